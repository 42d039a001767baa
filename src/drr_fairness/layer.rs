use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use tower_layer::Layer;

use super::scheduler::{ClassSelection, ClassWeights, SchedulerConfig};
use super::state::{FairQueue, TierWeights};
use super::{DrrFairness, Settler};
use crate::error::ConfigError;
use crate::guarded::Ahead;
use crate::{Priority, Store, Tier};

/// Applies [`DrrFairness`] to a service: at most `max_in_flight` requests below it at once,
/// the waiting ones dispatched in fair order. See the [module docs](crate::drr_fairness).
///
/// # Clone
/// Cloning this layer does **not** create a new window or queue: every clone, and every
/// service it builds, shares the one state created by [`new`](DrrFairnessLayer::new) /
/// [`build`](DrrFairnessBuilder::build). Wrap the whole client or router with it, not a
/// per-route clone built from a fresh layer each time, or each gets its own window.
#[derive(Clone)]
pub struct DrrFairnessLayer {
    shared: Arc<FairQueue>,
}

impl DrrFairnessLayer {
    /// At most `max_in_flight` requests in flight below the layer, with the defaults:
    /// one request charged at most 4 quanta of 5,000 tokens, class weights
    /// critical:standard:batch = 270:25:5 by smooth weighted round robin, tiers `pro` and
    /// `premium` weighing 3 and the rest 1, no queue limits, a 60 s fairness window.
    ///
    /// # Panics
    /// If `max_in_flight` is 0; use [`builder`](DrrFairnessLayer::builder) to get a
    /// [`ConfigError`] instead.
    pub fn new(store: Store, max_in_flight: usize) -> Self {
        match DrrFairnessLayer::builder(store, max_in_flight).build() {
            Ok(layer) => layer,
            Err(e) => panic!("{e}"),
        }
    }

    /// Configures a layer; see [`DrrFairnessBuilder`].
    pub fn builder(store: Store, max_in_flight: usize) -> DrrFairnessBuilder {
        DrrFairnessBuilder {
            store,
            max_in_flight,
            config: SchedulerConfig::default(),
            weights: TierWeights::default(),
            fairness_window: Duration::from_secs(60),
            rate: None,
            slots: None,
        }
    }

    /// A handle to settle requests' real usage against their tenants' place in the order; see
    /// [`Settler`].
    pub fn settler(&self) -> Settler {
        Settler {
            shared: self.shared.clone(),
        }
    }

    /// Requests dispatched and not finished (their permits held).
    pub fn in_flight(&self) -> usize {
        self.shared.in_flight()
    }

    /// Requests waiting, in `priority` or (`None`) in all classes.
    pub fn queued(&self, priority: Option<Priority>) -> usize {
        self.shared.queued(priority)
    }

    /// The window: the most requests dispatched below this layer at once.
    pub fn max_in_flight(&self) -> usize {
        self.shared.max_in_flight()
    }

    /// Requests of `tier` waiting for their slot, when the layer holds a slot gate (the
    /// tier the caps count them under; 0 without a slot gate).
    pub fn queued_in_tier(&self, tier: &Tier) -> usize {
        self.shared.queued_in_tier(tier)
    }

    /// How long the request waiting longest in this layer's queue has waited (from its
    /// arrival at the first fairgate layer), among those of `tier` and of `class` when
    /// given; `None` when none waits. It looks at every waiting request: for a status page
    /// read now and then, not for each request.
    pub fn longest_wait(&self, tier: Option<&Tier>, class: Option<Priority>) -> Option<Duration> {
        self.shared.longest_wait(tier, class)
    }

    /// Jain's index over the weight-normalised served cost of the tenants that were
    /// backlogged in the fairness window, as published in `claude_drr_fairness_index`;
    /// `None` when no tenant was backlogged.
    pub fn fairness_index(&self) -> Option<f64> {
        self.shared.fairness_index()
    }
}

impl fmt::Debug for DrrFairnessLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DrrFairnessLayer")
            .field("state", &self.shared)
            .field("scheduler", &self.shared.scheduler_config())
            .field("tier_weights", self.shared.weights())
            .finish()
    }
}

impl<S> Layer<S> for DrrFairnessLayer {
    type Service = DrrFairness<S>;

    fn layer(&self, inner: S) -> Self::Service {
        DrrFairness {
            inner: Ahead::new(inner),
            shared: self.shared.clone(),
        }
    }
}

