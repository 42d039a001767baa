//! Learned pacing, the worker's side: reading the provider's rate-limit headers, choosing
//! the upstream key of a request, and the worker's view of each key's learned bucket (so a
//! call in steady state costs no round trip on Redis).
//!
//! The bucket itself (limits, theoretical arrival times, the probe lease) lives in the
//! store (`store/pacing.rs`, `scripts/learned_pace.lua`).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use http::HeaderMap;
use tokio::time::Instant;

use crate::hash::HashMap;
use crate::store::{DIMS, MAX_LIMIT, PaceAsk, PaceGrant};

/// The four dimensions Anthropic reports, in the store's order.
const NAMES: [&str; DIMS] = ["requests", "input-tokens", "output-tokens", "tokens"];

/// `anthropic-ratelimit-<dim>-limit` and `-remaining`, as header names.
static HEADERS: std::sync::LazyLock<[(http::HeaderName, http::HeaderName); DIMS]> =
    std::sync::LazyLock::new(|| {
        NAMES.map(|dim| {
            (
                http::HeaderName::from_bytes(format!("anthropic-ratelimit-{dim}-limit").as_bytes())
                    .expect("valid header name"),
                http::HeaderName::from_bytes(
                    format!("anthropic-ratelimit-{dim}-remaining").as_bytes(),
                )
                .expect("valid header name"),
            )
        })
    });

/// The dimension's name, for metrics.
fn dim_name(d: usize) -> &'static str {
    NAMES.get(d).copied().unwrap_or("unknown")
}

/// Sets the learned-limit gauge of each dimension `upstream` has a limit in.
pub(super) fn learned_limits(upstream: &str, limits: &[u32; DIMS]) {
    for (d, limit) in limits.iter().enumerate() {
        if *limit > 0 {
            metrics::gauge!(
                crate::metrics::Metric::LearnedLimit.name(),
                "upstream" => upstream.to_owned(),
                "dimension" => dim_name(d)
            )
            .set(f64::from(*limit));
        }
    }
}

/// Whether an answer carries any `anthropic-ratelimit-*` header: one pass over its few
/// header names, so an answer without them (most upstreams, most tests) costs no lookups.
pub(crate) fn has_ratelimit_headers(headers: &HeaderMap) -> bool {
    headers
        .keys()
        .any(|name| name.as_str().starts_with("anthropic-ratelimit-"))
}

static LOGGED_GARBAGE: AtomicBool = AtomicBool::new(false);

/// What an answer's headers say per dimension: `(limit, remaining)`, limit 0 when the
/// dimension is absent or its values are unusable (zero, absurd, not a number), which is
/// logged once per process (`upstream.ratelimit_ignored`).
pub(super) fn read_limits(headers: &HeaderMap) -> [(u32, u32); DIMS] {
    let mut out = [(0, 0); DIMS];
    if !has_ratelimit_headers(headers) {
        return out;
    }
    for (d, (limit, remaining)) in HEADERS.iter().enumerate() {
        let Some(raw_limit) = headers.get(limit) else {
            continue;
        };
        let parse = |v: &http::HeaderValue| {
            let s = v.to_str().ok()?.trim();
            if s.is_empty() || s.len() > 19 || !s.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            s.parse::<u64>().ok()
        };
        let l = parse(raw_limit);
        // A missing `-remaining` says nothing of the bucket: a full one is assumed (the
        // limit is still learned).
        let r = match headers.get(remaining) {
            Some(v) => parse(v),
            None => l,
        };
        match (l, r) {
            (Some(l), Some(r)) if (1..=u64::from(MAX_LIMIT)).contains(&l) => {
                // `-remaining` above `-limit` is read as a full bucket.
                out[d] = (l as u32, r.min(l) as u32);
            }
            _ => {
                if !LOGGED_GARBAGE.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        name: "upstream.ratelimit_ignored",
                        dimension = NAMES[d],
                        limit = ?raw_limit,
                        "unusable rate-limit headers ignored (zero, absurd or not a number); \
                         logged once"
                    );
                }
            }
        }
    }
    out
}

