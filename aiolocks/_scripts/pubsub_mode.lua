-- Whether grants are published on sharded pub/sub (see SHARDED_PUBSUB in _prelude.lua),
-- so that subscribers use the matching SSUBSCRIBE or SUBSCRIBE.
-- KEYS none    ARGV none
-- Returns 1 for SPUBLISH / SSUBSCRIBE, 0 for PUBLISH / SUBSCRIBE.
return SHARDED_PUBSUB and 1 or 0
