//! The references' scenarios, reproduced: a mock Claude upstream and workload generators run
//! the real fairgate layers and a naive stack (a FIFO semaphore, immediate retries) side by
//! side, in tokio's paused time, and print one table beside the references' numbers.
//!
//! ```sh
//! cargo run --release --example simulate -- [scenario] [--seed N] [--svg out.svg] [--small]
//! ```
//!
//! `scenario` is one of `b-behind-a`, `hog`, `storm`, `peak`, `spike` (or its number 1-5);
//! all five when left out. The same seed prints the same table. `--svg FILE` writes the
//! latency distributions per tier and the calls in flight per tier over time (the spike,
//! else the last scenario run) as a self-contained SVG.

mod engine;
mod svg;

use std::process::ExitCode;

use engine::{Outcome, SCENARIOS, Size};

struct Args {
    scenarios: Vec<usize>,
    seed: u64,
    svg: Option<String>,
    size: Size,
}

fn usage() -> String {
    format!(
        "usage: simulate [{}|1-5] [--seed N] [--svg FILE] [--small]",
        SCENARIOS.join("|")
    )
}

fn parse() -> Result<Args, String> {
    let mut args = Args {
        scenarios: (1..=SCENARIOS.len()).collect(),
        seed: 1,
        svg: None,
        size: Size::Full,
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
    let total = args.scenarios.len();
    let mut outcomes: Vec<Outcome> = Vec::new();
    for (n, id) in args.scenarios.iter().enumerate() {
        eprint!("[{}/{total}] {} ... ", n + 1, SCENARIOS[id - 1]);
        let outcome = engine::scenario(*id, args.seed, args.size).await;
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
    print!("{}", engine::table(&outcomes));
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
