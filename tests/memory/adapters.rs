//! The integrations against real servers on loopback: the reqwest-middleware adapter
//! (feature `reqwest`), hyper-util's client as the inner service, and an axum router whose
//! handlers are admitted by the layers. For each: a call succeeds, a 429 with
//! `retry-after-ms` is retried and then succeeds, a rejection comes back in the chosen shape,
//! and a streamed answer holds its slot until its body has been read.
//!
//! The clients call the mock Anthropic upstream of `tests/support/anthropic.rs` (its 429s
//! say `retry-after: 1`, so each client retry test waits about a second). The axum app's
//! handler is a stand-in for the Messages API written here ([`App`]): its 429s say
//! `retry-after-ms: 200`, and its SSE answers stay open until the test releases them. These
//! tests run in real time (real sockets).

use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::support::anthropic::{MESSAGE_JSON, MockAnthropic, Reply, stream_body};
use bytes::Bytes;
use fairgate::{FairgateLayer, Job, Origin, SlotPolicy, Store};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::Frame;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

const MESSAGE: &str = r#"{"id":"msg_01","type":"message","role":"assistant","model":"claude-sonnet-4-5","content":[{"type":"text","text":"Hello!"}],"stop_reason":"end_turn","usage":{"input_tokens":12,"output_tokens":3}}"#;
const SSE_START: &str = "event: message_start\ndata: {\"type\":\"message_start\"}\n\n";
const SSE_REST: &str = "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"delta\":{\"type\":\"text_delta\",\"text\":\"Hello!\"}}\n\nevent: message_stop\ndata: {\"type\":\"message_stop\"}\n\n";
const THROTTLED: &str = r#"{"type":"error","error":{"type":"rate_limit_error","message":"Number of request tokens has exceeded your per-minute rate limit"}}"#;
const ASK: &str =
    r#"{"model":"claude-sonnet-4-5","max_tokens":64,"messages":[{"role":"user","content":"Hi"}]}"#;
const ASK_STREAM: &str = r#"{"model":"claude-sonnet-4-5","max_tokens":64,"stream":true,"messages":[{"role":"user","content":"Hi"}]}"#;

type AppBody = BoxBody<Bytes, Infallible>;

/// The axum app's handler state: what it answers and what it saw.
struct App {
    /// Requests received.
    hits: AtomicUsize,
    /// This many next requests are answered 429.
    throttle: AtomicUsize,
    /// SSE answers send their first event, then wait here for a permit to send the rest.
    gate: Semaphore,
    /// The bodies received, in order.
    bodies: Mutex<Vec<Bytes>>,
}

impl Default for App {
    fn default() -> Self {
        App {
            hits: AtomicUsize::new(0),
            throttle: AtomicUsize::new(0),
            gate: Semaphore::new(0),
            bodies: Mutex::default(),
        }
    }
}

impl App {
    fn throttle_next(&self, n: usize) {
        self.throttle.store(n, Ordering::SeqCst);
    }

    fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }

    fn release_streams(&self, n: usize) {
        self.gate.add_permits(n);
    }

    fn bodies(&self) -> Vec<Bytes> {
        self.bodies.lock().unwrap().clone()
    }

    /// The answer to a Messages request with `body`: a 429 if one is due, an SSE stream if
    /// the request asks for one, else a message.
    fn reply(self: &Arc<Self>, body: Bytes) -> http::Response<AppBody> {
        self.hits.fetch_add(1, Ordering::SeqCst);
        let streaming = body.windows(13).any(|w| w == b"\"stream\":true");
        self.bodies.lock().unwrap().push(body);
        let throttled = self
            .throttle
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        let builder = http::Response::builder().header("request-id", "req_mock");
        if throttled {
            return builder
                .status(429)
                .header("content-type", "application/json")
                .header("retry-after", "1")
                .header("retry-after-ms", "200")
                .body(Full::new(Bytes::from_static(THROTTLED.as_bytes())).boxed())
                .unwrap();
        }
        if !streaming {
            return builder
                .header("content-type", "application/json")
                .body(Full::new(Bytes::from_static(MESSAGE.as_bytes())).boxed())
                .unwrap();
        }
        let mock = self.clone();
        let events = futures_util::stream::unfold(0, move |step| {
            let mock = mock.clone();
            async move {
                let data = match step {
                    0 => SSE_START,
                    1 => {
                        mock.gate.acquire().await.unwrap().forget();
                        SSE_REST
                    }
                    _ => return None,
                };
                Some((
                    Ok::<_, Infallible>(Frame::data(Bytes::from_static(data.as_bytes()))),
                    step + 1,
                ))
            }
        });
        builder
            .header("content-type", "text/event-stream")
            .body(StreamBody::new(events).boxed())
            .unwrap()
    }
}

