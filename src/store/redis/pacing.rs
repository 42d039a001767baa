//! Shared pacing on Redis: one GCRA script reserving every dimension at once.

use std::sync::{Arc, LazyLock};
use std::time::Duration;

use redis::Script;

use super::RedisStore;
use crate::store::StoreFuture;
use crate::store::keys::escape_into;
use crate::store::pacing::PaceLimit;

pub(super) static PACE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../scripts/pace.lua")));

impl RedisStore {
    pub(crate) fn pace(self: &Arc<Self>, key: &str, limits: &[PaceLimit]) -> StoreFuture<Duration> {
        // A global key (one shared hash tag); the name is escaped like a tenant's.
        let mut redis_key = format!("{}:{{g}}:pace:", self.opts.key_prefix);
        escape_into(&mut redis_key, key);
        // While Redis is away each worker paces alone: against its share of the limits, split
        // among the workers last seen alive, as the slot caps are.
        let local_key = key.to_owned();
        let workers = self.alive_workers();
        let local_limits: Vec<PaceLimit> = limits.iter().map(|l| l.share_of(workers)).collect();
        let args: Vec<u64> = limits
            .iter()
            .flat_map(|limit| {
                let (interval, tolerance) = limit.interval_and_tolerance_us();
                [interval, tolerance, limit.cells()]
            })
            .collect();
        self.op(
            move |fallback| fallback.pacers.reserve(&local_key, &local_limits),
            move |this| async move {
                let mut conn = this.conn.clone();
                let wait_us: i64 = PACE
                    .key(redis_key)
                    .arg(&args[..])
                    .invoke_async(&mut conn)
                    .await?;
                Ok(Duration::from_micros(u64::try_from(wait_us).unwrap_or(0)))
            },
        )
    }
}
