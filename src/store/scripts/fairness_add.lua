-- Adds what the fair queues dispatched to the fleet's fairness window (one hash, so one
-- call carries a worker's whole batch): per tenant, the cost served divided by its tier
-- weight, in buckets of ARGV[2] seconds of server time, and whether any of it waited in a
-- queue in that bucket (the tenant was backlogged). fairness_index.lua reads it.
-- KEYS[1] the window's hash; ARGV[1] the window in seconds, ARGV[2] a bucket's width in
-- seconds, then per tenant: its name, cost / weight, '1' if it waited in a queue else '0'
local now = tonumber(redis.call('TIME')[1])
local bucket = math.floor(now / tonumber(ARGV[2]))
for i = 3, #ARGV, 3 do
  redis.call('HINCRBYFLOAT', KEYS[1], bucket .. '|' .. ARGV[i], ARGV[i + 1])
  if ARGV[i + 2] == '1' then
    redis.call('HSET', KEYS[1], 'q|' .. bucket .. '|' .. ARGV[i], 1)
  end
end
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[1]) + tonumber(ARGV[2]))
return 1
