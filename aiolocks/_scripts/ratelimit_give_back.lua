-- Give back the slot of a reservation whose caller left before using it, if no later
-- reservation was made since (the state is still the one it wrote): compare-and-set.
-- KEYS[1] state  STRING  (see _ratelimit.lua)
-- ARGV    tat, seq (as the reservation's reply gave them), cost
-- Returns 1 given back, 0 not (a later reservation, or the state expired or was removed).
local state = read_state()
if not state or state.tat ~= ARGV[1] or state.seq ~= ARGV[2] then
  return 0
end
local tat = tonumber(state.tat) - tonumber(ARGV[3]) * tonumber(state.interval)
write_state(tat, tonumber(state.seq), state.interval, state.burst, state.rate, state.per, now_us())
return 1