/// The stack on a fresh store; `guest` is capped at 1 slot and never waits.
fn stack() -> FairgateLayer {
    let slots = SlotPolicy::builder()
        .tier("guest", 1, Duration::ZERO)
        .build()
        .unwrap();
    FairgateLayer::builder(Store::memory())
        .slots(slots)
        .build()
        .unwrap()
}

fn job(tier: &str) -> Job {
    Job::new("tenant-a", Origin::UserAction)
        .with_tier(tier)
        .with_input_text(ASK)
}

/// Waits (a little, in real time) until `store` counts `n` slots in use.
async fn slots_become(store: &Store, n: u32) {
    let mut seen = u32::MAX;
    for _ in 0..200 {
        seen = store.slots_in_use(None).await;
        if seen == n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("{seen} slots in use, expected {n}");
}

/// The mock upstream, its SSE events `gap` apart (so a stream stays open a while).
fn upstream(gap: Duration) -> MockAnthropic {
    let mock = MockAnthropic::start();
    mock.set_event_gap(gap);
    mock
}

fn messages_url(mock: &MockAnthropic) -> String {
    format!("{}/v1/messages", mock.url())
}

/// How long an SSE answer of the mock stays open: long enough to look at the slots while
/// it streams.
const GAP: Duration = Duration::from_millis(150);

#[cfg(feature = "reqwest")]
mod reqwest_middleware_adapter {
    use super::*;

    use fairgate::reject::Rejection;
    use fairgate::reqwest::FairgateMiddleware;
    use reqwest_middleware::{ClientBuilder, ClientWithMiddleware, Middleware, Next};

    /// Counts the attempts that reach the rest of the chain, each seeing the job.
    #[derive(Clone, Default)]
    struct Attempts(Arc<AtomicUsize>);

    #[async_trait::async_trait]
    impl Middleware for Attempts {
        async fn handle(
            &self,
            req: reqwest::Request,
            extensions: &mut http::Extensions,
            next: Next<'_>,
        ) -> reqwest_middleware::Result<reqwest::Response> {
            assert!(
                extensions.get::<Job>().is_some(),
                "the job reaches the chain"
            );
            self.0.fetch_add(1, Ordering::SeqCst);
            next.run(req, extensions).await
        }
    }

    fn client(fairgate: &FairgateLayer, attempts: &Attempts) -> ClientWithMiddleware {
        ClientBuilder::new(reqwest::Client::new())
            .with(FairgateMiddleware::from_layer(fairgate.clone()))
            .with(attempts.clone())
            .build()
    }

    #[tokio::test]
    async fn a_call_succeeds_and_gives_its_slot_back_when_read() {
        let _turn = crate::support::file_turn(module_path!());
        let mock = upstream(GAP);
        let fairgate = stack();
        let attempts = Attempts::default();
        let response = client(&fairgate, &attempts)
            .post(messages_url(&mock))
            .header("anthropic-version", "2023-06-01")
            .body(ASK)
            .with_extension(job("pro"))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        assert_eq!(response.headers()["request-id"], "req_mock_1");
        assert_eq!(
            response.url().as_str(),
            messages_url(&mock),
            "the URL survives"
        );
        assert_eq!(response.text().await.unwrap(), MESSAGE_JSON);
        slots_become(fairgate.store(), 0).await;
        let seen = mock.last_request().unwrap();
        assert_eq!(seen.body, ASK);
        assert_eq!(seen.headers["anthropic-version"], "2023-06-01");
        assert_eq!(attempts.0.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn a_429_is_retried_with_the_same_body_after_retry_after() {
        let _turn = crate::support::file_turn(module_path!());
        let mock = upstream(GAP);
        mock.push_reply(Reply::RateLimited {
            retry_after_secs: 1,
        });
        let fairgate = stack();
        let attempts = Attempts::default();
        let started = tokio::time::Instant::now();
        let response = client(&fairgate, &attempts)
            .post(messages_url(&mock))
            .body(ASK.to_owned())
            .with_extension(job("pro"))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        assert_eq!(response.text().await.unwrap(), MESSAGE_JSON);
        assert!(started.elapsed() >= Duration::from_millis(700), "waited");
        assert_eq!(mock.calls(), 2);
        assert_eq!(
            attempts.0.load(Ordering::SeqCst),
            2,
            "each attempt runs the chain"
        );
        let bodies: Vec<_> = mock.requests().into_iter().map(|r| r.body).collect();
        assert_eq!(bodies, [ASK, ASK], "rebuilt by try_clone");
    }

    #[tokio::test]
    async fn a_streaming_request_body_is_sent_once_and_its_429_returned() {
        let _turn = crate::support::file_turn(module_path!());
        let mock = upstream(GAP);
        mock.push_reply(Reply::RateLimited {
            retry_after_secs: 1,
        });
        let fairgate = stack();
        let chunks = vec![Ok::<_, std::io::Error>(Bytes::from_static(ASK.as_bytes()))];
        let response = client(&fairgate, &Attempts::default())
            .post(messages_url(&mock))
            .body(reqwest::Body::wrap_stream(futures_util::stream::iter(
                chunks,
            )))
            .with_extension(job("pro"))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 429);
        assert!(response.text().await.unwrap().contains("rate_limit_error"));
        assert_eq!(mock.calls(), 1);
    }

    #[tokio::test]
    async fn a_streamed_answer_holds_its_slot_until_its_body_is_read() {
        let _turn = crate::support::file_turn(module_path!());
        let mock = upstream(GAP);
        let fairgate = stack();
        let mut response = client(&fairgate, &Attempts::default())
            .post(messages_url(&mock))
            .body(ASK_STREAM)
            .with_extension(job("pro"))
            .send()
            .await
            .unwrap();
        assert_eq!(response.headers()["content-type"], "text/event-stream");
        let mut read = response.chunk().await.unwrap().unwrap().to_vec();
        assert!(stream_body().as_bytes().starts_with(&read));
        assert_eq!(fairgate.store().slots_in_use(None).await, 1);
        assert_eq!(fairgate.fairness().in_flight(), 1);
        while let Some(chunk) = response.chunk().await.unwrap() {
            read.extend_from_slice(&chunk);
        }
        assert_eq!(read, stream_body().as_bytes(), "byte for byte");
        slots_become(fairgate.store(), 0).await;
        assert_eq!(fairgate.fairness().in_flight(), 0);
    }

    #[tokio::test]
    async fn rejections_come_back_as_errors_rejection_from_error_finds() {
        let _turn = crate::support::file_turn(module_path!());
        let mock = upstream(GAP);
        let fairgate = stack();
        let claude = client(&fairgate, &Attempts::default());
        // The guest tier's one slot, held by an open stream.
        let open = claude
            .post(messages_url(&mock))
            .body(ASK_STREAM)
            .with_extension(job("guest"))
            .send()
            .await
            .unwrap();
        let err = claude
            .post(messages_url(&mock))
            .body(ASK)
            .with_extension(job("guest"))
            .send()
            .await
            .unwrap_err();
        assert!(matches!(err, reqwest_middleware::Error::Middleware(_)));
        let Some(Rejection::Busy(busy)) = Rejection::from_error(&err) else {
            panic!("not busy: {err:?}");
        };
        assert_eq!(busy.tier().as_str(), "guest");
        assert_eq!(busy.retry_after(), Duration::from_secs(5));

        let err = claude
            .post(messages_url(&mock))
            .body(ASK)
            .send()
            .await
            .unwrap_err();
        assert_eq!(
            Rejection::from_error(&err),
            Some(Rejection::MissingJob(fairgate::MissingJob))
        );
        assert_eq!(mock.calls(), 1, "nothing refused was sent");

        drop(open);
        slots_become(fairgate.store(), 0).await;
    }

    #[tokio::test]
    async fn a_failed_connection_stays_a_reqwest_error() {
        let _turn = crate::support::file_turn(module_path!());
        let port = {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            listener.local_addr().unwrap().port()
        };
        let fairgate = stack();
        let err = client(&fairgate, &Attempts::default())
            .post(format!("http://127.0.0.1:{port}/v1/messages"))
            .body(ASK)
            .with_extension(job("pro"))
            .send()
            .await
            .unwrap_err();
        assert!(
            matches!(err, reqwest_middleware::Error::Reqwest(_)),
            "{err:?}"
        );
        assert_eq!(Rejection::from_error(&err), None);
        slots_become(fairgate.store(), 0).await;
    }
}

mod hyper_util_client {
    use super::*;

    use fairgate::reject::Rejection;
    use fairgate::{BoxError, Fairgate};
    use hyper_util::client::legacy::Client;
    use hyper_util::client::legacy::connect::HttpConnector;
    use hyper_util::rt::TokioExecutor;
    use tower::{Layer, ServiceExt};

    type Claude = Fairgate<Client<HttpConnector, Full<Bytes>>>;

    fn claude(fairgate: &FairgateLayer) -> Claude {
        fairgate.layer(Client::builder(TokioExecutor::new()).build_http())
    }

    fn request(mock: &MockAnthropic, body: &'static str, job: Job) -> http::Request<Full<Bytes>> {
        let mut req = http::Request::post(messages_url(mock))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from_static(body.as_bytes())))
            .unwrap();
        req.extensions_mut().insert(job);
        req
    }

    #[tokio::test]
    async fn a_call_succeeds_and_gives_its_slot_back_when_read() {
        let _turn = crate::support::file_turn(module_path!());
        let mock = upstream(GAP);
        let fairgate = stack();
        let response = claude(&fairgate)
            .oneshot(request(&mock, ASK, job("pro")))
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        let body = response.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(body, MESSAGE_JSON);
        slots_become(fairgate.store(), 0).await;
    }

    #[tokio::test]
    async fn a_429_is_retried_after_retry_after_and_then_succeeds() {
        let _turn = crate::support::file_turn(module_path!());
        let mock = upstream(GAP);
        mock.push_reply(Reply::RateLimited {
            retry_after_secs: 1,
        });
        let fairgate = stack();
        let response = claude(&fairgate)
            .oneshot(request(&mock, ASK, job("pro")))
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        let body = response.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(body, MESSAGE_JSON);
        assert_eq!(mock.calls(), 2);
    }

    #[tokio::test]
    async fn a_streamed_answer_holds_its_slot_until_its_body_is_read() {
        let _turn = crate::support::file_turn(module_path!());
        let mock = upstream(GAP);
        let fairgate = stack();
        let response = claude(&fairgate)
            .oneshot(request(&mock, ASK_STREAM, job("pro")))
            .await
            .unwrap();
        let mut body = response.into_body();
        let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
        assert!(stream_body().as_bytes().starts_with(&first));
        assert_eq!(fairgate.store().slots_in_use(None).await, 1);
        let rest = body.collect().await.unwrap().to_bytes();
        assert_eq!([&first[..], &rest[..]].concat(), stream_body().as_bytes());
        slots_become(fairgate.store(), 0).await;
    }

    #[tokio::test]
    async fn a_full_tier_is_refused_with_busy() {
        let _turn = crate::support::file_turn(module_path!());
        let mock = upstream(GAP);
        let fairgate = stack();
        let claude = claude(&fairgate);
        let open = claude
            .clone()
            .oneshot(request(&mock, ASK_STREAM, job("guest")))
            .await
            .unwrap();
        let err: BoxError = claude
            .clone()
            .oneshot(request(&mock, ASK, job("guest")))
            .await
            .unwrap_err();
        let Some(Rejection::Busy(busy)) = Rejection::from_error(&*err) else {
            panic!("not busy: {err:?}");
        };
        assert_eq!(busy.tier().as_str(), "guest");
        assert_eq!(mock.calls(), 1);
        drop(open);
        slots_become(fairgate.store(), 0).await;
    }
}

