use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};

use tower_service::Service;

use super::future::ResponseFuture;
use super::wait::{SlotLimiter, SlotPermit, SlotWait, wait_for_slot};
use crate::JobRequest;
use crate::body::GuardResponse;
use crate::error::BoxError;
use crate::gate::WaitReason;
use crate::guarded::Ahead;
use crate::store::SlotRefusal;

/// Holds every call to a slot: a global cap and a cap per tier, shared by every worker on
/// the store; see the [module docs](crate::tier_slot_limit).
pub struct TierSlotLimit<S> {
    pub(super) inner: Ahead<S>,
    pub(super) shared: Arc<SlotLimiter>,
}

impl<S> TierSlotLimit<S> {
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
}

impl<S: Clone> Clone for TierSlotLimit<S> {
    fn clone(&self) -> Self {
        TierSlotLimit {
            inner: self.inner.clone(),
            shared: self.shared.clone(),
        }
    }
}

impl<S: fmt::Debug> fmt::Debug for TierSlotLimit<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TierSlotLimit")
            .field("inner", self.inner.get_ref())
            .field("policy", &self.shared.policy)
            .finish()
    }
}

impl<S, Req> Service<Req> for TierSlotLimit<S>
where
    S: Service<Req> + Clone,
    S::Error: Into<BoxError>,
    S::Response: GuardResponse<SlotPermit>,
    Req: JobRequest,
{
    type Response = <S::Response as GuardResponse<SlotPermit>>::Output;
    type Error = BoxError;
    type Future = ResponseFuture<S, Req>;

    /// Always ready: the tier is only known in `call`, so the wait for a slot (and then for
    /// the inner service) happens in the response future, as in tower's `Buffer`. Holding
    /// the inner service's readiness through a wait of up to a minute would starve others:
    /// the inner service is asked ahead (never waited for), a request with its slot at once
    /// is sent from `call` if it said ready, and one that waits drops what it reserved.
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx);
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, mut req: Req) -> Self::Future {
        let Some(job) = req.job_mut() else {
            return ResponseFuture::missing_job();
        };
        let shared = &self.shared;
        if job.slot_held_by(&shared.gate) {
            // An outer layer (a fair queue handed this layer's gate) took its slot.
            let tier = shared.resolve_tier(job.tier());
            return ResponseFuture::new(self.inner.send(SlotPermit::held_above(tier), req));
        }
        if job.fair_queued_ungated() {
            shared.warn_fair_queue_ungated();
        }
        job.mark_slot_held_by(&shared.gate);
        let started = job.arrival();
        let (tier, limit, state) = shared.resolve(job.tier());
        // It waits its class's wait (a batch job longer than the tier's user actions).
        let limit = limit.for_class(job.priority(), job.sla());

        // A tier that caps tenants: the request first takes its place in its tenant's line.
        let tenant = limit.tenant_cap.map(|_| job.tenant().clone());
        let mut line = tenant.as_ref().map(|tenant| state.tenant_line(tenant));

        // Fast path: nobody of this tier (nor of the tenant, with a tenant cap) waits here
        // and the store answers at once (memory). On Redis the acquire is a round trip not
        // yet begun: it becomes the wait's first try.
        let turn = match line.as_mut().is_none_or(|line| line.try_take()) {
            true => state.turnstile.clone().try_acquire_owned().ok(),
            false => None,
        };
        let mut first_try = None;
        if turn.is_some() {
            let queue = shared.queue(limit, state.waiting() + 1);
            match shared
                .gate
                .acquire(&tier, tenant.as_ref(), shared.limits(limit), queue.clone())
                .into_ready()
            {
                Ok(Ok(lease)) => {
                    let permit = SlotPermit::new(lease, state);
                    return ResponseFuture::new(self.inner.send(permit, req));
                }
                // Redis is away and this worker cannot admit it soundly: say so at once.
                Ok(Err(SlotRefusal::Store)) => {
                    let busy = shared.busy_because(tier, started, WaitReason::Store);
                    return ResponseFuture::busy(busy);
                }
                // Refused (the wait tries again, and a tenant over its cap then waits apart).
                Ok(Err(_)) => {}
                Err(pending) => first_try = Some((pending, queue)),
            }
        }
        if shared.hopeless(&state, limit) {
            return ResponseFuture::busy(shared.busy(tier, started));
        }
        let wait = wait_for_slot(SlotWait {
            shared: shared.clone(),
            tier,
            limit,
            state,
            started,
            tenant: line,
            turn,
            first_try,
        });
        ResponseFuture::new(self.inner.wait(Box::pin(wait), req))
    }
}
