//! Message batches through the gateway: each belongs to the key that created it. The real
//! `fairgate-gateway` process in front of the mock upstream's Messages Batches API, one
//! workspace shared by every key (as the team's one upstream key is): another key, of
//! another tenant or of the same one, gets `404` for a batch it did not create, and the
//! upstream never hears of the call; the owner pages over its own batches; `results_url`
//! names the gateway; on Redis, every gateway of the fleet knows the owner.
//!
//! Real time against real processes, every wait bounded; processes are stopped by their pid
//! when their guards drop.

use std::time::Duration;

use crate::support::RedisServer;
use crate::support::anthropic::MockAnthropic;
use crate::support::gateway::*;
use serde_json::Value;

/// One test at a time (two cores).
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A second key of the premium tenant: the same tenant, another key holder.
const PREMIUM_KEY_2: &str = "sk-gw-premium-2";

fn keys() -> String {
    keys_toml(
        8,
        200,
        &format!(
            r#"
[[keys]]
key = "{PREMIUM_KEY_2}"
tenant = "team-premium"
tier = "premium"
"#
        ),
    )
}

/// `method url` with `key`; the status and the body (JSON when it is, else a string).
async fn call(method: &str, url: &str, key: &str) -> (u16, Value) {
    call_with(method, url, key, None, &[]).await
}

async fn call_with(
    method: &str,
    url: &str,
    key: &str,
    body: Option<String>,
    headers: &[(&str, &str)],
) -> (u16, Value) {
    let method: reqwest::Method = method.parse().unwrap();
    let mut request = client()
        .request(method.clone(), url)
        .header("x-api-key", key)
        .header("anthropic-version", "2023-06-01");
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    if let Some(body) = body {
        request = request
            .header("content-type", "application/json")
            .body(body);
    }
    let response = request
        .send()
        .await
        .unwrap_or_else(|e| panic!("{method} {url}: {e}"));
    let status = response.status().as_u16();
    let text = response.text().await.unwrap();
    let body = serde_json::from_str(&text).unwrap_or(Value::String(text));
    (status, body)
}

fn batch_body(custom_ids: &[&str]) -> String {
    let requests: Vec<Value> = custom_ids
        .iter()
        .map(|id| {
            serde_json::json!({
                "custom_id": id,
                "params": {"model": "claude-mock-1", "max_tokens": 64,
                           "messages": [{"role": "user", "content": "Hello"}]}
            })
        })
        .collect();
    serde_json::json!({ "requests": requests }).to_string()
}

/// Creates a batch through `gateway` with `key`; its id and the answer.
async fn create(gateway: &str, key: &str, custom_ids: &[&str]) -> (String, Value) {
    let (status, batch) = call_with(
        "POST",
        &format!("{gateway}/v1/messages/batches"),
        key,
        Some(batch_body(custom_ids)),
        &[],
    )
    .await;
    assert_eq!(status, 200, "create: {batch}");
    let id = batch["id"].as_str().expect("an id").to_owned();
    assert!(id.starts_with("msgbatch_"), "{batch}");
    (id, batch)
}

/// The requests the mock received whose path names `id`.
fn upstream_calls_naming(mock: &MockAnthropic, id: &str) -> Vec<String> {
    mock.requests()
        .iter()
        .filter(|r| r.path.contains(id))
        .map(|r| format!("{} {}", r.method, r.path))
        .collect()
}

