//! The first two rows of issue 9 on a real Redis: two workers (two `Store` handles on one
//! throwaway redis-server, each with its own recommended stack — PriorityClassify,
//! RetryAfterBackoff, DrrFairness(32), TierSlotLimit) share the caps through Redis, and a mock
//! upstream counts the calls in flight across both. Real time, scaled down: calls of 200 ms
//! instead of 1 s, max waits a fifth of the defaults. The paused-time versions on the memory
//! store are in `tests/memory/stack.rs`.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::support::{InFlight, RedisServer};
use fairgate::{
    BackoffPolicy, BoxError, Busy, DemotionPolicy, DrrFairnessLayer, Job, PriorityClassifyLayer,
    RetryAfterBackoffLayer, SlotPolicy, Store, TierSlotLimitLayer,
};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tower::{ServiceBuilder, ServiceExt, service_fn};

/// One upstream call, scaled down from 1 s.
const CALL: Duration = Duration::from_millis(200);

/// A mock upstream both workers call, counting what is in flight at it (across workers).
#[derive(Clone, Default)]
struct Upstream {
    seen: Arc<Mutex<InFlight>>,
}

/// A call in flight at the upstream, counted out when it ends or is dropped.
struct Counted {
    seen: Arc<Mutex<InFlight>>,
    tier: String,
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.seen.lock().unwrap().leave(&self.tier);
    }
}

impl Upstream {
    fn service(
        &self,
    ) -> impl tower::Service<
        http::Request<String>,
        Response = http::Response<String>,
        Error = BoxError,
        Future: Send + 'static,
    > + Clone
    + Send
    + Sync
    + 'static {
        let seen = self.seen.clone();
        service_fn(move |req: http::Request<String>| {
            let job = req.extensions().get::<Job>().expect("a job");
            let tier = job.tier().map_or("", |t| t.as_str()).to_owned();
            let guard = {
                seen.lock().unwrap().enter(&tier);
                Counted {
                    seen: seen.clone(),
                    tier,
                }
            };
            async move {
                tokio::time::sleep(CALL).await;
                drop(guard);
                Ok::<_, BoxError>(http::Response::new("ok".to_owned()))
            }
        })
    }

    fn max_in_flight(&self) -> u32 {
        self.seen.lock().unwrap().max()
    }

    fn max_of_tier(&self, tier: &str) -> u32 {
        self.seen.lock().unwrap().max_of_tier(tier)
    }
}

type Stack = tower::util::BoxCloneSyncService<http::Request<String>, (), BoxError>;

/// The default caps with every max wait a fifth of the default, as the calls are.
fn policy() -> SlotPolicy {
    SlotPolicy::builder()
        .tier("premium", 30, Duration::from_secs(12))
        .tier("pro", 20, Duration::from_secs(9))
        .tier("free", 15, Duration::from_millis(2_400))
        .tier("guest", 5, Duration::from_millis(1_600))
        .build()
        .unwrap()
}

/// One worker: its own store handle on the shared Redis, its own window and slot layer.
struct Worker {
    store: Store,
    fair: DrrFairnessLayer,
    stack: Stack,
}

impl Worker {
    async fn start(url: &str, upstream: &Upstream) -> Worker {
        let store = Store::redis(url)
            .await
            .expect("a store on the test's redis");
        // The recommended stack by hand, every wire in sight.
        let slots = TierSlotLimitLayer::new(store.clone(), policy());
        let (retry, rate) =
            RetryAfterBackoffLayer::new(store.clone(), BackoffPolicy::default()).with_gate_below();
        let fair = DrrFairnessLayer::builder(store.clone(), 32)
            .slot_gate(slots.gate())
            .rate_gate(rate)
            .build()
            .unwrap();
        let demotion = DemotionPolicy::builder()
            .default_daily_budget(u64::MAX)
            .throttle_limit(u32::MAX)
            .build()
            .unwrap();
        let service = ServiceBuilder::new()
            .layer(PriorityClassifyLayer::new(store.clone()).demotion(demotion))
            .layer(retry)
            .layer(fair.clone())
            .layer(slots)
            .service(upstream.service())
            // The body is whole at once: dropping the response releases everything.
            .map_response(drop);
        Worker {
            store,
            fair,
            stack: tower::util::BoxCloneSyncService::new(service),
        }
    }
}

/// Two workers on one throwaway Redis, over one upstream.
struct Fleet {
    _server: RedisServer,
    workers: [Worker; 2],
    upstream: Upstream,
}

impl Fleet {
    async fn start() -> Fleet {
        let server = RedisServer::start();
        let upstream = Upstream::default();
        let workers = [
            Worker::start(&server.url(), &upstream).await,
            Worker::start(&server.url(), &upstream).await,
        ];
        for worker in &workers {
            assert!(!worker.store.is_degraded(), "redis answers");
        }
        Fleet {
            _server: server,
            workers,
            upstream,
        }
    }

