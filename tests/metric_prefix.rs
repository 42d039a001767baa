//! The metric prefix is process wide, so it has a test binary of its own: one test, in
//! order, because the first successful call fixes the names for the whole process.

use std::convert::Infallible;
use std::time::Duration;

use fairgate::metrics::set_metric_prefix;
use fairgate::{
    BackoffPolicy, DrrFairnessLayer, Job, Origin, PriorityClassifyLayer, RetryAfterBackoffLayer,
    SlotPolicy, Store, TierSlotLimitLayer,
};
use metrics_util::debugging::DebuggingRecorder;
use tower::{ServiceBuilder, ServiceExt, service_fn};

#[tokio::test(start_paused = true)]
async fn every_metric_is_published_under_the_chosen_prefix_and_it_is_set_once() {
    // Refused with a message, and nothing fixed: the valid call below still succeeds.
    for bad in ["9lives_", "has space_", "dash-", "ünicode_"] {
        let err = set_metric_prefix(bad).unwrap_err().to_string();
        assert!(err.contains("metric prefix"), "{bad}: {err}");
    }
    set_metric_prefix("acme_llm_").unwrap();
    let err = set_metric_prefix("other_").unwrap_err().to_string();
    assert!(err.contains("already fixed"), "{err}");

    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let _guard = metrics::set_default_local_recorder(&recorder);

    let store = Store::memory();
    let upstream = service_fn(|_req: http::Request<String>| async {
        tokio::time::sleep(Duration::from_millis(10)).await;
        Ok::<_, Infallible>(
            http::Response::builder()
                .status(429)
                .body(String::new())
                .unwrap(),
        )
    });
    let slots = TierSlotLimitLayer::new(store.clone(), SlotPolicy::default());
    let claude = ServiceBuilder::new()
        .layer(PriorityClassifyLayer::new(store.clone()))
        .layer(
            DrrFairnessLayer::builder(store.clone(), 1)
                .slot_gate(slots.gate())
                .build()
                .unwrap(),
        )
        .layer(slots)
        .layer(RetryAfterBackoffLayer::new(
            store.clone(),
            BackoffPolicy::default(),
        ))
        .service(upstream);
    // Three at once through a window of one: two wait in the queue. Each answer (and the
    // permit in its body) is dropped as soon as its status is read.
    let calls = (0..3).map(|i| {
        let job = Job::new(format!("tenant-{i}"), Origin::UserAction)
            .with_tier("pro")
            .with_cost(100);
        let mut req = http::Request::new(String::from("{}"));
        req.extensions_mut().insert(job);
        let claude = claude.clone();
        async move { claude.oneshot(req).await.map(|response| response.status()) }
    });
    for status in futures_util::future::join_all(calls).await {
        assert_eq!(status.unwrap(), 429);
    }

    let names: Vec<String> = snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .map(|(key, ..)| key.key().name().to_owned())
        .collect();
    for expected in [
        "acme_llm_request_latency_seconds",
        "acme_llm_input_tokens_total",
        "acme_llm_queue_depth",
        "acme_llm_drr_fairness_index",
        "acme_llm_slots_in_use",
        "acme_llm_throttle_count",
        "acme_llm_retries_total",
        "acme_llm_retries_given_up_total",
    ] {
        assert!(
            names.iter().any(|n| n == expected),
            "{expected} in {names:?}"
        );
    }
    assert!(
        names.iter().all(|n| n.starts_with("acme_llm_")),
        "every name carries the prefix: {names:?}"
    );
}
