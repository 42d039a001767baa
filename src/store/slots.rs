//! Slots: how many calls are in flight, globally and per tier.
//!
//! A slot is held through a [`SlotLease`], an RAII guard: dropping it gives the slot back.
//! In process ([`LocalSlots`]) a slot is a pair of counters. On Redis a slot is a lease: a
//! member of two sorted sets (global and tier) scored by its expiry, renewed by a heartbeat
//! while held, so the slots of a crashed worker come back within one lease TTL.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;

use crate::Tier;

/// The caps one acquire is checked against, and how long a Redis lease lives unrenewed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotLimits {
    /// Most slots held at once across all tiers.
    pub global: u32,
    /// Most slots held at once by this tier.
    pub tier: u32,
    /// How long a lease lives without a heartbeat (Redis only).
    pub lease_ttl: Duration,
}

impl SlotLimits {
    /// The caps shrunk for one of `workers` processes sharing them (at least 1 each).
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn share_of(self, workers: u32) -> SlotLimits {
        SlotLimits {
            global: super::per_worker(self.global, workers),
            tier: super::per_worker(self.tier, workers),
            lease_ttl: self.lease_ttl,
        }
    }
}

/// A held slot. Dropping it gives the slot back (on Redis: at once by a best-effort
/// release, at the latest when the lease expires).
#[must_use = "dropping the lease gives the slot back at once"]
pub struct SlotLease {
    tier: Tier,
    holder: Holder,
    fallback: bool,
}

pub(crate) enum Holder {
    Local(Arc<LocalSlots>),
    #[cfg(feature = "redis")]
    Redis(super::redis::RedisLease),
}

impl SlotLease {
    pub(crate) fn new(tier: Tier, holder: Holder) -> Self {
        SlotLease {
            tier,
            holder,
            fallback: false,
        }
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

    /// Whether the slot was taken in Redis (`false`: in this process, memory store or
    /// fallback).
    pub fn is_shared(&self) -> bool {
        match self.holder {
            Holder::Local(_) => false,
            #[cfg(feature = "redis")]
            Holder::Redis(_) => !self.fallback,
        }
    }
}

impl Drop for SlotLease {
    fn drop(&mut self) {
        match &self.holder {
            Holder::Local(slots) => slots.release(&self.tier),
            #[cfg(feature = "redis")]
            Holder::Redis(lease) => lease.release(&self.tier),
        }
    }
}

impl fmt::Debug for SlotLease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SlotLease")
            .field("tier", &self.tier)
            .field("shared", &self.is_shared())
            .finish()
    }
}

#[derive(Debug, Default)]
struct Counts {
    global: u32,
    tiers: HashMap<Tier, u32>,
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
    /// Takes a slot if both counts are under their caps.
    pub(crate) fn try_acquire(
        self: &Arc<Self>,
        tier: &Tier,
        limits: SlotLimits,
    ) -> Option<SlotLease> {
        let mut counts = crate::sync::lock(&self.counts);
        let held = counts.tiers.get(tier).copied().unwrap_or(0);
        if counts.global >= limits.global || held >= limits.tier {
            return None;
        }
        counts.global += 1;
        counts.tiers.insert(tier.clone(), held + 1);
        Some(SlotLease::new(tier.clone(), Holder::Local(self.clone())))
    }

    fn release(&self, tier: &Tier) {
        let mut counts = crate::sync::lock(&self.counts);
        counts.global = counts.global.saturating_sub(1);
        if let Some(held) = counts.tiers.get_mut(tier) {
            *held = held.saturating_sub(1);
            if *held == 0 {
                counts.tiers.remove(tier);
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
