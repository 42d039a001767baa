-- A tenant's served cost over the last ARGV[1] seconds of server time.
-- KEYS[1] the tenant's served hash {second -> cost}; ARGV[1] window in seconds
local now = tonumber(redis.call('TIME')[1])
local window = tonumber(ARGV[1])
local fields = redis.call('HGETALL', KEYS[1])
local total = 0
for i = 1, #fields, 2 do
  if tonumber(fields[i]) > now - window then
    total = total + tonumber(fields[i + 1])
  end
end
return total
