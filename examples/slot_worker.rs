//! One worker process of the multi-process slot tests (`tests/redis/tier_slot_limit_redis.rs`):
//! many callers sharing one Redis budget through `TierSlotLimit`.
//!
//! ```sh
//! cargo run --features redis --example slot_worker -- load redis://127.0.0.1:6379/ 50 20
//! cargo run --features redis --example slot_worker -- hold redis://127.0.0.1:6379/ 10
//! ```
//!
//! `load URL CALLERS CALLS [PROBE_URL]`: each caller makes CALLS calls; the upstream
//! stand-in counts the calls in flight in Redis (`probe:*` keys: now and the maximum seen,
//! globally and per tier) for 5 ms each, on the Redis at PROBE_URL (default: URL, which must
//! then be one node). Prints `ok=N busy=N failed=N`.
//!
//! `hold URL N`: takes N slots, prints `HOLDING`, and holds them until killed.
//!
//! `hold-tenant URL N`: as `hold`, for tenant `capped` in tier `pro`, under the same caps
//! plus a cap of N `pro` slots per tenant (`tests/redis/tenant_caps_redis.rs`).
//!
//! `faults URL OBSERVER CALLERS MILLIS [EXPECTED_WORKERS]` (the fault suite,
//! `tests/fleet/faults.rs`): prints `READY` once its store is built (Redis may be down), then each
//! caller makes calls for MILLIS ms under global cap 8 (tiers 8/6/4/2), through the whole
//! recommended stack (`FairgateLayer`: the fair queue takes the slots). Every call counts
//! itself in flight on a second Redis, the OBSERVER, for its whole duration (5-49 ms, and
//! 400 ms for every 7th, a streamed answer): the current count, the maximum, and the time
//! spent over each cap, globally and per tier (`obs:*` keys). Prints
//! `ok=N store=N busy=N failed=N` (`store`: answered `Busy` at once because Redis was away,
//! after which the caller waits 20 ms; `busy`: any other `Busy`).
//!
//! `outage URL OBSERVER CALLERS MILLIS` (the outage suite, `tests/fleet/faults.rs`): the
//! gateway's caps and max waits scaled by 1/10 with its lease (global 30; premium 30 / 6 s,
//! pro 20 / 4.5 s, free 15 / 1.2 s, guest 5 / 0.8 s; lease TTL 3 s, or
//! `--lease-ttl-ms=N`), so a call can get `Busy` before a lease expires, through the whole
//! recommended stack and the store's defaults. Each caller draws each call's tier
//! (premium:pro:free:guest = 60:40:30:20) and its length (100 ms +/- 30%, or
//! `--call-ms=N` +/- 30%; `--wait-scale=1`: the gateway's max waits unscaled); a caller
//! answered `Busy` tries again 100 ms later, as a client whose retry goes to another
//! worker. The observer counts calls in flight as in `faults`, and calls completed per
//! 100 ms of its clock (`obs:done:<n>`). Prints `READY`, then `ok=N busy=N failed=N`, then
//! `busy store=N (max M ms) slot=N (max M ms) other=N`. `--after-outage=refuse|share`: the
//! store's [`OutagePolicy`](fairgate::OutagePolicy). `--probe-at=MS` (with 0 callers): an
//! idle worker that, MS ms after `READY`, sends one call of each tier at once and prints
//! `probe TIER ok|busy:REASON MS` for each, then stays idle until MILLIS have passed.
//!
//! `fleet URL OBSERVER MILLIS SPEC...` (the fleet's fair order counted from outside,
//! `tests/fleet/processes.rs`): the whole recommended stack (`FairgateLayer`, window 8) under
//! global cap 8 with tier caps of 8 that never bind, so the fleet's fair order alone decides
//! who gets a freed slot. Each SPEC, `CALLERS:TENANT:TIER:ORIGIN` (origin `user`, `scheduled`
//! or `batch`), runs CALLERS callers sending that tenant's calls (each estimated at 100
//! tokens, below the daily budget that would demote it) one after another for MILLIS ms.
//! A call lasts 30-50 ms at the upstream stand-in, which counts it on the OBSERVER: in flight
//! now and the maximum (`obs:now`, `obs:max`), in flight from this process (`obs:now:<pid>`,
//! so a test that kills it can take its calls back out), and its start as
//! `<ms on the observer's clock>:<tenant>` appended to `obs:starts`. Prints `READY` once its
//! store is built, then `ok=N busy=N failed=N`. `--lease-ttl-ms=N`: the lease TTL (default 30 s).
//! `--rpm=N`: a shared pacing of N requests a minute (burst 1), the provider's rate the
//! fleet orders with its slots. `--learned-rpm=N`: the upstream stand-in's answers say its
//! request limit is N a minute (`anthropic-ratelimit-requests-*`), so learned pacing learns
//! it and the fleet orders its cells.
//!
//! `--cluster` (anywhere; any mode): URL is a comma-separated list of a Redis
//! Cluster's node URLs, and the store is built with `redis_cluster`. `--slots-only`
//! (`faults`): TierSlotLimit alone instead of the whole recommended stack.
//! `--key-prefix=P` (any mode): the store's key prefix, so several tests can share one Redis.
//!
//! The caps (global 12; premium 8, pro 6, free 4, guest 2) and the lease TTL (2 s) are those
//! the tests check against (`faults`: global 8).

