//! The admin listener (`--admin`, loopback by default): what operators and their probes
//! read, kept off the API port (tenant names and usage are not for every client).
//!
//! - `GET /metrics`: Prometheus text.
//! - `GET /healthz`: `200 ok` while the process serves.
//! - `GET /readyz`: `200` once the keys are loaded, saying whether Redis answers or the
//!   store serves from in-process state (degraded, still serving); `503` while draining.
//! - `GET /status`: JSON: store, keys, connections, body budget, reloads.
//! - `GET /`: the live page, and `GET /live`, the JSON it reads every second: calls in
//!   flight and waiting per tier, `Busy` by reason, latency per class, top tenants, learned
//!   limits and cooldown gates (see `dashboard.rs`).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use http::header::{self, HeaderValue};
use http::{Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use metrics_exporter_prometheus::PrometheusHandle;

use super::Body;
use super::api::{Gateway, error_response};
use super::server::Connections;
use super::upstream::full;

/// What the admin listener reads from.
pub(crate) struct Admin {
    pub(crate) gateway: Arc<Gateway>,
    pub(crate) connections: Arc<Connections>,
    pub(crate) metrics: PrometheusHandle,
    pub(crate) started: Instant,
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
    if req.method() != Method::GET {
        return error_response(StatusCode::NOT_FOUND, "not_found_error", "not found");
    }
    let gw = &admin.gateway;
    match req.uri().path() {
        "/metrics" => text(
            StatusCode::OK,
            "text/plain; version=0.0.4",
            admin.metrics.render(),
        ),
        "/healthz" => text(StatusCode::OK, "text/plain", "ok\n".into()),
        "/" => text(
            StatusCode::OK,
            "text/html; charset=utf-8",
            super::dashboard::PAGE.to_owned(),
        ),
        "/live" => {
            let live = gw.live();
            let body = super::dashboard::live_json(&live, &admin.metrics.render()).await;
            text(StatusCode::OK, "application/json", body)
        }
        "/readyz" => {
            let live = gw.live();
            let store = match (live.store.backend_name(), live.store.is_degraded()) {
                ("redis", false) => "redis reachable",
                ("redis", true) => "redis unreachable: degraded, serving from in-process state",
                _ => "in-process store",
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
        "/status" => {
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
                    r#""auth":{{"slowed_addresses":{slowed}}}}}"#
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
            );
            text(StatusCode::OK, "application/json", body)
        }
        _ => error_response(StatusCode::NOT_FOUND, "not_found_error", "not found"),
    }
}
