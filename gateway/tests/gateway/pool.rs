//! A pool of upstreams through the gateway: the real `fairgate-gateway` process with the
//! keys file's `[[upstreams]]` in front of two mock upstreams, each checking its own key.
//! Both serve, each with its own key; one killed between calls of a running load loses no
//! call (the other serves them) and its calls moved away are counted; one answering `529`
//! is set aside and the other serves; `--upstream` with `[[upstreams]]` is refused at
//! start; a batch created through one upstream is read and cancelled through it; and
//! `models = [...]` routes by the body's `model`, a model no upstream serves answered `529`.
//!
//! Real time against real processes; every wait is for an event (a mock's calls in flight,
//! a count reached), bounded; processes are stopped by their pid when their guards drop.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use crate::first_hour::promtool_lint;
use crate::support::RedisServer;
use crate::support::anthropic::{MockAnthropic, Reply};
use crate::support::gateway::*;
use serde_json::Value;

/// One test at a time (two cores).
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const FIRST_KEY: &str = "sk-ant-first-workspace";
const SECOND_KEY: &str = "sk-ant-second-workspace";

/// Two mocks, each refusing any key but its own.
fn mocks() -> (MockAnthropic, MockAnthropic) {
    let (first, second) = (MockAnthropic::start(), MockAnthropic::start());
    first.require_key(FIRST_KEY);
    second.require_key(SECOND_KEY);
    (first, second)
}

const KEYS_ENV: [(&str, &str); 2] = [("FIRST_KEY", FIRST_KEY), ("SECOND_KEY", SECOND_KEY)];

/// The test keys file (a premium and a guest key, and the tenants `t1`..`t4`) with two
/// upstreams, `first` then `second`, each with `extra` lines.
fn pool_keys(first: &MockAnthropic, second: &MockAnthropic, extra: [&str; 2]) -> String {
    let tenants: String = (1..=4)
        .map(|i| format!("[[keys]]\nkey = \"sk-gw-t{i}\"\ntenant = \"t{i}\"\ntier = \"premium\"\n"))
        .collect();
    keys_toml(
        16,
        200,
        &format!(
            r#"
{tenants}
[[upstreams]]
name = "first"
url = "{}"
key_env = "FIRST_KEY"
{}

[[upstreams]]
name = "second"
url = "{}"
key_env = "SECOND_KEY"
{}
"#,
            first.url(),
            extra[0],
            second.url(),
            extra[1]
        ),
    )
}

/// `POST /v1/messages` of `key` with `body`: the status, the `retry-after` and the body.
async fn post(url: &str, key: &str, body: &str) -> (u16, Option<String>, Value) {
    let response = client()
        .post(format!("{url}/v1/messages"))
        .header("x-api-key", key)
        .header("anthropic-version", "2023-06-01")
        .header("content-type", "application/json")
        .body(body.to_owned())
        .send()
        .await
        .unwrap_or_else(|e| panic!("POST /v1/messages: {e}"));
    let status = response.status().as_u16();
    let retry_after = response
        .headers()
        .get("retry-after")
        .map(|v| v.to_str().unwrap().to_owned());
    let text = response.text().await.unwrap();
    let body = serde_json::from_str(&text).unwrap_or(Value::String(text));
    (status, retry_after, body)
}

fn model_body(model: &str) -> String {
    format!(
        r#"{{"model":"{model}","max_tokens":16,"messages":[{{"role":"user","content":"Hi"}}]}}"#
    )
}

/// The `/v1/messages` calls `mock` received.
fn messages_at(mock: &MockAnthropic) -> Vec<crate::support::anthropic::Recorded> {
    mock.requests()
        .into_iter()
        .filter(|r| r.path == "/v1/messages")
        .collect()
}

