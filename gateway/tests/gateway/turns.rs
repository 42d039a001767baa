//! One call per turn through one service key: the end users of a key take turns call by
//! call, and a light user is served within one turn of each user waiting. The real
//! `fairgate-gateway` process in front of the mock upstream (which answers with `usage`,
//! so every call is settled at what it used).

use std::time::Duration;

use crate::support::anthropic::MockAnthropic;
use crate::support::gateway::*;
use serde_json::Value;

const SERVICE_KEY: &str = "sk-svc-turns";

/// The issue's reproduction: 2 slots, 0.2 s calls (the rate not binding), users h, b, c and
/// d of one service key queue 200 calls each at once, and a light user L sends one every
/// 1.5 s. L is queued at most one turn of each waiting user (about 0.5 s at 10 calls a
/// second; DRR's turns of five calls kept it up to 6.9 s), and no user is dispatched more
/// than twice in a row while the others wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_light_end_user_waits_one_turn_of_each_user_of_its_service_key() {
    let _turn = crate::support::file_turn(module_path!());
    let mock = MockAnthropic::start();
    mock.set_delay(Duration::from_millis(200));
    let keys = format!(
        r#"
[[keys]]
key = "{SERVICE_KEY}"
tenant = "companion-app"
users = true
tier = "pro"

[limits]
global_max = 2

[[tiers]]
name = "pro"
cap = 2
max_wait_ms = 600000
"#
    );
    let gateway = Gateway::start(&mock.url(), &keys, None);
    let url = gateway.url();
    let send = |user: &str| {
        client()
            .post(format!("{url}/v1/messages"))
            .header("x-api-key", SERVICE_KEY)
            .header("anthropic-version", "2023-06-01")
            .header("content-type", "application/json")
            .body(format!(
                r#"{{"model":"claude-mock-1","max_tokens":200,"metadata":{{"user_id":"{user}"}},"messages":[{{"role":"user","content":"Hello"}}]}}"#
            ))
            .send()
    };
    let backlog: Vec<_> = ["h", "b", "c", "d"]
        .iter()
        .flat_map(|user| std::iter::repeat_n(*user, 200))
        .map(|user| tokio::spawn(send(user)))
        .collect();
    assert!(
        mock.wait_in_flight(2, Duration::from_secs(30)),
        "the slots fill"
    );
    let mut queued = Vec::new();
    for _ in 0..6 {
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        let answer = send("light").await.expect("the gateway answers");
        assert_eq!(answer.status(), 200);
        let ms: u64 = answer
            .headers()
            .get("x-fairgate-queued-ms")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok())
            .expect("x-fairgate-queued-ms");
        queued.push(ms);
    }
    for call in backlog {
        call.abort();
    }
    let users: Vec<String> = mock
        .requests()
        .iter()
        .map(|r| {
            let body: Value = serde_json::from_slice(&r.body).unwrap_or(Value::Null);
            body["metadata"]["user_id"]
                .as_str()
                .unwrap_or("")
                .to_owned()
        })
        .collect();
    let mut longest = (1, String::new());
    let mut run = 1;
    for pair in users.windows(2) {
        run = if pair[0] == pair[1] { run + 1 } else { 1 };
        if run > longest.0 {
            longest = (run, pair[0].clone());
        }
    }
    println!(
        "one service key, 4 users backlogged, 2 slots of 0.2 s calls: the light user queued \
         {queued:?} ms; the longest run of one user {longest:?} in {} calls",
        users.len()
    );
    assert!(
        queued.iter().all(|ms| *ms <= 1_000),
        "the light user queued {queued:?} ms"
    );
    assert!(
        longest.0 <= 2,
        "{} ran {} calls in a row",
        longest.1,
        longest.0
    );
}
