//! Which paths the API port answers, decided once, before anything else looks at a request.
//!
//! A path must be in canonical form or it is refused (`400`): segments of unreserved
//! characters only (`A-Z a-z 0-9 - . _ ~`), no empty segment (`//`, a trailing `/`), no `.`
//! or `..` segment. That refuses every other spelling of `/v1/messages` (`/v1/messages/`,
//! `/v1//messages`, `/v1/./messages`, `/v1/messages;x`, `/v1/%6Dessages`) and every dot
//! segment, encoded or not, so what is routed is exactly what is forwarded: an upstream
//! that normalises paths cannot turn a forwarded path into `/v1/messages` behind the
//! admission stack's back. Anthropic's paths need none of what is refused.
//!
//! Then the route: `POST /v1/messages` goes through the admission stack; a short
//! allow-list is forwarded after the key check alone (`count_tokens`, models, message
//! batches); everything else is `404`.

use http::Method;

/// What the gateway does with a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Route {
    /// `POST /v1/messages`: through the admission stack.
    Messages,
    /// On the allow-list: forwarded after the key check.
    Forward,
    /// A canonical path the gateway does not serve.
    NotFound,
    /// Not a canonical path: refused before routing.
    NotCanonical,
}

/// Whether `path` is in the canonical form described in the module docs.
pub(crate) fn is_canonical(path: &str) -> bool {
    let Some(rest) = path.strip_prefix('/') else {
        return false;
    };
    rest.split('/').all(|segment| {
        !segment.is_empty()
            && segment != "."
            && segment != ".."
            && segment
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~'))
    })
}

/// The route of `method` `path`.
pub(crate) fn route(method: &Method, path: &str) -> Route {
    if !is_canonical(path) {
        return Route::NotCanonical;
    }
    let segments: Vec<&str> = path[1..].split('/').collect();
    let get = method == Method::GET;
    let post = method == Method::POST;
    let forward = match segments.as_slice() {
        ["v1", "messages"] if post => return Route::Messages,
        ["v1", "messages", "count_tokens"] => post,
        ["v1", "models"] | ["v1", "models", _] => get,
        ["v1", "messages", "batches"] => get || post,
        ["v1", "messages", "batches", _] => get || method == Method::DELETE,
        ["v1", "messages", "batches", _, "results"] => get,
        ["v1", "messages", "batches", _, "cancel"] => post,
        _ => false,
    };
    if forward {
        Route::Forward
    } else {
        Route::NotFound
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_canonical_spelling_of_messages_is_admitted_and_no_other_is_forwarded() {
        assert_eq!(route(&Method::POST, "/v1/messages"), Route::Messages);
        for path in [
            "/v1/messages/",
            "/v1//messages",
            "/v1/./messages",
            "/v1/messages;x",
            "/v1/%6Dessages",
            "/v1/messages%2F",
            "//v1/messages",
            "/v1/x/../messages",
            "/v1/../../x",
            "/v1/%2e%2e/x",
            "/v1/.%2e/x",
            "/v1/messages\\",
            "v1/messages",
            "",
        ] {
            assert_eq!(route(&Method::POST, path), Route::NotCanonical, "{path}");
        }
        assert_eq!(route(&Method::GET, "/v1/messages"), Route::NotFound);
        assert_eq!(route(&Method::PUT, "/v1/messages"), Route::NotFound);
        assert_eq!(route(&Method::POST, "/v1/complete"), Route::NotFound);
        assert_eq!(route(&Method::GET, "/metrics"), Route::NotFound);
    }

    #[test]
    fn the_allow_list_is_forwarded() {
        for (method, path) in [
            (Method::POST, "/v1/messages/count_tokens"),
            (Method::GET, "/v1/models"),
            (Method::GET, "/v1/models/claude-mock-1"),
            (Method::POST, "/v1/messages/batches"),
            (Method::GET, "/v1/messages/batches"),
            (Method::GET, "/v1/messages/batches/msgbatch_01"),
            (Method::DELETE, "/v1/messages/batches/msgbatch_01"),
            (Method::GET, "/v1/messages/batches/msgbatch_01/results"),
            (Method::POST, "/v1/messages/batches/msgbatch_01/cancel"),
        ] {
            assert_eq!(route(&method, path), Route::Forward, "{method} {path}");
        }
        assert_eq!(
            route(&Method::POST, "/v1/messages/count_tokens/x"),
            Route::NotFound
        );
        assert_eq!(route(&Method::GET, "/v1/files"), Route::NotFound);
    }
}
