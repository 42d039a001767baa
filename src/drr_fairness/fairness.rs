//! The in-process sliding window behind `claude_drr_fairness_index`.
//!
//! Per tenant: served cost (estimated tokens) in buckets of a tenth of the window, its tier
//! weight, and whether any of its dispatches in a bucket came out of the queue (it was
//! backlogged then). The index is Jain's over `served / weight` of the tenants that were
//! backlogged inside the window: a tenant that only ever sent while there was room has
//! nothing to be treated fairly against, and would drag the index down for no reason.
//!
//! The window never costs one dispatch the time of all the tenants: they are kept in the
//! store's swept shards (`store/swept.rs`), each dispatch sweeps a few buckets of one shard,
//! forgetting tenants whose buckets all slid out, and adds the tenants it visits up into
//! Jain's index of the current pass. With up to [`EXACT_UP_TO`] tenants the published index
//! is computed over all of them at once, exactly; with more, it is that of the last
//! complete pass (each tenant as it was when the pass visited it), so it lags by one pass.

use std::collections::VecDeque;
use std::time::Duration;

use tokio::time::Instant;

use crate::TenantId;
use crate::store::swept::{SHARDS, SWEEP_BUDGET, SweptTable, TenantHasher, sweeps};

const BUCKETS: u32 = 10;

/// Up to this many tenants in the window, the index is computed over all of them at once.
const EXACT_UP_TO: usize = 4_096;

#[derive(Debug)]
struct Served {
    weight: u32,
    /// (bucket number, cost, any of it waited in the queue), oldest first.
    buckets: VecDeque<(u64, u64, bool)>,
}

impl Served {
    /// Drops the buckets before `oldest`; whether anything is left.
    fn trim(&mut self, oldest: u64) -> bool {
        while self.buckets.front().is_some_and(|&(b, _, _)| b < oldest) {
            self.buckets.pop_front();
        }
        !self.buckets.is_empty()
    }

    /// `served / weight`, if the tenant was backlogged in the window.
    fn normalised(&self) -> Option<f64> {
        let backlogged = self.buckets.iter().any(|&(_, _, q)| q);
        let cost: u64 = self.buckets.iter().map(|&(_, c, _)| c).sum();
        backlogged.then(|| cost as f64 / f64::from(self.weight))
    }
}

/// Jain's index `(Σx)² / (n·Σx²)`, summed one value at a time (as `jain_index`).
#[derive(Debug, Default, Clone, Copy)]
struct Jain {
    n: f64,
    sum: f64,
    squares: f64,
}

impl Jain {
    fn add(&mut self, x: f64) {
        self.n += 1.0;
        self.sum += x;
        self.squares += x * x;
    }

    fn index(&self) -> Option<f64> {
        if self.n == 0.0 || self.squares == 0.0 {
            return None;
        }
        let index = self.sum * self.sum / (self.n * self.squares);
        index.is_finite().then_some(index)
    }
}

