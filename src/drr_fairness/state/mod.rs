//! The state one layer shares between all its services and futures: a scheduler per tier
//! group, the in-flight count and the waiters' wakers, behind one mutex.

use std::collections::VecDeque;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::Waker;
use std::time::Duration;

use tokio::time::Instant;

use super::error::QueueFull;
use super::fairness::FairnessWindow;
use super::scheduler::{ClassPicker, Pick, Rejected, Scheduler, SchedulerConfig};
use crate::admission::TierLimit;
use crate::error::ConfigError;
use crate::gate::{RateGate, SlotGate, Taken, Verdict, WaitReason};
use crate::hash::{HashMap, HashSet};
use crate::rng::Rng;
use crate::store::{
    FleetCells, SlotLease, SlotLimits, SlotRefusal, SlotWake, StoreFuture, flow_name,
};
use crate::{Job, Priority, Store, TenantId, Tier};

mod after_unlock;
mod permit;
mod slots;

use self::after_unlock::{AfterUnlock, Declined};

pub use self::permit::Permit;
pub(super) use self::permit::Ticket;

/// Tier name -> DRR weight.
#[derive(Clone, Debug)]
pub(super) struct TierWeights {
    pub(super) by_tier: HashMap<Tier, u32>,
    pub(super) default: u32,
}

impl Default for TierWeights {
    fn default() -> Self {
        TierWeights {
            by_tier: [(Tier::new(Tier::PRO), 3), (Tier::new(Tier::PREMIUM), 3)]
                .into_iter()
                .collect(),
            default: 1,
        }
    }
}

impl TierWeights {
    fn of(&self, tier: Option<&Tier>) -> u32 {
        tier.and_then(|t| self.by_tier.get(t).copied())
            .unwrap_or(self.default)
    }
}

/// A waiting request as the scheduler holds it.
#[derive(Debug)]
pub(super) struct Waiter {
    waker: Option<Waker>,
    weight: u32,
    /// Names the request in `Queues::handed` once it is dispatched with a slot.
    id: u64,
    /// The upstream key its attempt goes to (the rate gate's), if the retry layer named it.
    key: Option<Arc<str>>,
    /// Its estimated input tokens, for the rate gate.
    cost: u32,
    /// Its class and when it arrived, for who asks how long the queue has been waiting.
    class: Priority,
    arrived: Instant,
    /// The group its tenant is fair-queued in ([`Job::with_group`]), for the fleet's order on a
    /// shared store (an in-process store keeps groups apart as `Group`s of their own).
    group: Option<TenantId>,
}

/// The requests of one tier under the store's slot policy (or, group 0, of every request no
/// slot gates), with their own DRR scheduler: a full tier blocks its group only.
struct Group {
    scheduler: Scheduler<Waiter>,
    /// `None` for group 0: no slot to take.
    slots: Option<TierSlots>,
    /// Start-time fair queuing between the groups of a class: the cost served per unit of
    /// the tier's weight. The group with the least goes next.
    vtime: [f64; 3],
    /// The last step of `vtime` per class: charged ahead for an acquire under way, so the
    /// next pick sees the group as served and other tiers get their turn meanwhile.
    last_step: [f64; 3],
    /// What the group's requests waited for last: the reason of a `Busy`.
    held_for: WaitReason,
}

/// How a tier's group takes its slots from the slot gate: whether the tier is full, the
/// acquires under way, and (Redis) its place in the fleet's order.
struct TierSlots {
    tier: Tier,
    limit: TierLimit,
    /// The last acquire found the tier (or the global cap) full: wait for a release.
    blocked: bool,
    /// Acquires under way (Redis), each holding a window place for the request it is for.
    acquiring: usize,
    /// How many acquires may be under way at once (Redis), as TCP's slow start: one after
    /// a refusal (a freed slot is one slot, not a window's worth), doubling with each slot
    /// granted.
    at_once: usize,
    /// A tier that caps tenants: tenants whose last acquire was refused for their own cap,
    /// passed over in DRR order (the rest of the group goes on) until a slot may have come
    /// free. Always empty otherwise.
    held_tenants: HashSet<TenantId>,
    /// A tier that caps tenants, any tier under a rate gate, or the fleet's order: tenants
    /// an acquire is under way for (Redis), passed over meanwhile so the acquires sent
    /// together are for different tenants, in DRR order.
    acquiring_for: HashMap<TenantId, usize>,
    /// The fleet's order (Redis): wake-ups for a tenant's next call of a class, each to be
    /// answered by an acquire for that call, oldest first.
    owed: VecDeque<(Priority, TenantId)>,
    /// The fleet's order: the flows (class, tenant) this worker is queued in, as far as it
    /// knows, and those still to be queued while the tier is full (an acquire refused
    /// queues its flow).
    queued: HashSet<(Priority, TenantId)>,
    to_queue: VecDeque<(Priority, TenantId)>,
}

impl TierSlots {
    /// Whether something here waits for a slot to come free (or, queued in the fleet's
    /// order, for the wake-up that says whose it is).
    fn waits(&self) -> bool {
        self.blocked
            || !self.held_tenants.is_empty()
            || !self.queued.is_empty()
            || !self.owed.is_empty()
    }
}

impl Group {
    fn new(config: &SchedulerConfig, slots: Option<TierSlots>) -> Result<Self, ConfigError> {
        Ok(Group {
            // The class limit is checked across groups by the layer.
            scheduler: Scheduler::new(config.clone().with_max_per_class(None))?,
            slots,
            vtime: [0.0; 3],
            last_step: [0.0; 3],
            held_for: WaitReason::Slot,
        })
    }

