//! Shared test helpers: throwaway Redis servers, a tracing event counter, request helpers.
#![allow(dead_code, unreachable_pub)]

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fairgate::Job;

pub mod anthropic;
pub mod rate_limited;
#[cfg(feature = "redis")]
mod target;
#[cfg(feature = "redis")]
#[allow(unused_imports)]
pub(crate) use target::on_node_and_cluster;
#[cfg(feature = "redis")]
#[allow(unused_imports)]
pub use target::{Redis, Target};

mod redis_server;
pub use redis_server::RedisServer;
mod turn;
#[allow(unused_imports)]
pub use turn::{FileTurn, file_turn};
mod slot_worker;
use redis_server::{free_port, ping};
#[allow(unused_imports)]
pub use slot_worker::SlotWorker;

/// Counts tracing events by name (`tracing::warn!(name: "...")`) on the current thread.
#[derive(Clone, Default)]
pub struct EventCounter {
    counts: Arc<Mutex<HashMap<String, usize>>>,
}

impl EventCounter {
    /// Installs the counter for the current thread until the guard is dropped.
    ///
    /// First, once per process, a bare registry as the global default: with one
    /// thread-local subscriber the only one in the process, an event first hit on a thread
    /// without a subscriber (another test's) is cached as never wanted, and this thread's
    /// counter would miss it (tokio-rs/tracing#3611). With a global default every thread
    /// has a subscriber that wants it.
    pub fn install() -> (EventCounter, tracing::subscriber::DefaultGuard) {
        use tracing_subscriber::layer::SubscriberExt;
        static GLOBAL: std::sync::Once = std::sync::Once::new();
        GLOBAL.call_once(|| {
            // Err only when the binary set a global default of its own: that one serves.
            let _ = tracing::subscriber::set_global_default(tracing_subscriber::registry());
        });
        let counter = EventCounter::default();
        let subscriber = tracing_subscriber::registry().with(counter.clone());
        let guard = tracing::subscriber::set_default(subscriber);
        (counter, guard)
    }

    pub fn count(&self, name: &str) -> usize {
        self.counts.lock().unwrap().get(name).copied().unwrap_or(0)
    }
}

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for EventCounter {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        *self
            .counts
            .lock()
            .unwrap()
            .entry(event.metadata().name().to_owned())
            .or_insert(0) += 1;
    }
}

/// Runs each scenario `async fn scenario(rig: Rig)` of the calling file twice: on the memory
/// store in tokio's paused time (`Rig::memory()`), and, with feature `redis`, on a throwaway
/// Redis in real time with the time rules scaled down (`Rig::redis().await`). One rule, one
/// scenario, both stores.
#[allow(unused_macros)]
macro_rules! on_both_stores {
    ($($scenario:ident),* $(,)?) => {$(
        mod $scenario {
            #[tokio::test(start_paused = true)]
            async fn memory() {
                super::$scenario(super::Rig::memory()).await;
            }

            #[cfg(feature = "redis")]
            #[tokio::test]
            async fn redis() {
                let _turn = $crate::support::file_turn(module_path!());
                super::$scenario(super::Rig::redis().await).await;
            }
        }
    )*};
}
#[allow(unused_imports)]
pub(crate) use on_both_stores;

/// The calls in flight at a mock upstream, in all and by tier, and the most at once.
#[derive(Debug, Default)]
pub struct InFlight {
    now: u32,
    max: u32,
    tier_now: HashMap<String, u32>,
    tier_max: HashMap<String, u32>,
}

impl InFlight {
    /// A call of `tier` starts.
    pub fn enter(&mut self, tier: &str) {
        self.now += 1;
        self.max = self.max.max(self.now);
        let now = self.tier_now.entry(tier.to_owned()).or_default();
        *now += 1;
        let now = *now;
        let max = self.tier_max.entry(tier.to_owned()).or_default();
        *max = (*max).max(now);
    }

    /// A call of `tier` ends.
    pub fn leave(&mut self, tier: &str) {
        self.now -= 1;
        *self.tier_now.get_mut(tier).expect("a call of the tier") -= 1;
    }

    pub fn now(&self) -> u32 {
        self.now
    }

    pub fn max(&self) -> u32 {
        self.max
    }

    pub fn max_of_tier(&self, tier: &str) -> u32 {
        self.tier_max.get(tier).copied().unwrap_or(0)
    }
}

