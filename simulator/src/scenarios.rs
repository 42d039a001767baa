//! The five published scenarios on the engine, each run under both policies, and the
//! table that sets their measures beside the write-ups' own.

use std::time::Duration;

use fairgate::Origin;

use crate::engine::{
    Answer, Call, Done, Policy, Rng, Run, TIERS, Upstream, jain, percentile, poisson, run,
};

/// How big a run: `Full` for the table, `Small` for the tests (a few seconds).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Size {
    Small,
    Full,
}

impl Size {
    fn pick<T>(self, small: T, full: T) -> T {
        match self {
            Size::Small => small,
            Size::Full => full,
        }
    }
}

/// The scenarios' names on the command line, in order.
pub const SCENARIOS: [&str; 5] = ["b-behind-a", "hog", "storm", "peak", "spike"];

/// One line of the table, and the runs behind it.
#[derive(Debug)]
pub struct Outcome {
    pub id: usize,
    pub title: &'static str,
    pub measure: &'static str,
    /// What the published write-up reports for its own system.
    pub reference: &'static str,
    /// The measure, naive and fairgate (seconds, an index or a share).
    pub naive: f64,
    pub fairgate: f64,
    pub naive_text: String,
    pub fairgate_text: String,
    /// The spike: tiers in the order they first saw `SERVER_BUSY`, seconds after it began.
    pub first_busy: Vec<(String, f64)>,
    /// Calls sent (both policies) and seconds simulated.
    pub calls: usize,
    pub simulated: f64,
    /// The workload and both runs (the last round's, when there are rounds), for pictures.
    pub workload: Vec<Call>,
    pub naive_run: Run,
    pub fairgate_run: Run,
}

/// Runs scenario `id` (1..=5).
pub async fn scenario(id: usize, seed: u64, size: Size) -> Outcome {
    match id {
        1 => b_behind_a(seed, size).await,
        2 => hog(seed, size).await,
        3 => storm(seed, size).await,
        4 => peak(seed, size).await,
        5 => spike(seed, size).await,
        _ => panic!("no scenario {id}: 1..=5"),
    }
}

fn sorted(mut calls: Vec<Call>) -> Vec<Call> {
    calls.sort_by_key(|c| c.at);
    calls
}

fn secs(s: f64) -> String {
    format!("{s:.1} s")
}

fn latencies(run: &Run, calls: &[Call], keep: impl Fn(&Call) -> bool) -> Vec<f64> {
    run.done
        .iter()
        .filter(|d| d.answer == Answer::Served && keep(&calls[d.call]))
        .map(|d| d.latency)
        .collect()
}

/// Scenario 1: tenant A dumps 100 critical jobs, tenant B sends one just after; B's p99
/// over rounds.
async fn b_behind_a(seed: u64, size: Size) -> Outcome {
    let rounds = size.pick(6, 40);
    let upstream = Upstream::roomy();
    let (mut naive_b, mut fair_b) = (Vec::new(), Vec::new());
    let (mut calls_sent, mut simulated) = (0, 0.0);
    let mut last = None;
    for round in 0..rounds {
        let mut rng = Rng::new(seed.wrapping_mul(1_000).wrapping_add(round));
        let mut calls: Vec<Call> = (0..100)
            .map(|i| Call {
                at: Duration::from_millis(i),
                tenant: "A".into(),
                tier: "pro",
                origin: Origin::UserAction,
                sla: None,
                input: rng.between(600, 1_200),
                output: rng.between(100, 300),
                latency: None,
                status: None,
            })
            .collect();
        calls.push(Call {
            at: Duration::from_secs_f64(0.1 + rng.unit()),
            tenant: "B".into(),
            tier: "pro",
            origin: Origin::UserAction,
            sla: None,
            input: rng.between(600, 1_200),
            output: rng.between(100, 300),
            latency: None,
            status: None,
        });
        let calls = sorted(calls);
        let horizon = Duration::from_secs(300);
        let naive = run(
            &Policy::Naive { limit: 10 },
            &upstream,
            &calls,
            horizon,
            seed,
        )
        .await;
        let fair = run(&Policy::fairgate(10), &upstream, &calls, horizon, seed).await;
        naive_b.extend(latencies(&naive, &calls, |c| c.tenant == "B"));
        fair_b.extend(latencies(&fair, &calls, |c| c.tenant == "B"));
        calls_sent += 2 * calls.len();
        simulated += naive.simulated + fair.simulated;
        last = Some((calls, naive, fair));
    }
    let (workload, naive_run, fairgate_run) = last.expect("at least one round");
    let naive = percentile(&naive_b, 0.99).unwrap_or(f64::NAN);
    let fairgate = percentile(&fair_b, 0.99).unwrap_or(f64::NAN);
    Outcome {
        id: 1,
        title: "A dumps 100 critical jobs, B sends 1",
        measure: "B's p99",
        reference: "9.8 s -> 1.7 s",
        naive,
        fairgate,
        naive_text: secs(naive),
        fairgate_text: secs(fairgate),
        first_busy: Vec::new(),
        calls: calls_sent,
        simulated,
        workload,
        naive_run,
        fairgate_run,
    }
}

