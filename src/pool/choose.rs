//! Which upstream of a pool a call goes to, without IO: among those that take calls now,
//! serve the call's model and have room, one set aside whose probe is due (so an upstream
//! that is back returns to the pool within a probe interval, whoever calls); else, in the
//! first priority that has one with room, the one that holds the tenant's prompt cache
//! (the one it went to last), else the one with the most room for its weight.

/// An upstream as the choice sees it now.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Candidate {
    /// Its breaker lets a call go.
    pub(crate) takes_calls: bool,
    /// Set aside, and its probe is due: the call would be the probe.
    pub(crate) probe_due: bool,
    /// It serves the call's model (and, for a batch, has batches).
    pub(crate) serves: bool,
    pub(crate) in_flight: usize,
    /// Most calls in flight at once (`None`: no cap of its own).
    pub(crate) max_in_flight: Option<usize>,
    /// Its share of the calls among upstreams of its priority.
    pub(crate) weight: u32,
    /// Lower goes first: a later priority takes calls only when no earlier one has room.
    pub(crate) priority: u32,
}

impl Candidate {
    fn has_room(&self) -> bool {
        self.takes_calls && self.serves && self.max_in_flight.is_none_or(|max| self.in_flight < max)
    }

    /// Calls in flight per unit of weight: the least loaded goes first.
    fn load(&self) -> f64 {
        self.in_flight as f64 / f64::from(self.weight.max(1))
    }
}

/// The upstream a call goes to (`affinity`: the one its tenant went to last), or `None`
/// when none has room.
pub(crate) fn choose(candidates: &[Candidate], affinity: Option<usize>) -> Option<usize> {
    preference(candidates, affinity).first().copied()
}

