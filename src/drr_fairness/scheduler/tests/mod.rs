//! The scheduler's tests: helpers and invariants here, the properties, the choice between
//! classes and the order inside a class in their own files.

use super::class::{Tenant, Visit};
use super::slab::NONE;
use super::*;

mod classes;
mod properties;
mod tenants;

fn tid(name: &str) -> TenantId {
    TenantId::new(name)
}

fn scheduler<T>(config: SchedulerConfig) -> Scheduler<T> {
    Scheduler::new(config).expect("valid config")
}

fn ceil_div(a: u64, b: u64) -> u64 {
    a.div_ceil(b)
}

/// Equal costs, quantum = cost: plain round robin when nobody is skipped.
fn round_robin(tenants: &[&str], each: usize) -> Scheduler<(String, usize)> {
    let mut s = scheduler(SchedulerConfig::default().with_quantum(10));
    for i in 0..each {
        for name in tenants {
            s.push(Priority::Standard, tid(name), 1, 10, (name.to_string(), i))
                .unwrap();
        }
    }
    s
}

#[test]
fn a_skipped_tenant_keeps_its_place_and_goes_first_once_it_may() {
    let mut s = round_robin(&["a", "b", "c"], 2);
    let order: Vec<String> = std::iter::from_fn(|| {
        let next = s
            .next_where(Priority::Standard, |t, _| t.as_str() == "a")?
            .clone();
        s.pop_tenant(Priority::Standard, &next)
            .map(|d| d.tenant.as_str().to_owned())
    })
    .collect();
    assert_eq!(order, ["b", "c", "b", "c"]);
    // Only the skipped tenant is left, and a turn that can serve nobody ends.
    assert_eq!(s.len(), 2);
    assert!(s.next_where(Priority::Standard, |_, _| true).is_none());
    // Its items come out in order once it may go.
    let next = s.pop_class(Priority::Standard).unwrap();
    assert_eq!((next.tenant, next.item.1), (tid("a"), 0));
}

#[test]
fn the_next_tenant_is_told_its_waiting_items_and_pop_tenant_serves_it() {
    let mut s = round_robin(&["a", "b"], 2);
    let mut told = Vec::new();
    let first = s
        .next_where(Priority::Standard, |t, waiting| {
            told.push((t.clone(), waiting));
            false
        })
        .cloned();
    assert_eq!(first, Some(tid("a")));
    assert_eq!(told, [(tid("a"), 2)]);
    assert_eq!(s.len(), 4, "nothing taken");
    let served = s.pop_tenant(Priority::Standard, &tid("a")).unwrap();
    assert_eq!((served.tenant.clone(), served.item.1), (tid("a"), 0));
    // The order goes on as if `a` had been popped.
    let next = s.pop_class(Priority::Standard).unwrap();
    assert_eq!(next.tenant, tid("b"));
    assert!(s.pop_tenant(Priority::Batch, &tid("a")).is_none());
    assert!(s.pop_tenant(Priority::Standard, &tid("z")).is_none());
    s.complete(Priority::Standard, &tid("a"));
    s.complete(Priority::Standard, &tid("b"));
}

impl<T> Scheduler<T> {
    fn take_trace(&mut self, class: Priority) -> Vec<Visit> {
        std::mem::take(&mut self.classes[class_index(class)].trace)
    }

    fn in_flight_of(&self, class: Priority, tenant: &TenantId) -> Option<u32> {
        let queue = &self.classes[class_index(class)];
        queue.tenant(queue.lookup(tenant)?).map(|x| x.in_flight)
    }

    /// `tenant`'s group's tag in the class's order (for a tenant of no group, its own
    /// place between the class's tenants), if the class knows the group.
    fn group_tag_of(&self, class: Priority, group: &TenantId) -> Option<f64> {
        let queue = &self.classes[class_index(class)];
        Some(tokens(queue.groups.get(queue.groups.find(group)?)?.tag))
    }

    /// The virtual time of the class's order of groups, in tokens.
    fn class_vtime(&self, class: Priority) -> f64 {
        tokens(self.classes[class_index(class)].order.vtime)
    }

