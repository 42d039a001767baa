//! The gateway's overhead: requests per second and latency (p50, p99) through the gateway
//! against calling the mock Anthropic upstream directly, non-streaming and streaming, on
//! loopback. Bounded in count and time; run by hand, in release:
//!
//! ```sh
//! cargo build --release -p fairgate-gateway --bin fairgate-gateway
//! cargo build --release -p fairgate-gateway --example gateway_bench
//! target/release/examples/gateway_bench [--requests N] [--concurrency C] [--redis URL]
//! ```
//!
//! Two commands: the program built with the example in one takes the dev-dependencies'
//! features (tokio's `full` and `test-util`), and is not the binary users install.
//!
//! It starts the mock upstream (`tests/support/anthropic.rs`, no delay, SSE events sent back
//! to back) in this process and the gateway binary built beside this one as a child process
//! (memory store, or `--redis URL`; caps high enough never to refuse: this measures the
//! cost of the path, not of waiting). Each scenario runs at concurrency 1 (the added
//! latency) and at concurrency C (default 32, the throughput), N requests each (default
//! 2,000 and 10,000), at most 20 s each. A streamed call is timed to its last byte. The
//! paths of a scenario take turns for R rounds (`--rounds`, default 5) and each figure is
//! the median of its rounds: on two shared cores one run of a path against one of another
//! differs by 10-20% at concurrency 32 from the machine alone.
//!
//! Through the gateway each scenario runs twice: with an ordinary key, and with a service
//! key (`users = true`) whose calls name one of 100,000 end users in `metadata.user_id`
//! (each call a tenant of its own, hashed): what acting for end users adds to the path.

#[path = "../../tests/support/anthropic.rs"]
mod anthropic;
#[path = "gateway_bench/cost.rs"]
mod cost;

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

const KEY: &str = "sk-bench-premium";
const SERVICE_KEY: &str = "sk-bench-service";
/// The end users a service key's calls name, one after another.
const USERS: usize = 100_000;
const LIMIT: Duration = Duration::from_secs(20);

type HttpClient = Client<HttpConnector, Full<Bytes>>;

struct Gateway(Child);

impl Drop for Gateway {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The program built beside the examples' folder: target/release/fairgate-gateway.
fn sibling_binary() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent()
        .and_then(Path::parent)
        .expect("target/release/examples")
        .join("fairgate-gateway")
}

