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
-- Free path (a permit free, nobody queued): ZSCORE, GET limit, LINDEX, GET fence, HLEN
-- (the fences hash's type), TIME, ZCARD, then the grant. Each read checks its key's type;
-- the waiters zset is checked by its first command, on the paths that touch it.
local k = sem_keys()
local member, mode, channel, limit = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local token, ttl, tag = split_member(member)

local now = now_ms()
local deadline = checked(redis.pcall('ZSCORE', k.holders, token), k.holders, 'zset')
local stored = read_key(6, 'counter')
local counter = tonumber(read_key(4, 'counter')) or 0
if deadline and tonumber(deadline) >= now then  -- already granted (maybe unread): re-arm
  local fence = checked(redis.pcall('HGET', k.fences, token), k.fences, 'hash')
  renew_member_lease({k.holders, k.fences, k.fence, k.limit}, token, ttl, now)
  return {1, tonumber(fence)}
end
local head = read_key(2, 'first')
read_key(5, 'hash')
if stored and tonumber(stored) ~= limit then
  if not checked(redis.pcall('ZSCORE', k.waiters, member), k.waiters, 'zset') then
    return {-2, tonumber(stored)}
  end
  limit = tonumber(stored)  -- queued before a set_limit: the stored limit rules
end
local held = sem_held(k, limit, now)
if head or (mode == 'wait' and held >= limit) then
  read_key(3, 'zset')  -- the waiters zset is written below: its type first
end
if not stored then  -- kept as long as a holder or waiter, from the grant or enqueue below
  redis.call('SET', k.limit, limit, 'PX', int_str(tonumber(ttl) + IDLE_MS))
end

local grants = {}
if head then
  held = sem_fill(k, limit, channel, tag, now, grants, held)
  if redis.call('ZSCORE', k.holders, token) then  -- it was queued and its turn came
    return {1, tonumber(redis.call('HGET', k.fences, token)), unpack(grants)}
  end
  head = redis.call('LINDEX', k.queue, 0)
end
if not head and held < limit then
  local fence = hold_in_set(k.holders, k.fences, k.fence, token, ttl, now, {k.limit}, counter)
  return {1, fence, unpack(grants)}
end
if mode == 'wait' then
  enqueue(k.queue, k.waiters, member, now, ttl, {k.limit})
  return {0, first_expiry(k.holders, now), fence_floor(k.fence), unpack(grants)}
end
return {-1, first_expiry(k.holders, now), fence_floor(k.fence), unpack(grants)}
