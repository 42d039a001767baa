//! The fleet's one fair order (`tests/fleet/order.rs` proves it with several stores in one
//! process) proved with real worker processes: `slot_worker fleet` processes, each with its
//! own store, worker id, connections and callers, share a global cap of 8 on a redis-server
//! this test starts (or on the test's own Redis Cluster), calls of 30-50 ms. Every count is
//! taken from outside the library, on a second redis-server, the observer: each call appends
//! its start (the observer's clock, and its tenant) to `obs:starts` and counts itself in
//! flight (`obs:now`, the maximum `obs:max`).
//!
//! Cases: a tenant on one of four processes against one on all four (its fair half, on one
//! node and on a cluster); user actions on one process before batch calls on three others;
//! a process SIGKILLed while it holds queued calls (the others keep being served, its
//! queue entries are swept, its slots come back); and, where a shared rate binds instead of
//! the slots, the fair half and the process that hands out the freed cells SIGKILLed. Each asserts the cap at the observer. One
//! case at a time; every process is stopped by its pid, also when a case panics.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use crate::support::{RedisCluster, RedisServer, SlotWorker};

const GLOBAL_CAP: i64 = 8;
/// Skipped before a measure: the processes connect, queue, and the order settles.
const WARM_UP: Duration = Duration::from_millis(1_000);
const MEASURE: Duration = Duration::from_millis(3_000);
/// How long a worker's callers run (from its `READY`): the warm-up, the measure, and room
/// for the processes started after it.
const RUN: Duration = Duration::from_millis(5_500);

/// One case at a time: two cores, and each case measures the others' absence.
static SERIAL: Mutex<()> = Mutex::new(());

/// What the workers share their slots through.
enum Rig<'a> {
    Node(&'a RedisServer),
    Cluster(&'a RedisCluster),
}

impl Rig<'_> {
    /// The URL (a cluster: its nodes' URLs, comma-separated) and the worker's flags.
    fn worker_args(&self) -> (String, &'static [&'static str]) {
        match self {
            Rig::Node(server) => (server.url(), &[]),
            Rig::Cluster(cluster) => (cluster.urls().join(","), &["--cluster"]),
        }
    }
}

/// A `slot_worker fleet` process, SIGKILLed by its pid when dropped.
struct Worker(SlotWorker);

impl Worker {
    /// Starts a worker running `specs` (`CALLERS:TENANT:TIER:ORIGIN`) for `run`, and waits
    /// for its `READY`.
    fn start(
        rig: &Rig,
        observer: &Observer,
        run: Duration,
        specs: &[&str],
        flags: &[&str],
    ) -> Worker {
        let (url, rig_flags) = rig.worker_args();
        let worker = Worker(SlotWorker::spawn(
            SlotWorker::command()
                .args(["fleet", &url, &observer.server.url()])
                .arg(run.as_millis().to_string())
                .args(specs)
                .args(rig_flags)
                .args(flags),
        ));
        let ready = worker.line(Duration::from_secs(10));
        assert_eq!(ready, "READY", "worker {} started", worker.pid());
        worker
    }

    fn pid(&self) -> u32 {
        self.0.pid()
    }

    fn line(&self, within: Duration) -> String {
        self.0.line(within)
    }

    /// Waits for the summary line and the exit; checks every call was served (none
    /// `Busy`, none failed) and returns how many were.
    fn finish(mut self) -> u64 {
        let line = self.line(Duration::from_secs(15));
        let status = self.0.wait();
        assert!(status.success(), "worker failed: {status}");
        assert!(line.ends_with("busy=0 failed=0"), "a call failed: {line}");
        line.strip_prefix("ok=")
            .and_then(|l| l.split(' ').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("a summary: {line}"))
    }

    /// SIGKILLs the worker by its pid and waits until it is gone.
    fn kill(&mut self) {
        self.0.kill();
    }
}

/// The observer: a redis-server of its own every worker counts its calls on.
struct Observer {
    server: RedisServer,
    conn: redis::Connection,
}

