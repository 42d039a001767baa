//! The API port: route, authenticate from the headers, then (and only then) read a body.
//!
//! - The path is checked and routed first (the `routes` module).
//! - The key is checked from the headers, failures slowed per address (the `auth` module);
//!   an unknown key is answered before a byte of the body is read.
//! - Each request then holds a claim on its key holder's share (the `holders` module):
//!   past `--key-max-requests` in progress, `429` before a byte of the body is read.
//! - `POST /v1/messages` buffers its body (so a throttled call can be sent again) within
//!   three bounds: one body at most `--max-body` (`413`, told at once from
//!   `content-length`); the bytes arrived so far of all the key holder's bodies at most
//!   `--key-body-budget` (`429`), of everyone's at most `--body-budget` (`529`), both with
//!   `retry-after`. What a body declares is not reserved, what arrives is. A body that
//!   stalls for `--body-idle-timeout`, or is not whole within `--body-timeout`, gets `408`;
//!   on shutdown a half-sent body gets `503` at once.
//! - Forwarded paths stream their body through, under the same idle timeout; the batch
//!   routes go to the `batches` module with the caller's key as their owner.
//! - Every answer is relayed through the key holder's answer buffer (the `answer` module):
//!   the call's slot and body bytes are given back at the upstream's last byte, and a
//!   client that stops reading is cut after `--write-timeout`.

use std::net::IpAddr;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use bytes::Bytes;
use fairgate::extract::{KeyTable, api_key};
use fairgate::pool::Pool;
use fairgate::pool::error::NoUpstream;
use fairgate::rate::UsageReader;
use fairgate::reject::{Style, render};
use fairgate::{BoxError, FairgateLayer, Job, Store, TenantId};
use futures_util::{FutureExt, StreamExt};
use http::header::{self, HeaderValue};
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, BodyStream, Full, StreamBody};
use hyper::body::Incoming;
use tokio::sync::watch;
use tower::util::BoxCloneSyncService;
use tower::{ServiceBuilder, ServiceExt, service_fn};
use tracing::{debug, info, warn};

use crate::admission::auth::{AuthGuard, Verdict};
use crate::admission::cost::settling;
use crate::admission::holders::{Claim, Held, Holders, Spent};
use crate::admission::identity::KeyPolicy;
use crate::body::Body;
use crate::config::Config;
use crate::ledger::flights::Flights;
use crate::ledger::record::{Probe, Recorder, Recording, Trace};
use crate::ledger::usage::Usage;
use crate::own_answer::error_response;
use crate::proxy::answer::relay;
use crate::proxy::batches::{Batches, Owner};
use crate::proxy::refusals::{self, Refused};
use crate::proxy::routes::{Route, route};
use crate::proxy::upstreams::{Member, Upstreams};
use crate::server::{Hangup, Holding, stopped};

/// `POST /v1/messages` through the stack: the buffered request in, the client's response out.
type Messages = BoxCloneSyncService<Request<Full<Bytes>>, Response<Body>, BoxError>;

/// What a keys file gives: replaced whole by a reload, while calls that began with the
/// previous one finish with it.
pub(crate) struct Live {
    pub(crate) config: Config,
    pub(crate) store: Store,
    /// The fair queue's handle: calls waiting and in flight, for the admin page.
    pub(crate) fair: fairgate::DrrFairnessLayer,
    /// The calls gone to the upstream whose answer has not ended, for the admin page.
    pub(crate) flights: Arc<Flights>,
    /// Settles each call's charge on its answer's usage (the `cost` module).
    settler: fairgate::drr_fairness::Settler,
    /// The upstreams' pool, built once at start: every `Live` holds the same one.
    pub(crate) pool: Pool<Member>,
    messages: Messages,
}

