//! TierSlotLimit: caps, reserved capacity, fail-fast timing, cancellation and streaming, on
//! the memory store in paused time and on a throwaway Redis in real time.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::support::{EventCounter, request};
use fairgate::{Busy, Job, MissingJob, Origin, SlotPolicy, Store, Tier, TierSlotLimitLayer};
use futures_util::FutureExt;
use http_body_util::BodyExt;
use tokio::sync::oneshot;
use tokio::time::Instant;
use tower::{BoxError, Layer, Service, ServiceExt, service_fn};

/// What the upstream saw: calls in flight now and at most, globally and per tier.
#[derive(Default)]
struct Seen {
    now: u32,
    max: u32,
    tier_now: HashMap<String, u32>,
    tier_max: HashMap<String, u32>,
    calls: u32,
}

type SeenRef = Arc<Mutex<Seen>>;

fn tier_of(req: &http::Request<()>) -> String {
    let job = req.extensions().get::<Job>().expect("a job");
    job.tier().map_or("guest", Tier::as_str).to_owned()
}

/// An upstream that takes `hold` per call and records concurrency.
fn upstream(
    hold: Duration,
) -> (
    SeenRef,
    impl Service<http::Request<()>, Response = http::Response<()>, Error = Infallible, Future: Send>
    + Clone
    + Send
    + 'static,
) {
    let seen = SeenRef::default();
    let record = seen.clone();
    let service = service_fn(move |req: http::Request<()>| {
        let seen = record.clone();
        async move {
            let tier = tier_of(&req);
            {
                let mut s = seen.lock().unwrap();
                s.now += 1;
                s.calls += 1;
                s.max = s.max.max(s.now);
                let n = s.tier_now.entry(tier.clone()).or_default();
                *n += 1;
                let n = *n;
                let m = s.tier_max.entry(tier.clone()).or_default();
                *m = (*m).max(n);
            }
            tokio::time::sleep(hold).await;
            {
                let mut s = seen.lock().unwrap();
                s.now -= 1;
                *s.tier_now.get_mut(&tier).unwrap() -= 1;
            }
            Ok::<_, Infallible>(http::Response::new(()))
        }
    });
    (seen, service)
}

fn job(tier: &str) -> Job {
    Job::new(format!("tenant-{tier}"), Origin::UserAction).with_tier(tier)
}

/// One store plus the time scale its scenario runs at.
struct Rig {
    store: Store,
    /// How long one upstream call takes.
    call: Duration,
    #[cfg(feature = "redis")]
    _server: Option<crate::support::RedisServer>,
}

impl Rig {
    fn memory() -> Rig {
        Rig {
            store: Store::memory(),
            call: Duration::from_secs(1),
            #[cfg(feature = "redis")]
            _server: None,
        }
    }

    #[cfg(feature = "redis")]
    async fn redis() -> Rig {
        let server = crate::support::RedisServer::start();
        let store = Store::builder()
            .probe_interval(Duration::from_millis(20))
            .redis(&server.url())
            .await
            .unwrap();
        Rig {
            store,
            // Long enough that a loaded machine's scheduling and round trips fit in one.
            call: Duration::from_millis(200),
            _server: Some(server),
        }
    }
}

crate::support::on_both_stores!(
    caps_hold_globally_and_per_tier,
    five_hundred_guests_leave_twenty_five_slots_for_paying_tiers,
    free_flood_cannot_keep_premium_out_for_a_call_time,
    cancelled_waiters_and_holders_give_their_slots_back,
    a_tenant_at_its_cap_waits_apart_and_another_of_its_tier_goes_at_once,
    a_tenant_over_its_cap_is_busy_at_its_tiers_max_wait,
);

