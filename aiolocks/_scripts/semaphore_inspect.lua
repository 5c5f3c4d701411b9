-- Read-only view of a semaphore.   KEYS as semaphore_acquire.
-- Returns {stored limit or -1, live holders, queue length, last fence}.
local now = now_ms()
return {
  tonumber(redis.call('GET', KEYS[6]) or -1),
  redis.call('ZCOUNT', KEYS[1], now, '+inf'),
  redis.call('LLEN', KEYS[2]),
  tonumber(redis.call('GET', KEYS[4]) or 0),
}
