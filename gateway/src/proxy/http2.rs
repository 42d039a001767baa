//! Calls to an upstream over HTTP/2 (`http2 = true` in `[[upstreams]]`, or
//! `--upstream-http2`): many calls share one connection, so a held stream costs the
//! upstream side a stream's state instead of an HTTP/1.1 connection's buffers and socket.
//!
//! A connection carries at most [`STREAMS_PER_CONNECTION`] calls at once; past that, another
//! is opened. With a peer that allows that many streams (RFC 9113 asks for at least 100), a
//! call never waits inside a connection for a stream, where the gateway could not see it:
//! its slot is spent on a call that is on the wire. `https://` negotiates `h2` by ALPN (a
//! server that does not speak HTTP/2 fails the handshake: each call is answered with that
//! error); `http://` speaks it with prior knowledge (h2c).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use fairgate::BoxError;
use http::{Request, Response, Uri};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use tower::Service;
use tracing::debug;

use crate::body::Body;
use crate::server::Holding;

/// Calls one connection carries at once, at most.
const STREAMS_PER_CONNECTION: usize = 100;

/// Connections kept open with no call on them, at most: the rest close as their last call ends.
const MAX_IDLE: usize = 4;

/// Time to connect and agree on HTTP/2, at most: calls wait for one connection at a time.
const OPEN_TIMEOUT: Duration = Duration::from_secs(10);

/// A connection is pinged this often (idle too), and closed when a ping goes unanswered for
/// [`PING_TIMEOUT`]: a peer or a NAT that dropped it silently is noticed before calls hang
/// on it.
const PING_EVERY: Duration = Duration::from_secs(30);
const PING_TIMEOUT: Duration = Duration::from_secs(10);

/// HTTP/2 connections to one upstream (clones share them).
#[derive(Clone)]
pub(crate) struct Http2 {
    inner: Arc<Inner>,
}

struct Inner {
    connector: HttpsConnector<HttpConnector>,
    /// `scheme://authority` of the upstream.
    target: Uri,
    connections: Mutex<Connections>,
    /// One connection opened at a time: calls that find every one full meanwhile take
    /// the new one's streams rather than each opening its own.
    opening: tokio::sync::Mutex<()>,
}

#[derive(Default)]
struct Connections {
    open: Vec<Connection>,
    next_id: u64,
}

struct Connection {
    id: u64,
    send: hyper::client::conn::http2::SendRequest<Body>,
    /// Calls on it now.
    calls: usize,
}

/// A call's stream on a connection, given back when the call's answer ends or is dropped.
struct Stream {
    inner: Arc<Inner>,
    connection: u64,
}

impl Drop for Stream {
    fn drop(&mut self) {
        let mut connections = self.inner.lock();
        let Some(at) = connections
            .open
            .iter()
            .position(|c| c.id == self.connection)
        else {
            return;
        };
        connections.open[at].calls -= 1;
        let idle = connections.open.iter().filter(|c| c.calls == 0).count();
        if connections.open[at].calls == 0 && idle > MAX_IDLE {
            // Dropping its last handle closes the connection.
            connections.open.swap_remove(at);
        }
    }
}

