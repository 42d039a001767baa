-- A tenant's input tokens for the server's current UTC day.
-- KEYS[1] the tenant's token hash {day, n}
local day = math.floor(tonumber(redis.call('TIME')[1]) / 86400)
if tonumber(redis.call('HGET', KEYS[1], 'day')) ~= day then
  return 0
end
return tonumber(redis.call('HGET', KEYS[1], 'n')) or 0
