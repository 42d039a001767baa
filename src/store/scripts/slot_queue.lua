-- The fleet's fair order of the calls waiting for a slot: prepended to the slot scripts.
-- A flow is one tenant's calls of one class (0 critical, 1 standard, 2 batch) in one tier;
-- a group is the flows of one key (a service and its end users, or a team: the caller names
-- it, or the tenant is a group of its own). Each worker holding calls of a flow is queued in
-- it (`<tier>:fw:<class>|<tenant>`, the oldest first), with how many of them wait there
-- (`<tier>:wants`) and what the next one costs in tokens (`<tier>:costs`); `<tier>:waiting`
-- lists every (worker, flow) entry, for the sweep of dead workers.
-- The order is start-time fair queuing on the cost at two levels. The groups of a class in
-- a tier wait in `<tier>:groups:<class>` scored by their start tag: a group that starts
-- waiting starts at the tier's virtual time in that class (`t:<class>:<tier>` in the wait
-- book), or at its own last finish if that is later (`<tier>:gfin:<class>`, kept while it is
-- ahead of the virtual time), so a newcomer goes next and a group that comes and goes banks
-- no credit. Inside a group the same between its flows (`<tier>:flows:<class>|<group>`, the
-- group's virtual time in `<tier>:gv:<class>`, finish tags in `<tier>:fin:<class>|<group>`):
-- a service with 1,000 users waiting and one with a single user get one share each.
-- `<tier>:fg:<class>` names each waiting flow's group.
local function member(worker, class, tenant)
  return worker .. '|' .. class .. '|' .. tenant
end

local function flow_workers(key, class, tenant)
  return key .. ':fw:' .. class .. '|' .. tenant
end

local function group_flows(key, class, group)
  return key .. ':flows:' .. class .. '|' .. group
end

local function group_fins(key, class, group)
  return key .. ':fin:' .. class .. '|' .. group
end

local function tag(x)
  return string.format('%.17g', x)
end

-- A group of `class` is about to wait in tier `key`: a tier (or a class) that starts waiting
-- starts at the current virtual time of its class (of the classes), so it banks no credit
-- for the time it had nothing waiting, and keeps its tag while it waits.
local function backlogged(book, key, class)
  if redis.call('ZCARD', key .. ':groups:' .. class) > 0 then
    return
  end
  local function num(field)
    return tonumber(redis.call('HGET', book, field) or '') or 0
  end
  local tier_tag = 'v:' .. class .. ':' .. key
  redis.call('HSET', book, tier_tag, tag(math.max(num(tier_tag), num('v:' .. class))))
  for _, field in ipairs(redis.call('HKEYS', book)) do
    if string.sub(field, 1, 2) == 'c:' and redis.call('ZCARD', string.sub(field, 3) .. ':groups:' .. class) > 0 then
      return
    end
  end
  redis.call('HSET', book, 'u:' .. class, tag(math.max(num('u:' .. class), num('u'))))
end

-- `name` starts waiting in the zset `queue` at the virtual time `v`, or at its finish tag
-- in `fins` if that is later.
local function enter(queue, fins, name, v)
  local last = tonumber(redis.call('ZSCORE', fins, name) or '0')
  redis.call('ZREM', fins, name)
  redis.call('ZADD', queue, tag(math.max(v, last)), name)
end

-- `name` leaves the zset `queue`, its start tag (its last finish) kept in `fins`.
local function depart(queue, fins, name)
  local start = redis.call('ZSCORE', queue, name)
  if start then
    redis.call('ZREM', queue, name)
    redis.call('ZADD', fins, start, name)
  end
end

-- Queues `worker` for `n` calls of the flow, of `group` ('': the tenant's own), the next
-- costing `cost`; a worker already queued keeps its place.
local function join(book, key, worker, class, group, tenant, n, cost, now)
  local m = member(worker, class, tenant)
  redis.call('ZADD', key .. ':waiting', 'NX', now, m)
  redis.call('HSET', key .. ':wants', m, n)
  redis.call('HSET', key .. ':costs', m, cost)
  redis.call('ZADD', flow_workers(key, class, tenant), 'NX', now, worker)
  local fg = key .. ':fg:' .. class
  group = redis.call('HGET', fg, tenant) or (group ~= '' and group) or tenant
  local flows = group_flows(key, class, group)
  if not redis.call('ZSCORE', flows, tenant) then
    local groups = key .. ':groups:' .. class
    if not redis.call('ZSCORE', groups, group) then
      backlogged(book, key, class)
      local v = tonumber(redis.call('HGET', book, 't:' .. class .. ':' .. key) or '0')
      enter(groups, key .. ':gfin:' .. class, group, v)
    end
    redis.call('HSET', fg, tenant, group)
    local v = tonumber(redis.call('ZSCORE', key .. ':gv:' .. class, group) or '0')
    enter(flows, group_fins(key, class, group), tenant, v)
  end
end

-- Takes the flow of `tenant` out of its group (`group`, or the one it joined); a group left
-- with no flow leaves its tier's queue (its last finish kept) and forgets its own order.
local function flow_leaves(key, class, tenant, group)
  local fg = key .. ':fg:' .. class
  group = group or redis.call('HGET', fg, tenant)
  if not group then
    return
  end
  redis.call('HDEL', fg, tenant)
  local flows = group_flows(key, class, group)
  depart(flows, group_fins(key, class, group), tenant)
  if redis.call('ZCARD', flows) == 0 then
    depart(key .. ':groups:' .. class, key .. ':gfin:' .. class, group)
    redis.call('DEL', group_fins(key, class, group))
    redis.call('ZREM', key .. ':gv:' .. class, group)
  end
end

-- Takes `worker` out of the flow; a flow left with no worker leaves its group.
local function leave(key, worker, class, tenant)
  local m = member(worker, class, tenant)
  redis.call('ZREM', key .. ':waiting', m)
  redis.call('HDEL', key .. ':wants', m)
  redis.call('HDEL', key .. ':costs', m)
  local workers = flow_workers(key, class, tenant)
  redis.call('ZREM', workers, worker)
  if redis.call('ZCARD', workers) == 0 then
    flow_leaves(key, class, tenant)
  end
end

-- `leave` for an entry of `<tier>:waiting` (`worker|class|tenant`).
local function leave_entry(key, entry)
  local worker, class, tenant = string.match(entry, '^([^|]*)|(%d)|(.*)$')
  if worker then
    leave(key, worker, class, tenant)
  else
    redis.call('ZREM', key .. ':waiting', entry)
  end
end

-- Forgets the order of a tier nobody waits in any more (and anything a wipe left of it).
local function forget_tier(key)
  for class = 0, 2 do
    for _, group in ipairs(redis.call('ZRANGE', key .. ':groups:' .. class, 0, -1)) do
      redis.call('DEL', group_flows(key, class, group), group_fins(key, class, group))
    end
    redis.call('DEL', key .. ':groups:' .. class, key .. ':gfin:' .. class, key .. ':gv:' .. class,
      key .. ':fg:' .. class)
  end
end

-- Whether any worker waits in the fleet's order, in any tier.
local function someone_waits(book)
  for _, field in ipairs(redis.call('HKEYS', book)) do
    if string.sub(field, 1, 2) == 'c:' and redis.call('ZCARD', string.sub(field, 3) .. ':waiting') > 0 then
      return true
    end
  end
  return false
end

-- How long (us) before a cell of `span` us frees a release may hand it out: 2 ms, or an
-- eighth of the span if less (so a fast rate's cells are not all counted free).
local function cell_lead(span)
  return math.min(2000, math.floor(span / 8))
end

-- The provider's rate while the fleet orders its cells (slot_acquire.lua), with every cell
-- taken and calls waiting: one worker sends a release with no lease (a tick) when the first
-- cell frees, so that cell goes out in the fleet's order. The tick is sent three quarters
-- of the `lead` ahead, to come just in time (a release hands out a cell that frees within
-- the lead). Returns {how long (us) the caller waits before it sends it, the cell's time
-- (us) its tick names}: {0, 0} when another worker sends it already (the book's
-- `cell_tick` is that time or later) — unless that is the caller, whose tick `mine` (the
-- time it named, or '') came too early. The book names the worker that sends the ticks
-- (`cell_ticker`), for whoever looks. `tick_at` names the time `at` (us): when the next
-- cell frees (`cell_tick`), or when the next call's tokens conform.
local function tick_at(book, at, now_us, lead, mine, worker)
  at = math.max(at, now_us + 1)
  local current = tonumber(redis.call('HGET', book, 'cell_tick') or '') or 0
  if current >= at and current ~= tonumber(mine) then
    return {0, 0}
  end
  redis.call('HSET', book, 'cell_tick', string.format('%.0f', at), 'cell_ticker', worker)
  return {math.max(at - now_us - math.floor(lead * 3 / 4), 1), at}
end

-- `tick_at` the time the first cell frees.
local function cell_tick(book, cells_key, now_us, lead, mine, worker)
  local first = redis.call('ZRANGE', cells_key, 0, 0, 'WITHSCORES')
  if not first[2] then
    return {0, 0}
  end
  return tick_at(book, tonumber(first[2]), now_us, lead, mine, worker)
end

-- The provider's input-token rate while the fleet orders it too: a GCRA (gcra.lua, prepended
-- before this file) of `iv` us a token and `cap` tokens at once, its TAT (us) in the book's
-- `tokens_tat`. A call of `cost` tokens conforms at `tokens_conform`'s time; going at `at`,
-- it is charged its whole cost (`gcra_charge`: a call larger than the bucket waits for a
-- full one, and the next waits for what it took beyond).

-- The fleet's token rate {iv, cap} while an acquire named it in the last 10 s, else nil.
local function token_rate(book, now)
  local r = redis.call('HMGET', book, 'tokens_iv', 'tokens_cap', 'tokens_to')
  local iv, cap = tonumber(r[1]) or 0, tonumber(r[2]) or 0
  if iv > 0 and cap > 0 and (tonumber(r[3]) or 0) >= now then
    return {iv, cap}
  end
end

-- When (us) a call of `cost` tokens conforms under the fleet's token rate `rate`.
local function tokens_conform(book, rate, now_us, cost)
  local tat = tonumber(redis.call('HGET', book, 'tokens_tat') or '') or 0
  return gcra_conforms_at(rate[1], rate[2], tat, now_us, cost)
end

-- Charges a call of `cost` tokens going at `at` to the fleet's token rate.
local function tokens_take(book, rate, at, cost)
  local tat = tonumber(redis.call('HGET', book, 'tokens_tat') or '') or 0
  redis.call('HSET', book, 'tokens_tat', string.format('%.0f', gcra_charge(rate[1], tat, at, cost)))
end

-- Corrects the fleet's token rate `rate` by `diff` tokens (the calls' true input less the
-- estimates they took) at `now_us`: more is charged as a call would be; less is given
-- back, never below now (a full bucket holds no more). At most a minute of the rate
-- either way: a usage misread must not stall the fleet for hours.
local function tokens_correct(book, rate, now_us, diff)
  local minute = math.floor(60000000 / rate[1])
  diff = math.max(-minute, math.min(diff, minute))
  if diff ~= 0 then
    local tat = tonumber(redis.call('HGET', book, 'tokens_tat') or '') or 0
    redis.call('HSET', book, 'tokens_tat', string.format('%.0f', gcra_charge(rate[1], tat, now_us, diff)))
  end
end

-- How long before a call of `cost` tokens conforms its tick is sent (as `cell_lead`, over
-- the span its tokens refill in).
local function tokens_lead(rate, cost)
  return cell_lead(rate[1] * math.max(1, math.min(cost, rate[2])))
end

-- The span of one handing out: a release that hands out a call whose tokens conform (within
-- the lead) hands out with it the calls whose tokens conform within 100 ms of it (an eighth
-- of the bucket if less), as a cell of the request rate lasts 100 ms at least: one tick
-- for the calls of 100 ms rather than one a call. Their tokens are taken dated from when
-- they conform, so the rate is kept and no call goes more than that span ahead of it.
local function tokens_batch(rate)
  return math.min(100000, math.floor(rate[1] * rate[2] / 8))
end
