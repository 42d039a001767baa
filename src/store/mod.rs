//! The shared state handle every layer takes.
//!
//! One [`Store`] is created per process and cloned into each layer; clones share everything.
//! Two backends sit behind the same operations:
//!
//! - **memory** ([`Store::memory`]): all state in this process. The default, for one worker,
//!   for tests and for the simulator.
//! - **redis** (`Store::redis`, feature `redis`): state shared by every worker on one Redis.
//!   Every multi-key operation is one Lua script using the server's clock. When Redis is
//!   unreachable the store degrades to in-process state at once, logs
//!   `queue.redis_unavailable` once per outage, and returns to Redis by itself; slots then
//!   follow [`StoreBuilder::after_outage`].
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
