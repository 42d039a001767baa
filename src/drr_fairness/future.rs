//! The future of [`DrrFairness`](crate::DrrFairness).

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use pin_project_lite::pin_project;
use tower_service::Service;

use super::state::{Permit, Ticket};
use crate::body::GuardResponse;
use crate::error::{BoxError, PolledAfterCompletion};

pin_project! {
    /// Response future of [`DrrFairness`](crate::DrrFairness): waits for the request's
    /// turn, then for the inner service's readiness, then for its response, into which it
    /// moves the permit ([`GuardResponse`]).
    ///
    /// Dropped while waiting, the request leaves the queue; dropped later, the permit is
    /// given back. Either way nothing leaks. Polled again after it completed, it returns
    /// [`PolledAfterCompletion`].
    pub struct ResponseFuture<F, S, Req> {
        #[pin]
        state: State<F, S, Req>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<F, S, Req> {
        Waiting {
            ticket: Ticket,
            call: Option<(S, Req)>,
        },
        Ready {
            permit: Option<Permit>,
            call: Option<(S, Req)>,
        },
        Calling {
            #[pin]
            fut: F,
            permit: Option<Permit>,
        },
        Failed {
            error: Option<BoxError>,
        },
        Done,
    }
}

impl<F, S, Req> ResponseFuture<F, S, Req> {
    pub(super) fn waiting(ticket: Ticket, inner: S, req: Req) -> Self {
        ResponseFuture {
            state: State::Waiting {
                ticket,
                call: Some((inner, req)),
            },
        }
    }

    pub(super) fn ready(permit: Permit, inner: S, req: Req) -> Self {
        ResponseFuture {
            state: State::Ready {
                permit: Some(permit),
                call: Some((inner, req)),
            },
        }
    }

    pub(super) fn failed(error: BoxError) -> Self {
        ResponseFuture {
            state: State::Failed { error: Some(error) },
        }
    }
}

impl<F, S, Req, T, E> Future for ResponseFuture<F, S, Req>
where
    F: Future<Output = Result<T, E>>,
    E: Into<BoxError>,
    S: Service<Req, Future = F, Response = T, Error = E>,
    T: GuardResponse<Permit>,
    Req: crate::JobRequest,
{
    type Output = Result<T::Output, BoxError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        loop {
            let mut this = self.as_mut().project();
            match this.state.as_mut().project() {
                StateProj::Waiting { ticket, call } => {
                    let permit = match ready!(ticket.poll_turn(cx)) {
                        Ok(permit) => permit,
                        Err(busy) => {
                            this.state.set(State::Done);
                            return Poll::Ready(Err(busy.into()));
                        }
                    };
                    let call = call.take();
                    // The ticket gave its place up when it became the permit: dropping it
                    // here does nothing.
                    this.state.set(State::Ready {
                        permit: Some(permit),
                        call,
                    });
                }
                StateProj::Ready { permit, call } => {
                    let Some((inner, _)) = call.as_mut() else {
                        this.state.set(State::Done);
                        return Poll::Ready(Err(PolledAfterCompletion.into()));
                    };
                    if let Err(e) = ready!(inner.poll_ready(cx)) {
                        // The permit goes back with the state.
                        this.state.set(State::Done);
                        return Poll::Ready(Err(e.into()));
                    }
                    let mut permit = permit.take();
                    let Some((mut inner, req)) = call.take() else {
                        this.state.set(State::Done);
                        return Poll::Ready(Err(PolledAfterCompletion.into()));
                    };
                    if let Some(permit) = permit.as_mut() {
                        permit.going(req.job());
                    }
                    let fut = inner.call(req);
                    this.state.set(State::Calling { fut, permit });
                }
                StateProj::Calling { fut, permit } => {
                    let output = ready!(fut.poll(cx));
                    let permit = permit.take();
                    this.state.set(State::Done);
                    return Poll::Ready(match (output, permit) {
                        (Ok(response), Some(permit)) => Ok(response.guard(permit)),
                        (Ok(_), None) => Err(PolledAfterCompletion.into()),
                        // The permit was dropped with the error: released at once.
                        (Err(e), _) => Err(e.into()),
                    });
                }
                StateProj::Failed { error } => {
                    let error = error.take();
                    this.state.set(State::Done);
                    return Poll::Ready(Err(error.unwrap_or_else(|| PolledAfterCompletion.into())));
                }
                StateProj::Done => return Poll::Ready(Err(PolledAfterCompletion.into())),
            }
        }
    }
}

impl<F, S, Req> fmt::Debug for ResponseFuture<F, S, Req> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match &self.state {
            State::Waiting { .. } => "waiting",
            State::Ready { .. } => "ready",
            State::Calling { .. } => "calling",
            State::Failed { .. } => "failed",
            State::Done => "done",
        };
        f.debug_struct("ResponseFuture")
            .field("state", &state)
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
