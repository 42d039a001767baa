//! The gateway program (`fairgate-gateway`) as a real process for tests: started as
//! `docs/gateway/running.md` says, on free loopback ports (API and admin), SIGKILLed by its pid when dropped,
//! its log printed when a test fails.
#![allow(dead_code, unreachable_pub)]

use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// The upstream key the gateway is started with.
pub const UPSTREAM_KEY: &str = "sk-upstream-test-key";
pub const PREMIUM_KEY: &str = "sk-gw-premium-1";
pub const GUEST_KEY: &str = "sk-gw-guest-1";

pub fn target_tmp() -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
}

/// The `fairgate-gateway` program, which cargo builds for the tests that need it.
pub fn gateway_binary() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_fairgate-gateway"))
}

pub fn free_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind a free port");
    listener.local_addr().unwrap().port()
}

/// A keys file: a premium and a guest key, the guest with one slot and a short wait.
pub fn keys_toml(global: u32, guest_wait_ms: u64, extra: &str) -> String {
    keys_toml_with_guest_cap(global, 1, guest_wait_ms, extra)
}

/// A keys file: a premium and a guest key, the guest with `guest_cap` slots.
pub fn keys_toml_with_guest_cap(
    global: u32,
    guest_cap: u32,
    guest_wait_ms: u64,
    extra: &str,
) -> String {
    format!(
        r#"
[[keys]]
key = "{PREMIUM_KEY}"
tenant = "team-premium"
tier = "premium"

[[keys]]
key = "{GUEST_KEY}"
tenant = "team-guest"
tier = "guest"

[limits]
global_max = {global}
retry_after_ms = 300
lease_ttl_ms = 5000

[[tiers]]
name = "guest"
cap = {guest_cap}
max_wait_ms = {guest_wait_ms}

[[tiers]]
name = "premium"
cap = {global}
max_wait_ms = 30000
{extra}
"#
    )
}

/// A gateway process, SIGKILLed by its pid when dropped; its log goes to a file, printed
/// when a test fails.
pub struct Gateway {
    child: Child,
    pub port: u16,
    pub admin_port: u16,
    pub log: PathBuf,
    pub keys_path: PathBuf,
}

impl Gateway {
    pub fn start(upstream: &str, keys: &str, redis: Option<&str>) -> Gateway {
        Gateway::start_with(upstream, keys, redis, &[])
    }

    /// Starts the gateway with `extra` flags after the usual ones; `{port}` in them stands
    /// for the API port it is given (`--public-url http://127.0.0.1:{port}`).
    pub fn start_with(upstream: &str, keys: &str, redis: Option<&str>, extra: &[&str]) -> Gateway {
        Gateway::start_limited(upstream, keys, redis, extra, None)
    }

    /// Starts the gateway as [`Gateway::start_with`] does, under `ulimit -n open_files`
    /// when given.
    pub fn start_limited(
        upstream: &str,
        keys: &str,
        redis: Option<&str>,
        extra: &[&str],
        open_files: Option<u64>,
    ) -> Gateway {
        Gateway::launch(Some(upstream), keys, redis, extra, open_files, &[])
    }

    /// Starts the gateway without `--upstream` and `ANTHROPIC_API_KEY` (the keys file's
    /// `[[upstreams]]` name their keys), with `env` set (the upstreams' keys).
    pub fn start_pool(keys: &str, env: &[(&str, &str)], extra: &[&str]) -> Gateway {
        Gateway::launch(None, keys, None, extra, None, env)
    }

    /// [`Gateway::start_pool`] on the Redis at `redis`.
    pub fn start_pool_on(redis: &str, keys: &str, env: &[(&str, &str)]) -> Gateway {
        Gateway::launch(None, keys, Some(redis), &[], None, env)
    }

