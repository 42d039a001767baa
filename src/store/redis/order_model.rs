//! The fleet's fair order, as a model to read: what the slot scripts (`slot_queue.lua`,
//! `slot_acquire.lua`, `slot_release.lua`) decide, written once more in plain Rust, and a
//! differential test that runs seeded random arrivals, releases and departures through the
//! real scripts on a throwaway `redis-server` and through the model, and asks both who is
//! woken for each freed slot.
//!
//! The order, at four levels, each start-time fair queuing (SFQ) on the cost:
//! 1. the class (critical, standard, batch) by fair queuing on the class weights, one call
//!    each: the least finish tag (`u`: start, start + 1 / weight), ties to the first class;
//! 2. the tier, among those with a call waiting in that class and room under their cap: the
//!    least start tag (`v`), ties to the heavier, then to any (the scripts list the tiers in
//!    the order of a Redis hash; the model allows each of the tied ones);
//! 3. the group (a key: a service with its end users, or a team) in that tier and class: the
//!    least start tag, ties to the smaller name (a sorted set's order);
//! 4. the flow (a tenant) in that group: the same.
//!
//! A tier (or class) that starts waiting starts at the current virtual time, a group or
//! flow at the virtual time of its level or its own last finish if later, so nothing banks
//! credit for the time it had nothing waiting. A served flow is charged its call's cost at
//! the flow and the group level, cost over the tier's weight at the tier level.
//!
//! The scripts read their clock once (`TIME`); the test replaces that read by a fixed time,
//! as `pacing_differential.rs` does, so no lease, promise or worker record expires during a
//! case: the order is what is compared here; expiries are the fleet tests' (`tests/fleet`).
//! One worker holds each flow, so the order of workers inside a flow (by when they joined)
//! plays no part.

use std::collections::HashMap;

use proptest::prelude::*;
use proptest::test_runner::{Config, RngSeed, TestRunner};
use redis::{Connection, Script};

use super::pacing_differential::redis_server;

/// One class of one tier: its waiting groups, and each group's waiting flows.
#[derive(Debug, Default)]
struct ClassQueue {
    /// Waiting groups by start tag; `gfin` keeps the last finish of those that left.
    groups: HashMap<String, f64>,
    gfin: HashMap<String, f64>,
    /// Per group: its virtual time, its waiting flows and their finish tags.
    gv: HashMap<String, f64>,
    flows: HashMap<String, HashMap<String, f64>>,
    fins: HashMap<String, HashMap<String, f64>>,
    /// The group each waiting flow joined.
    group_of: HashMap<String, String>,
}

/// A tier as the wait book knows it.
#[derive(Debug, Default)]
struct Tier {
    cap: u32,
    weight: u32,
    leases: u32,
    promised: u32,
    /// Whether the book lists the tier (`c:<tier>`): from a queued call until a release
    /// finds nobody waiting in it.
    listed: bool,
    /// Its start tag (`v`) and its groups' virtual time (`t`) per class.
    v: [Option<f64>; 3],
    t: [Option<f64>; 3],
    classes: [ClassQueue; 3],
}

/// A flow: its tier, class and tenant.
type Flow = (usize, usize, String);

/// The fleet's order as the wait book and the lease sets hold it.
#[derive(Debug, Default)]
struct Model {
    global_cap: Option<u32>,
    leases: u32,
    promised: u32,
    tiers: Vec<Tier>,
    /// Class tags (`u:<class>`, `u`) and the classes' virtual times (`v:<class>`).
    u_class: [Option<f64>; 3],
    u: Option<f64>,
    v_class: [Option<f64>; 3],
    class_weight: [Option<u32>; 3],
    /// Calls waiting per flow, and what the next one costs.
    wants: HashMap<Flow, (u32, u64)>,
}

/// Who a freed slot goes to: its class, and the tiers that were as fair (any may be
/// picked; the flow is then the head of the one picked).
#[derive(Debug)]
struct Wake {
    class: usize,
    tiers: Vec<usize>,
}

/// `name` starts waiting in `queue` at `v`, or at its finish in `fins` if later.
fn enter(queue: &mut HashMap<String, f64>, fins: &mut HashMap<String, f64>, name: &str, v: f64) {
    let last = fins.remove(name).unwrap_or(0.0);
    queue.insert(name.to_owned(), v.max(last));
}