async fn caps_hold_globally_and_per_tier(rig: Rig) {
    let policy = SlotPolicy::builder()
        .global_max(6)
        .tier("gold", 4, Duration::from_secs(600))
        .tier("silver", 3, Duration::from_secs(600))
        .tier("guest", 2, Duration::from_secs(600))
        .poll_interval(Duration::from_millis(20))
        .build()
        .unwrap();
    let (seen, inner) = upstream(rig.call);
    let service = TierSlotLimitLayer::new(rig.store.clone(), policy).layer(inner);
    let tiers = ["gold", "silver", "guest"];
    let calls = (0..60).map(|i| {
        let service = service.clone();
        tokio::spawn(async move { service.oneshot(request(job(tiers[i % 3]))).await.map(drop) })
    });
    for call in futures_util::future::join_all(calls).await {
        call.unwrap()
            .expect("every request gets a slot within its max wait");
    }
    {
        let seen = seen.lock().unwrap();
        assert_eq!(seen.calls, 60);
        assert!(seen.max <= 6, "global cap broken: {}", seen.max);
        assert_eq!(seen.max, 6, "the window is used in full");
        for (tier, cap) in [("gold", 4), ("silver", 3), ("guest", 2)] {
            let max = seen.tier_max[tier];
            assert!(max <= cap, "{tier}: {max} > {cap}");
        }
    }
    wait_for_slots(&rig.store, 0).await;
}

async fn five_hundred_guests_leave_twenty_five_slots_for_paying_tiers(rig: Rig) {
    let hold = rig.call * 20;
    let (seen, inner) = upstream(hold);
    let service = TierSlotLimitLayer::new(rig.store.clone(), SlotPolicy::default()).layer(inner);
    let guests: Vec<_> = (0..500)
        .map(|_| spawn_call(&service, job("guest")))
        .collect();
    // The first five guests hold their slots; the rest wait (or give up at 8 s).
    eventually("five guests hold slots", || seen.lock().unwrap().now == 5).await;
    assert_eq!(rig.store.slots_in_use(Some(&Tier::new("guest"))).await, 5);
    // 25 paying requests all get a slot without waiting for a guest to finish.
    let started = Instant::now();
    let paying: Vec<_> = (0..25)
        .map(|i| {
            let tier = if i % 2 == 0 { "premium" } else { "pro" };
            spawn_call(&service, job(tier))
        })
        .collect();
    eventually("all 30 slots are in use", || seen.lock().unwrap().now == 30).await;
    assert_eq!(rig.store.slots_in_use(None).await, 30);
    {
        let seen = seen.lock().unwrap();
        assert_eq!(seen.tier_now.get("guest"), Some(&5));
        assert_eq!(
            seen.tier_now.get("premium").copied().unwrap_or(0) + seen.tier_now["pro"],
            25
        );
    }
    for call in paying {
        call.await.unwrap().expect("a paying request gets a slot");
    }
    // Queued behind a guest, a paying call would have taken two holds.
    assert!(
        started.elapsed() < hold + hold / 2,
        "paying requests queued behind guests"
    );
    for guest in guests {
        guest.abort();
    }
}

async fn free_flood_cannot_keep_premium_out_for_a_call_time(rig: Rig) {
    let (_, inner) = upstream(rig.call);
    let service = TierSlotLimitLayer::new(rig.store.clone(), SlotPolicy::default()).layer(inner);
    let flood: Vec<_> = (0..200)
        .map(|_| spawn_call(&service, job("free")))
        .collect();
    tokio::time::sleep(rig.call / 4).await;
    let started = Instant::now();
    service
        .clone()
        .oneshot(request(job("premium")))
        .await
        .expect("premium gets a slot");
    // Its own call included: it went out without waiting for a free call to finish.
    assert!(
        started.elapsed() < rig.call * 2,
        "premium waited {:?}",
        started.elapsed()
    );
    // The flood itself drains through its 15 slots, or is told to come back later.
    let mut served = 0;
    for call in flood {
        match call.await.unwrap() {
            Ok(()) => served += 1,
            Err(e) => assert!(e.is::<Busy>(), "{e}"),
        }
    }
    assert!(served >= 15, "only {served} free calls served");
}

