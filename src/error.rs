//! Errors shared by every layer.
//!
//! The layers return [`BoxError`] in the tower way; callers find out what happened with
//! `err.is::<MissingJob>()` or `err.downcast_ref::<MissingJob>()`.

use std::fmt;

/// The boxed error every layer returns.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// The request carried no [`Job`](crate::Job), so no layer can tell who it is for.
///
/// Put one in the request's extensions before it reaches the layers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MissingJob;

impl fmt::Display for MissingJob {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("request carries no fairgate job")
    }
}

impl std::error::Error for MissingJob {}

/// A layer's response future was polled again after it had completed.
///
/// Like any future, a layer's response future is polled until it completes, then dropped;
/// polled again, it answers this error instead of panicking.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PolledAfterCompletion;

impl fmt::Display for PolledAfterCompletion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("fairgate response future polled after completion")
    }
}

impl std::error::Error for PolledAfterCompletion {}

/// A configuration value was refused when it was built.
///
/// The message names the field and the rule it broke, e.g. `"throttle limit must be at least 1"`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigError {
    message: String,
}

impl ConfigError {
    pub(crate) fn new(message: impl Into<String>) -> Self {
        ConfigError {
            message: message.into(),
        }
    }

    /// What was wrong.
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid fairgate configuration: {}", self.message)
    }
}

impl std::error::Error for ConfigError {}
