//! What a call costs at the gateway: input and output tokens, estimated from the body and
//! `max_tokens` when it goes, settled on the answer's `usage`, against the fair share and
//! the daily budget.
//!
//! The mock upstream answers each message as long as its `max_tokens`
//! ([`MockAnthropic::set_output_pace`]), so a call's time holding a slot is proportional to
//! its output, and it sums that time per caller (`x-mock-tag`). Two tenants of one tier:
//! the peer sends ordinary calls (a short prompt, `max_tokens` 2,048); the hog sends tiny
//! bodies asking for 64,000 output tokens each.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::support::anthropic::MockAnthropic;
use crate::support::gateway::*;

const HOG_KEY: &str = "sk-gw-hog-1";
const PEER_KEY: &str = "sk-gw-peer-1";
/// Slots of the tier both tenants are in (and the global cap).
const SLOTS: u32 = 8;
/// An output token takes this long at the mock: a hog's answer 640 ms, a peer's 20 ms
/// (long enough that the gateway's own work, on a busy machine, is a small part of it).
const PACE: Duration = Duration::from_micros(10);
const HOG_MAX_TOKENS: u64 = 64_000;
const PEER_MAX_TOKENS: u64 = 2_048;
/// A daily budget no phase of the share test reaches (a demotion would change the classes).
const BUDGET: u64 = 1_000_000_000_000;

static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Both tenants on the `pro` tier, `SLOTS` slots, a daily budget of `budget`.
fn keys(budget: u64) -> String {
    format!(
        r#"
[[keys]]
key = "{HOG_KEY}"
tenant = "team-hog"
tier = "pro"

[[keys]]
key = "{PEER_KEY}"
tenant = "team-peer"
tier = "pro"

[limits]
global_max = {SLOTS}
daily_token_budget = {budget}
retry_after_ms = 300
lease_ttl_ms = 5000

[[tiers]]
name = "pro"
cap = {SLOTS}
max_wait_ms = 60000
"#
    )
}

/// A peer's ordinary call: a prompt of about 400 tokens, 2,048 tokens of answer.
fn peer_body() -> String {
    let prompt = "Summarise the review below in one sentence. ".repeat(32);
    format!(
        r#"{{"model":"claude-mock-1","max_tokens":{PEER_MAX_TOKENS},"messages":[{{"role":"user","content":"{prompt}"}}]}}"#
    )
}

/// The hog's call: a tiny body asking for the longest answer.
fn hog_body() -> String {
    format!(
        r#"{{"model":"claude-mock-1","max_tokens":{HOG_MAX_TOKENS},"messages":[{{"role":"user","content":"Go on."}}]}}"#
    )
}

/// `clients` callers of `key` sending `body` back to back until `stop`; each answered call
/// is counted in `done` (a failed one fails the test).
fn callers(
    gateway: &Gateway,
    key: &'static str,
    tag: &'static str,
    body: String,
    clients: usize,
    stop: &Arc<AtomicBool>,
    done: &Arc<AtomicU64>,
) -> Vec<tokio::task::JoinHandle<()>> {
    (0..clients)
        .map(|_| {
            let (url, body) = (format!("{}/v1/messages", gateway.url()), body.clone());
            let (stop, done) = (stop.clone(), done.clone());
            tokio::spawn(async move {
                let client = client();
                while !stop.load(Ordering::SeqCst) {
                    let response = client
                        .post(&url)
                        .header("x-api-key", key)
                        .header("content-type", "application/json")
                        .header("x-mock-tag", tag)
                        .body(body.clone())
                        .send()
                        .await
                        .expect("an answer");
                    assert_eq!(response.status(), 200, "{tag}");
                    response.bytes().await.expect("the whole answer");
                    done.fetch_add(1, Ordering::SeqCst);
                }
            })
        })
        .collect()
}

/// What one phase measured.
#[derive(Debug)]
struct Phase {
    /// The peer's answered calls a second.
    peer_rate: f64,
    /// The hog's share of the slot time both used at the upstream.
    hog_share: f64,
}

