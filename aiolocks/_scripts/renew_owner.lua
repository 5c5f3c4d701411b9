-- Extend a lease held as an owner key (mutex, RW writer) if the caller still holds it.
-- KEYS[1] owner   ARGV[1] token   ARGV[2] ttl_ms
-- Returns 1 when extended, 0 when the token no longer holds it (the lease is lost).
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
