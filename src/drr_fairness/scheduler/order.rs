//! The pieces of start-time fair queuing: virtual time, one level of the order (its
//! members waiting by start tag, and those that wait no more but finished ahead of it), and
//! the slab of named members a level orders (a class's groups, or its tenants).

use std::cmp::Reverse;
use std::collections::{BTreeSet, BinaryHeap};
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
    let scaled = VTime::from(cost.max(1).unsigned_abs()) << 32;
    // Most tenants weigh 1: no 128-bit division for them.
    match weight {
        0 | 1 => scaled,
        w => scaled / VTime::from(w),
    }
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
///
/// The waiting members' places are a binary min-heap whose entries go stale instead of
/// being taken out: a member that stops waiting, or whose tag is corrected, leaves its old
/// entry behind, and an entry counts only while its member is waiting at that very place
/// (`valid`, which the caller answers from its members). Stale entries are dropped as they
/// reach the top, or all at once when they outnumber the live ones. So a place costs a
/// push and a pop, without allocating, and a newcomer (its tag the largest, as a rule)
/// settles at the bottom at once.
#[derive(Debug, Default)]
pub(super) struct Order {
    /// The start tag of the last call served in order: nobody waits before it, and a member
    /// that starts waiting starts here, or at its own finish if later.
    pub(super) vtime: VTime,
    heap: Vec<Place>,
    /// Members waiting.
    live: usize,
    /// (finish, slot) of the members with nothing waiting or in flight that finished ahead
    /// of `vtime`: remembered until `vtime` reaches them, so coming back does not rewind
    /// them (a member that keeps coming and going cannot push in front of those waiting).
    pub(super) idle: BTreeSet<(VTime, u32)>,
    /// The latest tag handed out (a finish, or a correction): see [`Order::restart`].
    horizon: VTime,
}

impl Order {
    /// Whether a member waits.
    pub(super) fn waits(&self) -> bool {
        self.live > 0
    }

    /// `slot`, which finished at `finish`, starts waiting with `tie`: its start tag.
    pub(super) fn enter(&mut self, slot: u32, finish: VTime, tie: u64) -> VTime {
        let start = finish.max(self.vtime);
        self.push((start, tie, slot));
        self.live += 1;
        start
    }

    /// A waiting member's tag was corrected to `place`: its old entry goes stale.
    pub(super) fn moved(&mut self, place: Place) {
        self.push(place);
    }

    /// A waiting member stops waiting without being served: its entry goes stale.
    pub(super) fn leave(&mut self) {
        self.live = self.live.saturating_sub(1);
    }

    /// The waiting member with the least place, dropping the stale entries above it.
    pub(super) fn head(&mut self, valid: impl Fn(&Place) -> bool) -> Option<Place> {
        while let Some(top) = self.heap.first() {
            if valid(top) {
                return Some(*top);
            }
            self.pop_top();
        }
        None
    }

    /// A call of the member at `place` is served (`head`: the least place waiting): it
    /// stops waiting there, and the virtual time moves to the head's start (the member's
    /// own, in order; a member served out of order does not move it past others waiting).
    pub(super) fn serve(&mut self, place: &Place, head: &Place) {
        self.vtime = self.vtime.max(head.0.min(place.0));
        self.live = self.live.saturating_sub(1);
        if self.heap.first() == Some(place) {
            self.pop_top();
        }
    }

    /// The waiting members in order, least place first (stale entries passed over): a walk
    /// of the heap from its root, O(log k) a member for the first k.
    pub(super) fn in_order<F: Fn(&Place) -> bool>(&self, valid: F) -> InOrder<'_, F> {
        let mut frontier = BinaryHeap::new();
        if let Some(&top) = self.heap.first() {
            frontier.push(Reverse((top, 0)));
        }
        InOrder {
            heap: &self.heap,
            frontier,
            valid,
        }
    }

    /// Drops every stale entry when they outnumber the live ones (so the heap stays within
    /// a constant factor of the members waiting).
    pub(super) fn compact(&mut self, valid: impl Fn(&Place) -> bool) {
        if self.heap.len() <= 2 * self.live + 16 {
            return;
        }
        self.heap.retain(|p| valid(p));
        self.heap.sort_unstable();
    }

    /// Nothing waits here: the entries left are all stale.
    pub(super) fn clear_stale(&mut self) {
        if self.live == 0 {
            self.heap.clear();
        }
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

    #[cfg(test)]
    pub(super) fn live(&self) -> usize {
        self.live
    }

    #[cfg(test)]
    pub(super) fn holds(&self, place: &Place) -> bool {
        self.heap.contains(place)
    }

    fn push(&mut self, place: Place) {
        self.heap.push(place);
        let mut i = self.heap.len() - 1;
        while i > 0 {
            let parent = (i - 1) / 2;
            if self.heap[parent] <= self.heap[i] {
                break;
            }
            self.heap.swap(parent, i);
            i = parent;
        }
    }

    fn pop_top(&mut self) {
        let Some(last) = self.heap.pop() else {
            return;
        };
        if self.heap.is_empty() {
            return;
        }
        self.heap[0] = last;
        let (mut i, len) = (0, self.heap.len());
        loop {
            let (left, right) = (2 * i + 1, 2 * i + 2);
            let mut least = i;
            if left < len && self.heap[left] < self.heap[least] {
                least = left;
            }
            if right < len && self.heap[right] < self.heap[least] {
                least = right;
            }
            if least == i {
                break;
            }
            self.heap.swap(i, least);
            i = least;
        }
    }
}

/// The waiting members of an [`Order`] in order: see [`Order::in_order`].
pub(super) struct InOrder<'a, F> {
    heap: &'a [Place],
    frontier: BinaryHeap<Reverse<(Place, usize)>>,
    valid: F,
}

impl<F: Fn(&Place) -> bool> Iterator for InOrder<'_, F> {
    type Item = Place;

    fn next(&mut self) -> Option<Place> {
        loop {
            let Reverse((place, i)) = self.frontier.pop()?;
            for child in [2 * i + 1, 2 * i + 2] {
                if let Some(&below) = self.heap.get(child) {
                    self.frontier.push(Reverse((below, child)));
                }
            }
            if (self.valid)(&place) {
                return Some(place);
            }
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
