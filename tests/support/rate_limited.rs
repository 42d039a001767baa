//! A mock of Anthropic's rate limiter as a tower `Service`, for the tests of one order under
//! every limit (`tests/stack_rate.rs`, `tests/stack_rate_redis.rs`): requests, input tokens
//! and output tokens per minute as token buckets refilled continuously; the
//! `anthropic-ratelimit-*` headers (limit, remaining, reset) on every answer; a real `429`
//! with `retry-after` (whole seconds, at least 1) when a bucket is empty. It keeps its own
//! record of every call it saw — who (tenant, tier, priority), which (the `x-call-id`
//! header), when it started — so a test counts from outside the library.
//!
//! Time is tokio's (`tokio::time::Instant`): paused time on the memory store, real time on
//! Redis. A call is charged when it arrives and answered `latency` later.

use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use fairgate::{BoxError, Busy, Job, Priority};
use tokio::time::Instant;
use tower::{Service, service_fn};

/// The frames of a streamed answer.
type Frames = std::pin::Pin<
    Box<dyn futures_util::Stream<Item = Result<http_body::Frame<bytes::Bytes>, BoxError>> + Send>,
>;

/// The body of a streamed answer ([`RateLimited::streaming_service`]).
pub type Streaming = http_body_util::StreamBody<Frames>;

/// The header a test puts on each request to find it in the record.
pub const CALL_ID: &str = "x-call-id";

/// One of the provider's token buckets: `limit` per minute, refilled continuously.
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

    /// Seconds until `need` fits (0 if it does).
    fn until(&self, need: f64) -> f64 {
        let need = need.min(self.limit);
        ((need - self.level) * 60.0 / self.limit).max(0.0)
    }

    /// Seconds until full.
    fn until_full(&self) -> f64 {
        ((self.limit - self.level) * 60.0 / self.limit).max(0.0)
    }
}

/// One call as the upstream saw it.
#[derive(Clone, Debug)]
pub struct Started {
    /// The request's `x-call-id` header, if it had one.
    pub id: Option<u64>,
    pub tenant: String,
    pub tier: String,
    pub priority: Option<Priority>,
    /// When the request entered the first fairgate layer.
    pub arrived: Option<Instant>,
    /// When it reached the upstream.
    pub at: Instant,
    /// What it was answered: 200, or 429 (over the rate, or scripted).
    pub status: u16,
}

/// Which calls (the job, the call's number from 0) are answered `429` whatever the buckets
/// hold, and with which `retry-after` (seconds).
pub type Script = dyn Fn(&Job, usize) -> Option<u64> + Send + Sync;

struct State {
    requests: Bucket,
    input: Bucket,
    output: Bucket,
    at: Instant,
    calls: Vec<Started>,
    in_flight: u32,
    max_in_flight: u32,
}

/// The mock upstream; cheap to clone, every clone shares the buckets and the record.
#[derive(Clone)]
pub struct RateLimited {
    state: Arc<Mutex<State>>,
    latency: Duration,
    script: Arc<Script>,
}

/// Output tokens charged per call, when its answer is sent.
const OUTPUT: f64 = 100.0;

impl RateLimited {
    /// `rpm` requests a minute (input and output tokens generous: 10 M a minute each),
    /// answering each call `latency` after it arrives.
    pub fn new(rpm: u32, latency: Duration) -> Self {
        RateLimited::with_limits(rpm, 10_000_000, 10_000_000, latency)
    }

    pub fn with_limits(rpm: u32, itpm: u32, otpm: u32, latency: Duration) -> Self {
        RateLimited {
            state: Arc::new(Mutex::new(State {
                requests: Bucket::new(f64::from(rpm)),
                input: Bucket::new(f64::from(itpm)),
                output: Bucket::new(f64::from(otpm)),
                at: Instant::now(),
                calls: Vec::new(),
                in_flight: 0,
                max_in_flight: 0,
            })),
            latency,
            script: Arc::new(|_, _| None),
        }
    }

