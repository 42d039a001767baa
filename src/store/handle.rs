//! The store's handle ([`Store`]), its builder and what its operations return; the
//! kinds of state behind it are the sibling modules.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::time::Instant;

use crate::admission::DemotionPolicy;
use crate::error::ConfigError;
use crate::{Priority, TenantId, Tier};

use super::kinds::{self, SlotLeases};
use super::memory::MemoryState;
use super::pacing::{LearnedLimits, PaceAsk, PaceGrant, PaceLimit};
use super::slots::{SlotLease, SlotLimits, SlotRefusal};

/// Whether a tenant is demoted, as a check found it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Demotion {
    /// Served by the classification rule.
    NotDemoted,
    /// Served as batch for `left` more.
    Demoted {
        /// Time left on the demotion.
        left: Duration,
        /// This check is the one that demoted the tenant.
        newly: bool,
    },
}

impl Demotion {
    /// Whether the tenant is demoted.
    pub fn is_demoted(&self) -> bool {
        matches!(self, Demotion::Demoted { .. })
    }
}

/// The future of a store operation: ready at once when no round trip is needed.
///
/// Store operations never fail: when Redis cannot answer, the in-process fallback does.
#[must_use = "futures do nothing unless polled"]
pub struct StoreFuture<T> {
    state: FutureState<T>,
}

enum FutureState<T> {
    Ready(Option<T>),
    Pending(Pin<Box<dyn Future<Output = T> + Send>>),
}

impl<T> StoreFuture<T> {
    /// Whether the answer is there already (no round trip).
    pub(crate) fn is_ready(&self) -> bool {
        matches!(self.state, FutureState::Ready(_))
    }

    pub(crate) fn ready(value: T) -> Self {
        StoreFuture {
            state: FutureState::Ready(Some(value)),
        }
    }

    pub(crate) fn pending(fut: impl Future<Output = T> + Send + 'static) -> Self {
        StoreFuture {
            state: FutureState::Pending(Box::pin(fut)),
        }
    }
}

impl<T> StoreFuture<T> {
    /// The value if it is already there, else the future itself (to poll later): an
    /// in-process store (or Redis's answer from this worker's own state) answers at once,
    /// so a caller can use an answer that costs no round trip and skip one that would.
    ///
    /// ```
    /// use fairgate::{Store, TenantId};
    ///
    /// let store = Store::memory();
    /// assert_eq!(store.tokens_today(&TenantId::new("t")).into_ready().ok(), Some(0));
    /// ```
    pub fn into_ready(self) -> Result<T, Self> {
        match self.state {
            FutureState::Ready(Some(value)) => Ok(value),
            state => Err(StoreFuture { state }),
        }
    }
}

// The value is moved out, never pinned in place.
impl<T> Unpin for StoreFuture<T> {}

impl<T> Future for StoreFuture<T> {
    type Output = T;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        match &mut self.get_mut().state {
            FutureState::Ready(value) => match value.take() {
                Some(value) => Poll::Ready(value),
                None => panic!("StoreFuture polled after completion"),
            },
            FutureState::Pending(fut) => fut.as_mut().poll(cx),
        }
    }
}

impl<T> fmt::Debug for StoreFuture<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match self.state {
            FutureState::Ready(Some(_)) => "ready",
            FutureState::Ready(None) => "done",
            FutureState::Pending(_) => "pending",
        };
        f.debug_struct("StoreFuture")
            .field("state", &state)
            .finish()
    }
}

/// The shared state handle.
///
/// # Clone
/// Cheap (an `Arc` inside); every clone shares the same state, connection and caches.
#[derive(Clone)]
pub struct Store {
    backend: Arc<Backend>,
}

// Lives behind the store's one `Arc`, so the size of a variant costs nothing per clone.
#[allow(clippy::large_enum_variant)]
pub(super) enum Backend {
    Memory(MemoryState),
    #[cfg(feature = "redis")]
    Redis(Arc<super::redis::RedisStore>),
}

impl fmt::Debug for Store {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Store")
            .field("backend", &self.backend_name())
            .field("degraded", &self.is_degraded())
            .finish()
    }
}

impl Default for Store {
    fn default() -> Self {
        Store::memory()
    }
}