impl Observer {
    fn start() -> Observer {
        let server = RedisServer::start();
        let conn = redis::Client::open(server.url())
            .and_then(|c| c.get_connection())
            .expect("connect to the observer");
        Observer { server, conn }
    }

    /// The observer's clock, in ms (the one the starts are stamped with).
    fn now_ms(&mut self) -> u64 {
        let [secs, micros]: [u64; 2] = redis::cmd("TIME").query(&mut self.conn).unwrap();
        secs * 1_000 + micros / 1_000
    }

    fn get(&mut self, key: &str) -> Option<i64> {
        redis::cmd("GET").arg(key).query(&mut self.conn).unwrap()
    }

    /// Every call started so far, in the order they started: when, and whose.
    fn starts(&mut self) -> Vec<(u64, String)> {
        let raw: Vec<String> = redis::cmd("LRANGE")
            .arg("obs:starts")
            .arg(0)
            .arg(-1)
            .query(&mut self.conn)
            .unwrap();
        raw.iter()
            .map(|s| {
                let (ms, tenant) = s.split_once(':').expect("ms:tenant");
                (ms.parse().expect("ms"), tenant.to_owned())
            })
            .collect()
    }

    /// The most calls ever in flight at once, checked against the cap.
    fn check_cap(&mut self) -> i64 {
        let max = self.get("obs:max").unwrap_or(0);
        assert!(
            max <= GLOBAL_CAP,
            "{max} calls in flight at once, over the global cap of {GLOBAL_CAP}"
        );
        max
    }

    /// Takes the calls a killed worker had in flight out of the count (they died with it;
    /// their leases stay held until they expire), and returns how many.
    fn forget(&mut self, pid: u32) -> i64 {
        redis::Script::new(
            "local k = tonumber(redis.call('GET', KEYS[2]) or '0')
             redis.call('DECRBY', KEYS[1], k)
             redis.call('DEL', KEYS[2])
             return k",
        )
        .key("obs:now")
        .key(format!("obs:now:{pid}"))
        .invoke(&mut self.conn)
        .unwrap()
    }
}

/// The calls started in `[from, to)` (observer ms), by tenant.
fn served(starts: &[(u64, String)], from: u64, to: u64) -> HashMap<String, usize> {
    let mut served = HashMap::new();
    for (at, tenant) in starts {
        if (from..to).contains(at) {
            *served.entry(tenant.clone()).or_default() += 1;
        }
    }
    served
}

/// Jain's fairness index of what each tenant got, each divided by its fair weight.
fn jain(shares: &[f64]) -> f64 {
    let sum: f64 = shares.iter().sum();
    let squares: f64 = shares.iter().map(|x| x * x).sum();
    sum * sum / (shares.len() as f64 * squares)
}

/// The specs of light against hog: hog's 12 callers on each of four processes, light's 12
/// on process 0 only.
fn light_and_hog(w: usize) -> &'static [&'static str] {
    if w == 0 {
        &["12:light:pro:user", "12:hog:pro:user"]
    } else {
        &["12:hog:pro:user"]
    }
}

/// Tenant "hog" has 12 callers in each of four processes, tenant "light" (same tier, same
/// weight) 12 in process 0 only; both always have calls waiting. Fair is half each; without
/// the fleet's order light gets about its share of the process it reaches (an eighth).
fn light_against_hog(rig: Rig) {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut observer = Observer::start();
    let workers: Vec<Worker> = (0..4)
        .map(|w| Worker::start(&rig, &observer, RUN, light_and_hog(w), &[]))
        .collect();
    std::thread::sleep(WARM_UP);
    let from = observer.now_ms();
    std::thread::sleep(MEASURE);
    let to = observer.now_ms();
    let ok: u64 = workers.into_iter().map(Worker::finish).sum();
    let served = served(&observer.starts(), from, to);
    let max = observer.check_cap();
    let light = served.get("light").copied().unwrap_or(0) as f64;
    let hog = served.get("hog").copied().unwrap_or(0) as f64;
    let share = light / (light + hog);
    let index = jain(&[light, hog]);
    println!(
        "4 processes: light {light}, hog {hog} calls started in {} ms: light's share {:.1}%, \
         Jain's index {index:.3}; max in flight {max}; {ok} calls in all",
        to - from,
        share * 100.0
    );
    assert!(light + hog > 0.0, "nothing was served");
    assert!(
        share >= 0.45,
        "light got {:.1}% of the calls",
        share * 100.0
    );
    assert!(index >= 0.99, "Jain's index {index:.3}");
}

