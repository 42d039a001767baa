//! An Anthropic-compatible gateway: a program a team runs in front of the Anthropic API for
//! its services in any language. Clients point their SDK's base URL at it and use a key
//! from `keys.toml`; the gateway admits their calls fairly (the four fairgate layers) and
//! calls the API with the team's one upstream key.
//!
//! ```sh
//! ANTHROPIC_API_KEY=sk-ant-... cargo run --release --all-features --example gateway -- \
//!     --listen 127.0.0.1:8080 --upstream https://api.anthropic.com --keys keys.toml \
//!     [--redis redis://127.0.0.1:6379/]
//! ```
//!
//! `keys.toml` lists the clients' keys; the optional `[limits]` and `[[tiers]]` change the
//! slot policy (defaults: global 30; premium 30, pro 20, free 15, guest 5 with max waits 60,
//! 45, 12 and 8 s):
//!
//! ```toml
//! [[keys]]
//! key = "sk-gw-team-a"
//! tenant = "team-a"
//! tier = "premium"
//!
//! [limits]            # optional
//! global_max = 30     # slots across all tiers (and all gateways on one Redis)
//! window = 30         # this gateway's fair-queue window (default: global_max)
//! retry_after_ms = 5000  # what a refused client is told to wait
//! daily_token_budget = 100000  # per tenant; past 1.5x it is demoted to batch for 5 min
//!
//! [[tiers]]           # optional; adds or replaces a tier
//! name = "guest"
//! cap = 5
//! max_wait_ms = 8000
//! ```
//!
//! - `POST /v1/messages` (streaming or not) goes through `JobLayer` (tenant and tier from the
//!   key table, tokens from the body's size) and `FairgateLayer`; the body is buffered (at
//!   most 32 MiB, `413` past it) so a throttled call can be sent again. A streamed answer is
//!   forwarded event by event and holds its slot to its last byte; a client that goes away
//!   drops the upstream call.
//! - Every other `/v1/*` path (`count_tokens`, `models`, batches) is forwarded as is, after
//!   the same key check.
//! - A missing or unknown key gets `401` `authentication_error`; fairgate's refusals come in
//!   Anthropic's shape (`529` `overloaded_error`, `429` `rate_limit_error`, with
//!   `retry-after`), so the official SDKs back off and retry.
//! - The client's own key is removed (never forwarded, never logged); the upstream gets
//!   `x-api-key: $ANTHROPIC_API_KEY`. Other headers (`anthropic-version`, `anthropic-beta`,
//!   `request-id`, `anthropic-ratelimit-*`, ...) pass through both ways, less hop-by-hop ones.
//! - `GET /metrics`: Prometheus text; `GET /healthz`: `200 ok`.
//! - SIGTERM or Ctrl-C: stops accepting, lets calls in flight finish (at most 30 s), then
//!   drops the rest, which releases their slots. Logs: `RUST_LOG` (default `info`), on stderr.

use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get};
use axum::serve::ListenerExt;
use bytes::Bytes;
use fairgate::extract::{FromHeaders, KeyTable, api_key};
use fairgate::reject::{Style, render};
use fairgate::{
    BoxError, DemotionPolicy, FairgateLayer, JobLayer, SlotPolicy, Store, Tier, Unidentified,
};
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{StatusCode, Uri};
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use serde::Deserialize;
use tower::util::BoxCloneSyncService;
use tower::{ServiceBuilder, ServiceExt, service_fn};
use tracing::{info, warn};
use tracing_subscriber::EnvFilter;

/// The largest `/v1/messages` body buffered for a retry.
const MAX_BODY: usize = 32 << 20;
/// How long calls in flight may take to finish after SIGTERM / Ctrl-C.
const DRAIN: Duration = Duration::from_secs(30);

const USAGE: &str = "usage: gateway --listen ADDR --upstream URL --keys FILE [--redis URL]
  --listen ADDR    address to serve on, e.g. 127.0.0.1:8080
  --upstream URL   the Anthropic API, e.g. https://api.anthropic.com (http:// for a local mock)
  --keys FILE      the clients' keys (TOML: [[keys]] key, tenant, tier; optional [limits], [[tiers]])
  --redis URL      share the caps with other gateways through Redis (default: this process only)
environment: ANTHROPIC_API_KEY (the upstream key, required), RUST_LOG (default info)";

// ---------------------------------------------------------------------------------------
// Command line and configuration
// ---------------------------------------------------------------------------------------

#[derive(Debug)]
struct Args {
    listen: SocketAddr,
    upstream: Uri,
    keys: PathBuf,
    redis: Option<String>,
}

