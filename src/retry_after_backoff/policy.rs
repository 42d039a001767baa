use std::sync::Arc;
use std::time::Duration;

use super::decide::{Backoff, StatusSet};
use crate::error::ConfigError;
use crate::rate::{Pacing, RateConfig};

/// What [`RetryAfterBackoff`](super::RetryAfterBackoff) retries, how long it waits, and what
/// it shares.
///
/// Defaults (the backoff without `retry-after` is the official SDKs'): retry 429 and 529; at most 4
/// retries; wait `retry-after` x 1.2 +/- 20%, else 0.5 s doubling up to 8 s minus up to 25%;
/// never sleep more than 60 s (a longer delay returns the response at once); a retry budget
/// of 20% of calls plus 10 retries a second over a 10 s window (tower's `TpsBudget`); held
/// calls released over a fifth of the remaining cooldown; a probe's lease 1 s;
/// upstream name `"default"`; learned pacing on at 0.95 of the learned rates, its token
/// charges corrected from each success's `usage`; no configured
/// pacing; a random seed; a 429's body read ahead up to
/// 64 KiB, 1,024 frames and 5 s; the probe mode over after 30 s without an answer.
///
/// ```
/// use fairgate::rate::Pacing;
/// use fairgate::retry_after_backoff::StatusSet;
/// use fairgate::BackoffPolicy;
/// use http::StatusCode;
/// use std::time::Duration;
///
/// let policy = BackoffPolicy::builder()
///     .retry_on(StatusSet::default().with(StatusCode::SERVICE_UNAVAILABLE))
///     .max_retries(3)
///     .max_delay(Duration::from_secs(30))
///     .upstream("api.anthropic.com")
///     .pacing(Pacing::reference())
///     .build()?;
/// assert_eq!(policy.max_retries(), 3);
/// assert!(BackoffPolicy::builder().max_delay(Duration::ZERO).build().is_err());
/// # Ok::<(), fairgate::ConfigError>(())
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct BackoffPolicy {
    pub(super) retry_on: StatusSet,
    pub(super) max_retries: u32,
    pub(super) max_delay: Duration,
    pub(super) backoff: Backoff,
    pub(super) budget: Option<RetryBudget>,
    pub(super) release_spread: Duration,
    pub(super) upstream: Arc<str>,
    pub(super) pacing: Option<Pacing>,
    pub(super) seed: Option<u64>,
    pub(super) peek_limit: usize,
    pub(super) peek_frame_limit: usize,
    pub(super) peek_timeout: Duration,
    pub(super) probe_timeout: Duration,
    pub(super) learned_pacing: bool,
    /// Thousandths of each learned rate aimed at.
    pub(super) learned_headroom: u32,
    pub(super) usage_correction: bool,
    pub(super) slow_start_max: Duration,
}

/// The retry budget's settings, as tower's `TpsBudget` takes them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct RetryBudget {
    pub(super) ttl: Duration,
    pub(super) min_per_sec: u32,
    pub(super) retry_percent: f32,
}

impl Default for BackoffPolicy {
    fn default() -> Self {
        BackoffPolicy {
            retry_on: StatusSet::default(),
            max_retries: 4,
            max_delay: Duration::from_secs(60),
            backoff: Backoff::default(),
            budget: Some(RetryBudget {
                ttl: Duration::from_secs(10),
                min_per_sec: 10,
                retry_percent: 0.2,
            }),
            release_spread: Duration::from_secs(1),
            upstream: Arc::from("default"),
            pacing: None,
            seed: None,
            peek_limit: 64 * 1024,
            peek_frame_limit: 1024,
            peek_timeout: Duration::from_secs(5),
            probe_timeout: Duration::from_secs(30),
            learned_pacing: true,
            learned_headroom: 950,
            usage_correction: true,
            slow_start_max: Duration::from_millis(500),
        }
    }
}

impl BackoffPolicy {
    /// Starts from the defaults.
    pub fn builder() -> BackoffPolicyBuilder {
        BackoffPolicyBuilder {
            policy: BackoffPolicy::default(),
        }
    }

    /// The statuses retried.
    pub fn retry_on(&self) -> StatusSet {
        self.retry_on
    }

    /// Retries after the first attempt, at most.
    pub fn max_retries(&self) -> u32 {
        self.max_retries
    }

