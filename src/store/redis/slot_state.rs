//! What a worker counts of its own calls in flight, and the share of the caps it keeps to
//! while Redis is away, restricted or settling after a new epoch (the rules are in
//! `slots.rs`'s module docs, "Faults: reconcile, don't guess").

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use super::{duration_ms, lock};
use crate::store::OutagePolicy;
use crate::store::slots::{SlotLimits, SlotRefusal};

/// How long a worker's word that it is alive lasts (it says so once a second).
pub(super) const WORKER_TTL: Duration = Duration::from_secs(3);

/// Where a call in flight is counted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Counted {
    /// Its acquire is on the way: maybe in Redis, surely counted here.
    Acquiring,
    /// A lease in Redis.
    Shared,
    /// A fallback slot, not (yet) in Redis.
    Local,
}

/// A call this worker has in flight.
pub(super) struct CallInFlight {
    pub(super) tier_key: String,
    /// The tenant's lease set the call is also in, when its tier caps tenants.
    pub(super) tenant_key: Option<String>,
    pub(super) ttl: Duration,
    pub(super) renewed: Instant,
    pub(super) counted: Counted,
    /// When the call took its slot.
    pub(super) since: Instant,
}

impl CallInFlight {
    /// The (lease id, set, TTL in ms) entries the resync and heartbeat scripts put back or
    /// renew for a call: its tier's set, and its tenant's when it is counted there. The
    /// scripts treat each entry alike (and the global set once more, harmlessly), so a
    /// tenant's leases expire, are renewed and come back exactly as the tier's do.
    pub(super) fn sets(
        (id, held): (&String, &CallInFlight),
    ) -> impl Iterator<Item = (String, String, u64)> {
        let ttl = duration_ms(held.ttl);
        let tenant = held.tenant_key.clone().map(|key| (id.clone(), key, ttl));
        std::iter::once((id.clone(), held.tier_key.clone(), ttl)).chain(tenant)
    }
}

/// Why this worker keeps to its share although Redis may answer.
#[derive(Debug, Default)]
pub(super) struct Restriction {
    /// After a new epoch: until this many workers are back in it, or until the instant.
    pub(super) settling: Option<(u32, Instant)>,
    /// This worker's calls in flight when the restriction began, if Redis counted them
    /// then (it had synced).
    pub(super) own: Option<Own>,
}

/// This worker's leases in Redis when a restriction began: by tier key and by tenant key,
/// when each expires there at the earliest. A lease taken or renewed by a call sent at
/// `renewed` lives in Redis until at least `renewed + ttl` (the server adds the TTL to its
/// own clock when the script runs, after the call was sent), so until then no other worker
/// can be given its slot, even if only this worker is cut off from Redis.
#[derive(Debug)]
pub(super) struct Own {
    pub(super) at: Instant,
    pub(super) tiers: HashMap<String, Vec<Instant>>,
    pub(super) tenants: HashMap<String, Vec<Instant>>,
}

impl Own {
    /// How many calls were counted in all, and in `tier_key`, when the restriction began.
    pub(super) fn counted(&self, tier_key: &str) -> (usize, usize) {
        let global = self.tiers.values().map(Vec::len).sum();
        (global, self.tiers.get(tier_key).map_or(0, Vec::len))
    }

    /// How many of the leases of `key` (in `map`) still live in Redis at `now`.
    pub(super) fn live(map: &HashMap<String, Vec<Instant>>, key: &str, now: Instant) -> usize {
        map.get(key).map_or(0, |expiries| {
            expiries.iter().filter(|&&at| at > now).count()
        })
    }

    /// How many of all its leases still live in Redis at `now`.
    pub(super) fn live_global(&self, now: Instant) -> usize {
        self.tiers
            .values()
            .flatten()
            .filter(|&&at| at > now)
            .count()
    }
}

