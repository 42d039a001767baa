//! The shared cooldown gate on Redis: one hash of reopen times (server clock), a script to
//! move a gate, and the messages (see `pubsub.rs`) that keep every worker's local copy current.
//!
//! A worker checks its local copy ([`CooldownGates`](crate::store::cooldown::CooldownGates) in the
//! fallback state), so holding calls behind a gate costs no round trip. Moving a gate is one
//! script that publishes `"<ms left> <upstream>"`; each worker applies it as
//! "closed for at least that long from now" (relative, so worker clocks never matter). After
//! each (re)subscription the worker reads every gate once, so a move published while it was
//! disconnected is not lost. While Redis is down a gate moves only in this worker.

use std::sync::{Arc, LazyLock};
use std::time::Duration;

use redis::Script;

use super::RedisStore;
use crate::store::StoreFuture;
use crate::store::cooldown::MAX_GATE;

pub(super) static EXTEND: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../scripts/extend_cooldown.lua")));
pub(super) static READ: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../scripts/read_cooldowns.lua")));

fn millis_ceil(d: Duration) -> u64 {
    // At most MAX_GATE: the script turns the delay into a key TTL, and Redis refuses an
    // absurd one only after the gate was written, leaving it closed with no expiry.
    let max = MAX_GATE.as_millis() as u64;
    let ms = d.as_nanos().div_ceil(1_000_000);
    u64::try_from(ms).unwrap_or(max).clamp(1, max)
}

impl RedisStore {
    pub(crate) fn extend_cooldown(
        self: &Arc<Self>,
        upstream: &str,
        delay: Duration,
    ) -> StoreFuture<Duration> {
        let local = upstream.to_owned();
        let upstream = upstream.to_owned();
        self.op(
            move |fallback| fallback.cooldowns.extend(&local, delay),
            move |this| async move {
                let mut conn = this.conn.clone();
                let left_ms: u64 = EXTEND
                    .key(&this.keys.cooldowns)
                    .arg(&upstream)
                    .arg(millis_ceil(delay))
                    .arg(&this.keys.cooldowns_channel)
                    .invoke_async(&mut conn)
                    .await?;
                let left = Duration::from_millis(left_ms);
                this.fallback.cooldowns.extend(&upstream, left);
                Ok(left)
            },
        )
    }

    /// Reads every closed gate into the local copy. A side channel: a failure here is left
    /// to the listener's next reconnect and never marks the store degraded.
    pub(super) async fn resync_cooldowns(&self) {
        let mut conn = self.conn.clone();
        let invocation = READ.key(&self.keys.cooldowns);
        let read = invocation.invoke_async::<Vec<(String, u64)>>(&mut conn);
        if let Ok(Ok(gates)) = tokio::time::timeout(self.opts.op_timeout, read).await {
            for (upstream, left_ms) in gates {
                self.fallback
                    .cooldowns
                    .extend(&upstream, Duration::from_millis(left_ms));
            }
        }
    }

    pub(super) fn apply_cooldown_message(&self, payload: &[u8]) {
        let Ok(text) = std::str::from_utf8(payload) else {
            return;
        };
        let Some((ms, upstream)) = text.split_once(' ') else {
            return;
        };
        if let Ok(ms) = ms.parse::<u64>() {
            self.fallback
                .cooldowns
                .extend(upstream, Duration::from_millis(ms));
        }
    }
}
