//! The admin listener's live page (`GET /`) and the numbers it shows (`GET /live`, JSON):
//! who is waiting right now and for what.
//!
//! The page is plain HTML, CSS and a small script, served from the binary (no build step,
//! nothing fetched from elsewhere); it reads `/live` every second. `/live` reads the same
//! state the metrics do: the store for the slots in use (the whole fleet's on Redis) and the
//! cooldown gates, the fair queue for the calls waiting here, and the metrics this process
//! publishes for the rest (latency quantiles, `Busy` by reason, this worker's fairness
//! index, the learned limits, the demoted tenants). The tenants' served tokens come from the
//! store too (the fleet's on Redis), and Jain's index over them is the fleet's.

use std::collections::BTreeMap;

use fairgate::{Priority, TenantId, metrics};

use super::api::Live;
use super::record::json_string as json;

/// The page.
pub(crate) const PAGE: &str = include_str!("dashboard.html");

/// The tenants whose served tokens are read for the page (a store read each, every second).
const MAX_TENANTS: usize = 200;

/// One sample of the metrics text: the labels and the value.
struct Sample {
    labels: BTreeMap<String, String>,
    value: f64,
}

/// The samples of `name` in Prometheus text.
fn samples(text: &str, name: &str) -> Vec<Sample> {
    let mut out = Vec::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        let (labels, value) = match rest.strip_prefix('{') {
            Some(rest) => match rest.rsplit_once('}') {
                Some((labels, value)) => (labels, value),
                None => continue,
            },
            None if rest.starts_with(' ') => ("", rest),
            None => continue,
        };
        let Ok(value) = value.trim().parse::<f64>() else {
            continue;
        };
        let labels = labels
            .split("\",")
            .filter_map(|pair| {
                let (key, value) = pair.split_once("=\"")?;
                Some((
                    key.trim().to_owned(),
                    value.trim_end_matches('"').to_owned(),
                ))
            })
            .collect();
        out.push(Sample { labels, value });
    }
    out
}

fn label<'a>(sample: &'a Sample, key: &str) -> &'a str {
    sample.labels.get(key).map_or("", String::as_str)
}

/// A JSON number (`null` for what JSON cannot carry).
fn num(x: f64) -> String {
    if x.is_finite() {
        format!("{x}")
    } else {
        "null".to_owned()
    }
}

/// The numbers of the live page, as JSON.
pub(crate) async fn live_json(live: &Live, metrics_text: &str) -> String {
    let tiers = tiers(live, metrics_text).await;
    let classes = classes(live, metrics_text);
    let Served {
        tenants,
        total,
        fleet_jain,
    } = served(live).await;
    let gauge = |name: &str| -> String {
        samples(metrics_text, name)
            .first()
            .map_or("null".to_owned(), |s| num(s.value))
    };
    let gates = gates(live, metrics_text);
    let probes = samples(metrics_text, metrics::PROBES);
    let probes_of = |reason: &str| -> f64 {
        probes
            .iter()
            .filter(|s| label(s, "reason") == reason)
            .fold(0.0, |sum, s| sum + s.value)
    };
    format!(
        concat!(
            r#"{{"store":{{"backend":{},"degraded":{}}},"#,
            r#""window":{{"in_flight":{},"max":{},"queued":{}}},"#,
            r#""tiers":[{}],"classes":[{}],"tenants":[{}],"fairness_index":{},"#,
            r#""worker_fairness_index":{},"#,
            r#""upstreams":[{}],"input_tokens_last_minute":{},"#,
            r#""probes":{{"cold_start":{},"recovery":{}}},"demoted_tenants":{}}}"#
        ),
        json(live.store.backend_name()),
        live.store.is_degraded(),
        live.fair.in_flight(),
        live.fair.max_in_flight(),
        live.fair.queued(None),
        tiers.join(","),
        classes.join(","),
        tenants.join(","),
        fleet_jain.map_or("null".to_owned(), num),
        gauge(metrics::FAIRNESS_INDEX),
        gates.join(","),
        num(total),
        num(probes_of("cold_start")),
        num(probes_of("recovery")),
        gauge(metrics::DEMOTED_TENANTS),
    )
}

/// Per tier: its cap, its calls in flight and waiting, and its refusals by reason.
async fn tiers(live: &Live, metrics_text: &str) -> Vec<String> {
    let busy = samples(metrics_text, metrics::SERVER_BUSY);
    let mut tiers = Vec::new();
    for (tier, limit) in live.config.policy.tiers() {
        let in_flight = live.store.slots_in_use(Some(&tier)).await;
        let waiting = live.fair.queued_in_tier(&tier);
        let by_reason = |reason: &str| -> f64 {
            busy.iter()
                .filter(|s| label(s, "tier") == tier.as_str() && label(s, "reason") == reason)
                .fold(0.0, |sum, s| sum + s.value)
        };
        tiers.push(format!(
            r#"{{"tier":{},"cap":{},"in_flight":{in_flight},"waiting":{waiting},"busy":{{"slot":{},"rate":{},"cooldown":{},"store":{}}}}}"#,
            json(tier.as_str()),
            limit.cap,
            num(by_reason("slot")),
            num(by_reason("rate")),
            num(by_reason("cooldown")),
            num(by_reason("store")),
        ));
    }
    tiers
}

