//! Slot leases on Redis: acquire and release are one script each, held leases are renewed
//! by the background task, releases are announced on a pub/sub channel.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use redis::Script;
use tokio::time::Instant;

use super::{RedisStore, duration_ms, lock};
use crate::Tier;
use crate::store::StoreFuture;
use crate::store::slots::{Holder, SlotLease, SlotLimits};

/// How often a worker says it is alive, and how long that lasts.
const WORKER_HEARTBEAT: Duration = Duration::from_secs(1);
const WORKER_TTL: Duration = Duration::from_secs(3);

pub(super) struct SlotScripts {
    acquire: Script,
    release: Script,
    heartbeat: Script,
    in_use: Script,
}

impl SlotScripts {
    pub(super) fn new() -> Self {
        SlotScripts {
            acquire: Script::new(include_str!("../scripts/slot_acquire.lua")),
            release: Script::new(include_str!("../scripts/slot_release.lua")),
            heartbeat: Script::new(include_str!("../scripts/slot_heartbeat.lua")),
            in_use: Script::new(include_str!("../scripts/slots_in_use.lua")),
        }
    }

    pub(super) fn all(&self) -> [&Script; 4] {
        [&self.acquire, &self.release, &self.heartbeat, &self.in_use]
    }
}

/// A lease this worker holds, for the heartbeat.
struct Held {
    tier_key: String,
    ttl: Duration,
    renewed: Instant,
}

/// This worker's side of the shared slots.
pub(super) struct SlotState {
    held: Mutex<HashMap<String, Held>>,
    /// Leases that may be in Redis with nobody holding them: released while Redis was away,
    /// or taken by an acquire whose answer never arrived (timed out, or its caller gone).
    /// The background task releases them once Redis answers; their TTL is the backstop.
    unreleased: Mutex<Vec<(String, String)>>,
    last_heartbeat: Mutex<Option<Instant>>,
    /// Workers alive at the last heartbeat (this one included): the fallback's divisor.
    alive_workers: AtomicU32,
}

impl SlotState {
    pub(super) fn new() -> Self {
        SlotState {
            held: Mutex::new(HashMap::new()),
            unreleased: Mutex::new(Vec::new()),
            last_heartbeat: Mutex::new(None),
            alive_workers: AtomicU32::new(1),
        }
    }
}

/// A lease id sent to Redis whose answer is not in yet. Dropped unclaimed (the acquire timed
/// out, failed, or its future was dropped mid round trip), it queues the id for release, so
/// a lease Redis may have granted is not left taken until its TTL runs out.
struct Unclaimed<'a> {
    store: &'a RedisStore,
    lease: Option<(String, String)>,
}

impl Unclaimed<'_> {
    /// The answer arrived: the lease is held (or was never granted).
    fn claim(mut self) -> (String, String) {
        self.lease.take().unwrap_or_default()
    }
}

impl Drop for Unclaimed<'_> {
    fn drop(&mut self) {
        if let Some(lease) = self.lease.take() {
            lock(&self.store.slots.unreleased).push(lease);
        }
    }
}

/// The Redis half of a [`SlotLease`].
pub(crate) struct RedisLease {
    store: Arc<RedisStore>,
    id: String,
}

impl RedisLease {
    /// Forgets the lease locally and releases it in Redis in the background (or, with no
    /// runtime to do it, on the next background tick); its TTL is the backstop.
    pub(crate) fn release(&self, tier: &Tier) {
        let held = lock(&self.store.slots.held).remove(&self.id);
        let tier_key = held.map_or_else(|| self.store.keys.slots_tier(tier), |h| h.tier_key);
        let lease = (self.id.clone(), tier_key);
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                let store = self.store.clone();
                runtime.spawn(async move { store.release_leases(vec![lease]).await });
            }
            Err(_) => lock(&self.store.slots.unreleased).push(lease),
        }
    }
}

impl RedisStore {
    /// One acquire script, sent when the future is first polled: dropped before that, the
    /// future has sent nothing and holds nothing; dropped during the round trip, it queues
    /// its lease id for release (see `Unclaimed`).
    pub(crate) fn try_acquire_slot(
        self: &Arc<Self>,
        tier: &Tier,
        limits: SlotLimits,
    ) -> StoreFuture<Option<SlotLease>> {
        if self.is_degraded() {
            return StoreFuture::ready(self.acquire_fallback(tier, limits));
        }
        let this = self.clone();
        let tier = tier.clone();
        StoreFuture::pending(async move {
            let id = format!(
                "{}:{}",
                this.worker_id,
                this.seq.fetch_add(1, Ordering::Relaxed)
            );
            let tier_key = this.keys.slots_tier(&tier);
            let unclaimed = Unclaimed {
                store: &this,
                lease: Some((id.clone(), tier_key.clone())),
            };
            let mut conn = this.conn.clone();
            let mut acquire = this.slot_scripts.acquire.prepare_invoke();
            acquire
                .key(&this.keys.slots_global)
                .key(&tier_key)
                .arg(limits.global)
                .arg(limits.tier)
                .arg(duration_ms(limits.lease_ttl))
                .arg(&id);
            let answer = this.guard(acquire.invoke_async::<u32>(&mut conn)).await;
            if answer.is_none() {
                drop(unclaimed); // maybe granted, surely not held: release it later
                return this.acquire_fallback(&tier, limits);
            }
            let (id, tier_key) = unclaimed.claim();
            if answer != Some(1) {
                return None;
            }
            let held = Held {
                tier_key,
                ttl: limits.lease_ttl,
                renewed: Instant::now(),
            };
            lock(&this.slots.held).insert(id.clone(), held);
            let lease = RedisLease {
                store: this.clone(),
                id,
            };
            Some(SlotLease::new(tier, Holder::Redis(lease)))
        })
    }

