-- Release the caller's holding, or withdraw it from the queue; hand the mutex on.
-- Also the cancellation clean-up: whatever state the token reached, it leaves none.
-- KEYS[1] owner  KEYS[2] queue  KEYS[3] waiters  KEYS[4] fence
-- ARGV[1] member "<token>:<ttl_ms>:<tag>:x"   ARGV[2] channel
-- ARGV[3] 'keep' (optional, a local hand-off cohort with tasks still waiting): when nobody
--         waits in the queue, keep holding instead, with a fresh lease and fence block.
--         'carry' (optional): ARGV[4..] are members of the caller's client that asked for
--         the mutex while the caller held it; once it is released or handed on, each is
--         treated as an acquire in 'wait' mode would (granted if free and nobody queued,
--         else queued at the tail), in that order.
-- Returns {1} released (nobody waiting), {1, next_token, next_fence, next_ttl} released and
-- handed on, {0} the caller did not hold it (any queue entry of it is gone now),
-- {0, next_token, next_fence, next_ttl} same, and a free mutex was handed to the queue head,
-- {2, fence} kept ('keep' only): still held, renewed, and `fence` starts its new block,
-- {-1, pttl} ('carry' only) the caller did not hold it, and the carried members were queued
-- behind the holder, whose lease has pttl ms left (their safety-net timer: nobody else tells
-- them when that lease ends).
-- A carried member granted adds its {token, fence, ttl} to the reply (never announced: it
-- waits in the caller's client).
local owner, queue, waiters, fence_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local member, channel, mode = ARGV[1], ARGV[2], ARGV[3]
local token, ttl, tag = split_member(member)

local current, queued, _, last = read_keys({'string', 'list', 'zset', 'counter'})
local stored = tonumber(last) or 0  -- the fence counter (grant_fence need not read it again)
if dequeue(queue, waiters, member) then
  queued = redis.call('LLEN', queue)  -- withdrawn from the queue (a cancelled waiter)
end
local status = 0
local reply
if current == token then
  status = 1
elseif current then
  reply = {0}
end

if not reply then
  if queued > 0 and #purge_dead(queue, waiters, now_ms()) > 0 then
    queued = redis.call('LLEN', queue)
  end
  if queued == 0 then
    if status == 1 then
      if mode == 'keep' then
        redis.call('PEXPIRE', owner, ttl)
        return {2, grant_fence(fence_key, token, ttl, stored)}
      end
      redis.call('DEL', owner)
    end
    reply, current = {status}, nil
  else
    local next_token, next_ttl, next_tag = pop_head(queue, waiters)
    redis.call('SET', owner, next_token, 'PX', next_ttl)
    local fence = grant_fence(fence_key, next_token, next_ttl, stored)
    announce(channel, next_token, fence, next_ttl, next_tag, tag)
    reply, current = {status, next_token, fence, next_ttl}, next_token
  end
end

if mode == 'carry' then
  local now = now_ms()
  if #reply == 1 and current then
    reply = {-1, redis.call('PTTL', owner)}  -- queued behind another holder: its lease end
  end
  for i = 4, #ARGV do
    local carried = ARGV[i]
    local carried_token, carried_ttl = split_member(carried)
    if not current then
      -- Free, and nobody queued (the queue was empty, or its head was just handed it).
      redis.call('SET', owner, carried_token, 'PX', carried_ttl)
      local fence = grant_fence(fence_key, carried_token, carried_ttl, stored)
      note_grant(reply, carried_token, fence, carried_ttl)
      current = carried_token
    elseif current ~= carried_token then
      enqueue(queue, waiters, carried, now, carried_ttl)
    end
  end
end
return reply
