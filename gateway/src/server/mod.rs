//! Connections: accepted up to a cap, timed out when they idle, closed at once on shutdown
//! when nothing real runs on them.
//!
//! Each listener has a [`Connections`] table. A connection is *idle* while no request of
//! it is being served (between requests, or while a request's head is still arriving). A
//! sweeper closes idle connections whose head has taken longer than the header timeout
//! (a trickled head, or a new connection that sends nothing) or that sent nothing for the
//! keep-alive timeout after a request. At the cap, a new connection closes the oldest idle
//! one, preferring one never served a request (so a flood of idle sockets cannot lock a
//! client out, nor push a client's pooled connections out first); when none can be closed,
//! the new one waits in the [`pen`] for its request's head, then is answered `529` with
//! `retry-after` and closed (never left to time out). On
//! shutdown idle connections close at once; the others finish their request (bounded by
//! the drain time).
//!
//! A request carries a [`Hangup`] for its connection: the answer's relay (`answer.rs`)
//! uses it to close a connection whose client stopped reading, which no timeout of
//! hyper's would ever close.

use std::collections::BTreeMap;
use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use fairgate::BoxError;
use http_body::{Frame, SizeHint};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tracing::{debug, info, warn};

use crate::body::Body;
use pen::Pen;

mod pen;

/// The largest request head (and read buffer) a connection holds: Anthropic's requests
/// have small heads, and a trickled head costs at most this much.
const MAX_HEAD: usize = 32 * 1024;

/// How long a connection never served must have been open, and a served one idle, before
/// a newcomer at the cap may close it: a client's request is read well within the first,
/// and a pooled connection is reused well within the second.
const EVICTABLE_AFTER: [Duration; 2] = [Duration::from_millis(250), Duration::from_secs(1)];

/// How a listener treats its connections.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ConnLimits {
    pub(crate) max: usize,
    pub(crate) header_timeout: Duration,
    pub(crate) keep_alive: Duration,
}

/// One connection's state, shared by its task, its IO and the sweeper.
struct Conn {
    /// Requests of it being served (0 or 1 on HTTP/1.1 without pipelining).
    active: AtomicUsize,
    /// When it last became idle, in ms after the table's epoch.
    idle_since: AtomicU64,
    /// When the bytes of the next request's head began (ms after the epoch, plus 1; 0: none).
    head_started: AtomicU64,
    /// Whether a request of it has been served (or is being served).
    served: AtomicBool,
    /// Close when idle (timed out, evicted).
    close: Notify,
    /// Close now, whatever it is doing ([`Hangup`]).
    cut: Notify,
}

/// The connections of one listener.
pub(crate) struct Connections {
    name: &'static str,
    limits: ConnLimits,
    epoch: Instant,
    table: Mutex<BTreeMap<u64, Arc<Conn>>>,
    next: AtomicU64,
    /// Closed to make room for a newer one, timed out, refused at the cap.
    pub(crate) evicted: AtomicU64,
    pub(crate) timed_out: AtomicU64,
    pub(crate) refused: AtomicU64,
}

impl Connections {
    pub(crate) fn new(name: &'static str, limits: ConnLimits) -> Arc<Connections> {
        Arc::new(Connections {
            name,
            limits,
            epoch: Instant::now(),
            table: Mutex::new(BTreeMap::new()),
            next: AtomicU64::new(0),
            evicted: AtomicU64::new(0),
            timed_out: AtomicU64::new(0),
            refused: AtomicU64::new(0),
        })
    }

