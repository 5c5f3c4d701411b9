-- Hand a holding kept in a sorted set of leases (semaphore permit, RW reader) over to a new
-- token, keeping its fence: adopt().
-- KEYS[1] holders ZSET token -> lease deadline (server ms)   KEYS[2] fences HASH token -> fence
-- KEYS[3..] more keys kept as long as the lease (the fence counter, a semaphore's limit)
-- ARGV[1] the handed-over token   ARGV[2] the adopter's new token   ARGV[3] ttl_ms
-- Returns 1 when the new token holds it now (also when it already did: a retried call), 0
-- when the old token holds no live lease: the holding ended, or was adopted already.
local holders, fences, old, new = KEYS[1], KEYS[2], ARGV[1], ARGV[2]
local now = now_ms()
local deadline = redis.call('ZSCORE', holders, old)
if deadline and tonumber(deadline) >= now then
  local fence = redis.call('HGET', fences, old)
  redis.call('ZREM', holders, old)
  redis.call('HDEL', fences, old)
  if fence then
    redis.call('HSET', fences, new, fence)
  end
  redis.call('ZADD', holders, now + tonumber(ARGV[3]), new)
  keep_all(KEYS, 1, tonumber(ARGV[3]) + IDLE_MS)
  return 1
end
deadline = redis.call('ZSCORE', holders, new)
if deadline and tonumber(deadline) >= now then
  redis.call('ZADD', holders, 'XX', now + tonumber(ARGV[3]), new)
  keep_all(KEYS, 1, tonumber(ARGV[3]) + IDLE_MS)
  return 1
end
return 0
