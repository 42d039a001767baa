//! The Redis backend: state shared by every worker, one Lua script per multi-key operation,
//! and an in-process fallback that answers whenever Redis cannot.
//!
//! Failing fast matters more here than anywhere: the connection is lazy (start-up never
//! blocks on Redis), does at most one quick reconnect attempt, and every call sits under an
//! outer timeout. After one failure the store is *degraded*: it stops calling Redis, answers
//! from [`MemoryState`], and a background task pings Redis until it answers.
//!
//! The same store runs on one node or on a Redis Cluster (`conn.rs`): the keys of each
//! script share a hash tag, so no script is ever `CROSSSLOT`. On a cluster the breaker is
//! still one for the store: a shard that is away (its master died, no replica promoted yet)
//! degrades the whole store, as one dead node does, until the probe gets through again.
//!
//! Redis *refusing* the store at start (a wrong password, a certificate not trusted) is an
//! error from the constructor, never a silent fallback; Redis *not there* at start (refused,
//! timed out) is a degraded start: the store answers from [`MemoryState`] and probes Redis
//! in the background, so no request fails because Redis is down.

use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use redis::{RedisError, RedisResult, Script};
use tokio::sync::Notify;
use tokio::time::Instant;

use super::keys::Keys;
use super::memory::MemoryState;
use super::{
    Backend, Demotion, OutagePolicy, RedisOptions, Store, StoreBuilder, StoreFuture,
    StoreUnavailable,
};
use crate::TenantId;
use crate::admission::DemotionPolicy;
use crate::error::ConfigError;
use crate::hash::HashMap;

mod budgets;
mod conn;
mod cooldown;
mod kinds;
#[cfg(test)]
mod order_differential;
#[cfg(test)]
mod order_model;
#[cfg(test)]
mod order_scheduler;
mod pacing;
#[cfg(test)]
mod pacing_differential;
mod pubsub;
mod served;
mod slot_state;
mod slots;
mod wakes;

use self::conn::{Conn, Refusal, Target};
use self::slot_state::SlotState;
use self::slots::SlotScripts;

/// Pending token counts past which a flush starts before its interval.
const FLUSH_AT_TENANTS: usize = 1024;

/// Why a Redis store could not be created. Redis being down is not one of them: the store
/// then starts degraded.
#[derive(Debug)]
#[non_exhaustive]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub enum RedisStoreError {
    /// A configuration value was refused.
    Config(ConfigError),
    /// The URL could not be parsed (or, for a cluster, the node URLs disagree).
    Url(RedisError),
    /// Redis refused the credentials: a wrong password or ACL user (`WRONGPASS`,
    /// `NOAUTH`), or a user not allowed to run the store's commands.
    Auth(RedisError),
    /// The TLS connection could not be set up: a certificate the client does not trust, a
    /// CA that does not parse, a server that does not speak TLS (or a `rediss://` one
    /// reached with `redis://`: that shows as Redis not answering).
    Tls(RedisError),
}

impl fmt::Display for RedisStoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RedisStoreError::Config(e) => fmt::Display::fmt(e, f),
            RedisStoreError::Url(e) => write!(f, "invalid redis url: {e}"),
            RedisStoreError::Auth(e) => write!(f, "redis refused the credentials: {e}"),
            RedisStoreError::Tls(e) => write!(f, "tls connection to redis failed: {e}"),
        }
    }
}

impl std::error::Error for RedisStoreError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            RedisStoreError::Config(e) => Some(e),
            RedisStoreError::Url(e) | RedisStoreError::Auth(e) | RedisStoreError::Tls(e) => Some(e),
        }
    }
}

impl From<ConfigError> for RedisStoreError {
    fn from(e: ConfigError) -> Self {
        RedisStoreError::Config(e)
    }
}

struct Scripts {
    record_throttle: Script,
    throttle_count: Script,
    add_tokens: Script,
    tokens_today: Script,
    check_demotion: Script,
}

impl Scripts {
    fn new() -> Self {
        Scripts {
            record_throttle: Script::new(include_str!("scripts/record_throttle.lua")),
            throttle_count: Script::new(include_str!("scripts/throttle_count.lua")),
            add_tokens: Script::new(include_str!("scripts/add_tokens.lua")),
            tokens_today: Script::new(include_str!("scripts/tokens_today.lua")),
            check_demotion: Script::new(include_str!("scripts/check_demotion.lua")),
        }
    }
}

/// A demotion check as this process last saw it.
#[derive(Clone, Copy, Debug)]
struct CachedDemotion {
    checked: Instant,
    until: Option<Instant>,
}

#[derive(Debug)]
struct DemotionCache {
    map: HashMap<TenantId, CachedDemotion>,
    last_sweep: Instant,
}