fn parse_args(args: impl IntoIterator<Item = String>) -> Result<Args, String> {
    let (mut listen, mut upstream, mut keys, mut redis) = (None, None, None, None);
    let mut args = args.into_iter();
    while let Some(arg) = args.next() {
        if arg == "-h" || arg == "--help" {
            return Err(String::new());
        }
        let (flag, inline) = match arg.split_once('=') {
            Some((flag, value)) if flag.starts_with("--") => {
                (flag.to_owned(), Some(value.to_owned()))
            }
            _ => (arg.clone(), None),
        };
        let slot = match flag.as_str() {
            "--listen" => &mut listen,
            "--upstream" => &mut upstream,
            "--keys" => &mut keys,
            "--redis" => &mut redis,
            other => return Err(format!("unknown argument `{other}`")),
        };
        let value = match inline.or_else(|| args.next()) {
            Some(value) if !value.is_empty() && !value.starts_with("--") => value,
            _ => return Err(format!("{flag} needs a value")),
        };
        if slot.replace(value).is_some() {
            return Err(format!("{flag} given twice"));
        }
    }
    let listen = listen.ok_or("--listen is required")?;
    let listen = listen
        .parse()
        .map_err(|e| format!("--listen {listen}: not an address like 127.0.0.1:8080 ({e})"))?;
    let upstream = upstream.ok_or("--upstream is required")?;
    let parsed: Uri = upstream
        .parse()
        .map_err(|e| format!("--upstream {upstream}: not a URL ({e})"))?;
    match parsed.scheme_str() {
        Some("http" | "https") if parsed.authority().is_some() => {}
        _ => {
            return Err(format!(
                "--upstream {upstream}: give an http:// or https:// URL with a host"
            ));
        }
    }
    if parsed.query().is_some() {
        return Err(format!("--upstream {upstream}: no query string, please"));
    }
    let keys = PathBuf::from(keys.ok_or("--keys is required")?);
    if let Some(url) = &redis
        && !(url.starts_with("redis://") || url.starts_with("rediss://"))
    {
        return Err(format!("--redis {url}: give a redis:// URL"));
    }
    Ok(Args {
        listen,
        upstream: parsed,
        keys,
        redis,
    })
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct KeysFile {
    #[serde(default)]
    keys: Vec<KeyEntry>,
    #[serde(default)]
    limits: Limits,
    #[serde(default)]
    tiers: Vec<TierEntry>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct KeyEntry {
    key: String,
    tenant: String,
    tier: String,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Limits {
    global_max: Option<u32>,
    window: Option<usize>,
    retry_after_ms: Option<u64>,
    lease_ttl_ms: Option<u64>,
    daily_token_budget: Option<u64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TierEntry {
    name: String,
    cap: u32,
    max_wait_ms: u64,
}

impl fmt::Debug for KeyEntry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never the key itself.
        f.debug_struct("KeyEntry")
            .field("tenant", &self.tenant)
            .field("tier", &self.tier)
            .finish_non_exhaustive()
    }
}

/// What the gateway runs with, from the keys file.
struct Config {
    keys: KeyTable,
    policy: SlotPolicy,
    window: usize,
    tenants: usize,
    demotion: Option<DemotionPolicy>,
}

fn load_config(path: &PathBuf) -> Result<Config, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read --keys {}: {e}", path.display()))?;
    // The parse error's message and line only: its snippet of the file could show a key.
    let file: KeysFile = toml::from_str(&text).map_err(|e| {
        let line = e.span().map(|span| {
            1 + text.as_bytes()[..span.start.min(text.len())]
                .iter()
                .filter(|&&b| b == b'\n')
                .count()
        });
        match line {
            Some(line) => format!("--keys {} line {line}: {}", path.display(), e.message()),
            None => format!("--keys {}: {}", path.display(), e.message()),
        }
    })?;
    let bad = |what: String| format!("--keys {}: {what}", path.display());
    if file.keys.is_empty() {
        return Err(bad(
            "no [[keys]]: list at least one `key`, `tenant`, `tier`".into(),
        ));
    }

    let mut builder = SlotPolicy::builder();
    if let Some(global) = file.limits.global_max {
        builder = builder.global_max(global);
    }
    if let Some(ms) = file.limits.retry_after_ms {
        builder = builder.retry_after(Duration::from_millis(ms));
    }
    if let Some(ms) = file.limits.lease_ttl_ms {
        builder = builder.lease_ttl(Duration::from_millis(ms));
    }
    let mut tiers: Vec<String> = [Tier::PREMIUM, Tier::PRO, Tier::FREE, Tier::GUEST]
        .map(str::to_owned)
        .to_vec();
    for tier in &file.tiers {
        if tier.name.trim().is_empty() {
            return Err(bad("a [[tiers]] entry has an empty name".into()));
        }
        builder = builder.tier(
            tier.name.as_str(),
            tier.cap,
            Duration::from_millis(tier.max_wait_ms),
        );
        tiers.push(tier.name.clone());
    }
    let policy = builder
        .build()
        .map_err(|e| bad(format!("bad [limits] or [[tiers]]: {e}")))?;

    let mut keys = KeyTable::new();
    let mut tenants = std::collections::HashSet::new();
    for (i, entry) in file.keys.iter().enumerate() {
        let n = i + 1;
        if entry.key.trim().is_empty() || entry.key.trim() != entry.key {
            return Err(bad(format!(
                "key #{n} (tenant `{}`) is empty or has spaces around it",
                entry.tenant
            )));
        }
        if entry.tenant.trim().is_empty() {
            return Err(bad(format!("key #{n} has an empty tenant")));
        }
        if !tiers.contains(&entry.tier) {
            return Err(bad(format!(
                "key #{n} (tenant `{}`): unknown tier `{}`; known: {} (add it under [[tiers]])",
                entry.tenant,
                entry.tier,
                tiers.join(", ")
            )));
        }
        if keys.get(&entry.key).is_some() {
            return Err(bad(format!(
                "key #{n} (tenant `{}`) is listed twice",
                entry.tenant
            )));
        }
        keys.insert(&entry.key, entry.tenant.as_str(), entry.tier.as_str());
        tenants.insert(entry.tenant.clone());
    }
    let window = file
        .limits
        .window
        .unwrap_or(policy.global_max() as usize)
        .max(1);
    let demotion = match file.limits.daily_token_budget {
        Some(tokens) => Some(
            DemotionPolicy::builder()
                .default_daily_budget(tokens)
                .build()
                .map_err(|e| bad(format!("bad [limits] daily_token_budget: {e}")))?,
        ),
        None => None,
    };
    Ok(Config {
        keys,
        policy,
        window,
        tenants: tenants.len(),
        demotion,
    })
}

// ---------------------------------------------------------------------------------------
// Upstream
// ---------------------------------------------------------------------------------------

type HttpClient = Client<HttpsConnector<HttpConnector>, Body>;

/// The Anthropic API (or a mock): where calls go and with which key.
#[derive(Clone)]
struct Upstream {
    client: HttpClient,
    scheme: http::uri::Scheme,
    authority: http::uri::Authority,
    /// A path prefix of the upstream URL, without the trailing `/` (usually empty).
    base_path: String,
    api_key: HeaderValue,
}

/// Headers that belong to one connection, never forwarded (RFC 9110 §7.6.1).
const HOP_BY_HOP: [&str; 8] = [
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "proxy-connection",
    "te",
    "trailer",
    "upgrade",
];

fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // Headers the `Connection` header names are hop-by-hop too.
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|name| HeaderName::try_from(name.trim()).ok())
        .collect();
    for name in named {
        headers.remove(name);
    }
    for name in HOP_BY_HOP {
        headers.remove(name);
    }
    headers.remove(header::TRANSFER_ENCODING);
}

