//! gRPC with [tonic]: fairgate's rejections as [`tonic::Status`], and the
//! stack around a tonic client `Channel` or a tonic `Server`.
//!
//! gRPC runs over HTTP/2, and tonic's clients and servers are tower services of
//! `http::Request<tonic::body::Body>`, so the layers apply to them unchanged. This module
//! only converts at the edge:
//!
//! - **Rejections as statuses.** `impl From<Rejection> for Status` and [`status`] give each
//!   fairgate rejection its gRPC code, with the retry information in metadata:
//!
//!   | rejection | code | metadata |
//!   |---|---|---|
//!   | [`Busy`](crate::Busy) | `UNAVAILABLE` | `retry-after-ms`, `grpc-retry-pushback-ms` |
//!   | [`QueueFull`](crate::drr_fairness::error::QueueFull) | `RESOURCE_EXHAUSTED` | `retry-after-ms`, `grpc-retry-pushback-ms` |
//!   | [`Unidentified`](crate::extract::Unidentified) | `UNAUTHENTICATED` | `grpc-retry-pushback-ms: -1` |
//!   | [`MissingJob`](crate::MissingJob) | `INTERNAL` | `grpc-retry-pushback-ms: -1` |
//!
//!   `grpc-retry-pushback-ms` is the server pushback of gRPC's retry design (gRFC A6): a
//!   client whose retry policy lists the code waits that long before its next attempt, and
//!   a negative value tells it not to retry (a missing key or a wiring bug will not get
//!   better by retrying). `retry-after-ms` is the same delay for code that reads metadata
//!   itself, as the HTTP renderings ([`crate::reject`]) carry it.
//!
//! - **Rejections as answers.** [`GrpcRejectionLayer`] goes outside the stack and turns
//!   every fairgate rejection into a gRPC *trailers-only* response (HTTP `200`, with
//!   `grpc-status`, `grpc-message` and the metadata as headers, no body) — what a gRPC server
//!   sends for a call it refuses. A tonic `Server` wrapped in the layers therefore answers a
//!   refused call with a proper status instead of resetting the stream, and a generated
//!   client over a wrapped `Channel` returns the status (`Code::Unavailable`, ...) instead of
//!   tonic's `Code::Unknown` for an error it does not know. Errors that are not fairgate's
//!   (a transport failure of the channel) pass through untouched, so tonic maps them as it
//!   always does.
//!
//! - **The job.** gRPC metadata are HTTP/2 headers, so on a server
//!   [`JobLayer`](crate::extract::JobLayer) with [`FromHeaders`](crate::extract::FromHeaders) reads
//!   the tenant from the `x-api-key` / `authorization: Bearer` metadata as is. On a client,
//!   put the [`Job`](crate::Job) into the `tonic::Request`'s extensions: tonic moves them
//!   into the `http::Request` the channel sends, where the layers find it.
//!
//! - **Bodies are not `Clone`.** `tonic::body::Body` is a stream, so the retry layer cannot
//!   copy a request: build the stack with
//!   [`.clone_requests_with(SendOnce)`](crate::FairgateLayer::clone_requests_with). The
//!   retry layer still counts throttles and holds calls behind the cooldown gate; retrying a
//!   refused gRPC call is the client's retry policy's job, driven by the pushback above.
//!   A response keeps its window permit and slot until its body (messages and trailers)
//!   ends or is dropped, so a server stream holds its slot for as long as it runs.
//!
//! # Server: admit the handlers
//!
//! ```no_run
//! use fairgate::extract::{FromHeaders, KeyTable};
//! use fairgate::retry_after_backoff::SendOnce;
//! use fairgate::tonic::GrpcRejectionLayer;
//! use fairgate::{FairgateLayer, Store};
//! use fairgate::extract::JobLayer;
//! use tower::ServiceBuilder;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), fairgate::BoxError> {
//! let keys = KeyTable::new().key("sk-team-a", "team-a", "premium");
//! let admission = ServiceBuilder::new()
//!     .layer(GrpcRejectionLayer::new()) // rejections become gRPC statuses
//!     .layer(JobLayer::new(FromHeaders::new().keys(keys))) // the job from the metadata
//!     .layer(FairgateLayer::new(Store::memory()).clone_requests_with(SendOnce))
//!     .into_inner();
//! let (_reporter, health) = tonic_health::server::health_reporter();
//! tonic::transport::Server::builder()
//!     .layer(admission)
//!     .add_service(health)
//!     .serve("127.0.0.1:50051".parse()?)
//!     .await?;
//! # Ok(())
//! # }
//! ```
//!
//! # Client: admit the calls
//!
//! ```no_run
//! use fairgate::retry_after_backoff::SendOnce;
//! use fairgate::tonic::GrpcRejectionLayer;
//! use fairgate::{FairgateLayer, Job, Origin, Store};
//! use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};
//! use tower::ServiceBuilder;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), fairgate::BoxError> {
//! let channel = tonic::transport::Channel::from_static("http://127.0.0.1:50051").connect().await?;
//! let admitted = ServiceBuilder::new()
//!     .layer(GrpcRejectionLayer::new())
//!     .layer(FairgateLayer::new(Store::memory()).clone_requests_with(SendOnce))
//!     .service(channel);
//! let mut client = HealthClient::new(admitted);
//!
//! let mut request = tonic::Request::new(HealthCheckRequest { service: String::new() });
//! request.extensions_mut().insert(Job::new("tenant-42", Origin::UserAction).with_tier("pro"));
//! match client.check(request).await {
//!     Ok(response) => println!("{:?}", response.into_inner().status()),
//!     Err(status) if status.code() == tonic::Code::Unavailable => {
//!         let retry_after_ms = status.metadata().get("retry-after-ms");
//!         println!("busy, retry after {retry_after_ms:?} ms");
//!     }
//!     Err(status) => return Err(status.into()),
//! }
//! # Ok(())
//! # }
//! ```
//!
//! [tonic]: https://docs.rs/tonic

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use ::tonic::metadata::{MetadataMap, MetadataValue};
use ::tonic::{Code, Status};
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;
use tower_layer::Layer;
use tower_service::Service;