    /// Runs the gateway as [`Gateway::start_pool`] would, with `--upstream` too when given,
    /// expecting it to refuse to start: its exit status and what it wrote on stderr.
    pub fn refused(
        upstream: Option<&str>,
        keys: &str,
        env: &[(&str, &str)],
    ) -> (std::process::ExitStatus, String) {
        static N: AtomicUsize = AtomicUsize::new(0);
        let n = N.fetch_add(1, Ordering::SeqCst);
        let keys_path = target_tmp().join(format!("refused-{}-{n}-keys.toml", std::process::id()));
        std::fs::write(&keys_path, keys).unwrap();
        let mut cmd = Command::new(gateway_binary());
        cmd.args([
            "--listen",
            "127.0.0.1:0",
            "--admin",
            "127.0.0.1:0",
            "--keys",
        ])
        .arg(&keys_path)
        .env_remove("ANTHROPIC_API_KEY")
        .envs(env.iter().copied())
        .stdin(Stdio::null());
        if let Some(url) = upstream {
            cmd.args(["--upstream", url]);
        }
        for (name, _) in std::env::vars_os() {
            if name.to_string_lossy().starts_with("FAIRGATE_") {
                cmd.env_remove(name);
            }
        }
        let out = cmd.output().expect("run the gateway");
        (
            out.status,
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    fn launch(
        upstream: Option<&str>,
        keys: &str,
        redis: Option<&str>,
        extra: &[&str],
        open_files: Option<u64>,
        env: &[(&str, &str)],
    ) -> Gateway {
        static N: AtomicUsize = AtomicUsize::new(0);
        let n = N.fetch_add(1, Ordering::SeqCst);
        let id = format!("gateway-{}-{n}", std::process::id());
        let keys_path = target_tmp().join(format!("{id}-keys.toml"));
        std::fs::write(&keys_path, keys).unwrap();
        for attempt in 0..3 {
            let (port, admin_port) = (free_port(), free_port());
            let log = target_tmp().join(format!("{id}-{attempt}.log"));
            let mut cmd = match open_files {
                // `exec` keeps the pid: the guard still stops the gateway itself.
                Some(files) => {
                    let mut sh = Command::new("sh");
                    sh.arg("-c")
                        .arg(format!(r#"ulimit -n {files} && exec "$0" "$@""#))
                        .arg(gateway_binary());
                    sh
                }
                None => Command::new(gateway_binary()),
            };
            cmd.args(["--listen", &format!("127.0.0.1:{port}")])
                .args(["--admin", &format!("127.0.0.1:{admin_port}")])
                .args(
                    upstream
                        .map(|url| ["--upstream", url])
                        .into_iter()
                        .flatten(),
                )
                .arg("--keys")
                .arg(&keys_path)
                .args(
                    extra
                        .iter()
                        .map(|arg| arg.replace("{port}", &port.to_string())),
                )
                .env("ANTHROPIC_API_KEY", UPSTREAM_KEY)
                .env(
                    "RUST_LOG",
                    std::env::var("GATEWAY_LOG").unwrap_or_else(|_| "info".into()),
                )
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(File::create(&log).unwrap());
            for (name, _) in std::env::vars_os() {
                if name.to_string_lossy().starts_with("FAIRGATE_") {
                    cmd.env_remove(name);
                }
            }
            if let Some(url) = redis {
                cmd.args(["--redis", url]);
            }
            if upstream.is_none() {
                cmd.env_remove("ANTHROPIC_API_KEY");
            }
            cmd.envs(env.iter().copied());
            let child = cmd.spawn().expect("start the gateway");
            let mut gateway = Gateway {
                child,
                port,
                admin_port,
                log,
                keys_path: keys_path.clone(),
            };
            if gateway.wait_ready(Duration::from_secs(20)) {
                return gateway;
            }
            eprintln!(
                "gateway did not start (attempt {attempt}):\n{}",
                gateway.log_text()
            );
        }
        panic!("the gateway did not start");
    }

    /// Polls the admin listener's `/healthz` until it answers 200; false if the process
    /// exits first.
    fn wait_ready(&mut self, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return false;
            }
            if raw_get(self.admin_port, "/healthz").starts_with("HTTP/1.1 200")
                && TcpStream::connect(("127.0.0.1", self.port)).is_ok()
            {
                return true;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        false
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    pub fn admin_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.admin_port)
    }

    pub fn log_text(&self) -> String {
        let mut text = String::new();
        if let Ok(mut file) = File::open(&self.log) {
            let len = file.metadata().map(|m| m.len()).unwrap_or(0);
            let _ = file.seek(SeekFrom::Start(len.saturating_sub(8_000)));
            let _ = file.read_to_string(&mut text);
        }
        text
    }

    /// Sends `signal` (`TERM`, `HUP`, ...) by pid.
    pub fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .args(["-s", signal, &self.child.id().to_string()])
            .status()
            .expect("run kill");
        assert!(status.success());
    }

    /// Sends SIGTERM by pid.
    pub fn terminate(&self) {
        self.signal("TERM");
    }

    /// Waits up to `within` for the process to exit.
    pub fn wait_exit(&mut self, within: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    /// The Prometheus text of the admin listener's `/metrics`.
    pub async fn metrics(&self) -> String {
        self.admin("/metrics").await
    }

    /// What the admin listener answers `GET path` (`/status`, `/live`, ...).
    pub async fn admin(&self, path: &str) -> String {
        client()
            .get(format!("{}{path}", self.admin_url()))
            .send()
            .await
            .unwrap_or_else(|e| panic!("GET {path}: {e}"))
            .text()
            .await
            .unwrap()
    }

    /// `claude_slots_in_use`, summed over tiers.
    pub async fn slots_in_use(&self) -> f64 {
        metric_sum(&self.metrics().await, "claude_slots_in_use")
    }

    /// The process's resident memory (`VmRSS`), in bytes.
    pub fn rss(&self) -> u64 {
        rss_of(self.child.id())
    }

    /// File descriptors the process has open.
    pub fn open_fds(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.child.id()))
            .map(|dir| dir.count())
            .unwrap_or(0)
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!(
                "--- gateway log ({}) ---\n{}",
                self.log.display(),
                self.log_text()
            );
        }
    }
}

