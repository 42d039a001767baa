//! What a dispatch leaves to do once the fair queue's lock is released: wakers to wake,
//! served costs to record, acquires to send, wake-ups to pass on, and the watcher that
//! dispatches again while something holds the order's head back.

use std::sync::Arc;
use std::task::Waker;
use std::time::Duration;

use tokio::time::Instant;

use super::effects::{AfterUnlock, Declined};
use super::queues::TierSlots;
use super::{FairQueue, Sent};
use crate::Priority;
use crate::gate::SlotGate;
use crate::metrics::Metric;
use crate::rng::Rng;
use crate::store::{SlotRefusal, SlotWakes};

impl AfterUnlock {
    pub(super) fn run(self, shared: &Arc<FairQueue>, depths: Option<(Priority, usize)>) {
        self.served.for_each(|(tenant, cost, weight, queued, at)| {
            shared.store.add_served_cost_at(&tenant, cost, at);
            shared.store.add_fairness(&tenant, weight, cost, queued);
        });
        if let Some((priority, depth)) = depths {
            metrics::gauge!(Metric::QueueDepth.name(), "priority" => priority.as_str())
                .set(depth as f64);
        }
        if let Some(index) = self.index {
            // The fleet's when the store knows it, so every worker says the same; no
            // backlogged tenant in the window: nothing was unfair.
            let index = shared.store.fleet_fairness_index().unwrap_or(index);
            metrics::gauge!(Metric::FairnessIndex.name()).set(index.unwrap_or(1.0));
        }
        drop(self.drop_handed);
        // Most calls leave these empty: no iterator to build and drop.
        if !self.declined.is_empty() {
            for Declined {
                tier,
                flow,
                n,
                leave,
            } in self.declined
            {
                if let Some(gate) = shared.slot_gate() {
                    gate.pass_on(&tier, &flow, n, leave);
                }
            }
        }
        let spawns = !self.acquires.is_empty() || self.watch;
        let runtime = spawns
            .then(tokio::runtime::Handle::try_current)
            .and_then(Result::ok);
        if spawns {
            for acquire in self.acquires {
                let shared = shared.clone();
                match &runtime {
                    Some(runtime) => {
                        runtime.spawn(async move {
                            let answer = acquire.slot.await;
                            shared.answered(acquire.sent, answer);
                        });
                    }
                    // Nothing can send it (no runtime): unsent, it holds nothing.
                    None => {
                        let sent = Sent {
                            more: false,
                            ..acquire.sent
                        };
                        shared.answered(sent, Err(SlotRefusal::Full));
                    }
                }
            }
        }
        if self.watch
            && let Some(runtime) = &runtime
        {
            runtime.spawn(watch(shared.clone()));
        }
        if self.rewatch {
            shared.rewatch.notify_one();
        }
        self.wake.for_each(Waker::wake);
    }
}

/// Waits while something holds the fair order's head back — a tier blocked for a slot to
/// come free anywhere on the store (on Redis, a release that woke this worker for a tier;
/// in process, any release, with a jittered poll as the safety net), or the rate gate
/// (until its time, or its notification) — and dispatches again. Ends when nothing waits.
async fn watch(shared: Arc<FairQueue>) {
    // The poll's time is kept across wake-ups: a busy worker is woken far more often than
    // it polls, and the poll must still come (a slot freed by an expired lease wakes
    // nobody).
    let mut poll_at: Option<Instant> = None;
    // Without a slot gate only the rate holds the head back.
    let gate = shared.slot_gate().cloned();
    let idle = tokio::sync::Notify::new();
    loop {
        let released = gate.as_ref().map_or(&idle, SlotGate::released).notified();
        tokio::pin!(released);
        released.as_mut().enable();
        // `notify_one`: a change made before this listens is kept for it.
        let changed = shared.rate.as_ref().map(|rate| rate.inner.changed());
        let rate_changed = async {
            match &changed {
                Some(notify) => notify.notified().await,
                None => std::future::pending().await,
            }
        };
        tokio::pin!(rate_changed);
        let (slots, rate_wait, poll) = {
            let mut state = shared.lock();
            let tiers = || state.groups.iter().filter_map(|g| g.slots.as_ref());
            let slots = tiers().any(TierSlots::waits);
            let rate_wait = state.rate_wait;
            if !slots && rate_wait.is_none() {
                state.watching = false;
                return;
            }
            // Held tenants are not woken one by one: they keep the policy's poll.
            let held = tiers().any(|tier| !tier.held_tenants.is_empty());
            let policy = gate.as_ref().map(SlotGate::policy);
            let interval = policy.map_or(Duration::from_millis(100), |p| p.poll_interval);
            let interval = match &gate {
                Some(gate) if !held => gate.poll_every(interval),
                _ => interval,
            };
            let seed = policy.and_then(|p| p.seed);
            let rng = state
                .rng
                .get_or_insert_with(|| seed.map_or_else(Rng::from_entropy, Rng::seeded));
            (slots, rate_wait, interval.mul_f64(0.5 + rng.unit()))
        };
        // A wake-up that came before this watch listened.
        if slots && let Some(woken) = gate.as_ref().and_then(SlotGate::take_wakes) {
            shared.slot_freed(woken);
            continue;
        }
        // A gate waiting for a notification is asked again now and then all the same.
        let rate_at = rate_wait.map(|at| {
            let safety = Instant::now() + Duration::from_millis(250);
            at.map_or(safety, |at| at.min(safety))
        });
        let far = Instant::now() + Duration::from_secs(3600);
        tokio::select! {
            _ = &mut released, if slots => {
                let woken = match gate.as_ref().and_then(SlotGate::take_wakes) {
                    Some(woken) => woken,
                    None if gate.as_ref().is_some_and(SlotGate::wakes_one_per_slot) => SlotWakes::Flows(Vec::new()),
                    None => SlotWakes::Everyone,
                };
                shared.slot_freed(woken);
            }
            _ = tokio::time::sleep_until(*poll_at.get_or_insert_with(|| Instant::now() + poll)), if slots => {
                poll_at = None;
                shared.slot_poll();
            }
            _ = &mut rate_changed, if rate_at.is_some() => shared.rate_opened(),
            _ = shared.rewatch.notified() => {}
            _ = tokio::time::sleep_until(rate_at.unwrap_or(far)), if rate_at.is_some() => {
                shared.rate_opened();
            }
        }
    }
}
