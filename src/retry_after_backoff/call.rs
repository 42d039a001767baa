//! One call through [`RetryAfterBackoff`](crate::RetryAfterBackoff), attempt after attempt:
//! what it carries, what its steps share (the `Step` each says next, the `Waits` of an
//! admission), and the steps from an attempt's answer to the next attempt or the caller.
//! The steps before an attempt (this layer's waits) are in `admit.rs`; the future that runs
//! them all is in `future.rs`.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::{Duration, SystemTime};

use http::StatusCode;
use http_body::Body;
use tokio::time::{Instant, Sleep};
use tower::retry::budget::Budget;
use tower_service::Service;

use super::body::{Filled, Peeked, ResponseBody};
use super::decide::{self, Verdict};
use super::request::CloneRequest;
use super::state::{CoreAndCloner, HeldCall};
use super::telemetry;
use crate::admission::Busy;
use crate::error::BoxError;
use crate::gate::{AttemptCell, Taken, WaitReason};
use crate::rate::{Answer, Ask, Usage};
use crate::store::{DIMS, OUTPUT, PaceGrant, StoreFuture, TOTAL};
use crate::{JobRequest, TenantId};

/// Everything one call carries from attempt to attempt.
pub(super) struct Call<S, Req, C> {
    pub(super) shared: Arc<CoreAndCloner<C>>,
    pub(super) service: S,
    /// The request of the next attempt, while admitting it (boxed: only an attempt that
    /// waits here has one, and unboxed it would make every future above as large).
    pub(super) next: Option<Box<Req>>,
    /// A copy kept for a retry; `None` once it could not be cloned.
    pub(super) spare: Option<Req>,
    pub(super) tenant: TenantId,
    pub(super) cost: u32,
    pub(super) retries: u32,
    /// The upstream key: the scope of the gate, the probe and the learned limits.
    pub(super) upstream: Arc<str>,
    /// How far the next attempt got through this layer's waits.
    pub(super) admission: Admission,
    /// What the attempt under way was charged, which its answer settles.
    pub(super) charge: Charge,
    /// Counted as held (behind the gate or a probe) while set.
    pub(super) held: Option<HeldCall>,
    /// Who waits for the upstream's rate.
    pub(super) rate: RateWaiter,
}

impl<S, Req, C> Call<S, Req, C> {
    /// The attempt admitted here waited `wait` for `reason` (told to the call's trace, if
    /// a subscriber wants its span: see [`crate::trace`]).
    pub(super) fn waited(&self, reason: WaitReason, wait: Duration) {
        crate::trace::waited(reason, wait);
    }
}

/// What learned pacing charged an attempt: its answer corrects the charges by its usage,
/// and a probe's answer tells the fleet.
#[derive(Default)]
pub(super) struct Charge {
    /// The cells per dimension a call of this job needs from learned pacing (see `needs`).
    pub(super) need: [u32; DIMS],
    /// The cells learned pacing took for the attempt (0 where none).
    pub(super) charged: [u32; DIMS],
    /// The attempt is the probe of its key (cold start or recovery): its answer tells the
    /// fleet at once.
    pub(super) probe: bool,
    /// What the attempt took from the rate gate of a fair queue below, until its answer is
    /// reported.
    pub(super) receipt: Taken,
}

/// Who waits for the upstream's rate before an attempt.
pub(super) enum RateWaiter {
    /// This layer, in its own waits (see `admit.rs`).
    Here {
        /// The tier's max wait, while the first attempt is held here.
        patience: Option<Patience>,
    },
    /// A fair queue below holds the rate gate: attempts go straight down.
    Below {
        /// Where the fair queue puts what the attempt took.
        attempt: Option<AttemptCell>,
    },
}

impl RateWaiter {
    pub(super) fn is_below(&self) -> bool {
        matches!(self, RateWaiter::Below { .. })
    }
}

/// The tier's max wait under the store's slot caps, counted from the request's arrival:
/// a first attempt held here (behind the gate, by pacing, by slow start) past it is told
/// [`Busy`] at the deadline, as the fair queue and the slot layer would. A retry is not
/// bounded by it: the request was dispatched once, and a retry's own wait is the server's.
pub(super) struct Patience {
    deadline: Instant,
    arrived: Instant,
    tier: crate::Tier,
    retry_after: Duration,
    timer: Option<Pin<Box<Sleep>>>,
}

