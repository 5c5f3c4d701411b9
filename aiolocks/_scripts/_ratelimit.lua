-- Shared by the rate limiter's scripts (GCRA, the generic cell rate algorithm).
--
-- One string key per name holds the whole state: per limit (a name may have several, all
-- reserved together), six fields, all separated by spaces, after "=<stamp> " when the
-- limits were set by set_limits():
--   "[=<stamp> ]<tat> <seq> <interval> <burst> <rate> <per>[ <tat> <seq> <interval> ...]"
-- stamp     the server's microseconds when set_limits() stored these limits (absent: 0, the
--           limits of the first user's constructor); a caller with an older stamp (or none)
--           and other limits adopts the stored ones, one with a newer stamp carries the
--           state over to its own (a change that outlived the key)
-- tat       the theoretical arrival time: server microseconds, an integer; a permit of cost
--           n is granted at max(tat, now) + n * interval - burst * interval
-- seq       counts the reservations, the same in every limit (a cancelled wait gives its
--           slot back only if the state is still the text its reservation wrote)
-- interval  microseconds per permit, an integer (ceil(per * 1e6 / rate): never faster)
-- burst     permits granted at once at most
-- rate per  as the first user gave them (for inspect() and the mismatch error)
-- The key expires IDLE_MS after the latest tat: past it the state is the same as none.
--
-- These scripts are loaded without the prelude (no queue, no lease: a call runs none of its
-- definitions), so the few helpers they need are here.

local IDLE_MS = 1000
-- The most a change may put ahead of now (µs): the longest burst span a limit may have.
local MAX_SPAN_US = 2 ^ 50

-- A raised error reply: a table from Redis 7.0 (0x070000) and every Valkey; a string before,
-- which Redis 6.2 prefixes with the script's name (as the prelude's fail()).
local function fail(message)
  if (redis.REDIS_VERSION_NUM or 0) >= 458752 then
    error({err = message})
  end
  error(message)
end

-- An integer as its decimal digits (tostring keeps 14 significant digits; a tat has 16).
local function int_str(n)
  return string.format('%.0f', n)
end

-- The server's clock in microseconds, read once per call.
local function now_us()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end

-- The parsed state of KEYS[1], its text and its stamp, or nil when there is none: a list
-- of limits, each {tat, seq, interval, burst, rate, per} (strings; seq the same in every
-- one); fails, naming the key, when the key holds something aiolocks did not write
-- (another type, or a string of another shape).
local function read_state()
  local raw = redis.pcall('GET', KEYS[1])
  if type(raw) == 'table' and raw['err'] then
    local got = redis.call('TYPE', KEYS[1])['ok']
    fail('WRONGTYPE aiolocks: ' .. KEYS[1] .. ' holds a ' .. got .. ', not a string')
  end
  if not raw then
    return nil
  end
  local limits, at, stamp = {}, 1, 0
  local marked, after = string.match(raw, '^=(%d+) ()')
  if marked then
    stamp, at = tonumber(marked), after
  end
  while true do
    local tat, seq, interval, burst, rate, per, stop =
      string.match(raw, '^(%d+) (%d+) (%d+) (%d+) (%S+) (%S+)()', at)
    if not tat or (stop <= #raw and string.sub(raw, stop, stop) ~= ' ') then
      fail('WRONGTYPE aiolocks: ' .. KEYS[1] .. ' holds a string that is not a rate limiter state')
    end
    limits[#limits + 1] =
      {tat = tat, seq = seq, interval = interval, burst = burst, rate = rate, per = per}
    if stop > #raw then
      return limits, raw, stamp
    end
    at = stop + 1
  end
end

-- The limits given as arguments from ARGV[first] on, four per limit: interval, burst,
-- rate, per (strings, as stored).
local function given_limits(first)
  local limits = {}
  for at = first, #ARGV, 4 do
    limits[#limits + 1] =
      {interval = ARGV[at], burst = ARGV[at + 1], rate = ARGV[at + 2], per = ARGV[at + 3]}
  end
  return limits
end

-- The tats that carry the stored `state` over to other `limits` at `now`, so that what was
-- reserved still counts: limit i keeps the permits its predecessor at the same place still
-- counts (its reserved time not yet past, over its interval), now spaced by its own
-- interval (rounded up: never looser); a limit added at a new place starts as full as the
-- fullest stored limit was (the same share of its burst, at most all of it: a limit with
-- waiters past its burst counts as full). Never more than MAX_SPAN_US ahead.
local function carry(state, limits, now)
  local counted, fullest = {}, 0
  for i, old in ipairs(state) do
    counted[i] = math.max(tonumber(old.tat) - now, 0) / tonumber(old.interval)
    fullest = math.min(math.max(fullest, counted[i] / tonumber(old.burst)), 1)
  end
  local tats = {}
  for i, limit in ipairs(limits) do
    local permits = counted[i] or fullest * tonumber(limit.burst)
    tats[i] = now + math.min(math.ceil(permits * tonumber(limit.interval)), MAX_SPAN_US)
  end
  return tats
end

-- Write the state: each limit's tat (numbers in `tats`) with `seq`, and `stamp` when the
-- limits were set by set_limits() (> 0); it expires IDLE_MS after the latest tat. Returns
-- the text written (what a give-back compares).
local function write_state(limits, tats, seq, now, stamp)
  local parts, latest = {}, now
  if stamp > 0 then
    parts[1] = '=' .. int_str(stamp)
  end
  for i, limit in ipairs(limits) do
    parts[#parts + 1] = table.concat(
      {int_str(tats[i]), int_str(seq), limit.interval, limit.burst, limit.rate, limit.per}, ' ')
    latest = math.max(latest, tats[i])
  end
  local state = table.concat(parts, ' ')
  local ms = math.ceil((latest - now) / 1000) + IDLE_MS
  redis.call('SET', KEYS[1], state, 'PX', int_str(ms))
  return state
end