impl Live {
    /// The stack for `config` over `store`, its calls sent through `pool`.
    pub(crate) fn new(config: Config, store: Store, pool: &Pool<Member>) -> Result<Live, String> {
        let fairgate = Live::layer(&config, &store, pool)?;
        let fair = fairgate.fairness().clone();
        let settler = fairgate.settler();
        let upstreams = pool.clone();
        let flights = Arc::new(Flights::default());
        let in_flight = flights.clone();
        let send = service_fn(move |req: Request<Full<Bytes>>| {
            let pool = upstreams.clone();
            if let Some(probe) = req.extensions().get::<Probe>() {
                probe.dispatched();
            }
            // The job as the call went out (classified): its answer settles it, and what
            // it was given is told to the client.
            let job = req.extensions().get::<Job>().cloned();
            let applied = job.as_ref().map(|job| {
                let applied = Applied::of(job);
                debug!(tenant = %job.tenant(), class = applied.class, queued_ms = applied.queued_ms, "dispatched");
                applied
            });
            // In flight for the live page until the answer's last byte (or its drop).
            let flight = job.as_ref().map(|job| in_flight.begin(job));
            // Boxed here: inside the block, its type trips the compiler's `Send` check.
            let call = pool.oneshot(req).boxed();
            async move {
                let mut response = call.await?.map(BodyExt::boxed_unsync);
                if let Some(job) = job {
                    response.extensions_mut().insert(job);
                }
                let response = response.map(|body| {
                    body.map_frame(move |frame| {
                        let _in_flight = &flight;
                        frame
                    })
                    .boxed_unsync()
                });
                Ok::<_, BoxError>(match applied {
                    Some(applied) => applied.tell(response),
                    None => response,
                })
            }
        });
        // The job is the gateway's own extractor's (the `identity` module), put on the
        // request by `messages` before the stack.
        let stack = ServiceBuilder::new()
            // `--record`: the job as the stack admits it.
            .map_request(|req: Request<Full<Bytes>>| {
                if let (Some(probe), Some(job)) = (
                    req.extensions().get::<Probe>(),
                    req.extensions().get::<Job>(),
                ) {
                    probe.job(job);
                }
                req
            })
            .layer(fairgate)
            .service(send)
            .map_response(|response: Response<_>| {
                response.map(|body| body.map_err(Into::<BoxError>::into).boxed_unsync())
            });
        Ok(Live {
            config,
            store,
            fair,
            flights,
            settler,
            pool: pool.clone(),
            messages: BoxCloneSyncService::new(stack),
        })
    }

    /// The four layers for `config` over `store`, handed `pool`'s gate.
    fn layer(config: &Config, store: &Store, pool: &Pool<Member>) -> Result<FairgateLayer, String> {
        FairgateLayer::builder(store.clone())
            .slots(config.policy.clone())
            .window(config.window)
            .demotion(config.demotion.clone())
            // One fair order across the upstreams: each call goes to one with room now.
            .pool(pool.gate())
            // A call up to `[cost] max_charge` pays its whole charge before it goes.
            .fairness(|fair| {
                let quantum = fairgate::drr_fairness::SchedulerConfig::default().quantum;
                fair.max_charge_quanta(config.cost.max_charge_quanta(quantum))
            })
            .build()
            .map_err(|e| format!("bad limits: {e}"))
    }

    pub(crate) fn keys(&self) -> &KeyTable {
        &self.config.keys
    }
}

/// The API port's limits on request bodies and answers.
#[derive(Clone, Copy, Debug)]
pub(crate) struct BodyLimits {
    pub(crate) max_body: usize,
    /// How long a body may stall between two reads.
    pub(crate) idle: Duration,
    /// How long a buffered (`/v1/messages`) body may take in all.
    pub(crate) total: Duration,
    /// How long an answer may wait with nothing of it read by the client.
    pub(crate) write: Duration,
}

/// The first bytes reserved for a body; more are taken as they arrive.
const FIRST_RESERVATION: usize = 64 * 1024;