/// A user's call (`Origin::UserAction`) of `tenant` in `tier`.
pub fn user(tenant: &str, tier: &str) -> Job {
    Job::new(tenant, fairgate::Origin::UserAction).with_tier(tier)
}

/// Caps of `slots` for the global count and the tier, with a lease that outlives any test.
pub fn slot_limits(slots: u32) -> fairgate::store::SlotLimits {
    fairgate::store::SlotLimits {
        global: slots,
        tier: slots,
        tenant: None,
        lease_ttl: Duration::from_secs(30),
    }
}

/// An `http::Request` carrying `job`.
pub fn request(job: Job) -> http::Request<()> {
    let mut req = http::Request::new(());
    req.extensions_mut().insert(job);
    req
}

/// Runs `redis-cli` with `args` and returns what it printed (stdout), trimmed.
pub fn redis_cli(args: &[&str]) -> String {
    let out = Command::new("redis-cli")
        .args(args)
        .stderr(Stdio::null())
        .output()
        .expect("run redis-cli");
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// A fresh directory of the test's own under the system's temp dir, removed on drop.
pub struct TempDir(std::path::PathBuf);

impl TempDir {
    pub fn new(what: &str) -> TempDir {
        use std::sync::atomic::{AtomicUsize, Ordering};
        static N: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "fairgate-{what}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create a temp dir");
        TempDir(dir)
    }

    pub fn path(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The ACL user every cluster node knows (besides `default`): the cluster tests connect as
/// it, so ACL auth on a cluster is exercised by every cluster test.
pub const CLUSTER_USER: &str = "fairgate";
pub const CLUSTER_PASSWORD: &str = "cluster-s3cret";

/// One node of a [`RedisCluster`]: its client port and cluster bus port, kept for a restart.
struct ClusterNode {
    port: u16,
    bus: u16,
    child: Option<Child>,
}

/// A Redis Cluster of the test's own: 6 `redis-server`s (3 masters, 3 replicas) on free
/// loopback ports, each in its own directory, joined with `redis-cli --cluster create`.
/// Every process is SIGKILLed by its pid on drop. Never touches the server on 6379.
///
/// [`start_tls`](RedisCluster::start_tls) makes a TLS-only one (`--port 0`, TLS between
/// the nodes and to the replicas too) with a certificate of the test's own.
pub struct RedisCluster {
    nodes: Vec<ClusterNode>,
    /// The CA the nodes' certificate is signed by (`c.pem` in `dir`), for a TLS cluster.
    ca_pem: Option<Vec<u8>>,
    dir: TempDir,
    /// Kills the nodes once the test process is gone (a cluster shared in a static is
    /// never dropped).
    reaper: Option<Child>,
}

impl RedisCluster {
    pub fn start() -> RedisCluster {
        RedisCluster::start_with(false)
    }

    /// A cluster that speaks only TLS, to its clients, between its nodes and to its
    /// replicas; the certificate is made with openssl ([`make_certificate`]).
    pub fn start_tls() -> RedisCluster {
        RedisCluster::start_with(true)
    }

    /// The cluster every test of this binary that does not kill a node shares, started by
    /// the first that asks. Tests keep apart by key prefix (see [`Target`]). Its nodes are
    /// killed by a reaper process once the test process has exited.
    pub fn shared() -> &'static RedisCluster {
        static SHARED: std::sync::OnceLock<RedisCluster> = std::sync::OnceLock::new();
        SHARED.get_or_init(|| {
            let mut cluster = RedisCluster::start();
            cluster.reap_when_gone();
            cluster
        })
    }

    /// As [`shared`](RedisCluster::shared), a TLS cluster ([`start_tls`](RedisCluster::start_tls)).
    pub fn shared_tls() -> &'static RedisCluster {
        static SHARED: std::sync::OnceLock<RedisCluster> = std::sync::OnceLock::new();
        SHARED.get_or_init(|| {
            let mut cluster = RedisCluster::start_tls();
            cluster.reap_when_gone();
            cluster
        })
    }

    fn start_with(tls: bool) -> RedisCluster {
        let dir = TempDir::new("cluster");
        let ca_pem = tls.then(|| make_certificate(dir.path(), "c"));
        let mut cluster = RedisCluster {
            nodes: Vec::new(),
            ca_pem,
            dir,
            reaper: None,
        };
        for _ in 0..6 {
            let node = cluster.spawn_node();
            cluster.nodes.push(node);
        }
        let addrs: Vec<String> = cluster
            .nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let mut args = cluster.tls_args();
        args.extend(["--cluster".to_owned(), "create".to_owned()]);
        args.extend(addrs);
        args.extend(["--cluster-replicas", "1", "--cluster-yes"].map(str::to_owned));
        let out = Command::new("redis-cli")
            .args(&args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .output()
            .expect("run redis-cli --cluster create");
        assert!(
            out.status.success(),
            "redis-cli --cluster create failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        cluster.wait_ok(Duration::from_secs(20));
        cluster
    }

    /// `--tls --cacert c.pem` for a TLS cluster, nothing otherwise.
    fn tls_args(&self) -> Vec<String> {
        match self.ca_pem {
            Some(_) => vec![
                "--tls".to_owned(),
                "--cacert".to_owned(),
                self.dir.path().join("c.pem").display().to_string(),
            ],
            None => Vec::new(),
        }
    }

    /// `redis-cli` on the node on `port` (as `default`, which has no password).
    pub fn cli_on(&self, port: u16, args: &[&str]) -> String {
        let mut all = self.tls_args();
        all.extend(["-p".to_owned(), port.to_string()]);
        all.extend(args.iter().map(|a| (*a).to_owned()));
        let all: Vec<&str> = all.iter().map(String::as_str).collect();
        redis_cli(&all)
    }

    fn answers(&self, port: u16) -> bool {
        match self.ca_pem {
            Some(_) => self.cli_on(port, &["PING"]) == "PONG",
            None => ping(port),
        }
    }

    fn spawn_node(&self) -> ClusterNode {
        for _ in 0..10 {
            let (port, bus) = (free_port(), free_port());
            if port == bus {
                continue;
            }
            let mut node = ClusterNode {
                port,
                bus,
                child: None,
            };
            if self.spawn(&mut node) {
                return node;
            }
        }
        panic!("could not start a cluster node");
    }

    /// Starts `node`'s process on its ports, with its directory (and so its cluster config,
    /// for a restart); false if it exited at once (a port taken) or never answered.
    fn spawn(&self, node: &mut ClusterNode) -> bool {
        let (port, bus) = (node.port, node.bus);
        let node_dir = self.dir.path().join(port.to_string());
        std::fs::create_dir_all(&node_dir).unwrap();
        let password = format!(">{CLUSTER_PASSWORD}");
        let mut command = Command::new("redis-server");
        command.current_dir(&node_dir);
        match self.ca_pem {
            Some(_) => {
                let file = |name: &str| self.dir.path().join(name);
                command
                    .args(["--port", "0", "--tls-port", &port.to_string()])
                    .arg("--tls-cert-file")
                    .arg(file("c-server.pem"))
                    .arg("--tls-key-file")
                    .arg(file("c-server.key"))
                    .arg("--tls-ca-cert-file")
                    .arg(file("c.pem"))
                    .args(["--tls-auth-clients", "no"])
                    .args(["--tls-cluster", "yes", "--tls-replication", "yes"]);
            }
            None => {
                command.args(["--port", &port.to_string()]);
            }
        }
        let child = command
            .args(["--cluster-port", &bus.to_string()])
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .args(["--cluster-enabled", "yes", "--cluster-node-timeout", "1000"])
            // A replica syncs at once, not after the default 5 s wait for more replicas.
            .args(["--repl-diskless-sync-delay", "0"])
            .args(["--cluster-config-file"])
            .arg(node_dir.join(format!("nodes-{port}.conf")))
            .args(["--dir"])
            .arg(&node_dir)
            .args(["--user", CLUSTER_USER, "on", &password, "~*", "&*", "+@all"])
            // DEBUG SLEEP stalls a node, for tests of calls that time out.
            .args(["--enable-debug-command", "yes"])
            .args(["--daemonize", "no", "--loglevel", "warning"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start redis-server (is it on PATH?)");
        node.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Some(Ok(Some(_))) = node.child.as_mut().map(Child::try_wait) {
                break; // a port was taken
            }
            if self.answers(port) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        if let Some(mut child) = node.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        false
    }

    /// Waits until every live node says `cluster_state:ok` and every live replica is in sync.
    pub fn wait_ok(&self, within: Duration) {
        let deadline = Instant::now() + within;
        loop {
            let ok = self.live_ports().iter().all(|&port| {
                let info = self.cli_on(port, &["CLUSTER", "INFO"]);
                let repl = self.cli_on(port, &["INFO", "replication"]);
                info.contains("cluster_state:ok")
                    && (repl.contains("role:master") || repl.contains("master_link_status:up"))
            });
            if ok {
                return;
            }
            assert!(Instant::now() < deadline, "the cluster never became ok");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn live_ports(&self) -> Vec<u16> {
        self.nodes
            .iter()
            .filter(|n| n.child.is_some())
            .map(|n| n.port)
            .collect()
    }

    /// The nodes' URLs, as the ACL user (`rediss://` for a TLS cluster).
    pub fn urls(&self) -> Vec<String> {
        self.urls_with(CLUSTER_USER, CLUSTER_PASSWORD)
    }

    /// The nodes' URLs, as `user` with `password`.
    pub fn urls_with(&self, user: &str, password: &str) -> Vec<String> {
        let scheme = if self.ca_pem.is_some() {
            "rediss"
        } else {
            "redis"
        };
        self.nodes
            .iter()
            .map(|n| format!("{scheme}://{user}:{password}@127.0.0.1:{}/", n.port))
            .collect()
    }

    /// The CA of a TLS cluster's certificate (PEM).
    pub fn ca_pem(&self) -> &[u8] {
        self.ca_pem.as_deref().expect("a TLS cluster")
    }

    /// Runs one command on the master that owns `key` (`redis-cli -c` follows MOVED).
    pub fn command(&self, key_hint: &str, args: &[&str]) -> String {
        let port = self.master_of(key_hint);
        let mut all = vec!["-c"];
        all.extend_from_slice(args);
        self.cli_on(port, &all)
    }

    /// The port of the master that now owns `key`'s slot, as a live node sees it.
    pub fn master_of(&self, key: &str) -> u16 {
        self.master_of_live(key)
            .unwrap_or_else(|| panic!("no live master owns {key}"))
    }

    /// The port of the live master that owns `key`'s slot, if one does (none during a
    /// failover).
    pub fn master_of_live(&self, key: &str) -> Option<u16> {
        let slot = key_slot(key);
        let live = self.live_ports();
        self.topology()
            .into_iter()
            .find(|n| n.master.is_none() && n.slots.iter().any(|r| r.contains(&slot)))
            .map(|n| n.port)
            .filter(|port| live.contains(port))
    }

    /// `CLUSTER NODES` as a live node sees it, without the nodes it holds failed.
    fn topology(&self) -> Vec<Seen> {
        let Some(&port) = self.live_ports().first() else {
            return Vec::new();
        };
        let nodes = self.cli_on(port, &["CLUSTER", "NODES"]);
        nodes
            .lines()
            .filter_map(|line| {
                let fields: Vec<&str> = line.split_whitespace().collect();
                if fields.len() < 8 || fields[2].contains("fail") {
                    return None;
                }
                let port = fields[1]
                    .split('@')
                    .next()?
                    .rsplit(':')
                    .next()?
                    .parse()
                    .ok()?;
                let master = fields[2].contains("slave").then(|| fields[3].to_owned());
                let slots = fields[8..]
                    .iter()
                    .filter_map(|range| {
                        let (a, b) = range.split_once('-').unwrap_or((range, range));
                        Some(a.parse().ok()?..=b.parse().ok()?)
                    })
                    .collect();
                Some(Seen {
                    id: fields[0].to_owned(),
                    port,
                    master,
                    slots,
                })
            })
            .collect()
    }

    /// The slot ranges the master on `port` owns.
    pub fn slots_of(&self, port: u16) -> Vec<std::ops::RangeInclusive<u16>> {
        self.topology()
            .into_iter()
            .find(|n| n.port == port)
            .map(|n| n.slots)
            .unwrap_or_default()
    }

    /// Waits until every replica of the master on `port` has all it wrote (the offsets
    /// `INFO replication` gives agree), so a promoted replica will have it too.
    pub fn wait_replicated(&self, port: u16, within: Duration) {
        let deadline = Instant::now() + within;
        loop {
            let info = self.cli_on(port, &["INFO", "replication"]);
            let field = |line: &str, name: &str| -> Option<u64> {
                line.split([',', ':'])
                    .find_map(|part| part.strip_prefix(name)?.trim().parse().ok())
            };
            let master = info.lines().find_map(|l| {
                l.strip_prefix("master_repl_offset:")?
                    .trim()
                    .parse::<u64>()
                    .ok()
            });
            let replicas: Vec<u64> = info
                .lines()
                .filter(|l| l.starts_with("slave"))
                .filter_map(|l| field(l, "offset="))
                .collect();
            if !replicas.is_empty() && replicas.iter().all(|&o| Some(o) == master) {
                return;
            }
            assert!(Instant::now() < deadline, "replicas behind: {info}");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// The connections subscribed to `channel` (plain `SUBSCRIBE`), over every live node.
    pub fn subscribers(&self, channel: &str) -> u32 {
        self.live_ports()
            .into_iter()
            .map(|port| {
                let reply = self.cli_on(port, &["PUBSUB", "NUMSUB", channel]);
                reply
                    .lines()
                    .nth(1)
                    .and_then(|n| n.trim().parse().ok())
                    .unwrap_or(0)
            })
            .sum()
    }

    /// The connections subscribed to the sharded `channel` (`SSUBSCRIBE`), on its shard's
    /// master.
    pub fn shard_subscribers(&self, channel: &str) -> u32 {
        let reply = self.cli_on(self.master_of(channel), &["PUBSUB", "SHARDNUMSUB", channel]);
        reply
            .lines()
            .nth(1)
            .and_then(|n| n.trim().parse().ok())
            .unwrap_or(0)
    }

    /// The sharded channels matching `pattern` with a subscriber, on the master of the
    /// shard that owns `key`.
    pub fn shard_channels(&self, key: &str, pattern: &str) -> Vec<String> {
        let reply = self.cli_on(self.master_of(key), &["PUBSUB", "SHARDCHANNELS", pattern]);
        reply
            .lines()
            .map(str::to_owned)
            .filter(|l| !l.is_empty())
            .collect()
    }

    /// The ports of the live replicas of the master on `port`.
    pub fn replicas_of(&self, port: u16) -> Vec<u16> {
        let topology = self.topology();
        let Some(id) = topology
            .iter()
            .find(|n| n.port == port)
            .map(|n| n.id.clone())
        else {
            return Vec::new();
        };
        topology
            .iter()
            .filter(|n| n.master.as_deref() == Some(id.as_str()))
            .map(|n| n.port)
            .collect()
    }

    /// The masters' ports.
    pub fn masters(&self) -> Vec<u16> {
        self.live_ports()
            .into_iter()
            .filter(|&port| {
                self.cli_on(port, &["ROLE"])
                    .lines()
                    .next()
                    .is_some_and(|l| l.trim() == "master")
            })
            .collect()
    }

    /// The keys a master holds (`KEYS *`: test data only).
    pub fn keys_on(&self, port: u16) -> Vec<String> {
        self.cli_on(port, &["KEYS", "*"])
            .lines()
            .map(str::to_owned)
            .filter(|l| !l.is_empty())
            .collect()
    }

    /// SIGKILLs the node on `port`, by its pid.
    pub fn kill(&mut self, port: u16) {
        for node in &mut self.nodes {
            if node.port == port
                && let Some(mut child) = node.child.take()
            {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
    }

    /// Starts every killed node again on its ports, with its cluster config and no data
    /// (`--save ''`), and waits until the cluster is ok with all of them.
    pub fn restart_killed(&mut self) {
        let mut nodes = std::mem::take(&mut self.nodes);
        for node in nodes.iter_mut().filter(|n| n.child.is_none()) {
            let deadline = Instant::now() + Duration::from_secs(5);
            while !self.spawn(node) {
                assert!(
                    Instant::now() < deadline,
                    "cluster node {} did not restart",
                    node.port
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        self.nodes = nodes;
        self.wait_ok(Duration::from_secs(20));
    }

    /// Stalls every live node for `secs` (DEBUG SLEEP), returning at once. Under the node
    /// timeout (1 s) no failover follows. (Plain TCP: not for a TLS cluster.)
    pub fn stall(&self, secs: f64) {
        assert!(self.ca_pem.is_none(), "stall speaks plain TCP");
        // Written to every node at once (a redis-cli process each took up to tens of ms to
        // start on the loaded machine, and a node not yet asleep answered).
        let streams: Vec<TcpStream> = self
            .live_ports()
            .into_iter()
            .map(|port| {
                let mut stream = TcpStream::connect(("127.0.0.1", port)).expect("connect");
                stream
                    .write_all(format!("DEBUG SLEEP {secs}\r\n").as_bytes())
                    .unwrap();
                stream
            })
            .collect();
        std::thread::spawn(move || {
            for mut stream in streams {
                let mut buf = [0u8; 16];
                let _ = stream.read(&mut buf);
            }
        });
        // Let the commands reach the nodes before the caller goes on.
        std::thread::sleep(Duration::from_millis(30));
    }

    /// A process that SIGKILLs the nodes, by their pids, once this test process is gone,
    /// and removes their directory.
    fn reap_when_gone(&mut self) {
        let pids: Vec<String> = self
            .nodes
            .iter()
            .filter_map(|n| n.child.as_ref().map(|c| c.id().to_string()))
            .collect();
        let script = format!(
            "while kill -0 {} 2>/dev/null; do sleep 0.2; done; kill -9 {} 2>/dev/null; rm -rf '{}'",
            std::process::id(),
            pids.join(" "),
            self.dir.path().display()
        );
        let reaper = Command::new("sh")
            .args(["-c", &script])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start the cluster's reaper");
        self.reaper = Some(reaper);
    }
}

/// One line of `CLUSTER NODES`.
struct Seen {
    id: String,
    port: u16,
    /// The master's id, for a replica.
    master: Option<String>,
    slots: Vec<std::ops::RangeInclusive<u16>>,
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        if let Some(mut reaper) = self.reaper.take() {
            let _ = reaper.kill();
            let _ = reaper.wait();
        }
        for node in &mut self.nodes {
            if let Some(mut child) = node.child.take() {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
    }
}

/// The Redis Cluster slot of `key`: CRC16 (XMODEM) of its hash tag, or of the whole key
/// without one, modulo 16384 (as `CLUSTER KEYSLOT` answers).
pub fn key_slot(key: &str) -> u16 {
    let bytes = key.as_bytes();
    let tag = bytes.iter().position(|&b| b == b'{').and_then(|open| {
        let len = bytes[open + 1..].iter().position(|&b| b == b'}')?;
        (len > 0).then(|| &bytes[open + 1..open + 1 + len])
    });
    let mut crc: u16 = 0;
    for &byte in tag.unwrap_or(bytes) {
        crc ^= u16::from(byte) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc % 16384
}

/// A TLS-only `redis-server` of the test's own, with a self-signed certificate the test made
/// (`openssl req -x509`) for `127.0.0.1`/`localhost`, and an ACL user.
pub struct TlsRedis {
    port: u16,
    child: Option<Child>,
    ca_pem: Vec<u8>,
    dir: TempDir,
}

pub const TLS_USER: &str = "app";
pub const TLS_PASSWORD: &str = "tls-s3cret";

impl TlsRedis {
    pub fn start() -> TlsRedis {
        let dir = TempDir::new("tls");
        let mut dir = dir;
        let ca_pem = make_certificate(dir.path(), "c");
        let password = format!(">{TLS_PASSWORD}");
        for _ in 0..10 {
            let port = free_port();
            let child = Command::new("redis-server")
                .current_dir(dir.path())
                .args(["--port", "0", "--tls-port", &port.to_string()])
                .args([
                    "--tls-cert-file",
                    "c-server.pem",
                    "--tls-key-file",
                    "c-server.key",
                ])
                .args(["--tls-ca-cert-file", "c.pem", "--tls-auth-clients", "no"])
                .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
                .args(["--user", TLS_USER, "on", &password, "~*", "&*", "+@all"])
                .args(["--daemonize", "no", "--loglevel", "warning"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("start redis-server");
            let mut server = TlsRedis {
                port,
                child: Some(child),
                ca_pem: ca_pem.clone(),
                dir,
            };
            let deadline = Instant::now() + Duration::from_secs(5);
            while Instant::now() < deadline {
                if let Some(Ok(Some(_))) = server.child.as_mut().map(Child::try_wait) {
                    break;
                }
                if server.cli(&["PING"]) == "PONG" {
                    return server;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            if let Some(mut child) = server.child.take() {
                let _ = child.kill();
                let _ = child.wait();
            }
            dir = TempDir(std::mem::take(&mut server.dir.0));
        }
        panic!("could not start a TLS redis-server");
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The CA (here: the server's own self-signed certificate), PEM.
    pub fn ca_pem(&self) -> &[u8] {
        &self.ca_pem
    }

    /// `rediss://app:PASSWORD@127.0.0.1:PORT/`
    pub fn url_with(&self, user: &str, password: &str) -> String {
        format!("rediss://{user}:{password}@127.0.0.1:{}/", self.port)
    }

    pub fn url(&self) -> String {
        self.url_with(TLS_USER, TLS_PASSWORD)
    }

    /// `redis-cli --tls` as the ACL user.
    pub fn cli(&self, args: &[&str]) -> String {
        let ca = self.dir.path().join("c.pem");
        let p = self.port.to_string();
        let mut all = vec!["--tls", "--cacert", ca.to_str().unwrap(), "-p", &p];
        all.extend([
            "--user",
            TLS_USER,
            "--pass",
            TLS_PASSWORD,
            "--no-auth-warning",
        ]);
        all.extend_from_slice(args);
        redis_cli(&all)
    }
}

impl Drop for TlsRedis {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Makes a CA `<name>.pem` (`openssl req -x509`) and a server certificate it signed,
/// `<name>-server.pem` with its key `<name>-server.key`, for `127.0.0.1` and `localhost`, in
/// `dir`, and returns the CA (PEM). (A self-signed certificate used as its own CA is refused
/// by webpki: `CaUsedAsEndEntity`.)
pub fn make_certificate(dir: &std::path::Path, name: &str) -> Vec<u8> {
    let run = |args: &[&str]| {
        let status = Command::new("openssl")
            .current_dir(dir)
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("openssl is needed to make the TLS tests' certificates");
        assert!(status.success(), "openssl {args:?} failed");
    };
    let (ca, ca_key) = (format!("{name}.pem"), format!("{name}.key"));
    let (cert, key, csr) = (
        format!("{name}-server.pem"),
        format!("{name}-server.key"),
        format!("{name}-server.csr"),
    );
    run(&[
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
    ]
    .iter()
    .copied()
    .chain([
        "-keyout",
        &ca_key,
        "-out",
        &ca,
        "-subj",
        "/CN=fairgate test CA",
    ])
    .collect::<Vec<_>>());
    run(&[
        "req", "-new", "-newkey", "rsa:2048", "-nodes", "-keyout", &key,
    ]
    .iter()
    .copied()
    .chain(["-out", &csr, "-subj", "/CN=localhost"])
    .collect::<Vec<_>>());
    std::fs::write(
        dir.join("ext.cnf"),
        "subjectAltName=IP:127.0.0.1,DNS:localhost\n",
    )
    .unwrap();
    run(
        &["x509", "-req", "-in", &csr, "-CA", &ca, "-CAkey", &ca_key]
            .iter()
            .copied()
            .chain([
                "-CAcreateserial",
                "-days",
                "1",
                "-out",
                &cert,
                "-extfile",
                "ext.cnf",
            ])
            .collect::<Vec<_>>(),
    );
    std::fs::read(dir.join(ca)).unwrap()
}

/// `YYYY-MM-DDTHH:MM:SS.mmmZ` (Howard Hinnant's civil_from_days).
pub fn rfc3339(at: std::time::SystemTime) -> String {
    let since = at.duration_since(std::time::UNIX_EPOCH).unwrap();
    let secs = since.as_secs() as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        since.subsec_millis()
    )
}

/// Waits (real time, polling every 10 ms) until `done`, for at most 5 s.
pub async fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while !done() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting until {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// What the spawned tasks returned, in the order given (a panic in one fails the test).
pub async fn joined<T>(handles: Vec<tokio::task::JoinHandle<T>>) -> Vec<T> {
    let mut all = Vec::with_capacity(handles.len());
    for handle in handles {
        all.push(handle.await.expect("no panic"));
    }
    all
}

/// The `p` percentile (0.0 to 1.0, nearest rank) of `values`.
pub fn percentile(mut values: Vec<Duration>, p: f64) -> Duration {
    values.sort();
    let at = ((values.len() as f64 - 1.0) * p).round() as usize;
    values[at]
}

/// An example built by `cargo test` next to the test binaries (`target/<profile>/examples`).
pub fn example_binary(name: &str) -> std::path::PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    let profile = exe
        .parent()
        .and_then(std::path::Path::parent)
        .expect("target/<profile>/deps");
    let path = profile.join("examples").join(name);
    assert!(
        path.exists(),
        "{} missing: the workspace's tests build it (`bash scripts/test`, or `cargo test \
         --workspace --all-features`); `-p fairgate-gateway` alone does not",
        path.display()
    );
    path
}
