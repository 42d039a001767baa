//! A stand-in for the Anthropic Messages API on a loopback port, so the client examples run
//! without a key: `POST /v1/messages` answers a message after 100 ms, or an SSE stream (an
//! event every 100 ms) when the body asks for `"stream": true`. A request carrying
//! `x-stand-in-throttle: once` is answered `429` with `retry-after-ms: 300` the first time
//! one comes (as the API answers when a rate limit is hit).

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::response::Response;

const MESSAGE: &str = r#"{"id":"msg_stand_in","type":"message","role":"assistant","model":"claude-stand-in","content":[{"type":"text","text":"Hello from the stand-in."}],"stop_reason":"end_turn","usage":{"input_tokens":12,"output_tokens":6}}"#;

const EVENTS: [&str; 4] = [
    "event: message_start\ndata: {\"type\":\"message_start\"}\n\n",
    "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"Hello\"}}\n\n",
    "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\" there.\"}}\n\n",
    "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n",
];

/// Starts the stand-in on a free loopback port; returns its base URL.
pub async fn start() -> std::io::Result<String> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    let throttled = Arc::new(AtomicBool::new(false));
    let app = axum::Router::new().fallback(answer).with_state(throttled);
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok(url)
}

async fn answer(State(throttled): State<Arc<AtomicBool>>, req: Request) -> Response {
    let throttle = req
        .headers()
        .get("x-stand-in-throttle")
        .is_some_and(|v| v == "once");
    let body = axum::body::to_bytes(req.into_body(), 1 << 20)
        .await
        .unwrap_or_default();
    let response = Response::builder().header("request-id", "req_stand_in");
    if throttle && !throttled.swap(true, Ordering::SeqCst) {
        return response
            .status(429)
            .header("content-type", "application/json")
            .header("retry-after", "1")
            .header("retry-after-ms", "300")
            .body(Body::from(
                r#"{"type":"error","error":{"type":"rate_limit_error","message":"Number of requests has exceeded your per-minute rate limit"}}"#,
            ))
            .unwrap();
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    let compact: Vec<u8> = body
        .iter()
        .copied()
        .filter(|b| !b.is_ascii_whitespace())
        .collect();
    if !compact.windows(13).any(|w| w == b"\"stream\":true") {
        return response
            .header("content-type", "application/json")
            .body(Body::from(MESSAGE))
            .unwrap();
    }
    let events = futures_util::stream::unfold(0, |i| async move {
        let event = EVENTS.get(i)?;
        if i > 0 {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Some((
            Ok::<_, Infallible>(Bytes::from_static(event.as_bytes())),
            i + 1,
        ))
    });
    response
        .header("content-type", "text/event-stream")
        .body(Body::from_stream(events))
        .unwrap()
}
