//! TierSlotLimit on a Redis Cluster against one Redis node: take and give back one slot per
//! request, through the same layer and store code.
//!
//! The cluster case runs when `FAIRGATE_BENCH_REDIS_CLUSTER` lists the cluster's node URLs
//! (comma-separated); the node case uses `FAIRGATE_BENCH_REDIS` as the other benches do.

use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput};
use fairgate::{SlotPolicy, Store, TierSlotLimitLayer};
use tower::{Layer, Service, ServiceExt, service_fn};

use crate::classify::{redis_store, runtime};

fn request() -> http::Request<()> {
    let mut req = http::Request::new(());
    req.extensions_mut()
        .insert(fairgate::Job::new("tenant", fairgate::Origin::UserAction).with_tier("pro"));
    req
}

async fn one<S>(service: &S)
where
    S: Service<http::Request<()>> + Clone,
    S::Error: std::fmt::Debug,
{
    let response = service.clone().oneshot(request()).await.expect("a slot");
    drop(response); // gives the slot back (a background round trip)
    // Let the release land before the next take, as in `slots.rs`.
    tokio::task::yield_now().await;
}

fn cluster_store(rt: &tokio::runtime::Runtime) -> Option<Store> {
    let nodes = std::env::var("FAIRGATE_BENCH_REDIS_CLUSTER").ok()?;
    let store = rt
        .block_on(
            Store::builder()
                .key_prefix("fairgate-bench")
                .redis_cluster(nodes.split(',')),
        )
        .ok()?;
    if store.is_degraded() {
        eprintln!("no cluster at {nodes}: skipping the cluster bench");
        return None;
    }
    Some(store)
}

pub(crate) fn bench(c: &mut Criterion) {
    let rt = runtime();
    let mut group = c.benchmark_group("redis_cluster");
    group.throughput(Throughput::Elements(1));
    let upstream = service_fn(|_: http::Request<()>| async {
        Ok::<_, std::convert::Infallible>(http::Response::new(()))
    });
    for (name, store) in [("node", redis_store(&rt)), ("cluster", cluster_store(&rt))] {
        let Some(store) = store else { continue };
        let service = TierSlotLimitLayer::new(store.clone(), SlotPolicy::default()).layer(upstream);
        group.bench_function(BenchmarkId::new("acquire_release", name), |b| {
            b.to_async(&rt).iter(|| one(&service));
        });
        rt.block_on(async { tokio::time::sleep(Duration::from_millis(50)).await });
        assert!(
            !store.is_degraded(),
            "{name}: the store degraded during the bench"
        );
    }
    group.finish();
}
