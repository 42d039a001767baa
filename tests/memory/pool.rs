//! A pool of upstreams (`fairgate::pool`): the choice, failover where the call provably did
//! not run, the breaker and its probe, each counted at mock upstreams in paused time.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::time::Duration;

use fairgate::pool::error::{FirstByteTimeout, NoUpstream};
use fairgate::pool::{Model, Pool, Upstream};
use fairgate::{BoxError, Job, Origin};
use tower::util::BoxCloneSyncService;
use tower::{Service, ServiceExt, service_fn};

type Svc = BoxCloneSyncService<http::Request<String>, http::Response<String>, BoxError>;

/// A mock upstream: what it does now (answer, refuse, or answer with a status), the calls
/// it ran, and the calls in flight there at most.
#[derive(Clone, Default)]
struct Mock {
    refuses: Arc<AtomicBool>,
    status: Arc<AtomicU32>,
    ran: Arc<AtomicU32>,
    now: Arc<AtomicUsize>,
    most: Arc<AtomicUsize>,
    delay_ms: Arc<AtomicU32>,
}

impl Mock {
    fn new() -> Self {
        let mock = Mock::default();
        mock.status.store(200, Ordering::SeqCst);
        mock
    }

    fn service(&self) -> Svc {
        let mock = self.clone();
        BoxCloneSyncService::new(service_fn(move |_req: http::Request<String>| {
            let mock = mock.clone();
            async move {
                if mock.refuses.load(Ordering::SeqCst) {
                    let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
                    return Err::<http::Response<String>, BoxError>(refused.into());
                }
                mock.ran.fetch_add(1, Ordering::SeqCst);
                let now = mock.now.fetch_add(1, Ordering::SeqCst) + 1;
                mock.most.fetch_max(now, Ordering::SeqCst);
                let delay = mock.delay_ms.load(Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(u64::from(delay))).await;
                mock.now.fetch_sub(1, Ordering::SeqCst);
                let status = mock.status.load(Ordering::SeqCst) as u16;
                let response = http::Response::builder()
                    .status(status)
                    .body(String::new())
                    .map_err(BoxError::from)?;
                Ok(response)
            }
        }))
    }

    fn ran(&self) -> u32 {
        self.ran.load(Ordering::SeqCst)
    }
}

fn call(tenant: &str) -> http::Request<String> {
    let mut req = http::Request::new("{}".to_owned());
    req.extensions_mut()
        .insert(Job::new(tenant, Origin::UserAction));
    req
}

fn two(a: &Mock, b: &Mock) -> Pool<Svc> {
    Pool::builder()
        .upstream(Upstream::new("a", a.service()))
        .upstream(Upstream::new("b", b.service()))
        .build()
        .unwrap()
}

/// One of two upstreams stops taking connections mid-load: no call is lost (each goes to
/// the other, once), the dead one is set aside at its first refusal, and it is back in the
/// pool within one probe interval of its return.
#[tokio::test(start_paused = true)]
async fn an_upstream_that_refuses_is_set_aside_its_calls_go_to_the_other_and_it_comes_back() {
    let (a, b) = (Mock::new(), Mock::new());
    let pool = two(&a, &b);
    for i in 0..20 {
        let response = pool.clone().oneshot(call(&format!("t{i}"))).await.unwrap();
        assert_eq!(response.status(), 200);
    }
    assert_eq!(a.ran() + b.ran(), 20);
    a.refuses.store(true, Ordering::SeqCst);
    let (before_a, before_b) = (a.ran(), b.ran());
    for i in 0..40 {
        let response = pool.clone().oneshot(call(&format!("t{i}"))).await.unwrap();
        assert_eq!(response.status(), 200, "no call lost");
    }
    assert_eq!(a.ran(), before_a, "a ran nothing while refusing");
    assert_eq!(b.ran(), before_b + 40, "every call ran once, at b");
    let states = pool.upstreams();
    assert!(states[0].set_aside);
    assert_eq!(
        states[0].moved_away, 1,
        "one call tried a before it was set aside"
    );
    // a comes back: the first call after a probe interval probes it and brings it back.
    a.refuses.store(false, Ordering::SeqCst);
    tokio::time::advance(Duration::from_secs(1)).await;
    let response = pool.clone().oneshot(call("t0")).await.unwrap();
    assert_eq!(response.status(), 200);
    assert!(
        !pool.upstreams()[0].set_aside,
        "back within one probe interval"
    );
    assert_eq!(a.ran(), before_a + 1);
}

