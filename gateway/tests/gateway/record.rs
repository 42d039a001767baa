//! The gateway's `--record FILE`: a real gateway process in front of the mock upstream,
//! a small mixed load (premium and guest keys, streaming and not, guests refused `529`
//! from a full tier), and the file it writes: one valid JSON line per call with every
//! field, the statuses the clients got, the answers' real usage, and no key or tenant name
//! in clear.
//!
//! `FAIRGATE_UPDATE_FIXTURES=1` copies the recording to the simulator's
//! `tests/fixtures/gateway_record.jsonl`, the recording its `tests/replay.rs` replays.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::support::anthropic::MockAnthropic;
use crate::support::gateway::*;
use serde_json::Value;
use sha2::{Digest, Sha256};

/// Rounds of the load; each sends 3 guest calls and 2 premium calls (one streamed) at once.
const ROUNDS: usize = 10;

fn tenant_hash(name: &str) -> String {
    Sha256::digest(name.as_bytes())[..8]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_admitted_call_is_one_json_line_with_its_usage_and_no_name_in_clear() {
    let _turn = crate::support::file_turn(module_path!());
    let mock = MockAnthropic::start();
    mock.set_delay(Duration::from_millis(300));
    let file = target_tmp().join(format!("record-{}.jsonl", std::process::id()));
    let record = file.to_str().unwrap().to_owned();
    // The guest tier has one slot and waits 100 ms: two of every three guests are refused.
    let gateway = Gateway::start_with(
        &mock.url(),
        &keys_toml_with_guest_cap(8, 1, 100, ""),
        None,
        &["--record", &record],
    );

    // What the clients got, per (tier, status).
    let mut got: BTreeMap<(&str, u16), usize> = BTreeMap::new();
    for _ in 0..ROUNDS {
        let mut calls = Vec::new();
        for (tier, key, stream) in [
            ("guest", GUEST_KEY, false),
            ("guest", GUEST_KEY, false),
            ("guest", GUEST_KEY, false),
            ("premium", PREMIUM_KEY, false),
            ("premium", PREMIUM_KEY, true),
        ] {
            let gateway = &gateway;
            calls.push(async move {
                let response = post_messages(gateway, key, stream).await.unwrap();
                let status = response.status().as_u16();
                let body = response.bytes().await.unwrap();
                if status == 200 && !stream {
                    let answer: Value = serde_json::from_slice(&body).unwrap();
                    assert_eq!(answer["usage"]["output_tokens"], 7);
                }
                (tier, status)
            });
        }
        for (tier, status) in futures_util::future::join_all(calls).await {
            *got.entry((tier, status)).or_default() += 1;
        }
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    let calls = ROUNDS * 5;
    assert!(
        got.get(&("guest", 529)).copied().unwrap_or(0) > 0,
        "a full guest tier refuses some calls: {got:?}"
    );

    // The writer flushes when it has nothing waiting.
    let read = || std::fs::read_to_string(&file).unwrap_or_default();
    assert!(
        eventually(Duration::from_secs(5), async || read().lines().count()
            >= calls)
        .await,
        "{} lines of {calls}:\n{}",
        read().lines().count(),
        read()
    );
    let text = read();
    for secret in [PREMIUM_KEY, GUEST_KEY, "team-premium", "team-guest"] {
        assert!(!text.contains(secret), "{secret} in clear in the recording");
    }
    let lines: Vec<Value> = text
        .lines()
        .map(|line| serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}")))
        .collect();
    assert_eq!(lines.len(), calls, "one line per call");

    let mut recorded: BTreeMap<(&str, u16), usize> = BTreeMap::new();
    let (mut plain, mut streamed) = (0, 0);
    for line in &lines {
        let fields = line.as_object().unwrap();
        let mut names: Vec<&str> = fields.keys().map(String::as_str).collect();
        names.sort_unstable();
        assert_eq!(
            names,
            [
                "at_ms",
                "est_input_tokens",
                "input_tokens",
                "latency_ms",
                "origin",
                "output_tokens",
                "sla_ms",
                "status",
                "tenant",
                "tier",
                "upstream_ms"
            ],
            "{line}"
        );
        assert!(
            line["at_ms"].is_u64() && line["latency_ms"].is_u64(),
            "{line}"
        );
        assert!(line["est_input_tokens"].as_u64().unwrap() > 0, "{line}");
        assert_eq!(line["origin"], "user");
        assert!(line["sla_ms"].is_null());
        let tier = match line["tier"].as_str().unwrap() {
            "premium" => "premium",
            "guest" => "guest",
            other => panic!("tier {other}"),
        };
        assert_eq!(line["tenant"], tenant_hash(&format!("team-{tier}")));
        let status = line["status"].as_u64().unwrap() as u16;
        *recorded.entry((tier, status)).or_default() += 1;
        if status == 200 {
            let upstream = line["upstream_ms"].as_u64().expect("served: dispatched");
            assert!(upstream >= 300, "the upstream took 300 ms at least: {line}");
            assert!(upstream <= line["latency_ms"].as_u64().unwrap(), "{line}");
            assert_eq!(line["input_tokens"], 12, "{line}");
            match line["output_tokens"].as_u64() {
                Some(7) => plain += 1,    // a JSON answer's usage
                Some(5) => streamed += 1, // a stream's message_delta
                other => panic!("output tokens {other:?}: {line}"),
            }
        } else {
            assert_eq!(status, 529, "{line}");
            assert!(
                line["upstream_ms"].is_null(),
                "refused before dispatch: {line}"
            );
            assert!(line["input_tokens"].is_null() && line["output_tokens"].is_null());
            assert!(
                line["latency_ms"].as_u64().unwrap() >= 100,
                "waited: {line}"
            );
        }
    }
    assert_eq!(recorded, got, "the statuses the clients got");
    assert_eq!(streamed, ROUNDS, "every streamed call's usage");
    assert!(plain >= ROUNDS, "every JSON answer's usage");
    assert_eq!(
        metric_sum(&gateway.metrics().await, "gateway_record_dropped_total"),
        0.0
    );

    if std::env::var_os("FAIRGATE_UPDATE_FIXTURES").is_some() {
        let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../simulator/tests/fixtures/gateway_record.jsonl");
        std::fs::create_dir_all(fixture.parent().unwrap()).unwrap();
        std::fs::write(&fixture, &text).unwrap();
        eprintln!("wrote {}", fixture.display());
    }
}