/// Everything the API port's requests share.
pub(crate) struct Gateway {
    live: RwLock<Arc<Live>>,
    /// Where calls go: the pool for the messages, its Anthropic upstreams for the rest.
    pub(crate) upstreams: Arc<Upstreams>,
    /// What each key holder holds of the shared resources, and the gateway's bounds.
    pub(crate) holders: Holders,
    pub(crate) auth: AuthGuard,
    pub(crate) bodies: BodyLimits,
    pub(crate) shutdown: watch::Receiver<bool>,
    pub(crate) reloads: AtomicU64,
    pub(crate) failed_reloads: AtomicU64,
    /// `--record`: where each admitted call's line goes.
    pub(crate) recorder: Option<Arc<Recorder>>,
    /// The batch routes' owner book.
    pub(crate) batches: Batches,
    /// What each tenant used, per day, for billing (`GET /usage`).
    pub(crate) usage: Usage,
}

impl Gateway {
    // Each argument is a part of its own, built from its own flags.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        live: Live,
        upstreams: Arc<Upstreams>,
        holders: Holders,
        auth: AuthGuard,
        bodies: BodyLimits,
        shutdown: watch::Receiver<bool>,
        recorder: Option<Arc<Recorder>>,
        (batches, usage): (Batches, Usage),
    ) -> Gateway {
        Gateway {
            live: RwLock::new(Arc::new(live)),
            upstreams,
            holders,
            auth,
            bodies,
            shutdown,
            reloads: AtomicU64::new(0),
            failed_reloads: AtomicU64::new(0),
            recorder,
            batches,
            usage,
        }
    }

    /// The keys, limits and stack in force now.
    pub(crate) fn live(&self) -> Arc<Live> {
        self.live.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Puts `live` in force for the calls that begin from now on.
    pub(crate) fn replace(&self, live: Live) {
        *self.live.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(live);
    }

    pub(crate) fn draining(&self) -> bool {
        *self.shutdown.borrow()
    }
}

fn with_retry_after(mut response: Response<Body>, wait: Duration) -> Response<Body> {
    let secs = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
    response
        .headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from(secs.max(1)));
    response
}

fn closing(mut response: Response<Body>) -> Response<Body> {
    response
        .headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    response
}

/// The answer to an error of the stack: a fairgate rejection as the library renders it, no
/// upstream with room as `529 overloaded_error` (as `Busy`: the SDKs retry it, after its
/// `retry-after`), anything else as a failed upstream call (`502`).
fn rendered(error: &BoxError) -> Response<Body> {
    if let Some(none) = no_upstream(error) {
        metrics::counter!("gateway_upstream_none_total").increment(1);
        let wait = none.retry_after.unwrap_or(Duration::from_secs(1));
        let mut response = with_retry_after(
            error_response(
                StatusCode::from_u16(529).unwrap_or(StatusCode::SERVICE_UNAVAILABLE),
                "overloaded_error",
                "no upstream has room for the call",
            ),
            wait,
        );
        let ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX).max(1);
        response
            .headers_mut()
            .insert("retry-after-ms", HeaderValue::from(ms));
        return response;
    }
    // The library's rendering, its `request_id` added as the API's errors carry one.
    let (parts, body) = render(error, Style::Anthropic).into_parts();
    crate::own_answer::error_answer(parts.status, parts.headers, &body)
}

