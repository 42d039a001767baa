//! Rejections every client understands: one type to match on, rendered in the shape the
//! caller's clients expect.
//!
//! The layers return [`BoxError`] in the tower way. [`Rejection::from_error`] finds what
//! fairgate refused (walking the error's sources), so callers match on one enum instead of a
//! `downcast_ref` chain; [`render`] turns any error from the stack into an HTTP response:
//!
//! | rejection | [`Style::Reference`] | [`Style::Anthropic`] |
//! |---|---|---|
//! | [`Busy`] (no slot within the tier's max wait) | `503` `{"code":"SERVER_BUSY","retry_after":5}` | `529` `overloaded_error` |
//! | [`QueueFull`] (a queue limit) | `429` `{"code":"QUEUE_FULL","retry_after":1}` | `429` `rate_limit_error` |
//! | [`Unidentified`] (no job could be derived) | `401` `{"code":"UNAUTHENTICATED",...}` | `401` `authentication_error` |
//! | [`MissingJob`] (no job: a wiring bug) | `500` `{"code":"MISSING_JOB"}` | `500` `api_error` |
//! | any other error (the upstream call failed) | `502` `{"code":"UPSTREAM_ERROR"}` | `502` `api_error` |
//!
//! Every answer that says when to come back carries `retry-after` in whole seconds (rounded
//! up) and `retry-after-ms`, which the official Anthropic SDKs honour; the Anthropic body is
//! `{"type":"error","error":{"type":...,"message":...}}`, as the API's own errors (for
//! `Busy` with the write-up's `"code":"SERVER_BUSY","retry_after":5` beside it). `Busy`
//! also carries `x-should-retry: false` (the SDKs then do not retry: the request already
//! waited its tier's max wait), or `true` for a tier that says so
//! ([`SlotPolicyBuilder::retry`](crate::SlotPolicyBuilder::retry)).
//!
//! ```
//! use fairgate::reject::{Rejection, Style, render};
//! use fairgate::{BoxError, Busy};
//!
//! # fn handle(err: BoxError) -> http::Response<String> {
//! match Rejection::from_error(&*err) {
//!     Some(Rejection::Busy(busy)) => eprintln!("tier {} is full", busy.tier()),
//!     Some(other) => eprintln!("refused: {other}"),
//!     None => eprintln!("upstream failed: {err}"),
//! }
//! render(&err, Style::Anthropic)
//! # }
//! ```

use std::fmt;
use std::time::Duration;

use http::{HeaderValue, StatusCode, header};

use crate::Busy;
use crate::drr_fairness::error::QueueFull;
use crate::error::{BoxError, MissingJob};
use crate::extract::Unidentified;

/// What a caller is told to wait after [`QueueFull`]: the queue is full now, not for long.
pub const QUEUE_FULL_RETRY_AFTER: Duration = Duration::from_secs(1);

/// Whether `error` says the call never went upstream: a fairgate [`Rejection`], or no
/// upstream of a pool with room ([`NoUpstream`](crate::pool::error::NoUpstream)), anywhere
/// in its chain. Any other error may come after the call ran.
pub(crate) fn not_sent(error: &(dyn std::error::Error + 'static)) -> bool {
    if Rejection::from_error(error).is_some() {
        return true;
    }
    let mut current = Some(error);
    while let Some(error) = current {
        if error.is::<crate::pool::error::NoUpstream>() {
            return true;
        }
        current = error.source();
    }
    false
}

/// Why fairgate refused a request (nothing was sent upstream).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Rejection {
    /// No slot came free for the request's tier within its max wait.
    Busy(Busy),
    /// A queue limit of the fair queue refused it.
    QueueFull(QueueFull),
    /// No job could be derived from the request (e.g. no or an unknown API key).
    Unidentified(Unidentified),
    /// The request carried no job (the stack is wired without a job source).
    MissingJob(MissingJob),
}

