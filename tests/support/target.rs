//! The parameterised Redis suites: one test body, run on one node and on a Redis Cluster.

use std::time::{Duration, Instant};

use super::{RedisCluster, RedisServer, free_port, key_slot, redis_cli};

/// What a Redis test of the parameterised suites runs on: one node, or a Redis Cluster (3
/// masters, 3 replicas). A test body takes a `Target` and is run on both by
/// [`on_node_and_cluster!`]; it gets its Redis from [`start`](Target::start) and the like,
/// and builds its stores with [`Redis::store`], so one body proves one rule on both.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    Node,
    Cluster,
}

/// Turns on the test binary's shared cluster: a test that only reads and writes its own
/// keys shares it with others (`read`); one that stalls or wipes it, or runs a cluster of
/// its own (six more processes on a small machine), has it alone (`write`). The tests that
/// stall or kill a single node take the `write` turn too: they time what follows, and on two
/// cores a cluster test beside them (six servers, 200 callers) made them miss (a worker's
/// share not reached in the degraded phase, 1 run in 3).
static CLUSTER_TURN: tokio::sync::RwLock<()> = tokio::sync::RwLock::const_new(());

impl Target {
    /// A Redis for a test that only uses its own keys: a fresh node, or the binary's shared
    /// cluster with a key prefix of the test's own.
    pub async fn start(self) -> Redis {
        match self {
            Target::Node => Redis::node(Turn::Free),
            Target::Cluster => {
                let turn = Turn::Shared(CLUSTER_TURN.read().await);
                Redis::shared(turn)
            }
        }
    }

    /// A Redis the test may stall or wipe: a fresh node, or the shared cluster, which no
    /// other test uses meanwhile.
    pub async fn start_alone(self) -> Redis {
        match self {
            Target::Node => Redis::node(Turn::Alone(CLUSTER_TURN.write().await)),
            Target::Cluster => {
                let turn = Turn::Alone(CLUSTER_TURN.write().await);
                Redis::shared(turn)
            }
        }
    }

    /// A Redis the test may kill nodes of: a fresh node, or a fresh cluster of its own.
    pub async fn start_own(self) -> Redis {
        match self {
            Target::Node => Redis::node(Turn::Alone(CLUSTER_TURN.write().await)),
            Target::Cluster => {
                let turn = Turn::Alone(CLUSTER_TURN.write().await);
                Redis {
                    backend: Backend::OwnCluster(RedisCluster::start()),
                    prefix: "fairgate".to_owned(),
                    _turn: turn,
                }
            }
        }
    }

    /// A store built for the Redis at `url`: that node, or a cluster with `url` its one
    /// seed node.
    pub async fn store_at(
        self,
        builder: fairgate::StoreBuilder,
        url: &str,
    ) -> Result<fairgate::Store, fairgate::store::RedisStoreError> {
        match self {
            Target::Node => builder.redis(url).await,
            Target::Cluster => builder.redis_cluster([url]).await,
        }
    }

    /// A store built for a Redis that is not there: a node, or a cluster whose one seed
    /// node is, on a port nothing listens on.
    pub async fn unreachable_store(
        self,
        builder: fairgate::StoreBuilder,
    ) -> Result<fairgate::Store, fairgate::store::RedisStoreError> {
        let url = format!("redis://127.0.0.1:{}/", free_port());
        self.store_at(builder, &url).await
    }
}

