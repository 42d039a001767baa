//! Bedrock's answers in the Messages API's shape: a JSON message passes as it is; an event
//! stream becomes server-sent events; an error, over HTTP or inside a stream, becomes
//! `{"type":"error","error":{"type":…,"message":…}}` with the status Anthropic would give.

use std::collections::VecDeque;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::{Buf, Bytes};
use http::{HeaderValue, StatusCode, header};
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;
use serde_json::Value;

use super::codec::base64_decode;
use super::eventstream::{Decoder, Message};

/// The most of an error answer's body read for its message.
const MAX_ERROR_BODY: usize = 64 * 1024;

/// What a Bedrock call is, for reading its answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Operation {
    /// `invoke`: a JSON message.
    Invoke,
    /// `invoke-with-response-stream`: an event stream.
    Stream,
    /// `count-tokens`: `{"inputTokens": n}`, answered as `{"input_tokens": n}`.
    CountTokens,
}

/// An answer in the Messages API's error shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct MessagesError {
    pub(crate) status: StatusCode,
    pub(crate) kind: &'static str,
    pub(crate) message: String,
}

impl MessagesError {
    pub(crate) fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        MessagesError {
            status,
            kind,
            message: message.into(),
        }
    }

    /// `{"type":"error","error":{"type":…,"message":…}}`.
    pub(crate) fn json(&self) -> String {
        serde_json::json!({
            "type": "error",
            "error": { "type": self.kind, "message": self.message },
        })
        .to_string()
    }

    /// The same as a server-sent `error` event.
    fn event(&self) -> Bytes {
        Bytes::from(format!("event: error\ndata: {}\n\n", self.json()))
    }

    /// A whole response with this error as its body.
    pub(crate) fn response<B>(&self) -> http::Response<UpstreamBody<B>> {
        let mut response = http::Response::new(UpstreamBody::full(Bytes::from(self.json())));
        *response.status_mut() = self.status;
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        response
    }
}

/// The Messages API's status and error type for a Bedrock exception (`ThrottlingException`,
/// or `throttlingException` as streams name it) or, when the name is unknown, for the status
/// Bedrock answered.
pub(crate) fn classify(exception: &str, status: StatusCode) -> (StatusCode, &'static str) {
    let overloaded = StatusCode::from_u16(529).unwrap_or(StatusCode::SERVICE_UNAVAILABLE);
    match exception.to_ascii_lowercase().as_str() {
        "throttlingexception" | "servicequotaexceededexception" => {
            (StatusCode::TOO_MANY_REQUESTS, "rate_limit_error")
        }
        "serviceunavailableexception" | "modelnotreadyexception" => {
            (overloaded, "overloaded_error")
        }
        "validationexception" => (StatusCode::BAD_REQUEST, "invalid_request_error"),
        "resourcenotfoundexception" => (StatusCode::NOT_FOUND, "not_found_error"),
        "accessdeniedexception" => (StatusCode::FORBIDDEN, "permission_error"),
        "unrecognizedclientexception"
        | "invalidsignatureexception"
        | "incompletesignatureexception"
        | "missingauthenticationtokenexception"
        | "expiredtokenexception" => (StatusCode::UNAUTHORIZED, "authentication_error"),
        "internalserverexception"
        | "modelerrorexception"
        | "modelstreamerrorexception"
        | "modeltimeoutexception" => (StatusCode::INTERNAL_SERVER_ERROR, "api_error"),
        _ => match status.as_u16() {
            400 => (status, "invalid_request_error"),
            401 => (status, "authentication_error"),
            403 => (status, "permission_error"),
            404 => (status, "not_found_error"),
            413 => (status, "request_too_large"),
            429 => (status, "rate_limit_error"),
            503 | 529 => (overloaded, "overloaded_error"),
            500..=599 => (status, "api_error"),
            _ => (StatusCode::INTERNAL_SERVER_ERROR, "api_error"),
        },
    }
}

