//! A dispatched request's place (`Permit`) and a waiting request's place in the queue
//! (`Ticket`): what a response and a waiting future hold of the fair queue, and give back
//! when dropped.

use std::fmt;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::time::{Instant, Sleep};

use super::{AfterUnlock, FairQueue, Handed};
use crate::Job;
use crate::admission::{Busy, SlowWait, TierLimit};
use crate::drr_fairness::scheduler::Key;
use crate::gate::{Taken, WaitReason};
use crate::metrics::Metric;
use crate::store::SlotLease;
use crate::{Priority, TenantId, Tier};

/// One of the layer's `max_in_flight` places, held by a dispatched request until its
/// response completes — for an `http::Response`, until its body ends, fails or is dropped
/// (it travels inside [`GuardedBody`](crate::body::GuardedBody)). When the store's slot
/// policy gates the request, the permit also holds its slot (see [`crate::admission`]).
///
/// Dropping it gives both back and hands the place to the next waiting request in fair
/// order. It cannot be created outside the crate.
pub struct Permit {
    shared: Arc<FairQueue>,
    group: usize,
    class: Priority,
    /// The tenant the scheduler counts this request in flight for, to report its completion.
    charged: Option<TenantId>,
    slot: Option<SlotLease>,
    /// What the call took from the rate gate, until it goes upstream.
    receipt: Taken,
}

impl Permit {
    pub(super) fn new(
        shared: Arc<FairQueue>,
        group: usize,
        class: Priority,
        charged: Option<TenantId>,
        handed: Handed,
        waited: Duration,
    ) -> Self {
        let Handed {
            lease: slot,
            receipt,
        } = handed;
        if let Some(lease) = &slot {
            crate::metrics::slot_taken(lease.tier(), lease.is_fallback(), Some(waited));
        }
        Permit {
            shared,
            group,
            class,
            charged,
            slot,
            receipt,
        }
    }

    /// Whether the permit holds the request's slot too.
    pub fn holds_slot(&self) -> bool {
        self.slot.is_some()
    }

    /// The call goes upstream now: its rate cells are spent, and the receipt goes to the
    /// retry layer above through the job's attempt cell (if it left one). The job is looked
    /// up only when there is a receipt to give it.
    pub(in crate::drr_fairness) fn going<'a>(&mut self, job: impl FnOnce() -> Option<&'a mut Job>) {
        if let Some(mut receipt) = self.receipt.take() {
            receipt.mark_used();
            // A receipt of nothing (no limit learned, no probe, no pool) tells the retry
            // layer nothing.
            if receipt.tells_something()
                && let Some(job) = job()
            {
                if let Some(route) = &receipt.route {
                    job.set_route(route.clone());
                }
                if let Some(cell) = job.attempt_cell() {
                    cell.put(receipt);
                }
            }
        }
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        let slot = self.slot.take();
        if let Some(lease) = &slot {
            crate::metrics::slot_given_back(lease.tier());
        }
        self.shared
            .release(self.group, self.class, self.charged.as_ref(), slot);
    }
}

impl fmt::Debug for Permit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Permit")
            .field("slot", &self.slot)
            .finish_non_exhaustive()
    }
}

/// A request's place in the queue. Dropped while waiting, it leaves the queue; dropped
/// after it was dispatched but before it noticed, it gives the permit (and slot) back.
pub(in crate::drr_fairness) struct Ticket {
    pub(super) shared: Option<Arc<FairQueue>>,
    pub(super) key: Key,
    pub(super) id: u64,
    pub(super) group: usize,
    pub(super) class: Priority,
    pub(super) tenant: TenantId,
    pub(super) arrived: Instant,
    /// The tier a slot gates the request by, and its limit: its max wait counts from
    /// `arrived`, and past it the request fails with `Busy`.
    pub(super) patience: Option<(Tier, TierLimit)>,
    pub(super) timer: Option<Pin<Box<Sleep>>>,
    /// The `queue.slow_wait` warning of a slot-gated wait, armed on its first poll.
    pub(super) slow: Option<SlowWait>,
    /// Once dispatched: what its group was last held for (one byte: the ticket moves with
    /// every future above it while it waits).
    pub(super) held_for: Option<WaitReason>,
}

impl Ticket {
    /// Once dispatched: what its group was last held for (a slot or a place in the window,
    /// the rate, the cooldown gate, the store), and how long it waited since its arrival.
    pub(in crate::drr_fairness) fn waited(&self) -> Option<(WaitReason, Duration)> {
        self.held_for.map(|reason| (reason, self.arrived.elapsed()))
    }

