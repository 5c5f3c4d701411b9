-- Give back the caller's permit, or withdraw it from the queue; hand free permits on.
-- Also the cancellation clean-up: whatever state the token reached, it leaves none.
-- KEYS as semaphore_acquire.   ARGV[1] member   ARGV[2] channel   ARGV[3] the caller's limit
-- Returns {held, grants...}: held 1 if the caller held a live permit; grants: token,
-- fence, ttl of each waiter given a permit.
check_keys({'zset', 'list', 'zset', 'counter', 'hash', 'counter'})
local k = sem_keys()
local member, channel = ARGV[1], ARGV[2]
local token, _, tag = split_member(member)
local now = now_ms()

dequeue(k.queue, k.waiters, member)
local held = release_from_set(k.holders, k.fences, token, now)
purge_expired(k.holders, k.fences, now)
purge_dead(k.queue, k.waiters, now)
local grants = {}
sem_fill(k, tonumber(redis.call('GET', k.limit) or ARGV[3]), channel, tag, now, grants)
return {held, unpack(grants)}