use crate::error::BoxError;
use crate::reject::Rejection;

/// The metadata key of the delay before a retry, in milliseconds.
pub const RETRY_AFTER_MS: &str = "retry-after-ms";

/// gRPC's server pushback (gRFC A6): milliseconds a client's retry policy waits before its
/// next attempt; negative means "do not retry".
pub const GRPC_RETRY_PUSHBACK_MS: &str = "grpc-retry-pushback-ms";

impl From<Rejection> for Status {
    /// The rejection's code (see the [module docs](crate::tonic)), its message, and the retry
    /// information in metadata; the rejection itself is the status's source.
    fn from(rejection: Rejection) -> Status {
        let code = match &rejection {
            Rejection::Busy(_) => Code::Unavailable,
            Rejection::QueueFull(_) => Code::ResourceExhausted,
            Rejection::Unidentified(_) => Code::Unauthenticated,
            Rejection::MissingJob(_) => Code::Internal,
        };
        let mut metadata = MetadataMap::new();
        match rejection.retry_after() {
            Some(after) => {
                let ms = millis(after);
                metadata.insert(RETRY_AFTER_MS, MetadataValue::from(ms));
                metadata.insert(GRPC_RETRY_PUSHBACK_MS, MetadataValue::from(ms));
            }
            None => {
                metadata.insert(GRPC_RETRY_PUSHBACK_MS, MetadataValue::from_static("-1"));
            }
        }
        let mut status = Status::with_metadata(code, rejection.to_string(), metadata);
        status.set_source(Arc::new(rejection));
        status
    }
}

