//! The metrics this layer publishes (names in [`metrics`](super::metrics)).

use std::time::Duration;

use http::StatusCode;

use crate::TenantId;
use crate::metrics::Metric;

pub(super) fn throttle_count(tenant: &TenantId, count: u32) {
    let label = crate::metrics::tenant_label(tenant);
    metrics::gauge!(Metric::ThrottleCount.name(), "tenant_id" => label).set(f64::from(count));
}

pub(super) fn retry(status: StatusCode) {
    let label = status.as_str().to_owned();
    metrics::counter!(Metric::Retries.name(), "status" => label).increment(1);
}

pub(super) fn gave_up(reason: &'static str) {
    metrics::counter!(Metric::GaveUp.name(), "reason" => reason).increment(1);
}

pub(super) fn cooldown_wait(wait: Duration) {
    metrics::counter!(Metric::CooldownWaits.name()).increment(1);
    metrics::histogram!(Metric::CooldownWaitSeconds.name()).record(wait.as_secs_f64());
}

pub(super) fn pacing_wait(wait: Duration) {
    metrics::histogram!(Metric::PacingWaitSeconds.name()).record(wait.as_secs_f64());
}

pub(super) fn probe(reason: &'static str) {
    metrics::counter!(Metric::Probes.name(), "reason" => reason).increment(1);
}
