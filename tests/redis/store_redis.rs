//! The Redis store across workers and through outages, against real throwaway servers: each
//! rule on one node and on a Redis Cluster (3 masters, 3 replicas), one body for both
//! (`support::on_node_and_cluster!`). On the cluster "Redis killed" is the master that owns
//! the slot keys SIGKILLed, its replica taking over (the tenants a test watches are picked
//! on that master, so what they touch goes away with it, as with the one node).

use std::convert::Infallible;
use std::time::Duration;

use crate::support::{EventCounter, Redis, Target, on_node_and_cluster, request, wait_until};
use fairgate::{DemotionPolicy, Job, Origin, Priority, PriorityClassifyLayer, Store, TenantId};
use tokio::time::{Instant, timeout};
use tower::{Layer, ServiceExt, service_fn};

const CACHE_TTL: Duration = Duration::from_millis(100);

/// A second per operation: on a loaded 2-core machine a cluster call now and then takes
/// over 100 ms, and a store that times out answers from local state for a moment, which
/// these tests would read as a broken rule. The timeout test sets its own.
fn options() -> fairgate::StoreBuilder {
    Store::builder()
        .cache_ttl(CACHE_TTL)
        .op_timeout(Duration::from_secs(1))
        .probe_interval(Duration::from_millis(20))
}

async fn worker(redis: &Redis) -> Store {
    redis
        .store(options())
        .await
        .expect("a valid url always gives a store")
}

async fn classify(store: &Store, job: Job) -> Priority {
    let inner = service_fn(|req: http::Request<()>| async move {
        Ok::<_, Infallible>(req.extensions().get::<Job>().and_then(Job::priority))
    });
    let service = PriorityClassifyLayer::new(store.clone()).layer(inner);
    // Bounded: classify must answer whatever state Redis is in.
    timeout(Duration::from_secs(2), service.oneshot(request(job)))
        .await
        .expect("classify answered in time")
        .expect("classify never fails because of the store")
        .expect("a priority is set")
}

fn chat(tenant: &str) -> Job {
    Job::new(tenant, Origin::UserAction)
}

on_node_and_cluster!(
    a_demotion_through_one_worker_holds_on_another_within_the_cache_time,
    redis_killed_mid_run_classify_keeps_answering_and_the_store_comes_back,
    a_stalled_redis_at_start_costs_one_timeout_then_the_store_starts_degraded,
    redis_down_at_start_gives_a_working_degraded_store_without_blocking,
    token_counts_batched_during_an_outage_reach_redis_after_it,
    a_flush_waits_for_the_one_the_background_task_has_under_way,
    a_bad_url_or_prefix_is_refused_with_a_message,
    each_store_listens_on_one_pub_sub_connection_for_both_feeds,
    a_settlements_correction_moves_the_days_count_both_ways_never_below_zero,
    the_budget_left_comes_with_the_demotion_check_and_costs_no_round_trip,
    the_tenants_served_most_are_the_fleets_in_one_ranking,
    a_tenant_without_a_budget_is_checked_on_redis_as_any_other,
);

async fn a_demotion_through_one_worker_holds_on_another_within_the_cache_time(target: Target) {
    let (events, _guard) = EventCounter::install();
    let redis = target.start().await;
    let (one, two) = (worker(&redis).await, worker(&redis).await);
    let tenant = TenantId::new("runaway");

    // Worker two has a fresh "not demoted" answer cached.
    assert_eq!(classify(&two, chat("runaway")).await, Priority::Critical);
    for _ in 0..5 {
        one.record_throttle(&tenant).await;
    }
    assert_eq!(classify(&one, chat("runaway")).await, Priority::Batch);

    tokio::time::sleep(CACHE_TTL).await;
    assert_eq!(
        classify(&two, chat("runaway")).await,
        Priority::Batch,
        "degraded: one {}, two {}, unavailable {}",
        one.is_degraded(),
        two.is_degraded(),
        events.count("queue.redis_unavailable")
    );
    assert!(two.demoted_for(&tenant).await.is_some());
}

