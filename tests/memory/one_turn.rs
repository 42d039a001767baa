//! One call per turn inside one tier, through the layers in paused time: four tenants
//! queue 200 calls each at once, a light tenant sends one every 1.5 s; a window of 2 and
//! 0.2 s calls (10 dispatches a second). Each call is charged 1,038 tokens (its input and
//! `max_tokens`) and settled at the 135 it used, as the gateway settles a short answer.
//! The light tenant is served within one turn of each waiting tenant, and no tenant goes
//! twice in a row while others wait — as tenants of the tier, and as the end users of one
//! group (a service key's users through the gateway).

use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::support::request;
use fairgate::{DemotionPolicy, DrrFairnessLayer, Job, Origin, PriorityClassifyLayer, Store};
use tokio::time::Instant;
use tower::{ServiceBuilder, ServiceExt, service_fn};

const CALL: Duration = Duration::from_millis(200);
const CHARGE: u32 = 1_038;
const USED: u64 = 135;

fn job(tenant: &str, group: Option<&str>) -> Job {
    let job = Job::new(tenant, Origin::Scheduled)
        .with_sla(Duration::from_secs(3600))
        .with_cost(CHARGE);
    match group {
        Some(group) => job.with_group(group),
        None => job,
    }
}

/// The light tenant's waits, and the longest run of one tenant's calls at the upstream.
async fn light_tenant_beside_four_backlogged(group: Option<&str>) -> (Vec<Duration>, usize) {
    let store = Store::memory();
    let policy = DemotionPolicy::builder()
        .default_daily_budget(u64::MAX)
        .build()
        .unwrap();
    let drr = DrrFairnessLayer::new(store.clone(), 2);
    let settler = drr.settler();
    let seen: Arc<Mutex<Vec<(String, Instant)>>> = Arc::default();
    let log = seen.clone();
    let upstream = service_fn(move |req: http::Request<()>| {
        let job = req.extensions().get::<Job>().expect("a job").clone();
        log.lock()
            .unwrap()
            .push((job.tenant().to_string(), Instant::now()));
        let settler = settler.clone();
        async move {
            tokio::time::sleep(CALL).await;
            settler.settle(&job, USED);
            Ok::<_, Infallible>(())
        }
    });
    let service = ServiceBuilder::new()
        .layer(PriorityClassifyLayer::new(store.clone()).demotion(policy))
        .layer(drr)
        .service(upstream);
    let mut calls = Vec::new();
    for tenant in ["h", "b", "c", "d"] {
        for _ in 0..200 {
            let call = service.clone().oneshot(request(job(tenant, group)));
            calls.push(tokio::spawn(call));
        }
    }
    let mut sent = Vec::new();
    for _ in 0..8 {
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        sent.push(Instant::now());
        service
            .clone()
            .oneshot(request(job("light", group)))
            .await
            .unwrap();
    }
    for call in calls {
        call.abort();
    }
    let seen = seen.lock().unwrap().clone();
    let light: Vec<Instant> = seen
        .iter()
        .filter(|(t, _)| t == "light")
        .map(|(_, at)| *at)
        .collect();
    let waits = sent
        .iter()
        .zip(&light)
        .map(|(sent, at)| at.saturating_duration_since(*sent))
        .collect();
    // The first two calls went out at once (room, nobody waiting yet): runs are counted
    // from the first call that waited.
    let mut longest = 0;
    let mut run = 0;
    for pair in seen[2..].windows(2) {
        run = if pair[0].0 == pair[1].0 { run + 1 } else { 0 };
        longest = longest.max(run + 1);
    }
    (waits, longest)
}

#[tokio::test(start_paused = true)]
async fn a_light_tenant_waits_one_turn_of_each_backlogged_tenant_of_its_tier() {
    let (waits, longest) = light_tenant_beside_four_backlogged(None).await;
    // Four tenants waiting: served within five dispatches, 0.5 s at 10 a second.
    let worst = waits.iter().max().copied().unwrap_or_default();
    assert!(worst <= Duration::from_millis(500), "waits {waits:?}");
    assert_eq!(longest, 1, "one call per turn");
}

#[tokio::test(start_paused = true)]
async fn a_light_end_user_waits_one_turn_of_each_backlogged_user_of_its_group() {
    let (waits, longest) = light_tenant_beside_four_backlogged(Some("companion-app")).await;
    let worst = waits.iter().max().copied().unwrap_or_default();
    assert!(worst <= Duration::from_millis(500), "waits {waits:?}");
    assert_eq!(longest, 1, "one call per turn");
}

