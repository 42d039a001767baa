-- Closes an upstream's cooldown gate until at least now + delay (server clock), never
-- earlier than it already was, and tells every worker when it moved.
-- KEYS[1] the gates hash (upstream -> reopen time in ms)
-- ARGV[1] upstream, ARGV[2] delay in ms, ARGV[3] pub/sub channel
-- Returns the ms left until the gate reopens.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local reopen = tonumber(redis.call('HGET', KEYS[1], ARGV[1])) or 0
local want = now + tonumber(ARGV[2])
if want > reopen then
  reopen = want
  redis.call('HSET', KEYS[1], ARGV[1], reopen)
  -- Drop gates that reopened long ago (a handful of upstreams: cheap).
  local all = redis.call('HGETALL', KEYS[1])
  local last = reopen
  for i = 1, #all, 2 do
    local at = tonumber(all[i + 1]) or 0
    if at <= now then
      redis.call('HDEL', KEYS[1], all[i])
    elseif at > last then
      last = at
    end
  end
  -- The hash lives as long as its furthest gate.
  redis.call('PEXPIRE', KEYS[1], last - now + 1000)
  redis.call('PUBLISH', ARGV[3], (reopen - now) .. ' ' .. ARGV[1])
end
return reopen - now
