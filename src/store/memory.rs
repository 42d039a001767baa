//! The in-process state: the whole store for one worker, and the fallback of the Redis store
//! while Redis is unreachable.
//!
//! Per-tenant state lives in sharded tables swept a few buckets per call (`swept.rs`): no
//! call does cleanup work the size of all the tenants. The UTC day rolling over is not an
//! event at all: a tenant's tokens carry their day, yesterday's read as zero, and the sweep
//! forgets tenants left with nothing over the calls that follow, shrinking the tables as
//! they empty.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::time::Instant;

use super::kinds;
use super::pacing::{LearnedLimits, PaceAsk, PaceGrant, PaceLimit};
use super::slots::{LocalSlots, SlotLease, SlotLimits, SlotQueue, SlotRefusal};
use super::swept::{SHARDS, Sweeper, SweptTable, TenantHasher};
#[cfg(test)]
use super::swept::{SWEEP_BUDGET, SWEEP_EVERY};
use super::{Demotion, StoreFuture, StoreUnavailable};
use crate::admission::DemotionPolicy;
use crate::{TenantId, Tier};

const SECONDS_PER_DAY: u64 = 86_400;

/// The clock as one store call reads it: the instant and its UTC day.
#[derive(Clone, Copy)]
struct Moment {
    now: Instant,
    today: u64,
}

/// Per-tenant state. A tenant whose state is all empty is dropped by the sweep.
#[derive(Debug, Default)]
struct TenantState {
    /// When each throttle in the window happened, oldest first.
    throttles: VecDeque<Instant>,
    /// The UTC day `tokens` counts for.
    day: u64,
    tokens: u64,
    budget: Option<u64>,
    demoted_until: Option<Instant>,
}

impl TenantState {
    fn trim_throttles(&mut self, now: Instant, window: Duration) {
        while let Some(&oldest) = self.throttles.front() {
            if now.saturating_duration_since(oldest) >= window {
                self.throttles.pop_front();
            } else {
                break;
            }
        }
    }

    fn tokens_on(&self, day: u64) -> u64 {
        if self.day == day { self.tokens } else { 0 }
    }

    fn demoted_for(&self, now: Instant) -> Option<Duration> {
        self.demoted_until
            .map(|until| until.saturating_duration_since(now))
            .filter(|left| !left.is_zero())
    }

    fn is_empty(&self, now: Instant, today: u64) -> bool {
        self.throttles.is_empty()
            && self.tokens_on(today) == 0
            && self.budget.is_none()
            && self.demoted_for(now).is_none()
    }
}

/// Everything the store keeps, in one process.
#[derive(Debug)]
pub(crate) struct MemoryState {
    throttle_window: Duration,
    /// Wall clock at `started`: the UTC day follows tokio's clock, so paused-time tests can
    /// cross midnight.
    started: Instant,
    started_wall: Duration,
    hasher: TenantHasher,
    /// Per-tenant state in [`SHARDS`] tables, each swept a few buckets per call
    /// (see `swept.rs`): no call cleans up more than [`SWEEP_BUDGET`] buckets, and no table
    /// holds more than its share of the tenants, so no call waits on work the size of all
    /// the tenants.
    shards: Box<[Mutex<SweptTable<TenantState>>]>,
    /// The shard being swept. Every few calls sweep a few buckets of it, whichever tenant
    /// the call is about, and the sweep moves on when it reached the shard's end.
    sweeper: Sweeper,
    /// Tenants whose `demoted_until` is set (one whose demotion ran out counts until a call
    /// or the sweep clears it).
    demoted: AtomicUsize,
    /// When `claude_demoted_tenants` was last published, in ms after `started`.
    gauge_published: AtomicU64,
    /// Whether this state publishes `claude_demoted_tenants` (not when it is a fallback).
    reports_gauges: bool,
    pub(crate) slots: Arc<LocalSlots>,
    /// Served cost per tenant (`served.rs`).
    pub(super) served: super::served::ServedCost,
    /// Upstream cooldown gates (on the Redis store: this worker's copy of the shared ones).
    /// Boxed, like `pacers`, to keep the store's backend enum small.
    pub(crate) cooldowns: Box<super::cooldown::CooldownGates>,
    /// Shared pacing (on the Redis store: the fallback while Redis is down).
    pub(crate) pacers: Box<super::pacing::Pacers>,
}

