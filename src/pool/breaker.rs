//! Whether an upstream of a pool takes calls: a circuit breaker, without IO (the time is
//! given). An upstream that cannot be reached is set aside at once; one that answers
//! overloaded or failed `trip_after` times in a row is set aside too. Set aside, it takes
//! no call until `probe_every` has passed; then one call, the probe, goes: answered, the
//! upstream is back; failed, it is set aside again for another interval. A probe with no
//! answer for a whole interval (its connection hangs, and nobody gives up on it) counts as
//! lost: the next call probes.

use std::time::Duration;

use tokio::time::Instant;

/// What an answer said of its upstream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// Answered (a 429 included: that is the upstream's rate, not a failure).
    Answered,
    /// Not reached: connection refused, or no answer's head before the first-byte timeout.
    Unreachable,
    /// `529`, `500`, `502`, `503` or `504`: reached, and failing.
    Failing,
}

/// What the breaker lets a call do now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Admit {
    /// The upstream takes calls.
    Call,
    /// The upstream is set aside; this call is its probe.
    Probe,
    /// Set aside: the next probe may go then.
    No(Instant),
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum State {
    Closed {
        failures: u32,
    },
    Open {
        until: Instant,
    },
    /// Set aside, its probe out since then.
    Probing {
        since: Instant,
    },
}

/// One upstream's breaker.
#[derive(Clone, Debug)]
pub(crate) struct Breaker {
    state: State,
    trip_after: u32,
    probe_every: Duration,
}

impl Breaker {
    pub(crate) fn new(trip_after: u32, probe_every: Duration) -> Self {
        Breaker {
            state: State::Closed { failures: 0 },
            trip_after: trip_after.max(1),
            probe_every,
        }
    }

    /// Whether a call may go to this upstream at `now`; a probe is taken if one is due.
    pub(crate) fn admit(&mut self, now: Instant) -> Admit {
        match self.probe_due() {
            None => Admit::Call,
            Some(due) if now >= due => {
                self.state = State::Probing { since: now };
                Admit::Probe
            }
            Some(due) => Admit::No(due),
        }
    }

    /// When the next probe may go: the end of the interval set aside, or, a probe out, one
    /// interval after it went (then it counts as lost). `None`: it takes calls.
    fn probe_due(&self) -> Option<Instant> {
        match self.state {
            State::Closed { .. } => None,
            State::Open { until } => Some(until),
            State::Probing { since } => Some(since + self.probe_every),
        }
    }

    /// Whether a call could go now, without taking a probe.
    pub(crate) fn would_admit(&self, now: Instant) -> bool {
        self.probe_due().is_none_or(|due| now >= due)
    }

    /// Whether the upstream is set aside.
    pub(crate) fn is_open(&self) -> bool {
        !matches!(self.state, State::Closed { .. })
    }

    /// The answer of a call let through (`probe`: the call was the probe). Whether it set
    /// the upstream aside (it took calls, or its probe was out).
    pub(crate) fn answered(&mut self, outcome: Outcome, probe: bool, now: Instant) -> bool {
        let was_aside = matches!(self.state, State::Open { .. });
        match (outcome, self.state) {
            (Outcome::Answered, _) => {
                // A call let through before the upstream was set aside says nothing of it
                // now; only the probe brings it back.
                if probe || matches!(self.state, State::Closed { .. }) {
                    self.state = State::Closed { failures: 0 };
                }
            }
            (_, State::Closed { failures }) => {
                let failures = failures + 1;
                self.state = if outcome == Outcome::Unreachable || failures >= self.trip_after {
                    State::Open {
                        until: now + self.probe_every,
                    }
                } else {
                    State::Closed { failures }
                };
            }
            (_, _) if probe => {
                self.state = State::Open {
                    until: now + self.probe_every,
                }
            }
            // A late failure of a call from before: the upstream is set aside already.
            (_, _) => {}
        }
        !was_aside && matches!(self.state, State::Open { .. })
    }

    /// How long an upstream set aside waits for its probe.
    pub(crate) fn probe_every(&self) -> Duration {
        self.probe_every
    }

