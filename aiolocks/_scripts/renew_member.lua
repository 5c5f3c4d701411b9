-- Extend a lease held as a member of a sorted set of holders (semaphore, RW readers).
-- KEYS[1] holders ZSET token -> lease deadline (server ms)
-- ARGV[1] token   ARGV[2] ttl_ms
-- Returns 1 when extended, 0 when the token no longer holds (or its lease had ended).
local now = now_ms()
local deadline = redis.call('ZSCORE', KEYS[1], ARGV[1])
if deadline and tonumber(deadline) >= now then
  redis.call('ZADD', KEYS[1], 'XX', now + tonumber(ARGV[2]), ARGV[1])
  return 1
end
return 0
