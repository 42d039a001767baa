//! fairgate's layers on the in-memory store, in front of a stand-in for the Claude API.
//!
//! Run with `cargo run --example quickstart`. It sends a handful of requests from different
//! tenants and prints the priority each one was given and why; then one tenant runs into
//! five 429s and is demoted to batch for five minutes.

use std::convert::Infallible;
use std::time::Duration;

use fairgate::{BoxError, Job, Origin, PriorityClassifyLayer, Store, TenantId};
use tower::{ServiceBuilder, ServiceExt, service_fn};

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), BoxError> {
    let store = Store::memory();
    let claude = ServiceBuilder::new()
        .layer(PriorityClassifyLayer::new(store.clone()))
        // Stand-in for the HTTP client that calls https://api.anthropic.com/v1/messages.
        .service(service_fn(|req: http::Request<String>| async move {
            let job = req.extensions().get::<Job>().cloned();
            Ok::<_, Infallible>(job)
        }));

    let hour = Duration::from_secs(3600);
    let requests = [
        (
            "chat message",
            Job::new("acme", Origin::UserAction).tier("pro"),
        ),
        (
            "review reply, due in 1 h",
            Job::new("acme", Origin::Scheduled).sla(hour),
        ),
        (
            "weekly digest, due in 48 h",
            Job::new("globex", Origin::Scheduled).sla(48 * hour),
        ),
        (
            "bulk re-tagging, no SLA",
            Job::new("globex", Origin::BatchJob),
        ),
        (
            "chat message",
            Job::new("initech", Origin::UserAction).tier("free"),
        ),
    ];
    println!(
        "{:<10} {:<28} {:>8}  priority",
        "tenant", "request", "tokens"
    );
    for (what, job) in requests {
        send(&claude, what, job).await?;
    }

    // initech's traffic draws five 429s within a minute (RetryAfterBackoff records these).
    let initech = TenantId::new("initech");
    for _ in 0..5 {
        store.record_throttle(&initech).await;
    }
    println!(
        "\ninitech: {} throttles in the last 60 s",
        store.throttle_count(&initech).await
    );
    send(
        &claude,
        "chat message",
        Job::new("initech", Origin::UserAction).tier("free"),
    )
    .await?;
    if let Some(left) = store.demoted_for(&initech).await {
        println!("initech is demoted to batch for {} s more", left.as_secs());
    }
    send(
        &claude,
        "chat message",
        Job::new("acme", Origin::UserAction).tier("pro"),
    )
    .await?;
    Ok(())
}

async fn send<S>(claude: &S, what: &str, job: Job) -> Result<(), BoxError>
where
    S: tower::Service<http::Request<String>, Response = Option<Job>, Error = BoxError> + Clone,
{
    let prompt = format!("{what}: please answer briefly.");
    let job = job.input_text(&prompt);
    let mut req = http::Request::post("https://api.anthropic.com/v1/messages").body(prompt)?;
    req.extensions_mut().insert(job);
    let seen = claude
        .clone()
        .oneshot(req)
        .await?
        .ok_or("the upstream saw no job")?;
    let priority = seen.priority().map_or("unset", |p| p.as_str());
    println!(
        "{:<10} {:<28} {:>8}  {priority}",
        seen.tenant().as_str(),
        what,
        seen.estimated_tokens()
    );
    Ok(())
}