impl Inner {
    fn lock(&self) -> std::sync::MutexGuard<'_, Connections> {
        // A panic elsewhere while it was held leaves counts that are still whole.
        self.connections.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Http2 {
    /// Connections to `target` (`scheme://authority`) made by `connector`.
    pub(crate) fn new(connector: HttpsConnector<HttpConnector>, target: Uri) -> Http2 {
        Http2 {
            inner: Arc::new(Inner {
                connector,
                target,
                connections: Mutex::default(),
                opening: tokio::sync::Mutex::new(()),
            }),
        }
    }

    /// Sends `req` (its URI absolute) on a connection with a free stream, opening one when
    /// every connection is full.
    pub(crate) async fn send(&self, req: Request<Body>) -> Result<Response<Body>, BoxError> {
        let (mut send, stream) = match self.take() {
            Some(taken) => taken,
            None => self.open().await?,
        };
        let response = send.send_request(req).await?;
        let (parts, body) = crate::body::downstream(response).into_parts();
        let body = http_body_util::BodyExt::boxed_unsync(Holding::new(body, stream));
        Ok(Response::from_parts(parts, body))
    }

    /// A stream on the busiest open connection that has one free: calls pack onto few
    /// connections, so the others can close when idle.
    fn take(&self) -> Option<(hyper::client::conn::http2::SendRequest<Body>, Stream)> {
        let mut connections = self.inner.lock();
        connections.open.retain(|c| !c.send.is_closed());
        let connection = connections
            .open
            .iter_mut()
            .filter(|c| c.calls < STREAMS_PER_CONNECTION)
            .max_by_key(|c| c.calls)?;
        connection.calls += 1;
        let stream = Stream {
            inner: self.inner.clone(),
            connection: connection.id,
        };
        Some((connection.send.clone(), stream))
    }

    /// Opens a connection (or takes a stream on one another call opened meanwhile).
    async fn open(
        &self,
    ) -> Result<(hyper::client::conn::http2::SendRequest<Body>, Stream), BoxError> {
        let _one = self.inner.opening.lock().await;
        if let Some(taken) = self.take() {
            return Ok(taken);
        }
        let opened = async {
            let io = self
                .inner
                .connector
                .clone()
                .call(self.inner.target.clone())
                .await?;
            hyper::client::conn::http2::Builder::new(TokioExecutor::new())
                .timer(TokioTimer::new())
                .keep_alive_interval(PING_EVERY)
                .keep_alive_timeout(PING_TIMEOUT)
                .keep_alive_while_idle(true)
                .handshake(io)
                .await
                .map_err(BoxError::from)
        };
        let (send, connection) =
            tokio::time::timeout(OPEN_TIMEOUT, opened)
                .await
                .map_err(|_| {
                    format!("no HTTP/2 connection to the upstream within {OPEN_TIMEOUT:?}")
                })??;
        tokio::spawn(async move {
            if let Err(error) = connection.await {
                debug!(%error, "HTTP/2 upstream connection ended");
            }
        });
        let mut connections = self.inner.lock();
        let id = connections.next_id;
        connections.next_id += 1;
        connections.open.push(Connection {
            id,
            send: send.clone(),
            calls: 1,
        });
        let stream = Stream {
            inner: self.inner.clone(),
            connection: id,
        };
        Ok((send, stream))
    }

    /// Connections open now.
    #[cfg(test)]
    pub(crate) fn connections(&self) -> usize {
        self.inner.lock().open.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use http_body_util::{BodyExt, Full};
    use hyper::body::Incoming;
    use hyper_util::rt::TokioIo;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokio::sync::{Notify, Semaphore};

    /// An h2c server on loopback whose answers wait for `release`; counts its connections
    /// and the calls it holds (`arrived` wakes whoever waits for a count).
    struct Server {
        url: Uri,
        connections: Arc<AtomicUsize>,
        holding: Arc<AtomicUsize>,
        arrived: Arc<Notify>,
        release: Arc<Semaphore>,
    }

    async fn server() -> Server {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/", listener.local_addr().unwrap())
            .parse()
            .unwrap();
        let connections = Arc::new(AtomicUsize::new(0));
        let holding = Arc::new(AtomicUsize::new(0));
        let release = Arc::new(Semaphore::new(0));
        let arrived = Arc::new(Notify::new());
        let (count, held, gate) = (connections.clone(), holding.clone(), release.clone());
        let woken = arrived.clone();
        tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                count.fetch_add(1, Ordering::SeqCst);
                let (held, gate, woken) = (held.clone(), gate.clone(), woken.clone());
                let service = hyper::service::service_fn(move |req: Request<Incoming>| {
                    let (held, gate, woken) = (held.clone(), gate.clone(), woken.clone());
                    async move {
                        assert_eq!(req.version(), http::Version::HTTP_2);
                        held.fetch_add(1, Ordering::SeqCst);
                        woken.notify_waiters();
                        gate.acquire().await.unwrap().forget();
                        held.fetch_sub(1, Ordering::SeqCst);
                        Ok::<_, std::convert::Infallible>(Response::new(Full::new(
                            Bytes::from_static(b"{}"),
                        )))
                    }
                });
                tokio::spawn(
                    hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                        .max_concurrent_streams(1000)
                        .serve_connection(TokioIo::new(tcp), service),
                );
            }
        });
        Server {
            url,
            connections,
            holding,
            arrived,
            release,
        }
    }

    fn http2(url: &Uri) -> Http2 {
        let https = hyper_rustls::HttpsConnectorBuilder::new()
            .with_webpki_roots()
            .https_or_http()
            .enable_http2()
            .wrap_connector(HttpConnector::new());
        Http2::new(https, url.clone())
    }

    fn call(url: &Uri) -> Request<Body> {
        Request::post(url.clone())
            .version(http::Version::HTTP_2)
            .body(crate::body::full("{}"))
            .unwrap()
    }

    impl Server {
        /// Waits until the server holds `calls` calls.
        async fn holds(&self, calls: usize) {
            loop {
                let arrived = self.arrived.notified();
                tokio::pin!(arrived);
                arrived.as_mut().enable();
                if self.holding.load(Ordering::SeqCst) == calls {
                    return;
                }
                arrived.await;
            }
        }
    }

    #[tokio::test]
    async fn calls_share_a_connection_up_to_its_streams_then_another_is_opened() {
        let server = server().await;
        let upstream = http2(&server.url);
        let calls = STREAMS_PER_CONNECTION + STREAMS_PER_CONNECTION / 2;
        let sent: Vec<_> = (0..calls)
            .map(|_| {
                let (upstream, req) = (upstream.clone(), call(&server.url));
                tokio::spawn(async move {
                    let answer = upstream.send(req).await.unwrap();
                    answer.into_body().collect().await.unwrap().to_bytes()
                })
            })
            .collect();
        server.holds(calls).await;
        // Every call on the wire at once, over two connections, not one per call.
        assert_eq!(server.connections.load(Ordering::SeqCst), 2);
        assert_eq!(upstream.connections(), 2);
        server.release.add_permits(calls);
        for answer in sent {
            assert_eq!(&answer.await.unwrap()[..], b"{}");
        }
        // Idle connections are kept for the next calls, up to MAX_IDLE.
        assert_eq!(upstream.connections(), 2);
        let again = upstream.send(call(&server.url));
        server.release.add_permits(1);
        again.await.unwrap().into_body().collect().await.unwrap();
        assert_eq!(server.connections.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn past_the_idle_bound_a_connection_closes_with_its_last_call() {
        let server = server().await;
        let upstream = http2(&server.url);
        let calls = STREAMS_PER_CONNECTION * (MAX_IDLE + 2);
        let sent: Vec<_> = (0..calls)
            .map(|_| {
                let (upstream, req) = (upstream.clone(), call(&server.url));
                tokio::spawn(async move {
                    let answer = upstream.send(req).await.unwrap();
                    answer.into_body().collect().await.unwrap();
                })
            })
            .collect();
        server.holds(calls).await;
        assert_eq!(upstream.connections(), MAX_IDLE + 2);
        server.release.add_permits(calls);
        for answer in sent {
            answer.await.unwrap();
        }
        assert_eq!(upstream.connections(), MAX_IDLE);
    }

    #[tokio::test]
    async fn a_call_dropped_before_its_answer_gives_its_stream_back() {
        let server = server().await;
        let upstream = http2(&server.url);
        let pending = tokio::spawn({
            let (upstream, req) = (upstream.clone(), call(&server.url));
            async move { upstream.send(req).await.map(|_| ()) }
        });
        server.holds(1).await;
        pending.abort();
        let _ = pending.await;
        let streams = upstream
            .inner
            .lock()
            .open
            .iter()
            .map(|c| c.calls)
            .sum::<usize>();
        assert_eq!(streams, 0);
    }
}
