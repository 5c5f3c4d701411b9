-- Take a permit of the semaphore; optionally join its FIFO queue.
-- KEYS[1] holders ZSET token -> lease deadline (server ms)   KEYS[2] queue   KEYS[3] waiters
-- KEYS[4] fence   KEYS[5] fences HASH token -> fence   KEYS[6] limit STRING
-- ARGV[1] member "<token>:<ttl_ms>:<tag>:x"   ARGV[2] 'wait' | 'try'   ARGV[3] channel
-- ARGV[4] the caller's limit: checked against the stored one for a new arrival only; a
--         waiter already queued keeps waiting under whatever limit is stored (set_limit)
-- Returns {1, fence, grants...} held (also when it already was), {0, wait_ms, floor,
-- grants...} queued, {-1, wait_ms, floor, grants...} busy and not queued, {-2, stored_limit}
-- the name is stored with another limit (nothing changed). grants: token, fence, ttl of
-- others granted; floor: the fence floor (fence_floor, _prelude.lua).
check_keys({'zset', 'list', 'zset', 'counter', 'hash', 'counter'})
local k = sem_keys()
local member, mode, channel, limit = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local token, ttl, tag = split_member(member)

local now = now_ms()
local deadline = redis.call('ZSCORE', k.holders, token)
if deadline and tonumber(deadline) >= now then  -- already granted (maybe unread): re-arm
  renew_member_lease({k.holders, k.fences, k.fence, k.limit}, token, ttl, now)
  return {1, tonumber(redis.call('HGET', k.fences, token))}
end

local stored = redis.call('GET', k.limit)
if not stored then  -- kept as long as a holder or waiter, from the grant or enqueue below
  redis.call('SET', k.limit, limit, 'PX', int_str(tonumber(ttl) + IDLE_MS))
elseif tonumber(stored) ~= limit then
  if not redis.call('ZSCORE', k.waiters, member) then
    return {-2, tonumber(stored)}
  end
  limit = tonumber(stored)  -- queued before a set_limit: the stored limit rules
end

purge_expired(k.holders, k.fences, now)
purge_dead(k.queue, k.waiters, now)
local grants = {}
sem_fill(k, limit, channel, tag, now, grants)
if redis.call('ZSCORE', k.holders, token) then  -- it was queued and its turn came
  return {1, tonumber(redis.call('HGET', k.fences, token)), unpack(grants)}
end
if redis.call('LLEN', k.queue) == 0 and redis.call('ZCARD', k.holders) < limit then
  return {1, hold_in_set(k.holders, k.fences, k.fence, token, ttl, now, {k.limit}), unpack(grants)}
end
if mode == 'wait' then
  enqueue(k.queue, k.waiters, member, now, ttl, {k.limit})
  return {0, first_expiry(k.holders, now), fence_floor(k.fence), unpack(grants)}
end
return {-1, first_expiry(k.holders, now), fence_floor(k.fence), unpack(grants)}