impl Patience {
    pub(super) fn new(policy: &crate::SlotPolicy, job: &crate::Job, arrived: Instant) -> Self {
        let (tier, limit, _) = policy.limit(job.tier());
        Patience {
            deadline: crate::time::after(arrived, limit.max_wait_for(job.priority(), job.sla())),
            arrived,
            tier,
            retry_after: policy.retry_after(),
            timer: None,
        }
    }

    /// `Busy` once the deadline has passed; `None` (the timer registered) before.
    pub(super) fn poll_expired(&mut self, cx: &mut Context<'_>) -> Option<Busy> {
        let deadline = self.deadline;
        let timer = self
            .timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        timer.as_mut().poll(cx).is_ready().then(|| {
            crate::metrics::server_busy(&self.tier, WaitReason::Rate);
            // The holds before it were told as they began: only the call's end is told.
            Busy::new(self.tier.clone(), self.arrived.elapsed(), self.retry_after)
                .because(WaitReason::Rate)
        })
    }
}

/// What a response means, decided as soon as its head arrives.
#[derive(Clone, Copy, Debug)]
pub(super) struct Outcome {
    status: StatusCode,
    /// A 429 or 529: the upstream said to slow down.
    slow_down: bool,
    /// How long the server said to wait, for a 429 / 529.
    server_delay: Option<Duration>,
    /// How long to close the upstream's gate for.
    gate: Option<Duration>,
    /// The delay before the retry, when it is retried.
    retry: Option<Duration>,
}

pub(super) enum Then<B: Body> {
    Retry(Duration),
    Return(http::Response<ResponseBody<B>>),
}

/// What polling one state leads to: the next state's parts, never a whole `State`. The
/// state holds the inner call's future, most of this future's size; passing it through a
/// return value would copy it at every step.
pub(super) enum Step<B: Body> {
    /// Poll the same state again: it set itself something new to wait for.
    Again,
    /// The inner service is ready: send the next attempt.
    Send,
    /// Admit the next attempt after these waits.
    Admit(Waits),
    /// Sleep before a retry a fair queue below admits.
    Backoff(Option<Pin<Box<Sleep>>>),
    /// Read a 429's body ahead.
    Peek(Box<Peek<B>>),
    /// Record what the answer taught in the store (boxed: rare, and the response it holds
    /// would make every future of the stack above as large).
    Record(Box<Recording<B>>),
    /// The call's outcome.
    Finish(Result<http::Response<ResponseBody<B>>, BoxError>),
}

/// A 429 whose body is read ahead, until `deadline`.
pub(super) struct Peek<B: Body> {
    pub(super) head: http::response::Parts,
    pub(super) peeked: Peeked<B>,
    pub(super) outcome: Outcome,
    pub(super) deadline: Sleep,
}

/// What goes to the store for an answer, and what follows once it took it.
pub(super) struct Recording<B: Body> {
    pub(super) throttle: Option<StoreFuture<u32>>,
    pub(super) gate: Option<StoreFuture<std::time::Duration>>,
    pub(super) report: Option<StoreFuture<PaceGrant>>,
    /// Taken once the store has it all.
    pub(super) then: Option<Then<B>>,
}

impl<B: Body> Step<B> {
    pub(super) fn fail(error: impl Into<BoxError>) -> Self {
        Step::Finish(Err(error.into()))
    }
}

/// A wake-up a step waits for besides its timer.
pub(super) type Wake = Pin<Box<dyn Future<Output = ()> + Send>>;

/// What an attempt waits for while it is admitted.
#[derive(Default)]
pub(super) struct Waits {
    pub(super) sleep: Option<Pin<Box<Sleep>>>,
    /// The store's shared pacing: the wait of this attempt's reservation.
    pub(super) reserve: Option<StoreFuture<Duration>>,
    /// The store's answer to a learned-pacing reservation.
    pub(super) learn: Option<StoreFuture<PaceGrant>>,
    /// Held behind another call's probe: woken by any answer in this worker (the timer
    /// covers answers in other workers).
    pub(super) answered: Option<Wake>,
    /// Waiting for cells reserved under the learned limits: woken when a limit changes, to
    /// ask again (see `Admission::paced_under`).
    pub(super) relimit: Option<Wake>,
}

impl Waits {
    /// The waits of a first attempt that sleeps `wait` (learned pacing's) before going on.
    pub(super) fn first<S, Req, C>(call: &Call<S, Req, C>, wait: Duration) -> Self {
        let relimit = call
            .admission
            .paced_under
            .is_some()
            .then(|| call.shared.core.rate.limits_changed());
        Waits {
            sleep: sleep_for(wait),
            relimit,
            ..Waits::default()
        }
    }

