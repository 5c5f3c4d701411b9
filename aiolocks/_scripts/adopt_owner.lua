-- Hand a holding kept in an owner key (mutex, RW writer) over to a new token: adopt().
-- KEYS[1] owner   KEYS[2..] keys kept as long as the lease (the fence counter)
-- ARGV[1] the handed-over token   ARGV[2] the adopter's new token
-- ARGV[3] ttl_ms (the adopter's lease)
-- Returns 1 when the new token holds it now (also when it already did: a retried call), 0
-- when the old token no longer holds it: the holding ended, or was adopted already (the
-- old token holds nothing after a first adopt, so a handle is adopted once, across every
-- process). Never takes a lock that is free or someone else's.
local current = redis.call('GET', KEYS[1])
if current and (current == ARGV[1] or current == ARGV[2]) then
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
  keep_all(KEYS, 2, tonumber(ARGV[3]) + IDLE_MS)
  return 1
end
return 0
