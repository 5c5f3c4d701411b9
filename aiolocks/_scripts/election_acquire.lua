-- Campaign: become the leader if nobody leads and no candidate is ahead; else queue.
-- KEYS as in _election.lua.
-- ARGV[1] member "<token>:<ttl_ms>:<tag>:x"   ARGV[2] 'wait' to queue when busy, 'try' not to
-- ARGV[3] channel   ARGV[4] the value to lead with
-- Returns {1, fence} when the caller leads (also when it already did: idempotent),
--         {0, pttl, floor} when queued behind a leader with pttl ms of lease left,
--         {-1, pttl, floor} when busy and the caller did not queue; floor: the fence floor
--         (fence_floor, _prelude.lua).
check_keys({'hash', 'list', 'zset', 'counter', 'hash'})
local leader, queue, waiters, fence_key, candidates = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local member, mode, channel, value = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local token, ttl = split_member(member)

local current = redis.call('HGET', leader, 'token')
if current == token then
  renew_leader_lease({leader, fence_key}, token, ttl)
  return {1, tonumber(redis.call('HGET', leader, 'fence'))}
end
if not current and redis.call('LLEN', queue) == 0 then
  return {1, elect(leader, fence_key, channel, token, ttl, value)}
end

local now = now_ms()
purge_candidates(queue, waiters, candidates, now)
if not current then
  local head = redis.call('LINDEX', queue, 0)
  if not head or head == member then
    if head then
      dequeue(queue, waiters, member)
      redis.call('HDEL', candidates, token)
    end
    return {1, elect(leader, fence_key, channel, token, ttl, value)}
  end
  -- Vacant while others wait ahead (the leader's lease ran out): elect the head.
  elect_head(leader, queue, waiters, fence_key, candidates, channel)
end

if mode == 'wait' then
  redis.call('HSET', candidates, token, value)
  enqueue(queue, waiters, member, now, ttl, {candidates})
  return {0, redis.call('PTTL', leader), fence_floor(fence_key)}
end
return {-1, redis.call('PTTL', leader), fence_floor(fence_key)}
