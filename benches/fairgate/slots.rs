//! TierSlotLimit: take and give back one slot per request.
//! Memory store vs tower's `GlobalConcurrencyLimitLayer`; Redis store vs the same two Lua
//! scripts sent raw on the same server (the ceiling: two round trips per slot).

use std::convert::Infallible;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput};
use fairgate::{Job, Origin, SlotPolicy, Store, TierSlotLimitLayer};
use tower::limit::GlobalConcurrencyLimitLayer;
use tower::{Layer, Service, ServiceExt, service_fn};

use crate::classify::{redis_store, runtime};

fn request() -> http::Request<()> {
    let mut req = http::Request::new(());
    req.extensions_mut()
        .insert(Job::new("tenant", Origin::UserAction).with_tier("pro"));
    req
}

fn upstream()
-> impl Service<http::Request<()>, Response = http::Response<()>, Error = Infallible, Future: Send>
+ Clone
+ Send
+ 'static {
    service_fn(|_: http::Request<()>| async { Ok::<_, Infallible>(http::Response::new(())) })
}

async fn one<S>(service: &S)
where
    S: Service<http::Request<()>> + Clone,
    S::Error: std::fmt::Debug,
{
    let response = service.clone().oneshot(request()).await.expect("a slot");
    drop(response); // gives the slot back
}

pub(crate) fn bench(c: &mut Criterion) {
    let rt = runtime();
    let mut group = c.benchmark_group("tier_slot_limit");
    group.throughput(Throughput::Elements(1));

    let baseline = GlobalConcurrencyLimitLayer::new(30).layer(upstream());
    group.bench_function(
        BenchmarkId::new("baseline", "tower_global_concurrency_limit"),
        |b| {
            b.to_async(&rt).iter(|| one(&baseline));
        },
    );

    let memory = TierSlotLimitLayer::new(Store::memory(), SlotPolicy::default()).layer(upstream());
    group.bench_function(BenchmarkId::new("slot", "memory"), |b| {
        b.to_async(&rt).iter(|| one(&memory));
    });

    if let Some(store) = redis_store(&rt) {
        let url = std::env::var("FAIRGATE_BENCH_REDIS")
            .unwrap_or_else(|_| "redis://127.0.0.1:6379/".into());
        let mut conn = rt
            .block_on(
                redis::Client::open(url.as_str())
                    .unwrap()
                    .get_multiplexed_async_connection(),
            )
            .unwrap();
        let acquire = redis::Script::new(include_str!("../../src/store/scripts/slot_acquire.lua"));
        let release = redis::Script::new(include_str!("../../src/store/scripts/slot_release.lua"));
        let (global, tier) = (
            "fairgate-bench-raw:{slots}:global",
            "fairgate-bench-raw:{slots}:tier:pro",
        );
        // The bookkeeping the acquire script checks: an epoch, and this worker's record in it.
        let (workers, epoch) = (
            "fairgate-bench-raw:{slots}:workers",
            "fairgate-bench-raw:{slots}:epoch",
        );
        rt.block_on(async {
            let mut conn = conn.clone();
            let _: () = redis::cmd("SET")
                .arg(epoch)
                .arg("bench")
                .query_async(&mut conn)
                .await
                .unwrap();
            let _: () = redis::cmd("ZADD")
                .arg(workers)
                .arg(u64::MAX >> 12)
                .arg("bench-worker")
                .query_async(&mut conn)
                .await
                .unwrap();
        });
        group.bench_function(
            BenchmarkId::new("baseline", "raw_evalsha_acquire_release"),
            |b| {
                b.to_async(&rt).iter(|| {
                    let mut conn = conn.clone();
                    let (acquire, release) = (&acquire, &release);
                    async move {
                        let (taken, _, _): (i64, u32, u32) = acquire
                            .key(global)
                            .key(tier)
                            .key(workers)
                            .key(epoch)
                            .arg(30)
                            .arg(20)
                            .arg(30_000)
                            .arg("lease")
                            .arg("bench-worker")
                            .arg("bench")
                            .invoke_async(&mut conn)
                            .await
                            .unwrap();
                        assert_eq!(taken, 1);
                        let _: u32 = release
                            .key(global)
                            .key(tier)
                            .arg("lease")
                            .arg("fairgate-bench-raw:{slots}:released")
                            .arg("PUBLISH")
                            .invoke_async(&mut conn)
                            .await
                            .unwrap();
                    }
                });
            },
        );
        let _ = rt.block_on(
            redis::cmd("DEL")
                .arg(global)
                .arg(tier)
                .arg(workers)
                .arg(epoch)
                .query_async::<()>(&mut conn),
        );

        let redis = TierSlotLimitLayer::new(store.clone(), SlotPolicy::default()).layer(upstream());
        group.bench_function(BenchmarkId::new("slot", "redis"), |b| {
            b.to_async(&rt).iter(|| async {
                one(&redis).await;
                // The release is a background round trip: let it land before the next take.
                tokio::task::yield_now().await;
            });
        });
        rt.block_on(async { tokio::time::sleep(Duration::from_millis(50)).await });
        drop(store);
    }
    group.finish();
}
