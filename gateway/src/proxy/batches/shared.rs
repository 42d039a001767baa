//! The owner book on Redis (with `--redis`): every gateway of the fleet answers an owner for
//! the batches it created through any of them.
//!
//! One sorted set per owner, `fairgate:gateway:batches:{<owner hash>}`: its members are the
//! owner's batch ids, scored by when they were recorded (Redis's clock, in ms, one more than
//! the newest when two fall in one ms, so the order is the order of creation). Owning a
//! batch is being a member of one's own set within the retention, so no key names another
//! key's batches and every script touches one key (the braces make it Redis Cluster safe).
//! Each write drops what is past the retention and sets the key to expire with it; an owner
//! keeps at most [`PER_OWNER`] ids, the oldest dropped first.
//!
//! The upstream each batch was created through is kept beside the set, in a hash of the
//! same owner, `fairgate:gateway:batches:{<owner hash>}:upstreams` (id to upstream name),
//! pruned with the set. A batch with no entry there was recorded by a gateway that kept no
//! upstreams (the set's format is unchanged, so either reads the other's): it is the first
//! Anthropic upstream's.
//!
//! Its own connection (a lazy [`ConnectionManager`]) with short timeouts: when Redis does
//! not answer within them, the batch routes are refused (`503`), never answered from a
//! partial book.

use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{RedisResult, Script};

use super::book::{Cursor, Holder, Owner, PageIds, RETENTION};

/// Batch ids kept per owner at most.
pub(crate) const PER_OWNER: usize = 100_000;

/// How long a command may take before the batch route is refused.
const TIMEOUT: Duration = Duration::from_millis(1_000);

const PREFIX: &str = "fairgate:gateway:batches:";