    /// Answers the calls `script` picks `429` with its `retry-after`, whatever the buckets
    /// hold (such a call takes nothing from them).
    pub fn throttling(
        mut self,
        script: impl Fn(&Job, usize) -> Option<u64> + Send + Sync + 'static,
    ) -> Self {
        self.script = Arc::new(script);
        self
    }

    fn headers(s: &State) -> Vec<(String, String)> {
        let now = SystemTime::now();
        let mut out = Vec::new();
        for (name, b) in [
            ("requests", &s.requests),
            ("input-tokens", &s.input),
            ("output-tokens", &s.output),
        ] {
            out.push((
                format!("anthropic-ratelimit-{name}-limit"),
                (b.limit as u64).to_string(),
            ));
            out.push((
                format!("anthropic-ratelimit-{name}-remaining"),
                (b.level.max(0.0).floor() as u64).to_string(),
            ));
            out.push((
                format!("anthropic-ratelimit-{name}-reset"),
                super::rfc3339(now + Duration::from_secs_f64(b.until_full())),
            ));
        }
        out
    }

    /// Records a call arriving now and decides its answer: `None` admitted, `Some(secs)` a
    /// 429 with that `retry-after`.
    fn arrive(&self, job: &Job, id: Option<u64>) -> Option<u64> {
        let mut s = self.state.lock().unwrap();
        let now = Instant::now();
        let secs = (now - s.at).as_secs_f64();
        s.at = now;
        s.requests.refill(secs);
        s.input.refill(secs);
        s.output.refill(secs);
        let n = s.calls.len();
        let input = f64::from(job.estimated_tokens());
        let throttled = (self.script)(job, n).or_else(|| {
            let wait = s
                .requests
                .until(1.0)
                .max(s.input.until(input))
                .max(s.output.until(1.0));
            (wait > 0.0).then(|| wait.ceil().max(1.0) as u64)
        });
        if throttled.is_none() {
            s.requests.level -= 1.0;
            s.input.level -= input.min(s.input.limit);
        }
        s.in_flight += 1;
        s.max_in_flight = s.max_in_flight.max(s.in_flight);
        s.calls.push(Started {
            id,
            tenant: job.tenant().to_string(),
            tier: job.tier_name().map_or("", |t| t.as_str()).to_owned(),
            priority: job.priority(),
            arrived: job.arrived_at(),
            at: now,
            status: if throttled.is_some() { 429 } else { 200 },
        });
        throttled
    }

    /// The answer's head, when the call's time is up.
    fn answer(&self, throttled: Option<u64>) -> http::Response<String> {
        let mut s = self.state.lock().unwrap();
        s.in_flight -= 1;
        if throttled.is_none() {
            s.output.level -= OUTPUT;
        }
        let mut headers = Self::headers(&s);
        drop(s);
        let status = match throttled {
            Some(secs) => {
                headers.push(("retry-after".into(), secs.to_string()));
                429
            }
            None => 200,
        };
        let mut builder = http::Response::builder().status(status);
        for (name, value) in headers {
            builder = builder.header(name, value);
        }
        builder.body("{}".to_owned()).unwrap()
    }

