//! Gates: the limits the fair queue consults when it dispatches.
//!
//! Who goes next is decided in one place, [`DrrFairness`](crate::DrrFairness)'s fair order
//! (class by weight, tier by start-time fair queuing, tenant by DRR), whatever holds calls
//! back. A limit is a *gate* handed to the fair queue: when the fair queue is about to
//! dispatch its next request, it asks each gate whether a call of that tier, tenant and
//! cost may go now; if one may, it takes what the call needs from each gate at that
//! moment, for that request; if not, nothing is taken and the fair queue waits until the
//! gate says it may have opened (a time, or a notification). A request waiting in the
//! queue holds nothing, so one that leaves (`Busy`, `QueueFull`, dropped) leaves no gap.
//!
//! Two kinds of gate exist:
//! - the slot caps, a [`SlotGate`]: global, per tier, per tenant ([`SlotPolicy`]), from
//!   [`TierSlotLimitLayer::gate`](crate::TierSlotLimitLayer::gate), passed to
//!   [`DrrFairnessBuilder::slot_gate`](crate::drr_fairness::DrrFairnessBuilder::slot_gate);
//! - the rate of an upstream key, a [`RateGate`]: the learned limits (requests, input and
//!   output tokens), a configured [`Pacing`](crate::rate::Pacing), the cooldown gate
//!   after a 429, slow start and the recovery probe ([`crate::rate`]). It is made by
//!   [`RetryAfterBackoffLayer::with_gate_below`](crate::RetryAfterBackoffLayer::with_gate_below)
//!   and passed to [`DrrFairnessLayer::builder`](crate::DrrFairnessLayer::builder)'s
//!   [`rate_gate`](crate::drr_fairness::DrrFairnessBuilder::rate_gate);
//!   [`FairgateLayer`](crate::FairgateLayer) does that wiring itself.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

pub(crate) use crate::admission::WaitReason;
use crate::store::{
    DIMS, FleetCells, SlotLease, SlotLeases, SlotLimits, SlotQueue, SlotRefusal, SlotWakes,
    StoreFuture,
};
use crate::{SlotPolicy, Store, TenantId, Tier};

/// What a rate gate says about the next call of an upstream key.
pub(crate) enum Verdict {
    /// It goes now, with what was taken for it (`None`: nothing, no limit applies).
    Go(Taken),
    /// Not before then.
    Until(Instant, WaitReason),
    /// Not until the gate notifies (an answer the store or a probe is awaited for).
    Notified(WaitReason),
}

/// What a dispatched call took from a rate gate, boxed (most calls take nothing: `None`,
/// and the futures that carry it stay small).
pub(crate) type Taken = Option<Box<Receipt>>;

/// What a dispatched call took from a rate gate: given to the call, so the retry layer
/// can correct the token charges from the answer's usage, and report a probe's answer.
/// Dropped unused, the cells go back to the gate (and a probe's lease is let go).
pub(crate) struct Receipt {
    pub(crate) key: Arc<str>,
    /// Cells per dimension the call needed, and those taken (0 where no limit is known).
    pub(crate) need: [u32; DIMS],
    pub(crate) charged: [u32; DIMS],
    /// This call is the key's probe (slow start or recovery): its answer tells the fleet.
    pub(crate) probe: bool,
    /// Set once the call went upstream: the cells are spent.
    pub(crate) used: bool,
    /// When the cells were due: kept for another call, they are still dated then.
    pub(crate) due: Instant,
    /// The input tokens the fleet's token rate took for the call with its slot (its
    /// estimate; 0: none): its answer's usage corrects them.
    pub(crate) fleet_tokens: u32,
    pub(crate) gate: Option<Arc<dyn RateLimit>>,
    /// The upstream of a pool the call goes to, with its place there (a rate gate
    /// [across](RateGate::across) a pool): handed to the pool's service in the job.
    pub(crate) route: Option<Arc<Route>>,
}

impl Receipt {
    /// The call went upstream: its cells are spent whatever happens next.
    pub(crate) fn mark_used(&mut self) {
        self.used = true;
    }

