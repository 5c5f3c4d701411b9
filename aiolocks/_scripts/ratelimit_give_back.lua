-- Give back the slot of a reservation whose caller left before using it, if no later
-- reservation was made since (the state is still the text it wrote): compare-and-set, then
-- every limit's tat as it was before (the counter stays: it only rises).
-- KEYS[1] state  STRING  (see _ratelimit.lua)
-- ARGV    state (the text the reservation wrote), then the tats before it, one per limit
-- Returns 1 given back, 0 not (a later reservation, or the state expired or was removed).
local state, raw, stamp = read_state()
if not state or raw ~= ARGV[1] then
  return 0
end
local tats = {}
for i = 1, #state do
  tats[i] = tonumber(ARGV[i + 1])
end
write_state(state, tats, tonumber(state[1].seq), now_us(), stamp)
return 1
