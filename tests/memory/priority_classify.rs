//! PriorityClassify: the rule, demotion, and the store under it — one suite run on the memory
//! store in paused time and on a real Redis with the time rules scaled down.

use std::convert::Infallible;
use std::time::Duration;

use crate::support::request;
use fairgate::{
    DemotionPolicy, Job, MissingJob, Origin, Priority, PriorityClassifyLayer, Store, TenantId,
};
use tower::{Layer, Service, ServiceExt, service_fn};

const HOUR: Duration = Duration::from_secs(3600);

/// One backend plus the time scale its rules run at.
struct Rig {
    store: Store,
    window: Duration,
    policy: DemotionPolicy,
    /// How long a worker may reuse a demotion check.
    cache_ttl: Duration,
    #[cfg(feature = "redis")]
    server: Option<crate::support::RedisServer>,
}

impl Rig {
    /// The reference's own numbers, for tokio's paused time.
    fn memory() -> Rig {
        Rig {
            store: Store::memory(),
            window: Duration::from_secs(60),
            policy: DemotionPolicy::default(),
            cache_ttl: Duration::ZERO,
            #[cfg(feature = "redis")]
            server: None,
        }
    }

    /// The same rules scaled down (Redis keeps its own clock, so real time it is).
    #[cfg(feature = "redis")]
    async fn redis() -> Rig {
        let server = crate::support::RedisServer::start();
        // Scaled down from 60 s / 5 min, with room for a loaded machine's delays.
        let window = Duration::from_millis(2000);
        let cache_ttl = Duration::from_millis(50);
        let store = Rig::redis_store(&server.url(), window, cache_ttl).await;
        Rig {
            store,
            window,
            policy: DemotionPolicy::builder()
                .demote_for(Duration::from_millis(3000))
                .build()
                .unwrap(),
            cache_ttl,
            server: Some(server),
        }
    }

    #[cfg(feature = "redis")]
    async fn redis_store(url: &str, window: Duration, cache_ttl: Duration) -> Store {
        Store::builder()
            .throttle_window(window)
            .cache_ttl(cache_ttl)
            // Counts move when a scenario says so (`settle`), not by chance.
            .flush_interval(Duration::from_secs(30))
            .probe_interval(Duration::from_millis(20))
            .redis(url)
            .await
            .unwrap()
    }

    fn layer(&self) -> PriorityClassifyLayer {
        PriorityClassifyLayer::new(self.store.clone()).demotion(self.policy.clone())
    }

    /// The priority the layer gives `job`.
    async fn classify(&self, job: Job) -> Priority {
        classify_with(self.layer(), job).await
    }

    /// Lets batched counts reach the store and local caches expire.
    async fn settle(&self) {
        self.store.flush().await;
        if !self.cache_ttl.is_zero() {
            tokio::time::sleep(self.cache_ttl + Duration::from_millis(10)).await;
        }
    }

    async fn throttle(&self, tenant: &TenantId, times: u32) {
        for _ in 0..times {
            self.store.record_throttle(tenant).await;
        }
    }
}

async fn classify_with<R: fairgate::ClassifyRule>(
    layer: PriorityClassifyLayer<R>,
    job: Job,
) -> Priority {
    let inner = service_fn(|req: http::Request<()>| async move {
        Ok::<_, Infallible>(req.extensions().get::<Job>().and_then(Job::priority))
    });
    layer
        .layer(inner)
        .oneshot(request(job))
        .await
        .expect("classify never fails on a request with a job")
        .expect("the layer sets a priority")
}

fn scheduled(tenant: &str) -> Job {
    Job::new(tenant, Origin::Scheduled).with_sla(HOUR)
}

crate::support::on_both_stores!(
    classification_follows_origin_and_sla,
    a_priority_set_earlier_is_never_trusted,
    five_throttles_within_the_window_demote,
    four_throttles_do_not_demote,
    a_throttle_that_slid_out_of_the_window_does_not_count,
    tokens_over_one_and_a_half_budgets_demote,
    tokens_at_exactly_one_and_a_half_budgets_do_not_demote,
    per_tenant_budgets_are_respected,
    demotion_expires_and_the_rule_applies_again,
    odd_tenant_names_neither_break_keys_nor_collide,
    missing_job_is_a_typed_error,
);