/// `name` leaves `queue`, its start tag kept as its finish.
fn depart(queue: &mut HashMap<String, f64>, fins: &mut HashMap<String, f64>, name: &str) {
    if let Some(start) = queue.remove(name) {
        fins.insert(name.to_owned(), start);
    }
}

/// The least (tag, name) of a queue: a sorted set's first member.
fn head(queue: &HashMap<String, f64>) -> Option<(String, f64)> {
    queue
        .iter()
        .min_by(|a, b| a.1.total_cmp(b.1).then_with(|| a.0.cmp(b.0)))
        .map(|(name, tag)| (name.clone(), *tag))
}

impl Model {
    /// Tiers of (cap, weight). The global cap and the class weights are learnt from the
    /// calls that queue, as the wait book learns them.
    fn new(tiers: &[(u32, u32)]) -> Model {
        Model {
            tiers: tiers
                .iter()
                .map(|&(cap, weight)| Tier {
                    cap,
                    weight,
                    ..Tier::default()
                })
                .collect(),
            ..Model::default()
        }
    }

    fn waiting(&self, tier: usize) -> bool {
        self.wants.keys().any(|(t, _, _)| *t == tier)
    }

    /// A tier (and maybe its class) starts waiting in `class`: at the virtual times.
    fn backlogged(&mut self, tier: usize, class: usize) {
        if !self.tiers[tier].classes[class].groups.is_empty() {
            return;
        }
        let v_class = self.v_class[class].unwrap_or(0.0);
        let t = &mut self.tiers[tier];
        t.v[class] = Some(t.v[class].unwrap_or(0.0).max(v_class));
        let others = self
            .tiers
            .iter()
            .any(|t| t.listed && !t.classes[class].groups.is_empty());
        if !others {
            let u = self.u.unwrap_or(0.0);
            self.u_class[class] = Some(self.u_class[class].unwrap_or(0.0).max(u));
        }
    }

    /// The flow's worker queues `n` calls, the next costing `cost`, in `group`.
    fn join(&mut self, flow: &Flow, group: &str, n: u32, cost: u64) {
        let (tier, class, tenant) = flow;
        self.wants.insert(flow.clone(), (n, cost));
        let q = &self.tiers[*tier].classes[*class];
        let group = match q.group_of.get(tenant) {
            Some(g) => g.clone(),
            None if group.is_empty() => tenant.clone(),
            None => group.to_owned(),
        };
        let waiting = q.flows.get(&group).is_some_and(|f| f.contains_key(tenant));
        if waiting {
            return;
        }
        if !q.groups.contains_key(&group) {
            self.backlogged(*tier, *class);
            let t = &mut self.tiers[*tier];
            let v = t.t[*class].unwrap_or(0.0);
            let q = &mut t.classes[*class];
            enter(&mut q.groups, &mut q.gfin, &group, v);
        }
        let q = &mut self.tiers[*tier].classes[*class];
        q.group_of.insert(tenant.clone(), group.clone());
        let v = q.gv.get(&group).copied().unwrap_or(0.0);
        let flows = q.flows.entry(group.clone()).or_default();
        enter(flows, q.fins.entry(group).or_default(), tenant, v);
    }

    /// The flow's worker leaves it: so does the flow, and its group when it was the last.
    fn leave(&mut self, flow: &Flow) {
        let (tier, class, tenant) = flow;
        self.wants.remove(flow);
        let q = &mut self.tiers[*tier].classes[*class];
        let Some(group) = q.group_of.remove(tenant) else {
            return;
        };
        let flows = q.flows.entry(group.clone()).or_default();
        depart(flows, q.fins.entry(group.clone()).or_default(), tenant);
        if flows.is_empty() {
            q.flows.remove(&group);
            depart(&mut q.groups, &mut q.gfin, &group);
            q.fins.remove(&group);
            q.gv.remove(&group);
        }
    }

