//! The metrics fairgate publishes, through the [`metrics`] facade (install any exporter;
//! with none installed they cost next to nothing).
//!
//! The constants here and in the layers' modules are the names under the default prefix
//! `claude_` (the ones `dashboards/fairgate.json` queries); [`set_metric_prefix`] chooses
//! another (`set_metric_prefix("llm_")` publishes `llm_queue_depth`). Labels that carry a tenant are
//! capped (see [`limit_tenant_labels`]) so a million tenants cannot explode a time-series
//! database.

use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock, RwLock};
use std::time::Duration;

use metrics::{Key, Label, Level, Metadata};

use crate::error::ConfigError;
use crate::hash::HashMap;
use crate::{Priority, TenantId};

/// The prefix of every metric name unless [`set_metric_prefix`] chose another.
pub const DEFAULT_PREFIX: &str = "claude_";

/// Every metric fairgate publishes; the index into the names in force.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Metric {
    RequestLatency,
    DemotedTenants,
    InputTokens,
    StoreDegraded,
    SlotsInUse,
    SlotWait,
    ServerBusy,
    SlotsFallback,
    QueueDepth,
    FairnessIndex,
    ThrottleCount,
    Retries,
    GaveUp,
    CooldownWaits,
    CooldownWaitSeconds,
    LearnedLimit,
    PacingWaitSeconds,
    Probes,
}

const METRICS: usize = 18;

impl Metric {
    const ALL: [Metric; METRICS] = [
        Metric::RequestLatency,
        Metric::DemotedTenants,
        Metric::InputTokens,
        Metric::StoreDegraded,
        Metric::SlotsInUse,
        Metric::SlotWait,
        Metric::ServerBusy,
        Metric::SlotsFallback,
        Metric::QueueDepth,
        Metric::FairnessIndex,
        Metric::ThrottleCount,
        Metric::Retries,
        Metric::GaveUp,
        Metric::CooldownWaits,
        Metric::CooldownWaitSeconds,
        Metric::LearnedLimit,
        Metric::PacingWaitSeconds,
        Metric::Probes,
    ];

    /// The name under [`DEFAULT_PREFIX`]: the public constant.
    fn default_name(self) -> &'static str {
        match self {
            Metric::RequestLatency => REQUEST_LATENCY,
            Metric::DemotedTenants => DEMOTED_TENANTS,
            Metric::InputTokens => INPUT_TOKENS,
            Metric::StoreDegraded => STORE_DEGRADED,
            Metric::SlotsInUse => SLOTS_IN_USE,
            Metric::SlotWait => SLOT_WAIT,
            Metric::ServerBusy => SERVER_BUSY,
            Metric::SlotsFallback => SLOTS_FALLBACK,
            Metric::QueueDepth => QUEUE_DEPTH,
            Metric::FairnessIndex => FAIRNESS_INDEX,
            Metric::ThrottleCount => THROTTLE_COUNT,
            Metric::Retries => RETRIES,
            Metric::GaveUp => GAVE_UP,
            Metric::CooldownWaits => COOLDOWN_WAITS,
            Metric::CooldownWaitSeconds => COOLDOWN_WAIT_SECONDS,
            Metric::LearnedLimit => LEARNED_LIMIT,
            Metric::PacingWaitSeconds => PACING_WAIT_SECONDS,
            Metric::Probes => PROBES,
        }
    }

    /// The name to publish under: fixed by [`set_metric_prefix`], or by the first metric
    /// published (then with the default prefix).
    pub(crate) fn name(self) -> &'static str {
        let names = NAMES.get_or_init(|| Metric::ALL.map(|m| Box::from(m.default_name())));
        &names[self as usize]
    }
}

static NAMES: OnceLock<[Box<str>; METRICS]> = OnceLock::new();

