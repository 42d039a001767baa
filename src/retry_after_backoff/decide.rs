//! Sans-IO decision core of the `RetryAfterBackoff` layer.
//!
//! Everything here is a pure function of its inputs: headers, a status code,
//! the caller's clock reading and a caller-supplied uniform random `unit` in
//! `[0, 1)`. No IO, no clock reads, no RNG, so the shell owns time and
//! randomness (and can seed them in tests).
//!
//! Header values come from the network, so nothing in this module panics on
//! any input: malformed values (and a delay of zero) are treated as absent,
//! values too large for a [`Duration`] as [`Duration::MAX`], and all duration
//! arithmetic is done in integer nanoseconds (`u128`) and saturates.
//!
//! Typical use by the shell after an error response:
//!
//! 1. [`should_retry`] decides whether to retry at all; on a 429 with a body at
//!    hand, [`is_spend_limit_body`] vetoes the retry.
//! 2. If the server said when ([`retry_after`], and/or [`ratelimit_wait`] for
//!    exhausted provider limits), sleep [`throttle_delay`] of that value,
//!    unless it exceeds the policy's `max_delay`.
//! 3. Otherwise sleep [`backoff_delay`] (or [`Backoff::delay`]).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use http::header::{AsHeaderName, HeaderName};
use http::{HeaderMap, StatusCode, header};

use crate::rate::has_ratelimit_headers;

const RETRY_AFTER_MS: HeaderName = HeaderName::from_static("retry-after-ms");
const X_SHOULD_RETRY: HeaderName = HeaderName::from_static("x-should-retry");

const NANOS_PER_SEC: u128 = 1_000_000_000;

// ---------------------------------------------------------------------------
// Retry-After
// ---------------------------------------------------------------------------

/// How long the server asked us to wait before the next attempt, per the
/// Anthropic API and RFC 9110 §10.2.3; `None` when it named no usable delay.
///
/// Precedence:
/// 1. `retry-after-ms`: a non-negative decimal number of milliseconds
///    (`250`, `1.5`), surrounding whitespace ignored.
/// 2. `retry-after` as delta-seconds: a non-negative decimal number of
///    seconds (`1`, `2.5`, ` 3 `).
/// 3. `retry-after` as an HTTP date (IMF-fixdate, RFC 850 or asctime),
///    measured against the response's `Date` header when present and
///    parsable (so clock skew between us and the server cancels out),
///    otherwise against `now`.
///
/// A header that is present but unparsable falls through to the next rule
/// (an invalid `retry-after-ms` does not hide a valid `retry-after`).
///
/// Numbers must match `DIGITS [ "." DIGITS ]`: signs, exponents (`1e3`),
/// `inf`, `NaN`, empty strings and non-ASCII bytes are rejected. Parsing is
/// exact decimal (no floating point); fractional digits beyond nanosecond
/// precision are truncated.
///
/// Two rules make every value land in one of three verdicts (absent, a
/// delay, too long):
///
/// - **Zero is no delay named.** A delay of zero (`retry-after: 0`,
///   `retry-after-ms: 0`, `0.0000000001`, an HTTP date at or before the
///   server's `Date`) returns `None`, as a missing header does, so the caller
///   falls back to its jittered exponential backoff instead of retrying at
///   once. The official SDKs do the same (they only honour a delay above 0).
///   A zero `retry-after-ms` does not fall through to `retry-after`: the
///   server did name a delay, just not a usable one.
/// - **Overflow is huge.** A well-formed number too large for a [`Duration`]
///   (more than `u64::MAX` seconds, whether in seconds, decimal seconds or
///   milliseconds, and however many digits) returns [`Duration::MAX`]. There
///   is deliberately no "sanity ceiling" below that: `99999999` seconds or a
///   date in the year 9999 is returned as is. Every such value is longer than
///   any `max_delay`, so the caller treats them all alike: it does not sleep,
///   and returns the response at once.
///
/// Only the first value of each header is consulted.
pub(crate) fn retry_after(headers: &HeaderMap, now: SystemTime) -> Option<Duration> {
    named_delay(headers, now).filter(|d| !d.is_zero())
}

/// [`retry_after`] before the zero rule: the delay the headers name, zero included.
fn named_delay(headers: &HeaderMap, now: SystemTime) -> Option<Duration> {
    if let Some(d) = header_str(headers, RETRY_AFTER_MS).and_then(parse_millis) {
        return Some(d);
    }
    let value = header_str(headers, header::RETRY_AFTER)?;
    if let Some(d) = parse_seconds(value) {
        return Some(d);
    }
    let at = httpdate::parse_http_date(value).ok()?;
    let base = header_str(headers, header::DATE)
        .and_then(|d| httpdate::parse_http_date(d).ok())
        .unwrap_or(now);
    Some(at.duration_since(base).unwrap_or(Duration::ZERO))
}

/// First value of `name` as trimmed visible ASCII, or `None`.
fn header_str(headers: &HeaderMap, name: impl AsHeaderName) -> Option<&str> {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::trim_ascii)
}

/// Parses `DIGITS [ "." DIGITS ]` exactly into (integer part, fraction in
/// units of 1e-9). Rejects everything else. An integer part too large for
/// `u128` saturates at `u128::MAX` (far past any `Duration` either way).
fn parse_decimal(s: &str) -> Option<(u128, u32)> {
    let (int, frac) = match s.split_once('.') {
        Some((i, f)) => (i, Some(f)),
        None => (s, None),
    };
    if !is_digits(int) {
        return None;
    }
    // Only ASCII digits reach here, so this fails only on overflow.
    let whole: u128 = int.parse().unwrap_or(u128::MAX);
    let mut nanos = 0u32;
    if let Some(f) = frac {
        if !is_digits(f) {
            return None;
        }
        let mut scale = 100_000_000u32;
        for b in f.bytes().take(9) {
            nanos += u32::from(b - b'0') * scale;
            scale /= 10;
        }
    }
    Some((whole, nanos))
}

fn is_digits(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit())
}

/// Seconds; past `u64::MAX` seconds, [`Duration::MAX`].
fn parse_seconds(s: &str) -> Option<Duration> {
    let (secs, nanos) = parse_decimal(s)?;
    Some(match u64::try_from(secs) {
        Ok(secs) => Duration::new(secs, nanos),
        Err(_) => Duration::MAX,
    })
}