    /// An acquire of `flow` with `n` of its calls at its worker (this one included):
    /// taken when the caps have room, the rest queued; else all queued.
    fn acquire(&mut self, flow: &Flow, group: &str, n: u32, cost: u64, caps: (u32, u32)) -> bool {
        let (global_cap, class_weight) = caps;
        let tier = flow.0;
        let t = &self.tiers[tier];
        let room = self.leases + self.promised < global_cap && t.leases + t.promised < t.cap;
        let queued = if room { n - 1 } else { n };
        if queued > 0 {
            self.join(flow, group, queued, cost);
            self.global_cap = Some(global_cap);
            self.tiers[tier].listed = true;
            self.class_weight[flow.1] = Some(class_weight);
        } else {
            self.leave(flow);
        }
        if room {
            self.leases += 1;
            self.tiers[tier].leases += 1;
        }
        room
    }

    /// The tiers with a flow queued and room; the others listed but with nobody waiting
    /// forget their order.
    fn open_tiers(&mut self) -> Vec<usize> {
        let mut open = Vec::new();
        for tier in 0..self.tiers.len() {
            if !self.tiers[tier].listed {
                continue;
            }
            if !self.waiting(tier) {
                let t = &mut self.tiers[tier];
                t.listed = false;
                t.v = [None; 3];
                t.t = [None; 3];
                t.classes = Default::default();
            } else if self.tiers[tier].leases + self.tiers[tier].promised < self.tiers[tier].cap {
                open.push(tier);
            }
        }
        open
    }

    /// A slot (or a wake-up) is free: who gets it, charged and promised. `None` when no
    /// flow waits in a tier with room, or the global cap is full with promises.
    fn hand_out(&mut self) -> Option<Wake> {
        if self.leases + self.promised >= self.global_cap.unwrap_or(0) {
            return None;
        }
        let open = self.open_tiers();
        let has =
            |m: &Model, tier: usize, class: usize| !m.tiers[tier].classes[class].groups.is_empty();
        // 1. The class: the least finish, the first on a tie.
        let mut best: Option<(usize, f64)> = None;
        for class in 0..3 {
            if open.iter().any(|&t| has(self, t, class)) {
                let start = self.u_class[class].unwrap_or(self.u.unwrap_or(0.0));
                let finish = start + 1.0 / f64::from(self.class_weight(class));
                if best.is_none_or(|b| finish < b.1) {
                    best = Some((class, finish));
                }
            }
        }
        let (class, _) = best?;
        // 2. The tier: the least start, the heaviest on a tie; tied ones all allowed.
        let tag =
            |m: &Model, t: usize| m.tiers[t].v[class].unwrap_or(m.v_class[class].unwrap_or(0.0));
        let waiting: Vec<usize> = open.into_iter().filter(|&t| has(self, t, class)).collect();
        let least = waiting
            .iter()
            .map(|&t| (tag(self, t), self.tier_weight(t)))
            .min_by(|a, b| a.0.total_cmp(&b.0).then(b.1.cmp(&a.1)))?;
        let tiers: Vec<usize> = waiting
            .into_iter()
            .filter(|&t| (tag(self, t), self.tier_weight(t)) == least)
            .collect();
        Some(Wake { class, tiers })
    }

    fn class_weight(&self, class: usize) -> u32 {
        self.class_weight[class].filter(|w| *w > 0).unwrap_or(1)
    }

    fn tier_weight(&self, tier: usize) -> u32 {
        self.tiers[tier].weight.max(1)
    }

    /// The slot goes to the head flow of `tier` in `class` (one of the wake's tiers):
    /// promised, and every level charged.
    fn serve(&mut self, tier: usize, class: usize) -> Flow {
        let start = self.u_class[class].unwrap_or(self.u.unwrap_or(0.0));
        self.u_class[class] = Some(start + 1.0 / f64::from(self.class_weight(class)));
        self.u = Some(start);
        let tier_start = self.tiers[tier].v[class].unwrap_or(self.v_class[class].unwrap_or(0.0));
        let weight = f64::from(self.tier_weight(tier));
        let q = &self.tiers[tier].classes[class];
        let (group, group_start) = head(&q.groups).expect("a waiting group");
        let (tenant, flow_start) = head(&q.flows[&group]).expect("a waiting flow");
        let flow = (tier, class, tenant.clone());
        let (n, cost) = self.wants[&flow];
        let cost = cost.max(1) as f64;
        let t = &mut self.tiers[tier];
        t.v[class] = Some(tier_start + cost / weight);
        t.t[class] = Some(group_start);
        self.v_class[class] = Some(tier_start);
        let q = &mut t.classes[class];
        q.groups.insert(group.clone(), group_start + cost);
        q.gv.insert(group.clone(), flow_start);
        q.flows
            .get_mut(&group)
            .expect("its flows")
            .insert(tenant, flow_start + cost);
        q.gfin.retain(|_, fin| *fin > group_start);
        if let Some(fins) = q.fins.get_mut(&group) {
            fins.retain(|_, fin| *fin > flow_start);
        }
        t.promised += 1;
        self.promised += 1;
        if n > 1 {
            self.wants.get_mut(&flow).expect("its calls").0 = n - 1;
        } else {
            self.leave(&flow);
        }
        flow
    }
}

