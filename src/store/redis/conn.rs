//! Where the store sends its commands: one Redis node or a Redis Cluster, behind one
//! [`ConnectionLike`] so every script call is written once.
//!
//! - **One node**: a lazy [`ConnectionManager`] (start-up never blocks on Redis), at most one
//!   quick reconnect, short connection and response timeouts: with the manager's defaults a
//!   command waits about 9 s on the reconnect after Redis dies; with these it fails in under
//!   a millisecond and recovers about 25 ms after Redis is back.
//! - **Cluster**: the redis crate's async cluster connection. It routes each `EVALSHA` to the
//!   master owning its first key, follows `MOVED` (refreshing its slot map) and `ASK`, and
//!   `SCRIPT LOAD` goes to every node, so [`redis::Script`]'s reload after `NOSCRIPT` works
//!   on a promoted replica too. Its defaults retry 16 times with waits up to ~11 min: here
//!   it gets 2 retries (a redirect and a reconnect), 10-50 ms apart, and every request is
//!   bounded by the operation timeout overall.
//!
//! Both sides can speak TLS (`rediss://`, rustls with the ring provider) with the system's
//! roots or a CA given to [`StoreBuilder::tls_ca_pem`](crate::StoreBuilder::tls_ca_pem), and
//! authenticate with an ACL user and password from the URL (`redis://user:pass@host`).

use std::sync::Arc;
use std::time::Duration;

use super::RedisStoreError;
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::{ClusterClient, ClusterClientBuilder, ClusterConfig};
use redis::cluster_async::ClusterConnection;
use redis::{
    Cmd, ConnectionInfo, ErrorKind, IntoConnectionInfo, Pipeline, ProtocolVersion, RedisError,
    RedisFuture, RedisResult, TlsCertificates, Value,
};

/// The command connection: cheap to clone (every clone shares the same sockets).
#[derive(Clone)]
pub(crate) enum Conn {
    /// One node.
    Node(ConnectionManager),
    /// A Redis Cluster.
    Cluster(ClusterConnection),
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Conn::Node(conn) => conn.req_packed_command(cmd),
            Conn::Cluster(conn) => conn.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Conn::Node(conn) => conn.req_packed_commands(cmd, offset, count),
            Conn::Cluster(conn) => conn.req_packed_commands(cmd, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Node(conn) => conn.get_db(),
            Conn::Cluster(conn) => conn.get_db(),
        }
    }
}

/// How to reach Redis: what the pub/sub listener and the start-up check connect with.
#[derive(Clone)]
pub(crate) enum Target {
    /// One node.
    Node(redis::Client),
    /// A Redis Cluster: its seed nodes and TLS roots.
    Cluster {
        nodes: Vec<ConnectionInfo>,
        certs: Option<TlsCertificates>,
    },
}

impl Target {
    /// Parses one node's URL; with `ca_pem`, trusts that CA (and only it) for `rediss://`.
    pub(crate) fn node(url: &str, ca_pem: Option<&[u8]>) -> Result<Target, RedisStoreError> {
        let info = url.into_connection_info().map_err(RedisStoreError::Url)?;
        tls_provider(std::slice::from_ref(&info));
        let client = match ca_pem {
            Some(ca) => {
                redis::Client::build_with_tls(info, certs(ca)).map_err(RedisStoreError::Tls)?
            }
            None => redis::Client::open(info).map_err(RedisStoreError::Url)?,
        };
        Ok(Target::Node(client))
    }

    /// Parses the cluster's seed URLs (all with the same scheme, user and password).
    pub(crate) fn cluster<S: AsRef<str>>(
        nodes: &[S],
        ca_pem: Option<&[u8]>,
    ) -> Result<Target, RedisStoreError> {
        let nodes = nodes
            .iter()
            .map(|url| url.as_ref().into_connection_info())
            .collect::<RedisResult<Vec<_>>>()
            .map_err(RedisStoreError::Url)?;
        if nodes.is_empty() {
            return Err(RedisStoreError::Url(RedisError::from((
                ErrorKind::InvalidClientConfig,
                "a cluster needs at least one node url",
            ))));
        }
        let tls = nodes
            .iter()
            .all(|node| matches!(node.addr(), redis::ConnectionAddr::TcpTls { .. }));
        if ca_pem.is_some() && !tls {
            return Err(RedisStoreError::Tls(RedisError::from((
                ErrorKind::InvalidClientConfig,
                "a TLS CA was given for a redis:// url (TLS needs rediss://)",
            ))));
        }
        tls_provider(&nodes);
        let target = Target::Cluster {
            nodes,
            certs: ca_pem.map(certs),
        };
        // Checks the nodes agree (credentials, TLS) and the CA parses, without connecting.
        target
            .cluster_client(Duration::from_millis(100), false)
            .map_err(|e| match e.kind() {
                ErrorKind::InvalidClientConfig if ca_pem.is_some() => RedisStoreError::Tls(e),
                _ => RedisStoreError::Url(e),
            })?;
        Ok(target)
    }

    /// A cluster client that fails fast; `resp3` for the pub/sub connection (the cluster
    /// client delivers messages only as RESP3 pushes).
    pub(crate) fn cluster_client(
        &self,
        timeout: Duration,
        resp3: bool,
    ) -> RedisResult<ClusterClient> {
        let Target::Cluster { nodes, certs } = self else {
            // Only asked of a cluster target; an error, not a panic, if that ever changes.
            return Err(redis::RedisError::from((
                redis::ErrorKind::InvalidClientConfig,
                "a cluster client for a single-node target",
            )));
        };
        let mut builder = ClusterClientBuilder::new(nodes.clone())
            .retries(2)
            .min_retry_wait(10)
            .max_retry_wait(50)
            .connection_timeout(timeout)
            .response_timeout(timeout)
            .overall_response_timeout(Some(timeout));
        if let Some(certs) = certs {
            builder = builder.certs(certs.clone());
        }
        if resp3 {
            builder = builder.use_protocol(ProtocolVersion::RESP3);
        }
        builder.build()
    }