    /// The waits of a retry after `delay`.
    pub(super) fn after(delay: Duration) -> Self {
        Waits {
            sleep: sleep_for(delay),
            ..Waits::default()
        }
    }

    pub(super) fn sleep(&mut self, wait: Duration) {
        self.sleep = sleep_for(wait);
    }
}

pub(super) fn sleep_for(delay: Duration) -> Option<Pin<Box<Sleep>>> {
    (!delay.is_zero()).then(|| Box::pin(tokio::time::sleep(delay)))
}

/// How far the next attempt got through the waits; all of it starts over once it goes.
#[derive(Default)]
pub(super) struct Admission {
    pub(super) learned: LearnedPass,
    /// The learned limits under which this attempt's cells were reserved, while it waits
    /// for them: if a limit changed meanwhile, the store restarted the bucket and the
    /// reservation is void, so the attempt asks again rather than go at the old pace.
    pub(super) paced_under: Option<[u32; DIMS]>,
    /// The attempt holds its reservation in the store's shared pacing.
    pub(super) reserved: bool,
    /// Configured pacing's dimensions already taken for the attempt.
    pub(super) pace_step: usize,
}

/// Where the attempt stands with learned pacing.
#[derive(Default)]
pub(super) enum LearnedPass {
    /// Not asked yet.
    #[default]
    Unasked,
    /// A reservation to ask the store for, then while it is asked.
    Asking(Ask),
    /// Learned pacing let the attempt go: its cells are taken.
    Let,
}

impl<S, Req, C> Call<S, Req, C> {
    /// Reads a response head: whether to retry and after how long, and what to tell the gate.
    fn judge(&self, status: StatusCode, headers: &http::HeaderMap) -> Outcome {
        let policy = &self.shared.core.policy;
        // The clock is read only when the head says something about time.
        let slow_down = matches!(status.as_u16(), 429 | 529);
        let reset = decide::ratelimit_reset_unlearned(headers, policy.learned_pacing);
        let wall = (slow_down || reset.is_some()).then(SystemTime::now);
        // The provider says a limit is exhausted until its reset: slow down before a 429.
        let limits = reset
            .zip(wall)
            .map(|(at, now)| at.duration_since(now).unwrap_or(Duration::ZERO))
            // A per-minute bucket is full again within a minute: a reset further ahead is
            // not believed (and never holds anyone).
            .filter(|d| !d.is_zero() && *d <= Duration::from_secs(61));
        let server_delay = match wall {
            Some(now) if slow_down => decide::retry_after(headers, now),
            _ => None,
        };
        // A gate never stays closed longer than the longest sleep this layer allows.
        let gate = server_delay
            .filter(|d| !d.is_zero())
            .or(limits)
            .map(|d| d.min(policy.max_delay));
        let retry = match decide::should_retry(status, headers, &policy.retry_on) {
            Verdict::DontRetry => None,
            Verdict::Retry { .. } => self.retry_delay(server_delay.or(limits)),
        };
        Outcome {
            status,
            slow_down,
            server_delay,
            gate,
            retry,
        }
    }

    /// The delay before a retry the answer asks for (`told`: how long the server said to
    /// wait), or `None` where it is not retried.
    fn retry_delay(&self, told: Option<Duration>) -> Option<Duration> {
        let core = &self.shared.core;
        let policy = &core.policy;
        if self.retries >= policy.max_retries {
            telemetry::gave_up("max_retries");
            return None;
        }
        if self.spare.is_none() {
            telemetry::gave_up("not_clonable");
            return None;
        }
        let unit = core.rate.unit();
        let delay = match told {
            Some(told) => decide::throttle_delay(told, unit),
            None => policy.backoff.delay(self.retries, unit),
        };
        if delay > policy.max_delay {
            telemetry::gave_up("over_max_delay");
            None
        } else {
            Some(delay)
        }
    }

    /// The key the attempt's answer teaches: the upstream of a pool the fair queue's rate
    /// gate sent it to, or the request's own.
    fn answered_key(&self) -> Arc<str> {
        match self.charge.receipt.as_ref().and_then(|r| r.route.as_ref()) {
            Some(route) => route.answered_key(),
            None => self.upstream.clone(),
        }
    }

