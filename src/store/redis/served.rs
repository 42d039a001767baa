//! Served cost on Redis: batched locally, sent in the background with the token counts, one
//! script per tenant (`scripts/add_served_cost.lua`), read back over the window with
//! `scripts/served_cost.lua`. Server time decides the window, so every worker agrees.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use redis::{RedisError, RedisResult, Script};

use super::{RedisStore, is_outage, lock};
use crate::TenantId;
use crate::store::StoreFuture;
use crate::store::served::SERVED_WINDOW;

/// Pending tenants past which a flush starts before its interval.
const FLUSH_AT_TENANTS: usize = 1024;

/// The served-cost part of the Redis store: counts not sent yet, and the scripts.
pub(crate) struct ServedRedis {
    pending: Mutex<HashMap<TenantId, u64>>,
    add: Script,
    read: Script,
}

impl ServedRedis {
    pub(crate) fn new() -> Self {
        ServedRedis {
            pending: Mutex::new(HashMap::new()),
            add: Script::new(include_str!("../scripts/add_served_cost.lua")),
            read: Script::new(include_str!("../scripts/served_cost.lua")),
        }
    }
}

impl RedisStore {
    pub(crate) fn add_served_cost(&self, tenant: &TenantId, cost: u64) {
        if self.is_degraded() {
            self.fallback.add_served_cost(tenant, cost);
        }
        let mut pending = lock(&self.served.pending);
        let total = pending.entry(tenant.clone()).or_insert(0);
        *total = total.saturating_add(cost);
        if pending.len() >= FLUSH_AT_TENANTS {
            self.wake.notify_one();
        }
    }

    /// Sends the batched served counts (pipelined over the multiplexed connection); counts
    /// Redis refused are kept for the next flush, as the token counts are.
    pub(super) async fn flush_served(&self) {
        let batch = std::mem::take(&mut *lock(&self.served.pending));
        if batch.is_empty() {
            return;
        }
        let window = SERVED_WINDOW.as_secs();
        let calls = batch.iter().map(|(tenant, &cost)| {
            let mut conn = self.conn.clone();
            let key = self.keys.tenant(tenant, "served");
            async move {
                let sent: RedisResult<u64> = self
                    .served
                    .add
                    .key(key)
                    .arg(cost)
                    .arg(window)
                    .invoke_async(&mut conn)
                    .await;
                sent.err()
            }
        });
        let all = async { Ok::<_, RedisError>(futures_util::future::join_all(calls).await) };
        let Some(errors) = self.guard(all).await else {
            // Timed out as a whole: dropping under-counts one flush at most; resending
            // could count twice.
            return;
        };
        let mut pending = lock(&self.served.pending);
        for ((tenant, cost), error) in batch.into_iter().zip(errors) {
            if let Some(e) = error {
                if is_outage(&e) {
                    self.mark_degraded(&e.to_string());
                }
                let total = pending.entry(tenant).or_insert(0);
                *total = total.saturating_add(cost);
            }
        }
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
