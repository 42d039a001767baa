//! The state one layer shares between all its services and futures: the fair queue's core
//! (`queues.rs`: the queues and the order's decisions, without IO) behind one mutex, and
//! the shell around it that asks the gates — the slot capability ([`SlotGate`]) and the
//! rate ([`RateGate`]) — and applies the core's decisions.

use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::time::Instant;

use super::error::QueueFull;
use super::fairness::FairnessWindow;
use super::scheduler::SchedulerConfig;
use crate::admission::TierLimit;
use crate::error::ConfigError;
use crate::gate::{RateAsk, RateGate, SlotGate, Taken, Verdict, WaitReason};
use crate::store::{FleetCells, SlotLease, SlotLimits, SlotRefusal, StoreFuture};
use crate::{Job, Priority, Store, TenantId, Tier};

mod after_unlock;
mod effects;
mod permit;
mod queues;
#[cfg(test)]
mod queues_tests;
mod slots;

use self::effects::{AfterUnlock, Declined, Handed};
pub(super) use self::queues::TierWeights;
use self::queues::{Arrival, Group, Handout, Queues, TierSlots, Waiter};

pub use self::permit::Permit;
pub(super) use self::permit::Ticket;

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
    /// What `target` was charged ahead in the order while the acquire is under way.
    reserved: u64,
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

