//! DrrFairness against tower's FIFO `ConcurrencyLimit` on the same inner service
//! (uncontended and contended), and the scheduler's pick cost as the number of waiting
//! tenants grows.

use std::convert::Infallible;
use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, Throughput};
use fairgate::drr_fairness::{Scheduler, SchedulerConfig};
use fairgate::{DrrFairnessLayer, Job, Origin, Priority, Store, TenantId};
use tower::limit::ConcurrencyLimitLayer;
use tower::{Layer, Service, ServiceExt, service_fn};

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime")
}

/// 100 tenants in rotation, as a busy worker sees them.
fn jobs() -> Vec<Job> {
    (0..100)
        .map(|i| Job::new(format!("tenant-{i}"), Origin::UserAction).with_cost(800))
        .collect()
}

fn request(job: &Job) -> http::Request<()> {
    let mut req = http::Request::new(());
    req.extensions_mut().insert(job.clone());
    req
}

/// Answers at once, or (contended) after yielding once, so requests pile up behind the
/// window.
fn upstream(
    yields: bool,
) -> impl Service<http::Request<()>, Response = (), Error = Infallible, Future: Send> + Clone {
    service_fn(move |req: http::Request<()>| async move {
        black_box(req);
        if yields {
            tokio::task::yield_now().await;
        }
        Ok::<_, Infallible>(())
    })
}

/// `n` requests, `concurrent` of them at a time.
async fn drive<S>(service: &S, jobs: &[Job], n: usize, concurrent: usize)
where
    S: Service<http::Request<()>> + Clone,
    S::Error: std::fmt::Debug,
{
    let mut sent = 0;
    while sent < n {
        let wave = concurrent.min(n - sent);
        let calls = (0..wave).map(|i| {
            service
                .clone()
                .oneshot(request(&jobs[(sent + i) % jobs.len()]))
        });
        for result in futures_util::future::join_all(calls).await {
            result.expect("the call succeeds");
        }
        sent += wave;
    }
}

fn dispatch(c: &mut Criterion) {
    let rt = runtime();
    let jobs = jobs();
    let mut group = c.benchmark_group("drr_dispatch");
    // (name, requests at once, window): uncontended = one at a time under a window of 32;
    // contended = 64 at once through a window of 4 (60 wait in the queue or the semaphore).
    for (case, concurrent, window) in [("uncontended", 1, 32), ("contended", 64, 4)] {
        let n = 256;
        group.throughput(Throughput::Elements(n as u64));
        let yields = concurrent > 1;
        let fifo = ConcurrencyLimitLayer::new(window).layer(upstream(yields));
        group.bench_function(BenchmarkId::new("concurrency_limit", case), |b| {
            b.iter(|| rt.block_on(drive(&fifo, &jobs, n, concurrent)));
        });
        let drr = DrrFairnessLayer::new(Store::memory(), window).layer(upstream(yields));
        group.bench_function(BenchmarkId::new("drr_fairness", case), |b| {
            b.iter(|| rt.block_on(drive(&drr, &jobs, n, concurrent)));
        });
    }
    group.finish();
}

fn backlog(tenants: &[TenantId], per_tenant: u64) -> Scheduler<u64> {
    let mut scheduler = Scheduler::new(SchedulerConfig::default()).expect("default config");
    for round in 0..per_tenant {
        for id in tenants {
            let _ = scheduler.push(Priority::Standard, id.clone(), 1, 2_000, round);
        }
    }
    scheduler
}

/// The pick itself: `pop` with `tenants` tenants waiting (refilled outside the timer), and
/// a steady state of one pop plus one push back (the push hashes the tenant's name into a
/// map of `tenants` entries).
fn pick(c: &mut Criterion) {
    let mut group = c.benchmark_group("drr_pick");
    group.throughput(Throughput::Elements(1));
    for tenants in [10usize, 1_000, 100_000] {
        let ids: Vec<TenantId> = (0..tenants)
            .map(|i| TenantId::new(format!("t{i}")))
            .collect();
        // Ten items per tenant (FAIRGATE_BENCH_DEPTH overrides; at least 4), and at most a
        // third popped per refill: every tenant stays backlogged, so every size does the same
        // work per pick (no tenant empties).
        let per_tenant = std::env::var("FAIRGATE_BENCH_DEPTH")
            .ok()
            .and_then(|depth| depth.parse::<u64>().ok())
            .map_or(10, |depth| depth.max(4));
        let mut scheduler = backlog(&ids, per_tenant);
        // Where the popped items wait for the refill: allocated and touched once, outside
        // the timed loops, so no sample pays for growing it.
        let mut popped = Vec::with_capacity(scheduler.len());
        for _ in 0..2 {
            let run = scheduler.len() / 3;
            popped.extend(std::iter::repeat_with(|| scheduler.pop()).take(run));
            for next in popped.drain(..).flatten() {
                let _ = scheduler.push(next.class, next.tenant, 1, 2_000, next.item);
            }
        }
        group.bench_with_input(BenchmarkId::new("pop", tenants), &tenants, |b, _| {
            b.iter_custom(|iters| {
                let mut total = std::time::Duration::ZERO;
                let mut left = iters;
                while left > 0 {
                    let run = left.min(scheduler.len() as u64 / 3);
                    let start = std::time::Instant::now();
                    for _ in 0..run {
                        popped.push(scheduler.pop());
                    }
                    total += start.elapsed();
                    left -= run;
                    // Untimed: the popped items arrive again, at the back of their tenants.
                    for next in popped.drain(..).flatten() {
                        let _ = scheduler.push(next.class, next.tenant, 1, 2_000, next.item);
                    }
                }
                total
            });
        });
        let mut scheduler = backlog(&ids, 2);
        group.bench_with_input(BenchmarkId::new("pop_push", tenants), &tenants, |b, _| {
            b.iter(|| {
                let next = scheduler.pop().expect("tenants are waiting");
                let _ = scheduler.push(next.class, next.tenant, 1, 2_000, next.item);
            });
        });
        // Each tenant with one request waiting: every pick empties a tenant and every push
        // brings one back, the churn of many light tenants.
        let mut scheduler = backlog(&ids, 1);
        group.bench_with_input(
            BenchmarkId::new("pop_push_one_each", tenants),
            &tenants,
            |b, _| {
                b.iter(|| {
                    let next = scheduler.pop().expect("tenants are waiting");
                    let _ = scheduler.push(next.class, next.tenant, 1, 2_000, next.item);
                });
            },
        );
    }
    group.finish();
}

pub(crate) fn bench(c: &mut Criterion) {
    dispatch(c);
    pick(c);
}