/// Configures a [`Store`]: start from [`Store::builder`], finish with
/// [`memory`](StoreBuilder::memory) or `redis`.
#[derive(Clone, Debug)]
pub struct StoreBuilder {
    pub(crate) throttle_window: Duration,
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) redis: RedisOptions,
}

/// What a worker does with new calls once Redis has been away longer than a lease TTL
/// ([`StoreBuilder::after_outage`]).
///
/// For the first lease TTL after Redis goes away a worker keeps to what it held (see
/// [`StoreBuilder::after_outage`]): sound whether Redis died or only this worker was cut
/// off from it. Past that TTL the two cannot be told apart from here, and the other
/// workers may by then have been given this worker's expired leases, so one of two things
/// must give:
///
/// - [`Share`](OutagePolicy::Share) (the default): serve the caps divided by the workers
///   last seen alive. Available: a dead Redis costs nothing more, and the caps hold. Under
///   a partition (this worker cut off, the others still on Redis) the fleet can run over
///   the caps by at most the cut-off workers' shares.
/// - [`Refuse`](OutagePolicy::Refuse): refuse every new call at once
///   ([`SlotRefusal::Store`]) until Redis answers. Sound under any fault; a Redis outage
///   longer than a lease TTL is then an outage of every worker.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum OutagePolicy {
    /// Serve a share of the caps: the caps divided by the workers last seen alive.
    #[default]
    Share,
    /// Refuse every new call until Redis answers.
    Refuse,
}

/// Options that only the Redis backend uses (kept here so the builder is one type).
#[derive(Clone, Debug)]
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
pub(crate) struct RedisOptions {
    pub(crate) key_prefix: String,
    pub(crate) op_timeout: Duration,
    pub(crate) cache_ttl: Duration,
    pub(crate) flush_interval: Duration,
    pub(crate) probe_interval: Duration,
    pub(crate) expected_workers: Option<u32>,
    pub(crate) after_outage: OutagePolicy,
    /// The CA (PEM) trusted for `rediss://`, instead of the system's roots.
    pub(crate) tls_ca_pem: Option<Vec<u8>>,
}

impl Default for StoreBuilder {
    fn default() -> Self {
        StoreBuilder {
            throttle_window: Duration::from_secs(60),
            redis: RedisOptions {
                key_prefix: "fairgate".to_owned(),
                op_timeout: Duration::from_millis(150),
                cache_ttl: Duration::from_secs(1),
                flush_interval: Duration::from_millis(250),
                probe_interval: Duration::from_millis(250),
                expected_workers: None,
                after_outage: OutagePolicy::default(),
                tls_ca_pem: None,
            },
        }
    }
}

impl StoreBuilder {
    /// The sliding window throttles are counted in (default 60 s).
    pub fn throttle_window(mut self, window: Duration) -> Self {
        self.throttle_window = window;
        self
    }

    /// Builds an in-process store.
    ///
    /// # Errors
    /// A throttle window under 1 ms or over 30 days.
    pub fn memory(self) -> Result<Store, ConfigError> {
        self.validate()?;
        Ok(Store::in_process(self.throttle_window))
    }

    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        if self.throttle_window < Duration::from_millis(1)
            || self.throttle_window > Duration::from_secs(30 * 86_400)
        {
            return Err(ConfigError::new(
                "throttle window must be between 1 ms and 30 days",
            ));
        }
        Ok(())
    }
}

impl Store {
    /// The backend's implementation of every kind of shared state (`kinds.rs`).
    /// The slots, as the slot capability ([`SlotGate`](crate::SlotGate)) takes them.
    pub(crate) fn slot_leases(&self) -> &dyn SlotLeases {
        self.kinds()
    }

    pub(super) fn kinds(&self) -> &dyn kinds::AllKinds {
        match &*self.backend {
            Backend::Memory(memory) => memory,
            #[cfg(feature = "redis")]
            Backend::Redis(redis) => redis,
        }
    }
}

impl Store {
    /// An in-process store with the default configuration.
    pub fn memory() -> Store {
        Store::in_process(StoreBuilder::default().throttle_window)
    }

    fn in_process(throttle_window: Duration) -> Store {
        Store::from_backend(Backend::Memory(MemoryState::new(throttle_window, true)))
    }

    /// Configures a store.
    pub fn builder() -> StoreBuilder {
        StoreBuilder::default()
    }

    pub(super) fn from_backend(backend: Backend) -> Store {
        Store {
            backend: Arc::new(backend),
        }
    }