/// Publishes every metric under `prefix` instead of [`DEFAULT_PREFIX`], process wide:
/// `set_metric_prefix("llm_")` turns `claude_queue_depth` into `llm_queue_depth`.
///
/// Call it once, at start-up, before any layer publishes a metric: the names are fixed by
/// the first metric published (or the first successful call) and later calls are refused.
/// A prefix must be a valid start of a Prometheus metric name: ASCII letters, digits, `_`
/// and `:`, not starting with a digit (it may be empty).
///
/// ```no_run
/// // In main, before building the layers (process wide, so not run here).
/// fairgate::metrics::set_metric_prefix("llm_gateway_")?;
/// assert!(fairgate::metrics::set_metric_prefix("other_").is_err());
/// # Ok::<(), fairgate::ConfigError>(())
/// ```
pub fn set_metric_prefix(prefix: &str) -> Result<(), ConfigError> {
    let valid = prefix
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
        && !prefix.starts_with(|c: char| c.is_ascii_digit());
    if !valid {
        return Err(ConfigError::new(format!(
            "metric prefix {prefix:?}: only ASCII letters, digits, '_' and ':', no leading digit"
        )));
    }
    let names = Metric::ALL.map(|m| {
        let suffix = m
            .default_name()
            .strip_prefix(DEFAULT_PREFIX)
            .unwrap_or(m.default_name());
        format!("{prefix}{suffix}").into_boxed_str()
    });
    NAMES.set(names).map_err(|_| {
        ConfigError::new(format!(
            "metric names are already fixed (e.g. {}): set the prefix once, before any metric",
            Metric::RequestLatency.name()
        ))
    })
}

/// Histogram, seconds from the outermost layer's `call` to its outcome, labels `priority` and
/// `outcome`: `answered` (a response came back, whatever its status), `refused` (fairgate
/// refused it: `Busy`, `QueueFull`, ...) or `failed` (any other error). An SLO on latency
/// reads `outcome="answered"`: a refusal at a tier's max wait is not a slow answer.
pub const REQUEST_LATENCY: &str = "claude_request_latency_seconds";
/// Gauge, tenants currently demoted to batch as this worker knows them.
pub const DEMOTED_TENANTS: &str = "claude_demoted_tenants";
/// Counter, estimated input tokens admitted, label `tenant_id`.
pub const INPUT_TOKENS: &str = "claude_input_tokens_total";
/// Gauge, 1 while the store serves from in-process state because Redis is unreachable.
pub const STORE_DEGRADED: &str = "claude_store_degraded";

/// Histogram buckets for LLM calls, in seconds: 10 ms to 10 minutes, with the dashboard's
/// SLO lines (2 s, 6 s, 120 s) on bucket bounds. Give them to every histogram fairgate
/// publishes ([`HISTOGRAMS`]); an exporter's default buckets (Prometheus' end at 10 s) or
/// summaries (which cannot be added up across a fleet) do not fit calls of minutes.
pub const LATENCY_BUCKETS: [f64; 17] = [
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 6.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0,
    600.0,
];

/// The histograms fairgate publishes, under the default prefix; all in seconds, all ending
/// in `_seconds`.
pub const HISTOGRAMS: [&str; 4] = [
    REQUEST_LATENCY,
    SLOT_WAIT,
    COOLDOWN_WAIT_SECONDS,
    PACING_WAIT_SECONDS,
];

/// The `tenant_id` label of tenants past the cap.
pub const OTHER_TENANTS: &str = "_other";

static TENANT_LABEL_LIMIT: AtomicUsize = AtomicUsize::new(1_000);
/// The labelled tenants, each with its input-token counter's key (built once).
static TENANT_LABELS: OnceLock<RwLock<HashMap<TenantId, Key>>> = OnceLock::new();
static NAMESPACE_LABELS: AtomicBool = AtomicBool::new(false);

/// Caps how many distinct tenants get their own `tenant_id` label (default 1,000, process
/// wide, first come first labelled); the rest are counted under [`OTHER_TENANTS`].
pub fn limit_tenant_labels(max: usize) {
    TENANT_LABEL_LIMIT.store(max, Ordering::Relaxed);
}

/// Labels a tenant named `namespace/rest` by its `namespace` alone (default off, process
/// wide): the end users of a service (`service/<hash>`, as `fairgate-gateway` names them)
/// then never become a label, and their service's label counts them all. A name without
/// `/` is its own label, as before. A gauge labelled so (`claude_throttle_count`) shows
/// the last value set by any of the namespace's tenants.
pub fn label_tenants_by_namespace(on: bool) {
    NAMESPACE_LABELS.store(on, Ordering::Relaxed);
}

/// The part of `tenant`'s name its label shows.
fn label_name(tenant: &TenantId) -> &str {
    label_part(tenant.as_str(), NAMESPACE_LABELS.load(Ordering::Relaxed))
}

/// `name`, or with `by_namespace` its part before the first `/`.
fn label_part(name: &str, by_namespace: bool) -> &str {
    match name.split_once('/') {
        Some((namespace, _)) if by_namespace => namespace,
        _ => name,
    }
}

