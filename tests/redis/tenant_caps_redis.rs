//! Per-tenant slot caps on a real Redis: one tenant flooding every worker never holds more
//! than its cap, another tenant of the same tier is not delayed by it (through the slot
//! layer alone and through the fair queue that takes the slots), and a SIGKILLed worker's
//! tenant leases come back within the lease TTL.

use std::collections::HashMap;
use std::convert::Infallible;
use std::io::{BufRead, BufReader};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::support::RedisServer;
use fairgate::store::SlotRefusal;
use fairgate::{
    BoxError, DrrFairnessLayer, Job, Origin, SlotPolicy, Store, TenantId, Tier, TierSlotLimitLayer,
};
use tokio::time::Instant;
use tower::{Service, ServiceBuilder, ServiceExt, service_fn};

const WORKERS: usize = 4;
const TENANT_CAP: u32 = 4;
const HOLD: Duration = Duration::from_millis(200);

/// `pro`: 20 slots, at most 4 per tenant.
fn policy() -> SlotPolicy {
    SlotPolicy::builder()
        .global_max(30)
        .tier("pro", 20, Duration::from_secs(60))
        .tenant_cap("pro", TENANT_CAP)
        .lease_ttl(Duration::from_secs(2))
        .build()
        .unwrap()
}

/// What the upstream saw, across the four workers: calls in flight per tenant (now and the
/// most), and how long each call of a tenant waited from being sent to reaching it.
#[derive(Default)]
struct Seen {
    now: HashMap<String, u32>,
    max: HashMap<String, u32>,
    waits: HashMap<String, Vec<Duration>>,
}

type SeenRef = Arc<Mutex<Seen>>;

/// The mock upstream: the request's body is the instant it was sent.
fn upstream(
    seen: SeenRef,
) -> impl Service<
    http::Request<Instant>,
    Response = http::Response<()>,
    Error = Infallible,
    Future: Send + 'static,
> + Clone
+ Send
+ 'static {
    service_fn(move |req: http::Request<Instant>| {
        let seen = seen.clone();
        let tenant = req.extensions().get::<Job>().unwrap().tenant().to_string();
        {
            let mut s = seen.lock().unwrap();
            let now = s.now.entry(tenant.clone()).or_default();
            *now += 1;
            let now = *now;
            let max = s.max.entry(tenant.clone()).or_default();
            *max = (*max).max(now);
            s.waits
                .entry(tenant.clone())
                .or_default()
                .push(req.body().elapsed());
        }
        async move {
            tokio::time::sleep(HOLD).await;
            *seen.lock().unwrap().now.get_mut(&tenant).unwrap() -= 1;
            Ok(http::Response::new(()))
        }
    })
}

type Worker = tower::util::BoxCloneSyncService<http::Request<Instant>, (), BoxError>;

/// Four workers, each its own store handle on `url` (its own worker in Redis), with the
/// slot layer alone or the fair queue above it (which then takes the slots).
async fn workers(url: &str, fair: bool, seen: &SeenRef) -> Vec<Worker> {
    let mut workers = Vec::new();
    for _ in 0..WORKERS {
        let store = Store::redis(url).await.unwrap();
        let slots = TierSlotLimitLayer::new(store.clone(), policy());
        let worker = if fair {
            let worker = ServiceBuilder::new()
                .layer(
                    DrrFairnessLayer::builder(store.clone(), 64)
                        .slot_gate(slots.gate())
                        .build()
                        .unwrap(),
                )
                .layer(slots)
                .service(upstream(seen.clone()))
                .map_response(drop);
            tower::util::BoxCloneSyncService::new(worker)
        } else {
            let worker = ServiceBuilder::new()
                .layer(slots)
                .service(upstream(seen.clone()))
                .map_response(drop);
            tower::util::BoxCloneSyncService::new(worker)
        };
        workers.push(worker);
    }
    workers
}

fn send(worker: &Worker, tenant: &str) -> tokio::task::JoinHandle<Result<(), BoxError>> {
    let mut req = http::Request::new(Instant::now());
    req.extensions_mut()
        .insert(Job::new(tenant, Origin::UserAction).with_tier("pro"));
    tokio::spawn(worker.clone().oneshot(req))
}

