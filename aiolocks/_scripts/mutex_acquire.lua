-- Try to take the mutex; optionally join its FIFO queue.
-- KEYS[1] owner    STRING token of the holder, with the lease as its PX expiry
-- KEYS[2] queue    LIST   waiting members, FIFO
-- KEYS[3] waiters  ZSET   member -> liveness deadline (server ms)
-- KEYS[4] fence    STRING fencing counter, a hybrid logical clock (grant_fence, _prelude.lua)
-- ARGV[1] member   "<token>:<ttl_ms>:<tag>:x" (see _prelude.lua)
-- ARGV[2] 'wait' to queue when busy, 'try' not to    ARGV[3] channel for grants
-- Returns {1, fence} when the caller holds it (also when it already did: idempotent),
--         {0, pttl, floor} when queued behind a holder with pttl ms of lease left,
--         {-1, pttl, floor} when busy and the caller did not queue;
--         floor: the fence floor (fence_floor, _prelude.lua): a grant of the caller's
--         token at or below it is stale.
local owner, queue, waiters, fence_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local member, mode, channel = ARGV[1], ARGV[2], ARGV[3]
local token, ttl, tag = split_member(member)

local current, queued, _, last = read_keys({'string', 'list', 'zset', 'counter'})
local stored = tonumber(last) or 0  -- the fence counter (grant_fence need not read it again)
if current == token then
  renew_owner_lease({owner, fence_key}, token, ttl)
  return {1, stored - fence_block(token) + 1}
end
if not current and queued == 0 then
  -- The uncontended path: free, nobody queued.
  redis.call('SET', owner, token, 'PX', ttl)
  return {1, grant_fence(fence_key, token, ttl, stored)}
end

local now = now_ms()
purge_dead(queue, waiters, now)
if not current then
  local head = redis.call('LINDEX', queue, 0)
  if not head or head == member then
    if head then
      dequeue(queue, waiters, member)
    end
    redis.call('SET', owner, token, 'PX', ttl)
    return {1, grant_fence(fence_key, token, ttl, stored)}
  end
  -- Free while others wait ahead (the holder's lease ran out): hand it to the head.
  local next_token, next_ttl = pop_head(queue, waiters)
  redis.call('SET', owner, next_token, 'PX', next_ttl)
  local fence = grant_fence(fence_key, next_token, next_ttl, stored)
  announce(channel, next_token, fence, next_ttl, nil, tag)
  stored = fence + fence_block(next_token) - 1
end

if mode == 'wait' then
  enqueue(queue, waiters, member, now, ttl)
  return {0, redis.call('PTTL', owner), fence_floor(fence_key, stored)}
end
return {-1, redis.call('PTTL', owner), fence_floor(fence_key, stored)}
