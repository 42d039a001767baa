//! The Deficit Round Robin core of the `DrrFairness` layer: a pure data structure (no IO,
//! no clocks, no async) that holds waiting requests and says which goes next. The layer
//! pushes requests in, pops the next to dispatch, removes those whose waiter went away,
//! charges those that went out without waiting, and reports each dispatch's completion
//! and real cost.
//!
//! The rules it keeps (the reasoning and the bounds' proofs are in `ARCHITECTURE.md`,
//! "The fair queue's scheduler"):
//!
//! - **Between classes**, a work-conserving weighted choice among the classes with work,
//!   by default nginx's smooth weighted round robin: with weights 270/25/5 and every class
//!   backlogged, critical gets 90% and batch never waits more than 60 dispatches. A class
//!   that empties banks no credit.
//! - **Inside a class**, Deficit Round Robin over tenants with fq_codel's `new`/`old`
//!   lists (RFC 8290 §4.2): a newcomer gets one grant of `quantum × weight` and takes turns
//!   one request at a time while it lasts; a request is charged `min(max(cost, 1),
//!   max_charge)`, so one giant prompt cannot stall its class.
//! - **A tenant is forgotten only in its turn**: one whose queue empties keeps its place
//!   and deficit until the head of `old` finds it empty, so light tenants that keep
//!   re-arriving cannot starve a backlogged one.
//! - **Every dispatch is charged**, queued ([`Scheduler::pop`]) or not
//!   ([`Scheduler::dispatch_direct`]), and counted in flight until
//!   [`Scheduler::complete`]; a tenant with work in flight is no newcomer.
//! - **Bounded work**: `push`, `remove`, `settle`, `dispatch_direct` and `complete` are
//!   O(1), `pop` amortised O(`max_charge_quanta`) whatever the number of tenants. At most
//!   `u32::MAX - 1` waiting items, and as many tenants per class: beyond, a push is
//!   refused with [`Rejected::ClassFull`], never a panic. A [`Key`] never matches another
//!   item, even after its slot is reused.
//!
//! ```
//! use fairgate::drr_fairness::scheduler::Scheduler;
//! use fairgate::drr_fairness::SchedulerConfig;
//! use fairgate::{Priority, TenantId};
//!
//! let mut queue = Scheduler::new(SchedulerConfig::default()).unwrap();
//! // Tenant a queues three requests of one quantum each, then b queues one.
//! for n in 1..=3 {
//!     queue.push(Priority::Standard, TenantId::new("a"), 1, 5_000, format!("a{n}")).unwrap();
//! }
//! queue.push(Priority::Standard, TenantId::new("b"), 1, 5_000, "b1".to_owned()).unwrap();
//! // b goes second, not fourth.
//! let order: Vec<String> = std::iter::from_fn(|| queue.pop()).map(|d| d.item).collect();
//! assert_eq!(order, ["a1", "b1", "a2", "a3"]);
//! ```

use std::fmt;
use std::hash::BuildHasher;

use hashbrown::HashTable;

use crate::error::ConfigError;
use crate::hash::Seeded;
use crate::rng::Rng;
use crate::{Priority, TenantId};

/// Capacity kept when a slab drains, so steady light traffic does not
/// reallocate on every idle/busy transition.
const RETAINED_CAPACITY: usize = 1024;

const CLASSES: [Priority; 3] = [Priority::Critical, Priority::Standard, Priority::Batch];

fn class_index(class: Priority) -> usize {
    match class {
        Priority::Critical => 0,
        Priority::Standard => 1,
        Priority::Batch => 2,
    }
}

fn clamp_i64(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

/// Relative dispatch weights of the three priority classes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClassWeights {
    /// Weight of [`Priority::Critical`].
    pub critical: u32,
    /// Weight of [`Priority::Standard`].
    pub standard: u32,
    /// Weight of [`Priority::Batch`].
    pub batch: u32,
}

impl Default for ClassWeights {
    /// 270 / 25 / 5: critical wins 90 % while it has work, the remaining
    /// 10 % split 5:1 between standard and batch.
    fn default() -> Self {
        ClassWeights {
            critical: 270,
            standard: 25,
            batch: 5,
        }
    }
}

impl ClassWeights {
    /// The weight of `class`.
    pub fn get(&self, class: Priority) -> u32 {
        match class {
            Priority::Critical => self.critical,
            Priority::Standard => self.standard,
            Priority::Batch => self.batch,
        }
    }

    fn as_array(&self) -> [u64; 3] {
        [
            u64::from(self.critical),
            u64::from(self.standard),
            u64::from(self.batch),
        ]
    }
}

/// How the next class is chosen among the non-empty classes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ClassSelection {
    /// Deterministic smooth weighted round robin (nginx): even spacing, exact
    /// shares over every `total weight` dispatches when all are backlogged.
    #[default]
    SmoothWeighted,
    /// Random choice weighted by the non-empty classes' weights, from a
    /// SplitMix64 generator seeded with `seed` (reproducible per seed).
    Probabilistic {
        /// Initial generator state.
        seed: u64,
    },
}

/// Scheduler settings. Build from [`Default`] and the `with_*` methods, then
/// check with [`SchedulerConfig::validate`] (also done by [`Scheduler::new`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Credit (in tokens) a tenant of weight 1 receives per round. At least 1.
    pub quantum: u64,
    /// Charged cost is capped at `quantum × max_charge_quanta`. At least 1.
    pub max_charge_quanta: u32,
    /// Weights of the priority classes. Each at least 1.
    pub class_weights: ClassWeights,
    /// Class selection policy.
    pub selection: ClassSelection,
    /// Maximum waiting items per tenant per class (`None`: unlimited).
    pub max_per_tenant: Option<usize>,
    /// Maximum waiting items per class (`None`: unlimited).
    pub max_per_class: Option<usize>,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            quantum: 5_000,
            max_charge_quanta: 4,
            class_weights: ClassWeights::default(),
            selection: ClassSelection::default(),
            max_per_tenant: None,
            max_per_class: None,
        }
    }
}

impl SchedulerConfig {
    /// Sets [`SchedulerConfig::quantum`].
    pub fn with_quantum(mut self, quantum: u64) -> Self {
        self.quantum = quantum;
        self
    }

    /// Sets [`SchedulerConfig::max_charge_quanta`].
    pub fn with_max_charge_quanta(mut self, quanta: u32) -> Self {
        self.max_charge_quanta = quanta;
        self
    }

    /// Sets [`SchedulerConfig::class_weights`].
    pub fn with_class_weights(mut self, weights: ClassWeights) -> Self {
        self.class_weights = weights;
        self
    }

    /// Sets [`SchedulerConfig::selection`].
    pub fn with_selection(mut self, selection: ClassSelection) -> Self {
        self.selection = selection;
        self
    }

    /// Sets [`SchedulerConfig::max_per_tenant`].
    pub fn with_max_per_tenant(mut self, limit: Option<usize>) -> Self {
        self.max_per_tenant = limit;
        self
    }

    /// Sets [`SchedulerConfig::max_per_class`].
    pub fn with_max_per_class(mut self, limit: Option<usize>) -> Self {
        self.max_per_class = limit;
        self
    }

    /// The largest cost charged for one item: `quantum × max_charge_quanta`
    /// (saturating).
    pub fn max_charge(&self) -> u64 {
        self.quantum
            .saturating_mul(u64::from(self.max_charge_quanta))
    }

    /// Checks every field; the error names the first bad one.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let at_least_one =
            |field: &str| Err(ConfigError::new(format!("{field} must be at least 1")));
        if self.quantum == 0 {
            return at_least_one("quantum");
        }
        if self.max_charge_quanta == 0 {
            return at_least_one("max_charge_quanta");
        }
        for class in CLASSES {
            if self.class_weights.get(class) == 0 {
                return at_least_one(&format!("class_weights.{class}"));
            }
        }
        if self.max_per_tenant == Some(0) {
            return at_least_one("max_per_tenant");
        }
        if self.max_per_class == Some(0) {
            return at_least_one("max_per_class");
        }
        Ok(())
    }
}

/// A push refused by a queue limit; carries the incoming item back.
#[derive(Debug, PartialEq, Eq)]
pub enum Rejected<T> {
    /// The tenant already has `max_per_tenant` items waiting in this class.
    TenantFull(T),
    /// The class already has `max_per_class` items waiting, or the
    /// scheduler is at capacity (`u32::MAX - 1` waiting items, or as many
    /// known tenants in the class, listed or parked; see the module doc).
    ClassFull(T),
}

impl<T> Rejected<T> {
    /// The refused item.
    pub fn into_inner(self) -> T {
        match self {
            Rejected::TenantFull(item) | Rejected::ClassFull(item) => item,
        }
    }
}

impl<T> fmt::Display for Rejected<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Rejected::TenantFull(_) => f.write_str("tenant queue is full"),
            Rejected::ClassFull(_) => f.write_str("priority class queue is full"),
        }
    }
}

impl<T: fmt::Debug> std::error::Error for Rejected<T> {}

/// What [`Scheduler::pop_class_where`] does with the tenant whose turn came.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pick {
    /// Dispatch its head item.
    Take,
    /// Pass it over this time: it goes to the back of the round with its
    /// deficit (no grant), and the next tenant's turn comes.
    Skip,
    /// Dispatch nothing now, and leave it first in line (in its turn, its
    /// deficit covering its head): the next pop starts with it.
    Stop,
}

/// Handle of a waiting item, for [`Scheduler::remove`]. Never matches a
/// different item, even after its slot is reused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Key {
    index: u32,
    generation: u64,
}

/// An item chosen by [`Scheduler::pop`].
#[derive(Debug, PartialEq, Eq)]
pub struct Dispatched<T> {
    /// The item that was pushed.
    pub item: T,
    /// Its priority class.
    pub class: Priority,
    /// Its tenant.
    pub tenant: TenantId,
    /// The cost charged to the tenant's deficit (the estimate, at least 1,
    /// capped at [`SchedulerConfig::max_charge`]).
    pub cost: u64,
}

/// "No slot" in the `u32` links and indices of the slabs.
const NONE: u32 = u32::MAX;

/// Most slots a slab (entries, or the tenants of one class) may hold, so
/// every index stays below [`NONE`].
const MAX_SLOTS: usize = (u32::MAX - 1) as usize;

/// `u32` links and a `Priority` (whose spare values give `Option<Entry>` its
/// discriminant): 40 bytes for an 8-byte item on a 64-bit target.
#[derive(Debug)]
struct Entry<T> {
    item: T,
    generation: u64,
    cost: i64,
    tenant: u32,
    /// Previous entry of the tenant's FIFO. Left stale once the entry is its
    /// tenant's head (popping the head does not touch its successor): read
    /// only for an entry that is not the head.
    prev: u32,
    next: u32,
    class: Priority,
}

#[derive(Debug)]
struct Entries<T> {
    slots: Vec<Option<Entry<T>>>,
    free: Vec<u32>,
    next_generation: u64,
    /// [`MAX_SLOTS`], lowered by tests.
    limit: usize,
}

impl<T> Entries<T> {
    fn new() -> Self {
        Entries {
            slots: Vec::new(),
            free: Vec::new(),
            next_generation: 0,
            limit: MAX_SLOTS,
        }
    }

    /// Whether [`Entries::insert`] will find a slot.
    fn has_room(&self) -> bool {
        !self.free.is_empty() || self.slots.len() < self.limit
    }