/// Served input tokens per tenant, for `names`.
fn served_by(run: &Run, names: &[String]) -> Vec<f64> {
    names
        .iter()
        .map(|n| {
            run.served
                .iter()
                .filter(|(_, t, _)| t == n)
                .map(|(_, _, tokens)| f64::from(*tokens))
                .sum()
        })
        .collect()
}

/// Scenario 2: eight tenants, all backlogged, one sending 8x the others; Jain's index over
/// served input tokens.
async fn hog(seed: u64, size: Size) -> Outcome {
    let t = size.pick(40.0, 120.0);
    let mut rng = Rng::new(seed ^ 2);
    let mut calls = Vec::new();
    // Prompts of about one quantum (5,000 tokens), so a DRR visit sends about one call.
    let tokens = ((2_000, 8_000), (100, 300));
    let standard = Origin::Scheduled;
    // Capacity is about 6.7 calls a second: each light tenant asks 1.2 (its fair share is
    // 0.83), the hog 8x that.
    poisson(
        &mut rng,
        &mut calls,
        (0.0, t),
        7.0 * 1.2,
        ("light", 7),
        "free",
        standard,
        tokens,
    );
    poisson(
        &mut rng,
        &mut calls,
        (0.0, t),
        9.6,
        ("hog", 1),
        "free",
        standard,
        tokens,
    );
    let calls = sorted(calls);
    let horizon = Duration::from_secs_f64(t);
    let naive_run = run(
        &Policy::Naive { limit: 8 },
        &Upstream::roomy(),
        &calls,
        horizon,
        seed,
    )
    .await;
    let fairgate_run = run(
        &Policy::fairgate(8),
        &Upstream::roomy(),
        &calls,
        horizon,
        seed,
    )
    .await;
    let mut names: Vec<String> = (0..7).map(|i| format!("light-{i}")).collect();
    names.push("hog-0".into());
    let (naive_served, fair_served) = (
        served_by(&naive_run, &names),
        served_by(&fairgate_run, &names),
    );
    let (naive, fairgate) = (jain(&naive_served), jain(&fair_served));
    // The hog's share of the served tokens (1/8 = 12.5% is its fair share).
    let hog_share = |served: &[f64]| 100.0 * served[7] / served.iter().sum::<f64>().max(1.0);
    Outcome {
        id: 2,
        title: "8 tenants, one hogging",
        measure: "Jain's index, served tokens",
        reference: "0.42 -> 0.86-0.91",
        naive,
        fairgate,
        naive_text: format!("{naive:.2} (hog {:.0}%)", hog_share(&naive_served)),
        fairgate_text: format!("{fairgate:.2} (hog {:.0}%)", hog_share(&fair_served)),
        first_busy: Vec::new(),
        calls: 2 * calls.len(),
        simulated: naive_run.simulated + fairgate_run.simulated,
        workload: calls,
        naive_run,
        fairgate_run,
    }
}

