-- Reserve the earliest slot for `cost` permits of every limit at once, unless it is later
-- than `max_wait`: GCRA per limit, the slot the latest any limit allows.
-- KEYS[1] state  STRING  (see _ratelimit.lua)
-- ARGV    cost, max_wait (µs; -1: any), stamp (of the caller's limits: set_limits()'s, 0
--         when they are its constructor's), then per limit: interval (µs per permit,
--         integer), burst, rate, per
-- Whose limits: the caller's when none are stored or the stored ones are the same; the
-- stored ones when their stamp is newer (the caller adopts them); the caller's, carried
-- over as set_limits() does, when its stamp is newer; other limits, same stamp: mismatch.
-- Returns {1, delay_us, state, seq, now_us, binding, tat...} reserved: the slot is delay_us
--         after now_us, the server's clock (0: now); state is the text written (for a
--         give-back), binding the 1-based limit that set the slot (0: none, now), and the
--         tats the limits had before (a give-back writes them back)
--         {2, ...} the same, under the stored limits (a newer stamp): the caller adopts them
--         (and the stamp) from state
--         {0, delay_us, binding}  refused: the slot is later than max_wait; nothing changed
--         {3, delay_us, binding, state}  the same, under the stored limits (to adopt)
--         {-3, state}  the stored limits (newer) have a burst below cost; nothing changed
--         {-2, rate, per, burst, ...}  stored with other limits; nothing changed
local cost, max_wait, stamp = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local limits = given_limits(4)
local count = #limits
local state, raw, stored = read_state()
local now = now_us()
local before, seq, adopted = {}, 0, false
if state then
  local same = #state == count
  for i = 1, count do
    same = same and state[i].interval == limits[i].interval and state[i].burst == limits[i].burst
  end
  seq = tonumber(state[1].seq)
  if same or stored > stamp then
    adopted = stored > stamp
    if not same then
      limits, count = state, #state
      for i = 1, count do
        if cost > tonumber(state[i].burst) then
          return {-3, raw}
        end
      end
    end
    for i = 1, count do
      before[i] = tonumber(state[i].tat)
    end
    stamp = math.max(stamp, stored)
  elseif stamp > stored then
    before = carry(state, limits, now)
  else
    local mismatch = {-2}
    for _, limit in ipairs(state) do
      mismatch[#mismatch + 1] = limit.rate
      mismatch[#mismatch + 1] = limit.per
      mismatch[#mismatch + 1] = limit.burst
    end
    return mismatch
  end
else
  for i = 1, count do
    before[i] = 0
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
  if adopted then
    return {3, delay, binding, raw}
  end
  return {0, delay, binding}
end
local tats = {}
for i = 1, count do
  tats[i] = math.max(before[i], slot) + cost * tonumber(limits[i].interval)
end
seq = seq + 1
local written = write_state(limits, tats, seq, now, stamp)
local reply = {adopted and 2 or 1, delay, written, seq, int_str(now), binding}
for i = 1, count do
  reply[#reply + 1] = int_str(before[i])
end
return reply
