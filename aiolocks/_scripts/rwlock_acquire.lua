-- Take the read or the write side (the member's last field); optionally join the FIFO queue.
-- KEYS[1] writer STRING   KEYS[2] readers ZSET token -> lease deadline   KEYS[3] queue
-- KEYS[4] waiters   KEYS[5] fence   KEYS[6] fences HASH reader -> fence
-- ARGV[1] member "<token>:<ttl_ms>:<tag>:r|w"   ARGV[2] 'wait' | 'try'   ARGV[3] channel
-- Returns {1, fence, grants...} held (also when it already was), {0, wait_ms, floor,
-- grants...} queued, {-1, wait_ms, floor, grants...} busy and not queued; floor: the fence
-- floor (fence_floor, _prelude.lua).
-- Free path: GET writer, LINDEX queue, GET fence, TIME, then a reader: ZSCORE, HLEN (the
-- fences hash's type), the grant; a writer: ZCARD readers, the grant. Each read checks its
-- key's type; the waiters zset is checked before the paths that write it.
local k = rw_keys()
local member, mode, channel = ARGV[1], ARGV[2], ARGV[3]
local token, ttl, tag, side = split_member(member)
local now = now_ms()

local writer = read_key(1, 'string')
local head = read_key(3, 'first')
local counter = tonumber(read_key(5, 'counter')) or 0
if side == 'w' and writer == token then  -- already granted (a hand-off not read): re-arm
  extend_lease({k.writer, k.fence}, ttl)
  return {1, counter}
end
local deadline = nil
if side == 'r' then
  deadline = checked(redis.pcall('ZSCORE', k.readers, token), k.readers, 'zset')
else
  read_key(2, 'zset')
end
read_key(6, 'hash')
if deadline and tonumber(deadline) >= now then  -- already granted: re-arm
  local fence = redis.call('HGET', k.fences, token)
  renew_member_lease({k.readers, k.fences, k.fence}, token, ttl, now)
  return {1, tonumber(fence)}
end
if head or mode == 'wait' then
  read_key(4, 'zset')  -- written below: its type first
end

local grants = {}
if head then
  rw_readers(k, now)
  rw_fill(k, channel, tag, now, grants)
  local fence = rw_held(k, token, side, now)
  if fence then  -- it was queued and its turn came
    return {1, fence, unpack(grants)}
  end
  head = redis.call('LINDEX', k.queue, 0)
  writer = redis.call('GET', k.writer)
  counter = nil  -- the grants moved it: read again
end
if not head and not writer then
  if side == 'r' then
    return {1, hold_in_set(k.readers, k.fences, k.fence, token, ttl, now, nil, counter),
            unpack(grants)}
  elseif rw_readers(k, now) == 0 then
    return {1, grant_writer(k, token, ttl, counter), unpack(grants)}
  end
end
if mode == 'wait' then
  enqueue(k.queue, k.waiters, member, now, ttl)
  return {0, rw_wait_ms(k, now), fence_floor(k.fence), unpack(grants)}
end
return {-1, rw_wait_ms(k, now), fence_floor(k.fence), unpack(grants)}
