//! The Grafana dashboard (`dashboards/fairgate.json`) against a real Prometheus: Debian's
//! `prometheus` scrapes a gateway under a load that answers, refuses a tier, retries 429s,
//! demotes a tenant and serves every class; then every panel's query is evaluated through
//! Prometheus's HTTP API, and one that returns nothing fails the test, named.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::support::anthropic::{MockAnthropic, Reply};
use crate::support::gateway::*;

const PROMETHEUS: &str = "/usr/bin/prometheus";
const SCHEDULED_KEY: &str = "sk-test-scheduled";

/// A Prometheus server, stopped by its pid when dropped.
struct Prometheus {
    child: Child,
    port: u16,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Prometheus {
    /// Scrapes `target` (`host:port`) every second, its data in a fresh directory.
    fn start(target: &str) -> Prometheus {
        let dir = target_tmp().join(format!("prometheus-{}", free_port()));
        std::fs::create_dir_all(&dir).unwrap();
        let config = dir.join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n\
                 scrape_configs:\n  - job_name: gateway\n    static_configs:\n      \
                 - targets: ['{target}']\n"
            ),
        )
        .unwrap();
        let port = free_port();
        let child = Command::new(PROMETHEUS)
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .arg("--log.level=warn")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start prometheus");
        Prometheus { child, port }
    }

    /// The series `expr` evaluates to now (empty when none, or on an error).
    async fn query(&self, expr: &str) -> Vec<serde_json::Value> {
        // Every byte but letters and digits percent-encoded: safe for any query.
        let encoded: String = expr
            .bytes()
            .map(|b| match b {
                b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' => (b as char).to_string(),
                _ => format!("%{b:02X}"),
            })
            .collect();
        let answer = client()
            .get(format!(
                "http://127.0.0.1:{}/api/v1/query?query={encoded}",
                self.port
            ))
            .send()
            .await;
        let Ok(answer) = answer else {
            return Vec::new();
        };
        let bytes = answer.bytes().await.unwrap_or_default();
        let body: serde_json::Value = serde_json::from_slice(&bytes).unwrap_or_default();
        body["data"]["result"]
            .as_array()
            .cloned()
            .unwrap_or_default()
    }
}

/// Every panel query of the dashboard, with Grafana's interval variables made a window
/// that holds several 1 s scrapes.
fn panel_queries() -> Vec<(String, String)> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../dashboards/fairgate.json");
    let dashboard: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let mut queries = Vec::new();
    let mut panels: Vec<&serde_json::Value> = dashboard["panels"]
        .as_array()
        .map(|p| p.iter().collect())
        .unwrap_or_default();
    while let Some(panel) = panels.pop() {
        if let Some(inner) = panel["panels"].as_array() {
            panels.extend(inner);
        }
        for target in panel["targets"].as_array().into_iter().flatten() {
            if let Some(expr) = target["expr"].as_str() {
                let expr = expr
                    .replace("$__rate_interval", "30s")
                    .replace("$__interval", "5s");
                queries.push((panel["title"].as_str().unwrap_or("").to_owned(), expr));
            }
        }
    }
    queries
}

/// `n` calls of `key` with the headers `claims`, one after another.
async fn calls(gateway: &Gateway, key: &str, claims: &[(&str, &str)], n: usize) {
    for _ in 0..n {
        let _ = post_messages_at(&gateway.url(), key, claims, false).await;
    }
}

/// A load that gives every panel something to show: answers of every class, a refused
/// tier, 429s retried, a tenant over its budget demoted.
async fn load(gateway: &Gateway, mock: &MockAnthropic) {
    // Two 429s: retried by the retry layer, the cooldown gate closed meanwhile.
    mock.push_reply(Reply::RateLimited {
        retry_after_secs: 1,
    });
    mock.push_reply(Reply::RateLimited {
        retry_after_secs: 1,
    });
    calls(gateway, PREMIUM_KEY, &[], 3).await;
    // Standard (a scheduled call with an SLA) and batch (one without).
    calls(gateway, SCHEDULED_KEY, &[("x-fairgate-sla", "60")], 2).await;
    calls(gateway, SCHEDULED_KEY, &[], 2).await;
    // The guest tier (1 slot, 100 ms max wait) refused: ten guests at once on slow answers.
    mock.set_delay(Duration::from_millis(400));
    let guests: Vec<_> = (0..10)
        .map(|_| {
            let url = gateway.url();
            tokio::spawn(async move {
                post_messages_at(&url, GUEST_KEY, &[], false)
                    .await
                    .map_or(0, |r| r.status().as_u16())
            })
        })
        .collect();
    let mut refused = 0;
    for guest in guests {
        refused += usize::from(guest.await.unwrap() == 529);
    }
    assert!(refused > 0, "the guest tier was never refused");
    mock.set_delay(Duration::ZERO);
    // Premium over its daily budget (2,000 tokens, demoted past 1.5 times that; a call is
    // charged its input and 5 x its 64 `max_tokens`): demoted, its next calls batch.
    calls(gateway, PREMIUM_KEY, &[], 15).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_panel_of_the_dashboard_returns_data_in_a_real_prometheus() {
    let _turn = crate::support::file_turn(module_path!());
    if !std::path::Path::new(PROMETHEUS).exists() {
        assert!(
            std::env::var_os("CI").is_none(),
            "no prometheus: scripts/test installs Debian's prometheus"
        );
        eprintln!("SKIPPED: prometheus is absent (scripts/test installs Debian's package)");
        return;
    }
    let mock = MockAnthropic::start();
    let keys = keys_toml(
        8,
        100,
        &format!(
            "\n[[keys]]\nkey = \"{SCHEDULED_KEY}\"\ntenant = \"team-scheduled\"\ntier = \"premium\"\n\
             origin = \"scheduled\"\norigins = [\"scheduled\"]\n"
        ),
    )
    .replace(
        "retry_after_ms = 300",
        "retry_after_ms = 300\ndaily_token_budget = 2000",
    );
    let gateway = Gateway::start(&mock.url(), &keys, None);
    let prometheus = Prometheus::start(&format!("127.0.0.1:{}", gateway.admin_port));
    let scraping = eventually(Duration::from_secs(30), async || {
        !prometheus.query("up == 1").await.is_empty()
    })
    .await;
    assert!(scraping, "prometheus never scraped the gateway");
    load(&gateway, &mock).await;

    // Every query must return a series once the load's last counts have been scraped.
    let queries = panel_queries();
    assert!(queries.len() >= 30, "{} queries", queries.len());
    let mut empty = Vec::new();
    let all = eventually(Duration::from_secs(20), async || {
        empty.clear();
        for (title, expr) in &queries {
            if prometheus.query(expr).await.is_empty() {
                empty.push(format!("{title}: {expr}"));
            }
        }
        empty.is_empty()
    })
    .await;
    println!(
        "{} panel queries evaluated in Prometheus, {} without data",
        queries.len(),
        empty.len()
    );
    assert!(all, "panel queries with no data:\n{}", empty.join("\n"));
}