pub(crate) struct RedisStore {
    /// One node or a cluster; the scripts are called the same way on both.
    pub(super) conn: Conn,
    pub(super) keys: Keys,
    scripts: Scripts,
    slot_scripts: SlotScripts,
    slots: SlotState,
    /// Wake-ups for freed slots, one per slot (`redis/wakes.rs`).
    wakes: wakes::Wakes,
    pub(super) opts: RedisOptions,
    throttle_window_ms: u64,
    pub(super) fallback: MemoryState,
    /// How to reach Redis: for the one pub/sub connection (releases and cooldown moves).
    pub(super) target: Target,
    degraded: AtomicBool,
    /// Wakes the background task: a flush is due, or Redis just failed.
    pub(super) wake: Arc<Notify>,
    /// Bumped on each return from an outage: the pub/sub listeners subscribe again.
    recovered: tokio::sync::watch::Sender<u64>,
    pending_tokens: Batch,
    /// Held while the batches are sent, so a `flush` that finds them empty because the
    /// background task is sending them waits until those counts are in Redis.
    flushing: tokio::sync::Mutex<()>,
    cache: Mutex<DemotionCache>,
    /// What each tenant has left of its budget, as the last demotion check saw it
    /// (`redis/budgets.rs`).
    budgets: budgets::BudgetsSeen,
    /// Makes throttle members unique across workers.
    worker_id: String,
    seq: AtomicU64,
    /// Served cost (`redis/served.rs`).
    pub(super) served: served::ServedRedis,
}

/// Per-tenant counts batched off the request path until the background flush sends them.
#[derive(Default)]
pub(super) struct Batch(Mutex<HashMap<TenantId, i64>>);

/// Adds `n` to the tenant's pending count (negative: a correction down).
fn put(pending: &mut HashMap<TenantId, i64>, tenant: TenantId, n: i64) {
    let total = pending.entry(tenant).or_insert(0);
    *total = total.saturating_add(n);
}

pub(super) use crate::sync::lock;

