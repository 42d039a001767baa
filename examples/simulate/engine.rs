//! The simulator's engine, shared by `examples/simulate/main.rs` and `tests/memory/simulate.rs`:
//! a mock Claude upstream as a tower `Service`, workload generators, the two policies
//! (naive: a FIFO `ConcurrencyLimit` and immediate retries; fairgate: the real
//! `FairgateLayer` on `Store::memory()`), and the five published scenarios.
//!
//! Everything runs in tokio's paused time and draws its randomness from [`Rng`], seeded:
//! the same seed gives the same numbers.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use fairgate::{
    BackoffPolicy, BoxError, Busy, FairgateLayer, Job, Origin, SlotPolicy, Store, WaitReason,
};
use tokio::time::Instant;
use tower::limit::ConcurrencyLimitLayer;
use tower::util::BoxCloneSyncService;
use tower::{Layer, Service, ServiceExt};

/// The tiers, best first; the index of a tier in the in-flight timeline.
pub const TIERS: [&str; 4] = ["premium", "pro", "free", "guest"];

fn tier_index(tier: &str) -> usize {
    TIERS.iter().position(|t| *t == tier).unwrap_or(3)
}

// ---------------------------------------------------------------------------------------
// Randomness

/// A small seeded PRNG (SplitMix64): enough for workloads, and the same for a seed.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed ^ 0x5DEE_CE66_D1CE_4E5B)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in `lo..=hi`.
    pub fn between(&mut self, lo: u32, hi: u32) -> u32 {
        lo + (self.next_u64() % u64::from(hi - lo + 1)) as u32
    }

    /// Exponential with `mean` (Poisson arrivals).
    pub fn exp(&mut self, mean: f64) -> f64 {
        -mean * (1.0 - self.unit()).ln()
    }
}

// ---------------------------------------------------------------------------------------
// The mock upstream

/// Request headers the mock reads (the workload's truth: who, and how long the answer is).
pub const TENANT: &str = "x-sim-tenant";
pub const TIER: &str = "x-sim-tier";
pub const INPUT: &str = "x-sim-input-tokens";
pub const OUTPUT: &str = "x-sim-output-tokens";
/// A replayed call's recorded upstream latency and status (`--replay`): the mock answers
/// in that time, with that status when it was a 429 or a 5xx.
pub const LATENCY: &str = "x-sim-latency-ms";
pub const STATUS: &str = "x-sim-status";

/// The provider's limits and latency.
#[derive(Clone, Debug)]
pub struct Upstream {
    pub rpm: f64,
    pub itpm: f64,
    pub otpm: f64,
    /// A success takes `base + output tokens x per_token`.
    pub base: Duration,
    pub per_token: Duration,
    /// A 429 or 529 is answered this fast.
    pub refusal: Duration,
    /// Windows (from the start) in which every call is answered `529 overloaded_error`.
    pub overloaded: Vec<(Duration, Duration)>,
}

impl Upstream {
    /// Limits so high they never bind: only concurrency does.
    pub fn roomy() -> Self {
        Upstream {
            rpm: 1_000_000.0,
            itpm: 1_000_000_000.0,
            otpm: 1_000_000_000.0,
            base: Duration::from_millis(400),
            per_token: Duration::from_millis(4),
            refusal: Duration::from_millis(40),
            overloaded: Vec::new(),
        }
    }
}

/// One of the provider's per-minute token buckets, refilled continuously.
#[derive(Clone, Copy, Debug)]
struct Bucket {
    limit: f64,
    level: f64,
}

impl Bucket {
    fn new(limit: f64) -> Self {
        Bucket {
            limit,
            level: limit,
        }
    }

    fn refill(&mut self, secs: f64) {
        self.level = (self.level + secs * self.limit / 60.0).min(self.limit);
    }

    /// Seconds until `need` fits (0 if it does now).
    fn until(&self, need: f64) -> f64 {
        ((need.min(self.limit) - self.level) * 60.0 / self.limit).max(0.0)
    }
}

#[derive(Debug)]
struct UpState {
    requests: Bucket,
    input: Bucket,
    output: Bucket,
    refilled: Instant,
    start: Instant,
    attempts: u64,
    throttled: u64,
    overloaded: u64,
    in_flight: [u32; 4],
    /// `(seconds from start, in flight per tier)` at every change.
    timeline: Vec<(f64, [u32; 4])>,
    /// `(seconds from start, tenant, input tokens)` per success, when it was answered.
    served: Vec<(f64, String, u32)>,
    /// `(seconds from start, answered 429)` per attempt, when it arrived.
    attempt_log: Vec<(f64, bool)>,
}

/// The mock Claude API: RPM / input / output token buckets, the
/// `anthropic-ratelimit-*-limit` / `-remaining` headers on every answer, a real 429 with
/// `retry-after` when a bucket is short, a latency growing with the answer's length, and
/// optional 529 bursts. Cheap to clone; clones share the buckets and the record.
#[derive(Clone, Debug)]
pub struct MockClaude {
    state: Arc<Mutex<UpState>>,
    config: Arc<Upstream>,
}

