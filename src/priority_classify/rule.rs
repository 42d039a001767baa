use std::fmt;
use std::time::Duration;

use crate::{Job, Origin, Priority};

/// Decides a job's priority from what the caller said about it (origin, SLA, tier) — never
/// from a label the caller chose.
///
/// Implemented for closures, so a custom rule reads as one:
///
/// ```
/// use fairgate::{Job, Origin, Priority, PriorityClassifyLayer, Store};
///
/// let layer = PriorityClassifyLayer::new(Store::memory()).rule(|job: &Job| {
///     match (job.origin(), job.tier().map(|t| t.as_str())) {
///         (Origin::UserAction, _) => Priority::Critical,
///         (_, Some("premium")) => Priority::Standard,
///         _ => Priority::Batch,
///     }
/// });
/// # let _ = layer;
/// ```
pub trait ClassifyRule: Send + Sync + 'static {
    /// The priority of `job` before any demotion.
    fn classify(&self, job: &Job) -> Priority;
}

impl<F> ClassifyRule for F
where
    F: Fn(&Job) -> Priority + Send + Sync + 'static,
{
    fn classify(&self, job: &Job) -> Priority {
        self(job)
    }
}

/// The default rule: a user action is critical; no SLA, or one of at least a day
/// (configurable), is batch; anything else is standard.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct DefaultRule {
    batch_from: Duration,
}

impl DefaultRule {
    /// The rule with a 24 h batch threshold.
    pub const fn new() -> Self {
        DefaultRule {
            batch_from: Duration::from_secs(24 * 60 * 60),
        }
    }

    /// Jobs whose SLA is at least `sla` are batch.
    pub const fn batch_from(mut self, sla: Duration) -> Self {
        self.batch_from = sla;
        self
    }
}

impl Default for DefaultRule {
    fn default() -> Self {
        DefaultRule::new()
    }
}

impl fmt::Debug for DefaultRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DefaultRule")
            .field("batch_from", &self.batch_from)
            .finish()
    }
}

impl ClassifyRule for DefaultRule {
    fn classify(&self, job: &Job) -> Priority {
        match (job.origin(), job.sla()) {
            (Origin::UserAction, _) => Priority::Critical,
            (_, None) => Priority::Batch,
            (_, Some(sla)) if sla >= self.batch_from => Priority::Batch,
            (_, Some(_)) => Priority::Standard,
        }
    }
}
