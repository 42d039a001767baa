//! One upstream key's rate-gate state in this worker, as the rate gate (`gate.rs`) keeps
//! it for the fair queue below.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::hash::HashMap;
use crate::store::DIMS;

/// One upstream key's gate state in this worker.
#[derive(Debug, Default)]
pub(crate) struct KeyGate {
    /// Cells taken ahead for the next call to go, usable from their time.
    pub(crate) ready: Option<Ready>,
    /// A reservation is on its way to the store.
    pub(crate) asking: bool,
    /// Another call (in another worker) is probing the key: ask again then, or at the next
    /// answer.
    pub(crate) hold_until: Option<Instant>,
    /// This worker's probe is out: nobody else goes until its answer.
    pub(crate) probing: bool,
    /// When this worker first found the key cold (no answer yet): slow start holds the
    /// other calls for at most `slow_start_max` from then.
    pub(crate) cold_since: Option<Instant>,
    /// Configured pacing in process: the dimensions already taken for the next call.
    pub(crate) pace_step: usize,
    /// Configured pacing through the store: reserved for the next call, usable from then.
    pub(crate) paced: Option<Instant>,
    pub(crate) pacing_asking: bool,
}

#[derive(Debug)]
pub(crate) struct Ready {
    pub(crate) due: Instant,
    pub(crate) cost: u32,
    pub(crate) need: [u32; DIMS],
    pub(crate) charged: [u32; DIMS],
    pub(crate) probe: bool,
}

/// How late cells may be taken and still count as taken when they were due: a timer's
/// lateness, which the pacing's headroom absorbs; not a caller's wait.
const STALE_AFTER: Duration = Duration::from_millis(10);

impl Ready {
    /// Reserved cells (not a probe, not nothing) whose time is long past.
    pub(crate) fn is_stale(&self, now: Instant) -> bool {
        !self.probe
            && self.charged.iter().any(|c| *c > 0)
            && now.saturating_duration_since(self.due) > STALE_AFTER
    }
}

/// The per-key gates of one layer.
pub(crate) type KeyGates = HashMap<Arc<str>, KeyGate>;
