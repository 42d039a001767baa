//! A pool of upstreams: more capacity than one key, and calls that go elsewhere while an
//! upstream fails.
//!
//! [`Pool`] is a tower service over several upstream services of one type (the Anthropic
//! API under different keys or workspaces, Claude on Bedrock — box them in tower's
//! `BoxCloneSyncService` to mix kinds). Each
//! call goes to one upstream, chosen when it is sent:
//!
//! - **Choosing**: among the upstreams that take calls, serve the call's [`Model`] and have
//!   room (below their `max_in_flight`), one set aside whose probe is due; else the one its
//!   tenant's last call went to while that one has room (its prompt cache is there); else,
//!   in the first `priority` with room, the one with the fewest calls in flight for its
//!   `weight`. Priority is a preference: under a fair queue's gate, a call held by the
//!   first priority's rate waits for it up to `spill_after` (default 1 s) before a later
//!   priority takes it; the tenant's own upstream is preferred within its priority only.
//! - **Setting aside** (a breaker per upstream): an upstream that cannot be reached
//!   (connection refused, no answer's head within `first_byte_timeout`) is set aside at
//!   once; one that answers `529`, `500`, `502`, `503` or `504` `trip_after` times in a row (default 3)
//!   too. Set aside, it takes no call until `probe_every` (default 1 s) has passed; then one
//!   call probes it, and an answer brings it back. A `429` is the upstream's rate, not a
//!   failure: it goes back to the caller (and to the retry layer above, which keeps that
//!   upstream's cooldown).
//! - **Sending again**: a call goes to another upstream only where the first provably did
//!   not run it — the connection was refused, or it answered `529` (overloaded: the API
//!   refuses before it runs a call; Bedrock's unavailable and not-ready answers are mapped
//!   to it) before anything of the answer went back — since a call run twice may be billed
//!   twice. A `500`, `502`, `503` or `504` may come after the call ran: it goes back to the
//!   caller as it is. Each upstream is tried at most once per call; a call is answered once.
//!   When no upstream has room, the call fails with [`NoUpstream`](error::NoUpstream),
//!   saying when the first set aside may be probed.
//!
//! - **Models**: `models` keeps an upstream to some models, read from a request's
//!   [`Model`] extension (the gateway sets it from the body's `model`).
//!
//! A call counts as in flight at its upstream until its response body ends (the count moves
//! into the body, as the limiting layers' permits do). [`Pool::upstreams`] reads, for each
//! upstream, its calls in flight, whether it is set aside, the calls it served, those moved
//! away (after a `529`, or its connection refused) and those spilled to it past an earlier
//! priority.
//!
//! **Under the fair queue**, give the stack the pool's [`gate`](Pool::gate)
//! ([`FairgateBuilder::pool`](crate::FairgateBuilder::pool)): the head of the fair order
//! then goes to an upstream that has room now — not set aside, below its cap, and its own
//! rate (learned limits, pacing, cooldown after a `429`, slow start, probe) lets it go —
//! and the pool sends it there, so the pool's rate is the sum of its upstreams' and the
//! order across tenants is one across the pool (see [`PoolGate`]). Each upstream's rate is
//! kept under the upstream key `{key}@{upstream}`, and a call held by one upstream's rate
//! goes at the next free cell of any. The gate goes down the pool's choice (a due probe,
//! the tenant's own upstream, then priority and load) and asks each upstream's rate in
//! turn; the first that lets the call go takes its cells, and the call's place at that
//! upstream is taken at once (so a pass of the fair queue never sends an upstream more than
//! its `max_in_flight`) and handed to the pool with the request.
//!
//! **Set aside for the fleet.** Under the gate, an upstream the breaker sets aside has its
//! rate's gate closed for the probe interval in the store's cooldown: on Redis every worker
//! passes over it at once (pub/sub), and after the interval one probe for the fleet brings
//! it back. A pool used without the gate keeps its breaker per worker.
//!
//! **Limits of the gate.** On Redis each upstream's rate is paced by its own gate through
//! the store, not handed out in the fleet's order with the slots as a single upstream's is
//! (the order across workers is each worker's). The gate does not know a call's model, so
//! an upstream given `models` may be chosen for a call it does not serve: the pool then
//! sends it to another with room, outside that one's rate. A call moved to another upstream
//! after a refusal or a `529` goes outside the second one's rate too, and closes the first
//! one's rate for a probe interval, as a `529` does a single upstream's (then one call
//! probes it).
//!
//! ```
//! use fairgate::pool::{Pool, Upstream};
//! use std::time::Duration;
//! use tower::{ServiceExt, service_fn};
//!
//! # #[tokio::main(flavor = "current_thread", start_paused = true)]
//! # async fn main() -> Result<(), fairgate::BoxError> {
//! // The first upstream refuses its connections; the call goes to the second.
//! let upstream = |answers: bool| {
//!     service_fn(move |_req: http::Request<String>| async move {
//!         if answers {
//!             Ok(http::Response::new("hello".to_owned()))
//!         } else {
//!             Err(std::io::Error::from(std::io::ErrorKind::ConnectionRefused))
//!         }
//!     })
//! };
//! let pool = Pool::builder()
//!     .upstream(Upstream::new("primary", upstream(false)))
//!     .upstream(Upstream::new("second", upstream(true)))
//!     .probe_every(Duration::from_secs(1))
//!     .build()?;
//! let response = pool.clone().oneshot(http::Request::new("{}".to_owned())).await?;
//! assert_eq!(response.into_body().inner(), "hello");
//! assert!(pool.upstreams()[0].set_aside);
//! # Ok(())
//! # }
//! ```
//!
//! # Cancel safety
//! Dropping the response future drops the call under way (its upstream's count goes back);
//! a dropped probe lets the next call probe. Dropping the response, or its body ending,
//! gives the upstream's in-flight count back; a response kept unread keeps it.

