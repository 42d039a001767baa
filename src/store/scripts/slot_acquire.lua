-- Takes a slot lease if the global and the tier counts are both under their caps.
-- A lease is a member of both sets scored by its expiry: expired leases (a crashed worker's)
-- are dropped here, so they come back within one TTL whatever the traffic.
-- The counts are only true if this worker's calls are all in them: when the bookkeeping
-- that says so is gone (no epoch key, another epoch than the worker's, or no live record of
-- the worker: Redis was wiped or restarted, or the worker was away), nothing is taken and
-- the worker is told to resync first.
-- A worker whose call waits for a full tier queues itself in the flow of the call (its
-- tenant and class in the tier; see slot_queue.lua) with how many of the flow's calls wait
-- there; slot_release.lua wakes the worker of the flow whose turn it is when a slot frees.
-- A slot a release woke a worker for is promised to it for a second: counted against the
-- global and the tier cap for everyone else until its acquire, which names the wake's
-- token, comes.
-- KEYS[1] global lease set, KEYS[2] tier lease set, KEYS[3] worker set, KEYS[4] epoch key,
-- KEYS[5] wait book (hash: the caps and weights of the queued tiers), KEYS[6] the tier's
-- wait queue, KEYS[7] the promised slots (tokens scored by expiry), KEYS[8] the tier's
-- promised slots
-- ARGV[1] global cap, ARGV[2] tier cap, ARGV[3] lease TTL in ms, ARGV[4] lease id,
-- ARGV[5] worker id, ARGV[6] the epoch the worker synced to, ARGV[7] how many calls of the
-- flow wait at this worker, this one included ('0': never queue): refused, the worker
-- queues with that many; granted, it stays queued (in its place) with one less, or leaves
-- the flow with the last. ARGV[8] the tier's weight, ARGV[9] the token of the wake-up this
-- acquire answers, or '', ARGV[10] the flow's class (0-2), ARGV[11] the class's weight,
-- ARGV[12] the flow's tenant ('' for a worker that orders its calls of the tier itself),
-- ARGV[13] what the flow's next call here costs
-- The provider's request rate, when the fleet orders its cells too: KEYS[9] the cells (call
-- ids scored by the microsecond their cell frees), ARGV[14] how many cells there are ('0':
-- the rate is not the fleet's to order; '-1': as many as another worker named, if one
-- did), ARGV[15] how long (us) a cell stays taken. A call
-- takes a cell as it takes its slot (one promised to it came with its cell, `p<token>`);
-- with every cell taken, the call is refused and queued as for a full tier, and the next
-- freed cell goes in the fleet's fair order (slot_release.lua). The book keeps the cells'
-- number and span for 10 s after the last acquire that names them, so releases hand a slot
-- out only with a cell free.
-- The provider's input-token rate, when the fleet orders it too: ARGV[16] how long (us) a
-- token takes to refill, ARGV[17] how many tokens may go at once ('0', '0': none named;
-- with ARGV[14] '-1', the rate another worker named, if one did). A call not promised its
-- slot takes its cost (ARGV[13]) in tokens when it conforms (slot_queue.lua's GCRA); with
-- the tokens short it is refused and queued as for a full tier, and the tokens go in the
-- fleet's fair order (slot_release.lua). The book keeps the rate for 10 s after the last
-- acquire that names it.
-- With a tenant cap (absent otherwise: then nothing is counted per tenant):
-- KEYS[10] the tenant's lease set in this tier, ARGV[18] the tenant cap (sent as '0'
-- otherwise, so that ARGV[19] follows)
-- ARGV[19] the flow's group ('': the tenant is a group of its own; see slot_queue.lua)
-- Returns {status, global count, tier count, reason, room, workers, tick, at} (counting the promised
-- slots): status 1 when the lease was taken, 0 when a cap is reached, -1 when the worker
-- must resync (nothing follows); reason (with status 0) 1 when the global or tier cap is
-- reached, 2 when only the tenant's own cap is, 3 when every cell of the rate is taken
-- (or the input tokens are short);
-- room (with status 1) how many more calls (and cells)
-- the global and tier caps have room for; workers the records in the worker set (some
-- maybe expired), so a worker learns of one that joined since its last heartbeat; tick
-- (refused for the rate) how long (us) before this worker sends the tick that hands out the
-- next freed cell (0: another worker sends it; see slot_queue.lua), at the time it names.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local record = redis.call('ZSCORE', KEYS[3], ARGV[5])
if redis.call('GET', KEYS[4]) ~= ARGV[6] or not record or tonumber(record) <= now then
  return {-1, 0, 0}
end
local workers = redis.call('ZCARD', KEYS[3])
local waiting = tonumber(ARGV[7]) or 0
local class, tenant = ARGV[10], ARGV[12]
local function queue(n)
  join(KEYS[5], KEYS[2], ARGV[5], class, ARGV[19] or '', tenant, n, ARGV[13], now)
  redis.call('HSET', KEYS[5], 'global', ARGV[1], 'c:' .. KEYS[2], ARGV[2], 'w:' .. KEYS[2], ARGV[8],
    'k:' .. class, ARGV[11])
