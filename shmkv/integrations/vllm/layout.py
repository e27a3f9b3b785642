"""vLLM's paged K/V layouts as the connector reads them, and the copies between them and
the pool.

This module owns the views of vLLM's cache tensors (:func:`kv_views`, one per layout,
and the check that the CPU back end keeps K/V where they read, :func:`check_cpu_layout`),
the copy plan between a request's vLLM blocks and its pool blocks (:func:`copy_runs`,
:func:`merge_runs`) and the copy itself (:func:`assign`). It does not own when a copy is
made (the worker side) nor the pool's layout (:mod:`shmkv.memory.layout`). It imports
only the connector's settings (for its errors).

Every layout gives K and V views of ``[num_blocks, num_kv_heads, block_size, head_size]``
(block, head, token, dimension) whose strides follow vLLM's order, so the copies through
them leave the pool in its own layout (``[block, layer, K|V, token, head, dim]``) whatever
vLLM's, for every pool block size that divides vLLM's block size:

* ``"cpu"``: the CPU back end's ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``:
  per (block, head), ``block_size * head_size`` K values, then as many V values. V is
  token-major (``[block_size, head_size]``), K dimension-major (``[head_size,
  block_size]``), as vLLM's vector kernels write them. vLLM picks its kernel path per CPU,
  dtype and shape; the worker side has vLLM's own write op place a probe on the path the
  engine uses and refuses one that keeps K/V otherwise (:func:`check_cpu_layout`: the AMX
  path's bfloat16 tiles, Arm's BFMMLA);
* ``"split"``: vLLM 0.32's standardized ``[num_blocks, num_kv_heads, block_size,
  2 * head_size]`` of FlashAttention on CUDA (any memory order of those dimensions), K and
  V side by side in the last dimension;
* ``"flash"``: the older FlashAttention ``[2, num_blocks, block_size, num_kv_heads,
  head_size]``.

Each is checked against vLLM's own writes and a reference forward
(``tests/test_vllm_oracle.py``).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import numpy as np
import torch

from shmkv.integrations.vllm.settings import LAYOUTS, ConnectorConfigError


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
