//! Message batches: each belongs to the key that created it.
//!
//! The upstream keeps batches per workspace, and every client of the gateway reaches it
//! under the team's one key, so the upstream alone would show any client every batch. The
//! gateway therefore keeps an *owner book*: when `POST /v1/messages/batches` succeeds, the
//! id the upstream returns is recorded under its owner (the key that created it, as the
//! tenant it stood for: a hash of both, never the key). Then:
//!
//! - `GET /v1/messages/batches/{id}`, `.../results`, `POST .../cancel` and `DELETE` go
//!   upstream only when the caller's key owns `{id}`. An id with no owner in the book and
//!   another key's id get the same `404 not_found_error`, so the answer does not tell which
//!   ids exist. A `404` from the upstream, or a `DELETE` it accepted, forgets the id.
//! - `GET /v1/messages/batches` pages over the caller's own batches, newest first, with
//!   `limit` (1 to 100, default 20; more is read as 100, since each listed batch costs an
//!   upstream call), `after_id` (older: the next page) and `before_id` (newer), and answers
//!   `has_more`, `first_id` and `last_id` as the Messages Batches API does. A cursor that is
//!   not one of the caller's batches is `404`.
//! - `results_url` in every batch the gateway answers (create, retrieve, list, cancel) is
//!   rewritten to the gateway's own `--public-url`, so the official SDKs, which fetch it
//!   directly with the client's key, come back through this owner check (the upstream's URL
//!   would send the client's key to the upstream, which refuses it).
//!
//! # Upstreams
//!
//! Batches go to Anthropic upstreams only (Bedrock has none; with no Anthropic upstream
//! the batch routes answer `404 not_found_error`). A create goes to the first of the
//! lowest `priority` not set aside (the `upstreams` module); the book records the
//! upstream's name with the owner, and every later call of that batch (retrieve, results,
//! cancel, delete, and its place in a list page) goes to that upstream. A batch recorded
//! without an upstream (by a gateway before upstreams were kept) is the first Anthropic
//! upstream's; one whose upstream is no longer configured answers `404`.
//!
//! The owner is the key, not the tenant: a second key of the same tenant, or the tenant's
//! key after a rotation, does not see the first key's batches (a key holder owns what it
//! creates, DESIGN §13). A key moved to another tenant in the keys file is a new owner too.
//!
//! # Why the gateway pages, and not the upstream
//!
//! The upstream's list is the workspace's: filtering its pages down to the caller's batches
//! would give pages of any length (often empty) whose `has_more` and cursors describe other
//! tenants' batches, and reading far enough to fill one page could take the whole
//! workspace's history. Instead the book keeps each owner's ids in the order they were
//! created, pages over them (the arithmetic is `book::window`, one plain function), and
//! fetches each listed batch's current state from the upstream (`GET .../{id}`, 8 at a
//! time, in order). Pages are exact and cost one upstream call per batch shown; a batch
//! the upstream no longer has is left out of its page.
//!
//! # Where the book lives
//!
//! With `--redis`, on Redis (the `shared` module): fleet-wide, every owner expiring with the
//! upstream's retention (29 days). When Redis does not answer, the batch routes are refused
//! (`503` with `retry-after`) rather than answered from nothing: a create is not sent
//! upstream unless Redis answered a moment before, and should recording the owner still
//! fail after the upstream created the batch, the batch is cancelled upstream (it could
//! never be read through the gateway) and the client gets the `503`.
//!
//! Without it, in process (`book::MemoryBook`), at most 100,000 ids (past it, the oldest
//! of the owner with the most is forgotten). A restart forgets every owner: the batches
//! created before it stay upstream until they expire but answer `404` to every client.
//!
//! # `--public-url`
//!
//! The base URL clients reach the gateway at (`https://llm.example.com`, with a path prefix
//! if a proxy adds one). Without it, `results_url` names the listen address over `http://`:
//! right when clients connect to the gateway directly. It is not derived from the request's
//! `Host`: the gateway cannot tell whether a proxy in front of it terminated TLS (the URL
//! would send the key over plain HTTP) nor whether the proxy passed on a `Host` its client
//! chose.

