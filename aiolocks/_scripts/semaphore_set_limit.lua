-- Change the stored limit on purpose; a higher limit hands the new permits to waiters.
-- KEYS as semaphore_acquire.   ARGV[1] new limit   ARGV[2] channel   ARGV[3] caller's tag
-- ARGV[4] the caller's ttl_ms: the stored limit is kept at least ttl + IDLE_MS (holders
--         and waiters keep it longer), never shorter than it already was
-- Returns {previous limit or 0, grants...} (grants: token, fence, ttl).
check_keys({'zset', 'list', 'zset', 'counter', 'hash', 'counter'})
local k = sem_keys()
local previous = tonumber(redis.call('GET', k.limit) or 0)
local left = redis.call('PTTL', k.limit)
redis.call('SET', k.limit, ARGV[1], 'PX', int_str(math.max(left, tonumber(ARGV[4]) + IDLE_MS)))
local now = now_ms()
local grants = {}
local limit = tonumber(ARGV[1])
sem_fill(k, limit, ARGV[2], ARGV[3], now, grants, sem_held(k, limit, now))
return {previous, unpack(grants)}
