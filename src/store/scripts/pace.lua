-- Reserves a call's cells in every pacing dimension at once (GCRA, server clock) and
-- returns how long the call waits before it goes. The GCRA rules are the crate's core
-- (gcra.rs, in the gcra.lua prelude); the test pace_script_answers_as_the_memory_store checks that this script
-- answers as the memory store does, with the TIME read below replaced by its own clock.
-- KEYS[1] hash of theoretical arrival times in microseconds, one field per dimension
-- ARGV triples per dimension: emission interval (us), this call's tolerance (us):
-- (burst - cells) intervals, cells
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local n = #ARGV / 3
local tats = {}
local send = now
for i = 1, n do
  local tat = tonumber(redis.call('HGET', KEYS[1], i)) or now
  tats[i] = tat
  local at = gcra_at(tat, now, tonumber(ARGV[3 * i - 1]))
  if at > send then send = at end
end
local last = now
for i = 1, n do
  local tat = gcra_after(tats[i], send, tonumber(ARGV[3 * i]), tonumber(ARGV[3 * i - 2]))
  redis.call('HSET', KEYS[1], i, string.format('%.0f', tat))
  if tat > last then last = tat end
end
redis.call('PEXPIRE', KEYS[1], math.ceil((last - now) / 1000) + 1000)
return math.floor(send - now)
