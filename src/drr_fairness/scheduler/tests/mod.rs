//! The scheduler's tests: helpers and invariants here, the properties, the choice between
//! classes and the order inside a class in their own files.

use super::class::{ListKind, Tenant, Visit};
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
fn skipped_tenant_loses_its_turn_not_its_place_in_the_queue() {
    let mut s = round_robin(&["a", "b", "c"], 2);
    let order: Vec<String> = std::iter::from_fn(|| {
        s.pop_class_where(Priority::Standard, |t| match t.as_str() {
            "a" => Pick::Skip,
            _ => Pick::Take,
        })
        .map(|d| d.tenant.as_str().to_owned())
    })
    .collect();
    assert_eq!(order, ["b", "c", "b", "c"]);
    // Only the skipped tenant is left, and a pop that can serve nobody ends.
    assert_eq!(s.len(), 2);
    assert!(
        s.pop_class_where(Priority::Standard, |_| Pick::Skip)
            .is_none()
    );
    // Its items come out in order once it may go.
    let next = s.pop_class(Priority::Standard).unwrap();
    assert_eq!((next.tenant, next.item.1), (tid("a"), 0));
}

#[test]
fn stop_leaves_the_tenant_first_and_pop_tenant_serves_it() {
    let mut s = round_robin(&["a", "b"], 2);
    let mut first = None;
    let none = s.pop_class_where(Priority::Standard, |t| {
        first = Some(t.clone());
        Pick::Stop
    });
    assert!(none.is_none());
    assert_eq!(first, Some(tid("a")));
    assert_eq!(s.len(), 4);
    let served = s.pop_tenant(Priority::Standard, &tid("a")).unwrap();
    assert_eq!((served.tenant.clone(), served.item.1), (tid("a"), 0));
    // The round goes on as if `a` had been popped.
    let next = s.pop_class(Priority::Standard).unwrap();
    assert_eq!(next.tenant, tid("b"));
    assert!(s.pop_tenant(Priority::Batch, &tid("a")).is_none());
    assert!(s.pop_tenant(Priority::Standard, &tid("z")).is_none());
    s.complete(Priority::Standard, &tid("a"));
    s.complete(Priority::Standard, &tid("b"));
}

impl<T> Scheduler<T> {
    fn deficit_of(&self, class: Priority, tenant: &TenantId) -> Option<i64> {
        let queue = &self.classes[class_index(class)];
        let t = queue.lookup(tenant).1?;
        queue.tenant(t).map(|x| x.deficit)
    }

    fn take_trace(&mut self, class: Priority) -> Vec<Visit> {
        std::mem::take(&mut self.classes[class_index(class)].trace)
    }

    /// The list `tenant` is on in `class`, `None` if it is not listed.
    fn list_of(&self, class: Priority, tenant: &TenantId) -> Option<ListKind> {
        let queue = &self.classes[class_index(class)];
        queue.tenant(queue.lookup(tenant).1?)?.list
    }

    fn in_flight_of(&self, class: Priority, tenant: &TenantId) -> Option<u32> {
        let queue = &self.classes[class_index(class)];
        queue.tenant(queue.lookup(tenant).1?).map(|x| x.in_flight)
    }

    /// Whether `tenant` is known in `class` but on no list (parked).
    fn is_parked(&self, class: Priority, tenant: &TenantId) -> bool {
        let queue = &self.classes[class_index(class)];
        queue
            .lookup(tenant)
            .1
            .and_then(|t| queue.tenant(t))
            .is_some_and(|x| x.list.is_none())
    }

    /// Pops and completes at once, as if every request finished instantly.
    fn pop_done(&mut self) -> Option<Dispatched<T>> {
        let d = self.pop()?;
        self.complete(d.class, &d.tenant);
        Some(d)
    }

    /// Internal consistency: lists, slabs and counts agree.
    fn check_invariants(&self) {
        let mut total = 0;
        for (class, queue) in self.classes.iter().enumerate() {
            let (mut seen, mut busy, mut items) = (0, 0, 0);
            for (kind, list) in [(ListKind::New, queue.new), (ListKind::Old, queue.old)] {
                let mut cursor = list.head;
                let mut prev = NONE;
                while cursor != NONE {
                    let t = cursor;
                    let tenant = queue.tenant(t).expect("listed tenant exists");
                    assert_eq!(tenant.prev, prev);
                    assert_eq!(tenant.list, Some(kind));
                    assert!(
                        tenant.len > 0 || kind == ListKind::Old,
                        "only `old` holds empty tenants"
                    );
                    busy += usize::from(tenant.len > 0);
                    assert_eq!(queue.lookup(&tenant.id).1, Some(t));
                    let (mut e, mut last) = (tenant.head, NONE);
                    let mut count = 0;
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
                    seen += 1;
                    prev = cursor;
                    cursor = tenant.next;
                }
                assert_eq!(list.tail, prev);
            }
            let parked: Vec<&Tenant> = queue
                .tenants
                .iter()
                .flatten()
                .filter(|x| x.list.is_none())
                .collect();
            for tenant in &parked {
                assert_eq!(tenant.len, 0, "a parked tenant has nothing waiting");
                assert!(tenant.in_flight > 0, "a parked tenant has work in flight");
                assert!(tenant.deficit <= 0, "a parked tenant banks no credit");
            }
            assert_eq!(parked.len(), queue.parked);
            assert_eq!(seen + parked.len(), queue.index.len());
            assert_eq!(seen + parked.len(), queue.tenants.iter().flatten().count());
            assert_eq!(busy, queue.busy);
            assert_eq!(items, queue.len);
            if queue.len == 0 {
                assert_eq!(seen, 0, "a drained class lists nobody");
            }
            total += items;
        }
        assert_eq!(total, self.len);
        assert_eq!(self.entries.slots.iter().flatten().count(), self.len);
    }
}

fn tenant_number(id: &TenantId) -> usize {
    id.as_str()[1..].parse().expect("test tenant name")
}
