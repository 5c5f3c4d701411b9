-- Extend a lease held as a member of a sorted set of holders (semaphore, RW readers).
-- KEYS[1] holders ZSET token -> lease deadline (server ms)
-- KEYS[2..] keys kept as long as the lease (fences hash, fence counter, a semaphore's limit)
-- ARGV[1] token   ARGV[2] ttl_ms
-- Returns 1 when extended, 0 when the token no longer holds (or its lease had ended).
return renew_member_lease(KEYS, ARGV[1], ARGV[2], now_ms())
