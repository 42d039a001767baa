//! `fairgate-gateway`: an Anthropic-compatible gateway a team runs in front of the Anthropic
//! API for its services in any language. Clients point their SDK's base URL at it and use
//! a key from `keys.toml`; the gateway admits their calls fairly (the four fairgate layers)
//! and calls the API with the team's upstream key (`--upstream`), or through a pool of
//! upstreams listed in the keys file (`[[upstreams]]`: keys, workspaces, Bedrock).
//!
//! ```sh
//! cargo install --locked --path . --features gateway
//! ANTHROPIC_API_KEY=sk-ant-... fairgate-gateway --listen 127.0.0.1:8080 \
//!     --upstream https://api.anthropic.com --keys keys.toml [--redis redis://127.0.0.1:6379/]
//! ```
//!
//! Every flag can also come from the environment (`fairgate-gateway --help` names the
//! variables). The modules:
//! - `config`: the keys file, checked in full at start and on `SIGHUP`;
//! - `routes`: canonical paths only, one admission path, an allow-list for the rest;
//! - `auth`: the key check, failures slowed per (address, key) and per address on
//!   distinct keys;
//! - `api`: the API port (authenticate from the headers, then buffer within a budget);
//! - `batches`: message batches, each answered only to the key that created it;
//! - `holders`: what each key holder may hold at once (requests, body and answer bytes);
//! - `own_answer`: the gateway's own answers marked (`request-id`, `529 Overloaded`);
//! - `answer`: answers relayed through a bounded buffer, the slot free at the upstream's end;
//! - `cut_stream`: a stream its upstream cuts ends with the API's error event;
//! - `server`: connections (cap, header / body / keep-alive timeouts, drain);
//! - `admin`: `/metrics`, `/healthz`, `/readyz`, `/status` on the admin listener (its token);
//! - `dashboard`: the admin listener's live page (`/`) and its numbers (`/live`);
//! - `telemetry`: the Prometheus recorder, the `# HELP` of its own metrics, zeros from start;
//! - `flights`: the calls gone to the upstream whose answer has not ended, for the page;
//! - `record`: `--record`, the admitted calls as JSON lines for the simulator's replay;
//! - `upstream`: the upstream client;
//! - `upstreams`: `--upstream` or the keys file's `[[upstreams]]`, as one pool.

mod admin;
#[cfg(not(target_env = "msvc"))]
mod allocator;
mod answer;
mod api;
mod auth;
mod batches;
mod config;
mod cost;
mod cut_stream;
mod dashboard;
mod flights;
mod holders;
mod http2;
mod identity;
mod otlp;
mod own_answer;
mod record;
mod routes;
mod server;
mod telemetry;
mod upstream;
mod upstreams;
mod usage;

use std::io::IsTerminal;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use bytes::Bytes;
use clap::Parser;
use fairgate::{BoxError, Store};
use http::Uri;
use metrics_exporter_prometheus::PrometheusHandle;
use tokio::signal::unix::{SignalKind, signal};
use tokio::task::JoinHandle;
use tracing::{info, warn};
use tracing_subscriber::EnvFilter;

use self::api::{BodyLimits, Gateway, Live};
use self::auth::AuthGuard;
use self::holders::{HolderLimits, Holders};
use self::server::{ConnLimits, Connections};
use self::upstreams::Upstreams;

/// The body of every response the gateway sends.
pub(crate) type Body = http_body_util::combinators::UnsyncBoxBody<Bytes, BoxError>;

/// An Anthropic-compatible gateway with fair, tier-aware admission control.
///
/// Clients use their own key from the keys file (`x-api-key` or `Authorization: Bearer`);
/// the upstream (--upstream) is called with ANTHROPIC_API_KEY (from the environment only),
/// or the keys file's [[upstreams]] with theirs.
/// SIGHUP reloads the keys file; SIGTERM or Ctrl-C drains and stops. Logs: RUST_LOG
/// (default info), on stderr, in --log-format.
#[derive(Debug, Parser)]
#[command(name = "fairgate-gateway", version, about, long_about)]
pub(crate) struct Args {
    /// Address to serve the API on, e.g. 127.0.0.1:8080.
    #[arg(long, env = "FAIRGATE_LISTEN", value_name = "ADDR")]
    listen: SocketAddr,