/// The pool's `NoUpstream` in `error` or its sources.
fn no_upstream(error: &BoxError) -> Option<&NoUpstream> {
    let mut current: Option<&(dyn std::error::Error + 'static)> = Some(&**error);
    while let Some(error) = current {
        if let Some(none) = error.downcast_ref::<NoUpstream>() {
            return Some(none);
        }
        current = error.source();
    }
    None
}

/// Answers one request of the API port.
pub(crate) async fn handle(
    gw: Arc<Gateway>,
    peer: IpAddr,
    req: Request<Incoming>,
) -> Response<Body> {
    let route = route(req.method(), req.uri().path());
    let response = answer(gw, peer, req, route).await;
    refusals::log(route.name(), &response);
    response
}

/// The answer to `req` on `route`.
async fn answer(
    gw: Arc<Gateway>,
    peer: IpAddr,
    req: Request<Incoming>,
    route: Route,
) -> Response<Body> {
    match route {
        Route::NotCanonical => {
            return closing(error_response(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                "the path is not in canonical form (no empty, `.` or `..` segments, no \
                 percent-encoding, no `;`, no trailing `/`)",
            ));
        }
        Route::NotFound => {
            return error_response(StatusCode::NOT_FOUND, "not_found_error", "not found");
        }
        Route::Messages | Route::Batch(_) | Route::Forward => {}
    }
    let live = gw.live();
    if let Some(refused) = refused_key(&gw, peer, &req, &live) {
        return refused;
    }
    // Hashed once for the holder and the key's policy.
    let sha256 = api_key(&req).map(KeyTable::sha256);
    let found = sha256.as_ref().and_then(|sha256| {
        let (holder, _) = live.keys().get_sha256(sha256)?;
        Some((
            holder.clone(),
            live.config.identities.get_sha256(sha256)?.clone(),
        ))
    });
    let Some((holder, policy)) = found else {
        // Checked just above; a reload in between is the only way here.
        return closing(rendered(&BoxError::from(
            fairgate::extract::Unidentified::new("unknown api key"),
        )));
    };
    let Some(claim) = gw.holders.begin(&holder) else {
        metrics::counter!("gateway_key_refusals_total", "reason" => "requests").increment(1);
        return closing(with_retry_after(
            error_response(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                "this key has as many requests in progress as it may hold",
            ),
            Duration::from_secs(1),
        ));
    };
    let claim = Arc::new(claim);
    let hangup = req.extensions().get::<Hangup>().cloned();
    let response = match route {
        Route::Messages => return messages(&gw, live, policy, req, claim).await,
        Route::Batch(batch) => {
            let Some(owner) = api_key(&req).map(|key| Owner::of(key, holder.as_str())) else {
                return error_response(
                    StatusCode::UNAUTHORIZED,
                    "authentication_error",
                    "no api key",
                );
            };
            let req = req.map(|body| streamed(&gw, body));
            gw.batches.handle(&gw.upstreams, batch, &owner, req).await
        }
        _ => forward(&gw, req).await,
    };
    response.map(|body| {
        let body = relay(body, (), claim.clone(), gw.bodies.write, hangup);
        Holding::new(body, claim).boxed_unsync()
    })
}

/// The key check: the answer to an unknown key (`401`) or a slowed one (`429`), if any.
fn refused_key(
    gw: &Gateway,
    peer: IpAddr,
    req: &Request<Incoming>,
    live: &Live,
) -> Option<Response<Body>> {
    match gw.auth.check(peer, api_key(req), live.keys()) {
        Verdict::Known => None,
        Verdict::Unknown => {
            metrics::counter!("gateway_auth_failures_total", "answer" => "401").increment(1);
            let reason = if api_key(req).is_some() {
                "unknown api key"
            } else {
                "no api key"
            };
            // The body is never read: the connection closes after the answer.
            Some(closing(rendered(&BoxError::from(
                fairgate::extract::Unidentified::new(reason),
            ))))
        }
        Verdict::Slowed(wait) => {
            metrics::counter!("gateway_auth_failures_total", "answer" => "429").increment(1);
            Some(closing(with_retry_after(
                error_response(
                    StatusCode::TOO_MANY_REQUESTS,
                    "rate_limit_error",
                    "too many failed authentications",
                ),
                wait,
            )))
        }
    }
}

/// Why a body was not buffered.
enum Unread {
    TooLarge,
    /// The key holder's body bytes, or the gateway's.
    OverBudget(Spent),
    Stalled,
    ShuttingDown,
    Failed(hyper::Error),
}

/// Reads `body` into one buffer, within the size limit and the budgets of `claim`.
async fn buffer(
    gw: &Gateway,
    body: &mut Incoming,
    declared: Option<usize>,
    claim: &Claim,
) -> Result<(Bytes, Held), Unread> {
    let max = gw.bodies.max_body;
    if declared.is_some_and(|len| len > max) {
        return Err(Unread::TooLarge);
    }
    // What arrives is paid for, not what is declared: a body that declares 32 MiB and
    // trickles holds what it has sent.
    let mut held = declared.unwrap_or(0).clamp(1, FIRST_RESERVATION);
    let mut permit = claim.take_body(held).map_err(Unread::OverBudget)?;
    let mut buf: Vec<u8> = Vec::with_capacity(held);
    let mut shutdown = gw.shutdown.clone();
    // A body trickled just fast enough never idles: it must also end within the total.
    let deadline = tokio::time::sleep(gw.bodies.total);
    tokio::pin!(deadline);
    loop {
        let frame = tokio::select! {
            frame = tokio::time::timeout(gw.bodies.idle, body.frame()) => frame,
            _ = &mut deadline => return Err(Unread::Stalled),
            _ = stopped(&mut shutdown) => return Err(Unread::ShuttingDown),
        };
        let data = match frame {
            Err(_) => return Err(Unread::Stalled),
            Ok(None) => break,
            Ok(Some(Err(e))) => return Err(Unread::Failed(e)),
            Ok(Some(Ok(frame))) => match frame.into_data() {
                Ok(data) => data,
                Err(_) => continue, // trailers
            },
        };
        let needed = buf.len() + data.len();
        if needed > max {
            return Err(Unread::TooLarge);
        }
        if needed > held {
            // Grow by doubling (as a Vec would), every byte of it paid from the budget first.
            let grown = needed.max(held.saturating_mul(2)).min(max);
            let more = claim.take_body(grown - held).map_err(Unread::OverBudget)?;
            permit.merge(more);
            held = grown;
            buf.reserve_exact(grown - buf.len());
        }
        buf.extend_from_slice(&data);
    }
    Ok((Bytes::from(buf), permit))
}

/// Reads and drops what is left of a refused body (at most `limit` bytes, each frame within
/// `idle`), so the client, still sending, reads the answer instead of a reset connection.
async fn discard(mut body: Incoming, limit: u64, idle: Duration) {
    let mut read = 0u64;
    while read < limit {
        match tokio::time::timeout(idle, body.frame()).await {
            Ok(Some(Ok(frame))) => {
                read += frame.data_ref().map_or(0, |d| d.len() as u64);
            }
            _ => break,
        }
    }
}

async fn messages(
    gw: &Gateway,
    live: Arc<Live>,
    policy: Arc<KeyPolicy>,
    req: Request<Incoming>,
    claim: Arc<Claim>,
) -> Response<Body> {
    let (mut parts, mut body) = req.into_parts();
    let hangup = parts.extensions.get::<Hangup>().cloned();
    let declared = declared_length(&parts.headers);
    let (bytes, permit) = match buffer(gw, &mut body, declared, &claim).await {
        Ok(read) => read,
        Err(unread) => return unread_response(gw, unread, &parts.headers, body),
    };
    let size = bytes.len();
    let estimate = match live
        .config
        .cost
        .estimate(&parts.headers, &bytes, gw.bodies.max_body)
    {
        Ok(estimate) => estimate,
        Err(refused) => return refused.response(),
    };
    let job = match policy.identify(&parts.headers, estimate.user()) {
        Ok(job) => estimate.apply(job),
        Err(refused) => return refused.response(),
    };
    if estimate.stream() {
        // A stream is asked for uncompressed (a client that accepts gzip accepts that
        // too): cut by its upstream, it can then end with an error event as the API's do.
        parts.headers.insert(
            header::ACCEPT_ENCODING,
            HeaderValue::from_static("identity"),
        );
    }
    let tenant = job.tenant().clone();
    let tier = job.tier().cloned();
    let model = gw.upstreams.model(&bytes);
    let mut req = Request::from_parts(parts, Full::new(bytes));
    req.extensions_mut().insert(job);
    if let Some(model) = model {
        req.extensions_mut().insert(model);
    }
    let started = tokio::time::Instant::now();
    let trace = gw.recorder.as_ref().map(|recorder| recorder.begin());
    if let Some(trace) = &trace {
        req.extensions_mut().insert(trace.probe());
    }
    match live.messages.clone().oneshot(req).await {
        Ok(response) => {
            let response = settling(
                response,
                (&live.settler, &gw.usage),
                &live.config.cost,
                estimate,
            );
            debug!(
                status = response.status().as_u16(),
                bytes = size,
                ms = started.elapsed().as_millis() as u64,
                "POST /v1/messages"
            );
            let relayed = Relayed {
                permit,
                claim,
                hangup,
                trace,
            };
            to_client(gw, (&live, &tenant), response, relayed)
        }
        Err(error) => refused_by_stack(&error, trace, tenant, tier),
    }
}

/// The answer to a call the stack refused (or the upstream failed), marked with who it
/// was for and why, for its log line (`refusals`).
fn refused_by_stack(
    error: &BoxError,
    trace: Option<Trace>,
    tenant: TenantId,
    tier: Option<fairgate::Tier>,
) -> Response<Body> {
    let mut response = failed(error, trace);
    let tier = match error.downcast_ref::<fairgate::Busy>() {
        Some(busy) => Some(busy.tier().clone()),
        None => tier,
    };
    response.extensions_mut().insert(Refused {
        tenant,
        tier,
        reason: error.to_string(),
    });
    response
}

/// What the relay of an answer to its client holds and needs.
struct Relayed {
    /// The request body's bytes, given back at the upstream's last byte.
    permit: Held,
    claim: Arc<Claim>,
    hangup: Option<Hangup>,
    trace: Option<Trace>,
}

/// The answer as the client gets it: the tenant's budget left told; an SSE stream its
/// upstream cuts ended with an error event; relayed through the holder's buffer (the slot,
/// the window permit and the body's bytes come back at the upstream's last byte, the claim
/// at the client's); recorded with `--record`.
fn to_client(
    gw: &Gateway,
    (live, tenant): (&Live, &TenantId),
    mut response: Response<Body>,
    relayed: Relayed,
) -> Response<Body> {
    let status = response.status().as_u16();
    let sse = is_plain_sse(response.headers());
    if let Some(left) = budget_left(live, tenant) {
        response
            .headers_mut()
            .insert("x-fairgate-budget-remaining", HeaderValue::from(left));
    }
    let Relayed {
        permit,
        claim,
        hangup,
        trace,
    } = relayed;
    let trace = trace.map(|trace| (trace, UsageReader::new(response.headers())));
    response.map(|body| {
        let body = match sse {
            true => crate::proxy::cut_stream::ended_as_the_api_ends(body),
            false => body,
        };
        let body = relay(body, permit, claim.clone(), gw.bodies.write, hangup);
        let body = Holding::new(body, claim).boxed_unsync();
        match trace {
            Some((trace, usage)) => Recording::new(body, (status, usage), trace).boxed_unsync(),
            None => body,
        }
    })
}

/// What a call was given, told to the client on its answer (`x-fairgate-tier`,
/// `x-fairgate-class`, `x-fairgate-queued-ms`): read from the job at dispatch, no store
/// round trip.
struct Applied {
    tier: Option<HeaderValue>,
    class: Option<&'static str>,
    queued_ms: u64,
}

impl Applied {
    fn of(job: &Job) -> Applied {
        Applied {
            // Tier names are checked header-safe by the keys file; one that is not is left out.
            tier: job
                .tier()
                .and_then(|tier| HeaderValue::from_str(tier.as_str()).ok()),
            class: job.priority().map(fairgate::Priority::as_str),
            queued_ms: job
                .arrived_at()
                .map_or(0, |at| at.elapsed().as_millis() as u64),
        }
    }

    fn tell(self, mut response: Response<Body>) -> Response<Body> {
        let headers = response.headers_mut();
        if let Some(tier) = self.tier {
            headers.insert("x-fairgate-tier", tier);
        }
        if let Some(class) = self.class {
            headers.insert("x-fairgate-class", HeaderValue::from_static(class));
        }
        headers.insert("x-fairgate-queued-ms", HeaderValue::from(self.queued_ms));
        response
    }
}

/// The input tokens left of `tenant`'s daily budget (this call counted), as the store
/// knows it without a round trip: exact in process; on Redis as of this gateway's last
/// demotion check of the tenant, with this gateway's own calls since (`Store::budget_left`).
fn budget_left(live: &Live, tenant: &TenantId) -> Option<u64> {
    live.store.budget_left(tenant, &live.config.demotion)
}

/// Whether an answer is an uncompressed SSE stream (an error event can be added to it).
fn is_plain_sse(headers: &http::HeaderMap) -> bool {
    let sse = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim_start().starts_with("text/event-stream"));
    let plain = headers
        .get(header::CONTENT_ENCODING)
        .is_none_or(|v| v.as_bytes().eq_ignore_ascii_case(b"identity"));
    sse && plain
}