impl Upstream {
    fn new(url: &Uri, api_key: &str) -> Result<Upstream, String> {
        let mut http = HttpConnector::new();
        http.enforce_http(false); // https:// goes through rustls
        http.set_nodelay(true); // a request's head and body go out at once
        http.set_connect_timeout(Some(Duration::from_secs(10)));
        let https = hyper_rustls::HttpsConnectorBuilder::new()
            .with_webpki_roots()
            .https_or_http()
            .enable_http1()
            .wrap_connector(http);
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(60))
            .build(https);
        let mut api_key = HeaderValue::from_str(api_key)
            .map_err(|_| "ANTHROPIC_API_KEY is not a valid header value".to_owned())?;
        api_key.set_sensitive(true);
        Ok(Upstream {
            client,
            scheme: url.scheme().cloned().unwrap_or(http::uri::Scheme::HTTPS),
            authority: url.authority().cloned().ok_or("no host")?,
            base_path: url.path().trim_end_matches('/').to_owned(),
            api_key,
        })
    }

    /// `req` readdressed to the upstream, with the upstream key instead of the client's.
    fn prepare<B>(&self, req: http::Request<B>) -> Result<http::Request<B>, BoxError> {
        let (mut parts, body) = req.into_parts();
        let path_and_query = parts
            .uri
            .path_and_query()
            .map(|p| p.as_str())
            .unwrap_or("/");
        parts.uri = Uri::builder()
            .scheme(self.scheme.clone())
            .authority(self.authority.clone())
            .path_and_query(format!("{}{path_and_query}", self.base_path))
            .build()?;
        let headers = &mut parts.headers;
        strip_hop_by_hop(headers);
        headers.remove(header::HOST);
        headers.remove(header::CONTENT_LENGTH);
        headers.remove(header::AUTHORIZATION);
        headers.insert("x-api-key", self.api_key.clone());
        parts.version = http::Version::HTTP_11;
        Ok(http::Request::from_parts(parts, body))
    }

    async fn send(
        &self,
        req: http::Request<Body>,
    ) -> Result<http::Response<hyper::body::Incoming>, BoxError> {
        let req = self.prepare(req)?;
        Ok(self.client.request(req).await?)
    }
}