    /// Whether the class remembers `tenant`, or the group of that name.
    fn knows(&self, class: Priority, tenant: &TenantId) -> bool {
        let queue = &self.classes[class_index(class)];
        queue.lookup(tenant).is_some() || queue.groups.find(tenant).is_some()
    }

    /// Pops and completes at once, as if every request finished instantly.
    fn pop_done(&mut self) -> Option<Dispatched<T>> {
        let d = self.pop()?;
        self.complete(d.class, &d.tenant);
        Some(d)
    }

    /// Internal consistency: orders, slabs and counts agree.
    fn check_invariants(&self) {
        let mut total = 0;
        for (class, queue) in self.classes.iter().enumerate() {
            let (mut busy, mut items) = (0, 0);
            for (t, tenant) in queue.tenants.iter() {
                assert_eq!(queue.lookup(&tenant.id), Some(t));
                let group = queue.groups.get(tenant.group).expect("its group is known");
                let order = &group.tenants;
                let (mut e, mut last, mut count) = (tenant.head, NONE, 0);
                while e != NONE {
                    let entry = self.entries.get(e).expect("entry exists");
                    assert_eq!(entry.tenant, t);
                    assert_eq!(entry.class, CLASSES[class]);
                    if e != tenant.head {
                        // A head's `prev` may be stale; no other's.
                        assert_eq!(entry.prev, last);
                    }
                    count += 1;
                    last = e;
                    e = entry.next;
                }
                assert_eq!(tenant.tail, last);
                assert_eq!(count, tenant.len as usize);
                items += count;
                if tenant.len > 0 {
                    busy += 1;
                    assert!(order.holds(&(tenant.tag, tenant.tie, t)));
                    assert!(
                        tenant.tag >= order.vtime,
                        "nobody waits before the virtual time"
                    );
                } else if tenant.in_flight == 0 {
                    assert!(
                        order.idle.contains(&(tenant.tag, t)),
                        "a tenant with nothing waiting or in flight is remembered idle"
                    );
                    assert!(tenant.tag > order.vtime);
                }
            }
            for (g, group) in queue.groups.iter() {
                let members: Vec<&Tenant> = queue
                    .tenants
                    .iter()
                    .filter(|(_, t)| t.group == g)
                    .map(|(_, t)| t)
                    .collect();
                assert_eq!(group.known as usize, members.len());
                let in_flight: u32 = members.iter().map(|t| t.in_flight).sum();
                assert_eq!(group.in_flight, in_flight);
                let waiting = members.iter().filter(|t| t.len > 0).count();
                assert_eq!(group.tenants.live(), waiting);
                assert_eq!(
                    group.tenants.idle.len(),
                    members
                        .iter()
                        .filter(|t| t.len == 0 && t.in_flight == 0)
                        .count()
                );
                if group.waits() {
                    assert!(queue.order.holds(&(group.tag, group.tie, g)));
                    assert!(group.tag >= queue.order.vtime);
                } else {
                    assert!(
                        group.tenants.idle.is_empty(),
                        "a group that waits not remembers no idle tenant"
                    );
                    if group.known == 0 {
                        assert!(queue.order.idle.contains(&(group.tag, g)));
                        assert!(group.tag > queue.order.vtime);
                    }
                }
            }
            let waiting_groups = queue.groups.iter().filter(|(_, g)| g.waits()).count();
            assert_eq!(queue.order.live(), waiting_groups);
            assert_eq!(
                queue.order.idle.len(),
                queue
                    .groups
                    .iter()
                    .filter(|(_, g)| !g.waits() && g.known == 0)
                    .count()
            );
            assert_eq!(busy, queue.busy);
            assert_eq!(items, queue.len);
            if queue.len == 0 && queue.tenants.len() == 0 {
                assert!(
                    queue.order.idle.is_empty(),
                    "a class with nothing waiting or in flight remembers nobody idle"
                );
            }
            total += items;
        }
        assert_eq!(total, self.len);
        assert_eq!(self.entries.slots.iter().flatten().count(), self.len);
    }
}

/// A virtual time in tokens per unit of weight.
fn tokens(vtime: super::order::VTime) -> f64 {
    vtime as f64 / f64::from(1u32 << 31) / 2.0
}

fn tenant_number(id: &TenantId) -> usize {
    id.as_str()[1..].parse().expect("test tenant name")
}
