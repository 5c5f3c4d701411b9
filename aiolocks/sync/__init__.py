"""aiolocks for synchronous code (Celery, RQ, Django, scripts): the same locks, keys, queue,
fences and leases as the asyncio API, so threads and asyncio tasks queue for one name.

```python
import redis
from aiolocks.sync import RedisMutex

with RedisMutex(redis.Redis.from_url("redis://localhost:6379"), "orders:42", ttl=30):
    ...
```

A thin door onto the one engine: each process runs the engine on one background event
loop (a daemon thread started on first use, stopped at interpreter exit, started afresh in
a forked child), and a thread's acquisition is a task there. Holdings belong to the thread
that acquired them; a lost lease sets `lost` (a `threading.Event`), calls `on_lost` and
makes leaving the `with` raise `LockLost`. See docs/sync.md.
"""

from ._locks import ReadLock as ReadLock
from ._locks import RedisMutex as RedisMutex
from ._locks import RedisReadWriteLock as RedisReadWriteLock
from ._locks import RedisSemaphore as RedisSemaphore
from ._locks import WriteLock as WriteLock
from ._others import RedisRateLimiter as RedisRateLimiter
from ._others import RedisRegistry as RedisRegistry

__all__ = (
    "ReadLock",
    "RedisMutex",
    "RedisRateLimiter",
    "RedisReadWriteLock",
    "RedisRegistry",
    "RedisSemaphore",
    "WriteLock",
)

for _name in __all__:
    globals()[_name].__module__ = "aiolocks.sync"
del _name
