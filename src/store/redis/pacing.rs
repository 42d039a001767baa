//! Shared pacing on Redis: one GCRA script reserving every dimension at once.

use std::sync::{Arc, LazyLock};
use std::time::Duration;

use redis::Script;

use super::RedisStore;
use crate::store::StoreFuture;
use crate::store::pacing::PaceLimit;

pub(super) static PACE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../scripts/pace.lua")));

impl RedisStore {
    pub(crate) fn pace(self: &Arc<Self>, key: &str, limits: &[PaceLimit]) -> StoreFuture<Duration> {
        let redis_key = self.keys.global("pace", key);
        let args: Vec<u64> = limits
            .iter()
            .flat_map(|limit| {
                let (interval, tolerance) = limit.interval_and_tolerance_us();
                [interval, tolerance, limit.cells()]
            })
            .collect();
        let local_key = key.to_owned();
        let local_limits = limits.to_vec();
        let workers = self.known_workers();
        self.op(
            move |fallback| {
                // Pacing alone while Redis is away: against this worker's share of the
                // limits, split among the workers last seen alive, as the slot caps are.
                let share: Vec<PaceLimit> =
                    local_limits.iter().map(|l| l.share_of(workers)).collect();
                fallback.pacers.reserve(&local_key, &share)
            },
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