mod breaker;
mod choose;
pub mod error;
pub mod future;
pub(crate) mod gate;
mod service;

use crate::PoolGate;

use std::fmt;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use self::breaker::Breaker;
use crate::error::ConfigError;
use crate::hash::HashMap;
use crate::{TenantId, sync::lock};

/// The model a call asks for, as an extension of its request: an upstream given
/// [`models`](Upstream::models) takes only calls of those models (a call that names none
/// goes to any).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Model(pub String);

/// One upstream of a [`Pool`]: its name, its service and how calls are shared out to it.
#[derive(Clone, Debug)]
pub struct Upstream<S> {
    name: Arc<str>,
    service: S,
    weight: u32,
    priority: u32,
    models: Option<Vec<String>>,
    max_in_flight: Option<usize>,
}

impl<S> Upstream<S> {
    /// An upstream named `name` (in metrics and on the live page), called through
    /// `service`; weight 1, priority 0, every model, no cap of its own.
    pub fn new(name: impl Into<Arc<str>>, service: S) -> Self {
        Upstream {
            name: name.into(),
            service,
            weight: 1,
            priority: 0,
            models: None,
            max_in_flight: None,
        }
    }

    /// Its share of the calls among the upstreams of its priority (at least 1).
    pub fn weight(mut self, weight: u32) -> Self {
        self.weight = weight;
        self
    }

    /// Lower goes first: an upstream of a later priority takes calls only while none of
    /// an earlier one has room (prefer the primary, spill to the second).
    pub fn priority(mut self, priority: u32) -> Self {
        self.priority = priority;
        self
    }

    /// The models it serves (a call's [`Model`]); every model if never called.
    pub fn models<I: IntoIterator<Item = impl Into<String>>>(mut self, models: I) -> Self {
        self.models = Some(models.into_iter().map(Into::into).collect());
        self
    }

    /// Most calls in flight at once here (its key's concurrency, say).
    pub fn max_in_flight(mut self, max: usize) -> Self {
        self.max_in_flight = Some(max);
        self
    }
}

