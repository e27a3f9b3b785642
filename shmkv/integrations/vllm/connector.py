"""``ShmkvConnector``: the class vLLM loads, a facade over the connector's two sides.

vLLM makes one connector per role: in its scheduler's process a connector of the
scheduler role, in each worker one of the worker role. The facade reads the settings
(:func:`read_settings`), makes the one side its role needs
(:class:`ShmkvConnectorScheduler` or :class:`ShmkvConnectorWorker`) and hands each of
vLLM's hooks to it; it holds no state of its own. What the scheduler side tells the
workers crosses in :class:`ShmkvConnectorMetadata` alone (vLLM's ``bind_connector_metadata``
on this facade), and what the workers tell the scheduler in vLLM's own channels. It
imports every other module of the connector; none imports it.
"""

from __future__ import annotations

import logging
from typing import Dict, Optional

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
)

from shmkv.integrations.vllm.identity import model_identity
from shmkv.integrations.vllm.log import log_through_vllm
from shmkv.integrations.vllm.metadata import ShmkvConnectorMetadata, ShmkvConnectorStats
from shmkv.integrations.vllm.scheduler import ShmkvConnectorScheduler
from shmkv.integrations.vllm.settings import read_settings
from shmkv.integrations.vllm.worker import ShmkvConnectorWorker

log = logging.getLogger("shmkv.vllm")