async fn classification_follows_origin_and_sla(rig: Rig) {
    use Origin::*;
    use Priority::*;
    let day = 24 * HOUR;
    let slas = [
        None,
        Some(Duration::ZERO),
        Some(HOUR),
        Some(day - Duration::from_millis(1)),
        Some(day),
        Some(2 * day),
    ];
    for origin in [UserAction, Scheduled, BatchJob] {
        for sla in slas {
            let expected = match (origin, sla) {
                (UserAction, _) => Critical,
                (_, None) => Batch,
                (_, Some(sla)) if sla >= day => Batch,
                _ => Standard,
            };
            let mut job = Job::new("t", origin);
            if let Some(sla) = sla {
                job = job.with_sla(sla);
            }
            assert_eq!(
                rig.classify(job).await,
                expected,
                "{origin:?} with sla {sla:?}"
            );
        }
    }
    // The edge, spelled out: exactly 24 h is batch, a millisecond less is standard.
    assert_eq!(
        rig.classify(Job::new("t", Scheduled).with_sla(day)).await,
        Batch
    );
    assert_eq!(
        rig.classify(Job::new("t", Scheduled).with_sla(day - Duration::from_millis(1)))
            .await,
        Standard
    );
}

async fn a_priority_set_earlier_is_never_trusted(rig: Rig) {
    // An upstream classifier (or a job reused from a critical request) marks everything
    // critical; the central layer below decides again from origin and SLA.
    let everything_critical =
        PriorityClassifyLayer::new(Store::memory()).rule(|_: &Job| Priority::Critical);
    let inner = service_fn(|req: http::Request<()>| async move {
        Ok::<_, Infallible>(req.extensions().get::<Job>().and_then(Job::priority))
    });
    let service = everything_critical.layer(rig.layer().layer(inner));
    let got = service
        .oneshot(request(Job::new("t", Origin::BatchJob)))
        .await
        .unwrap();
    assert_eq!(got, Some(Priority::Batch));
}

async fn five_throttles_within_the_window_demote(rig: Rig) {
    let tenant = TenantId::new("runaway");
    assert_eq!(rig.classify(scheduled("runaway")).await, Priority::Standard);
    rig.throttle(&tenant, 5).await;
    rig.settle().await;
    assert_eq!(rig.classify(scheduled("runaway")).await, Priority::Batch);
    assert_eq!(
        rig.classify(Job::new("runaway", Origin::UserAction)).await,
        Priority::Batch
    );
    // Others are untouched.
    assert_eq!(
        rig.classify(scheduled("neighbour")).await,
        Priority::Standard
    );
}

async fn four_throttles_do_not_demote(rig: Rig) {
    let tenant = TenantId::new("busy");
    rig.throttle(&tenant, 4).await;
    rig.settle().await;
    assert_eq!(rig.store.throttle_count(&tenant).await, 4);
    assert_eq!(rig.classify(scheduled("busy")).await, Priority::Standard);
}

async fn a_throttle_that_slid_out_of_the_window_does_not_count(rig: Rig) {
    let tenant = TenantId::new("sliding");
    rig.throttle(&tenant, 1).await;
    tokio::time::sleep(rig.window / 2).await;
    rig.throttle(&tenant, 3).await;
    // The first throttle leaves the window; the fifth arrives after it.
    tokio::time::sleep(rig.window / 2 + rig.window / 10).await;
    rig.throttle(&tenant, 1).await;
    rig.settle().await;
    assert_eq!(rig.store.throttle_count(&tenant).await, 4);
    assert_eq!(rig.classify(scheduled("sliding")).await, Priority::Standard);
}

async fn tokens_over_one_and_a_half_budgets_demote(rig: Rig) {
    // Counted by the layer itself: a 150,001-token day against the default 100,000 budget.
    let big = scheduled("hungry").with_cost(150_001);
    assert_eq!(
        rig.classify(big).await,
        Priority::Standard,
        "the check sees the tokens before this job"
    );
    rig.settle().await;
    assert_eq!(
        rig.store.tokens_today(&TenantId::new("hungry")).await,
        150_001
    );
    assert_eq!(rig.classify(scheduled("hungry")).await, Priority::Batch);
}

async fn tokens_at_exactly_one_and_a_half_budgets_do_not_demote(rig: Rig) {
    let tenant = TenantId::new("edge");
    rig.store.add_tokens(&tenant, 150_000);
    rig.settle().await;
    assert_eq!(
        rig.classify(scheduled("edge").with_cost(1)).await,
        Priority::Standard
    );
    rig.settle().await;
    // One more token (the job above) and it is over.
    assert_eq!(rig.store.tokens_today(&tenant).await, 150_001);
    assert_eq!(rig.classify(scheduled("edge")).await, Priority::Batch);
}

