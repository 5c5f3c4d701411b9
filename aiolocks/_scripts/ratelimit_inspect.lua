-- The rate limiter's state as the server sees it now.
-- KEYS[1] state  STRING  (see _ratelimit.lua)
-- Returns {now_us} when there is no state (never used, or idle), else
--         {now_us, then per limit: tat, interval, burst, rate, per}
local state = read_state()
local reply = {int_str(now_us())}
for _, limit in ipairs(state or {}) do
  for _, field in ipairs({limit.tat, limit.interval, limit.burst, limit.rate, limit.per}) do
    reply[#reply + 1] = field
  end
end
return reply