/// The body's length as its `Content-Length` declares it, if it does.
fn declared_length(headers: &http::HeaderMap) -> Option<usize> {
    headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        .map(|len| usize::try_from(len).unwrap_or(usize::MAX))
}

/// The answer to a body that was not read in full, and the connection closed after it.
fn unread_response(
    gw: &Gateway,
    unread: Unread,
    headers: &http::HeaderMap,
    body: Incoming,
) -> Response<Body> {
    match unread {
        Unread::TooLarge => {
            // An authenticated client: read the rest of its body away (no buffering) so
            // that it sees the 413, unless it waits for `100 Continue`, which it then
            // never gets.
            let expects = headers.contains_key(header::EXPECT);
            if !expects {
                tokio::spawn(discard(body, 1 << 30, gw.bodies.idle));
            }
            let mb = gw.bodies.max_body >> 20;
            closing(error_response(
                StatusCode::PAYLOAD_TOO_LARGE,
                "request_too_large",
                &format!("request body is larger than the gateway's {mb} MiB limit"),
            ))
        }
        Unread::OverBudget(Spent::Key) => {
            metrics::counter!("gateway_key_refusals_total", "reason" => "body_bytes").increment(1);
            info!("refused: the key's body budget is spent");
            closing(with_retry_after(
                error_response(
                    StatusCode::TOO_MANY_REQUESTS,
                    "rate_limit_error",
                    "this key's request bodies in progress hold as many bytes as it may buffer",
                ),
                Duration::from_secs(1),
            ))
        }
        Unread::OverBudget(Spent::Gateway) => {
            metrics::counter!("gateway_body_budget_refusals_total").increment(1);
            info!("refused: the body budget is spent");
            closing(with_retry_after(
                error_response(
                    StatusCode::from_u16(529).unwrap_or(StatusCode::SERVICE_UNAVAILABLE),
                    "overloaded_error",
                    "the gateway is buffering too many request bodies",
                ),
                Duration::from_secs(1),
            ))
        }
        Unread::Stalled => closing(error_response(
            StatusCode::REQUEST_TIMEOUT,
            "invalid_request_error",
            "the request body stopped arriving",
        )),
        Unread::ShuttingDown => closing(error_response(
            StatusCode::SERVICE_UNAVAILABLE,
            "overloaded_error",
            "the gateway is shutting down",
        )),
        Unread::Failed(e) => {
            debug!(error = %e, "reading a request body failed");
            closing(error_response(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                "could not read the request body",
            ))
        }
    }
}

