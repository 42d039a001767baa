-- Gives a slot lease back and wakes one waiting worker for the slot, in the fleet's fair
-- order (slot_queue.lua): of the tiers with a queued flow and room under their cap, the
-- class by fair queuing on the class weights (one call each), then the tier in that class
-- by start-time fair queuing on the cost over the tier's weight (whatever its number of
-- flows waiting, as in one process: a flood of many tenants takes its tier's share, not
-- more; a class or tier that starts waiting starts at the current virtual time, so a flood
-- queued before it cannot hold it back), then the group with the smallest start tag, then
-- its flow with the smallest start tag, then the worker queued longest for that flow. The
-- flow, its group and its tier are charged what the worker said its next call costs. The
-- worker is told on its own channel and goes to the back of the flow's workers, or leaves
-- the flow when that was the last of its calls there; one no longer listening (gone), or
-- no longer saying it is alive (its record in the worker set missing or not renewed for a
-- while: crashed, or cut off from Redis while its subscription lingers), leaves it and is
-- skipped, so a freed slot is not promised to a worker that cannot take it. The message is the tier key, a token, the
-- class and the tenant, one per line; the slot is promised to the worker (see
-- slot_acquire.lua) until its acquire names the token, for a second at most. With no lease
-- id, only wakes: a woken worker whose calls had gone passes the slot on, naming the token
-- it got, and leaves the flow.
-- KEYS[1] global lease set, KEYS[2] tier lease set, KEYS[3] wait book (slot_acquire.lua),
-- KEYS[4] the promised slots (each also in `<tier key>:promised`), KEYS[5] the worker set
-- (slot_heartbeat.lua), KEYS[6] the cells of the provider's request rate (slot_acquire.lua:
-- while the book names a number of cells, a slot is handed out only with a cell free, and
-- the promise takes the cell as `p<token>`; a wake-up passed on gives its cell back; while
-- calls wait for a cell, one worker sends a release with no lease, no token and no entry
-- (a tick) when a cell frees, so the freed cell goes in the fleet's order as a freed slot
-- does: see slot_queue.lua)
-- ARGV[1] lease id or '', ARGV[2] the wake channels' prefix (the worker id follows),
-- ARGV[3] 'PUBLISH' (one node) or 'SPUBLISH' (a cluster: sharded pub/sub; the channels
-- share the lease sets' hash tag, so they belong to this shard), ARGV[4] the token passed
-- on, or '', ARGV[5] the entry (`worker|class|tenant`) leaving its flow, or '', ARGV[6] how
-- long (ms) a live worker's record has left at least (a worker TTL less the heartbeat's
-- slack), ARGV[7] for a tick, the time it names (see slot_queue.lua), or '', ARGV[8] the
-- worker's id, ARGV[9] the input tokens this worker's answered calls used beyond the
-- estimates the fleet's token rate took for them (negative: fewer), or '' (see
-- `tokens_correct`)
-- Returns {removed, global count, tier count, tick, at} (the counts before the wake-up's
-- promise; tick: how long (us) before the caller sends the next tick, 0 for none, and the
-- time that tick names).
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
  redis.call('ZREM', KEYS[6], 'p' .. ARGV[4])
end
if ARGV[5] ~= '' then
  leave_entry(KEYS[2], ARGV[5])
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now)
local global = redis.call('ZCARD', KEYS[1])
local tier = redis.call('ZCARD', KEYS[2])
local book = KEYS[3]
local function num(field, default)
  return tonumber(redis.call('HGET', book, field) or '') or default
end
local function weight(field)
  local w = num(field, 1)
  if w <= 0 then
    return 1
  end
  return w
end

