-- Run many lease renewals and waiter heartbeats in one call (the lease keeper's batch).
-- OPS     the operations, each one's own script as a function of (KEYS, ARGV) (see
--         `load_batch`): 1 renew_owner, 2 renew_member, 3 heartbeat, 4 election_renew
-- KEYS    every entry's keys, entry after entry
-- ARGV[1] the entries, back to back, each "<op>,<key count>,<arg count>," and then its
--         args, each "<length>:<bytes>" (one string: far cheaper for the client to send
--         than one argument per value)
-- Returns {entry, result, ...} (entries counted from 1) for every entry whose result is
--         neither 1 nor an empty list: 0 for a lease no longer held, the indexes a
--         heartbeat found purged, or the error message of an entry that failed.
local blob = ARGV[1]
local out = {}
local k, pos, entry = 1, 1, 0
while pos <= #blob do
  entry = entry + 1
  local op, nk, na, first = string.match(blob, '^(%d+),(%d+),(%d+),()', pos)
  if not op then
    return redis.error_reply('ERR aiolocks: malformed batch entry ' .. entry)
  end
  pos = first
  local keys, args = {}, {}
  for i = 1, tonumber(nk) do
    keys[i] = KEYS[k]
    k = k + 1
  end
  for i = 1, tonumber(na) do
    local length, start = string.match(blob, '^(%d+):()', pos)
    pos = start + tonumber(length)
    args[i] = string.sub(blob, start, pos - 1)
  end
  local ok, result = pcall(OPS[tonumber(op)], keys, args)
  if result == nil then
    result = false  -- a nil would end the reply's array here
  end
  if not ok then
    out[#out + 1] = entry
    out[#out + 1] = type(result) == 'table' and tostring(result.err) or tostring(result)
  elseif result ~= 1 and not (type(result) == 'table' and #result == 0) then
    out[#out + 1] = entry
    out[#out + 1] = result
  end
end
return out
