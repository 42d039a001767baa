//! The rate gate, as a fair queue below consults it (see [`crate::gate`]).
//!
//! The same limits the retry layer waits for when it works alone — the cooldown gate, the
//! recovery probe, slow start, learned pacing and a configured [`Pacing`](super::Pacing) —
//! answered for the one call the fair queue is about to dispatch. Cells are taken for that
//! call only, when it may go: at most one call's cells per key are reserved ahead (on Redis
//! a quarter second of the rate, as the layer alone does), and cells a call did not use go
//! back to the next one, so callers that leave waste nothing.

use std::ops::ControlFlow;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::core::{Learned, Rates, taken};
use super::key_gate::{KeyGate, Ready};
use super::pacing::Pacing;
use crate::gate::{RateAsk, RateLimit, Receipt, Verdict, WaitReason};
use crate::store::{DIMS, FleetCells, PaceGrant};

impl Rates {
    /// Applies the store's answer to a reservation made for the next call of `key`.
    fn apply_grant(
        &self,
        gate: &mut KeyGate,
        key: &Arc<str>,
        grant: &PaceGrant,
        need: [u32; DIMS],
        block: u32,
        cost: u32,
    ) {
        self.granted(key, grant, need, block);
        let now = Instant::now();
        if !grant.hold.is_zero() {
            // Another worker's probe: ask again a random moment later, or at an answer.
            let wait = grant.hold.mul_f64(0.5 + 0.5 * self.unit());
            gate.hold_until = Some(now + wait.max(Duration::from_millis(1)));
            return;
        }
        gate.ready = Some(Ready {
            due: now + grant.wait,
            cost,
            need,
            charged: taken(need, &grant.limits),
            probe: grant.probe,
        });
    }

    /// Slow start past its bound: the key is still cold (no answer yet) and this worker
    /// has held its calls for `slow_start_max`.
    fn cold_start_over(&self, gate: &mut KeyGate, key: &Arc<str>, now: Instant) -> bool {
        if !self.is_cold(key) {
            gate.cold_since = None;
            return false;
        }
        let since = *gate.cold_since.get_or_insert(now);
        now.saturating_duration_since(since) >= self.config.slow_start_max
    }

    /// The configured pacing's verdict for the next call of `cost`: `None` when it may go.
    /// With `fleet_cells`, every configured limit is the fleet's to order
    /// ([`Pacing::fleet_cells`]): none is reserved here.
    fn configured_pacing(
        self: &Arc<Self>,
        gate: &mut KeyGate,
        key: &Arc<str>,
        cost: u32,
        now: Instant,
        fleet_cells: bool,
    ) -> Option<Verdict> {
        let shared = match fleet_cells {
            true => None,
            false => self.shared_pacing().map(|pacing| pacing.limits(cost)),
        };
        if let Some((limits, n)) = shared.filter(|&(_, n)| n > 0) {
            match gate.paced {
                Some(at) if at > now => return Some(Verdict::Until(at, WaitReason::Rate)),
                Some(_) => {}
                None if gate.pacing_asking => return Some(Verdict::Notified(WaitReason::Rate)),
                None => {
                    match self
                        .store
                        .pace(&self.config.upstream, &limits[..n])
                        .into_ready()
                    {
                        Ok(wait) => {
                            gate.paced = Some(now + wait);
                            if !wait.is_zero() {
                                return Some(Verdict::Until(now + wait, WaitReason::Rate));
                            }
                        }
                        Err(pending) => {
                            gate.pacing_asking = true;
                            let rates = self.clone();
                            let key = key.clone();
                            spawn_or_drop(async move {
                                let wait = pending.await;
                                let mut gates = crate::sync::lock(&rates.gates);
                                let gate = gates.entry(key).or_default();
                                gate.pacing_asking = false;
                                gate.paced = Some(Instant::now() + wait);
                                drop(gates);
                                rates.gate_changed.notify_one();
                            });
                            return Some(Verdict::Notified(WaitReason::Rate));
                        }
                    }
                }
            }
        }
        if let Some(pacer) = &self.pacer
            && let Some(wait) = pacer.admit(&mut gate.pace_step, cost)
        {
            return Some(Verdict::Until(now + wait, WaitReason::Rate));
        }
        None
    }

