use super::*;
use proptest::prelude::*;
use std::collections::{HashMap, HashSet, VecDeque};

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

fn tenants_and_ops() -> impl Strategy<Value = (Vec<u32>, Vec<Op>)> {
    (2..=5usize).prop_flat_map(|n| (prop::collection::vec(1..=4u32, n), ops(n)))
}

struct VisitState {
    waiting: Vec<usize>,
    topups: Vec<u64>,
    fresh: Vec<bool>,
    /// Tenants of the requests popped and not completed yet.
    in_flight: Vec<usize>,
}

impl VisitState {
    fn pop_and_check(
        &mut self,
        s: &mut Scheduler<()>,
        weights: &[u32],
        quantum: u64,
        quanta: u32,
    ) -> Result<(), TestCaseError> {
        let Some(d) = s.pop() else { return Ok(()) };
        let x = tenant_number(&d.tenant);
        self.waiting[x] -= 1;
        self.in_flight.push(x);
        for visit in s.take_trace(Priority::Standard) {
            match visit {
                Visit::TopUp(t) => self.topups[tenant_number(&t)] += 1,
                Visit::Dispatch(t) => {
                    let t = tenant_number(&t);
                    prop_assert_eq!(t, x);
                    let per_visit = quantum * u64::from(weights[t]);
                    // A top-up ends a turn of the tenant at the head of
                    // its list. From a deficit >= 0 the item needs at
                    // most ceil(c / (quantum × weight)) top-ups, each one
                    // turn: an item that reached its tenant's head as
                    // its predecessor went out leaves within that many
                    // new turns. A newcomer's grant is its first top-up,
                    // so its first item needs one fewer. A tenant that
                    // came back to its listed, empty queue gets no fresh
                    // grant (DRR++), so its first turn may be spent on
                    // that top-up: ceil(c / (quantum × weight)) + 1 turns.
                    let needed = ceil_div(d.cost, per_visit);
                    let allowed = needed - u64::from(self.fresh[t]);
                    prop_assert!(
                        self.topups[t] <= allowed,
                        "{} top-ups > {allowed} (cost {}, fresh {})",
                        self.topups[t],
                        d.cost,
                        self.fresh[t]
                    );
                    prop_assert!(self.topups[t] <= u64::from(quanta));
                    self.topups[t] = 0;
                    self.fresh[t] = false;
                }
                Visit::Forget(_) => {}
            }
        }
        Ok(())
    }
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
                    let key = s
                        .push(CLASSES[class], tid(&format!("t{tenant}")), weights[tenant], cost, next_id)
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
                        .dispatch_direct(CLASSES[class], id.clone(), weights[tenant], cost)
                        .ok_or_else(|| TestCaseError::fail("no capacity limit"))?;
                    prop_assert_eq!(charged, cost.min(max_charge));
                    let deficit = s.deficit_of(CLASSES[class], &id);
                    let floor = -i64::try_from(max_charge).unwrap_or(i64::MAX);
                    prop_assert!(deficit.is_some_and(|d| d >= floor));
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
            prop_assert!(queue.index.len() == 0 && queue.tenants.is_empty());
        }
    }

    #[test]
    fn two_backlogged_tenants_stay_within_quantum_plus_max_charge(
        costs_a in prop::collection::vec(1..=40_000u64, 1..80),
        costs_b in prop::collection::vec(1..=40_000u64, 1..80),
        w_a in 1..=4u32,
        w_b in 1..=4u32,
        order in prop::collection::vec(any::<bool>(), 160),
        quantum in prop_oneof![Just(1_000u64), Just(5_000), Just(20_000)],
        quanta in 1..=4u32,
    ) {
        let config = SchedulerConfig::default().with_quantum(quantum).with_max_charge_quanta(quanta);
        let bound = i128::from(quantum + config.max_charge());
        let mut s = scheduler(config);
        let (mut ia, mut ib) = (0, 0);
        for take_a in order.into_iter().chain(std::iter::repeat_n(true, 160)) {
            if take_a && ia < costs_a.len() {
                s.push(Priority::Standard, tid("a"), w_a, costs_a[ia], ()).ok();
                ia += 1;
            } else if ib < costs_b.len() {
                s.push(Priority::Standard, tid("b"), w_b, costs_b[ib], ()).ok();
                ib += 1;
            }
        }
        prop_assert_eq!(s.len(), costs_a.len() + costs_b.len());
        let (mut left_a, mut left_b) = (costs_a.len(), costs_b.len());
        let (mut served_a, mut served_b) = (0i128, 0i128);
        while left_a > 0 && left_b > 0 {
            let d = s.pop().ok_or_else(|| TestCaseError::fail("items waiting"))?;
            if d.tenant.as_str() == "a" {
                served_a += i128::from(d.cost);
                left_a -= 1;
            } else {
                served_b += i128::from(d.cost);
                left_b -= 1;
            }
            // |sa/wa - sb/wb| < q + max_charge, cross-multiplied.
            let (wa, wb) = (i128::from(w_a), i128::from(w_b));
            prop_assert!((served_a * wb - served_b * wa).abs() < bound * wa * wb,
                "served a={served_a} b={served_b}");
        }
    }

    #[test]
    fn item_is_dispatched_within_its_top_up_bound(
        weights in prop::collection::vec(1..=4u32, 2..=5),
        steps in prop::collection::vec((0..3u8, any::<prop::sample::Index>(), 1..=40_000u64), 1..300),
        quantum in prop_oneof![Just(1_000u64), Just(5_000)],
        quanta in 1..=4u32,
    ) {
        let config = SchedulerConfig::default().with_quantum(quantum).with_max_charge_quanta(quanta);
        let mut s = scheduler(config);
        let n = weights.len();
        let mut state = VisitState {
            waiting: vec![0; n],
            topups: vec![0; n],
            fresh: vec![false; n],
            in_flight: Vec::new(),
        };
        for (op, who, cost) in steps {
            match op {
                0 => {
                    let t = who.index(n);
                    if state.waiting[t] == 0 {
                        // Fresh grant only if forgotten; a tenant that emptied
                        // less than a round ago, or is parked with requests in
                        // flight, keeps its deficit (>= 0 here).
                        state.topups[t] = 0;
                        let id = tid(&format!("t{t}"));
                        state.fresh[t] = s.deficit_of(Priority::Standard, &id).is_none();
                    }
                    state.waiting[t] += 1;
                    s.push(Priority::Standard, tid(&format!("t{t}")), weights[t], cost, ()).ok();
                }
                1 => state.pop_and_check(&mut s, &weights, quantum, quanta)?,
                _ => {
                    if !state.in_flight.is_empty() {
                        let t = state.in_flight.swap_remove(who.index(state.in_flight.len()));
                        s.complete(Priority::Standard, &tid(&format!("t{t}")));
                    }
                }
            }
        }
        while !s.is_empty() {
            state.pop_and_check(&mut s, &weights, quantum, quanta)?;
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

    /// Newcomer starvation (`ARCHITECTURE.md`, "Newcomers"). Tenant `h` is
    /// backlogged; after every pop one of `n` light tenants with nothing
    /// waiting (brand-new on its first push, else one that emptied
    /// earlier and may still be listed) pushes one item, unless the
    /// script skips. Every item costs exactly its tenant's
    /// `quantum × weight`, so a deficit is always 0 or one grant. Proven
    /// bounds: `h` is served at least once in every `2n + 1` consecutive
    /// pops, and after `P` pops it has had at least `(P - 2n) / (n + 1)`
    /// of them. (With newcomer priority on every return, `h` got none.)
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
            prop_assert!(since_heavy <= 2 * n64, "h waited {since_heavy} pops, n = {n}");
            prop_assert!(
                (n64 + 1) * heavy_pops + 2 * n64 >= pops,
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
