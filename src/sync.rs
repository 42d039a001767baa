//! Locking that survives a panic elsewhere.

use std::sync::{Mutex, MutexGuard};

/// Locks `mutex`, even if a thread panicked while holding it: what these locks guard is
/// counters, queues and clocks that stay usable, and refusing every later request would be
/// worse than serving from them.
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}
