//! The simulator's engine, shared by the `fairgate-simulate` program and the tests:
//! a mock Claude upstream as a tower `Service`, workload generators, the two policies
//! (naive: a FIFO `ConcurrencyLimit` and immediate retries; fairgate: the real
//! `FairgateLayer` on `Store::memory()`); the five published scenarios are in
//! `scenarios`.
//!
//! Everything runs in tokio's paused time and draws its randomness from [`Rng`], seeded:
//! the same seed gives the same numbers.

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
            let answer = call_until_answered(&stack, &req, naive).await;
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

/// One caller's call, sent again on a 429 or 529 (up to [`NAIVE_RETRIES`] times) under the
/// naive policy: how it ended.
async fn call_until_answered(stack: &Stack, req: &http::Request<String>, naive: bool) -> Answer {
    let mut attempt = 0;
    loop {
        match stack.clone().oneshot(req.clone()).await {
            Ok(200) => return Answer::Served,
            Ok(429 | 529) if naive && attempt < NAIVE_RETRIES => attempt += 1,
            Ok(status) => return Answer::Refused(status),
            Err(e) => {
                return match e.downcast_ref::<Busy>() {
                    Some(busy) => Answer::Busy(busy.tier().as_str().to_owned(), busy.reason()),
                    None => Answer::Failed(e.to_string()),
                };
            }
        }
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
