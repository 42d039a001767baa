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
use crate::error::{BoxError, MissingJob};

/// The wait for a slot, boxed: it only exists when a request has to wait (or on Redis,
/// where the acquire is a round trip anyway), never on the uncontended in-process path.
pub(super) type Wait = Pin<Box<dyn Future<Output = Result<SlotPermit, Busy>> + Send>>;

pin_project! {
    /// Response future of [`TierSlotLimit`](crate::TierSlotLimit): waits for a slot, then for
    /// the inner service, calls it, and moves the slot into the response.
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
            match this.state.as_mut().project() {
                StateProj::Waiting { wait } => {
                    let permit = ready!(wait.as_mut().poll(cx))?;
                    *this.permit = Some(permit);
                    this.state.set(State::Ready);
                }
                StateProj::Ready => {
                    let (inner, _) = this.call.as_mut().expect("polled after completion");
                    // Dropping the future here (e.g. a timeout) drops the permit with it.
                    ready!(inner.poll_ready(cx)).map_err(Into::into)?;
                    let (mut inner, req) = this.call.take().expect("polled after completion");
                    let fut = inner.call(req);
                    this.state.set(State::Calling { fut });
                }
                StateProj::Calling { fut } => {
                    // On an error the permit drops here, with the future's state.
                    let response = ready!(fut.poll(cx)).map_err(Into::into)?;
                    let permit = this.permit.take().expect("polled after completion");
                    return Poll::Ready(Ok(response.guard(permit)));
                }
                StateProj::Failed { error } => {
                    let error = error.take().expect("polled after completion");
                    return Poll::Ready(Err(error));
                }
            }
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
        };
        f.debug_struct("ResponseFuture")
            .field("state", &state)
            .field("permit", &self.permit)
            .finish()
    }
}