#[test]
fn a_tenant_on_one_of_four_processes_gets_its_fair_half() {
    let _turn = crate::support::file_turn(module_path!());
    let server = RedisServer::start();
    light_against_hog(Rig::Node(&server));
}

#[test]
#[ignore = "long: bash scripts/test --long"]
fn a_tenant_on_one_of_four_processes_gets_its_fair_half_on_a_cluster() {
    let _turn = crate::support::file_turn(module_path!());
    light_against_hog(Rig::Cluster(RedisCluster::shared()));
}

/// Batch calls backlogged in processes 0-2, then a process 3 starts with user actions: its
/// first goes at once, and while they wait they get the critical class's share.
#[test]
#[ignore = "long: bash scripts/test --long"]
fn user_actions_in_one_process_go_before_batch_in_the_others() {
    let _turn = crate::support::file_turn(module_path!());
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let server = RedisServer::start();
    let rig = Rig::Node(&server);
    let mut observer = Observer::start();
    let batch: Vec<Worker> = (0..3)
        .map(|w| {
            let spec = format!("12:batch-{w}:pro:batch");
            Worker::start(&rig, &observer, RUN + WARM_UP, &[&spec], &[])
        })
        .collect();
    std::thread::sleep(WARM_UP);
    let chat = Worker::start(
        &rig,
        &observer,
        MEASURE + WARM_UP / 2,
        &["12:chat:pro:user"],
        &[],
    );
    // The user actions arrive when the fleet's order holds them (their flow queued in
    // Redis), not when the process starts its callers: on a loaded machine classifying and
    // queueing them takes a few freed slots (CI saw 5 batch calls first from `began`).
    let mut fleet_redis = redis::Client::open(server.url())
        .expect("a client")
        .get_connection()
        .expect("a connection to the fleet's Redis");
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let arrived = loop {
        assert!(
            std::time::Instant::now() < deadline,
            "the user actions never queued"
        );
        let queued: Vec<String> = redis::cmd("KEYS")
            .arg("*:fw:0|chat")
            .query(&mut fleet_redis)
            .expect("KEYS");
        if !queued.is_empty() {
            break observer.now_ms();
        }
        std::thread::sleep(Duration::from_millis(1));
    };
    std::thread::sleep(MEASURE);
    let ok = chat.finish() + batch.into_iter().map(Worker::finish).sum::<u64>();
    let starts = observer.starts();
    let max = observer.check_cap();
    let after: Vec<&(u64, String)> = starts
        .iter()
        .filter(|(at, _)| (arrived..arrived + MEASURE.as_millis() as u64).contains(at))
        .collect();
    let before_first = after.iter().take_while(|(_, t)| t != "chat").count();
    let chat = after.iter().filter(|(_, t)| t == "chat").count();
    let share = chat as f64 / after.len() as f64;
    println!(
        "{before_first} batch calls started before the first user action; user actions \
         {chat} of {} dispatches ({:.1}%); max in flight {max}; {ok} calls in all",
        after.len(),
        share * 100.0
    );
    // Calls whose wake-up was on its way (or whose slot was being taken) when the first
    // user action queued may go first (the observer's ms is coarse too).
    assert!(before_first <= 3, "{before_first} batch calls went first");
    assert!(share >= 0.9, "user actions got {:.1}%", share * 100.0);
}

/// What a case with a killed process saw.
struct AfterKill {
    /// Calls per second started before the kill, while the dead worker's leases last, and
    /// once they have run out.
    before: f64,
    during: f64,
    back: f64,
    /// The longest time (ms) with no call starting, from the kill on.
    stall: u64,
}

