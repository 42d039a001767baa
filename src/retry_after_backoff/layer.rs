use std::fmt;
use std::sync::{Arc, Mutex};

use tower::retry::budget::TpsBudget;
use tower_layer::Layer;

use super::pacing::Pacer;
use super::request::{ByClone, TypeName};
use super::{BackoffPolicy, RetryAfterBackoff};
use crate::Store;
use crate::rng::Rng;

/// Applies [`RetryAfterBackoff`] to a service.
///
/// # Clone
/// Cloning shares everything: the store, the retry budget, the pacing limiters and the
/// jitter source. Build the layer once per upstream and wrap the one client with it; a
/// layer built per route would give each route its own budget and pacing.
pub struct RetryAfterBackoffLayer<C = ByClone> {
    pub(super) shared: Arc<Shared<C>>,
}

/// What every service and future of one layer shares.
pub(super) struct Shared<C> {
    pub(super) core: Arc<Core>,
    pub(super) cloner: C,
}

pub(super) struct Core {
    pub(super) store: Store,
    pub(super) policy: BackoffPolicy,
    pub(super) budget: Option<TpsBudget>,
    pub(super) pacer: Option<Pacer>,
    rng: Mutex<Rng>,
}

impl Core {
    /// A uniform draw in [0, 1) from the layer's seeded source.
    pub(super) fn unit(&self) -> f64 {
        self.rng.lock().unwrap_or_else(|e| e.into_inner()).unit()
    }
}

impl RetryAfterBackoffLayer {
    /// A layer retrying by `policy`, recording throttles and the cooldown gate in `store`.
    /// Requests are cloned with `Clone` for a retry (see
    /// [`clone_requests_with`](RetryAfterBackoffLayer::clone_requests_with)).
    pub fn new(store: Store, policy: BackoffPolicy) -> Self {
        let budget = policy
            .budget
            .map(|b| TpsBudget::new(b.ttl, b.min_per_sec, b.retry_percent));
        let pacer = policy.pacing.as_ref().map(Pacer::new);
        let rng = policy.seed.map_or_else(Rng::from_entropy, Rng::seeded);
        RetryAfterBackoffLayer {
            shared: Arc::new(Shared {
                core: Arc::new(Core {
                    store,
                    policy,
                    budget,
                    pacer,
                    rng: Mutex::new(rng),
                }),
                cloner: ByClone,
            }),
        }
    }
}

impl<C> RetryAfterBackoffLayer<C> {
    /// Replaces how requests are copied for a retry (a [`CloneRequest`](super::CloneRequest):
    /// [`SendOnce`](super::SendOnce), or a closure `Fn(&Req) -> Option<Req>`). Keeps the
    /// budget and pacing state.
    pub fn clone_requests_with<C2>(self, cloner: C2) -> RetryAfterBackoffLayer<C2> {
        RetryAfterBackoffLayer {
            shared: Arc::new(Shared {
                core: self.shared.core.clone(),
                cloner,
            }),
        }
    }

    /// The policy.
    pub fn policy(&self) -> &BackoffPolicy {
        &self.shared.core.policy
    }
}

impl<C> Clone for RetryAfterBackoffLayer<C> {
    fn clone(&self) -> Self {
        RetryAfterBackoffLayer {
            shared: self.shared.clone(),
        }
    }
}

impl<C> fmt::Debug for RetryAfterBackoffLayer<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetryAfterBackoffLayer")
            .field("store", &self.shared.core.store)
            .field("policy", &self.shared.core.policy)
            .field("cloner", &TypeName::<C>::new())
            .finish()
    }
}

impl<S, C> Layer<S> for RetryAfterBackoffLayer<C> {
    type Service = RetryAfterBackoff<S, C>;

    fn layer(&self, inner: S) -> Self::Service {
        RetryAfterBackoff {
            inner,
            shared: self.shared.clone(),
        }
    }
}
