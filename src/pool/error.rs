//! Errors of a [`Pool`](super::Pool).

use std::fmt;
use std::time::Duration;

/// No upstream of the pool had room for the call: each was set aside, full, or does not
/// serve its model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NoUpstream {
    /// When the first upstream set aside may be probed, if one is (`None`: full, or none
    /// serves the call).
    pub retry_after: Option<Duration>,
}

impl fmt::Display for NoUpstream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("no upstream of the pool has room")?;
        if let Some(after) = self.retry_after {
            write!(f, " (one may be probed in {} ms)", after.as_millis())?;
        }
        Ok(())
    }
}

impl std::error::Error for NoUpstream {}

/// No head of an answer came within the pool's first-byte timeout; the upstream is set
/// aside, and the call not sent again (it may have run).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FirstByteTimeout {
    /// The upstream that did not answer.
    pub upstream: String,
}

impl fmt::Display for FirstByteTimeout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "upstream {} sent no answer in time", self.upstream)
    }
}

impl std::error::Error for FirstByteTimeout {}
