//! `--cost`: what the gateway costs the machine, read from its own `/proc/<pid>`: CPU time
//! (`utime + stime` of `stat`) per 1,000 calls, peak RSS (`VmHWM` of `status`), and idle
//! RSS (`VmRSS`) after start before any call, and again [`SETTLE`] after the load ends and
//! its connections closed.
//!
//! ```sh
//! target/release/examples/gateway_bench --cost [--baseline PATH] [--rounds R] \
//!     [--requests N] [--concurrency C] [--seed S] [--gateway PATH] [--no-users]
//! ```
//!
//! Each round starts the gateway afresh and makes N calls (default 4,000), C at a time
//! (default 64), to the mock upstream answering after [`DELAY`], its SSE events
//! [`EVENT_GAP`] apart (each its own read): a mix drawn from the seed, half of them
//! streamed, a quarter of the service key naming one of 100,000 end users (none with
//! `--no-users`, for a build older than service keys). With
//! `--baseline` a second binary (it takes the same flags) runs the same calls in the same
//! round, the two in an order drawn from the seed, for R rounds (default 8); each figure is
//! the median of its rounds, the ratio this build's over the baseline's.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

use super::{Flags, HttpClient, USERS, anthropic, call, sibling_binary, start_gateway};

/// How long the mock takes to answer a call's head.
const DELAY: Duration = Duration::from_millis(50);
/// Between the SSE events of a streamed answer.
const EVENT_GAP: Duration = Duration::from_millis(2);
/// How long a gateway is left alone before its idle RSS is read.
const SETTLE: Duration = Duration::from_secs(3);
/// The most a round's load may take.
const LOAD_LIMIT: Duration = Duration::from_secs(60);

/// One call of the load: streamed or not, and the end user it names (of the service key).
type Plan = Vec<(bool, Option<usize>)>;

/// A seeded generator (splitmix64): the same seed, the same calls and order.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

/// What one round of one binary measured.
#[derive(Clone, Copy, Default)]
struct Figures {
    cpu_per_1000: f64,
    peak_mib: f64,
    idle_start_mib: f64,
    /// Of which anonymous (`RssAnon`): the rest is the program's own code and libraries
    /// mapped, which varies with how their files sit in the page cache.
    idle_anon_mib: f64,
    idle_after_mib: f64,
    per_second: f64,
    p99_ms: f64,
}

impl Figures {
    const NAMES: [&str; 7] = [
        "CPU s per 1,000 calls",
        "peak RSS MiB (VmHWM)",
        "idle RSS MiB at start",
        "of which anonymous (RssAnon)",
        "idle RSS MiB after the load",
        "calls/s",
        "p99 ms",
    ];

    fn values(&self) -> [f64; 7] {
        [
            self.cpu_per_1000,
            self.peak_mib,
            self.idle_start_mib,
            self.idle_anon_mib,
            self.idle_after_mib,
            self.per_second,
            self.p99_ms,
        ]
    }
}

/// Seconds of CPU the process has used, user and system (`/proc/<pid>/stat`, fields 14
/// and 15, in clock ticks).
fn cpu_seconds(pid: u32, ticks_per_second: f64) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("/proc/<pid>/stat");
    // The command's name, in parentheses, may hold spaces: count fields after it.
    let fields: Vec<&str> = stat[stat.rfind(')').expect("(comm)") + 2..]
        .split(' ')
        .collect();
    let ticks = |i: usize| fields[i - 3].parse::<u64>().expect("a tick count");
    (ticks(14) + ticks(15)) as f64 / ticks_per_second
}

/// The line `name` of `/proc/<pid>/status`, in MiB.
fn status_mib(pid: u32, name: &str) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    let line = status
        .lines()
        .find_map(|line| line.strip_prefix(name)?.strip_prefix(':'))
        .unwrap_or_else(|| panic!("no {name} in /proc/<pid>/status"));
    let kib: f64 = line.trim().trim_end_matches("kB").trim().parse().unwrap();
    kib / 1024.0
}

/// The kernel's clock ticks a second (`getconf CLK_TCK`; 100 where it cannot say).
fn ticks_per_second() -> f64 {
    std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|out| String::from_utf8(out.stdout).ok()?.trim().parse().ok())
        .unwrap_or(100.0)
}

/// Makes the calls of `plan`, `concurrency` at a time, on connections closed at the end:
/// the calls a second and the p99, in ms.
async fn load(url: &str, plan: &Plan, concurrency: usize) -> (f64, f64) {
    let client: HttpClient = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(concurrency)
        .build_http();
    let (message, stream) = (
        anthropic::MESSAGE_JSON.len(),
        anthropic::stream_body().len(),
    );
    let plan = std::sync::Arc::new(plan.clone());
    let next = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let started = Instant::now();
    let workers: Vec<_> = (0..concurrency)
        .map(|_| {
            let (client, url, plan, next) =
                (client.clone(), url.to_owned(), plan.clone(), next.clone());
            tokio::spawn(async move {
                let mut times = Vec::new();
                loop {
                    let n = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let Some(&(streamed, user)) = plan.get(n) else {
                        break;
                    };
                    assert!(
                        started.elapsed() < LOAD_LIMIT,
                        "the load took over {LOAD_LIMIT:?}"
                    );
                    let expect = if streamed { stream } else { message };
                    times.push(call(&client, &url, streamed, expect, user).await);
                }
                times
            })
        })
        .collect();
    let mut times = Vec::with_capacity(plan.len());
    for worker in workers {
        times.extend(worker.await.unwrap());
    }
    let elapsed = started.elapsed();
    times.sort();
    let p99 = times[(times.len() * 99 / 100).min(times.len() - 1)];
    (
        times.len() as f64 / elapsed.as_secs_f64(),
        p99.as_secs_f64() * 1e3,
    )
}

