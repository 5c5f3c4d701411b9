-- End leases now, as if they had run out (aiolocks.testing).
-- KEYS   the lease keys of one primitive: a STRING holding the owner token (mutex, RW
--        writer), a ZSET of holder tokens (semaphore, RW readers) or a HASH whose field
--        'token' is the holder's (an election's leader)
-- ARGV[1] the token whose lease ends, or '' for every holder's
-- Returns the number of leases ended.
local ended = 0
for _, key in ipairs(KEYS) do
  local key_type = redis.call('TYPE', key)['ok']
  if key_type == 'string' then
    if ARGV[1] == '' or redis.call('GET', key) == ARGV[1] then
      ended = ended + redis.call('DEL', key)
    end
  elseif key_type == 'hash' then
    if ARGV[1] == '' or redis.call('HGET', key, 'token') == ARGV[1] then
      ended = ended + redis.call('DEL', key)
    end
  elseif key_type == 'zset' then
    if ARGV[1] == '' then
      ended = ended + redis.call('ZCARD', key)
      redis.call('DEL', key)
    else
      ended = ended + redis.call('ZREM', key, ARGV[1])
    end
  end
end
return ended