/// Builds a [`Pool`].
#[derive(Debug)]
pub struct PoolBuilder<S> {
    upstreams: Vec<Upstream<S>>,
    trip_after: u32,
    probe_every: Duration,
    first_byte_timeout: Option<Duration>,
    spill_after: Duration,
}

impl<S> PoolBuilder<S> {
    /// Adds an upstream.
    pub fn upstream(mut self, upstream: Upstream<S>) -> Self {
        self.upstreams.push(upstream);
        self
    }

    /// Failing answers (`529`, `500`, `502`-`504`) in a row that set an upstream aside
    /// (default 3).
    pub fn trip_after(mut self, n: u32) -> Self {
        self.trip_after = n;
        self
    }

    /// How long an upstream set aside waits for its probe (default 1 s).
    pub fn probe_every(mut self, every: Duration) -> Self {
        self.probe_every = every;
        self
    }

    /// Under a fair queue's gate, how long a call waits in the fair queue for the first
    /// priority with room before a later priority may take it (default 1 s). An upstream
    /// set aside, full or not serving the call's model has no room: the call goes past it
    /// at once; one whose rate holds the call keeps it this long.
    pub fn spill_after(mut self, wait: Duration) -> Self {
        self.spill_after = wait;
        self
    }

    /// How long a call waits for its answer's head before its upstream counts as
    /// unreachable (default: no limit). The call is not sent again (it may have run).
    pub fn first_byte_timeout(mut self, timeout: Duration) -> Self {
        self.first_byte_timeout = Some(timeout);
        self
    }

    /// The pool; refused with no upstream, two of one name, a weight or `trip_after` of 0,
    /// a `max_in_flight` of 0, or a `probe_every` of zero.
    pub fn build(self) -> Result<Pool<S>, ConfigError> {
        if self.upstreams.is_empty() {
            return Err(ConfigError::new("a pool needs at least one upstream"));
        }
        if self.upstreams.len() > 64 {
            return Err(ConfigError::new("a pool holds at most 64 upstreams"));
        }
        let mut names: Vec<&str> = self.upstreams.iter().map(|u| &*u.name).collect();
        names.sort_unstable();
        if names.windows(2).any(|w| w[0] == w[1]) {
            return Err(ConfigError::new("two upstreams of a pool have one name"));
        }
        if self.upstreams.iter().any(|u| u.weight == 0) {
            return Err(ConfigError::new("an upstream's weight must be at least 1"));
        }
        if self.upstreams.iter().any(|u| u.max_in_flight == Some(0)) {
            return Err(ConfigError::new(
                "an upstream's max_in_flight must be at least 1",
            ));
        }
        if self.trip_after == 0 || self.probe_every.is_zero() {
            return Err(ConfigError::new(
                "trip_after and probe_every must be more than zero",
            ));
        }
        if self.spill_after > Duration::from_secs(3_600) {
            return Err(ConfigError::new("spill_after must be at most an hour"));
        }
        let room = Arc::new(Room::default());
        let (services, members): (Vec<S>, Vec<_>) = self
            .upstreams
            .into_iter()
            .map(|upstream| {
                let member = MemberState {
                    name: upstream.name,
                    weight: upstream.weight,
                    priority: upstream.priority,
                    models: upstream.models,
                    max_in_flight: upstream.max_in_flight,
                    breaker: Mutex::new(Breaker::new(self.trip_after, self.probe_every)),
                    in_flight: AtomicUsize::new(0),
                    counts: Counts::default(),
                    room: room.clone(),
                };
                (upstream.service, Arc::new(member))
            })
            .unzip();
        Ok(Pool {
            services: services.into(),
            shared: Arc::new(Members {
                id: NEXT_POOL.fetch_add(1, Ordering::Relaxed),
                members,
                affinity: Mutex::new(HashMap::default()),
                first_byte_timeout: self.first_byte_timeout,
                spill_after: self.spill_after,
                room,
            }),
        })
    }
}

