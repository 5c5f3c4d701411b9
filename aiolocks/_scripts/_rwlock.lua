-- Shared by the read-write lock scripts. Keys: writer STRING (token, lease as PX),
-- readers ZSET (token -> lease deadline), queue, waiters, fence, fences HASH (reader -> fence).
-- Queue members take side 'r' or 'w'. The writer's fence is the counter itself: no
-- reader is granted (no fence taken) while a writer holds.

local function rw_keys()
  return {writer = KEYS[1], readers = KEYS[2], queue = KEYS[3], waiters = KEYS[4],
          fence = KEYS[5], fences = KEYS[6]}
end

local function grant_writer(k, token, ttl, stored)
  redis.call('SET', k.writer, token, 'PX', ttl)
  return grant_fence(k.fence, token, ttl, stored)
end

-- Live readers: ZCARD, with the expired ones purged first when there are any.
local function rw_readers(k, now)
  if redis.call('ZCARD', k.readers) == 0 then
    return 0
  end
  purge_expired(k.readers, k.fences, now)
  return redis.call('ZCARD', k.readers)
end

-- Let in, in queue order (pop_live), what can enter: a writer alone when nobody holds, or
-- every reader up to the next queued writer while no writer holds; dead members at the
-- head are dropped on the way. Expired readers must have been purged. Grants go to `grants`.
local function rw_fill(k, channel, caller_tag, now, grants)
  local function admits(member)  -- a writer waits for the readers to leave
    local _, _, _, side = split_member(member)
    return not (side == 'w' and redis.call('ZCARD', k.readers) > 0)
  end
  while redis.call('EXISTS', k.writer) == 0 do
    local first = pop_live(k.queue, k.waiters, redis.call('LINDEX', k.queue, 0), now, nil, admits)
    if not first then
      return
    end
    local token, ttl, tag, side = split_member(first)
    local fence
    if side == 'w' then
      fence = grant_writer(k, token, ttl)
    else
      fence = hold_in_set(k.readers, k.fences, k.fence, token, ttl, now)
    end
    announce(channel, token, fence, ttl, tag, caller_tag)
    note_grant(grants, token, fence, ttl)
  end
end

-- The caller's fence if it holds its side now, else nil.
local function rw_held(k, token, side, now)
  if side == 'w' then
    if redis.call('GET', k.writer) == token then
      return tonumber(redis.call('GET', k.fence))
    end
    return nil
  end
  local deadline = redis.call('ZSCORE', k.readers, token)
  if deadline and tonumber(deadline) >= now then
    return tonumber(redis.call('HGET', k.fences, token))
  end
  return nil
end

-- Milliseconds until the first lease in the way ends (-1: unknown).
local function rw_wait_ms(k, now)
  local pttl = redis.call('PTTL', k.writer)
  if pttl >= 0 then
    return pttl
  end
  return first_expiry(k.readers, now)
end
