//! The gateway's metrics: the Prometheus recorder installed once at start, the `# HELP` of
//! each family of its own, and every family published at 0 from start (a dashboard reads 0
//! rather than no data).

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

use crate::config::Config;

/// The gateway's own metrics: name, kind and `# HELP`.
const GATEWAY_METRICS: [(&str, MetricKind, &str); 22] = [
    (
        "gateway_connections_open",
        MetricKind::Gauge,
        "Connections open, by listener (api, admin).",
    ),
    (
        "gateway_connections_timed_out_total",
        MetricKind::Counter,
        "Connections closed for a late request head or idle keep-alive, by listener.",
    ),
    (
        "gateway_connections_evicted_total",
        MetricKind::Counter,
        "Idle connections closed to make room at the connection cap, by listener.",
    ),
    (
        "gateway_connections_refused_total",
        MetricKind::Counter,
        "Connections refused at the connection cap with none idle, by listener.",
    ),
    (
        "gateway_auth_failures_total",
        MetricKind::Counter,
        "Requests refused for their key, by answer (401 unknown key, 429 slowed).",
    ),
    (
        "gateway_key_refusals_total",
        MetricKind::Counter,
        "Requests refused for what their key holder holds, by reason (requests, body_bytes).",
    ),
    (
        "gateway_body_budget_used_bytes",
        MetricKind::Gauge,
        "Bytes of /v1/messages bodies being buffered, against --body-budget.",
    ),
    (
        "gateway_body_budget_refusals_total",
        MetricKind::Counter,
        "Requests answered 529 because --body-budget was spent.",
    ),
    (
        "gateway_answer_buffer_used_bytes",
        MetricKind::Gauge,
        "Bytes of answers waiting for their clients, against --answer-buffer.",
    ),
    (
        "gateway_answers_cut_total",
        MetricKind::Counter,
        "Answers cut because their client read nothing within --write-timeout.",
    ),
    (
        "gateway_record_dropped_total",
        MetricKind::Counter,
        "--record lines dropped because the writer's channel was full.",
    ),
    (
        "gateway_usage_estimated_total",
        MetricKind::Counter,
        "Answered calls counted at their estimate because their usage could not be read, by reason.",
    ),
    (
        "gateway_admin_refusals_total",
        MetricKind::Counter,
        "Admin requests answered 421 for naming a host the listener does not answer to.",
    ),
    (
        "gateway_batch_book_failures_total",
        MetricKind::Counter,
        "Batch owners the book could not record or read (Redis away): the call answered 503.",
    ),
    (
        "gateway_claim_refusals_total",
        MetricKind::Counter,
        "Calls refused for what they claimed or named, by what (the header, or metadata.user_id) and status (400, 403).",
    ),
    (
        "gateway_upstream_in_flight",
        MetricKind::Gauge,
        "Calls in flight at each upstream of the pool (until their answers end), by upstream.",
    ),
    (
        "gateway_upstream_set_aside",
        MetricKind::Gauge,
        "1 while an upstream is set aside by its breaker (no call until its probe), by upstream.",
    ),
    (
        "gateway_upstream_moved_away_total",
        MetricKind::Counter,
        "Calls sent to another upstream after this one did not run them, by upstream and reason (refused: its connection; overloaded: a 529).",
    ),
    (
        "gateway_streams_cut_total",
        MetricKind::Counter,
        "SSE answers whose upstream failed mid-stream, ended for the client with an error event.",
    ),
    (
        "gateway_upstream_served_total",
        MetricKind::Counter,
        "Calls an upstream of the pool answered, by upstream.",
    ),
    (
        "gateway_upstream_spilled_total",
        MetricKind::Counter,
        "Calls an upstream took past an earlier priority (full, set aside, or holding the call past [pool] spill_after_ms), by upstream.",
    ),
    (
        "gateway_upstream_none_total",
        MetricKind::Counter,
        "Calls answered 529 because no upstream of the pool had room.",
    ),
];

#[derive(Clone, Copy)]
enum MetricKind {
    Counter,
    Gauge,
}

/// Installs the Prometheus recorder: histograms with buckets for LLM calls, every family
/// described (`# HELP`), and every metric published from start (0 until its first event,
/// so a dashboard reads 0 rather than no data). Once at start: nothing per request.
pub(crate) fn install_metrics(config: &Config) -> Result<PrometheusHandle, String> {
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(
            Matcher::Suffix("_seconds".into()),
            &fairgate::metrics::LATENCY_BUCKETS,
        )
        .and_then(|builder| builder.install_recorder())
        .map_err(|e| format!("cannot install the metrics recorder: {e}"))?;
    // A service key's end users (`service/<hash>`) are labelled by their service: an
    // end user never becomes a label.
    fairgate::metrics::label_tenants_by_namespace(true);
    fairgate::metrics::describe();
    let tiers: Vec<_> = config
        .policy
        .tiers()
        .into_iter()
        .map(|(tier, _)| tier)
        .collect();
    fairgate::metrics::publish_zeros(&tiers);
    for (name, kind, help) in GATEWAY_METRICS {
        match kind {
            MetricKind::Counter => metrics::describe_counter!(name, help),
            MetricKind::Gauge => metrics::describe_gauge!(name, help),
        }
    }
    publish_zeros();
    Ok(handle)
}

/// Every labelled family of the gateway's own metrics at 0 from start.
fn publish_zeros() {
    for listener in ["api", "admin"] {
        metrics::gauge!("gateway_connections_open", "listener" => listener).increment(0.0);
        for name in [
            "gateway_connections_timed_out_total",
            "gateway_connections_evicted_total",
            "gateway_connections_refused_total",
        ] {
            metrics::counter!(name, "listener" => listener).increment(0);
        }
    }
    for answer in ["401", "429"] {
        metrics::counter!("gateway_auth_failures_total", "answer" => answer).increment(0);
    }
    for reason in ["requests", "body_bytes"] {
        metrics::counter!("gateway_key_refusals_total", "reason" => reason).increment(0);
    }
    for reason in [
        "no_usage",
        "cut",
        "unknown_encoding",
        "more_than_one_encoding",
        "does_not_decode",
        "past_the_bound",
        "too_many_pieces",
    ] {
        metrics::counter!("gateway_usage_estimated_total", "reason" => reason).increment(0);
    }
    metrics::counter!("gateway_admin_refusals_total", "reason" => "host").increment(0);
    for what in [
        "metadata.user_id",
        "x-fairgate-user",
        "x-fairgate-tier",
        "x-fairgate-origin",
        "x-fairgate-sla",
    ] {
        for status in ["400", "403"] {
            metrics::counter!("gateway_claim_refusals_total", "what" => what, "status" => status)
                .increment(0);
        }
    }
    for name in [
        "gateway_body_budget_refusals_total",
        "gateway_answers_cut_total",
        "gateway_record_dropped_total",
        "gateway_batch_book_failures_total",
        "gateway_upstream_none_total",
        "gateway_streams_cut_total",
    ] {
        metrics::counter!(name).increment(0);
    }
    for name in [
        "gateway_body_budget_used_bytes",
        "gateway_answer_buffer_used_bytes",
    ] {
        metrics::gauge!(name).increment(0.0);
    }
}
