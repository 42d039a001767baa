use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use tower::retry::budget::TpsBudget;
use tower_layer::Layer;

use super::pacing::Pacer;
use super::request::{ByClone, TypeName};
use super::{BackoffPolicy, RetryAfterBackoff};
use crate::Store;
use crate::rng::Rng;

/// Applies [`RetryAfterBackoff`] to a service.
///
/// # Clone
/// Cloning shares everything: the store, the retry budget, the pacing limiters and the
/// jitter source. Build the layer once per upstream and wrap the one client with it; a
/// layer built per route would give each route its own budget and pacing.
pub struct RetryAfterBackoffLayer<C = ByClone> {
    pub(super) shared: Arc<Shared<C>>,
}

/// What every service and future of one layer shares.
pub(super) struct Shared<C> {
    pub(super) core: Arc<Core>,
    pub(super) cloner: C,
}

pub(super) struct Core {
    pub(super) store: Store,
    pub(super) policy: BackoffPolicy,
    pub(super) budget: Option<TpsBudget>,
    pub(super) pacer: Option<Pacer>,
    rng: Mutex<Rng>,
    /// Set while the upstream is known to be at its limit (a throttle, or a limit reported
    /// exhausted) and no answer since said otherwise: calls then go one at a time (a probe),
    /// so the calls released when a gate reopens do not all meet an empty bucket. Read
    /// through `is_probing`, which ends it once `probe_ends` is past.
    probing: AtomicBool,
    /// When the probe mode ends by itself: the policy's probe timeout after the last
    /// throttle, or after this worker's release from the gate when that is later. Without
    /// it, a worker whose last answer was a throttle would send one call at a time forever
    /// (until one succeeds), however long the upstream had been quiet since.
    probe_ends: Mutex<Option<Instant>>,
    /// The one call in flight while probing: its ticket and when it took the slot. A slot
    /// older than the release spread is free again, so a slow answer (a long call that is
    /// not streamed) cannot stop the worker: it then sends one call per spread.
    probe: Mutex<Option<(u64, Instant)>>,
    tickets: AtomicU64,
    /// The gate's last known reopening and this worker's release after it (see
    /// `note_reopen`).
    release: Mutex<Option<(Instant, Instant)>>,
}

/// The probe slot, released when dropped (unless it expired and another call took it).
pub(super) struct Probe(Arc<Core>, u64);

impl Drop for Probe {
    fn drop(&mut self) {
        let mut slot = crate::sync::lock(&self.0.probe);
        if slot.is_some_and(|(ticket, _)| ticket == self.1) {
            *slot = None;
        }
    }
}

impl Core {
    /// Takes the probe slot if it is free (or its holder has had it longer than the release
    /// spread).
    pub(super) fn try_probe(self: &Arc<Self>) -> Option<Probe> {
        let now = Instant::now();
        let mut slot = crate::sync::lock(&self.probe);
        let free = slot.is_none_or(|(_, taken)| {
            now.saturating_duration_since(taken) >= self.policy.release_spread
        });
        if !free {
            return None;
        }
        let ticket = self.tickets.fetch_add(1, Ordering::Relaxed);
        *slot = Some((ticket, now));
        Some(Probe(self.clone(), ticket))
    }

    /// Notes that the gate reopens in `left` and returns when this worker's first call may
    /// go after it: the reopening plus the worker's own random offset into the release
    /// window (one draw per reopening, so the workers' first calls are spread out).
    pub(super) fn note_reopen(&self, left: Duration) -> Instant {
        let now = Instant::now();
        let reopen = now + left;
        let mut release = crate::sync::lock(&self.release);
        match *release {
            // The same reopening (give or take a millisecond of clock reading), or an
            // earlier one than already known: the release stands.
            Some((known, at)) if reopen <= known + Duration::from_millis(1) => at,
            _ => {
                let at = reopen + self.policy.spread_for(left).mul_f64(self.unit());
                *release = Some((reopen, at));
                at
            }
        }
    }

    /// How long a call held by a gate reopening in `left` waits: until this worker's release,
    /// plus a draw of its own over the window.
    pub(super) fn release_after(&self, left: Duration) -> Duration {
        let at = self.note_reopen(left);
        let window = self.policy.spread_for(left);
        at.saturating_duration_since(Instant::now()) + window.mul_f64(self.unit())
    }

    /// How long until this worker's release after the last reopening, if it is still ahead.
    pub(super) fn release_in(&self) -> Option<Duration> {
        let release = crate::sync::lock(&self.release);
        let (_, at) = (*release)?;
        Some(at.saturating_duration_since(Instant::now())).filter(|d| !d.is_zero())
    }

