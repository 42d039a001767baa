//! One `tracing` span per call through the layers: who it was for, what it waited for and
//! how long, its attempts and its upstream.
//!
//! [`PriorityClassify`](crate::PriorityClassify), the outermost layer of the recommended
//! stack, opens the span when a call enters and closes it when the call's outcome is known
//! (the response's head, or the error). The span is a `DEBUG` span named `fairgate.call`
//! with the target [`CALL_TARGET`]; its fields:
//!
//! | field | value |
//! |---|---|
//! | `tenant` | the job's tenant, as the caller named it (the gateway names an end user by a keyed hash, `service/<hex>`) |
//! | `tier` | the job's tier, `""` when unset |
//! | `class` | the priority the classifier gave: `critical`, `standard`, `batch` |
//! | `waited_ms` | the time waited in the layers, all reasons together |
//! | `wait_slot_ms`, `wait_rate_ms`, `wait_cooldown_ms`, `wait_store_ms` | that time by reason (a slot or a place in the fair queue's window; the provider's rate; the cooldown gate after a 429 and a retry's backoff; a round trip to the store) |
//! | `wait_reason` | the reason waited for longest, `none` when the call did not wait |
//! | `attempts` | attempts sent upstream (retries included) |
//! | `upstream` | the upstream key of the last attempt (API keys appear hashed) |
//! | `status` | the HTTP status of the last answer, 0 when none came |
//! | `outcome` | `answered`, `refused` (a [`Rejection`](crate::reject::Rejection)) or `failed` |
//!
//! Each wait is also an event (target [`WAIT_TARGET`], fields `reason` and `waited_ms`)
//! inside the span.
//!
//! # Cost when nobody listens
//! The span is created only when a subscriber enables its callsite (`tracing` caches that
//! answer per callsite): with none, a call pays one check of that cache, and its outermost
//! future carries an empty 4-byte number. BENCHMARKS.md has the count.

use std::cell::RefCell;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use tracing::Span;
use tracing::field::Empty;

use crate::admission::WaitReason;
use crate::labels::Priority;
use crate::metrics::Outcome;

/// The target of the call span (`RUST_LOG=fairgate::call=debug` enables it).
pub const CALL_TARGET: &str = "fairgate::call";
/// The target of the wait events inside the call span.
pub const WAIT_TARGET: &str = "fairgate::wait";

/// Whether a call span was ever opened in this process: until one is, the layers below the
/// classifier look for no trace on a request (one load instead of a look-up).
static CALLS_TRACED: AtomicBool = AtomicBool::new(false);

/// Whether any call may carry a trace.
#[inline]
pub(crate) fn calls_traced() -> bool {
    CALLS_TRACED.load(Ordering::Relaxed)
}

thread_local! {
    /// The trace of the call whose outermost future (or `call`) runs on this thread now:
    /// the layers below tell it what they wait for, as `tracing` finds the current span.
    static CURRENT: RefCell<Option<Arc<CallTrace>>> = const { RefCell::new(None) };
}

/// Runs `f` with the trace of the call running on this thread, if it has one.
#[inline]
pub(crate) fn with_current(f: impl FnOnce(&CallTrace)) {
    if !calls_traced() {
        return;
    }
    CURRENT.with_borrow(|current| {
        if let Some(trace) = current {
            f(trace);
        }
    });
}

/// While it lives, the call's trace is this thread's current one; dropped, the previous
/// one is again.
pub(crate) struct Entered {
    previous: Option<Arc<CallTrace>>,
}

impl Drop for Entered {
    fn drop(&mut self) {
        let previous = self.previous.take();
        CURRENT.set(previous);
    }
}

/// What the layers tell about one call while its span is open, read once when the call's
/// outcome is known.
#[derive(Debug)]
pub(crate) struct CallTrace {
    /// The call's span: the wait events name it as their parent, so they belong to the
    /// call whichever task polls the layer that waited.
    span: Span,
    /// Microseconds waited, by [`WaitReason`] (in the order of `WaitReason::ALL`).
    waits: [AtomicU64; 4],
    attempts: AtomicU32,
    status: AtomicU16,
    upstream: Mutex<Option<Arc<str>>>,
}

