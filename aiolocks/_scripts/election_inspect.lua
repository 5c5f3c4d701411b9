-- Read-only view of an election.   KEYS as in _election.lua.
-- Returns {token or false, value or false, term fence, lease left ms, rev, last fence,
--          queue length, server clock us}. The last fence is 0 once the counter expired
-- (the name idle); every fence handed out later is above the server clock (grant_fence).
local leader = redis.call('HMGET', KEYS[1], 'token', 'value', 'fence', 'rev')
local pttl = redis.call('PTTL', KEYS[1])
return {
  leader[1],
  leader[2],
  tonumber(leader[3] or 0),
  pttl,
  tonumber(leader[4] or 0),
  tonumber(redis.call('GET', KEYS[4]) or 0),
  redis.call('LLEN', KEYS[2]),
  now_us(),
}
