//! The key check, with failed attempts slowed per (address, key) and per address on
//! distinct keys.
//!
//! Two kinds of token bucket, both drawn from by failures only (`burst` at once, then
//! `per_sec` a second):
//!
//! - one per (address, key presented): a client retrying one bad key (a revoked key in a
//!   loop, a missing key) is slowed on that pair alone. The other users behind the same
//!   address (a NAT, a proxy) are not: their keys are other pairs.
//! - one per address, drawn from only by a failure with a key not failing from that address
//!   already (a new pair): a guesser cycling keys is slowed there.
//!
//! While a request's pair or its address is slowed, it is answered `429` with `retry-after`
//! **without its key being looked up**: the same answer, from the same steps, whatever key
//! it presents. A right guess made while slowed is told apart from a wrong one neither by
//! the answer nor by its time, so guessing goes no faster than the address's bucket allows.
//! (The `retry-after` is the address's wait, or a pair's longer one: a pair has a wait only
//! for a key that already failed, which the guesser knows is wrong.)
//!
//! The price: while one address guesses distinct keys, every user behind it is slowed too;
//! a lone client's bad key costs its neighbours nothing. No key is ever exempted by having
//! worked from the address before: such a key would be checked while the others are not,
//! which answers the guesser "right" for exactly the keys its neighbours use.
//!
//! An address is an IPv4 address or an IPv6 /64. The key is kept as a salted 64-bit hash
//! of (address, SHA-256 of the key), never in clear. Both tables are bounded (refilled
//! buckets are forgotten first, then all), so many addresses or keys cost a few MB at most.

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::Duration;

use fairgate::extract::KeyTable;
use tokio::time::Instant;

/// Addresses with a bucket at most; past it the refilled ones are forgotten first.
const MAX_ADDRESSES: usize = 65_536;
/// (address, key) pairs with a bucket at most; likewise.
const MAX_PAIRS: usize = 65_536;

/// What the check says.
#[derive(Debug, PartialEq)]
pub(crate) enum Verdict {
    /// A known key.
    Known,
    /// No key or an unknown one: `401`.
    Unknown,
    /// Too many failures from this address, or with this key from it: `429`, retry after
    /// this long.
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

#[derive(Clone, Copy)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

/// A bounded table of failure buckets.
struct Buckets<K> {
    map: HashMap<K, Bucket>,
    max: usize,
}

impl<K: std::hash::Hash + Eq + Copy> Buckets<K> {
    fn new(max: usize) -> Self {
        Buckets {
            map: HashMap::new(),
            max,
        }
    }
}

/// The failed-authentication limiter; shared by every connection.
pub(crate) struct AuthGuard {
    burst: f64,
    per_sec: f64,
    addresses: Mutex<Buckets<Source>>,
    pairs: Mutex<Buckets<u64>>,
    salt: RandomState,
}

impl AuthGuard {
    /// `burst` failures at once, `per_sec` a second after that: per (address, key), and per
    /// address for distinct keys.
    pub(crate) fn new(burst: u32, per_sec: f64) -> AuthGuard {
        AuthGuard {
            burst: f64::from(burst.max(1)),
            per_sec: per_sec.max(0.001),
            addresses: Mutex::new(Buckets::new(MAX_ADDRESSES)),
            pairs: Mutex::new(Buckets::new(MAX_PAIRS)),
            salt: RandomState::new(),
        }
    }

    /// Addresses whose failures are being slowed now (guessing distinct keys).
    pub(crate) fn slowed_addresses(&self) -> usize {
        let now = Instant::now();
        let addresses = self.addresses.lock().unwrap_or_else(|e| e.into_inner());
        addresses
            .map
            .values()
            .filter(|b| self.refilled(b, now) < 1.0)
            .count()
    }

    /// (Address, key) pairs whose failures are being slowed now (one bad key retried).
    pub(crate) fn slowed_keys(&self) -> usize {
        let now = Instant::now();
        let pairs = self.pairs.lock().unwrap_or_else(|e| e.into_inner());
        pairs
            .map
            .values()
            .filter(|b| self.refilled(b, now) < 1.0)
            .count()
    }

