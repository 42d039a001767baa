//! The fleet's fair order, as a model to read: what the slot scripts (`slot_queue.lua`,
//! `slot_acquire.lua`, `slot_release.lua`, `slot_heartbeat.lua`) decide, written once more
//! in plain Rust, and a differential test that runs seeded random arrivals, releases,
//! departures, heartbeats and the passing of time through the real scripts on a throwaway
//! `redis-server` and through the model, and asks both who is woken for each freed slot.
//!
//! The order, at four levels, each start-time fair queuing (SFQ) on the cost:
//! 1. the class (critical, standard, batch) by fair queuing on the class weights, one call
//!    each: the least finish tag (`u`: start, start + 1 / weight), ties to the first class;
//! 2. the tier, among those with a call waiting in that class and room under their cap: the
//!    least start tag (`v`), ties to the heavier (then to the first the wait book's hash
//!    lists, which is no rule: the test gives each tier weights no other tier has);
//! 3. the group (a key: a service with its end users, or a team) in that tier and class: the
//!    least start tag, ties to the smaller name (a sorted set's order);
//! 4. the flow (a tenant) in that group: the same.
//!
//! A tier (or class) that starts waiting starts at the current virtual time, a group or
//! flow at the virtual time of its level or its own last finish if later, so nothing banks
//! credit for the time it had nothing waiting. A served flow is charged its call's cost at
//! the flow and the group level, cost over the tier's weight at the tier level.
//!
//! Around the order, time (ms on the scripts' clock):
//! - a lease lasts [`LEASE_TTL`] unless a heartbeat of its worker renews it; once expired it
//!   counts no more, and giving it back after a script swept it wakes nobody;
//! - a slot promised to a woken worker counts for [`PROMISE`], until its acquire (or its
//!   passing on) names the token;
//! - a worker's record lasts [`WORKER_TTL`] from its last heartbeat. Past it the worker's
//!   acquires and heartbeats are told to resync, and any heartbeat takes its flows out of
//!   the order; with less than [`LIVE_FOR`] left a release passes over its flows, taking
//!   them out, and wakes the next.
//!
//! The scripts read their clock once (`TIME`). The test replaces that read by a hash it sets
//! before each call, as `pacing_differential.rs` does with a key, rather than giving the
//! scripts a clock argument: the scripts run as shipped but for that line, and time moves
//! by any amount with no sleep.
//! Each tenant has one worker (`w-<tenant>`), so a flow is held by one worker and the order
//! of workers inside a flow plays no part.

use std::collections::{BTreeMap, HashMap};

use proptest::prelude::*;
use proptest::test_runner::{Config, RngSeed, TestRunner};
use redis::{Connection, Script};

use super::pacing_differential::redis_server;

/// How long a lease lasts unrenewed (the acquire's and the heartbeat's TTL), ms.
const LEASE_TTL: u64 = 5_000;
/// How long a worker's record lasts from its heartbeat, ms.
const WORKER_TTL: u64 = 20_000;
/// How long a release wakes a worker only if its record has left at least, ms (the
/// release's `ARGV[6]`).
const LIVE_FOR: u64 = 5_000;
/// How long a promised slot is kept for its worker, ms (fixed in `slot_release.lua`).
const PROMISE: u64 = 1_000;

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
    /// Its cap and weight (`c:<tier>`, `w:<tier>`) as the last acquire that queued named
    /// them, while the book lists it: from a queued call until a release finds nobody
    /// waiting in it.
    listed: Option<(u32, u32)>,
    /// Its start tag (`v`) and its groups' virtual time (`t`) per class.
    v: [Option<f64>; 3],
    t: [Option<f64>; 3],
    classes: [ClassQueue; 3],
}

/// A flow: its tier, class and tenant.
type Flow = (usize, usize, String);

/// The caps and weights an acquire names (its worker's policy).
#[derive(Clone, Copy, Debug)]
struct Caps {
    global: u32,
    tier: u32,
    weight: u32,
    class_weight: u32,
}