/// A count as the signed batches hold it.
pub(super) fn clamp(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// An error that means "Redis is not there" rather than "Redis refused this call". On a
/// cluster that includes a shard that is away or moving: `CLUSTERDOWN`, `TRYAGAIN`,
/// `MASTERDOWN`, a redirect the client could not follow, no connection to the slot's node,
/// a write that reached a replica (`READONLY`) or a node still loading: each is a failover
/// under way, where the caps must be kept by the fallback, not by a call that went nowhere.
pub(super) fn is_outage(e: &RedisError) -> bool {
    use redis::{ErrorKind, ServerErrorKind};
    e.is_io_error()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_timeout()
        || e.is_unrecoverable_error()
        || e.is_cluster_error()
        || matches!(
            e.kind(),
            ErrorKind::ClusterConnectionNotFound
                | ErrorKind::Server(
                    ServerErrorKind::MasterDown
                        | ServerErrorKind::ReadOnly
                        | ServerErrorKind::BusyLoading
                )
        )
}

#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
impl StoreBuilder {
    /// Prefix of every Redis key (default `fairgate`; ASCII letters, digits, `_-.:`).
    pub fn key_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.redis.key_prefix = prefix.into();
        self
    }

    /// Outer timeout of every Redis call (default 150 ms). Past it the store degrades.
    pub fn op_timeout(mut self, timeout: Duration) -> Self {
        self.redis.op_timeout = timeout;
        self
    }

    /// How long a demotion check is reused before Redis is asked again (default 1 s).
    pub fn cache_ttl(mut self, ttl: Duration) -> Self {
        self.redis.cache_ttl = ttl;
        self
    }

    /// How often batched counts are sent (default 250 ms; the served cost, kept in
    /// one-second buckets, at most once a second).
    pub fn flush_interval(mut self, interval: Duration) -> Self {
        self.redis.flush_interval = interval;
        self
    }

    /// How often a degraded store pings Redis to come back (default 250 ms).
    pub fn probe_interval(mut self, interval: Duration) -> Self {
        self.redis.probe_interval = interval;
        self
    }

    /// How many worker processes share this Redis budget (default: unknown).
    ///
    /// While Redis is away each worker keeps to its share of the slot caps (and of the
    /// pacing limits): the caps divided by the workers it last saw alive, and never by fewer
    /// than `workers`. A worker that has never reached Redis knows only this number.
    /// Every call the worker has in flight counts against its share, those it holds as
    /// Redis leases too.
    ///
    /// With neither (never connected, no `expected_workers`), a worker assumes it may be one
    /// of many and takes **one slot at a time** globally and per tier until Redis answers:
    /// the caps hold for any fleet no larger than the smallest cap, and every request is
    /// still served, one by one. It keeps to that for a worker TTL (3 s) after Redis first
    /// answers, while the other workers put their calls back. (Pacing then divides by 1.)
    /// Set this to serve more while Redis is down at start. [`redis`](StoreBuilder::redis)
    /// refuses 0.
    pub fn expected_workers(mut self, workers: u32) -> Self {
        self.redis.expected_workers = Some(workers);
        self
    }

    /// What a worker does with new calls when Redis has been away longer than a lease TTL
    /// (default [`OutagePolicy::Share`]).
    ///
    /// When Redis goes away (a call fails or times out), a worker that had reached it keeps,
    /// for the life of the leases it held then, to exactly what it held, per tier and in
    /// all: a call of its own that ends frees a slot for its next call of that tier, in fair
    /// order. That is sound whether Redis died or only this worker is cut off from it: all
    /// the fleet's calls were within the caps at the fault, and Redis counts every lease
    /// until it expires. A call it cannot admit soundly (a tier it held nothing of, a worker
    /// that was idle) is refused at once with [`SlotRefusal::Store`](crate::store::SlotRefusal::Store), which the layers answer
    /// with [`Busy`](crate::Busy) whose reason is
    /// [`WaitReason::Store`](crate::WaitReason::Store).
    ///
    /// Past one lease TTL, `policy` decides: [`OutagePolicy::Share`] serves the caps
    /// divided by the workers last seen alive (the caps hold if Redis is down; a partition
    /// that cut off some workers can pass them by those workers' shares);
    /// [`OutagePolicy::Refuse`] refuses every new call until Redis answers (the caps hold
    /// under any fault; an outage longer than a lease TTL stops every worker).
    ///
    /// A worker that never reached Redis (down at start) serves its share as
    /// [`expected_workers`](StoreBuilder::expected_workers) says, and one that knows it is
    /// alone (one worker seen alive, none expected) the whole caps, whatever the policy.
    pub fn after_outage(mut self, policy: OutagePolicy) -> Self {
        self.redis.after_outage = policy;
        self
    }

    /// Trusts this CA (PEM, one or more certificates) for `rediss://` instead of the
    /// system's roots: for a managed Redis with a private CA, or a test's own certificate.
    /// Applies to [`redis`](StoreBuilder::redis) and
    /// [`redis_cluster`](StoreBuilder::redis_cluster); a `redis://` URL with a CA set is
    /// refused (a [`RedisStoreError::Tls`]).
    pub fn tls_ca_pem(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.redis.tls_ca_pem = Some(pem.into());
        self
    }

    /// Builds a store on the Redis at `url`: `redis://host:port/db`, with an ACL user and
    /// password `redis://user:pass@host:port/`, over TLS `rediss://...` (rustls; the
    /// system's roots, or [`tls_ca_pem`](StoreBuilder::tls_ca_pem)).
    ///
    /// Never waits for Redis longer than one operation timeout: if Redis does not answer,
    /// the store starts degraded and switches to Redis once it does.
    ///
    /// Must be called inside a tokio runtime (it starts a background task that flushes
    /// batched counts and probes Redis; the task ends when the last clone of the store is
    /// dropped).
    ///
    /// # Errors
    /// A URL that cannot be parsed or a configuration value out of range; Redis refusing
    /// the credentials ([`RedisStoreError::Auth`]) or the TLS handshake failing
    /// ([`RedisStoreError::Tls`]) at start. Redis not answering is not an error.
    pub async fn redis(self, url: &str) -> Result<Store, RedisStoreError> {
        let ca = self.redis.tls_ca_pem.as_deref();
        let target = Target::node(url, ca)?;
        self.build_redis(target).await
    }

    /// Builds a store on a Redis Cluster, given its nodes' URLs (`redis://` or `rediss://`,
    /// all with the same user and password; one reachable node is enough to find the
    /// others, listing several lets the store start while one is down).
    ///
    /// Every script runs on the master that owns its keys (they share a hash tag: the slot
    /// keys `{slots}` one shard, the cooldown and pacing keys `{g}` one, each tenant's keys
    /// `{t:<tenant>}` spread over all), with that node's clock. `MOVED` and `ASK` are
    /// followed, scripts are loaded again on a node that lost them, releases reach every
    /// worker through sharded pub/sub (`SSUBSCRIBE`, so **Redis 7 or later**; RESP3 on the
    /// pub/sub connection). When a shard is away (its master died and no replica is promoted
    /// yet), the store falls back as for a single node that died, and comes back, putting
    /// back every call it has in flight, once the shard answers again.
    ///
    /// Same start-up rules, options and errors as [`redis`](StoreBuilder::redis).
    ///
    /// # Errors
    /// As [`redis`](StoreBuilder::redis); also an empty list, or nodes whose URLs disagree
    /// (user, password, TLS).
    pub async fn redis_cluster<I>(self, nodes: I) -> Result<Store, RedisStoreError>
    where
        I: IntoIterator,
        I::Item: AsRef<str>,
    {
        let nodes: Vec<I::Item> = nodes.into_iter().collect();
        let ca = self.redis.tls_ca_pem.as_deref();
        let target = Target::cluster(&nodes, ca)?;
        self.build_redis(target).await
    }

    async fn build_redis(self, target: Target) -> Result<Store, RedisStoreError> {
        self.validate()?;
        let opts = self.redis.clone();
        for (name, value) in [
            ("op timeout", opts.op_timeout),
            ("cache ttl", opts.cache_ttl),
            ("flush interval", opts.flush_interval),
            ("probe interval", opts.probe_interval),
        ] {
            if value < Duration::from_millis(1) || value > Duration::from_secs(3600) {
                return Err(
                    ConfigError::new(format!("{name} must be between 1 ms and 1 h")).into(),
                );
            }
        }
        if opts.expected_workers == Some(0) {
            return Err(ConfigError::new("expected workers must be at least 1").into());
        }
        let keys = Keys::new(&opts.key_prefix)?;
        // One connection and a PING, within one operation timeout: a refusal (credentials,
        // TLS) is an error now; no answer is a degraded start.
        let reachable =
            match tokio::time::timeout(opts.op_timeout, target.check(opts.op_timeout)).await {
                Ok(Ok(())) => true,
                Ok(Err(e)) => match conn::refusal(&e) {
                    Some(Refusal::Auth) => return Err(RedisStoreError::Auth(e)),
                    Some(Refusal::Tls) => return Err(RedisStoreError::Tls(e)),
                    None => false,
                },
                Err(_) => false,
            };
        let conn = target
            .connect_lazy(opts.op_timeout)
            .map_err(RedisStoreError::Url)?;
        let now = Instant::now();
        let redis = Arc::new(RedisStore {
            conn,
            keys,
            scripts: Scripts::new(),
            slot_scripts: SlotScripts::new(),
            slots: SlotState::new(opts.expected_workers, opts.after_outage),
            wakes: wakes::Wakes::default(),
            throttle_window_ms: duration_ms(self.throttle_window),
            fallback: MemoryState::new(self.throttle_window, false),
            degraded: AtomicBool::new(false),
            wake: Arc::new(Notify::new()),
            recovered: tokio::sync::watch::Sender::new(0),
            pending_tokens: Batch::default(),
            flushing: tokio::sync::Mutex::new(()),
            cache: Mutex::new(DemotionCache {
                map: HashMap::default(),
                last_sweep: now,
            }),
            budgets: budgets::BudgetsSeen::new(),
            target,
            worker_id: worker_id(),
            seq: AtomicU64::new(0),
            served: served::ServedRedis::new(),
            opts,
        });
        crate::metrics::store_degraded(false);
        if reachable && redis.ping().await {
            redis.load_scripts().await;
            if !redis.resync(false, None).await {
                redis.mark_degraded("no answer at start-up");
            }
        } else {
            redis.mark_degraded("no answer at start-up");
        }
        tokio::spawn(background(Arc::downgrade(&redis), redis.wake.clone()));
        tokio::spawn(pubsub::listen(Arc::downgrade(&redis)));
        Ok(Store::from_backend(Backend::Redis(redis)))
    }
}

