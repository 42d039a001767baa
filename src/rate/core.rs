//! The rate of one layer's upstream keys, shared by the retry layer's services, futures
//! and rate gate: the store, pacing, and this worker's view of each upstream key.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use super::key_gate::KeyGates;
use super::learned::{self, View, Views};
use super::pacing::{Pacer, Pacing};
use crate::Store;
use crate::hash::HashMap;
use crate::rng::Rng;
use crate::store::{
    DIMS, FleetCells, INPUT, OUTPUT, PaceAsk, PaceGrant, REQUESTS, TOTAL, learned_rate,
};

/// What the rate of a layer's upstream keys is made of, from the retry layer's
/// policy (`BackoffPolicy::rate_config`).
#[derive(Clone, Debug)]
pub(crate) struct RateConfig {
    /// The layer's own upstream key: that of a request that names none.
    pub(crate) upstream: Arc<str>,
    /// Configured pacing, in process or shared through the store.
    pub(crate) pacing: Option<Pacing>,
    /// The seed of the draws (release offsets, and the retry layer's jitter); `None`: from
    /// entropy.
    pub(crate) seed: Option<u64>,
    /// The probe's lease, and what a held call's poll is sized from.
    pub(crate) release_spread: Duration,
    /// How long after a throttle calls go one probe at a time.
    pub(crate) probe_timeout: Duration,
    /// Whether the answers' rate-limit headers pace the calls.
    pub(crate) learned_pacing: bool,
    /// Thousandths of each learned rate aimed at.
    pub(crate) learned_headroom: u32,
    /// Whether a success's usage corrects what its call was charged.
    pub(crate) usage_correction: bool,
    /// How long slow start holds the calls of a key no answer has told of, at most.
    pub(crate) slow_start_max: Duration,
}

impl RateConfig {
    /// The release window after a reopening `left` away: a fifth of it (at least 1 ms), so
    /// the spread scales with the server's delay.
    pub(super) fn spread_for(&self, left: Duration) -> Duration {
        (left / 5).max(Duration::from_millis(1))
    }

    /// How often a call held behind another's probe asks again, at most: an eighth of the
    /// probe lease, between 10 ms and 250 ms.
    fn poll_interval(&self) -> Duration {
        (self.release_spread / 8).clamp(Duration::from_millis(10), Duration::from_millis(250))
    }
}

/// The rate of one layer's upstream keys: the store, pacing, and this worker's view of
/// each key. The retry layer feeds it what the answers said (`feed.rs`, `usage.rs`) and
/// waits for it when it works alone; a fair queue below consults it as a
/// [`RateGate`](crate::RateGate) (`gate.rs`).
pub(crate) struct Rates {
    pub(super) store: Store,
    pub(super) config: RateConfig,
    pub(crate) pacer: Option<Pacer>,
    rng: Mutex<Rng>,
    /// This worker's view of each upstream key's learned bucket.
    views: Mutex<Views>,
    /// Views that are not quiet (see `View::is_quiet`): while none is, an answer without
    /// rate-limit headers is noted without the lock.
    loud: AtomicUsize,
    /// The view of the layer's own upstream key exists (the common, one-key case).
    default_known: std::sync::atomic::AtomicBool,
    /// Per upstream key: the gate's last known reopening and this worker's release after it
    /// (see `note_reopen`).
    release: Mutex<HashMap<Arc<str>, (Instant, Instant)>>,
    /// The latest release of them all, in milliseconds after `created`: before it has
    /// passed, `release_in` looks; after, nothing is ahead and no lock is taken.
    release_latest_ms: AtomicU64,
    created: Instant,
    /// Notified when an answer was reported to the store: calls held behind a probe in
    /// this worker ask again at once, in the order they wait.
    pub(super) answered: Arc<tokio::sync::Notify>,
    /// Notified when this worker learns that a key's limits changed: calls waiting for
    /// cells reserved under the old ones ask again.
    limits_changed: Arc<tokio::sync::Notify>,
    /// The rate gate's state per key, when a fair queue below consults it.
    pub(super) gates: Mutex<KeyGates>,
    /// Notified when a rate gate may have opened (one fair queue listens).
    pub(super) gate_changed: Arc<tokio::sync::Notify>,
}

