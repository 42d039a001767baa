//! The gateway's live page, as an operator's browser shows it: a real `fairgate-gateway`
//! process under load (calls in flight and waiting at a slow mock upstream), its admin
//! page loaded by headless Chromium, the rendered numbers read from the DOM and checked
//! against the page's JSON (`/live`) and the upstream's own count; JavaScript errors are
//! failures, and a screenshot is kept (`target/tmp/gateway_page.png`).

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use crate::support::anthropic::MockAnthropic;
use crate::support::gateway::*;

/// Debian's Chromium, if installed (`scripts/test` installs it); CI must have it.
fn chromium() -> Option<PathBuf> {
    let found = ["chromium", "chromium-browser", "google-chrome"]
        .iter()
        .map(|name| PathBuf::from("/usr/bin").join(name))
        .find(|path| path.exists());
    if found.is_none() {
        assert!(
            std::env::var_os("CI").is_none(),
            "no chromium: scripts/test installs Debian's chromium"
        );
        eprintln!("no chromium on this machine: the live page test is skipped");
    }
    found
}

/// Runs headless Chromium on `url` with `args`, letting the page's script run for a while.
fn headless(browser: &PathBuf, url: &str, args: &[&str]) -> String {
    let profile = tempdir();
    let output = Command::new(browser)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--virtual-time-budget=4000",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .args(args)
        .arg(url)
        .output()
        .expect("run chromium");
    let _ = std::fs::remove_dir_all(&profile);
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn tempdir() -> PathBuf {
    let dir = target_tmp().join(format!("chromium-{}", free_port()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The text of the cell of class `class` in the table row `<tr data-{key}="{value}">`.
fn cell(dom: &str, key: &str, value: &str, class: &str) -> Option<String> {
    let row_start = dom.find(&format!(r#"<tr data-{key}="{value}">"#))?;
    let row = &dom[row_start..row_start + dom[row_start..].find("</tr>")?];
    let at = row.find(&format!(r#"class="{class}">"#))? + class.len() + 9;
    Some(row[at..at + row[at..].find('<')?].to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_live_page_shows_who_waits_and_what_is_in_flight_as_the_gateway_counts_it() {
    let _turn = crate::support::file_turn(module_path!());
    let Some(browser) = chromium() else {
        return;
    };
    let mock = MockAnthropic::start();
    mock.set_delay(Duration::from_secs(30));
    // Premium: 8 slots; guest: 1 slot, waits up to 30 s.
    let gateway = Gateway::start(&mock.url(), &keys_toml(8, 30_000, ""), None);
    let mut calls = Vec::new();
    for (key, n) in [(PREMIUM_KEY, 3), (GUEST_KEY, 3)] {
        for _ in 0..n {
            let url = gateway.url();
            calls.push(tokio::spawn(async move {
                client()
                    .post(format!("{url}/v1/messages"))
                    .header("x-api-key", key)
                    .body(messages_body(false))
                    .send()
                    .await
            }));
        }
    }
    assert!(
        mock.wait_in_flight(4, Duration::from_secs(10)),
        "3 premium and 1 guest call at the upstream"
    );
    // Mid-flood the page tells how long the calls not yet finished have run: the guest in
    // flight and the two guests waiting behind it, seconds in (the latency histograms
    // count a call only once it ends, so they say nothing of these yet).
    let tier_field = |live: &str, tier: &str, field: &str| -> u64 {
        let live: serde_json::Value = serde_json::from_str(live).unwrap_or_default();
        live["tiers"]
            .as_array()
            .and_then(|tiers| tiers.iter().find(|t| t["tier"] == tier))
            .and_then(|t| t[field].as_u64())
            .unwrap_or(0)
    };
    let aged = eventually(Duration::from_secs(20), async || {
        let live = gateway.admin("/live").await;
        tier_field(&live, "guest", "oldest_in_flight_ms") >= 2_000
            && tier_field(&live, "guest", "longest_wait_ms") >= 2_000
    })
    .await;
    let live = gateway.admin("/live").await;
    println!("/live: {live}");
    assert!(aged, "the guests' ages never reached 2 s: {live}");
    let tokens_in_flight: serde_json::Value = serde_json::from_str(&live).unwrap();
    assert!(
        tokens_in_flight["window"]["tokens_in_flight"].as_u64() > Some(0),
        "the tokens of the calls in flight: {live}"
    );
    for tier in [
        r#"{"tier":"premium","cap":8,"in_flight":3,"waiting":0"#,
        r#"{"tier":"guest","cap":1,"in_flight":1,"waiting":2"#,
    ] {
        assert!(live.contains(tier), "{tier} in {live}");
    }

    let page = format!("{}/", gateway.admin_url());
    let dom = headless(&browser, &page, &["--dump-dom"]);
    assert!(!dom.is_empty(), "chromium rendered nothing");
    let updates: u32 = dom
        .split(r#"data-updates=""#)
        .nth(1)
        .and_then(|rest| rest.split('"').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    assert!(updates >= 1, "the page never read /live");
    assert!(
        dom.contains(r#"data-errors="0""#),
        "JavaScript errors on the page"
    );
    let shown = |tier: &str, class: &str| cell(&dom, "tier", tier, class);
    println!(
        "rendered: premium {:?}/{:?} in flight, guest {:?} in flight and {:?} waiting \
         ({updates} updates)",
        shown("premium", "n in-flight"),
        shown("premium", "n cap"),
        shown("guest", "n in-flight"),
        shown("guest", "n waiting"),
    );
    assert_eq!(shown("premium", "n in-flight").as_deref(), Some("3"));
    assert_eq!(shown("premium", "n cap").as_deref(), Some("8"));
    assert_eq!(shown("guest", "n in-flight").as_deref(), Some("1"));
    assert_eq!(shown("guest", "n waiting").as_deref(), Some("2"));
    let seconds = |text: Option<String>| text.and_then(|t| t.parse::<f64>().ok()).unwrap_or(0.0);
    for (what, shown) in [
        ("guest in flight", shown("guest", "n oldest-in-flight")),
        ("guest waiting", shown("guest", "n longest-wait")),
        (
            "critical waiting",
            cell(&dom, "class", "critical", "n longest-wait"),
        ),
    ] {
        assert!(
            seconds(shown.clone()) >= 2.0,
            "{what}: {shown:?} s on the page"
        );
    }
    // Premium went out after the first answer told the limits (slow start): younger.
    let premium = shown("premium", "n oldest-in-flight");
    assert!(
        seconds(premium.clone()) >= 1.0,
        "premium in flight: {premium:?} s"
    );
    assert_eq!(shown("premium", "n longest-wait").as_deref(), Some("–"));
    // The page and the upstream agree: what it shows in flight is what the upstream holds.
    assert_eq!(mock.in_flight(), 4);
    // Tokens served per tenant, as the store counts them for the fair queue.
    let tokens = |tenant: &str| -> Option<String> {
        let at = live.find(&format!(r#""tenant":"{tenant}""#))?;
        let rest = &live[at..];
        let from = rest.find(r#""tokens":"#)? + 9;
        Some(rest[from..from + rest[from..].find(',')?].to_owned())
    };
    for tenant in ["team-premium", "team-guest"] {
        let shown = cell(&dom, "tenant", tenant, "n tokens");
        println!(
            "{tenant}: {shown:?} tokens served on the page, {:?} in /live",
            tokens(tenant)
        );
        assert!(shown.is_some(), "{tenant} on the page");
        assert_eq!(shown, tokens(tenant), "{tenant}'s tokens");
    }

    let shot = target_tmp().join("gateway_page.png");
    let _ = std::fs::remove_file(&shot);
    headless(
        &browser,
        &page,
        &[
            &format!("--screenshot={}", shot.display()),
            "--window-size=1280,900",
            "--hide-scrollbars",
        ],
    );
    let size = std::fs::metadata(&shot).map(|m| m.len()).unwrap_or(0);
    println!("screenshot: {} ({size} bytes)", shot.display());
    assert!(size > 10_000, "the screenshot is empty");
    for call in calls {
        call.abort();
    }
}
