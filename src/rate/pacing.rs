//! Proactive pacing under provider limits, in process: the crate's GCRA core on tokio's
//! clock (so paused-time tests drive it).
//!
//! Each configured dimension (requests, input tokens, output tokens per minute) is one GCRA
//! limiter. A call takes its cells from the dimensions in order and keeps what it took while
//! it waits for the next one, so nothing is charged twice and no cell is lost.

use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

use crate::error::ConfigError;
use crate::gcra::Gcra;
use crate::store::{FleetCells, PaceLimit};

/// Limits to stay under before any 429: requests, input tokens and output tokens per minute.
///
/// Requests go out evenly (GCRA with a burst of 1 by default, so no rolling minute ever sees
/// more than the limit); token dimensions allow a burst of their whole per-minute limit, as
/// the provider's own token buckets do. Output tokens are not known before a call: each call
/// is charged [`expected_output_tokens`](Pacing::expected_output_tokens).
///
/// The pacing is per layer (per process). For several workers, give each its share of the
/// provider's limits.
///
/// ```
/// use fairgate::rate::Pacing;
///
/// // A small Anthropic tier: 50 RPM, 40,000 ITPM, 8,000 OTPM.
/// let pacing = Pacing::reference();
/// assert_eq!(pacing.requests_per_minute_limit(), Some(50));
/// let mine = Pacing::new().requests_per_minute(50);
/// assert_eq!(mine.input_tokens_per_minute_limit(), None);
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Pacing {
    requests_per_minute: Option<u32>,
    input_tokens_per_minute: Option<u32>,
    output_tokens_per_minute: Option<u32>,
    request_burst: u32,
    expected_output_tokens: u32,
    shared: bool,
}

impl Pacing {
    /// No limit yet; add them with the setters.
    pub fn new() -> Self {
        Pacing {
            request_burst: 1,
            expected_output_tokens: 1,
            ..Pacing::default()
        }
    }

    /// A small Anthropic tier, the one the crate's tests and simulator use: 50 requests,
    /// 40,000 input tokens and 8,000 output tokens per minute.
    pub fn reference() -> Self {
        Pacing::new()
            .requests_per_minute(50)
            .input_tokens_per_minute(40_000)
            .output_tokens_per_minute(8_000)
    }

    /// At most `n` requests per minute (at least 1).
    pub fn requests_per_minute(mut self, n: u32) -> Self {
        self.requests_per_minute = Some(n);
        self
    }

    /// At most `n` estimated input tokens ([`Job::cost`](crate::Job::cost))
    /// per minute (at least 1). Where the fleet's order hands the limit out
    /// ([`shared`](Pacing::shared)), the answers' usage corrects each call's estimate (see
    /// [`usage_correction`](crate::retry_after_backoff::BackoffPolicyBuilder::usage_correction)).
    pub fn input_tokens_per_minute(mut self, n: u32) -> Self {
        self.input_tokens_per_minute = Some(n);
        self
    }

    /// At most `n` output tokens per minute (at least 1), each call charged
    /// [`expected_output_tokens`](Pacing::expected_output_tokens).
    pub fn output_tokens_per_minute(mut self, n: u32) -> Self {
        self.output_tokens_per_minute = Some(n);
        self
    }

    /// How many requests may go back to back before the even pace applies (default 1; at
    /// least 1). More than 1 lets a rolling minute see up to `limit + burst - 1` requests.
    pub fn request_burst(mut self, n: u32) -> Self {
        self.request_burst = n;
        self
    }

    /// Output tokens charged per call when output tokens are paced (default 1; at least 1).
    pub fn expected_output_tokens(mut self, n: u32) -> Self {
        self.expected_output_tokens = n;
        self
    }

    /// Paces through the [`Store`](crate::Store) ([`Store::pace`](crate::Store::pace)), so
    /// every layer and worker on the store shares the limits: one GCRA script on Redis
    /// (server time), reserving all dimensions at once. Default: each layer paces alone, in
    /// process, and the limits are that layer's.
    ///
    /// Under the recommended stack on Redis ([`FairgateLayer`](crate::FairgateLayer) with
    /// its slots), the request limit of the layer's own upstream key goes in the fleet's
    /// fair order instead: each call takes its cell with its slot, and a freed cell goes to
    /// the call the fleet's order picks, whichever worker holds it (while Redis answers;
    /// meanwhile each worker paces its share). The token limits go in the same order: the
    /// output limit as a bound on the calls at
    /// [`expected_output_tokens`](Pacing::expected_output_tokens) a call, the input limit
    /// as a token rate that bursts one second of it (not its minute: the fleet does not
    /// know how full the provider's bucket is).
    pub fn shared(mut self) -> Self {
        self.shared = true;
        self
    }