/// Chooses the upstream key of a request: the scope of its cooldown gate and learned limits.
///
/// One throttled key or model then does not hold the others. The key is appended to the
/// policy's [`upstream`](crate::retry_after_backoff::BackoffPolicyBuilder::upstream) name (`"default/key-…"`);
/// `None` means the policy's name alone. Ready-made: [`OneUpstream`] (the default),
/// [`ByApiKey`], [`ByModel`], [`ByApiKeyAndModel`]; or a closure `Fn(&Req) -> Option<String>`.
///
/// ```
/// use fairgate::{RetryAfterBackoffLayer, Store};
/// use fairgate::rate::ByApiKeyAndModel;
/// use fairgate::BackoffPolicy;
///
/// let layer = RetryAfterBackoffLayer::new(Store::memory(), BackoffPolicy::default())
///     .upstream_key_with(ByApiKeyAndModel);
/// // Or any rule of your own:
/// let layer = RetryAfterBackoffLayer::new(Store::memory(), BackoffPolicy::default())
///     .upstream_key_with(|req: &http::Request<String>| {
///         req.headers().get("x-region").and_then(|v| v.to_str().ok()).map(str::to_owned)
///     });
/// # let _ = layer;
/// ```
pub trait UpstreamKey<Req>: Send + Sync + 'static {
    /// The key of `req`, or `None` for the policy's upstream alone.
    fn upstream_key(&self, req: &Req) -> Option<String>;
}

/// One key per layer: the policy's upstream name (the default).
#[derive(Clone, Copy, Debug, Default)]
pub struct OneUpstream;

impl<Req> UpstreamKey<Req> for OneUpstream {
    fn upstream_key(&self, _: &Req) -> Option<String> {
        None
    }
}

/// One key per API key (`x-api-key` or `Authorization: Bearer`), hashed
/// ([`api_key_tenant`](crate::extract::api_key_tenant)): the key never reaches the store or
/// a metric label in clear. Anthropic's limits are per organisation; give each key its own
/// scope when the keys belong to different organisations or workspaces.
#[derive(Clone, Copy, Debug, Default)]
pub struct ByApiKey;

impl<B> UpstreamKey<http::Request<B>> for ByApiKey {
    fn upstream_key(&self, req: &http::Request<B>) -> Option<String> {
        crate::extract::api_key(req).map(|key| crate::extract::api_key_tenant(key).to_string())
    }
}

/// One key per model, read from the request body's `"model"` field (JSON; the body must be
/// buffered: `String`, `Vec<u8>`, `Bytes`). Anthropic's limits are per model class.
#[derive(Clone, Copy, Debug, Default)]
pub struct ByModel;

impl<B: AsRef<[u8]>> UpstreamKey<http::Request<B>> for ByModel {
    fn upstream_key(&self, req: &http::Request<B>) -> Option<String> {
        model_of(req.body().as_ref()).map(|m| format!("model-{m}"))
    }
}

/// Both: one key per API key and model.
#[derive(Clone, Copy, Debug, Default)]
pub struct ByApiKeyAndModel;

impl<B: AsRef<[u8]>> UpstreamKey<http::Request<B>> for ByApiKeyAndModel {
    fn upstream_key(&self, req: &http::Request<B>) -> Option<String> {
        match (ByApiKey.upstream_key(req), ByModel.upstream_key(req)) {
            (Some(key), Some(model)) => Some(format!("{key}/{model}")),
            (key, model) => key.or(model),
        }
    }
}

impl<F, Req> UpstreamKey<Req> for F
where
    F: Fn(&Req) -> Option<String> + Send + Sync + 'static,
{
    fn upstream_key(&self, req: &Req) -> Option<String> {
        self(req)
    }
}

/// The value of the first top-level-looking `"model": "<name>"` in a JSON body: a name of
/// at most 128 characters among letters, digits and `-._:@`; anything else is `None`.
pub(super) fn model_of(body: &[u8]) -> Option<&str> {
    const NEEDLE: &[u8] = b"\"model\"";
    let at = body.windows(NEEDLE.len()).position(|w| w == NEEDLE)?;
    let rest = &body[at + NEEDLE.len()..];
    let rest = rest
        .trim_ascii_start()
        .strip_prefix(b":")?
        .trim_ascii_start();
    let rest = rest.strip_prefix(b"\"")?;
    let end = rest.iter().position(|b| *b == b'"')?;
    let name = &rest[..end];
    let ok = !name.is_empty()
        && name.len() <= 128
        && name
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || b"-._:@".contains(b));
    ok.then(|| std::str::from_utf8(name).ok()).flatten()
}

