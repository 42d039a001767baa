//! The simulator's `--replay` (`src/replay.rs`): a recorded gateway run
//! (`tests/fixtures/gateway_record.jsonl`, written by the gateway's `tests/gateway/record.rs`
//! with `FAIRGATE_UPDATE_FIXTURES=1`) replayed in paused time under the recording's own
//! policy gives back its per-tier counts, and the same file and seed print the same table.

use fairgate_simulator::replay;

const RECORDING: &str = include_str!("fixtures/gateway_record.jsonl");
const POLICY: &str = include_str!("fixtures/gateway_record_policy.toml");
const SEED: u64 = 1;

#[tokio::test(start_paused = true)]
async fn a_replay_under_the_recorded_policy_reproduces_served_and_busy_per_tier_within_5_percent() {
    let records = replay::read(RECORDING).unwrap();
    assert!(records.len() >= 50, "{} calls", records.len());
    let (policy, _) = replay::policy(POLICY).unwrap();
    let run = replay::replay(&records, &policy, SEED).await;
    print!("{}", replay::table(&run));
    let rows = replay::served_and_busy(&run);
    assert_eq!(rows.len(), 2, "premium and guest: {rows:?}");
    for (tier, recorded, replayed) in rows {
        for (what, r, p) in [
            ("served", recorded[0], replayed[0]),
            ("busy", recorded[1], replayed[1]),
        ] {
            let off = r.abs_diff(p) as f64;
            assert!(
                off <= 0.05 * r as f64,
                "{tier} {what}: recorded {r}, replayed {p}"
            );
        }
    }
}

#[tokio::test(start_paused = true)]
async fn the_same_file_and_seed_print_the_same_table_twice() {
    let records = replay::read(RECORDING).unwrap();
    let (policy, _) = replay::policy(POLICY).unwrap();
    let mut tables = Vec::new();
    for _ in 0..2 {
        tables.push(replay::table(
            &replay::replay(&records, &policy, SEED).await,
        ));
    }
    print!("{}", tables[0]);
    assert_eq!(tables[0], tables[1]);
}

#[test]
fn a_policy_takes_the_keys_file_shape_and_drr_settings() {
    let (policy, summary) = replay::policy(
        r#"
[[keys]]
key = "ignored"
tenant = "t"
tier = "pro"

[limits]
global_max = 16
window = 12

[[tiers]]
name = "free"
cap = 4
max_wait_ms = 250

[drr]
quantum = 2000
tier_weights = { premium = 4, free = 1 }
"#,
    )
    .unwrap();
    assert_eq!(
        summary,
        "global 16, window 12; free cap 4 wait 250 ms; quantum 2000; weights free 1, premium 4"
    );
    let fairgate_simulator::engine::Policy::Fairgate { window, drr, .. } = policy else {
        panic!("a fairgate policy")
    };
    assert_eq!((window, drr.quantum), (12, Some(2000)));
    assert!(replay::policy("[limits]\nglobal_cap = 3\n").is_err());
}

/// Every policy block of the guide's simulator page (a ```toml block without `[[keys]]`)
/// is one the simulator's `--policy` reads.
#[test]
fn every_policy_file_in_the_guide_is_read_by_the_replay() {
    let readme = include_str!("../../docs/simulator.md");
    let mut checked = 0;
    for block in readme.split("```toml\n").skip(1) {
        let text = &block[..block.find("```").expect("a closed block")];
        if text.contains("[[keys]]") {
            continue; // a keys file: the gateway's own check reads it (config.rs)
        }
        if let Err(error) = replay::policy(text) {
            panic!("docs/simulator.md: policy refused: {error}\n{text}");
        }
        checked += 1;
    }
    assert!(checked > 0, "no policy block found in docs/simulator.md");
}
