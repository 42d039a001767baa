//! Deficit Round Robin inside one priority class: the class's tenants, their `new` and `old`
//! lists (DRR++), their deficits and FIFOs of waiting items.

use std::hash::BuildHasher;

use hashbrown::HashTable;

use super::slab::{Entries, Entry, MAX_SLOTS, NONE};
use super::{Pick, RETAINED_CAPACITY};
use crate::TenantId;
use crate::hash::Seeded;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum ListKind {
    New,
    Old,
}

#[derive(Clone, Copy, Debug)]
pub(super) struct TenantList {
    pub(super) head: u32,
    pub(super) tail: u32,
}

impl TenantList {
    pub(super) const EMPTY: TenantList = TenantList {
        head: NONE,
        tail: NONE,
    };
}

/// `u32` links, and an `Option<ListKind>` whose spare values give
/// `Option<Tenant>` its discriminant: 56 bytes on a 64-bit target.
#[derive(Debug)]
pub(super) struct Tenant {
    pub(super) deficit: i64,
    pub(super) id: TenantId,
    pub(super) weight: u32,
    /// FIFO of this tenant's entries in this class. Empty only while the
    /// tenant waits on `old` to be found empty in its turn (DRR++), or while
    /// it is parked.
    pub(super) head: u32,
    pub(super) tail: u32,
    pub(super) len: u32,
    /// Dispatched items not yet [completed](Scheduler::complete).
    pub(super) in_flight: u32,
    /// Position in the class's `new` or `old` list. A tenant on `new` always
    /// has waiting items.
    pub(super) prev: u32,
    pub(super) next: u32,
    /// `None`: parked, on neither list (nothing waiting, items in flight).
    pub(super) list: Option<ListKind>,
}

#[cfg(test)]
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Visit {
    TopUp(TenantId),
    Dispatch(TenantId),
    /// Found empty at the head of `old`: state freed.
    Forget(TenantId),
}

/// Tenant name -> slot in its class's tenant slab. A bucket holds only the
/// `u32` slot (a `HashMap<TenantId, u32>` bucket is 24 bytes), so the index
/// of 100,000 tenants stays within a core's L2 cache; names are compared
/// through the slab. Each operation hashes a name once (SipHash with random
/// keys, as `HashMap`: tenant names come from callers).
#[derive(Debug, Default)]
pub(super) struct TenantIndex {
    slots: HashTable<u32>,
    hasher: Seeded,
}

impl TenantIndex {
    fn hash(&self, id: &TenantId) -> u64 {
        self.hasher.hash_one(id)
    }

    fn find(&self, hash: u64, id: &TenantId, tenants: &[Option<Tenant>]) -> Option<u32> {
        self.slots
            .find(hash, |&t| {
                Self::id_at(tenants, t).is_some_and(|x| x.same(id))
            })
            .copied()
    }

    fn insert(&mut self, hash: u64, t: u32, tenants: &[Option<Tenant>]) {
        let hasher = &self.hasher;
        self.slots.insert_unique(hash, t, |&x| {
            Self::id_at(tenants, x).map_or(0, |id| hasher.hash_one(id))
        });
    }

    fn remove(&mut self, hash: u64, t: u32) {
        if let Ok(entry) = self.slots.find_entry(hash, |&x| x == t) {
            entry.remove();
        }
    }

    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.slots.len()
    }

    fn clear(&mut self) {
        self.slots.clear();
        // Empty: the rehash function is never called.
        self.slots.shrink_to(RETAINED_CAPACITY, |_| 0);
    }

    fn id_at(tenants: &[Option<Tenant>], t: u32) -> Option<&TenantId> {
        tenants.get(t as usize)?.as_ref().map(|x| &x.id)
    }
}

#[derive(Debug)]
pub(super) struct Class {
    pub(super) index: TenantIndex,
    pub(super) tenants: Vec<Option<Tenant>>,
    pub(super) free: Vec<u32>,
    /// [`MAX_SLOTS`], lowered by tests.
    pub(super) limit: usize,
    pub(super) new: TenantList,
    pub(super) old: TenantList,
    /// Waiting items.
    pub(super) len: usize,
    /// Listed tenants with at least one waiting item.
    pub(super) busy: usize,
    /// Tenants with nothing waiting but items in flight, on neither list.
    pub(super) parked: usize,
    /// Tenant slab length above which a drain compacts it
    /// ([`RETAINED_CAPACITY`], lowered by tests).
    pub(super) compact_above: usize,
    #[cfg(test)]
    pub(super) trace: Vec<Visit>,
}

