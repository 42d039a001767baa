//! The in-process state: the whole store for one worker, and the fallback of the Redis store
//! while Redis is unreachable.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::time::Instant;

use super::Demotion;
use super::slots::LocalSlots;
use crate::TenantId;
use crate::priority_classify::DemotionPolicy;

const SECONDS_PER_DAY: u64 = 86_400;

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

#[derive(Debug)]
struct Tenants {
    map: HashMap<TenantId, TenantState>,
    last_sweep: Instant,
}

/// Everything the store keeps, in one process.
#[derive(Debug)]
pub(crate) struct MemoryState {
    throttle_window: Duration,
    /// Wall clock at `started`: the UTC day follows tokio's clock, so paused-time tests can
    /// cross midnight.
    started: Instant,
    started_wall: Duration,
    tenants: Mutex<Tenants>,
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
            tenants: Mutex::new(Tenants {
                map: HashMap::new(),
                last_sweep: now,
            }),
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

    /// Runs `f` on the tenant's state, creating it if needed, then sweeps now and then.
    fn with_tenant<T>(
        &self,
        tenant: &TenantId,
        f: impl FnOnce(&mut TenantState, Instant) -> T,
    ) -> T {
        let now = Instant::now();
        let mut tenants = crate::sync::lock(&self.tenants);
        let state = match tenants.map.get_mut(tenant) {
            Some(state) => state,
            None => tenants.map.entry(tenant.clone()).or_default(),
        };
        let out = f(state, now);
        if now.saturating_duration_since(tenants.last_sweep) >= Duration::from_secs(1) {
            self.sweep(&mut tenants, now);
        }
        out
    }

    /// Drops tenants with nothing left to remember; O(tenants) at most once a second.
    fn sweep(&self, tenants: &mut Tenants, now: Instant) {
        let today = self.utc_day(now);
        let window = self.throttle_window;
        let mut demoted = 0usize;
        tenants.map.retain(|_, state| {
            state.trim_throttles(now, window);
            if state.demoted_for(now).is_some() {
                demoted += 1;
            }
            !state.is_empty(now, today)
        });
        tenants.last_sweep = now;
        if self.reports_gauges {
            crate::metrics::demoted_tenants(demoted);
        }
    }

    pub(crate) fn record_throttle(&self, tenant: &TenantId) -> u32 {
        let window = self.throttle_window;
        self.with_tenant(tenant, |state, now| {
            state.trim_throttles(now, window);
            state.throttles.push_back(now);
            u32::try_from(state.throttles.len()).unwrap_or(u32::MAX)
        })
    }

    pub(crate) fn throttle_count(&self, tenant: &TenantId) -> u32 {
        let window = self.throttle_window;
        self.with_tenant(tenant, |state, now| {
            state.trim_throttles(now, window);
            u32::try_from(state.throttles.len()).unwrap_or(u32::MAX)
        })
    }

    pub(crate) fn add_tokens(&self, tenant: &TenantId, tokens: u64) -> u64 {
        self.with_tenant(tenant, |state, now| {
            Self::count_tokens(state, self.utc_day(now), tokens)
        })
    }

    fn count_tokens(state: &mut TenantState, today: u64, tokens: u64) -> u64 {
        if state.day != today {
            state.day = today;
            state.tokens = 0;
        }
        state.tokens = state.tokens.saturating_add(tokens);
        state.tokens
    }

    pub(crate) fn tokens_today(&self, tenant: &TenantId) -> u64 {
        self.with_tenant(tenant, |state, now| state.tokens_on(self.utc_day(now)))
    }

    pub(crate) fn set_daily_budget(&self, tenant: &TenantId, budget: Option<u64>) {
        self.with_tenant(tenant, |state, _| state.budget = budget)
    }

    pub(crate) fn daily_budget(&self, tenant: &TenantId) -> Option<u64> {
        self.with_tenant(tenant, |state, _| state.budget)
    }

    pub(crate) fn demoted_for(&self, tenant: &TenantId) -> Option<Duration> {
        self.with_tenant(tenant, |state, now| state.demoted_for(now))
    }

    /// The same rule as `scripts/check_demotion.lua`, under one lock.
    pub(crate) fn check_demotion(&self, tenant: &TenantId, policy: &DemotionPolicy) -> Demotion {
        self.with_tenant(tenant, |state, now| self.demotion(state, now, policy))
    }

    /// A classification in one lock: the demotion check, then the job's tokens.
    pub(crate) fn admit(
        &self,
        tenant: &TenantId,
        policy: &DemotionPolicy,
        tokens: u64,
    ) -> Demotion {
        self.with_tenant(tenant, |state, now| {
            let demotion = self.demotion(state, now, policy);
            Self::count_tokens(state, self.utc_day(now), tokens);
            demotion
        })
    }

    fn demotion(&self, state: &mut TenantState, now: Instant, policy: &DemotionPolicy) -> Demotion {
        if let Some(left) = state.demoted_for(now) {
            return Demotion::Demoted { left, newly: false };
        }
        state.trim_throttles(now, self.throttle_window);
        let throttles = u64::try_from(state.throttles.len()).unwrap_or(u64::MAX);
        let tokens = state.tokens_on(self.utc_day(now));
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
