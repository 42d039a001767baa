//! `GET /usage` on the admin listener: what each tenant used per UTC day, as the answers'
//! `usage` said it, compressed or not — in one process, as the official Python SDK reads
//! it at its defaults, and for a fleet of gateways on one Redis.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use serde_json::Value;

use crate::support::RedisServer;
use crate::support::anthropic::MockAnthropic;
use crate::support::gateway::*;

const TOKEN: &str = "admin-token-for-usage-0123456789";

/// The mock's answers: a message says 12 input and 7 output tokens; a stream 12 and 5.
const MESSAGE: (u64, u64) = (12, 7);
const STREAM: (u64, u64) = (12, 5);

async fn usage(gateway: &Gateway, query: &str) -> (u16, String) {
    let response = client()
        .get(format!("{}/usage{query}", gateway.admin_url()))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    (response.status().as_u16(), response.text().await.unwrap())
}

/// The rows `/usage` answers for `query`.
async fn rows(gateway: &Gateway, query: &str) -> Vec<Value> {
    let (status, body) = usage(gateway, query).await;
    assert_eq!(status, 200, "{body}");
    let parsed: Value = serde_json::from_str(&body).unwrap();
    parsed["usage"].as_array().unwrap().clone()
}

/// `tenant`'s (input, output, calls) in `rows`, or zeros.
fn counts(rows: &[Value], tenant: &str) -> (u64, u64, u64) {
    rows.iter()
        .filter(|row| row["tenant"] == tenant)
        .map(|row| {
            let n = |name: &str| row[name].as_u64().unwrap();
            (n("input_tokens"), n("output_tokens"), n("calls"))
        })
        .fold((0, 0, 0), |a, b| (a.0 + b.0, a.1 + b.1, a.2 + b.2))
}

async fn call(gateway: &Gateway, key: &str, stream: bool) {
    let answer = post_messages(gateway, key, stream).await.unwrap();
    assert_eq!(answer.status(), 200);
    answer.bytes().await.unwrap();
}

