//! The slot scripts against the model of the fleet's order (`order_model.rs`): seeded random
//! arrivals, releases, departures, heartbeats and the passing of time run through the real
//! acquire, release and heartbeat scripts on a throwaway `redis-server` and through the
//! model; both must give every acquire, release and heartbeat the same answer (above all,
//! wake the same flow for each freed slot) and keep the same calls waiting.
//!
//! The scripts read their clock once (`TIME`). The test replaces that read by a hash it sets
//! before each call, as `pacing_differential.rs` does with a key, rather than giving the
//! scripts a clock argument: the scripts run as shipped but for that line, and time moves
//! by any amount with no sleep.

use std::collections::{BTreeMap, HashMap};

use proptest::prelude::*;
use proptest::test_runner::{Config, RngSeed, TestRunner};
use redis::{Connection, Script};

use super::order_model::{Acquired, Ask, Caps, Flow, LEASE_TTL, LIVE_FOR, Model, WORKER_TTL};
use super::pacing_differential::{redis_server, with_clock};

const CLOCK: &str = "local t = redis.call('TIME')\n";
/// The test's clock: `s` and `us` of the hash next to the global lease set (`KEYS[1]` of
/// the three scripts), as `TIME` answers.
const TEST_CLOCK: &str = "local t = redis.call('HMGET', KEYS[1] .. ':clock', 's', 'us')\n";
/// The clock's 0, ms: near where Redis's `TIME` is, so the scores carry today's magnitudes.
const EPOCH_MS: u64 = 1_764_547_200_000;

fn on_test_clock(source: &str) -> Script {
    with_clock(source, CLOCK, TEST_CLOCK)
}

/// Tenants and their groups: three of one service, two of another, two of their own.
const TENANTS: [(&str, &str); 7] = [
    ("svc-a/u1", "svc-a"),
    ("svc-a/u2", "svc-a"),
    ("svc-a/u3", "svc-a"),
    ("svc-b/u1", "svc-b"),
    ("svc-b/u2", "svc-b"),
    ("team-c", ""),
    ("team-d", ""),
];

/// One step of a case.
#[derive(Clone, Debug)]
enum Step {
    /// `calls` more calls of `tenant` (of `TENANTS`) in a tier and class, its worker naming
    /// the caps and weights of `policy` (one of two per tier and class).
    Arrive {
        tier: usize,
        class: usize,
        tenant: usize,
        calls: u32,
        cost: u64,
        policy: usize,
    },
    /// One of the leases held (by its index, modulo) is given back.
    Release(usize),
    /// One waiting flow (by its index, modulo) has no calls any more.
    GiveUp(usize),
    /// The worker of a tenant (by its index) beats.
    Heartbeat(usize),
    /// Time passes, ms.
    Wait(u64),
}

/// What a woken worker does: takes its slot, passes it on (its calls went), or never comes
/// (its promise lapses).
#[derive(Clone, Copy, Debug)]
enum Answer {
    Take,
    PassOn,
    Ignore,
}

#[derive(Clone, Debug)]
struct Case {
    global_cap: u32,
    /// Per tier, two (cap, weight) its workers may name; no two tiers share a weight.
    tiers: [[(u32, u32); 2]; 3],
    /// Per class, two weights its workers may name.
    class_weights: [[u32; 2]; 3],
    steps: Vec<Step>,
    /// What the woken workers do, in turn (cycled).
    answers: Vec<Answer>,
}

fn step() -> impl Strategy<Value = Step> {
    let arrive = (
        0usize..3,
        0usize..3,
        0..TENANTS.len(),
        1u32..4,
        1u64..60,
        0usize..2,
    );
    prop_oneof![
        8 => arrive.prop_map(|(tier, class, tenant, calls, cost, policy)| Step::Arrive {
            tier,
            class,
            tenant,
            calls,
            cost,
            policy
        }),
        8 => any::<usize>().prop_map(Step::Release),
        2 => any::<usize>().prop_map(Step::GiveUp),
        2 => (0..TENANTS.len()).prop_map(Step::Heartbeat),
        3 => prop_oneof![0u64..20, 0u64..1_500, 0u64..8_000].prop_map(Step::Wait),
    ]
}

fn case() -> impl Strategy<Value = Case> {
    let tier = |i: u32| {
        [(1u32..4, 0u32..2), (1u32..4, 0u32..2)]
            .prop_map(move |p| p.map(|(cap, w)| (cap, i + 1 + 3 * w)))
    };
    let answer = prop_oneof![
        6 => Just(Answer::Take),
        1 => Just(Answer::PassOn),
        1 => Just(Answer::Ignore)
    ];
    (
        1u32..6,
        [tier(0), tier(1), tier(2)],
        [[1u32..6, 1u32..6], [1u32..6, 1u32..6], [1u32..6, 1u32..6]],
        prop::collection::vec(step(), 1..100),
        prop::collection::vec(answer, 1..20),
    )
        .prop_map(|(global_cap, tiers, class_weights, steps, answers)| Case {
            global_cap,
            tiers,
            class_weights,
            steps,
            answers,
        })
}