    /// `Ready` with the permit once the request's turn came, or with `Busy` once its tier's
    /// max wait has passed; `Pending` with the waker (and the timer) registered otherwise.
    pub(in crate::drr_fairness) fn poll_turn(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Result<Permit, Busy>> {
        let Some(shared) = self.shared.clone() else {
            // Turned into a permit already; the future's state machine never polls again.
            panic!("DrrFairness ticket polled after completion");
        };
        let expired = self.poll_timer(cx, &shared);
        let busy = {
            let mut state = shared.lock();
            let reason = state.groups[self.group].held_for;
            // Refused for the store's absence: answered at once, not at the max wait.
            let refused = reason == WaitReason::Store
                && (state.groups[self.group].slots.as_ref()).is_some_and(|slots| slots.blocked);
            if let Some(waiter) = state.groups[self.group].scheduler.get_mut(self.key) {
                if !expired && !refused {
                    match &mut waiter.waker {
                        Some(waker) if waker.will_wake(cx.waker()) => {}
                        slot => *slot = Some(cx.waker().clone()),
                    }
                    return Poll::Pending;
                }
                state.groups[self.group].scheduler.remove(self.key);
                state.left(self.class);
                Some((state.class_len(self.class), reason))
            } else {
                None
            }
        };
        if let Some((depth, reason)) = busy {
            // Its max wait passed while it waited: out of the queue, `Busy`.
            self.shared = None;
            AfterUnlock::default().run(&shared, Some((self.class, depth)));
            let (tier, limit) = self
                .patience
                .clone()
                .unwrap_or_else(|| (Tier::new(""), TierLimit::new(0, Duration::ZERO)));
            crate::metrics::server_busy(&tier, reason);
            let retry_after = shared
                .slot_policy()
                .map_or(Duration::from_secs(5), |p| p.retry_after());
            let waited = self.arrived.elapsed();
            crate::trace::waited(reason, waited);
            let busy = Busy::new(tier, waited, retry_after)
                .because(reason)
                .retrying(limit.retry);
            return Poll::Ready(Err(busy));
        }
        // Only this ticket removes its own entry, so a missing entry was popped: the
        // releasing side already counted the permit (and took the slot) for us.
        let (handed, held_for) = {
            let mut state = shared.lock();
            let handed = state.handed.remove(&self.id).unwrap_or_default();
            (handed, state.groups[self.group].held_for)
        };
        self.shared = None;
        self.held_for = Some(held_for);
        if held_for == WaitReason::Rate {
            // Held here for the provider's rate: the pacing wait the retry layer records for
            // the calls it paces itself, recorded for those the fair order paced.
            metrics::histogram!(Metric::PacingWaitSeconds.name())
                .record(self.arrived.elapsed().as_secs_f64());
        }
        Poll::Ready(Ok(Permit::new(
            shared,
            self.group,
            self.class,
            Some(self.tenant.clone()),
            handed,
            self.arrived.elapsed(),
        )))
    }

    /// Arms (and polls) the timer of a slot-gated wait: `queue.slow_wait` at the policy's
    /// mark, then the max wait. True once the max wait has passed. A timer firing never
    /// moves the request in the queue.
    fn poll_timer(&mut self, cx: &mut Context<'_>, shared: &FairQueue) -> bool {
        let Some((tier, limit)) = &self.patience else {
            return false;
        };
        let deadline = crate::time::after(self.arrived, limit.max_wait);
        let arrived = self.arrived;
        let slow = self.slow.get_or_insert_with(|| {
            let after = shared.slot_policy().map_or(Duration::MAX, |p| p.slow_wait);
            SlowWait::new(arrived, after, shared.slow_waits())
        });
        loop {
            let now = Instant::now();
            if now >= deadline {
                return true;
            }
            slow.check(tier);
            let wake = slow.next().map_or(deadline, |at| at.min(deadline));
            let timer = self
                .timer
                .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(wake)));
            if timer.deadline() != wake {
                timer.as_mut().reset(wake);
            }
            if timer.as_mut().poll(cx).is_pending() {
                return false;
            }
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let Some(shared) = self.shared.take() else {
            return;
        };
        let left_queue = {
            let mut state = shared.lock();
            let removed = state.groups[self.group].scheduler.remove(self.key);
            removed.map(|_| {
                state.left(self.class);
                state.class_len(self.class)
            })
        };
        match left_queue {
            Some(depth) => AfterUnlock::default().run(&shared, Some((self.class, depth))),
            // Dispatched but never claimed: the permit (and slot) are ours to give back.
            None => {
                let handed = shared.lock().handed.remove(&self.id).unwrap_or_default();
                shared.release(self.group, self.class, Some(&self.tenant), handed.lease);
            }
        }
    }
}

impl fmt::Debug for Ticket {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Ticket").field("key", &self.key).finish()
    }
}
