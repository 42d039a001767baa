//! Fair order inside each priority: a fair-queuing concurrency limiter.
//!
//! [`DrrFairness`] is like [`tower::limit::ConcurrencyLimit`]: at most `max_in_flight`
//! requests are in flight below it. The difference is who goes next when the window is
//! full. `ConcurrencyLimit` serves first come, first served, so a tenant that dumps 100
//! jobs makes everyone behind it wait for all 100. `DrrFairness` serves the waiting
//! requests in a fair order:
//!
//! - **between priorities**, a work-conserving weighted choice among the classes with work:
//!   by default critical takes 90% of the dispatches while it has work — not 100%, so the
//!   others never starve — and standard:batch share the rest 25:5, by a deterministic smooth
//!   weighted round robin (a seeded random draw by weight is an option);
//! - **inside a priority**, Deficit Round Robin over the tenants with waiting work
//!   (Shreedhar & Varghese, 1995): on its turn a tenant's deficit grows by
//!   `quantum x weight(tier)` and it dispatches while its head request's cost (estimated
//!   tokens) fits. Tiers `pro` and `premium` weigh 3. As in fq_codel (RFC 8290,
//!   "DRR++"), a tenant that becomes active first joins a list of new tenants served
//!   before the old ones, so a light tenant's single request goes out at the next freed
//!   permit instead of behind a whole round of the heavy tenant's work. A tenant whose
//!   queue empties keeps its place in the round (and its leftover deficit) until its turn
//!   comes and finds it still empty; then it is forgotten, deficit included, or, while
//!   requests of it are still in flight, set aside with its debt (its credit forfeited)
//!   until they complete. So idle time banks no credit, a tenant with nothing waiting or
//!   in flight costs no memory, and light tenants that keep coming back get no newcomer
//!   priority over a backlogged one, which they could otherwise starve. One request is
//!   charged at most 4 quanta, so a giant prompt cannot stall its class. Each pick is O(1)
//!   amortised, whatever the number of tenants. Every dispatch is charged to its tenant's
//!   deficit, also one that goes out at once because the window had room: a tenant that
//!   filled the window while nobody waited starts in debt, so when others arrive it
//!   queues behind the newcomers.
//!
//! The scheduler is a sans-IO core, public as [`scheduler`] for simulations.
//!
//! # How a request goes through
//! `poll_ready` cannot know the tenant, so it is always ready and reserves nothing. `call`
//! reads the request's [`Job`] — its priority (set by
//! [`PriorityClassify`](crate::PriorityClassify); a job without one is served as standard),
//! tier and estimated tokens — and either dispatches at once (room in the window, nobody
//! waiting) or queues it. The response future waits for its turn (woken exactly when a
//! permit is handed to it), then drives a clone of the inner service to readiness, as
//! tower's `Buffer` worker does, and calls it. The permit is held until the response future
//! completes, and for an `http::Response<B>` until its body ends, fails or is dropped
//! (the body becomes a [`GuardedBody`](crate::body::GuardedBody)): an LLM answer that
//! streams for a minute holds its place for that minute.
//!
//! Dropping a waiting future takes the request out of the queue; dropping it later gives
//! the permit back. A request without a job fails with [`MissingJob`](crate::MissingJob);
//! one refused by an optional queue limit with [`QueueFull`](error::QueueFull) — the
//! incoming (youngest) request is the one refused.
//!
//! # With gates: one order under every limit
//! Handed a slot layer's caps ([`DrrFairnessBuilder::slot_gate`]) this layer dispatches a
//! request only together with its tier slot; handed a retry layer's rate
//! ([`DrrFairnessBuilder::rate_gate`]: learned and configured pacing, the cooldown gate
//! after a 429, slow start, the recovery probe), only when the rate lets it go, taking its
//! cells then (see [`crate::gate`]). A request the rate holds back waits here, in fair
//! order, holding nothing; one that leaves took nothing. Requests wait in one DRR scheduler per tier; the next
//! dispatch picks the class by weighted round robin among the classes that have a request
//! whose tier has room, then the tier by start-time fair queuing (cost served per unit of
//! the tier's active weight, so tiers share as their tenants' weights say), then the tenant
//! by DRR, and takes the slot then: at once on the memory store, by one script on Redis
//! whose answer goes to that tier's next request in fair order. A tier found full waits,
//! holding no window permit, until a slot comes free (a release here, one announced by
//! another worker, or the poll of the slot policy). So a flood of a capped tier never delays
//! another tier, fairness holds inside a full tier (a newcomer goes at its tier's next freed
//! slot), and a request is dispatched or told [`Busy`](crate::Busy) within its tier's max
//! wait of its arrival ([`Job::arrived_at`](crate::Job::arrived_at)); `queue.slow_wait` is
//! logged at the policy's mark. The permit holds the slot and gives both back together; the
//! `TierSlotLimit` below lets the request through without taking a second slot.
//!
//! Sizing the window: with the caps in the store the window no longer decides who goes; it
//! is this worker's own ceiling on calls in flight. Set it at least to the share of the
//! global cap this worker should be able to use (the whole global cap for one worker); a
//! smaller window caps the worker below its share, a larger one costs nothing.
//!
//! # Settling real usage
//! The cost charged at dispatch is the job's estimate. When the real usage is known (the
//! response's `usage`, or the app's own count), report it through a [`Settler`]: the
//! difference is charged to or refunded from the tenant's deficit, if that class still
//! knows the tenant: always while the request is in flight (the permit is held until the
//! response body ends), or while the tenant has work waiting; a forgotten tenant has no
//! deficit to settle.
//!
//! # Observability
//! Gauges [`QUEUE_DEPTH`] (`claude_queue_depth{priority}`) and [`FAIRNESS_INDEX`]
//! (`claude_drr_fairness_index`: Jain's index over the weight-normalised served cost of the
//! tenants that were backlogged in a sliding window, 60 s by default). Every dispatch also
//! adds its cost to the tenant's served cost in the [`Store`](crate::Store)
//! ([`Store::add_served_cost`](crate::Store::add_served_cost), batched off the request path),
//! so the index can be computed across workers. The names shown carry the default prefix
//! (see [`set_metric_prefix`](crate::metrics::set_metric_prefix)).
//!
//! # Clone
//! The window and the queues are created once, in [`DrrFairnessLayer::new`]; every clone of
//! the layer and every service it builds share them. Put the layer around the whole client
//! (or router), not around a per-route clone made from a new layer each time.
//!
//! ```
//! use fairgate::{DrrFairnessLayer, Job, Origin, PriorityClassifyLayer, Store};
//! use tower::{ServiceBuilder, ServiceExt, service_fn};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), fairgate::BoxError> {
//! let store = Store::memory();
//! let fair = DrrFairnessLayer::new(store.clone(), 32);
//! let claude = ServiceBuilder::new()
//!     .layer(PriorityClassifyLayer::new(store.clone()))
//!     .layer(fair.clone())
//!     .service(service_fn(|_req: http::Request<String>| async move {
//!         Ok::<_, std::convert::Infallible>(http::Response::new("{\"usage\":{}}".to_owned()))
//!     }));
//!
//! let mut req = http::Request::post("https://api.anthropic.com/v1/messages").body("{}".to_owned())?;
//! req.extensions_mut().insert(Job::new("tenant-42", Origin::UserAction).tier("pro").cost(1_200));
//! let response = claude.oneshot(req).await?;
//! // The permit lives in the body until it is read to the end or dropped.
//! assert_eq!(fair.in_flight(), 1);
//! drop(response);
//! assert_eq!(fair.in_flight(), 0);
//! # Ok(())
//! # }
//! ```