/// The scripts on the test clock.
struct Scripts {
    acquire: Script,
    release: Script,
    heartbeat: Script,
}

/// The scripts of one case, its keys under `prefix`.
struct Fleet<'a> {
    conn: &'a mut Connection,
    scripts: &'a Scripts,
    prefix: String,
}

impl Fleet<'_> {
    fn key(&self, name: &str) -> String {
        format!("{}:{name}", self.prefix)
    }

    fn tier_key(&self, tier: usize) -> String {
        self.key(&format!("tier:{tier}"))
    }

    fn worker(tenant: &str) -> String {
        format!("w-{tenant}")
    }

    /// Sets the scripts' clock to `now` (ms after `EPOCH_MS`).
    fn at(&mut self, now: u64) {
        let ms = EPOCH_MS + now;
        redis::cmd("HSET")
            .arg(self.key("global:clock"))
            .arg("s")
            .arg(ms / 1000)
            .arg("us")
            .arg(ms % 1000 * 1000)
            .exec(self.conn)
            .expect("set the clock");
    }

    /// One epoch, and every tenant's worker alive for a worker TTL.
    fn start(&mut self) {
        let mut pipe = redis::pipe();
        pipe.cmd("SET").arg(self.key("epoch")).arg("e1");
        for (tenant, _) in TENANTS {
            pipe.cmd("ZADD")
                .arg(self.key("workers"))
                .arg(EPOCH_MS + WORKER_TTL)
                .arg(Fleet::worker(tenant));
        }
        pipe.exec(self.conn).expect("set the fleet up");
    }

    fn acquire(&mut self, now: u64, ask: &Ask, id: &str, token: Option<u64>) -> Acquired {
        self.at(now);
        let (tier, class, tenant) = &ask.flow;
        let tier = self.tier_key(*tier);
        let reply: Vec<i64> = self
            .scripts
            .acquire
            .key(self.key("global"))
            .key(&tier)
            .key(self.key("workers"))
            .key(self.key("epoch"))
            .key(self.key("waits"))
            .key(format!("{tier}:waiting"))
            .key(self.key("promised"))
            .key(format!("{tier}:promised"))
            .key(self.key("cells"))
            .arg(ask.caps.global)
            .arg(ask.caps.tier)
            .arg(LEASE_TTL)
            .arg(id)
            .arg(Fleet::worker(tenant))
            .arg("e1")
            .arg(ask.calls)
            .arg(ask.caps.weight)
            .arg(token.map_or(String::new(), |t| t.to_string()))
            .arg(class)
            .arg(ask.caps.class_weight)
            .arg(tenant)
            .arg(ask.cost)
            .arg(0)
            .arg(0)
            .arg(0)
            .arg(0)
            .arg(0)
            .arg(ask.group)
            .invoke(self.conn)
            .expect("run the acquire script");
        match reply[0] {
            1 => Acquired::Taken,
            0 => Acquired::Refused,
            _ => Acquired::Resync,
        }
    }

    /// The release script in `tier`, giving back `lease` (or only waking), `token` passed
    /// on and `entry` leaving its flow: whether the lease was there, and who was woken.
    fn release(
        &mut self,
        now: u64,
        tier: usize,
        lease: Option<&str>,
        token: Option<u64>,
        entry: Option<&Flow>,
    ) -> (bool, Vec<(Flow, u64)>) {
        self.at(now);
        let tier = self.tier_key(tier);
        let reply: Vec<i64> = self
            .scripts
            .release
            .key(self.key("global"))
            .key(&tier)
            .key(self.key("waits"))
            .key(self.key("promised"))
            .key(self.key("workers"))
            .key(self.key("cells"))
            .arg(lease.unwrap_or(""))
            .arg(self.key("wake:"))
            // A list rather than a channel: every worker is listening, and the test reads
            // what was sent.
            .arg("RPUSH")
            .arg(token.map_or(String::new(), |t| t.to_string()))
            .arg(entry.map_or(String::new(), |(_, class, tenant)| {
                format!("{}|{class}|{tenant}", Fleet::worker(tenant))
            }))
            .arg(LIVE_FOR)
            .arg("")
            .arg("")
            .arg("")
            .invoke(self.conn)
            .expect("run the release script");
        (reply[0] == 1, self.woken())
    }

    /// The heartbeat of `tenant`'s worker holding `held` (lease id, tier): the leases gone,
    /// or `None` to resync.
    fn heartbeat(
        &mut self,
        now: u64,
        tenant: &str,
        held: &[(String, usize)],
    ) -> Option<Vec<String>> {
        self.at(now);
        let mut script = self.scripts.heartbeat.key(self.key("global"));
        script
            .key(self.key("workers"))
            .key(self.key("epoch"))
            .key(self.key("waits"))
            .arg(Fleet::worker(tenant))
            .arg(WORKER_TTL)
            .arg("e1");
        for (id, tier) in held {
            script.key(self.tier_key(*tier)).arg(id).arg(LEASE_TTL);
        }
        let reply: Vec<String> = script.invoke(self.conn).expect("run the heartbeat script");
        (reply[0] != "-1").then(|| reply[2..].to_vec())
    }

    /// The calls waiting per flow (each tier's `wants`).
    fn waiting(&mut self) -> BTreeMap<Flow, u32> {
        let mut waiting = BTreeMap::new();
        for tier in 0..3 {
            let wants: HashMap<String, u32> = redis::cmd("HGETALL")
                .arg(format!("{}:wants", self.tier_key(tier)))
                .query(self.conn)
                .expect("read the calls waiting");
            for (member, n) in wants {
                let mut parts = member.splitn(3, '|').skip(1);
                let class = parts.next().and_then(|c| c.parse().ok());
                let tenant = parts.next().unwrap_or_default().to_owned();
                waiting.insert((tier, class.expect("a class"), tenant), n);
            }
        }
        waiting
    }

    /// The wake-ups sent since the last look (each worker's list), emptied.
    fn woken(&mut self) -> Vec<(Flow, u64)> {
        // The workers are known: their lists are read and emptied in one round trip (no
        // KEYS, which slows with every case's keys).
        let mut pipe = redis::pipe();
        for (tenant, _) in TENANTS {
            let list = format!("{}{}", self.key("wake:"), Fleet::worker(tenant));
            pipe.cmd("LRANGE").arg(&list).arg(0).arg(-1);
            pipe.cmd("DEL").arg(&list).ignore();
        }
        let lists: Vec<Vec<String>> = pipe.query(self.conn).expect("read the wake-ups");
        let mut woken = Vec::new();
        for message in lists.into_iter().flatten() {
            let parts: Vec<&str> = message.split('\n').collect();
            let tier = parts[0].rsplit(':').next().and_then(|t| t.parse().ok());
            let flow = (
                tier.expect("a tier key"),
                parts[2].parse().expect("a class"),
                parts[3].to_owned(),
            );
            woken.push((flow, parts[1].parse().expect("a token")));
        }
        woken
    }
}

