//! `--replay FILE [--policy policy.toml]`: a recording of real traffic (the gateway's
//! `--record`, or any system writing the same JSON lines) replayed through the real layers
//! in paused time, under a policy of your choosing.
//!
//! Each recorded call arrives at its recorded time with its tenant, tier, origin, SLA and
//! estimated input tokens; the mock upstream answers it in its recorded upstream latency
//! (with its recorded status when the upstream refused it: a 429 or a 5xx). A call the
//! recording's stack refused never reached the upstream, so its latency is unknown: it
//! gets the median upstream latency of its tier's served calls. The mock's own rate limits
//! never bind: what is replayed is admission (caps, waits, the fair queue), not the
//! provider's limits.
//!
//! `policy.toml` has the keys file's shape (`[limits]` `global_max`, `window`,
//! `retry_after_ms`, `lease_ttl_ms`; `[[tiers]]` `name`, `cap`, `max_wait_ms`; the keys
//! file itself works, its `[[keys]]` are ignored) and an optional `[drr]`: `quantum` and
//! `tier_weights = { premium = 4, ... }`.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;

use fairgate::{Origin, SlotPolicy};
use serde::Deserialize;

use crate::engine::{Answer, Call, Drr, Policy, Run, TIERS, Upstream, percentile, run};
use crate::scenarios::Outcome;

/// One line of a recording (the format is in `docs/simulator.md`).
#[derive(Clone, Debug, Deserialize)]
pub struct Recorded {
    pub at_ms: u64,
    pub tenant: String,
    pub tier: Option<String>,
    pub origin: String,
    pub sla_ms: Option<u64>,
    pub est_input_tokens: u32,
    pub input_tokens: Option<u32>,
    pub output_tokens: Option<u32>,
    pub upstream_ms: Option<u64>,
    pub latency_ms: u64,
    pub status: u16,
}

impl Recorded {
    /// How the call ended, as its client saw it.
    fn answer(&self) -> Answer {
        let tier = self.tier.clone().unwrap_or_default();
        match (self.status, self.upstream_ms) {
            (200, _) => Answer::Served,
            // The client left before its answer began.
            (499, _) => Answer::Refused(499),
            // Refused by the stack before any dispatch: busy.
            (_, None) => Answer::Busy(tier, fairgate::WaitReason::Slot),
            (status, Some(_)) => Answer::Refused(status),
        }
    }
}