/// This worker's side of the shared slots.
pub(super) struct SlotState {
    /// Every call in flight through this worker, by lease id.
    pub(super) held: Mutex<HashMap<String, CallInFlight>>,
    /// Leases that may be in Redis with nobody holding them: released while Redis was away,
    /// or taken by an acquire whose answer never arrived (timed out, or its caller gone).
    /// The background task releases them once Redis answers; their TTL is the backstop.
    pub(super) unreleased: Mutex<Vec<(String, String)>>,
    pub(super) last_heartbeat: Mutex<Option<Instant>>,
    /// Workers alive at the last heartbeat (this one included); 0 until Redis answered.
    pub(super) alive_workers: AtomicU32,
    /// The fleet size configured for a worker that knows no better.
    pub(super) expected_workers: Option<u32>,
    /// The epoch this worker's calls were last put back in (`None`: never).
    pub(super) epoch: Mutex<Option<String>>,
    pub(super) restriction: Mutex<Restriction>,
    /// One resync at a time; the others wait for it and reuse its result.
    pub(super) resyncing: tokio::sync::Mutex<()>,
    /// Back from an outage, putting its calls back: no new fallback slot, or it would be
    /// missed by the resync under way.
    pub(super) recovering: AtomicBool,
    /// What to do once Redis has been away longer than a lease TTL.
    pub(super) after_outage: OutagePolicy,
    /// How long this worker's calls hold their slots, on average (microseconds; a moving
    /// average over the last calls or so).
    pub(super) hold_us: AtomicU64,
    /// Input tokens this worker's answered calls used beyond the estimates the fleet's
    /// token rate took for them (negative: fewer), not yet sent: the next release carries
    /// them (`tokens_correct` in `slot_queue.lua`).
    pub(super) tokens_beyond: AtomicI64,
}

impl SlotState {
    pub(super) fn new(expected_workers: Option<u32>, after_outage: OutagePolicy) -> Self {
        SlotState {
            held: Mutex::new(HashMap::new()),
            unreleased: Mutex::new(Vec::new()),
            last_heartbeat: Mutex::new(None),
            alive_workers: AtomicU32::new(0),
            expected_workers,
            epoch: Mutex::new(None),
            restriction: Mutex::new(Restriction::default()),
            resyncing: tokio::sync::Mutex::new(()),
            recovering: AtomicBool::new(false),
            after_outage,
            hold_us: AtomicU64::new(0),
            tokens_beyond: AtomicI64::new(0),
        }
    }