#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
impl Store {
    /// A store on the Redis at `url` with the default configuration; see
    /// [`StoreBuilder::redis`] for the options and what happens when Redis is down.
    ///
    /// # Errors
    /// A URL that cannot be parsed; Redis refusing the credentials or the TLS handshake.
    pub async fn redis(url: &str) -> Result<Store, RedisStoreError> {
        Store::builder().redis(url).await
    }

    /// A store on the Redis Cluster whose nodes' URLs are `nodes` (a `Vec<String>`, a
    /// slice of `&str`, ...), with the default configuration; see
    /// [`StoreBuilder::redis_cluster`].
    ///
    /// # Errors
    /// As [`StoreBuilder::redis_cluster`].
    pub async fn redis_cluster<I>(nodes: I) -> Result<Store, RedisStoreError>
    where
        I: IntoIterator,
        I::Item: AsRef<str>,
    {
        Store::builder().redis_cluster(nodes).await
    }
}

fn duration_ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}

/// A duration in whole microseconds, at least 1.
fn duration_us(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX).max(1)
}

/// A worker id unlikely to repeat across a fleet: 128 bits from the OS-seeded keys of std's
/// `RandomState` (in containers every worker may be pid 1), plus the pid for the reader.
fn worker_id() -> String {
    use std::hash::{BuildHasher, Hasher};
    let random = || {
        std::collections::hash_map::RandomState::new()
            .build_hasher()
            .finish()
    };
    format!("{}-{:016x}{:016x}", std::process::id(), random(), random())
}