/// The label value for `tenant`: its name (shared, no copy), or [`OTHER_TENANTS`] past the
/// cap.
pub(crate) fn tenant_label(tenant: &TenantId) -> metrics::SharedString {
    match labelled(tenant, |labelled, _| labelled.shared_name()) {
        Some(name) => metrics::SharedString::from(name),
        None => metrics::SharedString::const_str(OTHER_TENANTS),
    }
}

/// `f` on the labelled tenant (`tenant`, or its namespace) and its input-token key when it
/// has (or now gets) its own label; `None` past the cap.
fn labelled<T>(tenant: &TenantId, f: impl FnOnce(&TenantId, &Key) -> T) -> Option<T> {
    let labels = TENANT_LABELS.get_or_init(Default::default);
    let name = label_name(tenant);
    if let Some((labelled, key)) = labels
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .get_key_value(name)
    {
        return Some(f(labelled, key));
    }
    let mut labels = labels.write().unwrap_or_else(|e| e.into_inner());
    if !labels.contains_key(name) && labels.len() >= TENANT_LABEL_LIMIT.load(Ordering::Relaxed) {
        return None;
    }
    if !labels.contains_key(name) {
        // Once per label: the namespace's own id, or the tenant's (no copy).
        let id = if name.len() == tenant.as_str().len() {
            tenant.clone()
        } else {
            TenantId::new(name)
        };
        let label = metrics::SharedString::from(id.shared_name());
        labels.insert(id, labelled_key(Metric::InputTokens, "tenant_id", label));
    }
    let (labelled, key) = labels.get_key_value(name)?;
    Some(f(labelled, key))
}

/// The metadata every metric here registers with.
static METADATA: Metadata<'static> =
    Metadata::new(module_path!(), Level::INFO, Some(module_path!()));

/// The key of `metric` with one label: built once and kept, so publishing costs no label
/// allocation and no key hash per request (a recorder is still looked up at each use, so a
/// recorder installed later, or a thread's local one, sees every value).
fn labelled_key(metric: Metric, label: &'static str, value: metrics::SharedString) -> Key {
    Key::from_parts(metric.name(), vec![Label::new(label, value)])
}

fn counter(key: &Key) -> metrics::Counter {
    metrics::with_recorder(|recorder| recorder.register_counter(key, &METADATA))
}

fn gauge(key: &Key) -> metrics::Gauge {
    metrics::with_recorder(|recorder| recorder.register_gauge(key, &METADATA))
}

fn histogram(key: &Key) -> metrics::Histogram {
    metrics::with_recorder(|recorder| recorder.register_histogram(key, &METADATA))
}

/// How a call through the stack ended: the `outcome` label of [`REQUEST_LATENCY`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// A response came back (whatever its status).
    Answered,
    /// Fairgate refused it ([`Rejection`](crate::reject::Rejection): `Busy`, `QueueFull`, ...).
    Refused,
    /// Any other error (the inner service's, a transport's).
    Failed,
}

impl Outcome {
    const ALL: [Outcome; 3] = [Outcome::Answered, Outcome::Refused, Outcome::Failed];

    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Outcome::Answered => "answered",
            Outcome::Refused => "refused",
            Outcome::Failed => "failed",
        }
    }
}

/// The keys of [`REQUEST_LATENCY`], by priority and outcome, built once.
fn latency_keys() -> &'static [[Key; 3]; 3] {
    static KEYS: OnceLock<[[Key; 3]; 3]> = OnceLock::new();
    KEYS.get_or_init(|| {
        Priority::ALL.map(|p| {
            Outcome::ALL.map(|o| {
                Key::from_parts(
                    Metric::RequestLatency.name(),
                    vec![
                        Label::new("priority", p.as_str()),
                        Label::new("outcome", o.as_str()),
                    ],
                )
            })
        })
    })
}

pub(crate) fn request_latency(priority: Priority, outcome: Outcome, elapsed: Duration) {
    histogram(&latency_keys()[priority as usize][outcome as usize]).record(elapsed.as_secs_f64());
}

pub(crate) fn input_tokens(tenant: &TenantId, tokens: u64) {
    if labelled(tenant, |_, key| counter(key).increment(tokens)).is_none() {
        static OTHER: OnceLock<Key> = OnceLock::new();
        let key = OTHER
            .get_or_init(|| labelled_key(Metric::InputTokens, "tenant_id", OTHER_TENANTS.into()));
        counter(key).increment(tokens);
    }
}

