//! RetryAfterBackoff's overhead on a call that succeeds the first time, against
//! `tower::retry::Retry` with an equivalent policy (429/529, 4 retries, a `TpsBudget`,
//! jittered backoff), memory and Redis stores.

use std::convert::Infallible;
use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput};
use fairgate::BackoffPolicy;
use fairgate::{Job, Origin, RetryAfterBackoffLayer, Store};
use tower::retry::budget::{Budget, TpsBudget};
use tower::retry::{Policy, RetryLayer};
use tower::{Layer, Service, ServiceExt, service_fn};

use crate::classify::redis_store;

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime")
}

pub(crate) fn request(i: u64) -> http::Request<String> {
    let mut req = http::Request::new(String::new());
    let job = Job::new(format!("tenant-{}", i % 100), Origin::UserAction).with_cost(800);
    req.extensions_mut().insert(job);
    req
}

pub(crate) fn upstream() -> impl Service<
    http::Request<String>,
    Response = http::Response<String>,
    Error = Infallible,
    Future: Send,
> + Clone {
    service_fn(|req: http::Request<String>| async move {
        black_box(req);
        Ok::<_, Infallible>(http::Response::new(String::new()))
    })
}

/// tower's retry with what this layer does on the same statuses: 429/529, at most 4
/// retries, a 10 s / 10 per s / 20% `TpsBudget`, 0.5 s backoff.
#[derive(Clone)]
pub(crate) struct Equivalent {
    budget: Arc<TpsBudget>,
    retries: u32,
}

impl Equivalent {
    pub(crate) fn new() -> Self {
        Equivalent {
            budget: Arc::new(TpsBudget::new(Duration::from_secs(10), 10, 0.2)),
            retries: 0,
        }
    }
}

impl<E> Policy<http::Request<String>, http::Response<String>, E> for Equivalent {
    type Future = tokio::time::Sleep;

    fn retry(
        &mut self,
        _req: &mut http::Request<String>,
        result: &mut Result<http::Response<String>, E>,
    ) -> Option<Self::Future> {
        match result {
            Ok(res) if matches!(res.status().as_u16(), 429 | 529) => {
                if self.retries >= 4 || !self.budget.withdraw() {
                    return None;
                }
                self.retries += 1;
                Some(tokio::time::sleep(
                    Duration::from_millis(500) * self.retries,
                ))
            }
            _ => {
                self.budget.deposit();
                None
            }
        }
    }

    fn clone_request(&mut self, req: &http::Request<String>) -> Option<http::Request<String>> {
        Some(req.clone())
    }
}

pub(crate) async fn drive<S>(service: &S, n: u64)
where
    S: Service<http::Request<String>> + Clone,
    S::Error: std::fmt::Debug,
{
    for i in 0..n {
        black_box(
            service
                .clone()
                .oneshot(request(i))
                .await
                .expect("the call succeeds"),
        );
    }
}

pub(crate) fn bench(c: &mut Criterion) {
    let rt = runtime();
    let mut group = c.benchmark_group("retry_after_backoff");
    group.throughput(Throughput::Elements(1));

    group.bench_function(BenchmarkId::new("baseline", "service_fn"), |b| {
        let service = upstream();
        b.to_async(&rt).iter(|| drive(&service, 1));
    });

    let tower_retry = RetryLayer::new(Equivalent::new()).layer(upstream());
    group.bench_function(BenchmarkId::new("tower_retry", "first_success"), |b| {
        b.to_async(&rt).iter(|| drive(&tower_retry, 1));
    });

    let memory =
        RetryAfterBackoffLayer::new(Store::memory(), BackoffPolicy::default()).layer(upstream());
    group.bench_function(BenchmarkId::new("retry_after_backoff", "memory"), |b| {
        b.to_async(&rt).iter(|| drive(&memory, 1));
    });

    if let Some(store) = redis_store(&rt) {
        // A first-time success reads the local gate copy only: no round trip.
        let redis = RetryAfterBackoffLayer::new(store, BackoffPolicy::default()).layer(upstream());
        group.bench_function(BenchmarkId::new("retry_after_backoff", "redis"), |b| {
            b.to_async(&rt).iter(|| drive(&redis, 1));
        });
    }
    group.finish();
}