    /// The Anthropic API, e.g. `https://api.anthropic.com` (`http://` for a local mock);
    /// not with the keys file's `[[upstreams]]`.
    #[arg(long, env = "FAIRGATE_UPSTREAM", value_name = "URL", value_parser = upstream_url,
          help = "The Anthropic API, e.g. https://api.anthropic.com (http:// for a local mock); \
                  not with the keys file's [[upstreams]]")]
    upstream: Option<Uri>,

    /// Calls `--upstream` over HTTP/2: many calls a connection (`https://` by ALPN,
    /// `http://` with prior knowledge); the upstream must speak it.
    #[arg(long, env = "FAIRGATE_UPSTREAM_HTTP2", requires = "upstream")]
    upstream_http2: bool,

    /// The clients' keys (TOML: `[[keys]]` key, tenant, tier; optional `[limits]`, `[[tiers]]`).
    #[arg(
        long,
        env = "FAIRGATE_KEYS",
        value_name = "FILE",
        help = "The clients' keys (TOML: [[keys]] key, tenant, tier; optional [limits], [[tiers]])"
    )]
    keys: PathBuf,

    /// Share the caps with other gateways through Redis (default: this process only).
    #[arg(long, env = "FAIRGATE_REDIS", value_name = "URL", hide_env_values = true,
          value_parser = redis_url)]
    redis: Option<String>,

    /// Address of the admin listener: /metrics, /healthz, /readyz, /status.
    #[arg(
        long,
        env = "FAIRGATE_ADMIN",
        value_name = "ADDR",
        default_value = "127.0.0.1:9464"
    )]
    admin: SocketAddr,

    /// Bearer token every admin route but /healthz and /readyz asks for; required when
    /// --admin binds beyond loopback. Prefer the environment variable (a flag shows in ps).
    #[arg(long, env = "FAIRGATE_ADMIN_TOKEN", value_name = "TOKEN", hide_env_values = true,
          value_parser = admin::AdminToken::read)]
    admin_token: Option<admin::AdminToken>,

    /// A host name the admin listener on loopback answers to, besides localhost, 127.0.0.1
    /// and ::1 (repeat for more): other names get 421 (/healthz and /readyz answer any).
    #[arg(
        long,
        env = "FAIRGATE_ADMIN_HOST",
        value_name = "NAME",
        value_delimiter = ','
    )]
    admin_host: Vec<String>,

    /// How many gateways share --redis: while Redis has not answered since start, each
    /// serves the caps divided by this (default 1: the whole caps, right for one gateway).
    #[arg(long, env = "FAIRGATE_FLEET_SIZE", value_name = "N", default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(1..))]
    fleet_size: u32,

    /// Connections open at once on the API port; at the cap a new one closes the oldest idle
    /// one, or is answered 529 when none is idle. Lowered to fit the open-files limit, two
    /// files a call (its connection and the upstream's; one when every upstream is HTTP/2).
    #[arg(long, env = "FAIRGATE_MAX_CONNECTIONS", value_name = "N", default_value_t = 4096,
          value_parser = clap::value_parser!(u32).range(1..))]
    max_connections: u32,

    /// Time a client has to send a request's head (trickled heads are closed).
    #[arg(long, env = "FAIRGATE_HEADER_TIMEOUT", value_name = "DURATION", default_value = "10s",
          value_parser = duration)]
    header_timeout: Duration,

    /// Time a request body may stall between two reads (408 past it).
    #[arg(long, env = "FAIRGATE_BODY_IDLE_TIMEOUT", value_name = "DURATION",
          default_value = "10s", value_parser = duration)]
    body_idle_timeout: Duration,

    /// Time a /v1/messages body may take in all, however it trickles (408 past it).
    #[arg(long, env = "FAIRGATE_BODY_TIMEOUT", value_name = "DURATION", default_value = "60s",
          value_parser = duration)]
    body_timeout: Duration,

    /// Time an idle keep-alive connection stays open.
    #[arg(long, env = "FAIRGATE_KEEP_ALIVE_TIMEOUT", value_name = "DURATION",
          default_value = "30s", value_parser = duration)]
    keep_alive_timeout: Duration,

    /// The largest /v1/messages body (413 past it), e.g. 32MiB.
    #[arg(long, env = "FAIRGATE_MAX_BODY", value_name = "SIZE", default_value = "32MiB",
          value_parser = size)]
    max_body: usize,

    /// Memory all /v1/messages bodies being buffered may take together (529 past it).
    #[arg(long, env = "FAIRGATE_BODY_BUDGET", value_name = "SIZE", default_value = "128MiB",
          value_parser = size)]
    body_budget: usize,

    /// Body bytes one key holder's requests may have buffered at once (429 past it);
    /// default: a quarter of --body-budget, at least --max-body.
    #[arg(long, env = "FAIRGATE_KEY_BODY_BUDGET", value_name = "SIZE", value_parser = size)]
    key_body_budget: Option<usize>,

    /// Requests one key holder may have in progress at once, from its key check to its
    /// answer's last byte (429 past it); default: a quarter of --max-connections.
    #[arg(long, env = "FAIRGATE_KEY_MAX_REQUESTS", value_name = "N",
          value_parser = clap::value_parser!(u32).range(1..))]
    key_max_requests: Option<u32>,

    /// Memory all answers waiting for their clients to read them may take together.
    #[arg(long, env = "FAIRGATE_ANSWER_BUFFER", value_name = "SIZE", default_value = "256MiB",
          value_parser = size)]
    answer_buffer: usize,

    /// Memory one key holder's answers waiting for their clients may take; past it the
    /// upstream is read no faster than the client reads.
    #[arg(long, env = "FAIRGATE_KEY_ANSWER_BUFFER", value_name = "SIZE",
          default_value = "8MiB", value_parser = size)]
    key_answer_buffer: usize,

    /// Time an answer may wait with nothing of it read by its client (the connection is
    /// cut past it).
    #[arg(long, env = "FAIRGATE_WRITE_TIMEOUT", value_name = "DURATION", default_value = "30s",
          value_parser = duration)]
    write_timeout: Duration,

    /// Failed authentications with one key, and with distinct keys, an address may make at
    /// once before it is slowed (429).
    #[arg(
        long,
        env = "FAIRGATE_AUTH_FAILURE_BURST",
        value_name = "N",
        default_value_t = 20
    )]
    auth_failure_burst: u32,

    /// Failed authentications (as above) an address may make per second after its burst.
    #[arg(
        long,
        env = "FAIRGATE_AUTH_FAILURE_RATE",
        value_name = "PER_SEC",
        default_value_t = 1.0
    )]
    auth_failure_rate: f64,

    /// How long calls in flight may take to finish after SIGTERM or Ctrl-C.
    #[arg(long, env = "FAIRGATE_DRAIN_TIMEOUT", value_name = "DURATION", default_value = "30s",
          value_parser = duration)]
    drain_timeout: Duration,

    /// The URL clients reach this gateway at, e.g. `https://llm.example.com`: batches'
    /// `results_url` points there (default: `http://` and the listen address).
    #[arg(long, env = "FAIRGATE_PUBLIC_URL", value_name = "URL", value_parser = public_url,
          help = "The URL clients reach this gateway at, e.g. https://llm.example.com: \
                  batches' results_url points there (default: http:// and the listen address)")]
    public_url: Option<Uri>,

    /// Record each POST /v1/messages call the admission stack saw to FILE (created or
    /// truncated), one JSON line each when it ends: for the simulator's --replay.
    #[arg(long, env = "FAIRGATE_RECORD", value_name = "FILE")]
    record: Option<PathBuf>,

    /// Log lines on stderr: `text` (coloured only when stderr is a terminal) or `json` (one
    /// object a line, for a log collector).
    #[arg(long, env = "FAIRGATE_LOG_FORMAT", value_name = "FORMAT", value_enum,
          default_value_t = LogFormat::Text)]
    log_format: LogFormat,

    /// Export the span of every call through the admission stack (tenant, tier, class,
    /// waits, attempts, upstream, status) over OTLP/HTTP to URL, e.g.
    /// http://127.0.0.1:4318 (its /v1/traces); nothing is traced when unset.
    #[arg(long, env = "FAIRGATE_OTLP", value_name = "URL", value_parser = otlp::endpoint)]
    otlp: Option<Uri>,
}

