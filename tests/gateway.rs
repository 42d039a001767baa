//! The Anthropic-compatible gateway (`examples/gateway.rs`) end to end: the example runs as
//! a real process (started as its README says, on a free loopback port), in front of the
//! mock Anthropic upstream (`support/anthropic.rs`), and is driven by a real HTTP client
//! and by the official Anthropic Python SDK.
//!
//! Every process is stopped by its pid when its guard drops, also when a test panics. The
//! tests run one at a time (two cores; the flood and disconnect checks are timed).
#![cfg(feature = "redis")]

mod support;

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use support::RedisServer;
use support::anthropic::{MESSAGE_JSON, MockAnthropic, STREAM_TEXT, stream_body};

/// The upstream key the gateway is started with.
const UPSTREAM_KEY: &str = "sk-upstream-test-key";
const PREMIUM_KEY: &str = "sk-gw-premium-1";
const GUEST_KEY: &str = "sk-gw-guest-1";

/// One test at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn target_tmp() -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
}

/// The gateway example, built with this test's profile and features (a no-op when fresh:
/// `cargo test --test gateway` alone builds no example).
fn gateway_binary() -> PathBuf {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT
        .get_or_init(|| {
            let exe = std::env::current_exe().unwrap();
            let profile_dir = exe.parent().unwrap().parent().unwrap().to_path_buf();
            let target_dir = profile_dir.parent().unwrap();
            let mut features = vec!["redis"];
            for (on, name) in [
                (cfg!(feature = "axum"), "axum"),
                (cfg!(feature = "reqwest"), "reqwest"),
                (cfg!(feature = "tonic"), "tonic"),
                (cfg!(feature = "full"), "full"),
            ] {
                if on {
                    features.push(name);
                }
            }
            let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
            let mut build = Command::new(cargo);
            // Without the variables cargo sets for this test's run: build scripts that watch
            // one (ring watches CARGO_MANIFEST_DIR) would be rerun by each build in turn.
            for (name, _) in std::env::vars_os() {
                let name = name.to_string_lossy();
                if name.starts_with("CARGO_PKG_")
                    || name.starts_with("CARGO_BIN_")
                    || [
                        "CARGO_MANIFEST_DIR",
                        "CARGO_MANIFEST_PATH",
                        "CARGO_CRATE_NAME",
                        "CARGO_PRIMARY_PACKAGE",
                        "CARGO_TARGET_TMPDIR",
                        "CARGO_RUSTC_CURRENT_DIR",
                        "OUT_DIR",
                    ]
                    .contains(&&*name)
                {
                    build.env_remove(&*name);
                }
            }
            build
                .args(["build", "--quiet", "--example", "gateway"])
                .args(["--features", &features.join(",")])
                .arg("--target-dir")
                .arg(target_dir)
                .current_dir(env!("CARGO_MANIFEST_DIR"));
            match profile_dir.file_name().and_then(|n| n.to_str()) {
                Some("debug") => {}
                Some("release") => {
                    build.arg("--release");
                }
                Some(other) => {
                    build.args(["--profile", other]);
                }
                None => {}
            }
            let status = build.status().expect("run cargo build --example gateway");
            assert!(status.success(), "cargo build --example gateway failed");
            let path = profile_dir.join("examples").join("gateway");
            assert!(path.exists(), "{} missing after the build", path.display());
            path
        })
        .clone()
}

fn free_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind a free port");
    listener.local_addr().unwrap().port()
}

/// A keys file: a premium and a guest key, the guest with one slot and a short wait.
fn keys_toml(global: u32, guest_wait_ms: u64, extra: &str) -> String {
    format!(
        r#"
[[keys]]
key = "{PREMIUM_KEY}"
tenant = "team-premium"
tier = "premium"

[[keys]]
key = "{GUEST_KEY}"
tenant = "team-guest"
tier = "guest"

[limits]
global_max = {global}
retry_after_ms = 300
lease_ttl_ms = 5000

[[tiers]]
name = "guest"
cap = 1
max_wait_ms = {guest_wait_ms}

[[tiers]]
name = "premium"
cap = {global}
max_wait_ms = 30000
{extra}
"#
    )
}

