//! The pieces of start-time fair queuing: virtual time, one level of the order (its
//! members waiting by start tag, and those that wait no more but finished ahead of it), and
//! the slab of named members a level orders (a class's groups, or its tenants).

use std::collections::BTreeSet;
use std::hash::BuildHasher;

use hashbrown::HashTable;

use super::RETAINED_CAPACITY;
use super::slab::MAX_SLOTS;
use crate::TenantId;
use crate::hash::Seeded;

/// Virtual time: service per unit of weight, in tokens × 2^32 (so a weight up to `u32::MAX`
/// still moves it by a call of 1 token, and a century of calls does not overflow it).
pub(super) type VTime = u128;

/// What serving a call of `cost` tokens moves a member of `weight` on by.
pub(super) fn step(cost: i64, weight: u32) -> VTime {
    (VTime::from(cost.max(1).unsigned_abs()) << 32) / VTime::from(weight.max(1))
}

/// A waiting member's place: (start tag, tie, slot). The tie is the order the members
/// started waiting in ([`Ties`]): a member that starts waiting at the virtual time goes
/// after those already there and before everyone ahead of it, and no later arrival at the
/// same tag goes before it.
pub(super) type Place = (VTime, u64, u32);

/// Hands out the ties of [`Place`]s: first come, first served.
#[derive(Debug, Default)]
pub(super) struct Ties {
    arrivals: u64,
    /// Ties by name instead (a rank in name order), as the fleet's sorted sets break
    /// them: for the test that holds this order to the fleet's.
    #[cfg(test)]
    pub(super) by_name: Option<fn(&TenantId) -> u64>,
}

impl Ties {
    /// The tie of `name`'s place, starting to wait now.
    pub(super) fn next(&mut self, name: &TenantId) -> u64 {
        #[cfg(test)]
        if let Some(rank) = self.by_name {
            return rank(name);
        }
        let _ = name;
        self.arrivals += 1;
        self.arrivals
    }
}

/// One level of start-time fair queuing (Goyal, Vin & Cheng 1996): the member with the least
/// start tag goes next, and is charged its call's cost over its weight.
#[derive(Debug, Default)]
pub(super) struct Order {
    /// The start tag of the last call served in order: nobody waits before it, and a member
    /// that starts waiting starts here, or at its own finish if later.
    pub(super) vtime: VTime,
    pub(super) waiting: BTreeSet<Place>,
    /// (finish, slot) of the members with nothing waiting or in flight that finished ahead
    /// of `vtime`: remembered until `vtime` reaches them, so coming back does not rewind
    /// them (a member that keeps coming and going cannot push in front of those waiting).
    pub(super) idle: BTreeSet<(VTime, u32)>,
    /// The latest tag handed out (a finish, or a correction): see [`Order::restart`].
    horizon: VTime,
}

impl Order {
    /// `slot`, which finished at `finish`, starts waiting with `tie`: its start tag.
    pub(super) fn enter(&mut self, slot: u32, finish: VTime, tie: u64) -> VTime {
        let start = finish.max(self.vtime);
        self.waiting.insert((start, tie, slot));
        start
    }

    /// A call of the member at `place` is served: it leaves the waiting set, and the
    /// virtual time moves to the head's start (the member's own, in order; a member served
    /// out of order does not move it past others still waiting).
    pub(super) fn serve(&mut self, place: &Place) {
        if let Some((head, _, _)) = self.waiting.first() {
            self.vtime = self.vtime.max(*head.min(&place.0));
        }
        self.waiting.remove(place);
    }

    /// A member's tag became `tag` (it was served, or corrected).
    pub(super) fn handed(&mut self, tag: VTime) {
        self.horizon = self.horizon.max(tag);
    }

    /// Nobody waits here any more: the members still known (calls in flight) start again
    /// level with a newcomer when they come back, their finishes forgotten (as the fleet's
    /// order forgets a group's flows when the group leaves, and a tier's when a release
    /// finds nobody waiting in it). Nobody waits to be overtaken, so this is fair.
    pub(super) fn restart(&mut self) {
        self.vtime = self.vtime.max(self.horizon);
    }

    /// The next idle member the virtual time has reached: to be forgotten.
    pub(super) fn expired(&mut self) -> Option<u32> {
        let &(finish, slot) = self.idle.first()?;
        (finish <= self.vtime).then(|| {
            self.idle.pop_first();
            slot
        })
    }