/// The upstream's answer as the client's: hop-by-hop headers dropped, the body streamed.
fn downstream<B>(response: http::Response<B>) -> Response
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let (mut parts, body) = response.into_parts();
    strip_hop_by_hop(&mut parts.headers);
    Response::from_parts(parts, Body::new(body))
}

// ---------------------------------------------------------------------------------------
// The gateway
// ---------------------------------------------------------------------------------------

/// `POST /v1/messages` through the stack: the buffered request in, the client's response out.
type Messages = BoxCloneSyncService<http::Request<Full<Bytes>>, Response, BoxError>;

struct Gateway {
    messages: Messages,
    upstream: Upstream,
    keys: Arc<KeyTable>,
    metrics: PrometheusHandle,
}

fn messages_service(upstream: Upstream, keys: KeyTable, fairgate: FairgateLayer) -> Messages {
    let send = service_fn(move |req: http::Request<Full<Bytes>>| {
        let upstream = upstream.clone();
        async move { upstream.send(req.map(Body::new)).await }
    });
    let stack = ServiceBuilder::new()
        .layer(JobLayer::new(FromHeaders::new().keys(keys)))
        .layer(fairgate)
        .service(send)
        .map_response(downstream);
    BoxCloneSyncService::new(stack)
}

/// Anthropic's error shape for the gateway's own refusals.
fn error_response(status: StatusCode, kind: &str, message: &str) -> Response {
    let body = format!(r#"{{"type":"error","error":{{"type":"{kind}","message":"{message}"}}}}"#);
    (
        status,
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )],
        body,
    )
        .into_response()
}

fn rendered(error: &BoxError) -> Response {
    render(error, Style::Anthropic).map(Body::from)
}

async fn messages(State(gw): State<Arc<Gateway>>, req: Request) -> Response {
    let started = Instant::now();
    let (parts, body) = req.into_parts();
    let bytes = match Limited::new(body, MAX_BODY).collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(e) if e.is::<LengthLimitError>() => {
            return error_response(
                StatusCode::PAYLOAD_TOO_LARGE,
                "request_too_large",
                "request body is larger than the gateway's 32 MiB limit",
            );
        }
        Err(e) => {
            warn!(error = %e, "reading a request body failed");
            return error_response(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                "could not read the request body",
            );
        }
    };
    let size = bytes.len();
    let req = http::Request::from_parts(parts, Full::new(bytes));
    match gw.messages.clone().oneshot(req).await {
        Ok(response) => {
            tracing::debug!(
                status = response.status().as_u16(),
                bytes = size,
                ms = started.elapsed().as_millis() as u64,
                "POST /v1/messages"
            );
            response
        }
        Err(error) => {
            let response = rendered(&error);
            if response.status() == StatusCode::BAD_GATEWAY {
                warn!(error = %error, "upstream call failed");
            } else {
                info!(status = response.status().as_u16(), reason = %error, "refused");
            }
            response
        }
    }
}

async fn forward(State(gw): State<Arc<Gateway>>, req: Request) -> Response {
    let known = api_key(&req).is_some_and(|key| gw.keys.get(key).is_some());
    if !known {
        let reason = if api_key(&req).is_some() {
            "unknown api key"
        } else {
            "no api key"
        };
        return rendered(&BoxError::from(Unidentified::new(reason)));
    }
    match gw.upstream.send(req).await {
        Ok(response) => downstream(response),
        Err(error) => {
            warn!(error = %error, "upstream call failed");
            rendered(&error)
        }
    }
}

async fn metrics(State(gw): State<Arc<Gateway>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; version=0.0.4"),
        )],
        gw.metrics.render(),
    )
        .into_response()
}

