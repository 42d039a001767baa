//! The simulator (`examples/simulate`) reproduces each reference result at a small size:
//! the direction of the reference's claim and a margin, naive (a FIFO semaphore, immediate
//! retries) against the real fairgate stack, in paused time. The engine is the example's
//! own module, included here, so the test runs what the example prints.

use crate::engine::{Outcome, Size, scenario, table};

const SEED: u64 = 1;

fn show(o: &Outcome) {
    print!("{}", table(std::slice::from_ref(o)));
}

#[tokio::test(start_paused = true)]
async fn b_behind_a_100_job_dump_waits_under_a_third_of_its_naive_p99() {
    let o = scenario(1, SEED, Size::Small).await;
    show(&o);
    assert!(
        o.naive > 5.0,
        "naive: B queues behind A's jobs: {}",
        o.naive_text
    );
    assert!(
        o.fairgate < o.naive / 3.0,
        "B's p99: fairgate {} vs naive {}",
        o.fairgate_text,
        o.naive_text
    );
}

#[tokio::test(start_paused = true)]
async fn with_a_hog_among_8_tenants_jain_is_at_least_0_85_and_above_naive() {
    let o = scenario(2, SEED, Size::Small).await;
    show(&o);
    assert!(
        o.naive < 0.6,
        "naive serves the hog first: {}",
        o.naive_text
    );
    assert!(o.fairgate >= 0.85, "fairgate: {}", o.fairgate_text);
    assert!(o.fairgate > o.naive);
}

#[tokio::test(start_paused = true)]
async fn in_a_429_storm_fairgate_draws_under_a_third_of_the_naive_429_share() {
    let o = scenario(3, SEED, Size::Small).await;
    show(&o);
    assert!(
        o.naive > 0.1,
        "the storm throttles naive callers: {}",
        o.naive_text
    );
    assert!(
        o.fairgate < o.naive / 3.0,
        "429 share: fairgate {} vs naive {}",
        o.fairgate_text,
        o.naive_text
    );
}

#[tokio::test(start_paused = true)]
async fn at_peak_with_20_free_users_per_paying_user_paid_p99_stays_under_2_s() {
    let o = scenario(4, SEED, Size::Small).await;
    show(&o);
    assert!(
        o.fairgate < 2.0,
        "paid p99 under fairgate: {}",
        o.fairgate_text
    );
    assert!(
        o.fairgate < o.naive,
        "naive {} vs fairgate {}",
        o.naive_text,
        o.fairgate_text
    );
}

#[tokio::test(start_paused = true)]
async fn in_a_10x_spike_free_or_guest_see_server_busy_before_pro_and_premium() {
    let o = scenario(5, SEED, Size::Small).await;
    show(&o);
    let first = o.first_busy.first().expect("the spike makes someone busy");
    assert!(
        first.0 == "free" || first.0 == "guest",
        "first SERVER_BUSY: {:?}",
        o.first_busy
    );
    let last_unpaid = o
        .first_busy
        .iter()
        .rposition(|(tier, _)| tier == "free" || tier == "guest");
    let first_paid = o
        .first_busy
        .iter()
        .position(|(tier, _)| tier == "pro" || tier == "premium");
    if let (Some(unpaid), Some(paid)) = (last_unpaid, first_paid) {
        assert!(
            unpaid < paid,
            "a paid tier before an unpaid one: {:?}",
            o.first_busy
        );
    }
}

#[tokio::test(start_paused = true)]
async fn the_same_seed_prints_the_same_table_twice() {
    let mut tables = Vec::new();
    for _ in 0..2 {
        let mut outcomes = Vec::new();
        for id in 1..=5 {
            outcomes.push(scenario(id, SEED, Size::Small).await);
        }
        tables.push(table(&outcomes));
    }
    print!("{}", tables[0]);
    assert_eq!(tables[0], tables[1]);
}
