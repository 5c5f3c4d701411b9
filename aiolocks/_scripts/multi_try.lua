-- Take several mutex names at once, or none: a multi-lock's first try on a single server
-- (not Cluster: the names' keys are in different hash slots).
-- KEYS[4i+1..4i+4] owner, queue, waiters, fence of name i (as mutex_acquire.lua)
-- ARGV[1] token   ARGV[2] ttl_ms
-- Returns {1, fence_1, ..., fence_n} when the token holds every name now, or {0} when any
-- name is held by another token or has anyone queued: then nothing was changed, and the
-- caller takes the names one by one through their queues.
local types = {}
for i = 1, #KEYS, 4 do
  types[i], types[i + 1], types[i + 2], types[i + 3] = 'string', 'list', 'zset', 'counter'
end
check_keys(types)
local token, ttl = ARGV[1], ARGV[2]
for i = 1, #KEYS, 4 do
  local current = redis.call('GET', KEYS[i])
  if (current and current ~= token) or redis.call('LLEN', KEYS[i + 1]) > 0 then
    return {0}
  end
end
local reply = {1}
for i = 1, #KEYS, 4 do
  if redis.call('GET', KEYS[i]) == token then
    renew_owner_lease({KEYS[i], KEYS[i + 3]}, token, ttl)
    reply[#reply + 1] = tonumber(redis.call('GET', KEYS[i + 3])) or 0
  else
    redis.call('SET', KEYS[i], token, 'PX', ttl)
    reply[#reply + 1] = grant_fence(KEYS[i + 3], token, ttl)
  end
end
return reply