/// A reservation of a block of calls this worker is asking the store for: while it lives,
/// the worker's other calls to the key ask for their own cells only (see `View::block`).
pub(crate) struct BlockAsked {
    rates: Arc<Rates>,
    key: Arc<str>,
}

impl Drop for BlockAsked {
    fn drop(&mut self) {
        crate::sync::lock(&self.rates.views).block_done(&self.key);
    }
}

/// A reservation to ask the store for.
pub(crate) struct Ask {
    /// The request, with the reports pending.
    pub(crate) ask: PaceAsk,
    /// The calls it reserves for, of the same cells each.
    pub(crate) block: u32,
    /// Set while `block` is more than one call.
    pub(crate) _asked: Option<BlockAsked>,
}

/// What learned pacing says about a call about to go.
pub(crate) enum Learned {
    /// Go after this wait (no store operation needed): the cells the call needs, and those
    /// taken (0 where no limit is learned).
    Go(Duration, [u32; DIMS], [u32; DIMS]),
    /// Ask the store for this reservation: the cells the call needs.
    Ask(Ask, [u32; DIMS]),
}

/// Cells one call takes per dimension before it goes: a request, its estimated input
/// tokens, the output tokens expected (`output`: the key's recent average from the
/// answers' usage, at least 1; the count is only known after, see `usage.rs`), and both
/// again in the combined `tokens` dimension.
pub(super) fn needs(cost: u32, output: u32) -> [u32; DIMS] {
    [
        1,
        cost.max(1),
        output.max(1),
        cost.max(1).saturating_add(output),
    ]
}

/// What a call of `view`'s key takes on average in the dimensions the fleet's order keeps
/// as a bound on the calls: the output tokens and the combined tokens, once the answers'
/// usage has said (0 elsewhere: the requests are the calls, the input tokens are the
/// fleet's token rate, and a dimension with no average yet this worker reserves itself).
fn per_call(view: &View) -> [u32; DIMS] {
    let mut out = [0; DIMS];
    if view.output_avg > 0 {
        out[OUTPUT] = view.output_avg;
        if view.input_avg > 0 {
            out[TOTAL] = view.input_avg.saturating_add(view.output_avg);
        }
    }
    out
}

/// Which of `view`'s learned limits the fleet's order keeps where it orders the rate (the
/// rest this worker reserves itself): the requests, the input tokens, and the output and
/// combined tokens as a bound on the calls at the average call ([`per_call`]) — all of
/// them once every such limit can be sized, none before (a worker naming the request
/// limit alone would hand out the whole request rate meanwhile). Without `averages` (no
/// usage is read: usage correction off) none ever comes: the output and combined limits
/// stay this worker's, the rest is the fleet's.
fn kept_by_the_fleet(view: &View, averages: bool) -> [bool; DIMS] {
    if !averages {
        return [true, true, false, false];
    }
    let per_call = per_call(view);
    let sized = [OUTPUT, TOTAL]
        .iter()
        .all(|&d| view.limits[d] == 0 || per_call[d] > 0);
    [sized; DIMS]
}

/// What of `need` a worker still reserves itself where the fleet orders the rate: the
/// learned limits the fleet does not keep ([`kept_by_the_fleet`]).
fn reserved_here(view: &View, need: [u32; DIMS], averages: bool) -> [u32; DIMS] {
    let kept = kept_by_the_fleet(view, averages);
    let mut reserve = need;
    for (d, n) in reserve.iter_mut().enumerate() {
        if kept[d] || view.limits[d] == 0 {
            *n = 0;
        }
    }
    reserve
}

/// The calls a minute the learned limits allow the fleet (0: no limit known): the request
/// limit, or an output or combined token limit over what a call takes of it on average
/// ([`per_call`]) where that allows fewer. Every call is taken to use the average, so such
/// a limit bounds the calls, handed out as the request cells are.
fn calls_a_minute(limits: &[u32; DIMS], per_call: &[u32; DIMS]) -> u32 {
    let mut calls = limits[REQUESTS];
    for (limit, tokens) in limits.iter().zip(per_call) {
        if *limit > 0 && *tokens > 0 {
            let bound = (limit / tokens).max(1);
            calls = if calls == 0 { bound } else { calls.min(bound) };
        }
    }
    calls
}

