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

/// How often each tier logs `queue.slow_wait` at most.
pub(crate) const SLOW_WAIT_EVERY: std::time::Duration = std::time::Duration::from_secs(10);

/// Tiers whose slow waits are folded; a tier past them (never, with a policy's tiers) logs
/// each of its own.
const FOLDED_TIERS: usize = 64;

/// The slow waits of one slot layer (and the fair queue handed its gate), folded per tier:
/// the first of each [`SLOW_WAIT_EVERY`] is logged at once, with how many more there were
/// in the window before it and the longest of them. A flood of slow waits is one line per
/// tier per window, not one per request.
///
/// # Clone
/// Cheap; clones fold into the same counts.
#[derive(Clone, Default)]
pub(crate) struct SlowWaits {
    tiers: std::sync::Arc<std::sync::Mutex<std::collections::HashMap<Tier, Fold>>>,
}

/// One tier's window: when its logged wait was, and the waits folded since.
struct Fold {
    logged: Instant,
    more: u64,
    longest: std::time::Duration,
}

impl SlowWaits {
    /// A wait of `tier` passed the threshold, `waited` so far: logged, or folded into the
    /// tier's window.
    fn record(&self, tier: &Tier, waited: std::time::Duration) {
        let now = Instant::now();
        let mut tiers = crate::sync::lock(&self.tiers);
        let full = tiers.len() >= FOLDED_TIERS;
        let fold = match tiers.get_mut(tier) {
            Some(fold) if now.saturating_duration_since(fold.logged) < SLOW_WAIT_EVERY => {
                fold.more += 1;
                fold.longest = fold.longest.max(waited);
                return;
            }
            Some(fold) => std::mem::replace(fold, Fold::new(now)),
            None if full => Fold::new(now),
            None => {
                tiers.insert(tier.clone(), Fold::new(now));
                Fold::new(now)
            }
        };
        drop(tiers);
        tracing::warn!(
            name: "queue.slow_wait",
            tier = %tier,
            waited_secs = waited.as_secs_f64(),
            folded_before = fold.more,
            folded_longest_secs = fold.longest.as_secs_f64(),
            "request still waiting for a slot (with folded_before more in this tier's \
             previous 10 s, the longest folded_longest_secs)"
        );
    }
}

impl Fold {
    fn new(logged: Instant) -> Self {
        Fold {
            logged,
            more: 0,
            longest: std::time::Duration::ZERO,
        }
    }
}

/// Tells [`SlowWaits`] once, when a wait for a slot passes the policy's threshold: the
/// fair queue's waits and the slot layer's own, the same event.
pub(crate) struct SlowWait {
    at: Instant,
    warned: bool,
    started: Instant,
    folds: SlowWaits,
}

impl SlowWait {
    /// A wait that began at `started` and tells `folds` `after` it.
    pub(crate) fn new(started: Instant, after: std::time::Duration, folds: SlowWaits) -> Self {
        SlowWait {
            at: crate::time::after(started, after),
            warned: false,
            started,
            folds,
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
            let waited = now.saturating_duration_since(self.started);
            self.folds.record(tier, waited);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_tiers_slow_waits_fold_into_one_line_per_window() {
        let folds = SlowWaits::default();
        let (premium, pro) = (Tier::new("premium"), Tier::new("pro"));
        let folded = |tier: &Tier| {
            let tiers = crate::sync::lock(&folds.tiers);
            tiers.get(tier).map(|f| (f.more, f.longest))
        };
        for n in 0..40u64 {
            folds.record(&premium, Duration::from_millis(3_000 + n));
        }
        folds.record(&pro, Duration::from_secs(5));
        // The first of each tier was logged; the other 39 premium waits are folded.
        assert_eq!(folded(&premium), Some((39, Duration::from_millis(3_039))));
        assert_eq!(folded(&pro), Some((0, Duration::ZERO)));
        tokio::time::advance(SLOW_WAIT_EVERY - Duration::from_millis(1)).await;
        folds.record(&premium, Duration::from_secs(4));
        assert_eq!(folded(&premium), Some((40, Duration::from_secs(4))));
        // A new window: logged (with the 40 folded before it), and counting starts again.
        tokio::time::advance(Duration::from_millis(1)).await;
        folds.record(&premium, Duration::from_secs(3));
        assert_eq!(folded(&premium), Some((0, Duration::ZERO)));
    }
}