/// What a worker knows of one key's learned bucket.
#[derive(Debug)]
pub(super) struct View {
    /// 0: cold (no answer yet), 1: answers carry no limits, 2: limits learned.
    pub(super) mode: u8,
    pub(super) limits: [u32; DIMS],
    /// Recovering from a throttle (one probe first) until then, as far as this worker knows.
    pub(super) recover_until: Option<Instant>,
    /// Cells reserved ahead (Redis), usable from `credit_at`.
    pub(super) credit: [u32; DIMS],
    pub(super) credit_at: Instant,
    /// Reports not sent yet (Redis, steady state): they go with the next reservation.
    pub(super) pending: Option<PaceAsk>,
    /// A reservation of a block of calls is on its way to the store (see
    /// [`View::block`]).
    pub(super) block_asked: bool,
    /// Input and output tokens per call, on average over the recent answers' usage (0:
    /// none seen).
    pub(super) input_avg: u32,
    pub(super) output_avg: u32,
}

impl View {
    pub(super) fn new(learning: bool) -> Self {
        View {
            // Without learning there is no cold start: calls go without waiting for an answer.
            mode: if learning { 0 } else { 1 },
            limits: [0; DIMS],
            recover_until: None,
            credit: [0; DIMS],
            credit_at: Instant::now(),
            pending: None,
            block_asked: false,
            input_avg: 0,
            output_avg: 0,
        }
    }

    /// How many calls a reservation about to be asked for takes at once: on Redis in steady
    /// state a quarter second of the learned request rate (`per_sec`, at most 64 calls), so
    /// a call is not a round trip; else 1. Only one block is asked for at a time (until
    /// [`Views::block_done`]): calls that ask side by side — every call woken when a limit
    /// changed, or at the end of the cold start — would each take a block, reserve several
    /// times what they need and pool the spare cells behind the latest block's time, seconds
    /// ahead under a limit that went up. They take their own cells instead.
    pub(super) fn block(&mut self, remote: bool, recovering: bool, per_sec: f64) -> u32 {
        if !remote || self.mode != 2 || recovering || self.block_asked {
            return 1;
        }
        let block = ((per_sec / 4.0).floor() as u32).clamp(1, 64);
        self.block_asked = block > 1;
        block
    }

    pub(super) fn recovering(&mut self, now: Instant) -> bool {
        match self.recover_until {
            Some(at) if now < at => true,
            Some(_) => {
                self.recover_until = None;
                false
            }
            None => false,
        }
    }

    /// Applies what the store said.
    pub(super) fn update(&mut self, grant: &PaceGrant, recover: Duration) {
        self.mode = self.mode.max(grant.mode);
        if grant.limits != self.limits {
            self.limits = grant.limits;
            self.credit = [0; DIMS];
        }
        self.recover_until = grant.recovering.then(|| Instant::now() + recover);
    }
}

/// The views of one layer, per key. Bounded: past 4,096 keys the idle ones are forgotten
/// (and learned again from the store).
#[derive(Debug, Default)]
pub(super) struct Views {
    map: HashMap<Arc<str>, View>,
}

impl View {
    /// Nothing to learn, recover from or report: answers without rate-limit headers
    /// change nothing (see `Rates::report`'s lock-free path).
    fn is_quiet(&self) -> bool {
        self.mode == 1 && self.recover_until.is_none() && self.pending.is_none()
    }
}

impl Views {
    /// The view of `key` (created cold), through a guard that keeps `loud` — the number
    /// of views that are not quiet — true when it is dropped.
    pub(super) fn get<'a>(
        &'a mut self,
        key: &Arc<str>,
        learning: bool,
        loud: &'a AtomicUsize,
    ) -> ViewGuard<'a> {
        if self.map.len() >= 4096 && !self.map.contains_key(key) {
            let now = Instant::now();
            self.map.retain(|_, v| {
                v.pending.is_some() || v.block_asked || v.recover_until.is_some_and(|at| at > now)
            });
            let count = self.map.values().filter(|v| !v.is_quiet()).count();
            loud.store(count, Ordering::Release);
        }
        let mut created = false;
        // One hash: an `Arc` clone is cheaper than a second lookup.
        let view = self.map.entry(key.clone()).or_insert_with(|| {
            created = true;
            View::new(learning)
        });
        let quiet_before = view.is_quiet();
        if created && !quiet_before {
            // Counted at once (a cold view is loud), before anyone reads the new view as
            // known.
            loud.fetch_add(1, Ordering::Release);
        }
        ViewGuard {
            quiet_before,
            view,
            loud,
        }
    }

    /// The view of `key`, if there is one (none is created).
    pub(super) fn peek(&self, key: &str) -> Option<&View> {
        self.map.get(key)
    }

    /// The block reservation of `key` asked for by [`View::block`] is answered (or given
    /// up): the next call short of cells may ask for a block again.
    pub(super) fn block_done(&mut self, key: &str) {
        if let Some(view) = self.map.get_mut(key) {
            view.block_asked = false;
        }
    }
}

