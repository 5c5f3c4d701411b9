-- Shared by the rate limiter's scripts (GCRA, the generic cell rate algorithm).
--
-- One string key per name holds the whole state, written as six fields separated by spaces:
--   "<tat> <seq> <interval> <burst> <rate> <per>"
-- tat       the theoretical arrival time: server microseconds, an integer; a permit of cost
--           n is granted at max(tat, now) + n * interval - burst * interval
-- seq       counts the reservations (a cancelled wait gives its slot back only if the state
--           is still the one its reservation wrote: tat and seq both)
-- interval  microseconds per permit, an integer (ceil(per * 1e6 / rate): never faster)
-- burst     permits granted at once at most
-- rate per  as the first user gave them (for inspect() and the mismatch error)
-- The key expires IDLE_MS after tat: past tat the state is the same as no state at all.

-- The parsed state of KEYS[1], or nil when there is none; fails, naming the key, when the
-- key holds something aiolocks did not write (another type, or a string of another shape).
local function read_state()
  local raw = redis.pcall('GET', KEYS[1])
  if type(raw) == 'table' and raw['err'] then
    check_keys({'string'})  -- names the key
    return fail(raw['err'])
  end
  if not raw then
    return nil
  end
  local tat, seq, interval, burst, rate, per =
    string.match(raw, '^(%d+) (%d+) (%d+) (%d+) (%S+) (%S+)$')
  if not tat then
    fail('WRONGTYPE aiolocks: ' .. KEYS[1] .. ' holds a string that is not a rate limiter state')
  end
  return {tat = tat, seq = seq, interval = interval, burst = burst, rate = rate, per = per}
end

-- Write the state with tat `tat` (a number) and seq `seq`; it expires IDLE_MS after tat.
local function write_state(tat, seq, interval, burst, rate, per, now)
  local text = int_str(tat)
  local state = table.concat({text, int_str(seq), interval, burst, rate, per}, ' ')
  local ms = math.ceil(math.max(tat - now, 0) / 1000) + IDLE_MS
  redis.call('SET', KEYS[1], state, 'PX', int_str(ms))
  return text
end
