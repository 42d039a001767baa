//! Served cost per tenant over a sliding window: what `DrrFairness` dispatched for each
//! tenant (in estimated tokens), so every worker can compute the same fairness index.
//!
//! The in-process part: one-second buckets per tenant, at most [`SERVED_WINDOW`] of them,
//! and a tenant with nothing in the window is forgotten by the sweep, which each `add` runs
//! over a few buckets of one shard. The Redis part lives
//! in `redis/served.rs`.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

use super::swept::{SHARDS, Sweeper, SweptTable, TenantHasher};
#[cfg(test)]
use super::swept::{SWEEP_BUDGET, SWEEP_EVERY};
use super::{Store, StoreFuture};
use crate::TenantId;

/// The window served cost is summed over: the last 60 seconds (whole seconds, so a read
/// sees between 59 and 60 s of history).
pub const SERVED_WINDOW: Duration = Duration::from_secs(60);

/// The most tenants [`Store::top_served`] names.
pub const TOP_SERVED_MAX: usize = 100;

/// The tenants served most in the last [`SERVED_WINDOW`] ([`Store::top_served`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TopServed {
    /// The tenants served most, with what each was served, most first (ties by name).
    pub tenants: Vec<(TenantId, u64)>,
    /// What every tenant was served, together.
    pub total: u64,
}

impl TopServed {
    /// The `n` largest of `served`, most first, ties by name; `total` is the sum of all.
    fn of(served: impl Iterator<Item = (TenantId, u64)>, n: usize) -> TopServed {
        let mut top = BinaryHeap::with_capacity(n + 1);
        let mut total = 0u64;
        for (tenant, cost) in served.filter(|&(_, cost)| cost > 0) {
            total = total.saturating_add(cost);
            // The heap's least: the smallest cost, of the last name among equals.
            top.push((Reverse(cost), tenant));
            if top.len() > n {
                top.pop();
            }
        }
        let mut tenants: Vec<(TenantId, u64)> = top
            .into_iter()
            .map(|(Reverse(cost), tenant)| (tenant, cost))
            .collect();
        tenants.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        TopServed { tenants, total }
    }
}

/// Per tenant, (second since `started`, cost) oldest first, one entry per second.
type Buckets = VecDeque<(u64, u64)>;

/// Served cost per tenant, in one-second buckets.
///
/// Sharded and swept a few buckets per call like the tenant state (`swept.rs`), so
/// forgetting the tenants that went quiet never costs one call the time of all of them.
#[derive(Debug)]
pub(crate) struct ServedCost {
    started: Instant,
    hasher: TenantHasher,
    shards: Box<[Mutex<SweptTable<Buckets>>]>,
    /// Where the sweep is (see `swept.rs`).
    sweeper: Sweeper,
}

impl ServedCost {
    pub(crate) fn new() -> Self {
        ServedCost {
            started: Instant::now(),
            hasher: TenantHasher::default(),
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
            sweeper: Sweeper::default(),
        }
    }

    fn second(&self, at: Instant) -> u64 {
        at.saturating_duration_since(self.started).as_secs()
    }

    /// The oldest second still inside the window at `now`.
    fn oldest(now: u64) -> u64 {
        (now + 1).saturating_sub(SERVED_WINDOW.as_secs())
    }

    fn trim(buckets: &mut Buckets, now: u64) {
        while buckets.front().is_some_and(|&(s, _)| s < Self::oldest(now)) {
            buckets.pop_front();
        }
    }

    pub(crate) fn add(&self, tenant: &TenantId, cost: u64, at: Instant) {
        let now = self.second(at);
        let hash = self.hasher.hash(tenant);
        {
            let mut shard = crate::sync::lock(&self.shards[TenantHasher::shard(hash)]);
            let buckets = shard.get_or_insert_with(hash, tenant, VecDeque::new);
            match buckets.back_mut() {
                // `at` was read before the lock: a dispatch added after one that read the
                // clock later counts in that later second, so the buckets stay in order.
                Some((second, total)) if *second >= now => *total = total.saturating_add(cost),
                _ => buckets.push_back((now, cost)),
            }
            Self::trim(buckets, now);
        }
        // A few buckets of one shard: forget tenants with nothing left in the window.
        self.sweeper.step(&self.shards, |_, buckets| {
            Self::trim(buckets, now);
            !buckets.is_empty()
        });
    }