/// The exception name of `x-amzn-errortype` (`ThrottlingException:http://…` → `ThrottlingException`).
fn error_type(headers: &http::HeaderMap) -> &str {
    headers
        .get("x-amzn-errortype")
        .and_then(|v| v.to_str().ok())
        .map_or("", |v| v.split(':').next().unwrap_or(v))
}

/// The `message` (or `Message`) of an AWS JSON error body.
fn error_message(body: &[u8]) -> Option<String> {
    let value: Value = serde_json::from_slice(body).ok()?;
    ["message", "Message"]
        .iter()
        .find_map(|k| value.get(k)?.as_str().map(str::to_owned))
}

/// Bedrock's response head in the Messages API's shape, and how its body is to be read.
pub(crate) fn answer<B>(
    response: http::Response<B>,
    operation: Operation,
) -> http::Response<UpstreamBody<B>> {
    let (mut parts, inner) = response.into_parts();
    if let Some(id) = parts.headers.get("x-amzn-requestid").cloned() {
        parts.headers.insert("request-id", id);
    }
    let is_events = parts
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/vnd.amazon.eventstream"));
    let kind = if !parts.status.is_success() {
        let exception = error_type(&parts.headers).to_owned();
        let (status, kind) = classify(&exception, parts.status);
        parts.status = status;
        set_content_type(&mut parts.headers, "application/json");
        Kind::Error {
            inner,
            read: Vec::new(),
            error: Some(MessagesError::new(status, kind, exception)),
        }
    } else if operation == Operation::CountTokens {
        parts.headers.remove(header::CONTENT_LENGTH);
        Kind::Count {
            inner,
            read: Vec::new(),
            done: false,
        }
    } else if is_events {
        set_content_type(&mut parts.headers, "text/event-stream");
        parts
            .headers
            .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
        Kind::Events {
            inner,
            decoder: Decoder::default(),
            out: VecDeque::new(),
            ended: false,
        }
    } else {
        Kind::Pass { inner }
    };
    http::Response::from_parts(parts, UpstreamBody { kind })
}

fn set_content_type(headers: &mut http::HeaderMap, value: &'static str) {
    headers.remove(header::CONTENT_LENGTH);
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(value));
}

/// What one event stream message becomes.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Translated {
    /// A server-sent event to pass on.
    Event(Bytes),
    /// Nothing for the client (an event type the Messages API does not have).
    Skip,
    /// An error: sent as an `error` event, after which the stream ends.
    Error(MessagesError),
}

/// One event stream message as the Messages API streams it.
pub(crate) fn translate(message: &Message) -> Translated {
    let api_error = |text: &str| {
        Translated::Error(MessagesError::new(
            StatusCode::BAD_GATEWAY,
            "api_error",
            format!("Bedrock stream: {text}"),
        ))
    };
    match message.header(":message-type") {
        Some("event") if message.header(":event-type") == Some("chunk") => {
            match chunk_event(&message.payload) {
                Some(event) => Translated::Event(event),
                None => api_error("a chunk that is not a Messages stream event"),
            }
        }
        Some("event") => Translated::Skip,
        Some("exception") => {
            let exception = message.header(":exception-type").unwrap_or("");
            let (status, kind) = classify(exception, StatusCode::INTERNAL_SERVER_ERROR);
            let text = error_message(&message.payload).unwrap_or_else(|| exception.to_owned());
            Translated::Error(MessagesError::new(status, kind, text))
        }
        Some("error") => {
            let code = message.header(":error-code").unwrap_or("");
            let (status, kind) = classify(code, StatusCode::INTERNAL_SERVER_ERROR);
            let text = message.header(":error-message").unwrap_or(code);
            Translated::Error(MessagesError::new(status, kind, text))
        }
        _ => api_error("a message without a known :message-type"),
    }
}

