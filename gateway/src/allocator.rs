//! The gateway's allocator: jemalloc, with background threads that give freed pages back to
//! the system. After a burst of 1,000 held streams the system allocator kept its peak (51.0
//! MB, idle 12.5); jemalloc with these settings is back at 17.4 MB within a second.
//!
//! While many connections are open, freed pages go back at once rather than after a
//! second ([`follow_connections`]). Pages kept for reuse are handed out again already
//! resident: a held stream's buffers that are never written (hyper's 8 KiB read buffer
//! waiting for the client's next request, most of its write buffer) then count in full.
//! Taken from pages given back, only what is written counts: 21.5 -> 18.0 KiB a stream
//! (2,000 held over HTTP/2). It costs a page fault and a purge per buffer: about 13% of
//! the calls a second at 32 calls at once (`examples/gateway_bench.rs`), so it is kept for
//! when memory, not calls, is what runs out.

use std::time::Duration;

use tracing::{info, warn};

#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// jemalloc's settings, read when it starts (the symbol its prefixed build looks for):
/// freed pages go back after a second rather than ten.
#[unsafe(export_name = "_rjem_malloc_conf")]
static CONF: Conf = Conf(c"background_thread:true,dirty_decay_ms:1000,muzzy_decay_ms:0".as_ptr());

/// The decay of [`CONF`], in ms.
const DECAY_MS: isize = 1000;

/// Open connections from which freed pages go back at once; below half of it they go back
/// after [`DECAY_MS`] again.
const MANY_CONNECTIONS: usize = 1_000;

/// jemalloc's answer for an arena it has not made yet (`EFAULT`).
const NOT_MADE: i32 = 14;

/// A C string jemalloc reads once; never written.
#[repr(transparent)]
struct Conf(*const std::ffi::c_char);

// SAFETY: it points at a static C string that nothing writes.
unsafe impl Sync for Conf {}

/// Gives freed pages back at once while `open()` connections are [`MANY_CONNECTIONS`] or
/// more (checked every quarter second), after [`DECAY_MS`] again once they are fewer than
/// half of it.
pub(crate) async fn follow_connections(open: impl Fn() -> usize) {
    let mut at_once = false;
    let mut every = tokio::time::interval(Duration::from_millis(250));
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        every.tick().await;
        let open = open();
        let wanted = gives_back_at_once(open, at_once);
        if wanted != at_once {
            at_once = wanted;
            let decay_ms = if at_once { 0 } else { DECAY_MS };
            match set_dirty_decay(decay_ms) {
                Ok(()) => info!(
                    open,
                    decay_ms, "freed memory now goes back to the system after decay_ms"
                ),
                Err(code) => warn!(code, "jemalloc refused a dirty_decay_ms"),
            }
        }
    }
}

/// Whether freed pages go back at once with `open` connections, `now` whether they do.
fn gives_back_at_once(open: usize, now: bool) -> bool {
    if now {
        open >= MANY_CONNECTIONS / 2
    } else {
        open >= MANY_CONNECTIONS
    }
}

/// Sets jemalloc's `dirty_decay_ms` on every arena it has, and on those it creates later.
fn set_dirty_decay(ms: isize) -> Result<(), i32> {
    let arenas: u32 = read(c"arenas.narenas")?;
    set_decay(c"arenas.dirty_decay_ms", ms)?;
    for arena in 0..arenas {
        let Ok(name) = std::ffi::CString::new(format!("arena.{arena}.dirty_decay_ms")) else {
            continue;
        };
        // An arena not made yet (EFAULT) takes the default just set when it is.
        match set_decay(&name, ms) {
            Ok(()) | Err(NOT_MADE) => {}
            Err(code) => return Err(code),
        }
    }
    Ok(())
}

/// Reads the setting `name`, a `T` of its size (jemalloc refuses another size: `EINVAL`).
fn read<T: Default>(name: &std::ffi::CStr) -> Result<T, i32> {
    let (mut value, mut size) = (T::default(), std::mem::size_of::<T>());
    // SAFETY: jemalloc writes at most `size` bytes into `value`, and none unless `size` is
    // the setting's.
    let code = unsafe {
        tikv_jemalloc_sys::mallctl(
            name.as_ptr(),
            (&raw mut value).cast(),
            &raw mut size,
            std::ptr::null_mut(),
            0,
        )
    };
    if code == 0 { Ok(value) } else { Err(code) }
}

/// Sets the `ssize_t` setting `name` to `ms`.
fn set_decay(name: &std::ffi::CStr, ms: isize) -> Result<(), i32> {
    let mut value = ms;
    // SAFETY: `name` takes an `ssize_t`, given by pointer and size; nothing is read back.
    let code = unsafe {
        tikv_jemalloc_sys::mallctl(
            name.as_ptr(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            (&raw mut value).cast(),
            std::mem::size_of::<isize>(),
        )
    };
    if code == 0 { Ok(()) } else { Err(code) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_arena_takes_the_decay_both_ways() {
        set_dirty_decay(0).unwrap();
        assert_eq!(read::<isize>(c"arena.0.dirty_decay_ms"), Ok(0));
        set_dirty_decay(DECAY_MS).unwrap();
        assert_eq!(read::<isize>(c"arena.0.dirty_decay_ms"), Ok(DECAY_MS));
    }

    #[test]
    fn a_setting_read_at_another_size_is_refused() {
        assert!(read::<u32>(c"arenas.narenas").is_ok_and(|n| n > 0));
        assert_eq!(read::<u8>(c"arenas.narenas"), Err(22)); // EINVAL
    }

    #[test]
    fn at_once_from_many_connections_until_fewer_than_half() {
        assert!(!gives_back_at_once(MANY_CONNECTIONS - 1, false));
        assert!(gives_back_at_once(MANY_CONNECTIONS, false));
        // Between the two it stays as it is, so a count around the mark does not flap.
        assert!(gives_back_at_once(MANY_CONNECTIONS / 2, true));
        assert!(!gives_back_at_once(MANY_CONNECTIONS / 2, false));
        assert!(!gives_back_at_once(MANY_CONNECTIONS / 2 - 1, true));
    }
}
