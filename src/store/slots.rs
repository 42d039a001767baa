//! Slots: how many calls are in flight, globally, per tier and (when capped) per tenant.
//!
//! A slot is held through a [`SlotLease`], an RAII guard: dropping it gives the slot back.
//! In process ([`LocalSlots`]) a slot is a pair of counters (three with a tenant cap). On
//! Redis a slot is a lease: a member of two sorted sets (global and tier; a third, the
//! tenant's, with a tenant cap) scored by its expiry, renewed by a heartbeat while held, so
//! the slots of a crashed worker come back within one lease TTL.

use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;

use crate::gcra::Gcra;
use crate::hash::HashMap;
use crate::{Priority, TenantId, Tier};

/// The caps one acquire is checked against, and how long a Redis lease lives unrenewed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotLimits {
    /// Most slots held at once across all tiers.
    pub global: u32,
    /// Most slots held at once by this tier.
    pub tier: u32,
    /// Most slots held at once by one tenant of this tier (`None`: no cap of its own, and
    /// nothing is counted per tenant). Checked only by
    /// [`Store::try_acquire_slot_for`](crate::Store::try_acquire_slot_for) with a tenant.
    pub tenant: Option<u32>,
    /// How long a lease lives without a heartbeat (Redis only).
    pub lease_ttl: Duration,
}

/// Why an acquire took no slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum SlotRefusal {
    /// The global or the tier cap is reached: a slot of the tier must come free.
    Full,
    /// The tier has room, but the tenant holds its own cap
    /// ([`SlotLimits::tenant`]): one of the tenant's calls must end. Other tenants of the
    /// tier may still get slots.
    TenantCap,
    /// The shared store (Redis) is away and this worker cannot admit the call soundly: it
    /// held no slot of the tier (or none at all) when Redis went away, so none of its own
    /// will come free, and the other workers' calls are not known here; or Redis has been
    /// away longer than a lease TTL and the store was told to refuse then
    /// ([`OutagePolicy::Refuse`](crate::OutagePolicy::Refuse)). Waiting would not help:
    /// answer at once, so the caller can try another worker.
    Store,
    /// The provider's request rate, which the fleet's order hands out with the slots
    /// (Redis), has no cell free: the next freed cell comes with a wake-up, as a freed slot
    /// does.
    Rate,
}

impl SlotLimits {
    /// The caps an acquire for a tier of `limit` under `policy` is checked against.
    pub(crate) fn of(policy: &crate::SlotPolicy, limit: crate::TierLimit) -> SlotLimits {
        SlotLimits {
            global: policy.global_max(),
            tier: limit.cap,
            tenant: limit.tenant_cap,
            lease_ttl: policy.lease_ttl(),
        }
    }

    /// The caps shrunk for one of `workers` processes sharing them (at least 1 each).
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn share_of(self, workers: u32) -> SlotLimits {
        SlotLimits {
            global: super::per_worker(self.global, workers),
            tier: super::per_worker(self.tier, workers),
            tenant: self.tenant.map(|cap| super::per_worker(cap, workers)),
            lease_ttl: self.lease_ttl,
        }
    }
}

/// How an acquire made for a call that will wait if refused queues for a freed slot on
/// Redis: refused, the worker is queued in the call's flow (its tenant and class in the
/// tier), and a release wakes the worker of the flow whose turn it is in the fleet's fair
/// order (the memory store ignores it: its releases wake the local waiters directly).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct SlotQueue {
    /// The tier's weight, for the fleet's start-time fair queuing between tiers.
    pub(crate) weight: u32,
    /// The call's class, and the class's weight between classes.
    pub(crate) class: Priority,
    pub(crate) class_weight: u32,
    /// The call's tenant; `None` for a worker that orders its calls of the tier itself
    /// (one flow per tier).
    pub(crate) tenant: Option<TenantId>,
    /// The group of the tenant ([`crate::Job::with_group`]), fair-queued first; `None`: the
    /// tenant is a group of its own.
    pub(crate) group: Option<TenantId>,
    /// What the call costs in tokens, as the fair queue charges it.
    pub(crate) cost: u64,
    /// How many calls of the flow wait at this worker, this one included: the worker is
    /// woken that many times (granted the last room, it stays queued for the rest).
    pub(crate) waiting: u32,
    /// The provider's request rate, when the fleet orders its cells with the slots.
    pub(crate) cells: Option<FleetCells>,
}

