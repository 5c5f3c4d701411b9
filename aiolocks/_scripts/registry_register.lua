-- Get-or-create the ids of a batch of names, atomically: the same name always gets the
-- same id, and new names take the next ids of a dense sequence starting at 1.
-- KEYS[1] ids      HASH   name -> id
-- KEYS[2] names    HASH   id -> name (the reverse map, same entries)
-- KEYS[3] counter  STRING the highest id handed out so far
-- ARGV    the names (at least one), in the caller's order; duplicates are allowed
-- Returns the ids, one per ARGV entry, in ARGV order. New names are numbered in the
-- order of their first occurrence in ARGV.
local ids_key, names_key, counter_key = KEYS[1], KEYS[2], KEYS[3]
-- Commands take at most this many names at once: Lua's unpack() has a bounded C stack.
local CHUNK = 1000

local count = #ARGV
local result = {}
local fresh = {}       -- name -> position in new_names (first occurrence in this batch)
local new_names = {}

for first = 1, count, CHUNK do
  local last = math.min(first + CHUNK - 1, count)
  local found = redis.call('HMGET', ids_key, unpack(ARGV, first, last))
  for i = first, last do
    local id = found[i - first + 1]
    if id then
      result[i] = tonumber(id)
    else
      local name = ARGV[i]
      local position = fresh[name]
      if not position then
        position = #new_names + 1
        new_names[position] = name
        fresh[name] = position
      end
      result[i] = -position  -- resolved once the new ids are known
    end
  end
end

local added = #new_names
if added > 0 then
  local base = redis.call('INCRBY', counter_key, added) - added
  for first = 1, added, CHUNK / 2 do
    local last = math.min(first + CHUNK / 2 - 1, added)
    local forward, reverse = {}, {}
    for position = first, last do
      local id = base + position
      forward[#forward + 1] = new_names[position]
      forward[#forward + 1] = id
      reverse[#reverse + 1] = id
      reverse[#reverse + 1] = new_names[position]
    end
    redis.call('HSET', ids_key, unpack(forward))
    redis.call('HSET', names_key, unpack(reverse))
  end
  for i = 1, count do
    if result[i] < 0 then
      result[i] = base - result[i]
    end
  end
end
return result
