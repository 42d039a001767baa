//! Shared pacing (GCRA) in process: the memory store's, and the Redis store's fallback. The
//! arithmetic is the crate's GCRA core; this module keeps the buckets per key.
//!
//! A call *reserves* its cells in every dimension at once and is told when to go: the
//! earliest moment every dimension conforms. Reserving (instead of "try again later") keeps
//! the order of arrival and wakes each waiter once, at its own time.

use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

use crate::gcra::{self, Gcra};
use crate::hash::HashMap;

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
    /// The bucket, in microseconds: one cell per `60 s / per_minute`, `burst` cells.
    pub(crate) fn rate(&self) -> Gcra {
        Gcra::new(
            60_000_000 / i64::from(self.per_minute.max(1)),
            i64::from(self.burst),
        )
    }

    /// The cells this call takes (at least 1, at most the burst).
    pub(crate) fn cells(&self) -> i64 {
        self.rate().cells(i64::from(self.cells))
    }

    /// One worker's share of the limit when `workers` pace alone (Redis away): rate and
    /// burst divided, at least 1 each, and the burst at most a second of the share. The
    /// fleet's bucket was being spent when Redis went away and no worker knows how much of
    /// it is left: a token limit's whole minute at once (a fresh bucket's burst) would
    /// overrun the provider's by that much.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn share_of(self, workers: u32) -> PaceLimit {
        let per_minute = super::per_worker(self.per_minute, workers);
        let a_second = (per_minute / 60).max(1);
        PaceLimit {
            per_minute,
            burst: super::per_worker(self.burst, workers).min(a_second),
            cells: self.cells,
        }
    }
}

/// Theoretical arrival times per pacing key and dimension, and the learned buckets.
#[derive(Debug)]
pub(crate) struct Pacers {
    tats: Mutex<HashMap<String, Vec<i64>>>,
    learned: Mutex<HashMap<String, LearnedBucket>>,
    /// Time is counted in microseconds from here.
    base: Instant,
}

impl Default for Pacers {
    fn default() -> Self {
        Pacers {
            tats: Mutex::default(),
            learned: Mutex::default(),
            base: Instant::now(),
        }
    }
}

impl Pacers {
    /// Microseconds since `base`.
    fn now_us(&self) -> i64 {
        let since = Instant::now().saturating_duration_since(self.base);
        i64::try_from(since.as_micros()).unwrap_or(i64::MAX / 4)
    }

    /// Reserves the cells of `limits` under `key`; returns how long to wait before going.
    pub(crate) fn reserve(&self, key: &str, limits: &[PaceLimit]) -> Duration {
        micros(self.reserve_at(key, limits, self.now_us()))
    }

    /// [`reserve`](Pacers::reserve) at `now` (microseconds); returns the wait in microseconds.
    pub(crate) fn reserve_at(&self, key: &str, limits: &[PaceLimit], now: i64) -> i64 {
        let mut tats = crate::sync::lock(&self.tats);
        if tats.len() > 1024 {
            tats.retain(|_, dims| dims.iter().any(|tat| *tat > now));
        }
        // The key is copied only the first time it is seen.
        if !tats.contains_key(key) {
            tats.insert(key.to_owned(), Vec::new());
        }
        let Some(dims) = tats.get_mut(key) else {
            return 0; // unreachable: inserted above
        };
        // A dimension not seen before starts idle.
        dims.resize(limits.len().max(dims.len()), now);
        let send = gcra::reserve(now, dims, |i| {
            limits.get(i).map(|limit| (limit.rate(), limit.cells()))
        });
        send - now
    }

    /// Applies `ask` to the learned bucket of `key` (see [`LearnedBucket::apply`]).
    pub(crate) fn learned(&self, key: &str, ask: &PaceAsk) -> PaceGrant {
        self.learned_at(key, ask, self.now_us())
    }

    /// [`learned`](Pacers::learned) at `now` (microseconds).
    pub(crate) fn learned_at(&self, key: &str, ask: &PaceAsk, now: i64) -> PaceGrant {
        let mut learned = crate::sync::lock(&self.learned);
        if learned.len() > 1024 {
            learned.retain(|_, bucket| !bucket.is_idle(now));
        }
        if !learned.contains_key(key) {
            learned.insert(key.to_owned(), LearnedBucket::default());
        }
        match learned.get_mut(key) {
            Some(bucket) => bucket.apply(now, ask),
            None => PaceGrant::default(), // unreachable: inserted above
        }
    }

    /// The limits learned for `key`, if any.
    pub(crate) fn learned_limits(&self, key: &str) -> LearnedLimits {
        let learned = crate::sync::lock(&self.learned);
        learned.get(key).map_or_else(LearnedLimits::default, |b| {
            LearnedLimits::from_array(b.limit)
        })
    }
}

// ---------------------------------------------------------------------------------------
// Learned pacing: the provider's own buckets, mirrored
// ---------------------------------------------------------------------------------------