enum Verdict {
    Ok { output: u32 },
    Throttled { retry_after: u64 },
    Overloaded,
}

impl MockClaude {
    pub fn new(config: Upstream) -> Self {
        let now = Instant::now();
        MockClaude {
            state: Arc::new(Mutex::new(UpState {
                requests: Bucket::new(config.rpm),
                input: Bucket::new(config.itpm),
                output: Bucket::new(config.otpm),
                refilled: now,
                start: now,
                attempts: 0,
                throttled: 0,
                overloaded: 0,
                in_flight: [0; 4],
                timeline: Vec::new(),
                served: Vec::new(),
                attempt_log: Vec::new(),
            })),
            config: Arc::new(config),
        }
    }

    /// Forgets the record (not the buckets) and starts its clock now.
    pub fn restart_record(&self) {
        let mut s = self.state.lock().unwrap();
        s.start = Instant::now();
        s.attempts = 0;
        s.throttled = 0;
        s.overloaded = 0;
        s.timeline.clear();
        s.served.clear();
        s.attempt_log.clear();
    }

    fn arrive(&self, tier: usize, input: u32, output: u32, forced: Option<u16>) -> Verdict {
        let verdict = self.judge(tier, input, output, forced);
        let mut s = self.state.lock().unwrap();
        let since = Instant::now()
            .saturating_duration_since(s.start)
            .as_secs_f64();
        let throttled = matches!(verdict, Verdict::Throttled { .. });
        s.attempt_log.push((since, throttled));
        verdict
    }

    fn judge(&self, tier: usize, input: u32, output: u32, forced: Option<u16>) -> Verdict {
        let mut s = self.state.lock().unwrap();
        let now = Instant::now();
        let secs = now.saturating_duration_since(s.refilled).as_secs_f64();
        s.refilled = now;
        s.requests.refill(secs);
        s.input.refill(secs);
        s.output.refill(secs);
        s.attempts += 1;
        match forced {
            Some(429) => {
                s.throttled += 1;
                return Verdict::Throttled { retry_after: 1 };
            }
            Some(status) if status >= 500 => {
                s.overloaded += 1;
                return Verdict::Overloaded;
            }
            _ => {}
        }
        let since = now.saturating_duration_since(s.start);
        if self
            .config
            .overloaded
            .iter()
            .any(|(from, to)| since >= *from && since < *to)
        {
            s.overloaded += 1;
            return Verdict::Overloaded;
        }
        let wait = s
            .requests
            .until(1.0)
            .max(s.input.until(f64::from(input)))
            .max(s.output.until(1.0));
        if wait > 0.0 {
            s.throttled += 1;
            return Verdict::Throttled {
                retry_after: wait.ceil().max(1.0) as u64,
            };
        }
        s.requests.level -= 1.0;
        s.input.level -= f64::from(input);
        s.in_flight[tier] += 1;
        let point = (since.as_secs_f64(), s.in_flight);
        s.timeline.push(point);
        Verdict::Ok { output }
    }

    fn answer(
        &self,
        tier: usize,
        tenant: String,
        input: u32,
        verdict: Verdict,
    ) -> http::Response<String> {
        let mut s = self.state.lock().unwrap();
        let (status, body) = match verdict {
            Verdict::Ok { output } => {
                s.output.level -= f64::from(output);
                s.in_flight[tier] -= 1;
                let since = Instant::now()
                    .saturating_duration_since(s.start)
                    .as_secs_f64();
                let point = (since, s.in_flight);
                s.timeline.push(point);
                s.served.push((since, tenant, input));
                (
                    200,
                    format!(
                        r#"{{"type":"message","content":[],"usage":{{"input_tokens":{input},"output_tokens":{output}}}}}"#
                    ),
                )
            }
            Verdict::Throttled { .. } => (
                429,
                r#"{"type":"error","error":{"type":"rate_limit_error","message":"rate limited"}}"#
                    .to_owned(),
            ),
            Verdict::Overloaded => (
                529,
                r#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}"#
                    .to_owned(),
            ),
        };
        let mut builder = http::Response::builder().status(status);
        for (name, b) in [
            ("requests", s.requests),
            ("input-tokens", s.input),
            ("output-tokens", s.output),
        ] {
            builder = builder
                .header(format!("anthropic-ratelimit-{name}-limit"), b.limit as u64)
                .header(
                    format!("anthropic-ratelimit-{name}-remaining"),
                    b.level.max(0.0).floor() as u64,
                );
        }
        if let Verdict::Throttled { retry_after } = verdict {
            builder = builder.header("retry-after", retry_after);
        }
        builder.body(body).expect("a valid response")
    }
}

fn header<'a>(req: &'a http::Request<String>, name: &str) -> &'a str {
    req.headers()
        .get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
}

