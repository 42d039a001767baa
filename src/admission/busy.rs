//! The answer of a request that got no slot in time.

use std::fmt;
use std::time::Duration;

use crate::Tier;

/// The request could not go within its tier's max wait: the `SERVER_BUSY` answer. Its
/// [`reason`](Busy::reason) says what it waited for: a slot, the provider's rate, the
/// upstream's cooldown gate, or (answered at once) the shared store, away.
///
/// With feature `axum` it converts into a response: `503 Service Unavailable`, a
/// `Retry-After` header in whole seconds (rounded up), `x-should-retry` (see
/// [`should_retry`](Busy::should_retry)) and the body
/// `{"code":"SERVER_BUSY","retry_after":5}`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Busy {
    tier: Tier,
    waited: Duration,
    retry_after: Duration,
    reason: WaitReason,
    retry: bool,
}

impl Busy {
    /// A request that waited for a slot.
    pub(crate) fn new(tier: Tier, waited: Duration, retry_after: Duration) -> Self {
        Busy {
            tier,
            waited,
            retry_after,
            reason: WaitReason::Slot,
            retry: false,
        }
    }

    /// The same answer, saying whether the caller should retry it (its tier's
    /// [`retry`](crate::TierLimit::retry)).
    pub(crate) fn retrying(mut self, retry: bool) -> Self {
        self.retry = retry;
        self
    }

    /// Whether the caller should retry (its tier's [`retry`](crate::TierLimit::retry),
    /// default `false`: the request already waited its max wait). Rendered as
    /// `x-should-retry`, which the official SDKs honour.
    pub fn should_retry(&self) -> bool {
        self.retry
    }

    /// The same answer, for a request that waited for `reason`.
    pub(crate) fn because(mut self, reason: WaitReason) -> Self {
        self.reason = reason;
        self
    }

    /// What the request waited for when its max wait ran out.
    pub fn reason(&self) -> WaitReason {
        self.reason
    }

    /// The tier of the request.
    pub fn tier(&self) -> &Tier {
        &self.tier
    }

    /// How long the request waited before giving up.
    pub fn waited(&self) -> Duration {
        self.waited
    }

    /// When the caller should try again.
    pub fn retry_after(&self) -> Duration {
        self.retry_after
    }

    /// `retry_after` in whole seconds, rounded up (what a `Retry-After` header carries).
    pub fn retry_after_secs(&self) -> u64 {
        self.retry_after.as_secs() + u64::from(self.retry_after.subsec_nanos() > 0)
    }
}

impl fmt::Display for Busy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let waited = self.waited.as_secs_f64();
        match self.reason {
            WaitReason::Slot => write!(
                f,
                "server busy: no slot for tier {} after {waited:.1} s",
                self.tier
            )?,
            WaitReason::Rate => write!(
                f,
                "server busy: tier {} waited {waited:.1} s for the provider's rate limit",
                self.tier
            )?,
            WaitReason::Cooldown => write!(
                f,
                "server busy: tier {} waited {waited:.1} s behind the upstream's cooldown after a throttle",
                self.tier
            )?,
            WaitReason::Store => write!(
                f,
                "server busy: the shared store is away and this worker cannot admit a call of tier {} soundly (after {waited:.1} s)",
                self.tier
            )?,
        }
        write!(f, "; retry after {} s", self.retry_after_secs())
    }
}

impl std::error::Error for Busy {}

#[cfg(feature = "axum")]
#[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
impl axum::response::IntoResponse for Busy {
    fn into_response(self) -> axum::response::Response {
        let secs = self.retry_after_secs();
        let body = format!(r#"{{"code":"SERVER_BUSY","retry_after":{secs}}}"#);
        (
            http::StatusCode::SERVICE_UNAVAILABLE,
            [
                (http::header::RETRY_AFTER, secs.to_string()),
                (http::header::CONTENT_TYPE, "application/json".to_owned()),
                (
                    http::HeaderName::from_static("x-should-retry"),
                    self.retry.to_string(),
                ),
            ],
            body,
        )
            .into_response()
    }
}

/// What a request waited for, when it waited too long: the answer's reason.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum WaitReason {
    /// A slot: the global cap, its tier's cap or its tenant's cap was full.
    Slot,
    /// The provider's rate: learned limits, configured pacing, slow start or the probe.
    Rate,
    /// The upstream's cooldown gate, closed after a 429 or a `-remaining: 0`.
    Cooldown,
    /// The shared store: Redis is away and this worker cannot admit the call soundly (see
    /// [`SlotRefusal::Store`](crate::store::SlotRefusal::Store)); answered at once, not at the
    /// max wait.
    Store,
}

impl WaitReason {
    /// Every reason, for metrics published at zero from start.
    pub(crate) const ALL: [WaitReason; 4] = [
        WaitReason::Slot,
        WaitReason::Rate,
        WaitReason::Cooldown,
        WaitReason::Store,
    ];

    /// The reason as a metric label and in messages: `slot`, `rate`, `cooldown`, `store`.
    pub fn as_str(self) -> &'static str {
        match self {
            WaitReason::Slot => "slot",
            WaitReason::Rate => "rate",
            WaitReason::Cooldown => "cooldown",
            WaitReason::Store => "store",
        }
    }
}

impl fmt::Display for WaitReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}
