//! The gateway program on an open network: what an unauthenticated (or merely careless)
//! client can make it spend. Each test runs the real `fairgate-gateway` process on loopback
//! (`support/gateway.rs`) in front of the mock upstream, with an attacker written out in
//! the test: raw sockets where a well-behaved HTTP client would not do what an attacker
//! does (trickle a head, stall a body, spell a path oddly, hold 10,000 sockets).
//!
//! Real time against a real process: every wait is bounded, the whole file runs in about a
//! minute. Processes are stopped by their pid when their guards drop.

use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::support::RedisServer;
use crate::support::anthropic::{MESSAGE_JSON, MockAnthropic};
use crate::support::gateway::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// One test at a time (two cores; several tests time the gateway).
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const MIB: usize = 1 << 20;

/// Sends `head` (and `body`) on a fresh connection and reads the answer to its end (at most
/// `within`); returns the status (0 when there was none) and the whole answer.
async fn raw(port: u16, head: &str, body: &[u8], within: Duration) -> (u16, String) {
    let Ok(mut stream) = TcpStream::connect(("127.0.0.1", port)).await else {
        return (0, String::new());
    };
    let _ = stream.write_all(head.as_bytes()).await;
    let _ = stream.write_all(body).await;
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(within, stream.read_to_end(&mut answer)).await;
    let answer = String::from_utf8_lossy(&answer).into_owned();
    (status_of(&answer), answer)
}

fn status_of(answer: &str) -> u16 {
    answer
        .strip_prefix("HTTP/1.1 ")
        .and_then(|rest| rest.get(..3))
        .and_then(|code| code.parse().ok())
        .unwrap_or(0)
}

fn post_head(path: &str, key: &str, length: usize) -> String {
    format!(
        "POST {path} HTTP/1.1\r\nhost: gateway\r\nx-api-key: {key}\r\n\
         content-type: application/json\r\ncontent-length: {length}\r\nconnection: close\r\n\r\n"
    )
}

/// Samples a process's RSS every 10 ms on a thread of its own until stopped; the peak.
struct RssSampler {
    stop: Arc<AtomicBool>,
    peak: Arc<AtomicU64>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl RssSampler {
    fn start(pid: u32) -> RssSampler {
        let stop = Arc::new(AtomicBool::new(false));
        let peak = Arc::new(AtomicU64::new(0));
        let thread = {
            let (stop, peak) = (stop.clone(), peak.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    peak.fetch_max(rss_of(pid), Ordering::Relaxed);
                    std::thread::sleep(Duration::from_millis(10));
                }
            })
        };
        RssSampler {
            stop,
            peak,
            thread: Some(thread),
        }
    }

    fn peak(mut self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        self.peak.load(Ordering::Relaxed)
    }
}

fn mb(bytes: u64) -> f64 {
    bytes as f64 / 1e6
}

