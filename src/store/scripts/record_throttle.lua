-- Records one throttle for a tenant and counts those inside the sliding window.
-- KEYS[1] the tenant's throttle set (member -> time in ms)
-- ARGV[1] window in ms, ARGV[2] a member unique to this throttle
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local window = tonumber(ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - window)
redis.call('ZADD', KEYS[1], now, ARGV[2])
redis.call('PEXPIRE', KEYS[1], window)
return redis.call('ZCARD', KEYS[1])