/// The shape of the log lines (`--log-format`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object a line.
    Json,
}

fn upstream_url(value: &str) -> Result<Uri, String> {
    let parsed: Uri = value.parse().map_err(|e| format!("not a URL ({e})"))?;
    match parsed.scheme_str() {
        Some("http" | "https") if parsed.authority().is_some() => {}
        _ => return Err("give an http:// or https:// URL with a host".into()),
    }
    if parsed.query().is_some() {
        return Err("no query string, please".into());
    }
    Ok(parsed)
}

fn public_url(value: &str) -> Result<Uri, String> {
    let parsed = upstream_url(value)?;
    if value.contains('#') {
        return Err("no fragment, please".into());
    }
    Ok(parsed)
}

fn redis_url(value: &str) -> Result<String, String> {
    if value.starts_with("redis://") || value.starts_with("rediss://") {
        Ok(value.to_owned())
    } else {
        Err("give a redis:// or rediss:// URL".into())
    }
}

/// `10s`, `500ms`, `2m`, `1h`, or a number of seconds.
fn duration(value: &str) -> Result<Duration, String> {
    let value = value.trim();
    let split = value
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(value.len());
    let (number, unit) = value.split_at(split);
    let number: f64 = number
        .parse()
        .map_err(|_| format!("`{value}`: give a duration like 10s, 500ms or 2m"))?;
    let secs = match unit.trim() {
        "" | "s" => number,
        "ms" => number / 1000.0,
        "m" => number * 60.0,
        "h" => number * 3600.0,
        _ => return Err(format!("`{value}`: give a duration like 10s, 500ms or 2m")),
    };
    if !(secs > 0.0 && secs <= 86_400.0) {
        return Err(format!("`{value}`: give more than 0 and at most a day"));
    }
    Ok(Duration::from_secs_f64(secs))
}

