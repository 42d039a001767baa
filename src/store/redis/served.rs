//! Served cost on Redis: batched locally, sent in the background at most once a second (its
//! buckets are a second wide: sooner would only cost more script calls, one per tenant and
//! worker), one script per tenant (`scripts/add_served_cost.lua`), read back over the window
//! with `scripts/served_cost.lua`. Server time decides the window, so every worker agrees.
//!
//! The fleet's top tenants: the same send adds the batch, in one call, to a ranking of the
//! tenants served most (`scripts/served_top_add.lua`: a ring of sorted sets, one per
//! [`RANK_BUCKET`], each keeping its [`RANK_KEEP`] tenants served most), read back with
//! `scripts/served_top.lua`, so reading who uses the upstream costs one bounded call
//! whatever the number of tenants.
//!
//! The fleet's fairness index: the fair queues' dispatches (cost over weight, and whether
//! the tenant waited) go with the same send, in one call for the whole batch, into one hash
//! (`scripts/fairness_add.lua`); the index over every worker's record is read back right
//! after (`scripts/fairness_index.lua`) and kept for the fair queues to publish, so every
//! worker publishes the same number.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use redis::Script;

use super::{Batch, RedisStore};
use crate::TenantId;
use crate::hash::HashMap;
use crate::store::served::{SERVED_WINDOW, TopServed};
use crate::store::{StoreFuture, keys::Keys};

/// The served-cost part of the Redis store: counts not sent yet, and the scripts.
pub(crate) struct ServedRedis {
    pending: Batch,
    /// When the counts were last sent.
    sent: Mutex<Option<Instant>>,
    add: Script,
    read: Script,
    /// The fair queues' dispatches not sent yet: per tenant, cost over weight, and whether
    /// any of it waited in a queue.
    fairness: Mutex<HashMap<TenantId, (f64, bool)>>,
    /// A fair queue records here: the fleet's index is worth reading.
    fairness_wanted: AtomicBool,
    /// The fleet's index as last read, and when (`None` inside: nobody waited).
    fleet_index: Mutex<Option<(Option<f64>, Instant)>>,
    fairness_add: Script,
    fairness_read: Script,
    rank_add: Script,
    rank_read: Script,
}

/// The ranking's buckets: the served window in six.
const RANK_BUCKETS: usize = 6;

/// A bucket of the ranking: its window is 50 to 60 s.
const RANK_BUCKET: Duration = Duration::from_secs(SERVED_WINDOW.as_secs() / RANK_BUCKETS as u64);

/// The tenants a bucket of the ranking keeps: ten times the most a read names, so that a
/// tenant near the top in one bucket is seldom out of another's.
const RANK_KEEP: usize = 10 * crate::store::TOP_SERVED_MAX;

/// The ranking's keys: its sorted sets, then the hash of which bucket each holds.
fn rank_keys(keys: &Keys) -> Vec<String> {
    (0..RANK_BUCKETS)
        .map(|i| keys.global("served", &format!("top{i}")))
        .chain([keys.global("served", "top")])
        .collect()
}

/// The fleet's fairness window is the served cost's, in ten buckets.
const FAIRNESS_BUCKET: Duration = Duration::from_secs(SERVED_WINDOW.as_secs() / 10);

/// An index read longer ago than this is not the fleet's any more (Redis away, say).
const FLEET_INDEX_FRESH: Duration = Duration::from_secs(5);

/// How often the counts go to Redis in the background: the width of a bucket.
const SEND_EVERY: Duration = Duration::from_secs(1);

impl ServedRedis {
    pub(crate) fn new() -> Self {
        ServedRedis {
            pending: Batch::default(),
            sent: Mutex::new(None),
            add: Script::new(include_str!("../scripts/add_served_cost.lua")),
            read: Script::new(include_str!("../scripts/served_cost.lua")),
            fairness: Mutex::default(),
            fairness_wanted: AtomicBool::new(false),
            fleet_index: Mutex::new(None),
            fairness_add: Script::new(include_str!("../scripts/fairness_add.lua")),
            fairness_read: Script::new(include_str!("../scripts/fairness_index.lua")),
            rank_add: Script::new(include_str!("../scripts/served_top_add.lua")),
            rank_read: Script::new(include_str!("../scripts/served_top.lua")),
        }
    }
}

impl ServedRedis {
    pub(super) fn scripts(&self) -> [&Script; 6] {
        [
            &self.add,
            &self.read,
            &self.fairness_add,
            &self.fairness_read,
            &self.rank_add,
            &self.rank_read,
        ]
    }
}

impl RedisStore {
    pub(crate) fn add_served_cost(&self, tenant: &TenantId, cost: u64, at: Instant) {
        if self.is_degraded() {
            self.fallback.served.add(tenant, cost, at);
        }
        self.batch_add(&self.served.pending, tenant, super::clamp(cost));
    }

