-- Give back the caller's permit, or withdraw it from the queue; hand free permits on.
-- Also the cancellation clean-up: whatever state the token reached, it leaves none.
-- KEYS as semaphore_acquire.   ARGV[1] member   ARGV[2] channel   ARGV[3] the caller's limit
-- Returns {held, grants...}: held 1 if the caller held a live permit; grants: token,
-- fence, ttl of each waiter given a permit.
-- Free path (held, nobody queued): TIME, LINDEX, ZSCORE, HDEL, ZREM. Each key's type is
-- checked by its first command, before anything is written on it.
local k = sem_keys()
local member, channel = ARGV[1], ARGV[2]
local token, _, tag = split_member(member)
local now = now_ms()

local head = read_key(2, 'first')
local limit = nil
if head then  -- permits may go to waiters below: every key they touch checked first
  limit = tonumber(read_key(6, 'counter') or ARGV[3])
  read_key(4, 'counter')
  read_key(5, 'hash')
  read_key(3, 'zset')
end
local held = release_from_set(k.holders, k.fences, token, now)
if held == 0 and head and redis.call('ZREM', k.waiters, member) == 1 then
  redis.call('LREM', k.queue, 1, member)  -- withdrawn from the queue (a cancelled waiter)
end
local grants = {}
if head then
  sem_fill(k, limit, channel, tag, now, grants, sem_held(k, limit, now))
end
return {held, unpack(grants)}
