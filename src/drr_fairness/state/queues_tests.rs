//! The fair queue's core without IO: the order's decisions checked on the queues alone, no
//! runtime, no store, no gate (a gate's answer is what the test hands over).

use std::time::Duration;

use proptest::prelude::*;
use tokio::time::Instant;

use super::effects::AfterUnlock;
use super::queues::{Arrival, Handout, Queues, Waiter};
use crate::admission::TierLimit;
use crate::drr_fairness::fairness::FairnessWindow;
use crate::drr_fairness::scheduler::SchedulerConfig;
use crate::store::SlotWake;
use crate::{Priority, TenantId, Tier};

const COST: u64 = 100;

fn queues() -> Queues {
    Queues::new(
        &SchedulerConfig::default(),
        FairnessWindow::new(Duration::from_secs(10)),
    )
    .expect("valid config")
}

fn limit() -> TierLimit {
    TierLimit::new(10, Duration::from_secs(10))
}

/// The group of `tier` (and `service`, a group of its own beside the tier's others).
fn group(q: &mut Queues, tier: &str, service: Option<&str>) -> usize {
    let tier = Tier::new(tier);
    let named = service.map(|name| (tier.clone(), TenantId::new(name)));
    q.group_for(&tier, limit(), named, &SchedulerConfig::default())
        .expect("valid config")
}

fn waiter(class: Priority, weight: u32) -> Waiter {
    Waiter {
        waker: None,
        weight,
        id: 0,
        key: None,
        cost: 0,
        class,
        arrived: Instant::now(),
        group: None,
    }
}

/// Queues `n` requests of `tenant` in `group`, of the tier weight `weight`.
fn push(q: &mut Queues, group: usize, class: Priority, tenant: &str, weight: u32, n: usize) {
    for _ in 0..n {
        let arrival = Arrival {
            group,
            class,
            tenant: TenantId::new(tenant),
            named: None,
            weight,
            cost: COST,
        };
        q.push(arrival, waiter(class, weight), None, false)
            .expect("room");
    }
}

/// One turn of the fair order with every gate open: the group picked gets the window place.
fn dispatch_one(q: &mut Queues) -> Option<(Priority, usize)> {
    let (class, group) = q.pick(&[])?;
    let handout = Handout {
        lease: None,
        rate: None,
        target: None,
    };
    q.hand_next(
        group,
        class,
        handout,
        Instant::now(),
        &mut AfterUnlock::default(),
    );
    Some((class, group))
}

