//! The shared cooldown gate, as this process knows it.
//!
//! After a 429 that said when to come back, an upstream is *closed* until a reopen time;
//! every worker holds new calls to it until then. This struct is the in-process copy: the
//! whole gate on the memory store, and on the Redis store the local copy that every worker
//! keeps up to date from the pub/sub message sent whenever any worker moves the gate (so
//! checking the gate is never a round trip).
//!
//! A gate only ever moves later: a longer 429 extends it, a shorter one never shortens it.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::time::Instant;

/// Reopen times per upstream.
#[derive(Debug)]
pub(crate) struct CooldownGates {
    gates: Mutex<HashMap<String, Instant>>,
    /// The furthest reopening of any gate, in ns after `base`: while it is past, every gate
    /// is open and a check takes no lock (the common case, on the hot path).
    latest: AtomicU64,
    base: Instant,
}

impl Default for CooldownGates {
    fn default() -> Self {
        CooldownGates {
            gates: Mutex::default(),
            latest: AtomicU64::new(0),
            base: Instant::now(),
        }
    }
}

impl CooldownGates {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Instant>> {
        // Plain instants: a panic elsewhere leaves them usable.
        crate::sync::lock(&self.gates)
    }

    /// Closes `upstream` for at least `delay` from now and returns how long it stays
    /// closed (longer when an earlier gate reaches further).
    pub(crate) fn extend(&self, upstream: &str, delay: Duration) -> Duration {
        let now = Instant::now();
        let want = now + delay.min(MAX_GATE);
        let mut gates = self.lock();
        // Forget gates long open again, so names seen once do not pile up.
        if gates.len() > 64 {
            gates.retain(|_, reopen| *reopen > now);
        }
        let reopen = match gates.get_mut(upstream) {
            Some(reopen) => {
                *reopen = (*reopen).max(want);
                *reopen
            }
            None => {
                gates.insert(upstream.to_owned(), want);
                want
            }
        };
        let since_base = reopen.saturating_duration_since(self.base).as_nanos();
        self.latest.fetch_max(
            u64::try_from(since_base).unwrap_or(u64::MAX),
            Ordering::AcqRel,
        );
        reopen.saturating_duration_since(now)
    }

    /// How long `upstream` stays closed; `None` when it is open.
    pub(crate) fn remaining(&self, upstream: &str) -> Option<Duration> {
        let latest = self.latest.load(Ordering::Acquire);
        if latest == 0 {
            // No gate was ever closed: no clock read.
            return None;
        }
        let now = Instant::now();
        let since_base = now.saturating_duration_since(self.base).as_nanos();
        if u128::from(latest) <= since_base {
            return None;
        }
        let gates = self.lock();
        let reopen = *gates.get(upstream)?;
        Some(reopen.saturating_duration_since(now)).filter(|left| !left.is_zero())
    }
}

/// Gates further away than this are capped (a year is "closed" for any caller).
/// The longest a gate closes for, on every store (Redis turns it into a key TTL).
pub(crate) const MAX_GATE: Duration = Duration::from_secs(24 * 3600);

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_longer_gate_extends_and_a_shorter_one_never_shortens() {
        let gates = CooldownGates::default();
        assert_eq!(gates.remaining("up"), None);
        assert_eq!(
            gates.extend("up", Duration::from_secs(10)),
            Duration::from_secs(10)
        );
        assert_eq!(
            gates.extend("up", Duration::from_secs(3)),
            Duration::from_secs(10)
        );
        tokio::time::advance(Duration::from_secs(2)).await;
        assert_eq!(gates.remaining("up"), Some(Duration::from_secs(8)));
        assert_eq!(
            gates.extend("up", Duration::from_secs(20)),
            Duration::from_secs(20)
        );
        assert_eq!(gates.remaining("other"), None);
        tokio::time::advance(Duration::from_secs(20)).await;
        assert_eq!(gates.remaining("up"), None);
        assert_eq!(gates.extend("up", Duration::MAX), MAX_GATE);
    }
}
