-- Jain's fairness index of the whole fleet over the window (fairness_add.lua): over the
-- tenants that waited in a queue in the window, (sum x)^2 / (n * sum x^2) with x a tenant's
-- cost served in the window divided by its weight. Drops the buckets that slid out.
-- KEYS[1] the window's hash; ARGV[1] the window in seconds, ARGV[2] a bucket's width
-- Returns the index as a string, or '' when no tenant waited in the window.
local now = tonumber(redis.call('TIME')[1])
local width = tonumber(ARGV[2])
local oldest = math.floor(now / width) - math.floor(tonumber(ARGV[1]) / width) + 1
local served, waited = {}, {}
local fields = redis.call('HGETALL', KEYS[1])
for i = 1, #fields, 2 do
  local field = fields[i]
  local queued, bucket, tenant = false, string.match(field, '^(%d+)|(.*)$')
  if not bucket then
    queued = true
    bucket, tenant = string.match(field, '^q|(%d+)|(.*)$')
  end
  bucket = tonumber(bucket)
  if not bucket or bucket < oldest then
    redis.call('HDEL', KEYS[1], field)
  elseif queued then
    waited[tenant] = true
  else
    served[tenant] = (served[tenant] or 0) + tonumber(fields[i + 1])
  end
end
local n, sum, squares = 0, 0, 0
for tenant in pairs(waited) do
  local x = served[tenant] or 0
  n = n + 1
  sum = sum + x
  squares = squares + x * x
end
if n == 0 or squares == 0 then
  return ''
end
return string.format('%.17g', sum * sum / (n * squares))