mod axum_ingress {
    use super::*;

    use axum::Router;
    use axum::body::Body;
    use axum::error_handling::HandleErrorLayer;
    use axum::extract::State;
    use axum::routing::post;
    use fairgate::BoxError;
    use fairgate::extract::{FromHeaders, JobLayer};
    use fairgate::reject::{Style, render};
    use http::HeaderName;
    use tower::ServiceBuilder;

    /// Buffers a request's body so the retry layer can send it again.
    async fn buffer(req: http::Request<Body>) -> Result<http::Request<Full<Bytes>>, BoxError> {
        let (parts, body) = req.into_parts();
        let bytes = axum::body::to_bytes(body, 1 << 20).await?;
        Ok(http::Request::from_parts(parts, Full::new(bytes)))
    }

    async fn messages(State(mock): State<Arc<App>>, body: Bytes) -> http::Response<Body> {
        mock.reply(body).map(Body::new)
    }

    /// The app: its handlers admitted by the stack, the job from the headers, rejections
    /// rendered in `style`; served on a loopback port.
    async fn serve(fairgate: &FairgateLayer, style: Style) -> (String, Arc<App>) {
        let mock = Arc::new(App::default());
        let admission = ServiceBuilder::new()
            .layer(HandleErrorLayer::new(move |e: BoxError| async move {
                render(&e, style)
            }))
            .filter_async(buffer)
            .layer(JobLayer::new(
                FromHeaders::new()
                    .tenant_header(HeaderName::from_static("x-tenant-id"))
                    .tier_header(HeaderName::from_static("x-tier")),
            ))
            .layer(fairgate.clone())
            .map_request(|req: http::Request<Full<Bytes>>| req.map(Body::new));
        let app = Router::new()
            .route("/v1/messages", post(messages))
            .route_layer(admission)
            .with_state(mock.clone());
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/v1/messages", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await });
        (url, mock)
    }