/// Scenario 3: a 429 storm, a burst of 60 calls then 70 calls a minute against the
/// 50 RPM / 40,000 ITPM / 8,000 OTPM tier, with a 3 s burst of 529s; the share
/// of attempts answered 429.
async fn storm(seed: u64, size: Size) -> Outcome {
    let t = size.pick(90.0, 300.0);
    let burst = size.pick(30.0, 60.0);
    let upstream = Upstream {
        rpm: 50.0,
        itpm: 40_000.0,
        otpm: 8_000.0,
        overloaded: vec![(
            Duration::from_secs_f64(burst),
            Duration::from_secs_f64(burst + 3.0),
        )],
        ..Upstream::roomy()
    };
    let mut rng = Rng::new(seed ^ 3);
    let mut calls = Vec::new();
    let tokens = ((200, 600), (50, 150));
    let chat = Origin::UserAction;
    // A burst of 60 calls in 5 s empties the bucket, then 70 calls a minute keep it empty.
    poisson(
        &mut rng,
        &mut calls,
        (0.0, 5.0),
        12.0,
        ("user", 6),
        "pro",
        chat,
        tokens,
    );
    poisson(
        &mut rng,
        &mut calls,
        (0.0, t),
        70.0 / 60.0,
        ("user", 6),
        "pro",
        chat,
        tokens,
    );
    let calls = sorted(calls);
    let horizon = Duration::from_secs_f64(t + 120.0);
    let naive_run = run(
        &Policy::Naive { limit: 30 },
        &upstream,
        &calls,
        horizon,
        seed,
    )
    .await;
    let fairgate_run = run(&Policy::fairgate(30), &upstream, &calls, horizon, seed).await;
    let share = |r: &Run| r.throttled as f64 / r.attempts.max(1) as f64;
    let (naive, fairgate) = (share(&naive_run), share(&fairgate_run));
    let text = |r: &Run, s: f64| {
        let served = r.done.iter().filter(|d| d.answer == Answer::Served).count();
        format!(
            "{:.0}% ({}/{}), {served} served",
            100.0 * s,
            r.throttled,
            r.attempts
        )
    };
    Outcome {
        id: 3,
        title: "429 storm on a 50 RPM tier",
        measure: "attempts answered 429",
        reference: "38% -> 7%",
        naive,
        fairgate,
        naive_text: text(&naive_run, naive),
        fairgate_text: text(&fairgate_run, fairgate),
        first_busy: Vec::new(),
        calls: 2 * calls.len(),
        simulated: naive_run.simulated + fairgate_run.simulated,
        workload: calls,
        naive_run,
        fairgate_run,
    }
}

fn paid(tier: &str) -> bool {
    tier == "pro" || tier == "premium"
}

/// Scenario 4: a peak, 20 free users per paying user, more calls than 30 slots can answer;
/// the paid users' p99.
async fn peak(seed: u64, size: Size) -> Outcome {
    let t = size.pick(40.0, 120.0);
    let mut rng = Rng::new(seed ^ 4);
    let mut calls = Vec::new();
    let tokens = ((300, 1_500), (100, 300));
    let chat = Origin::UserAction;
    poisson(
        &mut rng,
        &mut calls,
        (0.0, t),
        0.625,
        ("premium", 5),
        "premium",
        chat,
        tokens,
    );
    poisson(
        &mut rng,
        &mut calls,
        (0.0, t),
        0.625,
        ("pro", 5),
        "pro",
        chat,
        tokens,
    );
    poisson(
        &mut rng,
        &mut calls,
        (0.0, t),
        28.0,
        ("free", 200),
        "free",
        chat,
        tokens,
    );
    let calls = sorted(calls);
    let horizon = Duration::from_secs_f64(t + 300.0);
    let naive_run = run(
        &Policy::Naive { limit: 30 },
        &Upstream::roomy(),
        &calls,
        horizon,
        seed,
    )
    .await;
    let fairgate_run = run(
        &Policy::fairgate(32),
        &Upstream::roomy(),
        &calls,
        horizon,
        seed,
    )
    .await;
    let p99 =
        |r: &Run| percentile(&latencies(r, &calls, |c| paid(c.tier)), 0.99).unwrap_or(f64::NAN);
    let (naive, fairgate) = (p99(&naive_run), p99(&fairgate_run));
    Outcome {
        id: 4,
        title: "peak, 20 free users per paying user",
        measure: "paid p99",
        reference: "20+ s -> under 2 s",
        naive,
        fairgate,
        naive_text: secs(naive),
        fairgate_text: secs(fairgate),
        first_busy: Vec::new(),
        calls: 2 * calls.len(),
        simulated: naive_run.simulated + fairgate_run.simulated,
        workload: calls,
        naive_run,
        fairgate_run,
    }
}

/// When the spike starts, seconds from the start.
pub fn spike_start(size: Size) -> f64 {
    size.pick(10.0, 30.0)
}