proptest! {
    /// Start-time fair queuing between tiers: while every tier is backlogged, their virtual
    /// times (cost served over weight) stay within one step of each other, whatever their
    /// number of tenants, so each tier's share is its weight's.
    #[test]
    fn backlogged_tiers_share_by_weight_whatever_their_number_of_tenants(
        tiers in proptest::collection::vec((1u32..6, 1usize..30), 2..5),
        turns in 10usize..300,
    ) {
        let mut q = queues();
        let mut groups = Vec::new();
        for (i, &(weight, tenants)) in tiers.iter().enumerate() {
            let g = group(&mut q, &format!("tier{i}"), None);
            for t in 0..tenants {
                push(&mut q, g, Priority::Standard, &format!("t{i}-{t}"), weight, 400);
            }
            groups.push((g, weight));
        }
        let mut served = vec![0u64; q.groups.len()];
        for _ in 0..turns {
            let (_, g) = dispatch_one(&mut q).expect("backlogged");
            served[g] += 1;
        }
        let ci = Priority::Standard as usize;
        let times: Vec<f64> = groups.iter().map(|&(g, _)| q.groups[g].vtime[ci]).collect();
        let spread = times.iter().cloned().fold(f64::MIN, f64::max)
            - times.iter().cloned().fold(f64::MAX, f64::min);
        let step = groups.iter().map(|&(_, w)| COST as f64 / f64::from(w)).fold(0.0, f64::max);
        prop_assert!(spread <= step + 1e-9, "virtual times {times:?} spread {spread} > {step}");
        // Served counts, in turns: each tier's within one turn of its weight's share.
        let total_weight: u32 = groups.iter().map(|&(_, w)| w).sum();
        for &(g, w) in &groups {
            let fair = turns as f64 * f64::from(w) / f64::from(total_weight);
            prop_assert!(
                (served[g] as f64 - fair).abs() <= groups.len() as f64,
                "tier of weight {w} served {} of {turns}, fair {fair:.1}", served[g]
            );
        }
        prop_assert_eq!(q.in_flight, turns);
    }

    /// Groups (services) of one tier go in turn, whatever their number of tenants: one
    /// user of one service against many users of another.
    #[test]
    fn groups_of_a_tier_go_in_turn_whatever_their_number_of_users(
        many in 1usize..200,
        turns in 2usize..200,
    ) {
        let mut q = queues();
        let crowd = group(&mut q, "pro", Some("svc-crowd"));
        let single = group(&mut q, "pro", Some("svc-single"));
        for u in 0..many {
            push(&mut q, crowd, Priority::Standard, &format!("svc-crowd/u{u}"), 3, 3);
        }
        push(&mut q, single, Priority::Standard, "svc-single/u0", 3, 600);
        let mut served = [0usize; 2];
        for _ in 0..turns.min(many * 3) {
            let (_, g) = dispatch_one(&mut q).expect("backlogged");
            served[usize::from(g == single)] += 1;
        }
        prop_assert!(served[0].abs_diff(served[1]) <= 1, "served {served:?}");
    }

    /// Whose turn it is inside a group passes over the tenants held at their cap or with an
    /// acquire under way for each of their calls waiting (two each here), takes nothing, and
    /// is `None` only when every tenant waiting is one of those.
    #[test]
    fn the_next_tenant_is_never_one_held_back(
        held in proptest::collection::vec(any::<bool>(), 1..12),
        acquiring in proptest::collection::vec(0..=2usize, 12),
    ) {
        let mut q = queues();
        let g = group(&mut q, "free", None);
        for (t, _) in held.iter().enumerate() {
            push(&mut q, g, Priority::Standard, &format!("t{t}"), 1, 2);
        }
        let slots = q.groups[g].slots.as_mut().expect("gated");
        for (t, &h) in held.iter().enumerate() {
            if h {
                slots.held_tenants.insert(TenantId::new(format!("t{t}")));
            } else if acquiring[t] > 0 {
                slots.acquiring_for.insert(TenantId::new(format!("t{t}")), acquiring[t]);
            }
        }
        let free = held.iter().zip(&acquiring).any(|(&h, &a)| !h && a < 2);
        let len = q.groups[g].scheduler.len();
        let next = q.groups[g].next_tenant(Priority::Standard);
        prop_assert_eq!(next.is_some(), free);
        if let Some(tenant) = next {
            let slots = q.groups[g].slots.as_ref().expect("gated");
            prop_assert!(!slots.held_tenants.contains(&tenant));
            prop_assert!(slots.acquiring_for.get(&tenant).is_none_or(|&n| n < 2));
        }
        prop_assert_eq!(q.groups[g].scheduler.len(), len);
    }

    /// The fleet's wake-ups: one for a flow with a call waiting here is owed an acquire; one
    /// for a flow with none is passed on, leaving the flow; wake-ups for a tier beyond the
    /// calls no acquire is on its way for are passed on, and the rest let that many acquires
    /// go at once.
    #[test]
    fn wakes_are_owed_to_waiting_flows_and_passed_on_beyond_them(
        waiting in proptest::collection::vec(0usize..3, 1..6),
        flow_wakes in proptest::collection::vec(0usize..8, 0..10),
        tier_wakes in 0usize..12,
        acquiring in 0usize..4,
    ) {
        let mut q = queues();
        let g = group(&mut q, "pro", None);
        for (t, &n) in waiting.iter().enumerate() {
            push(&mut q, g, Priority::Standard, &format!("t{t}"), 3, n);
        }
        q.groups[g].slots.as_mut().expect("gated").acquiring = acquiring;
        let tier = Tier::new("pro");
        let mut wakes: Vec<SlotWake> = flow_wakes
            .iter()
            .map(|&t| SlotWake {
                tier: tier.clone(),
                flow: Some((Priority::Standard, TenantId::new(format!("t{t}")))),
            })
            .collect();
        wakes.extend((0..tier_wakes).map(|_| SlotWake { tier: tier.clone(), flow: None }));
        let mut declined = Vec::new();
        q.woken(wakes, &mut declined);
        let waits = |t: usize| waiting.get(t).is_some_and(|&n| n > 0);
        let owed = flow_wakes.iter().filter(|&&t| waits(t)).count();
        let slots = q.groups[g].slots.as_ref().expect("gated");
        prop_assert_eq!(slots.owed.len(), owed);
        let flows_declined: Vec<_> = declined.iter().filter(|d| !d.flow.ends_with('|')).collect();
        prop_assert_eq!(flows_declined.len(), flow_wakes.len() - owed);
        prop_assert!(flows_declined.iter().all(|d| d.leave && d.n == 1));
        let total: usize = waiting.iter().sum();
        let usable = tier_wakes.min(total.saturating_sub(acquiring));
        let passed: usize = declined.iter().filter(|d| d.flow.ends_with('|')).map(|d| d.n).sum();
        prop_assert_eq!(passed, tier_wakes - usable);
        if usable > 0 {
            prop_assert!(!slots.blocked);
            prop_assert!(slots.at_once >= usable);
        }
    }
}

#[test]
fn a_group_that_waited_for_nothing_banks_no_credit() {
    let mut q = queues();
    let early = group(&mut q, "pro", None);
    let late = group(&mut q, "free", None);
    push(&mut q, early, Priority::Standard, "a", 1, 500);
    for _ in 0..200 {
        assert_eq!(dispatch_one(&mut q), Some((Priority::Standard, early)));
    }
    // `late` arrives after 200 turns of `early` alone: it starts level, not 200 behind.
    push(&mut q, late, Priority::Standard, "b", 1, 500);
    let mut served = [0usize; 2];
    for _ in 0..40 {
        let (_, g) = dispatch_one(&mut q).expect("backlogged");
        served[usize::from(g == late)] += 1;
    }
    assert!(served[0].abs_diff(served[1]) <= 1, "served {served:?}");
}