/// `32MiB`, `512KiB`, `1GiB`, or a number of bytes.
fn size(value: &str) -> Result<usize, String> {
    let value = value.trim();
    let split = value
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(value.len());
    let (number, unit) = value.split_at(split);
    let number: usize = number
        .parse()
        .map_err(|_| format!("`{value}`: give a size like 32MiB"))?;
    let scale: usize = match unit.trim() {
        "" | "B" => 1,
        "KiB" | "K" | "KB" => 1 << 10,
        "MiB" | "M" | "MB" => 1 << 20,
        "GiB" | "G" | "GB" => 1 << 30,
        _ => return Err(format!("`{value}`: give a size like 32MiB")),
    };
    match number.checked_mul(scale) {
        Some(bytes) if bytes > 0 => Ok(bytes),
        _ => Err(format!("`{value}`: give a size above 0")),
    }
}

/// Raises the soft limit on open files to the hard one (each connection is one file), and
/// returns it.
fn raise_open_files_limit() -> Option<u64> {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let mut limit = getrlimit(Resource::Nofile);
    if limit.current != limit.maximum {
        limit.current = limit.maximum;
        if let Err(e) = setrlimit(Resource::Nofile, limit) {
            warn!(error = %e, "cannot raise the open-files limit");
        }
    }
    getrlimit(Resource::Nofile).current
}

/// Files kept for Redis, the admin listener, the upstream's idle pool and the process
/// itself.
const RESERVED_FILES: u64 = 512;

/// Files each API connection may need at once: its own socket and, unless every upstream
/// is called over HTTP/2 (a few connections for all calls, held in [`RESERVED_FILES`]),
/// the upstream's.
fn files_per_connection(args: &Args, config: &config::Config) -> u64 {
    let all_http2 = if config.upstreams.is_empty() {
        args.upstream_http2
    } else {
        config.upstreams.iter().all(|upstream| upstream.http2)
    };
    if all_http2 { 1 } else { 2 }
}

/// Reads the keys file again: the new keys, tiers and limits apply to calls that begin
/// from now on; a bad file keeps the old one.
async fn reload(gw: &Gateway, args: &Args) {
    let result = async {
        let config = config::load(&args.keys)?;
        let current = gw.live();
        // The same store: new caps are the new stack's own (its fair queue is handed them),
        // and calls in flight keep counting in the store against them.
        let store = current.store.clone();
        let keys = config.keys.len();
        let tenants = config.tenants.len();
        let spill_after = current.pool.spill_after();
        if !upstreams::same_pool(gw.upstreams.specs(), &config.upstreams)
            || !config.upstreams.is_empty() && spill_after != config.spill_after
        {
            let why = "[[upstreams]] changed (or [pool]): the pool is built at start, so \
                       restart the gateway to change them";
            return Err(why.to_owned());
        }
        // The same pool: its breakers, counts and tenants' upstreams carry on.
        gw.replace(Live::new(config, store, &current.pool)?);
        Ok::<_, String>((keys, tenants))
    }
    .await;
    match result {
        Ok((keys, tenants)) => {
            gw.reloads.fetch_add(1, Ordering::Relaxed);
            info!(keys, tenants, "SIGHUP: keys file reloaded");
        }
        Err(error) => {
            gw.failed_reloads.fetch_add(1, Ordering::Relaxed);
            warn!(%error, "SIGHUP: keys file not reloaded; keeping the previous one");
        }
    }
}