    /// `"memory"` or `"redis"`.
    pub fn backend_name(&self) -> &'static str {
        match &*self.backend {
            Backend::Memory(_) => "memory",
            #[cfg(feature = "redis")]
            Backend::Redis(_) => "redis",
        }
    }

    /// Whether the store is serving from in-process state because Redis is unreachable.
    /// Always `false` for the memory store. Also published as the gauge
    /// `claude_store_degraded`.
    pub fn is_degraded(&self) -> bool {
        match &*self.backend {
            Backend::Memory(_) => false,
            #[cfg(feature = "redis")]
            Backend::Redis(redis) => redis.is_degraded(),
        }
    }

    /// Records a throttle (a 429 attributed to `tenant`) and returns how many fall inside the
    /// throttle window, this one included.
    pub fn record_throttle(&self, tenant: &TenantId) -> StoreFuture<u32> {
        self.kinds().record_throttle(tenant)
    }

    /// Throttles of `tenant` inside the throttle window.
    pub fn throttle_count(&self, tenant: &TenantId) -> StoreFuture<u32> {
        self.kinds().throttle_count(tenant)
    }

    /// Adds input tokens to `tenant`'s total for the current UTC day.
    ///
    /// Off the request path: the Redis store adds them up locally and sends them in the
    /// background (every 250 ms by default, or on [`flush`](Store::flush)).
    pub fn add_tokens(&self, tenant: &TenantId, tokens: u64) {
        self.kinds().add_tokens(tenant, tokens);
    }

    /// Corrects `tenant`'s tokens for the current UTC day by `diff`: a settled call's real
    /// usage against what was counted for it when it was admitted (negative: it used less).
    /// The count never goes below 0. Batched off the request path as `add_tokens` is.
    pub fn correct_tokens(&self, tenant: &TenantId, diff: i64) {
        self.kinds().correct_tokens(tenant, diff);
    }

    /// `tenant`'s input tokens for the current UTC day, as far as they were flushed.
    pub fn tokens_today(&self, tenant: &TenantId) -> StoreFuture<u64> {
        self.kinds().tokens_today(tenant)
    }

    /// Sets (`Some`) or clears (`None`, back to the policy's default) `tenant`'s daily
    /// input-token budget.
    ///
    /// # Errors
    /// [`StoreUnavailable`] when Redis did not take the write; the budget then holds in this
    /// process only, until Redis returns.
    pub fn set_daily_budget(
        &self,
        tenant: &TenantId,
        tokens: Option<u64>,
    ) -> StoreFuture<Result<(), StoreUnavailable>> {
        self.kinds().set_daily_budget(tenant, tokens)
    }

    /// `tenant`'s own daily budget, if one was set.
    pub fn daily_budget(&self, tenant: &TenantId) -> StoreFuture<Option<u64>> {
        self.kinds().daily_budget(tenant)
    }

    /// Time left on `tenant`'s demotion, if it is demoted. Reads only; never demotes.
    pub fn demoted_for(&self, tenant: &TenantId) -> StoreFuture<Option<Duration>> {
        self.kinds().demoted_for(tenant)
    }

    /// Checks `tenant` against `policy` and demotes it if it crossed a threshold, atomically
    /// (one Lua script on Redis). The Redis store caches the answer for its cache TTL
    /// (default 1 s), so a busy tenant costs no round trip per request.
    pub fn check_demotion(
        &self,
        tenant: &TenantId,
        policy: &DemotionPolicy,
    ) -> StoreFuture<Demotion> {
        self.kinds().check_demotion(tenant, policy)
    }

    /// The tokens `tenant` has left of its daily budget (its own, else `policy`'s
    /// default) when the store can tell without a round trip; never a round trip.
    ///
    /// The memory store (and Redis while degraded) knows it exactly. A healthy Redis store
    /// tells what the last [`check_demotion`](Store::check_demotion) of the tenant by this
    /// worker read (the check classification makes for every call, answered from Redis
    /// at most once per cache TTL), less what this worker counted since: its own calls are
    /// in it, the other workers' only as of that check, so it may be one cache TTL stale.
    /// `None` when this worker has not checked the tenant in the last 5 minutes (or its
    /// demotion).
    ///
    /// ```
    /// use fairgate::{DemotionPolicy, Store, TenantId};
    ///
    /// let store = Store::memory();
    /// let tenant = TenantId::new("acme");
    /// store.add_tokens(&tenant, 1_200);
    /// let policy = DemotionPolicy::default(); // 100,000 tokens a day
    /// assert_eq!(store.budget_left(&tenant, &policy), Some(98_800));
    /// ```
    pub fn budget_left(&self, tenant: &TenantId, policy: &DemotionPolicy) -> Option<u64> {
        self.kinds().budget_left(tenant, policy)
    }

    /// Closes the cooldown gate of `upstream` (any name: a host, a model) for at least
    /// `delay` from now, for every worker on this store, and returns how long it stays closed.
    ///
    /// A gate only moves later: a longer delay extends it, a shorter one never shortens it.
    /// It closes for at most a day (a longer delay counts as a day), on every store. On Redis the gate lives in one hash (server time) and every worker's local copy is
    /// updated through pub/sub, so [`cooldown`](Store::cooldown) stays a local read.
    pub fn extend_cooldown(&self, upstream: &str, delay: Duration) -> StoreFuture<Duration> {
        self.kinds().extend_cooldown(upstream, delay)
    }

    /// How long `upstream`'s cooldown gate stays closed; `None` when it is open.
    ///
    /// Never a round trip: on Redis this reads the worker's copy, which pub/sub keeps
    /// current (and a resync on every reconnect).
    pub fn cooldown(&self, upstream: &str) -> Option<Duration> {
        self.kinds().cooldown(upstream)
    }

    /// Reserves a call's cells under the pacing `key` in every dimension of `limits` (GCRA:
    /// requests, input tokens, output tokens per minute) and returns how long the call must
    /// wait before it goes (zero: now). The reservation is made at once, so waiters go in
    /// the order they asked, each woken once.
    ///
    /// Shared by every worker on the store (one Lua script on Redis, server time). While
    /// Redis is down each worker paces alone against its share: every rate and burst
    /// divided by the workers last seen alive (at least 1), as TierSlotLimit divides its
    /// caps.
    pub fn pace(&self, key: &str, limits: &[PaceLimit]) -> StoreFuture<Duration> {
        self.kinds().pace(key, limits)
    }

    /// The per-minute limits the provider reported for the upstream `key` (learned by
    /// [`RetryAfterBackoff`](crate::RetryAfterBackoff) from `anthropic-ratelimit-*-limit`),
    /// as the store holds them: every worker on the store shares them, so a worker that
    /// starts later starts informed.
    pub fn learned_limits(&self, key: &str) -> StoreFuture<LearnedLimits> {
        self.kinds().learned_limits(key)
    }

    /// Learned pacing, in one operation on the upstream `key`'s bucket (one script on
    /// Redis, server time): learn and resynchronise from an answer's headers, charge
    /// corrections, and take the cells of the calls about to go (or be told to wait for a
    /// probe). See `pacing.rs`.
    pub(crate) fn pace_learned(&self, key: &str, ask: &PaceAsk) -> StoreFuture<PaceGrant> {
        self.kinds().pace_learned(key, ask)
    }

    /// Whether an operation may be a round trip (Redis), so callers batch (or, with
    /// [`StoreFuture::into_ready`], use only the answers that cost none).
    pub fn is_remote(&self) -> bool {
        !matches!(&*self.backend, Backend::Memory(_))
    }

    /// [`check_demotion`](Store::check_demotion) at `now`, then
    /// [`add_tokens`](Store::add_tokens): in one lock on the memory store.
    pub(crate) fn check_demotion_then_add_tokens(
        &self,
        tenant: &TenantId,
        policy: &DemotionPolicy,
        tokens: u64,
        now: Instant,
    ) -> StoreFuture<Demotion> {
        self.kinds()
            .check_demotion_then_add_tokens(tenant, policy, tokens, now)
    }

    /// Sends whatever is batched locally (token and served-cost counts) now. When it is
    /// ready, every count added before the call is in Redis or, if Redis refused it, kept
    /// for the next flush (a flush the background task had under way is waited for).
    /// Ready at once on the memory store, and while the store is degraded.
    pub fn flush(&self) -> StoreFuture<()> {
        match &*self.backend {
            Backend::Memory(_) => StoreFuture::ready(()),
            #[cfg(feature = "redis")]
            Backend::Redis(redis) => redis.flush(),
        }
    }
}

