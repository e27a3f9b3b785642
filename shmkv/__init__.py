"""shmkv: a shared-memory, multi-process, paged KV cache for LLM inference.

A :class:`Coordinator` owns a pool of K/V blocks (POSIX shared memory on CPU, CUDA
IPC on GPU) and all metadata about them; workers :func:`connect` once, zero copy,
and hold :class:`KvCacheHandle` objects whose block tables resolve into the pool.
"""

from .batch import Batch, Step
from .client import Client, connect
from .coordinator import Coordinator, default_address
from .errors import (AccessDenied, CoordinatorGone, CoordinatorTimeout, HandleClosed,
                     HandoffError, InvalidArgument, LayoutMismatch, LimitExceeded, OutOfRange,
                     PoolExhausted, ProtocolError, ShmkvError, StaleStep, UnknownCache,
                     WrongType)
from .handle import BlockTable, CacheHandleStats, KvCacheHandle
from .layout import PoolConfig
from .spawned import SpawnedCoordinator

__version__ = "0.1.0"

__all__ = [
    "AccessDenied", "Batch", "BlockTable", "CacheHandleStats", "Client", "Coordinator",
    "CoordinatorGone", "CoordinatorTimeout", "HandleClosed", "HandoffError", "InvalidArgument",
    "KvCacheHandle", "LayoutMismatch", "LimitExceeded", "OutOfRange", "PoolConfig",
    "PoolExhausted", "ProtocolError", "ShmkvError", "SpawnedCoordinator", "StaleStep", "Step", "UnknownCache",
    "WrongType", "connect", "default_address", "__version__",
]