    /// A call that held its slot since `since` ended.
    pub(super) fn held_for(&self, since: Instant) {
        let sample = u64::try_from(since.elapsed().as_micros()).unwrap_or(u64::MAX);
        let _ = self
            .hold_us
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |avg| {
                Some(match avg {
                    0 => sample,
                    avg => avg - avg / 8 + sample / 8,
                })
            });
    }

    /// The workers this one shares the caps with, as far as it knows: the last count seen
    /// alive, at least the configured fleet; `u32::MAX` (one slot each) when it knows neither.
    pub(super) fn fleet(&self) -> u32 {
        match (
            self.alive_workers.load(Ordering::Relaxed),
            self.expected_workers,
        ) {
            (0, None) => u32::MAX,
            (seen, expected) => seen.max(expected.unwrap_or(1)).max(1),
        }
    }

    /// Keeps to the share from now on (until [`restricted`](Self::restricted) says not),
    /// and to the leases this worker holds in Redis now, if Redis counted its calls.
    /// `mark_degraded` calls it, so "now" is when the fault was first seen: an operation
    /// that failed or timed out, or the subscription closed by the server (`pubsub.rs`).
    pub(super) fn freeze(&self) {
        if lock(&self.epoch).is_none() {
            return; // never counted in Redis: it holds nothing the others counted on
        }
        let own = {
            // Leases only: an acquire under way may have been refused, a fallback slot is
            // not in Redis.
            let held = lock(&self.held);
            let mut tiers: HashMap<String, Vec<Instant>> = HashMap::new();
            let mut tenants: HashMap<String, Vec<Instant>> = HashMap::new();
            for h in held.values().filter(|h| h.counted == Counted::Shared) {
                let expiry = crate::time::after(h.renewed, h.ttl);
                tiers.entry(h.tier_key.clone()).or_default().push(expiry);
                if let Some(key) = &h.tenant_key {
                    tenants.entry(key.clone()).or_default().push(expiry);
                }
            }
            Own {
                at: Instant::now(),
                tiers,
                tenants,
            }
        };
        lock(&self.restriction).own.get_or_insert(own);
    }

    /// Whether this worker keeps to its share now; ends a settling that ran out.
    pub(super) fn restricted(&self, degraded: bool) -> bool {
        let mut restriction = lock(&self.restriction);
        if restriction
            .settling
            .is_some_and(|(_, until)| Instant::now() >= until)
        {
            restriction.settling = None;
        }
        if degraded || restriction.settling.is_some() {
            return true;
        }
        restriction.own = None;
        false
    }

    /// Whether one more call of `tier_key` (and `tenant_key`, with a tenant cap) fits what
    /// this worker may hold while restricted (Redis away when `degraded`, else settling
    /// after a new epoch), counting every call it has in flight; if not, why.
    ///
    /// Redis away, with other workers alive, a worker that had synced keeps for one lease
    /// TTL to the leases it held when Redis went away, as long as each lives in Redis: all
    /// the fleet's calls were within the caps then, and the others cannot be given those
    /// slots before the leases expire, whether Redis died or only this worker is cut off. A
    /// call of a tier (or a capped tenant) it holds no live lease of cannot be admitted
    /// soundly: [`SlotRefusal::Store`], at once. Past the TTL, the [`OutagePolicy`].
    /// Otherwise (never synced, alone, settling) it keeps to its share of the caps, and
    /// while settling within a TTL of the fault also to what it held then.
    pub(super) fn fits(
        &self,
        held: &HashMap<String, CallInFlight>,
        tier_key: &str,
        tenant_key: Option<&str>,
        limits: SlotLimits,
        degraded: bool,
    ) -> Result<(), SlotRefusal> {
        let fleet = self.fleet();
        let in_tier = held.values().filter(|h| h.tier_key == tier_key).count();
        let of_tenant = |key: &str| {
            held.values()
                .filter(|h| h.tenant_key.as_deref() == Some(key))
                .count()
        };
        let restriction = lock(&self.restriction);
        let own = restriction.own.as_ref().filter(|_| fleet > 1);
        let within_ttl = own.is_some_and(|own| own.at.elapsed() < limits.lease_ttl);
        match own {
            Some(own) if degraded && within_ttl => {
                // A lease that expires before a call of the usual length would end is not
                // used for a new one: under a partition the call would outlive it, while
                // another worker may be given its slot.
                let hold = Duration::from_micros(self.hold_us.load(Ordering::Relaxed));
                let now = crate::time::after(Instant::now(), hold);
                let tier_live = Own::live(&own.tiers, tier_key, now);
                if tier_live == 0 {
                    return Err(SlotRefusal::Store);
                }
                if held.len() >= own.live_global(now) || in_tier >= tier_live {
                    return Err(SlotRefusal::Full); // one of its own calls must end
                }
                if let (Some(key), Some(_)) = (tenant_key, limits.tenant) {
                    match Own::live(&own.tenants, key, now) {
                        0 => return Err(SlotRefusal::Store),
                        live if of_tenant(key) >= live => return Err(SlotRefusal::TenantCap),
                        _ => {}
                    }
                }
                return Ok(());
            }
            Some(_) if degraded && self.after_outage == OutagePolicy::Refuse => {
                return Err(SlotRefusal::Store);
            }
            _ => {}
        }
        let share = limits.share_of(fleet);
        if held.len() >= share.global as usize || in_tier >= share.tier as usize {
            return Err(SlotRefusal::Full);
        }
        // Settling after a new epoch, within a TTL of the fault: also no more than this
        // worker held when it began (the others' counts seen before may be stale).
        if let Some(own) = own.filter(|_| within_ttl) {
            let (global, own_tier) = own.counted(tier_key);
            if held.len() >= global || in_tier >= own_tier {
                return Err(SlotRefusal::Full);
            }
        }
        // The tenant's share: its cap divided as the others are (the others' tenant counts
        // are not tracked; the share alone keeps the fleet under the cap).
        if let (Some(key), Some(cap)) = (tenant_key, share.tenant)
            && of_tenant(key) >= cap as usize
        {
            return Err(SlotRefusal::TenantCap);
        }
        Ok(())
    }

    /// A new epoch began for this worker: keep to the share until `need` workers are back.
    pub(super) fn settle(&self, need: u32, alive: u32) {
        self.freeze();
        if alive >= need {
            self.alive_workers.store(alive, Ordering::Relaxed);
            lock(&self.restriction).settling = None;
        } else {
            lock(&self.restriction).settling = Some((need, Instant::now() + WORKER_TTL));
        }
    }

    /// `alive` workers are back in the current epoch.
    pub(super) fn workers_seen(&self, alive: u32) {
        let mut restriction = lock(&self.restriction);
        match restriction.settling {
            Some((need, _)) if alive < need => {}
            _ => {
                // Redis answers and every worker is back: the restriction is over, and the
                // next fault must count this worker's calls afresh.
                restriction.settling = None;
                restriction.own = None;
                self.alive_workers.store(alive.max(1), Ordering::Relaxed);
            }
        }
    }

    /// An acquire counted `workers` records in the worker set: a worker that joined since
    /// this one's last heartbeat is known from now on (the heartbeat alone may leave it
    /// unknown for a second, and a worker that thinks it is alone serves an outage from the
    /// whole caps, or ends settling before the others put their calls back). Only raises:
    /// the heartbeat's exact count lowers it again.
    pub(super) fn workers_heard(&self, workers: u32) {
        self.alive_workers.fetch_max(workers, Ordering::Relaxed);
    }

    pub(super) fn settling(&self) -> bool {
        lock(&self.restriction).settling.is_some()
    }
}
