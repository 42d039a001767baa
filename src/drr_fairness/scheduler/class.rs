//! Start-time fair queuing inside one priority class, at two levels: the class's groups
//! (a key: a service with its end users, or a team; a tenant that names no group is a group
//! of its own), then the tenants of each group, one call per turn at both.

use super::RETAINED_CAPACITY;
use super::order::{Members, Named, Order, Place, Ties, VTime, step};
use super::slab::{Entries, Entry, NONE};
use crate::TenantId;

/// A tenant of the class: its FIFO of waiting items and its place in its group's order.
#[derive(Debug)]
pub(super) struct Tenant {
    pub(super) id: TenantId,
    /// Waiting: its start tag in its group's order (`tie` its tie there). Otherwise the
    /// finish of its last call: where it starts when it comes back, unless the group's
    /// virtual time is later.
    pub(super) tag: VTime,
    pub(super) tie: u64,
    /// The slot of its group.
    pub(super) group: u32,
    pub(super) weight: u32,
    /// FIFO of this tenant's entries in this class.
    pub(super) head: u32,
    pub(super) tail: u32,
    pub(super) len: u32,
    /// Dispatched items not yet [completed](super::Scheduler::complete).
    pub(super) in_flight: u32,
}

impl Tenant {
    fn place(&self, slot: u32) -> Place {
        (self.tag, self.tie, slot)
    }
}

impl Named for Tenant {
    fn name(&self) -> &TenantId {
        &self.id
    }
}

/// A group of the class: its place in the class's order, and the order of its tenants.
#[derive(Debug)]
pub(super) struct Group {
    pub(super) id: TenantId,
    /// As a tenant's: its start tag while some tenant of it waits, else its last finish.
    pub(super) tag: VTime,
    pub(super) tie: u64,
    pub(super) tenants: Order,
    /// Its tenants the class knows (waiting, in flight, or remembered idle).
    pub(super) known: u32,
    /// Its dispatched items not yet completed.
    pub(super) in_flight: u32,
}

impl Group {
    fn place(&self, slot: u32) -> Place {
        (self.tag, self.tie, slot)
    }

    pub(super) fn waits(&self) -> bool {
        self.tenants.waits()
    }
}

impl Named for Group {
    fn name(&self) -> &TenantId {
        &self.id
    }
}

/// Whether the tenant in `place`'s slot waits at that very place (else the entry is stale).
fn tenant_waits_at(tenants: &Members<Tenant>, place: &Place) -> bool {
    tenants
        .get(place.2)
        .is_some_and(|t| t.len > 0 && t.tag == place.0 && t.tie == place.1)
}

/// Whether the group in `place`'s slot waits at that very place.
fn group_waits_at(groups: &Members<Group>, place: &Place) -> bool {
    groups
        .get(place.2)
        .is_some_and(|g| g.waits() && g.tag == place.0 && g.tie == place.1)
}

#[cfg(test)]
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Visit {
    Dispatch(TenantId),
    Forget(TenantId),
}

#[derive(Debug)]
pub(super) struct Class {
    pub(super) groups: Members<Group>,
    pub(super) tenants: Members<Tenant>,
    /// The groups' order.
    pub(super) order: Order,
    /// The ties of the places handed out, at both levels.
    pub(super) ties: Ties,
    /// Waiting items.
    pub(super) len: usize,
    /// Tenants with at least one waiting item.
    pub(super) busy: usize,
    /// Slab length above which a drain compacts the slabs ([`RETAINED_CAPACITY`], lowered
    /// by tests).
    pub(super) compact_above: usize,
    #[cfg(test)]
    pub(super) trace: Vec<Visit>,
}

impl Class {
    pub(super) fn new() -> Self {
        Class {
            groups: Members::new(),
            tenants: Members::new(),
            order: Order::default(),
            ties: Ties::default(),
            len: 0,
            busy: 0,
            compact_above: RETAINED_CAPACITY,
            #[cfg(test)]
            trace: Vec::new(),
        }
    }

