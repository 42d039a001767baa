//! The future of a layer that holds a place for its request: wait for the place (a
//! permit), then for the inner service, call it, and hand the permit to the response, which
//! keeps it until its body ends. [`DrrFairness`](crate::DrrFairness) and
//! [`TierSlotLimit`](crate::TierSlotLimit) both answer with it.
//!
//! Every way out ends in `Done`: a poll after the output was given answers
//! [`PolledAfterCompletion`], never panics.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use pin_project_lite::pin_project;
use tower_service::Service;

use crate::JobRequest;
use crate::body::GuardResponse;
use crate::error::{BoxError, PolledAfterCompletion};

/// A wait for a request's place.
pub(crate) trait Turn {
    /// What holds the place.
    type Permit;

    /// Ready with the permit once the place is the request's, or with why it never will be.
    fn poll_turn(&mut self, cx: &mut Context<'_>) -> Poll<Result<Self::Permit, BoxError>>;

    /// `req` is about to be sent with `permit` (nothing to do by default).
    fn going<Req: JobRequest>(_permit: &mut Self::Permit, _req: &Req) {}
}

pin_project! {
    /// Wait for the turn, then for the inner service, then the call; the response keeps
    /// the permit.
    pub(crate) struct GuardedCall<W, F, S, Req>
    where
        W: Turn,
    {
        #[pin]
        state: State<W, W::Permit, F, S, Req>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<W, P, F, S, Req> {
        Waiting { turn: W, call: Option<(S, Req)> },
        Ready { permit: Option<P>, call: Option<(S, Req)> },
        Calling { #[pin] fut: F, permit: Option<P> },
        Failed { error: Option<BoxError> },
        Done,
    }
}

impl<W: Turn, F, S, Req> GuardedCall<W, F, S, Req> {
    /// The request waits for its turn.
    pub(crate) fn waiting(turn: W, inner: S, req: Req) -> Self {
        let state = State::Waiting {
            turn,
            call: Some((inner, req)),
        };
        GuardedCall { state }
    }

    /// The request holds its place already.
    pub(crate) fn ready(permit: W::Permit, inner: S, req: Req) -> Self {
        let state = State::Ready {
            permit: Some(permit),
            call: Some((inner, req)),
        };
        GuardedCall { state }
    }

    /// The request was refused before it waited.
    pub(crate) fn failed(error: BoxError) -> Self {
        let state = State::Failed { error: Some(error) };
        GuardedCall { state }
    }

    /// What the future is doing, for `Debug`.
    pub(crate) fn phase(&self) -> &'static str {
        match self.state {
            State::Waiting { .. } => "waiting for its turn",
            State::Ready { .. } => "waiting for the inner service",
            State::Calling { .. } => "calling",
            State::Failed { .. } => "failed",
            State::Done => "done",
        }
    }
}

impl<W, F, S, Req, T, E> Future for GuardedCall<W, F, S, Req>
where
    W: Turn,
    F: Future<Output = Result<T, E>>,
    E: Into<BoxError>,
    S: Service<Req, Future = F, Response = T, Error = E>,
    T: GuardResponse<W::Permit>,
    Req: JobRequest,
{
    type Output = Result<T::Output, BoxError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        loop {
            let mut this = self.as_mut().project();
            let output = match this.state.as_mut().project() {
                StateProj::Waiting { turn, call } => match ready!(turn.poll_turn(cx)) {
                    Ok(permit) => {
                        // The turn gave its place up when it became the permit: dropping
                        // it with the state does nothing.
                        let call = call.take();
                        let permit = Some(permit);
                        this.state.set(State::Ready { permit, call });
                        continue;
                    }
                    Err(error) => Err(error),
                },
                StateProj::Ready { permit, call } => match call.as_mut() {
                    None => Err(PolledAfterCompletion.into()),
                    Some((inner, _)) => match ready!(inner.poll_ready(cx)) {
                        // The permit goes back with the state.
                        Err(e) => Err(e.into()),
                        Ok(()) => match (permit.take(), call.take()) {
                            (Some(mut permit), Some((mut inner, req))) => {
                                W::going(&mut permit, &req);
                                let fut = inner.call(req);
                                let permit = Some(permit);
                                this.state.set(State::Calling { fut, permit });
                                continue;
                            }
                            _ => Err(PolledAfterCompletion.into()),
                        },
                    },
                },
                StateProj::Calling { fut, permit } => {
                    let output = ready!(fut.poll(cx));
                    match (output, permit.take()) {
                        (Ok(response), Some(permit)) => Ok(response.guard(permit)),
                        (Ok(_), None) => Err(PolledAfterCompletion.into()),
                        // The permit is dropped with the error: given back at once.
                        (Err(e), _) => Err(e.into()),
                    }
                }
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
