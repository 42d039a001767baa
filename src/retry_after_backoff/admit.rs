//! The waits before an attempt, when this layer waits for the upstream's rate itself: the
//! tier's max wait, a sleep (a backoff, pacing, a release), the store's shared pacing, a
//! grant of learned pacing, the cooldown gate, and configured pacing, in that order.
//!
//! Each wait is one step. A step either lets the attempt on to the next one, or sets
//! something new to wait for and has the admission start over from the first step: what it
//! waited for may have changed what the earlier steps say.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use http_body::Body;
use tower_service::Service;

use super::call::{Admission, Call, LearnedPass, RateWaiter, Step, Waits};
use super::state::HeldCall;
use super::telemetry;
use crate::admission::WaitReason;
use crate::error::BoxError;
use crate::rate::{Learned, taken};

/// What one step of the admission says.
enum Admit {
    /// On to the next step.
    Pass,
    /// Start over from the first step: this one set something new to wait for.
    Again,
}

/// One step of the admission.
type AdmitStep<S, Req, C> = fn(&mut Call<S, Req, C>, &mut Context<'_>, &mut Waits) -> Poll<Admit>;

impl<S, Req, C> Call<S, Req, C> {
    /// Admitting the next attempt: every wait in order, then the inner service's readiness.
    pub(super) fn poll_admitting<F, B, E>(
        &mut self,
        cx: &mut Context<'_>,
        waits: &mut Waits,
    ) -> Poll<Step<B>>
    where
        S: Service<Req, Future = F, Error = E>,
        E: Into<BoxError>,
        B: Body,
    {
        if self.retries == 0
            && let RateWaiter::Here {
                patience: Some(patience),
            } = &mut self.rate
            && let Some(busy) = patience.poll_expired(cx)
        {
            // Nothing was sent: whatever it held here goes with the state.
            return Poll::Ready(Step::fail(busy));
        }
        let steps: [AdmitStep<S, Req, C>; 9] = [
            Self::woken,
            Self::slept,
            Self::shared_pacing_reserved,
            Self::learned_granted,
            Self::gate_open,
            Self::learned_let,
            Self::limits_unchanged,
            Self::shared_pacing_asked,
            Self::configured_pacing,
        ];
        for step in steps {
            if let Admit::Again = ready!(step(self, cx, waits)) {
                return Poll::Ready(Step::Again);
            }
        }
        let step = ready!(self.poll_send(cx));
        // Sent: the next attempt starts the waits over.
        self.admission = Admission::default();
        Poll::Ready(step)
    }

    /// The waits of a first attempt, on the fast path: the gate is open (a local read),
    /// learned pacing lets it go without asking the store, and configured pacing lets it
    /// go. `None`: it goes now; else it is admitted in the future, first sleeping that long.
    pub(super) fn first_wait(&mut self) -> Option<Duration> {
        let core = &self.shared.core;
        let mut wait = Duration::ZERO;
        if core.store.cooldown(&self.upstream).is_none() {
            match core.rate.admit_learned(&self.upstream, self.cost, false) {
                Learned::Go(first, need, charged) => {
                    (self.charge.need, self.charge.charged) = (need, charged);
                    self.admission.learned = LearnedPass::Let;
                    wait = first;
                }
                Learned::Ask(ask, need) => {
                    self.charge.need = need;
                    self.admission.learned = LearnedPass::Asking(ask);
                }
            }
        }
        let go_now = matches!(self.admission.learned, LearnedPass::Let)
            && wait.is_zero()
            && core.rate.shared_pacing().is_none()
            && core.rate.pacer.as_ref().is_none_or(|pacer| {
                pacer
                    .admit(&mut self.admission.pace_step, self.cost)
                    .is_none()
            });
        if go_now {
            self.admission = Admission::default();
            return None;
        }
        if !wait.is_zero() {
            telemetry::pacing_wait(wait);
            self.waited(WaitReason::Rate, wait);
            self.admission.paced_under = Some(core.rate.limits_of(&self.upstream));
        }
        Some(wait)
    }

    /// An answer in this worker ends a hold behind a probe; a change of the learned limits
    /// voids a reservation made under the old ones.
    fn woken(&mut self, cx: &mut Context<'_>, waits: &mut Waits) -> Poll<Admit> {
        if let Some(woken) = waits.answered.as_mut()
            && woken.as_mut().poll(cx).is_ready()
        {
            waits.answered = None;
            waits.sleep = None;
        }
        if let Some(changed) = waits.relimit.as_mut()
            && changed.as_mut().poll(cx).is_ready()
        {
            waits.relimit = None;
            if let Some(limits) = self.admission.paced_under
                && self.shared.core.rate.limits_of(&self.upstream) != limits
            {
                // The reservation is void: ask again now.
                self.admission.paced_under = None;
                self.admission.learned = LearnedPass::Unasked;
                waits.sleep = None;
            } else if waits.sleep.is_some() {
                waits.relimit = Some(self.shared.core.rate.limits_changed());
                return Poll::Ready(Admit::Again);
            }
        }
        Poll::Ready(Admit::Pass)
    }

    /// The timer, whatever set it.
    fn slept(&mut self, cx: &mut Context<'_>, waits: &mut Waits) -> Poll<Admit> {
        if let Some(timer) = waits.sleep.as_mut() {
            ready!(timer.as_mut().poll(cx));
            waits.sleep = None;
            waits.answered = None;
            waits.relimit = None;
        }
        Poll::Ready(Admit::Pass)
    }

    /// The store's shared pacing answered the reservation: sleep its wait.
    fn shared_pacing_reserved(&mut self, cx: &mut Context<'_>, waits: &mut Waits) -> Poll<Admit> {
        if let Some(reservation) = waits.reserve.as_mut() {
            let wait = ready!(Pin::new(reservation).poll(cx));
            waits.reserve = None;
            self.admission.reserved = true;
            if !wait.is_zero() {
                self.waited(WaitReason::Rate, wait);
                waits.sleep(wait);
                return Poll::Ready(Admit::Again);
            }
        }
        Poll::Ready(Admit::Pass)
    }

    /// The store answered a learned-pacing reservation: held behind a probe, paced, or let go.
    fn learned_granted(&mut self, cx: &mut Context<'_>, waits: &mut Waits) -> Poll<Admit> {
        let Some(pending) = waits.learn.as_mut() else {
            return Poll::Ready(Admit::Pass);
        };
        let grant = ready!(Pin::new(pending).poll(cx));
        waits.learn = None;
        let core = &self.shared.core;
        let asked = std::mem::take(&mut self.admission.learned);
        let block = match &asked {
            LearnedPass::Asking(asked) => asked.block,
            _ => 1,
        };
        core.rate
            .granted(&self.upstream, &grant, self.charge.need, block);
        // Another block may be asked for once this one's cells are credited.
        drop(asked);
        if !grant.hold.is_zero() {
            // Another call is probing this key (cold start or recovery): ask again a random
            // moment later, or when its lease ends.
            self.held.get_or_insert_with(|| HeldCall::new(core));
            let wait = grant.hold.mul_f64(0.5 + 0.5 * core.rate.unit());
            // Slow start or recovery: held for the rate until the probe answers.
            self.waited(WaitReason::Rate, wait);
            waits.sleep(wait.max(Duration::from_millis(1)));
            waits.answered = Some(core.rate.next_answer());
            return Poll::Ready(Admit::Again);
        }
        if grant.probe {
            telemetry::probe(if grant.mode == 0 {
                "cold_start"
            } else {
                "recovery"
            });
        }
        self.charge.probe = grant.probe;
        self.admission.learned = LearnedPass::Let;
        self.charge.charged = taken(self.charge.need, &grant.limits);
        if grant.mode == 2 {
            telemetry::pacing_wait(grant.wait);
        }
        if !grant.wait.is_zero() {
            self.waited(WaitReason::Rate, grant.wait);
        }
        if !grant.wait.is_zero() {
            self.admission.paced_under = Some(grant.limits);
            waits.relimit = Some(core.rate.limits_changed());
            waits.sleep(grant.wait);
            return Poll::Ready(Admit::Again);
        }
        Poll::Ready(Admit::Pass)
    }

    /// Held behind the upstream's cooldown gate until this worker's release after it.
    fn gate_open(&mut self, _: &mut Context<'_>, waits: &mut Waits) -> Poll<Admit> {
        let core = &self.shared.core;
        let Some(left) = core.store.cooldown(&self.upstream) else {
            return Poll::Ready(Admit::Pass);
        };
        // A retry with nothing else held goes when the gate reopens (it keeps the band its
        // own delay was drawn in); the rest go at random points of a window (each worker
        // from its own offset into it), after one probe for the whole fleet.
        let lone = self.retries > 0 && !core.others_held(self.held.is_some());
        self.held.get_or_insert_with(|| HeldCall::new(core));
        core.rate.note_at_limit(&self.upstream);
        let wait = if lone {
            left
        } else {
            core.rate.release_after(&self.upstream, left)
        };
        telemetry::cooldown_wait(wait);
        self.waited(WaitReason::Cooldown, wait);
        self.admission.learned = LearnedPass::Unasked;
        waits.sleep(wait.max(Duration::from_millis(1)));
        Poll::Ready(Admit::Again)
    }

    /// Learned pacing lets the attempt go, at once or after a wait, or asks the store.
    fn learned_let(&mut self, _: &mut Context<'_>, waits: &mut Waits) -> Poll<Admit> {
        let core = &self.shared.core;
        let asked = match std::mem::take(&mut self.admission.learned) {
            LearnedPass::Let => {
                self.admission.learned = LearnedPass::Let;
                return Poll::Ready(Admit::Pass);
            }
            LearnedPass::Asking(asked) => asked,
            LearnedPass::Unasked => match core.rate.admit_learned(&self.upstream, self.cost, false)
            {
                Learned::Go(wait, need, charged) => {
                    self.admission.learned = LearnedPass::Let;
                    self.charge.need = need;
                    self.charge.charged = charged;
                    if wait.is_zero() {
                        return Poll::Ready(Admit::Pass);
                    }
                    telemetry::pacing_wait(wait);
                    self.waited(WaitReason::Rate, wait);
                    self.admission.paced_under = Some(core.rate.limits_of(&self.upstream));
                    waits.relimit = Some(core.rate.limits_changed());
                    waits.sleep(wait);
                    return Poll::Ready(Admit::Again);
                }
                Learned::Ask(asked, need) => {
                    self.charge.need = need;
                    asked
                }
            },
        };
        // Not before this worker's release after the key's last reopening, unless nothing
        // else is held.
        if core.others_held(self.held.is_some())
            && let Some(wait) = core.rate.release_in(&self.upstream)
        {
            waits.sleep(wait.max(Duration::from_millis(1)));
            return Poll::Ready(Admit::Again);
        }
        waits.learn = Some(core.store.pace_learned(&self.upstream, &asked.ask));
        self.admission.learned = LearnedPass::Asking(asked);
        Poll::Ready(Admit::Again)
    }

    /// The learned limits did not change while the attempt waited for its cells.
    fn limits_unchanged(&mut self, _: &mut Context<'_>, _: &mut Waits) -> Poll<Admit> {
        if let Some(limits) = self.admission.paced_under.take()
            && self.shared.core.rate.limits_of(&self.upstream) != limits
        {
            // The limits changed while this call waited: ask again.
            self.admission.learned = LearnedPass::Unasked;
            return Poll::Ready(Admit::Again);
        }
        // Past every hold: no longer counted as held.
        self.held = None;
        Poll::Ready(Admit::Pass)
    }

    /// Asks the store's shared pacing for a reservation, once per attempt.
    fn shared_pacing_asked(&mut self, _: &mut Context<'_>, waits: &mut Waits) -> Poll<Admit> {
        let core = &self.shared.core;
        if let Some(pacing) = core.rate.shared_pacing()
            && !self.admission.reserved
        {
            let (limits, n) = pacing.limits(self.cost);
            waits.reserve = Some(core.store.pace(&core.policy.upstream, &limits[..n]));
            return Poll::Ready(Admit::Again);
        }
        Poll::Ready(Admit::Pass)
    }

    /// The layer's own configured pacing.
    fn configured_pacing(&mut self, _: &mut Context<'_>, waits: &mut Waits) -> Poll<Admit> {
        let core = &self.shared.core;
        if let Some(pacer) = &core.rate.pacer
            && let Some(wait) = pacer.admit(&mut self.admission.pace_step, self.cost)
        {
            self.waited(WaitReason::Rate, wait);
            waits.sleep(wait);
            return Poll::Ready(Admit::Again);
        }
        Poll::Ready(Admit::Pass)
    }
}
