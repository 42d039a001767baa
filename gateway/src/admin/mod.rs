//! The admin listener (`--admin`, loopback by default): what operators and their probes
//! read, kept off the API port (tenant names and usage are not for every client).
//!
//! - `GET /metrics`: Prometheus text.
//! - `GET /healthz`: `200 ok` while the process serves.
//! - `GET /readyz`: `200` once the keys are loaded, saying whether Redis answers or the
//!   store serves from in-process state (degraded, still serving); `503` while draining.
//! - `GET /status`: JSON: store, keys, connections, body budget, reloads, slowed
//!   addresses and (address, key) pairs, and the upstreams of the pool (calls in flight,
//!   set aside, calls moved away).
//! - `GET /usage`: what each tenant used per UTC day (tokens and calls, for billing), as
//!   JSON or JSON lines (`?format=jsonl`), filtered by `?day=YYYY-MM-DD` and `?tenant=`;
//!   the fleet's on Redis (see `ledger::usage`).
//! - `GET /`: the live page, and `GET /live`, the JSON it reads every second: calls in
//!   flight and waiting per tier, `Busy` by reason, latency per class, top tenants, learned
//!   limits and cooldown gates (see `dashboard`).
//!
//! On a loopback address, every route but `/healthz` and `/readyz` answers `421` unless the
//! request names the listener as `localhost`, `127.0.0.1` or `[::1]` (any port) or a name
//! given with `--admin-host`: a web page the operator opens cannot read the tenants' names
//! and usage by rebinding its own name to 127.0.0.1.
//!
//! With `--admin-token`, every route but `/healthz` and `/readyz` answers `401` unless the
//! request carries `Authorization: Bearer <token>` (or `Basic` with the token as the
//! password, which a browser sends for the live page and its `/live` once asked). The two
//! probes stay open: load balancers' and orchestrators' health checks often cannot send a
//! header, and they say only whether the process serves (no tenant, no usage). The token
//! is kept as its SHA-256 and compared in constant time.

pub(crate) mod dashboard;
pub(crate) mod otlp;
pub(crate) mod telemetry;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use http::header::{self, HeaderValue};
use http::{HeaderMap, Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use metrics_exporter_prometheus::PrometheusHandle;
use sha2::{Digest, Sha256};

use crate::body::Body;
use crate::body::full;
use crate::own_answer::error_response;
use crate::proxy::api::Gateway;
use crate::server::Connections;

/// What the admin listener reads from.
pub(crate) struct Admin {
    pub(crate) gateway: Arc<Gateway>,
    pub(crate) connections: Arc<Connections>,
    pub(crate) metrics: PrometheusHandle,
    pub(crate) started: Instant,
    /// What every route but the probes asks for, when set.
    pub(crate) token: Option<AdminToken>,
    /// `--fleet-size`: the gateways a degraded store shares the caps with, at least.
    pub(crate) fleet_size: u32,
    /// The host names a request may name, when the listener is on loopback.
    pub(crate) hosts: Option<AdminHosts>,
}

/// The names the admin listener answers to when it listens on loopback: `localhost`,
/// `127.0.0.1`, `[::1]` and those of `--admin-host`, with or without a port. A page on
/// another site cannot read the tenants' names and usage by pointing its own name at
/// 127.0.0.1 (DNS rebinding): its requests name that site.
#[derive(Clone, Debug)]
pub(crate) struct AdminHosts {
    names: Vec<String>,
}

impl AdminHosts {
    /// The loopback names and `extra`, for a listener on `addr`; `None` beyond loopback
    /// (where `--admin-token` guards every route).
    pub(crate) fn for_listener(addr: std::net::SocketAddr, extra: &[String]) -> Option<AdminHosts> {
        addr.ip().to_canonical().is_loopback().then(|| AdminHosts {
            names: ["localhost", "127.0.0.1", "[::1]"]
                .into_iter()
                .map(str::to_owned)
                .chain(extra.iter().map(|name| name.trim().to_ascii_lowercase()))
                .collect(),
        })
    }

    /// Whether the request names one of the listener's hosts (its `Host`, or over HTTP/2
    /// its `:authority`).
    fn admits<B>(&self, req: &Request<B>) -> bool {
        let named = req
            .uri()
            .authority()
            .map(|authority| authority.as_str().to_owned())
            .or_else(|| {
                let host = req.headers().get(header::HOST)?;
                host.to_str().ok().map(str::to_owned)
            });
        let Some(named) = named else {
            return false;
        };
        let named = named.to_ascii_lowercase();
        // The port, if any, is whatever the client used to reach the listener.
        let host = match named.rsplit_once(':') {
            Some((host, port))
                if port.bytes().all(|b| b.is_ascii_digit()) && !host.ends_with(':') =>
            {
                host
            }
            _ => named.as_str(),
        };
        self.names.iter().any(|name| name == host)
    }
}

/// The admin listener's bearer token (`--admin-token`), kept as its SHA-256; its `Debug`
/// shows nothing of it.
#[derive(Clone)]
pub(crate) struct AdminToken {
    sha256: [u8; 32],
    /// Why the token is refused, if it is (checked at start, so that the refusal does not
    /// quote it as a flag parser's would).
    refused: Option<String>,
}

impl std::fmt::Debug for AdminToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AdminToken(..)")
    }
}