    /// Settles an outcome: spends the budget, records the throttle and the gate.
    fn settle<B: Body>(
        &mut self,
        mut outcome: Outcome,
        response: http::Response<ResponseBody<B>>,
        spend_limit: bool,
    ) -> Step<B>
    where
        C: CloneRequest<Req>,
        Req: JobRequest,
    {
        let core = &self.shared.core;
        if spend_limit {
            // Waiting does not lift a spend limit: neither retry nor hold anyone back.
            telemetry::gave_up("spend_limit");
            outcome.retry = None;
            outcome.gate = None;
        }
        if outcome.retry.is_some()
            && let Some(budget) = &core.budget
            && !budget.withdraw()
        {
            telemetry::gave_up("budget");
            outcome.retry = None;
        }
        let key = &self.answered_key();
        // At its limit until an answer says otherwise, or the probe timeout runs out: after
        // the gate, one probe for the whole fleet through the store.
        let at_limit = !spend_limit && (outcome.slow_down || outcome.gate.is_some());
        let answer = Answer {
            headers: response.headers(),
            at_limit,
            closes_for: outcome.gate,
            probe: self.charge.probe,
        };
        let (report, limits) = core.rate.answered(key, &answer);
        let report = report.map(|ask| core.store.pace_learned(key, &ask));
        let throttle = (outcome.status == StatusCode::TOO_MANY_REQUESTS)
            .then(|| core.store.record_throttle(&self.tenant));
        let gate = outcome
            .gate
            .map(|delay| core.store.extend_cooldown(key, delay));
        if outcome.slow_down {
            self.log_throttled(&outcome);
        }
        let then = self.then(outcome, response, limits);
        if throttle.is_none() && gate.is_none() && report.is_none() {
            // Nothing for the store to take (a success with nothing learned, the usual
            // answer): no recording step to pass the response through.
            return self.recorded(then);
        }
        Step::Record(Box::new(Recording {
            throttle,
            gate,
            report,
            then: Some(then),
        }))
    }

    fn log_throttled(&self, outcome: &Outcome) {
        let delay = outcome.retry.or(outcome.server_delay).unwrap_or_default();
        tracing::warn!(
            name: "upstream.throttled",
            tenant = %self.tenant,
            status = outcome.status.as_u16(),
            delay_secs = delay.as_secs_f64(),
            retried = outcome.retry.is_some(),
            "upstream said to slow down"
        );
    }

    /// What follows a settled answer: a retry, or the response to the caller.
    fn then<B: Body>(
        &self,
        outcome: Outcome,
        response: http::Response<ResponseBody<B>>,
        limits: [u32; DIMS],
    ) -> Then<B> {
        let Charge {
            need,
            charged,
            ref receipt,
            ..
        } = self.charge;
        // The input tokens the fleet's token rate took for the attempt; with usage
        // correction off, none is corrected.
        let fleet_tokens = match self.shared.core.policy.usage_correction {
            true => receipt.as_ref().map_or(0, |r| r.fleet_tokens),
            false => 0,
        };
        match outcome.retry {
            Some(delay) => {
                telemetry::retry(outcome.status);
                Then::Retry(delay)
            }
            // A success charged tokens by learned pacing or by the fleet's token rate: its
            // usage corrects the estimate, read as the body streams to the caller. With an
            // output or combined limit learned it is read even when nothing was charged
            // (the fleet's order takes those as cells): its usage moves the key's average
            // call, which sizes them.
            None if outcome.status.is_success()
                && (fleet_tokens > 0
                    || limits[1..].iter().any(|l| *l > 0)
                        && (charged[1..].iter().any(|c| *c > 0)
                            || limits[OUTPUT] > 0
                            || limits[TOTAL] > 0)) =>
            {
                let core = self.shared.core.rate.clone();
                let charge = (need, charged, fleet_tokens);
                let key = (self.answered_key(), response.headers());
                let usage = Usage::new(core, key, charge, limits);
                Then::Return(response.map(|body| body.scanned(usage)))
            }
            None => Then::Return(response),
        }
    }

    /// Backing off before a retry a fair queue below admits: the sleep, then the inner
    /// service's readiness.
    pub(super) fn poll_backoff<F, B, E>(
        &mut self,
        cx: &mut Context<'_>,
        sleep: &mut Option<Pin<Box<Sleep>>>,
    ) -> Poll<Step<B>>
    where
        S: Service<Req, Future = F, Error = E>,
        E: Into<BoxError>,
        B: Body,
    {
        if let Some(timer) = sleep.as_mut() {
            ready!(timer.as_mut().poll(cx));
            *sleep = None;
        }
        self.poll_send(cx)
    }

