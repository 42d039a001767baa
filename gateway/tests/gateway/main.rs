//! The gateway program (`fairgate-gateway`) end to end, as a real process on loopback
//! ports: its calls and clients (`proxy`), the attacks on it (`attacks`), batches kept to
//! their owner (`batches`), what a call costs (`cost`), what a newcomer meets first
//! (`first_hour`: the quickstart, logs, metrics, the gateway's own answers), what one key
//! holder cannot take from the others (`isolation`), the Grafana dashboard's queries in a
//! real Prometheus (`dashboard`), its keys, admin token and start
//! without Redis (`keys`), its live page (`page`), its pool of upstreams (`pool`), its rate under a provider's limit
//! (`rate`), its record of calls (`record`), its traces over OTLP (`traces`) and what each
//! tenant used, for billing (`usage`).
//!
//! Every test takes its file's turn first ([`support::file_turn`]): the tests of one file
//! run beside each other (most keep apart from each other too, by a lock of the file's
//! own), those of two files never at once.
//!
//! Run one file's tests with `cargo test -p fairgate-gateway --test gateway attacks::`.

// The helpers the library's tests use too, and the gateway's own (`support/gateway.rs`).
#[path = "../../../tests/support/mod.rs"]
mod shared_support;
mod support {
    pub use super::shared_support::*;
    pub mod gateway;
}

mod attacks;
mod batches;
mod bedrock;
mod cost;
mod dashboard;
mod first_hour;
mod isolation;
mod keys;
mod page;
mod pool;
mod proxy;
mod rate;
mod record;
mod traces;
mod turns;
mod usage;
mod users;
