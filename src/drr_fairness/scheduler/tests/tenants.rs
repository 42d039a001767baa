use super::*;
use std::collections::HashSet;

#[test]
fn paid_tier_weight_three_is_served_three_to_one() {
    let mut s = scheduler(SchedulerConfig::default());
    for _ in 0..1_000 {
        s.push(Priority::Standard, tid("paid"), 3, 1_000, ()).ok();
        s.push(Priority::Standard, tid("free"), 1, 1_000, ()).ok();
    }
    let (mut paid, mut free) = (0u64, 0u64);
    for _ in 0..1_000 {
        let d = s.pop().expect("backlogged");
        match d.tenant.as_str() {
            "paid" => paid += d.cost,
            _ => free += d.cost,
        }
    }
    let ratio = paid as f64 / free as f64;
    assert!((ratio - 3.0).abs() < 0.09, "ratio {ratio}");
}

#[test]
fn newcomer_goes_out_at_next_pop() {
    // quantum == cost: A's deficit is spent by each dispatch, so B's
    // item is the very next pop.
    let mut s = scheduler(SchedulerConfig::default());
    for _ in 0..100 {
        s.push(Priority::Standard, tid("a"), 1, 5_000, ()).ok();
    }
    assert_eq!(s.pop().expect("waiting").tenant, tid("a"));
    s.push(Priority::Standard, tid("b"), 1, 5_000, ()).ok();
    assert_eq!(s.pop().expect("waiting").tenant, tid("b"));

    // General case: A keeps the head while its remaining deficit covers
    // its next item (floor(deficit / cost) more pops), then B, whose
    // fresh quantum covers an item of cost <= quantum.
    let mut s = scheduler(SchedulerConfig::default());
    for _ in 0..100 {
        s.push(Priority::Standard, tid("a"), 1, 2_000, ()).ok();
    }
    assert_eq!(s.pop().expect("waiting").tenant, tid("a"));
    let left = s.deficit_of(Priority::Standard, &tid("a")).expect("active");
    assert_eq!(left, 3_000);
    s.push(Priority::Standard, tid("b"), 1, 5_000, ()).ok();
    let more_a = usize::try_from(left / 2_000).expect("small");
    for _ in 0..more_a {
        assert_eq!(s.pop().expect("waiting").tenant, tid("a"));
    }
    assert_eq!(s.pop().expect("waiting").tenant, tid("b"));
}

/// `h` backlogged (10 items of one quantum), served twice: from `new`,
/// then topped up, moved to `old` and served again; its deficit is spent.
fn heavy_on_old() -> Scheduler<()> {
    let class = Priority::Standard;
    let mut s = scheduler(SchedulerConfig::default());
    for _ in 0..10 {
        s.push(class, tid("h"), 1, 5_000, ()).ok();
    }
    assert_eq!(s.pop_done().expect("waiting").tenant, tid("h"));
    assert_eq!(s.pop_done().expect("waiting").tenant, tid("h"));
    assert_eq!(s.list_of(class, &tid("h")), Some(ListKind::Old));
    s
}

/// `h` backlogged on `old` with its deficit spent; `l` then pushes one
/// item, goes out at once from `new` as a genuine newcomer, and empties.
fn heavy_on_old_after_light_served_once() -> Scheduler<()> {
    let class = Priority::Standard;
    let mut s = heavy_on_old();
    s.push(class, tid("l"), 1, 5_000, ()).ok();
    assert_eq!(s.list_of(class, &tid("l")), Some(ListKind::New));
    assert_eq!(s.pop_done().expect("waiting").tenant, tid("l"));
    s.take_trace(class);
    s
}