impl Rejection {
    /// The fairgate rejection in `error` or in its chain of sources; `None` when the error
    /// is not fairgate's (the inner service failed).
    pub fn from_error(error: &(dyn std::error::Error + 'static)) -> Option<Rejection> {
        let mut current = Some(error);
        while let Some(error) = current {
            if let Some(busy) = error.downcast_ref::<Busy>() {
                return Some(Rejection::Busy(busy.clone()));
            }
            if let Some(full) = error.downcast_ref::<QueueFull>() {
                return Some(Rejection::QueueFull(full.clone()));
            }
            if let Some(unidentified) = error.downcast_ref::<Unidentified>() {
                return Some(Rejection::Unidentified(unidentified.clone()));
            }
            if error.is::<MissingJob>() {
                return Some(Rejection::MissingJob(MissingJob));
            }
            current = error.source();
        }
        None
    }

    /// When the caller should try again, if it should.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            Rejection::Busy(busy) => Some(busy.retry_after()),
            Rejection::QueueFull(_) => Some(QUEUE_FULL_RETRY_AFTER),
            Rejection::Unidentified(_) | Rejection::MissingJob(_) => None,
        }
    }

    /// The HTTP status of this rejection in `style`.
    pub fn status(&self, style: Style) -> StatusCode {
        match (self, style) {
            (Rejection::Busy(_), Style::Reference) => StatusCode::SERVICE_UNAVAILABLE,
            // Anthropic's "overloaded": the SDKs retry it, honouring retry-after.
            (Rejection::Busy(_), Style::Anthropic) => overloaded(),
            (Rejection::QueueFull(_), _) => StatusCode::TOO_MANY_REQUESTS,
            (Rejection::Unidentified(_), _) => StatusCode::UNAUTHORIZED,
            (Rejection::MissingJob(_), _) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The HTTP answer for this rejection in `style`.
    pub fn to_response(&self, style: Style) -> http::Response<String> {
        let message = self.to_string();
        let body = match style {
            Style::Reference => {
                let code = match self {
                    Rejection::Busy(_) => "SERVER_BUSY",
                    Rejection::QueueFull(_) => "QUEUE_FULL",
                    Rejection::Unidentified(_) => "UNAUTHENTICATED",
                    Rejection::MissingJob(_) => "MISSING_JOB",
                };
                match self.retry_after() {
                    Some(after) => format!(
                        r#"{{"code":"{code}","retry_after":{}}}"#,
                        whole_seconds(after)
                    ),
                    None => format!(r#"{{"code":"{code}","message":{}}}"#, json_string(&message)),
                }
            }
            Style::Anthropic => match self {
                // The write-up's fields beside the API's error shape.
                Rejection::Busy(busy) => format!(
                    r#"{{"type":"error","error":{{"type":"overloaded_error","message":{}}},"code":"SERVER_BUSY","retry_after":{}}}"#,
                    json_string(&message),
                    busy.retry_after_secs()
                ),
                Rejection::QueueFull(_) => anthropic_body("rate_limit_error", &message),
                Rejection::Unidentified(_) => anthropic_body("authentication_error", &message),
                Rejection::MissingJob(_) => anthropic_body("api_error", &message),
            },
        };
        let mut response = respond(self.status(style), body, self.retry_after());
        if let Rejection::Busy(busy) = self {
            // The official SDKs retry a 529 unless told not to: a request that already
            // waited its tier's max wait is told not to, unless its tier says otherwise.
            let retry =
                HeaderValue::from_static(if busy.should_retry() { "true" } else { "false" });
            response.headers_mut().insert("x-should-retry", retry);
        }
        response
    }
}

impl fmt::Display for Rejection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Rejection::Busy(e) => e.fmt(f),
            Rejection::QueueFull(e) => e.fmt(f),
            Rejection::Unidentified(e) => e.fmt(f),
            Rejection::MissingJob(e) => e.fmt(f),
        }
    }
}

impl std::error::Error for Rejection {}

/// The shape of a rendered rejection.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Style {
    /// A plain JSON code a front end can map to its own message: `503` with
    /// `{"code":"SERVER_BUSY","retry_after":5}`.
    #[default]
    Reference,
    /// The Anthropic API's error shape and statuses, so its SDKs retry correctly.
    Anthropic,
}

/// Renders any error from the stack: a fairgate [`Rejection`] in `style`, anything else as
/// a failed upstream call (`502`, without the error's text: it may carry upstream details).
pub fn render(error: &BoxError, style: Style) -> http::Response<String> {
    if let Some(rejection) = Rejection::from_error(&**error) {
        return rejection.to_response(style);
    }
    let message = "the upstream call failed";
    let body = match style {
        Style::Reference => r#"{"code":"UPSTREAM_ERROR"}"#.to_owned(),
        Style::Anthropic => anthropic_body("api_error", message),
    };
    respond(StatusCode::BAD_GATEWAY, body, None)
}

/// Anthropic's `529 Overloaded`.
fn overloaded() -> StatusCode {
    StatusCode::from_u16(529).unwrap_or(StatusCode::SERVICE_UNAVAILABLE)
}

