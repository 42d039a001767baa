//! The metrics this layer publishes (names in [`metrics`](super::metrics)).

use std::time::Duration;

use http::StatusCode;

use super::metrics::{COOLDOWN_WAIT_SECONDS, COOLDOWN_WAITS, GAVE_UP, RETRIES, THROTTLE_COUNT};
use crate::TenantId;

pub(super) fn throttle_count(tenant: &TenantId, count: u32) {
    metrics::gauge!(THROTTLE_COUNT, "tenant_id" => crate::metrics::tenant_label(tenant))
        .set(f64::from(count));
}

pub(super) fn retry(status: StatusCode) {
    metrics::counter!(RETRIES, "status" => status.as_str().to_owned()).increment(1);
}

pub(super) fn gave_up(reason: &'static str) {
    metrics::counter!(GAVE_UP, "reason" => reason).increment(1);
}

pub(super) fn cooldown_wait(wait: Duration) {
    metrics::counter!(COOLDOWN_WAITS).increment(1);
    metrics::histogram!(COOLDOWN_WAIT_SECONDS).record(wait.as_secs_f64());
}
