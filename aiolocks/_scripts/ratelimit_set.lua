-- Store other limits for a name on purpose (set_limits()), keeping what was reserved: the
-- stored state is carried over to them (see carry()), in one call, and stamped with the
-- server's clock so that callers with older limits adopt these.
-- KEYS[1] state  STRING  (see _ratelimit.lua)
-- ARGV    per limit: interval (µs per permit, integer), burst, rate, per
-- Returns {stamp, then per limit stored before: rate, per, burst} (none: the name was idle)
local limits = given_limits(1)
local state, _, stored = read_state()
local now = now_us()
local tats, seq = {}, 0
if state then
  tats, seq = carry(state, limits, now), tonumber(state[1].seq) + 1
else
  for i = 1, #limits do
    tats[i] = now
  end
end
local stamp = math.max(now, stored + 1)
write_state(limits, tats, seq, now, stamp)
local reply = {int_str(stamp)}
for _, limit in ipairs(state or {}) do
  reply[#reply + 1] = limit.rate
  reply[#reply + 1] = limit.per
  reply[#reply + 1] = limit.burst
end
return reply
