//! Learned pacing's cost per request in steady state: a call that succeeds, against an
//! upstream sending Anthropic's rate-limit headers on every answer (limits far above the
//! bench's rate, so no call waits), with learned pacing on versus off in the same run,
//! memory and Redis stores. On Redis a call must not be a round trip: the layer reserves a
//! quarter second of the learned rate at once (at most 64 calls) and sends what the headers
//! said with the next reservation. `learned_usage`: the upstream also reports an output
//! token limit and answers a body with its `usage`, which the caller reads to the end —
//! the body is scanned and each call's charge corrected; `learned_usage_off` is the same
//! with the correction off (the difference is the scan and the correction).

use std::convert::Infallible;
use std::hint::black_box;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use criterion::{BenchmarkId, Criterion, Throughput};
use fairgate::BackoffPolicy;
use fairgate::{RetryAfterBackoffLayer, Store};
use http_body_util::BodyExt;
use tower::{Layer, Service, ServiceExt, service_fn};

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

/// As [`upstream`], plus an output token limit (the largest believed, all left) and a body
/// with its `usage`: 1 or 2 output tokens, in turn, so corrections are not all zero.
fn upstream_with_usage() -> impl Service<
    http::Request<String>,
    Response = http::Response<String>,
    Error = Infallible,
    Future: Send,
> + Clone {
    let n = Arc::new(AtomicU64::new(0));
    service_fn(move |req: http::Request<String>| {
        let output = 1 + n.fetch_add(1, Ordering::Relaxed) % 2;
        async move {
            black_box(req);
            let body = format!(
                r#"{{"id":"msg_1","type":"message","role":"assistant","content":[{{"type":"text","text":"Hi"}}],"stop_reason":"end_turn","usage":{{"input_tokens":800,"output_tokens":{output}}}}}"#
            );
            let mut response = http::Response::new(body);
            let headers = response.headers_mut();
            for (name, value) in [
                ("anthropic-ratelimit-requests-limit", "60000000"),
                ("anthropic-ratelimit-requests-remaining", "60000000"),
                ("anthropic-ratelimit-output-tokens-limit", "1000000000"),
                ("anthropic-ratelimit-output-tokens-remaining", "1000000000"),
            ] {
                headers.insert(name, http::HeaderValue::from_static(value));
            }
            Ok::<_, Infallible>(response)
        }
    })
}

/// `n` calls, each answer's body read to its end.
async fn drive_bodies<S, B>(service: &S, n: u64)
where
    S: Service<http::Request<String>, Response = http::Response<B>> + Clone,
    S::Error: std::fmt::Debug,
    B: http_body::Body,
    B::Error: std::fmt::Debug,
{
    for i in 0..n {
        let response = service
            .clone()
            .oneshot(request(i))
            .await
            .expect("the call succeeds");
        black_box(response.into_body().collect().await.expect("the body"));
    }
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
        // Bodies with their usage, read to the end: corrected (the body scanned) or not.
        // Each its own upstream key: the limits learned above are not these.
        for (corrected, case) in [(false, "learned_usage_off"), (true, "learned_usage")] {
            let usage_policy = BackoffPolicy::builder()
                .upstream(case)
                .usage_correction(corrected)
                .build()
                .expect("a policy");
            let usage = RetryAfterBackoffLayer::new(store.clone(), usage_policy)
                .layer(upstream_with_usage());
            rt.block_on(drive_bodies(&usage, 10));
            group.bench_function(
                BenchmarkId::new(format!("{backend}/{case}"), "first_success"),
                |b| {
                    b.to_async(&rt).iter(|| drive_bodies(&usage, 1));
                },
            );
        }
    }
    let _ = request(0);
    group.finish();
}