/// `VmRSS` of process `pid`, in bytes (0 once it is gone).
pub fn rss_of(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|status| {
            let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
            let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
            Some(kib * 1024)
        })
        .unwrap_or(0)
}

/// A `GET path` over a fresh connection; the raw answer (empty on failure).
pub fn raw_get(port: u16, path: &str) -> String {
    let Ok(mut stream) = TcpStream::connect(("127.0.0.1", port)) else {
        return String::new();
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
    let _ = stream.write_all(
        format!("GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").as_bytes(),
    );
    let mut answer = String::new();
    let _ = stream.read_to_string(&mut answer);
    answer
}

pub fn metric_sum(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|line| {
            line.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .pool_max_idle_per_host(0)
        .build()
        .unwrap()
}

pub fn messages_body(stream: bool) -> String {
    format!(
        r#"{{"model":"claude-mock-1","max_tokens":64,"stream":{stream},"messages":[{{"role":"user","content":"Hello"}}]}}"#
    )
}

pub async fn post_messages(
    gateway: &Gateway,
    key: &str,
    stream: bool,
) -> reqwest::Result<reqwest::Response> {
    post_messages_at(&gateway.url(), key, &[], stream).await
}

/// `POST /v1/messages` of `key` to the gateway at `url` (owned by a spawned task as easily
/// as borrowed), with the extra headers `claims` (`x-fairgate-*`).
pub async fn post_messages_at(
    url: &str,
    key: &str,
    claims: &[(&str, &str)],
    stream: bool,
) -> reqwest::Result<reqwest::Response> {
    let mut request = client()
        .post(format!("{url}/v1/messages"))
        .header("x-api-key", key)
        .header("anthropic-version", "2023-06-01")
        .header("content-type", "application/json");
    for (name, value) in claims {
        request = request.header(*name, *value);
    }
    request.body(messages_body(stream)).send().await
}

pub async fn eventually(within: Duration, mut check: impl AsyncFnMut() -> bool) -> bool {
    let deadline = Instant::now() + within;
    loop {
        if check().await {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}
