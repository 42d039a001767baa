//! The admin listener's live page (`GET /`) and the numbers it shows (`GET /live`, JSON):
//! who is waiting right now and for what.
//!
//! The page is plain HTML, CSS and a small script, served from the binary (no build step,
//! nothing fetched from elsewhere); it reads `/live` every second. `/live` reads the same
//! state the metrics do: the store for the slots in use (the whole fleet's on Redis) and the
//! cooldown gates, the fair queue for the calls waiting here, and the metrics this process
//! publishes for the rest (latency quantiles of the last minute's answered calls, from the
//! histogram's buckets; `Busy` by reason, the learned limits, the demoted tenants). Calls
//! not yet finished are shown as they run: how long the oldest waiting and the oldest in
//! flight have been, per tier and class (the fair queue's waiting requests, the `flights`
//! book), and the tokens in flight apart from those served. The tenants served most come
//! from the store (`Store::top_served`: the fleet's on Redis, end users of a service by
//! their hashed tenant, never their id); the fairness index is the fair queue's, one
//! number (the fleet's on Redis).

use std::collections::BTreeMap;

use fairgate::{Priority, metrics};

use crate::ledger::flights::Aloft;
use crate::ledger::record::json_string as json;
use crate::proxy::api::Live;

/// The page.
pub(crate) const PAGE: &str = include_str!("dashboard.html");

/// The tenants the page shows: the store's served most.
const SHOWN_TENANTS: usize = 10;

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
/// `pool` is the upstreams' JSON array (the `upstreams` module).
pub(crate) async fn live_json(live: &Live, metrics_text: &str, pool: &str) -> String {
    let aloft = live.flights.aloft();
    let tiers = tiers(live, metrics_text, &aloft).await;
    let classes = classes(live, metrics_text, &aloft);
    let Served { tenants, total } = served(live).await;
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
            r#""window":{{"in_flight":{},"max":{},"queued":{},"longest_wait_ms":{},"#,
            r#""oldest_in_flight_ms":{},"tokens_in_flight":{}}},"#,
            r#""tiers":[{}],"classes":[{}],"tenants":[{}],"fairness_index":{},"#,
            r#""upstreams":[{}],"input_tokens_last_minute":{},"#,
            r#""probes":{{"cold_start":{},"recovery":{}}},"demoted_tenants":{},"pool":{}}}"#
        ),
        json(live.store.backend_name()),
        live.store.is_degraded(),
        live.fair.in_flight(),
        live.fair.max_in_flight(),
        live.fair.queued(None),
        ms(live.fair.longest_wait(None, None)),
        ms(aloft.oldest),
        aloft.tokens,
        tiers.join(","),
        classes.join(","),
        tenants.join(","),
        // One index: the fair queue's, over the tenants that waited in its window (the
        // fleet's on Redis, as `claude_drr_fairness_index` publishes it).
        live.fair.fairness_index().map_or("null".to_owned(), num),
        gates.join(","),
        num(total),
        num(probes_of("cold_start")),
        num(probes_of("recovery")),
        gauge(metrics::DEMOTED_TENANTS),
        pool,
    )
}

/// A duration in whole milliseconds as JSON (`null` for none).
fn ms(duration: Option<std::time::Duration>) -> String {
    duration.map_or("null".to_owned(), |d| d.as_millis().to_string())
}

/// Per tier: its cap, its calls in flight and waiting (and for how long the oldest of
/// each), and its refusals by reason.
async fn tiers(live: &Live, metrics_text: &str, aloft: &Aloft) -> Vec<String> {
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
            concat!(
                r#"{{"tier":{},"cap":{},"in_flight":{},"waiting":{},"#,
                r#""longest_wait_ms":{},"oldest_in_flight_ms":{},"#,
                r#""busy":{{"slot":{},"rate":{},"cooldown":{},"store":{}}}}}"#
            ),
            json(tier.as_str()),
            limit.cap,
            in_flight,
            waiting,
            ms(live.fair.longest_wait(Some(&tier), None)),
            ms(aloft.oldest_by_tier.get(tier.as_str()).copied()),
            num(by_reason("slot")),
            num(by_reason("rate")),
            num(by_reason("cooldown")),
            num(by_reason("store")),
        ));
    }
    tiers
}

/// Per priority class: its calls queued, how long the oldest waiting and the oldest in
/// flight have been (calls not yet finished), and the median and 99th percentile of its
/// answered calls' latency over about the last minute.
fn classes(live: &Live, metrics_text: &str, aloft: &Aloft) -> Vec<String> {
    let recent = recent_latency(metrics_text);
    Priority::ALL
        .iter()
        .zip(recent)
        .map(|(&class, buckets)| {
            let ms = |q: f64| quantile(&buckets, q).map_or("null".to_owned(), |s| num(s * 1000.0));
            format!(
                concat!(
                    r#"{{"class":{},"queued":{},"longest_wait_ms":{},"#,
                    r#""oldest_in_flight_ms":{},"p50_ms":{},"p99_ms":{}}}"#
                ),
                json(class.as_str()),
                live.fair.queued(Some(class)),
                self::ms(live.fair.longest_wait(None, Some(class))),
                self::ms(aloft.oldest_by_class.get(class.as_str()).copied()),
                ms(0.5),
                ms(0.99),
            )
        })
        .collect()
}

/// Cumulative bucket counts of a histogram: `(le, count)` by increasing `le`.
type Buckets = Vec<(f64, f64)>;

