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

pub(super) static EXTEND: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../scripts/extend_cooldown.lua")));
pub(super) static READ: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../scripts/read_cooldowns.lua")));

fn gates_key(prefix: &str) -> String {
    // A global key: one shared hash tag (the prefix was validated: no braces).
    format!("{prefix}:{{g}}:cooldowns")
}

fn channel(prefix: &str) -> String {
    format!("{prefix}:cooldowns")
}

fn millis_ceil(d: Duration) -> u64 {
    // At most a day: the script turns the delay into a key TTL, and Redis refuses an
    // absurd one only after the gate was written, leaving it closed with no expiry.
    const DAY_MS: u64 = 24 * 60 * 60 * 1000;
    let ms = d.as_nanos().div_ceil(1_000_000);
    u64::try_from(ms).unwrap_or(DAY_MS).clamp(1, DAY_MS)
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
                let prefix = &this.opts.key_prefix;
                let left_ms: u64 = EXTEND
                    .key(gates_key(prefix))
                    .arg(&upstream)
                    .arg(millis_ceil(delay))
                    .arg(channel(prefix))
                    .invoke_async(&mut conn)
                    .await?;
                let left = Duration::from_millis(left_ms);
                this.fallback.cooldowns.extend(&upstream, left);
                Ok(left)
            },
        )
    }

    /// The channel gate moves are published on.
    pub(super) fn cooldown_channel(&self) -> String {
        channel(&self.opts.key_prefix)
    }

    /// Reads every closed gate into the local copy. A side channel: a failure here is left
    /// to the listener's next reconnect and never marks the store degraded.
    pub(super) async fn resync_cooldowns(&self) {
        let mut conn = self.conn.clone();
        let invocation = READ.key(gates_key(&self.opts.key_prefix));
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
