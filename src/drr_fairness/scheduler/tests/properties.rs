use super::*;
use proptest::prelude::*;
use std::collections::{HashMap, HashSet, VecDeque};

const STD: Priority = Priority::Standard;

// ---------- proptests ----------

#[derive(Clone, Debug)]
enum Op {
    Push {
        class: usize,
        tenant: usize,
        cost: u64,
    },
    Pop,
    Remove(prop::sample::Index),
    /// One dispatched request completes.
    Complete(prop::sample::Index),
    /// One dispatched request is settled at `actual` tokens.
    Settle(prop::sample::Index, u64),
    /// A request goes out without queueing.
    Direct {
        class: usize,
        tenant: usize,
        cost: u64,
    },
}

fn ops(tenants: usize) -> impl Strategy<Value = Vec<Op>> {
    prop::collection::vec(
        prop_oneof![
            4 => (0..3usize, 0..tenants, 1..=40_000u64)
                .prop_map(|(class, tenant, cost)| Op::Push { class, tenant, cost }),
            3 => Just(Op::Pop),
            2 => any::<prop::sample::Index>().prop_map(Op::Remove),
            2 => any::<prop::sample::Index>().prop_map(Op::Complete),
            1 => (any::<prop::sample::Index>(), 1..=100_000u64)
                .prop_map(|(index, actual)| Op::Settle(index, actual)),
            1 => (0..3usize, 0..tenants, 1..=40_000u64)
                .prop_map(|(class, tenant, cost)| Op::Direct { class, tenant, cost }),
        ],
        1..250,
    )
}

/// Odd tenants are end users of one group; even ones groups of their own.
fn group_of(tenant: usize) -> Option<TenantId> {
    (tenant % 2 == 1).then(|| tid("odd"))
}

fn tenants_and_ops() -> impl Strategy<Value = (Vec<u32>, Vec<Op>)> {
    (2..=5usize).prop_flat_map(|n| (prop::collection::vec(1..=4u32, n), ops(n)))
}

