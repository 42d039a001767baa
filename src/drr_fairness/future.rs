//! The future of [`DrrFairness`](crate::DrrFairness).

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use pin_project_lite::pin_project;
use tower_service::Service;

use super::state::{Permit, Ticket};
use crate::JobRequest;
use crate::body::GuardResponse;
use crate::error::BoxError;
use crate::guarded::{GuardedCall, Turn};

pin_project! {
    /// Response future of [`DrrFairness`](crate::DrrFairness): waits for the request's
    /// turn in the fair order, then for the inner service's readiness, then for its
    /// response, into which it moves the [`Permit`] ([`GuardResponse`]).
    ///
    /// Dropped while waiting, the request leaves the queue; dropped later, the permit is
    /// given back. Either way nothing leaks. Polled again after it completed, it returns
    /// [`PolledAfterCompletion`](crate::error::PolledAfterCompletion).
    pub struct ResponseFuture<F, S, Req> {
        #[pin]
        call: GuardedCall<Ticket, F, S, Req>,
    }
}

impl Turn for Ticket {
    type Permit = Permit;

    fn poll_turn(&mut self, cx: &mut Context<'_>) -> Poll<Result<Permit, BoxError>> {
        Ticket::poll_turn(self, cx).map_err(Into::into)
    }

    fn going<Req: JobRequest>(permit: &mut Permit, req: &mut Req) {
        permit.going(|| req.job_mut());
    }

    fn waited(&self) -> Option<(crate::WaitReason, std::time::Duration)> {
        self.waited()
    }
}

impl<F, S, Req> ResponseFuture<F, S, Req> {
    pub(super) fn new(call: GuardedCall<Ticket, F, S, Req>) -> Self {
        ResponseFuture { call }
    }

    pub(super) fn failed(error: BoxError) -> Self {
        let call = GuardedCall::failed(error);
        ResponseFuture { call }
    }
}

impl<F, S, Req, T, E> Future for ResponseFuture<F, S, Req>
where
    F: Future<Output = Result<T, E>>,
    E: Into<BoxError>,
    S: Service<Req, Future = F, Response = T, Error = E>,
    T: GuardResponse<Permit>,
    Req: JobRequest,
{
    type Output = Result<T::Output, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.project().call.poll(cx)
    }
}

impl<F, S, Req> fmt::Debug for ResponseFuture<F, S, Req> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture")
            .field("state", &self.call.phase())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use crate::{DrrFairnessLayer, Store};

    #[tokio::test]
    async fn a_poll_after_completion_is_an_error() {
        crate::error::answers_once(
            DrrFairnessLayer::builder(Store::memory(), 1)
                .build()
                .unwrap(),
        )
        .await;
    }
}