    pub fn service(
        &self,
    ) -> impl Service<
        http::Request<String>,
        Response = http::Response<String>,
        Error = BoxError,
        Future: Send + 'static,
    > + Clone
    + Send
    + Sync
    + 'static {
        let this = self.clone();
        service_fn(move |req: http::Request<String>| {
            let this = this.clone();
            let id = req
                .headers()
                .get(CALL_ID)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse().ok());
            let job = req.extensions().get::<Job>().expect("a job").clone();
            let throttled = this.arrive(&job, id);
            async move {
                tokio::time::sleep(this.latency).await;
                Ok::<_, BoxError>(this.answer(throttled))
            }
        })
    }

    /// As [`service`](RateLimited::service), but streaming, as the Messages API does: the
    /// answer's head (status and rate-limit headers) comes `head` after the call arrives,
    /// and its body ends when the call's `latency` is up.
    pub fn streaming_service(
        &self,
        head: Duration,
    ) -> impl Service<
        http::Request<String>,
        Response = http::Response<Streaming>,
        Error = BoxError,
        Future: Send + 'static,
    > + Clone
    + Send
    + Sync
    + 'static {
        let this = self.clone();
        service_fn(move |req: http::Request<String>| {
            let this = this.clone();
            let id = req
                .headers()
                .get(CALL_ID)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse().ok());
            let job = req.extensions().get::<Job>().expect("a job").clone();
            let throttled = this.arrive(&job, id);
            let rest = this.latency.saturating_sub(head);
            async move {
                tokio::time::sleep(head).await;
                let response = this.answer(throttled);
                let body: Frames = Box::pin(futures_util::stream::once(async move {
                    tokio::time::sleep(rest).await;
                    Ok(http_body::Frame::data(bytes::Bytes::from_static(b"{}")))
                }));
                Ok::<_, BoxError>(response.map(|_| http_body_util::StreamBody::new(body)))
            }
        })
    }

    /// Every call seen, in the order they reached the upstream.
    pub fn calls(&self) -> Vec<Started> {
        self.state.lock().unwrap().calls.clone()
    }

    /// How many calls were answered `429`.
    pub fn throttled(&self) -> usize {
        let s = self.state.lock().unwrap();
        s.calls.iter().filter(|c| c.status == 429).count()
    }

    /// The most calls in flight at once.
    pub fn max_in_flight(&self) -> u32 {
        self.state.lock().unwrap().max_in_flight
    }

    /// Forgets the record (after a warm-up); the buckets keep what they hold.
    pub fn forget(&self) {
        let mut s = self.state.lock().unwrap();
        s.calls.clear();
        s.max_in_flight = s.in_flight;
    }
}

/// The longest stretch in `[from, to]` during which some request was waiting (by
/// `waiting`: from when, until when) and no call started at the upstream (`starts`).
pub fn longest_idle_while_waiting(
    starts: &[Instant],
    waiting: &[(Instant, Instant)],
    from: Instant,
    to: Instant,
) -> Duration {
    let step = Duration::from_millis(5);
    let mut starts: Vec<Instant> = starts.to_vec();
    starts.sort();
    let mut longest = Duration::ZERO;
    // The start of the current idle stretch: the later of the last start and the moment
    // the current waiting began.
    let mut idle_since: Option<Instant> = None;
    let mut t = from;
    let mut next = 0;
    while t <= to {
        let mut started = false;
        while next < starts.len() && starts[next] <= t {
            started = true;
            next += 1;
        }
        let someone_waits = waiting.iter().any(|&(a, b)| a <= t && t < b);
        if !someone_waits || started {
            idle_since = someone_waits.then_some(t);
        } else {
            let since = *idle_since.get_or_insert(t);
            longest = longest.max(t - since);
        }
        t += step;
    }
    longest
}

// The callers' side: what each request was answered, and rules over the record.

/// What `Busy` waited for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    Slot,
    Rate,
    Cooldown,
    /// A message that names none of them.
    Unknown,
}

impl Reason {
    pub fn label(self) -> &'static str {
        match self {
            Reason::Slot => "slot",
            Reason::Rate => "rate",
            Reason::Cooldown => "cooldown",
            Reason::Unknown => "unknown",
        }
    }
}

/// What `busy` waited for: its [`Busy::reason`], which its message must say too (a
/// disagreement reads as `Unknown`, so the asserts on the reason fail).
pub fn reason(busy: &Busy) -> Reason {
    let reason = match busy.reason() {
        fairgate::WaitReason::Slot => Reason::Slot,
        fairgate::WaitReason::Rate => Reason::Rate,
        fairgate::WaitReason::Cooldown => Reason::Cooldown,
        _ => Reason::Unknown,
    };
    let text = busy.to_string();
    let said = if text.contains("cooldown") {
        Reason::Cooldown
    } else if text.contains("rate") {
        Reason::Rate
    } else if text.contains("no slot") {
        Reason::Slot
    } else {
        Reason::Unknown
    };
    if said.label() == reason.label() {
        reason
    } else {
        Reason::Unknown
    }
}