/// The shortest token taken: a short one could be guessed over the network.
const MIN_TOKEN_LEN: usize = 16;

impl AdminToken {
    /// Reads `--admin-token`; never fails (see [`check`](Self::check)).
    pub(crate) fn read(token: &str) -> Result<AdminToken, std::convert::Infallible> {
        let refused = (token.len() < MIN_TOKEN_LEN || !token.bytes().all(|b| b.is_ascii_graphic()))
            .then(|| {
                format!(
                    "--admin-token: give at least {MIN_TOKEN_LEN} visible ASCII characters, no \
                 spaces (e.g. `openssl rand -hex 32`)"
                )
            });
        Ok(AdminToken {
            sha256: Sha256::digest(token.as_bytes()).into(),
            refused,
        })
    }

    /// Refuses a token shorter than 16 characters, or one a header cannot carry.
    pub(crate) fn check(&self) -> Result<(), String> {
        self.refused.clone().map_or(Ok(()), Err)
    }

    /// Whether `presented` is the token: the digests compared in constant time (an XOR of
    /// every byte), so the time of a refusal says nothing of how much of a guess was right.
    fn is(&self, presented: &[u8]) -> bool {
        let digest: [u8; 32] = Sha256::digest(presented).into();
        digest
            .iter()
            .zip(self.sha256.iter())
            .fold(0u8, |diff, (a, b)| diff | (a ^ b))
            == 0
    }

    /// Whether `headers` carry the token: `Authorization: Bearer <token>`, or `Basic` with
    /// the token as the password (any user name).
    fn admits(&self, headers: &HeaderMap) -> bool {
        let Some(value) = headers.get(header::AUTHORIZATION) else {
            return false;
        };
        let value = value.as_bytes().trim_ascii();
        let Some(space) = value.iter().position(|&b| b == b' ') else {
            return false;
        };
        let (scheme, rest) = (&value[..space], value[space..].trim_ascii());
        if scheme.eq_ignore_ascii_case(b"bearer") {
            return self.is(rest);
        }
        if scheme.eq_ignore_ascii_case(b"basic") {
            return base64_decode(rest)
                .and_then(|pair| {
                    let colon = pair.iter().position(|&b| b == b':')?;
                    Some(self.is(&pair[colon + 1..]))
                })
                .unwrap_or(false);
        }
        false
    }
}

/// Standard base64 (padding optional), or `None`.
fn base64_decode(text: &[u8]) -> Option<Vec<u8>> {
    let text = text
        .strip_suffix(b"==")
        .or(text.strip_suffix(b"="))
        .unwrap_or(text);
    let mut out = Vec::with_capacity(text.len() * 3 / 4);
    let (mut bits, mut n) = (0u32, 0u32);
    for &c in text {
        let v = match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        };
        bits = (bits << 6) | u32::from(v);
        n += 6;
        if n >= 8 {
            n -= 8;
            out.push((bits >> n) as u8);
            bits &= (1 << n) - 1;
        }
    }
    Some(out)
}

fn unauthorized() -> Response<Body> {
    let mut response = error_response(
        StatusCode::UNAUTHORIZED,
        "authentication_error",
        "the admin listener needs Authorization: Bearer <admin token>",
    );
    response.headers_mut().insert(
        header::WWW_AUTHENTICATE,
        HeaderValue::from_static("Bearer realm=\"fairgate admin\", Basic realm=\"fairgate admin\""),
    );
    response
}

fn text(status: StatusCode, content_type: &'static str, body: String) -> Response<Body> {
    let mut response = Response::new(full(body));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    response
}

