//! A pool as the fair queue's rate gate on Redis: two workers — two `Store::redis` handles
//! on one throwaway redis-server, each with its own `FairgateLayer` and its own `Pool` of
//! the same two rate-limited mock upstreams (`support::rate_limited`) — serve the sum of
//! the upstreams' rates with no 429, each upstream's learned rate shared by the fleet
//! (the memory version: `tests/memory/pool_rate.rs`). Real time, scaled: each upstream
//! allows 600 requests a minute, calls take 50 ms.
//!
//! `--nocapture` shows the numbers.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::support::RedisServer;
use crate::support::rate_limited::{Outcome, RateLimited, busy_reasons, count, send_at};
use crate::support::{joined, user};
use fairgate::pool::{Pool, Upstream};
use fairgate::{BackoffPolicy, BoxError, FairgateLayer, Store};
use tokio::time::Instant;
use tower::util::BoxCloneSyncService;
use tower::{Layer, ServiceExt};

type Stack = BoxCloneSyncService<http::Request<String>, u16, BoxError>;
type Svc = BoxCloneSyncService<http::Request<String>, http::Response<String>, BoxError>;

/// Each upstream's request limit.
const RPM: u32 = 600;

/// The tests measure real time: one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Two workers on the Redis at `url`, each with its own `FairgateLayer` and its own pool
/// of `upstreams` (named `u0`, `u1`, ...; each worker's pool made by `pool`).
async fn workers(
    url: &str,
    upstreams: &[Svc],
    pool: impl Fn(fairgate::pool::PoolBuilder<Svc>) -> fairgate::pool::PoolBuilder<Svc>,
) -> Vec<Stack> {
    workers_prioritised(url, (upstreams, &[]), pool).await
}

/// [`workers`], the upstreams of these priorities (0 where none is given).
async fn workers_prioritised(
    url: &str,
    (upstreams, priorities): (&[Svc], &[u32]),
    pool: impl Fn(fairgate::pool::PoolBuilder<Svc>) -> fairgate::pool::PoolBuilder<Svc>,
) -> Vec<Stack> {
    let mut stacks: Vec<Stack> = Vec::new();
    for worker in 0..2u64 {
        let store = Store::redis(url).await.expect("a store");
        let mut builder = Pool::builder();
        for (i, upstream) in upstreams.iter().enumerate() {
            let priority = priorities.get(i).copied().unwrap_or(0);
            let upstream = Upstream::new(format!("u{i}"), upstream.clone()).priority(priority);
            builder = builder.upstream(upstream);
        }
        let pool = pool(builder).build().unwrap();
        let fairgate = FairgateLayer::builder(store)
            .backoff(BackoffPolicy::builder().seed(40 + worker).build().unwrap())
            .pool(pool.gate())
            .build()
            .unwrap();
        let service = fairgate
            .layer(pool)
            .map_response(|response| response.status().as_u16());
        stacks.push(BoxCloneSyncService::new(service));
    }
    stacks
}

