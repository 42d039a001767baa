//! The fair queue's slots: taking a tier's slot for the next request (at once in process,
//! an acquire sent on Redis), the answers to those acquires, and the fleet's order on a
//! shared store — the wake-ups owed to a flow, turned into acquires in the fleet's turn.

use std::sync::Arc;

use tokio::time::Instant;

use super::{
    Acquire, AfterUnlock, Declined, FairQueue, FlowStep, Group, Handed, Handout, Queues, RateGo,
    Sent, TierSlots,
};
use crate::gate::SlotGate;
use crate::store::{
    FleetCells, SlotLease, SlotLimits, SlotQueue, SlotRefusal, SlotWakes, flow_name,
};
use crate::{Priority, TenantId};

impl FairQueue {
    /// Whether freed slots go in the fleet's order: a shared store whose releases wake the
    /// worker of the flow whose turn it is (Redis, while it answers).
    pub(super) fn fleet(&self) -> bool {
        self.slots.as_ref().is_some_and(SlotGate::in_fleet_order)
    }

    /// The fleet's order first: an acquire for each wake-up owed to a tenant's call (the
    /// fleet picked it), then, while its tier is full, one for each flow of this worker not
    /// yet queued in Redis (refused, the acquire queues it). `false` when the slot policy
    /// is gone.
    pub(super) fn dispatch_flows(&self, state: &mut Queues, after: &mut AfterUnlock) -> bool {
        // Outside the fleet's order (memory, Redis away) a full tier waits for any release.
        let fleet = self.fleet();
        for group in 0..state.groups.len() {
            if fleet {
                state.groups[group].requeue_if_lost();
            }
            while state.in_flight < self.max_in_flight {
                match self.dispatch_flow(state, group, fleet, after) {
                    FlowStep::Next => {}
                    FlowStep::GroupDone => break,
                    FlowStep::PolicyGone => return false,
                }
            }
        }
        true
    }

    /// One acquire of `dispatch_flows` in `group`: for the next wake-up owed, else (in the
    /// fleet's order) the next flow to queue while the tier is full.
    pub(super) fn dispatch_flow(
        &self,
        state: &mut Queues,
        group: usize,
        fleet: bool,
        after: &mut AfterUnlock,
    ) -> FlowStep {
        let Some(slots) = state.groups[group].slots.as_mut() else {
            return FlowStep::GroupDone;
        };
        let ((class, tenant), owed) = match slots.owed.pop_front() {
            Some(flow) => (flow, true),
            None if fleet && slots.blocked => match slots.to_queue.pop_front() {
                Some(flow) => (flow, false),
                None => return FlowStep::GroupDone,
            },
            None => return FlowStep::GroupDone,
        };
        let g = &mut state.groups[group];
        let Some(slots) = &mut g.slots else {
            return FlowStep::GroupDone;
        };
        if !owed {
            if slots.acquiring_for.contains_key(&tenant) {
                // Its acquire's answer says whether it is queued: looked at again then.
                slots.to_queue.push_front((class, tenant));
                return FlowStep::GroupDone;
            }
            if slots.queued.contains(&(class, tenant.clone()))
                || g.scheduler.tenant_len(class, &tenant) == 0
            {
                return FlowStep::Next;
            }
        }
        let g = &state.groups[group];
        let Some(slots) = &g.slots else {
            return FlowStep::GroupDone;
        };
        // A wake names the class its flow queued in; the tenant's next call may be of
        // another by now.
        let Some(call) = std::iter::once(class)
            .chain(Priority::ALL)
            .find(|&c| g.scheduler.tenant_len(c, &tenant) > 0)
        else {
            after.declined.push(Declined {
                tier: slots.tier.clone(),
                flow: flow_name(class, Some(&tenant)),
                n: 1,
                leave: true,
            });
            return FlowStep::Next;
        };
        let Ok(rate) = self.rate_for(state, group, call, &tenant, after) else {
            if owed && self.rate_answering(&state.groups[group], call, &tenant) {
                // The gate's word comes within a round trip (its notice runs this again):
                // passed on now, the slot and the cell would go to whoever is next, here or
                // on another worker, ahead of this flow's turn.
                if let Some(slots) = state.groups[group].slots.as_mut() {
                    slots.owed.push_front((class, tenant));
                }
                return FlowStep::GroupDone;
            }
            return Self::flow_without_rate(state, group, (class, tenant), owed, after);
        };
        if self.take_slot(state, group, call, Some(tenant), rate, after) {
            FlowStep::Next
        } else {
            FlowStep::PolicyGone
        }
    }

