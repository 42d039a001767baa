//! The pool as a tower service: which upstream a call goes to, and what its answer says of
//! that upstream.

use std::sync::Arc;
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
        let tenant = request
            .extensions()
            .get::<Job>()
            .map(|job| job.tenant().clone());
        let model = request
            .extensions()
            .get::<super::Model>()
            .map(|m| m.0.clone());
        ResponseFuture::new(self.shared.clone(), request, tenant, model)
    }
}

impl<S> Members<S> {
    /// The upstream the call goes to, not among `tried` (a bit per upstream), its count
    /// taken; `NoUpstream` when none has room.
    pub(super) fn pick(
        self: &Arc<Self>,
        tried: u64,
        tenant: Option<&TenantId>,
        model: Option<&str>,
    ) -> Result<Dispatch<S>, NoUpstream> {
        let now = Instant::now();
        let mut excluded = tried;
        let affinity = tenant.and_then(|t| lock(&self.affinity).get(t).copied());
        loop {
            let candidates: Vec<Candidate> = self
                .members
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
                        max_in_flight: m.upstream.max_in_flight,
                        weight: m.upstream.weight,
                        priority: m.upstream.priority,
                    }
                })
                .collect();
            let Some(member) = choose(&candidates, affinity) else {
                return Err(self.none_has_room(now, model));
            };
            let chosen = &self.members[member];
            let probe = match lock(&chosen.breaker).admit(now) {
                Admit::Call => false,
                Admit::Probe => true,
                // Another call took its probe meanwhile: choose again without it.
                Admit::No(_) => {
                    excluded |= 1 << member;
                    continue;
                }
            };
            // Its place, checked against its cap and taken in one step: another thread may
            // have taken the last one since the choice.
            let Some(in_flight) = InFlight::take(&chosen.in_flight, chosen.upstream.max_in_flight)
            else {
                if probe {
                    lock(&chosen.breaker).probe_dropped(now);
                }
                excluded |= 1 << member;
                continue;
            };
            if let Some(tenant) = tenant {
                self.remember(tenant, member);
            }
            return Ok(Dispatch {
                shared: self.clone(),
                member,
                probe,
                in_flight: Some(in_flight),
            });
        }
    }

    /// When the first upstream set aside that serves `model` may be probed.
    fn none_has_room(&self, now: Instant, model: Option<&str>) -> NoUpstream {
        let first_probe = self
            .members
            .iter()
            .filter(|m| m.serves(model))
            .filter_map(|m| match lock(&m.breaker).clone().admit(now) {
                Admit::No(at) => Some(at),
                Admit::Call | Admit::Probe => None,
            })
            .min();
        NoUpstream {
            retry_after: first_probe.map(|at| at.saturating_duration_since(now)),
        }
    }
}
