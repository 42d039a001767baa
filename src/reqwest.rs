//! The stack as a [`reqwest_middleware`] middleware: a `reqwest` client whose calls are
//! admitted by fairgate.
//!
//! [`FairgateMiddleware`] runs each request through the same four layers as
//! [`FairgateLayer`], with the rest of the middleware chain (and in the end the `reqwest`
//! client) as the service they wrap. Each request says who it is for with a [`Job`] in
//! reqwest-middleware's extensions (`.with_extension(job)`); a request without one fails
//! with [`MissingJob`] and is not sent.
//!
//! ```
//! use fairgate::reqwest::FairgateMiddleware;
//! use fairgate::reject::Rejection;
//! use fairgate::{Job, Origin, Store};
//! use reqwest_middleware::ClientBuilder;
//!
//! # #[derive(Clone)]
//! # struct Upstream;
//! # #[async_trait::async_trait]
//! # impl reqwest_middleware::Middleware for Upstream {
//! #     async fn handle(
//! #         &self,
//! #         _: reqwest::Request,
//! #         _: &mut http::Extensions,
//! #         _: reqwest_middleware::Next<'_>,
//! #     ) -> reqwest_middleware::Result<reqwest::Response> {
//! #         Ok(http::Response::new("{\"content\":[]}").into())
//! #     }
//! # }
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), fairgate::BoxError> {
//! let store = Store::memory();
//! let claude = ClientBuilder::new(reqwest::Client::new())
//!     .with(FairgateMiddleware::new(store.clone()))
//! #   .with(Upstream) // answers here instead of the network
//!     .build();
//!
//! let prompt = r#"{"model":"claude-sonnet-4-5","max_tokens":64,"messages":[]}"#;
//! let job = Job::new("tenant-42", Origin::UserAction).with_tier("pro").with_input_text(prompt);
//! let response = claude
//!     .post("http://127.0.0.1:1/v1/messages")
//!     .body(prompt)
//!     .with_extension(job)
//!     .send()
//!     .await?;
//! assert_eq!(response.status(), 200);
//! assert_eq!(store.slots_in_use(None).await, 1); // held until the body is read
//! let _answer = response.text().await?;
//! assert_eq!(store.slots_in_use(None).await, 0);
//!
//! // A request without a job is refused before it is sent.
//! let err = claude.get("http://127.0.0.1:1/v1/models").send().await.unwrap_err();
//! assert!(matches!(Rejection::from_error(&err), Some(Rejection::MissingJob(_))));
//! # Ok(())
//! # }
//! ```
//!
//! # How it runs
//!
//! - **Retries rebuild the request.** A `reqwest::Body` is not `Clone`, so the request is not
//!   converted to an `http::Request` on the way in: it travels through the layers as it is,
//!   with its job beside it, and a retry gets its copy from [`reqwest::Request::try_clone`]
//!   — no copy of the bytes for a body in memory (`.body(String)`, `.body(Vec<u8>)`,
//!   `.json(..)`). A streaming body (`Body::wrap_stream`) cannot be copied: such a request
//!   is sent once, and its answer, whatever it says, goes back to the caller. A
//!   [`FairgateLayer`] passed to [`FairgateMiddleware::from_layer`] keeps its policies, but
//!   requests are always copied this way (its own request cloner is not used).
//! - **The slot lives in the response.** The answer comes back from the inner service as an
//!   `http::Response`, the layers move the window permit and the tier slot into its body
//!   ([`FairgateBody`](crate::FairgateBody)), and that body becomes the body of the
//!   `reqwest::Response` the caller gets ([`reqwest::Body::wrap`]): a streaming answer holds
//!   its slot until it has been read to the end, fails, or the response is dropped — not only
//!   until its headers arrived. The response keeps its URL, headers and extensions.
//! - **Extensions.** The middlewares after this one see the request's extensions, and what
//!   they add is there for the caller afterwards, as with any middleware; each attempt of a
//!   retried request sees what the previous one left.
//! - **Errors.** What the rest of the chain returns comes back unchanged (a
//!   `reqwest_middleware::Error::Reqwest` stays one). What fairgate refused is a
//!   `reqwest_middleware::Error::Middleware` holding a [`NotAdmitted`] whose source is the
//!   rejection, so [`Rejection::from_error`](crate::reject::Rejection::from_error) finds it
//!   directly on the `reqwest_middleware::Error`.
//!
//! Put it first in the chain: middlewares before it run once per call, those after it once
//! per attempt, while the attempt holds its slot. It already retries 429 and 529 by their
//! `retry-after`, without holding a slot while it waits; a reqwest-retry
//! `RetryTransientMiddleware` after it would retry those again with the slot held, so give
//! that one a strategy that leaves 429 and 529 alone (e.g. for connection errors only).

use std::fmt;
use std::future::Future;
use std::mem;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use ::reqwest::{Request, Response, ResponseBuilderExt};
use http::Extensions;
use reqwest_middleware::{Middleware, Next};
use tower::ServiceExt;
use tower_layer::Layer;
use tower_service::Service;

use crate::reject::Rejection;
use crate::retry_after_backoff::CloneRequest;
use crate::stack::FairgateLayer;
use crate::sync::lock;
use crate::{
    BoxError, ClassifyRule, DefaultRule, DrrFairnessLayer, Job, JobRequest, MissingJob, Store,
};

/// Admits each call of a `reqwest_middleware` client through the fairgate stack; see the
/// [module docs](crate::reqwest).
///
/// # Clone
/// Cheap; clones share the stack's state (the window, the queues, the caps, the gate), as
/// every clone of a [`FairgateLayer`] does.
pub struct FairgateMiddleware<R = DefaultRule> {
    layer: FairgateLayer<TryClone, R>,
}

impl FairgateMiddleware {
    /// The recommended stack with its defaults on `store` ([`FairgateLayer::new`]).
    pub fn new(store: Store) -> Self {
        FairgateMiddleware::from_layer(FairgateLayer::new(store))
    }
}

impl<R> FairgateMiddleware<R> {
    /// The stack `layer` configures (its store, policies and rule). Requests are copied for a
    /// retry with [`reqwest::Request::try_clone`], whatever cloner `layer` had.
    pub fn from_layer<C>(layer: FairgateLayer<C, R>) -> Self {
        FairgateMiddleware {
            layer: layer.clone_requests_with(TryClone),
        }
    }

    /// The store the stack shares.
    pub fn store(&self) -> &Store {
        self.layer.store()
    }

    /// The fair queue: requests in flight and waiting, the fairness index.
    pub fn fairness(&self) -> &DrrFairnessLayer {
        self.layer.fairness()
    }

    /// A handle to settle requests' real usage against their tenants' deficits.
    pub fn settler(&self) -> crate::drr_fairness::Settler {
        self.layer.settler()
    }
}

impl<C, R> From<FairgateLayer<C, R>> for FairgateMiddleware<R> {
    fn from(layer: FairgateLayer<C, R>) -> Self {
        FairgateMiddleware::from_layer(layer)
    }
}

impl<R> Clone for FairgateMiddleware<R> {
    fn clone(&self) -> Self {
        FairgateMiddleware {
            layer: self.layer.clone(),
        }
    }
}

impl<R> fmt::Debug for FairgateMiddleware<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FairgateMiddleware")
            .field("layer", &self.layer)
            .finish()
    }
}

