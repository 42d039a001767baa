//! Slot leases on Redis: acquire and release are one script each, held leases are renewed
//! by the background task, releases are announced on a pub/sub channel.
//!
//! # Faults: reconcile, don't guess
//!
//! The shared count is only true while it holds every call in flight. Three things break
//! that, and each is repaired the same way, by a *resync*: one script that puts back, with
//! `ZADD` (not `XX`), a lease for every call this worker still has in flight, Redis leases
//! and fallback slots alike, before the worker takes another slot.
//!
//! - **Redis wiped or restarted empty** (`FLUSHALL`, a fresh server on the same port): the
//!   epoch key is gone. Acquire and heartbeat check it and this worker's record in the
//!   worker set, and answer "resync" instead of taking a slot.
//! - **This worker was away** (Redis down at start, hung, unreachable): while degraded it
//!   counts every call it has in flight against its share of the caps; when Redis answers
//!   again it resyncs and starts a new *epoch*, which forgets every worker record, so every
//!   other worker resyncs too before its next slot.
//! - **A lease expired unrenewed** while its call still runs: the heartbeat reports it
//!   missing, and the worker puts it back.
//!
//! Until every worker it knew is back in the new epoch (or a worker TTL has passed), a
//! worker keeps to its share as if degraded: a worker that resynced first cannot take the
//! slots of calls another worker has not put back yet.
//!
//! While Redis is away, a worker that had synced and knows of other workers keeps, for one
//! lease TTL, to exactly the leases it held when the fault began, per tier and in all (and
//! per tenant, with a tenant cap), each as long as it lives in Redis: all the workers'
//! calls then were within the caps together, and no other worker can be given those slots
//! before they expire, whether Redis died or only this worker is cut off from it. A call of
//! its own that ends frees its slot for its next call of the tier; a call of a tier it
//! held nothing of is refused at once ([`SlotRefusal::Store`]): nothing of its own will
//! come free, and what the others hold is not known here. Past the TTL, the store's
//! [`OutagePolicy`] decides: its share of the caps (the caps divided by the workers last
//! seen alive), or nothing.
//!
//! A worker knows how many workers there are from its heartbeat (once a second) and from
//! every acquire's answer; one that joined within the last second may be unknown to a
//! worker that sent no acquire since (`docs/limits.md`).
//!
//! Otherwise while restricted (Redis away and never synced, or alone; settling after a new
//! epoch) a worker keeps to its share: the caps divided by the workers it knows of (the
//! last count seen alive, at least [`expected_workers`](crate::StoreBuilder::expected_workers);
//! one slot each when it knows nothing), and while settling within a TTL of the fault also
//! to what it held when the fault began.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use redis::Script;
use tokio::time::Instant;

use super::slot_state::{CallInFlight, Counted, WORKER_TTL};
use super::{RedisStore, duration_ms, duration_us, is_outage, lock};
use crate::store::StoreFuture;
use crate::store::keys::Keys;
use crate::store::slots::{Holder, ReleaseSlot, SlotLease, SlotLimits, SlotQueue, SlotRefusal};
use crate::{TenantId, Tier};

/// How often a worker says it is alive (how long that lasts: `WORKER_TTL`).
const WORKER_HEARTBEAT: Duration = Duration::from_secs(1);
/// A worker that has not said it is alive for this long is not woken for a freed slot (it
/// crashed, or is cut off from Redis while its subscription lingers): the slot would be
/// promised to it for nothing.
const WORKER_SILENT: Duration = Duration::from_millis(1_500);

pub(super) struct SlotScripts {
    acquire: Script,
    release: Script,
    heartbeat: Script,
    resync: Script,
    in_use: Script,
}

// The fleet's fair order is one prelude of the three scripts that change it, after the GCRA
// one (its token rate).
pub(super) const ACQUIRE_SOURCE: &str = concat!(
    include_str!("../scripts/gcra.lua"),
    include_str!("../scripts/slot_queue.lua"),
    include_str!("../scripts/slot_acquire.lua")
);
pub(super) const RELEASE_SOURCE: &str = concat!(
    include_str!("../scripts/gcra.lua"),
    include_str!("../scripts/slot_queue.lua"),
    include_str!("../scripts/slot_release.lua")
);
pub(super) const HEARTBEAT_SOURCE: &str = concat!(
    include_str!("../scripts/gcra.lua"),
    include_str!("../scripts/slot_queue.lua"),
    include_str!("../scripts/slot_heartbeat.lua")
);

impl SlotScripts {
    pub(super) fn new() -> Self {
        SlotScripts {
            acquire: Script::new(ACQUIRE_SOURCE),
            release: Script::new(RELEASE_SOURCE),
            heartbeat: Script::new(HEARTBEAT_SOURCE),
            resync: Script::new(include_str!("../scripts/slot_resync.lua")),
            in_use: Script::new(include_str!("../scripts/slots_in_use.lua")),
        }
    }

