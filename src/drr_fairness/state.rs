//! The state one layer shares between all its services and futures: the scheduler, the
//! in-flight count and the waiters' wakers, behind one mutex.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use tokio::time::Instant;

use super::error::QueueFull;
use super::fairness::FairnessWindow;
use super::scheduler::{Key, Rejected, Scheduler, SchedulerConfig};
use crate::error::ConfigError;
use crate::metrics::Metric;
use crate::{Job, Priority, Store, TenantId, Tier};

/// Metric: gauge, requests waiting in the queue, label `priority`.
pub const QUEUE_DEPTH: &str = "claude_queue_depth";
/// Metric: gauge, Jain's fairness index over the weight-normalised served cost of the
/// tenants that were backlogged in the fairness window (1.0 = perfectly fair).
pub const FAIRNESS_INDEX: &str = "claude_drr_fairness_index";

/// Tier name -> DRR weight.
#[derive(Clone, Debug)]
pub(super) struct TierWeights {
    pub(super) by_tier: HashMap<Tier, u32>,
    pub(super) default: u32,
}

impl Default for TierWeights {
    fn default() -> Self {
        TierWeights {
            by_tier: [(Tier::new(Tier::PRO), 3), (Tier::new(Tier::PREMIUM), 3)]
                .into_iter()
                .collect(),
            default: 1,
        }
    }
}

impl TierWeights {
    fn of(&self, tier: Option<&Tier>) -> u32 {
        tier.and_then(|t| self.by_tier.get(t).copied())
            .unwrap_or(self.default)
    }
}

/// A waiting request as the scheduler holds it.
#[derive(Debug)]
pub(super) struct Waiter {
    waker: Option<Waker>,
    weight: u32,
}

struct State {
    scheduler: Scheduler<Waiter>,
    in_flight: usize,
    fairness: FairnessWindow,
}

pub(super) struct Shared {
    store: Store,
    max_in_flight: usize,
    weights: TierWeights,
    state: Mutex<State>,
}

/// What a dispatch leaves to do once the lock is released.
#[derive(Default)]
struct AfterUnlock {
    wake: Option<Waker>,
    served: Option<(TenantId, u64)>,
    depth: Option<(Priority, usize)>,
    index: Option<Option<f64>>,
}

impl AfterUnlock {
    fn run(self, store: &Store) {
        if let Some((tenant, cost)) = self.served {
            store.add_served_cost(&tenant, cost);
        }
        if let Some((priority, depth)) = self.depth {
            metrics::gauge!(Metric::QueueDepth.name(), "priority" => priority.as_str())
                .set(depth as f64);
        }
        if let Some(index) = self.index {
            // No backlogged tenant in the window: nothing was unfair.
            metrics::gauge!(Metric::FairnessIndex.name()).set(index.unwrap_or(1.0));
        }
        if let Some(waker) = self.wake {
            waker.wake();
        }
    }
}

/// How a request got in.
pub(super) enum Admission {
    /// There was room: dispatched at once.
    Now(Permit),
    /// It waits for its turn.
    Queued(Ticket),
}

