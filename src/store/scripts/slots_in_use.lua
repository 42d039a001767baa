-- Counts unexpired leases in one lease set (global or a tier's).
-- KEYS[1] lease set
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
return redis.call('ZCOUNT', KEYS[1], '(' .. now, '+inf')
