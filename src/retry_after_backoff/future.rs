//! The future of [`RetryAfterBackoff`](crate::RetryAfterBackoff).

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use http_body::Body;
use pin_project_lite::pin_project;
use tokio::time::Sleep;
use tower_service::Service;

use super::body::{Peeked, ResponseBody};
use super::call::{Call, Outcome, Peek, Recording, Step, Waits};
use super::request::CloneRequest;
use crate::JobRequest;
use crate::error::{BoxError, MissingJob, PolledAfterCompletion};

pin_project! {
    /// Response future of [`RetryAfterBackoff`](crate::RetryAfterBackoff): waits for the
    /// cooldown gate and the pacing, calls the inner service, and on a "try later" answer
    /// records it, waits and calls again, until the answer is final.
    ///
    /// Polled again after it completed, it returns [`PolledAfterCompletion`].
    pub struct ResponseFuture<F, S, Req, B, C>
    where
        B: Body,
    {
        #[pin]
        state: State<F, B>,
        call: Option<Call<S, Req, C>>,
    }
}

pin_project! {
    /// Where a call is: admitting (this layer's waits, see `admit.rs`) or backing off (a
    /// fair queue below waits for the rate), calling, peeking at a 429's body, recording the
    /// answer in the store, then admitting again for a retry, or done. Each state is polled
    /// by one method of `Call`, which says the `Step` to take next.
    #[project = StateProj]
    pub(super) enum State<F, B>
    where
        B: Body,
    {
        // Waiting (a backoff, the gate, the pacing), then the inner service's readiness.
        Admitting {
            waits: Waits,
        },
        // Sleeping before a retry that a fair queue below admits (it holds the rate gate),
        // then the inner service's readiness.
        Backoff {
            sleep: Option<Pin<Box<Sleep>>>,
        },
        Calling {
            #[pin]
            fut: F,
        },
        // Reading a 429's body ahead for the spend-limit code, until the deadline.
        Peeking {
            head: Option<http::response::Parts>,
            peeked: Option<Peeked<B>>,
            outcome: Outcome,
            #[pin]
            deadline: Sleep,
        },
        // Waiting for the store to take the throttle and the gate.
        Recording {
            recording: Box<Recording<B>>,
        },
        MissingJob,
        Done,
    }
}

impl<F, S, Req, B: Body, C> ResponseFuture<F, S, Req, B, C> {
    pub(super) fn missing_job() -> Self {
        ResponseFuture {
            state: State::MissingJob,
            call: None,
        }
    }

    pub(super) fn calling(fut: F, call: Call<S, Req, C>) -> Self {
        ResponseFuture {
            state: State::Calling { fut },
            call: Some(call),
        }
    }

    pub(super) fn admitting(call: Call<S, Req, C>, wait: std::time::Duration) -> Self {
        let waits = Waits::first(&call, wait);
        ResponseFuture {
            state: State::Admitting { waits },
            call: Some(call),
        }
    }
}

impl<F, S, Req, B, C, E> Future for ResponseFuture<F, S, Req, B, C>
where
    S: Service<Req, Future = F, Response = http::Response<B>, Error = E>,
    F: Future<Output = Result<http::Response<B>, E>>,
    E: Into<BoxError>,
    B: Body,
    C: CloneRequest<Req>,
    Req: JobRequest,
{
    type Output = Result<http::Response<ResponseBody<B>>, BoxError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        loop {
            let mut this = self.as_mut().project();
            let step = match (this.state.as_mut().project(), this.call.as_mut()) {
                (StateProj::MissingJob, _) => Step::fail(MissingJob),
                (StateProj::Done, _) | (_, None) => Step::fail(PolledAfterCompletion),
                (StateProj::Admitting { waits }, Some(call)) => {
                    ready!(call.poll_admitting(cx, waits))
                }
                (StateProj::Backoff { sleep }, Some(call)) => ready!(call.poll_backoff(cx, sleep)),
                (StateProj::Calling { fut }, Some(call)) => ready!(call.poll_calling(cx, fut)),
                (
                    StateProj::Peeking {
                        head,
                        peeked,
                        outcome,
                        deadline,
                    },
                    Some(call),
                ) => ready!(call.poll_peeking(cx, head, peeked, *outcome, deadline)),
                (StateProj::Recording { recording }, Some(call)) => {
                    ready!(call.poll_recording(cx, recording))
                }
            };
            match step {
                Step::Again => {}
                Step::Send => match this.call.as_mut().map(Call::send) {
                    Some(Ok(fut)) => this.state.set(State::Calling { fut }),
                    Some(Err(e)) => {
                        this.state.set(State::Done);
                        return Poll::Ready(Err(e));
                    }
                    None => {
                        this.state.set(State::Done);
                        return Poll::Ready(Err(PolledAfterCompletion.into()));
                    }
                },
                Step::Admit(waits) => this.state.set(State::Admitting { waits }),
                Step::Backoff(sleep) => this.state.set(State::Backoff { sleep }),
                Step::Peek(peek) => {
                    let Peek {
                        head,
                        peeked,
                        outcome,
                        deadline,
                    } = *peek;
                    this.state.set(State::Peeking {
                        head: Some(head),
                        peeked: Some(peeked),
                        outcome,
                        deadline,
                    });
                }
                Step::Record(recording) => this.state.set(State::Recording { recording }),
                Step::Finish(output) => {
                    this.state.set(State::Done);
                    return Poll::Ready(output);
                }
            }
        }
    }
}

impl<F, S, Req, B: Body, C> fmt::Debug for ResponseFuture<F, S, Req, B, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match &self.state {
            State::Admitting { .. } => "admitting",
            State::Backoff { .. } => "backing off",
            State::Calling { .. } => "calling",
            State::Peeking { .. } => "peeking",
            State::Recording { .. } => "recording",
            State::MissingJob => "missing job",
            State::Done => "done",
        };
        let retries = self.call.as_ref().map(|call| call.retries);
        f.debug_struct("ResponseFuture")
            .field("state", &state)
            .field("retries", &retries)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use crate::{BackoffPolicy, RetryAfterBackoffLayer, Store};

    #[tokio::test]
    async fn a_poll_after_completion_is_an_error() {
        crate::error::answers_once(RetryAfterBackoffLayer::new(
            Store::memory(),
            BackoffPolicy::default(),
        ))
        .await;
    }
}