use std::convert::Infallible;
use std::time::Duration;

use fairgate::rate::Pacing;
use fairgate::{
    BackoffPolicy, BoxError, Busy, FairgateLayer, Job, Origin, OutagePolicy, SlotPolicy, Store,
    TierSlotLimitLayer, WaitReason,
};
use tower::{Layer, ServiceExt, service_fn};

const TIERS: [&str; 4] = ["premium", "pro", "free", "guest"];

fn policy() -> SlotPolicy {
    let wait = Duration::from_secs(120);
    SlotPolicy::builder()
        .global_max(12)
        .tier("premium", 8, wait)
        .tier("pro", 6, wait)
        .tier("free", 4, wait)
        .tier("guest", 2, wait)
        .lease_ttl(Duration::from_secs(2))
        .build()
        .expect("a valid policy")
}

/// Counts a call in flight, keeps the maximum, and returns the new count (atomic in Redis).
const ENTER: &str = r"
local now = redis.call('INCR', KEYS[1])
if now > tonumber(redis.call('GET', KEYS[2]) or '0') then redis.call('SET', KEYS[2], now) end
return now";

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let cluster = args.iter().any(|a| a == "--cluster");
    let slots_only = args.iter().any(|a| a == "--slots-only");
    let builder = match args.iter().find_map(|a| a.strip_prefix("--key-prefix=")) {
        Some(prefix) => Store::builder().key_prefix(prefix),
        None => Store::builder(),
    };
    args.retain(|a| !a.starts_with("--"));
    let (mode, url) = match args.as_slice() {
        [mode, url, ..] => (mode.as_str(), url.as_str()),
        _ => {
            return Err(
                "usage: slot_worker load URL CALLERS CALLS [PROBE_URL] | hold URL N \
                 | hold-tenant URL N | faults URL OBSERVER CALLERS MILLIS [EXPECTED_WORKERS] \
                 | outage URL OBSERVER CALLERS MILLIS | fleet URL OBSERVER MILLIS SPEC..."
                    .into(),
            );
        }
    };
    let number =
        |i: usize| -> Result<usize, BoxError> { Ok(args.get(i).ok_or("missing number")?.parse()?) };
    if mode == "outage" {
        let observer = args.get(2).ok_or("missing observer url")?;
        let flag =
            |name: &str| std::env::args().find_map(|a| a.strip_prefix(name).map(str::to_owned));
        let ttl = flag("--lease-ttl-ms=").map_or(Ok(3_000), |v| v.parse())?;
        let builder = match flag("--after-outage=").as_deref() {
            Some("refuse") => builder.after_outage(OutagePolicy::Refuse),
            Some("share") | None => builder.after_outage(OutagePolicy::Share),
            Some(other) => return Err(format!("unknown outage policy {other}").into()),
        };
        let probe_at = flag("--probe-at=").map(|v| v.parse()).transpose()?;
        let run = Outage {
            callers: number(3)?,
            millis: number(4)?,
            lease_ttl: Duration::from_millis(ttl),
            probe_at: probe_at.map(Duration::from_millis),
            call_ms: flag("--call-ms=").map_or(Ok(100), |v| v.parse())?,
            wait_scale: flag("--wait-scale=").map_or(Ok(10), |v| v.parse())?,
        };
        return outage(builder, url, observer, run).await;
    }
    if mode == "fleet" {
        let observer = args.get(2).ok_or("missing observer url")?;
        let millis = number(3)?;
        let specs = args
            .iter()
            .skip(4)
            .map(|spec| Spec::parse(spec))
            .collect::<Result<Vec<_>, _>>()?;
        let lease_ttl = std::env::args()
            .find_map(|a| a.strip_prefix("--lease-ttl-ms=").map(str::to_owned))
            .map(|v| v.parse().map(Duration::from_millis))
            .transpose()?;
        let number = |flag: &str| {
            std::env::args()
                .find_map(|a| a.strip_prefix(flag).map(str::parse::<u32>))
                .transpose()
        };
        let (rpm, learned_rpm) = (number("--rpm=")?, number("--learned-rpm=")?);
        let store = build(builder, url, cluster).await?;
        let limits = FleetLimits {
            lease_ttl,
            rpm,
            learned_rpm,
        };
        return fleet(store, observer, millis, limits, specs).await;
    }
    if mode == "faults" {
        let observer = args.get(2).ok_or("missing observer url")?;
        let builder = match args.get(5) {
            Some(n) => builder.expected_workers(n.parse()?),
            None => builder,
        };
        let (callers, millis) = (number(3)?, number(4)?);
        return faults(builder, url, cluster, slots_only, observer, callers, millis).await;
    }
    let store = build(
        builder.flush_interval(Duration::from_millis(50)),
        url,
        cluster,
    )
    .await?;
    match mode {
        "load" => {
            let probe = args.get(4).map_or(url, String::as_str);
            load(store, probe, number(2)?, number(3)?).await
        }
        "hold" => hold(store, number(2)?).await,
        "hold-tenant" => hold_tenant(store, number(2)?).await,
        _ => Err(format!("unknown mode {mode}").into()),
    }
}