    /// Nothing learned, cold or recovering, no pacing, the gate open: nothing to take, and
    /// no lock (the hot path: no clock read, no allocation).
    fn nothing_to_take(&self, key: &Arc<str>) -> bool {
        self.all_quiet(key)
            && self.pacer.is_none()
            && self.shared_pacing().is_none()
            && self.store.cooldown(key).is_none()
            && self.release_in(key).is_none()
    }

    /// Whether the next call of `cost` may go now, and with which cells; the caller holds
    /// the lock on the gates throughout.
    fn take_turn(
        self: &Arc<Self>,
        gate: &mut KeyGate,
        key: &Arc<str>,
        cost: u32,
        now: Instant,
        fleet_cells: bool,
    ) -> ControlFlow<Verdict, Ready> {
        self.cooldown_over(key, now, fleet_cells)?;
        let cold_over = self.cold_start_over(gate, key, now);
        if gate.probing && !self.probes(key) {
            // Another answer ended slow start or recovery before the probe's own did.
            gate.probing = false;
        }
        if !cold_over {
            self.learned_turn(gate, key, cost, now, fleet_cells)?;
        }
        if let Some(verdict) = self.configured_pacing(gate, key, cost, now, fleet_cells) {
            return ControlFlow::Break(verdict);
        }
        gate.pace_step = 0;
        gate.paced = None;
        let ready = if cold_over {
            // No limit is known yet: nothing to take.
            gate.ready.take().filter(|r| !r.probe).unwrap_or(Ready {
                due: now,
                cost,
                need: [0; DIMS],
                charged: [0; DIMS],
                probe: false,
            })
        } else {
            match gate.ready.take() {
                Some(ready) => ready,
                None => return ControlFlow::Break(Verdict::Notified(WaitReason::Rate)),
            }
        };
        if ready.probe {
            gate.probing = true;
        }
        ControlFlow::Continue(ready)
    }

    /// The cooldown gate after a throttle, and this worker's own release after it.
    ///
    /// With `fleet_cells` the fleet's order hands out the rate's cells: every worker's
    /// calls wait for the reopening itself, and the cells pace them from there in the
    /// fleet's order. A release of its own, drawn at random over the window after the
    /// reopening, would spread nothing the cells do not already pace, and would serve the
    /// tenants of the workers that drew early first.
    fn cooldown_over(
        &self,
        key: &Arc<str>,
        now: Instant,
        fleet_cells: bool,
    ) -> ControlFlow<Verdict> {
        if let Some(left) = self.store.cooldown(key) {
            // Closed after a throttle: this worker's release is its own random point of the
            // window after the reopening, and then one probe goes for the fleet.
            self.note_at_limit(key);
            let at = self.note_reopen(key, left);
            let at = if fleet_cells { now + left } else { at };
            return ControlFlow::Break(Verdict::Until(at, WaitReason::Cooldown));
        }
        if !fleet_cells && let Some(wait) = self.release_in(key) {
            return ControlFlow::Break(Verdict::Until(now + wait, WaitReason::Cooldown));
        }
        ControlFlow::Continue(())
    }

    /// The learned limits' turn: a probe out, another worker's probe, a reservation on its
    /// way, or cells reserved ahead that are not due yet hold the call.
    fn learned_turn(
        self: &Arc<Self>,
        gate: &mut KeyGate,
        key: &Arc<str>,
        cost: u32,
        now: Instant,
        fleet_cells: bool,
    ) -> ControlFlow<Verdict> {
        if gate.probing {
            return ControlFlow::Break(Verdict::Notified(WaitReason::Rate));
        }
        match gate.hold_until {
            Some(at) if at > now => {
                return ControlFlow::Break(Verdict::Until(at, WaitReason::Rate));
            }
            _ => gate.hold_until = None,
        }
        if gate.asking {
            return ControlFlow::Break(Verdict::Notified(WaitReason::Rate));
        }
        if let Some(stale) = gate.ready.take_if(|ready| ready.is_stale(now)) {
            // The provider counts a call when it comes: cells dated long before would let
            // the next reservation go early by the difference. They go back, and the call
            // takes cells dated now.
            self.correct_usage(key, stale.charged.map(|c| -i64::from(c)), None);
        }
        if gate.ready.is_none() {
            self.reserve_learned(gate, key, cost, now, fleet_cells)?;
            if let Some(at) = gate.hold_until {
                return ControlFlow::Break(Verdict::Until(at, WaitReason::Rate));
            }
        }
        if let Some(ready) = &gate.ready
            && ready.due > now
        {
            return ControlFlow::Break(Verdict::Until(ready.due, WaitReason::Rate));
        }
        ControlFlow::Continue(())
    }

