-- Release the caller's holding, or withdraw it from the queue; hand the mutex on.
-- Also the cancellation clean-up: whatever state the token reached, it leaves none.
-- KEYS[1] owner  KEYS[2] queue  KEYS[3] waiters  KEYS[4] fence
-- ARGV[1] member "<token>:<ttl_ms>:<tag>:x"   ARGV[2] channel
-- ARGV[3] 'keep' (optional, a local hand-off cohort with tasks still waiting): when nobody
--         waits in the queue, keep holding instead, with a fresh lease and fence block.
-- Returns {1} released (nobody waiting), {1, next_token, next_fence, next_ttl} released and
-- handed on, {0} the caller did not hold it (any queue entry of it is gone now),
-- {0, next_token, next_fence, next_ttl} same, and a free mutex was handed to the queue head,
-- {2, fence} kept ('keep' only): still held, renewed, and `fence` starts its new block.
local owner, queue, waiters, fence_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local member, channel, keep = ARGV[1], ARGV[2], ARGV[3] == 'keep'
local token, ttl, tag = split_member(member)

local current, queued, _, last = read_keys({'string', 'list', 'zset', 'counter'})
local stored = tonumber(last) or 0  -- the fence counter (grant_fence need not read it again)
if dequeue(queue, waiters, member) then
  queued = redis.call('LLEN', queue)  -- withdrawn from the queue (a cancelled waiter)
end
local status = 0
if current == token then
  status = 1
elseif current then
  return {0}
end

if queued > 0 and #purge_dead(queue, waiters, now_ms()) > 0 then
  queued = redis.call('LLEN', queue)
end
if queued == 0 then
  if status == 1 then
    if keep then
      redis.call('PEXPIRE', owner, ttl)
      return {2, grant_fence(fence_key, token, ttl, stored)}
    end
    redis.call('DEL', owner)
  end
  return {status}
end
local next_token, next_ttl, next_tag = pop_head(queue, waiters)
redis.call('SET', owner, next_token, 'PX', next_ttl)
local fence = grant_fence(fence_key, next_token, next_ttl, stored)
announce(channel, next_token, fence, next_ttl, next_tag, tag)
return {status, next_token, fence, next_ttl}
