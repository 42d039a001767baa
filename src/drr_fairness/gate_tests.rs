//! The fair queue's side of the rate gate, against a scripted gate: who goes when it opens,
//! and what a request that never went takes (nothing).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;
use tower::{Layer, ServiceExt, service_fn};

use crate::gate::{RateAsk, RateGate, RateLimit, Receipt, Verdict, WaitReason};
use crate::store::DIMS;
use crate::{DrrFairnessLayer, Job, Origin, Priority, Store};

/// A rate gate closed until a set instant, then open; it counts what it gave and got back.
#[derive(Default)]
struct Scripted {
    closed_until: Mutex<Option<Instant>>,
    given: AtomicUsize,
    used: AtomicUsize,
    unused: AtomicUsize,
    changed: Arc<tokio::sync::Notify>,
    /// As learned pacing does: a check with no cell reserved reserves one due a moment
    /// later (and holds the caller until then); the next check takes it, whoever asks.
    reserve_first: bool,
    reserved: std::sync::atomic::AtomicBool,
}

impl RateLimit for Scripted {
    fn default_key(&self) -> Arc<str> {
        Arc::from("k")
    }

    fn check(self: Arc<Self>, ask: &RateAsk<'_>) -> Verdict {
        let key = ask.key;
        if let Some(at) = *self.closed_until.lock().unwrap()
            && Instant::now() < at
        {
            return Verdict::Until(at, WaitReason::Rate);
        }
        if self.reserve_first && !self.reserved.swap(true, Ordering::SeqCst) {
            return Verdict::Until(Instant::now() + Duration::from_millis(1), WaitReason::Rate);
        }
        self.reserved.store(false, Ordering::SeqCst);
        self.given.fetch_add(1, Ordering::SeqCst);
        let gate: Arc<dyn RateLimit> = self.clone();
        Verdict::Go(Some(Box::new(Receipt {
            key: key.clone(),
            need: [1; DIMS],
            charged: [1, 0, 0, 0],
            probe: false,
            used: false,
            due: Instant::now(),
            fleet_tokens: 0,
            gate: Some(gate),
            route: None,
        })))
    }

    fn returned(&self, receipt: &Receipt) {
        let count = if receipt.used {
            &self.used
        } else {
            &self.unused
        };
        count.fetch_add(1, Ordering::SeqCst);
    }

    fn changed(&self) -> Arc<tokio::sync::Notify> {
        self.changed.clone()
    }
}

/// Who reached the upstream, in order: tenant and class.
type Went = Arc<Mutex<Vec<(String, Priority)>>>;

/// A fair queue (window 8) with the scripted gate, over an upstream that logs who went.
fn fair(
    gate: Arc<Scripted>,
) -> (
    DrrFairnessLayer,
    Went,
    impl tower::Service<
        http::Request<()>,
        Response = http::Response<crate::body::GuardedBody<(), super::Permit>>,
        Error = crate::BoxError,
        Future: Send,
    > + Clone,
) {
    let layer = DrrFairnessLayer::builder(Store::memory(), 8)
        .rate_gate(RateGate::new(gate))
        .build()
        .unwrap();
    let went: Went = Arc::default();
    let log = went.clone();
    let service = layer.layer(service_fn(move |req: http::Request<()>| {
        let job = req.extensions().get::<Job>().cloned().unwrap();
        log.lock().unwrap().push((
            job.tenant().as_str().to_owned(),
            job.priority().unwrap_or(Priority::Standard),
        ));
        async { Ok::<_, std::convert::Infallible>(http::Response::new(())) }
    }));
    (layer, went, service)
}

fn request(tenant: &str, priority: Priority) -> http::Request<()> {
    let mut job = Job::new(tenant, Origin::UserAction);
    job.set_priority(priority);
    let mut req = http::Request::new(());
    req.extensions_mut().insert(job);
    req
}

