//! A model test of the combined admission: random arrivals of tenants, tiers (an unknown one
//! too), priorities, costs and call durations, some callers giving up at a random moment,
//! through the whole recommended stack (PriorityClassify, RetryAfterBackoff, DrrFairness,
//! TierSlotLimit) on the memory store, each case in its own paused-time runtime. Everything is
//! checked from outside the library: a mock upstream counts the calls in flight, each caller
//! records how its request ended, and at quiescent moments between events the waiting
//! requests are compared with the room left in their tier, the global cap and the window.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use fairgate::{
    BackoffPolicy, BoxError, Busy, DemotionPolicy, DrrFairnessLayer, Job, Origin,
    PriorityClassifyLayer, RetryAfterBackoffLayer, SlotGate, SlotPolicy, Store, TierSlotLimitLayer,
};

use fairgate::drr_fairness::error::QueueFull;
use proptest::prelude::*;
use proptest::test_runner::FileFailurePersistence;
use tokio::time::Instant;
use tower::{ServiceBuilder, ServiceExt, service_fn};

use crate::support::rate_limited::RequestCells;

/// The tiers of the policy, in the order of `Limits::caps`.
const TIERS: [&str; 4] = ["premium", "pro", "free", "guest"];
/// What callers send: the four tiers, a name the policy does not know, and no tier at all.
const SENT_TIERS: [Option<&str>; 6] = [
    Some("premium"),
    Some("pro"),
    Some("free"),
    Some("guest"),
    Some("platinum"),
    None,
];
/// Every event (arrival, end of a call, a caller giving up, a max wait) falls on this grid;
/// the checks run half-way between two ticks, when nothing is due.
const TICK: Duration = Duration::from_millis(10);
/// Timer slack: tokio's timers round up to the millisecond.
const SLACK: Duration = Duration::from_millis(5);

/// The slot policy and the window of one case.
#[derive(Clone, Debug)]
struct Limits {
    global: u32,
    caps: [u32; 4],
    max_waits: [Duration; 4],
    window: usize,
    /// An optional per-tenant queue limit, so some requests end `QueueFull`.
    queue_per_tenant: Option<usize>,
    /// The provider's rate in requests per minute, if it binds: the upstream keeps a token
    /// bucket, sends Anthropic's rate-limit headers and answers 429 when over; the stack
    /// learns the rate and its fair queue consults it.
    rpm: Option<u32>,
}

impl Limits {
    /// The time between two calls the stack paces to (0.95 of the rate).
    fn paced_interval(&self) -> Option<Duration> {
        self.rpm
            .map(|rpm| Duration::from_secs_f64(60.0 / (0.95 * f64::from(rpm))))
    }
}

impl Limits {
    fn policy(&self) -> SlotPolicy {
        let mut builder = SlotPolicy::builder().global_max(self.global).seed(7);
        for (t, tier) in TIERS.iter().enumerate() {
            // Every class of a tier waits the tier's wait here: the model checks the caps and
            // each request's end against one wait (the class waits: `tier_slot_limit::`).
            let wait = self.max_waits[t];
            builder = builder
                .tier(*tier, self.caps[t], wait)
                .standard_max_wait(*tier, wait)
                .batch_max_wait(*tier, wait);
        }
        builder.build().expect("a valid policy")
    }
}

/// One caller.
#[derive(Clone, Debug)]
struct Arrival {
    tenant: usize,
    /// Index into `SENT_TIERS`.
    tier: usize,
    origin: Origin,
    sla: Option<Duration>,
    cost: u32,
    at: Duration,
    call: Duration,
    /// The caller drops its future this long after sending, if it has no answer by then.
    gives_up_after: Option<Duration>,
}

impl Arrival {
    /// The tier the caps count it under: an unknown tier (or none) is `guest`.
    fn counted(&self) -> usize {
        self.tier.min(3)
    }

    fn job(&self) -> Job {
        let mut job = Job::new(format!("t{}", self.tenant), self.origin).with_cost(self.cost);
        if let Some(tier) = SENT_TIERS[self.tier] {
            job = job.with_tier(tier);
        }
        if let Some(sla) = self.sla {
            job = job.with_sla(sla);
        }
        job
    }
}