    pub(crate) fn limits(&self) -> ConnLimits {
        self.limits
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, Arc<Conn>>> {
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Connections open now.
    pub(crate) fn open(&self) -> usize {
        self.lock().len()
    }

    /// Registers a new connection, closing the oldest idle one at the cap; `None` when the
    /// cap is reached and every connection is serving a request.
    fn admit(&self) -> Option<(u64, Arc<Conn>)> {
        let mut table = self.lock();
        if table.len() >= self.limits.max && !self.evict_oldest_idle(&mut table) {
            self.refused.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let now = self.now_ms();
        let conn = Arc::new(Conn {
            active: AtomicUsize::new(0),
            idle_since: AtomicU64::new(now),
            // A new connection owes its first head within the header timeout.
            head_started: AtomicU64::new(now + 1),
            served: AtomicBool::new(false),
            close: Notify::new(),
            cut: Notify::new(),
        });
        table.insert(id, conn.clone());
        metrics::gauge!("gateway_connections_open", "listener" => self.name)
            .set(table.len() as f64);
        Some((id, conn))
    }

    /// Closes the oldest idle connection that has not been served a request yet (a socket
    /// opened and left silent, or trickling), else the oldest idle one; only one idle for
    /// [`EVICTABLE_AFTER`], so that in a burst of clients a connection whose request has
    /// not arrived yet is not closed under its client (the newcomer is refused instead).
    /// While any connection never served is open, no served one is closed for a newcomer:
    /// a flood of silent sockets cannot push a client's kept-alive connection out.
    fn evict_oldest_idle(&self, table: &mut BTreeMap<u64, Arc<Conn>>) -> bool {
        let now = self.now_ms();
        let idle = |conn: &Arc<Conn>| conn.active.load(Ordering::SeqCst) == 0;
        let never_served = |conn: &Arc<Conn>| !conn.served.load(Ordering::Relaxed);
        let long_idle = |conn: &Arc<Conn>| {
            let grace = EVICTABLE_AFTER[usize::from(!never_served(conn))].as_millis() as u64;
            idle(conn) && now.saturating_sub(conn.idle_since.load(Ordering::SeqCst)) >= grace
        };
        let oldest = match table
            .iter()
            .find(|(_, conn)| idle(conn) && never_served(conn))
        {
            Some((_, conn)) if !long_idle(conn) => None,
            Some((&id, _)) => Some(id),
            None => table
                .iter()
                .find(|(_, conn)| long_idle(conn))
                .map(|(&id, _)| id),
        };
        match oldest.and_then(|id| table.remove(&id)) {
            Some(conn) => {
                conn.close.notify_one();
                self.evicted.fetch_add(1, Ordering::Relaxed);
                metrics::counter!("gateway_connections_evicted_total", "listener" => self.name)
                    .increment(1);
                true
            }
            None => false,
        }
    }

    /// Closes the oldest idle connection, if any (when out of file descriptors).
    fn make_room(&self) -> bool {
        let mut table = self.lock();
        self.evict_oldest_idle(&mut table)
    }

    fn remove(&self, id: u64) {
        let mut table = self.lock();
        table.remove(&id);
        metrics::gauge!("gateway_connections_open", "listener" => self.name)
            .set(table.len() as f64);
    }

    /// Closes idle connections past their header or keep-alive timeout.
    fn sweep(&self) {
        let now = self.now_ms();
        let header = self.limits.header_timeout.as_millis() as u64;
        let keep_alive = self.limits.keep_alive.as_millis() as u64;
        let mut table = self.lock();
        let before = table.len();
        table.retain(|_, conn| {
            if conn.active.load(Ordering::SeqCst) > 0 {
                return true;
            }
            let head = conn.head_started.load(Ordering::SeqCst);
            let expired = if head > 0 {
                now.saturating_sub(head - 1) > header
            } else {
                now.saturating_sub(conn.idle_since.load(Ordering::SeqCst)) > keep_alive
            };
            if expired {
                conn.close.notify_one();
            }
            !expired
        });
        let closed = before - table.len();
        if closed > 0 {
            self.timed_out.fetch_add(closed as u64, Ordering::Relaxed);
            metrics::counter!("gateway_connections_timed_out_total", "listener" => self.name)
                .increment(closed as u64);
            metrics::gauge!("gateway_connections_open", "listener" => self.name)
                .set(table.len() as f64);
            debug!(listener = self.name, closed, "idle connections timed out");
        }
    }
}

/// A request being served on a connection: the connection is busy until it is dropped
/// (with the response's body, so at its last byte).
pub(crate) struct Busy {
    conn: Arc<Conn>,
    table: Arc<Connections>,
}

impl Busy {
    fn begin(conn: Arc<Conn>, table: Arc<Connections>) -> Busy {
        conn.active.fetch_add(1, Ordering::SeqCst);
        conn.head_started.store(0, Ordering::SeqCst);
        conn.served.store(true, Ordering::Relaxed);
        Busy { conn, table }
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.conn
            .idle_since
            .store(self.table.now_ms(), Ordering::SeqCst);
        self.conn.active.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A request's handle on its connection: [`Hangup::cut`] closes the connection at once,
/// dropping whatever it was writing (a client that stopped reading its answer).
#[derive(Clone)]
pub(crate) struct Hangup(Arc<Conn>);

impl Hangup {
    pub(crate) fn cut(&self) {
        self.0.cut.notify_one();
    }
}

/// A response body holding something (a [`Busy`], a buffer reservation) until it ends.
pub(crate) struct Holding<T> {
    inner: Body,
    held: Option<T>,
}

impl<T> Holding<T> {
    pub(crate) fn new(inner: Body, held: T) -> Holding<T> {
        Holding {
            inner,
            held: Some(held),
        }
    }
}

impl<T: Send + Unpin + 'static> http_body::Body for Holding<T> {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if let Poll::Ready(None) = polled {
            self.held = None;
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// The socket, noting when a new request's head begins to arrive.
struct Tracked {
    tcp: TcpStream,
    conn: Arc<Conn>,
    table: Arc<Connections>,
}

impl AsyncRead for Tracked {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.tcp).poll_read(cx, buf);
        if buf.filled().len() > before
            && self.conn.active.load(Ordering::SeqCst) == 0
            && self.conn.head_started.load(Ordering::SeqCst) == 0
        {
            let now = self.table.now_ms() + 1;
            self.conn.head_started.store(now, Ordering::SeqCst);
        }
        polled
    }
}

impl AsyncWrite for Tracked {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.tcp).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.tcp).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.tcp).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.tcp).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.tcp.is_write_vectored()
    }
}