    /// Whether a request of this group may be dispatched now, as far as its slot goes.
    fn may_go(&self) -> bool {
        self.slots.as_ref().is_none_or(|slots| {
            !slots.blocked && slots.acquiring < slots.at_once.min(self.scheduler.len())
        })
    }
}

/// The fair queue under its lock: the groups' schedulers, the window's count, the slots and
/// rate cells handed to dispatched requests, and the fairness window.
struct Queues {
    groups: Vec<Group>,
    /// Gated groups by tier (the tier a request counts under in the slot policy), for
    /// requests of no group ([`Job::with_group`]).
    by_tier: HashMap<Tier, usize>,
    /// Gated groups by tier and group (in-process stores only).
    by_group: HashMap<(Tier, TenantId), usize>,
    picker: ClassPicker,
    in_flight: usize,
    /// A task waits for a slot to come free elsewhere (another worker, another layer).
    watching: bool,
    /// Dispatched requests whose ticket has not claimed its permit yet: their slots and
    /// rate receipts.
    handed: HashMap<u64, Handed>,
    /// The rate gate held the fair order's head back: dispatch again then (`Some(None)`:
    /// when the gate notifies).
    rate_wait: Option<Option<Instant>>,
    next_id: u64,
    fairness: FairnessWindow,
    /// The watcher's poll jitter, seeded from the slot policy (`SlotPolicyBuilder::seed`)
    /// when the first watch starts: the policy is registered after this layer is built.
    rng: Option<Rng>,
}

/// What a dispatched request takes with it.
#[derive(Default)]
struct Handed {
    lease: Option<SlotLease>,
    receipt: Taken,
}

impl Queues {
    /// The rate gate holds the head back until `at` (`None`: until it notifies).
    fn hold_for_rate(&mut self, at: Option<Instant>, after: &mut AfterUnlock) {
        self.rate_wait = Some(match (self.rate_wait, at) {
            (Some(Some(known)), Some(at)) => Some(known.min(at)),
            (Some(Some(known)), None) => Some(known),
            (_, at) => at,
        });
        if !self.watching {
            self.watching = true;
            after.watch = true;
        } else {
            // The watcher may sleep on an older time (or none): it looks again.
            after.rewatch = true;
        }
    }

    fn class_len(&self, class: Priority) -> usize {
        self.groups
            .iter()
            .map(|g| g.scheduler.class_len(class))
            .sum()
    }

    fn len(&self) -> usize {
        self.groups.iter().map(|g| g.scheduler.len()).sum()
    }

    /// No request waits and no group owes the fleet's order a wake-up or a flow to queue:
    /// a dispatch would find nothing to do (the common case of a release).
    fn nothing_to_dispatch(&self) -> bool {
        self.groups.iter().all(|g| {
            g.scheduler.is_empty()
                && g.slots
                    .as_ref()
                    .is_none_or(|s| s.owed.is_empty() && s.to_queue.is_empty())
        })
    }

    /// A slot may have come free: every blocked tier may try again. With `lost`, the
    /// shared store may have lost its wait queue (Redis back, or a missed message): every
    /// flow queues again.
    fn unblock_all(&mut self, lost: bool) {
        for slots in self.groups.iter_mut().filter_map(|g| g.slots.as_mut()) {
            slots.blocked = false;
            slots.held_tenants.clear();
            if lost {
                slots.queued.clear();
            }
        }
    }

    /// Releases woke this worker (an entry per freed slot): a wake for a flow is owed an
    /// acquire for that tenant's next call, or declined (passed on, leaving the flow) when
    /// none waits here; a wake for the tier lets its group send one acquire, for requests
    /// no acquire is on its way for, and the wake-ups beyond those are declined.
    fn woken(&mut self, wakes: Vec<SlotWake>, declined: &mut Vec<Declined>) {
        let mut tiers: HashMap<usize, usize> = HashMap::default();
        for SlotWake { tier, flow } in wakes {
            let Some(&group) = self.by_tier.get(&tier) else {
                continue;
            };
            let g = &mut self.groups[group];
            let Some(slots) = g.slots.as_mut() else {
                continue;
            };
            match flow {
                Some((class, tenant)) => {
                    let waits = Priority::ALL
                        .into_iter()
                        .any(|c| g.scheduler.tenant_len(c, &tenant) > 0);
                    if waits {
                        slots.owed.push_back((class, tenant));
                    } else {
                        slots.queued.remove(&(class, tenant.clone()));
                        declined.push(Declined {
                            tier,
                            flow: flow_name(class, Some(&tenant)),
                            n: 1,
                            leave: true,
                        });
                    }
                }
                None => *tiers.entry(group).or_default() += 1,
            }
        }
        for (group, n) in tiers {
            let g = &mut self.groups[group];
            let waiting = g.scheduler.len();
            let Some(slots) = g.slots.as_mut() else {
                continue;
            };
            let usable = n.min(waiting.saturating_sub(slots.acquiring));
            if usable < n {
                declined.push(Declined {
                    tier: slots.tier.clone(),
                    flow: flow_name(Priority::Standard, None),
                    n: n - usable,
                    leave: waiting == 0,
                });
            }
            if usable > 0 {
                slots.at_once = if slots.blocked {
                    usable
                } else {
                    slots.at_once.max(usable)
                };
                slots.blocked = false;
            }
        }
    }

    /// A request of `class` left the queue: a class with nothing left waiting banks no
    /// round-robin credit (as inside one scheduler).
    fn left(&mut self, class: Priority) {
        if self.class_len(class) == 0 {
            self.picker.forget(class);
        }
    }
}