fn ticks(range: std::ops::RangeInclusive<u64>) -> impl Strategy<Value = Duration> {
    range.prop_map(|n| TICK * n as u32)
}

fn limits() -> impl Strategy<Value = Limits> {
    (
        2..=6u32,
        prop::array::uniform4(1..=4u32),
        prop::array::uniform4(1..=5u64),
        1..=8usize,
        prop::option::weighted(0.5, 1..=3usize),
    )
        .prop_map(|(global, caps, waits, window, queue_per_tenant)| Limits {
            global,
            caps,
            max_waits: waits.map(Duration::from_secs),
            window,
            queue_per_tenant,
            rpm: None,
        })
}

/// The same, under a provider rate of 60 to 1,200 requests a minute.
fn rated_limits() -> impl Strategy<Value = Limits> {
    (limits(), 60..=1_200u32).prop_map(|(limits, rpm)| Limits {
        rpm: Some(rpm),
        ..limits
    })
}

fn arrival() -> impl Strategy<Value = Arrival> {
    (
        0..5usize,
        0..SENT_TIERS.len(),
        prop::sample::select(vec![
            Origin::UserAction,
            Origin::Scheduled,
            Origin::BatchJob,
        ]),
        prop::sample::select(vec![
            None,
            Some(Duration::from_secs(60)),
            Some(Duration::from_secs(48 * 3600)),
        ]),
        1..20_000u32,
        ticks(0..=300),
        ticks(5..=200),
        prop::option::weighted(0.2, ticks(0..=400)),
    )
        .prop_map(
            |(tenant, tier, origin, sla, cost, at, call, gives_up_after)| Arrival {
                tenant,
                tier,
                origin,
                sla,
                cost,
                at,
                call,
                gives_up_after,
            },
        )
}

/// How a request ended, as its caller saw it.
#[derive(Clone, Copy, Debug, PartialEq)]
enum End {
    Served,
    Busy,
    QueueFull,
    Dropped,
}

/// What the outside world knows of one request.
#[derive(Clone, Debug, Default)]
struct Seen {
    sent: Option<Instant>,
    /// Calls that reached the upstream (at most one: nothing is throttled here).
    calls: u32,
    started: Option<Instant>,
    call_over: bool,
    end: Option<(End, Instant)>,
}

#[derive(Default)]
struct Track {
    requests: Vec<Seen>,
    in_flight: u32,
    by_tier: [u32; 4],
    violations: Vec<String>,
    /// The provider's request bucket, from the first call under a rate.
    cells: Option<RequestCells>,
    /// When the last call reached the upstream.
    last_start: Option<Instant>,
    /// When the last answer said the bucket was empty (`-remaining: 0`): the stack paces
    /// from that answer, as from a call that went then.
    last_empty: Option<Instant>,
}

type Shared = Arc<Mutex<Track>>;

/// A call in flight at the upstream; counted out when the call ends or is dropped.
struct InFlight {
    track: Shared,
    id: usize,
    tier: usize,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let mut track = self.track.lock().unwrap();
        track.in_flight -= 1;
        track.by_tier[self.tier] -= 1;
        track.requests[self.id].call_over = true;
    }
}

type Stack = tower::util::BoxCloneSyncService<http::Request<String>, (), BoxError>;

/// Takes a cell of the provider's request bucket: the cells left, or `None` when it is
/// empty (a 429). Always a cell without a rate.
fn take_cell(t: &mut Track, limits: &Limits, origin: Instant) -> Option<u32> {
    let Some(rpm) = limits.rpm else {
        return Some(0);
    };
    let now = Instant::now().saturating_duration_since(origin);
    t.cells
        .get_or_insert_with(|| RequestCells::new(rpm))
        .take(now)
}

/// An answer with Anthropic's request-limit headers (under a rate), or a 429 when the
/// bucket was empty.
fn rated(
    mut response: http::Response<String>,
    limits: &Limits,
    remaining: Option<u32>,
) -> http::Response<String> {
    let Some(rpm) = limits.rpm else {
        return response;
    };
    let headers = response.headers_mut();
    headers.insert("anthropic-ratelimit-requests-limit", rpm.into());
    headers.insert(
        "anthropic-ratelimit-requests-remaining",
        remaining.unwrap_or(0).into(),
    );
    if remaining.is_none() {
        *response.status_mut() = http::StatusCode::TOO_MANY_REQUESTS;
        response.headers_mut().insert("retry-after", 1.into());
    }
    response
}