async fn open_store(args: &Args) -> Result<Store, String> {
    match &args.redis {
        // Until Redis first answers, the store knows of no other gateway: it serves the caps
        // divided by --fleet-size (the library's default without one is a slot at a time).
        Some(url) => Store::builder()
            .expected_workers(args.fleet_size)
            .redis(url)
            .await
            .map_err(|e| format!("--redis: {e}")),
        None => Ok(Store::memory()),
    }
}

async fn run(mut args: Args) -> Result<(), String> {
    let config = config::load(&args.keys)?;
    let files = files_per_connection(&args, &config);
    check_args(&mut args, files)?;
    let upstreams = Arc::new(open_upstreams(&args, &config)?);
    let metrics = telemetry::install_metrics(&config)?;
    let store = open_store(&args).await?;
    let tenants = config.tenants.len();
    let (global_max, window) = (config.policy.global_max(), config.window);
    let live = Live::new(config, store, upstreams.pool())?;
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let listeners = Listeners::bind(&args).await?;
    let batches = batch_book(&args, listeners.api_addr)?;
    let upstream_names: Vec<String> = upstreams
        .states()
        .iter()
        .map(|(state, _)| state.name.to_string())
        .collect();
    let gw = Arc::new(gateway(&args, live, upstreams, stopped.clone(), batches)?);
    info!(
        listen = %listeners.api_addr,
        admin = %listeners.admin_addr,
        upstream = args.upstream.as_ref().map(ToString::to_string),
        upstreams = %upstream_names.join(","),
        store = if args.redis.is_some() { "redis" } else { "memory" },
        tenants,
        global_max,
        window,
        max_connections = args.max_connections,
        record = args.record.as_ref().map(|path| path.display().to_string()),
        "gateway listening"
    );

    let admin = Arc::new(admin::Admin {
        gateway: gw.clone(),
        connections: listeners.api_conns.clone(),
        metrics: metrics.clone(),
        started: Instant::now(),
        token: args.admin_token.clone(),
        fleet_size: args.fleet_size,
        hosts: admin::AdminHosts::for_listener(listeners.admin_addr, &args.admin_host),
    });
    let background = background(&gw, metrics);
    let mut servers = Servers::start(listeners, &gw, admin, stopped, args.drain_timeout);
    until_shutdown(&gw, &args, &mut servers.api).await?;
    let _ = stop.send(true);
    servers.drain(args.drain_timeout).await;
    for task in background {
        task.abort();
    }
    // Every connection, call and slot is dropped by now; let the store send what it owes
    // (released leases, batched counts) before the process ends.
    let store = gw.live().store.clone();
    let _ = tokio::time::timeout(Duration::from_secs(2), store.flush()).await;
    let _ = tokio::time::timeout(Duration::from_secs(2), gw.usage.flush()).await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    info!("gateway stopped");
    Ok(())
}

/// The gateway's shared state for `live`, with `--record`'s recorder started, and the body
/// and auth limits of `args`.
fn gateway(
    args: &Args,
    live: Live,
    upstreams: Arc<Upstreams>,
    stopped: tokio::sync::watch::Receiver<bool>,
    batches: batches::Batches,
) -> Result<Gateway, String> {
    // On Redis the fleet's counts; else this process's.
    let usage = match &args.redis {
        Some(url) => usage::Usage::redis(url)?,
        None => usage::Usage::memory(),
    };
    let recorder = match &args.record {
        Some(path) => Some(record::Recorder::start(path, &args.keys)?),
        None => None,
    };
    Ok(Gateway::new(
        live,
        upstreams,
        Holders::new(holder_limits(args), args.body_budget, args.answer_buffer),
        AuthGuard::new(args.auth_failure_burst, args.auth_failure_rate),
        BodyLimits {
            max_body: args.max_body,
            idle: args.body_idle_timeout,
            total: args.body_timeout,
            write: args.write_timeout,
        },
        stopped,
        recorder,
        (batches, usage),
    ))
}

