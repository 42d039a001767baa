//! The pub/sub feeds a Redis store listens to, on **one** connection per store: wake-ups
//! for freed slots (on this worker's own channel: a release picked it, `redis/wakes.rs`)
//! and cooldown gate moves (keep the local gate copy current). The listener subscribes to both, catches up on what it may have missed,
//! applies every message, and subscribes again when the connection is lost or when the
//! store comes back from an outage (a connection that lived through it may be half-open and
//! silent, or, on a cluster, point at a master that is gone).
//!
//! - **One node**: a RESP2 pub/sub connection, `SUBSCRIBE` to both channels. The server
//!   closing it (killed, restarted) degrades the store at once: the first sign of the fault,
//!   while the calls in flight still hold the slots the outage is served from.
//! - **Cluster**: a cluster connection in RESP3 (the only way the cluster client delivers
//!   messages), `SSUBSCRIBE` to the wake channel (sharded pub/sub, Redis 7: it shares the
//!   `{slots}` hash tag, so the release script `SPUBLISH`es it on the shard that owns the
//!   slot keys and only that shard carries it) and `SUBSCRIBE` to the cooldown channel
//!   (rare messages, broadcast over the cluster bus). The cluster client resubscribes by
//!   itself after a reconnect; each (re)subscription it confirms is a catch-up here too.

use std::sync::{Arc, Weak};
use std::time::Duration;

use futures_util::StreamExt;
use redis::{PushKind, Value};

use super::RedisStore;
use super::conn::Target;

/// How often an idle listener checks that its store still exists.
const LIVENESS: Duration = Duration::from_millis(500);

/// What a message is about.
#[derive(Clone, Copy, Debug)]
enum Feed {
    /// A release woke this worker for a freed slot.
    SlotWakes,
    /// Cooldown gates moved by any worker.
    CooldownMoves,
}

impl Feed {
    fn of(redis: &RedisStore, channel: &[u8]) -> Option<Feed> {
        if channel.strip_prefix(redis.keys.slots_wake.as_bytes())
            == Some(redis.worker_id.as_bytes())
        {
            Some(Feed::SlotWakes)
        } else if channel == redis.keys.cooldowns_channel.as_bytes() {
            Some(Feed::CooldownMoves)
        } else {
            None
        }
    }

    /// After each (re)subscription: what was published while this worker was not listening
    /// may have been missed.
    async fn catch_up(self, redis: &RedisStore) {
        match self {
            // A missed wake-up: let the waiters try again now rather than at their poll.
            Feed::SlotWakes => redis.wake_everyone(),
            Feed::CooldownMoves => redis.resync_cooldowns().await,
        }
    }

    fn apply(self, redis: &Arc<RedisStore>, payload: &[u8]) {
        match self {
            Feed::SlotWakes => redis.wake_arrived(payload),
            Feed::CooldownMoves => redis.apply_cooldown_message(payload),
        }
    }
}

/// One message or event from the connection.
enum Event {
    Message(Vec<u8>, Vec<u8>),
    /// A (re)subscription confirmed: catch up on this channel.
    Subscribed(Vec<u8>),
    /// The connection is gone: subscribe again.
    Closed,
}

