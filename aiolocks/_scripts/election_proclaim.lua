-- Publish a new value for the current term, keeping the leadership.
-- KEYS[1] leader   ARGV[1] token   ARGV[2] channel   ARGV[3] value
-- Returns {1, rev} proclaimed (rev counts this term's proclamations), {0} not the leader.
check_keys({'hash'})
local leader, token, channel, value = KEYS[1], ARGV[1], ARGV[2], ARGV[3]
if redis.call('HGET', leader, 'token') ~= token then
  return {0}
end
redis.call('HSET', leader, 'value', value)
-- HGET + HSET rather than HINCRBY: the README's least-privilege ACL lists no HINCRBY.
local rev = tonumber(redis.call('HGET', leader, 'rev') or 0) + 1
redis.call('HSET', leader, 'rev', rev)
local fence = redis.call('HGET', leader, 'fence')
announce_leader(channel, token, fence, math.max(0, redis.call('PTTL', leader)), rev, value)
return {1, rev}
