//! The kinds of shared state a [`Store`](super::Store) keeps, one trait each, each with a
//! memory implementation (`memory.rs`) and a Redis one (`redis.rs`, `redis/`):
//!
//! | kind | what it holds |
//! |---|---|
//! | [`Tenants`] | throttles, daily input tokens, daily budgets and demotion per tenant |
//! | [`Cooldowns`] | the cooldown gate of each upstream after a 429 |
//! | [`RateBuckets`] | configured pacing and the learned limits of each upstream key |
//! | [`SlotLeases`] | slot leases (global, tier, tenant) and the wake-ups of freed slots |
//! | [`ServedCosts`] | cost served per tenant, and the fleet's fairness index |
//!
//! A store's backend implements them all ([`AllKinds`]); the `Store` methods of the same
//! names say what each operation promises.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::pacing::{LearnedLimits, PaceAsk, PaceGrant, PaceLimit};
use super::slots::{SlotLease, SlotLimits, SlotQueue, SlotRefusal};
use super::{Demotion, SlotWakes, StoreFuture, StoreUnavailable, TopServed};
use crate::admission::DemotionPolicy;
use crate::{TenantId, Tier};

/// Throttles, daily input tokens, daily budgets and demotion, per tenant.
pub(crate) trait Tenants: Send + Sync {
    fn record_throttle(&self, tenant: &TenantId) -> StoreFuture<u32>;
    fn throttle_count(&self, tenant: &TenantId) -> StoreFuture<u32>;
    fn add_tokens(&self, tenant: &TenantId, tokens: u64);
    /// Corrects today's count by `diff` (a settled call's usage against its charge); the
    /// count never goes below 0.
    fn correct_tokens(&self, tenant: &TenantId, diff: i64);
    fn tokens_today(&self, tenant: &TenantId) -> StoreFuture<u64>;
    fn set_daily_budget(
        &self,
        tenant: &TenantId,
        tokens: Option<u64>,
    ) -> StoreFuture<Result<(), StoreUnavailable>>;
    fn daily_budget(&self, tenant: &TenantId) -> StoreFuture<Option<u64>>;
    fn demoted_for(&self, tenant: &TenantId) -> StoreFuture<Option<Duration>>;
    fn check_demotion(&self, tenant: &TenantId, policy: &DemotionPolicy) -> StoreFuture<Demotion>;
    /// The tokens left of the tenant's daily budget, when known without a round trip.
    fn budget_left(&self, tenant: &TenantId, policy: &DemotionPolicy) -> Option<u64>;
    /// [`check_demotion`](Self::check_demotion) at `now` (the caller's clock read; Redis
    /// keeps its own time), then [`add_tokens`](Self::add_tokens).
    fn check_demotion_then_add_tokens(
        &self,
        tenant: &TenantId,
        policy: &DemotionPolicy,
        tokens: u64,
        now: Instant,
    ) -> StoreFuture<Demotion> {
        let _ = now;
        let check = self.check_demotion(tenant, policy);
        self.add_tokens(tenant, tokens);
        check
    }
}

/// The cooldown gate of each upstream: closed after a throttle until its delay is over.
pub(crate) trait Cooldowns: Send + Sync {
    fn extend_cooldown(&self, upstream: &str, delay: Duration) -> StoreFuture<Duration>;
    /// Never a round trip.
    fn cooldown(&self, upstream: &str) -> Option<Duration>;
}

/// The buckets calls to an upstream take cells from: configured pacing, and the limits
/// learned from the provider's headers.
pub(crate) trait RateBuckets: Send + Sync {
    fn pace(&self, key: &str, limits: &[PaceLimit]) -> StoreFuture<Duration>;
    fn learned_limits(&self, key: &str) -> StoreFuture<LearnedLimits>;
    fn pace_learned(&self, key: &str, ask: &PaceAsk) -> StoreFuture<PaceGrant>;
}

/// Slot leases under the global, tier and tenant caps, and how a freed slot reaches a
/// waiter: in process every waiter hears of every release; on Redis a release wakes the
/// worker of the next flow in the fleet's order.
pub(crate) trait SlotLeases: Send + Sync {
    /// Takes a slot if the caps have room; `queue`: on Redis, queue the call's flow for a
    /// wake-up if refused.
    fn acquire_slot(
        &self,
        tier: &Tier,
        tenant: Option<&TenantId>,
        limits: SlotLimits,
        queue: Option<SlotQueue>,
    ) -> StoreFuture<Result<SlotLease, SlotRefusal>>;
    fn slots_in_use(&self, tier: Option<&Tier>) -> StoreFuture<u32>;
    fn alive_workers(&self) -> u32;
    /// The wake-ups received since the last call; `None` when releases only notify
    /// [`released`](Self::released).
    fn take_wakes(&self) -> Option<SlotWakes> {
        None
    }
    /// Passes `n` wake-ups of `flow` in `tier` on to the next flow in the fleet's order;
    /// with `leave`, this worker leaves the flow.
    fn pass_on_wakes(&self, tier: &Tier, flow: &str, n: usize, leave: bool) {
        let _ = (tier, flow, n, leave);
    }
    /// Whether a freed slot wakes one queued worker rather than every local waiter.
    fn wakes_per_freed_slot(&self) -> bool {
        false
    }
    /// What a waiter of `tier` waits on while freed slots wake one worker each.
    fn wake_for(&self, tier: &Tier) -> Option<Arc<tokio::sync::Notify>> {
        let _ = tier;
        None
    }
    /// Notified whenever a slot may have come free.
    fn released(&self) -> &tokio::sync::Notify;
    /// The input tokens answered calls used beyond (or, negative, short of) the estimates
    /// the fleet's token rate took for them: corrects that rate (Redis: with this worker's
    /// next slot release; the memory store has no fleet's rate).
    fn correct_fleet_tokens(&self, diff: i64) {
        let _ = diff;
    }
}

/// Cost served per tenant over the last minute, and the fleet's fairness index.
pub(crate) trait ServedCosts: Send + Sync {
    /// `cost` served for `tenant` at `at`, the caller's clock read (the store reads none).
    fn add_served_cost(&self, tenant: &TenantId, cost: u64, at: Instant);
    fn served_cost(&self, tenant: &TenantId) -> StoreFuture<u64>;
    /// The `n` tenants served most in the window, and the total of all.
    fn top_served(&self, n: usize) -> StoreFuture<TopServed>;
    /// A fair queue's dispatch, for an index shared by the fleet (nothing to keep in one
    /// process: the fair queue's own index is the index).
    fn add_fairness(&self, tenant: &TenantId, weight: u32, cost: u64, queued: bool) {
        let _ = (tenant, weight, cost, queued);
    }
    /// The fleet's index, when one is known.
    fn fleet_fairness_index(&self) -> Option<Option<f64>> {
        None
    }
}

/// Every kind at once: what a store's backend is.
pub(crate) trait AllKinds:
    Tenants + Cooldowns + RateBuckets + SlotLeases + ServedCosts
{
}

impl<T: Tenants + Cooldowns + RateBuckets + SlotLeases + ServedCosts> AllKinds for T {}
