//! The Deficit Round Robin core of the `DrrFairness` layer, sans IO: [`Scheduler`] holds the
//! waiting requests and says which goes next; its documentation gives the rules.
//!
//! The files: `config` (what a scheduler is configured with), `class` (the order inside a
//! class), `picker` (the choice between classes), `slab` (where waiting items live), `jain`
//! (the fairness index).

use std::fmt;

use crate::error::ConfigError;
use crate::{Priority, TenantId};

mod class;
mod config;
mod jain;
mod picker;
mod slab;
#[cfg(test)]
mod tests;

use self::class::Class;
pub use self::config::{ClassSelection, ClassWeights, SchedulerConfig};
pub use self::jain::jain_index;
pub(crate) use self::picker::ClassPicker;
use self::slab::{Entries, Entry, NONE};

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

/// A push refused by a queue limit; carries the incoming item back.
#[derive(Debug, PartialEq, Eq)]
pub enum Rejected<T> {
    /// The tenant already has `max_per_tenant` items waiting in this class.
    TenantFull(T),
    /// The class already has `max_per_class` items waiting, or the
    /// scheduler is at capacity (`u32::MAX - 1` waiting items, or as many
    /// known tenants in the class, listed or parked; see [`Scheduler`]).
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
pub(crate) enum Pick {
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

/// The Deficit Round Robin core of the [`DrrFairness`](crate::DrrFairness) layer: a pure
/// data structure (no IO, no clocks, no async) that holds waiting requests and says which
/// goes next. The layer keeps one per tier group: it pushes requests in, pops the next to
/// dispatch, removes those whose waiter went away, charges those that went out without
/// waiting, and reports each dispatch's completion and real cost.
///
/// The rules it keeps (the reasoning and the bounds' proofs are in `ARCHITECTURE.md`,
/// "The fair queue's scheduler"):
///
/// - **Between classes**, a work-conserving weighted choice among the classes with work,
///   by default nginx's smooth weighted round robin: with weights 270/25/5 and every class
///   backlogged, critical gets 90% and batch never waits more than 60 dispatches. A class
///   that empties banks no credit.
/// - **Inside a class**, Deficit Round Robin over tenants with fq_codel's `new`/`old`
///   lists (RFC 8290 §4.2): a newcomer gets one grant of `quantum × weight` and takes turns
///   one request at a time while it lasts; a request is charged `min(max(cost, 1),
///   max_charge)`, so one giant prompt cannot stall its class.
/// - **A tenant is forgotten only in its turn**: one whose queue empties keeps its place
///   and deficit until the head of `old` finds it empty, so light tenants that keep
///   re-arriving cannot starve a backlogged one.
/// - **Every dispatch is charged**, queued ([`Scheduler::pop`]) or not
///   ([`Scheduler::dispatch_direct`]), and counted in flight until
///   [`Scheduler::complete`]; a tenant with work in flight is no newcomer.
/// - **Bounded work**: `push`, `remove`, `settle`, `dispatch_direct` and `complete` are
///   O(1), `pop` amortised O(`max_charge_quanta`) whatever the number of tenants. At most
///   `u32::MAX - 1` waiting items, and as many tenants per class: beyond, a push is
///   refused with [`Rejected::ClassFull`], never a panic. A [`Key`] never matches another
///   item, even after its slot is reused.
///
/// ```
/// use fairgate::drr_fairness::{Scheduler, SchedulerConfig};
/// use fairgate::{Priority, TenantId};
///
/// let mut queue = Scheduler::new(SchedulerConfig::default()).unwrap();
/// // Tenant a queues three requests of one quantum each, then b queues one.
/// for n in 1..=3 {
///     queue.push(Priority::Standard, TenantId::new("a"), 1, 5_000, format!("a{n}")).unwrap();
/// }
/// queue.push(Priority::Standard, TenantId::new("b"), 1, 5_000, "b1".to_owned()).unwrap();
/// // b goes second, not fourth.
/// let order: Vec<String> = std::iter::from_fn(|| queue.pop()).map(|d| d.item).collect();
/// assert_eq!(order, ["a1", "b1", "a2", "a3"]);
/// ```
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
    /// limit, or the scheduler's capacity (see [`Scheduler`]), refuses the
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
    pub(crate) fn pop_class(&mut self, class: Priority) -> Option<Dispatched<T>> {
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
    pub(crate) fn pop_class_where(
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
    pub(crate) fn pop_tenant(
        &mut self,
        class: Priority,
        tenant: &TenantId,
    ) -> Option<Dispatched<T>> {
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
    pub(crate) fn peek_tenant(&self, class: Priority, tenant: &TenantId) -> Option<&T> {
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
    /// `None` if the class is at its tenant capacity (see [`Scheduler`]):
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
    pub(crate) fn get_mut(&mut self, key: Key) -> Option<&mut T> {
        self.entries
            .get_mut(key.index)
            .filter(|entry| entry.generation == key.generation)
            .map(|entry| &mut entry.item)
    }

    /// Every still-waiting item, mutably, in no particular order (e.g. to wake them all).
    pub(crate) fn items_mut(&mut self) -> impl Iterator<Item = &mut T> {
        self.entries
            .slots
            .iter_mut()
            .flatten()
            .map(|entry| &mut entry.item)
    }

    /// Settles a dispatched request once its real usage is known: charges
    /// (`actual > estimated`) or refunds the difference of the charged costs
    /// to the tenant's deficit, if `class` still knows the tenant (items
    /// waiting or in flight, or emptied less than a round ago; see
    /// [`Scheduler`]). Refunds never lift the deficit above one `quantum × weight`, nor
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
    pub(crate) fn waiting_tenants(&self, class: Priority) -> impl Iterator<Item = &TenantId> {
        self.classes[class_index(class)]
            .tenants
            .iter()
            .flatten()
            .filter(|t| t.len > 0)
            .map(|t| &t.id)
    }

    /// Number of tenants with waiting items in `class`. A tenant that emptied
    /// less than a round ago is still listed (with its deficit, see
    /// [`Scheduler`]) but is not counted: it has nothing waiting.
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