#[async_trait::async_trait]
impl<R: ClassifyRule> Middleware for FairgateMiddleware<R> {
    async fn handle(
        &self,
        request: Request,
        extensions: &mut Extensions,
        next: Next<'_>,
    ) -> reqwest_middleware::Result<Response> {
        let Some(job) = extensions.get::<Job>().cloned() else {
            return Err(not_admitted(MissingJob.into()));
        };
        // Lent to the rest of the chain for each attempt, and given back to the caller.
        let home = Arc::new(Mutex::new(mem::take(extensions)));
        let stack = self.layer.layer(Downstream {
            next,
            extensions: home.clone(),
        });
        let result = stack.oneshot(Outgoing { request, job }).await;
        *extensions = mem::take(&mut *lock(&home));
        match result {
            Ok(response) => Ok(Response::from(response.map(::reqwest::Body::wrap))),
            Err(error) => Err(match error.downcast::<reqwest_middleware::Error>() {
                Ok(downstream) => *downstream,
                Err(refused) => not_admitted(refused),
            }),
        }
    }
}

fn not_admitted(source: BoxError) -> reqwest_middleware::Error {
    reqwest_middleware::Error::middleware(NotAdmitted { source })
}

/// Fairgate did not admit a request sent through [`FairgateMiddleware`]: it is in
/// `reqwest_middleware::Error::Middleware`, and its source is the rejection ([`Busy`](crate::Busy),
/// [`QueueFull`](crate::drr_fairness::error::QueueFull), [`MissingJob`]). Nothing was sent.
///
/// [`Rejection::from_error`] finds the rejection on the `reqwest_middleware::Error` itself.
#[derive(Debug)]
pub struct NotAdmitted {
    source: BoxError,
}