/// The fair queue one layer and its clones share: its configuration, the slot and rate
/// gates it consults, and its `Queues` behind one lock.
pub(super) struct FairQueue {
    store: Store,
    max_in_flight: usize,
    weights: TierWeights,
    config: SchedulerConfig,
    /// The slot caps, taken at each dispatch (see `crate::gate`).
    slots: Option<SlotGate>,
    /// The provider's rate, consulted at each dispatch.
    rate: Option<RateGate>,
    state: Mutex<Queues>,
    /// Tells a running watcher to look at the state again (see `Queues::hold_for_rate`).
    rewatch: tokio::sync::Notify,
}

/// Usually one (a dispatch hands out one place at a time): the first kept inline, so the
/// common case allocates nothing.
struct Few<T> {
    first: Option<T>,
    rest: Vec<T>,
}

impl<T> Default for Few<T> {
    fn default() -> Self {
        Few {
            first: None,
            rest: Vec::new(),
        }
    }
}

impl<T> Few<T> {
    fn push(&mut self, value: T) {
        match self.first {
            None => self.first = Some(value),
            Some(_) => self.rest.push(value),
        }
    }

    /// Runs `f` on each value in order (no iterator built and dropped for the usual one
    /// value or none).
    fn for_each(self, mut f: impl FnMut(T)) {
        if let Some(first) = self.first {
            f(first);
        }
        if !self.rest.is_empty() {
            self.rest.into_iter().for_each(f);
        }
    }
}

/// An acquire `dispatch` sent for a group's next request in `class` (of `tenant`, in a tier
/// that caps tenants), with the step of the group's virtual time charged ahead for it.
struct Acquire {
    sent: Sent,
    slot: StoreFuture<Result<SlotLease, SlotRefusal>>,
}

/// What an acquire was sent for: its answer is handled with it.
struct Sent {
    group: usize,
    class: Priority,
    ahead: f64,
    tenant: Option<TenantId>,
    /// The tenant whose request the slot goes to (a tier that caps tenants, a rate gate,
    /// or the fleet's order), passed over by the next acquires until the answer.
    target: Option<TenantId>,
    /// More requests of its flow (of the group, outside the fleet's order) waited behind
    /// it: granted the last room, this worker stayed queued for a wake-up (Redis).
    more: bool,
    /// The rate cells taken for the request whose turn it was, and its tenant: the slot
    /// goes to that tenant's request.
    rate: Option<(TenantId, Taken)>,
}

/// The rate gate let a request go: what it took, and the cells of the provider's request
/// rate it left to the fleet's order (the acquire of the request's slot takes one).
struct RateGo {
    taken: Taken,
    cells: Option<FleetCells>,
}

/// What one step of `dispatch_flows` says.
enum FlowStep {
    /// On to the next flow of the group.
    Next,
    /// Nothing more in this group: on to the next group.
    GroupDone,
    /// The slot policy is gone.
    PolicyGone,
}

/// A slot, or rate cells, on their way to the next request of a group (see `hand_next`).
struct Handout {
    lease: Option<SlotLease>,
    /// The rate cells taken for the request whose turn it was, and its tenant.
    rate: Option<(TenantId, Taken)>,
    /// The tenant the slot was taken for (a tier that caps tenants, the fleet's order).
    target: Option<TenantId>,
}

/// How a request got in.
pub(super) enum Admission {
    /// There was room (and its slot): dispatched at once.
    Now(Permit),
    /// It waits for its turn.
    Queued(Ticket),
}

/// Where a request waits: its group, and its tier's patience if a slot gates it.
struct Placement {
    group: usize,
    patience: Option<(Tier, TierLimit)>,
}

/// A request being admitted, as `admit` classified and placed it.
#[derive(Clone, Copy)]
struct Entry<'a> {
    job: &'a Job,
    class: Priority,
    weight: u32,
    cost: u64,
    arrived: Instant,
    group: usize,
}

impl FairQueue {
    pub(super) fn new(
        store: Store,
        max_in_flight: usize,
        config: SchedulerConfig,
        weights: TierWeights,
        fairness_window: Duration,
        slots: Option<SlotGate>,
        rate: Option<RateGate>,
    ) -> Result<Self, ConfigError> {
        if max_in_flight == 0 {
            return Err(ConfigError::new("max_in_flight must be at least 1"));
        }
        if weights.default == 0 || weights.by_tier.values().any(|&w| w == 0) {
            return Err(ConfigError::new("tier weights must be at least 1"));
        }
        if fairness_window < Duration::from_millis(10) {
            return Err(ConfigError::new("fairness window must be at least 10 ms"));
        }
        config.validate()?;
        Ok(FairQueue {
            store,
            max_in_flight,
            weights,
            slots,
            rate,
            rewatch: tokio::sync::Notify::new(),
            state: Mutex::new(Queues {
                groups: vec![Group::new(&config, None)?],
                by_tier: HashMap::default(),
                by_group: HashMap::default(),
                picker: ClassPicker::new(&config),
                in_flight: 0,
                watching: false,
                handed: HashMap::default(),
                rate_wait: None,
                next_id: 0,
                fairness: FairnessWindow::new(fairness_window),
                rng: None,
            }),
            config,
        })
    }

