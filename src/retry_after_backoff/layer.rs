use std::fmt;
use std::sync::Arc;

use tower_layer::Layer;

use super::request::{ByClone, TypeName};
use super::state::{Core, CoreAndCloner};
use super::{BackoffPolicy, RetryAfterBackoff};
use crate::Store;
use crate::rate::OneUpstream;

/// Applies [`RetryAfterBackoff`] to a service.
///
/// # Clone
/// Cloning shares everything: the store, the retry budget, the pacing limiters, the learned
/// views and the jitter source. Build the layer once per upstream and wrap the one client
/// with it; a layer built per route would give each route its own budget and pacing.
pub struct RetryAfterBackoffLayer<C = ByClone, K = OneUpstream> {
    pub(super) shared: Arc<CoreAndCloner<C>>,
    pub(super) key: Arc<K>,
    /// The tiers' max waits that bound a first attempt held here (see `max_waits`).
    pub(super) waits: Option<Arc<crate::SlotPolicy>>,
    /// A fair queue below holds this layer's rate gate (see `with_gate_below`): calls go
    /// straight down, and the fair queue waits for the rate in its own order.
    pub(super) gated: bool,
}

impl RetryAfterBackoffLayer {
    /// A layer retrying by `policy`, recording throttles and the cooldown gate in `store`.
    /// Requests are cloned with `Clone` for a retry (see
    /// [`clone_requests_with`](RetryAfterBackoffLayer::clone_requests_with)).
    pub fn new(store: Store, policy: BackoffPolicy) -> Self {
        RetryAfterBackoffLayer {
            shared: Arc::new(CoreAndCloner {
                core: Arc::new(Core::new(store, policy)),
                cloner: ByClone,
            }),
            key: Arc::new(OneUpstream),
            waits: None,
            gated: false,
        }
    }
}

impl<C, K> RetryAfterBackoffLayer<C, K> {
    /// Replaces how requests are copied for a retry (a [`CloneRequest`](super::CloneRequest):
    /// [`SendOnce`](super::SendOnce), or a closure `Fn(&Req) -> Option<Req>`). Keeps the
    /// budget and pacing state.
    pub fn clone_requests_with<C2>(self, cloner: C2) -> RetryAfterBackoffLayer<C2, K> {
        RetryAfterBackoffLayer {
            shared: Arc::new(CoreAndCloner {
                core: self.shared.core.clone(),
                cloner,
            }),
            key: self.key,
            waits: self.waits,
            gated: self.gated,
        }
    }

    /// Chooses the upstream key of each request (an [`UpstreamKey`](crate::rate::UpstreamKey):
    /// [`ByApiKey`](crate::rate::ByApiKey), [`ByModel`](crate::rate::ByModel),
    /// [`ByApiKeyAndModel`](crate::rate::ByApiKeyAndModel) or a closure): the scope of its
    /// cooldown gate, recovery probe and learned limits. Default: one key per layer, the
    /// policy's [`upstream`](super::BackoffPolicyBuilder::upstream). Keeps every other
    /// state.
    pub fn upstream_key_with<K2>(self, key: K2) -> RetryAfterBackoffLayer<C, K2> {
        RetryAfterBackoffLayer {
            shared: self.shared,
            key: Arc::new(key),
            waits: self.waits,
            gated: self.gated,
        }
    }

    /// Bounds a first attempt held here (behind the cooldown gate, by pacing, by slow
    /// start) by its tier's max wait in `policy`, counted from the request's arrival: past
    /// it the caller is told [`Busy`](crate::Busy) at once, as the slot caps would. For a
    /// stack that does not hand this layer's gate to a fair queue
    /// ([`with_gate_below`](Self::with_gate_below)), where the fair queue bounds every wait
    /// itself.
    pub fn max_waits(mut self, policy: crate::SlotPolicy) -> Self {
        self.waits = Some(Arc::new(policy));
        self
    }

    /// Hands this layer's rate limits to a fair queue below it: returns the layer and its
    /// [`RateGate`](crate::RateGate), to pass to
    /// [`DrrFairnessBuilder::rate_gate`](crate::drr_fairness::DrrFairnessBuilder::rate_gate).
    ///
    /// The layer returned (and its clones, and the services it makes; not a clone taken
    /// before) then no longer holds calls for
    /// the cooldown gate, slow start, the recovery probe, learned pacing or a configured
    /// [`Pacing`](crate::rate::Pacing): it sends each attempt straight down, naming its upstream
    /// key on the request's [`Job`](crate::Job), and the fair queue dispatches its waiting
    /// requests in fair order as the gate lets them go, taking each call's cells when it
    /// dispatches it. What stays here: reading `retry-after` and the rate-limit headers
    /// (they feed the gate), attributing throttles, deciding whether and when to retry; a
    /// retry goes through the fair queue again. [`FairgateLayer`](crate::FairgateLayer)
    /// does this wiring itself.
    ///
    /// ```
    /// use fairgate::{BackoffPolicy, DrrFairnessLayer, RetryAfterBackoffLayer, Store};
    ///
    /// let store = Store::memory();
    /// let (retry, rate) =
    ///     RetryAfterBackoffLayer::new(store.clone(), BackoffPolicy::default()).with_gate_below();
    /// let fair = DrrFairnessLayer::builder(store, 32).rate_gate(rate).build()?;
    /// # let _ = (retry, fair);
    /// # Ok::<(), fairgate::ConfigError>(())
    /// ```
    pub fn with_gate_below(mut self) -> (Self, crate::RateGate) {
        self.gated = true;
        let gate = self.shared.core.rate.gate();
        (self, gate)
    }

    /// The policy.
    pub fn policy(&self) -> &BackoffPolicy {
        &self.shared.core.policy
    }
}

impl<C, K> Clone for RetryAfterBackoffLayer<C, K> {
    fn clone(&self) -> Self {
        RetryAfterBackoffLayer {
            shared: self.shared.clone(),
            key: self.key.clone(),
            waits: self.waits.clone(),
            gated: self.gated,
        }
    }
}

impl<C, K> fmt::Debug for RetryAfterBackoffLayer<C, K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetryAfterBackoffLayer")
            .field("store", &self.shared.core.store)
            .field("policy", &self.shared.core.policy)
            .field("cloner", &TypeName::<C>::new())
            .field("upstream_key", &TypeName::<K>::new())
            .finish()
    }
}

impl<S, C, K> Layer<S> for RetryAfterBackoffLayer<C, K> {
    type Service = RetryAfterBackoff<S, C, K>;

    fn layer(&self, inner: S) -> Self::Service {
        RetryAfterBackoff {
            inner,
            shared: self.shared.clone(),
            key: self.key.clone(),
            waits: self.waits.clone(),
            gated: self.gated,
        }
    }
}