impl CallTrace {
    /// The call waited `waited` for `reason`.
    pub(crate) fn waited(&self, reason: WaitReason, waited: Duration) {
        let micros = u64::try_from(waited.as_micros()).unwrap_or(u64::MAX);
        self.waits[reason_index(reason)].fetch_add(micros, Ordering::Relaxed);
        tracing::debug!(
            target: WAIT_TARGET,
            parent: &self.span,
            reason = reason.as_str(),
            waited_ms = millis(micros),
            "waited"
        );
    }

    /// An attempt sent to `upstream` ended: answered with `status`, or failed (`None`).
    pub(crate) fn attempted(&self, upstream: &Arc<str>, status: Option<http::StatusCode>) {
        self.attempts.fetch_add(1, Ordering::Relaxed);
        self.status
            .store(status.map_or(0, |s| s.as_u16()), Ordering::Relaxed);
        let mut named = self.upstream.lock().unwrap_or_else(|e| e.into_inner());
        if named
            .as_ref()
            .is_none_or(|named| !Arc::ptr_eq(named, upstream))
        {
            *named = Some(upstream.clone());
        }
    }

    /// Writes what was told on the span, with the call's `class` and `outcome`.
    fn record(&self, class: Option<Priority>, outcome: Outcome) {
        let span = &self.span;
        let micros = self.waits.each_ref().map(|w| w.load(Ordering::Relaxed));
        let total: u64 = micros.iter().fold(0, |sum, m| sum.saturating_add(*m));
        let longest = (0..micros.len())
            .filter(|&i| micros[i] > 0)
            .max_by_key(|&i| micros[i])
            .map_or("none", |i| WaitReason::ALL[i].as_str());
        if let Some(class) = class {
            span.record("class", class.as_str());
        }
        span.record("waited_ms", millis(total));
        for (field, micros) in WAIT_FIELDS.iter().zip(micros) {
            span.record(*field, millis(micros));
        }
        span.record("wait_reason", longest);
        // A stack without the retry layer sends each call once.
        let attempts = self.attempts.load(Ordering::Relaxed);
        let sent = matches!(outcome, Outcome::Answered);
        span.record("attempts", attempts.max(u32::from(sent)));
        if let Some(upstream) = self
            .upstream
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_deref()
        {
            span.record("upstream", upstream);
        }
        span.record("status", self.status.load(Ordering::Relaxed));
        span.record("outcome", outcome.as_str());
    }
}

/// The span fields of the waits by reason, in the order of `WaitReason::ALL`.
const WAIT_FIELDS: [&str; 4] = [
    "wait_slot_ms",
    "wait_rate_ms",
    "wait_cooldown_ms",
    "wait_store_ms",
];

fn reason_index(reason: WaitReason) -> usize {
    match reason {
        WaitReason::Slot => 0,
        WaitReason::Rate => 1,
        WaitReason::Cooldown => 2,
        WaitReason::Store => 3,
    }
}

/// Microseconds as fractional milliseconds.
fn millis(micros: u64) -> f64 {
    micros as f64 / 1_000.0
}

/// The traces of the calls whose span is open, by the number their outermost future
/// keeps: four bytes, which fit in that future's padding (it moves with every poll of the
/// stack, so a pointer more would cost every call, traced or not).
static OPEN: Mutex<OpenTraces> = Mutex::new(OpenTraces {
    traces: Vec::new(),
    free: Vec::new(),
});

struct OpenTraces {
    traces: Vec<Option<Arc<CallTrace>>>,
    free: Vec<u32>,
}

fn open_traces() -> std::sync::MutexGuard<'static, OpenTraces> {
    OPEN.lock().unwrap_or_else(|e| e.into_inner())
}