    pub(super) fn all(&self) -> [&Script; 5] {
        [
            &self.acquire,
            &self.release,
            &self.heartbeat,
            &self.resync,
            &self.in_use,
        ]
    }
}

/// A lease id sent to Redis whose answer is not in yet. Dropped unclaimed (the acquire timed
/// out, failed, or its future was dropped mid round trip), it forgets the call and queues the
/// id for release, so a lease Redis may have granted is not left taken until its TTL runs out.
struct Unclaimed<'a> {
    store: &'a RedisStore,
    lease: Option<(String, String)>,
    /// The tenant's lease set the acquire may have put it in too.
    tenant_key: Option<String>,
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
            lock(&self.store.slots.held).remove(&lease.0);
            let tenant = self.tenant_key.take().map(|key| (lease.0.clone(), key));
            lock(&self.store.slots.unreleased).extend(std::iter::once(lease).chain(tenant));
        }
    }
}

/// An acquire under way (see `Wakes::idle_since`), with the token of the wake-up it
/// answers, if any. Unless the acquire took the slot, the token is passed on when dropped
/// (refused, for instance by a tenant's own cap; timed out; its future dropped), so the
/// freed slot goes to the next queued worker rather than waiting for its promise to run
/// out.
struct Answering<'a> {
    store: &'a Arc<RedisStore>,
    tier_key: &'a str,
    token: Option<String>,
}

impl<'a> Answering<'a> {
    fn new(store: &'a Arc<RedisStore>, tier_key: &'a str, token: Option<String>) -> Self {
        store.wakes.acquiring(tier_key, true);
        Answering {
            store,
            tier_key,
            token,
        }
    }

    fn arg(&self) -> &str {
        self.token.as_deref().unwrap_or("")
    }

    /// The acquire took the slot: the wake-up is answered.
    fn taken(mut self) {
        self.token = None;
    }
}

impl Drop for Answering<'_> {
    fn drop(&mut self) {
        self.store.wakes.acquiring(self.tier_key, false);
        if let Some(token) = self.token.take() {
            self.store.pass_wake(self.tier_key, &token, None);
        }
    }
}

/// One acquire, as every try of it sends it.
struct SlotAsk {
    /// The lease id, one for all the tries.
    id: String,
    tier: Tier,
    /// Named only when `limits` caps tenants.
    tenant: Option<TenantId>,
    tier_key: String,
    tenant_key: Option<String>,
    limits: SlotLimits,
    /// How a refusal for a full tier queues this worker for a wake-up.
    queue: Option<SlotQueue>,
    /// The flow a queued acquire belongs to, as its wake-ups name it.
    flow: Option<String>,
}

impl SlotAsk {
    /// Takes a lease id and, with `queue`, counts this worker as queueing for the tier.
    fn new(
        store: &RedisStore,
        tier: Tier,
        tenant: Option<TenantId>,
        limits: SlotLimits,
        queue: Option<SlotQueue>,
    ) -> Self {
        let id = store.lease_id();
        let tier_key = store.keys.slots_tier(&tier);
        let tenant_key = tenant.as_ref().map(|t| store.keys.slots_tenant(&tier, t));
        if queue.is_some() {
            store.wakes.queueing(&tier_key, &tier);
        }
        let flow = queue.as_ref().map(SlotQueue::flow);
        SlotAsk {
            id,
            tier,
            tenant,
            tier_key,
            tenant_key,
            limits,
            queue,
            flow,
        }
    }
}

/// What the acquire script answered.
struct AcquireAnswer {
    /// Below 0: this worker must resync first; 0: refused; above: taken.
    status: i64,
    /// Why, when refused.
    refusal: SlotRefusal,
    /// Room left in the tier after this acquire.
    room: u32,
    /// The records in the worker set (0: not said).
    workers: u32,
    /// Refused for the provider's rate: the tick this worker is to send, if any.
    tick: Option<Tick>,
}

impl AcquireAnswer {
    fn read(answer: &[i64]) -> Option<Self> {
        let &[status, _global, _tier, ..] = answer else {
            return None;
        };
        let count = |n: i64| u32::try_from(n).unwrap_or(0);
        // 2: the tier had room, the tenant's own cap did not; 3: the rate had no cell.
        let refusal = match answer.get(3) {
            Some(2) => SlotRefusal::TenantCap,
            Some(3) => SlotRefusal::Rate,
            _ => SlotRefusal::Full,
        };
        let room = answer.get(4).map_or(u32::MAX, |&n| count(n));
        let workers = answer.get(5).map_or(0, |&n| count(n));
        let tick = Tick::read(answer.get(6..8));
        Some(AcquireAnswer {
            status,
            refusal,
            room,
            workers,
            tick,
        })
    }
}