impl Class {
    pub(super) fn new() -> Self {
        Class {
            index: TenantIndex::default(),
            tenants: Vec::new(),
            free: Vec::new(),
            limit: MAX_SLOTS,
            new: TenantList::EMPTY,
            old: TenantList::EMPTY,
            len: 0,
            busy: 0,
            parked: 0,
            compact_above: RETAINED_CAPACITY,
            #[cfg(test)]
            trace: Vec::new(),
        }
    }

    /// The hash of `id` for this class's index, and its slot if it is known.
    pub(super) fn lookup(&self, id: &TenantId) -> (u64, Option<u32>) {
        let hash = self.index.hash(id);
        (hash, self.index.find(hash, id, &self.tenants))
    }

    pub(super) fn tenant(&self, t: u32) -> Option<&Tenant> {
        self.tenants.get(t as usize)?.as_ref()
    }

    pub(super) fn tenant_mut(&mut self, t: u32) -> Option<&mut Tenant> {
        self.tenants.get_mut(t as usize)?.as_mut()
    }

    /// Whether [`Class::activate`] will find a slot.
    pub(super) fn has_room(&self) -> bool {
        !self.free.is_empty() || self.tenants.len() < self.limit
    }

    fn list_mut(&mut self, kind: ListKind) -> &mut TenantList {
        match kind {
            ListKind::New => &mut self.new,
            ListKind::Old => &mut self.old,
        }
    }

    fn link_back(&mut self, kind: ListKind, t: u32) {
        let tail = self.list_mut(kind).tail;
        if let Some(tenant) = self.tenant_mut(t) {
            tenant.list = Some(kind);
            tenant.prev = tail;
            tenant.next = NONE;
        }
        match self.tenant_mut(tail) {
            Some(prev) => prev.next = t,
            None => self.list_mut(kind).head = t,
        }
        self.list_mut(kind).tail = t;
    }

    /// Takes `t` off its list (a parked tenant is on none).
    fn unlink(&mut self, t: u32) {
        let Some(tenant) = self.tenant_mut(t) else {
            return;
        };
        let Some(kind) = tenant.list else {
            return;
        };
        let (prev, next) = (tenant.prev, tenant.next);
        tenant.prev = NONE;
        tenant.next = NONE;
        match self.tenant_mut(prev) {
            Some(p) => p.next = next,
            None => self.list_mut(kind).head = next,
        }
        match self.tenant_mut(next) {
            Some(n) => n.prev = prev,
            None => self.list_mut(kind).tail = prev,
        }
    }

    /// A tenant the class does not know gets a waiting item: back of `new`,
    /// one quantum × weight. `None` if the tenant slab is full.
    pub(super) fn activate(
        &mut self,
        hash: u64,
        id: TenantId,
        weight: u32,
        grant: i64,
    ) -> Option<u32> {
        let t = self.insert(hash, id, weight, grant)?;
        self.link_back(ListKind::New, t);
        Some(t)
    }

    /// A new tenant state (`hash` is its id's), on no list yet. `None` if the
    /// tenant slab is full.
    pub(super) fn insert(
        &mut self,
        hash: u64,
        id: TenantId,
        weight: u32,
        deficit: i64,
    ) -> Option<u32> {
        let tenant = Tenant {
            deficit,
            id,
            weight,
            head: NONE,
            tail: NONE,
            len: 0,
            in_flight: 0,
            prev: NONE,
            next: NONE,
            list: None,
        };
        let t = match self.free.pop() {
            Some(t) if (t as usize) < self.tenants.len() => {
                self.tenants[t as usize] = Some(tenant);
                t
            }
            _ => {
                let t = u32::try_from(self.tenants.len())
                    .ok()
                    .filter(|_| self.tenants.len() < self.limit)?;
                self.tenants.push(Some(tenant));
                t
            }
        };
        self.index.insert(hash, t, &self.tenants);
        Some(t)
    }

    /// The tenant was found empty at the head of `old` while items of it are
    /// in flight: off the lists, credit forfeited (debt kept), until it gets
    /// a waiting item (back of `old`) or its last item completes (forgotten).
    fn park(&mut self, t: u32) {
        self.unlink(t);
        if let Some(tenant) = self.tenant_mut(t) {
            tenant.list = None;
            tenant.deficit = tenant.deficit.min(0);
            self.parked += 1;
        }
    }

