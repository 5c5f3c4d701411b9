-- Extend the leader's lease if the caller still leads.
-- KEYS[1] leader   KEYS[2..] keys kept as long as the lease (the fence counter)
-- ARGV[1] token   ARGV[2] ttl_ms
-- Returns 1 when extended, 0 when the token no longer leads (the lease is lost).
return renew_leader_lease(KEYS, ARGV[1], ARGV[2])