async fn per_tenant_budgets_are_respected(rig: Rig) {
    let small = TenantId::new("small-plan");
    let large = TenantId::new("large-plan");
    rig.store
        .set_daily_budget(&small, Some(1_000))
        .await
        .unwrap();
    rig.store
        .set_daily_budget(&large, Some(1_000_000))
        .await
        .unwrap();
    assert_eq!(rig.store.daily_budget(&small).await, Some(1_000));
    rig.store.add_tokens(&small, 1_501);
    rig.store.add_tokens(&large, 1_000_000);
    rig.settle().await;
    assert_eq!(rig.classify(scheduled("small-plan")).await, Priority::Batch);
    assert_eq!(
        rig.classify(scheduled("large-plan")).await,
        Priority::Standard
    );
    // Clearing a budget falls back to the policy's default (100,000).
    rig.store.set_daily_budget(&large, None).await.unwrap();
    assert_eq!(rig.store.daily_budget(&large).await, None);
    rig.settle().await;
    assert_eq!(rig.classify(scheduled("large-plan")).await, Priority::Batch);
}

async fn demotion_expires_and_the_rule_applies_again(rig: Rig) {
    let tenant = TenantId::new("cooling");
    rig.throttle(&tenant, 5).await;
    rig.settle().await;
    assert_eq!(
        rig.classify(Job::new("cooling", Origin::UserAction)).await,
        Priority::Batch
    );
    let left = rig.store.demoted_for(&tenant).await.expect("demoted");
    assert!(left <= rig.policy.demote_for());

    // Still demoted just before the end...
    tokio::time::sleep(rig.policy.demote_for() - rig.policy.demote_for() / 5).await;
    assert_eq!(
        rig.classify(Job::new("cooling", Origin::UserAction)).await,
        Priority::Batch
    );
    // ...and classified by the rule again after it (the throttles left the window long ago).
    tokio::time::sleep(rig.policy.demote_for() / 5 + rig.cache_ttl + Duration::from_millis(50))
        .await;
    assert_eq!(rig.store.demoted_for(&tenant).await, None);
    assert_eq!(
        rig.classify(Job::new("cooling", Origin::UserAction)).await,
        Priority::Critical
    );
}

async fn odd_tenant_names_neither_break_keys_nor_collide(rig: Rig) {
    let long = "x".repeat(10 * 1024);
    let names = [
        "{acme}",
        "}{",
        "a:b",
        "a:b:throttles",
        "*",
        "a b",
        "line\nbreak",
        "ünïcødé 🚀",
        "%7B",
        "",
        long.as_str(),
        "{t:a}:throttles",
    ];
    // Tenant i gets i + 1 throttles: any shared key would show up as a wrong count.
    for (i, name) in names.iter().enumerate() {
        rig.throttle(&TenantId::new(name), i as u32 % 4 + 1).await;
    }
    for (i, name) in names.iter().enumerate() {
        let count = rig.store.throttle_count(&TenantId::new(name)).await;
        assert_eq!(
            count,
            i as u32 % 4 + 1,
            "tenant {:?}",
            &name[..name.len().min(20)]
        );
    }
    #[cfg(feature = "redis")]
    if let Some(server) = &rig.server {
        // Every key keeps its structure: one hash tag, no raw separator from a name.
        let keys = server.command("KEYS *");
        let names: Vec<&str> = keys
            .lines()
            .filter(|l| l.starts_with("fairgate:{t:"))
            .collect();
        assert_eq!(names.len(), 12, "one throttle set per tenant:\n{keys}");
        for key in names {
            assert_eq!(key.matches('{').count(), 1, "{key}");
            assert_eq!(key.matches('}').count(), 1, "{key}");
            assert!(key.ends_with("}:throttles"), "{key}");
        }
    }
}

async fn missing_job_is_a_typed_error(rig: Rig) {
    let mut service = rig.layer().layer(service_fn(|_: http::Request<()>| async {
        Ok::<_, Infallible>(())
    }));
    let err = service
        .ready()
        .await
        .unwrap()
        .call(http::Request::new(()))
        .await
        .expect_err("no job, no call");
    assert!(err.is::<MissingJob>(), "{err}");
    assert_eq!(err.to_string(), "request carries no fairgate job");
}

/// A metric as the debugging recorder saw it: name, labels, and the value of a counter or a
/// gauge, or the number of samples of a histogram.
type Recorded = (String, Vec<(String, String)>, f64);

fn recorded(snapshotter: &metrics_util::debugging::Snapshotter) -> Vec<Recorded> {
    use metrics_util::debugging::DebugValue;
    snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .map(|(key, _, _, value)| {
            let labels = key
                .key()
                .labels()
                .map(|l| (l.key().to_owned(), l.value().to_owned()))
                .collect();
            let value = match value {
                DebugValue::Counter(n) => n as f64,
                DebugValue::Gauge(g) => g.0,
                DebugValue::Histogram(samples) => samples.len() as f64,
            };
            (key.key().name().to_owned(), labels, value)
        })
        .collect()
}

fn metric(seen: &[Recorded], name: &str, label: Option<(&str, &str)>) -> Option<f64> {
    seen.iter()
        .find(|(n, labels, _)| {
            n == name && label.is_none_or(|(k, v)| labels.iter().any(|(lk, lv)| lk == k && lv == v))
        })
        .map(|(_, _, value)| *value)
}