/// The answer to a call the stack refused or the upstream failed: rendered, recorded and
/// logged.
fn failed(error: &BoxError, trace: Option<Trace>) -> Response<Body> {
    let response = rendered(error);
    if let Some(trace) = trace {
        trace.finish(response.status().as_u16(), (None, None));
    }
    // A refusal is logged with its request id where the answer leaves (`refusals`).
    if response.status() == StatusCode::BAD_GATEWAY {
        warn!(error = %error, "upstream call failed");
    }
    response
}

/// A request body passed through as it comes, each frame within the idle timeout, cut on
/// shutdown.
fn streamed(gw: &Gateway, body: Incoming) -> Body {
    let idle = gw.bodies.idle;
    let shutdown = gw.shutdown.clone();
    let frames = BodyStream::new(body);
    let stream = futures_util::stream::unfold(
        (frames, shutdown, false),
        move |(mut frames, mut shutdown, done)| async move {
            if done {
                return None;
            }
            let next = tokio::select! {
                next = tokio::time::timeout(idle, frames.next()) => Some(next),
                _ = stopped(&mut shutdown) => None,
            };
            let Some(next) = next else {
                let cut: BoxError = "the gateway is shutting down".into();
                return Some((Err(cut), (frames, shutdown, true)));
            };
            match next {
                Err(_) => {
                    let stalled: BoxError = "the request body stopped arriving".into();
                    Some((Err(stalled), (frames, shutdown, true)))
                }
                Ok(None) => None,
                Ok(Some(frame)) => Some((frame.map_err(BoxError::from), (frames, shutdown, false))),
            }
        },
    );
    StreamBody::new(stream).boxed_unsync()
}