    /// The command connection, lazy: it connects in the background and on first use.
    pub(crate) fn connect_lazy(&self, timeout: Duration) -> RedisResult<Conn> {
        match self {
            Target::Node(client) => {
                // Measured: the defaults wait ~9 s per command on a dead server. These make a
                // call fail in under a millisecond while Redis is down and reconnect ~25 ms
                // after it is back.
                let config = ConnectionManagerConfig::new()
                    .set_number_of_retries(1)
                    .set_min_delay(Duration::from_millis(10))
                    .set_max_delay(Duration::from_millis(50))
                    .set_connection_timeout(Some(timeout))
                    .set_response_timeout(Some(timeout));
                Ok(Conn::Node(ConnectionManager::new_lazy_with_config(
                    client.clone(),
                    config,
                )?))
            }
            Target::Cluster { .. } => {
                let client = self.cluster_client(timeout, false)?;
                let config = ClusterConfig::new()
                    .set_connection_timeout(timeout)
                    .set_response_timeout(timeout);
                Ok(Conn::Cluster(
                    client.get_pending_async_connection_with_config(config),
                ))
            }
        }
    }

    /// One connection and a `PING`, for the start-up check: `Ok` when Redis answered, else
    /// why not. On a cluster, each seed node in turn until one answers or refuses: the
    /// cluster client folds a node's refusal into one I/O error ("failed to create initial
    /// connections"), a plain connection to the node keeps its kind.
    pub(crate) async fn check(&self, timeout: Duration) -> RedisResult<()> {
        match self {
            Target::Node(client) => ping_once(client, timeout).await,
            Target::Cluster { nodes, certs } => {
                let mut last = None;
                for node in nodes {
                    let client = match certs {
                        Some(certs) => redis::Client::build_with_tls(node.clone(), certs.clone()),
                        None => redis::Client::open(node.clone()),
                    }?;
                    match ping_once(&client, timeout).await {
                        Ok(()) => return Ok(()),
                        Err(e) if refusal(&e).is_some() => return Err(e),
                        Err(e) => last = Some(e),
                    }
                }
                Err(last.unwrap_or_else(|| {
                    RedisError::from((ErrorKind::InvalidClientConfig, "no cluster node"))
                }))
            }
        }
    }

    pub(crate) fn is_cluster(&self) -> bool {
        matches!(self, Target::Cluster { .. })
    }
}

async fn ping_once(client: &redis::Client, timeout: Duration) -> RedisResult<()> {
    let config = redis::AsyncConnectionConfig::new()
        .set_connection_timeout(Some(timeout))
        .set_response_timeout(Some(timeout));
    let mut conn = client
        .get_multiplexed_async_connection_with_config(&config)
        .await?;
    redis::cmd("PING").query_async::<()>(&mut conn).await
}

fn certs(ca_pem: &[u8]) -> TlsCertificates {
    TlsCertificates {
        client_tls: None,
        root_cert: Some(ca_pem.to_vec()),
    }
}

/// rustls needs a process-wide crypto provider. For a `rediss://` URL, when the application
/// installed none, this installs ring's (the one fairgate is built with); an application's
/// own choice, made before, stays.
fn tls_provider(nodes: &[ConnectionInfo]) {
    let tls = nodes
        .iter()
        .any(|node| matches!(node.addr(), redis::ConnectionAddr::TcpTls { .. }));
    if tls && rustls::crypto::CryptoProvider::get_default().is_none() {
        // ring on purpose: it builds with no C toolchain. rustls deprecates it for want of
        // post-quantum key exchange; an application that wants that installs aws-lc-rs's
        // provider before opening the store, and that choice stays.
        #[allow(deprecated)]
        let ring = rustls::crypto::ring::default_provider();
        // Err only when another thread installed one meanwhile: that one is used.
        let _ = ring.install_default();
    }
}

/// What went wrong when Redis answered at all: the credentials or the TLS set-up, which no
/// retry can fix. `None` for "not reachable" (refused, timed out, reset), which a later
/// attempt can.
pub(crate) fn refusal(e: &RedisError) -> Option<Refusal> {
    if e.kind() == ErrorKind::AuthenticationFailed
        || matches!(e.code(), Some("WRONGPASS" | "NOAUTH" | "NOPERM"))
    {
        return Some(Refusal::Auth);
    }
    if e.kind() == ErrorKind::InvalidClientConfig || is_tls_failure(e) {
        return Some(Refusal::Tls);
    }
    None
}

/// Why Redis refused this store at start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Refusal {
    Auth,
    Tls,
}

/// A TLS handshake that failed on its merits (an unknown CA, a name mismatch, a server that
/// does not speak TLS), not on a dead socket: a `rustls::Error` inside the I/O error.
fn is_tls_failure(e: &RedisError) -> bool {
    fn rustls_inside(err: &(dyn std::error::Error + 'static)) -> bool {
        if err.is::<rustls::Error>() {
            return true;
        }
        // The redis crate keeps the I/O error behind an `Arc<dyn Error>`.
        if let Some(shared) = err.downcast_ref::<Arc<dyn std::error::Error + Send + Sync>>() {
            return rustls_inside(&**shared);
        }
        err.downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
            .is_some_and(|inner| inner.is::<rustls::Error>())
    }
    let mut source = std::error::Error::source(e);
    while let Some(err) = source {
        if rustls_inside(err) {
            return true;
        }
        source = err.source();
    }
    false
}