/// What each key holder may hold, from the flags (or their defaults, from the gateway's
/// bounds).
fn holder_limits(args: &Args) -> HolderLimits {
    HolderLimits {
        requests: args
            .key_max_requests
            .map_or((args.max_connections / 4).max(1) as usize, |n| n as usize),
        body_bytes: args
            .key_body_budget
            .unwrap_or((args.body_budget / 4).max(args.max_body)),
        answer_bytes: args.key_answer_buffer,
    }
}

/// The batch routes' owner book (on `--redis` when given) and the URL their `results_url`
/// names: `--public-url`, else the API listener's address.
fn batch_book(args: &Args, api_addr: SocketAddr) -> Result<batches::Batches, String> {
    let public_url = match &args.public_url {
        Some(url) => url.to_string(),
        None => {
            if api_addr.ip().is_unspecified() {
                warn!(
                    listen = %api_addr,
                    "no --public-url: batches' results_url names {api_addr}, which clients \
                     cannot reach; give the URL they use"
                );
            }
            format!("http://{api_addr}")
        }
    };
    match &args.redis {
        Some(url) => batches::Batches::on_redis(url, &public_url),
        None => Ok(batches::Batches::in_memory(&public_url)),
    }
}

/// The upstreams: `--upstream` with `ANTHROPIC_API_KEY` (a pool of one), or the keys file's
/// `[[upstreams]]` with the keys their `key_env` name; refused with both, or neither.
fn open_upstreams(args: &Args, config: &config::Config) -> Result<Upstreams, String> {
    match (&args.upstream, config.upstreams.is_empty()) {
        (Some(_), false) => Err(format!(
            "both --upstream (or FAIRGATE_UPSTREAM) and [[upstreams]] in --keys {}: give the \
             upstreams in one place (remove --upstream to use the keys file's pool)",
            args.keys.display()
        )),
        (None, true) => Err(format!(
            "no upstream: give --upstream URL (with ANTHROPIC_API_KEY), or [[upstreams]] in \
             --keys {}",
            args.keys.display()
        )),
        (Some(url), true) => {
            let key = std::env::var("ANTHROPIC_API_KEY").unwrap_or_default();
            if key.trim().is_empty() {
                return Err(
                    "ANTHROPIC_API_KEY is not set: the gateway calls --upstream with it".into(),
                );
            }
            Upstreams::single(url, key.trim(), args.upstream_http2)
        }
        (None, false) => {
            let specs = (&config.upstreams[..], config.spill_after);
            Upstreams::from_specs(&args.keys, specs, |var| std::env::var(var).ok())
        }
    }
}

/// Refuses what the gateway cannot start with (a body budget smaller than one body; an
/// admin listener beyond loopback without a token; a `--record` file it must not
/// overwrite), and lowers `--max-connections` to fit the open-files limit.
fn check_args(args: &mut Args, files_per_connection: u64) -> Result<(), String> {
    if args.body_budget < args.max_body {
        return Err(format!(
            "--body-budget ({} bytes) must hold at least one --max-body ({} bytes)",
            args.body_budget, args.max_body
        ));
    }
    if args.key_body_budget.is_some_and(|key| key < args.max_body) {
        return Err("--key-body-budget must hold at least one --max-body".into());
    }
    if let Some(token) = &args.admin_token {
        token.check()?;
    }
    if !args.admin.ip().to_canonical().is_loopback() && args.admin_token.is_none() {
        return Err(format!(
            "--admin {} is reachable beyond loopback: set --admin-token (FAIRGATE_ADMIN_TOKEN) \
             too, since /live and /status name tenants; or bind --admin to 127.0.0.1",
            args.admin
        ));
    }
    if let Some(path) = &args.record {
        record::check_target(path, &args.keys)?;
    }
    if let Some(files) = raise_open_files_limit() {
        let fit = (files.saturating_sub(RESERVED_FILES) / files_per_connection).max(1);
        if u64::from(args.max_connections) > fit {
            warn!(
                max_connections = args.max_connections,
                open_files_limit = files,
                "--max-connections lowered to fit the open-files limit"
            );
            args.max_connections = u32::try_from(fit).unwrap_or(u32::MAX);
        }
    }
    Ok(())
}

