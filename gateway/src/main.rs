//! `fairgate-gateway`: an Anthropic-compatible gateway with fair, tier-aware admission
//! control (the crate's library says how it works).

fn main() {
    fairgate_gateway::main();
}
