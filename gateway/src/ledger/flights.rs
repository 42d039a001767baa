//! The calls gone to the upstream whose answer has not ended, for the live page: how long
//! the oldest has been in flight (per tier and class) and the tokens they were charged,
//! while they run — the latency histograms count a call only once it has ended.
//!
//! A call is in flight from its dispatch to the upstream to the last byte of its answer (or
//! until the answer is dropped): its [`Flight`] rides in the answer's body.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use fairgate::{Job, Priority, Tier};
use tokio::time::Instant;

/// One call in flight, as the page reads it.
#[derive(Clone, Debug)]
struct Flying {
    since: Instant,
    tier: Option<Tier>,
    class: Option<Priority>,
    tokens: u64,
}

/// The calls in flight, oldest first (ids are taken in dispatch order).
#[derive(Debug, Default)]
pub(crate) struct Flights {
    next: AtomicU64,
    book: Mutex<BTreeMap<u64, Flying>>,
}

/// A call counted in flight while this lives.
#[derive(Debug)]
pub(crate) struct Flight {
    flights: std::sync::Arc<Flights>,
    id: u64,
}

impl Drop for Flight {
    fn drop(&mut self) {
        self.flights.lock().remove(&self.id);
    }
}

/// What the page shows of the calls in flight.
#[derive(Debug, Default, PartialEq)]
pub(crate) struct Aloft {
    /// How long the oldest call in flight has been, by tier and by class.
    pub(crate) oldest_by_tier: BTreeMap<String, Duration>,
    pub(crate) oldest_by_class: BTreeMap<&'static str, Duration>,
    pub(crate) oldest: Option<Duration>,
    /// The tokens the calls in flight were charged (input and expected output).
    pub(crate) tokens: u64,
}

impl Flights {
    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, Flying>> {
        self.book.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Counts `job`'s call in flight from now until the returned guard is dropped.
    pub(crate) fn begin(self: &std::sync::Arc<Self>, job: &Job) -> Flight {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let flying = Flying {
            since: Instant::now(),
            tier: job.tier().cloned(),
            class: job.priority(),
            tokens: job.charge(),
        };
        self.lock().insert(id, flying);
        Flight {
            flights: self.clone(),
            id,
        }
    }

    /// The ages of the oldest calls in flight and the tokens they hold.
    pub(crate) fn aloft(&self) -> Aloft {
        let book = self.lock();
        let now = Instant::now();
        let mut aloft = Aloft::default();
        for flying in book.values() {
            let age = now.saturating_duration_since(flying.since);
            aloft.oldest.get_or_insert(age);
            if let Some(tier) = &flying.tier {
                aloft
                    .oldest_by_tier
                    .entry(tier.as_str().to_owned())
                    .or_insert(age);
            }
            if let Some(class) = flying.class {
                aloft.oldest_by_class.entry(class.as_str()).or_insert(age);
            }
            aloft.tokens = aloft.tokens.saturating_add(flying.tokens);
        }
        aloft
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fairgate::Origin;
    use std::sync::Arc;

    #[tokio::test(start_paused = true)]
    async fn the_oldest_call_in_flight_is_shown_per_tier_and_class_until_its_answer_ends() {
        let flights = Arc::new(Flights::default());
        assert_eq!(flights.aloft(), Aloft::default());
        let old = flights.begin(
            &Job::new("a", Origin::UserAction)
                .with_tier("pro")
                .with_cost(100),
        );
        tokio::time::advance(Duration::from_secs(8)).await;
        let new = flights.begin(
            &Job::new("b", Origin::UserAction)
                .with_tier("pro")
                .with_cost(50),
        );
        let free = flights.begin(
            &Job::new("c", Origin::BatchJob)
                .with_tier("free")
                .with_cost(7),
        );
        tokio::time::advance(Duration::from_secs(1)).await;
        let aloft = flights.aloft();
        assert_eq!(aloft.oldest, Some(Duration::from_secs(9)));
        assert_eq!(aloft.oldest_by_tier["pro"], Duration::from_secs(9));
        assert_eq!(aloft.oldest_by_tier["free"], Duration::from_secs(1));
        assert_eq!(aloft.tokens, 157);
        drop(old);
        let aloft = flights.aloft();
        assert_eq!(aloft.oldest_by_tier["pro"], Duration::from_secs(1));
        assert_eq!(aloft.tokens, 57);
        drop((new, free));
        assert_eq!(flights.aloft(), Aloft::default());
    }
}
