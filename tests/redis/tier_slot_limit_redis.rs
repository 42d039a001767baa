//! TierSlotLimit on a real Redis: several OS processes sharing one budget, a worker killed
//! while holding slots, Redis killed mid-load, and a stream outliving its lease TTL. Each
//! rule on one node and on a Redis Cluster (3 masters, 3 replicas), one body for both
//! (`support::on_node_and_cluster!`); the counts are read from outside, on the node that
//! owns the slot keys (on a cluster they share the `{slots}` hash tag).

use std::convert::Infallible;
use std::io::{BufRead, BufReader};
use std::process::{Child, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::support::{
    Redis, RedisServer, SlotWorker, Target, on_node_and_cluster, request, slot_limits, wait_until,
};
use fairgate::store::{SlotLimits, SlotRefusal};
use fairgate::{
    FairgateLayer, Job, Origin, OutagePolicy, SlotPolicy, Store, Tier, TierSlotLimitLayer,
};
use tokio::time::Instant;
use tower::{Layer, ServiceExt, service_fn};

/// A `slot_worker` process in `mode` on `redis`, with `args` after the URL.
fn spawn_worker(redis: &Redis, mode: &str, args: &[&str]) -> Child {
    let (url, flags) = redis.worker_args();
    SlotWorker::command()
        .arg(mode)
        .arg(url)
        .args(args)
        .args(flags)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start a slot_worker process")
}

fn get(observer: &RedisServer, key: &str) -> u32 {
    let reply = observer.command(&format!("GET {key}"));
    // "$1\r\n7\r\n" or "$-1" for a missing key
    reply
        .lines()
        .nth(1)
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0)
}

on_node_and_cluster!(
    four_processes_of_fifty_callers_never_exceed_the_caps,
    a_sigkilled_workers_slots_come_back_within_the_lease_ttl_and_not_before,
    a_stream_longer_than_the_lease_ttl_keeps_its_slot_until_it_ends,
    an_acquire_that_timed_out_does_not_leave_its_lease_taken,
    a_request_dropped_during_its_acquire_does_not_leave_its_lease_taken,
    a_lease_given_back_while_redis_is_away_is_released_when_it_returns,
    a_wiped_redis_gets_back_every_lease_still_held_before_a_new_one_is_taken,
    a_lease_gone_from_redis_while_its_call_runs_is_put_back_by_the_heartbeat,
    a_worker_that_never_reached_redis_takes_its_share_of_the_expected_fleet,
    while_degraded_the_redis_leases_still_held_count_against_the_share,
    redis_away_a_worker_keeps_what_it_held_for_a_lease_ttl_then_follows_its_outage_policy,
    wait_queue_entries_of_workers_gone_expire_within_a_worker_ttl,
);
on_node_and_cluster!(multi_thread:
    redis_killed_mid_load_no_request_fails_and_each_worker_keeps_to_its_share,
    a_release_in_one_worker_wakes_a_waiter_in_another_at_once,
    while_the_slot_keys_shard_is_away_the_fallback_gives_slots,
    each_freed_slot_wakes_one_queued_worker_whose_acquire_takes_it,
    a_tier_that_starts_waiting_is_not_held_behind_a_flood_queued_before_it,
);

