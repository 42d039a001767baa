-- Reserves a call's cells in every pacing dimension at once (GCRA, server clock) and
-- returns how long the call waits before it goes; gcra.lua is prepended. The test
-- pace_script_answers_as_the_memory_store checks that this script answers as the memory
-- store does, with the TIME read below replaced by its own clock.
-- KEYS[1] hash of theoretical arrival times in microseconds, one field per dimension
-- ARGV triples per dimension: emission interval (us), capacity (cells), this call's cells
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local n = #ARGV / 3
local tats, asks = {}, {}
for i = 1, n do
  -- A dimension not seen before starts idle.
  tats[i] = tonumber(redis.call('HGET', KEYS[1], i)) or now
  asks[i] = {tonumber(ARGV[3 * i - 2]), tonumber(ARGV[3 * i - 1]), tonumber(ARGV[3 * i])}
end
local send = gcra_reserve(now, tats, asks, n)
local last = now
for i = 1, n do
  redis.call('HSET', KEYS[1], i, string.format('%.0f', tats[i]))
  if tats[i] > last then last = tats[i] end
end
redis.call('PEXPIRE', KEYS[1], math.ceil((last - now) / 1000) + 1000)
return math.floor(send - now)
