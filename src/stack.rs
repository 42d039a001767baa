//! The four layers in the recommended order, as one layer ([`FairgateLayer`]).

use std::fmt;

use tower_layer::Layer;

use crate::body::GuardedBody;
use crate::drr_fairness::{DrrFairnessBuilder, Permit, Settler};
use crate::error::ConfigError;
use crate::priority_classify::PriorityClassify;
use crate::rate::OneUpstream;
use crate::retry_after_backoff::{ByClone, ResponseBody, RetryAfterBackoff};
use crate::tier_slot_limit::{SlotPermit, TierSlotLimit};
use crate::{
    BackoffPolicy, ClassifyRule, DefaultRule, DemotionPolicy, DrrFairness, DrrFairnessLayer,
    PriorityClassifyLayer, RetryAfterBackoffLayer, SlotPolicy, Store, TierSlotLimitLayer,
};

/// The service [`FairgateLayer`] builds around `S`.
pub type Fairgate<S, C = ByClone, R = DefaultRule, K = OneUpstream> =
    PriorityClassify<RetryAfterBackoff<DrrFairness<TierSlotLimit<S>>, C, K>, R>;

/// The response body of [`Fairgate`] for an inner `http::Response<B>`: the upstream body,
/// holding the window permit and the slot until it ends, fails or is dropped.
pub type FairgateBody<B> = ResponseBody<GuardedBody<GuardedBody<B, SlotPermit>, Permit>>;

/// The four layers in the recommended order, as one layer.
///
/// [`FairgateLayer`] applies [`PriorityClassify`], [`RetryAfterBackoff`], [`DrrFairness`] and
/// [`TierSlotLimit`] in that order (see [`crate::admission`] for why this order), with one
/// store and their policies, so a whole admission stack is one line:
///
/// ```
/// use fairgate::{FairgateLayer, Job, Origin, SlotPolicy, Store};
/// use tower::{Layer, ServiceExt, service_fn};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), fairgate::BoxError> {
/// let fairgate = FairgateLayer::builder(Store::memory())
///     .slots(SlotPolicy::builder().global_max(40).build()?)
///     .window(40)
///     .build()?;
/// let claude = fairgate.layer(service_fn(|_req: http::Request<String>| async {
///     Ok::<_, std::convert::Infallible>(http::Response::new("{}".to_owned()))
/// }));
///
/// let mut req = http::Request::new("{}".to_owned());
/// req.extensions_mut().insert(Job::new("tenant-42", Origin::UserAction).with_tier("pro"));
/// let response = claude.oneshot(req).await?;
/// assert_eq!(response.status(), 200);
/// assert_eq!(fairgate.fairness().in_flight(), 1); // held until the body is done
/// drop(response);
/// assert_eq!(fairgate.fairness().in_flight(), 0);
/// # Ok(())
/// # }
/// ```
///
/// # Around hyper-util's client
///
/// A `hyper_util::client::legacy::Client` is a tower service of `http::Request`s: the
/// stack wraps it as it is, no adapter needed. With a `Full<Bytes>` body the client and
/// its requests are `Clone`, so a 429 is retried with plain `Clone`; the answer's body
/// ([`FairgateBody<Incoming>`](FairgateBody)) holds the call's permit and slot until it has
/// been read (the `hyper_client` example runs this against a stand-in or the real API):
///
/// ```no_run
/// use bytes::Bytes;
/// use fairgate::{Fairgate, FairgateLayer, Job, Origin, Store};
/// use http_body_util::{BodyExt, Full};
/// use hyper_util::client::legacy::{Client, connect::HttpConnector};
/// use hyper_util::rt::TokioExecutor;
/// use tower::{Layer, ServiceExt};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), fairgate::BoxError> {
/// let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
/// let claude: Fairgate<Client<HttpConnector, Full<Bytes>>> =
///     FairgateLayer::new(Store::memory()).layer(client);
///
/// let mut req = http::Request::post("http://127.0.0.1:8080/v1/messages")
///     .header("content-type", "application/json")
///     .body(Full::new(Bytes::from_static(br#"{"model":"claude-haiku-4-5","max_tokens":64,"messages":[]}"#)))?;
/// req.extensions_mut().insert(Job::new("tenant-42", Origin::UserAction).with_tier("pro"));
/// let response = claude.oneshot(req).await?;
/// let answer = response.into_body().collect().await?.to_bytes(); // the slot is given back here
/// # let _ = answer;
/// # Ok(())
/// # }
/// ```
///
/// The four layers stay usable one by one; this is only their recommended composition, with
/// names for its types: [`Fairgate<S>`] is the service, [`FairgateBody<B>`] the body of its
/// responses (`http::Response<FairgateBody<B>>` for an inner `http::Response<B>`).
///
/// # Clone
/// Cheap; every clone shares the four layers' state (the window, the queues, the caps, the
/// gate): wrap the whole client or router with it, not a per-route clone of a new layer.
pub struct FairgateLayer<C = ByClone, R = DefaultRule, K = OneUpstream> {
    classify: PriorityClassifyLayer<R>,
    retry: RetryAfterBackoffLayer<C, K>,
    fair: DrrFairnessLayer,
    slots: TierSlotLimitLayer,
    store: Store,
}