/// The services of `upstreams`.
fn services(upstreams: &[RateLimited]) -> Vec<Svc> {
    upstreams
        .iter()
        .map(|u| BoxCloneSyncService::new(u.service()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_workers_over_two_upstreams_serve_at_least_1_8_times_one_with_no_429() {
    let _serial = SERIAL.lock().await;
    let server = RedisServer::start();
    let upstreams = [
        RateLimited::new(RPM, Duration::from_millis(50)),
        RateLimited::new(RPM, Duration::from_millis(50)),
    ];
    let stacks = workers(&server.url(), &services(&upstreams), |pool| pool).await;
    let ids = Arc::new(AtomicU64::new(0));
    let send = |w: usize, at: Instant, tenant: String| {
        let stack = stacks[w].clone();
        let id = ids.fetch_add(1, Ordering::Relaxed);
        send_at(stack, id, at, user(&tenant, "premium"))
    };
    // Warm-up: calls through both workers until each upstream has answered (slow start over,
    // its limits learned by the fleet).
    for _ in 0..20 {
        if upstreams.iter().all(|u| u.served() > 0) {
            break;
        }
        let now = Instant::now();
        let warm = vec![
            send(0, now, "warm-up".into()),
            send(1, now, "warm-up".into()),
        ];
        for warm in joined(warm).await {
            assert!(warm.ok(), "a warm-up call: {warm:?}");
        }
    }
    assert!(upstreams.iter().all(|u| u.served() > 0), "warmed up");
    tokio::time::sleep(Duration::from_millis(500)).await;
    upstreams.iter().for_each(RateLimited::forget);
    // 25 calls a second for 6 s, over both workers: above the pool's 20 a second.
    let start = Instant::now();
    let calls: Vec<_> = (0..150u64)
        .map(|i| {
            send(
                (i % 2) as usize,
                start + Duration::from_millis(i * 40),
                format!("t{i}"),
            )
        })
        .collect();
    let outcomes = joined(calls).await;
    let (from, to) = (
        start + Duration::from_secs(1),
        start + Duration::from_secs(5),
    );
    let started: Vec<usize> = upstreams
        .iter()
        .map(|u| {
            u.calls()
                .iter()
                .filter(|c| c.at >= from && c.at < to)
                .count()
        })
        .collect();
    let throttled: usize = upstreams.iter().map(RateLimited::throttled).sum();
    let total: usize = started.iter().sum();
    println!(
        "two workers, two upstreams of {RPM} a minute: {total} calls started in 4 s \
         ({started:?}; one upstream's rate would be {}); {} of 150 served (busy: {}); \
         429s {throttled}",
        RPM / 15,
        count(&outcomes, Outcome::ok),
        busy_reasons(&outcomes)
    );
    // 1.8 times one upstream's 40 calls in 4 s.
    assert!(total >= 72, "{total} calls in 4 s");
    // Each at its rate over the window (40) and at most a second of it more: the cells the
    // fleet takes ahead on Redis and back to back. The provider's bucket holds a minute.
    assert!(
        started.iter().all(|n| *n <= 50),
        "an upstream over its rate: {started:?}"
    );
    assert_eq!(throttled, 0, "429s from the upstreams");
}

/// The rule: priority is a preference for the fleet. Two workers sending 6 calls a second
/// in pairs (one from each at once), within the first upstream's rate: the second
/// priority serves none; a burst of 30 a second past the first's 10 spills to it the calls
/// the first's rate holds past `spill_after`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_workers_prefer_the_first_priority_and_spill_only_past_its_rate() {
    let _serial = SERIAL.lock().await;
    let server = RedisServer::start();
    let upstreams = [
        RateLimited::new(RPM, Duration::from_millis(50)),
        RateLimited::new(RPM, Duration::from_millis(50)),
    ];
    let services = services(&upstreams);
    let stacks = workers_prioritised(&server.url(), (&services, &[0, 1]), |pool| pool).await;
    let ids = Arc::new(AtomicU64::new(0));
    let send = |w: usize, at: Instant, tenant: String| {
        let stack = stacks[w].clone();
        let id = ids.fetch_add(1, Ordering::Relaxed);
        send_at(stack, id, at, user(&tenant, "premium"))
    };
    // Warm-up, one call at a time from each worker: the first's limits learned by the fleet.
    for w in [0, 1, 0, 1] {
        assert!(
            send(w, Instant::now(), "warm-up".into())
                .await
                .unwrap()
                .ok()
        );
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    upstreams.iter().for_each(RateLimited::forget);
    let start = Instant::now();
    let pairs: Vec<_> = (0..18u64)
        .map(|i| {
            let at = start + Duration::from_millis(i / 2 * 333);
            send((i % 2) as usize, at, format!("t{}", i % 4))
        })
        .collect();
    let outcomes = joined(pairs).await;
    assert_eq!(
        count(&outcomes, Outcome::ok),
        18,
        "{}",
        busy_reasons(&outcomes)
    );
    let each: Vec<usize> = upstreams.iter().map(|u| u.calls().len()).collect();
    println!("within the first's rate: calls at each upstream {each:?}");
    assert_eq!(
        each,
        [18, 0],
        "the second priority took calls the first had room for"
    );
    let start = Instant::now();
    let burst: Vec<_> = (0..60u64)
        .map(|i| {
            let at = start + Duration::from_millis(i * 33);
            send((i % 2) as usize, at, format!("t{}", i % 4))
        })
        .collect();
    let outcomes = joined(burst).await;
    let second = upstreams[1].calls().len();
    println!(
        "a burst of 30 a second: {} served, {second} at the second (busy: {})",
        count(&outcomes, Outcome::ok),
        busy_reasons(&outcomes)
    );
    assert!(
        second >= 5,
        "the second took {second} of a burst past the first's rate"
    );
    let throttled: usize = upstreams.iter().map(RateLimited::throttled).sum();
    assert_eq!(throttled, 0, "429s from the upstreams");
}

/// An upstream that refuses its connections while `down`, counting the calls that reached
/// it by the worker that sent them (the tenant's first letters) and those it answered.
#[derive(Clone, Default)]
struct Flaky {
    down: Arc<std::sync::atomic::AtomicBool>,
    reached: Arc<std::sync::Mutex<Vec<String>>>,
    answered: Arc<AtomicU64>,
}

impl Flaky {
    fn service(&self) -> Svc {
        let this = self.clone();
        BoxCloneSyncService::new(tower::service_fn(move |req: http::Request<String>| {
            let this = this.clone();
            async move {
                let job = req.extensions().get::<fairgate::Job>().expect("a job");
                let worker = job.tenant().as_str()[..2].to_owned();
                this.reached.lock().unwrap().push(worker);
                if this.down.load(Ordering::SeqCst) {
                    let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
                    return Err::<http::Response<String>, BoxError>(refused.into());
                }
                this.answered.fetch_add(1, Ordering::SeqCst);
                Ok(http::Response::new(String::new()))
            }
        }))
    }

    fn reached_from(&self, worker: &str) -> usize {
        let reached = self.reached.lock().unwrap();
        reached.iter().filter(|w| *w == worker).count()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_set_aside_by_one_worker_is_set_aside_for_the_fleet_and_comes_back_for_all() {
    let _serial = SERIAL.lock().await;
    let server = RedisServer::start();
    let (a, b) = (Flaky::default(), Flaky::default());
    a.down.store(true, Ordering::SeqCst);
    let probe_every = Duration::from_millis(1_500);
    let stacks = workers(&server.url(), &[a.service(), b.service()], |pool| {
        pool.probe_every(probe_every)
    })
    .await;
    // What a worker's store reads of the fleet's cooldowns, as worker 1 reads them.
    let observer = Store::redis(&server.url()).await.expect("a store");
    let call = |w: usize, i: usize| {
        let stack = stacks[w].clone();
        let mut req = http::Request::new("{}".to_owned());
        req.extensions_mut()
            .insert(user(&format!("w{w}-{i}"), "premium"));
        async move { stack.oneshot(req).await.map_err(|e| e.to_string()) }
    };
    // Worker 0's calls until one goes to `a` (each upstream's rate answers from Redis, and
    // `a`'s first probe may be taken by a call that then waits for its slot: the first calls
    // may all go to `b`): refused there, it is answered by `b`; `a` is set aside, and its
    // gate closes for the fleet.
    let first = Instant::now();
    let mut i = 0;
    while a.reached_from("w0") == 0 {
        assert!(
            first.elapsed() < Duration::from_secs(10),
            "no call of worker 0 tried `a`"
        );
        assert_eq!(call(0, i).await, Ok(200));
        i += 1;
    }
    assert_eq!(a.reached_from("w0"), 1, "worker 0 tried `a` once");
    let closed = async {
        while observer.cooldown("default@u0").is_none() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(5), closed)
        .await
        .expect("the fleet learns that `a` is set aside");
    // Worker 1 never saw `a` fail: its calls go to `b` all the same.
    for i in 0..10 {
        assert_eq!(call(1, i).await, Ok(200));
    }
    let from_1 = a.reached_from("w1");
    println!(
        "`a` down: worker 1 sent it {from_1} calls, `b` answered {}",
        b.answered.load(Ordering::SeqCst)
    );
    assert_eq!(from_1, 0, "worker 1 sent calls to the upstream set aside");
    // `a` returns: after the probe interval, one probe for the fleet, then both workers'
    // calls reach it again.
    a.down.store(false, Ordering::SeqCst);
    let back = Instant::now();
    let mut i = 100;
    while a.answered.load(Ordering::SeqCst) == 0
        || a.reached_from("w1") == 0
        || a.reached_from("w0") < 2
    {
        assert!(
            back.elapsed() < 4 * probe_every,
            "`a` back in the pool for both workers"
        );
        let (x, y) = tokio::join!(call(0, i), call(1, i));
        assert_eq!((x, y), (Ok(200), Ok(200)));
        i += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    println!(
        "`a` back: both workers' calls reach it {:?} after it returned",
        back.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_redis_killed_and_back_the_pool_serves_before_and_after_and_never_overdrives() {
    let _serial = SERIAL.lock().await;
    let mut server = RedisServer::start();
    let upstreams = [
        RateLimited::new(RPM, Duration::from_millis(50)),
        RateLimited::new(RPM, Duration::from_millis(50)),
    ];
    let stacks = workers(&server.url(), &services(&upstreams), |pool| pool).await;
    let send = |w: usize, at: Instant, tenant: String| {
        let stack = stacks[w].clone();
        let mut req = http::Request::new("{}".to_owned());
        req.extensions_mut().insert(user(&tenant, "premium"));
        tokio::spawn(async move {
            tokio::time::sleep_until(at).await;
            (at, stack.oneshot(req).await.map_err(|e| e.to_string()))
        })
    };
    // 15 calls a second for 8 s, over both workers: below the pool's 19 a second, above
    // one upstream's. Redis is killed at 2 s and back at 4 s.
    let start = Instant::now();
    let calls: Vec<_> = (0..120u64)
        .map(|i| {
            let at = start + Duration::from_millis(i * 1_000 / 15);
            send((i % 2) as usize, at, format!("t{i}"))
        })
        .collect();
    tokio::time::sleep_until(start + Duration::from_secs(2)).await;
    server.kill();
    tokio::time::sleep_until(start + Duration::from_secs(4)).await;
    server.restart();
    let outcomes = joined(calls).await;
    let (killed, back) = (
        start + Duration::from_secs(2),
        start + Duration::from_secs(5),
    );
    let sent_while_up: Vec<&Result<u16, String>> = outcomes
        .iter()
        .filter(|(at, _)| *at < killed || *at >= back)
        .map(|(_, o)| o)
        .collect();
    let up_ok = sent_while_up.iter().filter(|o| **o == &Ok(200)).count();
    let during: Vec<&Result<u16, String>> = outcomes
        .iter()
        .filter(|(at, _)| *at >= killed && *at < back)
        .map(|(_, o)| o)
        .collect();
    let during_ok = during.iter().filter(|o| **o == &Ok(200)).count();
    let throttled: usize = upstreams.iter().map(RateLimited::throttled).sum();
    let each: Vec<usize> = upstreams.iter().map(|u| u.calls().len()).collect();
    println!(
        "Redis killed at 2 s, back at 4 s: sent while it was up (before 2 s, from 5 s) \
         {up_ok} of {} answered 200; sent from 2 s to 5 s {during_ok} of {} (the others told \
         busy: the store's outage rule); {each:?} at the upstreams, 429s {throttled}",
        sent_while_up.len(),
        during.len()
    );
    assert_eq!(throttled, 0, "429s from the upstreams");
    assert_eq!(
        up_ok,
        sent_while_up.len(),
        "a call sent while Redis was up failed"
    );
    for outcome in &during {
        assert!(
            outcome == &&Ok(200) || outcome.as_ref().is_err_and(|e| e.contains("busy")),
            "a call during the outage was neither served nor told busy: {outcome:?}"
        );
    }
    assert!(
        each.iter().all(|n| *n >= 20),
        "both upstreams served: {each:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_workers_a_light_tenant_behind_a_hog_is_served_at_the_next_free_cell_of_either_upstream()
 {
    let _serial = SERIAL.lock().await;
    let server = RedisServer::start();
    let call = Duration::from_millis(50);
    let upstreams = [RateLimited::new(RPM, call), RateLimited::new(RPM, call)];
    let stacks = workers(&server.url(), &services(&upstreams), |pool| pool).await;
    let send = |w: usize, tenant: &str| {
        let stack = stacks[w].clone();
        let mut req = http::Request::new("{}".to_owned());
        req.extensions_mut().insert(user(tenant, "pro"));
        tokio::spawn(async move {
            let sent = Instant::now();
            let status = stack.oneshot(req).await.map_err(|e| e.to_string());
            (status, sent.elapsed())
        })
    };
    // Warm-up: both upstreams answered (their limits learned by the fleet).
    for _ in 0..50 {
        if upstreams.iter().all(|u| u.served() > 0) {
            break;
        }
        let warm: Vec<_> = (0..4).map(|i| send(i % 2, &format!("warm-{i}"))).collect();
        for warm in joined(warm).await {
            assert_eq!(warm.0, Ok(200));
        }
    }
    assert!(upstreams.iter().all(|u| u.served() > 0), "warmed up");
    // The hog: 120 calls at once over both workers (6 s of the pool's rate).
    let hog: Vec<_> = (0..120).map(|i| send(i % 2, "tenant-a")).collect();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (light, took) = send(1, "tenant-b").await.unwrap();
    let hog = joined(hog).await;
    // One paced interval of one upstream (learned pacing aims at 0.95 of the rate), the
    // call, and what each worker may reserve ahead on Redis (a quarter second).
    let interval = Duration::from_secs_f64(60.0 / (0.95 * f64::from(RPM)));
    let bound = 2 * interval + call + Duration::from_millis(250);
    let throttled: usize = upstreams.iter().map(RateLimited::throttled).sum();
    println!(
        "two workers, a hog at 2 x {RPM} a minute: B answered {light:?} in {took:?} (bound \
         {bound:?}); A {} of 120 answered 200; 429s {throttled}",
        hog.iter().filter(|(s, _)| *s == Ok(200)).count()
    );
    assert_eq!(light, Ok(200));
    assert!(took <= bound, "B took {took:?}");
    assert_eq!(throttled, 0, "429s from the upstreams");
}
