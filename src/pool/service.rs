//! The pool as a tower service: which upstream a call goes to, and what its answer says of
//! that upstream.

use std::task::{Context, Poll};

use tokio::time::Instant;
use tower_service::Service;

use super::breaker::Admit;
use super::choose::{Candidate, choose};
use super::error::NoUpstream;
use super::future::{Dispatch, InFlight, ResponseFuture};
use super::{Members, Pool};
use crate::body::GuardedBody;
use crate::error::BoxError;
use crate::sync::lock;
use crate::{Job, TenantId};

impl<S, B, R> Service<http::Request<B>> for Pool<S>
where
    S: Service<http::Request<B>, Response = http::Response<R>> + Clone,
    S::Error: Into<BoxError>,
    B: Clone,
{
    type Response = http::Response<GuardedBody<R, InFlight>>;
    type Error = BoxError;
    type Future = ResponseFuture<S, B>;

    /// Always ready: each call readies its upstream's service in its future.
    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let job = request.extensions().get::<Job>();
        let tenant = job.map(|job| job.tenant().clone());
        // A rate gate over this pool chose the upstream and took its place there.
        let routed = job
            .and_then(Job::route)
            .and_then(|route| super::gate::routed_place(route, self.shared.id));
        let model = request
            .extensions()
            .get::<super::Model>()
            .map(|m| m.0.clone());
        // The gate does not know the call's model: a place at an upstream that does not
        // serve it goes back, and the call is sent as if no gate had chosen.
        let routed = routed.filter(|place| place.state.serves(model.as_deref()));
        let mut future = ResponseFuture::new(
            self.shared.clone(),
            self.services.clone(),
            request,
            tenant,
            model,
        );
        if let Some(routed) = routed {
            future = future.routed(routed);
        }
        future
    }
}

impl Members {
    /// Each upstream as the choice sees it at `now`; those in `excluded` (a bit per
    /// upstream) take no call.
    pub(super) fn candidates(
        &self,
        now: Instant,
        excluded: u64,
        model: Option<&str>,
    ) -> Vec<Candidate> {
        self.members
            .iter()
            .enumerate()
            .map(|(i, m)| {
                let breaker = lock(&m.breaker);
                let takes_calls = excluded & (1 << i) == 0 && breaker.would_admit(now);
                Candidate {
                    takes_calls,
                    probe_due: takes_calls && breaker.is_open(),
                    serves: m.serves(model),
                    in_flight: m.in_flight(),
                    max_in_flight: m.max_in_flight,
                    weight: m.weight,
                    priority: m.priority,
                }
            })
            .collect()
    }

    /// A place at `member` for a call: its probe if one is due, and its count checked
    /// against its cap and taken in one step (another thread may have taken the last one
    /// since the choice). `None` when it was lost meanwhile.
    pub(super) fn take(&self, member: usize, now: Instant) -> Option<Dispatch> {
        let state = &self.members[member];
        let probe = match lock(&state.breaker).admit(now) {
            Admit::Call => false,
            Admit::Probe => true,
            // Another call took its probe meanwhile.
            Admit::No(_) => return None,
        };
        let Some(in_flight) = InFlight::take(state) else {
            if probe {
                lock(&state.breaker).probe_dropped(now);
            }
            return None;
        };
        Some(Dispatch {
            state: state.clone(),
            member,
            probe,
            in_flight: Some(in_flight),
        })
    }

    /// The upstream the call goes to, not among `tried` (a bit per upstream), its count
    /// taken; `NoUpstream` when none has room.
    pub(super) fn pick(
        &self,
        tried: u64,
        tenant: Option<&TenantId>,
        model: Option<&str>,
    ) -> Result<Dispatch, NoUpstream> {
        let now = Instant::now();
        let mut excluded = tried;
        let affinity = tenant.and_then(|t| lock(&self.affinity).get(t).copied());
        loop {
            let candidates = self.candidates(now, excluded, model);
            let Some(member) = choose(&candidates, affinity) else {
                return Err(self.none_has_room(now, model));
            };
            let Some(dispatch) = self.take(member, now) else {
                // Choose again without it.
                excluded |= 1 << member;
                continue;
            };
            if let Some(tenant) = tenant {
                self.remember(tenant, member);
            }
            return Ok(dispatch);
        }
    }

    /// When the first upstream set aside that serves `model` may be probed.
    pub(super) fn none_has_room(&self, now: Instant, model: Option<&str>) -> NoUpstream {
        NoUpstream {
            retry_after: self
                .first_probe(now, model)
                .map(|at| at.saturating_duration_since(now)),
        }
    }

    /// When the first upstream set aside that serves `model` may be probed, if one is.
    pub(super) fn first_probe(&self, now: Instant, model: Option<&str>) -> Option<Instant> {
        self.members
            .iter()
            .filter(|m| m.serves(model))
            .filter_map(|m| match lock(&m.breaker).clone().admit(now) {
                Admit::No(at) => Some(at),
                Admit::Call | Admit::Probe => None,
            })
            .min()
    }
}