/// The API and admin listeners, bound, with their connection tables.
struct Listeners {
    api: tokio::net::TcpListener,
    api_addr: SocketAddr,
    api_conns: Arc<Connections>,
    admin: tokio::net::TcpListener,
    admin_addr: SocketAddr,
    admin_conns: Arc<Connections>,
}

impl Listeners {
    async fn bind(args: &Args) -> Result<Listeners, String> {
        let api = server::listen(args.listen, server::API_BACKLOG)
            .map_err(|e| format!("--listen {}: {e}", args.listen))?;
        let api_addr = api.local_addr().map_err(|e| e.to_string())?;
        let admin = tokio::net::TcpListener::bind(args.admin)
            .await
            .map_err(|e| format!("--admin {}: {e}", args.admin))?;
        let admin_addr = admin.local_addr().map_err(|e| e.to_string())?;
        let limits = |max| ConnLimits {
            max,
            header_timeout: args.header_timeout,
            keep_alive: args.keep_alive_timeout,
        };
        let api_conns = Connections::new("api", limits(args.max_connections as usize));
        let admin_conns = Connections::new("admin", limits(64));
        Ok(Listeners {
            api,
            api_addr,
            api_conns,
            admin,
            admin_addr,
            admin_conns,
        })
    }
}

/// The tasks that run beside the servers until the gateway stops: the metrics' upkeep,
/// the demotion gauge's tick and the body budget's gauge.
fn background(gw: &Arc<Gateway>, metrics: PrometheusHandle) -> [JoinHandle<()>; 4] {
    [
        // On Redis, the usage counts go to the fleet's book.
        tokio::spawn(gw.usage.clone().flush_forever()),
        // Prometheus histograms need upkeep now and then.
        tokio::spawn(async move {
            let mut every = tokio::time::interval(Duration::from_secs(5));
            loop {
                every.tick().await;
                metrics.run_upkeep();
            }
        }),
        tokio::spawn(api::demotion_tick(gw.clone(), Duration::from_secs(1), 256)),
        {
            let gw = gw.clone();
            tokio::spawn(async move {
                let mut every = tokio::time::interval(Duration::from_secs(1));
                loop {
                    every.tick().await;
                    metrics::gauge!("gateway_body_budget_used_bytes")
                        .set(gw.holders.body_used() as f64);
                    metrics::gauge!("gateway_answer_buffer_used_bytes")
                        .set(gw.holders.answers_used() as f64);
                }
            })
        },
    ]
}

/// The API and admin servers, running.
struct Servers {
    /// How many connections it cut at the end of its drain.
    api: JoinHandle<usize>,
    admin: JoinHandle<usize>,
    admin_stop: tokio::sync::watch::Sender<bool>,
}

impl Servers {
    /// Serves the API until `stopped` turns true, then drains for up to `drain`; the admin
    /// listener has its own stop.
    fn start(
        listeners: Listeners,
        gw: &Arc<Gateway>,
        admin: Arc<admin::Admin>,
        stopped: tokio::sync::watch::Receiver<bool>,
        drain: Duration,
    ) -> Servers {
        #[cfg(not(target_env = "msvc"))]
        {
            let conns = listeners.api_conns.clone();
            tokio::spawn(allocator::follow_connections(move || conns.open()));
        }
        let api = {
            let gw = gw.clone();
            tokio::spawn(server::serve(
                listeners.api,
                listeners.api_conns,
                move |peer, req| api::handle(gw.clone(), peer, req),
                stopped,
                drain,
            ))
        };
        // The admin listener stays up while the API port drains (`/readyz` says so).
        let (admin_stop, admin_stopped) = tokio::sync::watch::channel(false);
        let admin = tokio::spawn(server::serve(
            listeners.admin,
            listeners.admin_conns,
            move |_, req| admin::handle(admin.clone(), req),
            admin_stopped,
            Duration::from_secs(1),
        ));
        Servers {
            api,
            admin,
            admin_stop,
        }
    }

    /// After the API's stop: waits for its calls in flight (up to `drain`), then stops the
    /// admin listener.
    async fn drain(self, drain: Duration) {
        info!(
            drain_secs = drain.as_secs(),
            "no new connections; idle ones closed; waiting for calls in flight"
        );
        let cut = self.api.await.unwrap_or(0);
        server::log_drained("api", cut);
        let _ = self.admin_stop.send(true);
        let _ = self.admin.await;
    }
}