    fn call(url: &str, tier: &str, body: &'static str) -> reqwest::RequestBuilder {
        reqwest::Client::new()
            .post(url)
            .header("x-tenant-id", "tenant-a")
            .header("x-tier", tier)
            .header("content-type", "application/json")
            .body(body)
    }

    #[tokio::test]
    async fn a_call_succeeds_and_gives_its_slot_back_when_read() {
        let _turn = crate::support::file_turn(module_path!());
        let fairgate = stack();
        let (url, mock) = serve(&fairgate, Style::Reference).await;
        let response = call(&url, "pro", ASK).send().await.unwrap();
        assert_eq!(response.status(), 200);
        assert_eq!(response.text().await.unwrap(), MESSAGE);
        assert_eq!(mock.hits(), 1);
        slots_become(fairgate.store(), 0).await;
    }

    #[tokio::test]
    async fn a_429_from_the_handler_is_retried_and_then_succeeds() {
        let _turn = crate::support::file_turn(module_path!());
        let fairgate = stack();
        let (url, mock) = serve(&fairgate, Style::Anthropic).await;
        mock.throttle_next(1);
        let response = call(&url, "pro", ASK).send().await.unwrap();
        assert_eq!(response.status(), 200);
        assert_eq!(response.text().await.unwrap(), MESSAGE);
        assert_eq!(mock.hits(), 2);
        let ask = Bytes::from_static(ASK.as_bytes());
        assert_eq!(mock.bodies(), [ask.clone(), ask]);
    }

