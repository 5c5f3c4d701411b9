-- The rate limiter's state as the server sees it now.
-- KEYS[1] state  STRING  (see _ratelimit.lua)
-- Returns {now_us} when there is no state (never used, or idle), else
--         {now_us, tat, interval, burst, rate, per}
local state = read_state()
local now = int_str(now_us())
if not state then
  return {now}
end
return {now, state.tat, state.interval, state.burst, state.rate, state.per}