/// Milliseconds; past `u64::MAX` seconds, [`Duration::MAX`].
fn parse_millis(s: &str) -> Option<Duration> {
    let (ms, frac) = parse_decimal(s)?;
    let Ok(secs) = u64::try_from(ms / 1000) else {
        return Some(Duration::MAX);
    };
    // ms % 1000 < 1000, so this fits; the sum is < 999_000_000 + 999_999, below one
    // second: Duration::new cannot carry.
    let sub = (ms % 1000) as u32 * 1_000_000 + frac / 1000;
    Some(Duration::new(secs, sub))
}

// ---------------------------------------------------------------------------
// Delays
// ---------------------------------------------------------------------------

/// Maps a caller-supplied random `unit` into `[0, 1]`: NaN becomes 0.5 (the
/// mean), infinities and out-of-range values are clamped.
fn sanitize_unit(unit: f64) -> f64 {
    if unit.is_nan() {
        0.5
    } else {
        unit.clamp(0.0, 1.0)
    }
}

/// `floor(unit * span)` for a sanitized unit; `as` from f64 saturates.
fn unit_scaled(unit: f64, span: u32) -> u128 {
    (sanitize_unit(unit) * f64::from(span)) as u128
}

fn duration_from_nanos_saturating(n: u128) -> Duration {
    match u64::try_from(n / NANOS_PER_SEC) {
        // The remainder is < 1e9 and so always fits.
        Ok(secs) => Duration::new(secs, (n % NANOS_PER_SEC) as u32),
        Err(_) => Duration::MAX,
    }
}

/// How long to wait after the server named a delay `retry_after`:
/// `retry_after × 1.2 × (1 + (unit − 0.5) × 0.4)`, i.e. `retry_after ×
/// (0.96 + 0.48 × unit)`.
///
/// The 1.2 mean leaves headroom over the server's figure (its window may
/// close a little late by our clock), and the ±20 % spread keeps tenants that
/// were throttled together from returning in lockstep.
///
/// `unit` should be uniform in `[0, 1)`; it is clamped into `[0, 1]` (NaN
/// counts as 0.5), so the result is always within
/// `[0.96 × retry_after, 1.44 × retry_after]` (to the nanosecond), and it
/// saturates at [`Duration::MAX`] instead of overflowing.
pub(crate) fn throttle_delay(retry_after: Duration, unit: f64) -> Duration {
    let r = retry_after.as_nanos();
    // Factor in parts per billion: 0.96e9 ..= 1.44e9.
    let factor = 960_000_000 + unit_scaled(unit, 480_000_000);
    let raw = r * factor / NANOS_PER_SEC;
    // Integer rounding must not leave the documented range; for every r the
    // range [ceil(0.96 r), floor(1.44 r)] holds at least one integer.
    let lo = (r * 96).div_ceil(100);
    let hi = r * 144 / 100;
    duration_from_nanos_saturating(raw.max(lo).min(hi))
}

/// Exponential backoff with jitter for when the server named no delay.
///
/// Follows the official Anthropic SDKs: `min(initial × 2^retry, max) × (1 −
/// 0.25 × unit)`, with `retry` counted from 0 for the first retry. The
/// default is `initial = 0.5 s`, `max = 8 s`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Backoff {
    /// Delay cap before jitter for the first retry (`retry = 0`).
    pub initial: Duration,
    /// Upper bound for the delay before jitter.
    pub max: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Self {
            initial: Duration::from_millis(500),
            max: Duration::from_secs(8),
        }
    }
}

impl Backoff {
    /// Delay before retry number `retry` (0 for the first retry).
    ///
    /// `unit` should be uniform in `[0, 1)`; it is clamped into `[0, 1]` (NaN
    /// counts as 0.5). The result lies in `[0.75 × cap, cap]` with
    /// `cap = min(initial × 2^retry, max)`, and never overflows, even for
    /// `retry = u32::MAX`.
    pub fn delay(&self, retry: u32, unit: f64) -> Duration {
        let initial = self.initial.as_nanos();
        let max = self.max.as_nanos();
        let cap = if initial == 0 {
            0
        } else {
            // 2^retry overflowing u128, or initial × 2^retry doing so, is far
            // past any Duration and so past `max`.
            1u128
                .checked_shl(retry)
                .and_then(|p| initial.checked_mul(p))
                .map_or(max, |d| d.min(max))
        };
        let jitter = cap * unit_scaled(unit, 250_000_000) / NANOS_PER_SEC;
        let lo = (cap * 3).div_ceil(4);
        duration_from_nanos_saturating((cap - jitter).max(lo).min(cap))
    }
}

/// [`Backoff::delay`] with the SDK defaults (0.5 s doubling up to 8 s).
#[cfg(test)]
pub(crate) fn backoff_delay(retry: u32, unit: f64) -> Duration {
    Backoff::default().delay(retry, unit)
}

// ---------------------------------------------------------------------------
// Whether to retry
// ---------------------------------------------------------------------------

/// A set of HTTP status codes (100–999), stored as a fixed-size bitset so it
/// is `Copy` and allocation-free.
///
/// The default is {429, 529}: "rate limited" and Anthropic's "overloaded".
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct StatusSet {
    bits: [u64; 15],
}

impl StatusSet {
    /// The empty set.
    pub const fn empty() -> Self {
        Self { bits: [0; 15] }
    }

    /// What the official Anthropic SDKs retry: 408, 409, 429 and every 5xx
    /// (which includes 529).
    pub const fn sdk() -> Self {
        let mut set = Self::empty().with_code(408).with_code(409).with_code(429);
        let mut code = 500;
        while code < 600 {
            set = set.with_code(code);
            code += 1;
        }
        set
    }

    /// This set plus `status` (builder style), e.g.
    /// `StatusSet::default().with(StatusCode::SERVICE_UNAVAILABLE)`.
    pub fn with(self, status: StatusCode) -> Self {
        self.with_code(status.as_u16())
    }

    /// Adds `status` to the set.
    pub fn insert(&mut self, status: StatusCode) {
        *self = self.with(status);
    }

    /// Removes `status` from the set.
    pub fn remove(&mut self, status: StatusCode) {
        if let Some((word, bit)) = Self::slot(status.as_u16()) {
            self.bits[word] &= !bit;
        }
    }

    /// Whether `status` is in the set.
    pub fn contains(&self, status: StatusCode) -> bool {
        Self::slot(status.as_u16()).is_some_and(|(word, bit)| self.bits[word] & bit != 0)
    }

    const fn with_code(mut self, code: u16) -> Self {
        if let Some((word, bit)) = Self::slot(code) {
            self.bits[word] |= bit;
        }
        self
    }

    const fn slot(code: u16) -> Option<(usize, u64)> {
        if code < 100 || code > 999 {
            return None;
        }
        let i = (code - 100) as usize;
        Some((i / 64, 1u64 << (i % 64)))
    }
}