    #[tokio::test]
    async fn a_streamed_answer_holds_its_slot_until_its_body_is_read() {
        let _turn = crate::support::file_turn(module_path!());
        let fairgate = stack();
        let (url, mock) = serve(&fairgate, Style::Reference).await;
        let mut response = call(&url, "pro", ASK_STREAM).send().await.unwrap();
        assert_eq!(response.headers()["content-type"], "text/event-stream");
        assert_eq!(response.chunk().await.unwrap().unwrap(), SSE_START);
        assert_eq!(fairgate.store().slots_in_use(None).await, 1);
        mock.release_streams(1);
        assert_eq!(response.text().await.unwrap(), SSE_REST);
        slots_become(fairgate.store(), 0).await;
    }

    /// Holds the guest tier's one slot with an open stream, then sends another guest call
    /// and one without a tenant; returns both answers.
    async fn refused(style: Style) -> [(u16, http::HeaderMap, String); 2] {
        let fairgate = stack();
        let (url, mock) = serve(&fairgate, style).await;
        let mut open = call(&url, "guest", ASK_STREAM).send().await.unwrap();
        assert_eq!(open.chunk().await.unwrap().unwrap(), SSE_START);
        let busy = call(&url, "guest", ASK).send().await.unwrap();
        let anonymous = reqwest::Client::new()
            .post(&url)
            .body(ASK)
            .send()
            .await
            .unwrap();
        let mut answers = Vec::new();
        for response in [busy, anonymous] {
            let status = response.status().as_u16();
            let headers = response.headers().clone();
            answers.push((status, headers, response.text().await.unwrap()));
        }
        assert_eq!(mock.hits(), 1, "nothing refused reached a handler");
        mock.release_streams(1);
        assert_eq!(open.text().await.unwrap(), SSE_REST);
        slots_become(fairgate.store(), 0).await;
        answers.try_into().unwrap()
    }