impl Service<http::Request<String>> for MockClaude {
    type Response = http::Response<String>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<String>) -> Self::Future {
        let tier = tier_index(header(&req, TIER));
        let tenant = header(&req, TENANT).to_owned();
        let input = header(&req, INPUT).parse().unwrap_or(1);
        let output = header(&req, OUTPUT).parse().unwrap_or(1);
        let forced = header(&req, STATUS).parse().ok();
        let recorded = header(&req, LATENCY)
            .parse()
            .ok()
            .map(Duration::from_millis);
        let verdict = self.arrive(tier, input, output, forced);
        let latency = match verdict {
            Verdict::Ok { output } => {
                recorded.unwrap_or_else(|| self.config.base + self.config.per_token * output)
            }
            _ => recorded.unwrap_or(self.config.refusal),
        };
        let this = self.clone();
        Box::pin(async move {
            tokio::time::sleep(latency).await;
            Ok(this.answer(tier, tenant, input, verdict))
        })
    }
}

// ---------------------------------------------------------------------------------------
// Workloads and policies

/// One call of a workload.
#[derive(Clone, Debug)]
pub struct Call {
    pub at: Duration,
    pub tenant: String,
    pub tier: &'static str,
    pub origin: Origin,
    pub sla: Option<Duration>,
    pub input: u32,
    pub output: u32,
    /// A replayed call: the upstream's latency and status as recorded (`None`: the mock's
    /// own model).
    pub latency: Option<Duration>,
    pub status: Option<u16>,
}

