//! The Grafana dashboard (`dashboards/fairgate.json`) queries only metrics fairgate
//! publishes under the default prefix — the names are taken from the public constants in
//! `fairgate::metrics`, so renaming a metric without the dashboard fails here — and shows
//! the reference's six and its SLO lines.

use std::collections::BTreeSet;

use fairgate::metrics;
use serde_json::Value;

const DASHBOARD: &str = include_str!("../../dashboards/fairgate.json");

/// The metric names fairgate publishes under the default prefix, with the series a
/// Prometheus exporter derives from a histogram (`_bucket`, `_sum`, `_count`).
fn published() -> BTreeSet<String> {
    let plain = [
        metrics::QUEUE_DEPTH,
        metrics::THROTTLE_COUNT,
        metrics::DEMOTED_TENANTS,
        metrics::FAIRNESS_INDEX,
        metrics::INPUT_TOKENS,
        metrics::STORE_DEGRADED,
        metrics::SLOTS_IN_USE,
        metrics::SERVER_BUSY,
        metrics::SLOTS_FALLBACK,
        metrics::RETRIES,
        metrics::GAVE_UP,
        metrics::COOLDOWN_WAITS,
        metrics::LEARNED_LIMIT,
        metrics::PROBES,
    ];
    let histograms = [
        metrics::REQUEST_LATENCY,
        metrics::SLOT_WAIT,
        metrics::COOLDOWN_WAIT_SECONDS,
        metrics::PACING_WAIT_SECONDS,
    ];
    let mut names: BTreeSet<String> = plain.iter().map(|n| n.to_string()).collect();
    for h in histograms {
        names.insert(h.to_owned());
        for suffix in ["_bucket", "_sum", "_count"] {
            names.insert(format!("{h}{suffix}"));
        }
    }
    names
}

/// Every panel, rows' nested panels included.
fn panels(dashboard: &Value) -> Vec<&Value> {
    let mut out = Vec::new();
    let mut stack: Vec<&Value> = dashboard["panels"]
        .as_array()
        .into_iter()
        .flatten()
        .collect();
    while let Some(panel) = stack.pop() {
        if let Some(nested) = panel["panels"].as_array() {
            stack.extend(nested);
        }
        out.push(panel);
    }
    out
}

/// Every PromQL expression of every panel's targets: (panel title, expression).
fn expressions(dashboard: &Value) -> Vec<(String, String)> {
    panels(dashboard)
        .into_iter()
        .flat_map(|p| {
            let title = p["title"].as_str().unwrap_or("?").to_owned();
            p["targets"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|t| t["expr"].as_str())
                .map(move |e| (title.clone(), e.to_owned()))
        })
        .collect()
}

/// PromQL words that are not metric names: keywords, and the aggregation operators (which
/// may be followed by `by (...)` rather than by their parenthesis).
const KEYWORDS: [&str; 28] = [
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "inf",
    "nan",
    "atan2",
    "start",
    "end",
    "sum",
    "min",
    "max",
    "avg",
    "group",
    "stddev",
    "stdvar",
    "count",
    "count_values",
    "bottomk",
    "topk",
    "quantile",
];

/// The metric names an expression selects: identifiers that are not functions (followed by
/// `(`), keywords, label names or values (inside `{}`), durations (inside `[]`), the label
/// lists of `by (...)` / `without (...)` / `on (...)` / `ignoring (...)`, numbers, strings or
/// Grafana variables.
fn metric_names(expr: &str) -> Vec<String> {
    let chars: Vec<char> = expr.chars().collect();
    let mut names = Vec::new();
    let mut i = 0;
    let mut skip_label_list = false;
    while i < chars.len() {
        let c = chars[i];
        match c {
            '"' | '\'' | '`' => {
                i += 1;
                while i < chars.len() && chars[i] != c {
                    i += if chars[i] == '\\' { 2 } else { 1 };
                }
                i += 1;
            }
            '{' | '[' => {
                let close = if c == '{' { '}' } else { ']' };
                while i < chars.len() && chars[i] != close {
                    if chars[i] == '"' {
                        i += 1;
                        while i < chars.len() && chars[i] != '"' {
                            i += if chars[i] == '\\' { 2 } else { 1 };
                        }
                    }
                    i += 1;
                }
                i += 1;
            }
            '(' if skip_label_list => {
                while i < chars.len() && chars[i] != ')' {
                    i += 1;
                }
                i += 1;
                skip_label_list = false;
            }
            '$' => {
                i += 1;
                while i < chars.len() && (chars[i].is_alphanumeric() || chars[i] == '_') {
                    i += 1;
                }
            }
            c if c.is_ascii_digit() || c == '.' => {
                // A number (or a duration such as 5m, or 1e3): no metric starts with a digit.
                while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '.') {
                    i += 1;
                }
            }
            c if c.is_ascii_alphabetic() || c == '_' || c == ':' => {
                let start = i;
                while i < chars.len()
                    && (chars[i].is_ascii_alphanumeric() || chars[i] == '_' || chars[i] == ':')
                {
                    i += 1;
                }
                let word: String = chars[start..i].iter().collect();
                let mut j = i;
                while j < chars.len() && chars[j].is_whitespace() {
                    j += 1;
                }
                let lower = word.to_ascii_lowercase();
                if [
                    "by",
                    "without",
                    "on",
                    "ignoring",
                    "group_left",
                    "group_right",
                ]
                .contains(&lower.as_str())
                {
                    skip_label_list = true;
                } else if chars.get(j) == Some(&'(') || KEYWORDS.contains(&lower.as_str()) {
                    // A function or an aggregation, or a keyword.
                } else {
                    names.push(word);
                }
            }
            _ => i += 1,
        }
    }
    names
}