/// The dimensions Anthropic reports, in this order everywhere (arrays, the Redis hash's
/// fields `l1..l4` / `t1..t4`, the script's arguments).
pub(crate) const DIMS: usize = 4;
/// The requests dimension's index.
pub(crate) const REQUESTS: usize = 0;
/// The input tokens dimension's index.
pub(crate) const INPUT: usize = 1;
/// The output tokens dimension's index.
pub(crate) const OUTPUT: usize = 2;
/// The combined tokens dimension's index (input and output).
pub(crate) const TOTAL: usize = 3;
/// The largest limit believed (per minute); a larger one is absurd and ignored.
pub(crate) const MAX_LIMIT: u32 = 1_000_000_000;

/// The per-minute limits an upstream key reported (the provider's
/// `anthropic-ratelimit-*-limit` headers), as the store holds them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LearnedLimits {
    /// Requests per minute.
    pub requests: Option<u32>,
    /// Input tokens per minute.
    pub input_tokens: Option<u32>,
    /// Output tokens per minute.
    pub output_tokens: Option<u32>,
    /// Tokens per minute (the combined limit Anthropic also reports).
    pub tokens: Option<u32>,
}

impl LearnedLimits {
    pub(crate) fn from_array(limits: [u32; DIMS]) -> Self {
        let get = |i: usize| Some(limits[i]).filter(|l| *l > 0);
        LearnedLimits {
            requests: get(0),
            input_tokens: get(1),
            output_tokens: get(2),
            tokens: get(3),
        }
    }

    /// Whether any limit is known.
    pub fn is_known(&self) -> bool {
        self.requests.is_some()
            || self.input_tokens.is_some()
            || self.output_tokens.is_some()
            || self.tokens.is_some()
    }
}

/// What an answer said, or what a call needs, sent to the learned bucket of one upstream
/// key in one operation (one script on Redis).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct PaceAsk {
    /// Aim at this share of each learned rate, in thousandths (e.g. 950).
    pub(crate) headroom_permille: u32,
    /// Per dimension, `(limit, remaining)` as an answer reported them (`limit` 0: absent).
    /// Values are already checked (limit in 1..=MAX_LIMIT).
    pub(crate) learn: [(u32, u32); DIMS],
    /// 0: no answer; 1: an answer that is not a throttle; 2: a throttle.
    pub(crate) answered: u8,
    /// The headers in `learn` waited in a worker for its next reservation: they may be
    /// older than a limit another worker reported since, so they resynchronise a limit the
    /// store holds (or learn one it has none of) but never replace a different one.
    pub(crate) queued: bool,
    /// Cells charged after the fact (a correction; negative gives back).
    pub(crate) charge: [i64; DIMS],
    /// Cells for the calls about to go (all 0: a report only).
    pub(crate) take: [u32; DIMS],
    /// How long a probe (cold start or recovery) holds the lease, in microseconds.
    pub(crate) probe_lease_us: i64,
    /// How long after a throttle the key recovers (one probe first) at most, in
    /// microseconds, unless an answer shows room first.
    pub(crate) recover_us: i64,
    /// The longest a held call waits before asking again, in microseconds.
    pub(crate) poll_us: i64,
}

/// The learned bucket's answer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct PaceGrant {
    /// The cells are taken: go after this wait.
    pub(crate) wait: Duration,
    /// Not taken: another call is probing this key (cold start or recovery); ask again
    /// after this. Zero when the cells were taken.
    pub(crate) hold: Duration,
    /// This call is the probe: its answer tells the fleet.
    pub(crate) probe: bool,
    /// The limits known for the key (0: unknown).
    pub(crate) limits: [u32; DIMS],
    /// 0: no answer yet (cold); 1: answers carry no limits; 2: limits learned.
    pub(crate) mode: u8,
    /// The key is recovering from a throttle (one probe before the rest).
    pub(crate) recovering: bool,
}

/// One upstream key's mirror of the provider's buckets: per dimension the learned limit and
/// a GCRA theoretical arrival time, plus the slow-start / recovery probe lease. Times in
/// microseconds on the store's clock.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct LearnedBucket {
    pub(crate) limit: [u32; DIMS],
    pub(crate) tat: [i64; DIMS],
    pub(crate) mode: u8,
    /// A probe holds the lease until then.
    pub(crate) probe_until: i64,
    /// Recovering from a throttle until then (0: not).
    pub(crate) recover_until: i64,
}

/// The bucket (µs per cell, capacity in cells) the pacer uses for a dimension whose
/// provider limit is `limit` per minute, aiming at `headroom_permille` (the policy's 0.1-1,
/// or a worker's share of it while Redis is away): the rate is a little under the
/// provider's; requests may burst one second's worth (the provider enforces per-minute
/// limits over shorter intervals too), tokens their whole minute (the provider's bucket).
pub(crate) fn learned_rate(dim: usize, limit: u32, headroom_permille: u32) -> Gcra {
    let per_minute =
        (f64::from(limit) * f64::from(headroom_permille.clamp(1, 1000)) / 1000.0).max(1.0);
    let interval = (60_000_000.0 / per_minute).max(1.0) as i64;
    let capacity = if dim == REQUESTS {
        (per_minute / 60.0).floor().max(1.0)
    } else {
        per_minute.floor().max(1.0)
    } as i64;
    Gcra::new(interval, capacity)
}

