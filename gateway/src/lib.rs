//! `fairgate-gateway`: an Anthropic-compatible gateway a team runs in front of the Anthropic
//! API for its services in any language. Clients point their SDK's base URL at it and use
//! a key from `keys.toml`; the gateway admits their calls fairly (the four fairgate layers)
//! and calls the API with the team's upstream key (`--upstream`), or through a pool of
//! upstreams listed in the keys file (`[[upstreams]]`: keys, workspaces, Bedrock).
//!
//! ```sh
//! cargo install --locked --path gateway
//! ANTHROPIC_API_KEY=sk-ant-... fairgate-gateway --listen 127.0.0.1:8080 \
//!     --upstream https://api.anthropic.com --keys keys.toml [--redis redis://127.0.0.1:6379/]
//! ```
//!
//! Every flag can also come from the environment (`fairgate-gateway --help` names the
//! variables). The modules, each using only those above it:
//! - `body`, `own_answer`: what every answer is made of; the gateway's own answers marked
//!   (`request-id`, Anthropic's error shape, `529 Overloaded`);
//! - `server`: connections (cap, header / body / keep-alive timeouts, drain);
//! - `ledger`: what the gateway saw, written by the proxy and read by the admin side: each
//!   tenant's usage (`/usage`), the calls aloft, `--record`'s JSON lines;
//! - `admission`: who may call and at what cost: the key check (`auth`), end users and
//!   origins (`identity`), what each key holder may hold at once (`holders`), a call's
//!   estimated and settled cost (`cost`);
//! - `config`: the keys file, checked in full at start and on `SIGHUP` (its
//!   `[[upstreams]]` too);
//! - `proxy`: the API port: canonical routes, the handlers, answers relayed through a
//!   bounded buffer, the upstreams as one pool (HTTP/1.1 and HTTP/2), message batches kept
//!   to their owner;
//! - `admin`: the admin listener (`/metrics`, `/healthz`, `/readyz`, `/status`, `/usage`,
//!   the live page `/` and its numbers `/live`), the Prometheus recorder, OTLP export;
//! - `cli`, `run`: the command line, and the gateway from start to drain.

#[cfg(not(target_env = "msvc"))]
mod allocator;

mod body;
mod own_answer;

mod server;

mod ledger;

mod admission;

mod config;

mod proxy;

mod admin;

mod cli;
mod run;

pub use run::main;