/// The provider's request rate as cells the fleet hands out in its fair order, with the
/// slots: `count` cells, each taken by a call for `span` from when it goes (a rate of
/// `count` calls per `span`; with one cell, one call per `span`, as a burst-1 GCRA).
/// With `tokens`, the provider's input-token rate goes in the same order: a GCRA in
/// microseconds a token, each call taking its cost in tokens with its slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct FleetCells {
    pub(crate) count: u32,
    pub(crate) span: std::time::Duration,
    pub(crate) tokens: Option<Gcra>,
}

impl FleetCells {
    /// The fleet orders the rate's cells, but this worker's view names no limit now: the
    /// call takes a cell if another worker names them (the acquire finds their number in
    /// the wait book), and goes as the gate lets it otherwise.
    pub(crate) const FROM_THE_FLEET: FleetCells = FleetCells {
        count: 0,
        span: std::time::Duration::ZERO,
        tokens: None,
    };

    /// An input-token limit of `per_minute` (with `headroom_permille`) as the token rate
    /// the fleet's order hands out: microseconds a token, holding 900 ms of it at once —
    /// with the 100 ms a handing out may go ahead of the tokens (`tokens_batch` in
    /// `slot_queue.lua`), a second's burst. A provider's bucket holds a minute, but the
    /// fleet does not know how full it is: a second's burst is what it sends back to back.
    pub(crate) fn token_rate(per_minute: u32, headroom_permille: u32) -> Gcra {
        let rate = crate::store::learned_rate(crate::store::INPUT, per_minute, headroom_permille);
        let burst = 900_000 / rate.interval().max(1);
        Gcra::new(rate.interval(), burst)
    }

    /// The slower of two namings of one upstream's limits, in each of its two parts: the
    /// request cells (a count of 0 names none) and the token rate.
    pub(crate) fn slower(self, other: FleetCells) -> FleetCells {
        let requests = match (self.count, other.count) {
            (0, _) => other,
            (_, 0) => self,
            _ if other.per_second() < self.per_second() => other,
            _ => self,
        };
        let tokens = match (self.tokens, other.tokens) {
            (Some(a), Some(b)) if b.interval() > a.interval() => Some(b),
            (Some(a), _) => Some(a),
            (None, b) => b,
        };
        FleetCells { tokens, ..requests }
    }

    /// Whether this worker names the cells or the token rate (a limit it knows), or takes
    /// them as the fleet names them.
    pub(crate) fn names_a_limit(&self) -> bool {
        self.count > 0 || self.tokens.is_some()
    }

    /// The rate, in calls a second.
    pub(crate) fn per_second(&self) -> f64 {
        f64::from(self.count) / self.span.as_secs_f64().max(1e-9)
    }
}

impl SlotQueue {
    /// The flow's name in a wake-up: `<class index>|<tenant>`.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn flow(&self) -> String {
        flow_name(self.class, self.tenant.as_ref())
    }
}

/// A flow's name in the wait queue and in a wake-up: `<class index>|<tenant>` (the tenant
/// empty for a worker's own order of a tier).
pub(crate) fn flow_name(class: Priority, tenant: Option<&TenantId>) -> String {
    format!(
        "{}|{}",
        class as u8,
        tenant.map_or("", |tenant| tenant.as_str())
    )
}

/// A held slot. Dropping it gives the slot back (on Redis: at once by a best-effort
/// release, at the latest when the lease expires).
#[must_use = "dropping the lease gives the slot back at once"]
pub struct SlotLease {
    tier: Tier,
    /// The tenant the slot is also counted for, when its tier caps tenants.
    tenant: Option<TenantId>,
    holder: Holder,
    fallback: bool,
    /// How many more calls the caps had room for when this slot was taken (Redis: as the
    /// acquire script saw them; elsewhere not known: `u32::MAX`).
    room: u32,
}

pub(crate) enum Holder {
    Local(Arc<LocalSlots>),
    /// Held in a store shared with other workers (a Redis lease).
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    Shared(Box<dyn ReleaseSlot>),
}