impl Call {
    fn request(&self) -> http::Request<String> {
        let mut req = http::Request::post("https://api.anthropic.com/v1/messages")
            .header(TENANT, &self.tenant)
            .header(TIER, self.tier)
            .header(INPUT, self.input)
            .header(OUTPUT, self.output)
            .body(r#"{"model":"claude-sonnet-4-5","max_tokens":1024,"messages":[]}"#.to_owned())
            .expect("a valid request");
        if let Some(latency) = self.latency {
            req.headers_mut()
                .insert(LATENCY, http::HeaderValue::from(latency.as_millis() as u64));
        }
        if let Some(status) = self.status {
            req.headers_mut()
                .insert(STATUS, http::HeaderValue::from(status));
        }
        let mut job = Job::new(self.tenant.as_str(), self.origin)
            .with_tier(self.tier)
            .with_cost(self.input);
        if let Some(sla) = self.sla {
            job = job.with_sla(sla);
        }
        req.extensions_mut().insert(job);
        req
    }
}

/// Poisson arrivals of one kind of call from `from` to `to`, `per_sec` a second, each from
/// one of `tenants` tenants named `prefix-N`.
#[allow(clippy::too_many_arguments)]
pub fn poisson(
    rng: &mut Rng,
    calls: &mut Vec<Call>,
    (from, to): (f64, f64),
    per_sec: f64,
    (prefix, tenants): (&str, u32),
    tier: &'static str,
    origin: Origin,
    (input, output): ((u32, u32), (u32, u32)),
) {
    let mut t = from + rng.exp(1.0 / per_sec);
    while t < to {
        calls.push(Call {
            at: Duration::from_secs_f64(t),
            tenant: format!("{prefix}-{}", rng.between(0, tenants - 1)),
            tier,
            origin,
            sla: (origin == Origin::Scheduled).then(|| Duration::from_secs(600)),
            input: rng.between(input.0, input.1),
            output: rng.between(output.0, output.1),
            latency: None,
            status: None,
        });
        t += rng.exp(1.0 / per_sec);
    }
}

/// Who stands between the callers and the upstream.
#[derive(Clone, Debug)]
pub enum Policy {
    /// A FIFO semaphore (`tower::limit::ConcurrencyLimit`) of `limit` calls, and up to four
    /// immediate retries of a 429 or 529.
    Naive { limit: usize },
    /// `FairgateLayer` on `Store::memory()` with this window, these caps and this fair
    /// queue.
    Fairgate {
        window: usize,
        slots: SlotPolicy,
        drr: Drr,
    },
}

/// The fair queue's settings a replay's policy may change (the crate's defaults else).
#[derive(Clone, Debug, Default)]
pub struct Drr {
    /// Tokens a tenant may send per visit.
    pub quantum: Option<u64>,
    /// Weights per tier.
    pub tier_weights: Vec<(String, u32)>,
}

impl Policy {
    pub fn fairgate(window: usize) -> Self {
        Policy::Fairgate {
            window,
            slots: SlotPolicy::default(),
            drr: Drr::default(),
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            Policy::Naive { .. } => "naive",
            Policy::Fairgate { .. } => "fairgate",
        }
    }
}

type Stack = BoxCloneSyncService<http::Request<String>, u16, BoxError>;

fn stack(policy: &Policy, upstream: &MockClaude, seed: u64) -> Stack {
    match policy {
        Policy::Naive { limit } => BoxCloneSyncService::new(
            ConcurrencyLimitLayer::new(*limit)
                .layer(upstream.clone())
                .map_response(|r: http::Response<String>| r.status().as_u16()),
        ),
        Policy::Fairgate { window, slots, drr } => {
            let layer = FairgateLayer::builder(Store::memory())
                .window(*window)
                .slots(slots.clone())
                .fairness(|mut fair| {
                    if let Some(quantum) = drr.quantum {
                        fair = fair.quantum(quantum);
                    }
                    for (tier, weight) in &drr.tier_weights {
                        fair = fair.tier_weight(tier.as_str(), *weight);
                    }
                    fair
                })
                .backoff(
                    BackoffPolicy::builder()
                        .seed(seed)
                        .build()
                        .expect("valid backoff"),
                )
                .build()
                .expect("a valid stack");
            // The body is whole at once: dropping the response gives everything back.
            BoxCloneSyncService::new(
                layer
                    .layer(upstream.clone())
                    .map_response(|r: http::Response<_>| r.status().as_u16()),
            )
        }
    }
}

/// How a call ended, as its caller saw it.
#[derive(Clone, Debug, PartialEq)]
pub enum Answer {
    Served,
    /// A 429 or 529 the caller was finally answered.
    Refused(u16),
    /// `SERVER_BUSY`: the tier and what it waited for.
    Busy(String, WaitReason),
    Failed(String),
}

#[derive(Clone, Debug)]
pub struct Done {
    pub call: usize,
    /// Seconds from the call's arrival to its answer.
    pub latency: f64,
    /// Seconds from the start to its answer.
    pub at: f64,
    pub answer: Answer,
}

/// One run of a workload under one policy.
#[derive(Debug, Default)]
pub struct Run {
    pub done: Vec<Done>,
    pub attempts: u64,
    pub throttled: u64,
    pub overloaded: u64,
    pub timeline: Vec<(f64, [u32; 4])>,
    pub served: Vec<(f64, String, u32)>,
    /// `(seconds from start, answered 429)` per attempt at the upstream.
    pub attempt_log: Vec<(f64, bool)>,
    /// Seconds simulated.
    pub simulated: f64,
}

const NAIVE_RETRIES: u32 = 4;

/// Runs `calls` (sorted by arrival) under `policy` against a fresh mock, until every call is
/// answered or `horizon` has passed (calls still waiting then are dropped).
pub async fn run(
    policy: &Policy,
    upstream: &Upstream,
    calls: &[Call],
    horizon: Duration,
    seed: u64,
) -> Run {
    let mock = MockClaude::new(upstream.clone());
    let stack = stack(policy, &mock, seed);
    if let Policy::Fairgate { .. } = policy {
        // One call first, as a running service would have made: the limits are learned.
        let warm = Call {
            at: Duration::ZERO,
            tenant: "warm-up".into(),
            tier: "premium",
            origin: Origin::UserAction,
            sla: None,
            input: 10,
            output: 10,
            latency: None,
            status: None,
        };
        let _ = stack.clone().oneshot(warm.request()).await;
        mock.restart_record();
    }
    let start = Instant::now();
    let naive = matches!(policy, Policy::Naive { .. });
    let mut handles = Vec::with_capacity(calls.len());
    for (i, call) in calls.iter().enumerate() {
        let stack = stack.clone();
        let req = call.request();
        let at = start + call.at;
        handles.push(tokio::spawn(async move {
            tokio::time::sleep_until(at).await;
            let mut attempt = 0;
            let answer = loop {
                let result = stack.clone().oneshot(req.clone()).await;
                match result {
                    Ok(200) => break Answer::Served,
                    Ok(429 | 529) if naive && attempt < NAIVE_RETRIES => attempt += 1,
                    Ok(status) => break Answer::Refused(status),
                    Err(e) => match e.downcast_ref::<Busy>() {
                        Some(busy) => {
                            break Answer::Busy(busy.tier().as_str().to_owned(), busy.reason());
                        }
                        None => break Answer::Failed(e.to_string()),
                    },
                }
            };
            let now = Instant::now();
            Done {
                call: i,
                latency: now.saturating_duration_since(at).as_secs_f64(),
                at: now.saturating_duration_since(start).as_secs_f64(),
                answer,
            }
        }));
    }
    let deadline = start + horizon;
    let mut done = Vec::new();
    for mut handle in handles {
        match tokio::time::timeout_at(deadline, &mut handle).await {
            Ok(Ok(d)) => done.push(d),
            Ok(Err(e)) => panic!("a caller panicked: {e}"),
            Err(_) => handle.abort(),
        }
    }
    let simulated = Instant::now()
        .saturating_duration_since(start)
        .as_secs_f64();
    let s = mock.state.lock().unwrap();
    Run {
        done,
        attempts: s.attempts,
        throttled: s.throttled,
        overloaded: s.overloaded,
        timeline: s.timeline.clone(),
        served: s.served.clone(),
        attempt_log: s.attempt_log.clone(),
        simulated,
    }
}

// ---------------------------------------------------------------------------------------
// Measures

/// The `p` quantile (0..=1) of `values`, nearest rank; `None` when empty.
pub fn percentile(values: &[f64], p: f64) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let rank = ((p * v.len() as f64).ceil() as usize).clamp(1, v.len());
    Some(v[rank - 1])
}