/// A tick this worker is to send (see `RedisStore::tick_in`): after `wait`, naming the
/// cell's time `at` (Redis microseconds).
#[derive(Clone, Copy, Debug)]
struct Tick {
    wait: Duration,
    at: i64,
}

impl Tick {
    /// From a script's `{wait (us), at}`; `None` for a wait of 0 (another worker ticks).
    fn read(answer: Option<&[i64]>) -> Option<Tick> {
        let &[wait, at] = answer? else {
            return None;
        };
        let wait = u64::try_from(wait).ok().filter(|&us| us > 0)?;
        Some(Tick {
            wait: Duration::from_micros(wait),
            at,
        })
    }
}

/// The Redis half of a [`SlotLease`]: a call this worker counts in flight, in Redis or (a
/// fallback slot) not yet.
pub(super) struct RedisLease {
    store: Arc<RedisStore>,
    id: String,
}

impl ReleaseSlot for RedisLease {
    /// Forgets the call locally and releases its lease in Redis in the background (or, with
    /// no runtime to do it, on the next background tick); its TTL is the backstop.
    ///
    /// A lease counted for its tenant is in the tenant's lease set too: it is released as
    /// a second (set, id) pair after the tier's, whose release already took it out of the
    /// global set (so it announces nothing a second time).
    fn release(&self, tier: &Tier, tenant: Option<&TenantId>) {
        let held = lock(&self.store.slots.held).remove(&self.id);
        if let Some(h) = &held {
            self.store.slots.held_for(h.since);
        }
        if held.as_ref().is_some_and(|h| h.counted == Counted::Local) {
            // Never put in Redis (a resync on the way finds it gone and releases it).
            self.store.wake_everyone();
            return;
        }
        let keys = &self.store.keys;
        let (tier_key, tenant_key) = match held {
            Some(h) => (h.tier_key, h.tenant_key),
            None => (
                keys.slots_tier(tier),
                tenant.map(|tenant| keys.slots_tenant(tier, tenant)),
            ),
        };
        let mut leases = vec![(self.id.clone(), tier_key)];
        leases.extend(tenant_key.map(|key| (self.id.clone(), key)));
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                let store = self.store.clone();
                runtime.spawn(async move { store.release_leases(leases).await });
            }
            Err(_) => lock(&self.store.slots.unreleased).extend(leases),
        }
    }
}

impl RedisStore {
    fn lease_id(&self) -> String {
        format!(
            "{}:{}",
            self.worker_id,
            self.seq.fetch_add(1, Ordering::Relaxed)
        )
    }

    /// One acquire script, sent when the future is first polled: dropped before that, the
    /// future has sent nothing and holds nothing; dropped during the round trip, it queues
    /// its lease id for release (see `Unclaimed`). An answer that this worker must resync
    /// first is followed by the resync and one more try.
    ///
    /// With a tenant cap and a tenant, the tenant's lease set and cap follow the script's
    /// other keys and arguments; without, only the tier's keys and arguments.
    ///
    /// With `queue`, a refusal for a full tier queues this worker for a wake-up
    /// (`redis/wakes.rs`).
    pub(crate) fn try_acquire_slot(
        self: &Arc<Self>,
        tier: &Tier,
        tenant: Option<&TenantId>,
        limits: SlotLimits,
        queue: Option<SlotQueue>,
    ) -> StoreFuture<Result<SlotLease, SlotRefusal>> {
        let tenant = limits.tenant.and(tenant);
        if self.is_degraded() {
            return StoreFuture::ready(self.acquire_fallback(tier, tenant, limits));
        }
        let this = self.clone();
        let tier = tier.clone();
        let tenant = tenant.cloned();
        StoreFuture::pending(async move {
            let ask = SlotAsk::new(&this, tier, tenant, limits, queue);
            this.acquire_shared(ask).await
        })
    }

