"""shmkv as a vLLM KV connector: prefix K/V shared across engines, restarts and nodes.

This module owns the adapter between vLLM's ``KVConnectorBase_V1`` (vLLM 0.32) and
shmkv's public client API. It does not own shmkv's pool, keys, tiers or store: the
coordinator does. Load it out of tree::

    KVTransferConfig(kv_connector="ShmkvConnector",
                     kv_connector_module_path="shmkv.integrations.vllm",
                     kv_role="kv_both",
                     kv_connector_extra_config={"shmkv.name": "lm"})  # or "shmkv.address"

How a request goes through it:

* **Scheduler side** (:meth:`ShmkvConnector.get_num_new_matched_tokens`): one
  ``client.allocate(prompt=...)`` over the prompt's full vLLM blocks, under a salt made of
  the model's identity (the checkpoint's content or ``"shmkv.model_id"``, the effective
  config, dtype, KV cache dtype, ``"shmkv.salt"``: ``shmkv.integrations.vllm_identity``),
  the request's LoRA adapter's content, its images and prompt embeddings, and its
  ``cache_salt``. It is asked on a thread of the scheduler's own (:class:`_Courier`),
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
* **Metadata** (:meth:`build_connector_meta`): per request and step, a few ints (which
  vLLM blocks, which token ranges to load and to save) and, for a load alone, the
  lookup handle's descriptor (``handle.descriptor()``: no request; the handle pins the
  blocks until the request finishes), or, the first time a request saves, one hand-off
  token per tensor-parallel rank (``handle.export``, made with the lookup). No round
  trip on vLLM's thread per step.
* **Worker side**: :meth:`start_load_kv` reads a load's pool blocks through the
  descriptor (``client.peek``: no round trip, no reference), or opens the hand-offs,
  and copies the hit blocks into vLLM's paged tensors before the forward (with
  ``"shmkv.layerwise"``, on the CPU, layer by layer on a thread of the worker's own, each
  layer's attention waiting for its layer in :meth:`wait_for_layer_load`); after the
  forward, :meth:`wait_for_save` copies the newly complete blocks into the pool and
  ``commit``s them (under tensor parallelism a block is published once every rank has
  committed its head shard). Copies go block to block, no Python loop per token: one
  strided copy per layer, K or V, and run of pool blocks that lie one after another in
  one vLLM block (:func:`copy_runs`). A load read
  through a descriptor counts only if the sequence was still alive with the same blocks
  after the copy (``peek.check()``); else it is a load error, recomputed.
* **Failures never crash the engine.** A hand-off that cannot be opened, a coordinator
  gone or restarted, a copy that raises: the blocks of that load are reported through
  :meth:`get_block_ids_with_load_errors` and vLLM recomputes them (the connector sets
  ``kv_load_failure_policy="recompute"`` unless ``"shmkv.on_load_error": "fail"``). A save
  that fails is dropped (a later miss, nothing worse). With no coordinator the scheduler
  answers "no hit" and tries to connect again after ``"shmkv.retry_s"`` seconds.

vLLM's paged K/V layouts, as :func:`kv_views` reads them: every one gives K and V views of
``[num_blocks, num_kv_heads, block_size, head_size]`` (block, head, token, dimension) whose
strides follow vLLM's order, so the copies through them leave the pool in its own layout
(``[block, layer, K|V, token, head, dim]``) whatever vLLM's, for every pool block size that
divides vLLM's block size:

* ``"cpu"``: the CPU back end's ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``:
  per (block, head), ``block_size * head_size`` K values, then as many V values. V is
  token-major (``[block_size, head_size]``), K dimension-major (``[head_size,
  block_size]``), as vLLM's vector kernels write them. vLLM picks its kernel path per CPU,
  dtype and shape; :meth:`ShmkvConnector.register_kv_caches` has vLLM's own write op place
  a probe on the path the engine uses and refuses one that keeps K/V otherwise
  (:func:`check_cpu_layout`: the AMX path's bfloat16 tiles, Arm's BFMMLA);
* ``"split"``: vLLM 0.32's standardized ``[num_blocks, num_kv_heads, block_size,
  2 * head_size]`` of FlashAttention on CUDA (any memory order of those dimensions), K and
  V side by side in the last dimension;
* ``"flash"``: the older FlashAttention ``[2, num_blocks, block_size, num_kv_heads,
  head_size]``.

Each is checked against vLLM's own writes and a reference forward
(``tests/test_vllm_oracle.py``).
"""

from __future__ import annotations

import logging
import queue
import re
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

import shmkv
from shmkv.errors import InvalidArgument, ShmkvError
from shmkv.integrations.vllm_identity import (
    key_tokens,
    model_identity,
    model_namespace as model_namespace,  # (public: re-exported)
    request_salt,
)
from shmkv.integrations.vllm_log import log_through_vllm
from shmkv.protocol import check_client_name

try:  # where each loaded token came from (vLLM 0.32)
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError:  # pragma: no cover
    CacheHitSource = None  # type: ignore[misc, assignment]

try:  # vLLM 0.32 has connector stats; older releases may not
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
except ImportError:  # pragma: no cover
    KVConnectorStats = object  # type: ignore[misc, assignment]  # (no stats before 0.32)

log = logging.getLogger("shmkv.vllm")

LAYOUTS = ("cpu", "split", "flash")
DEFAULT_RETRY_S = 1.0  # (a failed attempt on this host costs a connect() that fails at once)
# How long a lookup may take before it counts as a miss (its request waits for it, others
# are scheduled meanwhile), and the longest vLLM's scheduler thread waits for a hand-off
# made in a step (see _Courier).
DEFAULT_LOOKUP_TIMEOUT_S = 0.05
# The longest vLLM's scheduler thread waits for lookups' answers in one step: one not
# there by then is asked for again at the next step (vLLM schedules others meanwhile).
LOOKUP_WAIT_S = 0.002
# An unopened hand-off pins its blocks this long: the workers open a step's hand-offs
# when the step starts, well within it, unless their engine died (Ctrl-C of vllm serve).
HANDOFF_TTL_S = 10.0
# The longest a worker waits, before a step's loads, to connect to the coordinator the
# scheduler looked them up in (after a restart); a failure is reported to the scheduler.
CONNECT_WAIT_S = 2.0
# The client timeout (handshakes, and requests on the workers' own threads).
CLIENT_TIMEOUT_S = 10.0
LAYER_WAIT_S = 30.0  # the longest a layer's attention waits for its load before giving up
SETTLE_TIMEOUT_S = 60.0  # the longest an asynchronous load waits for a tier's copies


class ConnectorConfigError(shmkv.InvalidArgument):
    """The connector's configuration and the coordinator's pool do not fit together
    (block sizes, layers, heads, head size, dtype, or a missing address), or a
    ``kv_connector_extra_config`` key is unknown or has an invalid value."""


class ConnectorLayoutError(ConnectorConfigError, shmkv.LayoutMismatch):
    """The coordinator's pool is not laid out for this engine: its block size, tensor
    parallel size, layers, KV heads, head size or dtype."""


def expected_layout(vllm_config) -> Optional[Dict[str, Any]]:
    """The pool layout (layers, all ranks' KV heads, head size, dtype) the engine of
    ``vllm_config`` will register, as far as its model config tells (None when it does
    not: a model whose layers are not all plain attention; the workers' tensors are
    checked at registration anyway)."""
    mc, pc, cc = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    try:
        if getattr(mc, "is_hybrid", False) or getattr(mc, "is_attention_free", False):
            return None
        layers = mc.get_num_layers_by_block_type(pc, "attention")
        heads = mc.get_num_kv_heads(pc) * pc.tensor_parallel_size
        head_dim = mc.get_head_size()
        dtype = mc.dtype if cc.cache_dtype in ("auto", None) else None
    except Exception:  # noqa: BLE001 - an unusual model: checked at registration only
        return None
    if not isinstance(dtype, torch.dtype):
        return None  # a quantized KV cache: its storage dtype is the backend's
    return dict(
        num_layers=int(layers),
        kv_heads=int(heads),
        head_dim=int(head_dim),
        dtype=str(dtype).replace("torch.", ""),
    )


def lookup_name(name: str) -> str:
    """The client name of the scheduler's lookups: ``name`` and ``.lookup`` (``name``
    shortened to keep within the 64 characters of a client name)."""
    return name[: 64 - len(LOOKUP_SUFFIX)] + LOOKUP_SUFFIX


LOOKUP_SUFFIX = ".lookup"


def _text(key: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ConnectorConfigError(f"{key!r} must be a non-empty string, got {value!r}")
    return value


def _seconds(low: float, high: float) -> Callable[[str, Any], float]:
    def check(key: str, value: Any) -> float:
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not low <= float(value) <= high
        ):
            raise ConnectorConfigError(
                f"{key!r} must be a number of seconds in [{low:g}, {high:g}], got {value!r}"
            )
        return float(value)

    return check


