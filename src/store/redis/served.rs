//! Served cost on Redis: batched locally, sent in the background at most once a second (its
//! buckets are a second wide: sooner would only cost more script calls, one per tenant and
//! worker), one script per tenant (`scripts/add_served_cost.lua`), read back over the window
//! with `scripts/served_cost.lua`. Server time decides the window, so every worker agrees.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use redis::Script;

use super::{Batch, RedisStore};
use crate::TenantId;
use crate::store::StoreFuture;
use crate::store::served::SERVED_WINDOW;

/// The served-cost part of the Redis store: counts not sent yet, and the scripts.
pub(crate) struct ServedRedis {
    pending: Batch,
    /// When the counts were last sent.
    sent: Mutex<Option<Instant>>,
    add: Script,
    read: Script,
}

/// How often the counts go to Redis in the background: the width of a bucket.
const SEND_EVERY: Duration = Duration::from_secs(1);

impl ServedRedis {
    pub(crate) fn new() -> Self {
        ServedRedis {
            pending: Batch::default(),
            sent: Mutex::new(None),
            add: Script::new(include_str!("../scripts/add_served_cost.lua")),
            read: Script::new(include_str!("../scripts/served_cost.lua")),
        }
    }
}

impl ServedRedis {
    pub(super) fn scripts(&self) -> [&Script; 2] {
        [&self.add, &self.read]
    }
}

impl RedisStore {
    pub(crate) fn add_served_cost(&self, tenant: &TenantId, cost: u64) {
        if self.is_degraded() {
            self.fallback.add_served_cost(tenant, cost);
        }
        self.batch_add(&self.served.pending, tenant, cost);
    }

    /// Sends the batched served counts with the window length: when `now`, or when a
    /// second has passed since they were last sent.
    pub(super) async fn flush_served(&self, now: bool) {
        {
            let mut sent = super::lock(&self.served.sent);
            if !now && sent.is_some_and(|at| at.elapsed() < SEND_EVERY) {
                return;
            }
            *sent = Some(Instant::now());
        }
        let window = SERVED_WINDOW.as_secs();
        self.flush_batch(&self.served.pending, "served", &self.served.add, &[window])
            .await;
    }

    pub(crate) fn served_cost(self: &Arc<Self>, tenant: &TenantId) -> StoreFuture<u64> {
        let key = self.keys.tenant(tenant, "served");
        let tenant = tenant.clone();
        self.op(
            move |local| local.served_cost(&tenant),
            move |this| async move {
                let mut conn = this.conn.clone();
                this.served
                    .read
                    .key(key)
                    .arg(SERVED_WINDOW.as_secs())
                    .invoke_async(&mut conn)
                    .await
            },
        )
    }
}