    /// Stores `entry`, or hands its item back when the slab is full.
    fn insert(&mut self, mut entry: Entry<T>) -> Result<Key, T> {
        let generation = self.next_generation;
        entry.generation = generation;
        if let Some(index) = self.free.pop()
            && let Some(slot) = self.slots.get_mut(index as usize)
        {
            self.next_generation = generation.wrapping_add(1);
            *slot = Some(entry);
            return Ok(Key { index, generation });
        }
        let Some(index) = u32::try_from(self.slots.len())
            .ok()
            .filter(|_| self.slots.len() < self.limit)
        else {
            return Err(entry.item);
        };
        self.next_generation = generation.wrapping_add(1);
        self.slots.push(Some(entry));
        Ok(Key { index, generation })
    }

    fn get(&self, index: u32) -> Option<&Entry<T>> {
        self.slots.get(index as usize)?.as_ref()
    }

    fn get_mut(&mut self, index: u32) -> Option<&mut Entry<T>> {
        self.slots.get_mut(index as usize)?.as_mut()
    }

    /// Takes the entry at `index`, if it is `key`'s.
    fn take(&mut self, key: Key) -> Option<Entry<T>> {
        if self.get(key.index)?.generation != key.generation {
            return None;
        }
        self.take_at(key.index)
    }

    fn take_at(&mut self, index: u32) -> Option<Entry<T>> {
        let entry = self.slots.get_mut(index as usize)?.take()?;
        self.free.push(index);
        Some(entry)
    }

