//! Managed Redis as teams run it: TLS (`rediss://`, rustls) with a CA the test made, and an
//! ACL user and password, on one node and on a Redis Cluster. A wrong CA or password is a
//! clear error at start; Redis not up is still a degraded start.
//!
//! Its own binary: in one binary with the other Redis tests the TLS cluster's stores
//! sometimes started degraded (their first connection over TLS timed out).
#![cfg(feature = "redis")]

mod support;

use std::time::Duration;

use crate::support::{
    CLUSTER_PASSWORD, CLUSTER_USER, EventCounter, RedisCluster, TLS_PASSWORD, TLS_USER, TempDir,
    TlsRedis,
};
use fairgate::store::RedisStoreError;
use fairgate::store::SlotLimits;
use fairgate::{Store, TenantId, Tier};
use tokio::time::Instant;

async fn tls_store(server: &TlsRedis, url: &str, ca: &[u8]) -> Result<Store, RedisStoreError> {
    let _ = server;
    Store::builder()
        .tls_ca_pem(ca.to_vec())
        .op_timeout(Duration::from_millis(500))
        .redis(url)
        .await
}

#[tokio::test]
async fn tls_with_the_right_ca_and_password_shares_state_on_redis() {
    let _turn = crate::support::file_turn(module_path!());
    let server = TlsRedis::start();
    let store = tls_store(&server, &server.url(), server.ca_pem())
        .await
        .expect("the right CA and password");
    assert!(!store.is_degraded());
    let tenant = TenantId::new("tls-tenant");
    store.record_throttle(&tenant).await;
    assert_eq!(store.throttle_count(&tenant).await, 1);
    let limits = SlotLimits {
        global: 2,
        tier: 2,
        tenant: None,
        lease_ttl: Duration::from_secs(5),
    };
    let lease = store.try_acquire_slot(&Tier::new("pro"), limits).await;
    assert!(lease.is_some());
    assert!(!store.is_degraded(), "the scripts ran over TLS");
    // It really is in the TLS server's data.
    assert_eq!(server.cli(&["ZCARD", "fairgate:{slots}:global"]), "1");
}

#[tokio::test]
async fn a_certificate_from_another_ca_is_a_tls_error_at_start() {
    let _turn = crate::support::file_turn(module_path!());
    let server = TlsRedis::start();
    let other = TempDir::new("other-ca");
    let wrong_ca = crate::support::make_certificate(other.path(), "other");
    let err = tls_store(&server, &server.url(), &wrong_ca)
        .await
        .expect_err("a server certificate the client does not trust");
    assert!(matches!(err, RedisStoreError::Tls(_)), "{err:?}");
    println!("wrong CA: {err}");
    assert!(
        err.to_string()
            .starts_with("tls connection to redis failed"),
        "{err}"
    );
}

#[tokio::test]
async fn a_wrong_password_or_user_is_an_auth_error_at_start() {
    let _turn = crate::support::file_turn(module_path!());
    let server = TlsRedis::start();
    for url in [
        server.url_with(TLS_USER, "not-the-password"),
        server.url_with("nobody", TLS_PASSWORD),
    ] {
        let err = tls_store(&server, &url, server.ca_pem())
            .await
            .expect_err("wrong credentials");
        assert!(matches!(err, RedisStoreError::Auth(_)), "{err:?}");
        println!("wrong credentials: {err}");
        assert!(!err.to_string().contains(TLS_PASSWORD), "{err}");
    }
}

#[tokio::test]
async fn a_tls_redis_not_up_yet_is_a_degraded_start_not_an_error() {
    let _turn = crate::support::file_turn(module_path!());
    let server = TlsRedis::start();
    let url = format!(
        "rediss://{TLS_USER}:{TLS_PASSWORD}@127.0.0.1:{}/",
        crate::support::RedisServer::unused_port()
    );
    let store = tls_store(&server, &url, server.ca_pem())
        .await
        .expect("Redis down at start is not an error");
    assert!(store.is_degraded());
}

#[tokio::test]
async fn a_ca_with_a_plain_url_is_refused_as_a_tls_error() {
    let _turn = crate::support::file_turn(module_path!());
    let server = TlsRedis::start();
    let url = format!("redis://127.0.0.1:{}/", server.port());
    let err = tls_store(&server, &url, server.ca_pem())
        .await
        .expect_err("a CA for a redis:// url");
    assert!(matches!(err, RedisStoreError::Tls(_)), "{err:?}");
}

// The same on a Redis Cluster: six TLS-only nodes (`--port 0`, TLS between the nodes and to
// the replicas too), every store connecting as the cluster's ACL user over `rediss://`.
// One cluster for these tests (they only read and write, under their own key prefixes).

