//! The Bedrock service in process: an inner service standing for Bedrock answers with event
//! streams cut in every way, corrupted, cut short, and with errors.

use std::convert::Infallible;

use bytes::Bytes;
use http_body::Frame;
use http_body_util::{BodyExt, StreamBody};
use tower::{ServiceBuilder, ServiceExt, service_fn};

use super::codec::base64_encode;
use super::eventstream::encode;
use super::{AwsCredentials, BedrockLayer};

type Chunks =
    StreamBody<futures_util::stream::Iter<std::vec::IntoIter<Result<Frame<Bytes>, Infallible>>>>;

fn body_of(chunks: Vec<Vec<u8>>) -> Chunks {
    let frames: Vec<Result<Frame<Bytes>, Infallible>> = chunks
        .into_iter()
        .map(|c| Ok(Frame::data(Bytes::from(c))))
        .collect();
    StreamBody::new(futures_util::stream::iter(frames))
}

fn chunk_frame(event: &str) -> Vec<u8> {
    let b64 = base64_encode(event.as_bytes());
    encode(
        &[(":event-type", "chunk"), (":message-type", "event")],
        format!("{{\"bytes\":\"{b64}\"}}").as_bytes(),
    )
}

/// Calls a Bedrock service whose inner service answers `status`, `headers` and `chunks`;
/// the status, content type and whole body the caller gets.
async fn answer(
    status: u16,
    headers: &'static [(&'static str, &'static str)],
    chunks: Vec<Vec<u8>>,
    stream: bool,
) -> (u16, String, String) {
    let path = "/v1/messages";
    answer_to(path, status, headers, chunks, stream).await
}

