//! GCRA, the generic cell rate algorithm: the arithmetic of every pacer in the crate, with no
//! clock and no state of its own.
//!
//! A bucket is a rate — an emission interval (time per cell) — and a capacity (cells that may
//! go back to back). Its whole state is one number, the theoretical arrival time (TAT): the
//! moment the bucket would be full again had nothing more been taken. A call of `n` cells
//! conforms once the TAT is at most `capacity - n` intervals ahead of now, and taking them
//! pushes the TAT `n` intervals further. Any window of length `t` then admits at most
//! `capacity + t / interval` cells.
//!
//! Times are plain integers in the caller's unit (microseconds for the store, which Redis's
//! clock counts in; nanoseconds for a layer's own pacer): the caller reads its clock and
//! passes `now`, so the rules here are tested without one.

/// One bucket's rate: the emission interval and the capacity, both at least 1.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Gcra {
    interval: i64,
    capacity: i64,
}

impl Gcra {
    /// A bucket refilling one cell per `interval` and holding `capacity` cells (each at
    /// least 1).
    pub(crate) fn new(interval: i64, capacity: i64) -> Self {
        Gcra {
            interval: interval.max(1),
            capacity: capacity.max(1),
        }
    }

    pub(crate) fn interval(&self) -> i64 {
        self.interval
    }

    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn capacity(&self) -> i64 {
        self.capacity
    }

    /// The cells a call asking for `asked` takes: at least 1, and at most the capacity — a
    /// call larger than the bucket takes all of it rather than never going.
    pub(crate) fn cells(&self, asked: i64) -> i64 {
        asked.clamp(1, self.capacity)
    }

    /// How far ahead of now the TAT may be for `cells` to conform: the room the rest of
    /// the bucket leaves.
    pub(crate) fn tolerance(&self, cells: i64) -> i64 {
        (self.capacity - self.cells(cells)).saturating_mul(self.interval)
    }

    /// The earliest moment, `now` or later, at which `cells` conform under `tat`.
    pub(crate) fn conforms_at(&self, tat: i64, now: i64, cells: i64) -> i64 {
        now.max(tat.saturating_sub(self.tolerance(cells)))
    }

    /// The TAT once `cells` go at `at`.
    pub(crate) fn take(&self, tat: i64, at: i64, cells: i64) -> i64 {
        tat.max(at)
            .saturating_add(self.cells(cells).saturating_mul(self.interval))
    }

    /// The TAT of a bucket that has room for `room` cells at `now` (what a provider's
    /// "remaining" header says): the missing cells are still to refill.
    pub(crate) fn with_room(&self, now: i64, room: i64) -> i64 {
        let missing = self.capacity - room.clamp(0, self.capacity);
        now.saturating_add(missing.saturating_mul(self.interval))
    }

    /// The TAT once `cells` are charged after the fact (negative: given back). A bucket
    /// never holds more than it did at `now`'s full refill: the result is never before
    /// `now`.
    pub(crate) fn charge(&self, tat: i64, now: i64, cells: i64) -> i64 {
        tat.max(now)
            .saturating_add(cells.saturating_mul(self.interval))
            .max(now)
    }
}

