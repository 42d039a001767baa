//! The gateway program (`fairgate-gateway`) end to end, as a real process on loopback
//! ports: its calls and clients (`proxy`), the attacks on it (`attacks`), its live page
//! (`page`), its rate under a provider's limit (`rate`), its record of calls (`record`)
//! and its keys, admin token and start without Redis (`keys`).
//!
//! Every test takes its file's turn first ([`support::file_turn`]): the tests of one file
//! run beside each other (most keep apart from each other too, by a lock of the file's
//! own), those of two files never at once.
//!
//! Run one file's tests with `cargo test --all-features --test gateway attacks::`.

#[path = "../support/mod.rs"]
mod support;

mod attacks;
mod keys;
mod page;
mod proxy;
mod rate;
mod record;
