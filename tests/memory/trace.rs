//! Every call through the stack is one `fairgate.call` span carrying its tenant, tier,
//! class, what it waited for and how long, its attempts, its upstream, status and outcome;
//! without a subscriber that wants it, no span is made.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fairgate::{FairgateLayer, Job, SlotPolicy, Store};
use tower::{Layer, ServiceExt, service_fn};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;

/// The fields of one closed span, as text.
type Fields = HashMap<String, String>;

/// Keeps each `fairgate.call` span's fields (and the wait events inside it) until it closes.
#[derive(Clone, Default)]
struct Captured {
    open: Arc<Mutex<HashMap<u64, Fields>>>,
    closed: Arc<Mutex<Vec<Fields>>>,
    waits: Arc<Mutex<Vec<(u64, String)>>>,
}

struct Text<'a>(&'a mut Fields);

impl Visit for Text<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.insert(field.name().to_owned(), format!("{value:?}"));
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_owned(), value.to_owned());
    }
}

impl<S: tracing::Subscriber + for<'a> LookupSpan<'a>> tracing_subscriber::Layer<S> for Captured {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, _: Context<'_, S>) {
        if attrs.metadata().name() != "fairgate.call" {
            return;
        }
        let mut fields = Fields::new();
        attrs.record(&mut Text(&mut fields));
        self.open.lock().unwrap().insert(id.into_u64(), fields);
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, _: Context<'_, S>) {
        if let Some(fields) = self.open.lock().unwrap().get_mut(&id.into_u64()) {
            values.record(&mut Text(fields));
        }
    }

    fn on_event(&self, event: &tracing::Event<'_>, _: Context<'_, S>) {
        if event.metadata().target() == fairgate::trace::WAIT_TARGET
            && let Some(parent) = event.parent()
        {
            let mut fields = Fields::new();
            event.record(&mut Text(&mut fields));
            let reason = fields.remove("reason").unwrap_or_default();
            self.waits.lock().unwrap().push((parent.into_u64(), reason));
        }
    }

    fn on_close(&self, id: Id, _: Context<'_, S>) {
        if let Some(mut fields) = self.open.lock().unwrap().remove(&id.into_u64()) {
            fields.insert("id".to_owned(), id.into_u64().to_string());
            self.closed.lock().unwrap().push(fields);
        }
    }
}

impl Captured {
    fn closed_for(&self, tenant: &str) -> Fields {
        let closed = self.closed.lock().unwrap();
        let mine: Vec<_> = closed.iter().filter(|f| f["tenant"] == tenant).collect();
        assert_eq!(mine.len(), 1, "one span for {tenant}'s call: {closed:?}");
        mine[0].clone()
    }

    fn waits_of(&self, span: &Fields) -> Vec<String> {
        let id: u64 = span["id"].parse().unwrap();
        let waits = self.waits.lock().unwrap();
        waits
            .iter()
            .filter(|(p, _)| *p == id)
            .map(|(_, r)| r.clone())
            .collect()
    }
}

fn millis(fields: &Fields, name: &str) -> f64 {
    fields[name]
        .parse()
        .unwrap_or_else(|_| panic!("{name} = {}", fields[name]))
}

fn request(job: Job) -> http::Request<String> {
    let mut req = http::Request::new(String::new());
    req.extensions_mut().insert(job);
    req
}

/// An upstream answering each call after `delay`; the first `throttled` calls get a 429
/// asking for a second's pause.
fn upstream(
    delay: Duration,
    throttled: usize,
) -> impl tower::Service<
    http::Request<String>,
    Response = http::Response<String>,
    Error = fairgate::BoxError,
    Future: Send,
> + Clone
+ Send
+ 'static {
    let calls = Arc::new(Mutex::new(0usize));
    service_fn(move |_req: http::Request<String>| {
        let n = {
            let mut calls = calls.lock().unwrap();
            *calls += 1;
            *calls
        };
        async move {
            tokio::time::sleep(delay).await;
            let status = if n <= throttled { 429 } else { 200 };
            let response = http::Response::builder()
                .status(status)
                .header("retry-after", "1")
                .body(String::new())?;
            Ok::<_, fairgate::BoxError>(response)
        }
    })
}

fn subscriber(captured: &Captured) -> impl tracing::Subscriber + Send + Sync {
    tracing_subscriber::registry().with(captured.clone()).with(
        tracing_subscriber::filter::Targets::new().with_target("fairgate", tracing::Level::DEBUG),
    )
}

