"""aiolocks: asyncio-native distributed locks on Redis and Valkey.

FIFO hand-off woken by pub/sub (never sleep-polling), leases renewed in the background
with loss reported to the holder, a fencing token for every acquisition, and clean-up
on cancellation at every await.
"""

from ._base._errors import AccessDenied as AccessDenied
from ._base._errors import ClientClosed as ClientClosed
from ._base._errors import LimitMismatch as LimitMismatch
from ._base._errors import LockError as LockError
from ._base._errors import LockLost as LockLost
from ._base._errors import LockNotOwned as LockNotOwned
from ._base._errors import LockReentry as LockReentry
from ._base._errors import LockTimeout as LockTimeout
from ._base._errors import NotReplicated as NotReplicated
from ._base._errors import ServerUnavailable as ServerUnavailable
from ._base._handle import LockHandle as LockHandle
from ._engine._leasedlock import LockStatistics as LockStatistics
from .election import ElectionInfo as ElectionInfo
from .election import LeaderInfo as LeaderInfo
from .election import RedisElection as RedisElection
from .election import Term as Term
from .multilock import RedisMultiLock as RedisMultiLock
from .mutex import MutexInfo as MutexInfo
from .mutex import RedisMutex as RedisMutex
from .ratelimit import Limit as Limit
from .ratelimit import RateLimiterInfo as RateLimiterInfo
from .ratelimit import RateLimiterStatistics as RateLimiterStatistics
from .ratelimit import RedisRateLimiter as RedisRateLimiter
from .registry import RedisRegistry as RedisRegistry
from .registry import RegistryStatistics as RegistryStatistics
from .rwlock import ReadLock as ReadLock
from .rwlock import RedisReadWriteLock as RedisReadWriteLock
from .rwlock import RWLockInfo as RWLockInfo
from .rwlock import WriteLock as WriteLock
from .semaphore import RedisSemaphore as RedisSemaphore
from .semaphore import SemaphoreInfo as SemaphoreInfo

__all__ = (
    "AccessDenied",
    "ClientClosed",
    "ElectionInfo",
    "LeaderInfo",
    "Limit",
    "LimitMismatch",
    "LockError",
    "LockHandle",
    "LockLost",
    "LockNotOwned",
    "LockReentry",
    "LockStatistics",
    "LockTimeout",
    "MutexInfo",
    "NotReplicated",
    "RWLockInfo",
    "RateLimiterInfo",
    "RateLimiterStatistics",
    "ReadLock",
    "RedisElection",
    "RedisMultiLock",
    "RedisMutex",
    "RedisRateLimiter",
    "RedisReadWriteLock",
    "RedisRegistry",
    "RedisSemaphore",
    "RegistryStatistics",
    "SemaphoreInfo",
    "ServerUnavailable",
    "Term",
    "WriteLock",
)

for _name in __all__:
    globals()[_name].__module__ = "aiolocks"
del _name

__version__ = "0.2.0.dev0"  # the package's version (pyproject.toml reads it from here)