/// What a caller was answered.
#[derive(Clone, Debug)]
pub enum Answer {
    Status(u16),
    Busy(Reason, String),
    Other(String),
}

/// One request as its caller saw it.
#[derive(Clone, Debug)]
pub struct Outcome {
    pub id: u64,
    pub sent: Instant,
    pub done: Instant,
    pub answer: Answer,
}

impl Outcome {
    pub fn took(&self) -> Duration {
        self.done - self.sent
    }

    pub fn ok(&self) -> bool {
        matches!(self.answer, Answer::Status(200))
    }

    pub fn busy(&self) -> Option<Reason> {
        match self.answer {
            Answer::Busy(reason, _) => Some(reason),
            _ => None,
        }
    }
}

/// What a caller of the stack (answering the status) was answered.
pub fn answer(result: Result<u16, BoxError>) -> Answer {
    match result {
        Ok(status) => Answer::Status(status),
        Err(e) => match e.downcast_ref::<Busy>() {
            Some(busy) => Answer::Busy(reason(busy), busy.to_string()),
            None => Answer::Other(e.to_string()),
        },
    }
}

/// The first prefix of `dispatches` (tiers, in start order) in which `light` has more than
/// its share against `heavy` at weights `heavy_weight : 1`, with `slack` calls of slack:
/// `light > heavy / heavy_weight + slack`. `None` if every prefix keeps the share.
pub fn share_broken(
    dispatches: &[&str],
    heavy: &str,
    light: &str,
    heavy_weight: usize,
    slack: usize,
) -> Option<(usize, usize, usize)> {
    let (mut h, mut l) = (0, 0);
    for (i, tier) in dispatches.iter().enumerate() {
        if *tier == heavy {
            h += 1;
        } else if *tier == light {
            l += 1;
        }
        if l * heavy_weight > h + slack * heavy_weight {
            return Some((i + 1, h, l));
        }
    }
    None
}

pub fn count(outcomes: &[Outcome], what: impl Fn(&Outcome) -> bool) -> usize {
    outcomes.iter().filter(|o| what(o)).count()
}

/// Busy answers by reason, for the printout.
pub fn busy_reasons(outcomes: &[Outcome]) -> String {
    let mut out = Vec::new();
    for reason in [
        Reason::Slot,
        Reason::Rate,
        Reason::Cooldown,
        Reason::Unknown,
    ] {
        let n = count(outcomes, |o| o.busy() == Some(reason));
        if n > 0 {
            out.push(format!("{} {n}", reason.label()));
        }
    }
    if let Some(Answer::Other(e)) = outcomes
        .iter()
        .map(|o| &o.answer)
        .find(|a| matches!(a, Answer::Other(_)))
    {
        let n = count(outcomes, |o| matches!(o.answer, Answer::Other(_)));
        out.push(format!("other errors {n} (first: {e})"));
    }
    if out.is_empty() {
        "none".to_owned()
    } else {
        out.join(", ")
    }
}

/// The first time each request reached the upstream, by its id.
pub fn first_start(calls: &[Started], id: u64) -> Option<Instant> {
    calls.iter().find(|c| c.id == Some(id)).map(|c| c.at)
}

/// When each request waited in the stack: from when it was sent until it first reached the
/// upstream, or until it was answered without reaching it.
pub fn waiting(outcomes: &[Outcome], calls: &[Started]) -> Vec<(Instant, Instant)> {
    outcomes
        .iter()
        .map(|o| (o.sent, first_start(calls, o.id).unwrap_or(o.done)))
        .collect()
}
