//! PriorityClassify's overhead over a bare `service_fn`, memory and Redis stores.

use std::convert::Infallible;
use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, Throughput};
use fairgate::{Job, Origin, PriorityClassifyLayer, Store};
use tower::{Layer, Service, ServiceExt, service_fn};

pub(crate) fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime")
}

fn request(i: u64) -> http::Request<()> {
    let mut req = http::Request::new(());
    // 100 tenants in rotation, as a busy worker sees them.
    let job = Job::new(format!("tenant-{}", i % 100), Origin::UserAction).with_cost(800);
    req.extensions_mut().insert(job);
    req
}

fn upstream()
-> impl Service<http::Request<()>, Response = (), Error = Infallible, Future: Send> + Clone {
    service_fn(|req: http::Request<()>| async move {
        black_box(req);
        Ok::<_, Infallible>(())
    })
}

async fn drive<S>(service: &S, n: u64)
where
    S: Service<http::Request<()>> + Clone,
    S::Error: std::fmt::Debug,
{
    for i in 0..n {
        service
            .clone()
            .oneshot(request(i))
            .await
            .expect("the call succeeds");
    }
}

/// The Redis store the benches use, if one answers.
pub(crate) fn redis_store(rt: &tokio::runtime::Runtime) -> Option<Store> {
    let url =
        std::env::var("FAIRGATE_BENCH_REDIS").unwrap_or_else(|_| "redis://127.0.0.1:6379/".into());
    let store = rt
        .block_on(Store::builder().key_prefix("fairgate-bench").redis(&url))
        .ok()?;
    if store.is_degraded() {
        eprintln!("no redis at {url}: skipping the redis benches");
        return None;
    }
    Some(store)
}

pub(crate) fn bench(c: &mut Criterion) {
    let rt = runtime();
    let mut group = c.benchmark_group("priority_classify");
    group.throughput(Throughput::Elements(1));

    group.bench_function(BenchmarkId::new("baseline", "service_fn"), |b| {
        let service = upstream();
        b.to_async(&rt).iter(|| drive(&service, 1));
    });

    let memory = PriorityClassifyLayer::new(Store::memory()).layer(upstream());
    group.bench_function(BenchmarkId::new("classify", "memory"), |b| {
        b.to_async(&rt).iter(|| drive(&memory, 1));
    });

    if let Some(store) = redis_store(&rt) {
        // Steady state: every tenant's demotion check is cached (1 s), so no round trip.
        let redis = PriorityClassifyLayer::new(store).layer(upstream());
        rt.block_on(drive(&redis, 100));
        group.bench_function(BenchmarkId::new("classify", "redis"), |b| {
            b.to_async(&rt).iter(|| drive(&redis, 1));
        });
    }
    group.finish();
}