/// `avg` (0: none yet) moved towards `sample`: an average over about the last 8.
fn moving_average(avg: u32, sample: u32) -> u32 {
    match avg {
        0 => sample,
        avg => (f64::from(avg) + (f64::from(sample) - f64::from(avg)) / 8.0).round() as u32,
    }
}

/// `cells` in the dimensions with a limit, 0 elsewhere: what the store took.
pub(crate) fn taken(cells: [u32; DIMS], limits: &[u32; DIMS]) -> [u32; DIMS] {
    let mut out = [0; DIMS];
    for d in 0..DIMS {
        if limits[d] > 0 {
            out[d] = cells[d];
        }
    }
    out
}

impl Rates {
    pub(crate) fn new(store: Store, config: RateConfig) -> Rates {
        let pacer = config
            .pacing
            .as_ref()
            .filter(|pacing| !pacing.is_shared())
            .map(Pacer::new);
        let rng = config.seed.map_or_else(Rng::from_entropy, Rng::seeded);
        Rates {
            store,
            config,
            pacer,
            rng: Mutex::new(rng),
            views: Mutex::default(),
            loud: AtomicUsize::new(0),
            default_known: std::sync::atomic::AtomicBool::new(false),
            release: Mutex::default(),
            release_latest_ms: AtomicU64::new(0),
            created: Instant::now(),
            answered: Arc::default(),
            limits_changed: Arc::default(),
            gates: Mutex::default(),
            gate_changed: Arc::default(),
        }
    }

    /// Notes that `key`'s gate reopens in `left` and returns when this worker's first call
    /// may go after it: the reopening plus the worker's own random offset into the release
    /// window (one draw per reopening, so the workers' first calls are spread out).
    pub(super) fn note_reopen(&self, key: &Arc<str>, left: Duration) -> Instant {
        let now = Instant::now();
        let reopen = now + left;
        let mut release = crate::sync::lock(&self.release);
        if release.len() > 1024 {
            release.retain(|_, (_, at)| *at > now);
        }
        match release.get(key) {
            // The same reopening (give or take a millisecond of clock reading), or an
            // earlier one than already known: the release stands.
            Some(&(known, at)) if reopen <= known + Duration::from_millis(1) => at,
            _ => {
                let at = reopen + self.config.spread_for(left).mul_f64(self.unit());
                release.insert(key.clone(), (reopen, at));
                let ms = at.saturating_duration_since(self.created).as_millis() + 1;
                self.release_latest_ms
                    .fetch_max(u64::try_from(ms).unwrap_or(u64::MAX), Ordering::AcqRel);
                at
            }
        }
    }

    /// How long a call held by `key`'s gate reopening in `left` waits: until this worker's
    /// release, plus a draw of its own over the window.
    pub(crate) fn release_after(&self, key: &Arc<str>, left: Duration) -> Duration {
        let at = self.note_reopen(key, left);
        let window = self.config.spread_for(left);
        at.saturating_duration_since(Instant::now()) + window.mul_f64(self.unit())
    }

    /// How long until this worker's release after `key`'s last reopening, if still ahead.
    pub(crate) fn release_in(&self, key: &Arc<str>) -> Option<Duration> {
        let latest = self.release_latest_ms.load(Ordering::Acquire);
        if latest == 0
            || Instant::now()
                .saturating_duration_since(self.created)
                .as_millis()
                > u128::from(latest)
        {
            return None;
        }
        let release = crate::sync::lock(&self.release);
        let (_, at) = *release.get(key)?;
        Some(at.saturating_duration_since(Instant::now())).filter(|d| !d.is_zero())
    }

    /// The pacing that goes through the store, if any.
    pub(crate) fn shared_pacing(&self) -> Option<&Pacing> {
        self.config
            .pacing
            .as_ref()
            .filter(|pacing| pacing.is_shared())
    }

