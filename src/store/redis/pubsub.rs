//! The pub/sub feeds a Redis store listens to: slot releases (wake this worker's waiters)
//! and cooldown gate moves (keep the local gate copy current). One listener loop serves
//! both: it subscribes, catches up on what it may have missed, applies every message, and
//! subscribes again when the connection is lost or when the store comes back from an outage
//! (a connection that lived through it may be half-open and silent).

use std::sync::Weak;
use std::time::Duration;

use futures_util::StreamExt;

use super::RedisStore;

/// How often an idle listener checks that its store still exists.
const LIVENESS: Duration = Duration::from_millis(500);

/// What a listener listens to.
#[derive(Clone, Copy, Debug)]
pub(super) enum Feed {
    /// Slots released by any worker.
    SlotReleases,
    /// Cooldown gates moved by any worker.
    CooldownMoves,
}

impl Feed {
    fn channel(self, redis: &RedisStore) -> String {
        match self {
            Feed::SlotReleases => redis.keys.slots_released.clone(),
            Feed::CooldownMoves => redis.keys.cooldowns_channel.clone(),
        }
    }

    /// After each (re)subscription: what was published while this worker was not listening
    /// may have been missed.
    async fn catch_up(self, redis: &RedisStore) {
        match self {
            // A missed release: let the waiters try again now rather than at their poll.
            Feed::SlotReleases => redis.fallback.slots.released.notify_waiters(),
            Feed::CooldownMoves => redis.resync_cooldowns().await,
        }
    }

    fn apply(self, redis: &RedisStore, payload: &[u8]) {
        match self {
            Feed::SlotReleases => redis.fallback.slots.released.notify_waiters(),
            Feed::CooldownMoves => redis.apply_cooldown_message(payload),
        }
    }
}

/// Listens to `feed` for as long as the store exists.
pub(super) async fn listen(store: Weak<RedisStore>, feed: Feed) {
    loop {
        let Some(redis) = store.upgrade() else { return };
        let client = redis.client.clone();
        let channel = feed.channel(&redis);
        // Subscribing opens a connection of its own: a few operations' worth of time.
        let timeout = redis.opts.op_timeout.saturating_mul(4);
        let pause = redis.opts.probe_interval;
        let mut recovered = redis.recovered.subscribe();
        drop(redis);
        let subscribed = tokio::time::timeout(timeout, async {
            let mut pubsub = client.get_async_pubsub().await?;
            pubsub.subscribe(&channel).await?;
            Ok::<_, redis::RedisError>(pubsub)
        })
        .await;
        if let Ok(Ok(pubsub)) = subscribed {
            // Subscribed first, caught up second: anything in between arrives as a message.
            match store.upgrade() {
                Some(redis) => feed.catch_up(&redis).await,
                None => return,
            }
            let mut messages = pubsub.into_on_message();
            loop {
                tokio::select! {
                    message = messages.next() => match message {
                        Some(message) => match store.upgrade() {
                            Some(redis) => feed.apply(&redis, message.get_payload_bytes()),
                            None => return,
                        },
                        // The connection is gone: subscribe again.
                        None => break,
                    },
                    // Back from an outage: this connection may be half-open.
                    _ = recovered.changed() => break,
                    _ = tokio::time::sleep(LIVENESS) => {
                        if store.strong_count() == 0 {
                            return;
                        }
                    }
                }
            }
        }
        tokio::time::sleep(pause).await;
    }
}