/// A gateway process, SIGKILLed by its pid when dropped; its log goes to a file, printed
/// when a test fails.
struct Gateway {
    child: Child,
    port: u16,
    log: PathBuf,
}

impl Gateway {
    fn start(upstream: &str, keys: &str, redis: Option<&str>) -> Gateway {
        static N: AtomicUsize = AtomicUsize::new(0);
        let n = N.fetch_add(1, Ordering::SeqCst);
        let id = format!("gateway-{}-{n}", std::process::id());
        let keys_path = target_tmp().join(format!("{id}-keys.toml"));
        std::fs::write(&keys_path, keys).unwrap();
        for attempt in 0..3 {
            let port = free_port();
            let log = target_tmp().join(format!("{id}-{attempt}.log"));
            let mut cmd = Command::new(gateway_binary());
            cmd.args(["--listen", &format!("127.0.0.1:{port}")])
                .args(["--upstream", upstream])
                .arg("--keys")
                .arg(&keys_path)
                .env("ANTHROPIC_API_KEY", UPSTREAM_KEY)
                .env(
                    "RUST_LOG",
                    std::env::var("GATEWAY_LOG").unwrap_or_else(|_| "info".into()),
                )
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(File::create(&log).unwrap());
            if let Some(url) = redis {
                cmd.args(["--redis", url]);
            }
            let child = cmd.spawn().expect("start the gateway");
            let mut gateway = Gateway { child, port, log };
            if gateway.wait_ready(Duration::from_secs(20)) {
                return gateway;
            }
            eprintln!(
                "gateway did not start (attempt {attempt}):\n{}",
                gateway.log_text()
            );
        }
        panic!("the gateway did not start");
    }

