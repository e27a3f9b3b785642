"""shmkv: a shared-memory, multi-process, paged KV cache for LLM inference.

A :class:`Coordinator` owns a pool of K/V blocks (POSIX shared memory on CPU, CUDA
IPC on GPU) and all metadata about them; workers :func:`connect` once, zero copy,
and hold :class:`KvCacheHandle` objects whose block tables resolve into the pool.

The library prints nothing by itself: it logs to the ``shmkv`` logger (connections,
drops and their reasons, refusals, limits hit), which has no output until the
application configures logging (``shmkv serve --log-level`` does).
"""

import logging as _logging

_logging.getLogger("shmkv").addHandler(_logging.NullHandler())

from shmkv.client.batch import Batch, Step
from shmkv.client.client import Client, Computing, connect
from shmkv.client.handle import BlockTable, CacheHandleStats, KvCacheHandle, SequencePeek
from shmkv.coordinator.server import Coordinator, SpawnedCoordinator, default_address
from shmkv.errors import (
    AccessDenied,
    CoordinatorGone,
    CoordinatorTimeout,
    HandleClosed,
    HandoffError,
    InvalidArgument,
    LayoutMismatch,
    LimitExceeded,
    NotSettled,
    OutOfRange,
    PoolExhausted,
    ProtocolError,
    ShmkvError,
    StaleStep,
    UnknownCache,
    WrongType,
)
from shmkv.memory.layout import PoolConfig
from shmkv.tiers import DiskTier, HostTier
from shmkv.tiers.redis_store import RedisTier

__version__ = "0.1.0"

__all__ = [
    "AccessDenied",
    "Batch",
    "BlockTable",
    "CacheHandleStats",
    "Client",
    "Computing",
    "Coordinator",
    "CoordinatorGone",
    "CoordinatorTimeout",
    "DiskTier",
    "HandleClosed",
    "HandoffError",
    "HostTier",
    "InvalidArgument",
    "KvCacheHandle",
    "LayoutMismatch",
    "LimitExceeded",
    "NotSettled",
    "OutOfRange",
    "PoolConfig",
    "PoolExhausted",
    "ProtocolError",
    "RedisTier",
    "SequencePeek",
    "ShmkvError",
    "SpawnedCoordinator",
    "StaleStep",
    "Step",
    "UnknownCache",
    "WrongType",
    "connect",
    "default_address",
    "__version__",
]
