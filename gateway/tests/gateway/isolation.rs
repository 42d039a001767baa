//! Isolation between key holders: whatever one key sends or leaves unread, the other keys'
//! calls go as they go without it. Each test measures a victim's calls per second alone,
//! then under the attack of another key (a valid one: the attacker is a tenant), and asserts
//! that every victim call is answered and its rate stays at least 75% of the first.
//!
//! The real `fairgate-gateway` process in front of the mock upstream, attackers on raw
//! sockets where a well-behaved client would not do what they do (stall a body, never read
//! an answer). Every wait is bounded; waits are for events (a status, a count), not times.

use std::time::Duration;

use crate::support::anthropic::MockAnthropic;
use crate::support::gateway::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

/// One test at a time (two cores; each times a victim).
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const MIB: usize = 1 << 20;
const KIB: usize = 1 << 10;

/// How long a victim's rate is measured.
const SPAN: Duration = Duration::from_secs(2);

/// Another guest key, of another tenant: the attacker's neighbour in its tier.
const GUEST_2_KEY: &str = "sk-gw-guest-2";

fn second_guest() -> String {
    format!("\n[[keys]]\nkey = \"{GUEST_2_KEY}\"\ntenant = \"team-guest-2\"\ntier = \"guest\"\n")
}

/// Calls of `key` answered `200` per second over `span`, `workers` at a time; and every
/// other outcome seen.
async fn rate_of(
    gateway: &Gateway,
    key: &str,
    span: Duration,
    workers: usize,
) -> (f64, Vec<String>) {
    let deadline = tokio::time::Instant::now() + span;
    let url = gateway.url();
    let tasks: Vec<_> = (0..workers)
        .map(|_| {
            let (url, key) = (url.clone(), key.to_owned());
            tokio::spawn(async move {
                let client = client();
                let (mut ok, mut other) = (0u32, Vec::new());
                while tokio::time::Instant::now() < deadline {
                    let sent = client
                        .post(format!("{url}/v1/messages"))
                        .header("x-api-key", &key)
                        .header("content-type", "application/json")
                        .body(messages_body(false))
                        .send()
                        .await;
                    match sent {
                        Ok(response) if response.status() == 200 => {
                            let _ = response.bytes().await;
                            ok += 1;
                        }
                        Ok(response) => other.push(response.status().to_string()),
                        Err(e) => other.push(e.to_string()),
                    }
                }
                (ok, other)
            })
        })
        .collect();
    let (mut ok, mut other) = (0, Vec::new());
    for task in tasks {
        let (n, failures) = task.await.unwrap();
        ok += n;
        other.extend(failures);
    }
    (f64::from(ok) / span.as_secs_f64(), other)
}

/// The admin listener's `/status`, parsed.
async fn status(gateway: &Gateway) -> serde_json::Value {
    serde_json::from_str(&gateway.admin("/status").await).unwrap()
}

fn post_head(key: &str, length: usize, extra: &str) -> String {
    format!(
        "POST /v1/messages HTTP/1.1\r\nhost: gateway\r\nx-api-key: {key}\r\n\
         content-type: application/json\r\ncontent-length: {length}\r\n{extra}\r\n"
    )
}

/// A `/v1/messages` body of `key` declaring `declared` bytes, of which `sent` are sent;
/// the connection is left open.
async fn body_begun(port: u16, key: &str, declared: usize, sent: usize) -> TcpStream {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    stream
        .write_all(post_head(key, declared, "").as_bytes())
        .await
        .unwrap();
    stream.write_all(&vec![b' '; sent]).await.unwrap();
    stream
}

/// The status of what `stream` is answered within `within` (0: nothing yet), and the text.
async fn answer_of(stream: &mut TcpStream, within: Duration) -> (u16, String) {
    let mut answer = Vec::new();
    let mut buf = [0u8; 4096];
    let _ = tokio::time::timeout(within, async {
        while let Ok(n) = stream.read(&mut buf).await {
            if n == 0 {
                break;
            }
            answer.extend_from_slice(&buf[..n]);
            if answer.windows(4).any(|w| w == b"\r\n\r\n") {
                break;
            }
        }
    })
    .await;
    let text = String::from_utf8_lossy(&answer).into_owned();
    let status = text
        .strip_prefix("HTTP/1.1 ")
        .and_then(|rest| rest.get(..3))
        .and_then(|code| code.parse().ok())
        .unwrap_or(0);
    (status, text)
}