#[test]
fn tenant_that_empties_and_returns_within_the_round_gets_no_newcomer_priority() {
    let class = Priority::Standard;
    let mut s = heavy_on_old_after_light_served_once();
    // Emptied from `new`: back of `old`, behind h, deficit (0) kept; it
    // is listed but not active.
    assert_eq!(s.list_of(class, &tid("l")), Some(ListKind::Old));
    assert_eq!(s.deficit_of(class, &tid("l")), Some(0));
    assert_eq!(s.active_tenants(class), 1);
    s.check_invariants();
    // Back before its turn: joins its own queue, no grant, no `new`.
    s.push(class, tid("l"), 1, 5_000, ()).ok();
    assert_eq!(s.list_of(class, &tid("l")), Some(ListKind::Old));
    assert_eq!(s.deficit_of(class, &tid("l")), Some(0));
    assert_eq!(s.active_tenants(class), 2);
    // So h goes first (a newcomer would have), then l in its turn.
    assert_eq!(s.pop_done().expect("waiting").tenant, tid("h"));
    assert_eq!(s.pop_done().expect("waiting").tenant, tid("l"));
    assert!(
        !s.take_trace(class)
            .iter()
            .any(|v| matches!(v, Visit::Forget(_)))
    );
    s.check_invariants();
}

#[test]
fn tenant_absent_for_a_full_round_regains_newcomer_priority() {
    let class = Priority::Standard;
    let mut s = heavy_on_old_after_light_served_once();
    // h's turn: topped up and moved behind l, which is found empty at
    // the head of `old` and forgotten, then h is served.
    assert_eq!(s.pop_done().expect("waiting").tenant, tid("h"));
    assert_eq!(
        s.take_trace(class),
        vec![
            Visit::TopUp(tid("h")),
            Visit::Forget(tid("l")),
            Visit::Dispatch(tid("h"))
        ]
    );
    assert_eq!(s.deficit_of(class, &tid("l")), None);
    s.check_invariants();
    // Newcomer again: fresh grant, `new`, out at the next pop.
    s.push(class, tid("l"), 1, 5_000, ()).ok();
    assert_eq!(s.list_of(class, &tid("l")), Some(ListKind::New));
    assert_eq!(s.deficit_of(class, &tid("l")), Some(5_000));
    assert_eq!(s.pop_done().expect("waiting").tenant, tid("l"));
}

