use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http_body::Body;
use tower::retry::budget::Budget;
use tower_service::Service;

use super::body::ResponseBody;
use super::future::{Call, Patience, ResponseFuture};
use super::layer::{Learned, Shared};
use super::learned::{OneUpstream, UpstreamKey};
use super::request::{ByClone, CloneRequest, TypeName};
use crate::JobRequest;
use crate::error::BoxError;
use crate::store::DIMS;

/// Retries "try later" answers by the server's word, records throttles, and holds calls
/// behind the upstream's shared cooldown gate; see the
/// [module docs](crate::retry_after_backoff).
pub struct RetryAfterBackoff<S, C = ByClone, K = OneUpstream> {
    pub(super) inner: S,
    pub(super) shared: Arc<Shared<C>>,
    pub(super) key: Arc<K>,
    pub(super) waits: Option<Arc<crate::SlotPolicy>>,
    pub(super) gated: bool,
}

impl<S, C, K> RetryAfterBackoff<S, C, K> {
    /// The wrapped service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The wrapped service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Unwraps the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S: Clone, C, K> Clone for RetryAfterBackoff<S, C, K> {
    fn clone(&self) -> Self {
        RetryAfterBackoff {
            inner: self.inner.clone(),
            shared: self.shared.clone(),
            key: self.key.clone(),
            waits: self.waits.clone(),
            gated: self.gated,
        }
    }
}

impl<S: fmt::Debug, C, K> fmt::Debug for RetryAfterBackoff<S, C, K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetryAfterBackoff")
            .field("inner", &self.inner)
            .field("policy", &self.shared.core.policy)
            .field("cloner", &TypeName::<C>::new())
            .finish()
    }
}

impl<S, C, K, Req, B> Service<Req> for RetryAfterBackoff<S, C, K>
where
    S: Service<Req, Response = http::Response<B>> + Clone,
    S::Error: Into<BoxError>,
    B: Body,
    Req: JobRequest,
    C: CloneRequest<Req>,
    K: UpstreamKey<Req>,
{
    type Response = http::Response<ResponseBody<B>>;
    type Error = BoxError;
    type Future = ResponseFuture<S::Future, S, Req, B, C>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, mut req: Req) -> Self::Future {
        let Some(job) = req.job_mut() else {
            return ResponseFuture::missing_job();
        };
        let arrived = job.arrival();
        // With the store's slot caps, the tier's max wait bounds this layer's holds too (the
        // gate, pacing, slow start): dispatched or `Busy` within it, wherever it waited.
        let gated = self.gated;
        let patience = self
            .waits
            .as_deref()
            .filter(|_| !gated)
            .map(|policy| Patience::new(policy, job, arrived));
        let job = &*job;
        let tenant = job.tenant().clone();
        let cost = job.estimated_tokens();
        let shared = self.shared.clone();
        let core = &shared.core;
        if let Some(budget) = &core.budget {
            budget.deposit();
        }
        let upstream: Arc<str> = match self.key.upstream_key(&req) {
            Some(key) => Arc::from(format!("{}/{key}", core.policy.upstream)),
            None => core.policy.upstream.clone(),
        };
        let attempt = core.attempt_cell(&upstream).filter(|_| gated);
        if let (Some(cell), Some(job)) = (&attempt, req.job_mut()) {
            job.set_attempt(upstream.clone(), cell.clone());
        }
        let spare = shared.cloner.clone_request(&req);
        let mut pace_step = 0;
        // Fast path: the gate is open (a local read), learned pacing lets the call go now
        // without asking the store, and the configured pacing lets it go now.
        let (mut need, mut charged) = ([0; DIMS], [0; DIMS]);
        let (learned, ask, first_wait) = if gated {
            // The fair queue below waits for the rate, in its order: straight down.
            (true, None, Duration::ZERO)
        } else if core.store.cooldown(&upstream).is_none() {
            match core.admit_learned(&upstream, cost) {
                Learned::Go(wait, cells, taken) => {
                    (need, charged) = (cells, taken);
                    (true, None, wait)
                }
                Learned::Ask(ask, cells) => {
                    need = cells;
                    (false, Some(ask), Duration::ZERO)
                }
            }
        } else {
            (false, None, Duration::ZERO)
        };
        let go_now = gated
            || learned
                && first_wait.is_zero()
                && core.shared_pacing().is_none()
                && core
                    .pacer
                    .as_ref()
                    .is_none_or(|pacer| pacer.admit(&mut pace_step, cost).is_none());
        // The future keeps a clone for retries; the ready one is used now, or stays here
        // (still ready) when the call must wait.
        let service = self.inner.clone();
        let mut call = Call {
            shared,
            service,
            next: None,
            spare,
            tenant,
            cost,
            retries: 0,
            pace_step,
            upstream,
            learned,
            ask,
            need,
            charged,
            paced_under: None,
            probe: false,
            held: None,
            reserved: false,
            patience,
            attempt,
            receipt: None,
            gated,
        };
        if go_now {
            call.pace_step = 0;
            call.learned = false;
            ResponseFuture::calling(self.inner.call(req), call)
        } else {
            if !first_wait.is_zero() {
                super::telemetry::pacing_wait(first_wait);
                call.paced_under = Some(call.shared.core.limits_of(&call.upstream));
            }
            call.next = Some(req);
            ResponseFuture::admitting(call, first_wait)
        }
    }
}