fn assert_not_found(answer: &(u16, Value), what: &str) {
    assert_eq!(answer.0, 404, "{what}: {}", answer.1);
    assert_eq!(answer.1["type"], "error", "{what}: {}", answer.1);
    assert_eq!(
        answer.1["error"]["type"], "not_found_error",
        "{what}: {}",
        answer.1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_key_can_neither_read_nor_touch_a_batch_it_did_not_create() {
    let _turn = crate::support::file_turn(module_path!());
    let _serial = SERIAL.lock().await;
    let mock = MockAnthropic::start();
    let gateway = Gateway::start(&mock.url(), &keys(), None);
    let url = gateway.url();
    let (id, _) = create(&url, PREMIUM_KEY, &["a", "b"]).await;
    let batch_url = format!("{url}/v1/messages/batches/{id}");

    // A guest (another tenant) and a second key of the same tenant: 404 everywhere, and the
    // upstream never hears of it.
    let nobody = call(
        "GET",
        &format!("{url}/v1/messages/batches/msgbatch_nobody"),
        GUEST_KEY,
    )
    .await;
    assert_not_found(&nobody, "an id nobody owns");
    for key in [GUEST_KEY, PREMIUM_KEY_2] {
        for (method, target) in [
            ("GET", batch_url.clone()),
            ("GET", format!("{batch_url}/results")),
            ("POST", format!("{batch_url}/cancel")),
            ("DELETE", batch_url.clone()),
        ] {
            let answer = call(method, &target, key).await;
            assert_not_found(&answer, &format!("{key} {method} {target}"));
            // Each answer has its own request_id; the rest is the same.
            let without_id = |body: &Value| {
                let mut body = body.clone();
                body.as_object_mut()
                    .map(|fields| fields.remove("request_id"));
                body
            };
            assert_eq!(
                without_id(&answer.1),
                without_id(&nobody.1),
                "the same answer as for an id nobody owns"
            );
        }
        let (status, list) = call("GET", &format!("{url}/v1/messages/batches"), key).await;
        assert_eq!(status, 200, "{list}");
        assert_eq!(
            list["data"],
            serde_json::json!([]),
            "{key} lists nothing: {list}"
        );
        assert_eq!(list["has_more"], false);
        assert!(
            list["first_id"].is_null() && list["last_id"].is_null(),
            "{list}"
        );
    }
    assert_eq!(
        upstream_calls_naming(&mock, &id),
        Vec::<String>::new(),
        "no call of another key reached the upstream"
    );
    assert_eq!(mock.batch_ids(), [id.as_str()], "the batch is still there");

    // The owner can do all of it.
    let (status, batch) = call("GET", &batch_url, PREMIUM_KEY).await;
    assert_eq!(
        (status, batch["id"].as_str()),
        (200, Some(id.as_str())),
        "{batch}"
    );
    let (status, results) = call("GET", &format!("{batch_url}/results"), PREMIUM_KEY).await;
    assert_eq!(status, 200, "{results}");
    let lines: Vec<Value> = results
        .as_str()
        .expect("JSON lines")
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect();
    assert_eq!(lines.len(), 2);
    assert_eq!(lines[0]["custom_id"], "a");
    assert_eq!(lines[1]["result"]["type"], "succeeded");
    let (status, list) = call("GET", &format!("{url}/v1/messages/batches"), PREMIUM_KEY).await;
    assert_eq!(
        (status, &list["data"][0]["id"]),
        (200, &Value::from(id.as_str()))
    );
    let (status, cancelled) = call("POST", &format!("{batch_url}/cancel"), PREMIUM_KEY).await;
    assert_eq!(status, 200, "{cancelled}");
    assert!(cancelled["cancel_initiated_at"].is_string(), "{cancelled}");
    let (status, deleted) = call("DELETE", &batch_url, PREMIUM_KEY).await;
    assert_eq!(status, 200, "{deleted}");
    assert_eq!(deleted["type"], "message_batch_deleted");
    assert!(mock.batch_ids().is_empty());
    assert_not_found(
        &call("GET", &batch_url, PREMIUM_KEY).await,
        "after its delete",
    );
    assert_eq!(
        upstream_calls_naming(&mock, &id).len(),
        5,
        "the owner's get, results, list's get, cancel and delete went upstream"
    );
}

/// Pages with `limit` from `after`/`before`; the ids, `has_more`, `first_id`, `last_id`.
async fn page(url: &str, key: &str, query: &str) -> (Vec<String>, bool, Value, Value) {
    let (status, list) = call("GET", &format!("{url}/v1/messages/batches?{query}"), key).await;
    assert_eq!(status, 200, "{query}: {list}");
    let ids: Vec<String> = list["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["id"].as_str().unwrap().to_owned())
        .collect();
    (
        ids,
        list["has_more"].as_bool().unwrap(),
        list["first_id"].clone(),
        list["last_id"].clone(),
    )
}

async fn list_pages_over_the_own_batches_only(redis: Option<&RedisServer>) {
    let mock = MockAnthropic::start();
    let gateway = Gateway::start(&mock.url(), &keys(), redis.map(|r| r.url()).as_deref());
    let url = gateway.url();
    // Seven of the premium key, four of the guest's in between.
    let mut mine = Vec::new();
    let mut theirs = Vec::new();
    for i in 0..11 {
        if i % 3 == 1 {
            theirs.push(create(&url, GUEST_KEY, &["g"]).await.0);
        } else {
            mine.push(create(&url, PREMIUM_KEY, &["p"]).await.0);
        }
    }
    mine.reverse(); // newest first, as lists are
    assert_eq!(mine.len(), 7);

    let (first, more, first_id, last_id) = page(&url, PREMIUM_KEY, "limit=3").await;
    assert_eq!((first.as_slice(), more), (&mine[0..3], true));
    assert_eq!(
        (first_id, last_id),
        (Value::from(&*mine[0]), Value::from(&*mine[2]))
    );
    let (second, more, _, _) =
        page(&url, PREMIUM_KEY, &format!("limit=3&after_id={}", mine[2])).await;
    assert_eq!((second.as_slice(), more), (&mine[3..6], true));
    let (third, more, first_id, last_id) =
        page(&url, PREMIUM_KEY, &format!("limit=3&after_id={}", mine[5])).await;
    assert_eq!((third.as_slice(), more), (&mine[6..7], false));
    assert_eq!(first_id, last_id);
    // Back from the last page.
    let (back, more, _, _) =
        page(&url, PREMIUM_KEY, &format!("limit=3&before_id={}", mine[6])).await;
    assert_eq!((back.as_slice(), more), (&mine[3..6], true));
    let (back, more, _, _) =
        page(&url, PREMIUM_KEY, &format!("limit=3&before_id={}", mine[3])).await;
    assert_eq!((back.as_slice(), more), (&mine[0..3], false));
    let (all, more, _, _) = page(&url, PREMIUM_KEY, "").await;
    assert_eq!((all, more), (mine.clone(), false), "default limit 20");
    let (guest, more, _, _) = page(&url, GUEST_KEY, "limit=100").await;
    theirs.reverse();
    assert_eq!((guest, more), (theirs.clone(), false));

    // Another key's id is no cursor; bad limits and two cursors are refused.
    let foreign = call(
        "GET",
        &format!("{url}/v1/messages/batches?after_id={}", theirs[0]),
        PREMIUM_KEY,
    )
    .await;
    assert_not_found(&foreign, "another key's id as a cursor");
    for query in [
        "limit=0",
        "limit=x",
        &format!("after_id={}&before_id={}", mine[0], mine[1]),
    ] {
        let (status, error) = call(
            "GET",
            &format!("{url}/v1/messages/batches?{query}"),
            PREMIUM_KEY,
        )
        .await;
        assert_eq!(status, 400, "{query}: {error}");
        assert_eq!(error["error"]["type"], "invalid_request_error");
    }
    // A batch the upstream lost (deleted with the team's key, not through the gateway) is
    // left out of its page.
    let lost = mine[1].clone();
    let mut upstream_delete = reqwest::Client::new()
        .delete(format!("{}/v1/messages/batches/{lost}", mock.url()))
        .send()
        .await
        .unwrap();
    assert_eq!(upstream_delete.status(), 200);
    upstream_delete = reqwest::Client::new()
        .get(format!("{}/v1/messages/batches/{lost}", mock.url()))
        .send()
        .await
        .unwrap();
    assert_eq!(upstream_delete.status(), 404);
    let (first, more, _, _) = page(&url, PREMIUM_KEY, "limit=3").await;
    assert_eq!(
        (first, more),
        (vec![mine[0].clone(), mine[2].clone()], true)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_list_pages_over_the_keys_own_batches_in_process() {
    let _turn = crate::support::file_turn(module_path!());
    let _serial = SERIAL.lock().await;
    list_pages_over_the_own_batches_only(None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_list_pages_over_the_keys_own_batches_on_redis() {
    let _turn = crate::support::file_turn(module_path!());
    let _serial = SERIAL.lock().await;
    let redis = RedisServer::start();
    list_pages_over_the_own_batches_only(Some(&redis)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn results_url_names_the_gateway_and_fetching_it_goes_through_the_owner_check() {
    let _turn = crate::support::file_turn(module_path!());
    let _serial = SERIAL.lock().await;
    let mock = MockAnthropic::start();
    // Without --public-url: the listen address.
    let gateway = Gateway::start(&mock.url(), &keys(), None);
    let url = gateway.url();
    let (id, created) = create(&url, PREMIUM_KEY, &["x", "y", "z"]).await;
    let results_url = format!("{url}/v1/messages/batches/{id}/results");
    assert_eq!(created["results_url"], results_url.as_str(), "{created}");
    let (_, got) = call(
        "GET",
        &format!("{url}/v1/messages/batches/{id}"),
        PREMIUM_KEY,
    )
    .await;
    assert_eq!(got["results_url"], results_url.as_str());
    let (_, list) = call("GET", &format!("{url}/v1/messages/batches"), PREMIUM_KEY).await;
    assert_eq!(list["data"][0]["results_url"], results_url.as_str());
    let (_, cancelled) = call(
        "POST",
        &format!("{url}/v1/messages/batches/{id}/cancel"),
        PREMIUM_KEY,
    )
    .await;
    assert_eq!(cancelled["results_url"], results_url.as_str());
    // As the SDKs do: fetch the URL the batch names, with the client's key.
    let (status, lines) = call("GET", &results_url, PREMIUM_KEY).await;
    assert_eq!(status, 200, "{lines}");
    assert_eq!(lines.as_str().unwrap().lines().count(), 3);
    assert_not_found(
        &call("GET", &results_url, GUEST_KEY).await,
        "another key's results",
    );
    assert_not_found(
        &call("GET", &results_url, PREMIUM_KEY_2).await,
        "another key's results",
    );
    drop(gateway);

    // With --public-url (a proxy in front, under a path prefix).
    let public = "https://llm.example.test/anthropic";
    let gateway = Gateway::start_with(&mock.url(), &keys(), None, &["--public-url", public]);
    let (id, created) = create(&gateway.url(), PREMIUM_KEY, &["x"]).await;
    assert_eq!(
        created["results_url"],
        format!("{public}/v1/messages/batches/{id}/results").as_str()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn headers_that_would_act_as_another_never_reach_the_upstream() {
    let _turn = crate::support::file_turn(module_path!());
    let _serial = SERIAL.lock().await;
    let mock = MockAnthropic::start();
    let gateway = Gateway::start(&mock.url(), &keys(), None);
    let url = gateway.url();
    let impersonating = [
        ("anthropic-workspace-id", "wrkspc_someone_else"),
        ("anthropic-organization-id", "org_someone_else"),
        ("cookie", "session=someone-else"),
        ("forwarded", "for=10.9.9.9"),
        ("x-forwarded-for", "10.9.9.9"),
        ("x-real-ip", "10.9.9.9"),
    ];
    let (id, _) = create(&url, PREMIUM_KEY, &["a"]).await;
    let message = messages_body(false);
    let count = r#"{"model":"claude-mock-1","messages":[{"role":"user","content":"Hi"}]}"#;
    let calls: [(&str, String, Option<String>); 6] = [
        ("POST", format!("{url}/v1/messages"), Some(message)),
        (
            "POST",
            format!("{url}/v1/messages/count_tokens"),
            Some(count.to_owned()),
        ),
        ("GET", format!("{url}/v1/models"), None),
        (
            "POST",
            format!("{url}/v1/messages/batches"),
            Some(batch_body(&["b"])),
        ),
        ("GET", format!("{url}/v1/messages/batches/{id}"), None),
        ("GET", format!("{url}/v1/messages/batches"), None),
    ];
    let before = mock.requests().len();
    for (method, target, body) in calls {
        let (status, answer) = call_with(method, &target, PREMIUM_KEY, body, &impersonating).await;
        assert_eq!(status, 200, "{method} {target}: {answer}");
    }
    let seen = &mock.requests()[before..];
    assert!(seen.len() >= 6, "{} upstream calls", seen.len());
    for request in seen {
        for (name, _) in impersonating {
            assert!(
                request.headers.get(name).is_none(),
                "{name} reached the upstream on {} {}",
                request.method,
                request.path
            );
        }
        assert_eq!(request.headers["x-api-key"], UPSTREAM_KEY);
        assert_eq!(request.headers["anthropic-version"], "2023-06-01");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_redis_every_gateway_answers_the_owner_and_no_one_else_and_refuses_without_it() {
    let _turn = crate::support::file_turn(module_path!());
    let _serial = SERIAL.lock().await;
    let mut redis = RedisServer::start();
    let mock = MockAnthropic::start();
    let a = Gateway::start(&mock.url(), &keys(), Some(&redis.url()));
    let b = Gateway::start(&mock.url(), &keys(), Some(&redis.url()));
    let (id, _) = create(&a.url(), PREMIUM_KEY, &["a"]).await;
    let through_b = format!("{}/v1/messages/batches/{id}", b.url());
    let (status, batch) = call("GET", &through_b, PREMIUM_KEY).await;
    assert_eq!(status, 200, "the owner through the other gateway: {batch}");
    assert_eq!(
        batch["results_url"],
        format!("{}/v1/messages/batches/{id}/results", b.url()).as_str(),
        "each gateway names itself"
    );
    let (_, list) = call(
        "GET",
        &format!("{}/v1/messages/batches", b.url()),
        PREMIUM_KEY,
    )
    .await;
    assert_eq!(list["data"][0]["id"], id.as_str());
    for key in [GUEST_KEY, PREMIUM_KEY_2] {
        assert_not_found(&call("GET", &through_b, key).await, key);
        assert_not_found(
            &call("GET", &format!("{through_b}/results"), key).await,
            key,
        );
        assert_not_found(&call("DELETE", &through_b, key).await, key);
    }
    assert_eq!(
        upstream_calls_naming(&mock, &id).len(),
        2,
        "the owner's get and list"
    );

    // Redis gone: the batch routes are refused, retry-after given; nothing is created
    // upstream that no owner could be kept for.
    redis.terminate();
    let creates_before = mock.batch_ids().len();
    for gateway in [&a, &b] {
        let response = client()
            .post(format!("{}/v1/messages/batches", gateway.url()))
            .header("x-api-key", PREMIUM_KEY)
            .header("content-type", "application/json")
            .body(batch_body(&["c"]))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 503);
        assert!(response.headers().contains_key("retry-after"));
        let error: Value = serde_json::from_str(&response.text().await.unwrap()).unwrap();
        assert_eq!(error["error"]["type"], "overloaded_error", "{error}");
        for (method, target) in [
            ("GET", format!("{}/v1/messages/batches/{id}", gateway.url())),
            ("GET", format!("{}/v1/messages/batches", gateway.url())),
        ] {
            let (status, error) = call(method, &target, PREMIUM_KEY).await;
            assert_eq!(status, 503, "{method} {target}: {error}");
        }
    }
    assert_eq!(
        mock.batch_ids().len(),
        creates_before,
        "nothing created upstream"
    );
    // And back.
    redis.restart();
    let came_back = eventually(Duration::from_secs(10), async || {
        call_with(
            "POST",
            &format!("{}/v1/messages/batches", a.url()),
            PREMIUM_KEY,
            Some(batch_body(&["d"])),
            &[],
        )
        .await
        .0 == 200
    })
    .await;
    assert!(came_back, "batches are served again once Redis is back");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_whose_owner_cannot_be_recorded_is_cancelled_upstream_and_refused() {
    let _turn = crate::support::file_turn(module_path!());
    let _serial = SERIAL.lock().await;
    let redis = RedisServer::start();
    let mock = MockAnthropic::start();
    let gateway = Gateway::start(&mock.url(), &keys(), Some(&redis.url()));
    // Redis answers, but takes no write (a primary that lost its replicas).
    assert!(
        redis
            .command("CONFIG SET min-replicas-to-write 1")
            .contains("OK")
    );
    let (status, error) = call_with(
        "POST",
        &format!("{}/v1/messages/batches", gateway.url()),
        PREMIUM_KEY,
        Some(batch_body(&["a"])),
        &[],
    )
    .await;
    assert_eq!(status, 503, "{error}");
    assert_eq!(error["error"]["type"], "overloaded_error");
    let created = mock.batch_ids();
    assert_eq!(
        created.len(),
        1,
        "the upstream created it before the owner failed"
    );
    let cancel = format!("/v1/messages/batches/{}/cancel", created[0]);
    let cancelled = eventually(Duration::from_secs(10), async || {
        mock.requests()
            .iter()
            .any(|r| r.method == "POST" && r.path == cancel)
    })
    .await;
    assert!(cancelled, "the ownerless batch was cancelled upstream");
    assert_eq!(
        call(
            "GET",
            &format!("{}/v1/messages/batches/{}", gateway.url(), created[0]),
            PREMIUM_KEY
        )
        .await
        .0,
        404,
        "and nobody owns it"
    );
}

/// A full page (100) costs one upstream call per batch listed, and no more; its time is
/// printed (`-- --nocapture`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_page_costs_one_upstream_call_per_batch_listed() {
    let _turn = crate::support::file_turn(module_path!());
    let _serial = SERIAL.lock().await;
    let mock = MockAnthropic::start();
    let gateway = Gateway::start(&mock.url(), &keys(), None);
    let url = gateway.url();
    for _ in 0..120 {
        create(&url, PREMIUM_KEY, &["a"]).await;
    }
    let before = mock.requests().len();
    let started = std::time::Instant::now();
    let (ids, more, _, _) = page(&url, PREMIUM_KEY, "limit=1000").await;
    let took = started.elapsed();
    assert_eq!(
        (ids.len(), more),
        (100, true),
        "limit is read as at most 100"
    );
    let calls = &mock.requests()[before..];
    assert_eq!(calls.len(), 100, "one upstream call per batch listed");
    assert!(calls.iter().all(|r| r.method == "GET"));
    eprintln!(
        "a page of 100 batches: {:.1} ms through the gateway (debug build, mock on loopback)",
        took.as_secs_f64() * 1e3
    );
}
