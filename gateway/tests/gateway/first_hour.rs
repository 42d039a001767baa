//! What a newcomer meets in the first hour, as real processes: the README's quickstart is
//! `examples/first_call.rs` and calls an Anthropic-shaped endpoint (the mock) with its
//! headers; the gateway's log file carries no terminal escape codes, and `--log-format json`
//! writes one JSON object a line; `/metrics` right after start has every family described
//! and typed, latencies as histograms, and every metric the README lists; the gateway's own
//! answers carry a `request-id` and `529 Overloaded`; the live page reads class latency
//! from the histograms.
//!
//! Processes are stopped by their pid when their guards drop; every wait is bounded.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::support::anthropic::MockAnthropic;
use crate::support::example_binary;
use crate::support::gateway::*;

/// Runs `cmd` to its end, killing it past `within`: its status and stdout.
fn run_bounded(cmd: &mut Command, within: Duration) -> (std::process::ExitStatus, String) {
    let out = crate::support::gateway::target_tmp().join(format!(
        "first-hour-{}-{:?}.out",
        std::process::id(),
        std::thread::current().id()
    ));
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out).unwrap())
        .spawn()
        .expect("start the program");
    let deadline = Instant::now() + within;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("still running after {within:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    (status, std::fs::read_to_string(&out).unwrap_or_default())
}