async fn redis_killed_mid_run_classify_keeps_answering_and_the_store_comes_back(target: Target) {
    let (events, _guard) = EventCounter::install();
    let mut redis = target.start_own().await;
    let store = worker(&redis).await;
    let steady = redis.tenant_by_the_slots("steady");
    let tenant = TenantId::new(steady.as_str());
    // For the second outage, picked while the cluster still knows its masters.
    let second: Vec<String> = (0..10)
        .map(|i| redis.tenant_by_the_slots(&format!("second-{i}")))
        .collect();

    assert_eq!(classify(&store, chat(&steady)).await, Priority::Critical);
    assert!(!store.is_degraded());

    redis.kill_slots_master();
    // Every request is still answered, from in-process state; the outage is logged once.
    for i in 0..50 {
        let job = if i % 2 == 0 {
            chat(&steady)
        } else {
            chat(&format!("t{i}"))
        };
        assert_eq!(classify(&store, job).await, Priority::Critical);
    }
    assert!(store.is_degraded());
    assert_eq!(events.count("queue.redis_unavailable"), 1);
    // Local rules still hold while degraded: five throttles demote here.
    for _ in 0..5 {
        store.record_throttle(&TenantId::new("local-runaway")).await;
    }
    assert_eq!(
        classify(&store, chat("local-runaway")).await,
        Priority::Batch
    );

    // Back on Redis by itself once it answers: the restarted node has no scripts; on a
    // cluster the promoted replica has none loaded by this store.
    let promoted = redis.bring_back();
    wait_until("the store is back on redis", || !store.is_degraded()).await;
    if redis.is_cluster() {
        println!("cluster: replica promoted {promoted:?} after the kill");
    }
    assert_eq!(events.count("queue.redis_recovered"), 1);
    assert_eq!(events.count("queue.redis_unavailable"), 1, "no flapping");
    for _ in 0..5 {
        store.record_throttle(&tenant).await;
    }
    // A brand-new worker sees what went through the scripts on the restarted server.
    let other = worker(&redis).await;
    assert_eq!(other.throttle_count(&tenant).await, 5);
    assert_eq!(classify(&other, chat(&steady)).await, Priority::Batch);

    // A second outage is a second log line, not one per call (on a cluster: the promoted
    // master killed too, its shard has no replica left).
    redis.kill_slots_master();
    for name in &second {
        classify(&store, chat(name)).await;
    }
    // One line for `store`, and one for `other` if its subscription was up when the server
    // closed it (it sends nothing else).
    let lines = events.count("queue.redis_unavailable");
    assert!(
        (2..=3).contains(&lines),
        "{lines} lines for the second outage"
    );
}

async fn a_stalled_redis_at_start_costs_one_timeout_then_the_store_starts_degraded(target: Target) {
    let redis = target.start_alone().await;
    // Longer than the start-up's timeouts, shorter than the cluster's node timeout.
    redis.stall(0.5);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let started = Instant::now();
    let store = redis
        .store(options().op_timeout(Duration::from_millis(100)))
        .await
        .unwrap();
    let took = started.elapsed();
    assert!(store.is_degraded());
    assert!(took >= Duration::from_millis(100), "{took:?}");
    assert!(
        took < Duration::from_millis(190),
        "{took:?}: more than one timeout"
    );
}

async fn redis_down_at_start_gives_a_working_degraded_store_without_blocking(target: Target) {
    let started = Instant::now();
    let store = timeout(Duration::from_secs(2), target.unreachable_store(options()))
        .await
        .expect("creating the store does not wait for redis")
        .expect("redis down is not an error");
    assert!(started.elapsed() < Duration::from_secs(1));
    assert!(store.is_degraded());
    assert_eq!(store.backend_name(), "redis");

    let tenant = TenantId::new("early");
    assert_eq!(classify(&store, chat("early")).await, Priority::Critical);
    for _ in 0..5 {
        assert!(store.record_throttle(&tenant).await >= 1);
    }
    assert_eq!(classify(&store, chat("early")).await, Priority::Batch);
    store.add_tokens(&tenant, 10);
    assert_eq!(store.tokens_today(&tenant).await, 10 + 1 + 1);
    // A budget written while degraded holds here and says it did not reach Redis.
    assert!(store.set_daily_budget(&tenant, Some(5)).await.is_err());
}