async fn cancelled_waiters_and_holders_give_their_slots_back(rig: Rig) {
    let policy = SlotPolicy::builder()
        .global_max(2)
        .tier("guest", 2, Duration::from_secs(3600))
        .poll_interval(Duration::from_millis(20))
        .build()
        .unwrap();
    let (seen, inner) = upstream(rig.call * 1000);
    let service = TierSlotLimitLayer::new(rig.store.clone(), policy).layer(inner);
    // Two holders mid-call, one waiter queued behind them.
    let holder_a = tokio::spawn(service.clone().oneshot(request(job("guest"))));
    let holder_b = tokio::spawn(service.clone().oneshot(request(job("guest"))));
    eventually("both holders are mid-call", || {
        seen.lock().unwrap().now == 2
    })
    .await;
    let waiter = tokio::spawn(service.clone().oneshot(request(job("guest"))));
    tokio::time::sleep(rig.call).await;
    assert_eq!(seen.lock().unwrap().now, 2, "the waiter waits");

    waiter.abort(); // dropped while queued
    holder_a.abort(); // dropped mid-call
    let _ = (waiter.await, holder_a.await);
    wait_for_slots(&rig.store, 1).await;

    // (A service made ready and dropped before `call` holds nothing by construction:
    // `poll_ready` reserves no slot; the wait happens in the response future.)
    holder_b.abort();
    let _ = holder_b.await;
    wait_for_slots(&rig.store, 0).await;
}

/// Calls in a task that drops the response (and so the slot) as soon as it arrives.
fn spawn_call<S>(service: &S, job: Job) -> tokio::task::JoinHandle<Result<(), BoxError>>
where
    S: Service<http::Request<()>, Error = BoxError> + Clone + Send + 'static,
    S::Future: Send,
    S::Response: Send,
{
    let service = service.clone();
    tokio::spawn(async move { service.oneshot(request(job)).await.map(drop) })
}

/// Polls `done` until it holds (paused time moves on by itself; real time has 5 s).
async fn eventually(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Waits until `n` slots are held (a Redis release is a background round trip).
async fn wait_for_slots(store: &Store, n: u32) {
    for _ in 0..200 {
        if store.slots_in_use(None).await == n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!(
        "slots in use stayed at {}, not {n}",
        store.slots_in_use(None).await
    );
}

/// Holds all 30 default slots (premium) until the returned senders fire.
async fn fill_all_slots(
    service: &(
         impl Service<
        http::Request<()>,
        Response = http::Response<
            fairgate::body::GuardedBody<(), fairgate::tier_slot_limit::SlotPermit>,
        >,
        Error = BoxError,
        Future: Send + 'static,
    > + Clone
         + Send
         + 'static
     ),
) -> Vec<oneshot::Sender<()>> {
    let mut releases = Vec::new();
    for _ in 0..30 {
        let (tx, rx) = oneshot::channel::<()>();
        let response = service
            .clone()
            .oneshot(request(job("premium")))
            .await
            .expect("a free slot");
        tokio::spawn(async move {
            let _ = rx.await;
            drop(response); // the slot lives in the body
        });
        releases.push(tx);
    }
    releases
}

fn instant_upstream()
-> impl Service<http::Request<()>, Response = http::Response<()>, Error = Infallible, Future: Send>
+ Clone
+ Send
+ 'static {
    service_fn(|_: http::Request<()>| async { Ok::<_, Infallible>(http::Response::new(())) })
}

#[tokio::test(start_paused = true)]
async fn free_gives_up_at_12_s_guest_at_8_s_premium_waits_and_gets_a_slot_freed_at_50_s() {
    let (events, _guard) = EventCounter::install();
    let service =
        TierSlotLimitLayer::new(Store::memory(), SlotPolicy::default()).layer(instant_upstream());
    let mut releases = fill_all_slots(&service).await;

    let timed = |tier: &'static str| {
        let service = service.clone();
        tokio::spawn(async move {
            let started = Instant::now();
            let result = service.oneshot(request(job(tier))).await.map(drop);
            (result, started.elapsed())
        })
    };
    let (free, guest, premium) = (timed("free"), timed("guest"), timed("premium"));
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(50)).await;
        drop(releases.pop()); // one premium call ends at 50 s
        tokio::time::sleep(Duration::from_secs(3600)).await;
        drop(releases);
    });

    let (result, waited) = free.await.unwrap();
    let busy = result
        .expect_err("free gives up")
        .downcast::<Busy>()
        .expect("a Busy error");
    assert_eq!(
        (busy.tier().as_str(), waited),
        ("free", Duration::from_secs(12))
    );
    assert_eq!(busy.waited(), Duration::from_secs(12));
    assert_eq!(busy.retry_after(), Duration::from_secs(5));

    let (result, waited) = guest.await.unwrap();
    assert!(result.unwrap_err().is::<Busy>());
    assert_eq!(waited, Duration::from_secs(8));

    let (result, waited) = premium.await.unwrap();
    result.expect("premium got the slot freed at 50 s");
    assert_eq!(waited, Duration::from_secs(50));
    // Each of the three waited past 3 s and said so once.
    assert_eq!(events.count("queue.slow_wait"), 3);
}

