-- Take several mutex names at once, or none: a multi-lock's first try on a single server
-- (not Cluster: the names' keys are in different hash slots).
-- KEYS[4i+1..4i+4] owner, queue, waiters, fence of name i (as mutex_acquire.lua)
-- ARGV[1] token   ARGV[2] ttl_ms
-- Returns {1, fence_1, ..., fence_n} when the token holds every name now, or {0} when any
-- name is held by another token or has anyone queued: then nothing was changed, and the
-- caller takes the names one by one through their queues.
-- Reads only what the decision needs (each checks its key's type; the waiters zsets are
-- neither read nor written): per name EXISTS owner queue (0 when both are missing: nothing
-- to check), else GET owner, LINDEX queue; then GET fence.
local token, ttl = ARGV[1], ARGV[2]
local current, stored = {}, {}
for i = 1, #KEYS, 4 do
  if redis.call('EXISTS', KEYS[i], KEYS[i + 1]) > 0 then
    current[i] = read_key(i, 'string')
    if (current[i] and current[i] ~= token) or read_key(i + 1, 'first') then
      return {0}
    end
  end
  stored[i] = tonumber(read_key(i + 3, 'counter')) or 0
end
local reply = {1}
for i = 1, #KEYS, 4 do
  if current[i] == token then
    extend_lease({KEYS[i], KEYS[i + 3]}, ttl)
    reply[#reply + 1] = stored[i]
  else
    redis.call('SET', KEYS[i], token, 'PX', ttl)
    reply[#reply + 1] = grant_fence(KEYS[i + 3], token, ttl, stored[i], true)
  end
end
return reply
