-- Try to take the mutex; optionally join its FIFO queue.
-- KEYS[1] owner    STRING token of the holder, with the lease as its PX expiry
-- KEYS[2] queue    LIST   waiting members, FIFO
-- KEYS[3] waiters  ZSET   member -> liveness deadline (server ms)
-- KEYS[4] fence    STRING fencing counter, a hybrid logical clock (grant_fence, _prelude.lua)
-- ARGV[1] member   "<token>:<ttl_ms>:<tag>:x" (see _prelude.lua)
-- ARGV[2] 'wait' to queue when busy, 'try' not to    ARGV[3] channel for grants
-- Queued behind a local hand-off cohort's token, it tells the cohort (tell_cohort).
-- Returns fence, an integer, when the caller takes it free with nobody queued (an integer
--         reply costs the server about 5,000 instructions less than a table),
--         {1, fence} when the caller holds it otherwise (also when it already did: idempotent),
--         {0, pttl, floor} when queued behind a holder with pttl ms of lease left,
--         {-1, pttl, floor} when busy and the caller did not queue;
--         floor: the fence floor (fence_floor, _prelude.lua): a grant of the caller's
--         token at or below it is stale.
local owner, queue, waiters, fence_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local member, mode, channel = ARGV[1], ARGV[2], ARGV[3]
local token, ttl, tag = split_member(member)

-- Only what the decision needs is read; each read checks its key's type, and the waiters
-- zset, read on the contended paths only, is checked by its first command there, before
-- anything is written. Free path: EXISTS, GET, TIME, SET, SET. EXISTS checks no type, and
-- needs none: it answers 0 only when the owner and the queue are both missing; any other
-- answer reads each key that exists, checking its type.
local present = redis.call('EXISTS', owner, queue)
if present == 0 then
  -- The uncontended path: free, nobody queued. It returns before the helpers only the
  -- other paths use are defined (the mark below).
  local stored = read_key(4, 'counter') or 0
  redis.call('SET', owner, token, 'PX', ttl)
  return grant_fence(fence_key, token, ttl, stored, true)
end

-- (the prelude's other helpers are defined here)

local current = read_key(1, 'string')
if current == token then  -- a re-check, a retry or a late grant's confirmation: renew
  local stored = read_key(4, 'counter') or 0
  extend_lease({owner, fence_key}, ttl)
  return {1, stored - fence_block(token) + 1}
end
-- The queue exists unless the owner alone does (then nobody waits: no head, no list whose
-- type matters to the RPUSH that makes it).
local head = nil
if present == 2 or not current then
  head = read_key(2, 'first')
end
local stored = read_key(4, 'counter') or 0

local now = now_ms()
if not current then
  -- Free while members are queued (the holder's lease ran out, or the caller is the head):
  -- the first live one takes it, dead ones ahead of it dropped.
  local first = pop_live(queue, waiters, head, now)
  if not first or first == member then
    redis.call('SET', owner, token, 'PX', ttl)
    return {1, grant_fence(fence_key, token, ttl, stored, true)}
  end
  local next_token, next_ttl = split_member(first)
  redis.call('SET', owner, next_token, 'PX', next_ttl)
  local fence = grant_fence(fence_key, next_token, next_ttl, stored, true)
  -- Published even to the caller's own client: this reply does not carry the grant.
  announce(channel, next_token, fence, next_ttl, nil, tag)
  stored = fence + fence_block(next_token) - 1
end

if mode == 'wait' then
  enqueue(queue, waiters, member, now, ttl)
  tell_cohort(channel, current)
  return {0, redis.call('PTTL', owner), fence_floor(fence_key, stored)}
end
return {-1, redis.call('PTTL', owner), fence_floor(fence_key, stored)}