pub(crate) fn demoted_tenants(count: usize) {
    metrics::gauge!(Metric::DemotedTenants.name()).set(count as f64);
}

#[cfg_attr(not(feature = "redis"), allow(dead_code))]
pub(crate) fn store_degraded(degraded: bool) {
    metrics::gauge!(Metric::StoreDegraded.name()).set(if degraded { 1.0 } else { 0.0 });
}

// RetryAfterBackoff

/// Gauge, 429s of a tenant inside the store's throttle window (rolling 60 s by default), as
/// of its latest throttle; label `tenant_id` (capped, see
/// [`limit_tenant_labels`]).
pub const THROTTLE_COUNT: &str = "claude_throttle_count";
/// Counter, retries sent, label `status` (the status that was retried).
pub const RETRIES: &str = "claude_retries_total";
/// Counter, retryable answers returned to the caller instead, label `reason`
/// (`max_retries`, `budget`, `over_max_delay`, `spend_limit`, `not_clonable`,
/// `peek_timeout`, `peek_frame_limit`).
pub const GAVE_UP: &str = "claude_retries_given_up_total";
/// The `reason` labels of [`GAVE_UP`].
const GAVE_UP_REASONS: [&str; 7] = [
    "max_retries",
    "budget",
    "over_max_delay",
    "spend_limit",
    "not_clonable",
    "peek_timeout",
    "peek_frame_limit",
];
/// Counter, calls held behind a closed cooldown gate (each hold counts).
pub const COOLDOWN_WAITS: &str = "claude_cooldown_waits_total";
/// Histogram, seconds a call was held behind a closed cooldown gate (each hold).
pub const COOLDOWN_WAIT_SECONDS: &str = "claude_cooldown_wait_seconds";
/// Gauge, the per-minute limit learned from the provider's `anthropic-ratelimit-*-limit`
/// headers, labels `upstream` (the upstream key: API keys appear hashed) and `dimension`
/// (`requests`, `input-tokens`, `output-tokens`, `tokens`).
pub const LEARNED_LIMIT: &str = "claude_learned_rate_limit";
/// Histogram, seconds a call waited for learned pacing (each paced attempt).
pub const PACING_WAIT_SECONDS: &str = "claude_pacing_wait_seconds";
/// Counter, probes sent (one call going first for its whole fleet), label `reason`
/// (`cold_start`, `recovery`).
pub const PROBES: &str = "claude_probes_total";

// DrrFairness

/// Metric: gauge, requests waiting in the fair queue, label `priority`.
pub const QUEUE_DEPTH: &str = "claude_queue_depth";
/// Metric: gauge, Jain's fairness index over the weight-normalised served cost of the
/// tenants that were backlogged in the fairness window (1.0 = perfectly fair).
pub const FAIRNESS_INDEX: &str = "claude_drr_fairness_index";
/// Metric: gauge, slots this worker holds now, label `tier`.
pub const SLOTS_IN_USE: &str = "claude_slots_in_use";
/// Histogram, seconds a request waited for its slot, label `tier`.
pub const SLOT_WAIT: &str = "claude_slot_wait_seconds";
/// Counter, requests refused with `Busy` (`SERVER_BUSY`), labels `tier` and `reason` (what
/// the request waited for: `slot`, `rate`, `cooldown`, or `store` when Redis was away and
/// the call could not be admitted soundly).
pub const SERVER_BUSY: &str = "claude_server_busy_total";
/// Counter, slots taken from the in-process fallback because Redis was away, label `tier`.
pub const SLOTS_FALLBACK: &str = "claude_slots_fallback_total";

/// The `tier` label: the tier's name, shared (no copy).
fn tier_label(tier: &crate::Tier) -> metrics::SharedString {
    metrics::SharedString::from(tier.shared_name())
}

/// The keys of the metrics labelled by tier alone, built once per tier.
struct TierKeys {
    in_use: Key,
    fallback: Key,
    wait: Key,
}

/// How many tiers keep their keys; past that (tiers are configured, so never in practice)
/// the keys are built at each use.
const TIER_KEYS_KEPT: usize = 256;

static TIER_KEYS: OnceLock<RwLock<HashMap<crate::Tier, Arc<TierKeys>>>> = OnceLock::new();

thread_local! {
    /// The tier this thread last published for, with its keys: a request publishes for
    /// one tier several times, so most calls skip the shared map's lock and hash.
    static LAST_TIER: RefCell<Option<(crate::Tier, Arc<TierKeys>)>> = const { RefCell::new(None) };
}

