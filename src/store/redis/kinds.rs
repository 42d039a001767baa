//! The Redis store as each kind of shared state (`store/kinds.rs`); the operations are the
//! store's own, in `redis.rs` and the files beside this one.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::RedisStore;
use crate::admission::DemotionPolicy;
use crate::store::kinds::{Cooldowns, RateBuckets, ServedCosts, SlotLeases, Tenants};
use crate::store::{
    Demotion, LearnedLimits, PaceAsk, PaceGrant, PaceLimit, SlotLease, SlotLimits, SlotQueue,
    SlotRefusal, SlotWakes, StoreFuture, StoreUnavailable, TopServed,
};
use crate::{TenantId, Tier};

impl Tenants for Arc<RedisStore> {
    fn record_throttle(&self, tenant: &TenantId) -> StoreFuture<u32> {
        RedisStore::record_throttle(self, tenant)
    }

    fn throttle_count(&self, tenant: &TenantId) -> StoreFuture<u32> {
        RedisStore::throttle_count(self, tenant)
    }

    fn add_tokens(&self, tenant: &TenantId, tokens: u64) {
        RedisStore::add_tokens(self, tenant, tokens);
    }

    fn correct_tokens(&self, tenant: &TenantId, diff: i64) {
        RedisStore::correct_tokens(self, tenant, diff);
    }

    fn tokens_today(&self, tenant: &TenantId) -> StoreFuture<u64> {
        RedisStore::tokens_today(self, tenant)
    }

    fn set_daily_budget(
        &self,
        tenant: &TenantId,
        tokens: Option<u64>,
    ) -> StoreFuture<Result<(), StoreUnavailable>> {
        RedisStore::set_daily_budget(self, tenant, tokens)
    }

    fn daily_budget(&self, tenant: &TenantId) -> StoreFuture<Option<u64>> {
        RedisStore::daily_budget(self, tenant)
    }

    fn demoted_for(&self, tenant: &TenantId) -> StoreFuture<Option<Duration>> {
        RedisStore::demoted_for(self, tenant)
    }

    fn check_demotion(&self, tenant: &TenantId, policy: &DemotionPolicy) -> StoreFuture<Demotion> {
        RedisStore::check_demotion(self, tenant, policy)
    }

    fn budget_left(&self, tenant: &TenantId, policy: &DemotionPolicy) -> Option<u64> {
        RedisStore::budget_left(self, tenant, policy)
    }
}

impl Cooldowns for Arc<RedisStore> {
    fn extend_cooldown(&self, upstream: &str, delay: Duration) -> StoreFuture<Duration> {
        RedisStore::extend_cooldown(self, upstream, delay)
    }

    /// This worker's copy, which pub/sub keeps current.
    fn cooldown(&self, upstream: &str) -> Option<Duration> {
        self.fallback.cooldowns.remaining(upstream)
    }
}

impl RateBuckets for Arc<RedisStore> {
    fn pace(&self, key: &str, limits: &[PaceLimit]) -> StoreFuture<Duration> {
        RedisStore::pace(self, key, limits)
    }

    fn learned_limits(&self, key: &str) -> StoreFuture<LearnedLimits> {
        RedisStore::learned_limits(self, key)
    }

    fn pace_learned(&self, key: &str, ask: &PaceAsk) -> StoreFuture<PaceGrant> {
        RedisStore::pace_learned(self, key, ask)
    }
}

impl SlotLeases for Arc<RedisStore> {
    fn acquire_slot(
        &self,
        tier: &Tier,
        tenant: Option<&TenantId>,
        limits: SlotLimits,
        queue: Option<SlotQueue>,
    ) -> StoreFuture<Result<SlotLease, SlotRefusal>> {
        RedisStore::try_acquire_slot(self, tier, tenant, limits, queue)
    }

    fn slots_in_use(&self, tier: Option<&Tier>) -> StoreFuture<u32> {
        RedisStore::slots_in_use(self, tier)
    }

    fn alive_workers(&self) -> u32 {
        RedisStore::alive_workers(self)
    }

    fn take_wakes(&self) -> Option<SlotWakes> {
        RedisStore::take_wakes(self)
    }

    fn pass_on_wakes(&self, tier: &Tier, flow: &str, n: usize, leave: bool) {
        RedisStore::pass_on_wakes(self, tier, flow, n, leave);
    }

    fn wakes_per_freed_slot(&self) -> bool {
        RedisStore::wakes_per_freed_slot(self)
    }

    fn wake_for(&self, tier: &Tier) -> Option<Arc<tokio::sync::Notify>> {
        RedisStore::wake_for(self, tier)
    }

    fn released(&self) -> &tokio::sync::Notify {
        RedisStore::slot_released(self)
    }

    fn correct_fleet_tokens(&self, diff: i64) {
        self.slots
            .tokens_beyond
            .fetch_add(diff, std::sync::atomic::Ordering::Relaxed);
    }
}

impl ServedCosts for Arc<RedisStore> {
    fn add_served_cost(&self, tenant: &TenantId, cost: u64, at: Instant) {
        RedisStore::add_served_cost(self, tenant, cost, at);
    }

    fn served_cost(&self, tenant: &TenantId) -> StoreFuture<u64> {
        RedisStore::served_cost(self, tenant)
    }

    fn top_served(&self, n: usize) -> StoreFuture<TopServed> {
        RedisStore::top_served(self, n)
    }

    fn add_fairness(&self, tenant: &TenantId, weight: u32, cost: u64, queued: bool) {
        RedisStore::add_fairness(self, tenant, weight, cost, queued);
    }

    fn fleet_fairness_index(&self) -> Option<Option<f64>> {
        RedisStore::fleet_fairness_index(self)
    }
}
