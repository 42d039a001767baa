//! The fair queue's core, without IO: the requests waiting per group (a tier, or a tier
//! and a service), and the decisions of the fair order over them — which class and group go
//! next, whose turn it is inside a group, what a dispatch charges, what a wake-up of the
//! fleet's order is owed — each a function of the queues and of what the gates answered.
//! The shell (`mod.rs`, `slots.rs`) asks the gates and applies these under its lock; what
//! is left to do once the lock is released is written to an `AfterUnlock`, not done here.

use std::collections::VecDeque;
use std::sync::Arc;
use std::task::Waker;

use tokio::time::Instant;

use super::effects::{AfterUnlock, Declined, Handed};
use crate::admission::TierLimit;
use crate::drr_fairness::error::QueueFull;
use crate::drr_fairness::fairness::FairnessWindow;
use crate::drr_fairness::scheduler::{
    ClassPicker, Dispatched, Key, Rejected, Scheduler, SchedulerConfig,
};
use crate::error::ConfigError;
use crate::gate::Taken;
use crate::gate::WaitReason;
use crate::hash::{HashMap, HashSet};
use crate::rng::Rng;
use crate::store::{SlotLease, SlotWake, flow_name};
use crate::{Priority, TenantId, Tier};

/// Tier name -> weight in the fair order.
#[derive(Clone, Debug)]
pub(in crate::drr_fairness) struct TierWeights {
    pub(in crate::drr_fairness) by_tier: HashMap<Tier, u32>,
    pub(in crate::drr_fairness) default: u32,
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
    pub(super) fn of(&self, tier: Option<&Tier>) -> u32 {
        tier.and_then(|t| self.by_tier.get(t).copied())
            .unwrap_or(self.default)
    }
}

/// A waiting request as the scheduler holds it.
#[derive(Debug)]
pub(super) struct Waiter {
    pub(super) waker: Option<Waker>,
    pub(super) weight: u32,
    /// Names the request in `Queues::handed` once it is dispatched with a slot.
    pub(super) id: u64,
    /// The upstream key its attempt goes to (the rate gate's), if the retry layer named it.
    pub(super) key: Option<Arc<str>>,
    /// Its estimated input tokens, for the rate gate.
    pub(super) cost: u32,
    /// Its class and when it arrived, for who asks how long the queue has been waiting.
    pub(super) class: Priority,
    pub(super) arrived: Instant,
    /// The group its tenant is fair-queued in ([`Job::with_group`]), for the fleet's order on a
    /// shared store (an in-process store keeps groups apart as `Group`s of their own).
    pub(super) group: Option<TenantId>,
}

/// The requests of one tier under the store's slot policy (or, group 0, of every request no
/// slot gates), with their own scheduler: a full tier blocks its group only.
pub(super) struct Group {
    pub(super) scheduler: Scheduler<Waiter>,
    /// `None` for group 0: no slot to take.
    pub(super) slots: Option<TierSlots>,
    /// Start-time fair queuing between the groups of a class: the cost served per unit of
    /// the tier's weight. The group with the least goes next.
    pub(super) vtime: [f64; 3],
    /// The last step of `vtime` per class: charged ahead for an acquire under way, so the
    /// next pick sees the group as served and other tiers get their turn meanwhile.
    pub(super) last_step: [f64; 3],
    /// What the group's requests waited for last: the reason of a `Busy`.
    pub(super) held_for: WaitReason,
}