/// The queried names fairgate does not publish, with their panels.
fn unknown_metrics(dashboard: &Value) -> Vec<(String, String)> {
    let published = published();
    let mut unknown = Vec::new();
    for (title, expr) in expressions(dashboard) {
        for name in metric_names(&expr) {
            if !published.contains(&name) {
                unknown.push((title.clone(), name));
            }
        }
    }
    unknown
}

fn dashboard() -> Value {
    serde_json::from_str(DASHBOARD).expect("dashboards/fairgate.json is valid JSON")
}

#[test]
fn every_metric_the_dashboard_queries_is_published_under_the_default_prefix() {
    let dashboard = dashboard();
    let exprs = expressions(&dashboard);
    assert!(exprs.len() > 20, "the dashboard has queries: {exprs:?}");
    let unknown = unknown_metrics(&dashboard);
    assert!(unknown.is_empty(), "queried but not published: {unknown:?}");
}

#[test]
fn a_panel_querying_a_metric_that_does_not_exist_is_caught() {
    let mut dashboard = dashboard();
    let bogus = serde_json::json!({
        "type": "timeseries",
        "title": "bogus",
        "targets": [{ "refId": "A", "expr": "sum by (tier) (rate(claude_slots_taken_total{tier=\"pro\"}[5m]))" }]
    });
    // Nested in a row, as a collapsed row keeps its panels.
    dashboard["panels"][0]["panels"]
        .as_array_mut()
        .expect("the first panel is a row")
        .push(bogus);
    assert_eq!(
        unknown_metrics(&dashboard),
        [("bogus".to_owned(), "claude_slots_taken_total".to_owned())]
    );
}

#[test]
fn metric_names_are_told_from_functions_labels_and_durations() {
    assert_eq!(
        metric_names(
            r#"histogram_quantile(0.99, sum by (le, priority) (rate(claude_request_latency_seconds_bucket{priority="critical"}[$__rate_interval])))"#
        ),
        ["claude_request_latency_seconds_bucket"]
    );
    assert_eq!(
        metric_names(
            "topk(10, claude_throttle_count) / on (tenant_id) group_left claude_input_tokens_total offset 5m"
        ),
        ["claude_throttle_count", "claude_input_tokens_total"]
    );
    assert_eq!(metric_names(r#"max(up{job="x"}) * 60 + 1e3"#), ["up"]);
}

#[test]
fn the_reference_six_and_the_slot_rate_busy_and_store_metrics_are_all_shown() {
    let dashboard = dashboard();
    let queried: BTreeSet<String> = expressions(&dashboard)
        .iter()
        .flat_map(|(_, e)| metric_names(e))
        .map(|n| {
            ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| n.strip_suffix(s))
                .filter(|base| published().contains(*base))
                .map_or(n.clone(), str::to_owned)
        })
        .collect();
    for name in [
        // The reference's six.
        metrics::QUEUE_DEPTH,
        metrics::REQUEST_LATENCY,
        metrics::THROTTLE_COUNT,
        metrics::DEMOTED_TENANTS,
        metrics::FAIRNESS_INDEX,
        metrics::INPUT_TOKENS,
        // Slots, rate, busy, retries, the store.
        metrics::SLOTS_IN_USE,
        metrics::SLOT_WAIT,
        metrics::LEARNED_LIMIT,
        metrics::PACING_WAIT_SECONDS,
        metrics::COOLDOWN_WAITS,
        metrics::PROBES,
        metrics::SERVER_BUSY,
        metrics::RETRIES,
        metrics::STORE_DEGRADED,
    ] {
        assert!(queried.contains(name), "no panel shows {name}");
    }
}

#[test]
fn the_latency_panels_carry_the_reference_slo_lines() {
    let dashboard = dashboard();
    for (priority, slo) in [("critical", 2.0), ("standard", 6.0), ("batch", 120.0)] {
        let panel = panels(&dashboard)
            .into_iter()
            .find(|p| {
                p["targets"].as_array().is_some_and(|ts| {
                    ts.iter().any(|t| {
                        t["expr"].as_str().is_some_and(|e| {
                            e.contains(metrics::REQUEST_LATENCY)
                                && e.contains(&format!("priority=\"{priority}\""))
                        })
                    })
                })
            })
            .unwrap_or_else(|| panic!("no latency panel for {priority}"));
        let defaults = &panel["fieldConfig"]["defaults"];
        let steps = defaults["thresholds"]["steps"]
            .as_array()
            .expect("thresholds");
        assert!(
            steps.iter().any(|s| s["value"].as_f64() == Some(slo)),
            "{priority}: no threshold at {slo} s: {steps:?}"
        );
        assert_eq!(defaults["unit"], "s");
        let style = defaults["custom"]["thresholdsStyle"]["mode"]
            .as_str()
            .unwrap_or("off");
        assert!(
            style.contains("line"),
            "{priority}: thresholds not drawn as a line"
        );
    }
}

#[test]
fn every_panel_reads_the_prometheus_datasource_variable() {
    let dashboard = dashboard();
    let variable = dashboard["templating"]["list"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|v| v["name"] == "DS_PROMETHEUS")
        .expect("a DS_PROMETHEUS variable");
    assert_eq!(variable["type"], "datasource");
    assert_eq!(variable["query"], "prometheus");
    for panel in panels(&dashboard) {
        if panel["type"] == "row" {
            continue;
        }
        assert_eq!(
            panel["datasource"]["uid"], "${DS_PROMETHEUS}",
            "{}",
            panel["title"]
        );
    }
}