    #[tokio::test]
    async fn rejections_in_the_reference_shape() {
        let _turn = crate::support::file_turn(module_path!());
        let [busy, anonymous] = refused(Style::Reference).await;
        assert_eq!(busy.0, 503);
        assert_eq!(busy.2, r#"{"code":"SERVER_BUSY","retry_after":5}"#);
        assert_eq!(busy.1["retry-after"], "5");
        assert_eq!(busy.1["content-type"], "application/json");
        assert_eq!(anonymous.0, 401);
        assert_eq!(
            anonymous.2,
            r#"{"code":"UNAUTHENTICATED","message":"request not identified: no x-tenant-id header"}"#
        );
    }

    #[tokio::test]
    async fn rejections_in_the_anthropic_shape() {
        let _turn = crate::support::file_turn(module_path!());
        let [busy, anonymous] = refused(Style::Anthropic).await;
        assert_eq!(busy.0, 529);
        assert!(
            busy.2
                .starts_with(r#"{"type":"error","error":{"type":"overloaded_error","message":"#),
            "{}",
            busy.2
        );
        assert_eq!(busy.1["retry-after"], "5");
        assert_eq!(busy.1["retry-after-ms"], "5000");
        assert_eq!(anonymous.0, 401);
        assert_eq!(
            anonymous.2,
            r#"{"type":"error","error":{"type":"authentication_error","message":"request not identified: no x-tenant-id header"}}"#
        );
    }
}
