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
//!   3); a tenant that starts waiting starts at the order's current turn and goes within
//!   one turn of everyone waiting, no credit banked by idle time; one that comes back
//!   before the order reached its last call's end comes back there, so light tenants that
//!   keep re-arriving cannot starve a backlogged one; one request is charged at most
//!   20,000 tokens (4 quanta of 5,000). A tier's share is its weight's whatever its number
//!   of tenants waiting, and its tenants share it alike, so a flood of many free users
//!   cannot outweigh the paying ones;
//! - **every dispatch is charged**, also one that went out at once because the window had
//!   room: a tenant that filled the window while nobody else waited queues behind the
//!   newcomers when others arrive. A tenant is remembered while it has requests waiting or
//!   in flight (at most `max_in_flight` of the latter), or until the order reaches the end
//!   of its last call;
//! - **the permit travels with the request**: held until the response future completes,
//!   and for an `http::Response<B>` until its body ends, fails or is dropped; dropping a
//!   waiting future takes the request out of the queue.
//!
//! A request without a [`Job`] fails with [`MissingJob`](crate::MissingJob); one refused by
//! an optional queue limit, per tenant or per class, with [`QueueFull`](error::QueueFull)
//! (the incoming request, the newest, is the one refused). Handed a slot gate or a rate gate
//! ([`DrrFairnessBuilder::slot_gate`], [`DrrFairnessBuilder::rate_gate`]), it dispatches a
//! request only with its tier slot and its rate cells, and tells it [`Busy`](crate::Busy)
//! at its tier's max wait; the window is then this worker's own ceiling on calls in flight:
//! set it at least to the share of the global cap this worker should be able to use (the
//! whole global cap for a single worker). Real usage, once known, is settled through a
//! [`Settler`]: `layer.settler().settle(&job, actual_tokens)` corrects the tenant's place;
//! the tenant is remembered while that request is in flight, so a settlement made when the
//! response arrives always counts. The scheduler is a sans-IO core, public as
//! [`Scheduler`]. `ARCHITECTURE.md` follows a request through this layer.
//!
//! Metrics: [`QUEUE_DEPTH`](crate::metrics::QUEUE_DEPTH) (`claude_queue_depth{priority}`)
//! and [`FAIRNESS_INDEX`](crate::metrics::FAIRNESS_INDEX)
//! (`claude_drr_fairness_index`: Jain's index over the weight-normalised cost served to the
//! tenants backlogged in the last 60 s). Every dispatch adds its cost to the tenant's served
//! cost in the [`Store`](crate::Store), so the index spans every worker: on Redis each
//! worker sends what it dispatched with its served counts once a second, in one script
//! call, and reads the fleet's index back, the same on every worker.
//!
//! # Across a fleet
//! Workers on one Redis, each with the recommended stack, hand out the slots in one fair
//! order for the whole fleet, not one per worker. A worker queues each *flow* it holds
//! calls of (a tenant's calls of one priority in one tier), and a freed slot anywhere goes
//! to the priority picked by fair queuing on the class weights, then to the tier in it by
//! fair queuing on the cost over the tier's weight, then to the tenant by start-time fair
//! queuing on the cost in tokens (a tenant that starts waiting starts at its tier's virtual
//! time, so it goes next; a tie between tiers goes to the heavier tier), then to the worker
//! queued longest for that tenant. The wake-up names the tenant, and that worker sends that
//! tenant's next call.
//!
//! Where the provider's request limit binds instead of the slots (learned from the
//! answers' `anthropic-ratelimit-requests-*` headers, or a configured
//! [`Pacing::shared`](crate::rate::Pacing::shared) request limit, for the layer's own
//! upstream key), its *cells* go in the same order, and so does an output-token or combined
//! token limit (learned or configured), as a bound on the calls at the average call (the
//! answers' usage; a configured pacing's expected output). A call takes its cell with its
//! slot in the acquire, a call with no cell left queues as for a full tier, and each freed
//! cell is handed out by a release, as a freed slot is. An input-token limit, learned
//! (`anthropic-ratelimit-input-tokens-*`) or configured, goes in the same order too, as a
//! token rate in the wait book: a release promises the flow the order picks only once that
//! flow's next call's cost in tokens conforms, and takes the tokens dated from then. While
//! Redis is away each worker keeps its own order, as in one process, and paces its share
//! of the rate. Nothing of the fleet's order stays in Redis once nothing waits. The
//! guide's page on the store (`docs/store.md`) has what was measured, and its known limits
//! page (`docs/limits.md`) which rates the fleet orders and how.
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
