//! Five published scenarios, reproduced: a mock Claude upstream and workload generators run
//! the real fairgate layers and a naive stack (a FIFO semaphore, immediate retries) side by
//! side, in tokio's paused time, and print one table beside the numbers two published
//! write-ups report for their own systems (a three-tier Redis job queue with DRR, a Redis
//! tier-aware semaphore).
//!
//! ```sh
//! cargo run --release -p fairgate-simulator -- [scenario] [--seed N] [--svg out.svg] [--small]
//! ```
//!
//! `scenario` is one of `b-behind-a`, `hog`, `storm`, `peak`, `spike` (or its number 1-5);
//! all five when left out. The same seed prints the same table. `--svg FILE` writes the
//! latency distributions per tier and the calls in flight per tier over time (the spike,
//! else the last scenario run) as a self-contained SVG.
//!
//! ```sh
//! cargo run --release -p fairgate-simulator -- --replay FILE [--policy policy.toml] [--seed N] [--svg out.svg]
//! ```
//!
//! `--replay` replays a recording (the gateway's `--record`) through the real layers under
//! `policy.toml` (the keys file's `[limits]` and `[[tiers]]`, optional `[drr]`; the crate's
//! defaults without it) and prints, per tier, the recorded and the replayed outcomes.

use std::process::ExitCode;

use fairgate_simulator::scenarios::{self, Outcome, SCENARIOS, Size};
use fairgate_simulator::{replay, svg};

struct Args {
    scenarios: Vec<usize>,
    seed: u64,
    svg: Option<String>,
    size: Size,
    replay: Option<String>,
    policy: Option<String>,
}

fn usage() -> String {
    format!(
        "usage: fairgate-simulate [{}|1-5] [--seed N] [--svg FILE] [--small]\n       fairgate-simulate --replay FILE [--policy policy.toml] [--seed N] [--svg FILE]",
        SCENARIOS.join("|")
    )
}

fn parse() -> Result<Args, String> {
    let mut args = Args {
        scenarios: (1..=SCENARIOS.len()).collect(),
        seed: 1,
        svg: None,
        size: Size::Full,
        replay: None,
        policy: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--seed" => {
                let n = it.next().ok_or("--seed needs a number")?;
                args.seed = n.parse().map_err(|_| format!("--seed {n}: not a number"))?;
            }
            "--svg" => args.svg = Some(it.next().ok_or("--svg needs a file name")?),
            "--small" => args.size = Size::Small,
            "--replay" => args.replay = Some(it.next().ok_or("--replay needs a file name")?),
            "--policy" => args.policy = Some(it.next().ok_or("--policy needs a file name")?),
            "-h" | "--help" => return Err(usage()),
            "all" => {}
            name => {
                let id = SCENARIOS
                    .iter()
                    .position(|s| *s == name)
                    .map(|i| i + 1)
                    .or_else(|| {
                        name.parse()
                            .ok()
                            .filter(|n| (1..=SCENARIOS.len()).contains(n))
                    })
                    .ok_or_else(|| format!("unknown scenario {name:?}\n{}", usage()))?;
                args.scenarios = vec![id];
            }
        }
    }
    Ok(args)
}

#[tokio::main(flavor = "current_thread", start_paused = true)]
async fn main() -> ExitCode {
    let args = match parse() {
        Ok(args) => args,
        Err(message) => {
            eprintln!("{message}");
            return ExitCode::FAILURE;
        }
    };
    if let Some(file) = &args.replay {
        return match replay_file(file, args.policy.as_deref(), args.seed, args.svg.as_deref()).await
        {
            Ok(()) => ExitCode::SUCCESS,
            Err(message) => {
                eprintln!("{message}");
                ExitCode::FAILURE
            }
        };
    }
    if args.policy.is_some() {
        eprintln!("--policy goes with --replay\n{}", usage());
        return ExitCode::FAILURE;
    }
    let total = args.scenarios.len();
    let mut outcomes: Vec<Outcome> = Vec::new();
    for (n, id) in args.scenarios.iter().enumerate() {
        eprint!("[{}/{total}] {} ... ", n + 1, SCENARIOS[id - 1]);
        let outcome = scenarios::scenario(*id, args.seed, args.size).await;
        eprintln!(
            "{} calls, {:.0} s simulated",
            outcome.calls, outcome.simulated
        );
        outcomes.push(outcome);
    }
    println!(
        "seed {}: naive = FIFO semaphore + immediate retries; fairgate = FairgateLayer on Store::memory()\n",
        args.seed
    );
    print!("{}", scenarios::table(&outcomes));
    if let Some(path) = args.svg {
        let shown = outcomes
            .iter()
            .find(|o| o.id == 5)
            .or(outcomes.last())
            .expect("a scenario ran");
        if let Err(e) = std::fs::write(&path, svg::render(shown, args.size)) {
            eprintln!("{path}: {e}");
            return ExitCode::FAILURE;
        }
        eprintln!("wrote {path}");
    }
    ExitCode::SUCCESS
}

/// `--replay FILE [--policy FILE]`: prints the recorded and replayed table, writes the SVG.
async fn replay_file(
    file: &str,
    policy: Option<&str>,
    seed: u64,
    svg_path: Option<&str>,
) -> Result<(), String> {
    let text = std::fs::read_to_string(file).map_err(|e| format!("--replay {file}: {e}"))?;
    let records = replay::read(&text).map_err(|e| format!("--replay {file} {e}"))?;
    let policy_text = match policy {
        Some(path) => std::fs::read_to_string(path).map_err(|e| format!("--policy {path}: {e}"))?,
        None => String::new(),
    };
    let policy_name = policy.unwrap_or("(the crate's defaults)");
    let (policy, summary) =
        replay::policy(&policy_text).map_err(|e| format!("--policy {policy_name}: {e}"))?;
    let tenants: std::collections::BTreeSet<&str> =
        records.iter().map(|r| r.tenant.as_str()).collect();
    let span = records.last().map_or(0.0, |r| r.at_ms as f64 / 1000.0);
    eprint!("replaying {} calls ... ", records.len());
    let replayed = replay::replay(&records, &policy, seed).await;
    eprintln!("{:.0} s simulated", replayed.replayed.simulated);
    println!(
        "replay of {file}: {} calls from {} tenants over {span:.1} s, seed {seed}\npolicy {policy_name}: {summary}\n",
        records.len(),
        tenants.len(),
    );
    print!("{}", replay::table(&replayed));
    if let Some(path) = svg_path {
        let picture = svg::render_with(
            &replay::outcome(replayed),
            &format!("fairgate simulator: replay of {file}"),
            [
                ("recorded", "At the upstream per tier, recorded"),
                (
                    "replayed",
                    "At the upstream per tier, replayed under the policy",
                ),
            ],
            svg::Claim::None,
        );
        std::fs::write(path, picture).map_err(|e| format!("{path}: {e}"))?;
        eprintln!("wrote {path}");
    }
    Ok(())
}
