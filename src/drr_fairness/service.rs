use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};

use tower_service::Service;

use super::Settler;
use super::future::ResponseFuture;
use super::state::{Admission, FairQueue, Permit};
use crate::body::GuardResponse;
use crate::error::{BoxError, MissingJob};
use crate::guarded::Ahead;
use crate::{JobRequest, Priority};

/// A concurrency limiter that dispatches waiting requests in fair order (start-time fair
/// queuing across groups and tenants, weighted across priorities); see the
/// [module docs](crate::drr_fairness).
///
/// # Clone
/// Clones share the layer's window and queues (and clone the inner service).
pub struct DrrFairness<S> {
    pub(super) inner: Ahead<S>,
    pub(super) shared: Arc<FairQueue>,
}

impl<S> DrrFairness<S> {
    /// The wrapped service.
    pub fn get_ref(&self) -> &S {
        self.inner.get_ref()
    }

    /// The wrapped service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        self.inner.get_mut()
    }

    /// Unwraps the inner service.
    pub fn into_inner(self) -> S {
        self.inner.into_inner()
    }

    /// A handle to settle requests' real usage; see [`Settler`].
    pub fn settler(&self) -> Settler {
        Settler {
            shared: self.shared.clone(),
        }
    }

    /// Requests dispatched and not finished.
    pub fn in_flight(&self) -> usize {
        self.shared.in_flight()
    }

    /// Requests waiting, in `priority` or (`None`) in all classes.
    pub fn queued(&self, priority: Option<Priority>) -> usize {
        self.shared.queued(priority)
    }

    /// The window size this service shares.
    pub fn max_in_flight(&self) -> usize {
        self.shared.max_in_flight()
    }
}

impl<S: Clone> Clone for DrrFairness<S> {
    fn clone(&self) -> Self {
        DrrFairness {
            inner: self.inner.clone(),
            shared: self.shared.clone(),
        }
    }
}

impl<S: fmt::Debug> fmt::Debug for DrrFairness<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DrrFairness")
            .field("inner", self.inner.get_ref())
            .field("state", &self.shared)
            .finish()
    }
}

impl<S, Req> Service<Req> for DrrFairness<S>
where
    S: Service<Req> + Clone,
    S::Error: Into<BoxError>,
    S::Response: GuardResponse<Permit>,
    Req: JobRequest,
{
    type Response = <S::Response as GuardResponse<Permit>>::Output;
    type Error = BoxError;
    type Future = ResponseFuture<S::Future, S, Req>;

    /// Always ready: the tenant is not known before `call`, so a request takes its place
    /// in the queue there, and its response future waits for its turn and then for the
    /// inner service's readiness. No place is reserved here, so a service dropped after
    /// `poll_ready` holds none.
    ///
    /// The inner service is asked ahead (never waited for): if it said ready, a request
    /// admitted at once is sent from `call`. A request that queues drops whatever the inner
    /// service reserved for that (a concurrency permit, a buffer slot), so it holds nothing
    /// another request admitted before it needs.
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx);
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, mut req: Req) -> Self::Future {
        let Some(job) = req.job_mut() else {
            return ResponseFuture::failed(MissingJob.into());
        };
        let arrived = job.arrival();
        let gate = self.shared.slot_gate();
        let held_above = gate.is_some_and(|gate| job.slot_held_by(gate));
        // Dispatched only with its slot when this layer holds a slot gate, so the slot
        // layer below that gave it lets it through without taking a second one.
        match gate {
            Some(gate) if !held_above => job.mark_slot_held_by(gate),
            Some(_) => {}
            None => job.mark_fair_queued_ungated(),
        }
        let job = &*job;
        // A queued request's future drives its own clone's readiness once dispatched (as
        // tower's Buffer worker does), holding nothing the inner service reserves meanwhile.
        match self.shared.admit(job, arrived, held_above) {
            Ok(Admission::Now(permit)) => ResponseFuture::new(self.inner.send(permit, req)),
            Ok(Admission::Queued(ticket)) => ResponseFuture::new(self.inner.wait(ticket, req)),
            Err(full) => ResponseFuture::failed(full.into()),
        }
    }
}