/// One case running: the scripts and the model side by side.
struct Run<'a> {
    fleet: Fleet<'a>,
    model: Model,
    case: &'a Case,
    /// The leases held: id, tier, tenant.
    leases: Vec<(String, usize, String)>,
    /// Each flow's last acquire, which its worker repeats when woken.
    asks: HashMap<Flow, Ask>,
    ids: u64,
    answers: usize,
}

impl Run<'_> {
    fn new_id(&mut self) -> String {
        self.ids += 1;
        format!("lease{}", self.ids)
    }

    /// The same acquire on both sides; a lease taken is held.
    fn acquire(&mut self, ask: &Ask, token: Option<u64>) -> Result<(), TestCaseError> {
        let id = self.new_id();
        let got = self.fleet.acquire(self.model.now, ask, &id, token);
        let expected = self.model.acquire(ask, &id, token);
        prop_assert_eq!(
            got,
            expected,
            "an acquire of {:?} at {}",
            ask,
            self.model.now
        );
        if got == Acquired::Taken {
            self.leases.push((id, ask.flow.0, ask.flow.2.clone()));
        }
        Ok(())
    }

    /// The same release on both sides, and the woken worker's answer.
    fn release(
        &mut self,
        tier: usize,
        lease: Option<&str>,
        token: Option<u64>,
        entry: Option<&Flow>,
    ) -> Result<(), TestCaseError> {
        let (removed, woken) = self
            .fleet
            .release(self.model.now, tier, lease, token, entry);
        prop_assert!(woken.len() <= 1, "one wake-up per freed slot: {:?}", woken);
        let got = (removed, woken.into_iter().next());
        let expected = self.model.release(lease, token, entry);
        prop_assert_eq!(
            &got,
            &expected,
            "a release of {:?} (token {:?}, entry {:?}) at {}",
            lease,
            token,
            entry,
            self.model.now
        );
        let Some((flow, token)) = got.1 else {
            return Ok(());
        };
        let answer = self.case.answers[self.answers % self.case.answers.len()];
        self.answers += 1;
        match answer {
            Answer::Take => {
                // It takes its slot with the calls it had, the woken one included.
                let left = self.model.wants.get(&flow).map_or(0, |w| w.0);
                let mut ask = self.asks[&flow].clone();
                ask.calls = left + 1;
                self.acquire(&ask, Some(token))
            }
            Answer::PassOn => self.release(flow.0, None, Some(token), Some(&flow)),
            Answer::Ignore => Ok(()),
        }
    }

    fn step(&mut self, step: &Step) -> Result<(), TestCaseError> {
        match *step {
            Step::Arrive {
                tier,
                class,
                tenant,
                calls,
                cost,
                policy,
            } => {
                let (name, group) = TENANTS[tenant];
                let flow = (tier, class, name.to_owned());
                let (cap, weight) = self.case.tiers[tier][policy];
                let ask = Ask {
                    calls: self.model.wants.get(&flow).map_or(0, |w| w.0) + calls,
                    flow: flow.clone(),
                    group,
                    cost,
                    caps: Caps {
                        global: self.case.global_cap,
                        tier: cap,
                        weight,
                        class_weight: self.case.class_weights[class][policy],
                    },
                };
                self.asks.insert(flow, ask.clone());
                self.acquire(&ask, None)
            }
            Step::Release(i) if !self.leases.is_empty() => {
                let (id, tier, _) = self.leases.remove(i % self.leases.len());
                self.release(tier, Some(&id), None, None)
            }
            Step::GiveUp(i) if !self.model.wants.is_empty() => {
                let mut flows: Vec<&Flow> = self.model.wants.keys().collect();
                flows.sort();
                let flow = flows[i % flows.len()].clone();
                self.release(flow.0, None, None, Some(&flow))
            }
            Step::Heartbeat(i) => {
                let tenant = TENANTS[i].0;
                let held: Vec<(String, usize)> = (self.leases.iter())
                    .filter(|l| l.2 == tenant)
                    .map(|l| (l.0.clone(), l.1))
                    .collect();
                let ids: Vec<String> = held.iter().map(|l| l.0.clone()).collect();
                let got = self.fleet.heartbeat(self.model.now, tenant, &held);
                let expected = self.model.heartbeat(tenant, &ids);
                prop_assert_eq!(
                    &got,
                    &expected,
                    "a heartbeat of {} at {}",
                    tenant,
                    self.model.now
                );
                // The leases gone are no more held (a worker puts its own back: not here).
                let gone = got.unwrap_or_default();
                self.leases.retain(|l| !gone.contains(&l.0));
                Ok(())
            }
            Step::Wait(ms) => {
                self.model.now += ms;
                Ok(())
            }
            _ => Ok(()),
        }
    }
}

