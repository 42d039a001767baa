//! Waiting for a slot: in arrival order per tier, woken by releases, bounded by max wait.

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, sleep_until};

use super::{Busy, SlotPolicy, TierLimit};
use crate::admission::SlowWait;
use crate::gate::WaitReason;
use crate::hash::{HashMap, HashSet};
use crate::rng::Rng;
use crate::store::{SlotLease, SlotLimits, SlotQueue, SlotRefusal, Store, StoreFuture};
use crate::sync::lock;
use crate::{TenantId, Tier, metrics};

/// The slot limiter one layer (and its clones) shares: the policy's caps and each tier's
/// waiting line.
pub(super) struct SlotLimiter {
    pub(super) policy: SlotPolicy,
    /// The caps as a capability: slots are taken, and freed ones heard of, through it. A
    /// fair queue above is handed the same gate: requests it took a slot of it for go
    /// through.
    pub(super) gate: crate::SlotGate,
    /// Every configured tier's limit and state, built once: the tiers are fixed by the
    /// policy, so the request path finds both with one lookup and no lock.
    tiers: HashMap<Tier, (TierLimit, Arc<TierState>)>,
    /// The default tier's entry (the same state as its entry in `tiers`): what requests with
    /// no tier or an unknown one count under.
    default: (TierLimit, Arc<TierState>),
    /// Unknown tier names already logged (bounded: the names come from callers).
    unknown_logged: Mutex<HashSet<Tier>>,
    /// Whether a fair queue above without this layer's gate was warned of (once).
    ungated_warned: AtomicBool,
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
    /// The last slot taken here took the last room and left this worker queued for a
    /// wake-up (Redis): the next waiter waits for it instead of trying.
    full: AtomicBool,
    /// Moving average of how long a slot is held, in nanoseconds (0: not seen yet).
    avg_hold_ns: AtomicU64,
    /// With a tenant cap: one line per tenant with requests trying or waiting here (see
    /// [`TenantLine`]). Empty, and never touched, when the tier caps no tenant.
    tenants: Mutex<HashMap<TenantId, Arc<Semaphore>>>,
}

impl TierState {
    fn new() -> Self {
        TierState {
            turnstile: Arc::new(Semaphore::new(1)),
            waiting: AtomicUsize::new(0),
            full: AtomicBool::new(false),
            avg_hold_ns: AtomicU64::new(0),
            tenants: Mutex::new(HashMap::default()),
        }
    }

    /// Requests of this tier waiting here now.
    pub(super) fn waiting(&self) -> usize {
        self.waiting.load(Ordering::Relaxed)
    }

    /// A place in `tenant`'s line (not its turn yet).
    pub(super) fn tenant_line(self: &Arc<Self>, tenant: &TenantId) -> TenantLine {
        let line = lock(&self.tenants)
            .entry(tenant.clone())
            .or_insert_with(|| Arc::new(Semaphore::new(1)))
            .clone();
        TenantLine {
            state: self.clone(),
            tenant: tenant.clone(),
            line,
            turn: None,
        }
    }
}

/// A request's place in its tenant's line, in a tier that caps tenants.
///
/// A tenant at its own cap must not hold the tier's turnstile while it waits, or every
/// other tenant of the tier would wait behind it. So the requests of one tenant queue
/// first in their tenant's line (one permit, FIFO): only the request at its head goes on
/// to the tier's turnstile and tries the store, and when the store refuses it for the
/// tenant's cap it gives the turnstile back and waits apart for a release — with its
/// tenant's other requests behind it here, not in the tier's queue. One request per
/// tenant and worker tries at a time, however many the tenant sends.
///
/// The line is removed from the tier's map when its last holder goes.
pub(super) struct TenantLine {
    state: Arc<TierState>,
    tenant: TenantId,
    line: Arc<Semaphore>,
    turn: Option<OwnedSemaphorePermit>,
}

impl TenantLine {
    /// Takes the head of the line if nobody of the tenant is there.
    pub(super) fn try_take(&mut self) -> bool {
        if self.turn.is_none() {
            self.turn = self.line.clone().try_acquire_owned().ok();
        }
        self.turn.is_some()
    }
}

impl Drop for TenantLine {
    fn drop(&mut self) {
        drop(self.turn.take());
        let mut tenants = lock(&self.state.tenants);
        // The map's and this one: nobody else holds or waits in the line. Others clone it
        // only under this lock.
        if Arc::strong_count(&self.line) == 2 {
            tenants.remove(&self.tenant);
        }
    }
}

