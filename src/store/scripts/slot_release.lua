-- Gives a slot lease back and tells every worker's waiters that a slot is free.
-- KEYS[1] global lease set, KEYS[2] tier lease set
-- ARGV[1] lease id, ARGV[2] release channel
local removed = redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
if removed == 1 then
  redis.call('PUBLISH', ARGV[2], '1')
end
return removed