/// How a tier's group takes its slots from the slot gate: whether the tier is full, the
/// acquires under way, and (Redis) its place in the fleet's order.
pub(super) struct TierSlots {
    pub(super) tier: Tier,
    pub(super) limit: TierLimit,
    /// The last acquire found the tier (or the global cap) full: wait for a release.
    pub(super) blocked: bool,
    /// Acquires under way (Redis), each holding a window place for the request it is for.
    pub(super) acquiring: usize,
    /// How many acquires may be under way at once (Redis), as TCP's slow start: one after
    /// a refusal (a freed slot is one slot, not a window's worth), doubling with each slot
    /// granted.
    pub(super) at_once: usize,
    /// A tier that caps tenants: tenants whose last acquire was refused for their own cap,
    /// passed over in fair order (the rest of the group goes on) until a slot may have come
    /// free. Always empty otherwise.
    pub(super) held_tenants: HashSet<TenantId>,
    /// A tier that caps tenants, any tier under a rate gate, or the fleet's order: tenants
    /// an acquire is under way for (Redis), passed over meanwhile so the acquires sent
    /// together are for different tenants, in fair order.
    pub(super) acquiring_for: HashMap<TenantId, usize>,
    /// The fleet's order (Redis): wake-ups for a tenant's next call of a class, each to be
    /// answered by an acquire for that call, oldest first.
    pub(super) owed: VecDeque<(Priority, TenantId)>,
    /// The fleet's order: the flows (class, tenant) this worker is queued in, as far as it
    /// knows, and those still to be queued while the tier is full (an acquire refused
    /// queues its flow).
    pub(super) queued: HashSet<(Priority, TenantId)>,
    pub(super) to_queue: VecDeque<(Priority, TenantId)>,
}

impl TierSlots {
    /// Whether something here waits for a slot to come free (or, queued in the fleet's
    /// order, for the wake-up that says whose it is).
    pub(super) fn waits(&self) -> bool {
        self.blocked
            || !self.held_tenants.is_empty()
            || !self.queued.is_empty()
            || !self.owed.is_empty()
    }
}