impl Shared {
    pub(super) fn new(
        store: Store,
        max_in_flight: usize,
        config: SchedulerConfig,
        weights: TierWeights,
        fairness_window: Duration,
    ) -> Result<Self, ConfigError> {
        if max_in_flight == 0 {
            return Err(ConfigError::new("max_in_flight must be at least 1"));
        }
        if weights.default == 0 || weights.by_tier.values().any(|&w| w == 0) {
            return Err(ConfigError::new("tier weights must be at least 1"));
        }
        if fairness_window < Duration::from_millis(10) {
            return Err(ConfigError::new("fairness window must be at least 10 ms"));
        }
        Ok(Shared {
            store,
            max_in_flight,
            weights,
            state: Mutex::new(State {
                scheduler: Scheduler::new(config)?,
                in_flight: 0,
                fairness: FairnessWindow::new(fairness_window),
            }),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Counts and queues stay consistent between statements that could panic (none
        // should); refusing every later request would be worse than going on.
        crate::sync::lock(&self.state)
    }

    pub(super) fn max_in_flight(&self) -> usize {
        self.max_in_flight
    }

    pub(super) fn weights(&self) -> &TierWeights {
        &self.weights
    }

    pub(super) fn scheduler_config(&self) -> SchedulerConfig {
        self.lock().scheduler.config().clone()
    }

    pub(super) fn in_flight(&self) -> usize {
        self.lock().in_flight
    }

    pub(super) fn queued(&self, priority: Option<Priority>) -> usize {
        let state = self.lock();
        match priority {
            Some(p) => state.scheduler.class_len(p),
            None => state.scheduler.len(),
        }
    }

    pub(super) fn fairness_index(&self) -> Option<f64> {
        self.lock().fairness.index(Instant::now())
    }

    /// The weight, class and cost of `job`.
    pub(super) fn classify(&self, job: &Job) -> (Priority, u32, u64) {
        (
            job.priority().unwrap_or(Priority::Standard),
            self.weights.of(job.tier_name()),
            u64::from(job.estimated_tokens()),
        )
    }

    /// Called from `call`: a permit at once while nothing waits and there is room, else a
    /// place in the queue, else (a queue limit) `QueueFull`.
    pub(super) fn admit(
        self: &Arc<Self>,
        class: Priority,
        tenant: &TenantId,
        weight: u32,
        cost: u64,
    ) -> Result<Admission, QueueFull> {
        let mut after = AfterUnlock::default();
        let admission = {
            let mut state = self.lock();
            if state.scheduler.is_empty() && state.in_flight < self.max_in_flight {
                // Room and nobody waiting: out at once, still charged to the tenant, so a
                // tenant that filled the window queues behind those that did not.
                state.in_flight += 1;
                let charged = state
                    .scheduler
                    .dispatch_direct(class, tenant.clone(), weight, cost);
                // `None`: the class is at its tenant capacity (billions); served, not charged.
                let cost = charged
                    .unwrap_or_else(|| state.scheduler.config().max_charge().min(cost.max(1)));
                after.index = state
                    .fairness
                    .record(tenant, weight, cost, false, Instant::now());
                after.served = Some((tenant.clone(), cost));
                Admission::Now(Permit {
                    shared: self.clone(),
                    class,
                    charged: charged.map(|_| tenant.clone()),
                })
            } else {
                let waiter = Waiter {
                    waker: None,
                    weight,
                };
                match state
                    .scheduler
                    .push(class, tenant.clone(), weight, cost, waiter)
                {
                    Ok(key) => {
                        after.depth = Some((class, state.scheduler.class_len(class)));
                        Admission::Queued(Ticket {
                            shared: Some(self.clone()),
                            key,
                            class,
                            tenant: tenant.clone(),
                        })
                    }
                    Err(rejected) => {
                        let tenant_limit = matches!(rejected, Rejected::TenantFull(_));
                        return Err(QueueFull::new(class, tenant.clone(), tenant_limit));
                    }
                }
            }
        };
        after.run(&self.store);
        Ok(admission)
    }

    /// A permit came back: its request, if the scheduler counted it (`tenant`), is no longer
    /// in flight; hand the permit to the next request in fair order, if one waits.
    fn release(&self, class: Priority, tenant: Option<&TenantId>) {
        let after = {
            let mut state = self.lock();
            state.in_flight = state.in_flight.saturating_sub(1);
            if let Some(tenant) = tenant {
                state.scheduler.complete(class, tenant);
            }
            Self::dispatch_next(&mut state, self.max_in_flight)
        };
        after.run(&self.store);
    }

    fn dispatch_next(state: &mut State, max_in_flight: usize) -> AfterUnlock {
        let mut after = AfterUnlock::default();
        if state.in_flight >= max_in_flight {
            return after;
        }
        let Some(next) = state.scheduler.pop() else {
            return after;
        };
        state.in_flight += 1;
        after.index = state.fairness.record(
            &next.tenant,
            next.item.weight,
            next.cost,
            true,
            Instant::now(),
        );
        after.depth = Some((next.class, state.scheduler.class_len(next.class)));
        after.served = Some((next.tenant, next.cost));
        after.wake = next.item.waker;
        after
    }

    pub(super) fn settle(&self, job: &Job, actual: u64) {
        let (class, _, estimated) = self.classify(job);
        self.lock()
            .scheduler
            .settle(class, job.tenant(), estimated, actual);
    }
}

impl fmt::Debug for Shared {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = self.lock();
        f.debug_struct("DrrFairnessState")
            .field("max_in_flight", &self.max_in_flight)
            .field("in_flight", &state.in_flight)
            .field("queued", &state.scheduler.len())
            .field("store", &self.store)
            .finish()
    }
}

/// One of the layer's `max_in_flight` places, held by a dispatched request until its
/// response completes — for an `http::Response`, until its body ends, fails or is dropped
/// (it travels inside [`GuardedBody`](crate::body::GuardedBody)).
///
/// Dropping it hands the place to the next waiting request in fair order. It cannot be
/// created outside the crate.
pub struct Permit {
    shared: Arc<Shared>,
    class: Priority,
    /// The tenant the scheduler counts this request in flight for, to report its completion.
    charged: Option<TenantId>,
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.shared.release(self.class, self.charged.as_ref());
    }
}

impl fmt::Debug for Permit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Permit").finish_non_exhaustive()
    }
}

/// A request's place in the queue. Dropped while waiting, it leaves the queue; dropped
/// after it was dispatched but before it noticed, it gives the permit back.
pub(super) struct Ticket {
    shared: Option<Arc<Shared>>,
    key: Key,
    class: Priority,
    tenant: TenantId,
}

impl Ticket {
    /// `Ready` with the permit once the request's turn came; `Pending` with the waker
    /// registered otherwise.
    pub(super) fn poll_turn(&mut self, cx: &mut Context<'_>) -> Poll<Permit> {
        let Some(shared) = &self.shared else {
            // Turned into a permit already; the future's state machine never polls again.
            panic!("DrrFairness ticket polled after completion");
        };
        {
            let mut state = shared.lock();
            if let Some(waiter) = state.scheduler.get_mut(self.key) {
                match &mut waiter.waker {
                    Some(waker) if waker.will_wake(cx.waker()) => {}
                    slot => *slot = Some(cx.waker().clone()),
                }
                return Poll::Pending;
            }
        }
        // Only this ticket removes its own entry, so a missing entry was popped: the
        // releasing side already counted the permit for us.
        match self.shared.take() {
            Some(shared) => Poll::Ready(Permit {
                shared,
                class: self.class,
                charged: Some(self.tenant.clone()),
            }),
            None => Poll::Pending,
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
            state
                .scheduler
                .remove(self.key)
                .map(|_| state.scheduler.class_len(self.class))
        };
        match left_queue {
            Some(depth) => AfterUnlock {
                depth: Some((self.class, depth)),
                ..AfterUnlock::default()
            }
            .run(&shared.store),
            // Dispatched but never claimed: the permit is ours to give back.
            None => shared.release(self.class, Some(&self.tenant)),
        }
    }
}

impl fmt::Debug for Ticket {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Ticket").field("key", &self.key).finish()
    }
}