/// Jain's fairness index: (Σx)² / (n Σx²).
pub fn jain(values: &[f64]) -> f64 {
    let sum: f64 = values.iter().sum();
    let squares: f64 = values.iter().map(|x| x * x).sum();
    if squares == 0.0 {
        return 1.0;
    }
    sum * sum / (values.len() as f64 * squares)
}

// ---------------------------------------------------------------------------------------
// The published scenarios

/// How big a run: `Full` for the table, `Small` for the tests (a few seconds).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Size {
    Small,
    Full,
}

impl Size {
    fn pick<T>(self, small: T, full: T) -> T {
        match self {
            Size::Small => small,
            Size::Full => full,
        }
    }
}

/// The scenarios' names on the command line, in order.
pub const SCENARIOS: [&str; 5] = ["b-behind-a", "hog", "storm", "peak", "spike"];

/// One line of the table, and the runs behind it.
#[derive(Debug)]
pub struct Outcome {
    pub id: usize,
    pub title: &'static str,
    pub measure: &'static str,
    /// What the published write-up reports for its own system.
    pub reference: &'static str,
    /// The measure, naive and fairgate (seconds, an index or a share).
    pub naive: f64,
    pub fairgate: f64,
    pub naive_text: String,
    pub fairgate_text: String,
    /// The spike: tiers in the order they first saw `SERVER_BUSY`, seconds after it began.
    pub first_busy: Vec<(String, f64)>,
    /// Calls sent (both policies) and seconds simulated.
    pub calls: usize,
    pub simulated: f64,
    /// The workload and both runs (the last round's, when there are rounds), for pictures.
    pub workload: Vec<Call>,
    pub naive_run: Run,
    pub fairgate_run: Run,
}

/// Runs scenario `id` (1..=5).
pub async fn scenario(id: usize, seed: u64, size: Size) -> Outcome {
    match id {
        1 => b_behind_a(seed, size).await,
        2 => hog(seed, size).await,
        3 => storm(seed, size).await,
        4 => peak(seed, size).await,
        5 => spike(seed, size).await,
        _ => panic!("no scenario {id}: 1..=5"),
    }
}

fn sorted(mut calls: Vec<Call>) -> Vec<Call> {
    calls.sort_by_key(|c| c.at);
    calls
}

fn secs(s: f64) -> String {
    format!("{s:.1} s")
}

fn latencies(run: &Run, calls: &[Call], keep: impl Fn(&Call) -> bool) -> Vec<f64> {
    run.done
        .iter()
        .filter(|d| d.answer == Answer::Served && keep(&calls[d.call]))
        .map(|d| d.latency)
        .collect()
}

/// Scenario 1: tenant A dumps 100 critical jobs, tenant B sends one just after; B's p99
/// over rounds.
async fn b_behind_a(seed: u64, size: Size) -> Outcome {
    let rounds = size.pick(6, 40);
    let upstream = Upstream::roomy();
    let (mut naive_b, mut fair_b) = (Vec::new(), Vec::new());
    let (mut calls_sent, mut simulated) = (0, 0.0);
    let mut last = None;
    for round in 0..rounds {
        let mut rng = Rng::new(seed.wrapping_mul(1_000).wrapping_add(round));
        let mut calls: Vec<Call> = (0..100)
            .map(|i| Call {
                at: Duration::from_millis(i),
                tenant: "A".into(),
                tier: "pro",
                origin: Origin::UserAction,
                sla: None,
                input: rng.between(600, 1_200),
                output: rng.between(100, 300),
                latency: None,
                status: None,
            })
            .collect();
        calls.push(Call {
            at: Duration::from_secs_f64(0.1 + rng.unit()),
            tenant: "B".into(),
            tier: "pro",
            origin: Origin::UserAction,
            sla: None,
            input: rng.between(600, 1_200),
            output: rng.between(100, 300),
            latency: None,
            status: None,
        });
        let calls = sorted(calls);
        let horizon = Duration::from_secs(300);
        let naive = run(
            &Policy::Naive { limit: 10 },
            &upstream,
            &calls,
            horizon,
            seed,
        )
        .await;
        let fair = run(&Policy::fairgate(10), &upstream, &calls, horizon, seed).await;
        naive_b.extend(latencies(&naive, &calls, |c| c.tenant == "B"));
        fair_b.extend(latencies(&fair, &calls, |c| c.tenant == "B"));
        calls_sent += 2 * calls.len();
        simulated += naive.simulated + fair.simulated;
        last = Some((calls, naive, fair));
    }
    let (workload, naive_run, fairgate_run) = last.expect("at least one round");
    let naive = percentile(&naive_b, 0.99).unwrap_or(f64::NAN);
    let fairgate = percentile(&fair_b, 0.99).unwrap_or(f64::NAN);
    Outcome {
        id: 1,
        title: "A dumps 100 critical jobs, B sends 1",
        measure: "B's p99",
        reference: "9.8 s -> 1.7 s",
        naive,
        fairgate,
        naive_text: secs(naive),
        fairgate_text: secs(fairgate),
        first_busy: Vec::new(),
        calls: calls_sent,
        simulated,
        workload,
        naive_run,
        fairgate_run,
    }
}

