//! The fleet keeps one fair order: `N` workers (store handles, each with its own worker id,
//! connections and wake channel, and the whole stack through `FairgateLayer`, window 8)
//! share a global cap of 8 slots on one throwaway redis-server (or the test's own Redis
//! Cluster), calls of 30-50 ms. A freed slot goes to the call the fair order of the whole fleet
//! picks — class by its weights, tier by start-time fair queuing on the tier weights, tenant
//! by start-time fair queuing on the cost — whichever worker holds it. Where a shared
//! pacing's request limit binds instead of the slots, each freed cell of the rate goes the
//! same way; where a learned input-token limit binds, so do the tokens.
//!
//! Counted at the upstream stand-in shared by every worker: who started when, and how many
//! were in flight at once. Real time (Redis is real), a few seconds a scenario.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::support::{RedisCluster, RedisServer};
use fairgate::rate::Pacing;
use fairgate::retry_after_backoff::BackoffPolicyBuilder;
use fairgate::{BackoffPolicy, FairgateLayer, Job, Origin, SlotPolicy, Store};
use http_body_util::BodyExt;
use tower::util::BoxCloneService;
use tower::{Layer, ServiceExt, service_fn};

const GLOBAL_CAP: u32 = 8;
/// Calls take 30 to 50 ms (40 on average, in a fixed sequence), so the slots free one by
/// one rather than all at once.
const CALL_MS: (u64, u64) = (30, 20);
/// Tokens a call is estimated at: small enough that no tenant reaches the daily budget that
/// would demote it to batch (1.5 x 100,000 tokens by default) within a scenario, counting
/// the calls refused at once while Redis is away and tried again (they count at
/// classification; at 100, hog was demoted after an outage of 1.5 s).
const COST: u32 = 10;
const WARM_UP: Duration = Duration::from_millis(1_000);
const MEASURE: Duration = Duration::from_millis(3_000);

/// One scenario at a time: two at once on two cores would measure each other.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn policy() -> SlotPolicy {
    let mut builder = SlotPolicy::builder().global_max(GLOBAL_CAP);
    // Tier caps that never bind: the global cap and the fair order decide.
    for tier in ["premium", "pro", "free", "guest"] {
        builder = builder.tier(tier, GLOBAL_CAP, Duration::from_secs(120));
    }
    builder.build().expect("a valid policy")
}

/// A call started at the upstream: its tenant, and when.
#[derive(Clone)]
struct Start {
    tenant: String,
    worker: usize,
    at: Instant,
}

#[derive(Default)]
struct Upstream {
    starts: Vec<Start>,
    in_flight: u32,
    max_in_flight: u32,
    calls: u64,
    /// The next call is answered 429 with this `retry-after-ms`; when that answer went.
    throttle_next: Option<u64>,
    throttled_at: Option<Instant>,
    /// When the first answer went back.
    first_answer: Option<Instant>,
    /// The upstream's token buckets (input, output, combined), where its answers say their
    /// limit: when each is full again (seconds after the fleet started), as the provider's
    /// GCRA keeps it.
    full_at: [f64; 3],
}

/// Takes `tokens` from a bucket of `limit` a minute that is full again at `full_at`
/// (seconds): what is left of it after.
fn take_tokens(full_at: &mut f64, limit: u32, tokens: u32, now: f64) -> u32 {
    let per_token = 60.0 / f64::from(limit);
    *full_at = full_at.max(now) + f64::from(tokens) * per_token;
    let missing = (*full_at - now) / per_token;
    (f64::from(limit) - missing).clamp(0.0, f64::from(limit)) as u32
}

/// What every answer says of the upstream's limits (`anthropic-ratelimit-*`), on the
/// workers from `first` on: the request limit, and the token limits given (with what is
/// left of each, from the upstream's own bucket of a minute, empty when the fleet starts:
/// the provider was busy before).
#[derive(Clone, Copy)]
struct Said {
    rpm: u32,
    itpm: Option<u32>,
    /// An output-token limit a minute: then every answer's body reports its usage,
    /// [`OUTPUT`] tokens out.
    otpm: Option<u32>,
    /// The combined token limit a minute (input and output): then every answer's body
    /// reports its usage too.
    tpm: Option<u32>,
    /// The input tokens each answer's usage reports (the job's estimate is [`COST`]).
    input: u32,
    first: usize,
}

impl Said {
    /// Every worker's answers saying a request limit of `rpm` a minute, and no other.
    const fn rpm(rpm: u32) -> Said {
        Said {
            rpm,
            itpm: None,
            otpm: None,
            tpm: None,
            input: COST,
            first: 0,
        }
    }
}

/// Output tokens an answer reports in its usage, where the upstream says an output limit.
const OUTPUT: u32 = 100;

type Service = BoxCloneService<http::Request<()>, (), fairgate::BoxError>;

struct Fleet {
    upstream: Arc<Mutex<Upstream>>,
    workers: Vec<Service>,
    fair_queues: Vec<fairgate::DrrFairnessLayer>,
    stores: Vec<Store>,
    stop: Arc<AtomicBool>,
    started: Instant,
    callers: Vec<tokio::task::JoinHandle<()>>,
}

enum Redis<'a> {
    Node(&'a RedisServer),
    Cluster(&'a RedisCluster),
}

impl Redis<'_> {
    /// A worker's store; on the cluster (shared by the binary's tests) under the fleet's
    /// own key prefix, so that what an earlier test's fleet left (a wait book naming other
    /// cells, for 10 s) is not this one's.
    async fn store(&self, fleet: u64) -> Store {
        match self {
            Redis::Node(server) => Store::redis(&server.url()).await.expect("a store"),
            Redis::Cluster(cluster) => Store::builder()
                .key_prefix(format!("order-fleet-{fleet}"))
                .redis_cluster(cluster.urls())
                .await
                .expect("a store on the cluster"),
        }
    }
}

/// One call of `tenant` in `tier`, costing [`COST`].
fn call_of(tenant: &str, tier: &str, origin: Origin) -> http::Request<()> {
    call_in(tenant, None, tier, origin)
}

/// [`call_of`] for a tenant of `group` (a key's end user).
fn call_in(tenant: &str, group: Option<&str>, tier: &str, origin: Origin) -> http::Request<()> {
    let mut req = http::Request::new(());
    let job = Job::new(tenant, origin).with_tier(tier);
    let job = match group {
        Some(group) => job.with_group(group),
        None => job,
    };
    req.extensions_mut().insert(job.with_cost(COST));
    req
}

/// Numbers each fleet started (its key prefix on the cluster).
static FLEETS: AtomicU64 = AtomicU64::new(0);

impl Fleet {
    async fn start(redis: &Redis<'_>, workers: usize) -> Fleet {
        Fleet::start_paced(redis, workers, None).await
    }

    /// `start`, each worker's retry layer pacing its calls by `pacing` (shared in Redis).
    async fn start_paced(redis: &Redis<'_>, workers: usize, pacing: Option<Pacing>) -> Fleet {
        Fleet::start_with(redis, workers, pacing, CALL_MS, None).await
    }

    /// `start`, every answer saying the limits `said` (`anthropic-ratelimit-*`), so learned
    /// pacing paces the fleet.
    async fn start_said(redis: &Redis<'_>, workers: usize, said: Said) -> Fleet {
        Fleet::start_with(redis, workers, None, CALL_MS, Some(said)).await
    }

    /// `start_paced`, calls taking `call_ms` (the least, and the spread above it), answers
    /// saying the limits `said` if given.
    async fn start_with(
        redis: &Redis<'_>,
        workers: usize,
        pacing: Option<Pacing>,
        call_ms: (u64, u64),
        said: Option<Said>,
    ) -> Fleet {
        Fleet::start_tuned(redis, workers, pacing, call_ms, said, |policy| policy).await
    }

