//! Shared pacing (GCRA) in process: the memory store's, and the Redis store's fallback. The
//! same arithmetic as `scripts/pace.lua`.
//!
//! A call *reserves* its cells in every dimension at once and is told when to go: the
//! earliest moment every dimension conforms. Reserving (instead of "try again later") keeps
//! the order of arrival and wakes each waiter once, at its own time.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

/// One dimension of a pacing request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PaceLimit {
    /// Cells allowed per minute (at least 1).
    pub per_minute: u32,
    /// Cells that may go back to back before the even pace applies (at least 1).
    pub burst: u32,
    /// Cells this call takes (clamped to the burst: a call larger than the burst takes it
    /// all rather than never going).
    pub cells: u32,
}

impl PaceLimit {
    /// The emission interval and this call's tolerance, in microseconds: a call of `n`
    /// cells conforms once the theoretical arrival time is at most `(burst - n)` intervals
    /// ahead (the bucket holds `burst` cells).
    pub(crate) fn interval_and_tolerance_us(&self) -> (u64, u64) {
        let interval = 60_000_000 / u64::from(self.per_minute.max(1));
        let room = u64::from(self.burst.max(1)) - self.cells();
        (interval, interval * room)
    }

    pub(crate) fn cells(&self) -> u64 {
        u64::from(self.cells.clamp(1, self.burst.max(1)))
    }

    /// One worker's share of the limit when `workers` pace alone (Redis away): rate and
    /// burst divided, at least 1 each.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn share_of(self, workers: u32) -> PaceLimit {
        PaceLimit {
            per_minute: super::per_worker(self.per_minute, workers),
            burst: super::per_worker(self.burst, workers),
            cells: self.cells,
        }
    }
}

/// Theoretical arrival times per pacing key and dimension.
#[derive(Debug, Default)]
pub(crate) struct Pacers {
    tats: Mutex<HashMap<String, Vec<Instant>>>,
}

impl Pacers {
    /// Reserves the cells of `limits` under `key`; returns how long to wait before going.
    pub(crate) fn reserve(&self, key: &str, limits: &[PaceLimit]) -> Duration {
        let now = Instant::now();
        let mut tats = crate::sync::lock(&self.tats);
        if tats.len() > 1024 {
            tats.retain(|_, dims| dims.iter().any(|tat| *tat > now));
        }
        // The key is copied only the first time it is seen.
        if !tats.contains_key(key) {
            tats.insert(key.to_owned(), Vec::new());
        }
        let Some(dims) = tats.get_mut(key) else {
            return Duration::ZERO; // unreachable: inserted above
        };
        dims.resize(limits.len().max(dims.len()), now);
        let mut send = now;
        for (limit, tat) in limits.iter().zip(dims.iter()) {
            let (_, tolerance) = limit.interval_and_tolerance_us();
            let at = (*tat).max(now);
            let at = at
                .checked_sub(Duration::from_micros(tolerance))
                .unwrap_or(now);
            send = send.max(at);
        }
        for (limit, tat) in limits.iter().zip(dims.iter_mut()) {
            let (interval, _) = limit.interval_and_tolerance_us();
            *tat = (*tat).max(send) + Duration::from_micros(interval * limit.cells());
        }
        send.saturating_duration_since(now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const RPM: PaceLimit = PaceLimit {
        per_minute: 60,
        burst: 1,
        cells: 1,
    };

    #[test]
    fn a_workers_share_divides_rate_and_burst_and_never_reaches_zero() {
        let limit = PaceLimit {
            per_minute: 600,
            burst: 10,
            cells: 4,
        };
        let half = limit.share_of(2);
        assert_eq!((half.per_minute, half.burst, half.cells), (300, 5, 4));
        assert_eq!(limit.share_of(0), limit);
        assert_eq!(limit.share_of(1), limit);
        let tiny = limit.share_of(10_000);
        assert_eq!((tiny.per_minute, tiny.burst), (1, 1));
    }

    #[tokio::test(start_paused = true)]
    async fn reservations_go_one_interval_apart_and_every_dimension_must_conform() {
        let pacers = Pacers::default();
        let waits: Vec<_> = (0..3).map(|_| pacers.reserve("up", &[RPM])).collect();
        assert_eq!(waits, [0, 1, 2].map(Duration::from_secs));
        assert_eq!(pacers.reserve("other", &[RPM]), Duration::ZERO);

        let tokens = PaceLimit {
            per_minute: 600,
            burst: 600,
            cells: 600,
        };
        let both = Pacers::default();
        assert_eq!(both.reserve("k", &[RPM, tokens]), Duration::ZERO);
        // The request dimension allows one a second; the token one is empty for a minute.
        assert_eq!(both.reserve("k", &[RPM, tokens]), Duration::from_secs(60));
    }
}