    fn refilled(&self, bucket: &Bucket, now: Instant) -> f64 {
        let secs = now.saturating_duration_since(bucket.at).as_secs_f64();
        (bucket.tokens + secs * self.per_sec).min(self.burst)
    }

    /// How long until `bucket` has a token again, if it has none now.
    fn empty_for(&self, bucket: Option<&Bucket>, now: Instant) -> Option<Duration> {
        let tokens = self.refilled(bucket?, now);
        (tokens < 1.0).then(|| Duration::from_secs_f64((1.0 - tokens) / self.per_sec))
    }

    /// Checks `key` (from `ip`) against `keys`.
    pub(crate) fn check(&self, ip: IpAddr, key: Option<&str>, keys: &KeyTable) -> Verdict {
        let source = Source::from(ip);
        let now = Instant::now();
        // Hashed once, for the pair and the look-up alike; "no key" is a pair of its own.
        let sha256 = key.map(KeyTable::sha256);
        let pair = self.salt.hash_one((source, sha256));
        let (pair_wait, known_pair) = {
            let pairs = self.pairs.lock().unwrap_or_else(|e| e.into_inner());
            let bucket = pairs.map.get(&pair);
            (self.empty_for(bucket, now), bucket.is_some())
        };
        let address_wait = {
            let addresses = self.addresses.lock().unwrap_or_else(|e| e.into_inner());
            self.empty_for(addresses.map.get(&source), now)
        };
        // Slowed: answered before the key is looked up, the same way for every key.
        if let Some(wait) = pair_wait.max(address_wait) {
            return Verdict::Slowed(wait);
        }
        if sha256.is_some_and(|sha256| keys.get_sha256(&sha256).is_some()) {
            return Verdict::Known;
        }
        self.charge(&self.pairs, pair, now);
        if !known_pair {
            // A key not failing from here already: one more distinct guess.
            self.charge(&self.addresses, source, now);
        }
        Verdict::Unknown
    }

    fn charge<K: std::hash::Hash + Eq + Copy>(
        &self,
        table: &Mutex<Buckets<K>>,
        key: K,
        now: Instant,
    ) {
        let mut table = table.lock().unwrap_or_else(|e| e.into_inner());
        let max = table.max;
        if table.map.len() >= max && !table.map.contains_key(&key) {
            table.map.retain(|_, b| self.refilled(b, now) < self.burst);
            if table.map.len() >= max {
                // Still full of drained buckets: start again. A forgotten pair counts as a
                // distinct key once more, a forgotten address has its burst back; memory
                // stays bounded whatever the number of addresses.
                table.map.clear();
            }
        }
        let bucket = table.map.entry(key).or_insert(Bucket {
            tokens: self.burst,
            at: now,
        });
        bucket.tokens = (self.refilled(bucket, now) - 1.0).max(0.0);
        bucket.at = now;
    }