#[derive(Debug)]
pub(super) struct FairnessWindow {
    started: Instant,
    bucket: Duration,
    hasher: TenantHasher,
    shards: Box<[SweptTable<Served>]>,
    /// The shard the sweep is in, and the index summed so far in this pass.
    sweep_shard: usize,
    /// Records so far: one in [`SWEEP_EVERY`](crate::store::swept::SWEEP_EVERY) sweeps.
    records: usize,
    pass: Jain,
    /// The index of the last complete pass.
    last_pass: Option<f64>,
    /// The bucket of the last publish; `None` until the first record publishes (a gauge
    /// set only after a whole bucket, 6 s by default, reads as missing on a fresh worker).
    last_publish: Option<u64>,
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
            hasher: TenantHasher::default(),
            shards: (0..SHARDS).map(|_| SweptTable::default()).collect(),
            sweep_shard: 0,
            records: 0,
            pass: Jain::default(),
            last_pass: None,
            last_publish: None,
            current: 0,
            current_end: started + bucket,
        }
    }

    fn bucket_at(&self, now: Instant) -> u64 {
        let elapsed = now.saturating_duration_since(self.started).as_nanos();
        u64::try_from(elapsed / self.bucket.as_nanos()).unwrap_or(u64::MAX)
    }

    /// The oldest bucket inside the window when `bucket` is the current one.
    fn oldest(bucket: u64) -> u64 {
        bucket.saturating_sub(u64::from(BUCKETS) - 1)
    }

    /// Records a dispatch. Returns the index to publish when a new bucket started since the
    /// last publish (at most once per bucket).
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
        let hash = self.hasher.hash(tenant);
        let served =
            self.shards[TenantHasher::shard(hash)].get_or_insert_with(hash, tenant, || Served {
                weight,
                buckets: VecDeque::new(),
            });
        served.weight = weight.max(1);
        served.trim(Self::oldest(bucket));
        match served.buckets.back_mut() {
            Some((b, c, q)) if *b == bucket => {
                *c = c.saturating_add(cost);
                *q |= queued;
            }
            _ => served.buckets.push_back((bucket, cost, queued)),
        }
        self.sweep_step(bucket);
        if self.last_publish.is_none_or(|last| bucket > last) {
            self.last_publish = Some(bucket);
            Some(self.index_at(bucket))
        } else {
            None
        }
    }

    /// One record in [`SWEEP_EVERY`](crate::store::swept::SWEEP_EVERY) sweeps a few buckets
    /// of the pass's shard; a pass ends when the last shard wraps.
    fn sweep_step(&mut self, bucket: u64) {
        let record = self.records;
        self.records = record.wrapping_add(1);
        if !sweeps(record) {
            return;
        }
        let oldest = Self::oldest(bucket);
        let pass = &mut self.pass;
        let swept = self.shards[self.sweep_shard].sweep(SWEEP_BUDGET, |_, served| {
            let live = served.trim(oldest);
            if let Some(x) = served.normalised().filter(|_| live) {
                pass.add(x);
            }
            live
        });
        if swept.wrapped {
            self.sweep_shard += 1;
            if self.sweep_shard == SHARDS {
                self.sweep_shard = 0;
                self.last_pass = self.pass.index();
                self.pass = Jain::default();
            }
        }
    }

    /// Jain's index now, dropping what slid out of the window.
    pub(super) fn index(&mut self, now: Instant) -> Option<f64> {
        self.index_at(self.bucket_at(now))
    }

    /// Exact over every tenant while they are few; else the last complete pass's.
    fn index_at(&mut self, bucket: u64) -> Option<f64> {
        if self.len() > EXACT_UP_TO {
            return self.last_pass;
        }
        let oldest = Self::oldest(bucket);
        let mut all = Jain::default();
        for shard in self.shards.iter_mut() {
            shard.sweep_all(|_, served| {
                let live = served.trim(oldest);
                if let Some(x) = served.normalised().filter(|_| live) {
                    all.add(x);
                }
                live
            });
        }
        all.index()
    }

    fn len(&self) -> usize {
        self.shards.iter().map(SweptTable::len).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::swept::SWEEP_EVERY;

    #[tokio::test(start_paused = true)]
    async fn a_fresh_window_publishes_on_its_first_record_then_once_per_bucket() {
        let mut w = FairnessWindow::new(Duration::from_secs(10));
        let now = Instant::now();
        let a = TenantId::new("a");
        assert_eq!(w.record(&a, 1, 100, true, now), Some(Some(1.0)));
        assert_eq!(w.record(&a, 1, 100, true, now), None, "once per bucket");
        let later = now + Duration::from_secs(1);
        assert!(
            w.record(&a, 1, 100, true, later).is_some(),
            "the next bucket"
        );
    }

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
        assert_eq!(w.len(), 0);
    }

    fn capacity(w: &FairnessWindow) -> usize {
        w.shards.iter().map(SweptTable::capacity).sum()
    }

    /// Dispatches enough for the sweep to make two passes over every shard.
    fn sweep_all(w: &mut FairnessWindow, tenant: &TenantId, now: Instant) {
        let widest = w.shards.iter().map(SweptTable::capacity).max().unwrap_or(0);
        for _ in 0..2 * SHARDS * SWEEP_EVERY * (2 * widest / SWEEP_BUDGET + 1) {
            w.record(tenant, 1, 1, true, now);
        }
    }

    #[tokio::test(start_paused = true)]
    async fn many_tenants_slide_out_a_few_per_dispatch_and_the_tables_shrink() {
        let mut w = FairnessWindow::new(Duration::from_secs(10));
        let now = Instant::now();
        for i in 0..50_000 {
            w.record(&TenantId::new(format!("t{i}")), 1, 100, true, now);
        }
        let full = capacity(&w);
        let later = now + Duration::from_secs(11);
        let one = TenantId::new("one");
        let mut before = w.len();
        for _ in 0..SHARDS {
            w.record(&one, 1, 1, true, later);
            let after = w.len();
            assert!(after + SWEEP_BUDGET >= before, "{before} -> {after}");
            before = after;
        }
        assert!(before < 50_000, "the sweep made progress");
        sweep_all(&mut w, &one, later);
        assert_eq!(w.len(), 1);
        assert!(capacity(&w) * 8 < full, "{} of {full}", capacity(&w));
        assert_eq!(w.index(later), Some(1.0));
    }

    #[tokio::test(start_paused = true)]
    async fn with_many_tenants_the_index_is_that_of_the_last_complete_pass() {
        let mut w = FairnessWindow::new(Duration::from_secs(10));
        let now = Instant::now();
        // 10,000 tenants: half served 100, half 300 (Jain: 400² / (2 * (100² + 300²)) = 0.8).
        for i in 0..10_000 {
            let cost = if i % 2 == 0 { 100 } else { 300 };
            w.record(&TenantId::new(format!("t{i}")), 1, cost, true, now);
        }
        assert!(w.len() > EXACT_UP_TO);
        // Dispatches of a tenant that never waited (not part of the index) drive the passes.
        let probe = TenantId::new("probe");
        let widest = w.shards.iter().map(SweptTable::capacity).max().unwrap_or(0);
        for _ in 0..2 * SHARDS * SWEEP_EVERY * (2 * widest / SWEEP_BUDGET + 1) {
            w.record(&probe, 1, 1, false, now);
        }
        let index = w.index(now).expect("a pass completed");
        assert!((index - 0.8).abs() < 1e-9, "{index}");
    }
}