async fn token_counts_batched_during_an_outage_reach_redis_after_it(target: Target) {
    let mut redis = target.start_own().await;
    let store = worker(&redis).await;
    let name = redis.tenant_by_the_slots("counted");
    let tenant = TenantId::new(name.as_str());
    store.add_tokens(&tenant, 100);
    store.flush().await;
    assert_eq!(store.tokens_today(&tenant).await, 100);
    // On a cluster the replica has the 100 before its master dies.
    redis.wait_replicated(&redis.key(&format!("{{t:{name}}}:x")));

    redis.kill_slots_master();
    store.record_throttle(&tenant).await; // notices the outage
    assert!(store.is_degraded());
    store.add_tokens(&tenant, 50);
    redis.bring_back();
    wait_until("the store is back on redis", || !store.is_degraded()).await;
    store.flush().await;
    // What was batched during the outage arrives, once: on a node restarted empty (no
    // persistence) alone, on a cluster's promoted replica on top of what it had.
    let kept = if redis.is_cluster() { 100 } else { 0 };
    assert_eq!(
        store.tokens_today(&tenant).await,
        kept + 50,
        "degraded: {}",
        store.is_degraded()
    );
}

/// A settled call corrects its tenant's count for the day by its use minus its charge
/// (`Store::correct_tokens`, batched with the additions): down, up, and never below 0.
async fn a_settlements_correction_moves_the_days_count_both_ways_never_below_zero(target: Target) {
    let redis = target.start_own().await;
    let store = worker(&redis).await;
    let name = redis.tenant_by_the_slots("settled");
    let tenant = TenantId::new(name.as_str());
    // Charged 20,000 when it went, used 500.
    store.add_tokens(&tenant, 20_000);
    store.correct_tokens(&tenant, -19_500);
    store.flush().await;
    assert_eq!(store.tokens_today(&tenant).await, 500);
    store.correct_tokens(&tenant, 300_000);
    store.flush().await;
    assert_eq!(store.tokens_today(&tenant).await, 300_500);
    store.correct_tokens(&tenant, -1_000_000);
    store.flush().await;
    assert_eq!(store.tokens_today(&tenant).await, 0);
}

/// What a tenant has left of its budget is read without a round trip: Redis's count as the
/// last demotion check read it, this worker's counts since, per tenant; the other workers'
/// counts show from the next check.
async fn the_budget_left_comes_with_the_demotion_check_and_costs_no_round_trip(target: Target) {
    let redis = target.start().await;
    // Sent only when flushed here: what is unsent at a check is known.
    let store = redis
        .store(options().flush_interval(Duration::from_secs(600)))
        .await
        .unwrap();
    let other = worker(&redis).await;
    let policy = DemotionPolicy::default();
    let (a, b) = (TenantId::new("svc/a"), TenantId::new("svc/b"));
    assert_eq!(
        store.budget_left(&a, &policy),
        None,
        "never checked: not known"
    );
    store.set_daily_budget(&a, Some(10_000)).await.unwrap();
    store.add_tokens(&a, 1_000);
    store.flush().await;
    assert!(!store.check_demotion(&a, &policy).await.is_demoted());
    assert_eq!(store.budget_left(&a, &policy), Some(9_000));
    // Counted here, not sent yet: in it at once.
    store.add_tokens(&a, 500);
    store.correct_tokens(&a, -100);
    assert_eq!(store.budget_left(&a, &policy), Some(8_600));
    store.check_demotion(&b, &policy).await;
    assert_eq!(
        store.budget_left(&b, &policy),
        Some(policy.default_daily_budget()),
        "each tenant its own"
    );
    // Another worker's count: from the next check, with this worker's unsent ones still in.
    other.add_tokens(&a, 2_000);
    other.flush().await;
    assert_eq!(store.budget_left(&a, &policy), Some(8_600));
    tokio::time::sleep(CACHE_TTL).await;
    store.check_demotion(&a, &policy).await;
    assert_eq!(
        store.budget_left(&a, &policy),
        Some(10_000 - 1_000 - 400 - 2_000),
        "degraded: {}",
        store.is_degraded()
    );
}

