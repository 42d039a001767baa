//! The in-process sliding window behind `claude_drr_fairness_index`.
//!
//! Per tenant: served cost (estimated tokens) in buckets of a tenth of the window, its tier
//! weight, and whether any of its dispatches in a bucket came out of the queue (it was
//! backlogged then). The index is Jain's over `served / weight` of the tenants that were
//! backlogged inside the window: a tenant that only ever sent while there was room has
//! nothing to be treated fairly against, and would drag the index down for no reason.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use tokio::time::Instant;

use super::scheduler::jain_index;
use crate::TenantId;

const BUCKETS: u32 = 10;

#[derive(Debug)]
struct Served {
    weight: u32,
    /// (bucket number, cost, any of it waited in the queue), oldest first.
    buckets: VecDeque<(u64, u64, bool)>,
}

#[derive(Debug)]
pub(super) struct FairnessWindow {
    started: Instant,
    bucket: Duration,
    tenants: HashMap<TenantId, Served>,
    /// The bucket of the last sweep and publish.
    last_publish: u64,
    /// The current bucket and when it ends, so a record needs no division.
    current: u64,
    current_end: Instant,
}

impl FairnessWindow {
    pub(super) fn new(window: Duration) -> Self {
        let started = Instant::now();
        let bucket = (window / BUCKETS).max(Duration::from_millis(1));
        FairnessWindow {
            started,
            bucket,
            tenants: HashMap::new(),
            last_publish: 0,
            current: 0,
            current_end: started + bucket,
        }
    }

    fn bucket_at(&self, now: Instant) -> u64 {
        let elapsed = now.saturating_duration_since(self.started).as_nanos();
        u64::try_from(elapsed / self.bucket.as_nanos()).unwrap_or(u64::MAX)
    }

    /// Records a dispatch. Returns the index to publish when a new bucket started since the
    /// last publish (at most once per bucket; the sweep is O(tenants in the window)).
    pub(super) fn record(
        &mut self,
        tenant: &TenantId,
        weight: u32,
        cost: u64,
        queued: bool,
        now: Instant,
    ) -> Option<Option<f64>> {
        if now >= self.current_end {
            self.current = self.bucket_at(now);
            let next = u32::try_from(self.current.saturating_add(1)).unwrap_or(u32::MAX);
            self.current_end = self
                .started
                .checked_add(self.bucket.saturating_mul(next))
                .unwrap_or(now);
        }
        let bucket = self.current;
        let served = match self.tenants.get_mut(tenant) {
            Some(served) => served,
            None => self.tenants.entry(tenant.clone()).or_insert(Served {
                weight,
                buckets: VecDeque::new(),
            }),
        };
        served.weight = weight.max(1);
        match served.buckets.back_mut() {
            Some((b, c, q)) if *b == bucket => {
                *c = c.saturating_add(cost);
                *q |= queued;
            }
            _ => served.buckets.push_back((bucket, cost, queued)),
        }
        if bucket > self.last_publish {
            self.last_publish = bucket;
            Some(self.index_at(bucket))
        } else {
            None
        }
    }

    /// Jain's index now, dropping what slid out of the window.
    pub(super) fn index(&mut self, now: Instant) -> Option<f64> {
        self.index_at(self.bucket_at(now))
    }

    fn index_at(&mut self, bucket: u64) -> Option<f64> {
        let oldest = bucket.saturating_sub(u64::from(BUCKETS) - 1);
        self.tenants.retain(|_, served| {
            while served.buckets.front().is_some_and(|&(b, _, _)| b < oldest) {
                served.buckets.pop_front();
            }
            !served.buckets.is_empty()
        });
        jain_index(self.tenants.values().filter_map(|served| {
            let backlogged = served.buckets.iter().any(|&(_, _, q)| q);
            let cost: u64 = served.buckets.iter().map(|&(_, c, _)| c).sum();
            backlogged.then(|| cost as f64 / f64::from(served.weight))
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn index_counts_backlogged_tenants_weight_normalised_in_the_window() {
        let mut w = FairnessWindow::new(Duration::from_secs(10));
        let now = Instant::now();
        let (a, b, c) = (TenantId::new("a"), TenantId::new("b"), TenantId::new("c"));
        w.record(&a, 3, 300, true, now);
        w.record(&b, 1, 100, true, now);
        // Never waited: not part of the index.
        w.record(&c, 1, 5_000, false, now);
        assert_eq!(w.index(now), Some(1.0));
        w.record(&b, 1, 100, true, now);
        let j = w.index(now).expect("values");
        assert!((j - 0.9).abs() < 1e-9, "{j}"); // (1+2)^2 / (2*(1+4))
        // Everything slides out after the window.
        let later = now + Duration::from_secs(11);
        assert_eq!(w.index(later), None);
        assert!(w.tenants.is_empty());
    }
}