/// Flushes batched counts while Redis is up; pings it while it is down. Holds the store only
/// while working, so it ends when the last `Store` is dropped.
async fn background(store: Weak<RedisStore>, wake: Arc<Notify>) {
    loop {
        let Some(redis) = store.upgrade() else { return };
        let pause = if redis.is_degraded() {
            if redis.ping().await {
                // A restarted Redis has lost its scripts; `Script` would reload each on its
                // first NOSCRIPT, but loading them all now keeps that off the request path.
                redis.load_scripts().await;
                // Every call made meanwhile goes back into the shared count, in a new epoch
                // all workers resync to, before this worker takes another slot from Redis
                // (and no fallback slot is taken while that is under way).
                redis.slots.recovering.store(true, Ordering::Release);
                let mut resynced = redis.resync(true, None).await;
                if !resynced {
                    // No answer is not "not done": the script may still run late (queued in
                    // the client or the server; seen on a cluster just after a failover),
                    // counting this worker in a new epoch with only the calls it had then.
                    // So take no fallback slot (`recovering`) until that window is over and
                    // a second resync, which puts every call back again, has answered or
                    // failed.
                    tokio::time::sleep(redis.opts.op_timeout).await;
                    resynced = redis.ping().await && redis.resync(true, None).await;
                }
                if resynced {
                    redis.recover();
                }
                redis.slots.recovering.store(false, Ordering::Release);
                redis.wake_everyone();
                if resynced {
                    redis.flush_pending(false).await;
                }
            }
            redis.opts.probe_interval
        } else {
            redis.flush_pending(false).await;
            redis.release_unreleased().await;
            redis.slot_heartbeat().await;
            // Tick often enough to renew the shortest lease held in time.
            let renew = redis.heartbeat_pause().unwrap_or(Duration::MAX);
            redis.opts.flush_interval.min(renew)
        };
        drop(redis);
        tokio::select! {
            _ = tokio::time::sleep(pause) => {}
            _ = wake.notified() => {}
        }
    }
}

impl RedisStore {
    pub(crate) fn is_degraded(&self) -> bool {
        self.degraded.load(Ordering::Acquire)
    }

    pub(super) fn mark_degraded(&self, reason: &str) {
        // From now on this worker keeps to its share, and for a lease TTL to what it holds.
        self.slots.freeze();
        if !self.degraded.swap(true, Ordering::AcqRel) {
            tracing::warn!(
                name: "queue.redis_unavailable",
                reason,
                "redis unreachable; fairgate serves from in-process state until it returns"
            );
            crate::metrics::store_degraded(true);
            self.wake.notify_one();
        }
    }

    fn recover(&self) {
        if self.degraded.swap(false, Ordering::AcqRel) {
            self.recovered.send_modify(|generation| *generation += 1);
            tracing::info!(name: "queue.redis_recovered", "redis answers again; fairgate state is shared again");
            crate::metrics::store_degraded(false);
        }
    }

    /// Whether Redis answers where the slots live: a keyed read, so on a cluster it goes to
    /// the master of the `{slots}` keys (a `PING` would pass on any live node while that
    /// shard is still away, and the store would keep trying to recover, taking no fallback
    /// slot meanwhile).
    async fn ping(&self) -> bool {
        let mut conn = self.conn.clone();
        let mut cmd = redis::cmd("EXISTS");
        cmd.arg(&self.keys.slots_epoch);
        let ping = cmd.query_async::<u32>(&mut conn);
        matches!(
            tokio::time::timeout(self.opts.op_timeout, ping).await,
            Ok(Ok(_))
        )
    }

    async fn load_scripts(&self) {
        let scripts = &self.scripts;
        let all = [
            &scripts.record_throttle,
            &scripts.throttle_count,
            &scripts.add_tokens,
            &scripts.tokens_today,
            &scripts.check_demotion,
        ];
        let shared = [&*cooldown::EXTEND, &*cooldown::READ, &*pacing::PACE];
        let loads = all
            .into_iter()
            .chain(self.slot_scripts.all())
            .chain(self.served.scripts())
            .chain(shared)
            .map(|script| {
                let mut conn = self.conn.clone();
                async move { script.load_async(&mut conn).await.map(drop) }
            });
        let all = async {
            futures_util::future::join_all(loads)
                .await
                .into_iter()
                .collect::<RedisResult<Vec<()>>>()
        };
        // Best effort: a failure here shows up again on the next call.
        let _ = self.guard(all).await;
    }

