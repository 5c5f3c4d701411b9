-- Extend the leader's lease if the caller still leads.
-- KEYS[1] leader   ARGV[1] token   ARGV[2] ttl_ms
-- Returns 1 when extended, 0 when the token no longer leads (the lease is lost).
if redis.call('HGET', KEYS[1], 'token') == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
