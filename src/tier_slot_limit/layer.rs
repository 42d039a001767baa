use std::fmt;
use std::sync::Arc;

use tower_layer::Layer;

use super::wait::Shared;
use super::{SlotPolicy, TierSlotLimit};
use crate::Store;

/// Applies [`TierSlotLimit`] to a service.
///
/// # Clone
/// Cloning shares the caps: every clone, and every service it makes, counts against the
/// same slots (those of the store: on Redis, every worker's). Nothing is created per
/// `layer()` call, so a per-route clone (axum) still limits.
#[derive(Clone)]
pub struct TierSlotLimitLayer {
    shared: Arc<Shared>,
}

impl TierSlotLimitLayer {
    /// Limits with `policy` ([`SlotPolicy::default`] for the reference's caps), counting slots
    /// in `store`.
    ///
    /// The policy is registered with the store (the first one registered on a store is the
    /// one shared): a [`DrrFairness`](crate::DrrFairness) on the same store then takes each
    /// request's slot when it dispatches it, so requests of a full tier wait in the fair
    /// queue without holding its window. See [`crate::admission`].
    pub fn new(store: Store, policy: SlotPolicy) -> Self {
        store.register_slot_policy(&policy);
        TierSlotLimitLayer {
            shared: Arc::new(Shared::new(store, policy)),
        }
    }
}

impl fmt::Debug for TierSlotLimitLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TierSlotLimitLayer")
            .field("store", &self.shared.store)
            .field("policy", &self.shared.policy)
            .finish()
    }
}

impl<S> Layer<S> for TierSlotLimitLayer {
    type Service = TierSlotLimit<S>;

    fn layer(&self, inner: S) -> Self::Service {
        TierSlotLimit {
            inner,
            shared: self.shared.clone(),
        }
    }
}