    /// Runs one Redis call under the outer timeout; `None` means "answer locally".
    pub(super) async fn guard<T>(&self, call: impl Future<Output = RedisResult<T>>) -> Option<T> {
        match tokio::time::timeout(self.opts.op_timeout, call).await {
            Ok(Ok(value)) => Some(value),
            Ok(Err(e)) if is_outage(&e) => {
                self.mark_degraded(&e.to_string());
                None
            }
            Ok(Err(e)) => {
                tracing::error!(name: "store.redis_error", error = %e, "redis refused a fairgate call; answering from local state");
                None
            }
            Err(_) => {
                self.mark_degraded("timed out");
                None
            }
        }
    }

    /// The shape of every operation: no round trip while degraded, one otherwise, and the
    /// fallback's answer when that round trip fails.
    pub(super) fn op<T, Fut>(
        self: &Arc<Self>,
        fallback: impl FnOnce(&MemoryState) -> T + Send + 'static,
        call: impl FnOnce(Arc<Self>) -> Fut + Send + 'static,
    ) -> StoreFuture<T>
    where
        T: Send + 'static,
        Fut: Future<Output = RedisResult<T>> + Send,
    {
        if self.is_degraded() {
            return StoreFuture::ready(fallback(&self.fallback));
        }
        let this = self.clone();
        StoreFuture::pending(async move {
            match this.guard(call(this.clone())).await {
                Some(value) => value,
                None => fallback(&this.fallback),
            }
        })
    }

    pub(crate) fn record_throttle(self: &Arc<Self>, tenant: &TenantId) -> StoreFuture<u32> {
        let key = self.keys.tenant(tenant, "throttles");
        let member = format!(
            "{}:{}",
            self.worker_id,
            self.seq.fetch_add(1, Ordering::Relaxed)
        );
        let tenant = tenant.clone();
        self.op(
            move |local| local.record_throttle(&tenant),
            move |this| async move {
                let mut conn = this.conn.clone();
                this.scripts
                    .record_throttle
                    .key(key)
                    .arg(this.throttle_window_ms)
                    .arg(member)
                    .invoke_async(&mut conn)
                    .await
            },
        )
    }

    pub(crate) fn throttle_count(self: &Arc<Self>, tenant: &TenantId) -> StoreFuture<u32> {
        let key = self.keys.tenant(tenant, "throttles");
        let tenant = tenant.clone();
        self.op(
            move |local| local.throttle_count(&tenant),
            move |this| async move {
                let mut conn = this.conn.clone();
                this.scripts
                    .throttle_count
                    .key(key)
                    .arg(this.throttle_window_ms)
                    .invoke_async(&mut conn)
                    .await
            },
        )
    }

    pub(crate) fn add_tokens(&self, tenant: &TenantId, tokens: u64) {
        if self.is_degraded() {
            self.fallback.add_tokens(tenant, tokens);
        }
        self.count_tokens(tenant, clamp(tokens));
    }

    /// Corrects `tenant`'s tokens today by `diff` (never below 0), batched as
    /// [`add_tokens`](Self::add_tokens) is.
    pub(crate) fn correct_tokens(&self, tenant: &TenantId, diff: i64) {
        if self.is_degraded() {
            self.fallback.correct_tokens(tenant, diff);
        }
        self.count_tokens(tenant, diff);
    }

    /// Batches a token count, and counts it in the budget seen. Under the batch's lock: a
    /// demotion check's answer reads the batch and sets the budget seen under it too, so a
    /// count is in one or the other, never in both.
    fn count_tokens(&self, tenant: &TenantId, n: i64) {
        let mut pending = lock(&self.pending_tokens.0);
        put(&mut pending, tenant.clone(), n);
        self.budgets.count(tenant, n);
        if pending.len() >= FLUSH_AT_TENANTS {
            self.wake.notify_one();
        }
    }

    /// Adds to a batch of per-tenant counts, waking the flush early when many tenants wait.
    pub(super) fn batch_add(&self, batch: &Batch, tenant: &TenantId, n: i64) {
        let mut pending = lock(&batch.0);
        put(&mut pending, tenant.clone(), n);
        if pending.len() >= FLUSH_AT_TENANTS {
            self.wake.notify_one();
        }
    }

    /// Sends every batch of counts (the served cost at its own pace, unless `now`).
    async fn flush_pending(&self, now: bool) {
        let _one_at_a_time = self.flushing.lock().await;
        self.flush_batch(
            &self.pending_tokens,
            "tokens",
            &self.scripts.add_tokens,
            &[],
        )
        .await;
        self.flush_served(now).await;
    }