/// Scenario 5: a 10x spike over a mixed load; which tiers see `SERVER_BUSY` first.
async fn spike(seed: u64, size: Size) -> Outcome {
    let from = spike_start(size);
    let to = from + size.pick(30.0, 60.0);
    let end = to + size.pick(10.0, 30.0);
    let mut rng = Rng::new(seed ^ 5);
    let mut calls = Vec::new();
    let tokens = ((300, 1_500), (100, 300));
    let chat = Origin::UserAction;
    for (from, to, x) in [(0.0, from, 1.0), (from, to, 10.0), (to, end, 1.0)] {
        for (tier, rate, users) in [
            ("premium", 0.6, 20),
            ("pro", 1.2, 40),
            ("free", 2.4, 400),
            ("guest", 1.2, 400),
        ] {
            poisson(
                &mut rng,
                &mut calls,
                (from, to),
                rate * x,
                (tier, users),
                tier,
                chat,
                tokens,
            );
        }
    }
    let calls = sorted(calls);
    let horizon = Duration::from_secs_f64(end + 300.0);
    let (naive, fair) = (Policy::Naive { limit: 30 }, Policy::fairgate(32));
    let naive_run = run(&naive, &Upstream::roomy(), &calls, horizon, seed).await;
    let fairgate_run = run(&fair, &Upstream::roomy(), &calls, horizon, seed).await;
    let first_busy = first_busy_by_tier(&fairgate_run, from);
    let naive_busy = naive_run
        .done
        .iter()
        .filter(|d| matches!(d.answer, Answer::Busy(..)))
        .count();
    let in_spike = |c: &Call| c.at.as_secs_f64() >= from && c.at.as_secs_f64() < to;
    let naive_p99 = percentile(
        &latencies(&naive_run, &calls, |c| in_spike(c) && paid(c.tier)),
        0.99,
    )
    .unwrap_or(f64::NAN);
    let fair_p99 = percentile(
        &latencies(&fairgate_run, &calls, |c| in_spike(c) && paid(c.tier)),
        0.99,
    )
    .unwrap_or(f64::NAN);
    let mut order: Vec<String> = first_busy
        .iter()
        .map(|(t, s)| format!("{t} {s:.0} s"))
        .collect();
    order.extend(
        TIERS
            .iter()
            .filter(|tier| !first_busy.iter().any(|(t, _)| t == *tier))
            .map(|tier| format!("{tier} never")),
    );
    Outcome {
        id: 5,
        title: "10x spike (paid p99 in brackets)",
        measure: "first SERVER_BUSY, by tier",
        reference: "free/guest before pro/premium",
        naive: naive_busy as f64,
        fairgate: first_busy.len() as f64,
        naive_text: format!("none, all wait ({})", secs(naive_p99)),
        fairgate_text: format!("{} ({})", order.join(", "), secs(fair_p99)),
        first_busy,
        calls: 2 * calls.len(),
        simulated: naive_run.simulated + fairgate_run.simulated,
        workload: calls,
        naive_run,
        fairgate_run,
    }
}

/// The tiers in the order they were first answered `Busy`, each with the seconds from
/// `from` to that answer.
fn first_busy_by_tier(run: &Run, from: f64) -> Vec<(String, f64)> {
    let mut first_busy: Vec<(String, f64)> = Vec::new();
    let mut by_time: Vec<&Done> = run.done.iter().collect();
    by_time.sort_by(|a, b| a.at.total_cmp(&b.at));
    for d in by_time {
        if let Answer::Busy(tier, _) = &d.answer
            && !first_busy.iter().any(|(t, _)| t == tier)
        {
            first_busy.push((tier.clone(), d.at - from));
        }
    }
    first_busy
}

/// The table of `outcomes`, beside the numbers the published write-ups report
/// (column `reference`).
pub fn table(outcomes: &[Outcome]) -> String {
    let header = ["#", "scenario", "measure", "reference", "naive", "fairgate"];
    let rows: Vec<[String; 6]> = outcomes
        .iter()
        .map(|o| {
            [
                o.id.to_string(),
                o.title.to_owned(),
                o.measure.to_owned(),
                o.reference.to_owned(),
                o.naive_text.clone(),
                o.fairgate_text.clone(),
            ]
        })
        .collect();
    let mut widths = header.map(str::len);
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: &[String]| {
        let padded: Vec<String> = cells
            .iter()
            .zip(widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        padded.join("  ").trim_end().to_owned() + "\n"
    };
    let mut out = line(&header.map(str::to_owned));
    out += &line(&widths.map(|w| "-".repeat(w)));
    for row in &rows {
        out += &line(row);
    }
    out
}