/// Per priority class: its calls queued and its latency's median and 99th percentile.
fn classes(live: &Live, metrics_text: &str) -> Vec<String> {
    let latency = samples(metrics_text, metrics::REQUEST_LATENCY);
    let quantile = |class: &str, q: &str| -> String {
        latency
            .iter()
            .find(|s| label(s, "priority") == class && label(s, "quantile") == q)
            .map_or("null".to_owned(), |s| num(s.value * 1000.0))
    };
    Priority::ALL
        .iter()
        .map(|&class| {
            format!(
                r#"{{"class":{},"queued":{},"p50_ms":{},"p99_ms":{}}}"#,
                json(class.as_str()),
                live.fair.queued(Some(class)),
                quantile(class.as_str(), "0.5"),
                quantile(class.as_str(), "0.99"),
            )
        })
        .collect()
}

/// The tenants' served tokens, as the live page shows them.
struct Served {
    /// The ten tenants served most, as JSON.
    tenants: Vec<String>,
    /// Every tenant's tokens together.
    total: f64,
    /// Jain's index over the weighed tokens of the tenants served at all.
    fleet_jain: Option<f64>,
}

async fn served(live: &Live) -> Served {
    // Served tokens per tenant in the store's window (every worker's, on Redis), weighed by
    // the tenant's tier as the fair queue weighs it (pro and premium 3, others 1).
    let mut served = Vec::new();
    for tenant in live.config.tenants.iter().take(MAX_TENANTS) {
        let tokens = live
            .store
            .served_cost(&TenantId::from(tenant.as_str()))
            .await;
        let tier = live
            .config
            .tenant_tiers
            .get(tenant)
            .map_or("", String::as_str);
        let weight = if matches!(tier, "pro" | "premium") {
            3.0
        } else {
            1.0
        };
        served.push((tenant, tier, weight, tokens as f64));
    }
    let total = served.iter().fold(0.0, |sum, s| sum + s.3);
    let active: Vec<f64> = served
        .iter()
        .filter(|s| s.3 > 0.0)
        .map(|s| s.3 / s.2)
        .collect();
    let fleet_jain = fairgate::drr_fairness::scheduler::jain_index(active.iter().copied());
    served.sort_by(|a, b| b.3.total_cmp(&a.3));
    let tenants: Vec<String> = served
        .iter()
        .take(10)
        .map(|(tenant, tier, weight, tokens)| {
            let share = if total > 0.0 { tokens / total } else { 0.0 };
            format!(
                r#"{{"tenant":{},"tier":{},"weight":{},"tokens":{},"share":{}}}"#,
                json(tenant),
                json(tier),
                num(*weight),
                num(*tokens),
                num(share)
            )
        })
        .collect();
    Served {
        tenants,
        total,
        fleet_jain,
    }
}

/// Per upstream key: its learned limits and how long its cooldown gate stays closed.
fn gates(live: &Live, metrics_text: &str) -> Vec<String> {
    let learned = samples(metrics_text, metrics::LEARNED_LIMIT);
    let mut upstreams: Vec<String> = learned
        .iter()
        .map(|s| label(s, "upstream").to_owned())
        .collect();
    upstreams.push("default".to_owned());
    upstreams.sort();
    upstreams.dedup();
    upstreams
        .iter()
        .map(|upstream| {
            let limits: Vec<String> = learned
                .iter()
                .filter(|s| label(s, "upstream") == upstream)
                .map(|s| format!("{}:{}", json(label(s, "dimension")), num(s.value)))
                .collect();
            let closed = live.store.cooldown(upstream).map(|d| d.as_secs_f64());
            format!(
                r#"{{"upstream":{},"limits":{{{}}},"cooldown_secs":{}}}"#,
                json(upstream),
                limits.join(","),
                closed.map_or("null".to_owned(), num),
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_are_read_with_their_labels_and_nothing_else_matches() {
        let text = "# TYPE claude_server_busy_total counter\n\
                    claude_server_busy_total{tier=\"guest\",reason=\"rate\"} 13\n\
                    claude_server_busy_total_other 2\n\
                    claude_demoted_tenants 1\n";
        let busy = samples(text, "claude_server_busy_total");
        assert_eq!(busy.len(), 1);
        assert_eq!(label(&busy[0], "tier"), "guest");
        assert_eq!(label(&busy[0], "reason"), "rate");
        assert_eq!(busy[0].value, 13.0);
        assert_eq!(samples(text, "claude_demoted_tenants")[0].value, 1.0);
    }
}
