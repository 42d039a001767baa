//! The future of [`RetryAfterBackoff`](crate::RetryAfterBackoff).

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::{Duration, SystemTime};

use http::StatusCode;
use http_body::Body;
use pin_project_lite::pin_project;
use tokio::time::{Instant, Sleep};
use tower::retry::budget::Budget;
use tower_service::Service;

use super::body::{Filled, Peeked, ResponseBody};
use super::decide::{self, Verdict};
use super::layer::{Ask, Held, Learned, Shared, taken};
use super::request::CloneRequest;
use super::telemetry;
use super::usage::Usage;
use crate::admission::Busy;
use crate::error::{BoxError, MissingJob};
use crate::gate::{AttemptCell, Taken};
use crate::store::{DIMS, PaceAsk, PaceGrant, StoreFuture};
use crate::{JobRequest, TenantId};

pin_project! {
    /// Response future of [`RetryAfterBackoff`](crate::RetryAfterBackoff): waits for the
    /// cooldown gate and the pacing, calls the inner service, and on a "try later" answer
    /// records it, waits and calls again, until the answer is final.
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
    #[project = StateProj]
    enum State<F, B>
    where
        B: Body,
    {
        // Waiting (a backoff, the gate, the pacing), then the inner service's readiness.
        Admitting {
            sleep: Option<Pin<Box<Sleep>>>,
            reserve: Option<StoreFuture<Duration>>,
            learn: Option<StoreFuture<PaceGrant>>,
            // Held behind another call's probe: woken by any answer in this worker (the
            // timer covers answers in other workers).
            answered: Option<Pin<Box<dyn Future<Output = ()> + Send>>>,
            // Waiting for cells reserved under the learned limits: woken when a limit
            // changes, to ask again (see `Call::paced_under`).
            relimit: Option<Pin<Box<dyn Future<Output = ()> + Send>>>,
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
            throttle: Option<StoreFuture<u32>>,
            gate: Option<StoreFuture<Duration>>,
            report: Option<StoreFuture<PaceGrant>>,
            then: Option<Then<B>>,
        },
        MissingJob,
        Done,
    }
}

