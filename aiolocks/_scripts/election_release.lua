-- Resign, or withdraw a candidacy; elect the next candidate at once. Also the clean-up of a
-- cancelled campaign: whatever state the token reached, it leaves none.
-- KEYS as in _election.lua.   ARGV[1] member   ARGV[2] channel
-- Returns {1} resigned (nobody waiting: vacant), {1, token, fence, ttl} resigned and the
-- next candidate elected, {0} the caller did not lead (its candidacy is gone now),
-- {0, token, fence, ttl} same, and a vacant election went to the first candidate.
check_keys({'hash', 'list', 'zset', 'counter', 'hash'})
local leader, queue, waiters, fence_key, candidates = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local member, channel = ARGV[1], ARGV[2]
local token = split_member(member)

dequeue(queue, waiters, member)
redis.call('HDEL', candidates, token)
local current = redis.call('HGET', leader, 'token')
local status = 0
if current == token then
  status = 1
elseif current then
  return {0}
end

if redis.call('LLEN', queue) > 0 then
  purge_candidates(queue, waiters, candidates, now_ms())
end
if redis.call('LLEN', queue) == 0 then
  if status == 1 then
    local fence = redis.call('HGET', leader, 'fence')
    redis.call('DEL', leader)
    publish(channel, '- ' .. fence .. ' 0 V')
  end
  return {status}
end
local next_token, fence, next_ttl = elect_head(leader, queue, waiters, fence_key, candidates, channel)
return {status, next_token, fence, tonumber(next_ttl)}