async fn forward(gw: &Gateway, req: Request<Incoming>) -> Response<Body> {
    let req = req.map(|body| streamed(gw, body));
    match gw.upstreams.forward(req).await {
        Ok(response) => response,
        Err(error) => {
            warn!(error = %error, "upstream call failed");
            rendered(&error)
        }
    }
}

/// Checks the tenants' demotions now and then, so `claude_demoted_tenants` follows
/// demotions that begin (on another gateway) or run out while a tenant sends nothing (the
/// store publishes the gauge when it is used). The tenants are the store's served most
/// (end users of a service included, whom the keys file never names), then the keys file's;
/// at most `per_tick` a tick, in turn.
pub(crate) async fn demotion_tick(gw: Arc<Gateway>, every: Duration, per_tick: usize) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut next = 0usize;
    loop {
        tick.tick().await;
        let live = gw.live();
        let top = live.store.top_served(fairgate::store::TOP_SERVED_MAX).await;
        let tenants = tick_tenants(top.tenants, &live.config.tenants);
        if tenants.is_empty() {
            continue;
        }
        for _ in 0..per_tick.min(tenants.len()) {
            next %= tenants.len();
            let _ = live
                .store
                .check_demotion(&tenants[next], &live.config.demotion)
                .await;
            next += 1;
        }
    }
}