impl MemoryState {
    pub(crate) fn new(throttle_window: Duration, reports_gauges: bool) -> Self {
        let now = Instant::now();
        MemoryState {
            throttle_window,
            started: now,
            started_wall: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap_or_default(),
            hasher: TenantHasher::default(),
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
            sweeper: Sweeper::default(),
            demoted: AtomicUsize::new(0),
            gauge_published: AtomicU64::new(0),
            reports_gauges,
            slots: Arc::new(LocalSlots::default()),
            served: super::served::ServedCost::new(),
            cooldowns: Default::default(),
            pacers: Default::default(),
        }
    }

    fn utc_day(&self, now: Instant) -> u64 {
        let wall = self.started_wall + now.saturating_duration_since(self.started);
        wall.as_secs() / SECONDS_PER_DAY
    }

    /// The clock, read once per call: the instant and its UTC day.
    fn moment(&self) -> Moment {
        self.moment_at(Instant::now())
    }

    /// `now`, read by the caller, and its UTC day.
    fn moment_at(&self, now: Instant) -> Moment {
        Moment {
            now,
            today: self.utc_day(now),
        }
    }

    /// Runs `f` on the tenant's state, creating it if needed, then sweeps a little.
    fn with_tenant<T>(
        &self,
        tenant: &TenantId,
        f: impl FnOnce(&mut TenantState, Moment) -> T,
    ) -> T {
        self.with_tenant_at(tenant, Instant::now(), f)
    }

    /// [`with_tenant`](Self::with_tenant) at `now`, read by the caller.
    fn with_tenant_at<T>(
        &self,
        tenant: &TenantId,
        now: Instant,
        f: impl FnOnce(&mut TenantState, Moment) -> T,
    ) -> T {
        let at = self.moment_at(now);
        let hash = self.hasher.hash(tenant);
        let out = {
            let mut shard = crate::sync::lock(&self.shards[TenantHasher::shard(hash)]);
            let state = shard.get_or_insert_with(hash, tenant, TenantState::default);
            let was_demoted = state.demoted_until.is_some();
            let out = f(state, at);
            self.count_demotion(was_demoted, state, now);
            out
        };
        self.sweep(at);
        out
    }

    /// Runs `f` on the tenant's state if it has one (a read never creates an entry).
    fn read_tenant<T>(
        &self,
        tenant: &TenantId,
        f: impl FnOnce(Option<&mut TenantState>, Moment) -> T,
    ) -> T {
        let at = self.moment();
        let now = at.now;
        let hash = self.hasher.hash(tenant);
        let out = {
            let mut shard = crate::sync::lock(&self.shards[TenantHasher::shard(hash)]);
            match shard.get_mut(hash, tenant) {
                Some(state) => {
                    let was_demoted = state.demoted_until.is_some();
                    let out = f(Some(&mut *state), at);
                    self.count_demotion(was_demoted, state, now);
                    out
                }
                None => f(None, at),
            }
        };
        self.sweep(at);
        out
    }

    /// Keeps `demoted` equal to the number of tenants with `demoted_until` set, clearing a
    /// demotion that ran out.
    fn count_demotion(&self, was_demoted: bool, state: &mut TenantState, now: Instant) {
        if state.demoted_for(now).is_none() {
            state.demoted_until = None;
        }
        match (was_demoted, state.demoted_until.is_some()) {
            (false, true) => {
                self.demoted.fetch_add(1, Ordering::Relaxed);
            }
            (true, false) => {
                self.demoted.fetch_sub(1, Ordering::Relaxed);
            }
            _ => {}
        }
    }