/// Configures a [`DrrFairnessLayer`]; start from [`DrrFairnessLayer::builder`].
///
/// ```
/// use fairgate::{DrrFairnessLayer, Store};
/// use fairgate::drr_fairness::ClassWeights;
///
/// let layer = DrrFairnessLayer::builder(Store::memory(), 32)
///     .quantum(8_000)
///     .tier_weight("enterprise", 5)
///     .class_weights(ClassWeights { critical: 80, standard: 15, batch: 5 })
///     .max_queued_per_tenant(100)
///     .build()?;
/// # Ok::<(), fairgate::ConfigError>(())
/// ```
#[derive(Clone, Debug)]
pub struct DrrFairnessBuilder {
    store: Store,
    max_in_flight: usize,
    config: SchedulerConfig,
    weights: TierWeights,
    fairness_window: Duration,
    rate: Option<crate::RateGate>,
    slots: Option<crate::SlotGate>,
}

impl DrrFairnessBuilder {
    /// Takes each request's slot from `gate` — the global, tier and tenant caps of a
    /// [`TierSlotLimitLayer`](crate::TierSlotLimitLayer), from its
    /// [`gate`](crate::TierSlotLimitLayer::gate) — when it dispatches the request: the
    /// window is handed out only together with a slot, in fair order among the requests
    /// whose tier has room, so a full tier never holds the window another tier could use,
    /// and a request is dispatched or told [`Busy`](crate::Busy) within its tier's max wait
    /// of its arrival. The slot layer below lets such a request through.
    pub fn slot_gate(mut self, gate: crate::SlotGate) -> Self {
        self.slots = Some(gate);
        self
    }

    /// Consults `gate` — the provider's rate of each upstream key, the cooldown gate after
    /// a 429, slow start and the recovery probe, from
    /// [`RetryAfterBackoffLayer::with_gate_below`](crate::RetryAfterBackoffLayer::with_gate_below)
    /// — when dispatching: the next request to go is the head of the fair order among those
    /// the rate lets go, and it takes its rate cells then. Without it, this layer orders
    /// only what its window and the slot caps hold back.
    pub fn rate_gate(mut self, gate: crate::RateGate) -> Self {
        self.rate = Some(gate);
        self
    }

    /// The unit of [`max_charge_quanta`](Self::max_charge_quanta), in tokens (default
    /// 5,000). Turns are one call each whatever it is.
    pub fn quantum(mut self, tokens: u64) -> Self {
        self.config.quantum = tokens;
        self
    }

    /// One request is charged at most `quanta` x quantum (default 4), so one giant prompt
    /// cannot stall its class.
    pub fn max_charge_quanta(mut self, quanta: u32) -> Self {
        self.config.max_charge_quanta = quanta;
        self
    }

    /// Weights of the priority classes (default 270:25:5: critical takes 90% of the
    /// dispatches while it has work, standard:batch share the rest 5:1).
    pub fn class_weights(mut self, weights: ClassWeights) -> Self {
        self.config.class_weights = weights;
        self
    }

    /// How the next class is picked (default deterministic smooth weighted round robin;
    /// [`ClassSelection::Probabilistic`] draws each class at random by weight, seeded).
    pub fn class_selection(mut self, selection: ClassSelection) -> Self {
        self.config.selection = selection;
        self
    }

    /// At most `limit` requests of one tenant waiting in one class; past it
    /// [`QueueFull`](super::error::QueueFull). Default: no limit.
    pub fn max_queued_per_tenant(mut self, limit: usize) -> Self {
        self.config.max_per_tenant = Some(limit);
        self
    }

    /// At most `limit` requests waiting in one class; past it
    /// [`QueueFull`](super::error::QueueFull). Default: no limit.
    pub fn max_queued_per_class(mut self, limit: usize) -> Self {
        self.config.max_per_class = Some(limit);
        self
    }

    /// The weight of a tier in the fair order (default `pro` and `premium` 3).
    pub fn tier_weight(mut self, tier: impl Into<Tier>, weight: u32) -> Self {
        self.weights.by_tier.insert(tier.into(), weight);
        self
    }

    /// The weight of any other tier, and of a job without one (default 1).
    pub fn default_tier_weight(mut self, weight: u32) -> Self {
        self.weights.default = weight;
        self
    }

    /// The sliding window of `claude_drr_fairness_index` (default 60 s, in ten buckets).
    pub fn fairness_window(mut self, window: Duration) -> Self {
        self.fairness_window = window;
        self
    }

    /// Builds the layer and its shared state.
    ///
    /// # Errors
    /// `max_in_flight`, the quantum, `max_charge_quanta`, a class or tier weight, or a queue
    /// limit of 0; a fairness window under 10 ms.
    pub fn build(self) -> Result<DrrFairnessLayer, ConfigError> {
        let shared = FairQueue::new(
            self.store,
            self.max_in_flight,
            self.config,
            self.weights,
            self.fairness_window,
            self.slots,
            self.rate,
        )?;
        Ok(DrrFairnessLayer {
            shared: Arc::new(shared),
        })
    }
}