/// A view borrowed from [`Views`]; counts it in or out of the loud views when dropped.
pub(super) struct ViewGuard<'a> {
    view: &'a mut View,
    quiet_before: bool,
    loud: &'a AtomicUsize,
}

impl std::ops::Deref for ViewGuard<'_> {
    type Target = View;

    fn deref(&self) -> &View {
        self.view
    }
}

impl std::ops::DerefMut for ViewGuard<'_> {
    fn deref_mut(&mut self) -> &mut View {
        self.view
    }
}

impl Drop for ViewGuard<'_> {
    fn drop(&mut self) {
        match (self.quiet_before, self.view.is_quiet()) {
            (true, false) => {
                self.loud.fetch_add(1, Ordering::Release);
            }
            (false, true) => {
                self.loud.fetch_sub(1, Ordering::Release);
            }
            _ => {}
        }
    }
}

/// Merges a report into pending ones: the latest headers, charges summed.
pub(super) fn merge(pending: &mut Option<PaceAsk>, report: &PaceAsk) {
    match pending {
        None => *pending = Some(*report),
        Some(p) => {
            for d in 0..DIMS {
                if report.learn[d].0 != 0 {
                    p.learn[d] = report.learn[d];
                }
                p.charge[d] = p.charge[d].saturating_add(report.charge[d]);
            }
            p.answered = p.answered.max(report.answered);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (k, v) in pairs {
            map.insert(
                http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                http::HeaderValue::from_str(v).unwrap(),
            );
        }
        map
    }

    #[test]
    fn hostile_limits_are_ignored_and_remaining_over_limit_reads_as_full() {
        let h = headers(&[
            ("anthropic-ratelimit-requests-limit", "50"),
            ("anthropic-ratelimit-requests-remaining", "900"),
            ("anthropic-ratelimit-input-tokens-limit", "0"),
            ("anthropic-ratelimit-input-tokens-remaining", "0"),
            (
                "anthropic-ratelimit-output-tokens-limit",
                "99999999999999999999999",
            ),
            ("anthropic-ratelimit-tokens-limit", "-3"),
        ]);
        assert_eq!(read_limits(&h), [(50, 50), (0, 0), (0, 0), (0, 0)]);
        assert_eq!(read_limits(&HeaderMap::new()), [(0, 0); DIMS]);
    }

    #[tokio::test(start_paused = true)]
    async fn calls_asking_side_by_side_take_one_block_between_them() {
        // A limit going up (480 -> 1,200 RPM at 0.95): the calls that waited under the old
        // limit all ask again at once. One asks for a block, the others for their own cells.
        let mut view = View::new(true);
        view.mode = 2;
        let per_sec = |rpm: f64| rpm * 0.95 / 60.0;
        assert_eq!(view.block(true, false, per_sec(480.0)), 1);
        let blocks: Vec<u32> = (0..10)
            .map(|_| view.block(true, false, per_sec(1_200.0)))
            .collect();
        assert_eq!(blocks, [4, 1, 1, 1, 1, 1, 1, 1, 1, 1]);
        // Once that block is answered, the next call short of cells asks for one again.
        let mut views = Views::default();
        let key: Arc<str> = Arc::from("k");
        let loud = AtomicUsize::new(0);
        let mut guard = views.get(&key, true, &loud);
        guard.mode = 2;
        assert_eq!(guard.block(true, false, per_sec(1_200.0)), 4);
        drop(guard);
        views.block_done(&key);
        let mut guard = views.get(&key, true, &loud);
        assert_eq!(guard.block(true, false, per_sec(1_200.0)), 4);
        // The memory store, the cold start and recovery never take blocks.
        let mut view = View::new(true);
        view.mode = 2;
        assert_eq!(view.block(false, false, per_sec(1_200.0)), 1);
        assert_eq!(view.block(true, true, per_sec(1_200.0)), 1);
        view.mode = 0;
        assert_eq!(view.block(true, false, per_sec(1_200.0)), 1);
    }

    #[test]
    fn the_model_is_read_from_a_json_body() {
        assert_eq!(
            model_of(br#"{"max_tokens":1,"model" : "claude-sonnet-4-5","x":1}"#),
            Some("claude-sonnet-4-5")
        );
        assert_eq!(model_of(br#"{"model":"a b"}"#), None);
        assert_eq!(model_of(br#"{"model":12}"#), None);
        assert_eq!(model_of(b"garbage"), None);
    }
}