impl OpenTraces {
    /// Keeps `trace`; `None` past `u32::MAX` open at once (the call goes untraced).
    fn insert(&mut self, trace: Arc<CallTrace>) -> Option<NonZeroU32> {
        let index = match self.free.pop() {
            Some(index) => index,
            None => {
                let index = u32::try_from(self.traces.len())
                    .ok()
                    .filter(|i| *i < u32::MAX)?;
                self.traces.push(None);
                index
            }
        };
        self.traces[index as usize] = Some(trace);
        NonZeroU32::new(index + 1)
    }

    fn get(&self, slot: NonZeroU32) -> Option<&Arc<CallTrace>> {
        self.traces.get(slot.get() as usize - 1)?.as_ref()
    }

    fn remove(&mut self, slot: NonZeroU32) -> Option<Arc<CallTrace>> {
        let index = slot.get() - 1;
        let trace = self.traces.get_mut(index as usize)?.take();
        if trace.is_some() {
            self.free.push(index);
        }
        trace
    }
}

/// One call's span and what the layers tell about it, held by the call's outermost future
/// (a number in [`OPEN`]); empty when nobody listens. Dropped before the call ended (the
/// caller gave up), the span closes with no outcome.
#[derive(Debug, Default)]
pub(crate) struct CallSpan {
    slot: Option<NonZeroU32>,
}

impl CallSpan {
    /// Whether a subscriber wants call spans: the callsite's cached interest, so with none
    /// this is the whole cost of tracing a call. Asked before anything of the span is made:
    /// a value to drop held across the inner service's `call` costs every call a move of
    /// its future.
    #[inline]
    pub(crate) fn wanted() -> bool {
        tracing::enabled!(target: CALL_TARGET, tracing::Level::DEBUG)
    }

    /// Opens the span of a call for `job` (when [`CallSpan::wanted`]).
    #[cold]
    pub(crate) fn open(job: &crate::Job) -> CallSpan {
        let tier = job.tier().map_or("", |tier| tier.as_str());
        let span = tracing::debug_span!(
            target: CALL_TARGET,
            "fairgate.call",
            tenant = job.tenant().as_str(),
            tier,
            class = Empty,
            waited_ms = Empty,
            wait_slot_ms = Empty,
            wait_rate_ms = Empty,
            wait_cooldown_ms = Empty,
            wait_store_ms = Empty,
            wait_reason = Empty,
            attempts = Empty,
            upstream = Empty,
            status = Empty,
            outcome = Empty,
        );
        if span.is_disabled() {
            return CallSpan::default();
        }
        let trace = Arc::new(CallTrace {
            span,
            waits: Default::default(),
            attempts: AtomicU32::new(0),
            status: AtomicU16::new(0),
            upstream: Mutex::new(None),
        });
        CALLS_TRACED.store(true, Ordering::Relaxed);
        CallSpan {
            slot: open_traces().insert(trace),
        }
    }

    /// Makes the call's trace this thread's current one while the guard lives: the layers
    /// below, polled inside the call's future, tell it their waits.
    #[inline]
    pub(crate) fn enter(&self) -> Option<Entered> {
        let slot = self.slot?;
        let trace = open_traces().get(slot).cloned();
        let previous = CURRENT.replace(trace);
        Some(Entered { previous })
    }

    /// The call waited `waited` for `reason` (the classifier's own round trip).
    pub(crate) fn waited(&self, reason: WaitReason, waited: Duration) {
        if self.slot.is_some() {
            with_current(|trace| trace.waited(reason, waited));
        }
    }

    /// The call ended with `outcome`: its fields are written and the span closes.
    #[inline]
    pub(crate) fn close(&mut self, class: Option<Priority>, outcome: impl FnOnce() -> Outcome) {
        if let Some(slot) = self.slot.take()
            && let Some(trace) = open_traces().remove(slot)
        {
            trace.record(class, outcome());
        }
    }
}

impl Drop for CallSpan {
    fn drop(&mut self) {
        if let Some(slot) = self.slot.take() {
            drop(open_traces().remove(slot));
        }
    }
}

/// Tells the trace of the call running on this thread, if any, that it waited.
pub(crate) fn waited(reason: WaitReason, waited: Duration) {
    with_current(|trace| trace.waited(reason, waited));
}
