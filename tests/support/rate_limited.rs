//! A mock of Anthropic's rate limiter as a tower `Service`, for the tests of one order under
//! every limit (`memory/stack_rate.rs`, `redis/stack_rate_redis.rs`) and of the limits the
//! fleet learns (`memory/learned_pacing.rs`): requests, input tokens and output tokens per
//! minute as token buckets refilled continuously; the `anthropic-ratelimit-*` headers
//! (limit, remaining, reset = when the bucket is full again, as Anthropic documents) on
//! every answer; a real `429` with `retry-after` (whole seconds, at least 1) when a bucket
//! is empty. It keeps its own record of every call it saw — who (tenant, tier, priority),
//! which (the `x-call-id` header), when it started — and when each success was answered,
//! so a test counts from outside the library.
//!
//! Time is tokio's (`tokio::time::Instant`): paused time on the memory store, real time on
//! Redis. A call is charged when it arrives and answered `latency` later: input tokens the
//! job's estimate, output tokens [`OUTPUT`] when the answer is sent — or, for a request
//! carrying a [`TrueUsage`], what it says, with the `usage` in the body.

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

/// A provider's request bucket as GCRA keeps it, holding a second of the rate (at least one
/// cell): for the mocks that send only the request-limit headers (`memory/stack_model.rs`,
/// `gateway/rate.rs`). Its clock is the caller's: `now` is the time since the mock started.
#[derive(Clone, Debug)]
pub struct RequestCells {
    interval: Duration,
    capacity: u32,
    /// The theoretical arrival time, past the start.
    tat: Duration,
}

impl RequestCells {
    pub fn new(rpm: u32) -> Self {
        RequestCells {
            interval: Duration::from_secs_f64(60.0 / f64::from(rpm)),
            capacity: (rpm / 60).max(1),
            tat: Duration::ZERO,
        }
    }

