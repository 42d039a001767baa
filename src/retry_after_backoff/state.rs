//! The layer's state, shared by its services and futures: the store, the policy, the retry
//! budget, the rate of its upstream keys, and the calls it holds.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tower::retry::budget::TpsBudget;

use super::BackoffPolicy;
use crate::Store;
use crate::rate::Rates;

/// What every service and future of one layer shares: its `Core` and how it copies a
/// request for a retry.
pub(super) struct CoreAndCloner<C> {
    pub(super) core: Arc<Core>,
    pub(super) cloner: C,
}

/// The layer's state: store, policy, retry budget, and the rate of its upstream keys (the
/// learned limits, pacing, cooldown gate, slow start and probe), which it feeds with what
/// the answers say.
pub(super) struct Core {
    pub(super) store: Store,
    pub(super) policy: BackoffPolicy,
    pub(super) budget: Option<TpsBudget>,
    pub(super) rate: Arc<Rates>,
    /// Calls of this layer held now (behind a gate or a probe).
    held: AtomicUsize,
}

/// A call counted as held while this lives.
pub(super) struct HeldCall(Arc<Core>);

impl HeldCall {
    pub(super) fn new(core: &Arc<Core>) -> Self {
        core.held.fetch_add(1, Ordering::AcqRel);
        HeldCall(core.clone())
    }
}

impl Drop for HeldCall {
    fn drop(&mut self) {
        self.0.held.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Core {
    pub(super) fn new(store: Store, policy: BackoffPolicy) -> Core {
        let budget = policy
            .budget
            .map(|b| TpsBudget::new(b.ttl, b.min_per_sec, b.retry_percent));
        let rate = Arc::new(Rates::new(store.clone(), policy.rate_config()));
        Core {
            store,
            policy,
            budget,
            rate,
            held: AtomicUsize::new(0),
        }
    }

    /// Whether calls other than the caller's own are held in this layer now.
    pub(super) fn others_held(&self, mine: bool) -> bool {
        self.held.load(Ordering::Acquire) > usize::from(mine)
    }
}