    fn lock(&self) -> MutexGuard<'_, Queues> {
        // Counts and queues stay consistent between statements that could panic (none
        // should); refusing every later request would be worse than going on.
        crate::sync::lock(&self.state)
    }

    pub(super) fn max_in_flight(&self) -> usize {
        self.max_in_flight
    }

    pub(super) fn weights(&self) -> &TierWeights {
        &self.weights
    }

    pub(super) fn scheduler_config(&self) -> SchedulerConfig {
        self.config.clone()
    }

    /// The slot gate this layer takes each request's slot from, if it was given one.
    pub(super) fn slot_gate(&self) -> Option<&SlotGate> {
        self.slots.as_ref()
    }

    /// The caps of the slot gate, if any.
    fn slot_policy(&self) -> Option<&crate::SlotPolicy> {
        self.slots.as_ref().map(SlotGate::policy)
    }

    /// The store the slot gate counts in (this layer's own without one).
    fn slot_store(&self) -> &Store {
        self.slots.as_ref().map_or(&self.store, SlotGate::store)
    }

    pub(super) fn in_flight(&self) -> usize {
        self.lock().in_flight
    }

    pub(super) fn queued(&self, priority: Option<Priority>) -> usize {
        let state = self.lock();
        match priority {
            Some(p) => state.class_len(p),
            None => state.len(),
        }
    }

    /// Requests of `tier` waiting for their slot (its group under the slot gate).
    pub(super) fn queued_in_tier(&self, tier: &Tier) -> usize {
        let state = self.lock();
        state
            .groups
            .iter()
            .filter(|g| g.slots.as_ref().is_some_and(|slots| &slots.tier == tier))
            .map(|g| g.scheduler.len())
            .sum()
    }

    /// How long the request waiting longest here has waited, among those of `tier` (its
    /// group under the slot gate) and of `class` when given. Every waiting request is
    /// looked at: meant for a page read now and then, not for the request path.
    pub(super) fn longest_wait(
        &self,
        tier: Option<&Tier>,
        class: Option<Priority>,
    ) -> Option<Duration> {
        let mut state = self.lock();
        let now = Instant::now();
        state
            .groups
            .iter_mut()
            .filter(|g| {
                tier.is_none_or(|tier| g.slots.as_ref().is_some_and(|slots| &slots.tier == tier))
            })
            .flat_map(|g| g.scheduler.items_mut())
            .filter(|waiter| class.is_none_or(|class| waiter.class == class))
            .map(|waiter| now.saturating_duration_since(waiter.arrived))
            .max()
    }

    pub(super) fn fairness_index(&self) -> Option<f64> {
        let local = self.lock().fairness.index(Instant::now());
        self.store.fleet_fairness_index().unwrap_or(local)
    }

    /// The weight, class and cost of `job`.
    pub(super) fn classify(&self, job: &Job) -> (Priority, u32, u64) {
        (
            job.priority().unwrap_or(Priority::Standard),
            self.weights.of(job.tier()),
            job.charge(),
        )
    }

    /// The group of a request: its tier's under the store's slot policy, unless no policy is
    /// registered or an outer layer already holds its slot (group 0).
    fn place(
        &self,
        state: &mut Queues,
        job: &Job,
        held_above: bool,
    ) -> Result<Placement, ConfigError> {
        let Some(policy) = self.slot_policy().filter(|_| !held_above) else {
            return Ok(Placement {
                group: 0,
                patience: None,
            });
        };
        let (tier, limit, _) = policy.limit(job.tier());
        // A job's group is a level of its own in an in-process store; on a shared store the
        // fleet's order keeps the groups (its wake-ups name a tier and a tenant).
        let named = job
            .group()
            .filter(|_| !self.slot_store().is_remote())
            .map(|name| (tier.clone(), name.clone()));
        let known = match &named {
            Some(key) => state.by_group.get(key),
            None => state.by_tier.get(&tier),
        };
        let group = match known {
            Some(&group) => group,
            None => {
                let slots = TierSlots {
                    tier: tier.clone(),
                    limit,
                    blocked: false,
                    acquiring: 0,
                    at_once: 1,
                    held_tenants: HashSet::default(),
                    acquiring_for: HashMap::default(),
                    owed: VecDeque::new(),
                    queued: HashSet::default(),
                    to_queue: VecDeque::new(),
                };
                state.groups.push(Group::new(&self.config, Some(slots))?);
                let group = state.groups.len() - 1;
                match named {
                    Some(key) => state.by_group.insert(key, group),
                    None => state.by_tier.insert(tier.clone(), group),
                };
                group
            }
        };
        Ok(Placement {
            group,
            patience: Some((tier, limit)),
        })
    }

    /// Called from `call`: a permit (and the slot, when one gates the request) at once while
    /// nothing waits and there is room, else a place in the queue, else (a queue limit)
    /// `QueueFull`. `held_above`: an outer layer holds the request's slot.
    pub(super) fn admit(
        self: &Arc<Self>,
        job: &Job,
        arrived: Instant,
        held_above: bool,
    ) -> Result<Admission, QueueFull> {
        let (class, weight, cost) = self.classify(job);
        let tenant = job.tenant();
        let mut after = AfterUnlock::default();
        let admission = {
            let mut state = self.lock();
            let place = match self.place(&mut state, job, held_above) {
                Ok(place) => place,
                // Only a scheduler refusing the layer's own (validated) config; unreachable.
                Err(_) => return Err(QueueFull::new(class, tenant.clone(), false)),
            };
            // A tier the store refused for its absence asks again for each arrival: Redis
            // may be back, or the outage policy may now serve it.
            let g = &mut state.groups[place.group];
            if g.held_for == WaitReason::Store
                && let Some(slots) = g.slots.as_mut()
            {
                slots.blocked = false;
            }
            let room = state.len() == 0 && state.in_flight < self.max_in_flight;
            let key = job.upstream();
            let receipt = match room {
                true => self.rate_now(&mut state, place.group, key, job.cost(), &mut after),
                false => None,
            };
            let room = room && receipt.as_ref().is_none_or(Option::is_some);
            let slot = match (&place.patience, room) {
                (_, false) => None,
                (None, true) => Some(None),
                (Some(_), true) => self.try_slot_now(&mut state, place.group, tenant, &mut after),
            };
            let entry = Entry {
                job,
                class,
                weight,
                cost,
                arrived,
                group: place.group,
            };
            match slot {
                Some(lease) => {
                    let handed = Handed {
                        lease,
                        receipt: receipt.flatten().and_then(|go| go.taken),
                    };
                    self.admit_now(&mut state, &entry, handed, &mut after)
                }
                None => return self.enqueue(state, entry, place.patience, receipt, after),
            }
        };
        after.run(self, None);
        Ok(admission)
    }

    /// Room, its slot, and nobody waiting: out at once, still charged to the tenant, so a
    /// tenant that filled the window queues behind those that did not.
    fn admit_now(
        self: &Arc<Self>,
        state: &mut Queues,
        entry: &Entry<'_>,
        handed: Handed,
        after: &mut AfterUnlock,
    ) -> Admission {
        let Entry {
            class,
            weight,
            cost,
            group,
            ..
        } = *entry;
        let tenant = entry.job.tenant();
        state.in_flight += 1;
        let charged =
            state.groups[group]
                .scheduler
                .dispatch_direct(class, tenant.clone(), weight, cost);
        // `None`: the class is at its tenant capacity (billions); served, not charged.
        let cost = charged.unwrap_or_else(|| self.config.max_charge().min(cost.max(1)));
        // One clock read for the fairness window and the slot's wait.
        let now = Instant::now();
        after.index = state.fairness.record(tenant, weight, cost, false, now);
        after
            .served
            .push((tenant.clone(), cost, weight, false, now));
        Admission::Now(Permit::new(
            self.clone(),
            group,
            class,
            charged.map(|_| tenant.clone()),
            handed,
            now.saturating_duration_since(entry.arrived),
        ))
    }

    /// No room, or others waiting: a place in the queue (what the rate gate gave goes back),
    /// else `QueueFull`. Dispatches, then runs what the dispatch left once the lock is
    /// released.
    fn enqueue(
        self: &Arc<Self>,
        mut state: MutexGuard<'_, Queues>,
        entry: Entry<'_>,
        patience: Option<(Tier, TierLimit)>,
        receipt: Option<Option<RateGo>>,
        mut after: AfterUnlock,
    ) -> Result<Admission, QueueFull> {
        let Entry {
            job,
            class,
            weight,
            cost,
            arrived,
            group,
        } = entry;
        let tenant = job.tenant();
        // Not dispatched: what the rate gate gave goes back to it.
        drop(receipt);
        if let Some(limit) = self.config.max_per_class
            && state.class_len(class) >= limit
        {
            return Err(QueueFull::new(class, tenant.clone(), false));
        }
        state.next_id += 1;
        let id = state.next_id;
        let waiter = Waiter {
            waker: None,
            weight,
            id,
            key: job.upstream().cloned(),
            cost: job.cost(),
            class,
            arrived,
            group: job.group().filter(|_| self.fleet()).cloned(),
        };
        let g = &mut state.groups[group];
        let was_idle = g.scheduler.class_len(class) == 0;
        let key = match g
            .scheduler
            .push(class, tenant.clone(), weight, cost, waiter)
        {
            Ok(key) => key,
            Err(rejected) => {
                let tenant_limit = matches!(rejected, Rejected::TenantFull(_));
                return Err(QueueFull::new(class, tenant.clone(), tenant_limit));
            }
        };
        if was_idle {
            Self::catch_up(&mut state, group, class);
        }
        // A newcomer flow of a full tier queues in the fleet's order now, so it may take the
        // next slot freed anywhere.
        if self.fleet()
            && let Some(slots) = state.groups[group].slots.as_mut()
            && slots.blocked
            && !slots.queued.contains(&(class, tenant.clone()))
        {
            slots.to_queue.push_back((class, tenant.clone()));
        }
        self.dispatch(&mut state, &mut after);
        after.depth = Some(class);
        let depth = state.class_len(class);
        drop(state);
        after.run(self, Some((class, depth)));
        Ok(Admission::Queued(Ticket {
            shared: Some(self.clone()),
            key,
            id,
            group,
            class,
            tenant: tenant.clone(),
            arrived,
            patience,
            timer: None,
            slow: None,
            held_for: None,
        }))
    }

    /// A group that had nothing waiting in `class` starts no earlier than the groups that
    /// did: idle time banks no credit.
    fn catch_up(state: &mut Queues, group: usize, class: Priority) {
        let ci = class as usize;
        let floor = state
            .groups
            .iter()
            .enumerate()
            .filter(|(g, other)| *g != group && other.scheduler.class_len(class) > 0)
            .map(|(_, other)| other.vtime[ci])
            .fold(f64::INFINITY, f64::min);
        if floor.is_finite() {
            let own = &mut state.groups[group].vtime[ci];
            *own = own.max(floor);
        }
    }

    /// The rate gate's word on a request that could go at once: `None` without a rate gate,
    /// `Some(Some(go))` when it may go (with what it took, and the cells its acquire takes),
    /// `Some(None)` when the gate holds it (it queues, and the queue waits for the gate).
    fn rate_now(
        &self,
        state: &mut Queues,
        group: usize,
        key: Option<&Arc<str>>,
        cost: u32,
        after: &mut AfterUnlock,
    ) -> Option<Option<RateGo>> {
        let rate = self.rate.as_ref()?;
        let key = key.unwrap_or(&rate.default_key);
        // With its slot from the fleet, the call takes its cell of the request rate in the
        // fleet's order too; the gate paces the rest. While Redis is away nobody hands out
        // cells: the gate paces it all, against this worker's share of each limit.
        let from_the_fleet = self.fleet() && !self.slot_store().is_degraded();
        let cells = match from_the_fleet && state.groups[group].slots.is_some() {
            true => rate.inner.fleet_cells(key),
            false => None,
        };
        // The gate leaves the request limit to the cells only where this worker names them.
        let fleet_cells = cells.is_some_and(|c| c.names_a_limit());
        Some(match rate.inner.clone().check(key, cost, fleet_cells) {
            Verdict::Go(mut taken) => {
                // The acquire takes the call's cost from the token rate this worker names:
                // its usage corrects it. (A worker naming none, whose acquire takes the
                // rate another names, reads no usage for it: its calls go at their
                // estimates.)
                if let Some(receipt) = taken.as_mut()
                    && cells.is_some_and(|c| c.tokens.is_some())
                {
                    receipt.fleet_tokens = cost;
                }
                Some(RateGo { taken, cells })
            }
            Verdict::Until(at, reason) => {
                state.groups[group].held_for = reason;
                state.hold_for_rate(Some(at), after);
                None
            }
            Verdict::Notified(reason) => {
                state.groups[group].held_for = reason;
                state.hold_for_rate(None, after);
                None
            }
        })
    }

    /// The rate gate's word on the request whose turn it is in `class` of `group` (its
    /// tenant by DRR, passing over tenants held at their cap): `Ok` with its tenant and what
    /// it took when it may go (`None` without a rate gate), `Err` when the gate holds it,
    /// or nobody of the group may go now.
    fn rate_turn(
        &self,
        state: &mut Queues,
        group: usize,
        class: Priority,
        held: &mut Vec<Option<Arc<str>>>,
        after: &mut AfterUnlock,
    ) -> Result<Option<(TenantId, RateGo)>, ()> {
        if self.rate.is_none() {
            return Ok(None);
        }
        let tenant = Self::next_tenant(&mut state.groups[group], class).ok_or(())?;
        let head = state.groups[group].scheduler.peek_tenant(class, &tenant);
        let key = head.ok_or(())?.key.clone();
        // What the gate reserved for the fair order's head (cells due a moment later) is
        // the head's: a request after it in the order, on the same key, must not take it
        // in the same pass, or the head asks again next time and loses again.
        if held.contains(&key) {
            return Err(());
        }
        let turn = self.rate_for(state, group, class, &tenant, after);
        if turn.is_err() {
            held.push(key);
        }
        turn
    }

    /// `rate_turn` for `tenant`'s next request in `class`.
    fn rate_for(
        &self,
        state: &mut Queues,
        group: usize,
        class: Priority,
        tenant: &TenantId,
        after: &mut AfterUnlock,
    ) -> Result<Option<(TenantId, RateGo)>, ()> {
        if self.rate.is_none() {
            return Ok(None);
        }
        let g = &state.groups[group];
        let head = g.scheduler.peek_tenant(class, tenant).ok_or(())?;
        let (key, cost) = (head.key.clone(), head.cost);
        match self.rate_now(state, group, key.as_ref(), cost, after) {
            Some(Some(receipt)) => Ok(Some((tenant.clone(), receipt))),
            _ => Err(()),
        }
    }

    /// Tries to take a slot for `group` at once: `Some(Some(lease))` taken, `None` when the
    /// tier (or the global cap) is full — the group is then blocked — or when the store needs
    /// a round trip (Redis): then the request queues and the dispatcher sends the acquire.
    ///
    /// In a tier that caps tenants the slot is taken for `tenant`; refused for its cap, only
    /// the tenant is held back.
    fn try_slot_now(
        &self,
        state: &mut Queues,
        group: usize,
        tenant: &TenantId,
        after: &mut AfterUnlock,
    ) -> Option<Option<SlotLease>> {
        let policy = self.slot_policy()?;
        let slots = state.groups[group].slots.as_ref()?;
        let capped = slots.limit.tenant_cap.is_some();
        if slots.blocked || (capped && slots.held_tenants.contains(tenant)) {
            return None;
        }
        match self
            .store
            .try_acquire_slot_for(
                &slots.tier,
                Some(tenant),
                SlotLimits::of(policy, slots.limit),
            )
            .into_ready()
        {
            Ok(Ok(lease)) => Some(Some(lease)),
            Ok(Err(SlotRefusal::TenantCap)) => {
                self.hold_tenant(state, group, tenant.clone(), after);
                None
            }
            Ok(Err(SlotRefusal::Full)) => {
                self.block(state, group, after);
                None
            }
            Ok(Err(SlotRefusal::Rate)) => {
                self.block_for_rate(state, group, after);
                None
            }
            Ok(Err(SlotRefusal::Store)) => {
                self.refuse(state, group, after);
                None
            }
            // Not sent: dropped unpolled, it holds nothing.
            Err(_) => None,
        }
    }

    /// Dispatches waiting requests in fair order while the window has room: first what the
    /// fleet's order owes (`dispatch_flows`), then the class by weighted round robin among
    /// the classes with a request that may go, the group (tier) by start-time fair queuing,
    /// the tenant by DRR. A gated group's request goes only with its slot (`take_slot`).
    /// A group (in a class) whose waiting tenants are all held is `stuck` until the next
    /// dispatch.
    fn dispatch(self: &Arc<Self>, state: &mut Queues, after: &mut AfterUnlock) {
        let mut stuck: Vec<(usize, Priority)> = Vec::new();
        // The rate gate's keys that held the fair order's head back in this pass.
        let mut held: Vec<Option<Arc<str>>> = Vec::new();
        // Set again below if the rate gate still holds the head back.
        state.rate_wait = None;
        if state.nothing_to_dispatch() {
            return;
        }
        if !self.dispatch_flows(state, after) {
            return;
        }
        while state.in_flight < self.max_in_flight {
            let candidates = Priority::ALL.map(|class| {
                state.groups.iter().enumerate().any(|(i, g)| {
                    g.may_go() && g.scheduler.class_len(class) > 0 && !stuck.contains(&(i, class))
                })
            });
            // A pick the rate gate holds back is not a turn taken: the class keeps its
            // round-robin credit.
            let picker = state.picker.clone();
            let Some(class) = state.picker.pick(candidates) else {
                return;
            };
            let ci = class as usize;
            let Some(group) = (0..state.groups.len())
                .filter(|&i| {
                    let g = &state.groups[i];
                    g.may_go() && g.scheduler.class_len(class) > 0 && !stuck.contains(&(i, class))
                })
                .min_by(|&a, &b| state.groups[a].vtime[ci].total_cmp(&state.groups[b].vtime[ci]))
            else {
                return;
            };
            let rate = match self.rate_turn(state, group, class, &mut held, after) {
                Ok(rate) => rate,
                Err(()) => {
                    state.picker = picker;
                    stuck.push((group, class));
                    continue;
                }
            };
            let Some(slots) = &state.groups[group].slots else {
                // No slot to take: no cells either (the fleet orders them with slots).
                let handout = Handout {
                    lease: None,
                    rate: rate.map(|(tenant, go)| (tenant, go.taken)),
                    target: None,
                };
                self.hand_next(state, group, class, handout, after);
                continue;
            };
            // The slot is taken for the request whose turn it is: a tier that caps tenants
            // counts it for its tenant, and the fleet's order queues its flow.
            let target = match &rate {
                Some((tenant, _)) => Some(tenant.clone()),
                None if slots.limit.tenant_cap.is_some() || self.fleet() => {
                    match Self::next_tenant(&mut state.groups[group], class) {
                        Some(tenant) => Some(tenant),
                        None => {
                            stuck.push((group, class));
                            continue;
                        }
                    }
                }
                None => None,
            };
            if !self.take_slot(state, group, class, target, rate, after) {
                return;
            }
        }
    }

    /// The group's tier (or the global cap) is full: its calls wait for a wake-up. In the
    /// fleet's order, every flow of the group not yet queued in Redis is to be queued.
    fn block(&self, state: &mut Queues, group: usize, after: &mut AfterUnlock) {
        let fleet = self.fleet();
        let Group {
            scheduler,
            slots,
            held_for,
            ..
        } = &mut state.groups[group];
        *held_for = WaitReason::Slot;
        if let Some(slots) = slots.as_mut() {
            if fleet && !slots.blocked {
                for class in Priority::ALL {
                    for tenant in scheduler.waiting_tenants(class) {
                        if !slots.queued.contains(&(class, tenant.clone())) {
                            slots.to_queue.push_back((class, tenant.clone()));
                        }
                    }
                }
            }
            slots.blocked = true;
            slots.at_once = 1;
        }
        if !state.watching {
            state.watching = true;
            after.watch = true;
        }
    }

    /// The fleet's cells of the provider's request rate are all taken: the group's calls
    /// wait for a wake-up as for a full tier, held for the rate.
    fn block_for_rate(&self, state: &mut Queues, group: usize, after: &mut AfterUnlock) {
        self.block(state, group, after);
        state.groups[group].held_for = WaitReason::Rate;
    }

    /// The store refused the group's tier for its own absence (Redis away, and this worker
    /// cannot admit a call of the tier soundly, `SlotRefusal::Store`): waiting would not
    /// help, so every request of the group is woken to answer `Busy` at once, as is any
    /// that arrives before the group tries again (see `Ticket::poll_turn`).
    fn refuse(&self, state: &mut Queues, group: usize, after: &mut AfterUnlock) {
        self.block(state, group, after);
        let g = &mut state.groups[group];
        g.held_for = WaitReason::Store;
        for waiter in g.scheduler.items_mut() {
            if let Some(waker) = waiter.waker.take() {
                after.wake.push(waker);
            }
        }
    }

    /// Pops the next request of `group` in `class` (or, if none is left there, of its
    /// highest class with one) and hands it the window place, `lease` and the rate cells.
    /// A slot taken for a tenant's request (`target`: a tier that caps tenants, the fleet's
    /// order), or together with rate cells for the request whose turn it was, goes to that
    /// tenant's request, or back if it has none left.
    fn hand_next(
        &self,
        state: &mut Queues,
        group: usize,
        class: Priority,
        handout: Handout,
        after: &mut AfterUnlock,
    ) {
        let Handout {
            lease,
            rate,
            target,
        } = handout;
        let (for_tenant, receipt) = match rate {
            Some((tenant, receipt)) => (Some(tenant), receipt),
            None => (target, None),
        };
        let handed = Handed { lease, receipt };
        let g = &mut state.groups[group];
        let next = match &for_tenant {
            Some(tenant) => std::iter::once(class)
                .chain(Priority::ALL)
                .find_map(|c| g.scheduler.pop_tenant(c, tenant)),
            None => {
                // The class the slot was taken for, or (its requests went away meanwhile)
                // the group's highest class with one.
                std::iter::once(class)
                    .chain(Priority::ALL)
                    .find(|&c| g.scheduler.class_len(c) > 0)
                    .and_then(|c| g.scheduler.pop_class(c))
            }
        };
        match next {
            Some(next) => self.handed(state, group, next, handed, after),
            // Nothing of it waits any more: the slot and the cells go back.
            None => after.drop_handed.push(handed),
        }
    }

    /// Hands `next` (popped from `group`) the window place and `lease`.
    fn handed(
        &self,
        state: &mut Queues,
        group: usize,
        next: super::scheduler::Dispatched<Waiter>,
        handed: Handed,
        after: &mut AfterUnlock,
    ) {
        let class = next.class;
        let ci = class as usize;
        // The tier's weight, whatever its number of tenants waiting: a flood of many
        // tenants of one tier takes that tier's share, not more.
        let weight = f64::from(next.item.weight.max(1));
        // The tier's share is split among its groups with work in the class: each steps
        // as many times as far, so the tier as a whole advances as one group would, and
        // inside it the groups (services) go in turn whatever their number of tenants.
        let groups = Self::groups_sharing(state, group, class);
        let g = &mut state.groups[group];
        g.last_step[ci] = next.cost as f64 * groups as f64 / weight;
        g.vtime[ci] += g.last_step[ci];
        state.left(class);
        state.in_flight += 1;
        let now = Instant::now();
        after.index = state
            .fairness
            .record(&next.tenant, next.item.weight, next.cost, true, now);
        after.depth = Some(next.class);
        if handed.lease.is_some() || handed.receipt.is_some() {
            state.handed.insert(next.item.id, handed);
        }
        after
            .served
            .push((next.tenant, next.cost, next.item.weight, true, now));
        if let Some(waker) = next.item.waker {
            after.wake.push(waker);
        }
    }

    /// How many groups of `group`'s tier (itself included) have requests of `class`
    /// waiting: 1 unless jobs name groups ([`Job::with_group`]).
    fn groups_sharing(state: &Queues, group: usize, class: Priority) -> usize {
        let Some(tier) = state.groups[group].slots.as_ref().map(|slots| &slots.tier) else {
            return 1;
        };
        if state.by_group.is_empty() {
            return 1;
        }
        let others = state
            .groups
            .iter()
            .enumerate()
            .filter(|(i, g)| {
                *i != group
                    && g.scheduler.class_len(class) > 0
                    && g.slots.as_ref().is_some_and(|slots| &slots.tier == tier)
            })
            .count();
        1 + others
    }

    /// The tenant whose DRR turn it is in `class` of `group`, passing over (to the back of
    /// the round) tenants held at their cap or with an acquire under way; `None` if every
    /// waiting tenant is one of those.
    fn next_tenant(group: &mut Group, class: Priority) -> Option<TenantId> {
        let Group {
            scheduler, slots, ..
        } = group;
        let slots = slots.as_ref();
        let mut next = None;
        // Never `Take`: nothing is popped here.
        let _ = scheduler.pop_class_where(class, |tenant| {
            if slots.is_some_and(|slots| {
                slots.held_tenants.contains(tenant) || slots.acquiring_for.contains_key(tenant)
            }) {
                Pick::Skip
            } else {
                next = Some(tenant.clone());
                Pick::Stop
            }
        });
        next
    }

    /// `tenant` is at its own cap: its requests wait, passed over, until a slot may have
    /// come free; the rest of the group goes on.
    fn hold_tenant(
        &self,
        state: &mut Queues,
        group: usize,
        tenant: TenantId,
        after: &mut AfterUnlock,
    ) {
        state.groups[group].held_for = WaitReason::Slot;
        if let Some(slots) = state.groups[group].slots.as_mut() {
            slots.held_tenants.insert(tenant);
        }
        if !state.watching {
            state.watching = true;
            after.watch = true;
        }
    }

    /// The rate gate may have opened: dispatch again, in fair order.
    fn rate_opened(self: &Arc<Self>) {
        self.then_dispatch(|_, _| {});
    }

    /// A permit came back: its request, if the scheduler counted it (`tenant`), is no longer
    /// in flight; its slot, if it held one, is free; hand the place to the next request in
    /// fair order, if one waits.
    fn release(
        self: &Arc<Self>,
        group: usize,
        class: Priority,
        tenant: Option<&TenantId>,
        lease: Option<SlotLease>,
    ) {
        self.then_dispatch(|state, _| {
            state.in_flight = state.in_flight.saturating_sub(1);
            if let Some(tenant) = tenant {
                state.groups[group].scheduler.complete(class, tenant);
            }
            if lease.is_some() {
                // The slot is given back before the next dispatch tries to take one. On
                // Redis the release wakes the worker whose turn it is, maybe this one.
                drop(lease);
                if !self.slot_store().wakes_per_freed_slot() {
                    state.unblock_all(false);
                }
            }
        });
    }

    pub(super) fn settle(&self, job: &Job, actual: u64) {
        let (class, _, estimated) = self.classify(job);
        let mut state = self.lock();
        let group = self
            .slot_policy()
            .and_then(|policy| {
                let tier = policy.limit(job.tier()).0;
                match job.group() {
                    Some(name) if !self.slot_store().is_remote() => {
                        state.by_group.get(&(tier, name.clone())).copied()
                    }
                    _ => state.by_tier.get(&tier).copied(),
                }
            })
            .unwrap_or(0);
        state.groups[group]
            .scheduler
            .settle(class, job.tenant(), estimated, actual);
        drop(state);
        // The daily count took the charge when the job was classified: bring it to the use.
        let diff = i128::from(actual) - i128::from(estimated);
        let diff = i64::try_from(diff).unwrap_or(if diff < 0 { i64::MIN } else { i64::MAX });
        if diff != 0 {
            self.store.correct_tokens(job.tenant(), diff);
        }
    }
}

impl fmt::Debug for FairQueue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = self.lock();
        f.debug_struct("DrrFairnessState")
            .field("max_in_flight", &self.max_in_flight)
            .field("in_flight", &state.in_flight)
            .field("queued", &state.len())
            .field("store", &self.store)
            .finish()
    }
}
