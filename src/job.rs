//! What every request carries: who it is for, where it comes from, and what it costs.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::labels::{Priority, TenantId, Tier};

/// What caused a request: the only priority input a caller gives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Origin {
    /// A person is waiting for the answer (a chat message, a button).
    UserAction,
    /// Periodic work: review replies, summaries.
    Scheduled,
    /// Bulk work with no one waiting.
    BatchJob,
}

/// The metadata every request carries through the layers.
///
/// Built by the caller (server-side code, never the end user), put into the request's
/// extensions. Each `with_*` method sets one field and the method of the same word reads it
/// back (`with_tier` / `tier`, `with_cost` / `cost`). The priority is read-only: only
/// [`PriorityClassify`](crate::PriorityClassify) sets it, so a caller cannot label its own
/// work critical.
///
/// ```
/// use fairgate::{Job, Origin};
/// use std::time::Duration;
///
/// let job = Job::new("tenant-42", Origin::Scheduled)
///     .with_tier("pro")
///     .with_sla(Duration::from_secs(600))
///     .with_input_text("Summarise this week's reviews.");
/// assert_eq!(job.tenant().as_str(), "tenant-42");
/// assert_eq!(job.cost(), 9);         // ceil(30 chars / 3.5)
/// assert_eq!(job.priority(), None); // not classified yet
/// ```
///
/// # What a job is charged
/// The fair queue's deficit and the tenant's daily budget are charged the job's
/// [`charge`](Job::charge): its estimated input tokens plus its
/// [`output_cost`](Job::output_cost), the output it may produce counted in input tokens.
/// Providers limit output tokens more tightly than input (Anthropic's output-token limit is
/// commonly a fifth of the input-token one), and an answer holds its slot while it is
/// written, so a call asking for a long answer costs more than its prompt says:
///
/// ```
/// use fairgate::{Job, Origin};
///
/// // A short prompt asking for up to 4,096 tokens, each weighing 5 input tokens.
/// let job = Job::new("tenant-42", Origin::UserAction).with_cost(300).with_output_cost(4_096 * 5);
/// assert_eq!(job.cost(), 300);
/// assert_eq!(job.charge(), 20_780);
/// ```
///
/// The charge is an estimate; the answer's real usage settles it (see
/// [`Settler`](crate::drr_fairness::Settler)).
///
/// There is no way to set the priority from outside the crate:
///
/// ```compile_fail
/// use fairgate::{Job, Origin, Priority};
/// let mut job = Job::new("t", Origin::BatchJob);
/// job.set_priority(Priority::Critical);
/// ```
#[derive(Clone, Debug)]
pub struct Job {
    tenant: TenantId,
    origin: Origin,
    sla: Option<Duration>,
    tier: Option<Tier>,
    /// The group its tenant is fair-queued in inside its tier (a service and its users).
    group: Option<TenantId>,
    cost: u32,
    /// The output the call may produce, in input-token units (0: not counted).
    output: u32,
    priority: Option<Priority>,
    /// When the request entered the first fairgate layer: every wait counts from here.
    arrived: Option<Instant>,
    /// What the layers hand one another about this request.
    handoff: Handoff,
}

impl Job {
    /// A job for `tenant` caused by `origin`, with no SLA, no tier and a cost of 1 token.
    pub fn new(tenant: impl Into<TenantId>, origin: Origin) -> Self {
        Job {
            tenant: tenant.into(),
            origin,
            sla: None,
            tier: None,
            group: None,
            cost: 1,
            output: 0,
            priority: None,
            arrived: None,
            handoff: Handoff::default(),
        }
    }

    /// Sets the plan the tenant is on (`premium`, `pro`, `free`, `guest`, ...).
    pub fn with_tier(mut self, tier: impl Into<Tier>) -> Self {
        self.tier = Some(tier.into());
        self
    }

    /// Puts the job's tenant in `group` (a service, whose end users are its tenants): inside
    /// a tier, the fair queue is fair first across groups, each one share of the tier, then
    /// across a group's tenants by DRR. A service with 1,000 waiting users and one with a
    /// single user then get one share each, not 1,000 to 1. Jobs without a group share one
    /// group of their tier, as before.
    ///
    /// Name groups by what holds a key (a service, a team), never by end user: each group
    /// of each tier is kept for the life of the layer in an in-process store. On Redis the
    /// fleet's order keeps the same two levels across every worker (start-time fair
    /// queuing on the cost at both: groups, then a group's tenants), and there a job with
    /// no group is a group of its own.
    ///
    /// ```
    /// use fairgate::{Job, Origin};
    ///
    /// let job = Job::new("companion-app/4f2a", Origin::UserAction).with_group("companion-app");
    /// assert_eq!(job.group().unwrap().as_str(), "companion-app");
    /// ```
    pub fn with_group(mut self, group: impl Into<TenantId>) -> Self {
        self.group = Some(group.into());
        self
    }