#[test]
fn each_emptied_tenant_is_visited_once_then_forgotten() {
    let class = Priority::Standard;
    let mut s = heavy_on_old();
    for i in 0..100 {
        s.push(class, tid(&format!("l{i}")), 1, 5_000, ()).ok();
    }
    for _ in 0..100 {
        assert_ne!(s.pop_done().expect("waiting").tenant, tid("h"));
    }
    // 101 listed tenants, one of them active.
    assert_eq!(s.classes[1].index.len(), 101);
    assert_eq!(s.active_tenants(class), 1);
    s.take_trace(class);
    // One pop walks past all 100 once, forgetting each, then serves h.
    assert_eq!(s.pop_done().expect("waiting").tenant, tid("h"));
    let trace = s.take_trace(class);
    let forgotten: HashSet<_> = trace
        .iter()
        .filter_map(|v| match v {
            Visit::Forget(t) => Some(t.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(forgotten.len(), 100);
    assert_eq!(trace.len(), 102, "top-up h, 100 forgets, dispatch h");
    assert_eq!(s.classes[1].index.len(), 1);
    assert_eq!(s.classes[1].tenants.iter().flatten().count(), 1);
    assert_eq!(s.pop_done().expect("waiting").tenant, tid("h"));
    assert_eq!(s.take_trace(class).len(), 2, "top-up h, dispatch h");
    s.check_invariants();
}

#[test]
fn removal_that_empties_a_tenant_keeps_its_place_like_a_dispatch() {
    let class = Priority::Standard;
    let mut s = heavy_on_old_after_light_served_once();
    // On `new`: a removal moves it to the back of `old`, deficit kept,
    // so cancelling and pushing again does not jump the queue.
    let key = s.push(class, tid("m"), 1, 5_000, ()).expect("no limit");
    assert_eq!(s.list_of(class, &tid("m")), Some(ListKind::New));
    assert_eq!(s.remove(key), Some(()));
    assert_eq!(s.list_of(class, &tid("m")), Some(ListKind::Old));
    assert_eq!(s.deficit_of(class, &tid("m")), Some(5_000));
    s.push(class, tid("m"), 1, 5_000, ()).ok();
    assert_eq!(s.list_of(class, &tid("m")), Some(ListKind::Old));
    s.check_invariants();
    // On `old`: stays until its turn, then is forgotten.
    let key = s.push(class, tid("l"), 1, 5_000, ()).expect("no limit");
    assert_eq!(s.remove(key), Some(()));
    assert_eq!(s.list_of(class, &tid("l")), Some(ListKind::Old));
    assert_eq!(s.active_tenants(class), 2, "h and m");
    // old = [h, l, m]: h topped up and moved back, l forgotten, m served.
    assert_eq!(s.pop_done().expect("waiting").tenant, tid("m"));
    assert_eq!(s.list_of(class, &tid("l")), None);
    s.check_invariants();
}

#[test]
fn giant_request_is_not_stuck() {
    let config = SchedulerConfig::default();
    let quanta = u64::from(config.max_charge_quanta);
    let mut s = scheduler(config);
    for _ in 0..50 {
        s.push(Priority::Standard, tid("busy"), 1, 5_000, ()).ok();
    }
    s.push(Priority::Standard, tid("giant"), 1, 1_000_000_000, ())
        .ok();
    s.push(Priority::Standard, tid("giant"), 1, 1_000_000_000, ())
        .ok();
    let mut giant_topups = 0u64;
    let mut giant_done = 0;
    for _ in 0..40 {
        let d = s.pop().expect("waiting");
        for visit in s.take_trace(Priority::Standard) {
            match visit {
                Visit::TopUp(t) if t == tid("giant") => giant_topups += 1,
                Visit::Dispatch(t) if t == tid("giant") => {
                    assert!(giant_topups <= quanta, "{giant_topups} top-ups");
                    assert_eq!(d.cost, 20_000);
                    giant_topups = 0;
                    giant_done += 1;
                }
                _ => {}
            }
        }
    }
    assert_eq!(giant_done, 2);
}

#[test]
fn deficit_resets_when_the_class_drains_or_the_tenant_is_found_empty() {
    let mut s = scheduler(SchedulerConfig::default());
    s.push(Priority::Batch, tid("a"), 2, 1_000, ()).ok();
    assert_eq!(s.deficit_of(Priority::Batch, &tid("a")), Some(10_000));
    s.pop_done().expect("waiting");
    assert_eq!(s.deficit_of(Priority::Batch, &tid("a")), None);
    assert_eq!(s.active_tenants(Priority::Batch), 0);
    // No banked 9,000: a fresh quantum × weight.
    s.push(Priority::Batch, tid("a"), 2, 1_000, ()).ok();
    assert_eq!(s.deficit_of(Priority::Batch, &tid("a")), Some(10_000));

    // With b backlogged the class does not drain: a keeps its 9,000
    // until its turn on `old` finds it empty, then it is forgotten.
    s.push(Priority::Batch, tid("b"), 1, 5_000, ()).ok();
    s.push(Priority::Batch, tid("b"), 1, 5_000, ()).ok();
    assert_eq!(s.pop_done().expect("waiting").tenant, tid("a"));
    assert_eq!(s.deficit_of(Priority::Batch, &tid("a")), Some(9_000));
    assert_eq!(s.pop_done().expect("waiting").tenant, tid("b"));
    assert_eq!(s.deficit_of(Priority::Batch, &tid("a")), Some(9_000));
    // old = [a, b]: a is forgotten, b (deficit 0) topped up and served.
    assert_eq!(s.pop_done().expect("waiting").tenant, tid("b"));
    assert_eq!(s.deficit_of(Priority::Batch, &tid("a")), None);
}

// ---------- in flight ----------

#[test]
fn direct_dispatches_are_charged_so_a_newcomer_goes_first() {
    // `a` filled the window without queueing: 4 × 1,000 charged from a
    // deficit of 0. Then `a` and `b` queue, `a` first: `b`, a newcomer
    // with a fresh quantum, goes out before `a`, whose debt (and work in
    // flight) puts it on `old`.
    let class = Priority::Standard;
    let mut s = scheduler(SchedulerConfig::default());
    for _ in 0..4 {
        assert_eq!(s.dispatch_direct(class, tid("a"), 1, 1_000), Some(1_000));
    }
    assert_eq!(s.deficit_of(class, &tid("a")), Some(-4_000));
    assert!(s.is_parked(class, &tid("a")));
    assert!(s.is_empty());
    s.check_invariants();
    s.push(class, tid("a"), 1, 1_000, ()).ok();
    s.push(class, tid("b"), 1, 1_000, ()).ok();
    assert_eq!(s.list_of(class, &tid("a")), Some(ListKind::Old));
    assert_eq!(s.list_of(class, &tid("b")), Some(ListKind::New));
    assert_eq!(s.pop().expect("waiting").tenant, tid("b"));
    assert_eq!(s.pop().expect("waiting").tenant, tid("a"));
    s.check_invariants();
    // A debt never goes below -max_charge (20,000), so a tenant that had
    // the window to itself waits at most max_charge_quanta extra rounds.
    for _ in 0..100 {
        s.dispatch_direct(class, tid("c"), 1, 5_000);
    }
    assert_eq!(s.deficit_of(class, &tid("c")), Some(-20_000));
    s.check_invariants();
}

#[test]
fn a_tenant_found_empty_with_work_in_flight_is_parked_not_forgotten() {
    let class = Priority::Standard;
    let mut s = heavy_on_old();
    s.push(class, tid("l"), 1, 5_000, ()).ok();
    // Out from `new`, still in flight: moves to `old` behind `h`.
    assert_eq!(s.pop().expect("waiting").tenant, tid("l"));
    s.take_trace(class);
    // h's turn, then l's: found empty with work in flight, it is parked
    // (credit forfeited), not forgotten.
    assert_eq!(s.pop_done().expect("waiting").tenant, tid("h"));
    assert!(
        !s.take_trace(class)
            .iter()
            .any(|v| matches!(v, Visit::Forget(_)))
    );
    assert!(s.is_parked(class, &tid("l")));
    assert_eq!(s.deficit_of(class, &tid("l")), Some(0));
    assert_eq!(s.active_tenants(class), 1);
    s.check_invariants();
    // Back while in flight: no newcomer priority, `old` behind h.
    s.push(class, tid("l"), 1, 5_000, ()).ok();
    assert_eq!(s.list_of(class, &tid("l")), Some(ListKind::Old));
    assert_eq!(s.pop_done().expect("waiting").tenant, tid("h"));
    assert_eq!(s.pop().expect("waiting").tenant, tid("l"));
    s.check_invariants();
    // Its two requests complete; its next turn finds it empty with
    // nothing in flight, and it is forgotten.
    s.complete(class, &tid("l"));
    s.complete(class, &tid("l"));
    assert_eq!(s.pop_done().expect("waiting").tenant, tid("h"));
    assert_eq!(s.pop_done().expect("waiting").tenant, tid("h"));
    assert_eq!(s.deficit_of(class, &tid("l")), None);
    s.check_invariants();
}

#[test]
fn settlement_reaches_a_tenant_in_flight_and_completion_forgets_it() {
    let class = Priority::Standard;
    let mut s = scheduler(SchedulerConfig::default());
    s.push(class, tid("x"), 1, 1_000, ()).ok();
    s.pop().expect("waiting");
    // The class drained; x is parked with its credit forfeited.
    assert!(s.is_parked(class, &tid("x")));
    assert_eq!(s.deficit_of(class, &tid("x")), Some(0));
    // It really used 3,000 tokens: charged while still in flight.
    s.settle(class, &tid("x"), 1_000, 3_000);
    assert_eq!(s.deficit_of(class, &tid("x")), Some(-2_000));
    // So when x and a newcomer y queue, y goes first.
    s.push(class, tid("x"), 1, 1_000, ()).ok();
    s.push(class, tid("y"), 1, 1_000, ()).ok();
    assert_eq!(s.pop_done().expect("waiting").tenant, tid("y"));
    assert_eq!(s.pop_done().expect("waiting").tenant, tid("x"));
    // x's first request completes: nothing waits, nothing in flight, no
    // state left. Completions of unknown tenants change nothing.
    s.complete(class, &tid("x"));
    s.complete(class, &tid("x"));
    s.complete(Priority::Batch, &tid("nobody"));
    assert_eq!(s.deficit_of(class, &tid("x")), None);
    assert!(s.classes[1].index.len() == 0 && s.classes[1].tenants.is_empty());
    s.check_invariants();
}

// ---------- removal ----------

#[test]
fn removed_entries_leave_no_tenant_state() {
    let mut s = scheduler(SchedulerConfig::default());
    let keys: Vec<Key> = (0..3)
        .map(|i| {
            s.push(Priority::Standard, tid("a"), 1, 100, i)
                .expect("no limit")
        })
        .collect();
    let other = s
        .push(Priority::Critical, tid("a"), 1, 100, 9)
        .expect("no limit");
    assert_eq!(s.active_tenants(Priority::Standard), 1);
    assert_eq!(s.remove(keys[1]), Some(1));
    assert_eq!(s.remove(keys[0]), Some(0));
    assert_eq!(s.remove(keys[2]), Some(2));
    assert_eq!(s.active_tenants(Priority::Standard), 0);
    assert_eq!(s.class_len(Priority::Standard), 0);
    assert_eq!(s.len(), 1);
    assert_eq!(s.remove(other), Some(9));
    assert_eq!(s.len(), 0);
    assert!(s.is_empty());
    for class in CLASSES {
        assert_eq!(s.active_tenants(class), 0);
        let queue = &s.classes[class_index(class)];
        assert!(queue.new.head == NONE && queue.old.head == NONE);
        assert!(queue.tenants.is_empty());
    }
    assert!(s.entries.slots.is_empty());
    assert!(s.pop().is_none());
    s.check_invariants();
}

#[cfg(target_pointer_width = "64")]
#[test]
fn slab_slots_stay_compact() {
    assert_eq!(std::mem::size_of::<Option<Entry<u64>>>(), 40);
    assert_eq!(std::mem::size_of::<Option<Tenant>>(), 56);
}

#[test]
fn push_beyond_capacity_is_refused_without_change() {
    let class = Priority::Standard;
    let mut s = scheduler(SchedulerConfig::default());
    s.entries.limit = 3;
    s.classes[1].limit = 2;
    s.push(class, tid("a"), 1, 1, 1).expect("room");
    s.push(class, tid("b"), 1, 1, 2).expect("room");
    // Tenant slab full: a third tenant is refused, a listed one is not.
    assert_eq!(
        s.push(class, tid("c"), 1, 1, 3),
        Err(Rejected::ClassFull(3))
    );
    s.push(class, tid("a"), 1, 1, 4).expect("room");
    s.check_invariants();
    // Entry slab full: refused for any tenant, in any class.
    assert_eq!(
        s.push(class, tid("b"), 1, 1, 5),
        Err(Rejected::ClassFull(5))
    );
    assert_eq!(
        s.push(Priority::Batch, tid("d"), 1, 1, 6),
        Err(Rejected::ClassFull(6))
    );
    assert_eq!(s.len(), 3);
    s.check_invariants();
    // A freed slot is reused.
    let first = s.pop().expect("waiting");
    assert_eq!(first.item, 1);
    s.push(class, tid("b"), 1, 1, 7).expect("a slot was freed");
    s.check_invariants();
    let order: Vec<u32> = std::iter::from_fn(|| s.pop().map(|d| d.item)).collect();
    assert_eq!(order.len(), 3);
    assert!(s.is_empty());
}

#[test]
fn a_drained_class_gives_back_memory_while_a_few_requests_are_in_flight() {
    let class = Priority::Standard;
    let mut s: Scheduler<()> = scheduler(SchedulerConfig::default());
    // One request stays in flight throughout, as on a busy service.
    s.dispatch_direct(class, tid("keeper"), 1, 1_000);
    for i in 0..5_000 {
        s.push(class, tid(&format!("t{i}")), 1, 1_000, ()).ok();
    }
    assert!(s.classes[1].tenants.len() > 5_000);
    while s.pop_done().is_some() {}
    // Drained: only the keeper is left, in a slab of the retained size
    // (the last tenant served was parked with it, then completed).
    let queue = &s.classes[1];
    assert_eq!(queue.tenants.iter().flatten().count(), 1);
    assert!(queue.tenants.len() <= 2);
    assert_eq!(queue.index.len(), 1);
    assert!(queue.tenants.capacity() <= RETAINED_CAPACITY);
    assert!(s.is_parked(class, &tid("keeper")));
    assert_eq!(s.deficit_of(class, &tid("keeper")), Some(-1_000));
    s.check_invariants();
    // Still found and charged as before, and forgotten when done.
    s.push(class, tid("keeper"), 1, 1_000, ()).ok();
    assert_eq!(s.list_of(class, &tid("keeper")), Some(ListKind::Old));
    assert!(s.pop_done().is_some());
    s.complete(class, &tid("keeper"));
    assert!(s.classes[1].tenants.is_empty());
    s.check_invariants();
}

#[test]
fn direct_dispatch_beyond_tenant_capacity_is_not_recorded() {
    let class = Priority::Standard;
    let mut s: Scheduler<()> = scheduler(SchedulerConfig::default());
    s.classes[1].limit = 1;
    assert_eq!(s.dispatch_direct(class, tid("a"), 1, 1_000), Some(1_000));
    // No slot for b: nothing recorded, so its caller must not complete it.
    assert_eq!(s.dispatch_direct(class, tid("b"), 1, 1_000), None);
    assert_eq!(s.deficit_of(class, &tid("b")), None);
    s.check_invariants();
    s.complete(class, &tid("a"));
    assert_eq!(s.deficit_of(class, &tid("a")), None);
    assert_eq!(s.dispatch_direct(class, tid("b"), 1, 1_000), Some(1_000));
    s.check_invariants();
}

#[test]
fn stale_key_after_reuse_removes_nothing() {
    let mut s = scheduler(SchedulerConfig::default());
    let keep = s
        .push(Priority::Standard, tid("a"), 1, 1, "keep")
        .expect("no limit");
    let first = s
        .push(Priority::Standard, tid("a"), 1, 1, "first")
        .expect("no limit");
    assert_eq!(s.remove(first), Some("first"));
    let second = s
        .push(Priority::Standard, tid("a"), 1, 1, "second")
        .expect("no limit");
    assert_eq!(first.index, second.index, "slot was reused");
    assert_eq!(s.remove(first), None);
    assert_eq!(s.len(), 2);
    // A popped item's key is stale too, even after a full drain.
    assert_eq!(s.pop().map(|d| d.item), Some("keep"));
    assert_eq!(s.pop().map(|d| d.item), Some("second"));
    let third = s
        .push(Priority::Standard, tid("a"), 1, 1, "third")
        .expect("no limit");
    assert_eq!(s.remove(keep), None);
    assert_eq!(s.remove(second), None);
    assert_eq!(s.remove(third), Some("third"));
    assert_eq!(s.remove(third), None);
}

// ---------- limits, settlement, config ----------

#[test]
fn queue_limits_refuse_the_incoming_request() {
    let config = SchedulerConfig::default()
        .with_max_per_tenant(Some(2))
        .with_max_per_class(Some(3));
    let mut s = scheduler(config);
    s.push(Priority::Standard, tid("a"), 1, 1, 1).expect("room");
    s.push(Priority::Standard, tid("a"), 1, 1, 2).expect("room");
    let refused = s.push(Priority::Standard, tid("a"), 1, 1, 3);
    assert_eq!(refused, Err(Rejected::TenantFull(3)));
    assert_eq!(refused.map_err(Rejected::into_inner), Err(3));
    s.push(Priority::Standard, tid("b"), 1, 1, 4).expect("room");
    assert_eq!(
        s.push(Priority::Standard, tid("c"), 1, 1, 5),
        Err(Rejected::ClassFull(5))
    );
    // The refusals changed nothing.
    assert_eq!(s.class_len(Priority::Standard), 3);
    assert_eq!(s.active_tenants(Priority::Standard), 2);
    // Other classes have their own limits.
    s.push(Priority::Batch, tid("a"), 1, 1, 6).expect("room");
    let order: Vec<i32> = std::iter::from_fn(|| s.pop().map(|d| d.item)).collect();
    assert_eq!(order.len(), 4);
    let standard: Vec<i32> = order.into_iter().filter(|&x| x != 6).collect();
    // Newcomers take turns one request at a time.
    assert_eq!(standard, vec![1, 4, 2]);
    assert_eq!(Rejected::TenantFull(()).to_string(), "tenant queue is full");
}

#[test]
fn settlement_charges_and_refunds_active_tenant() {
    let mut s = scheduler(SchedulerConfig::default());
    let class = Priority::Standard;
    let a = tid("a");
    for _ in 0..3 {
        s.push(class, a.clone(), 1, 1_000, ()).ok();
    }
    s.pop().expect("waiting");
    assert_eq!(s.deficit_of(class, &a), Some(4_000));
    s.settle(class, &a, 1_000, 3_000);
    assert_eq!(s.deficit_of(class, &a), Some(2_000));
    s.settle(class, &a, 3_000, 1_000);
    assert_eq!(s.deficit_of(class, &a), Some(4_000));
    // Refunds bank at most one quantum × weight.
    s.settle(class, &a, 20_000, 1);
    assert_eq!(s.deficit_of(class, &a), Some(5_000));
    // Charges use capped costs: 10^9 counts as max_charge (20,000).
    s.settle(class, &a, 1, 1_000_000_000);
    assert_eq!(s.deficit_of(class, &a), Some(5_000 - 19_999));
    s.settle(class, &a, 1, 1_000_000_000);
    assert_eq!(
        s.deficit_of(class, &a),
        Some(-20_000),
        "floored at -max_charge"
    );
    // A negative deficit needs top-ups first, then the item goes out.
    assert!(s.pop().is_some());
    // Inactive tenants and other classes are ignored.
    s.settle(Priority::Batch, &a, 1, 10_000);
    s.settle(class, &tid("nobody"), 10_000, 1);
    assert_eq!(s.active_tenants(Priority::Batch), 0);
    assert_eq!(s.active_tenants(class), 1);
}

#[test]
fn extreme_inputs_do_not_panic() {
    let config = SchedulerConfig::default()
        .with_quantum(u64::MAX)
        .with_max_charge_quanta(u32::MAX)
        .with_class_weights(ClassWeights {
            critical: u32::MAX,
            standard: u32::MAX,
            batch: u32::MAX,
        });
    let mut s = scheduler(config);
    for class in CLASSES {
        s.push(class, tid("a"), u32::MAX, u64::MAX, ()).ok();
        s.push(class, tid("b"), 0, 0, ()).ok();
    }
    s.settle(Priority::Critical, &tid("a"), 0, u64::MAX);
    s.settle(Priority::Critical, &tid("a"), u64::MAX, 0);
    assert_eq!(std::iter::from_fn(|| s.pop()).count(), 6);
}
