//! The answer of a request that got no slot in time.

use std::fmt;
use std::time::Duration;

use crate::Tier;

/// No slot came free for the request's tier within its max wait: the `SERVER_BUSY` answer.
///
/// With feature `axum` it converts into a response: `503 Service Unavailable`, a
/// `Retry-After` header in whole seconds (rounded up) and the body
/// `{"code":"SERVER_BUSY","retry_after":5}`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Busy {
    tier: Tier,
    waited: Duration,
    retry_after: Duration,
}

impl Busy {
    pub(crate) fn new(tier: Tier, waited: Duration, retry_after: Duration) -> Self {
        Busy {
            tier,
            waited,
            retry_after,
        }
    }

    /// The tier that had no slot.
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
        write!(
            f,
            "server busy: no slot for tier {} after {:.1} s; retry after {} s",
            self.tier,
            self.waited.as_secs_f64(),
            self.retry_after_secs()
        )
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
            ],
            body,
        )
            .into_response()
    }
}