    /// Releases leases in Redis (one script each, pipelined), keeping for later those Redis
    /// did not take, then wakes this worker's waiters.
    async fn release_leases(&self, leases: Vec<(String, String)>) {
        if self.is_degraded() {
            lock(&self.slots.unreleased).extend(leases);
        } else {
            let calls = leases.iter().map(|(id, tier_key)| {
                let mut conn = self.conn.clone();
                let mut release = self.slot_scripts.release.prepare_invoke();
                release
                    .key(&self.keys.slots_global)
                    .key(tier_key)
                    .arg(id)
                    .arg(&self.keys.slots_released);
                async move { release.invoke_async::<u32>(&mut conn).await.is_ok() }
            });
            let all = async { Ok(futures_util::future::join_all(calls).await) };
            let done = self.guard(all).await.unwrap_or_default();
            let mut unreleased = lock(&self.slots.unreleased);
            for (i, lease) in leases.into_iter().enumerate() {
                if !done.get(i).copied().unwrap_or(false) {
                    unreleased.push(lease);
                }
            }
        }
        // Local waiters first: they need not wait for the announcement to come back.
        self.fallback.slots.released.notify_waiters();
    }

    /// Retries the releases that could not be made when they happened.
    pub(super) async fn release_unreleased(&self) {
        let leases = std::mem::take(&mut *lock(&self.slots.unreleased));
        if !leases.is_empty() {
            self.release_leases(leases).await;
        }
    }

    /// How often the background task must tick for the shortest held lease to be renewed in
    /// time (a quarter of its TTL), if any lease is held.
    pub(super) fn heartbeat_pause(&self) -> Option<Duration> {
        lock(&self.slots.held)
            .values()
            .map(|held| held.ttl / 4)
            .min()
    }

    /// While Redis is away: an in-process slot, from this worker's share of the caps.
    fn acquire_fallback(&self, tier: &Tier, limits: SlotLimits) -> Option<SlotLease> {
        let workers = self.slots.alive_workers.load(Ordering::Relaxed);
        let lease = self
            .fallback
            .slots
            .try_acquire(tier, limits.share_of(workers));
        lease.map(SlotLease::mark_fallback)
    }

    pub(crate) fn slots_in_use(self: &Arc<Self>, tier: Option<&Tier>) -> StoreFuture<u32> {
        let key = match tier {
            Some(tier) => self.keys.slots_tier(tier),
            None => self.keys.slots_global.clone(),
        };
        let tier = tier.cloned();
        self.op(
            move |local| local.slots.in_use(tier.as_ref()),
            move |this| async move {
                let mut conn = this.conn.clone();
                this.slot_scripts
                    .in_use
                    .key(key)
                    .invoke_async(&mut conn)
                    .await
            },
        )
    }

    pub(crate) fn slot_released(&self) -> &tokio::sync::Notify {
        &self.fallback.slots.released
    }

    pub(crate) fn alive_workers(&self) -> u32 {
        self.slots.alive_workers.load(Ordering::Relaxed)
    }

    /// Renews held leases that reached a third of their TTL, and says this worker is alive,
    /// in one script call. Run by the background task while Redis is up.
    pub(super) async fn slot_heartbeat(&self) {
        let now = Instant::now();
        let leases: Vec<(String, String, u64)> = {
            let held = lock(&self.slots.held);
            let lease_due = held
                .values()
                .any(|h| now.saturating_duration_since(h.renewed) >= h.ttl / 3);
            let worker_due = lock(&self.slots.last_heartbeat)
                .is_none_or(|at| now.saturating_duration_since(at) >= WORKER_HEARTBEAT);
            if !lease_due && !worker_due {
                return;
            }
            held.iter()
                .map(|(id, h)| (id.clone(), h.tier_key.clone(), duration_ms(h.ttl)))
                .collect()
        };
        let mut invocation = self.slot_scripts.heartbeat.prepare_invoke();
        invocation
            .key(&self.keys.slots_global)
            .key(&self.keys.slots_workers)
            .arg(&self.worker_id)
            .arg(duration_ms(WORKER_TTL));
        for (id, tier_key, ttl_ms) in &leases {
            invocation.key(tier_key).arg(id).arg(*ttl_ms);
        }
        let mut conn = self.conn.clone();
        if let Some(alive) = self.guard(invocation.invoke_async::<u32>(&mut conn)).await {
            self.slots
                .alive_workers
                .store(alive.max(1), Ordering::Relaxed);
            *lock(&self.slots.last_heartbeat) = Some(now);
            let mut held = lock(&self.slots.held);
            for (id, _, _) in &leases {
                if let Some(h) = held.get_mut(id) {
                    h.renewed = now;
                }
            }
        }
    }
}
