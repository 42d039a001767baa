//! The [`Job`] from the request: a layer that derives each request's job (who it is for,
//! its tier, its cost) from the request itself, so the stack can be mounted where requests
//! arrive as they are (an axum `route_service`, a gateway) instead of every caller building
//! the job by hand.
//!
//! [`JobLayer::new`] takes any extractor: a closure `Fn(&http::Request<B>) -> Result<Job,
//! Unidentified>`, or the ready-made [`FromHeaders`]:
//!
//! - the tenant from a header your own authentication sets (`x-tenant-id`), or from the
//!   client's API key (`x-api-key`, or `Authorization: Bearer ...`) — **hashed** (SHA-256,
//!   [`api_key_tenant`]), so a key never reaches metrics, logs or Redis in clear; or from a
//!   [`KeyTable`] of known keys, which also gives the tier (and refuses unknown keys);
//! - the tier from a header, a key table, or a fixed name;
//! - the origin from a header (`user`, `scheduled`, `batch`; default: a user action), the
//!   SLA from a header in seconds;
//! - the input tokens estimated from the body's size (its exact size hint, else
//!   `Content-Length`): ceil(bytes / 3.5).
//!
//! A request it cannot identify fails with the typed [`Unidentified`] (rendered as `401` by
//! [`render`](crate::reject::render)), never a panic; nothing is sent.
//!
//! ```
//! use fairgate::extract::{FromHeaders, JobLayer, KeyTable};
//! use fairgate::{FairgateLayer, Store};
//! use tower::{ServiceBuilder, ServiceExt, service_fn};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), fairgate::BoxError> {
//! let keys = KeyTable::new().key("sk-team-a", "team-a", "premium");
//! let claude = ServiceBuilder::new()
//!     .layer(JobLayer::new(FromHeaders::new().keys(keys)))
//!     .layer(FairgateLayer::new(Store::memory()))
//!     .service(service_fn(|_req: http::Request<String>| async {
//!         Ok::<_, std::convert::Infallible>(http::Response::new("{}".to_owned()))
//!     }));
//!
//! let req = http::Request::post("/v1/messages")
//!     .header("x-api-key", "sk-team-a")
//!     .body(r#"{"messages":[]}"#.to_owned())?;
//! assert_eq!(claude.clone().oneshot(req).await?.status(), 200);
//!
//! let stranger = http::Request::post("/v1/messages")
//!     .header("x-api-key", "sk-who-knows")
//!     .body(String::new())?;
//! let err = claude.oneshot(stranger).await.unwrap_err();
//! assert!(err.is::<fairgate::extract::Unidentified>());
//! # Ok(())
//! # }
//! ```

use std::borrow::Cow;
use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::HeaderName;
use http::header::{AUTHORIZATION, CONTENT_LENGTH};
use http_body::Body;
use pin_project_lite::pin_project;
use sha2::{Digest, Sha256};
use tower_layer::Layer;
use tower_service::Service;

use crate::error::BoxError;
use crate::{Job, Origin, TenantId, Tier};

/// No job could be derived from the request: no tenant (no key, no header), or a key no
/// table knows. Nothing was sent; answer `401`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unidentified {
    reason: Cow<'static, str>,
}

impl Unidentified {
    /// A refusal saying why (never put a key or a secret in it).
    pub fn new(reason: impl Into<Cow<'static, str>>) -> Self {
        Unidentified {
            reason: reason.into(),
        }
    }

    /// Why the request was not identified.
    pub fn reason(&self) -> &str {
        &self.reason
    }
}

impl fmt::Display for Unidentified {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "request not identified: {}", self.reason)
    }
}

impl std::error::Error for Unidentified {}

/// Derives the [`Job`] of a request.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot derive a fairgate Job from `http::Request<{B}>`",
    label = "not a job extractor for this request type",
    note = "use `fairgate::extract::FromHeaders`, or a closure `Fn(&http::Request<B>) -> Result<Job, Unidentified>`"
)]
pub trait ExtractJob<B>: Send + Sync + 'static {
    /// The job of `req`, or why there is none.
    fn extract(&self, req: &http::Request<B>) -> Result<Job, Unidentified>;
}

impl<F, B> ExtractJob<B> for F
where
    F: Fn(&http::Request<B>) -> Result<Job, Unidentified> + Send + Sync + 'static,
{
    fn extract(&self, req: &http::Request<B>) -> Result<Job, Unidentified> {
        self(req)
    }
}