    /// Reserves the cells learned pacing asks of the next call: from this worker's credit,
    /// or from the store, whose answer may come later (the call waits to be notified).
    /// With `fleet_cells`, no request cell (the fleet's order hands it out).
    fn reserve_learned(
        self: &Arc<Self>,
        gate: &mut KeyGate,
        key: &Arc<str>,
        cost: u32,
        now: Instant,
        fleet_cells: bool,
    ) -> ControlFlow<Verdict> {
        let (asked, need) = match self.admit_learned(key, cost, fleet_cells) {
            Learned::Go(wait, need, charged) => {
                gate.ready = Some(Ready {
                    due: now + wait,
                    cost,
                    need,
                    charged,
                    probe: false,
                });
                return ControlFlow::Continue(());
            }
            Learned::Ask(asked, need) => (asked, need),
        };
        match self.store.pace_learned(key, &asked.ask).into_ready() {
            Ok(grant) => {
                self.apply_grant(gate, key, &grant, need, asked.block, cost);
                ControlFlow::Continue(())
            }
            Err(pending) => {
                gate.asking = true;
                let rates = self.clone();
                let key = key.clone();
                spawn_or_drop(async move {
                    let grant = pending.await;
                    let mut gates = crate::sync::lock(&rates.gates);
                    let gate = gates.entry(key.clone()).or_default();
                    gate.asking = false;
                    rates.apply_grant(gate, &key, &grant, need, asked.block, cost);
                    drop(gates);
                    drop(asked);
                    rates.gate_changed.notify_one();
                });
                ControlFlow::Break(Verdict::Notified(WaitReason::Rate))
            }
        }
    }

    /// Cells reserved for another call's estimate: the difference in input tokens is
    /// charged (or given back) as a usage correction would be.
    fn correct_estimate(&self, key: &Arc<str>, cost: u32, ready: &Ready) {
        if cost == ready.cost || ready.charged[1] == 0 {
            return;
        }
        let diff = i64::from(cost) - i64::from(ready.cost);
        let mut charge = [0; DIMS];
        charge[1] = diff;
        if ready.charged[3] > 0 {
            charge[3] = diff;
        }
        self.correct_usage(key, charge, None);
    }
}

/// Runs `fut` on the current runtime; without one nothing can send it, and it is dropped
/// (unsent, it holds nothing; the fair queue's poll asks again).
fn spawn_or_drop(fut: impl Future<Output = ()> + Send + 'static) {
    if let Ok(runtime) = tokio::runtime::Handle::try_current() {
        runtime.spawn(fut);
    }
}

impl RateLimit for Rates {
    fn default_key(&self) -> Arc<str> {
        self.config.upstream.clone()
    }

    fn fleet_cells(&self, key: &Arc<str>) -> Option<FleetCells> {
        if **key != *self.config.upstream {
            return None;
        }
        let configured = self.shared_pacing().and_then(Pacing::fleet_cells);
        let learned = self.learned_cells(key);
        match (configured, learned) {
            // Both: the slower request rate and the slower token rate bind.
            (Some(c), Some(l)) => Some(c.slower(l)),
            (Some(c), None) => Some(c),
            (None, l) => l,
        }
    }

    fn check(self: Arc<Self>, ask: &RateAsk<'_>) -> Verdict {
        let RateAsk {
            key,
            cost,
            fleet_cells,
            ..
        } = *ask;
        if self.nothing_to_take(key) {
            return Verdict::Go(None);
        }
        let now = Instant::now();
        let mut gates = crate::sync::lock(&self.gates);
        let gate = gates.entry(key.clone()).or_default();
        let ready = match self.take_turn(gate, key, cost, now, fleet_cells) {
            ControlFlow::Continue(ready) => ready,
            ControlFlow::Break(held) => return held,
        };
        drop(gates);
        self.correct_estimate(key, cost, &ready);
        let gate: Arc<dyn RateLimit> = self.clone();
        Verdict::Go(Some(Box::new(Receipt {
            key: key.clone(),
            need: ready.need,
            charged: ready.charged,
            probe: ready.probe,
            used: false,
            due: ready.due,
            fleet_tokens: 0,
            gate: Some(gate),
            route: None,
        })))
    }

