//! Shared pacing on Redis: one GCRA script reserving every dimension at once.

use std::sync::{Arc, LazyLock};
use std::time::Duration;

use redis::Script;

use super::RedisStore;
use crate::store::StoreFuture;
use crate::store::pacing::{DIMS, LearnedLimits, PaceAsk, PaceGrant, PaceLimit};

pub(super) const PACE_SOURCE: &str = concat!(
    include_str!("../scripts/gcra.lua"),
    include_str!("../scripts/pace.lua")
);

pub(super) static PACE: LazyLock<Script> = LazyLock::new(|| Script::new(PACE_SOURCE));

impl RedisStore {
    pub(crate) fn pace(self: &Arc<Self>, key: &str, limits: &[PaceLimit]) -> StoreFuture<Duration> {
        let redis_key = self.keys.global("pace", key);
        let args = pace_args(limits);
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

/// The pace script's arguments: per dimension its rate (interval in microseconds, capacity)
/// and this call's cells.
pub(super) fn pace_args(limits: &[PaceLimit]) -> Vec<i64> {
    limits
        .iter()
        .flat_map(|limit| {
            let rate = limit.rate();
            [rate.interval(), rate.capacity(), limit.cells()]
        })
        .collect()
}

pub(super) const LEARNED_PACE_SOURCE: &str = concat!(
    include_str!("../scripts/gcra.lua"),
    include_str!("../scripts/learned_pace.lua")
);

pub(super) static LEARNED_PACE: LazyLock<Script> =
    LazyLock::new(|| Script::new(LEARNED_PACE_SOURCE));

impl RedisStore {
    pub(crate) fn pace_learned(
        self: &Arc<Self>,
        key: &str,
        ask: &PaceAsk,
    ) -> StoreFuture<PaceGrant> {
        let redis_key = self.keys.global("learn", key);
        let args = learned_args(ask);
        let local_key = key.to_owned();
        let mut local_ask = *ask;
        // Alone while Redis is away: this worker's own mirror (learned afresh from the
        // answers it gets meanwhile), aiming at its share of each learned rate — the rate
        // split among the workers it knows of, as the slot caps and configured pacing are.
        let workers = self.known_workers().max(1);
        local_ask.headroom_permille = (ask.headroom_permille / workers).max(1);
        self.op(
            move |fallback| fallback.pacers.learned(&local_key, &local_ask),
            move |this| async move {
                let mut conn = this.conn.clone();
                let out: Vec<i64> = LEARNED_PACE
                    .key(redis_key)
                    .arg(&args[..])
                    .invoke_async(&mut conn)
                    .await?;
                Ok(learned_grant(&out))
            },
        )
    }

    pub(crate) fn learned_limits(self: &Arc<Self>, key: &str) -> StoreFuture<LearnedLimits> {
        let redis_key = self.keys.global("learn", key);
        let local_key = key.to_owned();
        self.op(
            move |fallback| fallback.pacers.learned_limits(&local_key),
            move |this| async move {
                let mut conn = this.conn.clone();
                let limits: Vec<Option<u32>> = redis::cmd("HMGET")
                    .arg(redis_key)
                    .arg(&["l1", "l2", "l3", "l4"])
                    .query_async(&mut conn)
                    .await?;
                let get = |i: usize| limits.get(i).copied().flatten().unwrap_or(0);
                Ok(LearnedLimits::from_array([get(0), get(1), get(2), get(3)]))
            },
        )
    }
}

/// The learned pace script's arguments (see the script's header).
pub(super) fn learned_args(ask: &PaceAsk) -> Vec<i64> {
    let mut args: Vec<i64> = vec![
        i64::from(ask.headroom_permille),
        i64::from(ask.answered),
        ask.probe_lease_us,
        ask.recover_us,
        ask.poll_us,
    ];
    for d in 0..DIMS {
        args.extend([
            i64::from(ask.learn[d].0),
            i64::from(ask.learn[d].1),
            ask.charge[d],
            i64::from(ask.take[d]),
        ]);
    }
    args.push(i64::from(ask.queued));
    args
}

/// The learned pace script's reply as a grant.
pub(super) fn learned_grant(out: &[i64]) -> PaceGrant {
    let get = |i: usize| out.get(i).copied().unwrap_or(0);
    let micros = |v: i64| Duration::from_micros(u64::try_from(v).unwrap_or(0));
    let limit = |i: usize| u32::try_from(get(i)).unwrap_or(0);
    PaceGrant {
        wait: micros(get(0)),
        hold: micros(get(1)),
        probe: get(2) == 1,
        mode: u8::try_from(get(3)).unwrap_or(0),
        recovering: get(4) == 1,
        limits: [limit(5), limit(6), limit(7), limit(8)],
    }
}