/// `{"bytes":"<base64 of a Messages stream event>"}` as `event: <type>\ndata: <json>\n\n`.
/// Bedrock's own `amazon-bedrock-invocationMetrics` field is left out.
fn chunk_event(payload: &[u8]) -> Option<Bytes> {
    let chunk: Value = serde_json::from_slice(payload).ok()?;
    let decoded = base64_decode(chunk.get("bytes")?.as_str()?)?;
    let mut event: Value = serde_json::from_slice(&decoded).ok()?;
    let object = event.as_object_mut()?;
    object.remove("amazon-bedrock-invocationMetrics");
    let kind = object.get("type")?.as_str()?.to_owned();
    if kind.is_empty() || kind.contains(['\n', '\r']) {
        return None;
    }
    Some(Bytes::from(format!("event: {kind}\ndata: {event}\n\n")))
}

pin_project! {
    /// The body of an answer from an upstream, in the Messages API's shape whatever its
    /// kind: the upstream's own body when it already is (the Anthropic API's answers,
    /// Bedrock's JSON messages), server-sent events decoded from Bedrock's event stream as
    /// it arrives, or an error in the Messages API's shape.
    ///
    /// An event stream that cannot be decoded (a bad checksum, a cut-off message) or that
    /// carries an exception ends with an `error` event; the body's own errors are the inner
    /// body's.
    #[derive(Debug)]
    pub struct UpstreamBody<B> {
        #[pin]
        kind: Kind<B>,
    }
}