/// Gives a slot held in a shared store back when its lease is dropped.
pub(crate) trait ReleaseSlot: Send + Sync {
    fn release(&self, tier: &Tier, tenant: Option<&TenantId>);
}

impl SlotLease {
    pub(crate) fn new(tier: Tier, tenant: Option<TenantId>, holder: Holder) -> Self {
        SlotLease {
            tier,
            tenant,
            holder,
            fallback: false,
            room: u32::MAX,
        }
    }

    /// Records how many more calls the caps had room for when this slot was taken.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn with_room(mut self, room: u32) -> Self {
        self.room = room;
        self
    }

    /// How many more calls could have had a slot when this one was taken: 0 when it took
    /// the last (Redis), so the next call waits for a wake-up instead of trying.
    pub(crate) fn room(&self) -> u32 {
        self.room
    }

    /// Marks a local lease taken because Redis was away.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn mark_fallback(mut self) -> Self {
        self.fallback = true;
        self
    }

    /// Whether the slot came from the in-process fallback of a Redis store that was away.
    pub fn is_fallback(&self) -> bool {
        self.fallback
    }

    /// The tier the slot counts against.
    pub fn tier(&self) -> &Tier {
        &self.tier
    }

    /// The tenant the slot also counts against (`None`: its tier caps no tenant, or the
    /// acquire named none).
    pub fn tenant(&self) -> Option<&TenantId> {
        self.tenant.as_ref()
    }

    /// Whether the slot was taken in Redis (`false`: in this process, memory store or
    /// fallback).
    pub fn is_shared(&self) -> bool {
        match self.holder {
            Holder::Local(_) => false,
            Holder::Shared(_) => !self.fallback,
        }
    }
}

impl Drop for SlotLease {
    fn drop(&mut self) {
        match &self.holder {
            Holder::Local(slots) => slots.release(&self.tier, self.tenant.as_ref()),
            Holder::Shared(lease) => lease.release(&self.tier, self.tenant.as_ref()),
        }
    }
}

impl fmt::Debug for SlotLease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SlotLease")
            .field("tier", &self.tier)
            .field("tenant", &self.tenant)
            .field("shared", &self.is_shared())
            .finish()
    }
}

#[derive(Debug, Default)]
struct Counts {
    global: u32,
    tiers: HashMap<Tier, u32>,
    /// Only for tiers that cap tenants; an entry lives while the tenant holds a slot.
    tenants: HashMap<(Tier, TenantId), u32>,
}

/// Slots counted in this process: the memory store's, and the Redis store's fallback.
#[derive(Debug, Default)]
pub(crate) struct LocalSlots {
    counts: Mutex<Counts>,
    /// Wakes every local waiter when a slot may have come free (a local release, or one
    /// announced by another worker); they try again and the caps decide who gets it.
    pub(crate) released: Notify,
}

impl LocalSlots {
    /// Takes a slot if the global and tier counts (and, when `limits` caps tenants and a
    /// tenant is named, the tenant's count) are under their caps.
    pub(crate) fn try_acquire(
        self: &Arc<Self>,
        tier: &Tier,
        tenant: Option<&TenantId>,
        limits: SlotLimits,
    ) -> Result<SlotLease, SlotRefusal> {
        let capped = limits.tenant.zip(tenant);
        let mut counts = crate::sync::lock(&self.counts);
        let held = counts.tiers.get(tier).copied().unwrap_or(0);
        if counts.global >= limits.global || held >= limits.tier {
            return Err(SlotRefusal::Full);
        }
        let tenant = match capped {
            None => None,
            Some((cap, tenant)) => {
                let key = (tier.clone(), tenant.clone());
                let mine = counts.tenants.get(&key).copied().unwrap_or(0);
                if mine >= cap {
                    return Err(SlotRefusal::TenantCap);
                }
                counts.tenants.insert(key, mine + 1);
                Some(tenant.clone())
            }
        };
        counts.global += 1;
        match counts.tiers.get_mut(tier) {
            Some(count) => *count = held + 1,
            None => {
                counts.tiers.insert(tier.clone(), 1);
            }
        }
        Ok(SlotLease::new(
            tier.clone(),
            tenant,
            Holder::Local(self.clone()),
        ))
    }

