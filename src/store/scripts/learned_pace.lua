-- Learned pacing for one upstream key, in one step (server clock): learn the provider's
-- limits and resynchronise from -remaining, charge corrections, take the cells of the calls
-- about to go, or hold them behind a probe (cold start, recovery after a throttle).
-- The rules are LearnedBucket::apply's, over the crate's GCRA core (gcra.lua, prepended);
-- the test learned_pace_script_answers_as_the_memory_store checks that this script answers
-- as the memory store does, with the TIME read below replaced by its own clock.
-- KEYS[1] hash: l1..l4 limits, t1..t4 theoretical arrival times (us), m mode,
--         pu probe lease end (us), ru recovery end (us)
-- ARGV[1] headroom (thousandths), ARGV[2] answered (0 none, 1 ok, 2 throttle),
-- ARGV[3] probe lease (us), ARGV[4] recovery (us), ARGV[5] poll (us),
-- then per dimension d = 1..4: limit, remaining, charge, take (ARGV[6 + 4 (d - 1) ..]),
-- then ARGV[22] queued (1: the headers waited in a worker; they never replace a different
-- limit, see PaceAsk::queued)
-- Returns {wait us, hold us, probe 0/1, mode, recovering 0/1, l1, l2, l3, l4}
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local h = math.min(math.max(tonumber(ARGV[1]), 100), 1000)
local answered = tonumber(ARGV[2])
local lease = math.max(tonumber(ARGV[3]), 1000)
local recover = tonumber(ARGV[4])
local poll = math.max(tonumber(ARGV[5]), 1000)
local MAX_LIMIT = 1000000000
local queued = tonumber(ARGV[22] or '0') == 1

local state = redis.call('HMGET', KEYS[1], 'l1', 'l2', 'l3', 'l4', 't1', 't2', 't3', 't4', 'm', 'pu', 'ru')
local limit, tat = {}, {}
for d = 1, 4 do
  limit[d] = tonumber(state[d]) or 0
  tat[d] = tonumber(state[4 + d]) or 0
end
local mode = tonumber(state[9]) or 0
local pu = tonumber(state[10]) or 0
local ru = tonumber(state[11]) or 0

local function shape(d, l)
  local per_minute = math.max(l * h / 1000, 1)
  local interval = math.max(math.floor(60000000 / per_minute), 1)
  local capacity
  if d == 1 then capacity = math.max(math.floor(per_minute / 60), 1)
  else capacity = math.max(math.floor(per_minute), 1) end
  return interval, capacity
end

local learned = false
for d = 1, 4 do
  local l = tonumber(ARGV[6 + 4 * (d - 1)])
  local r = tonumber(ARGV[7 + 4 * (d - 1)])
  local stale = queued and limit[d] ~= 0 and limit[d] ~= l
  if l > 0 and l <= MAX_LIMIT and not stale then
    learned = true
    local interval, capacity = shape(d, l)
    local floor = gcra_with_room(interval, capacity, now, math.min(r, l))
    if limit[d] ~= l then
      limit[d] = l
      tat[d] = floor
    else
      tat[d] = math.max(tat[d], floor)
    end
  end
end
if learned then mode = 2 end
if answered ~= 0 and mode == 0 then mode = 1 end
if answered == 1 then
  ru = 0
  pu = 0
elseif answered == 2 then
  ru = math.max(ru, now + recover)
  pu = 0
end
if ru ~= 0 and now >= ru then ru = 0 end

for d = 1, 4 do
  local c = tonumber(ARGV[8 + 4 * (d - 1)])
  if c ~= 0 and limit[d] > 0 then
    local interval = shape(d, limit[d])
    tat[d] = gcra_charge(interval, tat[d], now, c)
  end
end

local wait, hold, probe = 0, 0, 0
local any = false
for d = 1, 4 do
  if tonumber(ARGV[9 + 4 * (d - 1)]) > 0 then any = true end
end
if any then
  if mode == 0 or ru > now then
    if pu > now then
      hold = math.min(math.max(pu - now, 1000), poll)
    else
      pu = now + lease
      probe = 1
    end
  end
  if hold == 0 then
    local asks = {}
    for d = 1, 4 do
      local take = tonumber(ARGV[9 + 4 * (d - 1)])
      if limit[d] > 0 and take > 0 then
        local interval, capacity = shape(d, limit[d])
        asks[d] = {interval, capacity, take}
      end
    end
    wait = gcra_reserve(now, tat, asks, 4) - now
  end
end

local last = now
for d = 1, 4 do
  if tat[d] > last then last = tat[d] end
end
redis.call('HSET', KEYS[1],
  'l1', limit[1], 'l2', limit[2], 'l3', limit[3], 'l4', limit[4],
  't1', string.format('%.0f', tat[1]), 't2', string.format('%.0f', tat[2]),
  't3', string.format('%.0f', tat[3]), 't4', string.format('%.0f', tat[4]),
  'm', mode, 'pu', string.format('%.0f', pu), 'ru', string.format('%.0f', ru))
-- Learned limits outlive the pacing state: a worker that starts within a day starts informed.
redis.call('PEXPIRE', KEYS[1], math.max(math.ceil((last - now) / 1000), 0) + 86400000)
local recovering = 0
if ru > now then recovering = 1 end
return {math.floor(wait), math.floor(hold), probe, mode, recovering, limit[1], limit[2], limit[3], limit[4]}