pin_project! {
    #[project = KindProj]
    #[derive(Debug)]
    enum Kind<B> {
        Pass { #[pin] inner: B },
        Events { #[pin] inner: B, decoder: Decoder, out: VecDeque<Bytes>, ended: bool },
        Error { #[pin] inner: B, read: Vec<u8>, error: Option<MessagesError> },
        Count { #[pin] inner: B, read: Vec<u8>, done: bool },
        Full { data: Option<Bytes> },
    }
}

impl<B> UpstreamBody<B> {
    /// The upstream's own body, passed as it is.
    pub(crate) fn pass(inner: B) -> Self {
        UpstreamBody {
            kind: Kind::Pass { inner },
        }
    }

    /// A body of one chunk.
    pub(crate) fn full(data: Bytes) -> Self {
        UpstreamBody {
            kind: Kind::Full { data: Some(data) },
        }
    }
}

impl<B> Body for UpstreamBody<B>
where
    B: Body,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        match self.project().kind.project() {
            KindProj::Pass { inner } => {
                let frame = ready!(inner.poll_frame(cx));
                Poll::Ready(
                    frame.map(|f| f.map(|f| f.map_data(|mut d| d.copy_to_bytes(d.remaining())))),
                )
            }
            KindProj::Events {
                inner,
                decoder,
                out,
                ended,
            } => poll_events(inner, decoder, out, ended, cx),
            KindProj::Error { inner, read, error } => poll_error(inner, read, error, cx),
            KindProj::Count { inner, read, done } => poll_count(inner, read, done, cx),
            KindProj::Full { data } => Poll::Ready(data.take().map(|d| Ok(Frame::data(d)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Pass { inner } => inner.is_end_stream(),
            Kind::Full { data } => data.is_none(),
            Kind::Events { out, ended, .. } => *ended && out.is_empty(),
            Kind::Error { error, .. } => error.is_none(),
            Kind::Count { done, .. } => *done,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Pass { inner } => inner.size_hint(),
            Kind::Full { data } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
            _ => SizeHint::default(),
        }
    }
}

/// Reads the event stream, sending what each message becomes; after an error event or the
/// end of the stream, nothing more is read.
fn poll_events<B: Body>(
    mut inner: Pin<&mut B>,
    decoder: &mut Decoder,
    out: &mut VecDeque<Bytes>,
    ended: &mut bool,
    cx: &mut Context<'_>,
) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
    loop {
        if let Some(event) = out.pop_front() {
            return Poll::Ready(Some(Ok(Frame::data(event))));
        }
        if *ended {
            return Poll::Ready(None);
        }
        match ready!(inner.as_mut().poll_frame(cx)) {
            Some(Ok(frame)) => {
                if let Ok(mut data) = frame.into_data() {
                    decoder.push(&data.copy_to_bytes(data.remaining()));
                }
            }
            Some(Err(e)) => {
                *ended = true;
                return Poll::Ready(Some(Err(e)));
            }
            None => {
                *ended = true;
                if let Err(e) = decoder.finish() {
                    out.push_back(stream_broken(&e.to_string()));
                }
                continue;
            }
        }
        while let Some(message) = decoder.next_message() {
            let translated = match message {
                Ok(message) => translate(&message),
                Err(e) => Translated::Error(broken(&e.to_string())),
            };
            match translated {
                Translated::Event(event) => out.push_back(event),
                Translated::Skip => {}
                Translated::Error(error) => {
                    out.push_back(error.event());
                    *ended = true;
                    break;
                }
            }
        }
    }
}

fn broken(why: &str) -> MessagesError {
    MessagesError::new(
        StatusCode::BAD_GATEWAY,
        "api_error",
        format!("Bedrock stream: {why}"),
    )
}

fn stream_broken(why: &str) -> Bytes {
    broken(why).event()
}

/// Reads `inner` to its end (or its error), keeping its first [`MAX_ERROR_BODY`] bytes.
fn poll_collect<B: Body>(
    mut inner: Pin<&mut B>,
    read: &mut Vec<u8>,
    cx: &mut Context<'_>,
) -> Poll<()> {
    loop {
        match ready!(inner.as_mut().poll_frame(cx)) {
            Some(Ok(frame)) => {
                if let Ok(mut data) = frame.into_data() {
                    let take = data.remaining().min(MAX_ERROR_BODY - read.len());
                    read.extend_from_slice(&data.copy_to_bytes(take));
                }
                if read.len() >= MAX_ERROR_BODY {
                    return Poll::Ready(());
                }
            }
            Some(Err(_)) | None => return Poll::Ready(()),
        }
    }
}

/// Reads an error answer's body for its message, then sends the error in the Messages API's
/// shape.
fn poll_error<B: Body>(
    inner: Pin<&mut B>,
    read: &mut Vec<u8>,
    error: &mut Option<MessagesError>,
    cx: &mut Context<'_>,
) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
    if error.is_none() {
        return Poll::Ready(None);
    }
    ready!(poll_collect(inner, read, cx));
    let Some(mut error) = error.take() else {
        return Poll::Ready(None);
    };
    if let Some(message) = error_message(read) {
        error.message = message;
    } else if error.message.is_empty() {
        error.message = format!("Bedrock answered {}", error.status);
    }
    Poll::Ready(Some(Ok(Frame::data(Bytes::from(error.json())))))
}

/// Reads Bedrock's `{"inputTokens": n}` and sends the Messages API's `{"input_tokens": n}`
/// (or, if it is not that, what Bedrock sent).
fn poll_count<B: Body>(
    inner: Pin<&mut B>,
    read: &mut Vec<u8>,
    done: &mut bool,
    cx: &mut Context<'_>,
) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
    if *done {
        return Poll::Ready(None);
    }
    ready!(poll_collect(inner, read, cx));
    *done = true;
    let count = serde_json::from_slice::<Value>(read)
        .ok()
        .and_then(|v| v.get("inputTokens")?.as_u64());
    let body = match count {
        Some(n) => Bytes::from(serde_json::json!({ "input_tokens": n }).to_string()),
        None => Bytes::from(std::mem::take(read)),
    };
    Poll::Ready(Some(Ok(Frame::data(body))))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::upstream::codec::base64_encode;
    use crate::upstream::eventstream::encode;

    fn chunk(event: &str) -> Vec<u8> {
        let b64 = base64_encode(event.as_bytes());
        encode(
            &[(":event-type", "chunk"), (":message-type", "event")],
            format!("{{\"bytes\":\"{b64}\",\"p\":\"abc\"}}").as_bytes(),
        )
    }

    fn decode(frames: &[u8]) -> Vec<Translated> {
        let mut decoder = Decoder::default();
        decoder.push(frames);
        std::iter::from_fn(|| decoder.next_message())
            .map(|m| translate(&m.unwrap()))
            .collect()
    }

    #[test]
    fn a_chunk_becomes_the_messages_event_it_carries() {
        let got = decode(&chunk(
            r#"{"type":"message_stop","amazon-bedrock-invocationMetrics":{"inputTokenCount":3}}"#,
        ));
        assert_eq!(
            got,
            [Translated::Event(Bytes::from_static(
                b"event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n"
            ))]
        );
    }

    #[test]
    fn exceptions_in_a_stream_become_error_events_of_the_messages_api() {
        let frames = encode(
            &[
                (":exception-type", "throttlingException"),
                (":message-type", "exception"),
            ],
            br#"{"message":"Too many tokens, please wait before trying again."}"#,
        );
        let [Translated::Error(error)] = &decode(&frames)[..] else {
            panic!("one error");
        };
        assert_eq!(error.kind, "rate_limit_error");
        assert_eq!(error.status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(
            error.event(),
            "event: error\ndata: {\"error\":{\"message\":\"Too many tokens, please wait \
             before trying again.\",\"type\":\"rate_limit_error\"},\"type\":\"error\"}\n\n"
        );
    }

    #[test]
    fn a_chunk_that_is_not_an_event_is_an_api_error() {
        for payload in [
            &b"{}"[..],
            b"not json",
            br#"{"bytes":"!!"}"#,
            br#"{"bytes":"e30="}"#,
        ] {
            let frames = encode(
                &[(":event-type", "chunk"), (":message-type", "event")],
                payload,
            );
            let [Translated::Error(error)] = &decode(&frames)[..] else {
                panic!("one error for {payload:?}");
            };
            assert_eq!(error.kind, "api_error");
        }
    }

    #[test]
    fn bedrock_errors_map_to_the_messages_statuses() {
        let cases = [
            ("ThrottlingException", 429, 429, "rate_limit_error"),
            ("ServiceUnavailableException", 503, 529, "overloaded_error"),
            ("ModelNotReadyException", 429, 529, "overloaded_error"),
            ("ValidationException", 400, 400, "invalid_request_error"),
            ("AccessDeniedException", 403, 403, "permission_error"),
            (
                "InvalidSignatureException",
                403,
                401,
                "authentication_error",
            ),
            ("InternalServerException", 500, 500, "api_error"),
            ("", 413, 413, "request_too_large"),
            ("", 418, 500, "api_error"),
        ];
        for (name, from, to, kind) in cases {
            let (status, got) = classify(name, StatusCode::from_u16(from).unwrap());
            assert_eq!((status.as_u16(), got), (to, kind), "{name} {from}");
        }
    }

    proptest::proptest! {
        /// Whatever a well-framed message says (any message and event type, any payload,
        /// any base64 inside), it becomes an event, nothing or an error: never a panic,
        /// and an event is always one `event:` line and one `data:` line.
        #[test]
        fn any_message_translates_without_panic(
            message_type in "(event|exception|error|[a-z]{0,6})",
            event_type in "(chunk|[a-z:-]{0,8})",
            inner in ".{0,40}",
            raw in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..80),
            use_raw in proptest::prelude::any::<bool>(),
        ) {
            let payload = if use_raw {
                raw
            } else {
                let b64 = base64_encode(inner.as_bytes());
                format!("{{\"bytes\":\"{b64}\"}}").into_bytes()
            };
            let frames = encode(
                &[(":message-type", &message_type), (":event-type", &event_type),
                  (":exception-type", &event_type)],
                &payload,
            );
            for translated in decode(&frames) {
                if let Translated::Event(event) = translated {
                    let text = std::str::from_utf8(&event).unwrap();
                    proptest::prop_assert_eq!(text.matches('\n').count(), 3, "{}", text);
                    proptest::prop_assert!(text.starts_with("event: "));
                }
            }
        }
    }
}