/// A store on the Redis at `url`, or on the cluster whose node URLs `url` lists.
async fn build(
    builder: fairgate::StoreBuilder,
    url: &str,
    cluster: bool,
) -> Result<Store, BoxError> {
    Ok(if cluster {
        builder.redis_cluster(url.split(',')).await?
    } else {
        builder.redis(url).await?
    })
}

async fn load(store: Store, probe: &str, callers: usize, calls: usize) -> Result<(), BoxError> {
    let probe = redis::Client::open(probe)?
        .get_multiplexed_async_connection()
        .await?;
    let enter = redis::Script::new(ENTER);
    let upstream = service_fn(move |req: http::Request<()>| {
        let (mut probe, enter) = (probe.clone(), enter.clone());
        let tier = req.extensions().get::<Job>().and_then(Job::tier);
        let tier = tier.map_or("guest", |t| t.as_str()).to_owned();
        async move {
            let (now, tier_now) = ("probe:now".to_owned(), format!("probe:now:{tier}"));
            let _: u32 = enter
                .key(&now)
                .key("probe:max")
                .invoke_async(&mut probe)
                .await?;
            let tier_max = format!("probe:max:{tier}");
            let _: u32 = enter
                .key(&tier_now)
                .key(tier_max)
                .invoke_async(&mut probe)
                .await?;
            tokio::time::sleep(Duration::from_millis(5)).await;
            let _: i64 = redis::cmd("DECR").arg(&now).query_async(&mut probe).await?;
            let _: i64 = redis::cmd("DECR")
                .arg(&tier_now)
                .query_async(&mut probe)
                .await?;
            Ok::<_, redis::RedisError>(http::Response::new(()))
        }
    });
    let service = TierSlotLimitLayer::new(store, policy()).layer(upstream);
    let tasks = (0..callers).map(|caller| {
        let service = service.clone();
        tokio::spawn(async move {
            let (mut ok, mut busy, mut failed) = (0, 0, 0);
            for call in 0..calls {
                let tier = TIERS[(caller + call) % TIERS.len()];
                let mut req = http::Request::new(());
                req.extensions_mut().insert(
                    Job::new(format!("tenant-{caller}"), Origin::UserAction).with_tier(tier),
                );
                match service.clone().oneshot(req).await {
                    Ok(response) => {
                        drop(response);
                        ok += 1;
                    }
                    Err(e) if e.is::<Busy>() => busy += 1,
                    Err(e) => {
                        eprintln!("call failed: {e}");
                        failed += 1;
                    }
                }
            }
            (ok, busy, failed)
        })
    });
    let (mut ok, mut busy, mut failed) = (0, 0, 0);
    for task in futures_util::future::join_all(tasks).await {
        let (o, b, f) = task?;
        (ok, busy, failed) = (ok + o, busy + b, failed + f);
    }
    println!("ok={ok} busy={busy} failed={failed}");
    Ok(())
}