/// An acquire: the flow, its group (`""`: the tenant's own), the flow's calls at its
/// worker (this one included), what the next costs, and the caps.
#[derive(Clone, Debug)]
struct Ask {
    flow: Flow,
    group: &'static str,
    calls: u32,
    cost: u64,
    caps: Caps,
}

/// What an acquire answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Acquired {
    Taken,
    /// A cap is full; the calls are queued.
    Refused,
    /// The worker's record is gone: nothing is taken or queued.
    Resync,
}

/// A wake-up: the flow woken and its token.
type Woken = Option<(Flow, u64)>;

/// The fleet's order as the wait book, the lease sets and the worker set hold it.
#[derive(Debug, Default)]
struct Model {
    /// The scripts' clock, ms.
    now: u64,
    /// Leases (id: tier, expiry), promised slots (token: tier, expiry) and the workers'
    /// records (tenant: expiry). The scripts drop what expired before they count; so does
    /// [`Model::sweep`].
    leases: HashMap<String, (usize, u64)>,
    promises: HashMap<u64, (usize, u64)>,
    records: HashMap<String, u64>,
    /// The last wake-up's token (the book's `token`).
    token: u64,
    /// The global cap and the class weights, as the last acquire that queued named them.
    global_cap: Option<u32>,
    class_weight: [Option<u32>; 3],
    tiers: Vec<Tier>,
    /// Class tags (`u:<class>`, `u`) and the classes' virtual times (`v:<class>`).
    u_class: [Option<f64>; 3],
    u: Option<f64>,
    v_class: [Option<f64>; 3],
    /// Calls waiting per flow, and what the next one costs.
    wants: HashMap<Flow, (u32, u64)>,
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
    /// `tiers` tiers, and the workers of `tenants` alive for a worker TTL.
    fn new<'a>(tiers: usize, tenants: impl IntoIterator<Item = &'a str>) -> Model {
        Model {
            tiers: (0..tiers).map(|_| Tier::default()).collect(),
            records: tenants
                .into_iter()
                .map(|t| (t.to_owned(), WORKER_TTL))
                .collect(),
            ..Model::default()
        }
    }

    /// Drops the leases and promises that expired.
    fn sweep(&mut self) {
        let now = self.now;
        self.leases.retain(|_, (_, expiry)| *expiry > now);
        self.promises.retain(|_, (_, expiry)| *expiry > now);
    }

    /// Whether the worker of `tenant` has a record alive for `more` ms yet.
    fn alive(&self, tenant: &str, more: u64) -> bool {
        self.records
            .get(tenant)
            .is_some_and(|expiry| *expiry > self.now + more)
    }

    /// Slots held in `tier`: its leases and promises.
    fn held(&self, tier: usize) -> usize {
        let leases = self.leases.values().filter(|l| l.0 == tier).count();
        leases + self.promises.values().filter(|p| p.0 == tier).count()
    }

    fn waiting(&self, tier: usize) -> bool {
        self.wants.keys().any(|(t, _, _)| *t == tier)
    }

    fn class_start(&self, class: usize) -> f64 {
        self.u_class[class].unwrap_or(self.u.unwrap_or(0.0))
    }

    fn class_weight(&self, class: usize) -> u32 {
        self.class_weight[class].filter(|w| *w > 0).unwrap_or(1)
    }

    fn tier_start(&self, tier: usize, class: usize) -> f64 {
        self.tiers[tier].v[class].unwrap_or(self.v_class[class].unwrap_or(0.0))
    }

    fn tier_weight(&self, tier: usize) -> u32 {
        self.tiers[tier].listed.map_or(1, |(_, w)| w.max(1))
    }

    // -- The order: joining and leaving -------------------------------------------------

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
            .any(|t| t.listed.is_some() && !t.classes[class].groups.is_empty());
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

    // -- The order: whose turn ----------------------------------------------------------

    /// The tiers with a flow queued and room under their cap; the others listed but with
    /// nobody waiting forget their order.
    fn open_tiers(&mut self) -> Vec<usize> {
        let mut open = Vec::new();
        for tier in 0..self.tiers.len() {
            let Some((cap, _)) = self.tiers[tier].listed else {
                continue;
            };
            if !self.waiting(tier) {
                self.tiers[tier] = Tier::default();
            } else if self.held(tier) < cap as usize {
                open.push(tier);
            }
        }
        open
    }

    /// The class and tier whose turn it is among the `open` tiers.
    fn pick(&self, open: &[usize]) -> Option<(usize, usize)> {
        let has = |tier: usize, class: usize| !self.tiers[tier].classes[class].groups.is_empty();
        // 1. The class: the least finish, the first on a tie.
        let mut best: Option<(usize, f64)> = None;
        for class in 0..3 {
            if open.iter().any(|&t| has(t, class)) {
                let finish = self.class_start(class) + 1.0 / f64::from(self.class_weight(class));
                if best.is_none_or(|b| finish < b.1) {
                    best = Some((class, finish));
                }
            }
        }
        let (class, _) = best?;
        // 2. The tier: the least start, the heavier on a tie.
        let tier = open
            .iter()
            .copied()
            .filter(|&t| has(t, class))
            .min_by(|&a, &b| {
                let (sa, sb) = (self.tier_start(a, class), self.tier_start(b, class));
                sa.total_cmp(&sb)
                    .then(self.tier_weight(b).cmp(&self.tier_weight(a)))
            })?;
        Some((tier, class))
    }

    /// 3. and 4.: the head group of `tier` in `class`, and its head flow.
    fn head_flow(&self, tier: usize, class: usize) -> Option<Flow> {
        let q = &self.tiers[tier].classes[class];
        let (group, _) = head(&q.groups)?;
        let (tenant, _) = head(q.flows.get(&group)?)?;
        Some((tier, class, tenant))
    }

    /// The head flow of `tier` in `class` is served: every level charged, one call less.
    fn serve(&mut self, flow: &Flow) {
        let (tier, class, tenant) = flow;
        let (tier, class) = (*tier, *class);
        let start = self.class_start(class);
        self.u_class[class] = Some(start + 1.0 / f64::from(self.class_weight(class)));
        self.u = Some(start);
        let tier_start = self.tier_start(tier, class);
        let weight = f64::from(self.tier_weight(tier));
        let (n, cost) = self.wants.get(flow).copied().unwrap_or((1, 1));
        let cost = cost.max(1) as f64;
        let t = &mut self.tiers[tier];
        let q = &mut t.classes[class];
        let group = q.group_of.get(tenant).cloned().unwrap_or_default();
        let group_start = q.groups.get(&group).copied().unwrap_or(0.0);
        let flows = q.flows.entry(group.clone()).or_default();
        let flow_start = flows.get(tenant).copied().unwrap_or(0.0);
        flows.insert(tenant.clone(), flow_start + cost);
        q.groups.insert(group.clone(), group_start + cost);
        q.gv.insert(group.clone(), flow_start);
        // Finish tags behind the virtual time give a returning group or flow nothing.
        q.gfin.retain(|_, fin| *fin > group_start);
        if let Some(fins) = q.fins.get_mut(&group) {
            fins.retain(|_, fin| *fin > flow_start);
        }
        t.v[class] = Some(tier_start + cost / weight);
        t.t[class] = Some(group_start);
        self.v_class[class] = Some(tier_start);
        match self.wants.get_mut(flow) {
            Some(w) if n > 1 => w.0 = n - 1,
            _ => self.leave(flow),
        }
    }

    // -- The scripts --------------------------------------------------------------------

    /// `slot_acquire.lua` for `ask`, the lease `id`, answering the wake-up `token`: taken
    /// when the caps have room (the rest of the calls queued), else all queued.
    fn acquire(&mut self, ask: &Ask, id: &str, token: Option<u64>) -> Acquired {
        let (tier, class, tenant) = &ask.flow;
        if !self.alive(tenant, 0) {
            return Acquired::Resync;
        }
        if let Some(token) = token {
            self.promises.remove(&token);
        }
        self.sweep();
        let global = self.leases.len() + self.promises.len();
        let full = global >= ask.caps.global as usize || self.held(*tier) >= ask.caps.tier as usize;
        let queued = if full {
            ask.calls
        } else {
            ask.calls.saturating_sub(1)
        };
        if queued > 0 {
            self.join(&ask.flow, ask.group, queued, ask.cost);
            self.global_cap = Some(ask.caps.global);
            self.tiers[*tier].listed = Some((ask.caps.tier, ask.caps.weight));
            self.class_weight[*class] = Some(ask.caps.class_weight);
        } else if !full && ask.calls == 1 {
            self.leave(&ask.flow);
        }
        if full {
            return Acquired::Refused;
        }
        self.leases
            .insert(id.to_owned(), (*tier, self.now + LEASE_TTL));
        Acquired::Taken
    }

    /// `slot_release.lua`: gives back `lease` (or only wakes), takes back the promise
    /// `token` passed on and the flow `entry` leaving, and wakes the flow whose turn it is,
    /// passing over those whose worker is not alive for `LIVE_FOR` more. Returns whether
    /// the lease was still there, and who was woken.
    fn release(
        &mut self,
        lease: Option<&str>,
        token: Option<u64>,
        entry: Option<&Flow>,
    ) -> (bool, Woken) {
        let removed = lease.is_some_and(|id| self.leases.remove(id).is_some());
        if let Some(token) = token {
            self.promises.remove(&token);
        }
        if let Some(flow) = entry {
            self.leave(flow);
        }
        self.sweep();
        let room = self.leases.len() + self.promises.len() < self.global_cap.unwrap_or(0) as usize;
        // A lease a script already dropped as expired frees nothing now: its slot has been
        // counted free since.
        if !(removed || lease.is_none()) || !room {
            return (removed, None);
        }
        for _ in 0..64 {
            let open = self.open_tiers();
            let Some(flow) = self.pick(&open).and_then(|(t, c)| self.head_flow(t, c)) else {
                break;
            };
            if !self.alive(&flow.2, LIVE_FOR) {
                self.leave(&flow);
                continue;
            }
            self.serve(&flow);
            self.token += 1;
            self.promises
                .insert(self.token, (flow.0, self.now + PROMISE));
            return (removed, Some((flow, self.token)));
        }
        (removed, None)
    }

    /// `slot_heartbeat.lua` of the worker of `tenant`, holding the leases `held`: its record
    /// and those leases renewed, the flows of workers whose record expired taken out.
    /// Returns the leases gone, or `None` when the worker must resync.
    fn heartbeat(&mut self, tenant: &str, held: &[String]) -> Option<Vec<String>> {
        if !self.alive(tenant, 0) {
            return None;
        }
        self.records
            .insert(tenant.to_owned(), self.now + WORKER_TTL);
        self.sweep();
        let dead: Vec<Flow> = (self.wants.keys())
            .filter(|f| !self.alive(&f.2, 0))
            .cloned()
            .collect();
        for flow in dead {
            self.leave(&flow);
        }
        let mut missing = Vec::new();
        for id in held {
            match self.leases.get_mut(id) {
                Some(lease) => lease.1 = self.now + LEASE_TTL,
                None => missing.push(id.clone()),
            }
        }
        Some(missing)
    }
}

// ---------------------------------------------------------------------------------------
// The differential test
// ---------------------------------------------------------------------------------------

const CLOCK: &str = "local t = redis.call('TIME')\n";
/// The test's clock: `s` and `us` of the hash next to the global lease set (`KEYS[1]` of
/// the three scripts), as `TIME` answers.
const TEST_CLOCK: &str = "local t = redis.call('HMGET', KEYS[1] .. ':clock', 's', 'us')\n";
/// The clock's 0, ms: near where Redis's `TIME` is, so the scores carry today's magnitudes.
const EPOCH_MS: u64 = 1_764_547_200_000;

fn on_test_clock(source: &str) -> Script {
    assert_eq!(
        source.matches(CLOCK).count(),
        1,
        "one clock read to replace"
    );
    Script::new(&source.replacen(CLOCK, TEST_CLOCK, 1))
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
                let flow = (
                    tier.expect("a tier key"),
                    parts[2].parse().expect("a class"),
                    parts[3].to_owned(),
                );
                woken.push((flow, parts[1].parse().expect("a token")));
            }
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
