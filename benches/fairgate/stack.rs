//! The whole recommended stack against the tower baseline doing less: one request through
//! PriorityClassify + RetryAfterBackoff + DrrFairness + TierSlotLimit (memory store) vs
//! `ConcurrencyLimit` + `Retry` with an equivalent retry policy.

use criterion::{BenchmarkId, Criterion, Throughput};
use fairgate::{
    BackoffPolicy, DrrFairnessLayer, PriorityClassifyLayer, RetryAfterBackoffLayer, SlotPolicy,
    Store, TierSlotLimitLayer,
};
use tower::ServiceBuilder;
use tower::retry::RetryLayer;

use crate::classify::runtime;
use crate::retry::{Equivalent, drive, upstream};

pub(crate) fn bench(c: &mut Criterion) {
    let rt = runtime();
    let mut group = c.benchmark_group("stack");
    group.throughput(Throughput::Elements(1));

    let baseline = ServiceBuilder::new()
        .concurrency_limit(32)
        .layer(RetryLayer::new(Equivalent::new()))
        .service(upstream());
    group.bench_function(
        BenchmarkId::new("baseline", "concurrency_limit_and_retry"),
        |b| {
            b.to_async(&rt).iter(|| drive(&baseline, 1));
        },
    );

    let store = Store::memory();
    // The recommended stack, wired as `FairgateLayer` wires it.
    let slots = TierSlotLimitLayer::new(store.clone(), SlotPolicy::default());
    let (retry, rate) =
        RetryAfterBackoffLayer::new(store.clone(), BackoffPolicy::default()).with_gate_below();
    let fair = DrrFairnessLayer::builder(store.clone(), 32)
        .slot_gate(slots.gate())
        .rate_gate(rate)
        .build()
        .expect("a valid window");
    let fairgate = ServiceBuilder::new()
        .layer(PriorityClassifyLayer::new(store))
        .layer(retry)
        .layer(fair)
        .layer(slots)
        .service(upstream());
    group.bench_function(BenchmarkId::new("fairgate", "memory"), |b| {
        b.to_async(&rt).iter(|| drive(&fairgate, 1));
    });
    group.finish();
}