    /// `start_with`, each worker's retry policy tuned by `tune`.
    async fn start_tuned(
        redis: &Redis<'_>,
        workers: usize,
        pacing: Option<Pacing>,
        call_ms: (u64, u64),
        said: Option<Said>,
        tune: fn(BackoffPolicyBuilder) -> BackoffPolicyBuilder,
    ) -> Fleet {
        let upstream = Arc::new(Mutex::new(Upstream {
            // Empty: full again in a minute.
            full_at: [60.0; 3],
            ..Upstream::default()
        }));
        let started = Instant::now();
        let fleet_id = FLEETS.fetch_add(1, Ordering::Relaxed);
        let mut fleet = Fleet {
            upstream: upstream.clone(),
            workers: Vec::new(),
            fair_queues: Vec::new(),
            stores: Vec::new(),
            stop: Arc::new(AtomicBool::new(false)),
            started,
            callers: Vec::new(),
        };
        for worker in 0..workers {
            let store = redis.store(fleet_id).await;
            let upstream = upstream.clone();
            let said = said.filter(|said| worker >= said.first);
            let call = service_fn(move |req: http::Request<()>| {
                let upstream = upstream.clone();
                async move {
                    let job = req.extensions().get::<Job>().expect("a job");
                    let (call, throttle, left) = {
                        let mut up = upstream.lock().unwrap();
                        // The provider's token buckets take the call's tokens.
                        let now = started.elapsed().as_secs_f64();
                        let mut left = [None; 3];
                        if let Some(said) = said {
                            let limits = [said.itpm, said.otpm, said.tpm];
                            let tokens = [said.input, OUTPUT, said.input + OUTPUT];
                            for d in 0..3 {
                                left[d] = limits[d].map(|limit| {
                                    take_tokens(&mut up.full_at[d], limit, tokens[d], now)
                                });
                            }
                        }
                        up.starts.push(Start {
                            tenant: job.tenant().as_str().to_owned(),
                            worker,
                            at: Instant::now(),
                        });
                        up.in_flight += 1;
                        up.max_in_flight = up.max_in_flight.max(up.in_flight);
                        up.calls += 1;
                        let (least, spread) = call_ms;
                        let call = Duration::from_millis(least + up.calls * 7_919 % (spread + 1));
                        (call, up.throttle_next.take(), left)
                    };
                    tokio::time::sleep(call).await;
                    let mut answer = http::Response::new(String::new());
                    {
                        let mut up = upstream.lock().unwrap();
                        up.in_flight -= 1;
                        up.first_answer.get_or_insert_with(Instant::now);
                        if let Some(ms) = throttle {
                            up.throttled_at = Some(Instant::now());
                            *answer.status_mut() = http::StatusCode::TOO_MANY_REQUESTS;
                            answer
                                .headers_mut()
                                .insert("retry-after-ms", http::HeaderValue::from(ms));
                        }
                    }
                    if let Some(said) = said {
                        let headers = answer.headers_mut();
                        for name in [
                            "anthropic-ratelimit-requests-limit",
                            "anthropic-ratelimit-requests-remaining",
                        ] {
                            headers.insert(name, http::HeaderValue::from(said.rpm));
                        }
                        let limits = [said.itpm, said.otpm, said.tpm];
                        for (d, dim) in ["input-tokens", "output-tokens", "tokens"]
                            .iter()
                            .enumerate()
                        {
                            let (Some(limit), Some(left)) = (limits[d], left[d]) else {
                                continue;
                            };
                            for (end, value) in [("limit", limit), ("remaining", left)] {
                                let name = format!("anthropic-ratelimit-{dim}-{end}");
                                let name = http::HeaderName::try_from(name).expect("a name");
                                headers.insert(name, http::HeaderValue::from(value));
                            }
                        }
                    }
                    if let Some(Said { input, .. }) =
                        said.filter(|s| s.itpm.is_some() || s.otpm.is_some() || s.tpm.is_some())
                    {
                        *answer.body_mut() = format!(
                            r#"{{"usage":{{"input_tokens":{input},"output_tokens":{OUTPUT}}}}}"#
                        );
                    }
                    Ok::<_, std::convert::Infallible>(answer)
                }
            });
            let mut backoff = tune(BackoffPolicy::builder());
            if let Some(pacing) = pacing.clone() {
                backoff = backoff.pacing(pacing);
            }
            let layer = FairgateLayer::builder(store.clone())
                .slots(policy())
                .backoff(backoff.build().expect("a valid policy"))
                .window(8)
                .build()
                .expect("a stack");
            fleet.fair_queues.push(layer.fairness().clone());
            let service = layer.layer(call);
            // Each answer read to its end, as a caller does (its usage is seen).
            let service = service.and_then(
                |answer: http::Response<fairgate::FairgateBody<String>>| async move {
                    let _ = answer.into_body().collect().await;
                    Ok::<_, fairgate::BoxError>(())
                },
            );
            fleet.workers.push(BoxCloneService::new(service));
            fleet.stores.push(store);
        }
        fleet
    }

    /// `n` callers on `worker`, each sending calls of `tenant` one after another until the
    /// fleet stops.
    fn callers(&mut self, worker: usize, n: usize, tenant: &str, tier: &str, origin: Origin) {
        self.callers_in(worker, n, (tenant, None), tier, origin);
    }

    /// [`Fleet::callers`] for a tenant of a group (`(tenant, Some(group))`).
    fn callers_in(
        &mut self,
        worker: usize,
        n: usize,
        (tenant, group): (&str, Option<&str>),
        tier: &str,
        origin: Origin,
    ) {
        for _ in 0..n {
            let service = self.workers[worker].clone();
            let stop = self.stop.clone();
            let (tenant, tier) = (tenant.to_owned(), tier.to_owned());
            let group = group.map(str::to_owned);
            self.callers.push(tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    let req = call_in(&tenant, group.as_deref(), &tier, origin);
                    if service.clone().oneshot(req).await.is_err() {
                        // Refused (`Busy`): a client waits a moment before it tries again.
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                }
            }));
        }
    }

    /// The calls started in `[from, from + for)`, by tenant.
    fn served(&self, from: Instant, span: Duration) -> HashMap<String, usize> {
        let mut served = HashMap::new();
        for start in &self.upstream.lock().unwrap().starts {
            if start.at >= from && start.at < from + span {
                *served.entry(start.tenant.clone()).or_default() += 1;
            }
        }
        served
    }

    /// The fairness index each worker publishes, once every worker sent what it served.
    async fn fairness_indexes(&self) -> Vec<Option<f64>> {
        for store in &self.stores {
            store.flush().await;
        }
        // Each worker reads the fleet's index after its own send: read again once all sent.
        for store in &self.stores {
            store.flush().await;
        }
        self.fair_queues
            .iter()
            .map(|q| q.fairness_index())
            .collect()
    }

    fn starts(&self) -> Vec<Start> {
        self.upstream.lock().unwrap().starts.clone()
    }

    /// Stops the callers and waits until their last calls are over.
    async fn stop_callers(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for caller in self.callers.drain(..) {
            let _ = tokio::time::timeout(Duration::from_secs(10), caller).await;
        }
    }

    /// Stops the callers; the most calls ever in flight at once at the upstream.
    async fn stop(mut self) -> u32 {
        self.stop_callers().await;
        drop(self.workers);
        drop(self.stores);
        let max = self.upstream.lock().unwrap().max_in_flight;
        assert!(
            max <= GLOBAL_CAP,
            "{max} calls in flight at once, over the global cap"
        );
        max
    }
}

/// What the fleet's order still keeps once nothing waits (flows, their workers, finish
/// tags, counts), after the last releases had a moment to land.
async fn queue_leftovers(server: &RedisServer) -> Vec<String> {
    let mut left = Vec::new();
    for _ in 0..20 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let out = std::process::Command::new("redis-cli")
            .args(["-p", &server.port().to_string(), "--scan"])
            .output()
            .expect("redis-cli");
        left = String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|key| {
                [
                    ":flows:", ":fw:", ":fin:", ":groups:", ":gfin:", ":gv:", ":fg:", ":wants",
                    ":costs", ":waiting",
                ]
                .iter()
                .any(|part| key.contains(part))
            })
            .map(str::to_owned)
            .collect();
        if left.is_empty() {
            break;
        }
    }
    left
}

/// Jain's fairness index of what each tenant got, each divided by its fair weight.
fn jain(shares: &[f64]) -> f64 {
    let sum: f64 = shares.iter().sum();
    let squares: f64 = shares.iter().map(|x| x * x).sum();
    sum * sum / (shares.len() as f64 * squares)
}