    /// The longest delay slept; a longer one returns the response at once.
    pub fn max_delay(&self) -> Duration {
        self.max_delay
    }

    /// The backoff used when the server named no delay.
    pub fn backoff(&self) -> Backoff {
        self.backoff
    }

    /// The name of the upstream whose cooldown gate this layer shares.
    pub fn upstream(&self) -> &str {
        &self.upstream
    }

    /// The pacing, if any.
    pub fn pacing(&self) -> Option<&Pacing> {
        self.pacing.as_ref()
    }

    /// Bytes of a 429's body read ahead at most.
    pub fn peek_limit(&self) -> usize {
        self.peek_limit
    }

    /// Frames of a 429's body read ahead at most; see
    /// [`BackoffPolicyBuilder::peek_frame_limit`].
    pub fn peek_frame_limit(&self) -> usize {
        self.peek_frame_limit
    }

    /// How long a 429's body is read ahead at most; see
    /// [`BackoffPolicyBuilder::peek_timeout`].
    pub fn peek_timeout(&self) -> Duration {
        self.peek_timeout
    }

    /// How long the probe mode lasts without an answer; see
    /// [`BackoffPolicyBuilder::probe_timeout`].
    pub fn probe_timeout(&self) -> Duration {
        self.probe_timeout
    }

    /// Whether the provider's limits are learned from its headers and paced to.
    pub fn learned_pacing(&self) -> bool {
        self.learned_pacing
    }

    /// The share of each learned rate aimed at (default 0.95).
    pub fn learned_headroom(&self) -> f64 {
        f64::from(self.learned_headroom) / 1000.0
    }

    /// Whether learned token charges are corrected from a success's `usage`.
    pub fn usage_correction(&self) -> bool {
        self.usage_correction
    }

    /// What the rate of the layer's upstream keys is made of.
    pub(crate) fn rate_config(&self) -> RateConfig {
        RateConfig {
            upstream: self.upstream.clone(),
            pacing: self.pacing.clone(),
            seed: self.seed,
            release_spread: self.release_spread,
            probe_timeout: self.probe_timeout,
            learned_pacing: self.learned_pacing,
            learned_headroom: self.learned_headroom,
            usage_correction: self.usage_correction,
            slow_start_max: self.slow_start_max,
        }
    }
}

/// Builds a [`BackoffPolicy`]; [`build`](BackoffPolicyBuilder::build) refuses bad values.
#[derive(Clone, Debug)]
pub struct BackoffPolicyBuilder {
    policy: BackoffPolicy,
}

impl BackoffPolicyBuilder {
    /// The statuses to retry (default 429 and 529; see [`StatusSet::sdk`] for what the
    /// official SDKs retry). `x-should-retry` overrides it either way.
    pub fn retry_on(mut self, statuses: StatusSet) -> Self {
        self.policy.retry_on = statuses;
        self
    }

    /// Retries after the first attempt, at most (default 4; at most 100).
    pub fn max_retries(mut self, retries: u32) -> Self {
        self.policy.max_retries = retries;
        self
    }

    /// The longest delay the layer sleeps before a retry (default 60 s; at least 1 ms). A
    /// longer delay (say `retry-after: 3600`) returns the response to the caller at once.
    pub fn max_delay(mut self, delay: Duration) -> Self {
        self.policy.max_delay = delay;
        self
    }

    /// The backoff when the server named no delay: `min(initial x 2^n, max)` minus up to
    /// 25% (default 0.5 s and 8 s; initial at least 1 ms, max at least initial).
    pub fn backoff(mut self, initial: Duration, max: Duration) -> Self {
        self.policy.backoff = Backoff { initial, max };
        self
    }

    /// The retry budget (tower's `TpsBudget`): retries allowed are `retry_percent` of the
    /// calls seen over `ttl`, plus `min_per_sec` a second. `ttl` between 1 and 60 s,
    /// `retry_percent` between 0 and 1000.
    pub fn retry_budget(mut self, ttl: Duration, min_per_sec: u32, retry_percent: f32) -> Self {
        self.policy.budget = Some(RetryBudget {
            ttl,
            min_per_sec,
            retry_percent,
        });
        self
    }

