//! Decide who goes first, centrally.
//!
//! [`PriorityClassify`] sets every request's [`Priority`](crate::Priority) from its
//! [`Job`](crate::Job)'s origin and SLA — never from a label the caller chose (the caller has
//! no way to set one) — and sends tenants that run away to batch for a while:
//!
//! - the rule ([`DefaultRule`], or any [`ClassifyRule`] or closure): a user action is
//!   critical; no SLA, or an SLA of at least 24 h, is batch; anything else is standard;
//! - demotion ([`DemotionPolicy`]): a tenant with at least 5 throttles (429s attributed to
//!   it) in the last 60 s, or more than 1.5x its daily token budget today (100,000 tokens
//!   by default; a budget per tenant with
//!   [`Store::set_daily_budget`](crate::Store::set_daily_budget)), is batch for 5 minutes
//!   whatever it asked for, then the demotion expires by itself. Every threshold is
//!   configuration (`DemotionPolicy::builder()`). The check and the demotion are one
//!   atomic step in the [`Store`](crate::Store) (one Lua script on Redis), so every worker
//!   agrees;
//! - off the hot path: each worker reuses a demotion check for the store's cache TTL (1 s,
//!   `cache_ttl`), and token counts are batched and flushed in the background every
//!   250 ms, so a busy tenant costs no Redis round trip per request;
//! - each job counts toward its tenant's total for the UTC day in the policy's
//!   [`BudgetCounts`](crate::BudgetCounts): its estimated input tokens (the default), or
//!   its whole [`charge`](crate::Job::charge); a [`Settler`](crate::drr_fairness::Settler)
//!   later corrects the total to the answer's real usage, and a call refused before it
//!   runs (`Busy`, `QueueFull`, no upstream with room) gives its count back.
//!
//! It is meant to be the outermost layer: it records `claude_request_latency_seconds` per
//! priority from its `call` to the response. A request with no `Job` fails with
//! [`MissingJob`](crate::MissingJob).
//!
//! Metrics: `claude_request_latency_seconds{priority}`, `claude_demoted_tenants`,
//! `claude_input_tokens_total{tenant_id}` (tenant labels capped, 1,000 by default) and
//! `claude_store_degraded`. Tracing events: `tenant.demoted`, `queue.redis_unavailable`
//! (once per outage) and `queue.redis_recovered`.
//!
//! ```
//! use fairgate::{Job, Origin, Priority, PriorityClassifyLayer, Store};
//! use tower::{ServiceBuilder, ServiceExt, service_fn};
//! use std::time::Duration;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), fairgate::BoxError> {
//! let store = Store::memory();
//! let service = ServiceBuilder::new()
//!     .layer(PriorityClassifyLayer::new(store.clone()))
//!     .service(service_fn(|req: http::Request<()>| async move {
//!         // What the layers below see:
//!         let priority = req.extensions().get::<Job>().and_then(|job| job.priority());
//!         Ok::<_, std::convert::Infallible>(priority)
//!     }));
//!
//! let mut req = http::Request::new(());
//! req.extensions_mut().insert(Job::new("acme", Origin::Scheduled).with_sla(Duration::from_secs(60)));
//! assert_eq!(service.oneshot(req).await?, Some(Priority::Standard));
//! # Ok(())
//! # }
//! ```
//!
//! # Cancel safety
//! - **Dropping the response future**: the job's count was added to its tenant's day in
//!   `call` and stays (as for a call whose answer never said its usage); the inner future is
//!   dropped with it, and each layer below gives back what it held (see theirs).
//! - **Dropping or keeping a response**: nothing of this layer is held by a response; the
//!   latency is recorded when the response future completes.

mod classifier;
pub mod future;
pub(crate) mod layer;
pub(crate) mod rule;
pub(crate) mod service;

pub(crate) use self::rule::{ClassifyRule, DefaultRule};
pub(crate) use self::service::PriorityClassify;
use crate::admission::DemotionPolicy;