async fn not_found() -> Response {
    error_response(StatusCode::NOT_FOUND, "not_found_error", "not found")
}

fn router(gw: Arc<Gateway>) -> Router {
    Router::new()
        .route("/v1/messages", axum::routing::post(messages))
        .route("/v1/{*rest}", any(forward))
        .route("/healthz", get(|| async { "ok" }))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .with_state(gw)
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(term) => term,
        Err(e) => {
            warn!(error = %e, "cannot listen for SIGTERM; Ctrl-C only");
            let _ = ctrl_c.await;
            return;
        }
    };
    tokio::select! {
        _ = ctrl_c => info!("Ctrl-C: shutting down"),
        _ = term.recv() => info!("SIGTERM: shutting down"),
    }
}

async fn run(args: Args) -> Result<(), String> {
    let config = load_config(&args.keys)?;
    let api_key = std::env::var("ANTHROPIC_API_KEY").unwrap_or_default();
    if api_key.trim().is_empty() {
        return Err("ANTHROPIC_API_KEY is not set: the gateway calls the upstream with it".into());
    }
    let upstream = Upstream::new(&args.upstream, api_key.trim())?;
    let metrics = PrometheusBuilder::new()
        .install_recorder()
        .map_err(|e| format!("cannot install the metrics recorder: {e}"))?;

    let store = match &args.redis {
        #[cfg(feature = "redis")]
        Some(url) => Store::redis(url)
            .await
            .map_err(|e| format!("--redis {url}: {e}"))?,
        #[cfg(not(feature = "redis"))]
        Some(_) => return Err("--redis needs the `redis` feature (--all-features)".into()),
        None => Store::memory(),
    };
    let mut fairgate = FairgateLayer::builder(store.clone())
        .slots(config.policy.clone())
        .window(config.window);
    if let Some(demotion) = config.demotion.clone() {
        fairgate = fairgate.demotion(demotion);
    }
    let fairgate = fairgate.build().map_err(|e| format!("bad limits: {e}"))?;
    let keys = Arc::new(config.keys.clone());
    let gw = Arc::new(Gateway {
        messages: messages_service(upstream.clone(), config.keys, fairgate),
        upstream,
        keys,
        metrics: metrics.clone(),
    });

    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(|e| format!("--listen {}: {e}", args.listen))?;
    let local = listener.local_addr().map_err(|e| e.to_string())?;
    // SSE events go out as they come, not held back by Nagle's algorithm.
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    info!(
        listen = %local,
        upstream = %args.upstream,
        store = if args.redis.is_some() { "redis" } else { "memory" },
        tenants = config.tenants,
        global_max = config.policy.global_max(),
        window = config.window,
        "gateway listening"
    );

    // Prometheus histograms need upkeep now and then.
    let upkeep = tokio::spawn(async move {
        let mut every = tokio::time::interval(Duration::from_secs(5));
        loop {
            every.tick().await;
            metrics.run_upkeep();
        }
    });

    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let app = router(gw);
    let mut server = tokio::spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(async move {
                let _ = stopped.await;
            })
            .await
    });
    tokio::select! {
        _ = shutdown_signal() => {}
        result = &mut server => {
            upkeep.abort();
            return match result {
                Ok(Ok(())) => Ok(()),
                Ok(Err(e)) => Err(format!("server failed: {e}")),
                Err(e) => Err(format!("server task failed: {e}")),
            };
        }
    }
    let _ = stop.send(());
    info!(
        drain_secs = DRAIN.as_secs(),
        "no new connections; waiting for calls in flight"
    );
    match tokio::time::timeout(DRAIN, &mut server).await {
        Ok(_) => info!("calls in flight finished"),
        Err(_) => {
            warn!("calls still in flight after the drain time: dropping them");
            server.abort();
            let _ = server.await;
        }
    }
    upkeep.abort();
    // Every connection, call and slot is dropped by now; let the store send what it owes
    // (released leases, batched counts) before the process ends.
    let _ = tokio::time::timeout(Duration::from_secs(2), store.flush()).await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    info!("gateway stopped");
    Ok(())
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = match parse_args(std::env::args().skip(1)) {
        Ok(args) => args,
        Err(message) if message.is_empty() => {
            println!("{USAGE}");
            return;
        }
        Err(message) => {
            eprintln!("gateway: {message}\n\n{USAGE}");
            std::process::exit(2);
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("gateway: cannot start the runtime: {e}");
            std::process::exit(1);
        }
    };
    if let Err(message) = runtime.block_on(run(args)) {
        eprintln!("gateway: {message}");
        std::process::exit(1);
    }
}
