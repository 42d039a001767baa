//! A pool as the fair queue's rate gate (`FairgateBuilder::pool`): one fair order served by
//! whichever upstream has room now, each upstream with its own learned rate. Two mock
//! upstreams that keep real token buckets and send Anthropic's rate-limit headers
//! (`support::rate_limited`), the whole recommended stack on the memory store, counted from
//! outside at each upstream, in paused time. The same scenarios with one upstream are in
//! `stack_rate.rs`; their bounds hold here with two.
//!
//! `--nocapture` shows each test's numbers.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::support::rate_limited::{
    Outcome, RateLimited, Started, busy_reasons, count, first_start, send_at, share_broken,
};
use crate::support::{joined, user};
use fairgate::pool::{Pool, Upstream};
use fairgate::{BackoffPolicy, BoxError, FairgateLayer, Job, Store};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tower::util::BoxCloneSyncService;
use tower::{Layer, ServiceExt};

type Stack = BoxCloneSyncService<http::Request<String>, u16, BoxError>;
type Svc = BoxCloneSyncService<http::Request<String>, http::Response<String>, BoxError>;

fn ms(ms: u64) -> Duration {
    Duration::from_millis(ms)
}

/// The stack over a pool of rate-limited upstreams, and the test's clock.
struct Rig {
    upstreams: Vec<RateLimited>,
    pool: Pool<Svc>,
    stack: Stack,
    start: Instant,
    ids: Arc<AtomicU64>,
}

impl Rig {
    /// `FairgateLayer` (the jitter seeded) with the pool's gate, over a pool of `upstreams`
    /// of these `priorities` (all 0 when empty).
    fn new(upstreams: Vec<RateLimited>, priorities: &[u32]) -> Rig {
        let mut builder = Pool::builder();
        for (i, upstream) in upstreams.iter().enumerate() {
            let service: Svc = BoxCloneSyncService::new(upstream.service());
            let priority = priorities.get(i).copied().unwrap_or(0);
            builder = builder.upstream(Upstream::new(format!("u{i}"), service).priority(priority));
        }
        Rig::over(upstreams, builder.build().unwrap())
    }

    /// `FairgateLayer` (the jitter seeded) with `pool`'s gate, over `pool`, whose
    /// upstreams' records are `upstreams`.
    fn over(upstreams: Vec<RateLimited>, pool: Pool<Svc>) -> Rig {
        let fairgate = FairgateLayer::builder(Store::memory())
            .backoff(BackoffPolicy::builder().seed(18).build().unwrap())
            .pool(pool.gate())
            .build()
            .unwrap();
        let service = fairgate
            .layer(pool.clone())
            // The body is whole at once: dropping the response gives everything back.
            .map_response(|response| response.status().as_u16());
        Rig {
            upstreams,
            pool,
            stack: BoxCloneSyncService::new(service),
            start: Instant::now(),
            ids: Arc::default(),
        }
    }

    /// As [`new`](Rig::new), after warm-up calls until every upstream has answered (slow
    /// start is over, each one's limits learned); then the records and the clock start
    /// afresh.
    async fn warm(upstreams: Vec<RateLimited>) -> Rig {
        Rig::warm_prioritised(upstreams, &[]).await
    }

    /// As [`warm`](Rig::warm), the upstreams of these `priorities`.
    async fn warm_prioritised(upstreams: Vec<RateLimited>, priorities: &[u32]) -> Rig {
        let mut rig = Rig::new(upstreams, priorities);
        for _ in 0..20 {
            if rig.upstreams.iter().all(|u| u.served() > 0) {
                break;
            }
            // Four a round for each: a later priority's share spills to it past the first's
            // slow start and rate.
            let warm: Vec<_> = (0..4 * rig.upstreams.len())
                .map(|_| rig.send(Duration::ZERO, user("warm-up", "premium")))
                .collect();
            for warm in joined(warm).await {
                assert!(warm.ok(), "a warm-up call: {warm:?}");
            }
        }
        assert!(rig.upstreams.iter().all(|u| u.served() > 0), "warmed up");
        for upstream in &rig.upstreams {
            upstream.forget();
        }
        rig.start = Instant::now();
        rig
    }