pub mod error;
mod fairness;
pub mod future;
#[cfg(test)]
mod gate_tests;
mod layer;
pub mod scheduler;
mod service;
mod state;

use std::fmt;
use std::sync::Arc;

pub use self::layer::{DrrFairnessBuilder, DrrFairnessLayer};
pub use self::scheduler::{ClassSelection, ClassWeights, SchedulerConfig};
pub use self::service::DrrFairness;
pub use self::state::Permit;
pub use crate::metrics::{FAIRNESS_INDEX, QUEUE_DEPTH};

use self::state::Shared;
use crate::Job;

/// Settles requests' real usage against their tenants' deficits.
///
/// Get one from [`DrrFairnessLayer::settler`] or [`DrrFairness::settler`]; it is cheap to
/// clone and shares the layer's state. Call [`settle`](Settler::settle) with the request's
/// job and the tokens it really used (e.g. `usage.input_tokens` of the response, or a
/// count the app made): the difference to the job's estimate is charged to the tenant's
/// deficit (it used more) or refunded (less), if the tenant still has requests waiting or
/// in flight in that class. Refunds never bank more than one quantum x weight; charges never go below
/// minus one maximum charge. Only the scheduling order changes: the served cost already
/// recorded stays the estimate.
///
/// ```
/// use fairgate::{DrrFairnessLayer, Job, Origin, Store};
///
/// let layer = DrrFairnessLayer::new(Store::memory(), 8);
/// let settler = layer.settler();
/// let job = Job::new("acme", Origin::Scheduled).cost(1_000);
/// // ... later, the response said it used 4,000 input tokens:
/// settler.settle(&job, 4_000);
/// ```
#[derive(Clone)]
pub struct Settler {
    shared: Arc<Shared>,
}

impl Settler {
    /// Settles `job` (as it was sent: same tenant, priority and estimate) at `actual`
    /// tokens.
    pub fn settle(&self, job: &Job, actual_tokens: u64) {
        self.shared.settle(job, actual_tokens);
    }
}

impl fmt::Debug for Settler {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Settler").finish_non_exhaustive()
    }
}