/// Runs the peer's and (if `hog` is given) the hog's callers, twice `SLOTS` each (so both
/// always have calls waiting at the gateway: a tenant whose queue is empty when a slot
/// frees is not backlogged, and the other takes the slot), for `length`; then stops them
/// and waits for the upstream to be idle.
async fn phase(
    gateway: &Gateway,
    mock: &MockAnthropic,
    hog: Option<String>,
    length: Duration,
) -> Phase {
    let before = mock.busy_by_tag();
    let stop = Arc::new(AtomicBool::new(false));
    let (peer_done, hog_done) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let clients = 2 * SLOTS as usize;
    let mut tasks = callers(
        gateway,
        PEER_KEY,
        "peer",
        peer_body(),
        clients,
        &stop,
        &peer_done,
    );
    if let Some(body) = hog {
        tasks.extend(callers(
            gateway, HOG_KEY, "hog", body, clients, &stop, &hog_done,
        ));
    }
    let started = Instant::now();
    tokio::time::sleep(length).await;
    // The slot time used inside the phase (calls still in flight counted to now): what
    // the callers left waiting get after it is not part of it.
    let after = mock.busy_by_tag();
    let peer_calls = peer_done.load(Ordering::SeqCst);
    let elapsed = started.elapsed();
    stop.store(true, Ordering::SeqCst);
    for task in tasks {
        tokio::time::timeout(Duration::from_secs(60), task)
            .await
            .expect("every caller ends within a minute")
            .expect("no caller failed");
    }
    assert!(mock.wait_in_flight(0, Duration::from_secs(30)));
    let busy = |tag: &str| {
        let of = |m: &std::collections::BTreeMap<String, (Duration, u64)>| {
            m.get(tag).map_or(Duration::ZERO, |(d, _)| *d)
        };
        (of(&after) - of(&before)).as_secs_f64()
    };
    let (hog, peer) = (busy("hog"), busy("peer"));
    Phase {
        peer_rate: peer_calls as f64 / elapsed.as_secs_f64(),
        hog_share: hog / (hog + peer).max(f64::MIN_POSITIVE),
    }
}

/// The rule: a tenant asking for long answers is charged its output tokens, so with two
/// backlogged tenants of one tier it holds about half the tier's slot time (at most 60%),
/// not nearly all of it; and the peer's calls a second stay at least 75% of what they are
/// when the hog sends ordinary calls instead (the peer's fair share is the same half then).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_asking_for_long_answers_gets_its_tiers_share_of_slot_time() {
    let _turn = crate::support::file_turn(module_path!());
    let _serial = SERIAL.lock().await;
    let mock = MockAnthropic::start();
    mock.set_output_pace(PACE);
    let gateway = Gateway::start(&mock.url(), &keys(BUDGET), None);
    let length = Duration::from_secs(5);

    let alone = phase(&gateway, &mock, None, length).await;
    let ordinary = phase(&gateway, &mock, Some(peer_body()), length).await;
    let hogged = phase(&gateway, &mock, Some(hog_body()), length).await;
    eprintln!(
        "peer alone: {:.1} calls/s; beside an ordinary peer: {:.1} calls/s (other's slot time \
         {:.1}%); beside the hog: {:.1} calls/s, hog's slot time {:.1}%",
        alone.peer_rate,
        ordinary.peer_rate,
        ordinary.hog_share * 100.0,
        hogged.peer_rate,
        hogged.hog_share * 100.0,
    );
    assert!(
        hogged.hog_share <= 0.60,
        "the hog held {:.1}% of the slot time",
        hogged.hog_share * 100.0
    );
    assert!(
        hogged.peer_rate >= 0.75 * ordinary.peer_rate,
        "the peer fell from {:.1} to {:.1} calls/s",
        ordinary.peer_rate,
        hogged.peer_rate
    );
}

/// Whether the gateway's log says `tenant` was demoted.
fn demoted(gateway: &Gateway, tenant: &str) -> bool {
    gateway
        .log_text()
        .lines()
        .any(|line| line.contains("tenant demoted to batch") && line.contains(tenant))
}

