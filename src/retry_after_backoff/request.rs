use std::fmt;

/// How [`RetryAfterBackoff`](super::RetryAfterBackoff) gets a copy of a request to send
/// again, as `tower::retry::Policy::clone_request` does.
///
/// A request is cloned before its first attempt (the original is consumed by the call);
/// `None` means it cannot be, and it is sent once: its response goes back to the caller
/// whatever it says. Implementations:
///
/// - [`ByClone`] (the default): any `Req: Clone`, which includes `http::Request<B>` for any
///   `B: Clone` (`String`, `Bytes`, `Full<Bytes>`, ...);
/// - [`SendOnce`]: never retries; for request types that are not `Clone` (a streaming body);
/// - a closure `Fn(&Req) -> Option<Req>`, e.g. to copy a body that is buffered but not
///   `Clone`, or to refuse some requests.
///
/// ```
/// use fairgate::{RetryAfterBackoffLayer, Store};
/// use fairgate::BackoffPolicy;
///
/// let layer = RetryAfterBackoffLayer::new(Store::memory(), BackoffPolicy::default())
///     .clone_requests_with(|req: &http::Request<Vec<u8>>| {
///         // Only small bodies are kept for a retry.
///         (req.body().len() < 1 << 20).then(|| req.clone())
///     });
/// # let _ = layer;
/// ```
///
/// A stack over a request that cannot be copied does not compile, and says why
/// (``error[E0277]: `ByClone` cannot copy a `http::Request<Body>` for a retry``, with notes
/// naming the three ways out):
///
/// ```compile_fail
/// use fairgate::{BoxError, FairgateLayer, Store};
/// use tower::{Layer, ServiceExt, service_fn};
///
/// # async fn run() {
/// let handler = service_fn(|_req: http::Request<axum::body::Body>| async {
///     Ok::<_, BoxError>(http::Response::new(String::new()))
/// });
/// let stack = FairgateLayer::new(Store::memory()).layer(handler);
/// let _ = ServiceExt::oneshot(stack, http::Request::new(axum::body::Body::empty())).await;
/// # }
/// ```
///
/// The same with [`SendOnce`] compiles:
///
/// ```
/// use fairgate::retry_after_backoff::SendOnce;
/// use fairgate::{BoxError, FairgateLayer, Store};
/// use tower::{Layer, ServiceExt, service_fn};
///
/// # async fn run() {
/// let handler = service_fn(|_req: http::Request<axum::body::Body>| async {
///     Ok::<_, BoxError>(http::Response::new(String::new()))
/// });
/// let stack = FairgateLayer::new(Store::memory())
///     .clone_requests_with(SendOnce)
///     .layer(handler);
/// let _ = ServiceExt::oneshot(stack, http::Request::new(axum::body::Body::empty())).await;
/// # }
/// ```
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot copy a `{Req}` for a retry",
    label = "no way to copy this request for a retry",
    note = "the default `ByClone` needs a `Clone` request; `http::Request<B>` is `Clone` only when its body is, and a streaming body (axum's `Body`, hyper's `Incoming`) is not",
    note = "buffer the body first (into `Bytes`, `String` or `Full<Bytes>`), copy it with `.clone_requests_with(|req: &Req| ...)`, or send each request once with `.clone_requests_with(SendOnce)`"
)]
pub trait CloneRequest<Req>: Send + Sync + 'static {
    /// A copy of `req` to send again, or `None` if it cannot be sent again.
    fn clone_request(&self, req: &Req) -> Option<Req>;
}

/// Clones requests with `Clone` (the default).
#[derive(Clone, Copy, Debug, Default)]
pub struct ByClone;

impl<Req: Clone> CloneRequest<Req> for ByClone {
    fn clone_request(&self, req: &Req) -> Option<Req> {
        Some(req.clone())
    }
}

/// Never clones: every request is sent once (the layer still records throttles, holds calls
/// behind the cooldown gate and paces).
#[derive(Clone, Copy, Debug, Default)]
pub struct SendOnce;

impl<Req> CloneRequest<Req> for SendOnce {
    fn clone_request(&self, _: &Req) -> Option<Req> {
        None
    }
}

impl<F, Req> CloneRequest<Req> for F
where
    F: Fn(&Req) -> Option<Req> + Send + Sync + 'static,
{
    fn clone_request(&self, req: &Req) -> Option<Req> {
        self(req)
    }
}

pub(super) struct TypeName<C>(std::marker::PhantomData<C>);

impl<C> TypeName<C> {
    pub(super) fn new() -> Self {
        TypeName(std::marker::PhantomData)
    }
}

impl<C> fmt::Debug for TypeName<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(std::any::type_name::<C>())
    }
}
