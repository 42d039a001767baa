//! Fair, tier-aware admission control for calls to hosted LLM APIs (Anthropic Claude first),
//! as tower layers that share one state handle.
//!
//! Multi-tenant applications put fairgate in front of the provider so that a paying user's
//! chat never queues behind a free-tier flood, one runaway tenant cannot starve the others,
//! the whole fleet of workers stays inside its provider budget, and a storm of 429s calms
//! down instead of feeding itself.
//!
//! - [`PriorityClassify`]: critical / standard / batch, decided centrally from a request's
//!   origin and SLA, never from a caller's label; runaway tenants demoted to batch for a
//!   while.
//! - [`DrrFairness`]: at most N requests in flight, and when the window is full the waiting
//!   ones go out in a fair order — one call per turn across tenants (start-time fair
//!   queuing on their tokens; paid tiers weigh more), weighted across priorities — instead
//!   of first come, first served.
//! - [`TierSlotLimit`]: a global cap on calls in flight plus a cap per tier, shared by every
//!   worker through the store; free tiers fail fast with [`Busy`], paid ones wait longer.
//! - [`RetryAfterBackoff`]: retries "try later" answers by the server's `retry-after` with
//!   jitter and a budget, counts every 429 against its tenant, and holds every worker's
//!   calls behind one shared cooldown gate per upstream; optional pacing under provider
//!   limits.
//!
//! Every layer reads the [`Job`] a request carries (in `http::Request` extensions, or through
//! [`JobRequest`] for other request types) and shares one [`Store`]: in memory by default,
//! Redis (feature `redis`) when many processes share one budget.
//!
//! Features: none by default (the in-memory store); `redis` adds the Redis store; `axum`
//! turns [`Busy`] into a `503 SERVER_BUSY` response; `reqwest` adds a reqwest-middleware
//! adapter; `tonic` renders rejections as gRPC statuses; `full` is all of them.
//!
//! Around the layers: [`FairgateLayer`] applies all four in the recommended order;
//! [`JobLayer`](extract::JobLayer) derives each request's [`Job`] from the request (API key, headers);
//! [`Rejection`](reject::Rejection) and [`reject::render`] turn every refusal into an answer clients
//! understand (`503 {"code":"SERVER_BUSY","retry_after":5}`, or Anthropic's error shape).
//!
//! The order below is the recommended one: classify first (the others read the priority);
//! retry outside the fair queue, so a call sleeping before a retry holds no window permit
//! and no slot, and queues fairly again; the fair queue outside the slot layer, handed the
//! slot layer's caps and the retry layer's rate as gates ([`SlotGate`], [`RateGate`]), so who goes next is decided
//! in one place and a waiting request holds nothing. [`FairgateLayer`] does this wiring; by
//! hand it is two lines, below. Every layer also works alone and in any order, waiting for
//! its own limit. Every clone of a layer shares its limits: wrap the whole client or
//! router, not each route. `ARCHITECTURE.md` follows a request through the stack.
//!
//! ```
//! use fairgate::{
//!     BackoffPolicy, DrrFairnessLayer, Job, Origin, PriorityClassifyLayer,
//!     RetryAfterBackoffLayer, SlotPolicy, Store, TierSlotLimitLayer,
//! };
//! use tower::{ServiceBuilder, ServiceExt, service_fn};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), fairgate::BoxError> {
//! // Any tower Service taking http::Request<B>: hyper, a reqwest adapter, ...
//! let http_client = service_fn(|_req: http::Request<String>| async {
//!     Ok::<_, std::convert::Infallible>(http::Response::new("{\"content\":[]}".to_owned()))
//! });
//!
//! let store = Store::memory(); // or Store::redis("redis://127.0.0.1/").await? (feature "redis")
//! let slots = TierSlotLimitLayer::new(store.clone(), SlotPolicy::default()); // global + per-tier caps
//! let (retry, rate) = // 429 hygiene; its rate gate goes to the fair queue
//!     RetryAfterBackoffLayer::new(store.clone(), BackoffPolicy::default()).with_gate_below();
//! let fair = DrrFairnessLayer::builder(store.clone(), 32) // fair order, 32 in flight here
//!     .slot_gate(slots.gate())
//!     .rate_gate(rate)
//!     .build()?;
//! let claude = ServiceBuilder::new()
//!     .layer(PriorityClassifyLayer::new(store.clone())) // who goes first
//!     .layer(retry)
//!     .layer(fair)
//!     .layer(slots)
//!     .service(http_client);
//!
//! let prompt = "Summarise this thread.";
//! let mut req = http::Request::post("https://api.anthropic.com/v1/messages").body(prompt.to_owned())?;
//! req.extensions_mut().insert(Job::new("tenant-42", Origin::UserAction).with_tier("pro").with_input_text(prompt));
//! let response = claude.oneshot(req).await?;
//! assert_eq!(response.status(), 200);
//! # Ok(())
//! # }
//! ```
#![warn(
    missing_docs,
    missing_debug_implementations,
    rust_2018_idioms,
    unreachable_pub
)]
#![forbid(unsafe_code)]
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod admission;
pub mod body;
pub mod drr_fairness;
mod error;
pub mod extract;
mod gate;
mod gcra;
mod guarded;
mod hash;
mod job;
mod labels;
pub mod metrics;
pub mod pool;
pub mod priority_classify;
pub mod rate;
pub mod reject;
#[cfg(feature = "reqwest")]
#[cfg_attr(docsrs, doc(cfg(feature = "reqwest")))]
pub mod reqwest;
pub mod retry_after_backoff;
mod rng;
mod stack;
pub mod store;
mod sync;
pub mod tier_slot_limit;
mod time;
#[cfg(feature = "tonic")]
#[cfg_attr(docsrs, doc(cfg(feature = "tonic")))]
pub mod tonic;
pub mod trace;
#[cfg(feature = "bedrock")]
#[cfg_attr(docsrs, doc(cfg(feature = "bedrock")))]
pub mod upstream;

