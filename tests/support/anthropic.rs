//! A mock Anthropic upstream for tests: an axum server on a loopback port, on its own
//! thread and runtime (so sync and async tests alike can use it), stopped when dropped.
//!
//! What it answers, for `POST /v1/messages` (the first that applies):
//! 1. a reply pushed with [`MockAnthropic::push_reply`] (scripted, first in first out);
//! 2. the request's `x-mock-reply` header: `message`, `stream`, `stream-cut` (its
//!    connection cut inside the fourth event), `hang-up` (the connection dropped unanswered),
//!    `429`, `529`, or a server error after the call ran (`500`, `502`, `503`, `504`);
//! 3. `"stream": true` in the body: an SSE stream ([`stream_body`]), else a message
//!    ([`MESSAGE_JSON`]).
//!
//! `x-mock-delay-ms` on a request (or [`MockAnthropic::set_delay`]) delays the answer's
//! head; `x-mock-padding-bytes: N` makes a message answer's text N bytes long; SSE events are [`MockAnthropic::set_event_gap`] apart. Every answer carries
//! `request-id: req_mock_<n>` and `anthropic-ratelimit-requests-limit: 1000000` (so high
//! that learned pacing never binds: the tests and the bench measure the gateway); 429s
//! carry `retry-after` and Anthropic's `rate_limit_error` body, 529s an `overloaded_error`,
//! each error body with its `request_id` as the API's. As the API does, every answer is
//! compressed when the request accepts it (`Accept-Encoding: gzip` or `deflate`, as the
//! official SDKs send): JSON and SSE alike, each chunk flushed as it goes.
//!
//! The Message Batches API (`/v1/messages/batches`: create, list with `limit`, `after_id`
//! and `before_id`, retrieve, results as JSON lines, cancel, delete) over one workspace's
//! batches: a created batch gets a fresh `msgbatch_mock_<n>` id, has ended at once (each
//! request succeeded with [`MESSAGE_JSON`]) and its `results_url` is on the mock's own
//! address.
//!
//! With [`MockAnthropic::set_output_pace`] a message answer is as long as the request's
//! `max_tokens`: it takes that many output tokens at the pace set, and its `usage` says so
//! (`input_tokens` a quarter of the body's bytes); the time each call took is summed by
//! its `x-mock-tag` header ([`MockAnthropic::busy_by_tag`]). Off by default.
//!
//! With [`MockAnthropic::require_key`] every request must carry that `x-api-key` (else
//! `401 authentication_error`, counted by [`MockAnthropic::refused_keys`]); with
//! [`MockAnthropic::set_close_connections`] every answer closes its connection (so a
//! client keeps none idle to it).
//!
//! `GET /v1/models` and `POST /v1/messages/count_tokens` answer small fixed JSON. The mock
//! counts the calls in flight (a call ends when its answer's last byte is sent or the
//! connection drops it), their maximum, and records every request's method, path, headers
//! and body.
//!
//! ```ignore
//! let mock = support::anthropic::MockAnthropic::start();
//! let url = mock.url(); // http://127.0.0.1:PORT
//! mock.push_reply(Reply::RateLimited { retry_after_secs: 1 });
//! ```
#![allow(dead_code, unreachable_pub)]

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::response::Response;
use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Method, StatusCode};

/// The non-streaming answer, byte for byte.
pub const MESSAGE_JSON: &str = r#"{"id":"msg_mock_01","type":"message","role":"assistant","model":"claude-mock-1","content":[{"type":"text","text":"Hello from the mock upstream."}],"stop_reason":"end_turn","stop_sequence":null,"usage":{"input_tokens":12,"output_tokens":7}}"#;

/// The text the streamed answer spells out, one delta per word.
pub const STREAM_TEXT: [&str; 5] = ["Hello", " from", " the", " mock", " stream."];

