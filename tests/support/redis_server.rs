//! A throwaway `redis-server` for a test: its own port, stopped by its pid. Standalone (std
//! only), so the crate's own unit tests can include it too.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A `redis-server` of the test's own on a free loopback port, stopped by its pid.
/// Never the shared one on 6379.
pub struct RedisServer {
    port: u16,
    child: Option<Child>,
}

impl RedisServer {
    pub fn start() -> RedisServer {
        for _ in 0..10 {
            let port = free_port();
            let mut server = RedisServer { port, child: None };
            if server.spawn() {
                return server;
            }
        }
        panic!("could not start a throwaway redis-server");
    }

    /// A port nothing listens on, for "Redis down at start".
    pub fn unused_port() -> u16 {
        free_port()
    }

    /// A server for a free port that is not started yet (Redis down at start): start it
    /// later with [`restart`](RedisServer::restart).
    pub fn not_started() -> RedisServer {
        RedisServer {
            port: free_port(),
            child: None,
        }
    }

    /// Sends `signal` (`STOP`, `CONT`, `TERM`, ...) to the server, by its pid.
    pub fn signal(&self, signal: &str) {
        let pid = self.pid().expect("the server runs");
        let status = Command::new("kill")
            .args(["-s", signal, &pid.to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -s {signal} {pid}");
    }

    /// Stops the server as an operator would (SIGTERM, by its pid) and waits for it to exit;
    /// with `--save ''` it comes back empty.
    pub fn terminate(&mut self) {
        if self.child.is_some() {
            self.signal("TERM");
        }
        if let Some(mut child) = self.child.take() {
            let _ = child.wait();
        }
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Starts the server on its port again (after `kill`); its data and scripts are gone.
    pub fn restart(&mut self) {
        assert!(self.child.is_none(), "restart after kill");
        let deadline = Instant::now() + Duration::from_secs(5);
        while !self.spawn() {
            assert!(
                Instant::now() < deadline,
                "redis-server did not restart on {}",
                self.port
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// SIGKILLs the server by its pid and waits for it to be gone.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Stalls the server for `secs` (DEBUG SLEEP) from another thread, returning at once.
    pub fn stall(&self, secs: f64) {
        let port = self.port;
        std::thread::spawn(move || {
            let mut stream = TcpStream::connect(("127.0.0.1", port)).expect("connect to redis");
            stream
                .write_all(format!("DEBUG SLEEP {secs}\r\n").as_bytes())
                .unwrap();
            let mut buf = [0u8; 16];
            let _ = stream.read(&mut buf);
        });
        // Let the command reach the server before the caller goes on.
        std::thread::sleep(Duration::from_millis(30));
    }

    /// Sends one inline command and returns the raw reply.
    pub fn command(&self, cmd: &str) -> String {
        let mut stream = TcpStream::connect(("127.0.0.1", self.port)).expect("connect to redis");
        stream
            .set_read_timeout(Some(Duration::from_secs(2)))
            .unwrap();
        stream.write_all(format!("{cmd}\r\n").as_bytes()).unwrap();
        let mut buf = vec![0u8; 1 << 20];
        let mut out = Vec::new();
        // Replies here are small; read until the socket has been quiet a moment.
        stream
            .set_read_timeout(Some(Duration::from_millis(200)))
            .unwrap();
        while let Ok(n) = stream.read(&mut buf) {
            if n == 0 {
                break;
            }
            out.extend_from_slice(&buf[..n]);
        }
        String::from_utf8_lossy(&out).into_owned()
    }

    fn spawn(&mut self) -> bool {
        let child = Command::new("redis-server")
            .args(["--port", &self.port.to_string()])
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .args(["--daemonize", "no", "--loglevel", "warning"])
            // DEBUG SLEEP stalls the server, for tests of calls that time out.
            .args(["--enable-debug-command", "yes"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn();
        let mut child = match child {
            Ok(child) => child,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => panic!(
                "redis-server is not on PATH. The Redis tests start their own throwaway servers: \
                 install it (Debian: `apt-get install -y redis-server`) or run `bash scripts/test`, \
                 which does"
            ),
            Err(e) => panic!("could not start redis-server: {e}"),
        };
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = child.try_wait() {
                return false; // exited: port taken
            }
            if ping(self.port) {
                self.child = Some(child);
                return true;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let _ = child.kill();
        let _ = child.wait();
        false
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A loopback port nothing listens on now.
pub fn free_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind a free port");
    listener.local_addr().unwrap().port()
}

/// Whether a Redis answers PING on `port`.
pub fn ping(port: u16) -> bool {
    let Ok(mut stream) = TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_millis(200)));
    if stream.write_all(b"PING\r\n").is_err() {
        return false;
    }
    let mut buf = [0u8; 7];
    matches!(stream.read(&mut buf), Ok(n) if buf[..n].starts_with(b"+PONG"))
}