async fn hold(store: Store, slots: usize) -> Result<(), BoxError> {
    let upstream =
        service_fn(|_: http::Request<()>| async { Ok::<_, Infallible>(http::Response::new(())) });
    let service = TierSlotLimitLayer::new(store, policy()).layer(upstream);
    let mut held = Vec::new();
    for i in 0..slots {
        let mut req = http::Request::new(());
        let tier = TIERS[i % 2]; // premium and pro: 10 fit under their caps
        req.extensions_mut()
            .insert(Job::new("holder", Origin::UserAction).with_tier(tier));
        held.push(service.clone().oneshot(req).await?);
    }
    println!("HOLDING");
    tokio::time::sleep(Duration::from_secs(3600)).await;
    drop(held);
    Ok(())
}

async fn hold_tenant(store: Store, slots: usize) -> Result<(), BoxError> {
    let cap = u32::try_from(slots)?;
    let wait = Duration::from_secs(120);
    let policy = SlotPolicy::builder()
        .global_max(12)
        .tier("premium", 8, wait)
        .tier("pro", 6, wait)
        .tier("free", 4, wait)
        .tier("guest", 2, wait)
        .tenant_cap("pro", cap)
        .lease_ttl(Duration::from_secs(2))
        .build()?;
    let upstream =
        service_fn(|_: http::Request<()>| async { Ok::<_, Infallible>(http::Response::new(())) });
    let service = TierSlotLimitLayer::new(store, policy).layer(upstream);
    let mut held = Vec::new();
    for _ in 0..slots {
        let mut req = http::Request::new(());
        req.extensions_mut()
            .insert(Job::new("capped", Origin::UserAction).with_tier("pro"));
        held.push(service.clone().oneshot(req).await?);
    }
    println!("HOLDING");
    tokio::time::sleep(Duration::from_secs(3600)).await;
    drop(held);
    Ok(())
}

/// The fault suite's caps: global 8, tiers 8/6/4/2, a 2 s lease.
fn fault_policy() -> SlotPolicy {
    let wait = Duration::from_secs(120);
    SlotPolicy::builder()
        .global_max(FAULT_GLOBAL)
        .tier("premium", 8, wait)
        .tier("pro", 6, wait)
        .tier("free", 4, wait)
        .tier("guest", 2, wait)
        .lease_ttl(Duration::from_secs(2))
        .build()
        .expect("a valid policy")
}

const FAULT_GLOBAL: u32 = 8;

/// Moves the in-flight counts (global `KEYS[1..4]`, tier `KEYS[5..8]`: now, max, over since,
/// ms over) by `ARGV[1]` against the caps `ARGV[2]` (global) and `ARGV[3]` (tier), on the
/// observer's clock; a call that ends (`-1`) is counted done in its 100 ms.
const OBSERVE: &str = r"
local t = redis.call('TIME')
local ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if tonumber(ARGV[1]) < 0 then
  redis.call('INCR', 'obs:done:' .. math.floor(ms / 100))
end
local function move(base, cap)
  local now = redis.call('INCRBY', KEYS[base], ARGV[1])
  if now > tonumber(redis.call('GET', KEYS[base + 1]) or '0') then
    redis.call('SET', KEYS[base + 1], now)
  end
  local since = redis.call('GET', KEYS[base + 2])
  if now > cap then
    if not since then redis.call('SET', KEYS[base + 2], ms) end
  elseif since then
    redis.call('INCRBY', KEYS[base + 3], ms - tonumber(since))
    redis.call('DEL', KEYS[base + 2])
  end
end
move(1, tonumber(ARGV[2]))
move(5, tonumber(ARGV[3]))
return 1";