/// Served input tokens per tenant, for `names`.
fn served_by(run: &Run, names: &[String]) -> Vec<f64> {
    names
        .iter()
        .map(|n| {
            run.served
                .iter()
                .filter(|(_, t, _)| t == n)
                .map(|(_, _, tokens)| f64::from(*tokens))
                .sum()
        })
        .collect()
}

/// Scenario 2: eight tenants, all backlogged, one sending 8x the others; Jain's index over
/// served input tokens.
async fn hog(seed: u64, size: Size) -> Outcome {
    let t = size.pick(40.0, 120.0);
    let mut rng = Rng::new(seed ^ 2);
    let mut calls = Vec::new();
    // Prompts of about one quantum (5,000 tokens), so a DRR visit sends about one call.
    let tokens = ((2_000, 8_000), (100, 300));
    let standard = Origin::Scheduled;
    // Capacity is about 6.7 calls a second: each light tenant asks 1.2 (its fair share is
    // 0.83), the hog 8x that.
    poisson(
        &mut rng,
        &mut calls,
        (0.0, t),
        7.0 * 1.2,
        ("light", 7),
        "free",
        standard,
        tokens,
    );
    poisson(
        &mut rng,
        &mut calls,
        (0.0, t),
        9.6,
        ("hog", 1),
        "free",
        standard,
        tokens,
    );
    let calls = sorted(calls);
    let horizon = Duration::from_secs_f64(t);
    let naive_run = run(
        &Policy::Naive { limit: 8 },
        &Upstream::roomy(),
        &calls,
        horizon,
        seed,
    )
    .await;
    let fairgate_run = run(
        &Policy::fairgate(8),
        &Upstream::roomy(),
        &calls,
        horizon,
        seed,
    )
    .await;
    let mut names: Vec<String> = (0..7).map(|i| format!("light-{i}")).collect();
    names.push("hog-0".into());
    let (naive_served, fair_served) = (
        served_by(&naive_run, &names),
        served_by(&fairgate_run, &names),
    );
    let (naive, fairgate) = (jain(&naive_served), jain(&fair_served));
    // The hog's share of the served tokens (1/8 = 12.5% is its fair share).
    let hog_share = |served: &[f64]| 100.0 * served[7] / served.iter().sum::<f64>().max(1.0);
    Outcome {
        id: 2,
        title: "8 tenants, one hogging",
        measure: "Jain's index, served tokens",
        reference: "0.42 -> 0.86-0.91",
        naive,
        fairgate,
        naive_text: format!("{naive:.2} (hog {:.0}%)", hog_share(&naive_served)),
        fairgate_text: format!("{fairgate:.2} (hog {:.0}%)", hog_share(&fair_served)),
        first_busy: Vec::new(),
        calls: 2 * calls.len(),
        simulated: naive_run.simulated + fairgate_run.simulated,
        workload: calls,
        naive_run,
        fairgate_run,
    }
}

/// Scenario 3: a 429 storm, a burst of 60 calls then 70 calls a minute against the
/// 50 RPM / 40,000 ITPM / 8,000 OTPM tier, with a 3 s burst of 529s; the share
/// of attempts answered 429.
async fn storm(seed: u64, size: Size) -> Outcome {
    let t = size.pick(90.0, 300.0);
    let burst = size.pick(30.0, 60.0);
    let upstream = Upstream {
        rpm: 50.0,
        itpm: 40_000.0,
        otpm: 8_000.0,
        overloaded: vec![(
            Duration::from_secs_f64(burst),
            Duration::from_secs_f64(burst + 3.0),
        )],
        ..Upstream::roomy()
    };
    let mut rng = Rng::new(seed ^ 3);
    let mut calls = Vec::new();
    let tokens = ((200, 600), (50, 150));
    let chat = Origin::UserAction;
    // A burst of 60 calls in 5 s empties the bucket, then 70 calls a minute keep it empty.
    poisson(
        &mut rng,
        &mut calls,
        (0.0, 5.0),
        12.0,
        ("user", 6),
        "pro",
        chat,
        tokens,
    );
    poisson(
        &mut rng,
        &mut calls,
        (0.0, t),
        70.0 / 60.0,
        ("user", 6),
        "pro",
        chat,
        tokens,
    );
    let calls = sorted(calls);
    let horizon = Duration::from_secs_f64(t + 120.0);
    let naive_run = run(
        &Policy::Naive { limit: 30 },
        &upstream,
        &calls,
        horizon,
        seed,
    )
    .await;
    let fairgate_run = run(&Policy::fairgate(30), &upstream, &calls, horizon, seed).await;
    let share = |r: &Run| r.throttled as f64 / r.attempts.max(1) as f64;
    let (naive, fairgate) = (share(&naive_run), share(&fairgate_run));
    let text = |r: &Run, s: f64| {
        let served = r.done.iter().filter(|d| d.answer == Answer::Served).count();
        format!(
            "{:.0}% ({}/{}), {served} served",
            100.0 * s,
            r.throttled,
            r.attempts
        )
    };
    Outcome {
        id: 3,
        title: "429 storm on a 50 RPM tier",
        measure: "attempts answered 429",
        reference: "38% -> 7%",
        naive,
        fairgate,
        naive_text: text(&naive_run, naive),
        fairgate_text: text(&fairgate_run, fairgate),
        first_busy: Vec::new(),
        calls: 2 * calls.len(),
        simulated: naive_run.simulated + fairgate_run.simulated,
        workload: calls,
        naive_run,
        fairgate_run,
    }
}