impl Store {
    /// Takes a slot for `tier` if the global and the tier counts are under `limits`; `None`
    /// when a cap is reached. One round trip on Redis (one script); while Redis is away, a
    /// slot from this worker's share of the caps: the caps divided by the workers it knows
    /// of (the last count seen alive, never fewer than `StoreBuilder::expected_workers`), or
    /// one slot at a time when it knows nothing, with every call it has in flight counted
    /// against that share, Redis leases and fallback slots alike. When Redis returns (or
    /// its leases vanish), the worker puts every call it still has in flight back before it
    /// takes a new slot.
    ///
    /// Names no tenant, so [`SlotLimits::tenant`] is not checked; see
    /// [`try_acquire_slot_for`](Self::try_acquire_slot_for).
    pub fn try_acquire_slot(
        &self,
        tier: &Tier,
        limits: SlotLimits,
    ) -> StoreFuture<Option<SlotLease>> {
        match self.try_acquire_slot_for(tier, None, limits).into_ready() {
            Ok(answer) => StoreFuture::ready(answer.ok()),
            Err(pending) => StoreFuture::pending(async move { pending.await.ok() }),
        }
    }

    /// As [`try_acquire_slot`](Self::try_acquire_slot), for a call of `tenant`: when
    /// `limits` caps tenants ([`SlotLimits::tenant`]), the tenant's own count is checked in
    /// the same step as the global and tier counts (on Redis, the same script, against a
    /// lease set of the tenant with the same expiries) and the slot counts for it too. A
    /// refusal says why: [`SlotRefusal::Full`] (the global or tier cap; checked first) or
    /// [`SlotRefusal::TenantCap`] (the tier has room, the tenant does not). While Redis is
    /// away, the tenant's cap is shared among the workers as the other caps are.
    ///
    /// With no tenant, or no tenant cap, nothing is counted per tenant: the acquire is the
    /// same as `try_acquire_slot`'s.
    pub fn try_acquire_slot_for(
        &self,
        tier: &Tier,
        tenant: Option<&TenantId>,
        limits: SlotLimits,
    ) -> StoreFuture<Result<SlotLease, SlotRefusal>> {
        self.kinds().acquire_slot(tier, tenant, limits, None)
    }

