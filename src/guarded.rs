//! The future of a layer that holds a place for its request: wait for the place (a
//! permit), then for the inner service, call it, and hand the permit to the response, which
//! keeps it until its body ends. [`DrrFairness`](crate::DrrFairness) and
//! [`TierSlotLimit`](crate::TierSlotLimit) both answer with it.
//!
//! Every way out ends in `Done`: a poll after the output was given answers
//! [`PolledAfterCompletion`], never panics.
//!
//! Such a layer answers ready whatever its inner service says (a request waits for its place
//! in the future, never in `poll_ready`), but asks the inner service ahead ([`Ahead`]): a
//! request whose place is its own at once is then sent from `call`, and its future only
//! waits for the answer.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use pin_project_lite::pin_project;
use tower_service::Service;

use crate::JobRequest;
use crate::admission::WaitReason;
use crate::body::GuardResponse;
use crate::error::{BoxError, PolledAfterCompletion};

/// A wait for a request's place.
pub(crate) trait Turn {
    /// What holds the place.
    type Permit;

    /// Ready with the permit once the place is the request's, or with why it never will be.
    fn poll_turn(&mut self, cx: &mut Context<'_>) -> Poll<Result<Self::Permit, BoxError>>;

    /// `req` is about to be sent with `permit` (nothing to do by default).
    fn going<Req: JobRequest>(_permit: &mut Self::Permit, _req: &mut Req) {}

    /// Once the turn came: what the request waited for, and how long (none by default).
    fn waited(&self) -> Option<(WaitReason, Duration)> {
        None
    }
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
    // The service and the request wait boxed: only a request that waits keeps them, and
    // unboxed they would make every future of the stack above as large, moved as often.
    enum State<W, P, F, S, Req> {
        Waiting { turn: W, call: Option<Box<(S, Req)>> },
        Ready { permit: Option<P>, call: Option<Box<(S, Req)>> },
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
            call: Some(Box::new((inner, req))),
        };
        GuardedCall { state }
    }

    /// The request holds its place already.
    pub(crate) fn ready(permit: W::Permit, inner: S, req: Req) -> Self {
        let state = State::Ready {
            permit: Some(permit),
            call: Some(Box::new((inner, req))),
        };
        GuardedCall { state }
    }

    /// The request holds its place and was sent.
    fn calling(fut: F, permit: W::Permit) -> Self {
        let state = State::Calling {
            fut,
            permit: Some(permit),
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
                        if crate::trace::calls_traced()
                            && let Some((reason, waited)) = turn.waited()
                        {
                            crate::trace::waited(reason, waited);
                        }
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
                    Some(waiting) => match ready!(waiting.0.poll_ready(cx)) {
                        // The permit goes back with the state.
                        Err(e) => Err(e.into()),
                        Ok(()) => match (permit.take(), call.take().map(|call| *call)) {
                            (Some(mut permit), Some((mut inner, mut req))) => {
                                W::going(&mut permit, &mut req);
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

/// A layer's inner service, with what it said when the layer's own `poll_ready` asked it
/// ahead.
#[derive(Debug)]
pub(crate) struct Ahead<S> {
    service: S,
    said: Said,
}

/// What the inner service said to the last `poll_ready`.
#[derive(Debug)]
enum Said {
    Unasked,
    Ready,
    /// Not yet: whatever it holds (an acquisition under way) is dropped with it at the next
    /// call.
    NotReady,
    /// An error: not asked again; the next call answers it.
    Failed(BoxError),
}

impl<S: Clone> Clone for Ahead<S> {
    /// A clone was asked nothing.
    fn clone(&self) -> Self {
        Ahead::new(self.service.clone())
    }
}

impl<S> Ahead<S> {
    pub(crate) fn new(service: S) -> Self {
        Ahead {
            service,
            said: Said::Unasked,
        }
    }

    pub(crate) fn get_ref(&self) -> &S {
        &self.service
    }

    pub(crate) fn get_mut(&mut self) -> &mut S {
        &mut self.service
    }

    pub(crate) fn into_inner(self) -> S {
        self.service
    }

    /// Asks the inner service whether it is ready, never waiting for it.
    pub(crate) fn poll_ready<Req>(&mut self, cx: &mut Context<'_>)
    where
        S: Service<Req>,
        S::Error: Into<BoxError>,
    {
        if matches!(self.said, Said::Unasked | Said::NotReady) {
            self.said = match self.service.poll_ready(cx) {
                Poll::Ready(Ok(())) => Said::Ready,
                Poll::Ready(Err(error)) => Said::Failed(error.into()),
                Poll::Pending => Said::NotReady,
            };
        }
    }

    /// The call of `req`, whose place `permit` holds already: sent now if the inner service
    /// said ready, else by the future once it does.
    pub(crate) fn send<W, Req>(
        &mut self,
        mut permit: W::Permit,
        mut req: Req,
    ) -> GuardedCall<W, S::Future, S, Req>
    where
        W: Turn,
        S: Service<Req> + Clone,
        Req: JobRequest,
    {
        if matches!(self.said, Said::Ready) {
            self.said = Said::Unasked;
            W::going(&mut permit, &mut req);
            return GuardedCall::calling(self.service.call(req), permit);
        }
        match self.for_future() {
            Ok(service) => GuardedCall::ready(permit, service, req),
            // The place goes back with the permit.
            Err(error) => GuardedCall::failed(error),
        }
    }

    /// The call of `req` once `turn` gives it its place.
    pub(crate) fn wait<W, Req>(&mut self, turn: W, req: Req) -> GuardedCall<W, S::Future, S, Req>
    where
        W: Turn,
        S: Service<Req> + Clone,
    {
        match self.for_future() {
            Ok(service) => GuardedCall::waiting(turn, service, req),
            // The place in the queue goes with the turn.
            Err(error) => GuardedCall::failed(error),
        }
    }

    /// A service for a future to drive (a clone that was asked nothing), or the error the
    /// asked one gave. One that was asked is dropped here (replaced by a clone): a request
    /// waiting for its place must not hold what the inner service reserved for a call (a
    /// concurrency permit, a buffer slot) while others that have theirs wait for it.
    fn for_future(&mut self) -> Result<S, BoxError>
    where
        S: Clone,
    {
        match std::mem::replace(&mut self.said, Said::Unasked) {
            Said::Unasked => {}
            Said::Ready | Said::NotReady => self.service = self.service.clone(),
            Said::Failed(error) => {
                self.service = self.service.clone();
                return Err(error);
            }
        }
        Ok(self.service.clone())
    }
}