    /// Polls `/healthz` until it answers 200; false if the process exits first.
    fn wait_ready(&mut self, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return false;
            }
            if let Ok(mut stream) = std::net::TcpStream::connect(("127.0.0.1", self.port)) {
                use std::io::Write;
                let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
                let _ = stream
                    .write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n");
                let mut answer = String::new();
                let _ = stream.read_to_string(&mut answer);
                if answer.starts_with("HTTP/1.1 200") {
                    return true;
                }
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        false
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    fn log_text(&self) -> String {
        let mut text = String::new();
        if let Ok(mut file) = File::open(&self.log) {
            let len = file.metadata().map(|m| m.len()).unwrap_or(0);
            let _ = file.seek(SeekFrom::Start(len.saturating_sub(8_000)));
            let _ = file.read_to_string(&mut text);
        }
        text
    }

    /// Sends SIGTERM by pid.
    fn terminate(&self) {
        let status = Command::new("kill")
            .args(["-s", "TERM", &self.child.id().to_string()])
            .status()
            .expect("run kill");
        assert!(status.success());
    }

    /// Waits up to `within` for the process to exit.
    fn wait_exit(&mut self, within: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    /// The Prometheus text of `/metrics`.
    async fn metrics(&self) -> String {
        client()
            .get(format!("{}/metrics", self.url()))
            .send()
            .await
            .expect("GET /metrics")
            .text()
            .await
            .unwrap()
    }

    /// `claude_slots_in_use`, summed over tiers.
    async fn slots_in_use(&self) -> f64 {
        metric_sum(&self.metrics().await, "claude_slots_in_use")
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!(
                "--- gateway log ({}) ---\n{}",
                self.log.display(),
                self.log_text()
            );
        }
    }
}

fn metric_sum(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|line| {
            line.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .pool_max_idle_per_host(0)
        .build()
        .unwrap()
}

fn messages_body(stream: bool) -> String {
    format!(
        r#"{{"model":"claude-mock-1","max_tokens":64,"stream":{stream},"messages":[{{"role":"user","content":"Hello"}}]}}"#
    )
}

async fn post_messages(
    gateway: &Gateway,
    key: &str,
    stream: bool,
) -> reqwest::Result<reqwest::Response> {
    client()
        .post(format!("{}/v1/messages", gateway.url()))
        .header("x-api-key", key)
        .header("anthropic-version", "2023-06-01")
        .header("content-type", "application/json")
        .body(messages_body(stream))
        .send()
        .await
}

async fn eventually(within: Duration, mut check: impl AsyncFnMut() -> bool) -> bool {
    let deadline = Instant::now() + within;
    loop {
        if check().await {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_arrive_byte_for_byte_and_headers_pass_both_ways() {
    let _serial = SERIAL.lock().await;
    let mock = MockAnthropic::start();
    let gateway = Gateway::start(&mock.url(), &keys_toml(8, 200, ""), None);

    // Non-streaming, with x-api-key.
    let response = client()
        .post(format!("{}/v1/messages", gateway.url()))
        .header("x-api-key", PREMIUM_KEY)
        .header("anthropic-version", "2023-06-01")
        .header("anthropic-beta", "output-128k-2025-02-19")
        .header("content-type", "application/json")
        .body(messages_body(false))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let headers = response.headers().clone();
    assert!(
        headers["request-id"]
            .to_str()
            .unwrap()
            .starts_with("req_mock_"),
        "{headers:?}"
    );
    assert_eq!(headers["anthropic-ratelimit-requests-limit"], "1000");
    assert_eq!(headers["anthropic-ratelimit-requests-remaining"], "999");
    assert_eq!(response.bytes().await.unwrap(), MESSAGE_JSON.as_bytes());

    let seen = mock.last_request().expect("the mock got the call");
    assert_eq!(seen.path, "/v1/messages");
    assert_eq!(seen.headers["x-api-key"], UPSTREAM_KEY, "the upstream key");
    assert_eq!(seen.headers.get_all("x-api-key").iter().count(), 1);
    assert!(seen.headers.get("authorization").is_none());
    assert_eq!(seen.headers["anthropic-version"], "2023-06-01");
    assert_eq!(seen.headers["anthropic-beta"], "output-128k-2025-02-19");
    assert_eq!(
        seen.body,
        messages_body(false).as_bytes(),
        "the body as sent"
    );
    let everything: String = format!("{:?}", seen.headers);
    assert!(
        !everything.contains(PREMIUM_KEY),
        "the client's key is not forwarded"
    );

    // Streaming, with Authorization: Bearer: the same bytes, arriving event by event.
    mock.set_event_gap(Duration::from_millis(40));
    let sent = Instant::now();
    let mut response = client()
        .post(format!("{}/v1/messages", gateway.url()))
        .header("authorization", format!("Bearer {PREMIUM_KEY}"))
        .header("anthropic-version", "2023-06-01")
        .body(messages_body(true))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["content-type"], "text/event-stream");
    assert!(response.headers().contains_key("request-id"));
    let mut body = Vec::new();
    let mut first_chunk = None;
    let mut chunks = 0;
    while let Some(chunk) = response.chunk().await.unwrap() {
        first_chunk.get_or_insert(sent.elapsed());
        chunks += 1;
        body.extend_from_slice(&chunk);
    }
    let total = sent.elapsed();
    assert_eq!(String::from_utf8(body).unwrap(), stream_body());
    let first_chunk = first_chunk.unwrap();
    assert!(
        chunks >= 5 && first_chunk + Duration::from_millis(250) < total,
        "events were forwarded as they came ({chunks} chunks, first at {first_chunk:?}, \
         last at {total:?}), not buffered"
    );
    assert!(
        mock.last_request()
            .unwrap()
            .headers
            .get("authorization")
            .is_none(),
        "the bearer token is not forwarded"
    );

    // Other /v1 paths are forwarded, authenticated by the same keys.
    let models = client()
        .get(format!("{}/v1/models", gateway.url()))
        .header("x-api-key", PREMIUM_KEY)
        .send()
        .await
        .unwrap();
    assert_eq!(models.status(), 200);
    assert!(models.text().await.unwrap().contains("claude-mock-1"));
    assert_eq!(
        mock.last_request().unwrap().headers["x-api-key"],
        UPSTREAM_KEY
    );
    let count = client()
        .post(format!("{}/v1/messages/count_tokens", gateway.url()))
        .header("x-api-key", PREMIUM_KEY)
        .body(messages_body(false))
        .send()
        .await
        .unwrap();
    assert_eq!(count.status(), 200);
    assert_eq!(count.text().await.unwrap(), r#"{"input_tokens":12}"#);

    // /healthz and /metrics.
    let health = client()
        .get(format!("{}/healthz", gateway.url()))
        .send()
        .await
        .unwrap();
    assert_eq!(health.status(), 200);
    let metrics = gateway.metrics().await;
    assert!(metrics.contains("claude_slots_in_use"), "{metrics}");
    assert!(
        metrics.contains("claude_request_latency_seconds"),
        "{metrics}"
    );
    assert!(!metrics.contains(PREMIUM_KEY));
    assert!(
        !gateway.log_text().contains(PREMIUM_KEY),
        "no key in the logs"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_or_missing_key_gets_401_in_anthropic_shape() {
    let _serial = SERIAL.lock().await;
    let mock = MockAnthropic::start();
    let gateway = Gateway::start(&mock.url(), &keys_toml(8, 200, ""), None);
    for (path, key) in [
        ("/v1/messages", Some("sk-nobody")),
        ("/v1/messages", None),
        ("/v1/models", Some("sk-nobody")),
        ("/v1/messages/count_tokens", None),
    ] {
        let mut request = client()
            .post(format!("{}{path}", gateway.url()))
            .body(messages_body(false));
        if path == "/v1/models" {
            request = client().get(format!("{}{path}", gateway.url()));
        }
        if let Some(key) = key {
            request = request.header("x-api-key", key);
        }
        let response = request.send().await.unwrap();
        assert_eq!(response.status(), 401, "{path} {key:?}");
        assert_eq!(response.headers()["content-type"], "application/json");
        let body = response.text().await.unwrap();
        assert!(
            body.starts_with(
                r#"{"type":"error","error":{"type":"authentication_error","message":"#
            ),
            "{body}"
        );
    }
    assert_eq!(mock.calls(), 0, "nothing unidentified reaches the upstream");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guest_flood_is_overloaded_while_premium_calls_succeed() {
    let _serial = SERIAL.lock().await;
    let mock = MockAnthropic::start();
    mock.set_delay(Duration::from_millis(400));
    let gateway = Gateway::start(&mock.url(), &keys_toml(4, 150, ""), None);

    let guests: Vec<_> = (0..8)
        .map(|_| {
            let url = gateway.url();
            tokio::spawn(async move {
                let response = client()
                    .post(format!("{url}/v1/messages"))
                    .header("x-api-key", GUEST_KEY)
                    .body(messages_body(false))
                    .send()
                    .await
                    .unwrap();
                let status = response.status().as_u16();
                let retry_after = response
                    .headers()
                    .get("retry-after")
                    .map(|v| v.to_str().unwrap().to_owned());
                (status, retry_after, response.text().await.unwrap())
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(50)).await;
    let premium: Vec<_> = (0..3)
        .map(|_| {
            let url = gateway.url();
            tokio::spawn(async move {
                let response = client()
                    .post(format!("{url}/v1/messages"))
                    .header("x-api-key", PREMIUM_KEY)
                    .body(messages_body(false))
                    .send()
                    .await
                    .unwrap();
                (response.status().as_u16(), response.text().await.unwrap())
            })
        })
        .collect();

    let (mut ok, mut overloaded) = (0, 0);
    for guest in guests {
        let (status, retry_after, body) = guest.await.unwrap();
        match status {
            200 => ok += 1,
            529 => {
                overloaded += 1;
                assert_eq!(
                    retry_after.as_deref(),
                    Some("1"),
                    "retry-after in whole seconds"
                );
                assert!(
                    body.starts_with(
                        r#"{"type":"error","error":{"type":"overloaded_error","message":"server busy"#
                    ),
                    "{body}"
                );
            }
            other => panic!("a guest got {other}: {body}"),
        }
    }
    for call in premium {
        let (status, body) = call.await.unwrap();
        assert_eq!(status, 200, "a premium call failed: {body}");
        assert_eq!(body, MESSAGE_JSON);
    }
    assert!(ok >= 1, "the guest's one slot served someone");
    assert!(
        overloaded >= 4,
        "the flood was refused: ok={ok} overloaded={overloaded}"
    );
    let metrics = gateway.metrics().await;
    assert!(metric_sum(&metrics, "claude_server_busy_total") >= overloaded as f64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_gone_mid_stream_cancels_the_upstream_call_and_frees_its_slot() {
    let _serial = SERIAL.lock().await;
    let mock = MockAnthropic::start();
    // 12 events 250 ms apart: about 3 s of stream.
    mock.set_event_gap(Duration::from_millis(250));
    let gateway = Gateway::start(&mock.url(), &keys_toml(8, 200, ""), None);

    let mut response = post_messages(&gateway, PREMIUM_KEY, true).await.unwrap();
    assert_eq!(response.status(), 200);
    let first = response.chunk().await.unwrap().expect("a first event");
    assert!(first.starts_with(b"event: message_start"));
    assert_eq!(mock.in_flight(), 1);
    assert_eq!(
        gateway.slots_in_use().await,
        1.0,
        "a stream holds its slot while it runs"
    );

    let dropped = Instant::now();
    drop(response);
    let gateway_ref = &gateway;
    assert!(
        eventually(Duration::from_millis(1_500), async || mock.in_flight() == 0).await,
        "the upstream call was not cancelled"
    );
    assert!(
        eventually(Duration::from_millis(1_000), async || {
            gateway_ref.slots_in_use().await == 0.0
        })
        .await,
        "the slot was not given back"
    );
    assert!(
        dropped.elapsed() < Duration::from_millis(2_500),
        "freed before the stream would have ended"
    );

    // A client that gives up before the answer's head: its call is dropped too.
    let gave_up = reqwest::Client::new()
        .post(format!("{}/v1/messages", gateway.url()))
        .header("x-api-key", PREMIUM_KEY)
        .header("x-mock-delay-ms", "3000")
        .timeout(Duration::from_millis(400))
        .body(messages_body(false))
        .send()
        .await;
    assert!(gave_up.is_err(), "the client timed out");
    let dropped = Instant::now();
    assert!(
        eventually(Duration::from_millis(1_500), async || {
            gateway_ref.slots_in_use().await == 0.0
        })
        .await,
        "the slot of a call dropped before its head was not given back"
    );
    assert!(
        eventually(Duration::from_millis(1_500), async || mock.in_flight() == 0).await,
        "the upstream call dropped before its head was not cancelled"
    );
    assert!(dropped.elapsed() < Duration::from_millis(2_000));

    // The slot is usable again: a full stream goes through.
    mock.set_event_gap(Duration::from_millis(1));
    let response = post_messages(&gateway, PREMIUM_KEY, true).await.unwrap();
    assert_eq!(response.text().await.unwrap(), stream_body());
    assert_eq!(gateway.slots_in_use().await, 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_429_is_retried_after_its_retry_after() {
    let _serial = SERIAL.lock().await;
    let mock = MockAnthropic::start();
    let gateway = Gateway::start(&mock.url(), &keys_toml(8, 200, ""), None);
    mock.push_reply(support::anthropic::Reply::RateLimited {
        retry_after_secs: 1,
    });
    let sent = Instant::now();
    let response = post_messages(&gateway, PREMIUM_KEY, false).await.unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(response.text().await.unwrap(), MESSAGE_JSON);
    assert!(
        sent.elapsed() >= Duration::from_millis(900),
        "waited as told"
    );
    assert_eq!(mock.calls(), 2, "the 429, then the retry");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_lets_a_stream_finish_then_the_gateway_exits() {
    let _serial = SERIAL.lock().await;
    let mock = MockAnthropic::start();
    mock.set_event_gap(Duration::from_millis(100));
    let mut gateway = Gateway::start(&mock.url(), &keys_toml(8, 200, ""), None);

    let mut response = post_messages(&gateway, PREMIUM_KEY, true).await.unwrap();
    let mut body = response.chunk().await.unwrap().unwrap().to_vec();
    gateway.terminate();
    while let Some(chunk) = response.chunk().await.unwrap() {
        body.extend_from_slice(&chunk);
    }
    assert_eq!(String::from_utf8(body).unwrap(), stream_body());
    let status = gateway
        .wait_exit(Duration::from_secs(10))
        .expect("the gateway exits after its streams");
    assert!(status.success(), "{status}");
    assert!(
        client()
            .get(format!("{}/healthz", gateway.url()))
            .send()
            .await
            .is_err(),
        "no longer accepting"
    );
    let log = gateway.log_text();
    assert!(log.contains("SIGTERM"), "{log}");
    assert!(log.contains("gateway stopped"), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gateways_on_redis_share_the_caps() {
    let _serial = SERIAL.lock().await;
    let redis = RedisServer::start();
    let mock = MockAnthropic::start();
    mock.set_delay(Duration::from_millis(100));
    let keys = keys_toml(3, 200, "");
    let a = Gateway::start(&mock.url(), &keys, Some(&redis.url()));
    let b = Gateway::start(&mock.url(), &keys, Some(&redis.url()));

    let calls: Vec<_> = (0..24)
        .map(|i| {
            let url = if i % 2 == 0 { a.url() } else { b.url() };
            tokio::spawn(async move {
                let response = client()
                    .post(format!("{url}/v1/messages"))
                    .header("x-api-key", PREMIUM_KEY)
                    .body(messages_body(i % 4 == 1))
                    .send()
                    .await
                    .unwrap();
                (response.status().as_u16(), response.text().await.unwrap())
            })
        })
        .collect();
    for call in calls {
        let (status, body) = call.await.unwrap();
        assert_eq!(status, 200, "{body}");
    }
    let max = mock.max_in_flight();
    assert!(
        max <= 3,
        "the mock saw {max} calls at once over a global cap of 3"
    );
    assert!(max >= 2, "both gateways sent calls at once (max {max})");
    eprintln!("two gateways, global cap 3: the mock saw at most {max} at once");
}

/// The official Anthropic Python SDK, from a venv under `target/` (created and filled with
/// `pip install anthropic` when missing). Skipped with a message when PyPI cannot be reached,
/// unless `CI` is set: there it must run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_sdk_against_the_gateway() {
    let _serial = SERIAL.lock().await;
    let Some(python) = sdk_python() else {
        return;
    };
    let mock = MockAnthropic::start();
    mock.set_delay(Duration::from_millis(150));
    mock.set_event_gap(Duration::from_millis(10));
    let gateway = Gateway::start(&mock.url(), &keys_toml(4, 100, ""), None);
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/python/sdk_gateway.py");
    let mut child = tokio::process::Command::new(python)
        .arg(&script)
        .env("GATEWAY_URL", gateway.url())
        .env("PREMIUM_KEY", PREMIUM_KEY)
        .env("GUEST_KEY", GUEST_KEY)
        .env("STREAM_TEXT", STREAM_TEXT.concat())
        .env("MESSAGE_TEXT", "Hello from the mock upstream.")
        .env_remove("ANTHROPIC_API_KEY")
        .env_remove("ANTHROPIC_BASE_URL")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("run the SDK script");
    let mut stdout = child.stdout.take().unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let out = async {
        use tokio::io::AsyncReadExt;
        let (mut out, mut err) = (String::new(), String::new());
        let _ = tokio::join!(
            stdout.read_to_string(&mut out),
            stderr.read_to_string(&mut err)
        );
        (out, err)
    };
    let ((out, err), status) = match tokio::time::timeout(Duration::from_secs(120), async {
        let out = out.await;
        (out, child.wait().await)
    })
    .await
    {
        Ok(done) => done,
        Err(_) => {
            let _ = child.kill().await;
            panic!("the SDK script took more than 120 s");
        }
    };
    let status = status.unwrap();
    eprintln!("{out}{err}");
    assert!(status.success(), "the SDK script failed:\n{out}\n{err}");
    assert!(out.contains(" passed, 0 failed"), "{out}");
}

/// A Python with the `anthropic` SDK installed, or `None` (with a message) when it cannot be
/// had outside CI.
fn sdk_python() -> Option<PathBuf> {
    let venv = target_tmp().join("anthropic-sdk-venv");
    let python = venv.join("bin").join("python");
    let has_sdk = |python: &PathBuf| {
        Command::new(python)
            .args(["-c", "import anthropic"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    if python.exists() && has_sdk(&python) {
        return Some(python);
    }
    let in_ci = std::env::var_os("CI").is_some_and(|v| !v.is_empty());
    let give_up = |why: String| -> Option<PathBuf> {
        if in_ci {
            panic!("the Python SDK test must run in CI: {why}");
        }
        eprintln!("SKIPPED python_sdk_against_the_gateway: {why}");
        None
    };
    if !python.exists() {
        let made = Command::new("python3")
            .args(["-m", "venv"])
            .arg(&venv)
            .status();
        match made {
            Ok(status) if status.success() => {}
            Ok(status) => return give_up(format!("`python3 -m venv` failed ({status})")),
            Err(e) => return give_up(format!("python3 is not available ({e})")),
        }
    }
    let pip = Command::new(&python)
        .args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
        ])
        .args(["--timeout", "30", "anthropic"])
        .status();
    match pip {
        Ok(status) if status.success() && has_sdk(&python) => Some(python),
        Ok(status) => give_up(format!(
            "`pip install anthropic` failed ({status}): is PyPI reachable?"
        )),
        Err(e) => give_up(format!("could not run pip ({e})")),
    }
}

#[test]
fn a_bad_command_line_or_keys_file_is_refused_at_start_with_a_clear_message() {
    let run = |args: &[&str], keys: Option<&str>| {
        let path = target_tmp().join(format!("bad-keys-{}.toml", std::process::id()));
        let mut cmd = Command::new(gateway_binary());
        cmd.args(args).env("ANTHROPIC_API_KEY", UPSTREAM_KEY);
        if let Some(keys) = keys {
            std::fs::write(&path, keys).unwrap();
            cmd.arg("--keys").arg(&path);
        }
        let out = cmd.output().expect("run the gateway");
        assert!(!out.status.success(), "{args:?} {keys:?} started");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let base = [
        "--listen",
        "127.0.0.1:0",
        "--upstream",
        "http://127.0.0.1:9",
    ];
    assert!(run(&["--listen", "127.0.0.1:0"], None).contains("--upstream is required"));
    assert!(
        run(&["--listen", "nowhere", "--upstream", "http://x"], None).contains("--listen nowhere")
    );
    assert!(run(&["--bogus"], None).contains("unknown argument `--bogus`"));
    let err = run(
        &base,
        Some("[[keys]]\nkey = \"sk-secret-1\"\ntenant = \"t\"\ntier = \"gold\"\n"),
    );
    assert!(err.contains("unknown tier `gold`"), "{err}");
    assert!(!err.contains("sk-secret-1"), "no key in the message: {err}");
    let err = run(
        &base,
        Some("[[keys]]\nkey = \"sk-secret-2\ntenant = \"t\"\n"),
    );
    assert!(err.contains("line 2"), "{err}");
    assert!(!err.contains("sk-secret-2"), "no key in the message: {err}");
    let err = run(
        &base,
        Some("[[keys]]\nkey = \"k\"\ntenant = \"t\"\ntiers = \"pro\"\n"),
    );
    assert!(err.contains("unknown field `tiers`"), "{err}");
    assert!(run(&base, Some("")).contains("no [[keys]]"));
}