impl Group {
    pub(super) fn new(
        config: &SchedulerConfig,
        slots: Option<TierSlots>,
    ) -> Result<Self, ConfigError> {
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
    pub(super) fn may_go(&self) -> bool {
        self.slots.as_ref().is_none_or(|slots| {
            !slots.blocked && slots.acquiring < slots.at_once.min(self.scheduler.len())
        })
    }
}

/// The fair queue under its lock: the groups' schedulers, the window's count, the slots and
/// rate cells handed to dispatched requests, and the fairness window.
pub(super) struct Queues {
    pub(super) groups: Vec<Group>,
    /// Gated groups by tier (the tier a request counts under in the slot policy), for
    /// requests of no group ([`Job::with_group`]).
    pub(super) by_tier: HashMap<Tier, usize>,
    /// Gated groups by tier and group (in-process stores only).
    pub(super) by_group: HashMap<(Tier, TenantId), usize>,
    pub(super) picker: ClassPicker,
    pub(super) in_flight: usize,
    /// A task waits for a slot to come free elsewhere (another worker, another layer).
    pub(super) watching: bool,
    /// Dispatched requests whose ticket has not claimed its permit yet: their slots and
    /// rate receipts.
    pub(super) handed: HashMap<u64, Handed>,
    /// The rate gate held the fair order's head back: dispatch again then (`Some(None)`:
    /// when the gate notifies).
    pub(super) rate_wait: Option<Option<Instant>>,
    pub(super) next_id: u64,
    pub(super) fairness: FairnessWindow,
    /// The watcher's poll jitter, seeded from the slot policy (`SlotPolicyBuilder::seed`)
    /// when the first watch starts: the policy is registered after this layer is built.
    pub(super) rng: Option<Rng>,
}

impl Queues {
    /// The rate gate holds the head back until `at` (`None`: until it notifies).
    pub(super) fn hold_for_rate(&mut self, at: Option<Instant>, after: &mut AfterUnlock) {
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

    pub(super) fn class_len(&self, class: Priority) -> usize {
        self.groups
            .iter()
            .map(|g| g.scheduler.class_len(class))
            .sum()
    }

    pub(super) fn len(&self) -> usize {
        self.groups.iter().map(|g| g.scheduler.len()).sum()
    }

    /// No request waits and no group owes the fleet's order a wake-up or a flow to queue:
    /// a dispatch would find nothing to do (the common case of a release).
    pub(super) fn nothing_to_dispatch(&self) -> bool {
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
    pub(super) fn unblock_all(&mut self, lost: bool) {
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
    pub(super) fn woken(&mut self, wakes: Vec<SlotWake>, declined: &mut Vec<Declined>) {
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
    pub(super) fn left(&mut self, class: Priority) {
        if self.class_len(class) == 0 {
            self.picker.forget(class);
        }
    }
}

/// A slot, or rate cells, on their way to the next request of a group (see
/// `Queues::hand_next`).
pub(super) struct Handout {
    pub(super) lease: Option<SlotLease>,
    /// The rate cells taken for the request whose turn it was, and its tenant.
    pub(super) rate: Option<(TenantId, Taken)>,
    /// The tenant the slot was taken for (a tier that caps tenants, the fleet's order).
    pub(super) target: Option<TenantId>,
}

/// A request joining the queue, as the shell classified it.
pub(super) struct Arrival<'a> {
    pub(super) group: usize,
    pub(super) class: Priority,
    pub(super) tenant: TenantId,
    /// The group the job names ([`Job::with_group`](crate::Job::with_group)): its tenants
    /// take one turn together in the scheduler's order.
    pub(super) named: Option<&'a TenantId>,
    pub(super) weight: u32,
    pub(super) cost: u64,
}

impl Queues {
    pub(super) fn new(
        config: &SchedulerConfig,
        fairness: FairnessWindow,
    ) -> Result<Self, ConfigError> {
        Ok(Queues {
            groups: vec![Group::new(config, None)?],
            by_tier: HashMap::default(),
            by_group: HashMap::default(),
            picker: ClassPicker::new(config),
            in_flight: 0,
            watching: false,
            handed: HashMap::default(),
            rate_wait: None,
            next_id: 0,
            fairness,
            rng: None,
        })
    }

    /// The group of `tier` (of `named`, its tier and group, when jobs name groups and the
    /// store keeps them apart here), made on first use.
    pub(super) fn group_for(
        &mut self,
        tier: &Tier,
        limit: TierLimit,
        named: Option<(Tier, TenantId)>,
        config: &SchedulerConfig,
    ) -> Result<usize, ConfigError> {
        let known = match &named {
            Some(key) => self.by_group.get(key),
            None => self.by_tier.get(tier),
        };
        if let Some(&group) = known {
            return Ok(group);
        }
        self.groups.push(Group::new(
            config,
            Some(TierSlots::new(tier.clone(), limit)),
        )?);
        let group = self.groups.len() - 1;
        match named {
            Some(key) => self.by_group.insert(key, group),
            None => self.by_tier.insert(tier.clone(), group),
        };
        Ok(group)
    }

    /// The group a job of `tier` (and `named` group) waits in, if it has one yet; group 0
    /// otherwise.
    pub(super) fn group_of(&self, tier: Tier, named: Option<&TenantId>) -> usize {
        match named {
            Some(name) => self.by_group.get(&(tier, name.clone())).copied(),
            None => self.by_tier.get(&tier).copied(),
        }
        .unwrap_or(0)
    }

    /// Queues `waiter`: its place in its group's scheduler, or `QueueFull` (the class at
    /// `max_per_class`, or the tenant at the scheduler's limit). A group that had nothing
    /// of the class waiting catches up; in the fleet's order (`fleet`), a newcomer flow of
    /// a full tier is to be queued in the store at once, to take the next slot freed
    /// anywhere.
    pub(super) fn push(
        &mut self,
        arrival: Arrival<'_>,
        mut waiter: Waiter,
        max_per_class: Option<usize>,
        fleet: bool,
    ) -> Result<(Key, u64), QueueFull> {
        let Arrival {
            group,
            class,
            tenant,
            named,
            weight,
            cost,
        } = arrival;
        if max_per_class.is_some_and(|limit| self.class_len(class) >= limit) {
            return Err(QueueFull::new(class, tenant, false));
        }
        self.next_id += 1;
        let id = self.next_id;
        waiter.id = id;
        let g = &mut self.groups[group];
        let was_idle = g.scheduler.class_len(class) == 0;
        let key = g
            .scheduler
            .push_in(class, named, tenant.clone(), weight, cost, waiter)
            .map_err(|rejected| {
                let tenant_limit = matches!(rejected, Rejected::TenantFull(_));
                QueueFull::new(class, tenant.clone(), tenant_limit)
            })?;
        if was_idle {
            self.catch_up(group, class);
        }
        if fleet
            && let Some(slots) = self.groups[group].slots.as_mut()
            && slots.blocked
            && !slots.queued.contains(&(class, tenant.clone()))
        {
            slots.to_queue.push_back((class, tenant));
        }
        Ok((key, id))
    }

    /// A group that had nothing waiting in `class` starts no earlier than the groups that
    /// did: idle time banks no credit.
    pub(super) fn catch_up(&mut self, group: usize, class: Priority) {
        let ci = class as usize;
        let floor = self
            .groups
            .iter()
            .enumerate()
            .filter(|(g, other)| *g != group && other.scheduler.class_len(class) > 0)
            .map(|(_, other)| other.vtime[ci])
            .fold(f64::INFINITY, f64::min);
        if floor.is_finite() {
            let own = &mut self.groups[group].vtime[ci];
            *own = own.max(floor);
        }
    }

    /// The next turn of the fair order among the groups that may go and are not `stuck`:
    /// the class by weighted round robin among the classes with such a group, then the
    /// group (tier) with the least virtual time in it. The picker's round is taken: the
    /// caller restores it if the turn is not used.
    pub(super) fn pick(&mut self, stuck: &[(usize, Priority)]) -> Option<(Priority, usize)> {
        let open = |i: usize, g: &Group, class: Priority| {
            g.may_go() && g.scheduler.class_len(class) > 0 && !stuck.contains(&(i, class))
        };
        let candidates = Priority::ALL.map(|class| {
            self.groups
                .iter()
                .enumerate()
                .any(|(i, g)| open(i, g, class))
        });
        let class = self.picker.pick(candidates)?;
        let ci = class as usize;
        let group = (0..self.groups.len())
            .filter(|&i| open(i, &self.groups[i], class))
            .min_by(|&a, &b| self.groups[a].vtime[ci].total_cmp(&self.groups[b].vtime[ci]))?;
        Some((class, group))
    }

    /// Starts the watcher, unless one runs.
    pub(super) fn watch(&mut self, after: &mut AfterUnlock) {
        if !self.watching {
            self.watching = true;
            after.watch = true;
        }
    }

    /// The group's tier (or the global cap) is full: its calls wait for a wake-up. In the
    /// fleet's order (`fleet`), every flow of the group not yet queued in the store is to
    /// be queued.
    pub(super) fn block(&mut self, group: usize, fleet: bool, after: &mut AfterUnlock) {
        let Group {
            scheduler,
            slots,
            held_for,
            ..
        } = &mut self.groups[group];
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
        self.watch(after);
    }

    /// `tenant` is at its own cap: its requests wait, passed over, until a slot may have
    /// come free; the rest of the group goes on.
    pub(super) fn hold_tenant(&mut self, group: usize, tenant: TenantId, after: &mut AfterUnlock) {
        self.groups[group].held_for = WaitReason::Slot;
        if let Some(slots) = self.groups[group].slots.as_mut() {
            slots.held_tenants.insert(tenant);
        }
        self.watch(after);
    }

    /// How many groups of `group`'s tier (itself included) have requests of `class`
    /// waiting: 1 unless jobs name groups ([`Job::with_group`](crate::Job::with_group)).
    pub(super) fn groups_sharing(&self, group: usize, class: Priority) -> usize {
        let Some(tier) = self.groups[group].slots.as_ref().map(|slots| &slots.tier) else {
            return 1;
        };
        if self.by_group.is_empty() {
            return 1;
        }
        let others = self
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

    /// Pops the next request of `group` in `class` (or, if none is left there, of its
    /// highest class with one) and hands it the window place, the slot and the rate cells.
    /// A slot taken for a tenant's request (`target`: a tier that caps tenants, the fleet's
    /// order), or together with rate cells for the request whose turn it was, goes to that
    /// tenant's request, or back (in `after`) if it has none left.
    pub(super) fn hand_next(
        &mut self,
        group: usize,
        class: Priority,
        handout: Handout,
        now: Instant,
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
        let g = &mut self.groups[group];
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
            Some(next) => self.handed(group, next, handed, now, after),
            // Nothing of it waits any more: the slot and the cells go back.
            None => after.drop_handed.push(handed),
        }
    }

    /// Hands `next` (popped from `group`) the window place and what was taken for it, and
    /// charges its group: the group's virtual time steps by the cost over its tier's weight.
    fn handed(
        &mut self,
        group: usize,
        next: Dispatched<Waiter>,
        handed: Handed,
        now: Instant,
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
        let groups = self.groups_sharing(group, class);
        let g = &mut self.groups[group];
        g.last_step[ci] = next.cost as f64 * groups as f64 / weight;
        g.vtime[ci] += g.last_step[ci];
        self.left(class);
        self.in_flight += 1;
        after.index = self
            .fairness
            .record(&next.tenant, next.item.weight, next.cost, true, now);
        after.depth = Some(next.class);
        if handed.lease.is_some() || handed.receipt.is_some() {
            self.handed.insert(next.item.id, handed);
        }
        after
            .served
            .push((next.tenant, next.cost, next.item.weight, true, now));
        if let Some(waker) = next.item.waker {
            after.wake.push(waker);
        }
    }

    /// A request dispatched at once, nobody waiting: in the window, still charged to its
    /// tenant (so a tenant that filled the window queues behind those that did not).
    /// Returns what it was charged (`None`: the class is at its tenant capacity, served
    /// and not charged) and the cost recorded.
    pub(super) fn dispatch_now(
        &mut self,
        arrival: &Arrival<'_>,
        max_charge: u64,
        now: Instant,
        after: &mut AfterUnlock,
    ) -> Option<u64> {
        let Arrival {
            group,
            class,
            ref tenant,
            named,
            weight,
            cost,
        } = *arrival;
        self.in_flight += 1;
        let charged = self.groups[group].scheduler.dispatch_direct_in(
            class,
            named,
            tenant.clone(),
            weight,
            cost,
        );
        let recorded = charged.unwrap_or_else(|| max_charge.min(cost.max(1)));
        after.index = self.fairness.record(tenant, weight, recorded, false, now);
        after
            .served
            .push((tenant.clone(), recorded, weight, false, now));
        charged
    }
}

impl Group {
    /// The tenant whose turn it is in `class`, passing over (keeping their places)
    /// tenants held at their cap or with an acquire under way for each of their calls
    /// waiting; `None` if every waiting tenant is one of those. A tenant with more calls
    /// waiting than acquires under way stays in turn, placed as if served for each
    /// (`Scheduler::reserve`): a key that is one tenant gets its share of the acquires sent
    /// together beside a key of many end users, and no more than a tenant's share.
    pub(super) fn next_tenant(&self, class: Priority) -> Option<TenantId> {
        let slots = self.slots.as_ref();
        self.scheduler
            .next_where(class, |tenant, waiting| {
                slots.is_some_and(|slots| {
                    slots.held_tenants.contains(tenant)
                        || slots
                            .acquiring_for
                            .get(tenant)
                            .is_some_and(|&under_way| under_way >= waiting)
                })
            })
            .cloned()
    }

    /// A full tier with calls waiting here but nothing that will wake them — no flow
    /// queued in the fleet's order, none to queue, no acquire or wake-up under way — queues
    /// every flow again.
    pub(super) fn requeue_if_lost(&mut self) {
        let Group {
            scheduler, slots, ..
        } = self;
        let Some(slots) = slots.as_mut() else {
            return;
        };
        if !slots.blocked
            || scheduler.is_empty()
            || !slots.queued.is_empty()
            || !slots.to_queue.is_empty()
            || !slots.owed.is_empty()
            || slots.acquiring > 0
        {
            return;
        }
        for class in Priority::ALL {
            for tenant in scheduler.waiting_tenants(class) {
                slots.to_queue.push_back((class, tenant.clone()));
            }
        }
    }
}

impl TierSlots {
    pub(super) fn new(tier: Tier, limit: TierLimit) -> Self {
        TierSlots {
            tier,
            limit,
            blocked: false,
            acquiring: 0,
            at_once: 1,
            held_tenants: HashSet::default(),
            acquiring_for: HashMap::default(),
            owed: VecDeque::new(),
            queued: HashSet::default(),
            to_queue: VecDeque::new(),
        }
    }
}