impl Default for StatusSet {
    fn default() -> Self {
        Self::empty().with_code(429).with_code(529)
    }
}

/// Outcome of [`should_retry`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Verdict {
    /// Retry the request.
    Retry {
        /// The provider said "slow down" (429 or 529): the shell records it
        /// against the tenant and the shared cooldown.
        throttled: bool,
    },
    /// Pass the response through.
    DontRetry,
}

/// Whether an error response should be retried.
///
/// - Statuses below 400 are never retried (nothing failed), whatever the
///   headers or `retry_on` say.
/// - `x-should-retry: false` vetoes any retry.
/// - `x-should-retry: true` forces a retry even when `status` is not in
///   `retry_on`; the official SDKs honour the server's hint the same way.
///   The value is matched case-insensitively after trimming; other values
///   are ignored.
/// - Otherwise, retry iff `status` is in `retry_on`.
///
/// `throttled` is true for 429 and 529, regardless of why we retry.
///
/// The body is not seen here: on a 429 the shell must also check
/// [`is_spend_limit_body`] when it has the body, and not retry if it matches
/// (waiting does not lift a spend limit).
pub(crate) fn should_retry(
    status: StatusCode,
    headers: &HeaderMap,
    retry_on: &StatusSet,
) -> Verdict {
    if status.as_u16() < 400 {
        return Verdict::DontRetry;
    }
    let hint = header_str(headers, X_SHOULD_RETRY);
    let retry = match hint {
        Some(v) if v.eq_ignore_ascii_case("false") => false,
        Some(v) if v.eq_ignore_ascii_case("true") => true,
        _ => retry_on.contains(status),
    };
    if retry {
        Verdict::Retry {
            throttled: matches!(status.as_u16(), 429 | 529),
        }
    } else {
        Verdict::DontRetry
    }
}

