//! The pool as the fair queue's rate gate: one order served by whichever upstream has room.
//!
//! Each upstream of the pool keeps its own rate under the retry layer (learned limits,
//! pacing, cooldown after a 429, slow start and probe), as the key `{key}@{name}`. When the
//! fair queue is about to dispatch the head of its order, the gate goes down the pool's
//! [preference](super::choose::preference) (a due probe, the tenant's own upstream, then by
//! priority and load, among those not set aside and below their cap) and asks each
//! upstream's rate in turn: the first that lets the call go takes its cells, and the call's
//! place at that upstream is taken at once and handed to the pool's service with the
//! request (a [`Route`] in its job). So the pool's rate is the sum of its members', and a
//! call held by one upstream's rate goes at the next free cell of any.

use std::fmt;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use super::Members;
use super::choose::preference;
use super::future::Dispatch;
use crate::gate::{RateAsk, RateGate, RateLimit, Receipt, Route, Verdict, WaitReason};
use crate::hash::HashMap;
use crate::store::{DIMS, FleetCells};
use crate::sync::lock;

/// A [`Pool`](super::Pool)'s upstreams as a fair queue's rate gate sees them, from
/// [`Pool::gate`](super::Pool::gate): given to
/// [`FairgateBuilder::pool`](crate::FairgateBuilder::pool), or to
/// [`RateGate::across`] in a stack built by hand.
///
/// # Clone
/// Cheap; clones are the same pool.
#[derive(Clone)]
pub struct PoolGate {
    pub(super) shared: Arc<Members>,
}

impl fmt::Debug for PoolGate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<&str> = self.shared.members.iter().map(|m| &*m.name).collect();
        f.debug_struct("PoolGate")
            .field("upstreams", &names)
            .finish()
    }
}

impl RateGate {
    /// This rate gate across the upstreams of a pool: a call goes when one of them has
    /// room — not set aside, below its cap, and its own rate (this gate's, under the key
    /// `{key}@{upstream name}`) lets it go now — and it goes there. The pool's service
    /// must be below the fair queue given the result (see the [module docs](crate::pool)).
    pub fn across(self, pool: &PoolGate) -> RateGate {
        let gate = Arc::new(PoolRate {
            rates: self.inner,
            pool: pool.shared.clone(),
            keys: Mutex::new(HashMap::default()),
        });
        pool.shared.room.tell(&gate);
        let inner: Arc<dyn RateLimit> = gate;
        RateGate::new(inner)
    }
}

/// Most request keys whose upstreams' keys are kept; past it the book starts again.
const KEYS_MAX: usize = 1_024;

/// The rate of each upstream of a pool, as one gate.
pub(super) struct PoolRate {
    /// The retry layer's rate, keyed per upstream of the pool.
    rates: Arc<dyn RateLimit>,
    pool: Arc<Members>,
    /// Per request key, each upstream's key (`{key}@{name}`): made once.
    keys: Mutex<HashMap<Arc<str>, UpstreamKeys>>,
}

/// Each upstream's key for one request key, in the pool's order.
type UpstreamKeys = Arc<[Arc<str>]>;

/// The place a rate gate over the pool took for a call, if `route` is of the pool `pool`
/// and its place was not used yet.
pub(super) fn routed_place(route: &Route, pool: u64) -> Option<Dispatch> {
    let place = route.take_place(pool)?;
    place.downcast::<Dispatch>().ok().map(|place| *place)
}

impl PoolRate {
    /// Upstream `member`'s learned limits and cooldown, for requests of the default key.
    pub(super) fn rate_of(&self, member: usize) -> ([u32; DIMS], Option<Duration>) {
        let keys = self.keys_of(&self.rates.default_key());
        let key = &keys[member];
        (self.rates.limits(key), self.rates.cooldown(key))
    }

    /// A call at an upstream ended: the fair queue waiting on this gate looks again.
    pub(super) fn room_freed(&self) {
        self.rates.changed().notify_one();
    }

    /// Upstream `member` was set aside: its rate's gate closes for `probe_every`, for the
    /// fleet (the store's cooldown), under each request key seen, and one probe goes after.
    pub(super) fn set_aside(&self, member: usize, probe_every: Duration) {
        let keys: Vec<UpstreamKeys> = lock(&self.keys).values().cloned().collect();
        for keys in keys {
            self.rates.set_aside(&keys[member], probe_every);
        }
    }