async fn tls_cluster_store(
    cluster: &RedisCluster,
    urls: Vec<String>,
    ca: &[u8],
    prefix: &str,
) -> Result<Store, RedisStoreError> {
    let _ = cluster;
    Store::builder()
        .tls_ca_pem(ca.to_vec())
        .key_prefix(prefix)
        .op_timeout(Duration::from_millis(500))
        .redis_cluster(urls)
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_on_a_cluster_takes_and_releases_slots_and_sees_other_workers_leases() {
    let _turn = crate::support::file_turn(module_path!());
    let (events, _guard) = EventCounter::install();
    let cluster = RedisCluster::shared_tls();
    let prefix = "tls-slots";
    assert!(
        cluster
            .urls()
            .iter()
            .all(|url| url.starts_with("rediss://"))
    );
    let one = tls_cluster_store(cluster, cluster.urls(), cluster.ca_pem(), prefix)
        .await
        .expect("the right CA and password");
    let two = tls_cluster_store(cluster, cluster.urls(), cluster.ca_pem(), prefix)
        .await
        .expect("the right CA and password");
    assert!(!one.is_degraded() && !two.is_degraded());
    // Both stores listen for their wake-ups on the slot keys' shard (sharded pub/sub, a
    // channel each) and for cooldown moves, over TLS (subscribing takes a few handshakes).
    let global = format!("{prefix}:{{slots}}:global");
    let wakes = format!("{prefix}:{{slots}}:wake:*");
    let cooldowns = format!("{prefix}:cooldowns");
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let seen = (
            cluster.shard_channels(&global, &wakes).len(),
            cluster.subscribers(&cooldowns),
        );
        if seen == (2, 2) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not subscribed over TLS: {seen:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // Per-tenant scripts on every shard, over TLS.
    for i in 0..12 {
        let tenant = TenantId::new(format!("tls-tenant-{i}"));
        one.record_throttle(&tenant).await;
        assert_eq!(two.throttle_count(&tenant).await, 1);
    }

    // Slots: one worker's lease is seen by the other, the shared cap holds, the release
    // frees the slot for the other.
    let limits = SlotLimits {
        global: 1,
        tier: 1,
        tenant: None,
        lease_ttl: Duration::from_secs(30),
    };
    let tier = Tier::new("pro");
    let held = one.try_acquire_slot(&tier, limits).await.expect("a slot");
    assert!(held.is_shared(), "a lease in Redis, not a fallback slot");
    assert_eq!(two.slots_in_use(None).await, 1);
    assert!(two.try_acquire_slot(&tier, limits).await.is_none());
    assert_eq!(cluster.command(&global, &["ZCARD", &global]), "1");
    drop(held);
    let deadline = Instant::now() + Duration::from_secs(3);
    let lease = loop {
        if let Some(lease) = two.try_acquire_slot(&tier, limits).await {
            break lease;
        }
        assert!(Instant::now() < deadline, "the release never reached Redis");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    assert!(lease.is_shared());
    assert_eq!(one.slots_in_use(None).await, 1);
    drop(lease);
    let deadline = Instant::now() + Duration::from_secs(3);
    while cluster.command(&global, &["ZCARD", &global]) != "0" {
        assert!(Instant::now() < deadline, "the lease was not released");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(!one.is_degraded() && !two.is_degraded());
    assert_eq!(events.count("store.redis_error"), 0);
    assert_eq!(events.count("queue.redis_unavailable"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_password_or_user_on_a_tls_cluster_is_an_auth_error_at_start() {
    let _turn = crate::support::file_turn(module_path!());
    let cluster = RedisCluster::shared_tls();
    for urls in [
        cluster.urls_with(CLUSTER_USER, "not-the-password"),
        cluster.urls_with("nobody", CLUSTER_PASSWORD),
    ] {
        let err = tls_cluster_store(cluster, urls, cluster.ca_pem(), "tls-auth")
            .await
            .expect_err("wrong credentials");
        assert!(matches!(err, RedisStoreError::Auth(_)), "{err:?}");
        println!("tls cluster, wrong credentials: {err}");
        assert!(!err.to_string().contains(CLUSTER_PASSWORD), "{err}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_from_another_ca_on_a_tls_cluster_is_a_tls_error_at_start() {
    let _turn = crate::support::file_turn(module_path!());
    let cluster = RedisCluster::shared_tls();
    let other = TempDir::new("other-ca");
    let wrong_ca = crate::support::make_certificate(other.path(), "other");
    let err = tls_cluster_store(cluster, cluster.urls(), &wrong_ca, "tls-ca")
        .await
        .expect_err("a server certificate the client does not trust");
    assert!(matches!(err, RedisStoreError::Tls(_)), "{err:?}");
    println!("tls cluster, wrong CA: {err}");
    assert!(
        err.to_string()
            .starts_with("tls connection to redis failed"),
        "{err}"
    );
    // Without a CA of its own the store trusts the system's roots, which do not know the
    // test's CA either.
    let err = Store::builder()
        .redis_cluster(cluster.urls())
        .await
        .expect_err("the system's roots do not trust the test's CA");
    assert!(matches!(err, RedisStoreError::Tls(_)), "{err:?}");
}