    /// The group the job's tenant is fair-queued in, if set ([`Job::with_group`]).
    pub fn group(&self) -> Option<&TenantId> {
        self.group.as_ref()
    }

    /// Sets how soon an answer is needed.
    pub fn with_sla(mut self, within: Duration) -> Self {
        self.sla = Some(within);
        self
    }

    /// Sets the estimated input tokens exactly (e.g. from a token-counting call). A cost of 0
    /// counts as 1: every call costs something.
    pub fn with_cost(mut self, tokens: u32) -> Self {
        self.cost = tokens.max(1);
        self
    }

    /// Sets the output the call may produce, counted in input tokens: the most output
    /// tokens it may use (the request's `max_tokens`) times the weight of an output token
    /// against an input token (e.g. 5 where the output-token limit is a fifth of the
    /// input-token one). Default 0: only the input is charged.
    ///
    /// The fair queue charges one call at most `quantum × max_charge_quanta` (by default
    /// 5,000 × 4 = 20,000) before it goes: to charge long answers whole, raise
    /// [`max_charge_quanta`](crate::drr_fairness::DrrFairnessBuilder::max_charge_quanta)
    /// to cover the longest calls (the gateway covers 400,000).
    pub fn with_output_cost(mut self, tokens: u32) -> Self {
        self.output = tokens;
        self
    }

    /// Estimates the input tokens from the prompt text: ceil(chars / 3.5), at least 1.
    pub fn with_input_text(mut self, text: &str) -> Self {
        let chars = text.chars().count() as u64;
        let tokens = (chars * 2).div_ceil(7).max(1);
        self.cost = u32::try_from(tokens).unwrap_or(u32::MAX);
        self
    }

    /// Who the job is for.
    pub fn tenant(&self) -> &TenantId {
        &self.tenant
    }

    /// What caused the job.
    pub fn origin(&self) -> Origin {
        self.origin
    }

    /// How soon an answer is needed; `None` means whenever.
    pub fn sla(&self) -> Option<Duration> {
        self.sla
    }

    /// The tenant's plan, if the caller set one.
    pub fn tier(&self) -> Option<&Tier> {
        self.tier.as_ref()
    }

    /// Estimated input tokens (at least 1).
    pub fn cost(&self) -> u32 {
        self.cost
    }

    /// The output the call may produce, in input tokens (see [`with_output_cost`](Job::with_output_cost)).
    pub fn output_cost(&self) -> u32 {
        self.output
    }

    /// What the fair queue and the daily budget charge for the job until its usage is
    /// known: the estimated input tokens plus the output cost.
    pub fn charge(&self) -> u64 {
        u64::from(self.cost) + u64::from(self.output)
    }

    /// The class decided by `PriorityClassify`; `None` before it ran.
    pub fn priority(&self) -> Option<Priority> {
        self.priority
    }

    pub(crate) fn set_priority(&mut self, priority: Priority) {
        self.priority = Some(priority);
    }

    /// Records what the classifier counted toward the tenant's day.
    pub(crate) fn set_budget_counted(&mut self, counts: crate::BudgetCounts, tokens: u64) {
        self.handoff.budget_counted = Some((counts, tokens));
    }

    /// What the classifier counted toward the tenant's day; `None` when none ran.
    pub(crate) fn budget_counted(&self) -> Option<(crate::BudgetCounts, u64)> {
        self.handoff.budget_counted
    }

    /// When the request entered the first fairgate layer; `None` before any layer saw it.
    ///
    /// Every layer's waits count from this one instant: a tier's max wait is end to end,
    /// wherever in the stack the request waited.
    pub fn arrived_at(&self) -> Option<Instant> {
        self.arrived
    }

    /// The arrival, stamped now by the first layer that asks.
    pub(crate) fn arrival(&mut self) -> Instant {
        *self.arrived.get_or_insert_with(Instant::now)
    }

    /// The arrival, stamped `now` (the caller's clock read) if no layer stamped it yet.
    pub(crate) fn arrival_or(&mut self, now: Instant) -> Instant {
        *self.arrived.get_or_insert(now)
    }