    /// The pacing that goes through the store, if any.
    pub(super) fn shared_pacing(&self) -> Option<&super::Pacing> {
        self.policy
            .pacing
            .as_ref()
            .filter(|pacing| pacing.is_shared())
    }

    /// Whether calls go one at a time: the upstream was at its limit, no answer has said
    /// otherwise since, and the probe timeout has not run out.
    pub(super) fn is_probing(&self) -> bool {
        if !self.probing.load(Ordering::Acquire) {
            return false;
        }
        let mut ends = crate::sync::lock(&self.probe_ends);
        if ends.is_some_and(|at| Instant::now() >= at) {
            // Quiet for the whole timeout: back to calls side by side.
            *ends = None;
            self.probing.store(false, Ordering::Release);
            return false;
        }
        true
    }

    /// Notes what the last answer (or a closed gate) said about the upstream: at its limit,
    /// so calls go one at a time until `release` (this worker's release from the gate, if
    /// any) plus the probe timeout, unless an answer shows room first; or not.
    pub(super) fn note_at_limit(&self, at_limit: bool, release: Option<Instant>) {
        let mut ends = crate::sync::lock(&self.probe_ends);
        if at_limit {
            let from = release.map_or_else(Instant::now, |at| at.max(Instant::now()));
            let until = from + self.policy.probe_timeout;
            // Only later: a second throttle never shortens the first one's quiet interval.
            *ends = Some(ends.map_or(until, |known| known.max(until)));
        } else {
            *ends = None;
        }
        self.probing.store(at_limit, Ordering::Release);
    }

    /// A uniform draw in [0, 1) from the layer's seeded source.
    pub(super) fn unit(&self) -> f64 {
        crate::sync::lock(&self.rng).unit()
    }
}

impl RetryAfterBackoffLayer {
    /// A layer retrying by `policy`, recording throttles and the cooldown gate in `store`.
    /// Requests are cloned with `Clone` for a retry (see
    /// [`clone_requests_with`](RetryAfterBackoffLayer::clone_requests_with)).
    pub fn new(store: Store, policy: BackoffPolicy) -> Self {
        let budget = policy
            .budget
            .map(|b| TpsBudget::new(b.ttl, b.min_per_sec, b.retry_percent));
        let pacer = policy
            .pacing
            .as_ref()
            .filter(|pacing| !pacing.is_shared())
            .map(Pacer::new);
        let rng = policy.seed.map_or_else(Rng::from_entropy, Rng::seeded);
        RetryAfterBackoffLayer {
            shared: Arc::new(Shared {
                core: Arc::new(Core {
                    store,
                    policy,
                    budget,
                    pacer,
                    rng: Mutex::new(rng),
                    probing: AtomicBool::new(false),
                    probe_ends: Mutex::new(None),
                    probe: Mutex::new(None),
                    tickets: AtomicU64::new(0),
                    release: Mutex::new(None),
                }),
                cloner: ByClone,
            }),
        }
    }
}

impl<C> RetryAfterBackoffLayer<C> {
    /// Replaces how requests are copied for a retry (a [`CloneRequest`](super::CloneRequest):
    /// [`SendOnce`](super::SendOnce), or a closure `Fn(&Req) -> Option<Req>`). Keeps the
    /// budget and pacing state.
    pub fn clone_requests_with<C2>(self, cloner: C2) -> RetryAfterBackoffLayer<C2> {
        RetryAfterBackoffLayer {
            shared: Arc::new(Shared {
                core: self.shared.core.clone(),
                cloner,
            }),
        }
    }

    /// The policy.
    pub fn policy(&self) -> &BackoffPolicy {
        &self.shared.core.policy
    }
}

impl<C> Clone for RetryAfterBackoffLayer<C> {
    fn clone(&self) -> Self {
        RetryAfterBackoffLayer {
            shared: self.shared.clone(),
        }
    }
}

impl<C> fmt::Debug for RetryAfterBackoffLayer<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetryAfterBackoffLayer")
            .field("store", &self.shared.core.store)
            .field("policy", &self.shared.core.policy)
            .field("cloner", &TypeName::<C>::new())
            .finish()
    }
}

impl<S, C> Layer<S> for RetryAfterBackoffLayer<C> {
    type Service = RetryAfterBackoff<S, C>;

    fn layer(&self, inner: S) -> Self::Service {
        RetryAfterBackoff {
            inner,
            shared: self.shared.clone(),
        }
    }
}
