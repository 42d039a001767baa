//! A `reqwest` client whose calls to the Claude API are admitted by fairgate, through the
//! reqwest-middleware adapter ([`FairgateMiddleware`]).
//!
//! ```sh
//! cargo run --features reqwest --example reqwest_client
//! cargo run --features reqwest --example reqwest_client -- --upstream http://127.0.0.1:8080
//! ```
//!
//! Without `--upstream` it calls a stand-in of the Messages API on loopback. With one, it
//! sends `ANTHROPIC_API_KEY` (if set) as `x-api-key`: point it at fairgate's gateway
//! example, or any plain-HTTP Anthropic-compatible endpoint (this example's reqwest is built
//! without TLS). Logs: `RUST_LOG=fairgate=debug`.
//!
//! It sends a message, a call the upstream throttles once (retried after its
//! `retry-after-ms`, invisibly to the caller), a streamed answer (its slot held until the
//! last event is read), a burst from the `guest` tier (capped at one call, never waiting:
//! the rest are refused with `Busy`), and a call without a job.

#[path = "support/stand_in.rs"]
mod stand_in;

use std::time::{Duration, Instant};

use fairgate::reject::Rejection;
use fairgate::reqwest::FairgateMiddleware;
use fairgate::{BoxError, FairgateLayer, Job, Origin, SlotPolicy, Store};
use reqwest_middleware::{ClientBuilder, ClientWithMiddleware, RequestBuilder};

const ASK: &str = r#"{"model":"claude-haiku-4-5","max_tokens":64,"messages":[{"role":"user","content":"Say hello."}]}"#;
const ASK_STREAM: &str = r#"{"model":"claude-haiku-4-5","max_tokens":64,"stream":true,"messages":[{"role":"user","content":"Say hello."}]}"#;

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

    // One store and one stack for the whole client: every clone shares the caps.
    let store = Store::memory();
    let slots = SlotPolicy::builder()
        .tier("guest", 1, Duration::ZERO)
        .build()?;
    let fairgate = FairgateLayer::builder(store.clone()).slots(slots).build()?;
    let claude = ClientBuilder::new(reqwest::Client::new())
        .with(FairgateMiddleware::from_layer(fairgate))
        .build();
    let call = |body: &'static str| post(&claude, &url, body);

    println!("== a message");
    let job = Job::new("acme", Origin::UserAction)
        .with_tier("pro")
        .with_input_text(ASK);
    let response = call(ASK).with_extension(job).send().await?;
    println!("{} {}", response.status(), response.text().await?);

    println!("== a call the upstream throttles once: retried after its retry-after");
    let started = Instant::now();
    let job = Job::new("acme", Origin::UserAction)
        .with_tier("pro")
        .with_input_text(ASK);
    let response = call(ASK)
        .header("x-stand-in-throttle", "once")
        .with_extension(job)
        .send()
        .await?;
    println!("{} after {:?}", response.status(), started.elapsed());
    drop(response);

    println!("== a streamed answer: the slot is held until the last event");
    let job = Job::new("acme", Origin::UserAction)
        .with_tier("pro")
        .with_input_text(ASK_STREAM);
    let mut response = call(ASK_STREAM).with_extension(job).send().await?;
    while let Some(chunk) = response.chunk().await? {
        let slots = store.slots_in_use(None).await;
        print!("[{slots} slot in use] {}", String::from_utf8_lossy(&chunk));
    }
    println!("[{} slots in use]", store.slots_in_use(None).await);

    println!("== three guest calls at once: the guest tier has one slot and never waits");
    let burst = (0..3).map(|i| {
        let job = Job::new(format!("visitor-{i}"), Origin::UserAction)
            .with_tier("guest")
            .with_input_text(ASK);
        call(ASK).with_extension(job).send()
    });
    for outcome in futures_util::future::join_all(burst).await {
        match outcome {
            Ok(response) => println!("admitted: {}", response.status()),
            Err(err) => match Rejection::from_error(&err) {
                Some(Rejection::Busy(busy)) => println!(
                    "refused: tier {} is full, retry after {:?}",
                    busy.tier(),
                    busy.retry_after()
                ),
                _ => println!("failed: {err}"),
            },
        }
    }

    println!("== a call without a job");
    let err = call(ASK).send().await.unwrap_err();
    println!("{err}: {:?}", Rejection::from_error(&err));
    Ok(())
}

fn post(claude: &ClientWithMiddleware, url: &str, body: &'static str) -> RequestBuilder {
    let request = claude
        .post(url)
        .header("anthropic-version", "2023-06-01")
        .header("content-type", "application/json")
        .body(body);
    match std::env::var("ANTHROPIC_API_KEY") {
        Ok(key) => request.header("x-api-key", key),
        Err(_) => request,
    }
}

/// The value after `name` on the command line.
fn flag(name: &str) -> Option<String> {
    let mut args = std::env::args().skip_while(|arg| arg != name);
    args.next().and(args.next())
}