    /// Sends `job` through worker `w`.
    fn send(&self, w: usize, job: Job) -> JoinHandle<Outcome> {
        let stack = self.workers[w].stack.clone();
        let tier = job.tier().map_or("", |t| t.as_str()).to_owned();
        let mut req = http::Request::new(String::new());
        req.extensions_mut().insert(job);
        tokio::spawn(async move {
            let sent = Instant::now();
            let result = stack.oneshot(req).await;
            let busy = match result {
                Ok(()) => false,
                Err(e) if e.is::<Busy>() => true,
                Err(e) => panic!("only Busy may end a request here, not {e}"),
            };
            Outcome {
                tier,
                took: sent.elapsed(),
                busy,
            }
        })
    }

    /// Once every request has ended: nothing is held in either worker or in Redis (the
    /// releases are sent in the background, so give them a moment).
    async fn assert_drained(&self) {
        let deadline = Instant::now() + Duration::from_secs(2);
        loop {
            let slots = self.workers[0].store.slots_in_use(None).await;
            let held: usize = self.workers.iter().map(|w| w.fair.in_flight()).sum();
            let queued: usize = self.workers.iter().map(|w| w.fair.queued(None)).sum();
            if slots == 0 && held == 0 && queued == 0 {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "still held: {slots} slots, {held} permits, {queued} queued"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

#[derive(Debug)]
struct Outcome {
    tier: String,
    took: Duration,
    busy: bool,
}

use crate::support::{joined as outcomes, percentile};

fn user(tenant: &str, tier: &str) -> Job {
    crate::support::user(tenant, tier).with_cost(1_000)
}

#[tokio::test]
async fn two_workers_guest_flood_leaves_premium_its_slots_fifty_premium_calls_done_in_two_rounds() {
    let _turn = crate::support::file_turn(module_path!());
    let fleet = Fleet::start().await;
    let guests: Vec<_> = (0..200)
        .map(|i| fleet.send(i % 2, user(&format!("guest-{i}"), "guest")))
        .collect();
    tokio::time::sleep(Duration::from_millis(20)).await;
    let premium: Vec<_> = (0..50)
        .map(|i| fleet.send(i % 2, user(&format!("premium-{}", i % 5), "premium")))
        .collect();
    let premium = outcomes(premium).await;
    let last = premium.iter().map(|o| o.took).max().unwrap();
    let guests = outcomes(guests).await;
    let served = guests.iter().filter(|o| !o.busy).count();
    println!(
        "two workers: last of 50 premium calls done after {last:?} behind 200 guests \
         (two rounds: {:?}); guests {served} served, {} busy; max in flight {} (global 30), \
         guests {} (cap 5), premium {}",
        2 * CALL,
        guests.len() - served,
        fleet.upstream.max_in_flight(),
        fleet.upstream.max_of_tier("guest"),
        fleet.upstream.max_of_tier("premium"),
    );
    assert!(premium.iter().all(|o| !o.busy), "every premium call served");
    // 5 guests hold their cap, 25 slots stay for premium: two rounds of 200 ms, plus Redis
    // round trips and the release announcements between the workers.
    assert!(last <= 2 * CALL + Duration::from_millis(600), "{last:?}");
    assert!(served > 0, "guests are served too");
    assert!(fleet.upstream.max_in_flight() <= 30);
    assert!(fleet.upstream.max_of_tier("guest") <= 5);
    fleet.assert_drained().await;
}

#[tokio::test]
async fn two_workers_mixed_flood_paying_tiers_go_first_and_caps_hold() {
    let _turn = crate::support::file_turn(module_path!());
    let fleet = Fleet::start().await;
    // 8 tenants, two per tier, 50 requests each, interleaved, each tenant on both workers.
    let tiers = ["premium", "pro", "free", "guest"];
    let mut handles = Vec::new();
    for round in 0..50 {
        for tier in tiers {
            for k in 0..2 {
                handles.push(fleet.send((round + k) % 2, user(&format!("{tier}-{k}"), tier)));
            }
        }
    }
    let all = outcomes(handles).await;
    let p50 = |tier: &str| {
        percentile(
            all.iter()
                .filter(|o| o.tier == tier)
                .map(|o| o.took)
                .collect(),
            0.5,
        )
    };
    let busy = |tier: &str| all.iter().filter(|o| o.tier == tier && o.busy).count();
    let (premium, pro, free, guest) = (p50("premium"), p50("pro"), p50("free"), p50("guest"));
    println!(
        "two workers, 400 mixed requests: p50 premium {premium:?}, pro {pro:?}, free {free:?}, \
         guest {guest:?}; busy: premium {}, pro {}, free {}, guest {}; max in flight {} \
         (global 30); per tier {:?}",
        busy("premium"),
        busy("pro"),
        busy("free"),
        busy("guest"),
        fleet.upstream.max_in_flight(),
        tiers.map(|t| fleet.upstream.max_of_tier(t)),
    );
    assert!(premium < free && premium < guest, "paying tiers first");
    assert!(pro < free && pro < guest, "paying tiers first");
    assert_eq!(busy("premium"), 0);
    assert!(fleet.upstream.max_in_flight() <= 30);
    for (tier, cap) in [("premium", 30), ("pro", 20), ("free", 15), ("guest", 5)] {
        assert!(fleet.upstream.max_of_tier(tier) <= cap, "{tier}");
    }
    fleet.assert_drained().await;
}