pub use crate::admission::busy::{Busy, WaitReason};
pub use crate::admission::demotion::{BudgetCounts, DemotionPolicy, DemotionPolicyBuilder};
pub use crate::admission::policy::{SlotPolicy, SlotPolicyBuilder, TierLimit};
pub use crate::drr_fairness::layer::DrrFairnessLayer;
pub use crate::drr_fairness::service::DrrFairness;
pub use crate::error::{BoxError, ConfigError, MissingJob, PolledAfterCompletion};
pub use crate::gate::{RateGate, SlotGate};
pub use crate::job::{Job, JobRequest, Origin};
pub use crate::labels::{Priority, TenantId, Tier};
pub use crate::pool::gate::PoolGate;
pub use crate::priority_classify::layer::PriorityClassifyLayer;
pub use crate::priority_classify::rule::{ClassifyRule, DefaultRule};
pub use crate::priority_classify::service::PriorityClassify;
pub use crate::retry_after_backoff::layer::RetryAfterBackoffLayer;
pub use crate::retry_after_backoff::policy::BackoffPolicy;
pub use crate::retry_after_backoff::service::RetryAfterBackoff;
pub use crate::stack::{Fairgate, FairgateBody, FairgateBuilder, FairgateLayer};
pub use crate::store::handle::{
    Demotion, OutagePolicy, Store, StoreBuilder, StoreFuture, StoreUnavailable,
};
pub use crate::tier_slot_limit::layer::TierSlotLimitLayer;
pub use crate::tier_slot_limit::service::TierSlotLimit;

/// The Rust blocks of the README and of the guide's pages that have some (`docs/`),
/// compiled (and the runnable ones run) as doc-tests: each is a whole program, as a reader
/// copies it (`scripts/doc-blocks` also builds each as a crate of its own, with the
/// dependencies its page gives). They use every optional feature.
#[cfg(all(doctest, feature = "full"))]
#[doc = include_str!("../README.md")]
#[doc = include_str!("../docs/integrations.md")]
#[doc = include_str!("../docs/store.md")]
#[doc = include_str!("../docs/upstreams.md")]
pub struct ReadmeDoctests;
