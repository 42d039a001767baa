//! The metrics fairgate publishes, through the [`metrics`] facade (install any exporter;
//! with none installed they cost next to nothing).
//!
//! Names follow the reference dashboards. Labels that carry a tenant are capped (see
//! [`limit_tenant_labels`]) so a million tenants cannot explode a time-series database.

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{OnceLock, RwLock};
use std::time::Duration;

use crate::{Priority, TenantId};

/// Histogram, seconds from the outermost layer's `call` to the response, label `priority`.
pub const REQUEST_LATENCY: &str = "claude_request_latency_seconds";
/// Gauge, tenants currently demoted to batch as this worker knows them.
pub const DEMOTED_TENANTS: &str = "claude_demoted_tenants";
/// Counter, estimated input tokens admitted, label `tenant_id`.
pub const INPUT_TOKENS: &str = "claude_input_tokens_total";
/// Gauge, 1 while the store serves from in-process state because Redis is unreachable.
pub const STORE_DEGRADED: &str = "claude_store_degraded";

/// The `tenant_id` label of tenants past the cap.
pub const OTHER_TENANTS: &str = "_other";

static TENANT_LABEL_LIMIT: AtomicUsize = AtomicUsize::new(1_000);
static TENANT_LABELS: OnceLock<RwLock<HashSet<TenantId>>> = OnceLock::new();

/// Caps how many distinct tenants get their own `tenant_id` label (default 1,000, process
/// wide, first come first labelled); the rest are counted under [`OTHER_TENANTS`].
pub fn limit_tenant_labels(max: usize) {
    TENANT_LABEL_LIMIT.store(max, Ordering::Relaxed);
}

/// The label value for `tenant`: its name (shared with the `TenantId`, no copy), or
/// [`OTHER_TENANTS`] past the cap.
pub(crate) fn tenant_label(tenant: &TenantId) -> metrics::SharedString {
    let labels = TENANT_LABELS.get_or_init(Default::default);
    let known = labels
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .contains(tenant);
    if known {
        return metrics::SharedString::from(tenant.shared_name());
    }
    let mut labels = labels.write().unwrap_or_else(|e| e.into_inner());
    if labels.len() < TENANT_LABEL_LIMIT.load(Ordering::Relaxed) {
        labels.insert(tenant.clone());
        metrics::SharedString::from(tenant.shared_name())
    } else {
        metrics::SharedString::const_str(OTHER_TENANTS)
    }
}

pub(crate) fn request_latency(priority: Priority, elapsed: Duration) {
    metrics::histogram!(REQUEST_LATENCY, "priority" => priority.as_str())
        .record(elapsed.as_secs_f64());
}

pub(crate) fn input_tokens(tenant: &TenantId, tokens: u64) {
    metrics::counter!(INPUT_TOKENS, "tenant_id" => tenant_label(tenant)).increment(tokens);
}

pub(crate) fn demoted_tenants(count: usize) {
    metrics::gauge!(DEMOTED_TENANTS).set(count as f64);
}

#[cfg_attr(not(feature = "redis"), allow(dead_code))]
pub(crate) fn store_degraded(degraded: bool) {
    metrics::gauge!(STORE_DEGRADED).set(if degraded { 1.0 } else { 0.0 });
}

/// Gauge, slots this worker holds now, label `tier`.
pub const SLOTS_IN_USE: &str = "claude_slots_in_use";
/// Histogram, seconds a request waited for its slot, label `tier`.
pub const SLOT_WAIT: &str = "claude_slot_wait_seconds";
/// Counter, requests refused with `Busy` (`SERVER_BUSY`), label `tier`.
pub const SERVER_BUSY: &str = "claude_server_busy_total";
/// Counter, slots taken from the in-process fallback because Redis was away, label `tier`.
pub const SLOTS_FALLBACK: &str = "claude_slots_fallback_total";

pub(crate) fn slot_taken(tier: &crate::Tier, fallback: bool) {
    metrics::gauge!(SLOTS_IN_USE, "tier" => metrics::SharedString::from(tier.shared_name()))
        .increment(1.0);
    if fallback {
        metrics::counter!(SLOTS_FALLBACK, "tier" => metrics::SharedString::from(tier.shared_name())).increment(1);
    }
}

pub(crate) fn slot_given_back(tier: &crate::Tier) {
    metrics::gauge!(SLOTS_IN_USE, "tier" => metrics::SharedString::from(tier.shared_name()))
        .decrement(1.0);
}

pub(crate) fn slot_wait(tier: &crate::Tier, waited: Duration) {
    metrics::histogram!(SLOT_WAIT, "tier" => metrics::SharedString::from(tier.shared_name()))
        .record(waited.as_secs_f64());
}

pub(crate) fn server_busy(tier: &crate::Tier) {
    metrics::counter!(SERVER_BUSY, "tier" => metrics::SharedString::from(tier.shared_name()))
        .increment(1);
}