    /// Starts the clock again: a retry is a new attempt, its waits count from now.
    pub(crate) fn restamp(&mut self) {
        self.arrived = Some(Instant::now());
        self.handoff.slot_held = None;
    }

    /// The upstream key and receipt cell of the next attempt (the retry layer, when the
    /// fair queue below holds its rate gate).
    pub(crate) fn set_attempt(&mut self, upstream: Arc<str>, cell: crate::gate::AttemptCell) {
        self.handoff.upstream = Some(upstream);
        self.handoff.attempt = Some(cell);
        self.handoff.route = None;
    }

    /// The upstream of a pool a rate gate over it chose for this attempt, with its place.
    pub(crate) fn set_route(&mut self, route: Arc<crate::gate::Route>) {
        self.handoff.route = Some(route);
    }

    /// Where a rate gate over a pool routed this attempt, if one did.
    pub(crate) fn route(&self) -> Option<&crate::gate::Route> {
        self.handoff.route.as_deref()
    }

    /// The upstream key the retry layer chose for this attempt, if it did.
    pub(crate) fn upstream(&self) -> Option<&Arc<str>> {
        self.handoff.upstream.as_ref()
    }

    /// Where the fair queue puts what the attempt took from the rate gate.
    pub(crate) fn attempt_cell(&self) -> Option<&crate::gate::AttemptCell> {
        self.handoff.attempt.as_ref()
    }

    /// Whether a layer outside the one asking already holds a slot of `gate` for this
    /// request (a slot of another gate counts against other caps).
    pub(crate) fn slot_held_by(&self, gate: &crate::SlotGate) -> bool {
        self.handoff
            .slot_held
            .as_ref()
            .is_some_and(|held| held.same(gate))
    }

    /// Says that the request holds (or will hold before it goes further) a slot of `gate`.
    pub(crate) fn mark_slot_held_by(&mut self, gate: &crate::SlotGate) {
        self.handoff.slot_held = Some(gate.clone());
    }

    /// Says that a fair queue with no slot gate dispatched the request.
    pub(crate) fn mark_fair_queued_ungated(&mut self) {
        self.handoff.fair_queued_ungated = true;
    }

    /// Whether a fair queue with no slot gate dispatched the request.
    pub(crate) fn fair_queued_ungated(&self) -> bool {
        self.handoff.fair_queued_ungated
    }
}

/// What one layer hands the next about a request, beside what the caller said: written by
/// an outer layer, read by an inner one, never seen outside the crate. Cloning a [`Job`]
/// clones it too (a retried request carries what its first attempt was handed, until
/// [`Job::restamp`] and [`Job::set_attempt`] renew it).
#[derive(Clone, Debug, Default)]
pub(crate) struct Handoff {
    /// The slot gate an outer layer already took (or will take) this request's slot from.
    slot_held: Option<crate::SlotGate>,
    /// The upstream key of the next attempt, as the retry layer chose it: the rate gate
    /// the fair queue consults for it.
    upstream: Option<Arc<str>>,
    /// Where the fair queue below puts what the attempt took from the rate gate.
    attempt: Option<crate::gate::AttemptCell>,
    /// The upstream of a pool the fair queue's rate gate chose for the attempt.
    route: Option<Arc<crate::gate::Route>>,
    /// A fair queue above dispatched it without a slot gate: a slot layer below that waits
    /// for its slot then loses the fair order (and says so once).
    fair_queued_ungated: bool,
    /// What the classifier counted toward its tenant's daily budget, and in which unit:
    /// the settler corrects the day by it.
    budget_counted: Option<(crate::BudgetCounts, u64)>,
}

/// A request type that can carry a [`Job`].
///
/// Implemented for `http::Request<B>` (the job lives in its extensions); implement it for
/// your own request type to use the layers with, say, a tonic or a custom client.
#[diagnostic::on_unimplemented(
    message = "`{Self}` carries no fairgate `Job`",
    label = "the layers cannot find this request's job",
    note = "use `http::Request<B>` with a `Job` in its extensions (or a `JobLayer` in front), or implement `fairgate::JobRequest` for your request type"
)]
pub trait JobRequest {
    /// The job, if the request carries one.
    fn job(&self) -> Option<&Job>;
    /// The job, mutably, if the request carries one.
    fn job_mut(&mut self) -> Option<&mut Job>;
}

impl<B> JobRequest for http::Request<B> {
    fn job(&self) -> Option<&Job> {
        self.extensions().get::<Job>()
    }

    fn job_mut(&mut self) -> Option<&mut Job> {
        self.extensions_mut().get_mut::<Job>()
    }
}
