//! The gateway's own answers (its `400`, `401`, `404`, `413`, `429`, `529`, ..., not the
//! upstream's), marked as Anthropic marks its answers.

use http::{HeaderValue, Response};

use crate::body::Body;

/// An answer of the gateway's own with an error `body` (Anthropic's shape, and whatever
/// else it holds): its `request_id` put in the body, as the API puts it, and in the
/// `request-id` header ([`mark`]).
pub(crate) fn error_answer(
    status: http::StatusCode,
    headers: http::HeaderMap,
    body: &str,
) -> Response<Body> {
    let id = next_request_id();
    // After the object's other fields, in their order (`"type"` first, as the API's).
    let body = match body.trim_end().strip_suffix('}') {
        Some(open) if open.trim_start().starts_with('{') => {
            let comma = if open.trim() == "{" { "" } else { "," };
            format!(r#"{open}{comma}"request_id":"{id}"}}"#)
        }
        _ => body.to_owned(),
    };
    let mut response = Response::new(crate::body::full(body));
    *response.status_mut() = status;
    *response.headers_mut() = headers;
    response.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    if let Ok(id) = HeaderValue::from_str(&id) {
        response.headers_mut().insert("request-id", id);
    }
    mark(response)
}

/// On an answer of the gateway's own (not the upstream's): its refusals are logged.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Own;

/// Marks an answer of the gateway's own as Anthropic marks its answers: a `request-id` to
/// quote in a report (kept if it has one), and a reason phrase on `529` (hyper knows none
/// for it: the line would end bare).
pub(crate) fn mark(mut response: Response<Body>) -> Response<Body> {
    response.extensions_mut().insert(Own);
    if !response.headers().contains_key("request-id")
        && let Ok(id) = HeaderValue::from_str(&next_request_id())
    {
        response.headers_mut().insert("request-id", id);
    }
    if response.status().as_u16() == 529 {
        let reason = hyper::ext::ReasonPhrase::from_static(b"Overloaded");
        response.extensions_mut().insert(reason);
    }
    response
}

/// The `request-id` of the gateway's next own answer (`req_fairgate_` and 16 hex digits).
pub(crate) fn next_request_id() -> String {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    format!("req_fairgate_{:016x}", request_id(n))
}

/// The id of the gateway's `n`th own answer: `n` through a keyed permutation (four Feistel
/// rounds over SipHash with this process's random keys), so ids never repeat in a process
/// and two of them say nothing of how many answers other clients got between them.
fn request_id(n: u64) -> u64 {
    use std::hash::BuildHasher;
    static KEYS: std::sync::OnceLock<std::hash::RandomState> = std::sync::OnceLock::new();
    let keys = KEYS.get_or_init(std::hash::RandomState::new);
    let (mut left, mut right) = ((n >> 32) as u32, n as u32);
    for round in 0..4u8 {
        let mixed = keys.hash_one((round, right)) as u32;
        (left, right) = (right, left ^ mixed);
    }
    (u64::from(left) << 32) | u64::from(right)
}

/// Anthropic's error shape for the gateway's own refusals, with their `request_id`.
pub(crate) fn error_response(
    status: http::StatusCode,
    kind: &str,
    message: &str,
) -> Response<Body> {
    // Escaped as JSON: a message may quote what the client sent.
    let body = serde_json::json!({"type": "error", "error": {"type": kind, "message": message}});
    error_answer(status, http::HeaderMap::new(), &body.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_error_body_gets_the_request_id_of_its_header_last() {
        let answer = error_answer(
            http::StatusCode::UNAUTHORIZED,
            http::HeaderMap::new(),
            r#"{"type":"error","error":{"type":"authentication_error","message":"x"}}"#,
        );
        let id = answer.headers()["request-id"].to_str().unwrap().to_owned();
        let body = futures_util::FutureExt::now_or_never(http_body_util::BodyExt::collect(
            answer.into_body(),
        ))
        .unwrap()
        .unwrap()
        .to_bytes();
        let expected = format!(
            r#"{{"type":"error","error":{{"type":"authentication_error","message":"x"}},"request_id":"{id}"}}"#
        );
        assert_eq!(String::from_utf8_lossy(&body), expected);
    }

    #[test]
    fn request_ids_never_repeat_and_do_not_count_up() {
        let ids: Vec<u64> = (0..100_000).map(request_id).collect();
        let mut unique = ids.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), ids.len());
        // Consecutive answers are not neighbours: the ids say nothing of the count between.
        let close = ids
            .windows(2)
            .filter(|w| w[0].abs_diff(w[1]) < 1 << 32)
            .count();
        assert!(
            close < 10,
            "{close} consecutive ids within 2^32 of each other"
        );
    }

    #[test]
    fn an_own_529_has_a_reason_phrase_and_every_answer_a_request_id() {
        let answer = |status: u16| {
            let mut response = Response::new(crate::body::full(String::new()));
            *response.status_mut() = http::StatusCode::from_u16(status).unwrap();
            mark(response)
        };
        let (busy, unknown) = (answer(529), answer(401));
        let reason = busy.extensions().get::<hyper::ext::ReasonPhrase>();
        assert_eq!(reason.map(|r| r.as_bytes()), Some(&b"Overloaded"[..]));
        assert!(
            unknown
                .extensions()
                .get::<hyper::ext::ReasonPhrase>()
                .is_none()
        );
        let id = |r: &Response<Body>| r.headers()["request-id"].to_str().unwrap().to_owned();
        assert!(id(&busy).starts_with("req_fairgate_"));
        assert_ne!(id(&busy), id(&unknown));
    }
}