/// The SSE events of the streamed answer, each a complete `event: ...\ndata: ...\n\n`.
pub fn stream_events() -> Vec<String> {
    let mut events = Vec::new();
    let mut push = |kind: &str, data: &str| events.push(format!("event: {kind}\ndata: {data}\n\n"));
    push(
        "message_start",
        r#"{"type":"message_start","message":{"id":"msg_mock_02","type":"message","role":"assistant","model":"claude-mock-1","content":[],"stop_reason":null,"stop_sequence":null,"usage":{"input_tokens":12,"output_tokens":1}}}"#,
    );
    push(
        "content_block_start",
        r#"{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}"#,
    );
    push("ping", r#"{"type":"ping"}"#);
    for word in STREAM_TEXT {
        push(
            "content_block_delta",
            &format!(
                r#"{{"type":"content_block_delta","index":0,"delta":{{"type":"text_delta","text":"{word}"}}}}"#
            ),
        );
    }
    push(
        "content_block_stop",
        r#"{"type":"content_block_stop","index":0}"#,
    );
    push(
        "message_delta",
        r#"{"type":"message_delta","delta":{"stop_reason":"end_turn","stop_sequence":null},"usage":{"output_tokens":5}}"#,
    );
    push("message_stop", r#"{"type":"message_stop"}"#);
    events
}

/// The streamed answer's whole body, byte for byte.
pub fn stream_body() -> String {
    stream_events().concat()
}

/// Anthropic's error body for the mock's `n`th call: its `request_id` beside the error, as
/// the API puts it (the same id as the answer's `request-id` header).
pub fn error_json(kind: &str, message: &str, n: u64) -> String {
    format!(
        r#"{{"type":"error","error":{{"type":"{kind}","message":"{message}"}},"request_id":"req_mock_{n}"}}"#
    )
}

/// A scripted answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reply {
    /// `200` with [`MESSAGE_JSON`].
    Message,
    /// `200` SSE with [`stream_events`].
    Stream,
    /// `429` `rate_limit_error` with `retry-after`.
    RateLimited { retry_after_secs: u64 },
    /// `529` `overloaded_error`.
    Overloaded,
    /// `400` `invalid_request_error` (an answer no one retries).
    Invalid,
    /// This server error (`500`, `502`, `503`, `504`) with `api_error`, after the call ran.
    ServerError(u16),
    /// `200` with a message that says no `usage`.
    NoUsage,
    /// `200` SSE whose connection is cut after its first three events and half of the
    /// fourth (the upstream died).
    StreamCut,
    /// No answer at all: the connection is dropped after the request was read (the
    /// upstream died while it ran the call).
    HangUp,
}

/// One request the mock received.
#[derive(Clone, Debug)]
pub struct Recorded {
    pub method: Method,
    /// HTTP/1.1, or HTTP/2 from an upstream of `http2 = true`.
    pub version: http::Version,
    pub path: String,
    pub headers: HeaderMap,
    pub body: Bytes,
}

#[derive(Default)]
struct Inner {
    calls: AtomicU64,
    in_flight: AtomicUsize,
    max_in_flight: AtomicUsize,
    delay_ms: AtomicU64,
    event_gap_ms: AtomicU64,
    normalise_paths: std::sync::atomic::AtomicBool,
    script: Mutex<VecDeque<Reply>>,
    recorded: Mutex<VecDeque<Recorded>>,
    /// `http://127.0.0.1:PORT`, for the batches' `results_url`.
    url: std::sync::OnceLock<String>,
    /// The workspace's batches, oldest first.
    batches: Mutex<Vec<MockBatch>>,
    batches_created: AtomicU64,
    /// Microseconds per output token of a message answer; 0: the fixed answer at once.
    output_pace_us: AtomicU64,
    /// Per `x-mock-tag`: microseconds of answers ended, calls ended, calls in flight and
    /// the sum of their start times (microseconds since `epoch`).
    busy: Mutex<std::collections::BTreeMap<String, [u64; 4]>>,
    epoch: std::sync::OnceLock<std::time::Instant>,
    /// The `x-api-key` every request must carry, when set.
    required_key: Mutex<Option<String>>,
    /// Answers with `connection: close`.
    close_connections: std::sync::atomic::AtomicBool,
    /// Requests refused for their key.
    refused_keys: AtomicU64,
}

/// A batch the mock keeps: its object, and its requests' `custom_id`s.
#[derive(Clone, Debug)]
struct MockBatch {
    object: serde_json::Value,
    custom_ids: Vec<String>,
}

/// How many requests are kept for [`MockAnthropic::requests`].
const RECORDED: usize = 2_000;

/// The running mock; stopped (its thread and runtime ended) when dropped.
pub struct MockAnthropic {
    addr: SocketAddr,
    inner: Arc<Inner>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl MockAnthropic {
    /// Starts the mock on a free loopback port; SSE events 20 ms apart, no delay.
    pub fn start() -> MockAnthropic {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind the mock");
        listener.set_nonblocking(true).unwrap();
        let addr = listener.local_addr().unwrap();
        let inner = Arc::new(Inner::default());
        inner.event_gap_ms.store(20, Ordering::Relaxed);
        let _ = inner.url.set(format!("http://{addr}"));
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let state = inner.clone();
        let thread = std::thread::Builder::new()
            .name("mock-anthropic".into())
            .spawn(move || {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("the mock's runtime");
                runtime.block_on(async move {
                    let listener = tokio::net::TcpListener::from_std(listener).unwrap();
                    let app = axum::Router::new().fallback(checked).with_state(state);
                    tokio::select! {
                        _ = axum::serve(listener, app) => {}
                        _ = stopped => {}
                    }
                });
            })
            .expect("start the mock's thread");
        MockAnthropic {
            addr,
            inner,
            stop: Some(stop),
            thread: Some(thread),
        }
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://127.0.0.1:PORT`, to pass as the gateway's `--upstream`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Delays every answer's head by `delay` (a request's `x-mock-delay-ms` wins).
    pub fn set_delay(&self, delay: Duration) {
        self.inner
            .delay_ms
            .store(delay.as_millis() as u64, Ordering::Relaxed);
    }

    /// The time between two SSE events (default 20 ms).
    pub fn set_event_gap(&self, gap: Duration) {
        self.inner
            .event_gap_ms
            .store(gap.as_millis() as u64, Ordering::Relaxed);
    }

    /// Makes each message answer (not a stream) as long as its request's `max_tokens`, at
    /// `per_token` a token: the answer comes after `max_tokens × per_token`, and its usage
    /// reports `max_tokens` output tokens. `Duration::ZERO` turns it off (the default).
    pub fn set_output_pace(&self, per_token: Duration) {
        self.inner
            .output_pace_us
            .store(per_token.as_micros() as u64, Ordering::Relaxed);
    }

    /// Time answers were in flight (arrival to last byte) up to now, those still in flight
    /// included, and calls ended, summed by the requests' `x-mock-tag` header (untagged
    /// calls are not counted).
    pub fn busy_by_tag(&self) -> std::collections::BTreeMap<String, (Duration, u64)> {
        let now = self.inner.micros();
        self.inner
            .busy
            .lock()
            .unwrap()
            .iter()
            .map(|(tag, [ended, calls, open, starts])| {
                let busy = ended + (open * now).saturating_sub(*starts);
                (tag.clone(), (Duration::from_micros(busy), *calls))
            })
            .collect()
    }

    /// Routes on the path as a lenient server would read it: percent-decoded, `;` params
    /// cut, empty and `.` segments dropped, `..` resolved, no trailing `/`. (The path is
    /// recorded as received.)
    pub fn set_normalise_paths(&self, on: bool) {
        self.inner.normalise_paths.store(on, Ordering::Relaxed);
    }

    /// Answers the next `POST /v1/messages` with `reply` (scripted replies go first in first
    /// out, before any header or body says what to answer).
    pub fn push_reply(&self, reply: Reply) {
        self.inner.script.lock().unwrap().push_back(reply);
    }

    /// Refuses (`401 authentication_error`) every request whose `x-api-key` is not `key`.
    pub fn require_key(&self, key: &str) {
        *self.inner.required_key.lock().unwrap() = Some(key.to_owned());
    }

    /// Requests refused for their key (see [`require_key`](Self::require_key)).
    pub fn refused_keys(&self) -> u64 {
        self.inner.refused_keys.load(Ordering::SeqCst)
    }

    /// Answers every request with `connection: close` (or stops doing so).
    pub fn set_close_connections(&self, on: bool) {
        self.inner.close_connections.store(on, Ordering::SeqCst);
    }

    /// Calls received (every path).
    pub fn calls(&self) -> u64 {
        self.inner.calls.load(Ordering::SeqCst)
    }

    /// Calls whose answer is not fully sent yet.
    pub fn in_flight(&self) -> usize {
        self.inner.in_flight.load(Ordering::SeqCst)
    }

    /// The most calls in flight at once so far.
    pub fn max_in_flight(&self) -> usize {
        self.inner.max_in_flight.load(Ordering::SeqCst)
    }

    /// Forgets the maximum (the next call sets it anew).
    pub fn reset_max_in_flight(&self) {
        self.inner.max_in_flight.store(0, Ordering::SeqCst);
    }

    /// The requests received, oldest first (the last 2,000).
    pub fn requests(&self) -> Vec<Recorded> {
        self.inner
            .recorded
            .lock()
            .unwrap()
            .iter()
            .cloned()
            .collect()
    }

    /// The ids of the batches the mock has (not deleted), oldest first.
    pub fn batch_ids(&self) -> Vec<String> {
        self.inner
            .batches
            .lock()
            .unwrap()
            .iter()
            .filter_map(|batch| batch.object["id"].as_str().map(str::to_owned))
            .collect()
    }

    /// The most recent request, if any.
    pub fn last_request(&self) -> Option<Recorded> {
        self.inner.recorded.lock().unwrap().back().cloned()
    }

    /// Waits up to `within` for the calls in flight to drop to `n`; true if they did.
    pub fn wait_in_flight(&self, n: usize, within: Duration) -> bool {
        let deadline = std::time::Instant::now() + within;
        loop {
            if self.in_flight() == n {
                return true;
            }
            if std::time::Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for MockAnthropic {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Inner {
    /// Microseconds since the first call to this.
    fn micros(&self) -> u64 {
        let epoch = self.epoch.get_or_init(std::time::Instant::now);
        epoch.elapsed().as_micros() as u64
    }
}

/// Counts a call in flight until dropped (with the answer's body, so to its last byte);
/// a tagged call's time counts toward its tag's (tag, start in `Inner::micros`).
struct InFlight(Arc<Inner>, Option<(String, u64)>);

impl InFlight {
    fn enter(inner: &Arc<Inner>) -> InFlight {
        let now = inner.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        inner.max_in_flight.fetch_max(now, Ordering::SeqCst);
        InFlight(inner.clone(), None)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
        if let Some((tag, start)) = self.1.take() {
            let now = self.0.micros();
            let mut busy = self.0.busy.lock().unwrap();
            let [ended, calls, open, starts] = busy.entry(tag).or_default();
            *ended += now.saturating_sub(start);
            *calls += 1;
            *open -= 1;
            *starts -= start;
        }
    }
}

/// [`handle`], after the key check of [`MockAnthropic::require_key`], compressed when the
/// request accepts it (as the API compresses); its answer closes the connection when
/// [`MockAnthropic::set_close_connections`] says so.
async fn checked(State(inner): State<Arc<Inner>>, req: Request) -> Response {
    let encoding = accepted_encoding(req.headers());
    let response = answered(inner, req).await;
    match encoding {
        Some(encoding) => compressed(response, encoding),
        None => response,
    }
}

/// The encoding the API answers in when the request accepts it (the official SDKs send
/// `Accept-Encoding: gzip, deflate`): gzip, else deflate.
fn accepted_encoding(headers: &HeaderMap) -> Option<Encoding> {
    let accepted: Vec<String> = headers
        .get_all("accept-encoding")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|coding| {
            coding
                .split(';')
                .next()
                .unwrap_or("")
                .trim()
                .to_ascii_lowercase()
        })
        .collect();
    let accepts = |name: &str| accepted.iter().any(|coding| coding == name);
    match (accepts("gzip"), accepts("deflate")) {
        (true, _) => Some(Encoding::Gzip),
        (false, true) => Some(Encoding::Deflate),
        (false, false) => None,
    }
}

/// An encoding the mock compresses its answers in.
#[derive(Clone, Copy, Debug)]
enum Encoding {
    Gzip,
    Deflate,
}

/// A compressor of one answer: each chunk is compressed and flushed as it comes (an SSE
/// event is never held back), then the stream is finished.
enum Compressor {
    Gzip(flate2::write::GzEncoder<Vec<u8>>),
    Deflate(flate2::write::ZlibEncoder<Vec<u8>>),
}

impl Compressor {
    fn new(encoding: Encoding) -> Compressor {
        let level = flate2::Compression::fast();
        match encoding {
            Encoding::Gzip => Compressor::Gzip(flate2::write::GzEncoder::new(Vec::new(), level)),
            Encoding::Deflate => {
                Compressor::Deflate(flate2::write::ZlibEncoder::new(Vec::new(), level))
            }
        }
    }

    /// `chunk` compressed and flushed: what the client can decode of it at once.
    fn push(&mut self, chunk: &[u8]) -> Bytes {
        use std::io::Write;
        let out = match self {
            Compressor::Gzip(e) => {
                e.write_all(chunk).and_then(|()| e.flush()).unwrap();
                e.get_mut()
            }
            Compressor::Deflate(e) => {
                e.write_all(chunk).and_then(|()| e.flush()).unwrap();
                e.get_mut()
            }
        };
        Bytes::from(std::mem::take(out))
    }

    fn finish(self) -> Bytes {
        Bytes::from(match self {
            Compressor::Gzip(e) => e.finish().unwrap(),
            Compressor::Deflate(e) => e.finish().unwrap(),
        })
    }
}

/// `response` compressed in `encoding`, chunk by chunk, as the API compresses its JSON and
/// SSE answers for a client that accepts it.
fn compressed(response: Response, encoding: Encoding) -> Response {
    use futures_util::StreamExt;
    let (mut parts, body) = response.into_parts();
    let name = match encoding {
        Encoding::Gzip => "gzip",
        Encoding::Deflate => "deflate",
    };
    parts
        .headers
        .insert("content-encoding", HeaderValue::from_static(name));
    parts.headers.remove("content-length");
    parts
        .headers
        .append("vary", HeaderValue::from_static("accept-encoding"));
    let state = (body.into_data_stream(), Some(Compressor::new(encoding)));
    let stream = futures_util::stream::unfold(state, |(mut chunks, compressor)| async move {
        let mut compressor = compressor?;
        match chunks.next().await {
            Some(Ok(chunk)) => {
                let out = compressor.push(&chunk);
                Some((Ok(out), (chunks, Some(compressor))))
            }
            Some(Err(e)) => Some((Err(e), (chunks, None))),
            None => Some((Ok(compressor.finish()), (chunks, None))),
        }
    });
    Response::from_parts(parts, Body::from_stream(stream))
}

/// [`handle`] after the key check.
async fn answered(inner: Arc<Inner>, req: Request) -> Response {
    let required = inner.required_key.lock().unwrap().clone();
    let sent = req.headers().get("x-api-key").and_then(|v| v.to_str().ok());
    let mut response = match required {
        Some(key) if sent != Some(key.as_str()) => {
            inner.refused_keys.fetch_add(1, Ordering::SeqCst);
            // Refused before it counts as a call: request id 0.
            let mut response = Response::new(Body::from(error_json(
                "authentication_error",
                "invalid x-api-key",
                0,
            )));
            *response.status_mut() = StatusCode::UNAUTHORIZED;
            response
        }
        _ => handle(State(inner.clone()), req).await,
    };
    if inner.close_connections.load(Ordering::SeqCst) {
        response
            .headers_mut()
            .insert("connection", HeaderValue::from_static("close"));
    }
    response
}

/// The request body's `max_tokens`, if it has one.
fn max_tokens(body: &[u8]) -> Option<u64> {
    serde_json::from_slice::<serde_json::Value>(body)
        .ok()?
        .get("max_tokens")?
        .as_u64()
}

async fn handle(State(inner): State<Arc<Inner>>, req: Request) -> Response {
    let n = inner.calls.fetch_add(1, Ordering::SeqCst) + 1;
    let mut guard = InFlight::enter(&inner);
    if let Some(tag) = req
        .headers()
        .get("x-mock-tag")
        .and_then(|v| v.to_str().ok())
    {
        let start = inner.micros();
        let mut busy = inner.busy.lock().unwrap();
        let [_, _, open, starts] = busy.entry(tag.to_owned()).or_default();
        *open += 1;
        *starts += start;
        guard.1 = Some((tag.to_owned(), start));
    }
    let (parts, body) = req.into_parts();
    let body = axum::body::to_bytes(body, 64 << 20)
        .await
        .unwrap_or_default();
    {
        let mut recorded = inner.recorded.lock().unwrap();
        if recorded.len() == RECORDED {
            recorded.pop_front();
        }
        recorded.push_back(Recorded {
            method: parts.method.clone(),
            version: parts.version,
            path: parts.uri.path().to_owned(),
            headers: parts.headers.clone(),
            body: body.clone(),
        });
    }
    let header = |name: &str| {
        parts
            .headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    let request_body = body.clone();
    let delay = header("x-mock-delay-ms")
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| inner.delay_ms.load(Ordering::Relaxed));
    if delay > 0 {
        tokio::time::sleep(Duration::from_millis(delay)).await;
    }
    let normalised;
    let path = if inner.normalise_paths.load(Ordering::Relaxed) {
        normalised = normalise(parts.uri.path());
        normalised.as_str()
    } else {
        parts.uri.path()
    };
    if path == "/v1/messages/batches" || path.starts_with("/v1/messages/batches/") {
        drop(guard);
        let (status, content_type, body) = batches(
            (&inner, n),
            &parts.method,
            path,
            parts.uri.query().unwrap_or(""),
            &body,
        );
        let mut response = Response::new(Body::from(body));
        *response.status_mut() = status;
        let headers = response.headers_mut();
        headers.insert("content-type", HeaderValue::from_static(content_type));
        common_headers(headers, n);
        return response;
    }
    let (status, content_type, body, retry_after) = match (&parts.method, path) {
        (&Method::POST, "/v1/messages") => {
            let scripted = inner.script.lock().unwrap().pop_front();
            let reply = scripted.unwrap_or_else(|| match header("x-mock-reply").as_deref() {
                Some("stream") => Reply::Stream,
                Some("429") => Reply::RateLimited {
                    retry_after_secs: 1,
                },
                Some("529") => Reply::Overloaded,
                Some(code @ ("500" | "502" | "503" | "504")) => {
                    Reply::ServerError(code.parse().unwrap())
                }
                Some("message") => Reply::Message,
                Some("stream-cut") => Reply::StreamCut,
                Some("hang-up") => Reply::HangUp,
                _ if wants_stream(&body) => Reply::Stream,
                _ => Reply::Message,
            });
            match reply {
                Reply::Message => (StatusCode::OK, "application/json", Body::empty(), None),
                Reply::Stream => {
                    let gap = Duration::from_millis(inner.event_gap_ms.load(Ordering::Relaxed));
                    return sse(n, guard, gap);
                }
                Reply::HangUp => {
                    // Unwinding ends the connection's task: the socket closes unanswered.
                    drop(guard);
                    std::panic::resume_unwind(Box::new("the mock upstream hangs up, as asked"));
                }
                Reply::StreamCut => {
                    let mut response = sse(n, guard, Duration::ZERO);
                    use futures_util::StreamExt;
                    // Three events, then the first bytes of a fourth: the connection dies
                    // inside it.
                    let events: Vec<Result<Bytes, std::io::Error>> = stream_events()[..4]
                        .iter()
                        .enumerate()
                        .map(|(i, event)| match i {
                            3 => Ok(Bytes::from(event[..event.len() / 2].to_owned())),
                            _ => Ok(Bytes::from(event.clone())),
                        })
                        .collect();
                    // The events go out first (a moment passes), then the connection dies.
                    let cut = futures_util::stream::once(async {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        Err(std::io::Error::other("the upstream died"))
                    });
                    let stream = futures_util::stream::iter(events).chain(cut);
                    *response.body_mut() = Body::from_stream(stream);
                    return response;
                }
                Reply::RateLimited { retry_after_secs } => (
                    StatusCode::TOO_MANY_REQUESTS,
                    "application/json",
                    Body::from(error_json(
                        "rate_limit_error",
                        "Number of request tokens has exceeded your per-minute rate limit",
                        n,
                    )),
                    Some(retry_after_secs),
                ),
                Reply::Overloaded => (
                    StatusCode::from_u16(529).unwrap(),
                    "application/json",
                    Body::from(error_json("overloaded_error", "Overloaded", n)),
                    None,
                ),
                Reply::Invalid => (
                    StatusCode::BAD_REQUEST,
                    "application/json",
                    Body::from(error_json("invalid_request_error", "Invalid request", n)),
                    None,
                ),
                Reply::ServerError(status) => (
                    StatusCode::from_u16(status).unwrap(),
                    "application/json",
                    Body::from(error_json("api_error", "Internal server error", n)),
                    None,
                ),
                Reply::NoUsage => {
                    drop(guard);
                    let json = MESSAGE_JSON
                        .replace(r#","usage":{"input_tokens":12,"output_tokens":7}"#, "");
                    let mut response = Response::new(Body::from(json));
                    let headers = response.headers_mut();
                    headers.insert("content-type", HeaderValue::from_static("application/json"));
                    common_headers(headers, n);
                    return response;
                }
            }
        }
        (&Method::POST, "/v1/messages/count_tokens") => (
            StatusCode::OK,
            "application/json",
            Body::from(r#"{"input_tokens":12}"#),
            None,
        ),
        (&Method::GET, "/v1/models") => (
            StatusCode::OK,
            "application/json",
            Body::from(
                r#"{"data":[{"type":"model","id":"claude-mock-1","display_name":"Claude Mock","created_at":"2025-01-01T00:00:00Z"}],"has_more":false,"first_id":"claude-mock-1","last_id":"claude-mock-1"}"#,
            ),
            None,
        ),
        _ => (
            StatusCode::NOT_FOUND,
            "application/json",
            Body::from(error_json("not_found_error", "Not found", n)),
            None,
        ),
    };
    // The message body, held with the in-flight guard until it is sent.
    let pace = inner.output_pace_us.load(Ordering::Relaxed);
    let body = if status == StatusCode::OK && path == "/v1/messages" && pace > 0 {
        // As long as `max_tokens`: that many output tokens, at the pace set.
        let output = max_tokens(&request_body).unwrap_or(1);
        tokio::time::sleep(Duration::from_micros(output.saturating_mul(pace))).await;
        let input = request_body.len() as u64 / 4;
        let json = MESSAGE_JSON.replace(
            r#""usage":{"input_tokens":12,"output_tokens":7}"#,
            &format!(r#""usage":{{"input_tokens":{input},"output_tokens":{output}}}"#),
        );
        guarded(vec![Bytes::from(json)], guard, Duration::ZERO)
    } else if status == StatusCode::OK && path == "/v1/messages" {
        let chunks = match header("x-mock-padding-bytes").and_then(|v| v.parse().ok()) {
            Some(padding) => padded_message(padding),
            None => vec![Bytes::from_static(MESSAGE_JSON.as_bytes())],
        };
        guarded(chunks, guard, Duration::ZERO)
    } else {
        drop(guard);
        body
    };
    let mut response = Response::new(body);
    *response.status_mut() = status;
    let headers = response.headers_mut();
    headers.insert("content-type", HeaderValue::from_static(content_type));
    common_headers(headers, n);
    if let Some(secs) = retry_after {
        headers.insert("retry-after", HeaderValue::from(secs));
    }
    response
}

/// A message whose text is `padding` bytes of `x`, in 64 KiB chunks (a large answer).
fn padded_message(padding: usize) -> Vec<Bytes> {
    let mut chunks = vec![Bytes::from_static(
        br#"{"id":"msg_mock_03","type":"message","role":"assistant","model":"claude-mock-1","content":[{"type":"text","text":""#,
    )];
    let chunk = Bytes::from(vec![b'x'; 64 << 10]);
    let mut left = padding;
    while left > 0 {
        let n = left.min(chunk.len());
        chunks.push(chunk.slice(..n));
        left -= n;
    }
    chunks.push(Bytes::from_static(
        br#""}],"stop_reason":"end_turn","stop_sequence":null,"usage":{"input_tokens":12,"output_tokens":7}}"#,
    ));
    chunks
}

fn wants_stream(body: &[u8]) -> bool {
    let text = String::from_utf8_lossy(body);
    let compact: String = text.chars().filter(|c| !c.is_whitespace()).collect();
    compact.contains(r#""stream":true"#)
}

fn common_headers(headers: &mut HeaderMap, n: u64) {
    headers.insert(
        "request-id",
        HeaderValue::from_str(&format!("req_mock_{n}")).unwrap(),
    );
    headers.insert(
        "anthropic-ratelimit-requests-limit",
        HeaderValue::from_static("1000000"),
    );
    headers.insert(
        "anthropic-ratelimit-requests-remaining",
        HeaderValue::from_static("999999"),
    );
}

fn sse(n: u64, guard: InFlight, gap: Duration) -> Response {
    let events = stream_events().into_iter().map(Bytes::from).collect();
    let mut response = Response::new(guarded(events, guard, gap));
    let headers = response.headers_mut();
    headers.insert(
        "content-type",
        HeaderValue::from_static("text/event-stream"),
    );
    headers.insert("cache-control", HeaderValue::from_static("no-cache"));
    common_headers(headers, n);
    response
}

/// A body of `chunks`, `gap` apart (the first at once), holding `guard` until its last
/// chunk is taken or it is dropped.
fn guarded(chunks: Vec<Bytes>, guard: InFlight, gap: Duration) -> Body {
    let state = (VecDeque::from(chunks), Some(guard), true);
    let stream =
        futures_util::stream::unfold(state, move |(mut chunks, guard, first)| async move {
            let chunk = chunks.pop_front()?;
            if !first && !gap.is_zero() {
                tokio::time::sleep(gap).await;
            }
            // The guard goes with the last chunk: the call ends when its last byte is taken.
            let guard = if chunks.is_empty() { None } else { guard };
            Some((Ok::<_, std::io::Error>(chunk), (chunks, guard, false)))
        });
    Body::from_stream(stream)
}

/// `path` as a lenient server reads it (see [`MockAnthropic::set_normalise_paths`]).
pub fn normalise(path: &str) -> String {
    let bytes = path.as_bytes();
    let mut decoded = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%'
            && i + 2 < bytes.len()
            && let Ok(byte) = u8::from_str_radix(&path[i + 1..i + 3], 16)
        {
            decoded.push(byte);
            i += 3;
            continue;
        }
        decoded.push(bytes[i]);
        i += 1;
    }
    let decoded = String::from_utf8_lossy(&decoded).into_owned();
    let mut segments: Vec<&str> = Vec::new();
    for segment in decoded.split('/') {
        let segment = segment.split(';').next().unwrap_or("");
        match segment {
            "" | "." => {}
            ".." => {
                segments.pop();
            }
            other => segments.push(other),
        }
    }
    format!("/{}", segments.join("/"))
}

/// The Message Batches API over the mock's one workspace: `(status, content type, body)`.
fn batches(
    (inner, n): (&Inner, u64),
    method: &Method,
    path: &str,
    query: &str,
    body: &[u8],
) -> (StatusCode, &'static str, String) {
    let json = "application/json";
    let not_found = || {
        (
            StatusCode::NOT_FOUND,
            json,
            error_json("not_found_error", "Not found", n),
        )
    };
    let segments: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let mut batches = inner.batches.lock().unwrap();
    let find = |id: &str| {
        batches
            .iter()
            .position(|batch| batch.object["id"].as_str() == Some(id))
    };
    match (method, segments.as_slice()) {
        (&Method::POST, ["v1", "messages", "batches"]) => {
            let Ok(request) = serde_json::from_slice::<serde_json::Value>(body) else {
                return (
                    StatusCode::BAD_REQUEST,
                    json,
                    error_json("invalid_request_error", "the body is not JSON", n),
                );
            };
            let custom_ids: Vec<String> = request["requests"]
                .as_array()
                .map(|requests| {
                    requests
                        .iter()
                        .filter_map(|r| r["custom_id"].as_str().map(str::to_owned))
                        .collect()
                })
                .unwrap_or_default();
            let n = inner.batches_created.fetch_add(1, Ordering::SeqCst) + 1;
            let id = format!("msgbatch_mock_{n:04}");
            let url = inner.url.get().cloned().unwrap_or_default();
            let object = serde_json::json!({
                "id": id,
                "type": "message_batch",
                "processing_status": "ended",
                "request_counts": {
                    "processing": 0,
                    "succeeded": custom_ids.len(),
                    "errored": 0,
                    "canceled": 0,
                    "expired": 0
                },
                "ended_at": "2025-01-01T00:00:01Z",
                "created_at": "2025-01-01T00:00:00Z",
                "expires_at": "2025-01-02T00:00:00Z",
                "archived_at": null,
                "cancel_initiated_at": null,
                "results_url": format!("{url}/v1/messages/batches/{id}/results"),
            });
            batches.push(MockBatch {
                object: object.clone(),
                custom_ids,
            });
            (StatusCode::OK, json, object.to_string())
        }
        (&Method::GET, ["v1", "messages", "batches"]) => {
            // Newest first, paged as the API pages.
            let newest_first: Vec<&MockBatch> = batches.iter().rev().collect();
            let param = |name: &str| {
                query
                    .split('&')
                    .filter_map(|pair| pair.split_once('='))
                    .find(|(k, _)| *k == name)
                    .map(|(_, v)| v.to_owned())
            };
            let limit: usize = param("limit").and_then(|l| l.parse().ok()).unwrap_or(20);
            let rank = |id: &str| {
                newest_first
                    .iter()
                    .position(|batch| batch.object["id"].as_str() == Some(id))
            };
            let (start, end, has_more) = if let Some(after) = param("after_id") {
                let Some(rank) = rank(&after) else {
                    return not_found();
                };
                let start = rank + 1;
                let end = (start + limit).min(newest_first.len());
                (start, end, newest_first.len() > end)
            } else if let Some(before) = param("before_id") {
                let Some(rank) = rank(&before) else {
                    return not_found();
                };
                (rank.saturating_sub(limit), rank, rank > limit)
            } else {
                let end = limit.min(newest_first.len());
                (0, end, newest_first.len() > end)
            };
            let data: Vec<serde_json::Value> = newest_first[start..end]
                .iter()
                .map(|batch| batch.object.clone())
                .collect();
            let list = serde_json::json!({
                "data": data,
                "has_more": has_more,
                "first_id": data.first().map(|b| b["id"].clone()),
                "last_id": data.last().map(|b| b["id"].clone()),
            });
            (StatusCode::OK, json, list.to_string())
        }
        (&Method::GET, ["v1", "messages", "batches", id]) => match find(id) {
            Some(at) => (StatusCode::OK, json, batches[at].object.to_string()),
            None => not_found(),
        },
        (&Method::GET, ["v1", "messages", "batches", id, "results"]) => match find(id) {
            Some(at) => {
                let lines: String = batches[at]
                    .custom_ids
                    .iter()
                    .map(|custom_id| {
                        format!(
                            r#"{{"custom_id":{},"result":{{"type":"succeeded","message":{MESSAGE_JSON}}}}}"#,
                            serde_json::Value::from(custom_id.as_str())
                        ) + "\n"
                    })
                    .collect();
                (StatusCode::OK, "application/x-jsonl", lines)
            }
            None => not_found(),
        },
        (&Method::POST, ["v1", "messages", "batches", id, "cancel"]) => match find(id) {
            Some(at) => {
                let object = &mut batches[at].object;
                object["cancel_initiated_at"] = "2025-01-01T00:00:02Z".into();
                (StatusCode::OK, json, object.to_string())
            }
            None => not_found(),
        },
        (&Method::DELETE, ["v1", "messages", "batches", id]) => match find(id) {
            Some(at) => {
                batches.remove(at);
                let deleted = serde_json::json!({"id": id, "type": "message_batch_deleted"});
                (StatusCode::OK, json, deleted.to_string())
            }
            None => not_found(),
        },
        _ => not_found(),
    }
}
