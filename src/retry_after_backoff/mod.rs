//! 429 hygiene: retry when the server says "try later", by its word, with jitter and a
//! budget; attribute every throttle to its tenant; hold every worker's calls behind one
//! cooldown gate per upstream; optionally pace calls under the provider's limits.
//!
//! [`RetryAfterBackoff`] wraps the client that calls the provider (the innermost layer).
//! The rules it keeps, each set on [`BackoffPolicy`]:
//!
//! - **What is retried**: 429 and 529 by default (a [`StatusSet`]), unless the response
//!   says `x-should-retry: false`; never a 429 for `enforced_spend_limit_reached` (waiting
//!   does not lift a spend cap). At most 4 retries, within a retry budget (tower's
//!   `TpsBudget`: 20% of calls plus 10 a second), so retries cannot multiply a storm.
//! - **How long to wait**: the server's delay (`retry-after-ms`, else `retry-after` in
//!   seconds or as a date; `decide::retry_after`) x 1.2 +/- 20%; with none, the SDKs'
//!   backoff (0.5 s doubling up to 8 s, minus up to 25%). A delay over the maximum (60 s)
//!   is not slept: the response goes back at once. Never panics on any header.
//! - **Who is told**: every 429 counts against the request's tenant
//!   ([`Store::record_throttle`](crate::Store::record_throttle), which feeds demotion) and
//!   closes the upstream's **cooldown gate** for every worker on the store
//!   ([`Store::extend_cooldown`](crate::Store::extend_cooldown)); a longer delay extends
//!   it, a shorter one never shortens it. When it reopens, held calls go spread over a
//!   release window, and one probe at a time until an answer shows room again.
//! - **Learned pacing** (on by default): every answer's `anthropic-ratelimit-*` headers
//!   teach its upstream key's limits, kept in the store, and every worker paces to 0.95 of
//!   them; the answer's `usage`, read as the body streams, corrects what the call was
//!   charged.
//! - **Slow start**: until an answer has told an upstream key's limits, one call goes first
//!   and the rest wait for its answer.
//! - **Gate scope per request** ([`UpstreamKey`](crate::rate::UpstreamKey)): the gate, the
//!   probe and the learned limits are kept per layer by default, or per
//!   [`ByApiKey`](crate::rate::ByApiKey) (hashed), [`ByModel`](crate::rate::ByModel),
//!   [`ByApiKeyAndModel`](crate::rate::ByApiKeyAndModel), or a closure.
//! - **Configured pacing** ([`Pacing`](crate::rate::Pacing), optional): GCRA limits per
//!   minute on requests, input and output tokens, per layer or
//!   [shared](crate::rate::Pacing::shared) through the store.
//! - **Max wait**: with slot caps in the store, a first attempt held here past its tier's
//!   max wait fails with [`Busy`](crate::Busy); a retry's wait is the server's.
//!
//! Requests are copied for a retry with `Clone` ([`CloneRequest`]: [`SendOnce`] or a
//! closure for other types). Responses are `http::Response<B>`, returned with a
//! [`ResponseBody`]: the upstream body untouched, but for a retryable 429 whose first 64
//! KiB are read ahead (bounded in bytes, frames and time) and replayed. A request without
//! a [`Job`](crate::Job) fails with [`MissingJob`](crate::MissingJob). `ARCHITECTURE.md`
//! ("429 hygiene") gives each rule in full.
//!
//! ```
//! use fairgate::{Job, Origin, RetryAfterBackoffLayer, Store};
//! use fairgate::BackoffPolicy;
//! use std::sync::atomic::{AtomicU32, Ordering};
//! use std::sync::Arc;
//! use tower::{ServiceBuilder, ServiceExt, service_fn};
//!
//! # #[tokio::main(flavor = "current_thread", start_paused = true)]
//! # async fn main() -> Result<(), fairgate::BoxError> {
//! let store = Store::memory();
//! let attempts = Arc::new(AtomicU32::new(0));
//! let seen = attempts.clone();
//! // An upstream that says "slow down, come back in 2 s" once, then answers.
//! let upstream = service_fn(move |_req: http::Request<String>| {
//!     let n = seen.fetch_add(1, Ordering::SeqCst);
//!     async move {
//!         let response = if n == 0 {
//!             http::Response::builder().status(429).header("retry-after", "2").body(String::new())?
//!         } else {
//!             http::Response::new("hello".to_owned())
//!         };
//!         Ok::<_, http::Error>(response)
//!     }
//! });
//! let claude = ServiceBuilder::new()
//!     .layer(RetryAfterBackoffLayer::new(store.clone(), BackoffPolicy::default()))
//!     .service(upstream);
//!
//! let mut req = http::Request::new("{}".to_owned());
//! req.extensions_mut().insert(Job::new("tenant-42", Origin::UserAction));
//! let response = claude.oneshot(req).await?;
//! assert_eq!(response.status(), 200);
//! assert_eq!(attempts.load(Ordering::SeqCst), 2);
//! // The 429 counted against the tenant (this feeds demotion).
//! assert_eq!(store.throttle_count(&"tenant-42".into()).await, 1);
//! # Ok(())
//! # }
//! ```
//!
//! # Cancel safety
//! - **Dropping the response future** while it waits (a cooldown, pacing, a backoff before
//!   a retry) gives up the call: no retry is sent later, and the rate cells taken for an
//!   attempt that never went are kept for the next call to the same upstream key or given
//!   back. The throttles and cooldowns already reported stay reported.
//! - **Dropping a response** ends the reading of its `usage`: a call whose answer said no
//!   usage keeps the estimate it was charged.
//! - **Keeping a response unread** holds nothing of this layer but the read-ahead of a
//!   retryable 429 (at most 64 KiB).

mod admit;
mod body;
mod call;
pub(crate) mod decide;
pub mod future;
pub(crate) mod layer;
pub(crate) mod policy;
mod request;
pub(crate) mod service;
mod state;
mod telemetry;

pub use self::body::ResponseBody;
pub use self::decide::{Backoff, StatusSet};
pub(crate) use self::policy::BackoffPolicy;
pub use self::policy::BackoffPolicyBuilder;
pub use self::request::{ByClone, CloneRequest, SendOnce};
pub(crate) use self::service::RetryAfterBackoff;
