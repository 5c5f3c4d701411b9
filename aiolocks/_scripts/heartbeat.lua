-- Keep one process's queue entries of one primitive alive.
-- KEYS[1] waiters  ZSET member -> liveness deadline (server ms)
-- ARGV    members, each "<token>:<ttl_ms>:<tag>:<kind>"; each gets deadline now + its ttl
-- Returns the 1-based indexes of members that were no longer queued (purged as dead);
-- their waiters must re-run acquire to queue again.
local now = now_ms()
local missing = {}
for i, member in ipairs(ARGV) do
  local _, ttl = split_member(member)
  if redis.call('ZADD', KEYS[1], 'XX', 'CH', now + tonumber(ttl), member) == 0
      and not redis.call('ZSCORE', KEYS[1], member) then
    missing[#missing + 1] = i
  end
end
return missing