    fn keys_of(&self, key: &Arc<str>) -> UpstreamKeys {
        let mut book = lock(&self.keys);
        if let Some(keys) = book.get(key) {
            return keys.clone();
        }
        if book.len() >= KEYS_MAX {
            book.clear();
        }
        let keys: UpstreamKeys = (self.pool.members.iter())
            .map(|m| Arc::from(format!("{key}@{}", m.name)))
            .collect();
        book.insert(key.clone(), keys.clone());
        keys
    }
}

impl RateLimit for PoolRate {
    fn default_key(&self) -> Arc<str> {
        self.rates.default_key()
    }

    fn check(self: Arc<Self>, ask: &RateAsk<'_>) -> Verdict {
        let now = Instant::now();
        let pool = &self.pool;
        let candidates = pool.candidates(now, 0, None);
        let affinity = lock(&pool.affinity).get(ask.tenant).copied();
        let keys = self.keys_of(ask.key);
        let order = preference(&candidates, affinity);
        // Priority is a preference: until the call has waited `spill_after` in the fair
        // queue, only the first priority with room may take it (a due probe aside).
        let first = (order.iter())
            .find(|&&m| !candidates[m].probe_due)
            .map(|&m| candidates[m].priority);
        let spill_at = ask.waiting_since + pool.spill_after;
        // The pool's first priority: a call that goes to a later one spilled (counted).
        let top = candidates.iter().map(|c| c.priority).min();
        let mut held: Option<Verdict> = None;
        for member in order {
            let candidate = &candidates[member];
            let waits_for_first = !candidate.probe_due && Some(candidate.priority) != first;
            if waits_for_first && now < spill_at {
                held = sooner(held, Verdict::Until(spill_at, WaitReason::Rate));
                break;
            }
            let member_key = &keys[member];
            match self.rates.clone().check(&ask.to(member_key)) {
                Verdict::Go(taken) => {
                    // Its place, taken now: the fair queue may dispatch more in this pass
                    // than the upstream has room for. Lost meanwhile, the cells go back.
                    let Some(place) = pool.take(member, now) else {
                        continue;
                    };
                    if !candidate.probe_due && Some(candidate.priority) != top {
                        pool.members[member]
                            .counts
                            .spilled
                            .fetch_add(1, Ordering::Relaxed);
                    }
                    pool.remember(ask.tenant, member);
                    let mut receipt = taken.unwrap_or_else(|| Receipt::nothing(member_key, now));
                    let route = Route::new(pool.id, Box::new(place), keys.clone(), member);
                    receipt.route = Some(Arc::new(route));
                    return Verdict::Go(Some(receipt));
                }
                verdict => held = sooner(held, verdict),
            }
        }
        // An upstream set aside may take a call at its probe, whatever holds the others;
        // a full one when a call ends (the pool tells this gate's `changed`).
        let probe = pool.first_probe(now, None);
        match (held, probe) {
            (Some(Verdict::Until(at, _)), Some(probe)) if probe < at => {
                Verdict::Until(probe, WaitReason::Cooldown)
            }
            (Some(Verdict::Notified(reason)), Some(probe)) => Verdict::Until(probe, reason),
            (Some(held), _) => held,
            (None, Some(probe)) if candidates.iter().all(|c| !c.takes_calls) => {
                Verdict::Until(probe, WaitReason::Cooldown)
            }
            (None, Some(probe)) => Verdict::Until(probe, WaitReason::Slot),
            (None, None) => Verdict::Notified(WaitReason::Slot),
        }
    }

    fn fleet_cells(&self, _key: &Arc<str>) -> Option<FleetCells> {
        // Each upstream's rate is paced by its own gate (through the store on Redis): the
        // fleet's order hands out no cells for a pool.
        None
    }

    fn answering(&self, key: &Arc<str>) -> bool {
        self.keys_of(key).iter().any(|k| self.rates.answering(k))
    }

    fn returned(&self, receipt: &Receipt) {
        self.rates.returned(receipt);
    }

    fn changed(&self) -> Arc<tokio::sync::Notify> {
        self.rates.changed()
    }
}

/// The sooner of two holds: the earlier time, else a time over a notification, else the
/// first held.
fn sooner(held: Option<Verdict>, verdict: Verdict) -> Option<Verdict> {
    Some(match (held, verdict) {
        (None, verdict) => verdict,
        (Some(Verdict::Until(known, r)), Verdict::Until(at, _)) if known <= at => {
            Verdict::Until(known, r)
        }
        (Some(Verdict::Until(..) | Verdict::Notified(_)), Verdict::Until(at, reason)) => {
            Verdict::Until(at, reason)
        }
        (Some(held), _) => held,
    })
}

