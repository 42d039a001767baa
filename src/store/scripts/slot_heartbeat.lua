-- Renews this worker's leases and its own liveness, and counts the workers alive.
-- XX: a lease released meanwhile is never brought back here. A lease that is gone (expired
-- unrenewed, or removed) is reported instead, so the worker can put back those it still
-- holds; a worker whose bookkeeping is gone (as in slot_acquire.lua) is told to resync.
-- Also drops from the tiers' wait queues (slot_acquire.lua) every worker no longer alive
-- (no record for a worker TTL: crashed, or restarted under a new id), so a dead worker's
-- entry is gone within a worker TTL and a heartbeat, not only when a release reaches it.
-- Not in the first worker TTL of an epoch, while the live workers put themselves back.
-- KEYS[1] global lease set, KEYS[2] worker set, KEYS[3] epoch key, KEYS[4] wait book
-- (slot_acquire.lua), KEYS[5..n] the tier set of each lease below
-- ARGV[1] worker id, ARGV[2] worker TTL in ms, ARGV[3] the worker's epoch,
-- then per lease: its id, its TTL in ms
-- Returns {'-1'} to resync, else {workers alive, global count, ids of missing leases...}.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local record = redis.call('ZSCORE', KEYS[2], ARGV[1])
if redis.call('GET', KEYS[3]) ~= ARGV[3] or not record or tonumber(record) <= now then
  return {'-1'}
end
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[2]), ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local epoch_began = (tonumber(string.match(ARGV[3], '^(%d+)%.')) or 0) * 1000
if now - epoch_began >= tonumber(ARGV[2]) then
  for _, field in ipairs(redis.call('HKEYS', KEYS[4])) do
    if string.sub(field, 1, 2) == 'c:' then
      local key = string.sub(field, 3)
      for _, entry in ipairs(redis.call('ZRANGE', key .. ':waiting', 0, -1)) do
        local worker = string.match(entry, '^([^|]*)|')
        if not worker or not redis.call('ZSCORE', KEYS[2], worker) then
          leave_entry(key, entry)
        end
      end
    end
  end
end
local missing = {}
for i = 5, #KEYS do
  local id = ARGV[2 * i - 6]
  local expiry = now + tonumber(ARGV[2 * i - 5])
  if redis.call('ZSCORE', KEYS[1], id) then
    redis.call('ZADD', KEYS[1], 'XX', expiry, id)
    redis.call('ZADD', KEYS[i], 'XX', expiry, id)
  else
    missing[#missing + 1] = id
  end
end
local out = {tostring(redis.call('ZCARD', KEYS[2])), tostring(redis.call('ZCARD', KEYS[1]))}
for _, id in ipairs(missing) do
  out[#out + 1] = id
end
return out
