//! The command line (and its environment variables): every flag of `fairgate-gateway`,
//! checked as it is read.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use http::Uri;

use crate::admin::{self, otlp};

/// An Anthropic-compatible gateway with fair, tier-aware admission control.
///
/// Clients use their own key from the keys file (`x-api-key` or `Authorization: Bearer`);
/// the upstream (--upstream) is called with ANTHROPIC_API_KEY (from the environment only),
/// or the keys file's [[upstreams]] with theirs.
/// The admin listener (--admin, http://127.0.0.1:9464/ by default) serves the live page
/// at /, its numbers at /live, each tenant's usage at /usage, and /metrics, /status,
/// /healthz, /readyz.
/// SIGHUP reloads the keys file; SIGTERM or Ctrl-C drains and stops. Logs: RUST_LOG
/// (default info), on stderr, in --log-format.
#[derive(Debug, Parser)]
#[command(name = "fairgate-gateway", version, about, long_about)]
pub(crate) struct Args {
    /// Address to serve the API on, e.g. 127.0.0.1:8080.
    #[arg(long, env = "FAIRGATE_LISTEN", value_name = "ADDR")]
    pub(crate) listen: SocketAddr,

    /// The Anthropic API, e.g. `https://api.anthropic.com` (`http://` for a local mock);
    /// not with the keys file's `[[upstreams]]`.
    #[arg(long, env = "FAIRGATE_UPSTREAM", value_name = "URL", value_parser = upstream_url,
          help = "The Anthropic API, e.g. https://api.anthropic.com (http:// for a local mock); \
                  not with the keys file's [[upstreams]]")]
    pub(crate) upstream: Option<Uri>,

    /// Calls `--upstream` over HTTP/2: many calls a connection (`https://` by ALPN,
    /// `http://` with prior knowledge); the upstream must speak it.
    #[arg(long, env = "FAIRGATE_UPSTREAM_HTTP2", requires = "upstream")]
    pub(crate) upstream_http2: bool,

    /// The clients' keys (TOML: `[[keys]]` key, tenant, tier; optional `[limits]`, `[[tiers]]`).
    #[arg(
        long,
        env = "FAIRGATE_KEYS",
        value_name = "FILE",
        help = "The clients' keys (TOML: [[keys]] key, tenant, tier; optional [limits], [[tiers]])"
    )]
    pub(crate) keys: PathBuf,

    /// Share the caps with other gateways through Redis (default: this process only).
    #[arg(long, env = "FAIRGATE_REDIS", value_name = "URL", hide_env_values = true,
          value_parser = redis_url)]
    pub(crate) redis: Option<String>,

    /// Address of the admin listener: the live page (/) and its numbers (/live), /usage,
    /// /metrics, /status, /healthz, /readyz.
    #[arg(
        long,
        env = "FAIRGATE_ADMIN",
        value_name = "ADDR",
        default_value = "127.0.0.1:9464"
    )]
    pub(crate) admin: SocketAddr,

    /// Bearer token every admin route but /healthz and /readyz asks for; required when
    /// --admin binds beyond loopback. Prefer the environment variable (a flag shows in ps).
    #[arg(long, env = "FAIRGATE_ADMIN_TOKEN", value_name = "TOKEN", hide_env_values = true,
          value_parser = admin::AdminToken::read)]
    pub(crate) admin_token: Option<admin::AdminToken>,

    /// A host name the admin listener on loopback answers to, besides localhost, 127.0.0.1
    /// and ::1 (repeat for more): other names get 421 (/healthz and /readyz answer any).
    #[arg(
        long,
        env = "FAIRGATE_ADMIN_HOST",
        value_name = "NAME",
        value_delimiter = ','
    )]
    pub(crate) admin_host: Vec<String>,

    /// How many gateways share --redis: while Redis has not answered since start, each
    /// serves the caps divided by this (default 1: the whole caps, right for one gateway).
    #[arg(long, env = "FAIRGATE_FLEET_SIZE", value_name = "N", default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub(crate) fleet_size: u32,

    /// Connections open at once on the API port; at the cap a new one closes the oldest idle
    /// one, or is answered 529 when none is idle. Lowered to fit the open-files limit, two
    /// files a call (its connection and the upstream's; one when every upstream is HTTP/2).
    #[arg(long, env = "FAIRGATE_MAX_CONNECTIONS", value_name = "N", default_value_t = 4096,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub(crate) max_connections: u32,

    /// Time a client has to send a request's head (trickled heads are closed).
    #[arg(long, env = "FAIRGATE_HEADER_TIMEOUT", value_name = "DURATION", default_value = "10s",
          value_parser = duration)]
    pub(crate) header_timeout: Duration,

    /// Time a request body may stall between two reads (408 past it).
    #[arg(long, env = "FAIRGATE_BODY_IDLE_TIMEOUT", value_name = "DURATION",
          default_value = "10s", value_parser = duration)]
    pub(crate) body_idle_timeout: Duration,

    /// Time a /v1/messages body may take in all, however it trickles (408 past it).
    #[arg(long, env = "FAIRGATE_BODY_TIMEOUT", value_name = "DURATION", default_value = "60s",
          value_parser = duration)]
    pub(crate) body_timeout: Duration,

    /// Time an idle keep-alive connection stays open.
    #[arg(long, env = "FAIRGATE_KEEP_ALIVE_TIMEOUT", value_name = "DURATION",
          default_value = "30s", value_parser = duration)]
    pub(crate) keep_alive_timeout: Duration,

    /// The largest /v1/messages body (413 past it), e.g. 32MiB.
    #[arg(long, env = "FAIRGATE_MAX_BODY", value_name = "SIZE", default_value = "32MiB",
          value_parser = size)]
    pub(crate) max_body: usize,

    /// Memory all /v1/messages bodies being buffered may take together (529 past it).
    #[arg(long, env = "FAIRGATE_BODY_BUDGET", value_name = "SIZE", default_value = "128MiB",
          value_parser = size)]
    pub(crate) body_budget: usize,

    /// Body bytes one key holder's requests may have buffered at once (429 past it);
    /// default: a quarter of --body-budget, at least --max-body.
    #[arg(long, env = "FAIRGATE_KEY_BODY_BUDGET", value_name = "SIZE", value_parser = size)]
    pub(crate) key_body_budget: Option<usize>,

    /// Requests one key holder may have in progress at once, from its key check to its
    /// answer's last byte (429 past it); default: a quarter of --max-connections.
    #[arg(long, env = "FAIRGATE_KEY_MAX_REQUESTS", value_name = "N",
          value_parser = clap::value_parser!(u32).range(1..))]
    pub(crate) key_max_requests: Option<u32>,

    /// Memory all answers waiting for their clients to read them may take together.
    #[arg(long, env = "FAIRGATE_ANSWER_BUFFER", value_name = "SIZE", default_value = "256MiB",
          value_parser = size)]
    pub(crate) answer_buffer: usize,

    /// Memory one key holder's answers waiting for their clients may take; past it the
    /// upstream is read no faster than the client reads.
    #[arg(long, env = "FAIRGATE_KEY_ANSWER_BUFFER", value_name = "SIZE",
          default_value = "8MiB", value_parser = size)]
    pub(crate) key_answer_buffer: usize,

    /// Time an answer may wait with nothing of it read by its client (the connection is
    /// cut past it).
    #[arg(long, env = "FAIRGATE_WRITE_TIMEOUT", value_name = "DURATION", default_value = "30s",
          value_parser = duration)]
    pub(crate) write_timeout: Duration,

    /// Failed authentications with one key, and with distinct keys, an address may make at
    /// once before it is slowed (429).
    #[arg(
        long,
        env = "FAIRGATE_AUTH_FAILURE_BURST",
        value_name = "N",
        default_value_t = 20
    )]
    pub(crate) auth_failure_burst: u32,

    /// Failed authentications (as above) an address may make per second after its burst.
    #[arg(
        long,
        env = "FAIRGATE_AUTH_FAILURE_RATE",
        value_name = "PER_SEC",
        default_value_t = 1.0
    )]
    pub(crate) auth_failure_rate: f64,

    /// How long calls in flight may take to finish after SIGTERM or Ctrl-C.
    #[arg(long, env = "FAIRGATE_DRAIN_TIMEOUT", value_name = "DURATION", default_value = "30s",
          value_parser = duration)]
    pub(crate) drain_timeout: Duration,

    /// The URL clients reach this gateway at, e.g. `https://llm.example.com`: batches'
    /// `results_url` points there (default: `http://` and the listen address).
    #[arg(long, env = "FAIRGATE_PUBLIC_URL", value_name = "URL", value_parser = public_url,
          help = "The URL clients reach this gateway at, e.g. https://llm.example.com: \
                  batches' results_url points there (default: http:// and the listen address)")]
    pub(crate) public_url: Option<Uri>,

    /// Record each POST /v1/messages call the admission stack saw to FILE (created or
    /// truncated), one JSON line each when it ends: for the simulator's --replay.
    #[arg(long, env = "FAIRGATE_RECORD", value_name = "FILE")]
    pub(crate) record: Option<PathBuf>,

    /// Log lines on stderr: `text` (coloured only when stderr is a terminal) or `json` (one
    /// object a line, for a log collector).
    #[arg(long, env = "FAIRGATE_LOG_FORMAT", value_name = "FORMAT", value_enum,
          default_value_t = LogFormat::Text)]
    pub(crate) log_format: LogFormat,

    /// Export the span of every call through the admission stack (tenant, tier, class,
    /// waits, attempts, upstream, status) over OTLP/HTTP to URL, e.g.
    /// http://127.0.0.1:4318 (its /v1/traces); nothing is traced when unset.
    #[arg(long, env = "FAIRGATE_OTLP", value_name = "URL", value_parser = otlp::endpoint)]
    pub(crate) otlp: Option<Uri>,
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

pub(crate) fn public_url(value: &str) -> Result<Uri, String> {
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
    fn the_help_names_the_live_page_and_the_admin_routes() {
        use clap::CommandFactory;
        let help = Args::command().render_long_help().to_string();
        for route in ["live page", "/live", "/usage", "/metrics", "9464"] {
            assert!(
                help.contains(route),
                "--help does not name {route}:\n{help}"
            );
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