/// A pool of upstreams as one tower service (see the [module docs](self)).
///
/// # Clone
/// Cheap; clones share the upstreams' counts, breakers and the tenants' last upstreams.
pub struct Pool<S> {
    /// Each upstream's service, in the order of `shared.members`.
    services: Arc<[S]>,
    shared: Arc<Members>,
}

impl<S> Clone for Pool<S> {
    fn clone(&self) -> Self {
        Pool {
            services: self.services.clone(),
            shared: self.shared.clone(),
        }
    }
}

impl<S> fmt::Debug for Pool<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pool")
            .field("upstreams", &self.upstreams())
            .finish()
    }
}

/// An upstream of a pool as it stands now.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct UpstreamState {
    /// Its name.
    pub name: Arc<str>,
    /// Calls in flight there (until their bodies end).
    pub in_flight: usize,
    /// Set aside by its breaker (a probe may be out).
    pub set_aside: bool,
    /// Calls it answered (whatever the answer: it ran them, or may have).
    pub served: u64,
    /// Calls sent elsewhere after it refused or was overloaded ...
    pub moved_away: u64,
    /// ... of which after a `529` (the rest: its connection refused).
    pub moved_away_overloaded: u64,
    /// Calls it took past an earlier priority (the earlier ones full, set aside, or holding
    /// the call longer than [`spill_after`](PoolBuilder::spill_after)).
    pub spilled: u64,
    /// Under a fair queue's gate ([`Pool::gate`]): the limits learned from its answers,
    /// per minute (0: not learned, or no gate).
    pub limits: RateLimits,
    /// Under a fair queue's gate: how long its gate stays closed (after a `429`, or set
    /// aside), if it is.
    pub cooldown: Option<Duration>,
}

/// An upstream's limits as learned from its answers' `anthropic-ratelimit-*` headers, per
/// minute (0: not learned).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RateLimits {
    /// Requests a minute.
    pub requests: u32,
    /// Input tokens a minute.
    pub input_tokens: u32,
    /// Output tokens a minute.
    pub output_tokens: u32,
}

impl<S> Pool<S> {
    /// Builds a pool.
    pub fn builder() -> PoolBuilder<S> {
        PoolBuilder {
            upstreams: Vec::new(),
            trip_after: 3,
            probe_every: Duration::from_secs(1),
            first_byte_timeout: None,
            spill_after: Duration::from_secs(1),
        }
    }

    /// How long a call waits for the first priority with room (see
    /// [`PoolBuilder::spill_after`]).
    pub fn spill_after(&self) -> Duration {
        self.shared.spill_after
    }

    /// The pool as a fair queue's rate gate sees it: each upstream's room and rate, for
    /// [`FairgateBuilder::pool`](crate::FairgateBuilder::pool) or
    /// [`RateGate::across`](crate::RateGate::across).
    pub fn gate(&self) -> PoolGate {
        PoolGate {
            shared: self.shared.clone(),
        }
    }

    /// Each upstream now, in the order they were added.
    pub fn upstreams(&self) -> Vec<UpstreamState> {
        let gate = self.shared.room.gate();
        self.shared
            .members
            .iter()
            .enumerate()
            .map(|(i, m)| {
                let (limits, cooldown) = gate.as_ref().map_or(([0; 4], None), |g| g.rate_of(i));
                UpstreamState {
                    name: m.name.clone(),
                    in_flight: m.in_flight(),
                    set_aside: lock(&m.breaker).is_open(),
                    served: m.counts.served.load(Ordering::Relaxed),
                    moved_away: m.counts.moved_away.load(Ordering::Relaxed),
                    moved_away_overloaded: m.counts.overloaded.load(Ordering::Relaxed),
                    spilled: m.counts.spilled.load(Ordering::Relaxed),
                    limits: RateLimits {
                        requests: limits[0],
                        input_tokens: limits[1],
                        output_tokens: limits[2],
                    },
                    cooldown,
                }
            })
            .collect()
    }
}

