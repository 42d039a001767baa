//! An axum app whose handlers are admitted by fairgate: the job from the request's headers,
//! the caps and the fair order from the stack, rejections rendered in one place.
//!
//! ```sh
//! cargo run --example axum_ingress -- --listen 127.0.0.1:3000 [--style anthropic]
//! curl -s localhost:3000/v1/messages -H 'x-tenant-id: acme' -H 'x-tier: pro' -d '{"messages":[]}'
//! cargo run --example axum_ingress -- --demo   # serves, sends a few calls itself, exits
//! ```
//!
//! The stack wraps the routes (`route_layer`), so every handler behind it is admitted:
//! `x-tenant-id` names the tenant (set it in your own authentication, never from the end
//! user), `x-tier` the tier (`guest` is capped at one call here and never waits). A request
//! without a tenant is `401`; a full tier is `503 {"code":"SERVER_BUSY","retry_after":5}`
//! (`--style reference`, the default) or `529 overloaded_error` (`--style anthropic`), with
//! `retry-after`. A handler's `429` with `retry-after` is retried by the stack, so the body
//! is buffered first (up to 1 MiB) to be sent again. A streamed answer holds its slot until
//! its last byte is sent. Ctrl-C stops accepting and lets answers in progress finish. Logs:
//! `RUST_LOG=fairgate=debug`.

use std::net::SocketAddr;
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::error_handling::HandleErrorLayer;
use axum::response::Response;
use axum::routing::post;
use fairgate::extract::{FromHeaders, JobLayer};
use fairgate::reject::{Style, render};
use fairgate::{BoxError, FairgateLayer, SlotPolicy, Store};
use http::HeaderName;
use http_body_util::Full;
use tower::ServiceBuilder;

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .init();
    let listen: SocketAddr = flag("--listen")
        .unwrap_or_else(|| "127.0.0.1:3000".to_owned())
        .parse()?;
    let style = match flag("--style").as_deref() {
        None | Some("reference") => Style::Reference,
        Some("anthropic") => Style::Anthropic,
        Some(other) => return Err(format!("--style {other}: reference or anthropic").into()),
    };
    let demo = std::env::args().any(|arg| arg == "--demo");

    let store = Store::memory();
    let slots = SlotPolicy::builder()
        .tier("guest", 1, Duration::ZERO)
        .build()?;
    // Built once: every route and every clone shares its window, queues and caps.
    let fairgate = FairgateLayer::builder(store).slots(slots).build()?;
    let admission = ServiceBuilder::new()
        // Every refusal (and a failed handler) becomes an answer here, in one place.
        .layer(HandleErrorLayer::new(move |e: BoxError| async move {
            render(&e, style)
        }))
        // The retry layer sends a throttled request again: it must be copyable.
        .filter_async(buffer)
        .layer(JobLayer::new(
            FromHeaders::new()
                .tenant_header(HeaderName::from_static("x-tenant-id"))
                .tier_header(HeaderName::from_static("x-tier")),
        ))
        .layer(fairgate)
        .map_request(|req: http::Request<Full<Bytes>>| req.map(Body::new));
    let app = Router::new()
        .route("/v1/messages", post(messages))
        .route_layer(admission);

    let listener = tokio::net::TcpListener::bind(listen).await?;
    let addr = listener.local_addr()?;
    tracing::info!(%addr, ?style, "listening");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(async move {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = stopped => {}
                }
            })
            .await
    });
    if demo {
        run_demo(addr).await?;
        let _ = stop.send(());
    }
    server.await??;
    Ok(())
}

/// Buffers a request's body (up to 1 MiB) so the retry layer can send it again.
async fn buffer(req: http::Request<Body>) -> Result<http::Request<Full<Bytes>>, BoxError> {
    let (parts, body) = req.into_parts();
    let bytes = axum::body::to_bytes(body, 1 << 20).await?;
    Ok(http::Request::from_parts(parts, Full::new(bytes)))
}

/// The app's work, standing in for a model: a message after 200 ms, or an SSE stream (an
/// event every 200 ms) when the body asks for `"stream": true`.
async fn messages(body: Bytes) -> Response {
    let compact: Vec<u8> = body
        .iter()
        .copied()
        .filter(|b| !b.is_ascii_whitespace())
        .collect();
    let stream = compact.windows(13).any(|w| w == b"\"stream\":true");
    if !stream {
        tokio::time::sleep(Duration::from_millis(200)).await;
        return Response::builder()
            .header("content-type", "application/json")
            .body(Body::from(
                r#"{"type":"message","role":"assistant","content":[{"type":"text","text":"Hello."}]}"#,
            ))
            .unwrap();
    }
    let events = futures_util::stream::unfold(0, |i| async move {
        let text = ["Hello", ", ", "world."].get(i)?;
        tokio::time::sleep(Duration::from_millis(200)).await;
        let event = format!(
            "event: content_block_delta\ndata: {{\"type\":\"text_delta\",\"text\":\"{text}\"}}\n\n"
        );
        Some((Ok::<_, std::convert::Infallible>(event), i + 1))
    });
    Response::builder()
        .header("content-type", "text/event-stream")
        .body(Body::from_stream(events))
        .unwrap()
}

/// A few calls from a client: a pro message, two guests at once (one refused), a stream and
/// a call with no tenant.
async fn run_demo(addr: SocketAddr) -> Result<(), BoxError> {
    let url = format!("http://{addr}/v1/messages");
    let http = reqwest::Client::new();
    let call = |tenant: Option<&str>, tier: &str, body: &'static str| {
        let mut req = http.post(&url).header("x-tier", tier).body(body);
        if let Some(tenant) = tenant {
            req = req.header("x-tenant-id", tenant);
        }
        req.send()
    };
    let show = |label: &str, status: reqwest::StatusCode, body: &str| {
        println!("{label:>24}: {status} {body}");
    };

    let response = call(Some("acme"), "pro", r#"{"messages":[]}"#).await?;
    show("pro", response.status(), &response.text().await?);

    let (a, b) = tokio::join!(
        call(Some("visitor-1"), "guest", r#"{"messages":[]}"#),
        call(Some("visitor-2"), "guest", r#"{"messages":[]}"#),
    );
    for (label, response) in [("guest 1", a?), ("guest 2", b?)] {
        let retry_after = response
            .headers()
            .get("retry-after")
            .map(|v| format!(" (retry-after: {})", v.to_str().unwrap_or("?")))
            .unwrap_or_default();
        let status = response.status();
        show(label, status, &(response.text().await? + &retry_after));
    }

    let mut response = call(Some("acme"), "pro", r#"{"stream": true, "messages":[]}"#).await?;
    show("pro, streamed", response.status(), "");
    while let Some(chunk) = response.chunk().await? {
        print!("{}", String::from_utf8_lossy(&chunk));
    }

    let response = call(None, "pro", r#"{"messages":[]}"#).await?;
    show("no tenant", response.status(), &response.text().await?);
    Ok(())
}

/// The value after `name` on the command line.
fn flag(name: &str) -> Option<String> {
    let mut args = std::env::args().skip_while(|arg| arg != name);
    args.next().and(args.next())
}
