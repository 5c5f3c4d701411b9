-- Take the read or the write side (the member's kind); optionally join the FIFO queue.
-- KEYS[1] writer STRING   KEYS[2] readers ZSET token -> lease deadline   KEYS[3] queue
-- KEYS[4] waiters   KEYS[5] fence   KEYS[6] fences HASH reader -> fence
-- ARGV[1] member "<token>:<ttl_ms>:<tag>:r|w"   ARGV[2] 'wait' | 'try'   ARGV[3] channel
-- Returns {1, fence, grants...} held (also when it already was), {0, wait_ms, floor,
-- grants...} queued, {-1, wait_ms, floor, grants...} busy and not queued; floor: the fence
-- floor (fence_floor, _prelude.lua).
check_keys({'string', 'zset', 'list', 'zset', 'counter', 'hash'})
local k = rw_keys()
local member, mode, channel = ARGV[1], ARGV[2], ARGV[3]
local token, ttl, tag, kind = split_member(member)
local now = now_ms()

local fence = rw_held(k, token, kind, now)
if fence then  -- already granted (e.g. by a hand-off whose message was not read): re-arm
  if kind == 'w' then
    renew_owner_lease({k.writer, k.fence}, token, ttl)
  else
    renew_member_lease({k.readers, k.fences, k.fence}, token, ttl, now)
  end
  return {1, fence}
end

purge_expired(k.readers, k.fences, now)
purge_dead(k.queue, k.waiters, now)
local grants = {}
rw_fill(k, channel, tag, now, grants)
fence = rw_held(k, token, kind, now)
if fence then  -- it was queued and its turn came
  return {1, fence, unpack(grants)}
end
if redis.call('LLEN', k.queue) == 0 and redis.call('EXISTS', k.writer) == 0 then
  if kind == 'r' then
    return {1, hold_in_set(k.readers, k.fences, k.fence, token, ttl, now), unpack(grants)}
  elseif redis.call('ZCARD', k.readers) == 0 then
    return {1, grant_writer(k, token, ttl), unpack(grants)}
  end
end
if mode == 'wait' then
  enqueue(k.queue, k.waiters, member, now, ttl)
  return {0, rw_wait_ms(k, now), fence_floor(k.fence), unpack(grants)}
end
return {-1, rw_wait_ms(k, now), fence_floor(k.fence), unpack(grants)}
