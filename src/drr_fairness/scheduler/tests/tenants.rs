use super::*;

const STD: Priority = Priority::Standard;

fn order_of(s: &mut Scheduler<()>, pops: usize) -> Vec<String> {
    (0..pops)
        .map_while(|_| s.pop_done())
        .map(|d| d.tenant.as_str().to_owned())
        .collect()
}

#[test]
fn paid_tier_weight_three_is_served_three_to_one() {
    let mut s = scheduler(SchedulerConfig::default());
    for _ in 0..1_000 {
        s.push(STD, tid("paid"), 3, 1_000, ()).ok();
        s.push(STD, tid("free"), 1, 1_000, ()).ok();
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
    assert!((ratio - 3.0).abs() < 0.01, "ratio {ratio}");
    // Three calls of the paid tenant to each one of the free, interleaved: never four
    // in a row.
    let order = order_of(&mut s, 40);
    assert!(
        !order.windows(4).any(|w| w.iter().all(|t| t == "paid")),
        "{order:?}"
    );
}

#[test]
fn backlogged_tenants_take_one_call_per_turn() {
    let mut s = scheduler(SchedulerConfig::default());
    for _ in 0..20 {
        for name in ["a", "b", "c"] {
            s.push(STD, tid(name), 1, 1_000, ()).ok();
        }
    }
    let order = order_of(&mut s, 60);
    let expected: Vec<String> = std::iter::repeat_n(["a", "b", "c"], 20)
        .flatten()
        .map(str::to_owned)
        .collect();
    assert_eq!(order, expected);
}

#[test]
fn a_newcomer_goes_after_those_already_at_the_virtual_time() {
    let mut s = scheduler(SchedulerConfig::default());
    for _ in 0..100 {
        s.push(STD, tid("a"), 1, 2_000, ()).ok();
        s.push(STD, tid("b"), 1, 5_000, ()).ok();
    }
    // a and b start at 0; a moves to 2,000 and b to 5,000: the virtual time is b's 0.
    assert_eq!(order_of(&mut s, 2), ["a", "b"]);
    // A newcomer starts at that virtual time: ahead of both.
    s.push(STD, tid("n"), 1, 1_000, ()).ok();
    assert_eq!(s.group_tag_of(STD, &tid("n")), Some(0.0));
    assert_eq!(order_of(&mut s, 3), ["n", "a", "a"]);
}

#[test]
fn a_tenant_that_comes_and_goes_cannot_push_in_front() {
    let mut s = scheduler(SchedulerConfig::default());
    for _ in 0..100 {
        s.push(STD, tid("h1"), 1, 1_000, ()).ok();
        s.push(STD, tid("h2"), 1, 1_000, ()).ok();
    }
    // l comes with one call after every pop, each finished at once: it is remembered at
    // its finish, so it takes one turn in three, not every other one.
    let mut order = Vec::new();
    for _ in 0..30 {
        if s.tenant_len(STD, &tid("l")) == 0 {
            s.push(STD, tid("l"), 1, 1_000, ()).ok();
        }
        order.push(s.pop_done().expect("backlogged").tenant.as_str().to_owned());
        s.check_invariants();
    }
    let light = order.iter().filter(|t| *t == "l").count();
    assert_eq!(light, 10, "{order:?}");
    assert!(!order.windows(2).any(|w| w[0] == "l" && w[1] == "l"));
}

#[test]
fn a_tenant_back_after_its_finish_was_reached_starts_at_the_virtual_time() {
    let mut s = scheduler(SchedulerConfig::default());
    for _ in 0..100 {
        s.push(STD, tid("h"), 1, 1_000, ()).ok();
    }
    s.push(STD, tid("l"), 1, 1_000, ()).ok();
    assert_eq!(order_of(&mut s, 2), ["h", "l"]);
    assert!(s.knows(STD, &tid("l")), "finished ahead: remembered");
    assert_eq!(order_of(&mut s, 1), ["h"]);
    assert!(
        !s.knows(STD, &tid("l")),
        "the virtual time reached it: forgotten"
    );
    // Away for 50 calls of h: no credit banked, no extra round either.
    assert_eq!(order_of(&mut s, 50).len(), 50);
    s.push(STD, tid("l"), 1, 1_000, ()).ok();
    assert_eq!(s.group_tag_of(STD, &tid("l")), Some(s.class_vtime(STD)));
    assert_eq!(order_of(&mut s, 3), ["l", "h", "h"]);
    s.check_invariants();
}

#[test]
fn a_tenant_in_flight_is_remembered_at_its_finish() {
    let mut s = scheduler(SchedulerConfig::default());
    for _ in 0..10 {
        s.push(STD, tid("h"), 1, 1_000, ()).ok();
    }
    s.push(STD, tid("l"), 1, 3_000, ()).ok();
    assert_eq!(s.pop_done().expect("waiting").tenant, tid("h"));
    let l = s.pop().expect("waiting");
    assert_eq!(l.tenant, tid("l"));
    assert_eq!(s.in_flight_of(STD, &tid("l")), Some(1));
    assert_eq!(s.group_tag_of(STD, &tid("l")), Some(3_000.0));
    // Back while its call runs: it starts at its finish, after h's next two.
    s.push(STD, tid("l"), 1, 1_000, ()).ok();
    assert_eq!(order_of(&mut s, 4), ["h", "h", "l", "h"]);
    s.complete(STD, &tid("l"));
    s.check_invariants();
}

#[test]
fn removal_that_empties_a_tenant_keeps_its_start_as_its_finish() {
    let mut s = scheduler(SchedulerConfig::default());
    for _ in 0..10 {
        s.push(STD, tid("h"), 1, 1_000, ()).ok();
    }
    s.push(STD, tid("m"), 1, 1_000, ()).ok();
    assert_eq!(s.pop_done().expect("waiting").tenant, tid("h"));
    assert_eq!(s.pop().expect("waiting").tenant, tid("m"));
    // Back while its call runs: it waits at its finish, 1,000.
    let key = s.push(STD, tid("m"), 1, 1_000, ()).expect("room");
    assert_eq!(s.group_tag_of(STD, &tid("m")), Some(1_000.0));
    assert_eq!(s.remove(key), Some(()));
    s.complete(STD, &tid("m"));
    // Not served: remembered where it was, and it comes back there, not later.
    assert_eq!(s.group_tag_of(STD, &tid("m")), Some(1_000.0));
    s.push(STD, tid("m"), 1, 1_000, ()).ok();
    assert_eq!(s.group_tag_of(STD, &tid("m")), Some(1_000.0));
    assert_eq!(order_of(&mut s, 3), ["h", "m", "h"]);
    s.check_invariants();
}

#[test]
fn giant_request_is_charged_at_most_max_charge() {
    let mut s = scheduler(SchedulerConfig::default());
    s.push(STD, tid("g"), 1, 10_000_000, ()).ok();
    for _ in 0..50 {
        s.push(STD, tid("g"), 1, 10_000_000, ()).ok();
        s.push(STD, tid("s"), 1, 1_000, ()).ok();
    }
    let first = s.pop_done().expect("waiting");
    assert_eq!((first.tenant.as_str(), first.cost), ("g", 20_000));
    // One giant call is worth 20 small ones, then the giant goes again.
    let order = order_of(&mut s, 22);
    assert!(order[..20].iter().all(|t| t == "s"), "{order:?}");
    assert_eq!(order[20], "g");
}

#[test]
fn direct_dispatches_are_charged_so_a_newcomer_goes_first() {
    let mut s: Scheduler<()> = scheduler(SchedulerConfig::default());
    for _ in 0..5 {
        assert_eq!(s.dispatch_direct(STD, tid("a"), 1, 1_000), Some(1_000));
    }
    assert!(s.is_empty());
    assert_eq!(s.group_tag_of(STD, &tid("a")), Some(5_000.0));
    s.push(STD, tid("a"), 1, 1_000, ()).ok();
    s.push(STD, tid("b"), 1, 1_000, ()).ok();
    assert_eq!(s.pop().expect("waiting").tenant, tid("b"));
    assert_eq!(s.pop().expect("waiting").tenant, tid("a"));
    // Never more than one largest charge (20,000) ahead of the virtual time.
    for _ in 0..50 {
        s.dispatch_direct(STD, tid("c"), 1, 1_000);
    }
    let ahead = s.group_tag_of(STD, &tid("c")).expect("in flight") - s.class_vtime(STD);
    assert!(ahead <= 20_000.0, "{ahead}");
    s.check_invariants();
}

#[test]
fn settlement_moves_the_tenant_by_what_the_call_took() {
    let mut s = scheduler(SchedulerConfig::default());
    let (a, b) = (tid("a"), tid("b"));
    for _ in 0..3 {
        s.push(STD, a.clone(), 1, 1_000, ()).ok();
        s.push(STD, b.clone(), 1, 1_000, ()).ok();
    }
    assert_eq!(s.pop().expect("waiting").tenant, a);
    assert_eq!(s.group_tag_of(STD, &a), Some(1_000.0));
    s.settle(STD, &a, 1_000, 3_000);
    assert_eq!(s.group_tag_of(STD, &a), Some(3_000.0));
    s.settle(STD, &a, 3_000, 1_500);
    assert_eq!(s.group_tag_of(STD, &a), Some(1_500.0));
    // A refund never moves it before the virtual time (0 here): no credit banked.
    s.settle(STD, &a, 20_000, 1);
    assert_eq!(s.group_tag_of(STD, &a), Some(0.0));
    // A charge uses capped costs, and never leaves it more than one largest charge
    // (20,000) ahead of the virtual time.
    s.settle(STD, &a, 1, 1_000_000_000);
    s.settle(STD, &a, 1, 1_000_000_000);
    assert_eq!(s.group_tag_of(STD, &a), Some(20_000.0));
    s.check_invariants();
    // Unknown tenants and other classes are ignored.
    s.settle(Priority::Batch, &a, 1, 10_000);
    s.settle(STD, &tid("nobody"), 10_000, 1);
    assert_eq!(s.active_tenants(STD), 2);
    assert_eq!(order_of(&mut s, 5), ["b", "b", "b", "a", "a"]);
}

#[test]
fn settling_a_newcomers_first_call_never_stretches_its_turn() {
    // Calls charged 1,038 that use 135: the refund moves a by what it used, so it is
    // not served twice while b waits.
    let mut s = scheduler(SchedulerConfig::default());
    for _ in 0..50 {
        s.push(STD, tid("a"), 1, 1_038, ()).ok();
        s.push(STD, tid("b"), 1, 1_038, ()).ok();
    }
    let mut order = Vec::new();
    for _ in 0..40 {
        let d = s.pop().expect("backlogged");
        s.settle(d.class, &d.tenant, 1_038, 135);
        s.complete(d.class, &d.tenant);
        order.push(d.tenant.as_str().to_owned());
    }
    assert!(
        !order.windows(3).any(|w| w[0] == w[1] && w[1] == w[2]),
        "{order:?}"
    );
    s.check_invariants();
}

#[test]
fn a_group_takes_one_share_whatever_its_number_of_tenants() {
    let mut s = scheduler(SchedulerConfig::default());
    let service = tid("service");
    for round in 0..20 {
        for user in 0..50 {
            s.push_in(
                STD,
                Some(&service),
                tid(&format!("u{user}")),
                1,
                1_000,
                round,
            )
            .ok();
        }
    }
    for round in 0..200 {
        s.push(STD, tid("plain"), 1, 1_000, round).ok();
    }
    let order: Vec<String> = (0..200)
        .map(|_| s.pop_done().expect("backlogged").tenant.as_str().to_owned())
        .collect();
    // The plain key every other call; the service's users in turn between.
    assert!(
        order.iter().skip(1).step_by(2).all(|t| t == "plain"),
        "{order:?}"
    );
    let users: Vec<&String> = order.iter().filter(|t| *t != "plain").collect();
    for (i, user) in users.iter().enumerate().take(50) {
        assert_eq!(**user, format!("u{i}"));
    }
    s.check_invariants();
}

#[test]
fn each_tenant_idle_ahead_is_forgotten_once_the_virtual_time_reaches_it() {
    let mut s = scheduler(SchedulerConfig::default());
    for _ in 0..200 {
        s.push(STD, tid("h"), 1, 1_000, ()).ok();
    }
    for i in 0..100 {
        s.push(STD, tid(&format!("l{i}")), 1, 1_000, ()).ok();
    }
    // h first (it came first), then the hundred light tenants, each remembered at its
    // finish once served, then forgotten as h's next call starts there.
    let order = order_of(&mut s, 101);
    assert_eq!(order.iter().filter(|t| *t != "h").count(), 100);
    assert_eq!(s.classes[1].groups.len(), 101);
    assert_eq!(s.classes[1].order.idle.len(), 100);
    assert_eq!(order_of(&mut s, 1), ["h"]);
    assert_eq!(s.classes[1].groups.len(), 1);
    assert_eq!(s.classes[1].tenants.len(), 1);
    s.check_invariants();
    // Inside a group, the same for its end users.
    let service = tid("service");
    for _ in 0..10 {
        s.push_in(STD, Some(&service), tid("busy"), 1, 1_000, ())
            .ok();
    }
    for i in 0..10 {
        s.push_in(STD, Some(&service), tid(&format!("u{i}")), 1, 1_000, ())
            .ok();
    }
    s.take_trace(STD);
    while s.tenant_len(STD, &tid("u9")) > 0 {
        s.pop_done();
    }
    assert_eq!(s.classes[1].tenants.len(), 12, "h, busy and ten idle users");
    while s.tenant_len(STD, &tid("busy")) == 9 {
        s.pop_done();
    }
    let forgotten = s
        .take_trace(STD)
        .into_iter()
        .filter(|v| matches!(v, Visit::Forget(_)))
        .count();
    assert_eq!(forgotten, 10);
    assert_eq!(s.classes[1].tenants.len(), 2);
    s.check_invariants();
}

// ---------- removal, memory, capacity ----------

#[test]
fn removed_entries_leave_no_tenant_state() {
    let mut s = scheduler(SchedulerConfig::default());
    let keys: Vec<Key> = (0..3)
        .map(|i| s.push(STD, tid("a"), 1, 100, i).expect("no limit"))
        .collect();
    let other = s
        .push(Priority::Critical, tid("a"), 1, 100, 9)
        .expect("no limit");
    assert_eq!(s.active_tenants(STD), 1);
    assert_eq!(s.remove(keys[1]), Some(1));
    assert_eq!(s.remove(keys[0]), Some(0));
    assert_eq!(s.remove(keys[2]), Some(2));
    assert_eq!(s.active_tenants(STD), 0);
    assert_eq!(s.class_len(STD), 0);
    assert_eq!(s.len(), 1);
    assert_eq!(s.remove(other), Some(9));
    assert!(s.is_empty());
    for class in CLASSES {
        let queue = &s.classes[class_index(class)];
        assert_eq!(queue.tenants.len() + queue.groups.len(), 0);
        assert!(!queue.order.waits() && queue.order.idle.is_empty());
    }
    assert!(s.entries.slots.is_empty());
    assert!(s.pop().is_none());
    s.check_invariants();
}

#[cfg(target_pointer_width = "64")]
#[test]
fn slab_slots_stay_compact() {
    assert_eq!(std::mem::size_of::<Option<Entry<u64>>>(), 40);
    assert_eq!(std::mem::size_of::<Option<Tenant>>(), 64);
}

#[test]
fn push_beyond_capacity_is_refused_without_change() {
    let mut s = scheduler(SchedulerConfig::default());
    s.entries.limit = 3;
    s.classes[1].tenants.limit = 2;
    s.push(STD, tid("a"), 1, 1, 1).expect("room");
    s.push(STD, tid("b"), 1, 1, 2).expect("room");
    // Tenant slab full: a third tenant is refused, a known one is not.
    assert_eq!(s.push(STD, tid("c"), 1, 1, 3), Err(Rejected::ClassFull(3)));
    s.push(STD, tid("a"), 1, 1, 4).expect("room");
    s.check_invariants();
    // Entry slab full: refused for any tenant, in any class.
    assert_eq!(s.push(STD, tid("b"), 1, 1, 5), Err(Rejected::ClassFull(5)));
    assert_eq!(
        s.push(Priority::Batch, tid("d"), 1, 1, 6),
        Err(Rejected::ClassFull(6))
    );
    assert_eq!(s.len(), 3);
    s.check_invariants();
    // A freed slot is reused.
    assert_eq!(s.pop().expect("waiting").item, 1);
    s.push(STD, tid("b"), 1, 1, 7).expect("a slot was freed");
    s.check_invariants();
    assert_eq!(std::iter::from_fn(|| s.pop().map(|d| d.item)).count(), 3);
    assert!(s.is_empty());
}

#[test]
fn a_drained_class_gives_back_memory_while_a_few_requests_are_in_flight() {
    let mut s: Scheduler<()> = scheduler(SchedulerConfig::default());
    // One request stays in flight throughout, as on a busy service.
    s.dispatch_direct(STD, tid("keeper"), 1, 1_000);
    for i in 0..5_000 {
        s.push(STD, tid(&format!("t{i}")), 1, 1_000, ()).ok();
    }
    assert!(s.classes[1].tenants.len() > 5_000);
    while s.pop_done().is_some() {}
    // Drained: only the keeper is left, in a slab of the retained size.
    let queue = &s.classes[1];
    assert_eq!(queue.tenants.len(), 1);
    assert_eq!(queue.groups.len(), 1);
    assert!(queue.tenants.slots.capacity() <= RETAINED_CAPACITY);
    assert_eq!(s.in_flight_of(STD, &tid("keeper")), Some(1));
    s.check_invariants();
    // Still found and charged as before, and forgotten when done.
    s.push(STD, tid("keeper"), 1, 1_000, ()).ok();
    assert!(s.pop_done().is_some());
    s.complete(STD, &tid("keeper"));
    assert_eq!(s.classes[1].tenants.len(), 0);
    s.check_invariants();
}

#[test]
fn direct_dispatch_beyond_tenant_capacity_is_not_recorded() {
    let mut s: Scheduler<()> = scheduler(SchedulerConfig::default());
    s.classes[1].tenants.limit = 1;
    assert_eq!(s.dispatch_direct(STD, tid("a"), 1, 1_000), Some(1_000));
    // No slot for b: nothing recorded, so its caller must not complete it.
    assert_eq!(s.dispatch_direct(STD, tid("b"), 1, 1_000), None);
    assert!(!s.knows(STD, &tid("b")));
    s.check_invariants();
    s.complete(STD, &tid("a"));
    assert!(!s.knows(STD, &tid("a")));
    assert_eq!(s.dispatch_direct(STD, tid("b"), 1, 1_000), Some(1_000));
    s.check_invariants();
}

#[test]
fn stale_key_after_reuse_removes_nothing() {
    let mut s = scheduler(SchedulerConfig::default());
    let keep = s.push(STD, tid("a"), 1, 1, "keep").expect("no limit");
    let first = s.push(STD, tid("a"), 1, 1, "first").expect("no limit");
    assert_eq!(s.remove(first), Some("first"));
    let second = s.push(STD, tid("a"), 1, 1, "second").expect("no limit");
    assert_eq!(first.index, second.index, "slot was reused");
    assert_eq!(s.remove(first), None);
    assert_eq!(s.len(), 2);
    // A popped item's key is stale too, even after a full drain.
    assert_eq!(s.pop().map(|d| d.item), Some("keep"));
    assert_eq!(s.pop().map(|d| d.item), Some("second"));
    let third = s.push(STD, tid("a"), 1, 1, "third").expect("no limit");
    assert_eq!(s.remove(keep), None);
    assert_eq!(s.remove(second), None);
    assert_eq!(s.remove(third), Some("third"));
    assert_eq!(s.remove(third), None);
}

#[test]
fn queue_limits_refuse_the_incoming_request() {
    let config = SchedulerConfig::default()
        .with_max_per_tenant(Some(2))
        .with_max_per_class(Some(3));
    let mut s = scheduler(config);
    s.push(STD, tid("a"), 1, 1, 1).expect("room");
    s.push(STD, tid("a"), 1, 1, 2).expect("room");
    let refused = s.push(STD, tid("a"), 1, 1, 3);
    assert_eq!(refused, Err(Rejected::TenantFull(3)));
    assert_eq!(refused.map_err(Rejected::into_inner), Err(3));
    s.push(STD, tid("b"), 1, 1, 4).expect("room");
    assert_eq!(s.push(STD, tid("c"), 1, 1, 5), Err(Rejected::ClassFull(5)));
    // The refusals changed nothing.
    assert_eq!(s.class_len(STD), 3);
    assert_eq!(s.active_tenants(STD), 2);
    // Other classes have their own limits.
    s.push(Priority::Batch, tid("a"), 1, 1, 6).expect("room");
    let order: Vec<i32> = std::iter::from_fn(|| s.pop().map(|d| d.item)).collect();
    assert_eq!(order.len(), 4);
    let standard: Vec<i32> = order.into_iter().filter(|&x| x != 6).collect();
    assert_eq!(standard, vec![1, 4, 2]);
    assert_eq!(Rejected::TenantFull(()).to_string(), "tenant queue is full");
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
        s.dispatch_direct(class, tid("c"), 1, u64::MAX);
    }
    s.settle(Priority::Critical, &tid("a"), 0, u64::MAX);
    s.settle(Priority::Critical, &tid("a"), u64::MAX, 0);
    s.settle(Priority::Critical, &tid("c"), 0, u64::MAX);
    assert_eq!(std::iter::from_fn(|| s.pop()).count(), 6);
    s.check_invariants();
}
