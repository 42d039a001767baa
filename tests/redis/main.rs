//! The tests on Redis, in real time: the store on one node and on a Redis Cluster (over
//! TLS: `tests/redis_tls.rs`); the slot and tenant caps, the stack and the stack under a
//! provider's rate shared by workers on one Redis. Each starts its own throwaway `redis-server`s (never the one on
//! 6379); the tests that only use their own keys share one cluster by key prefix.
//!
//! Every test takes its file's turn first ([`support::file_turn`]): the tests of one file
//! run beside each other, those of two files never at once.
//!
//! Run one file's tests with `cargo test --all-features --test redis store_redis::`.
#![cfg(feature = "redis")]

#[path = "../support/mod.rs"]
mod support;

mod cluster;
mod pool_rate_redis;
mod stack_rate_redis;
mod stack_redis;
mod store_redis;
mod tenant_caps_redis;
mod tier_slot_limit_redis;