    /// No retry budget: only `max_retries` bounds the retries.
    pub fn no_retry_budget(mut self) -> Self {
        self.policy.budget = None;
        self
    }

    /// How long a probe holds its key's probe lease (default 1 s): after a throttle (and at
    /// cold start) one call goes first for the whole fleet; if its answer has not come
    /// within this, the next call goes as the probe. It does not bound the release window
    /// (a fifth of the server's delay, with no floor: each worker starts at a random point
    /// of it and each call adds a draw of its own, so the last call goes at most two windows
    /// after the reopening).
    pub fn release_spread(mut self, spread: Duration) -> Self {
        self.policy.release_spread = spread;
        self
    }

    /// The upstream's name in the shared cooldown gate (default `"default"`). Layers in front
    /// of different upstreams (hosts, API keys, models with their own limits) that share one
    /// store need different names.
    pub fn upstream(mut self, name: impl AsRef<str>) -> Self {
        self.policy.upstream = Arc::from(name.as_ref());
        self
    }

    /// Proactive pacing under provider limits (default none).
    pub fn pacing(mut self, pacing: Pacing) -> Self {
        self.policy.pacing = Some(pacing);
        self
    }

    /// Seeds the jitter (default: from the clock), so a test is deterministic.
    pub fn seed(mut self, seed: u64) -> Self {
        self.policy.seed = Some(seed);
        self
    }

    /// How many bytes of a 429's body are read to look for the spend-limit error code
    /// (default 64 KiB; at least 64). With no spend-limit code in them, the 429 is retried.
    pub fn peek_limit(mut self, bytes: usize) -> Self {
        self.policy.peek_limit = bytes;
        self
    }

    /// How many frames of a 429's body are read ahead at most (default 1,024; at least 1),
    /// whatever their size: a body of millions of empty frames stops here.
    ///
    /// Reaching this limit (or [`peek_timeout`](Self::peek_timeout)) before the byte limit
    /// or the body's end means the body could not be judged: the 429 is **not retried**
    /// but goes back to the caller as it is — the frames read so far replayed, then the
    /// rest of the body streamed as the upstream sends it. It is still counted as a
    /// throttle and still closes the gate by its `retry-after`. Not retrying is the safe
    /// side: the unread part may be the spend-limit code, and a retry would drop a body the
    /// caller may want; the caller's own read timeout governs the rest of the body.
    pub fn peek_frame_limit(mut self, frames: usize) -> Self {
        self.policy.peek_frame_limit = frames;
        self
    }

    /// How long a 429's body is read ahead at most, from its head's arrival (default 5 s;
    /// at least 1 ms). An upstream that sends a few bytes and then stalls cannot hold the
    /// call (and the permit and slot of the layers around it) longer than this: past it,
    /// the 429 goes back to the caller as it is, as past
    /// [`peek_frame_limit`](Self::peek_frame_limit).
    pub fn peek_timeout(mut self, timeout: Duration) -> Self {
        self.policy.peek_timeout = timeout;
        self
    }

    /// How long slow start holds a fair queue's other calls at most while the first call
    /// to a key that has told no limits yet is out (default 500 ms).
    ///
    /// Until an answer has told an upstream key's limits, one call (the head of the fair
    /// queue) goes first and the rest wait for its answer. A slow answer (a long
    /// generation) would hold every caller for its whole length, so past this the calls go
    /// at the slot caps until an answer teaches the limits: the provider's buckets start
    /// full, so a start-up burst within the caps is what they are sized for. Applies where
    /// the fair queue holds the rate gate (see
    /// [`RetryAfterBackoffLayer::with_gate_below`](crate::RetryAfterBackoffLayer::with_gate_below)).
    pub fn slow_start_max(mut self, max: Duration) -> Self {
        self.policy.slow_start_max = max;
        self
    }

    /// How long the probe mode lasts with no answer at all (default 30 s; at least 1 ms).
    ///
    /// After a throttle (or while the gate holds calls) a worker sends one call at a time
    /// until an answer shows the upstream has room. The first answer that is not a
    /// throttle ends that at once; each throttle starts the interval again. With no answer
    /// (no traffic, or calls that never finish) the mode ends this long after the last
    /// throttle, or after this worker's release from the gate when that is later, and
    /// calls go side by side again. A fixed interval rather than a multiple of the last
    /// delay: the delay is already waited out by the gate, and what is left is how long a
    /// stale "at its limit" may be believed.
    pub fn probe_timeout(mut self, timeout: Duration) -> Self {
        self.policy.probe_timeout = timeout;
        self
    }

