-- The fleet's fair order of the calls waiting for a slot: prepended to the slot scripts.
-- A flow is one tenant's calls of one class (0 critical, 1 standard, 2 batch) in one tier.
-- Each worker holding calls of a flow is queued in it (`<tier>:fw:<class>|<tenant>`, the
-- oldest first), with how many of them wait there (`<tier>:wants`) and what the next one
-- costs in tokens (`<tier>:costs`); `<tier>:waiting` lists every (worker, flow) entry, for
-- the sweep of dead workers. The flows of a class in a tier wait in `<tier>:flows:<class>`
-- scored by their start tag (start-time fair queuing on the cost): a flow that starts
-- waiting starts at the tier's virtual time in that class (`t:<class>:<tier>` in the wait
-- book), or at its own last finish if that is later (`<tier>:fin:<class>`, kept while it is
-- ahead of the virtual time), so a newcomer goes next and a tenant that comes and goes
-- banks no credit.
local function member(worker, class, tenant)
  return worker .. '|' .. class .. '|' .. tenant
end

local function flow_workers(key, class, tenant)
  return key .. ':fw:' .. class .. '|' .. tenant
end

local function tag(x)
  return string.format('%.17g', x)
end

-- A flow of `class` is about to wait in tier `key`: a tier (or a class) that starts waiting
-- starts at the current virtual time of its class (of the classes), so it banks no credit
-- for the time it had nothing waiting, and keeps its tag while it waits.
local function backlogged(book, key, class)
  if redis.call('ZCARD', key .. ':flows:' .. class) > 0 then
    return
  end
  local function num(field)
    return tonumber(redis.call('HGET', book, field) or '') or 0
  end
  local tier_tag = 'v:' .. class .. ':' .. key
  redis.call('HSET', book, tier_tag, tag(math.max(num(tier_tag), num('v:' .. class))))
  for _, field in ipairs(redis.call('HKEYS', book)) do
    if string.sub(field, 1, 2) == 'c:' and redis.call('ZCARD', string.sub(field, 3) .. ':flows:' .. class) > 0 then
      return
    end
  end
  redis.call('HSET', book, 'u:' .. class, tag(math.max(num('u:' .. class), num('u'))))
end

-- Queues `worker` for `n` calls of the flow, the next costing `cost`; a worker already
-- queued keeps its place.
local function join(book, key, worker, class, tenant, n, cost, now)
  local m = member(worker, class, tenant)
  redis.call('ZADD', key .. ':waiting', 'NX', now, m)
  redis.call('HSET', key .. ':wants', m, n)
  redis.call('HSET', key .. ':costs', m, cost)
  redis.call('ZADD', flow_workers(key, class, tenant), 'NX', now, worker)
  local flows = key .. ':flows:' .. class
  if not redis.call('ZSCORE', flows, tenant) then
    backlogged(book, key, class)
    local v = tonumber(redis.call('HGET', book, 't:' .. class .. ':' .. key) or '0')
    local fin = key .. ':fin:' .. class
    local last = tonumber(redis.call('ZSCORE', fin, tenant) or '0')
    redis.call('ZREM', fin, tenant)
    redis.call('ZADD', flows, tag(math.max(v, last)), tenant)
  end
end

-- Takes `worker` out of the flow; a flow left with no worker leaves its tier's queue,
-- keeping its start tag (its last finish) as a finish tag.
local function leave(key, worker, class, tenant)
  local m = member(worker, class, tenant)
  redis.call('ZREM', key .. ':waiting', m)
  redis.call('HDEL', key .. ':wants', m)
  redis.call('HDEL', key .. ':costs', m)
  local workers = flow_workers(key, class, tenant)
  redis.call('ZREM', workers, worker)
  if redis.call('ZCARD', workers) == 0 then
    local flows = key .. ':flows:' .. class
    local start = redis.call('ZSCORE', flows, tenant)
    if start then
      redis.call('ZREM', flows, tenant)
      redis.call('ZADD', key .. ':fin:' .. class, start, tenant)
    end
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