    /// Whether the call's answer has anything to settle: cells taken, a probe, or the
    /// upstream of a pool it went to (its key is the one the answer teaches).
    pub(crate) fn tells_something(&self) -> bool {
        self.probe || self.gate.is_some() || self.route.is_some()
    }
}

impl Drop for Receipt {
    fn drop(&mut self) {
        if let Some(gate) = self.gate.take() {
            gate.returned(self);
        }
    }
}

impl fmt::Debug for Receipt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Receipt")
            .field("key", &self.key)
            .field("charged", &self.charged)
            .field("probe", &self.probe)
            .finish_non_exhaustive()
    }
}

/// Where a rate gate over a pool routed a call: its place at the upstream chosen (the
/// pool's own type, opaque here), taken when the fair queue dispatched it, for the pool's
/// service to use (dropped unused, the place goes back); and which upstream has the call,
/// whose key its answer teaches.
pub(crate) struct Route {
    pool: u64,
    place: std::sync::Mutex<Option<Box<dyn std::any::Any + Send>>>,
    /// Each upstream's key for the call's request key, in the pool's order.
    keys: Arc<[Arc<str>]>,
    /// The upstream that has the call now (another, after a refusal or a `529`).
    at: std::sync::atomic::AtomicUsize,
}

impl Route {
    pub(crate) fn new(
        pool: u64,
        place: Box<dyn std::any::Any + Send>,
        keys: Arc<[Arc<str>]>,
        at: usize,
    ) -> Self {
        Route {
            pool,
            place: std::sync::Mutex::new(Some(place)),
            keys,
            at: at.into(),
        }
    }

    /// The place, if this route is of the pool `pool` and was not used yet.
    pub(crate) fn take_place(&self, pool: u64) -> Option<Box<dyn std::any::Any + Send>> {
        (self.pool == pool)
            .then(|| crate::sync::lock(&self.place).take())
            .flatten()
    }

