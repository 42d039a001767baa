-- Adds dispatched cost to a tenant's served counts, one field per server second, and drops
-- the seconds that slid out of the window.
-- KEYS[1] the tenant's served hash {second -> cost}; ARGV[1] cost; ARGV[2] window in seconds
local now = tonumber(redis.call('TIME')[1])
local window = tonumber(ARGV[2])
redis.call('HINCRBY', KEYS[1], now, ARGV[1])
-- At most window + 1 fields: the scan is bounded.
for _, second in ipairs(redis.call('HKEYS', KEYS[1])) do
  if tonumber(second) <= now - window then
    redis.call('HDEL', KEYS[1], second)
  end
end
redis.call('EXPIRE', KEYS[1], window + 1)
return 1
