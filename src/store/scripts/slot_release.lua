-- Gives a slot lease back and wakes one waiting worker for the slot: of the tiers with a
-- queued worker and room under their cap, the one whose turn it is by start-time fair
-- queuing on the tiers' weights (a tier that starts waiting starts at the current virtual
-- time, so a flood queued before it cannot hold it back), and in that tier the worker
-- queued longest. The worker is told on its own channel and goes to the back of the queue,
-- or leaves it when that was the last of its calls waiting; one no longer listening (gone),
-- or no longer saying it is alive (its record in the worker set missing or not renewed
-- for a while: crashed, or cut off from Redis while its subscription lingers), leaves it
-- and is skipped, so a freed slot is not promised to a worker that cannot take it. The message is the tier key and a token; the slot is promised
-- to the worker (see slot_acquire.lua) until its acquire names the token, for a second at
-- most. With no lease id, only wakes: a woken worker whose calls had gone passes the slot
-- on, naming the token it got, and leaves the tier's queue.
-- KEYS[1] global lease set, KEYS[2] tier lease set, KEYS[3] wait book (slot_acquire.lua),
-- KEYS[4] the promised slots (each also in `<tier key>:promised`), KEYS[5] the worker set
-- (slot_heartbeat.lua)
-- ARGV[1] lease id or '', ARGV[2] the wake channels' prefix (the worker id follows),
-- ARGV[3] 'PUBLISH' (one node) or 'SPUBLISH' (a cluster: sharded pub/sub; the channels
-- share the lease sets' hash tag, so they belong to this shard), ARGV[4] the token passed
-- on, or '', ARGV[5] the worker passing it on, or '', ARGV[6] how long (ms) a live
-- worker's record has left at least (a worker TTL less the heartbeat's slack)
-- Returns {removed, global count, tier count} (before the wake-up's promise).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local removed = 0
if ARGV[1] ~= '' then
  removed = redis.call('ZREM', KEYS[1], ARGV[1])
  redis.call('ZREM', KEYS[2], ARGV[1])
end
if ARGV[4] ~= '' then
  redis.call('ZREM', KEYS[4], ARGV[4])
  redis.call('ZREM', KEYS[2] .. ':promised', ARGV[4])
end
local function unqueue(key, worker)
  redis.call('ZREM', key .. ':waiting', worker)
  redis.call('HDEL', key .. ':wants', worker)
end
if ARGV[5] ~= '' then
  unqueue(KEYS[2], ARGV[5])
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now)
local global = redis.call('ZCARD', KEYS[1])
local tier = redis.call('ZCARD', KEYS[2])
local book = KEYS[3]
local gcap = tonumber(redis.call('HGET', book, 'global') or '0')
if (removed == 1 or ARGV[1] == '') and global + redis.call('ZCARD', KEYS[4]) < gcap then
  local v = tonumber(redis.call('HGET', book, 'v') or '0')
  for _ = 1, 16 do
    local best, best_start, best_finish, best_head, best_worker
    for _, field in ipairs(redis.call('HKEYS', book)) do
      if string.sub(field, 1, 2) == 'c:' then
        local key = string.sub(field, 3)
        local head = redis.call('ZRANGE', key .. ':waiting', 0, 0, 'WITHSCORES')
        if #head == 0 then
          redis.call('HDEL', book, field, 'w:' .. key, 'v:' .. key)
        else
          redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
          redis.call('ZREMRANGEBYSCORE', key .. ':promised', '-inf', now)
          local held = redis.call('ZCARD', key) + redis.call('ZCARD', key .. ':promised')
          if held < tonumber(redis.call('HGET', book, field)) then
            local weight = tonumber(redis.call('HGET', book, 'w:' .. key) or '1')
            if not weight or weight <= 0 then
              weight = 1
            end
            local start = math.max(tonumber(redis.call('HGET', book, 'v:' .. key) or '0'), v)
            local finish = start + 1 / weight
            local at = tonumber(head[2])
            if not best or finish < best_finish or (finish == best_finish and at < best_head) then
              best, best_start, best_finish = key, start, finish
              best_head, best_worker = at, head[1]
            end
          end
        end
      end
    end
    if not best then
      break
    end
    local record = tonumber(redis.call('ZSCORE', KEYS[5], best_worker) or '0')
    local token = record > now + tonumber(ARGV[6]) and tostring(redis.call('HINCRBY', book, 'token', 1))
    if token and redis.call(ARGV[3], ARGV[2] .. best_worker, best .. '\n' .. token) > 0 then
      redis.call('ZADD', KEYS[4], now + 1000, token)
      redis.call('ZADD', best .. ':promised', now + 1000, token)
      redis.call('HSET', book, 'v:' .. best, tostring(best_finish), 'v', tostring(best_start))
      if redis.call('HINCRBY', best .. ':wants', best_worker, -1) > 0 then
        redis.call('ZADD', best .. ':waiting', 'XX', now, best_worker)
      else
        unqueue(best, best_worker)
      end
      break
    end
    unqueue(best, best_worker)
  end
end
return {removed, global, tier}