/// A flood of slow waits in one tier is one `queue.slow_wait` line per 10 s, not one per
/// request; another tier logs its own, and the next window logs again.
#[tokio::test(start_paused = true)]
async fn slow_waits_are_one_line_per_tier_per_ten_seconds() {
    let (events, _guard) = EventCounter::install();
    let service =
        TierSlotLimitLayer::new(Store::memory(), SlotPolicy::default()).layer(instant_upstream());
    let releases = fill_all_slots(&service).await;
    let wait = |tier: &'static str| {
        let service = service.clone();
        tokio::spawn(async move { service.oneshot(request(job(tier))).await.map(drop) })
    };
    // 40 premium calls and 1 pro call wait past the 3 s mark, all within a second.
    let mut waiting: Vec<_> = (0..40).map(|_| wait("premium")).collect();
    waiting.push(wait("pro"));
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(events.count("queue.slow_wait"), 2, "one line per tier");
    // The next window: one more premium wait past the mark is logged at once.
    tokio::time::sleep(Duration::from_secs(7)).await;
    waiting.push(wait("premium"));
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(events.count("queue.slow_wait"), 3);
    drop(releases);
    for call in waiting {
        let _ = call.await.unwrap();
    }
}

/// The tenants of the calls an upstream saw, in the order they started.
type CallLog = Arc<Mutex<Vec<String>>>;

/// An upstream that logs the tenant of each call as it starts, then takes `hold`.
fn logging_upstream(
    hold: Duration,
) -> (
    CallLog,
    impl Service<http::Request<()>, Response = http::Response<()>, Error = Infallible, Future: Send>
    + Clone
    + Send
    + 'static,
) {
    let order = CallLog::default();
    let log = order.clone();
    let service = service_fn(move |req: http::Request<()>| {
        let log = log.clone();
        async move {
            let tenant = req.extensions().get::<Job>().unwrap().tenant().to_string();
            log.lock().unwrap().push(tenant);
            tokio::time::sleep(hold).await;
            Ok::<_, Infallible>(http::Response::new(()))
        }
    });
    (order, service)
}