fn anthropic_body(kind: &str, message: &str) -> String {
    format!(
        r#"{{"type":"error","error":{{"type":"{kind}","message":{}}}}}"#,
        json_string(message)
    )
}

fn respond(
    status: StatusCode,
    body: String,
    retry_after: Option<Duration>,
) -> http::Response<String> {
    let mut response = http::Response::new(body);
    *response.status_mut() = status;
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    if let Some(after) = retry_after {
        headers.insert(header::RETRY_AFTER, HeaderValue::from(whole_seconds(after)));
        let ms = u64::try_from(after.as_millis()).unwrap_or(u64::MAX);
        headers.insert("retry-after-ms", HeaderValue::from(ms));
    }
    response
}

/// Whole seconds, rounded up: what a `retry-after` header carries.
fn whole_seconds(after: Duration) -> u64 {
    after.as_secs() + u64::from(after.subsec_nanos() > 0)
}

/// `text` as a JSON string literal.
fn json_string(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 2);
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Priority, TenantId, Tier};

    fn busy() -> Busy {
        Busy::new(
            Tier::new("guest"),
            Duration::from_secs(8),
            Duration::from_millis(4_200),
        )
    }

    #[test]
    fn busy_renders_as_server_busy_or_overloaded_with_retry_headers_rounded_up() {
        let err: BoxError = busy().into();
        let reference = render(&err, Style::Reference);
        assert_eq!(reference.status(), 503);
        assert_eq!(
            reference.body(),
            r#"{"code":"SERVER_BUSY","retry_after":5}"#
        );
        assert_eq!(reference.headers()["retry-after"], "5");
        assert_eq!(reference.headers()["retry-after-ms"], "4200");
        let anthropic = render(&err, Style::Anthropic);
        assert_eq!(anthropic.status(), 529);
        assert!(anthropic.body().starts_with(
            r#"{"type":"error","error":{"type":"overloaded_error","message":"server busy"#
        ));
        assert!(
            anthropic
                .body()
                .ends_with(r#""},"code":"SERVER_BUSY","retry_after":5}"#),
            "{}",
            anthropic.body()
        );
        assert_eq!(anthropic.headers()["retry-after"], "5");
    }

    #[test]
    fn busy_says_not_to_retry_unless_its_tier_says_so() {
        for (retry, told) in [(false, "false"), (true, "true")] {
            let err: BoxError = busy().retrying(retry).into();
            for style in [Style::Reference, Style::Anthropic] {
                assert_eq!(render(&err, style).headers()["x-should-retry"], told);
            }
        }
        let policy = crate::SlotPolicy::builder()
            .retry("guest", true)
            .build()
            .unwrap();
        assert!(policy.limit(Some(&Tier::new("guest"))).1.retry);
        assert!(
            crate::SlotPolicy::builder()
                .retry("gold", true)
                .build()
                .is_err()
        );
    }

    #[test]
    fn queue_full_is_a_rate_limit_error_with_a_short_retry() {
        let full = QueueFull::new(Priority::Batch, TenantId::new("t"), true);
        let response = Rejection::QueueFull(full).to_response(Style::Anthropic);
        assert_eq!(response.status(), 429);
        assert!(response.body().contains(r#""type":"rate_limit_error""#));
        assert_eq!(response.headers()["retry-after"], "1");
    }

    #[test]
    fn a_rejection_is_found_under_a_wrapping_error_and_others_are_upstream_failures() {
        #[derive(Debug)]
        struct Wrapped(Busy);
        impl fmt::Display for Wrapped {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("wrapped")
            }
        }
        impl std::error::Error for Wrapped {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.0)
            }
        }
        let err: BoxError = Wrapped(busy()).into();
        assert!(matches!(
            Rejection::from_error(&*err),
            Some(Rejection::Busy(_))
        ));
        let other: BoxError = "connection reset".into();
        assert_eq!(Rejection::from_error(&*other), None);
        let response = render(&other, Style::Anthropic);
        assert_eq!(response.status(), 502);
        assert!(
            !response.body().contains("connection reset"),
            "no upstream detail leaks"
        );
    }

    #[test]
    fn messages_are_json_escaped() {
        let unidentified = Unidentified::new("bad \"key\"\n\u{1}");
        let body = Rejection::Unidentified(unidentified).to_response(Style::Anthropic);
        assert_eq!(body.status(), 401);
        assert!(
            body.body().contains(r#"bad \"key\"\n\u0001"#),
            "{}",
            body.body()
        );
    }
}