    /// A parked tenant gets a waiting item: back of `old`, deficit kept.
    pub(super) fn unpark(&mut self, t: u32) {
        if self.tenant(t).is_some_and(|x| x.list.is_none()) {
            self.parked = self.parked.saturating_sub(1);
            self.link_back(ListKind::Old, t);
        }
    }

    /// The tenant was found empty at the head of `old` with nothing in
    /// flight, or its last item completed while parked: forget it, deficit
    /// included. `hash` is its id's, if the caller has it.
    fn release(&mut self, t: u32, hash: Option<u64>) {
        self.unlink(t);
        let Some(tenant) = self.tenants.get_mut(t as usize).and_then(Option::take) else {
            return;
        };
        self.free.push(t);
        let hash = hash.unwrap_or_else(|| self.index.hash(&tenant.id));
        self.index.remove(hash, t);
        #[cfg(test)]
        self.trace.push(Visit::Forget(tenant.id));
    }

    /// Unlinks `entry`, already taken out of the slab from `index`, from its
    /// tenant's FIFO. Taking the head does not touch its successor (whose
    /// `prev` goes stale; a head's `prev` is never read). A tenant this
    /// empties stays listed with its deficit (DRR++): one on `new` moves to
    /// the back of `old`, one on `old` keeps its place until [`Class::pop`]
    /// finds it empty there.
    pub(super) fn detach<T>(&mut self, entries: &mut Entries<T>, index: u32, entry: &Entry<T>) {
        self.len = self.len.saturating_sub(1);
        let Some(tenant) = self.tenant_mut(entry.tenant) else {
            return;
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
        if tenant.len > 0 {
            return;
        }
        let on_new = tenant.list == Some(ListKind::New);
        self.busy = self.busy.saturating_sub(1);
        if on_new {
            self.unlink(entry.tenant);
            self.link_back(ListKind::Old, entry.tenant);
        }
    }

    /// A tenant on `new` was served one request: it goes to the back of `new`. Newcomers
    /// take turns one request at a time while their first grant lasts, so a tenant that
    /// dumps many small requests holds a newcomer behind one of them, not behind a whole
    /// quantum of them; its service is still bounded by its one grant.
    pub(super) fn newcomer_served(&mut self, t: u32) {
        if self
            .tenant(t)
            .is_some_and(|tenant| tenant.list == Some(ListKind::New))
        {
            self.unlink(t);
            self.link_back(ListKind::New, t);
        }
    }

    /// DRR++ dispatch inside the class. Each loop iteration either returns,
    /// forgets or parks an empty tenant (each at most once), or tops up one tenant by
    /// at least 1 while no cost exceeds max_charge, so the loop ends (bounds
    /// in `ARCHITECTURE.md`, "Cost of an operation").
    pub(super) fn pop<T>(
        &mut self,
        entries: &mut Entries<T>,
        quantum: i64,
    ) -> Option<(T, TenantId, i64)> {
        self.pop_where(entries, quantum, |_| Pick::Take)
    }

    /// [`Class::pop`], asking `decide` about each tenant whose turn comes
    /// (its deficit covers its head): see [`Pick`]. A skip moves the tenant
    /// to the back of `old` with its deficit and no grant, and is the only
    /// other kind of iteration: tenants with waiting items all skipped in a
    /// row (no top-up between) end the loop with `None`.
    pub(super) fn pop_where<T>(
        &mut self,
        entries: &mut Entries<T>,
        quantum: i64,
        mut decide: impl FnMut(&TenantId) -> Pick,
    ) -> Option<(T, TenantId, i64)> {
        let mut skipped = 0;
        loop {
            let t = if self.new.head == NONE {
                self.old.head
            } else {
                self.new.head
            };
            let tenant = self.tenant_mut(t)?;
            let head = tenant.head;
            if head == NONE {
                // Empty: on `old` (its turn came) it is forgotten, or parked
                // while items of it are in flight. `detach` never leaves an
                // empty tenant on `new`; were one there, it would move to
                // `old` as RFC 8290 says.
                if tenant.list == Some(ListKind::New) {
                    self.unlink(t);
                    self.link_back(ListKind::Old, t);
                } else if tenant.in_flight > 0 {
                    self.park(t);
                } else {
                    self.release(t, None);
                }
                continue;
            }
            let cost = entries.get(head)?.cost;
            if tenant.deficit < cost {
                let grant = quantum.saturating_mul(i64::from(tenant.weight));
                tenant.deficit = tenant.deficit.saturating_add(grant);
                #[cfg(test)]
                let visited = tenant.id.clone();
                #[cfg(test)]
                self.trace.push(Visit::TopUp(visited));
                self.unlink(t);
                self.link_back(ListKind::Old, t);
                skipped = 0;
                continue;
            }
            match decide(&tenant.id) {
                Pick::Take => {}
                Pick::Stop => return None,
                Pick::Skip => {
                    skipped += 1;
                    if skipped >= self.busy {
                        return None;
                    }
                    self.unlink(t);
                    self.link_back(ListKind::Old, t);
                    continue;
                }
            }
            let tenant = self.tenant_mut(t)?;
            // deficit >= cost >= 1, so this cannot overflow.
            tenant.deficit -= cost;
            tenant.in_flight = tenant.in_flight.saturating_add(1);
            let id = tenant.id.clone();
            let entry = entries.take_at(head)?;
            self.detach(entries, head, &entry);
            self.newcomer_served(t);
            #[cfg(test)]
            self.trace.push(Visit::Dispatch(id.clone()));
            return Some((entry.item, id, cost));
        }
    }

    /// A dispatched item of `id` completed. A parked tenant whose last item
    /// this was is forgotten.
    pub(super) fn complete(&mut self, id: &TenantId) {
        let (hash, Some(t)) = self.lookup(id) else {
            return;
        };
        let Some(tenant) = self.tenant_mut(t) else {
            return;
        };
        tenant.in_flight = tenant.in_flight.saturating_sub(1);
        if tenant.in_flight > 0 || tenant.list.is_some() {
            return;
        }
        self.parked = self.parked.saturating_sub(1);
        if self.len == 0 && self.parked == 0 {
            // The last tenant the class knew: free everything at once.
            self.reset();
        } else {
            self.release(t, Some(hash));
        }
    }

    /// Called when the class has nothing waiting: every tenant still listed
    /// is empty (on `old`). Each is parked if items of it are in flight,
    /// else forgotten at once (a drained class has no backlogged tenant a
    /// returning one could overtake).
    pub(super) fn drained(&mut self) {
        self.busy = 0;
        for list in [self.new, self.old] {
            let mut cursor = list.head;
            while let Some(tenant) = self.tenant(cursor) {
                let (t, next, in_flight) = (cursor, tenant.next, tenant.in_flight);
                if in_flight > 0 {
                    self.park(t);
                } else {
                    self.release(t, None);
                }
                cursor = next;
            }
        }
        if self.parked == 0 {
            self.reset();
        } else if self.tenants.len() > self.compact_above
            && self.free.len() >= self.tenants.len() / 2
        {
            self.compact();
        }
    }

    /// Called when nothing waits and the parked tenants are the only ones
    /// left: moves them into a fresh, small slab and index, so a class that
    /// once knew many tenants gives the memory back even while some requests
    /// are in flight. No entry or list refers to a tenant slot then. The scan
    /// is paid for by the at least `RETAINED_CAPACITY / 2` tenants forgotten
    /// since the slab last had this size.
    fn compact(&mut self) {
        let parked: Vec<Tenant> = self.tenants.drain(..).flatten().collect();
        self.reset();
        for tenant in parked {
            let hash = self.index.hash(&tenant.id);
            let Ok(t) = u32::try_from(self.tenants.len()) else {
                // Unreachable: fewer parked tenants than slots before.
                break;
            };
            self.tenants.push(Some(tenant));
            self.index.insert(hash, t, &self.tenants);
        }
    }

    /// Frees every tenant slot and the index: nothing waits, and nothing is
    /// in flight (or [`Class::compact`] puts the parked tenants back).
    fn reset(&mut self) {
        self.index.clear();
        self.new = TenantList::EMPTY;
        self.old = TenantList::EMPTY;
        self.tenants.clear();
        self.free.clear();
        self.tenants.shrink_to(RETAINED_CAPACITY);
        self.free.shrink_to(RETAINED_CAPACITY);
    }
}