    /// Once the inner service is ready, sends the next attempt.
    pub(super) fn poll_send<F, B, E>(&mut self, cx: &mut Context<'_>) -> Poll<Step<B>>
    where
        S: Service<Req, Future = F, Error = E>,
        E: Into<BoxError>,
        B: Body,
    {
        if let Err(e) = ready!(self.service.poll_ready(cx)) {
            return Poll::Ready(Step::fail(e));
        }
        Poll::Ready(Step::Send)
    }

    /// Sends the next attempt: its service said it is ready. A retry is a new attempt: the
    /// layers below count its waits (a tier's max wait) from now, when it reaches them, not
    /// from before its backoff, and it takes its own slot.
    pub(super) fn send<F>(&mut self) -> Result<F, BoxError>
    where
        S: Service<Req, Future = F>,
        Req: JobRequest,
    {
        match self.next.take() {
            Some(req) => {
                let mut req = *req;
                if self.retries > 0
                    && let Some(job) = req.job_mut()
                {
                    job.restamp();
                }
                Ok(self.service.call(req))
            }
            // Only reachable by polling after completion.
            None => Err(crate::error::PolledAfterCompletion.into()),
        }
    }

    /// Waiting for the attempt's answer; then judges its head.
    pub(super) fn poll_calling<F, B, E>(
        &mut self,
        cx: &mut Context<'_>,
        fut: Pin<&mut F>,
    ) -> Poll<Step<B>>
    where
        F: Future<Output = Result<http::Response<B>, E>>,
        E: Into<BoxError>,
        B: Body,
        C: CloneRequest<Req>,
        Req: JobRequest,
    {
        // The attempt is told to the call's trace when it ends, from inside the call's
        // poll (it may have been sent from a `call` outside it).
        let response = match ready!(fut.poll(cx)) {
            Ok(response) => response,
            Err(e) => {
                let e: BoxError = e.into();
                // Refused below (Busy, QueueFull): it never went upstream.
                if crate::trace::calls_traced()
                    && crate::reject::Rejection::from_error(&*e).is_none()
                {
                    crate::trace::with_current(|trace| trace.attempted(&self.upstream, None));
                }
                self.charge.probe = false;
                return Poll::Ready(Step::fail(e));
            }
        };
        if let RateWaiter::Below {
            attempt: Some(cell),
        } = &self.rate
            && let Some(receipt) = cell.take()
        {
            // What the fair queue took for this attempt: its answer corrects the charges
            // and, for a probe, tells the fleet.
            self.charge.probe = receipt.probe;
            self.charge.need = receipt.need;
            self.charge.charged = receipt.charged;
            self.charge.receipt = Some(receipt);
        }
        let status = response.status();
        crate::trace::with_current(|trace| trace.attempted(&self.answered_key(), Some(status)));
        let outcome = self.judge(status, response.headers());
        let (head, body) = response.into_parts();
        if outcome.retry.is_some() && outcome.status == StatusCode::TOO_MANY_REQUESTS {
            // Only a 429 about to be retried is read ahead: it may be the spend limit, which
            // must go back to the caller (with every byte).
            let timeout = self.shared.core.policy.peek_timeout;
            return Poll::Ready(Step::Peek(Box::new(Peek {
                head,
                peeked: Peeked::new(body),
                outcome,
                deadline: tokio::time::sleep(timeout),
            })));
        }
        let response = http::Response::from_parts(head, ResponseBody::passthrough(body));
        Poll::Ready(self.settle(outcome, response, false))
    }

    /// Reading a 429's body ahead until it can be judged, or the read is cut short.
    pub(super) fn poll_peeking<B: Body>(
        &mut self,
        cx: &mut Context<'_>,
        head: &mut Option<http::response::Parts>,
        peeked: &mut Option<Peeked<B>>,
        mut outcome: Outcome,
        deadline: Pin<&mut Sleep>,
    ) -> Poll<Step<B>>
    where
        C: CloneRequest<Req>,
        Req: JobRequest,
    {
        let policy = &self.shared.core.policy;
        // Why the reading stopped before the body could be judged, if it did.
        let cut = match peeked.as_mut() {
            Some(body) => match body.poll_fill(cx, policy.peek_limit, policy.peek_frame_limit) {
                Poll::Ready(Filled::Read) => None,
                Poll::Ready(Filled::FrameLimit) => Some("peek_frame_limit"),
                Poll::Pending => {
                    // The body's waker, or its own (a capped poll), is set; the deadline's
                    // is set here.
                    ready!(deadline.poll(cx));
                    Some("peek_timeout")
                }
            },
            None => None,
        };
        let (Some(head), Some(body)) = (head.take(), peeked.take()) else {
            return Poll::Ready(Step::fail(crate::error::PolledAfterCompletion));
        };
        // A compressed 429 (the SDKs ask for gzip) is judged on its decoded bytes.
        let decoded = crate::rate::decoded_prefix(&head.headers, body.bytes(), policy.peek_limit);
        let spend_limit = decide::is_spend_limit_body(&decoded);
        let response = http::Response::from_parts(head, ResponseBody::replay(body));
        if let Some(reason) = cut
            && !spend_limit
        {
            // Not judged: back to the caller as it is (see
            // `BackoffPolicyBuilder::peek_frame_limit`).
            telemetry::gave_up(reason);
            outcome.retry = None;
        }
        Poll::Ready(self.settle(outcome, response, spend_limit))
    }

    /// Waiting for the store to take what the answer taught; then retries or returns.
    pub(super) fn poll_recording<B: Body>(
        &mut self,
        cx: &mut Context<'_>,
        recording: &mut Recording<B>,
    ) -> Poll<Step<B>>
    where
        C: CloneRequest<Req>,
        Req: JobRequest,
    {
        // All go to the store at once (one round trip each on Redis, side by side): wait
        // until none is pending.
        let Recording {
            throttle,
            gate,
            report,
            then,
        } = recording;
        if let Some(count) = throttle.as_mut()
            && let Poll::Ready(count) = Pin::new(count).poll(cx)
        {
            telemetry::throttle_count(&self.tenant, count);
            *throttle = None;
        }
        if let Some(reopen) = gate.as_mut()
            && Pin::new(reopen).poll(cx).is_ready()
        {
            *gate = None;
        }
        if let Some(told) = report.as_mut()
            && let Poll::Ready(grant) = Pin::new(told).poll(cx)
        {
            // Calls held behind this probe ask again now.
            let key = self.answered_key();
            (self.shared.core.rate).reported(&key, &grant, self.charge.need);
            *report = None;
        }
        if throttle.is_some() || gate.is_some() || report.is_some() {
            return Poll::Pending;
        }
        Poll::Ready(match then.take() {
            Some(then) => self.recorded(then),
            None => Step::fail(crate::error::PolledAfterCompletion),
        })
    }

    /// The store took what the answer taught: retry, or give the response back.
    fn recorded<B: Body>(&mut self, then: Then<B>) -> Step<B>
    where
        C: CloneRequest<Req>,
        Req: JobRequest,
    {
        // The gate and the learned bucket now say what this answer taught.
        self.charge.probe = false;
        // The rate gate may let the next call go (a probe's answer is in).
        self.charge.receipt = None;
        match then {
            Then::Retry(delay) => self.retry(delay),
            Then::Return(response) => Step::Finish(Ok(response)),
        }
    }

    /// Makes the spare copy the next attempt, after `delay`.
    fn retry<B: Body>(&mut self, delay: Duration) -> Step<B>
    where
        C: CloneRequest<Req>,
        Req: JobRequest,
    {
        self.retries += 1;
        // The backoff the upstream asked for (or the SDKs' own when it named none).
        self.waited(WaitReason::Cooldown, delay);
        self.charge.charged = [0; DIMS];
        self.next = self.spare.take().map(Box::new);
        if let Some(job) = self.next.as_mut().and_then(|r| r.job_mut()) {
            // A fresh cell: the retry is a new attempt (after a throttle its key is
            // recovering, so one is needed).
            if let RateWaiter::Below { attempt } = &mut self.rate {
                *attempt = self.shared.core.rate.attempt_cell(&self.upstream);
                if let Some(cell) = attempt {
                    job.set_attempt(self.upstream.clone(), cell.clone());
                }
            }
        }
        self.spare = self
            .next
            .as_ref()
            .and_then(|req| self.shared.cloner.clone_request(req));
        if self.rate.is_below() {
            Step::Backoff(sleep_for(delay))
        } else {
            Step::Admit(Waits::after(delay))
        }
    }
}
