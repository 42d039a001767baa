//! The tonic adapter against a real gRPC server on loopback (tonic-health's `Health`
//! service, so no protoc): calls admitted by a client-side stack around a `Channel` and by a
//! server-side stack around the handlers, rejections arriving as gRPC statuses, slots held
//! for exactly as long as a response runs.

use std::net::SocketAddr;
use std::time::Duration;

use fairgate::extract::JobLayer;
use fairgate::extract::{FromHeaders, KeyTable};
use fairgate::retry_after_backoff::SendOnce;
use fairgate::tonic::{GRPC_RETRY_PUSHBACK_MS, GrpcRejectionLayer, RETRY_AFTER_MS};
use fairgate::{FairgateLayer, Job, Origin, SlotPolicy, Store};
use tokio::sync::oneshot;
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Channel, Server};
use tonic::{Code, Status};
use tonic_health::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::{HealthCheckRequest, HealthCheckResponse};
use tower::ServiceBuilder;

/// Free users: one call at a time, and they never wait.
fn capped_free_tier() -> SlotPolicy {
    SlotPolicy::builder()
        .global_max(10)
        .tier("free", 1, Duration::ZERO)
        .build()
        .unwrap()
}

fn stack(store: &Store) -> FairgateLayer<SendOnce> {
    FairgateLayer::builder(store.clone())
        .slots(capped_free_tier())
        .build()
        .unwrap()
        .clone_requests_with(SendOnce)
}

/// A running server; stops when dropped.
struct Running {
    addr: SocketAddr,
    _stop: oneshot::Sender<()>,
}

/// A Health server on a loopback port whose handlers are admitted by the stack on `store`,
/// the job from the `x-api-key` metadata.
async fn admitted_server(store: &Store) -> Running {
    let keys = KeyTable::new().key("sk-free", "team-free", "free").key(
        "sk-premium",
        "team-premium",
        "premium",
    );
    let admission = ServiceBuilder::new()
        .layer(GrpcRejectionLayer::new())
        .layer(JobLayer::new(FromHeaders::new().keys(keys)))
        .layer(stack(store))
        .into_inner();
    let (_reporter, health) = tonic_health::server::health_reporter();
    let incoming = TcpIncoming::bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = incoming.local_addr().unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let mut server = Server::builder().layer(admission);
    let router = server.add_service(health);
    tokio::spawn(async move {
        router
            .serve_with_incoming_shutdown(incoming, async {
                let _ = stopped.await;
            })
            .await
            .unwrap();
    });
    Running { addr, _stop: stop }
}

/// A Health server with no admission at all.
async fn plain_server() -> Running {
    let (_reporter, health) = tonic_health::server::health_reporter();
    let incoming = TcpIncoming::bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = incoming.local_addr().unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    tokio::spawn(async move {
        Server::builder()
            .add_service(health)
            .serve_with_incoming_shutdown(incoming, async {
                let _ = stopped.await;
            })
            .await
            .unwrap();
    });
    Running { addr, _stop: stop }
}

async fn channel(addr: SocketAddr) -> Channel {
    Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap()
}

/// A check of the server's overall health, with `key` as `x-api-key` metadata (if any) and
/// `job` in the extensions (if any).
fn check(key: Option<&str>, job: Option<Job>) -> tonic::Request<HealthCheckRequest> {
    let mut request = tonic::Request::new(HealthCheckRequest {
        service: String::new(),
    });
    if let Some(key) = key {
        request
            .metadata_mut()
            .insert("x-api-key", key.parse().unwrap());
    }
    if let Some(job) = job {
        request.extensions_mut().insert(job);
    }
    request
}

fn free_job() -> Job {
    Job::new("team-free", Origin::UserAction).with_tier("free")
}

/// Waits (up to 2 s) until `store` holds `n` slots.
async fn slots_become(store: &Store, n: u32) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
    loop {
        let held = store.slots_in_use(None).await;
        if held == n {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{held} slots held, expected {n}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn meta<'a>(status: &'a Status, key: &str) -> Option<&'a str> {
    status.metadata().get(key).and_then(|v| v.to_str().ok())
}

