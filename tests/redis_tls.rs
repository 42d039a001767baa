//! Managed Redis as teams run it: TLS (`rediss://`, rustls) with a CA the test made, and an
//! ACL user and password. A wrong CA or password is a clear error at start; Redis not up is
//! still a degraded start.
#![cfg(feature = "redis")]

mod support;

use std::time::Duration;

use fairgate::store::RedisStoreError;
use fairgate::{SlotLimits, Store, TenantId, Tier};
use support::{TLS_PASSWORD, TLS_USER, TempDir, TlsRedis};

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
    let server = TlsRedis::start();
    let other = TempDir::new("other-ca");
    let wrong_ca = support::make_certificate(other.path(), "other");
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
    let server = TlsRedis::start();
    let url = format!(
        "rediss://{TLS_USER}:{TLS_PASSWORD}@127.0.0.1:{}/",
        support::RedisServer::unused_port()
    );
    let store = tls_store(&server, &url, server.ca_pem())
        .await
        .expect("Redis down at start is not an error");
    assert!(store.is_degraded());
}

#[tokio::test]
async fn a_ca_with_a_plain_url_is_refused_as_a_tls_error() {
    let server = TlsRedis::start();
    let url = format!("redis://127.0.0.1:{}/", server.port());
    let err = tls_store(&server, &url, server.ca_pem())
        .await
        .expect_err("a CA for a redis:// url");
    assert!(matches!(err, RedisStoreError::Tls(_)), "{err:?}");
}
