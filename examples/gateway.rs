//! The gateway under its first name: the `fairgate-gateway` program
//! (`src/bin/fairgate-gateway/`), built as an example so that
//! `cargo run --release --all-features --example gateway -- --listen ... --upstream ... --keys keys.toml`
//! keeps working. Install the program itself with `cargo install --locked --path . --features gateway`.

#[path = "../src/bin/fairgate-gateway/main.rs"]
mod gateway;

fn main() {
    gateway::main();
}