// ---------------------------------------------------------------------------------------
// The differential test
// ---------------------------------------------------------------------------------------

const CLOCK: &str = "local t = redis.call('TIME')\n";
const FIXED_CLOCK: &str = "local t = {'1764547200', '0'}\n";

fn on_fixed_clock(source: &str) -> Script {
    assert_eq!(
        source.matches(CLOCK).count(),
        1,
        "one clock read to replace"
    );
    Script::new(&source.replacen(CLOCK, FIXED_CLOCK, 1))
}

/// One step of a case.
#[derive(Clone, Debug)]
enum Step {
    /// `calls` more calls of tenant `tenant` (of `TENANTS`) in a tier and class.
    Arrive {
        tier: usize,
        class: usize,
        tenant: usize,
        calls: u32,
        cost: u64,
    },
    /// One of the leases held (by its index, modulo) is given back.
    Release(usize),
    /// One waiting flow (by its index, modulo) has no calls any more.
    GiveUp(usize),
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

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        4 => (0usize..3, 0usize..3, 0..TENANTS.len(), 1u32..4, 1u64..60).prop_map(
            |(tier, class, tenant, calls, cost)| Step::Arrive { tier, class, tenant, calls, cost }
        ),
        4 => any::<usize>().prop_map(Step::Release),
        1 => any::<usize>().prop_map(Step::GiveUp),
    ]
}

/// The global cap, the tiers' (cap, weight), the class weights, the steps.
type Case = (u32, Vec<(u32, u32)>, [u32; 3], Vec<Step>);

fn case() -> impl Strategy<Value = Case> {
    (
        1u32..6,
        prop::collection::vec((1u32..4, 1u32..5), 3),
        [1u32..6, 1u32..6, 1u32..6],
        prop::collection::vec(step(), 1..80),
    )
}

/// The scripts of one case, its keys under `prefix`.
struct Fleet<'a> {
    conn: &'a mut Connection,
    acquire: &'a Script,
    release: &'a Script,
    prefix: String,
    tokens: u64,
}