mod book;
#[cfg(test)]
mod differential;
mod shared;

use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use http::header::{self, HeaderMap, HeaderValue};
use http::{Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use serde_json::{Map, Value};
use tracing::{info, warn};

pub(crate) use self::book::Owner;
use self::book::{Cursor, Holder, MEMORY_CAPACITY, MemoryBook, PageIds};
use self::shared::RedisBook;
use crate::body::Body;
use crate::body::full;
use crate::own_answer::error_response;
use crate::proxy::routes::BatchRoute;
use crate::proxy::upstream::Upstream;
use crate::proxy::upstreams::Upstreams;

/// The largest batch object (or error) read from the upstream to rewrite; a batch is well
/// under 1 KiB.
const MAX_OBJECT: usize = 1 << 20;
/// How long an upstream call whose answer is rewritten may take, to its last byte.
const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(60);
/// The same for a create, whose request body (up to the API's 256 MB) goes up within it:
/// that body is also cut when it stalls for `--body-idle-timeout`.
const CREATE_TIMEOUT: Duration = Duration::from_secs(15 * 60);
/// Batches fetched from the upstream at once for one page of the list.
const LIST_CONCURRENCY: usize = 8;
/// The most batches one page lists.
const MAX_LIMIT: usize = 100;
const DEFAULT_LIMIT: usize = 20;
/// The longest batch id taken (Anthropic's are about 35 characters).
const MAX_ID: usize = 128;

/// A listed batch as the upstream has it now; `None` when the upstream no longer has it;
/// the answer to give instead of the list when the upstream fails.
type Fetched = Result<Option<Map<String, Value>>, Response<Body>>;

/// Where the owners are kept.
enum Book {
    Memory(MemoryBook),
    Redis(RedisBook),
}

/// The book could not be read or written: Redis did not answer.
struct Unavailable;

impl Book {
    fn failed(op: &str, error: &redis::RedisError) -> Unavailable {
        warn!(op, %error, "the batch owner book on Redis did not answer");
        metrics::counter!("gateway_batch_book_failures_total").increment(1);
        Unavailable
    }

    async fn ready(&self) -> Result<(), Unavailable> {
        match self {
            Book::Memory(_) => Ok(()),
            Book::Redis(book) => book.ping().await.map_err(|e| Self::failed("ping", &e)),
        }
    }

    async fn record(&self, owner: &Owner, id: &str, upstream: &str) -> Result<(), Unavailable> {
        match self {
            Book::Memory(book) => {
                book.record(owner, id, Some(upstream));
                Ok(())
            }
            Book::Redis(book) => book
                .record(owner, id, Some(upstream))
                .await
                .map_err(|e| Self::failed("record", &e)),
        }
    }

    /// The upstream holding `id` when `owner` owns it.
    async fn owns(&self, owner: &Owner, id: &str) -> Result<Option<Holder>, Unavailable> {
        match self {
            Book::Memory(book) => Ok(book.owns(owner, id)),
            Book::Redis(book) => book
                .owns(owner, id)
                .await
                .map_err(|e| Self::failed("owns", &e)),
        }
    }

    async fn forget(&self, owner: &Owner, id: &str) {
        match self {
            Book::Memory(book) => book.forget(owner, id),
            // Left in the book, the id is pruned at the retention and skipped by the list.
            Book::Redis(book) => {
                if let Err(e) = book.forget(owner, id).await {
                    Self::failed("forget", &e);
                }
            }
        }
    }

    async fn page(
        &self,
        owner: &Owner,
        cursor: &Cursor,
        limit: usize,
    ) -> Result<Option<PageIds>, Unavailable> {
        match self {
            Book::Memory(book) => Ok(book.page(owner, cursor, limit)),
            Book::Redis(book) => book
                .page(owner, cursor, limit)
                .await
                .map_err(|e| Self::failed("page", &e)),
        }
    }
}

/// The batch routes' state: the owner book and the gateway's public URL.
pub(crate) struct Batches {
    book: Book,
    /// Without a trailing `/`.
    public_url: String,
}

impl Batches {
    /// Owners kept in this process only.
    pub(crate) fn in_memory(public_url: &str) -> Batches {
        Batches {
            book: Book::Memory(MemoryBook::new(MEMORY_CAPACITY)),
            public_url: public_url.trim_end_matches('/').to_owned(),
        }
    }

    /// Owners kept on the Redis at `url`, shared by every gateway using it.
    pub(crate) fn on_redis(url: &str, public_url: &str) -> Result<Batches, String> {
        let book = RedisBook::new(url).map_err(|e| format!("--redis (batch owners): {e}"))?;
        Ok(Batches {
            book: Book::Redis(book),
            public_url: public_url.trim_end_matches('/').to_owned(),
        })
    }

    /// Answers a batch route for `owner` (the caller's key, authenticated).
    pub(crate) async fn handle(
        &self,
        upstreams: &Upstreams,
        route: BatchRoute,
        owner: &Owner,
        req: Request<Body>,
    ) -> Response<Body> {
        let (parts, body) = req.into_parts();
        let headers = &parts.headers;
        match route {
            BatchRoute::Create => return self.create(upstreams, owner, headers, body).await,
            BatchRoute::List => {
                return self
                    .list(upstreams, owner, headers, parts.uri.query())
                    .await;
            }
            _ => {}
        }
        let Some(id) = parts.uri.path().split('/').nth(4).filter(|id| valid_id(id)) else {
            return not_found();
        };
        let holder = match self.book.owns(owner, id).await {
            Err(Unavailable) => return unavailable(),
            Ok(None) => return not_found(),
            Ok(Some(holder)) => holder,
        };
        // Its upstream; one no longer configured cannot be asked.
        let Some(api) = upstreams.api_named(holder.as_deref()) else {
            return not_found();
        };
        let upstream = &api.upstream;
        let (method, path) = match route {
            BatchRoute::Results => (Method::GET, format!("/v1/messages/batches/{id}/results")),
            BatchRoute::Cancel => (Method::POST, format!("/v1/messages/batches/{id}/cancel")),
            BatchRoute::Delete => (Method::DELETE, format!("/v1/messages/batches/{id}")),
            _ => (Method::GET, format!("/v1/messages/batches/{id}")),
        };
        let mut req = upstream_request(headers, method, &path, body);
        if route == BatchRoute::Results {
            // JSON lines, possibly large: streamed through as they come, in whichever
            // encoding the client accepts.
            let accepted = req.headers_mut();
            accepted.remove(header::ACCEPT_ENCODING);
            for value in headers.get_all(header::ACCEPT_ENCODING) {
                accepted.append(header::ACCEPT_ENCODING, value.clone());
            }
            return match upstream.send(req).await {
                Ok(response) => response,
                Err(error) => upstream_failed(&error),
            };
        }
        let answer = match read(upstream, req).await {
            Ok(answer) => answer,
            Err(response) => return response,
        };
        if answer.status == StatusCode::NOT_FOUND
            || (route == BatchRoute::Delete && answer.status.is_success())
        {
            self.book.forget(owner, id).await;
        }
        if route == BatchRoute::Delete || !answer.status.is_success() {
            return answer.passed();
        }
        match self.rewritten(&answer.body) {
            Some(batch) => answer.into_response(batch),
            None => unreadable_batch(),
        }
    }

    async fn create(
        &self,
        upstreams: &Upstreams,
        owner: &Owner,
        headers: &HeaderMap,
        body: Body,
    ) -> Response<Body> {
        let Some(api) = upstreams.api() else {
            return no_batches();
        };
        let upstream = &api.upstream;
        // Nothing is created upstream unless its owner can be recorded.
        if self.book.ready().await.is_err() {
            return unavailable();
        }
        let req = upstream_request(headers, Method::POST, "/v1/messages/batches", body);
        let answer = match read_within(CREATE_TIMEOUT, upstream, req).await {
            Ok(answer) => answer,
            Err(response) => return response,
        };
        if !answer.status.is_success() {
            return answer.passed();
        }
        let Some(id) = parse_object(&answer.body).and_then(|batch| batch_id(&batch)) else {
            warn!("the upstream answered a batch create with no readable id: nobody owns it");
            return unreadable_batch();
        };
        if self.record(owner, &id, &api.name).await.is_err() {
            warn!(batch = %id, "no owner recorded for a batch just created: cancelling it");
            tokio::spawn(cancel_orphan(upstream.clone(), headers.clone(), id));
            return unavailable();
        }
        info!(batch = %id, owner = ?owner, upstream = %api.name, "batch created");
        match self.rewritten(&answer.body) {
            Some(batch) => answer.into_response(batch),
            None => unreadable_batch(),
        }
    }

    /// Records `id` for `owner`, created through `upstream`, three tries within about a
    /// third of a second.
    async fn record(&self, owner: &Owner, id: &str, upstream: &str) -> Result<(), Unavailable> {
        let mut wait = Duration::from_millis(100);
        for _ in 0..2 {
            if self.book.record(owner, id, upstream).await.is_ok() {
                return Ok(());
            }
            tokio::time::sleep(wait).await;
            wait *= 2;
        }
        self.book.record(owner, id, upstream).await
    }

    async fn list(
        &self,
        upstreams: &Upstreams,
        owner: &Owner,
        headers: &HeaderMap,
        query: Option<&str>,
    ) -> Response<Body> {
        let (cursor, limit) = match list_query(query.unwrap_or("")) {
            Ok(query) => query,
            Err(message) => {
                return error_response(StatusCode::BAD_REQUEST, "invalid_request_error", message);
            }
        };
        let page = match self.book.page(owner, &cursor, limit).await {
            Err(Unavailable) => return unavailable(),
            Ok(None) => return not_found(),
            Ok(Some(page)) => page,
        };
        let fetched: Vec<Fetched> = futures_util::stream::iter(page.ids.iter().cloned())
            .map(|(id, holder)| {
                let upstream = upstreams.api_named(holder.as_deref());
                self.fetch(upstream.map(|api| &api.upstream), headers, id)
            })
            .buffered(LIST_CONCURRENCY)
            .collect()
            .await;
        let mut data = Vec::with_capacity(fetched.len());
        for batch in fetched {
            match batch {
                Ok(Some(batch)) => data.push(Value::Object(batch)),
                Ok(None) => {}
                Err(response) => return response,
            }
        }
        // The cursors name listed batches, or (should the upstream have lost them all)
        // the page's ids, so paging goes on past them.
        let id_of = |batch: Option<&Value>| batch.and_then(|b| b.get("id")).cloned();
        let first_id = id_of(data.first())
            .or_else(|| page.ids.first().map(|(id, _)| Value::String(id.clone())))
            .unwrap_or(Value::Null);
        let last_id = id_of(data.last())
            .or_else(|| page.ids.last().map(|(id, _)| Value::String(id.clone())))
            .unwrap_or(Value::Null);
        let list = serde_json::json!({
            "data": data,
            "has_more": page.has_more,
            "first_id": first_id,
            "last_id": last_id,
        });
        json_response(StatusCode::OK, HeaderMap::new(), &list)
    }

    /// One listed batch as its upstream has it now, its `results_url` rewritten; left out
    /// when that upstream is no longer configured.
    async fn fetch(&self, upstream: Option<&Upstream>, headers: &HeaderMap, id: String) -> Fetched {
        let Some(upstream) = upstream else {
            return Ok(None);
        };
        let path = format!("/v1/messages/batches/{id}");
        let req = upstream_request(headers, Method::GET, &path, full(""));
        let answer = read(upstream, req).await?;
        if answer.status == StatusCode::NOT_FOUND {
            return Ok(None);
        }
        if !answer.status.is_success() {
            return Err(answer.passed());
        }
        let mut batch = parse_object(&answer.body).ok_or_else(unreadable_batch)?;
        self.rewrite(&mut batch);
        Ok(Some(batch))
    }

    /// The upstream's batch object with its `results_url` rewritten; `None` when it is not
    /// a JSON object.
    fn rewritten(&self, body: &[u8]) -> Option<Bytes> {
        let mut batch = parse_object(body)?;
        self.rewrite(&mut batch);
        serde_json::to_vec(&batch).ok().map(Bytes::from)
    }

    /// Points `results_url` at the gateway; a URL it cannot point there is dropped (`null`),
    /// never left naming the upstream.
    fn rewrite(&self, batch: &mut Map<String, Value>) {
        let own = batch_id(batch).map(|id| {
            Value::String(format!(
                "{}/v1/messages/batches/{id}/results",
                self.public_url
            ))
        });
        if let Some(url) = batch.get_mut("results_url")
            && !url.is_null()
        {
            *url = own.unwrap_or(Value::Null);
        }
    }
}

/// Whether `id` may name a batch: 1 to 128 characters of a canonical path segment.
fn valid_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= MAX_ID
        && id != "."
        && id != ".."
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~'))
}

