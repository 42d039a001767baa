//! Per-tenant tables that forget their dead entries a few at a time and give memory back.
//!
//! Every in-process table keyed by tenant (demotion state, served cost, the fairness window)
//! is one of these. One `retain` over a whole map, under the lock every caller takes, would
//! with a million tenants pause callers 20 ms once a second and 200 ms when the UTC day rolls
//! over, a growing map would rehash for 200 ms, and the memory of the million would never
//! come back (`retain` does not shrink). Instead:
//! - a table is split into [`SHARDS`] shards by the tenant's hash, so growing one rehashes
//!   a 1/256th of the tenants (each entry keeps its hash, so a rehash reads it instead of
//!   hashing the name again);
//! - one call in [`SWEEP_EVERY`] sweeps at most [`SWEEP_BUDGET`] buckets of the shard being
//!   swept, from where the last sweep stopped (a cursor over bucket indices: removing an
//!   entry moves no other), then the next shard, so no call does more than a bounded amount
//!   of cleanup, and every entry is visited once per pass whatever tenants the traffic is
//!   about (the calls in between pay nothing for it: a sweep's lock and cursor cost as much
//!   as its buckets while the tenants are few);
//! - a shard whose entries fall under a quarter of its capacity is shrunk to fit.
//!
//! The price is that a dead entry lingers until the sweep reaches it: one pass over all the
//! buckets, `SWEEP_EVERY * buckets / SWEEP_BUDGET` calls (about 30,000 calls for a million
//! tenants). Every
//! reader checks an entry's own expiry, so a lingering entry is memory, never a wrong answer.

use std::hash::BuildHasher;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use hashbrown::HashTable;

use crate::TenantId;
use crate::hash::Seeded;

/// Shards per table (a power of two).
pub(crate) const SHARDS: usize = 256;

/// Calls per sweep.
pub(crate) const SWEEP_EVERY: usize = 4;

/// Buckets one sweep may visit: the share of [`SWEEP_EVERY`] calls, 64 each.
pub(crate) const SWEEP_BUDGET: usize = 64 * SWEEP_EVERY;

/// A table this small is not worth shrinking.
const MIN_CAPACITY: usize = 16;

/// Where the sweep of a table's shards is: the shard being swept, and the calls since the
/// last sweep.
#[derive(Debug, Default)]
pub(crate) struct Sweeper {
    shard: AtomicUsize,
    calls: AtomicUsize,
}

impl Sweeper {
    /// One call's share of the cleanup of `shards`: every [`SWEEP_EVERY`]th call sweeps (see
    /// [`sweep_shard`]).
    pub(crate) fn step<V>(
        &self,
        shards: &[Mutex<SweptTable<V>>],
        keep: impl FnMut(&TenantId, &mut V) -> bool,
    ) {
        if sweeps(self.calls.fetch_add(1, Ordering::Relaxed)) {
            sweep_shard(shards, &self.shard, keep);
        }
    }
}

/// Whether call number `call` (counted from 0) of a table is one that sweeps.
pub(crate) fn sweeps(call: usize) -> bool {
    call.is_multiple_of(SWEEP_EVERY)
}

/// One sweep of `shards`: at most [`SWEEP_BUDGET`] buckets of the shard being swept, moving
/// to the next shard when that one's pass is complete.
///
/// The shards are swept one after the other, not a few buckets of each in turn, for the
/// allocator's sake: glibc keeps small freed blocks aside and sorts them all out on the next
/// large free, which here is a shard shrinking. Swept in turn, every shard would shrink at
/// about the same moment, after most of the tenants were freed (80 ms for one call after a
/// million tenants' day ended); swept one by one, a shrink follows one shard's frees.
fn sweep_shard<V>(
    shards: &[Mutex<SweptTable<V>>],
    current: &AtomicUsize,
    keep: impl FnMut(&TenantId, &mut V) -> bool,
) {
    let index = current.load(Ordering::Relaxed) % shards.len();
    let swept = crate::sync::lock(&shards[index]).sweep(SWEEP_BUDGET, keep);
    if swept.wrapped {
        // Once, however many calls found the end at the same time.
        let _ = current.compare_exchange(
            index,
            (index + 1) % shards.len(),
            Ordering::Relaxed,
            Ordering::Relaxed,
        );
    }
}

/// Hashes tenant names (seeded per table, so names cannot be chosen to collide).
#[derive(Debug, Default)]
pub(crate) struct TenantHasher(Seeded);

impl TenantHasher {
    pub(crate) fn hash(&self, tenant: &TenantId) -> u64 {
        self.0.hash_one(tenant)
    }

    /// The shard of a hash: bits that neither the bucket index (low bits) nor the tag
    /// (top 7 bits) of a shard's table use.
    pub(crate) fn shard(hash: u64) -> usize {
        // Truncation intended: 8 bits.
        (hash >> 40) as usize & (SHARDS - 1)
    }
}

#[derive(Debug)]
struct Slot<V> {
    hash: u64,
    tenant: TenantId,
    value: V,
}

/// What one sweep did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Swept {
    /// Entries removed.
    pub(crate) removed: usize,
    /// The sweep reached the end of the table: a pass is complete.
    pub(crate) wrapped: bool,
}

/// One shard: a hash table plus the cursor of its incremental sweep.
#[derive(Debug)]
pub(crate) struct SweptTable<V> {
    table: HashTable<Slot<V>>,
    /// The next bucket to sweep.
    cursor: usize,
    /// `num_buckets` when `cursor` was set: a resize moves every entry, so the pass restarts.
    buckets: usize,
}