    /// Sends the batched served counts with the window length: when `now`, or when a
    /// second has passed since they were last sent.
    pub(super) async fn flush_served(&self, now: bool) {
        {
            let mut sent = super::lock(&self.served.sent);
            if !now && sent.is_some_and(|at| at.elapsed() < SEND_EVERY) {
                return;
            }
            *sent = Some(Instant::now());
        }
        let window = SERVED_WINDOW.as_secs();
        let sending = std::mem::take(&mut *super::lock(&self.served.pending.0));
        let ranked: Vec<(TenantId, i64)> = sending
            .iter()
            .filter(|(_, n)| **n > 0)
            .map(|(tenant, n)| (tenant.clone(), *n))
            .collect();
        let args = [window];
        let counts = self.send_batch(
            &self.served.pending,
            sending,
            "served",
            &self.served.add,
            &args,
        );
        futures_util::future::join(counts, self.rank(ranked)).await;
        if self.served.fairness_wanted.load(Ordering::Relaxed) {
            self.flush_fairness().await;
        }
    }

    /// Adds a batch of served cost to the fleet's ranking, in one call. Best effort: a
    /// batch Redis did not take is missing from the ranking, never from the counts.
    async fn rank(&self, served: Vec<(TenantId, i64)>) {
        if served.is_empty() {
            return;
        }
        let mut add = self.served.rank_add.key(rank_keys(&self.keys));
        add.arg(RANK_BUCKET.as_secs()).arg(RANK_KEEP);
        for (tenant, n) in &served {
            add.arg(tenant.as_str()).arg(*n);
        }
        let mut conn = self.conn.clone();
        let _ = self.guard(add.invoke_async::<i64>(&mut conn)).await;
    }

    /// The fleet's `n` tenants served most, from the ranking.
    pub(crate) fn top_served(self: &Arc<Self>, n: usize) -> StoreFuture<TopServed> {
        let keys = rank_keys(&self.keys);
        self.op(
            move |local| local.served.top(n),
            move |this| async move {
                let mut conn = this.conn.clone();
                let read: Vec<String> = this
                    .served
                    .rank_read
                    .key(keys)
                    .arg(RANK_BUCKET.as_secs())
                    .arg(n)
                    .invoke_async(&mut conn)
                    .await?;
                Ok(parse_top(&read))
            },
        )
    }

    /// A fair queue's dispatch, for the fleet's fairness index.
    pub(crate) fn add_fairness(&self, tenant: &TenantId, weight: u32, cost: u64, queued: bool) {
        self.served.fairness_wanted.store(true, Ordering::Relaxed);
        let mut pending = super::lock(&self.served.fairness);
        let entry = pending.entry(tenant.clone()).or_default();
        entry.0 += cost as f64 / f64::from(weight.max(1));
        entry.1 |= queued;
    }

    /// Sends the fair queues' dispatches (kept for the next send if Redis does not take
    /// them), then reads the fleet's index back.
    async fn flush_fairness(&self) {
        let pending = std::mem::take(&mut *super::lock(&self.served.fairness));
        let key = self.keys.global("fairness", "window");
        let (window, width) = (SERVED_WINDOW.as_secs(), FAIRNESS_BUCKET.as_secs());
        if !pending.is_empty() {
            let mut add = self.served.fairness_add.key(&key);
            add.arg(window).arg(width);
            for (tenant, (served, queued)) in &pending {
                add.arg(tenant.as_str())
                    .arg(*served)
                    .arg(if *queued { 1 } else { 0 });
            }
            let mut conn = self.conn.clone();
            if self
                .guard(add.invoke_async::<i64>(&mut conn))
                .await
                .is_none()
            {
                let mut kept = super::lock(&self.served.fairness);
                for (tenant, (served, queued)) in pending {
                    let entry = kept.entry(tenant).or_default();
                    entry.0 += served;
                    entry.1 |= queued;
                }
                return;
            }
        }
        let mut conn = self.conn.clone();
        let mut read = self.served.fairness_read.key(&key);
        read.arg(window).arg(width);
        if let Some(index) = self.guard(read.invoke_async::<String>(&mut conn)).await {
            let index = index.parse::<f64>().ok().filter(|i| i.is_finite());
            *super::lock(&self.served.fleet_index) = Some((index, Instant::now()));
        }
    }

    /// The fleet's fairness index as last read, if fresh: `Some(None)` when no tenant
    /// waited in a queue anywhere in the window.
    pub(crate) fn fleet_fairness_index(&self) -> Option<Option<f64>> {
        let read = *super::lock(&self.served.fleet_index);
        read.filter(|(_, at)| at.elapsed() < FLEET_INDEX_FRESH && !self.is_degraded())
            .map(|(index, _)| index)
    }

    pub(crate) fn served_cost(self: &Arc<Self>, tenant: &TenantId) -> StoreFuture<u64> {
        let key = self.keys.tenant(tenant, "served");
        let tenant = tenant.clone();
        self.op(
            move |local| local.served.total(&tenant),
            move |this| async move {
                let mut conn = this.conn.clone();
                this.served
                    .read
                    .key(key)
                    .arg(SERVED_WINDOW.as_secs())
                    .invoke_async(&mut conn)
                    .await
            },
        )
    }
}

/// `served_top.lua`'s answer: the total, then tenant and cost pairs (a count that does not
/// parse reads as 0).
fn parse_top(read: &[String]) -> TopServed {
    let number = |s: &String| s.parse::<u64>().unwrap_or(0);
    TopServed {
        total: read.first().map_or(0, number),
        tenants: read
            .get(1..)
            .unwrap_or_default()
            .chunks_exact(2)
            .map(|pair| (TenantId::new(&pair[0]), number(&pair[1])))
            .collect(),
    }
}