fn parse_object(body: &[u8]) -> Option<Map<String, Value>> {
    match serde_json::from_slice(body) {
        Ok(Value::Object(object)) => Some(object),
        _ => None,
    }
}

fn batch_id(batch: &Map<String, Value>) -> Option<String> {
    batch
        .get("id")
        .and_then(Value::as_str)
        .filter(|id| valid_id(id))
        .map(str::to_owned)
}

/// `limit`, `after_id`, `before_id` of the list's query; unknown parameters are ignored.
fn list_query(query: &str) -> Result<(Cursor, usize), &'static str> {
    let (mut limit, mut after, mut before) = (DEFAULT_LIMIT, None, None);
    for pair in query.split('&').filter(|pair| !pair.is_empty()) {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        match name {
            "limit" => {
                limit = match value.parse::<u64>() {
                    Ok(0) | Err(_) => return Err("limit: give a number from 1 to 100"),
                    Ok(n) => usize::try_from(n).unwrap_or(MAX_LIMIT).min(MAX_LIMIT),
                }
            }
            "after_id" => after = Some(value.to_owned()),
            "before_id" => before = Some(value.to_owned()),
            _ => {}
        }
    }
    let cursor = match (after, before) {
        (Some(_), Some(_)) => return Err("give after_id or before_id, not both"),
        (Some(id), None) => Cursor::After(id),
        (None, Some(id)) => Cursor::Before(id),
        (None, None) => Cursor::First,
    };
    Ok((cursor, limit))
}

