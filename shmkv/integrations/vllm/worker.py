"""The worker side of the vLLM connector: copies between vLLM's paged K/V and the pool.

This module owns :class:`ShmkvConnectorWorker`, what vLLM's workers (one per
tensor-parallel rank) ask of the connector: register vLLM's K/V tensors, load a step's
hits into them before (or, layer by layer, during) the forward, save the newly complete
blocks into the pool after it, and report failed loads. It learns what to do only from
the step's :class:`ShmkvConnectorMetadata`, and reports back only through vLLM's
channels (finished receives, load errors, :class:`ShmkvWorkerMetadata`, stats). It does
not look anything up (the scheduler side does). It imports the connector's settings,
layout, metadata and courier modules, never the scheduler side.
"""

from __future__ import annotations

import logging
import queue
import re
import threading
from dataclasses import replace
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

import shmkv
from shmkv.errors import ShmkvError
from shmkv.integrations.vllm.courier import Dialer, _Courier, _release, log_refused
from shmkv.integrations.vllm.layout import (
    assign,
    check_cpu_layout,
    copy_runs,
    cpu_attn_isas,
    detect_layout,
    kv_views,
    merge_runs,
)
from shmkv.integrations.vllm.metadata import (
    ShmkvConnectorMetadata,
    ShmkvConnectorStats,
    ShmkvReqMeta,
    ShmkvWorkerMetadata,
)
from shmkv.integrations.vllm.settings import ConnectorConfigError, ConnectorSettings

log = logging.getLogger("shmkv.vllm")

# The longest a worker waits, before a step's loads, to connect to the coordinator the
# scheduler looked them up in (after a restart); a failure is reported to the scheduler.
CONNECT_WAIT_S = 2.0
LAYER_WAIT_S = 30.0  # the longest a layer's attention waits for its load before giving up


class _Run:
    """One step's loads on the load thread: its own layer events, stop flag and failures,
    so that a run that outlives its step can neither signal nor report for the next."""

    def __init__(self, pool, loads, num_layers: int):
        self.pool = pool
        self.loads = loads
        self.layers = [threading.Event() for _ in range(num_layers)]
        self.stop = threading.Event()
        self.done = threading.Event()
        self.failed: Dict[int, BaseException] = {}

    def cancel(self) -> None:
        self.stop.set()
        for event in self.layers:  # every later wait of the step returns at once
            event.set()


