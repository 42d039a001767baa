-- Takes a slot lease if the global and the tier counts are both under their caps.
-- A lease is a member of both sets scored by its expiry: expired leases (a crashed worker's)
-- are dropped here, so they come back within one TTL whatever the traffic.
-- KEYS[1] global lease set, KEYS[2] tier lease set
-- ARGV[1] global cap, ARGV[2] tier cap, ARGV[3] lease TTL in ms, ARGV[4] lease id
-- Returns 1 when the lease was taken, 0 when a cap is reached.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[1])
    or redis.call('ZCARD', KEYS[2]) >= tonumber(ARGV[2]) then
  return 0
end
local expiry = now + tonumber(ARGV[3])
redis.call('ZADD', KEYS[1], expiry, ARGV[4])
redis.call('ZADD', KEYS[2], expiry, ARGV[4])
return 1
