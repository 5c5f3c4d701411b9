-- Release the caller's side, or withdraw it from the queue; let in what can enter next.
-- Also the cancellation clean-up: whatever state the token reached, it leaves none.
-- KEYS as rwlock_acquire.   ARGV[1] member   ARGV[2] channel
-- Returns {held, grants...}: held 1 if the caller held a live lease of its side.
-- Free path (held, nobody queued): TIME, GET writer, LINDEX queue, then a writer: DEL; a
-- reader: ZSCORE, HDEL, ZREM. Each key's type is checked before anything is written on it.
local k = rw_keys()
local member, channel = ARGV[1], ARGV[2]
local token, _, tag, side = split_member(member)
local now = now_ms()

local writer = read_key(1, 'string')
local head = read_key(3, 'first')
if head then  -- others may be let in below: every key they touch checked first
  read_key(2, 'zset')
  read_key(4, 'zset')
  read_key(5, 'counter')
  read_key(6, 'hash')
end
local held = 0
if side == 'w' then
  if writer == token then
    redis.call('DEL', k.writer)
    held = 1
  end
else
  held = release_from_set(k.readers, k.fences, token, now)
end
local grants = {}
if head then
  if held == 0 and redis.call('ZREM', k.waiters, member) == 1 then
    redis.call('LREM', k.queue, 1, member)  -- withdrawn from the queue (a cancelled waiter)
  end
  rw_readers(k, now)
  rw_fill(k, channel, tag, now, grants)
end
return {held, unpack(grants)}
