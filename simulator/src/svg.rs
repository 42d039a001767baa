//! The simulator's picture, as hand-written SVG: the scenario's claim where the tiers do
//! not show it (the latency per tenant when one tenant's dump must not hold another up;
//! the share of attempts answered 429 over time in a storm), the latency distribution per
//! tier (CDF lines, naive dashed, fairgate solid) and the calls in flight per tier over
//! time under each policy. Each claim's line carries an `id` naming its series.

use std::fmt::Write;

use crate::engine::{
    Run, TIERS, in_flight_series, latencies_by_tenant, latencies_by_tier, throttle_share_series,
};
use crate::scenarios::{Outcome, Size};

/// What a picture shows beyond the tiers: its scenario's claim.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Claim {
    /// Nothing more (the tiers tell it).
    None,
    /// Each tenant's latency, naive and fairgate: one tenant's dump must not hold another.
    TenantLatency,
    /// The share of attempts answered 429 per second, naive and fairgate.
    ThrottleShare,
}

impl Claim {
    /// The claim scenario `id` makes (see `engine::SCENARIOS`).
    pub fn of_scenario(id: usize) -> Claim {
        match id {
            1 => Claim::TenantLatency,
            3 => Claim::ThrottleShare,
            _ => Claim::None,
        }
    }
}

const COLORS: [&str; 4] = ["#7b3294", "#2c7bb6", "#fdae61", "#d7191c"];
const W: f64 = 900.0;
const PANEL_H: f64 = 240.0;
const LEFT: f64 = 60.0;
const PLOT_W: f64 = W - LEFT - 150.0;

/// A panel's frame: title, axes and ticks, its top at `top`.
fn frame(
    out: &mut String,
    top: f64,
    title: &str,
    x_label: &str,
    x_max: f64,
    y_label: &str,
    y_max: f64,
) {
    let bottom = top + PANEL_H - 40.0;
    let _ = writeln!(
        out,
        r#"<text x="{LEFT}" y="{}" font-weight="bold">{title}</text>"#,
        top - 8.0
    );
    let _ = writeln!(
        out,
        r##"<rect x="{LEFT}" y="{top}" width="{PLOT_W}" height="{}" fill="none" stroke="#888"/>"##,
        bottom - top
    );
    for i in 0..=5 {
        let f = f64::from(i) / 5.0;
        let x = LEFT + f * PLOT_W;
        let y = bottom - f * (bottom - top);
        // Shares with two decimals, counts whole.
        let digits = if y_max > 2.0 { 0 } else { 2 };
        // Seconds whole, tenths on a short axis (a replay's sub-second latencies).
        let x_digits = if x_max < 5.0 { 1 } else { 0 };
        let _ = writeln!(
            out,
            r##"<text x="{x:.1}" y="{:.1}" text-anchor="middle" font-size="10">{:.x_digits$}</text><text x="{:.1}" y="{:.1}" text-anchor="end" font-size="10">{:.digits$}</text><line x1="{LEFT}" x2="{:.1}" y1="{y:.1}" y2="{y:.1}" stroke="#eee"/>"##,
            bottom + 14.0,
            f * x_max,
            LEFT - 4.0,
            y + 3.0,
            f * y_max,
            LEFT + PLOT_W
        );
    }
    let _ = writeln!(
        out,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle" font-size="11">{x_label}</text><text x="12" y="{:.1}" font-size="11" transform="rotate(-90 12 {:.1})" text-anchor="middle">{y_label}</text>"#,
        LEFT + PLOT_W / 2.0,
        bottom + 30.0,
        (top + bottom) / 2.0,
        (top + bottom) / 2.0
    );
}

fn polyline(out: &mut String, points: &[(f64, f64)], color: &str, dashed: bool) {
    polyline_named(out, points, color, dashed, None);
}

