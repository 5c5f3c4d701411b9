-- Shared by the election scripts (prepended after the prelude).
-- KEYS[1] leader      HASH  token, value, fence, rev (proclamations this term); PX = lease
-- KEYS[2] queue       LIST  candidates' members, FIFO
-- KEYS[3] waiters     ZSET  member -> liveness deadline (server ms)
-- KEYS[4] fence       STRING the term counter, a hybrid logical clock (grant_fence)
-- KEYS[5] candidates  HASH  queued candidate's token -> the value it campaigns with
-- Expiry as for the mutex (docs/architecture.md, "Fences and expiry"): the leader hash has
-- the lease as its PX and the fence counter is kept ttl + IDLE_MS by every grant and
-- renewal; the candidates hash lives with the queue keys (enqueue, heartbeats).
-- Every change is announced on the channel, to the candidates (a grant) and to observers:
--   "<token> <fence> <ttl_ms> L <rev> <value>"  a leader: elected (rev 0) or proclaimed
--   "- <fence> 0 V"                              vacant: the term <fence> resigned
-- The first three fields are a grant message (see _notifier.py), so a candidate elected by
-- another process's script wakes on it; observers read the rest.

local function publish(channel, message)
  redis.call(SHARDED_PUBSUB and 'SPUBLISH' or 'PUBLISH', channel, message)
end

-- `fence` is a string of digits or a number (written with int_str: it has 16 digits).
local function announce_leader(channel, token, fence, ttl, rev, value)
  local digits = type(fence) == 'number' and int_str(fence) or fence
  publish(channel, token .. ' ' .. digits .. ' ' .. ttl .. ' L ' .. rev .. ' ' .. value)
end

-- Make `token` the leader for `ttl` ms with `value`; returns its term's fence. The hash's
-- four fields are all written (it holds no others), so no DEL first. `stored`: the fence
-- counter as the caller read it (nil: read here); a term is alone on its counter.
local function elect(leader, fence_key, channel, token, ttl, value, stored)
  local fence = grant_fence(fence_key, token, ttl, stored, true)
  redis.call('HSET', leader, 'token', token, 'value', value, 'fence', int_str(fence), 'rev', 0)
  redis.call('PEXPIRE', leader, ttl)
  announce_leader(channel, token, fence, ttl, 0, value)
  return fence
end

-- Elect the first live candidate `first` (popped by pop_live): its grant triple.
local function elect_member(leader, fence_key, candidates, channel, first, stored)
  local token, ttl = split_member(first)
  local value = redis.call('HGET', candidates, token) or ''
  redis.call('HDEL', candidates, token)
  return token, elect(leader, fence_key, channel, token, ttl, value, stored), ttl
end
