use bytes::Bytes;
use fairgate::{
    BackoffPolicy, BoxError, DrrFairnessLayer, Job, Origin, PriorityClassifyLayer,
    RetryAfterBackoffLayer, SlotPolicy, Store, TierSlotLimitLayer,
};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tower::{ServiceBuilder, ServiceExt};

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    // An HTTPS client (rustls; http:// too, for a local mock).
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_webpki_roots()
        .https_or_http()
        .enable_http1()
        .build();
    let http_client = Client::builder(TokioExecutor::new()).build::<_, Full<Bytes>>(https);

    let store = Store::memory(); // or Store::redis("redis://127.0.0.1/").await?
    let slots = TierSlotLimitLayer::new(store.clone(), SlotPolicy::default()); // global + per-tier caps
    let (retry, rate) = // 429 hygiene; its rate gate goes to the fair queue
        RetryAfterBackoffLayer::new(store.clone(), BackoffPolicy::default()).with_gate_below();
    let fair = DrrFairnessLayer::builder(store.clone(), 32) // fair order, 32 in flight here
        .slot_gate(slots.gate()) // it takes the slots...
        .rate_gate(rate) // ...and the rate cells, when it dispatches
        .build()?;
    let claude = ServiceBuilder::new()
        .layer(PriorityClassifyLayer::new(store.clone())) // who goes first
        .layer(retry)
        .layer(fair)
        .layer(slots)
        .service(http_client); // any tower Service taking http::Request<B>
    // The same in one line (with `use tower::Layer`):
    // let claude = fairgate::FairgateLayer::new(store).layer(http_client);

    // The official SDKs' variables: ANTHROPIC_BASE_URL points them at a gateway or a mock.
    let base = std::env::var("ANTHROPIC_BASE_URL");
    let base = base.as_deref().unwrap_or("https://api.anthropic.com");
    let prompt = "Say hello.";
    let body = format!(
        r#"{{"model":"claude-haiku-4-5","max_tokens":64,"messages":[{{"role":"user","content":"{prompt}"}}]}}"#
    );
    let key = std::env::var("ANTHROPIC_API_KEY").map_err(|_| "set ANTHROPIC_API_KEY")?;
    let mut req = http::Request::post(format!("{base}/v1/messages"))
        .header("x-api-key", key)
        .header("anthropic-version", "2023-06-01")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))?;
    req.extensions_mut().insert(
        Job::new("tenant-42", Origin::UserAction)
            .with_tier("pro")
            .with_input_text(prompt),
    );
    let resp = claude.oneshot(req).await?;
    let status = resp.status();
    let answer = resp.into_body().collect().await?.to_bytes();
    println!("{status} {}", String::from_utf8_lossy(&answer));
    Ok(())
}