#[tokio::test(start_paused = true)]
async fn latency_tokens_and_demotions_are_published() {
    use fairgate::metrics::{DEMOTED_TENANTS, INPUT_TOKENS, REQUEST_LATENCY};
    let recorder = metrics_util::debugging::DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let _metrics = metrics::set_default_local_recorder(&recorder);
    let (events, _tracing) = crate::support::EventCounter::install();

    let rig = Rig::memory();
    let slow = service_fn(|req: http::Request<()>| async move {
        tokio::time::sleep(Duration::from_millis(250)).await;
        Ok::<_, Infallible>(req.extensions().get::<Job>().and_then(Job::priority))
    });
    let service = rig.layer().layer(slow);
    service
        .clone()
        .oneshot(request(
            Job::new("acme", Origin::UserAction).with_cost(1_200),
        ))
        .await
        .unwrap();
    service
        .clone()
        .oneshot(request(scheduled("acme").with_cost(300)))
        .await
        .unwrap();

    rig.throttle(&TenantId::new("runaway"), 5).await;
    service
        .clone()
        .oneshot(request(scheduled("runaway")))
        .await
        .unwrap();
    assert_eq!(events.count("tenant.demoted"), 1, "logged when it happens");
    service
        .clone()
        .oneshot(request(scheduled("runaway")))
        .await
        .unwrap();
    assert_eq!(
        events.count("tenant.demoted"),
        1,
        "not again while it lasts"
    );
    // The demoted gauge is refreshed by the store's sweep, at most once a second.
    tokio::time::sleep(Duration::from_secs(1)).await;
    rig.store.throttle_count(&TenantId::new("anyone")).await;

    let seen = recorded(&snapshotter);
    assert_eq!(
        metric(&seen, INPUT_TOKENS, Some(("tenant_id", "acme"))),
        Some(1_500.0)
    );
    assert_eq!(
        metric(&seen, REQUEST_LATENCY, Some(("priority", "critical"))),
        Some(1.0)
    );
    assert_eq!(
        metric(&seen, REQUEST_LATENCY, Some(("priority", "standard"))),
        Some(1.0)
    );
    assert_eq!(
        metric(&seen, REQUEST_LATENCY, Some(("priority", "batch"))),
        Some(2.0)
    );
    assert_eq!(metric(&seen, DEMOTED_TENANTS, None), Some(1.0));
}

#[tokio::test(start_paused = true)]
async fn latency_is_labelled_by_outcome_answered_refused_or_failed() {
    use fairgate::metrics::REQUEST_LATENCY;
    use fairgate::reject::Rejection;
    use fairgate::{BoxError, FairgateLayer, SlotPolicy, Store};
    let recorder = metrics_util::debugging::DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let _metrics = metrics::set_default_local_recorder(&recorder);

    // One guest slot and no wait: a second guest call while the first is out is refused.
    let slots = SlotPolicy::builder()
        .tier("guest", 1, Duration::ZERO)
        .build()
        .unwrap();
    let stack = FairgateLayer::builder(Store::memory())
        .slots(slots)
        .build()
        .unwrap();
    let service = stack.layer(service_fn(|req: http::Request<&'static str>| async move {
        tokio::time::sleep(Duration::from_millis(100)).await;
        match *req.body() {
            "fail" => Err::<http::Response<String>, BoxError>("upstream unreachable".into()),
            _ => Ok(http::Response::new(String::new())),
        }
    }));
    let guest = |body: &'static str| {
        let mut req = http::Request::new(body);
        req.extensions_mut()
            .insert(Job::new("visitor", Origin::UserAction).with_tier("guest"));
        req
    };
    let held = tokio::spawn(service.clone().oneshot(guest("ok")));
    tokio::time::sleep(Duration::from_millis(10)).await;
    let refused = service.clone().oneshot(guest("ok")).await.unwrap_err();
    assert!(Rejection::from_error(&*refused).is_some(), "{refused}");
    drop(held.await.unwrap().unwrap());
    service.clone().oneshot(guest("fail")).await.unwrap_err();

    let seen = recorded(&snapshotter);
    for outcome in ["answered", "refused", "failed"] {
        let count = seen
            .iter()
            .find(|(name, labels, _)| {
                name == REQUEST_LATENCY
                    && labels.iter().any(|(k, v)| k == "outcome" && v == outcome)
                    && labels
                        .iter()
                        .any(|(k, v)| k == "priority" && v == "critical")
            })
            .map(|(_, _, value)| *value);
        assert_eq!(count, Some(1.0), "outcome {outcome}: {seen:?}");
    }
}
