-- The tenants served most over the window of the ranking served_top_add.lua keeps, most
-- first (ties by name), and what every tenant was served together.
-- KEYS as served_top_add.lua's; ARGV[1] a bucket's width in seconds, ARGV[2] how many
-- Returns {total, tenant, cost, tenant, cost, ...} as strings.
local ring = #KEYS - 1
local width = tonumber(ARGV[1])
local bucket = math.floor(tonumber(redis.call('TIME')[1]) / width)
local meta = KEYS[ring + 1]
local served, total = {}, 0
for slot = 1, ring do
  local held = tonumber(redis.call('HGET', meta, 'b' .. slot))
  if held and held > bucket - ring then
    total = total + (tonumber(redis.call('HGET', meta, 't' .. slot)) or 0)
    local members = redis.call('ZRANGE', KEYS[slot], 0, -1, 'WITHSCORES')
    for i = 1, #members, 2 do
      served[members[i]] = (served[members[i]] or 0) + tonumber(members[i + 1])
    end
  end
end
local ranked = {}
for tenant, cost in pairs(served) do
  ranked[#ranked + 1] = {tenant, cost}
end
table.sort(ranked, function(a, b)
  if a[2] ~= b[2] then
    return a[2] > b[2]
  end
  return a[1] < b[1]
end)
local out = {string.format('%d', total)}
for i = 1, math.min(tonumber(ARGV[2]), #ranked) do
  out[#out + 1] = ranked[i][1]
  out[#out + 1] = string.format('%d', ranked[i][2])
end
return out