impl FairgateLayer {
    /// The stack with the defaults: [`DefaultRule`] and
    /// [`DemotionPolicy::default`](crate::DemotionPolicy::default), 429
    /// hygiene by [`BackoffPolicy::default`], a fair queue with a window of 32, and
    /// [`SlotPolicy::default`] (global 30; premium 30, pro 20, free 15, guest 5).
    pub fn new(store: Store) -> Self {
        match FairgateLayer::builder(store).build() {
            Ok(layer) => layer,
            // The defaults are valid; `build` only refuses what a caller configured.
            Err(e) => unreachable!("default fairgate stack refused: {e}"),
        }
    }

    /// Configures the stack; see [`FairgateBuilder`].
    pub fn builder(store: Store) -> FairgateBuilder {
        FairgateBuilder {
            fair: DrrFairnessLayer::builder(store.clone(), 32),
            store,
            slots: SlotPolicy::default(),
            backoff: BackoffPolicy::default(),
            demotion: None,
            pool: None,
        }
    }
}

impl<C, R, K> FairgateLayer<C, R, K> {
    /// A handle to settle requests' real usage against their tenants' deficits.
    pub fn settler(&self) -> Settler {
        self.fair.settler()
    }

    /// The fair queue: requests in flight and waiting, the fairness index.
    pub fn fairness(&self) -> &DrrFairnessLayer {
        &self.fair
    }

    /// The store the four layers share.
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// Copies requests for a retry with `cloner` instead of `Clone` (e.g. a closure that
    /// rebuilds a buffered body, or [`SendOnce`](crate::retry_after_backoff::SendOnce)).
    pub fn clone_requests_with<C2>(self, cloner: C2) -> FairgateLayer<C2, R, K> {
        FairgateLayer {
            classify: self.classify,
            retry: self.retry.clone_requests_with(cloner),
            fair: self.fair,
            slots: self.slots,
            store: self.store,
        }
    }

    /// Scopes the cooldown gate, the recovery probe and the learned limits per request
    /// (per API key, per model, both, or a closure) instead of one per layer; see
    /// [`UpstreamKey`](crate::rate::UpstreamKey).
    pub fn upstream_key_with<K2>(self, key: K2) -> FairgateLayer<C, R, K2> {
        FairgateLayer {
            classify: self.classify,
            retry: self.retry.upstream_key_with(key),
            fair: self.fair,
            slots: self.slots,
            store: self.store,
        }
    }

    /// Classifies with `rule` instead of the default rule.
    pub fn rule<R2: ClassifyRule>(self, rule: R2) -> FairgateLayer<C, R2, K>
    where
        R: ClassifyRule,
    {
        FairgateLayer {
            classify: self.classify.rule(rule),
            retry: self.retry,
            fair: self.fair,
            slots: self.slots,
            store: self.store,
        }
    }
}

impl<C, R, K> Clone for FairgateLayer<C, R, K> {
    fn clone(&self) -> Self {
        FairgateLayer {
            classify: self.classify.clone(),
            retry: self.retry.clone(),
            fair: self.fair.clone(),
            slots: self.slots.clone(),
            store: self.store.clone(),
        }
    }
}

impl<C, R, K> fmt::Debug for FairgateLayer<C, R, K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FairgateLayer")
            .field("classify", &self.classify)
            .field("retry", &self.retry)
            .field("fair", &self.fair)
            .field("slots", &self.slots)
            .finish()
    }
}

impl<S, C, R, K> Layer<S> for FairgateLayer<C, R, K> {
    type Service = Fairgate<S, C, R, K>;

    fn layer(&self, inner: S) -> Self::Service {
        let inner = self.slots.layer(inner);
        let inner = self.fair.layer(inner);
        let inner = self.retry.layer(inner);
        self.classify.layer(inner)
    }
}

