//! The key check, with failed attempts slowed per source address.
//!
//! Each address (an IPv4 address, or an IPv6 /64) has a small token bucket that only
//! failures draw from: `burst` unknown keys at once, then `per_sec` a second. While its
//! bucket is empty, a request from that address is answered `429` with `retry-after`
//! *without its key being checked*: answering a right guess differently from a wrong one
//! would let the guessing go on at full speed. Keys that authenticated from that address
//! before (remembered as a salted hash of address and key, for an hour) are still checked
//! and served: a team behind the same NAT as a guesser is not slowed.
//!
//! Both tables are bounded, so an attacker with many addresses costs a few MB at most.

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::Duration;

use fairgate::extract::KeyTable;
use tokio::time::Instant;

/// Addresses with a bucket at most; past it the refilled ones are forgotten first.
const MAX_ADDRESSES: usize = 65_536;
/// (address, key) pairs remembered as good at most.
const MAX_GOOD: usize = 65_536;
/// How long a key that authenticated from an address stays good there without use.
const GOOD_FOR: Duration = Duration::from_secs(3_600);

/// What the check says.
#[derive(Debug, PartialEq)]
pub(crate) enum Verdict {
    /// A known key.
    Known,
    /// No key or an unknown one: `401`.
    Unknown,
    /// Too many failures from this address: `429`, retry after this long.
    Slowed(Duration),
}

#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
struct Source(u128);

impl From<IpAddr> for Source {
    fn from(ip: IpAddr) -> Self {
        match ip.to_canonical() {
            IpAddr::V4(v4) => Source(u128::from(u32::from(v4))),
            // One /64 is one subscriber's network: its addresses count as one.
            IpAddr::V6(v6) => Source(u128::from(v6) & !((1u128 << 64) - 1) | (1 << 127)),
        }
    }
}

struct Bucket {
    tokens: f64,
    at: Instant,
}

/// The failed-authentication limiter; shared by every connection.
pub(crate) struct AuthGuard {
    burst: f64,
    per_sec: f64,
    buckets: Mutex<HashMap<Source, Bucket>>,
    good: Mutex<HashMap<u64, Instant>>,
    salt: RandomState,
}

impl AuthGuard {
    /// `burst` failures at once, `per_sec` a second after that, per address.
    pub(crate) fn new(burst: u32, per_sec: f64) -> AuthGuard {
        AuthGuard {
            burst: f64::from(burst.max(1)),
            per_sec: per_sec.max(0.001),
            buckets: Mutex::new(HashMap::new()),
            good: Mutex::new(HashMap::new()),
            salt: RandomState::new(),
        }
    }

    /// Addresses whose failures are being slowed now.
    pub(crate) fn slowed_addresses(&self) -> usize {
        let now = Instant::now();
        let buckets = self.buckets.lock().unwrap_or_else(|e| e.into_inner());
        buckets
            .values()
            .filter(|b| self.refilled(b, now) < 1.0)
            .count()
    }

    fn refilled(&self, bucket: &Bucket, now: Instant) -> f64 {
        let secs = now.saturating_duration_since(bucket.at).as_secs_f64();
        (bucket.tokens + secs * self.per_sec).min(self.burst)
    }

    /// Checks `key` (from `ip`) against `keys`.
    pub(crate) fn check(&self, ip: IpAddr, key: Option<&str>, keys: &KeyTable) -> Verdict {
        let source = Source::from(ip);
        let now = Instant::now();
        let pair = key.map(|key| self.salt.hash_one((source, key)));
        let empty_for = {
            let mut buckets = self.buckets.lock().unwrap_or_else(|e| e.into_inner());
            buckets.get_mut(&source).and_then(|bucket| {
                let tokens = self.refilled(bucket, now);
                (tokens < 1.0).then(|| Duration::from_secs_f64((1.0 - tokens) / self.per_sec))
            })
        };
        if let Some(wait) = empty_for {
            let was_good = pair.is_some_and(|pair| {
                let good = self.good.lock().unwrap_or_else(|e| e.into_inner());
                good.get(&pair)
                    .is_some_and(|at| now.saturating_duration_since(*at) < GOOD_FOR)
            });
            if !was_good {
                return Verdict::Slowed(wait);
            }
        }
        match (key.and_then(|key| keys.get(key)), pair) {
            (Some(_), Some(pair)) => {
                self.remember_good(pair, now);
                Verdict::Known
            }
            _ => {
                self.charge(source, now);
                Verdict::Unknown
            }
        }
    }

    fn remember_good(&self, pair: u64, now: Instant) {
        let mut good = self.good.lock().unwrap_or_else(|e| e.into_inner());
        if good.len() >= MAX_GOOD && !good.contains_key(&pair) {
            good.retain(|_, at| now.saturating_duration_since(*at) < GOOD_FOR);
            if good.len() >= MAX_GOOD {
                // Forgotten pairs are learned again at their next success.
                good.clear();
            }
        }
        good.insert(pair, now);
    }

    fn charge(&self, source: Source, now: Instant) {
        let mut buckets = self.buckets.lock().unwrap_or_else(|e| e.into_inner());
        if buckets.len() >= MAX_ADDRESSES && !buckets.contains_key(&source) {
            buckets.retain(|_, b| self.refilled(b, now) < self.burst);
            if buckets.len() >= MAX_ADDRESSES {
                buckets.clear();
            }
        }
        let bucket = buckets.entry(source).or_insert(Bucket {
            tokens: self.burst,
            at: now,
        });
        bucket.tokens = (self.refilled(bucket, now) - 1.0).max(0.0);
        bucket.at = now;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table() -> KeyTable {
        KeyTable::new().key("sk-good", "team", "premium")
    }

    #[tokio::test(start_paused = true)]
    async fn failures_past_the_burst_are_slowed_but_a_known_key_from_the_address_is_not() {
        let guard = AuthGuard::new(3, 1.0);
        let keys = table();
        let ip: IpAddr = "10.0.0.1".parse().unwrap();
        let other: IpAddr = "10.0.0.2".parse().unwrap();
        assert_eq!(guard.check(ip, Some("sk-good"), &keys), Verdict::Known);
        for _ in 0..3 {
            assert_eq!(guard.check(ip, Some("sk-bad"), &keys), Verdict::Unknown);
        }
        assert!(matches!(
            guard.check(ip, Some("sk-bad"), &keys),
            Verdict::Slowed(_)
        ));
        assert!(matches!(guard.check(ip, None, &keys), Verdict::Slowed(_)));
        assert_eq!(guard.check(ip, Some("sk-good"), &keys), Verdict::Known);
        assert_eq!(guard.check(other, Some("sk-bad"), &keys), Verdict::Unknown);
        assert_eq!(guard.slowed_addresses(), 1);
        tokio::time::advance(Duration::from_millis(1_001)).await;
        assert_eq!(guard.check(ip, Some("sk-bad"), &keys), Verdict::Unknown);
        assert!(matches!(
            guard.check(ip, Some("sk-bad"), &keys),
            Verdict::Slowed(_)
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn a_right_guess_while_slowed_is_not_told_apart_from_a_wrong_one() {
        let guard = AuthGuard::new(2, 1.0);
        let keys = table();
        let ip: IpAddr = "10.0.0.1".parse().unwrap();
        for _ in 0..2 {
            assert_eq!(guard.check(ip, Some("sk-bad"), &keys), Verdict::Unknown);
        }
        assert!(matches!(
            guard.check(ip, Some("sk-good"), &keys),
            Verdict::Slowed(_)
        ));
    }
}
