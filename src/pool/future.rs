//! The future of a [`Pool`](super::Pool) call, and what its response body holds.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};

use tokio::time::Instant;

use pin_project_lite::pin_project;
use tokio::time::Sleep;
use tower::util::Oneshot;
use tower_service::Service;

use super::breaker::Outcome;
use super::error::FirstByteTimeout;
use super::{MemberState, Members};
use crate::body::{GuardResponse, GuardedBody};
use crate::error::{BoxError, PolledAfterCompletion};
use crate::sync::lock;
use crate::{Job, TenantId};

/// A call's place in its upstream's count of calls in flight, held by the response body
/// until it ends, fails or is dropped.
pub struct InFlight(Arc<MemberState>);

impl InFlight {
    /// A place in `member`'s count, if it is below its cap: checked and taken in one step,
    /// so callers on several threads never hold more than the cap together.
    pub(super) fn take(member: &Arc<MemberState>) -> Option<Self> {
        let max = member.max_in_flight;
        member
            .in_flight
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                max.is_none_or(|max| n < max).then_some(n + 1)
            })
            .ok()?;
        Some(InFlight(member.clone()))
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
        self.0.room.freed();
    }
}

impl fmt::Debug for InFlight {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("InFlight")
    }
}

/// A call's place at one upstream: its place in the upstream's count, and whether it is the
/// upstream's probe (dropped unanswered, the next call probes).
pub(super) struct Dispatch {
    pub(super) state: Arc<MemberState>,
    pub(super) member: usize,
    pub(super) probe: bool,
    pub(super) in_flight: Option<InFlight>,
}

impl Dispatch {
    pub(super) fn name(&self) -> &str {
        &self.state.name
    }

    /// The call's answer said `outcome` of its upstream; set aside by it, the upstream's
    /// rate is closed for the fleet too (the gates over the pool; a call moved away does
    /// that already).
    pub(super) fn answered(&mut self, outcome: Outcome) {
        let mut breaker = lock(&self.state.breaker);
        let set_aside = breaker.answered(outcome, self.probe, Instant::now());
        let probe_every = breaker.probe_every();
        drop(breaker);
        self.probe = false;
        if set_aside {
            self.state.room.set_aside(self.member, probe_every);
        }
    }

    /// The call goes elsewhere: it counted as moved away from here. Under a fair queue's
    /// gate, the upstream's rate closes for a probe interval, for the fleet, as a single
    /// upstream's does after a `529`: the calls go to the others, then one probe.
    pub(super) fn moved_away(&self, overloaded: bool) {
        let counts = &self.state.counts;
        counts.moved_away.fetch_add(1, Ordering::Relaxed);
        if overloaded {
            counts.overloaded.fetch_add(1, Ordering::Relaxed);
        }
        let probe_every = lock(&self.state.breaker).probe_every();
        self.state.room.set_aside(self.member, probe_every);
    }
}

impl Drop for Dispatch {
    fn drop(&mut self) {
        if self.probe {
            lock(&self.state.breaker).probe_dropped(Instant::now());
        }
    }
}

pin_project! {
    /// Response future of a [`Pool`](super::Pool): sends the call to the upstream chosen,
    /// and to another where the first provably did not run it.
    pub struct ResponseFuture<S, B>
    where
        S: Service<http::Request<B>>,
    {
        shared: Arc<Members>,
        services: Arc<[S]>,
        #[pin]
        call: Option<Oneshot<S, http::Request<B>>>,
        #[pin]
        deadline: Option<Sleep>,
        // The request, kept to send again (`None` once answered).
        spare: Option<http::Request<B>>,
        at: Option<Dispatch>,
        // The next upstream's place, taken before an answer was let go (or by a rate gate
        // over the pool, for the first).
        next: Option<Dispatch>,
        // A bit per upstream this call went to.
        tried: u64,
        tenant: Option<TenantId>,
        model: Option<String>,
    }
}

impl<S, B> ResponseFuture<S, B>
where
    S: Service<http::Request<B>>,
{
    pub(super) fn new(
        shared: Arc<Members>,
        services: Arc<[S]>,
        request: http::Request<B>,
        tenant: Option<TenantId>,
        model: Option<String>,
    ) -> Self {
        ResponseFuture {
            shared,
            services,
            call: None,
            deadline: None,
            spare: Some(request),
            at: None,
            next: None,
            tried: 0,
            tenant,
            model,
        }
    }

    /// The call goes first to the place a rate gate over the pool took for it.
    pub(super) fn routed(mut self, place: Dispatch) -> Self {
        self.next = Some(place);
        self
    }
}

/// A copy of `request` to send again: its head and extensions, and its body cloned.
fn copy<B: Clone>(request: &http::Request<B>) -> http::Request<B> {
    let mut copy = http::Request::new(request.body().clone());
    *copy.method_mut() = request.method().clone();
    *copy.uri_mut() = request.uri().clone();
    *copy.version_mut() = request.version();
    *copy.headers_mut() = request.headers().clone();
    *copy.extensions_mut() = request.extensions().clone();
    copy
}

