-- Takes a slot lease if the global and the tier counts are both under their caps.
-- A lease is a member of both sets scored by its expiry: expired leases (a crashed worker's)
-- are dropped here, so they come back within one TTL whatever the traffic.
-- The counts are only true if this worker's calls are all in them: when the bookkeeping
-- that says so is gone (no epoch key, another epoch than the worker's, or no live record of
-- the worker: Redis was wiped or restarted, or the worker was away), nothing is taken and
-- the worker is told to resync first.
-- KEYS[1] global lease set, KEYS[2] tier lease set, KEYS[3] worker set, KEYS[4] epoch key
-- ARGV[1] global cap, ARGV[2] tier cap, ARGV[3] lease TTL in ms, ARGV[4] lease id,
-- ARGV[5] worker id, ARGV[6] the epoch the worker synced to
-- With a tenant cap (absent otherwise: then nothing is counted per tenant):
-- KEYS[5] the tenant's lease set in this tier, ARGV[7] the tenant cap
-- Returns {status, global count, tier count, reason}: status 1 when the lease was taken, 0
-- when a cap is reached, -1 when the worker must resync; reason (with status 0) 1 when the
-- global or tier cap is reached, 2 when only the tenant's own cap is.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local record = redis.call('ZSCORE', KEYS[3], ARGV[5])
if redis.call('GET', KEYS[4]) ~= ARGV[6] or not record or tonumber(record) <= now then
  return {-1, 0, 0}
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
local global = redis.call('ZCARD', KEYS[1])
local tier = redis.call('ZCARD', KEYS[2])
if global >= tonumber(ARGV[1]) or tier >= tonumber(ARGV[2]) then
  return {0, global, tier, 1}
end
if KEYS[5] then
  redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', now)
  if redis.call('ZCARD', KEYS[5]) >= tonumber(ARGV[7]) then
    return {0, global, tier, 2}
  end
end
local expiry = now + tonumber(ARGV[3])
redis.call('ZADD', KEYS[1], expiry, ARGV[4])
redis.call('ZADD', KEYS[2], expiry, ARGV[4])
if KEYS[5] then
  redis.call('ZADD', KEYS[5], expiry, ARGV[4])
end
return {1, global + 1, tier + 1}
