-- Shared by the semaphore scripts. Keys: holders ZSET (token -> lease deadline), queue,
-- waiters, fence, fences HASH (token -> its fence), limit STRING (the stored limit).

-- Hand free permits to queued waiters in order; grants go to `grants`.
local function sem_fill(k, limit, channel, caller_tag, now, grants)
  while redis.call('ZCARD', k.holders) < limit do
    local token, ttl, tag = pop_head(k.queue, k.waiters)
    if not token then
      return
    end
    local fence = hold_in_set(k.holders, k.fences, k.fence, token, ttl, now, {k.limit})
    announce(channel, token, fence, ttl, tag, caller_tag)
    note_grant(grants, token, fence, ttl)
  end
end

local function sem_keys()
  return {holders = KEYS[1], queue = KEYS[2], waiters = KEYS[3], fence = KEYS[4],
          fences = KEYS[5], limit = KEYS[6]}
end