    /// Sends the acquire script until it answers for good: a resync and one more try when
    /// this worker's calls are not all counted, one more with a wake-up that came while it
    /// was on its way; the fallback when Redis does not answer.
    async fn acquire_shared(self: Arc<Self>, ask: SlotAsk) -> Result<SlotLease, SlotRefusal> {
        // The wake-up of its flow this acquire answers, if any (only a queued call answers
        // one).
        let token = ask
            .flow
            .as_ref()
            .and_then(|f| self.wakes.answer(&ask.tier_key, f));
        let mut answering = Answering::new(&self, &ask.tier_key, token);
        let (mut resynced, mut late) = (false, false);
        loop {
            self.reserve(
                &ask.id,
                &ask.tier_key,
                ask.tenant_key.as_deref(),
                ask.limits,
            )?;
            let epoch = lock(&self.slots.epoch).clone();
            let Some(answer) = self.send_acquire(&ask, &epoch, answering.arg()).await else {
                return self.acquire_fallback(&ask.tier, ask.tenant.as_ref(), ask.limits);
            };
            if answer.status < 0 {
                // Nothing was taken: this worker's calls are not all counted.
                lock(&self.slots.held).remove(&ask.id);
                if resynced {
                    // Another epoch began meanwhile: wait, try again.
                    return Err(SlotRefusal::Full);
                }
                if !self.resync(false, Some(epoch)).await {
                    return self.acquire_fallback(&ask.tier, ask.tenant.as_ref(), ask.limits);
                }
                resynced = true;
                continue;
            }
            self.note_answer(&ask.id, answer.status != 0);
            self.slots.workers_heard(answer.workers);
            if let Some(tick) = answer.tick {
                self.tick_in(&ask.tier_key, tick);
            }
            if answer.status == 0 {
                // A wake-up that came while this acquire was on its way is for this call:
                // try once more with it, or the slot goes to nobody.
                if answering.token.is_none()
                    && let Some(flow) = &ask.flow
                    && !late
                {
                    answering.token = self.wakes.answer(&ask.tier_key, flow);
                    if answering.token.is_some() {
                        late = true;
                        continue;
                    }
                }
                return Err(answer.refusal);
            }
            answering.taken();
            let lease = RedisLease {
                store: self.clone(),
                id: ask.id,
            };
            let lease = SlotLease::new(ask.tier, ask.tenant, Holder::Shared(Box::new(lease)));
            return Ok(lease.with_room(answer.room));
        }
    }

    /// One acquire script for `ask`, in this worker's `epoch`, answering the wake-up of
    /// `token` (empty: none). `None` when Redis did not answer: the lease id, perhaps
    /// granted, is then queued for release (as it is when this future is dropped on the way).
    async fn send_acquire(
        &self,
        ask: &SlotAsk,
        epoch: &Option<String>,
        token: &str,
    ) -> Option<AcquireAnswer> {
        let unclaimed = Unclaimed {
            store: self,
            lease: Some((ask.id.clone(), ask.tier_key.clone())),
            tenant_key: ask.tenant_key.clone(),
        };
        let mut conn = self.conn.clone();
        let mut acquire = self.slot_scripts.acquire.prepare_invoke();
        let (limits, queue) = (ask.limits, ask.queue.as_ref());
        let (waiting, weight) = queue.map_or((0, 1), |q| (q.waiting, q.weight));
        let (class, class_weight) = queue.map_or((1, 1), |q| (q.class as u8, q.class_weight));
        let cost = queue.map_or(1, |q| q.cost.max(1));
        acquire
            .key(&self.keys.slots_global)
            .key(&ask.tier_key)
            .key(&self.keys.slots_workers)
            .key(&self.keys.slots_epoch)
            .key(&self.keys.slots_waits)
            .key(Keys::tier_queue(&ask.tier_key))
            .key(&self.keys.slots_promised)
            .key(Keys::tier_promised(&ask.tier_key))
            .arg(limits.global)
            .arg(limits.tier)
            .arg(duration_ms(limits.lease_ttl))
            .arg(&ask.id)
            .arg(&self.worker_id)
            .arg(epoch.as_deref().unwrap_or(""))
            .arg(waiting)
            .arg(weight)
            .arg(token)
            .arg(class)
            .arg(class_weight)
            .arg(
                queue
                    .and_then(|q| q.tenant.as_ref())
                    .map_or("", |t| t.as_str()),
            )
            .arg(cost);
        let cells = queue.and_then(|q| q.cells);
        acquire
            .key(&self.keys.slots_cells)
            .arg(cells.map_or(0, |c| match c.names_a_limit() {
                true => i64::from(c.count),
                false => -1,
            }))
            .arg(cells.map_or(0, |c| duration_us(c.span)));
        let tokens = cells.and_then(|c| c.tokens);
        acquire
            .arg(tokens.map_or(0, |t| t.interval()))
            .arg(tokens.map_or(0, |t| t.capacity()));
        match (&ask.tenant_key, limits.tenant) {
            (Some(key), Some(cap)) => acquire.key(key).arg(cap),
            _ => acquire.arg(0),
        };
        acquire.arg(
            queue
                .and_then(|q| q.group.as_ref())
                .map_or("", |g| g.as_str()),
        );
        let answer = self
            .guard(acquire.invoke_async::<Vec<i64>>(&mut conn))
            .await;
        let Some(answer) = answer.as_deref().and_then(AcquireAnswer::read) else {
            drop(unclaimed); // maybe granted, surely not held: release it later
            return None;
        };
        unclaimed.claim();
        Some(answer)
    }

