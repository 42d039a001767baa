//! One upstream key's rate-gate state in this worker, as the rate gate (`gate.rs`) keeps
//! it for the fair queue below.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::hash::HashMap;
use crate::store::DIMS;

/// One upstream key's gate state in this worker.
#[derive(Debug, Default)]
pub(super) struct KeyGate {
    /// Cells taken ahead for the next call to go, usable from their time.
    pub(super) ready: Option<Ready>,
    /// A reservation is on its way to the store.
    pub(super) asking: bool,
    /// Another call (in another worker) is probing the key: ask again then, or at the next
    /// answer.
    pub(super) hold_until: Option<Instant>,
    /// This worker's probe is out: nobody else goes until its answer.
    pub(super) probing: bool,
    /// When this worker first found the key cold (no answer yet): slow start holds the
    /// other calls for at most `slow_start_max` from then.
    pub(super) cold_since: Option<Instant>,
    /// Configured pacing in process: the dimensions already taken for the next call.
    pub(super) pace_step: usize,
    /// Configured pacing through the store: reserved for the next call, usable from then.
    pub(super) paced: Option<Instant>,
    pub(super) pacing_asking: bool,
}

#[derive(Debug)]
pub(super) struct Ready {
    pub(super) due: Instant,
    pub(super) cost: u32,
    pub(super) need: [u32; DIMS],
    pub(super) charged: [u32; DIMS],
    pub(super) probe: bool,
}

/// How late cells may be taken and still count as taken when they were due: a timer's
/// lateness, which the pacing's headroom absorbs; not a caller's wait.
const STALE_AFTER: Duration = Duration::from_millis(10);

impl Ready {
    /// Reserved cells (not a probe, not nothing) whose time is long past.
    pub(super) fn is_stale(&self, now: Instant) -> bool {
        !self.probe
            && self.charged.iter().any(|c| *c > 0)
            && now.saturating_duration_since(self.due) > STALE_AFTER
    }
}

/// The per-key gates of one layer.
pub(super) type KeyGates = HashMap<Arc<str>, KeyGate>;