    /// Whether the rate gate's word on `tenant`'s next call in `class` is on its way (a
    /// reservation sent to the store).
    pub(super) fn rate_answering(&self, g: &Group, class: Priority, tenant: &TenantId) -> bool {
        let (Some(rate), Some(head)) = (&self.rate, g.scheduler.peek_tenant(class, tenant)) else {
            return false;
        };
        rate.inner
            .answering(head.key.as_ref().unwrap_or(&rate.default_key))
    }

    /// A flow's rate cells are not there yet: the provider's rate binds, not the slots. The
    /// slot goes on to the next in the fleet's order now, and the flow queues again once its
    /// cells are there.
    pub(super) fn flow_without_rate(
        state: &mut Queues,
        group: usize,
        (class, tenant): (Priority, TenantId),
        owed: bool,
        after: &mut AfterUnlock,
    ) -> FlowStep {
        let Some(slots) = state.groups[group].slots.as_mut() else {
            return FlowStep::GroupDone;
        };
        if !owed {
            slots.to_queue.push_front((class, tenant));
            return FlowStep::GroupDone;
        }
        // An acquire of the flow on its way says itself whether the flow stays queued:
        // leaving now could undo what it does.
        let leave = !slots.acquiring_for.contains_key(&tenant);
        after.declined.push(Declined {
            tier: slots.tier.clone(),
            flow: flow_name(class, Some(&tenant)),
            n: 1,
            leave,
        });
        if leave {
            slots.queued.remove(&(class, tenant.clone()));
            slots.to_queue.push_back((class, tenant));
        }
        FlowStep::Next
    }

    /// How the acquire for `group`'s next call in `class` (`target`'s, if named) queues if
    /// refused: in the fleet's order, the flow of `target` with its calls waiting here;
    /// else the worker, with every call of the group (those with an acquire under way too:
    /// refused, they wait again). Kept queued after taking the last room if others are
    /// left.
    pub(super) fn slot_queue(
        &self,
        g: &Group,
        slots: &TierSlots,
        class: Priority,
        target: Option<&TenantId>,
        cells: Option<FleetCells>,
    ) -> SlotQueue {
        let flow = target.filter(|_| self.fleet());
        // The cells go with a flow the fleet orders (the rate check just now left them to it).
        let cells = cells.filter(|_| flow.is_some());
        let waiting = match flow {
            Some(tenant) => g.scheduler.tenant_len(class, tenant),
            None => g.scheduler.len(),
        };
        let head = flow.and_then(|tenant| g.scheduler.peek_tenant(class, tenant));
        let cost = head.map_or(1, |head| {
            u64::from(head.cost).clamp(1, self.config.max_charge())
        });
        SlotQueue {
            weight: self.weights.of(Some(&slots.tier)),
            class,
            class_weight: self.config.class_weights.get(class),
            tenant: flow.cloned(),
            group: head.and_then(|head| head.group.clone()),
            cost,
            waiting: u32::try_from(waiting).unwrap_or(u32::MAX),
            cells,
        }
    }