    /// The call goes to upstream `member` of the pool `pool` (if the route is of it).
    pub(crate) fn sent_to(&self, pool: u64, member: usize) {
        if self.pool == pool && member < self.keys.len() {
            self.at.store(member, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// The key of the upstream the call was last sent to: the one its answer teaches.
    pub(crate) fn answered_key(&self) -> Arc<str> {
        self.keys[self.at.load(std::sync::atomic::Ordering::Relaxed)].clone()
    }
}

impl fmt::Debug for Route {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Route").field("pool", &self.pool).finish()
    }
}

/// What the fair queue asks a rate gate about one call.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RateAsk<'a> {
    pub(crate) tenant: &'a TenantId,
    /// The upstream key the call goes to.
    pub(crate) key: &'a Arc<str>,
    /// Its estimated input tokens.
    pub(crate) cost: u32,
    /// The request rate's cell is not the gate's: the call takes it with its slot, in the
    /// fleet's order (see [`fleet_cells`](RateLimit::fleet_cells)).
    pub(crate) fleet_cells: bool,
    /// Since when the call has waited in the fair queue (its arrival there).
    pub(crate) waiting_since: Instant,
}

impl<'a> RateAsk<'a> {
    /// The same ask, of another key.
    pub(crate) fn to(self, key: &'a Arc<str>) -> RateAsk<'a> {
        RateAsk { key, ..self }
    }
}

/// The rate of upstream keys, as the fair queue consults it. Implemented by the rate of a
/// retry layer's keys (`crate::rate`: the learned limits, pacing, cooldown gate and probe).
pub(crate) trait RateLimit: Send + Sync + 'static {
    /// The key of a request that names none.
    fn default_key(&self) -> Arc<str>;
    /// Whether the call `ask` describes may go now; takes its cells if so.
    fn check(self: Arc<Self>, ask: &RateAsk<'_>) -> Verdict;
    /// The request rate of `key` as cells the fleet's order can hand out with the slots:
    /// a configured shared [`Pacing`](crate::rate::Pacing)'s request limit
    /// or the learned one (the slower of the two), for the gate's own upstream key (`None`
    /// otherwise: the gate paces it). Learning, with no limit in this worker's view now:
    /// [`FleetCells::FROM_THE_FLEET`], the cells another worker names.
    fn fleet_cells(&self, key: &Arc<str>) -> Option<FleetCells> {
        let _ = key;
        None
    }
    /// Whether a reservation for `key` is on its way to the store: the gate will have its
    /// word within a round trip (a wake-up of the fleet's order is worth keeping for it).
    fn answering(&self, key: &Arc<str>) -> bool {
        let _ = key;
        false
    }
    /// A receipt comes back (`used` if its call went upstream). Unused cells are kept for
    /// the next call; a probe that never went lets the next call probe.
    fn returned(&self, receipt: &Receipt);
    /// Resolves when the gate may have opened (an answer came, a reservation was granted).
    fn changed(&self) -> Arc<tokio::sync::Notify>;
    /// The limits learned for `key`, per minute in each dimension (0: not learned).
    fn limits(&self, key: &Arc<str>) -> [u32; DIMS] {
        let _ = key;
        [0; DIMS]
    }
    /// How long `key`'s cooldown gate stays closed, if it is.
    fn cooldown(&self, key: &Arc<str>) -> Option<Duration> {
        let _ = key;
        None
    }
    /// The upstream behind `key` failed (a pool set it aside): its gate closes for `closed`
    /// for the fleet, and one probe goes after.
    fn set_aside(&self, key: &Arc<str>, closed: Duration) {
        let _ = (key, closed);
    }
}

/// The rate gate of a [`RetryAfterBackoffLayer`](crate::RetryAfterBackoffLayer), handed to
/// the fair queue below it (ARCHITECTURE.md, "With gates: one order under every limit").
///
/// # Clone
/// Cheap; clones are the same gate.
#[derive(Clone)]
pub struct RateGate {
    pub(crate) inner: Arc<dyn RateLimit>,
    /// The key of a request that names none.
    pub(crate) default_key: Arc<str>,
}

impl RateGate {
    pub(crate) fn new(inner: Arc<dyn RateLimit>) -> Self {
        let default_key = inner.default_key();
        RateGate { inner, default_key }
    }
}

impl fmt::Debug for RateGate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateGate")
            .field("default_key", &self.inner.default_key())
            .finish()
    }
}

/// The slot caps of a [`TierSlotLimitLayer`](crate::TierSlotLimitLayer) — its store and its
/// [`SlotPolicy`] — handed to the fair queue above it, from
/// [`TierSlotLimitLayer::gate`](crate::TierSlotLimitLayer::gate) (ARCHITECTURE.md, "With
/// gates: one order under every limit").
///
/// A fair queue given it takes each request's slot when it dispatches the request, and
/// marks the request's [`Job`](crate::Job) with this gate: the slot layer it came from lets
/// such a request through without taking a second slot. Another slot layer (another gate,
/// even on the same store) takes its own.
///
/// # Clone
/// Cheap; clones are the same gate.
#[derive(Clone)]
pub struct SlotGate {
    inner: Arc<SlotCaps>,
}

struct SlotCaps {
    store: Store,
    policy: SlotPolicy,
    /// The slow waits of the slot layer and of the fair queue, folded per tier.
    slow_waits: crate::admission::SlowWaits,
}

impl SlotGate {
    pub(crate) fn new(store: Store, policy: SlotPolicy) -> Self {
        SlotGate {
            inner: Arc::new(SlotCaps {
                store,
                policy,
                slow_waits: crate::admission::SlowWaits::default(),
            }),
        }
    }

    /// Where the waits for these slots log `queue.slow_wait`, folded per tier.
    pub(crate) fn slow_waits(&self) -> &crate::admission::SlowWaits {
        &self.inner.slow_waits
    }

    /// The store the slots are counted in.
    pub fn store(&self) -> &Store {
        &self.inner.store
    }

    /// The caps.
    pub fn policy(&self) -> &SlotPolicy {
        &self.inner.policy
    }

    /// Whether `other` is this gate (or a clone of it).
    pub(crate) fn same(&self, other: &SlotGate) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}