/// Drops the owner's ids past the retention (ms, the argument) from the set (`KEYS[1]`) and
/// their upstreams (`KEYS[2]`); the start of the scripts that prune.
const PRUNE: &str = r"
local function forget(ids)
  for i = 1, #ids, 1000 do
    redis.call('HDEL', KEYS[2], unpack(ids, i, math.min(i + 999, #ids)))
  end
end
local function prune(retention)
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local cutoff = '(' .. (now - retention)
  local expired = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', cutoff)
  if #expired > 0 then
    redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', cutoff)
    forget(expired)
  end
  return now
end
";

/// ARGV: id, retention ms, per-owner cap, key ttl s, upstream (empty: none).
const RECORD: &str = r"
local now = prune(tonumber(ARGV[2]))
if redis.call('ZSCORE', KEYS[1], ARGV[1]) then return 0 end
local newest = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
if newest[2] and tonumber(newest[2]) >= now then now = tonumber(newest[2]) + 1 end
redis.call('ZADD', KEYS[1], now, ARGV[1])
if ARGV[5] ~= '' then redis.call('HSET', KEYS[2], ARGV[1], ARGV[5]) end
local extra = redis.call('ZCARD', KEYS[1]) - tonumber(ARGV[3])
if extra > 0 then
  forget(redis.call('ZRANGE', KEYS[1], 0, extra - 1))
  redis.call('ZREMRANGEBYRANK', KEYS[1], 0, extra - 1)
end
redis.call('EXPIRE', KEYS[1], ARGV[4])
if redis.call('EXISTS', KEYS[2]) == 1 then redis.call('EXPIRE', KEYS[2], ARGV[4]) end
return 1
";

/// ARGV: id, retention ms. `{1, upstream}` when the id is the owner's and within the
/// retention (the upstream empty when none was recorded), else `{0}`.
const OWNS: &str = r"
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not score then return {0} end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if tonumber(score) < now - tonumber(ARGV[2]) then return {0} end
return {1, redis.call('HGET', KEYS[2], ARGV[1]) or ''}
";

/// ARGV: mode (`first`, `after`, `before`), cursor id, limit, retention ms.
/// Returns `{-1}` when the cursor is not the owner's, else `{has_more, id, upstream, ...}`
/// newest first (an upstream empty when none was recorded). The window is
/// `book::window`'s, rank 0 the newest.
const PAGE: &str = r"
prune(tonumber(ARGV[4]))
local len = redis.call('ZCARD', KEYS[1])
local limit = tonumber(ARGV[3])
local start, stop, more
if ARGV[1] == 'first' then
  start = 0
  stop = math.min(limit, len)
  more = len > stop
else
  local rank = redis.call('ZREVRANK', KEYS[1], ARGV[2])
  if not rank then return {-1} end
  if ARGV[1] == 'after' then
    start = math.min(rank + 1, len)
    stop = math.min(start + limit, len)
    more = len > stop
  else
    stop = math.min(rank, len)
    start = math.max(stop - limit, 0)
    more = start > 0
  end
end
local out = {more and 1 or 0}
if stop > start then
  for _, id in ipairs(redis.call('ZREVRANGE', KEYS[1], start, stop - 1)) do
    table.insert(out, id)
    table.insert(out, redis.call('HGET', KEYS[2], id) or '')
  end
end
return out
";

/// The Redis book; cheap to clone (the clones share one connection).
#[derive(Clone)]
pub(crate) struct RedisBook {
    conn: ConnectionManager,
    record: std::sync::Arc<Script>,
    owns: std::sync::Arc<Script>,
    page: std::sync::Arc<Script>,
}

impl RedisBook {
    /// A book on the Redis at `url`; connects lazily (on first use, and again after an outage).
    pub(crate) fn new(url: &str) -> RedisResult<RedisBook> {
        let client = redis::Client::open(url)?;
        let config = ConnectionManagerConfig::new()
            .set_number_of_retries(1)
            .set_min_delay(Duration::from_millis(10))
            .set_max_delay(Duration::from_millis(50))
            .set_connection_timeout(Some(TIMEOUT))
            .set_response_timeout(Some(TIMEOUT));
        let conn = ConnectionManager::new_lazy_with_config(client, config)?;
        Ok(RedisBook {
            conn,
            record: Script::new(&format!("{PRUNE}{RECORD}")).into(),
            owns: Script::new(OWNS).into(),
            page: Script::new(&format!("{PRUNE}{PAGE}")).into(),
        })
    }

    fn key(owner: &Owner) -> String {
        format!("{PREFIX}{{{}}}", owner.as_str())
    }

    /// The owner's batches' upstreams (same hash slot as [`key`](Self::key)).
    fn upstreams_key(owner: &Owner) -> String {
        format!("{PREFIX}{{{}}}:upstreams", owner.as_str())
    }

    pub(crate) async fn ping(&self) -> RedisResult<()> {
        redis::cmd("PING")
            .query_async::<()>(&mut self.conn.clone())
            .await
    }

    /// Records `id` as `owner`'s, created through `upstream` (`None`: none recorded).
    pub(crate) async fn record(
        &self,
        owner: &Owner,
        id: &str,
        upstream: Option<&str>,
    ) -> RedisResult<()> {
        self.record
            .key(Self::key(owner))
            .key(Self::upstreams_key(owner))
            .arg(id)
            .arg(RETENTION.as_millis() as u64)
            .arg(PER_OWNER)
            .arg(RETENTION.as_secs())
            .arg(upstream.unwrap_or(""))
            .invoke_async::<i64>(&mut self.conn.clone())
            .await
            .map(drop)
    }

    /// The upstream holding `id` when `owner` owns it, else `None`.
    pub(crate) async fn owns(&self, owner: &Owner, id: &str) -> RedisResult<Option<Holder>> {
        let reply: Vec<redis::Value> = self
            .owns
            .key(Self::key(owner))
            .key(Self::upstreams_key(owner))
            .arg(id)
            .arg(RETENTION.as_millis() as u64)
            .invoke_async(&mut self.conn.clone())
            .await?;
        match reply.as_slice() {
            [redis::Value::Int(0)] => Ok(None),
            [redis::Value::Int(1), holder] => Ok(Some(holder_of(holder)?)),
            _ => Err(unexpected("the owns script answered neither 0 nor 1")),
        }
    }

    pub(crate) async fn forget(&self, owner: &Owner, id: &str) -> RedisResult<()> {
        redis::pipe()
            .atomic()
            .zrem(Self::key(owner), id)
            .ignore()
            .hdel(Self::upstreams_key(owner), id)
            .ignore()
            .query_async::<()>(&mut self.conn.clone())
            .await
    }

    pub(crate) async fn page(
        &self,
        owner: &Owner,
        cursor: &Cursor,
        limit: usize,
    ) -> RedisResult<Option<PageIds>> {
        let (mode, id) = match cursor {
            Cursor::First => ("first", ""),
            Cursor::After(id) => ("after", id.as_str()),
            Cursor::Before(id) => ("before", id.as_str()),
        };
        let reply: Vec<redis::Value> = self
            .page
            .key(Self::key(owner))
            .key(Self::upstreams_key(owner))
            .arg(mode)
            .arg(id)
            .arg(limit)
            .arg(RETENTION.as_millis() as u64)
            .invoke_async(&mut self.conn.clone())
            .await?;
        let mut reply = reply.into_iter();
        let has_more = match reply.next() {
            Some(redis::Value::Int(-1)) => return Ok(None),
            Some(redis::Value::Int(more)) => more == 1,
            _ => return Err(unexpected("the page script answered no flag")),
        };
        let reply: Vec<redis::Value> = reply.collect();
        let mut ids = Vec::with_capacity(reply.len() / 2);
        for pair in reply.chunks(2) {
            let [id, holder] = pair else {
                return Err(unexpected(
                    "the page script answered an id without its upstream",
                ));
            };
            let id = string_of(id)
                .ok_or_else(|| unexpected("the page script answered an id that is no string"))?;
            ids.push((id, holder_of(holder)?));
        }
        Ok(Some(PageIds { ids, has_more }))
    }
}

fn string_of(value: &redis::Value) -> Option<String> {
    match value {
        redis::Value::BulkString(bytes) => String::from_utf8(bytes.clone()).ok(),
        redis::Value::SimpleString(text) => Some(text.clone()),
        _ => None,
    }
}

/// A script's upstream: empty for none.
fn holder_of(value: &redis::Value) -> RedisResult<Holder> {
    let name = string_of(value).ok_or_else(|| unexpected("an upstream that is no string"))?;
    Ok((!name.is_empty()).then_some(name))
}

fn unexpected(what: &'static str) -> redis::RedisError {
    redis::RedisError::from((redis::ErrorKind::UnexpectedReturnType, what))
}
