//! Global and per-tier caps on calls in flight, across every worker.
//!
//! [`TierSlotLimit`] holds each call to a *slot* for as long as it runs: at most
//! `global_max` calls at once across all tiers, and at most each tier's cap for that tier.
//! A tier's cap below the global one is how paying tiers keep room under a free-tier flood:
//! with the defaults (global 30; `premium` 30, `pro` 20, `free` 15, `guest` 5), 500 guests
//! hold at most 5 slots and 25 stay usable by everyone else. Unknown tiers count as `guest`
//! (logged once as `tier.unknown`).
//!
//! When no slot is free, a request waits — free tiers briefly, paid ones longer (`free` 12 s,
//! `guest` 8 s, `pro` 45 s, `premium` 60 s) — and then fails fast with
//! [`Busy { tier, waited, retry_after }`](Busy) (retry after 5 s by default) instead of
//! holding its caller forever. With feature `axum`, `Busy` is a response: `503`, a
//! `Retry-After` header and the body `{"code":"SERVER_BUSY","retry_after":5}`. Waiting past
//! 3 s logs `queue.slow_wait` (at most one line per tier per 10 s: the first slow wait of a
//! window, with how many more the window before it folded and the longest of them), and the
//! waiter keeps its place in its tier's line through the warning. Optional early rejection (`SlotPolicyBuilder::early_reject`) fails at once when
//! the expected wait already exceeds the max.
//!
//! Waiters of a tier get slots in arrival order (under the fair queue, in its order). In
//! process (the memory store) a release wakes them at once. On Redis a refused call queues
//! its worker in the call's flow (its tenant and priority in the tier; this layer alone
//! queues one flow per tier) in the same acquire script, and each release wakes **one**
//! queued worker of the whole fleet, on that worker's own pub/sub channel, in the fleet's
//! fair order (priority, tier, tenant: see [`drr_fairness`](crate::drr_fairness)), within a
//! flow the worker queued longest, which goes to the back while more of its calls wait (it
//! queues with their number). The slot is promised to it for a second, so nobody else takes
//! it meanwhile; a worker with no call of that flow left to send, or whose call waits for
//! the provider's rate, passes it on at once (after 50 ms if nothing answers). So the Redis
//! work per request stays at about one acquire and one release however many workers wait
//! (`BENCHMARKS.md`, "Redis commands per request under contention"). A jittered poll
//! (100 ms in process, 1 s on Redis) is the safety net. A worker that has not said it is
//! alive for 1.5 s (crashed, or cut off from Redis) is not woken, and its entries in the
//! wait queues are dropped within a worker TTL and a heartbeat.
//!
//! On the Redis store a slot is a *lease*, not a counter: a member of a sorted set scored by
//! its expiry, taken by one Lua script that drops expired leases and checks both caps, and
//! renewed by a heartbeat while its call runs. A crashed worker's slots therefore come back
//! within one lease TTL (30 s), however busy the others are, and a streamed answer keeps
//! its slot.
//!
//! # While Redis is unreachable
//! - **For one lease TTL** a worker keeps to *exactly the slots it held* when Redis went
//!   away, per tier and in all (and per tenant, with a tenant cap), at full speed: a call of
//!   its own that ends frees its slot for its next call of that tier, in fair order. That
//!   is sound whether Redis died or only this worker is cut off from it: all the fleet's
//!   calls were within the caps at the fault, and Redis counts every lease until it expires
//!   (a lease is reused only while a call of the worker's usual length would end before it
//!   expires).
//! - **A call it cannot admit soundly** (a tier it held nothing of; any call at a worker
//!   that was idle) is answered *at once* with [`Busy`] whose reason is
//!   [`WaitReason::Store`](crate::WaitReason::Store) (the store answers
//!   `SlotRefusal::Store`; the gateway answers `529` with `retry-after`, so the client's
//!   retry reaches another worker), never after its tier's max wait.
//! - **Past one lease TTL** a worker cannot tell a dead Redis from a partition that cut off
//!   only itself, and the others may have been given its expired leases: the store's
//!   [`OutagePolicy`](crate::OutagePolicy) (`StoreBuilder::after_outage`) decides.
//!   `OutagePolicy::Share` (the default) serves the caps divided by the workers last seen
//!   alive: a dead Redis costs nothing more and the caps hold; a partition runs over them by
//!   at most the cut-off workers' shares. `OutagePolicy::Refuse` answers every call `Busy`
//!   (reason `store`) until Redis is back: the caps hold under any fault, and an outage
//!   longer than a lease TTL stops every worker. The default is `Share` because a dead,
//!   restarting or failing-over Redis is the common fault and a partition of one worker the
//!   rare one, and because refusing everything would turn a Redis outage of a minute into a
//!   gateway outage; choose `Refuse` when the caps are a hard contract.
//! - A worker that never reached Redis (down at start) keeps to its share of the fleet it
//!   was told about (`StoreBuilder::expected_workers`) whatever the policy. Crash recovery
//!   is unchanged: a killed worker's slots come back within one lease TTL.
//!
//! Below a [`DrrFairness`](crate::DrrFairness) handed this layer's
//! [`gate`](crate::TierSlotLimitLayer::gate), the fair queue takes each request's slot when it
//! dispatches it (in fair order, and the wait counts from the request's arrival), and this
//! layer lets such a request through without taking a second one. Alone, or under a fair
//! queue that was not handed its gate, it takes and waits for the slots itself.
//!
//! For an `http::Response<B>` the slot moves into the body and is given back when the body
//! ends, fails or is dropped: a streamed answer keeps its slot until its last byte.
//!
//! Metrics: `claude_slots_in_use{tier}`, `claude_slot_wait_seconds{tier}`,
//! `claude_server_busy_total{tier,reason}` (`reason`: `slot`, `rate`, `cooldown`, `store`)
//! and `claude_slots_fallback_total{tier}`.
//!
//! # Per-tenant caps
//! A tier can also cap the calls one tenant holds at once, across every worker, so a
//! tenant sending to every worker cannot take its whole tier (LiteLLM's per-key
//! `max_parallel_requests`, fleet-wide). Off by default; per tier:
//!
//! ```
//! use fairgate::SlotPolicy;
//! use std::time::Duration;
//!
//! # fn main() -> Result<(), fairgate::BoxError> {
//! let policy = SlotPolicy::builder()
//!     .tier("pro", 20, Duration::from_secs(45))
//!     .tenant_cap("pro", 4) // no pro tenant holds more than 4 of the 20
//!     .build()?;
//! # let _ = policy;
//! # Ok(())
//! # }
//! ```
//!
//! - The tenant's count is checked in the same step as the global and tier caps: on Redis
//!   in the same acquire script, against a lease set of the tenant (under the `{slots}` hash
//!   tag, the tenant name escaped into the key) with the same expiries, renewals and
//!   resyncs as the tier's, so a crashed worker's tenant leases come back within one lease
//!   TTL too. While Redis is away each worker keeps to its share of the tenant cap as of
//!   the other caps.
//! - Over its cap a tenant's request waits — apart, without holding up the other tenants
//!   of its tier — and fails with `Busy` at its tier's max wait, as for a full tier. Under a
//!   fair queue the slot is taken for the tenant whose turn it is, passing over a tenant at
//!   its cap until one of its calls (or any call) ends.
//! - `0` is a configuration error; a cap at or above the tier's cap is no cap. With no cap
//!   nothing is counted per tenant. The store says why an acquire was refused
//!   ([`Store::try_acquire_slot_for`](crate::Store::try_acquire_slot_for) answers
//!   `SlotRefusal::Full` or `SlotRefusal::TenantCap`). Tenant caps on Redis are not woken
//!   one by one: their waiters poll every 100 ms.
//!
//! ```
//! use fairgate::{Busy, Job, Origin, SlotPolicy, Store, TierSlotLimitLayer};
//! use std::time::Duration;
//! use tower::{ServiceBuilder, ServiceExt, service_fn};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), fairgate::BoxError> {
//! let policy = SlotPolicy::builder()
//!     .global_max(10)
//!     .tier("free", 2, Duration::ZERO) // free users never wait
//!     .build()?;
//! let claude = ServiceBuilder::new()
//!     .layer(TierSlotLimitLayer::new(Store::memory(), policy))
//!     .service(service_fn(|_req: http::Request<()>| async {
//!         Ok::<_, std::convert::Infallible>(http::Response::new(()))
//!     }));
//!
//! let mut req = http::Request::new(());
//! req.extensions_mut().insert(Job::new("acme", Origin::UserAction).with_tier("free"));
//! let response = claude.oneshot(req).await?; // the slot is held until its body is done
//! drop(response);
//! # Ok(())
//! # }
//! ```
//!
//! # Cancel safety
//! - **Dropping a waiting response future** leaves the tier's wait line (and its tenant's
//!   line) at once; the next waiter is woken if a slot was meanwhile meant for it. On Redis
//!   an acquire already under way when the future is dropped is released as soon as it
//!   answers.
//! - **Dropping a response** (or reading its body to the end, or an error in it) gives the
//!   slot back; on Redis the lease is removed and one waiter anywhere in the fleet woken.
//! - **Keeping a response unread holds its slot** (on Redis its lease is renewed by the
//!   heartbeat for as long as it lives); a process that dies holding slots gives them back
//!   within one lease TTL.

pub mod future;
pub(crate) mod layer;
pub(crate) mod service;
mod wait;

pub(crate) use self::service::TierSlotLimit;
pub use self::wait::SlotPermit;
use crate::admission::{Busy, SlotPolicy, TierLimit};