/// The recommended stack over a mock upstream that checks the caps at every call's start.
fn stack(
    store: &Store,
    retry: RetryAfterBackoffLayer,
    fair: &DrrFairnessLayer,
    slots: TierSlotLimitLayer,
    limits: &Limits,
    arrivals: Arc<Vec<Arrival>>,
    track: Shared,
) -> Stack {
    let demotion = DemotionPolicy::builder()
        .default_daily_budget(u64::MAX)
        .throttle_limit(u32::MAX)
        .build()
        .unwrap();
    let limits = limits.clone();
    let origin = Instant::now();
    let upstream = service_fn(move |req: http::Request<String>| {
        // The warm-up call (under a rate): answered at once, counted by the bucket only.
        if req.body() == "warm-up" {
            let mut t = track.lock().unwrap();
            let remaining = take_cell(&mut t, &limits, origin);
            t.last_start = Some(Instant::now());
            let response = rated(http::Response::new(String::new()), &limits, remaining);
            return futures_util::future::Either::Left(std::future::ready(Ok::<_, BoxError>(
                response,
            )));
        }
        let id: usize = req.body().parse().expect("the body names the request");
        let arrival = &arrivals[id];
        let tier = arrival.counted();
        let mut remaining = None;
        let guard = {
            let mut t = track.lock().unwrap();
            let now = Instant::now();
            if limits.rpm.is_some() {
                remaining = take_cell(&mut t, &limits, origin);
                if remaining.is_none() {
                    t.violations.push(format!(
                        "request {id} answered 429: over the provider's rate"
                    ));
                }
                // Within a tenant, class and tier, requests go in the order they came.
                let sent = t.requests[id].sent;
                let overtaken: Vec<usize> = t
                    .requests
                    .iter()
                    .enumerate()
                    .filter(|(other, seen)| {
                        let a = &arrivals[*other];
                        *other != id
                            && seen.sent.is_some_and(|at| Some(at) < sent)
                            && seen.started.is_none()
                            && seen.end.is_none()
                            && (a.tenant, a.origin, a.sla, a.counted())
                                == (arrival.tenant, arrival.origin, arrival.sla, tier)
                    })
                    .map(|(other, _)| other)
                    .collect();
                for other in overtaken {
                    t.violations.push(format!(
                        "request {id} went before request {other} of its tenant, class and \
                         tier, sent earlier"
                    ));
                }
                t.last_start = Some(now);
            }
            t.in_flight += 1;
            t.by_tier[tier] += 1;
            let (in_flight, in_tier) = (t.in_flight, t.by_tier[tier]);
            if in_flight > limits.global {
                t.violations.push(format!(
                    "{in_flight} calls in flight, global cap {}",
                    limits.global
                ));
            }
            if in_tier > limits.caps[tier] {
                t.violations.push(format!(
                    "{in_tier} calls of {} in flight, cap {}",
                    TIERS[tier], limits.caps[tier]
                ));
            }
            let seen = &mut t.requests[id];
            seen.calls += 1;
            seen.started = Some(now);
            InFlight {
                track: track.clone(),
                id,
                tier,
            }
        };
        let call = arrival.call;
        let limits = limits.clone();
        let track = track.clone();
        futures_util::future::Either::Right(async move {
            tokio::time::sleep(call).await;
            if remaining == Some(0) && limits.rpm.is_some() {
                track.lock().unwrap().last_empty = Some(Instant::now());
            }
            drop(guard);
            Ok::<_, BoxError>(rated(
                http::Response::new(String::new()),
                &limits,
                remaining,
            ))
        })
    });
    let service = ServiceBuilder::new()
        .layer(PriorityClassifyLayer::new(store.clone()).demotion(demotion))
        .layer(retry)
        .layer(fair.clone())
        .layer(slots)
        .service(upstream)
        // The body is whole at once: dropping the response releases everything.
        .map_response(drop);
    tower::util::BoxCloneSyncService::new(service)
}

