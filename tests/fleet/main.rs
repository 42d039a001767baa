//! A fleet of workers on Redis, measured in real time: worker processes (the
//! `slot_worker` example) through Redis faults and outages, and against each other
//! (`faults`, `processes`); workers in one process sharing the fleet's order and its
//! wake-ups (`order`, `wakeups`).
//!
//! Every test takes its file's turn first ([`support::file_turn`]): the tests of one file
//! run beside each other (most keep apart from each other too, by a lock of the file's
//! own), those of two files never at once.
//!
//! Run one file's tests with `cargo test --all-features --test fleet faults::`. The default
//! run keeps one test of each promise on one Redis and four workers; the fault runs, the
//! cluster and sixteen-worker variants and the other limits are `#[ignore = "long: ..."]`,
//! run by `bash scripts/test --long` (and CI).
#![cfg(feature = "redis")]

#[path = "../support/mod.rs"]
mod support;

mod faults;
mod order;
mod processes;
mod wakeups;
