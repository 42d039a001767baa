//! The tests on the in-memory store: each layer alone, the whole stack, the stack under a
//! provider's rate, its model-based check and the adapters.
//!
//! Most run in tokio's paused time. Those that run in real time (the adapters and the
//! tonic stack on loopback sockets, and the few that repeat a rule on a throwaway Redis)
//! take their file's turn first ([`support::file_turn`]), so they never run beside another
//! file's real-time tests.
//!
//! Run one file's tests with `cargo test --all-features --test memory stack_rate::`.

#[path = "../support/mod.rs"]
mod support;

mod adapters;
mod dashboard;
mod drr_fairness;
mod learned_pacing;
mod one_turn;
mod pool;
mod pool_rate;
mod priority_classify;
mod retry_after_backoff;
mod stack;
mod stack_model;
mod stack_rate;
mod tier_slot_limit;
#[cfg(feature = "tonic")]
mod tonic;
mod trace;
