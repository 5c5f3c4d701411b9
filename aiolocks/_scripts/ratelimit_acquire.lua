-- Reserve the earliest slot for `cost` permits, unless it is later than `max_wait`.
-- KEYS[1] state  STRING  "<tat> <seq> <interval> <burst> <rate> <per>" (see _ratelimit.lua)
-- ARGV    interval (µs per permit, integer), burst, cost, max_wait (µs; -1: any), rate, per
-- Returns {1, delay_us, tat, seq, now_us} reserved: the slot is delay_us after now_us, the
--         server's clock (0: now); tat and seq identify the reservation (for a give-back)
--         {0, delay_us}  refused: the slot is later than max_wait; nothing changed
--         {-2, rate, per, burst}  the name is stored with other settings; nothing changed
local interval, burst, cost, max_wait = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local state = read_state()
local seq = 0
local now = now_us()
local start = now
if state then
  if state.interval ~= interval or state.burst ~= burst then
    return {-2, state.rate, state.per, state.burst}
  end
  seq = tonumber(state.seq)
  start = math.max(tonumber(state.tat), now)
end
local step = tonumber(interval)
local tat = start + cost * step
local delay = math.max(tat - tonumber(burst) * step - now, 0)
if max_wait >= 0 and delay > max_wait then
  return {0, delay}
end
seq = seq + 1
local text = write_state(tat, seq, interval, burst, ARGV[5], ARGV[6], now)
return {1, delay, text, seq, int_str(now)}
