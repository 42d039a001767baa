//! What each tenant has left of its daily budget, as this worker last saw it, so that an
//! answer can say so without a round trip of its own.
//!
//! The demotion check (`scripts/check_demotion.lua`) already reads the tenant's tokens
//! today and its budget; it returns them too, and they are kept here with what this worker
//! counted for the tenant since (its charges and settlements, which reach Redis only with
//! the next flush). The day's end comes from the server's clock with the same answer, so
//! the count restarts when Redis's does.
//!
//! Kept in swept per-tenant tables (`store/swept.rs`): 100,000 end users that went quiet
//! give their memory back over the calls that follow.

use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

use crate::TenantId;
use crate::store::swept::{SHARDS, Sweeper, SweptTable, TenantHasher};

/// How long an answer from Redis is used at least: longer than a call may wait and run, so
/// that the check its classification made still holds when its answer is told.
const SEEN_FOR: Duration = Duration::from_secs(300);

/// The largest budget the demotion script answers exactly (its numbers are doubles); a
/// budget it answers at or past it is none at all.
const LUA_EXACT: u64 = 1 << 53;

/// A budget as the demotion script answered it: at or past [`LUA_EXACT`], none (u64::MAX).
pub(super) fn from_lua(budget: u64) -> u64 {
    if budget >= LUA_EXACT {
        u64::MAX
    } else {
        budget
    }
}

/// One tenant's budget as Redis told it, plus this worker's counts since.
#[derive(Debug, Clone, Copy)]
struct Seen {
    used: u64,
    budget: u64,
    /// When the server's UTC day ends: from then on the day's count starts at zero.
    day_ends: Instant,
    /// Until when the answer is used (a demotion running: no check is made meanwhile).
    keep_until: Instant,
}

impl Seen {
    /// Moves to the next day if this one ended; the count is then this worker's alone.
    fn roll(&mut self, now: Instant) {
        while now >= self.day_ends {
            self.used = 0;
            self.day_ends = crate::time::after(self.day_ends, Duration::from_secs(86_400));
        }
    }
}

/// Per tenant, the budget as last seen.
#[derive(Debug)]
pub(super) struct BudgetsSeen {
    hasher: TenantHasher,
    shards: Box<[Mutex<SweptTable<Seen>>]>,
    sweeper: Sweeper,
}

/// What a demotion check read of the tenant's budget.
#[derive(Debug, Clone, Copy)]
pub(super) struct BudgetRead {
    /// Tokens today in Redis, plus this worker's counts not sent yet.
    pub(super) used: u64,
    /// The tenant's own budget, else the policy's default.
    pub(super) budget: u64,
    /// Until the server's UTC day ends.
    pub(super) day_left: Duration,
    /// Time left on a demotion running (zero: none).
    pub(super) demoted_for: Duration,
}

impl BudgetsSeen {
    pub(super) fn new() -> Self {
        BudgetsSeen {
            hasher: TenantHasher::default(),
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
            sweeper: Sweeper::default(),
        }
    }

    fn with<T>(&self, tenant: &TenantId, f: impl FnOnce(&mut SweptTable<Seen>, u64) -> T) -> T {
        let hash = self.hasher.hash(tenant);
        let out = f(
            &mut crate::sync::lock(&self.shards[TenantHasher::shard(hash)]),
            hash,
        );
        self.sweep(Instant::now());
        out
    }

    fn sweep(&self, now: Instant) {
        self.sweeper
            .step(&self.shards, |_, seen| seen.keep_until > now);
    }

    /// A demotion check's answer, at `now`.
    pub(super) fn seen(&self, tenant: &TenantId, read: BudgetRead, now: Instant) {
        let seen = Seen {
            used: read.used,
            budget: read.budget,
            day_ends: crate::time::after(now, read.day_left),
            keep_until: crate::time::after(now, SEEN_FOR.max(read.demoted_for)),
        };
        self.with(tenant, |shard, hash| {
            *shard.get_or_insert_with(hash, tenant, || seen) = seen;
        });
    }

    /// `n` tokens counted by this worker for `tenant` (negative: a correction down); only
    /// a tenant already seen is kept.
    pub(super) fn count(&self, tenant: &TenantId, n: i64) {
        let now = Instant::now();
        self.with(tenant, |shard, hash| {
            if let Some(seen) = shard.get_mut(hash, tenant) {
                seen.roll(now);
                seen.used = seen.used.saturating_add_signed(n);
            }
        });
    }

    /// The tokens `tenant` has left today, if seen recently enough.
    pub(super) fn left(&self, tenant: &TenantId) -> Option<u64> {
        let now = Instant::now();
        let hash = self.hasher.hash(tenant);
        let mut shard = crate::sync::lock(&self.shards[TenantHasher::shard(hash)]);
        let seen = shard.get_mut(hash, tenant)?;
        if seen.keep_until <= now {
            return None;
        }
        seen.roll(now);
        Some(seen.budget.saturating_sub(seen.used))
    }

    #[cfg(test)]
    fn tenants(&self) -> usize {
        self.shards.iter().map(|s| crate::sync::lock(s).len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::swept::SWEEP_EVERY;

    fn read(used: u64, budget: u64) -> BudgetRead {
        BudgetRead {
            used,
            budget,
            day_left: Duration::from_secs(60),
            demoted_for: Duration::ZERO,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn what_is_left_goes_down_with_this_workers_counts_and_restarts_with_the_day() {
        let seen = BudgetsSeen::new();
        let (a, b) = (TenantId::new("svc/a"), TenantId::new("svc/b"));
        assert_eq!(seen.left(&a), None, "never checked: not known");
        seen.count(&a, 10);
        assert_eq!(seen.left(&a), None, "a count alone creates no entry");
        seen.seen(&a, read(100, 1_000), Instant::now());
        seen.seen(&b, read(0, 500), Instant::now());
        assert_eq!(seen.left(&a), Some(900));
        seen.count(&a, 300);
        seen.count(&a, -50);
        assert_eq!(seen.left(&a), Some(650));
        assert_eq!(seen.left(&b), Some(500), "per tenant");
        seen.count(&a, 10_000);
        assert_eq!(seen.left(&a), Some(0), "never below zero");
        tokio::time::advance(Duration::from_secs(60)).await;
        assert_eq!(seen.left(&a), Some(1_000), "the server's day ended");
        seen.count(&a, 1);
        assert_eq!(seen.left(&a), Some(999));
    }

    #[tokio::test(start_paused = true)]
    async fn an_answer_is_kept_through_a_demotion_and_forgotten_after() {
        let seen = BudgetsSeen::new();
        let quiet = TenantId::new("quiet");
        let demoted = TenantId::new("demoted");
        seen.seen(&quiet, read(1, 10), Instant::now());
        let mut long = read(20, 10);
        long.demoted_for = SEEN_FOR * 2;
        long.day_left = SEEN_FOR * 4;
        seen.seen(&demoted, long, Instant::now());
        tokio::time::advance(SEEN_FOR).await;
        assert_eq!(seen.left(&quiet), None, "too old to tell");
        assert_eq!(
            seen.left(&demoted),
            Some(0),
            "no check is made while demoted"
        );
        tokio::time::advance(SEEN_FOR).await;
        // Calls of other tenants sweep the quiet ones away.
        let busy = TenantId::new("busy");
        seen.seen(&busy, read(0, 10), Instant::now());
        for _ in 0..SWEEP_EVERY * SHARDS * 2 {
            seen.count(&busy, 1);
        }
        assert_eq!(seen.tenants(), 1);
    }
}
