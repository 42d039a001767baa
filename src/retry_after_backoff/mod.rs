//! 429 hygiene: retry when the server says "try later", by its word, with jitter and a
//! budget; attribute every throttle to its tenant; hold every worker's calls behind one
//! cooldown gate per upstream; optionally pace calls under the provider's limits.
//!
//! [`RetryAfterBackoff`] wraps the client that calls the provider (the innermost layer).
//! The rules it keeps, each set on [`BackoffPolicy`]:
//!
//! - **What is retried**: 429 and 529 by default (a [`StatusSet`]: add 408, 409, 5xx, ...),
//!   unless the response says `x-should-retry: false` (`true` forces a retry); never a 429
//!   whose body says `"error_code":"enforced_spend_limit_reached"` (waiting does not lift a
//!   spend cap). Only a retryable 429's body is read ahead for this, and the caller still
//!   gets every byte. The read-ahead stops at 64 KiB, 1,024 frames or 5 s after the headers
//!   (`BackoffPolicyBuilder::peek_limit`, `peek_frame_limit`, `peek_timeout`), and reads at
//!   most 64 frames a poll: past a limit the 429 goes back to the caller as it is (the
//!   bytes read replayed, the rest streamed), counted as a throttle, never retried blind,
//!   so an upstream that stalls mid-body never hangs a caller. At most 4 retries, within a
//!   retry budget (tower's `TpsBudget`: 20% of calls plus 10 a second), so retries cannot
//!   multiply a storm.
//! - **How long to wait**: the server's delay (`retry-after-ms`, else `retry-after` in
//!   seconds, with decimals, or as any HTTP date measured against the `Date` header;
//!   `decide::retry_after`) x 1.2 +/- 20%; with none, the SDKs' backoff (0.5 s doubling up
//!   to 8 s, minus up to 25%). A zero or past value counts as none (backoff, gate left
//!   open), as the official SDKs do. A delay over the maximum (60 s) is not slept: the
//!   response goes back at once, and every value that overflows, in any form, counts as
//!   such a delay. No header value, however malformed, can make it panic (property-tested).
//! - **Who is told**: every 429 counts against the request's tenant in the store's 60 s
//!   window ([`Store::record_throttle`](crate::Store::record_throttle), which feeds
//!   demotion) and closes the upstream's **cooldown gate** for every worker on the store
//!   ([`Store::extend_cooldown`](crate::Store::extend_cooldown)); a longer delay extends
//!   it, a shorter one never shortens it. A response reporting an exhausted limit
//!   (`anthropic-ratelimit-*-remaining: 0`) closes it until the `-reset`, before any 429.
//!   Checking the gate is a local read (Redis pub/sub keeps each worker's copy).
//! - **Recovery at full speed**: after a gate reopens, one probe goes for the whole fleet
//!   (a lease in the store); on its success every worker goes back to the learned rate at
//!   once. Any success ends the recovery, an answer to a call that was in flight when the
//!   throttle came too: with calls in flight at the throttle (the usual case) the fleet goes
//!   back at the reopening without a probe (paced by what else binds: the learned rate, the
//!   release window, the slot caps). Held calls are spread over R/5 of the server's delay R
//!   (each worker from its own random point of that window; where the fleet hands out the
//!   rate's cells, every worker from the reopening itself, the cells pacing them in the
//!   fleet's order), with no fixed floor. A lone call keeps its band: with nothing else
//!   held, a retry goes within [0.96 R, 1.44 R] (over 1,000 seeded draws: 250 ms ->
//!   250-360 ms, 2 s -> 2.0-2.88 s). After a storm whose last answer was a 429, probe mode
//!   ends after 30 s with no throttle.
//! - **Learned pacing** (on by default; `BackoffPolicyBuilder::learned_pacing(false)` turns
//!   it off): every answer's `anthropic-ratelimit-{requests,input-tokens,output-tokens,
//!   tokens}-{limit,remaining}` headers (successes too) teach the limits of its upstream
//!   key. The limits are kept in the store, so every worker, and one that starts later,
//!   paces to them: the provider's token buckets (continuous refill) at 0.95 of each rate,
//!   `-remaining` resynchronising them. Before the call, the job's estimated input tokens
//!   and the output tokens expected (the average of the key's recent answers, 1 until one
//!   is seen) are charged, both again in `tokens`; after it, the answer's `usage` corrects
//!   that: while a key has learned token limits, a 2xx body is scanned as it streams to the
//!   caller (no buffering, frames untouched, matches split across frames found) for
//!   `"input_tokens"` and the largest `"output_tokens"` (a JSON message, or a stream's
//!   `message_start` and `message_delta`), and when the body ends, or is dropped after its
//!   usage was seen, the difference is charged or given back once (at most one minute of
//!   the limit; on Redis with the next reservation). No usage, a non-2xx answer, garbage
//!   numbers or a body that never ends: no correction (`usage_correction(false)` turns it
//!   off). A configured `Pacing` still applies; the stricter wins. No headers: no pacing.
//!   Zero, absurd or non-numeric limits are ignored (logged once). On Redis a call in steady
//!   state is no round trip: workers reserve a quarter second of the rate at a time;
//!   headers reported with a later reservation never undo a newer limit, and a call waiting
//!   for cells reserved under a limit that changed asks again.
//! - **Slow start**: until an answer has told an upstream key's limits, one call goes first
//!   and the rest wait for its answer — under a fair queue for at most
//!   `BackoffPolicyBuilder::slow_start_max` (500 ms), then the slot caps bound the start-up
//!   burst.
//! - **Gate scope per request** ([`UpstreamKey`](crate::rate::UpstreamKey)): the gate, the
//!   probe and the learned limits are kept per layer by default, or per
//!   [`ByApiKey`](crate::rate::ByApiKey) (hashed), [`ByModel`](crate::rate::ByModel) (from
//!   the body), [`ByApiKeyAndModel`](crate::rate::ByApiKeyAndModel), or a closure
//!   (`.upstream_key_with(ByApiKeyAndModel)`). One throttled key or model does not stop the
//!   others.
//! - **Configured pacing** ([`Pacing`](crate::rate::Pacing), optional): GCRA limits per
//!   minute on requests, input and output tokens, per layer in process or
//!   [shared](crate::rate::Pacing::shared) through the store (one Lua script on Redis that
//!   reserves every dimension at once, on server time; while Redis is down each worker paces
//!   against its share, the limits divided by the workers last seen alive).
//! - **Under a fair queue** (`RetryAfterBackoffLayer::with_gate_below`, as
//!   [`FairgateLayer`](crate::FairgateLayer) wires it) the layer holds nothing itself: the
//!   gate, the probe, slow start and the pacing are consulted by the fair queue for the head
//!   of its order. Alone, it holds calls itself, and **max wait**
//!   (`RetryAfterBackoffLayer::max_waits(slot_policy)`) tells a first attempt held past its
//!   tier's max wait [`Busy`](crate::Busy) at the deadline; a retry's wait is the server's.
//!
//! Requests are copied for a retry with `Clone` ([`CloneRequest`]: [`SendOnce`] or a
//! closure for other types). Responses are `http::Response<B>`, returned with a
//! [`ResponseBody`]: the upstream body untouched, but for a retryable 429 whose first 64
//! KiB are read ahead (bounded in bytes, frames and time) and replayed. A request without
//! a [`Job`](crate::Job) fails with [`MissingJob`](crate::MissingJob). `ARCHITECTURE.md`
//! ("429 hygiene") gives each rule in full.
//!
//! Metrics: `claude_throttle_count{tenant_id}` (rolling window), `claude_retries_total{status}`,
//! `claude_retries_given_up_total{reason}`, `claude_cooldown_waits_total`,
//! `claude_cooldown_wait_seconds`, `claude_learned_rate_limit{upstream,dimension}`,
//! `claude_pacing_wait_seconds` and `claude_probes_total{reason}`. Tracing event:
//! `upstream.throttled` (tenant, status, delay).
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
