//! The shared state handle every layer takes.
//!
//! One [`Store`] is created per process and cloned into each layer; clones share everything.
//! Two backends sit behind the same operations:
//!
//! - **memory** ([`Store::memory`]): all state in this process. The default, for one worker,
//!   for tests and for the simulator.
//! - **redis** (`Store::redis(url).await`, feature `redis`; `Store::redis_cluster` for a
//!   Redis Cluster): state shared by every worker on one Redis. When Redis is unreachable
//!   the store degrades to in-process state at once and returns to Redis by itself; slots
//!   then follow [`StoreBuilder::after_outage`].
//!
//! [`Store::builder`] sets the throttle window, the key prefix, the operation timeout
//! (150 ms), the cache TTL, and the flush and probe intervals. On Redis:
//!
//! - every multi-key operation is one Lua script (`EVALSHA`, reloaded after a Redis
//!   restart), using the server's clock, never a worker's;
//! - keys are `prefix:{t:<tenant>}:<part>` with the tenant name percent-escaped, so a name
//!   with `{`, `}`, `:`, `*`, spaces or newlines cannot break a key or collide with another,
//!   and the keys one script touches share a Redis Cluster slot;
//! - the slot keys, the fleet's wait queue (one flow per tenant and priority in a tier, with
//!   the workers holding its calls) and the fairness window live under the `{slots}` and
//!   `{g}` tags; what the wait queue keeps of a tenant goes when its calls stop waiting;
//! - `StoreBuilder::expected_workers(n)` tells a worker how large its fleet is before it
//!   has ever reached Redis;
//! - a call that fails or times out marks the store degraded: it serves from in-process
//!   state with no further Redis calls, logs `queue.redis_unavailable` once, sets the gauge
//!   `claude_store_degraded`, pings Redis in the background every 250 ms, and returns to it
//!   when it answers. Creating the store waits one timeout at most for a Redis that does
//!   not answer (then starts degraded); one that answers is also sent the scripts, under a
//!   timeout of their own;
//! - `rediss://` goes through rustls (ring; no OpenSSL, no aws-lc), with the system's roots
//!   or `StoreBuilder::tls_ca_pem`, and `redis://user:password@host` logs in with an ACL
//!   user. A wrong password or an untrusted certificate is an error from `Store::redis*`
//!   (`RedisStoreError::Auth`, `RedisStoreError::Tls`); Redis not up yet is still a degraded
//!   start;
//! - each store holds one command connection and one pub/sub connection.
//!
//! The operations are those the layers need — throttles, daily tokens, budgets and demotion
//! (PriorityClassify); served cost (DrrFairness); slot leases (TierSlotLimit); cooldown gates
//! and pacing (RetryAfterBackoff) — and are public so an application can read or feed the
//! same state (set a tenant's budget, record a 429 it handled itself, show who is demoted). They return a [`StoreFuture`], which is ready at once when no round trip is
//! needed (memory, a fresh cache entry, a degraded Redis store).
//!
//! ```
//! use fairgate::{Store, TenantId};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let store = Store::memory();
//! let tenant = TenantId::new("acme");
//! store.record_throttle(&tenant).await;
//! assert_eq!(store.throttle_count(&tenant).await, 1);
//! store.add_tokens(&tenant, 1_200);
//! assert_eq!(store.tokens_today(&tenant).await, 1_200);
//! # }
//! ```

mod cooldown;
pub(crate) mod handle;
#[cfg(feature = "redis")]
mod keys;
mod kinds;
mod memory;
mod pacing;
#[cfg(feature = "redis")]
mod redis;
mod served;
mod slots;
pub(crate) mod swept;

pub(crate) use self::kinds::SlotLeases;
pub(crate) use self::pacing::{
    DIMS, INPUT, MAX_LIMIT, OUTPUT, PaceAsk, PaceGrant, REQUESTS, TOTAL, learned_rate,
};
pub use self::pacing::{LearnedLimits, PaceLimit};
#[cfg(feature = "redis")]
pub use self::redis::RedisStoreError;
pub use self::served::{SERVED_WINDOW, TOP_SERVED_MAX, TopServed};
pub(crate) use self::slots::{FleetCells, SlotQueue, flow_name};
pub use self::slots::{SlotLease, SlotLimits, SlotRefusal};
// The handle and what its operations return are public at the crate root only.
pub(crate) use self::handle::*;

/// One worker's share of a limit that `workers` processes keep alone while Redis is away:
/// divided among them, at least 1.
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
fn per_worker(limit: u32, workers: u32) -> u32 {
    (limit / workers.max(1)).max(1)
}