pub(crate) async fn handle(admin: Arc<Admin>, req: Request<Incoming>) -> Response<Body> {
    let probe = matches!(req.uri().path(), "/healthz" | "/readyz");
    if let Some(hosts) = &admin.hosts
        && !probe
        && !hosts.admits(&req)
    {
        metrics::counter!("gateway_admin_refusals_total", "reason" => "host").increment(1);
        return error_response(
            StatusCode::MISDIRECTED_REQUEST,
            "invalid_request_error",
            "this admin listener answers only to localhost, 127.0.0.1, [::1] and the names \
             of --admin-host",
        );
    }
    if let Some(token) = &admin.token
        && !probe
        && !token.admits(req.headers())
    {
        return unauthorized();
    }
    if req.method() != Method::GET {
        return error_response(StatusCode::NOT_FOUND, "not_found_error", "not found");
    }
    let gw = &admin.gateway;
    match req.uri().path() {
        "/metrics" => {
            // Each upstream's numbers, read from the pool as the scrape asks for them.
            gw.upstreams.publish();
            text(
                StatusCode::OK,
                "text/plain; version=0.0.4",
                admin.metrics.render(),
            )
        }
        "/healthz" => text(StatusCode::OK, "text/plain", "ok\n".into()),
        "/" => text(
            StatusCode::OK,
            "text/html; charset=utf-8",
            crate::admin::dashboard::PAGE.to_owned(),
        ),
        "/live" => {
            let live = gw.live();
            let pool = gw.upstreams.json();
            let body =
                crate::admin::dashboard::live_json(&live, &admin.metrics.render(), &pool).await;
            text(StatusCode::OK, "application/json", body)
        }
        "/readyz" => readyz(&admin),
        "/status" => status(&admin),
        "/usage" => usage(gw, req.uri().query()).await,
        _ => error_response(StatusCode::NOT_FOUND, "not_found_error", "not found"),
    }
}

/// `/usage`: what each tenant used per day, as JSON or JSON lines (see `usage.rs`); `400`
/// for a query it cannot read, `503` when Redis cannot answer.
async fn usage(gw: &Gateway, query: Option<&str>) -> Response<Body> {
    let (filter, lines) = match crate::ledger::usage::query(query) {
        Ok(read) => read,
        Err(why) => {
            return error_response(StatusCode::BAD_REQUEST, "invalid_request_error", &why);
        }
    };
    match gw.usage.rows(&filter).await {
        Ok(rows) => {
            let content_type = match lines {
                true => "application/x-ndjson",
                false => "application/json",
            };
            text(
                StatusCode::OK,
                content_type,
                crate::ledger::usage::render(&rows, lines),
            )
        }
        Err(why) => error_response(StatusCode::SERVICE_UNAVAILABLE, "api_error", &why),
    }
}

/// `/readyz`: `200` with the keys loaded and what the store serves from; `503` draining.
fn readyz(admin: &Admin) -> Response<Body> {
    let gw = &admin.gateway;
    let live = gw.live();
    let store = match (live.store.backend_name(), live.store.is_degraded()) {
        ("redis", false) => "redis reachable".to_owned(),
        ("redis", true) => {
            // The store's own rule: the last count seen alive, at least the fleet.
            let fleet = live.store.alive_workers().max(admin.fleet_size);
            format!(
                "redis unreachable: degraded, serving 1/{fleet} of the caps from \
                 in-process state ({fleet} gateways: the last count seen alive, at \
                 least --fleet-size)"
            )
        }
        _ => "in-process store".to_owned(),
    };
    let keys = live.config.keys.len();
    if gw.draining() {
        text(
            StatusCode::SERVICE_UNAVAILABLE,
            "text/plain",
            "draining\n".into(),
        )
    } else {
        text(
            StatusCode::OK,
            "text/plain",
            format!("ready: {keys} keys loaded; {store}\n"),
        )
    }
}