    fn answering(&self, key: &Arc<str>) -> bool {
        crate::sync::lock(&self.gates)
            .get(key)
            .is_some_and(|gate| gate.asking || gate.pacing_asking)
    }

    fn returned(&self, receipt: &Receipt) {
        let (key, used, probe, charged) =
            (&receipt.key, receipt.used, receipt.probe, receipt.charged);
        let give_back = {
            let mut gates = crate::sync::lock(&self.gates);
            let gate = gates.entry(key.clone()).or_default();
            if probe {
                // Its answer is reported (or it never went): the next call may go or probe.
                gate.probing = false;
            }
            let unused = !used && charged.iter().any(|c| *c > 0);
            if unused && gate.ready.is_none() && !probe {
                // Kept for the next call, still dated when they were due.
                gate.ready = Some(Ready {
                    due: receipt.due,
                    cost: charged[1],
                    need: charged,
                    charged,
                    probe: false,
                });
                false
            } else {
                unused
            }
        };
        if give_back {
            self.correct_usage(key, charged.map(|c| -i64::from(c)), None);
        }
        self.gate_changed.notify_one();
    }

    fn changed(&self) -> Arc<tokio::sync::Notify> {
        self.gate_changed.clone()
    }

    fn limits(&self, key: &Arc<str>) -> [u32; DIMS] {
        self.limits_of(key)
    }

    fn cooldown(&self, key: &Arc<str>) -> Option<Duration> {
        self.store.cooldown(key)
    }