/// Serves `listener` until `shutdown` turns true, then drains: idle connections close at
/// once, the others get up to `drain` to finish. Returns how many were cut at the end.
pub(crate) async fn serve<H, Fut>(
    listener: TcpListener,
    table: Arc<Connections>,
    handler: H,
    mut shutdown: watch::Receiver<bool>,
    drain: Duration,
) -> usize
where
    H: Fn(IpAddr, http::Request<Incoming>) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = http::Response<Body>> + Send + 'static,
{
    let mut tasks = JoinSet::new();
    let sweeper = tokio::spawn(sweep(table.clone()));
    let mut pen = Pen::new();
    let mut last_refusal_log: Option<Instant> = None;
    let for_connections = shutdown.clone();
    loop {
        tokio::select! {
            biased;
            _ = stopped(&mut shutdown) => break,
            Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
            accepted = listener.accept() => match accepted {
                Ok((tcp, peer)) => match table.admit() {
                    Some((id, conn)) => {
                        tasks.spawn(connection(
                            tcp,
                            peer,
                            id,
                            conn,
                            table.clone(),
                            handler.clone(),
                            for_connections.clone(),
                        ));
                    }
                    None => {
                        // Told, not left to time out: a client (or its SDK) retries after
                        // the `retry-after`.
                        pen.enter(tcp).await;
                        refused(&table, &mut last_refusal_log);
                    }
                },
                Err(e) => {
                    // Out of file descriptors (or another transient error): make room and
                    // let the backlog wait a moment rather than spin.
                    let made_room = table.make_room();
                    warn!(listener = table.name, error = %e, made_room, "accept failed");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        }
    }
    drop(listener);
    let cut = finish(tasks, drain).await;
    sweeper.abort();
    cut
}

/// Closes what idles too long in `table`, every quarter second.
async fn sweep(table: Arc<Connections>) {
    let mut every = tokio::time::interval(Duration::from_millis(250));
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        every.tick().await;
        table.sweep();
    }
}

/// A connection refused because every one of `table` serves a request: counted, and
/// logged at most every ten seconds (`last_log`).
fn refused(table: &Connections, last_log: &mut Option<Instant>) {
    metrics::counter!("gateway_connections_refused_total", "listener" => table.name).increment(1);
    if last_log.is_none_or(|at| at.elapsed() > Duration::from_secs(10)) {
        *last_log = Some(Instant::now());
        warn!(
            listener = table.name,
            max = table.limits.max,
            "connection refused: every connection is serving a request"
        );
    }
}

/// Lets the connections in `tasks` finish for up to `drain`, then cuts the rest; returns
/// how many were cut.
async fn finish(mut tasks: JoinSet<()>, drain: Duration) -> usize {
    let deadline = tokio::time::sleep(drain);
    tokio::pin!(deadline);
    loop {
        tokio::select! {
            joined = tasks.join_next() => if joined.is_none() { return 0 },
            _ = &mut deadline => {
                let cut = tasks.len();
                tasks.abort_all();
                while tasks.join_next().await.is_some() {}
                return cut;
            }
        }
    }
}

async fn connection<H, Fut>(
    tcp: TcpStream,
    peer: SocketAddr,
    id: u64,
    conn: Arc<Conn>,
    table: Arc<Connections>,
    handler: H,
    mut shutdown: watch::Receiver<bool>,
) where
    H: Fn(IpAddr, http::Request<Incoming>) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = http::Response<Body>> + Send + 'static,
{
    // SSE events go out as they come, not held back by Nagle's algorithm.
    let _ = tcp.set_nodelay(true);
    let io = TokioIo::new(Tracked {
        tcp,
        conn: conn.clone(),
        table: table.clone(),
    });
    let service = {
        let conn = conn.clone();
        let table = table.clone();
        service_fn(move |mut req: http::Request<Incoming>| {
            let busy = Busy::begin(conn.clone(), table.clone());
            req.extensions_mut().insert(Hangup(conn.clone()));
            let answer = handler(peer.ip(), req);
            // Boxed: hyper keeps room for this future for the connection's whole life,
            // and an answer streams long after it is done (5 KiB a stream saved).
            let answer: Pin<Box<dyn Future<Output = _> + Send>> =
                Box::pin(async move {
                    let response = answer.await;
                    Ok::<_, std::convert::Infallible>(response.map(|body| {
                        http_body_util::BodyExt::boxed_unsync(Holding::new(body, busy))
                    }))
                });
            answer
        })
    };
    let http = hyper::server::conn::http1::Builder::new()
        .max_buf_size(MAX_HEAD)
        .serve_connection(io, service);
    tokio::pin!(http);
    let mut draining = false;
    loop {
        tokio::select! {
            result = http.as_mut() => {
                if let Err(e) = result {
                    debug!(listener = table.name, error = %e, "connection ended with an error");
                }
                break;
            }
            // A client that stopped reading its answer: nothing more is written.
            _ = conn.cut.notified() => {
                debug!(listener = table.name, "connection cut: its answer went unread");
                break;
            }
            // Timed out or evicted while idle; should a request have begun in between,
            // it is served and the connection closes after it.
            _ = conn.close.notified() => {
                if conn.active.load(Ordering::SeqCst) == 0 {
                    break;
                }
                draining = true;
                http.as_mut().graceful_shutdown();
            }
            _ = stopped(&mut shutdown), if !draining => {
                if conn.active.load(Ordering::SeqCst) == 0 {
                    break;
                }
                draining = true;
                http.as_mut().graceful_shutdown();
            }
        }
    }
    table.remove(id);
}

/// Logs how a drain ended.
pub(crate) fn log_drained(listener: &str, cut: usize) {
    if cut == 0 {
        info!(listener, "connections drained");
    } else {
        warn!(
            listener,
            cut, "calls still in flight after the drain time: dropped"
        );
    }
}

/// Resolves when `shutdown` turns true (or its sender is gone).
pub(crate) async fn stopped(shutdown: &mut watch::Receiver<bool>) {
    let _ = shutdown.wait_for(|stop| *stop).await;
}

/// How many connections may wait to be accepted on the API listener. A thousand clients
/// connecting at once overflowed tokio's default of 1,024 (10-15% of the connects failed, one
/// run in three); the kernel caps it at `net.core.somaxconn` (4,096 on current Linux).
pub(crate) const API_BACKLOG: u32 = 4096;

/// A listener on `addr` with room for `backlog` connections waiting to be accepted.
pub(crate) fn listen(addr: SocketAddr, backlog: u32) -> std::io::Result<tokio::net::TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    // As `TcpListener::bind` does: a restarted gateway rebinds while old sockets linger.
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(backlog)
}