async fn answer_to(
    path: &str,
    status: u16,
    headers: &'static [(&'static str, &'static str)],
    chunks: Vec<Vec<u8>>,
    stream: bool,
) -> (u16, String, String) {
    let inner = service_fn(move |_req: http::Request<String>| {
        let chunks = chunks.clone();
        async move {
            let mut response = http::Response::new(body_of(chunks));
            *response.status_mut() = http::StatusCode::from_u16(status).unwrap();
            for (name, value) in headers {
                response.headers_mut().insert(*name, value.parse().unwrap());
            }
            Ok::<_, Infallible>(response)
        }
    });
    let layer = BedrockLayer::builder()
        .region("us-east-1")
        .credentials(AwsCredentials::new("AKID", "secret"))
        .build()
        .unwrap();
    let bedrock = ServiceBuilder::new().layer(layer).service(inner);
    let body = format!(r#"{{"model":"claude-haiku-4-5","stream":{stream},"messages":[]}}"#);
    let request = http::Request::post(format!("http://x{path}"))
        .body(body)
        .unwrap();
    let response = bedrock.oneshot(request).await.unwrap();
    let status = response.status().as_u16();
    let content_type = response.headers()[http::header::CONTENT_TYPE]
        .to_str()
        .unwrap()
        .to_owned();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (
        status,
        content_type,
        String::from_utf8(body.to_vec()).unwrap(),
    )
}

const EVENT_STREAM: &[(&str, &str)] = &[("content-type", "application/vnd.amazon.eventstream")];

fn three_events() -> Vec<u8> {
    [
        r#"{"type":"message_start","message":{"id":"m"}}"#,
        r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Hi"}}"#,
        r#"{"type":"message_stop"}"#,
    ]
    .iter()
    .flat_map(|e| chunk_frame(e))
    .collect()
}

const THREE_EVENTS_SSE: &str = "event: message_start\ndata: {\"message\":{\"id\":\"m\"},\"type\":\"message_start\"}\n\n\
     event: content_block_delta\ndata: {\"delta\":{\"text\":\"Hi\",\"type\":\"text_delta\"},\"index\":0,\"type\":\"content_block_delta\"}\n\n\
     event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n";

#[tokio::test]
async fn a_stream_cut_into_any_pieces_arrives_as_the_same_events() {
    let stream = three_events();
    for size in [1, 2, 3, 7, 12, 13, 64, stream.len()] {
        let chunks: Vec<Vec<u8>> = stream.chunks(size).map(<[u8]>::to_vec).collect();
        let (status, content_type, body) = answer(200, EVENT_STREAM, chunks, true).await;
        assert_eq!((status, content_type.as_str()), (200, "text/event-stream"));
        assert_eq!(body, THREE_EVENTS_SSE, "pieces of {size} bytes");
    }
}

#[tokio::test]
async fn a_bad_checksum_ends_the_stream_with_an_error_event() {
    let mut stream = three_events();
    let second = chunk_frame(r#"{"type":"message_start","message":{"id":"m"}}"#).len() + 20;
    stream[second] ^= 1;
    let (status, _, body) = answer(200, EVENT_STREAM, vec![stream], true).await;
    assert_eq!(status, 200);
    let events: Vec<&str> = body.split_terminator("\n\n").collect();
    assert_eq!(events.len(), 2, "{body}");
    assert!(events[0].starts_with("event: message_start\n"), "{body}");
    assert!(
        events[1].starts_with("event: error\ndata: {\"error\":{\"message\":\"Bedrock stream: event stream message checksum mismatch\",\"type\":\"api_error\"}"),
        "{body}"
    );
}

#[tokio::test]
async fn a_stream_cut_inside_a_message_ends_with_an_error_event() {
    let stream = three_events();
    let cut = stream[..stream.len() - 5].to_vec();
    let (_, _, body) = answer(200, EVENT_STREAM, vec![cut], true).await;
    assert!(body.starts_with("event: message_start\n"), "{body}");
    assert!(
        body.ends_with(
            "event stream ended inside a message\",\"type\":\"api_error\"},\"type\":\"error\"}\n\n"
        ),
        "{body}"
    );
}

#[tokio::test]
async fn a_message_passes_as_bedrock_sent_it() {
    let message = br#"{"type":"message","content":[{"type":"text","text":"Hi"}]}"#.to_vec();
    let halves = vec![message[..10].to_vec(), message[10..].to_vec()];
    let (status, _, body) =
        answer(200, &[("content-type", "application/json")], halves, false).await;
    assert_eq!(status, 200);
    assert_eq!(body.as_bytes(), &message[..]);
}

#[tokio::test]
async fn a_token_count_is_answered_as_the_messages_api_counts() {
    let json = &[("content-type", "application/json")];
    let count = vec![br#"{"inputTokens":"#.to_vec(), b"42}".to_vec()];
    let path = "/v1/messages/count_tokens";
    let (status, _, body) = answer_to(path, 200, json, count, false).await;
    assert_eq!((status, body.as_str()), (200, r#"{"input_tokens":42}"#));
}

#[tokio::test]
async fn bedrock_errors_are_answered_in_the_messages_error_shape() {
    let unavailable = &[
        ("content-type", "application/json"),
        (
            "x-amzn-errortype",
            "ServiceUnavailableException:http://internal.amazon.com/coral/",
        ),
    ];
    let body = br#"{"message":"Bedrock is unable to process your request."}"#.to_vec();
    let (status, content_type, got) = answer(503, unavailable, vec![body], false).await;
    assert_eq!((status, content_type.as_str()), (529, "application/json"));
    assert_eq!(
        got,
        r#"{"error":{"message":"Bedrock is unable to process your request.","type":"overloaded_error"},"type":"error"}"#
    );
    // Without a JSON message, the exception's name says what happened.
    let (status, _, got) = answer(503, unavailable, vec![b"<html>".to_vec()], false).await;
    assert_eq!(status, 529);
    assert!(
        got.contains(r#""message":"ServiceUnavailableException""#),
        "{got}"
    );
}

#[tokio::test]
async fn a_body_over_the_limit_is_refused_without_a_call() {
    let inner = service_fn(|_req: http::Request<String>| async {
        panic!("no call is sent");
        #[allow(unreachable_code)]
        Ok::<http::Response<String>, Infallible>(http::Response::new(String::new()))
    });
    let layer = BedrockLayer::builder()
        .region("us-east-1")
        .credentials(AwsCredentials::new("AKID", "secret"))
        .build()
        .unwrap();
    let bedrock = ServiceBuilder::new().layer(layer).service(inner);
    let huge = "x".repeat(super::request::MAX_REQUEST_BODY + 1);
    let request = http::Request::post("http://x/v1/messages")
        .body(huge)
        .unwrap();
    let response = bedrock.oneshot(request).await.unwrap();
    assert_eq!(response.status(), 413);
    let body = response.into_body().collect().await.unwrap().to_bytes();
    assert!(body.starts_with(br#"{"error":{"message":"the request body is over"#));
}

/// Under `FairgateLayer`, Bedrock's throttling is the 429 the retry layer knows: the call is
/// sent again after its backoff and served, and its `Job` went through to the client below.
#[tokio::test(start_paused = true)]
async fn fairgate_retries_bedrocks_throttling_as_a_429() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use crate::{FairgateLayer, Job, Origin, Store};

    let calls = Arc::new(AtomicUsize::new(0));
    let inner = {
        let calls = Arc::clone(&calls);
        service_fn(move |req: http::Request<String>| {
            let first = calls.fetch_add(1, Ordering::SeqCst) == 0;
            assert!(
                req.extensions().get::<Job>().is_some(),
                "the job goes along"
            );
            async move {
                let response = if first {
                    http::Response::builder()
                        .status(429)
                        .header("x-amzn-errortype", "ThrottlingException:http://internal/")
                        .body(r#"{"message":"Too many requests"}"#.to_owned())
                } else {
                    http::Response::builder().body(r#"{"type":"message"}"#.to_owned())
                };
                Ok::<_, Infallible>(response.unwrap())
            }
        })
    };
    let bedrock = BedrockLayer::builder()
        .region("us-east-1")
        .credentials(AwsCredentials::new("AKID", "secret"))
        .build()
        .unwrap();
    let claude = ServiceBuilder::new()
        .layer(FairgateLayer::new(Store::memory()))
        .layer(bedrock)
        .service(inner);
    let body = r#"{"model":"claude-haiku-4-5","max_tokens":8,"messages":[]}"#;
    let mut request = http::Request::post("http://x/v1/messages")
        .body(body.to_owned())
        .unwrap();
    request
        .extensions_mut()
        .insert(Job::new("tenant-1", Origin::UserAction).with_tier("pro"));
    let response = claude.oneshot(request).await.unwrap();
    assert_eq!(response.status(), 200);
    let body = response.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body, r#"{"type":"message"}"#);
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}
