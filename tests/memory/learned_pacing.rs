//! Learned pacing (issue 12): against a mock upstream that behaves like Anthropic's rate
//! limiter, with `BackoffPolicy::default()` and no configured pacing, the fleet learns the
//! limits from the headers, paces to them, recovers at full speed, keeps the lone-retry band,
//! scopes gates per upstream key and survives hostile headers.

use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fairgate::BackoffPolicy;
use fairgate::rate::ByApiKey;
use fairgate::{FairgateLayer, Job, Origin, RetryAfterBackoffLayer, Store};
use http_body_util::BodyExt;
use tokio::time::Instant;
use tower::{Layer, ServiceExt, service_fn};

use crate::support::rate_limited::{RateLimited, TrueUsage};

type Response = http::Response<String>;

/// The mock provider (`support::rate_limited`), `rpm` requests, `itpm` input and `otpm`
/// output tokens a minute, answering in `latency`; a 429 carries the headers as they were
/// when the call was refused.
fn anthropic(rpm: u32, itpm: u32, otpm: u32, latency: Duration) -> RateLimited {
    RateLimited::with_limits(rpm, itpm, otpm, latency).refusal_headers_at_arrival()
}

fn respond(code: u16, headers: &[(String, String)]) -> Response {
    let mut builder = http::Response::builder().status(code);
    for (name, value) in headers {
        builder = builder.header(name.as_str(), value.as_str());
    }
    builder.body("{}".to_owned()).unwrap()
}

fn request(tenant: &str, cost: u32) -> http::Request<String> {
    let mut req = http::Request::new("{}".to_owned());
    req.extensions_mut().insert(
        Job::new(tenant, Origin::Scheduled)
            .with_sla(Duration::from_secs(3600))
            .with_cost(cost),
    );
    req
}

fn policy(seed: u64) -> BackoffPolicy {
    BackoffPolicy::builder().seed(seed).build().unwrap()
}

/// `workers` layers on `store` (one per worker), `callers` tasks each, `jobs` calls each.
async fn storm(provider: &RateLimited, stores: &[Store], callers: usize, jobs: usize) {
    let mut tasks = Vec::new();
    for (worker, store) in stores.iter().enumerate() {
        let layer = RetryAfterBackoffLayer::new(store.clone(), policy(worker as u64));
        for caller in 0..callers {
            let service = layer.layer(provider.service());
            tasks.push(tokio::spawn(async move {
                for _ in 0..jobs {
                    let tenant = format!("w{worker}-c{caller}");
                    service
                        .clone()
                        .oneshot(request(&tenant, 500))
                        .await
                        .unwrap();
                }
            }));
        }
    }
    for task in tasks {
        task.await.unwrap();
    }
}

#[tokio::test(start_paused = true)]
async fn a_storm_of_eight_workers_stays_under_2_percent_429_at_the_providers_rate() {
    // The storm: 8 workers x 20 callers x 3 jobs, a 50 RPM / 40,000 ITPM / 8,000
    // OTPM upstream, BackoffPolicy::default() and no configured pacing.
    let provider = anthropic(50, 40_000, 8_000, Duration::from_millis(50));
    let store = Store::memory();
    let stores = vec![store.clone(); 8];
    storm(&provider, &stores, 20, 3).await;
    let (share, all, throttled) = provider.share_429();
    let rpm = provider.throughput_rpm();
    println!(
        "learned pacing storm (memory, 8 workers): {:.2}% of {all} attempts answered 429 \
         ({throttled}); {rpm:.1} successes per minute against a 50 RPM limit",
        share * 100.0
    );
    assert_eq!(provider.served(), 480);
    assert!(share <= 0.02, "{:.2}% answered 429", share * 100.0);
    assert!((45.0..=55.0).contains(&rpm), "{rpm} RPM");
    let learned = store.learned_limits("default").await;
    assert_eq!(learned.requests, Some(50));
    assert_eq!(learned.input_tokens, Some(40_000));
    assert_eq!(learned.output_tokens, Some(8_000));
}

