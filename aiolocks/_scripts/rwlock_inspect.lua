-- Read-only view of a read-write lock.   KEYS as rwlock_acquire.
-- Returns {writer token or false, live readers, queue length, last fence}.
local now = now_ms()
return {
  redis.call('GET', KEYS[1]),
  redis.call('ZCOUNT', KEYS[2], now, '+inf'),
  redis.call('LLEN', KEYS[3]),
  tonumber(redis.call('GET', KEYS[5]) or 0),
}