    pub(super) fn lookup(&self, id: &TenantId) -> Option<u32> {
        self.tenants.find(id)
    }

    pub(super) fn tenant(&self, t: u32) -> Option<&Tenant> {
        self.tenants.get(t)
    }

    /// The slot of `tenant` (`known`, when the caller looked it up), made in `group`
    /// (`None`: a group of its own; made too if new) if the class does not know it. `None`
    /// if a slab is full: then nothing is made.
    pub(super) fn find_or_make(
        &mut self,
        known: Option<u32>,
        tenant: TenantId,
        group: Option<&TenantId>,
        weight: u32,
    ) -> Option<u32> {
        if known.is_some() {
            return known;
        }
        let room = self.tenants.has_room()
            && (self.groups.has_room() || self.groups.find(group.unwrap_or(&tenant)).is_some());
        room.then(|| self.make(tenant, group, weight)).flatten()
    }

    /// The slot of a tenant the class does not know, made in `group` (`None`: a group of
    /// its own; made too if new). `None` if a slab is full.
    fn make(&mut self, tenant: TenantId, group: Option<&TenantId>, weight: u32) -> Option<u32> {
        let name = group.unwrap_or(&tenant);
        let g = match self.groups.find(name) {
            Some(g) => g,
            None => self.groups.insert(Group {
                id: name.clone(),
                tag: self.order.vtime,
                tie: 0,
                tenants: Order::default(),
                known: 0,
                in_flight: 0,
            })?,
        };
        let start = self.groups.get(g)?.tenants.vtime;
        let t = self.tenants.insert(Tenant {
            id: tenant,
            tag: start,
            tie: 0,
            group: g,
            weight,
            head: NONE,
            tail: NONE,
            len: 0,
            in_flight: 0,
        });
        match (t, self.groups.get_mut(g)) {
            (Some(t), Some(group)) => {
                group.known += 1;
                Some(t)
            }
            _ => {
                // The tenant slab is full: a group made for it goes again.
                self.rest_group(g);
                None
            }
        }
    }

    /// Tenant `t` was made for a call that did not go in after all: forgotten again.
    pub(super) fn unused(&mut self, t: u32) {
        let g = self.tenants.get(t).map(|tenant| tenant.group);
        self.rest_tenant(t);
        if let Some(g) = g {
            self.rest_group(g);
        }
    }

    /// Takes tenant `t` and its group out of the idle records: work of it starts.
    fn wake(&mut self, t: u32) {
        let Some(tenant) = self.tenants.get(t) else {
            return;
        };
        let (g, tag, idle) = (
            tenant.group,
            tenant.tag,
            tenant.len == 0 && tenant.in_flight == 0,
        );
        let Some(group) = self.groups.get_mut(g) else {
            return;
        };
        if idle {
            group.tenants.idle.remove(&(tag, t));
        }
        if !group.waits() && group.in_flight == 0 {
            self.order.idle.remove(&(group.tag, g));
        }
    }

    /// Tenant `t` got its first waiting item: it takes its place in its group's order at
    /// its finish or the group's virtual time, whichever is later, and its group likewise
    /// in the class's (no credit for the time it had nothing waiting, no extra round).
    fn starts_waiting(&mut self, t: u32) {
        let Some(tenant) = self.tenants.get(t) else {
            return;
        };
        let (g, tag) = (tenant.group, tenant.tag);
        let tie = self.ties.next(&tenant.id);
        let Some(group) = self.groups.get_mut(g) else {
            return;
        };
        if !group.waits() {
            group.tie = self.ties.next(&group.id);
            group.tag = self.order.enter(g, group.tag, group.tie);
        }
        let start = group.tenants.enter(t, tag, tie);
        self.busy += 1;
        if let Some(tenant) = self.tenants.get_mut(t) {
            (tenant.tag, tenant.tie) = (start, tie);
        }
    }