impl Fleet<'_> {
    fn key(&self, name: &str) -> String {
        format!("{}:{name}", self.prefix)
    }

    fn tier_key(&self, tier: usize) -> String {
        self.key(&format!("tier:{tier}"))
    }

    fn worker(flow: &Flow) -> String {
        format!("w-{}-{}-{}", flow.0, flow.1, flow.2)
    }

    /// Registers every flow's worker as alive for good, in one epoch.
    fn start(&mut self) {
        let mut pipe = redis::pipe();
        pipe.cmd("SET").arg(self.key("epoch")).arg("e1");
        for tier in 0..3 {
            for class in 0..3 {
                for (tenant, _) in TENANTS {
                    let flow = (tier, class, tenant.to_owned());
                    pipe.cmd("ZADD")
                        .arg(self.key("workers"))
                        .arg(1_764_547_200_000u64 * 2)
                        .arg(Fleet::worker(&flow));
                }
            }
        }
        pipe.exec(self.conn).expect("set the fleet up");
    }

    /// The acquire script for `flow`; whether the lease `id` was taken.
    #[allow(clippy::too_many_arguments)]
    fn acquire(
        &mut self,
        flow: &Flow,
        group: &str,
        id: &str,
        waiting: u32,
        token: &str,
        cost: u64,
        caps: (u32, u32, u32),
        weights: (u32, u32),
    ) -> bool {
        let tier = self.tier_key(flow.0);
        let reply: Vec<i64> = self
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
            .arg(caps.0)
            .arg(caps.1)
            .arg(3_600_000)
            .arg(id)
            .arg(Fleet::worker(flow))
            .arg("e1")
            .arg(waiting)
            .arg(weights.0)
            .arg(token)
            .arg(flow.1)
            .arg(weights.1)
            .arg(&flow.2)
            .arg(cost)
            .arg(0)
            .arg(0)
            .arg(0)
            .arg(0)
            .arg(0)
            .arg(group)
            .invoke(self.conn)
            .expect("run the acquire script");
        assert_ne!(reply[0], -1, "the worker is told to resync");
        reply[0] == 1
    }

    /// The release script, giving back `lease` (or only waking, with `entry` leaving its
    /// flow); the flows it woke: (tier, class, tenant, token).
    fn release(
        &mut self,
        lease: Option<(&str, usize)>,
        entry: Option<&Flow>,
    ) -> Vec<(usize, usize, String, String)> {
        let tier = self.tier_key(lease.map_or(entry.map_or(0, |f| f.0), |l| l.1));
        self.release
            .key(self.key("global"))
            .key(&tier)
            .key(self.key("waits"))
            .key(self.key("promised"))
            .key(self.key("workers"))
            .key(self.key("cells"))
            .arg(lease.map_or("", |l| l.0))
            .arg(self.key("wake:"))
            .arg("RPUSH")
            .arg("")
            .arg(entry.map_or(String::new(), |f| {
                format!("{}|{}|{}", Fleet::worker(f), f.1, f.2)
            }))
            .arg(0)
            .arg("")
            .arg("")
            .arg("")
            .invoke::<Vec<i64>>(self.conn)
            .expect("run the release script");
        self.woken()
    }

    /// The wake-ups sent since the last look (each worker's list), emptied.
    fn woken(&mut self) -> Vec<(usize, usize, String, String)> {
        let lists: Vec<String> = redis::cmd("KEYS")
            .arg(format!("{}*", self.key("wake:")))
            .query(self.conn)
            .expect("list the wake-ups");
        let mut woken = Vec::new();
        for list in lists {
            let messages: Vec<String> = redis::cmd("LRANGE")
                .arg(&list)
                .arg(0)
                .arg(-1)
                .query(self.conn)
                .expect("read a wake-up");
            redis::cmd("DEL").arg(&list).exec(self.conn).expect("clear");
            for message in messages {
                let parts: Vec<&str> = message.split('\n').collect();
                let tier = parts[0].rsplit(':').next().and_then(|t| t.parse().ok());
                woken.push((
                    tier.expect("a tier key"),
                    parts[2].parse().expect("a class"),
                    parts[3].to_owned(),
                    parts[1].to_owned(),
                ));
            }
        }
        self.tokens += woken.len() as u64;
        woken
    }
}

fn run_case(
    conn: &mut Connection,
    scripts: (&Script, &Script),
    n: u64,
    case: Case,
) -> Result<(), TestCaseError> {
    let (global_cap, tiers, class_weights, steps) = case;
    let mut model = Model::new(&tiers);
    let mut fleet = Fleet {
        conn,
        acquire: scripts.0,
        release: scripts.1,
        prefix: format!("order{n}"),
        tokens: 0,
    };
    fleet.start();
    let mut leases: Vec<(String, usize)> = Vec::new();
    let mut next_id = 0u64;
    let mut new_id = || {
        next_id += 1;
        format!("lease{next_id}")
    };
    for step in steps {
        match step {
            Step::Arrive {
                tier,
                class,
                tenant,
                calls,
                cost,
            } => {
                let (name, group) = TENANTS[tenant];
                let flow = (tier, class, name.to_owned());
                let waiting = model.wants.get(&flow).map_or(0, |w| w.0) + calls;
                let caps = (global_cap, tiers[tier].0, tiers[tier].1);
                let id = new_id();
                let taken = fleet.acquire(
                    &flow,
                    group,
                    &id,
                    waiting,
                    "",
                    cost,
                    caps,
                    (caps.2, class_weights[class]),
                );
                let expected = model.acquire(
                    &flow,
                    group,
                    waiting,
                    cost,
                    (global_cap, class_weights[class]),
                );
                prop_assert_eq!(taken, expected, "an arrival of {:?}", flow);
                if taken {
                    leases.push((id, tier));
                }
            }
            Step::Release(i) if !leases.is_empty() => {
                let (id, tier) = leases.remove(i % leases.len());
                model.leases -= 1;
                model.tiers[tier].leases -= 1;
                let woken = fleet.release(Some((&id, tier)), None);
                follow(
                    &mut fleet,
                    &mut model,
                    woken,
                    global_cap,
                    &tiers,
                    &class_weights,
                    &mut leases,
                    &mut new_id,
                )?;
            }
            Step::GiveUp(i) if !model.wants.is_empty() => {
                let mut flows: Vec<&Flow> = model.wants.keys().collect();
                flows.sort();
                let flow = flows[i % flows.len()].clone();
                model.leave(&flow);
                let woken = fleet.release(None, Some(&flow));
                follow(
                    &mut fleet,
                    &mut model,
                    woken,
                    global_cap,
                    &tiers,
                    &class_weights,
                    &mut leases,
                    &mut new_id,
                )?;
            }
            _ => {}
        }
    }
    Ok(())
}