    /// Called when nothing is waiting: drop the vacant slots.
    fn reset(&mut self) {
        self.slots.clear();
        self.free.clear();
        self.slots.shrink_to(RETAINED_CAPACITY);
        self.free.shrink_to(RETAINED_CAPACITY);
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ListKind {
    New,
    Old,
}

#[derive(Clone, Copy, Debug)]
struct TenantList {
    head: u32,
    tail: u32,
}

impl TenantList {
    const EMPTY: TenantList = TenantList {
        head: NONE,
        tail: NONE,
    };
}

/// `u32` links, and an `Option<ListKind>` whose spare values give
/// `Option<Tenant>` its discriminant: 56 bytes on a 64-bit target.
#[derive(Debug)]
struct Tenant {
    deficit: i64,
    id: TenantId,
    weight: u32,
    /// FIFO of this tenant's entries in this class. Empty only while the
    /// tenant waits on `old` to be found empty in its turn (DRR++), or while
    /// it is parked.
    head: u32,
    tail: u32,
    len: u32,
    /// Dispatched items not yet [completed](Scheduler::complete).
    in_flight: u32,
    /// Position in the class's `new` or `old` list. A tenant on `new` always
    /// has waiting items.
    prev: u32,
    next: u32,
    /// `None`: parked, on neither list (nothing waiting, items in flight).
    list: Option<ListKind>,
}

#[cfg(test)]
#[derive(Clone, Debug, PartialEq, Eq)]
enum Visit {
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
struct TenantIndex {
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
    fn len(&self) -> usize {
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
struct Class {
    index: TenantIndex,
    tenants: Vec<Option<Tenant>>,
    free: Vec<u32>,
    /// [`MAX_SLOTS`], lowered by tests.
    limit: usize,
    new: TenantList,
    old: TenantList,
    /// Waiting items.
    len: usize,
    /// Listed tenants with at least one waiting item.
    busy: usize,
    /// Tenants with nothing waiting but items in flight, on neither list.
    parked: usize,
    /// Tenant slab length above which a drain compacts it
    /// ([`RETAINED_CAPACITY`], lowered by tests).
    compact_above: usize,
    #[cfg(test)]
    trace: Vec<Visit>,
}

impl Class {
    fn new() -> Self {
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
    fn lookup(&self, id: &TenantId) -> (u64, Option<u32>) {
        let hash = self.index.hash(id);
        (hash, self.index.find(hash, id, &self.tenants))
    }

    fn tenant(&self, t: u32) -> Option<&Tenant> {
        self.tenants.get(t as usize)?.as_ref()
    }

    fn tenant_mut(&mut self, t: u32) -> Option<&mut Tenant> {
        self.tenants.get_mut(t as usize)?.as_mut()
    }

    /// Whether [`Class::activate`] will find a slot.
    fn has_room(&self) -> bool {
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
    fn activate(&mut self, hash: u64, id: TenantId, weight: u32, grant: i64) -> Option<u32> {
        let t = self.insert(hash, id, weight, grant)?;
        self.link_back(ListKind::New, t);
        Some(t)
    }

    /// A new tenant state (`hash` is its id's), on no list yet. `None` if the
    /// tenant slab is full.
    fn insert(&mut self, hash: u64, id: TenantId, weight: u32, deficit: i64) -> Option<u32> {
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
    fn unpark(&mut self, t: u32) {
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
    fn detach<T>(&mut self, entries: &mut Entries<T>, index: u32, entry: &Entry<T>) {
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
    fn newcomer_served(&mut self, t: u32) {
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
    fn pop<T>(&mut self, entries: &mut Entries<T>, quantum: i64) -> Option<(T, TenantId, i64)> {
        self.pop_where(entries, quantum, |_| Pick::Take)
    }

    /// [`Class::pop`], asking `decide` about each tenant whose turn comes
    /// (its deficit covers its head): see [`Pick`]. A skip moves the tenant
    /// to the back of `old` with its deficit and no grant, and is the only
    /// other kind of iteration: tenants with waiting items all skipped in a
    /// row (no top-up between) end the loop with `None`.
    fn pop_where<T>(
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
    fn complete(&mut self, id: &TenantId) {
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
    fn drained(&mut self) {
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

/// Deficit Round Robin scheduler over three priority classes; the module
/// documentation gives its rules, `ARCHITECTURE.md` their reasons and bounds.
#[derive(Debug)]
pub struct Scheduler<T> {
    config: SchedulerConfig,
    quantum: i64,
    max_charge: i64,
    entries: Entries<T>,
    classes: [Class; 3],
    len: usize,
    picker: ClassPicker,
}

impl<T> Scheduler<T> {
    /// An empty scheduler, or the reason `config` is refused.
    pub fn new(config: SchedulerConfig) -> Result<Self, ConfigError> {
        config.validate()?;
        Ok(Scheduler {
            picker: ClassPicker::new(&config),
            quantum: clamp_i64(config.quantum),
            max_charge: clamp_i64(config.max_charge()),
            config,
            entries: Entries::new(),
            classes: [Class::new(), Class::new(), Class::new()],
            len: 0,
        })
    }

    /// The configuration in force.
    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// The cost charged for an estimate: at least 1, at most max_charge.
    fn charge(&self, cost: u64) -> i64 {
        clamp_i64(cost.max(1)).min(self.max_charge)
    }

    /// Queues `item` for `tenant` in `class`. `weight` is the tenant's tier
    /// weight (0 is treated as 1; the latest push's weight applies to later
    /// top-ups); `cost` the estimated tokens (0 is treated as 1). A queue
    /// limit, or the scheduler's capacity (see the module doc), refuses the
    /// incoming item and hands it back unchanged.
    pub fn push(
        &mut self,
        class: Priority,
        tenant: TenantId,
        weight: u32,
        cost: u64,
        item: T,
    ) -> Result<Key, Rejected<T>> {
        let ci = class_index(class);
        let weight = weight.max(1);
        let cost = self.charge(cost);
        let grant = self.quantum.saturating_mul(i64::from(weight));
        let (max_per_tenant, max_per_class) =
            (self.config.max_per_tenant, self.config.max_per_class);
        let queue = &mut self.classes[ci];
        let (hash, existing) = queue.lookup(&tenant);
        if let (Some(limit), Some(t)) = (max_per_tenant, existing)
            && queue.tenant(t).is_some_and(|x| x.len as usize >= limit)
        {
            return Err(Rejected::TenantFull(item));
        }
        if max_per_class.is_some_and(|limit| queue.len >= limit) {
            return Err(Rejected::ClassFull(item));
        }
        // Slab capacity (about 4.3 billion entries, resp. known tenants of a
        // class): refused like a full class, checked before any change.
        if !self.entries.has_room() || (existing.is_none() && !queue.has_room()) {
            return Err(Rejected::ClassFull(item));
        }
        // A listed tenant, even an empty one waiting on `old` for its turn,
        // keeps its place and deficit: no fresh grant, no move to `new`. A
        // parked one (items in flight) joins the back of `old` with its debt.
        let t = match existing.or_else(|| queue.activate(hash, tenant, weight, grant)) {
            Some(t) => t,
            // Unreachable: room was checked above.
            None => return Err(Rejected::ClassFull(item)),
        };
        queue.unpark(t);
        let Some(owner) = queue.tenant_mut(t) else {
            // Unreachable: `t` was just found or created.
            return Err(Rejected::ClassFull(item));
        };
        let prev = owner.tail;
        let key = match self.entries.insert(Entry {
            item,
            generation: 0,
            cost,
            tenant: t,
            prev,
            next: NONE,
            class,
        }) {
            Ok(key) => key,
            // Unreachable: room was checked above. A tenant activated for
            // this push is on `new` with nothing waiting; `pop` moves it on.
            Err(item) => return Err(Rejected::ClassFull(item)),
        };
        let was_empty = owner.len == 0;
        owner.weight = weight;
        owner.tail = key.index;
        owner.len += 1;
        if was_empty {
            owner.head = key.index;
        } else if let Some(last) = self.entries.get_mut(prev) {
            last.next = key.index;
        }
        queue.len += 1;
        queue.busy += usize::from(was_empty);
        self.len += 1;
        Ok(key)
    }

    /// Takes the next item to dispatch, or `None` if nothing is waiting.
    pub fn pop(&mut self) -> Option<Dispatched<T>> {
        let nonempty = CLASSES.map(|class| self.class_len(class) > 0);
        let class = self.picker.pick(nonempty)?;
        self.pop_class(class)
    }

    /// Takes the next item of `class` in DRR order, bypassing the choice
    /// between classes (for a caller that makes that choice itself, over
    /// several schedulers), or `None` if nothing of `class` is waiting.
    pub fn pop_class(&mut self, class: Priority) -> Option<Dispatched<T>> {
        let ci = class_index(class);
        let (item, tenant, cost) = self.classes[ci].pop(&mut self.entries, self.quantum)?;
        Some(self.dispatched(ci, item, tenant, cost))
    }

    /// [`Scheduler::pop_class`], letting `decide` pass over (or stop at) the
    /// tenant whose turn came: for a caller that can serve only some tenants
    /// now (one at its own cap of calls in flight, say). A skipped tenant
    /// loses its turn in this round, not its deficit. `None` when `decide`
    /// stops, or when it skipped every tenant with waiting items in a row
    /// (so a pop that can serve nobody ends). A pop that skips is O(skipped
    /// tenants) more than a plain one.
    pub fn pop_class_where(
        &mut self,
        class: Priority,
        decide: impl FnMut(&TenantId) -> Pick,
    ) -> Option<Dispatched<T>> {
        let ci = class_index(class);
        let (item, tenant, cost) =
            self.classes[ci].pop_where(&mut self.entries, self.quantum, decide)?;
        Some(self.dispatched(ci, item, tenant, cost))
    }

    /// Takes the next waiting item of `tenant` in `class`, whatever its
    /// place in the round: for an item a caller chose earlier (with a
    /// [`Pick::Stop`]) and can only now serve. Charged to the tenant's
    /// deficit as a pop is (floored at `-max_charge`, as for
    /// [`Scheduler::dispatch_direct`]), and counted in flight until
    /// [`Scheduler::complete`]. `None` if nothing of `tenant` waits in
    /// `class`.
    pub fn pop_tenant(&mut self, class: Priority, tenant: &TenantId) -> Option<Dispatched<T>> {
        let ci = class_index(class);
        let floor = self.max_charge.saturating_neg();
        let queue = &mut self.classes[ci];
        let (_, Some(t)) = queue.lookup(tenant) else {
            return None;
        };
        let head = queue.tenant(t)?.head;
        let cost = self.entries.get(head)?.cost;
        let owner = queue.tenant_mut(t)?;
        owner.deficit = owner.deficit.saturating_sub(cost).max(floor);
        owner.in_flight = owner.in_flight.saturating_add(1);
        let id = owner.id.clone();
        let entry = self.entries.take_at(head)?;
        queue.detach(&mut self.entries, head, &entry);
        queue.newcomer_served(t);
        Some(self.dispatched(ci, entry.item, id, cost))
    }

    /// The next waiting item of `tenant` in `class` (the one [`Scheduler::pop_tenant`]
    /// would take), without taking it.
    pub fn peek_tenant(&self, class: Priority, tenant: &TenantId) -> Option<&T> {
        let queue = &self.classes[class_index(class)];
        let (_, Some(t)) = queue.lookup(tenant) else {
            return None;
        };
        let head = queue.tenant(t)?.head;
        self.entries.get(head).map(|entry| &entry.item)
    }

    /// Charges a request that went out without waiting in the queue (there
    /// was room and nothing waited) to its tenant, and counts it in flight
    /// until [`Scheduler::complete`]: a tenant the class does not know
    /// starts from a deficit of 0, so it ends in debt and, if it queues
    /// while that request is in flight, it joins `old`, not `new`. Returns
    /// the charged cost. The deficit never goes below `-max_charge`.
    ///
    /// `None` if the class is at its tenant capacity (see the module doc):
    /// then nothing is recorded, and the request must not be completed.
    pub fn dispatch_direct(
        &mut self,
        class: Priority,
        tenant: TenantId,
        weight: u32,
        cost: u64,
    ) -> Option<u64> {
        let weight = weight.max(1);
        let cost = self.charge(cost);
        let floor = self.max_charge.saturating_neg();
        let queue = &mut self.classes[class_index(class)];
        let t = match queue.lookup(&tenant) {
            (_, Some(t)) => Some(t),
            (hash, None) => queue
                .insert(hash, tenant, weight, 0)
                .inspect(|_| queue.parked += 1),
        };
        let owner = t.and_then(|t| queue.tenant_mut(t))?;
        owner.weight = weight;
        owner.deficit = owner.deficit.saturating_sub(cost).max(floor);
        owner.in_flight = owner.in_flight.saturating_add(1);
        Some(cost.unsigned_abs())
    }

    /// A request of `tenant` in `class`, dispatched by [`Scheduler::pop`] or
    /// [`Scheduler::dispatch_direct`], completed. A tenant is remembered, with
    /// its deficit, while it has items waiting or in flight, so every
    /// dispatch and settlement reaches it; each dispatch must be completed
    /// exactly once, or its tenant stays in memory.
    pub fn complete(&mut self, class: Priority, tenant: &TenantId) {
        self.classes[class_index(class)].complete(tenant);
    }

    /// Takes out a still-waiting item (its waiter went away). `None` if the
    /// key's item was already popped or removed.
    pub fn remove(&mut self, key: Key) -> Option<T> {
        let entry = self.entries.take(key)?;
        let ci = class_index(entry.class);
        let queue = self.classes.get_mut(ci)?;
        queue.detach(&mut self.entries, key.index, &entry);
        self.removed(ci);
        Some(entry.item)
    }

    /// The still-waiting item of `key`, mutably (e.g. to update its waker). `None` once it
    /// was popped or removed.
    pub fn get_mut(&mut self, key: Key) -> Option<&mut T> {
        self.entries
            .get_mut(key.index)
            .filter(|entry| entry.generation == key.generation)
            .map(|entry| &mut entry.item)
    }

    /// Every still-waiting item, mutably, in no particular order (e.g. to wake them all).
    pub fn items_mut(&mut self) -> impl Iterator<Item = &mut T> {
        self.entries
            .slots
            .iter_mut()
            .flatten()
            .map(|entry| &mut entry.item)
    }

    /// Settles a dispatched request once its real usage is known: charges
    /// (`actual > estimated`) or refunds the difference of the charged costs
    /// to the tenant's deficit, if `class` still knows the tenant (items
    /// waiting or in flight, or emptied less than a round ago; see the module
    /// doc). Refunds never lift the deficit above one `quantum × weight`, nor
    /// a parked tenant's above 0 (it banks no credit); charges never push it
    /// below `-max_charge`. Forgotten tenants are ignored.
    pub fn settle(&mut self, class: Priority, tenant: &TenantId, estimated: u64, actual: u64) {
        let (estimated, actual) = (self.charge(estimated), self.charge(actual));
        let (quantum, floor) = (self.quantum, self.max_charge.saturating_neg());
        let queue = &mut self.classes[class_index(class)];
        let (_, Some(t)) = queue.lookup(tenant) else {
            return;
        };
        let Some(tenant) = queue.tenant_mut(t) else {
            return;
        };
        if actual > estimated {
            tenant.deficit = tenant.deficit.saturating_sub(actual - estimated).max(floor);
        } else {
            let cap = match tenant.list {
                Some(_) => quantum.saturating_mul(i64::from(tenant.weight)),
                None => 0,
            };
            if tenant.deficit < cap {
                tenant.deficit = tenant.deficit.saturating_add(estimated - actual).min(cap);
            }
        }
    }

    /// Number of waiting items.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is waiting.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Number of waiting items in `class`.
    pub fn class_len(&self, class: Priority) -> usize {
        self.classes[class_index(class)].len
    }

    /// Number of `tenant`'s waiting items in `class`.
    pub fn tenant_len(&self, class: Priority, tenant: &TenantId) -> usize {
        let queue = &self.classes[class_index(class)];
        match queue.lookup(tenant) {
            (_, Some(t)) => queue.tenant(t).map_or(0, |t| t.len as usize),
            _ => 0,
        }
    }

    /// The tenants with waiting items in `class`, in no particular order.
    pub fn waiting_tenants(&self, class: Priority) -> impl Iterator<Item = &TenantId> {
        self.classes[class_index(class)]
            .tenants
            .iter()
            .flatten()
            .filter(|t| t.len > 0)
            .map(|t| &t.id)
    }

    /// Number of tenants with waiting items in `class`. A tenant that emptied
    /// less than a round ago is still listed (with its deficit, see the
    /// module doc) but is not counted: it has nothing waiting.
    pub fn active_tenants(&self, class: Priority) -> usize {
        self.classes[class_index(class)].busy
    }

    /// An item of class `ci` was popped for `tenant` at `cost`: counted out, and handed out.
    fn dispatched(&mut self, ci: usize, item: T, tenant: TenantId, cost: i64) -> Dispatched<T> {
        self.removed(ci);
        Dispatched {
            item,
            class: CLASSES[ci],
            tenant,
            cost: cost.unsigned_abs(),
        }
    }

    /// An item of class `ci` left the queue.
    fn removed(&mut self, ci: usize) {
        self.len = self.len.saturating_sub(1);
        if let Some(queue) = self.classes.get_mut(ci)
            && queue.len == 0
        {
            queue.drained();
            // A class that empties banks no round-robin credit.
            self.picker.forget(CLASSES[ci]);
        }
        if self.len == 0 {
            self.entries.reset();
        }
    }
}

/// Chooses the next class among those that may go: nginx's smooth weighted
/// round robin, or a random draw by weight (seeded). Used by
/// [`Scheduler::pop`], and by a caller that picks over several schedulers
/// (the layer keeps one per tier) with [`Scheduler::pop_class`].
#[derive(Clone, Debug)]
pub(crate) struct ClassPicker {
    weights: [u64; 3],
    selection: ClassSelection,
    /// Smooth weighted round robin credit of each class.
    current: [i64; 3],
    rng: Rng,
}

impl ClassPicker {
    pub(crate) fn new(config: &SchedulerConfig) -> Self {
        let rng = match config.selection {
            ClassSelection::Probabilistic { seed } => Rng::seeded(seed),
            ClassSelection::SmoothWeighted => Rng::seeded(0),
        };
        ClassPicker {
            weights: config.class_weights.as_array(),
            selection: config.selection,
            current: [0; 3],
            rng,
        }
    }

    /// The class to serve next among `candidates` (indexed critical,
    /// standard, batch), or `None` if there is none.
    pub(crate) fn pick(&mut self, candidates: [bool; 3]) -> Option<Priority> {
        let weights = self.weights;
        let total: u64 = (0..3).filter(|&i| candidates[i]).map(|i| weights[i]).sum();
        if total == 0 {
            return None;
        }
        let chosen = match self.selection {
            ClassSelection::SmoothWeighted => {
                let mut best: Option<usize> = None;
                for i in (0..3).filter(|&i| candidates[i]) {
                    self.current[i] = self.current[i].saturating_add(clamp_i64(weights[i]));
                    // Strict `>`: ties go to the higher priority.
                    if best.is_none_or(|b| self.current[i] > self.current[b]) {
                        best = Some(i);
                    }
                }
                let chosen = best?;
                self.current[chosen] = self.current[chosen].saturating_sub(clamp_i64(total));
                chosen
            }
            ClassSelection::Probabilistic { .. } => {
                // Multiply-shift maps 64 random bits onto 0..total.
                let draw = u128::from(self.rng.next_u64()) * u128::from(total);
                let mut point = u64::try_from(draw >> 64).unwrap_or(0);
                let mut chosen = None;
                for i in (0..3).filter(|&i| candidates[i]) {
                    if point < weights[i] {
                        chosen = Some(i);
                        break;
                    }
                    point -= weights[i];
                }
                chosen?
            }
        };
        Some(CLASSES[chosen])
    }

    /// `class` has nothing waiting: it banks no credit.
    pub(crate) fn forget(&mut self, class: Priority) {
        self.current[class_index(class)] = 0;
    }
}

/// Jain's fairness index `(Σx)² / (n·Σx²)`: 1.0 when all values are equal,
/// `1/n` when one of `n` gets everything. `None` for no values, all zeros,
/// or a non-finite result.
pub fn jain_index(values: impl IntoIterator<Item = f64>) -> Option<f64> {
    let (mut n, mut sum, mut squares) = (0.0_f64, 0.0_f64, 0.0_f64);
    for x in values {
        n += 1.0;
        sum += x;
        squares += x * x;
    }
    if n == 0.0 || squares == 0.0 {
        return None;
    }
    let index = sum * sum / (n * squares);
    index.is_finite().then_some(index)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::{HashMap, HashSet, VecDeque};

    fn tid(name: &str) -> TenantId {
        TenantId::new(name)
    }

    fn scheduler<T>(config: SchedulerConfig) -> Scheduler<T> {
        Scheduler::new(config).expect("valid config")
    }

    fn ceil_div(a: u64, b: u64) -> u64 {
        a.div_ceil(b)
    }

    /// Equal costs, quantum = cost: plain round robin when nobody is skipped.
    fn round_robin(tenants: &[&str], each: usize) -> Scheduler<(String, usize)> {
        let mut s = scheduler(SchedulerConfig::default().with_quantum(10));
        for i in 0..each {
            for name in tenants {
                s.push(Priority::Standard, tid(name), 1, 10, (name.to_string(), i))
                    .unwrap();
            }
        }
        s
    }

    #[test]
    fn skipped_tenant_loses_its_turn_not_its_place_in_the_queue() {
        let mut s = round_robin(&["a", "b", "c"], 2);
        let order: Vec<String> = std::iter::from_fn(|| {
            s.pop_class_where(Priority::Standard, |t| match t.as_str() {
                "a" => Pick::Skip,
                _ => Pick::Take,
            })
            .map(|d| d.tenant.as_str().to_owned())
        })
        .collect();
        assert_eq!(order, ["b", "c", "b", "c"]);
        // Only the skipped tenant is left, and a pop that can serve nobody ends.
        assert_eq!(s.len(), 2);
        assert!(
            s.pop_class_where(Priority::Standard, |_| Pick::Skip)
                .is_none()
        );
        // Its items come out in order once it may go.
        let next = s.pop_class(Priority::Standard).unwrap();
        assert_eq!((next.tenant, next.item.1), (tid("a"), 0));
    }

    #[test]
    fn stop_leaves_the_tenant_first_and_pop_tenant_serves_it() {
        let mut s = round_robin(&["a", "b"], 2);
        let mut first = None;
        let none = s.pop_class_where(Priority::Standard, |t| {
            first = Some(t.clone());
            Pick::Stop
        });
        assert!(none.is_none());
        assert_eq!(first, Some(tid("a")));
        assert_eq!(s.len(), 4);
        let served = s.pop_tenant(Priority::Standard, &tid("a")).unwrap();
        assert_eq!((served.tenant.clone(), served.item.1), (tid("a"), 0));
        // The round goes on as if `a` had been popped.
        let next = s.pop_class(Priority::Standard).unwrap();
        assert_eq!(next.tenant, tid("b"));
        assert!(s.pop_tenant(Priority::Batch, &tid("a")).is_none());
        assert!(s.pop_tenant(Priority::Standard, &tid("z")).is_none());
        s.complete(Priority::Standard, &tid("a"));
        s.complete(Priority::Standard, &tid("b"));
    }

    impl<T> Scheduler<T> {
        fn deficit_of(&self, class: Priority, tenant: &TenantId) -> Option<i64> {
            let queue = &self.classes[class_index(class)];
            let t = queue.lookup(tenant).1?;
            queue.tenant(t).map(|x| x.deficit)
        }

        fn take_trace(&mut self, class: Priority) -> Vec<Visit> {
            std::mem::take(&mut self.classes[class_index(class)].trace)
        }

        /// The list `tenant` is on in `class`, `None` if it is not listed.
        fn list_of(&self, class: Priority, tenant: &TenantId) -> Option<ListKind> {
            let queue = &self.classes[class_index(class)];
            queue.tenant(queue.lookup(tenant).1?)?.list
        }

        fn in_flight_of(&self, class: Priority, tenant: &TenantId) -> Option<u32> {
            let queue = &self.classes[class_index(class)];
            queue.tenant(queue.lookup(tenant).1?).map(|x| x.in_flight)
        }

        /// Whether `tenant` is known in `class` but on no list (parked).
        fn is_parked(&self, class: Priority, tenant: &TenantId) -> bool {
            let queue = &self.classes[class_index(class)];
            queue
                .lookup(tenant)
                .1
                .and_then(|t| queue.tenant(t))
                .is_some_and(|x| x.list.is_none())
        }

        /// Pops and completes at once, as if every request finished instantly.
        fn pop_done(&mut self) -> Option<Dispatched<T>> {
            let d = self.pop()?;
            self.complete(d.class, &d.tenant);
            Some(d)
        }

        /// Internal consistency: lists, slabs and counts agree.
        fn check_invariants(&self) {
            let mut total = 0;
            for (class, queue) in self.classes.iter().enumerate() {
                let (mut seen, mut busy, mut items) = (0, 0, 0);
                for (kind, list) in [(ListKind::New, queue.new), (ListKind::Old, queue.old)] {
                    let mut cursor = list.head;
                    let mut prev = NONE;
                    while cursor != NONE {
                        let t = cursor;
                        let tenant = queue.tenant(t).expect("listed tenant exists");
                        assert_eq!(tenant.prev, prev);
                        assert_eq!(tenant.list, Some(kind));
                        assert!(
                            tenant.len > 0 || kind == ListKind::Old,
                            "only `old` holds empty tenants"
                        );
                        busy += usize::from(tenant.len > 0);
                        assert_eq!(queue.lookup(&tenant.id).1, Some(t));
                        let (mut e, mut last) = (tenant.head, NONE);
                        let mut count = 0;
                        while e != NONE {
                            let entry = self.entries.get(e).expect("entry exists");
                            assert_eq!(entry.tenant, t);
                            assert_eq!(entry.class, CLASSES[class]);
                            if e != tenant.head {
                                // A head's `prev` may be stale; no other's.
                                assert_eq!(entry.prev, last);
                            }
                            count += 1;
                            last = e;
                            e = entry.next;
                        }
                        assert_eq!(tenant.tail, last);
                        assert_eq!(count, tenant.len as usize);
                        items += count;
                        seen += 1;
                        prev = cursor;
                        cursor = tenant.next;
                    }
                    assert_eq!(list.tail, prev);
                }
                let parked: Vec<&Tenant> = queue
                    .tenants
                    .iter()
                    .flatten()
                    .filter(|x| x.list.is_none())
                    .collect();
                for tenant in &parked {
                    assert_eq!(tenant.len, 0, "a parked tenant has nothing waiting");
                    assert!(tenant.in_flight > 0, "a parked tenant has work in flight");
                    assert!(tenant.deficit <= 0, "a parked tenant banks no credit");
                }
                assert_eq!(parked.len(), queue.parked);
                assert_eq!(seen + parked.len(), queue.index.len());
                assert_eq!(seen + parked.len(), queue.tenants.iter().flatten().count());
                assert_eq!(busy, queue.busy);
                assert_eq!(items, queue.len);
                if queue.len == 0 {
                    assert_eq!(seen, 0, "a drained class lists nobody");
                }
                total += items;
            }
            assert_eq!(total, self.len);
            assert_eq!(self.entries.slots.iter().flatten().count(), self.len);
        }
    }

    fn tenant_number(id: &TenantId) -> usize {
        id.as_str()[1..].parse().expect("test tenant name")
    }

    // ---------- proptests ----------

    #[derive(Clone, Debug)]
    enum Op {
        Push {
            class: usize,
            tenant: usize,
            cost: u64,
        },
        Pop,
        Remove(prop::sample::Index),
        /// One dispatched request completes.
        Complete(prop::sample::Index),
        /// One dispatched request is settled at `actual` tokens.
        Settle(prop::sample::Index, u64),
        /// A request goes out without queueing.
        Direct {
            class: usize,
            tenant: usize,
            cost: u64,
        },
    }

    fn ops(tenants: usize) -> impl Strategy<Value = Vec<Op>> {
        prop::collection::vec(
            prop_oneof![
                4 => (0..3usize, 0..tenants, 1..=40_000u64)
                    .prop_map(|(class, tenant, cost)| Op::Push { class, tenant, cost }),
                3 => Just(Op::Pop),
                2 => any::<prop::sample::Index>().prop_map(Op::Remove),
                2 => any::<prop::sample::Index>().prop_map(Op::Complete),
                1 => (any::<prop::sample::Index>(), 1..=100_000u64)
                    .prop_map(|(index, actual)| Op::Settle(index, actual)),
                1 => (0..3usize, 0..tenants, 1..=40_000u64)
                    .prop_map(|(class, tenant, cost)| Op::Direct { class, tenant, cost }),
            ],
            1..250,
        )
    }

    fn tenants_and_ops() -> impl Strategy<Value = (Vec<u32>, Vec<Op>)> {
        (2..=5usize).prop_flat_map(|n| (prop::collection::vec(1..=4u32, n), ops(n)))
    }

    struct VisitState {
        waiting: Vec<usize>,
        topups: Vec<u64>,
        fresh: Vec<bool>,
        /// Tenants of the requests popped and not completed yet.
        in_flight: Vec<usize>,
    }

    impl VisitState {
        fn pop_and_check(
            &mut self,
            s: &mut Scheduler<()>,
            weights: &[u32],
            quantum: u64,
            quanta: u32,
        ) -> Result<(), TestCaseError> {
            let Some(d) = s.pop() else { return Ok(()) };
            let x = tenant_number(&d.tenant);
            self.waiting[x] -= 1;
            self.in_flight.push(x);
            for visit in s.take_trace(Priority::Standard) {
                match visit {
                    Visit::TopUp(t) => self.topups[tenant_number(&t)] += 1,
                    Visit::Dispatch(t) => {
                        let t = tenant_number(&t);
                        prop_assert_eq!(t, x);
                        let per_visit = quantum * u64::from(weights[t]);
                        // A top-up ends a turn of the tenant at the head of
                        // its list. From a deficit >= 0 the item needs at
                        // most ceil(c / (quantum × weight)) top-ups, each one
                        // turn: an item that reached its tenant's head as
                        // its predecessor went out leaves within that many
                        // new turns. A newcomer's grant is its first top-up,
                        // so its first item needs one fewer. A tenant that
                        // came back to its listed, empty queue gets no fresh
                        // grant (DRR++), so its first turn may be spent on
                        // that top-up: ceil(c / (quantum × weight)) + 1 turns.
                        let needed = ceil_div(d.cost, per_visit);
                        let allowed = needed - u64::from(self.fresh[t]);
                        prop_assert!(
                            self.topups[t] <= allowed,
                            "{} top-ups > {allowed} (cost {}, fresh {})",
                            self.topups[t],
                            d.cost,
                            self.fresh[t]
                        );
                        prop_assert!(self.topups[t] <= u64::from(quanta));
                        self.topups[t] = 0;
                        self.fresh[t] = false;
                    }
                    Visit::Forget(_) => {}
                }
            }
            Ok(())
        }
    }

    proptest! {
        #[test]
        fn every_item_is_popped_or_removed_exactly_once_in_fifo_order(
            (weights, ops) in tenants_and_ops()
        ) {
            let mut s = scheduler(SchedulerConfig::default());
            // Compact on (nearly) every drain, to check it against the model.
            for queue in &mut s.classes {
                queue.compact_above = 1;
            }
            let max_charge = s.config().max_charge();
            let mut model: HashMap<(usize, usize), VecDeque<(u64, u64)>> = HashMap::new();
            let mut keys: Vec<(Key, u64, usize, usize)> = Vec::new();
            let (mut popped, mut removed) = (HashSet::new(), HashSet::new());
            let mut flights: Vec<(Priority, TenantId, u64)> = Vec::new();
            let mut check = |s: &mut Scheduler<u64>, d: Dispatched<u64>,
                             model: &mut HashMap<(usize, usize), VecDeque<(u64, u64)>>| {
                let slot = (class_index(d.class), tenant_number(&d.tenant));
                let front = model.get_mut(&slot).and_then(VecDeque::pop_front);
                prop_assert_eq!(front.map(|(id, _)| id), Some(d.item), "fifo within tenant");
                prop_assert_eq!(front.map(|(_, c)| c.min(max_charge)), Some(d.cost));
                prop_assert!(popped.insert(d.item), "popped once");
                s.check_invariants();
                Ok(())
            };
            for (next_id, op) in ops.into_iter().enumerate() {
                let next_id = next_id as u64;
                match op {
                    Op::Push { class, tenant, cost } => {
                        let key = s
                            .push(CLASSES[class], tid(&format!("t{tenant}")), weights[tenant], cost, next_id)
                            .map_err(|_| TestCaseError::fail("no limits configured"))?;
                        model.entry((class, tenant)).or_default().push_back((next_id, cost));
                        keys.push((key, next_id, class, tenant));
                    }
                    Op::Pop => match s.pop() {
                        Some(d) => {
                            flights.push((d.class, d.tenant.clone(), d.cost));
                            check(&mut s, d, &mut model)?;
                        }
                        None => prop_assert!(model.values().all(VecDeque::is_empty)),
                    },
                    Op::Complete(index) => {
                        if !flights.is_empty() {
                            let picked = index.index(flights.len());
                            let (class, tenant, _) = flights.swap_remove(picked);
                            s.complete(class, &tenant);
                        }
                    }
                    Op::Settle(index, actual) => {
                        if !flights.is_empty() {
                            let (class, tenant, cost) = &flights[index.index(flights.len())];
                            s.settle(*class, tenant, *cost, actual);
                        }
                    }
                    Op::Direct { class, tenant, cost } => {
                        let id = tid(&format!("t{tenant}"));
                        let charged = s
                            .dispatch_direct(CLASSES[class], id.clone(), weights[tenant], cost)
                            .ok_or_else(|| TestCaseError::fail("no capacity limit"))?;
                        prop_assert_eq!(charged, cost.min(max_charge));
                        let deficit = s.deficit_of(CLASSES[class], &id);
                        let floor = -i64::try_from(max_charge).unwrap_or(i64::MAX);
                        prop_assert!(deficit.is_some_and(|d| d >= floor));
                        flights.push((CLASSES[class], id, charged));
                    }
                    Op::Remove(index) => {
                        if keys.is_empty() {
                            continue;
                        }
                        let (key, id, class, tenant) = keys[index.index(keys.len())];
                        let queue = model.entry((class, tenant)).or_default();
                        let expected = queue.iter().position(|&(x, _)| x == id);
                        let got = s.remove(key);
                        match expected {
                            Some(pos) => {
                                queue.remove(pos);
                                prop_assert_eq!(got, Some(id));
                                prop_assert!(removed.insert(id));
                            }
                            None => prop_assert_eq!(got, None),
                        }
                    }
                }
                s.check_invariants();
                // A tenant with requests in flight is known, with its exact count.
                for (class, tenant, _) in &flights {
                    let expected =
                        flights.iter().filter(|f| (&f.0, &f.1) == (class, tenant)).count();
                    prop_assert_eq!(s.in_flight_of(*class, tenant), Some(expected as u32));
                }
                let waiting: usize = model.values().map(VecDeque::len).sum();
                prop_assert_eq!(s.len(), waiting);
                for (ci, class) in CLASSES.into_iter().enumerate() {
                    let items: usize = model.iter().filter(|(k, _)| k.0 == ci).map(|(_, q)| q.len()).sum();
                    let active = model.iter().filter(|(k, q)| k.0 == ci && !q.is_empty()).count();
                    prop_assert_eq!(s.class_len(class), items);
                    prop_assert_eq!(s.active_tenants(class), active);
                }
            }
            while let Some(d) = s.pop() {
                flights.push((d.class, d.tenant.clone(), d.cost));
                check(&mut s, d, &mut model)?;
            }
            prop_assert!(s.is_empty());
            prop_assert!(popped.is_disjoint(&removed));
            prop_assert_eq!(popped.len() + removed.len(), keys.len());
            for class in CLASSES {
                prop_assert_eq!(s.active_tenants(class), 0);
            }
            // Nothing waiting and, once every dispatch completed, nothing in
            // flight: no tenant state is left.
            for (class, tenant, _) in flights {
                s.complete(class, &tenant);
                s.check_invariants();
            }
            for queue in &s.classes {
                prop_assert!(queue.index.len() == 0 && queue.tenants.is_empty());
            }
        }

        #[test]
        fn two_backlogged_tenants_stay_within_quantum_plus_max_charge(
            costs_a in prop::collection::vec(1..=40_000u64, 1..80),
            costs_b in prop::collection::vec(1..=40_000u64, 1..80),
            w_a in 1..=4u32,
            w_b in 1..=4u32,
            order in prop::collection::vec(any::<bool>(), 160),
            quantum in prop_oneof![Just(1_000u64), Just(5_000), Just(20_000)],
            quanta in 1..=4u32,
        ) {
            let config = SchedulerConfig::default().with_quantum(quantum).with_max_charge_quanta(quanta);
            let bound = i128::from(quantum + config.max_charge());
            let mut s = scheduler(config);
            let (mut ia, mut ib) = (0, 0);
            for take_a in order.into_iter().chain(std::iter::repeat_n(true, 160)) {
                if take_a && ia < costs_a.len() {
                    s.push(Priority::Standard, tid("a"), w_a, costs_a[ia], ()).ok();
                    ia += 1;
                } else if ib < costs_b.len() {
                    s.push(Priority::Standard, tid("b"), w_b, costs_b[ib], ()).ok();
                    ib += 1;
                }
            }
            prop_assert_eq!(s.len(), costs_a.len() + costs_b.len());
            let (mut left_a, mut left_b) = (costs_a.len(), costs_b.len());
            let (mut served_a, mut served_b) = (0i128, 0i128);
            while left_a > 0 && left_b > 0 {
                let d = s.pop().ok_or_else(|| TestCaseError::fail("items waiting"))?;
                if d.tenant.as_str() == "a" {
                    served_a += i128::from(d.cost);
                    left_a -= 1;
                } else {
                    served_b += i128::from(d.cost);
                    left_b -= 1;
                }
                // |sa/wa - sb/wb| < q + max_charge, cross-multiplied.
                let (wa, wb) = (i128::from(w_a), i128::from(w_b));
                prop_assert!((served_a * wb - served_b * wa).abs() < bound * wa * wb,
                    "served a={served_a} b={served_b}");
            }
        }

        #[test]
        fn item_is_dispatched_within_its_top_up_bound(
            weights in prop::collection::vec(1..=4u32, 2..=5),
            steps in prop::collection::vec((0..3u8, any::<prop::sample::Index>(), 1..=40_000u64), 1..300),
            quantum in prop_oneof![Just(1_000u64), Just(5_000)],
            quanta in 1..=4u32,
        ) {
            let config = SchedulerConfig::default().with_quantum(quantum).with_max_charge_quanta(quanta);
            let mut s = scheduler(config);
            let n = weights.len();
            let mut state = VisitState {
                waiting: vec![0; n],
                topups: vec![0; n],
                fresh: vec![false; n],
                in_flight: Vec::new(),
            };
            for (op, who, cost) in steps {
                match op {
                    0 => {
                        let t = who.index(n);
                        if state.waiting[t] == 0 {
                            // Fresh grant only if forgotten; a tenant that emptied
                            // less than a round ago, or is parked with requests in
                            // flight, keeps its deficit (>= 0 here).
                            state.topups[t] = 0;
                            let id = tid(&format!("t{t}"));
                            state.fresh[t] = s.deficit_of(Priority::Standard, &id).is_none();
                        }
                        state.waiting[t] += 1;
                        s.push(Priority::Standard, tid(&format!("t{t}")), weights[t], cost, ()).ok();
                    }
                    1 => state.pop_and_check(&mut s, &weights, quantum, quanta)?,
                    _ => {
                        if !state.in_flight.is_empty() {
                            let t = state.in_flight.swap_remove(who.index(state.in_flight.len()));
                            s.complete(Priority::Standard, &tid(&format!("t{t}")));
                        }
                    }
                }
            }
            while !s.is_empty() {
                state.pop_and_check(&mut s, &weights, quantum, quanta)?;
            }
        }

        #[test]
        fn batch_wait_stays_bounded_when_other_classes_come_and_go(
            critical in 1..=300u32,
            standard in 1..=300u32,
            batch in 1..=300u32,
            steps in prop::collection::vec(0..4u8, 1..600),
        ) {
            let weights = ClassWeights { critical, standard, batch };
            let total = u64::from(critical) + u64::from(standard) + u64::from(batch);
            let limit = 2 * ceil_div(total, u64::from(batch));
            let mut s = scheduler(SchedulerConfig::default().with_class_weights(weights));
            for _ in 0..steps.len() {
                s.push(Priority::Batch, tid("b"), 1, 1, ()).ok();
            }
            let mut waited = 0u64;
            for step in steps {
                match step {
                    0 => { s.push(Priority::Critical, tid("c"), 1, 1, ()).ok(); }
                    1 => { s.push(Priority::Standard, tid("s"), 1, 1, ()).ok(); }
                    _ => {
                        let d = s.pop().ok_or_else(|| TestCaseError::fail("batch backlogged"))?;
                        if d.class == Priority::Batch {
                            waited = 0;
                        } else {
                            waited += 1;
                            prop_assert!(waited < limit, "batch waited {waited}");
                        }
                    }
                }
            }
        }

        /// Newcomer starvation (`ARCHITECTURE.md`, "Newcomers"). Tenant `h` is
        /// backlogged; after every pop one of `n` light tenants with nothing
        /// waiting (brand-new on its first push, else one that emptied
        /// earlier and may still be listed) pushes one item, unless the
        /// script skips. Every item costs exactly its tenant's
        /// `quantum × weight`, so a deficit is always 0 or one grant. Proven
        /// bounds: `h` is served at least once in every `2n + 1` consecutive
        /// pops, and after `P` pops it has had at least `(P - 2n) / (n + 1)`
        /// of them. (With newcomer priority on every return, `h` got none.)
        #[test]
        fn old_tenant_is_not_starved_by_a_stream_of_newcomers(
            light_weights in prop::collection::vec(1..=4u32, 1..=6),
            heavy_weight in 1..=4u32,
            script in prop::collection::vec(
                (prop::option::weighted(0.9, any::<prop::sample::Index>()), any::<bool>()),
                1..400,
            ),
            quantum in prop_oneof![Just(1_000u64), Just(5_000)],
        ) {
            let class = Priority::Standard;
            // Requests in flight; the script completes them all at some steps,
            // so light tenants are forgotten and come back through `new`, and
            // at others leaves them running, so they are parked.
            let mut in_flight: Vec<TenantId> = Vec::new();
            let n = light_weights.len();
            let n64 = n as u64;
            let mut s = scheduler(SchedulerConfig::default().with_quantum(quantum));
            let heavy = tid("h");
            for _ in 0..=script.len() {
                s.push(class, heavy.clone(), heavy_weight, quantum * u64::from(heavy_weight), ())
                    .ok();
            }
            let mut waiting = vec![false; n];
            let (mut pops, mut heavy_pops, mut since_heavy) = (0u64, 0u64, 0u64);
            for (choice, complete) in script {
                let d = s.pop().ok_or_else(|| TestCaseError::fail("h is backlogged"))?;
                in_flight.push(d.tenant.clone());
                if complete {
                    for tenant in in_flight.drain(..) {
                        s.complete(class, &tenant);
                    }
                }
                pops += 1;
                if d.tenant == heavy {
                    heavy_pops += 1;
                    since_heavy = 0;
                } else {
                    waiting[tenant_number(&d.tenant)] = false;
                    since_heavy += 1;
                }
                prop_assert!(since_heavy <= 2 * n64, "h waited {since_heavy} pops, n = {n}");
                prop_assert!(
                    (n64 + 1) * heavy_pops + 2 * n64 >= pops,
                    "h served {heavy_pops} of {pops} pops, n = {n}"
                );
                if let Some(index) = choice {
                    let idle: Vec<usize> = (0..n).filter(|&i| !waiting[i]).collect();
                    if !idle.is_empty() {
                        let x = idle[index.index(idle.len())];
                        let weight = light_weights[x];
                        s.push(class, tid(&format!("l{x}")), weight, quantum * u64::from(weight), ())
                            .ok();
                        waiting[x] = true;
                    }
                }
            }
        }
    }

    // ---------- class selection ----------

    fn backlogged_all_classes(config: SchedulerConfig, per_class: usize) -> Scheduler<()> {
        let mut s = scheduler(config);
        for class in CLASSES {
            for _ in 0..per_class {
                s.push(class, tid("t"), 1, 1, ()).ok();
            }
        }
        s
    }

    fn shares(s: &mut Scheduler<()>, pops: usize) -> [f64; 3] {
        let mut counts = [0usize; 3];
        for _ in 0..pops {
            let d = s.pop().expect("backlogged");
            counts[class_index(d.class)] += 1;
        }
        counts.map(|c| c as f64 / pops as f64)
    }

    #[test]
    fn class_shares_match_weights_within_two_points() {
        let mut s = backlogged_all_classes(SchedulerConfig::default(), 10_000);
        let got = shares(&mut s, 10_000);
        for (share, want) in got
            .into_iter()
            .zip([270.0 / 300.0, 25.0 / 300.0, 5.0 / 300.0])
        {
            assert!((share - want).abs() < 0.02, "share {share} want {want}");
        }
    }

    #[test]
    fn batch_waits_at_most_total_over_batch_weight_dispatches() {
        let limit = 300_u64.div_ceil(5);
        let mut s = backlogged_all_classes(SchedulerConfig::default(), 10_000);
        let (mut waited, mut worst) = (0u64, 0u64);
        // The schedule repeats every 300 dispatches, so this covers all states.
        for _ in 0..10_000 {
            if s.pop().expect("backlogged").class == Priority::Batch {
                waited = 0;
            } else {
                waited += 1;
                worst = worst.max(waited);
            }
        }
        assert!(worst <= limit, "batch waited {worst} > {limit}");
    }

    #[test]
    fn batch_never_starves_under_steady_standard_inflow() {
        let mut s = scheduler(SchedulerConfig::default());
        for i in 0..5_000 {
            s.push(Priority::Critical, tid(&format!("c{}", i % 7)), 1, 1, ())
                .ok();
            s.push(Priority::Batch, tid("b"), 1, 1, ()).ok();
        }
        let (mut waited, mut worst, mut batch) = (0u64, 0u64, 0usize);
        for i in 0..3_000 {
            // Standard never runs dry: one new request after every pop.
            s.push(Priority::Standard, tid(&format!("s{}", i % 3)), 1, 1, ())
                .ok();
            if s.pop().expect("backlogged").class == Priority::Batch {
                batch += 1;
                waited = 0;
            } else {
                waited += 1;
                worst = worst.max(waited);
            }
        }
        assert!(worst <= 60, "batch waited {worst}");
        assert!(batch >= 3_000 * 5 / 300 - 1, "batch served {batch}");
    }

    #[test]
    fn probabilistic_selection_is_deterministic_per_seed_and_close_to_weights() {
        let run = |seed| {
            let config =
                SchedulerConfig::default().with_selection(ClassSelection::Probabilistic { seed });
            let mut s = backlogged_all_classes(config, 10_000);
            (0..10_000)
                .map(|_| s.pop().expect("backlogged").class)
                .collect::<Vec<_>>()
        };
        let first = run(42);
        assert_eq!(first, run(42));
        assert_ne!(first, run(43));
        let mut counts = [0usize; 3];
        for class in &first {
            counts[class_index(*class)] += 1;
        }
        for (count, want) in counts.into_iter().zip([0.9, 25.0 / 300.0, 5.0 / 300.0]) {
            let share = count as f64 / 10_000.0;
            assert!((share - want).abs() < 0.02, "share {share} want {want}");
        }
        // Empty classes are never chosen.
        let config =
            SchedulerConfig::default().with_selection(ClassSelection::Probabilistic { seed: 7 });
        let mut s = scheduler(config);
        for _ in 0..100 {
            s.push(Priority::Batch, tid("b"), 1, 1, ()).ok();
        }
        assert!((0..100).all(|_| s.pop().map(|d| d.class) == Some(Priority::Batch)));
        assert!(s.pop().is_none());
    }

    // ---------- inside a class ----------

    #[test]
    fn paid_tier_weight_three_is_served_three_to_one() {
        let mut s = scheduler(SchedulerConfig::default());
        for _ in 0..1_000 {
            s.push(Priority::Standard, tid("paid"), 3, 1_000, ()).ok();
            s.push(Priority::Standard, tid("free"), 1, 1_000, ()).ok();
        }
        let (mut paid, mut free) = (0u64, 0u64);
        for _ in 0..1_000 {
            let d = s.pop().expect("backlogged");
            match d.tenant.as_str() {
                "paid" => paid += d.cost,
                _ => free += d.cost,
            }
        }
        let ratio = paid as f64 / free as f64;
        assert!((ratio - 3.0).abs() < 0.09, "ratio {ratio}");
    }

    #[test]
    fn newcomer_goes_out_at_next_pop() {
        // quantum == cost: A's deficit is spent by each dispatch, so B's
        // item is the very next pop.
        let mut s = scheduler(SchedulerConfig::default());
        for _ in 0..100 {
            s.push(Priority::Standard, tid("a"), 1, 5_000, ()).ok();
        }
        assert_eq!(s.pop().expect("waiting").tenant, tid("a"));
        s.push(Priority::Standard, tid("b"), 1, 5_000, ()).ok();
        assert_eq!(s.pop().expect("waiting").tenant, tid("b"));

        // General case: A keeps the head while its remaining deficit covers
        // its next item (floor(deficit / cost) more pops), then B, whose
        // fresh quantum covers an item of cost <= quantum.
        let mut s = scheduler(SchedulerConfig::default());
        for _ in 0..100 {
            s.push(Priority::Standard, tid("a"), 1, 2_000, ()).ok();
        }
        assert_eq!(s.pop().expect("waiting").tenant, tid("a"));
        let left = s.deficit_of(Priority::Standard, &tid("a")).expect("active");
        assert_eq!(left, 3_000);
        s.push(Priority::Standard, tid("b"), 1, 5_000, ()).ok();
        let more_a = usize::try_from(left / 2_000).expect("small");
        for _ in 0..more_a {
            assert_eq!(s.pop().expect("waiting").tenant, tid("a"));
        }
        assert_eq!(s.pop().expect("waiting").tenant, tid("b"));
    }

    /// `h` backlogged (10 items of one quantum), served twice: from `new`,
    /// then topped up, moved to `old` and served again; its deficit is spent.
    fn heavy_on_old() -> Scheduler<()> {
        let class = Priority::Standard;
        let mut s = scheduler(SchedulerConfig::default());
        for _ in 0..10 {
            s.push(class, tid("h"), 1, 5_000, ()).ok();
        }
        assert_eq!(s.pop_done().expect("waiting").tenant, tid("h"));
        assert_eq!(s.pop_done().expect("waiting").tenant, tid("h"));
        assert_eq!(s.list_of(class, &tid("h")), Some(ListKind::Old));
        s
    }

    /// `h` backlogged on `old` with its deficit spent; `l` then pushes one
    /// item, goes out at once from `new` as a genuine newcomer, and empties.
    fn heavy_on_old_after_light_served_once() -> Scheduler<()> {
        let class = Priority::Standard;
        let mut s = heavy_on_old();
        s.push(class, tid("l"), 1, 5_000, ()).ok();
        assert_eq!(s.list_of(class, &tid("l")), Some(ListKind::New));
        assert_eq!(s.pop_done().expect("waiting").tenant, tid("l"));
        s.take_trace(class);
        s
    }

    #[test]
    fn tenant_that_empties_and_returns_within_the_round_gets_no_newcomer_priority() {
        let class = Priority::Standard;
        let mut s = heavy_on_old_after_light_served_once();
        // Emptied from `new`: back of `old`, behind h, deficit (0) kept; it
        // is listed but not active.
        assert_eq!(s.list_of(class, &tid("l")), Some(ListKind::Old));
        assert_eq!(s.deficit_of(class, &tid("l")), Some(0));
        assert_eq!(s.active_tenants(class), 1);
        s.check_invariants();
        // Back before its turn: joins its own queue, no grant, no `new`.
        s.push(class, tid("l"), 1, 5_000, ()).ok();
        assert_eq!(s.list_of(class, &tid("l")), Some(ListKind::Old));
        assert_eq!(s.deficit_of(class, &tid("l")), Some(0));
        assert_eq!(s.active_tenants(class), 2);
        // So h goes first (a newcomer would have), then l in its turn.
        assert_eq!(s.pop_done().expect("waiting").tenant, tid("h"));
        assert_eq!(s.pop_done().expect("waiting").tenant, tid("l"));
        assert!(
            !s.take_trace(class)
                .iter()
                .any(|v| matches!(v, Visit::Forget(_)))
        );
        s.check_invariants();
    }

    #[test]
    fn tenant_absent_for_a_full_round_regains_newcomer_priority() {
        let class = Priority::Standard;
        let mut s = heavy_on_old_after_light_served_once();
        // h's turn: topped up and moved behind l, which is found empty at
        // the head of `old` and forgotten, then h is served.
        assert_eq!(s.pop_done().expect("waiting").tenant, tid("h"));
        assert_eq!(
            s.take_trace(class),
            vec![
                Visit::TopUp(tid("h")),
                Visit::Forget(tid("l")),
                Visit::Dispatch(tid("h"))
            ]
        );
        assert_eq!(s.deficit_of(class, &tid("l")), None);
        s.check_invariants();
        // Newcomer again: fresh grant, `new`, out at the next pop.
        s.push(class, tid("l"), 1, 5_000, ()).ok();
        assert_eq!(s.list_of(class, &tid("l")), Some(ListKind::New));
        assert_eq!(s.deficit_of(class, &tid("l")), Some(5_000));
        assert_eq!(s.pop_done().expect("waiting").tenant, tid("l"));
    }

    #[test]
    fn each_emptied_tenant_is_visited_once_then_forgotten() {
        let class = Priority::Standard;
        let mut s = heavy_on_old();
        for i in 0..100 {
            s.push(class, tid(&format!("l{i}")), 1, 5_000, ()).ok();
        }
        for _ in 0..100 {
            assert_ne!(s.pop_done().expect("waiting").tenant, tid("h"));
        }
        // 101 listed tenants, one of them active.
        assert_eq!(s.classes[1].index.len(), 101);
        assert_eq!(s.active_tenants(class), 1);
        s.take_trace(class);
        // One pop walks past all 100 once, forgetting each, then serves h.
        assert_eq!(s.pop_done().expect("waiting").tenant, tid("h"));
        let trace = s.take_trace(class);
        let forgotten: HashSet<_> = trace
            .iter()
            .filter_map(|v| match v {
                Visit::Forget(t) => Some(t.clone()),
                _ => None,
            })
            .collect();
        assert_eq!(forgotten.len(), 100);
        assert_eq!(trace.len(), 102, "top-up h, 100 forgets, dispatch h");
        assert_eq!(s.classes[1].index.len(), 1);
        assert_eq!(s.classes[1].tenants.iter().flatten().count(), 1);
        assert_eq!(s.pop_done().expect("waiting").tenant, tid("h"));
        assert_eq!(s.take_trace(class).len(), 2, "top-up h, dispatch h");
        s.check_invariants();
    }

    #[test]
    fn removal_that_empties_a_tenant_keeps_its_place_like_a_dispatch() {
        let class = Priority::Standard;
        let mut s = heavy_on_old_after_light_served_once();
        // On `new`: a removal moves it to the back of `old`, deficit kept,
        // so cancelling and pushing again does not jump the queue.
        let key = s.push(class, tid("m"), 1, 5_000, ()).expect("no limit");
        assert_eq!(s.list_of(class, &tid("m")), Some(ListKind::New));
        assert_eq!(s.remove(key), Some(()));
        assert_eq!(s.list_of(class, &tid("m")), Some(ListKind::Old));
        assert_eq!(s.deficit_of(class, &tid("m")), Some(5_000));
        s.push(class, tid("m"), 1, 5_000, ()).ok();
        assert_eq!(s.list_of(class, &tid("m")), Some(ListKind::Old));
        s.check_invariants();
        // On `old`: stays until its turn, then is forgotten.
        let key = s.push(class, tid("l"), 1, 5_000, ()).expect("no limit");
        assert_eq!(s.remove(key), Some(()));
        assert_eq!(s.list_of(class, &tid("l")), Some(ListKind::Old));
        assert_eq!(s.active_tenants(class), 2, "h and m");
        // old = [h, l, m]: h topped up and moved back, l forgotten, m served.
        assert_eq!(s.pop_done().expect("waiting").tenant, tid("m"));
        assert_eq!(s.list_of(class, &tid("l")), None);
        s.check_invariants();
    }

    #[test]
    fn giant_request_is_not_stuck() {
        let config = SchedulerConfig::default();
        let quanta = u64::from(config.max_charge_quanta);
        let mut s = scheduler(config);
        for _ in 0..50 {
            s.push(Priority::Standard, tid("busy"), 1, 5_000, ()).ok();
        }
        s.push(Priority::Standard, tid("giant"), 1, 1_000_000_000, ())
            .ok();
        s.push(Priority::Standard, tid("giant"), 1, 1_000_000_000, ())
            .ok();
        let mut giant_topups = 0u64;
        let mut giant_done = 0;
        for _ in 0..40 {
            let d = s.pop().expect("waiting");
            for visit in s.take_trace(Priority::Standard) {
                match visit {
                    Visit::TopUp(t) if t == tid("giant") => giant_topups += 1,
                    Visit::Dispatch(t) if t == tid("giant") => {
                        assert!(giant_topups <= quanta, "{giant_topups} top-ups");
                        assert_eq!(d.cost, 20_000);
                        giant_topups = 0;
                        giant_done += 1;
                    }
                    _ => {}
                }
            }
        }
        assert_eq!(giant_done, 2);
    }

    #[test]
    fn deficit_resets_when_the_class_drains_or_the_tenant_is_found_empty() {
        let mut s = scheduler(SchedulerConfig::default());
        s.push(Priority::Batch, tid("a"), 2, 1_000, ()).ok();
        assert_eq!(s.deficit_of(Priority::Batch, &tid("a")), Some(10_000));
        s.pop_done().expect("waiting");
        assert_eq!(s.deficit_of(Priority::Batch, &tid("a")), None);
        assert_eq!(s.active_tenants(Priority::Batch), 0);
        // No banked 9,000: a fresh quantum × weight.
        s.push(Priority::Batch, tid("a"), 2, 1_000, ()).ok();
        assert_eq!(s.deficit_of(Priority::Batch, &tid("a")), Some(10_000));

        // With b backlogged the class does not drain: a keeps its 9,000
        // until its turn on `old` finds it empty, then it is forgotten.
        s.push(Priority::Batch, tid("b"), 1, 5_000, ()).ok();
        s.push(Priority::Batch, tid("b"), 1, 5_000, ()).ok();
        assert_eq!(s.pop_done().expect("waiting").tenant, tid("a"));
        assert_eq!(s.deficit_of(Priority::Batch, &tid("a")), Some(9_000));
        assert_eq!(s.pop_done().expect("waiting").tenant, tid("b"));
        assert_eq!(s.deficit_of(Priority::Batch, &tid("a")), Some(9_000));
        // old = [a, b]: a is forgotten, b (deficit 0) topped up and served.
        assert_eq!(s.pop_done().expect("waiting").tenant, tid("b"));
        assert_eq!(s.deficit_of(Priority::Batch, &tid("a")), None);
    }

    // ---------- in flight ----------

    #[test]
    fn direct_dispatches_are_charged_so_a_newcomer_goes_first() {
        // `a` filled the window without queueing: 4 × 1,000 charged from a
        // deficit of 0. Then `a` and `b` queue, `a` first: `b`, a newcomer
        // with a fresh quantum, goes out before `a`, whose debt (and work in
        // flight) puts it on `old`.
        let class = Priority::Standard;
        let mut s = scheduler(SchedulerConfig::default());
        for _ in 0..4 {
            assert_eq!(s.dispatch_direct(class, tid("a"), 1, 1_000), Some(1_000));
        }
        assert_eq!(s.deficit_of(class, &tid("a")), Some(-4_000));
        assert!(s.is_parked(class, &tid("a")));
        assert!(s.is_empty());
        s.check_invariants();
        s.push(class, tid("a"), 1, 1_000, ()).ok();
        s.push(class, tid("b"), 1, 1_000, ()).ok();
        assert_eq!(s.list_of(class, &tid("a")), Some(ListKind::Old));
        assert_eq!(s.list_of(class, &tid("b")), Some(ListKind::New));
        assert_eq!(s.pop().expect("waiting").tenant, tid("b"));
        assert_eq!(s.pop().expect("waiting").tenant, tid("a"));
        s.check_invariants();
        // A debt never goes below -max_charge (20,000), so a tenant that had
        // the window to itself waits at most max_charge_quanta extra rounds.
        for _ in 0..100 {
            s.dispatch_direct(class, tid("c"), 1, 5_000);
        }
        assert_eq!(s.deficit_of(class, &tid("c")), Some(-20_000));
        s.check_invariants();
    }

    #[test]
    fn a_tenant_found_empty_with_work_in_flight_is_parked_not_forgotten() {
        let class = Priority::Standard;
        let mut s = heavy_on_old();
        s.push(class, tid("l"), 1, 5_000, ()).ok();
        // Out from `new`, still in flight: moves to `old` behind `h`.
        assert_eq!(s.pop().expect("waiting").tenant, tid("l"));
        s.take_trace(class);
        // h's turn, then l's: found empty with work in flight, it is parked
        // (credit forfeited), not forgotten.
        assert_eq!(s.pop_done().expect("waiting").tenant, tid("h"));
        assert!(
            !s.take_trace(class)
                .iter()
                .any(|v| matches!(v, Visit::Forget(_)))
        );
        assert!(s.is_parked(class, &tid("l")));
        assert_eq!(s.deficit_of(class, &tid("l")), Some(0));
        assert_eq!(s.active_tenants(class), 1);
        s.check_invariants();
        // Back while in flight: no newcomer priority, `old` behind h.
        s.push(class, tid("l"), 1, 5_000, ()).ok();
        assert_eq!(s.list_of(class, &tid("l")), Some(ListKind::Old));
        assert_eq!(s.pop_done().expect("waiting").tenant, tid("h"));
        assert_eq!(s.pop().expect("waiting").tenant, tid("l"));
        s.check_invariants();
        // Its two requests complete; its next turn finds it empty with
        // nothing in flight, and it is forgotten.
        s.complete(class, &tid("l"));
        s.complete(class, &tid("l"));
        assert_eq!(s.pop_done().expect("waiting").tenant, tid("h"));
        assert_eq!(s.pop_done().expect("waiting").tenant, tid("h"));
        assert_eq!(s.deficit_of(class, &tid("l")), None);
        s.check_invariants();
    }

    #[test]
    fn settlement_reaches_a_tenant_in_flight_and_completion_forgets_it() {
        let class = Priority::Standard;
        let mut s = scheduler(SchedulerConfig::default());
        s.push(class, tid("x"), 1, 1_000, ()).ok();
        s.pop().expect("waiting");
        // The class drained; x is parked with its credit forfeited.
        assert!(s.is_parked(class, &tid("x")));
        assert_eq!(s.deficit_of(class, &tid("x")), Some(0));
        // It really used 3,000 tokens: charged while still in flight.
        s.settle(class, &tid("x"), 1_000, 3_000);
        assert_eq!(s.deficit_of(class, &tid("x")), Some(-2_000));
        // So when x and a newcomer y queue, y goes first.
        s.push(class, tid("x"), 1, 1_000, ()).ok();
        s.push(class, tid("y"), 1, 1_000, ()).ok();
        assert_eq!(s.pop_done().expect("waiting").tenant, tid("y"));
        assert_eq!(s.pop_done().expect("waiting").tenant, tid("x"));
        // x's first request completes: nothing waits, nothing in flight, no
        // state left. Completions of unknown tenants change nothing.
        s.complete(class, &tid("x"));
        s.complete(class, &tid("x"));
        s.complete(Priority::Batch, &tid("nobody"));
        assert_eq!(s.deficit_of(class, &tid("x")), None);
        assert!(s.classes[1].index.len() == 0 && s.classes[1].tenants.is_empty());
        s.check_invariants();
    }

    // ---------- removal ----------

    #[test]
    fn removed_entries_leave_no_tenant_state() {
        let mut s = scheduler(SchedulerConfig::default());
        let keys: Vec<Key> = (0..3)
            .map(|i| {
                s.push(Priority::Standard, tid("a"), 1, 100, i)
                    .expect("no limit")
            })
            .collect();
        let other = s
            .push(Priority::Critical, tid("a"), 1, 100, 9)
            .expect("no limit");
        assert_eq!(s.active_tenants(Priority::Standard), 1);
        assert_eq!(s.remove(keys[1]), Some(1));
        assert_eq!(s.remove(keys[0]), Some(0));
        assert_eq!(s.remove(keys[2]), Some(2));
        assert_eq!(s.active_tenants(Priority::Standard), 0);
        assert_eq!(s.class_len(Priority::Standard), 0);
        assert_eq!(s.len(), 1);
        assert_eq!(s.remove(other), Some(9));
        assert_eq!(s.len(), 0);
        assert!(s.is_empty());
        for class in CLASSES {
            assert_eq!(s.active_tenants(class), 0);
            let queue = &s.classes[class_index(class)];
            assert!(queue.new.head == NONE && queue.old.head == NONE);
            assert!(queue.tenants.is_empty());
        }
        assert!(s.entries.slots.is_empty());
        assert!(s.pop().is_none());
        s.check_invariants();
    }

    #[cfg(target_pointer_width = "64")]
    #[test]
    fn slab_slots_stay_compact() {
        assert_eq!(std::mem::size_of::<Option<Entry<u64>>>(), 40);
        assert_eq!(std::mem::size_of::<Option<Tenant>>(), 56);
    }

    #[test]
    fn push_beyond_capacity_is_refused_without_change() {
        let class = Priority::Standard;
        let mut s = scheduler(SchedulerConfig::default());
        s.entries.limit = 3;
        s.classes[1].limit = 2;
        s.push(class, tid("a"), 1, 1, 1).expect("room");
        s.push(class, tid("b"), 1, 1, 2).expect("room");
        // Tenant slab full: a third tenant is refused, a listed one is not.
        assert_eq!(
            s.push(class, tid("c"), 1, 1, 3),
            Err(Rejected::ClassFull(3))
        );
        s.push(class, tid("a"), 1, 1, 4).expect("room");
        s.check_invariants();
        // Entry slab full: refused for any tenant, in any class.
        assert_eq!(
            s.push(class, tid("b"), 1, 1, 5),
            Err(Rejected::ClassFull(5))
        );
        assert_eq!(
            s.push(Priority::Batch, tid("d"), 1, 1, 6),
            Err(Rejected::ClassFull(6))
        );
        assert_eq!(s.len(), 3);
        s.check_invariants();
        // A freed slot is reused.
        let first = s.pop().expect("waiting");
        assert_eq!(first.item, 1);
        s.push(class, tid("b"), 1, 1, 7).expect("a slot was freed");
        s.check_invariants();
        let order: Vec<u32> = std::iter::from_fn(|| s.pop().map(|d| d.item)).collect();
        assert_eq!(order.len(), 3);
        assert!(s.is_empty());
    }

    #[test]
    fn a_drained_class_gives_back_memory_while_a_few_requests_are_in_flight() {
        let class = Priority::Standard;
        let mut s: Scheduler<()> = scheduler(SchedulerConfig::default());
        // One request stays in flight throughout, as on a busy service.
        s.dispatch_direct(class, tid("keeper"), 1, 1_000);
        for i in 0..5_000 {
            s.push(class, tid(&format!("t{i}")), 1, 1_000, ()).ok();
        }
        assert!(s.classes[1].tenants.len() > 5_000);
        while s.pop_done().is_some() {}
        // Drained: only the keeper is left, in a slab of the retained size
        // (the last tenant served was parked with it, then completed).
        let queue = &s.classes[1];
        assert_eq!(queue.tenants.iter().flatten().count(), 1);
        assert!(queue.tenants.len() <= 2);
        assert_eq!(queue.index.len(), 1);
        assert!(queue.tenants.capacity() <= RETAINED_CAPACITY);
        assert!(s.is_parked(class, &tid("keeper")));
        assert_eq!(s.deficit_of(class, &tid("keeper")), Some(-1_000));
        s.check_invariants();
        // Still found and charged as before, and forgotten when done.
        s.push(class, tid("keeper"), 1, 1_000, ()).ok();
        assert_eq!(s.list_of(class, &tid("keeper")), Some(ListKind::Old));
        assert!(s.pop_done().is_some());
        s.complete(class, &tid("keeper"));
        assert!(s.classes[1].tenants.is_empty());
        s.check_invariants();
    }

    #[test]
    fn direct_dispatch_beyond_tenant_capacity_is_not_recorded() {
        let class = Priority::Standard;
        let mut s: Scheduler<()> = scheduler(SchedulerConfig::default());
        s.classes[1].limit = 1;
        assert_eq!(s.dispatch_direct(class, tid("a"), 1, 1_000), Some(1_000));
        // No slot for b: nothing recorded, so its caller must not complete it.
        assert_eq!(s.dispatch_direct(class, tid("b"), 1, 1_000), None);
        assert_eq!(s.deficit_of(class, &tid("b")), None);
        s.check_invariants();
        s.complete(class, &tid("a"));
        assert_eq!(s.deficit_of(class, &tid("a")), None);
        assert_eq!(s.dispatch_direct(class, tid("b"), 1, 1_000), Some(1_000));
        s.check_invariants();
    }

    #[test]
    fn stale_key_after_reuse_removes_nothing() {
        let mut s = scheduler(SchedulerConfig::default());
        let keep = s
            .push(Priority::Standard, tid("a"), 1, 1, "keep")
            .expect("no limit");
        let first = s
            .push(Priority::Standard, tid("a"), 1, 1, "first")
            .expect("no limit");
        assert_eq!(s.remove(first), Some("first"));
        let second = s
            .push(Priority::Standard, tid("a"), 1, 1, "second")
            .expect("no limit");
        assert_eq!(first.index, second.index, "slot was reused");
        assert_eq!(s.remove(first), None);
        assert_eq!(s.len(), 2);
        // A popped item's key is stale too, even after a full drain.
        assert_eq!(s.pop().map(|d| d.item), Some("keep"));
        assert_eq!(s.pop().map(|d| d.item), Some("second"));
        let third = s
            .push(Priority::Standard, tid("a"), 1, 1, "third")
            .expect("no limit");
        assert_eq!(s.remove(keep), None);
        assert_eq!(s.remove(second), None);
        assert_eq!(s.remove(third), Some("third"));
        assert_eq!(s.remove(third), None);
    }

    // ---------- limits, settlement, config ----------

    #[test]
    fn queue_limits_refuse_the_incoming_request() {
        let config = SchedulerConfig::default()
            .with_max_per_tenant(Some(2))
            .with_max_per_class(Some(3));
        let mut s = scheduler(config);
        s.push(Priority::Standard, tid("a"), 1, 1, 1).expect("room");
        s.push(Priority::Standard, tid("a"), 1, 1, 2).expect("room");
        let refused = s.push(Priority::Standard, tid("a"), 1, 1, 3);
        assert_eq!(refused, Err(Rejected::TenantFull(3)));
        assert_eq!(refused.map_err(Rejected::into_inner), Err(3));
        s.push(Priority::Standard, tid("b"), 1, 1, 4).expect("room");
        assert_eq!(
            s.push(Priority::Standard, tid("c"), 1, 1, 5),
            Err(Rejected::ClassFull(5))
        );
        // The refusals changed nothing.
        assert_eq!(s.class_len(Priority::Standard), 3);
        assert_eq!(s.active_tenants(Priority::Standard), 2);
        // Other classes have their own limits.
        s.push(Priority::Batch, tid("a"), 1, 1, 6).expect("room");
        let order: Vec<i32> = std::iter::from_fn(|| s.pop().map(|d| d.item)).collect();
        assert_eq!(order.len(), 4);
        let standard: Vec<i32> = order.into_iter().filter(|&x| x != 6).collect();
        // Newcomers take turns one request at a time.
        assert_eq!(standard, vec![1, 4, 2]);
        assert_eq!(Rejected::TenantFull(()).to_string(), "tenant queue is full");
    }

    #[test]
    fn settlement_charges_and_refunds_active_tenant() {
        let mut s = scheduler(SchedulerConfig::default());
        let class = Priority::Standard;
        let a = tid("a");
        for _ in 0..3 {
            s.push(class, a.clone(), 1, 1_000, ()).ok();
        }
        s.pop().expect("waiting");
        assert_eq!(s.deficit_of(class, &a), Some(4_000));
        s.settle(class, &a, 1_000, 3_000);
        assert_eq!(s.deficit_of(class, &a), Some(2_000));
        s.settle(class, &a, 3_000, 1_000);
        assert_eq!(s.deficit_of(class, &a), Some(4_000));
        // Refunds bank at most one quantum × weight.
        s.settle(class, &a, 20_000, 1);
        assert_eq!(s.deficit_of(class, &a), Some(5_000));
        // Charges use capped costs: 10^9 counts as max_charge (20,000).
        s.settle(class, &a, 1, 1_000_000_000);
        assert_eq!(s.deficit_of(class, &a), Some(5_000 - 19_999));
        s.settle(class, &a, 1, 1_000_000_000);
        assert_eq!(
            s.deficit_of(class, &a),
            Some(-20_000),
            "floored at -max_charge"
        );
        // A negative deficit needs top-ups first, then the item goes out.
        assert!(s.pop().is_some());
        // Inactive tenants and other classes are ignored.
        s.settle(Priority::Batch, &a, 1, 10_000);
        s.settle(class, &tid("nobody"), 10_000, 1);
        assert_eq!(s.active_tenants(Priority::Batch), 0);
        assert_eq!(s.active_tenants(class), 1);
    }

    #[test]
    fn invalid_config_is_refused_with_message() {
        let cases = [
            (
                SchedulerConfig::default().with_quantum(0),
                "quantum must be at least 1",
            ),
            (
                SchedulerConfig::default().with_max_charge_quanta(0),
                "max_charge_quanta must be at least 1",
            ),
            (
                SchedulerConfig::default().with_class_weights(ClassWeights {
                    batch: 0,
                    ..ClassWeights::default()
                }),
                "class_weights.batch must be at least 1",
            ),
            (
                SchedulerConfig::default().with_max_per_tenant(Some(0)),
                "max_per_tenant must be at least 1",
            ),
            (
                SchedulerConfig::default().with_max_per_class(Some(0)),
                "max_per_class must be at least 1",
            ),
        ];
        for (config, message) in cases {
            let err = Scheduler::<()>::new(config).expect_err("refused");
            assert_eq!(err.message(), message);
        }
        assert!(SchedulerConfig::default().validate().is_ok());
    }

    #[test]
    fn extreme_inputs_do_not_panic() {
        let config = SchedulerConfig::default()
            .with_quantum(u64::MAX)
            .with_max_charge_quanta(u32::MAX)
            .with_class_weights(ClassWeights {
                critical: u32::MAX,
                standard: u32::MAX,
                batch: u32::MAX,
            });
        let mut s = scheduler(config);
        for class in CLASSES {
            s.push(class, tid("a"), u32::MAX, u64::MAX, ()).ok();
            s.push(class, tid("b"), 0, 0, ()).ok();
        }
        s.settle(Priority::Critical, &tid("a"), 0, u64::MAX);
        s.settle(Priority::Critical, &tid("a"), u64::MAX, 0);
        assert_eq!(std::iter::from_fn(|| s.pop()).count(), 6);
    }

    // ---------- Jain's index ----------

    #[test]
    fn jain_index_equal_values_is_one() {
        let j = jain_index([3.0; 5]).expect("values");
        assert!((j - 1.0).abs() < 1e-12);
    }

    #[test]
    fn jain_index_one_of_n_is_one_over_n() {
        let j = jain_index([7.0, 0.0, 0.0, 0.0]).expect("values");
        assert!((j - 0.25).abs() < 1e-12);
    }

    #[test]
    fn jain_index_empty_or_all_zero_is_none() {
        assert_eq!(jain_index(std::iter::empty()), None);
        assert_eq!(jain_index([0.0, 0.0]), None);
    }
}