    /// Takes the slot of `group`'s next call in `class` — `target`'s call when named (a
    /// tier that caps tenants counts it for that tenant) — with the rate cells already taken
    /// for it: handed over at once when the store answers at once (memory), else the
    /// acquire is sent (Redis) and the answer handed over when it comes (`answered`). `false`
    /// when no slot policy is left to take it under.
    pub(super) fn take_slot(
        &self,
        state: &mut Queues,
        group: usize,
        class: Priority,
        target: Option<TenantId>,
        rate: Option<(TenantId, RateGo)>,
        after: &mut AfterUnlock,
    ) -> bool {
        let cells = rate.as_ref().and_then(|(_, go)| go.cells);
        let rate = rate.map(|(tenant, go)| (tenant, go.taken));
        let Some(gate) = self.slots.as_ref() else {
            return false;
        };
        let g = &state.groups[group];
        let Some(slots) = &g.slots else {
            return false;
        };
        let tenant = target.clone().filter(|_| slots.limit.tenant_cap.is_some());
        let queue = self.slot_queue(g, slots, class, target.as_ref(), cells);
        let more = queue.waiting > 1;
        let reserved = queue.cost;
        let limits = SlotLimits::of(gate.policy(), slots.limit);
        let acquire = gate.acquire(&slots.tier, tenant.as_ref(), limits, Some(queue));
        match acquire.into_ready() {
            Ok(Ok(lease)) => {
                let handout = Handout {
                    lease: Some(lease),
                    rate,
                    target,
                };
                state.hand_next(group, class, handout, Instant::now(), after);
            }
            Ok(Err(refusal)) => match (refusal, tenant) {
                (SlotRefusal::TenantCap, Some(tenant)) => {
                    state.hold_tenant(group, tenant, after);
                }
                (SlotRefusal::Store, _) => self.refuse(state, group, after),
                (SlotRefusal::Rate, _) => self.block_for_rate(state, group, after),
                _ => self.block(state, group, after),
            },
            Err(pending) => {
                // The window place is reserved for the request the answer will be handed to.
                state.in_flight += 1;
                let g = &mut state.groups[group];
                if let Some(slots) = g.slots.as_mut() {
                    slots.acquiring += 1;
                    // Counted, and placed in the order as if served meanwhile, so the
                    // acquires sent together go to tenants in fair order.
                    if let Some(tenant) = &target {
                        *slots.acquiring_for.entry(tenant.clone()).or_default() += 1;
                        g.scheduler.reserve(class, tenant, reserved, true);
                    }
                }
                let ci = class as usize;
                let ahead = g.last_step[ci];
                g.vtime[ci] += ahead;
                after.acquires.push(Acquire {
                    sent: Sent {
                        group,
                        class,
                        ahead,
                        tenant,
                        target,
                        reserved,
                        more,
                        rate,
                    },
                    slot: pending,
                });
            }
        }
        true
    }

    /// An acquire sent by `dispatch` is answered: for a tenant (a tier that caps tenants)
    /// a refusal for the tenant's cap holds back that tenant only; anything else is
    /// `answered_slot`'s. In the fleet's order, the flow is queued in Redis once it is
    /// refused, or granted with more of its calls left here.
    pub(super) fn answered(
        self: &Arc<Self>,
        mut sent: Sent,
        answer: Result<SlotLease, SlotRefusal>,
    ) {
        let fleet = self.fleet();
        let mut state = self.lock();
        let g = &mut state.groups[sent.group];
        if let Some(target) = &sent.target
            && let Some(slots) = g.slots.as_mut()
        {
            Self::answered_tenant(slots, target);
            // Its reservation goes: the call is served now (charged then) or waits again.
            g.scheduler
                .reserve(sent.class, target, sent.reserved, false);
            let flow = (sent.class, target.clone());
            match &answer {
                Err(SlotRefusal::Full | SlotRefusal::Rate) if fleet => {
                    slots.queued.insert(flow);
                }
                Ok(_) if fleet && sent.more => {
                    slots.queued.insert(flow);
                }
                Ok(_) => {
                    slots.queued.remove(&flow);
                }
                Err(_) => {}
            }
        }
        drop(state);
        match (answer, sent.tenant.take()) {
            (Err(SlotRefusal::TenantCap), Some(tenant)) => {
                let Sent {
                    group,
                    class,
                    ahead,
                    rate,
                    ..
                } = sent;
                self.then_dispatch(|state, after| {
                    Self::answered_group(state, group, class, ahead);
                    // Not dispatched: the rate cells go back to the gate.
                    after.drop_handed.push(Handed {
                        lease: None,
                        receipt: rate.and_then(|(_, receipt)| receipt),
                    });
                    state.hold_tenant(group, tenant, after);
                });
            }
            (answer, _) => self.answered_slot(sent, answer),
        }
    }