fn with_tier_keys(tier: &crate::Tier, f: impl FnOnce(&TierKeys)) {
    let mut f = Some(f);
    LAST_TIER.with_borrow(|last| {
        if let Some((last, keys)) = last
            && last == tier
            && let Some(f) = f.take()
        {
            f(keys);
        }
    });
    let Some(f) = f else {
        return;
    };
    let kept = TIER_KEYS.get_or_init(Default::default);
    let found = kept
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .get(tier)
        .cloned();
    let keys = match found {
        Some(keys) => keys,
        None => {
            let keys = Arc::new(TierKeys {
                in_use: labelled_key(Metric::SlotsInUse, "tier", tier_label(tier)),
                fallback: labelled_key(Metric::SlotsFallback, "tier", tier_label(tier)),
                wait: labelled_key(Metric::SlotWait, "tier", tier_label(tier)),
            });
            let mut kept = kept.write().unwrap_or_else(|e| e.into_inner());
            if kept.len() >= TIER_KEYS_KEPT {
                drop(kept);
                return f(&keys);
            }
            kept.entry(tier.clone()).or_insert(keys).clone()
        }
    };
    f(&keys);
    LAST_TIER.set(Some((tier.clone(), keys)));
}

/// A slot of `tier` taken (from the outage fallback: `fallback`), after waiting `waited`
/// if the taker records its wait here: one look-up of the tier's keys for both.
pub(crate) fn slot_taken(tier: &crate::Tier, fallback: bool, waited: Option<Duration>) {
    with_tier_keys(tier, |keys| {
        gauge(&keys.in_use).increment(1.0);
        if fallback {
            counter(&keys.fallback).increment(1);
        }
        if let Some(waited) = waited {
            histogram(&keys.wait).record(waited.as_secs_f64());
        }
    });
}

pub(crate) fn slot_given_back(tier: &crate::Tier) {
    with_tier_keys(tier, |keys| gauge(&keys.in_use).decrement(1.0));
}

pub(crate) fn slot_wait(tier: &crate::Tier, waited: Duration) {
    with_tier_keys(tier, |keys| {
        histogram(&keys.wait).record(waited.as_secs_f64())
    });
}

pub(crate) fn server_busy(tier: &crate::Tier, reason: crate::admission::WaitReason) {
    metrics::counter!(Metric::ServerBusy.name(), "tier" => tier_label(tier), "reason" => reason.as_str())
        .increment(1);
}

impl Metric {
    /// What the metric is: its kind and `# HELP` text.
    fn description(self) -> (Kind, &'static str) {
        match self {
            Metric::RequestLatency => (
                Kind::Histogram,
                "Seconds from a call's arrival at the stack to its outcome, by priority and outcome (answered, refused, failed).",
            ),
            Metric::DemotedTenants => (
                Kind::Gauge,
                "Tenants currently demoted to batch, as this worker knows them.",
            ),
            Metric::InputTokens => (
                Kind::Counter,
                "Estimated input tokens of the calls classified, by tenant (capped; the rest under _other).",
            ),
            Metric::StoreDegraded => (
                Kind::Gauge,
                "1 while the store serves from in-process state because Redis is unreachable.",
            ),
            Metric::SlotsInUse => (Kind::Gauge, "Slots this worker holds now, by tier."),
            Metric::SlotWait => (
                Kind::Histogram,
                "Seconds a request waited for its slot, by tier.",
            ),
            Metric::ServerBusy => (
                Kind::Counter,
                "Requests refused with Busy (SERVER_BUSY), by tier and what they waited for (slot, rate, cooldown, store).",
            ),
            Metric::SlotsFallback => (
                Kind::Counter,
                "Slots taken from the in-process fallback while Redis was away, by tier.",
            ),
            Metric::QueueDepth => (
                Kind::Gauge,
                "Requests waiting in the fair queue, by priority.",
            ),
            Metric::FairnessIndex => (
                Kind::Gauge,
                "Jain's index over the weight-normalised served cost of the backlogged tenants (1 = fair).",
            ),
            Metric::ThrottleCount => (
                Kind::Gauge,
                "429s of a tenant inside the store's throttle window, as of its latest throttle.",
            ),
            Metric::Retries => (Kind::Counter, "Retries sent, by the status retried."),
            Metric::GaveUp => (
                Kind::Counter,
                "Retryable answers returned to the caller instead of retried, by reason.",
            ),
            Metric::CooldownWaits => (
                Kind::Counter,
                "Calls held behind a closed cooldown gate (each hold).",
            ),
            Metric::CooldownWaitSeconds => (
                Kind::Histogram,
                "Seconds a call was held behind a closed cooldown gate (each hold).",
            ),
            Metric::LearnedLimit => (
                Kind::Gauge,
                "Per-minute limits learned from the provider's rate-limit headers, by upstream key (hashed) and dimension.",
            ),
            Metric::PacingWaitSeconds => (
                Kind::Histogram,
                "Seconds a call waited for learned pacing (each paced attempt).",
            ),
            Metric::Probes => (
                Kind::Counter,
                "Probes sent (one call going first for its fleet), by reason (cold_start, recovery).",
            ),
        }
    }
}