/// The tenants a demotion tick walks: the served most, then the keys file's, each once.
fn tick_tenants(served: Vec<(TenantId, u64)>, listed: &[String]) -> Vec<TenantId> {
    let mut tenants: Vec<TenantId> = served.into_iter().map(|(tenant, _)| tenant).collect();
    let seen: std::collections::HashSet<TenantId> = tenants.iter().cloned().collect();
    tenants.extend(
        listed
            .iter()
            .map(TenantId::new)
            .filter(|tenant| !seen.contains(tenant)),
    );
    tenants
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn an_own_error_is_json_whatever_its_message_holds() {
        let response = error_response(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "a \"quoted\" \\ message\n",
        );
        let body = response.into_body().collect().await.unwrap().to_bytes();
        let parsed: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(parsed["error"]["message"], "a \"quoted\" \\ message\n");
        assert_eq!(parsed["error"]["type"], "invalid_request_error");
    }

    #[test]
    fn the_demotion_tick_walks_the_served_most_then_the_keys_files_tenants_once_each() {
        let t = TenantId::new;
        let served = vec![(t("svc/ab12"), 30), (t("team-a"), 20)];
        let listed = ["svc".to_owned(), "team-a".to_owned(), "team-b".to_owned()];
        assert_eq!(
            tick_tenants(served, &listed),
            [t("svc/ab12"), t("team-a"), t("svc"), t("team-b")]
        );
    }
}