    /// The acquire script answered for the call `id` counts here: taken, it is a lease in
    /// Redis; refused, it is forgotten.
    fn note_answer(&self, id: &str, taken: bool) {
        let mut held = lock(&self.slots.held);
        if !taken {
            held.remove(id);
        } else if let Some(held) = held.get_mut(id) {
            // `renewed` stays when the acquire was sent: the lease lives in Redis at least a
            // TTL from then.
            held.counted = Counted::Shared;
        }
    }

    /// Counts a call about to be acquired, if it fits this worker's share while restricted.
    fn reserve(
        &self,
        id: &str,
        tier_key: &str,
        tenant_key: Option<&str>,
        limits: SlotLimits,
    ) -> Result<(), SlotRefusal> {
        let restricted = self.slots.restricted(self.is_degraded());
        let mut held = lock(&self.slots.held);
        if restricted {
            self.slots
                .fits(&held, tier_key, tenant_key, limits, self.is_degraded())?;
        }
        held.insert(
            id.to_owned(),
            CallInFlight {
                tier_key: tier_key.to_owned(),
                tenant_key: tenant_key.map(str::to_owned),
                ttl: limits.lease_ttl,
                renewed: Instant::now(),
                counted: Counted::Acquiring,
                since: Instant::now(),
            },
        );
        Ok(())
    }

    /// While Redis is away: a slot from this worker's share of the caps, counting every
    /// call it has in flight (Redis leases and fallback slots alike).
    /// `tenant` is named only when `limits` caps tenants.
    fn acquire_fallback(
        self: &Arc<Self>,
        tier: &Tier,
        tenant: Option<&TenantId>,
        limits: SlotLimits,
    ) -> Result<SlotLease, SlotRefusal> {
        if self.slots.recovering.load(Ordering::Acquire) {
            return Err(SlotRefusal::Full); // woken when the store is back
        }
        let id = self.lease_id();
        let tier_key = self.keys.slots_tier(tier);
        let tenant_key = tenant.map(|tenant| self.keys.slots_tenant(tier, tenant));
        let mut held = lock(&self.slots.held);
        self.slots
            .fits(&held, &tier_key, tenant_key.as_deref(), limits, true)?;
        held.insert(
            id.clone(),
            CallInFlight {
                tier_key,
                tenant_key,
                ttl: limits.lease_ttl,
                renewed: Instant::now(),
                counted: Counted::Local,
                since: Instant::now(),
            },
        );
        drop(held);
        let lease = RedisLease {
            store: self.clone(),
            id,
        };
        Ok(SlotLease::new(
            tier.clone(),
            tenant.cloned(),
            Holder::Shared(Box::new(lease)),
        )
        .mark_fallback())
    }

    /// Puts back every call this worker has in flight as a lease, and records the worker
    /// in the current epoch (a new one with `new_epoch`). Skipped when another resync ran
    /// since this worker last saw `seen_epoch`. `false` when Redis did not answer.
    pub(super) async fn resync(&self, new_epoch: bool, seen_epoch: Option<Option<String>>) -> bool {
        let _one = self.slots.resyncing.lock().await;
        if seen_epoch.is_some_and(|seen| *lock(&self.slots.epoch) != seen) {
            return true;
        }
        let leases: Vec<(String, String, u64)> = lock(&self.slots.held)
            .iter()
            .filter(|(_, h)| h.counted != Counted::Acquiring)
            .flat_map(CallInFlight::sets)
            .collect();
        let mut invocation = self.slot_scripts.resync.prepare_invoke();
        invocation
            .key(&self.keys.slots_global)
            .key(&self.keys.slots_workers)
            .key(&self.keys.slots_epoch)
            .arg(&self.worker_id)
            .arg(duration_ms(WORKER_TTL))
            .arg(if new_epoch { "1" } else { "0" });
        for (id, tier_key, ttl_ms) in &leases {
            invocation.key(tier_key).arg(id).arg(*ttl_ms);
        }
        let mut conn = self.conn.clone();
        // Before the call: the leases put back live in Redis at least a TTL from then.
        let now = Instant::now();
        let answer = self
            .guard(invocation.invoke_async::<Vec<String>>(&mut conn))
            .await;
        let Some([epoch, alive, _global]) = answer.and_then(|a| <[String; 3]>::try_from(a).ok())
        else {
            return false;
        };
        let alive: u32 = alive.parse().unwrap_or(1);
        // Calls, not entries: a call counted for its tenant has two.
        let put_back = leases
            .iter()
            .map(|(id, _, _)| id)
            .collect::<std::collections::HashSet<_>>()
            .len();
        {
            let mut held = lock(&self.slots.held);
            let mut unreleased = lock(&self.slots.unreleased);
            for (id, tier_key, _) in leases {
                match held.get_mut(&id) {
                    Some(h) => {
                        h.counted = Counted::Shared;
                        h.renewed = now;
                    }
                    // Released while the resync was on the way: it put the lease back.
                    None => unreleased.push((id, tier_key)),
                }
            }
        }
        let before = lock(&self.slots.epoch).replace(epoch.clone());
        let epoch_changed = before.as_ref().is_some_and(|before| *before != epoch);
        if new_epoch || epoch_changed {
            tracing::info!(
                name: "queue.redis_resync",
                epoch,
                started_here = new_epoch,
                calls_put_back = put_back,
                workers_back = alive,
                "slot counts were untrue (redis was away, restarted or wiped); this worker's \
                 calls in flight are back in them"
            );
        }
        if new_epoch || epoch_changed {
            // The count was untrue for every worker: wait for those known to put theirs back.
            self.slots.settle(self.slots.fleet(), alive);
        } else {
            self.slots.workers_seen(alive);
        }
        *lock(&self.slots.last_heartbeat) = Some(now);
        self.wake.notify_one();
        true
    }