    pub(crate) fn total(&self, tenant: &TenantId) -> u64 {
        let oldest = Self::oldest(self.second(Instant::now()));
        let hash = self.hasher.hash(tenant);
        let shard = crate::sync::lock(&self.shards[TenantHasher::shard(hash)]);
        shard.get(hash, tenant).map_or(0, |buckets| {
            buckets
                .iter()
                .filter(|&&(s, _)| s >= oldest)
                .fold(0u64, |sum, &(_, c)| sum.saturating_add(c))
        })
    }

    /// The `n` tenants served most in the window. Reads every tenant remembered, one shard
    /// locked at a time: as long as the tenants in the window, kept off the request path.
    pub(crate) fn top(&self, n: usize) -> TopServed {
        let oldest = Self::oldest(self.second(Instant::now()));
        let mut served = Vec::new();
        for shard in self.shards.iter() {
            let shard = crate::sync::lock(shard);
            served.extend(shard.iter().map(|(tenant, buckets)| {
                let cost = buckets
                    .iter()
                    .filter(|&&(s, _)| s >= oldest)
                    .fold(0u64, |sum, &(_, c)| sum.saturating_add(c));
                (tenant.clone(), cost)
            }));
        }
        TopServed::of(served.into_iter(), n)
    }

    /// Tenants with served cost remembered (in the window or not yet swept).
    #[cfg(test)]
    fn tenants(&self) -> usize {
        self.shards.iter().map(|s| crate::sync::lock(s).len()).sum()
    }
}

impl Store {
    /// Adds `cost` (estimated tokens) to what was dispatched for `tenant`. `DrrFairness`
    /// calls this for every dispatch; from these counts any worker can compute the fairness
    /// across the fleet (see [`served_cost`](Store::served_cost)).
    ///
    /// Off the request path: the Redis store adds them up locally and sends them in the
    /// background with the token counts (every 250 ms by default, or on
    /// [`flush`](Store::flush)).
    pub fn add_served_cost(&self, tenant: &TenantId, cost: u64) {
        self.kinds().add_served_cost(tenant, cost, Instant::now());
    }

    /// A fair queue's dispatch of `cost` for `tenant` at `at` (its own clock read).
    pub(crate) fn add_served_cost_at(&self, tenant: &TenantId, cost: u64, at: Instant) {
        self.kinds().add_served_cost(tenant, cost, at);
    }

    /// A fair queue's dispatch for the fleet's fairness index: `cost` served for `tenant`,
    /// of tier weight `weight`, `queued` if it waited in the queue (the memory store's
    /// index is the layer's own: nothing to do).
    pub(crate) fn add_fairness(&self, tenant: &TenantId, weight: u32, cost: u64, queued: bool) {
        self.kinds().add_fairness(tenant, weight, cost, queued);
    }

    /// Jain's index over every worker's dispatches in the last [`SERVED_WINDOW`] (Redis,
    /// while it answers): `Some(None)` when no tenant waited in a queue; `None` when the
    /// fleet's is not known (memory store, Redis away, not read yet).
    pub(crate) fn fleet_fairness_index(&self) -> Option<Option<f64>> {
        self.kinds().fleet_fairness_index()
    }

    /// What was dispatched for `tenant` in the last [`SERVED_WINDOW`], as far as it was
    /// flushed (on Redis: by every worker).
    pub fn served_cost(&self, tenant: &TenantId) -> StoreFuture<u64> {
        self.kinds().served_cost(tenant)
    }