    /// Sends `job` at `at` past the start.
    fn send(&self, at: Duration, job: Job) -> JoinHandle<Outcome> {
        let stack = self.stack.clone();
        let id = self.ids.fetch_add(1, Ordering::Relaxed);
        let when = self.start + at;
        send_at(stack, id, when, job)
    }

    /// Every call at every upstream, in the order they reached it.
    fn calls(&self) -> Vec<Started> {
        let mut calls: Vec<Started> = self.upstreams.iter().flat_map(|u| u.calls()).collect();
        calls.sort_by_key(|c| c.at);
        calls
    }

    fn throttled(&self) -> usize {
        self.upstreams.iter().map(RateLimited::throttled).sum()
    }

    /// Calls that reached any upstream in `[from, to)` past the start.
    fn started_between(&self, from: Duration, to: Duration) -> usize {
        let (from, to) = (self.start + from, self.start + to);
        self.calls()
            .iter()
            .filter(|c| c.at >= from && c.at < to)
            .count()
    }
}

/// Calls a minute served in a steady minute of load above the pool's rate: many tenants
/// sending 2.5 calls a second (each call its own tenant, so no tenant's share binds).
async fn steady_minute(rig: &Rig) -> usize {
    let calls: Vec<_> = (0..225u64)
        .map(|i| rig.send(ms(i * 400), user(&format!("t{i}"), "premium")))
        .collect();
    let outcomes = joined(calls).await;
    let served = count(&outcomes, Outcome::ok);
    println!(
        "{served} of {} served (busy: {}), {} throttled",
        outcomes.len(),
        busy_reasons(&outcomes),
        rig.throttled()
    );
    rig.started_between(Duration::from_secs(20), Duration::from_secs(80))
}

#[tokio::test(start_paused = true)]
async fn two_upstreams_of_60_a_minute_serve_at_least_108_a_minute_with_no_429() {
    let one = Rig::warm(vec![RateLimited::new(60, ms(200))]).await;
    let one_rate = steady_minute(&one).await;
    let two = Rig::warm(vec![
        RateLimited::new(60, ms(200)),
        RateLimited::new(60, ms(200)),
    ])
    .await;
    let two_rate = steady_minute(&two).await;
    let each: Vec<usize> = two.upstreams.iter().map(|u| u.calls().len()).collect();
    println!(
        "calls a minute (20-80 s): one upstream of 60 {one_rate}, two {two_rate} \
         ({:.2}x), split {each:?}; 429s {} and {}",
        two_rate as f64 / one_rate as f64,
        one.throttled(),
        two.throttled()
    );
    assert!(two_rate >= 108, "two upstreams served {two_rate} a minute");
    assert!(
        one_rate <= 60,
        "one upstream went over its rate: {one_rate}"
    );
    assert_eq!(two.throttled(), 0, "a 429 from an upstream");
    assert_eq!(one.throttled(), 0, "a 429 from the upstream");
    let state = two.pool.upstreams();
    assert!(state.iter().all(|u| u.in_flight == 0), "{state:?}");
    // Each upstream's own limit, learned from its own headers.
    assert!(state.iter().all(|u| u.limits.requests == 60), "{state:?}");
}

