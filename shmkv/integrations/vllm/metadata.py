"""What crosses between the connector's two sides, through vLLM's channels only.

Scheduler to workers, once a step: :class:`ShmkvConnectorMetadata` (vLLM pickles it to
every worker), one :class:`ShmkvReqMeta` per request with work. Workers to scheduler:
:class:`ShmkvWorkerMetadata` (vLLM's ``kv_connector_worker_meta``, aggregated over the
ranks), besides what vLLM's own hooks carry (finished receives, load errors). And the
workers' counts to vLLM's metrics: :class:`ShmkvConnectorStats`. Plain data: no handle,
client or lock. This module imports no other module of the connector.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

try:  # vLLM 0.32 has connector stats; older releases may not
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
except ImportError:  # pragma: no cover
    KVConnectorStats = object  # type: ignore[misc, assignment]  # (no stats before 0.32)


@dataclass
class ShmkvReqMeta:
    """One request's work for one step (plain data: it is pickled to the workers).

    ``tokens``: the hand-off tokens, one per tensor-parallel rank, on the first step that
    saves (``None`` otherwise; an empty list when the scheduler lost its handle, so the
    worker reports the load as failed). ``source``: for a load while no hand-off was made,
    the scheduler's handle's descriptor (``handle.descriptor()``): every rank reads the
    pool blocks from the shared tables and copies them with no round trip and no
    reference of its own, then checks the sequence outlived the copy (the scheduler holds
    it until the request finishes). ``block_ids``: the request's vLLM block ids.
    ``load``: the token range to copy from the pool into vLLM's blocks. ``save``: the
    token range to copy from vLLM's blocks into the pool and commit. ``done``: the worker
    closes its handle after this step. ``recv``, ``valid``: see below.
    """

    req_id: str
    block_ids: List[int]
    tokens: Optional[List[bytes]] = None
    source: Optional[bytes] = None
    load: Tuple[int, int] = (0, 0)
    save: Tuple[int, int] = (0, 0)
    done: bool = False
    # An asynchronous load (``load_async``), its tier copies done: copied in this step
    # whether or not vLLM schedules the request, then reported finished receiving; the
    # blocks of ``load`` from ``valid`` on did not arrive (load errors).
    recv: bool = False
    valid: Optional[int] = None
    # Tokens of the prompt vLLM asked shmkv for and shmkv did not have (computed):
    # reported to the coordinator as misses (rank 0, count_hits).
    missed: int = 0


@dataclass
class ShmkvConnectorMetadata(KVConnectorMetadata):
    """The connector metadata of one step: requests with work, requests whose handles
    the workers close (finished, aborted or preempted), and asynchronous loads dropped."""

    requests: List[ShmkvReqMeta] = field(default_factory=list)
    closed: List[str] = field(default_factory=list)
    # asynchronous loads of requests finished before they were handed over: reported
    # finished receiving with nothing copied (vLLM frees their blocks then)
    recv_dropped: List[str] = field(default_factory=list)
    # the instance id of the coordinator the scheduler is connected to ("" for none): a
    # worker not connected to it connects at once (after a coordinator restart)
    coordinator: str = ""


COUNTS = ("num_loaded_tokens", "num_saved_tokens", "num_load_errors", "num_async_loads")


@dataclass
class ShmkvConnectorStats(KVConnectorStats):
    """Loaded and saved tokens, failed loads and asynchronous loads (a prefix that came
    up from a tier while vLLM scheduled on), summed over an interval."""

    data: Dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        for name in COUNTS:
            self.data.setdefault(name, 0)

    def reset(self):
        """Zero every count."""
        for name in self.data:
            self.data[name] = 0

    def aggregate(self, other):
        """Add ``other``'s counts to these."""
        for name, value in other.data.items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self):
        """The counts as they are (sums)."""
        return dict(self.data)

    def is_empty(self) -> bool:
        """True when nothing was loaded, saved or lost."""
        return not any(self.data.values())


@dataclass
class ShmkvWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker to scheduler, when it changes: the instance id of the coordinator each
    tensor-parallel rank is connected to (``""``: none). The scheduler promises a hit
    only while every rank is connected to the coordinator its own lookups asked."""

    instances: Dict[int, str] = field(default_factory=dict)

    def aggregate(self, other: "KVConnectorWorkerMetadata") -> "ShmkvWorkerMetadata":
        """Every rank's report (a rank reports only its own)."""
        merged = dict(self.instances)
        if isinstance(other, ShmkvWorkerMetadata):
            merged.update(other.instances)
        return ShmkvWorkerMetadata(merged)
