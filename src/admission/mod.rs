//! What the layers share about admitting a request: the slot caps, the answer of a request
//! that could not go in time, and the thresholds of demotion.
//!
//! The stack is the product: every promise holds from the moment a request enters the first
//! fairgate layer until its answer ends.
//!
//! - **One arrival.** The first layer that sees a job stamps its arrival
//!   ([`Job::arrived_at`](crate::Job::arrived_at)); every wait counts from that instant, so
//!   a tier's max wait is end to end, wherever in the stack the request waited. A retry is
//!   a new attempt: the retry layer starts its clock again when it sends the retry, after
//!   its backoff.
//! - **One order.** The fair queue is handed the slot layer's caps and the retry layer's
//!   rate as gates ([`SlotGate`](crate::SlotGate), [`RateGate`](crate::RateGate)) and decides who goes next whatever holds calls back.
//!   Nothing is registered in the store by one layer for another: the wires are passed, and
//!   [`FairgateLayer`](crate::FairgateLayer) shows every one.
//! - **Waiting holds nothing.** A request holds upstream capacity (a window permit, a slot,
//!   rate cells) only while it can go upstream or is talking to it.
//!
//! What the layers and the store both read is defined here, so neither imports the other:
//! the slot caps ([`SlotPolicy`]), the answer of a request that could not go in time
//! ([`Busy`], with what it waited for), and the thresholds of demotion ([`DemotionPolicy`],
//! read by the store's atomic check-and-demote). Each is used from the crate root
//! (`fairgate::Busy`), its one public path.

pub(crate) mod busy;
pub(crate) mod demotion;
pub(crate) mod policy;

pub(crate) use self::busy::{Busy, WaitReason};
pub(crate) use self::demotion::DemotionPolicy;
pub(crate) use self::policy::{SlotPolicy, TierLimit};

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