/// Two workers (store handles) on one throwaway Redis, which lives as long as the server.
#[cfg(feature = "redis")]
async fn two_workers() -> (crate::support::RedisServer, [Store; 2]) {
    let server = crate::support::RedisServer::start();
    let url = server.url();
    let connect = || Store::builder().redis(&url);
    let stores = [connect().await.unwrap(), connect().await.unwrap()];
    (server, stores)
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_storm_of_two_workers_on_one_redis_stays_under_2_percent_429_at_the_providers_rate() {
    let _turn = crate::support::file_turn(module_path!());
    let server = crate::support::RedisServer::start();
    let url = server.url();
    let connect = || Store::builder().redis(&url);
    // Real time, scaled: 1,200 RPM (20 a second).
    let provider = anthropic(1_200, 10_000_000, 10_000_000, Duration::from_millis(20));
    let stores = vec![connect().await.unwrap(), connect().await.unwrap()];
    storm(&provider, &stores, 10, 8).await;
    let (share, all, throttled) = provider.share_429();
    let rpm = provider.throughput_rpm();
    println!(
        "learned pacing storm (redis, 2 workers): {:.2}% of {all} attempts answered 429 \
         ({throttled}); {rpm:.0} successes per minute against a 1,200 RPM limit",
        share * 100.0
    );
    assert_eq!(provider.served(), 160);
    {
        let served = provider.served_at();
        let first = served[0];
        let mut per = vec![0; 60];
        for t in &served {
            per[((*t - first).as_secs_f64() * 2.0) as usize] += 1;
        }
        println!("served per half second: {per:?}");
    }
    assert!(share <= 0.02, "{:.2}% answered 429", share * 100.0);
    assert!((1_080.0..=1_320.0).contains(&rpm), "{rpm} RPM");
    // A worker that starts later starts informed.
    let late = connect().await.unwrap();
    assert_eq!(late.learned_limits("default").await.requests, Some(1_200));
}

#[tokio::test(start_paused = true)]
async fn the_pacer_follows_a_limit_that_changes_mid_run() {
    let provider = anthropic(50, 1_000_000, 1_000_000, Duration::from_millis(50));
    let store = Store::memory();
    let minute = Duration::from_secs(60);
    let start = Instant::now();
    let end = start + minute * 9;
    let mut tasks = Vec::new();
    for worker in 0..4u64 {
        let layer = RetryAfterBackoffLayer::new(store.clone(), policy(worker));
        for caller in 0..10 {
            let service = layer.layer(provider.service());
            tasks.push(tokio::spawn(async move {
                while Instant::now() < end {
                    let tenant = format!("w{worker}-c{caller}");
                    service.clone().oneshot(request(&tenant, 10)).await.unwrap();
                }
            }));
        }
    }
    // 50 RPM for 3 minutes, 20 for 3, 50 again for 3; count the answers served after each
    // change until the store holds the new limit.
    let mut followed = Vec::new();
    for (at, rpm) in [(3u32, 20u32), (6, 50)] {
        tokio::time::sleep_until(start + minute * at).await;
        provider.set_rpm(rpm);
        let attempts = provider.attempts();
        let give_up = Instant::now() + minute;
        while store.learned_limits("default").await.requests != Some(rpm) {
            assert!(Instant::now() < give_up, "the store never held {rpm} RPM");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        followed.push(provider.attempts() - attempts);
    }
    for task in tasks {
        task.await.unwrap();
    }
    let (share, all, throttled) = provider.share_429();
    println!(
        "limit 50 -> 20 -> 50 RPM: {:.2}% of {all} attempts answered 429 ({throttled}); \
         the store held the new limit after {followed:?} answers",
        share * 100.0
    );
    // Under 5%, and in fact under 1%: a call waiting for cells reserved under the old
    // limit asks again when the new one is learned (without that: 2.5%).
    assert!(share < 0.01, "{:.2}% answered 429", share * 100.0);
    assert!(followed.iter().all(|n| *n <= 3), "{followed:?}");
}

/// Output-heavy calls whose jobs estimate a tenth of their input and nothing of their
/// output (1,000 input and 1,000 output tokens each, estimated 100), half of them streamed,
/// against 600 RPM / 100,000 ITPM / 20,000 OTPM: the output limit binds (20 calls a
/// minute). 4 workers x 5 callers x 6 calls, each caller reading its answers' bodies.
/// Returns the share of attempts answered 429, attempts, throttles, and calls served.
async fn output_heavy(usage_correction: bool) -> (f64, u64, u64, usize) {
    let provider = anthropic(600, 100_000, 20_000, Duration::from_millis(200));
    let store = Store::memory();
    let mut tasks = Vec::new();
    for worker in 0..4u64 {
        let policy = BackoffPolicy::builder()
            .seed(worker)
            .usage_correction(usage_correction)
            .build()
            .unwrap();
        let layer = RetryAfterBackoffLayer::new(store.clone(), policy);
        for caller in 0..5 {
            let service = layer.layer(provider.service());
            tasks.push(tokio::spawn(async move {
                for job in 0..6 {
                    let mut req = request(&format!("w{worker}-c{caller}"), 100);
                    req.extensions_mut().insert(TrueUsage {
                        input: 1_000,
                        output: 1_000,
                        stream: job % 2 == 1,
                    });
                    let response = service.clone().oneshot(req).await.unwrap();
                    let status = response.status();
                    let body = response.into_body().collect().await.unwrap().to_bytes();
                    assert!(status != 200 || body.len() > 2, "a success with its usage");
                }
            }));
        }
    }
    for task in tasks {
        task.await.unwrap();
    }
    let (share, attempts, throttled) = provider.share_429();
    (share, attempts, throttled, provider.served())
}

#[tokio::test(start_paused = true)]
async fn token_charges_corrected_from_the_usage_keep_429s_under_2_percent() {
    let (corrected, all, throttled, served) = output_heavy(true).await;
    let (estimated, all_off, throttled_off, served_off) = output_heavy(false).await;
    println!(
        "output-heavy calls estimated 10x low: {:.2}% of {all} attempts answered 429 \
         ({throttled}), {served} of 120 served, with the usage correction; {:.2}% of \
         {all_off} ({throttled_off}), {served_off} served, without",
        corrected * 100.0,
        estimated * 100.0
    );
    assert!(corrected <= 0.02, "{:.2}% answered 429", corrected * 100.0);
    assert_eq!(served, 120, "every call served with the correction");
    assert!(
        estimated > 0.02 && estimated > 2.0 * corrected,
        "without the correction: {:.2}%",
        estimated * 100.0
    );
}

#[tokio::test(start_paused = true)]
async fn tokens_another_client_spent_are_read_from_remaining() {
    // 40,000 input tokens a minute, 2,000 a call (estimated right). Five times, after a
    // quiet minute, another client on the same key spends 35,000 of them at once (unseen
    // but in every answer's `-remaining`), then 2 callers send 4 calls each: the first
    // answers say what is left, and the rest wait for it instead of running into 429s.
    let provider = anthropic(1_000, 40_000, 1_000_000, Duration::from_millis(50));
    let layer = RetryAfterBackoffLayer::new(Store::memory(), policy(9));
    let service = layer.layer(provider.service());
    service
        .clone()
        .oneshot(request("warm-up", 2_000))
        .await
        .unwrap();
    for round in 0..5 {
        tokio::time::sleep(Duration::from_secs(60)).await;
        provider.take_outside(35_000.0);
        let callers = (0..2).map(|caller| {
            let service = service.clone();
            async move {
                for _ in 0..4 {
                    let tenant = format!("r{round}-c{caller}");
                    service
                        .clone()
                        .oneshot(request(&tenant, 2_000))
                        .await
                        .unwrap();
                }
            }
        });
        futures_util::future::join_all(callers).await;
    }
    let (share, all, throttled) = provider.share_429();
    println!(
        "another client spends 35,000 of 40,000 tokens before each round: {:.2}% of {all} \
         attempts answered 429 ({throttled})",
        share * 100.0
    );
    assert!(share <= 0.05, "{:.2}% answered 429", share * 100.0);
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pacer_follows_a_limit_that_changes_mid_run_on_two_workers_on_one_redis() {
    let _turn = crate::support::file_turn(module_path!());
    // Real time, scaled: 1,200 RPM (20 a second), then 480 (8 a second), then 1,200 again,
    // 2.5 s each after 1.5 s of warm-up (slow start and the first reservations); two
    // workers sharing one throwaway Redis, 10 callers each.
    let (_server, stores) = two_workers().await;
    let provider = anthropic(1_200, 10_000_000, 10_000_000, Duration::from_millis(20));
    let phase = Duration::from_millis(2_500);
    let start = Instant::now() + Duration::from_millis(1_500);
    let end = start + phase * 3;
    let mut tasks = Vec::new();
    for (worker, store) in stores.iter().enumerate() {
        let layer = RetryAfterBackoffLayer::new(store.clone(), policy(worker as u64));
        for caller in 0..10 {
            let service = layer.layer(provider.service());
            tasks.push(tokio::spawn(async move {
                while Instant::now() < end {
                    let tenant = format!("w{worker}-c{caller}");
                    service.clone().oneshot(request(&tenant, 10)).await.unwrap();
                }
            }));
        }
    }
    // After each change, the answers given, and the time, until the store holds the new
    // limit.
    let answered = |p: &RateLimited| p.served() + p.throttled();
    let mut followed = Vec::new();
    for (at, rpm) in [(1u32, 480u32), (2, 1_200)] {
        tokio::time::sleep_until(start + phase * at).await;
        provider.set_rpm(rpm);
        let (before, changed) = (answered(&provider), Instant::now());
        while stores[0].learned_limits("default").await.requests != Some(rpm) {
            assert!(changed.elapsed() < phase, "the store never held {rpm} RPM");
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        followed.push((answered(&provider) - before, changed.elapsed()));
        if rpm == 480 {
            // Until the next change the store keeps the new limit: headers a worker queued
            // for its next reservation before the change never put the old one back.
            let mut old = 0;
            while Instant::now() + Duration::from_millis(100) < start + phase * (at + 1) {
                if stores[0].learned_limits("default").await.requests != Some(rpm) {
                    old += 1;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            assert_eq!(old, 0, "the old limit came back {old} times");
        }
    }
    for task in tasks {
        task.await.unwrap();
    }
    let (share, all, throttled) = provider.share_429();
    // Successes a second in each phase, from a second after its change (the calls already
    // reserved at the old rate have gone by then).
    let rates: Vec<f64> = {
        let served = provider.served_at();
        (0..3u32)
            .map(|i| {
                let from = start + phase * i + Duration::from_secs(1);
                let to = start + phase * (i + 1);
                let n = served.iter().filter(|t| **t >= from && **t < to).count();
                n as f64 / (to - from).as_secs_f64()
            })
            .collect()
    };
    println!(
        "limit 1,200 -> 480 -> 1,200 RPM on one Redis, 2 workers: {:.2}% of {all} attempts \
         answered 429 ({throttled}); the store held the new limit after {followed:?} \
         (answers, time); {rates:.1?} successes a second per phase (limits 20, 8, 20)",
        share * 100.0
    );
    assert!(share < 0.05, "{:.2}% answered 429", share * 100.0);
    // The first answer after the change teaches it. Counted in answers that can be up to
    // a dozen: on Redis a worker spends the cells it reserved ahead in blocks, so the
    // answers of calls sent just before the change come back together; in time, it is
    // the gap to the next answer plus a round trip.
    assert!(
        followed
            .iter()
            .all(|(n, took)| *n <= 12 && *took <= Duration::from_millis(300)),
        "{followed:?}"
    );
    // The pacer follows: the low phase at 0.95 of its limit, give or take the one second
    // of burst the pacer allows (7 calls, over a 1.5 s window), the high ones well above it
    // (bursty over 1.5 s, for the same reason).
    assert!(
        (5.5..=10.5).contains(&rates[1]),
        "{:.1} a second against 8",
        rates[1]
    );
    for rate in [rates[0], rates[2]] {
        assert!(
            (10.0..=40.0).contains(&rate),
            "{rate:.1} a second against 20"
        );
    }
}

/// 400 requests through the whole stack against an upstream answering in 1 s, with
/// `share` of the calls answered 429 (`retry-after: 1`) at random; the time they took.
async fn through_the_stack(share: f64) -> Duration {
    let provider = anthropic(
        1_000_000,
        1_000_000_000,
        1_000_000_000,
        Duration::from_secs(1),
    )
    .with_random_429(share);
    let fairgate = FairgateLayer::builder(Store::memory())
        .backoff(policy(3))
        .build()
        .unwrap();
    let service = fairgate.layer(provider.service());
    let start = Instant::now();
    let calls: Vec<_> = (0..400)
        .map(|i| {
            let service = service.clone();
            tokio::spawn(async move {
                let mut req = request(&format!("t{}", i % 10), 100);
                let job = req
                    .extensions()
                    .get::<Job>()
                    .unwrap()
                    .clone()
                    .with_tier("premium");
                req.extensions_mut().insert(job);
                let response = service.oneshot(req).await;
                response.unwrap().status()
            })
        })
        .collect();
    let mut ok = 0;
    for call in calls {
        if call.await.unwrap() == 200 {
            ok += 1;
        }
    }
    assert!(ok >= 396, "{ok} of 400 succeeded");
    Instant::now() - start
}

/// Every waiting call honours the cooldown gate a 429 closes (the fair queue holds them
/// all, not only the calls that arrive while it is closed): with 10% of the answers a 429
/// with `retry-after: 1`, the gate is closed a good part of the run, and the run takes
/// 2.4x the time of a clean one (it was 1.4x when calls already queued went past the gate).
#[tokio::test(start_paused = true)]
async fn random_429s_through_the_whole_stack_keep_two_fifths_of_the_throughput() {
    let clean = through_the_stack(0.0).await;
    let noisy = through_the_stack(0.10).await;
    let ratio = noisy.as_secs_f64() / clean.as_secs_f64();
    println!(
        "400 requests through FairgateLayer: {:.1} s without 429s, {:.1} s with 10% random \
         429s (retry-after: 1): {ratio:.2}x",
        clean.as_secs_f64(),
        noisy.as_secs_f64()
    );
    assert!(ratio <= 2.5, "{ratio:.2}x slower");
}

#[tokio::test(start_paused = true)]
async fn a_throttled_key_does_not_delay_another_keys_calls() {
    let arrivals: Arc<Mutex<Vec<(String, Instant)>>> = Arc::default();
    let seen = arrivals.clone();
    let upstream = service_fn(move |req: http::Request<String>| {
        let key = req.headers()["x-api-key"].to_str().unwrap().to_owned();
        seen.lock().unwrap().push((key.clone(), Instant::now()));
        async move {
            let response = if key == "sk-a" {
                respond(429, &[("retry-after".into(), "10".into())])
            } else {
                respond(200, &[])
            };
            Ok::<_, Infallible>(response)
        }
    });
    let layer = RetryAfterBackoffLayer::new(
        Store::memory(),
        BackoffPolicy::builder()
            .seed(1)
            .max_retries(0)
            .build()
            .unwrap(),
    )
    .upstream_key_with(ByApiKey);
    let call = |key: &str| {
        let mut req = request("t", 10);
        req.headers_mut().insert("x-api-key", key.parse().unwrap());
        layer.layer(upstream.clone()).oneshot(req)
    };
    // Both keys answered once (past their cold start), then key A is throttled for 10 s.
    assert_eq!(call("sk-b").await.unwrap().status(), 200);
    assert_eq!(call("sk-a").await.unwrap().status(), 429);
    let sent = Instant::now();
    let a = tokio::spawn(call("sk-a"));
    let b: Vec<_> = (0..10).map(|_| call("sk-b")).collect();
    for response in futures_util::future::join_all(b).await {
        assert_eq!(response.unwrap().status(), 200);
    }
    let _ = a.await.unwrap();
    let arrivals = arrivals.lock().unwrap();
    for (key, at) in arrivals.iter().skip(2) {
        if key == "sk-b" {
            assert_eq!(*at, sent, "key B was delayed by key A's gate");
        } else {
            assert!(*at >= sent + Duration::from_secs(10), "key A went early");
        }
    }
}

/// The lone retry after a 429 saying `header: value`: how long after the 429 it went, over
/// `draws` seeds.
async fn lone_retry_delays(header: &'static str, value: &'static str, draws: u64) -> Vec<Duration> {
    let mut out = Vec::new();
    for seed in 0..draws {
        let times: Arc<Mutex<Vec<Instant>>> = Arc::default();
        let seen = times.clone();
        let upstream = service_fn(move |_req: http::Request<String>| {
            let n = {
                let mut t = seen.lock().unwrap();
                t.push(Instant::now());
                t.len()
            };
            async move {
                Ok::<_, Infallible>(if n == 1 {
                    respond(429, &[(header.into(), value.into())])
                } else {
                    respond(200, &[])
                })
            }
        });
        let layer = RetryAfterBackoffLayer::new(Store::memory(), policy(seed));
        let response = layer
            .layer(upstream)
            .oneshot(request("t", 10))
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        let times = times.lock().unwrap();
        out.push(times[1] - times[0]);
    }
    out
}

#[tokio::test(start_paused = true)]
async fn a_lone_retry_keeps_its_band_for_250_ms_and_2_s() {
    for (header, value, server) in [
        ("retry-after-ms", "250", Duration::from_millis(250)),
        ("retry-after", "2", Duration::from_secs(2)),
    ] {
        let delays = lone_retry_delays(header, value, 1_000).await;
        let (lo, hi) = (server.mul_f64(0.96), server.mul_f64(1.44));
        let min = *delays.iter().min().unwrap();
        let max = *delays.iter().max().unwrap();
        println!(
            "lone retry after {header}: {value}: from {min:?} to {max:?} (band {lo:?}..{hi:?})"
        );
        assert!(
            min >= lo.saturating_sub(Duration::from_millis(1)),
            "{min:?} < {lo:?}"
        );
        assert!(max <= hi + Duration::from_millis(1), "{max:?} > {hi:?}");
    }
}

#[tokio::test(start_paused = true)]
async fn held_calls_spread_over_a_fifth_of_the_servers_delay() {
    // A 429 with `retry-after-ms: 250` closes the gate; 20 calls sent meanwhile are held
    // behind it, then released over a fifth of the delay (no fixed floor): all go within
    // 250 ms + 2 x 50 ms of the 429 (the worker's offset and each call's own draw).
    let arrivals: Arc<Mutex<Vec<Instant>>> = Arc::default();
    let seen = arrivals.clone();
    let upstream = service_fn(move |_req: http::Request<String>| {
        let n = {
            let mut seen = seen.lock().unwrap();
            seen.push(Instant::now());
            seen.len()
        };
        async move {
            Ok::<_, Infallible>(if n == 2 {
                respond(429, &[("retry-after-ms".into(), "250".into())])
            } else {
                respond(200, &[])
            })
        }
    });
    let layer = RetryAfterBackoffLayer::new(
        Store::memory(),
        BackoffPolicy::builder()
            .seed(4)
            .max_retries(0)
            .build()
            .unwrap(),
    );
    let call = || layer.layer(upstream.clone()).oneshot(request("t", 10));
    assert_eq!(call().await.unwrap().status(), 200); // past the cold start
    assert_eq!(call().await.unwrap().status(), 429);
    let throttled = Instant::now();
    let held: Vec<_> = (0..20).map(|_| call()).collect();
    for response in futures_util::future::join_all(held).await {
        assert_eq!(response.unwrap().status(), 200);
    }
    let arrivals = arrivals.lock().unwrap();
    let first = *arrivals[2..].iter().min().unwrap() - throttled;
    let last = *arrivals[2..].iter().max().unwrap() - throttled;
    println!("20 calls held behind retry-after-ms: 250 went from {first:?} to {last:?}");
    assert!(first >= Duration::from_millis(250), "{first:?}");
    assert!(last <= Duration::from_millis(351), "{last:?}");
}

#[tokio::test(start_paused = true)]
async fn hostile_rate_limit_headers_neither_panic_nor_stop_the_fleet() {
    let variants: Vec<Vec<(&str, &str)>> = vec![
        vec![
            ("anthropic-ratelimit-requests-limit", "0"),
            ("anthropic-ratelimit-requests-remaining", "0"),
            ("anthropic-ratelimit-requests-reset", "2099-01-01T00:00:00Z"),
        ],
        vec![
            ("anthropic-ratelimit-requests-limit", "10"),
            ("anthropic-ratelimit-requests-remaining", "5000"),
            ("anthropic-ratelimit-requests-reset", "1999-01-01T00:00:00Z"),
        ],
        vec![
            ("anthropic-ratelimit-input-tokens-limit", "lots"),
            ("anthropic-ratelimit-input-tokens-remaining", "-1"),
            ("anthropic-ratelimit-input-tokens-reset", "soon"),
        ],
        vec![
            (
                "anthropic-ratelimit-tokens-limit",
                "99999999999999999999999999",
            ),
            ("anthropic-ratelimit-tokens-remaining", "0"),
            ("anthropic-ratelimit-tokens-reset", "9999-12-31T23:59:59Z"),
        ],
        vec![
            ("anthropic-ratelimit-output-tokens-limit", "4000000000"),
            ("anthropic-ratelimit-output-tokens-remaining", "0"),
            (
                "anthropic-ratelimit-output-tokens-reset",
                "3025-01-01T00:00:00Z",
            ),
        ],
    ];
    let upstream = service_fn(move |req: http::Request<String>| {
        let i: usize = req.body().parse().unwrap();
        let headers: Vec<(String, String)> = variants[i % variants.len()]
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        async move { Ok::<_, Infallible>(respond(200, &headers)) }
    });
    let layer = RetryAfterBackoffLayer::new(Store::memory(), policy(5));
    let start = Instant::now();
    let calls: Vec<_> = (0..200)
        .map(|i| {
            let mut req = request("t", 10);
            *req.body_mut() = i.to_string();
            layer.layer(upstream.clone()).oneshot(req)
        })
        .collect();
    for response in futures_util::future::join_all(calls).await {
        assert_eq!(response.unwrap().status(), 200);
    }
    // Limit 10 RPM with more remaining than the limit is the one usable limit: 200 calls
    // at 9.5 a minute would take 20 minutes; never a standstill means they all went.
    let took = Instant::now() - start;
    println!("200 calls with hostile headers took {took:?}");
    assert!(took < Duration::from_secs(30 * 60), "{took:?}");
}

#[cfg(feature = "redis")]
#[tokio::test]
async fn while_redis_is_away_each_worker_paces_at_its_share_of_the_learned_rate() {
    let _turn = crate::support::file_turn(module_path!());
    // Real time, scaled: 600 RPM learned by two workers on one Redis; then Redis dies and
    // one worker paces alone against half of it (0.95 x 600 / 2 = 285 a minute, 4.75 a
    // second), as the slot caps and configured pacing are split.
    let (mut server, [one, _two]) = two_workers().await;
    let provider = anthropic(600, 10_000_000, 10_000_000, Duration::from_millis(5));
    let alive = Instant::now() + Duration::from_secs(5);
    while one.alive_workers() < 2 && Instant::now() < alive {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(one.alive_workers(), 2, "both workers heartbeat");
    let service = RetryAfterBackoffLayer::new(one.clone(), policy(1)).layer(provider.service());
    service.clone().oneshot(request("t", 10)).await.unwrap();
    server.kill();
    let calls: Vec<_> = (0..20)
        .map(|i| tokio::spawn(service.clone().oneshot(request(&format!("t{i}"), 10))))
        .collect();
    for call in calls {
        assert_eq!(call.await.unwrap().unwrap().status(), 200);
    }
    assert!(one.is_degraded());
    let served = provider.served_at();
    let last = &served[served.len() - 10..];
    let rate = 9.0 / (last[9] - last[0]).as_secs_f64();
    println!("Redis away, 2 workers known: the last 10 calls at {rate:.2} a second (share 4.75)");
    assert!((3.5..=6.0).contains(&rate), "{rate:.2} calls a second");
}