/// A budget past what a Lua script counts exactly (none: `u64::MAX`, by the policy or set
/// for the tenant) is checked as none: no demotion, no error, the store stays on Redis.
/// (Redis answers such a number as `i64::MIN`, which the client refuses as a reply.)
async fn a_tenant_without_a_budget_is_checked_on_redis_as_any_other(target: Target) {
    let redis = target.start().await;
    let store = worker(&redis).await;
    let unlimited = DemotionPolicy::builder()
        .default_daily_budget(u64::MAX)
        .build()
        .unwrap();
    let (a, b) = (TenantId::new("svc/a"), TenantId::new("svc/b"));
    store.set_daily_budget(&b, Some(u64::MAX)).await.unwrap();
    store.add_tokens(&a, 1_000_000);
    store.add_tokens(&b, 1_000_000);
    store.flush().await;
    for (tenant, policy) in [(&a, &unlimited), (&b, &DemotionPolicy::default())] {
        assert!(!store.check_demotion(tenant, policy).await.is_demoted());
        assert!(!store.is_degraded(), "{tenant}: the check's answer is read");
        // As the memory store counts it: none, less what was used.
        let left = Some(u64::MAX - 1_000_000);
        assert_eq!(store.budget_left(tenant, policy), left, "{tenant}");
    }
}

/// The tenants served most are the fleet's: every worker's sends add up in one ranking,
/// most first, with the total of all, read in one call.
async fn the_tenants_served_most_are_the_fleets_in_one_ranking(target: Target) {
    let redis = target.start().await;
    let (one, two) = (worker(&redis).await, worker(&redis).await);
    let t = TenantId::new;
    one.add_served_cost(&t("svc/a"), 100);
    two.add_served_cost(&t("svc/a"), 50);
    two.add_served_cost(&t("svc/b"), 120);
    one.add_served_cost(&t("svc/c"), 10);
    one.flush().await;
    two.flush().await;
    let top = two.top_served(2).await;
    assert_eq!(
        top.tenants,
        [(t("svc/a"), 150), (t("svc/b"), 120)],
        "degraded: {}",
        two.is_degraded()
    );
    assert_eq!(top.total, 280);
}

/// `flush` is a barrier: when it is ready, every count added before it is in Redis, even
/// when the background task took them just before and is still sending them (Redis slow
/// here). Finding the batch empty, a flush returned at once, and a read right after an
/// outage saw 100 of 150 tokens.
async fn a_flush_waits_for_the_one_the_background_task_has_under_way(target: Target) {
    let redis = target.start_own().await;
    let store = redis
        .store(options().flush_interval(Duration::from_millis(20)))
        .await
        .unwrap();
    let tenant = TenantId::new("counted");
    // Redis answers nothing for 0.6 s (less than the store's timeouts: not an outage); the
    // background flush takes the batch within 20 ms and waits for Redis.
    redis.stall(0.6);
    store.add_tokens(&tenant, 100);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let asked = Instant::now();
    store.flush().await;
    let took = asked.elapsed();
    assert!(
        took >= Duration::from_millis(300),
        "flush was ready after {took:?}, before the flush under way was answered"
    );
    assert!(!store.is_degraded());
    assert_eq!(store.tokens_today(&tenant).await, 100);
}