    /// The part of every store request that comes from the configuration.
    fn ask(&self) -> PaceAsk {
        let micros = |d: Duration| i64::try_from(d.as_micros()).unwrap_or(i64::MAX / 4);
        PaceAsk {
            headroom_permille: self.config.learned_headroom,
            probe_lease_us: micros(self.config.release_spread),
            recover_us: micros(self.config.probe_timeout),
            poll_us: micros(self.config.poll_interval()),
            ..PaceAsk::default()
        }
    }

    /// Notes that `key` is at its limit (a throttle, or a call held by its closed gate):
    /// after the gate, calls go through the store's probe.
    pub(crate) fn note_at_limit(&self, key: &Arc<str>) {
        let mut views = crate::sync::lock(&self.views);
        let mut view = views.get(key, self.config.learned_pacing, &self.loud);
        view.recover_until = Some(Instant::now() + self.config.probe_timeout);
        view.credit = [0; DIMS];
    }

    /// Resolves when this worker next learns that some key's limits changed.
    pub(crate) fn limits_changed(&self) -> std::pin::Pin<Box<dyn Future<Output = ()> + Send>> {
        let notify = self.limits_changed.clone();
        Box::pin(async move { notify.notified().await })
    }

    /// Whether `key` has had no answer yet (slow start), as far as this worker knows.
    pub(super) fn is_cold(&self, key: &Arc<str>) -> bool {
        let mut views = crate::sync::lock(&self.views);
        views.get(key, self.config.learned_pacing, &self.loud).mode == 0
    }

    /// Whether calls to `key` go one probe at a time: no answer yet (slow start), or
    /// recovering from a throttle, as far as this worker knows.
    pub(super) fn probes(&self, key: &Arc<str>) -> bool {
        let mut views = crate::sync::lock(&self.views);
        let mut view = views.get(key, self.config.learned_pacing, &self.loud);
        view.mode == 0 || view.recovering(Instant::now())
    }

    /// Where a fair queue below puts what an attempt to `key` took from the rate gate;
    /// `None` while the gate has nothing to take for it (no limit learned, cold or
    /// recovering, no pacing: its key is then the layer's own).
    pub(crate) fn attempt_cell(&self, key: &Arc<str>) -> Option<crate::gate::AttemptCell> {
        let quiet = self.all_quiet(key) && self.pacer.is_none() && self.shared_pacing().is_none();
        (!quiet).then(crate::gate::AttemptCell::default)
    }

    /// The limits this worker knows for `key` (0: not learned).
    pub(crate) fn limits_of(&self, key: &Arc<str>) -> [u32; DIMS] {
        let mut views = crate::sync::lock(&self.views);
        views
            .get(key, self.config.learned_pacing, &self.loud)
            .limits
    }

    /// The layer's own key, known, and every view quiet (nothing learned, cold or
    /// recovering): learned pacing has nothing to say, checked without a lock.
    pub(super) fn all_quiet(&self, key: &Arc<str>) -> bool {
        Arc::ptr_eq(key, &self.config.upstream)
            && self.default_known.load(Ordering::Acquire)
            && self.loud.load(Ordering::Acquire) == 0
    }

    /// The learned limits of `key` as cells the fleet's order can hand out (see
    /// `RateLimit::fleet_cells`): of those the fleet keeps ([`kept_by_the_fleet`]), the
    /// calls a minute they allow ([`calls_a_minute`]) with the headroom, and the input-token
    /// rate ([`FleetCells::token_rate`]); each cell taken for at least
    /// 100 ms (so a fast rate's handing out does not cost a script every millisecond), never
    /// more cells than a second of the rate. With no limit in this worker's view now (not
    /// learned yet, or its last answer said none), the cells another worker names
    /// ([`FleetCells::FROM_THE_FLEET`]): a worker pacing in the shared bucket while others
    /// hand out cells would take the whole rate a second time.
    pub(super) fn learned_cells(&self, key: &Arc<str>) -> Option<FleetCells> {
        if !self.config.learned_pacing {
            return None;
        }
        let (limits, per_call) = match self.all_quiet(key) {
            true => ([0; DIMS], [0; DIMS]),
            false => {
                let views = crate::sync::lock(&self.views);
                let kept = |view: &View| {
                    let kept = kept_by_the_fleet(view, self.config.usage_correction);
                    let (mut limits, mut per_call) = (view.limits, per_call(view));
                    for d in (0..DIMS).filter(|d| !kept[*d]) {
                        (limits[d], per_call[d]) = (0, 0);
                    }
                    (limits, per_call)
                };
                views
                    .peek(key)
                    .filter(|view| view.mode == 2)
                    .map_or(([0; DIMS], [0; DIMS]), kept)
            }
        };
        let tokens = (limits[INPUT] > 0)
            .then(|| FleetCells::token_rate(limits[INPUT], self.config.learned_headroom));
        let limit = calls_a_minute(&limits, &per_call);
        if limit == 0 {
            return Some(FleetCells {
                tokens,
                ..FleetCells::FROM_THE_FLEET
            });
        }
        let rate = learned_rate(REQUESTS, limit, self.config.learned_headroom);
        let interval = rate.interval().max(1);
        let count = (100_000 + interval - 1) / interval;
        let count = count.clamp(1, rate.cells(i64::MAX));
        Some(FleetCells {
            count: u32::try_from(count).unwrap_or(1),
            span: Duration::from_micros(u64::try_from(count * interval).unwrap_or(u64::MAX)),
            tokens,
        })
    }