/// Puts the [`Job`] its extractor derives into each request; see the
/// [module docs](crate::extract).
///
/// # Clone
/// Cheap; clones share the extractor.
pub struct JobLayer<X> {
    extract: Arc<X>,
}

impl<X> JobLayer<X> {
    /// Derives jobs with `extract`.
    pub fn new(extract: X) -> Self {
        JobLayer {
            extract: Arc::new(extract),
        }
    }
}

impl<X> Clone for JobLayer<X> {
    fn clone(&self) -> Self {
        JobLayer {
            extract: self.extract.clone(),
        }
    }
}

impl<X> fmt::Debug for JobLayer<X> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JobLayer")
            .field("extract", &std::any::type_name::<X>())
            .finish()
    }
}

impl<S, X> Layer<S> for JobLayer<X> {
    type Service = WithJob<S, X>;

    fn layer(&self, inner: S) -> Self::Service {
        WithJob {
            inner,
            extract: self.extract.clone(),
        }
    }
}

/// The service of [`JobLayer`].
pub struct WithJob<S, X> {
    inner: S,
    extract: Arc<X>,
}

impl<S, X> WithJob<S, X> {
    /// The wrapped service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The wrapped service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Unwraps the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S: Clone, X> Clone for WithJob<S, X> {
    fn clone(&self) -> Self {
        WithJob {
            inner: self.inner.clone(),
            extract: self.extract.clone(),
        }
    }
}

impl<S: fmt::Debug, X> fmt::Debug for WithJob<S, X> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WithJob")
            .field("inner", &self.inner)
            .field("extract", &std::any::type_name::<X>())
            .finish()
    }
}

impl<S, X, B> Service<http::Request<B>> for WithJob<S, X>
where
    S: Service<http::Request<B>>,
    S::Error: Into<BoxError>,
    X: ExtractJob<B>,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = ResponseFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, mut req: http::Request<B>) -> Self::Future {
        match self.extract.extract(&req) {
            Ok(job) => {
                req.extensions_mut().insert(job);
                ResponseFuture {
                    state: State::Called {
                        fut: self.inner.call(req),
                    },
                }
            }
            Err(unidentified) => ResponseFuture {
                state: State::Refused {
                    error: Some(unidentified),
                },
            },
        }
    }
}

pin_project! {
    /// Response future of [`WithJob`].
    pub struct ResponseFuture<F> {
        #[pin]
        state: State<F>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<F> {
        Called { #[pin] fut: F },
        Refused { error: Option<Unidentified> },
    }
}

impl<F, T, E> Future for ResponseFuture<F>
where
    F: Future<Output = Result<T, E>>,
    E: Into<BoxError>,
{
    type Output = Result<T, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().state.project() {
            StateProj::Called { fut } => fut.poll(cx).map_err(Into::into),
            StateProj::Refused { error } => Poll::Ready(Err(error
                .take()
                .unwrap_or_else(|| Unidentified::new("polled after completion"))
                .into())),
        }
    }
}

impl<F> fmt::Debug for ResponseFuture<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

/// The tenant name of an API key: `key-` and the first 16 bytes of its SHA-256, in hex.
/// The same key gives the same tenant in every process; the key itself cannot be read back.
pub fn api_key_tenant(key: &str) -> TenantId {
    let digest = Sha256::digest(key.as_bytes());
    let mut name = String::with_capacity(4 + 32);
    name.push_str("key-");
    for byte in &digest[..16] {
        name.push_str(&format!("{byte:02x}"));
    }
    TenantId::from(name)
}

/// The client's API key: `x-api-key`, else `Authorization: Bearer <key>`.
pub fn api_key<B>(req: &http::Request<B>) -> Option<&str> {
    let headers = req.headers();
    if let Some(key) = headers.get("x-api-key").and_then(|v| v.to_str().ok()) {
        return Some(key.trim()).filter(|k| !k.is_empty());
    }
    let auth = headers.get(AUTHORIZATION)?.to_str().ok()?;
    let (scheme, key) = auth.trim().split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| key.trim())
        .filter(|k| !k.is_empty())
}

/// Known API keys and the tenant and tier each stands for. Keys are kept by their SHA-256:
/// the table never holds one in clear, its `Debug` shows only how many it holds, and a
/// configuration may give a key's hash instead of the key ([`key_sha256`](KeyTable::key_sha256)).
/// A presented key is hashed once and looked up by its hash.
#[derive(Clone, Default)]
pub struct KeyTable {
    by_hash: HashMap<[u8; 32], (TenantId, Tier)>,
}

