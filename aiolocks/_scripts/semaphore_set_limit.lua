-- Change the stored limit on purpose; a higher limit hands the new permits to waiters.
-- KEYS as semaphore_acquire.   ARGV[1] new limit   ARGV[2] channel   ARGV[3] caller's tag
-- Returns {previous limit or 0, grants...} (grants: token, fence, ttl).
check_keys({'zset', 'list', 'zset', 'counter', 'hash', 'counter'})
local k = sem_keys()
local previous = tonumber(redis.call('GET', k.limit) or 0)
redis.call('SET', k.limit, ARGV[1])
local now = now_ms()
purge_expired(k.holders, k.fences, now)
purge_dead(k.queue, k.waiters, now)
local grants = {}
sem_fill(k, tonumber(ARGV[1]), ARGV[2], ARGV[3], now, grants)
return {previous, unpack(grants)}
