-- Shared helpers, prepended to every aiolocks script at load time.
--
-- The wait queue of a primitive is two keys kept in step:
--   queue   LIST  of members in FIFO order
--   waiters ZSET  member -> liveness deadline (server ms); a member whose
--                 deadline has passed belongs to a dead process and is purged.
-- A member is "<token>:<ttl_ms>:<tag>:<kind>": whoever pops it knows the lease to grant;
-- the tag names the client it waits in, so a client handing on to its own waiter (which
-- it wakes from the script's reply) need not publish; kind is 'x' (exclusive), or 'r' /
-- 'w' for the two sides of a read-write lock.
-- A grant is announced on the primitive's channel as "<token> <fence> <ttl_ms>".

-- Refuse, before any write, keys that hold something else than the script expects (another
-- program's data under aiolocks' names): such a call fails and changes nothing. `types`
-- gives, per KEYS index, 'string', 'list', 'zset', 'hash', or 'counter' (an integer string).
local function check_keys(types)
  for i, want in ipairs(types) do
    local got = redis.call('TYPE', KEYS[i])['ok']
    if got ~= 'none' then
      local base = want
      if want == 'counter' then
        base = 'string'
      end
      if got ~= base then
        error({err = 'WRONGTYPE aiolocks: ' .. KEYS[i] .. ' holds a ' .. got .. ', not a ' .. base})
      end
      if want == 'counter' and not tonumber(redis.call('GET', KEYS[i])) then
        error({err = 'WRONGTYPE aiolocks: ' .. KEYS[i] .. ' holds a string that is not a number'})
      end
    end
  end
end

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function split_member(member)
  local token, ttl, tag, kind = string.match(member, '^([^:]+):([^:]+):([^:]*):(.*)$')
  return token, ttl, tag, kind
end

-- Drop queue entries whose heartbeat deadline has passed; returns the members dropped.
local function purge_dead(queue, waiters, now)
  local dead = redis.call('ZRANGEBYSCORE', waiters, '-inf', '(' .. now)
  if #dead > 0 then
    for _, member in ipairs(dead) do
      redis.call('LREM', queue, 1, member)
    end
    redis.call('ZREMRANGEBYSCORE', waiters, '-inf', '(' .. now)
  end
  return dead
end

-- Remove one member from the queue; returns true when it was queued.
local function dequeue(queue, waiters, member)
  if redis.call('ZREM', waiters, member) == 1 then
    redis.call('LREM', queue, 1, member)
    return true
  end
  return false
end

-- Put a member at the tail (once) and refresh its liveness deadline.
local function enqueue(queue, waiters, member, deadline)
  if redis.call('ZADD', waiters, deadline, member) == 1 then
    redis.call('RPUSH', queue, member)
  end
end

-- Pop the first queued (live) member; returns token, ttl_ms, tag, kind or nil.
local function pop_head(queue, waiters)
  local member = redis.call('LPOP', queue)
  if not member then
    return nil
  end
  redis.call('ZREM', waiters, member)
  return split_member(member)
end

-- Grants go out on sharded pub/sub (SPUBLISH: on Cluster, to the channel's shard only)
-- where the server has it, Redis 7.0 (version number 0x070000 = 458752) and every Valkey;
-- PUBLISH otherwise. pubsub_mode.lua answers the same question for subscribers.
local SHARDED_PUBSUB = (redis.REDIS_VERSION_NUM or 0) >= 458752

-- Tell the new owner; skipped when it waits in the caller's own client (same tag).
local function announce(channel, token, fence, ttl, tag, caller_tag)
  if tag ~= caller_tag then
    redis.call(SHARDED_PUBSUB and 'SPUBLISH' or 'PUBLISH', channel, token .. ' ' .. fence .. ' ' .. ttl)
  end
end

-- Record a grant for the reply: {..., token, fence, ttl} (the caller wakes local waiters).
local function note_grant(grants, token, fence, ttl)
  grants[#grants + 1] = token
  grants[#grants + 1] = fence
  grants[#grants + 1] = tonumber(ttl)
end

-- Fence blocks: a token ending in "+<k>" is a local hand-off cohort's (see _cohort.py); its
-- grant reserves k consecutive fences at once and holds the first, and the process hands the
-- others to its own tasks without a round trip. Any other token reserves one.
local function fence_block(token)
  return tonumber(string.match(token, '%+(%d+)$')) or 1
end

-- Count a grant of `token`: returns the first fence of its block.
local function grant_fence(fence_key, token)
  local block = fence_block(token)
  return redis.call('INCRBY', fence_key, block) - block + 1
end

-- A holder in a sorted set of leases (token -> deadline, server ms) with its fence in a hash.
local function hold_in_set(holders, fences, fence_key, token, ttl, now)
  redis.call('ZADD', holders, now + tonumber(ttl), token)
  local fence = grant_fence(fence_key, token)
  redis.call('HSET', fences, token, fence)
  return fence
end

-- Remove a holder from a sorted set of leases; 1 if its lease was still live, else 0.
local function release_from_set(holders, fences, token, now)
  local deadline = redis.call('ZSCORE', holders, token)
  if not deadline then
    return 0
  end
  redis.call('ZREM', holders, token)
  redis.call('HDEL', fences, token)
  if tonumber(deadline) >= now then
    return 1
  end
  return 0
end

-- Drop holders of a sorted set whose lease has ended.
local function purge_expired(holders, fences, now)
  local gone = redis.call('ZRANGEBYSCORE', holders, '-inf', '(' .. now)
  if #gone > 0 then
    redis.call('ZREMRANGEBYSCORE', holders, '-inf', '(' .. now)
    redis.call('HDEL', fences, unpack(gone))
  end
end

-- Milliseconds until the first lease of a sorted set ends (a waiter's safety-net timer).
local function first_expiry(holders, now)
  local first = redis.call('ZRANGE', holders, 0, 0, 'WITHSCORES')
  if #first == 0 then
    return -1
  end
  return math.max(0, tonumber(first[2]) - now)
end