    /// Sweeps at most [`SWEEP_BUDGET`] buckets of the next shard, dropping tenants with
    /// nothing left to remember; publishes the demoted gauge at most once a second.
    fn sweep(&self, Moment { now, today }: Moment) {
        let window = self.throttle_window;
        self.sweeper.step(&self.shards, |_, state| {
            state.trim_throttles(now, window);
            self.count_demotion(state.demoted_until.is_some(), state, now);
            !state.is_empty(now, today)
        });
        if self.reports_gauges {
            let ms = u64::try_from(now.saturating_duration_since(self.started).as_millis())
                .unwrap_or(u64::MAX);
            let last = self.gauge_published.load(Ordering::Relaxed);
            if ms.saturating_sub(last) >= 1_000
                && self
                    .gauge_published
                    .compare_exchange(last, ms, Ordering::Relaxed, Ordering::Relaxed)
                    .is_ok()
            {
                crate::metrics::demoted_tenants(self.demoted.load(Ordering::Relaxed));
            }
        }
    }

    /// Tenants the store holds state for (live or not yet swept).
    #[cfg(test)]
    fn tenants(&self) -> usize {
        self.shards.iter().map(|s| crate::sync::lock(s).len()).sum()
    }

    /// Total capacity of the per-tenant tables.
    #[cfg(test)]
    fn capacity(&self) -> usize {
        self.shards
            .iter()
            .map(|s| crate::sync::lock(s).capacity())
            .sum()
    }

    pub(crate) fn record_throttle(&self, tenant: &TenantId) -> u32 {
        let window = self.throttle_window;
        self.with_tenant(tenant, |state, at| {
            state.trim_throttles(at.now, window);
            state.throttles.push_back(at.now);
            u32::try_from(state.throttles.len()).unwrap_or(u32::MAX)
        })
    }

    pub(crate) fn throttle_count(&self, tenant: &TenantId) -> u32 {
        let window = self.throttle_window;
        self.read_tenant(tenant, |state, at| {
            state.map_or(0, |state| {
                state.trim_throttles(at.now, window);
                u32::try_from(state.throttles.len()).unwrap_or(u32::MAX)
            })
        })
    }

    pub(crate) fn add_tokens(&self, tenant: &TenantId, tokens: u64) -> u64 {
        self.with_tenant(tenant, |state, at| {
            Self::count_tokens(state, at.today, tokens)
        })
    }

    pub(crate) fn correct_tokens(&self, tenant: &TenantId, diff: i64) {
        self.with_tenant(tenant, |state, at| {
            // A correction counts toward the current day, as an addition would.
            Self::count_tokens(state, at.today, 0);
            state.tokens = state.tokens.saturating_add_signed(diff);
        })
    }

    fn count_tokens(state: &mut TenantState, today: u64, tokens: u64) -> u64 {
        // Only forward: a call that read the clock just before midnight but locked after
        // one that rolled the day over counts in the new day instead of zeroing it.
        if state.day < today {
            state.day = today;
            state.tokens = 0;
        }
        state.tokens = state.tokens.saturating_add(tokens);
        state.tokens
    }

    pub(crate) fn tokens_today(&self, tenant: &TenantId) -> u64 {
        self.read_tenant(tenant, |state, at| {
            state.map_or(0, |state| state.tokens_on(at.today))
        })
    }

    pub(crate) fn set_daily_budget(&self, tenant: &TenantId, budget: Option<u64>) {
        self.with_tenant(tenant, |state, _| state.budget = budget)
    }

    pub(crate) fn daily_budget(&self, tenant: &TenantId) -> Option<u64> {
        self.read_tenant(tenant, |state, _| state.and_then(|state| state.budget))
    }