    /// Whether a call to `key` may go now without asking the store, or what to ask it.
    /// With `fleet_cells`, the learned limits the fleet keeps ([`kept_by_the_fleet`]) are
    /// not reserved here.
    pub(crate) fn admit_learned(
        self: &Arc<Self>,
        key: &Arc<str>,
        cost: u32,
        fleet_cells: bool,
    ) -> Learned {
        // The layer's own key, known, and every view quiet: it is quiet too, so the call goes
        // as without learned pacing, without the lock.
        if self.all_quiet(key) {
            return Learned::Go(Duration::ZERO, [0; DIMS], [0; DIMS]);
        }
        let mut views = crate::sync::lock(&self.views);
        let mut view = views.get(key, self.config.learned_pacing, &self.loud);
        if Arc::ptr_eq(key, &self.config.upstream) {
            self.default_known.store(true, Ordering::Release);
        }
        // No headers ever seen, nothing to recover from: as without learned pacing (and no
        // clock read).
        if view.mode == 1 && view.recover_until.is_none() {
            return Learned::Go(Duration::ZERO, [0; DIMS], [0; DIMS]);
        }
        let now = Instant::now();
        let recovering = view.recovering(now);
        if view.mode == 1 && !recovering {
            return Learned::Go(Duration::ZERO, [0; DIMS], [0; DIMS]);
        }
        let mut need = needs(cost, view.output_avg);
        if fleet_cells {
            // With nothing to reserve, out of recovery nothing is asked of the store (an ask
            // on its way holds this worker's calls, and the fleet's wake-ups it keeps for
            // them, for a round trip) and the call goes, its need told for its usage.
            let reserve = reserved_here(&view, need, self.config.usage_correction);
            if view.mode == 2 && !recovering && reserve.iter().all(|n| *n == 0) {
                return Learned::Go(Duration::ZERO, need, [0; DIMS]);
            }
            need = reserve;
        }
        if view.mode == 2 && !recovering && (0..DIMS).all(|d| view.credit[d] >= need[d]) {
            for (credit, need) in view.credit.iter_mut().zip(need) {
                *credit -= need;
            }
            return Learned::Go(
                view.credit_at.saturating_duration_since(now),
                need,
                taken(need, &view.limits),
            );
        }
        // Reserve ahead on Redis, one block at a time (see `View::block`).
        let per_sec =
            f64::from(view.limits[0]) * f64::from(self.config.learned_headroom) / 1000.0 / 60.0;
        let block = view.block(self.store.is_remote(), recovering, per_sec);
        let asked = (block > 1).then(|| BlockAsked {
            rates: self.clone(),
            key: key.clone(),
        });
        let mut ask = self.ask();
        if let Some(pending) = view.pending.take() {
            ask.learn = pending.learn;
            ask.charge = pending.charge;
            ask.answered = pending.answered;
            // Headers that waited for this reservation: another worker may have reported
            // a newer limit since (see `PaceAsk::queued`).
            ask.queued = true;
        }
        ask.take = need.map(|n| n.saturating_mul(block));
        Learned::Ask(
            Ask {
                ask,
                block,
                _asked: asked,
            },
            need,
        )
    }

