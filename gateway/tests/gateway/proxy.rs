//! The Anthropic-compatible gateway (`fairgate-gateway`) end to end: the program runs as a
//! real process (started as `docs/gateway/running.md` says, on free loopback ports), in
//! front of the mock Anthropic upstream (`support/anthropic.rs`), and is driven by a real
//! HTTP client and by the official Anthropic Python SDK. The attacks on it are in
//! `attacks.rs`.
//!
//! Every process is stopped by its pid when its guard drops, also when a test panics. The
//! tests run one at a time (two cores; the flood and disconnect checks are timed).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::support::RedisServer;
use crate::support::anthropic::{MESSAGE_JSON, MockAnthropic, STREAM_TEXT, stream_body};
use crate::support::gateway::*;

/// One test at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_arrive_byte_for_byte_and_headers_pass_both_ways() {
    let _turn = crate::support::file_turn(module_path!());
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
    assert_eq!(headers["anthropic-ratelimit-requests-limit"], "1000000");
    assert_eq!(headers["anthropic-ratelimit-requests-remaining"], "999999");
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

    // /healthz and /metrics, on the admin listener.
    let health = client()
        .get(format!("{}/healthz", gateway.admin_url()))
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
    let _turn = crate::support::file_turn(module_path!());
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
    let _turn = crate::support::file_turn(module_path!());
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