#[tokio::test(start_paused = true)]
async fn waiters_of_a_tier_get_slots_in_arrival_order() {
    let policy = SlotPolicy::builder().global_max(1).build().unwrap();
    let (order, inner) = logging_upstream(Duration::from_secs(1));
    let service = TierSlotLimitLayer::new(Store::memory(), policy).layer(inner);
    let mut calls = Vec::new();
    for i in 0..5 {
        let job = Job::new(format!("t{i}"), Origin::UserAction).with_tier("premium");
        calls.push(tokio::spawn(service.clone().oneshot(request(job))));
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    for call in calls {
        call.await.unwrap().unwrap();
    }
    assert_eq!(*order.lock().unwrap(), ["t0", "t1", "t2", "t3", "t4"]);
}

#[tokio::test(start_paused = true)]
async fn a_new_arrival_never_barges_past_a_waiter_of_its_tier() {
    let policy = SlotPolicy::builder().global_max(1).build().unwrap();
    let (order, inner) = logging_upstream(Duration::ZERO);
    let mut service = TierSlotLimitLayer::new(Store::memory(), policy).layer(inner);
    let premium = |tenant: &str| Job::new(tenant, Origin::UserAction).with_tier("premium");
    let held = service
        .clone()
        .oneshot(request(premium("a")))
        .await
        .unwrap();
    let waiter = tokio::spawn(
        service
            .clone()
            .oneshot(request(premium("b")))
            .map(|r| r.map(drop)),
    );
    tokio::time::sleep(Duration::from_millis(10)).await; // b is waiting

    // The slot frees and, before b's task runs again, c arrives and tries at once.
    drop(held);
    ServiceExt::<http::Request<()>>::ready(&mut service)
        .await
        .unwrap();
    let late = service.call(request(premium("c")));
    let late = tokio::spawn(late.map(|r| r.map(drop)));
    waiter.await.unwrap().unwrap();
    late.await.unwrap().unwrap();
    assert_eq!(*order.lock().unwrap(), ["a", "b", "c"], "c went ahead of b");
}

#[tokio::test(start_paused = true)]
async fn the_slow_wait_warning_never_costs_a_waiter_its_place() {
    // free capped at 1, calls of 1 s: A0-A9 at t = 0, B at 10 ms. The 3 s warning fires for
    // A3-A9 while they wait; each must keep its place in the tier's line.
    let policy = SlotPolicy::builder()
        .tier("free", 1, Duration::from_secs(60))
        .build()
        .unwrap();
    let (order, inner) = logging_upstream(Duration::from_secs(1));
    let service = TierSlotLimitLayer::new(Store::memory(), policy).layer(inner);
    let free = |tenant: String| Job::new(tenant, Origin::UserAction).with_tier("free");
    let mut calls = Vec::new();
    for i in 0..10 {
        let call = service.clone().oneshot(request(free(format!("A{i}"))));
        calls.push(tokio::spawn(call.map(|r| r.map(drop))));
        tokio::task::yield_now().await; // each takes its place before the next arrives
    }
    tokio::time::sleep(Duration::from_millis(10)).await;
    let b = service.clone().oneshot(request(free("B".to_owned())));
    calls.push(tokio::spawn(b.map(|r| r.map(drop))));
    for call in calls {
        call.await.unwrap().unwrap();
    }
    let expected: Vec<String> = (0..10)
        .map(|i| format!("A{i}"))
        .chain(["B".into()])
        .collect();
    assert_eq!(*order.lock().unwrap(), expected, "B overtook A's waiters");
}

#[tokio::test(start_paused = true)]
async fn a_streaming_body_keeps_its_slot_until_it_ends() {
    let policy = SlotPolicy::builder().global_max(1).build().unwrap();
    let inner = service_fn(|_: http::Request<()>| async {
        let body = http_body_util::StreamBody::new(futures_util::stream::iter([
            Ok::<_, Infallible>(http_body::Frame::data(bytes::Bytes::from_static(
                b"data: hello\n\n",
            ))),
            Ok(http_body::Frame::data(bytes::Bytes::from_static(
                b"data: world\n\n",
            ))),
        ]));
        Ok::<_, Infallible>(http::Response::new(body))
    });
    let store = Store::memory();
    let service = TierSlotLimitLayer::new(store.clone(), policy).layer(inner);
    let response = service.clone().oneshot(request(job("pro"))).await.unwrap();
    assert_eq!(
        store.slots_in_use(None).await,
        1,
        "headers are back, the body is not"
    );
    let mut body = response.into_body();
    assert!(body.frame().await.is_some());
    assert_eq!(store.slots_in_use(None).await, 1, "mid-stream");
    assert!(body.frame().await.is_some());
    // The last frame, then the end: the slot is free.
    while body.frame().await.is_some() {}
    assert_eq!(store.slots_in_use(None).await, 0);
}

#[tokio::test(start_paused = true)]
async fn an_unknown_tier_is_served_as_guest_and_logged_once() {
    let (events, _guard) = EventCounter::install();
    let store = Store::memory();
    let service =
        TierSlotLimitLayer::new(store.clone(), SlotPolicy::default()).layer(instant_upstream());
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(
            service
                .clone()
                .oneshot(request(job("platinum")))
                .await
                .unwrap(),
        );
    }
    assert_eq!(store.slots_in_use(Some(&Tier::new("guest"))).await, 3);
    assert_eq!(events.count("tier.unknown"), 1);
    drop(held);
    // Tier names come from callers: a flood of made-up ones is logged for the first 100 only.
    for i in 0..150 {
        let response = service
            .clone()
            .oneshot(request(job(&format!("made-up-{i}"))))
            .await;
        drop(response.unwrap());
    }
    assert_eq!(events.count("tier.unknown"), 100);
}