impl KeyTable {
    /// An empty table.
    pub fn new() -> Self {
        KeyTable::default()
    }

    /// Adds (or replaces) `key`, standing for `tenant` on `tier`.
    pub fn key(mut self, key: &str, tenant: impl Into<TenantId>, tier: impl Into<Tier>) -> Self {
        self.insert(key, tenant, tier);
        self
    }

    /// Adds (or replaces) `key`, standing for `tenant` on `tier`.
    pub fn insert(&mut self, key: &str, tenant: impl Into<TenantId>, tier: impl Into<Tier>) {
        self.insert_sha256(KeyTable::sha256(key), tenant, tier);
    }

    /// Adds (or replaces) the key whose SHA-256 is `sha256`, standing for `tenant` on
    /// `tier`: for a configuration that keeps only the keys' hashes (the key itself is
    /// then known to its holder alone). A presented key matches if its SHA-256 is
    /// `sha256`; [`KeyTable::sha256`] computes it.
    ///
    /// ```
    /// use fairgate::extract::KeyTable;
    ///
    /// // `printf %s sk-team-a | sha256sum`
    /// let hash = KeyTable::sha256("sk-team-a");
    /// let keys = KeyTable::new().key_sha256(hash, "team-a", "premium");
    /// let (tenant, tier) = keys.get("sk-team-a").unwrap();
    /// assert_eq!((tenant.as_str(), tier.as_str()), ("team-a", "premium"));
    /// assert!(keys.get("sk-team-b").is_none());
    /// ```
    pub fn key_sha256(
        mut self,
        sha256: [u8; 32],
        tenant: impl Into<TenantId>,
        tier: impl Into<Tier>,
    ) -> Self {
        self.insert_sha256(sha256, tenant, tier);
        self
    }

    /// Adds (or replaces) the key whose SHA-256 is `sha256`; see
    /// [`key_sha256`](KeyTable::key_sha256).
    pub fn insert_sha256(
        &mut self,
        sha256: [u8; 32],
        tenant: impl Into<TenantId>,
        tier: impl Into<Tier>,
    ) {
        self.by_hash.insert(sha256, (tenant.into(), tier.into()));
    }

    /// The SHA-256 of `key`: what the table keeps of it, and what
    /// [`get_sha256`](KeyTable::get_sha256) looks up.
    pub fn sha256(key: &str) -> [u8; 32] {
        Sha256::digest(key.as_bytes()).into()
    }

    /// The tenant and tier of `key`, if the table knows it.
    pub fn get(&self, key: &str) -> Option<&(TenantId, Tier)> {
        self.get_sha256(&KeyTable::sha256(key))
    }

    /// The tenant and tier of the key whose SHA-256 is `sha256`, if the table knows it: for
    /// a caller that hashes a presented key once and uses the hash for more than the look-up.
    pub fn get_sha256(&self, sha256: &[u8; 32]) -> Option<&(TenantId, Tier)> {
        self.by_hash.get(sha256)
    }

    /// How many keys the table knows.
    pub fn len(&self) -> usize {
        self.by_hash.len()
    }

    /// Whether the table knows no key.
    pub fn is_empty(&self) -> bool {
        self.by_hash.is_empty()
    }
}

impl fmt::Debug for KeyTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeyTable")
            .field("keys", &self.by_hash.len())
            .finish()
    }
}

#[derive(Clone, Debug)]
enum TenantFrom {
    Header(HeaderName),
    ApiKey,
    Keys(Arc<KeyTable>),
}

#[derive(Clone, Debug)]
enum TierFrom {
    None,
    Header(HeaderName),
    Fixed(Tier),
}

/// A ready-made job extractor reading the request's headers (and the body's size); see the
/// [module docs](crate::extract). Default: tenant from the hashed API key, no tier (the slot
/// policy's default tier), a user action with no SLA, tokens from the body's size.
#[derive(Clone, Debug)]
pub struct FromHeaders {
    tenant: TenantFrom,
    tier: TierFrom,
    origin: Origin,
    origin_header: Option<HeaderName>,
    sla_header: Option<HeaderName>,
}

impl Default for FromHeaders {
    fn default() -> Self {
        FromHeaders::new()
    }
}

impl FromHeaders {
    /// Tenant from the hashed API key, nothing else configured.
    pub fn new() -> Self {
        FromHeaders {
            tenant: TenantFrom::ApiKey,
            tier: TierFrom::None,
            origin: Origin::UserAction,
            origin_header: None,
            sla_header: None,
        }
    }

