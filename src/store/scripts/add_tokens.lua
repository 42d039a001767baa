-- Adds tokens to a tenant's total for the server's current UTC day (negative: a
-- settlement's correction down; the total never goes below 0).
-- KEYS[1] the tenant's token hash {day, n}; ARGV[1] tokens to add
local day = math.floor(tonumber(redis.call('TIME')[1]) / 86400)
if tonumber(redis.call('HGET', KEYS[1], 'day')) ~= day then
  redis.call('HSET', KEYS[1], 'day', day, 'n', 0)
end
local n = redis.call('HINCRBY', KEYS[1], 'n', ARGV[1])
if n < 0 then
  n = 0
  redis.call('HSET', KEYS[1], 'n', 0)
end
-- Two days, so a total is still readable around midnight and then vanishes.
redis.call('EXPIRE', KEYS[1], 172800)
return n
