//! The future of [`TierSlotLimit`](crate::TierSlotLimit).

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use pin_project_lite::pin_project;
use tower_service::Service;

use super::Busy;
use super::wait::SlotPermit;
use crate::JobRequest;
use crate::body::GuardResponse;
use crate::error::{BoxError, MissingJob};
use crate::guarded::{GuardedCall, Turn};

/// The wait for a slot: the whole acquire, retries and patience included.
pub(super) type Wait = Pin<Box<dyn Future<Output = Result<SlotPermit, Busy>> + Send>>;

impl Turn for Wait {
    type Permit = SlotPermit;

    fn poll_turn(&mut self, cx: &mut Context<'_>) -> Poll<Result<SlotPermit, BoxError>> {
        self.as_mut().poll(cx).map_err(Into::into)
    }
}

pin_project! {
    /// Response future of [`TierSlotLimit`](crate::TierSlotLimit): waits for a slot, then
    /// for the inner service, calls it, and moves the [`SlotPermit`] into the response.
    ///
    /// Polled again after it completed, it returns
    /// [`PolledAfterCompletion`](crate::error::PolledAfterCompletion).
    pub struct ResponseFuture<S, Req>
    where
        S: Service<Req>,
    {
        #[pin]
        call: GuardedCall<Wait, S::Future, S, Req>,
    }
}

impl<S: Service<Req>, Req> ResponseFuture<S, Req> {
    pub(super) fn new(call: GuardedCall<Wait, S::Future, S, Req>) -> Self {
        ResponseFuture { call }
    }

    pub(super) fn busy(busy: Busy) -> Self {
        let call = GuardedCall::failed(busy.into());
        ResponseFuture { call }
    }

    pub(super) fn missing_job() -> Self {
        let call = GuardedCall::failed(MissingJob.into());
        ResponseFuture { call }
    }
}

impl<S, Req> Future for ResponseFuture<S, Req>
where
    S: Service<Req>,
    S::Error: Into<BoxError>,
    S::Response: GuardResponse<SlotPermit>,
    Req: JobRequest,
{
    type Output = Result<<S::Response as GuardResponse<SlotPermit>>::Output, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.project().call.poll(cx)
    }
}

impl<S: Service<Req>, Req> fmt::Debug for ResponseFuture<S, Req> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture")
            .field("state", &self.call.phase())
            .finish()
    }
}
#[cfg(test)]
mod tests {
    use crate::{SlotPolicy, Store, TierSlotLimitLayer};

    #[tokio::test]
    async fn a_poll_after_completion_is_an_error() {
        crate::error::answers_once(TierSlotLimitLayer::new(
            Store::memory(),
            SlotPolicy::default(),
        ))
        .await;
    }
}