/// One case: every violation found, empty if none.
async fn run(limits: Limits, arrivals: Vec<Arrival>) -> Vec<String> {
    let store = Store::memory();
    let slots = TierSlotLimitLayer::new(store.clone(), limits.policy());
    let mut fair = DrrFairnessLayer::builder(store.clone(), limits.window).slot_gate(slots.gate());
    let retry = match limits.rpm {
        // Without a rate: learned pacing's slow start holds calls at cold start by design
        // (tested in tests/memory/learned_pacing.rs); this model is about the fair queue and caps.
        None => RetryAfterBackoffLayer::new(
            store.clone(),
            BackoffPolicy::builder()
                .learned_pacing(false)
                .build()
                .expect("a valid policy"),
        ),
        // Under a rate: learned, and consulted by the fair queue.
        Some(_) => {
            let policy = BackoffPolicy::builder()
                .seed(7)
                .build()
                .expect("a valid policy");
            let (retry, rate) =
                RetryAfterBackoffLayer::new(store.clone(), policy).with_gate_below();
            fair = fair.rate_gate(rate);
            retry
        }
    };
    if let Some(limit) = limits.queue_per_tenant {
        fair = fair.max_queued_per_tenant(limit);
    }
    let fair = fair.build().expect("a valid window");
    let track: Shared = Arc::new(Mutex::new(Track {
        requests: vec![Seen::default(); arrivals.len()],
        ..Track::default()
    }));
    let arrivals = Arc::new(arrivals);
    let stack = stack(
        &store,
        retry,
        &fair,
        slots,
        &limits,
        arrivals.clone(),
        track.clone(),
    );
    if limits.rpm.is_some() {
        // One call first, so the rate is learned before the arrivals (slow start holds calls
        // at cold start by design, tested in tests/memory/stack_rate.rs).
        let mut req = http::Request::new("warm-up".to_owned());
        req.extensions_mut()
            .insert(Job::new("warm-up", Origin::UserAction).with_tier("premium"));
        if let Err(e) = stack.clone().oneshot(req).await {
            return vec![format!("the warm-up call failed: {e}")];
        }
    }
    let start = Instant::now();

    let callers: Vec<_> = (0..arrivals.len())
        .map(|id| {
            let (stack, track, arrival) = (stack.clone(), track.clone(), arrivals[id].clone());
            tokio::spawn(async move {
                tokio::time::sleep_until(start + arrival.at).await;
                let mut req = http::Request::new(id.to_string());
                req.extensions_mut().insert(arrival.job());
                track.lock().unwrap().requests[id].sent = Some(Instant::now());
                let call = stack.oneshot(req);
                let result = match arrival.gives_up_after {
                    Some(after) => tokio::select! {
                        result = call => Some(result),
                        _ = tokio::time::sleep(after) => None,
                    },
                    None => Some(call.await),
                };
                let end = match result {
                    None => End::Dropped,
                    Some(Ok(())) => End::Served,
                    Some(Err(e)) if e.is::<Busy>() => End::Busy,
                    Some(Err(e)) if e.is::<QueueFull>() => End::QueueFull,
                    Some(Err(e)) => {
                        track
                            .lock()
                            .unwrap()
                            .violations
                            .push(format!("request {id} failed with {e}"));
                        End::Dropped
                    }
                };
                let mut t = track.lock().unwrap();
                match t.requests[id].end {
                    None => t.requests[id].end = Some((end, Instant::now())),
                    Some(first) => t
                        .violations
                        .push(format!("request {id} ended twice: {first:?}, {end:?}")),
                }
            })
        })
        .collect();

    // Quiescent moments: half-way between ticks, after letting every task run.
    let mut violations = Vec::new();
    for k in 0u32.. {
        tokio::time::sleep_until(start + TICK * k + TICK / 2).await;
        for _ in 0..4 {
            tokio::task::yield_now().await;
        }
        let at = Instant::now().saturating_duration_since(start);
        let window = fair.in_flight();
        let slots_used = store.slots_in_use(None).await;
        let t = track.lock().unwrap();
        if window > limits.window {
            violations.push(format!(
                "at {at:?}: {window} permits, window {}",
                limits.window
            ));
        }
        if window as u32 != t.in_flight || slots_used != t.in_flight {
            violations.push(format!(
                "at {at:?}: {} calls in flight, {window} permits, {slots_used} slots",
                t.in_flight
            ));
        }
        for (id, seen) in t.requests.iter().enumerate() {
            if seen.sent.is_none() || seen.started.is_some() || seen.end.is_some() {
                continue;
            }
            let tier = arrivals[id].counted();
            let tier_full = t.by_tier[tier] >= limits.caps[tier];
            let global_full = t.in_flight >= limits.global;
            let window_full = window >= limits.window;
            // The rate holds calls back only while it is spent: a call went within the last
            // paced interval. An idle upstream with a request waiting and room for it is a
            // cell held by nobody.
            let now = Instant::now();
            let rate_busy = limits.paced_interval().is_some_and(|interval| {
                [t.last_start, t.last_empty]
                    .into_iter()
                    .flatten()
                    .any(|at| now.saturating_duration_since(at) < interval + TICK + SLACK)
            });
            if !(tier_full || global_full || window_full || rate_busy) {
                violations.push(format!(
                    "at {at:?}: request {id} ({}) waits with room: tier {}/{}, global {}/{}, \
                     window {window}/{}",
                    TIERS[tier],
                    t.by_tier[tier],
                    limits.caps[tier],
                    t.in_flight,
                    limits.global,
                    limits.window
                ));
            }
        }
        let all_ended = t.requests.iter().all(|s| s.end.is_some());
        drop(t);
        if !violations.is_empty() || all_ended {
            break;
        }
        if at > Duration::from_secs(60) {
            violations.push("requests still unfinished after 60 s".to_owned());
            break;
        }
    }
    for caller in callers {
        caller.abort();
        if let Err(e) = caller.await
            && !e.is_cancelled()
        {
            violations.push(format!("a caller panicked: {e}"));
        }
    }
    if !violations.is_empty() {
        return violations;
    }

    // Every request ended exactly once, in a way that fits what the upstream saw, within
    // its tier's max wait of its arrival.
    tokio::time::sleep(TICK).await;
    violations.extend(check_ends(&track.lock().unwrap(), &arrivals, &limits));
    let (window, queued, slots_used) = (
        fair.in_flight(),
        fair.queued(None),
        store.slots_in_use(None).await,
    );
    if window != 0 || queued != 0 || slots_used != 0 {
        violations.push(format!(
            "at the end: {window} permits, {queued} queued, {slots_used} slots held"
        ));
    }
    violations
}

