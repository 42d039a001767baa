-- GCRA, the arithmetic of src/gcra.rs written once for the scripts (a prelude of pace.lua,
-- learned_pace.lua and the slot scripts; store::redis::pacing_differential checks each
-- against the Rust core). Times in microseconds; a limit keeps its TAT (theoretical
-- arrival time): the time its cells are taken until.

-- When a call may go under a TAT `tat` at `now`, with `tolerance` us of burst left for it
-- ((burst - its cells) emission intervals): at or before `now` when it conforms already.
local function gcra_at(tat, now, tolerance)
  return math.max(tat, now) - tolerance
end

-- The TAT once a call of `cells` cells, `iv` us each, goes at `at`.
local function gcra_after(tat, at, cells, iv)
  return math.max(tat, at) + cells * iv
end

-- When a call of `cells` conforms under `iv` us a cell and `cap` cells at once (`Gcra::
-- conforms_at`): a call larger than the bucket waits for a full one.
local function gcra_conforms_at(iv, cap, tat, now, cells)
  local n = math.max(1, math.min(cells, cap))
  return math.max(now, gcra_at(tat, now, (cap - n) * iv))
end

-- The TAT once a call of `cells` goes at `at`, charged its whole cost (`Gcra::charge`);
-- negative cells give back, never below `at` (a full bucket holds no more).
local function gcra_charge(iv, tat, at, cells)
  return math.max(gcra_after(tat, at, cells, iv), at)
end