    pub(crate) fn demoted_for(&self, tenant: &TenantId) -> Option<Duration> {
        self.read_tenant(tenant, |state, at| {
            state.and_then(|state| state.demoted_for(at.now))
        })
    }

    /// The tokens left of `tenant`'s budget today (its own, else the policy's default).
    pub(crate) fn budget_left(&self, tenant: &TenantId, policy: &DemotionPolicy) -> u64 {
        self.read_tenant(tenant, |state, at| {
            let (used, budget) =
                state.map_or((0, None), |state| (state.tokens_on(at.today), state.budget));
            budget
                .unwrap_or(policy.default_daily_budget())
                .saturating_sub(used)
        })
    }

    /// The same rule as `scripts/check_demotion.lua`, under one lock.
    pub(crate) fn check_demotion(&self, tenant: &TenantId, policy: &DemotionPolicy) -> Demotion {
        self.with_tenant(tenant, |state, at| self.demotion(state, at, policy))
    }

    /// The demotion check at `now`, then the job's tokens, in one lock.
    pub(crate) fn check_demotion_and_count(
        &self,
        tenant: &TenantId,
        policy: &DemotionPolicy,
        tokens: u64,
        now: Instant,
    ) -> Demotion {
        self.with_tenant_at(tenant, now, |state, at| {
            let demotion = self.demotion(state, at, policy);
            Self::count_tokens(state, at.today, tokens);
            demotion
        })
    }

    fn demotion(&self, state: &mut TenantState, at: Moment, policy: &DemotionPolicy) -> Demotion {
        let now = at.now;
        if let Some(left) = state.demoted_for(now) {
            return Demotion::Demoted { left, newly: false };
        }
        state.trim_throttles(now, self.throttle_window);
        let throttles = u64::try_from(state.throttles.len()).unwrap_or(u64::MAX);
        let tokens = state.tokens_on(at.today);
        let budget = state.budget.unwrap_or(policy.default_daily_budget());
        if !policy.should_demote(throttles, tokens, budget) {
            return Demotion::NotDemoted;
        }
        state.demoted_until = Some(crate::time::after(now, policy.demote_for()));
        Demotion::Demoted {
            left: policy.demote_for(),
            newly: true,
        }
    }
}

impl kinds::Tenants for MemoryState {
    fn record_throttle(&self, tenant: &TenantId) -> StoreFuture<u32> {
        StoreFuture::ready(MemoryState::record_throttle(self, tenant))
    }

    fn throttle_count(&self, tenant: &TenantId) -> StoreFuture<u32> {
        StoreFuture::ready(MemoryState::throttle_count(self, tenant))
    }

    fn add_tokens(&self, tenant: &TenantId, tokens: u64) {
        MemoryState::add_tokens(self, tenant, tokens);
    }

    fn correct_tokens(&self, tenant: &TenantId, diff: i64) {
        MemoryState::correct_tokens(self, tenant, diff);
    }

    fn tokens_today(&self, tenant: &TenantId) -> StoreFuture<u64> {
        StoreFuture::ready(MemoryState::tokens_today(self, tenant))
    }

    fn set_daily_budget(
        &self,
        tenant: &TenantId,
        tokens: Option<u64>,
    ) -> StoreFuture<Result<(), StoreUnavailable>> {
        MemoryState::set_daily_budget(self, tenant, tokens);
        StoreFuture::ready(Ok(()))
    }

    fn daily_budget(&self, tenant: &TenantId) -> StoreFuture<Option<u64>> {
        StoreFuture::ready(MemoryState::daily_budget(self, tenant))
    }

    fn demoted_for(&self, tenant: &TenantId) -> StoreFuture<Option<Duration>> {
        StoreFuture::ready(MemoryState::demoted_for(self, tenant))
    }

    fn check_demotion(&self, tenant: &TenantId, policy: &DemotionPolicy) -> StoreFuture<Demotion> {
        StoreFuture::ready(MemoryState::check_demotion(self, tenant, policy))
    }