/// Any error of the stack as a gRPC status.
///
/// - a fairgate [`Rejection`] (anywhere in the error's chain of sources) as its status, see
///   the [module docs](crate::tonic);
/// - a [`tonic::Status`] in the chain (the inner service's own answer) as
///   itself (code, message, details and metadata);
/// - anything else as `UNAVAILABLE`, "the upstream call failed": what fails below the
///   admission layers is the channel or the server it talks to, and gRPC's mapping of
///   HTTP's `502`/`503`/`504` (which [`render`](crate::reject::render) answers for the same
///   errors) is `UNAVAILABLE`. The error's text is left out, as `render` leaves it out:
///   it may carry upstream details; log it yourself if you need it.
pub fn status(error: &BoxError) -> Status {
    if let Some(rejection) = Rejection::from_error(&**error) {
        return Status::from(rejection);
    }
    let mut current: Option<&(dyn std::error::Error + 'static)> = Some(&**error);
    while let Some(error) = current {
        if let Some(status) = error.downcast_ref::<Status>() {
            return Status::with_details_and_metadata(
                status.code(),
                status.message(),
                status.details().to_vec().into(),
                status.metadata().clone(),
            );
        }
        current = error.source();
    }
    Status::unavailable("the upstream call failed")
}

fn millis(after: Duration) -> u64 {
    u64::try_from(after.as_millis()).unwrap_or(u64::MAX)
}

/// The trailers-only gRPC response carrying `status`: HTTP `200`, `content-type:
/// application/grpc`, `grpc-status`, `grpc-message` and the status's metadata as headers,
/// no body.
fn trailers_only<B>(status: &Status) -> http::Response<GrpcRejectionBody<B>> {
    let mut response = http::Response::new(GrpcRejectionBody::empty());
    response.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/grpc"),
    );
    if status.add_header(response.headers_mut()).is_err() {
        // Only a message or details that cannot be a header value fail, and tonic encodes
        // both; keep the code whatever happens.
        response.headers_mut().insert(
            http::HeaderName::from_static("grpc-status"),
            http::HeaderValue::from(i32::from(status.code())),
        );
    }
    response
}

/// Turns fairgate's rejections into gRPC trailers-only responses carrying their status; see
/// the [module docs](crate::tonic). Put it outside the stack (and outside a
/// [`JobLayer`](crate::extract::JobLayer), whose refusals it answers too).
///
/// # Clone
/// Cheap; it holds nothing.
#[derive(Clone, Copy, Debug, Default)]
pub struct GrpcRejectionLayer {
    _priv: (),
}

impl GrpcRejectionLayer {
    /// The layer.
    pub fn new() -> Self {
        GrpcRejectionLayer { _priv: () }
    }
}

impl<S> Layer<S> for GrpcRejectionLayer {
    type Service = GrpcRejection<S>;

    fn layer(&self, inner: S) -> Self::Service {
        GrpcRejection { inner }
    }
}

/// The service of [`GrpcRejectionLayer`].
///
/// # Errors
/// Fairgate's rejections become `Ok` responses; any other error of the inner service is
/// returned as it is (boxed).
#[derive(Clone, Debug)]
pub struct GrpcRejection<S> {
    inner: S,
}

impl<S> GrpcRejection<S> {
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

impl<S, Req, B> Service<Req> for GrpcRejection<S>
where
    S: Service<Req, Response = http::Response<B>>,
    S::Error: Into<BoxError>,
{
    type Response = http::Response<GrpcRejectionBody<B>>;
    type Error = BoxError;
    type Future = ResponseFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, req: Req) -> Self::Future {
        ResponseFuture {
            inner: self.inner.call(req),
        }
    }
}

pin_project! {
    /// Response future of [`GrpcRejection`].
    pub struct ResponseFuture<F> {
        #[pin]
        inner: F,
    }
}

impl<F, B, E> Future for ResponseFuture<F>
where
    F: Future<Output = Result<http::Response<B>, E>>,
    E: Into<BoxError>,
{
    type Output = Result<http::Response<GrpcRejectionBody<B>>, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        Poll::Ready(match ready!(self.project().inner.poll(cx)) {
            Ok(response) => Ok(response.map(GrpcRejectionBody::new)),
            Err(error) => {
                let error = error.into();
                match Rejection::from_error(&*error) {
                    Some(rejection) => Ok(trailers_only(&Status::from(rejection))),
                    None => Err(error),
                }
            }
        })
    }
}

impl<F> fmt::Debug for ResponseFuture<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

pin_project! {
    /// The response body of [`GrpcRejection`]: the inner service's body, or none for a
    /// rejection (whose status is in the headers).
    pub struct GrpcRejectionBody<B> {
        #[pin]
        kind: Kind<B>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<B> {
        Inner { #[pin] inner: B },
        Empty,
    }
}

impl<B> GrpcRejectionBody<B> {
    fn new(inner: B) -> Self {
        GrpcRejectionBody {
            kind: Kind::Inner { inner },
        }
    }

    fn empty() -> Self {
        GrpcRejectionBody { kind: Kind::Empty }
    }

    /// Whether this is the empty body of a rejection.
    pub fn is_rejection(&self) -> bool {
        matches!(self.kind, Kind::Empty)
    }
}

impl<B: Body> Body for GrpcRejectionBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        match self.project().kind.project() {
            KindProj::Inner { inner } => inner.poll_frame(cx),
            KindProj::Empty => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Inner { inner } => inner.is_end_stream(),
            Kind::Empty => true,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Inner { inner } => inner.size_hint(),
            Kind::Empty => SizeHint::with_exact(0),
        }
    }
}