/// A request to the upstream at `path` with the client's headers (the upstream client drops
/// the client's credentials and the rest of `upstream::NOT_FORWARDED`), asking for an
/// answer the gateway can read (`accept-encoding: identity`: the SDKs accept gzip, and a
/// batch must be read to be rewritten).
fn upstream_request(headers: &HeaderMap, method: Method, path: &str, body: Body) -> Request<Body> {
    let mut req = Request::new(body);
    *req.method_mut() = method.clone();
    *req.headers_mut() = headers.clone();
    if method != Method::POST {
        req.headers_mut().remove(header::CONTENT_TYPE);
    }
    req.headers_mut().insert(
        header::ACCEPT_ENCODING,
        HeaderValue::from_static("identity"),
    );
    *req.uri_mut() = match path.parse() {
        Ok(uri) => uri,
        // Unreachable: `path` is built of checked ids; `/` is then a harmless 404 upstream.
        Err(_) => http::Uri::from_static("/"),
    };
    req
}

/// An upstream answer read in full (bounded in size and time).
struct Answer {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

impl Answer {
    /// The answer as the upstream gave it.
    fn passed(self) -> Response<Body> {
        let body = self.body.clone();
        self.into_response(body)
    }

    /// The answer with `body`, the upstream's headers kept (`request-id`, ...).
    fn into_response(self, body: Bytes) -> Response<Body> {
        let mut response = Response::new(full(body));
        *response.status_mut() = self.status;
        *response.headers_mut() = self.headers;
        response.headers_mut().remove(header::CONTENT_LENGTH);
        response
    }
}

/// Sends `req` upstream and reads the answer, within [`UPSTREAM_TIMEOUT`] and
/// [`MAX_OBJECT`]; the response to give the client when that fails.
async fn read(upstream: &Upstream, req: Request<Body>) -> Result<Answer, Response<Body>> {
    read_within(UPSTREAM_TIMEOUT, upstream, req).await
}

async fn read_within(
    timeout: Duration,
    upstream: &Upstream,
    req: Request<Body>,
) -> Result<Answer, Response<Body>> {
    match tokio::time::timeout(timeout, read_in_full(upstream, req)).await {
        Ok(Ok(answer)) => Ok(answer),
        Ok(Err(error)) => Err(upstream_failed(&error)),
        Err(_) => {
            warn!("the upstream did not answer a batch call in time");
            Err(error_response(
                StatusCode::GATEWAY_TIMEOUT,
                "api_error",
                "the upstream did not answer in time",
            ))
        }
    }
}

async fn read_in_full(upstream: &Upstream, req: Request<Body>) -> Result<Answer, String> {
    let response = upstream.send(req).await.map_err(|e| e.to_string())?;
    let (parts, body) = response.into_parts();
    // Read by hand: `http_body_util::Limited`'s boxed error makes the future `Send` for one
    // lifetime only (rust-lang/rust#102211), and the server spawns it.
    let mut body = body;
    let mut bytes = Vec::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| e.to_string())?;
        if let Ok(data) = frame.into_data() {
            if bytes.len() + data.len() > MAX_OBJECT {
                return Err(format!("an answer larger than {MAX_OBJECT} bytes"));
            }
            bytes.extend_from_slice(&data);
        }
    }
    let body = Bytes::from(bytes);
    Ok(Answer {
        status: parts.status,
        headers: parts.headers,
        body,
    })
}

