//! How the layers cooperate when they are stacked: what they share about admitting a request.
//!
//! The stack is the product: every promise holds from the moment a request enters the first
//! fairgate layer until its answer ends. The layers import nothing of each other; they
//! cooperate only through the [`Store`](crate::Store) and the request's [`Job`](crate::Job):
//!
//! - **One arrival.** The first layer that sees a job stamps its arrival
//!   ([`Job::arrived_at`](crate::Job::arrived_at)); every wait counts from that instant, so
//!   a tier's max wait is end to end, wherever in the stack the request waited: the fair
//!   queue, the slot layer, and [`RetryAfterBackoff`](crate::RetryAfterBackoff)'s holds of a
//!   first attempt (the gate, pacing, slow start) all answer [`Busy`] at the deadline. A
//!   retry is a new attempt: the retry layer starts its clock again.
//! - **The caps are the store's.** [`TierSlotLimitLayer::new`](crate::TierSlotLimitLayer::new)
//!   registers its [`SlotPolicy`] with its store (the first policy registered on a store is
//!   the one shared; the caps are the fleet's budget, and the store is what the fleet
//!   shares). A [`DrrFairness`](crate::DrrFairness) on the same store then dispatches only
//!   requests whose tier slot it can take: it takes the slot itself, at the moment the
//!   request is dispatched, in fair order among the requests that can go — a full tier never
//!   holds a window permit another tier could use, and a flood of a capped tier never delays
//!   another tier. It marks the job as holding a slot, and a `TierSlotLimit` below it lets
//!   such a request through without taking a second one. In the other order (`TierSlotLimit`
//!   outside `DrrFairness`) the slot layer takes the slot and the fair queue sees the mark.
//! - **Waiting holds nothing.** A request holds upstream capacity (a window permit, a slot)
//!   only while it can go upstream or is talking to it. Recommended order: `PriorityClassify`,
//!   `RetryAfterBackoff`, `DrrFairness`, `TierSlotLimit`, then the client. With the retry layer
//!   outside the fair queue, a call held behind a closed cooldown gate, or sleeping before a
//!   retry, has given its permit and its slot back; the retry goes through the fair queue
//!   again (charged its estimate again, as any call) and takes a slot again.
//!
//! Each layer still works alone and in any order. What the layers and the store both read
//! lives here, so neither imports the other: the slot caps ([`SlotPolicy`]), the answer of a
//! request that got no slot in time ([`Busy`]), and the thresholds of demotion
//! ([`DemotionPolicy`], read by the store's atomic check-and-demote).

mod busy;
mod demotion;
mod policy;

pub use self::busy::Busy;
pub use self::demotion::{DemotionPolicy, DemotionPolicyBuilder};
pub use self::policy::{SlotPolicy, SlotPolicyBuilder, TierLimit};

use tokio::time::Instant;

use crate::Tier;

/// Logs `queue.slow_wait` once, when a wait for a slot passes the policy's threshold:
/// the fair queue's waits and the slot layer's own, the same event.
pub(crate) struct SlowWait {
    at: Instant,
    warned: bool,
    started: Instant,
}

impl SlowWait {
    /// A wait that began at `started` and warns `after` it.
    pub(crate) fn new(started: Instant, after: std::time::Duration) -> Self {
        SlowWait {
            at: crate::time::after(started, after),
            warned: false,
            started,
        }
    }

    /// When the warning is due, if it has not been given.
    pub(crate) fn next(&self) -> Option<Instant> {
        (!self.warned).then_some(self.at)
    }

    pub(crate) fn check(&mut self, tier: &Tier) {
        let now = Instant::now();
        if !self.warned && now >= self.at {
            self.warned = true;
            tracing::warn!(
                name: "queue.slow_wait",
                tier = %tier,
                waited_secs = now.saturating_duration_since(self.started).as_secs_f64(),
                "request still waiting for a slot"
            );
        }
    }
}
