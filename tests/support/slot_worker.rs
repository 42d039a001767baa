//! The `slot_worker` example as a process of a test's own, its output read line by line.

use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError, channel};
use std::time::Duration;

/// A `slot_worker` process, SIGKILLed by its pid when dropped (a test that panics leaves
/// nothing). Its stdout is read on a thread of its own, a line at a time; its stderr goes
/// to the test's.
pub struct SlotWorker {
    child: Child,
    lines: Receiver<String>,
}

impl SlotWorker {
    /// The command that runs the example (built by `cargo test --all-features`), for the
    /// caller to add its arguments to.
    pub fn command() -> Command {
        Command::new(super::example_binary("slot_worker"))
    }

    /// Starts `command` (from [`SlotWorker::command`]) and reads what it prints.
    pub fn spawn(command: &mut Command) -> SlotWorker {
        use std::io::{BufRead, BufReader};
        let mut child = command
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start a slot_worker process");
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        SlotWorker { child, lines }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The next line it prints, within `within`; panics if none comes.
    pub fn line(&self, within: Duration) -> String {
        self.lines
            .recv_timeout(within)
            .unwrap_or_else(|_| panic!("worker {} said nothing", self.child.id()))
    }

    /// The next line within `within`, or why there is none (the worker closed its output:
    /// `Disconnected`).
    pub fn next_line(&self, within: Duration) -> Result<String, RecvTimeoutError> {
        self.lines.recv_timeout(within)
    }

    /// Its exit status, if it has exited.
    pub fn try_wait(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().unwrap()
    }

    /// Waits until it exits.
    pub fn wait(&mut self) -> ExitStatus {
        self.child.wait().expect("wait for the worker")
    }

    /// SIGKILLs it by its pid and waits until it is gone.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for SlotWorker {
    fn drop(&mut self) {
        self.kill();
    }
}