/// How each request ended, checked against what the upstream saw and its tier's max wait.
fn check_ends(t: &Track, arrivals: &[Arrival], limits: &Limits) -> Vec<String> {
    let mut violations = Vec::new();
    violations.extend(t.violations.iter().cloned());
    for (id, (seen, arrival)) in t.requests.iter().zip(arrivals.iter()).enumerate() {
        let (Some(sent), Some((end, ended))) = (seen.sent, seen.end) else {
            violations.push(format!("request {id} never ended: {seen:?}"));
            continue;
        };
        let max_wait = limits.max_waits[arrival.counted()];
        let waited = ended.saturating_duration_since(sent);
        let ok = match end {
            End::Served => {
                let started = seen.started.map(|s| s.saturating_duration_since(sent));
                seen.calls == 1 && seen.call_over && started.is_some_and(|s| s <= max_wait + SLACK)
            }
            End::Busy => seen.calls == 0 && waited >= max_wait && waited <= max_wait + SLACK,
            End::QueueFull => seen.calls == 0 && waited <= SLACK,
            End::Dropped => seen.calls <= 1 && seen.call_over == (seen.calls == 1),
        };
        if !ok {
            violations.push(format!(
                "request {id} ({:?} of {}, max wait {max_wait:?}) ended {end:?} after \
                 {waited:?}: {seen:?}",
                SENT_TIERS[arrival.tier],
                TIERS[arrival.counted()],
            ));
        }
    }
    violations
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 48,
        failure_persistence: Some(Box::new(FileFailurePersistence::WithSource("regressions"))),
        ..ProptestConfig::default()
    })]

    #[test]
    fn the_stack_keeps_the_caps_conserves_work_and_ends_every_request_once_within_its_max_wait(
        limits in limits(),
        arrivals in prop::collection::vec(arrival(), 1..40),
    ) {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .unwrap();
        let violations = runtime.block_on(run(limits.clone(), arrivals));
        prop_assert!(violations.is_empty(), "{limits:?}:\n{}", violations.join("\n"));
    }

    /// The same under a random provider rate that the stack learns from the answers'
    /// headers: no call is answered 429, no request waits while its tier, the window and
    /// the rate have room (an idle upstream with a request waiting is a cell nobody used),
    /// requests of one tenant, class and tier go in the order they came, every request
    /// ends once, and a tier's max wait holds from arrival.
    #[test]
    fn under_a_random_rate_the_stack_keeps_the_caps_and_the_rate_and_wastes_no_cell(
        limits in rated_limits(),
        arrivals in prop::collection::vec(arrival(), 1..40),
    ) {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .unwrap();
        let violations = runtime.block_on(run(limits.clone(), arrivals));
        prop_assert!(violations.is_empty(), "{limits:?}:\n{}", violations.join("\n"));
    }
}