#[tokio::test(start_paused = true)]
async fn a_call_that_waited_for_a_slot_says_so_on_its_span() {
    let captured = Captured::default();
    let _traced = tracing::subscriber::set_default(subscriber(&captured));
    let policy = SlotPolicy::builder().global_max(1).build().unwrap();
    let layer = FairgateLayer::builder(Store::memory())
        .slots(policy)
        .build()
        .unwrap();
    let stack = layer.layer(upstream(Duration::from_secs(2), 0));
    // Past the slow start (one call first while the upstream's limits are unknown).
    let warm_up = stack
        .clone()
        .oneshot(request(crate::support::user("warm-up", "pro")));
    warm_up.await.unwrap();
    // The first call holds the only slot for 2 s; the second waits for it.
    // (A response holds its slot until it is dropped: each is dropped once its status is
    // read.)
    let first = stack
        .clone()
        .oneshot(request(crate::support::user("first", "pro")));
    let first = tokio::spawn(async move { first.await.map(|answer| answer.status()) });
    tokio::task::yield_now().await;
    let second = stack
        .clone()
        .oneshot(request(crate::support::user("second", "free")));
    let (first, second) = tokio::join!(first, second);
    assert_eq!(first.unwrap().unwrap(), 200);
    assert_eq!(second.unwrap().status(), 200);

    let span = captured.closed_for("second");
    assert_eq!(span["tier"], "free");
    assert_eq!(span["class"], "critical");
    assert_eq!(span["outcome"], "answered");
    assert_eq!(span["status"], "200");
    assert_eq!(span["attempts"], "1");
    assert_eq!(span["wait_reason"], "slot");
    let slot = millis(&span, "wait_slot_ms");
    assert!(
        (1_900.0..=2_100.0).contains(&slot),
        "waited {slot} ms for its slot"
    );
    assert_eq!(millis(&span, "waited_ms"), slot);
    assert!(!span["upstream"].is_empty(), "{span:?}");
    assert_eq!(captured.waits_of(&span), ["slot"]);
    // The first call went at once.
    let first = captured.closed_for("first");
    assert_eq!(first["wait_reason"], "none");
    assert_eq!(millis(&first, "waited_ms"), 0.0);
}

#[tokio::test(start_paused = true)]
async fn a_retried_call_counts_its_attempts_and_its_backoff() {
    let captured = Captured::default();
    let _traced = tracing::subscriber::set_default(subscriber(&captured));
    let stack = FairgateLayer::new(Store::memory()).layer(upstream(Duration::from_millis(10), 1));
    let answer = stack
        .oneshot(request(crate::support::user("retried", "pro")))
        .await
        .unwrap();
    assert_eq!(answer.status(), 200);

    let span = captured.closed_for("retried");
    assert_eq!(span["attempts"], "2");
    assert_eq!(span["status"], "200");
    assert_eq!(span["outcome"], "answered");
    assert_eq!(span["wait_reason"], "cooldown");
    // retry-after: 1 s, times 1.2 with +/-20% jitter.
    let cooldown = millis(&span, "wait_cooldown_ms");
    assert!(
        (900.0..=1_500.0).contains(&cooldown),
        "backed off {cooldown} ms: {span:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn without_a_subscriber_that_wants_it_no_call_span_is_made() {
    let captured = Captured::default();
    // Only warnings from fairgate: the call span (DEBUG) is not wanted.
    let subscriber = tracing_subscriber::registry().with(captured.clone()).with(
        tracing_subscriber::filter::Targets::new().with_target("fairgate", tracing::Level::WARN),
    );
    let _traced = tracing::subscriber::set_default(subscriber);
    let stack = FairgateLayer::new(Store::memory()).layer(upstream(Duration::from_millis(10), 0));
    let answer = stack
        .oneshot(request(crate::support::user("quiet", "pro")))
        .await
        .unwrap();
    assert_eq!(answer.status(), 200);
    assert!(captured.open.lock().unwrap().is_empty());
    assert!(captured.closed.lock().unwrap().is_empty());
}

#[tokio::test(start_paused = true)]
async fn a_call_refused_at_its_max_wait_is_a_refused_span_with_its_wait() {
    let captured = Captured::default();
    let _traced = tracing::subscriber::set_default(subscriber(&captured));
    let policy = SlotPolicy::builder()
        .global_max(1)
        .tier("guest", 1, Duration::from_secs(8))
        .build()
        .unwrap();
    let layer = FairgateLayer::builder(Store::memory())
        .slots(policy)
        .build()
        .unwrap();
    let stack = layer.layer(upstream(Duration::from_secs(20), 0));
    let warm_up = stack
        .clone()
        .oneshot(request(crate::support::user("warm-up", "pro")));
    let _ = warm_up.await.unwrap().status();
    // The holder keeps the only slot for 20 s; the guest gives up at its 8 s.
    let holder = stack
        .clone()
        .oneshot(request(crate::support::user("holder", "pro")));
    let holder = tokio::spawn(async move { holder.await.map(|answer| answer.status()) });
    tokio::task::yield_now().await;
    let refused = stack
        .clone()
        .oneshot(request(crate::support::user("refused", "guest")))
        .await;
    assert!(refused.unwrap_err().is::<fairgate::Busy>());
    holder.await.unwrap().unwrap();

    let span = captured.closed_for("refused");
    assert_eq!(span["outcome"], "refused");
    assert_eq!(span["attempts"], "0");
    assert_eq!(span["status"], "0");
    assert_eq!(span["wait_reason"], "slot");
    let slot = millis(&span, "wait_slot_ms");
    assert!((7_900.0..=8_100.0).contains(&slot), "waited {slot} ms");
}