fn start(mock: &MockAnthropic, redis: Option<&str>) -> Gateway {
    Gateway::start_with(
        &mock.url(),
        &keys_toml(8, 200, ""),
        redis,
        &["--admin-token", TOKEN],
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_tenants_tokens_and_calls_of_the_day_as_json_and_json_lines() {
    let _turn = crate::support::file_turn(module_path!());
    let mock = MockAnthropic::start();
    let gateway = start(&mock, None);
    call(&gateway, PREMIUM_KEY, false).await;
    call(&gateway, PREMIUM_KEY, false).await;
    call(&gateway, PREMIUM_KEY, true).await;
    call(&gateway, GUEST_KEY, false).await;

    let premium = (2 * MESSAGE.0 + STREAM.0, 2 * MESSAGE.1 + STREAM.1, 3);
    let settled = eventually(Duration::from_secs(5), async || {
        counts(&rows(&gateway, "").await, "team-premium") == premium
    })
    .await;
    assert!(settled, "{:?}", usage(&gateway, "").await);
    let all = rows(&gateway, "").await;
    assert_eq!(counts(&all, "team-guest"), (MESSAGE.0, MESSAGE.1, 1));
    assert_eq!(all.len(), 2, "{all:?}");
    let today = all[0]["day"].as_str().unwrap().to_owned();
    assert_eq!(today.len(), 10, "{today}");

    // Filters: the day, the tenant; an empty day.
    let guest = rows(&gateway, &format!("?day={today}&tenant=team-guest")).await;
    assert_eq!(guest.len(), 1);
    assert_eq!(guest[0]["tenant"], "team-guest");
    assert!(rows(&gateway, "?day=2001-01-01").await.is_empty());
    // JSON lines: one tenant-day a line.
    let (status, lines) = usage(&gateway, "?format=jsonl").await;
    assert_eq!(status, 200);
    let lines: Vec<Value> = lines
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines, all);
    // What it cannot read is refused; without the token, nothing.
    assert_eq!(usage(&gateway, "?day=yesterday").await.0, 400);
    assert_eq!(usage(&gateway, "?limit=3").await.0, 400);
    let anonymous = client()
        .get(format!("{}/usage", gateway.admin_url()))
        .send()
        .await
        .unwrap();
    assert_eq!(anonymous.status(), 401);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sdks_usage_is_what_usage_bills() {
    let _turn = crate::support::file_turn(module_path!());
    let Some(python) = crate::proxy::sdk_python() else {
        return;
    };
    let mock = MockAnthropic::start();
    let gateway = start(&mock, None);
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/python/sdk_usage.py");
    let run = tokio::process::Command::new(python)
        .arg(&script)
        .env("GATEWAY_URL", gateway.url())
        .env("API_KEY", PREMIUM_KEY)
        .env_remove("ANTHROPIC_API_KEY")
        .env_remove("ANTHROPIC_BASE_URL")
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(60), run)
        .await
        .expect("the SDK script ends within 60 s")
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let told: Value = serde_json::from_str(text.trim()).unwrap();
    let n = |name: &str| told[name].as_u64().unwrap();
    let sdk = (n("input_tokens"), n("output_tokens"), n("calls"));
    assert_eq!(sdk.2, 3);
    // The SDK at its defaults asked for gzip, so the upstream compressed the two messages;
    // the stream the gateway asks for uncompressed (to end it as the API does if cut).
    let calls = mock.requests();
    assert_eq!(calls.len(), 3);
    let accepted: Vec<&str> = (calls.iter())
        .map(|call| call.headers["accept-encoding"].to_str().unwrap())
        .collect();
    assert!(
        accepted[..2].iter().all(|a| a.contains("gzip")),
        "{accepted:?}"
    );
    assert_eq!(accepted[2], "identity");
    let billed = eventually(Duration::from_secs(5), async || {
        counts(
            &rows(&gateway, "?tenant=team-premium").await,
            "team-premium",
        ) == sdk
    })
    .await;
    assert!(
        billed,
        "SDK {sdk:?}, /usage {:?}",
        usage(&gateway, "").await
    );
}

/// The rule: an answer the upstream compressed (the API compresses for a client that asks,
/// and the official SDKs ask for gzip) is settled on its usage as any other: `/usage`
/// bills what the answers said, and the daily budget moves by their input tokens, not by
/// the estimate (a 7,000-byte prompt is estimated at 2,000 tokens; the mock says it used
/// 12). Streams, asked of the upstream uncompressed, count the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compressed_answer_is_billed_and_budgeted_on_its_usage() {
    let _turn = crate::support::file_turn(module_path!());
    let mock = MockAnthropic::start();
    let gateway = start(&mock, None);
    let prompt = "x".repeat(7_000);
    let mut told = Vec::new();
    for stream in [false, false, false, true, true, true] {
        let body = format!(
            r#"{{"model":"claude-mock-1","max_tokens":64,"stream":{stream},"messages":[{{"role":"user","content":"{prompt}"}}]}}"#
        );
        let estimate = (body.len() as u64 * 2).div_ceil(7);
        let answer = client()
            .post(format!("{}/v1/messages", gateway.url()))
            .header("x-api-key", PREMIUM_KEY)
            .header("content-type", "application/json")
            .header("accept-encoding", "gzip, deflate")
            .body(body)
            .send()
            .await
            .unwrap();
        assert_eq!(answer.status(), 200);
        // A message comes compressed, relayed as sent; a stream is asked for uncompressed.
        let encoding = answer.headers().get("content-encoding");
        assert_eq!(encoding.is_some(), !stream, "{encoding:?}");
        let left: u64 = answer.headers()["x-fairgate-budget-remaining"]
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        told.push((left, estimate));
        let bytes = answer.bytes().await.unwrap();
        assert_eq!(
            bytes[..2] == [0x1f, 0x8b],
            !stream,
            "gzip reached the client"
        );
    }
    // Each answer's header counts its own call at the estimate and those before it at
    // their usage (12 input tokens each).
    for (k, (left, estimate)) in told.iter().enumerate() {
        assert_eq!(
            *left,
            100_000 - 12 * k as u64 - estimate,
            "call {k}: {told:?}"
        );
    }
    let billed = eventually(Duration::from_secs(5), async || {
        let all = rows(&gateway, "").await;
        counts(&all, "team-premium")
            == (
                3 * MESSAGE.0 + 3 * STREAM.0,
                3 * MESSAGE.1 + 3 * STREAM.1,
                6,
            )
    })
    .await;
    assert!(billed, "{:?}", usage(&gateway, "").await);
    assert_eq!(rows(&gateway, "").await[0]["estimated_calls"], 0);
}

/// The rule: a success whose usage cannot be read is counted at its estimate, never 0:
/// `/usage` bills the body's estimated input and its `max_tokens`, marked in
/// `estimated_calls`; an error answer counts nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_without_a_readable_usage_is_billed_its_estimate() {
    let _turn = crate::support::file_turn(module_path!());
    let mock = MockAnthropic::start();
    let gateway = start(&mock, None);
    let body = messages_body(false);
    let estimate = (body.len() as u64 * 2).div_ceil(7);
    // A success whose body carries no usage, then an error answer.
    mock.push_reply(crate::support::anthropic::Reply::NoUsage);
    call(&gateway, PREMIUM_KEY, false).await;
    mock.push_reply(crate::support::anthropic::Reply::Invalid);
    let refused = post_messages(&gateway, PREMIUM_KEY, false).await.unwrap();
    assert_eq!(refused.status(), 400);
    let error: Value = serde_json::from_slice(&refused.bytes().await.unwrap()).unwrap();
    assert!(error["request_id"].is_string(), "{error}");
    let billed = eventually(Duration::from_secs(5), async || {
        counts(&rows(&gateway, "").await, "team-premium") == (estimate, 64, 1)
    })
    .await;
    assert!(billed, "{:?}", usage(&gateway, "").await);
    assert_eq!(rows(&gateway, "").await[0]["estimated_calls"], 1);
}