/// Whether an error body reports `"error_code": "enforced_spend_limit_reached"`
/// (JSON whitespace around the colon allowed). Such a 429 must not be retried.
///
/// A byte search, not a JSON parse: it looks for the key token followed by
/// the value token, so the phrase merely appearing in a message does not
/// match.
pub(crate) fn is_spend_limit_body(body: &[u8]) -> bool {
    const KEY: &[u8] = b"\"error_code\"";
    const VALUE: &[u8] = b"\"enforced_spend_limit_reached\"";
    let skip_ws = |s: &[u8]| -> usize {
        s.iter()
            .take_while(|b| matches!(b, b' ' | b'\t' | b'\n' | b'\r'))
            .count()
    };
    let mut rest = body;
    while let Some(pos) = find(rest, KEY) {
        rest = &rest[pos + KEY.len()..];
        let after_ws = &rest[skip_ws(rest)..];
        if let Some(after_colon) = after_ws.strip_prefix(b":")
            && after_colon[skip_ws(after_colon)..].starts_with(VALUE)
        {
            return true;
        }
    }
    false
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

// ---------------------------------------------------------------------------
// Provider rate-limit headers
// ---------------------------------------------------------------------------

/// (`-remaining`, `-reset`) header pairs. `tokens` is the combined limit the
/// API also reports; it is included because it too can be the one at 0.
const RATELIMIT_HEADERS: [(&str, &str); 4] = [
    (
        "anthropic-ratelimit-requests-remaining",
        "anthropic-ratelimit-requests-reset",
    ),
    (
        "anthropic-ratelimit-tokens-remaining",
        "anthropic-ratelimit-tokens-reset",
    ),
    (
        "anthropic-ratelimit-input-tokens-remaining",
        "anthropic-ratelimit-input-tokens-reset",
    ),
    (
        "anthropic-ratelimit-output-tokens-remaining",
        "anthropic-ratelimit-output-tokens-reset",
    ),
];

/// [`RATELIMIT_HEADERS`] as header names, so a lookup parses nothing.
const RATELIMIT_NAMES: [(HeaderName, HeaderName); 4] = {
    const fn pair(i: usize) -> (HeaderName, HeaderName) {
        (
            HeaderName::from_static(RATELIMIT_HEADERS[i].0),
            HeaderName::from_static(RATELIMIT_HEADERS[i].1),
        )
    }
    [pair(0), pair(1), pair(2), pair(3)]
};

/// How long until the provider's exhausted rate limits reset.
///
/// Reads `anthropic-ratelimit-{requests,tokens,input-tokens,output-tokens}-
/// remaining` and `-reset` (RFC 3339, see [`parse_rfc3339`]). A dimension is
/// exhausted when its remaining count is `0`. Returns the wait until the
/// latest reset among exhausted dimensions, measured against `now`
/// ([`Duration::ZERO`] if already past).
///
/// `None` when no dimension is exhausted. An exhausted dimension whose reset
/// is missing or unparsable is skipped (we cannot say when it ends; the
/// `retry-after` header or backoff covers it); a remaining count that is not
/// a plain non-negative integer counts as not exhausted.
#[cfg(test)]
pub(crate) fn ratelimit_wait(headers: &HeaderMap, now: SystemTime) -> Option<Duration> {
    ratelimit_reset(headers).map(|at| at.duration_since(now).unwrap_or(Duration::ZERO))
}

/// The latest reset among exhausted dimensions, as [`ratelimit_wait`] finds it, without a
/// clock: the shell reads the clock only when a limit is exhausted.
pub(super) fn ratelimit_reset(headers: &HeaderMap) -> Option<SystemTime> {
    if !has_ratelimit_headers(headers) {
        return None;
    }
    let mut latest: Option<SystemTime> = None;
    for (remaining, reset) in &RATELIMIT_NAMES {
        let exhausted = header_str(headers, remaining)
            .filter(|s| is_digits(s))
            .is_some_and(|s| s.bytes().all(|b| b == b'0'));
        if !exhausted {
            continue;
        }
        if let Some(at) = header_str(headers, reset).and_then(parse_rfc3339) {
            latest = Some(latest.map_or(at, |l| l.max(at)));
        }
    }
    latest
}

/// [`ratelimit_reset`], skipping (when `learned`) every exhausted dimension whose
/// `-limit` is usable: learned pacing waits for one cell of it instead of its full
/// replenishment (which is what Anthropic's `-reset` says).
pub(super) fn ratelimit_reset_unlearned(headers: &HeaderMap, learned: bool) -> Option<SystemTime> {
    if !learned || !has_ratelimit_headers(headers) {
        return ratelimit_reset(headers);
    }
    let mut latest: Option<SystemTime> = None;
    for (i, (remaining, reset)) in RATELIMIT_NAMES.iter().enumerate() {
        let exhausted = header_str(headers, remaining)
            .filter(|s| is_digits(s))
            .is_some_and(|s| s.bytes().all(|b| b == b'0'));
        if !exhausted {
            continue;
        }
        let limit_name = RATELIMIT_HEADERS[i].0.replace("-remaining", "-limit");
        let has_limit = header_str(headers, limit_name.as_str())
            .filter(|s| is_digits(s) && s.len() <= 10)
            .and_then(|s| s.parse::<u64>().ok())
            .is_some_and(|l| (1..=1_000_000_000).contains(&l));
        if has_limit {
            continue;
        }
        if let Some(at) = header_str(headers, reset).and_then(parse_rfc3339) {
            latest = Some(latest.map_or(at, |l| l.max(at)));
        }
    }
    latest
}

/// Strict RFC 3339 timestamp parser:
/// `YYYY-MM-DDTHH:MM:SS[.frac](Z|±HH:MM)`, with `t` and `z` also accepted.
///
/// - The date must exist (month 1–12, day within the month, leap years per
///   the Gregorian rules).
/// - Hour < 24, minute < 60, second ≤ 60; a leap second `60` is read as `59`
///   (`SystemTime` has no leap seconds; being up to a second early on a
///   reset estimate is harmless). Offsets need hour < 24 and minute < 60;
///   `-00:00` is accepted as UTC.
/// - Any number (≥ 1) of fractional digits; beyond nanoseconds they are
///   truncated.
/// - No surrounding whitespace, no space for `T`, nothing else: `None`.
///
/// Times before 1970 are returned when the platform's `SystemTime` can
/// represent them.
pub(crate) fn parse_rfc3339(s: &str) -> Option<SystemTime> {
    let b = s.as_bytes();
    let year = fixed_digits(b, 0, 4)?;
    let month = fixed_digits(b, 5, 2)?;
    let day = fixed_digits(b, 8, 2)?;
    let hour = fixed_digits(b, 11, 2)?;
    let minute = fixed_digits(b, 14, 2)?;
    let second = fixed_digits(b, 17, 2)?;
    let separators_ok = b.get(4) == Some(&b'-')
        && b.get(7) == Some(&b'-')
        && matches!(b.get(10), Some(b'T' | b't'))
        && b.get(13) == Some(&b':')
        && b.get(16) == Some(&b':');
    if !separators_ok
        || !(1..=12).contains(&month)
        || day < 1
        || day > days_in_month(year, month)
        || hour > 23
        || minute > 59
        || second > 60
    {
        return None;
    }
    let second = second.min(59);

    let mut i = 19;
    let mut nanos = 0u32;
    if b.get(i) == Some(&b'.') {
        i += 1;
        let start = i;
        let mut scale = 100_000_000u32;
        while let Some(d) = b.get(i).filter(|d| d.is_ascii_digit()) {
            nanos += u32::from(d - b'0') * scale;
            scale /= 10;
            i += 1;
        }
        if i == start {
            return None;
        }
    }

    let offset_secs: i64 = match b.get(i)? {
        b'Z' | b'z' => {
            i += 1;
            0
        }
        sign @ (b'+' | b'-') => {
            let oh = fixed_digits(b, i + 1, 2)?;
            let om = fixed_digits(b, i + 4, 2)?;
            if b.get(i + 3) != Some(&b':') || oh > 23 || om > 59 {
                return None;
            }
            let magnitude = i64::from(oh * 3600 + om * 60);
            i += 6;
            if *sign == b'+' { magnitude } else { -magnitude }
        }
        _ => return None,
    };
    if i != b.len() {
        return None;
    }

    // Local time = UTC + offset, so UTC = local − offset. Years ≤ 9999 keep
    // all of this far inside i64.
    let days = days_from_civil(i64::from(year), month, day);
    let secs = days * 86_400 + i64::from(hour * 3600 + minute * 60 + second) - offset_secs;
    let whole = Duration::from_secs(secs.unsigned_abs());
    let at = if secs >= 0 {
        UNIX_EPOCH.checked_add(whole)?
    } else {
        UNIX_EPOCH.checked_sub(whole)?
    };
    at.checked_add(Duration::from_nanos(u64::from(nanos)))
}

/// `len` ASCII digits at `at`, as a number; `None` if out of bounds or not
/// all digits.
fn fixed_digits(b: &[u8], at: usize, len: usize) -> Option<u32> {
    let digits = b.get(at..at.checked_add(len)?)?;
    digits.iter().try_fold(0u32, |acc, &d| {
        d.is_ascii_digit().then(|| acc * 10 + u32::from(d - b'0'))
    })
}

fn is_leap_year(year: u32) -> bool {
    year.is_multiple_of(4) && (!year.is_multiple_of(100) || year.is_multiple_of(400))
}

fn days_in_month(year: u32, month: u32) -> u32 {
    match month {
        1 | 3 | 5 | 7 | 8 | 10 | 12 => 31,
        4 | 6 | 9 | 11 => 30,
        2 if is_leap_year(year) => 29,
        2 => 28,
        _ => 0,
    }
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's
/// `days_from_civil`). Expects a validated month and day.
fn days_from_civil(year: i64, month: u32, day: u32) -> i64 {
    // Count years from March so the leap day is the last day of the year.
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400); // [0, 399]
    let mp = i64::from((month + 9) % 12); // March = 0
    let doy = (153 * mp + 2) / 5 + i64::from(day) - 1; // [0, 365]
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy; // [0, 146096]
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;
    use proptest::prelude::*;

    fn headers(pairs: &[(&'static str, &[u8])]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.append(*name, HeaderValue::from_bytes(value).expect("test header"));
        }
        map
    }

    fn at(secs: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(secs)
    }

    /// Far from every date used below, so a result that depends on `now`
    /// instead of `Date` shows up.
    fn now() -> SystemTime {
        at(1_795_960_987)
    }

    #[test]
    fn retry_after_parser_table() {
        let date: &[u8] = b"Sun, 06 Nov 1994 08:49:37 GMT";
        type Row<'a> = (&'a str, &'a [(&'static str, &'a [u8])], Option<Duration>);
        let table: &[Row<'_>] = &[
            (
                "integer",
                &[("retry-after", b"1")],
                Some(Duration::from_secs(1)),
            ),
            (
                "decimal",
                &[("retry-after", b"2.5")],
                Some(Duration::from_millis(2500)),
            ),
            (
                "padded",
                &[("retry-after", b" 3 ")],
                Some(Duration::from_secs(3)),
            ),
            ("zero is no delay", &[("retry-after", b"0")], None),
            (
                "zero decimal is no delay",
                &[("retry-after", b"0.000")],
                None,
            ),
            ("negative", &[("retry-after", b"-5")], None),
            ("garbage", &[("retry-after", b"soon")], None),
            ("inf", &[("retry-after", b"inf")], None),
            ("nan", &[("retry-after", b"NaN")], None),
            ("overflow", &[("retry-after", b"1e400")], None),
            (
                "large",
                &[("retry-after", b"99999999")],
                Some(Duration::from_secs(99_999_999)),
            ),
            (
                "date ahead of Date",
                &[
                    ("date", date),
                    ("retry-after", b"Sun, 06 Nov 1994 08:49:39 GMT"),
                ],
                Some(Duration::from_secs(2)),
            ),
            (
                "date in the past",
                &[
                    ("date", date),
                    ("retry-after", b"Sun, 06 Nov 1994 08:49:30 GMT"),
                ],
                None,
            ),
            (
                "ms wins",
                &[("retry-after-ms", b"250"), ("retry-after", b"10")],
                Some(Duration::from_millis(250)),
            ),
            ("empty", &[("retry-after", b"")], None),
            ("non-utf8", &[("retry-after", b"\xff\xfe1")], None),
            (
                "invalid ms falls back",
                &[("retry-after-ms", b"-1"), ("retry-after", b"7")],
                Some(Duration::from_secs(7)),
            ),
            // Beyond the required rows.
            ("absent", &[], None),
            (
                "ms decimal",
                &[("retry-after-ms", b" 1.5 ")],
                Some(Duration::from_micros(1500)),
            ),
            (
                "ms zero is no delay, and hides retry-after",
                &[("retry-after-ms", b"0"), ("retry-after", b"9")],
                None,
            ),
            (
                "ms empty falls back",
                &[("retry-after-ms", b""), ("retry-after", b"4")],
                Some(Duration::from_secs(4)),
            ),
            ("ms alone invalid", &[("retry-after-ms", b"soon")], None),
            ("exponent", &[("retry-after", b"1e3")], None),
            ("plus sign", &[("retry-after", b"+5")], None),
            ("trailing dot", &[("retry-after", b"5.")], None),
            ("leading dot", &[("retry-after", b".5")], None),
            (
                "tab padded",
                &[("retry-after", b"\t6\t")],
                Some(Duration::from_secs(6)),
            ),
            (
                "sub-nanosecond truncated",
                &[("retry-after", b"0.0000000019")],
                Some(Duration::from_nanos(1)),
            ),
            (
                "truncated to zero is no delay",
                &[("retry-after", b"0.0000000001")],
                None,
            ),
            (
                "u64::MAX seconds",
                &[("retry-after", b"18446744073709551615")],
                Some(Duration::from_secs(u64::MAX)),
            ),
            (
                "beyond Duration is huge",
                &[("retry-after", b"18446744073709551616")],
                Some(Duration::MAX),
            ),
            (
                "decimal beyond Duration is huge",
                &[("retry-after", b"18446744073709551616.5")],
                Some(Duration::MAX),
            ),
            (
                "beyond u128 is huge",
                &[(
                    "retry-after",
                    b"999999999999999999999999999999999999999999999",
                )],
                Some(Duration::MAX),
            ),
            (
                "ms beyond Duration is huge",
                &[("retry-after-ms", b"18446744073709551616000")],
                Some(Duration::MAX),
            ),
            (
                "ms beyond u128 is huge, and hides retry-after",
                &[
                    (
                        "retry-after-ms",
                        b"999999999999999999999999999999999999999999999",
                    ),
                    ("retry-after", b"3"),
                ],
                Some(Duration::MAX),
            ),
            (
                "date far ahead is taken as is",
                &[
                    ("date", date),
                    ("retry-after", b"Fri, 31 Dec 9999 23:59:59 GMT"),
                ],
                Some(Duration::from_secs(253_402_300_799 - 784_111_777)),
            ),
            (
                "ms beyond u64",
                &[("retry-after-ms", b"18446744073709551616")],
                Some(Duration::new(18_446_744_073_709_551, 616_000_000)),
            ),
            (
                "RFC 850 date",
                &[
                    ("date", date),
                    ("retry-after", b"Sunday, 06-Nov-94 08:49:39 GMT"),
                ],
                Some(Duration::from_secs(2)),
            ),
            (
                "asctime date",
                &[("date", date), ("retry-after", b"Sun Nov  6 08:49:39 1994")],
                Some(Duration::from_secs(2)),
            ),
            (
                "date without Date header uses now",
                &[("retry-after", b"Sun, 29 Nov 2026 14:03:12 GMT")],
                Some(Duration::from_secs(5)),
            ),
            (
                "unparsable Date header uses now",
                &[
                    ("date", b"yesterday"),
                    ("retry-after", b"Sun, 29 Nov 2026 14:03:12 GMT"),
                ],
                Some(Duration::from_secs(5)),
            ),
            (
                "invalid date",
                &[
                    ("date", date),
                    ("retry-after", b"Sun, 31 Feb 1994 08:49:39 GMT"),
                ],
                None,
            ),
        ];
        for (name, pairs, expected) in table {
            assert_eq!(retry_after(&headers(pairs), now()), *expected, "{name}");
        }
    }

    /// Tiny seeded generator so the statistics test is reproducible.
    struct SplitMix64(u64);

    impl SplitMix64 {
        fn next_u64(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        }

        /// Uniform in [0, 1) from the top 53 bits.
        fn unit(&mut self) -> f64 {
            (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
        }
    }

    #[test]
    fn throttle_delay_mean_is_one_point_two_r_and_both_ends_are_reached() {
        let r = Duration::from_secs(10);
        let mut rng = SplitMix64(0x5EED);
        let n = 100_000;
        let (mut sum, mut min, mut max) = (0.0, f64::INFINITY, 0.0f64);
        for _ in 0..n {
            let d = throttle_delay(r, rng.unit()).as_secs_f64();
            sum += d;
            min = min.min(d);
            max = max.max(d);
        }
        let r = r.as_secs_f64();
        let mean = sum / f64::from(n);
        assert!((mean / (1.2 * r) - 1.0).abs() < 0.01, "mean {mean}");
        assert!(min < 0.97 * r, "min {min}");
        assert!(max > 1.43 * r, "max {max}");
    }

    #[test]
    fn throttle_delay_endpoints_and_bad_units() {
        let r = Duration::from_secs(10);
        assert_eq!(throttle_delay(r, 0.0), Duration::from_millis(9600));
        assert_eq!(throttle_delay(r, 0.5), Duration::from_secs(12));
        assert_eq!(throttle_delay(r, 1.0), Duration::from_millis(14400));
        assert_eq!(throttle_delay(r, f64::NAN), Duration::from_secs(12));
        assert_eq!(
            throttle_delay(r, f64::NEG_INFINITY),
            Duration::from_millis(9600)
        );
        assert_eq!(throttle_delay(r, 7.0), Duration::from_millis(14400));
        assert_eq!(throttle_delay(Duration::ZERO, 0.3), Duration::ZERO);
        assert_eq!(
            throttle_delay(Duration::from_nanos(1), 0.0),
            Duration::from_nanos(1)
        );
        assert_eq!(throttle_delay(Duration::MAX, 1.0), Duration::MAX);
    }

    #[test]
    fn backoff_follows_the_sdk_rule() {
        let b = Backoff::default();
        assert_eq!(b.delay(0, 0.0), Duration::from_millis(500));
        assert_eq!(b.delay(1, 0.0), Duration::from_secs(1));
        assert_eq!(b.delay(3, 0.0), Duration::from_secs(4));
        assert_eq!(b.delay(4, 0.0), Duration::from_secs(8));
        assert_eq!(b.delay(10, 0.0), Duration::from_secs(8));
        assert_eq!(b.delay(u32::MAX, 0.0), Duration::from_secs(8));
        assert_eq!(b.delay(0, 1.0), Duration::from_millis(375));
        assert_eq!(b.delay(u32::MAX, 1.0), Duration::from_secs(6));
        assert_eq!(b.delay(0, f64::NAN), Duration::from_micros(437_500));
        assert_eq!(backoff_delay(2, 0.0), Duration::from_secs(2));
        let zero = Backoff {
            initial: Duration::ZERO,
            max: Duration::from_secs(8),
        };
        assert_eq!(zero.delay(u32::MAX, 0.5), Duration::ZERO);
        let huge = Backoff {
            initial: Duration::MAX,
            max: Duration::MAX,
        };
        assert_eq!(huge.delay(200, 0.0), Duration::MAX);
    }

    #[test]
    fn should_retry_defaults_and_hints() {
        let none = HeaderMap::new();
        let set = StatusSet::default();
        let s = |c: u16| StatusCode::from_u16(c).expect("status");
        let throttled = Verdict::Retry { throttled: true };
        let plain = Verdict::Retry { throttled: false };

        assert_eq!(should_retry(s(429), &none, &set), throttled);
        assert_eq!(should_retry(s(529), &none, &set), throttled);
        assert_eq!(should_retry(s(500), &none, &set), Verdict::DontRetry);
        let with_500 = set.with(StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(should_retry(s(500), &none, &with_500), plain);
        assert_eq!(should_retry(s(503), &none, &with_500), Verdict::DontRetry);

        let no = headers(&[("x-should-retry", b"false")]);
        assert_eq!(should_retry(s(429), &no, &set), Verdict::DontRetry);
        let yes = headers(&[("x-should-retry", b"true")]);
        assert_eq!(should_retry(s(400), &yes, &set), plain);
        assert_eq!(should_retry(s(429), &yes, &set), throttled);
        let yes_loud = headers(&[("x-should-retry", b" TRUE ")]);
        assert_eq!(should_retry(s(400), &yes_loud, &set), plain);
        let junk = headers(&[("x-should-retry", b"maybe")]);
        assert_eq!(should_retry(s(400), &junk, &set), Verdict::DontRetry);
        assert_eq!(should_retry(s(429), &junk, &set), throttled);

        // Non-errors are never retried.
        assert_eq!(should_retry(s(200), &yes, &set), Verdict::DontRetry);
        assert_eq!(
            should_retry(s(200), &none, &StatusSet::sdk()),
            Verdict::DontRetry
        );
    }

    #[test]
    fn status_set_builder() {
        let s = |c: u16| StatusCode::from_u16(c).expect("status");
        let mut set = StatusSet::empty();
        assert!(!set.contains(s(429)));
        set.insert(s(999));
        set.insert(s(100));
        assert!(set.contains(s(999)) && set.contains(s(100)));
        set.remove(s(999));
        assert!(!set.contains(s(999)));
        let d = StatusSet::default();
        assert!(d.contains(s(429)) && d.contains(s(529)) && !d.contains(s(500)));
        let sdk = StatusSet::sdk();
        for c in [408, 409, 429, 500, 502, 503, 504, 529, 599] {
            assert!(sdk.contains(s(c)), "{c}");
        }
        for c in [400, 401, 404, 600] {
            assert!(!sdk.contains(s(c)), "{c}");
        }
        let built = StatusSet::default()
            .with(StatusCode::REQUEST_TIMEOUT)
            .with(StatusCode::CONFLICT)
            .with(StatusCode::BAD_GATEWAY);
        assert!(built.contains(s(408)) && built.contains(s(409)) && built.contains(s(502)));
    }

    #[test]
    fn spend_limit_body_detection() {
        let yes: &[&[u8]] = &[
            br#"{"type":"error","error":{"type":"rate_limit_error","error_code":"enforced_spend_limit_reached"}}"#,
            br#"{"error_code" : "enforced_spend_limit_reached"}"#,
            b"{\"error_code\"\n\t:\r\n \"enforced_spend_limit_reached\"}",
            br#"{"error_code":"other","x":{"error_code":"enforced_spend_limit_reached"}}"#,
        ];
        let no: &[&[u8]] = &[
            b"",
            br#"{"type":"error","error":{"type":"rate_limit_error","message":"slow down"}}"#,
            br#"{"error_code":"rate_limited"}"#,
            br#"{"message":"enforced_spend_limit_reached"}"#,
            br#"{"message":"\"error_code\":\"enforced_spend_limit_reached\""}"#,
            br#"{"error_code":"enforced_spend_limit"}"#,
            br#"{"error_code""#,
            br#""error_code":"#,
        ];
        for b in yes {
            assert!(is_spend_limit_body(b), "{}", String::from_utf8_lossy(b));
        }
        for b in no {
            assert!(!is_spend_limit_body(b), "{}", String::from_utf8_lossy(b));
        }
    }

    fn base() -> SystemTime {
        parse_rfc3339("2026-11-29T14:03:04Z").expect("base time")
    }

    #[test]
    fn ratelimit_wait_exhausted_requests() {
        let h = headers(&[
            ("anthropic-ratelimit-requests-remaining", b"0"),
            (
                "anthropic-ratelimit-requests-reset",
                b"2026-11-29T14:03:07Z",
            ),
            ("anthropic-ratelimit-input-tokens-remaining", b"1000"),
            (
                "anthropic-ratelimit-input-tokens-reset",
                b"2026-11-29T14:04:00Z",
            ),
        ]);
        assert_eq!(ratelimit_wait(&h, base()), Some(Duration::from_secs(3)));
    }

    #[test]
    fn ratelimit_wait_latest_exhausted_reset_wins() {
        let h = headers(&[
            ("anthropic-ratelimit-requests-remaining", b"0"),
            (
                "anthropic-ratelimit-requests-reset",
                b"2026-11-29T14:03:07Z",
            ),
            ("anthropic-ratelimit-output-tokens-remaining", b"0"),
            (
                "anthropic-ratelimit-output-tokens-reset",
                b"2026-11-29T14:03:10.5Z",
            ),
            ("anthropic-ratelimit-input-tokens-remaining", b"5"),
            (
                "anthropic-ratelimit-input-tokens-reset",
                b"2026-11-29T15:00:00Z",
            ),
        ]);
        assert_eq!(
            ratelimit_wait(&h, base()),
            Some(Duration::from_millis(6500))
        );
    }

    #[test]
    fn ratelimit_wait_none_exhausted_or_unusable() {
        assert_eq!(ratelimit_wait(&HeaderMap::new(), base()), None);
        let some_left = headers(&[
            ("anthropic-ratelimit-requests-remaining", b"3"),
            (
                "anthropic-ratelimit-requests-reset",
                b"2026-11-29T14:03:07Z",
            ),
        ]);
        assert_eq!(ratelimit_wait(&some_left, base()), None);
        let bad_reset = headers(&[
            ("anthropic-ratelimit-requests-remaining", b"0"),
            ("anthropic-ratelimit-requests-reset", b"in 3 seconds"),
        ]);
        assert_eq!(ratelimit_wait(&bad_reset, base()), None);
        let bad_remaining = headers(&[
            ("anthropic-ratelimit-requests-remaining", b"-0"),
            (
                "anthropic-ratelimit-requests-reset",
                b"2026-11-29T14:03:07Z",
            ),
        ]);
        assert_eq!(ratelimit_wait(&bad_remaining, base()), None);
        let past = headers(&[
            ("anthropic-ratelimit-tokens-remaining", b" 0 "),
            ("anthropic-ratelimit-tokens-reset", b"2026-11-29T14:00:00Z"),
        ]);
        assert_eq!(ratelimit_wait(&past, base()), Some(Duration::ZERO));
    }

    #[test]
    fn rfc3339_table() {
        let t = |secs: i64, nanos: u32| {
            let whole = Duration::from_secs(secs.unsigned_abs());
            let at = if secs >= 0 {
                UNIX_EPOCH + whole
            } else {
                UNIX_EPOCH - whole
            };
            Some(at + Duration::from_nanos(u64::from(nanos)))
        };
        let ok = 1_795_960_987;
        let table: &[(&str, Option<SystemTime>)] = &[
            ("2026-11-29T14:03:07Z", t(ok, 0)),
            ("2026-11-29t14:03:07z", t(ok, 0)),
            ("2026-11-29T14:03:07+00:00", t(ok, 0)),
            ("2026-11-29T14:03:07-00:00", t(ok, 0)),
            ("2026-11-29T15:03:07+01:00", t(ok, 0)),
            ("2026-11-29T08:33:07-05:30", t(ok, 0)),
            ("2026-11-29T14:03:07.5Z", t(ok, 500_000_000)),
            ("2026-11-29T14:03:07.123456789987Z", t(ok, 123_456_789)),
            ("2026-11-29T14:03:07.000001+00:00", t(ok, 1_000)),
            ("2026-11-29T14:03:60Z", t(ok - 7 + 59, 0)),
            ("1970-01-01T00:00:00Z", t(0, 0)),
            ("1969-12-31T23:59:59Z", t(-1, 0)),
            ("0000-01-01T00:00:00Z", t(-62_167_219_200, 0)),
            ("2000-02-29T00:00:00Z", t(951_782_400, 0)),
            ("2028-02-29T00:00:00Z", t(1_835_395_200, 0)),
            ("2027-02-29T00:00:00Z", None),
            ("2100-02-29T00:00:00Z", None),
            ("2026-04-31T00:00:00Z", None),
            ("2026-13-01T00:00:00Z", None),
            ("2026-00-01T00:00:00Z", None),
            ("2026-01-00T00:00:00Z", None),
            ("2026-11-29T24:00:00Z", None),
            ("2026-11-29T14:60:00Z", None),
            ("2026-11-29T14:03:61Z", None),
            ("2026-11-29T14:03:07+24:00", None),
            ("2026-11-29T14:03:07+01:60", None),
            ("2026-11-29T14:03:07+0100", None),
            ("2026-11-29T14:03:07", None),
            ("2026-11-29 14:03:07Z", None),
            ("2026-11-29T14:03:07.Z", None),
            ("2026-11-29T14:03:07ZZ", None),
            (" 2026-11-29T14:03:07Z", None),
            ("2026-11-29T14:03:07Z ", None),
            ("26-11-29T14:03:07Z", None),
            ("2026-1-29T14:03:07Z", None),
            ("+026-11-29T14:03:07Z", None),
            ("2026-11-29T14:03:07\u{e9}", None),
            ("", None),
            ("soon", None),
        ];
        for (input, expected) in table {
            assert_eq!(parse_rfc3339(input), *expected, "{input:?}");
        }
    }

    /// Rebuilds an RFC 3339 string from httpdate's IMF-fixdate output, an
    /// independent calendar implementation.
    fn rfc3339_via_httpdate(at: SystemTime) -> String {
        let imf = httpdate::fmt_http_date(at); // "Sun, 06 Nov 1994 08:49:37 GMT"
        let months = [
            "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
        ];
        let month = months
            .iter()
            .position(|m| *m == &imf[8..11])
            .expect("month")
            + 1;
        format!(
            "{}-{month:02}-{}T{}Z",
            &imf[12..16],
            &imf[5..7],
            &imf[17..25]
        )
    }

    fn header_bytes() -> impl Strategy<Value = Vec<u8>> {
        prop_oneof![
            proptest::collection::vec(any::<u8>(), 0..48),
            "[ 0-9.+eE-]{0,24}".prop_map(String::into_bytes),
            "[ 0-9.]{0,45}".prop_map(String::into_bytes),
        ]
    }

    fn any_unit() -> impl Strategy<Value = f64> {
        prop_oneof![
            0.0..1.0f64,
            any::<f64>(),
            Just(f64::NAN),
            Just(f64::INFINITY),
            Just(f64::NEG_INFINITY),
            Just(1.0),
        ]
    }

    fn any_duration() -> impl Strategy<Value = Duration> {
        prop_oneof![
            (0..100_000u64, 0..1_000_000_000u32).prop_map(|(s, n)| Duration::new(s, n)),
            (any::<u64>(), 0..1_000_000_000u32).prop_map(|(s, n)| Duration::new(s, n)),
            Just(Duration::MAX),
            Just(Duration::ZERO),
        ]
    }

    fn insert_raw(map: &mut HeaderMap, name: &'static str, value: &[u8]) {
        // Bytes that are not a legal header value never reach us from http.
        if let Ok(v) = HeaderValue::from_bytes(value) {
            map.insert(name, v);
        }
    }

    proptest! {
        #[test]
        fn retry_after_never_panics(
            ms in proptest::option::of(header_bytes()),
            ra in proptest::option::of(header_bytes()),
            date in proptest::option::of(header_bytes()),
            now_secs in any::<i64>(),
        ) {
            let mut map = HeaderMap::new();
            for (name, v) in [("retry-after-ms", &ms), ("retry-after", &ra), ("date", &date)] {
                if let Some(v) = v {
                    insert_raw(&mut map, name, v);
                }
            }
            let d = Duration::from_secs(now_secs.unsigned_abs());
            let now = if now_secs >= 0 { UNIX_EPOCH.checked_add(d) } else { UNIX_EPOCH.checked_sub(d) }
                .unwrap_or(UNIX_EPOCH);
            let delay = retry_after(&map, now);
            prop_assert_ne!(delay, Some(Duration::ZERO), "zero is no delay named");
        }

        #[test]
        fn every_overflowing_retry_after_is_huge(
            digits in "[1-9][0-9]{23,60}",
            fraction in proptest::option::of("[0-9]{1,12}"),
            millis in any::<bool>(),
            pad in "[ \t]{0,2}",
        ) {
            // At least 10^23 seconds or milliseconds (10^20 s): past u64::MAX (about
            // 1.8 x 10^19) seconds either way.
            let number = match &fraction {
                Some(f) => format!("{pad}{digits}.{f}{pad}"),
                None => format!("{pad}{digits}{pad}"),
            };
            let name = if millis { "retry-after-ms" } else { "retry-after" };
            let mut map = HeaderMap::new();
            insert_raw(&mut map, name, number.as_bytes());
            prop_assert_eq!(retry_after(&map, now()), Some(Duration::MAX), "{}: {}", name, number);
        }

        #[test]
        fn retry_after_http_date_is_measured_from_date(
            server in 0..253_402_300_799u64,
            target in 0..253_402_300_799u64,
        ) {
            let mut map = HeaderMap::new();
            insert_raw(&mut map, "date", httpdate::fmt_http_date(at(server)).as_bytes());
            insert_raw(&mut map, "retry-after", httpdate::fmt_http_date(at(target)).as_bytes());
            prop_assert_eq!(
                retry_after(&map, now()),
                // A date at or before `Date` names no delay.
                Some(Duration::from_secs(target.saturating_sub(server))).filter(|d| !d.is_zero())
            );
        }

        #[test]
        fn throttle_delay_stays_in_range(r in any_duration(), unit in any_unit()) {
            let d = throttle_delay(r, unit).as_nanos();
            let r = r.as_nanos();
            prop_assert!(d * 100 >= r * 96, "{} < 0.96 × {}", d, r);
            prop_assert!(d * 100 <= r * 144, "{} > 1.44 × {}", d, r);
        }

        #[test]
        fn backoff_delay_stays_in_range(
            initial in any_duration(),
            max in any_duration(),
            retry in prop_oneof![0..80u32, any::<u32>()],
            unit in any_unit(),
        ) {
            let d = Backoff { initial, max }.delay(retry, unit).as_nanos();
            // Oracle: double step by step; stop once at the cap.
            let (max, mut cap) = (max.as_nanos(), initial.as_nanos());
            for _ in 0..retry {
                if cap == 0 || cap >= max {
                    break;
                }
                cap *= 2;
            }
            let cap = cap.min(max);
            prop_assert!(d * 4 >= cap * 3, "{} < 0.75 × {}", d, cap);
            prop_assert!(d <= cap, "{} > {}", d, cap);
            let _ = backoff_delay(retry, unit);
        }

        #[test]
        fn ratelimit_wait_never_panics(
            values in proptest::collection::vec(header_bytes(), 8),
            rfc in prop_oneof![
                any::<String>(),
                "[0-9]{4}-[0-9]{2}-[0-9]{2}[Tt ][0-9]{2}:[0-9]{2}:[0-9]{2}(\\.[0-9]{0,12})?([Zz]|[+-][0-9]{2}:[0-9]{2})?",
            ],
            now_secs in any::<u64>(),
        ) {
            let _ = parse_rfc3339(&rfc);
            let mut map = HeaderMap::new();
            for ((remaining, reset), v) in RATELIMIT_HEADERS.iter().zip(values.chunks(2)) {
                insert_raw(&mut map, remaining, &v[0]);
                insert_raw(&mut map, reset, &v[1]);
                insert_raw(&mut map, reset, rfc.as_bytes());
            }
            let now = UNIX_EPOCH.checked_add(Duration::from_secs(now_secs)).unwrap_or(UNIX_EPOCH);
            let _ = ratelimit_wait(&map, now);
        }

        #[test]
        fn rfc3339_agrees_with_httpdate(
            secs in 0..253_402_300_799u64,
            offset_min in -(23 * 60 + 59)..=(23 * 60 + 59i64),
        ) {
            let t = at(secs);
            prop_assert_eq!(parse_rfc3339(&rfc3339_via_httpdate(t)), Some(t));
            // The same instant written in another zone.
            let local = t.checked_add(Duration::from_secs(offset_min.unsigned_abs() * 60));
            let local = if offset_min >= 0 { local } else { t.checked_sub(Duration::from_secs(offset_min.unsigned_abs() * 60)) };
            if let Some(local) = local.filter(|l| *l >= UNIX_EPOCH && *l < at(253_402_300_800)) {
                let utc = rfc3339_via_httpdate(local);
                let sign = if offset_min >= 0 { '+' } else { '-' };
                let a = offset_min.unsigned_abs();
                let s = format!("{}{sign}{:02}:{:02}", &utc[..utc.len() - 1], a / 60, a % 60);
                prop_assert_eq!(parse_rfc3339(&s), Some(t), "{}", s);
            }
        }
    }
}