    /// Sends one batch: one script call per tenant (`KEYS[1]` = the tenant's `part` key,
    /// `ARGV` = its count, then `args`), pipelined over the multiplexed connection. Counts
    /// Redis refused are kept for the next flush.
    pub(super) async fn flush_batch(
        &self,
        batch: &Batch,
        part: &str,
        script: &Script,
        args: &[u64],
    ) {
        let sending = std::mem::take(&mut *lock(&batch.0));
        self.send_batch(batch, sending, part, script, args).await;
    }

    /// Sends counts taken from `batch` as [`flush_batch`](Self::flush_batch) does, putting
    /// back those Redis refused.
    pub(super) async fn send_batch(
        &self,
        batch: &Batch,
        sending: HashMap<TenantId, i64>,
        part: &str,
        script: &Script,
        args: &[u64],
    ) {
        if sending.is_empty() {
            return;
        }
        let calls = sending.iter().map(|(tenant, &n)| {
            let mut conn = self.conn.clone();
            let mut call = script.prepare_invoke();
            call.key(self.keys.tenant(tenant, part)).arg(n).arg(args);
            async move { call.invoke_async::<i64>(&mut conn).await.err() }
        });
        // Background work gets more time than a request's call, and a slow flush does not
        // by itself mean Redis is gone (connection errors below do).
        let patience = self
            .opts
            .op_timeout
            .saturating_mul(10)
            .max(Duration::from_secs(1));
        let errors =
            match tokio::time::timeout(patience, futures_util::future::join_all(calls)).await {
                Ok(errors) => errors,
                Err(_) => {
                    // Whether Redis applied them is unknown: keep them. A count sent twice is a
                    // smaller error than a flush lost.
                    let mut pending = lock(&batch.0);
                    for (tenant, n) in sending {
                        put(&mut pending, tenant, n);
                    }
                    return;
                }
            };
        let mut pending = lock(&batch.0);
        for ((tenant, n), error) in sending.into_iter().zip(errors) {
            if let Some(e) = error {
                if is_outage(&e) {
                    self.mark_degraded(&e.to_string());
                }
                put(&mut pending, tenant, n);
            }
        }
    }

    pub(crate) fn flush(self: &Arc<Self>) -> StoreFuture<()> {
        if self.is_degraded() {
            return StoreFuture::ready(());
        }
        let this = self.clone();
        StoreFuture::pending(async move { this.flush_pending(true).await })
    }

    pub(crate) fn tokens_today(self: &Arc<Self>, tenant: &TenantId) -> StoreFuture<u64> {
        let key = self.keys.tenant(tenant, "tokens");
        let tenant = tenant.clone();
        self.op(
            move |local| local.tokens_today(&tenant),
            move |this| async move {
                let mut conn = this.conn.clone();
                this.scripts
                    .tokens_today
                    .key(key)
                    .invoke_async(&mut conn)
                    .await
            },
        )
    }

    pub(crate) fn set_daily_budget(
        self: &Arc<Self>,
        tenant: &TenantId,
        tokens: Option<u64>,
    ) -> StoreFuture<Result<(), StoreUnavailable>> {
        // Held locally too, so it also applies while degraded.
        self.fallback.set_daily_budget(tenant, tokens);
        let key = self.keys.tenant(tenant, "budget");
        self.op(
            |_| Err(StoreUnavailable),
            move |this| async move {
                let mut conn = this.conn.clone();
                let cmd = match tokens {
                    Some(tokens) => {
                        let mut cmd = redis::cmd("SET");
                        cmd.arg(key).arg(tokens);
                        cmd
                    }
                    None => {
                        let mut cmd = redis::cmd("DEL");
                        cmd.arg(key);
                        cmd
                    }
                };
                cmd.query_async::<()>(&mut conn).await.map(Ok)
            },
        )
    }

    pub(crate) fn daily_budget(self: &Arc<Self>, tenant: &TenantId) -> StoreFuture<Option<u64>> {
        let key = self.keys.tenant(tenant, "budget");
        let tenant = tenant.clone();
        self.op(
            move |local| local.daily_budget(&tenant),
            move |this| async move {
                let mut conn = this.conn.clone();
                redis::cmd("GET").arg(key).query_async(&mut conn).await
            },
        )
    }

