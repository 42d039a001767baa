-- GCRA, the crate's core (src/gcra.rs) in Lua: prepended to every script that paces
-- (pace.lua, learned_pace.lua, the slot scripts), so the arithmetic is written once here.
-- Each function is its namesake on `Gcra`, a rate being `iv` (us a cell) and `cap` (cells at
-- once), times in us; store::redis::pacing_differential checks the scripts against gcra.rs.

-- The cells a call asking for `asked` takes: at least 1, at most the capacity.
local function gcra_cells(cap, asked)
  return math.max(1, math.min(asked, cap))
end

-- The earliest moment, `now` or later, at which `cells` conform under `tat`.
local function gcra_conforms_at(iv, cap, tat, now, cells)
  return math.max(now, tat - (cap - gcra_cells(cap, cells)) * iv)
end

-- The TAT once `cells` go at `at`.
local function gcra_take(iv, cap, tat, at, cells)
  return math.max(tat, at) + gcra_cells(cap, cells) * iv
end

-- The TAT of a bucket with room for `room` cells at `now`.
local function gcra_with_room(iv, cap, now, room)
  return now + (cap - math.max(0, math.min(room, cap))) * iv
end

-- The TAT once `cells` are charged after the fact (negative: given back), never before now.
local function gcra_charge(iv, tat, now, cells)
  return math.max(math.max(tat, now) + cells * iv, now)
end

-- Reserves a call's cells in buckets 1..n at once (`reserve`): `asks[i]` is {iv, cap, cells}
-- or nil to leave bucket i out; `tats` is updated. Returns when the call goes.
local function gcra_reserve(now, tats, asks, n)
  local send = now
  for i = 1, n do
    local a = asks[i]
    if a then
      send = math.max(send, gcra_conforms_at(a[1], a[2], tats[i], now, a[3]))
    end
  end
  for i = 1, n do
    local a = asks[i]
    if a then
      tats[i] = gcra_take(a[1], a[2], tats[i], send, a[3])
    end
  end
  return send
end