    fn set_aside(&self, key: &Arc<str>, closed: Duration) {
        // As after a throttle: at its limit until a probe's answer says otherwise, the
        // gate closed for the fleet (pub/sub on Redis tells every worker).
        self.note_at_limit(key);
        self.note_reopen(key, closed);
        let close = self.store.extend_cooldown(key, closed);
        spawn_or_drop(async move {
            let _ = close.await;
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::PaceAsk;
    use crate::{BackoffPolicy, RetryAfterBackoffLayer, Store};

    const KEY: &str = "default";

    /// The tenant asking (the rate gate of one layer does not look at it).
    fn t() -> crate::TenantId {
        crate::TenantId::from("t")
    }

    fn gate(store: &Store) -> (Arc<dyn RateLimit>, Arc<str>) {
        let policy = BackoffPolicy::builder().seed(1).build().unwrap();
        let (_, gate) = RetryAfterBackoffLayer::new(store.clone(), policy).with_gate_below();
        (gate.inner, gate.default_key)
    }

    /// The store learns `rpm` from an answer with a full bucket.
    fn learn(store: &Store, rpm: u32) {
        learn_limits(store, [rpm, 0, 0, 0]);
    }

    /// The store learns `limits` (per dimension, 0: none) from an answer with full buckets.
    fn learn_limits(store: &Store, limits: [u32; DIMS]) {
        let ask = PaceAsk {
            headroom_permille: 950,
            learn: limits.map(|limit| (limit, limit)),
            answered: 1,
            ..PaceAsk::default()
        };
        let _ = store.pace_learned(KEY, &ask).into_ready();
    }

    /// The gate's word on a call of 10 input tokens to `key`.
    fn check(gate: &Arc<dyn RateLimit>, key: &Arc<str>) -> Verdict {
        ask(gate, key, 10, false)
    }

    /// The gate's word on a call of `cost` input tokens to `key`, its request cell the
    /// fleet's (`fleet_cells`) or not.
    fn ask(gate: &Arc<dyn RateLimit>, key: &Arc<str>, cost: u32, fleet_cells: bool) -> Verdict {
        let tenant = t();
        gate.clone().check(&RateAsk {
            tenant: &tenant,
            key,
            cost,
            fleet_cells,
            waiting_since: Instant::now(),
        })
    }

    fn go(verdict: Verdict) -> Box<Receipt> {
        match verdict {
            Verdict::Go(Some(receipt)) => receipt,
            Verdict::Go(None) => panic!("went with nothing taken"),
            Verdict::Until(at, reason) => panic!("held until {at:?} for {reason}"),
            Verdict::Notified(reason) => panic!("held for {reason} until notified"),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_call_takes_its_cells_when_it_goes_and_the_next_waits_one_interval() {
        let store = Store::memory();
        learn(&store, 60);
        let (gate, key) = gate(&store);
        let mut first = go(check(&gate, &key));
        first.mark_used();
        assert!(!first.probe);
        assert_eq!(first.charged[0], 1, "a request cell taken");
        // The next call's cells are reserved for whoever goes next, not for an asker.
        let Verdict::Until(at, WaitReason::Rate) = check(&gate, &key) else {
            panic!("the second call of a 60 RPM key goes at once");
        };
        let interval = at.saturating_duration_since(Instant::now());
        assert!(interval > Duration::from_millis(1_000) && interval < Duration::from_millis(1_100));
        // Asking again changes nothing: one reservation ahead, not one per asker.
        let Verdict::Until(again, _) = check(&gate, &key) else {
            panic!("held");
        };
        assert_eq!(again, at);
        tokio::time::sleep_until(at).await;
        go(check(&gate, &key)).mark_used();
    }

    #[tokio::test(start_paused = true)]
    async fn cells_a_call_did_not_use_go_to_the_next_call_at_once() {
        let store = Store::memory();
        learn(&store, 60);
        let (gate, key) = gate(&store);
        // Taken for a call that then left (its caller went away before it went upstream).
        drop(go(check(&gate, &key)));
        let mut next = go(check(&gate, &key));
        assert_eq!(next.charged[0], 1);
        next.mark_used();
    }

    #[tokio::test(start_paused = true)]
    async fn cells_taken_long_after_their_time_are_dated_anew_so_the_next_call_keeps_the_rate() {
        let store = Store::memory();
        learn(&store, 60);
        let (gate, key) = gate(&store);
        go(check(&gate, &key)).mark_used();
        let Verdict::Until(due, WaitReason::Rate) = check(&gate, &key) else {
            panic!("the second call of a 60 RPM key waits");
        };
        // Its caller is held elsewhere (a full tier) and comes 3 s after its cells were due:
        // its call reaches the provider then, so the one after it waits a whole interval
        // from then, not from the cells' old time.
        tokio::time::sleep_until(due + Duration::from_secs(3)).await;
        let mut late = go(check(&gate, &key));
        late.mark_used();
        let sent = Instant::now();
        let Verdict::Until(next, WaitReason::Rate) = check(&gate, &key) else {
            panic!("the call after a late one goes at once");
        };
        let interval = next.saturating_duration_since(sent);
        assert!(interval > Duration::from_millis(1_000), "{interval:?}");
        // A timer's lateness is not a caller's wait: cells taken just after their time keep it.
        tokio::time::sleep_until(next + Duration::from_millis(5)).await;
        go(check(&gate, &key)).mark_used();
        let Verdict::Until(after, _) = check(&gate, &key) else {
            panic!("held");
        };
        assert!(after.saturating_duration_since(next) > Duration::from_millis(1_000));
        assert!(after.saturating_duration_since(next) < Duration::from_millis(1_100));
    }

    #[tokio::test(start_paused = true)]
    async fn slow_start_holds_the_rest_while_the_first_call_is_out_for_at_most_its_bound() {
        let store = Store::memory();
        let (gate, key) = gate(&store);
        let mut probe = go(check(&gate, &key));
        assert!(probe.probe, "the first call to a cold key is its probe");
        probe.mark_used();
        assert!(matches!(
            check(&gate, &key),
            Verdict::Notified(WaitReason::Rate)
        ));
        // The first answer is slow: past `slow_start_max` the rest go (nothing to take).
        tokio::time::advance(Duration::from_millis(500)).await;
        let mut after = go(check(&gate, &key));
        assert!(!after.probe);
        assert_eq!(after.charged, [0; DIMS]);
        after.mark_used();
        drop(probe);
    }

    #[tokio::test(start_paused = true)]
    async fn a_probe_that_never_went_holds_the_rest_no_longer_than_slow_start() {
        let store = Store::memory();
        let (gate, key) = gate(&store);
        let started = Instant::now();
        let probe = go(check(&gate, &key));
        assert!(probe.probe);
        drop(probe);
        // Not held for its answer (none comes): the store's lease of the lost probe holds
        // the rest until slow start's bound (500 ms), before the lease (1 s) runs out.
        let next = loop {
            match check(&gate, &key) {
                Verdict::Go(receipt) => break receipt,
                Verdict::Until(at, WaitReason::Rate) => tokio::time::sleep_until(at).await,
                Verdict::Until(_, reason) | Verdict::Notified(reason) => {
                    panic!("a probe that never went holds nobody ({reason})")
                }
            }
        };
        assert!(
            started.elapsed() <= Duration::from_millis(550),
            "{:?}",
            started.elapsed()
        );
        drop(next);
    }

    #[tokio::test(start_paused = true)]
    async fn a_closed_cooldown_holds_until_this_workers_release_and_says_cooldown() {
        let store = Store::memory();
        learn(&store, 6_000);
        let (gate, key) = gate(&store);
        let _ = store
            .extend_cooldown(KEY, Duration::from_secs(2))
            .into_ready();
        let Verdict::Until(at, WaitReason::Cooldown) = check(&gate, &key) else {
            panic!("a closed gate holds the call");
        };
        let wait = at.saturating_duration_since(Instant::now());
        // Reopening plus this worker's point of the release window (a fifth of the delay).
        assert!(wait >= Duration::from_secs(2) && wait <= Duration::from_millis(2_400));
    }

    #[tokio::test(start_paused = true)]
    async fn a_learned_request_limit_is_handed_to_the_fleet_as_cells_of_at_least_100_ms() {
        let store = Store::memory();
        learn(&store, 3_000);
        let (fast, key) = gate(&store);
        assert_eq!(
            fast.fleet_cells(&key),
            Some(FleetCells::FROM_THE_FLEET),
            "nothing learned here yet: the cells another worker names"
        );
        go(ask(&fast, &key, 10, false)).mark_used();
        // 95% of 3,000 a minute: a cell every 21,052 us, five to a cell of 105 ms.
        assert_eq!(
            fast.fleet_cells(&key),
            Some(FleetCells {
                count: 5,
                span: Duration::from_micros(5 * 21_052),
                tokens: None,
            })
        );
        // At 60 a minute (57 with the headroom) one cell, one call, every 1.05 s; the gate
        // leaves it to the fleet: two calls go back to back.
        let store = Store::memory();
        learn(&store, 60);
        let (slow, key) = gate(&store);
        go(ask(&slow, &key, 10, true)).mark_used();
        let cells = slow.fleet_cells(&key).expect("learned");
        assert_eq!(
            (cells.count, cells.span),
            (1, Duration::from_micros(1_052_631))
        );
        go(ask(&slow, &key, 10, true)).mark_used();
        // They took nothing of the request bucket; on its own the gate paces them.
        go(ask(&slow, &key, 10, false)).mark_used();
        let Verdict::Until(..) = ask(&slow, &key, 10, false) else {
            panic!("the learned request limit holds the call");
        };
    }

    #[tokio::test(start_paused = true)]
    async fn a_learned_input_token_limit_is_handed_to_the_fleet_as_a_token_rate() {
        let store = Store::memory();
        learn_limits(&store, [3_000, 600, 0, 0]);
        let (gate, key) = gate(&store);
        go(check(&gate, &key)).mark_used();
        // 95% of 600 a minute: a token every 105,263 us, 900 ms of them at once (8).
        let cells = gate.fleet_cells(&key).expect("learned");
        assert_eq!(cells.tokens, Some(crate::gcra::Gcra::new(105_263, 8)));
        assert_eq!(cells.count, 5);
        // The fleet orders the tokens: calls of 100 go back to back here, far past the
        // learned bucket (570)...
        for _ in 0..10 {
            go(ask(&gate, &key, 100, true)).mark_used();
        }
        // ...which they took nothing of: on its own the gate holds the sixth of 100.
        for _ in 0..5 {
            go(ask(&gate, &key, 100, false)).mark_used();
        }
        let Verdict::Until(_, WaitReason::Rate) = ask(&gate, &key, 100, false) else {
            panic!("the learned input-token limit holds the call");
        };
    }

    /// A gate of a shared pacing: 60 requests a minute, 100 input tokens a minute.
    fn paced_gate(store: &Store) -> (Arc<dyn RateLimit>, Arc<str>) {
        let pacing = crate::rate::Pacing::new()
            .requests_per_minute(60)
            .input_tokens_per_minute(100)
            .shared();
        let policy = BackoffPolicy::builder()
            .pacing(pacing)
            .seed(1)
            .build()
            .unwrap();
        let (_, gate) = RetryAfterBackoffLayer::new(store.clone(), policy).with_gate_below();
        (gate.inner, gate.default_key)
    }

    #[tokio::test(start_paused = true)]
    async fn with_the_fleet_ordering_the_configured_limits_the_gate_reserves_none() {
        let store = Store::memory();
        learn(&store, 6_000);
        let (gate, key) = paced_gate(&store);
        assert_eq!(
            gate.fleet_cells(&key),
            Some(FleetCells {
                count: 1,
                span: Duration::from_secs(1),
                // 100 tokens a minute: one every 600 ms, at most one at once.
                tokens: Some(crate::gcra::Gcra::new(600_000, 1)),
            }),
            "one call a second, as cells, and the token rate"
        );
        assert_eq!(gate.fleet_cells(&Arc::from("another key")), None);
        // Both limits are the fleet's: calls of 40 tokens go back to back here.
        for _ in 0..5 {
            go(ask(&gate, &key, 40, true)).mark_used();
        }
        // On its own the gate paces both: the second call waits for the request limit...
        let store = Store::memory();
        learn(&store, 6_000);
        let (alone, key) = paced_gate(&store);
        go(ask(&alone, &key, 40, false)).mark_used();
        let Verdict::Until(at, WaitReason::Rate) = ask(&alone, &key, 40, false) else {
            panic!("the second call of a 60 RPM key waits");
        };
        assert!(at.saturating_duration_since(Instant::now()) > Duration::from_millis(900));
        // ...and the third, a second later, for the tokens (100 a minute: 80 taken, 17
        // more after the 2 s gone, 10 s).
        tokio::time::advance(Duration::from_secs(1)).await;
        go(ask(&alone, &key, 40, false)).mark_used();
        tokio::time::advance(Duration::from_secs(1)).await;
        let Verdict::Until(at, WaitReason::Rate) = ask(&alone, &key, 40, false) else {
            panic!("the token limit holds the third call");
        };
        let wait = at.saturating_duration_since(Instant::now());
        assert!(wait > Duration::from_secs(9), "{wait:?}");
    }

    #[test]
    fn the_slower_of_two_namings_binds_in_each_part() {
        let cells = |count, ms, tokens: Option<i64>| FleetCells {
            count,
            span: Duration::from_millis(ms),
            tokens: tokens.map(|iv| crate::gcra::Gcra::new(iv, 10)),
        };
        // The slower request rate, and the slower token rate, wherever each is named.
        assert_eq!(
            cells(5, 100, Some(10)).slower(cells(1, 100, Some(20))),
            cells(1, 100, Some(20))
        );
        assert_eq!(
            cells(1, 100, Some(20)).slower(cells(5, 100, Some(10))),
            cells(1, 100, Some(20))
        );
        // A count of 0 names no request rate; no token rate names none.
        assert_eq!(
            cells(0, 0, Some(10)).slower(cells(5, 100, None)),
            cells(5, 100, Some(10))
        );
        assert_eq!(
            cells(5, 100, None).slower(cells(0, 0, None)),
            cells(5, 100, None)
        );
    }
}

#[cfg(test)]
mod wiring_tests {
    use std::time::Duration;

    use tokio::time::Instant;
    use tower::{Layer, ServiceExt, service_fn};

    use crate::rate::Pacing;
    use crate::{BackoffPolicy, Job, Origin, RetryAfterBackoffLayer, Store};

    #[tokio::test(start_paused = true)]
    async fn a_clone_taken_before_the_gate_went_below_still_waits_for_its_own_pacing() {
        let policy = BackoffPolicy::builder()
            .pacing(Pacing::new().requests_per_minute(60))
            .seed(1)
            .build()
            .unwrap();
        let before = RetryAfterBackoffLayer::new(Store::memory(), policy);
        let (after, _gate) = before.clone().with_gate_below();
        let upstream = service_fn(|_req: http::Request<String>| async {
            Ok::<_, std::convert::Infallible>(http::Response::new(String::new()))
        });
        let request = || {
            let mut req = http::Request::new(String::new());
            req.extensions_mut()
                .insert(Job::new("t", Origin::UserAction));
            req
        };
        // The layer handed its gate down sends both at once (a fair queue below would pace).
        let start = Instant::now();
        let gated = after.layer(upstream);
        gated.clone().oneshot(request()).await.unwrap();
        gated.oneshot(request()).await.unwrap();
        assert_eq!(start.elapsed(), Duration::ZERO);
        // A clone taken before is still a layer of its own: it paces, one call a second.
        let start = Instant::now();
        let alone = before.layer(upstream);
        alone.clone().oneshot(request()).await.unwrap();
        alone.oneshot(request()).await.unwrap();
        assert!(
            start.elapsed() >= Duration::from_millis(900),
            "{:?}",
            start.elapsed()
        );
    }
}