/// The value of `name{upstream="<upstream>",...}` in Prometheus text, summed over its
/// other labels.
fn upstream_metric(text: &str, name: &str, upstream: &str) -> Option<f64> {
    let label = format!("upstream=\"{upstream}\"");
    text.lines()
        .filter(|line| line.starts_with(&format!("{name}{{")))
        .filter(|line| {
            line.split_once('}')
                .is_some_and(|(labels, _)| labels.contains(&label))
        })
        .filter_map(|line| line.rsplit_once(' ')?.1.trim().parse::<f64>().ok())
        .fold(None, |sum, n| Some(sum.unwrap_or(0.0) + n))
}

/// The guide's keys file with a pool (the first of `docs/gateway/upstreams.md`), its two
/// base URLs replaced by `urls`.
fn readme_pool_keys(urls: [&str; 2]) -> String {
    let section = include_str!("../../../docs/gateway/upstreams.md");
    let block = section
        .split("```toml\n")
        .nth(1)
        .and_then(|rest| rest.split("\n```").next())
        .expect("a ```toml block in the section");
    assert!(block.contains("[[upstreams]]"), "{block}");
    let mut parts = block.split("https://api.anthropic.com");
    let mut text = parts.next().unwrap().to_owned();
    for url in urls {
        text.push_str(url);
        text.push_str(parts.next().expect("two upstream URLs"));
    }
    assert!(
        parts.next().is_none(),
        "more than two upstream URLs: {block}"
    );
    text
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readmes_pool_calls_each_upstream_with_its_own_key_and_spills_past_max_in_flight() {
    let _turn = crate::support::file_turn(module_path!());
    let _serial = SERIAL.lock().await;
    let (primary, second) = (MockAnthropic::start(), MockAnthropic::start());
    primary.require_key("sk-ant-primary");
    second.require_key("sk-ant-second");
    // Held until the test has seen where every call went.
    primary.set_delay(Duration::from_secs(8));
    second.set_delay(Duration::from_secs(8));
    let keys = readme_pool_keys([&primary.url(), &second.url()]);
    let env = [
        ("ANTHROPIC_API_KEY", "sk-ant-primary"),
        ("ANTHROPIC_API_KEY_2", "sk-ant-second"),
    ];
    let gateway = Gateway::start_pool(&keys, &env, &[]);
    let url = gateway.url();
    // Two calls at once, until each upstream has answered one: slow start (one call at a
    // time to an upstream not heard from yet) is over for both.
    primary.set_delay(Duration::ZERO);
    second.set_delay(Duration::ZERO);
    while primary.calls() == 0 || second.calls() == 0 {
        let two = [(); 2].map(|_| {
            let url = url.clone();
            tokio::spawn(async move { post(&url, "sk-gw-team-a", &model_body("claude-x")).await })
        });
        for call in two {
            assert_eq!(call.await.unwrap().0, 200);
        }
    }
    primary.set_delay(Duration::from_secs(8));
    second.set_delay(Duration::from_secs(8));
    let calls: Vec<_> = (0..8)
        .map(|_| {
            let url = url.clone();
            tokio::spawn(async move { post(&url, "sk-gw-team-a", &model_body("claude-x")).await })
        })
        .collect();
    // The primary takes its max_in_flight (4), the rest spill to the second workspace.
    let both = eventually(Duration::from_secs(20), async || {
        primary.in_flight() == 4 && second.in_flight() == 4
    })
    .await;
    assert!(
        both,
        "in flight: primary {}, second {}",
        primary.in_flight(),
        second.in_flight()
    );
    let metrics = gateway.metrics().await;
    assert_eq!(
        upstream_metric(&metrics, "gateway_upstream_in_flight", "primary"),
        Some(4.0),
        "{metrics}"
    );
    assert_eq!(
        upstream_metric(&metrics, "gateway_upstream_in_flight", "second-workspace"),
        Some(4.0)
    );
    // Each upstream's learned limits, under its own key (`default@{name}`).
    for name in ["primary", "second-workspace"] {
        let learned = format!(
            "claude_learned_rate_limit{{upstream=\"default@{name}\",dimension=\"requests\"}} 1000000"
        );
        assert!(metrics.contains(&learned), "no `{learned}` in {metrics}");
    }
    let status: Value = serde_json::from_str(&gateway.admin("/status").await).unwrap();
    let upstreams = status["upstreams"]
        .as_array()
        .expect("upstreams in /status");
    assert_eq!(upstreams.len(), 2, "{status}");
    assert_eq!(upstreams[0]["name"], "primary");
    assert_eq!(upstreams[0]["kind"], "anthropic");
    assert_eq!(upstreams[0]["in_flight"], 4);
    assert_eq!(upstreams[1]["set_aside"], false);
    let live: Value = serde_json::from_str(&gateway.admin("/live").await).unwrap();
    assert_eq!(live["pool"][1]["name"], "second-workspace", "{live}");
    for call in calls {
        let (status, _, body) = call.await.unwrap();
        assert_eq!(status, 200, "{body}");
    }
    assert_eq!(primary.max_in_flight(), 4);
    for (mock, key) in [(&primary, "sk-ant-primary"), (&second, "sk-ant-second")] {
        let seen = messages_at(mock);
        // The 4 held, and the warm-up's.
        assert!(seen.len() >= 5, "{} calls", seen.len());
        assert!(seen.iter().all(|r| r.headers["x-api-key"] == key));
        assert_eq!(mock.refused_keys(), 0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_killed_under_load_loses_no_call_and_its_calls_move_to_the_other() {
    let _turn = crate::support::file_turn(module_path!());
    let _serial = SERIAL.lock().await;
    let (first, second) = mocks();
    // No idle connection to either is kept: after the kill, a call to the first finds it
    // refusing connections, as a stopped process does.
    first.set_close_connections(true);
    second.set_close_connections(true);
    let gateway = Gateway::start_pool(&pool_keys(&first, &second, ["", ""]), &KEYS_ENV, &[]);
    let url = gateway.url();
    // Three clients call in a loop; the kill comes between two calls of each (a call in
    // flight at an upstream that dies may have run there, so it is not sent again: the
    // rule is that a call goes elsewhere only where its upstream provably did not run it).
    let gate = Arc::new(tokio::sync::RwLock::new(()));
    let stop = Arc::new(AtomicBool::new(false));
    let (answered, failed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let clients: Vec<_> = (0..3)
        .map(|_| {
            let (url, gate, stop) = (url.clone(), gate.clone(), stop.clone());
            let (answered, failed) = (answered.clone(), failed.clone());
            tokio::spawn(async move {
                let mut failures = Vec::new();
                while !stop.load(Ordering::SeqCst) {
                    let _call = gate.read().await;
                    let (status, _, body) = post(&url, PREMIUM_KEY, &model_body("claude-x")).await;
                    if status == 200 {
                        answered.fetch_add(1, Ordering::SeqCst);
                    } else {
                        failed.fetch_add(1, Ordering::SeqCst);
                        failures.push(format!("{status} {body}"));
                    }
                }
                failures
            })
        })
        .collect();
    let first_served = eventually(Duration::from_secs(30), async || first.calls() >= 10).await;
    assert!(
        first_served,
        "the first upstream served {} calls",
        first.calls()
    );
    {
        let _between_calls = gate.write().await;
        drop(first);
    }
    let before = answered.load(Ordering::SeqCst);
    let second_served = eventually(Duration::from_secs(30), async || {
        answered.load(Ordering::SeqCst) >= before + 30
    })
    .await;
    stop.store(true, Ordering::SeqCst);
    let mut failures = Vec::new();
    for client in clients {
        failures.extend(client.await.unwrap());
    }
    assert!(
        second_served,
        "calls after the kill: {}",
        answered.load(Ordering::SeqCst) - before
    );
    assert!(failures.is_empty(), "calls lost: {failures:?}");
    assert!(messages_at(&second).len() >= 30);
    assert_eq!(second.refused_keys(), 0);
    let metrics = gateway.metrics().await;
    let moved = upstream_metric(&metrics, "gateway_upstream_moved_away_total", "first");
    assert!(
        moved.is_some_and(|n| n >= 1.0),
        "moved away: {moved:?}\n{metrics}"
    );
    assert_eq!(
        upstream_metric(&metrics, "gateway_upstream_set_aside", "first"),
        Some(1.0)
    );
    assert_eq!(
        upstream_metric(&metrics, "gateway_upstream_moved_away_total", "second"),
        Some(0.0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_overloaded_upstream_is_set_aside_and_the_other_serves_its_calls() {
    let _turn = crate::support::file_turn(module_path!());
    let _serial = SERIAL.lock().await;
    let (first, second) = mocks();
    for _ in 0..200 {
        first.push_reply(Reply::Overloaded);
    }
    let gateway = Gateway::start_pool(&pool_keys(&first, &second, ["", ""]), &KEYS_ENV, &[]);
    let url = gateway.url();
    // A call that goes to the first upstream (both idle: the first listed) is answered
    // 529 there and goes to the second; each 529 closes the first's rate for a probe
    // interval (1 s), then one call probes it: three in a row set it aside.
    let started = std::time::Instant::now();
    let mut sent = 0;
    while messages_at(&first).len() < 3 {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the first upstream saw {} calls",
            messages_at(&first).len()
        );
        let key = format!("sk-gw-t{}", 1 + sent % 4);
        let (status, _, body) = post(&url, &key, &model_body("claude-x")).await;
        assert_eq!(status, 200, "{key}: {body}");
        sent += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let overloaded = messages_at(&first).len();
    // Between the probes, the calls went straight to the second.
    assert!(sent > overloaded, "{sent} calls, {overloaded} at the first");
    assert_eq!(
        messages_at(&second).len(),
        sent,
        "every call served by the second"
    );
    let metrics = gateway.metrics().await;
    assert_eq!(
        upstream_metric(&metrics, "gateway_upstream_set_aside", "first"),
        Some(1.0),
        "{metrics}"
    );
    assert_eq!(
        upstream_metric(&metrics, "gateway_upstream_moved_away_total", "first"),
        Some(overloaded as f64)
    );
    assert!(
        metrics.contains(&format!(
            "gateway_upstream_moved_away_total{{upstream=\"first\",reason=\"overloaded\"}} {overloaded}"
        )),
        "{metrics}"
    );
    assert_eq!(
        upstream_metric(&metrics, "gateway_upstream_served_total", "second"),
        Some(sent as f64)
    );
    promtool_lint(&metrics);
    let status: Value = serde_json::from_str(&gateway.admin("/status").await).unwrap();
    assert_eq!(status["upstreams"][0]["set_aside"], true, "{status}");
    assert_eq!(status["upstreams"][1]["set_aside"], false, "{status}");
    // The live page's table of upstreams, as a browser renders it.
    if let Some(dom) = live_page(&gateway) {
        let row = |name: &str| {
            let start = dom
                .find(&format!(r#"<tr data-upstream="{name}">"#))
                .unwrap_or_else(|| panic!("no row for {name}: {dom}"));
            let row = &dom[start..];
            row[..row.find("</tr>").unwrap()].to_owned()
        };
        let (first_row, second_row) = (row("first"), row("second"));
        assert!(first_row.contains("set aside"), "{first_row}");
        assert!(
            first_row.contains(&format!(r#"class="n moved-away">{overloaded}<"#)),
            "{first_row}"
        );
        assert!(second_row.contains("taking calls"), "{second_row}");
        // Its 529s are the reason they moved; the second served every call.
        assert!(
            first_row.contains(&format!(r#"class="n overloaded">{overloaded}<"#)),
            "{first_row}"
        );
        assert!(
            second_row.contains(&format!(r#"class="n served">{sent}<"#)),
            "{second_row}"
        );
    }
}

/// The rule: a call goes to another upstream only when it provably did not run at the
/// first. A `529` (the API refuses before it runs a call) is served by the other, counted
/// as moved away for being overloaded. A `500`, `502`, `503` or `504`, or a connection
/// dropped after the request was sent, may come after the call ran (both mocks answer so
/// a call asking for it): the client gets it as it is (`502` for the hang-up), and the
/// call ran at one upstream only. (A `429` goes back to the retry layer: `rate::`.) On one
/// gateway, or on Redis.
async fn a_call_that_may_have_run_is_never_sent_again(redis: Option<&RedisServer>) {
    let (first, second) = mocks();
    // The second is the fallback: a call goes to the first, or to the second only once the
    // first refused it (or held it past `spill_after`).
    let keys = pool_keys(&first, &second, ["", "priority = 1"]);
    let gateway = match redis {
        Some(redis) => Gateway::start_pool_on(&redis.url(), &keys, &KEYS_ENV),
        None => Gateway::start_pool(&keys, &KEYS_ENV, &[]),
    };
    // The first refuses the first call it gets: that call is served by the second.
    first.push_reply(Reply::Overloaded);
    let mut sent = 0;
    while messages_at(&first).is_empty() {
        assert!(sent < 20, "the first upstream got none of {sent} calls");
        let key = format!("sk-gw-t{}", 1 + sent % 4);
        let (answered, _, body) = post(&gateway.url(), &key, &model_body("claude-x")).await;
        assert_eq!(answered, 200, "a 529 is served by the other: {body}");
        sent += 1;
    }
    assert_eq!(messages_at(&first).len(), 1);
    assert_eq!(
        messages_at(&second).len(),
        sent,
        "every call ran at the second"
    );
    let metrics = gateway.metrics().await;
    let overloaded =
        "gateway_upstream_moved_away_total{upstream=\"first\",reason=\"overloaded\"} 1";
    assert!(metrics.contains(overloaded), "{metrics}");
    let ran = || messages_at(&first).len() + messages_at(&second).len() - 1 - sent;
    for (n, status) in ["500", "502", "503", "504", "hang-up"]
        .into_iter()
        .enumerate()
    {
        let key = format!("sk-gw-t{}", 1 + n % 4);
        let asked = [("x-mock-reply", status)];
        let answer = post_messages_at(&gateway.url(), &key, &asked, false)
            .await
            .unwrap();
        let expected = if status == "hang-up" { "502" } else { status };
        assert_eq!(
            answer.status().as_str(),
            expected,
            "as the upstream answered"
        );
        let body: Value = serde_json::from_slice(&answer.bytes().await.unwrap()).unwrap();
        assert_eq!(body["error"]["type"], "api_error", "{body}");
        assert_eq!(ran(), n + 1, "{status}: the call ran at one upstream only");
    }
    let metrics = gateway.metrics().await;
    assert_eq!(
        upstream_metric(&metrics, "gateway_upstream_moved_away_total", "first"),
        Some(1.0),
        "only the 529 moved: {metrics}"
    );
    assert_eq!(
        upstream_metric(&metrics, "gateway_upstream_moved_away_total", "second"),
        Some(0.0),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_that_may_have_run_is_never_sent_again_on_one_gateway() {
    let _turn = crate::support::file_turn(module_path!());
    let _serial = SERIAL.lock().await;
    a_call_that_may_have_run_is_never_sent_again(None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_that_may_have_run_is_never_sent_again_on_redis() {
    let _turn = crate::support::file_turn(module_path!());
    let _serial = SERIAL.lock().await;
    let redis = RedisServer::start();
    a_call_that_may_have_run_is_never_sent_again(Some(&redis)).await;
}

/// The live page as headless Chromium renders it (its script run), when Chromium is
/// installed (`scripts/test` installs it; the `page` tests say when it is not).
fn live_page(gateway: &Gateway) -> Option<String> {
    let browser = ["chromium", "chromium-browser", "google-chrome"]
        .iter()
        .map(|name| std::path::Path::new("/usr/bin").join(name))
        .find(|path| path.exists())?;
    let profile = target_tmp().join(format!("pool-chromium-{}", free_port()));
    let output = std::process::Command::new(browser)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--virtual-time-budget=4000",
            "--dump-dom",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .arg(format!("{}/", gateway.admin_url()))
        .output()
        .expect("run chromium");
    let _ = std::fs::remove_dir_all(&profile);
    let dom = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        dom.contains(r#"data-errors="0""#),
        "JavaScript errors: {dom}"
    );
    Some(dom)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_flag_and_keys_file_upstreams_together_are_refused_at_start() {
    let _turn = crate::support::file_turn(module_path!());
    let _serial = SERIAL.lock().await;
    let (first, second) = mocks();
    let keys = pool_keys(&first, &second, ["", ""]);
    let (status, stderr) = Gateway::refused(Some(&first.url()), &keys, &KEYS_ENV);
    assert!(!status.success());
    assert!(
        stderr.contains("both --upstream") && stderr.contains("[[upstreams]]"),
        "{stderr}"
    );
    // A key_env that is not set: the upstream and its line named, no key shown.
    let (status, stderr) = Gateway::refused(None, &keys, &[("FIRST_KEY", FIRST_KEY)]);
    assert!(!status.success());
    assert!(
        stderr.contains("[[upstreams]] `second`: key_env SECOND_KEY is not set"),
        "{stderr}"
    );
    assert!(stderr.contains(" line "), "{stderr}");
    assert!(!stderr.contains(FIRST_KEY), "{stderr}");
    // Neither --upstream nor [[upstreams]].
    let (status, stderr) = Gateway::refused(None, &keys_toml(8, 200, ""), &[]);
    assert!(!status.success());
    assert!(stderr.contains("no upstream"), "{stderr}");
}

/// A batch created through the preferred upstream (the second: lower priority first) is
/// read, listed and cancelled through it, the first never hearing of it. On Redis, created
/// through one gateway and read through another that prefers the first upstream: the
/// fleet's book holds the batch's upstream.
async fn batches_stay_with_their_upstream(redis: Option<&RedisServer>) {
    let (first, second) = mocks();
    let keys = pool_keys(&first, &second, ["priority = 1", "priority = 0"]);
    // The reader prefers the first upstream: only the book can send it to the second.
    let prefers_first = pool_keys(&first, &second, ["priority = 0", "priority = 1"]);
    let (creator, reader) = match redis {
        Some(redis) => (
            Gateway::start_pool_on(&redis.url(), &keys, &KEYS_ENV),
            Some(Gateway::start_pool_on(
                &redis.url(),
                &prefers_first,
                &KEYS_ENV,
            )),
        ),
        None => (Gateway::start_pool(&keys, &KEYS_ENV, &[]), None),
    };
    let body = serde_json::json!({"requests": [{"custom_id": "a", "params": {
        "model": "claude-x", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}}]});
    let send = |url: String, method: &str, path: String, body: Option<String>| {
        let method: reqwest::Method = method.parse().unwrap();
        let mut request = client()
            .request(method, format!("{url}{path}"))
            .header("x-api-key", PREMIUM_KEY)
            .header("anthropic-version", "2023-06-01");
        if let Some(body) = body {
            request = request
                .header("content-type", "application/json")
                .body(body);
        }
        async move {
            let response = request.send().await.unwrap();
            let status = response.status().as_u16();
            (status, response.text().await.unwrap())
        }
    };
    let path = "/v1/messages/batches".to_owned();
    let (status, created) = send(creator.url(), "POST", path, Some(body.to_string())).await;
    assert_eq!(status, 200, "{created}");
    let created: Value = serde_json::from_str(&created).unwrap();
    let id = created["id"].as_str().unwrap().to_owned();
    assert_eq!(second.batch_ids(), std::slice::from_ref(&id));
    assert!(first.batch_ids().is_empty());
    let url = reader.as_ref().unwrap_or(&creator).url();
    let batch = format!("/v1/messages/batches/{id}");
    for (method, path) in [
        ("GET", batch.clone()),
        ("GET", format!("{batch}/results")),
        ("POST", format!("{batch}/cancel")),
        ("GET", "/v1/messages/batches".to_owned()),
    ] {
        let (status, answer) = send(url.clone(), method, path.clone(), None).await;
        assert_eq!(status, 200, "{method} {path}: {answer}");
        if path.ends_with("/batches") {
            let list: Value = serde_json::from_str(&answer).unwrap();
            assert_eq!(list["data"][0]["id"], id.as_str(), "{list}");
        }
    }
    let naming = |mock: &MockAnthropic| {
        mock.requests()
            .iter()
            .filter(|r| r.path.contains(&id))
            .map(|r| format!("{} {}", r.method, r.path))
            .collect::<Vec<_>>()
    };
    assert_eq!(
        naming(&second),
        [
            format!("GET {batch}"),
            format!("GET {batch}/results"),
            format!("POST {batch}/cancel"),
            format!("GET {batch}"),
        ]
    );
    assert!(
        first.requests().is_empty(),
        "the first upstream heard of it"
    );
    assert_eq!(second.refused_keys(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_is_read_and_cancelled_through_the_upstream_that_created_it() {
    let _turn = crate::support::file_turn(module_path!());
    let _serial = SERIAL.lock().await;
    batches_stay_with_their_upstream(None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_redis_every_gateway_sends_a_batch_to_the_upstream_that_created_it() {
    let _turn = crate::support::file_turn(module_path!());
    let _serial = SERIAL.lock().await;
    let redis = RedisServer::start();
    batches_stay_with_their_upstream(Some(&redis)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_route_each_call_by_its_body_and_a_model_none_serves_is_529() {
    let _turn = crate::support::file_turn(module_path!());
    let _serial = SERIAL.lock().await;
    let (first, second) = mocks();
    let keys = pool_keys(
        &first,
        &second,
        [
            r#"models = ["claude-first"]"#,
            r#"models = ["claude-second", "claude-both"]"#,
        ],
    );
    let gateway = Gateway::start_pool(&keys, &KEYS_ENV, &[]);
    let url = gateway.url();
    for model in [
        "claude-first",
        "claude-second",
        "claude-first",
        "claude-both",
    ] {
        let (status, _, body) = post(&url, PREMIUM_KEY, &model_body(model)).await;
        assert_eq!(status, 200, "{model}: {body}");
    }
    let models = |mock: &MockAnthropic| -> Vec<String> {
        messages_at(mock)
            .iter()
            .map(|r| {
                let body: Value = serde_json::from_slice(&r.body).unwrap();
                body["model"].as_str().unwrap().to_owned()
            })
            .collect()
    };
    assert_eq!(models(&first), ["claude-first", "claude-first"]);
    assert_eq!(models(&second), ["claude-second", "claude-both"]);
    // No upstream serves it: 529, to come back after `retry-after`, and nothing sent.
    let (status, retry_after, body) = post(&url, PREMIUM_KEY, &model_body("claude-none")).await;
    assert_eq!(status, 529, "{body}");
    assert_eq!(body["error"]["type"], "overloaded_error", "{body}");
    assert!(retry_after.is_some_and(|s| s.parse::<u64>().unwrap() >= 1));
    assert_eq!(messages_at(&first).len() + messages_at(&second).len(), 4);
    let metrics = gateway.metrics().await;
    assert!(
        metric_sum(&metrics, "gateway_upstream_none_total") >= 1.0,
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_that_changes_the_upstreams_is_refused_and_the_pool_kept() {
    let _turn = crate::support::file_turn(module_path!());
    let _serial = SERIAL.lock().await;
    let (first, second) = mocks();
    let keys = pool_keys(&first, &second, ["", ""]);
    let gateway = Gateway::start_pool(&keys, &KEYS_ENV, &[]);
    let status =
        async || -> Value { serde_json::from_str(&gateway.admin("/status").await).unwrap() };
    // The same upstreams, keys changed: taken.
    let more = format!("{keys}\n[[keys]]\nkey = \"sk-gw-new\"\ntenant = \"new\"\ntier = \"pro\"\n");
    std::fs::write(&gateway.keys_path, &more).unwrap();
    gateway.signal("HUP");
    let reloaded = eventually(Duration::from_secs(20), async || {
        status().await["keys"]["reloads"] == 1
    })
    .await;
    assert!(reloaded, "{}", status().await);
    // Another upstream's weight: refused, the previous file and the pool kept.
    std::fs::write(
        &gateway.keys_path,
        more.replacen(
            "key_env = \"SECOND_KEY\"",
            "key_env = \"SECOND_KEY\"\nweight = 3",
            1,
        ),
    )
    .unwrap();
    gateway.signal("HUP");
    let refused = eventually(Duration::from_secs(20), async || {
        status().await["keys"]["failed_reloads"] == 1
    })
    .await;
    assert!(refused, "{}", status().await);
    assert!(
        gateway.log_text().contains("[[upstreams]] changed"),
        "{}",
        gateway.log_text()
    );
    let (status_code, _, body) = post(&gateway.url(), "sk-gw-new", &model_body("claude-x")).await;
    assert_eq!(status_code, 200, "{body}");
    assert_eq!(
        status().await["upstreams"].as_array().map(Vec::len),
        Some(2)
    );
}

/// The official Python SDK, its own retries off, through a pool whose first upstream is
/// overloaded: every call (a stream among them) is answered by the second.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_sdk_sees_no_failover_through_the_pool() {
    let _turn = crate::support::file_turn(module_path!());
    let _serial = SERIAL.lock().await;
    let Some(python) = super::proxy::sdk_python() else {
        return;
    };
    let (first, second) = mocks();
    first.push_reply(Reply::Overloaded);
    let gateway = Gateway::start_pool(&pool_keys(&first, &second, ["", ""]), &KEYS_ENV, &[]);
    let script = r#"
import os, anthropic
client = anthropic.Anthropic(base_url=os.environ["GATEWAY_URL"], api_key=os.environ["KEY"], max_retries=0)
ask = dict(model="claude-x", max_tokens=16, messages=[{"role": "user", "content": "Hi"}])
for _ in range(3):
    message = client.messages.create(**ask)
    assert message.content[0].text == os.environ["MESSAGE_TEXT"], message
with client.messages.stream(**ask) as stream:
    text = "".join(stream.text_stream)
assert text == os.environ["STREAM_TEXT"], text
print("sdk: 4 answered")
"#;
    let out = tokio::process::Command::new(python)
        .args(["-c", script])
        .env("GATEWAY_URL", gateway.url())
        .env("KEY", PREMIUM_KEY)
        .env("MESSAGE_TEXT", "Hello from the mock upstream.")
        .env(
            "STREAM_TEXT",
            crate::support::anthropic::STREAM_TEXT.concat(),
        )
        .env_remove("ANTHROPIC_API_KEY")
        .env_remove("ANTHROPIC_BASE_URL")
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(120), out)
        .await
        .expect("the SDK script within 120 s")
        .expect("run the SDK script");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("sdk: 4 answered"), "{stdout}");
    assert_eq!(messages_at(&first).len(), 1, "the overloaded call");
    assert_eq!(messages_at(&second).len(), 4);
}