    /// Appends `entry` (already stored at `index`) to tenant `t`'s FIFO.
    pub(super) fn append<T>(&mut self, entries: &mut Entries<T>, t: u32, index: u32, weight: u32) {
        self.wake(t);
        let Some(tenant) = self.tenants.get_mut(t) else {
            return;
        };
        let (prev, was_empty) = (tenant.tail, tenant.len == 0);
        tenant.weight = weight;
        tenant.tail = index;
        tenant.len += 1;
        if was_empty {
            tenant.head = index;
        } else if let Some(last) = entries.get_mut(prev) {
            last.next = index;
        }
        if let Some(entry) = entries.get_mut(index) {
            entry.prev = prev;
        }
        self.len += 1;
        if was_empty {
            self.starts_waiting(t);
        }
    }

    /// Unlinks `entry`, already taken out of the slab from `index`, from its tenant's
    /// FIFO. Taking the head does not touch its successor (whose `prev` goes stale; a
    /// head's `prev` is never read). Returns whether the tenant has nothing left waiting.
    fn unlink<T>(&mut self, entries: &mut Entries<T>, index: u32, entry: &Entry<T>) -> bool {
        self.len = self.len.saturating_sub(1);
        let Some(tenant) = self.tenants.get_mut(entry.tenant) else {
            return false;
        };
        let was_head = tenant.head == index;
        if was_head {
            tenant.head = entry.next;
        } else if let Some(prev) = entries.get_mut(entry.prev) {
            prev.next = entry.next;
        }
        if entry.next == NONE {
            tenant.tail = if was_head { NONE } else { entry.prev };
        } else if !was_head && let Some(next) = entries.get_mut(entry.next) {
            next.prev = entry.prev;
        }
        tenant.len = tenant.len.saturating_sub(1);
        tenant.len == 0
    }

    /// Takes out a waiting entry whose waiter went away. A tenant it empties leaves the
    /// order keeping its start tag as its finish: it was not served, and comes back there.
    pub(super) fn remove<T>(&mut self, entries: &mut Entries<T>, index: u32, entry: &Entry<T>) {
        if !self.unlink(entries, index, entry) {
            return;
        }
        let t = entry.tenant;
        let Some(tenant) = self.tenants.get(t) else {
            return;
        };
        let g = tenant.group;
        self.busy = self.busy.saturating_sub(1);
        let Some(group) = self.groups.get_mut(g) else {
            return;
        };
        group.tenants.leave();
        if !group.waits() {
            self.order.leave();
        }
        self.rest_tenant(t);
        self.rest_group(g);
        self.after_leaving();
    }

    /// The tenant whose turn it is, passing over (by group, then inside it) those `skip`
    /// says, who keep their places; `None` if it skipped every waiting tenant.
    pub(super) fn turn(&self, mut skip: impl FnMut(&TenantId, usize) -> bool) -> Option<&TenantId> {
        let (groups, tenants) = (&self.groups, &self.tenants);
        for (_, _, g) in self.order.in_order(|p| group_waits_at(groups, p)) {
            let Some(group) = self.groups.get(g) else {
                continue;
            };
            for (_, _, t) in group.tenants.in_order(|p| tenant_waits_at(tenants, p)) {
                let Some(tenant) = self.tenants.get(t) else {
                    continue;
                };
                if !skip(&tenant.id, tenant.len as usize) {
                    return Some(&tenant.id);
                }
            }
        }
        None
    }

    /// The next item in fair order, or `None` if nothing waits.
    pub(super) fn pop<T>(&mut self, entries: &mut Entries<T>) -> Option<(T, TenantId, i64)> {
        let groups = &self.groups;
        let (_, _, g) = self.order.head(|p| group_waits_at(groups, p))?;
        let tenants = &self.tenants;
        let group = self.groups.get_mut(g)?;
        let (_, _, t) = group.tenants.head(|p| tenant_waits_at(tenants, p))?;
        self.serve(entries, t)
    }

