-- Checks a tenant against the demotion policy and demotes it, atomically.
-- The same rule as DemotionPolicy::should_demote and MemoryState::check_demotion.
-- KEYS[1] throttle set, KEYS[2] token hash {day, n}, KEYS[3] budget, KEYS[4] demotion flag
-- ARGV[1] window ms, ARGV[2] throttle limit, ARGV[3] budget ratio in thousandths,
-- ARGV[4] default budget, ARGV[5] demotion ms
-- Returns {ms left on the demotion (0 = not demoted), 1 if this call demoted the tenant,
-- tokens today, the budget, seconds until the server's UTC day ends}: the last three so
-- the worker can tell what is left of the budget without a round trip of its own.
local t = redis.call('TIME')
local seconds = tonumber(t[1])
local day_left = 86400 - seconds % 86400
local tokens = 0
if tonumber(redis.call('HGET', KEYS[2], 'day')) == math.floor(seconds / 86400) then
  tokens = tonumber(redis.call('HGET', KEYS[2], 'n')) or 0
end
local budget = tonumber(redis.call('GET', KEYS[3])) or tonumber(ARGV[4])
-- Lua's numbers are doubles, and Redis turns a reply past a 64-bit integer into its least
-- value: a budget past 2^53 (none, as a rule: u64::MAX) is answered as 2^53.
if budget > 9007199254740992 then
  budget = 9007199254740992
end
local left = redis.call('PTTL', KEYS[4])
if left > 0 then
  return {left, 0, tokens, budget, day_left}
end
local now = seconds * 1000 + math.floor(tonumber(t[2]) / 1000)
local throttles = redis.call('ZCOUNT', KEYS[1], '(' .. (now - tonumber(ARGV[1])), '+inf')
if throttles >= tonumber(ARGV[2]) or tokens * 1000 > budget * tonumber(ARGV[3]) then
  redis.call('SET', KEYS[4], '1', 'PX', ARGV[5])
  return {tonumber(ARGV[5]), 1, tokens, budget, day_left}
end
return {0, 0, tokens, budget, day_left}