#[tokio::test]
async fn a_call_succeeds_through_client_and_server_stacks() {
    let _turn = crate::support::file_turn(module_path!());
    let server_store = Store::memory();
    let server = admitted_server(&server_store).await;
    let client_store = Store::memory();
    let admitted = ServiceBuilder::new()
        .layer(GrpcRejectionLayer::new())
        .layer(stack(&client_store))
        .service(channel(server.addr).await);
    let mut client = HealthClient::new(admitted);

    for _ in 0..3 {
        let response = client
            .check(check(Some("sk-premium"), Some(free_job())))
            .await
            .unwrap();
        assert_eq!(
            response.into_inner().status(),
            ServingStatus::Serving.into()
        );
    }
    slots_become(&client_store, 0).await;
    slots_become(&server_store, 0).await;
}

#[tokio::test]
async fn a_busy_server_answers_unavailable_with_retry_after_metadata() {
    let _turn = crate::support::file_turn(module_path!());
    let store = Store::memory();
    let server = admitted_server(&store).await;
    let mut client = HealthClient::new(channel(server.addr).await);

    // A free user's server stream holds the free tier's only slot while it runs.
    let mut watch = client
        .watch(check(Some("sk-free"), None))
        .await
        .unwrap()
        .into_inner();
    let first: HealthCheckResponse = watch.message().await.unwrap().unwrap();
    assert_eq!(first.status(), ServingStatus::Serving.into());
    slots_become(&store, 1).await;

    let status = client
        .check(check(Some("sk-free"), None))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert!(status.message().starts_with("server busy"), "{status:?}");
    let retry_after_ms: u64 = meta(&status, RETRY_AFTER_MS).unwrap().parse().unwrap();
    assert!(retry_after_ms > 0);
    assert_eq!(
        meta(&status, GRPC_RETRY_PUSHBACK_MS),
        Some(retry_after_ms.to_string().as_str())
    );

    // Another tier is not blocked by the capped one.
    client.check(check(Some("sk-premium"), None)).await.unwrap();

    // The stream's end gives the slot back, and free users get in again.
    drop(watch);
    slots_become(&store, 0).await;
    client.check(check(Some("sk-free"), None)).await.unwrap();
    slots_become(&store, 0).await;
}

#[tokio::test]
async fn a_missing_or_unknown_key_is_unauthenticated() {
    let _turn = crate::support::file_turn(module_path!());
    let store = Store::memory();
    let server = admitted_server(&store).await;
    let mut client = HealthClient::new(channel(server.addr).await);

    for key in [None, Some("sk-who-knows")] {
        let status = client.check(check(key, None)).await.unwrap_err();
        assert_eq!(status.code(), Code::Unauthenticated, "{key:?}: {status:?}");
        assert_eq!(meta(&status, GRPC_RETRY_PUSHBACK_MS), Some("-1"));
        assert_eq!(meta(&status, RETRY_AFTER_MS), None);
    }
    assert_eq!(store.slots_in_use(None).await, 0);
}

#[tokio::test]
async fn the_client_stack_holds_a_slot_until_the_response_ends() {
    let _turn = crate::support::file_turn(module_path!());
    let server = plain_server().await;
    let store = Store::memory();
    let admitted = ServiceBuilder::new()
        .layer(GrpcRejectionLayer::new())
        .layer(stack(&store))
        .service(channel(server.addr).await);
    let mut client = HealthClient::new(admitted);

    // A unary call: the slot is given back with its trailers.
    client.check(check(None, Some(free_job()))).await.unwrap();
    assert_eq!(store.slots_in_use(None).await, 0);

    // A stream: its headers and first message are in, the call still runs, the slot is held.
    let mut watch = client
        .watch(check(None, Some(free_job())))
        .await
        .unwrap()
        .into_inner();
    watch.message().await.unwrap().unwrap();
    assert_eq!(store.slots_in_use(None).await, 1);

    // Refused on this side, before anything is sent: a status, not a transport error.
    let status = client
        .check(check(None, Some(free_job())))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert!(meta(&status, RETRY_AFTER_MS).is_some());

    drop(watch);
    assert_eq!(store.slots_in_use(None).await, 0);
    client.check(check(None, Some(free_job()))).await.unwrap();
}

#[tokio::test]
async fn a_client_call_without_a_job_is_an_internal_error() {
    let _turn = crate::support::file_turn(module_path!());
    let server = plain_server().await;
    let admitted = ServiceBuilder::new()
        .layer(GrpcRejectionLayer::new())
        .layer(stack(&Store::memory()))
        .service(channel(server.addr).await);
    let status = HealthClient::new(admitted)
        .check(check(None, None))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Internal, "{status:?}");
}
