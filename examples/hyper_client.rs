//! hyper-util's client with the fairgate stack around it: no adapter, the client is the
//! service the layers wrap.
//!
//! ```sh
//! cargo run --example hyper_client
//! ANTHROPIC_API_KEY=sk-ant-... cargo run --example hyper_client -- --upstream https://api.anthropic.com
//! ```
//!
//! Without `--upstream` it calls a stand-in of the Messages API on loopback; HTTPS works
//! (rustls). A `Client<_, Full<Bytes>>` is `Clone` and so is its request body, so the retry
//! layer copies requests with plain `Clone`; the response body is `FairgateBody<Incoming>`,
//! which holds the call's window permit and tier slot until it has been read. Logs:
//! `RUST_LOG=fairgate=debug`.

#[path = "support/stand_in.rs"]
mod stand_in;

use std::time::{Duration, Instant};

use bytes::Bytes;
use fairgate::reject::Rejection;
use fairgate::{BoxError, Fairgate, FairgateLayer, Job, Origin, SlotPolicy, Store};
use http_body_util::{BodyExt, Full};
use hyper_rustls::{HttpsConnector, HttpsConnectorBuilder};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tower::{Layer, ServiceExt};

/// The client with the stack around it: a name for a type to keep in a struct.
type Claude = Fairgate<Client<HttpsConnector<HttpConnector>, Full<Bytes>>>;

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .init();
    let upstream = match flag("--upstream") {
        Some(url) => url,
        None => stand_in::start().await?,
    };
    let url = format!("{}/v1/messages", upstream.trim_end_matches('/'));
    let model = flag("--model").unwrap_or_else(|| "claude-haiku-4-5".to_owned());
    let ask = |stream: bool| {
        format!(
            r#"{{"model":"{model}","max_tokens":64,"stream":{stream},"messages":[{{"role":"user","content":"Say hello."}}]}}"#
        )
    };

    let https = HttpsConnectorBuilder::new()
        .with_webpki_roots()
        .https_or_http()
        .enable_http1()
        .build();
    let client = Client::builder(TokioExecutor::new()).build(https);
    let store = Store::memory();
    let slots = SlotPolicy::builder()
        .tier("guest", 1, Duration::ZERO)
        .build()?;
    let fairgate = FairgateLayer::builder(store.clone()).slots(slots).build()?;
    let claude: Claude = fairgate.layer(client);

    println!("== a message");
    let job = Job::new("acme", Origin::UserAction).with_tier("pro");
    let response = claude
        .clone()
        .oneshot(request(&url, ask(false), job)?)
        .await?;
    let status = response.status();
    let body = response.into_body().collect().await?.to_bytes();
    println!("{status} {}", String::from_utf8_lossy(&body));

    println!("== a call the stand-in throttles once: retried after its retry-after");
    let started = Instant::now();
    let job = Job::new("acme", Origin::UserAction).with_tier("pro");
    let mut req = request(&url, ask(false), job)?;
    req.headers_mut()
        .insert("x-stand-in-throttle", "once".parse()?);
    let response = claude.clone().oneshot(req).await?;
    println!("{} after {:?}", response.status(), started.elapsed());
    drop(response);

    println!("== a streamed answer: the slot is held until the last event");
    let job = Job::new("acme", Origin::UserAction).with_tier("pro");
    let mut body = claude
        .clone()
        .oneshot(request(&url, ask(true), job)?)
        .await?
        .into_body();
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame?.into_data() {
            let slots = store.slots_in_use(None).await;
            print!("[{slots} slot in use] {}", String::from_utf8_lossy(&data));
        }
    }
    drop(body);
    println!("[{} slots in use]", store.slots_in_use(None).await);

    println!("== three guest calls at once: the guest tier has one slot and never waits");
    let mut burst = Vec::new();
    for i in 0..3 {
        let job = Job::new(format!("visitor-{i}"), Origin::UserAction).with_tier("guest");
        burst.push(claude.clone().oneshot(request(&url, ask(false), job)?));
    }
    for outcome in futures_util::future::join_all(burst).await {
        match outcome {
            Ok(response) => println!("admitted: {}", response.status()),
            Err(err) => match Rejection::from_error(&*err) {
                Some(rejection) => println!("refused: {rejection}"),
                None => println!("failed: {err}"),
            },
        }
    }
    Ok(())
}

/// A Messages API request carrying `job`, with the API key from the environment.
fn request(url: &str, body: String, job: Job) -> Result<http::Request<Full<Bytes>>, BoxError> {
    let job = job.with_input_text(&body);
    let mut req = http::Request::post(url)
        .header("anthropic-version", "2023-06-01")
        .header("content-type", "application/json");
    if let Ok(key) = std::env::var("ANTHROPIC_API_KEY") {
        req = req.header("x-api-key", key);
    }
    let mut req = req.body(Full::new(Bytes::from(body)))?;
    req.extensions_mut().insert(job);
    Ok(req)
}

/// The value after `name` on the command line.
fn flag(name: &str) -> Option<String> {
    let mut args = std::env::args().skip_while(|arg| arg != name);
    args.next().and(args.next())
}
