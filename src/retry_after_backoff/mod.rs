//! 429 hygiene: retry when the server says "try later", by its word, with jitter and a
//! budget; attribute every throttle to its tenant; hold every worker's calls behind one
//! cooldown gate per upstream; optionally pace calls under the provider's limits.
//!
//! [`RetryAfterBackoff`] wraps the client that calls the provider (the innermost layer):
//!
//! - **What is retried**: 429 and 529 by default (a [`StatusSet`]; e.g. add 408, 409, 5xx),
//!   unless the response says `x-should-retry: false` (`true` forces a retry). A 429 whose
//!   body carries `"error_code":"enforced_spend_limit_reached"` is never retried: waiting
//!   does not lift a spend cap. At most 4 retries, and a retry budget (tower's `TpsBudget`:
//!   20% of calls plus 10 a second) so retries cannot multiply the load in a storm — tower
//!   explains why budgets beat a bare retry count; this layer keeps both.
//! - **How long to wait**: the server's delay (`retry-after-ms`, else `retry-after` in
//!   seconds or as an HTTP date; see [`decide::retry_after`]) x 1.2 +/- 20%; with none, the
//!   SDKs' jittered exponential backoff (0.5 s doubling up to 8 s, minus up to 25%). A zero
//!   delay (`retry-after: 0`, `retry-after-ms: 0`, a date at or before the server's `Date`)
//!   counts as none, as in the official SDKs: the backoff applies, never an immediate retry,
//!   and the gate stays open. A delay over the policy's maximum (60 s) is not slept: the
//!   response goes back at once, so the caller can decide, and the gate closes for the
//!   maximum. Every value too large to represent (`18446744073709551616`, a decimal or
//!   millisecond form of it, any number of digits) counts as such a delay, like a date in the
//!   year 9999: one rule for every overflow. Never panics on any header.
//! - **Who is told**: every 429 counts against the request's tenant in the store's sliding
//!   window ([`Store::record_throttle`](crate::Store::record_throttle)), which is what
//!   demotes a runaway tenant in [`PriorityClassify`](crate::PriorityClassify); and the
//!   server's delay closes the upstream's **cooldown gate**
//!   ([`Store::extend_cooldown`](crate::Store::extend_cooldown)): every worker on the store
//!   holds new calls to that upstream until it reopens. Then they do not all go at once:
//!   each worker starts at its own random point of a release window (a fifth of the wait),
//!   each held call adds a draw of its own, and while the upstream is known
//!   to be at its limit a worker sends one call at a time (a probe, like a circuit breaker
//!   half-open) until an answer shows room again, or until the upstream has been quiet for
//!   the probe timeout (30 s, counted from the last throttle or from the worker's release
//!   from the gate; [`BackoffPolicyBuilder::probe_timeout`]), so a stale throttle does not
//!   hold a worker to one call at a time forever. A later, longer
//!   delay extends the gate, a shorter one never shortens it; checking it is a local read
//!   (pub/sub keeps each worker's copy current on Redis). A response reporting an exhausted
//!   limit (`anthropic-ratelimit-*-remaining: 0` with its `-reset`) closes the gate until
//!   the reset, before any 429.
//! - **Learned pacing** (on by default; [`BackoffPolicyBuilder::learned_pacing`]): every
//!   answer's `anthropic-ratelimit-{requests,input-tokens,output-tokens,tokens}-{limit,
//!   remaining}` headers (successes too) teach the limits of its upstream key, kept in the
//!   store (`Store::learned_limits`), so every worker, and one that starts later, paces to
//!   them: a GCRA mirror of the provider's buckets (continuous refill) at 0.95 of each rate
//!   ([`learned_headroom`](BackoffPolicyBuilder::learned_headroom)); requests burst one
//!   second's worth, tokens their minute. `-remaining` resynchronises the mirror (only
//!   later; a new `-limit` restarts it from what is left). **What is charged when**:
//!   before the call, its job's estimated input tokens and the output tokens expected
//!   (the average of the key's recent answers in this worker, 1 until one is seen), both
//!   again in `tokens`; after it, the answer's `usage` corrects that — while the key has
//!   learned token limits, a 2xx body is scanned as it streams to the caller (never
//!   buffered, frames untouched) for `"input_tokens"` and the largest `"output_tokens"`
//!   (a JSON message, or a stream's `message_start` and `message_delta` events), and when
//!   the body ends, or is dropped after its usage was seen, the difference is charged or
//!   given back once, at most one minute of the limit
//!   ([`usage_correction`](BackoffPolicyBuilder::usage_correction)). No usage, a non-2xx
//!   answer or a body that never ends: no correction; the next answer's `-remaining`
//!   still resynchronises.
//!   Zero, absurd (over 10^9) or non-numeric limits are ignored (logged once); `-remaining`
//!   above `-limit` reads as full; a `-reset` over 61 s ahead is not believed; an exhausted
//!   dimension with a usable `-limit` waits for one cell, not for its full reset. No
//!   headers: no learned pacing. A configured [`Pacing`] still applies: the stricter
//!   wins. On Redis a call is not a round trip: a worker reserves a quarter second of the
//!   learned request rate at once (at most 64 calls) and sends what headers said with the
//!   next reservation (at once when a limit changed, a dimension runs low, or a throttle).
//! - **Slow start**: before any answer told an upstream key's limits, one call goes first
//!   (a probe, its lease 1 s: [`release_spread`](BackoffPolicyBuilder::release_spread)) and
//!   the rest wait for its answer.
//! - **Gate scope per request** ([`UpstreamKey`],
//!   [`upstream_key_with`](RetryAfterBackoffLayer::upstream_key_with)): the gate, the probe
//!   and the learned limits are keyed per request: one per layer by default, or
//!   [`ByApiKey`] (hashed), [`ByModel`], [`ByApiKeyAndModel`], or a closure.
//! - **Recovery at full speed**: after a throttle, once the gate reopens, one probe for the
//!   whole fleet (a lease in the store); its success ends the recovery for every worker and
//!   calls go at the learned rate at once.
//! - **A lone call keeps its band**: a retry with nothing else held in its layer goes when
//!   its own delay ends or the gate reopens, within [0.96 R, 1.44 R] of the server's delay
//!   R; held calls are spread over a fifth of R (no fixed floor) from each worker's offset.
//! - **Pacing** ([`Pacing`], optional): GCRA limits on requests, input tokens and output
//!   tokens per minute, before any 429 — per layer in process, or
//!   [shared](Pacing::shared) by every worker through the store (one GCRA script on Redis
//!   that reserves all dimensions at once, server time).
//!
//! **Max wait.** When the store carries slot caps (a
//! [`TierSlotLimitLayer`](crate::TierSlotLimitLayer) was built on it), a first attempt
//! held here — behind the gate, by pacing, by slow start — past its tier's max wait
//! (counted from the request's arrival) fails with [`Busy`](crate::Busy) at the deadline,
//! as the fair queue and the slot layer would: a tier's max wait is end to end. A retry is
//! not bounded by it (the request was dispatched once); its wait is the server's.
//!
//! Requests are copied for a retry with `Clone` by default ([`CloneRequest`]: [`SendOnce`]
//! or a closure for other types); a request that cannot be copied is sent once. Responses
//! must be `http::Response<B>` (any `http_body::Body`): the layer returns them with a
//! [`ResponseBody`], which is the upstream body untouched except for a retryable 429, whose
//! first 64 KiB are read ahead to look for the spend-limit code and then replayed — the
//! caller gets every byte. A request without a [`Job`](crate::Job) fails with
//! [`MissingJob`](crate::MissingJob).
//!
//! The read-ahead is bounded three ways, so no call hangs because an upstream stalls: by
//! bytes (64 KiB, [`peek_limit`](BackoffPolicyBuilder::peek_limit)), by frames (1,024,
//! [`peek_frame_limit`](BackoffPolicyBuilder::peek_frame_limit)) and by time (5 s from the
//! head's arrival, [`peek_timeout`](BackoffPolicyBuilder::peek_timeout)). Reaching the byte
//! limit or the body's end judges the body. Reaching the frame or time limit first means it
//! could not be judged: the 429 is then **not retried** but goes back to the caller as it
//! is — the frames read so far replayed, then the rest of the body streamed as the upstream
//! sends it — still counted as a throttle and still closing the gate by its `retry-after`.
//! Not retrying is the safe side (the unread part may be the spend-limit code); the
//! caller's own read timeout governs the rest of a stalled body, and the permit and slot of
//! the layers around this one come back when the caller drops it. One poll reads at most 64
//! frames, then yields (waking itself), so a body of millions of empty frames that are all
//! ready cannot hold a thread.
//!
//! ```
//! use fairgate::{Job, Origin, RetryAfterBackoffLayer, Store};
//! use fairgate::retry_after_backoff::BackoffPolicy;
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

mod admit;
mod body;
mod call;
pub mod decide;
pub mod future;
mod gate;
mod layer;
mod learned;
pub mod metrics;
mod pacing;
mod policy;
mod request;
mod service;
mod telemetry;
mod usage;

pub use self::body::ResponseBody;
pub use self::decide::{Backoff, StatusSet};
pub use self::layer::RetryAfterBackoffLayer;
pub use self::learned::{ByApiKey, ByApiKeyAndModel, ByModel, OneUpstream, UpstreamKey};
pub use self::pacing::Pacing;
pub use self::policy::{BackoffPolicy, BackoffPolicyBuilder};
pub use self::request::{ByClone, CloneRequest, SendOnce};
pub use self::service::RetryAfterBackoff;