/// The slot capability as the layers use it: take a slot, and hear when one may be free
/// (and, in the fleet's order, for which flow). Nothing here says how the store keeps them.
impl SlotGate {
    fn leases(&self) -> &dyn SlotLeases {
        self.inner.store.slot_leases()
    }

    /// Takes a slot of `tier` (for `tenant`, in a tier that caps tenants) under `limits`;
    /// refused, `queue` places the call's flow in the fleet's order (Redis) for a wake-up.
    pub(crate) fn acquire(
        &self,
        tier: &Tier,
        tenant: Option<&TenantId>,
        limits: SlotLimits,
        queue: Option<SlotQueue>,
    ) -> StoreFuture<Result<SlotLease, SlotRefusal>> {
        self.leases().acquire_slot(tier, tenant, limits, queue)
    }

    /// Whether the store orders waiting calls across the fleet itself (Redis): a job's
    /// group is then a level of the store's order, not a queue of the fair queue.
    pub(crate) fn orders_the_fleet(&self) -> bool {
        self.inner.store.is_remote()
    }

    /// Whether a freed slot wakes the one worker whose flow's turn it is (the fleet's
    /// order, while Redis answers) rather than every waiter here: a slot given back here
    /// then wakes nobody here directly.
    pub(crate) fn wakes_one_per_slot(&self) -> bool {
        self.leases().wakes_per_freed_slot()
    }

    /// Whether freed slots go in the fleet's order now.
    pub(crate) fn in_fleet_order(&self) -> bool {
        self.orders_the_fleet() && self.wakes_one_per_slot()
    }

    /// Whether the store is away and the outage policy serves meanwhile.
    pub(crate) fn is_degraded(&self) -> bool {
        self.inner.store.is_degraded()
    }

    /// The wake-ups that came for this worker since last asked: a slot free for a flow,
    /// or for anyone of a tier.
    pub(crate) fn take_wakes(&self) -> Option<SlotWakes> {
        self.leases().take_wakes()
    }

    /// Passes on `n` wake-ups of `flow` in `tier` that no call here can answer, so the
    /// slots go to the next flow now; with `leave`, no call of the flow waits here.
    pub(crate) fn pass_on(&self, tier: &Tier, flow: &str, n: usize, leave: bool) {
        self.leases().pass_on_wakes(tier, flow, n, leave);
    }

    /// What a waiter of `tier` waits on when freed slots wake one worker each.
    pub(crate) fn wake_for(&self, tier: &Tier) -> Option<Arc<tokio::sync::Notify>> {
        self.leases().wake_for(tier)
    }

    /// Notified whenever a slot may have come free (on Redis, anywhere in the fleet).
    pub(crate) fn released(&self) -> &tokio::sync::Notify {
        self.leases().released()
    }

    /// How often a waiter polls, for the policy's `poll_interval`: ten times less often
    /// while freed slots wake waiters one by one, where the poll is only the safety net
    /// for a lost wake-up or an expired lease.
    pub(crate) fn poll_every(&self, interval: Duration) -> Duration {
        if self.wakes_one_per_slot() {
            interval.saturating_mul(10)
        } else {
            interval
        }
    }
}

impl fmt::Debug for SlotGate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SlotGate")
            .field("store", &self.inner.store)
            .field("policy", &self.inner.policy)
            .finish()
    }
}

/// The cell a retry layer hands each attempt, through the request's [`Job`](crate::Job):
/// the fair queue below puts the attempt's [`Receipt`] in it when it dispatches.
#[derive(Clone, Default)]
pub(crate) struct AttemptCell(pub(crate) Arc<std::sync::Mutex<Taken>>);

impl AttemptCell {
    pub(crate) fn put(&self, receipt: Box<Receipt>) {
        *crate::sync::lock(&self.0) = Some(receipt);
    }

    pub(crate) fn take(&self) -> Taken {
        crate::sync::lock(&self.0).take()
    }
}

impl fmt::Debug for AttemptCell {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("AttemptCell")
    }
}