    /// Whether the pacing goes through the store.
    pub fn is_shared(&self) -> bool {
        self.shared
    }

    /// The store-side limits of a call with `input_tokens` (`PaceLimit`s, in the order
    /// requests, input tokens, output tokens; only those configured).
    pub(crate) fn limits(&self, input_tokens: u32) -> ([PaceLimit; 3], usize) {
        let mut out = [PaceLimit {
            per_minute: 1,
            burst: 1,
            cells: 1,
        }; 3];
        let mut n = 0;
        let dims = [
            (self.requests_per_minute, self.request_burst, 1),
            (self.input_tokens_per_minute, 0, input_tokens),
            (
                self.output_tokens_per_minute,
                0,
                self.expected_output_tokens,
            ),
        ];
        for (limit, burst, cells) in dims {
            if let Some(per_minute) = limit {
                // Token dimensions burst their whole minute, as the provider's buckets do.
                let burst = if burst == 0 { per_minute } else { burst };
                out[n] = PaceLimit {
                    per_minute,
                    burst,
                    cells,
                };
                n += 1;
            }
        }
        (out, n)
    }

    /// The limits as the fleet's order hands them out with the slots (`None` without a
    /// limit): the calls a minute the request limit and the output-token limit allow (the
    /// latter at [`expected_output_tokens`](Pacing::expected_output_tokens) a call), in
    /// cells of [`request_burst`](Pacing::request_burst); the input-token limit as a token
    /// rate of a second's burst ([`FleetCells::token_rate`]; the fleet does not know how
    /// full the provider's bucket of a minute is).
    pub(crate) fn fleet_cells(&self) -> Option<FleetCells> {
        let by_output = self
            .output_tokens_per_minute
            .map(|limit| (limit / self.expected_output_tokens.max(1)).max(1));
        let calls = match (self.requests_per_minute, by_output) {
            (Some(requests), Some(output)) => Some(requests.min(output)),
            (requests, output) => requests.or(output),
        };
        let tokens = self
            .input_tokens_per_minute
            .map(|limit| FleetCells::token_rate(limit, 1000));
        if calls.is_none() && tokens.is_none() {
            return None;
        }
        let count = self.request_burst.max(1);
        let (count, span) = calls.map_or((0, Duration::ZERO), |per_minute| {
            (count, Duration::from_secs(60) * count / per_minute.max(1))
        });
        Some(FleetCells {
            count,
            span,
            tokens,
        })
    }

    /// The request limit, if set.
    pub fn requests_per_minute_limit(&self) -> Option<u32> {
        self.requests_per_minute
    }

    /// How many requests may go back to back ([`request_burst`](Pacing::request_burst)).
    pub fn request_burst_limit(&self) -> u32 {
        self.request_burst
    }

    /// The input-token limit, if set.
    pub fn input_tokens_per_minute_limit(&self) -> Option<u32> {
        self.input_tokens_per_minute
    }

    /// The output-token limit, if set.
    pub fn output_tokens_per_minute_limit(&self) -> Option<u32> {
        self.output_tokens_per_minute
    }

    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        for (name, value) in [
            ("requests per minute", self.requests_per_minute),
            ("input tokens per minute", self.input_tokens_per_minute),
            ("output tokens per minute", self.output_tokens_per_minute),
            ("request burst", Some(self.request_burst)),
            ("expected output tokens", Some(self.expected_output_tokens)),
        ] {
            if value == Some(0) {
                return Err(ConfigError::new(format!(
                    "pacing {name} must be at least 1"
                )));
            }
        }
        Ok(())
    }
}

/// The running buckets of one layer: one per dimension of [`Pacing::limits`], in its order,
/// counting nanoseconds from `base` on tokio's clock (so paused-time tests drive it).
#[derive(Debug)]
pub(crate) struct Pacer {
    pacing: Pacing,
    rates: Vec<Gcra>,
    tats: Mutex<Vec<i64>>,
    base: Instant,
}

