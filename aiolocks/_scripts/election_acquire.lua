-- Campaign: become the leader if nobody leads and no candidate is ahead; else queue.
-- KEYS as in _election.lua.
-- ARGV[1] member "<token>:<ttl_ms>:<tag>:x"   ARGV[2] 'wait' to queue when busy, 'try' not to
-- ARGV[3] channel   ARGV[4] the value to lead with
-- Returns {1, fence} when the caller leads (also when it already did: idempotent),
--         {0, pttl, floor} when queued behind a leader with pttl ms of lease left,
--         {-1, pttl, floor} when busy and the caller did not queue; floor: the fence floor
--         (fence_floor, _prelude.lua).
-- Free path (vacant, nobody queued): HGET, LINDEX, GET fence, TIME, HSET, PEXPIRE, SET,
-- the announcement. Each read checks its key's type; the waiters zset and the candidates
-- hash are checked before the paths that write them.
local leader, queue, waiters, fence_key, candidates = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local member, mode, channel, value = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local token, ttl = split_member(member)

local current = checked(redis.pcall('HGET', leader, 'token'), leader, 'hash')
local stored = tonumber(read_key(4, 'counter')) or 0
if current == token then
  extend_lease({leader, fence_key}, ttl)
  return {1, tonumber(redis.call('HGET', leader, 'fence'))}
end
local head = read_key(2, 'first')
if not current and not head then
  return {1, elect(leader, fence_key, channel, token, ttl, value, stored)}
end
if head or mode == 'wait' then
  read_key(3, 'zset')
  read_key(5, 'hash')
end

local now = now_ms()
if not current then
  -- Vacant while candidates are queued (the leader's lease ran out, or the caller is the
  -- head): the first live one is elected, dead ones ahead of it dropped with their values.
  local first = pop_live(queue, waiters, head, now, candidates)
  if not first or first == member then
    if first then
      redis.call('HDEL', candidates, token)
    end
    return {1, elect(leader, fence_key, channel, token, ttl, value, stored)}
  end
  elect_member(leader, fence_key, candidates, channel, first, stored)
  stored = nil
end

if mode == 'wait' then
  redis.call('HSET', candidates, token, value)
  enqueue(queue, waiters, member, now, ttl, {candidates})
  return {0, redis.call('PTTL', leader), fence_floor(fence_key, stored)}
end
return {-1, redis.call('PTTL', leader), fence_floor(fence_key, stored)}
