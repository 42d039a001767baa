//! fairgate around gRPC with tonic, both sides, on loopback.
//!
//! Run with `cargo run --example tonic_grpc --features tonic` (add `RUST_LOG=fairgate=debug`
//! for the layers' logs; `-- --listen 127.0.0.1:50051` to pick the port). It starts a gRPC
//! server (tonic-health's `grpc.health.v1.Health`, so no protoc is needed) whose handlers are
//! admitted by the four layers — the job from the `x-api-key` metadata, free users one call
//! at a time and never waiting — and calls it through a client `Channel` wrapped in the
//! layers too. It prints what each call got: an answer, or a gRPC status carrying the retry
//! information in metadata.

use std::net::SocketAddr;
use std::time::Duration;

use fairgate::extract::JobLayer;
use fairgate::extract::{FromHeaders, KeyTable};
use fairgate::retry_after_backoff::SendOnce;
use fairgate::tonic::{GRPC_RETRY_PUSHBACK_MS, GrpcRejectionLayer, RETRY_AFTER_MS};
use fairgate::{BoxError, FairgateLayer, Job, Origin, SlotPolicy, Store};
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Channel, Server};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;
use tower::ServiceBuilder;
use tracing_subscriber::EnvFilter;

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::from_default_env())
        .init();
    let listen: SocketAddr = match std::env::args().skip_while(|a| a != "--listen").nth(1) {
        Some(addr) => addr.parse()?,
        None => "127.0.0.1:0".parse()?,
    };
    let slots = SlotPolicy::builder()
        .global_max(10)
        .tier("free", 1, Duration::ZERO) // free users: one call at a time, no waiting
        .build()?;

    // --- Server (ingress): every handler admitted by the stack. ---
    let server_store = Store::memory();
    let keys = KeyTable::new().key("sk-free", "team-free", "free").key(
        "sk-premium",
        "team-premium",
        "premium",
    );
    let admission = ServiceBuilder::new()
        .layer(GrpcRejectionLayer::new()) // rejections answer as gRPC statuses
        .layer(JobLayer::new(FromHeaders::new().keys(keys))) // metadata are HTTP/2 headers
        .layer(
            FairgateLayer::builder(server_store.clone())
                .slots(slots.clone())
                .build()?
                .clone_requests_with(SendOnce), // tonic's bodies are streams, not Clone
        )
        .into_inner();
    let (_reporter, health) = tonic_health::server::health_reporter();
    let incoming = TcpIncoming::bind(listen)?;
    let addr = incoming.local_addr()?;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(
        Server::builder()
            .layer(admission)
            .add_service(health)
            .serve_with_incoming_shutdown(incoming, async {
                let _ = stopped.await;
            }),
    );
    println!("gRPC server on {addr}");

    // --- Client (egress): the calls admitted by a stack of their own. ---
    let client_store = Store::memory();
    let channel = Channel::from_shared(format!("http://{addr}"))?
        .connect()
        .await?;
    let admitted = ServiceBuilder::new()
        .layer(GrpcRejectionLayer::new())
        .layer(
            FairgateLayer::builder(client_store.clone())
                .slots(slots)
                .build()?
                .clone_requests_with(SendOnce),
        )
        .service(channel);
    let mut client = HealthClient::new(admitted);

    // A request carries its key in metadata (for the server's stack) and its job in its
    // extensions (for the client's: tonic moves them into the http::Request it sends).
    let request = |key: &str, tier: &str| {
        let mut request = tonic::Request::new(HealthCheckRequest {
            service: String::new(),
        });
        if let Ok(value) = key.parse() {
            request.metadata_mut().insert("x-api-key", value);
        }
        let job = Job::new(format!("team-{tier}"), Origin::UserAction).with_tier(tier);
        request.extensions_mut().insert(job);
        request
    };

    let answer = client.check(request("sk-premium", "premium")).await?;
    println!("premium check: {:?}", answer.into_inner().status());

    // A free user's server stream holds the free tier's only slot, on both sides, while it
    // runs; the free user's next call is refused at once (here by the client's stack,
    // before anything is sent; a client without one gets the same status from the server).
    let mut watch = client.watch(request("sk-free", "free")).await?.into_inner();
    if let Some(first) = watch.message().await? {
        println!("free watch:    {:?} (stream open)", first.status());
    }
    println!(
        "slots held:    client {}, server {}",
        client_store.slots_in_use(None).await,
        server_store.slots_in_use(None).await
    );
    report("free check", client.check(request("sk-free", "free")).await);
    report(
        "unknown key",
        client.check(request("sk-stolen", "premium")).await,
    );

    // Ending the stream gives both slots back.
    drop(watch);
    tokio::time::sleep(Duration::from_millis(50)).await;
    println!(
        "slots held:    client {}, server {} (stream ended)",
        client_store.slots_in_use(None).await,
        server_store.slots_in_use(None).await
    );
    report("free check", client.check(request("sk-free", "free")).await);

    let _ = stop.send(());
    server.await??;
    Ok(())
}

fn report<T>(what: &str, result: Result<tonic::Response<T>, tonic::Status>) {
    match result {
        Ok(_) => println!("{:<15}ok", format!("{what}:")),
        Err(status) => {
            let meta = |key| {
                status
                    .metadata()
                    .get(key)
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("-")
                    .to_owned()
            };
            println!(
                "{:<15}{:?} \"{}\" {RETRY_AFTER_MS}={} {GRPC_RETRY_PUSHBACK_MS}={}",
                format!("{what}:"),
                status.code(),
                status.message(),
                meta(RETRY_AFTER_MS),
                meta(GRPC_RETRY_PUSHBACK_MS),
            );
        }
    }
}