fn run_case(
    conn: &mut Connection,
    scripts: &Scripts,
    n: u64,
    case: &Case,
) -> Result<(), TestCaseError> {
    let mut run = Run {
        fleet: Fleet {
            conn,
            scripts,
            prefix: format!("order{n}"),
        },
        model: Model::new(3, TENANTS.iter().map(|t| t.0)),
        case,
        leases: Vec::new(),
        asks: HashMap::new(),
        ids: 0,
        answers: 0,
    };
    run.fleet.start();
    for (i, step) in case.steps.iter().enumerate() {
        run.step(step)
            .map_err(|e| TestCaseError::fail(format!("step {i} ({step:?}): {e}")))?;
        // The same calls wait: where a bookkeeping rule differs, the first step it shows.
        let expected: BTreeMap<Flow, u32> = (run.model.wants.iter())
            .map(|(f, w)| (f.clone(), w.0))
            .collect();
        prop_assert_eq!(
            run.fleet.waiting(),
            expected,
            "waiting after step {} ({:?})",
            i,
            step
        );
    }
    Ok(())
}

#[test]
fn the_slot_scripts_wake_whom_the_model_of_the_fleets_order_names() {
    let server = redis_server::RedisServer::start();
    let client = redis::Client::open(server.url()).expect("client");
    let mut conn = client
        .get_connection()
        .expect("connect to the throwaway redis");
    let scripts = Scripts {
        acquire: on_test_clock(super::slots::ACQUIRE_SOURCE),
        release: on_test_clock(super::slots::RELEASE_SOURCE),
        heartbeat: on_test_clock(super::slots::HEARTBEAT_SOURCE),
    };
    let conn = std::cell::RefCell::new(&mut conn);
    let cases = std::cell::Cell::new(0u64);
    let mut runner = TestRunner::new(Config {
        cases: 200,
        rng_seed: RngSeed::Fixed(0x6f72_6465),
        failure_persistence: None,
        ..Config::default()
    });
    let result = runner.run(&case(), |case| {
        cases.set(cases.get() + 1);
        run_case(&mut conn.borrow_mut(), &scripts, cases.get(), &case)
    });
    if let Err(failure) = result {
        panic!("{failure}");
    }
}