/// Everything one call carries from attempt to attempt.
pub(super) struct Call<S, Req, C> {
    pub(super) shared: Arc<Shared<C>>,
    pub(super) service: S,
    /// The request of the next attempt, while admitting it.
    pub(super) next: Option<Req>,
    /// A copy kept for a retry; `None` once it could not be cloned.
    pub(super) spare: Option<Req>,
    pub(super) tenant: TenantId,
    pub(super) cost: u32,
    pub(super) retries: u32,
    /// Pacing dimensions already taken for the next attempt.
    pub(super) pace_step: usize,
    /// The upstream key: the scope of the gate, the probe and the learned limits.
    pub(super) upstream: Arc<str>,
    /// Learned pacing let the next attempt go (its cells are taken).
    pub(super) learned: bool,
    /// A reservation to ask the store for, decided in `call`, then while it is asked.
    pub(super) ask: Option<Ask>,
    /// The cells per dimension a call of this job needs from learned pacing (see `needs`).
    pub(super) need: [u32; DIMS],
    /// The cells learned pacing took for the attempt under way (0 where none): what its
    /// answer's usage corrects.
    pub(super) charged: [u32; DIMS],
    /// The learned limits under which this attempt's cells were reserved, while it waits
    /// for them: if a limit changed meanwhile, the store restarted the bucket and the
    /// reservation is void, so the attempt asks again rather than go at the old pace.
    pub(super) paced_under: Option<[u32; DIMS]>,
    /// This attempt is the probe of its key (cold start or recovery): its answer tells the
    /// fleet at once.
    pub(super) probe: bool,
    /// Counted as held (behind the gate or a probe) while set.
    pub(super) held: Option<Held>,
    /// The next attempt holds its reservation in the store's shared pacing.
    pub(super) reserved: bool,
    /// The tier's max wait, while the first attempt is held here (see `Patience`).
    pub(super) patience: Option<Patience>,
    /// With the rate gate in a fair queue below: where it puts what the attempt took.
    pub(super) attempt: Option<AttemptCell>,
    /// What the attempt under way took from the rate gate, until its answer is reported.
    pub(super) receipt: Taken,
    /// A fair queue below holds the rate gate: attempts go straight down.
    pub(super) gated: bool,
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
        let (tier, limit, _) = policy.limit(job.tier_name());
        Patience {
            deadline: crate::time::after(arrived, limit.max_wait),
            arrived,
            tier,
            retry_after: policy.retry_after(),
            timer: None,
        }
    }

    /// `Busy` once the deadline has passed; `None` (the timer registered) before.
    fn poll_expired(&mut self, cx: &mut Context<'_>) -> Option<Busy> {
        let deadline = self.deadline;
        let timer = self
            .timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        timer.as_mut().poll(cx).is_ready().then(|| {
            crate::metrics::server_busy(&self.tier, crate::gate::WaitReason::Rate);
            Busy::new(self.tier.clone(), self.arrived.elapsed(), self.retry_after)
                .because(crate::gate::WaitReason::Rate)
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

enum Then<B: Body> {
    Retry(Duration),
    Return(http::Response<ResponseBody<B>>),
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

    pub(super) fn admitting(call: Call<S, Req, C>, wait: Duration) -> Self {
        let relimit = call
            .paced_under
            .is_some()
            .then(|| call.shared.core.limits_changed());
        ResponseFuture {
            state: State::Admitting {
                sleep: sleep_for(wait),
                reserve: None,
                learn: None,
                answered: None,
                relimit,
            },
            call: Some(call),
        }
    }
}

fn sleep_for(delay: Duration) -> Option<Pin<Box<Sleep>>> {
    (!delay.is_zero()).then(|| Box::pin(tokio::time::sleep(delay)))
}

impl<S, Req, C> Call<S, Req, C> {
    /// Reads a response head: whether to retry and after how long, and what to tell the gate.
    fn judge(&self, status: StatusCode, headers: &http::HeaderMap) -> Outcome {
        let core = &self.shared.core;
        let policy = &core.policy;
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
            Verdict::Retry { .. } if self.retries >= policy.max_retries => {
                telemetry::gave_up("max_retries");
                None
            }
            Verdict::Retry { .. } if self.spare.is_none() => {
                telemetry::gave_up("not_clonable");
                None
            }
            Verdict::Retry { .. } => {
                let unit = core.unit();
                let delay = match server_delay.or(limits) {
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
        };
        Outcome {
            status,
            slow_down,
            server_delay,
            gate,
            retry,
        }
    }

    /// Settles an outcome: spends the budget, records the throttle and the gate.
    fn settle<F, B: Body>(
        &self,
        mut outcome: Outcome,
        response: http::Response<ResponseBody<B>>,
        spend_limit: bool,
    ) -> State<F, B> {
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
        let status = outcome.status;
        let key = &self.upstream;
        // At its limit until an answer says otherwise, or the probe timeout runs out: after
        // the gate, one probe for the whole fleet through the store.
        let at_limit = !spend_limit && (outcome.slow_down || outcome.gate.is_some());
        if let Some(delay) = outcome.gate {
            core.note_reopen(key, delay);
        }
        if at_limit {
            core.note_at_limit(key);
        }
        let (report, limits) = core.report(key, response.headers(), at_limit, self.probe);
        let report = report.map(|ask| core.store.pace_learned(key, &ask));
        let throttle = (status == StatusCode::TOO_MANY_REQUESTS)
            .then(|| core.store.record_throttle(&self.tenant));
        let gate = outcome
            .gate
            .map(|delay| core.store.extend_cooldown(key, delay));
        if outcome.slow_down {
            let delay = outcome.retry.or(outcome.server_delay).unwrap_or_default();
            tracing::warn!(
                name: "upstream.throttled",
                tenant = %self.tenant,
                status = status.as_u16(),
                delay_secs = delay.as_secs_f64(),
                retried = outcome.retry.is_some(),
                "upstream said to slow down"
            );
        }
        let then = match outcome.retry {
            Some(delay) => {
                telemetry::retry(status);
                Then::Retry(delay)
            }
            // A success charged tokens by learned pacing: its usage corrects the estimate,
            // read as the body streams to the caller.
            None if status.is_success()
                && limits[1..].iter().any(|l| *l > 0)
                && self.charged[1..].iter().any(|c| *c > 0) =>
            {
                let usage = Usage::new(core.clone(), key.clone(), self.need, self.charged, limits);
                Then::Return(response.map(|body| body.scanned(usage)))
            }
            None => Then::Return(response),
        };
        State::Recording {
            throttle,
            gate,
            report,
            then: Some(then),
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
            let Some(call) = this.call.as_mut() else {
                this.state.set(State::Done);
                return Poll::Ready(Err(MissingJob.into()));
            };
            match this.state.as_mut().project() {
                StateProj::Admitting {
                    sleep,
                    reserve,
                    learn,
                    answered,
                    relimit,
                } => {
                    if call.retries == 0
                        && let Some(busy) = call.patience.as_mut().and_then(|p| p.poll_expired(cx))
                    {
                        // Nothing was sent: whatever it held here goes with the state.
                        this.state.set(State::Done);
                        return Poll::Ready(Err(busy.into()));
                    }
                    if let Some(woken) = answered.as_mut()
                        && woken.as_mut().poll(cx).is_ready()
                    {
                        *answered = None;
                        *sleep = None;
                    }
                    if let Some(changed) = relimit.as_mut()
                        && changed.as_mut().poll(cx).is_ready()
                    {
                        *relimit = None;
                        if let Some(limits) = call.paced_under
                            && call.shared.core.limits_of(&call.upstream) != limits
                        {
                            // The reservation is void: ask again now.
                            call.paced_under = None;
                            call.learned = false;
                            *sleep = None;
                        } else if sleep.is_some() {
                            *relimit = Some(call.shared.core.limits_changed());
                            continue;
                        }
                    }
                    if let Some(timer) = sleep.as_mut() {
                        ready!(timer.as_mut().poll(cx));
                        *sleep = None;
                        *answered = None;
                        *relimit = None;
                    }
                    if let Some(reservation) = reserve.as_mut() {
                        let wait = ready!(Pin::new(reservation).poll(cx));
                        *reserve = None;
                        call.reserved = true;
                        if !wait.is_zero() {
                            *sleep = sleep_for(wait);
                            continue;
                        }
                    }
                    let core = &call.shared.core;
                    if let Some(pending) = learn.as_mut() {
                        let grant = ready!(Pin::new(pending).poll(cx));
                        *learn = None;
                        let asked = call.ask.take();
                        let block = asked.as_ref().map_or(1, |asked| asked.block);
                        core.granted(&call.upstream, &grant, call.need, block);
                        // Another block may be asked for once this one's cells are credited.
                        drop(asked);
                        if !grant.hold.is_zero() {
                            // Another call is probing this key (cold start or recovery):
                            // ask again a random moment later, or when its lease ends.
                            if call.held.is_none() {
                                call.held = Some(Held::new(core));
                            }
                            let wait = grant.hold.mul_f64(0.5 + 0.5 * core.unit());
                            *sleep = sleep_for(wait.max(Duration::from_millis(1)));
                            let notify = core.answered.clone();
                            *answered = Some(Box::pin(async move { notify.notified().await }));
                            continue;
                        }
                        if grant.probe {
                            telemetry::probe(if grant.mode == 0 {
                                "cold_start"
                            } else {
                                "recovery"
                            });
                        }
                        call.probe = grant.probe;
                        call.learned = true;
                        call.charged = taken(call.need, &grant.limits);
                        if grant.mode == 2 {
                            telemetry::pacing_wait(grant.wait);
                        }
                        if !grant.wait.is_zero() {
                            call.paced_under = Some(grant.limits);
                            *relimit = Some(core.limits_changed());
                            *sleep = sleep_for(grant.wait);
                            continue;
                        }
                    }
                    if let Some(left) = core.store.cooldown(&call.upstream) {
                        // Held behind the gate. A retry with nothing else held goes when the
                        // gate reopens (it keeps the band its own delay was drawn in); the
                        // rest go at random points of a window (each worker from its own
                        // offset into it), after one probe for the whole fleet.
                        let lone = call.retries > 0 && !core.others_held(call.held.is_some());
                        if call.held.is_none() {
                            call.held = Some(Held::new(core));
                        }
                        core.note_at_limit(&call.upstream);
                        let wait = if lone {
                            left
                        } else {
                            core.release_after(&call.upstream, left)
                        };
                        telemetry::cooldown_wait(wait);
                        call.learned = false;
                        call.ask = None;
                        *sleep = sleep_for(wait.max(Duration::from_millis(1)));
                        continue;
                    }
                    if !call.learned {
                        let asked = match call.ask.take() {
                            Some(asked) => asked,
                            None => match core.admit_learned(&call.upstream, call.cost) {
                                Learned::Go(wait, need, charged) => {
                                    call.learned = true;
                                    call.need = need;
                                    call.charged = charged;
                                    if !wait.is_zero() {
                                        telemetry::pacing_wait(wait);
                                        call.paced_under = Some(core.limits_of(&call.upstream));
                                        *relimit = Some(core.limits_changed());
                                        *sleep = sleep_for(wait);
                                        continue;
                                    }
                                    Ask {
                                        ask: PaceAsk::default(),
                                        block: 0,
                                        _asked: None,
                                    }
                                }
                                Learned::Ask(asked, need) => {
                                    call.need = need;
                                    asked
                                }
                            },
                        };
                        if !call.learned {
                            // Not before this worker's release after the key's last
                            // reopening, unless nothing else is held.
                            if core.others_held(call.held.is_some())
                                && let Some(wait) = core.release_in(&call.upstream)
                            {
                                *sleep = sleep_for(wait.max(Duration::from_millis(1)));
                                continue;
                            }
                            *learn = Some(core.store.pace_learned(&call.upstream, &asked.ask));
                            call.ask = Some(asked);
                            continue;
                        }
                    }
                    if let Some(limits) = call.paced_under.take()
                        && core.limits_of(&call.upstream) != limits
                    {
                        // The limits changed while this call waited: ask again.
                        call.learned = false;
                        continue;
                    }
                    call.held = None;
                    if let Some(pacing) = core.shared_pacing()
                        && !call.reserved
                    {
                        let (limits, n) = pacing.limits(call.cost);
                        *reserve = Some(core.store.pace(&core.policy.upstream, &limits[..n]));
                        continue;
                    }
                    if let Some(pacer) = &core.pacer
                        && let Some(wait) = pacer.admit(&mut call.pace_step, call.cost)
                    {
                        *sleep = sleep_for(wait);
                        continue;
                    }
                    if let Err(e) = ready!(call.service.poll_ready(cx)) {
                        this.state.set(State::Done);
                        return Poll::Ready(Err(e.into()));
                    }
                    let Some(req) = call.next.take() else {
                        // Only reachable by polling after completion.
                        this.state.set(State::Done);
                        return Poll::Ready(Err(MissingJob.into()));
                    };
                    call.pace_step = 0;
                    call.reserved = false;
                    call.learned = false;
                    let fut = call.service.call(req);
                    this.state.set(State::Calling { fut });
                }
                StateProj::Backoff { sleep } => {
                    if let Some(timer) = sleep.as_mut() {
                        ready!(timer.as_mut().poll(cx));
                        *sleep = None;
                    }
                    if let Err(e) = ready!(call.service.poll_ready(cx)) {
                        this.state.set(State::Done);
                        return Poll::Ready(Err(e.into()));
                    }
                    let Some(req) = call.next.take() else {
                        // Only reachable by polling after completion.
                        this.state.set(State::Done);
                        return Poll::Ready(Err(MissingJob.into()));
                    };
                    let fut = call.service.call(req);
                    this.state.set(State::Calling { fut });
                }
                StateProj::Calling { fut } => {
                    let response = match ready!(fut.poll(cx)) {
                        Ok(response) => response,
                        Err(e) => {
                            call.probe = false;
                            this.state.set(State::Done);
                            return Poll::Ready(Err(e.into()));
                        }
                    };
                    if let Some(receipt) = call.attempt.as_ref().and_then(AttemptCell::take) {
                        // What the fair queue took for this attempt: its answer corrects
                        // the charges and, for a probe, tells the fleet.
                        call.probe = receipt.probe;
                        call.need = receipt.need;
                        call.charged = receipt.charged;
                        call.receipt = Some(receipt);
                    }
                    let outcome = call.judge(response.status(), response.headers());
                    let (head, body) = response.into_parts();
                    if outcome.retry.is_some() && outcome.status == StatusCode::TOO_MANY_REQUESTS {
                        // Only a 429 about to be retried is read ahead: it may be the spend
                        // limit, which must go back to the caller (with every byte).
                        let timeout = call.shared.core.policy.peek_timeout;
                        this.state.set(State::Peeking {
                            head: Some(head),
                            peeked: Some(Peeked::new(body)),
                            outcome,
                            deadline: tokio::time::sleep(timeout),
                        });
                    } else {
                        let response =
                            http::Response::from_parts(head, ResponseBody::passthrough(body));
                        this.state.set(call.settle(outcome, response, false));
                    }
                }
                StateProj::Peeking {
                    head,
                    peeked,
                    outcome,
                    deadline,
                } => {
                    let policy = &call.shared.core.policy;
                    // Why the reading stopped before the body could be judged, if it did.
                    let cut = match peeked.as_mut() {
                        Some(body) => {
                            match body.poll_fill(cx, policy.peek_limit, policy.peek_frame_limit) {
                                Poll::Ready(Filled::Read) => None,
                                Poll::Ready(Filled::FrameLimit) => Some("peek_frame_limit"),
                                Poll::Pending => {
                                    // The body's waker, or its own (a capped poll), is set;
                                    // the deadline's is set here.
                                    ready!(deadline.poll(cx));
                                    Some("peek_timeout")
                                }
                            }
                        }
                        None => None,
                    };
                    let (Some(head), Some(body)) = (head.take(), peeked.take()) else {
                        this.state.set(State::Done);
                        return Poll::Ready(Err(MissingJob.into()));
                    };
                    let spend_limit = decide::is_spend_limit_body(body.bytes());
                    let response = http::Response::from_parts(head, ResponseBody::replay(body));
                    let mut outcome = *outcome;
                    if let Some(reason) = cut
                        && !spend_limit
                    {
                        // Not judged: back to the caller as it is (see
                        // `BackoffPolicyBuilder::peek_frame_limit`).
                        telemetry::gave_up(reason);
                        outcome.retry = None;
                    }
                    this.state.set(call.settle(outcome, response, spend_limit));
                }
                StateProj::Recording {
                    throttle,
                    gate,
                    report,
                    then,
                } => {
                    // Both go to the store at once (one round trip each on Redis, side
                    // by side): wait until neither is pending.
                    if let Some(count) = throttle.as_mut()
                        && let Poll::Ready(count) = Pin::new(count).poll(cx)
                    {
                        telemetry::throttle_count(&call.tenant, count);
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
                        let core = &call.shared.core;
                        core.granted(&call.upstream, &grant, call.need, 1);
                        *report = None;
                        // Calls held behind this probe ask again now.
                        core.answered.notify_waiters();
                        core.gate_changed.notify_one();
                    }
                    if throttle.is_some() || gate.is_some() || report.is_some() {
                        return Poll::Pending;
                    }
                    // The gate and the learned bucket now say what this answer taught.
                    call.probe = false;
                    // The rate gate may let the next call go (a probe's answer is in).
                    call.receipt = None;
                    match then.take() {
                        Some(Then::Retry(delay)) => {
                            call.retries += 1;
                            call.charged = [0; DIMS];
                            call.next = call.spare.take();
                            // A retry is a new attempt: the layers below count its waits
                            // (a tier's max wait) from now, and it takes its own slot.
                            if let Some(job) = call.next.as_mut().and_then(|r| r.job_mut()) {
                                job.restamp();
                                // A fresh cell: the retry is a new attempt (after a throttle
                                // its key is recovering, so one is needed).
                                call.attempt = call
                                    .shared
                                    .core
                                    .attempt_cell(&call.upstream)
                                    .filter(|_| call.gated);
                                if let Some(cell) = &call.attempt {
                                    job.set_attempt(call.upstream.clone(), cell.clone());
                                }
                            }
                            call.spare = call
                                .next
                                .as_ref()
                                .and_then(|req| call.shared.cloner.clone_request(req));
                            if call.gated {
                                this.state.set(State::Backoff {
                                    sleep: sleep_for(delay),
                                });
                            } else {
                                this.state.set(State::Admitting {
                                    sleep: sleep_for(delay),
                                    reserve: None,
                                    learn: None,
                                    answered: None,
                                    relimit: None,
                                });
                            }
                        }
                        Some(Then::Return(response)) => {
                            this.state.set(State::Done);
                            return Poll::Ready(Ok(response));
                        }
                        None => {
                            this.state.set(State::Done);
                            return Poll::Ready(Err(MissingJob.into()));
                        }
                    }
                }
                StateProj::MissingJob | StateProj::Done => {
                    this.state.set(State::Done);
                    return Poll::Ready(Err(MissingJob.into()));
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