/// `529` (overloaded: not run) goes elsewhere, and `trip_after` of them in a row set the
/// upstream aside; a `500`, `502`, `503` or `504` goes back to its caller (it may have
/// run) and counts; a `429` goes back and does not count (it is the upstream's rate).
#[tokio::test(start_paused = true)]
async fn overloaded_goes_elsewhere_a_server_error_and_a_429_go_back() {
    let (a, b) = (Mock::new(), Mock::new());
    let pool = Pool::builder()
        .upstream(Upstream::new("a", a.service()).priority(0))
        .upstream(Upstream::new("b", b.service()).priority(1))
        .build()
        .unwrap();
    a.status.store(529, Ordering::SeqCst);
    // A tenant each: a tenant answered by b would stay there (its prompt cache).
    for i in 0..5 {
        let response = pool.clone().oneshot(call(&format!("t{i}"))).await.unwrap();
        assert_eq!(response.status(), 200, "answered once, by b");
    }
    assert_eq!(a.ran(), 3, "set aside after three 529s in a row");
    assert_eq!(b.ran(), 5);
    assert_eq!(pool.upstreams()[0].moved_away, 3);

    let (a, b) = (Mock::new(), Mock::new());
    let pool = Pool::builder()
        .upstream(Upstream::new("a", a.service()).priority(0))
        .upstream(Upstream::new("b", b.service()).priority(1))
        .build()
        .unwrap();
    for status in [500, 502, 503, 504] {
        a.status.store(status, Ordering::SeqCst);
        let response = pool.clone().oneshot(call("t")).await.unwrap();
        assert_eq!(
            u32::from(response.status().as_u16()),
            status,
            "it may have run"
        );
        assert_eq!(b.ran(), 0, "{status}");
        // Not three in a row of one upstream: the next call still goes to `a`.
        a.status.store(200, Ordering::SeqCst);
        let response = pool.clone().oneshot(call("t")).await.unwrap();
        assert_eq!(response.status(), 200);
    }
    a.status.store(429, Ordering::SeqCst);
    for _ in 0..10 {
        let response = pool.clone().oneshot(call("t")).await.unwrap();
        assert_eq!(response.status(), 429);
    }
    assert!(!pool.upstreams()[0].set_aside, "429s are not failures");
    assert_eq!(b.ran(), 0);
}

/// With every upstream overloaded, the caller gets the `529` (the retry layer above waits
/// and retries it), not an error of the pool.
#[tokio::test(start_paused = true)]
async fn when_every_upstream_is_overloaded_the_529_goes_back() {
    let (a, b) = (Mock::new(), Mock::new());
    a.status.store(529, Ordering::SeqCst);
    b.status.store(529, Ordering::SeqCst);
    let pool = two(&a, &b);
    let response = pool.clone().oneshot(call("t")).await.unwrap();
    assert_eq!(response.status(), 529);
    assert_eq!(a.ran() + b.ran(), 2, "each tried once");
}

/// The pool's capacity is the sum of its upstreams': two capped at 2 hold 4 calls at once,
/// and a fifth finds no room.
#[tokio::test(start_paused = true)]
async fn two_upstreams_hold_the_sum_of_their_caps() {
    let (a, b) = (Mock::new(), Mock::new());
    a.delay_ms.store(1_000, Ordering::SeqCst);
    b.delay_ms.store(1_000, Ordering::SeqCst);
    let pool = Pool::builder()
        .upstream(Upstream::new("a", a.service()).max_in_flight(2))
        .upstream(Upstream::new("b", b.service()).max_in_flight(2))
        .build()
        .unwrap();
    let calls: Vec<_> = (0..4)
        .map(|i| tokio::spawn(pool.clone().oneshot(call(&format!("t{i}")))))
        .collect();
    tokio::task::yield_now().await;
    let refused = pool.clone().oneshot(call("t9")).await.unwrap_err();
    let none = refused.downcast_ref::<NoUpstream>().expect("NoUpstream");
    assert_eq!(none.retry_after, None, "full, not set aside");
    for c in calls {
        assert_eq!(c.await.unwrap().unwrap().status(), 200);
    }
    assert_eq!(
        (a.most.load(Ordering::SeqCst), b.most.load(Ordering::SeqCst)),
        (2, 2)
    );
    assert_eq!(
        pool.upstreams()[0].in_flight,
        0,
        "counts back once the bodies are gone"
    );
}

/// A tenant's calls stay on the upstream that holds its prompt cache while it has room;
/// a second priority takes calls only while the first has none.
#[tokio::test(start_paused = true)]
async fn a_tenant_keeps_its_upstream_and_the_second_priority_only_spills() {
    let (a, b) = (Mock::new(), Mock::new());
    let pool = two(&a, &b);
    let _held = pool.clone().oneshot(call("other")).await.unwrap();
    // `other`'s call is in flight at its upstream: `t` goes to the other one, then stays.
    let first = pool.clone().oneshot(call("t")).await.unwrap();
    drop(_held);
    let (ran_a, ran_b) = (a.ran(), b.ran());
    for _ in 0..10 {
        drop(pool.clone().oneshot(call("t")).await.unwrap());
    }
    drop(first);
    assert!(
        (a.ran() - ran_a == 10) ^ (b.ran() - ran_b == 10),
        "all ten on one upstream: {} {}",
        a.ran() - ran_a,
        b.ran() - ran_b
    );

    let (primary, second) = (Mock::new(), Mock::new());
    primary.delay_ms.store(1_000, Ordering::SeqCst);
    let pool = Pool::builder()
        .upstream(Upstream::new("primary", primary.service()).max_in_flight(3))
        .upstream(Upstream::new("second", second.service()).priority(1))
        .build()
        .unwrap();
    let calls: Vec<_> = (0..5)
        .map(|i| tokio::spawn(pool.clone().oneshot(call(&format!("u{i}")))))
        .collect();
    for c in calls {
        c.await.unwrap().unwrap();
    }
    assert_eq!((primary.ran(), second.ran()), (3, 2));
}