/// The upstreams with room, the one a call should go to first: one whose probe is due,
/// then by priority and, within one, the tenant's own, then from the least loaded for its
/// weight (the first added first among equals). A rate gate over the pool goes down it to
/// the first whose rate lets the call go now.
pub(crate) fn preference(candidates: &[Candidate], affinity: Option<usize>) -> Vec<usize> {
    let mut order: Vec<usize> = (0..candidates.len())
        .filter(|&i| candidates[i].has_room())
        .collect();
    // Stable: equals keep the order they were added in.
    order.sort_by(|&a, &b| {
        let (ca, cb) = (&candidates[a], &candidates[b]);
        match (ca.probe_due, cb.probe_due) {
            // Due probes first, in the order the upstreams were added.
            (true, true) => std::cmp::Ordering::Equal,
            (true, false) => std::cmp::Ordering::Less,
            (false, true) => std::cmp::Ordering::Greater,
            (false, false) => ca
                .priority
                .cmp(&cb.priority)
                .then_with(|| (affinity == Some(b)).cmp(&(affinity == Some(a))))
                .then_with(|| ca.load().total_cmp(&cb.load())),
        }
    });
    order
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn open(in_flight: usize) -> Candidate {
        Candidate {
            takes_calls: true,
            probe_due: false,
            serves: true,
            in_flight,
            max_in_flight: Some(4),
            weight: 1,
            priority: 0,
        }
    }

    #[test]
    fn the_tenants_upstream_keeps_it_while_it_has_room() {
        let pool = [open(0), open(3)];
        assert_eq!(choose(&pool, Some(1)), Some(1));
        let full = [open(0), open(4)];
        assert_eq!(choose(&full, Some(1)), Some(0));
    }

    #[test]
    fn the_primary_first_and_the_second_only_when_the_primary_is_full() {
        let second = Candidate {
            priority: 1,
            ..open(0)
        };
        assert_eq!(choose(&[open(3), second], None), Some(0));
        assert_eq!(choose(&[open(4), second], None), Some(1));
        let aside = Candidate {
            takes_calls: false,
            ..open(0)
        };
        assert_eq!(choose(&[aside, second], None), Some(1));
    }

    #[test]
    fn the_tenants_upstream_of_a_later_priority_does_not_pass_the_primary() {
        let second = Candidate {
            priority: 1,
            ..open(0)
        };
        assert_eq!(choose(&[open(3), second], Some(1)), Some(0));
        assert_eq!(
            choose(&[open(4), second], Some(1)),
            Some(1),
            "the primary is full"
        );
    }

    #[test]
    fn a_due_probe_goes_before_the_tenants_upstream() {
        let due = Candidate {
            probe_due: true,
            priority: 1,
            ..open(0)
        };
        assert_eq!(choose(&[open(0), due], Some(0)), Some(1));
    }

    #[test]
    fn an_upstream_that_does_not_serve_the_model_is_never_chosen() {
        let other = Candidate {
            serves: false,
            ..open(0)
        };
        assert_eq!(choose(&[other, open(3)], None), Some(1));
        assert_eq!(choose(&[other], Some(0)), None);
    }

    proptest! {
        /// The preference holds every upstream with room once and nothing else, by
        /// priority, and within one the tenant's own first, then by load.
        #[test]
        fn the_preference_is_every_upstream_with_room_from_the_choice_on(
            pool in proptest::collection::vec(
                (any::<bool>(), 0usize..6, proptest::option::of(1usize..6), 1u32..4, 0u32..3),
                1..8,
            ),
            affinity in proptest::option::of(0usize..8),
        ) {
            let pool: Vec<Candidate> = pool
                .into_iter()
                .map(|(takes_calls, in_flight, max_in_flight, weight, priority)| Candidate {
                    takes_calls, probe_due: false, serves: true, in_flight, max_in_flight, weight, priority,
                })
                .collect();
            let order = preference(&pool, affinity);
            let mut with_room: Vec<usize> = (0..pool.len()).filter(|&i| pool[i].has_room()).collect();
            let mut sorted = order.clone();
            sorted.sort_unstable();
            with_room.sort_unstable();
            prop_assert_eq!(sorted, with_room);
            for pair in order.windows(2) {
                let (a, b) = (&pool[pair[0]], &pool[pair[1]]);
                prop_assert!(a.priority <= b.priority, "by priority first");
                if a.priority == b.priority {
                    prop_assert!(Some(pair[1]) != affinity, "the tenant's own first in its priority");
                    if Some(pair[0]) != affinity {
                        prop_assert!(a.load() <= b.load());
                    }
                }
            }
        }

        /// The choice always has room, serves the call and takes calls; it is `None` only
        /// when no upstream does; it is of the first priority with room, and no upstream of
        /// that priority is less loaded for its weight (the affinity aside).
        #[test]
        fn the_choice_has_room_and_is_the_least_loaded_of_the_first_priority(
            pool in proptest::collection::vec(
                (any::<bool>(), any::<bool>(), 0usize..6, proptest::option::of(1usize..6), 1u32..4, 0u32..3, any::<bool>()),
                1..8,
            ),
        ) {
            let pool: Vec<Candidate> = pool
                .into_iter()
                .map(|(takes_calls, serves, in_flight, max_in_flight, weight, priority, due)| Candidate {
                    takes_calls, probe_due: due && takes_calls, serves, in_flight, max_in_flight, weight, priority,
                })
                .collect();
            let any_room = pool.iter().any(Candidate::has_room);
            let probe = pool.iter().position(|c| c.probe_due && c.has_room());
            match choose(&pool, None) {
                None => prop_assert!(!any_room),
                Some(i) if probe.is_some() => prop_assert_eq!(Some(i), probe),
                Some(i) => {
                    let c = pool[i];
                    prop_assert!(c.has_room());
                    for other in pool.iter().filter(|o| o.has_room()) {
                        prop_assert!(other.priority >= c.priority);
                        if other.priority == c.priority {
                            prop_assert!(other.load() >= c.load());
                        }
                    }
                }
            }
        }
    }
}