async fn faults(
    builder: fairgate::StoreBuilder,
    url: &str,
    cluster: bool,
    slots_only: bool,
    observer: &str,
    callers: usize,
    millis: usize,
) -> Result<(), BoxError> {
    let builder = builder
        .op_timeout(Duration::from_millis(100))
        .probe_interval(Duration::from_millis(25))
        .flush_interval(Duration::from_millis(25));
    let store = build(builder, url, cluster).await?;
    let probe = redis::Client::open(observer)?
        .get_multiplexed_async_connection()
        .await?;
    println!("READY");
    let policy = fault_policy();
    let observe = redis::Script::new(OBSERVE);
    let tier_caps: std::collections::HashMap<&'static str, u32> = TIERS
        .iter()
        .map(|&t| (t, policy.limit(Some(&t.into())).1.cap))
        .collect();
    let upstream = service_fn(move |req: http::Request<()>| {
        let (mut probe, observe) = (probe.clone(), observe.clone());
        let tier = req.extensions().get::<Job>().and_then(Job::tier);
        let tier = tier.map_or("guest", |t| t.as_str()).to_owned();
        let cap = tier_caps.get(tier.as_str()).copied().unwrap_or(0);
        let hold = req
            .extensions()
            .get::<Duration>()
            .copied()
            .unwrap_or_default();
        async move {
            let keys = |part: &str| {
                [
                    format!("obs:now{part}"),
                    format!("obs:max{part}"),
                    format!("obs:since{part}"),
                    format!("obs:over_ms{part}"),
                ]
            };
            let (global, tier) = (keys(""), keys(&format!(":{tier}")));
            let call = |delta: i32| {
                let mut call = observe.prepare_invoke();
                call.key(&global[..])
                    .key(&tier[..])
                    .arg(delta)
                    .arg(FAULT_GLOBAL)
                    .arg(cap);
                call
            };
            let _: u32 = call(1).invoke_async(&mut probe).await?;
            tokio::time::sleep(hold).await;
            let _: u32 = call(-1).invoke_async(&mut probe).await?;
            Ok::<_, redis::RedisError>(http::Response::new(String::new()))
        }
    });
    // The recommended stack, as a deployment runs it: the fair queue takes each call's slot
    // when it dispatches it (a spawned acquire on Redis), the slot layer lets it through.
    // `--slots-only`: TierSlotLimit alone takes and waits for the slots.
    let service = if slots_only {
        let slots = TierSlotLimitLayer::new(store, policy).layer(upstream);
        tower::util::BoxCloneService::new(slots.map_response(drop))
    } else {
        let stack = FairgateLayer::builder(store)
            .slots(policy)
            .window(64)
            .build()?
            .layer(upstream);
        tower::util::BoxCloneService::new(stack.map_response(drop))
    };
    let until = tokio::time::Instant::now() + Duration::from_millis(millis as u64);
    let tasks = (0..callers).map(|caller| {
        let service = service.clone();
        tokio::spawn(async move {
            let (mut ok, mut store, mut busy, mut failed) = (0, 0, 0, 0);
            let mut call = 0;
            while tokio::time::Instant::now() < until {
                let tier = TIERS[(caller + call) % TIERS.len()];
                // Mostly short calls; every 7th is a streamed answer that outlasts a
                // Redis operation timeout several times over.
                let hold = if (caller + call) % 7 == 0 {
                    Duration::from_millis(400)
                } else {
                    Duration::from_millis(5 + ((caller * 7 + call * 13) % 45) as u64)
                };
                let mut req = http::Request::new(());
                req.extensions_mut().insert(
                    Job::new(format!("tenant-{caller}"), Origin::UserAction).with_tier(tier),
                );
                req.extensions_mut().insert(hold);
                // The response (and the slot it holds) is dropped when the call returns.
                match service.clone().oneshot(req).await {
                    Ok(()) => ok += 1,
                    // Refused at once while Redis is away: a client tries again shortly.
                    Err(e)
                        if e.downcast_ref::<Busy>()
                            .is_some_and(|b| b.reason() == WaitReason::Store) =>
                    {
                        store += 1;
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                    Err(e) if e.is::<Busy>() => busy += 1,
                    Err(e) => {
                        eprintln!("call failed: {e}");
                        failed += 1;
                    }
                }
                call += 1;
            }
            (ok, store, busy, failed)
        })
    });
    let (mut ok, mut store, mut busy, mut failed) = (0, 0, 0, 0);
    for task in futures_util::future::join_all(tasks).await {
        let (o, r, b, f) = task?;
        (ok, store, busy, failed) = (ok + o, store + r, busy + b, failed + f);
    }
    println!("ok={ok} store={store} busy={busy} failed={failed}");
    Ok(())
}

/// The outage suite's run: `callers` callers for `millis` ms (or, with `probe_at`, one call
/// of each tier at that time), on a lease of `lease_ttl`.
struct Outage {
    callers: usize,
    millis: usize,
    lease_ttl: Duration,
    probe_at: Option<Duration>,
    /// The mean call length.
    call_ms: u64,
    /// The gateway's max waits divided by this.
    wait_scale: u64,
}

/// The gateway's caps, its max waits divided by `wait_scale`, and the lease TTL given.
fn outage_policy(lease_ttl: Duration, wait_scale: u64) -> SlotPolicy {
    let ms = |n: u64| Duration::from_millis(n * 10 / wait_scale.max(1));
    SlotPolicy::builder()
        .global_max(OUTAGE_GLOBAL)
        .tier("premium", 30, ms(6_000))
        .tier("pro", 20, ms(4_500))
        .tier("free", 15, ms(1_200))
        .tier("guest", 5, ms(800))
        .lease_ttl(lease_ttl)
        .build()
        .expect("a valid policy")
}

const OUTAGE_GLOBAL: u32 = 30;

/// A tier drawn premium:pro:free:guest = 60:40:30:20 from `x`, and a call length of
/// `call_ms` +/- 30%, from a small LCG.
fn draw(x: &mut u64, call_ms: u64) -> (&'static str, Duration) {
    let mut next = || {
        *x = x
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        *x >> 33
    };
    let tier = match next() % 150 {
        0..60 => "premium",
        60..100 => "pro",
        100..130 => "free",
        _ => "guest",
    };
    let spread = call_ms * 3 / 5 + 1;
    (
        tier,
        Duration::from_millis(call_ms * 7 / 10 + next() % spread),
    )
}

async fn outage(
    builder: fairgate::StoreBuilder,
    url: &str,
    observer: &str,
    run: Outage,
) -> Result<(), BoxError> {
    let store = builder.redis(url).await?;
    let probe = redis::Client::open(observer)?
        .get_multiplexed_async_connection()
        .await?;
    println!("READY");
    let ready = tokio::time::Instant::now();
    let policy = outage_policy(run.lease_ttl, run.wait_scale);
    let observe = redis::Script::new(OBSERVE);
    let tier_caps: std::collections::HashMap<&'static str, u32> = TIERS
        .iter()
        .map(|&t| (t, policy.limit(Some(&t.into())).1.cap))
        .collect();
    let upstream = service_fn(move |req: http::Request<()>| {
        let (mut probe, observe) = (probe.clone(), observe.clone());
        let tier = req.extensions().get::<Job>().and_then(Job::tier);
        let tier = tier.map_or("guest", |t| t.as_str()).to_owned();
        let cap = tier_caps.get(tier.as_str()).copied().unwrap_or(0);
        let hold = req
            .extensions()
            .get::<Duration>()
            .copied()
            .unwrap_or_default();
        async move {
            let keys = |part: &str| {
                [
                    format!("obs:now{part}"),
                    format!("obs:max{part}"),
                    format!("obs:since{part}"),
                    format!("obs:over_ms{part}"),
                ]
            };
            let (global, tier) = (keys(""), keys(&format!(":{tier}")));
            let call = |delta: i32| {
                let mut call = observe.prepare_invoke();
                call.key(&global[..])
                    .key(&tier[..])
                    .arg(delta)
                    .arg(OUTAGE_GLOBAL)
                    .arg(cap);
                call
            };
            let _: u32 = call(1).invoke_async(&mut probe).await?;
            tokio::time::sleep(hold).await;
            let _: u32 = call(-1).invoke_async(&mut probe).await?;
            Ok::<_, redis::RedisError>(http::Response::new(String::new()))
        }
    });
    let stack = FairgateLayer::builder(store)
        .slots(policy)
        .window(256)
        .build()?
        .layer(upstream);
    let service = tower::util::BoxCloneService::new(stack.map_response(drop));
    let request = |tenant: String, tier: &str, hold: Duration| {
        let mut req = http::Request::new(());
        req.extensions_mut()
            .insert(Job::new(tenant, Origin::UserAction).with_tier(tier));
        req.extensions_mut().insert(hold);
        req
    };
    if let Some(at) = run.probe_at {
        tokio::time::sleep_until(ready + at).await;
        let calls = TIERS.map(|tier| {
            let service = service.clone();
            let req = request(format!("probe-{tier}"), tier, Duration::from_millis(100));
            async move {
                let sent = tokio::time::Instant::now();
                let answer = service.oneshot(req).await;
                let ms = sent.elapsed().as_millis();
                match answer {
                    Ok(()) => format!("probe {tier} ok {ms}"),
                    Err(e) => match e.downcast_ref::<Busy>() {
                        Some(busy) => format!("probe {tier} busy:{} {ms}", busy.reason()),
                        None => format!("probe {tier} failed {ms}"),
                    },
                }
            }
        });
        for line in futures_util::future::join_all(calls).await {
            println!("{line}");
        }
        // Still one of the fleet until the run ends, as an idle gateway is.
        tokio::time::sleep_until(ready + Duration::from_millis(run.millis as u64)).await;
        return Ok(());
    }
    let until = ready + Duration::from_millis(run.millis as u64);
    let call_ms = run.call_ms;
    let tasks = (0..run.callers).map(|caller| {
        let service = service.clone();
        tokio::spawn(async move {
            let mut x = caller as u64 * 7_919 + u64::from(std::process::id());
            // ok, failed, busy for the store (count, max wait), busy for a slot, other
            let mut seen = [0u64; 7];
            while tokio::time::Instant::now() < until {
                let (tier, hold) = draw(&mut x, call_ms);
                let req = request(format!("tenant-{caller}"), tier, hold);
                match service.clone().oneshot(req).await {
                    Ok(()) => seen[0] += 1,
                    Err(e) => {
                        match e.downcast_ref::<Busy>() {
                            Some(busy) => {
                                let ms = u64::try_from(busy.waited().as_millis()).unwrap_or(0);
                                let at = match busy.reason() {
                                    WaitReason::Store => 2,
                                    WaitReason::Slot => 4,
                                    _ => 6,
                                };
                                seen[at] += 1;
                                if at < 6 {
                                    seen[at + 1] = seen[at + 1].max(ms);
                                }
                            }
                            None => {
                                eprintln!("call failed: {e}");
                                seen[1] += 1;
                            }
                        }
                        // A client's retry goes to another worker, or comes back later.
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
            }
            seen
        })
    });
    let mut total = [0u64; 7];
    for task in futures_util::future::join_all(tasks).await {
        let seen = task?;
        for (i, n) in seen.into_iter().enumerate() {
            total[i] = if i == 3 || i == 5 {
                total[i].max(n)
            } else {
                total[i] + n
            };
        }
    }
    let [ok, failed, store, store_ms, slot, slot_ms, other] = total;
    println!("ok={ok} busy={} failed={failed}", store + slot + other);
    println!("busy store={store} (max {store_ms} ms) slot={slot} (max {slot_ms} ms) other={other}");
    Ok(())
}

/// One kind of caller of `fleet`: `callers` of them send `tenant`'s calls in `tier`.
struct Spec {
    callers: usize,
    tenant: String,
    tier: String,
    origin: Origin,
}

impl Spec {
    /// `CALLERS:TENANT:TIER:ORIGIN`.
    fn parse(spec: &str) -> Result<Spec, BoxError> {
        let parts: Vec<&str> = spec.split(':').collect();
        let [callers, tenant, tier, origin] = parts.as_slice() else {
            return Err(format!("a spec is CALLERS:TENANT:TIER:ORIGIN, not {spec}").into());
        };
        let origin = match *origin {
            "user" => Origin::UserAction,
            "scheduled" => Origin::Scheduled,
            "batch" => Origin::BatchJob,
            other => return Err(format!("unknown origin {other}").into()),
        };
        Ok(Spec {
            callers: callers.parse()?,
            tenant: (*tenant).to_owned(),
            tier: (*tier).to_owned(),
            origin,
        })
    }
}

/// `fleet`'s caps: global 8; tier caps of 8 that never bind.
fn fleet_policy(lease_ttl: Option<Duration>) -> SlotPolicy {
    let mut builder = SlotPolicy::builder().global_max(FLEET_GLOBAL);
    for tier in TIERS {
        builder = builder.tier(tier, FLEET_GLOBAL, Duration::from_secs(120));
    }
    if let Some(ttl) = lease_ttl {
        builder = builder.lease_ttl(ttl);
    }
    builder.build().expect("a valid policy")
}

const FLEET_GLOBAL: u32 = 8;

/// Moves the calls in flight (`KEYS[1]` now, `KEYS[2]` the maximum, `KEYS[3]` this
/// process's) by `ARGV[1]`; a call that starts (`1`) appends `<ms>:<tenant ARGV[2]>` to
/// `KEYS[4]`, on the observer's clock, so every process's starts share one order and clock.
const FLEET_OBSERVE: &str = r"
local now = redis.call('INCRBY', KEYS[1], ARGV[1])
redis.call('INCRBY', KEYS[3], ARGV[1])
if now > tonumber(redis.call('GET', KEYS[2]) or '0') then redis.call('SET', KEYS[2], now) end
if tonumber(ARGV[1]) > 0 then
  local t = redis.call('TIME')
  local ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  redis.call('RPUSH', KEYS[4], ms .. ':' .. ARGV[2])
end
return now";

/// `fleet`'s options: the lease TTL, the provider's rate (configured, or said by the
/// answers).
struct FleetLimits {
    lease_ttl: Option<Duration>,
    rpm: Option<u32>,
    learned_rpm: Option<u32>,
}

async fn fleet(
    store: Store,
    observer: &str,
    millis: usize,
    limits: FleetLimits,
    specs: Vec<Spec>,
) -> Result<(), BoxError> {
    let probe = redis::Client::open(observer)?
        .get_multiplexed_async_connection()
        .await?;
    let mine = format!("obs:now:{}", std::process::id());
    let observe = redis::Script::new(FLEET_OBSERVE);
    let calls = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let learned_rpm = limits.learned_rpm;
    let upstream = {
        let probe = probe.clone();
        service_fn(move |req: http::Request<()>| {
            let (mut probe, observe, mine) = (probe.clone(), observe.clone(), mine.clone());
            let job = req.extensions().get::<Job>();
            let tenant = job.map_or("", |j| j.tenant().as_str()).to_owned();
            // 30 to 50 ms in a fixed sequence, so the slots free one by one.
            let n = calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
            let hold = Duration::from_millis(30 + n * 7_919 % 21);
            async move {
                let call = |delta: i32| {
                    let mut call = observe.prepare_invoke();
                    call.key("obs:now")
                        .key("obs:max")
                        .key(&mine)
                        .key("obs:starts")
                        .arg(delta)
                        .arg(&tenant);
                    call
                };
                let _: i64 = call(1).invoke_async(&mut probe).await?;
                tokio::time::sleep(hold).await;
                let _: i64 = call(-1).invoke_async(&mut probe).await?;
                let mut answer = http::Response::new(String::new());
                if let Some(rpm) = learned_rpm {
                    for name in [
                        "anthropic-ratelimit-requests-limit",
                        "anthropic-ratelimit-requests-remaining",
                    ] {
                        answer
                            .headers_mut()
                            .insert(name, http::HeaderValue::from(rpm));
                    }
                }
                Ok::<_, redis::RedisError>(answer)
            }
        })
    };
    let mut backoff = BackoffPolicy::builder();
    if let Some(rpm) = limits.rpm {
        backoff = backoff.pacing(Pacing::new().requests_per_minute(rpm).shared());
    }
    let stack = FairgateLayer::builder(store)
        .slots(fleet_policy(limits.lease_ttl))
        .backoff(backoff.build()?)
        .window(8)
        .build()?
        .layer(upstream);
    let service = tower::util::BoxCloneService::new(stack.map_response(drop));
    println!("READY");
    let until = tokio::time::Instant::now() + Duration::from_millis(millis as u64);
    let mut tasks = Vec::new();
    for spec in &specs {
        for _ in 0..spec.callers {
            let service = service.clone();
            let (tenant, tier, origin) = (spec.tenant.clone(), spec.tier.clone(), spec.origin);
            tasks.push(tokio::spawn(async move {
                let (mut ok, mut busy, mut failed) = (0, 0, 0);
                while tokio::time::Instant::now() < until {
                    let mut req = http::Request::new(());
                    let job = Job::new(tenant.as_str(), origin).with_tier(tier.as_str());
                    req.extensions_mut().insert(job.with_cost(100));
                    match service.clone().oneshot(req).await {
                        Ok(()) => ok += 1,
                        Err(e) if e.is::<Busy>() => busy += 1,
                        Err(e) => {
                            eprintln!("call failed: {e}");
                            failed += 1;
                        }
                    }
                }
                (ok, busy, failed)
            }));
        }
    }
    let (mut ok, mut busy, mut failed) = (0, 0, 0);
    for task in futures_util::future::join_all(tasks).await {
        let (o, b, f) = task?;
        (ok, busy, failed) = (ok + o, busy + b, failed + f);
    }
    println!("ok={ok} busy={busy} failed={failed}");
    Ok(())
}