async fn a_bad_url_or_prefix_is_refused_with_a_message(target: Target) {
    let err = target
        .store_at(Store::builder(), "not a url")
        .await
        .expect_err("bad url");
    assert!(err.to_string().starts_with("invalid redis url"), "{err}");
    let err = target
        .store_at(Store::builder().key_prefix("a{b"), "redis://127.0.0.1:1/")
        .await
        .expect_err("bad prefix");
    assert!(err.to_string().contains("key prefix"), "{err}");
    let err = target
        .store_at(
            Store::builder().op_timeout(Duration::ZERO),
            "redis://127.0.0.1:1/",
        )
        .await
        .expect_err("zero timeout");
    assert!(err.to_string().contains("op timeout"), "{err}");
}

async fn each_store_listens_on_one_pub_sub_connection_for_both_feeds(target: Target) {
    let redis = target.start().await;
    let stores = [worker(&redis).await, worker(&redis).await];
    let deadline = Instant::now() + Duration::from_secs(2);
    match redis.cluster() {
        // One cluster connection per store: its own wake-up channel sharded (`SSUBSCRIBE`)
        // on the slot keys' master, the cooldown channel plain. Other tests share this
        // cluster, so count this test's channels, not connections: each store once on each.
        Some(cluster) => loop {
            let global = redis.key("{slots}:global");
            let wakes = cluster.shard_channels(&global, &redis.key("{slots}:wake:*"));
            let cooldowns = redis.key("cooldowns");
            let seen = (
                wakes.len(),
                wakes
                    .iter()
                    .map(|c| cluster.shard_subscribers(c))
                    .sum::<u32>(),
                cluster.subscribers(&cooldowns),
            );
            if seen == (2, 2, 2) {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "not one subscription per store and feed: {seen:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        },
        None => loop {
            let clients = redis.slots_cli(&["CLIENT", "LIST"]);
            // A subscribed connection shows `sub=2` (its wake-up and the cooldown channels).
            let subscribed: Vec<&str> = clients.lines().filter(|l| l.contains(" sub=")).collect();
            let listening = subscribed.iter().filter(|l| !l.contains(" sub=0 ")).count();
            if listening == 2 {
                assert!(
                    subscribed
                        .iter()
                        .filter(|l| !l.contains(" sub=0 "))
                        .all(|l| l.contains(" sub=2 ")),
                    "{clients}"
                );
                break;
            }
            assert!(
                Instant::now() < deadline,
                "not one pub/sub connection per store: {clients}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        },
    }
    // And a cooldown moved in one store reaches the other through it.
    stores[0]
        .extend_cooldown("api", Duration::from_secs(5))
        .await;
    let stores1 = stores[1].clone();
    wait_until("the cooldown reached the other store", move || {
        stores1.cooldown("api").is_some()
    })
    .await;
}

/// A killed Redis is noticed when the store's subscription closes, not when an operation
/// next fails: a store with nothing to send (its callers wait for wake-ups, its heartbeat
/// is a second away) and a 5 s operation timeout is degraded within 100 ms. Without that
/// it was noticed at the next heartbeat, after its calls had ended, and the slots they held
/// were lost to its share of the outage. One node: a cluster's client reconnects its
/// subscriptions by itself, and a node of it going away is not the slots' master going away.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_redis_is_noticed_when_the_subscription_closes() {
    let _turn = crate::support::file_turn(module_path!());
    let mut server = crate::support::RedisServer::start();
    let store = options()
        .op_timeout(Duration::from_secs(5))
        .redis(&server.url())
        .await
        .expect("a store");
    wait_until("the store subscribed", || {
        server.command("CLIENT LIST").contains(" sub=2 ")
    })
    .await;
    server.kill();
    let killed = Instant::now();
    wait_until("the store noticed", || store.is_degraded()).await;
    let noticed = killed.elapsed();
    println!("a killed redis noticed after {noticed:?}");
    assert!(
        noticed < Duration::from_millis(100),
        "noticed after {noticed:?}"
    );
}
