"""shmkv as a vLLM KV connector: prefix K/V shared across engines, restarts and nodes.

This package owns the adapter between vLLM's ``KVConnectorBase_V1`` (vLLM 0.32) and
shmkv's public client API. It does not own shmkv's pool, keys, tiers or store: the
coordinator does. Load it out of tree::

    KVTransferConfig(kv_connector="ShmkvConnector",
                     kv_connector_module_path="shmkv.integrations.vllm",
                     kv_role="kv_both",
                     kv_connector_extra_config={"shmkv.name": "lm"})  # or "shmkv.address"

How a request goes through it:

* **Scheduler side** (:class:`ShmkvConnectorScheduler`): one
  ``client.allocate(prompt=...)`` over the prompt's full vLLM blocks, under a salt made of
  the model's identity (the checkpoint's content or ``"shmkv.model_id"``, the effective
  config, dtype, KV cache dtype, ``"shmkv.salt"``: ``shmkv.integrations.vllm.identity``),
  the request's LoRA adapter's content, its images and prompt embeddings, and its
  ``cache_salt``. It is asked on a thread of the scheduler's own (the courier),
  which vLLM's scheduler thread waits for at most ``LOOKUP_WAIT_S`` a step: an answer
  not there yet is "not known yet" (None; vLLM schedules others and asks again next
  step), and one not there ``"shmkv.lookup_timeout_s"`` after the courier began it (or
  queued behind one that is, a coordinator that stopped answering) is a miss. A
  request that will save gets its workers' hand-offs in the same job. The handle's
  ``num_cached_tokens``, rounded down to whole vLLM blocks (and short of the prompt's last
  token, which vLLM must compute), is the hit. The handle pins the hit blocks until the
  workers have loaded them, and its other slots receive the blocks vLLM computes. The
  allocate is answered at once (``wait=False``) also when a tier still copies part of
  the hit into the pool: from this host's tiers the load is then asynchronous
  (``load_async``, handed to the workers once a thread of the scheduler's has seen the
  copies settle); while the shared store is asked, the hit is "not known yet" (None) and
  vLLM asks again.
* **Metadata** (:class:`ShmkvConnectorMetadata`, the only state that crosses between the
  two sides): per request and step, a few ints (which vLLM blocks, which token ranges to
  load and to save) and, for a load alone, the lookup handle's descriptor
  (``handle.descriptor()``: no request; the handle pins the blocks until the request
  finishes), or, the first time a request saves, one hand-off token per tensor-parallel
  rank (``handle.export``, made with the lookup). No round trip on vLLM's thread per step.
* **Worker side** (:class:`ShmkvConnectorWorker`): ``start_load_kv`` reads a load's pool
  blocks through the descriptor (``client.peek``: no round trip, no reference), or opens
  the hand-offs, and copies the hit blocks into vLLM's paged tensors before the forward
  (with ``"shmkv.layerwise"``, on the CPU, layer by layer on a thread of the worker's own,
  each layer's attention waiting for its layer in ``wait_for_layer_load``); after the
  forward, ``wait_for_save`` copies the newly complete blocks into the pool and
  ``commit``s them (under tensor parallelism a block is published once every rank has
  committed its head shard). Copies go block to block, no Python loop per token: one
  strided copy per layer, K or V, and run of pool blocks that lie one after another in one
  vLLM block (:func:`copy_runs`). A load read through a descriptor counts only if the
  sequence was still alive with the same blocks after the copy (``peek.check()``); else it
  is a load error, recomputed.
* **Failures never crash the engine.** A hand-off that cannot be opened, a coordinator
  gone or restarted, a copy that raises: the blocks of that load are reported through
  ``get_block_ids_with_load_errors`` and vLLM recomputes them (the connector sets
  ``kv_load_failure_policy="recompute"`` unless ``"shmkv.on_load_error": "fail"``). A save
  that fails is dropped (a later miss, nothing worse). With no coordinator the scheduler
  answers "no hit" and tries to connect again after ``"shmkv.retry_s"`` seconds.

vLLM's paged K/V layouts, and how the copies read them: :mod:`shmkv.integrations.vllm.layout`.

The files, each the only owner of its concern; imports point down this list only:

* ``settings.py``: the ``shmkv.*`` keys of ``kv_connector_extra_config``, their checks
  and defaults, the connector's errors (imports nothing of the package);
* ``identity.py``: what a prefix key stands for, the engine's namespace and a request's
  salt (imports no vLLM); ``log.py``: shmkv's log lines in vLLM's log;
* ``layout.py``: views of vLLM's cache tensors per attention back end, the copy plan and
  the copy (imports ``settings``);
* ``metadata.py``: what crosses between the two sides through vLLM (the step's
  :class:`ShmkvConnectorMetadata` and its :class:`ShmkvReqMeta`, the workers'
  :class:`ShmkvWorkerMetadata`), and the stats (imports nothing of the package);
* ``courier.py``: the connections to the coordinator, each on a thread of its own (the
  dialer, the courier, the scheduler's waits for tier copies; imports ``settings``);
* ``scheduler.py``: :class:`ShmkvConnectorScheduler`, the lookups and each step's
  metadata (imports the above; never ``worker``);
* ``worker.py``: :class:`ShmkvConnectorWorker`, the loads and saves (imports the above;
  never ``scheduler``);
* ``connector.py``: :class:`ShmkvConnector`, the facade vLLM loads: it holds one of the
  two sides, by its role, and hands each hook to it.

The names below are importable from the package, as vLLM's ``kv_connector_module_path``
finds ``ShmkvConnector``. A timing constant (``LOOKUP_WAIT_S``, ``LAYER_WAIT_S``, ...)
is read by the module that uses it: change it there, not here.
"""