fn paid(tier: &str) -> bool {
    tier == "pro" || tier == "premium"
}

/// Scenario 4: a peak, 20 free users per paying user, more calls than 30 slots can answer;
/// the paid users' p99.
async fn peak(seed: u64, size: Size) -> Outcome {
    let t = size.pick(40.0, 120.0);
    let mut rng = Rng::new(seed ^ 4);
    let mut calls = Vec::new();
    let tokens = ((300, 1_500), (100, 300));
    let chat = Origin::UserAction;
    poisson(
        &mut rng,
        &mut calls,
        (0.0, t),
        0.625,
        ("premium", 5),
        "premium",
        chat,
        tokens,
    );
    poisson(
        &mut rng,
        &mut calls,
        (0.0, t),
        0.625,
        ("pro", 5),
        "pro",
        chat,
        tokens,
    );
    poisson(
        &mut rng,
        &mut calls,
        (0.0, t),
        28.0,
        ("free", 200),
        "free",
        chat,
        tokens,
    );
    let calls = sorted(calls);
    let horizon = Duration::from_secs_f64(t + 300.0);
    let naive_run = run(
        &Policy::Naive { limit: 30 },
        &Upstream::roomy(),
        &calls,
        horizon,
        seed,
    )
    .await;
    let fairgate_run = run(
        &Policy::fairgate(32),
        &Upstream::roomy(),
        &calls,
        horizon,
        seed,
    )
    .await;
    let p99 =
        |r: &Run| percentile(&latencies(r, &calls, |c| paid(c.tier)), 0.99).unwrap_or(f64::NAN);
    let (naive, fairgate) = (p99(&naive_run), p99(&fairgate_run));
    Outcome {
        id: 4,
        title: "peak, 20 free users per paying user",
        measure: "paid p99",
        reference: "20+ s -> under 2 s",
        naive,
        fairgate,
        naive_text: secs(naive),
        fairgate_text: secs(fairgate),
        first_busy: Vec::new(),
        calls: 2 * calls.len(),
        simulated: naive_run.simulated + fairgate_run.simulated,
        workload: calls,
        naive_run,
        fairgate_run,
    }
}

/// When the spike starts, seconds from the start.
pub fn spike_start(size: Size) -> f64 {
    size.pick(10.0, 30.0)
}

