//! `--otlp`: the gateway exports one span per call over OTLP/HTTP to a collector, here a
//! local receiver decoding each `ExportTraceServiceRequest`; the last batch goes when the
//! gateway stops.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;

use crate::support::anthropic::MockAnthropic;
use crate::support::gateway::*;

/// A collector's OTLP/HTTP endpoint on a free loopback port, keeping every span it gets.
struct Receiver {
    url: String,
    spans: Arc<Mutex<Vec<Span>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Receiver {
    async fn start() -> Receiver {
        let spans: Arc<Mutex<Vec<Span>>> = Arc::default();
        let kept = spans.clone();
        let app = axum::Router::new().route(
            "/v1/traces",
            axum::routing::post(move |body: axum::body::Bytes| {
                let kept = kept.clone();
                async move {
                    let export = ExportTraceServiceRequest::decode(body).expect("OTLP protobuf");
                    let mut kept = kept.lock().unwrap();
                    for resource in export.resource_spans {
                        for scope in resource.scope_spans {
                            kept.extend(scope.spans);
                        }
                    }
                    // An empty ExportTraceServiceResponse.
                    (
                        [("content-type", "application/x-protobuf")],
                        Vec::<u8>::new(),
                    )
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let task = tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        Receiver { url, spans, task }
    }

    fn calls(&self) -> Vec<Span> {
        let spans = self.spans.lock().unwrap();
        spans
            .iter()
            .filter(|s| s.name == "fairgate.call")
            .cloned()
            .collect()
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A span's attributes, as text.
fn attributes(span: &Span) -> HashMap<String, String> {
    let text = |value: &Value| match value {
        Value::StringValue(s) => s.clone(),
        Value::IntValue(i) => i.to_string(),
        Value::DoubleValue(d) => d.to_string(),
        Value::BoolValue(b) => b.to_string(),
        other => format!("{other:?}"),
    };
    span.attributes
        .iter()
        .filter_map(|kv| {
            let value = kv.value.as_ref()?.value.as_ref()?;
            Some((kv.key.clone(), text(value)))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_call_is_one_span_at_the_collector_with_its_attributes() {
    let _turn = crate::support::file_turn(module_path!());
    let receiver = Receiver::start().await;
    let mock = MockAnthropic::start();
    let mut gateway = Gateway::start_with(
        &mock.url(),
        &keys_toml(8, 200, ""),
        None,
        &["--otlp", &receiver.url],
    );
    let answer = post_messages(&gateway, PREMIUM_KEY, false).await.unwrap();
    assert_eq!(answer.status(), 200);
    answer.bytes().await.unwrap();

    // The batch goes when the gateway stops, if not before.
    gateway.terminate();
    assert!(
        gateway.wait_exit(Duration::from_secs(15)).is_some(),
        "{}",
        gateway.log_text()
    );
    let calls = receiver.calls();
    assert_eq!(
        calls.len(),
        1,
        "one span per call: {calls:?}\n{}",
        gateway.log_text()
    );
    let span = attributes(&calls[0]);
    assert_eq!(span["tenant"], "team-premium", "{span:?}");
    assert_eq!(span["tier"], "premium");
    assert_eq!(span["class"], "critical");
    assert_eq!(span["attempts"], "1");
    assert_eq!(span["status"], "200");
    assert_eq!(span["outcome"], "answered");
    // The upstream that answered, by its rate key: the retry layer's key ("default") at the
    // pool member's name (`--upstream` alone is a pool of one named "default"), the key its
    // learned limits show under in /metrics.
    assert_eq!(span["upstream"], "default@default");
    // The first call may wait a moment for the slow start (one call while the upstream's
    // limits are unknown): the rate.
    assert!(
        ["none", "rate"].contains(&span["wait_reason"].as_str()),
        "{span:?}"
    );
    let ms = |name: &str| -> f64 { span[name].parse().unwrap() };
    let by_reason =
        ms("wait_slot_ms") + ms("wait_rate_ms") + ms("wait_cooldown_ms") + ms("wait_store_ms");
    assert!((ms("waited_ms") - by_reason).abs() < 0.01, "{span:?}");
    assert!(ms("waited_ms") < 1_000.0, "{span:?}");
    assert!(calls[0].end_time_unix_nano >= calls[0].start_time_unix_nano);
}
