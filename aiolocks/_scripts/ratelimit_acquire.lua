-- Reserve the earliest slot for `cost` permits of every limit at once, unless it is later
-- than `max_wait`: GCRA per limit, the slot the latest any limit allows.
-- KEYS[1] state  STRING  (see _ratelimit.lua)
-- ARGV    cost, max_wait (µs; -1: any), then per limit: interval (µs per permit, integer),
--         burst, rate, per
-- Returns {1, delay_us, state, seq, now_us, binding, tat...} reserved: the slot is delay_us
--         after now_us, the server's clock (0: now); state is the text written (for a
--         give-back), binding the 1-based limit that set the slot (0: none, now), and the
--         tats the limits had before (a give-back writes them back)
--         {0, delay_us, binding}  refused: the slot is later than max_wait; nothing changed
--         {-2, rate, per, burst, ...}  stored with other limits; nothing changed
local cost, max_wait = tonumber(ARGV[1]), tonumber(ARGV[2])
local count = (#ARGV - 2) / 4
local state = read_state()
local now = now_us()
local limits, before, seq = {}, {}, 0
for i = 1, count do
  local at = 2 + (i - 1) * 4
  limits[i] = {interval = ARGV[at + 1], burst = ARGV[at + 2], rate = ARGV[at + 3], per = ARGV[at + 4]}
  before[i] = 0
end
if state then
  local same = #state == count
  for i = 1, count do
    same = same and state[i].interval == limits[i].interval and state[i].burst == limits[i].burst
  end
  if not same then
    local stored = {-2}
    for _, limit in ipairs(state) do
      stored[#stored + 1] = limit.rate
      stored[#stored + 1] = limit.per
      stored[#stored + 1] = limit.burst
    end
    return stored
  end
  seq = tonumber(state[1].seq)
  for i = 1, count do
    before[i] = tonumber(state[i].tat)
  end
end
-- The earliest slot every limit allows: limit i admits a slot s once s >= tat + (cost -
-- burst) * interval (its GCRA), and then its tat becomes max(tat, s) + cost * interval.
local slot, binding = now, 0
for i = 1, count do
  local step = tonumber(limits[i].interval)
  local earliest = before[i] + (cost - tonumber(limits[i].burst)) * step
  if earliest > slot then
    slot, binding = earliest, i
  end
end
local delay = slot - now
if max_wait >= 0 and delay > max_wait then
  return {0, delay, binding}
end
local tats = {}
for i = 1, count do
  tats[i] = math.max(before[i], slot) + cost * tonumber(limits[i].interval)
end
seq = seq + 1
local reply = {1, delay, write_state(limits, tats, seq, now), seq, int_str(now), binding}
for i = 1, count do
  reply[#reply + 1] = int_str(before[i])
end
return reply