impl<'a> Entry<'a> {
    fn arrival(&self) -> Arrival<'a> {
        Arrival {
            group: self.group,
            class: self.class,
            tenant: self.job.tenant().clone(),
            named: self.job.group(),
            weight: self.weight,
            cost: self.cost,
        }
    }
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
            state: Mutex::new(Queues::new(&config, FairnessWindow::new(fairness_window))?),
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

    /// Where a slot-gated wait logs `queue.slow_wait`: the slot layer's folds, shared.
    fn slow_waits(&self) -> crate::admission::SlowWaits {
        self.slots
            .as_ref()
            .map_or_else(Default::default, |gate| gate.slow_waits().clone())
    }

    /// Whether the slot gate's store orders the fleet's waiting calls itself (Redis): a
    /// job's group is then a level of that order, not a group here.
    fn fleet_keeps_groups(&self) -> bool {
        self.slots.as_ref().is_some_and(SlotGate::orders_the_fleet)
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
            .filter(|_| !self.fleet_keeps_groups())
            .map(|name| (tier.clone(), name.clone()));
        let group = state.group_for(&tier, limit, named, &self.config)?;
        // It waits its class's wait (a batch job longer than the tier's user actions).
        Ok(Placement {
            group,
            patience: Some((tier, limit.for_class(job.priority(), job.sla()))),
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
                true => {
                    let group = place.group;
                    let ask = (tenant, key, job.cost(), arrived);
                    self.rate_now(&mut state, group, ask, &mut after)
                }
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
        // One clock read for the fairness window and the slot's wait.
        let now = Instant::now();
        let arrival = entry.arrival();
        let charged = state.dispatch_now(&arrival, self.config.max_charge(), now, after);
        Admission::Now(Permit::new(
            self.clone(),
            arrival.group,
            arrival.class,
            charged.map(|_| arrival.tenant),
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
            arrived,
            group,
            ..
        } = entry;
        let tenant = job.tenant();
        // Not dispatched: what the rate gate gave goes back to it.
        drop(receipt);
        let waiter = Waiter {
            waker: None,
            weight,
            id: 0,
            key: job.upstream().cloned(),
            cost: job.cost(),
            class,
            arrived,
            group: job.group().filter(|_| self.fleet()).cloned(),
        };
        let fleet = self.fleet();
        let (key, id) = state.push(entry.arrival(), waiter, self.config.max_per_class, fleet)?;
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

    /// The rate gate's word on a request that could go at once: `None` without a rate gate,
    /// `Some(Some(go))` when it may go (with what it took, and the cells its acquire takes),
    /// `Some(None)` when the gate holds it (it queues, and the queue waits for the gate).
    /// `ask`: the call's tenant, upstream key, estimated input tokens and since when it waits.
    fn rate_now(
        &self,
        state: &mut Queues,
        group: usize,
        (tenant, key, cost, waiting_since): (&TenantId, Option<&Arc<str>>, u32, Instant),
        after: &mut AfterUnlock,
    ) -> Option<Option<RateGo>> {
        let rate = self.rate.as_ref()?;
        let key = key.unwrap_or(&rate.default_key);
        // With its slot from the fleet, the call takes its cell of the request rate in the
        // fleet's order too; the gate paces the rest. While Redis is away nobody hands out
        // cells: the gate paces it all, against this worker's share of each limit.
        let from_the_fleet =
            self.fleet() && !self.slots.as_ref().is_some_and(SlotGate::is_degraded);
        let cells = match from_the_fleet && state.groups[group].slots.is_some() {
            true => rate.inner.fleet_cells(key),
            false => None,
        };
        // The gate leaves the request limit to the cells only where this worker names them.
        let fleet_cells = cells.is_some_and(|c| c.names_a_limit());
        Some(
            match rate.inner.clone().check(&RateAsk {
                tenant,
                key,
                cost,
                fleet_cells,
                waiting_since,
            }) {
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
            },
        )
    }

    /// The rate gate's word on the request whose turn it is in `class` of `group` (its
    /// tenant in fair order, passing over tenants held at their cap): `Ok` with its tenant and what
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
        let tenant = state.groups[group].next_tenant(class).ok_or(())?;
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
        let (key, cost, arrived) = (head.key.clone(), head.cost, head.arrived);
        match self.rate_now(state, group, (tenant, key.as_ref(), cost, arrived), after) {
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
        let gate = self.slots.as_ref()?;
        let slots = state.groups[group].slots.as_ref()?;
        let capped = slots.limit.tenant_cap.is_some();
        if slots.blocked || (capped && slots.held_tenants.contains(tenant)) {
            return None;
        }
        let limits = SlotLimits::of(gate.policy(), slots.limit);
        match gate
            .acquire(&slots.tier, Some(tenant), limits, None)
            .into_ready()
        {
            Ok(Ok(lease)) => Some(Some(lease)),
            Ok(Err(SlotRefusal::TenantCap)) => {
                state.hold_tenant(group, tenant.clone(), after);
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
    /// the tenant in fair order. A gated group's request goes only with its slot (`take_slot`).
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
            // A pick the rate gate holds back is not a turn taken: the class keeps its
            // round-robin credit.
            let picker = state.picker.clone();
            let Some((class, group)) = state.pick(&stuck) else {
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
                state.hand_next(group, class, handout, Instant::now(), after);
                continue;
            };
            // The slot is taken for the request whose turn it is: a tier that caps tenants
            // counts it for its tenant, and the fleet's order queues its flow.
            let target = match &rate {
                Some((tenant, _)) => Some(tenant.clone()),
                None if slots.limit.tenant_cap.is_some() || self.fleet() => {
                    match state.groups[group].next_tenant(class) {
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

    /// The group's tier (or the global cap) is full: its calls wait for a wake-up.
    fn block(&self, state: &mut Queues, group: usize, after: &mut AfterUnlock) {
        state.block(group, self.fleet(), after);
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
                if !self
                    .slots
                    .as_ref()
                    .is_some_and(SlotGate::wakes_one_per_slot)
                {
                    state.unblock_all(false);
                }
            }
        });
    }

    pub(super) fn settle(&self, job: &Job, actual: u64, input_tokens: Option<u64>) {
        let (class, _, estimated) = self.classify(job);
        let mut state = self.lock();
        let group = self.slot_policy().map_or(0, |policy| {
            let tier = policy.limit(job.tier()).0;
            let named = job.group().filter(|_| !self.fleet_keeps_groups());
            state.group_of(tier, named)
        });
        state.groups[group]
            .scheduler
            .settle(class, job.tenant(), estimated, actual);
        drop(state);
        // The classifier counted the job toward its day: bring the count to the use, in
        // the unit it counted (nothing when no classifier ran, or the input is unknown).
        let Some((counts, counted)) = job.budget_counted() else {
            return;
        };
        let used = match (counts, input_tokens) {
            (crate::BudgetCounts::Weighted, _) => actual,
            (counts, Some(input)) => counts.count(input, actual),
            (_, None) => return,
        };
        let diff = i128::from(used) - i128::from(counted);
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