impl Pacer {
    pub(crate) fn new(pacing: &Pacing) -> Self {
        // Rate and burst do not depend on the call's tokens.
        let (limits, n) = pacing.limits(0);
        let rates: Vec<Gcra> = limits[..n]
            .iter()
            .map(|limit| {
                let interval = 60_000_000_000 / i64::from(limit.per_minute.max(1));
                Gcra::new(interval, i64::from(limit.burst))
            })
            .collect();
        Pacer {
            pacing: pacing.clone(),
            tats: Mutex::new(vec![0; rates.len()]),
            rates,
            base: Instant::now(),
        }
    }

    /// Takes the cells of a call with `input_tokens` from dimension `*step` on; `None` once
    /// all are taken, else how long to wait before trying dimension `*step` again.
    ///
    /// Unlike the store's pacing this does not reserve: a call that must wait takes nothing
    /// from that dimension and asks again (it keeps what earlier dimensions gave it).
    pub(crate) fn admit(&self, step: &mut usize, input_tokens: u32) -> Option<Duration> {
        let (limits, n) = self.pacing.limits(input_tokens);
        let since = Instant::now().saturating_duration_since(self.base);
        let now = i64::try_from(since.as_nanos()).unwrap_or(i64::MAX / 4);
        let mut tats = crate::sync::lock(&self.tats);
        let dims = self.rates.iter().zip(tats.iter_mut()).zip(&limits[..n]);
        for ((rate, tat), limit) in dims.skip(*step) {
            let cells = i64::from(limit.cells);
            let at = rate.conforms_at(*tat, now, cells);
            if at > now {
                let wait = Duration::from_nanos(u64::try_from(at - now).unwrap_or(u64::MAX));
                // Never a zero wait: that would spin.
                return Some(wait.max(Duration::from_millis(1)));
            }
            *tat = rate.take(*tat, now, cells);
            *step += 1;
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use proptest::test_runner::{Config, RngSeed, TestRunner};

    /// governor's GCRA on tokio's clock, one limiter per dimension: what the pacer must
    /// answer as.
    mod reference {
        use std::num::NonZeroU32;
        use std::ops::Add;
        use std::time::Duration;

        use governor::clock::{Clock, Reference};
        use governor::middleware::NoOpMiddleware;
        use governor::nanos::Nanos;
        use governor::state::{InMemoryState, NotKeyed};
        use governor::{Quota, RateLimiter};

        use super::Pacing;

        #[derive(Clone, Copy, Debug, Default)]
        pub(crate) struct TokioClock;

        #[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
        pub(crate) struct TokioInstant(tokio::time::Instant);

        impl Add<Nanos> for TokioInstant {
            type Output = TokioInstant;

            fn add(self, other: Nanos) -> TokioInstant {
                TokioInstant(self.0 + Duration::from(other))
            }
        }

        impl Reference for TokioInstant {
            fn duration_since(&self, earlier: Self) -> Nanos {
                self.0.saturating_duration_since(earlier.0).into()
            }

            fn saturating_sub(&self, duration: Nanos) -> Self {
                self.0
                    .checked_sub(duration.into())
                    .map_or(*self, TokioInstant)
            }
        }

        impl Clock for TokioClock {
            type Instant = TokioInstant;

            fn now(&self) -> TokioInstant {
                TokioInstant(tokio::time::Instant::now())
            }
        }

        type Limiter =
            RateLimiter<NotKeyed, InMemoryState, TokioClock, NoOpMiddleware<TokioInstant>>;

        fn nonzero(n: i64) -> NonZeroU32 {
            u32::try_from(n)
                .ok()
                .and_then(NonZeroU32::new)
                .unwrap_or(NonZeroU32::MIN)
        }

        pub(crate) struct Governed(Pacing, Vec<Limiter>);

        impl Governed {
            pub(crate) fn new(pacing: &Pacing) -> Self {
                let (limits, n) = pacing.limits(0);
                let limiters = limits[..n]
                    .iter()
                    .map(|limit| {
                        let quota = Quota::per_minute(nonzero(limit.per_minute.into()))
                            .allow_burst(nonzero(limit.burst.into()));
                        Limiter::direct_with_clock(quota, TokioClock)
                    })
                    .collect();
                Governed(pacing.clone(), limiters)
            }

            pub(crate) fn admit(&self, step: &mut usize, input_tokens: u32) -> Option<Duration> {
                let (limits, n) = self.0.limits(input_tokens);
                for (limiter, limit) in self.1.iter().zip(&limits[..n]).skip(*step) {
                    if let Ok(Err(not_until)) = limiter.check_n(nonzero(limit.cells())) {
                        let wait = not_until.wait_time_from(TokioClock.now());
                        return Some(wait.max(Duration::from_millis(1)));
                    }
                    *step += 1;
                }
                None
            }
        }
    }

    fn pacing() -> impl Strategy<Value = Pacing> {
        (
            prop::option::of(1u32..600),
            prop::option::of(1u32..100_000),
            prop::option::of(1u32..20_000),
            1u32..5,
            1u32..3_000,
        )
            .prop_map(|(rpm, itpm, otpm, burst, output)| {
                let mut pacing = Pacing::new()
                    .request_burst(burst)
                    .expected_output_tokens(output);
                pacing.requests_per_minute = rpm;
                pacing.input_tokens_per_minute = itpm;
                pacing.output_tokens_per_minute = otpm;
                pacing
            })
    }

    /// Calls as (time since the previous one in µs, input tokens, whether it is a new call
    /// or the previous one asking again).
    fn calls() -> impl Strategy<Value = Vec<(u64, u32, bool)>> {
        let advance = prop_oneof![0u64..10, 0u64..2_000_000, 0u64..90_000_000];
        let tokens = prop_oneof![0u32..100, 0u32..150_000];
        prop::collection::vec((advance, tokens, any::<bool>()), 1..80)
    }

    #[test]
    fn the_pacer_answers_as_governor_does() {
        let mut runner = TestRunner::new(Config {
            cases: 128,
            rng_seed: RngSeed::Fixed(0x676f_7665),
            failure_persistence: None,
            ..Config::default()
        });
        let result = runner.run(&(pacing(), calls()), |(pacing, calls)| {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_time()
                .start_paused(true)
                .build()
                .expect("runtime");
            runtime.block_on(async {
                let ours = Pacer::new(&pacing);
                let governed = reference::Governed::new(&pacing);
                let (mut step, mut expected_step) = (0, 0);
                for (i, (advance, tokens, new_call)) in calls.into_iter().enumerate() {
                    tokio::time::advance(Duration::from_micros(advance)).await;
                    if new_call {
                        (step, expected_step) = (0, 0);
                    }
                    let answer = ours.admit(&mut step, tokens);
                    let expected = governed.admit(&mut expected_step, tokens);
                    prop_assert_eq!(answer, expected, "call {}", i);
                    prop_assert_eq!(step, expected_step, "call {}", i);
                }
                Ok(())
            })
        });
        if let Err(failure) = result {
            panic!("{failure}");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn requests_go_out_evenly_and_tokens_in_bursts() {
        let pacer = Pacer::new(&Pacing::new().requests_per_minute(60));
        let mut step = 0;
        assert_eq!(pacer.admit(&mut step, 1), None);
        let mut step = 0;
        let wait = pacer.admit(&mut step, 1).expect("second request waits");
        assert_eq!(wait, Duration::from_secs(1));
        tokio::time::advance(wait).await;
        assert_eq!(pacer.admit(&mut step, 1), None);

        let tokens = Pacer::new(&Pacing::new().input_tokens_per_minute(1_000));
        let mut step = 0;
        assert_eq!(tokens.admit(&mut step, 600), None);
        let mut step = 0;
        assert!(
            tokens.admit(&mut step, 600).is_some(),
            "over the minute's tokens"
        );
        // A call larger than the whole minute still goes, taking all of it.
        tokio::time::advance(Duration::from_secs(60)).await;
        let mut step = 0;
        assert_eq!(tokens.admit(&mut step, 5_000), None);
    }

    #[test]
    fn zero_limits_are_refused() {
        assert!(Pacing::new().requests_per_minute(0).validate().is_err());
        assert!(Pacing::new().request_burst(0).validate().is_err());
        assert!(Pacing::reference().validate().is_ok());
    }
}
