-- Shared by the semaphore scripts. Keys: holders ZSET (token -> lease deadline), queue,
-- waiters, fence, fences HASH (token -> its fence), limit STRING (the stored limit).
-- Expired holders are purged only when the permits look taken (ZCARD counts them too, so a
-- count under the limit is a free permit either way), dead waiters only when they reach
-- the queue's head (pop_live): the free paths read and write nothing else.

-- Live holders: ZCARD, and when that reaches `limit`, the expired ones purged first.
local function sem_held(k, limit, now)
  local held = redis.call('ZCARD', k.holders)
  if held >= limit then
    purge_expired(k.holders, k.fences, now)
    held = redis.call('ZCARD', k.holders)
  end
  return held
end

-- Hand free permits to queued waiters in order (dead ones dropped); grants go to `grants`.
-- `held`: the live holders now. Returns the live holders after.
local function sem_fill(k, limit, channel, caller_tag, now, grants, held)
  while true do
    if held >= limit then
      held = sem_held(k, limit, now)  -- expired holders purged, if that frees any
      if held >= limit then
        return held
      end
    end
    local first = pop_live(k.queue, k.waiters, redis.call('LINDEX', k.queue, 0), now)
    if not first then
      return held
    end
    local token, ttl, tag = split_member(first)
    local fence = hold_in_set(k.holders, k.fences, k.fence, token, ttl, now, {k.limit})
    announce(channel, token, fence, ttl, tag, caller_tag)
    note_grant(grants, token, fence, ttl)
    held = held + 1
  end
  return held
end

local function sem_keys()
  return {holders = KEYS[1], queue = KEYS[2], waiters = KEYS[3], fence = KEYS[4],
          fences = KEYS[5], limit = KEYS[6]}
end