/// While the shard of the slot keys is away (on a cluster the other shards still answer),
/// the store serves from its fallback share: every acquire that fits the share gets a slot.
/// (A probe that any live node answered made the store try to recover over and over and
/// refuse fallback slots meanwhile: 57 given and 431 refused in 3 s on a cluster.)
async fn while_the_slot_keys_shard_is_away_the_fallback_gives_slots(target: Target) {
    let mut redis = target.start_own().await;
    let store = redis
        .store(
            Store::builder()
                .op_timeout(Duration::from_millis(100))
                .probe_interval(Duration::from_millis(20)),
        )
        .await
        .unwrap();
    let pro = Tier::new("pro");
    let limits = slot_limits(8);
    let _held = store.try_acquire_slot(&pro, limits).await.expect("a slot");
    redis.kill_slots_shard();
    let started = Instant::now();
    let (mut given, mut refused) = (0, 0);
    while started.elapsed() < Duration::from_secs(2) {
        match store.try_acquire_slot(&pro, limits).await {
            Some(lease) => {
                given += 1;
                drop(lease);
            }
            None => refused += 1,
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    println!("{target:?}, slot keys' shard away: {given} fallback slots given, {refused} refused");
    assert!(store.is_degraded());
    assert!(given > 100, "{given} given");
    // The first acquire or two may meet the outage itself (a timeout, not yet degraded).
    assert!(refused <= 2, "{refused} refused");
}

async fn four_processes_of_fifty_callers_never_exceed_the_caps(target: Target) {
    // 200 callers keep the cluster busy: no other test shares it meanwhile.
    let redis = target.start_alone().await;
    // The calls in flight are counted on a Redis of their own, outside the one the workers
    // share their caps through.
    let observer = RedisServer::start();
    let probe = observer.url();
    let workers: Vec<Child> = (0..4)
        .map(|_| spawn_worker(&redis, "load", &["50", "12", &probe]))
        .collect();
    let mut ok = 0;
    for worker in workers {
        let output = worker.wait_with_output().unwrap();
        assert!(output.status.success(), "worker failed: {output:?}");
        let line = String::from_utf8_lossy(&output.stdout).trim().to_owned();
        assert!(line.ends_with("busy=0 failed=0"), "{line}");
        ok += line
            .trim_start_matches("ok=")
            .split(' ')
            .next()
            .unwrap()
            .parse::<u32>()
            .unwrap();
    }
    assert_eq!(ok, 4 * 50 * 12);
    let max = get(&observer, "probe:max");
    let tiers = [("premium", 8), ("pro", 6), ("free", 4), ("guest", 2)];
    let tier_max: Vec<(&str, u32, u32)> = tiers
        .iter()
        .map(|&(t, cap)| (t, get(&observer, &format!("probe:max:{t}")), cap))
        .collect();
    println!("4 processes x 50 callers: max in flight {max} (cap 12); per tier {tier_max:?}");
    assert!(max <= 12, "global cap broken across processes: {max}");
    assert!(
        max >= 10,
        "the budget was barely used ({max}): the probe is not measuring"
    );
    for (tier, seen, cap) in tier_max {
        assert!(seen <= cap, "{tier}: {seen} > {cap}");
        assert!(seen >= 1, "{tier} never ran");
    }
}

async fn a_sigkilled_workers_slots_come_back_within_the_lease_ttl_and_not_before(target: Target) {
    let redis = target.start().await;
    let mut holder = spawn_worker(&redis, "hold", &["10"]);
    let mut line = String::new();
    BufReader::new(holder.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line.trim(), "HOLDING");

    let store = redis.store(patient()).await.unwrap();
    assert_eq!(store.slots_in_use(None).await, 10);
    holder.kill().unwrap(); // SIGKILL: no release, no more heartbeats
    holder.wait().unwrap();
    let killed = Instant::now();
    // When each of its leases expires, by the server's clock (nobody renews them now).
    let expiries = lease_expiries(&redis);
    assert_eq!(expiries.len(), 10);
    let (first, last) = (expiries[0], expiries[9]);

    let limits = slot_limits(10);
    let premium = Tier::new("premium");
    let (back_after, server_ms, _lease) = loop {
        if let Some(lease) = store.try_acquire_slot(&premium, limits).await {
            break (killed.elapsed(), server_time_ms(&redis), lease);
        }
        assert!(
            killed.elapsed() < Duration::from_secs(4),
            "slots never came back"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    println!("slots of a killed worker: the first back after {back_after:?} (lease ttl 2 s)");
    assert!(
        server_ms >= first,
        "a slot came back {} ms before its lease expired",
        first - server_ms
    );
    assert!(
        back_after <= Duration::from_millis(2300),
        "too late: {back_after:?}"
    );
    // The rest come back as their leases expire, and are all back soon after the last.
    let deadline = Instant::now() + Duration::from_millis((last - first + 500).min(3000));
    while store.slots_in_use(None).await > 1 {
        assert!(
            Instant::now() < deadline,
            "a killed worker's slot stayed taken"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The expiry (server ms) of every lease in the global set, earliest first.
fn lease_expiries(redis: &Redis) -> Vec<u64> {
    let key = redis.key("{slots}:global");
    let reply = redis.slots_cli(&["ZRANGE", &key, "0", "-1", "WITHSCORES"]);
    // Member, score, member, score, ...
    let mut scores: Vec<u64> = reply
        .lines()
        .skip(1)
        .step_by(2)
        .map(|s| s.trim().parse().expect("a score"))
        .collect();
    scores.sort_unstable();
    scores
}

/// The clock of the node that owns the slot keys (the one the slot scripts use), in ms.
fn server_time_ms(redis: &Redis) -> u64 {
    let reply = redis.slots_cli(&["TIME"]);
    let parts: Vec<u64> = reply.lines().map(|l| l.trim().parse().unwrap()).collect();
    parts[0] * 1000 + parts[1] / 1000
}

/// Concurrency seen by an upstream, overall.
#[derive(Default)]
struct Probe {
    now: u32,
    max: u32,
}

/// Runs `callers` x `calls` premium calls of 5 ms through TierSlotLimit; how many failed
/// (a `Busy` for the store's absence is an answer, not a failure).
async fn run_load(
    store: Store,
    policy: SlotPolicy,
    probe: Arc<Mutex<Probe>>,
    callers: usize,
    calls: usize,
) -> usize {
    let upstream = service_fn(move |_: http::Request<()>| {
        let probe = probe.clone();
        async move {
            {
                let mut p = probe.lock().unwrap();
                p.now += 1;
                p.max = p.max.max(p.now);
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
            probe.lock().unwrap().now -= 1;
            Ok::<_, Infallible>(http::Response::new(()))
        }
    });
    let service = TierSlotLimitLayer::new(store, policy).layer(upstream);
    let tasks = (0..callers).map(|c| {
        let service = service.clone();
        tokio::spawn(async move {
            let mut failed = 0;
            for _ in 0..calls {
                let job = Job::new(format!("t{c}"), Origin::UserAction).with_tier("premium");
                match service.clone().oneshot(request(job)).await {
                    Ok(_) => {}
                    // Redis away, and nothing this worker can admit soundly: said so.
                    Err(e)
                        if e.downcast_ref::<fairgate::Busy>()
                            .is_some_and(|b| b.reason() == fairgate::WaitReason::Store) => {}
                    Err(_) => failed += 1,
                }
            }
            failed
        })
    });
    futures_util::future::join_all(tasks)
        .await
        .into_iter()
        .map(|r| r.unwrap())
        .sum()
}

/// A store that does not take a slow answer for an outage: on the loaded 2-core machine a
/// cluster call now and then takes over the default 150 ms, and a store that times out
/// answers from local state for a moment, which these tests would read as a broken rule.
fn patient() -> fairgate::StoreBuilder {
    Store::builder().op_timeout(Duration::from_secs(1))
}

async fn worker(redis: &Redis) -> Store {
    redis
        .store(
            patient()
                .probe_interval(Duration::from_millis(20))
                .flush_interval(Duration::from_millis(20)),
        )
        .await
        .unwrap()
}

/// On a cluster the whole shard of the slot keys is killed (master and replica) and later
/// started again empty, as the one node is: with its replica alive the shard would be back
/// by itself within ~2 s, too soon to watch the workers keep to their shares (that failover
/// is `tests/fleet/faults.rs`'s).
async fn redis_killed_mid_load_no_request_fails_and_each_worker_keeps_to_its_share(target: Target) {
    let mut redis = target.start_own().await;
    // The default operation timeout: the recovery waits one after a failed resync.
    let fast = || {
        Store::builder()
            .probe_interval(Duration::from_millis(20))
            .flush_interval(Duration::from_millis(20))
    };
    let (one, two) = (
        redis.store(fast()).await.unwrap(),
        redis.store(fast()).await.unwrap(),
    );
    let lease_ttl = Duration::from_secs(1);
    let policy = SlotPolicy::builder()
        .global_max(8)
        .tier("premium", 8, Duration::from_secs(60))
        .lease_ttl(lease_ttl)
        .build()
        .unwrap();
    // Both workers have said they are alive.
    let deadline = Instant::now() + Duration::from_secs(5);
    while one.alive_workers() < 2 || two.alive_workers() < 2 {
        assert!(Instant::now() < deadline, "workers never saw each other");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let shared_probe = Arc::new(Mutex::new(Probe::default()));
    let load = |store: &Store, probe: &Arc<Mutex<Probe>>, calls: usize| {
        tokio::spawn(run_load(
            store.clone(),
            policy.clone(),
            probe.clone(),
            20,
            calls,
        ))
    };
    let (a, b) = (load(&one, &shared_probe, 40), load(&two, &shared_probe, 40));
    tokio::time::sleep(Duration::from_millis(100)).await;
    redis.kill_slots_shard();
    let killed = Instant::now();
    assert_eq!(
        a.await.unwrap() + b.await.unwrap(),
        0,
        "no request failed across the outage (but those refused at once for it)"
    );
    // Until one lease TTL has passed each worker also kept to what it held at the fault
    // (the probe above counted both together: never more than 8).
    assert!(shared_probe.lock().unwrap().max <= 8);
    // A worker that fell idle before the kill noticed it at its next heartbeat (within a
    // second); one lease TTL after that it serves its share.
    let noticed = Duration::from_millis(1_200);
    tokio::time::sleep((noticed + lease_ttl).saturating_sub(killed.elapsed())).await;

    // Degraded, past one lease TTL: each worker keeps to global / workers alive = 4.
    assert!(one.is_degraded() && two.is_degraded());
    let (probe_one, probe_two) = (
        Arc::new(Mutex::new(Probe::default())),
        Arc::new(Mutex::new(Probe::default())),
    );
    let degraded = Instant::now();
    let (a, b) = (load(&one, &probe_one, 40), load(&two, &probe_two, 40));
    assert_eq!(a.await.unwrap() + b.await.unwrap(), 0);
    let took = degraded.elapsed();
    let (max_one, max_two) = (probe_one.lock().unwrap().max, probe_two.lock().unwrap().max);
    println!(
        "fallback: worker one max {max_one}, worker two max {max_two} (share 4 each); \
         1600 calls of 5 ms in {took:?}"
    );
    assert!(
        max_one <= 4 && max_two <= 4 && max_one.max(max_two) == 4,
        "each worker keeps to its share, and one of them uses all of it: {max_one}, {max_two}"
    );

    // Back on Redis (its scripts reloaded): the shared cap of 8 holds across both again.
    redis.restart();
    let deadline = Instant::now() + Duration::from_secs(10);
    while one.is_degraded() || two.is_degraded() {
        assert!(Instant::now() < deadline, "never back on redis");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let after = Arc::new(Mutex::new(Probe::default()));
    let (a, b) = (load(&one, &after, 40), load(&two, &after, 40));
    assert_eq!(a.await.unwrap() + b.await.unwrap(), 0);
    let max = after.lock().unwrap().max;
    println!("after recovery: max in flight across both workers {max} (cap 8)");
    assert!((6..=8).contains(&max), "shared cap after recovery: {max}");
    // The lease went through the acquire script on the restarted server, not the fallback.
    let limits = slot_limits(8);
    let lease = one
        .try_acquire_slot(&Tier::new("premium"), limits)
        .await
        .expect("a slot");
    assert!(lease.is_shared());
    assert_eq!(leases_in_redis(&redis), 1);
}

async fn a_stream_longer_than_the_lease_ttl_keeps_its_slot_until_it_ends(target: Target) {
    let redis = target.start().await;
    let store = redis
        .store(patient().flush_interval(Duration::from_millis(50)))
        .await
        .unwrap();
    let policy = SlotPolicy::builder()
        .global_max(1)
        .tier("pro", 1, Duration::ZERO)
        .lease_ttl(Duration::from_millis(600))
        .build()
        .unwrap();
    let (tx, rx) =
        tokio::sync::mpsc::channel::<Result<http_body::Frame<bytes::Bytes>, Infallible>>(16);
    let rx = Arc::new(Mutex::new(Some(rx)));
    let upstream = service_fn(move |_: http::Request<()>| {
        // The first call streams from the test; later ones get an empty body.
        let rx = rx
            .lock()
            .unwrap()
            .take()
            .unwrap_or_else(|| tokio::sync::mpsc::channel(1).1);
        async move {
            let stream = tokio_stream_from(rx);
            Ok::<_, Infallible>(http::Response::new(http_body_util::StreamBody::new(stream)))
        }
    });
    let service = TierSlotLimitLayer::new(store.clone(), policy).layer(upstream);
    let job = || Job::new("acme", Origin::UserAction).with_tier("pro");
    let response = service.clone().oneshot(request(job())).await.unwrap();

    // Three TTLs of streaming: the heartbeat keeps the lease, nobody else gets the slot.
    for _ in 0..6 {
        tx.send(Ok(http_body::Frame::data(bytes::Bytes::from_static(
            b"data: x\n\n",
        ))))
        .await
        .unwrap();
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(store.slots_in_use(None).await, 1);
        match service.clone().oneshot(request(job())).await {
            Err(err) => assert!(err.is::<fairgate::Busy>(), "{err}"),
            Ok(_) => panic!("a second stream got the only slot"),
        }
    }
    drop(tx); // the stream ends
    use http_body_util::BodyExt;
    let body = response.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body.len(), 6 * 9);
    let deadline = Instant::now() + Duration::from_secs(2);
    while store.slots_in_use(None).await != 0 {
        assert!(Instant::now() < deadline, "the slot was not given back");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    service
        .oneshot(request(job()))
        .await
        .expect("the slot is free again");
}

fn tokio_stream_from<T: Send + 'static>(
    mut rx: tokio::sync::mpsc::Receiver<T>,
) -> impl futures_util::Stream<Item = T> + Send {
    futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx))
}

/// The leases in the global set, read from outside.
fn leases_in_redis(redis: &Redis) -> u32 {
    // No answer yet (Redis is stalled) reads as "not there yet".
    let reply = redis.slots_cli(&["ZCARD", &redis.key("{slots}:global")]);
    reply.trim().parse().unwrap_or(u32::MAX)
}

async fn wait_for_leases(redis: &Redis, n: u32, within: Duration) {
    let deadline = Instant::now() + within;
    while leases_in_redis(redis) != n {
        assert!(
            Instant::now() < deadline,
            "leases in redis stayed at {}, not {n}",
            leases_in_redis(redis)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn stalling_worker(redis: &Redis) -> Store {
    redis
        .store(
            Store::builder()
                .op_timeout(Duration::from_millis(100))
                .probe_interval(Duration::from_millis(20))
                .flush_interval(Duration::from_millis(20)),
        )
        .await
        .unwrap()
}

// The stalls (DEBUG SLEEP) last 0.4 s: on a cluster every node sleeps, under the node
// timeout (1 s), so no failover follows.

async fn an_acquire_that_timed_out_does_not_leave_its_lease_taken(target: Target) {
    let redis = target.start_alone().await;
    let store = stalling_worker(&redis).await;
    let limits = slot_limits(5);
    redis.stall(0.4);
    // The script waits behind the stall, the call times out, the store falls back...
    let lease = store
        .try_acquire_slot(&Tier::new("pro"), limits)
        .await
        .expect("a fallback slot");
    assert!(!lease.is_shared());
    assert!(store.is_degraded());
    // ...and Redis runs the script after the stall, granting a lease nobody holds.
    // Released once Redis answers again: long before its 30 s TTL. The fallback slot's call
    // is still in flight, so it is put back as a lease of its own...
    let deadline = Instant::now() + Duration::from_secs(3);
    while store.is_degraded() {
        assert!(Instant::now() < deadline, "never back on redis");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    wait_for_leases(&redis, 1, Duration::from_secs(3)).await;
    let members = redis.slots_cli(&["ZRANGE", &redis.key("{slots}:global"), "0", "-1"]);
    assert_eq!(members.lines().count(), 1, "one lease: {members}");
    // ...which goes when the call ends.
    drop(lease);
    wait_for_leases(&redis, 0, Duration::from_secs(3)).await;
}

async fn a_request_dropped_during_its_acquire_does_not_leave_its_lease_taken(target: Target) {
    let redis = target.start_alone().await;
    let store = stalling_worker(&redis).await;
    let upstream =
        service_fn(|_: http::Request<()>| async { Ok::<_, Infallible>(http::Response::new(())) });
    let service = TierSlotLimitLayer::new(store.clone(), SlotPolicy::default()).layer(upstream);
    let job = Job::new("acme", Origin::UserAction).with_tier("pro");
    redis.stall(0.4);
    // The acquire made in `call` is sent and waits behind the stall; the caller gives up
    // before the store's own timeout...
    let gave_up = tokio::time::timeout(Duration::from_millis(50), service.oneshot(request(job)));
    assert!(gave_up.await.is_err(), "no answer while redis is stalled");
    // ...and Redis runs the script after the stall, granting a lease nobody holds.
    // Released once Redis answers again: long before its 30 s TTL.
    tokio::time::sleep(Duration::from_millis(500)).await;
    wait_for_leases(&redis, 0, Duration::from_secs(3)).await;
}

async fn a_lease_given_back_while_redis_is_away_is_released_when_it_returns(target: Target) {
    let redis = target.start_alone().await;
    let store = stalling_worker(&redis).await;
    let limits = slot_limits(5);
    let lease = store
        .try_acquire_slot(&Tier::new("pro"), limits)
        .await
        .expect("a slot");
    assert!(lease.is_shared());
    assert_eq!(leases_in_redis(&redis), 1);

    redis.stall(0.4);
    assert!(store.throttle_count(&fairgate::TenantId::new("t")).await == 0); // times out
    assert!(store.is_degraded());
    drop(lease); // while degraded: queued, not lost
    wait_for_leases(&redis, 0, Duration::from_secs(3)).await;
}

/// One `pro` slot in all, and a safety-net poll of a minute (ten on Redis while wake-ups
/// are targeted): only a wake-up can serve a waiter soon.
fn one_slot_no_poll() -> SlotPolicy {
    SlotPolicy::builder()
        .global_max(1)
        .tier("pro", 1, Duration::from_secs(30))
        .poll_interval(Duration::from_secs(60))
        .build()
        .unwrap()
}

/// A TierSlotLimit on `store` around an upstream that answers at once.
fn answering_at_once(
    store: Store,
    policy: SlotPolicy,
) -> impl tower::Service<
    http::Request<()>,
    Response: Send + 'static,
    Error: std::fmt::Debug + Send + 'static,
    Future: Send,
> + Clone
+ Send
+ 'static {
    let upstream =
        service_fn(|_: http::Request<()>| async { Ok::<_, Infallible>(http::Response::new(())) });
    TierSlotLimitLayer::new(store, policy).layer(upstream)
}

fn pro_job() -> Job {
    Job::new("acme", Origin::UserAction).with_tier("pro")
}

async fn a_release_in_one_worker_wakes_a_waiter_in_another_at_once(target: Target) {
    let redis = target.start().await;
    let (one, two) = (worker(&redis).await, worker(&redis).await);
    let policy = one_slot_no_poll();
    let holder = answering_at_once(one, policy.clone());
    let waiter = answering_at_once(two, policy);
    let job = pro_job;

    let held = holder.oneshot(request(job())).await.unwrap();
    let waiting = tokio::spawn(async move {
        let response = waiter.oneshot(request(job())).await;
        (response.map(drop), Instant::now())
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !waiting.is_finished(),
        "the waiter waits while the slot is held"
    );
    let released = Instant::now();
    drop(held);
    let (result, got) = waiting.await.unwrap();
    result.expect("the waiter gets the slot");
    let after = got.saturating_duration_since(released);
    println!("a release in worker one reached worker two's waiter after {after:?}");
    assert!(
        after < Duration::from_secs(2),
        "woken by the poll, not the announcement: {after:?}"
    );
}

/// How many workers wait in `tier`'s wait queue in Redis.
fn queued(redis: &Redis, tier: &str) -> u32 {
    let queue = redis.key(&format!("{{slots}}:tier:{tier}:waiting"));
    redis
        .slots_cli(&["ZCARD", &queue])
        .trim()
        .parse()
        .unwrap_or(0)
}

/// How many wake-ups releases have sent (each names a token of its own).
fn wake_ups(redis: &Redis) -> u32 {
    let book = redis.key("{slots}:waits");
    redis
        .slots_cli(&["HGET", &book, "token"])
        .trim()
        .parse()
        .unwrap_or(0)
}

/// Three workers each wait for the one slot another holds. Each release wakes exactly one
/// of them (a wake-up is a token: three releases with waiters, three tokens), and its one
/// acquire takes the slot: a refused acquire would queue it again and cost a fourth. The
/// safety-net poll is ten minutes on Redis here, so only wake-ups can serve them.
async fn each_freed_slot_wakes_one_queued_worker_whose_acquire_takes_it(target: Target) {
    let redis = target.start_own().await;
    let policy = one_slot_no_poll();
    let holder = answering_at_once(worker(&redis).await, policy.clone());
    let held = holder.oneshot(request(pro_job())).await.unwrap();
    let mut waiting = Vec::new();
    for _ in 0..3 {
        let waiter = answering_at_once(worker(&redis).await, policy.clone());
        waiting.push(tokio::spawn(async move {
            waiter.oneshot(request(pro_job())).await.map(drop)
        }));
    }
    wait_until("three workers queued", || queued(&redis, "pro") == 3).await;
    assert_eq!(wake_ups(&redis), 0);
    let released = Instant::now();
    drop(held);
    for waiter in waiting {
        waiter.await.unwrap().expect("every waiter gets the slot");
    }
    let took = released.elapsed();
    println!("{target:?}: three queued workers served one after another in {took:?}");
    assert_eq!(wake_ups(&redis), 3, "one wake-up per freed slot");
    assert_eq!(queued(&redis, "pro"), 0);
    assert!(
        took < Duration::from_secs(5),
        "served by the poll: {took:?}"
    );
}

/// The fleet's fair queuing between tiers: one worker floods `guest` (weight 1) through the
/// whole stack and its calls queue in Redis; then another sends `premium` (weight 3). The
/// premium calls go within the next few freed slots, about three for each guest, not after
/// the guests queued before them.
async fn a_tier_that_starts_waiting_is_not_held_behind_a_flood_queued_before_it(target: Target) {
    let redis = target.start_own().await;
    let policy = SlotPolicy::builder()
        .global_max(2)
        .tier("guest", 2, Duration::from_secs(60))
        .tier("premium", 2, Duration::from_secs(60))
        .poll_interval(Duration::from_secs(60))
        .build()
        .unwrap();
    let done: Arc<Mutex<Vec<String>>> = Arc::default();
    let stack = |store: Store| {
        let done = done.clone();
        let upstream = service_fn(move |req: http::Request<()>| {
            let done = done.clone();
            async move {
                let job = req.extensions().get::<Job>().expect("a job");
                let tier = job.tier().expect("a tier").as_str().to_owned();
                tokio::time::sleep(Duration::from_millis(10)).await;
                done.lock().unwrap().push(tier);
                Ok::<_, Infallible>(http::Response::new(String::new()))
            }
        });
        let stack = FairgateLayer::builder(store)
            .slots(policy.clone())
            .window(64)
            .build()
            .unwrap()
            .layer(upstream);
        tower::util::BoxCloneService::new(stack.map_response(drop))
    };
    let (flood, paying) = (stack(worker(&redis).await), stack(worker(&redis).await));
    let call = |service: &tower::util::BoxCloneService<_, (), _>, tier: &str, i: usize| {
        let service = service.clone();
        let job = Job::new(format!("{tier}-{i}"), Origin::UserAction).with_tier(tier);
        tokio::spawn(async move { service.oneshot(request(job)).await })
    };
    // Each worker past its slow start first (one call until an answer came): this is about
    // the order between tiers, not about a cold start.
    for (service, tier) in [(&paying, "premium"), (&flood, "guest")] {
        call(service, tier, 99)
            .await
            .unwrap()
            .expect("a warm-up call");
    }
    done.lock().unwrap().clear();
    let guests: Vec<_> = (0..40).map(|i| call(&flood, "guest", i)).collect();
    // Each guest's calls are a flow of their own in the fleet's order.
    wait_until("the guests queued in redis", || {
        queued(&redis, "guest") >= 1
    })
    .await;
    let before = done.lock().unwrap().len();
    let premium: Vec<_> = (0..6).map(|i| call(&paying, "premium", i)).collect();
    for call in premium.into_iter().chain(guests) {
        call.await.unwrap().expect("every call is served");
    }
    let done = done.lock().unwrap();
    let last_premium = done.iter().rposition(|t| t == "premium").unwrap();
    let guests_meanwhile = done[before..last_premium]
        .iter()
        .filter(|t| *t == "guest")
        .count();
    println!(
        "{target:?}: premium sent after {before} guests were served; {guests_meanwhile} more \
         guests were served before the last of the 6 premium calls"
    );
    // In arrival order all 40 guests would go first; by weight about one in four slots
    // (2 measured, every run; the margin is for a loaded machine).
    assert!(
        guests_meanwhile <= 6,
        "{guests_meanwhile} guests before the last premium call"
    );
}

/// Takes slots of `tier` until the store says no; returns them.
async fn take_all(
    store: &Store,
    tier: &str,
    limits: SlotLimits,
) -> Vec<fairgate::store::SlotLease> {
    let mut leases = Vec::new();
    while let Some(lease) = store.try_acquire_slot(&Tier::new(tier), limits).await {
        leases.push(lease);
        assert!(leases.len() <= 100, "no cap at all");
    }
    leases
}

async fn a_wiped_redis_gets_back_every_lease_still_held_before_a_new_one_is_taken(target: Target) {
    let redis = target.start_alone().await;
    let store = worker(&redis).await;
    let limits = slot_limits(8);
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(
            store
                .try_acquire_slot(&Tier::new("pro"), limits)
                .await
                .unwrap(),
        );
    }
    assert_eq!(leases_in_redis(&redis), 3);
    redis.flush_all();
    assert_eq!(leases_in_redis(&redis), 0);
    // The next acquire finds the epoch gone, puts the three back, then takes its own.
    held.push(
        store
            .try_acquire_slot(&Tier::new("pro"), limits)
            .await
            .unwrap(),
    );
    assert_eq!(leases_in_redis(&redis), 4);
    assert_eq!(
        take_all(&store, "pro", limits).await.len(),
        4,
        "the cap counts all 8"
    );
    drop(held);
    wait_for_leases(&redis, 0, Duration::from_secs(2)).await;
}

async fn a_lease_gone_from_redis_while_its_call_runs_is_put_back_by_the_heartbeat(target: Target) {
    let redis = target.start().await;
    let store = worker(&redis).await;
    let lease = store
        .try_acquire_slot(&Tier::new("pro"), slot_limits(8))
        .await;
    assert!(lease.as_ref().is_some_and(|l| l.is_shared()));
    // Gone from both sets, as if expired or evicted; the epoch and the worker remain.
    let (global, tier) = (redis.key("{slots}:global"), redis.key("{slots}:tier:pro"));
    let id = redis.slots_cli(&["ZRANGE", &global, "0", "-1"]);
    let id = id.lines().next().unwrap().trim().to_owned();
    redis.slots_cli(&["ZREM", &global, &id]);
    redis.slots_cli(&["ZREM", &tier, &id]);
    // The worker heartbeat (every second) reports it missing and the worker puts it back.
    wait_for_leases(&redis, 1, Duration::from_secs(3)).await;
    assert_eq!(redis.slots_cli(&["ZCARD", &tier]), "1");
    drop(lease);
    wait_for_leases(&redis, 0, Duration::from_secs(2)).await;
}

async fn a_worker_that_never_reached_redis_takes_its_share_of_the_expected_fleet(target: Target) {
    let limits = slot_limits(8);
    let unknown = target
        .unreachable_store(Store::builder().probe_interval(Duration::from_millis(20)))
        .await
        .unwrap();
    assert!(unknown.is_degraded());
    // Knowing nothing: one slot at a time.
    assert_eq!(take_all(&unknown, "pro", limits).await.len(), 1);
    let two = target
        .unreachable_store(Store::builder().expected_workers(2))
        .await
        .unwrap();
    let leases = take_all(&two, "pro", limits).await;
    assert_eq!(leases.len(), 4);
    assert!(leases.iter().all(|l| l.is_fallback() && !l.is_shared()));
    assert!(
        target
            .unreachable_store(Store::builder().expected_workers(0))
            .await
            .is_err()
    );
}

async fn while_degraded_the_redis_leases_still_held_count_against_the_share(target: Target) {
    let redis = target.start_alone().await;
    let store = stalling_worker(&redis).await;
    let limits = slot_limits(8);
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(
            store
                .try_acquire_slot(&Tier::new("pro"), limits)
                .await
                .unwrap(),
        );
    }
    redis.stall(0.4);
    let _ = store.throttle_count(&fairgate::TenantId::new("t")).await; // times out
    assert!(store.is_degraded());
    // One worker alive: its share is the whole cap, three of which it holds in Redis.
    let fallback = take_all(&store, "pro", limits).await;
    assert_eq!(fallback.len(), 5);
    assert_eq!(store.slots_in_use(None).await, 8);
    drop(fallback);
    drop(held);
}

/// Redis away with two workers alive (each one's share: 4 of 8): for a lease TTL each keeps
/// exactly what it held, per tier and in all, however far from its share; a call of its own
/// that ends frees a slot for the next of its tier; a tier it held nothing of is refused at
/// once for the store's absence. Past the TTL, the outage policy: the share, or nothing.
async fn redis_away_a_worker_keeps_what_it_held_for_a_lease_ttl_then_follows_its_outage_policy(
    target: Target,
) {
    let mut redis = target.start_own().await;
    let builder = || {
        Store::builder()
            .op_timeout(Duration::from_millis(100))
            .probe_interval(Duration::from_millis(20))
            .flush_interval(Duration::from_millis(20))
    };
    let one = redis.store(builder()).await.unwrap();
    let two = redis
        .store(builder().after_outage(OutagePolicy::Refuse))
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while one.alive_workers() < 2 || two.alive_workers() < 2 {
        assert!(Instant::now() < deadline, "workers never saw each other");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let ttl = Duration::from_millis(2_000);
    let limits = SlotLimits {
        lease_ttl: ttl,
        ..slot_limits(8)
    };
    let (pro, free, guest) = (Tier::new("pro"), Tier::new("free"), Tier::new("guest"));
    let take = |store: &Store, tier: &Tier| store.try_acquire_slot_for(tier, None, limits);
    let mut held_one = Vec::new();
    for _ in 0..6 {
        held_one.push(take(&one, &pro).await.unwrap());
    }
    let mut held_two = vec![
        take(&two, &pro).await.unwrap(),
        take(&two, &free).await.unwrap(),
    ];
    let taken = Instant::now();
    redis.kill_slots_shard();
    for store in [&one, &two] {
        let _ = store.slots_in_use(None).await; // fails: the slot keys are away
        assert!(store.is_degraded());
    }

    // Within the TTL: what each held, per tier.
    let refused = Instant::now();
    assert_eq!(take(&one, &pro).await.unwrap_err(), SlotRefusal::Full);
    assert_eq!(take(&one, &free).await.unwrap_err(), SlotRefusal::Store);
    assert_eq!(take(&two, &guest).await.unwrap_err(), SlotRefusal::Store);
    assert_eq!(take(&two, &free).await.unwrap_err(), SlotRefusal::Full);
    assert!(
        refused.elapsed() < Duration::from_millis(50),
        "refused at once"
    );
    held_one.truncate(5);
    let again = take(&one, &pro).await.expect("its own freed slot");
    assert!(again.is_fallback());
    held_one.push(again);
    assert_eq!(take(&one, &pro).await.unwrap_err(), SlotRefusal::Full);
    held_two.pop();
    held_two.push(take(&two, &free).await.expect("its own freed slot"));
    assert!(
        taken.elapsed() < ttl,
        "too slow to check within the TTL: {:?}",
        taken.elapsed()
    );

    // Past the TTL: worker one shares (4 of 8), worker two refuses.
    tokio::time::sleep((ttl + Duration::from_millis(100)).saturating_sub(taken.elapsed())).await;
    assert_eq!(take(&one, &pro).await.unwrap_err(), SlotRefusal::Full);
    held_one.truncate(3);
    held_one.push(take(&one, &free).await.expect("its share"));
    assert_eq!(take(&one, &pro).await.unwrap_err(), SlotRefusal::Full);
    assert_eq!(take(&two, &pro).await.unwrap_err(), SlotRefusal::Store);
    held_two.clear();
    assert_eq!(take(&two, &guest).await.unwrap_err(), SlotRefusal::Store);
    drop(held_one);

    // The layers answer such a call `Busy` for the store at once, not at the max wait
    // (60 s here): TierSlotLimit alone, and the fair queue taking the slots.
    let policy = SlotPolicy::builder()
        .global_max(8)
        .tier("pro", 8, Duration::from_secs(60))
        .lease_ttl(ttl)
        .build()
        .unwrap();
    let upstream =
        service_fn(|_: http::Request<()>| async { Ok::<_, Infallible>(http::Response::new(())) });
    let alone = TierSlotLimitLayer::new(two.clone(), policy.clone()).layer(upstream);
    let answering = service_fn(|_: http::Request<()>| async {
        Ok::<_, Infallible>(http::Response::new(String::new()))
    });
    let stack = FairgateLayer::builder(two.clone())
        .slots(policy)
        .build()
        .unwrap()
        .layer(answering);
    let sent = Instant::now();
    let busy = [
        alone
            .oneshot(request(pro_job()))
            .await
            .map(drop)
            .unwrap_err(),
        stack
            .oneshot(request(pro_job()))
            .await
            .map(drop)
            .unwrap_err(),
    ];
    for e in busy {
        let busy = e.downcast_ref::<fairgate::Busy>().expect("busy");
        assert_eq!(busy.reason(), fairgate::WaitReason::Store, "{busy}");
    }
    assert!(
        sent.elapsed() < Duration::from_secs(1),
        "{:?}",
        sent.elapsed()
    );
}

/// Five workers queue for the one slot another holds, and go away (their stores dropped,
/// as a process killed): their entries in the tier's wait queue are gone within a worker
/// TTL (3 s) and a heartbeat of the worker left, far within a lease TTL (30 s), although no
/// release comes to find them. (Before: they stayed until a release reached each.)
async fn wait_queue_entries_of_workers_gone_expire_within_a_worker_ttl(target: Target) {
    let redis = target.start_own().await;
    let policy = one_slot_no_poll();
    let holder = answering_at_once(worker(&redis).await, policy.clone());
    let held = holder.oneshot(request(pro_job())).await.unwrap();
    for n in 1..=5 {
        let waiter = answering_at_once(worker(&redis).await, policy.clone());
        let call = tokio::spawn(async move { waiter.oneshot(request(pro_job())).await.map(drop) });
        let deadline = Instant::now() + Duration::from_secs(5);
        while queued(&redis, "pro") < n {
            assert!(Instant::now() < deadline, "worker {n} never queued");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        call.abort();
        let _ = call.await;
    }
    let gone = Instant::now();
    while queued(&redis, "pro") > 0 {
        assert!(
            gone.elapsed() < Duration::from_secs(8),
            "{} entries of workers gone still queued",
            queued(&redis, "pro")
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    println!(
        "{target:?}: 5 wait-queue entries of workers gone expired {:?} after they went",
        gone.elapsed()
    );
    drop(held);
}