    /// Serves the head item of tenant `t`, in its turn or out of it: the tenant and its
    /// group each move on by the item's cost over the tenant's weight, the virtual times
    /// to the start of the head of their order.
    pub(super) fn serve<T>(
        &mut self,
        entries: &mut Entries<T>,
        t: u32,
    ) -> Option<(T, TenantId, i64)> {
        let tenant = self.tenants.get(t)?;
        let (g, head, place, weight) = (tenant.group, tenant.head, tenant.place(t), tenant.weight);
        let tie = self.ties.next(&tenant.id);
        let cost = entries.get(head)?.cost;
        // The heads of both orders, before anything moves: the virtual times go there.
        let groups = &self.groups;
        let class_head = self.order.head(|p| group_waits_at(groups, p))?;
        let tenants = &self.tenants;
        let tenant_head =
            (self.groups.get_mut(g)?.tenants).head(|p| tenant_waits_at(tenants, p))?;
        let entry = entries.take_at(head)?;
        let emptied = self.unlink(entries, head, &entry);
        let moved = step(cost, weight);
        let group = self.groups.get_mut(g)?;
        group.tenants.serve(&place, &tenant_head);
        group.in_flight += 1;
        let finish = place.0.saturating_add(moved);
        group.tenants.handed(finish);
        let tag = match emptied {
            true => finish,
            false => group.tenants.enter(t, finish, tie),
        };
        let group_place = group.place(g);
        self.order.serve(&group_place, &class_head);
        let group_finish = group_place.0.saturating_add(moved);
        self.order.handed(group_finish);
        group.tag = match group.waits() {
            true => {
                group.tie = self.ties.next(&group.id);
                self.order.enter(g, group_finish, group.tie)
            }
            false => group_finish,
        };
        let tenant = self.tenants.get_mut(t)?;
        tenant.in_flight += 1;
        (tenant.tag, tenant.tie) = (tag, tie);
        let id = tenant.id.clone();
        if emptied {
            self.busy = self.busy.saturating_sub(1);
        }
        #[cfg(test)]
        self.trace.push(Visit::Dispatch(id.clone()));
        self.compact_orders(g);
        self.forget_reached(g);
        if self.len == 0 {
            self.drained();
        }
        Some((entry.item, id, cost))
    }

    /// Charges a call of tenant `t` that went out without waiting: as served, without
    /// moving any virtual time, and never more than one largest call ahead of its order's
    /// virtual time.
    pub(super) fn charge_direct(&mut self, t: u32, cost: i64, max_charge: i64) {
        self.wake(t);
        let Some(tenant) = self.tenants.get_mut(t) else {
            return;
        };
        tenant.in_flight += 1;
        let (g, weight) = (tenant.group, tenant.weight);
        if let Some(group) = self.groups.get_mut(g) {
            group.in_flight += 1;
        }
        self.correct(t, cost, max_charge, weight);
    }

    /// A settled call of tenant `t` took `delta` tokens more (or, negative, fewer) than it
    /// was charged: the tenant and its group move by that over the tenant's weight, never
    /// before their order's virtual time nor more than one largest call ahead of it.
    pub(super) fn settle(&mut self, t: u32, delta: i64, max_charge: i64) {
        if let Some(tenant) = self.tenants.get(t)
            && delta != 0
        {
            self.correct(t, delta, max_charge, tenant.weight);
        }
    }

    fn correct(&mut self, t: u32, delta: i64, max_charge: i64, weight: u32) {
        let magnitude = i64::try_from(delta.unsigned_abs()).unwrap_or(i64::MAX);
        let Ok(moved) = i128::try_from(step(magnitude, weight)) else {
            return;
        };
        let signed = if delta < 0 { -moved } else { moved };
        let ceiling = step(max_charge, weight);
        let Some(g) = self.tenants.get(t).map(|tenant| tenant.group) else {
            return;
        };
        self.correct_tenant(t, signed, ceiling);
        self.correct_group(g, signed, ceiling);
        self.compact_orders(g);
    }