-- The tiers with a queued flow and room under their cap; a tier nobody waits in any more
-- forgets its order.
local function open_tiers()
  local open = {}
  for _, field in ipairs(redis.call('HKEYS', book)) do
    if string.sub(field, 1, 2) == 'c:' then
      local key = string.sub(field, 3)
      if redis.call('ZCARD', key .. ':waiting') == 0 then
        redis.call('HDEL', book, field, 'w:' .. key)
        for class = 0, 2 do
          redis.call('HDEL', book, 'v:' .. class .. ':' .. key, 't:' .. class .. ':' .. key)
        end
        forget_tier(key)
      else
        redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
        redis.call('ZREMRANGEBYSCORE', key .. ':promised', '-inf', now)
        local held = redis.call('ZCARD', key) + redis.call('ZCARD', key .. ':promised')
        if held < tonumber(redis.call('HGET', book, field)) then
          open[#open + 1] = key
        end
      end
    end
  end
  return open
end

-- Fair queuing among `choices` (name, start tag, weight), one call each: the least finish
-- tag, the first listed on a tie. A choice's start tag was set when it started waiting
-- (slot_queue.lua), at the latest the virtual time then, and is its last finish since.
local function fairest(choices)
  local best
  for _, c in ipairs(choices) do
    local start = c[2]
    local finish = start + 1 / c[3]
    if not best or finish < best[3] then
      best = {c[1], start, finish}
    end
  end
  return best
end

-- Start-time fair queuing among `choices` (name, start tag, weight): the least start tag,
-- on a tie the heaviest (the least finish for the same cost: a tier that starts waiting
-- starts at the virtual time, where one queued since may still stand), then the first
-- listed; the one served is charged its call's cost over its weight when the cost is known.
local function earliest(choices)
  local best
  for _, c in ipairs(choices) do
    if not best or c[2] < best[2] or (c[2] == best[2] and c[3] > best[3]) then
      best = c
    end
  end
  return best
end

-- The class, tier, group and flow whose turn it is: {class, tier key, tenant, start tag},
-- with the virtual times to set when it is served and {group, its start tag}.
local pick
function pick(open)
  local classes = {}
  for class = 0, 2 do
    for _, key in ipairs(open) do
      if redis.call('ZCARD', key .. ':groups:' .. class) > 0 then
        classes[#classes + 1] = {class, num('u:' .. class, num('u', 0)), weight('k:' .. class)}
        break
      end
    end
  end
  local class = fairest(classes)
  if not class then
    return nil
  end
  local c = class[1]
  local tiers = {}
  for _, key in ipairs(open) do
    if redis.call('ZCARD', key .. ':groups:' .. c) > 0 then
      tiers[#tiers + 1] = {key, num('v:' .. c .. ':' .. key, num('v:' .. c, 0)), weight('w:' .. key)}
    end
  end
  local tier_turn = earliest(tiers)
  local key = tier_turn[1]
  local group = redis.call('ZRANGE', key .. ':groups:' .. c, 0, 0, 'WITHSCORES')
  local head = redis.call('ZRANGE', group_flows(key, c, group[1]), 0, 0, 'WITHSCORES')
  if not head[1] then
    -- A group with no flow (left behind by a wipe of part of the queue): forget it.
    redis.call('ZREM', key .. ':groups:' .. c, group[1])
    return pick(open)
  end
  return {c, key, head[1], tonumber(head[2]), class, tier_turn, group[1], tonumber(group[2])}
end

-- Whether the fleet orders the provider's request rate now: how long a cell stays taken
-- (us) then, else nil.
local function cell_span()
  if num('cells', 0) > 0 and num('cells_to', 0) >= now and num('cells_span', 0) > 0 then
    return num('cells_span', 0)
  end
end
local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
local span = cell_span()

-- Whether the provider's rate has a cell free (always, while the fleet does not order it).
-- A cell that frees within the lead (`cell_lead`) counts as free (its tick is sent a little
-- ahead, so the next call is not late by a round trip), and the next one is dated from when
-- it frees: the cells follow each other without a gap and never overlap.
local cell_from = now_us
local lead = span and cell_lead(span) or 0
local function cell_free()
  if not span then
    return true
  end
  local first = redis.call('ZRANGE', KEYS[6], 0, 0, 'WITHSCORES')
  redis.call('ZREMRANGEBYSCORE', KEYS[6], '-inf', now_us + lead)
  if first[2] and tonumber(first[2]) <= now_us + lead then
    cell_from = math.max(now_us, tonumber(first[2]))
  end
  return redis.call('ZCARD', KEYS[6]) < num('cells', 0)
end

-- The input-token rate, while the fleet orders it: the flow picked goes only once its
-- next call's cost conforms (within the lead; with it, those that conform within the
-- batch's span: `tokens_batch`), and the tokens are taken dated from when they conform;
-- until then nothing is promised, and the tick names that time (`token_wait`).
local tokens = token_rate(book, now)
if tokens then
  tokens_correct(book, tokens, now_us, tonumber(ARGV[9] or '') or 0)
end
local token_wait, token_lead, batch_until
if (removed == 1 or ARGV[1] == '') and global + redis.call('ZCARD', KEYS[4]) < num('global', 0)
  and cell_free() then
  for _ = 1, 64 do
    local turn = pick(open_tiers())
    if not turn then
      break
    end
    local class, key, tenant, start, group = turn[1], turn[2], turn[3], turn[4], turn[7]
    local workers = flow_workers(key, class, tenant)
    local worker = redis.call('ZRANGE', workers, 0, 0)[1]
    if not worker then
      -- A flow with no worker (left behind by a wipe of part of the queue): forget it.
      redis.call('ZREM', group_flows(key, class, group), tenant)
      flow_leaves(key, class, tenant, group)
    else
      local m = member(worker, class, tenant)
      local cost = math.max(tonumber(redis.call('HGET', key .. ':costs', m) or '1') or 1, 1)
      local tokens_at = now_us
      if tokens then
        tokens_at, token_lead = tokens_conform(book, tokens, now_us, cost), tokens_lead(tokens, cost)
        if tokens_at > (batch_until or now_us + token_lead) then
          token_wait = tokens_at
          break
        end
      end
      local record = tonumber(redis.call('ZSCORE', KEYS[5], worker) or '0')
      local token = record > now + tonumber(ARGV[6]) and tostring(redis.call('HINCRBY', book, 'token', 1))
      local message = key .. '\n' .. (token or '') .. '\n' .. class .. '\n' .. tenant
      if token and redis.call(ARGV[3], ARGV[2] .. worker, message) > 0 then
        if tokens then
          tokens_take(book, tokens, tokens_at, cost)
          batch_until = batch_until or tokens_at + tokens_batch(tokens)
        end
        redis.call('ZADD', KEYS[4], now + 1000, token)
        redis.call('ZADD', key .. ':promised', now + 1000, token)
        if span then
          redis.call('ZADD', KEYS[6], cell_from + span, 'p' .. token)
          redis.call('PEXPIRE', KEYS[6], math.ceil(span / 1000) + 1000)
        end
        local class_turn, tier_turn = turn[5], turn[6]
        redis.call('HSET', book, 'u:' .. class, tag(class_turn[3]), 'u', tag(class_turn[2]),
          'v:' .. class .. ':' .. key, tag(tier_turn[2] + cost / tier_turn[3]),
          'v:' .. class, tag(tier_turn[2]), 't:' .. class .. ':' .. key, tag(turn[8]))
        redis.call('ZADD', key .. ':groups:' .. class, tag(turn[8] + cost), group)
        redis.call('ZADD', key .. ':gv:' .. class, tag(start), group)
        redis.call('ZADD', group_flows(key, class, group), tag(start + cost), tenant)
        -- Finish tags behind the virtual time give a returning group or flow nothing.
        redis.call('ZREMRANGEBYSCORE', key .. ':gfin:' .. class, '-inf', tag(turn[8]))
        redis.call('ZREMRANGEBYSCORE', group_fins(key, class, group), '-inf', tag(start))
        if redis.call('HINCRBY', key .. ':wants', m, -1) > 0 then
          redis.call('ZADD', workers, 'XX', now, worker)
        else
          leave(key, worker, class, tenant)
        end
        -- One wake-up per freed slot; where the rate's cells or tokens bind, one per free
        -- cell or conforming call (a tick may free several at once) while the global cap
        -- has room.
        if not (span or tokens) or global + redis.call('ZCARD', KEYS[4]) >= num('global', 0)
          or not cell_free() then
          break
        end
      else
        leave(key, worker, class, tenant)
      end
    end
  end
end
-- Calls still wait for the rate, every cell taken: the next tick is this caller's to send
-- unless another worker's is due (the tick this caller sent may have come too early). With
-- a cell still free, the next release hands it out.
local tick = {0, 0}
if span and someone_waits(book) and not cell_free() then
  tick = cell_tick(book, KEYS[6], now_us, lead, ARGV[7] or '', ARGV[8] or '')
elseif token_wait and someone_waits(book) then
  tick = tick_at(book, token_wait, now_us, token_lead, ARGV[7] or '', ARGV[8] or '')
end
return {removed, global, tier, tick[1], tick[2]}