    /// The `n` tenants (at most [`TOP_SERVED_MAX`]) served most in the last
    /// [`SERVED_WINDOW`], and what every tenant was served together: who is using the
    /// upstream now, whatever their names (end users of a service included), for a live
    /// page or a periodic check, not for the request path.
    ///
    /// The memory store reads every tenant in the window. Redis keeps a ranking beside the
    /// per-tenant counts, sent with them (`scripts/served_top_add.lua`): per 10 s of server
    /// time the 1,000 tenants served most, so a read is bounded however many tenants there
    /// are, and the window is 50 to 60 s; a tenant out of a bucket's 1,000 loses that
    /// bucket's cost from its rank (the total keeps it).
    ///
    /// ```
    /// use fairgate::{Store, TenantId};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// let store = Store::memory();
    /// store.add_served_cost(&TenantId::new("svc/a"), 300);
    /// store.add_served_cost(&TenantId::new("svc/b"), 100);
    /// let top = store.top_served(1).await;
    /// assert_eq!(top.tenants, [(TenantId::new("svc/a"), 300)]);
    /// assert_eq!(top.total, 400);
    /// # }
    /// ```
    pub fn top_served(&self, n: usize) -> StoreFuture<TopServed> {
        self.kinds().top_served(n.min(TOP_SERVED_MAX))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn served_cost_slides_out_of_the_window() {
        let served = ServedCost::new();
        let (a, b) = (TenantId::new("a"), TenantId::new("b"));
        served.add(&a, 100, Instant::now());
        tokio::time::advance(Duration::from_secs(30)).await;
        served.add(&a, 10, Instant::now());
        served.add(&b, 1, Instant::now());
        assert_eq!(served.total(&a), 110);
        assert_eq!(served.total(&b), 1);
        tokio::time::advance(Duration::from_secs(30)).await;
        assert_eq!(served.total(&a), 10, "the first 100 slid out after 60 s");
        tokio::time::advance(Duration::from_secs(30)).await;
        assert_eq!(served.total(&a), 0);
        assert_eq!(served.tenants(), 2, "not swept yet");
        // One shard swept per sweep: after a round of them every shard was.
        for _ in 0..SWEEP_EVERY * SHARDS {
            served.add(&b, 5, Instant::now());
        }
        assert_eq!(served.tenants(), 1, "a was forgotten");
    }

    #[tokio::test(start_paused = true)]
    async fn a_cost_added_after_a_later_one_counts_in_the_later_second() {
        let served = ServedCost::new();
        let a = TenantId::new("a");
        let early = Instant::now();
        tokio::time::advance(Duration::from_secs(2)).await;
        served.add(&a, 10, Instant::now());
        served.add(&a, 5, early);
        assert_eq!(served.total(&a), 15);
        // Both slide out together, with the later second.
        tokio::time::advance(SERVED_WINDOW - Duration::from_secs(1)).await;
        assert_eq!(served.total(&a), 15);
        tokio::time::advance(Duration::from_secs(1)).await;
        assert_eq!(served.total(&a), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn the_top_served_are_the_n_served_most_in_the_window_and_the_total_is_all() {
        let served = ServedCost::new();
        let t = |i: u64| TenantId::new(format!("svc/{i:03}"));
        served.add(&t(999), 1_000_000, Instant::now());
        tokio::time::advance(SERVED_WINDOW).await;
        for i in 0..500 {
            served.add(&t(i), i % 250, Instant::now());
        }
        let top = served.top(3);
        // 249 twice (249 and 499), then 248 (248): ties by name; 999 slid out.
        assert_eq!(top.tenants, [(t(249), 249), (t(499), 249), (t(248), 248)]);
        assert_eq!(top.total, 2 * (0..250).sum::<u64>());
        assert_eq!(served.top(0).tenants, []);
        assert_eq!(
            served.top(1_000).tenants.len(),
            498,
            "none with nothing served"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn served_tables_shrink_once_their_tenants_went_quiet() {
        let served = ServedCost::new();
        for i in 0..50_000 {
            served.add(&TenantId::new(format!("t{i}")), 1, Instant::now());
        }
        let full: usize = served
            .shards
            .iter()
            .map(|s| crate::sync::lock(s).capacity())
            .sum();
        tokio::time::advance(SERVED_WINDOW).await;
        let quiet = TenantId::new("quiet");
        // Enough adds for every shard's sweep to pass over it twice (a shrink restarts a pass).
        for _ in 0..SWEEP_EVERY * (2 * SHARDS * (full / SHARDS).div_ceil(SWEEP_BUDGET) + 2 * SHARDS)
        {
            served.add(&quiet, 1, Instant::now());
        }
        assert_eq!(served.tenants(), 1);
        let left: usize = served
            .shards
            .iter()
            .map(|s| crate::sync::lock(s).capacity())
            .sum();
        assert!(left * 8 < full, "capacity {left} of {full} left");
    }
}
