//! The slab of waiting items: each in a slot found again by its [`Key`], linked into its
//! tenant's FIFO by `u32` indices.

use super::{Key, RETAINED_CAPACITY};
use crate::Priority;

/// "No slot" in the `u32` links and indices of the slabs.
pub(super) const NONE: u32 = u32::MAX;

/// Most slots a slab (entries, or the tenants of one class) may hold, so
/// every index stays below [`NONE`].
pub(super) const MAX_SLOTS: usize = (u32::MAX - 1) as usize;

/// `u32` links and a `Priority` (whose spare values give `Option<Entry>` its
/// discriminant): 40 bytes for an 8-byte item on a 64-bit target.
#[derive(Debug)]
pub(super) struct Entry<T> {
    pub(super) item: T,
    pub(super) generation: u64,
    pub(super) cost: i64,
    pub(super) tenant: u32,
    /// Previous entry of the tenant's FIFO. Left stale once the entry is its
    /// tenant's head (popping the head does not touch its successor): read
    /// only for an entry that is not the head.
    pub(super) prev: u32,
    pub(super) next: u32,
    pub(super) class: Priority,
}

#[derive(Debug)]
pub(super) struct Entries<T> {
    pub(super) slots: Vec<Option<Entry<T>>>,
    pub(super) free: Vec<u32>,
    pub(super) next_generation: u64,
    /// [`MAX_SLOTS`], lowered by tests.
    pub(super) limit: usize,
}

impl<T> Entries<T> {
    pub(super) fn new() -> Self {
        Entries {
            slots: Vec::new(),
            free: Vec::new(),
            next_generation: 0,
            limit: MAX_SLOTS,
        }
    }

    /// Whether [`Entries::insert`] will find a slot.
    pub(super) fn has_room(&self) -> bool {
        !self.free.is_empty() || self.slots.len() < self.limit
    }

    /// Stores `entry`, or hands its item back when the slab is full.
    pub(super) fn insert(&mut self, mut entry: Entry<T>) -> Result<Key, T> {
        let generation = self.next_generation;
        entry.generation = generation;
        if let Some(index) = self.free.pop()
            && let Some(slot) = self.slots.get_mut(index as usize)
        {
            self.next_generation = generation.wrapping_add(1);
            *slot = Some(entry);
            return Ok(Key { index, generation });
        }
        let Some(index) = u32::try_from(self.slots.len())
            .ok()
            .filter(|_| self.slots.len() < self.limit)
        else {
            return Err(entry.item);
        };
        self.next_generation = generation.wrapping_add(1);
        self.slots.push(Some(entry));
        Ok(Key { index, generation })
    }

    pub(super) fn get(&self, index: u32) -> Option<&Entry<T>> {
        self.slots.get(index as usize)?.as_ref()
    }

    pub(super) fn get_mut(&mut self, index: u32) -> Option<&mut Entry<T>> {
        self.slots.get_mut(index as usize)?.as_mut()
    }

    /// Takes the entry at `index`, if it is `key`'s.
    pub(super) fn take(&mut self, key: Key) -> Option<Entry<T>> {
        if self.get(key.index)?.generation != key.generation {
            return None;
        }
        self.take_at(key.index)
    }

    pub(super) fn take_at(&mut self, index: u32) -> Option<Entry<T>> {
        let entry = self.slots.get_mut(index as usize)?.take()?;
        self.free.push(index);
        Some(entry)
    }

    /// Called when nothing is waiting: drop the vacant slots.
    pub(super) fn reset(&mut self) {
        self.slots.clear();
        self.free.clear();
        self.slots.shrink_to(RETAINED_CAPACITY);
        self.free.shrink_to(RETAINED_CAPACITY);
    }
}
