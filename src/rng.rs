//! A small seedable random source for jitter and probabilistic choices.
//!
//! SplitMix64: fast, tiny, and good enough for spreading retries and picking classes; not
//! for anything secret. Every layer that draws randomness takes a seed, so tests are
//! deterministic.

use std::time::{SystemTime, UNIX_EPOCH};

/// A seedable pseudo-random generator (SplitMix64).
#[derive(Clone, Debug)]
pub(crate) struct Rng {
    state: u64,
}

impl Rng {
    /// A generator that yields the same sequence for the same seed.
    pub(crate) fn seeded(seed: u64) -> Self {
        Rng { state: seed }
    }

    /// A generator seeded from the clock and the process id, for production use.
    pub(crate) fn from_entropy() -> Self {
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos() as u64;
        Rng::seeded(nanos ^ (u64::from(std::process::id()) << 32))
    }

    /// The next 64 random bits.
    pub(crate) fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A uniform number in [0, 1).
    pub(crate) fn unit(&mut self) -> f64 {
        // The top 53 bits fill an f64 mantissa exactly.
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_sequence_and_units_stay_in_range() {
        let (mut a, mut b) = (Rng::seeded(7), Rng::seeded(7));
        for _ in 0..1000 {
            assert_eq!(a.next_u64(), b.next_u64());
            let u = a.unit();
            b.unit();
            assert!((0.0..1.0).contains(&u));
        }
        assert_ne!(Rng::seeded(1).next_u64(), Rng::seeded(2).next_u64());
    }
}
