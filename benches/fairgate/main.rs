//! Criterion benchmarks: each layer against a baseline in the same run.
//!
//! `cargo bench --all-features --bench fairgate`; the Redis cases use the server at
//! `FAIRGATE_BENCH_REDIS` (default `redis://127.0.0.1:6379/`) and are skipped when it does
//! not answer; the cluster case (`redis_cluster/*`) the cluster at
//! `FAIRGATE_BENCH_REDIS_CLUSTER` (its node URLs, comma-separated), skipped when unset.

use criterion::{criterion_group, criterion_main};

mod classify;
mod cluster;
mod drr;
mod learned;
mod retry;
mod slots;
mod stack;

criterion_group!(
    benches,
    classify::bench,
    cluster::bench,
    drr::bench,
    slots::bench,
    retry::bench,
    learned::bench,
    stack::bench
);
criterion_main!(benches);