#[tokio::test(start_paused = true)]
async fn held_by_the_rate_the_fair_order_decides_who_goes_when_it_opens() {
    let gate = Arc::new(Scripted::default());
    let opens = Instant::now() + Duration::from_secs(1);
    *gate.closed_until.lock().unwrap() = Some(opens);
    let (_layer, went, service) = fair(gate.clone());
    // Five batch calls first, then one critical call: all held by the rate.
    let mut calls = Vec::new();
    for i in 0..5 {
        let call = service
            .clone()
            .oneshot(request(&format!("b{i}"), Priority::Batch));
        calls.push(tokio::spawn(call));
    }
    tokio::task::yield_now().await;
    calls.push(tokio::spawn(
        service.clone().oneshot(request("user", Priority::Critical)),
    ));
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(went.lock().unwrap().is_empty(), "nothing goes while held");
    assert_eq!(
        gate.given.load(Ordering::SeqCst),
        0,
        "no cell taken for a wait"
    );
    for call in calls {
        drop(call.await.unwrap().unwrap());
    }
    let went = went.lock().unwrap();
    assert_eq!(went.len(), 6);
    assert_eq!(went[0].0, "user", "the critical call goes first: {went:?}");
    assert_eq!(
        gate.given.load(Ordering::SeqCst),
        6,
        "one cell per call that went"
    );
    assert_eq!(gate.used.load(Ordering::SeqCst), 6);
    assert_eq!(gate.unused.load(Ordering::SeqCst), 0);
    assert!(Instant::now() >= opens);
}

#[tokio::test(start_paused = true)]
async fn a_request_that_leaves_while_the_rate_holds_it_takes_nothing() {
    let gate = Arc::new(Scripted::default());
    *gate.closed_until.lock().unwrap() = Some(Instant::now() + Duration::from_secs(5));
    let (layer, went, service) = fair(gate.clone());
    let gave_up = tokio::time::timeout(
        Duration::from_secs(1),
        service.clone().oneshot(request("t", Priority::Standard)),
    )
    .await;
    assert!(gave_up.is_err(), "held by the rate");
    assert_eq!(layer.queued(None), 0, "it left the queue");
    assert_eq!(gate.given.load(Ordering::SeqCst), 0);
    // When the gate opens, the next caller goes at once: no cell is owed to the one that
    // left.
    tokio::time::sleep(Duration::from_secs(4)).await;
    drop(
        service
            .oneshot(request("u", Priority::Standard))
            .await
            .unwrap(),
    );
    assert_eq!(went.lock().unwrap().len(), 1);
    assert_eq!(gate.given.load(Ordering::SeqCst), 1);
}

#[tokio::test(start_paused = true)]
async fn after_a_long_hold_the_class_weights_still_decide_who_goes_first() {
    // While the gate is closed, the fair queue looks for the next call at every arrival and
    // every few hundred milliseconds, and finds it held, over and over. Three critical and
    // three batch calls wait 30 s; then the critical ones go first, as the class weights
    // say (90%).
    let gate = Arc::new(Scripted::default());
    *gate.closed_until.lock().unwrap() = Some(Instant::now() + Duration::from_secs(30));
    let (_layer, went, service) = fair(gate.clone());
    let mut calls = Vec::new();
    for i in 0..3 {
        for priority in [Priority::Batch, Priority::Critical] {
            let call = service
                .clone()
                .oneshot(request(&format!("{priority:?}{i}"), priority));
            calls.push(tokio::spawn(call));
            tokio::task::yield_now().await;
        }
    }
    for call in calls {
        drop(call.await.unwrap().unwrap());
    }
    let order: Vec<Priority> = went.lock().unwrap().iter().map(|(_, p)| *p).collect();
    assert_eq!(
        &order[..3],
        &[Priority::Critical; 3],
        "critical first: {order:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn the_cell_reserved_for_the_fair_orders_head_is_the_heads() {
    // The gate reserves a cell for the call that asks first (the head of the fair order:
    // the critical call) and holds it a moment; the dispatcher must not let the next
    // candidate (a batch call, same key) take that cell meanwhile, or the head asks again
    // next time and loses again, for as long as batch has work.
    let gate = Arc::new(Scripted {
        reserve_first: true,
        ..Scripted::default()
    });
    *gate.closed_until.lock().unwrap() = Some(Instant::now() + Duration::from_secs(1));
    let (_layer, went, service) = fair(gate.clone());
    let mut calls = Vec::new();
    for i in 0..5 {
        let call = service
            .clone()
            .oneshot(request(&format!("b{i}"), Priority::Batch));
        calls.push(tokio::spawn(call));
    }
    tokio::task::yield_now().await;
    calls.push(tokio::spawn(
        service.clone().oneshot(request("user", Priority::Critical)),
    ));
    for call in calls {
        drop(call.await.unwrap().unwrap());
    }
    let went = went.lock().unwrap();
    assert_eq!(went.len(), 6);
    assert_eq!(
        went[0].0, "user",
        "the head's cell went to another: {went:?}"
    );
}