impl<V> Default for SweptTable<V> {
    fn default() -> Self {
        SweptTable {
            table: HashTable::new(),
            cursor: 0,
            buckets: 0,
        }
    }
}

impl<V> SweptTable<V> {
    pub(crate) fn len(&self) -> usize {
        self.table.len()
    }

    #[cfg(test)]
    pub(crate) fn capacity(&self) -> usize {
        self.table.capacity()
    }

    /// Every entry, in no order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (&TenantId, &V)> {
        self.table.iter().map(|slot| (&slot.tenant, &slot.value))
    }

    pub(crate) fn get(&self, hash: u64, tenant: &TenantId) -> Option<&V> {
        self.table
            .find(hash, |slot| slot.tenant == *tenant)
            .map(|slot| &slot.value)
    }

    pub(crate) fn get_mut(&mut self, hash: u64, tenant: &TenantId) -> Option<&mut V> {
        self.table
            .find_mut(hash, |slot| slot.tenant == *tenant)
            .map(|slot| &mut slot.value)
    }

    /// The tenant's entry, created with `new` when it has none.
    pub(crate) fn get_or_insert_with(
        &mut self,
        hash: u64,
        tenant: &TenantId,
        new: impl FnOnce() -> V,
    ) -> &mut V {
        let entry = self.table.entry(
            hash,
            |slot| slot.tenant == *tenant,
            |slot: &Slot<V>| slot.hash,
        );
        let slot = entry
            .or_insert_with(|| Slot {
                hash,
                tenant: tenant.clone(),
                value: new(),
            })
            .into_mut();
        &mut slot.value
    }

    /// Visits at most `budget` buckets from where the last sweep stopped, removing the
    /// entries `keep` says no; shrinks the table when it is under a quarter full.
    pub(crate) fn sweep(
        &mut self,
        budget: usize,
        mut keep: impl FnMut(&TenantId, &mut V) -> bool,
    ) -> Swept {
        let buckets = self.table.num_buckets();
        if buckets != self.buckets {
            self.cursor = 0;
            self.buckets = buckets;
        }
        let end = self.cursor.saturating_add(budget).min(buckets);
        let mut removed = 0;
        for index in self.cursor..end {
            if let Ok(mut entry) = self.table.get_bucket_entry(index) {
                let slot = entry.get_mut();
                if !keep(&slot.tenant, &mut slot.value) {
                    entry.remove();
                    removed += 1;
                }
            }
        }
        let wrapped = end == buckets;
        self.cursor = if wrapped { 0 } else { end };
        if removed > 0 {
            self.shrink_if_sparse();
        }
        Swept { removed, wrapped }
    }

    /// Sweeps the whole table now: O(entries), for callers that keep it small.
    pub(crate) fn sweep_all(&mut self, keep: impl FnMut(&TenantId, &mut V) -> bool) -> Swept {
        self.buckets = usize::MAX;
        let mut swept = self.sweep(usize::MAX, keep);
        // A shrink during the sweep left the cursor where it was: nothing is missed, as
        // the sweep visited every bucket before it.
        swept.wrapped = true;
        swept
    }

    /// Shrinks to fit once under a quarter of the capacity is used. Halving at a quarter
    /// (not at a half) leaves room to grow back, so a table at the edge does not
    /// reallocate on every call.
    fn shrink_if_sparse(&mut self) {
        let capacity = self.table.capacity();
        if capacity > MIN_CAPACITY && self.table.len() < capacity / 4 {
            self.table.shrink_to(self.table.len(), |slot| slot.hash);
            // The resize moved the entries: the next sweep starts the pass over.
            self.buckets = usize::MAX;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn filled(n: usize) -> (TenantHasher, SweptTable<u32>) {
        let hasher = TenantHasher::default();
        let mut table = SweptTable::default();
        for i in 0..n {
            let tenant = TenantId::new(format!("t{i}"));
            *table.get_or_insert_with(hasher.hash(&tenant), &tenant, || 0) = 1;
        }
        (hasher, table)
    }

    #[test]
    fn one_sweep_visits_at_most_its_budget_and_a_pass_reaches_every_entry() {
        let (_, mut table) = filled(1_000);
        let buckets = table.table.num_buckets();
        let mut calls = 0;
        let mut visited = 0;
        loop {
            let mut seen = 0;
            let swept = table.sweep(SWEEP_BUDGET, |_, _| {
                seen += 1;
                true
            });
            assert!(seen <= SWEEP_BUDGET);
            visited += seen;
            calls += 1;
            if swept.wrapped {
                break;
            }
        }
        assert_eq!(visited, 1_000, "every entry once per pass");
        assert_eq!(calls, buckets.div_ceil(SWEEP_BUDGET));
    }

    #[test]
    fn a_table_shrinks_when_most_of_its_entries_are_gone() {
        let (hasher, mut table) = filled(10_000);
        let full = table.capacity();
        assert!(full >= 10_000);
        let survivor = TenantId::new("t7");
        while !table
            .sweep(SWEEP_BUDGET, |tenant, _| *tenant == survivor)
            .wrapped
        {}
        // The shrink restarted the pass; finish it.
        while !table
            .sweep(SWEEP_BUDGET, |tenant, _| *tenant == survivor)
            .wrapped
        {}
        assert_eq!(table.len(), 1);
        assert!(
            table.capacity() <= MIN_CAPACITY,
            "capacity {} after shrinking from {full}",
            table.capacity()
        );
        assert_eq!(table.get(hasher.hash(&survivor), &survivor), Some(&1));
    }
}