/// Listens to both feeds for as long as the store exists.
pub(super) async fn listen(store: Weak<RedisStore>) {
    loop {
        let Some(redis) = store.upgrade() else { return };
        let target = redis.target.clone();
        let channels = [
            format!("{}{}", redis.keys.slots_wake, redis.worker_id),
            redis.keys.cooldowns_channel.clone(),
        ];
        // Subscribing opens a connection of its own: a few operations' worth of time.
        let timeout = redis.opts.op_timeout.saturating_mul(4);
        let op_timeout = redis.opts.op_timeout;
        let pause = redis.opts.probe_interval;
        let mut recovered = redis.recovered.subscribe();
        drop(redis);
        let subscribed =
            tokio::time::timeout(timeout, subscribe(&target, &channels, op_timeout)).await;
        if let Ok(Ok(mut events)) = subscribed {
            // Subscribed first, caught up second: anything in between arrives as a message.
            match store.upgrade() {
                Some(redis) => {
                    Feed::SlotWakes.catch_up(&redis).await;
                    Feed::CooldownMoves.catch_up(&redis).await;
                }
                None => return,
            }
            loop {
                tokio::select! {
                    event = events.next() => {
                        let Some(redis) = store.upgrade() else { return };
                        match event {
                            Event::Message(channel, payload) => {
                                if let Some(feed) = Feed::of(&redis, &channel) {
                                    feed.apply(&redis, &payload);
                                }
                            }
                            Event::Subscribed(channel) => {
                                if let Some(feed) = Feed::of(&redis, &channel) {
                                    feed.catch_up(&redis).await;
                                }
                            }
                            Event::Closed => {
                                // The server closed it: going away or gone. Said now,
                                // not when an operation times out, calls ending meanwhile
                                // would send releases whose outcome is unknown, and their
                                // slots would be lost to this worker's share of the outage.
                                // (A cluster's client reconnects by itself.)
                                if !redis.target.is_cluster() {
                                    redis.mark_degraded("the subscription was closed");
                                }
                                break;
                            }
                        }
                    },
                    // Back from an outage: this connection may be half-open or stale.
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

/// The subscribed connection, as a stream of events.
enum Events {
    Node(redis::aio::PubSubStream),
    Cluster {
        /// Holds the cluster connection (and so its subscriptions) open.
        _conn: redis::cluster_async::ClusterConnection,
        pushes: tokio::sync::mpsc::UnboundedReceiver<redis::PushInfo>,
    },
}

impl Events {
    async fn next(&mut self) -> Event {
        match self {
            Events::Node(messages) => match messages.next().await {
                Some(message) => Event::Message(
                    message.get_channel_name().as_bytes().to_vec(),
                    message.get_payload_bytes().to_vec(),
                ),
                None => Event::Closed,
            },
            Events::Cluster { pushes, .. } => loop {
                let Some(push) = pushes.recv().await else {
                    return Event::Closed;
                };
                let mut data = push.data.into_iter();
                let channel = match data.next() {
                    Some(Value::BulkString(channel)) => channel,
                    _ => continue,
                };
                match push.kind {
                    PushKind::Message | PushKind::SMessage => {
                        if let Some(Value::BulkString(payload)) = data.next() {
                            return Event::Message(channel, payload);
                        }
                    }
                    PushKind::Subscribe | PushKind::SSubscribe => {
                        return Event::Subscribed(channel);
                    }
                    // Disconnections: the cluster client reconnects and resubscribes, and
                    // says so with a (S)Subscribe push, handled above.
                    _ => {}
                }
            },
        }
    }
}

async fn subscribe(
    target: &Target,
    [wakes, cooldowns]: &[String; 2],
    op_timeout: Duration,
) -> redis::RedisResult<Events> {
    match target {
        Target::Node(client) => {
            let mut pubsub = client.get_async_pubsub().await?;
            pubsub.subscribe(&[wakes, cooldowns]).await?;
            Ok(Events::Node(pubsub.into_on_message()))
        }
        Target::Cluster { .. } => {
            let client = target.cluster_client(op_timeout, true)?;
            let (tx, pushes) = tokio::sync::mpsc::unbounded_channel();
            let config = redis::cluster::ClusterConfig::new()
                .set_connection_timeout(op_timeout)
                .set_response_timeout(op_timeout)
                .set_push_sender(tx);
            let mut conn = client.get_async_connection_with_config(config).await?;
            conn.ssubscribe(wakes).await?;
            conn.subscribe(cooldowns).await?;
            Ok(Events::Cluster {
                _conn: conn,
                pushes,
            })
        }
    }
}