/// The rule: only what ran is charged. A call the gateway refuses (`529` past its tier's
/// wait) counts nothing toward its tenant's day: the next answer's budget header counts the
/// call that ran (at its usage) and itself, not the refused one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_the_gateway_refuses_counts_nothing_toward_the_budget() {
    let _turn = crate::support::file_turn(module_path!());
    let mock = MockAnthropic::start();
    // The guest tier: one slot, 200 ms of wait.
    let gateway = start(&mock, None);
    let url = gateway.url();
    let estimate = (messages_body(false).len() as u64 * 2).div_ceil(7);
    let holder = tokio::spawn(async move {
        let held = [("x-mock-delay-ms", "1500")];
        let answer = post_messages_at(&url, GUEST_KEY, &held, false)
            .await
            .unwrap();
        assert_eq!(answer.status(), 200);
        answer.bytes().await.unwrap();
    });
    assert!(
        mock.wait_in_flight(1, Duration::from_secs(5)),
        "the slot is held"
    );
    let refused = post_messages(&gateway, GUEST_KEY, false).await.unwrap();
    assert_eq!(refused.status(), 529);
    refused.bytes().await.unwrap();
    holder.await.unwrap();
    let answer = post_messages(&gateway, GUEST_KEY, false).await.unwrap();
    assert_eq!(answer.status(), 200);
    let left: u64 = answer.headers()["x-fairgate-budget-remaining"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(
        left,
        100_000 - MESSAGE.0 - estimate,
        "the refused call counted"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gateways_on_one_redis_each_answer_the_fleets_sum() {
    let _turn = crate::support::file_turn(module_path!());
    let redis = RedisServer::start();
    let mock = MockAnthropic::start();
    let a = start(&mock, Some(&redis.url()));
    let b = start(&mock, Some(&redis.url()));
    call(&a, PREMIUM_KEY, false).await;
    call(&a, PREMIUM_KEY, false).await;
    call(&b, PREMIUM_KEY, false).await;
    call(&b, GUEST_KEY, false).await;

    let fleet = (3 * MESSAGE.0, 3 * MESSAGE.1, 3);
    for gateway in [&a, &b] {
        let summed = eventually(Duration::from_secs(10), async || {
            let all = rows(gateway, "").await;
            counts(&all, "team-premium") == fleet
                && counts(&all, "team-guest") == (MESSAGE.0, MESSAGE.1, 1)
        })
        .await;
        assert!(summed, "{:?}", usage(gateway, "").await);
    }
    // Kept in Redis, one hash per day, with an expiry.
    let today = rows(&a, "").await[0]["day"].as_str().unwrap().to_owned();
    let key = format!("fairgate:usage:{today}");
    let port = redis.port().to_string();
    let ttl: i64 = crate::support::redis_cli(&["-p", &port, "TTL", &key])
        .parse()
        .unwrap();
    assert!((30 * 86_400..=40 * 86_400).contains(&ttl), "TTL {ttl}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counts_made_while_redis_is_away_are_sent_once_it_answers() {
    let _turn = crate::support::file_turn(module_path!());
    let mut redis = RedisServer::not_started();
    let mock = MockAnthropic::start();
    let gateway = start(&mock, Some(&redis.url()));
    call(&gateway, PREMIUM_KEY, false).await;
    // Not a part of the fleet's numbers: none.
    assert_eq!(usage(&gateway, "").await.0, 503);

    redis.restart();
    let sent = eventually(Duration::from_secs(10), async || {
        let (status, body) = usage(&gateway, "").await;
        status == 200
            && counts(
                &serde_json::from_str::<Value>(&body).unwrap()["usage"]
                    .as_array()
                    .unwrap()
                    .clone(),
                "team-premium",
            ) == (MESSAGE.0, MESSAGE.1, 1)
    })
    .await;
    assert!(sent, "{:?}", usage(&gateway, "").await);
    // In Redis itself, not only in the gateway's memory (sent by the next flush).
    let today = rows(&gateway, "").await[0]["day"]
        .as_str()
        .unwrap()
        .to_owned();
    let port = redis.port().to_string();
    let key = format!("fairgate:usage:{today}");
    let in_redis = eventually(Duration::from_secs(5), async || {
        crate::support::redis_cli(&["-p", &port, "HGET", &key, "calls:team-premium"]) == "1"
    })
    .await;
    assert!(in_redis, "{}", gateway.log_text());
}
