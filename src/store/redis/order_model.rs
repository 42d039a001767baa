//! The fleet's fair order, as a model to read: what the slot scripts (`slot_queue.lua`,
//! `slot_acquire.lua`, `slot_release.lua`, `slot_heartbeat.lua`) decide, written once more
//! in plain Rust. `order_differential.rs` runs the scripts against it.
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
//! Each tenant has one worker (`w-<tenant>`), so a flow is held by one worker and the order
//! of workers inside a flow plays no part.

use std::collections::HashMap;

/// How long a lease lasts unrenewed (the acquire's and the heartbeat's TTL), ms.
pub(super) const LEASE_TTL: u64 = 5_000;
/// How long a worker's record lasts from its heartbeat, ms.
pub(super) const WORKER_TTL: u64 = 20_000;
/// How long a release wakes a worker only if its record has left at least, ms (the
/// release's `ARGV[6]`).
pub(super) const LIVE_FOR: u64 = 5_000;
/// How long a promised slot is kept for its worker, ms (fixed in `slot_release.lua`).
pub(super) const PROMISE: u64 = 1_000;

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
pub(super) type Flow = (usize, usize, String);

/// The caps and weights an acquire names (its worker's policy).
#[derive(Clone, Copy, Debug)]
pub(super) struct Caps {
    pub(super) global: u32,
    pub(super) tier: u32,
    pub(super) weight: u32,
    pub(super) class_weight: u32,
}

/// An acquire: the flow, its group (`""`: the tenant's own), the flow's calls at its
/// worker (this one included), what the next costs, and the caps.
#[derive(Clone, Debug)]
pub(super) struct Ask {
    pub(super) flow: Flow,
    pub(super) group: &'static str,
    pub(super) calls: u32,
    pub(super) cost: u64,
    pub(super) caps: Caps,
}

/// What an acquire answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Acquired {
    Taken,
    /// A cap is full; the calls are queued.
    Refused,
    /// The worker's record is gone: nothing is taken or queued.
    Resync,
}

/// A wake-up: the flow woken and its token.
pub(super) type Woken = Option<(Flow, u64)>;

/// The fleet's order as the wait book, the lease sets and the worker set hold it.
#[derive(Debug, Default)]
pub(super) struct Model {
    /// The scripts' clock, ms.
    pub(super) now: u64,
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
    pub(super) wants: HashMap<Flow, (u32, u64)>,
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
    pub(super) fn new<'a>(tiers: usize, tenants: impl IntoIterator<Item = &'a str>) -> Model {
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
    pub(super) fn acquire(&mut self, ask: &Ask, id: &str, token: Option<u64>) -> Acquired {
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
    pub(super) fn release(
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
    pub(super) fn heartbeat(&mut self, tenant: &str, held: &[String]) -> Option<Vec<String>> {
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
