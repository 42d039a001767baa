-- Gives a slot lease back and tells every worker's waiters that a slot is free.
-- KEYS[1] global lease set, KEYS[2] tier lease set
-- ARGV[1] lease id, ARGV[2] release channel, ARGV[3] 'PUBLISH' (one node) or 'SPUBLISH'
-- (a cluster: sharded pub/sub; the channel shares the lease sets' hash tag, so it belongs
-- to this shard)
local removed = redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
if removed == 1 then
  redis.call(ARGV[3], ARGV[2], '1')
end
return removed