/// A polyline, with `id` naming its series when given.
fn polyline_named(
    out: &mut String,
    points: &[(f64, f64)],
    color: &str,
    dashed: bool,
    id: Option<&str>,
) {
    let pts: Vec<String> = points
        .iter()
        .map(|(x, y)| format!("{x:.1},{y:.1}"))
        .collect();
    let dash = if dashed {
        r#" stroke-dasharray="6 4""#
    } else {
        ""
    };
    let id = id.map_or(String::new(), |id| format!(r#" id="{}""#, escape(id)));
    let _ = writeln!(
        out,
        r#"<polyline{id} fill="none" stroke="{color}" stroke-width="1.6"{dash} points="{}"/>"#,
        pts.join(" ")
    );
}

fn legend(out: &mut String, top: f64, extra: &[(&str, bool)]) {
    let x = LEFT + PLOT_W + 15.0;
    for (i, tier) in TIERS.iter().enumerate() {
        let y = top + 14.0 + 16.0 * i as f64;
        let _ = writeln!(
            out,
            r#"<line x1="{x}" x2="{}" y1="{y}" y2="{y}" stroke="{}" stroke-width="3"/><text x="{}" y="{}" font-size="11">{tier}</text>"#,
            x + 20.0,
            COLORS[i],
            x + 26.0,
            y + 4.0
        );
    }
    for (i, (label, dashed)) in extra.iter().enumerate() {
        let y = top + 90.0 + 16.0 * i as f64;
        let dash = if *dashed {
            r#" stroke-dasharray="6 4""#
        } else {
            ""
        };
        let _ = writeln!(
            out,
            r#"<line x1="{x}" x2="{}" y1="{y}" y2="{y}" stroke="black"{dash}/><text x="{}" y="{}" font-size="11">{label}</text>"#,
            x + 20.0,
            x + 26.0,
            y + 4.0
        );
    }
}

/// The slowest latency in either map, in whole seconds (at least 1): a CDF panel's x axis.
fn slowest<K>(maps: [&std::collections::BTreeMap<K, Vec<f64>>; 2]) -> f64 {
    maps.iter()
        .flat_map(|map| map.values())
        .flatten()
        .fold(1.0_f64, |m, v| m.max(*v))
        .ceil()
}

/// Latency CDFs per tier, both policies.
fn cdfs(out: &mut String, top: f64, o: &Outcome, labels: [&str; 2]) {
    let naive = latencies_by_tier(&o.naive_run, &o.workload);
    let fair = latencies_by_tier(&o.fairgate_run, &o.workload);
    let x_max = slowest([&naive, &fair]);
    frame(
        out,
        top,
        "Latency of served calls per tier (CDF)",
        "seconds from arrival to answer",
        x_max,
        "share of calls",
        1.0,
    );
    for (by_tier, dashed) in [(&naive, true), (&fair, false)] {
        for (i, tier) in TIERS.iter().enumerate() {
            let Some(values) = by_tier.get(tier) else {
                continue;
            };
            polyline(out, &cdf_points(values, top, x_max), COLORS[i], dashed);
        }
    }
    legend(out, top, &[(labels[0], true), (labels[1], false)]);
}

/// The points of a CDF of `values` in a panel at `top` whose x axis ends at `x_max`.
fn cdf_points(values: &[f64], top: f64, x_max: f64) -> Vec<(f64, f64)> {
    let bottom = top + PANEL_H - 40.0;
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len() as f64;
    let step = (v.len() / 200).max(1);
    let mut points: Vec<(f64, f64)> = v
        .iter()
        .enumerate()
        .step_by(step)
        .map(|(k, x)| {
            (
                LEFT + x / x_max * PLOT_W,
                bottom - (k as f64 + 1.0) / n * (bottom - top),
            )
        })
        .collect();
    if let Some(x) = v.last() {
        points.push((LEFT + x / x_max * PLOT_W, top));
    }
    points
}

/// A legend of named lines (a color each) and the two policies' dash styles.
fn named_legend(out: &mut String, top: f64, names: &[(&str, &str)], labels: [&str; 2]) {
    let x = LEFT + PLOT_W + 15.0;
    for (i, (name, color)) in names.iter().enumerate() {
        let y = top + 14.0 + 16.0 * i as f64;
        let _ = writeln!(
            out,
            r#"<line x1="{x}" x2="{}" y1="{y}" y2="{y}" stroke="{color}" stroke-width="3"/><text x="{}" y="{}" font-size="11">{}</text>"#,
            x + 20.0,
            x + 26.0,
            y + 4.0,
            escape(name)
        );
    }
    for (i, (label, dash)) in [(labels[0], r#" stroke-dasharray="6 4""#), (labels[1], "")]
        .iter()
        .enumerate()
    {
        let y = top + 90.0 + 16.0 * i as f64;
        let _ = writeln!(
            out,
            r#"<line x1="{x}" x2="{}" y1="{y}" y2="{y}" stroke="black"{dash}/><text x="{}" y="{}" font-size="11">{}</text>"#,
            x + 20.0,
            x + 26.0,
            y + 4.0,
            escape(label)
        );
    }
}

/// Latency CDFs per tenant, both policies: lines `tenant-<name>-naive` and
/// `tenant-<name>-fairgate`.
fn tenant_cdfs(out: &mut String, top: f64, o: &Outcome, labels: [&str; 2]) {
    let naive = latencies_by_tenant(&o.naive_run, &o.workload);
    let fair = latencies_by_tenant(&o.fairgate_run, &o.workload);
    let x_max = slowest([&naive, &fair]);
    frame(
        out,
        top,
        "Latency of served calls per tenant (CDF): the claim",
        "seconds from arrival to answer",
        x_max,
        "share of calls",
        1.0,
    );
    let tenants: Vec<&String> = naive.keys().chain(fair.keys()).collect();
    let mut names: Vec<&str> = tenants.iter().map(|t| t.as_str()).collect();
    names.sort_unstable();
    names.dedup();
    let colors: Vec<(&str, &str)> = names
        .iter()
        .enumerate()
        .map(|(i, name)| (*name, COLORS[(i * 3) % COLORS.len()]))
        .collect();
    for (by_tenant, policy, dashed) in [(&naive, "naive", true), (&fair, "fairgate", false)] {
        for (name, color) in &colors {
            if let Some(values) = by_tenant.get(*name) {
                let id = format!("tenant-{name}-{policy}");
                let points = cdf_points(values, top, x_max);
                polyline_named(out, &points, color, dashed, Some(&id));
            }
        }
    }
    named_legend(out, top, &colors, labels);
}

/// The share of attempts answered 429 per second, both policies: lines
/// `throttle-share-naive` and `throttle-share-fairgate`.
fn throttle_shares(out: &mut String, top: f64, o: &Outcome, labels: [&str; 2], until: f64) {
    let bottom = top + PANEL_H - 40.0;
    frame(
        out,
        top,
        "Share of attempts answered 429, per second: the claim",
        "seconds",
        until,
        "share answered 429",
        1.0,
    );
    for (run, policy, dashed) in [
        (&o.naive_run, "naive", true),
        (&o.fairgate_run, "fairgate", false),
    ] {
        let points: Vec<(f64, f64)> = throttle_share_series(run, 1.0)
            .into_iter()
            .filter(|(t, _)| *t <= until)
            .map(|(t, share)| (LEFT + t / until * PLOT_W, bottom - share * (bottom - top)))
            .collect();
        let id = format!("throttle-share-{policy}");
        polyline_named(out, &points, COLORS[3], dashed, Some(&id));
    }
    named_legend(out, top, &[("429 share", COLORS[3])], labels);
}

/// Calls in flight per tier over time, one policy.
fn in_flight(out: &mut String, top: f64, run: &Run, title: &str, until: f64, y_max: f64) {
    let bottom = top + PANEL_H - 40.0;
    frame(out, top, title, "seconds", until, "calls in flight", y_max);
    let series = in_flight_series(run, (until / 300.0).max(0.1), until);
    for (i, color) in COLORS.iter().enumerate() {
        let points: Vec<(f64, f64)> = series
            .iter()
            .map(|(t, n)| {
                (
                    LEFT + t / until * PLOT_W,
                    bottom - f64::from(n[i]) / y_max * (bottom - top),
                )
            })
            .collect();
        polyline(out, &points, color, false);
    }
    legend(out, top, &[]);
}

/// The whole picture for one scenario's runs.
pub fn render(o: &Outcome, size: Size) -> String {
    let heading = format!(
        "fairgate simulator: scenario {}, {}, {} size",
        o.id,
        crate::scenarios::SCENARIOS[o.id - 1],
        if size == Size::Full { "full" } else { "small" }
    );
    render_with(
        o,
        &heading,
        [
            ("naive", "In flight per tier, naive (FIFO semaphore)"),
            ("fairgate", "In flight per tier, fairgate"),
        ],
        Claim::of_scenario(o.id),
    )
}

/// The same picture under `heading`, the two runs named by `runs` (a legend label and an
/// in-flight panel's title each; the first is drawn dashed), with `claim`'s panel first.
pub fn render_with(o: &Outcome, heading: &str, runs: [(&str, &str); 2], claim: Claim) -> String {
    let until = o.naive_run.simulated.max(o.fairgate_run.simulated).min(
        o.workload
            .last()
            .map_or(60.0, |c| c.at.as_secs_f64() + 60.0),
    );
    // Five ticks of whole seconds.
    let until = (until / 5.0).ceil().max(1.0) * 5.0;
    let y_max = [&o.naive_run, &o.fairgate_run]
        .iter()
        .flat_map(|r| r.timeline.iter().map(|(_, n)| n.iter().sum::<u32>()))
        .max()
        .unwrap_or(1)
        .max(1) as f64;
    // Five ticks of whole calls.
    let y_max = if y_max > 2.0 {
        (y_max / 5.0).ceil() * 5.0
    } else {
        y_max
    };
    let claimed = claim != Claim::None;
    let panels = if claimed { 4.0 } else { 3.0 };
    let height = 60.0 + panels * (PANEL_H + 30.0);
    let mut out = String::new();
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{height}" viewBox="0 0 {W} {height}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(out, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        out,
        r#"<text x="{LEFT}" y="24" font-size="15" font-weight="bold">{}</text>"#,
        escape(heading)
    );
    let labels = [runs[0].0, runs[1].0];
    let top = |panel: f64| 60.0 + panel * (PANEL_H + 30.0);
    match claim {
        Claim::TenantLatency => tenant_cdfs(&mut out, top(0.0), o, labels),
        Claim::ThrottleShare => throttle_shares(&mut out, top(0.0), o, labels, until),
        Claim::None => {}
    }
    let first = if claimed { 1.0 } else { 0.0 };
    cdfs(&mut out, top(first), o, labels);
    in_flight(
        &mut out,
        top(first + 1.0),
        &o.naive_run,
        &escape(runs[0].1),
        until,
        y_max,
    );
    in_flight(
        &mut out,
        top(first + 2.0),
        &o.fairgate_run,
        &escape(runs[1].1),
        until,
        y_max,
    );
    out.push_str("</svg>\n");
    out
}

/// `text` safe inside an SVG element.
fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}