    /// Slots held now: all tiers (`None`) or one. On Redis, across every worker.
    pub fn slots_in_use(&self, tier: Option<&Tier>) -> StoreFuture<u32> {
        self.kinds().slots_in_use(tier)
    }

    /// Workers that said they were alive at the last heartbeat (this one included); 1 on the
    /// memory store.
    pub fn alive_workers(&self) -> u32 {
        self.kinds().alive_workers()
    }

    /// Corrects the fleet's input-token rate by what an answered call used beyond (or short
    /// of) the estimate it took (see `SlotLeases::correct_fleet_tokens`).
    pub(crate) fn correct_fleet_tokens(&self, diff: i64) {
        if diff != 0 {
            self.kinds().correct_fleet_tokens(diff);
        }
    }
}

/// What woke a worker's slot waiters (`SlotGate::take_wakes`).
#[derive(Debug)]
pub(crate) enum SlotWakes {
    /// Every waiter tries again.
    Everyone,
    /// One acquire per entry, for its flow.
    Flows(Vec<SlotWake>),
}

/// A release woke this worker for a slot of `tier`, for the next call of a flow: a tenant's
/// calls of one class, in the fleet's fair order (`None`: the worker's own order of the
/// tier, as TierSlotLimit alone queues).
#[derive(Debug)]
pub(crate) struct SlotWake {
    pub(crate) tier: Tier,
    pub(crate) flow: Option<(Priority, TenantId)>,
}

impl SlotWake {
    /// The wake of `tier` for the flow named `<class index>|<tenant>`.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn parse(tier: Tier, flow: &str) -> SlotWake {
        let flow = flow.split_once('|').and_then(|(class, tenant)| {
            let class = *Priority::ALL.get(class.parse::<usize>().ok()?)?;
            (!tenant.is_empty()).then(|| (class, TenantId::new(tenant)))
        });
        SlotWake { tier, flow }
    }
}

/// Redis did not take a write; it holds in this process only.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StoreUnavailable;

impl fmt::Display for StoreUnavailable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("shared store unavailable; the write holds in this process only")
    }
}

impl std::error::Error for StoreUnavailable {}