#[tokio::test(start_paused = true)]
async fn early_rejection_refuses_at_once_when_the_expected_wait_is_too_long() {
    let policy = SlotPolicy::builder()
        .global_max(1)
        .tier("free", 1, Duration::from_secs(12))
        .early_reject(true)
        .build()
        .unwrap();
    let (_, inner) = upstream(Duration::from_secs(10));
    let service = TierSlotLimitLayer::new(Store::memory(), policy).layer(inner);
    // Teach it that a call holds its slot 10 s.
    service.clone().oneshot(request(job("free"))).await.unwrap();
    let holder = tokio::spawn(service.clone().oneshot(request(job("free"))));
    let first_waiter = tokio::spawn(service.clone().oneshot(request(job("free"))));
    tokio::time::sleep(Duration::from_millis(1)).await;
    // Two ahead x 10 s each > 12 s: refused without waiting.
    let started = Instant::now();
    let err = service
        .clone()
        .oneshot(request(job("free")))
        .await
        .unwrap_err();
    assert!(err.is::<Busy>());
    assert_eq!(started.elapsed(), Duration::ZERO);
    holder.await.unwrap().unwrap();
    first_waiter.await.unwrap().unwrap();
}

#[tokio::test(start_paused = true)]
async fn early_rejection_never_refuses_a_request_with_nobody_ahead() {
    let policy = SlotPolicy::builder()
        .global_max(2)
        .tier("free", 1, Duration::from_secs(45))
        .early_reject(true)
        .build()
        .unwrap();
    let (_, inner) = upstream(Duration::from_secs(60));
    let service = TierSlotLimitLayer::new(Store::memory(), policy).layer(inner);
    // One call teaches the layer that a call holds its slot 60 s...
    service.clone().oneshot(request(job("free"))).await.unwrap();
    // ...and another holds the tier's one slot for the next 60 s.
    let holding = service.clone().oneshot(request(job("free")));
    // The answer is dropped when the call ends: its slot comes back then.
    let holder = tokio::spawn(async move { holding.await.map(drop) });
    tokio::time::sleep(Duration::from_secs(30)).await;
    // The tier is full and the expected wait (60 s) is over the max wait (45 s), but nobody
    // waits ahead: this call gets its own try, and the slot frees 30 s later, in time.
    let started = Instant::now();
    service
        .clone()
        .oneshot(request(job("free")))
        .await
        .expect("nobody ahead: it waits for its slot");
    assert_eq!(started.elapsed(), Duration::from_secs(30 + 60));
    holder.await.unwrap().unwrap();
}