    fn budget_left(&self, tenant: &TenantId, policy: &DemotionPolicy) -> Option<u64> {
        Some(MemoryState::budget_left(self, tenant, policy))
    }

    /// In one lock.
    fn check_demotion_then_add_tokens(
        &self,
        tenant: &TenantId,
        policy: &DemotionPolicy,
        tokens: u64,
        now: Instant,
    ) -> StoreFuture<Demotion> {
        StoreFuture::ready(self.check_demotion_and_count(tenant, policy, tokens, now))
    }
}

impl kinds::Cooldowns for MemoryState {
    fn extend_cooldown(&self, upstream: &str, delay: Duration) -> StoreFuture<Duration> {
        StoreFuture::ready(self.cooldowns.extend(upstream, delay))
    }

    fn cooldown(&self, upstream: &str) -> Option<Duration> {
        self.cooldowns.remaining(upstream)
    }
}

impl kinds::RateBuckets for MemoryState {
    fn pace(&self, key: &str, limits: &[PaceLimit]) -> StoreFuture<Duration> {
        StoreFuture::ready(self.pacers.reserve(key, limits))
    }

    fn learned_limits(&self, key: &str) -> StoreFuture<LearnedLimits> {
        StoreFuture::ready(self.pacers.learned_limits(key))
    }

    fn pace_learned(&self, key: &str, ask: &PaceAsk) -> StoreFuture<PaceGrant> {
        StoreFuture::ready(self.pacers.learned(key, ask))
    }
}

impl kinds::SlotLeases for MemoryState {
    /// A local release wakes the local waiters: nothing to queue.
    fn acquire_slot(
        &self,
        tier: &Tier,
        tenant: Option<&TenantId>,
        limits: SlotLimits,
        _queue: Option<SlotQueue>,
    ) -> StoreFuture<Result<SlotLease, SlotRefusal>> {
        StoreFuture::ready(self.slots.try_acquire(tier, tenant, limits))
    }

    fn slots_in_use(&self, tier: Option<&Tier>) -> StoreFuture<u32> {
        StoreFuture::ready(self.slots.in_use(tier))
    }

    fn alive_workers(&self) -> u32 {
        1
    }

    fn released(&self) -> &tokio::sync::Notify {
        &self.slots.released
    }
}

impl kinds::ServedCosts for MemoryState {
    fn add_served_cost(&self, tenant: &TenantId, cost: u64, at: Instant) {
        self.served.add(tenant, cost, at);
    }

    fn served_cost(&self, tenant: &TenantId) -> StoreFuture<u64> {
        StoreFuture::ready(self.served.total(tenant))
    }