/// Serves until SIGTERM or Ctrl-C, reloading the keys file on SIGHUP. An error when the
/// API listener stops on its own.
async fn until_shutdown(
    gw: &Gateway,
    args: &Args,
    api_server: &mut JoinHandle<usize>,
) -> Result<(), String> {
    let mut term = signal(SignalKind::terminate()).map_err(|e| format!("SIGTERM: {e}"))?;
    let mut hup = signal(SignalKind::hangup()).map_err(|e| format!("SIGHUP: {e}"))?;
    loop {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => { info!("Ctrl-C: shutting down"); return Ok(()); }
            _ = term.recv() => { info!("SIGTERM: shutting down"); return Ok(()); }
            _ = hup.recv() => reload(gw, args).await,
            result = &mut *api_server => {
                return Err(format!("the API listener stopped: {result:?}"));
            }
        }
    }
}

/// Runs the gateway: parses the command line (and environment), starts the runtime, serves
/// until SIGTERM or Ctrl-C.
pub(crate) fn main() {
    let args = Args::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("fairgate-gateway: cannot start the runtime: {e}");
            std::process::exit(1);
        }
    };
    let otlp = match install_logs(&args, runtime.handle()) {
        Ok(otlp) => otlp,
        Err(message) => {
            eprintln!("fairgate-gateway: {message}");
            std::process::exit(1);
        }
    };
    let result = runtime.block_on(async {
        let result = run(args).await;
        if let Some(otlp) = otlp {
            otlp.shutdown().await;
        }
        result
    });
    if let Err(message) = result {
        eprintln!("fairgate-gateway: {message}");
        std::process::exit(1);
    }
}

/// Logs on stderr as `--log-format` says, filtered by RUST_LOG; and with `--otlp`, the
/// call spans to the collector (whatever RUST_LOG says), the exporter returned to flush.
fn install_logs(
    args: &Args,
    runtime: &tokio::runtime::Handle,
) -> Result<Option<otlp::Otlp>, String> {
    use tracing_subscriber::Layer;
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;

    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let lines = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    let lines = match args.log_format {
        // Colour codes only for a person at a terminal: a log file or a collector gets text.
        LogFormat::Text => lines.with_ansi(std::io::stderr().is_terminal()).boxed(),
        LogFormat::Json => lines.json().boxed(),
    };
    let logs = tracing_subscriber::registry().with(lines.with_filter(filter));
    match &args.otlp {
        None => {
            logs.init();
            Ok(None)
        }
        Some(endpoint) => {
            let (otlp, spans) = otlp::start(endpoint, runtime)?;
            logs.with(spans).init();
            Ok(Some(otlp))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_and_sizes_read_as_written() {
        assert_eq!(duration("10s"), Ok(Duration::from_secs(10)));
        assert_eq!(duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(duration("7"), Ok(Duration::from_secs(7)));
        assert!(duration("0s").is_err());
        assert!(duration("2d").is_err());
        assert!(duration("ten").is_err());
        assert_eq!(size("32MiB"), Ok(32 << 20));
        assert_eq!(size("512KiB"), Ok(512 << 10));
        assert_eq!(size("1000"), Ok(1000));
        assert!(size("0").is_err());
        assert!(size("3 parsecs").is_err());
    }

    #[test]
    fn the_public_url_is_an_http_base_url() {
        assert!(public_url("https://llm.example.com").is_ok());
        assert!(public_url("http://10.0.0.5:8080/anthropic/").is_ok());
        for bad in [
            "llm.example.com",
            "ftp://x",
            "https://x/?a=1",
            "https://x/#top",
            "/v1",
        ] {
            assert!(public_url(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn every_flag_reads_from_its_environment_variable_too() {
        use clap::CommandFactory;
        for arg in Args::command().get_arguments() {
            let id = arg.get_id().as_str();
            if id == "help" || id == "version" {
                continue;
            }
            let env = arg.get_env().map(|v| v.to_string_lossy().into_owned());
            let expected = format!("FAIRGATE_{}", id.to_uppercase());
            assert_eq!(env.as_deref(), Some(expected.as_str()), "--{id}");
        }
    }
}
