//! Names of the metrics [`RetryAfterBackoff`](super::RetryAfterBackoff) publishes through the
//! `metrics` facade, under the default prefix (see
//! [`set_metric_prefix`](crate::metrics::set_metric_prefix)).

pub use crate::metrics::{
    COOLDOWN_WAIT_SECONDS, COOLDOWN_WAITS, GAVE_UP, LEARNED_LIMIT, PACING_WAIT_SECONDS, PROBES,
    RETRIES, THROTTLE_COUNT,
};