fn micros(us: i64) -> Duration {
    Duration::from_micros(u64::try_from(us).unwrap_or(0))
}

impl LearnedBucket {
    fn is_idle(&self, now: i64) -> bool {
        self.tat.iter().all(|t| *t <= now) && self.probe_until <= now && self.recover_until <= now
    }

    /// Learns, charges, and takes the cells of `ask` at `now`.
    pub(crate) fn apply(&mut self, now: i64, ask: &PaceAsk) -> PaceGrant {
        let h = ask.headroom_permille;
        // 1. What the answer said: learn each limit and resynchronise from `-remaining`.
        let mut learned_any = false;
        for d in 0..DIMS {
            let (limit, remaining) = ask.learn[d];
            if limit == 0 || limit > MAX_LIMIT {
                continue;
            }
            if ask.queued && self.limit[d] != 0 && self.limit[d] != limit {
                continue; // stale: a newer answer changed this limit
            }
            learned_any = true;
            let floor = learned_rate(d, limit, h).with_room(now, i64::from(remaining.min(limit)));
            if self.limit[d] != limit {
                // A new limit: start again from what the provider says is left.
                self.limit[d] = limit;
                self.tat[d] = floor;
            } else {
                // Only later: our reservations since that answer are already in the TAT.
                self.tat[d] = self.tat[d].max(floor);
            }
        }
        if learned_any {
            self.mode = 2;
        }
        if ask.answered != 0 && self.mode == 0 {
            // Any answer, a throttle too, ends the cold start: without limits, no pacing.
            self.mode = 1;
        }
        match ask.answered {
            1 => {
                self.recover_until = 0;
                self.probe_until = 0;
            }
            2 => {
                self.recover_until = self.recover_until.max(now.saturating_add(ask.recover_us));
                self.probe_until = 0;
            }
            _ => {}
        }
        if self.recover_until != 0 && now >= self.recover_until {
            self.recover_until = 0;
        }
        // 2. Corrections after the fact.
        for d in 0..DIMS {
            if ask.charge[d] != 0 && self.limit[d] > 0 {
                let rate = learned_rate(d, self.limit[d], h);
                self.tat[d] = rate.charge(self.tat[d], now, ask.charge[d]);
            }
        }
        let mut grant = PaceGrant {
            limits: self.limit,
            mode: self.mode,
            recovering: self.recover_until > now,
            ..PaceGrant::default()
        };
        if ask.take.iter().all(|c| *c == 0) {
            return grant;
        }
        // 3. Cold start or recovery: one probe at a time, the rest wait for its answer.
        if self.mode == 0 || self.recover_until > now {
            if self.probe_until > now {
                let left = (self.probe_until - now).clamp(1_000, ask.poll_us.max(1_000));
                grant.hold = Duration::from_micros(left as u64);
                return grant;
            }
            self.probe_until = now.saturating_add(ask.probe_lease_us.max(1_000));
            grant.probe = true;
        }
        // 4. Take the cells: GCRA over every learned dimension at once.
        let limits = self.limit;
        let send = gcra::reserve(now, &mut self.tat, |d| {
            (limits[d] > 0 && ask.take[d] > 0)
                .then(|| (learned_rate(d, limits[d], h), i64::from(ask.take[d])))
        });
        grant.wait = micros(send - now);
        grant
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
    fn a_workers_share_divides_rate_and_burst_bursts_a_second_at_most_and_never_reaches_zero() {
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
        // A token limit bursts its minute; a share bursts a second of the share.
        let tokens = PaceLimit {
            per_minute: 30_000,
            burst: 30_000,
            cells: 10,
        };
        let quarter = tokens.share_of(4);
        assert_eq!((quarter.per_minute, quarter.burst), (7_500, 125));
        assert_eq!(tokens.share_of(1).burst, 500);
    }

    #[test]
    fn a_queued_report_never_replaces_a_newer_limit() {
        let report = |limit: u32, queued: bool| PaceAsk {
            headroom_permille: 1000,
            learn: [(limit, limit), (0, 0), (0, 0), (0, 0)],
            answered: 1,
            queued,
            ..PaceAsk::default()
        };
        let mut bucket = LearnedBucket::default();
        // Queued headers still teach a key that knows nothing yet.
        bucket.apply(0, &report(1_200, true));
        assert_eq!(bucket.limit[REQUESTS], 1_200);
        // A fresh answer changes the limit; headers queued before it do not change it back.
        bucket.apply(1, &report(480, false));
        bucket.apply(2, &report(1_200, true));
        assert_eq!(bucket.limit[REQUESTS], 480);
        bucket.apply(3, &report(1_200, false));
        assert_eq!(bucket.limit[REQUESTS], 1_200);
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