/// The rule: priority is a preference. Four tenants sending 1.5 calls a second together
/// (two at once every 1.33 s), within the first upstream's 120 a minute: the second
/// priority serves none, though the first's rate holds one of each pair for a moment (it
/// served 30 of 60 when such a call went there at once). Then a burst past the first's
/// rate: calls held longer than `spill_after` (1 s) go to the second, counted as spilled.
#[tokio::test(start_paused = true)]
async fn a_later_priority_takes_only_what_the_first_holds_past_spill_after() {
    let upstreams = vec![
        RateLimited::new(120, ms(300)),
        RateLimited::new(120, ms(300)),
    ];
    let rig = Rig::warm_prioritised(upstreams, &[0, 1]).await;
    let spilled_before = rig.pool.upstreams()[1].spilled;
    let calls: Vec<_> = (0..46u64)
        .map(|i| rig.send(ms(i / 2 * 1_333), user(&format!("t{}", i % 4), "premium")))
        .collect();
    let outcomes = joined(calls).await;
    assert_eq!(count(&outcomes, Outcome::ok), 46);
    let each: Vec<usize> = rig.upstreams.iter().map(|u| u.calls().len()).collect();
    println!("within the first's rate: calls at each upstream {each:?}");
    assert_eq!(
        each,
        [46, 0],
        "the second priority took calls the first had room for"
    );
    // Six calls a second for 10 s: the first serves its 2 a second, the rest spill.
    let start = Duration::from_secs(31);
    let burst: Vec<_> = (0..60u64)
        .map(|i| rig.send(start + ms(i * 167), user(&format!("t{}", i % 4), "premium")))
        .collect();
    let outcomes = joined(burst).await;
    assert_eq!(count(&outcomes, Outcome::ok), 60);
    let second = rig.upstreams[1].calls().len();
    let spilled = rig.pool.upstreams()[1].spilled - spilled_before;
    println!("a burst of 6 a second: {second} at the second, {spilled} spilled");
    assert!(
        second >= 10,
        "the second took {second} of a burst past the first's rate"
    );
    assert_eq!(
        spilled as usize, second,
        "every call of the second spilled to it"
    );
    assert_eq!(rig.throttled(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_light_tenant_behind_a_hog_is_served_at_the_next_free_cell_of_either_upstream() {
    let call = ms(300);
    let rig = Rig::warm(vec![RateLimited::new(50, call), RateLimited::new(50, call)]).await;
    let hog: Vec<_> = (0..80)
        .map(|_| rig.send(Duration::ZERO, user("tenant-a", "pro").with_cost(1_000)))
        .collect();
    let light = rig.send(
        Duration::from_secs(2),
        user("tenant-b", "pro").with_cost(1_000),
    );
    let light = light.await.unwrap();
    let hog = joined(hog).await;
    let calls = rig.calls();
    let b_start = first_start(&calls, light.id).expect("B reached an upstream");
    // One paced interval of one upstream (learned pacing aims at 0.95 of 50 a minute): the
    // next free cell of either comes sooner.
    let interval = Duration::from_secs_f64(60.0 / (0.95 * 50.0));
    let bound = interval + call + ms(100);
    let a_in_10_s = rig.started_between(Duration::ZERO, Duration::from_secs(10));
    println!(
        "hog at 2 x 50 RPM: B answered {:?} after it was sent (bound {bound:?}), reached an \
         upstream {:?} after; calls started in the first 10 s {a_in_10_s}; A {} served; \
         429s {}",
        light.took(),
        b_start - light.sent,
        count(&hog, Outcome::ok),
        rig.throttled()
    );
    assert!(light.ok(), "B is served: {light:?}");
    assert!(light.took() <= bound, "B took {:?}", light.took());
    // Both upstreams' rates serve the hog: more than one upstream's 50 a minute would.
    assert!(a_in_10_s > 10, "{a_in_10_s} calls started in 10 s");
    assert_eq!(rig.throttled(), 0, "429s from the upstreams");
}

#[tokio::test(start_paused = true)]
async fn premium_behind_a_guest_flood_gets_its_weighted_share_across_two_upstreams() {
    let rig = Rig::warm(vec![
        RateLimited::new(30, ms(200)),
        RateLimited::new(30, ms(200)),
    ])
    .await;
    let guests: Vec<_> = (0..200)
        .map(|_| rig.send(Duration::ZERO, user("guest-flood", "guest").with_cost(500)))
        .collect();
    let premium: Vec<_> = (0..20)
        .map(|_| rig.send(ms(500), user("premium-a", "premium").with_cost(500)))
        .collect();
    let premium = joined(premium).await;
    let guests = joined(guests).await;
    let calls = rig.calls();
    let arrival = rig.start + ms(500);
    let until = calls
        .iter()
        .filter(|c| c.tier == "premium")
        .map(|c| c.at)
        .max()
        .expect("premium reached an upstream");
    let window: Vec<&str> = calls
        .iter()
        .filter(|c| c.at >= arrival && c.at <= until)
        .map(|c| c.tier.as_str())
        .collect();
    let in_window = |tier: &str| window.iter().filter(|t| **t == tier).count();
    let (p, g) = (in_window("premium"), in_window("guest"));
    let broken = share_broken(&window, "premium", "guest", 3, 1);
    println!(
        "guest flood at 2 x 30 RPM: premium {} of 20 served ({}); from the premium arrival to \
         its last start: premium {p}, guest {g}; guests {} served; 429s {}",
        count(&premium, Outcome::ok),
        busy_reasons(&premium),
        count(&guests, Outcome::ok),
        rig.throttled()
    );
    for o in &premium {
        assert!(o.ok(), "every premium call succeeds: {o:?}");
    }
    assert!(
        3 * g <= p + 3,
        "guest {g} against premium {p}: more than 1:3 (+1)"
    );
    assert_eq!(broken, None, "a guest went while premium's share was owed");
    assert_eq!(rig.throttled(), 0, "429s from the upstreams");
}

#[tokio::test(start_paused = true)]
async fn a_429_closes_its_own_upstream_only_and_the_calls_go_to_the_other() {
    let rig = Rig::warm(vec![
        RateLimited::new(600, ms(100)),
        RateLimited::new(600, ms(100)),
    ])
    .await;
    // Someone else empties the first upstream's bucket: its next answer is a 429.
    rig.upstreams[0].take_outside(1e9);
    rig.upstreams[0].set_rpm(1);
    let calls: Vec<_> = (0..40u64)
        .map(|i| rig.send(ms(i * 100), user(&format!("t{i}"), "premium")))
        .collect();
    let outcomes = joined(calls).await;
    let first: Vec<Started> = rig.upstreams[0].calls();
    let second = rig.upstreams[1].calls().len();
    println!(
        "first upstream: {} calls ({} throttled), second: {second}; {} of 40 served in {:?}",
        first.len(),
        rig.upstreams[0].throttled(),
        count(&outcomes, Outcome::ok),
        outcomes.iter().map(Outcome::took).max().unwrap()
    );
    assert_eq!(
        count(&outcomes, Outcome::ok),
        40,
        "{}",
        busy_reasons(&outcomes)
    );
    // The first upstream's 429 closed its gate; its probe aside, nothing else went there.
    assert!(
        rig.upstreams[0].throttled() >= 1,
        "the first upstream was at its limit"
    );
    assert!(
        first.len() <= 3,
        "{} calls went to the closed upstream",
        first.len()
    );
    assert!(second >= 37, "the second upstream took {second}");
    // Nobody waited for the closed upstream's cooldown.
    let slowest = outcomes.iter().map(Outcome::took).max().unwrap();
    assert!(slowest < Duration::from_secs(2), "a call took {slowest:?}");
}

#[tokio::test(start_paused = true)]
async fn the_pool_gate_holds_each_upstreams_cap_and_gives_the_place_back() {
    // Caps of 2 and 1: the fair queue dispatches at most 3 at once, whatever its window.
    let slow = [
        RateLimited::new(6_000, ms(500)),
        RateLimited::new(6_000, ms(500)),
    ];
    let services: Vec<Svc> = slow
        .iter()
        .map(|u| BoxCloneSyncService::new(u.service()))
        .collect();
    let pool = Pool::builder()
        .upstream(Upstream::new("a", services[0].clone()).max_in_flight(2))
        .upstream(Upstream::new("b", services[1].clone()).max_in_flight(1))
        .build()
        .unwrap();
    let rig = Rig::over(slow.to_vec(), pool);
    let calls: Vec<_> = (0..12)
        .map(|i| rig.send(Duration::ZERO, user(&format!("t{i}"), "pro")))
        .collect();
    for call in joined(calls).await {
        assert!(call.ok(), "{call:?}");
    }
    let most = (slow[0].max_in_flight(), slow[1].max_in_flight());
    println!("most in flight at each upstream: {most:?}");
    assert_eq!(most, (2, 1), "each upstream's cap held, and both used");
    assert!(rig.pool.upstreams().iter().all(|u| u.in_flight == 0));
}

#[tokio::test(start_paused = true)]
async fn an_upstream_killed_mid_load_loses_no_call_the_survivor_runs_at_its_rate_and_it_comes_back()
{
    // Two upstreams of 120 a minute; the first refuses its connections from 10 s to 30 s.
    let (first, second) = (
        RateLimited::new(120, ms(200)),
        RateLimited::new(120, ms(200)),
    );
    let down = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let killable = {
        let (down, inner) = (down.clone(), first.service());
        tower::service_fn(move |req: http::Request<String>| {
            let (down, inner) = (down.load(Ordering::SeqCst), inner.clone());
            async move {
                if down {
                    let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
                    return Err::<http::Response<String>, BoxError>(refused.into());
                }
                inner.oneshot(req).await
            }
        })
    };
    let pool = Pool::builder()
        .upstream(Upstream::new("first", BoxCloneSyncService::new(killable)))
        .upstream(Upstream::new(
            "second",
            BoxCloneSyncService::new(second.service()),
        ))
        .build()
        .unwrap();
    let rig = Rig::over(vec![first, second], pool);
    // 5 calls a second for 50 s, each its own tenant: above one upstream's 2 a second.
    let calls: Vec<_> = (0..250u64)
        .map(|i| rig.send(ms(i * 200), user(&format!("t{i}"), "premium")))
        .collect();
    tokio::time::sleep(Duration::from_secs(10)).await;
    down.store(true, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_secs(20)).await;
    down.store(false, Ordering::SeqCst);
    let outcomes = joined(calls).await;
    let at = |u: usize, from: u64, to: u64| {
        let (from, to) = (
            rig.start + Duration::from_secs(from),
            rig.start + Duration::from_secs(to),
        );
        rig.upstreams[u]
            .calls()
            .iter()
            .filter(|c| c.at >= from && c.at < to && c.status == 200)
            .count()
    };
    let back_at = rig.upstreams[0]
        .calls()
        .iter()
        .map(|c| c.at)
        .find(|t| *t >= rig.start + Duration::from_secs(30));
    let back_after = back_at.map(|t| t - (rig.start + Duration::from_secs(30)));
    println!(
        "first killed at 10 s, back at 30 s: answered 200 {} of 250; the second's calls from \
         11 to 29 s {} (its rate: 2 a second, 36), the first's {}; the first back {back_after:?} \
         after it returned; 429s {}",
        count(&outcomes, Outcome::ok),
        at(1, 11, 29),
        at(0, 11, 29),
        rig.throttled()
    );
    assert_eq!(
        count(&outcomes, Outcome::ok),
        250,
        "{}",
        busy_reasons(&outcomes)
    );
    // From a second after the kill, the survivor runs at its rate (0.95 of 2 a second).
    assert!(at(1, 11, 29) >= 33, "the survivor served {}", at(1, 11, 29));
    assert_eq!(at(0, 11, 29), 0, "the killed one answered");
    // Back within a probe interval (1 s) and a paced interval of its return.
    let back_after = back_after.expect("the first upstream came back");
    assert!(
        back_after <= Duration::from_secs(2),
        "back after {back_after:?}"
    );
    assert_eq!(rig.throttled(), 0, "429s from the upstreams");
}
