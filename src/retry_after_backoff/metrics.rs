//! Names of the metrics [`RetryAfterBackoff`](super::RetryAfterBackoff) publishes through the
//! `metrics` facade, under the default prefix (see
//! [`set_metric_prefix`](crate::metrics::set_metric_prefix)).

/// Gauge, 429s of a tenant inside the store's throttle window (rolling 60 s by default), as
/// of its latest throttle; label `tenant_id` (capped, see
/// [`limit_tenant_labels`](crate::metrics::limit_tenant_labels)).
pub const THROTTLE_COUNT: &str = "claude_throttle_count";
/// Counter, retries sent, label `status` (the status that was retried).
pub const RETRIES: &str = "claude_retries_total";
/// Counter, retryable answers returned to the caller instead, label `reason`
/// (`max_retries`, `budget`, `over_max_delay`, `spend_limit`, `not_clonable`,
/// `peek_timeout`, `peek_frame_limit`).
pub const GAVE_UP: &str = "claude_retries_given_up_total";
/// Counter, calls held behind a closed cooldown gate (each hold counts).
pub const COOLDOWN_WAITS: &str = "claude_cooldown_waits_total";
/// Histogram, seconds a call was held behind a closed cooldown gate (each hold).
pub const COOLDOWN_WAIT_SECONDS: &str = "claude_cooldown_wait_seconds";
