-- Shared helpers, prepended to every aiolocks script at load time.
--
-- The wait queue of a primitive is two keys kept in step:
--   queue   LIST  of members in FIFO order
--   waiters ZSET  member -> liveness deadline (server ms); a member whose
--                 deadline has passed belongs to a dead process and is purged.
-- A member is "<token>:<ttl_ms>:<tag>:<side>": whoever pops it knows the lease to grant;
-- the tag names the client it waits in, so a client handing on to its own waiter (which
-- it wakes from the script's reply) need not publish; side is 'x' (exclusive), or 'r' /
-- 'w' for the two sides of a read-write lock.
-- A grant is announced on the primitive's channel as "<token> <fence> <ttl_ms>".
--
-- Invariants every script keeps (the simulation's oracle checks them against the server):
--   1. The owner (or a holder slot) is set only when the lock is free and no live waiter is
--      ahead of the caller in the queue: a newcomer never overtakes a live waiter.
--   2. Every grant goes through the fence (grant_fence / hold_in_set): no holder without
--      a fence taken after every earlier grant's.
--   3. A holder is never queued: a member is popped from the queue before it is granted,
--      and an acquire by a holder renews, it does not enqueue.
--   4. The waiters zset is a subset of the queue list: a member enters the list with its
--      zset entry (enqueue) and leaves the zset no later than the list (pop_live).
-- The prelude is cut into its top-level items (see aiolocks/_scripts/__init__.py): an item
-- starts at an unindented comment or `local` after a blank line; only the items a script
-- uses are prepended to it, and where a script marks the end of its hot path
-- (REST_OF_PRELUDE), those that only the code past the mark uses are put at the mark: a
-- call that returns before it never defines them (each costs about 1,000 instructions).

-- Fail the script with `message` as its error reply. From Redis 7.0 (version number
-- 0x070000 = 458752; every Valkey) a raised {err = ...} table is the reply as it stands
-- (WRONGTYPE code included); before, the server cannot format a raised table (the reply
-- would lose the text), so a string is raised, which it prefixes with the script's name.
local TABLE_ERRORS = (redis.REDIS_VERSION_NUM or 0) >= 458752
local function fail(message)
  if TABLE_ERRORS then
    error({err = message})
  end
  error(message)
end

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
        fail('WRONGTYPE aiolocks: ' .. KEYS[i] .. ' holds a ' .. got .. ', not a ' .. base)
      end
      if want == 'counter' and not tonumber(redis.call('GET', KEYS[i])) then
        fail('WRONGTYPE aiolocks: ' .. KEYS[i] .. ' holds a string that is not a number')
      end
    end
  end
end

-- Fail on `reply`, an error reply of a call on `key`: a WRONGTYPE one names the key and
-- what it holds (as check_keys does), any other is passed on.
local function fail_on(reply, key, want)
  if string.sub(reply['err'], 1, 9) == 'WRONGTYPE' then
    local base = ({counter = 'string', first = 'list'})[want] or want
    fail('WRONGTYPE aiolocks: ' .. key .. ' holds a ' .. redis.call('TYPE', key)['ok']
      .. ', not a ' .. base)
  end
  fail(reply['err'])
end

-- A read that opens a script and doubles as its type check: KEYS[i] read as the type `want`
-- should be (as for check_keys: GET for a string or counter, LLEN for a list, ZCARD for a
-- zset, HLEN for a hash; 'first' reads a list's head, LINDEX 0), a read that fails on a key
-- of another type. Returns the reply (a counter's as its number, read once: `tonumber`
-- parses its string twice, about 1,000 instructions each time); a key of another type
-- fails the call before anything is written, naming the key as check_keys does. One call
-- per key, where check_keys and the script's own first read would take two.
local function read_key(i, want)
  local key = KEYS[i]
  local reply
  if want == 'first' then
    reply = redis.pcall('LINDEX', key, 0)
  elseif want == 'list' then
    reply = redis.pcall('LLEN', key)
  elseif want == 'zset' then
    reply = redis.pcall('ZCARD', key)
  elseif want == 'hash' then
    reply = redis.pcall('HLEN', key)
  else
    reply = redis.pcall('GET', key)
  end
  if type(reply) == 'table' and reply['err'] then
    fail_on(reply, key, want)
  end
  if want == 'counter' and reply then
    local number = tonumber(reply)
    if not number then
      fail('WRONGTYPE aiolocks: ' .. key .. ' holds a string that is not a number')
    end
    return number
  end
  return reply
end

-- The reply of `redis.pcall(...)` on `key`, the first command of its script on that key,
-- which doubles as the key's type check: a key of another type fails the call, naming it,
-- and the command changed nothing (a read, or a write that the server refused).
local function checked(reply, key, want)
  if type(reply) == 'table' and reply['err'] then
    fail_on(reply, key, want)
  end
  return reply
end

-- The server clock, read once per script call: one instant for all it does (the call is
-- atomic anyway), one TIME instead of one per use.
local clock = nil
local function server_time()
  if not clock then
    clock = redis.call('TIME')
  end
  return clock
end

-- TIME's two parts are digits, read by Lua's arithmetic (a third of what `tonumber`, which
-- parses a string twice, costs).
local function now_ms()
  local t = server_time()
  return t[1] * 1000 + math.floor(t[2] / 1000)
end

-- The server clock in microseconds since the epoch: about 1.8e15, exact in Lua's numbers
-- (doubles hold every integer below 2^53, about 9.0e15, until the year 2255).
local function now_us()
  local t = server_time()
  return t[1] * 1000000 + t[2]
end

-- An integer as its decimal digits. Never let Lua or the server turn a large number into
-- text: Lua's tostring and `..` keep 14 significant digits, and a fence has 16. '%d' (a C
-- long: 32 bits on a 32-bit build) takes a third of '%.0f''s time, and is exact below 2^31.
-- `n` may be a number's text (a ttl from ARGV).
local function int_str(n)
  n = tonumber(n)
  if n < 2147483648 and n > -2147483648 then
    return string.format('%d', n)
  end
  return string.format('%.0f', n)
end

-- Expiry: every key of a primitive lives while anyone holds or waits, and at most this long
-- past the end of the last lease or liveness deadline that needed it (docs/architecture.md,
-- "Fences and expiry"). A lease or deadline of ttl is written with the keys kept ttl + IDLE_MS.
local IDLE_MS = 1000
-- A fence counter is kept at least this long past its last grant, whatever the lease's ttl:
-- a server clock stepped back by less than that (or than ttl + IDLE_MS) once the key has
-- expired cannot send a fence below an earlier one (grant_fence; "Fences and expiry").
local FENCE_KEEP_MS = 5000

-- Keep `key` for at least `ms` more milliseconds: never shortens an expiry; gives one to a
-- key that has none (written by an older version); leaves a missing key missing.
local function keep_for(key, ms)
  local left = redis.call('PTTL', key)
  if left == -1 or (left >= 0 and left < ms) then
    redis.call('PEXPIRE', key, int_str(ms))
  end
end

-- keep_for every key of a list (a Lua table, e.g. a lease's keys) from index `first` on.
local function keep_all(keys, first, ms)
  for i = first, #keys do
    keep_for(keys[i], ms)
  end
end

local function split_member(member)
  local token, ttl, tag, side = string.match(member, '^([^:]+):([^:]+):([^:]*):(.*)$')
  return token, ttl, tag, side
end

-- A member's token alone, split_member's first field, for a path that needs no other: a
-- plain search and a cut, half the pattern match's cost.
local function member_token(member)
  return string.sub(member, 1, string.find(member, ':', 1, true) - 1)
end

-- Put a member at the tail (once) and refresh its liveness deadline (now + ttl); the queue
-- keys, and `extra` keys that must live as long as a waiter, are kept ttl + IDLE_MS. The
-- queue list and the waiters zset always get their expiries together (here, and in
-- heartbeat_group), so the zset's tells whether both need lengthening: one PTTL for two.
-- The queue's type must have been checked; the ZADD checks the zset's.
local function enqueue(queue, waiters, member, now, ttl, extra)
  local ms = tonumber(ttl) + IDLE_MS
  local fresh = false  -- the queue list was made here (an emptied list is deleted): no expiry
  local added = checked(redis.pcall('ZADD', waiters, now + tonumber(ttl), member), waiters, 'zset')
  if added == 1 then
    fresh = redis.call('RPUSH', queue, member) == 1
  end
  local left = redis.call('PTTL', waiters)
  if fresh or left == -1 or (left >= 0 and left < ms) then
    redis.call('PEXPIRE', waiters, int_str(ms))
    redis.call('PEXPIRE', queue, int_str(ms))
  end
  if extra then
    keep_all(extra, 1, ms)
  end
end

-- Pop the queue's first live member, dropping dead ones ahead of it (their liveness
-- deadline has passed: their process is gone): the only purge the hand-off needs, so a
-- hand-off reads the head, not every deadline. `head`: the queue's first member, as the
-- caller read it (LINDEX 0, which checked the list's type). The waiters zset's type is
-- checked by the first read, before anything is written. `forget` (optional): a hash of
-- per-token data of waiters (an election's candidates), a dead one's field deleted with it.
-- `admits` (optional): whether the first live member may enter now; if not, it stays at
-- the head (a read-write lock's writer behind readers). The one FIFO loop of every script.
-- Returns the member, or nil when nobody live waits (or the first live one may not enter).
local function pop_live(queue, waiters, head, now, forget, admits)
  while head do
    local deadline = checked(redis.pcall('ZSCORE', waiters, head), waiters, 'zset')
    local live = deadline and tonumber(deadline) >= now
    if live and admits and not admits(head) then
      return nil
    end
    redis.call('LPOP', queue)
    if deadline then
      redis.call('ZREM', waiters, head)
    end
    if live then
      return head
    end
    if forget then
      redis.call('HDEL', forget, (split_member(head)))
    end
    head = redis.call('LINDEX', queue, 0)
  end
  return nil
end

-- Grants go out on sharded pub/sub (SPUBLISH: on Cluster, to the channel's shard only)
-- where the server has it, Redis 7.0 (version number 0x070000 = 458752) and every Valkey;
-- PUBLISH otherwise. pubsub_mode.lua answers the same question for subscribers.
local SHARDED_PUBSUB = (redis.REDIS_VERSION_NUM or 0) >= 458752

-- Tell the new owner; skipped when it waits in the caller's own client (same tag).
local function announce(channel, token, fence, ttl, tag, caller_tag)
  if tag ~= caller_tag then
    local message = token .. ' ' .. int_str(fence) .. ' ' .. ttl
    redis.call(SHARDED_PUBSUB and 'SPUBLISH' or 'PUBLISH', channel, message)
  end
end

-- A waiter queued behind `holder`: when that is a local hand-off cohort's token (it ends in
-- "+<k>", see fence_block), its process is told, on the channel's "queued" twin (the same
-- hash tag: the same slot), which only a cohort holding the name listens to: its local
-- passes stop within their time bound of this (see Cohort, _engine/_leasedlock.py).
local function tell_cohort(channel, holder)
  if holder and string.find(holder, '+', 1, true) then
    redis.call(SHARDED_PUBSUB and 'SPUBLISH' or 'PUBLISH', channel .. ':queued', holder)
  end
end

-- Record a grant for the reply: {..., token, fence, ttl} (the caller wakes local waiters).
local function note_grant(grants, token, fence, ttl)
  grants[#grants + 1] = token
  grants[#grants + 1] = fence
  grants[#grants + 1] = tonumber(ttl)
end

-- Fence blocks: a token ending in "+<k>" is a local hand-off cohort's (see Cohort, _engine/_leasedlock.py); its
-- grant reserves k consecutive fences at once and holds the first, and the process hands the
-- others to its own tasks without a round trip. Any other token reserves one.
local function fence_block(token)
  local plus = string.find(token, '+', 1, true)  -- a plain search, not a pattern's scan
  return plus and tonumber(string.sub(token, plus + 1)) or 1
end

-- Count a grant of `token` whose lease is `ttl` ms: returns the first fence of its block.
-- The fence counter is a hybrid logical clock: a block starts above the stored counter and
-- reaches at least the server clock in microseconds, so fences stay strictly increasing
-- after the key expired (or was lost: a restart without persistence, a failover to a
-- replica behind).
-- The key outlives the lease by IDLE_MS, and FENCE_KEEP_MS at least, and never expires
-- before the clock has passed the stored value: a cohort reserving blocks faster than one
-- fence per microsecond runs the counter ahead of the clock, and its expiry is pushed back
-- by as much. So once the key has expired the clock is past every fence by that much, and a
-- server clock stepped back by less still hands out higher fences.
-- Where the key was missing, the block starts above the clock (nothing stored to start
-- above). Where the stored counter is behind the clock by a block or more (the usual case:
-- the last grant was a while ago), the block ends at the clock instead, and the counter is
-- written as TIME's own digits (no 16-digit number to format); it still starts
-- above the stored counter, and ends where the clock-based rule needs it. Otherwise (a
-- cohort ahead of the clock, or a clock stepped back) it starts right above the counter.
-- `stored`: the counter's value when the caller has just read it (nil: read it here).
-- `alone`: the counter serves this lease only (a mutex: whoever held it before has ended by
-- now), so its expiry is this grant's need, set without reading the one it had (which
-- another holder's lease may need, e.g. a semaphore's or an RW lock's).
local function grant_fence(fence_key, token, ttl, stored, alone)
  local block = fence_block(token)
  local now = now_us()
  if stored == nil then
    stored = tonumber(redis.call('GET', fence_key)) or 0
  end
  local base, last, digits = stored, stored + block, nil
  if stored > 0 and now - block >= stored then
    local t = server_time()  -- now's digits, from TIME's own text: no number to format
    base, last, digits = now - block, now, t[1] .. string.sub('00000' .. t[2], -6)
  elseif stored < now then
    base, last = now, now + block
  end
  local keep = math.max(ttl + IDLE_MS, FENCE_KEEP_MS) + math.ceil((last - now) / 1000)
  if not alone then
    keep = math.max(keep, redis.call('PTTL', fence_key))
  end
  redis.call('SET', fence_key, digits or int_str(last), 'PX', int_str(keep))
  return base + 1
end

-- The fence floor of a name, for a reply that says the caller does not hold it (queued or
-- busy): every fence handed out before this call is at or below it, and every later grant's
-- is above it. It is the counter (grant_fence starts above it), or, when the counter has
-- expired, the clock (the counter never expires before the clock has passed every fence).
-- A grant of the caller's token at or below it, read after this reply, is stale: the server
-- has ended it since (issue 24). `stored`: the counter as this call leaves it (nil: read).
local function fence_floor(fence_key, stored)
  if stored == nil then
    stored = tonumber(redis.call('GET', fence_key)) or 0
  end
  if stored > 0 then
    return stored
  end
  return now_us()
end

-- A holder in a sorted set of leases (token -> deadline, server ms) with its fence in a hash;
-- `extra` lists more keys to keep as long as the lease (e.g. a semaphore's stored limit).
-- `stored`: the fence counter, when the caller has just read it (nil: read it here).
local function hold_in_set(holders, fences, fence_key, token, ttl, now, extra, stored)
  redis.call('ZADD', holders, now + tonumber(ttl), token)
  local fence = grant_fence(fence_key, token, ttl, stored)
  redis.call('HSET', fences, token, int_str(fence))
  keep_all({holders, fences, unpack(extra or {})}, 1, tonumber(ttl) + IDLE_MS)
  return fence
end

-- Lease renewal, shared by renew_owner.lua / renew_member.lua / election_renew.lua and any
-- batch of renewals.
-- `keys` (a Lua table): the lease key first, then the keys that must outlive the lease (its
-- fence counter, its fences hash, a semaphore's limit); each is kept ttl_ms + IDLE_MS.

-- The lease key (keys[1]) extended to ttl_ms as its PX, the others kept past it. Returns 1.
local function extend_lease(keys, ttl_ms)
  redis.call('PEXPIRE', keys[1], int_str(ttl_ms))
  keep_all(keys, 2, tonumber(ttl_ms) + IDLE_MS)
  return 1
end

-- An owner key (mutex, RW writer) holding the token, with the lease as its PX.
-- Returns 1 when extended, 0 when the token no longer holds it (the lease is lost).
local function renew_owner_lease(keys, token, ttl_ms)
  if redis.call('GET', keys[1]) ~= token then
    return 0
  end
  return extend_lease(keys, ttl_ms)
end

-- An election's leader hash (its field 'token' names the leader, the lease is its PX).
-- Returns 1 when extended, 0 when the token no longer leads (the lease is lost).
local function renew_leader_lease(keys, token, ttl_ms)
  if redis.call('HGET', keys[1], 'token') ~= token then
    return 0
  end
  return extend_lease(keys, ttl_ms)
end

-- A member of a sorted set of holders (token -> lease deadline, server ms: semaphore, RW
-- readers). Returns 1 when extended, 0 when the token no longer holds (or its lease ended).
local function renew_member_lease(keys, token, ttl_ms, now)
  local deadline = redis.call('ZSCORE', keys[1], token)
  if not deadline or tonumber(deadline) < now then
    return 0
  end
  redis.call('ZADD', keys[1], 'XX', now + tonumber(ttl_ms), token)
  keep_all(keys, 1, tonumber(ttl_ms) + IDLE_MS)
  return 1
end

-- Heartbeat: give each of one process's queued `members` of one primitive the liveness
-- deadline now + its ttl. `keys`: the waiters zset first, then the keys kept as long as a
-- waiter (its queue list, a semaphore's limit). Returns the 1-based indexes of members no
-- longer queued (purged as dead): their waiters must re-run acquire to queue again.
local function heartbeat_group(keys, members, now)
  local missing = {}
  local longest = 0
  for i, member in ipairs(members) do
    local _, ttl = split_member(member)
    ttl = tonumber(ttl)
    if redis.call('ZADD', keys[1], 'XX', 'CH', now + ttl, member) == 0
        and not redis.call('ZSCORE', keys[1], member) then
      missing[#missing + 1] = i
    else
      longest = math.max(longest, ttl)
    end
  end
  if longest > 0 then
    keep_all(keys, 1, longest + IDLE_MS)
  end
  return missing
end

-- Remove a holder from a sorted set of leases; 1 if its lease was still live, else 0. Its
-- first commands on each key check the key's type (nothing written on a wrong one).
local function release_from_set(holders, fences, token, now)
  local deadline = checked(redis.pcall('ZSCORE', holders, token), holders, 'zset')
  if not deadline then
    return 0
  end
  checked(redis.pcall('HDEL', fences, token), fences, 'hash')
  redis.call('ZREM', holders, token)
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