fn assert_kept_up(victim: &str, alone: f64, attacked: (f64, Vec<String>)) {
    let (rate, failures) = attacked;
    eprintln!("{victim}: {alone:.1} calls/s alone, {rate:.1} under the attack");
    assert!(failures.is_empty(), "{victim}: not answered: {failures:?}");
    assert!(
        rate >= 0.75 * alone,
        "{victim}: {rate:.1} calls/s under the attack, {alone:.1} without"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_buffers_at_most_its_share_of_the_body_budget_and_a_declared_length_holds_nothing() {
    let _turn = crate::support::file_turn(module_path!());
    let _serial = SERIAL.lock().await;
    let mock = MockAnthropic::start();
    mock.set_delay(Duration::from_millis(20));
    // The guest key's share: a quarter of the 64 MiB, at least one 16 MiB body.
    let gateway = Gateway::start_with(
        &mock.url(),
        &keys_toml(8, 200, ""),
        None,
        &["--max-body", "16MiB", "--body-budget", "64MiB"],
    );
    let (alone, failures) = rate_of(&gateway, PREMIUM_KEY, SPAN, 4).await;
    assert!(failures.is_empty(), "{failures:?}");

    // 14 MiB of a guest body arrive, and the rest never does: its share is held.
    let held = body_begun(gateway.port, GUEST_KEY, 15 * MIB, 14 * MIB).await;
    assert!(
        eventually(Duration::from_secs(10), async || {
            status(&gateway).await["body_budget"]["used_bytes"].as_u64() >= Some(14 * MIB as u64)
        })
        .await
    );
    // More of its bodies are refused at once, told to come back: the key's share is spent.
    for _ in 0..4 {
        let mut more = body_begun(gateway.port, GUEST_KEY, 15 * MIB, 1).await;
        let (code, answer) = answer_of(&mut more, Duration::from_secs(5)).await;
        assert_eq!(code, 429, "{answer}");
        assert!(answer.contains("retry-after: 1"), "{answer}");
    }
    assert_kept_up(
        "premium",
        alone,
        rate_of(&gateway, PREMIUM_KEY, SPAN, 4).await,
    );
    let whole = client()
        .post(format!("{}/v1/messages", gateway.url()))
        .header("x-api-key", PREMIUM_KEY)
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
    assert_eq!(whole.status(), 200, "another key's largest body still fits");
    drop(held);
    assert!(
        eventually(Duration::from_secs(5), async || {
            status(&gateway).await["body_budget"]["used_bytes"] == 0
        })
        .await
    );

    // Four bodies declaring 15 MiB and sending one byte hold their first 64 KiB each.
    let mut trickling = Vec::new();
    for _ in 0..4 {
        trickling.push(body_begun(gateway.port, GUEST_KEY, 15 * MIB, 1).await);
    }
    assert!(
        eventually(Duration::from_secs(5), async || {
            status(&gateway).await["body_budget"]["used_bytes"] == 4 * 64 * KIB
        })
        .await,
        "{}",
        status(&gateway).await
    );
    assert_kept_up(
        "premium",
        alone,
        rate_of(&gateway, PREMIUM_KEY, SPAN, 4).await,
    );
}

/// Sends a `/v1/messages` call of `key` whose answer is `padding` bytes long, and never
/// reads it: the socket's receive buffer is small, so the kernel does not read it either.
async fn unread_call(port: u16, key: &str, padding: usize) -> TcpStream {
    let socket = TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut stream = socket.connect(([127, 0, 0, 1], port).into()).await.unwrap();
    let body = messages_body(false);
    let head = post_head(
        key,
        body.len(),
        &format!("x-mock-padding-bytes: {padding}\r\n"),
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    stream.write_all(body.as_bytes()).await.unwrap();
    stream
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_nobody_reads_frees_its_slot_at_the_upstreams_last_byte_and_is_cut_later() {
    let _turn = crate::support::file_turn(module_path!());
    let _serial = SERIAL.lock().await;
    let mock = MockAnthropic::start();
    mock.set_delay(Duration::from_millis(20));
    // The guest tier's 4 slots, shared by two guest tenants.
    let gateway = Gateway::start_with(
        &mock.url(),
        &keys_toml_with_guest_cap(8, 4, 20_000, &second_guest()),
        None,
        &["--write-timeout", "3s", "--key-answer-buffer", "64MiB"],
    );
    let (alone, failures) = rate_of(&gateway, GUEST_2_KEY, SPAN, 2).await;
    assert!(failures.is_empty(), "{failures:?}");

    // Four 4 MiB answers the guest key never reads (without the relay: its 4 slots, held
    // until the client reads).
    let mut unread = Vec::new();
    for _ in 0..4 {
        unread.push(unread_call(gateway.port, GUEST_KEY, 4 * MIB).await);
    }
    // The upstream is done with them; their bytes wait in the key's buffer, the slots are free
    // (the slot gauge follows the upstream's last byte by a few milliseconds: waited for).
    assert!(
        eventually(Duration::from_secs(10), async || {
            mock.calls() >= 4
                && mock.in_flight() == 0
                && status(&gateway).await["answer_buffer"]["used_bytes"].as_u64() > Some(0)
                && gateway.slots_in_use().await == 0.0
        })
        .await,
        "slots in use: {}",
        gateway.slots_in_use().await
    );
    assert!(
        eventually(Duration::from_secs(5), async || {
            gateway.slots_in_use().await == 0.0
        })
        .await,
        "the unread answers hold slots"
    );
    assert_kept_up(
        "the other guest",
        alone,
        rate_of(&gateway, GUEST_2_KEY, SPAN, 2).await,
    );

    // Nothing read for the write timeout: the connections are cut, the buffer given back.
    assert!(
        eventually(Duration::from_secs(10), async || {
            metric_sum(&gateway.metrics().await, "gateway_answers_cut_total") == 4.0
                && status(&gateway).await["answer_buffer"]["used_bytes"] == 0
        })
        .await
    );
    for mut stream in unread {
        let mut rest = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut rest));
        assert!(read.await.is_ok(), "the connection is closed");
        assert!(rest.len() < 4 * MIB, "the answer was cut short");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_whose_unread_answers_fill_its_buffer_holds_its_slots_no_longer_than_the_write_timeout()
 {
    let _turn = crate::support::file_turn(module_path!());
    let _serial = SERIAL.lock().await;
    let mock = MockAnthropic::start();
    // The guest tier's 2 slots; the attacker's buffer is 1 MiB, its answers 16 MiB.
    let gateway = Gateway::start_with(
        &mock.url(),
        &keys_toml_with_guest_cap(8, 2, 20_000, &second_guest()),
        None,
        &["--write-timeout", "2s", "--key-answer-buffer", "1MiB"],
    );
    let mut unread = Vec::new();
    for _ in 0..2 {
        unread.push(unread_call(gateway.port, GUEST_KEY, 16 * MIB).await);
    }
    assert!(
        eventually(Duration::from_secs(5), async || {
            gateway.slots_in_use().await == 2.0
        })
        .await
    );
    // The other guest waits for a slot: until the attacker's calls are cut.
    let started = std::time::Instant::now();
    let response = post_messages(&gateway, GUEST_2_KEY, false).await.unwrap();
    assert_eq!(response.status(), 200);
    let waited = started.elapsed();
    assert!(
        waited < Duration::from_secs(5),
        "waited {waited:?} for a slot the unread answers held"
    );
    assert!(
        eventually(Duration::from_secs(5), async || {
            metric_sum(&gateway.metrics().await, "gateway_answers_cut_total") == 2.0
        })
        .await
    );
    assert!(mock.wait_in_flight(0, Duration::from_secs(5)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_key_cannot_fill_the_connection_cap_with_trickling_bodies() {
    let _turn = crate::support::file_turn(module_path!());
    let _serial = SERIAL.lock().await;
    let mock = MockAnthropic::start();
    mock.set_delay(Duration::from_millis(20));
    // 64 connections; a key may have a quarter of them in progress.
    let gateway = Gateway::start_with(
        &mock.url(),
        &keys_toml(8, 200, ""),
        None,
        &["--max-connections", "64"],
    );
    let (alone, failures) = rate_of(&gateway, PREMIUM_KEY, SPAN, 4).await;
    assert!(failures.is_empty(), "{failures:?}");

    // 100 bodies of the guest key, each a byte of 1,000 and then nothing.
    let (mut held, mut refused) = (Vec::new(), 0);
    for _ in 0..100 {
        let mut stream = body_begun(gateway.port, GUEST_KEY, 1000, 1).await;
        match answer_of(&mut stream, Duration::from_millis(300)).await {
            (0, _) => held.push(stream),
            (429, answer) if answer.contains("retry-after") => refused += 1,
            (_, answer) => panic!("{answer}"),
        }
    }
    assert_eq!(held.len(), 16, "a quarter of the cap");
    assert_eq!(refused, 84);
    assert_kept_up(
        "premium",
        alone,
        rate_of(&gateway, PREMIUM_KEY, SPAN, 4).await,
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_what_its_open_files_allow_every_call_is_answered_or_refused_with_a_retry_after() {
    let _turn = crate::support::file_turn(module_path!());
    let _serial = SERIAL.lock().await;
    let mock = MockAnthropic::start();
    mock.set_delay(Duration::from_millis(200));
    let keys: String = (0..8)
        .map(|i| {
            format!(
                "\n[[keys]]\nkey = \"sk-many-{i}\"\ntenant = \"many-{i}\"\ntier = \"premium\"\n"
            )
        })
        .collect();
    // 1,024 files: 512 kept, two a call, so 256 connections.
    let gateway = Gateway::start_limited(
        &mock.url(),
        &keys_toml(16, 200, &keys),
        None,
        &[],
        Some(1024),
    );
    assert!(
        gateway.log_text().contains("lowered"),
        "{}",
        gateway.log_text()
    );
    // One client for all (it keeps no connection idle, so each call opens its own): 600
    // built at once would each take long enough to send its request that the gateway,
    // at its cap, could close its connection as one silent for 250 ms.
    let client = client();
    let calls: Vec<_> = (0..600)
        .map(|i| {
            let url = gateway.url();
            let client = client.clone();
            tokio::spawn(async move {
                let sent = client
                    .post(format!("{url}/v1/messages"))
                    .header("x-api-key", format!("sk-many-{}", i % 8))
                    .header("content-type", "application/json")
                    .body(messages_body(false))
                    .send()
                    .await;
                match sent {
                    Ok(response) => {
                        let code = response.status().as_u16();
                        let told = response.headers().contains_key("retry-after");
                        let _ = response.bytes().await;
                        if code == 200 || told {
                            Ok(code)
                        } else {
                            Err(format!("{code} without retry-after"))
                        }
                    }
                    Err(e) => Err(format!("{e:?}")),
                }
            })
        })
        .collect();
    let mut counts = std::collections::BTreeMap::new();
    let mut failures = Vec::new();
    for call in calls {
        match call.await.unwrap() {
            Ok(code) => *counts.entry(code).or_insert(0) += 1,
            Err(e) => failures.push(e),
        }
    }
    eprintln!("answers: {counts:?}; failures: {}", failures.len());
    assert!(
        failures.is_empty(),
        "{:?}",
        &failures[..failures.len().min(5)]
    );
    assert!(
        counts.keys().all(|code| [200, 429, 529].contains(code)),
        "{counts:?}"
    );
    assert!(counts.get(&200) >= Some(&256), "{counts:?}");
    assert!(!gateway.log_text().contains("too many open files"));
}

/// Raises this process's open-files limit to `files` (root may raise the hard limit too).
fn allow_open_files(files: u64) {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let wanted = Rlimit {
        current: Some(files),
        maximum: Some(files),
    };
    if setrlimit(Resource::Nofile, wanted).is_err() {
        let mut limit = getrlimit(Resource::Nofile);
        limit.current = limit.maximum;
        let _ = setrlimit(Resource::Nofile, limit);
    }
}

/// `n` streaming calls of `key`, each read as its events come, begun 500 at a time (the
/// next 500 once `begun()` counts the ones before: a burst of thousands of connects
/// overflows the listen backlogs, and a dropped connect is retried by the kernel seconds
/// later); the statuses (0: no answer).
async fn streams(
    gateway: &Gateway,
    key: &str,
    n: usize,
    mut begun: impl AsyncFnMut() -> usize,
) -> Vec<tokio::task::JoinHandle<u16>> {
    let mut calls = Vec::with_capacity(n);
    while calls.len() < n {
        let batch = 500.min(n - calls.len());
        calls.extend(streams_now(gateway, key, batch));
        let wanted = calls.len();
        if !eventually(Duration::from_secs(60), async || begun().await >= wanted).await {
            let mut ended = std::collections::BTreeMap::new();
            for call in calls.iter().filter(|call| call.is_finished()) {
                let _ = call;
                *ended.entry("ended").or_insert(0) += 1;
            }
            panic!("{} of {wanted} calls begun; {ended:?}", begun().await);
        }
    }
    calls
}

fn streams_now(gateway: &Gateway, key: &str, n: usize) -> Vec<tokio::task::JoinHandle<u16>> {
    (0..n)
        .map(|_| {
            let (port, key) = (gateway.port, key.to_owned());
            tokio::spawn(async move {
                let mut stream = match TcpStream::connect(("127.0.0.1", port)).await {
                    Ok(stream) => stream,
                    Err(e) => {
                        eprintln!("connect: {e}");
                        return 1;
                    }
                };
                let body = messages_body(true);
                let head = post_head(&key, body.len(), "connection: close\r\n");
                let sent = async {
                    stream.write_all(head.as_bytes()).await?;
                    stream.write_all(body.as_bytes()).await
                };
                if let Err(e) = sent.await {
                    eprintln!("send: {e}");
                    return 2;
                }
                let (status, text) = answer_of(&mut stream, Duration::from_secs(120)).await;
                if status != 200 {
                    eprintln!("{status}: {text}");
                }
                let mut rest = Vec::new();
                let _ =
                    tokio::time::timeout(Duration::from_secs(120), stream.read_to_end(&mut rest))
                        .await;
                status
            })
        })
        .collect()
}

/// Opt-in (`FAIRGATE_MEASURE_STREAMS=1`, a release build): streams held at once, the
/// gateway's memory per stream and after them: 10,000 with the upstream over HTTP/2
/// (`--upstream-http2`: a file a stream), 9,000 over HTTP/1.1 (two files a stream: the
/// most this machine's 20,000 open files allow the mock's process, which holds both ends);
/// `FAIRGATE_STREAMS` sets fewer. Then 7,500 clients against a gateway whose 10,000 open
/// files hold 4,744 calls, each answered or refused with `529`.
///
/// ```sh
/// FAIRGATE_MEASURE_STREAMS=1 cargo test --release -p fairgate-gateway --test gateway \
///     isolation::streams_held -- --nocapture
/// ```
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_held_at_once_cost_little_memory_each_and_past_the_files_are_refused_cleanly() {
    if std::env::var_os("FAIRGATE_MEASURE_STREAMS").is_none() {
        eprintln!("opt-in: FAIRGATE_MEASURE_STREAMS=1 (a release build) runs it");
        return;
    }
    let _turn = crate::support::file_turn(module_path!());
    let _serial = SERIAL.lock().await;
    allow_open_files(20_000);
    let n: usize = std::env::var("FAIRGATE_STREAMS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000);
    let mock = MockAnthropic::start();
    // About 11 events 8 s apart: every stream is still open when the last one begins.
    mock.set_event_gap(Duration::from_secs(8));
    // A budget no stream here comes near: the measure is of streams, not of demotion.
    let keys = keys_toml(40_000, 200, "")
        .replace("[limits]", "[limits]\ndaily_token_budget = 1000000000000")
        .replace("max_wait_ms = 30000", "max_wait_ms = 120000");
    let mut per_stream = [0.0; 2];
    for (http2, per_stream) in [false, true].into_iter().zip(&mut per_stream) {
        let mut flags = vec!["--max-connections", "40000", "--key-max-requests", "40000"];
        if http2 {
            flags.push("--upstream-http2");
        }
        let gateway = Gateway::start_limited(&mock.url(), &keys, None, &flags, Some(20_000));
        *per_stream = if http2 {
            held_streams(&mock, &gateway, n, "HTTP/2").await
        } else {
            held_streams(&mock, &gateway, n.min(9_000), "HTTP/1.1").await
        };
    }

    // 10,000 files: 4,744 calls at once; 7,500 clients.
    let gateway = Gateway::start_limited(
        &mock.url(),
        &keys,
        None,
        &["--key-max-requests", "40000", "--max-connections", "40000"],
        Some(10_000),
    );
    let before = mock.calls() as usize;
    let calls = streams(&gateway, PREMIUM_KEY, 7_500, async || {
        let status = status(&gateway).await;
        let refused = status["connections"]["refused"].as_u64().unwrap_or(0) as usize;
        mock.calls() as usize - before + refused
    })
    .await;
    let mut counts = std::collections::BTreeMap::new();
    for call in calls {
        *counts.entry(call.await.unwrap()).or_insert(0) += 1;
    }
    eprintln!("7,500 clients, open files for 4,744 calls: {counts:?}");
    assert!(
        counts.keys().all(|code| [200, 529].contains(code)),
        "{counts:?}"
    );
    assert!(!gateway.log_text().contains("too many open files"));
    assert!(per_stream[1] <= 20.0, "{:.1} KiB a stream", per_stream[1]);
}

/// `n` streams held at once through `gateway` (its upstream `over`): its memory a stream
/// in KiB, once the allocator has given back what their start left behind. Asserts that
/// every one is answered and that memory goes back near idle after them.
async fn held_streams(mock: &MockAnthropic, gateway: &Gateway, n: usize, over: &str) -> f64 {
    let warm = post_messages(gateway, PREMIUM_KEY, true).await.unwrap();
    let _ = warm.bytes().await;
    let idle = gateway.rss();
    let before = mock.calls() as usize;
    let calls = streams(gateway, PREMIUM_KEY, n, async || {
        mock.calls() as usize - before
    })
    .await;
    let all_open = eventually(Duration::from_secs(30), async || mock.in_flight() >= n).await;
    if !all_open {
        let metrics = gateway.metrics().await;
        let waiting: Vec<&str> = metrics
            .lines()
            .filter(|l| {
                l.starts_with("claude_queue_depth")
                    || l.starts_with("claude_slots_in_use")
                    || l.starts_with("gateway_connections")
            })
            .collect();
        panic!(
            "{} of {n} streams open ({} at most, {} calls); {}; {waiting:?}",
            mock.in_flight(),
            mock.max_in_flight(),
            mock.calls(),
            gateway.admin("/status").await
        );
    }
    // What the streams' start allocated and freed (their requests' futures, buffers) is
    // given back within the allocator's decay of a second: the memory the held streams
    // cost is what stays (the streams run for another minute).
    let mut held = gateway.rss();
    for _ in 0..30 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        held = held.min(gateway.rss());
    }
    let per_stream = (held.saturating_sub(idle)) as f64 / n as f64 / 1024.0;
    let mut answered = 0;
    for call in calls {
        answered += usize::from(call.await.unwrap() == 200);
    }
    assert!(mock.wait_in_flight(0, Duration::from_secs(30)));
    let mut after = gateway.rss();
    for _ in 0..50 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        after = after.min(gateway.rss());
    }
    eprintln!(
        "{n} streams over {over}: RSS {:.1} MB idle, {:.1} MB with them held ({per_stream:.1} \
         KiB a stream), {:.1} MB after; {answered} answered 200",
        idle as f64 / 1e6,
        held as f64 / 1e6,
        after as f64 / 1e6,
    );
    assert_eq!(answered, n);
    assert!(
        after <= idle + (held - idle) / 4,
        "RSS {after} after, {idle} idle"
    );
    per_stream
}