/// Tenant "hog" has 12 callers on every worker, tenant "light" (same tier, same weight)
/// 12 on worker 0 only; both always have calls waiting. Fair is half each.
async fn light_against_hog(redis: Redis<'_>, workers: usize) {
    let _serial = SERIAL.lock().await;
    let mut fleet = Fleet::start(&redis, workers).await;
    for w in 0..workers {
        fleet.callers(w, 12, "hog", "pro", Origin::UserAction);
    }
    fleet.callers(0, 12, "light", "pro", Origin::UserAction);
    tokio::time::sleep(WARM_UP).await;
    let from = Instant::now();
    tokio::time::sleep(MEASURE).await;
    let served = fleet.served(from, MEASURE);
    fleet.stop().await;
    if let Redis::Node(server) = &redis {
        // Nothing waits any more: the fleet's order keeps nothing of anyone.
        let left = queue_leftovers(server).await;
        assert!(left.is_empty(), "left in Redis: {left:?}");
    }
    let (light, hog) = (served["light"] as f64, served["hog"] as f64);
    let share = light / (light + hog);
    let index = jain(&[light, hog]);
    println!(
        "{workers} workers: light {light}, hog {hog} calls served: light's share {:.1}%, \
         Jain's index {index:.3}",
        share * 100.0
    );
    assert!(
        share >= 0.45,
        "light got {:.1}% of the calls",
        share * 100.0
    );
    assert!(index >= 0.99, "Jain's index {index:.3}");
}