    /// Applies the store's answer to a reservation of `block` calls of `need` cells each.
    pub(crate) fn granted(&self, key: &Arc<str>, grant: &PaceGrant, need: [u32; DIMS], block: u32) {
        let mut views = crate::sync::lock(&self.views);
        let mut view = views.get(key, self.config.learned_pacing, &self.loud);
        let before = view.limits;
        view.update(grant, self.config.probe_timeout);
        if grant.limits != before {
            learned::learned_limits(key, &grant.limits);
            self.limits_changed.notify_waiters();
        }
        if grant.hold.is_zero() && block > 1 {
            // Reservations made side by side add up (none is lost); the cells go from the
            // latest one's time.
            let extra = need.map(|n| n.saturating_mul(block - 1));
            for (credit, extra) in view.credit.iter_mut().zip(extra) {
                *credit = credit.saturating_add(extra);
            }
            view.credit_at = view.credit_at.max(Instant::now() + grant.wait);
        }
    }

    /// Notes an answer for `key`: what its headers say, and whether it was a throttle or
    /// the probe. Returns the report to send now, if it must not wait for the next
    /// reservation, and the key's learned limits as this worker knew them when the call
    /// went, when its token charges are to be corrected from the answer's usage (else
    /// zeros).
    pub(super) fn report(
        &self,
        key: &Arc<str>,
        headers: &http::HeaderMap,
        throttled: bool,
        probe: bool,
    ) -> (Option<PaceAsk>, [u32; DIMS]) {
        if !throttled
            && !probe
            && self.loud.load(std::sync::atomic::Ordering::Acquire) == 0
            && !learned::has_ratelimit_headers(headers)
        {
            // Every view is quiet and this answer says nothing new: what the locked path
            // below would conclude, without the lock.
            return (None, [0; DIMS]);
        }
        let learn = if self.config.learned_pacing {
            learned::read_limits(headers)
        } else {
            [(0, 0); DIMS]
        };
        let mut views = crate::sync::lock(&self.views);
        let mut view = views.get(key, self.config.learned_pacing, &self.loud);
        let limits = if self.config.usage_correction && view.limits[1..].iter().any(|l| *l > 0) {
            view.limits
        } else {
            [0; DIMS]
        };
        let was_recovering = view.recover_until.is_some();
        if throttled {
            view.recover_until = Some(Instant::now() + self.config.probe_timeout);
            view.credit = [0; DIMS];
        } else {
            view.recover_until = None;
        }
        let heard = learn.iter().any(|(l, _)| *l > 0);
        let new_limit = (0..DIMS).any(|d| learn[d].0 > 0 && learn[d].0 != view.limits[d]);
        let running_low = (0..DIMS).any(|d| learn[d].0 > 0 && learn[d].1 < learn[d].0 / 10);
        if !heard && !throttled && !probe && !was_recovering && view.mode != 0 {
            return (None, limits); // nothing new: no store operation
        }
        let mut ask = self.ask();
        ask.learn = learn;
        ask.answered = if throttled { 2 } else { 1 };
        let urgent = !self.store.is_remote()
            || throttled
            || probe
            || was_recovering
            || view.mode != 2
            || new_limit
            || running_low;
        if new_limit {
            view.credit = [0; DIMS];
        }
        if !urgent {
            learned::merge(&mut view.pending, &ask);
            return (None, limits);
        }
        if let Some(pending) = view.pending.take() {
            let mut merged = Some(pending);
            learned::merge(&mut merged, &ask);
            ask = merged.unwrap_or(ask);
        }
        (Some(ask), limits)
    }