/// An upstream given models takes only calls of those models.
#[tokio::test(start_paused = true)]
async fn an_upstream_serves_only_its_models() {
    let (a, b) = (Mock::new(), Mock::new());
    let pool = Pool::builder()
        .upstream(Upstream::new("a", a.service()).models(["claude-haiku-4-5"]))
        .upstream(Upstream::new("b", b.service()))
        .build()
        .unwrap();
    for _ in 0..6 {
        let mut req = call("t");
        req.extensions_mut()
            .insert(Model("claude-opus-4-1".to_owned()));
        pool.clone().oneshot(req).await.unwrap();
    }
    assert_eq!((a.ran(), b.ran()), (0, 6));
}

/// A probe whose caller goes away lets the next call probe; an answer's head that never
/// comes sets the upstream aside and is not sent again.
#[tokio::test(start_paused = true)]
async fn a_dropped_probe_and_a_first_byte_timeout() {
    let a = Mock::new();
    let pool = Pool::builder()
        .upstream(Upstream::new("a", a.service()))
        .first_byte_timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    a.delay_ms.store(10_000, Ordering::SeqCst);
    let timed_out = pool.clone().oneshot(call("t")).await.unwrap_err();
    assert!(timed_out.is::<FirstByteTimeout>(), "{timed_out}");
    assert_eq!(a.ran(), 1);
    let refused = pool.clone().oneshot(call("t")).await.unwrap_err();
    assert!(
        refused
            .downcast_ref::<NoUpstream>()
            .unwrap()
            .retry_after
            .is_some()
    );
    tokio::time::advance(Duration::from_secs(1)).await;
    // The probe's caller gives up before the answer: the next call probes again.
    let mut probe = pool.clone();
    let pending = tokio::time::timeout(
        Duration::from_millis(10),
        probe.ready().await.unwrap().call(call("t")),
    )
    .await;
    assert!(pending.is_err());
    a.delay_ms.store(0, Ordering::SeqCst);
    let response = pool.clone().oneshot(call("t")).await.unwrap();
    assert_eq!(response.status(), 200);
    assert!(!pool.upstreams()[0].set_aside);
}

#[test]
fn a_pool_refuses_what_cannot_work() {
    let a = Mock::new();
    assert!(Pool::<Svc>::builder().build().is_err());
    let same = Pool::builder()
        .upstream(Upstream::new("a", a.service()))
        .upstream(Upstream::new("a", a.service()))
        .build();
    assert!(same.is_err());
    let zero = Pool::builder()
        .upstream(Upstream::new("a", a.service()).max_in_flight(0))
        .build();
    assert!(zero.is_err());
}

/// The answer came at 1 s, within a 5 s first-byte timeout, but the caller's task is polled
/// again only at 6 s (a busy executor): it gets the answer, and the upstream is not set
/// aside.
#[tokio::test(start_paused = true)]
async fn an_answer_in_time_is_never_taken_for_a_timeout_however_late_it_is_polled() {
    use std::future::Future;
    let a = Mock::new();
    let mut pool = Pool::builder()
        .upstream(Upstream::new("a", a.service()))
        .first_byte_timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    a.delay_ms.store(1_000, Ordering::SeqCst);
    let mut call_under_way = Box::pin(pool.ready().await.unwrap().call(call("t")));
    let pending = std::future::poll_fn(|cx| {
        std::task::Poll::Ready(call_under_way.as_mut().poll(cx).is_pending())
    })
    .await;
    assert!(pending);
    tokio::time::advance(Duration::from_secs(6)).await;
    let answer = call_under_way.await;
    assert!(answer.is_ok(), "{:?}", answer.err());
    assert!(!pool.upstreams()[0].set_aside);
}

/// An upstream's cap holds across threads: its place is checked and taken in one step.
#[test]
fn max_in_flight_holds_when_calls_choose_at_once_on_two_threads() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        for round in 0..300 {
            let a = Mock::new();
            a.delay_ms.store(3, Ordering::SeqCst);
            let pool = Pool::builder()
                .upstream(Upstream::new("a", a.service()).max_in_flight(1))
                .build()
                .unwrap();
            let calls: Vec<_> = (0..8)
                .map(|t| tokio::spawn(pool.clone().oneshot(call(&format!("t{t}")))))
                .collect();
            for c in calls {
                let _ = c.await;
            }
            let most = a.most.load(Ordering::SeqCst);
            assert!(
                most <= 1,
                "round {round}: {most} calls at once, max_in_flight 1"
            );
        }
    });
}
