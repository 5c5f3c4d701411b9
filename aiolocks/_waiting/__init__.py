"""Waiting and notification: parked waiters and the pub/sub that wakes them.

A `Lot` is one channel's waiters in this process; the wait queue (`_waitqueue`, with its
lots) holds every lot of a client; the notifier (`_notifier`) is being told a name may be
free: its subscriptions and pub/sub links, and grant messages and keyspace events turned
into wake-ups. None knows a primitive. Imports `_base`, `_scripts` and `_transport`. Read
`_waitqueue`, then `_notifier`.
"""
