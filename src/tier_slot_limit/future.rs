//! The future of [`TierSlotLimit`](crate::TierSlotLimit).

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use pin_project_lite::pin_project;
use tower_service::Service;

use super::Busy;
use super::wait::SlotPermit;
use crate::body::GuardResponse;
use crate::error::{BoxError, MissingJob, PolledAfterCompletion};

/// The wait for a slot, boxed: it only exists when a request has to wait (or on Redis,
/// where the acquire is a round trip anyway), never on the uncontended in-process path.
pub(super) type Wait = Pin<Box<dyn Future<Output = Result<SlotPermit, Busy>> + Send>>;

pin_project! {
    /// Response future of [`TierSlotLimit`](crate::TierSlotLimit): waits for a slot, then for
    /// the inner service, calls it, and moves the slot into the response.
    ///
    /// Polled again after it completed, it returns [`PolledAfterCompletion`].
    pub struct ResponseFuture<S, Req>
    where
        S: Service<Req>,
    {
        #[pin]
        state: State<S::Future>,
        call: Option<(S, Req)>,
        permit: Option<SlotPermit>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<F> {
        Waiting { wait: Wait },
        Ready,
        Calling { #[pin] fut: F },
        Failed { error: Option<BoxError> },
        Done,
    }
}

impl<S: Service<Req>, Req> ResponseFuture<S, Req> {
    pub(super) fn waiting(wait: Wait, inner: S, req: Req) -> Self {
        ResponseFuture {
            state: State::Waiting { wait },
            call: Some((inner, req)),
            permit: None,
        }
    }

    pub(super) fn acquired(permit: SlotPermit, inner: S, req: Req) -> Self {
        ResponseFuture {
            state: State::Ready,
            call: Some((inner, req)),
            permit: Some(permit),
        }
    }

    pub(super) fn busy(busy: Busy) -> Self {
        Self::failed(busy.into())
    }

    pub(super) fn missing_job() -> Self {
        Self::failed(MissingJob.into())
    }

    fn failed(error: BoxError) -> Self {
        ResponseFuture {
            state: State::Failed { error: Some(error) },
            call: None,
            permit: None,
        }
    }
}

impl<S, Req> Future for ResponseFuture<S, Req>
where
    S: Service<Req>,
    S::Error: Into<BoxError>,
    S::Response: GuardResponse<SlotPermit>,
{
    type Output = Result<<S::Response as GuardResponse<SlotPermit>>::Output, BoxError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        loop {
            let mut this = self.as_mut().project();
            let output = match this.state.as_mut().project() {
                StateProj::Waiting { wait } => match ready!(wait.as_mut().poll(cx)) {
                    Ok(permit) => {
                        *this.permit = Some(permit);
                        this.state.set(State::Ready);
                        continue;
                    }
                    Err(busy) => Err(busy.into()),
                },
                StateProj::Ready => {
                    let Some((inner, _)) = this.call.as_mut() else {
                        this.state.set(State::Done);
                        return Poll::Ready(Err(PolledAfterCompletion.into()));
                    };
                    // Dropping the future here (e.g. a timeout) drops the permit with it.
                    match ready!(inner.poll_ready(cx)) {
                        Ok(()) => match this.call.take() {
                            Some((mut inner, req)) => {
                                let fut = inner.call(req);
                                this.state.set(State::Calling { fut });
                                continue;
                            }
                            None => Err(PolledAfterCompletion.into()),
                        },
                        Err(e) => Err(e.into()),
                    }
                }
                StateProj::Calling { fut } => match ready!(fut.poll(cx)) {
                    Ok(response) => match this.permit.take() {
                        Some(permit) => Ok(response.guard(permit)),
                        None => Err(PolledAfterCompletion.into()),
                    },
                    // On an error the permit drops with the future.
                    Err(e) => Err(e.into()),
                },
                StateProj::Failed { error } => {
                    Err(error.take().unwrap_or_else(|| PolledAfterCompletion.into()))
                }
                StateProj::Done => Err(PolledAfterCompletion.into()),
            };
            this.state.set(State::Done);
            return Poll::Ready(output);
        }
    }
}

impl<S: Service<Req>, Req> fmt::Debug for ResponseFuture<S, Req> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match &self.state {
            State::Waiting { .. } => "waiting for a slot",
            State::Ready => "waiting for the inner service",
            State::Calling { .. } => "calling",
            State::Failed { .. } => "failed",
            State::Done => "done",
        };
        f.debug_struct("ResponseFuture")
            .field("state", &state)
            .field("permit", &self.permit)
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
