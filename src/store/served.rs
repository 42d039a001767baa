//! Served cost per tenant over a sliding window: what `DrrFairness` dispatched for each
//! tenant (in estimated tokens), so every worker can compute the same fairness index.
//!
//! The in-process part: one-second buckets per tenant, at most [`SERVED_WINDOW`] of them,
//! and a tenant with nothing in the window is forgotten by the sweep. The Redis part lives
//! in `redis/served.rs`.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

use super::memory::MemoryState;
use super::{Backend, Store, StoreFuture};
use crate::TenantId;

/// The window served cost is summed over: the last 60 seconds (whole seconds, so a read
/// sees between 59 and 60 s of history).
pub const SERVED_WINDOW: Duration = Duration::from_secs(60);

/// Served cost per tenant, in one-second buckets.
#[derive(Debug)]
pub(crate) struct ServedCost {
    started: Instant,
    inner: Mutex<Tenants>,
}

#[derive(Debug)]
struct Tenants {
    /// Per tenant, (second since `started`, cost) oldest first, one entry per second.
    map: HashMap<TenantId, VecDeque<(u64, u64)>>,
    last_sweep: u64,
}

impl ServedCost {
    pub(crate) fn new() -> Self {
        ServedCost {
            started: Instant::now(),
            inner: Mutex::new(Tenants {
                map: HashMap::new(),
                last_sweep: 0,
            }),
        }
    }

    fn second(&self) -> u64 {
        Instant::now()
            .saturating_duration_since(self.started)
            .as_secs()
    }

    /// The oldest second still inside the window at `now`.
    fn oldest(now: u64) -> u64 {
        (now + 1).saturating_sub(SERVED_WINDOW.as_secs())
    }

    pub(crate) fn add(&self, tenant: &TenantId, cost: u64) {
        let now = self.second();
        let mut tenants = crate::sync::lock(&self.inner);
        let buckets = match tenants.map.get_mut(tenant) {
            Some(buckets) => buckets,
            None => tenants.map.entry(tenant.clone()).or_default(),
        };
        match buckets.back_mut() {
            Some((second, total)) if *second == now => *total = total.saturating_add(cost),
            _ => buckets.push_back((now, cost)),
        }
        while buckets.front().is_some_and(|&(s, _)| s < Self::oldest(now)) {
            buckets.pop_front();
        }
        if now > tenants.last_sweep {
            // At most once a second: forget tenants with nothing left in the window.
            tenants
                .map
                .retain(|_, b| b.back().is_some_and(|&(s, _)| s >= Self::oldest(now)));
            tenants.last_sweep = now;
        }
    }

    pub(crate) fn total(&self, tenant: &TenantId) -> u64 {
        let oldest = Self::oldest(self.second());
        let tenants = crate::sync::lock(&self.inner);
        tenants.map.get(tenant).map_or(0, |buckets| {
            buckets
                .iter()
                .filter(|&&(s, _)| s >= oldest)
                .fold(0u64, |sum, &(_, c)| sum.saturating_add(c))
        })
    }
}

impl MemoryState {
    pub(crate) fn add_served_cost(&self, tenant: &TenantId, cost: u64) {
        self.served.add(tenant, cost);
    }

    pub(crate) fn served_cost(&self, tenant: &TenantId) -> u64 {
        self.served.total(tenant)
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
        match &*self.backend {
            Backend::Memory(memory) => memory.add_served_cost(tenant, cost),
            #[cfg(feature = "redis")]
            Backend::Redis(redis) => redis.add_served_cost(tenant, cost),
        }
    }

    /// What was dispatched for `tenant` in the last [`SERVED_WINDOW`], as far as it was
    /// flushed (on Redis: by every worker).
    pub fn served_cost(&self, tenant: &TenantId) -> StoreFuture<u64> {
        match &*self.backend {
            Backend::Memory(memory) => StoreFuture::ready(memory.served_cost(tenant)),
            #[cfg(feature = "redis")]
            Backend::Redis(redis) => redis.served_cost(tenant),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn served_cost_slides_out_of_the_window() {
        let served = ServedCost::new();
        let (a, b) = (TenantId::new("a"), TenantId::new("b"));
        served.add(&a, 100);
        tokio::time::advance(Duration::from_secs(30)).await;
        served.add(&a, 10);
        served.add(&b, 1);
        assert_eq!(served.total(&a), 110);
        assert_eq!(served.total(&b), 1);
        tokio::time::advance(Duration::from_secs(30)).await;
        assert_eq!(served.total(&a), 10, "the first 100 slid out after 60 s");
        tokio::time::advance(Duration::from_secs(30)).await;
        assert_eq!(served.total(&a), 0);
        served.add(&b, 5);
        assert_eq!(served.inner.lock().unwrap().map.len(), 1, "a was forgotten");
    }
}
