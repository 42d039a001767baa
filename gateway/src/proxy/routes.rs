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
//! Then the route: `POST /v1/messages` goes through the admission stack; the message
//! batch routes go to the `batches` module, which answers each key only for the batches it
//! created; a short allow-list is forwarded after the key check alone (`count_tokens`,
//! models); everything else is `404`.
//!
//! # What the forwarded routes can show one key holder of another
//!
//! Every route goes upstream under the team's one key, so whatever the upstream keeps per
//! key (or per workspace) is shared by every client of the gateway unless the gateway
//! splits it. Headers that would choose another account or workspace
//! (`anthropic-workspace-id`, ...) are dropped on every route (`upstream::NOT_FORWARDED`).
//! Then, route by route:
//! - **Message batches** are kept by the upstream per workspace: the gateway records which
//!   key created each batch and answers the others `404` (the `batches` module). They are
//!   not admitted by the fair stack: one key can spend the team's batch rate limits and
//!   its queue of batch requests first come, first served, and each batch a list shows
//!   costs one upstream call.
//! - **`POST /v1/messages/count_tokens`** answers a count of the caller's own body: no other
//!   tenant's data. It is not admitted by the fair stack, so it spends the team's
//!   count-tokens rate limit first come, first served.
//! - **`GET /v1/models`, `GET /v1/models/{id}`** list what the team's key may use: the same
//!   answer for every client, naming no tenant.
//! - On every route the upstream's answer headers pass through: `anthropic-ratelimit-*`
//!   show the team's remaining capacity (so a client sees how busy the others keep it) and
//!   `anthropic-organization-id` names the team's account.
//! - Objects the upstream keeps per workspace and a `/v1/messages` body may name by id
//!   (uploaded files, code-execution containers) and the prompt cache (a hit is reported in
//!   `usage`) are shared by every client; the Files API is not on the allow-list, so such
//!   ids can only come from outside the gateway.

use http::Method;

/// What the gateway does with a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Route {
    /// `POST /v1/messages`: through the admission stack.
    Messages,
    /// A message batch route: answered by the `batches` module for the caller's own
    /// batches only.
    Batch(BatchRoute),
    /// On the allow-list: forwarded after the key check.
    Forward,
    /// A canonical path the gateway does not serve.
    NotFound,
    /// Not a canonical path: refused before routing.
    NotCanonical,
}

/// Which message batch call a request is; the batch id, when there is one, is the path's
/// fourth segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BatchRoute {
    /// `POST /v1/messages/batches`.
    Create,
    /// `GET /v1/messages/batches`.
    List,
    /// `GET /v1/messages/batches/{id}`.
    Retrieve,
    /// `GET /v1/messages/batches/{id}/results`.
    Results,
    /// `POST /v1/messages/batches/{id}/cancel`.
    Cancel,
    /// `DELETE /v1/messages/batches/{id}`.
    Delete,
}

impl Route {
    /// The route's name in logs.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Route::Messages => "messages",
            Route::Batch(_) => "batches",
            Route::Forward => "forward",
            Route::NotFound => "not_found",
            Route::NotCanonical => "not_canonical",
        }
    }
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
    let delete = method == Method::DELETE;
    let batch = match segments.as_slice() {
        ["v1", "messages", "batches"] if post => Some(BatchRoute::Create),
        ["v1", "messages", "batches"] if get => Some(BatchRoute::List),
        ["v1", "messages", "batches", _] if get => Some(BatchRoute::Retrieve),
        ["v1", "messages", "batches", _] if delete => Some(BatchRoute::Delete),
        ["v1", "messages", "batches", _, "results"] if get => Some(BatchRoute::Results),
        ["v1", "messages", "batches", _, "cancel"] if post => Some(BatchRoute::Cancel),
        _ => None,
    };
    if let Some(batch) = batch {
        return Route::Batch(batch);
    }
    let forward = match segments.as_slice() {
        ["v1", "messages"] if post => return Route::Messages,
        ["v1", "messages", "count_tokens"] => post,
        ["v1", "models"] | ["v1", "models", _] => get,
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
        ] {
            assert_eq!(route(&method, path), Route::Forward, "{method} {path}");
        }
        for (method, path, batch) in [
            (Method::POST, "/v1/messages/batches", BatchRoute::Create),
            (Method::GET, "/v1/messages/batches", BatchRoute::List),
            (
                Method::GET,
                "/v1/messages/batches/msgbatch_01",
                BatchRoute::Retrieve,
            ),
            (
                Method::DELETE,
                "/v1/messages/batches/msgbatch_01",
                BatchRoute::Delete,
            ),
            (
                Method::GET,
                "/v1/messages/batches/msgbatch_01/results",
                BatchRoute::Results,
            ),
            (
                Method::POST,
                "/v1/messages/batches/msgbatch_01/cancel",
                BatchRoute::Cancel,
            ),
        ] {
            assert_eq!(route(&method, path), Route::Batch(batch), "{method} {path}");
        }
        for (method, path) in [
            (Method::DELETE, "/v1/messages/batches"),
            (Method::POST, "/v1/messages/batches/msgbatch_01"),
            (Method::POST, "/v1/messages/batches/msgbatch_01/results"),
            (Method::GET, "/v1/messages/batches/msgbatch_01/cancel"),
            (Method::GET, "/v1/messages/batches/msgbatch_01/other"),
        ] {
            assert_eq!(route(&method, path), Route::NotFound, "{method} {path}");
        }
        assert_eq!(
            route(&Method::POST, "/v1/messages/count_tokens/x"),
            Route::NotFound
        );
        assert_eq!(route(&Method::GET, "/v1/files"), Route::NotFound);
    }
}
