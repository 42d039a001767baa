//! What a newcomer meets in the first hour, as real processes: the README's quickstart is
//! `examples/first_call.rs` and calls an Anthropic-shaped endpoint (the mock) with its
//! headers; the gateway's log file carries no terminal escape codes, and `--log-format json`
//! writes one JSON object a line; `/metrics` right after start has every family described
//! and typed, latencies as histograms, and every metric the README lists; the gateway's own
//! answers carry a `request-id` and `529 Overloaded`.
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
    let readme = include_str!("../../README.md");
    let example = include_str!("../../examples/first_call.rs");
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
