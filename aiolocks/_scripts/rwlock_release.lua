-- Release the caller's side, or withdraw it from the queue; let in what can enter next.
-- Also the cancellation clean-up: whatever state the token reached, it leaves none.
-- KEYS as rwlock_acquire.   ARGV[1] member   ARGV[2] channel
-- Returns {held, grants...}: held 1 if the caller held a live lease of its side.
check_keys({'string', 'zset', 'list', 'zset', 'counter', 'hash'})
local k = rw_keys()
local member, channel = ARGV[1], ARGV[2]
local token, _, tag, kind = split_member(member)
local now = now_ms()

dequeue(k.queue, k.waiters, member)
local held = 0
if kind == 'w' then
  if redis.call('GET', k.writer) == token then
    redis.call('DEL', k.writer)
    held = 1
  end
else
  held = release_from_set(k.readers, k.fences, token, now)
end
purge_expired(k.readers, k.fences, now)
purge_dead(k.queue, k.waiters, now)
local grants = {}
rw_fill(k, channel, tag, now, grants)
return {held, unpack(grants)}
