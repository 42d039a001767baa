//! The Redis store on a Redis Cluster of the test's own (6 `redis-server`s: 3 masters, 3
//! replicas, an ACL user): every operation runs without `CROSSSLOT`, releases and cooldown
//! moves reach every worker (sharded pub/sub), hostile tenant names spread over the shards
//! and never collide, a wrong password is an error at start. The multi-process and failover
//! cases are in `tests/fleet/faults.rs` (the same suite as on one node).

use std::collections::HashSet;
use std::time::Duration;

use crate::support::{CLUSTER_USER, EventCounter, RedisCluster, slot_limits};
use fairgate::DemotionPolicy;
use fairgate::store::PaceLimit;
use fairgate::store::RedisStoreError;
use fairgate::{Store, TenantId, Tier};
use tokio::time::Instant;

/// One cluster at a time: six processes each, on two cores.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

async fn worker(nodes: Vec<String>) -> Store {
    Store::builder()
        .op_timeout(Duration::from_millis(300))
        .probe_interval(Duration::from_millis(25))
        .flush_interval(Duration::from_millis(25))
        .cache_ttl(Duration::from_millis(50))
        .redis_cluster(nodes)
        .await
        .expect("a store on the cluster")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_operation_runs_on_the_cluster_and_reaches_every_worker() {
    let _turn = crate::support::file_turn(module_path!());
    let _serial = SERIAL.lock().await;
    let (events, _guard) = EventCounter::install();
    let cluster = RedisCluster::start();
    let one = worker(cluster.urls()).await;
    let two = worker(cluster.urls()).await;
    assert!(!one.is_degraded() && !two.is_degraded());

    // Per-tenant scripts (each on its tenant's shard), batched counts, demotion.
    let tenant = TenantId::new("acme");
    for _ in 0..5 {
        one.record_throttle(&tenant).await;
    }
    assert_eq!(two.throttle_count(&tenant).await, 5);
    one.add_tokens(&tenant, 1_000);
    one.flush().await;
    assert_eq!(two.tokens_today(&tenant).await, 1_000);
    assert!(one.set_daily_budget(&tenant, Some(10)).await.is_ok());
    assert_eq!(two.daily_budget(&tenant).await, Some(10));
    let demotion = two
        .check_demotion(&tenant, &DemotionPolicy::default())
        .await;
    assert!(demotion.is_demoted());
    assert!(one.demoted_for(&tenant).await.is_some());
    one.add_served_cost(&tenant, 7);
    one.flush().await;
    assert_eq!(two.served_cost(&tenant).await, 7);
    // Global scripts: pacing, cooldown gates.
    let rpm = [PaceLimit {
        per_minute: 600,
        burst: 10,
        cells: 1,
    }];
    assert_eq!(one.pace("api", &rpm).await, Duration::ZERO);

    // Cooldown moves reach the other worker through pub/sub.
    one.extend_cooldown("api.example", Duration::from_secs(5))
        .await;
    let deadline = Instant::now() + Duration::from_secs(2);
    while two.cooldown("api.example").is_none() {
        assert!(
            Instant::now() < deadline,
            "the cooldown never reached worker two"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }

    // Slots: shared caps; wake-ups sent on the slot keys' shard (sharded pub/sub), to which
    // each store listens on one connection.
    let tier = Tier::new("pro");
    let held = one
        .try_acquire_slot(&tier, slot_limits(1))
        .await
        .expect("a slot");
    assert!(two.try_acquire_slot(&tier, slot_limits(1)).await.is_none());
    assert_eq!(two.slots_in_use(None).await, 1);
    drop(held);
    let deadline = Instant::now() + Duration::from_secs(2);
    while two.try_acquire_slot(&tier, slot_limits(1)).await.is_none() {
        assert!(Instant::now() < deadline, "the release never reached Redis");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Each store listens for its wake-ups on a channel of its own, sharded with the slots.
    let channels = cluster.shard_channels("fairgate:{slots}:global", "fairgate:{slots}:wake:*");
    println!("cluster: PUBSUB SHARDCHANNELS fairgate:{{slots}}:wake:*: {channels:?}");
    assert_eq!(
        channels.len(),
        2,
        "one wake-up channel per store: {channels:?}"
    );
    for channel in &channels {
        assert_eq!(cluster.shard_subscribers(channel), 1, "{channel}");
    }

    assert!(!one.is_degraded() && !two.is_degraded());
    assert_eq!(
        events.count("store.redis_error"),
        0,
        "a script was refused (CROSSSLOT?)"
    );
    assert_eq!(events.count("queue.redis_unavailable"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_tenant_names_spread_over_the_shards_and_never_collide() {
    let _turn = crate::support::file_turn(module_path!());
    let _serial = SERIAL.lock().await;
    let cluster = RedisCluster::start();
    let store = worker(cluster.urls()).await;
    let mut names: Vec<String> = [
        "{slots}",
        "{g}",
        "}",
        "{",
        "a}:b",
        "{t:x}",
        "%7B",
        "a b",
        "new\nline",
        "*",
        "",
        "ünï",
        "fairgate:{slots}:global",
        "x}:throttles",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    names.extend((0..40).map(|i| format!("tenant-{i}")));
    for (i, name) in names.iter().enumerate() {
        let tenant = TenantId::new(name.as_str());
        for _ in 0..=i % 3 {
            store.record_throttle(&tenant).await;
        }
    }
    assert!(!store.is_degraded());
    // Every name has its own count: none collided.
    for (i, name) in names.iter().enumerate() {
        let count = store.throttle_count(&TenantId::new(name.as_str())).await;
        assert_eq!(count as usize, i % 3 + 1, "tenant {name:?}");
    }
    // Every master holds some tenants' keys, and no slot key sits with the tenants' keys by
    // accident of a name: a name never reaches the `{slots}` or `{g}` tags.
    let masters = cluster.masters();
    assert_eq!(masters.len(), 3);
    let mut all = HashSet::new();
    for &port in &masters {
        let keys: Vec<String> = cluster
            .keys_on(port)
            .into_iter()
            .filter(|k| k.ends_with(":throttles"))
            .collect();
        println!("master {port}: {} tenants' throttle keys", keys.len());
        assert!(!keys.is_empty(), "master {port} holds no tenant keys");
        for key in keys {
            assert!(key.starts_with("fairgate:{t:"), "{key:?}");
            assert!(all.insert(key));
        }
    }
    assert_eq!(all.len(), names.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_cluster_password_is_an_auth_error_and_a_dead_cluster_a_degraded_start() {
    let _turn = crate::support::file_turn(module_path!());
    let _serial = SERIAL.lock().await;
    let cluster = RedisCluster::start();
    let wrong: Vec<String> = cluster
        .urls()
        .iter()
        .map(|url| url.replace(crate::support::CLUSTER_PASSWORD, "wrong"))
        .collect();
    let err = Store::redis_cluster(wrong)
        .await
        .expect_err("a wrong password");
    assert!(matches!(err, RedisStoreError::Auth(_)), "{err:?}");
    println!("wrong cluster password: {err}");
    assert!(err.to_string().contains("credentials"));
    drop(cluster);

    let port = crate::support::RedisServer::unused_port();
    let started = Instant::now();
    let store = Store::redis_cluster(vec![format!("redis://{CLUSTER_USER}:x@127.0.0.1:{port}/")])
        .await
        .expect("no cluster up is a degraded start, not an error");
    assert!(store.is_degraded());
    assert!(started.elapsed() < Duration::from_secs(1));
    assert!(
        store
            .try_acquire_slot(&Tier::new("pro"), slot_limits(2))
            .await
            .is_some()
    );
}