    /// The tenant is the value of `header` (set by your own authentication, never by the
    /// end user); a request without it is [`Unidentified`].
    pub fn tenant_header(mut self, header: HeaderName) -> Self {
        self.tenant = TenantFrom::Header(header);
        self
    }

    /// The tenant is the client's API key, hashed ([`api_key_tenant`]); the default.
    pub fn tenant_from_api_key(mut self) -> Self {
        self.tenant = TenantFrom::ApiKey;
        self
    }

    /// The tenant and tier come from `keys`; a request with no key or an unknown one is
    /// [`Unidentified`].
    pub fn keys(mut self, keys: KeyTable) -> Self {
        self.tenant = TenantFrom::Keys(Arc::new(keys));
        self
    }

    /// The tier is the value of `header` (when the tenant does not come from a key table).
    pub fn tier_header(mut self, header: HeaderName) -> Self {
        self.tier = TierFrom::Header(header);
        self
    }

    /// Every request is on `tier` (when the tenant does not come from a key table).
    pub fn tier(mut self, tier: impl Into<Tier>) -> Self {
        self.tier = TierFrom::Fixed(tier.into());
        self
    }

    /// The origin of requests without an origin header (default: a user action).
    pub fn origin(mut self, origin: Origin) -> Self {
        self.origin = origin;
        self
    }

    /// Reads the origin from `header`: `user`, `scheduled` or `batch`; anything else is the
    /// default origin.
    pub fn origin_header(mut self, header: HeaderName) -> Self {
        self.origin_header = Some(header);
        self
    }

    /// Reads the SLA from `header`, in seconds (decimals allowed; anything else: none).
    pub fn sla_header(mut self, header: HeaderName) -> Self {
        self.sla_header = Some(header);
        self
    }
}

fn header_str<'a, B>(req: &'a http::Request<B>, name: &HeaderName) -> Option<&'a str> {
    req.headers()
        .get(name)?
        .to_str()
        .ok()
        .map(str::trim)
        .filter(|v| !v.is_empty())
}

/// Estimated input tokens of a body of `bytes`: ceil(bytes / 3.5), at least 1.
fn tokens_of(bytes: u64) -> u32 {
    u32::try_from(bytes.saturating_mul(2).div_ceil(7).max(1)).unwrap_or(u32::MAX)
}