/// The rule: with `budget_counts = "weighted"` the daily budget counts what a call costs,
/// output included: with a budget of 1,500,000 (demoted past 1.5 times it), a dozen calls
/// asking for 64,000 output tokens (320,000 each at weight 5) demote the hog, while 150
/// ordinary calls of the peer (about 10,700 each) do not demote it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_daily_budget_demotes_the_hog_not_the_ordinary_tenant() {
    let _turn = crate::support::file_turn(module_path!());
    let _serial = SERIAL.lock().await;
    let mock = MockAnthropic::start();
    mock.set_output_pace(PACE);
    let keys = keys(1_500_000).replace("[limits]", "[limits]\nbudget_counts = \"weighted\"");
    let gateway = Gateway::start(&mock.url(), &keys, None);
    let send = |key: &'static str, body: String| {
        let url = format!("{}/v1/messages", gateway.url());
        async move {
            let response = client()
                .post(url)
                .header("x-api-key", key)
                .header("content-type", "application/json")
                .body(body)
                .send()
                .await
                .expect("an answer");
            assert_eq!(response.status(), 200);
            response.bytes().await.expect("the whole answer");
        }
    };
    for _ in 0..150 / 6 {
        futures_util::future::join_all((0..6).map(|_| send(PEER_KEY, peer_body()))).await;
    }
    for _ in 0..2 {
        futures_util::future::join_all((0..6).map(|_| send(HOG_KEY, hog_body()))).await;
    }
    // The demotion is logged when the call that finds the tenant over its budget is
    // classified: before the calls above were answered.
    let hog = demoted(&gateway, "team-hog");
    let peer = demoted(&gateway, "team-peer");
    eprintln!("after 150 ordinary calls and 12 long ones: hog demoted {hog}, peer demoted {peer}");
    assert!(hog, "the hog was not demoted");
    assert!(!peer, "the ordinary tenant was demoted");
}

/// The rule: a body whose cost cannot be estimated is answered at once, as the API would
/// answer it, and takes no slot: not JSON or no `max_tokens` → `400`; a gzip body that
/// decompresses past 100 times its size (a zip bomb) → `413`; an encoding the gateway
/// cannot read → `415`. A gzip body within the bounds goes through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_whose_cost_cannot_be_read_is_refused_as_the_api_would() {
    use std::io::Write;
    let _turn = crate::support::file_turn(module_path!());
    let _serial = SERIAL.lock().await;
    let mock = MockAnthropic::start();
    let gateway = Gateway::start(&mock.url(), &keys(BUDGET), None);
    let gzip = |bytes: &[u8]| {
        let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
        encoder.write_all(bytes).unwrap();
        encoder.finish().unwrap()
    };
    let post = |body: Vec<u8>, encoding: Option<&'static str>| {
        let url = format!("{}/v1/messages", gateway.url());
        async move {
            let mut request = client()
                .post(url)
                .header("x-api-key", PEER_KEY)
                .header("content-type", "application/json");
            if let Some(encoding) = encoding {
                request = request.header("content-encoding", encoding);
            }
            let response = request.body(body).send().await.expect("an answer");
            let status = response.status().as_u16();
            (status, response.text().await.unwrap())
        }
    };
    let (status, answer) = post(b"{\"max_tokens\":".to_vec(), None).await;
    assert_eq!(status, 400, "{answer}");
    assert!(answer.contains("invalid_request_error"), "{answer}");
    let (status, answer) = post(br#"{"model":"m","messages":[]}"#.to_vec(), None).await;
    assert_eq!(status, 400, "{answer}");
    assert!(answer.contains("max_tokens"), "{answer}");
    let mut bomb = vec![b' '; 16 << 20];
    bomb.extend_from_slice(hog_body().as_bytes());
    let (status, answer) = post(gzip(&bomb), Some("gzip")).await;
    assert_eq!(status, 413, "{answer}");
    assert!(answer.contains("decompresses to more than"), "{answer}");
    let (status, _) = post(peer_body().into_bytes(), Some("br")).await;
    assert_eq!(status, 415);
    assert_eq!(mock.calls(), 0, "none of them went upstream");
    let (status, answer) = post(gzip(peer_body().as_bytes()), Some("gzip")).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(mock.calls(), 1);
}