    /// A correction of `refund` (negative) or charge (positive) virtual time to a member at
    /// `tag`: never before the virtual time (no credit to bank), never more than one
    /// largest call (`ceiling`) ahead of it (the debt one call can leave).
    pub(super) fn corrected(&self, tag: VTime, delta: i128, ceiling: VTime) -> VTime {
        let moved = delta.unsigned_abs();
        if delta < 0 {
            tag.saturating_sub(moved).max(self.vtime.min(tag))
        } else {
            tag.saturating_add(moved)
                .min(self.vtime.saturating_add(ceiling).max(tag))
        }
    }
}

/// What a slab of [`Members`] needs of its members.
pub(super) trait Named {
    fn name(&self) -> &TenantId;
}

/// Named members in `u32` slots, found again by name: a bucket of the index holds only the
/// slot, so the index of 100,000 tenants stays within a core's L2 cache; names are compared
/// through the slab. Each operation hashes a name once (seeded: tenant names come from
/// callers).
#[derive(Debug)]
pub(super) struct Members<M> {
    pub(super) slots: Vec<Option<M>>,
    free: Vec<u32>,
    index: HashTable<u32>,
    hasher: Seeded,
    /// [`MAX_SLOTS`], lowered by tests.
    pub(super) limit: usize,
}

impl<M: Named> Members<M> {
    pub(super) fn new() -> Self {
        Members {
            slots: Vec::new(),
            free: Vec::new(),
            index: HashTable::new(),
            hasher: Seeded::default(),
            limit: MAX_SLOTS,
        }
    }

    pub(super) fn get(&self, slot: u32) -> Option<&M> {
        self.slots.get(slot as usize)?.as_ref()
    }

    pub(super) fn get_mut(&mut self, slot: u32) -> Option<&mut M> {
        self.slots.get_mut(slot as usize)?.as_mut()
    }

    pub(super) fn find(&self, name: &TenantId) -> Option<u32> {
        let hash = self.hasher.hash_one(name);
        let slots = &self.slots;
        self.index
            .find(hash, |&s| {
                Self::name_at(slots, s).is_some_and(|x| x.same(name))
            })
            .copied()
    }

    /// Whether [`Members::insert`] will find a slot.
    pub(super) fn has_room(&self) -> bool {
        !self.free.is_empty() || self.slots.len() < self.limit
    }

    /// Stores `member`, or `None` when the slab is full.
    pub(super) fn insert(&mut self, member: M) -> Option<u32> {
        let hash = self.hasher.hash_one(member.name());
        let slot = match self.free.pop() {
            Some(s) if (s as usize) < self.slots.len() => {
                self.slots[s as usize] = Some(member);
                s
            }
            _ => {
                let s = u32::try_from(self.slots.len())
                    .ok()
                    .filter(|_| self.slots.len() < self.limit)?;
                self.slots.push(Some(member));
                s
            }
        };
        let (slots, hasher) = (&self.slots, &self.hasher);
        self.index.insert_unique(hash, slot, |&s| {
            Self::name_at(slots, s).map_or(0, |name| hasher.hash_one(name))
        });
        Some(slot)
    }

    /// Forgets the member in `slot`.
    pub(super) fn remove(&mut self, slot: u32) -> Option<M> {
        let member = self.slots.get_mut(slot as usize)?.take()?;
        let hash = self.hasher.hash_one(member.name());
        if let Ok(entry) = self.index.find_entry(hash, |&s| s == slot) {
            entry.remove();
        }
        self.free.push(slot);
        Some(member)
    }

    pub(super) fn len(&self) -> usize {
        self.index.len()
    }

    /// Every member, with its slot.
    pub(super) fn iter(&self) -> impl Iterator<Item = (u32, &M)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(s, m)| Some((u32::try_from(s).ok()?, m.as_ref()?)))
    }

    /// Whether the slab is large and at least half free: worth moving into a small one.
    pub(super) fn sparse(&self, above: usize) -> bool {
        self.slots.len() > above && self.free.len() >= self.slots.len() / 2
    }

    /// Takes every member out, in slot order with their old slots, leaving a small slab.
    pub(super) fn drain(&mut self) -> Vec<(u32, M)> {
        let members = self
            .slots
            .drain(..)
            .enumerate()
            .filter_map(|(s, m)| Some((u32::try_from(s).ok()?, m?)))
            .collect();
        self.clear();
        members
    }

    /// Frees every slot and the index.
    pub(super) fn clear(&mut self) {
        self.index.clear();
        // Empty: the rehash function is never called.
        self.index.shrink_to(RETAINED_CAPACITY, |_| 0);
        self.slots.clear();
        self.free.clear();
        self.slots.shrink_to(RETAINED_CAPACITY);
        self.free.shrink_to(RETAINED_CAPACITY);
    }

    fn name_at(slots: &[Option<M>], s: u32) -> Option<&TenantId> {
        slots.get(s as usize)?.as_ref().map(Named::name)
    }
}