/// One round of `binary`: started afresh, left idle, loaded with `plan`, left idle again.
async fn round(binary: &Path, upstream: &str, plan: &Plan, concurrency: usize) -> Figures {
    let ticks = ticks_per_second();
    let users = plan.iter().any(|(_, user)| user.is_some());
    let (gateway, url) = start_gateway(binary, upstream, None, users);
    let pid = gateway.0.id();
    tokio::time::sleep(SETTLE).await;
    let (idle_start_mib, idle_anon_mib) = (status_mib(pid, "VmRSS"), status_mib(pid, "RssAnon"));
    let cpu = cpu_seconds(pid, ticks);
    let (per_second, p99_ms) = load(&url, plan, concurrency).await;
    let cpu = cpu_seconds(pid, ticks) - cpu;
    let peak_mib = status_mib(pid, "VmHWM");
    tokio::time::sleep(SETTLE).await;
    Figures {
        cpu_per_1000: cpu * 1_000.0 / plan.len() as f64,
        peak_mib,
        idle_start_mib,
        idle_anon_mib,
        idle_after_mib: status_mib(pid, "VmRSS"),
        per_second,
        p99_ms,
    }
}

/// The calls of a round: half streamed, a quarter naming an end user when `users`.
fn plan(rng: &mut Rng, requests: usize, users: bool) -> Plan {
    (0..requests)
        .map(|_| {
            let draw = rng.next();
            let user = (users && draw.is_multiple_of(4)).then_some((draw >> 8) as usize % USERS);
            (draw >> 2 & 1 == 1, user)
        })
        .collect()
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    let mid = values.len() / 2;
    if values.len() % 2 == 1 {
        values[mid]
    } else {
        (values[mid - 1] + values[mid]) / 2.0
    }
}

fn print(rounds: &[Vec<Figures>], binaries: &[PathBuf], flags: &Flags, requests: usize) {
    let medians: Vec<[f64; 7]> = rounds
        .iter()
        .map(|runs| std::array::from_fn(|i| median(runs.iter().map(|f| f.values()[i]).collect())))
        .collect();
    println!(
        "gateway cost, loopback, release; {requests} calls at concurrency {}, mock answering after {} ms; median of {} rounds; seed {}",
        flags.concurrency.unwrap_or(64),
        DELAY.as_millis(),
        rounds[0].len(),
        flags.seed.unwrap_or(1),
    );
    for (n, binary) in binaries.iter().enumerate() {
        println!("{}: {}", ["this build", "baseline"][n], binary.display());
    }
    if medians.len() == 1 {
        println!("| figure | this build |\n|---|---|");
    } else {
        println!("| figure | this build | baseline | ratio |\n|---|---|---|---|");
    }
    for (i, name) in Figures::NAMES.iter().enumerate() {
        let ours = medians[0][i];
        match medians.get(1) {
            None => println!("| {name} | {ours:.3} |"),
            Some(base) => println!(
                "| {name} | {ours:.3} | {:.3} | x{:.2} |",
                base[i],
                ours / base[i]
            ),
        }
    }
}

/// The `--cost` mode: this build (and the baseline) for R rounds, taking turns.
pub(crate) async fn main(flags: Flags) {
    let (requests, concurrency) = (
        flags.requests.unwrap_or(4_000),
        flags.concurrency.unwrap_or(64),
    );
    let mut rng = Rng(flags.seed.unwrap_or(1));
    let mut binaries = vec![flags.gateway.clone().unwrap_or_else(sibling_binary)];
    binaries.extend(flags.baseline.clone());
    let mock = anthropic::MockAnthropic::start();
    mock.set_delay(DELAY);
    mock.set_event_gap(EVENT_GAP);
    let mut rounds = vec![Vec::new(); binaries.len()];
    for r in 0..flags.rounds.unwrap_or(8) {
        let plan = plan(&mut rng, requests, !flags.no_users);
        let first = (rng.next() % binaries.len() as u64) as usize;
        for k in 0..binaries.len() {
            let n = (first + k) % binaries.len();
            let figures = round(&binaries[n], &mock.url(), &plan, concurrency).await;
            let v = figures.values();
            eprintln!(
                "round {r} {}: cpu {:.3} s/1000, peak {:.1}, idle {:.1} ({:.1} anon) / {:.1} MiB, \
                 {:.0} calls/s, p99 {:.1} ms",
                ["this build", "baseline"][n],
                v[0],
                v[1],
                v[2],
                v[3],
                v[4],
                v[5],
                v[6]
            );
            rounds[n].push(figures);
        }
    }
    print(&rounds, &binaries, &flags, requests);
}
