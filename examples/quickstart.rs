//! fairgate's layers on the in-memory store, in front of a stand-in for the Claude API.
//!
//! Run with `cargo run --example quickstart`. It sends requests from a few tenants and prints
//! what happened to each: the priority it was given, whether it got a slot, and why.

use std::convert::Infallible;
use std::time::Duration;

use fairgate::{
    BoxError, Busy, Job, Origin, PriorityClassifyLayer, SlotPolicy, Store, TenantId,
    TierSlotLimitLayer,
};
use tower::{ServiceBuilder, ServiceExt, service_fn};

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), BoxError> {
    let store = Store::memory();
    // Small caps so the demonstration fills them: 4 calls in flight at most, free users 2
    // of them and never waiting, pro users up to 2 s.
    let slots = SlotPolicy::builder()
        .global_max(4)
        .tier("free", 2, Duration::ZERO)
        .tier("pro", 4, Duration::from_secs(2))
        .build()?;
    let claude = ServiceBuilder::new()
        .layer(PriorityClassifyLayer::new(store.clone())) // who goes first
        .layer(TierSlotLimitLayer::new(store.clone(), slots)) // global + per-tier caps
        // Stand-in for the HTTP client that calls https://api.anthropic.com/v1/messages:
        // it answers with the job it saw, as the response body.
        .service(service_fn(|req: http::Request<String>| async move {
            let job = req.extensions().get::<Job>().cloned();
            Ok::<_, Infallible>(http::Response::new(job))
        }));

    println!("1. Priority is decided centrally, from origin and SLA:");
    let hour = Duration::from_secs(3600);
    let requests = [
        (
            "chat message",
            Job::new("acme", Origin::UserAction).tier("pro"),
        ),
        (
            "review reply, due in 1 h",
            Job::new("acme", Origin::Scheduled).tier("pro").sla(hour),
        ),
        (
            "weekly digest, due in 48 h",
            Job::new("globex", Origin::Scheduled)
                .tier("pro")
                .sla(48 * hour),
        ),
        (
            "bulk re-tagging, no SLA",
            Job::new("globex", Origin::BatchJob).tier("pro"),
        ),
    ];
    for (what, job) in requests {
        let response = send(&claude, what, job).await?;
        drop(response); // the slot is held until the body is dropped
    }

    println!("\n2. A free-tier flood fills only the free slots; paying users still get through:");
    let mut held = Vec::new();
    for i in 0..3 {
        let job = Job::new(format!("free-user-{i}"), Origin::UserAction).tier("free");
        match send(&claude, "chat message (held open)", job).await {
            Ok(response) => held.push(response),
            Err(e) => match e.downcast_ref::<Busy>() {
                Some(busy) => println!(
                    "{:<12} {:<28} SERVER_BUSY: tier {} full, retry after {} s",
                    format!("free-user-{i}"),
                    "chat message",
                    busy.tier(),
                    busy.retry_after_secs()
                ),
                None => return Err(e),
            },
        }
    }
    let response = send(
        &claude,
        "chat message",
        Job::new("acme", Origin::UserAction).tier("pro"),
    )
    .await?;
    drop((response, held));

    println!("\n3. A tenant drawing five 429s within a minute is demoted to batch for 5 minutes:");
    let initech = TenantId::new("initech");
    for _ in 0..5 {
        store.record_throttle(&initech).await; // RetryAfterBackoff records these
    }
    let job = Job::new("initech", Origin::UserAction).tier("pro");
    drop(send(&claude, "chat message", job).await?);
    if let Some(left) = store.demoted_for(&initech).await {
        println!("initech is demoted to batch for {} s more", left.as_secs());
    }
    Ok(())
}

type Response = http::Response<fairgate::body::GuardedBody<Option<Job>, fairgate::SlotPermit>>;

async fn send<S>(claude: &S, what: &str, job: Job) -> Result<Response, BoxError>
where
    S: tower::Service<http::Request<String>, Response = Response, Error = BoxError> + Clone,
{
    let prompt = format!("{what}: please answer briefly.");
    let job = job.input_text(&prompt);
    let mut req = http::Request::post("https://api.anthropic.com/v1/messages").body(prompt)?;
    req.extensions_mut().insert(job);
    let response = claude.clone().oneshot(req).await?;
    let seen = response
        .body()
        .inner()
        .clone()
        .ok_or("the upstream saw no job")?;
    println!(
        "{:<12} {:<28} {:>4} tokens  {:<8} tier {}",
        seen.tenant().as_str(),
        what,
        seen.estimated_tokens(),
        seen.priority().map_or("unset", |p| p.as_str()),
        seen.tier_name().map_or("-", |t| t.as_str()),
    );
    Ok(response)
}
