-- Renews this worker's leases and its own liveness, and counts the workers alive.
-- XX: a lease already released or expired is never brought back.
-- KEYS[1] global lease set, KEYS[2] worker set, KEYS[3..n] the tier set of each lease below
-- ARGV[1] worker id, ARGV[2] worker TTL in ms, then per lease: its id, its TTL in ms
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[2]), ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
for i = 3, #KEYS do
  local id = ARGV[2 * i - 3]
  local expiry = now + tonumber(ARGV[2 * i - 2])
  redis.call('ZADD', KEYS[1], 'XX', expiry, id)
  redis.call('ZADD', KEYS[i], 'XX', expiry, id)
end
return redis.call('ZCARD', KEYS[2])