def _choice(*allowed: str) -> Callable[[str, Any], str]:
    def check(key: str, value: Any) -> str:
        if value not in allowed:
            raise ConnectorConfigError(f"{key!r} must be one of {allowed}, got {value!r}")
        return value

    return check


def _boolean(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConnectorConfigError(f"{key!r} must be true or false, got {value!r}")
    return value


def _salt(key: str, value: Any) -> str:
    if not isinstance(value, str):
        raise ConnectorConfigError(f"{key!r} must be a string, got {value!r}")
    return value


# Every key the connector reads from ``kv_connector_extra_config``, with its check. Any
# other key is refused at start-up: a misspelled ``"shmkv.slat"`` would otherwise leave
# a tenant unsalted, sharing K/V with every unsalted engine.
SETTINGS: Dict[str, Callable[[str, Any], Any]] = {
    "shmkv.name": _text,
    "shmkv.address": _text,
    "shmkv.salt": _salt,
    "shmkv.model_id": _text,
    "shmkv.client_name": _text,
    "shmkv.retry_s": _seconds(0.0, 3600.0),
    "shmkv.lookup_timeout_s": _seconds(0.001, 60.0),
    "shmkv.handoff_ttl_s": _seconds(1.0, 3600.0),
    "shmkv.kv_layout": _choice(*LAYOUTS),
    "shmkv.on_load_error": _choice("recompute", "fail"),
    "shmkv.prefault": _boolean,
    "shmkv.layerwise": _boolean,
}


def check_settings(extra: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """``kv_connector_extra_config`` checked: every key known (:data:`SETTINGS`), every
    value of its kind and range; returns the checked values (numbers as floats).

    Raises:
        ConnectorConfigError: an unknown key (the message names the accepted ones), or
            an invalid value (the message says what is accepted).
    """
    extra = dict(extra or {})
    unknown = sorted(str(key) for key in extra if key not in SETTINGS)
    if unknown:
        raise ConnectorConfigError(
            f"unknown kv_connector_extra_config key(s) {unknown} for ShmkvConnector; "
            f"accepted: {sorted(SETTINGS)}"
        )
    return {key: SETTINGS[key](key, value) for key, value in extra.items()}


# -- layouts --------------------------------------------------------------------------------


def detect_layout(kv: torch.Tensor) -> str:
    """The name of vLLM's paged layout of one layer's cache tensor ``kv`` (see the module
    docstring): ``"flash"`` for a 5-dim tensor with 2 in front, ``"cpu"`` for a 4-dim CPU
    tensor, ``"split"`` for a 4-dim tensor on any other device."""
    if kv.dim() == 5 and kv.shape[0] == 2:
        return "flash"
    if kv.dim() == 4:
        return "cpu" if kv.device.type == "cpu" else "split"
    raise ConnectorConfigError(
        f"unknown vLLM KV cache layout: shape {tuple(kv.shape)}; set "
        f'"shmkv.kv_layout" to one of {LAYOUTS}'
    )


def kv_views(kv: torch.Tensor, layout: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """Zero-copy K and V views ``[num_blocks, num_kv_heads, block_size, head_size]`` of one
    layer's vLLM cache tensor in ``layout`` (``"cpu"``, ``"split"`` or ``"flash"``): element
    ``[b, h, t, d]`` is dimension ``d`` of head ``h`` of token ``t`` of block ``b``, wherever
    vLLM keeps it (the views' strides carry vLLM's order; for ``"cpu"`` see
    :func:`check_cpu_layout`).

    Raises:
        ConnectorConfigError: a tensor that does not have that layout.
    """
    if layout == "cpu":
        if kv.dim() != 4 or kv.shape[-1] % 2:
            raise ConnectorConfigError(
                f"a CPU KV cache is [blocks, heads, block_size, "
                f"2 * head_size], got {tuple(kv.shape)}"
            )
        nb, heads, bs, width = kv.shape
        # Per (block, head): block_size * head_size K values, then as many V values
        # (cpu_attn.py views the tensor [blocks, heads, 2 * block_size, head_size] and
        # chunks it). V is token-major; K is dimension-major, [head_size, block_size]
        # (the kernels' "column-major" K, csrc/cpu/cpu_attn_vec.hpp): its view is a
        # transpose, so every copy through it puts tokens where the pool wants them.
        both = kv.view(nb, heads, 2, bs * (width // 2))
        k = both[:, :, 0].unflatten(-1, (width // 2, bs)).transpose(2, 3)
        return k, both[:, :, 1].unflatten(-1, (bs, width // 2))
    if layout == "split":
        if kv.dim() != 4 or kv.shape[-1] % 2:
            raise ConnectorConfigError(
                f"a split KV cache is [blocks, heads, block_size, "
                f"2 * head_size], got {tuple(kv.shape)}"
            )
        half = kv.shape[-1] // 2
        return kv[..., :half], kv[..., half:]
    if layout == "flash":
        if kv.dim() != 5 or kv.shape[0] != 2:
            raise ConnectorConfigError(
                f"a FlashAttention KV cache is [2, blocks, block_size,"
                f" heads, head_size], got {tuple(kv.shape)}"
            )
        return kv[0].permute(0, 2, 1, 3), kv[1].permute(0, 2, 1, 3)
    raise ConnectorConfigError(f"shmkv.kv_layout must be one of {LAYOUTS}, got {layout!r}")


_FP8_CACHE = {"fp8_e5m2": "float8_e5m2"}  # other "fp8*" KV caches are e4m3 (uint8 on the CPU)


def check_cpu_layout(
    kv: torch.Tensor, isa: str, kv_cache_dtype: str = "auto", dtype: Optional[torch.dtype] = None
) -> None:
    """Check that vLLM's CPU attention on kernel path ``isa`` keeps K and V where
    :func:`kv_views` ``(kv, "cpu")`` reads them, by vLLM's own write op: it writes a probe
    of every (token, head, dim) of one block of ``kv``'s shape, ``dtype`` K/V (the model's;
    ``kv``'s own by default) into a ``kv_cache_dtype`` cache, and each value must land
    where the views put it.

    vLLM picks the path per CPU, model dtype, block size, head size and KV-cache dtype
    (``cpu_attn.py``'s ``_get_attn_isa``). Its vector paths (``"vec"``, ``"vec16"``, Arm's
    ``"neon"`` for float32 and float16) keep K dimension-major and V token-major; its AMX
    path (``"amx"``, bfloat16 on CPUs with AMX tiles) and Arm's bfloat16 BFMMLA kernels
    pack them for their tiles, which the connector does not copy.

    Raises:
        ConnectorConfigError: K/V kept otherwise (the message says what to change), or
            vLLM's op cannot write the probe.
    """
    try:
        from vllm import _custom_ops as ops

        write = ops.cpu_attn_reshape_and_cache
    except (ImportError, AttributeError) as exc:
        raise ConnectorConfigError(
            f"cannot check vLLM's CPU KV cache layout without its CPU ops ({exc}); set "
            '"shmkv.kv_layout" to the layout of your back end'
        ) from None
    heads, bs, width = min(kv.shape[1], 2), kv.shape[2], kv.shape[3]  # (2 heads show their order)
    quantized = kv_cache_dtype.startswith("fp8")
    src_dtype = (dtype or torch.bfloat16) if quantized else kv.dtype
    stored = getattr(torch, _FP8_CACHE.get(kv_cache_dtype, "float8_e4m3fn")) if quantized else None
    scratch = torch.zeros((1, heads, bs, width), dtype=kv.dtype)
    k_cache, v_cache = scratch.view(1, heads, 2 * bs, width // 2).chunk(2, dim=2)
    # Each pass writes one base-4 digit of every value's index, as 1..4 (exact in every
    # dtype down to fp8): where a value lands is read back digit by digit.
    index = torch.arange(bs * heads * (width // 2)).view(bs, heads, width // 2)
    landed = torch.zeros(scratch.numel(), dtype=torch.int64)
    for power in range(max(1, ((index.numel() - 1).bit_length() + 1) // 2)):
        digits = (((index >> (2 * power)) & 3) + 1).to(src_dtype)
        scratch.zero_()
        try:
            write(
                digits,
                digits,
                k_cache,
                v_cache,
                torch.arange(bs),
                isa,
                kv_cache_dtype=kv_cache_dtype,
            )
        except (RuntimeError, NotImplementedError) as exc:
            raise ConnectorConfigError(
                f"vLLM's CPU attention ({isa}) cannot write a {kv_cache_dtype} KV cache of "
                f"{tuple(kv.shape)} here ({exc})"
            ) from None
        got = (scratch if stored is None else scratch.view(stored)).float().flatten().round().long()
        landed += (got - 1).clamp(0, 3) << (2 * power)
    landed[got == 0] = -1  # (written nowhere: every pass writes 1..4)
    positions = torch.arange(scratch.numel()).view(scratch.shape)
    for name, view in zip("KV", kv_views(positions, "cpu")):
        # view[0, h, t, d]: where the connector reads (t, h, d); it must hold (t, h, d)
        if not torch.equal(landed[view[0]], index.permute(1, 0, 2)):
            raise ConnectorConfigError(
                f"vLLM's CPU attention on its {isa!r} path keeps {name} of a "
                f"{src_dtype} model ({kv_cache_dtype} KV cache) in a layout the connector "
                "does not copy (packed for its kernels' tiles), so it would store wrong "
                "K/V: run the model in float16 or float32 (vLLM's vector paths), or "
                "without the connector"
            )


def cpu_attn_isas(vllm_config, layer_names: List[str], kv: torch.Tensor) -> List[str]:
    """The kernel paths vLLM's CPU attention takes for ``layer_names`` (caches like
    ``kv``): the ``isa`` its metadata builders set on the layers before the caches are
    registered, else the path vLLM picks for the model's dtype, block and head size and
    KV-cache dtype on this CPU."""
    context = vllm_config.compilation_config.static_forward_context
    found = {str(isa) for isa in (getattr(context.get(n), "isa", None) for n in layer_names) if isa}
    if found:
        return sorted(found)
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except ImportError as exc:
        raise ConnectorConfigError(
            f"cannot tell which kernel path vLLM's CPU attention takes ({exc}), so not "
            "where it keeps K and V: this vLLM is not one the connector supports"
        ) from None
    return [
        _get_attn_isa(
            vllm_config.model_config.dtype,
            kv.shape[2],
            kv.shape[3] // 2,
            vllm_config.cache_config.cache_dtype,
        )
    ]


def copy_runs(
    block_ids: List[int],
    table: List[int],
    start: int,
    end: int,
    vllm_block_size: int,
    pool_block_size: int,
) -> List[Tuple[int, int, int, int]]:
    """The copies that move tokens ``[start, end)`` of one request (multiples of
    ``pool_block_size``) between vLLM's blocks ``block_ids`` and the pool blocks ``table``
    (the handle's block table): ``(vllm_block, first_sub_block, first_pool_block, count)``
    runs, each ``count`` pool blocks that lie one after another both in one vLLM block
    and in the pool, so each run is one strided copy per layer for K and one for V (one
    run per vLLM block when the pool handed out consecutive blocks, as it does to a fresh
    sequence).

    Raises:
        IndexError: a range past the request's blocks or past the table.
    """
    per = vllm_block_size // pool_block_size
    first, last = start // pool_block_size, end // pool_block_size
    if last > len(table) or (last - 1) // per >= len(block_ids):
        raise IndexError(f"tokens [{start}, {end}) lie past the request's blocks")
    runs: List[Tuple[int, int, int, int]] = []
    for j in range(first, last):
        vblock, sub, pool = block_ids[j // per], j % per, table[j]
        if runs:
            rv, rs, rp, rc = runs[-1]
            if rv == vblock and rs + rc == sub and rp + rc == pool:
                runs[-1] = (rv, rs, rp, rc + 1)
                continue
        runs.append((vblock, sub, pool, 1))
    return runs


_SAME_WIDTH_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
SERIAL_COPY_BYTES = 1 << 20  # CPU copies under this many bytes go through numpy


def assign(dst: torch.Tensor, src: torch.Tensor, parallel: bool = True) -> None:
    """``dst.copy_(src)`` for two views of one dtype and shape. On the CPU, a copy under
    ``SERIAL_COPY_BYTES`` (or any, when not ``parallel``) is a byte copy through numpy:
    one thread, the GIL released, no OpenMP team to wake (a 1k-token hit, 4 layers of
    458 KB K and V copies into cold blocks: 0.56 ms, against 0.80 ms for torch's
    parallel copy of the same strided views); larger ones are torch's, whose threads
    then pay (an 8k-token hit: 3.2 ms, against 5.5 ms for one thread). Elsewhere torch's
    copy, queued on the current stream. (Those figures predate the CPU layout's K views
    as the transpose they are, :func:`kv_views`: a K copy now gathers across
    ``block_size``-strided rows, several times the time of a V copy of as many bytes.)"""
    width = _SAME_WIDTH_INT.get(dst.element_size())
    if (
        width is not None
        and dst.device.type == "cpu"
        and src.device.type == "cpu"
        and (not parallel or dst.numel() * dst.element_size() < SERIAL_COPY_BYTES)
    ):
        np.copyto(dst.view(width).numpy(), src.view(width).numpy())
    else:
        dst.copy_(src)


def _release(handle) -> None:
    """Drop a reference without waiting for the answer (the coordinator serves it before
    the client's next request; nothing here needs the blocks afterwards)."""
    try:
        handle.client.close_many([handle], wait=False)
    except (ShmkvError, OSError):
        pass  # a coordinator gone: its references went with it


def merge_runs(runs: List[Tuple[int, int, int, int]], per: int) -> List[Tuple[int, int, int, int]]:
    """:func:`copy_runs` with the runs of whole vLLM blocks that follow one another both
    in vLLM's blocks and in the pool merged: a run of ``count > per`` pool blocks (``per``
    to a vLLM block) covers ``count // per`` whole vLLM blocks from ``vllm_block`` on,
    one strided copy per layer for K and one for V however many blocks it covers (a
    fresh engine and a fresh sequence get consecutive blocks: one copy per layer)."""
    out: List[Tuple[int, int, int, int]] = []
    for run in runs:
        vblock, sub, pool, count = run
        if out and sub == 0 and count == per:
            last_v, last_sub, last_pool, last_count = out[-1]
            if (
                last_sub == 0
                and last_count % per == 0
                and last_v + last_count // per == vblock
                and last_pool + last_count == pool
            ):
                out[-1] = (last_v, 0, last_pool, last_count + per)
                continue
        out.append(run)
    return out


def tp_shard_heads(num_kv_heads: int, tp_rank: int, tp_size: int) -> range:
    """The K/V heads vLLM's tensor-parallel rank ``tp_rank`` of ``tp_size`` holds: a
    contiguous slice, the same slice shmkv's head shard ``tp_rank`` maps."""
    if num_kv_heads % tp_size:
        raise ConnectorConfigError(f"{num_kv_heads} KV heads do not split over {tp_size} ranks")
    per = num_kv_heads // tp_size
    return range(tp_rank * per, (tp_rank + 1) * per)


# -- metadata -------------------------------------------------------------------------------


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


# -- scheduler state ------------------------------------------------------------------------


@dataclass
class _SchedReq:
    handle: Any  # the scheduler's reference (pins the hit blocks until they are loaded)
    prompt_tokens: int  # tokens the handle covers (the prompt's full vLLM blocks)
    hit: int  # loadable tokens in shmkv, whole vLLM blocks
    cached: int  # the handle's num_cached_tokens (pool blocks)
    block_ids: List[int] = field(default_factory=list)
    load: Tuple[int, int] = (0, 0)
    saved: int = 0  # tokens [0, saved) are in the pool or sent to be saved
    exported: bool = False
    # The workers read a load through the handle's descriptor: the handle stays until the
    # request finishes (request_finished), however early the lookup is done with.
    peeked: bool = False
    # A tier still copies part of the hit into the pool (the allocate answered early):
    # vLLM is told the load is asynchronous, and the workers get it once it settled.
    pending: bool = False
    told_async: bool = False  # the last answer to vLLM said the load is asynchronous
    ticket: int = 0  # the pending wait's (``_Settler``)
    resident: int = 0  # leading hit tokens in the pool at the lookup, whole vLLM blocks
    sure: int = 0  # leading hit tokens in the pool or this host's tiers, whole vLLM blocks
    cap: int = 0  # the most tokens shmkv could give (the prompt less its last token)
    local: int = 0  # tokens vLLM's own prefix cache had when it last asked
    missed: int = 0  # tokens asked for and not found, for the workers to report
    # The workers' hand-offs, made with the lookup (a request that saves needs them in its
    # first step; made then, they would cost vLLM's thread a round trip), and when.
    tokens: Optional[List[bytes]] = None
    tokens_at: float = 0.0


class _Asked(NamedTuple):
    """A lookup asked of the courier and not answered yet."""

    job: "_Job"
    full: int  # the prompt's tokens in whole vLLM blocks (what the lookup asks for)
    prompt_len: int


def client_name(given: Optional[str], engine_id: Optional[str]) -> str:
    """The name this engine's clients give the coordinator (its ``/metrics`` count hits
    by it): ``shmkv.client_name`` if set, else ``vllm-ENGINE_ID`` made a valid name
    (vLLM's ``kv_transfer_config.engine_id``; set it for a name that survives restarts).

    Raises:
        ConnectorConfigError: ``shmkv.client_name`` is not a valid client name.
    """
    if given is not None:
        try:
            return check_client_name(given)
        except InvalidArgument as exc:
            raise ConnectorConfigError(f"shmkv.client_name: {exc}") from None
    name = re.sub(r"[^A-Za-z0-9_.:/-]", "_", f"vllm-{engine_id or 'engine'}")
    return name[:64]


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


class _Settler:
    """Waits, on a daemon thread and a connection of its own, for the tier copies of the
    scheduler's lookups that were answered early (``allocate(..., wait=False)``), so the
    scheduler keeps scheduling meanwhile. ``submit`` takes a hand-off token of the
    lookup's sequence and returns a ticket; the thread opens the token, waits in
    ``settle`` and drops its reference; ``take(ticket)`` gives the hit then: the
    sequence's ``num_cached_tokens``, or None when the wait failed (the coordinator gone,
    or the copies not done ``SETTLE_TIMEOUT_S`` after the lookup: the load then takes
    only what was in the pool). One wait at a time: one queued behind a stuck one gives
    up as soon as it is its turn past its own time, so every lookup's wait ends within
    ``2 * SETTLE_TIMEOUT_S``."""

    def __init__(self, address: str, name: str):
        self._address = address
        self._name = name
        self._jobs: "queue.SimpleQueue[Optional[Tuple[int, bytes, float]]]" = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._next = 0
        self._wanted: set = set()
        self._done: Dict[int, Optional[int]] = {}
        self._stopped = False
        self._client: Optional[shmkv.Client] = None
        self._thread = threading.Thread(target=self._serve, name="shmkv-settle", daemon=True)
        self._thread.start()

    def submit(self, token: bytes) -> int:
        """Wait for the sequence of hand-off ``token``; the ticket to :meth:`take`."""
        with self._lock:
            self._next += 1
            ticket = self._next
            self._wanted.add(ticket)
        self._jobs.put((ticket, token, time.monotonic() + SETTLE_TIMEOUT_S))
        return ticket

    def take(self, ticket: int) -> Tuple[bool, Optional[int]]:
        """``(True, hit or None)`` once the wait of ``ticket`` ended (given once), else
        ``(False, None)``."""
        with self._lock:
            if ticket in self._done:
                self._wanted.discard(ticket)
                return True, self._done.pop(ticket)
        return False, None

    def forget(self, ticket: int) -> None:
        """Nobody takes ``ticket`` now: its answer, when it comes, is dropped."""
        with self._lock:
            self._wanted.discard(ticket)
            self._done.pop(ticket, None)

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None or self._stopped:
                break
            ticket, token, deadline = job
            with self._lock:
                wanted = ticket in self._wanted
            hit = self._settle(token, deadline, wanted)
            with self._lock:
                if ticket in self._wanted:
                    self._done[ticket] = hit
        if self._client is not None:
            self._client.close()

    def _settle(self, token: bytes, deadline: float, wanted: bool = True) -> Optional[int]:
        """The settled hit of hand-off ``token``'s sequence, or None. Not ``wanted`` (or
        past ``deadline``) it only opens and drops the hand-off, which would otherwise
        hold the sequence until it expires."""
        late = time.monotonic() >= deadline
        if late and wanted:
            log.warning(
                "shmkv: tier copies not done in %.0f s; loaded as far as in the pool",
                SETTLE_TIMEOUT_S,
            )
        try:
            client = self._client
            if client is None or not client.is_alive():
                if client is not None:
                    client.close()
                client = self._client = shmkv.connect(
                    self._address, timeout=SETTLE_TIMEOUT_S, name=self._name
                )
            handle = client.open(token)
            try:
                return handle.settle() if wanted and not late else None
            finally:
                _release(handle)
        except Exception as exc:  # noqa: BLE001 - a failed wait is a shorter load
            log.warning("shmkv: waiting for tier copies failed (%s)", exc)
            return None

    def close(self) -> None:
        """Stop after the wait under way (its thread is a daemon: a stuck wait cannot
        hold up exit); queued waits are dropped."""
        self._stopped = True
        self._jobs.put(None)
        self._thread.join(1.0)


class _Late(ShmkvError):
    """The coordinator did not answer within the caller's time (counted as a miss)."""


class _NotYet(Exception):
    """A request queued for the courier has no answer yet (:meth:`_Courier.take`)."""


class _Job:
    __slots__ = ("fn", "abandon", "done", "lock", "late", "started", "result", "error")

    def __init__(self, fn: Callable[[Any], Any], abandon: Optional[Callable[[Any], None]]):
        self.fn, self.abandon = fn, abandon
        self.done = threading.Event()
        self.lock = threading.Lock()
        self.late = False  # given up by its caller: its result goes to ``abandon``
        self.started: Optional[float] = None  # when the thread began it (monotonic)
        self.result: Any = None
        self.error: Optional[BaseException] = None


class _Courier:
    """One connection to the coordinator, used only from a daemon thread of its own, so
    that none of vLLM's threads ever waits on the socket or on a handshake.

    :meth:`call` hands the thread a request (a function of the client) and waits at most
    ``timeout`` for its answer (the scheduler's ``"shmkv.lookup_timeout_s"``, tens of
    ms): a later answer is a miss, and what it made (a lookup's handle) goes to
    ``abandon`` on the thread (which releases it). While a request is outstanding past
    that time (a coordinator that stopped answering), further calls give up at once
    (:meth:`stuck`), so requests with nothing to look up never queue behind it.
    :meth:`post` queues a request nobody waits for (releases, counts, a connect).

    The thread (re)connects before a request when it has no live client: at once after a
    client was found gone (a restarted coordinator serves the next lookup), and
    ``retry_s`` after a failed attempt; with ``poll``, also on its own while it has none
    (every ``retry_s``, at least ``MIN_POLL_S``), so that a coordinator started after the
    engine serves its first request, and it checks a live client as often while idle, so
    that one restarted while no request came is connected before the next one. ``client``
    is the live client or None (read from any thread; only the courier's thread sets it);
    ``instance``, its coordinator's.
    """

    MIN_POLL_S = 0.1

    def __init__(
        self,
        dial: Callable[[], Any],
        retry_s: float,
        client=None,
        name: str = "shmkv-courier",
        poll: bool = False,
    ):
        self._dial = dial
        self._retry_s = retry_s
        self._poll = poll
        self.client = client
        self._down_until = 0.0
        self._jobs: "queue.Queue[Optional[_Job]]" = queue.Queue()
        self._busy_since: Optional[float] = None
        self._kicked = False
        self._closing = False
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    @property
    def instance(self) -> Optional[str]:
        """The instance id of the coordinator the live client is connected to, or None."""
        client = self.client
        return client.instance if client is not None and client.is_alive() else None

    def stuck(self, timeout: float) -> bool:
        """Whether a request has been under way for longer than ``timeout``."""
        since = self._busy_since
        return since is not None and time.monotonic() - since > timeout

    def call(
        self,
        fn: Callable[[Any], Any],
        timeout: float,
        abandon: Optional[Callable[[Any], None]] = None,
    ) -> Any:
        """``fn(client)`` on the thread; its result within ``timeout`` seconds.

        Raises:
            _Late: no answer in time (or an earlier request is still under way past it).
            shmkv.CoordinatorGone: no coordinator to ask (connecting failed).
            Exception: what ``fn`` raised.
        """
        job = self.submit(fn, timeout, abandon)
        try:
            return self.take(job, timeout)
        except _NotYet:
            if self.abandon(job):
                return self.take(job, 0)  # (answered as it was given up)
            raise _Late(f"no answer within {timeout * 1000:.0f} ms") from None

    def submit(
        self,
        fn: Callable[[Any], Any],
        timeout: float,
        abandon: Optional[Callable[[Any], None]] = None,
    ) -> _Job:
        """Queue ``fn(client)`` for the thread; :meth:`take` its answer, or
        :meth:`abandon` it (then ``abandon(result)`` runs on the thread once it is made).

        Raises:
            _Late: an earlier request is still under way ``timeout`` after it began (a
                coordinator that stopped answering): nothing is queued.
        """
        if self.stuck(timeout):
            raise _Late("the coordinator has not answered an earlier request")
        job = _Job(fn, abandon)
        self._jobs.put(job)
        return job

    @staticmethod
    def take(job: _Job, wait: float) -> Any:
        """The answer of ``job`` (waiting at most ``wait`` seconds for it).

        Raises:
            _NotYet: not answered yet.
            Exception: what the request raised.
        """
        if not job.done.wait(wait):
            raise _NotYet()
        if job.error is not None:
            raise job.error
        return job.result

    @staticmethod
    def abandon(job: _Job) -> bool:
        """Nobody takes ``job``'s answer: what it makes goes to its ``abandon`` on the
        thread. False when that is so; True when it was answered already (the caller
        takes it, and disposes of it)."""
        with job.lock:
            if job.done.is_set():
                return True
            job.late = True
            return False

    def post(self, fn: Callable[[Any], Any]) -> None:
        """``fn(client)`` on the thread, in order with the other requests, not waited
        for (a failure is logged at debug level: releases of a gone coordinator's
        references, say, which went with it)."""
        self._jobs.put(_Job(fn, None))

    def kick(self) -> None:
        """Connect now if there is no live client (once per kick until it is tried)."""
        if not self._kicked and self.instance is None:
            self._kicked = True
            self._jobs.put(_Job(lambda client: None, None))

    def connect_now(self, timeout: float) -> Optional[str]:
        """Connect unless connected (waiting at most ``timeout``); the coordinator's
        instance id, or None when there is none (the attempt may go on after the wait)."""
        if self.instance is None:
            try:
                self.call(lambda client: None, timeout)
            except (ShmkvError, OSError):
                return None
        return self.instance

    def close(self, timeout: float = 1.0) -> None:
        """Stop after the queued requests (at most ``timeout`` seconds; the thread is a
        daemon, so a stuck request cannot hold up exit) and close the client; a thread
        still stuck then makes no new connection, and closes the client when it ends."""
        self._closing = True
        self._jobs.put(None)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            client, self.client = self.client, None
            if client is not None:
                _quietly_close(client)

    def _serve(self) -> None:
        while True:
            try:
                job = self._jobs.get(timeout=self._idle_wait())
            except queue.Empty:  # (polling: time to try connecting again)
                self._busy_since = time.monotonic()  # (a handshake that hangs is stuck too)
                try:
                    self._live()
                except Exception:  # noqa: BLE001 - logged by the dial; tried again later
                    pass
                finally:
                    self._busy_since = None
                continue
            if job is None:
                client, self.client = self.client, None
                if client is not None:
                    _quietly_close(client)
                return
            with job.lock:
                if job.late:  # given up before it began (a lookup past its time): skipped
                    continue
                job.started = self._busy_since = time.monotonic()
            result: Any = None
            error: Optional[BaseException] = None
            try:
                self._kicked = False
                result = job.fn(self._live())
            except Exception as exc:  # noqa: BLE001 - handed to the caller
                error = exc
            finally:
                self._busy_since = None
            with job.lock:
                if not job.late:
                    job.result, job.error = result, error
                    job.done.set()
                    continue
            if error is None and job.abandon is not None:
                try:
                    job.abandon(result)
                except Exception as exc:  # noqa: BLE001 - a late answer's leftovers
                    log.debug("shmkv: dropping a late answer failed (%s)", exc)
            elif error is not None:
                log.debug("shmkv: a request nobody waits for failed (%s)", error)

    def _idle_wait(self) -> Optional[float]:
        """How long the idle thread waits for a request before it checks its connection
        on its own, connecting when there is none (None: not before a request, when not
        polling). Connected, it looks every ``retry_s`` (a coordinator that went away
        while the engine was idle is replaced before the next request, which then hits).
        """
        if not self._poll:
            return None
        if self.instance is not None:
            return max(self._retry_s, self.MIN_POLL_S)
        return max(self._down_until - time.monotonic(), self.MIN_POLL_S)

    def _live(self):
        client = self.client
        if client is not None and client.is_alive():
            return client
        if client is not None:
            self.client = None
            _quietly_close(client)
            self._down_until = 0.0  # gone: the next coordinator is asked for at once
            log.warning(
                "shmkv: the coordinator at %s went away; connecting again", _address_of(client)
            )
        if self._closing:
            raise shmkv.CoordinatorGone("the connector is shutting down")
        if time.monotonic() < self._down_until:
            raise shmkv.CoordinatorGone("no coordinator connected (retrying later)")
        try:
            client = self._dial()
        except Exception:
            self._down_until = time.monotonic() + self._retry_s
            raise
        self.client = client
        return client


def _drop_tokens(client, tokens: List[bytes]) -> None:
    """Open and drop hand-offs nobody will open (each would pin its blocks until it
    expires); on the courier's thread."""
    for token in tokens:
        try:
            _release(client.open(token))
        except (ShmkvError, OSError):
            pass  # expired, or its coordinator gone: it pins nothing


def _release_found(found: Tuple[Any, Any, Any, float]) -> None:
    """Release what a lookup nobody took made: its handle and hand-offs (none when the
    lookup was not made)."""
    handle, settle, tokens, _made_at = found
    if handle is not None:
        _drop_tokens(handle.client, ([settle] if settle else []) + (tokens or []))
        _release(handle)


def _quietly_close(client) -> None:
    try:
        client.close()
    except Exception:  # noqa: BLE001 - a dead coordinator's client closes as it can
        pass


def _address_of(client) -> str:
    return str(getattr(client, "address", "?"))


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


class ShmkvConnector(KVConnectorBase_V1):
    """vLLM KV connector over a shmkv coordinator (see the module docstring).

    ``kv_connector_extra_config`` keys (any other is refused, :func:`check_settings`):
    ``"shmkv.name"`` or ``"shmkv.address"`` (which coordinator), ``"shmkv.salt"`` (a
    namespace of your own), ``"shmkv.model_id"`` (the checkpoint's identity, instead of a
    digest of its files), ``"shmkv.client_name"`` (the engine's name in the coordinator's
    metrics), ``"shmkv.retry_s"`` (seconds between failed attempts to connect, default
    1), ``"shmkv.lookup_timeout_s"`` (how long a lookup may take before it is a miss,
    default 0.05), ``"shmkv.handoff_ttl_s"`` (how long a hand-off nobody
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

    Raises (at start-up):
        ConnectorConfigError: no address; an unknown key or an invalid value; pipeline
            parallelism; a CPU attention path whose K/V layout the connector does not copy.
        ConnectorLayoutError: (also a ``shmkv.LayoutMismatch``) a pool block size that
            does not divide vLLM's block size; a pool of another tensor-parallel size; a
            pool whose layers, heads, head size or dtype differ from the model's K/V (the
            message says what to set).
    """

    def __init__(self, vllm_config, role, kv_cache_config=None):
        log_through_vllm()  # "shmkv: ..." lines in vLLM's log (vllm serve's processes)
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = check_settings(self._kv_transfer_config.kv_connector_extra_config)
        if "shmkv.address" in extra and "shmkv.name" in extra:
            raise ConnectorConfigError(
                'give "shmkv.name" or "shmkv.address" in kv_connector_extra_config, not both'
            )
        self._address = extra.get("shmkv.address")
        if self._address is None and "shmkv.name" in extra:
            self._address = shmkv.default_address(extra["shmkv.name"])
        if self._address is None:
            raise ConnectorConfigError(
                'ShmkvConnector needs kv_connector_extra_config={"shmkv.name": NAME} or '
                '{"shmkv.address": PATH}: the coordinator to use (shmkv serve --name NAME)'
            )
        self._address = str(self._address)
        pp_size = vllm_config.parallel_config.pipeline_parallel_size
        if pp_size > 1:
            # Each stage holds only its own layers, and would need its own layer offset,
            # hand-off and commit; until then, refused before any stage maps a layer.
            raise ConnectorConfigError(
                f"ShmkvConnector does not support pipeline parallelism "
                f"(pipeline_parallel_size={pp_size}); run with pipeline_parallel_size=1 "
                f"(tensor parallelism is supported)"
            )
        self._retry_s = extra.get("shmkv.retry_s", DEFAULT_RETRY_S)
        self._lookup_timeout_s = extra.get("shmkv.lookup_timeout_s", DEFAULT_LOOKUP_TIMEOUT_S)
        self._handoff_ttl_s = extra.get("shmkv.handoff_ttl_s", HANDOFF_TTL_S)
        self._client_name = client_name(
            extra.get("shmkv.client_name"), self._kv_transfer_config.engine_id
        )
        if role == KVConnectorRole.SCHEDULER:
            # The scheduler's lookups count apart, under NAME.lookup (what they found);
            # NAME counts what the engine loaded and computed (count_hits, rank 0).
            self._client_name = lookup_name(self._client_name)
        self._layout = extra.get("shmkv.kv_layout")
        self._prefault = extra.get("shmkv.prefault", True)
        self._layerwise_wanted = extra.get("shmkv.layerwise", False)
        self._block_size = vllm_config.cache_config.block_size
        self._tp_size = vllm_config.parallel_config.tensor_parallel_size
        self._expected = expected_layout(vllm_config)
        identity = model_identity(
            vllm_config, extra.get("shmkv.salt", ""), extra.get("shmkv.model_id")
        )
        self._namespace = identity.namespace
        log.info("shmkv: prefix keys under namespace %s", identity.describe())
        self._client: Optional[shmkv.Client] = None
        self.connected = False  # the last connection attempt's outcome (logged on change)
        self._tried = False  # (the first failed attempt is logged as a warning)
        self._refused = ""  # why the last pool was refused (logged once per reason)
        self._stats = ShmkvConnectorStats()
        self.totals = ShmkvConnectorStats()  # the same counts since the connector started
        if role == KVConnectorRole.SCHEDULER:
            if extra.get("shmkv.on_load_error", "recompute") == "recompute":
                # A cache is best effort: a lost block is recomputed, never fatal.
                self._kv_transfer_config.kv_load_failure_policy = "recompute"
            self._reqs: Dict[str, _SchedReq] = {}
            # lookups asked of the courier, not answered yet: (job, when it is a miss)
            self._asking: Dict[str, _Asked] = {}
            self._lookup_waited = False  # a lookup waited for its answer in this step
            # lookups done with whose descriptors the workers read: released when the
            # request finishes (see _finish)
            self._pins: Dict[str, List[Any]] = {}
            self._closed: List[str] = []
            self._recv_dropped: List[str] = []
            # requests vLLM admitted as asynchronous loads, not handed to the workers yet
            self._waiting: Dict[str, _SchedReq] = {}
            self._settler: Optional[_Settler] = None  # made by the first early answer
            self._tp_rank: Optional[int] = None
            client = self._connect_at_start()  # refuses a misfit pool now, when it is up
            self._courier = _Courier(
                self._dial, self._retry_s, client, "shmkv-scheduler", poll=True
            )
            self._pool_is_cuda = client is not None and client.config.is_cuda
            # What each worker rank last reported (ShmkvWorkerMetadata): the instance id of
            # the coordinator it is connected to, or "!" and the one it failed to reach.
            self._worker_reports: Dict[int, str] = {}
            self._gate_logged = False
            self.num_late_lookups = 0  # lookups not answered in time (counted as misses)
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self._tp_rank = get_tensor_model_parallel_rank() if self._tp_size > 1 else 0
            self._k: List[torch.Tensor] = []
            self._v: List[torch.Tensor] = []
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
            # Connects before the model loads, so a misfit pool is refused at once.
            client = self._connect_at_start()
            self._courier = _Courier(self._dial, self._retry_s, client, "shmkv-worker")

    @property
    def requires_kv_delivery(self) -> bool:
        """False: a dropped save is only a later miss."""
        return False

    # -- the coordinator --------------------------------------------------------------------

    def _dial(self):
        """A new client of the coordinator, its pool checked (:meth:`_check_pool`, and
        vLLM's tensors once registered); logs and raises why when there is none."""
        # Only a worker copies through the pool; the scheduler never touches its pages.
        prefault = self._prefault and self._role != KVConnectorRole.SCHEDULER
        try:
            if self._tp_size > 1 and self._tp_rank is not None:
                client = shmkv.connect(
                    self._address,
                    tp_rank=self._tp_rank,
                    tp_size=self._tp_size,
                    name=self._client_name,
                    prefault=prefault,
                    timeout=CLIENT_TIMEOUT_S,
                )
            else:
                client = shmkv.connect(
                    self._address,
                    name=self._client_name,
                    prefault=prefault,
                    timeout=CLIENT_TIMEOUT_S,
                )
        except (ShmkvError, OSError) as exc:
            log.log(
                logging.WARNING if self.connected or not self._tried else logging.DEBUG,
                "shmkv: coordinator at %s unavailable (%s); no hits, retry in %.0f s",
                self._address,
                exc,
                self._retry_s,
            )
            self._tried = True
            self._set_connected(False)
            raise
        try:
            self._check_pool(client.config)
            if self._role != KVConnectorRole.SCHEDULER and self._k:
                self._check_layers(client.config, *self._shape)
        except ConnectorConfigError as exc:
            client.close()
            if str(exc) != self._refused:  # (once per reason, not at every retry)
                self._refused = str(exc)
                log.error("shmkv: %s; not using it, retry in %.0f s", exc, self._retry_s)
            self._set_connected(False)
            raise
        if prefault:
            log.info("shmkv: pool mapped into this worker in %.2f s", client.prefault_s)
        log.info(
            "shmkv: connected to the coordinator at %s (instance %s)",
            self._address,
            client.instance,
        )
        self._set_connected(True)
        return client

    def _connect_at_start(self):
        """Connect at start-up, on the calling thread: a pool that does not fit raises
        :class:`ConnectorConfigError` now, before the model loads; a coordinator that is
        not up is only logged (None: the courier connects later)."""
        try:
            return self._dial()
        except ConnectorConfigError:
            raise
        except (ShmkvError, OSError):
            return None

    def _set_connected(self, up: bool) -> None:
        """Note (and log, once per change) whether this side is connected."""
        if up != self.connected:
            self.connected = up
            if not up:
                log.warning("shmkv: disconnected from the coordinator at %s", self._address)

    def _connect(self):
        """(Worker side.) The live client, or None while there is none (the courier
        then connects on its own thread). A new client drops the handles of the last."""
        client = self._courier.client
        if client is None or not client.is_alive():
            self._courier.kick()
            client = None
        if client is not self._client:
            self._client = client
            self._handles.clear()  # their coordinator is gone with them
        return client

    def _check_pool(self, cfg) -> None:
        """Refuse a pool this engine cannot use: its block size must divide vLLM's, it
        must be built for vLLM's tensor-parallel size, and its layers, KV heads, head size
        and dtype must be the model's (as far as the model config tells, on both sides at
        start-up: before the model loads; the workers check vLLM's tensors again in
        :meth:`register_kv_caches`).

        Raises:
            ConnectorLayoutError: a pool of another layout (the message says what to run).
        """
        if self._block_size % cfg.block_size:
            divisors = [d for d in (16, 32, 64, 128) if self._block_size % d == 0]
            raise ConnectorLayoutError(
                f"shmkv pool block size {cfg.block_size} does not divide vLLM's block size "
                f"{self._block_size}: start the coordinator with --block-size one of "
                f"{divisors} (or vLLM with --block-size a multiple of {cfg.block_size} that "
                f"its kernels take)"
            )
        if self._tp_size > 1 and cfg.tp_size != self._tp_size:
            # (an engine without tensor parallelism reads and writes whole blocks: any
            # pool's; a rank of a TP engine needs the pool's head shard of that rank)
            raise ConnectorLayoutError(
                f"the shmkv pool at {self._address} is built for tensor_parallel_size "
                f"{cfg.tp_size}, this engine runs {self._tp_size}: start the coordinator "
                f"with --tp-size {self._tp_size}"
            )
        if self._expected is not None:
            self._check_shape(cfg, self._expected)

    def _check_layers(self, cfg, heads: int, head_dim: int, dtype) -> None:
        self._check_shape(
            cfg,
            dict(
                num_layers=len(self._k),
                kv_heads=heads * self._tp_size,
                head_dim=head_dim,
                dtype=str(dtype).replace("torch.", ""),
            ),
        )

    def _check_shape(self, cfg, want: Dict[str, Any]) -> None:
        have = dict(
            num_layers=cfg.num_layers,
            kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            dtype=str(cfg.dtype).replace("torch.", ""),
        )
        if want != have:
            raise ConnectorLayoutError(
                f"the shmkv pool at {self._address} holds {have}, this engine's K/V is "
                f"{want}: start the coordinator with shmkv serve --num-layers "
                f"{want['num_layers']} --num-kv-heads {want['kv_heads']} --head-dim "
                f"{want['head_dim']} --dtype {want['dtype']} --tp-size {self._tp_size}"
            )

    # -- scheduler side ---------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        """Tokens past ``num_computed_tokens`` that shmkv holds for ``request``, in whole vLLM
        blocks, and whether they load asynchronously: True while a tier of this host (host
        memory, disk) still copies some of the blocks vLLM needs into the pool, False when
        those are there (or nothing is needed). None (vLLM asks again later, scheduling
        others meanwhile) while some of them are asked of the shared store, which may not
        have them. 0 when the coordinator is gone."""
        state = self._reqs.get(request.request_id)
        if state is None:
            try:
                state = self._lookup(request)
            except _NotYet:  # asked, no answer yet: vLLM schedules others and asks again
                return None, False
            if state is None:
                return 0, False
        if state.pending and request.request_id not in self._waiting:
            self._take_settled(state)  # (settled by now? then the hit is final)
        state.local = num_computed_tokens
        num = max(0, state.hit - num_computed_tokens)
        # What vLLM is told: synchronous unless a tier still copies blocks it needs;
        # not known yet (None: vLLM asks again) while some of those are only maybe in
        # the store.
        state.told_async = False
        if num == 0 or not state.pending or state.hit <= state.resident:
            return num, False
        if state.hit > state.sure:
            return None, False
        state.told_async = True
        return num, True

    def _gate_open(self, instance: str) -> bool:
        """Whether hits from coordinator ``instance`` may be promised: not while a worker
        rank's last report says it failed to reach it (it connects again on its next
        step, and says so). A worker that is not connected to the coordinator a step's
        metadata names connects before it loads (:meth:`start_load_kv`), so after a
        coordinator restart the scheduler's first lookups are loaded, not failed."""
        blocked = "!" + instance
        if not any(self._worker_reports.get(r) == blocked for r in range(self._tp_size)):
            self._gate_logged = False
            return True
        if not self._gate_logged:
            self._gate_logged = True
            log.warning(
                "shmkv: a worker could not connect to coordinator instance %s; no hits "
                "are promised until it does",
                instance,
            )
        return False

    def update_connector_output(self, connector_output) -> None:
        """Take the workers' reports of which coordinator they are connected to."""
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, ShmkvWorkerMetadata):
            self._worker_reports.update(meta.instances)

    def _lookup(self, request, wait: Optional[float] = None) -> Optional[_SchedReq]:
        """The state of ``request``'s lookup; None when it missed or cannot be made.

        The lookup runs on the courier's thread: vLLM's thread waits at most
        ``LOOKUP_WAIT_S`` for lookups in one step, so that a busy coordinator or a busy host
        never holds up a step (decodes) for a round trip. An answer not there yet raises
        ``_NotYet`` (vLLM asks again next step); one not there ``"shmkv.lookup_timeout_s"``
        after the courier began it, or queued behind one that is (a coordinator that
        stopped answering), is a miss, and what it made is released when it comes (one
        that had not begun is never made). Lookups queued behind others answered in time
        wait their turn.

        Raises:
            _NotYet: asked, not answered yet.
        """
        req_id = request.request_id
        asked = self._asking.get(req_id)
        if asked is None:
            asked = self._ask(request)
            if asked is None:
                return None
            self._asking[req_id] = asked
        job = asked.job
        if wait is None:
            # One wait a step at most, however many requests wait for their lookups
            # (their answers come in order); waiting also lets the courier's thread take
            # the GIL from a scheduler that would otherwise spin through empty steps.
            wait = 0.0 if self._lookup_waited else LOOKUP_WAIT_S
            if not job.done.is_set():
                self._lookup_waited = True
        try:
            handle, settle, tokens, made_at = self._courier.take(job, wait)
        except _NotYet:
            # Late: under way for longer than the timeout, or queued behind a request
            # that is (a coordinator that stopped answering); one queued behind others
            # that are answered in time waits its turn.
            started, timeout = job.started, self._lookup_timeout_s
            if started is None:
                late = self._courier.stuck(timeout)
            else:
                late = time.monotonic() - started > timeout
            if not late or self._courier.abandon(job):
                raise
            del self._asking[req_id]
            log.debug("shmkv: lookup of %s counted as a miss (no answer in time)", req_id)
            self.num_late_lookups += 1
            return None
        except shmkv.CoordinatorGone as exc:  # (said once, as the connection went)
            del self._asking[req_id]
            log.debug("shmkv: request %s not looked up (%s)", req_id, exc)
            return None
        except (ShmkvError, OSError) as exc:  # no room, a prompt past max_seq_len
            del self._asking[req_id]
            log.info("shmkv: request %s not looked up (%s)", req_id, exc)
            return None
        del self._asking[req_id]
        prompt_tokens, prompt_len = asked.full, asked.prompt_len
        if handle is None:  # (a worker cannot reach this coordinator: _gate_open)
            return None
        bs = self._block_size
        cached = handle.num_cached_tokens
        cap = min(prompt_tokens, (prompt_len - 1) // bs * bs)
        state = _SchedReq(
            handle=handle,
            prompt_tokens=prompt_tokens,
            hit=min(cached // bs * bs, cap),
            cached=cached,
            saved=cached,
            cap=cap,
            tokens=tokens,
            tokens_at=made_at,
        )
        if settle is not None:  # a tier copies part of the hit in: wait off this thread
            state.pending = True
            state.resident = handle.num_resident_tokens // bs * bs
            state.sure = (cached - handle.num_fetching_tokens) // bs * bs
            if self._settler is None:
                self._settler = _Settler(str(self._address), self._client_name)
            state.ticket = self._settler.submit(settle)
        self._reqs[request.request_id] = state
        return state

    def _ask(self, request) -> Optional[_Asked]:
        """Queue ``request``'s lookup on the courier's thread: its sequence (the longest
        cached prefix pinned), a hand-off to wait on when a tier still copies part of it,
        and, when the request will save, the workers' hand-offs. None when there is
        nothing to look up, or no coordinator answering."""
        prompt = key_tokens(request)  # (zeros for a prompt of embeddings alone)
        full = len(prompt) // self._block_size * self._block_size
        if full == 0:
            return None
        # The salt covers the request's adapter, multimodal inputs and prompt embeddings;
        # None for an adapter whose files are not here: such a request is not cached.
        salt = request_salt(self._namespace, request)
        if salt is None:
            return None
        ttl, ranks = self._handoff_ttl_s, self._tp_size

        def lookup(client):
            if not self._gate_open(client.instance):
                return None, None, None, 0.0
            handle = client.allocate(prompt=prompt[:full], cache_salt=salt, wait=False)
            settle, tokens = None, []
            try:
                if handle.num_promoting_tokens:  # for the thread that waits for the copies
                    settle = handle.export(ttl=2 * SETTLE_TIMEOUT_S)
                if handle.num_cached_tokens < full:  # it saves: each rank's hand-off
                    for _ in range(ranks):
                        tokens.append(handle.export(ttl=ttl))
            except BaseException:
                _release_found((handle, settle, tokens, 0.0))  # (the tokens made so far too)
                raise
            return handle, settle, tokens or None, time.monotonic()

        try:
            job = self._courier.submit(lookup, self._lookup_timeout_s, _release_found)
        except _Late as exc:
            log.debug("shmkv: lookup of %s counted as a miss (%s)", request.request_id, exc)
            self.num_late_lookups += 1
            return None
        return _Asked(job, full, len(prompt))

    def _take_settled(self, state: _SchedReq) -> bool:
        """Whether the tier copies of ``state``'s lookup are done; if so its hit is the
        settled one (shorter when a block did not arrive; what was in the pool when the
        wait failed)."""
        assert self._settler is not None  # (made by the lookup that set pending)
        done, cached = self._settler.take(state.ticket)
        if not done:
            return False
        state.pending = False
        if cached is None:
            state.hit = min(state.hit, state.resident)
        else:
            state.hit = min(state.hit, cached // self._block_size * self._block_size)
            state.cached = cached
            state.saved = min(state.saved, cached)
        return True

    def get_external_cache_hit_sources(self, request, num_external_tokens: int):
        """Where the ``num_external_tokens`` loaded for ``request`` come from: the pool
        (host memory for a CPU pool, ``host``; another process's device memory for a CUDA
        pool, ``p2p``) for the blocks that were in it at the lookup, a tier below it or
        the shared store for the rest (``external_unspecified``: the coordinator does not
        say which)."""
        state = self._reqs.get(request.request_id)
        if num_external_tokens <= 0:
            return {}
        if state is None or CacheHitSource is None:
            return super().get_external_cache_hit_sources(request, num_external_tokens)
        start = state.hit - num_external_tokens
        resident = state.resident if state.ticket else state.hit  # (ticket: tiers copied)
        in_pool = max(0, min(resident, state.hit) - start)
        pool = CacheHitSource.P2P if self._pool_is_cuda else CacheHitSource.HOST
        sources = {
            pool: in_pool,
            CacheHitSource.EXTERNAL_UNSPECIFIED: num_external_tokens - in_pool,
        }
        return {source: num for source, num in sources.items() if num > 0}

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        """Note the vLLM blocks of ``request`` and the tokens to load into them."""
        state = self._reqs.get(request.request_id)
        asked = self._asking.get(request.request_id)
        if state is None and asked is not None:
            # Scheduled while its lookup was "not known yet": vLLM does so with a request
            # that does not read the prefix cache (prompt logprobs), which still saves.
            # Its answer, if here, is taken now; else the lookup is dropped (released when
            # it comes) and the request computes and saves nothing.
            try:
                state = self._lookup(request, wait=0.0)
            except _NotYet:
                del self._asking[request.request_id]
                self._drop_asked(asked)
        if state is None:
            return
        state.block_ids = list(blocks.get_block_ids()[0]) if blocks is not None else []
        # The coordinator counts, under this engine's name, what the engine took from it
        # (the workers report loads) and, here, what it asked for and computed instead,
        # not what the lookup found: vLLM's own cache may have had most of the prompt.
        state.missed = max(0, state.cap - state.local - num_external_tokens)
        if num_external_tokens > 0:
            state.load = (state.hit - num_external_tokens, state.hit)
            # vLLM was told the load is asynchronous: the request waits for the workers
            # to report it received (build_connector_meta hands it over once settled)
            if state.pending and state.told_async:
                self._waiting[request.request_id] = state
        else:
            state.load = (0, 0)

    def build_connector_meta(self, scheduler_output) -> ShmkvConnectorMetadata:
        """This step's loads and saves, with the hand-off tokens of new requests."""
        meta = ShmkvConnectorMetadata(
            closed=self._closed,
            recv_dropped=self._recv_dropped,
            coordinator=self._courier.instance or "",
        )
        self._closed, self._recv_dropped = [], []
        self._lookup_waited = False  # (a new step: a lookup may wait again, see _lookup)
        self._courier.post(self._log_refused)
        for req_id, waiting in list(self._waiting.items()):
            if self._take_settled(waiting):
                del self._waiting[req_id]
                meta.requests.append(self._received(req_id, waiting))
        computed: Dict[str, int] = {}
        for new in scheduler_output.scheduled_new_reqs:
            state = self._reqs.get(new.req_id)
            if state is not None:
                state.block_ids = list(new.block_ids[0])
                computed[new.req_id] = new.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._reqs.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.block_ids = list(new_ids[0]) if new_ids is not None else []
            elif new_ids is not None:
                state.block_ids.extend(new_ids[0])
            computed[req_id] = cached.num_computed_tokens[i]
        for req_id, before in computed.items():
            state = self._reqs[req_id]
            after = before + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            end = min(after, state.prompt_tokens) // self._block_size * self._block_size
            if state.pending:  # saves start where the settled hit ends: none before it
                self._take_settled(state)
            save = (state.saved, end) if end > state.saved and not state.pending else (0, 0)
            load = state.load
            if save == (0, 0) and load == (0, 0):
                if not state.exported and state.saved >= state.prompt_tokens:
                    # Nothing to load (vLLM's own cache had it) nor to save (shmkv has it
                    # all): no hand-off, no worker round trip; the lookup's pin goes.
                    self._finish(req_id, tell_workers=True)
                continue
            item = ShmkvReqMeta(
                req_id=req_id,
                block_ids=list(state.block_ids),
                load=load,
                save=save,
                missed=state.missed,
            )
            state.missed = 0
            if not state.exported:
                self._hand_over(state, item)
            state.load = (0, 0)
            if save != (0, 0):
                state.saved = save[1]
            if state.saved >= state.prompt_tokens:
                item.done = True
                self._finish(req_id, tell_workers=False)
            meta.requests.append(item)
        return meta

    def _received(self, req_id: str, state: _SchedReq) -> ShmkvReqMeta:
        """The hand-over of an asynchronous load whose tier copies are done: the workers
        copy what arrived and report the request received (see :class:`ShmkvReqMeta`)."""
        start, end = state.load
        item = ShmkvReqMeta(
            req_id=req_id,
            block_ids=list(state.block_ids),
            load=(start, end),
            recv=True,
            valid=max(start, min(end, state.hit)),
        )
        item.tokens = self._made_tokens(state) or self._export(state)
        state.exported = True
        state.load = (0, 0)
        return item

    def _hand_over(self, state: _SchedReq, item: ShmkvReqMeta) -> None:
        """Give the workers the request's sequence, the first time they need it: for a
        load alone, the lookup handle's descriptor (no hand-off to make, open or close;
        the handle pins the blocks until the request finishes); for a step that saves,
        one hand-off token per rank, each rank's own reference to write through."""
        if item.save == (0, 0):
            item.source = self._source(state)
            if item.source is None:
                item.tokens = []  # (the workers report the load failed)
            state.peeked = True
        else:
            item.tokens = self._made_tokens(state) or self._export(state)
            state.exported = True

    def _made_tokens(self, state: _SchedReq) -> Optional[List[bytes]]:
        """The hand-offs made with the lookup, while they have at least half their time
        to live (a request that waited longer gets new ones)."""
        tokens, state.tokens = state.tokens, None
        if tokens and time.monotonic() - state.tokens_at < self._handoff_ttl_s / 2:
            return tokens
        if tokens:
            self._courier.post(lambda client: _drop_tokens(client, tokens))
        return None

    def _source(self, state: _SchedReq) -> Optional[bytes]:
        """The descriptor the workers read a load through (its handle stays open); None
        when the handle was lost (the coordinator went away)."""
        try:
            return state.handle.descriptor()
        except (ShmkvError, OSError) as exc:
            log.warning("shmkv: the lookup's handle is gone (%s); the workers recompute", exc)
            return None

    def _export(self, state: _SchedReq) -> List[bytes]:
        """One hand-off token per rank (asked on the courier's thread, waited for at most
        ``"shmkv.lookup_timeout_s"``); an empty list when there are none: the workers
        then save nothing and report a load as failed (vLLM recomputes it). A late
        answer's tokens are left to expire (``"shmkv.handoff_ttl_s"``)."""
        handle, ttl, num = state.handle, self._handoff_ttl_s, self._tp_size
        try:
            return self._courier.call(
                lambda client: [handle.export(ttl=ttl) for _ in range(num)],
                self._lookup_timeout_s,
            )
        except (ShmkvError, OSError) as exc:
            log.warning("shmkv: hand-off failed (%s); the workers recompute", exc)
            return []

    def _drop(self, handle) -> None:
        """(Scheduler side.) Release ``handle`` on the courier's thread, not waited for."""
        self._courier.post(lambda client: _release(handle))

    def _finish(self, req_id: str, tell_workers: bool, final: bool = False) -> None:
        """The scheduler is done with ``req_id``'s lookup (a later lookup of the request,
        after a preemption, starts anew). Its reference goes, unless the workers read a
        load through its descriptor: that one pins the blocks they may still be copying
        until the request is ``final`` (finished, or the connector shut down)."""
        state = self._reqs.pop(req_id, None)
        asked = self._asking.pop(req_id, None)
        if asked is not None:
            self._drop_asked(asked)
        if final:
            for handle in self._pins.pop(req_id, ()):
                self._drop(handle)
        if state is None:
            return
        tokens, state.tokens = state.tokens, None
        if tokens:  # hand-offs made with the lookup, never handed to the workers
            self._courier.post(lambda client: _drop_tokens(client, tokens))
        if state.pending:  # its wait's answer, when it comes, goes to no one
            assert self._settler is not None  # (made by the lookup that set pending)
            self._settler.forget(state.ticket)
        if state.peeked and not final:
            self._pins.setdefault(req_id, []).append(state.handle)
        else:
            self._drop(state.handle)
        if tell_workers and (state.exported or state.peeked):
            self._closed.append(req_id)

    def _drop_asked(self, asked: _Asked) -> None:
        """Nobody takes the answer of lookup ``asked``: what it made is released, now if
        it was answered, else by the courier when it is (or never made, when it had not
        begun)."""
        if self._courier.abandon(asked.job):
            try:
                found = self._courier.take(asked.job, 0)
            except Exception:  # noqa: BLE001 - a failed lookup made nothing
                return
            self._courier.post(lambda client: _release_found(found))

    def request_finished(self, request, block_ids):
        """Drops the request's references. Saves finish within the step that computed the
        blocks (:meth:`wait_for_save` is synchronous), so vLLM may free the blocks now (an
        asynchronous load not handed over yet is reported received, with nothing copied,
        in the next step: vLLM frees its blocks then)."""
        if self._waiting.pop(request.request_id, None) is not None:
            # an asynchronous load not handed over: vLLM holds its blocks until the
            # workers report it received
            self._recv_dropped.append(request.request_id)
        self._finish(request.request_id, tell_workers=True, final=True)
        return False, None

    # -- worker side ------------------------------------------------------------------------

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
        self._k, self._v = [], []
        self._layer_index = {name: i for i, name in enumerate(names)}
        for name in names:
            k, v = kv_views(kv_caches[name], layout)
            self._k.append(k)
            self._v.append(v)
        nb, heads, bs, head_dim = self._k[0].shape
        if bs != self._block_size:
            raise ConnectorConfigError(
                f"vLLM's KV cache has blocks of {bs} tokens, its config says {self._block_size}"
            )
        self._shape = (heads, head_dim, first.dtype)
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

    def start_load_kv(self, forward_context, **kwargs) -> None:
        """Open this step's hand-offs and copy every hit block of the step into vLLM's
        blocks (see :func:`copy_runs`), all layers, before the forward. With
        ``"shmkv.layerwise"`` on the CPU, once a forward has shown that vLLM waits for
        every layer, the copies run layer by layer on a thread of their own while the
        forward computes, each layer's attention waiting in :meth:`wait_for_layer_load`
        for its own layer only."""
        meta = self._connector_metadata
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

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        """Nothing per layer: :meth:`wait_for_save` saves every layer after the forward."""
        return

    def wait_for_save(self):
        """Copy this step's newly complete blocks into the pool and commit them (after
        the step's loads have ended)."""
        self._finish_loads()
        if self._layerwise is None and self._k and len(self._waited) == len(self._k):
            self._layerwise = True  # vLLM waits for every layer: load layer by layer
        meta = self._connector_metadata
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
        self._log_refused()

    def _log_refused(self, client=None) -> None:
        """Log what the coordinator refused of the requests sent without waiting (commits
        and releases: a refused commit is a save not cached); of ``client``, or the
        worker's own."""
        client = client if client is not None else self._client
        if client is not None:
            for op, exc in client.posted_errors():
                log.warning("shmkv: %s refused (%s); that save is not cached", op, exc)

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

    @classmethod
    def build_kv_connector_stats(cls, data=None):
        """:class:`ShmkvConnectorStats` from a dict of counts."""
        return ShmkvConnectorStats(data=dict(data or {}))

    def shutdown(self):
        """Close every handle and the client."""
        if self._role == KVConnectorRole.SCHEDULER:
            for req_id in {*self._reqs, *self._pins, *self._asking}:
                self._finish(req_id, tell_workers=False, final=True)
            if self._settler is not None:
                self._settler.close()
        else:
            if self._loader is not None:
                self._loader.cancel()
                self._finish_loads()
                self._loader.close()
            for req_id in list(self._handles):
                self._close(req_id)
        # (closing the client drops every reference it still held, released or not)
        self._client = None
        self._courier.close()