impl SlotLimiter {
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
        SlotLimiter {
            gate: crate::SlotGate::new(store, policy.clone()),
            policy,
            tiers,
            default,
            unknown_logged: Mutex::new(HashSet::default()),
            ungated_warned: AtomicBool::new(false),
            rng: Mutex::new(rng),
        }
    }

    /// A fair queue above dispatched a request without this layer's gate: the request now
    /// waits here for its slot in arrival order, not in the fair order, so when a cap binds
    /// a paid tier can wait behind a flood. Said once per layer, naming the fix.
    pub(super) fn warn_fair_queue_ungated(&self) {
        if !self.ungated_warned.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                name: "slots.fair_queue_ungated",
                "a DrrFairness above this TierSlotLimit was not handed its gate: when a cap \
                 binds, requests wait here in arrival order and lose the fair order and the \
                 tier promise; build the fair queue with \
                 `.slot_gate(tier_slot_limit_layer.gate())` (and `.rate_gate(..)`), or use \
                 FairgateLayer, which wires both"
            );
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

    /// The tier `asked` counts against (the default tier for an unknown one), for a
    /// request whose slot is held above: its cap and state are not needed.
    pub(super) fn resolve_tier(&self, asked: Option<&Tier>) -> Tier {
        match asked {
            Some(asked) if self.tiers.contains_key(asked) => asked.clone(),
            _ => self.policy.default_tier.clone(),
        }
    }

    pub(super) fn limits(&self, limit: TierLimit) -> SlotLimits {
        SlotLimits::of(&self.policy, limit)
    }

    pub(super) fn busy(&self, tier: Tier, started: Instant) -> Busy {
        self.busy_because(tier, started, WaitReason::Slot)
    }

    /// `Busy` for `reason`: [`WaitReason::Store`] when the store refused the call because
    /// Redis is away ([`SlotRefusal::Store`]), at once rather than at the max wait.
    pub(super) fn busy_because(&self, tier: Tier, started: Instant, reason: WaitReason) -> Busy {
        metrics::server_busy(&tier, reason);
        let waited = started.elapsed();
        crate::trace::waited(reason, waited);
        let retry = self.policy.limit(Some(&tier)).1.retry;
        Busy::new(tier, waited, self.policy.retry_after)
            .because(reason)
            .retrying(retry)
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

    /// A poll interval jittered by +/-50%, so waiters across workers do not poll in step:
    /// the policy's, or the store's longer one while freed slots wake waiters one by one
    /// (not for a tenant over its own cap, who is not woken that way).
    fn poll_interval(&self, tenant_capped: bool) -> Duration {
        let unit = lock(&self.rng).unit();
        let interval = match tenant_capped {
            true => self.policy.poll_interval,
            false => self.gate.poll_every(self.policy.poll_interval),
        };
        interval.mul_f64(0.5 + unit)
    }

    /// How an acquire for a call that waits if refused queues on Redis (none for a tier
    /// that fails fast: its refused calls do not wait): `waiting` calls of its tier wait
    /// here, this one included.
    pub(super) fn queue(&self, limit: TierLimit, waiting: usize) -> Option<SlotQueue> {
        // Its calls of the tier are one flow, in the order this layer keeps.
        (!limit.max_wait.is_zero()).then(|| SlotQueue {
            weight: 1,
            class: crate::Priority::Standard,
            class_weight: 1,
            tenant: None,
            group: None,
            cost: 1,
            waiting: u32::try_from(waiting.max(1)).unwrap_or(u32::MAX),
            cells: None,
        })
    }

    /// Takes `lease` as the slot of a waiting call acquired with `queue`; remembers whether
    /// it took the last room while this worker stayed queued for the others.
    fn granted(&self, state: &TierState, lease: &SlotLease, queue: Option<SlotQueue>) {
        let last = lease.room() == 0 && queue.is_some_and(|q| q.waiting > 1);
        state.full.store(last, Ordering::Relaxed);
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
    held: Option<HeldSlot>,
}

/// The slot a permit holds: its lease, its tier's state, and when it was taken.
struct HeldSlot {
    lease: SlotLease,
    state: Arc<TierState>,
    acquired: Instant,
}

impl SlotPermit {
    pub(super) fn new(lease: SlotLease, state: Arc<TierState>) -> Self {
        metrics::slot_taken(lease.tier(), lease.is_fallback(), None);
        SlotPermit {
            tier: lease.tier().clone(),
            held: Some(HeldSlot {
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

/// An acquire made but not yet polled, with how it queues.
pub(super) type FirstTry = (
    StoreFuture<Result<SlotLease, SlotRefusal>>,
    Option<SlotQueue>,
);

/// A request that waits for a slot, as the service hands it to [`wait_for_slot`].
pub(super) struct SlotWait {
    pub(super) shared: Arc<SlotLimiter>,
    /// The tier the request counts under, with its limit and its state here.
    pub(super) tier: Tier,
    pub(super) limit: TierLimit,
    pub(super) state: Arc<TierState>,
    /// When the request arrived: its max wait runs from then.
    pub(super) started: Instant,
    /// Its place in its tenant's line, in a tier that caps tenants.
    pub(super) tenant: Option<TenantLine>,
    /// The tier's turnstile, when the caller already took it.
    pub(super) turn: Option<OwnedSemaphorePermit>,
    /// An acquire the caller made while holding `turn` but did not poll (a Redis round
    /// trip not yet begun), with how it queues.
    pub(super) first_try: Option<FirstTry>,
}

/// Waits for a slot until the tier's max wait has passed since the request arrived.
///
/// Takes the tier's turnstile first (arrival order), then tries the store each time a slot
/// may have come free: a local release or one announced by another worker wakes it at once,
/// and a jittered poll catches anything missed.
///
/// In a tier that caps tenants, the request first takes the head of its tenant's line,
/// before the turnstile (see [`TenantLine`]); refused for the tenant's cap, it gives the
/// turnstile back and waits for a release, then queues for it again.
///
/// An acquire the caller made but did not poll ([`SlotWait::first_try`]) is the first try
/// instead of making another.
pub(super) async fn wait_for_slot(mut wait: SlotWait) -> Result<SlotPermit, Busy> {
    let mut turn = wait.turn.take();
    let mut waiter = Waiter::new(wait);
    waiter.take_tenant_turn().await?;
    // Made before this wait began: if Redis went away since, drop it unpolled (nothing was
    // sent, so nothing leaks) and take the fallback's answer as a fresh acquire would.
    if waiter.first_try.is_some() && waiter.shared.gate.is_degraded() {
        waiter.first_try = None;
    }
    loop {
        let turn = match turn.take() {
            Some(turn) => turn,
            None => {
                let turnstile = waiter.state.turnstile.clone();
                waiter.take_turn_of(turnstile).await?
            }
        };
        if let Some(permit) = waiter.try_while_holding(turn).await? {
            return Ok(permit);
        }
    }
}

/// One request's wait, from its first try to its slot or its `Busy`. It counts itself in
/// its tier's waiters (the early-rejection estimate) while it lives.
struct Waiter {
    shared: Arc<SlotLimiter>,
    tier: Tier,
    limit: TierLimit,
    state: Arc<TierState>,
    started: Instant,
    limits: SlotLimits,
    deadline: Instant,
    slow: SlowWait,
    tenant: Option<TenantLine>,
    first_try: Option<FirstTry>,
}

impl Waiter {
    fn new(wait: SlotWait) -> Self {
        let deadline = crate::time::after(wait.started, wait.limit.max_wait);
        let slow = SlowWait::new(
            wait.started,
            wait.shared.policy.slow_wait,
            wait.shared.gate.slow_waits().clone(),
        );
        let limits = wait.shared.limits(wait.limit);
        wait.state.waiting.fetch_add(1, Ordering::Relaxed);
        Waiter {
            shared: wait.shared,
            tier: wait.tier,
            limit: wait.limit,
            state: wait.state,
            started: wait.started,
            limits,
            deadline,
            slow,
            tenant: wait.tenant,
            first_try: wait.first_try,
        }
    }

    fn busy(&self) -> Busy {
        self.shared.busy(self.tier.clone(), self.started)
    }

    /// In a tier that caps tenants: the head of the tenant's line, unless already taken.
    async fn take_tenant_turn(&mut self) -> Result<(), Busy> {
        let Some(line) = self.tenant.as_ref().filter(|line| line.turn.is_none()) else {
            return Ok(());
        };
        let queue = line.line.clone();
        let turn = self.take_turn_of(queue).await?;
        if let Some(line) = self.tenant.as_mut() {
            line.turn = Some(turn);
        }
        Ok(())
    }

    /// `queue`'s one permit, or `Busy` at the deadline.
    async fn take_turn_of(&mut self, queue: Arc<Semaphore>) -> Result<OwnedSemaphorePermit, Busy> {
        match take_turn(queue, self.deadline, &mut self.slow, &self.tier).await {
            Some(turn) => Ok(turn),
            None => Err(self.busy()),
        }
    }

    /// Tries for a slot while holding the tier's turnstile, and between tries waits for a
    /// slot to come free. `None`: refused for the tenant's own cap, it gave the turnstile
    /// back while it waited, and queues for it again.
    async fn try_while_holding(
        &mut self,
        turn: OwnedSemaphorePermit,
    ) -> Result<Option<SlotPermit>, Busy> {
        let mut holding = Some(turn);
        loop {
            // Registered before trying, so a release between the try and the wait is not
            // missed (an acquire does nothing until polled, so this holds for `first_try`
            // too). While freed slots wake workers one by one, a wake-up for this tier is
            // waited for; otherwise, and by a tenant over its own cap (not woken that way),
            // any release.
            let woken = self.shared.gate.wake_for(&self.tier);
            let tier_woken = woken.as_ref().map(|woken| woken.notified());
            let released = self.shared.gate.released().notified();
            tokio::pin!(tier_woken, released);
            if let Some(tier_woken) = tier_woken.as_mut().as_pin_mut() {
                tier_woken.enable();
            }
            released.as_mut().enable();
            let handed = self.first_try.take();
            let refusal = match self.acquire(woken.is_some(), handed) {
                Some((acquire, queue)) => match acquire.await {
                    Ok(lease) => return Ok(Some(self.slot_taken(lease, queue))),
                    Err(refusal) => refusal,
                },
                None => SlotRefusal::Full,
            };
            let (wake, apart) = self.next_try(refusal)?;
            if apart {
                // Over its own cap: the tier's other tenants go on meanwhile.
                drop(holding.take());
            }
            match tier_woken.as_mut().as_pin_mut().filter(|_| !apart) {
                // A wake-up for the tier this notification would have carried goes on to
                // the next waiter of the tier when it is dropped unclaimed (tokio's Notify).
                Some(tier_woken) => tokio::select! {
                    _ = tier_woken => {}
                    _ = sleep_until(wake) => {}
                },
                None => tokio::select! {
                    _ = released => {}
                    _ = sleep_until(wake) => {}
                },
            }
            self.slow.check(&self.tier);
            if apart {
                return Ok(None); // queue for the turnstile again
            }
        }
    }

    /// The acquire for this try: the one `handed` over, or a fresh one. `None` when the last
    /// slot taken here took the last room and the next comes with a wake-up (`woken`: this
    /// tier is woken that way).
    fn acquire(&self, woken: bool, handed: Option<FirstTry>) -> Option<FirstTry> {
        let full = woken && self.state.full.swap(false, Ordering::Relaxed);
        if full && handed.is_none() {
            return None;
        }
        Some(handed.unwrap_or_else(|| {
            let queue = self.shared.queue(self.limit, self.state.waiting());
            let asking = self.tenant.as_ref().map(|line| &line.tenant);
            let acquire = self
                .shared
                .gate
                .acquire(&self.tier, asking, self.limits, queue.clone());
            (acquire, queue)
        }))
    }

    /// Takes `lease` as this request's slot, acquired with `queue`.
    fn slot_taken(&self, lease: SlotLease, queue: Option<SlotQueue>) -> SlotPermit {
        self.shared.granted(&self.state, &lease, queue);
        let waited = self.started.elapsed();
        metrics::slot_wait(&self.tier, waited);
        crate::trace::waited(WaitReason::Slot, waited);
        SlotPermit::new(lease, self.state.clone())
    }

    /// After a refusal: `Busy` if Redis is away or the max wait has passed, else when to
    /// try again at the latest, and whether to wait apart (refused for the tenant's own
    /// cap, without the turnstile).
    fn next_try(&self, refusal: SlotRefusal) -> Result<(Instant, bool), Busy> {
        if refusal == SlotRefusal::Store {
            let tier = self.tier.clone();
            return Err(self
                .shared
                .busy_because(tier, self.started, WaitReason::Store));
        }
        let now = Instant::now();
        if now >= self.deadline {
            return Err(self.busy());
        }
        let apart = refusal == SlotRefusal::TenantCap;
        let poll = self.shared.poll_interval(apart);
        let mut wake = self.deadline.min(crate::time::after(now, poll));
        if let Some(at) = self.slow.next() {
            wake = wake.min(at.max(now));
        }
        Ok((wake, apart))
    }
}

impl Drop for Waiter {
    fn drop(&mut self) {
        self.state.waiting.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Waits for `queue`'s one permit until `deadline`, warning of a slow wait on the way.
/// `None` at the deadline.
async fn take_turn(
    queue: Arc<Semaphore>,
    deadline: Instant,
    slow: &mut SlowWait,
    tier: &Tier,
) -> Option<OwnedSemaphorePermit> {
    // One acquire for the whole wait: the slow-wait warning wakes this loop, and must not
    // cost the waiter its place in the queue.
    let acquire = queue.acquire_owned();
    tokio::pin!(acquire);
    loop {
        let wake = slow.next().map_or(deadline, |at| deadline.min(at));
        tokio::select! {
            biased;
            // Never closed; treat as a timeout rather than panic.
            turn = &mut acquire => return turn.ok(),
            _ = sleep_until(wake) => {
                if Instant::now() >= deadline {
                    return None;
                }
                slow.check(tier);
            }
        }
    }
}
