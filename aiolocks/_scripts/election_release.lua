-- Resign, or withdraw a candidacy; elect the next candidate at once. Also the clean-up of a
-- cancelled campaign: whatever state the token reached, it leaves none.
-- KEYS as in _election.lua.   ARGV[1] member   ARGV[2] channel
-- Returns {1} resigned (nobody waiting: vacant), {1, token, fence, ttl} resigned and the
-- next candidate elected, {0} the caller did not lead (its candidacy is gone now),
-- {0, token, fence, ttl} same, and a vacant election went to the first candidate.
-- Free path (leading, nobody queued): HGET token, LINDEX, HGET fence, DEL, the
-- announcement. Each key's type is checked before anything is written on it; a leader is
-- never queued (its election popped it), so only a caller that does not lead withdraws.
local leader, queue, waiters, fence_key, candidates = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local member, channel = ARGV[1], ARGV[2]
local token = split_member(member)

local current = checked(redis.pcall('HGET', leader, 'token'), leader, 'hash')
local head = read_key(2, 'first')
local stored = nil
if head then  -- a candidate may be elected below: every key it touches checked first
  read_key(3, 'zset')
  stored = tonumber(read_key(4, 'counter')) or 0
  read_key(5, 'hash')
end
local status = 1
if current ~= token then
  status = 0
  if head and redis.call('ZREM', waiters, member) == 1 then
    redis.call('LREM', queue, 1, member)  -- a candidacy withdrawn
    redis.call('HDEL', candidates, token)
    head = redis.call('LINDEX', queue, 0)
  end
  if current then
    return {0}
  end
end

local first = nil
if head then
  first = pop_live(queue, waiters, head, now_ms(), candidates)
end
if not first then
  if status == 1 then
    local fence = redis.call('HGET', leader, 'fence')
    redis.call('DEL', leader)
    publish(channel, '- ' .. fence .. ' 0 V')
  end
  return {status}
end
local next_token, fence, next_ttl = elect_member(leader, fence_key, candidates, channel, first,
  stored)
return {status, next_token, fence, tonumber(next_ttl)}
