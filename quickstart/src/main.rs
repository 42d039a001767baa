//! fairgate's layers on the in-memory store, in front of a stand-in for the Claude API.
//!
//! Run with `cargo run -p fairgate-quickstart`. It sends requests from a few tenants and prints
//! what happened to each: the priority it was given, whether it got a slot, and why. It runs
//! in tokio's paused time, so the minutes of simulated upstream calls take no wall time.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use fairgate::{
    BackoffPolicy, BoxError, Busy, DrrFairnessLayer, Job, Origin, PriorityClassifyLayer,
    RetryAfterBackoffLayer, SlotPolicy, Store, TenantId, TierSlotLimitLayer,
};
use tower::util::BoxCloneService;
use tower::{ServiceBuilder, ServiceExt, service_fn};

#[tokio::main(flavor = "current_thread", start_paused = true)]
async fn main() -> Result<(), BoxError> {
    let store = Store::memory();
    // Small caps so the demonstration fills them: 4 calls in flight at most, free users 2
    // of them and never waiting, pro users up to 5 s (a tier's max wait counts from the
    // call's arrival, retries included: step 4's retry comes 1.9-2.9 s after it).
    let slots = SlotPolicy::builder()
        .global_max(4)
        .tier("free", 2, Duration::ZERO)
        .tier("pro", 4, Duration::from_secs(5))
        .build()?;
    // The four layers, every wire in sight (`FairgateLayer` does the same in one line): the
    // fair queue takes the slot layer's caps and the retry layer's rate gate, so whatever
    // holds calls back, the next to go is the fair order's choice.
    let slots = TierSlotLimitLayer::new(store.clone(), slots); // global + per-tier caps
    let (retry, rate) = // 429 hygiene: decides retries; its rate gate goes to the fair queue
        RetryAfterBackoffLayer::new(store.clone(), BackoffPolicy::default()).with_gate_below();
    let fair = DrrFairnessLayer::builder(store.clone(), 32) // fair order, 32 in flight here
        .slot_gate(slots.gate())
        .rate_gate(rate)
        .build()?;
    let claude = ServiceBuilder::new()
        .layer(PriorityClassifyLayer::new(store.clone())) // who goes first
        .layer(retry)
        .layer(fair)
        .layer(slots)
        // Stand-in for the HTTP client that calls https://api.anthropic.com/v1/messages:
        // it answers with the job it saw, in the response's extensions; tenant "umbrella"'s
        // first call is refused with a 429 and `retry-after: 2`.
        .service(service_fn({
            let refused = Arc::new(AtomicBool::new(false));
            move |req: http::Request<String>| {
                let refused = refused.clone();
                async move {
                    let job = req.extensions().get::<Job>().cloned();
                    let umbrella = job
                        .as_ref()
                        .is_some_and(|j| j.tenant().as_str() == "umbrella");
                    if umbrella && !refused.swap(true, Ordering::SeqCst) {
                        let response = http::Response::builder()
                            .status(429)
                            .header("retry-after", "2")
                            .body(String::new())
                            .expect("a valid response");
                        return Ok::<_, Infallible>(response);
                    }
                    let mut response = http::Response::new("{\"content\":[]}".to_owned());
                    if let Some(job) = job {
                        response.extensions_mut().insert(job);
                    }
                    Ok(response)
                }
            }
        }));
    priority_is_decided_centrally(&claude).await?;
    a_free_flood_fills_only_the_free_slots(&claude).await?;
    a_tenant_drawing_429s_is_demoted(&claude, &store).await?;
    a_429_is_retried_after_its_retry_after(&claude).await?;
    tenant_b_does_not_wait_behind_tenant_a().await;
    Ok(())
}

/// The stack as the steps call it: a request with its `Job`, the upstream's answer.
trait Claude<B>:
    tower::Service<http::Request<String>, Response = http::Response<B>, Error = BoxError> + Clone
{
}

impl<S, B> Claude<B> for S where
    S: tower::Service<http::Request<String>, Response = http::Response<B>, Error = BoxError>
        + Clone
{
}

/// Step 1: four jobs of one tier get their priority from origin and SLA, not a label.
async fn priority_is_decided_centrally<B>(claude: &impl Claude<B>) -> Result<(), BoxError> {
    println!("1. Priority is decided centrally, from origin and SLA:");
    let hour = Duration::from_secs(3600);
    let requests = [
        (
            "chat message",
            Job::new("acme", Origin::UserAction).with_tier("pro"),
        ),
        (
            "review reply, due in 1 h",
            Job::new("acme", Origin::Scheduled)
                .with_tier("pro")
                .with_sla(hour),
        ),
        (
            "weekly digest, due in 48 h",
            Job::new("globex", Origin::Scheduled)
                .with_tier("pro")
                .with_sla(48 * hour),
        ),
        (
            "bulk re-tagging, no SLA",
            Job::new("globex", Origin::BatchJob).with_tier("pro"),
        ),
    ];
    for (what, job) in requests {
        let response = send(claude, what, job).await?;
        drop(response); // the slot is held until the body is dropped
    }

    Ok(())
}