/// Reserves a call's cells in several buckets at once: the call goes when every one
/// conforms, and each bucket's TAT moves on from that moment. `tats` holds the buckets'
/// TATs; `ask(i)` gives bucket `i`'s rate and the cells asked of it, or `None` to leave it
/// out. Returns the moment the call goes (`now` or later).
///
/// Reserving, rather than answering "try later", keeps the order of arrival: a later call
/// is told a later moment.
pub(crate) fn reserve(
    now: i64,
    tats: &mut [i64],
    ask: impl Fn(usize) -> Option<(Gcra, i64)>,
) -> i64 {
    let mut send = now;
    for (i, tat) in tats.iter().enumerate() {
        if let Some((rate, cells)) = ask(i) {
            send = send.max(rate.conforms_at(*tat, now, cells));
        }
    }
    for (i, tat) in tats.iter_mut().enumerate() {
        if let Some((rate, cells)) = ask(i) {
            *tat = rate.take(*tat, send, cells);
        }
    }
    send
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use proptest::test_runner::RngSeed;

    fn config() -> ProptestConfig {
        ProptestConfig {
            cases: 256,
            rng_seed: RngSeed::Fixed(0x6763_7261),
            ..ProptestConfig::default()
        }
    }

    fn rate() -> impl Strategy<Value = Gcra> {
        (1i64..2_000, 1i64..40).prop_map(|(interval, capacity)| Gcra::new(interval, capacity))
    }

    /// Calls as (time since the previous one, cells asked of each of three buckets).
    fn calls() -> impl Strategy<Value = Vec<(i64, [i64; 3])>> {
        prop::collection::vec((0i64..3_000, [1i64..60, 1i64..60, 1i64..60]), 1..80)
    }

    /// Runs `calls` through `reserve` over `rates`; returns when each went and the cells
    /// each bucket granted it.
    fn run(rates: &[Gcra], calls: &[(i64, [i64; 3])]) -> Vec<(i64, [i64; 3])> {
        let mut tats = vec![0; rates.len()];
        let mut now = 0;
        let mut out = Vec::new();
        for (advance, asked) in calls {
            now += advance;
            let send = reserve(now, &mut tats, |i| Some((rates[i], asked[i])));
            let mut granted = [0; 3];
            for (i, rate) in rates.iter().enumerate() {
                granted[i] = rate.cells(asked[i]);
            }
            out.push((send, granted));
        }
        out
    }

    #[test]
    fn an_idle_bucket_lets_its_capacity_go_at_once_then_one_cell_an_interval() {
        let rate = Gcra::new(1_000, 3);
        let mut tats = [0];
        let sends: Vec<i64> = (0..5)
            .map(|_| reserve(10, &mut tats, |_| Some((rate, 1))))
            .collect();
        assert_eq!(sends, [10, 10, 10, 1_010, 2_010]);
        // A call larger than the bucket takes all of it: it waits for a full bucket.
        assert_eq!(rate.conforms_at(tats[0], 2_010, 50), 5_010);
    }

    proptest! {
        #![proptest_config(config())]

        #[test]
        fn no_window_grants_more_than_the_capacity_plus_the_rate_times_its_length(
            rates in prop::collection::vec(rate(), 1..=3),
            calls in calls(),
        ) {
            let out = run(&rates, &calls);
            for (b, rate) in rates.iter().enumerate() {
                for first in 0..out.len() {
                    let mut granted = 0;
                    for (send, cells) in &out[first..] {
                        granted += cells[b];
                        let span = send - out[first].0;
                        prop_assert!(
                            granted <= rate.capacity + span / rate.interval,
                            "{granted} cells in {span} under {rate:?}"
                        );
                    }
                }
            }
        }

        #[test]
        fn calls_go_in_the_order_they_asked(
            rates in prop::collection::vec(rate(), 1..=3),
            calls in calls(),
        ) {
            let out = run(&rates, &calls);
            let mut now = 0;
            for ((send, _), (advance, _)) in out.iter().zip(&calls) {
                now += advance;
                prop_assert!(*send >= now, "a call never goes before it asks");
            }
            for pair in out.windows(2) {
                prop_assert!(pair[0].0 <= pair[1].0);
            }
        }

        #[test]
        fn asking_more_cells_never_goes_sooner(
            rates in prop::collection::vec(rate(), 1..=3),
            calls in calls(),
            more in [0i64..100, 0i64..100, 0i64..100],
        ) {
            // The same history, then one call asked with fewer or more cells.
            let mut tats = vec![0; rates.len()];
            let mut now = 0;
            for (advance, asked) in &calls {
                now += advance;
                reserve(now, &mut tats, |i| Some((rates[i], asked[i])));
            }
            let asked = calls[calls.len() - 1].1;
            let fewer = reserve(now, &mut tats.clone(), |i| Some((rates[i], asked[i])));
            let larger = reserve(now, &mut tats, |i| Some((rates[i], asked[i] + more[i])));
            prop_assert!(fewer <= larger);
        }

        #[test]
        fn a_bucket_set_from_a_reported_room_lets_exactly_that_room_go_now(
            rate in rate(),
            now in 0i64..1_000_000,
            room in 0i64..60,
        ) {
            let tat = rate.with_room(now, room);
            let room = room.min(rate.capacity);
            if room > 0 {
                prop_assert_eq!(rate.conforms_at(tat, now, room), now);
            }
            if room < rate.capacity {
                prop_assert!(rate.conforms_at(tat, now, room + 1) > now);
            }
        }

        #[test]
        fn a_charge_given_back_restores_the_bucket(
            rate in rate(),
            tat in 0i64..1_000_000,
            now in 0i64..1_000_000,
            cells in 0i64..1_000,
        ) {
            let charged = rate.charge(tat, now, cells);
            prop_assert_eq!(rate.charge(charged, now, -cells), tat.max(now));
            // Giving back more than was taken never leaves more than a full bucket.
            prop_assert_eq!(rate.charge(tat, now, -cells - 1_000_000), now);
        }
    }
}
