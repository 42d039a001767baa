//! Fair order inside each priority: a fair-queuing concurrency limiter.
//!
//! [`DrrFairness`] is [`tower::limit::ConcurrencyLimit`] with a fair order: at most
//! `max_in_flight` requests are in flight below it, and when the window is full the next
//! to go is chosen by these rules instead of first come, first served:
//!
//! - **between priorities**, critical takes 90% of the dispatches while it has work (never
//!   100%, so the others never starve) and standard:batch share the rest 25:5, by a
//!   deterministic smooth weighted round robin (a seeded random draw by weight is an
//!   option);
//! - **inside a priority**, start-time fair queuing, one call per turn: across groups
//!   ([`Job::with_group`]: a service key's end users together take one share), then across
//!   the tenants of a group, in proportion to the tier's weight (`pro` and `premium` weigh
//!   3); a tenant that starts waiting goes within one turn of everyone waiting, no credit
//!   banked by idle time or by coming and going, one request charged at most 20,000
//!   tokens (4 quanta of 5,000); every dispatch is charged, also one that went out at
//!   once, and settled at what it really took;
//! - **the permit travels with the request**: held until the response future completes,
//!   and for an `http::Response<B>` until its body ends, fails or is dropped; dropping a
//!   waiting future takes the request out of the queue.
//!
//! A request without a [`Job`] fails with [`MissingJob`](crate::MissingJob); one refused by
//! an optional queue limit with [`QueueFull`](error::QueueFull) (the incoming request is
//! the one refused). Handed a slot gate or a rate gate
//! ([`DrrFairnessBuilder::slot_gate`], [`DrrFairnessBuilder::rate_gate`]), it dispatches a
//! request only with its tier slot and its rate cells, and tells it [`Busy`](crate::Busy)
//! at its tier's max wait; the window is then this worker's own ceiling on calls in flight:
//! set it at least to the share of the global cap this worker should be able to use. Real
//! usage, once known, is settled through a [`Settler`]. The scheduler is a sans-IO core,
//! public as [`Scheduler`]. `ARCHITECTURE.md` follows a request through this layer.
//!
//! Metrics: [`QUEUE_DEPTH`](crate::metrics::QUEUE_DEPTH) (`claude_queue_depth{priority}`)
//! and [`FAIRNESS_INDEX`](crate::metrics::FAIRNESS_INDEX)
//! (`claude_drr_fairness_index`: Jain's index over the weight-normalised cost served to the
//! tenants backlogged in the last 60 s). Every dispatch adds its cost to the tenant's served
//! cost in the [`Store`](crate::Store), so the index spans every worker.
//!
//! # Clone
//! The window and the queues are created once, in [`DrrFairnessLayer::new`](crate::DrrFairnessLayer::new); every clone of
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
//! req.extensions_mut().insert(Job::new("tenant-42", Origin::UserAction).with_tier("pro").with_cost(1_200));
//! let response = claude.oneshot(req).await?;
//! // The permit lives in the body until it is read to the end or dropped.
//! assert_eq!(fair.in_flight(), 1);
//! drop(response);
//! assert_eq!(fair.in_flight(), 0);
//! # Ok(())
//! # }
//! ```
//!
//! # Cancel safety
//! - **Dropping a waiting response future** takes the request out of its queue at once; if
//!   it had just been dispatched and not yet polled, the window permit (and the slot and
//!   rate cells the gates gave it) go back to the next in the fair order.
//! - **Dropping a response** (or reading its body to the end, or an error in it) gives the
//!   window permit back, and with it the slot a handed slot gate took.
//! - **Keeping a response without reading or dropping it holds its permit.** A caller that
//!   collects `max_in_flight` responses before reading any stalls the queue for good: read
//!   or drop each response in the task that waits for it (the gateway relays each body in
//!   a task of its own for this reason).

pub mod error;
mod fairness;
pub mod future;
#[cfg(test)]
mod gate_tests;
pub(crate) mod layer;
mod scheduler;
pub(crate) mod service;
mod state;

use std::fmt;
use std::sync::Arc;

pub use self::layer::DrrFairnessBuilder;
pub use self::scheduler::{
    ClassSelection, ClassWeights, Dispatched, Key, Rejected, Scheduler, SchedulerConfig, jain_index,
};
pub(crate) use self::service::DrrFairness;
pub use self::state::Permit;

use self::state::FairQueue;
use crate::Job;

/// Settles requests' real usage against their tenants' place in the fair order and daily
/// budgets.
///
/// Get one from [`DrrFairnessLayer::settler`](crate::DrrFairnessLayer::settler), [`DrrFairness::settler`] or
/// [`FairgateLayer::settler`](crate::FairgateLayer::settler); it is cheap to clone and
/// shares the layer's state. Call [`settle_usage`](Settler::settle_usage) with the
/// request's job (as it was sent, classified), what the call really cost in the units of
/// the job's [`charge`](Job::charge) (e.g. the response's `usage.input_tokens` plus its
/// `output_tokens` times the weight the job's output cost used), and its input tokens.
///
/// - The difference to the charge moves the tenant (and its group) later in the fair order
///   (it used more) or earlier (less), if the tenant still has requests waiting or in
///   flight in that class: the order counts what tenants really used. A refund never moves
///   it before the order's current turn; a charge never more than one largest charge past
///   it.
/// - The tenant's count for the day, which [`PriorityClassify`](crate::PriorityClassify)
///   took when it classified the job (in the [`BudgetCounts`](crate::BudgetCounts) of its
///   policy), is brought to what the call used in that unit (never below 0; batched off
///   the request path on Redis). A call the upstream refused (a `429` or `529`: it did not
///   run) is settled at 0 and 0: it counts nothing.
///
/// The served cost already recorded (for the fairness index) stays the estimate.
///
/// ```
/// use fairgate::{DrrFairnessLayer, Job, Origin, Store};
///
/// let layer = DrrFairnessLayer::new(Store::memory(), 8);
/// let settler = layer.settler();
/// // A short prompt that may write 4,000 output tokens, each weighing 5 input tokens.
/// let job = Job::new("acme", Origin::Scheduled).with_cost(1_000).with_output_cost(4_000 * 5);
/// // ... later, the response said 900 input tokens and 120 output tokens:
/// settler.settle_usage(&job, 900 + 120 * 5, 900);
/// ```
#[derive(Clone)]
pub struct Settler {
    shared: Arc<FairQueue>,
}

impl Settler {
    /// Settles `job` (as it was sent: same tenant, priority and charge) at `actual`, in the
    /// units of [`Job::charge`], and its day at `input_tokens` when the budget counts input
    /// tokens (the default) or at `actual` when it counts the weighted charge.
    pub fn settle_usage(&self, job: &Job, actual: u64, input_tokens: u64) {
        self.shared.settle(job, actual, Some(input_tokens));
    }

    /// Settles `job` at `actual` without its input tokens: the fair order as
    /// [`settle_usage`](Self::settle_usage) does, and the day only when the budget counts
    /// the weighted charge (an input-token budget keeps the estimate).
    pub fn settle(&self, job: &Job, actual: u64) {
        self.shared.settle(job, actual, None);
    }
}

impl fmt::Debug for Settler {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Settler").finish_non_exhaustive()
    }
}