    /// Moves tenant `t`'s tag by `delta`, keeping its place in its group's order (or its
    /// record as idle) in step.
    fn correct_tenant(&mut self, t: u32, delta: i128, ceiling: VTime) {
        let Some(tenant) = self.tenants.get(t) else {
            return;
        };
        let (g, place, len, in_flight) =
            (tenant.group, tenant.place(t), tenant.len, tenant.in_flight);
        let Some(group) = self.groups.get_mut(g) else {
            return;
        };
        let order = &mut group.tenants;
        let tag = order.corrected(place.0, delta, ceiling);
        order.handed(tag);
        if len > 0 && tag != place.0 {
            order.moved((tag, place.1, t));
        } else if len == 0 && in_flight == 0 && order.idle.remove(&(place.0, t)) {
            order.idle.insert((tag, t));
        }
        if let Some(tenant) = self.tenants.get_mut(t) {
            tenant.tag = tag;
        }
    }

    /// [`Class::correct_tenant`] for group `g` in the class's order.
    fn correct_group(&mut self, g: u32, delta: i128, ceiling: VTime) {
        let Some(group) = self.groups.get_mut(g) else {
            return;
        };
        let place = group.place(g);
        let tag = self.order.corrected(place.0, delta, ceiling);
        self.order.handed(tag);
        if group.waits() {
            if tag != place.0 {
                self.order.moved((tag, place.1, g));
            }
        } else if group.in_flight == 0 && self.order.idle.remove(&(place.0, g)) {
            self.order.idle.insert((tag, g));
        }
        group.tag = tag;
    }

    /// A dispatched item of tenant `t` completed.
    pub(super) fn complete(&mut self, t: u32) {
        let Some(tenant) = self.tenants.get_mut(t) else {
            return;
        };
        tenant.in_flight = tenant.in_flight.saturating_sub(1);
        let g = tenant.group;
        if let Some(group) = self.groups.get_mut(g) {
            group.in_flight = group.in_flight.saturating_sub(1);
        }
        self.rest_tenant(t);
        if self.len == 0 {
            self.forget_idle();
        }
    }

    /// Drops the stale entries of group `g`'s order and of the class's, if they outnumber
    /// the live ones.
    fn compact_orders(&mut self, g: u32) {
        let tenants = &self.tenants;
        if let Some(group) = self.groups.get_mut(g) {
            group.tenants.compact(|p| tenant_waits_at(tenants, p));
        }
        let groups = &self.groups;
        self.order.compact(|p| group_waits_at(groups, p));
    }

    /// Tenant `t` may have nothing waiting or in flight: then it is remembered as idle if
    /// it finished ahead of its group's virtual time while others of the group wait, else
    /// forgotten; its group likewise.
    fn rest_tenant(&mut self, t: u32) {
        let Some(tenant) = self.tenants.get(t) else {
            return;
        };
        if tenant.len > 0 || tenant.in_flight > 0 {
            return;
        }
        let (g, tag) = (tenant.group, tenant.tag);
        let Some(group) = self.groups.get_mut(g) else {
            return;
        };
        if group.waits() && tag > group.tenants.vtime {
            group.tenants.idle.insert((tag, t));
            return;
        }
        self.forget_tenant(t);
        self.rest_group(g);
    }