#[derive(Clone, Copy)]
enum Kind {
    Counter,
    Gauge,
    Histogram,
}

/// Describes every metric fairgate publishes to the installed recorder: the `# HELP` and
/// unit of each family. Call it once at start-up, after installing the recorder and after
/// [`set_metric_prefix`] (it fixes the names as the first metric would).
pub fn describe() {
    for metric in Metric::ALL {
        let name = metric.name();
        let (kind, help) = metric.description();
        match kind {
            Kind::Counter => metrics::describe_counter!(name, help),
            Kind::Gauge => metrics::describe_gauge!(name, help),
            Kind::Histogram => metrics::describe_histogram!(name, metrics::Unit::Seconds, help),
        }
    }
}

/// Publishes every metric fairgate publishes at its starting value, for the label values
/// known at start (each priority and outcome, each of `tiers` and every `Busy` reason, the
/// retried statuses 429 and 529, every give-up and probe reason, tenants under
/// [`OTHER_TENANTS`]), so a dashboard reads 0 before the first event instead of no data.
/// Call it once at start-up, before traffic (it adds 0 to counters and gauges, and
/// registers histograms without a sample). `claude_learned_rate_limit` stays absent until
/// a limit is learned: its labels name the upstream key.
pub fn publish_zeros<'a>(tiers: impl IntoIterator<Item = &'a crate::Tier>) {
    for keys in latency_keys() {
        for key in keys {
            let _ = histogram(key);
        }
    }
    metrics::gauge!(Metric::DemotedTenants.name()).increment(0.0);
    metrics::counter!(Metric::InputTokens.name(), "tenant_id" => OTHER_TENANTS).increment(0);
    metrics::gauge!(Metric::StoreDegraded.name()).increment(0.0);
    for tier in tiers {
        with_tier_keys(tier, |keys| {
            gauge(&keys.in_use).increment(0.0);
            counter(&keys.fallback).increment(0);
            let _ = histogram(&keys.wait);
        });
        for reason in crate::admission::WaitReason::ALL {
            metrics::counter!(Metric::ServerBusy.name(), "tier" => tier_label(tier), "reason" => reason.as_str())
                .increment(0);
        }
    }
    for priority in Priority::ALL {
        metrics::gauge!(Metric::QueueDepth.name(), "priority" => priority.as_str()).increment(0.0);
    }
    // No backlogged tenant: as fair as it gets (what the queue publishes then too).
    metrics::gauge!(Metric::FairnessIndex.name()).set(1.0);
    metrics::gauge!(Metric::ThrottleCount.name(), "tenant_id" => OTHER_TENANTS).increment(0.0);
    for status in ["429", "529"] {
        metrics::counter!(Metric::Retries.name(), "status" => status).increment(0);
    }
    for reason in GAVE_UP_REASONS {
        metrics::counter!(Metric::GaveUp.name(), "reason" => reason).increment(0);
    }
    metrics::counter!(Metric::CooldownWaits.name()).increment(0);
    let _ = metrics::histogram!(Metric::CooldownWaitSeconds.name());
    let _ = metrics::histogram!(Metric::PacingWaitSeconds.name());
    for reason in ["cold_start", "recovery"] {
        metrics::counter!(Metric::Probes.name(), "reason" => reason).increment(0);
    }
}

#[cfg(test)]
mod namespace_tests {
    use super::label_part;

    #[test]
    fn an_end_user_is_labelled_by_its_service_only_when_asked() {
        assert_eq!(label_part("companion-app/0123abcd", true), "companion-app");
        assert_eq!(label_part("team-a", true), "team-a");
        assert_eq!(
            label_part("companion-app/0123abcd", false),
            "companion-app/0123abcd"
        );
    }
}