class _LayerLoader:
    """A step's loads, copied layer by layer on a daemon thread of their own, so that
    the forward computes while the later layers arrive. ``start`` takes the step's
    loads; ``wait`` blocks until one layer of all of them is in vLLM's blocks; ``finish``
    waits for the rest and returns each load's failure (None for a load fully copied);
    ``cancel`` stops the copies after the current one (the step's loads then all fail).
    One step at a time. A run still copying ``2 * LAYER_WAIT_S`` after its step ended
    makes the loader ``broken``: the connector copies before the forward from then on."""

    def __init__(self, num_layers: int, copy_layer: Callable[..., None]):
        self._num_layers = num_layers
        self._copy_layer = copy_layer
        self._jobs: "queue.SimpleQueue[Optional[_Run]]" = queue.SimpleQueue()
        self._run: Optional[_Run] = None
        self.broken = False
        self._thread = threading.Thread(target=self._serve, name="shmkv-load", daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        """A step's loads were started and not finished."""
        return self._run is not None

    def start(self, pool, loads) -> None:
        self._run = _Run(pool, loads, self._num_layers)
        self._jobs.put(self._run)

    def _serve(self) -> None:
        while True:
            run = self._jobs.get()
            if run is None:
                return
            try:
                self._copy(run)
            finally:
                for event in run.layers:  # nobody waits past the end, whatever happened
                    event.set()
                run.done.set()

    def _copy(self, run: _Run) -> None:
        for layer in range(self._num_layers):
            for i, (_, runs) in enumerate(run.loads):
                if run.stop.is_set():
                    return
                if i not in run.failed:
                    try:
                        # one thread: torch's parallel copy would wait on the forward's
                        self._copy_layer(run.pool, layer, runs, load=True, parallel=False)
                    except Exception as exc:  # noqa: BLE001 - reported by finish()
                        run.failed[i] = exc
            run.layers[layer].set()

    def wait(self, layer: int, timeout: float) -> bool:
        """Whether ``layer`` of every load was copied (or failed, or the step's loads were
        cancelled) within ``timeout``."""
        run = self._run
        return run is None or run.layers[layer].wait(timeout)

    def cancel(self) -> None:
        if self._run is not None:
            self._run.cancel()

    def finish(self) -> List[Tuple[Any, Optional[BaseException]]]:
        """Wait for the step's copies to end (within one copy of :meth:`cancel`: a copy is
        bounded by memory speed); each load with its failure, None where it was copied."""
        run, self._run = self._run, None
        if run is None:
            return []
        if not run.done.wait(LAYER_WAIT_S):
            run.cancel()
            if not run.done.wait(LAYER_WAIT_S):
                log.error(
                    "shmkv: a load still copies %.0f s after its step; loads are copied "
                    "before the forward from now on",
                    2 * LAYER_WAIT_S,
                )
                self.broken = True
        failed: Dict[int, BaseException] = {}
        if run.stop.is_set():
            stopped = ShmkvError("load stopped: a layer was not loaded in time")
            failed = {i: stopped for i in range(len(run.loads))}
        failed.update(dict(run.failed))
        return [(item, failed.get(i)) for i, (item, _) in enumerate(run.loads)]

    def close(self) -> None:
        """Stop the thread (after the copy under way, waiting for it at most
        ``LAYER_WAIT_S``; it is a daemon thread, so a stuck copy cannot hold up exit)."""
        self.cancel()
        self._jobs.put(None)
        self._thread.join(LAYER_WAIT_S)


class ShmkvConnectorWorker:
    """The connector's worker side (the facade :class:`ShmkvConnector` holds one in each
    of vLLM's workers): each hook is the facade's hook of the same name, and those that
    read the step's metadata take it as an argument (``None`` or another connector's:
    nothing to do).

    ``settings`` are the connector's (:func:`read_settings`). Connects at once, on the
    calling thread, before the model loads, so that a pool that does not fit is refused
    at start-up (:class:`ConnectorLayoutError`).
    """

    def __init__(self, vllm_config, settings: ConnectorSettings):
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        self._vllm_config = vllm_config
        self._layout = settings.layout
        self._layerwise_wanted = settings.layerwise
        self._block_size = settings.block_size
        self._tp_size = settings.tp_size
        self._tp_rank = get_tensor_model_parallel_rank() if self._tp_size > 1 else 0
        self._client: Optional[shmkv.Client] = None
        self._stats = ShmkvConnectorStats()
        self.totals = ShmkvConnectorStats()  # the same counts since the connector started
        self._k: List[torch.Tensor] = []
        self._v: List[torch.Tensor] = []
        self._shape: Tuple[int, int, Any] = (0, 0, None)  # heads, head size, dtype
        self._layer_index: Dict[str, int] = {}
        self._handles: Dict[str, Any] = {}
        self._peeks: Dict[str, Any] = {}  # this step's peeked loads, until checked
        self._load_errors: set = set()
        self._loader: Optional[_LayerLoader] = None
        # Whether vLLM calls wait_for_layer_load before every layer's attention here:
        # None until a forward shows it, False for good once one did not (loads are
        # then copied whole before the forward).
        self._layerwise: Optional[bool] = None
        self._waited: set = set()
        self._failed_reqs: set = set()  # requests whose load failed in this step
        # Requests whose load failed in a step that computed over it: nothing of them
        # is saved until they finish (a step scheduled before vLLM heard of the failure
        # still computes over the prefix that never loaded).
        self._poisoned: set = set()
        self._recving: set = set()  # asynchronous loads done, not yet reported
        self._reported: Optional[str] = None  # the instance last told the scheduler
        self._unreached = ""  # a coordinator the scheduler named that this one missed
        # Loads of this step that count as hits (rank 0 reports them: count_hits).
        self._hit_tokens = self._miss_tokens = 0
        self._dialer = Dialer(settings, self._tp_rank, settings.prefault, self._check_registered)
        # Connects before the model loads, so a misfit pool is refused at once. While idle
        # it connects on its own (a coordinator started, or restarted, after the engine):
        # connecting maps and prefaults the pool, which a first load would otherwise wait
        # for (up to CONNECT_WAIT_S), and miss on a busy host.
        client = self._dialer.connect_at_start()
        self._courier = _Courier(
            self._dialer.dial, settings.retry_s, client, "shmkv-worker", poll=True
        )

    @property
    def connected(self) -> bool:
        """Whether the last attempt to connect to the coordinator succeeded."""
        return self._dialer.connected

    def _connect(self):
        """The live client, or None while there is none (the courier then connects on its
        own thread). A new client drops the handles of the last."""
        client = self._courier.client
        if client is None or not client.is_alive():
            self._courier.kick()
            client = None
        if client is not self._client:
            self._client = client
            self._handles.clear()  # their coordinator is gone with them
        return client

    def _check_registered(self, cfg) -> None:
        """Refuse a pool that does not hold vLLM's registered K/V (none registered yet:
        nothing to check)."""
        if self._k:
            self._check_layers(cfg, *self._shape)

    def _check_layers(self, cfg, heads: int, head_dim: int, dtype) -> None:
        self._dialer.check_shape(
            cfg,
            dict(
                num_layers=len(self._k),
                kv_heads=heads * self._tp_size,
                head_dim=head_dim,
                dtype=str(dtype).replace("torch.", ""),
            ),
        )

    def register_kv_caches(self, kv_caches: Dict[str, torch.Tensor]):
        """Learn vLLM's paged K/V tensors (one per attention layer) and check them against
        the pool. Raises :class:`ConnectorConfigError` on a mismatch."""

        def index(name: str) -> int:
            found = re.findall(r"\.(\d+)\.", name)
            return int(found[-1]) if found else 0

        names = sorted(kv_caches, key=index)
        first = kv_caches[names[0]]
        layout = self._layout or detect_layout(first)
        kind = layout
        if layout == "cpu":  # its kernels' K/V order varies with the CPU: checked here
            isas = cpu_attn_isas(self._vllm_config, names, first)
            kind = f"cpu, {'/'.join(isas)} kernels"
            for isa in isas:
                model_dtype = self._vllm_config.model_config.dtype
                check_cpu_layout(
                    first,
                    isa,
                    str(self._vllm_config.cache_config.cache_dtype),
                    model_dtype if isinstance(model_dtype, torch.dtype) else None,
                )
        ks, vs = [], []
        for name in names:
            k, v = kv_views(kv_caches[name], layout)
            ks.append(k)
            vs.append(v)
        nb, heads, bs, head_dim = ks[0].shape
        if bs != self._block_size:
            raise ConnectorConfigError(
                f"vLLM's KV cache has blocks of {bs} tokens, its config says {self._block_size}"
            )
        # (the courier's thread may connect meanwhile and checks what is registered:
        # the shape first, then whole lists)
        self._layer_index = {name: i for i, name in enumerate(names)}
        self._shape = (heads, head_dim, first.dtype)
        self._k, self._v = ks, vs
        if first.device.type == "cpu" and self._layerwise_wanted and self._loader is None:
            self._loader = _LayerLoader(len(names), self._copy_layer)
        log.info(
            "shmkv: %d layers of %s K/V, %d heads x %d, blocks of %d (%s)",
            len(names),
            first.dtype,
            heads,
            head_dim,
            bs,
            kind,
        )
        client = self._connect()
        if client is not None:  # (else the courier checks the tensors when it connects)
            try:
                self._check_layers(client.config, *self._shape)
            except ConnectorConfigError:
                self._courier.close()
                raise

    def start_load_kv(self, meta) -> None:
        """Open this step's hand-offs and copy every hit block of the step into vLLM's
        blocks (see :func:`copy_runs`), all layers, before the forward. With
        ``"shmkv.layerwise"`` on the CPU, once a forward has shown that vLLM waits for
        every layer, the copies run layer by layer on a thread of their own while the
        forward computes, each layer's attention waiting in :meth:`wait_for_layer_load`
        for its own layer only. ``meta``: the step's :class:`ShmkvConnectorMetadata`."""
        self._finish_loads()  # (a step that raised before its wait_for_save)
        self._waited = set()
        self._failed_reqs = set()
        self._peeks = {}
        if not isinstance(meta, ShmkvConnectorMetadata):
            return
        for req_id in meta.closed:
            self._close(req_id)
        self._recving.update(meta.recv_dropped)
        if meta.coordinator and self._courier.instance != meta.coordinator:
            # The scheduler looked up in a coordinator this worker is not connected to (a
            # restarted one): connect before loading, or the loads would fail. One that
            # cannot be reached in time is reported (build_connector_worker_meta), and
            # the scheduler promises nothing more until this worker connects.
            got = self._courier.connect_now(CONNECT_WAIT_S)
            self._unreached = "" if got == meta.coordinator else meta.coordinator
            self._connect()
        loads: List[Tuple[ShmkvReqMeta, List[Tuple[int, int, int, int]]]] = []
        opened: List[Any] = []  # the handles and peeks of loads
        for item in meta.requests:
            self._miss_tokens += item.missed
            if item.source is not None and item.load != (0, 0) and not item.recv:
                source = self._peek(item)
                if source is None:
                    continue
            else:
                source = self._open(item)
                if item.recv:
                    self._load_received(item, source)
                    continue
                if item.load == (0, 0):
                    continue
                if source is None:
                    # (a hand-off that could not be opened was logged as such)
                    why = ShmkvError("no hand-off for this load") if item.tokens is None else None
                    self._fail_load(item, why)
                    continue
            try:
                loads.append((item, self._runs(source.block_table, item.block_ids, item.load)))
            except Exception as exc:  # noqa: BLE001 - a failed load is recomputed, never fatal
                self._fail_load(item, exc)
                continue
            opened.append(source)
        client = self._client
        if any(source.client is not client for source in opened):
            # The coordinator went away while this step's hand-offs were opened: its
            # handles (and pool) are not the client's now; every load of the step fails.
            gone = shmkv.CoordinatorGone("the coordinator went away within the step")
            for item, _ in loads:
                self._fail_load(item, gone)
            return
        if not loads or client is None:
            return
        pool = client.pool
        if self._loader is not None and self._layerwise:
            self._loader.start(pool, loads)
            return
        copied = []
        for item, runs in loads:
            try:
                for layer in range(len(self._k)):
                    self._copy_layer(pool, layer, runs, load=True)
            except Exception as exc:  # noqa: BLE001 - a failed load is recomputed, never fatal
                self._fail_load(item, exc)
                continue
            copied.append(item)
        if self._peeks and pool.device.type == "cuda":
            # The copies were only queued: a peeked sequence must outlive them, not the
            # queueing, before its check vouches for the bytes.
            torch.cuda.current_stream(pool.device).synchronize()
        for item in copied:
            try:
                self._check_peeked(item)
            except Exception as exc:  # noqa: BLE001 - a failed load is recomputed, never fatal
                self._fail_load(item, exc)
                continue
            self._count("num_loaded_tokens", item.load[1] - item.load[0])

    def _peek(self, item: ShmkvReqMeta):
        """The scheduler's sequence of ``item``'s load, read through its descriptor
        (:meth:`shmkv.Client.peek`), kept until the copies are checked; None, the load
        reported failed, when it cannot be read."""
        client = self._connect()
        if client is None:
            self._fail_load(item)
            return None
        try:
            peek = client.peek(item.source)
        except (ShmkvError, OSError) as exc:
            self._fail_load(item, exc)
            self._connect()  # (a coordinator found gone: the courier connects again)
            return None
        self._peeks[item.req_id] = peek
        return peek

    def _check_peeked(self, item: ShmkvReqMeta) -> None:
        """Raise unless the sequence a peeked load copied from outlived the copy, with
        the same blocks (else what was copied may be another sequence's bytes)."""
        peek = self._peeks.pop(item.req_id, None)
        if peek is not None:
            peek.check()

    def _load_received(self, item: ShmkvReqMeta, handle) -> None:
        """An asynchronous load whose tier copies are done: copy what arrived, all layers
        (vLLM does not schedule the request in this step), report the blocks that did not
        as load errors, and the request as received (:meth:`get_finished`)."""
        self._recving.add(item.req_id)
        self._count("num_async_loads", 1)
        start, end = item.load
        valid = end if item.valid is None else item.valid
        # (Not a failure of this step's requests: vLLM schedules this one later, with the
        # failed blocks recomputed, and its handle saves them then.)
        if valid < end:
            self._fail_load(
                replace(item, load=(valid, end)),
                ShmkvError(f"tier blocks from token {valid} on did not arrive"),
                in_step=False,
            )
        if valid <= start:
            return
        part = replace(item, load=(start, valid))
        client = self._client
        if handle is None or client is None or handle.client is not client:
            self._fail_load(part, in_step=False)
            return
        try:
            runs = self._runs(handle.block_table, item.block_ids, part.load)
            for layer in range(len(self._k)):
                self._copy_layer(client.pool, layer, runs, load=True)
        except Exception as exc:  # noqa: BLE001 - a failed load is recomputed, never fatal
            self._fail_load(part, exc, in_step=False)
            return
        self._count("num_loaded_tokens", valid - start)

    def get_finished(self, finished_req_ids):
        """The asynchronous loads handed over since the last call (copied, or failed and
        reported in :meth:`get_block_ids_with_load_errors`): vLLM schedules them now. No
        saves finish late (:meth:`wait_for_save` is synchronous)."""
        received, self._recving = self._recving, set()
        return None, (received or None)

    def _finish_loads(self) -> None:
        """Wait for the step's layer-by-layer loads (if any) to end and account for them:
        a load that failed, or that a layer's attention may have read before it was
        copied (vLLM did not wait for that layer), is reported as a load error."""
        loader = self._loader
        if loader is None or not loader.busy:
            return
        missed = len(self._waited) < len(self._k)
        if missed:
            log.warning(
                "shmkv: vLLM ran attention without waiting for the layer's load; this "
                "step's loads are recomputed and later loads copied before the forward"
            )
            self._layerwise = False
        results = loader.finish()
        if loader.broken:  # a run outlived its step: copy before the forward from now on
            self._layerwise = False
        for item, exc in results:
            if exc is None and not missed:
                try:
                    self._check_peeked(item)
                except Exception as err:  # noqa: BLE001 - a failed load is recomputed
                    exc = err
            if exc is None and not missed:
                self._count("num_loaded_tokens", item.load[1] - item.load[0])
            else:
                self._fail_load(item, exc or ShmkvError("a layer was read before its load"))

    def _runs(self, table, block_ids: List[int], span: Tuple[int, int]):
        """The merged copy runs (:func:`copy_runs`, :func:`merge_runs`) of tokens ``span``
        between the pool blocks of ``table`` (a :class:`shmkv.BlockTable`) and vLLM's
        blocks ``block_ids``."""
        bs = table.block_size
        runs = copy_runs(
            block_ids, list(table.physical_blocks), span[0], span[1], self._block_size, bs
        )
        return merge_runs(runs, self._block_size // bs)

    def _copy_layer(self, pool, layer: int, runs, load: bool, parallel: bool = True) -> None:
        """Copy ``runs`` (:meth:`_runs`) of one layer, K and V, between the pool and vLLM's
        blocks: one strided copy per run (:func:`assign`; ``parallel``: torch's threads
        may take the large ones), into the destination's own memory (no staging tensor,
        whose fresh pages cost more than the copy on the CPU)."""
        bs = pool.shape[3]
        per = self._block_size // bs
        for which, paged in enumerate((self._k[layer], self._v[layer])):
            pages = pool[:, layer, which]
            for vblock, sub, first, count in runs:
                ours = pages[first : first + count]
                if count > per:  # whole vLLM blocks vblock, vblock + 1, ...
                    n = count // per
                    # [n, heads, per * block, dim] -> [n, per, block, heads, dim]
                    theirs = (
                        paged[vblock : vblock + n].unflatten(2, (per, bs)).permute(0, 2, 3, 1, 4)
                    )
                    ours = ours.unflatten(0, (n, per))
                else:
                    # [heads, tokens, dim] -> [count, block, heads, dim], the pool's order
                    theirs = (
                        paged[vblock, :, sub * bs : (sub + count) * bs]
                        .unflatten(1, (count, bs))
                        .permute(1, 2, 0, 3)
                    )
                if load:
                    assign(theirs, ours, parallel)
                else:
                    assign(ours, theirs, parallel)

    def _open(self, item: ShmkvReqMeta):
        handle = self._handles.get(item.req_id)
        if handle is not None or item.tokens is None:
            return handle
        if item.req_id in self._poisoned:
            return None  # (saves nothing until it finishes: see wait_for_save)
        if not item.tokens:
            return None
        client = self._connect()
        if client is None:
            return None
        try:
            handle = client.open(item.tokens[self._tp_rank or 0])  # (a worker: set)
        except (ShmkvError, OSError, IndexError) as exc:
            log.warning("shmkv: hand-off of %s could not be opened (%s)", item.req_id, exc)
            self._connect()  # (a coordinator found gone: the courier connects again)
            return None
        self._handles[item.req_id] = handle
        return handle

    def _fail_load(
        self, item: ShmkvReqMeta, exc: Optional[BaseException] = None, in_step: bool = True
    ) -> None:
        """Report ``item``'s load as failed (vLLM recomputes its blocks; a request of this
        step's forward, ``in_step``, saves nothing of it); ``exc``, when given, is logged
        as why."""
        if exc is not None:
            log.warning("shmkv: load of %s failed (%s); vLLM recomputes", item.req_id, exc)
        if in_step:
            self._failed_reqs.add(item.req_id)
            self._poisoned.add(item.req_id)
        self._miss_tokens += max(0, item.load[1] - item.load[0])
        first = item.load[0] // self._block_size
        last = -(-item.load[1] // self._block_size)
        self._load_errors.update(item.block_ids[first:last])
        self._count("num_load_errors", 1)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Wait until this step's loads of layer ``layer_name`` are in vLLM's blocks (at
        most ``LAYER_WAIT_S``; past it the step's loads are stopped and recomputed)."""
        layer = self._layer_index.get(layer_name)
        if layer is None:
            return
        self._waited.add(layer)
        loader = self._loader
        if loader is not None and loader.busy and not loader.wait(layer, LAYER_WAIT_S):
            log.error(
                "shmkv: layer %s not loaded after %.0f s; stopping this step's loads "
                "(vLLM recomputes them)",
                layer_name,
                LAYER_WAIT_S,
            )
            loader.cancel()

    def wait_for_save(self, meta) -> None:
        """Copy this step's newly complete blocks into the pool and commit them (after
        the step's loads have ended); ``meta``: the step's :class:`ShmkvConnectorMetadata`."""
        self._finish_loads()
        if self._layerwise is None and self._k and len(self._waited) == len(self._k):
            self._layerwise = True  # vLLM waits for every layer: load layer by layer
        if not isinstance(meta, ShmkvConnectorMetadata):
            return
        for item in meta.requests:
            if item.req_id in self._poisoned:
                # Its attention read a prefix that was not loaded (in this step or one
                # before it): nothing computed for it may be published until it finishes
                # (vLLM recomputes it, uncached).
                self._drop_handle(item.req_id)
                if item.done:
                    self._close(item.req_id)
                continue
            handle = self._handles.get(item.req_id)
            if handle is not None and item.save != (0, 0):
                self._save(item, handle)
            if item.done:
                self._close(item.req_id)
        log_refused(self._client)

    def _save(self, item: ShmkvReqMeta, handle) -> None:
        # The saved range starts past the handle's cached prefix, at a block boundary: its
        # blocks are this sequence's own, uncommitted, shared with no one, so they are
        # written in place through the pool's views (no copy-on-write can be due).
        start, end = item.save
        try:
            if start < handle.num_cached_tokens or start % handle.block_table.block_size:
                raise ShmkvError(f"save of [{start}, {end}) would write the cached prefix")
            client = self._client
            if client is None or handle.client is not client:
                raise shmkv.CoordinatorGone("the coordinator went away since the hand-off")
            runs = self._runs(handle.block_table, item.block_ids, item.save)
            for layer in range(len(self._k)):
                self._copy_layer(client.pool, layer, runs, load=False)
            if client.pool.device.type == "cuda":
                # queued only: published blocks must hold their bytes before anyone
                # else may read them
                torch.cuda.current_stream(client.pool.device).synchronize()
            # Not waited for: the bytes are in the pool now (vLLM may reuse its blocks),
            # and a refused commit is only a later miss (logged by wait_for_save).
            handle.commit(end, wait=False, start=start)
        except Exception as exc:  # noqa: BLE001 - a failed save is a later miss
            log.warning("shmkv: save of %s failed (%s); not cached", item.req_id, exc)
            self._close(item.req_id)
            return
        self._count("num_saved_tokens", end - start)

    def _close(self, req_id: str) -> None:
        """The request is done with (finished, or all saved): drop its handle."""
        self._poisoned.discard(req_id)
        self._drop_handle(req_id)

    def _drop_handle(self, req_id: str) -> None:
        handle = self._handles.pop(req_id, None)
        if handle is not None:
            _release(handle)

    def get_block_ids_with_load_errors(self) -> set:
        """vLLM block ids whose load failed since the last call (vLLM recomputes them)."""
        self._finish_loads()
        errors, self._load_errors = self._load_errors, set()
        return errors

    def _count(self, name: str, num: int) -> None:
        self._stats.data[name] += num
        self.totals.data[name] += num
        if name == "num_loaded_tokens":
            self._hit_tokens += num

    def build_connector_worker_meta(self):
        """(Worker side, after each step.) Report to the coordinator what this step
        loaded and failed to load (rank 0 only, for the whole engine: its per-client
        counters), and to the scheduler which coordinator this rank is connected to,
        when that changed (:class:`ShmkvWorkerMetadata`)."""
        client = self._connect()
        counts = self._hit_tokens or self._miss_tokens
        if counts and not self._tp_rank and client is not None:
            try:
                client.count_hits(self._hit_tokens, self._miss_tokens)
            except (ShmkvError, OSError) as exc:
                log.debug("shmkv: hit counts not sent (%s)", exc)
        self._hit_tokens = self._miss_tokens = 0
        instance = client.instance if client is not None else ""
        if self._unreached and self._unreached != instance:
            instance = "!" + self._unreached
        if instance == self._reported:
            return None
        self._reported = instance
        return ShmkvWorkerMetadata({self._tp_rank or 0: instance})

    def get_kv_connector_stats(self):
        """Loaded and saved tokens and failed loads since the last call."""
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, ShmkvConnectorStats()
        return stats

    def shutdown(self) -> None:
        """Stop the load thread, close every handle and the client."""
        if self._loader is not None:
            self._loader.cancel()
            self._finish_loads()
            self._loader.close()
        for req_id in list(self._handles):
            self._close(req_id)
        # (closing the client drops every reference it still held, released or not)
        self._client = None
        self._courier.close()