    #[cfg(test)]
    fn sizes(&self) -> (usize, usize) {
        fn len<K>(table: &Mutex<Buckets<K>>) -> usize {
            table.lock().map_or(0, |t| t.map.len())
        }
        (len(&self.addresses), len(&self.pairs))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table() -> KeyTable {
        KeyTable::new()
            .key("sk-good", "team", "premium")
            .key("sk-other-user", "neighbour", "pro")
    }

    fn ip(text: &str) -> IpAddr {
        text.parse().unwrap()
    }

    #[tokio::test(start_paused = true)]
    async fn retrying_one_bad_key_slows_that_pair_only_not_the_other_keys_of_the_address() {
        let guard = AuthGuard::new(3, 1.0);
        let keys = table();
        let nat = ip("10.0.0.1");
        // A client retrying a revoked key twice a second for a minute.
        let mut unknown = 0;
        for _ in 0..120 {
            match guard.check(nat, Some("sk-revoked"), &keys) {
                Verdict::Unknown => unknown += 1,
                Verdict::Slowed(_) => {}
                Verdict::Known => panic!("a revoked key was served"),
            }
            tokio::time::advance(Duration::from_millis(500)).await;
        }
        // Its burst, then one a second.
        assert!((60..=64).contains(&unknown), "{unknown} checked");
        // The other users behind the address, whose keys it never presented: served.
        assert_eq!(guard.check(nat, Some("sk-good"), &keys), Verdict::Known);
        assert_eq!(
            guard.check(nat, Some("sk-other-user"), &keys),
            Verdict::Known
        );
        // And a typo from another user is checked, not slowed: one distinct key so far.
        assert_eq!(guard.check(nat, Some("sk-typo"), &keys), Verdict::Unknown);
        assert_eq!(guard.slowed_addresses(), 0);
        // A missing key is a pair of its own, slowed alone too.
        for _ in 0..3 {
            assert_eq!(guard.check(nat, None, &keys), Verdict::Unknown);
        }
        assert!(matches!(guard.check(nat, None, &keys), Verdict::Slowed(_)));
        assert!(guard.slowed_keys() >= 1);
        assert_eq!(guard.slowed_addresses(), 0);
        assert_eq!(guard.check(nat, Some("sk-good"), &keys), Verdict::Known);
    }

    #[tokio::test(start_paused = true)]
    async fn a_guesser_cycling_distinct_keys_is_slowed_and_its_address_refills() {
        let guard = AuthGuard::new(3, 1.0);
        let keys = table();
        let guesser = ip("10.0.0.1");
        for i in 0..3 {
            assert_eq!(
                guard.check(guesser, Some(&format!("sk-guess-{i}")), &keys),
                Verdict::Unknown
            );
        }
        assert_eq!(
            guard.check(guesser, Some("sk-guess-3"), &keys),
            Verdict::Slowed(Duration::from_secs(1))
        );
        assert_eq!(guard.slowed_addresses(), 1);
        // Another address is not slowed.
        assert_eq!(
            guard.check(ip("10.0.0.2"), Some("sk-guess-0"), &keys),
            Verdict::Unknown
        );
        // A /64 is one address.
        for i in 0..3 {
            let from = ip(&format!("2001:db8::{i}"));
            assert_eq!(
                guard.check(from, Some(&format!("sk-v6-{i}")), &keys),
                Verdict::Unknown
            );
        }
        assert!(matches!(
            guard.check(ip("2001:db8::ff"), Some("sk-v6-9"), &keys),
            Verdict::Slowed(_)
        ));
        // One guess a second after that.
        tokio::time::advance(Duration::from_millis(1_001)).await;
        assert_eq!(
            guard.check(guesser, Some("sk-guess-4"), &keys),
            Verdict::Unknown
        );
        assert!(matches!(
            guard.check(guesser, Some("sk-guess-5"), &keys),
            Verdict::Slowed(_)
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn while_slowed_a_right_key_and_a_wrong_one_get_the_same_answer() {
        let guard = AuthGuard::new(2, 1.0);
        let keys = table();
        let guesser = ip("10.0.0.1");
        for i in 0..2 {
            guard.check(guesser, Some(&format!("sk-guess-{i}")), &keys);
        }
        tokio::time::advance(Duration::from_millis(250)).await;
        let right = guard.check(guesser, Some("sk-good"), &keys);
        let wrong = guard.check(guesser, Some("sk-guess-new"), &keys);
        let none = guard.check(guesser, None, &keys);
        assert_eq!(right, Verdict::Slowed(Duration::from_millis(750)));
        assert_eq!(wrong, right);
        assert_eq!(none, right);
        // The answers charged nothing: at the refill, the next guess is checked.
        tokio::time::advance(Duration::from_millis(750)).await;
        assert_eq!(guard.check(guesser, Some("sk-good"), &keys), Verdict::Known);
    }

    #[tokio::test(start_paused = true)]
    async fn many_addresses_and_keys_keep_the_tables_bounded() {
        let guard = AuthGuard::new(1, 0.001);
        let keys = table();
        for i in 0..(MAX_ADDRESSES as u32 + 1_000) {
            let from = IpAddr::from((0x0a00_0000 + i).to_be_bytes());
            guard.check(from, Some("sk-bad"), &keys);
        }
        let (addresses, pairs) = guard.sizes();
        assert!(addresses <= MAX_ADDRESSES, "{addresses}");
        assert!(pairs <= MAX_PAIRS, "{pairs}");
        // A known key from a fresh address is still served.
        assert_eq!(
            guard.check(ip("192.0.2.1"), Some("sk-good"), &keys),
            Verdict::Known
        );
    }
}