/// The write-up's fairness scenario as the end users of one service key: 8 users of one
/// group at the provider's 300 requests a minute (1 s calls, learned pacing binding), one
/// keeping 40 calls queued (far over 10x the others), seven each sending one call and,
/// answered, the next 1-3 s later, for a minute. A light user with nothing queued is served
/// within one round of the users waiting: at most 8 paced calls (about 1.7 s at 5 calls a
/// second) from when it is sent until it reaches the upstream.
#[tokio::test(start_paused = true)]
async fn the_write_ups_eight_users_one_hogging_a_light_user_waits_at_most_one_round() {
    use crate::support::rate_limited::{RateLimited, StatusStack, first_start, send_at};
    use fairgate::{BackoffPolicy, FairgateLayer};
    use tower::Layer;

    let upstream = RateLimited::new(300, Duration::from_secs(1));
    let fairgate = FairgateLayer::builder(Store::memory())
        .backoff(BackoffPolicy::builder().seed(47).build().unwrap())
        .build()
        .unwrap();
    let stack: StatusStack = tower::util::BoxCloneSyncService::new(
        fairgate
            .layer(upstream.service())
            .map_response(|response| response.status().as_u16()),
    );
    let user = |name: &str| {
        Job::new(name, Origin::UserAction)
            .with_tier("pro")
            .with_group("companion-app")
            .with_cost(1_000)
    };
    // The warm-up: the limits are learned.
    let warm = send_at(stack.clone(), 0, Instant::now(), user("warm-up"));
    assert!(warm.await.unwrap().ok(), "the warm-up call");
    upstream.forget();
    let start = Instant::now();
    let ids = Arc::new(std::sync::atomic::AtomicU64::new(1));
    let next_id = move || ids.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    // The hog keeps 40 calls queued for the minute.
    let hog_stack = stack.clone();
    let hog_ids = next_id.clone();
    let hog = tokio::spawn(async move {
        let mut calls = tokio::task::JoinSet::new();
        while start.elapsed() < Duration::from_secs(60) {
            while calls.len() < 40 {
                let call = send_at(hog_stack.clone(), hog_ids(), Instant::now(), user("hog"));
                calls.spawn(call);
            }
            calls.join_next().await;
        }
        calls.abort_all();
    });
    let mut sent = Vec::new();
    let mut light = tokio::task::JoinSet::new();
    for u in 0..7u64 {
        let (stack, ids) = (stack.clone(), next_id.clone());
        light.spawn(async move {
            let mut mine = Vec::new();
            let mut at = start + Duration::from_millis(500 + 300 * u);
            while at < start + Duration::from_secs(55) {
                let id = ids();
                let outcome = send_at(stack.clone(), id, at, user(&format!("light-{u}")));
                let outcome = outcome.await.unwrap();
                mine.push((id, outcome.sent));
                // 1-3 s later, varying by user and call.
                at = Instant::now() + Duration::from_millis(1_000 + (u * 700 + id * 130) % 2_000);
            }
            mine
        });
    }
    while let Some(mine) = light.join_next().await {
        sent.extend(mine.unwrap());
    }
    hog.abort();
    let calls = upstream.calls();
    let waits: Vec<Duration> = sent
        .iter()
        .filter_map(|(id, at)| Some(first_start(&calls, *id)? - *at))
        .collect();
    let worst = waits.iter().max().copied().unwrap_or_default();
    let mean = waits.iter().sum::<Duration>() / waits.len().max(1) as u32;
    let hog_calls = calls.iter().filter(|c| c.tenant == "hog").count();
    println!(
        "8 users of one key at 300 RPM, one hogging: {} light calls waited {mean:?} on average, \
         at most {worst:?}; the hog {hog_calls} of {} calls; 429s {}",
        waits.len(),
        calls.len(),
        upstream.throttled()
    );
    assert_eq!(
        waits.len(),
        sent.len(),
        "every light call reached the upstream"
    );
    // One round: 8 paced calls at 0.95 of 300 a minute.
    let round = Duration::from_secs_f64(8.0 * 60.0 / (0.95 * 300.0));
    assert!(
        worst <= round,
        "a light user waited {worst:?}, over one round ({round:?})"
    );
    assert_eq!(upstream.throttled(), 0, "429s from the provider");
}