    /// The release script for `id` of `tier_key`, or ('' and the wake's token) to pass a
    /// wake-up on (this worker leaving the flow `leave`, if any), or (all '' but `tick_at`)
    /// to hand out a freed cell of the provider's rate: it wakes one queued worker for the
    /// freed slot, maybe this one.
    fn release_call(
        &self,
        id: &str,
        tier_key: &str,
        token: &str,
        leave: Option<&str>,
        tick_at: &str,
    ) -> redis::ScriptInvocation<'_> {
        let mut release = self.slot_scripts.release.prepare_invoke();
        release
            .key(&self.keys.slots_global)
            .key(tier_key)
            .key(&self.keys.slots_waits)
            .key(&self.keys.slots_promised)
            .key(&self.keys.slots_workers)
            .key(&self.keys.slots_cells)
            .arg(id)
            .arg(&self.keys.slots_wake)
            .arg(if self.target.is_cluster() {
                "SPUBLISH"
            } else {
                "PUBLISH"
            })
            .arg(token)
            .arg(leave.map_or(String::new(), |flow| format!("{}|{flow}", self.worker_id)))
            .arg(duration_ms(WORKER_TTL.saturating_sub(WORKER_SILENT)))
            .arg(tick_at)
            .arg(&self.worker_id)
            .arg(self.slots.tokens_beyond.swap(0, Ordering::Relaxed));
        release
    }

    /// Passes a wake-up of `tier_key` on to the next flow in the fleet's order (in the
    /// background), this worker leaving the flow `leave`, if any.
    fn pass_wake(self: &Arc<Self>, tier_key: &str, token: &str, leave: Option<&str>) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return; // its promise runs out within a second
        };
        let this = self.clone();
        let (tier_key, token) = (tier_key.to_owned(), token.to_owned());
        let leave = leave.map(str::to_owned);
        runtime.spawn(async move {
            let mut conn = this.conn.clone();
            let pass = this.release_call("", &tier_key, &token, leave.as_deref(), "");
            if let Some(answer) = this.guard(pass.invoke_async::<Vec<i64>>(&mut conn)).await {
                this.tick_after(&tier_key, &answer);
            }
        });
    }

    /// Calls wait for the provider's rate and the next freed cell is this worker's to hand
    /// out: after the tick's wait, a release with no lease (the tick) gives it to the call
    /// the fleet's order picks, as a freed slot is; its answer says whether the next one is
    /// this worker's too (in the background). If this worker dies first, the next refused
    /// acquire of another (its poll's) takes the ticks over.
    fn tick_in(self: &Arc<Self>, tier_key: &str, tick: Tick) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let this = self.clone();
        let tier_key = tier_key.to_owned();
        // The script made the wait a little shorter than the cell's time left, so the tick
        // comes just in time.
        let due = Instant::now() + tick.wait;
        runtime.spawn(async move {
            tokio::time::sleep_until(due).await;
            if this.is_degraded() {
                return;
            }
            let mut conn = this.conn.clone();
            let at = tick.at.to_string();
            let release = this.release_call("", &tier_key, "", None, &at);
            if let Some(answer) = this
                .guard(release.invoke_async::<Vec<i64>>(&mut conn))
                .await
            {
                this.tick_after(&tier_key, &answer);
            }
        });
    }

    /// A release's answer: the next tick, if it is this worker's.
    fn tick_after(self: &Arc<Self>, tier_key: &str, answer: &[i64]) {
        if let Some(tick) = Tick::read(answer.get(3..5)) {
            self.tick_in(tier_key, tick);
        }
    }

    /// Releases leases in Redis (one script each, pipelined), keeping for later those Redis
    /// did not take. Each release wakes one queued worker; while this worker keeps to its
    /// own share (Redis away, or settling after it was), its own waiters try again too.
    ///
    /// A release that finds Redis gone marks the store degraded, as every operation does:
    /// the worker then keeps to the leases its other calls still hold.
    async fn release_leases(self: &Arc<Self>, leases: Vec<(String, String)>) {
        if self.is_degraded() {
            lock(&self.slots.unreleased).extend(leases);
        } else {
            let calls = leases.iter().map(|(id, tier_key)| {
                let mut conn = self.conn.clone();
                let release = self.release_call(id, tier_key, "", None, "");
                async move { release.invoke_async::<Vec<i64>>(&mut conn).await }
            });
            let all = async { Ok(futures_util::future::join_all(calls).await) };
            let done = self.guard(all).await.unwrap_or_default();
            if let Some(e) = done
                .iter()
                .filter_map(|r| r.as_ref().err())
                .find(|e| is_outage(e))
            {
                self.mark_degraded(&e.to_string());
            }
            let mut unreleased = lock(&self.slots.unreleased);
            for (i, lease) in leases.into_iter().enumerate() {
                match done.get(i) {
                    Some(Ok(answer)) => self.tick_after(&lease.1, answer),
                    _ => unreleased.push(lease),
                }
            }
        }
        if self.is_degraded() || self.slots.restricted(false) {
            self.wake_everyone();
        }
    }

    /// A release woke this worker (`payload`: the tier key, the wake's token, the flow's
    /// class and tenant, a line each): keep it for that flow, and pass it on, leaving the
    /// flow, if no acquire of the tier answers it in time (or at once, for a tier this
    /// worker never queued in).
    pub(super) fn wake_arrived(self: &Arc<Self>, payload: &[u8]) {
        let Some([tier_key, token, class, tenant]) = std::str::from_utf8(payload)
            .ok()
            .and_then(|p| <[&str; 4]>::try_from(p.splitn(4, '\n').collect::<Vec<_>>()).ok())
        else {
            return;
        };
        let flow = format!("{class}|{tenant}");
        if !self.wakes.woken(tier_key, token, &flow) {
            return self.pass_wake(tier_key, token, Some(&flow));
        }
        self.fallback.slots.released.notify_waiters();
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let this = self.clone();
        let (tier_key, token) = (tier_key.to_owned(), token.to_owned());
        runtime.spawn(async move {
            tokio::time::sleep(super::wakes::PASS_AFTER).await;
            if let Some((arrived, flow)) = this.wakes.unanswered(&tier_key, &token) {
                // Left unused with no acquire of the tier on its way since: no call of
                // the flow waits here any more.
                let leave = this.wakes.idle_since(&tier_key, arrived);
                this.pass_wake(&tier_key, &token, leave.then_some(flow.as_str()));
            }
        });
    }

    /// Passes on at once `n` wake-ups of `flow` in `tier` this worker has no call to answer
    /// with (leaving the flow with `leave`: no call of it waits here).
    pub(crate) fn pass_on_wakes(self: &Arc<Self>, tier: &Tier, flow: &str, n: usize, leave: bool) {
        let tier_key = self.keys.slots_tier(tier);
        for _ in 0..n {
            let Some(token) = self.wakes.answer(&tier_key, flow) else {
                return;
            };
            self.pass_wake(&tier_key, &token, leave.then_some(flow));
        }
    }

    /// Every waiter of this worker tries again (see `redis/wakes.rs`).
    pub(super) fn wake_everyone(&self) {
        self.wakes.everyone();
        self.fallback.slots.released.notify_waiters();
    }

    pub(crate) fn take_wakes(&self) -> Option<crate::store::SlotWakes> {
        self.wakes.take()
    }

    /// What a waiter of `tier` waits on while releases wake workers one by one; `None`
    /// while this worker keeps to its own share (its waiters wait for any release).
    pub(crate) fn wake_for(&self, tier: &Tier) -> Option<Arc<tokio::sync::Notify>> {
        self.wakes_per_freed_slot()
            .then(|| self.wakes.notify_for(&self.keys.slots_tier(tier)))
    }

    /// Whether a freed slot wakes one queued worker (Redis answers, and this worker's
    /// calls are all counted there) rather than this worker's waiters trying on any
    /// release.
    pub(crate) fn wakes_per_freed_slot(&self) -> bool {
        !self.slots.restricted(self.is_degraded())
    }

    /// Retries the releases that could not be made when they happened.
    pub(super) async fn release_unreleased(self: &Arc<Self>) {
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

    pub(crate) fn slots_in_use(self: &Arc<Self>, tier: Option<&Tier>) -> StoreFuture<u32> {
        let key = match tier {
            Some(tier) => self.keys.slots_tier(tier),
            None => self.keys.slots_global.clone(),
        };
        if self.is_degraded() {
            return StoreFuture::ready(self.in_flight_here(tier.map(|_| key.as_str())));
        }
        let local_key = tier.map(|_| key.clone());
        let this = self.clone();
        StoreFuture::pending(async move {
            let mut conn = this.conn.clone();
            let mut in_use = this.slot_scripts.in_use.prepare_invoke();
            in_use.key(&key);
            let call = in_use.invoke_async(&mut conn);
            match this.guard(call).await {
                Some(n) => n,
                None => this.in_flight_here(local_key.as_deref()),
            }
        })
    }

    /// Calls in flight through this worker: all (`None`) or of one tier key.
    fn in_flight_here(&self, tier_key: Option<&str>) -> u32 {
        let held = lock(&self.slots.held);
        let n = held
            .values()
            .filter(|h| h.counted != Counted::Acquiring && tier_key.is_none_or(|k| h.tier_key == k))
            .count();
        u32::try_from(n).unwrap_or(u32::MAX)
    }

    pub(crate) fn slot_released(&self) -> &tokio::sync::Notify {
        &self.fallback.slots.released
    }

    pub(crate) fn alive_workers(&self) -> u32 {
        self.slots.alive_workers.load(Ordering::Relaxed).max(1)
    }

    /// The workers to share a limit with while Redis is away: those last seen alive, at
    /// least the configured fleet, at least 1.
    pub(super) fn known_workers(&self) -> u32 {
        self.alive_workers()
            .max(self.slots.expected_workers.unwrap_or(1))
    }

    /// Renews held leases that reached a third of their TTL, and says this worker is alive,
    /// in one script call; resyncs when Redis lost this worker's bookkeeping or leases. Run
    /// by the background task while Redis is up.
    pub(super) async fn slot_heartbeat(&self) {
        let now = Instant::now();
        // A fallback slot taken while Redis answers (it refused a call) is put back.
        let local = lock(&self.slots.held)
            .values()
            .any(|h| h.counted == Counted::Local);
        if local && !self.is_degraded() {
            self.resync(false, None).await;
            return;
        }
        let leases: Vec<(String, String, u64)> = {
            let held = lock(&self.slots.held);
            let lease_due = held
                .values()
                .any(|h| now.saturating_duration_since(h.renewed) >= h.ttl / 3);
            let worker_due = lock(&self.slots.last_heartbeat)
                .is_none_or(|at| now.saturating_duration_since(at) >= WORKER_HEARTBEAT);
            if !lease_due && !worker_due && !self.slots.settling() {
                return;
            }
            held.iter()
                .filter(|(_, h)| h.counted == Counted::Shared)
                .flat_map(CallInFlight::sets)
                .collect()
        };
        let epoch = lock(&self.slots.epoch).clone();
        let mut invocation = self.slot_scripts.heartbeat.prepare_invoke();
        invocation
            .key(&self.keys.slots_global)
            .key(&self.keys.slots_workers)
            .key(&self.keys.slots_epoch)
            .key(&self.keys.slots_waits)
            .arg(&self.worker_id)
            .arg(duration_ms(WORKER_TTL))
            .arg(epoch.as_deref().unwrap_or(""));
        for (id, tier_key, ttl_ms) in &leases {
            invocation.key(tier_key).arg(id).arg(*ttl_ms);
        }
        let mut conn = self.conn.clone();
        let Some(answer) = self
            .guard(invocation.invoke_async::<Vec<String>>(&mut conn))
            .await
        else {
            return;
        };
        let alive = match answer.as_slice() {
            [alive, _global, ..] => alive.parse().unwrap_or(1),
            _ => {
                // Redis lost this worker's bookkeeping: put its calls back.
                self.resync(false, Some(epoch)).await;
                return;
            }
        };
        *lock(&self.slots.last_heartbeat) = Some(now);
        let lost = {
            let mut held = lock(&self.slots.held);
            for (id, _, _) in &leases {
                if let Some(h) = held.get_mut(id) {
                    h.renewed = now;
                }
            }
            // A lease gone from Redis whose call still runs (not one released meanwhile).
            answer[2..].iter().any(|id| held.contains_key(id))
        };
        self.slots.workers_seen(alive);
        if lost {
            self.resync(false, None).await;
        }
    }
}