    /// Charges `charge` (cells per dimension; negative gives back) to `key`'s learned
    /// bucket after the fact: a call's true usage against what it was charged. At once on
    /// the memory store; on Redis with the next reservation, as the headers' reports go.
    /// `used`, the input and output tokens of a complete answer, moves the key's expected
    /// input and output per call (averages over about the last 8 answers).
    pub(crate) fn correct_usage(
        &self,
        key: &Arc<str>,
        charge: [i64; DIMS],
        used: Option<(u32, u32)>,
    ) {
        let ask = PaceAsk {
            charge,
            ..self.ask()
        };
        let mut views = crate::sync::lock(&self.views);
        let mut view = views.get(key, self.config.learned_pacing, &self.loud);
        if let Some((input, output)) = used {
            // At most one minute of the learned limit (the store takes no more for a call).
            let output = match view.limits[OUTPUT] {
                0 => output,
                limit => output.min(limit),
            };
            // At least 1: 0 is "none seen".
            view.input_avg = moving_average(view.input_avg, input.max(1));
            view.output_avg = moving_average(view.output_avg, output.max(1));
        }
        if charge.iter().all(|c| *c == 0) {
            return;
        }
        if self.store.is_remote() {
            learned::merge(&mut view.pending, &ask);
        } else {
            drop(view);
            drop(views);
            // Ready at once in memory: the charge is applied when the operation is made.
            let _ = self.store.pace_learned(key, &ask).into_ready();
        }
    }

    /// A uniform draw in [0, 1) from the layer's seeded source.
    pub(crate) fn unit(&self) -> f64 {
        crate::sync::lock(&self.rng).unit()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(limits: [u32; DIMS], input_avg: u32, output_avg: u32) -> View {
        let mut view = View::new(true);
        view.limits = limits;
        view.input_avg = input_avg;
        view.output_avg = output_avg;
        view
    }

    #[test]
    fn output_and_combined_limits_bound_the_calls_at_the_average_call() {
        // 1,000 requests; 18,000 output tokens at 100 a call: 180 calls.
        let v = view([1_000, 0, 18_000, 0], 10, 100);
        assert_eq!(calls_a_minute(&v.limits, &per_call(&v)), 180);
        // 22,000 combined tokens at 110 a call: 200 calls; the tighter output binds.
        let v = view([1_000, 0, 18_000, 22_000], 10, 100);
        assert_eq!(calls_a_minute(&v.limits, &per_call(&v)), 180);
        let v = view([0, 0, 0, 22_000], 10, 100);
        assert_eq!(calls_a_minute(&v.limits, &per_call(&v)), 200);
        // The request limit where it allows fewer.
        let v = view([60, 0, 18_000, 22_000], 10, 100);
        assert_eq!(calls_a_minute(&v.limits, &per_call(&v)), 60);
        // No average yet: the token limits bound nothing (the caller takes the fleet's
        // cells meanwhile); a limit below one call still lets one call a minute.
        let v = view([60, 0, 18_000, 22_000], 0, 0);
        assert_eq!(per_call(&v), [0; DIMS]);
        assert_eq!(calls_a_minute(&v.limits, &per_call(&v)), 60);
        let v = view([0, 0, 50, 0], 10, 100);
        assert_eq!(calls_a_minute(&v.limits, &per_call(&v)), 1);
    }

    #[test]
    fn the_fleet_keeps_every_learned_limit_once_it_can_size_them() {
        let all = [true; DIMS];
        // An output limit and no average call yet: none (the worker reserves them all).
        let v = view([1_000, 30_000, 18_000, 0], 0, 0);
        assert_eq!(kept_by_the_fleet(&v, true), [false; DIMS]);
        // Sized: all of them.
        let v = view([1_000, 30_000, 18_000, 0], 10, 100);
        assert_eq!(kept_by_the_fleet(&v, true), all);
        // A combined limit needs the input average too.
        let v = view([1_000, 0, 0, 22_000], 0, 100);
        assert_eq!(kept_by_the_fleet(&v, true), [false; DIMS]);
        // No output or combined limit: nothing to size.
        let v = view([1_000, 30_000, 0, 0], 0, 0);
        assert_eq!(kept_by_the_fleet(&v, true), all);
        // No usage read: the requests and input tokens, never the others.
        let v = view([1_000, 30_000, 18_000, 22_000], 10, 100);
        assert_eq!(kept_by_the_fleet(&v, false), [true, true, false, false]);
    }

    #[test]
    fn the_average_call_moves_an_eighth_towards_each_answer() {
        assert_eq!(moving_average(0, 80), 80);
        assert_eq!(moving_average(80, 160), 90);
        assert_eq!(moving_average(80, 0), 70);
    }
}
