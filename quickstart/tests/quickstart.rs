//! The README's first command, `cargo run -p fairgate-quickstart`, as a user runs it: it
//! ends well every time and shows each step. Its retry jitter is drawn afresh each run, so
//! it runs twenty times (a pro max wait shorter than step 4's retry made one run in five
//! end `Busy`).

use std::process::Command;

#[test]
fn the_demonstration_ends_well_whatever_its_jitter() {
    let binary = env!("CARGO_BIN_EXE_fairgate-quickstart");
    for run in 0..20 {
        let out = Command::new(binary).output().expect("the quickstart runs");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "run {run}: {}\n{stdout}{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        for shown in [
            "critical tier pro",
            "SERVER_BUSY: tier free full",
            "is demoted to batch",
            "answered after",
            "DrrFairness:",
        ] {
            assert!(
                stdout.contains(shown),
                "run {run} shows no {shown:?}:\n{stdout}"
            );
        }
    }
}