/// Reads a recording, sorted by arrival; blank lines are skipped.
pub fn read(text: &str) -> Result<Vec<Recorded>, String> {
    let mut records = Vec::new();
    for (n, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let record: Recorded =
            serde_json::from_str(line).map_err(|e| format!("line {}: {e}", n + 1))?;
        records.push(record);
    }
    records.sort_by_key(|r| r.at_ms);
    Ok(records)
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct PolicyFile {
    /// A keys file's keys: accepted (a keys file serves as a policy), ignored.
    #[serde(default)]
    #[allow(dead_code)]
    keys: Option<toml::Value>,
    #[serde(default)]
    limits: Limits,
    #[serde(default)]
    tiers: Vec<TierEntry>,
    #[serde(default)]
    drr: DrrEntry,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Limits {
    global_max: Option<u32>,
    window: Option<usize>,
    retry_after_ms: Option<u64>,
    lease_ttl_ms: Option<u64>,
    /// The budget and its demotion: accepted (a keys file serves as a policy), not
    /// replayed.
    #[allow(dead_code)]
    daily_token_budget: Option<u64>,
    #[allow(dead_code)]
    demotion_ms: Option<u64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TierEntry {
    name: String,
    cap: u32,
    max_wait_ms: u64,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct DrrEntry {
    quantum: Option<u64>,
    #[serde(default)]
    tier_weights: BTreeMap<String, u32>,
}

/// A policy from `policy.toml` (empty text: the crate's defaults), and a one-line summary.
pub fn policy(text: &str) -> Result<(Policy, String), String> {
    let file: PolicyFile = toml::from_str(text).map_err(|e| e.to_string())?;
    let mut slots = SlotPolicy::builder();
    if let Some(global) = file.limits.global_max {
        slots = slots.global_max(global);
    }
    if let Some(ms) = file.limits.retry_after_ms {
        slots = slots.retry_after(Duration::from_millis(ms));
    }
    if let Some(ms) = file.limits.lease_ttl_ms {
        slots = slots.lease_ttl(Duration::from_millis(ms));
    }
    let mut summary = Vec::new();
    for tier in &file.tiers {
        slots = slots.tier(
            tier.name.as_str(),
            tier.cap,
            Duration::from_millis(tier.max_wait_ms),
        );
        summary.push(format!(
            "{} cap {} wait {} ms",
            tier.name, tier.cap, tier.max_wait_ms
        ));
    }
    let slots = slots.build().map_err(|e| e.to_string())?;
    let window = file
        .limits
        .window
        .unwrap_or(slots.global_max() as usize)
        .max(1);
    let drr = Drr {
        quantum: file.drr.quantum,
        tier_weights: file.drr.tier_weights.into_iter().collect(),
    };
    let mut line = format!("global {}, window {window}", slots.global_max());
    if !summary.is_empty() {
        line += &format!("; {}", summary.join(", "));
    }
    if let Some(q) = drr.quantum {
        line += &format!("; quantum {q}");
    }
    if !drr.tier_weights.is_empty() {
        let weights: Vec<String> = drr
            .tier_weights
            .iter()
            .map(|(t, w)| format!("{t} {w}"))
            .collect();
        line += &format!("; weights {}", weights.join(", "));
    }
    Ok((Policy::Fairgate { window, slots, drr }, line))
}

/// A tier's name for the whole run (the engine's calls name tiers by `&'static str`): each
/// distinct name is leaked once.
fn intern(name: &str) -> &'static str {
    static NAMES: Mutex<Vec<&'static str>> = Mutex::new(Vec::new());
    if let Some(known) = TIERS.iter().find(|t| **t == name) {
        return known;
    }
    let mut names = NAMES.lock().unwrap();
    if let Some(known) = names.iter().find(|t| **t == name) {
        return known;
    }
    let leaked: &'static str = Box::leak(name.to_owned().into_boxed_str());
    names.push(leaked);
    leaked
}

fn origin(name: &str) -> Origin {
    match name {
        "scheduled" => Origin::Scheduled,
        "batch" => Origin::BatchJob,
        _ => Origin::UserAction,
    }
}

/// The recorded calls as the engine's calls.
pub fn calls(records: &[Recorded]) -> Vec<Call> {
    // A call never dispatched gets the median upstream latency of its tier's served calls.
    let mut served: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    for r in records {
        if let (200, Some(ms)) = (r.status, r.upstream_ms) {
            let tier = r.tier.as_deref().unwrap_or("");
            served.entry(tier).or_default().push(ms as f64);
        }
    }
    let everyone: Vec<f64> = served.values().flatten().copied().collect();
    let median = |tier: &str| {
        let values = served.get(tier).unwrap_or(&everyone);
        percentile(values, 0.5).unwrap_or(500.0) as u64
    };
    records
        .iter()
        .map(|r| {
            let tier = r.tier.as_deref().unwrap_or("");
            Call {
                at: Duration::from_millis(r.at_ms),
                tenant: r.tenant.clone(),
                tier: intern(tier),
                origin: origin(&r.origin),
                sla: r.sla_ms.map(Duration::from_millis),
                input: r.est_input_tokens.max(1),
                output: r.output_tokens.unwrap_or(1).max(1),
                latency: Some(Duration::from_millis(
                    r.upstream_ms.unwrap_or_else(|| median(tier)),
                )),
                status: r
                    .upstream_ms
                    .and_then(|_| (r.status == 429 || r.status >= 500).then_some(r.status)),
            }
        })
        .collect()
}

/// The recording as a run, for the table and the pictures: its answers and latencies, and
/// the calls at the upstream per tier over time (from each dispatch to its answer's end).
pub fn recorded_run(records: &[Recorded], calls: &[Call]) -> Run {
    let mut events: Vec<(f64, usize, i32)> = Vec::new();
    let mut done = Vec::new();
    for (i, r) in records.iter().enumerate() {
        let end = (r.at_ms + r.latency_ms) as f64 / 1000.0;
        done.push(crate::engine::Done {
            call: i,
            latency: r.latency_ms as f64 / 1000.0,
            at: end,
            answer: r.answer(),
        });
        if let (200, Some(up)) = (r.status, r.upstream_ms) {
            let tier = TIERS.iter().position(|t| *t == calls[i].tier).unwrap_or(3);
            events.push((end - up as f64 / 1000.0, tier, 1));
            events.push((end, tier, -1));
        }
    }
    events.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.2.cmp(&b.2)));
    let mut now = [0u32; 4];
    let mut timeline = Vec::new();
    for (t, tier, delta) in events {
        now[tier] = now[tier].saturating_add_signed(delta);
        timeline.push((t, now));
    }
    let simulated = done.iter().fold(0.0_f64, |m, d| m.max(d.at));
    Run {
        done,
        timeline,
        simulated,
        ..Run::default()
    }
}

/// A replay: the recorded calls, the recording as a run, and the replayed run.
#[derive(Debug)]
pub struct Replay {
    pub calls: Vec<Call>,
    pub recorded: Run,
    pub replayed: Run,
}

/// Replays `records` under `policy`, in paused time.
pub async fn replay(records: &[Recorded], policy: &Policy, seed: u64) -> Replay {
    let calls = calls(records);
    let recorded = recorded_run(records, &calls);
    let longest = calls
        .iter()
        .filter_map(|c| c.latency)
        .max()
        .unwrap_or_default();
    let horizon =
        calls.last().map_or(Duration::ZERO, |c| c.at) + longest + Duration::from_secs(300);
    let replayed = run(policy, &Upstream::roomy(), &calls, horizon, seed).await;
    Replay {
        calls,
        recorded,
        replayed,
    }
}

/// Per tier: calls, served, busy, refused, and the served calls' latencies.
#[derive(Debug, Default)]
struct Counts {
    calls: usize,
    served: usize,
    busy: usize,
    refused: usize,
    latencies: Vec<f64>,
}

fn counts(run: &Run, calls: &[Call]) -> BTreeMap<&'static str, Counts> {
    let mut out: BTreeMap<&'static str, Counts> = BTreeMap::new();
    for call in calls {
        out.entry(call.tier).or_default().calls += 1;
    }
    for d in &run.done {
        let c = out.entry(calls[d.call].tier).or_default();
        match &d.answer {
            Answer::Served => {
                c.served += 1;
                c.latencies.push(d.latency);
            }
            Answer::Busy(..) => c.busy += 1,
            Answer::Refused(_) | Answer::Failed(_) => c.refused += 1,
        }
    }
    out
}