impl<B> fmt::Debug for GrpcRejectionBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self.kind {
            Kind::Inner { .. } => "inner",
            Kind::Empty => "rejection",
        };
        f.debug_struct("GrpcRejectionBody")
            .field("kind", &kind)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::drr_fairness::error::QueueFull;
    use crate::extract::Unidentified;
    use crate::{Busy, MissingJob, Priority, TenantId, Tier};
    use tower::{ServiceExt, service_fn};

    fn busy() -> Busy {
        Busy::new(
            Tier::new("guest"),
            Duration::ZERO,
            Duration::from_millis(4_200),
        )
    }

    fn meta<'a>(status: &'a Status, key: &str) -> Option<&'a str> {
        status.metadata().get(key).and_then(|v| v.to_str().ok())
    }

    #[test]
    fn every_rejection_has_its_code_and_retry_metadata() {
        let status = Status::from(Rejection::Busy(busy()));
        assert_eq!(status.code(), Code::Unavailable);
        assert!(status.message().starts_with("server busy"));
        assert_eq!(meta(&status, RETRY_AFTER_MS), Some("4200"));
        assert_eq!(meta(&status, GRPC_RETRY_PUSHBACK_MS), Some("4200"));

        let full = QueueFull::new(Priority::Batch, TenantId::new("t"), true);
        let status = Status::from(Rejection::QueueFull(full));
        assert_eq!(status.code(), Code::ResourceExhausted);
        assert_eq!(meta(&status, RETRY_AFTER_MS), Some("1000"));

        let status = Status::from(Rejection::Unidentified(Unidentified::new("no api key")));
        assert_eq!(status.code(), Code::Unauthenticated);
        assert_eq!(meta(&status, RETRY_AFTER_MS), None);
        assert_eq!(meta(&status, GRPC_RETRY_PUSHBACK_MS), Some("-1"));

        let status = Status::from(Rejection::MissingJob(MissingJob));
        assert_eq!(status.code(), Code::Internal);
    }

    #[test]
    fn other_errors_are_unavailable_and_statuses_stay_themselves() {
        let err: BoxError = busy().into();
        let status = status(&err);
        assert_eq!(status.code(), Code::Unavailable);
        assert!(
            std::error::Error::source(&status).is_some_and(|s| s.is::<Rejection>()),
            "the rejection is the status's source"
        );

        let err: BoxError = "connection reset by 10.0.0.7".into();
        let other = super::status(&err);
        assert_eq!(other.code(), Code::Unavailable);
        assert!(!other.message().contains("10.0.0.7"), "no upstream detail");

        let err: BoxError = Status::permission_denied("nope").into();
        let own = super::status(&err);
        assert_eq!(own.code(), Code::PermissionDenied);
        assert_eq!(own.message(), "nope");
    }

    #[tokio::test]
    async fn a_rejection_becomes_a_trailers_only_response_and_other_errors_pass() {
        let refusing = GrpcRejectionLayer::new().layer(service_fn(|_: ()| async {
            Err::<http::Response<String>, BoxError>(busy().into())
        }));
        let response = refusing.oneshot(()).await.unwrap();
        assert_eq!(response.status(), 200);
        assert!(response.body().is_rejection());
        assert!(response.body().is_end_stream());
        let status = Status::from_header_map(response.headers()).unwrap();
        assert_eq!(status.code(), Code::Unavailable);
        assert_eq!(meta(&status, RETRY_AFTER_MS), Some("4200"));
        assert_eq!(response.headers()["content-type"], "application/grpc");

        let failing = GrpcRejectionLayer::new().layer(service_fn(|_: ()| async {
            Err::<http::Response<String>, BoxError>("connection reset".into())
        }));
        let err = failing.oneshot(()).await.unwrap_err();
        assert_eq!(err.to_string(), "connection reset");
    }
}
