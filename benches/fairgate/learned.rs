//! Learned pacing's cost per request in steady state: a call that succeeds, against an
//! upstream sending Anthropic's rate-limit headers on every answer (limits far above the
//! bench's rate, so no call waits), with learned pacing on versus off in the same run,
//! memory and Redis stores. On Redis a call must not be a round trip: the layer reserves a
//! quarter second of the learned rate at once (at most 64 calls) and sends what the headers
//! said with the next reservation.

use std::convert::Infallible;
use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, Throughput};
use fairgate::retry_after_backoff::BackoffPolicy;
use fairgate::{RetryAfterBackoffLayer, Store};
use tower::{Layer, Service, service_fn};

use crate::classify::redis_store;
use crate::retry::{drive, request};

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime")
}

/// An upstream answering 200 with the provider's request headers: 60 M a minute, all left.
fn upstream() -> impl Service<
    http::Request<String>,
    Response = http::Response<String>,
    Error = Infallible,
    Future: Send,
> + Clone {
    service_fn(|req: http::Request<String>| async move {
        black_box(req);
        let mut response = http::Response::new(String::new());
        let headers = response.headers_mut();
        // Requests only: the pacer counts microseconds, so a token limit cannot pace more
        // than 60 M tokens a minute, which this loop (800 tokens a call) would exceed.
        headers.insert(
            "anthropic-ratelimit-requests-limit",
            http::HeaderValue::from_static("60000000"),
        );
        headers.insert(
            "anthropic-ratelimit-requests-remaining",
            http::HeaderValue::from_static("60000000"),
        );
        Ok::<_, Infallible>(response)
    })
}

fn policy(learned: bool) -> BackoffPolicy {
    BackoffPolicy::builder()
        .learned_pacing(learned)
        .build()
        .expect("a policy")
}

pub(crate) fn bench(c: &mut Criterion) {
    let rt = runtime();
    let mut group = c.benchmark_group("learned_pacing");
    group.throughput(Throughput::Elements(1));

    let mut stores = vec![("memory", Store::memory())];
    if let Some(store) = redis_store(&rt) {
        stores.push(("redis", store));
    }
    for (backend, store) in stores {
        let off = RetryAfterBackoffLayer::new(store.clone(), policy(false)).layer(upstream());
        group.bench_function(
            BenchmarkId::new(format!("{backend}/off"), "first_success"),
            |b| {
                b.to_async(&rt).iter(|| drive(&off, 1));
            },
        );
        let on = RetryAfterBackoffLayer::new(store.clone(), policy(true)).layer(upstream());
        // Past the cold start: the limits are learned.
        rt.block_on(drive(&on, 10));
        group.bench_function(
            BenchmarkId::new(format!("{backend}/learned"), "first_success"),
            |b| {
                b.to_async(&rt).iter(|| drive(&on, 1));
            },
        );
    }
    let _ = request(0);
    group.finish();
}