/// Served and busy calls per tier, recorded and replayed: `(tier, recorded, replayed)`.
pub fn served_and_busy(replay: &Replay) -> Vec<(&'static str, [usize; 2], [usize; 2])> {
    let recorded = counts(&replay.recorded, &replay.calls);
    let replayed = counts(&replay.replayed, &replay.calls);
    recorded
        .iter()
        .map(|(tier, r)| {
            let p = &replayed[tier];
            (*tier, [r.served, r.busy], [p.served, p.busy])
        })
        .collect()
}

fn ms(value: Option<f64>) -> String {
    value.map_or("-".to_owned(), |s| format!("{:.0} ms", s * 1000.0))
}

/// The table: per tier, the calls served / busy / refused and the served calls' p50 / p99
/// latency, recorded beside replayed.
pub fn table(replay: &Replay) -> String {
    let recorded = counts(&replay.recorded, &replay.calls);
    let replayed = counts(&replay.replayed, &replay.calls);
    let order = |tier: &&str| TIERS.iter().position(|t| t == tier).unwrap_or(TIERS.len());
    let mut tiers: Vec<&'static str> = recorded.keys().copied().collect();
    tiers.sort_by_key(|t| (order(t), *t));
    let header = [
        "tier", "calls", "served", "busy", "refused", "p50", "p99", "served", "busy", "refused",
        "p50", "p99",
    ];
    let mut rows: Vec<Vec<String>> = Vec::new();
    for tier in tiers {
        let (r, p) = (&recorded[tier], &replayed[tier]);
        let mut row = vec![tier.to_owned(), r.calls.to_string()];
        for c in [r, p] {
            row.extend([
                c.served.to_string(),
                c.busy.to_string(),
                c.refused.to_string(),
                ms(percentile(&c.latencies, 0.5)),
                ms(percentile(&c.latencies, 0.99)),
            ]);
        }
        rows.push(row);
    }
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: &[String]| {
        let padded: Vec<String> = cells
            .iter()
            .zip(&widths)
            .enumerate()
            .map(|(i, (c, w))| {
                let gap = if i == 2 || i == 7 { "| " } else { "" };
                if i == 0 {
                    format!("{c:<w$}")
                } else {
                    format!("{gap}{c:>w$}")
                }
            })
            .collect();
        padded.join("  ").trim_end().to_owned() + "\n"
    };
    // The group names over their columns, each after its bar.
    let head = line(&header.map(str::to_owned));
    let bars: Vec<usize> = head.match_indices('|').map(|(i, _)| i).collect();
    let mut out = format!(
        "{:w1$}| {:w2$}| replayed under the policy\n",
        "",
        "recorded",
        w1 = bars[0],
        w2 = bars[1] - bars[0] - 2
    );
    out += &head;
    for row in &rows {
        out += &line(row);
    }
    out
}

/// The replay as an outcome the SVG can draw (recorded dashed, replayed solid).
pub fn outcome(replay: Replay) -> Outcome {
    Outcome {
        id: 0,
        title: "replay",
        measure: "",
        reference: "",
        naive: 0.0,
        fairgate: 0.0,
        naive_text: String::new(),
        fairgate_text: String::new(),
        first_busy: Vec::new(),
        calls: replay.calls.len(),
        simulated: replay.replayed.simulated,
        workload: replay.calls,
        naive_run: replay.recorded,
        fairgate_run: replay.replayed,
    }
}