    fn top_served(&self, n: usize) -> StoreFuture<super::TopServed> {
        StoreFuture::ready(self.served.top(n))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tenant(i: usize) -> TenantId {
        TenantId::new(format!("t{i}"))
    }

    /// Enough calls for every shard's sweep to make two whole passes (a shrink restarts one).
    fn sweep_all(state: &MemoryState) {
        let widest = state
            .shards
            .iter()
            .map(|s| crate::sync::lock(s).capacity())
            .max()
            .unwrap_or(0);
        let probe = TenantId::new("probe");
        for _ in 0..2 * SHARDS * SWEEP_EVERY * (2 * widest / SWEEP_BUDGET + 1) {
            state.throttle_count(&probe);
        }
    }

    #[tokio::test(start_paused = true)]
    async fn expired_state_reads_as_gone_and_is_forgotten_by_the_calls_that_follow() {
        let state = MemoryState::new(Duration::from_secs(60), false);
        let policy = DemotionPolicy::default();
        for i in 0..1_000 {
            state.record_throttle(&tenant(i));
        }
        // t0 is demoted (5 throttles), t1 has a budget, t2 tokens today.
        for _ in 0..4 {
            state.record_throttle(&tenant(0));
        }
        assert!(state.check_demotion(&tenant(0), &policy).is_demoted());
        state.set_daily_budget(&tenant(1), Some(10));
        assert_eq!(state.throttle_count(&tenant(5)), 1);

        tokio::time::advance(Duration::from_secs(61)).await;
        state.add_tokens(&tenant(2), 100);
        assert_eq!(state.throttle_count(&tenant(5)), 0, "the window slid on");
        sweep_all(&state);
        // t0 (demoted 5 min), t1 (budget), t2 (tokens today) are still live.
        assert_eq!(state.tenants(), 3);
        assert!(state.demoted_for(&tenant(0)).is_some());
        assert_eq!(state.daily_budget(&tenant(1)), Some(10));
        assert_eq!(state.tokens_today(&tenant(2)), 100);
        assert_eq!(state.demoted.load(Ordering::Relaxed), 1);

        tokio::time::advance(Duration::from_secs(5 * 60)).await;
        assert_eq!(state.demoted_for(&tenant(0)), None);
        assert_eq!(state.demoted.load(Ordering::Relaxed), 0, "counted off");
        sweep_all(&state);
        assert_eq!(state.tenants(), 2, "t0's demotion ran out");

        tokio::time::advance(Duration::from_secs(SECONDS_PER_DAY)).await;
        assert_eq!(state.tokens_today(&tenant(2)), 0, "a new day");
        sweep_all(&state);
        assert_eq!(state.tenants(), 1, "only the budget is left");
        assert_eq!(state.daily_budget(&tenant(1)), Some(10));
    }

    #[tokio::test(start_paused = true)]
    async fn a_read_never_creates_a_tenant() {
        let state = MemoryState::new(Duration::from_secs(60), false);
        for i in 0..100 {
            state.throttle_count(&tenant(i));
            state.tokens_today(&tenant(i));
            state.daily_budget(&tenant(i));
            state.demoted_for(&tenant(i));
        }
        assert_eq!(state.tenants(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_call_from_before_midnight_does_not_zero_the_new_days_tokens() {
        let state = MemoryState::new(Duration::from_secs(60), false);
        let policy = DemotionPolicy::default();
        let a = tenant(1);
        let yesterday = Instant::now();
        tokio::time::advance(Duration::from_secs(SECONDS_PER_DAY)).await;
        state.check_demotion_and_count(&a, &policy, 10, Instant::now());
        // Read the clock before midnight, took the lock after the day rolled over.
        state.check_demotion_and_count(&a, &policy, 5, yesterday);
        assert_eq!(state.tokens_today(&a), 15);
    }

    #[tokio::test(start_paused = true)]
    async fn tables_shrink_after_the_day_rolls_over() {
        let state = MemoryState::new(Duration::from_secs(60), false);
        for i in 0..50_000 {
            state.add_tokens(&tenant(i), 10);
        }
        let full = state.capacity();
        assert!(full >= 50_000);
        tokio::time::advance(Duration::from_secs(SECONDS_PER_DAY)).await;
        state.add_tokens(&tenant(7), 10);
        sweep_all(&state);
        assert_eq!(state.tenants(), 1);
        let left = state.capacity();
        assert!(left * 8 < full, "capacity {left} of {full} left");
        assert_eq!(state.tokens_today(&tenant(7)), 10);
    }

    #[tokio::test(start_paused = true)]
    async fn no_call_sweeps_more_than_its_budget() {
        let state = MemoryState::new(Duration::from_secs(60), false);
        for i in 0..50_000 {
            state.add_tokens(&tenant(i), 10);
        }
        tokio::time::advance(Duration::from_secs(SECONDS_PER_DAY)).await;
        let mut before = state.tenants();
        for _ in 0..2 * SHARDS {
            state.tokens_today(&tenant(0));
            let now = state.tenants();
            assert!(before - now <= SWEEP_BUDGET, "{before} -> {now}");
            before = now;
        }
        assert!(before < 50_000, "the sweep made progress");
    }
}
