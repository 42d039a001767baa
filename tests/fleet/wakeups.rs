//! One wake-up per freed slot (issue 13), counted at Redis: `N` store handles (workers) on
//! one throwaway redis-server, each with the whole recommended stack (`FairgateLayer`),
//! 680 callers in all on 30 slots, so nearly every call waits for a slot. `redis-cli
//! MONITOR` sees every script call; they are told apart by the scripts' SHA-1.
//!
//! Before, every release woke the head waiter of each tier in every worker and all but one
//! failed: 3.5 `EVALSHA` per request at 4 workers, growing with the fleet. Now a release
//! wakes one queued worker, which sends one acquire: about one acquire and one release per
//! request, at 4 workers as at 16.
//!
//! Real time (Redis is real), about two seconds a run.

use std::collections::HashMap;
use std::fs::File;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::support::RedisServer;
use fairgate::{FairgateLayer, Job, Origin, SlotPolicy, Store};
use tower::{Layer, ServiceExt, service_fn};

const GLOBAL_CAP: u32 = 30;
const TIER_CAPS: [(&str, u32); 4] = [("premium", 12), ("pro", 10), ("free", 8), ("guest", 4)];
const CALLERS: usize = 680;
const CALLS_EACH: usize = 4;
const CALL: Duration = Duration::from_millis(20);

fn policy() -> SlotPolicy {
    let mut builder = SlotPolicy::builder().global_max(GLOBAL_CAP);
    for (tier, cap) in TIER_CAPS {
        builder = builder.tier(tier, cap, Duration::from_secs(120));
    }
    builder.build().expect("a valid policy")
}

/// Every `MONITOR` line of one server, in a file, until dropped.
pub(crate) struct Monitor {
    child: Child,
    path: PathBuf,
}

impl Monitor {
    pub(crate) fn start(server: &RedisServer) -> Monitor {
        let path = std::env::temp_dir().join(format!(
            "fairgate-monitor-{}-{}.log",
            std::process::id(),
            server.port()
        ));
        let child = Command::new("redis-cli")
            .args(["-p", &server.port().to_string(), "monitor"])
            .stdout(Stdio::from(File::create(&path).expect("a monitor log")))
            .stderr(Stdio::null())
            .spawn()
            .expect("run redis-cli monitor");
        let monitor = Monitor { child, path };
        monitor.wait_for("OK");
        monitor
    }

    fn text(&self) -> String {
        std::fs::read_to_string(&self.path).unwrap_or_default()
    }

    fn wait_for(&self, needle: &str) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !self.text().contains(needle) {
            assert!(Instant::now() < deadline, "monitor never showed {needle:?}");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Every line up to a marker sent now, so nothing still in flight is missed.
    pub(crate) fn lines(&self, server: &RedisServer) -> Vec<String> {
        server.command("ECHO fairgate-wakeups-end");
        self.wait_for("fairgate-wakeups-end");
        self.text().lines().map(str::to_owned).collect()
    }
}

impl Drop for Monitor {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.path);
    }
}

/// What the upstream stand-in saw, across all workers.
#[derive(Default)]
struct Seen {
    now: HashMap<String, u32>,
    max: HashMap<String, u32>,
    done: usize,
}

impl Seen {
    fn enter(&mut self, tier: &str) {
        for key in ["", tier] {
            let now = self.now.entry(key.to_owned()).or_default();
            *now += 1;
            let now = *now;
            let max = self.max.entry(key.to_owned()).or_default();
            *max = (*max).max(now);
        }
    }

    fn leave(&mut self, tier: &str) {
        for key in ["", tier] {
            *self.now.get_mut(key).expect("entered") -= 1;
        }
        self.done += 1;
    }
}

/// What Redis served while the middle half of the requests completed (steady state: every
/// worker has callers waiting; the ramp-up and the drain are left out).
struct Run {
    requests: usize,
    slot_scripts: usize,
    all_scripts: usize,
}