/// Step 2: free users hold both free slots; the third is refused at once, a pro user
/// still gets through.
async fn a_free_flood_fills_only_the_free_slots<B>(
    claude: &impl Claude<B>,
) -> Result<(), BoxError> {
    println!("\n2. A free-tier flood fills only the free slots; paying users still get through:");
    let mut held = Vec::new();
    for i in 0..3 {
        let job = Job::new(format!("free-user-{i}"), Origin::UserAction).with_tier("free");
        match send(claude, "chat message (held open)", job).await {
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
        claude,
        "chat message",
        Job::new("acme", Origin::UserAction).with_tier("pro"),
    )
    .await?;
    drop((response, held));

    Ok(())
}

/// Step 3: five 429s within a minute demote a tenant to batch.
async fn a_tenant_drawing_429s_is_demoted<B>(
    claude: &impl Claude<B>,
    store: &Store,
) -> Result<(), BoxError> {
    println!("\n3. A tenant drawing five 429s within a minute is demoted to batch for 5 minutes:");
    let initech = TenantId::new("initech");
    for _ in 0..5 {
        store.record_throttle(&initech).await; // RetryAfterBackoff records these
    }
    let job = Job::new("initech", Origin::UserAction).with_tier("pro");
    drop(send(claude, "chat message", job).await?);
    if let Some(left) = store.demoted_for(&initech).await {
        println!("initech is demoted to batch for {} s more", left.as_secs());
    }

    Ok(())
}

/// Step 4: a 429 is retried after its `retry-after`, with jitter, not at once.
async fn a_429_is_retried_after_its_retry_after<B>(
    claude: &impl Claude<B>,
) -> Result<(), BoxError> {
    println!("\n4. A 429 with retry-after: 2 s is retried after 2 s x 1.2 +/- 20%, not at once:");
    let started = tokio::time::Instant::now();
    drop(
        send(
            claude,
            "chat message",
            Job::new("umbrella", Origin::UserAction).with_tier("pro"),
        )
        .await?,
    );
    println!("   answered after {:.2} s", started.elapsed().as_secs_f64());

    Ok(())
}

/// Step 5: tenant B's one chat behind tenant A's 100, first come first served and in
/// the fair queue.
async fn tenant_b_does_not_wait_behind_tenant_a() {
    println!("\n5. Tenant A queues 100 chats, tenant B sends one; 4 calls in flight, 1.5 s each:");
    let fifo = ServiceBuilder::new()
        .layer(PriorityClassifyLayer::new(Store::memory()))
        .concurrency_limit(4)
        .service(slow_upstream());
    let fifo = tenant_b_waits(BoxCloneService::new(fifo.map_response(drop))).await;
    println!("   first come, first served (tower's ConcurrencyLimit): B waits {fifo:>5.1} s");
    let store = Store::memory();
    let fair = ServiceBuilder::new()
        .layer(PriorityClassifyLayer::new(store.clone()))
        .layer(DrrFairnessLayer::new(store, 4))
        .service(slow_upstream());
    let fair = tenant_b_waits(BoxCloneService::new(fair.map_response(drop))).await;
    println!("   DrrFairness:                                         B waits {fair:>5.1} s");
}

/// A stand-in for the API that takes 1.5 s per call.
fn slow_upstream() -> impl tower::Service<
    http::Request<()>,
    Response = http::Response<()>,
    Error = Infallible,
    Future: Send + 'static,
> + Clone
+ Send
+ 'static {
    service_fn(|_: http::Request<()>| async {
        tokio::time::sleep(Duration::from_millis(1500)).await;
        Ok::<_, Infallible>(http::Response::new(()))
    })
}

/// How long tenant B's one chat waits (before its own call) behind tenant A's 100.
async fn tenant_b_waits(service: BoxCloneService<http::Request<()>, (), BoxError>) -> f64 {
    let call = |tenant: &str| {
        let mut req = http::Request::new(());
        req.extensions_mut()
            .insert(Job::new(tenant, Origin::UserAction).with_cost(5_000));
        let service = service.clone();
        tokio::spawn(async move { service.oneshot(req).await })
    };
    let a: Vec<_> = (0..100).map(|_| call("A")).collect();
    tokio::task::yield_now().await;
    let started = tokio::time::Instant::now();
    let b = call("B").await;
    let waited = started.elapsed().as_secs_f64() - 1.5;
    for job in a {
        let _ = job.await;
    }
    match b {
        Ok(Ok(())) => waited,
        _ => f64::NAN,
    }
}

/// Sends one request and prints what the upstream saw. The response holds the request's
/// slot and window permit in its body until it is dropped.
async fn send<B>(
    claude: &impl Claude<B>,
    what: &str,
    job: Job,
) -> Result<http::Response<B>, BoxError> {
    let prompt = format!("{what}: please answer briefly.");
    let job = job.with_input_text(&prompt);
    let mut req = http::Request::post("https://api.anthropic.com/v1/messages").body(prompt)?;
    req.extensions_mut().insert(job);
    let response = claude.clone().oneshot(req).await?;
    let seen = response
        .extensions()
        .get::<Job>()
        .ok_or("the upstream saw no job")?;
    println!(
        "{:<12} {:<28} {:>4} tokens  {:<8} tier {}",
        seen.tenant().as_str(),
        what,
        seen.cost(),
        seen.priority().map_or("unset", |p| p.as_str()),
        seen.tier().map_or("-", |t| t.as_str()),
    );
    Ok(response)
}
