//! One worker process of the multi-process slot tests (`tests/tier_slot_limit_redis.rs`):
//! many callers sharing one Redis budget through `TierSlotLimit`.
//!
//! ```sh
//! cargo run --features redis --example slot_worker -- load redis://127.0.0.1:6379/ 50 20
//! cargo run --features redis --example slot_worker -- hold redis://127.0.0.1:6379/ 10
//! ```
//!
//! `load URL CALLERS CALLS`: each caller makes CALLS calls; the upstream stand-in counts the
//! calls in flight in Redis (`probe:*` keys: now and the maximum seen, globally and per
//! tier) for 5 ms each. Prints `ok=N busy=N failed=N`.
//!
//! `hold URL N`: takes N slots, prints `HOLDING`, and holds them until killed.
//!
//! The caps (global 12; premium 8, pro 6, free 4, guest 2) and the lease TTL (2 s) are those
//! the tests check against.

use std::convert::Infallible;
use std::time::Duration;

use fairgate::{BoxError, Busy, Job, Origin, SlotPolicy, Store, TierSlotLimitLayer};
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
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (mode, url) = match args.as_slice() {
        [mode, url, ..] => (mode.as_str(), url.as_str()),
        _ => return Err("usage: slot_worker load URL CALLERS CALLS | hold URL N".into()),
    };
    let number =
        |i: usize| -> Result<usize, BoxError> { Ok(args.get(i).ok_or("missing number")?.parse()?) };
    let store = Store::builder()
        .flush_interval(Duration::from_millis(50))
        .redis(url)
        .await?;
    match mode {
        "load" => load(store, url, number(2)?, number(3)?).await,
        "hold" => hold(store, number(2)?).await,
        _ => Err(format!("unknown mode {mode}").into()),
    }
}

async fn load(store: Store, url: &str, callers: usize, calls: usize) -> Result<(), BoxError> {
    let probe = redis::Client::open(url)?
        .get_multiplexed_async_connection()
        .await?;
    let enter = redis::Script::new(ENTER);
    let upstream = service_fn(move |req: http::Request<()>| {
        let (mut probe, enter) = (probe.clone(), enter.clone());
        let tier = req.extensions().get::<Job>().and_then(Job::tier_name);
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
                req.extensions_mut()
                    .insert(Job::new(format!("tenant-{caller}"), Origin::UserAction).tier(tier));
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
            .insert(Job::new("holder", Origin::UserAction).tier(tier));
        held.push(service.clone().oneshot(req).await?);
    }
    println!("HOLDING");
    tokio::time::sleep(Duration::from_secs(3600)).await;
    drop(held);
    Ok(())
}
