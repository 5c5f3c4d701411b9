-- Extend a lease held as an owner key (mutex, RW writer) if the caller still holds it.
-- KEYS[1] owner   KEYS[2..] keys kept as long as the lease (the fence counter)
-- ARGV[1] token   ARGV[2] ttl_ms
-- Returns 1 when extended, 0 when the token no longer holds it (the lease is lost).
return renew_owner_lease(KEYS, ARGV[1], ARGV[2])
