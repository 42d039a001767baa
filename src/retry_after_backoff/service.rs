use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};

use http_body::Body;
use tower::retry::budget::Budget;
use tower_service::Service;

use super::body::ResponseBody;
use super::call::{Admission, Call, Charge, Patience, RateWaiter};
use super::future::ResponseFuture;
use super::request::{ByClone, CloneRequest, TypeName};
use super::state::CoreAndCloner;
use crate::JobRequest;
use crate::error::BoxError;
use crate::rate::{OneUpstream, UpstreamKey};

/// Retries "try later" answers by the server's word, records throttles, and holds calls
/// behind the upstream's shared cooldown gate; see the
/// [module docs](crate::retry_after_backoff).
pub struct RetryAfterBackoff<S, C = ByClone, K = OneUpstream> {
    pub(super) inner: S,
    pub(super) shared: Arc<CoreAndCloner<C>>,
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
        let tenant = job.tenant().clone();
        let cost = job.cost();
        let shared = self.shared.clone();
        let core = &shared.core;
        if let Some(budget) = &core.budget {
            budget.deposit();
        }
        let upstream: Arc<str> = match self.key.upstream_key(&req) {
            Some(key) => Arc::from(format!("{}/{key}", core.policy.upstream)),
            None => core.policy.upstream.clone(),
        };
        let rate = if gated {
            let attempt = core.rate.attempt_cell(&upstream);
            // The job is looked up again only when there is a cell to give it.
            if let Some(cell) = &attempt
                && let Some(job) = req.job_mut()
            {
                job.set_attempt(upstream.clone(), cell.clone());
            }
            RateWaiter::Below { attempt }
        } else {
            RateWaiter::Here { patience }
        };
        let spare = shared.cloner.clone_request(&req);
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
            upstream,
            admission: Admission::default(),
            charge: Charge::default(),
            held: None,
            rate,
        };
        // The fair queue below waits for the rate, in its order: straight down.
        let first_wait = if gated { None } else { call.first_wait() };
        match first_wait {
            None => ResponseFuture::calling(self.inner.call(req), call),
            Some(wait) => {
                call.next = Some(Box::new(req));
                ResponseFuture::admitting(call, wait)
            }
        }
    }
}