/// `/status`: the gateway's state as JSON.
fn status(admin: &Admin) -> Response<Body> {
    let gw = &admin.gateway;
    let live = gw.live();
    let conns = &admin.connections;
    let limits = conns.limits();
    let body = format!(
        concat!(
            r#"{{"version":"{version}","uptime_secs":{uptime},"draining":{draining},"#,
            r#""store":{{"backend":"{backend}","degraded":{degraded}}},"#,
            r#""keys":{{"keys":{keys},"tenants":{tenants},"reloads":{reloads},"failed_reloads":{failed}}},"#,
            r#""connections":{{"open":{open},"max":{max},"evicted":{evicted},"timed_out":{timed_out},"refused":{refused}}},"#,
            r#""body_budget":{{"used_bytes":{used},"max_bytes":{budget}}},"#,
            r#""answer_buffer":{{"used_bytes":{answers}}},"#,
            r#""per_key":{{"requests":{key_requests},"body_bytes":{key_body},"answer_bytes":{key_answers}}},"#,
            r#""auth":{{"slowed_addresses":{slowed},"slowed_keys":{slowed_keys}}},"#,
            r#""upstreams":{upstreams}}}"#
        ),
        version = env!("CARGO_PKG_VERSION"),
        uptime = admin.started.elapsed().as_secs(),
        draining = gw.draining(),
        backend = live.store.backend_name(),
        degraded = live.store.is_degraded(),
        keys = live.config.keys.len(),
        tenants = live.config.tenants.len(),
        reloads = gw.reloads.load(Ordering::Relaxed),
        failed = gw.failed_reloads.load(Ordering::Relaxed),
        open = conns.open(),
        max = limits.max,
        evicted = conns.evicted.load(Ordering::Relaxed),
        timed_out = conns.timed_out.load(Ordering::Relaxed),
        refused = conns.refused.load(Ordering::Relaxed),
        used = gw.holders.body_used(),
        budget = gw.holders.body_max(),
        answers = gw.holders.answers_used(),
        key_requests = gw.holders.limits().requests,
        key_body = gw.holders.limits().body_bytes,
        key_answers = gw.holders.limits().answer_bytes,
        slowed = gw.auth.slowed_addresses(),
        slowed_keys = gw.auth.slowed_keys(),
        upstreams = gw.upstreams.json(),
    );
    text(StatusCode::OK, "application/json", body)
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOKEN: &str = "admin-token-0123456789";

    fn headers(authorization: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(
            header::AUTHORIZATION,
            HeaderValue::from_str(authorization).unwrap(),
        );
        headers
    }

    #[test]
    fn only_the_token_is_admitted_as_bearer_or_as_a_basic_password() {
        let token = AdminToken::read(TOKEN).unwrap();
        assert!(token.admits(&headers(&format!("Bearer {TOKEN}"))));
        assert!(token.admits(&headers(&format!("bearer  {TOKEN} "))));
        // `ops:admin-token-0123456789`, as a browser sends it.
        assert!(token.admits(&headers("Basic b3BzOmFkbWluLXRva2VuLTAxMjM0NTY3ODk=")));
        assert!(!token.admits(&HeaderMap::new()));
        assert!(!token.admits(&headers(&format!("Bearer {TOKEN}x"))));
        assert!(!token.admits(&headers(&format!("Bearer {}", &TOKEN[..20]))));
        assert!(!token.admits(&headers(TOKEN)));
        assert!(!token.admits(&headers("Bearer")));
        assert!(!token.admits(&headers("Basic !!!")));
        assert!(!token.admits(&headers("Basic b3Bz"))); // `ops`: no password
        assert_eq!(format!("{token:?}"), "AdminToken(..)");
    }

    #[test]
    fn on_loopback_only_the_listeners_own_names_are_answered() {
        let addr = "127.0.0.1:9464".parse().unwrap();
        let hosts = AdminHosts::for_listener(addr, &["Gateway.Internal".to_owned()]).unwrap();
        let named = |host: &str| {
            let req = Request::get("/live")
                .header(header::HOST, host)
                .body(())
                .unwrap();
            hosts.admits(&req)
        };
        for host in [
            "localhost",
            "localhost:9464",
            "127.0.0.1:1",
            "[::1]:9464",
            "[::1]",
        ] {
            assert!(named(host), "{host}");
        }
        assert!(named("gateway.internal:80"));
        for host in [
            "attacker.example",
            "attacker.example:9464",
            "localhost.attacker.example",
        ] {
            assert!(!named(host), "{host}");
        }
        assert!(!named("127.0.0.1.nip.io"));
        let none = Request::get("/live").body(()).unwrap();
        assert!(!hosts.admits(&none), "no Host");
        let http2 = Request::get("http://localhost:9464/live").body(()).unwrap();
        assert!(hosts.admits(&http2), ":authority");
        let public = "0.0.0.0:9464".parse().unwrap();
        assert!(AdminHosts::for_listener(public, &[]).is_none());
    }

    #[test]
    fn a_short_or_unsendable_token_is_refused() {
        let check = |token: &str| AdminToken::read(token).unwrap().check();
        assert!(check("short").is_err());
        assert!(check("sixteen chars ok").is_err(), "a space");
        assert!(!check("sixteen chars ok").unwrap_err().contains("sixteen"));
        assert_eq!(check("sixteen-chars-ok"), Ok(()));
    }

    #[test]
    fn base64_decodes_with_or_without_padding() {
        assert_eq!(base64_decode(b"b3Bz").as_deref(), Some(&b"ops"[..]));
        assert_eq!(base64_decode(b"b3A=").as_deref(), Some(&b"op"[..]));
        assert_eq!(base64_decode(b"bw==").as_deref(), Some(&b"o"[..]));
        assert_eq!(base64_decode(b"bw").as_deref(), Some(&b"o"[..]));
        assert_eq!(base64_decode(b"b w"), None);
    }
}
