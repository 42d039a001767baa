-- Counts a tenant's throttles inside the sliding window, without writing.
-- KEYS[1] the tenant's throttle set; ARGV[1] window in ms
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
return redis.call('ZCOUNT', KEYS[1], '(' .. (now - tonumber(ARGV[1])), '+inf')