end
-- Whether a release promised this call its slot (and took its tokens).
local promised = false
if ARGV[9] ~= '' then
  promised = redis.call('ZREM', KEYS[7], ARGV[9]) == 1
  redis.call('ZREM', KEYS[8], ARGV[9])
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
redis.call('ZREMRANGEBYSCORE', KEYS[7], '-inf', now)
redis.call('ZREMRANGEBYSCORE', KEYS[8], '-inf', now)
local global = redis.call('ZCARD', KEYS[1]) + redis.call('ZCARD', KEYS[7])
local tier = redis.call('ZCARD', KEYS[2]) + redis.call('ZCARD', KEYS[8])
if global >= tonumber(ARGV[1]) or tier >= tonumber(ARGV[2]) then
  if waiting > 0 then
    queue(waiting)
  end
  return {0, global, tier, 1, 0, workers}
end
if KEYS[10] then
  redis.call('ZREMRANGEBYSCORE', KEYS[10], '-inf', now)
  if redis.call('ZCARD', KEYS[10]) >= tonumber(ARGV[18]) then
    return {0, global, tier, 2, 0, workers}
  end
end
local cells, span = tonumber(ARGV[14]) or 0, tonumber(ARGV[15]) or 0
local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
if cells > 0 then
  redis.call('HSET', KEYS[5], 'cells', cells, 'cells_span', span, 'cells_to', now + 10000)
elseif cells < 0 then
  -- The worker names no cells but another may (this one's view of the limit is behind):
  -- the call takes one too, or each side would take the whole rate.
  cells = 0
  local book = redis.call('HMGET', KEYS[5], 'cells', 'cells_span', 'cells_to')
  if (tonumber(book[3]) or 0) > now then
    cells, span = tonumber(book[1]) or 0, tonumber(book[2]) or 0
  end
end
local tok_iv, tok_cap = tonumber(ARGV[16]) or 0, tonumber(ARGV[17]) or 0
if tok_iv > 0 and tok_cap > 0 then
  redis.call('HSET', KEYS[5], 'tokens_iv', tok_iv, 'tokens_cap', tok_cap, 'tokens_to', now + 10000)
end
-- The input-token rate the fleet orders (this worker named it, or takes what another
-- named), unless a release promised this call its slot: the promise took its tokens.
local named_tokens = (tok_iv > 0 or ARGV[14] == '-1') and token_rate(KEYS[5], now)
local tokens = not promised and named_tokens
local cost = math.max(tonumber(ARGV[13]) or 1, 1)
-- Refused for the rate: queued as for a full tier, and told when to send the tick that
-- hands out what frees next (the tick at `at`, else at the first cell's time).
local function refused_for_rate(at, lead)
  if waiting > 0 then
    queue(waiting)
  end
  local tick
  if at then
    tick = tick_at(KEYS[5], at, now_us, lead, '', ARGV[5])
  else
    tick = cell_tick(KEYS[5], KEYS[9], now_us, lead, '', ARGV[5])
  end
  return {0, global, tier, 3, 0, workers, tick[1], tick[2]}
end
local promised_cell = ARGV[9] ~= '' and redis.call('ZSCORE', KEYS[9], 'p' .. ARGV[9])
-- How long (us) the cell this call holds stays taken (0: it takes none).
local cell_left = 0
if promised_cell then
  cell_left = math.max(tonumber(promised_cell) - now_us, 0)
elseif cells > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[9], '-inf', now_us)
  if redis.call('ZCARD', KEYS[9]) >= cells then
    return refused_for_rate(nil, cell_lead(span))
  end
  cell_left = span
end
if tokens then
  local at = tokens_conform(KEYS[5], tokens, now_us, cost)
  local lead = tokens_lead(tokens, cost)
  if at > now_us + lead then
    return refused_for_rate(at, lead)
  end
  tokens_take(KEYS[5], tokens, at, cost)
end
if cell_left > 0 and not promised_cell then
  redis.call('ZADD', KEYS[9], now_us + cell_left, ARGV[4])
  redis.call('PEXPIRE', KEYS[9], math.ceil(cell_left / 1000) + 1000)
end
local expiry = now + tonumber(ARGV[3])
redis.call('ZADD', KEYS[1], expiry, ARGV[4])
redis.call('ZADD', KEYS[2], expiry, ARGV[4])
if KEYS[10] then
  redis.call('ZADD', KEYS[10], expiry, ARGV[4])
end
local room = math.min(tonumber(ARGV[1]) - global, tonumber(ARGV[2]) - tier) - 1
if cell_left > 0 then
  -- The rate's cells left are room too: with none, the worker waits to be woken.
  room = math.min(room, cells - redis.call('ZCARD', KEYS[9]))
end
if named_tokens then
  -- Room for another call of the same cost only if its tokens conform already.
  local at = tokens_conform(KEYS[5], named_tokens, now_us, cost)
  if at > now_us + tokens_lead(named_tokens, cost) then
    room = 0
  end
end
if waiting > 1 then
  queue(waiting - 1)
elseif waiting > 0 then
  leave(KEYS[2], ARGV[5], class, tenant)
end
return {1, global + 1, tier + 1, 0, math.max(room, 0), workers}