/// Cancels, upstream, a batch whose owner could not be recorded (nobody could read it).
async fn cancel_orphan(upstream: Upstream, headers: HeaderMap, id: String) {
    let path = format!("/v1/messages/batches/{id}/cancel");
    let req = upstream_request(&headers, Method::POST, &path, full(""));
    match read(&upstream, req).await {
        Ok(answer) if answer.status.is_success() => {
            info!(batch = %id, "ownerless batch cancelled")
        }
        Ok(answer) => {
            warn!(batch = %id, status = answer.status.as_u16(), "ownerless batch not cancelled")
        }
        Err(_) => warn!(batch = %id, "ownerless batch not cancelled: the upstream failed"),
    }
}

fn json_response(status: StatusCode, headers: HeaderMap, value: &Value) -> Response<Body> {
    let mut response = Response::new(full(value.to_string()));
    *response.status_mut() = status;
    *response.headers_mut() = headers;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

/// The one answer for another key's batch and for an id nobody owns.
/// The answer of the batch routes when no upstream has batches (a Bedrock-only pool).
fn no_batches() -> Response<Body> {
    error_response(
        StatusCode::NOT_FOUND,
        "not_found_error",
        "this gateway's upstreams have no Message Batches",
    )
}

fn not_found() -> Response<Body> {
    error_response(
        StatusCode::NOT_FOUND,
        "not_found_error",
        "no message batch of this key has that id",
    )
}

fn unavailable() -> Response<Body> {
    let mut response = error_response(
        StatusCode::SERVICE_UNAVAILABLE,
        "overloaded_error",
        "the gateway cannot reach the store of batch owners; retry shortly",
    );
    response
        .headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    response
}

fn unreadable_batch() -> Response<Body> {
    error_response(
        StatusCode::BAD_GATEWAY,
        "api_error",
        "the upstream answered a message batch the gateway cannot read",
    )
}

fn upstream_failed(error: &dyn std::fmt::Display) -> Response<Body> {
    warn!(%error, "upstream batch call failed");
    error_response(
        StatusCode::BAD_GATEWAY,
        "api_error",
        "the upstream could not be reached",
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_list_query_reads_as_the_batches_api_does() {
        assert_eq!(list_query(""), Ok((Cursor::First, 20)));
        assert_eq!(
            list_query("limit=5&after_id=msgbatch_1"),
            Ok((Cursor::After("msgbatch_1".into()), 5))
        );
        assert_eq!(
            list_query("before_id=msgbatch_1&beta=true"),
            Ok((Cursor::Before("msgbatch_1".into()), 20))
        );
        assert_eq!(list_query("limit=1000"), Ok((Cursor::First, 100)));
        assert_eq!(
            list_query("limit=99999999999999999999"),
            Err("limit: give a number from 1 to 100")
        );
        assert!(list_query("limit=0").is_err());
        assert!(list_query("limit=x").is_err());
        assert!(list_query("after_id=a&before_id=b").is_err());
    }

    #[test]
    fn results_url_names_the_gateway_or_nothing() {
        let batches = Batches::in_memory("https://gw.example/llm/");
        let upstream = br#"{"id":"msgbatch_01","type":"message_batch","results_url":"https://api.anthropic.com/v1/messages/batches/msgbatch_01/results"}"#;
        let rewritten: Value =
            serde_json::from_slice(&batches.rewritten(upstream).unwrap()).unwrap();
        assert_eq!(
            rewritten["results_url"],
            "https://gw.example/llm/v1/messages/batches/msgbatch_01/results"
        );
        assert_eq!(rewritten["type"], "message_batch");
        let pending = br#"{"id":"msgbatch_01","results_url":null}"#;
        let rewritten: Value =
            serde_json::from_slice(&batches.rewritten(pending).unwrap()).unwrap();
        assert!(rewritten["results_url"].is_null());
        let bad_id = br#"{"id":"../x","results_url":"https://api.anthropic.com/x"}"#;
        let rewritten: Value = serde_json::from_slice(&batches.rewritten(bad_id).unwrap()).unwrap();
        assert!(
            rewritten["results_url"].is_null(),
            "never the upstream's URL"
        );
        assert!(batches.rewritten(b"[1,2]").is_none());
        assert!(batches.rewritten(b"{\"id\":").is_none());
        assert!(batches.rewritten(b"").is_none());
    }

    #[test]
    fn batches_are_asked_of_the_upstream_unencoded_with_the_clients_other_headers() {
        let mut client = HeaderMap::new();
        client.insert("anthropic-version", HeaderValue::from_static("2023-06-01"));
        client.insert("accept-encoding", HeaderValue::from_static("gzip, br"));
        client.insert("content-type", HeaderValue::from_static("application/json"));
        let req = upstream_request(&client, Method::GET, "/v1/messages/batches/b", full(""));
        assert_eq!(req.uri(), "/v1/messages/batches/b");
        assert_eq!(req.headers()["accept-encoding"], "identity");
        assert_eq!(req.headers()["anthropic-version"], "2023-06-01");
        assert!(
            req.headers().get("content-type").is_none(),
            "a GET has no body"
        );
    }

    #[test]
    fn batch_ids_are_path_segments_of_bounded_length() {
        assert!(valid_id("msgbatch_013Zva2CMHLNnXjNJJKqJ2EF"));
        for id in ["", ".", "..", "a/b", "a%2Fb", "a b", &"x".repeat(129)] {
            assert!(!valid_id(id), "{id}");
        }
    }
}