/// The wake-up the scripts sent (at most one) is the model's; the woken worker's acquire
/// takes the promised slot.
#[allow(clippy::too_many_arguments)]
fn follow(
    fleet: &mut Fleet<'_>,
    model: &mut Model,
    woken: Vec<(usize, usize, String, String)>,
    global_cap: u32,
    tiers: &[(u32, u32)],
    class_weights: &[u32; 3],
    leases: &mut Vec<(String, usize)>,
    new_id: &mut impl FnMut() -> String,
) -> Result<(), TestCaseError> {
    prop_assert!(woken.len() <= 1, "one wake-up per freed slot: {:?}", woken);
    let (wake, (tier, class, tenant, token)) = match (model.hand_out(), woken.into_iter().next()) {
        (None, None) => return Ok(()),
        (Some(wake), Some(woken)) => (wake, woken),
        (expected, woken) => {
            return Err(TestCaseError::fail(format!(
                "the model wakes {expected:?}, the scripts {woken:?}"
            )));
        }
    };
    prop_assert_eq!(class, wake.class, "the class woken");
    prop_assert!(
        wake.tiers.contains(&tier),
        "tier {} woken, the model allows {:?}",
        tier,
        wake.tiers
    );
    let flow = model.serve(tier, class);
    prop_assert_eq!(
        &tenant,
        &flow.2,
        "the flow woken in tier {} class {}",
        tier,
        class
    );
    // The woken worker takes its slot with the calls it had, the woken one included.
    let left = model.wants.get(&flow).map_or(0, |w| w.0);
    let cost = model.wants.get(&flow).map_or(1, |w| w.1);
    let group = TENANTS.iter().find(|t| t.0 == flow.2).map_or("", |t| t.1);
    let id = new_id();
    let caps = (global_cap, tiers[tier].0, tiers[tier].1);
    let taken = fleet.acquire(
        &flow,
        group,
        &id,
        left + 1,
        &token,
        cost,
        caps,
        (caps.2, class_weights[class]),
    );
    prop_assert!(taken, "a promised slot is taken");
    model.promised -= 1;
    model.tiers[tier].promised -= 1;
    model.leases += 1;
    model.tiers[tier].leases += 1;
    if left > 0 {
        model.join(&flow, group, left, cost);
    }
    leases.push((id, tier));
    Ok(())
}

#[test]
fn the_slot_scripts_wake_whom_the_model_of_the_fleets_order_names() {
    let server = redis_server::RedisServer::start();
    let client = redis::Client::open(server.url()).expect("client");
    let mut conn = client
        .get_connection()
        .expect("connect to the throwaway redis");
    let acquire = on_fixed_clock(super::slots::ACQUIRE_SOURCE);
    let release = on_fixed_clock(super::slots::RELEASE_SOURCE);
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
        run_case(
            &mut conn.borrow_mut(),
            (&acquire, &release),
            cases.get(),
            case,
        )
    });
    if let Err(failure) = result {
        panic!("{failure}");
    }
}