/// A plain key (one tenant, 4 callers on each worker) beside a service key of 50 end users
/// (`Job::with_group`, 3 callers each, spread over the workers), one tier: the fleet's
/// order goes across keys first, so the plain key gets half the calls. The same callers
/// with no group give the plain key one tenant's share of 51 (11 of 571 calls).
async fn plain_key_beside_a_service(redis: Redis<'_>, workers: usize) {
    let _serial = SERIAL.lock().await;
    let mut fleet = Fleet::start(&redis, workers).await;
    for w in 0..workers {
        fleet.callers(w, 4, "plain", "pro", Origin::UserAction);
    }
    for user in 0..50 {
        let name = format!("service/user-{user}");
        let of = (name.as_str(), Some("service"));
        fleet.callers_in(user % workers, 3, of, "pro", Origin::UserAction);
    }
    tokio::time::sleep(WARM_UP).await;
    let from = Instant::now();
    tokio::time::sleep(MEASURE).await;
    let served = fleet.served(from, MEASURE);
    fleet.stop().await;
    let plain = served.get("plain").copied().unwrap_or(0) as f64;
    let service: f64 = served
        .iter()
        .filter(|(tenant, _)| tenant.starts_with("service/"))
        .map(|(_, n)| *n as f64)
        .sum();
    let share = plain / (plain + service);
    println!(
        "{workers} workers: plain key {plain}, service key (50 users) {service} calls: the plain \
         key's share {:.1}%",
        share * 100.0
    );
    assert!(
        (0.4..=0.6).contains(&share),
        "the plain key got {:.1}% of the calls",
        share * 100.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "long: bash scripts/test --long"]
async fn a_plain_key_is_one_share_beside_a_50_user_service_key_on_four_workers() {
    let _turn = crate::support::file_turn(module_path!());
    let server = RedisServer::start();
    plain_key_beside_a_service(Redis::Node(&server), 4).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "long: bash scripts/test --long"]
async fn a_plain_key_is_one_share_beside_a_50_user_service_key_on_the_cluster() {
    let _turn = crate::support::file_turn(module_path!());
    plain_key_beside_a_service(Redis::Cluster(RedisCluster::shared()), 4).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_on_one_of_four_workers_gets_its_fair_half() {
    let _turn = crate::support::file_turn(module_path!());
    let server = RedisServer::start();
    light_against_hog(Redis::Node(&server), 4).await;
}

/// A shared pacing of 3,000 calls a minute (50/s, burst 1): in the light-against-hog
/// scenario it binds instead of the slots (8 slots of 40 ms calls take 200/s).
fn rate_of_50_a_second() -> Pacing {
    rate_of_50_a_second_in_bursts_of(1)
}

/// The same rate, `burst` calls back to back allowed.
fn rate_of_50_a_second_in_bursts_of(burst: u32) -> Pacing {
    Pacing::new()
        .requests_per_minute(3_000)
        .request_burst(burst)
        .shared()
}

/// The most calls started in any one second of `starts` (sorted by time).
fn most_in_a_second(starts: &[Instant]) -> usize {
    let mut most = 0;
    let mut first = 0;
    for (last, at) in starts.iter().enumerate() {
        while *at - starts[first] >= Duration::from_secs(1) {
            first += 1;
        }
        most = most.max(last + 1 - first);
    }
    most
}

/// The light-against-hog scenario where the provider's rate binds instead of the slots:
/// the rate's cells go out in the fleet's order with the slots, so light gets its fair
/// half whichever worker it is on, and the fleet keeps to the rate.
async fn light_against_hog_at_the_rate(redis: Redis<'_>, workers: usize) {
    light_against_hog_at_the_rate_in_bursts_of(redis, workers, 1).await;
}

/// `light_against_hog_at_the_rate` with cells of `burst` (each freed cell of a burst goes
/// in the fleet's order too: a release hands out every free one).
async fn light_against_hog_at_the_rate_in_bursts_of(redis: Redis<'_>, workers: usize, burst: u32) {
    let pacing = Some(rate_of_50_a_second_in_bursts_of(burst));
    let rate = Rate::kept(50.0, burst as usize);
    light_against_hog_bound(redis, workers, pacing, None, rate).await;
}

/// The provider's rate in a light-against-hog scenario: `per_second` calls in cells of
/// `burst`, kept from the first call (or from the end of the warm-up, where a worker runs
/// free until another has learned the limit).
struct Rate {
    per_second: f64,
    burst: usize,
    from_the_first_call: bool,
}

impl Rate {
    /// A rate the fleet keeps from its first call.
    fn kept(per_second: f64, burst: usize) -> Rate {
        Rate {
            per_second,
            burst,
            from_the_first_call: true,
        }
    }

    /// A rate the fleet keeps once it has learned it: from the end of the warm-up.
    fn after_warm_up(per_second: f64, burst: usize) -> Rate {
        Rate {
            from_the_first_call: false,
            ..Rate::kept(per_second, burst)
        }
    }
}

/// The light-against-hog scenario where `rate` binds instead of the slots, on `workers`
/// started on `redis` with `pacing` and answers saying `said`.
async fn light_against_hog_bound(
    redis: Redis<'_>,
    workers: usize,
    pacing: Option<Pacing>,
    said: Option<Said>,
    rate: Rate,
) {
    let _serial = SERIAL.lock().await;
    let fleet = Fleet::start_with(&redis, workers, pacing, CALL_MS, said).await;
    light_against_hog_paced(fleet, &redis, workers, rate).await;
}

/// The light-against-hog scenario on `fleet` (its `workers` on `redis`), whose `rate`
/// binds instead of the slots.
async fn light_against_hog_paced(mut fleet: Fleet, redis: &Redis<'_>, workers: usize, rate: Rate) {
    let Rate {
        per_second,
        burst,
        from_the_first_call,
    } = rate;
    for w in 0..workers {
        fleet.callers(w, 12, "hog", "pro", Origin::UserAction);
    }
    fleet.callers(0, 12, "light", "pro", Origin::UserAction);
    tokio::time::sleep(WARM_UP).await;
    // What Redis runs meanwhile (one node: MONITOR), per call started.
    let monitor = match &redis {
        Redis::Node(server) => Some((crate::wakeups::Monitor::start(server), *server)),
        Redis::Cluster(_) => None,
    };
    let from = Instant::now();
    tokio::time::sleep(MEASURE).await;
    let scripts =
        monitor.map(|(monitor, server)| crate::wakeups::scripts_in(&monitor.lines(server)));
    let served = fleet.served(from, MEASURE);
    // Which worker started them: who was left out, should a tenant be.
    let mut by_worker = std::collections::BTreeMap::new();
    for start in fleet.starts() {
        if start.at >= from && start.at < from + MEASURE {
            *by_worker.entry((start.tenant, start.worker)).or_insert(0) += 1;
        }
    }
    let mut starts: Vec<Instant> = fleet.starts().iter().map(|s| s.at).collect();
    starts.sort();
    fleet.stop().await;
    let light = served.get("light").copied().unwrap_or(0) as f64;
    let hog = served.get("hog").copied().unwrap_or(0) as f64;
    let per_request = scripts.map_or(String::new(), |(slot, all)| {
        let per_call = |n: usize| n as f64 / (light + hog);
        format!(
            ", {:.2} slot scripts per call ({:.2} scripts of any kind)",
            per_call(slot),
            per_call(all)
        )
    });
    // A second sees the rate and a burst; a cell is handed out up to 2 ms before it frees
    // (its release is sent a little ahead): one call more at most.
    if !from_the_first_call {
        starts.retain(|at| *at >= from);
    }
    let most = most_in_a_second(&starts);
    println!(
        "rate binding, {workers} workers: light {light}, hog {hog} calls started: light's \
         share {:.1}%, Jain's index {:.3}, {:.0}% of the rate used, at most {most} calls \
         in a second{per_request}",
        100.0 * light / (light + hog),
        jain(&[light, hog]),
        100.0 * (light + hog) / (per_second * MEASURE.as_secs_f64())
    );
    let allowed = per_second.ceil() as usize + burst + 1;
    assert!(
        most <= allowed,
        "{most} calls started in one second, over the rate ({per_second}/s, {burst} at once)"
    );
    assert!(
        light + hog >= 0.8 * per_second * MEASURE.as_secs_f64(),
        "the rate was not used: {}",
        light + hog
    );
    // Over the whole measure, too: the rate and a burst (one call more at most).
    let most_in_the_measure = per_second * MEASURE.as_secs_f64() + burst as f64 + 1.0;
    assert!(
        light + hog <= most_in_the_measure,
        "{} calls started in {MEASURE:?}, over the rate ({per_second}/s, {burst} at once)",
        light + hog
    );
    let share = light / (light + hog);
    assert!(
        share >= 0.45,
        "light got {:.1}% of the calls; started by (tenant, worker): {by_worker:?}",
        share * 100.0
    );
    assert!(
        jain(&[light, hog]) >= 0.99,
        "Jain's index {:.3}",
        jain(&[light, hog])
    );
}

/// The light-against-hog scenario where the rate is learned from the answers (3,000
/// requests a minute, paced at 95% of it, in cells of 5: each at least 100 ms), not
/// configured.
async fn light_against_hog_at_the_learned_rate(redis: Redis<'_>, workers: usize) {
    let said = Some(Said::rpm(3_000));
    light_against_hog_bound(redis, workers, None, said, Rate::kept(47.5, 5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "long: bash scripts/test --long"]
async fn where_the_learned_rate_binds_a_tenant_on_one_of_four_workers_gets_its_half() {
    let _turn = crate::support::file_turn(module_path!());
    let server = RedisServer::start();
    light_against_hog_at_the_learned_rate(Redis::Node(&server), 4).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "long: bash scripts/test --long"]
async fn where_the_learned_rate_binds_a_tenant_on_one_of_sixteen_workers_gets_its_half() {
    let _turn = crate::support::file_turn(module_path!());
    let server = RedisServer::start();
    light_against_hog_at_the_learned_rate(Redis::Node(&server), 16).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "long: bash scripts/test --long"]
async fn where_the_learned_rate_binds_the_cluster_keeps_the_fair_half_too() {
    let _turn = crate::support::file_turn(module_path!());
    light_against_hog_at_the_learned_rate(Redis::Cluster(RedisCluster::shared()), 4).await;
}

/// The light-against-hog scenario where the upstream's input-token limit binds, learned
/// from the answers: 30,000 tokens a minute (paced at 95% of it: 475 a second, 47.5 calls
/// of 10 tokens), its request limit (100,000 a minute) and the slots (8 of 40 ms calls:
/// 200 a second) do not, and its bucket is empty when the fleet starts. The tokens go in the
/// fleet's order with the slots; the fleet's bucket holds a second of them, so any second
/// sees at most the rate and that second's burst (every call costs the same 10 tokens:
/// calls counted are tokens over 10). Without it each worker reserves its tokens in the
/// learned bucket: light got 16-22% at 4 workers.
async fn light_against_hog_at_the_learned_token_rate(redis: Redis<'_>, workers: usize) {
    let said = Some(INPUT_LIMIT);
    light_against_hog_bound(redis, workers, None, said, Rate::kept(47.5, 48)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn where_the_learned_token_rate_binds_a_tenant_on_one_of_four_workers_gets_its_half() {
    let _turn = crate::support::file_turn(module_path!());
    let server = RedisServer::start();
    light_against_hog_at_the_learned_token_rate(Redis::Node(&server), 4).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "long: bash scripts/test --long"]
async fn where_the_learned_token_rate_binds_a_tenant_on_one_of_sixteen_workers_gets_its_half() {
    let _turn = crate::support::file_turn(module_path!());
    let server = RedisServer::start();
    light_against_hog_at_the_learned_token_rate(Redis::Node(&server), 16).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "long: bash scripts/test --long"]
async fn where_the_learned_token_rate_binds_the_cluster_keeps_the_fair_half_too() {
    let _turn = crate::support::file_turn(module_path!());
    light_against_hog_at_the_learned_token_rate(Redis::Cluster(RedisCluster::shared()), 4).await;
}

/// The same where one worker's answers never say the limit (light is on it), and its first
/// answer came before any other: it has learned there is nothing to learn and never asks
/// again, while the others learn the limit and hand it out as cells. Its calls take the
/// cells the others name (without that: 112-115% of the rate, 58-62 calls in one second).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "long: bash scripts/test --long"]
async fn where_one_worker_never_learns_the_limit_its_calls_take_the_cells_the_others_name() {
    let _turn = crate::support::file_turn(module_path!());
    let server = RedisServer::start();
    let _serial = SERIAL.lock().await;
    let said = Said {
        first: 1,
        ..Said::rpm(3_000)
    };
    let fleet = Fleet::start_said(&Redis::Node(&server), 4, said).await;
    fleet.workers[0]
        .clone()
        .oneshot(call_of("light", "pro", Origin::UserAction))
        .await
        .expect("the first call");
    // Until another worker's answer has said the limit, the fleet runs unpaced (about
    // three times the rate in the first 250 ms): the rate is kept from the end of the
    // warm-up.
    let rate = Rate::after_warm_up(47.5, 5);
    light_against_hog_paced(fleet, &Redis::Node(&server), 4, rate).await;
}

/// The light-against-hog scenario where a learned output or combined token limit binds
/// (`said`), the requests, the input tokens and the slots not: such a limit bounds the
/// fleet's request cells at the average call (10 tokens in, 100 out), which go in the
/// fleet's order. Until the first answers' usage is seen the fleet runs as it learns: the
/// rate is kept from the end of the warm-up.
async fn light_against_hog_at_a_learned_token_limit(redis: Redis<'_>, workers: usize, said: Said) {
    let rate = Rate::after_warm_up(28.5, 3);
    light_against_hog_bound(redis, workers, None, Some(said), rate).await;
}

/// 180,000 output tokens a minute, 100 an answer: 28.5 calls a second with the headroom.
const OUTPUT_LIMIT: Said = Said {
    otpm: Some(180_000),
    ..Said::rpm(100_000)
};

/// 198,000 tokens a minute, 110 a call: 28.5 calls a second with the headroom.
const COMBINED_LIMIT: Said = Said {
    tpm: Some(198_000),
    ..Said::rpm(100_000)
};

/// 30,000 input tokens a minute (47.5 calls of 10 a second with the headroom), the requests
/// (100,000 a minute) not binding.
const INPUT_LIMIT: Said = Said {
    itpm: Some(30_000),
    ..Said::rpm(100_000)
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "long: bash scripts/test --long"]
async fn where_the_learned_output_token_rate_binds_a_tenant_on_one_of_four_workers_gets_its_half() {
    let _turn = crate::support::file_turn(module_path!());
    let server = RedisServer::start();
    light_against_hog_at_a_learned_token_limit(Redis::Node(&server), 4, OUTPUT_LIMIT).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "long: bash scripts/test --long"]
async fn where_the_learned_combined_token_rate_binds_a_tenant_on_one_of_four_workers_gets_its_half()
{
    let _turn = crate::support::file_turn(module_path!());
    let server = RedisServer::start();
    light_against_hog_at_a_learned_token_limit(Redis::Node(&server), 4, COMBINED_LIMIT).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "long: bash scripts/test --long"]
async fn where_the_learned_combined_token_rate_binds_the_cluster_keeps_the_fair_half_too() {
    let _turn = crate::support::file_turn(module_path!());
    let cluster = Redis::Cluster(RedisCluster::shared());
    light_against_hog_at_a_learned_token_limit(cluster, 4, COMBINED_LIMIT).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "long: bash scripts/test --long"]
async fn where_the_learned_combined_token_rate_binds_a_tenant_on_one_of_sixteen_workers_gets_its_half()
 {
    let _turn = crate::support::file_turn(module_path!());
    let server = RedisServer::start();
    light_against_hog_at_a_learned_token_limit(Redis::Node(&server), 16, COMBINED_LIMIT).await;
}

/// The light-against-hog scenario where the learned input-token limit binds (30,000 a
/// minute) and the calls use `input` tokens each against an estimate of 10: the answers'
/// usage corrects the fleet's token rate, so the fleet keeps to the limit in the tokens
/// really used — `per_second` calls a second at 95% of it.
async fn light_against_hog_where_the_estimates_are_off(
    redis: Redis<'_>,
    input: u32,
    per_second: f64,
) {
    let said = Said {
        input,
        ..INPUT_LIMIT
    };
    // A second of the limit's burst (in calls of the tokens used), and the calls whose
    // corrections are not in yet.
    let burst = (per_second * 0.9) as usize + 4;
    let rate = Rate::after_warm_up(per_second, burst);
    light_against_hog_bound(redis, 4, None, Some(said), rate).await;
}

/// Calls using half their estimate: the fleet sends twice the calls the estimates allow
/// (95 a second, not 47.5), where the limit lets it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "long: bash scripts/test --long"]
async fn where_the_estimates_are_twice_the_tokens_used_the_fleets_token_rate_gets_them_back() {
    let _turn = crate::support::file_turn(module_path!());
    let server = RedisServer::start();
    light_against_hog_where_the_estimates_are_off(Redis::Node(&server), 5, 95.0).await;
}

/// Calls using twice their estimate: the fleet sends half the calls the estimates allow
/// (23.75 a second, not 47.5), so the provider's limit holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "long: bash scripts/test --long"]
async fn where_the_estimates_are_half_the_tokens_used_the_fleets_token_rate_charges_the_rest() {
    let _turn = crate::support::file_turn(module_path!());
    let server = RedisServer::start();
    light_against_hog_where_the_estimates_are_off(Redis::Node(&server), 20, 23.75).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "long: bash scripts/test --long"]
async fn where_the_estimates_are_half_the_tokens_used_the_cluster_charges_the_rest_too() {
    let _turn = crate::support::file_turn(module_path!());
    let cluster = Redis::Cluster(RedisCluster::shared());
    light_against_hog_where_the_estimates_are_off(cluster, 20, 23.75).await;
}

/// The learned input-token limit binding, the answers saying an output limit too (as the
/// provider's do), with usage correction off: no average call ever comes to size the
/// output limit, so it stays each worker's (it does not bind here), and the input tokens
/// still go in the fleet's order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "long: bash scripts/test --long"]
async fn without_usage_correction_the_learned_input_token_rate_still_goes_in_the_fleets_order() {
    let _turn = crate::support::file_turn(module_path!());
    let server = RedisServer::start();
    let _serial = SERIAL.lock().await;
    let said = Said {
        otpm: Some(5_000_000),
        ..INPUT_LIMIT
    };
    let redis = Redis::Node(&server);
    let fleet = Fleet::start_tuned(&redis, 4, None, CALL_MS, Some(said), |policy| {
        policy.usage_correction(false)
    })
    .await;
    light_against_hog_paced(fleet, &redis, 4, Rate::kept(47.5, 48)).await;
}

/// The same where the input-token limit binds: the worker whose answers never say the
/// limits (light's) takes the token rate the others name in the wait book.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "long: bash scripts/test --long"]
async fn where_one_worker_never_learns_the_token_limit_its_calls_take_the_rate_the_others_name() {
    let _turn = crate::support::file_turn(module_path!());
    let server = RedisServer::start();
    let _serial = SERIAL.lock().await;
    let said = Said {
        first: 1,
        ..INPUT_LIMIT
    };
    let fleet = Fleet::start_with(&Redis::Node(&server), 4, None, CALL_MS, Some(said)).await;
    fleet.workers[0]
        .clone()
        .oneshot(call_of("light", "pro", Origin::UserAction))
        .await
        .expect("the first call");
    let rate = Rate::after_warm_up(47.5, 48);
    light_against_hog_paced(fleet, &Redis::Node(&server), 4, rate).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn where_the_providers_rate_binds_a_tenant_on_one_of_four_workers_gets_its_half() {
    let _turn = crate::support::file_turn(module_path!());
    let server = RedisServer::start();
    light_against_hog_at_the_rate(Redis::Node(&server), 4).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "long: bash scripts/test --long"]
async fn where_the_providers_rate_binds_in_bursts_of_five_a_tenant_on_one_of_four_gets_its_half() {
    let _turn = crate::support::file_turn(module_path!());
    let server = RedisServer::start();
    light_against_hog_at_the_rate_in_bursts_of(Redis::Node(&server), 4, 5).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "long: bash scripts/test --long"]
async fn where_the_providers_rate_binds_a_tenant_on_one_of_sixteen_workers_gets_its_half() {
    let _turn = crate::support::file_turn(module_path!());
    let server = RedisServer::start();
    light_against_hog_at_the_rate(Redis::Node(&server), 16).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "long: bash scripts/test --long"]
async fn where_the_providers_rate_binds_the_cluster_keeps_the_fair_half_too() {
    let _turn = crate::support::file_turn(module_path!());
    let cluster = RedisCluster::shared();
    light_against_hog_at_the_rate(Redis::Cluster(cluster), 4).await;
}

/// 30,000 input tokens a minute (calls of 10: 50 a second), handed out as a token rate
/// of a second's burst (45 calls, and 100 ms ahead).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "long: bash scripts/test --long"]
async fn where_a_configured_input_token_limit_binds_a_tenant_on_one_of_four_workers_gets_its_half()
{
    let _turn = crate::support::file_turn(module_path!());
    let server = RedisServer::start();
    let pacing = Pacing::new().input_tokens_per_minute(30_000).shared();
    let rate = Rate::kept(50.0, 50);
    light_against_hog_bound(Redis::Node(&server), 4, Some(pacing), None, rate).await;
}

/// 300,000 output tokens a minute at 100 a call expected: 50 calls a second, one at a time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "long: bash scripts/test --long"]
async fn where_a_configured_output_token_limit_binds_a_tenant_on_one_of_four_workers_gets_its_half()
{
    let _turn = crate::support::file_turn(module_path!());
    let server = RedisServer::start();
    let pacing = Pacing::new()
        .output_tokens_per_minute(300_000)
        .expected_output_tokens(100)
        .shared();
    let rate = Rate::kept(50.0, 1);
    light_against_hog_bound(Redis::Node(&server), 4, Some(pacing), None, rate).await;
}

/// Redis killed under the rate-bound light/hog load, then back (a fresh, empty server):
/// meanwhile each worker paces its share of the rate in its own order (the fleet still
/// keeps to the rate), and once Redis is back the rate's cells go in the fleet's order
/// again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "long: bash scripts/test --long"]
async fn the_rate_holds_while_redis_is_away_and_its_order_comes_back() {
    let _turn = crate::support::file_turn(module_path!());
    // Each worker paces a quarter of the rate alone, each starting with its cell free; the
    // fleet's cells taken just before the fault are not known to them: a few calls more.
    redis_away_under(rate_of_50_a_second(), 50 + 4 + 2).await;
}

/// The same where a configured input-token limit binds (30,000 a minute: 50 calls of 10 a
/// second): its tokens go in the fleet's order before and after; meanwhile each worker
/// paces its share of them alone, as in one process, bursting a second of its share at
/// most (a fresh bucket's whole minute would overrun the provider's, which the fleet was
/// spending: 145-216 calls in the 1.5 s before that was fixed, 122-147 in one second).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "long: bash scripts/test --long"]
async fn the_token_rate_holds_while_redis_is_away_and_its_order_comes_back() {
    let _turn = crate::support::file_turn(module_path!());
    let pacing = Pacing::new().input_tokens_per_minute(30_000).shared();
    // The rate and a second of burst, which a fresh Redis's wait book starts with again
    // (94-100 seen at the start), plus what workers still pacing their shares alone send in
    // that second as they find Redis back one by one (a second of the rate between them at
    // most; up to 110 seen in all), and a few.
    redis_away_under(pacing, 50 + 50 + 50 + 10).await;
}

/// Redis killed for 1.5 s under the light/hog load where `pacing` binds (50 calls a
/// second), then back (a fresh, empty server): while it is away the fleet keeps to the rate
/// (and a second of it: each worker's share bursts a second of the share at most), at most
/// `most_allowed` calls start in any second of the run, and once Redis is back the fleet's
/// order holds again (Jain >= 0.99).
async fn redis_away_under(pacing: Pacing, most_allowed: usize) {
    let _serial = SERIAL.lock().await;
    let mut server = RedisServer::start();
    let mut fleet = Fleet::start_paced(&Redis::Node(&server), 4, Some(pacing)).await;
    for w in 0..4 {
        fleet.callers(w, 12, "hog", "pro", Origin::UserAction);
    }
    fleet.callers(0, 12, "light", "pro", Origin::UserAction);
    tokio::time::sleep(WARM_UP).await;
    server.kill();
    let away = Instant::now();
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    server.restart();
    let back = Instant::now();
    tokio::time::sleep(Duration::from_millis(2_000)).await;
    let from = Instant::now();
    tokio::time::sleep(MEASURE).await;
    let outage = fleet.served(away, Duration::from_millis(1_500));
    let served = fleet.served(from, MEASURE);
    let mut starts: Vec<Instant> = fleet.starts().iter().map(|s| s.at).collect();
    starts.sort();
    fleet.stop().await;
    let (light, hog) = (served["light"] as f64, served["hog"] as f64);
    let before_back: Vec<Instant> = starts.iter().copied().filter(|at| *at < back).collect();
    let after_back: Vec<Instant> = starts.iter().copied().filter(|at| *at >= back).collect();
    println!(
        "rate binding, Redis away 1.5 s: {} calls started meanwhile ({outage:?}), the most in \
         any second of the run {} (before Redis was back {}, after {}); once back light \
         {light}, hog {hog}: light's share {:.1}%",
        outage.values().sum::<usize>(),
        most_in_a_second(&starts),
        most_in_a_second(&before_back),
        most_in_a_second(&after_back),
        100.0 * light / (light + hog)
    );
    // (Fewer are served meanwhile than the rate: a worker that held no slot when Redis
    // went away refuses its calls, as the slot caps' outage policy says.)
    let away: usize = outage.values().sum();
    assert!(
        away <= 75 + 50 + 5,
        "{away} calls started in the 1.5 s Redis was away, over the rate's 75 and a second"
    );
    let most = most_in_a_second(&starts);
    assert!(
        most <= most_allowed,
        "{most} calls started in one second, over {most_allowed}"
    );
    assert!(
        jain(&[light, hog]) >= 0.99,
        "light got {:.1}% once Redis was back",
        100.0 * light / (light + hog)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "long: bash scripts/test --long"]
async fn a_tenant_on_one_of_sixteen_workers_gets_its_fair_half() {
    let _turn = crate::support::file_turn(module_path!());
    let server = RedisServer::start();
    light_against_hog(Redis::Node(&server), 16).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "long: bash scripts/test --long"]
async fn a_tenant_on_one_of_four_workers_gets_its_fair_half_on_a_cluster() {
    let _turn = crate::support::file_turn(module_path!());
    let cluster = RedisCluster::shared();
    light_against_hog(Redis::Cluster(cluster), 4).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "long: bash scripts/test --long"]
async fn a_tenant_on_one_of_sixteen_workers_gets_its_fair_half_on_a_cluster() {
    let _turn = crate::support::file_turn(module_path!());
    let cluster = RedisCluster::shared();
    light_against_hog(Redis::Cluster(cluster), 16).await;
}

/// Redis killed under the light/hog load, then back (a fresh, empty server on its port):
/// meanwhile each worker keeps its own order within its share of the caps, and once the
/// workers have put their calls back the fleet's order holds again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "long: bash scripts/test --long"]
async fn the_fleets_order_comes_back_with_redis() {
    let _turn = crate::support::file_turn(module_path!());
    let _serial = SERIAL.lock().await;
    let mut server = RedisServer::start();
    let mut fleet = Fleet::start(&Redis::Node(&server), 4).await;
    for w in 0..4 {
        fleet.callers(w, 12, "hog", "pro", Origin::UserAction);
    }
    fleet.callers(0, 12, "light", "pro", Origin::UserAction);
    tokio::time::sleep(WARM_UP).await;
    let before = fleet.served(Instant::now() - WARM_UP / 2, WARM_UP / 2);
    server.kill();
    let away = Instant::now();
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let outage = fleet.served(away, Duration::from_millis(1_500));
    let per_s = |served: &HashMap<String, usize>, span: Duration| {
        served.values().sum::<usize>() as f64 / span.as_secs_f64()
    };
    let kept = per_s(&outage, Duration::from_millis(1_500)) / per_s(&before, WARM_UP / 2);
    server.restart();
    // Noticed at the next probe, then every worker resyncs.
    tokio::time::sleep(Duration::from_millis(2_000)).await;
    let from = Instant::now();
    tokio::time::sleep(MEASURE).await;
    let served = fleet.served(from, MEASURE);
    fleet.stop().await;
    let share = |served: &HashMap<String, usize>| {
        let light = served.get("light").copied().unwrap_or(0) as f64;
        light / (light + served.get("hog").copied().unwrap_or(0) as f64)
    };
    let index = jain(&[
        served.get("light").copied().unwrap_or(0) as f64,
        served.get("hog").copied().unwrap_or(0) as f64,
    ]);
    println!(
        "light's share: {:.1}% while Redis was away (each worker's own order, {:.0}% of the \
         rate before kept), {:.1}% once it was back ({served:?}), Jain's index {index:.3}",
        share(&outage) * 100.0,
        kept * 100.0,
        share(&served) * 100.0
    );
    // The rate kept is printed, not asserted (77-105% over six runs; 65-78% when the fault
    // was noticed only when an operation failed, 150-190 ms after the kill, once most calls
    // had ended): `a_killed_redis_is_noticed_when_the_subscription_closes` holds the rule.
    // Fair is half each, not more: light far above it means hog's calls lost their place.
    assert!(
        index >= 0.99,
        "light got {:.1}% once Redis was back",
        share(&served) * 100.0
    );
}

/// Redis killed before any worker's first heartbeat, then back (a fresh, empty server),
/// with every slot taken, most of them by workers 1-3. Each worker was told at its start
/// only of those started before it, and learns of the others from its acquires' answers.
/// Without that, worker 0 thinks itself alone and serves the outage from the whole caps
/// beside the others' calls (15 in flight of 8, two runs in three), and a worker that knew
/// fewer than four ends settling before every worker put its calls back (9 or 10, one run
/// in five of `the_fleets_order_comes_back_with_redis`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "long: bash scripts/test --long"]
async fn caps_hold_when_redis_dies_before_the_first_heartbeat() {
    let _turn = crate::support::file_turn(module_path!());
    let _serial = SERIAL.lock().await;
    let mut server = RedisServer::start();
    // Calls long enough to be in flight still when each worker notices the fault.
    let mut fleet = Fleet::start_with(&Redis::Node(&server), 4, None, (400, 100), None).await;
    fleet.callers(0, 12, "light", "pro", Origin::UserAction);
    for w in 1..4 {
        fleet.callers(w, 12, "hog", "pro", Origin::UserAction);
    }
    tokio::time::sleep(Duration::from_millis(600)).await;
    server.kill();
    // A worker's first heartbeat comes a second after its start: none came yet.
    assert!(
        fleet.started.elapsed() < Duration::from_millis(950),
        "the fleet took {:?} to start: a heartbeat may have come before the fault",
        fleet.started.elapsed()
    );
    tokio::time::sleep(Duration::from_millis(700)).await;
    server.restart();
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let served = fleet
        .served(fleet.started, fleet.started.elapsed())
        .values()
        .sum::<usize>();
    let max = fleet.stop().await;
    assert!(
        max == GLOBAL_CAP && served >= 20,
        "the caps were not used: {max} in flight at most, {served} calls"
    );
}

/// Tier pro (weight 3) on worker 0 against tier free (weight 1) on workers 1-3, one free
/// tenant on each, all backlogged: pro gets three calls for each of free's, and free's
/// three tenants share its quarter alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tier_weights_hold_across_the_fleet() {
    let _turn = crate::support::file_turn(module_path!());
    let _serial = SERIAL.lock().await;
    let server = RedisServer::start();
    let fleet = Fleet::start(&Redis::Node(&server), 4).await;
    tier_weights(fleet).await;
}

/// The same where the learned request limit binds (3,000 a minute) instead of the slots:
/// the rate's cells go by the tier weights too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "long: bash scripts/test --long"]
async fn where_the_learned_rate_binds_tier_weights_hold_across_the_fleet() {
    let _turn = crate::support::file_turn(module_path!());
    let _serial = SERIAL.lock().await;
    let server = RedisServer::start();
    let fleet = Fleet::start_said(&Redis::Node(&server), 4, Said::rpm(3_000)).await;
    tier_weights(fleet).await;
}

/// Pro on worker 0, free on workers 1-3, all backlogged, on `fleet`: see
/// `tier_weights_hold_across_the_fleet`.
async fn tier_weights(mut fleet: Fleet) {
    fleet.callers(0, 12, "paying", "pro", Origin::UserAction);
    for w in 1..4 {
        fleet.callers(w, 12, &format!("free-{w}"), "free", Origin::UserAction);
    }
    tokio::time::sleep(WARM_UP).await;
    let from = Instant::now();
    tokio::time::sleep(MEASURE).await;
    let served = fleet.served(from, MEASURE);
    fleet.stop_callers().await;
    let indexes = fleet.fairness_indexes().await;
    // Over the whole run (the fairness window is a minute): served cost over weight.
    let everything = fleet.served(fleet.started, Duration::from_secs(3600));
    fleet.stop().await;
    let normalised: Vec<f64> = everything
        .iter()
        .map(|(tenant, n)| *n as f64 / if tenant == "paying" { 3.0 } else { 1.0 })
        .collect();
    let expected = jain(&normalised);
    println!(
        "fairness index on each worker: {indexes:?}, from the upstream's count: {expected:.3}"
    );
    for index in &indexes {
        let index = index.expect("an index");
        assert!(
            (index - expected).abs() < 0.03,
            "a worker publishes {index:.3}; the fleet's is {expected:.3}"
        );
    }
    let pro = served["paying"] as f64;
    let each_free: Vec<f64> = (1..4)
        .map(|w| served.get(&format!("free-{w}")).copied().unwrap_or(0) as f64)
        .collect();
    let free: f64 = each_free.iter().sum();
    let ratio = pro / free;
    println!("pro {pro}, free {free} calls served ({each_free:?}): {ratio:.2} to 1");
    // A tier's share is its weight's, whatever its number of tenants waiting (three here);
    // inside it, its tenants share alike.
    assert!((2.7..=3.3).contains(&ratio), "pro:free = {ratio:.2}:1");
    assert!(jain(&each_free) >= 0.98, "free's tenants: {each_free:?}");
}

/// Batch calls backlogged on workers 0-2, then user actions on worker 3: the first goes at
/// the next freed slot, and while they wait they get the critical class's share.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn user_actions_on_one_worker_go_before_batch_on_the_others() {
    let _turn = crate::support::file_turn(module_path!());
    user_actions_before_batch(None).await;
}

/// The same where the provider's rate binds: the first user action goes at the next freed
/// cell of the rate, and they get the critical share of the cells.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "long: bash scripts/test --long"]
async fn where_the_rate_binds_user_actions_on_one_worker_go_before_batch_on_the_others() {
    let _turn = crate::support::file_turn(module_path!());
    user_actions_before_batch(Some(rate_of_50_a_second())).await;
}

async fn user_actions_before_batch(pacing: Option<Pacing>) {
    let _serial = SERIAL.lock().await;
    let server = RedisServer::start();
    let mut fleet = Fleet::start_paced(&Redis::Node(&server), 4, pacing).await;
    for w in 0..3 {
        fleet.callers(w, 12, &format!("batch-{w}"), "pro", Origin::BatchJob);
    }
    tokio::time::sleep(WARM_UP).await;
    let mut observer = redis::Client::open(server.url())
        .expect("a client")
        .get_connection()
        .expect("an observer connection");
    fleet.callers(3, 12, "chat", "pro", Origin::UserAction);
    // The user actions arrive when the fleet's order holds them, not when their callers
    // start: on a loaded machine classifying and queueing them takes a few freed slots.
    let deadline = Instant::now() + Duration::from_secs(10);
    let arrived = loop {
        assert!(Instant::now() < deadline, "the user actions never queued");
        let queued: Vec<String> = redis::cmd("KEYS")
            .arg("*:fw:0|chat")
            .query(&mut observer)
            .expect("KEYS");
        if !queued.is_empty() {
            break Instant::now();
        }
        std::thread::sleep(Duration::from_millis(1));
    };
    tokio::time::sleep(MEASURE).await;
    let starts = fleet.starts();
    fleet.stop().await;
    let after: Vec<&Start> = starts.iter().filter(|s| s.at >= arrived).collect();
    let before_first = after.iter().take_while(|s| s.tenant != "chat").count();
    let chat = after.iter().filter(|s| s.tenant == "chat").count();
    let share = chat as f64 / after.len() as f64;
    println!(
        "{before_first} batch calls started before the first user action; user actions \
         {chat} of {} dispatches ({:.1}%)",
        after.len(),
        share * 100.0
    );
    // Slots granted before the first user action queued may still start after it: a slot
    // frees every 5 ms, and on a loaded two-core machine a grant takes up to ~15 ms to reach
    // the upstream.
    assert!(before_first <= 3, "{before_first} batch calls went first");
    assert!(share >= 0.9, "user actions got {:.1}%", share * 100.0);
}

/// A heavier tier that starts waiting beside a lighter one no release has served yet goes
/// at the next freed slot: both start at the virtual time, and on a tie the heavier goes
/// first (as listed, the lighter tier, queued first, went first).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_heavier_tier_that_starts_waiting_beside_a_lighter_one_goes_at_the_next_freed_slot() {
    let _turn = crate::support::file_turn(module_path!());
    let _serial = SERIAL.lock().await;
    let server = RedisServer::start();
    // Calls of 300-400 ms: the 8 slots are taken by the free flood's first calls at once,
    // the rest queue, no release comes before pro queues, and the releases come apart.
    let mut fleet = Fleet::start_with(&Redis::Node(&server), 3, None, (300, 100), None).await;
    // Slow start over first (one call through each worker): it would hold the flood behind
    // its probe, and then let everything go at once.
    for worker in &fleet.workers {
        let req = call_of("warm-up", "premium", Origin::UserAction);
        worker.clone().oneshot(req).await.expect("the warm-up call");
    }
    let warmed = Instant::now();
    for w in 0..2 {
        fleet.callers(w, 8, "flood", "free", Origin::UserAction);
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    let req = call_of("pro-one", "pro", Origin::UserAction);
    let sent = Instant::now();
    fleet.workers[2]
        .clone()
        .oneshot(req)
        .await
        .expect("the pro call is served");
    let starts = fleet.starts();
    fleet.stop().await;
    let before = starts
        .iter()
        .filter(|s| s.at >= warmed && s.at < sent)
        .count();
    assert_eq!(before, 8, "the flood's first calls took every slot");
    let after: Vec<&str> = starts
        .iter()
        .filter(|s| s.at >= sent)
        .map(|s| s.tenant.as_str())
        .take(3)
        .collect();
    println!("the calls that started after pro's was sent: {after:?}");
    assert_eq!(after.first(), Some(&"pro-one"), "{after:?}");
}

/// Workers 0-11 backlogged with one tenant's calls; a newcomer's one call on worker 12
/// (queued nowhere before) goes at the next freed slot of the fleet, not behind the twelve
/// queued workers. Calls whose wake-up was on its way when it queued, or that start while
/// its own wake-up and acquire are on their way, may start first: three at most.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_newcomer_on_an_idle_worker_goes_at_the_next_freed_slot() {
    let _turn = crate::support::file_turn(module_path!());
    let _serial = SERIAL.lock().await;
    let server = RedisServer::start();
    let mut fleet = Fleet::start(&Redis::Node(&server), 13).await;
    for w in 0..12 {
        fleet.callers(w, 12, "hog", "pro", Origin::UserAction);
    }
    tokio::time::sleep(WARM_UP).await;
    let mut observer = redis::Client::open(server.url())
        .expect("a client")
        .get_connection()
        .expect("an observer connection");
    let (mut waits, mut sent_waits) = (Vec::new(), Vec::new());
    for round in 0..5 {
        // The fleet is backlogged: the hog waits in the fleet's queue as the newcomer comes.
        let hog_waits: Vec<String> = redis::cmd("KEYS")
            .arg("*:fw:0|hog")
            .query(&mut observer)
            .expect("KEYS");
        assert!(
            !hog_waits.is_empty(),
            "round {round}: the hog waits in the fleet"
        );
        let tenant = format!("new-{round}");
        let req = call_of(&tenant, "pro", Origin::UserAction);
        let sent = Instant::now();
        let call = tokio::spawn(fleet.workers[12].clone().oneshot(req));
        // The newcomer arrives when the fleet's order holds it (an observer sees its flow
        // queued), not when its caller sends: on a loaded machine the refused acquire that
        // queues it takes a few freed slots. Served before it was ever seen queued, it went
        // at once.
        let pattern = format!("*:fw:0|{tenant}");
        let queued_at = loop {
            let queued: Vec<String> = redis::cmd("KEYS")
                .arg(&pattern)
                .query(&mut observer)
                .expect("KEYS");
            if !queued.is_empty() || call.is_finished() {
                break (!queued.is_empty()).then(Instant::now);
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        };
        call.await.expect("joined").expect("served");
        let starts = fleet.starts();
        let ahead = queued_at.map(|at| {
            starts
                .iter()
                .filter(|s| s.at >= at)
                .take_while(|s| s.tenant != tenant)
                .count()
        });
        let from_sent = starts
            .iter()
            .filter(|s| s.at >= sent)
            .take_while(|s| s.tenant != tenant)
            .count();
        sent_waits.push(from_sent);
        waits.push(ahead);
    }
    fleet.stop().await;
    println!(
        "calls started before each newcomer's: from when it was seen queued {waits:?} (None: \
         served before it was seen), from when it was sent {sent_waits:?}"
    );
    // Without the fleet's order 12-15 calls went first (the other workers' turns). Slots
    // granted before the newcomer queued may still start after it (a slot frees every 5 ms,
    // and with 13 workers and 156 callers on two cores a grant now and then takes tens of
    // ms to reach the upstream): most newcomers go within two calls, none behind the other
    // workers' turns. One served before it was seen queued went ahead of the waiting hog
    // (on a loaded machine the observer's polls are far apart; without the fleet's order a
    // newcomer waits 60 ms or more, in plain sight).
    let calls_ahead: Vec<usize> = waits.iter().map(|n| n.unwrap_or(0)).collect();
    assert!(calls_ahead.iter().all(|&n| n <= 8), "{waits:?}");
    let soon = calls_ahead.iter().filter(|&&n| n <= 2).count();
    assert!(2 * soon > calls_ahead.len(), "{waits:?}");
}

/// The light-against-hog scenario where the learned rate binds, and one answer is a 429
/// saying `retry-after-ms: 5000`: every worker holds its calls until the gate reopens, and
/// then the rate's cells go in the fleet's order again from the reopening on — not first
/// to the workers that happened to draw an early release (each worker's own point of a
/// window of a fifth of the delay after the reopening: light got 31.2% and 33.3% of the
/// 2 s after it, two runs; 28.6-48.9% of the first 1.5 s, four runs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "long: bash scripts/test --long"]
async fn after_a_429s_cooldown_the_fleets_order_resumes_at_the_reopening() {
    let _turn = crate::support::file_turn(module_path!());
    let server = RedisServer::start();
    reopening_after_a_429(Redis::Node(&server)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "long: bash scripts/test --long"]
async fn after_a_429s_cooldown_the_fleets_order_resumes_at_the_reopening_on_a_cluster() {
    let _turn = crate::support::file_turn(module_path!());
    reopening_after_a_429(Redis::Cluster(RedisCluster::shared())).await;
}

/// The scenario of `after_a_429s_cooldown_the_fleets_order_resumes_at_the_reopening` on
/// `redis`.
async fn reopening_after_a_429(redis: Redis<'_>) {
    const RETRY_AFTER: Duration = Duration::from_millis(5_000);
    let _serial = SERIAL.lock().await;
    let mut fleet = Fleet::start_said(&redis, 4, Said::rpm(3_000)).await;
    for w in 0..4 {
        fleet.callers(w, 12, "hog", "pro", Origin::UserAction);
    }
    fleet.callers(0, 12, "light", "pro", Origin::UserAction);
    tokio::time::sleep(WARM_UP).await;
    fleet.upstream.lock().unwrap().throttle_next = Some(RETRY_AFTER.as_millis() as u64);
    let throttled_at = loop {
        if let Some(at) = fleet.upstream.lock().unwrap().throttled_at {
            break at;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    let reopen = throttled_at + RETRY_AFTER;
    let window = Duration::from_millis(2_000);
    tokio::time::sleep_until((reopen + window).into()).await;
    // From a moment after the 429's answer (calls already on their way went on, and the
    // other workers hear of the gate through pub/sub) to a moment before the reopening
    // (the local copies of the gate may differ by a few ms).
    let heard = throttled_at + Duration::from_millis(250);
    let closed = fleet.served(heard, RETRY_AFTER - Duration::from_millis(300));
    let after = fleet.served(reopen, window);
    // From when every worker has heard of the gate: a call already on its way at the 429
    // is not one of the reopening's (counted as one, it read as a herd at offset 0).
    let all = fleet.starts();
    let on_their_way = all
        .iter()
        .filter(|s| (throttled_at..heard).contains(&s.at))
        .count();
    let mut starts: Vec<Instant> = all.iter().map(|s| s.at).filter(|at| *at >= heard).collect();
    starts.sort();
    fleet.stop().await;
    // Signed: a call started before the reopening shows as negative.
    let first: Vec<i64> = starts
        .iter()
        .take(8)
        .map(|at| match at.checked_duration_since(reopen) {
            Some(after) => after.as_millis() as i64,
            None => -(reopen.duration_since(*at).as_millis() as i64),
        })
        .collect();
    let light = after.get("light").copied().unwrap_or(0) as f64;
    let hog = after.get("hog").copied().unwrap_or(0) as f64;
    println!(
        "429 with a 5 s retry-after under the learned rate, 4 workers: {on_their_way} calls \
         on their way at the 429, {} started while the gate was closed; the first after it at \
         {first:?} ms from the reopening, the most \
         in a second {}; in the {window:?} from the reopening light {light}, hog {hog}: \
         light's share {:.1}%",
        closed.values().sum::<usize>(),
        most_in_a_second(&starts),
        100.0 * light / (light + hog)
    );
    assert!(
        closed.is_empty(),
        "calls went while the gate was closed: {closed:?}"
    );
    // No herd at the reopening: the cells pace it (5 of them, each taken for 100 ms).
    let herd = first.iter().filter(|&&ms| ms < 100).count();
    assert!(herd <= 5 + 1, "{herd} calls in the first 100 ms: {first:?}");
    let most = most_in_a_second(&starts);
    assert!(most <= 48 + 5 + 1, "{most} calls started in one second");
    assert!(
        light + hog >= 0.8 * 47.5 * window.as_secs_f64(),
        "the rate was not used after the reopening: {}",
        light + hog
    );
    // 46.3-49.5% in seven runs (the 5 cells of the reopening and the retry of the throttled
    // call make the first 2 s less even than a steady state); 31-33% without.
    let share = light / (light + hog);
    assert!(
        share >= 0.43,
        "light got {:.1}% of the calls after the reopening",
        share * 100.0
    );
}

/// Slow start across the fleet: four workers start cold together under the
/// light-against-hog load, the upstream saying its limit in every answer; one call goes for
/// the whole fleet (the store's probe lease) and the rest wait for its answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cold_fleet_sends_one_call_until_the_first_answer() {
    let _turn = crate::support::file_turn(module_path!());
    let server = RedisServer::start();
    let _serial = SERIAL.lock().await;
    let mut fleet = Fleet::start_said(&Redis::Node(&server), 4, Said::rpm(3_000)).await;
    for w in 0..4 {
        fleet.callers(w, 12, "hog", "pro", Origin::UserAction);
    }
    fleet.callers(0, 12, "light", "pro", Origin::UserAction);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (first_answer, before) = {
        let up = fleet.upstream.lock().unwrap();
        let first = up.first_answer.expect("an answer within 500 ms");
        (first, up.starts.iter().filter(|s| s.at < first).count())
    };
    let starts = fleet.starts();
    fleet.stop().await;
    let after: Vec<u128> = starts
        .iter()
        .filter(|s| s.at >= first_answer)
        .take(6)
        .map(|s| s.at.duration_since(first_answer).as_millis())
        .collect();
    println!(
        "cold fleet of 4: {before} call(s) started before the first answer; the next at \
         {after:?} ms after it"
    );
    assert_eq!(before, 1, "calls started before the first answer");
}