/// Scenario 5: a 10x spike over a mixed load; which tiers see `SERVER_BUSY` first.
async fn spike(seed: u64, size: Size) -> Outcome {
    let from = spike_start(size);
    let to = from + size.pick(30.0, 60.0);
    let end = to + size.pick(10.0, 30.0);
    let mut rng = Rng::new(seed ^ 5);
    let mut calls = Vec::new();
    let tokens = ((300, 1_500), (100, 300));
    let chat = Origin::UserAction;
    for (from, to, x) in [(0.0, from, 1.0), (from, to, 10.0), (to, end, 1.0)] {
        for (tier, rate, users) in [
            ("premium", 0.6, 20),
            ("pro", 1.2, 40),
            ("free", 2.4, 400),
            ("guest", 1.2, 400),
        ] {
            poisson(
                &mut rng,
                &mut calls,
                (from, to),
                rate * x,
                (tier, users),
                tier,
                chat,
                tokens,
            );
        }
    }
    let calls = sorted(calls);
    let horizon = Duration::from_secs_f64(end + 300.0);
    let naive_run = run(
        &Policy::Naive { limit: 30 },
        &Upstream::roomy(),
        &calls,
        horizon,
        seed,
    )
    .await;
    let fairgate_run = run(
        &Policy::fairgate(32),
        &Upstream::roomy(),
        &calls,
        horizon,
        seed,
    )
    .await;
    let mut first_busy: Vec<(String, f64)> = Vec::new();
    let mut by_time: Vec<&Done> = fairgate_run.done.iter().collect();
    by_time.sort_by(|a, b| a.at.total_cmp(&b.at));
    for d in by_time {
        if let Answer::Busy(tier, _) = &d.answer
            && !first_busy.iter().any(|(t, _)| t == tier)
        {
            first_busy.push((tier.clone(), d.at - from));
        }
    }
    let naive_busy = naive_run
        .done
        .iter()
        .filter(|d| matches!(d.answer, Answer::Busy(..)))
        .count();
    let in_spike = |c: &Call| c.at.as_secs_f64() >= from && c.at.as_secs_f64() < to;
    let naive_p99 = percentile(
        &latencies(&naive_run, &calls, |c| in_spike(c) && paid(c.tier)),
        0.99,
    )
    .unwrap_or(f64::NAN);
    let fair_p99 = percentile(
        &latencies(&fairgate_run, &calls, |c| in_spike(c) && paid(c.tier)),
        0.99,
    )
    .unwrap_or(f64::NAN);
    let mut order: Vec<String> = first_busy
        .iter()
        .map(|(t, s)| format!("{t} {s:.0} s"))
        .collect();
    for tier in TIERS {
        if !first_busy.iter().any(|(t, _)| t == tier) {
            order.push(format!("{tier} never"));
        }
    }
    Outcome {
        id: 5,
        title: "10x spike (paid p99 in brackets)",
        measure: "first SERVER_BUSY, by tier",
        reference: "free/guest before pro/premium",
        naive: naive_busy as f64,
        fairgate: first_busy.len() as f64,
        naive_text: format!("none, all wait ({})", secs(naive_p99)),
        fairgate_text: format!("{} ({})", order.join(", "), secs(fair_p99)),
        first_busy,
        calls: 2 * calls.len(),
        simulated: naive_run.simulated + fairgate_run.simulated,
        workload: calls,
        naive_run,
        fairgate_run,
    }
}

/// The table of `outcomes`, beside the numbers the published write-ups report
/// (column `reference`).
pub fn table(outcomes: &[Outcome]) -> String {
    let header = ["#", "scenario", "measure", "reference", "naive", "fairgate"];
    let rows: Vec<[String; 6]> = outcomes
        .iter()
        .map(|o| {
            [
                o.id.to_string(),
                o.title.to_owned(),
                o.measure.to_owned(),
                o.reference.to_owned(),
                o.naive_text.clone(),
                o.fairgate_text.clone(),
            ]
        })
        .collect();
    let mut widths = header.map(str::len);
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: &[String]| {
        let padded: Vec<String> = cells
            .iter()
            .zip(widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        padded.join("  ").trim_end().to_owned() + "\n"
    };
    let mut out = line(&header.map(str::to_owned));
    out += &line(&widths.map(|w| "-".repeat(w)));
    for row in &rows {
        out += &line(row);
    }
    out
}

/// In-flight per tier, sampled every `step` seconds up to `until` (the last value before).
pub fn in_flight_series(run: &Run, step: f64, until: f64) -> Vec<(f64, [u32; 4])> {
    let mut out = Vec::new();
    let mut i = 0;
    let mut current = [0; 4];
    let mut t = 0.0;
    while t <= until {
        while i < run.timeline.len() && run.timeline[i].0 <= t {
            current = run.timeline[i].1;
            i += 1;
        }
        out.push((t, current));
        t += step;
    }
    out
}

/// Latencies of served calls by tier.
pub fn latencies_by_tier(run: &Run, calls: &[Call]) -> BTreeMap<&'static str, Vec<f64>> {
    let mut out: BTreeMap<&'static str, Vec<f64>> = BTreeMap::new();
    for d in &run.done {
        if d.answer == Answer::Served {
            out.entry(calls[d.call].tier).or_default().push(d.latency);
        }
    }
    out
}

/// Served calls' latencies per tenant, as `latencies_by_tier` per tier.
pub fn latencies_by_tenant(run: &Run, calls: &[Call]) -> BTreeMap<String, Vec<f64>> {
    let mut out: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    for d in &run.done {
        if d.answer == Answer::Served {
            out.entry(calls[d.call].tenant.clone())
                .or_default()
                .push(d.latency);
        }
    }
    out
}

/// The share of attempts answered 429 per `step` seconds: `(start of the step, share)`,
/// for the steps with attempts.
pub fn throttle_share_series(run: &Run, step: f64) -> Vec<(f64, f64)> {
    let mut by_step: BTreeMap<u64, (u32, u32)> = BTreeMap::new();
    for &(at, throttled) in &run.attempt_log {
        let counts = by_step.entry((at / step) as u64).or_default();
        counts.0 += u32::from(throttled);
        counts.1 += 1;
    }
    by_step
        .into_iter()
        .map(|(k, (throttled, all))| (k as f64 * step, f64::from(throttled) / f64::from(all)))
        .collect()
}
