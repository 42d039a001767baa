//! Global and per-tier caps on calls in flight, across every worker.
//!
//! [`TierSlotLimit`] holds each call to a *slot* for as long as it runs: at most
//! `global_max` calls at once across all tiers, and at most each tier's cap for that tier.
//! A tier's cap below the global one is how paying tiers keep room under a free-tier flood:
//! with the defaults (global 30; `premium` 30, `pro` 20, `free` 15, `guest` 5), 500 guests
//! hold at most 5 slots and 25 stay usable by everyone else.
//!
//! When no slot is free, a request waits — free tiers briefly, paid ones longer (`free` 12 s,
//! `guest` 8 s, `pro` 45 s, `premium` 60 s) — and then fails fast with [`Busy`] (which says
//! when to retry) instead of holding its caller forever. Local waiters of a tier are served
//! in arrival order; a release in this process wakes them at once, a release elsewhere is
//! announced through Redis pub/sub, and a jittered poll is the safety net.
//!
//! On the Redis store a slot is a *lease*, not a counter: a member of a sorted set scored by
//! its expiry, taken by one Lua script that drops expired leases and checks both caps, and
//! renewed by a heartbeat while its call runs. A crashed worker's slots therefore come back
//! within one lease TTL (30 s), however busy the others are. When Redis is unreachable the
//! layer keeps serving in process: for one lease TTL exactly the slots this worker held at
//! the fault, per tier (a call of a tier it held nothing of is answered [`Busy`]
//! at once, reason [`WaitReason::Store`](crate::WaitReason::Store), so the client can try
//! another worker); then, by the store's [`OutagePolicy`](crate::OutagePolicy), its share
//! of the caps (the caps divided by the workers last seen alive) or nothing.
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