class ShmkvConnector(KVConnectorBase_V1):
    """vLLM KV connector over a shmkv coordinator (see :mod:`shmkv.integrations.vllm`).

    ``kv_connector_extra_config`` keys (any other is refused, :func:`check_settings`):
    ``"shmkv.name"`` or ``"shmkv.address"`` (which coordinator), ``"shmkv.salt"`` (a
    namespace of your own), ``"shmkv.model_id"`` (the checkpoint's identity, instead of a
    digest of its files), ``"shmkv.client_name"`` (the engine's name in the coordinator's
    metrics), ``"shmkv.retry_s"`` (seconds between failed attempts to connect, default
    1), ``"shmkv.lookup_timeout_s"`` (how long a lookup may take before it is a miss,
    default 1), ``"shmkv.handoff_ttl_s"`` (how long a hand-off nobody
    opened pins its blocks, default 10),
    ``"shmkv.kv_layout"`` (``"cpu"``, ``"split"`` or ``"flash"``; detected by default),
    ``"shmkv.on_load_error"`` (``"recompute"``, the default, or ``"fail"``),
    ``"shmkv.prefault"`` (map the whole CPU pool into each worker when it connects,
    default true: a load then copies at memory speed instead of meeting a page fault on
    every 4 KiB of blocks another process wrote, about 0.1 s a GiB once per connection),
    ``"shmkv.layerwise"`` (on the CPU, copy a step's loads on a thread of the worker's
    own, layer by layer, while the forward computes; default false, which copies them
    all before the forward: on a host whose cores the forward keeps busy the thread slows
    the forward by more than the copy it hides, ``shmkv bench --only vllm``).

    The side it makes is ``connector_scheduler`` or ``connector_worker`` (the other is
    None), of the class ``scheduler_class`` or ``worker_class``: a subclass may name
    subclasses of its own there.

    Raises (at start-up):
        ConnectorConfigError: no address; an unknown key or an invalid value; pipeline
            parallelism; a CPU attention path whose K/V layout the connector does not copy.
        ConnectorLayoutError: (also a ``shmkv.LayoutMismatch``) a pool block size that
            does not divide vLLM's block size; a pool of another tensor-parallel size; a
            pool whose layers, heads, head size or dtype differ from the model's K/V (the
            message says what to set).
    """

    scheduler_class = ShmkvConnectorScheduler
    worker_class = ShmkvConnectorWorker

    def __init__(self, vllm_config, role, kv_cache_config=None):
        log_through_vllm()  # "shmkv: ..." lines in vLLM's log (vllm serve's processes)
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        scheduler = role == KVConnectorRole.SCHEDULER
        settings = read_settings(vllm_config, self._kv_transfer_config, scheduler)
        identity = model_identity(vllm_config, settings.salt, settings.model_id)
        log.info("shmkv: prefix keys under namespace %s", identity.describe())
        self.connector_scheduler: Optional[ShmkvConnectorScheduler] = None
        self.connector_worker: Optional[ShmkvConnectorWorker] = None
        if scheduler:
            if settings.recompute:
                # A cache is best effort: a lost block is recomputed, never fatal.
                self._kv_transfer_config.kv_load_failure_policy = "recompute"
            self.connector_scheduler = self.scheduler_class(settings, identity.namespace)
        else:
            self.connector_worker = self.worker_class(vllm_config, settings)

    @property
    def connected(self) -> bool:
        """Whether this side's last attempt to connect to the coordinator succeeded."""
        side = self.connector_scheduler or self.connector_worker
        assert side is not None
        return side.connected

    @property
    def totals(self) -> ShmkvConnectorStats:
        """What this side loaded, saved and failed to load since it started (the worker
        side's counts; a scheduler's are all zero)."""
        worker = self.connector_worker
        return worker.totals if worker is not None else ShmkvConnectorStats()

    @property
    def num_late_lookups(self) -> int:
        """(Scheduler side.) Lookups not answered in time, counted as misses."""
        return self._scheduler.num_late_lookups

    @property
    def num_computing_waits(self) -> int:
        """(Scheduler side.) Requests that waited for a prefix another engine was
        computing (``"shmkv.wait_computing_s"``), rather than computing it too."""
        return self._scheduler.num_computing_waits

    @property
    def requires_kv_delivery(self) -> bool:
        """False: a dropped save is only a later miss."""
        return False

    @property
    def _scheduler(self) -> ShmkvConnectorScheduler:
        assert self.connector_scheduler is not None, "a scheduler-side hook on a worker"
        return self.connector_scheduler

    @property
    def _worker(self) -> ShmkvConnectorWorker:
        assert self.connector_worker is not None, "a worker-side hook on the scheduler"
        return self.connector_worker

    # -- scheduler side ---------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        """See :meth:`ShmkvConnectorScheduler.get_num_new_matched_tokens`."""
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_connector_output(self, connector_output) -> None:
        """See :meth:`ShmkvConnectorScheduler.update_connector_output`."""
        self._scheduler.update_connector_output(connector_output)

    def get_external_cache_hit_sources(self, request, num_external_tokens: int):
        """See :meth:`ShmkvConnectorScheduler.get_external_cache_hit_sources` (vLLM's
        default where it does not know the request)."""
        sources = self._scheduler.get_external_cache_hit_sources(request, num_external_tokens)
        if sources is None:
            return super().get_external_cache_hit_sources(request, num_external_tokens)
        return sources

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        """See :meth:`ShmkvConnectorScheduler.update_state_after_alloc`."""
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> ShmkvConnectorMetadata:
        """See :meth:`ShmkvConnectorScheduler.build_connector_meta`."""
        return self._scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request, block_ids):
        """See :meth:`ShmkvConnectorScheduler.request_finished`."""
        return self._scheduler.request_finished(request, block_ids)

    # -- worker side ------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Dict[str, torch.Tensor]):
        """See :meth:`ShmkvConnectorWorker.register_kv_caches`."""
        self._worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context, **kwargs) -> None:
        """See :meth:`ShmkvConnectorWorker.start_load_kv` (with the step's metadata)."""
        self._worker.start_load_kv(self._connector_metadata)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """See :meth:`ShmkvConnectorWorker.wait_for_layer_load`."""
        self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        """Nothing per layer: :meth:`wait_for_save` saves every layer after the forward."""
        return

    def wait_for_save(self):
        """See :meth:`ShmkvConnectorWorker.wait_for_save` (with the step's metadata)."""
        self._worker.wait_for_save(self._connector_metadata)

    def get_finished(self, finished_req_ids):
        """See :meth:`ShmkvConnectorWorker.get_finished`."""
        return self._worker.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set:
        """See :meth:`ShmkvConnectorWorker.get_block_ids_with_load_errors`."""
        return self._worker.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self):
        """See :meth:`ShmkvConnectorWorker.build_connector_worker_meta`."""
        return self._worker.build_connector_worker_meta()

    def get_kv_connector_stats(self):
        """Loaded and saved tokens and failed loads since the last call (the worker
        side's; None when there are none)."""
        worker = self.connector_worker
        return worker.get_kv_connector_stats() if worker is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data=None):
        """:class:`ShmkvConnectorStats` from a dict of counts."""
        return ShmkvConnectorStats(data=dict(data or {}))

    def shutdown(self):
        """Close every handle and the client (of whichever side this is)."""
        if self.connector_scheduler is not None:
            self.connector_scheduler.shutdown()
        if self.connector_worker is not None:
            self.connector_worker.shutdown()