/// Tenant `flood` sends 20 calls from each of the four workers (80: 20 at a time, its
/// tier's cap, would take 0.8 s; 4 at a time 4 s); 50 ms in, tenant `light` sends one
/// from each (its own cap's worth).
async fn flood_and_light(fair: bool) {
    let server = RedisServer::start();
    let seen = SeenRef::default();
    let workers = workers(&server.url(), fair, &seen).await;
    let started = Instant::now();
    let flood: Vec<_> = workers
        .iter()
        .flat_map(|w| (0..20).map(move |_| send(w, "flood")))
        .collect();
    tokio::time::sleep(Duration::from_millis(50)).await;
    let light: Vec<_> = workers.iter().map(|w| send(w, "light")).collect();
    for call in light.into_iter().chain(flood) {
        call.await.unwrap().expect("no call fails or is busy");
    }
    let took = started.elapsed();
    let s = seen.lock().unwrap();
    let flood_max = s.max["flood"];
    let mut light_waits = s.waits["light"].clone();
    light_waits.sort();
    let worst = *light_waits.last().unwrap();
    println!(
        "fair queue: {fair}; flood: {} calls, at most {flood_max} in flight (cap {TENANT_CAP}), \
         all done in {took:?}; light: waits {light_waits:?}",
        s.waits["flood"].len()
    );
    assert_eq!(s.waits["flood"].len(), 80);
    assert_eq!(light_waits.len(), WORKERS);
    assert!(
        flood_max <= TENANT_CAP,
        "flood held {flood_max} slots at once"
    );
    assert_eq!(flood_max, TENANT_CAP, "the flood used its whole cap");
    // Not one of the flood's calls is ahead of the light tenant's: each of its calls waits
    // only the round trips of its own acquire (behind an uncapped flood: a call time).
    assert!(worst < Duration::from_millis(80), "light waited {worst:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_flooding_four_workers_never_exceeds_its_cap_and_another_is_not_delayed() {
    let _turn = crate::support::file_turn(module_path!());
    flood_and_light(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn through_the_fair_queue_a_capped_flood_holds_its_cap_and_delays_nobody() {
    let _turn = crate::support::file_turn(module_path!());
    flood_and_light(true).await;
}

/// The worker process, killed (by its pid) when the test ends, however it ends.
struct Holder(std::process::Child);

impl Drop for Holder {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A worker SIGKILLed while its tenant holds its whole cap: the tenant is refused for its
/// cap (and only it) until the dead worker's leases expire, then gets slots again within
/// the lease TTL (2 s), without anyone releasing anything.
#[tokio::test]
async fn a_sigkilled_workers_tenant_leases_come_back_within_the_lease_ttl() {
    let _turn = crate::support::file_turn(module_path!());
    let server = RedisServer::start();
    let mut holder = Holder(
        crate::support::SlotWorker::command()
            .args(["hold-tenant", &server.url(), "3"])
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start a slot_worker process"),
    );
    let mut line = String::new();
    BufReader::new(holder.0.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line.trim(), "HOLDING");

    let store = Store::redis(&server.url()).await.unwrap();
    let pro = Tier::new("pro");
    let (capped, other) = (TenantId::new("capped"), TenantId::new("other"));
    let limits = fairgate::store::SlotLimits {
        global: 12,
        tier: 6,
        tenant: Some(3),
        lease_ttl: Duration::from_secs(2),
    };
    let refused = store
        .try_acquire_slot_for(&pro, Some(&capped), limits)
        .await;
    assert_eq!(refused.unwrap_err(), SlotRefusal::TenantCap);
    let _others = store
        .try_acquire_slot_for(&pro, Some(&other), limits)
        .await
        .expect("another tenant of the tier still gets a slot");

    holder.0.kill().unwrap(); // SIGKILL: no release, no more heartbeats
    holder.0.wait().unwrap();
    let killed = Instant::now();
    let (back_after, _lease) = loop {
        match store
            .try_acquire_slot_for(&pro, Some(&capped), limits)
            .await
        {
            Ok(lease) => break (killed.elapsed(), lease),
            Err(refusal) => assert_eq!(refusal, SlotRefusal::TenantCap),
        }
        assert!(
            killed.elapsed() < Duration::from_secs(4),
            "the tenant's slots never came back"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    println!("the killed worker's tenant leases came back after {back_after:?} (TTL 2 s)");
    assert!(back_after <= Duration::from_millis(2_300), "{back_after:?}");
}