/// `n` clients each start a `size`-byte `/v1/messages` body with a made-up key and push
/// it as fast as the gateway takes it; returns how many bytes the gateway accepted in all
/// and the statuses seen.
async fn big_bodies_with_bad_keys(port: u16, n: usize, size: usize) -> (u64, Vec<u16>) {
    let tasks: Vec<_> = (0..n)
        .map(|i| {
            tokio::spawn(async move {
                let Ok(mut stream) = TcpStream::connect(("127.0.0.1", port)).await else {
                    return (0u64, 0u16);
                };
                let head = post_head("/v1/messages", &format!("sk-made-up-{i}"), size);
                let _ = stream.write_all(head.as_bytes()).await;
                let chunk = vec![b'a'; MIB];
                let mut sent = 0u64;
                while (sent as usize) < size {
                    let write = tokio::time::timeout(
                        Duration::from_secs(5),
                        stream.write_all(&chunk[..MIB.min(size - sent as usize)]),
                    )
                    .await;
                    match write {
                        Ok(Ok(())) => sent += MIB as u64,
                        _ => break,
                    }
                }
                let mut answer = vec![0u8; 512];
                let got = tokio::time::timeout(Duration::from_secs(5), stream.read(&mut answer))
                    .await
                    .ok()
                    .and_then(Result::ok)
                    .unwrap_or(0);
                (sent, status_of(&String::from_utf8_lossy(&answer[..got])))
            })
        })
        .collect();
    let mut sent = 0;
    let mut statuses = Vec::new();
    for task in tasks {
        let (bytes, status) = task.await.unwrap();
        sent += bytes;
        statuses.push(status);
    }
    (sent, statuses)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn big_bodies_with_bad_keys_cost_no_memory() {
    let _turn = crate::support::file_turn(module_path!());
    let _serial = SERIAL.lock().await;
    let mock = MockAnthropic::start();
    let gateway = Gateway::start(&mock.url(), &keys_toml(8, 200, ""), None);
    let before = gateway.rss();
    let sampler = RssSampler::start(gateway.pid());
    let started = Instant::now();
    let (sent, statuses) = big_bodies_with_bad_keys(gateway.port, 80, 31 * MIB).await;
    let took = started.elapsed();
    let peak = sampler.peak();
    let settled = Instant::now();
    let mut after = gateway.rss();
    while after >= 100_000_000 && settled.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(50));
        after = gateway.rss();
    }
    let refused = statuses.iter().filter(|&&s| s == 401 || s == 429).count();
    eprintln!(
        "80 x 31 MiB bodies with made-up keys: RSS {:.1} MB before, peak {:.1} MB, {:.1} MB \
         after; the clients got {:.1} MB in ({refused} answered 401/429) in {took:?}",
        mb(before),
        mb(peak),
        mb(after),
        mb(sent),
    );
    assert!(peak < 300_000_000, "peak RSS {:.1} MB", mb(peak));
    assert!(after < 100_000_000, "RSS {:.1} MB 5 s after", mb(after));
    assert!(
        refused >= 70,
        "the made-up keys were answered at once: {statuses:?}"
    );
    assert_eq!(mock.calls(), 0);
    let status: String = gateway.admin("/status").await;
    assert!(status.contains(r#""used_bytes":0"#), "{status}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_over_the_limit_with_a_valid_key_gets_a_real_413() {
    let _turn = crate::support::file_turn(module_path!());
    let _serial = SERIAL.lock().await;
    let mock = MockAnthropic::start();
    let gateway = Gateway::start(&mock.url(), &keys_toml(8, 200, ""), None);
    let sampler = RssSampler::start(gateway.pid());

    // 200 MB with a content-length: refused from the header, the rest read away.
    let response = client()
        .post(format!("{}/v1/messages", gateway.url()))
        .header("x-api-key", PREMIUM_KEY)
        .header("content-type", "application/json")
        .body(vec![b'a'; 200_000_000])
        .send()
        .await
        .expect("an answer, not a broken pipe");
    assert_eq!(response.status(), 413);
    let body = response.text().await.unwrap();
    assert!(body.contains("request_too_large"), "{body}");

    // 40 MiB without a length (chunked): refused when the 32 MiB limit is passed.
    let chunks = futures_util::stream::iter(
        (0..40).map(|_| Ok::<_, std::io::Error>(bytes::Bytes::from(vec![b'a'; MIB]))),
    );
    let response = client()
        .post(format!("{}/v1/messages", gateway.url()))
        .header("x-api-key", PREMIUM_KEY)
        .body(reqwest::Body::wrap_stream(chunks))
        .send()
        .await
        .expect("an answer, not a broken pipe");
    assert_eq!(response.status(), 413);
    let peak = sampler.peak();
    eprintln!(
        "a 200 MB body and a 40 MiB chunked one with a valid key: 413 both; peak RSS {:.1} MB",
        mb(peak)
    );
    assert!(peak < 150_000_000, "peak RSS {:.1} MB", mb(peak));
    assert_eq!(mock.calls(), 0);
    // The key's next call goes through.
    let response = post_messages(&gateway, PREMIUM_KEY, false).await.unwrap();
    assert_eq!(response.status(), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_past_the_gateways_buffer_budget_are_refused_at_once() {
    let _turn = crate::support::file_turn(module_path!());
    let _serial = SERIAL.lock().await;
    let mock = MockAnthropic::start();
    let third = "\n[[keys]]\nkey = \"sk-gw-third\"\ntenant = \"team-third\"\ntier = \"premium\"\n";
    let gateway = Gateway::start_with(
        &mock.url(),
        &keys_toml(8, 200, third),
        None,
        &["--max-body", "16MiB", "--body-budget", "32MiB"],
    );
    // Two keys' bodies, 15 MiB of each arrived and the rest held back: 32 of the 32 MiB
    // (a body grows its share by doubling, up to the largest body).
    let mut held = Vec::new();
    for key in [PREMIUM_KEY, GUEST_KEY] {
        let mut stream = TcpStream::connect(("127.0.0.1", gateway.port))
            .await
            .unwrap();
        stream
            .write_all(post_head("/v1/messages", key, 16 * MIB).as_bytes())
            .await
            .unwrap();
        stream.write_all(&vec![b' '; 15 * MIB]).await.unwrap();
        held.push(stream);
    }
    let admin = gateway.admin_url();
    let used = async || {
        let status = client()
            .get(format!("{admin}/status"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let status: serde_json::Value = serde_json::from_str(&status).unwrap();
        status["body_budget"]["used_bytes"].as_u64().unwrap()
    };
    assert!(
        eventually(Duration::from_secs(10), async || used().await
            == 32 * MIB as u64)
        .await
    );
    // A third key's body: the gateway's budget, not its own, is spent.
    let sent = Instant::now();
    let (status, answer) = raw(
        gateway.port,
        &post_head("/v1/messages", "sk-gw-third", 15 * MIB),
        b"{",
        Duration::from_secs(5),
    )
    .await;
    assert_eq!(status, 529, "{answer}");
    assert!(sent.elapsed() < Duration::from_secs(1), "at once");
    assert!(answer.contains("retry-after: 1"), "{answer}");
    assert!(answer.contains("overloaded_error"), "{answer}");
    // The held ones go away: their share comes back, and a large body fits again.
    drop(held);
    assert!(eventually(Duration::from_secs(3), async || used().await == 0).await);
    let response = client()
        .post(format!("{}/v1/messages", gateway.url()))
        .header("x-api-key", "sk-gw-third")
        .body(
            [
                vec![b' '; 15 * MIB - 200],
                messages_body(false).into_bytes(),
            ]
            .concat(),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trickled_heads_stalled_bodies_and_idle_connections_are_closed() {
    let _turn = crate::support::file_turn(module_path!());
    let _serial = SERIAL.lock().await;
    let mock = MockAnthropic::start();
    let gateway = Gateway::start_with(
        &mock.url(),
        &keys_toml(8, 200, ""),
        None,
        &[
            "--header-timeout",
            "1s",
            "--body-idle-timeout",
            "1s",
            "--body-timeout",
            "2s",
            "--keep-alive-timeout",
            "2s",
        ],
    );
    let port = gateway.port;

    // A head trickled a byte every 100 ms: closed after the header timeout.
    let trickle = tokio::spawn(async move {
        let mut stream = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
        let started = Instant::now();
        for byte in b"POST /v1/messages HTTP/1.1\r\nhost: gateway\r\nx-api-key: sk-x".repeat(10) {
            if stream.write_all(&[byte]).await.is_err() {
                break;
            }
            let mut probe = [0u8; 64];
            if let Ok(read) =
                tokio::time::timeout(Duration::from_millis(100), stream.read(&mut probe)).await
            {
                // Closed (0 bytes or a reset).
                if read.unwrap_or(0) == 0 {
                    break;
                }
            }
        }
        started.elapsed()
    });

    // A body that stops after 10 of 1,000 bytes: 408 after the body idle timeout.
    let stall = tokio::spawn(async move {
        let mut stream = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
        let started = Instant::now();
        stream
            .write_all(post_head("/v1/messages", PREMIUM_KEY, 1_000).as_bytes())
            .await
            .unwrap();
        stream.write_all(b"{\"model\":\"").await.unwrap();
        let mut answer = Vec::new();
        let _ =
            tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut answer)).await;
        (
            started.elapsed(),
            String::from_utf8_lossy(&answer).into_owned(),
        )
    });

    // A body trickled a byte every 300 ms (never idle for 1 s): 408 after the body timeout.
    let drip = tokio::spawn(async move {
        let mut stream = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
        let started = Instant::now();
        stream
            .write_all(post_head("/v1/messages", PREMIUM_KEY, 1_000).as_bytes())
            .await
            .unwrap();
        let mut answer = vec![0u8; 512];
        for _ in 0..30 {
            if stream.write_all(b" ").await.is_err() {
                break;
            }
            if let Ok(read) =
                tokio::time::timeout(Duration::from_millis(300), stream.read(&mut answer)).await
            {
                let n = read.unwrap_or(0);
                return (
                    started.elapsed(),
                    String::from_utf8_lossy(&answer[..n]).into_owned(),
                );
            }
        }
        (started.elapsed(), String::new())
    });

    // A connection that sends nothing: closed after the header timeout; one idle after a
    // call: closed after the keep-alive timeout.
    let idle = tokio::spawn(async move {
        let mut stream = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
        let started = Instant::now();
        let mut buf = [0u8; 16];
        let _ = tokio::time::timeout(Duration::from_secs(10), stream.read(&mut buf)).await;
        started.elapsed()
    });
    let kept_alive = tokio::spawn(async move {
        let mut stream = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
        let body = messages_body(false);
        let head = format!(
            "POST /v1/messages HTTP/1.1\r\nhost: gateway\r\nx-api-key: {PREMIUM_KEY}\r\n\
             content-length: {}\r\n\r\n{body}",
            body.len()
        );
        stream.write_all(head.as_bytes()).await.unwrap();
        let mut answer = Vec::new();
        let mut buf = [0u8; 4096];
        let started = Instant::now();
        loop {
            match tokio::time::timeout(Duration::from_secs(10), stream.read(&mut buf)).await {
                Ok(Ok(0)) | Ok(Err(_)) | Err(_) => break,
                Ok(Ok(n)) => answer.extend_from_slice(&buf[..n]),
            }
        }
        (
            started.elapsed(),
            String::from_utf8_lossy(&answer).into_owned(),
        )
    });

    let trickled = trickle.await.unwrap();
    let (stalled, answer) = stall.await.unwrap();
    let idled = idle.await.unwrap();
    let (kept, kept_answer) = kept_alive.await.unwrap();
    let (dripped, drip_answer) = drip.await.unwrap();
    eprintln!(
        "closed after: trickled head {trickled:?}, stalled body {stalled:?}, trickled body \
         {dripped:?}, silent connection {idled:?}, idle keep-alive {kept:?}"
    );
    assert!(drip_answer.starts_with("HTTP/1.1 408"), "{drip_answer}");
    assert!(
        dripped >= Duration::from_millis(1_900) && dripped < Duration::from_millis(3_500),
        "trickled body answered after {dripped:?}"
    );
    assert!(
        trickled >= Duration::from_millis(900) && trickled < Duration::from_millis(2_500),
        "trickled head closed after {trickled:?}"
    );
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(
        stalled >= Duration::from_millis(900) && stalled < Duration::from_millis(2_500),
        "stalled body answered after {stalled:?}"
    );
    assert!(
        idled >= Duration::from_millis(900) && idled < Duration::from_millis(2_500),
        "silent connection closed after {idled:?}"
    );
    assert!(kept_answer.contains(MESSAGE_JSON), "{kept_answer}");
    assert!(
        kept >= Duration::from_millis(1_900) && kept < Duration::from_millis(3_500),
        "idle keep-alive connection closed after {kept:?}"
    );
}

/// Raises this process's open-files limit to its hard limit; returns the soft limit.
fn raise_open_files_limit() -> u64 {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let mut limit = getrlimit(Resource::Nofile);
    limit.current = limit.maximum;
    let _ = setrlimit(Resource::Nofile, limit);
    getrlimit(Resource::Nofile).current.unwrap_or(u64::MAX)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "long: bash scripts/test --long"]
async fn a_client_is_answered_within_a_second_while_ten_thousand_idle_sockets_are_open() {
    let _turn = crate::support::file_turn(module_path!());
    let _serial = SERIAL.lock().await;
    let files = raise_open_files_limit();
    let n = 10_000usize.min(files.saturating_sub(1_000) as usize);
    if n < 10_000 {
        eprintln!("open-files limit {files}: {n} idle sockets instead of 10,000");
    }
    served_behind_idle_sockets(n, 4_096, 1, Duration::from_secs(1)).await;
}

/// Silent sockets opened by eight connectors at once come far faster than a connection
/// becomes closable for a newcomer (250 ms after it opened): most of them wait at the cap,
/// where those silent for 250 ms make room for newcomers rather than stop the listener
/// until they time out (which held this call 4.7 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_the_cap_silent_sockets_never_stop_the_listener() {
    let _turn = crate::support::file_turn(module_path!());
    let _serial = SERIAL.lock().await;
    raise_open_files_limit();
    served_behind_idle_sockets(3_000, 300, 8, Duration::from_secs(2)).await;
}

/// After `n` silent sockets were opened (by `connectors` at once) on a gateway of `max`
/// connections, a client's call is answered `within`, served or refused cleanly
/// (`529` with `retry-after`, then served when it retries after it), its kept-alive
/// connection is kept, and the gateway's files stay within the cap and the connections
/// waiting at it.
async fn served_behind_idle_sockets(n: usize, max: usize, connectors: usize, within: Duration) {
    let mock = MockAnthropic::start();
    // A keep-alive timeout longer than the flood can take on a loaded machine: only an
    // eviction could close the client's connection below.
    let gateway = Gateway::start_with(
        &mock.url(),
        &keys_toml(8, 200, ""),
        None,
        &[
            "--keep-alive-timeout",
            "5m",
            "--max-connections",
            &max.to_string(),
        ],
    );
    // A client's keep-alive connection, served once before the flood.
    let body = messages_body(false);
    let request = format!(
        "POST /v1/messages HTTP/1.1\r\nhost: gateway\r\nx-api-key: {PREMIUM_KEY}\r\n\
         content-length: {}\r\n\r\n{body}",
        body.len()
    );
    let mut kept = TcpStream::connect(("127.0.0.1", gateway.port))
        .await
        .unwrap();
    let read_answer = async |stream: &mut TcpStream| {
        let mut answer = Vec::new();
        let mut buf = [0u8; 4096];
        while !String::from_utf8_lossy(&answer).contains(MESSAGE_JSON) {
            match tokio::time::timeout(Duration::from_secs(5), stream.read(&mut buf)).await {
                Ok(Ok(n)) if n > 0 => answer.extend_from_slice(&buf[..n]),
                _ => break,
            }
        }
        String::from_utf8_lossy(&answer).into_owned()
    };
    kept.write_all(request.as_bytes()).await.unwrap();
    // (The answer is chunked: its last chunk may come in the next read, before the next
    // answer's head.)
    assert!(read_answer(&mut kept).await.contains("HTTP/1.1 200"));

    let started = Instant::now();
    let port = gateway.port;
    let opened: Vec<_> = (0..connectors)
        .map(|c| {
            tokio::spawn(async move {
                let mut idle = Vec::new();
                for i in (c..n).step_by(connectors) {
                    match TcpStream::connect(("127.0.0.1", port)).await {
                        Ok(stream) => idle.push(stream),
                        Err(e) => panic!("connect #{i} failed: {e}"),
                    }
                }
                idle
            })
        })
        .collect();
    let mut idle = Vec::with_capacity(n);
    for connector in opened {
        idle.extend(connector.await.unwrap());
    }
    let opened = started.elapsed();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let call = async || {
        client()
            .post(format!("{}/v1/messages", gateway.url()))
            .header("x-api-key", PREMIUM_KEY)
            .body(messages_body(false))
            .timeout(Duration::from_secs(5))
            .send()
            .await
            .expect("answered")
    };
    let sent = Instant::now();
    let mut response = call().await;
    let took = sent.elapsed();
    let refused = response.status() == 529;
    if refused {
        let wait = response
            .headers()
            .get("retry-after")
            .expect("a retry-after");
        let wait: u64 = wait.to_str().unwrap().parse().expect("in seconds");
        tokio::time::sleep(Duration::from_secs(wait)).await;
        response = call().await;
    }
    assert_eq!(response.status(), 200);
    assert_eq!(response.text().await.unwrap(), MESSAGE_JSON);
    let fds = gateway.open_fds();
    let rss = gateway.rss();
    eprintln!(
        "{n} idle sockets opened in {opened:?} (cap {max}); a call answered in {took:?} \
         (refused, then served on its retry: {refused}); the gateway holds {fds} files, RSS \
         {:.1} MB",
        mb(rss)
    );
    assert!(took < within, "the call was answered in {took:?}");
    // The cap's connections, and up to 256 waiting at it for a second at most (a silent
    // one is closed unanswered), then the cap's alone.
    assert!(fds < max + 256 + 200, "{fds} files open");
    assert!(
        eventually(Duration::from_secs(5), async || gateway.open_fds()
            < max + 200)
        .await,
        "{} files open once none waits at the cap",
        gateway.open_fds()
    );
    // The flood closed idle sockets never served, not the client's kept-alive connection.
    kept.write_all(request.as_bytes()).await.unwrap();
    let answer = read_answer(&mut kept).await;
    assert!(
        answer.contains("HTTP/1.1 200") && answer.contains(MESSAGE_JSON),
        "{answer}"
    );
    drop(idle);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_spelling_of_messages_goes_through_the_stack_or_is_refused() {
    let _turn = crate::support::file_turn(module_path!());
    let _serial = SERIAL.lock().await;
    let mock = MockAnthropic::start();
    mock.set_normalise_paths(true);
    mock.set_delay(Duration::from_millis(300));
    let gateway = Gateway::start(
        &mock.url(),
        &keys_toml_with_guest_cap(16, 2, 5_000, ""),
        None,
    );
    let spellings = [
        "/v1/messages",
        "/v1/messages/",
        "/v1//messages",
        "//v1/messages",
        "/v1/./messages",
        "/v1/x/../messages",
        "/v1/messages;x",
        "/v1/%6Dessages",
        "/v1/messages%2F",
        "/v1/messages/.",
        "/v1/%2e/messages",
    ];
    let body = messages_body(false);
    let calls: Vec<_> = spellings
        .iter()
        .flat_map(|path| std::iter::repeat_n(*path, 4))
        .map(|path| {
            let (port, body) = (gateway.port, body.clone());
            tokio::spawn(async move {
                let head = post_head(path, GUEST_KEY, body.len());
                let (status, answer) =
                    raw(port, &head, body.as_bytes(), Duration::from_secs(20)).await;
                (path, status, answer)
            })
        })
        .collect();
    let mut admitted = 0;
    for call in calls {
        let (path, status, answer) = call.await.unwrap();
        if path == "/v1/messages" {
            assert_eq!(status, 200, "{answer}");
            admitted += 1;
        } else {
            assert_eq!(status, 400, "{path}: {answer}");
        }
    }
    // Dot segments, plain or encoded, are never forwarded.
    for path in [
        "/v1/../../x",
        "/v1/%2e%2e/x",
        "/v1/%2E%2E/%2e%2e/etc/passwd",
        "/v1/models/..%2F..%2Fx",
        "/v1/models/%2e%2e",
    ] {
        let head = format!(
            "GET {path} HTTP/1.1\r\nhost: gateway\r\nx-api-key: {PREMIUM_KEY}\r\nconnection: close\r\n\r\n"
        );
        let (status, answer) = raw(gateway.port, &head, b"", Duration::from_secs(5)).await;
        assert!(status == 400, "{path}: {answer}");
    }
    // Outside the allow-list: 404, not forwarded.
    for (method, path) in [
        ("GET", "/v1/files"),
        ("POST", "/v1/complete"),
        ("GET", "/v1/messages"),
    ] {
        let head = format!(
            "{method} {path} HTTP/1.1\r\nhost: gateway\r\nx-api-key: {PREMIUM_KEY}\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
        );
        let (status, answer) = raw(gateway.port, &head, b"", Duration::from_secs(5)).await;
        assert_eq!(status, 404, "{method} {path}: {answer}");
    }
    let max = mock.max_in_flight();
    let paths: Vec<String> = mock.requests().into_iter().map(|r| r.path).collect();
    eprintln!(
        "{} guest calls in {} spellings: {admitted} admitted, at most {max} at once (cap 2); \
         the upstream saw {:?}",
        spellings.len() * 4,
        spellings.len(),
        paths
    );
    assert!(max <= 2, "{max} guest calls ran at once against a cap of 2");
    assert_eq!(admitted, 4);
    assert_eq!(paths.len(), 4, "{paths:?}");
    assert!(paths.iter().all(|p| p == "/v1/messages"), "{paths:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_health_and_status_are_on_the_admin_port_only() {
    let _turn = crate::support::file_turn(module_path!());
    let _serial = SERIAL.lock().await;
    let mut redis = RedisServer::start();
    let mock = MockAnthropic::start();
    let gateway = Gateway::start(&mock.url(), &keys_toml(8, 200, ""), Some(&redis.url()));
    let response = post_messages(&gateway, PREMIUM_KEY, false).await.unwrap();
    assert_eq!(response.status(), 200);
    for path in ["/metrics", "/healthz", "/readyz", "/status"] {
        for key in [None, Some(PREMIUM_KEY)] {
            let mut request = client().get(format!("{}{path}", gateway.url()));
            if let Some(key) = key {
                request = request.header("x-api-key", key);
            }
            let response = request.send().await.unwrap();
            assert_eq!(response.status(), 404, "{path} on the API port");
            let body = response.text().await.unwrap();
            assert!(
                !body.contains("claude_") && !body.contains("team-"),
                "{body}"
            );
        }
    }
    let get = async |path: &str| {
        let response = client()
            .get(format!("{}{path}", gateway.admin_url()))
            .send()
            .await
            .unwrap();
        (response.status().as_u16(), response.text().await.unwrap())
    };
    let (status, metrics) = get("/metrics").await;
    assert_eq!(status, 200);
    assert!(metrics.contains("claude_slots_in_use"), "{metrics}");
    assert!(metrics.contains("gateway_connections_open"), "{metrics}");
    assert!(!metrics.contains(PREMIUM_KEY));
    assert_eq!(get("/healthz").await, (200, "ok\n".to_owned()));
    let (status, ready) = get("/readyz").await;
    assert_eq!(status, 200);
    assert!(
        ready.contains("2 keys loaded") && ready.contains("redis reachable"),
        "{ready}"
    );
    let (status, json) = get("/status").await;
    assert_eq!(status, 200);
    for field in [
        r#""backend":"redis""#,
        r#""degraded":false"#,
        r#""keys":2"#,
        r#""max":4096"#,
        r#""draining":false"#,
    ] {
        assert!(json.contains(field), "{field} in {json}");
    }
    assert!(!json.contains(PREMIUM_KEY));

    // Redis goes away: still ready (serving from in-process state), and saying so.
    redis.kill();
    let admin = gateway.admin_url();
    let readyz = async || {
        let response = client()
            .get(format!("{admin}/readyz"))
            .send()
            .await
            .unwrap();
        (response.status().as_u16(), response.text().await.unwrap())
    };
    assert!(
        eventually(Duration::from_secs(5), async || {
            let (status, text) = readyz().await;
            status == 200 && text.contains("degraded")
        })
        .await,
        "{:?}",
        readyz().await
    );
    let response = post_messages(&gateway, PREMIUM_KEY, false).await.unwrap();
    assert_eq!(response.status(), 200, "served while degraded");
    redis.restart();
    assert!(
        eventually(Duration::from_secs(10), async || {
            readyz().await.1.contains("redis reachable")
        })
        .await,
        "{:?}",
        readyz().await
    );
}

/// The rule: the admin listener on loopback answers only requests that name it
/// (`localhost`, `127.0.0.1`, `[::1]`, or a name of `--admin-host`): a page that rebinds its
/// own name to 127.0.0.1 gets `421` for every route that names tenants; the probes answer
/// any name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_listener_answers_only_its_own_host_names() {
    let _turn = crate::support::file_turn(module_path!());
    let _serial = SERIAL.lock().await;
    let mock = MockAnthropic::start();
    let extra = ["--admin-host", "gateway.internal"];
    let gateway = Gateway::start_with(&mock.url(), &keys_toml(8, 200, ""), None, &extra);
    let response = post_messages(&gateway, PREMIUM_KEY, false).await.unwrap();
    assert_eq!(response.status(), 200);
    response.bytes().await.unwrap();
    let port = gateway
        .admin_url()
        .rsplit(':')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    let get = async |path: &str, host: &str| {
        let head = format!("GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n");
        raw(port, &head, b"", Duration::from_secs(5)).await
    };
    for path in ["/usage", "/status", "/live", "/metrics", "/"] {
        let (status, answer) = get(path, "attacker.example").await;
        assert_eq!(status, 421, "{path}: {answer}");
        assert!(!answer.contains("team-"), "{path}: {answer}");
        assert_eq!(get(path, &format!("attacker.example:{port}")).await.0, 421);
        for host in [format!("localhost:{port}"), "gateway.internal".to_owned()] {
            assert_eq!(get(path, &host).await.0, 200, "{path} as {host}");
        }
    }
    for probe in ["/healthz", "/readyz"] {
        assert_eq!(get(probe, "attacker.example").await.0, 200, "{probe}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_the_cap_with_every_connection_busy_a_new_one_is_refused() {
    let _turn = crate::support::file_turn(module_path!());
    let _serial = SERIAL.lock().await;
    let mock = MockAnthropic::start();
    let gateway = Gateway::start_with(
        &mock.url(),
        &keys_toml(8, 200, ""),
        None,
        &["--max-connections", "2", "--key-max-requests", "2"],
    );
    // The start-up check's connection is gone (a newcomer at the cap closes only a
    // connection idle for a second).
    assert!(
        eventually(Duration::from_secs(2), async || {
            gateway.admin("/status").await.contains(r#""open":0"#)
        })
        .await
    );
    let slow: Vec<_> = (0..2)
        .map(|_| {
            let url = gateway.url();
            tokio::spawn(async move {
                client()
                    .post(format!("{url}/v1/messages"))
                    .header("x-api-key", PREMIUM_KEY)
                    .header("x-mock-delay-ms", "1500")
                    .body(messages_body(false))
                    .send()
                    .await
                    .unwrap()
                    .status()
                    .as_u16()
            })
        })
        .collect();
    assert!(
        eventually(Duration::from_secs(2), async || mock.in_flight() == 2).await,
        "{}",
        gateway.log_text()
    );
    let (status, answer) = raw(
        gateway.port,
        &post_head("/v1/messages", PREMIUM_KEY, 2),
        b"{}",
        Duration::from_secs(2),
    )
    .await;
    assert_eq!(status, 529, "refused, not queued: {answer}");
    assert!(answer.contains("retry-after: 1"), "{answer}");
    for call in slow {
        assert_eq!(call.await.unwrap(), 200, "the calls being served go on");
    }
    let response = post_messages(&gateway, PREMIUM_KEY, false).await.unwrap();
    assert_eq!(response.status(), 200, "served once a connection is free");
    let metrics = gateway.metrics().await;
    assert_eq!(
        metric_sum(&metrics, "gateway_connections_refused_total"),
        1.0,
        "{metrics}"
    );
}

/// A `POST /v1/messages` with `key` from `client`: the status, `retry-after` and body (its
/// `request_id` left out).
async fn auth_answer(
    client: &reqwest::Client,
    gateway: &Gateway,
    key: &str,
) -> (u16, Option<String>, String) {
    let response = client
        .post(format!("{}/v1/messages", gateway.url()))
        .header("x-api-key", key)
        .body(messages_body(false))
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    let retry_after = response
        .headers()
        .get("retry-after")
        .map(|v| v.to_str().unwrap().to_owned());
    // Every answer has its own `request_id` (as its `request-id` header): the rest is
    // compared.
    let mut body: serde_json::Value =
        serde_json::from_str(&response.text().await.unwrap()).expect("an error body in JSON");
    if let Some(fields) = body.as_object_mut() {
        fields.remove("request_id");
    }
    (status, retry_after, body.to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_authentications_are_slowed_per_key_and_per_address_on_distinct_keys() {
    let _turn = crate::support::file_turn(module_path!());
    let _serial = SERIAL.lock().await;
    let mock = MockAnthropic::start();
    // Sixty more users behind the same address (a NAT), their keys never seen from it yet,
    // as after a restart.
    let users: Vec<String> = (0..60).map(|i| format!("sk-gw-nat-user-{i}")).collect();
    let extra: String = users
        .iter()
        .enumerate()
        .map(|(i, key)| {
            format!("\n[[keys]]\nkey = \"{key}\"\ntenant = \"nat-{i}\"\ntier = \"premium\"\n")
        })
        .collect();
    let gateway = Gateway::start_with(
        &mock.url(),
        &keys_toml(8, 200, &extra),
        None,
        &["--auth-failure-burst", "5", "--auth-failure-rate", "1"],
    );

    // One client retries a revoked key twice a second from 127.0.0.1 all along.
    let stop = Arc::new(AtomicBool::new(false));
    let retrier = tokio::spawn({
        let (url, stop) = (gateway.url(), stop.clone());
        async move {
            let mut statuses = Vec::new();
            let mut every = tokio::time::interval(Duration::from_millis(500));
            while !stop.load(Ordering::Relaxed) && statuses.len() < 200 {
                every.tick().await;
                let response = client()
                    .post(format!("{url}/v1/messages"))
                    .header("x-api-key", "sk-gw-revoked")
                    .body(messages_body(false))
                    .send()
                    .await
                    .unwrap();
                statuses.push(response.status().as_u16());
            }
            statuses
        }
    });
    // Once it is slowed (its burst of 5 spent, at 2 a second), the others call.
    let slowed = eventually(Duration::from_secs(10), async || {
        let text = gateway.metrics().await;
        // (The counter is there from start, at 0.)
        text.lines().any(|l| {
            l.strip_prefix("gateway_auth_failures_total{answer=\"429\"} ")
                .and_then(|v| v.parse::<f64>().ok())
                .is_some_and(|v| v > 0.0)
        })
    })
    .await;
    assert!(slowed, "the retrier was slowed");
    let mut served = 0;
    for key in &users {
        let (status, ..) = auth_answer(&client(), &gateway, key).await;
        served += usize::from(status == 200);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.store(true, Ordering::Relaxed);
    let retried = retrier.await.unwrap();
    let checked = retried.iter().filter(|&&s| s == 401).count();
    eprintln!(
        "revoked key retried {} times ({checked} checked, the rest 429); other users: {served} of 60 served",
        retried.len()
    );
    assert_eq!(served, 60, "the other users behind the address were served");
    assert!(
        retried.contains(&429),
        "the retrier was slowed: {retried:?}"
    );
    // Its burst, then one a second (it sent two a second).
    assert!(
        checked <= 6 + retried.len() / 2,
        "{checked} retries checked: {retried:?}"
    );

    // A guesser cycling distinct keys from the same address is slowed.
    let started = Instant::now();
    let mut statuses = Vec::new();
    let mut retry_after = None;
    for i in 0..200 {
        let (status, after, _) = auth_answer(&client(), &gateway, &format!("sk-guess-{i}")).await;
        statuses.push(status);
        retry_after = after.or(retry_after);
    }
    let took = started.elapsed();
    let unauthorized = statuses.iter().filter(|&&s| s == 401).count();
    let slowed = statuses.iter().filter(|&&s| s == 429).count();
    eprintln!("200 guesses in {took:?}: {unauthorized} checked (401), {slowed} not checked (429)");
    // The burst (one drawn by the revoked key, refilled since), then one a second.
    let refilled = took.as_secs() as usize + 1;
    assert!(
        (4..=5 + refilled).contains(&unauthorized),
        "{unauthorized} checked in {took:?}: {statuses:?}"
    );
    assert_eq!(unauthorized + slowed, 200);
    let retry_after: u64 = retry_after.expect("retry-after").parse().unwrap();
    assert!((1..=2).contains(&retry_after), "retry-after {retry_after}");

    // While slowed, a right key (one of the users', never sent by the guesser) and a wrong
    // one get the same answer. Just after a refill is spent, so a second of slowing is left.
    let spent = eventually(Duration::from_secs(5), async || {
        auth_answer(&client(), &gateway, "sk-guess-wait").await.0 == 401
    })
    .await;
    assert!(spent, "a refill came within the bound");
    let spent_at = Instant::now();
    let (mut right_times, mut wrong_times) = (Vec::new(), Vec::new());
    // Pairs while well within that second (each a fresh connection, a few ms).
    while right_times.len() < 20 && spent_at.elapsed() < Duration::from_millis(600) {
        let sent = Instant::now();
        let right = auth_answer(&client(), &gateway, &users[right_times.len()]).await;
        right_times.push(sent.elapsed());
        let sent = Instant::now();
        let wrong = auth_answer(&client(), &gateway, "sk-guess-wrong").await;
        wrong_times.push(sent.elapsed());
        assert_eq!(right.0, 429, "{right:?}");
        assert_eq!(right, wrong, "a right key is told apart from a wrong one");
    }
    assert!(!right_times.is_empty());
    let median = |times: &mut Vec<Duration>| {
        times.sort();
        times[times.len() / 2]
    };
    eprintln!(
        "while slowed, {} right and wrong keys: the same 429; median {:?} and {:?}",
        right_times.len(),
        median(&mut right_times),
        median(&mut wrong_times)
    );

    // Another address is not slowed.
    let other = reqwest::Client::builder()
        .local_address(std::net::IpAddr::from([127, 0, 0, 2]))
        .build()
        .unwrap();
    assert_eq!(auth_answer(&other, &gateway, "sk-guess-other").await.0, 401);
    assert_eq!(auth_answer(&other, &gateway, GUEST_KEY).await.0, 200);
    assert_eq!(mock.calls(), 61);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_closes_idle_and_half_sent_connections_at_once_and_drains_calls() {
    let _turn = crate::support::file_turn(module_path!());
    let _serial = SERIAL.lock().await;
    let mock = MockAnthropic::start();
    let mut gateway = Gateway::start(&mock.url(), &keys_toml(8, 200, ""), None);
    let port = gateway.port;
    let mut silent = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    let mut half_head = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    half_head
        .write_all(b"POST /v1/messages HTTP/1.1\r\nhost: gateway\r\nx-api-")
        .await
        .unwrap();
    let mut half_body = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    half_body
        .write_all(post_head("/v1/messages", PREMIUM_KEY, 1_000).as_bytes())
        .await
        .unwrap();
    half_body.write_all(b"{\"model\":").await.unwrap();
    let call = tokio::spawn({
        let url = gateway.url();
        async move {
            let response = client()
                .post(format!("{url}/v1/messages"))
                .header("x-api-key", PREMIUM_KEY)
                .header("x-mock-delay-ms", "1500")
                .body(messages_body(false))
                .send()
                .await
                .unwrap();
            (response.status().as_u16(), response.text().await.unwrap())
        }
    });
    assert!(
        eventually(Duration::from_secs(2), async || mock.in_flight() == 1).await,
        "the call reached the upstream"
    );
    let signalled = Instant::now();
    gateway.terminate();

    let closed_within = async |stream: &mut TcpStream| {
        let mut answer = Vec::new();
        let read =
            tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut answer)).await;
        assert!(read.is_ok(), "still open 5 s after SIGTERM");
        (
            signalled.elapsed(),
            String::from_utf8_lossy(&answer).into_owned(),
        )
    };
    let (silent_closed, _) = closed_within(&mut silent).await;
    let (head_closed, _) = closed_within(&mut half_head).await;
    let (body_closed, answer) = closed_within(&mut half_body).await;
    // While the call drains, the admin listener says so.
    let readyz = client()
        .get(format!("{}/readyz", gateway.admin_url()))
        .send()
        .await
        .unwrap();
    assert_eq!(readyz.status(), 503);
    assert_eq!(readyz.text().await.unwrap(), "draining\n");
    let (status, body) = call.await.unwrap();
    let call_done = signalled.elapsed();
    let exit = gateway
        .wait_exit(Duration::from_secs(10))
        .expect("the gateway exits after its call");
    let exited = signalled.elapsed();
    eprintln!(
        "after SIGTERM: silent connection closed at {silent_closed:?}, half-sent head at \
         {head_closed:?}, half-sent body at {body_closed:?} (answered {}), the call in \
         flight ended at {call_done:?}, the process at {exited:?}",
        status_of(&answer)
    );
    assert!(exit.success(), "{exit}");
    assert!(silent_closed < Duration::from_millis(500));
    assert!(head_closed < Duration::from_millis(500));
    assert!(body_closed < Duration::from_millis(500));
    assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
    assert_eq!(status, 200, "the call in flight was drained: {body}");
    assert_eq!(body, MESSAGE_JSON);
    assert!(exited < Duration::from_secs(3), "exited after {exited:?}");
}

/// Runs the gateway on a keys file; it must refuse to start. Its stderr.
fn refused(keys: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    let path = target_tmp().join(format!(
        "refused-keys-{}-{}.toml",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::write(&path, keys).unwrap();
    let out = Command::new(gateway_binary())
        .args(["--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0"])
        .args(["--upstream", "http://127.0.0.1:9"])
        .arg("--keys")
        .arg(&path)
        .env("ANTHROPIC_API_KEY", UPSTREAM_KEY)
        .output()
        .expect("run the gateway");
    assert!(!out.status.success(), "started with:\n{keys}");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

const KEY_ENTRY: &str = "[[keys]]\nkey = \"sk-secret-ok\"\ntenant = \"t\"\ntier = \"premium\"\n";

#[test]
fn a_bad_keys_file_is_refused_at_start_naming_the_line_never_the_key() {
    let _turn = crate::support::file_turn(module_path!());
    let cases: Vec<(String, usize, &str, &str)> = vec![
        (
            format!("{KEY_ENTRY}\n[limits]\nwindow = 0\n"),
            7,
            "window = 0",
            "sk-secret-ok",
        ),
        (
            format!("{KEY_ENTRY}\n[limits]\nglobal_max = 0\n"),
            7,
            "global_max = 0",
            "sk-secret-ok",
        ),
        (
            format!("{KEY_ENTRY}\n[limits]\nretry_after_ms = 18446744073709551\n"),
            7,
            "retry_after_ms",
            "sk-secret-ok",
        ),
        (
            format!(
                "{KEY_ENTRY}\n[[tiers]]\nname = \"guest\"\ncap = 2\nmax_wait_ms = 100\n\n\
                 [[tiers]]\nname = \"guest\"\ncap = 3\nmax_wait_ms = 100\n"
            ),
            11,
            "`guest` is listed twice",
            "sk-secret-ok",
        ),
        (
            format!("{KEY_ENTRY}\n[[tiers]]\nname = \"pro\"\ncap = 2\nmax_wait_ms = 7200000\n"),
            9,
            "max_wait_ms",
            "sk-secret-ok",
        ),
        (
            "[[keys]]\nkey = \"sk-secr\u{e9}t\"\ntenant = \"t\"\ntier = \"premium\"\n".into(),
            2,
            "could never authenticate",
            "sk-secr",
        ),
        (
            "[[keys]]\nkey = \"sk-nul\\u0000key\"\ntenant = \"t\"\ntier = \"premium\"\n".into(),
            2,
            "could never authenticate",
            "sk-nul",
        ),
        (
            "[[keys]]\nkey = \"sk-with space\"\ntenant = \"t\"\ntier = \"premium\"\n".into(),
            2,
            "could never authenticate",
            "sk-with",
        ),
        (
            "[[keys]]\nkey = 987654321012\ntenant = \"t\"\ntier = \"premium\"\n".into(),
            2,
            "must be a string",
            "987654321012",
        ),
        (
            format!(
                "{KEY_ENTRY}{}",
                KEY_ENTRY.replace("tenant = \"t\"", "tenant = \"u\"")
            ),
            6,
            "listed twice",
            "sk-secret-ok",
        ),
    ];
    for (keys, line, what, secret) in cases {
        let err = refused(&keys);
        assert!(
            err.contains(&format!("line {line}:")) && err.contains(what),
            "expected line {line} and `{what}` for:\n{keys}\ngot: {err}"
        );
        assert!(!err.contains(secret), "the key is shown: {err}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reloads_the_keys_without_dropping_a_call_and_a_bad_file_keeps_the_old_one() {
    let _turn = crate::support::file_turn(module_path!());
    let _serial = SERIAL.lock().await;
    let mock = MockAnthropic::start();
    let gateway = Gateway::start(&mock.url(), &keys_toml(8, 200, ""), None);
    let in_flight = tokio::spawn({
        let url = gateway.url();
        async move {
            let response = client()
                .post(format!("{url}/v1/messages"))
                .header("x-api-key", PREMIUM_KEY)
                .header("x-mock-delay-ms", "1500")
                .body(messages_body(false))
                .send()
                .await
                .unwrap();
            (response.status().as_u16(), response.text().await.unwrap())
        }
    });
    assert!(eventually(Duration::from_secs(2), async || mock.in_flight() == 1).await);

    // The premium key goes, a new one comes, the guest tier gets 3 slots.
    let new_key = "sk-gw-new-team";
    let reloaded = keys_toml_with_guest_cap(8, 3, 200, "")
        .replace(PREMIUM_KEY, new_key)
        .replace("team-premium", "team-new");
    std::fs::write(&gateway.keys_path, reloaded).unwrap();
    gateway.signal("HUP");
    let url = gateway.url();
    assert!(
        eventually(Duration::from_secs(3), async || {
            client()
                .get(format!("{url}/v1/models"))
                .header("x-api-key", new_key)
                .send()
                .await
                .is_ok_and(|r| r.status() == 200)
        })
        .await,
        "the new key works after SIGHUP"
    );
    let (status, body) = in_flight.await.unwrap();
    assert_eq!(
        (status, body.as_str()),
        (200, MESSAGE_JSON),
        "the call in flight"
    );
    let response = post_messages(&gateway, PREMIUM_KEY, false).await.unwrap();
    assert_eq!(response.status(), 401, "the removed key");
    let response = post_messages(&gateway, new_key, false).await.unwrap();
    assert_eq!(response.status(), 200);
    // The guest tier's new cap: three guest calls run at once (one before the reload).
    mock.set_delay(Duration::from_millis(600));
    mock.reset_max_in_flight();
    let guests: Vec<_> = (0..3)
        .map(|_| {
            let url = gateway.url();
            tokio::spawn(async move {
                post_messages_at(&url, GUEST_KEY, &[], false)
                    .await
                    .unwrap()
                    .status()
                    .as_u16()
            })
        })
        .collect();
    for guest in guests {
        assert_eq!(guest.await.unwrap(), 200);
    }
    assert_eq!(mock.max_in_flight(), 3, "the reloaded guest cap");
    mock.set_delay(Duration::ZERO);

    // A bad file: the previous one stays, the log says why.
    std::fs::write(
        &gateway.keys_path,
        format!("{KEY_ENTRY}\n[limits]\nwindow = 0\n"),
    )
    .unwrap();
    gateway.signal("HUP");
    assert!(
        eventually(Duration::from_secs(3), async || {
            gateway.log_text().contains("not reloaded")
        })
        .await
    );
    let log = gateway.log_text();
    assert!(
        log.contains("line 7") && log.contains("window = 0"),
        "{log}"
    );
    assert!(!log.contains("sk-secret-ok"), "{log}");
    let response = post_messages(&gateway, new_key, false).await.unwrap();
    assert_eq!(response.status(), 200, "the previous keys still work");
    let status = gateway.admin("/status").await;
    assert!(
        status.contains(r#""reloads":1,"failed_reloads":1"#),
        "{status}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demotion_gauge_reads_the_truth_without_traffic() {
    let _turn = crate::support::file_turn(module_path!());
    let _serial = SERIAL.lock().await;
    let mock = MockAnthropic::start();
    // 12 input tokens a call (the mock's usage): a budget of 40 demotes past 60, once the
    // sixth call counts.
    let keys = keys_toml(8, 200, "").replace(
        "lease_ttl_ms = 5000",
        "lease_ttl_ms = 5000\ndaily_token_budget = 40",
    );
    let gateway = Gateway::start(&mock.url(), &keys, None);
    for _ in 0..6 {
        let response = post_messages(&gateway, PREMIUM_KEY, false).await.unwrap();
        assert_eq!(response.status(), 200);
    }
    let quiet = Instant::now();
    let gateway_ref = &gateway;
    assert!(
        eventually(Duration::from_secs(3), async || {
            metric_sum(&gateway_ref.metrics().await, "claude_demoted_tenants") == 1.0
        })
        .await,
        "the gauge still reads {} with no traffic",
        metric_sum(&gateway.metrics().await, "claude_demoted_tenants")
    );
    eprintln!(
        "claude_demoted_tenants read 1 {:?} after the last call",
        quiet.elapsed()
    );
}