/// Waits (real time) until `n` calls have completed; returns how many have.
async fn completed(seen: &Mutex<Seen>, n: usize) -> usize {
    loop {
        let done = seen.lock().unwrap().done;
        if done >= n {
            return done;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

async fn run(workers: usize) -> Run {
    let server = RedisServer::start();
    let seen = Arc::new(Mutex::new(Seen::default()));
    let mut stores = Vec::new();
    for _ in 0..workers {
        stores.push(Store::redis(&server.url()).await.expect("a store"));
    }
    let mut callers = Vec::new();
    for (w, store) in stores.iter().enumerate() {
        let upstream = {
            let seen = seen.clone();
            service_fn(move |req: http::Request<()>| {
                let seen = seen.clone();
                async move {
                    let job = req.extensions().get::<Job>().expect("a job");
                    let tier = job.tier().expect("a tier").as_str().to_owned();
                    seen.lock().unwrap().enter(&tier);
                    tokio::time::sleep(CALL).await;
                    seen.lock().unwrap().leave(&tier);
                    Ok::<_, std::convert::Infallible>(http::Response::new(String::new()))
                }
            })
        };
        let service = FairgateLayer::builder(store.clone())
            .slots(policy())
            .window(64)
            .build()
            .expect("a stack")
            .layer(upstream);
        let service = tower::util::BoxCloneService::new(service.map_response(drop));
        for c in (w..CALLERS).step_by(workers) {
            let service = service.clone();
            callers.push(tokio::spawn(async move {
                let mut ok = 0;
                for call in 0..CALLS_EACH {
                    let (tier, _) = TIER_CAPS[(c + call) % TIER_CAPS.len()];
                    let mut req = http::Request::new(());
                    req.extensions_mut().insert(
                        Job::new(format!("tenant-{}", c % 8), Origin::UserAction).with_tier(tier),
                    );
                    if service.clone().oneshot(req).await.is_ok() {
                        ok += 1;
                    }
                }
                ok
            }));
        }
    }
    let total = CALLERS * CALLS_EACH;
    let from = completed(&seen, total / 4).await;
    let monitor = Monitor::start(&server);
    let lines = {
        completed(&seen, total * 3 / 4).await;
        monitor.lines(&server)
    };
    let requests = seen.lock().unwrap().done - from;
    let mut served = 0;
    for caller in callers {
        served += caller.await.expect("a caller");
    }
    drop(stores);

    assert_eq!(served, total, "every request is served");
    let seen = seen.lock().unwrap();
    let max = seen.max[""];
    assert!(
        (GLOBAL_CAP * 3 / 4..=GLOBAL_CAP).contains(&max),
        "the global cap was held and nearly reached (contention): {max}"
    );
    for (tier, cap) in TIER_CAPS {
        assert!(
            seen.max[tier] <= cap,
            "{tier}: {} in flight",
            seen.max[tier]
        );
    }
    let (slot_scripts, all_scripts) = scripts_in(&lines);
    Run {
        requests,
        slot_scripts,
        all_scripts,
    }
}

/// The slot scripts (acquire and release) and the scripts of any kind in MONITOR `lines`.
pub(crate) fn scripts_in(lines: &[String]) -> (usize, usize) {
    let sha = |source: &str| redis::Script::new(source).get_hash().to_owned();
    // The slot scripts are sent with the fleet order's prelude.
    let acquire = sha(concat!(
        include_str!("../../src/store/scripts/slot_queue.lua"),
        include_str!("../../src/store/scripts/slot_acquire.lua")
    ));
    let release = sha(concat!(
        include_str!("../../src/store/scripts/slot_queue.lua"),
        include_str!("../../src/store/scripts/slot_release.lua")
    ));
    let scripts: Vec<&String> = lines
        .iter()
        .filter(|l| l.contains("\"EVALSHA\"") || l.contains("\"evalsha\""))
        .collect();
    let slot_scripts = scripts
        .iter()
        .filter(|l| l.contains(&acquire) || l.contains(&release))
        .count();
    (slot_scripts, scripts.len())
}

/// One run at a time: two at once on two cores would measure each other.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

async fn check(workers: usize) {
    let _serial = SERIAL.lock().await;
    let run = run(workers).await;
    let per_request = |n: usize| n as f64 / run.requests as f64;
    println!(
        "{workers} workers, {} requests in the middle half: {:.2} slot script calls per \
         request (acquire and release), {:.2} script calls of any kind",
        run.requests,
        per_request(run.slot_scripts),
        per_request(run.all_scripts)
    );
    assert!(
        per_request(run.slot_scripts) <= 2.5,
        "{workers} workers: {:.2} slot script calls per request",
        per_request(run.slot_scripts)
    );
    assert!(
        per_request(run.all_scripts) <= 2.5,
        "{workers} workers: {:.2} script calls per request",
        per_request(run.all_scripts)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_wake_up_per_freed_slot_at_four_workers() {
    let _turn = crate::support::file_turn(module_path!());
    check(4).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "long: bash scripts/test --long"]
async fn one_wake_up_per_freed_slot_at_sixteen_workers() {
    let _turn = crate::support::file_turn(module_path!());
    check(16).await;
}