/// What a test holds of the shared cluster (nothing, for a node of its own).
enum Turn {
    /// A node of its own, beside any other test.
    Free,
    Shared(tokio::sync::RwLockReadGuard<'static, ()>),
    Alone(tokio::sync::RwLockWriteGuard<'static, ()>),
}

enum Backend {
    Node(RedisServer),
    SharedCluster(&'static RedisCluster),
    OwnCluster(RedisCluster),
}

/// The Redis one test runs on ([`Target`]), with what it needs to watch and hurt it from
/// outside: `redis-cli` on the node that owns the keys, stalls, kills and restarts.
pub struct Redis {
    backend: Backend,
    /// The key prefix of this test's stores (`fairgate` unless the cluster is shared).
    prefix: String,
    _turn: Turn,
}

impl Redis {
    fn node(turn: Turn) -> Redis {
        Redis {
            backend: Backend::Node(RedisServer::start()),
            prefix: "fairgate".to_owned(),
            _turn: turn,
        }
    }

    fn shared(turn: Turn) -> Redis {
        use std::sync::atomic::{AtomicUsize, Ordering};
        static N: AtomicUsize = AtomicUsize::new(0);
        Redis {
            backend: Backend::SharedCluster(RedisCluster::shared()),
            prefix: format!("fg{}", N.fetch_add(1, Ordering::Relaxed)),
            _turn: turn,
        }
    }

    pub fn is_cluster(&self) -> bool {
        !matches!(self.backend, Backend::Node(_))
    }

    pub fn cluster(&self) -> Option<&RedisCluster> {
        match &self.backend {
            Backend::Node(_) => None,
            Backend::SharedCluster(cluster) => Some(cluster),
            Backend::OwnCluster(cluster) => Some(cluster),
        }
    }

    fn own_cluster(&mut self) -> &mut RedisCluster {
        match &mut self.backend {
            Backend::OwnCluster(cluster) => cluster,
            _ => panic!("only a cluster of the test's own may lose nodes (Target::start_own)"),
        }
    }

    fn server(&mut self) -> &mut RedisServer {
        match &mut self.backend {
            Backend::Node(server) => server,
            _ => unreachable!("a node"),
        }
    }

    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// A key of this test's stores: `key("{slots}:global")` is `<prefix>:{slots}:global`.
    pub fn key(&self, rest: &str) -> String {
        format!("{}:{rest}", self.prefix)
    }

    /// A store on this Redis built by `builder` (with this test's key prefix).
    pub async fn store(
        &self,
        builder: fairgate::StoreBuilder,
    ) -> Result<fairgate::Store, fairgate::store::RedisStoreError> {
        let builder = builder.key_prefix(self.prefix.clone());
        match &self.backend {
            Backend::Node(server) => builder.redis(&server.url()).await,
            _ => builder.redis_cluster(self.urls()).await,
        }
    }

    /// The node's URL, or the cluster nodes' URLs.
    pub fn urls(&self) -> Vec<String> {
        match &self.backend {
            Backend::Node(server) => vec![server.url()],
            _ => self.cluster().unwrap().urls(),
        }
    }

    /// The arguments that point an `examples/slot_worker` at this Redis: its URL (a
    /// cluster: the nodes' URLs, comma-separated), then flags.
    pub fn worker_args(&self) -> (String, Vec<String>) {
        let mut flags = vec![format!("--key-prefix={}", self.prefix)];
        if self.is_cluster() {
            flags.push("--cluster".to_owned());
        }
        (self.urls().join(","), flags)
    }

    /// The port of the node that owns `key` (a cluster: its master now).
    pub fn port_of(&self, key: &str) -> u16 {
        match &self.backend {
            Backend::Node(server) => server.port(),
            _ => self.cluster().unwrap().master_of(key),
        }
    }

    /// `redis-cli` on the node that owns `key` (what it prints, trimmed).
    pub fn cli(&self, key: &str, args: &[&str]) -> String {
        let port = self.port_of(key).to_string();
        let mut all = vec!["-p", &port];
        all.extend_from_slice(args);
        redis_cli(&all)
    }

    /// `redis-cli` on the node that owns this test's slot keys (and whose clock the slot
    /// scripts use): `slots_cli(&["ZCARD", &redis.key("{slots}:global")])`.
    pub fn slots_cli(&self, args: &[&str]) -> String {
        self.cli(&self.key("{slots}:global"), args)
    }

    /// A tenant name whose keys live on the node that owns the slot keys: `name` itself on
    /// one node; on a cluster `name`, `name-1`, `name-2`, ... whichever is first there. So
    /// killing that master takes away both what the tenant's calls and the store's recovery
    /// (the slot keys) need, as killing the one node does.
    pub fn tenant_by_the_slots(&self, name: &str) -> String {
        let Some(cluster) = self.cluster() else {
            return name.to_owned();
        };
        let ranges = cluster.slots_of(cluster.master_of(&self.key("{slots}:global")));
        (0..10_000)
            .map(|i| match i {
                0 => name.to_owned(),
                i => format!("{name}-{i}"),
            })
            .find(|tenant| {
                // Plain names (ASCII letters, digits, `-`) are not escaped in keys.
                let slot = key_slot(&self.key(&format!("{{t:{tenant}}}:throttles")));
                ranges.iter().any(|r| r.contains(&slot))
            })
            .expect("a tenant on the slot keys' master")
    }

    /// Waits until the replicas of the master that owns `key` have all it wrote (a cluster;
    /// nothing to wait for on one node).
    pub fn wait_replicated(&self, key: &str) {
        if let Some(cluster) = self.cluster() {
            cluster.wait_replicated(cluster.master_of(key), Duration::from_secs(5));
        }
    }

    /// Stalls Redis (every node of a cluster) for `secs` with DEBUG SLEEP, returning at once.
    /// On a cluster keep it under its node timeout (1 s): a longer stall is a failover.
    pub fn stall(&self, secs: f64) {
        match &self.backend {
            Backend::Node(server) => server.stall(secs),
            Backend::SharedCluster(_) if !matches!(self._turn, Turn::Alone(_)) => {
                panic!("a stall of the shared cluster needs Target::start_alone")
            }
            _ => self.cluster().unwrap().stall(secs),
        }
    }

    /// Wipes Redis: FLUSHALL on the node, or on every master of the cluster.
    pub fn flush_all(&self) {
        match &self.backend {
            Backend::Node(server) => assert!(server.command("FLUSHALL").starts_with("+OK")),
            Backend::SharedCluster(_) if !matches!(self._turn, Turn::Alone(_)) => {
                panic!("wiping the shared cluster needs Target::start_alone")
            }
            _ => {
                let cluster = self.cluster().unwrap();
                for port in cluster.masters() {
                    assert_eq!(cluster.cli_on(port, &["FLUSHALL"]), "OK");
                }
            }
        }
    }

    /// SIGKILLs the node, or the master that owns the slot keys (its replica takes over,
    /// see [`wait_for_failover`](Redis::wait_for_failover)).
    pub fn kill_slots_master(&mut self) {
        match &self.backend {
            Backend::Node(_) => self.server().kill(),
            _ => {
                let key = self.key("{slots}:global");
                let cluster = self.own_cluster();
                let master = cluster.master_of(&key);
                cluster.kill(master);
            }
        }
    }

    /// SIGKILLs the node, or the whole shard that owns the slot keys (its master and its
    /// replicas): away until [`restart`](Redis::restart), as a killed single node is.
    pub fn kill_slots_shard(&mut self) {
        match &self.backend {
            Backend::Node(_) => self.server().kill(),
            _ => {
                let key = self.key("{slots}:global");
                let cluster = self.own_cluster();
                let master = cluster.master_of(&key);
                for replica in cluster.replicas_of(master) {
                    cluster.kill(replica);
                }
                cluster.kill(master);
            }
        }
    }

    /// Starts the node again on its port, or every killed cluster node on its ports; their
    /// data is gone (`--save ''`). A cluster is waited for until it is ok.
    pub fn restart(&mut self) {
        match &self.backend {
            Backend::Node(_) => self.server().restart(),
            _ => self.own_cluster().restart_killed(),
        }
    }

    /// After [`kill_slots_master`](Redis::kill_slots_master): the node started again on its
    /// port, empty; or, on a cluster, a replica promoted in the killed master's place, with
    /// what was replicated to it (waits for it, returns how long that took).
    pub fn bring_back(&mut self) -> Duration {
        match &self.backend {
            Backend::Node(_) => {
                self.server().restart();
                Duration::ZERO
            }
            _ => self.wait_for_failover(Duration::from_secs(10)),
        }
    }

    /// Waits until a live master owns the slot keys again (a replica promoted) and returns
    /// how long that took; at once on a node.
    pub fn wait_for_failover(&self, within: Duration) -> Duration {
        let started = Instant::now();
        let Some(cluster) = self.cluster() else {
            return Duration::ZERO;
        };
        let key = self.key("{slots}:global");
        while cluster.master_of_live(&key).is_none() {
            assert!(started.elapsed() < within, "no failover within {within:?}");
            std::thread::sleep(Duration::from_millis(20));
        }
        started.elapsed()
    }
}

/// Runs each `async fn test(target: Target)` of the calling file twice, as `test::node` on
/// one node and `test::cluster` on a Redis Cluster: one rule, one body, both topologies.
/// `multi_thread:` before the names runs them on a 2-thread runtime.
#[allow(unused_macros)]
macro_rules! on_node_and_cluster {
    (multi_thread: $($test:ident),* $(,)?) => {$(
        mod $test {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn node() {
                let _turn = crate::support::file_turn(module_path!());
                super::$test(crate::support::Target::Node).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn cluster() {
                let _turn = crate::support::file_turn(module_path!());
                super::$test(crate::support::Target::Cluster).await;
            }
        }
    )*};
    ($($test:ident),* $(,)?) => {$(
        mod $test {
            #[tokio::test]
            async fn node() {
                let _turn = crate::support::file_turn(module_path!());
                super::$test(crate::support::Target::Node).await;
            }

            #[tokio::test]
            async fn cluster() {
                let _turn = crate::support::file_turn(module_path!());
                super::$test(crate::support::Target::Cluster).await;
            }
        }
    )*};
}
#[allow(unused_imports)]
pub(crate) use on_node_and_cluster;