/// After a client left: its upstream call is cancelled within 1.5 s and its slot given
/// back within 1 s more.
async fn cancelled_and_freed(mock: &MockAnthropic, gateway: &Gateway) {
    assert!(
        eventually(Duration::from_millis(1_500), async || mock.in_flight() == 0).await,
        "the upstream call was not cancelled"
    );
    assert!(
        eventually(Duration::from_millis(1_000), async || {
            gateway.slots_in_use().await == 0.0
        })
        .await,
        "the slot was not given back"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_gone_mid_stream_cancels_the_upstream_call_and_frees_its_slot() {
    let _turn = crate::support::file_turn(module_path!());
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
    cancelled_and_freed(&mock, &gateway).await;
    assert!(
        dropped.elapsed() < Duration::from_millis(2_500),
        "freed before the stream would have ended"
    );
    let gateway_ref = &gateway;

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

/// `--upstream-http2`: the same answers over HTTP/2 (h2c to the mock), and a client that
/// leaves mid-stream still cancels its call (its stream reset, the slot given back).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_http2_answers_arrive_whole_and_a_client_gone_cancels_its_call() {
    let _turn = crate::support::file_turn(module_path!());
    let _serial = SERIAL.lock().await;
    let mock = MockAnthropic::start();
    let gateway = Gateway::start_with(
        &mock.url(),
        &keys_toml(8, 200, ""),
        None,
        &["--upstream-http2"],
    );
    let whole = post_messages(&gateway, PREMIUM_KEY, false).await.unwrap();
    assert_eq!(whole.status(), 200);
    assert_eq!(whole.text().await.unwrap(), MESSAGE_JSON);
    let streamed = post_messages(&gateway, PREMIUM_KEY, true).await.unwrap();
    assert_eq!(streamed.text().await.unwrap(), stream_body());
    let versions: Vec<_> = mock.requests().iter().map(|r| r.version).collect();
    assert_eq!(versions, [http::Version::HTTP_2; 2]);

    mock.set_event_gap(Duration::from_millis(250));
    let mut response = post_messages(&gateway, PREMIUM_KEY, true).await.unwrap();
    let first = response.chunk().await.unwrap().expect("a first event");
    assert!(first.starts_with(b"event: message_start"));
    assert_eq!(mock.in_flight(), 1);
    drop(response);
    cancelled_and_freed(&mock, &gateway).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_429_is_retried_after_its_retry_after() {
    let _turn = crate::support::file_turn(module_path!());
    let _serial = SERIAL.lock().await;
    let mock = MockAnthropic::start();
    let gateway = Gateway::start(&mock.url(), &keys_toml(8, 200, ""), None);
    mock.push_reply(crate::support::anthropic::Reply::RateLimited {
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

/// The rule: a stream its upstream cuts mid-way (inside an event) ends as the API ends a
/// stream it cannot finish: the whole events sent so far, never half of one, then an
/// `error` event, then the body's end (no broken chunked body); a client that asked for
/// gzip gets the stream uncompressed (the gateway asks the upstream for identity on
/// streams, so it can add the event).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_cut_by_its_upstream_ends_with_an_error_event() {
    let _turn = crate::support::file_turn(module_path!());
    let _serial = SERIAL.lock().await;
    let mock = MockAnthropic::start();
    let gateway = Gateway::start(&mock.url(), &keys_toml(8, 200, ""), None);
    let asked = [
        ("accept-encoding", "gzip, deflate"),
        ("x-mock-reply", "stream-cut"),
    ];
    let response = post_messages_at(&gateway.url(), PREMIUM_KEY, &asked, true)
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert!(response.headers().get("content-encoding").is_none());
    let text = response.text().await.expect("a whole body, not a cut one");
    let events: Vec<&str> = text.split("\n\n").filter(|e| !e.is_empty()).collect();
    assert_eq!(events.len(), 4, "{text}");
    assert!(events[0].starts_with("event: message_start"), "{text}");
    assert!(events[3].starts_with("event: error\ndata: "), "{text}");
    let error: serde_json::Value =
        serde_json::from_str(events[3].trim_start_matches("event: error\ndata: ")).unwrap();
    assert_eq!(error["error"]["type"], "api_error", "{error}");
    let asked = mock.last_request().unwrap();
    assert_eq!(asked.headers["accept-encoding"], "identity");
    assert_eq!(
        metric_sum(&gateway.metrics().await, "gateway_streams_cut_total"),
        1.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_lets_a_stream_finish_then_the_gateway_exits() {
    let _turn = crate::support::file_turn(module_path!());
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
            .get(format!("{}/v1/models", gateway.url()))
            .header("x-api-key", PREMIUM_KEY)
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
    let _turn = crate::support::file_turn(module_path!());
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
/// `pip install anthropic` when missing), against a gateway whose upstream is HTTP/1.1 and
/// one whose upstream is HTTP/2 (`--upstream-http2`). Skipped with a message when PyPI
/// cannot be reached, unless `CI` is set: there it must run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_sdk_against_the_gateway() {
    let _turn = crate::support::file_turn(module_path!());
    let _serial = SERIAL.lock().await;
    let Some(python) = sdk_python() else {
        return;
    };
    for http2 in [false, true] {
        let mock = MockAnthropic::start();
        mock.set_delay(Duration::from_millis(150));
        mock.set_event_gap(Duration::from_millis(10));
        // Batches' results_url names --public-url, which the SDK fetches itself.
        let mut flags = vec!["--public-url", "http://127.0.0.1:{port}"];
        if http2 {
            flags.push("--upstream-http2");
        }
        // The guest tier's refusals may be retried (the SDK's retries then see a flood
        // through); the free tier's (one slot, 100 ms of wait) say not to.
        let keys = keys_toml(4, 100, FREE_TIER)
            .replace("name = \"guest\"", "name = \"guest\"\nretry = true");
        let gateway = Gateway::start_with(&mock.url(), &keys, None, &flags);
        let over = if http2 { "HTTP/2" } else { "HTTP/1.1" };
        let (status, out, err) = sdk_script(&python, &gateway).await;
        eprintln!("upstream over {over}:\n{out}{err}");
        assert!(
            status.success(),
            "the SDK script failed over {over}:\n{out}\n{err}"
        );
        assert!(out.contains(" passed, 0 failed"), "{out}");
        // Every free call the SDK saw refused was refused once: it did not retry them.
        let refused: f64 = out
            .lines()
            .find_map(|line| line.strip_prefix("free refused ")?.trim().parse().ok())
            .expect("the script says how many free calls were refused");
        let metrics = gateway.metrics().await;
        let busy: f64 = metrics
            .lines()
            .filter(|l| l.starts_with("claude_server_busy_total{") && l.contains("tier=\"free\""))
            .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
            .sum();
        assert!(refused >= 1.0, "{out}");
        assert_eq!(
            busy, refused,
            "the gateway refused {busy} free calls, the SDK saw {refused}"
        );
        let requests = mock.requests();
        let wanted = if http2 {
            http::Version::HTTP_2
        } else {
            http::Version::HTTP_11
        };
        assert!(requests.iter().all(|request| request.version == wanted));
        // The script sends `workspace_id` with the batch results: never forwarded.
        for request in requests {
            assert!(
                request.headers.get("anthropic-workspace-id").is_none(),
                "anthropic-workspace-id reached the upstream on {} {}",
                request.method,
                request.path
            );
        }
    }
}

/// A free key on a tier of one slot and 100 ms of wait, whose refusals say not to retry.
const FREE_TIER: &str = r#"
[[keys]]
key = "sk-gw-free-1"
tenant = "team-free"
tier = "free"

[[tiers]]
name = "free"
cap = 1
max_wait_ms = 100
"#;

/// Runs `tests/python/sdk_gateway.py` with `python` against `gateway`: its exit status,
/// stdout and stderr (at most 120 s).
async fn sdk_script(
    python: &std::path::Path,
    gateway: &Gateway,
) -> (std::process::ExitStatus, String, String) {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/python/sdk_gateway.py");
    let mut child = tokio::process::Command::new(python)
        .arg(&script)
        .env("GATEWAY_URL", gateway.url())
        .env("PREMIUM_KEY", PREMIUM_KEY)
        .env("GUEST_KEY", GUEST_KEY)
        .env("FREE_KEY", "sk-gw-free-1")
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
    (status.unwrap(), out, err)
}

/// A Python with the `anthropic` SDK installed, or `None` (with a message) when it cannot be
/// had outside CI.
/// Held while the venv is made or a package installed into it: tests of several modules
/// ask for it at once, and two `python3 -m venv` on one directory (or a `pip` run while the
/// other is still making it) fail.
pub(crate) static PYTHON_SETUP: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Whether `python` imports `module`.
pub(crate) fn python_has(python: &Path, module: &str) -> bool {
    Command::new(python)
        .args(["-c", &format!("import {module}")])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// `pip install package` into `python`'s environment, quietly: whether it went well.
pub(crate) fn pip_install(python: &Path, package: &str) -> bool {
    Command::new(python)
        .args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
        ])
        .args(["--timeout", "30", package])
        .status()
        .is_ok_and(|s| s.success())
}

pub(crate) fn sdk_python() -> Option<PathBuf> {
    let _setup = PYTHON_SETUP
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let venv = target_tmp().join("anthropic-sdk-venv");
    let python = venv.join("bin").join("python");
    if python.exists() && python_has(&python, "anthropic") {
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
    if pip_install(&python, "anthropic") && python_has(&python, "anthropic") {
        return Some(python);
    }
    give_up("`pip install anthropic` failed: is PyPI reachable?".to_owned())
}

#[test]
fn a_bad_command_line_or_keys_file_is_refused_at_start_with_a_clear_message() {
    let _turn = crate::support::file_turn(module_path!());
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
    let err = run(&["--listen", "127.0.0.1:0"], None);
    assert!(
        err.contains("required arguments were not provided") && err.contains("--keys <FILE>"),
        "{err}"
    );
    let err = run(&["--listen", "nowhere", "--upstream", "http://x"], None);
    assert!(err.contains("'nowhere' for '--listen <ADDR>'"), "{err}");
    let err = run(&["--bogus"], None);
    assert!(err.contains("unexpected argument '--bogus'"), "{err}");
    let err = run(&["--listen", "127.0.0.1:0", "--upstream", "ftp://x"], None);
    assert!(err.contains("give an http:// or https:// URL"), "{err}");
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
        Some("[[keys]]\nkey = \"k\"\ntenant = \"t\"\nweight = 3\n"),
    );
    assert!(err.contains("unknown field `weight`"), "{err}");
    assert!(run(&base, Some("")).contains("no [[keys]]"));
}
