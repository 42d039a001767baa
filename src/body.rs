//! Holding a permit or a lease for as long as a response streams.
//!
//! LLM answers usually stream (server-sent events): the call is not over when the headers
//! arrive but when the body ends. The limiting layers therefore move what they hold into the
//! response: for an `http::Response<B>` into its body ([`GuardedBody`]), released when the
//! body ends, fails or is dropped. Other response types implement [`GuardResponse`]; the
//! impls here for plain values release at once, when the response is produced.

use std::pin::Pin;
use std::task::{Context, Poll, ready};

use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

pin_project! {
    /// A response body that holds a guard (a concurrency permit, a slot lease) until the
    /// body ends, errors or is dropped.
    #[derive(Debug)]
    pub struct GuardedBody<B, G> {
        #[pin]
        inner: B,
        guard: Option<G>,
    }
}

impl<B, G> GuardedBody<B, G> {
    /// Wraps `inner`, holding `guard` until it is done.
    pub fn new(inner: B, guard: G) -> Self {
        GuardedBody {
            inner,
            guard: Some(guard),
        }
    }

    /// The wrapped body.
    pub fn inner(&self) -> &B {
        &self.inner
    }

    /// Whether the guard is still held.
    pub fn is_holding(&self) -> bool {
        self.guard.is_some()
    }
}

impl<B: Body, G> Body for GuardedBody<B, G> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = self.project();
        let mut inner = this.inner;
        let frame = ready!(inner.as_mut().poll_frame(cx));
        let done = match &frame {
            None | Some(Err(_)) => true,
            Some(Ok(_)) => inner.is_end_stream(),
        };
        if done {
            this.guard.take();
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// A response that can keep a guard alive until it has been consumed.
///
/// Implemented for `http::Response<B>` (the guard moves into the body) and, releasing at
/// once, for `()`, `String` and `Vec<u8>`. Implement it for your own response type to use
/// the limiting layers with it.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot hold a fairgate permit or slot until it is consumed",
    label = "not a response the limiting layers can guard",
    note = "the limiting layers need `http::Response<B>` (the guard moves into the body) or `()`, `String`, `Vec<u8>`; implement `fairgate::body::GuardResponse<G>` for your response type"
)]
pub trait GuardResponse<G>: Sized {
    /// The response with the guard inside.
    type Output;

    /// Moves `guard` into the response.
    fn guard(self, guard: G) -> Self::Output;
}

impl<B, G> GuardResponse<G> for http::Response<B> {
    type Output = http::Response<GuardedBody<B, G>>;

    fn guard(self, guard: G) -> Self::Output {
        self.map(|body| GuardedBody::new(body, guard))
    }
}

macro_rules! release_at_once {
    ($($ty:ty),*) => {$(
        impl<G> GuardResponse<G> for $ty {
            type Output = $ty;

            fn guard(self, guard: G) -> Self::Output {
                drop(guard);
                self
            }
        }
    )*};
}

release_at_once!((), String, Vec<u8>);