/// Configures a [`FairgateLayer`]; start from [`FairgateLayer::builder`].
#[derive(Debug)]
pub struct FairgateBuilder {
    store: Store,
    fair: DrrFairnessBuilder,
    slots: SlotPolicy,
    backoff: BackoffPolicy,
    demotion: Option<DemotionPolicy>,
    pool: Option<crate::PoolGate>,
}

impl FairgateBuilder {
    /// The global and per-tier caps (default [`SlotPolicy::default`]); registered with the
    /// store when the stack is built.
    pub fn slots(mut self, policy: SlotPolicy) -> Self {
        self.slots = policy;
        self
    }

    /// This worker's fair-queue window (default 32): at least its share of the global cap.
    pub fn window(mut self, max_in_flight: usize) -> Self {
        self.fair = DrrFairnessLayer::builder(self.store.clone(), max_in_flight);
        self
    }

    /// Configures the fair queue further (quantum, weights, queue limits), from a builder
    /// already holding the store and the window.
    pub fn fairness(
        mut self,
        configure: impl FnOnce(DrrFairnessBuilder) -> DrrFairnessBuilder,
    ) -> Self {
        self.fair = configure(self.fair);
        self
    }

    /// Dispatches across the upstreams of a [`Pool`](crate::pool::Pool) (from
    /// [`Pool::gate`](crate::pool::Pool::gate)), each with its own rate: the head of the
    /// fair order goes to an upstream that has room now (see [`RateGate::across`](crate::RateGate::across)). The
    /// pool must be the service this stack wraps (or below it).
    pub fn pool(mut self, pool: crate::PoolGate) -> Self {
        self.pool = Some(pool);
        self
    }

    /// The 429 hygiene (default [`BackoffPolicy::default`]).
    pub fn backoff(mut self, policy: BackoffPolicy) -> Self {
        self.backoff = policy;
        self
    }

    /// The demotion thresholds (default [`DemotionPolicy::default`]).
    pub fn demotion(mut self, policy: DemotionPolicy) -> Self {
        self.demotion = Some(policy);
        self
    }

