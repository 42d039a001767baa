use std::fmt;
use std::task::{Context, Poll};

use tokio::time::Instant;
use tower_service::Service;

use super::classifier::{Classifier, decide};
use super::future::{Refund, ResponseFuture};
use super::{ClassifyRule, DefaultRule};
use crate::JobRequest;
use crate::error::BoxError;
use crate::store::StoreFuture;
use crate::trace::CallSpan;

/// Sets each request's [`Priority`](crate::Priority) centrally, from its job's origin and
/// SLA, demoting runaway tenants to batch; see the [module docs](crate::priority_classify).
pub struct PriorityClassify<S, R = DefaultRule> {
    pub(super) inner: S,
    pub(super) shared: Classifier<R>,
}

impl<S, R> PriorityClassify<S, R> {
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

impl<S: Clone, R> Clone for PriorityClassify<S, R> {
    fn clone(&self) -> Self {
        PriorityClassify {
            inner: self.inner.clone(),
            shared: self.shared.clone(),
        }
    }
}

impl<S: fmt::Debug, R> fmt::Debug for PriorityClassify<S, R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PriorityClassify")
            .field("inner", &self.inner)
            .field("rule", &std::any::type_name::<R>())
            .field("policy", &self.shared.policy)
            .finish()
    }
}

impl<S, R, Req> Service<Req> for PriorityClassify<S, R>
where
    S: Service<Req> + Clone,
    S::Error: Into<BoxError>,
    R: ClassifyRule,
    Req: JobRequest,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = ResponseFuture<S::Future, S, Req>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, mut req: Req) -> Self::Future {
        let Some(job) = req.job_mut() else {
            return ResponseFuture::missing_job();
        };
        // The outermost layer: every wait below counts from here. One clock read for the
        // arrival and the demotion check.
        let now = Instant::now();
        let started = job.arrival_or(now);
        let shared = &self.shared;
        let by_rule = shared.rule.classify(job);
        // Checked before this job's tokens count, the same on every store: the job that
        // crosses the budget goes out as classified, the next one is demoted.
        // The budget counts in the policy's unit (input tokens by default); the metric, the
        // input tokens. What was counted rides on the job, for the settler, and in the
        // future, to be given back if the call is refused before it runs.
        let counts = shared.policy.budget_counts();
        let counted = counts.count(u64::from(job.cost()), job.charge());
        job.set_budget_counted(counts, counted);
        let check =
            shared
                .store
                .check_demotion_then_add_tokens(job.tenant(), &shared.policy, counted, now);
        crate::metrics::input_tokens(job.tenant(), u64::from(job.cost()));
        let refund = Refund::of(&shared.store, job.tenant(), counted);

        // A traced call takes the path of a round trip whatever the store answered: the
        // future calls the inner service inside the call's trace. Apart, so the untraced
        // path moves nothing more.
        // (Nothing of the trace is made before the inner call: a value to drop held across it
        // costs every call a move of the inner future.)
        let traced = CallSpan::wanted();
        let (check, round_trip) = match traced {
            false => (check, true),
            true => {
                let round_trip = !check.is_ready();
                (StoreFuture::pending(check), round_trip)
            }
        };
        match check.into_ready() {
            Ok(demotion) => {
                let priority = decide(job, by_rule, demotion);
                let fut = self.inner.call(req);
                ResponseFuture::calling(fut, priority, started, CallSpan::default()).refund(refund)
            }
            Err(check) => {
                let trace = match traced {
                    true => CallSpan::open(job),
                    false => CallSpan::default(),
                };
                // The answer needs a round trip: take the service that is ready into the
                // future and keep a fresh clone here (it will be polled ready again).
                let clone = self.inner.clone();
                let inner = std::mem::replace(&mut self.inner, clone);
                ResponseFuture::checking(check, inner, req, (by_rule, round_trip), started, trace)
                    .refund(refund)
            }
        }
    }
}