    /// Changes the state under the lock, dispatches in fair order, and does the rest
    /// (wakers, metrics, acquires to send, leases to drop) once the lock is released.
    pub(super) fn then_dispatch(
        self: &Arc<Self>,
        change: impl FnOnce(&mut Queues, &mut AfterUnlock),
    ) {
        let mut after = AfterUnlock::default();
        let depth = {
            let mut state = self.lock();
            change(&mut state, &mut after);
            self.dispatch(&mut state, &mut after);
            after.depth.map(|p| (p, state.class_len(p)))
        };
        after.run(self, depth);
    }

    /// An acquire `dispatch` sent for `group` in `class` is answered: its window place and
    /// the step of virtual time charged ahead for it are given back (a dispatch charges its
    /// own). Returns the group's tier slots, to account for the answer.
    pub(super) fn answered_group(
        state: &mut Queues,
        group: usize,
        class: Priority,
        ahead: f64,
    ) -> Option<&mut TierSlots> {
        state.in_flight = state.in_flight.saturating_sub(1);
        let g = &mut state.groups[group];
        g.vtime[class as usize] -= ahead;
        let slots = g.slots.as_mut()?;
        slots.acquiring = slots.acquiring.saturating_sub(1);
        Some(slots)
    }

    /// An acquire for `tenant` is answered: one fewer under way for it.
    pub(super) fn answered_tenant(slots: &mut TierSlots, tenant: &TenantId) {
        if let Some(n) = slots.acquiring_for.get_mut(tenant) {
            *n -= 1;
            if *n == 0 {
                slots.acquiring_for.remove(tenant);
            }
        }
    }

    /// An acquire sent by `dispatch` for `group` is answered with a slot or a refusal for
    /// the tier: the slot goes to the group's next request. A slot that took the last
    /// room, for an acquire that stayed queued (`more`), blocks the group as a refusal
    /// would: the next slot comes with a wake-up, not from another try. A slot taken with
    /// room left (a lease that expired, say, freed it without a wake-up) lets the group try
    /// again for the rest.
    pub(super) fn answered_slot(
        self: &Arc<Self>,
        sent: Sent,
        lease: Result<SlotLease, SlotRefusal>,
    ) {
        let Sent {
            group,
            class,
            ahead,
            more,
            rate,
            target,
            ..
        } = sent;
        self.then_dispatch(|state, after| {
            if let Some(slots) = Self::answered_group(state, group, class, ahead) {
                // Doubling, but never past the room the caps had left (with the acquires
                // still under way): on Redis the answer says how much.
                slots.at_once = match &lease {
                    Ok(lease) => {
                        let room = usize::try_from(lease.room()).unwrap_or(usize::MAX);
                        let cap = room.saturating_add(slots.acquiring).max(1);
                        slots.at_once.saturating_mul(2).min(cap)
                    }
                    Err(_) => 1,
                };
            }
            match lease {
                Ok(lease) => {
                    let room = lease.room();
                    let handout = Handout {
                        lease: Some(lease),
                        rate,
                        target,
                    };
                    state.hand_next(group, class, handout, Instant::now(), after);
                    if more && room == 0 {
                        self.block(state, group, after);
                    } else if room > 0
                        && let Some(slots) = state.groups[group].slots.as_mut()
                    {
                        slots.blocked = false;
                    }
                }
                Err(refusal) => {
                    after.drop_handed.push(Handed {
                        lease: None,
                        receipt: rate.and_then(|(_, receipt)| receipt),
                    });
                    match refusal {
                        SlotRefusal::Store => self.refuse(state, group, after),
                        SlotRefusal::Rate => self.block_for_rate(state, group, after),
                        _ => self.block(state, group, after),
                    }
                }
            }
        });
    }

    /// Slots may have come free: for the tiers a release woke this worker for (one acquire
    /// per wake-up), or for anyone (every blocked group tries again). Then dispatch, in
    /// fair order.
    pub(super) fn slot_freed(self: &Arc<Self>, woken: SlotWakes) {
        self.then_dispatch(|state, after| match woken {
            SlotWakes::Everyone => state.unblock_all(true),
            SlotWakes::Flows(wakes) => state.woken(wakes, &mut after.declined),
        });
    }

    /// The watcher's safety net (a lost wake-up, an expired lease): every blocked tier
    /// tries again; the flows this worker queued stay queued.
    pub(super) fn slot_poll(self: &Arc<Self>) {
        self.then_dispatch(|state, _| state.unblock_all(false));
    }
}