    pub(crate) fn demoted_for(
        self: &Arc<Self>,
        tenant: &TenantId,
    ) -> StoreFuture<Option<Duration>> {
        let key = self.keys.tenant(tenant, "demoted");
        let tenant = tenant.clone();
        self.op(
            move |local| local.demoted_for(&tenant),
            move |this| async move {
                let mut conn = this.conn.clone();
                let left: i64 = redis::cmd("PTTL").arg(key).query_async(&mut conn).await?;
                Ok(u64::try_from(left)
                    .ok()
                    .filter(|&ms| ms > 0)
                    .map(Duration::from_millis))
            },
        )
    }

    pub(crate) fn check_demotion(
        self: &Arc<Self>,
        tenant: &TenantId,
        policy: &DemotionPolicy,
    ) -> StoreFuture<Demotion> {
        let now = Instant::now();
        let cached = lock(&self.cache).map.get(tenant).copied();
        if let Some(cached) = cached {
            let fresh = now.saturating_duration_since(cached.checked) < self.opts.cache_ttl;
            let running = cached.until.filter(|&until| until > now);
            if let Some(until) = running {
                // A demotion never ends early, so a known one needs no round trip at all.
                return StoreFuture::ready(Demotion::Demoted {
                    left: until.saturating_duration_since(now),
                    newly: false,
                });
            }
            if fresh {
                return StoreFuture::ready(Demotion::NotDemoted);
            }
        }
        let keys = [
            self.keys.tenant(tenant, "throttles"),
            self.keys.tenant(tenant, "tokens"),
            self.keys.tenant(tenant, "budget"),
            self.keys.tenant(tenant, "demoted"),
        ];
        let args = [
            self.throttle_window_ms,
            u64::from(policy.throttle_limit()),
            policy.budget_permille(),
            policy.default_daily_budget(),
            duration_ms(policy.demote_for()),
        ];
        let fallback_tenant = tenant.clone();
        let fallback_policy = policy.clone();
        let tenant = tenant.clone();
        self.op(
            move |local| local.check_demotion(&fallback_tenant, &fallback_policy),
            move |this| async move {
                let mut conn = this.conn.clone();
                let (left_ms, newly, tokens, budget, day_left): (u64, u8, u64, u64, u64) = this
                    .scripts
                    .check_demotion
                    .key(&keys[..])
                    .arg(&args[..])
                    .invoke_async(&mut conn)
                    .await?;
                {
                    // Redis's count lacks what this worker has not sent yet (this call's
                    // charge, as a rule: it is counted before the check is polled). A
                    // flush under way is in neither: seen short until the next check.
                    let pending = lock(&this.pending_tokens.0);
                    let unsent = pending.get(&tenant).copied().unwrap_or(0);
                    let read = budgets::BudgetRead {
                        used: tokens.saturating_add_signed(unsent),
                        budget: budgets::from_lua(budget),
                        day_left: Duration::from_secs(day_left),
                        demoted_for: Duration::from_millis(left_ms),
                    };
                    this.budgets.seen(&tenant, read, Instant::now());
                }
                let demotion = if left_ms > 0 {
                    Demotion::Demoted {
                        left: Duration::from_millis(left_ms),
                        newly: newly == 1,
                    }
                } else {
                    Demotion::NotDemoted
                };
                this.remember(tenant, demotion);
                Ok(demotion)
            },
        )
    }

    /// The tokens `tenant` has left of its daily budget, without a round trip: what Redis
    /// held at this worker's last demotion check of the tenant, less what this worker
    /// counted since; `None` when it has not checked the tenant lately. The counts of the
    /// other workers since that check are not in it.
    pub(crate) fn budget_left(&self, tenant: &TenantId, policy: &DemotionPolicy) -> Option<u64> {
        if self.is_degraded() {
            return Some(self.fallback.budget_left(tenant, policy));
        }
        self.budgets.left(tenant)
    }

    /// Caches a check, and now and then drops stale entries and publishes how many tenants
    /// this worker knows to be demoted.
    fn remember(&self, tenant: TenantId, demotion: Demotion) {
        let now = Instant::now();
        let until = match demotion {
            Demotion::Demoted { left, .. } => Some(crate::time::after(now, left)),
            Demotion::NotDemoted => None,
        };
        let mut cache = lock(&self.cache);
        cache.map.insert(
            tenant,
            CachedDemotion {
                checked: now,
                until,
            },
        );
        if now.saturating_duration_since(cache.last_sweep) >= self.opts.cache_ttl {
            let ttl = self.opts.cache_ttl;
            cache.map.retain(|_, c| {
                now.saturating_duration_since(c.checked) < ttl || c.until.is_some_and(|u| u > now)
            });
            let demoted = cache
                .map
                .values()
                .filter(|c| c.until.is_some_and(|u| u > now))
                .count();
            cache.last_sweep = now;
            crate::metrics::demoted_tenants(demoted);
        }
    }
}