/// Each class's latency buckets of answered calls, since start (in `Priority::ALL` order).
fn latency_buckets(metrics_text: &str) -> [Buckets; 3] {
    let name = format!("{}_bucket", metrics::REQUEST_LATENCY);
    let samples = samples(metrics_text, &name);
    Priority::ALL.map(|class| {
        let mut buckets: Buckets = samples
            .iter()
            .filter(|s| label(s, "priority") == class.as_str() && label(s, "outcome") == "answered")
            .filter_map(|s| Some((label(s, "le").parse::<f64>().ok()?, s.value)))
            .collect();
        buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        buckets
    })
}

/// How far back the page's latency reads: the histograms count since start, so the page
/// keeps their counts of about a minute ago and reads the difference.
const LATENCY_WINDOW: std::time::Duration = std::time::Duration::from_secs(60);

/// The buckets of the calls answered in about the last minute (since start, before the
/// page has a minute of history).
fn recent_latency(metrics_text: &str) -> [Buckets; 3] {
    use std::sync::Mutex;
    use std::time::Instant;
    // Snapshots at most every 5 s; the oldest kept is the newest one past the window.
    static HISTORY: Mutex<std::collections::VecDeque<(Instant, [Buckets; 3])>> =
        Mutex::new(std::collections::VecDeque::new());
    let now = latency_buckets(metrics_text);
    let mut history = HISTORY.lock().unwrap_or_else(|e| e.into_inner());
    let at = Instant::now();
    if history
        .back()
        .is_none_or(|(t, _)| at.saturating_duration_since(*t).as_secs() >= 5)
    {
        history.push_back((at, now.clone()));
    }
    while history
        .get(1)
        .is_some_and(|(t, _)| at.saturating_duration_since(*t) >= LATENCY_WINDOW)
    {
        history.pop_front();
    }
    let Some((_, base)) = history.front().filter(|(t, _)| *t < at) else {
        return now;
    };
    let mut recent = now;
    for (buckets, base) in recent.iter_mut().zip(base) {
        for (le, count) in buckets.iter_mut() {
            let before = base.iter().find(|(b, _)| b == le).map_or(0.0, |(_, c)| *c);
            *count = (*count - before).max(0.0);
        }
    }
    recent
}

/// The `q` quantile of cumulative `buckets`, interpolated inside its bucket as Prometheus'
/// `histogram_quantile` does; `None` with no calls.
fn quantile(buckets: &[(f64, f64)], q: f64) -> Option<f64> {
    let total = buckets.last()?.1;
    if total <= 0.0 {
        return None;
    }
    let rank = q * total;
    let (mut lower, mut below) = (0.0, 0.0);
    for &(le, count) in buckets {
        if count >= rank {
            if le.is_infinite() {
                return Some(lower);
            }
            let inside = count - below;
            let frac = if inside > 0.0 {
                (rank - below) / inside
            } else {
                1.0
            };
            return Some(lower + (le - lower) * frac);
        }
        (lower, below) = (le, count);
    }
    None
}

/// The tenants' served tokens, as the live page shows them.
struct Served {
    /// The ten tenants served most, as JSON.
    tenants: Vec<String>,
    /// Every tenant's tokens together.
    total: f64,
}

async fn served(live: &Live) -> Served {
    // The store's tenants served most in its window (the fleet's on Redis), whatever their
    // names: a service's end users are tenants the keys file never lists. Weighed by the
    // tier as the fair queue weighs it (pro and premium 3, others 1): a key's own tier,
    // for an end user its service key's (the tier a call claims is not kept per user).
    let top = live.store.top_served(SHOWN_TENANTS).await;
    let total = top.total as f64;
    let tenants = top
        .tenants
        .iter()
        .map(|(tenant, tokens)| {
            let name = tenant.as_str();
            let tiers = &live.config.tenant_tiers;
            let tier = tiers
                .get(name)
                .or_else(|| tiers.get(name.split_once('/')?.0))
                .map_or("", String::as_str);
            let weight = if matches!(tier, "pro" | "premium") {
                3.0
            } else {
                1.0
            };
            let tokens = *tokens as f64;
            let share = if total > 0.0 { tokens / total } else { 0.0 };
            format!(
                r#"{{"tenant":{},"tier":{},"weight":{},"tokens":{},"share":{}}}"#,
                json(name),
                json(tier),
                num(weight),
                num(tokens),
                num(share)
            )
        })
        .collect();
    Served { tenants, total }
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

    #[test]
    fn class_latency_is_read_from_the_answered_calls_buckets_as_histogram_quantile_does() {
        let text = "claude_request_latency_seconds_bucket{priority=\"critical\",outcome=\"answered\",le=\"0.5\"} 50\n\
                    claude_request_latency_seconds_bucket{priority=\"critical\",outcome=\"answered\",le=\"1\"} 90\n\
                    claude_request_latency_seconds_bucket{priority=\"critical\",outcome=\"answered\",le=\"2\"} 100\n\
                    claude_request_latency_seconds_bucket{priority=\"critical\",outcome=\"answered\",le=\"+Inf\"} 100\n\
                    claude_request_latency_seconds_bucket{priority=\"critical\",outcome=\"refused\",le=\"+Inf\"} 7\n";
        let [critical, standard, _] = latency_buckets(text);
        assert_eq!(critical.len(), 4, "the refused calls are not read");
        assert_eq!(quantile(&critical, 0.5), Some(0.5));
        // The 99th of 100 lies 9/10 into the (1, 2] bucket.
        assert!((quantile(&critical, 0.99).unwrap() - 1.9).abs() < 1e-9);
        assert_eq!(quantile(&standard, 0.5), None, "no calls, no number");
    }
}
