//! What a dispatch leaves to do once the fair queue's lock is released, as data: the core
//! (`queues.rs`) and the shell write it under the lock, `after_unlock.rs` carries it out.

use std::task::Waker;

use tokio::time::Instant;

use super::Acquire;
use crate::gate::Taken;
use crate::store::SlotLease;
use crate::{Priority, TenantId, Tier};

/// What a dispatch leaves to do once the lock is released.
#[derive(Default)]
pub(super) struct AfterUnlock {
    pub(super) wake: Few<Waker>,
    /// Dispatches to record in the store: tenant, cost, tier weight, whether it queued.
    pub(super) served: Few<(TenantId, u64, u32, bool, Instant)>,
    pub(super) depth: Option<Priority>,
    pub(super) index: Option<Option<f64>>,
    /// Slot acquires to send (Redis).
    pub(super) acquires: Vec<Acquire>,
    pub(super) watch: bool,
    /// The rate gate's time changed while a watcher runs.
    pub(super) rewatch: bool,
    /// Slots and rate cells to give back, outside the lock.
    pub(super) drop_handed: Vec<Handed>,
    /// Wake-ups to pass on.
    pub(super) declined: Vec<Declined>,
}

/// Wake-ups of a flow this worker has no call for: passed on to the next in the fleet's
/// order, the worker leaving the flow with `leave`.
pub(super) struct Declined {
    pub(super) tier: Tier,
    pub(super) flow: String,
    pub(super) n: usize,
    pub(super) leave: bool,
}

/// What a dispatched request takes with it.
#[derive(Default)]
pub(super) struct Handed {
    pub(super) lease: Option<SlotLease>,
    pub(super) receipt: Taken,
}

/// Usually one (a dispatch hands out one place at a time): the first kept inline, so the
/// common case allocates nothing.
pub(super) struct Few<T> {
    pub(super) first: Option<T>,
    pub(super) rest: Vec<T>,
}

impl<T> Default for Few<T> {
    fn default() -> Self {
        Few {
            first: None,
            rest: Vec::new(),
        }
    }
}

impl<T> Few<T> {
    pub(super) fn push(&mut self, value: T) {
        match self.first {
            None => self.first = Some(value),
            Some(_) => self.rest.push(value),
        }
    }

    /// Runs `f` on each value in order (no iterator built and dropped for the usual one
    /// value or none).
    pub(super) fn for_each(self, mut f: impl FnMut(T)) {
        if let Some(first) = self.first {
            f(first);
        }
        if !self.rest.is_empty() {
            self.rest.into_iter().for_each(f);
        }
    }
}
