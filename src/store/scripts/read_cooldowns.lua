-- Every closed cooldown gate, for a worker that (re)subscribed and may have missed a move.
-- KEYS[1] the gates hash (upstream -> reopen time in ms)
-- Returns {upstream, ms left, upstream, ms left, ...} for gates still closed.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local all = redis.call('HGETALL', KEYS[1])
local out = {}
for i = 1, #all, 2 do
  local left = (tonumber(all[i + 1]) or 0) - now
  if left > 0 then
    out[#out + 1] = all[i]
    out[#out + 1] = left
  end
end
return out
