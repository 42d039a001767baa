//! The simulator (`fairgate-simulator`) reproduces each reference result at a small size:
//! the direction of the reference's claim and a margin, naive (a FIFO semaphore, immediate
//! retries) against the real fairgate stack, in paused time. The engine is the example's
//! own module, included here, so the test runs what the example prints.

use fairgate_simulator::scenarios::{Outcome, Size, scenario, table};

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

/// The points of the polyline `id` in `svg`: `(x, y)` pairs, empty when there is none.
fn series(svg: &str, id: &str) -> Vec<(f64, f64)> {
    let Some(at) = svg.find(&format!(r#"id="{id}""#)) else {
        return Vec::new();
    };
    let line = &svg[at..at + svg[at..].find("/>").unwrap_or(0)];
    let Some(from) = line.find(r#"points=""#) else {
        return Vec::new();
    };
    line[from + 8..]
        .trim_end_matches('"')
        .split_whitespace()
        .filter_map(|pair| {
            let (x, y) = pair.split_once(',')?;
            Some((x.parse().ok()?, y.parse().ok()?))
        })
        .collect()
}

/// The `b-behind-a` picture draws each tenant's latency under both policies, and B's
/// fairgate line reaches all of B's calls (y at the top) further left than its naive one:
/// the claim, drawn.
#[tokio::test(start_paused = true)]
async fn the_b_behind_a_picture_draws_each_tenants_latency_under_both_policies() {
    let o = scenario(1, SEED, Size::Small).await;
    let svg = fairgate_simulator::svg::render(&o, Size::Small);
    for id in [
        "tenant-A-naive",
        "tenant-A-fairgate",
        "tenant-B-naive",
        "tenant-B-fairgate",
    ] {
        assert!(series(&svg, id).len() >= 2, "{id} drawn in the picture");
    }
    let last_x = |id: &str| series(&svg, id).last().map_or(0.0, |p| p.0);
    assert!(
        last_x("tenant-B-fairgate") < last_x("tenant-B-naive"),
        "B's slowest call: fairgate at x {} vs naive at x {}",
        last_x("tenant-B-fairgate"),
        last_x("tenant-B-naive")
    );
}

/// The `storm` picture draws the share of attempts answered 429 over time under both
/// policies, fairgate's lower on average: the claim, drawn.
#[tokio::test(start_paused = true)]
async fn the_storm_picture_draws_the_share_of_429s_over_time_under_both_policies() {
    let o = scenario(3, SEED, Size::Small).await;
    let svg = fairgate_simulator::svg::render(&o, Size::Small);
    let naive = series(&svg, "throttle-share-naive");
    let fair = series(&svg, "throttle-share-fairgate");
    assert!(naive.len() >= 2 && fair.len() >= 2, "both shares drawn");
    // SVG y grows downwards: a higher share is a smaller y.
    let mean_y =
        |points: &[(f64, f64)]| points.iter().map(|p| p.1).sum::<f64>() / points.len() as f64;
    assert!(
        mean_y(&fair) > mean_y(&naive),
        "fairgate's 429 share drawn below naive's (mean y {} vs {})",
        mean_y(&fair),
        mean_y(&naive)
    );
    // Other scenarios claim nothing more than the tiers show.
    let hog = scenario(2, SEED, Size::Small).await;
    assert!(!fairgate_simulator::svg::render(&hog, Size::Small).contains("throttle-share"));
}
