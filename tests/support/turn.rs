//! Turns between the files of one test binary.
//!
//! A binary here is a root with one module a file (`tests/redis/main.rs` declaring
//! `mod cluster;`, ...). libtest runs every test of a binary on its threads at once, so
//! without turns a test timing real calls (a worker's share over three seconds, a lease
//! coming back within its TTL) would run beside another file's Redis servers, worker
//! processes or gateways, which on a small machine made such tests miss. With them, the
//! tests of one file still run beside each other, as they did when each file was a binary
//! of its own, and the tests of two files never at once.
//!
//! A test that runs in real time takes its file's turn first:
//! `let _turn = crate::support::file_turn(module_path!());`. Tests in paused time need none:
//! what they measure is tokio's clock, which no other test moves.

use std::sync::{Condvar, Mutex};

/// The file whose tests run now, and how many of them.
struct Now {
    file: Option<String>,
    tests: usize,
}

static NOW: Mutex<Now> = Mutex::new(Now {
    file: None,
    tests: 0,
});
static CHANGED: Condvar = Condvar::new();

/// While held, tests of other files of the binary wait; tests of the same file do not.
#[must_use = "the turn ends when this is dropped"]
pub struct FileTurn {
    file: String,
}

/// Waits (blocking the thread) until no test of another file runs, and takes the turn of
/// the file `module_path` (the caller's `module_path!()`) lies in: its second segment
/// (`redis::cluster::a_test` -> `cluster`).
pub fn file_turn(module_path: &str) -> FileTurn {
    let file = module_path
        .split("::")
        .nth(1)
        .unwrap_or(module_path)
        .to_owned();
    let mut now = NOW.lock().unwrap_or_else(|e| e.into_inner());
    while now.file.as_ref().is_some_and(|f| *f != file) {
        now = CHANGED.wait(now).unwrap_or_else(|e| e.into_inner());
    }
    now.file = Some(file.clone());
    now.tests += 1;
    FileTurn { file }
}

impl Drop for FileTurn {
    fn drop(&mut self) {
        let mut now = NOW.lock().unwrap_or_else(|e| e.into_inner());
        debug_assert_eq!(now.file.as_deref(), Some(self.file.as_str()));
        now.tests -= 1;
        if now.tests == 0 {
            now.file = None;
            CHANGED.notify_all();
        }
    }
}