    /// Builds the four layers around one store.
    ///
    /// # Errors
    /// What the fair queue's builder refuses (a window, quantum or weight of 0, ...).
    pub fn build(self) -> Result<FairgateLayer, ConfigError> {
        // One order under every limit: the fair queue consults the retry layer's rate gate
        // (learned and configured pacing, the cooldown gate, slow start, the probe).
        let (retry, rate) =
            RetryAfterBackoffLayer::new(self.store.clone(), self.backoff).with_gate_below();
        let rate = match &self.pool {
            Some(pool) => rate.across(pool),
            None => rate,
        };
        let slots = TierSlotLimitLayer::new(self.store.clone(), self.slots);
        let fair = self.fair.slot_gate(slots.gate()).rate_gate(rate).build()?;
        let mut classify = PriorityClassifyLayer::new(self.store.clone());
        if let Some(policy) = self.demotion {
            classify = classify.demotion(policy);
        }
        Ok(FairgateLayer {
            classify,
            retry,
            fair,
            slots,
            store: self.store,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Job, Origin, TenantId};
    use tower::{ServiceExt, service_fn};

    /// The stack around a service that answers at once; the job each call went out with
    /// (classified) comes back in the response's extensions, as a gateway would keep it.
    fn stack(
        layer: &FairgateLayer,
    ) -> Fairgate<
        impl tower::Service<
            http::Request<String>,
            Response = http::Response<String>,
            Error = std::convert::Infallible,
            Future = impl Send,
        > + Clone,
    > {
        layer.layer(service_fn(|req: http::Request<String>| async move {
            let mut response = http::Response::new(String::new());
            if let Some(job) = req.extensions().get::<Job>() {
                response.extensions_mut().insert(job.clone());
            }
            Ok::<_, std::convert::Infallible>(response)
        }))
    }

    async fn call(layer: &FairgateLayer, job: Job) -> Job {
        let mut req = http::Request::new(String::new());
        req.extensions_mut().insert(job);
        let response = stack(layer).oneshot(req).await.unwrap();
        response.extensions().get::<Job>().cloned().unwrap()
    }

    async fn tokens_today(layer: &FairgateLayer, tenant: &str) -> u64 {
        layer.store().tokens_today(&TenantId::new(tenant)).await
    }

    #[tokio::test(start_paused = true)]
    async fn the_daily_count_takes_the_input_and_the_settlement_brings_it_to_the_use() {
        let layer = FairgateLayer::new(Store::memory());
        let settler = layer.settler();
        // 200 input tokens, up to 4,000 output tokens at 5 each: 200 counted at once.
        let job = Job::new("acme", Origin::UserAction)
            .with_tier("pro")
            .with_cost(200)
            .with_output_cost(20_000);
        let sent = call(&layer, job).await;
        assert_eq!(tokens_today(&layer, "acme").await, 200);
        // The answer used 180 input and 100 output tokens.
        settler.settle_usage(&sent, 680, 180);
        assert_eq!(tokens_today(&layer, "acme").await, 180);
        // A call that used more than its estimate is counted up as well; one settled
        // without its input keeps the estimate.
        let sent = call(&layer, Job::new("acme", Origin::UserAction).with_cost(10)).await;
        settler.settle_usage(&sent, 5_010, 5_000);
        assert_eq!(tokens_today(&layer, "acme").await, 180 + 5_000);
        let sent = call(&layer, Job::new("acme", Origin::UserAction).with_cost(10)).await;
        settler.settle(&sent, 5_010);
        assert_eq!(tokens_today(&layer, "acme").await, 180 + 5_000 + 10);
    }

    fn weighted() -> FairgateLayer {
        let policy = crate::DemotionPolicy::builder()
            .budget_counts(crate::BudgetCounts::Weighted)
            .build()
            .unwrap();
        FairgateLayer::builder(Store::memory())
            .demotion(policy)
            .build()
            .unwrap()
    }

    #[tokio::test(start_paused = true)]
    async fn a_weighted_budget_takes_the_charge_and_the_settlement_brings_it_to_the_use() {
        let layer = weighted();
        let settler = layer.settler();
        let job = Job::new("acme", Origin::UserAction)
            .with_tier("pro")
            .with_cost(200)
            .with_output_cost(20_000);
        let sent = call(&layer, job).await;
        assert_eq!(tokens_today(&layer, "acme").await, 20_200);
        settler.settle(&sent, 680);
        assert_eq!(tokens_today(&layer, "acme").await, 680);
        let sent = call(&layer, Job::new("acme", Origin::UserAction).with_cost(10)).await;
        settler.settle_usage(&sent, 5_010, 10);
        assert_eq!(tokens_today(&layer, "acme").await, 680 + 5_010);
    }

    #[tokio::test(start_paused = true)]
    async fn a_tenant_whose_answers_outgrow_its_estimate_is_demoted_by_the_settlement() {
        let layer = weighted();
        let settler = layer.settler();
        let job = || {
            Job::new("hog", Origin::UserAction)
                .with_tier("pro")
                .with_cost(10)
        };
        // Tiny prompts, long answers: 320,000 each (64,000 output tokens at weight 5), past
        // 1.5x the default daily budget of 100,000 after the first settlement.
        let sent = call(&layer, job()).await;
        assert_eq!(sent.priority(), Some(crate::Priority::Critical));
        settler.settle(&sent, 320_010);
        let next = call(&layer, job()).await;
        assert_eq!(next.priority(), Some(crate::Priority::Batch), "demoted");
        // A tenant whose estimate was too high is refunded, never below 0; an answer the
        // upstream refused counts nothing.
        let light = call(
            &layer,
            Job::new("light", Origin::UserAction).with_cost(50_000),
        )
        .await;
        settler.settle_usage(&light, 0, 0);
        assert_eq!(tokens_today(&layer, "light").await, 0);
    }

    /// Through `layer` (tier `free`: 1 s of wait for user actions), a first call held for
    /// `hold`, then a user action, scheduled work with a 10 s SLA and batch work: how each
    /// ended (`Err(true)`: `Busy`) and after how many whole seconds.
    async fn class_waits(
        layer: FairgateLayer,
        hold: std::time::Duration,
    ) -> [(Result<(), bool>, u64); 3] {
        use std::time::Duration;
        let calls = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let service = tower::ServiceBuilder::new()
            .layer(layer)
            .service(service_fn(move |_req: http::Request<String>| {
                let first = calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0;
                async move {
                    if first {
                        tokio::time::sleep(hold).await;
                    }
                    Ok::<_, std::convert::Infallible>(http::Response::new(String::new()))
                }
            }));
        let send = |job: Job| {
            let mut req = http::Request::new(String::new());
            req.extensions_mut().insert(job.with_tier("free"));
            let call = service.clone().oneshot(req);
            tokio::spawn(async move {
                let started = tokio::time::Instant::now();
                let answer = call.await.map(|_| ()).map_err(|e| e.is::<crate::Busy>());
                (answer, started.elapsed().as_secs())
            })
        };
        let first = send(Job::new("first", Origin::UserAction));
        tokio::task::yield_now().await;
        let waits = [
            send(Job::new("user", Origin::UserAction)),
            send(Job::new("cron", Origin::Scheduled).with_sla(Duration::from_secs(10))),
            send(Job::new("nightly", Origin::BatchJob)),
        ];
        let mut ends = [(Ok(()), 0); 3];
        for (end, wait) in ends.iter_mut().zip(waits) {
            *end = wait.await.unwrap();
        }
        assert!(first.await.unwrap().0.is_ok());
        ends
    }

    /// A user action is `Busy` at its tier's wait (1 s), scheduled work at its SLA (10 s),
    /// and batch work is served at 60 s, within its 120 s: before, all three were refused
    /// at 1 s.
    const CLASS_ENDS: [(Result<(), bool>, u64); 3] =
        [(Err(true), 1), (Err(true), 10), (Ok(()), 60)];

    #[tokio::test(start_paused = true)]
    async fn each_class_waits_its_own_wait_where_the_slots_bind() {
        use std::time::Duration;
        // One slot, held 60 s by the first call.
        let policy = crate::SlotPolicy::builder()
            .global_max(1)
            .tier("free", 1, Duration::from_secs(1))
            .build()
            .unwrap();
        let layer = FairgateLayer::builder(Store::memory())
            .slots(policy)
            .build()
            .unwrap();
        assert_eq!(
            class_waits(layer, Duration::from_secs(60)).await,
            CLASS_ENDS
        );
    }

    #[tokio::test(start_paused = true)]
    async fn each_class_waits_its_own_wait_where_the_rate_binds() {
        use std::time::Duration;
        // Slots to spare; one request a minute, the first call's cell taken at once.
        let policy = crate::SlotPolicy::builder()
            .tier("free", 10, Duration::from_secs(1))
            .build()
            .unwrap();
        let pacing = crate::rate::Pacing::new()
            .requests_per_minute(1)
            .request_burst(1);
        let backoff = crate::BackoffPolicy::builder()
            .pacing(pacing)
            .seed(1)
            .build()
            .unwrap();
        let layer = FairgateLayer::builder(Store::memory())
            .slots(policy)
            .backoff(backoff)
            .build()
            .unwrap();
        assert_eq!(class_waits(layer, Duration::ZERO).await, CLASS_ENDS);
    }

    #[tokio::test(start_paused = true)]
    async fn a_call_fairgate_refuses_counts_nothing_toward_the_day() {
        // One slot for the tier, and no wait: the second call is `Busy` at once.
        let policy = crate::SlotPolicy::builder()
            .global_max(1)
            .tier("free", 1, std::time::Duration::ZERO)
            .build()
            .unwrap();
        let layer = FairgateLayer::builder(Store::memory())
            .slots(policy)
            .build()
            .unwrap();
        let (release, held) = tokio::sync::oneshot::channel::<()>();
        let held = std::sync::Arc::new(std::sync::Mutex::new(Some(held)));
        let service = tower::ServiceBuilder::new()
            .layer(layer.clone())
            .service(service_fn(move |_req: http::Request<String>| {
                let wait = held.lock().unwrap().take();
                // The first call holds the slot until released; the others answer at once.
                async move {
                    if let Some(wait) = wait {
                        let _ = wait.await;
                    }
                    Ok::<_, std::convert::Infallible>(http::Response::new(String::new()))
                }
            }));
        let job = || {
            let mut req = http::Request::new(String::new());
            req.extensions_mut().insert(
                Job::new("acme", Origin::UserAction)
                    .with_tier("free")
                    .with_cost(700),
            );
            req
        };
        let first = tokio::spawn(service.clone().oneshot(job()));
        tokio::task::yield_now().await;
        let refused = service.clone().oneshot(job()).await.unwrap_err();
        assert!(refused.is::<crate::Busy>(), "{refused}");
        assert_eq!(
            tokens_today(&layer, "acme").await,
            700,
            "only the call that ran"
        );
        release.send(()).unwrap();
        first.await.unwrap().unwrap();
        assert_eq!(tokens_today(&layer, "acme").await, 700);
    }
}