/// What the clones of a pool (and its [`PoolGate`]) share: everything but the services.
struct Members {
    /// Tells a call routed by a gate which pool it was routed in.
    id: u64,
    members: Vec<Arc<MemberState>>,
    /// The upstream each tenant's last call went to: its prompt cache is there.
    affinity: Mutex<HashMap<TenantId, usize>>,
    first_byte_timeout: Option<Duration>,
    /// How long a call waits for the first priority with room (see `PoolBuilder`).
    spill_after: Duration,
    room: Arc<Room>,
}

/// The pools made so far: each has its own id.
static NEXT_POOL: AtomicU64 = AtomicU64::new(0);

/// Most tenants whose last upstream is kept; past it the book starts again.
const AFFINITY_MAX: usize = 100_000;

/// One upstream of a pool, but its service: how calls are shared out to it, and its state.
struct MemberState {
    name: Arc<str>,
    weight: u32,
    priority: u32,
    models: Option<Vec<String>>,
    max_in_flight: Option<usize>,
    breaker: Mutex<Breaker>,
    in_flight: AtomicUsize,
    counts: Counts,
    room: Arc<Room>,
}

/// What an upstream did with the calls sent to it (see [`UpstreamState`]).
#[derive(Default)]
struct Counts {
    served: AtomicU64,
    moved_away: AtomicU64,
    overloaded: AtomicU64,
    spilled: AtomicU64,
}

impl MemberState {
    /// Whether it serves calls of `model` (a call that names none: yes).
    fn serves(&self, model: Option<&str>) -> bool {
        model.is_none_or(|model| {
            self.models
                .as_ref()
                .is_none_or(|models| models.iter().any(|m| m == model))
        })
    }

    fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Relaxed)
    }
}

/// The rate gates made over the pool: told when an upstream may have room again (a call
/// ended), and when one is set aside.
#[derive(Default)]
struct Room {
    /// Held weakly: a gate dropped (a gateway's stack replaced on reload) is forgotten.
    gates: Mutex<Vec<std::sync::Weak<gate::PoolRate>>>,
    /// Whether any gate was made: a pool used alone takes no lock when a call ends.
    any: std::sync::atomic::AtomicBool,
}

impl Room {
    fn tell(&self, gate: &Arc<gate::PoolRate>) {
        let mut gates = lock(&self.gates);
        gates.retain(|g| g.strong_count() > 0);
        gates.push(Arc::downgrade(gate));
        self.any.store(true, Ordering::Release);
    }

    /// The rate gates over the pool still in use.
    fn gates(&self) -> Vec<Arc<gate::PoolRate>> {
        if !self.any.load(Ordering::Acquire) {
            return Vec::new();
        }
        lock(&self.gates)
            .iter()
            .filter_map(std::sync::Weak::upgrade)
            .collect()
    }

    /// The first rate gate made over the pool still in use, if any.
    fn gate(&self) -> Option<Arc<gate::PoolRate>> {
        lock(&self.gates).iter().find_map(std::sync::Weak::upgrade)
    }

    /// Upstream `member` was set aside for `probe_every`: each gate's rate closes it for the
    /// fleet (on Redis, every worker's), and one probe goes after.
    fn set_aside(&self, member: usize, probe_every: Duration) {
        for gate in self.gates() {
            gate.set_aside(member, probe_every);
        }
    }

    /// A call ended: the fair queues waiting for room look again.
    fn freed(&self) {
        for gate in self.gates() {
            gate.room_freed();
        }
    }
}

impl Members {
    fn remember(&self, tenant: &TenantId, member: usize) {
        let mut book = lock(&self.affinity);
        if book.get(tenant) != Some(&member) {
            if book.len() >= AFFINITY_MAX {
                book.clear();
            }
            book.insert(tenant.clone(), member);
        }
    }
}
