-- Puts back every call a worker has in flight, as leases (ZADD, not XX: they may be gone),
-- and records the worker in the current epoch.
-- An epoch is a stretch of time in which the lease sets count every call in flight. A new
-- one starts when the epoch key is missing (Redis wiped or restarted) or when the worker
-- asks for one (it is back from an outage: its calls, and maybe others', were not counted).
-- Starting one forgets every worker record, so every worker resyncs before it takes
-- another slot.
-- KEYS[1] global lease set, KEYS[2] worker set, KEYS[3] epoch key,
-- KEYS[4..n] the tier set of each lease below
-- ARGV[1] worker id, ARGV[2] worker TTL in ms, ARGV[3] '1' to start a new epoch,
-- then per lease: its id, its TTL in ms
-- Returns {epoch, workers in this epoch, global count}.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local epoch = redis.call('GET', KEYS[3])
if not epoch or ARGV[3] == '1' then
  epoch = t[1] .. '.' .. t[2]
  redis.call('SET', KEYS[3], epoch)
  redis.call('DEL', KEYS[2])
end
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[2]), ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
for i = 4, #KEYS do
  local id = ARGV[2 * i - 4]
  local expiry = now + tonumber(ARGV[2 * i - 3])
  redis.call('ZADD', KEYS[1], expiry, id)
  redis.call('ZADD', KEYS[i], expiry, id)
end
return {epoch, tostring(redis.call('ZCARD', KEYS[2])), tostring(redis.call('ZCARD', KEYS[1]))}