    /// The probe went away unanswered (its caller dropped it): the next call probes.
    pub(crate) fn probe_dropped(&mut self, now: Instant) {
        if matches!(self.state, State::Probing { .. }) {
            self.state = State::Open { until: now };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const EVERY: Duration = Duration::from_secs(1);

    #[test]
    fn an_unreachable_upstream_is_set_aside_at_once_and_probed_after_an_interval() {
        let t0 = Instant::now();
        let mut b = Breaker::new(3, EVERY);
        assert_eq!(b.admit(t0), Admit::Call);
        b.answered(Outcome::Unreachable, false, t0);
        assert_eq!(b.admit(t0), Admit::No(t0 + EVERY));
        assert_eq!(b.admit(t0 + EVERY), Admit::Probe);
        // One probe at a time.
        assert_eq!(b.admit(t0 + EVERY), Admit::No(t0 + 2 * EVERY));
        b.answered(Outcome::Unreachable, true, t0 + EVERY);
        assert_eq!(b.admit(t0 + EVERY), Admit::No(t0 + 2 * EVERY));
        assert_eq!(b.admit(t0 + 2 * EVERY), Admit::Probe);
        b.answered(Outcome::Answered, true, t0 + 2 * EVERY);
        assert_eq!(b.admit(t0 + 2 * EVERY), Admit::Call);
    }

    #[test]
    fn failing_answers_set_it_aside_after_trip_after_in_a_row_only() {
        let t0 = Instant::now();
        let mut b = Breaker::new(3, EVERY);
        b.answered(Outcome::Failing, false, t0);
        b.answered(Outcome::Failing, false, t0);
        b.answered(Outcome::Answered, false, t0);
        b.answered(Outcome::Failing, false, t0);
        b.answered(Outcome::Failing, false, t0);
        assert_eq!(
            b.admit(t0),
            Admit::Call,
            "an answer between resets the count"
        );
        b.answered(Outcome::Failing, false, t0);
        assert!(b.is_open());
    }

    #[test]
    fn a_dropped_probe_lets_the_next_call_probe() {
        let t0 = Instant::now();
        let mut b = Breaker::new(1, EVERY);
        b.answered(Outcome::Failing, false, t0);
        assert_eq!(b.admit(t0 + EVERY), Admit::Probe);
        b.probe_dropped(t0 + EVERY);
        assert_eq!(b.admit(t0 + EVERY), Admit::Probe);
    }

    #[test]
    fn a_probe_with_no_answer_for_an_interval_is_lost_and_the_next_call_probes() {
        let t0 = Instant::now();
        let mut b = Breaker::new(1, EVERY);
        b.answered(Outcome::Unreachable, false, t0);
        assert_eq!(b.admit(t0 + EVERY), Admit::Probe);
        assert!(!b.would_admit(t0 + EVERY + EVERY / 2));
        assert_eq!(b.admit(t0 + 2 * EVERY), Admit::Probe);
        // The first probe's answer, late: it still tells.
        b.answered(Outcome::Answered, true, t0 + 2 * EVERY);
        assert_eq!(b.admit(t0 + 2 * EVERY), Admit::Call);
    }

    #[test]
    fn a_late_answer_of_a_call_from_before_does_not_bring_it_back() {
        let t0 = Instant::now();
        let mut b = Breaker::new(1, EVERY);
        b.answered(Outcome::Unreachable, false, t0);
        b.answered(Outcome::Answered, false, t0);
        assert!(b.is_open());
    }

    proptest! {
        /// Whatever the answers, a set-aside upstream takes no call before its interval has
        /// passed, and a probe goes only when the last is answered, dropped or lost.
        #[test]
        fn one_probe_at_a_time_and_none_early(
            steps in proptest::collection::vec((0u8..4, 0u64..1500), 1..200),
        ) {
            let t0 = Instant::now();
            let mut now = t0;
            let mut b = Breaker::new(2, EVERY);
            let mut probes_out = 0;
            for (what, advance) in steps {
                now += Duration::from_millis(advance);
                let open_until = b.probe_due();
                match b.admit(now) {
                    Admit::Probe => {
                        prop_assert!(open_until.is_some_and(|until| now >= until));
                        probes_out += 1;
                        prop_assert_eq!(probes_out, 1);
                        let set_aside = match what {
                            0 => b.answered(Outcome::Answered, true, now),
                            1 => b.answered(Outcome::Failing, true, now),
                            2 => b.answered(Outcome::Unreachable, true, now),
                            _ => {
                                b.probe_dropped(now);
                                false
                            }
                        };
                        // A failed probe sets the upstream aside anew (the fleet is told).
                        prop_assert_eq!(set_aside, what == 1 || what == 2);
                        probes_out -= 1;
                    }
                    Admit::Call => {
                        prop_assert!(!b.is_open());
                        let outcome = [Outcome::Answered, Outcome::Failing, Outcome::Unreachable]
                            [usize::from(what % 3)];
                        b.answered(outcome, false, now);
                    }
                    Admit::No(until) => {
                        prop_assert!(b.is_open());
                        prop_assert!(now < until);
                    }
                }
            }
        }
    }
}