impl Receipt {
    /// A receipt of nothing taken from a rate (no limit applies) for a call to `key`.
    fn nothing(key: &Arc<str>, now: Instant) -> Box<Receipt> {
        Box::new(Receipt {
            key: key.clone(),
            need: [0; DIMS],
            charged: [0; DIMS],
            probe: false,
            used: false,
            due: now,
            fleet_tokens: 0,
            gate: None,
            route: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool::{Pool, Upstream};

    /// A rate that answers each key as scripted (`Go` for a key it has no word for).
    #[derive(Default)]
    struct Scripted {
        held: Mutex<HashMap<Arc<str>, Verdict>>,
        asked: Mutex<Vec<Arc<str>>>,
        closed: Mutex<Vec<(Arc<str>, Duration)>>,
        changed: Arc<tokio::sync::Notify>,
    }

    impl Scripted {
        fn hold(&self, key: &str, verdict: Verdict) {
            lock(&self.held).insert(Arc::from(key), verdict);
        }
    }

    impl RateLimit for Scripted {
        fn default_key(&self) -> Arc<str> {
            Arc::from("k")
        }

        fn check(self: Arc<Self>, ask: &RateAsk<'_>) -> Verdict {
            let key = ask.key;
            lock(&self.asked).push(key.clone());
            match lock(&self.held).get(key) {
                Some(Verdict::Until(at, reason)) => Verdict::Until(*at, *reason),
                Some(Verdict::Notified(reason)) => Verdict::Notified(*reason),
                _ => Verdict::Go(None),
            }
        }

        fn returned(&self, _: &Receipt) {}

        fn changed(&self) -> Arc<tokio::sync::Notify> {
            self.changed.clone()
        }

        fn set_aside(&self, key: &Arc<str>, closed: Duration) {
            lock(&self.closed).push((key.clone(), closed));
        }
    }

    /// A pool of `caps` (one upstream each, named `u0`, `u1`, ..., all of priority 0) and
    /// the gate over it.
    fn gate(caps: &[usize]) -> (Pool<()>, Arc<Scripted>, Arc<dyn RateLimit>) {
        prioritised(&caps.iter().map(|cap| (*cap, 0)).collect::<Vec<_>>())
    }

    /// A pool of `(cap, priority)` upstreams and the gate over it.
    fn prioritised(upstreams: &[(usize, u32)]) -> (Pool<()>, Arc<Scripted>, Arc<dyn RateLimit>) {
        let mut builder = Pool::builder();
        for (i, (cap, priority)) in upstreams.iter().enumerate() {
            let upstream = Upstream::new(format!("u{i}"), ()).max_in_flight(*cap);
            builder = builder.upstream(upstream.priority(*priority));
        }
        let pool = builder.build().unwrap();
        let rates = Arc::new(Scripted::default());
        let inner: Arc<dyn RateLimit> = rates.clone();
        let gate = RateGate::new(inner).across(&pool.gate()).inner;
        (pool, rates, gate)
    }

    fn check(gate: &Arc<dyn RateLimit>) -> Verdict {
        waited(gate, Duration::ZERO)
    }

    /// The gate's word on a call that has waited `wait` in the fair queue.
    fn waited(gate: &Arc<dyn RateLimit>, wait: Duration) -> Verdict {
        let (tenant, key) = (crate::TenantId::from("t"), Arc::from("k"));
        gate.clone().check(&RateAsk {
            tenant: &tenant,
            key: &key,
            cost: 1,
            fleet_cells: false,
            waiting_since: Instant::now() - wait,
        })
    }

    /// The upstream a `Go` routed to, its place kept in `places`.
    fn went(verdict: Verdict, places: &mut Vec<Receipt>) -> Arc<str> {
        let Verdict::Go(Some(receipt)) = verdict else {
            panic!("not a go with its receipt");
        };
        let key = receipt.route.as_ref().expect("routed").answered_key();
        places.push(*receipt);
        key
    }

    #[test]
    fn a_call_goes_to_the_first_upstream_whose_rate_lets_it_and_takes_its_place_there() {
        let (pool, rates, gate) = gate(&[1, 1, 1]);
        let later = Instant::now() + Duration::from_secs(1);
        rates.hold("k@u0", Verdict::Until(later, WaitReason::Rate));
        let mut places = Vec::new();
        assert_eq!(&*went(check(&gate), &mut places), "k@u1");
        // `u1` is full now (its place taken by the gate): the next goes to `u2`.
        assert_eq!(&*went(check(&gate), &mut places), "k@u2");
        let in_flight: Vec<usize> = pool.upstreams().iter().map(|u| u.in_flight).collect();
        assert_eq!(in_flight, [0, 1, 1]);
        // Every upstream full or held: until the held one's time.
        let Verdict::Until(at, WaitReason::Rate) = check(&gate) else {
            panic!("held until `u0`'s rate opens");
        };
        assert_eq!(at, later);
        // A place dropped unused goes back.
        places.clear();
        assert!(pool.upstreams().iter().all(|u| u.in_flight == 0));
    }

    #[test]
    fn a_later_priority_takes_a_call_the_first_holds_only_past_spill_after() {
        let (pool, rates, gate) = prioritised(&[(4, 0), (4, 1)]);
        let later = Instant::now() + Duration::from_secs(5);
        rates.hold("k@u0", Verdict::Until(later, WaitReason::Rate));
        // Held by the primary's rate: the call waits for it, up to `spill_after` (1 s).
        let Verdict::Until(at, WaitReason::Rate) = check(&gate) else {
            panic!("held for the primary");
        };
        let spill = at.saturating_duration_since(Instant::now());
        assert!(spill <= Duration::from_secs(1) && spill > Duration::from_millis(900));
        assert!(
            !lock(&rates.asked).iter().any(|k| &**k == "k@u1"),
            "never asked"
        );
        let Verdict::Until(at, _) = waited(&gate, Duration::from_millis(600)) else {
            panic!("still held");
        };
        assert!(at.saturating_duration_since(Instant::now()) <= Duration::from_millis(400));
        // Waited past it: the second takes it, counted as spilled to it.
        let mut places = Vec::new();
        assert_eq!(
            &*went(waited(&gate, Duration::from_secs(1)), &mut places),
            "k@u1"
        );
        assert_eq!(pool.upstreams()[1].spilled, 1);
        // The primary's rate opens sooner than the spill: that is the wait.
        let soon = Instant::now() + Duration::from_millis(100);
        rates.hold("k@u0", Verdict::Until(soon, WaitReason::Rate));
        let Verdict::Until(at, _) = check(&gate) else {
            panic!("held for the primary");
        };
        assert_eq!(at, soon);
    }

    #[test]
    fn a_full_or_set_aside_primary_spills_at_once() {
        let (pool, _rates, gate) = prioritised(&[(1, 0), (4, 1)]);
        let mut places = Vec::new();
        assert_eq!(&*went(check(&gate), &mut places), "k@u0");
        // Full: the next goes to the second at once.
        assert_eq!(&*went(check(&gate), &mut places), "k@u1");
        assert_eq!(pool.upstreams()[1].spilled, 1);
    }

    #[test]
    fn a_full_pool_waits_for_a_call_to_end_and_is_told_when_one_does() {
        let (pool, rates, gate) = gate(&[1]);
        let mut places = Vec::new();
        went(check(&gate), &mut places);
        let Verdict::Notified(WaitReason::Slot) = check(&gate) else {
            panic!("full: until a call ends");
        };
        let told = rates.changed.notified();
        let mut told = std::pin::pin!(told);
        told.as_mut().enable();
        places.clear();
        assert_eq!(pool.upstreams()[0].in_flight, 0);
        // The call's end wakes the fair queue's watcher.
        let waker = futures_util::task::noop_waker();
        let mut cx = std::task::Context::from_waker(&waker);
        assert!(told.as_mut().poll(&mut cx).is_ready());
    }

    #[test]
    fn an_upstream_set_aside_is_closed_for_the_fleet_under_its_key_and_no_longer_asked() {
        let (pool, rates, gate) = gate(&[1, 1]);
        let mut places = Vec::new();
        went(check(&gate), &mut places);
        // The first upstream fails: set aside, its rate closed under its own key.
        let member = pool.shared.members[0].clone();
        let mut place = Dispatch {
            state: member,
            member: 0,
            probe: false,
            in_flight: None,
        };
        place.answered(super::super::breaker::Outcome::Unreachable);
        assert_eq!(
            *lock(&rates.closed),
            [(Arc::from("k@u0"), Duration::from_secs(1))]
        );
        // Set aside, it is not asked: the call goes to the other.
        lock(&rates.asked).clear();
        assert_eq!(&*went(check(&gate), &mut places), "k@u1");
        assert_eq!(*lock(&rates.asked), [Arc::<str>::from("k@u1")]);
    }
}
