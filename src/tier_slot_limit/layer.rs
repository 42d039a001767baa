use std::fmt;
use std::sync::Arc;

use tower_layer::Layer;

use super::wait::SlotLimiter;
use super::{SlotPolicy, TierSlotLimit};
use crate::Store;
use crate::guarded::Ahead;

/// Applies [`TierSlotLimit`] to a service.
///
/// # Clone
/// Cloning shares the caps: every clone, and every service it makes, counts against the
/// same slots (those of the store: on Redis, every worker's). Nothing is created per
/// `layer()` call, so a per-route clone (axum) still limits.
#[derive(Clone)]
pub struct TierSlotLimitLayer {
    shared: Arc<SlotLimiter>,
}

impl TierSlotLimitLayer {
    /// Limits with `policy` ([`SlotPolicy::default`]: global 30; premium 30, pro 20, free 15, guest 5), counting slots
    /// in `store`.
    pub fn new(store: Store, policy: SlotPolicy) -> Self {
        TierSlotLimitLayer {
            shared: Arc::new(SlotLimiter::new(store, policy)),
        }
    }

    /// These caps as a [`SlotGate`](crate::SlotGate), to hand to a fair queue above this
    /// layer ([`DrrFairnessBuilder::slot_gate`](crate::drr_fairness::DrrFairnessBuilder::slot_gate)):
    /// the fair queue then takes each request's slot when it dispatches it, in its fair
    /// order among the requests whose tier has room, so a request of a full tier waits
    /// without holding the window; this layer lets such a request through without taking
    /// a second slot. [`FairgateLayer`](crate::FairgateLayer) does this wiring itself.
    ///
    /// ```
    /// use fairgate::{DrrFairnessLayer, SlotPolicy, Store, TierSlotLimitLayer};
    ///
    /// let store = Store::memory();
    /// let slots = TierSlotLimitLayer::new(store.clone(), SlotPolicy::default());
    /// let fair = DrrFairnessLayer::builder(store, 32).slot_gate(slots.gate()).build()?;
    /// # let _ = fair;
    /// # Ok::<(), fairgate::ConfigError>(())
    /// ```
    pub fn gate(&self) -> crate::SlotGate {
        self.shared.gate.clone()
    }
}

impl fmt::Debug for TierSlotLimitLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TierSlotLimitLayer")
            .field("store", self.shared.gate.store())
            .field("policy", &self.shared.policy)
            .finish()
    }
}

impl<S> Layer<S> for TierSlotLimitLayer {
    type Service = TierSlotLimit<S>;

    fn layer(&self, inner: S) -> Self::Service {
        TierSlotLimit {
            inner: Ahead::new(inner),
            shared: self.shared.clone(),
        }
    }
}