impl<B: Body> ExtractJob<B> for FromHeaders {
    fn extract(&self, req: &http::Request<B>) -> Result<Job, Unidentified> {
        let (tenant, keyed_tier) = match &self.tenant {
            TenantFrom::Header(name) => {
                let tenant = header_str(req, name)
                    .ok_or_else(|| Unidentified::new(format!("no {name} header")))?;
                (TenantId::new(tenant), None)
            }
            TenantFrom::ApiKey => {
                let key = api_key(req).ok_or_else(|| Unidentified::new("no api key"))?;
                (api_key_tenant(key), None)
            }
            TenantFrom::Keys(table) => {
                let key = api_key(req).ok_or_else(|| Unidentified::new("no api key"))?;
                let (tenant, tier) = table
                    .get(key)
                    .ok_or_else(|| Unidentified::new("unknown api key"))?;
                (tenant.clone(), Some(tier.clone()))
            }
        };
        let origin = match self.origin_header.as_ref().and_then(|h| header_str(req, h)) {
            Some(v) if v.eq_ignore_ascii_case("user") => Origin::UserAction,
            Some(v) if v.eq_ignore_ascii_case("scheduled") => Origin::Scheduled,
            Some(v) if v.eq_ignore_ascii_case("batch") => Origin::BatchJob,
            _ => self.origin,
        };
        let mut job = Job::new(tenant, origin);
        let tier = keyed_tier.or_else(|| match &self.tier {
            TierFrom::None => None,
            TierFrom::Header(name) => header_str(req, name).map(Tier::new),
            TierFrom::Fixed(tier) => Some(tier.clone()),
        });
        if let Some(tier) = tier {
            job = job.with_tier(tier);
        }
        if let Some(sla) = self
            .sla_header
            .as_ref()
            .and_then(|h| header_str(req, h))
            .and_then(|v| v.parse::<f64>().ok())
            .and_then(|secs| Duration::try_from_secs_f64(secs).ok())
        {
            job = job.with_sla(sla);
        }
        let bytes = req
            .body()
            .size_hint()
            .exact()
            .or_else(|| header_str(req, &CONTENT_LENGTH).and_then(|v| v.parse::<u64>().ok()));
        if let Some(bytes) = bytes {
            job = job.with_cost(tokens_of(bytes));
        }
        Ok(job)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(headers: &[(&str, &str)], body: &str) -> http::Request<String> {
        let mut builder = http::Request::post("/v1/messages");
        for (name, value) in headers {
            builder = builder.header(*name, *value);
        }
        builder.body(body.to_owned()).unwrap()
    }

    #[test]
    fn an_api_key_becomes_a_hashed_tenant_from_either_header() {
        let from = FromHeaders::new();
        let a = from
            .extract(&req(&[("x-api-key", "sk-secret")], ""))
            .unwrap();
        let b = from
            .extract(&req(&[("authorization", "Bearer sk-secret")], ""))
            .unwrap();
        assert_eq!(a.tenant(), b.tenant());
        assert!(a.tenant().as_str().starts_with("key-"));
        assert!(!a.tenant().as_str().contains("secret"));
        assert_eq!(a.tenant().as_str().len(), 4 + 32);
    }

    #[test]
    fn no_key_or_an_unknown_key_is_unidentified_never_a_panic() {
        let from = FromHeaders::new().keys(KeyTable::new().key("k1", "acme", "pro"));
        assert_eq!(
            from.extract(&req(&[], "")).unwrap_err().reason(),
            "no api key"
        );
        assert_eq!(
            from.extract(&req(&[("x-api-key", "k2")], ""))
                .unwrap_err()
                .reason(),
            "unknown api key"
        );
        assert_eq!(
            from.extract(&req(&[("authorization", "Basic abc")], ""))
                .unwrap_err()
                .reason(),
            "no api key"
        );
        let job = from.extract(&req(&[("x-api-key", "k1")], "")).unwrap();
        assert_eq!(job.tenant().as_str(), "acme");
        assert_eq!(job.tier().unwrap().as_str(), "pro");
    }

    #[test]
    fn tier_origin_sla_and_tokens_come_from_headers_and_body_size() {
        let from = FromHeaders::new()
            .tenant_header(HeaderName::from_static("x-tenant-id"))
            .tier_header(HeaderName::from_static("x-tier"))
            .origin_header(HeaderName::from_static("x-origin"))
            .sla_header(HeaderName::from_static("x-sla"));
        let body = "x".repeat(35);
        let job = from
            .extract(&req(
                &[
                    ("x-tenant-id", "acme"),
                    ("x-tier", "free"),
                    ("x-origin", "batch"),
                    ("x-sla", "90.5"),
                ],
                &body,
            ))
            .unwrap();
        assert_eq!(job.tenant().as_str(), "acme");
        assert_eq!(job.tier().unwrap().as_str(), "free");
        assert_eq!(job.origin(), Origin::BatchJob);
        assert_eq!(job.sla(), Some(Duration::from_millis(90_500)));
        assert_eq!(job.cost(), 10);
        let garbage = from
            .extract(&req(&[("x-tenant-id", "acme"), ("x-sla", "-1e400")], ""))
            .unwrap();
        assert_eq!(garbage.sla(), None);
    }

    #[test]
    fn a_key_given_by_its_sha256_matches_the_key_and_nothing_else() {
        let hash = KeyTable::sha256("sk-hashed");
        // The well-known digest, so a file's `key_sha256` from `sha256sum` matches.
        assert_eq!(
            KeyTable::sha256("abc")[..4],
            [0xba, 0x78, 0x16, 0xbf],
            "SHA-256 of `abc`"
        );
        let mut table = KeyTable::new()
            .key("sk-plain", "plain", "pro")
            .key_sha256(hash, "hashed", "premium");
        let (tenant, tier) = table.get("sk-hashed").unwrap();
        assert_eq!((tenant.as_str(), tier.as_str()), ("hashed", "premium"));
        assert_eq!(table.get_sha256(&hash), table.get("sk-hashed"));
        assert!(table.get("sk-hashed ").is_none());
        assert_eq!(table.get("sk-plain").unwrap().0.as_str(), "plain");
        // The same key given both ways is one key: the later replaces the earlier.
        table.insert("sk-hashed", "again", "free");
        assert_eq!(table.len(), 2);
        assert_eq!(table.get_sha256(&hash).unwrap().0.as_str(), "again");
    }

    #[test]
    fn the_key_table_keeps_no_key_in_clear() {
        let table = KeyTable::new().key("sk-very-secret", "acme", "pro");
        assert!(!format!("{table:?}").contains("secret"));
    }
}