    /// Takes a cell at `now`: the cells left after it, or `None` when the bucket is empty
    /// (a 429; nothing is taken).
    pub fn take(&mut self, now: Duration) -> Option<u32> {
        let tat = self.tat.max(now);
        if tat.saturating_sub(now) > self.interval * (self.capacity - 1) {
            return None;
        }
        self.tat = tat + self.interval;
        let used = (self.tat - now).as_secs_f64() / self.interval.as_secs_f64();
        Some((f64::from(self.capacity) - used).floor().max(0.0) as u32)
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
    /// What it was answered: 200, or 429 (over the rate, scripted or at random).
    pub status: u16,
}

/// What a call really uses, whatever its job estimated: the mock charges it and answers
/// it in the body's `usage` (a JSON message, or an event stream). A request extension.
#[derive(Clone, Copy, Debug)]
pub struct TrueUsage {
    pub input: u32,
    pub output: u32,
    pub stream: bool,
}

impl TrueUsage {
    /// The answer's body, as the Messages API writes it.
    fn body(&self) -> String {
        let (input, output) = (self.input, self.output);
        if self.stream {
            format!(
                "event: message_start\ndata: {{\"type\":\"message_start\",\"message\":{{\"usage\":\
                 {{\"input_tokens\":{input},\"output_tokens\":1}}}}}}\n\n\
                 event: content_block_delta\ndata: {{\"type\":\"content_block_delta\",\"index\":0,\
                 \"delta\":{{\"type\":\"text_delta\",\"text\":\"Hi\"}}}}\n\n\
                 event: message_delta\ndata: {{\"type\":\"message_delta\",\"delta\":\
                 {{\"stop_reason\":\"end_turn\"}},\"usage\":{{\"output_tokens\": {output}}}}}\n\n\
                 event: message_stop\ndata: {{\"type\":\"message_stop\"}}\n\n"
            )
        } else {
            format!(
                "{{\"type\":\"message\",\"content\":[{{\"type\":\"text\",\"text\":\"Hi\"}}],\
                 \"usage\":{{\"input_tokens\":{input},\"output_tokens\":{output}}}}}"
            )
        }
    }
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
    /// When each success was answered.
    served: Vec<Instant>,
    /// Random 429s: the share of calls and the generator's state.
    random_429: f64,
    rng: u64,
}

impl State {
    /// Refills the buckets for the time since the last look.
    fn refill(&mut self, now: Instant) {
        let secs = (now - self.at).as_secs_f64();
        self.at = now;
        self.requests.refill(secs);
        self.input.refill(secs);
        self.output.refill(secs);
    }
}

/// The mock upstream; cheap to clone, every clone shares the buckets and the record.
#[derive(Clone)]
pub struct RateLimited {
    state: Arc<Mutex<State>>,
    latency: Duration,
    script: Arc<Script>,
    /// A 429's rate-limit headers as the buckets were when it was refused (else when it is
    /// answered).
    refusal_headers_at_arrival: bool,
}

/// Output tokens charged per call, when its answer is sent.
pub const OUTPUT: f64 = 100.0;

/// What `arrive` decided for a call: go (`None`), or a 429 with its `retry-after` (and,
/// with `refusal_headers_at_arrival`, its headers then).
type Admission = Option<(u64, Option<Vec<(String, String)>>)>;

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
                served: Vec::new(),
                random_429: 0.0,
                rng: 12,
            })),
            latency,
            script: Arc::new(|_, _| None),
            refusal_headers_at_arrival: false,
        }
    }

    /// Answers `share` of the calls `429` (`retry-after: 1`) at random, whatever the
    /// buckets hold (such a call takes nothing from them); the draws are seeded.
    pub fn with_random_429(self, share: f64) -> Self {
        self.state.lock().unwrap().random_429 = share;
        self
    }

    /// A 429 carries the rate-limit headers as they were when the call was refused, not
    /// when the answer is sent `latency` later.
    pub fn refusal_headers_at_arrival(mut self) -> Self {
        self.refusal_headers_at_arrival = true;
        self
    }

    /// Changes the request limit (the bucket keeps what it holds, up to the new limit).
    pub fn set_rpm(&self, rpm: u32) {
        let mut s = self.state.lock().unwrap();
        s.requests.limit = f64::from(rpm);
        s.requests.level = s.requests.level.min(f64::from(rpm));
    }

    /// Another client on the same key takes `input` tokens (as far as there are any).
    pub fn take_outside(&self, input: f64) {
        let mut s = self.state.lock().unwrap();
        s.refill(Instant::now());
        let taken = input.min(s.input.level.max(0.0));
        s.input.level -= taken;
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

    /// Records a call arriving now with `input` tokens and decides its answer.
    fn arrive(&self, job: &Job, id: Option<u64>, input: f64) -> Admission {
        let mut s = self.state.lock().unwrap();
        let now = Instant::now();
        s.refill(now);
        let n = s.calls.len();
        let random = s.random_429 > 0.0 && {
            s.rng = s
                .rng
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s.rng >> 11) as f64 / (1u64 << 53) as f64) < s.random_429
        };
        let throttled = (self.script)(job, n).or(random.then_some(1)).or_else(|| {
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
            tier: job.tier().map_or("", |t| t.as_str()).to_owned(),
            priority: job.priority(),
            arrived: job.arrived_at(),
            at: now,
            status: if throttled.is_some() { 429 } else { 200 },
        });
        let headers = self.refusal_headers_at_arrival.then(|| Self::headers(&s));
        throttled.map(|secs| (secs, headers))
    }

    /// The answer's head, when the call's time is up: a success charges `output` tokens.
    fn answer(&self, admission: Admission, output: f64) -> http::Response<String> {
        let mut s = self.state.lock().unwrap();
        s.in_flight -= 1;
        if admission.is_none() {
            s.output.level -= output;
            s.served.push(Instant::now());
        }
        let (status, headers) = match admission {
            Some((secs, at_arrival)) => {
                let mut headers = at_arrival.unwrap_or_else(|| Self::headers(&s));
                headers.push(("retry-after".into(), secs.to_string()));
                (429, headers)
            }
            None => (200, Self::headers(&s)),
        };
        drop(s);
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
            let usage = req.extensions().get::<TrueUsage>().copied();
            let input = usage.map_or(f64::from(job.cost()), |u| f64::from(u.input));
            let admission = this.arrive(&job, id, input);
            async move {
                tokio::time::sleep(this.latency).await;
                let output = usage.map_or(OUTPUT, |u| f64::from(u.output));
                let mut response = this.answer(admission, output);
                if let (200, Some(usage)) = (response.status().as_u16(), usage) {
                    *response.body_mut() = usage.body();
                }
                Ok::<_, BoxError>(response)
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
            let admission = this.arrive(&job, id, f64::from(job.cost()));
            let rest = this.latency.saturating_sub(head);
            async move {
                tokio::time::sleep(head).await;
                let response = this.answer(admission, OUTPUT);
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
        s.served.clear();
        s.max_in_flight = s.in_flight;
    }

    /// How many calls arrived (since the last [`forget`](RateLimited::forget)).
    pub fn attempts(&self) -> usize {
        self.state.lock().unwrap().calls.len()
    }

    /// The share of attempts answered `429`, the attempts, and the 429s.
    pub fn share_429(&self) -> (f64, u64, u64) {
        let (attempts, throttled) = (self.attempts() as u64, self.throttled() as u64);
        (throttled as f64 / attempts as f64, attempts, throttled)
    }

    /// When each success was answered, in order.
    pub fn served_at(&self) -> Vec<Instant> {
        self.state.lock().unwrap().served.clone()
    }

    /// How many calls succeeded.
    pub fn served(&self) -> usize {
        self.state.lock().unwrap().served.len()
    }

    /// Successes per minute between the first and the last success.
    pub fn throughput_rpm(&self) -> f64 {
        let served = self.served_at();
        let (first, last) = (served[0], served[served.len() - 1]);
        (served.len() - 1) as f64 / (last - first).as_secs_f64() * 60.0
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

/// A stack under test, answering each call's status.
pub type StatusStack = tower::util::BoxCloneSyncService<http::Request<String>, u16, BoxError>;

/// Sends `job` through `stack` at `at`, as call `id` (its [`CALL_ID`] header): what it was
/// answered, and when.
pub fn send_at(
    stack: StatusStack,
    id: u64,
    at: Instant,
    job: Job,
) -> tokio::task::JoinHandle<Outcome> {
    use tower::ServiceExt;
    let mut req = http::Request::new("{}".to_owned());
    req.headers_mut()
        .insert(CALL_ID, http::HeaderValue::from(id));
    req.extensions_mut().insert(job);
    tokio::spawn(async move {
        tokio::time::sleep_until(at).await;
        let sent = Instant::now();
        let answer = answer(stack.oneshot(req).await);
        Outcome {
            id,
            sent,
            done: Instant::now(),
            answer,
        }
    })
}
