-- Keep one process's queue entries of one primitive alive.
-- KEYS[1] waiters  ZSET member -> liveness deadline (server ms)
-- KEYS[2..] keys kept as long as a waiter (the queue list, a semaphore's limit)
-- ARGV    members, each "<token>:<ttl_ms>:<tag>:<side>"; each gets deadline now + its ttl
-- Returns the 1-based indexes of members that were no longer queued (purged as dead);
-- their waiters must re-run acquire to queue again.
return heartbeat_group(KEYS, ARGV, now_ms())
