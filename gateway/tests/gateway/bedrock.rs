//! Claude on Amazon Bedrock through the library's [`BedrockLayer`], over a real hyper
//! client, against a mock of Bedrock's runtime (`tests/python/bedrock_mock.py`) that checks
//! each request's SigV4 signature with botocore, the AWS SDK for Python: signed calls are
//! served, a wrong key or a changed body is refused, and the answers, streams and errors
//! come back in the Messages API's shape. Last, the official Anthropic Python SDK talks to
//! a small server that sends its calls through the same layer.
//!
//! The Python comes from the SDK tests' venv under `target/` (`proxy::sdk_python`), with
//! `botocore` installed into it; the tests are skipped with a message when it cannot be had
//! outside CI.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use fairgate::BoxError;
use fairgate::upstream::{AwsCredentials, BedrockLayer};
use http::{HeaderMap, StatusCode};
use http_body_util::BodyExt;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};
use tower::{ServiceBuilder, ServiceExt};

const ACCESS_KEY: &str = "AKIDMOCKBEDROCK";
const SECRET_KEY: &str = "mock/secret+key/for/bedrock/tests";
const SESSION_TOKEN: &str = "mock-session-token//+=";
const REGION: &str = "us-west-2";

/// The mock's process, killed when dropped.
struct MockBedrock {
    child: Child,
    url: String,
}

impl MockBedrock {
    fn start(python: &Path) -> MockBedrock {
        let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/python/bedrock_mock.py");
        let mut child = Command::new(python)
            .arg(script)
            .env("MOCK_ACCESS_KEY", ACCESS_KEY)
            .env("MOCK_SECRET_KEY", SECRET_KEY)
            .env("MOCK_SESSION_TOKEN", SESSION_TOKEN)
            .env("MOCK_REGION", REGION)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start the Bedrock mock");
        let mut line = String::new();
        let stdout = child.stdout.take().expect("piped");
        BufReader::new(stdout)
            .read_line(&mut line)
            .expect("read the mock's port");
        let port = line
            .trim()
            .strip_prefix("PORT ")
            .unwrap_or_else(|| panic!("the mock did not start: {line:?}"));
        MockBedrock {
            child,
            url: format!("http://127.0.0.1:{port}"),
        }
    }

    /// What the mock received, oldest first.
    async fn requests(&self) -> Vec<Value> {
        let client = Client::builder(TokioExecutor::new()).build_http::<String>();
        let response = client
            .request(
                http::Request::get(format!("{}/requests", self.url))
                    .body(String::new())
                    .unwrap(),
            )
            .await
            .expect("ask the mock what it received");
        let body = response.into_body().collect().await.unwrap().to_bytes();
        serde_json::from_slice(&body).expect("the mock's requests as JSON")
    }
}