#[test]
fn blocking_queues_each_waiting_flow_once_in_the_fleet_order() {
    let mut q = queues();
    let g = group(&mut q, "pro", None);
    push(&mut q, g, Priority::Standard, "a", 3, 2);
    push(&mut q, g, Priority::Batch, "a", 3, 1);
    push(&mut q, g, Priority::Standard, "b", 3, 1);
    q.groups[g]
        .slots
        .as_mut()
        .expect("gated")
        .queued
        .insert((Priority::Standard, TenantId::new("b")));
    let mut after = AfterUnlock::default();
    q.block(g, true, &mut after);
    assert!(after.watch, "the first block starts the watcher");
    let slots = q.groups[g].slots.as_ref().expect("gated");
    let mut flows: Vec<_> = slots.to_queue.iter().cloned().collect();
    flows.sort();
    assert_eq!(
        flows,
        [
            (Priority::Standard, TenantId::new("a")),
            (Priority::Batch, TenantId::new("a")),
        ]
    );
    assert!(slots.blocked);
    assert_eq!(slots.at_once, 1);
    // Blocked already: nothing queued twice, no second watcher.
    let mut again = AfterUnlock::default();
    q.block(g, true, &mut again);
    assert_eq!(q.groups[g].slots.as_ref().expect("gated").to_queue.len(), 2);
    assert!(!again.watch);
    // Outside the fleet's order nothing is queued in a store.
    let other = group(&mut q, "free", None);
    push(&mut q, other, Priority::Standard, "c", 1, 1);
    q.block(other, false, &mut AfterUnlock::default());
    assert!(
        q.groups[other]
            .slots
            .as_ref()
            .expect("gated")
            .to_queue
            .is_empty()
    );
}

#[test]
fn a_full_tier_that_nothing_will_wake_queues_its_flows_again() {
    let mut q = queues();
    let g = group(&mut q, "pro", None);
    push(&mut q, g, Priority::Standard, "a", 3, 1);
    push(&mut q, g, Priority::Critical, "b", 3, 1);
    q.groups[g].slots.as_mut().expect("gated").blocked = true;
    q.groups[g].requeue_if_lost();
    assert_eq!(q.groups[g].slots.as_ref().expect("gated").to_queue.len(), 2);
    // Something will wake it (a flow queued): nothing queued again.
    let slots = q.groups[g].slots.as_mut().expect("gated");
    slots.to_queue.clear();
    slots
        .queued
        .insert((Priority::Standard, TenantId::new("a")));
    q.groups[g].requeue_if_lost();
    assert!(
        q.groups[g]
            .slots
            .as_ref()
            .expect("gated")
            .to_queue
            .is_empty()
    );
}

#[test]
fn a_slot_taken_for_a_tenant_goes_to_it_or_back() {
    let mut q = queues();
    let g = group(&mut q, "pro", None);
    push(&mut q, g, Priority::Standard, "a", 3, 1);
    push(&mut q, g, Priority::Batch, "b", 3, 1);
    // Taken for `b` in the standard class: `b`'s call (batch by now) gets it.
    let handout = |target: &str| Handout {
        lease: None,
        rate: None,
        target: Some(TenantId::new(target)),
    };
    let mut after = AfterUnlock::default();
    q.hand_next(
        g,
        Priority::Standard,
        handout("b"),
        Instant::now(),
        &mut after,
    );
    assert_eq!(
        q.groups[g]
            .scheduler
            .tenant_len(Priority::Batch, &TenantId::new("b")),
        0
    );
    assert_eq!(q.groups[g].scheduler.len(), 1);
    assert_eq!(
        after.served.first.as_ref().map(|s| s.0.clone()),
        Some(TenantId::new("b"))
    );
    // Taken for a tenant with nothing left here: it goes back, and nobody else gets it.
    let mut after = AfterUnlock::default();
    q.hand_next(
        g,
        Priority::Standard,
        handout("gone"),
        Instant::now(),
        &mut after,
    );
    assert_eq!(after.drop_handed.len(), 1);
    assert_eq!(q.groups[g].scheduler.len(), 1);
    assert_eq!(q.in_flight, 1);
}

#[test]
fn a_queue_limit_refuses_the_newcomer_and_keeps_the_queue() {
    let mut q = queues();
    let g = group(&mut q, "pro", None);
    push(&mut q, g, Priority::Standard, "a", 3, 2);
    let arrival = Arrival {
        group: g,
        class: Priority::Standard,
        tenant: TenantId::new("b"),
        named: None,
        weight: 3,
        cost: COST,
    };
    let refused = q.push(arrival, waiter(Priority::Standard, 3), Some(2), false);
    assert!(refused.is_err());
    assert_eq!(q.len(), 2);
}
