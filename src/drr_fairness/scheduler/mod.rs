//! The fair order of the `DrrFairness` layer, sans IO: [`Scheduler`] holds the
//! waiting requests and says which goes next; its documentation gives the rules.
//!
//! The files: `config` (what a scheduler is configured with), `class` (the order inside a
//! class), `order` (start-time fair queuing's pieces), `picker` (the choice between
//! classes), `slab` (where waiting items live), `jain` (the fairness index).

use std::fmt;

use crate::error::ConfigError;
use crate::{Priority, TenantId};

mod class;
mod config;
mod jain;
mod order;
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

/// The fair order of the [`DrrFairness`](crate::DrrFairness) layer: a pure data structure
/// (no IO, no clocks, no async) that holds waiting requests and says which goes next. The
/// layer keeps one per tier group: it pushes requests in, pops the next to dispatch,
/// removes those whose waiter went away, charges those that went out without waiting, and
/// reports each dispatch's completion and real cost.
///
/// The rules it keeps (the reasoning and the bounds' proofs are in `ARCHITECTURE.md`,
/// "The fair queue's scheduler"):
///
/// - **Between classes**, a work-conserving weighted choice among the classes with work,
///   by default nginx's smooth weighted round robin: with weights 270/25/5 and every class
///   backlogged, critical gets 90% and batch never waits more than 60 dispatches. A class
///   that empties banks no credit.
/// - **Inside a class**, start-time fair queuing, one call per turn, at two levels: the
///   groups (a tenant is a group of its own unless the layer names its group), then the
///   tenants of each group. The one with the least start tag goes next and moves on by its
///   call's cost over its weight, so backlogged tenants are served in proportion to their
///   weights, interleaved call by call; a request is charged `min(max(cost, 1),
///   max_charge)`, so one giant prompt cannot stall its class.
/// - **A tenant that starts waiting starts at the virtual time** (the start of the call
///   last served), or at its own last finish if later: a newcomer, or one back after its
///   calls finished, goes within one turn of everyone waiting, and nobody banks credit
///   for the time it was away, nor gains by coming and going.
/// - **Every dispatch is charged**, queued ([`Scheduler::pop`]) or not
///   ([`Scheduler::dispatch_direct`]), and counted in flight until
///   [`Scheduler::complete`]; [`Scheduler::settle`] moves the tenant by what the call
///   really took.
/// - **Bounded work**: `push`, `remove`, `settle`, `dispatch_direct`, `complete` and `pop`
///   are O(log n) in the tenants waiting. At most `u32::MAX - 1` waiting items, and as
///   many tenants per class: beyond, a push is refused with [`Rejected::ClassFull`], never
///   a panic. A [`Key`] never matches another item, even after its slot is reused.
///
/// ```
/// use fairgate::drr_fairness::{Scheduler, SchedulerConfig};
/// use fairgate::{Priority, TenantId};
///
/// let mut queue = Scheduler::new(SchedulerConfig::default()).unwrap();
/// // Tenant a queues three requests, then b queues one.
/// for n in 1..=3 {
///     queue.push(Priority::Standard, TenantId::new("a"), 1, 1_000, format!("a{n}")).unwrap();
/// }
/// queue.push(Priority::Standard, TenantId::new("b"), 1, 1_000, "b1".to_owned()).unwrap();
/// // b goes second, not fourth.
/// let order: Vec<String> = std::iter::from_fn(|| queue.pop()).map(|d| d.item).collect();
/// assert_eq!(order, ["a1", "b1", "a2", "a3"]);
/// ```
#[derive(Debug)]
pub struct Scheduler<T> {
    config: SchedulerConfig,
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
            max_charge: clamp_i64(config.max_charge()),
            config,
            entries: Entries::new(),
            classes: [Class::new(), Class::new(), Class::new()],
            len: 0,
        })
    }

    /// Breaks ties of start tags by `rank` of the names (monotone in name order) instead of
    /// first come, first served: as the fleet's sorted sets do, for the test that holds
    /// this order to the fleet's.
    #[cfg(test)]
    pub(crate) fn tie_by_name(&mut self, rank: fn(&TenantId) -> u64) {
        for class in &mut self.classes {
            class.ties.by_name = Some(rank);
        }
    }

    /// The configuration in force.
    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// The cost charged for an estimate: at least 1, at most max_charge.
    fn charge(&self, cost: u64) -> i64 {
        clamp_i64(cost.max(1)).min(self.max_charge)
    }

    /// Queues `item` for `tenant` in `class`, the tenant a group of its own. `weight` is
    /// the tenant's tier weight (0 is treated as 1; the latest push's weight applies to
    /// later calls); `cost` the estimated tokens (0 is treated as 1). A queue limit, or the
    /// scheduler's capacity (see [`Scheduler`]), refuses the incoming item and hands it
    /// back unchanged.
    pub fn push(
        &mut self,
        class: Priority,
        tenant: TenantId,
        weight: u32,
        cost: u64,
        item: T,
    ) -> Result<Key, Rejected<T>> {
        self.push_in(class, None, tenant, weight, cost, item)
    }

    /// [`Scheduler::push`] for a tenant of `group` (`None`: a group of its own): groups
    /// take turns first, then the group's tenants. A tenant the class knows stays in the
    /// group it joined.
    pub(crate) fn push_in(
        &mut self,
        class: Priority,
        group: Option<&TenantId>,
        tenant: TenantId,
        weight: u32,
        cost: u64,
        item: T,
    ) -> Result<Key, Rejected<T>> {
        let weight = weight.max(1);
        let cost = self.charge(cost);
        let (max_per_tenant, max_per_class) =
            (self.config.max_per_tenant, self.config.max_per_class);
        let queue = &mut self.classes[class_index(class)];
        let existing = queue.lookup(&tenant);
        if let (Some(limit), Some(t)) = (max_per_tenant, existing)
            && queue.tenant(t).is_some_and(|x| x.len as usize >= limit)
        {
            return Err(Rejected::TenantFull(item));
        }
        if max_per_class.is_some_and(|limit| queue.len >= limit) {
            return Err(Rejected::ClassFull(item));
        }
        // Slab capacity (about 4.3 billion entries, resp. known tenants or groups of a
        // class): refused like a full class, before any change.
        if !self.entries.has_room() {
            return Err(Rejected::ClassFull(item));
        }
        let Some(t) = queue.find_or_make(existing, tenant, group, weight) else {
            return Err(Rejected::ClassFull(item));
        };
        let key = match self.entries.insert(Entry {
            item,
            generation: 0,
            cost,
            tenant: t,
            prev: NONE,
            next: NONE,
            class,
        }) {
            Ok(key) => key,
            Err(item) => {
                // Unreachable: room was checked above.
                queue.unused(t);
                return Err(Rejected::ClassFull(item));
            }
        };
        queue.append(&mut self.entries, t, key.index, weight);
        self.len += 1;
        Ok(key)
    }

    /// Takes the next item to dispatch, or `None` if nothing is waiting.
    pub fn pop(&mut self) -> Option<Dispatched<T>> {
        let nonempty = CLASSES.map(|class| self.class_len(class) > 0);
        let class = self.picker.pick(nonempty)?;
        self.pop_class(class)
    }

    /// Takes the next item of `class` in fair order, bypassing the choice between classes
    /// (for a caller that makes that choice itself, over several schedulers), or `None` if
    /// nothing of `class` is waiting.
    pub(crate) fn pop_class(&mut self, class: Priority) -> Option<Dispatched<T>> {
        let ci = class_index(class);
        let (item, tenant, cost) = self.classes[ci].pop(&mut self.entries)?;
        Some(self.dispatched(ci, item, tenant, cost))
    }

    /// The tenant whose turn it is in `class`, passing over those `skip` says (told each
    /// tenant's number of waiting items in the class), who keep their places: for a caller
    /// that can serve only some tenants now (one at its own cap of calls in flight, say),
    /// and serves the one chosen later with [`Scheduler::pop_tenant`]. `None` if it skipped
    /// every tenant waiting. O(log n) a tenant skipped.
    pub(crate) fn next_where(
        &self,
        class: Priority,
        skip: impl FnMut(&TenantId, usize) -> bool,
    ) -> Option<&TenantId> {
        self.classes[class_index(class)].turn(skip)
    }

    /// Takes the next waiting item of `tenant` in `class`, whatever its place in the
    /// order: for an item a caller chose earlier ([`Scheduler::next_where`]) and can only
    /// now serve. Charged as a pop is, and counted in flight until [`Scheduler::complete`].
    /// `None` if nothing of `tenant` waits in `class`.
    pub(crate) fn pop_tenant(
        &mut self,
        class: Priority,
        tenant: &TenantId,
    ) -> Option<Dispatched<T>> {
        let ci = class_index(class);
        let queue = &mut self.classes[ci];
        let t = queue.lookup(tenant)?;
        if queue.tenant(t)?.len == 0 {
            return None;
        }
        let (item, id, cost) = queue.serve(&mut self.entries, t)?;
        Some(self.dispatched(ci, item, id, cost))
    }

    /// Places `tenant` in `class` as if its next call of `cost` tokens were served (`on`),
    /// or takes that back (`!on`): for a caller that sends for that call's slot and hears
    /// later, so the calls it asks for meanwhile go to others in fair order. A reservation
    /// is taken back before the call is served ([`Scheduler::pop_tenant`] charges it then)
    /// or when it goes back to waiting; moves are clamped as a settlement's.
    pub(crate) fn reserve(&mut self, class: Priority, tenant: &TenantId, cost: u64, on: bool) {
        let cost = self.charge(cost);
        let max_charge = self.max_charge;
        let queue = &mut self.classes[class_index(class)];
        if let Some(t) = queue.lookup(tenant) {
            queue.settle(t, if on { cost } else { -cost }, max_charge);
        }
    }

    /// The next waiting item of `tenant` in `class` (the one [`Scheduler::pop_tenant`]
    /// would take), without taking it.
    pub(crate) fn peek_tenant(&self, class: Priority, tenant: &TenantId) -> Option<&T> {
        let queue = &self.classes[class_index(class)];
        let head = queue.tenant(queue.lookup(tenant)?)?.head;
        self.entries.get(head).map(|entry| &entry.item)
    }

    /// Charges a request that went out without waiting in the queue (there was room and
    /// nothing waited) to its tenant, a group of its own, and counts it in flight until
    /// [`Scheduler::complete`]: its next call starts that much later in the order (a
    /// tenant the class does not know starts from the virtual time, so a newcomer queued
    /// next goes before it), never more than one largest charge later. Returns the charged
    /// cost.
    ///
    /// `None` if the class is at its tenant capacity (see [`Scheduler`]): then nothing is
    /// recorded, and the request must not be completed.
    pub fn dispatch_direct(
        &mut self,
        class: Priority,
        tenant: TenantId,
        weight: u32,
        cost: u64,
    ) -> Option<u64> {
        self.dispatch_direct_in(class, None, tenant, weight, cost)
    }

    /// [`Scheduler::dispatch_direct`] for a tenant of `group` (as [`Scheduler::push_in`]).
    pub(crate) fn dispatch_direct_in(
        &mut self,
        class: Priority,
        group: Option<&TenantId>,
        tenant: TenantId,
        weight: u32,
        cost: u64,
    ) -> Option<u64> {
        let weight = weight.max(1);
        let cost = self.charge(cost);
        let max_charge = self.max_charge;
        let queue = &mut self.classes[class_index(class)];
        let known = queue.lookup(&tenant);
        let t = queue.find_or_make(known, tenant, group, weight)?;
        if let Some(known) = queue.tenants.get_mut(t) {
            known.weight = weight;
        }
        queue.charge_direct(t, cost, max_charge);
        Some(cost.unsigned_abs())
    }

    /// A request of `tenant` in `class`, dispatched by [`Scheduler::pop`] or
    /// [`Scheduler::dispatch_direct`], completed. A tenant is remembered while it has
    /// items waiting or in flight (so every dispatch and settlement reaches it), and while
    /// it finished ahead of its group's virtual time with others waiting; each dispatch
    /// must be completed exactly once, or its tenant stays in memory.
    pub fn complete(&mut self, class: Priority, tenant: &TenantId) {
        let queue = &mut self.classes[class_index(class)];
        if let Some(t) = queue.lookup(tenant) {
            queue.complete(t);
        }
    }

    /// Takes out a still-waiting item (its waiter went away). `None` if the
    /// key's item was already popped or removed.
    pub fn remove(&mut self, key: Key) -> Option<T> {
        let entry = self.entries.take(key)?;
        let ci = class_index(entry.class);
        let queue = self.classes.get_mut(ci)?;
        queue.remove(&mut self.entries, key.index, &entry);
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

    /// Settles a dispatched request once its real usage is known: the difference of the
    /// charged costs moves the tenant's (and its group's) place in the order, as if it had
    /// been charged what it used, if `class` still knows the tenant. A refund never moves
    /// it before the order's virtual time (no credit to bank: it never stretches the turn
    /// in progress nor goes before a newcomer), a charge never more than one largest
    /// charge past it. Forgotten tenants are ignored.
    pub fn settle(&mut self, class: Priority, tenant: &TenantId, estimated: u64, actual: u64) {
        let delta = self.charge(actual) - self.charge(estimated);
        let max_charge = self.max_charge;
        let queue = &mut self.classes[class_index(class)];
        if let Some(t) = queue.lookup(tenant) {
            queue.settle(t, delta, max_charge);
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
        queue
            .lookup(tenant)
            .and_then(|t| queue.tenant(t))
            .map_or(0, |t| t.len as usize)
    }

    /// The tenants with waiting items in `class`, in no particular order.
    pub(crate) fn waiting_tenants(&self, class: Priority) -> impl Iterator<Item = &TenantId> {
        self.classes[class_index(class)]
            .tenants
            .iter()
            .filter(|(_, t)| t.len > 0)
            .map(|(_, t)| &t.id)
    }

    /// Number of tenants with waiting items in `class`.
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
        if self.classes.get(ci).is_some_and(|queue| queue.len == 0) {
            // A class that empties banks no round-robin credit.
            self.picker.forget(CLASSES[ci]);
        }
        if self.len == 0 {
            self.entries.reset();
        }
    }
}