impl Drop for MockBedrock {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The SDK tests' Python with `botocore` installed too, or `None` (with a message) when it
/// cannot be had outside CI.
fn botocore_python() -> Option<PathBuf> {
    let python = crate::proxy::sdk_python()?;
    let _setup = crate::proxy::PYTHON_SETUP
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let has = |python: &Path| crate::proxy::python_has(python, "botocore");
    if has(&python) {
        return Some(python);
    }
    if crate::proxy::pip_install(&python, "botocore") && has(&python) {
        return Some(python);
    }
    let why = "`pip install botocore` failed: is PyPI reachable?";
    if std::env::var_os("CI").is_some_and(|v| !v.is_empty()) {
        panic!("the Bedrock tests must run in CI: {why}");
    }
    eprintln!("SKIPPED the Bedrock tests: {why}");
    None
}

fn layer(mock: &MockBedrock, secret: &str) -> BedrockLayer {
    BedrockLayer::builder()
        .region(REGION)
        .credentials(AwsCredentials::new(ACCESS_KEY, secret).session_token(SESSION_TOKEN))
        .base_url(&mock.url)
        .build()
        .expect("a Bedrock layer")
}

/// A Messages API request as a client sends it to the Anthropic API.
fn messages_request(body: &Value) -> http::Request<String> {
    http::Request::post("http://gateway.local/v1/messages")
        .header("x-api-key", "sk-ant-client-key")
        .header("anthropic-version", "2023-06-01")
        .header("content-type", "application/json")
        .body(body.to_string())
        .unwrap()
}

fn body_saying(text: &str, stream: bool) -> Value {
    json!({
        "model": "claude-sonnet-4-5",
        "max_tokens": 64,
        "stream": stream,
        "messages": [{"role": "user", "content": text}],
    })
}

/// Sends `body` through the layer over a hyper client: the status, headers and whole body.
async fn call(layer: &BedrockLayer, body: &Value) -> (StatusCode, HeaderMap, String) {
    let client = Client::builder(TokioExecutor::new()).build_http::<String>();
    let bedrock = ServiceBuilder::new().layer(layer.clone()).service(client);
    let response = bedrock
        .oneshot(messages_request(body))
        .await
        .expect("an answer");
    let (parts, body) = response.into_parts();
    let body = body.collect().await.expect("the whole body").to_bytes();
    let body = String::from_utf8(body.to_vec()).expect("UTF-8");
    (parts.status, parts.headers, body)
}

/// The (event, data) pairs of a server-sent events body; each data's `type` is its event's.
fn events(body: &str) -> Vec<(String, Value)> {
    body.split_terminator("\n\n")
        .map(|block| {
            let (event, data) = block
                .strip_prefix("event: ")
                .and_then(|b| b.split_once("\ndata: "))
                .unwrap_or_else(|| panic!("not an event: {block:?}"));
            let data: Value = serde_json::from_str(data).expect("JSON data");
            assert_eq!(data["type"], event, "{block}");
            (event.to_owned(), data)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_signed_call_is_served_and_answered_as_a_message() {
    let _turn = crate::support::file_turn(module_path!());
    let Some(python) = botocore_python() else {
        return;
    };
    let mock = MockBedrock::start(&python);
    let (status, headers, body) = call(&layer(&mock, SECRET_KEY), &body_saying("Hi", false)).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(headers["request-id"], "mock-request-1");
    let message: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(message["type"], "message");
    assert_eq!(message["content"][0]["text"], "Hello from Bedrock.");

    let requests = mock.requests().await;
    let [sent] = &requests[..] else {
        panic!("one request: {requests:?}");
    };
    assert_eq!(sent["status"], 200);
    assert_eq!(
        sent["path"],
        "/model/anthropic.claude-sonnet-4-5-20250929-v1%3A0/invoke"
    );
    let headers = sent["headers"].as_object().unwrap();
    assert!(!headers.contains_key("x-api-key"), "{headers:?}");
    assert!(!headers.contains_key("anthropic-version"), "{headers:?}");
    assert_eq!(headers["x-amz-security-token"], SESSION_TOKEN);
    let body: Value = serde_json::from_str(sent["body"].as_str().unwrap()).unwrap();
    assert_eq!(body["anthropic_version"], "bedrock-2023-05-31");
    assert!(
        body.get("model").is_none() && body.get("stream").is_none(),
        "{body}"
    );

    // An ARN goes whole into the path, its `:` and `/` percent-encoded, and encoded once
    // more in what is signed: botocore agrees.
    let arn = "arn:aws:bedrock:us-west-2:123456789012:application-inference-profile/abc123";
    let mut by_arn = body_saying("Hi", false);
    by_arn["model"] = arn.into();
    let (status, _, body) = call(&layer(&mock, SECRET_KEY), &by_arn).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        mock.requests().await[1]["path"],
        "/model/arn%3Aaws%3Abedrock%3Aus-west-2%3A123456789012%3A\
         application-inference-profile%2Fabc123/invoke"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_key_or_a_body_changed_after_signing_is_refused() {
    let _turn = crate::support::file_turn(module_path!());
    let Some(python) = botocore_python() else {
        return;
    };
    let mock = MockBedrock::start(&python);
    let (status, _, body) = call(&layer(&mock, "not-the-secret"), &body_saying("Hi", false)).await;
    let error: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(status, 401, "{body}");
    assert_eq!(error["error"]["type"], "authentication_error");
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap()
            .contains("signature we calculated does not match"),
        "{body}"
    );

    // Signed right, then changed on the way: the signed hash no longer matches.
    let client = Client::builder(TokioExecutor::new()).build_http::<String>();
    let tampering = ServiceBuilder::new()
        .layer(layer(&mock, SECRET_KEY))
        .map_request(|mut req: http::Request<String>| {
            req.body_mut().push(' ');
            let length = req.body().len();
            req.headers_mut()
                .insert(http::header::CONTENT_LENGTH, length.into());
            req
        })
        .service(client);
    let response = tampering
        .oneshot(messages_request(&body_saying("Hi", false)))
        .await
        .unwrap();
    assert_eq!(response.status(), 401);

    let statuses: Vec<Value> = mock
        .requests()
        .await
        .iter()
        .map(|r| r["status"].clone())
        .collect();
    assert_eq!(statuses, [403, 403], "the mock refused both");
    let (status, _, _) = call(&layer(&mock, SECRET_KEY), &body_saying("Hi", false)).await;
    assert_eq!(status, 200, "and served the call signed right");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_arrives_as_the_messages_server_sent_events() {
    let _turn = crate::support::file_turn(module_path!());
    let Some(python) = botocore_python() else {
        return;
    };
    let mock = MockBedrock::start(&python);
    let (status, headers, body) = call(&layer(&mock, SECRET_KEY), &body_saying("Hi", true)).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(headers["content-type"], "text/event-stream");
    let events = events(&body);
    let names: Vec<&str> = events.iter().map(|(name, _)| name.as_str()).collect();
    assert_eq!(
        names,
        [
            "message_start",
            "content_block_start",
            "content_block_delta",
            "content_block_delta",
            "content_block_delta",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop",
        ]
    );
    let text: String = events
        .iter()
        .filter_map(|(_, data)| data["delta"]["text"].as_str())
        .collect();
    assert_eq!(text, "Hello from Bedrock.");
    assert!(!body.contains("amazon-bedrock-invocationMetrics"), "{body}");
    let requests = mock.requests().await;
    assert_eq!(
        requests[0]["path"],
        "/model/anthropic.claude-sonnet-4-5-20250929-v1%3A0/invoke-with-response-stream"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_count_goes_to_count_tokens_and_comes_back_in_the_messages_shape() {
    let _turn = crate::support::file_turn(module_path!());
    let Some(python) = botocore_python() else {
        return;
    };
    let mock = MockBedrock::start(&python);
    let client = Client::builder(TokioExecutor::new()).build_http::<String>();
    let bedrock = ServiceBuilder::new()
        .layer(layer(&mock, SECRET_KEY))
        .service(client);
    let mut request = messages_request(&json!({
        "model": "claude-sonnet-4-5",
        "messages": [{"role": "user", "content": "Hi"}],
    }));
    *request.uri_mut() = "http://gateway.local/v1/messages/count_tokens"
        .parse()
        .unwrap();
    let response = bedrock.oneshot(request).await.unwrap();
    assert_eq!(response.status(), 200);
    let body = response.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body, r#"{"input_tokens":42}"#);
    assert_eq!(
        mock.requests().await[0]["path"],
        "/model/anthropic.claude-sonnet-4-5-20250929-v1%3A0/count-tokens"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn throttling_arrives_as_429_rate_limit_error_in_a_call_and_in_a_stream() {
    let _turn = crate::support::file_turn(module_path!());
    let Some(python) = botocore_python() else {
        return;
    };
    let mock = MockBedrock::start(&python);
    let bedrock = layer(&mock, SECRET_KEY);
    let (status, headers, body) = call(&bedrock, &body_saying("throttle me", false)).await;
    assert_eq!(status, 429, "{body}");
    assert_eq!(headers["content-type"], "application/json");
    let error: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        error,
        json!({"type": "error", "error": {
            "type": "rate_limit_error",
            "message": "Too many requests, please wait before trying again.",
        }})
    );

    let (status, _, body) = call(&bedrock, &body_saying("break the stream", true)).await;
    assert_eq!(status, 200, "the stream had begun");
    let events = events(&body);
    let names: Vec<&str> = events.iter().map(|(name, _)| name.as_str()).collect();
    assert_eq!(
        names,
        [
            "message_start",
            "content_block_start",
            "content_block_delta",
            "error"
        ]
    );
    assert_eq!(events[3].1["error"]["type"], "rate_limit_error");
}

/// The official Anthropic Python SDK, pointed at a small axum server whose every call goes
/// through the Bedrock layer to the mock: a message, a stream, a token count and a
/// throttled call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_anthropic_python_sdk_is_served_by_bedrock() {
    let _turn = crate::support::file_turn(module_path!());
    let Some(python) = botocore_python() else {
        return;
    };
    let mock = MockBedrock::start(&python);
    let client = Client::builder(TokioExecutor::new()).build_http::<String>();
    let bedrock = ServiceBuilder::new()
        .layer(layer(&mock, SECRET_KEY))
        .service(client);
    let app = axum::Router::new().fallback(move |req: axum::extract::Request| {
        let bedrock = bedrock.clone();
        async move {
            use axum::response::IntoResponse;
            match bedrock.oneshot(req).await {
                Ok(response) => response.into_response(),
                Err(e) => (StatusCode::BAD_GATEWAY, e.to_string()).into_response(),
            }
        }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let server = tokio::spawn(async move { axum::serve(listener, app).await });
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/python/sdk_bedrock.py");
    let run = tokio::process::Command::new(&python)
        .arg(script)
        .env("GATEWAY_URL", &url)
        .env_remove("ANTHROPIC_API_KEY")
        .env_remove("ANTHROPIC_BASE_URL")
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(60), run)
        .await
        .expect("the SDK script took more than 60 s")
        .expect("run the SDK script");
    server.abort();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    eprintln!("{stdout}{stderr}");
    assert!(
        out.status.success(),
        "the SDK script failed:\n{stdout}\n{stderr}"
    );
    assert!(stdout.contains("4 passed, 0 failed"), "{stdout}");
}

/// An upstream that refuses the connection is the inner client's error, as a `BoxError`:
/// no answer is made up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_that_refuses_connections_is_an_error() {
    let _turn = crate::support::file_turn(module_path!());
    let port = crate::support::gateway::free_port();
    let layer = BedrockLayer::builder()
        .region(REGION)
        .credentials(AwsCredentials::new(ACCESS_KEY, SECRET_KEY))
        .base_url(format!("http://127.0.0.1:{port}"))
        .build()
        .unwrap();
    let client = Client::builder(TokioExecutor::new()).build_http::<String>();
    let bedrock = ServiceBuilder::new().layer(layer).service(client);
    let result: Result<_, BoxError> = bedrock
        .oneshot(messages_request(&body_saying("Hi", false)))
        .await;
    assert!(result.is_err());
}
