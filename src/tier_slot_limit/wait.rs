//! Waiting for a slot: in arrival order per tier, woken by releases, bounded by max wait.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, sleep_until};

use super::{Busy, SlotPolicy, TierLimit};
use crate::admission::SlowWait;
use crate::rng::Rng;
use crate::store::{SlotLease, SlotLimits, Store, StoreFuture};
use crate::sync::lock;
use crate::{Tier, metrics};

/// What one layer (and its clones) shares.
pub(super) struct Shared {
    pub(super) store: Store,
    pub(super) policy: SlotPolicy,
    /// Every configured tier's limit and state, built once: the tiers are fixed by the
    /// policy, so the request path finds both with one lookup and no lock.
    tiers: HashMap<Tier, (TierLimit, Arc<TierState>)>,
    /// The default tier's entry (the same state as its entry in `tiers`): what requests with
    /// no tier or an unknown one count under.
    default: (TierLimit, Arc<TierState>),
    /// Unknown tier names already logged (bounded: the names come from callers).
    unknown_logged: Mutex<HashSet<Tier>>,
    rng: Mutex<Rng>,
}

/// Distinct unknown tier names logged one by one; past that they are served silently.
const UNKNOWN_TIERS_LOGGED: usize = 100;

/// Per tier, in this process.
pub(super) struct TierState {
    /// One permit: the waiter holding it is the only one of its tier trying for a slot, so
    /// local waiters of a tier get slots in arrival order (tokio's semaphore is FIFO).
    pub(super) turnstile: Arc<Semaphore>,
    /// Requests of this tier waiting here now.
    waiting: AtomicUsize,
    /// Moving average of how long a slot is held, in nanoseconds (0: not seen yet).
    avg_hold_ns: AtomicU64,
}

impl TierState {
    fn new() -> Self {
        TierState {
            turnstile: Arc::new(Semaphore::new(1)),
            waiting: AtomicUsize::new(0),
            avg_hold_ns: AtomicU64::new(0),
        }
    }
}

impl Shared {
    pub(super) fn new(store: Store, policy: SlotPolicy) -> Self {
        let rng = policy.seed.map_or_else(Rng::from_entropy, Rng::seeded);
        let tiers: HashMap<_, _> = policy
            .tiers
            .iter()
            .map(|(tier, limit)| (tier.clone(), (*limit, Arc::new(TierState::new()))))
            .collect();
        // `build` refuses a default tier that is not configured; `limit` still answers if
        // one ever were, and so does this.
        let default = match tiers.get(&policy.default_tier) {
            Some(entry) => entry.clone(),
            None => (policy.limit(None).1, Arc::new(TierState::new())),
        };
        Shared {
            store,
            policy,
            tiers,
            default,
            unknown_logged: Mutex::new(HashSet::new()),
            rng: Mutex::new(rng),
        }
    }

    /// The tier a request counts under, its limit and its state, logging an unknown tier
    /// name once.
    pub(super) fn resolve(&self, asked: Option<&Tier>) -> (Tier, TierLimit, Arc<TierState>) {
        if let Some(asked) = asked {
            if let Some((limit, state)) = self.tiers.get(asked) {
                return (asked.clone(), *limit, state.clone());
            }
            let mut logged = lock(&self.unknown_logged);
            if logged.len() < UNKNOWN_TIERS_LOGGED && logged.insert(asked.clone()) {
                tracing::warn!(
                    name: "tier.unknown",
                    tier = %asked,
                    served_as = %self.policy.default_tier,
                    "unknown tier; served as the default tier"
                );
            }
        }
        let (limit, state) = &self.default;
        (self.policy.default_tier.clone(), *limit, state.clone())
    }

    pub(super) fn limits(&self, limit: TierLimit) -> SlotLimits {
        self.policy.limits(limit)
    }

    pub(super) fn busy(&self, tier: Tier, started: Instant) -> Busy {
        metrics::server_busy(&tier);
        Busy::new(tier, started.elapsed(), self.policy.retry_after)
    }

    /// Early rejection: requests of this tier already wait here, and the wait this one can
    /// expect behind them (its place x the observed hold time / the tier's cap) exceeds its
    /// max wait. A request with nobody ahead always gets its own try.
    pub(super) fn hopeless(&self, state: &TierState, limit: TierLimit) -> bool {
        let ahead = u32::try_from(state.waiting.load(Ordering::Relaxed)).unwrap_or(u32::MAX);
        if !self.policy.early_reject || ahead == 0 {
            return false;
        }
        let hold = Duration::from_nanos(state.avg_hold_ns.load(Ordering::Relaxed));
        let expected = hold.saturating_mul(ahead.saturating_add(1)) / limit.cap.max(1);
        expected > limit.max_wait
    }

    /// A poll interval jittered by +/-50%, so waiters across workers do not poll in step.
    fn poll_interval(&self) -> Duration {
        let unit = lock(&self.rng).unit();
        self.policy.poll_interval.mul_f64(0.5 + unit)
    }
}

/// A held slot plus the bookkeeping of this layer: the hold-time average and the gauge.
///
/// Moved into an `http::Response`'s body (see [`GuardResponse`](crate::body::GuardResponse)),
/// so a streaming answer keeps its slot until the body ends, fails or is dropped. A request
/// whose slot an outer layer already holds (see [`crate::admission`]) passes with an empty
/// permit: the slot is given back by the layer that took it.
pub struct SlotPermit {
    tier: Tier,
    held: Option<Held>,
}