proptest! {
    #[test]
    fn every_item_is_popped_or_removed_exactly_once_in_fifo_order(
        (weights, ops) in tenants_and_ops()
    ) {
        let mut s = scheduler(SchedulerConfig::default());
        // Compact on (nearly) every drain, to check it against the model.
        for queue in &mut s.classes {
            queue.compact_above = 1;
        }
        let max_charge = s.config().max_charge();
        let mut model: HashMap<(usize, usize), VecDeque<(u64, u64)>> = HashMap::new();
        let mut keys: Vec<(Key, u64, usize, usize)> = Vec::new();
        let (mut popped, mut removed) = (HashSet::new(), HashSet::new());
        let mut flights: Vec<(Priority, TenantId, u64)> = Vec::new();
        let mut check = |s: &mut Scheduler<u64>, d: Dispatched<u64>,
                         model: &mut HashMap<(usize, usize), VecDeque<(u64, u64)>>| {
            let slot = (class_index(d.class), tenant_number(&d.tenant));
            let front = model.get_mut(&slot).and_then(VecDeque::pop_front);
            prop_assert_eq!(front.map(|(id, _)| id), Some(d.item), "fifo within tenant");
            prop_assert_eq!(front.map(|(_, c)| c.min(max_charge)), Some(d.cost));
            prop_assert!(popped.insert(d.item), "popped once");
            s.check_invariants();
            Ok(())
        };
        for (next_id, op) in ops.into_iter().enumerate() {
            let next_id = next_id as u64;
            match op {
                Op::Push { class, tenant, cost } => {
                    let group = group_of(tenant);
                    let key = s
                        .push_in(CLASSES[class], group.as_ref(), tid(&format!("t{tenant}")), weights[tenant], cost, next_id)
                        .map_err(|_| TestCaseError::fail("no limits configured"))?;
                    model.entry((class, tenant)).or_default().push_back((next_id, cost));
                    keys.push((key, next_id, class, tenant));
                }
                Op::Pop => match s.pop() {
                    Some(d) => {
                        flights.push((d.class, d.tenant.clone(), d.cost));
                        check(&mut s, d, &mut model)?;
                    }
                    None => prop_assert!(model.values().all(VecDeque::is_empty)),
                },
                Op::Complete(index) => {
                    if !flights.is_empty() {
                        let picked = index.index(flights.len());
                        let (class, tenant, _) = flights.swap_remove(picked);
                        s.complete(class, &tenant);
                    }
                }
                Op::Settle(index, actual) => {
                    if !flights.is_empty() {
                        let (class, tenant, cost) = &flights[index.index(flights.len())];
                        s.settle(*class, tenant, *cost, actual);
                    }
                }
                Op::Direct { class, tenant, cost } => {
                    let id = tid(&format!("t{tenant}"));
                    let charged = s
                        .dispatch_direct_in(CLASSES[class], group_of(tenant).as_ref(), id.clone(), weights[tenant], cost)
                        .ok_or_else(|| TestCaseError::fail("no capacity limit"))?;
                    prop_assert_eq!(charged, cost.min(max_charge));
                    flights.push((CLASSES[class], id, charged));
                }
                Op::Remove(index) => {
                    if keys.is_empty() {
                        continue;
                    }
                    let (key, id, class, tenant) = keys[index.index(keys.len())];
                    let queue = model.entry((class, tenant)).or_default();
                    let expected = queue.iter().position(|&(x, _)| x == id);
                    let got = s.remove(key);
                    match expected {
                        Some(pos) => {
                            queue.remove(pos);
                            prop_assert_eq!(got, Some(id));
                            prop_assert!(removed.insert(id));
                        }
                        None => prop_assert_eq!(got, None),
                    }
                }
            }
            s.check_invariants();
            // A tenant with requests in flight is known, with its exact count.
            for (class, tenant, _) in &flights {
                let expected =
                    flights.iter().filter(|f| (&f.0, &f.1) == (class, tenant)).count();
                prop_assert_eq!(s.in_flight_of(*class, tenant), Some(expected as u32));
            }
            let waiting: usize = model.values().map(VecDeque::len).sum();
            prop_assert_eq!(s.len(), waiting);
            for (ci, class) in CLASSES.into_iter().enumerate() {
                let items: usize = model.iter().filter(|(k, _)| k.0 == ci).map(|(_, q)| q.len()).sum();
                let active = model.iter().filter(|(k, q)| k.0 == ci && !q.is_empty()).count();
                prop_assert_eq!(s.class_len(class), items);
                prop_assert_eq!(s.active_tenants(class), active);
            }
        }
        while let Some(d) = s.pop() {
            flights.push((d.class, d.tenant.clone(), d.cost));
            check(&mut s, d, &mut model)?;
        }
        prop_assert!(s.is_empty());
        prop_assert!(popped.is_disjoint(&removed));
        prop_assert_eq!(popped.len() + removed.len(), keys.len());
        for class in CLASSES {
            prop_assert_eq!(s.active_tenants(class), 0);
        }
        // Nothing waiting and, once every dispatch completed, nothing in
        // flight: no tenant state is left.
        for (class, tenant, _) in flights {
            s.complete(class, &tenant);
            s.check_invariants();
        }
        for queue in &s.classes {
            prop_assert!(queue.tenants.len() == 0 && queue.groups.len() == 0);
        }
    }

    /// The Virtual Token Counter's bound: two tenants backlogged from the start, each call
    /// settled at what it really took (from a tenth to twice its estimate) as it ends,
    /// differ in service per unit of weight by at most one largest charge over the lesser
    /// weight, at every dispatch.
    #[test]
    fn two_backlogged_tenants_differ_by_at_most_one_call_of_real_service(
        costs_a in prop::collection::vec((1..=40_000u64, 1..=20u64), 1..80),
        costs_b in prop::collection::vec((1..=40_000u64, 1..=20u64), 1..80),
        w_a in 1..=4u32,
        w_b in 1..=4u32,
        quanta in 1..=4u32,
    ) {
        let config = SchedulerConfig::default().with_quantum(5_000).with_max_charge_quanta(quanta);
        let max_charge = config.max_charge();
        let mut s = scheduler(config);
        for &(cost, use_tenths) in &costs_a {
            s.push(STD, tid("a"), w_a, cost, use_tenths).ok();
        }
        for &(cost, use_tenths) in &costs_b {
            s.push(STD, tid("b"), w_b, cost, use_tenths).ok();
        }
        let (mut left_a, mut left_b) = (costs_a.len(), costs_b.len());
        let (mut served_a, mut served_b) = (0f64, 0f64);
        let bound = max_charge as f64 / f64::from(w_a.min(w_b)) + 1.0;
        while left_a > 0 && left_b > 0 {
            let d = s.pop().ok_or_else(|| TestCaseError::fail("items waiting"))?;
            let used = (d.cost * d.item / 10).max(1);
            s.settle(d.class, &d.tenant, d.cost, used);
            s.complete(d.class, &d.tenant);
            let took = used.min(max_charge) as f64;
            if d.tenant.as_str() == "a" {
                served_a += took / f64::from(w_a);
                left_a -= 1;
            } else {
                served_b += took / f64::from(w_b);
                left_b -= 1;
            }
            prop_assert!((served_a - served_b).abs() <= bound,
                "served per weight a={served_a} b={served_b}, bound {bound}");
        }
    }

    /// A tenant the class does not know that starts waiting while `k` others wait is
    /// dispatched within `k + 1` pops, whatever the weights, costs, completions and
    /// settlements around it.
    #[test]
    fn a_new_tenant_is_served_within_one_turn_of_each_waiting_tenant(
        weights in prop::collection::vec(1..=4u32, 2..=8),
        steps in prop::collection::vec(
            (0..4u8, any::<prop::sample::Index>(), 1..=40_000u64, 1..=20u64), 1..300),
    ) {
        let mut s = scheduler(SchedulerConfig::default());
        let n = weights.len();
        // Per newcomer waiting: pops left before it must have been served.
        let mut deadline: Vec<Option<usize>> = vec![None; n];
        let mut in_flight: Vec<(usize, u64)> = Vec::new();
        for (op, who, cost, use_tenths) in steps {
            match op {
                0 | 1 => {
                    let t = who.index(n);
                    let id = tid(&format!("t{t}"));
                    if s.tenant_len(STD, &id) == 0 && !s.knows(STD, &id) {
                        deadline[t] = Some(s.active_tenants(STD) + 1);
                    }
                    s.push(STD, id, weights[t], cost, ()).ok();
                }
                2 => {
                    let Some(d) = s.pop() else { continue };
                    let x = tenant_number(&d.tenant);
                    deadline[x] = None;
                    for (t, left) in deadline.iter_mut().enumerate() {
                        if let Some(left) = left {
                            *left -= 1;
                            prop_assert!(*left > 0, "t{t} not served in time");
                        }
                    }
                    in_flight.push((x, d.cost));
                }
                _ => {
                    if !in_flight.is_empty() {
                        let (t, charged) = in_flight.swap_remove(who.index(in_flight.len()));
                        let id = tid(&format!("t{t}"));
                        s.settle(STD, &id, charged, (charged * use_tenths / 10).max(1));
                        s.complete(STD, &id);
                    }
                }
            }
            s.check_invariants();
        }
    }

    /// Equal costs, every tenant backlogged: a tenant of weight `w` is dispatched at most
    /// `w / w' + 1` times in a row, `w'` the heaviest other's weight.
    #[test]
    fn no_tenant_runs_longer_than_its_weight_allows(
        weights in prop::collection::vec(1..=5u32, 2..=6),
        cost in 1..=40_000u64,
        pops in 1..400usize,
    ) {
        let mut s = scheduler(SchedulerConfig::default());
        for _ in 0..pops {
            for (t, &w) in weights.iter().enumerate() {
                s.push(STD, tid(&format!("t{t}")), w, cost, ()).ok();
            }
        }
        let (mut last, mut run) = (usize::MAX, 0u32);
        for _ in 0..pops {
            let d = s.pop_done().ok_or_else(|| TestCaseError::fail("backlogged"))?;
            let t = tenant_number(&d.tenant);
            run = if t == last { run + 1 } else { 1 };
            last = t;
            let heaviest_other = weights.iter().enumerate()
                .filter(|&(o, _)| o != t).map(|(_, &w)| w).max().unwrap_or(1);
            prop_assert!(run <= weights[t] / heaviest_other + 1,
                "t{t} (weight {}) ran {run} times, weights {weights:?}", weights[t]);
        }
    }

    #[test]
    fn batch_wait_stays_bounded_when_other_classes_come_and_go(
        critical in 1..=300u32,
        standard in 1..=300u32,
        batch in 1..=300u32,
        steps in prop::collection::vec(0..4u8, 1..600),
    ) {
        let weights = ClassWeights { critical, standard, batch };
        let total = u64::from(critical) + u64::from(standard) + u64::from(batch);
        let limit = 2 * ceil_div(total, u64::from(batch));
        let mut s = scheduler(SchedulerConfig::default().with_class_weights(weights));
        for _ in 0..steps.len() {
            s.push(Priority::Batch, tid("b"), 1, 1, ()).ok();
        }
        let mut waited = 0u64;
        for step in steps {
            match step {
                0 => { s.push(Priority::Critical, tid("c"), 1, 1, ()).ok(); }
                1 => { s.push(Priority::Standard, tid("s"), 1, 1, ()).ok(); }
                _ => {
                    let d = s.pop().ok_or_else(|| TestCaseError::fail("batch backlogged"))?;
                    if d.class == Priority::Batch {
                        waited = 0;
                    } else {
                        waited += 1;
                        prop_assert!(waited < limit, "batch waited {waited}");
                    }
                }
            }
        }
    }

    /// Newcomer starvation (`ARCHITECTURE.md`, "Newcomers"). Tenant `h` is backlogged;
    /// after every pop one of `n` light tenants with nothing waiting (brand-new on its
    /// first push, else one back, remembered at its finish or forgotten) pushes one item,
    /// unless the script skips. Every item moves its tenant on by the same virtual time
    /// (its cost is `quantum × weight`). Bounds: `h` is served at least once in every
    /// `n + 1` consecutive pops, so after `P` pops it has had at least `(P - n) / (n + 1)`
    /// of them.
    #[test]
    fn old_tenant_is_not_starved_by_a_stream_of_newcomers(
        light_weights in prop::collection::vec(1..=4u32, 1..=6),
        heavy_weight in 1..=4u32,
        script in prop::collection::vec(
            (prop::option::weighted(0.9, any::<prop::sample::Index>()), any::<bool>()),
            1..400,
        ),
        quantum in prop_oneof![Just(1_000u64), Just(5_000)],
    ) {
        let class = Priority::Standard;
        // Requests in flight; the script completes them all at some steps,
        // so light tenants are forgotten and come back through `new`, and
        // at others leaves them running, so they are parked.
        let mut in_flight: Vec<TenantId> = Vec::new();
        let n = light_weights.len();
        let n64 = n as u64;
        let mut s = scheduler(SchedulerConfig::default().with_quantum(quantum));
        let heavy = tid("h");
        for _ in 0..=script.len() {
            s.push(class, heavy.clone(), heavy_weight, quantum * u64::from(heavy_weight), ())
                .ok();
        }
        let mut waiting = vec![false; n];
        let (mut pops, mut heavy_pops, mut since_heavy) = (0u64, 0u64, 0u64);
        for (choice, complete) in script {
            let d = s.pop().ok_or_else(|| TestCaseError::fail("h is backlogged"))?;
            in_flight.push(d.tenant.clone());
            if complete {
                for tenant in in_flight.drain(..) {
                    s.complete(class, &tenant);
                }
            }
            pops += 1;
            if d.tenant == heavy {
                heavy_pops += 1;
                since_heavy = 0;
            } else {
                waiting[tenant_number(&d.tenant)] = false;
                since_heavy += 1;
            }
            prop_assert!(since_heavy <= n64, "h waited {since_heavy} pops, n = {n}");
            prop_assert!(
                (n64 + 1) * heavy_pops + n64 >= pops,
                "h served {heavy_pops} of {pops} pops, n = {n}"
            );
            if let Some(index) = choice {
                let idle: Vec<usize> = (0..n).filter(|&i| !waiting[i]).collect();
                if !idle.is_empty() {
                    let x = idle[index.index(idle.len())];
                    let weight = light_weights[x];
                    s.push(class, tid(&format!("l{x}")), weight, quantum * u64::from(weight), ())
                        .ok();
                    waiting[x] = true;
                }
            }
        }
    }
}