from __future__ import annotations

from shmkv.integrations.vllm.connector import ShmkvConnector
from shmkv.integrations.vllm.courier import (
    CLIENT_TIMEOUT_S,
    SETTLE_TIMEOUT_S,
    _Courier,
    _Settler,
)
from shmkv.integrations.vllm.identity import model_namespace, request_salt
from shmkv.integrations.vllm.layout import (
    SERIAL_COPY_BYTES,
    assign,
    check_cpu_layout,
    copy_runs,
    cpu_attn_isas,
    detect_layout,
    kv_views,
    merge_runs,
    tp_shard_heads,
)
from shmkv.integrations.vllm.metadata import (
    COUNTS,
    ShmkvConnectorMetadata,
    ShmkvConnectorStats,
    ShmkvReqMeta,
    ShmkvWorkerMetadata,
)
from shmkv.integrations.vllm.scheduler import (
    COMPUTING_POLL_S,
    LOOKUP_WAIT_S,
    ShmkvConnectorScheduler,
)
from shmkv.integrations.vllm.settings import (
    DEFAULT_LOOKUP_TIMEOUT_S,
    DEFAULT_RETRY_S,
    DEFAULT_WAIT_COMPUTING_S,
    HANDOFF_TTL_S,
    LAYOUTS,
    LOOKUP_SUFFIX,
    SETTINGS,
    ConnectorConfigError,
    ConnectorLayoutError,
    ConnectorSettings,
    check_settings,
    client_name,
    expected_layout,
    lookup_name,
    read_settings,
)
from shmkv.integrations.vllm.worker import (
    CONNECT_WAIT_S,
    LAYER_WAIT_S,
    ShmkvConnectorWorker,
)

__all__ = [
    "CLIENT_TIMEOUT_S",
    "COMPUTING_POLL_S",
    "CONNECT_WAIT_S",
    "COUNTS",
    "DEFAULT_LOOKUP_TIMEOUT_S",
    "DEFAULT_RETRY_S",
    "DEFAULT_WAIT_COMPUTING_S",
    "HANDOFF_TTL_S",
    "LAYER_WAIT_S",
    "LAYOUTS",
    "LOOKUP_SUFFIX",
    "LOOKUP_WAIT_S",
    "SERIAL_COPY_BYTES",
    "SETTINGS",
    "SETTLE_TIMEOUT_S",
    "ConnectorConfigError",
    "ConnectorLayoutError",
    "ConnectorSettings",
    "ShmkvConnector",
    "ShmkvConnectorMetadata",
    "ShmkvConnectorScheduler",
    "ShmkvConnectorStats",
    "ShmkvConnectorWorker",
    "ShmkvReqMeta",
    "ShmkvWorkerMetadata",
    "_Courier",
    "_Settler",
    "assign",
    "check_cpu_layout",
    "check_settings",
    "client_name",
    "copy_runs",
    "cpu_attn_isas",
    "detect_layout",
    "expected_layout",
    "kv_views",
    "lookup_name",
    "merge_runs",
    "model_namespace",
    "read_settings",
    "request_salt",
    "tp_shard_heads",
]
