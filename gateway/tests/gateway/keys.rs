//! The gateway's keys and its admin listener, as a real process: keys given by their
//! SHA-256, a keys file that must hold `expect_keys` entries (at start and on `SIGHUP`), the
//! admin token, `--record` refusing a file it must not overwrite, and a start while Redis
//! is unreachable (the gateway serves its share of the caps, and `/readyz` says so).
//!
//! Processes are stopped by their pid when their guards drop; every wait is bounded.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use fairgate::extract::KeyTable;

use crate::support::RedisServer;
use crate::support::anthropic::MockAnthropic;
use crate::support::gateway::*;

/// One test at a time (two cores; one test times the gateway).
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A fresh path under the test's temporary directory.
fn temp_path(name: &str) -> PathBuf {
    static N: AtomicU64 = AtomicU64::new(0);
    target_tmp().join(format!(
        "keys-test-{}-{}-{name}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ))
}

/// Runs the gateway on `keys` with `extra` flags; it must refuse to start. Its exit code
/// and stderr.
fn refused_with(keys: &Path, extra: &[&str]) -> (Option<i32>, String) {
    let out = Command::new(gateway_binary())
        .args(["--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0"])
        .args(["--upstream", "http://127.0.0.1:9"])
        .arg("--keys")
        .arg(keys)
        .args(extra)
        .env("ANTHROPIC_API_KEY", UPSTREAM_KEY)
        .env_remove("FAIRGATE_ADMIN_TOKEN")
        .output()
        .expect("run the gateway");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "started: {stderr}");
    (out.status.code(), stderr)
}

/// `keys` written to a fresh file, then [`refused_with`].
fn refused(keys: &str, extra: &[&str]) -> (Option<i32>, String) {
    let path = temp_path("keys.toml");
    std::fs::write(&path, keys).unwrap();
    refused_with(&path, extra)
}

fn sha256_hex(key: &str) -> String {
    KeyTable::sha256(key)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_given_by_its_sha256_authenticates_and_a_bad_entry_is_refused_by_line() {
    let _turn = crate::support::file_turn(module_path!());
    let _serial = SERIAL.lock().await;
    let mock = MockAnthropic::start();
    let hashed_key = "sk-gw-hashed-only";
    let keys = format!(
        "{}\n[[keys]]\nkey_sha256 = \"{}\"\ntenant = \"team-hashed\"\ntier = \"premium\"\n",
        keys_toml(8, 200, ""),
        sha256_hex(hashed_key)
    );
    let gateway = Gateway::start(&mock.url(), &keys, None);
    assert!(
        !std::fs::read_to_string(&gateway.keys_path)
            .unwrap()
            .contains(hashed_key)
    );
    let response = post_messages(&gateway, hashed_key, false).await.unwrap();
    assert_eq!(response.status(), 200);
    let response = post_messages(&gateway, "sk-gw-hashed-onl", false)
        .await
        .unwrap();
    assert_eq!(response.status(), 401);

    // Both `key` and `key_sha256`, or a hash that is not 64 hex digits: refused, by line.
    let both = format!(
        "[[keys]]\nkey = \"sk-secret-both\"\nkey_sha256 = \"{}\"\ntenant = \"t\"\ntier = \"premium\"\n",
        sha256_hex("x")
    );
    let (code, err) = refused(&both, &[]);
    assert_eq!(code, Some(1));
    assert!(
        err.contains("line 1:") && err.contains("exactly one of `key` and `key_sha256`"),
        "{err}"
    );
    assert!(!err.contains("sk-secret-both"), "{err}");
    let short = "[[keys]]\ntenant = \"t\"\nkey_sha256 = \"sk-secret-in-the-wrong-field\"\ntier = \"premium\"\n";
    let (_, err) = refused(short, &[]);
    assert!(
        err.contains("line 3:") && err.contains("64 hex digits"),
        "{err}"
    );
    assert!(!err.contains("sk-secret-in-the-wrong-field"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keys_file_cut_at_an_entry_boundary_is_refused_at_start_and_on_reload() {
    let _turn = crate::support::file_turn(module_path!());
    let _serial = SERIAL.lock().await;
    let mock = MockAnthropic::start();
    let full = format!("expect_keys = 2\n{}", keys_toml(8, 200, ""));
    // The file as a copy cut short would leave it: the first entry only.
    let guest_entry = full.find("[[keys]]\nkey = \"sk-gw-guest-1\"").unwrap();
    let cut = full[..guest_entry].to_owned();
    assert!(cut.ends_with("\n\n") && cut.contains(PREMIUM_KEY));

    let (code, err) = refused(&cut, &[]);
    assert_eq!(code, Some(1));
    assert!(
        err.contains("line 1:")
            && err.contains("expect_keys = 2 but the file holds 1 [[keys]]: cut short"),
        "{err}"
    );
    assert!(!err.contains(PREMIUM_KEY), "{err}");

    let gateway = Gateway::start(&mock.url(), &full, None);
    assert_eq!(
        post_messages(&gateway, GUEST_KEY, false)
            .await
            .unwrap()
            .status(),
        200
    );
    std::fs::write(&gateway.keys_path, &cut).unwrap();
    gateway.signal("HUP");
    let refused_reload = eventually(Duration::from_secs(5), async || {
        gateway
            .admin("/status")
            .await
            .contains("\"failed_reloads\":1")
    })
    .await;
    assert!(refused_reload, "the cut file was refused");
    assert!(
        gateway
            .log_text()
            .contains("expect_keys = 2 but the file holds 1"),
        "{}",
        gateway.log_text()
    );
    // The old keys are kept: the entry the cut file lost still works.
    assert_eq!(
        post_messages(&gateway, GUEST_KEY, false)
            .await
            .unwrap()
            .status(),
        200
    );
    assert!(gateway.admin("/status").await.contains("\"keys\":2"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_listener_asks_for_its_token_on_every_route_but_the_probes() {
    let _turn = crate::support::file_turn(module_path!());
    let _serial = SERIAL.lock().await;
    let mock = MockAnthropic::start();
    let token = "admin-token-for-the-test-0123456789";
    let gateway = Gateway::start_with(
        &mock.url(),
        &keys_toml(8, 200, ""),
        None,
        &["--admin-token", token],
    );
    let get = async |path: &str, authorization: Option<&str>| {
        let mut request = client().get(format!("{}{path}", gateway.admin_url()));
        if let Some(value) = authorization {
            request = request.header("authorization", value);
        }
        let response = request.send().await.unwrap();
        let status = response.status().as_u16();
        let challenge = response.headers().contains_key("www-authenticate");
        (status, challenge, response.text().await.unwrap())
    };
    let bearer = format!("Bearer {token}");
    for path in ["/metrics", "/status", "/live", "/"] {
        let (status, challenge, body) = get(path, None).await;
        assert_eq!((status, challenge), (401, true), "{path} without: {body}");
        assert!(!body.contains("team-premium"), "{path}: {body}");
        let wrong = format!("Bearer {token}x");
        assert_eq!(get(path, Some(&wrong)).await.0, 401, "{path} wrong token");
        assert_eq!(get(path, Some(token)).await.0, 401, "{path} no scheme");
        assert_eq!(
            get(path, Some(&bearer)).await.0,
            200,
            "{path} with the token"
        );
    }
    // The probes answer anyone: health checks often cannot send a header.
    for path in ["/healthz", "/readyz"] {
        assert_eq!(get(path, None).await.0, 200, "{path}");
    }
    // The API port does not take the admin token as a key.
    assert_eq!(
        post_messages(&gateway, token, false)
            .await
            .unwrap()
            .status(),
        401
    );
}

#[test]
fn an_admin_listener_beyond_loopback_without_a_token_is_refused() {
    let _turn = crate::support::file_turn(module_path!());
    let path = temp_path("keys.toml");
    std::fs::write(&path, keys_toml(8, 200, "")).unwrap();
    let out = Command::new(gateway_binary())
        .args(["--listen", "127.0.0.1:0", "--admin", "0.0.0.0:0"])
        .args(["--upstream", "http://127.0.0.1:9"])
        .arg("--keys")
        .arg(&path)
        .env("ANTHROPIC_API_KEY", UPSTREAM_KEY)
        .env_remove("FAIRGATE_ADMIN_TOKEN")
        .output()
        .expect("run the gateway");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("--admin 0.0.0.0:0 is reachable beyond loopback: set --admin-token"),
        "{err}"
    );
    // A token too short to keep a guesser out is refused, without being shown.
    let (code, err) = refused_with(&path, &["--admin-token", "sh0rt-t0ken"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("--admin-token: give at least 16"), "{err}");
    assert!(!err.contains("sh0rt-t0ken"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn record_refuses_the_keys_file_and_a_file_that_is_not_a_recording() {
    let _turn = crate::support::file_turn(module_path!());
    let _serial = SERIAL.lock().await;
    let keys_text = keys_toml(8, 200, "");
    let keys = temp_path("keys.toml");
    std::fs::write(&keys, &keys_text).unwrap();

    // The keys file itself, by its path and through a symlink.
    let (code, err) = refused_with(&keys, &["--record", keys.to_str().unwrap()]);
    assert_eq!(code, Some(1));
    assert!(err.contains("is the keys file"), "{err}");
    let link = temp_path("record-link.jsonl");
    std::os::unix::fs::symlink(&keys, &link).unwrap();
    let (code, err) = refused_with(&keys, &["--record", link.to_str().unwrap()]);
    assert_eq!(code, Some(1));
    assert!(err.contains("is the keys file"), "{err}");
    assert_eq!(std::fs::read_to_string(&keys).unwrap(), keys_text);

    // Another file that is not a recording.
    let notes = temp_path("notes.txt");
    std::fs::write(&notes, "do not lose me\n").unwrap();
    let (code, err) = refused_with(&keys, &["--record", notes.to_str().unwrap()]);
    assert_eq!(code, Some(1));
    assert!(
        err.contains("exists and is not a recording") && err.contains("new or empty file"),
        "{err}"
    );
    assert_eq!(std::fs::read_to_string(&notes).unwrap(), "do not lose me\n");

    // A new file is taken and gets a recording; a gateway started on that recording again
    // takes it too.
    let mock = MockAnthropic::start();
    let recording = temp_path("calls.jsonl");
    let record = ["--record", recording.to_str().unwrap()];
    let gateway = Gateway::start_with(&mock.url(), &keys_text, None, &record);
    let response = post_messages(&gateway, PREMIUM_KEY, false).await.unwrap();
    assert_eq!(response.status(), 200);
    let written = eventually(Duration::from_secs(5), async || {
        std::fs::read_to_string(&recording).is_ok_and(|t| t.contains("\"status\":200"))
    })
    .await;
    assert!(written, "the call was recorded");
    drop(gateway);
    let again = Gateway::start_with(&mock.url(), &keys_text, None, &record);
    assert_eq!(
        post_messages(&again, PREMIUM_KEY, false)
            .await
            .unwrap()
            .status(),
        200
    );
}

/// `n` premium calls the mock answers after `hold`, all at once; how long they took and
/// their statuses.
async fn premium_calls(gateway: &Gateway, n: usize, hold: Duration) -> (Duration, Vec<u16>) {
    let started = Instant::now();
    let calls: Vec<_> = (0..n)
        .map(|_| {
            let url = gateway.url();
            tokio::spawn(async move {
                client()
                    .post(format!("{url}/v1/messages"))
                    .header("x-api-key", PREMIUM_KEY)
                    .header("x-mock-delay-ms", hold.as_millis().to_string())
                    .body(messages_body(false))
                    .send()
                    .await
                    .map_or(0, |r| r.status().as_u16())
            })
        })
        .collect();
    let mut statuses = Vec::new();
    for call in calls {
        statuses.push(call.await.unwrap());
    }
    (started.elapsed(), statuses)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_started_while_redis_is_unreachable_serves_its_share_of_the_caps() {
    let _turn = crate::support::file_turn(module_path!());
    let _serial = SERIAL.lock().await;
    let mock = MockAnthropic::start();
    // A closed port: nothing ever answers there.
    let redis = format!("redis://127.0.0.1:{}/", free_port());
    let keys = keys_toml(8, 200, "");

    // Alone (the default fleet of 1): the whole caps, 8 at once.
    let gateway = Gateway::start(&mock.url(), &keys, Some(&redis));
    let ready = gateway.admin("/readyz").await;
    assert!(
        ready.contains("serving 1/1 of the caps from in-process state"),
        "{ready}"
    );
    let (took, statuses) = premium_calls(&gateway, 16, Duration::from_secs(1)).await;
    eprintln!("fleet of 1: 16 premium calls of 1 s in {took:?}");
    assert!(statuses.iter().all(|&s| s == 200), "{statuses:?}");
    assert_eq!(mock.max_in_flight(), 8);
    assert!(
        took < Duration::from_secs(4),
        "16 calls of 1 s took {took:?}"
    );
    drop(gateway);

    // One of a fleet of 2: half the caps.
    mock.reset_max_in_flight();
    let gateway = Gateway::start_with(&mock.url(), &keys, Some(&redis), &["--fleet-size", "2"]);
    let ready = gateway.admin("/readyz").await;
    assert!(ready.contains("serving 1/2 of the caps"), "{ready}");
    let (took, statuses) = premium_calls(&gateway, 8, Duration::from_secs(1)).await;
    eprintln!("fleet of 2: 8 premium calls of 1 s in {took:?}");
    assert!(statuses.iter().all(|&s| s == 200), "{statuses:?}");
    assert_eq!(mock.max_in_flight(), 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_started_while_redis_is_full_serves_its_share_of_the_caps() {
    let _turn = crate::support::file_turn(module_path!());
    let _serial = SERIAL.lock().await;
    let mock = MockAnthropic::start();
    // A Redis that answers PING but refuses every write: out of memory, nothing to evict.
    let redis = RedisServer::start();
    redis.command("CONFIG SET maxmemory-policy noeviction");
    redis.command("CONFIG SET maxmemory 1");
    assert!(
        redis.command("SET fairgate-full 1").contains("OOM"),
        "Redis is full"
    );
    let gateway = Gateway::start(&mock.url(), &keys_toml(8, 200, ""), Some(&redis.url()));
    let ready = gateway.admin("/readyz").await;
    assert!(ready.contains("serving 1/1 of the caps"), "{ready}");
    let (took, statuses) = premium_calls(&gateway, 16, Duration::from_secs(1)).await;
    eprintln!("Redis full, fleet of 1: 16 premium calls of 1 s in {took:?}");
    assert!(statuses.iter().all(|&s| s == 200), "{statuses:?}");
    assert_eq!(mock.max_in_flight(), 8);
    assert!(
        took < Duration::from_secs(4),
        "16 calls of 1 s took {took:?}"
    );
}
