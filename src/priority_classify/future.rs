//! The future of [`PriorityClassify`](crate::PriorityClassify).

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use pin_project_lite::pin_project;
use tokio::time::Instant;
use tower_service::Service;

use crate::admission::WaitReason;
use crate::error::{BoxError, MissingJob, PolledAfterCompletion};
use crate::store::{Demotion, StoreFuture};
use crate::trace::CallSpan;
use crate::{JobRequest, Priority, Store, TenantId};

pin_project! {
    /// Response future of [`PriorityClassify`](crate::PriorityClassify): waits for the
    /// demotion check when it needs a round trip, then calls the inner service, and records
    /// the end-to-end latency under the request's priority.
    ///
    /// Polled again after it completed, it returns [`PolledAfterCompletion`].
    pub struct ResponseFuture<F, S, Req> {
        #[pin]
        state: State<F, S, Req>,
        started: Instant,
        priority: Option<Priority>,
        // Four bytes after `priority`: inside the padding the struct had.
        trace: CallSpan,
        refund: Option<Refund>,
    }
}

/// What the call counted toward its tenant's day, given back if it is refused before it
/// runs (a fairgate rejection, or no upstream with room): only what ran is charged.
pub(super) struct Refund {
    store: Store,
    tenant: TenantId,
    tokens: u64,
}

impl Refund {
    /// The refund of `tokens` counted for `tenant`, if any were.
    pub(super) fn of(store: &Store, tenant: &TenantId, tokens: u64) -> Option<Refund> {
        (tokens > 0).then(|| Refund {
            store: store.clone(),
            tenant: tenant.clone(),
            tokens,
        })
    }

    /// Gives the tokens back when `error` says the call never went upstream.
    fn refused(self, error: &BoxError) {
        if crate::reject::not_sent(&**error) {
            let tokens = i64::try_from(self.tokens).unwrap_or(i64::MAX);
            self.store.correct_tokens(&self.tenant, -tokens);
        }
    }
}

pin_project! {
    #[project = StateProj]
    enum State<F, S, Req> {
        Checking {
            check: StoreFuture<Demotion>,
            call: Option<PendingCall<S, Req>>,
        },
        Calling {
            #[pin]
            fut: F,
        },
        MissingJob,
        Done,
    }
}

struct PendingCall<S, Req> {
    inner: S,
    req: Req,
    by_rule: Priority,
    /// The demotion check is a round trip to the store (not an answer already there,
    /// passed through this state so a traced call is made inside its trace).
    round_trip: bool,
}

impl<F, S, Req> ResponseFuture<F, S, Req> {
    pub(super) fn missing_job() -> Self {
        ResponseFuture {
            state: State::MissingJob,
            started: Instant::now(),
            priority: None,
            trace: CallSpan::default(),
            refund: None,
        }
    }

    /// The same future, giving `refund` back if the call is refused before it runs.
    pub(super) fn refund(mut self, refund: Option<Refund>) -> Self {
        self.refund = refund;
        self
    }

    pub(super) fn calling(fut: F, priority: Priority, started: Instant, trace: CallSpan) -> Self {
        ResponseFuture {
            state: State::Calling { fut },
            started,
            priority: Some(priority),
            trace,
            refund: None,
        }
    }

    pub(super) fn checking(
        check: StoreFuture<Demotion>,
        inner: S,
        req: Req,
        (by_rule, round_trip): (Priority, bool),
        started: Instant,
        trace: CallSpan,
    ) -> Self {
        ResponseFuture {
            state: State::Checking {
                check,
                call: Some(PendingCall {
                    inner,
                    req,
                    by_rule,
                    round_trip,
                }),
            },
            started,
            priority: None,
            trace,
            refund: None,
        }
    }
}

impl<F, S, Req, T, E> Future for ResponseFuture<F, S, Req>
where
    F: Future<Output = Result<T, E>>,
    E: Into<BoxError>,
    S: Service<Req, Future = F, Response = T, Error = E>,
    Req: JobRequest,
{
    type Output = Result<T, BoxError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        // The layers below tell this call's trace what they wait for while it is polled.
        let _entered = self.trace.enter();
        loop {
            let mut this = self.as_mut().project();
            let output = match this.state.as_mut().project() {
                StateProj::Checking { check, call } => {
                    let demotion = ready!(Pin::new(check).poll(cx));
                    match call.take() {
                        Some(PendingCall {
                            mut inner,
                            mut req,
                            by_rule,
                            round_trip,
                        }) => match req.job_mut() {
                            Some(job) => {
                                if round_trip {
                                    // The outermost layer: the call arrived when it asked.
                                    this.trace.waited(WaitReason::Store, this.started.elapsed());
                                }
                                let priority = super::classifier::decide(job, by_rule, demotion);
                                *this.priority = Some(priority);
                                let fut = inner.call(req);
                                this.state.set(State::Calling { fut });
                                continue;
                            }
                            None => Err(MissingJob.into()),
                        },
                        None => Err(PolledAfterCompletion.into()),
                    }
                }
                StateProj::Calling { fut } => {
                    let output = ready!(fut.poll(cx)).map_err(Into::into);
                    if let (Err(error), Some(refund)) = (&output, this.refund.take()) {
                        refund.refused(error);
                    }
                    if let Some(priority) = *this.priority {
                        let outcome = outcome_of(&output);
                        crate::metrics::request_latency(priority, outcome, this.started.elapsed());
                        this.trace.close(Some(priority), || outcome);
                    }
                    output
                }
                StateProj::MissingJob => Err(MissingJob.into()),
                StateProj::Done => Err(PolledAfterCompletion.into()),
            };
            this.state.set(State::Done);
            return Poll::Ready(output);
        }
    }
}

impl<F, S, Req> fmt::Debug for ResponseFuture<F, S, Req> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match &self.state {
            State::Checking { .. } => "checking",
            State::Calling { .. } => "calling",
            State::MissingJob => "missing job",
            State::Done => "done",
        };
        f.debug_struct("ResponseFuture")
            .field("state", &state)
            .field("priority", &self.priority)
            .finish()
    }
}

/// How `result` ended, for the latency's `outcome` label (a refusal is a [`crate::reject::Rejection`]
/// anywhere in the error's chain, read only on the error path). Here rather than in
/// `metrics`, which the rejections' modules use.
fn outcome_of<T>(result: &Result<T, crate::BoxError>) -> crate::metrics::Outcome {
    use crate::metrics::Outcome;
    match result {
        Ok(_) => Outcome::Answered,
        Err(error) if crate::reject::Rejection::from_error(&**error).is_some() => Outcome::Refused,
        Err(_) => Outcome::Failed,
    }
}

#[cfg(test)]
mod tests {
    use crate::{PriorityClassifyLayer, Store};

    #[tokio::test]
    async fn a_poll_after_completion_is_an_error() {
        crate::error::answers_once(PriorityClassifyLayer::new(Store::memory())).await;
    }
}