#[test]
fn the_readme_quickstart_is_a_whole_program_that_calls_the_messages_api_with_its_headers() {
    let _turn = crate::support::file_turn(module_path!());
    let readme = include_str!("../../../README.md");
    let example = include_str!("../../../examples/first_call.rs");
    let block = readme
        .split("## Quickstart\n")
        .nth(1)
        .and_then(|section| section.split("```rust,no_run\n").nth(1))
        .and_then(|block| block.split("```\n").next());
    assert_eq!(
        block,
        Some(example),
        "the README's quickstart block is examples/first_call.rs, byte for byte"
    );

    let mock = MockAnthropic::start();
    let (status, stdout) = run_bounded(
        Command::new(example_binary("first_call"))
            .env("ANTHROPIC_BASE_URL", mock.url())
            .env("ANTHROPIC_API_KEY", "sk-ant-readme")
            .env_remove("RUST_LOG"),
        Duration::from_secs(30),
    );
    assert!(status.success(), "{status}: {stdout}");
    assert!(stdout.starts_with("200 OK "), "{stdout}");
    assert!(stdout.contains("Hello from the mock upstream."), "{stdout}");
    let request = mock.last_request().expect("the mock was called");
    assert_eq!(request.path, "/v1/messages");
    assert_eq!(request.headers["x-api-key"], "sk-ant-readme");
    assert_eq!(request.headers["anthropic-version"], "2023-06-01");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_log_file_has_no_colour_codes_when_stderr_is_not_a_terminal() {
    let _turn = crate::support::file_turn(module_path!());
    let mock = MockAnthropic::start();
    let gateway = Gateway::start(&mock.url(), &keys_toml(8, 100, ""), None);
    let answer = post_messages(&gateway, PREMIUM_KEY, false).await.unwrap();
    assert_eq!(answer.status(), 200);
    let log = std::fs::read_to_string(&gateway.log).unwrap();
    assert!(log.contains("gateway listening"), "{log}");
    assert!(
        !log.contains('\x1b'),
        "escape codes in the log file:\n{log:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn log_format_json_writes_one_json_object_a_line() {
    let _turn = crate::support::file_turn(module_path!());
    let mock = MockAnthropic::start();
    let gateway = Gateway::start_with(
        &mock.url(),
        &keys_toml(8, 100, ""),
        None,
        &["--log-format", "json"],
    );
    let answer = post_messages(&gateway, PREMIUM_KEY, false).await.unwrap();
    assert_eq!(answer.status(), 200);
    let log = std::fs::read_to_string(&gateway.log).unwrap();
    let mut listening = false;
    for line in log.lines() {
        let event: serde_json::Value = serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("not a JSON line ({e}): {line:?}"));
        assert!(event["level"].is_string(), "{line}");
        listening |= event["fields"]["message"] == "gateway listening";
    }
    assert!(listening, "no `gateway listening` event:\n{log}");
}

/// The histograms the crate publishes: each must be a Prometheus histogram with buckets.
const HISTOGRAMS: [&str; 4] = fairgate::metrics::HISTOGRAMS;

/// The metric names the guide writes (`claude_*`, `gateway_*` in backticks, in
/// `docs/observability.md`).
fn readme_metric_names() -> Vec<String> {
    let readme = include_str!("../../../docs/observability.md");
    let mut names: Vec<String> = readme
        .split('`')
        .skip(1)
        .step_by(2)
        .filter_map(|code| {
            let name = code.split(['{', ' ', '(']).next()?;
            // `gateway_bench` is an example's name, not a metric.
            let known = (name.starts_with("claude_") || name.starts_with("gateway_"))
                && name != "gateway_bench";
            let metric = name.len() > "claude_".len()
                && name.bytes().all(|b| b.is_ascii_lowercase() || b == b'_');
            (known && metric).then(|| name.to_owned())
        })
        .collect();
    names.sort();
    names.dedup();
    names
}

/// Every family of a Prometheus text: name -> (TYPE, has HELP).
fn families(text: &str) -> std::collections::BTreeMap<String, (String, bool)> {
    let mut families = std::collections::BTreeMap::<String, (String, bool)>::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap();
            families.entry(name.to_owned()).or_default().0 = kind.to_owned();
        } else if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, help) = rest.split_once(' ').unwrap_or((rest, ""));
            families.entry(name.to_owned()).or_default().1 = !help.trim().is_empty();
        }
    }
    families
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_right_after_start_are_described_typed_histograms_and_every_one_the_readme_lists() {
    let _turn = crate::support::file_turn(module_path!());
    let mock = MockAnthropic::start();
    let gateway = Gateway::start(&mock.url(), &keys_toml(8, 100, ""), None);
    let text = gateway.metrics().await;
    let families = families(&text);

    for line in text
        .lines()
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
    {
        let series = line.split(['{', ' ']).next().unwrap();
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|suffix| {
                let base = series.strip_suffix(suffix)?;
                families.contains_key(base).then_some(base)
            })
            .unwrap_or(series);
        assert!(families.contains_key(family), "{series}: no # TYPE\n{text}");
    }
    for (name, (kind, help)) in &families {
        assert!(*help, "{name}: no # HELP\n{text}");
        assert!(!kind.is_empty(), "{name}: no # TYPE\n{text}");
    }
    for name in HISTOGRAMS {
        assert_eq!(
            families.get(name).map(|(kind, _)| kind.as_str()),
            Some("histogram"),
            "{name}\n{text}"
        );
        // Buckets for LLM calls: 10 ms to 10 minutes.
        for le in ["0.01", "600"] {
            let bucket = format!("le=\"{le}\"");
            assert!(
                text.lines()
                    .any(|l| l.starts_with(&format!("{name}_bucket")) && l.contains(&bucket)),
                "{name}: no bucket {le}\n{text}"
            );
        }
    }
    for outcome in ["answered", "refused", "failed"] {
        assert!(
            text.contains(&format!("outcome=\"{outcome}\"")),
            "no latency series for outcome {outcome}\n{text}"
        );
    }
    let readme = readme_metric_names();
    assert!(readme.len() >= 25, "{readme:?}");
    for name in readme {
        // A learned limit has no value before it is learned (0 would read as a limit of 0).
        if name == fairgate::metrics::LEARNED_LIMIT {
            continue;
        }
        assert!(
            families.contains_key(&name),
            "{name} absent at start\n{text}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn promtool_check_metrics_passes_on_a_scrape_after_start_and_after_calls() {
    let _turn = crate::support::file_turn(module_path!());
    let promtool = std::path::Path::new("/usr/bin/promtool");
    if !promtool.exists() {
        assert!(
            std::env::var_os("CI").is_none(),
            "no promtool: scripts/test installs Debian's prometheus"
        );
        eprintln!(
            "SKIPPED: promtool is absent (Debian's `prometheus` package; scripts/test installs it)"
        );
        return;
    }
    let mock = MockAnthropic::start();
    let gateway = Gateway::start(&mock.url(), &keys_toml(8, 100, ""), None);
    let mut scrapes = vec![gateway.metrics().await];
    // After an answer, a refusal (unknown key) and a refused tier, with samples in the
    // histograms.
    assert_eq!(
        post_messages(&gateway, PREMIUM_KEY, false)
            .await
            .unwrap()
            .status(),
        200
    );
    assert_eq!(
        post_messages(&gateway, "sk-unknown", false)
            .await
            .unwrap()
            .status(),
        401
    );
    scrapes.push(gateway.metrics().await);
    for text in scrapes {
        promtool_lint(&text);
    }
}

/// `POST /v1/messages` over a fresh connection with `key`: the raw answer's head and body.
fn raw_post_messages(port: u16, key: &str) -> String {
    use std::io::{Read, Write};
    let body = messages_body(false);
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    write!(
        stream,
        "POST /v1/messages HTTP/1.1\r\nhost: x\r\nx-api-key: {key}\r\n\
         anthropic-version: 2023-06-01\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut answer = String::new();
    let _ = stream.read_to_string(&mut answer);
    answer
}

fn request_id(head: &str) -> Option<&str> {
    head.lines()
        .find_map(|line| line.strip_prefix("request-id: "))
        .map(str::trim)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateways_own_answers_carry_a_request_id_and_529_its_reason_phrase() {
    let _turn = crate::support::file_turn(module_path!());
    let mock = MockAnthropic::start();
    // One guest slot, 100 ms of wait: a second guest call while the first is out is 529.
    let gateway = Gateway::start(&mock.url(), &keys_toml(8, 100, ""), None);
    let port = gateway.port;

    let unknown = tokio::task::spawn_blocking(move || {
        [
            raw_post_messages(port, "sk-unknown"),
            raw_post_messages(port, "sk-unknown-too"),
            raw_get(port, "/v1/nothing-here"),
        ]
    })
    .await
    .unwrap();
    assert!(
        unknown[0].starts_with("HTTP/1.1 401 Unauthorized\r\n"),
        "{}",
        unknown[0]
    );
    assert!(
        unknown[2].starts_with("HTTP/1.1 404 Not Found\r\n"),
        "{}",
        unknown[2]
    );
    let ids: Vec<&str> = unknown
        .iter()
        .map(|answer| request_id(answer).unwrap_or_else(|| panic!("no request-id:\n{answer}")))
        .collect();
    for id in &ids {
        assert!(
            id.starts_with("req_fairgate_") && id.len() > "req_fairgate_".len() + 8,
            "{id}"
        );
    }
    assert!(ids[0] != ids[1] && ids[1] != ids[2], "ids repeat: {ids:?}");

    mock.set_delay(Duration::from_secs(3));
    let first = tokio::spawn({
        let url = gateway.url();
        async move {
            client()
                .post(format!("{url}/v1/messages"))
                .header("x-api-key", GUEST_KEY)
                .header("anthropic-version", "2023-06-01")
                .header("content-type", "application/json")
                .body(messages_body(false))
                .send()
                .await
                .map(|r| r.status())
        }
    });
    let mock_in_flight = {
        let mock = &mock;
        std::thread::scope(|s| {
            s.spawn(|| mock.wait_in_flight(1, Duration::from_secs(10)))
                .join()
                .unwrap()
        })
    };
    assert!(
        mock_in_flight,
        "the first guest call never reached the upstream"
    );
    let busy = tokio::task::spawn_blocking(move || raw_post_messages(port, GUEST_KEY))
        .await
        .unwrap();
    assert!(busy.starts_with("HTTP/1.1 529 Overloaded\r\n"), "{busy}");
    assert!(busy.contains("overloaded_error"), "{busy}");
    let id = request_id(&busy).unwrap_or_else(|| panic!("no request-id:\n{busy}"));
    assert!(id.starts_with("req_fairgate_"), "{id}");
    mock.set_delay(Duration::ZERO);
    assert_eq!(first.await.unwrap().unwrap(), 200);

    // Each refusal is one log line with the id its client was told; a refusal of the stack
    // names the tenant, the tier and the reason.
    let log = std::fs::read_to_string(&gateway.log).unwrap();
    let line = |id: &str| {
        let lines: Vec<&str> = log.lines().filter(|l| l.contains(id)).collect();
        assert_eq!(lines.len(), 1, "one line for {id}:\n{log}");
        lines[0].to_owned()
    };
    for (id, status) in ids.iter().zip(["401", "401", "404"]) {
        let line = line(id);
        assert!(line.contains("refused") && line.contains(status), "{line}");
    }
    let line = line(id);
    for part in [
        "refused",
        "529",
        "messages",
        "team-guest",
        "tier=\"guest\"",
        "server busy",
    ] {
        assert!(line.contains(part), "{part} missing: {line}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_live_page_reads_the_latency_of_answered_calls_from_the_histograms() {
    let _turn = crate::support::file_turn(module_path!());
    let mock = MockAnthropic::start();
    let gateway = Gateway::start(&mock.url(), &keys_toml(8, 100, ""), None);
    let live: serde_json::Value = serde_json::from_str(&gateway.admin("/live").await).unwrap();
    let critical = |live: &serde_json::Value| {
        live["classes"]
            .as_array()
            .and_then(|classes| classes.iter().find(|c| c["class"] == "critical").cloned())
            .unwrap_or_else(|| panic!("no critical class: {live}"))
    };
    assert!(
        critical(&live)["p50_ms"].is_null(),
        "nothing answered yet: {live}"
    );
    assert_eq!(
        post_messages(&gateway, PREMIUM_KEY, false)
            .await
            .unwrap()
            .status(),
        200
    );
    let live: serde_json::Value = serde_json::from_str(&gateway.admin("/live").await).unwrap();
    let p50 = critical(&live)["p50_ms"].as_f64();
    assert!(p50.is_some_and(|ms| ms > 0.0 && ms < 60_000.0), "{live}");
}

/// `promtool check metrics` on a scrape (skipped without promtool outside CI). Exit 3 is
/// lint problems only (1: the text does not parse). One lint is known and kept:
/// `claude_throttle_count` is the reference's name (DESIGN.md §6), a gauge whose `_count`
/// promtool reads as a histogram's.
pub(crate) fn promtool_lint(text: &str) {
    use std::io::Write;
    use std::process::{Command, Stdio};
    let promtool = std::path::Path::new("/usr/bin/promtool");
    if !promtool.exists() {
        assert!(std::env::var_os("CI").is_none(), "no promtool");
        eprintln!("SKIPPED the promtool lint: promtool is absent");
        return;
    }
    let mut check = Command::new(promtool)
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run promtool");
    check
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = check.wait_with_output().unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let problems: Vec<&str> = said
        .lines()
        .filter(|line| !line.trim().is_empty())
        .filter(|line| !line.starts_with("claude_throttle_count non-histogram"))
        .collect();
    assert!(
        matches!(out.status.code(), Some(0 | 3)) && problems.is_empty(),
        "promtool check metrics: {}\n{said}",
        out.status
    );
}