/// Starts the gateway program `binary` in front of `upstream` (caps high enough never to
/// refuse), and waits for its API port. Its keys file has the service key when `users`
/// (a build older than service keys refuses it).
fn start_gateway(
    binary: &Path,
    upstream: &str,
    redis: Option<&str>,
    users: bool,
) -> (Gateway, String) {
    assert!(
        binary.exists(),
        "{} missing: cargo build --release -p fairgate-gateway --bin fairgate-gateway",
        binary.display()
    );
    let keys = std::env::temp_dir().join(format!("gateway-bench-{}.toml", std::process::id()));
    let service = format!(
        "[[keys]]\nkey = \"{SERVICE_KEY}\"\ntenant = \"bench-service\"\nusers = true\n\
         tier = \"premium\"\n\n"
    );
    std::fs::write(
        &keys,
        format!(
            "[[keys]]\nkey = \"{KEY}\"\ntenant = \"bench\"\ntier = \"premium\"\n\n{}\
             [limits]\nglobal_max = 512\ndaily_token_budget = 1000000000\n\n\
             [[tiers]]\nname = \"premium\"\ncap = 512\nmax_wait_ms = 60000\n",
            if users { service.as_str() } else { "" }
        ),
    )
    .unwrap();
    let port = free_port();
    let mut cmd = Command::new(binary);
    cmd.args([
        "--listen",
        &format!("127.0.0.1:{port}"),
        "--admin",
        &format!("127.0.0.1:{}", free_port()),
        "--upstream",
        upstream,
    ])
    .arg("--keys")
    .arg(&keys)
    .env("ANTHROPIC_API_KEY", "sk-upstream-bench")
    .env("RUST_LOG", "warn")
    .stdout(Stdio::null())
    .stderr(Stdio::inherit());
    if let Some(url) = redis {
        cmd.args(["--redis", url]);
    }
    let mut gateway = Gateway(cmd.spawn().expect("start the gateway"));
    let url = format!("http://127.0.0.1:{port}");
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        let exited = gateway.0.try_wait().expect("the gateway's state");
        assert!(exited.is_none(), "the gateway stopped: {exited:?}");
        assert!(Instant::now() < deadline, "the gateway did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    (gateway, url)
}

fn body(stream: bool, user: Option<usize>) -> Bytes {
    let metadata = user.map_or(String::new(), |user| {
        format!(r#""metadata":{{"user_id":"user-{user}"}},"#)
    });
    Bytes::from(format!(
        r#"{{"model":"claude-mock-1","max_tokens":64,"stream":{stream},{metadata}"messages":[{{"role":"user","content":"Hello, how are you today?"}}]}}"#
    ))
}

/// One call, timed to its last byte: of the service key, naming `user`, when one is given.
async fn call(
    client: &HttpClient,
    url: &str,
    stream: bool,
    expect: usize,
    user: Option<usize>,
) -> Duration {
    let started = Instant::now();
    let req = http::Request::post(format!("{url}/v1/messages"))
        .header("x-api-key", if user.is_some() { SERVICE_KEY } else { KEY })
        .header("anthropic-version", "2023-06-01")
        .header("content-type", "application/json")
        .body(Full::new(body(stream, user)))
        .unwrap();
    let response = client.request(req).await.expect("the call");
    assert_eq!(response.status(), 200);
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(bytes.len(), expect, "a whole answer");
    started.elapsed()
}

struct Run {
    done: usize,
    per_second: f64,
    p50: Duration,
    p99: Duration,
}

/// Each figure's median over the rounds of a path.
fn median(mut runs: Vec<Run>) -> Run {
    let mid = runs.len() / 2;
    runs.sort_by(|a, b| a.per_second.total_cmp(&b.per_second));
    let per_second = runs[mid].per_second;
    runs.sort_by_key(|r| r.p99);
    let p99 = runs[mid].p99;
    runs.sort_by_key(|r| r.p50);
    Run {
        done: runs[mid].done,
        per_second,
        p50: runs[mid].p50,
        p99,
    }
}

/// `requests` calls, `concurrency` at a time; of the service key, each naming the next of
/// [`USERS`] end users, when `users`.
async fn run(url: &str, stream: bool, requests: usize, concurrency: usize, users: bool) -> Run {
    let client: HttpClient = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(concurrency)
        .build_http();
    let expect = if stream {
        anthropic::stream_body().len()
    } else {
        anthropic::MESSAGE_JSON.len()
    };
    // Warm the connections up.
    let user = |n: usize| users.then_some(n % USERS);
    for n in 0..concurrency.min(8) {
        call(&client, url, stream, expect, user(n)).await;
    }
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let workers: Vec<_> = (0..concurrency)
        .map(|_| {
            let (client, url, next) = (client.clone(), url.to_owned(), next.clone());
            tokio::spawn(async move {
                let mut times = Vec::new();
                loop {
                    let n = next.fetch_add(1, Ordering::Relaxed);
                    if n >= requests || started.elapsed() >= LIMIT {
                        break;
                    }
                    let user = users.then_some(n % USERS);
                    times.push(call(&client, &url, stream, expect, user).await);
                }
                times
            })
        })
        .collect();
    let mut times = Vec::with_capacity(requests);
    for worker in workers {
        times.extend(worker.await.unwrap());
    }
    let elapsed = started.elapsed();
    times.sort();
    let at = |q: f64| times[((times.len() as f64 * q) as usize).min(times.len() - 1)];
    Run {
        done: times.len(),
        per_second: times.len() as f64 / elapsed.as_secs_f64(),
        p50: at(0.50),
        p99: at(0.99),
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1_000.0
}

/// The command line: `--name value` pairs, and `--cost` and `--no-users` alone.
#[derive(Default)]
struct Flags {
    requests: Option<usize>,
    concurrency: Option<usize>,
    redis: Option<String>,
    rounds: Option<usize>,
    cost: bool,
    no_users: bool,
    gateway: Option<PathBuf>,
    baseline: Option<PathBuf>,
    seed: Option<u64>,
}

fn flags() -> Flags {
    let mut flags = Flags::default();
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        if arg == "--cost" || arg == "--no-users" {
            flags.cost |= arg == "--cost";
            flags.no_users |= arg == "--no-users";
            continue;
        }
        let value = args.next().unwrap_or_else(|| panic!("{arg} needs a value"));
        let number = |what: &str| value.parse::<usize>().expect(what);
        match arg.as_str() {
            "--requests" => flags.requests = Some(number("--requests N")),
            "--concurrency" => flags.concurrency = Some(number("--concurrency C")),
            "--rounds" => flags.rounds = Some(number("--rounds R").max(1)),
            "--redis" => flags.redis = Some(value),
            "--gateway" => flags.gateway = Some(value.into()),
            "--baseline" => flags.baseline = Some(value.into()),
            "--seed" => flags.seed = Some(value.parse().expect("--seed S")),
            other => panic!("unknown argument {other}"),
        }
    }
    flags
}

#[tokio::main(flavor = "multi_thread", worker_threads = 1)]
async fn main() {
    let flags = flags();
    if flags.cost {
        return cost::main(flags).await;
    }
    let (requests, concurrency) = (flags.requests, flags.concurrency.unwrap_or(32));
    let (redis, rounds) = (flags.redis, flags.rounds.unwrap_or(5));
    let binary = flags.gateway.unwrap_or_else(sibling_binary);
    let mock = anthropic::MockAnthropic::start();
    mock.set_event_gap(Duration::ZERO);
    let (_gateway, gateway) = start_gateway(&binary, &mock.url(), redis.as_deref(), true);
    let direct = mock.url();
    println!(
        "gateway overhead ({} store), loopback, release; mock: no delay, SSE back to back; median of {rounds} rounds",
        if redis.is_some() { "redis" } else { "memory" }
    );
    println!(
        "| answer | concurrency | path | requests | req/s | p50 ms | p99 ms | added p50 ms | added p99 ms |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for stream in [false, true] {
        for c in [1, concurrency] {
            let n = requests.unwrap_or(if c == 1 { 2_000 } else { 10_000 });
            let (mut base, mut through, mut users) = (Vec::new(), Vec::new(), Vec::new());
            for _ in 0..rounds {
                base.push(run(&direct, stream, n, c, false).await);
                through.push(run(&gateway, stream, n, c, false).await);
                users.push(run(&gateway, stream, n, c, true).await);
            }
            let (base, through, users) = (median(base), median(through), median(users));
            let kind = if stream { "stream" } else { "message" };
            for (path, r) in [
                ("direct", &base),
                ("gateway", &through),
                ("gateway, end users", &users),
            ] {
                let added = |a: Duration, b: Duration| {
                    if path != "direct" {
                        format!("{:+.3}", ms(a) - ms(b))
                    } else {
                        "".into()
                    }
                };
                println!(
                    "| {kind} | {c} | {path} | {} | {:.0} | {:.3} | {:.3} | {} | {} |",
                    r.done,
                    r.per_second,
                    ms(r.p50),
                    ms(r.p99),
                    added(r.p50, base.p50),
                    added(r.p99, base.p99),
                );
            }
        }
    }
}