// ---------- the seam between DrrFairness and TierSlotLimit ----------

/// Five requests at once through a DrrFairness (window 8), given `fair_gate` if any, over a
/// TierSlotLimit capped at one call on `slot_store`: the most calls in flight at once.
async fn most_in_flight_through(fair_gate: Option<SlotGate>, slot_store: Store) -> u32 {
    let policy = SlotPolicy::builder().global_max(1).build().unwrap();
    let counts = Arc::new(Mutex::new((0u32, 0u32)));
    let upstream = {
        let counts = counts.clone();
        service_fn(move |_: http::Request<String>| {
            let counts = counts.clone();
            {
                let mut c = counts.lock().unwrap();
                c.0 += 1;
                c.1 = c.1.max(c.0);
            }
            async move {
                tokio::time::sleep(Duration::from_secs(1)).await;
                counts.lock().unwrap().0 -= 1;
                Ok::<_, BoxError>(http::Response::new(String::new()))
            }
        })
    };
    let mut fair = DrrFairnessLayer::builder(Store::memory(), 8);
    if let Some(gate) = fair_gate {
        fair = fair.slot_gate(gate);
    }
    let stack = ServiceBuilder::new()
        .layer(fair.build().unwrap())
        .layer(TierSlotLimitLayer::new(slot_store, policy))
        .service(upstream)
        .map_response(drop);
    let calls: Vec<_> = (0..5)
        .map(|i| {
            let mut req = http::Request::new(String::new());
            req.extensions_mut()
                .insert(Job::new(format!("t{i}"), Origin::UserAction).with_tier("pro"));
            tokio::spawn(stack.clone().oneshot(req))
        })
        .collect();
    for call in calls {
        let _ = call.await.unwrap();
    }
    counts.lock().unwrap().1
}

/// A DrrFairness given no slot gate takes no slot, so it must not tell the TierSlotLimit
/// below it that the request holds one.
#[tokio::test(start_paused = true)]
async fn a_fair_queue_without_a_slot_gate_leaves_the_slot_layer_its_caps() {
    let most = most_in_flight_through(None, Store::memory()).await;
    assert_eq!(most, 1, "the slot layer's global cap of 1 was skipped");
}

/// A DrrFairness given another slot layer's gate takes that layer's slot, not the one
/// below it, whose caps must still hold: on another store, and on the same store (where a
/// registry of policies kept in the store would mistake one for the other).
#[tokio::test(start_paused = true)]
async fn a_fair_queue_with_another_slot_layers_gate_leaves_the_slot_layer_its_caps() {
    let other = TierSlotLimitLayer::new(Store::memory(), SlotPolicy::default());
    let most = most_in_flight_through(Some(other.gate()), Store::memory()).await;
    assert_eq!(
        most, 1,
        "another store: the slot layer's global cap of 1 was skipped"
    );

    // On the same store both layers count in one place: each call holds a slot of each,
    // so the slot layer's cap of 1 is full with the fair queue's own slot and its calls
    // end `Busy` at their max wait. What must hold is that the cap is not skipped.
    let store = Store::memory();
    let other = TierSlotLimitLayer::new(store.clone(), SlotPolicy::default());
    let most = most_in_flight_through(Some(other.gate()), store).await;
    assert!(
        most <= 1,
        "the same store: the slot layer's global cap of 1 was skipped ({most} at once)"
    );
}
