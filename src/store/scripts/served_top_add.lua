-- Adds a worker's batch of served cost to the fleet's ranking of tenants (served_top.lua
-- reads it): a ring of sorted sets, one per bucket of ARGV[1] seconds of server time, each
-- keeping the ARGV[2] tenants served most in its bucket (the ranking is of the top: the
-- per-tenant counts of add_served_cost.lua stay exact), and the total of every tenant per
-- bucket. A bounded read however many tenants there are.
-- KEYS[1..n] the ring's sorted sets; KEYS[n+1] a hash, per ring slot i: 'b'..i the bucket
-- it holds, 't'..i that bucket's total
-- ARGV[1] a bucket's width in seconds, ARGV[2] tenants kept per bucket, then per tenant:
-- its name and its cost
local ring = #KEYS - 1
local width = tonumber(ARGV[1])
local bucket = math.floor(tonumber(redis.call('TIME')[1]) / width)
local slot = bucket % ring + 1
local key, meta = KEYS[slot], KEYS[ring + 1]
if tonumber(redis.call('HGET', meta, 'b' .. slot)) ~= bucket then
  -- The slot still holds a bucket that slid out of the window.
  redis.call('DEL', key)
  redis.call('HSET', meta, 'b' .. slot, bucket, 't' .. slot, 0)
end
local total = 0
for i = 3, #ARGV, 2 do
  redis.call('ZINCRBY', key, ARGV[i + 1], ARGV[i])
  total = total + tonumber(ARGV[i + 1])
end
redis.call('HINCRBY', meta, 't' .. slot, total)
redis.call('ZREMRANGEBYRANK', key, 0, -(tonumber(ARGV[2]) + 1))
local ttl = (ring + 1) * width
redis.call('EXPIRE', key, ttl)
redis.call('EXPIRE', meta, ttl)
return 1