    fn release(&self, tier: &Tier, tenant: Option<&TenantId>) {
        let mut counts = crate::sync::lock(&self.counts);
        counts.global = counts.global.saturating_sub(1);
        // A tier's count stays at zero: tiers are the policy's, so few, and the next
        // acquire of the tier finds its entry.
        if let Some(held) = counts.tiers.get_mut(tier) {
            *held = held.saturating_sub(1);
        }
        if let Some(tenant) = tenant {
            let key = (tier.clone(), tenant.clone());
            if let Some(mine) = counts.tenants.get_mut(&key) {
                *mine = mine.saturating_sub(1);
                if *mine == 0 {
                    counts.tenants.remove(&key);
                }
            }
        }
        drop(counts);
        self.released.notify_waiters();
    }

    /// Slots held in this process: all tiers (`None`) or one.
    pub(crate) fn in_use(&self, tier: Option<&Tier>) -> u32 {
        let counts = crate::sync::lock(&self.counts);
        match tier {
            None => counts.global,
            Some(tier) => counts.tiers.get(tier).copied().unwrap_or(0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(global: u32, tier: u32, tenant: Option<u32>) -> SlotLimits {
        SlotLimits {
            global,
            tier,
            tenant,
            lease_ttl: Duration::from_secs(30),
        }
    }

    #[test]
    fn a_tenant_at_its_cap_is_refused_for_its_cap_and_others_still_get_slots() {
        let slots = Arc::new(LocalSlots::default());
        let (free, a, b) = (Tier::new("free"), TenantId::new("a"), TenantId::new("b"));
        let capped = limits(10, 5, Some(2));
        let held: Vec<_> = (0..2)
            .map(|_| slots.try_acquire(&free, Some(&a), capped).unwrap())
            .collect();
        assert_eq!(held[0].tenant(), Some(&a));
        assert_eq!(
            slots.try_acquire(&free, Some(&a), capped).unwrap_err(),
            SlotRefusal::TenantCap
        );
        let other = slots.try_acquire(&free, Some(&b), capped).unwrap();
        assert_eq!(slots.in_use(Some(&free)), 3);
        drop(held);
        let again = slots.try_acquire(&free, Some(&a), capped).unwrap();
        drop((other, again));
        assert_eq!(slots.in_use(None), 0);
        assert!(crate::sync::lock(&slots.counts).tenants.is_empty());
    }

    #[test]
    fn a_full_tier_is_refused_as_full_before_the_tenant_cap() {
        let slots = Arc::new(LocalSlots::default());
        let (free, a) = (Tier::new("free"), TenantId::new("a"));
        let capped = limits(10, 2, Some(1));
        let _one = slots.try_acquire(&free, Some(&a), capped).unwrap();
        let _two = slots
            .try_acquire(&free, Some(&TenantId::new("b")), capped)
            .unwrap();
        assert_eq!(
            slots.try_acquire(&free, Some(&a), capped).unwrap_err(),
            SlotRefusal::Full
        );
    }

    #[test]
    fn without_a_tenant_cap_nothing_is_counted_per_tenant() {
        let slots = Arc::new(LocalSlots::default());
        let (free, a) = (Tier::new("free"), TenantId::new("a"));
        let leases: Vec<_> = (0..4)
            .map(|_| {
                slots
                    .try_acquire(&free, Some(&a), limits(10, 4, None))
                    .unwrap()
            })
            .collect();
        assert!(leases.iter().all(|lease| lease.tenant().is_none()));
        assert!(crate::sync::lock(&slots.counts).tenants.is_empty());
        // A cap with no tenant named counts nothing per tenant either.
        drop(leases);
        let lease = slots
            .try_acquire(&free, None, limits(10, 4, Some(1)))
            .unwrap();
        assert!(lease.tenant().is_none());
        assert!(crate::sync::lock(&slots.counts).tenants.is_empty());
    }

    #[test]
    fn tenants_are_counted_per_tier() {
        let slots = Arc::new(LocalSlots::default());
        let a = TenantId::new("a");
        let capped = limits(10, 5, Some(1));
        let _free = slots
            .try_acquire(&Tier::new("free"), Some(&a), capped)
            .unwrap();
        let _pro = slots
            .try_acquire(&Tier::new("pro"), Some(&a), capped)
            .unwrap();
    }
}