#[tokio::test]
async fn a_request_without_a_job_is_refused_with_a_typed_error() {
    let _turn = crate::support::file_turn(module_path!());
    let service =
        TierSlotLimitLayer::new(Store::memory(), SlotPolicy::default()).layer(instant_upstream());
    let err = service.oneshot(http::Request::new(())).await.unwrap_err();
    assert!(err.is::<MissingJob>());
}

#[test]
fn invalid_policies_are_refused_with_a_message() {
    let cases = [
        (
            SlotPolicy::builder().global_max(0),
            "global slot cap must be at least 1",
        ),
        (
            SlotPolicy::builder().tier("pro", 0, Duration::ZERO),
            "slot cap of tier pro must be at least 1",
        ),
        (
            SlotPolicy::builder().default_tier("nobody"),
            "default tier nobody has no slot limit configured",
        ),
        (
            SlotPolicy::builder().lease_ttl(Duration::from_millis(5)),
            "lease ttl must be at least 100 ms",
        ),
        (
            SlotPolicy::builder().poll_interval(Duration::ZERO),
            "poll interval must be between 1 ms and 60 s",
        ),
    ];
    for (builder, message) in cases {
        assert_eq!(builder.build().unwrap_err().message(), message);
    }
}

#[cfg(feature = "axum")]
#[tokio::test(start_paused = true)]
async fn busy_becomes_a_503_with_retry_after_and_server_busy_json() {
    use axum::response::IntoResponse;
    let policy = SlotPolicy::builder()
        .global_max(1)
        .tier("free", 1, Duration::ZERO)
        .retry_after(Duration::from_millis(4500))
        .build()
        .unwrap();
    let service = TierSlotLimitLayer::new(Store::memory(), policy).layer(instant_upstream());
    let _held = service.clone().oneshot(request(job("free"))).await.unwrap();
    let busy = service
        .oneshot(request(job("free")))
        .await
        .unwrap_err()
        .downcast::<Busy>()
        .unwrap();
    let response = busy.into_response();
    assert_eq!(response.status(), http::StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(response.headers()[http::header::RETRY_AFTER], "5");
    let body = response.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(&body[..], br#"{"code":"SERVER_BUSY","retry_after":5}"#);
}

/// Calls in flight at the upstream per tenant: now, and the most.
type TenantsSeen = Arc<Mutex<HashMap<String, (u32, u32)>>>;

/// An upstream that takes `hold` per call and records concurrency per tenant.
fn tenant_upstream(
    hold: Duration,
) -> (
    TenantsSeen,
    impl Service<http::Request<()>, Response = http::Response<()>, Error = Infallible, Future: Send>
    + Clone
    + Send
    + 'static,
) {
    let seen = TenantsSeen::default();
    let record = seen.clone();
    let service = service_fn(move |req: http::Request<()>| {
        let seen = record.clone();
        let tenant = req.extensions().get::<Job>().unwrap().tenant().to_string();
        async move {
            {
                let mut s = seen.lock().unwrap();
                let (now, max) = s.entry(tenant.clone()).or_default();
                *now += 1;
                *max = (*max).max(*now);
            }
            tokio::time::sleep(hold).await;
            seen.lock().unwrap().get_mut(&tenant).unwrap().0 -= 1;
            Ok::<_, Infallible>(http::Response::new(()))
        }
    });
    (seen, service)
}

fn tenant_job(tenant: &str) -> Job {
    Job::new(tenant, Origin::UserAction).with_tier("free")
}

async fn a_tenant_at_its_cap_waits_apart_and_another_of_its_tier_goes_at_once(rig: Rig) {
    let policy = SlotPolicy::builder()
        .tier("free", 10, Duration::from_secs(600))
        .tenant_cap("free", 2)
        .poll_interval(Duration::from_millis(20))
        .build()
        .unwrap();
    let (seen, inner) = tenant_upstream(rig.call);
    let service = TierSlotLimitLayer::new(rig.store.clone(), policy).layer(inner);
    // 30 calls of `a`: without its cap, 10 would run and 20 queue in the tier.
    let flood: Vec<_> = (0..30)
        .map(|_| spawn_call(&service, tenant_job("a")))
        .collect();
    tokio::time::sleep(rig.call / 4).await;
    let started = Instant::now();
    service
        .clone()
        .oneshot(request(tenant_job("b")))
        .await
        .expect("b gets a slot");
    let took = started.elapsed();
    // Its own call included: it waited behind none of a's.
    assert!(
        took < rig.call * 3 / 2,
        "b waited behind a's flood: {took:?}"
    );
    for call in flood {
        call.await
            .unwrap()
            .expect("every call of a is served in time");
    }
    let most = seen.lock().unwrap()["a"].1;
    assert_eq!(most, 2, "a held {most} slots at once");
    assert_eq!(rig.store.slots_in_use(None).await, 0);
}

async fn a_tenant_over_its_cap_is_busy_at_its_tiers_max_wait(rig: Rig) {
    let max_wait = rig.call * 2;
    let policy = SlotPolicy::builder()
        .tier("free", 10, max_wait)
        .tenant_cap("free", 1)
        .poll_interval(Duration::from_millis(20))
        .build()
        .unwrap();
    let (seen, inner) = tenant_upstream(rig.call * 10);
    let service = TierSlotLimitLayer::new(rig.store.clone(), policy).layer(inner);
    let holding = spawn_call(&service, tenant_job("a"));
    tokio::time::sleep(rig.call / 4).await;
    let other = spawn_call(&service, tenant_job("b"));
    let started = Instant::now();
    let err = service
        .clone()
        .oneshot(request(tenant_job("a")))
        .await
        .expect_err("a's second call never gets a slot");
    let waited = started.elapsed();
    let busy = err.downcast_ref::<Busy>().expect("Busy");
    assert_eq!(busy.tier().as_str(), "free");
    assert!(
        waited >= max_wait && waited < max_wait + rig.call / 2,
        "busy after {waited:?}, max wait {max_wait:?}"
    );
    // Meanwhile b, of the same tier, went out at once.
    assert_eq!(seen.lock().unwrap()["b"], (1, 1));
    holding.abort();
    other.abort();
}

/// A fair queue above the slot layer that was not handed its gate loses the fair order
/// whenever a cap binds (requests wait for slots in arrival order): the slot layer says so
/// once, naming the fix; wired through the gate, it says nothing.
#[tokio::test(start_paused = true)]
async fn a_fair_queue_not_handed_the_slot_gate_is_warned_of_once() {
    let (events, _guard) = EventCounter::install();
    for wired in [false, true] {
        let store = Store::memory();
        let slots = TierSlotLimitLayer::new(store.clone(), SlotPolicy::default());
        let fair = match wired {
            true => fairgate::DrrFairnessLayer::builder(store.clone(), 8)
                .slot_gate(slots.gate())
                .build()
                .unwrap(),
            false => fairgate::DrrFairnessLayer::new(store.clone(), 8),
        };
        let service = tower::ServiceBuilder::new()
            .layer(fair)
            .layer(slots)
            .service(service_fn(|_req: http::Request<()>| async {
                Ok::<_, Infallible>(http::Response::new(()))
            }));
        for _ in 0..3 {
            let mut req = http::Request::new(());
            req.extensions_mut()
                .insert(Job::new("t", Origin::UserAction).with_tier("free"));
            drop(service.clone().oneshot(req).await.unwrap());
        }
        assert_eq!(
            events.count("slots.fair_queue_ungated"),
            1,
            "after the {} stack",
            if wired { "wired" } else { "unwired" }
        );
    }
}