    /// Learned pacing (default on): learn the provider's limits from the
    /// `anthropic-ratelimit-*` headers of every answer and pace every worker on the store
    /// to them; one probe first at cold start. Off: only a configured [`Pacing`] paces.
    pub fn learned_pacing(mut self, on: bool) -> Self {
        self.policy.learned_pacing = on;
        self
    }

    /// The share of each learned rate aimed at (default 0.95; between 0.1 and 1): the
    /// provider's bucket and the pacer's clock drift apart, and `-remaining` corrects the
    /// rest.
    pub fn learned_headroom(mut self, share: f64) -> Self {
        self.policy.learned_headroom = if share.is_finite() {
            (share * 1000.0).round().clamp(0.0, 10_000.0) as u32
        } else {
            0
        };
        self
    }

    /// Correct learned token charges from each success's `usage` (default on). A call is
    /// charged its job's estimated input tokens and one output token before it goes; while
    /// an upstream key has learned token limits, the body of a 2xx answer is scanned as it
    /// streams to the caller (never buffered) for `"input_tokens"` and the largest
    /// `"output_tokens"` (a JSON message, or a stream's `message_start` and
    /// `message_delta` events), and when the body ends, or is dropped after its usage was
    /// seen, the difference is charged (or given back) once — to the fleet's input-token
    /// rate too, where the fleet orders it. Off: only the provider's `-remaining` on later
    /// answers corrects the estimate (and nothing the fleet's rate).
    pub fn usage_correction(mut self, on: bool) -> Self {
        self.policy.usage_correction = on;
        self
    }

    /// The policy, or what is wrong with it.
    ///
    /// # Errors
    /// More than 100 retries, a zero maximum delay, a backoff that starts at 0 or whose
    /// maximum is below its start, a budget out of tower's ranges, a zero pacing limit or a
    /// peek limit under 64 bytes.
    pub fn build(self) -> Result<BackoffPolicy, ConfigError> {
        let policy = self.policy;
        if policy.max_retries > 100 {
            return Err(ConfigError::new("max retries must be at most 100"));
        }
        if policy.max_delay < Duration::from_millis(1) {
            return Err(ConfigError::new("max delay must be at least 1 ms"));
        }
        if policy.backoff.initial < Duration::from_millis(1)
            || policy.backoff.max < policy.backoff.initial
        {
            return Err(ConfigError::new(
                "backoff must start at 1 ms or more and its maximum must not be below its start",
            ));
        }
        if let Some(budget) = policy.budget {
            if !(Duration::from_secs(1)..=Duration::from_secs(60)).contains(&budget.ttl) {
                return Err(ConfigError::new(
                    "retry budget ttl must be between 1 s and 60 s",
                ));
            }
            if !(0.0..=1000.0).contains(&budget.retry_percent) {
                return Err(ConfigError::new(
                    "retry budget percent must be between 0 and 1000",
                ));
            }
            if budget.min_per_sec >= i32::MAX as u32 {
                return Err(ConfigError::new(
                    "retry budget min per second must be below 2^31 - 1",
                ));
            }
        }
        if let Some(pacing) = &policy.pacing {
            pacing.validate()?;
        }
        if policy.peek_limit < 64 {
            return Err(ConfigError::new("peek limit must be at least 64 bytes"));
        }
        if policy.peek_frame_limit == 0 {
            return Err(ConfigError::new(
                "peek frame limit must be at least 1 frame",
            ));
        }
        if policy.peek_timeout < Duration::from_millis(1) {
            return Err(ConfigError::new("peek timeout must be at least 1 ms"));
        }
        if !(100..=1000).contains(&policy.learned_headroom) {
            return Err(ConfigError::new(
                "learned headroom must be between 0.1 and 1",
            ));
        }
        if policy.release_spread < Duration::from_millis(1) {
            return Err(ConfigError::new("release spread must be at least 1 ms"));
        }
        if policy.probe_timeout < Duration::from_millis(1) {
            return Err(ConfigError::new("probe timeout must be at least 1 ms"));
        }
        Ok(policy)
    }
}