    /// Group `g` may have no tenant waiting: then the tenants it remembered as idle are
    /// forgotten (nobody of it waits to be overtaken), and with no tenant left it is itself
    /// remembered as idle if it finished ahead of the class's virtual time while other
    /// groups wait, else forgotten.
    fn rest_group(&mut self, g: u32) {
        let Some(group) = self.groups.get_mut(g) else {
            return;
        };
        if group.waits() {
            return;
        }
        group.tenants.restart();
        group.tenants.clear_stale();
        let idle: Vec<u32> = std::mem::take(&mut group.tenants.idle)
            .into_iter()
            .map(|(_, t)| t)
            .collect();
        for t in idle {
            self.forget_tenant(t);
        }
        let Some(group) = self.groups.get(g) else {
            return;
        };
        if group.known > 0 {
            return;
        }
        if self.order.waits() && group.tag > self.order.vtime {
            self.order.idle.insert((group.tag, g));
        } else {
            self.forget_group(g);
        }
    }

    fn forget_tenant(&mut self, t: u32) {
        let Some(tenant) = self.tenants.remove(t) else {
            return;
        };
        if let Some(group) = self.groups.get_mut(tenant.group) {
            group.known = group.known.saturating_sub(1);
        }
        #[cfg(test)]
        self.trace.push(Visit::Forget(tenant.id));
    }

    /// After a call was served in group `g`: the idle tenants of `g`, and the idle groups,
    /// that the virtual times reached are forgotten.
    fn forget_reached(&mut self, g: u32) {
        while let Some(t) = self
            .groups
            .get_mut(g)
            .and_then(|group| group.tenants.expired())
        {
            self.forget_tenant(t);
        }
        self.rest_group(g);
        self.forget_expired_groups();
    }

    /// The idle groups the class's virtual time reached are forgotten.
    fn forget_expired_groups(&mut self) {
        while let Some(g) = self.order.expired() {
            self.forget_group(g);
        }
    }

    /// Forgets group `g` if no tenant of it is known.
    fn forget_group(&mut self, g: u32) {
        if self.groups.get(g).is_some_and(|group| group.known == 0) {
            self.groups.remove(g);
        }
    }

    /// A tenant left the order without being served (its last waiting item went away).
    fn after_leaving(&mut self) {
        self.forget_expired_groups();
        if self.len == 0 {
            self.drained();
        }
    }

    /// Called when the class has nothing waiting. The groups remembered idle are
    /// remembered until a call ends with nothing waiting (as the fleet's order forgets a
    /// tier's when a release finds nobody waiting in it), or at once if no call is in
    /// flight.
    pub(super) fn drained(&mut self) {
        self.busy = 0;
        if self.tenants.len() == 0 {
            self.forget_idle();
        }
    }

    /// Nothing waits: the idle groups are forgotten (nobody waits to be overtaken), and
    /// the memory goes back.
    fn forget_idle(&mut self) {
        self.order.restart();
        self.order.clear_stale();
        for (_, g) in std::mem::take(&mut self.order.idle) {
            self.forget_group(g);
        }
        if self.tenants.len() == 0 && self.groups.len() == 0 {
            self.reset();
        } else if self.tenants.sparse(self.compact_above) || self.groups.sparse(self.compact_above)
        {
            self.compact();
        }
    }

    /// Called when nothing waits and the tenants in flight are the only ones left: moves
    /// them and their groups into fresh, small slabs, so a class that once knew many
    /// tenants gives the memory back even while some calls are in flight. No entry or
    /// order refers to a slot then (the groups' orders hold nothing waiting or idle).
    fn compact(&mut self) {
        let groups = self.groups.drain();
        let tenants = self.tenants.drain();
        let mut moved = std::collections::HashMap::with_capacity(groups.len());
        for (old, mut group) in groups {
            group.tenants.clear_stale();
            if let Some(new) = self.groups.insert(group) {
                moved.insert(old, new);
            }
        }
        for (_, mut tenant) in tenants {
            tenant.group = moved.get(&tenant.group).copied().unwrap_or(NONE);
            self.tenants.insert(tenant);
        }
    }

    /// Frees every slot and both orders: nothing waits, and nothing is in flight.
    fn reset(&mut self) {
        self.groups.clear();
        self.tenants.clear();
        self.order = Order::default();
    }
}