/// Why an upstream provably did not run a call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum NotRun {
    /// Its connection was refused.
    Refused,
    /// It answered `529`, which the API answers before it runs a call (Bedrock's
    /// `ServiceUnavailableException` and `ModelNotReadyException` are mapped to it).
    Overloaded,
}

/// Tells the call's upstream's breaker what its answer said; why the upstream provably did
/// not run the call, if it did not. A `500`, `502`, `503` or `504` may come after the call
/// ran: it fails the upstream, and goes back to the caller as it is.
fn tell<R>(at: &mut Dispatch, answer: &Result<http::Response<R>, BoxError>) -> Option<NotRun> {
    let (outcome, not_run) = match answer {
        Ok(response) => match response.status().as_u16() {
            529 => (Outcome::Failing, Some(NotRun::Overloaded)),
            500 | 502..=504 => (Outcome::Failing, None),
            _ => (Outcome::Answered, None),
        },
        Err(error) if refused(error) => (Outcome::Unreachable, Some(NotRun::Refused)),
        Err(_) => (Outcome::Failing, None),
    };
    at.answered(outcome);
    not_run
}

/// Whether the upstream provably did not run the call: its connection was refused.
fn refused(error: &BoxError) -> bool {
    let error: &(dyn std::error::Error + 'static) = &**error;
    let mut source = Some(error);
    while let Some(error) = source {
        if let Some(io) = error.downcast_ref::<std::io::Error>()
            && io.kind() == std::io::ErrorKind::ConnectionRefused
        {
            return true;
        }
        source = error.source();
    }
    false
}

impl<S, B, R> Future for ResponseFuture<S, B>
where
    S: Service<http::Request<B>, Response = http::Response<R>> + Clone,
    S::Error: Into<BoxError>,
    B: Clone,
{
    type Output = Result<http::Response<GuardedBody<R, InFlight>>, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            if this.call.is_none() {
                let Some(request) = this.spare.take() else {
                    return Poll::Ready(Err(PolledAfterCompletion.into()));
                };
                let at = match this.next.take() {
                    Some(at) => at,
                    None => this.shared.pick(
                        *this.tried,
                        this.tenant.as_ref(),
                        this.model.as_deref(),
                    )?,
                };
                *this.tried |= 1 << at.member;
                if let Some(route) = request.extensions().get::<Job>().and_then(Job::route) {
                    route.sent_to(this.shared.id, at.member);
                }
                let service = this.services[at.member].clone();
                *this.spare = Some(copy(&request));
                this.call.set(Some(Oneshot::new(service, request)));
                this.deadline
                    .set(this.shared.first_byte_timeout.map(tokio::time::sleep));
                *this.at = Some(at);
            }
            let call = this
                .call
                .as_mut()
                .as_pin_mut()
                .expect("a call is under way");
            // The answer first: one that came in time is never taken for a timeout, however
            // late this task is polled.
            let Poll::Ready(answer) = call.poll(cx) else {
                if let Some(deadline) = this.deadline.as_mut().as_pin_mut()
                    && deadline.poll(cx).is_ready()
                {
                    this.call.set(None);
                    *this.spare = None;
                    let mut at = this.at.take().expect("a call under way has its dispatch");
                    at.answered(Outcome::Unreachable);
                    let upstream = at.name().to_owned();
                    return Poll::Ready(Err(FirstByteTimeout { upstream }.into()));
                }
                return Poll::Pending;
            };
            let answer: Result<_, BoxError> = answer.map_err(Into::into);
            this.call.set(None);
            this.deadline.set(None);
            let mut at = this.at.take().expect("a call under way has its dispatch");
            let not_run = tell(&mut at, &answer);
            // Elsewhere only with another upstream's place already taken: otherwise the
            // caller gets this answer as it is (a 529 and its retry-after, say).
            if let Some(why) = not_run
                && let Ok(next) =
                    this.shared
                        .pick(*this.tried, this.tenant.as_ref(), this.model.as_deref())
            {
                at.moved_away(why == NotRun::Overloaded);
                *this.next = Some(next);
                continue;
            }
            *this.spare = None;
            at.state.counts.served.fetch_add(1, Ordering::Relaxed);
            return Poll::Ready(match answer {
                Ok(response) => {
                    let in_flight = at.in_flight.take().expect("held until answered");
                    Ok(response.guard(in_flight))
                }
                Err(error) => Err(error),
            });
        }
    }
}

impl<S: Service<http::Request<B>>, B> fmt::Debug for ResponseFuture<S, B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture")
            .field("tried", &self.tried)
            .finish_non_exhaustive()
    }
}