struct Held {
    lease: SlotLease,
    state: Arc<TierState>,
    acquired: Instant,
}

impl SlotPermit {
    pub(super) fn new(lease: SlotLease, state: Arc<TierState>) -> Self {
        metrics::slot_taken(lease.tier(), lease.is_fallback());
        SlotPermit {
            tier: lease.tier().clone(),
            held: Some(Held {
                lease,
                state,
                acquired: Instant::now(),
            }),
        }
    }

    /// The slot is held by a layer outside this one.
    pub(super) fn held_above(tier: Tier) -> Self {
        SlotPermit { tier, held: None }
    }

    /// The tier the slot counts against.
    pub fn tier(&self) -> &Tier {
        &self.tier
    }

    /// Whether this permit holds the slot itself (`false`: an outer layer holds it).
    pub fn is_holding(&self) -> bool {
        self.held.is_some()
    }
}

impl Drop for SlotPermit {
    fn drop(&mut self) {
        let Some(held) = &self.held else {
            return;
        };
        let hold = held.acquired.elapsed().as_nanos().min(u128::from(u64::MAX)) as u64;
        // An exponential moving average with weight 1/8: cheap, and follows a shift within
        // a few dozen calls.
        let _ = held
            .state
            .avg_hold_ns
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |avg| {
                Some(if avg == 0 {
                    hold
                } else {
                    avg - avg / 8 + hold / 8
                })
            });
        metrics::slot_given_back(held.lease.tier());
    }
}

impl fmt::Debug for SlotPermit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut debug = f.debug_struct("SlotPermit");
        debug.field("tier", &self.tier);
        match &self.held {
            Some(held) => debug
                .field("lease", &held.lease)
                .field("held_for", &held.acquired.elapsed()),
            None => debug.field("held_above", &true),
        };
        debug.finish()
    }
}

/// Counts a waiter for the early-rejection estimate while it waits.
struct Waiting<'a>(&'a TierState);

impl<'a> Waiting<'a> {
    fn enter(state: &'a TierState) -> Self {
        state.waiting.fetch_add(1, Ordering::Relaxed);
        Waiting(state)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.waiting.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Waits for a slot until the tier's max wait has passed since `started`.
///
/// Takes the tier's turnstile first (arrival order), then tries the store each time a slot
/// may have come free: a local release or one announced by another worker wakes it at once,
/// and a jittered poll catches anything missed.
///
/// `first_try` is an acquire the caller made while holding `turn` but did not poll (a
/// Redis round trip not yet begun): used as the first try instead of making another.
pub(super) async fn wait_for_slot(
    shared: Arc<Shared>,
    tier: Tier,
    limit: TierLimit,
    state: Arc<TierState>,
    started: Instant,
    turn: Option<OwnedSemaphorePermit>,
    first_try: Option<StoreFuture<Option<SlotLease>>>,
) -> Result<SlotPermit, Busy> {
    let deadline = crate::time::after(started, limit.max_wait);
    let mut slow = SlowWait::new(started, shared.policy.slow_wait);
    let _waiting = Waiting::enter(&state);

    let _turn = match turn {
        Some(turn) => turn,
        None => {
            // One acquire for the whole wait: the slow-wait warning wakes this loop, and
            // must not cost the waiter its place in the turnstile's queue.
            let acquire = state.turnstile.clone().acquire_owned();
            tokio::pin!(acquire);
            loop {
                let wake = slow.next().map_or(deadline, |at| deadline.min(at));
                tokio::select! {
                    biased;
                    turn = &mut acquire => match turn {
                        Ok(turn) => break turn,
                        // Never closed; treat as a timeout rather than panic.
                        Err(_) => return Err(shared.busy(tier.clone(), started)),
                    },
                    _ = sleep_until(wake) => {
                        if Instant::now() >= deadline {
                            return Err(shared.busy(tier.clone(), started));
                        }
                        slow.check(&tier);
                    }
                }
            }
        }
    };

    let limits = shared.limits(limit);
    // Made before this wait began: if Redis went away since, drop it unpolled (nothing was
    // sent, so nothing leaks) and take the fallback's answer as a fresh acquire would.
    let mut first_try = first_try.filter(|_| !shared.store.is_degraded());
    loop {
        // Registered before trying, so a release between the try and the wait is not missed
        // (an acquire does nothing until polled, so this holds for `first_try` too).
        let released = shared.store.slot_released().notified();
        tokio::pin!(released);
        released.as_mut().enable();
        let acquire = first_try
            .take()
            .unwrap_or_else(|| shared.store.try_acquire_slot(&tier, limits));
        if let Some(lease) = acquire.await {
            metrics::slot_wait(&tier, started.elapsed());
            return Ok(SlotPermit::new(lease, state.clone()));
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(shared.busy(tier.clone(), started));
        }
        let mut wake = deadline.min(crate::time::after(now, shared.poll_interval()));
        if let Some(at) = slow.next() {
            wake = wake.min(at.max(now));
        }
        tokio::select! {
            _ = released => {}
            _ = sleep_until(wake) => {}
        }
        slow.check(&tier);
    }
}
