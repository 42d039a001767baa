//! The gateway from start to stop: the keys file and the flags checked, the store, the
//! upstreams and the listeners opened, the servers run until SIGTERM or Ctrl-C (the keys
//! file reloaded on SIGHUP), then a drain.

use std::io::IsTerminal;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use clap::Parser;
use fairgate::Store;
use metrics_exporter_prometheus::PrometheusHandle;
use tokio::signal::unix::{SignalKind, signal};
use tokio::task::JoinHandle;
use tracing::{info, warn};
use tracing_subscriber::EnvFilter;

use crate::admin::{self, otlp, telemetry};
use crate::admission::auth::AuthGuard;
use crate::admission::holders::{HolderLimits, Holders};
use crate::cli::{Args, LogFormat};
use crate::config;
use crate::ledger::{record, usage};
use crate::proxy::api::{self, BodyLimits, Gateway, Live};
use crate::proxy::batches;
use crate::proxy::upstreams::Upstreams;
use crate::server::{self, ConnLimits, Connections};

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
        if !crate::config::upstreams::same_pool(gw.upstreams.specs(), &config.upstreams)
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
            tokio::spawn(crate::allocator::follow_connections(move || conns.open()));
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
pub fn main() {
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