/// Light (on process 0 only) against hog (on all four) as above, with leases of 3 s; then
/// process 0 is SIGKILLed while it holds queued calls of both. Checks that the dead
/// worker's queue entries (light's flow among them) are gone within the worker TTL and a
/// heartbeat, that the others' calls were all served, and the cap at the observer.
fn kill_case() -> AfterKill {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let server = RedisServer::start();
    let rig = Rig::Node(&server);
    let mut observer = Observer::start();
    // The store's default lease TTL (30 s) would keep the dead worker's slots taken past
    // the end of the case: its leases are the one thing only their TTL frees.
    let lease = ["--lease-ttl-ms=3000"];
    let before = Duration::from_millis(2_000);
    let after = Duration::from_millis(7_000);
    let run = WARM_UP + before + after + Duration::from_millis(500);
    let mut workers: Vec<Worker> = (0..4)
        .map(|w| Worker::start(&rig, &observer, run, light_and_hog(w), &lease))
        .collect();
    std::thread::sleep(WARM_UP + before);
    let dead = workers[0].pid();
    workers[0].kill();
    let killed = observer.now_ms();
    let lost = observer.forget(dead);
    let mut conn = redis::Client::open(server.url())
        .and_then(|c| c.get_connection())
        .expect("connect to the fleet's redis");
    let mut light_gone = None;
    let swept = loop {
        let since = observer.now_ms() - killed;
        let (alive, stale) = stale_entries(&mut conn);
        if light_gone.is_none() && !stale.iter().any(|e| e.ends_with("|light")) {
            light_gone = Some(since);
        }
        if alive == 3 && stale.is_empty() {
            break since;
        }
        // The dead worker's record lasts the worker TTL (3 s) from its last heartbeat,
        // before the kill; the next heartbeat of a live worker (each says it is alive every
        // second) drops it and its entries: 4 s, and half a second for this poll.
        assert!(
            since <= 4_500,
            "{since} ms after the kill: {alive} workers alive, stale entries {stale:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let end = killed + after.as_millis() as u64 - 500;
    while observer.now_ms() < end {
        std::thread::sleep(Duration::from_millis(50));
    }
    let ok: u64 = workers.drain(1..).map(Worker::finish).sum();
    let starts = observer.starts();
    let max = observer.check_cap();
    let rate = |from: u64, to: u64| {
        let n: usize = served(&starts, from, to).values().sum();
        n as f64 * 1_000.0 / (to - from) as f64
    };
    let before_ms = before.as_millis() as u64;
    let mut last = killed;
    let mut stall = 0;
    for &(at, _) in starts.iter().filter(|(at, _)| (killed..end).contains(at)) {
        stall = stall.max(at - last);
        last = at;
    }
    let seen = AfterKill {
        before: rate(killed - before_ms, killed),
        during: rate(killed + 200, killed + 2_800),
        back: rate(killed + 4_500, end),
        stall,
    };
    println!(
        "killed with {lost} calls in flight; swept after {swept} ms (light's entries after \
         {} ms); longest stall {stall} ms; calls/s {:.0} before, {:.0} while its leases \
         last, {:.0} after; max in flight {max}; {ok} calls in all by the others",
        light_gone.unwrap_or(swept),
        seen.before,
        seen.during,
        seen.back,
    );
    seen
}

/// How many workers are recorded alive, and the queue entries (`worker|class|tenant`) of
/// a worker not among them or of tenant light (whose calls were only in the dead one).
fn stale_entries(conn: &mut redis::Connection) -> (usize, Vec<String>) {
    let alive: Vec<String> = redis::cmd("ZRANGE")
        .arg("fairgate:{slots}:workers")
        .arg(0)
        .arg(-1)
        .query(conn)
        .unwrap();
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("fairgate:{slots}:tier:*:waiting")
        .query(conn)
        .unwrap();
    let mut stale = Vec::new();
    for key in keys {
        let entries: Vec<String> = redis::cmd("ZRANGE")
            .arg(&key)
            .arg(0)
            .arg(-1)
            .query(conn)
            .unwrap();
        for entry in entries {
            let worker = entry.split('|').next().unwrap_or("");
            if !alive.iter().any(|w| w == worker) || entry.ends_with("|light") {
                stale.push(entry);
            }
        }
    }
    (alive.len(), stale)
}

/// A process SIGKILLed while it holds queued calls: the others keep being served, and it
/// keeps no place in the fleet's order (see `kill_case`).
#[test]
fn a_killed_process_neither_stalls_the_others_nor_keeps_its_place() {
    let _turn = crate::support::file_turn(module_path!());
    let seen = kill_case();
    // A release skips a worker nobody listens for any more (SIGKILL closes its connections,
    // so Redis drops its subscription at once), so every slot the live workers free goes to
    // one of them: a call starts every few ms on the slots the dead worker does not hold.
    // A wake-up lost to the dead worker would hold its slot for the promise's second, and
    // one only the sweep stopped would last the worker TTL (3 s): 300 ms is ten times the
    // shortest call and well below either.
    assert!(
        seen.stall <= 300,
        "no call started for {} ms after the kill",
        seen.stall
    );
    assert!(seen.during > 0.0, "nothing served while its leases lasted");
}

/// The dead worker's slots come back once its leases run out: they were renewed at most a
/// third of their TTL before the kill, so they are gone 3 s after it, and the fair queue's
/// safety-net poll (every 0.5-1.5 s) takes them again: from 4.5 s on, the fleet starts
/// calls as fast as before.
///
/// A worker queued in the fleet's order takes a slot when a release wakes it for one, and a
/// lease that expires wakes nobody: the fair queue's watcher polls (about every second,
/// its deadline kept across the wake-ups of a busy worker), and a slot taken with room left
/// lets the tier try again for the rest. Without either, the live workers kept only the
/// slots going round between them (94 calls/s against 188 before, no better once the
/// leases had run out).
#[test]
#[ignore = "long: bash scripts/test --long"]
fn a_killed_process_gives_its_slots_back_once_its_leases_run_out() {
    let _turn = crate::support::file_turn(module_path!());
    let seen = kill_case();
    assert!(
        seen.back >= 0.85 * seen.before,
        "{:.0} calls/s once its leases ran out, against {:.0} before",
        seen.back,
        seen.before
    );
}

/// Light against hog on four processes where a shared rate of 3,000 calls a minute (50/s,
/// `--rpm`) binds instead of the slots: the rate's cells go in the fleet's order too, so
/// light gets its fair half. Then the process that sends the ticks handing out the freed
/// cells (the wait book names it) is SIGKILLed: the next release of another process takes
/// the ticks over, so the others go on at the rate without a stall, and no second in the
/// run starts more calls than the rate allows.
#[test]
#[ignore = "long: bash scripts/test --long"]
fn where_the_rate_binds_the_fleet_keeps_its_order_and_a_killed_ticker_stalls_nobody() {
    let _turn = crate::support::file_turn(module_path!());
    rate_bound_light_against_hog(&["--rpm=3000"], (50.0, 1), true);
}

/// The same where the answers say the limit (`--learned-rpm`, 3,000 a minute): learned
/// pacing paces at 95% of it (47.5/s) in cells of 5, in the fleet's order. The ticker is
/// not killed here: a tick hands out up to five cells at once, and the slots promised to
/// the killed process just before wait out the promise (1 s), as long as the safety-net
/// poll, so a stall would not tell the takeover from the poll.
#[test]
#[ignore = "long: bash scripts/test --long"]
fn where_the_learned_rate_binds_four_processes_keep_the_fleets_order() {
    let _turn = crate::support::file_turn(module_path!());
    rate_bound_light_against_hog(&["--learned-rpm=3000"], (47.5, 5), false);
}

/// Light against hog on four processes started with `rate` (their flags), whose rate of
/// `per_second` calls in cells of `burst` binds instead of the slots; then, if
/// `kill_the_ticker`, the process sending the ticks is SIGKILLed.
fn rate_bound_light_against_hog(
    rate: &[&str],
    (per_second, burst): (f64, usize),
    kill_the_ticker: bool,
) {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let server = RedisServer::start();
    let rig = Rig::Node(&server);
    let mut observer = Observer::start();
    let mut flags = vec!["--lease-ttl-ms=3000"];
    flags.extend_from_slice(rate);
    let after = Duration::from_millis(3_000);
    let run = WARM_UP + MEASURE + after + Duration::from_millis(1_000);
    let mut workers: Vec<Worker> = (0..4)
        .map(|w| Worker::start(&rig, &observer, run, light_and_hog(w), &flags))
        .collect();
    std::thread::sleep(WARM_UP);
    let from = observer.now_ms();
    std::thread::sleep(MEASURE);
    let to = observer.now_ms();
    let mut conn = redis::Client::open(server.url())
        .and_then(|c| c.get_connection())
        .expect("connect to the fleet's redis");
    let ticker: String = redis::cmd("HGET")
        .arg("fairgate:{slots}:waits")
        .arg("cell_ticker")
        .query(&mut conn)
        .expect("a worker sends the ticks");
    // A worker id starts with its process id.
    let dead = workers
        .iter()
        .position(|w| ticker.starts_with(&format!("{}-", w.pid())))
        .unwrap_or_else(|| panic!("the ticker {ticker} is none of the workers"));
    if kill_the_ticker {
        let dead_pid = workers[dead].pid();
        workers[dead].kill();
        observer.forget(dead_pid);
        workers.remove(dead);
    }
    let killed = observer.now_ms();
    std::thread::sleep(after);
    let end = observer.now_ms();
    let ok: u64 = workers.into_iter().map(Worker::finish).sum();
    let starts = observer.starts();
    let max = observer.check_cap();
    let measured = served(&starts, from, to);
    let light = measured.get("light").copied().unwrap_or(0) as f64;
    let hog = measured.get("hog").copied().unwrap_or(0) as f64;
    let share = light / (light + hog);
    let mut stall = 0;
    let mut last = killed;
    for &(at, _) in starts.iter().filter(|(at, _)| (killed..end).contains(at)) {
        stall = stall.max(at - last);
        last = at;
    }
    let since_kill: usize = served(&starts, killed + 200, end).values().sum();
    let rate_after = since_kill as f64 * 1_000.0 / (end - killed - 200) as f64;
    let times: Vec<u64> = starts.iter().map(|(at, _)| *at).collect();
    let most = times
        .iter()
        .enumerate()
        .map(|(i, &at)| times[i..].iter().take_while(|&&t| t < at + 1_000).count())
        .max()
        .unwrap_or(0);
    let then = match kill_the_ticker {
        true => format!("killed the ticker (process {dead}); after it"),
        false => format!("the ticker (process {dead}) left running; after the measure"),
    };
    println!(
        "rate binding, 4 processes: light {light}, hog {hog} calls started in {} ms: light's \
         share {:.1}%; {then}: longest gap {stall} ms, {rate_after:.0} calls/s; the most in \
         any second {most}; max in flight {max}; {ok} calls in all by the others",
        to - from,
        share * 100.0
    );
    assert!(
        share >= 0.45,
        "light got {:.1}% of the calls",
        share * 100.0
    );
    assert!(
        jain(&[light, hog]) >= 0.99,
        "Jain's index {:.3}",
        jain(&[light, hog])
    );
    // A second sees the rate and a burst; a cell goes out up to 2 ms before it frees (its
    // tick is sent a little ahead): one call more at most.
    let allowed = per_second.ceil() as usize + burst + 1;
    assert!(
        most <= allowed,
        "{most} calls started in one second, over the rate ({per_second}/s, {burst} at once)"
    );
    if !kill_the_ticker {
        return;
    }
    // Calls end every 20 ms or so, and each release takes the ticks over if nobody sends
    // them: a stall of ten cells would mean the fleet waited for its safety-net poll.
    assert!(
        stall <= 200,
        "no call started for {stall} ms after the kill"
    );
    assert!(rate_after >= 40.0, "{rate_after:.0} calls/s after the kill");
}