impl NotAdmitted {
    /// What refused the request.
    pub fn rejection(&self) -> Option<Rejection> {
        Rejection::from_error(&*self.source)
    }

    /// The error the stack returned.
    pub fn into_inner(self) -> BoxError {
        self.source
    }
}

impl fmt::Display for NotAdmitted {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("request not admitted by fairgate")
    }
}

impl std::error::Error for NotAdmitted {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&*self.source)
    }
}

/// A request on its way through the layers: the `reqwest::Request` as the caller built it,
/// and its job.
struct Outgoing {
    request: Request,
    job: Job,
}

impl JobRequest for Outgoing {
    fn job(&self) -> Option<&Job> {
        Some(&self.job)
    }

    fn job_mut(&mut self) -> Option<&mut Job> {
        Some(&mut self.job)
    }
}

/// Copies a request for a retry with `reqwest::Request::try_clone`: a body in memory is
/// shared, not copied; a streaming body cannot be, and its request is sent once.
#[derive(Clone, Copy, Debug)]
struct TryClone;

impl CloneRequest<Outgoing> for TryClone {
    fn clone_request(&self, req: &Outgoing) -> Option<Outgoing> {
        Some(Outgoing {
            request: req.request.try_clone()?,
            job: req.job.clone(),
        })
    }
}

/// The rest of the middleware chain, as the service the layers wrap.
#[derive(Clone)]
struct Downstream<'a> {
    next: Next<'a>,
    extensions: Arc<Mutex<Extensions>>,
}

type DownstreamFuture<'a> = Pin<
    Box<
        dyn Future<Output = Result<http::Response<::reqwest::Body>, reqwest_middleware::Error>>
            + Send
            + 'a,
    >,
>;

impl<'a> Service<Outgoing> for Downstream<'a> {
    type Response = http::Response<::reqwest::Body>;
    type Error = reqwest_middleware::Error;
    type Future = DownstreamFuture<'a>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, outgoing: Outgoing) -> Self::Future {
        let next = self.next.clone();
        let home = self.extensions.clone();
        Box::pin(async move {
            let mut lent = Lent::take(home);
            let response = next.run(outgoing.request, &mut lent.extensions).await?;
            drop(lent);
            Ok(into_http(response))
        })
    }
}

/// The extensions lent to one attempt; given back when it ends or is dropped.
struct Lent {
    extensions: Extensions,
    home: Arc<Mutex<Extensions>>,
}

impl Lent {
    fn take(home: Arc<Mutex<Extensions>>) -> Lent {
        let extensions = mem::take(&mut *lock(&home));
        Lent { extensions, home }
    }
}

impl Drop for Lent {
    fn drop(&mut self) {
        *lock(&self.home) = mem::take(&mut self.extensions);
    }
}

/// The `reqwest::Response` as an `http::Response`, keeping its URL for the way back.
fn into_http(response: Response) -> http::Response<::reqwest::Body> {
    let url = response.url().clone();
    let mut response = http::Response::<::reqwest::Body>::from(response);
    if let Ok(marked) = http::Response::builder().url(url).body(()) {
        response
            .extensions_mut()
            .extend(marked.into_parts().0.extensions);
    }
    response
}
