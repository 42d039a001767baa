//! The in-process fair order (the `Scheduler`) against the fleet's (`order_model.rs`, which
//! `order_differential.rs` holds to the slot scripts): the same arrivals of calls of
//! tenants, some the end users of a group, some groups of their own, and one slot given
//! back and taken again call by call, so each freed slot goes to the flow whose turn it is.
//!
//! Both are start-time fair queuing at two levels (groups, then the tenants of a group),
//! a member that starts waiting starting at the virtual time or at its own last finish if
//! later, remembered at its finish until the virtual time reaches it. They differ only in
//! how they break a tie of start tags: the fleet's order takes the smaller name (a sorted
//! set's order), the scheduler the member that started waiting first. With ties broken by
//! name, the scheduler serves exactly the fleet's order, call by call (the test below).
//! First come, first served is what keeps a waiting tenant's bound of one turn of each
//! tenant waiting when it arrived (`a_new_tenant_is_served_within_one_turn_of_each_waiting_
//! tenant`): by name, a stream of newcomers at the same tag with smaller names would go
//! before it. Where the two differ, a tie's order changes which tenant goes first, and so
//! which one empties and comes back when; each order keeps its own bounds.

use std::collections::HashMap;

use proptest::prelude::*;

use super::order_model::{Acquired, Ask, Caps, Model};
use crate::drr_fairness::{Scheduler, SchedulerConfig};
use crate::{Priority, TenantId};

/// Tenants, their groups (`""`: a group of its own) and the cost of their calls.
const TENANTS: [(&str, &str, u64); 7] = [
    ("svc-a/u1", "svc-a", 300),
    ("svc-a/u2", "svc-a", 900),
    ("svc-a/u3", "svc-a", 300),
    ("svc-b/u1", "svc-b", 1_000),
    ("svc-b/u2", "svc-b", 400),
    ("team-c", "", 700),
    ("team-d", "", 1_000),
];

const CAPS: Caps = Caps {
    global: 1,
    tier: 1,
    weight: 1,
    class_weight: 1,
};

#[derive(Clone, Debug)]
enum Step {
    /// One more call of a tenant (by its index in `TENANTS`).
    Arrive(usize),
    /// The call holding the slot ends: the slot goes to the next call in each order.
    Serve,
}

/// The fleet's order driven as its workers drive it: the slot is held by one call at a
/// time, every arrival is refused and queued, and each release wakes the flow whose turn
/// it is, whose worker takes the slot with the wake-up's token.
struct Fleet {
    model: Model,
    /// Calls each tenant's worker holds, waiting.
    waiting: HashMap<usize, u32>,
    lease: u64,
}

impl Fleet {
    fn new() -> Fleet {
        let names = TENANTS.iter().map(|t| t.0).chain(["holder"]);
        let mut model = Model::new(1, names);
        let first = ask(usize::MAX, 1);
        assert_eq!(model.acquire(&first, "lease-0", None), Acquired::Taken);
        Fleet {
            model,
            waiting: HashMap::new(),
            lease: 0,
        }
    }

    fn arrive(&mut self, tenant: usize) {
        let calls = self.waiting.entry(tenant).or_default();
        *calls += 1;
        let acquired = self.model.acquire(&ask(tenant, *calls), "refused", None);
        assert_eq!(acquired, Acquired::Refused, "the slot is held");
    }

    /// The slot is given back: the tenant it goes to, if a call waits.
    fn serve(&mut self) -> Option<usize> {
        let held = format!("lease-{}", self.lease);
        let (removed, woken) = self.model.release(Some(&held), None, None);
        assert!(removed);
        self.lease += 1;
        let lease = format!("lease-{}", self.lease);
        let Some(((_, _, name), token)) = woken else {
            // Nobody waits: the holder takes the slot again.
            let taken = self.model.acquire(&ask(usize::MAX, 1), &lease, None);
            assert_eq!(taken, Acquired::Taken);
            return None;
        };
        let tenant = TENANTS.iter().position(|t| t.0 == name)?;
        let calls = self.waiting.get_mut(&tenant)?;
        let taken = self
            .model
            .acquire(&ask(tenant, *calls), &lease, Some(token));
        assert_eq!(taken, Acquired::Taken, "the woken worker takes its slot");
        *calls -= 1;
        Some(tenant)
    }
}

/// The acquire of `tenant`'s worker holding `calls` calls (`usize::MAX`: the holder).
fn ask(tenant: usize, calls: u32) -> Ask {
    let (name, group, cost) = TENANTS.get(tenant).copied().unwrap_or(("holder", "", 1));
    Ask {
        flow: (0, 1, name.to_owned()),
        group,
        calls,
        cost,
        caps: CAPS,
    }
}

/// A name's rank in name order, among the tenants' and groups' names.
fn rank(name: &TenantId) -> u64 {
    let mut names: Vec<&str> = TENANTS.iter().flat_map(|t| [t.0, t.1]).collect();
    names.sort_unstable();
    names
        .iter()
        .position(|n| *n == name.as_str())
        .unwrap_or(usize::MAX) as u64
}

fn steps() -> impl Strategy<Value = Vec<Step>> {
    prop::collection::vec(
        prop_oneof![
            3 => (0..TENANTS.len()).prop_map(Step::Arrive),
            2 => Just(Step::Serve),
        ],
        1..400,
    )
}

proptest! {
    #[test]
    fn with_ties_by_name_the_scheduler_serves_the_fleets_order_call_by_call(
        steps in steps()
    ) {
        let mut fleet = Fleet::new();
        let mut local: Scheduler<()> =
            Scheduler::new(SchedulerConfig::default().with_max_charge_quanta(1)).unwrap();
        local.tie_by_name(rank);
        // The call holding the slot: it ends when the next is served, as a lease does.
        let mut in_flight: Option<TenantId> = None;
        for step in steps {
            match step {
                Step::Arrive(t) => {
                    let (name, group, cost) = TENANTS[t];
                    fleet.arrive(t);
                    let group = (!group.is_empty()).then(|| TenantId::new(group));
                    local
                        .push_in(Priority::Standard, group.as_ref(), TenantId::new(name), 1, cost, ())
                        .unwrap();
                }
                Step::Serve => {
                    let served = fleet.serve();
                    if let Some(tenant) = in_flight.take() {
                        local.complete(Priority::Standard, &tenant);
                    }
                    let popped = local.pop().map(|d| {
                        let t = TENANTS.iter().position(|t| t.0 == d.tenant.as_str()).unwrap();
                        in_flight = Some(d.tenant);
                        t
                    });
                    prop_assert_eq!(served, popped, "the same tenant's call goes");
                }
            }
        }
    }
}
