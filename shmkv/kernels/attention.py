"""Paged attention over the pool's pages: plain torch, and a native decode kernel on CPU.

Owns :func:`paged_attention`: attention of query tokens against K/V held in pages
``[num_blocks, block_size, num_kv_heads, head_dim]`` (what ``KvCacheHandle.paged_kv(layer)``
returns) through a block table, with grouped-query attention. It takes either a
padded batch (``[batch, q_len, ...]``, or ``[batch, ...]`` for decode) or an engine
step's packed tokens (``[num_tokens, ...]`` with ``query_start_loc``, the
FlashAttention / vLLM varlen convention), so prefills and decodes of one step go in
one call.

How it runs, on any device torch runs on: the sequences are grouped by query count
and by how many keys they need, so a batch of decodes of similar lengths is one
``scaled_dot_product_attention`` call and a long prefill next to them is another.
Each group gathers only the blocks its sequences use (``index_select`` of whole
pages) and computes in the query's dtype; nothing is upcast to float32. Quantized
pages (float8, int8) are converted to the query's dtype as they are gathered and
multiplied by the caller's ``k_scale`` / ``v_scale`` (in float32, rounded once to the
query's dtype). Key slots a group gathers that lie outside a member's length (the rest
of its last block, pages standing in for a shorter member's missing blocks, which
belong to other sequences) are set to zero in the gathered copy before any product: a
mask alone does not stop NaN or inf there (``0 * NaN`` in P@V, ``inf - inf`` in the
scores), so whatever bytes lie there contribute exactly nothing (zeroing only those
slots costs next to nothing). On CPU, a group of one query per sequence (decode) in
float32, bfloat16 or float16 goes to the native kernel instead (``shmkv.kernels.native``,
built from C with the package): it reads each sequence's pages in place, once, with no
gathered copy and no padding to the longest member, and no key past a length; where
it is not built (no C compiler at install) or is turned off (``SHMKV_NATIVE=0``) the
torch path above runs. On a GPU,
FlashAttention's ``flash_attn_with_kvcache(..., block_table=)`` and FlashInfer's paged
kernels read the same pages in place, without the gather (see ``docs/transformers.md``).

The layers of a model step share one block table and lengths: a
:class:`PagedAttentionPlan` holds what is worked out from them (groups, gather
indexes, masks, page-id bounds) so that each layer's call only gathers and attends.

This module does not write K/V, does not resolve block tables (callers pass them)
and does not talk to a coordinator. Reading lengths and query offsets needs their
values on the host: tensors on a GPU are copied back (one sync per plan, so per call
without one).
"""

from __future__ import annotations

import math
from typing import List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F

from shmkv.kernels import native

IntsLike = Union[torch.Tensor, Sequence[int]]
ScaleLike = Union[None, float, torch.Tensor]

# scaled_dot_product_attention(enable_gqa=True) arrived in torch 2.5. Without it the
# query heads of a K/V head are folded into the query rows instead (a view, no copy).
_HAS_ENABLE_GQA = torch.__version__ >= "2.5"
# With few query rows per sequence, folding the query heads of each K/V head into the
# rows beats enable_gqa, which repeats K/V on CPU. Measured on CPU against 2k keys:
# 1.6x faster at 4 rows (one query token), even at 16 rows, slower beyond.
_GROUPED_MAX_ROWS = 16
# Sequences with the same query count share one SDPA call, padded to the longest key
# count. A member joins a group unless that pads more than this many (key x query)
# scores; one more call costs about as much as ~500 padded decode keys on CPU.
_MAX_PAD_SCORES = 512


class AttentionWorkspace:
    """Scratch memory for the K/V that :func:`paged_attention` gathers, kept between calls.

    Pass the same workspace to every call of a step loop (all layers, all steps): the
    gathered blocks then go into memory already mapped instead of fresh megabytes per
    call, whose first-touch page faults can cost more than the gather itself (3x the
    gather time, measured on CPU with other allocations between calls). It grows to the
    largest call seen, doubling so that a growing context reallocates rarely, and keeps
    one dtype and device at a time.

    Not thread-safe: use one per thread (or per CUDA stream). :meth:`clear` drops the
    memory; nothing else needs releasing.
    """

    def __init__(self) -> None:
        self._buffer: Optional[torch.Tensor] = None

    @property
    def nbytes(self) -> int:
        """Bytes held now."""
        buf = self._buffer
        return 0 if buf is None else buf.numel() * buf.element_size()

    def clear(self) -> None:
        """Drop the memory; the next call that uses the workspace allocates again."""
        self._buffer = None

    def _take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        buf = self._buffer
        if buf is None or buf.dtype != dtype or buf.device != device:
            buf = self._buffer = torch.empty(numel, dtype=dtype, device=device)
        elif buf.numel() < numel:
            buf = self._buffer = torch.empty(
                max(numel, 2 * buf.numel()), dtype=dtype, device=device
            )
        return buf[:numel]


class _Seq(NamedTuple):
    """One sequence's share of the work: row ``batch_index`` of the batch, whose query
    rows ``row0 .. row0 + num_queries - 1`` sit at positions ``start .. start +
    num_queries - 1`` and read keys ``0 .. num_keys - 1``. (Not ``index`` and ``count``:
    those are tuple's methods.)"""

    batch_index: int
    row0: int
    num_queries: int
    start: int
    num_keys: int


def _as_lengths(name: str, value: IntsLike, batch: int) -> List[int]:
    t = torch.as_tensor(value)
    if t.dim() != 1 or t.shape[0] != batch:
        raise ValueError(
            f"{name} must have one entry per sequence ({batch}), got shape {tuple(t.shape)}"
        )
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"{name} must hold integers, got {t.dtype}")
    return t.tolist()


class PagedAttentionPlan:
    """What :func:`paged_attention` works out from a block table and lengths, kept for
    every call that shares them.

    Every layer of a model step attends with the same block table, lengths and query
    offsets; only the queries, the pages and the scales change. Building the plan once
    per step (with the first layer's query and pages) and passing it as ``plan=`` to
    each layer's call leaves those calls the gathers and SDPA calls alone: the lengths
    are read on the host once (one sync on a GPU), the sequences grouped, the gather
    indexes, masks and page-id bounds computed once.

    Args:
        query: a query of the step, in the form every call will pass (its shape, dtype
            and device are what the plan is for).
        k_pages: pages of the step, ``[num_blocks, block_size, num_kv_heads,
            head_dim]`` (their block size, heads and device are what the plan is for;
            calls may pass other pages of that shape, such as another layer's).
        block_table, seq_lens, causal, query_start, query_start_loc: as for
            :func:`paged_attention`.

    A plan does not hold the pages or the queries, only indexes into them. Reuse it
    only while the block table, lengths and offsets it was built from still hold.

    Raises:
        ValueError / TypeError: as :func:`paged_attention` for the same arguments.
    """

    __slots__ = (
        "query_shape",
        "num_rows",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "block_size",
        "device",
        "query_device",
        "groups",
        "zero_rows",
        "whole",
        "low",
        "high",
        "decode_group",
    )

    def __init__(
        self,
        query: torch.Tensor,
        k_pages: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: IntsLike,
        *,
        causal: bool = True,
        query_start: Optional[IntsLike] = None,
        query_start_loc: Optional[IntsLike] = None,
    ) -> None:
        packed = query_start_loc is not None
        if packed:
            if query.dim() != 3:
                raise ValueError(
                    "with query_start_loc, query must be packed tokens [num_tokens, "
                    f"num_heads, head_dim], got shape {tuple(query.shape)}"
                )
            if query_start is not None:
                raise ValueError(
                    "query_start belongs to the batch form; with query_start_loc "
                    "the queries are the last tokens of each sequence"
                )
            q = query
        else:
            q = query.unsqueeze(1) if query.dim() == 3 else query
            if q.dim() != 4:
                raise ValueError(
                    "query must be [batch, q_len, num_heads, head_dim] or "
                    f"[batch, num_heads, head_dim], got shape {tuple(query.shape)}"
                )
        if not query.dtype.is_floating_point:
            raise TypeError(f"query must be floating point, got {query.dtype}")
        if k_pages.dim() != 4:
            raise ValueError(
                "k_pages and v_pages must both be [num_blocks, block_size, "
                f"num_kv_heads, head_dim], got {tuple(k_pages.shape)}"
            )
        num_heads, head_dim = q.shape[-2:]
        num_blocks, block_size, num_kv_heads, kv_dim = k_pages.shape
        if kv_dim != head_dim:
            raise ValueError(f"query head_dim {head_dim} differs from the pages' {kv_dim}")
        if num_kv_heads == 0 or num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}"
            )
        if block_table.dim() != 2 or (not packed and block_table.shape[0] != q.shape[0]):
            rows = "batch" if packed else f"batch={q.shape[0]}"
            raise ValueError(
                f"block_table must be [{rows}, max_blocks], got shape {tuple(block_table.shape)}"
            )
        batch = block_table.shape[0]
        if block_table.dtype.is_floating_point or block_table.dtype == torch.bool:
            raise TypeError(f"block_table must hold integers, got {block_table.dtype}")
        lens = _as_lengths("seq_lens", seq_lens, batch)
        if lens and min(lens) < 0:
            raise ValueError(f"seq_lens must not be negative, got {lens}")
        if lens and -(-max(lens) // block_size) > block_table.shape[1]:
            raise ValueError(
                f"seq_lens {lens} need more blocks than block_table has "
                f"({block_table.shape[1]} of {block_size} tokens)"
            )
        if query_start_loc is not None:  # (packed)
            locs = _as_lengths("query_start_loc", query_start_loc, batch + 1)
            num_rows = q.shape[0]
            if locs[0] < 0 or locs[-1] > num_rows or any(a > b for a, b in zip(locs, locs[1:])):
                raise ValueError(
                    f"query_start_loc must be non-decreasing offsets into the "
                    f"{num_rows} query rows, got {locs}"
                )
            seqs = [
                _Seq(b, locs[b], locs[b + 1] - locs[b], lens[b] - (locs[b + 1] - locs[b]), lens[b])
                for b in range(batch)
            ]
        else:
            q_len = q.shape[1]
            num_rows = batch * q_len
            starts = (
                [n - q_len for n in lens]
                if query_start is None or not causal
                else _as_lengths("query_start", query_start, batch)
            )
            seqs = [_Seq(b, b * q_len, q_len, starts[b], lens[b]) for b in range(batch)]
        work = _trim(seqs, causal)

        self.query_shape = tuple(query.shape)
        self.num_rows = num_rows
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.block_size = block_size
        self.device = k_pages.device
        self.query_device = query.device
        self.zero_rows = _unwritten(num_rows, work)
        self.groups: List[_Group] = []
        self.low, self.high = 0, -1
        if work:
            needed = max(-(-s.num_keys // block_size) for s in work)
            table = block_table[:, :needed]
            if table.device != self.device:
                table = table.to(self.device)
            if table.dtype not in (torch.int32, torch.int64):
                table = table.long()
            self.groups = [
                _Group(
                    table, g, causal, num_heads, num_kv_heads, block_size, self.device, query.device
                )
                for g in _groups(work)
            ]
            ids = (
                self.groups[0].index
                if len(self.groups) == 1
                else torch.cat([g.index for g in self.groups])
            )
            if ids.device.type == "cpu":
                ids_np = ids.numpy()
                self.low, self.high = int(ids_np.min()), int(ids_np.max())
            else:
                self.low, self.high = torch.stack(torch.aminmax(ids)).tolist()
        first = self.groups[0] if len(self.groups) == 1 else None
        self.whole = False
        self.decode_group: Optional[_Group] = None
        if (
            first is not None
            and first.rows is None
            and first.row0 == 0
            and first.size * first.count == num_rows
        ):
            self.whole = first.whole = True
            # One query per sequence, all in one group of folded heads: what a model's
            # decode step is. _Group.decode runs it with the fewest torch calls.
            if first.grouped and first.count == 1:
                self.decode_group = first

    def _next_decode(self) -> Optional["PagedAttentionPlan"]:
        """The plan of the decode step after this one, when every sequence has one more
        key in the blocks it already has (same table, same queries); None when this plan
        is not of that kind (sequences of different lengths) or the key needs a block
        more."""
        group = self.decode_group
        if (
            group is None
            or group.mask is not None
            or group.num_keys >= group.blocks * self.block_size
        ):
            return None
        plan = PagedAttentionPlan.__new__(PagedAttentionPlan)
        for name in PagedAttentionPlan.__slots__:
            setattr(plan, name, getattr(self, name))
        plan.decode_group = group.with_keys(group.num_keys + 1)
        plan.groups = [plan.decode_group]
        return plan


def paged_attention(
    query: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_table: Optional[torch.Tensor] = None,
    seq_lens: Optional[IntsLike] = None,
    *,
    scale: Optional[float] = None,
    causal: bool = True,
    query_start: Optional[IntsLike] = None,
    query_start_loc: Optional[IntsLike] = None,
    out: Optional[torch.Tensor] = None,
    workspace: Optional[AttentionWorkspace] = None,
    k_scale: ScaleLike = None,
    v_scale: ScaleLike = None,
    plan: Optional[PagedAttentionPlan] = None,
) -> torch.Tensor:
    """Attention of ``query`` against paged K/V, per sequence of a batch.

    Sequence ``b`` owns the K/V tokens ``0 .. seq_lens[b] - 1``; token ``t`` lives in
    page ``block_table[b, t // block_size]``, slot ``t % block_size``. The query
    tokens' own K/V must already be written there.

    Two forms of query:

    * Batch: ``[batch, q_len, num_heads, head_dim]`` (prefill, or several tokens per
      sequence), or ``[batch, num_heads, head_dim]`` (decode: one token per sequence).
    * Packed (an engine step, FlashAttention's varlen form): ``[num_tokens, num_heads,
      head_dim]`` with ``query_start_loc``. Sequence ``b``'s queries are rows
      ``query_start_loc[b] : query_start_loc[b + 1]`` and are its last tokens, so a
      500-token prefill and decodes of one token each go in the same call. Rows that
      belong to no sequence (padding after ``query_start_loc[-1]``) get zeros.

    ``num_heads`` is a multiple of ``num_kv_heads`` (grouped-query attention: query head
    ``h`` reads K/V head ``h // (num_heads // num_kv_heads)``).

    Args:
        query: the query tokens, in one of the forms above.
        k_pages, v_pages: ``[num_blocks, block_size, num_kv_heads, head_dim]``, e.g.
            from ``handle.paged_kv(layer)``. Any strides (pool views are fine). Key
            slots past a sequence's length contribute nothing, whatever they hold (NaN,
            inf, another sequence's values); the pages are only read.
        block_table: ``[batch, max_blocks]`` integer page ids (int32 as handles give
            them). Entries past a sequence's last block are ignored, whatever they hold.
        seq_lens: ``[batch]`` K/V tokens of each sequence, its new tokens included (a
            tensor or a list of ints).
        scale: multiplier of ``q @ k``; default ``1 / sqrt(head_dim)``.
        causal: a query attends to keys at positions up to its own. Positions are
            bottom-right aligned: the queries are the last tokens of their sequence,
            unless ``query_start`` says otherwise. Without it every query attends to all
            ``seq_lens[b]`` keys.
        query_start: batch form only: ``[batch]`` position of each sequence's first
            query token; default ``seq_lens - q_len``. Only used when causal.
        query_start_loc: packed form: ``[batch + 1]`` non-decreasing row offsets
            (cumulative query counts, as vLLM's ``query_start_loc``).
        out: optional tensor shaped like ``query``, of its dtype and device, to write
            the result into (and return).
        workspace: optional :class:`AttentionWorkspace` to gather K/V into, reused
            across calls instead of fresh memory each call.
        k_scale, v_scale: dequantization scales of a quantized pool (float8 or int8
            pages): the value of a stored element is ``stored * scale``. A number, or a
            tensor of one element or of ``[num_kv_heads]`` (one per K/V head). Pages
            are converted to the query's dtype as they are gathered, then scaled in
            float32 (either form; the product is rounded once to the query's dtype);
            ``client.kv_scales(layer)`` gives what was kept beside the pool. Default 1.
        plan: a :class:`PagedAttentionPlan` built from this step's block table and
            lengths, instead of ``block_table``, ``seq_lens``, ``causal``,
            ``query_start`` and ``query_start_loc`` (pass none of them with it): the
            call then only gathers and attends, with no host sync (the layers of a model
            step share one plan).

    Returns:
        A tensor shaped like ``query``, in its dtype. Scores and softmax are computed
        by ``scaled_dot_product_attention`` in that dtype (pages of another dtype are
        converted as gathered). A query row with nothing to attend to (its position is
        negative, as for a padding row placed before a short sequence's first token,
        or its sequence is empty) gets zeros, not NaN.

    Raises:
        ValueError / TypeError: inconsistent shapes, head counts, dtypes, lengths or
            offsets, or a page id outside the pages; a query or pages that do not
            match the plan.
    """
    if plan is None:
        if block_table is None or seq_lens is None:
            raise TypeError("paged_attention needs block_table and seq_lens, or a plan")
        plan = PagedAttentionPlan(
            query,
            k_pages,
            block_table,
            seq_lens,
            causal=causal,
            query_start=query_start,
            query_start_loc=query_start_loc,
        )
    elif not isinstance(plan, PagedAttentionPlan):
        raise TypeError(f"plan must be a PagedAttentionPlan, got {type(plan).__name__}")
    elif (
        block_table is not None
        or seq_lens is not None
        or query_start is not None
        or query_start_loc is not None
        or causal is not True
    ):
        raise TypeError(
            "pass either a plan or block_table / seq_lens / causal / query_start / "
            "query_start_loc, not both: the plan holds them"
        )
    elif query.shape != plan.query_shape or query.device != plan.query_device:
        raise ValueError(
            f"query {tuple(query.shape)} on {query.device} does not match the "
            f"plan's {plan.query_shape} on {plan.query_device}"
        )
    elif not query.dtype.is_floating_point:
        raise TypeError(f"query must be floating point, got {query.dtype}")
    if (
        k_pages.shape != v_pages.shape
        or k_pages.dim() != 4
        or k_pages.shape[1:] != (plan.block_size, plan.num_kv_heads, plan.head_dim)
    ):
        raise ValueError(
            "k_pages and v_pages must both be [num_blocks, block_size, "
            f"num_kv_heads, head_dim] (block_size={plan.block_size}, "
            f"num_kv_heads={plan.num_kv_heads}, head_dim={plan.head_dim}), "
            f"got {tuple(k_pages.shape)} and {tuple(v_pages.shape)}"
        )
    if not (_readable(k_pages.dtype) and _readable(v_pages.dtype)):
        raise TypeError(
            f"k_pages and v_pages must be floating point or int8 (quantized), got "
            f"{k_pages.dtype} and {v_pages.dtype}"
        )
    if k_pages.device != plan.device or v_pages.device != plan.device:
        raise ValueError(
            f"the pages are on {k_pages.device} and {v_pages.device}, the plan on {plan.device}"
        )
    if workspace is not None and not isinstance(workspace, AttentionWorkspace):
        raise TypeError(f"workspace must be an AttentionWorkspace, got {type(workspace).__name__}")
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out must be a tensor, got {type(out).__name__}")
        if out.shape != query.shape or out.dtype != query.dtype or out.device != query.device:
            raise ValueError(
                f"out must be shaped like query {tuple(query.shape)} "
                f"({query.dtype} on {query.device}), got {tuple(out.shape)} "
                f"({out.dtype} on {out.device})"
            )
    if plan.low < 0 or plan.high >= k_pages.shape[0]:
        raise _page_outside(k_pages.shape[0])
    scales = (None, None)
    if k_scale is not None or v_scale is not None:
        scales = (
            _as_scale("k_scale", k_scale, plan.num_kv_heads, query),
            _as_scale("v_scale", v_scale, plan.num_kv_heads, query),
        )
    scale = None if scale is None else float(scale)

    if plan.whole:  # one group over every row in order: its output is the result
        o = plan.groups[0].run(query, k_pages, v_pages, scale, workspace, scales)
        if out is None:
            return o.reshape(query.shape)
        return out.copy_(o.reshape(query.shape))
    flat_q = query.reshape(plan.num_rows, plan.num_heads, plan.head_dim)
    into_out = out is not None and out.is_contiguous()
    if out is not None and into_out:
        result = out.view(plan.num_rows, plan.num_heads, plan.head_dim)
    else:
        result = query.new_empty((plan.num_rows, plan.num_heads, plan.head_dim))
    for lo, hi in plan.zero_rows:
        result[lo:hi].zero_()
    for group in plan.groups:
        o = group.run(flat_q, k_pages, v_pages, scale, workspace, scales)
        if group.rows is None:
            result[group.row0 : group.row0 + o.shape[0]].copy_(o)
        else:
            result.index_copy_(0, group.rows, o)
    if out is None:
        return result.view(query.shape)
    if not into_out:
        out.copy_(result.view(query.shape))
    return out


def _readable(dtype: torch.dtype) -> bool:
    """Page dtypes paged_attention reads: floating point (float8 included) and int8."""
    return dtype.is_floating_point or dtype == torch.int8


def _as_scale(name: str, value: ScaleLike, num_kv_heads: int, query: torch.Tensor):
    """None (no scaling), a float, a tuple of one float per K/V head, or (per-head scales
    on a GPU, kept there: reading them back would sync) a ``[1, num_kv_heads, 1, 1]``
    float32 tensor (float64 for a float64 query) on the query's device.

    Never a tensor of the query's dtype: :func:`_apply_scale` multiplies by a Python
    number or a float32 tensor, which computes in float32 and rounds the product once,
    where a scale rounded to a half dtype first loses its precision (a small one becomes
    a float16 subnormal, with a few bits left)."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.dtype.is_complex or value.dtype == torch.bool:
            raise TypeError(f"{name} must hold real numbers, got {value.dtype}")
        if value.numel() == 1:
            value = float(value)
        elif value.dim() == 1 and value.shape[0] == num_kv_heads:
            if value.device.type != "cpu":
                dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
                return value.to(device=query.device, dtype=dtype).view(1, -1, 1, 1)
            per_head = value.tolist()
            if not all(math.isfinite(x) for x in per_head):
                raise ValueError(f"{name} must be finite, got {per_head}")
            if any(x != per_head[0] for x in per_head):
                return tuple(float(x) for x in per_head)
            value = float(per_head[0])
        else:
            raise ValueError(
                f"{name} must be a number, one value, or [num_kv_heads="
                f"{num_kv_heads}] values, got shape {tuple(value.shape)}"
            )
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number or a tensor, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return None if value == 1 else float(value)


def _apply_scale(x: torch.Tensor, scale) -> None:
    """Multiply gathered ``[size, kv_heads, keys, head_dim]`` K or V (a copy, never the
    pages) by a scale of :func:`_as_scale`, in place. Torch multiplies a half tensor by a
    Python number, or by a float32 tensor, in float32 and rounds once: a number and the
    same number per head give the same bits. Per head on the CPU, one multiply each: a
    float32 tensor there would go through a mixed-dtype loop (2.5x slower, measured)."""
    if isinstance(scale, tuple):
        for head, value in enumerate(scale):
            x[:, head].mul_(value)
    else:
        x.mul_(scale)


# Integer dtypes by element size: gathered slots are zeroed through one of these views
# (all bits zero is +0 in every float format, float8 included, whose fills torch lacks).
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _zero_slots(gathered: torch.Tensor, slots: torch.Tensor) -> None:
    """Zero key slots ``slots`` (rows of ``[blocks * block_size, ...]``) of a contiguous
    gathered ``[blocks, block_size, kv_heads, head_dim]`` copy, in place."""
    rows = gathered.view(_BITS[gathered.element_size()])
    rows.view(-1, rows.shape[2] * rows.shape[3]).index_fill_(0, slots, 0)


def _page_outside(num_blocks: int) -> ValueError:
    return ValueError(
        f"block_table names a page outside [0, {num_blocks}) within a sequence's blocks"
    )


def _unwritten(num_rows: int, work: List[_Seq]) -> List[tuple]:
    """``(lo, hi)`` ranges of the rows no group writes: padding rows, rows with nothing
    to attend to. They get zeros."""
    ranges, done = [], 0
    for s in sorted(work, key=lambda s: s.row0):
        if s.row0 > done:
            ranges.append((done, s.row0))
        done = s.row0 + s.num_queries
    if done < num_rows:
        ranges.append((done, num_rows))
    return ranges


def _trim(seqs: List[_Seq], causal: bool) -> List[_Seq]:
    """Drop the rows that attend to nothing and cut each sequence's keys to those read."""
    work = []
    for s in seqs:
        row0, count, start, num_keys = s.row0, s.num_queries, s.start, s.num_keys
        if causal:
            if start < 0:  # rows at negative positions see no key: left as zeros
                row0, count, start = row0 - start, count + start, 0
            num_keys = min(num_keys, start + count)
        if count > 0 and num_keys > 0:
            work.append(_Seq(s.batch_index, row0, count, start, num_keys))
    return work


def _groups(work: List[_Seq]) -> List[List[_Seq]]:
    """Sequences that share one SDPA call: same query count, similar key counts.

    Members keep batch order inside a group, so a batch whose sequences all fit in one
    group reads and writes its rows as views, without index copies.
    """
    ordered = sorted(work, key=lambda s: (s.num_queries, -s.num_keys))
    groups: List[List[_Seq]] = []
    for s in ordered:
        head = groups[-1][0] if groups else None
        if (
            head is None
            or head.num_queries != s.num_queries
            or (head.num_keys - s.num_keys) * s.num_queries > _MAX_PAD_SCORES
        ):
            groups.append([s])
        else:
            groups[-1].append(s)
    return [sorted(g, key=lambda s: s.batch_index) for g in groups]


class _Group:
    """One SDPA call of a plan: its members' gather index, query rows and mask."""

    __slots__ = (
        "index",
        "size",
        "count",
        "blocks",
        "num_keys",
        "row0",
        "rows",
        "mask",
        "grouped",
        "is_causal",
        "whole",
        "_held",
        "_kv",
        "lens",
        "_native",
        "outside",
    )

    def __init__(
        self,
        table: torch.Tensor,
        group: List[_Seq],
        causal: bool,
        num_heads: int,
        num_kv_heads: int,
        block_size: int,
        device: torch.device,
        query_device: torch.device,
    ) -> None:
        heads_per_kv = num_heads // num_kv_heads
        size, count = len(group), group[0].num_queries
        num_keys = max(s.num_keys for s in group)
        blocks = -(-num_keys // block_size)
        self.size, self.count, self.blocks, self.num_keys = size, count, blocks, num_keys
        self.whole = False  # the plan's only group, over every query row in order
        # (workspace buffer, gather outputs, their K/V views)
        self._held: Optional[
            Tuple[Optional[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
        ] = None
        # those views cut to num_keys
        self._kv: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
        # (int32 table, int64 lengths) for the native kernel
        self._native: Optional[Tuple[torch.Tensor, torch.Tensor]] = None

        first = group[0].batch_index
        indexes = [s.batch_index for s in group]
        if indexes == list(range(first, first + size)):
            idx = table[first : first + size, :blocks]
        else:
            idx = table.index_select(0, torch.tensor(indexes, device=table.device))[:, :blocks]
        short = [-(-s.num_keys // block_size) for s in group]
        if min(short) < blocks:  # table entries past a member's last block may be garbage
            unused = (
                torch.arange(blocks, device=table.device)[None, :]
                >= torch.tensor(short, device=table.device)[:, None]
            )
            idx = idx.masked_fill(unused, 0)
        self.index = idx.reshape(-1).contiguous()

        self.row0 = group[0].row0
        self.rows = None
        if any(b.row0 != a.row0 + count for a, b in zip(group, group[1:])):
            self.rows = torch.tensor(
                [s.row0 + i for s in group for i in range(count)], device=query_device
            )

        pad = any(s.num_keys < num_keys for s in group)
        # Rows of the gathered [size * blocks * block_size] key slots that lie past their
        # member's length (its last block's tail, and the page-0 stand-ins above): zeroed
        # in the gathered copy, since the mask cannot stop NaN or inf held there.
        self.outside = None
        if pad:
            lengths = torch.tensor([s.num_keys for s in group], device=device)
            past = torch.arange(num_keys, device=device)[None, :] >= lengths[:, None]
            member, pos = past.nonzero(as_tuple=True)
            self.outside = member * (blocks * block_size) + pos
        restrict = causal and any(s.start < s.num_keys - 1 for s in group)
        # Each member's key count, when that is all its mask says: one query each, which
        # sees every key of its sequence (the native kernel's case); else None.
        self.lens = [s.num_keys for s in group] if count == 1 and not restrict else None
        mask = None
        if pad or restrict:
            key_pos = torch.arange(num_keys, device=device)
            lengths = torch.tensor([s.num_keys for s in group], device=device)
            mask = key_pos < lengths[:, None, None]  # [size, 1, keys]
            if restrict:
                query_pos = torch.tensor([s.start for s in group], device=device)[
                    :, None
                ] + torch.arange(count, device=device)
                mask = mask & (key_pos <= query_pos[:, :, None])  # [size, count, keys]
            mask = mask[:, None]  # [size, 1, count or 1, keys]

        self.grouped = heads_per_kv > 1 and (
            count * heads_per_kv <= _GROUPED_MAX_ROWS or not _HAS_ENABLE_GQA
        )
        self.is_causal = False
        if self.grouped:
            if mask is not None and mask.shape[2] > 1:
                mask = (
                    mask[:, :, :, None]
                    .expand(size, 1, count, heads_per_kv, num_keys)
                    .reshape(size, 1, count * heads_per_kv, num_keys)
                )
        elif restrict and not pad and count == num_keys and all(s.start == 0 for s in group):
            # whole-sequence prefills: SDPA's own top-left mask is the same
            self.is_causal, mask = True, None
        self.mask = mask

    def gather(
        self, k_pages: torch.Tensor, v_pages: torch.Tensor, workspace: Optional[AttentionWorkspace]
    ) -> tuple:
        """The members' K and V, ``[size, kv_heads, keys, head_dim]`` views of the pages'
        dtype (into the workspace when there is one)."""
        index = self.index
        held = self._held
        if workspace is not None and k_pages.dtype == v_pages.dtype:
            if held is None or held[0] is not workspace._buffer or held[1].dtype != k_pages.dtype:
                # Views of the workspace, made once per plan: the gathers of later calls
                # (other layers) write the same memory, so they are the K/V again.
                num, rest = index.shape[0], k_pages.shape[1:]
                numel = num * rest.numel()
                space = workspace._take(2 * numel, k_pages.dtype, k_pages.device)
                k_out, v_out = space[:numel].view(num, *rest), space[numel:].view(num, *rest)
                held = self._held = (
                    workspace._buffer,
                    k_out,
                    v_out,
                    self._keys(k_out),
                    self._keys(v_out),
                )
                self._kv = None
            torch.index_select(k_pages, 0, index, out=held[1])
            torch.index_select(v_pages, 0, index, out=held[2])
            if self.outside is not None:
                _zero_slots(held[1], self.outside)
                _zero_slots(held[2], self.outside)
            kv = self._kv
            if kv is None:
                kv = self._kv = (held[3][:, :, : self.num_keys], held[4][:, :, : self.num_keys])
            return kv
        k, v = k_pages.index_select(0, index), v_pages.index_select(0, index)
        if self.outside is not None:
            _zero_slots(k, self.outside)
            _zero_slots(v, self.outside)
        return (self._keys(k)[:, :, : self.num_keys], self._keys(v)[:, :, : self.num_keys])

    def _keys(self, gathered: torch.Tensor) -> torch.Tensor:
        """``[size * blocks, block_size, kv_heads, dim]`` -> ``[size, kv_heads, blocks *
        block_size, dim]``."""
        _, block_size, num_kv_heads, head_dim = gathered.shape
        return gathered.view(self.size, self.blocks * block_size, num_kv_heads, head_dim).transpose(
            1, 2
        )

    def with_keys(self, num_keys: int) -> "_Group":
        """This group of one query per sequence with ``num_keys`` keys each, in the same
        blocks: the decode step after this one (no mask, so every member had
        ``self.num_keys``)."""
        group = _Group.__new__(_Group)
        for name in _Group.__slots__:
            setattr(group, name, getattr(self, name))
        group.num_keys, group._kv, group._native = num_keys, None, None
        group.lens = [num_keys] * self.size
        return group

    def native(
        self,
        query: torch.Tensor,
        k_pages: torch.Tensor,
        v_pages: torch.Tensor,
        scale: Optional[float],
    ) -> Optional[torch.Tensor]:
        """The group's decode by the native kernel (:mod:`shmkv.kernels.native`), reading the
        pages in place: ``[size, num_heads, head_dim]``; None when the kernel does not
        take this call (more than one query per member, another dtype or device, pages
        not made of contiguous chunks, no kernel built)."""
        if self.lens is None or not native.usable(query, k_pages, v_pages):
            return None
        kernels = native.decoder()
        if kernels is None:
            return None
        made = self._native
        if made is None:
            made = self._native = (
                self.index.view(self.size, self.blocks).to(torch.int32).contiguous(),
                torch.tensor(self.lens, dtype=torch.int64),
            )
        head_dim = k_pages.shape[3]
        q = query.reshape(self.size, -1, head_dim).contiguous()
        return native.run_checked(
            kernels,
            q,
            k_pages,
            v_pages,
            made[0],
            made[1],
            self.lens,
            head_dim**-0.5 if scale is None else scale,
            torch.empty(q.shape, dtype=q.dtype),
        )

    def decode(
        self,
        query: torch.Tensor,
        k_pages: torch.Tensor,
        v_pages: torch.Tensor,
        scale: Optional[float],
        workspace: Optional[AttentionWorkspace],
    ) -> torch.Tensor:
        """A plan's ``decode_group``, unchecked: ``query`` holds ``[size, num_heads,
        head_dim]`` elements in that order (any shape), the pages are of the query's dtype
        and shaped as the plan's (callers that built the plan from pages and queries like
        these). Returns ``[size, num_kv_heads, heads_per_kv, head_dim]``: the result rows
        in ``[size, num_heads, head_dim]`` order."""
        _, _, num_kv_heads, head_dim = k_pages.shape
        o = self.native(query, k_pages, v_pages, scale)
        if o is not None:
            return o.view(self.size, num_kv_heads, -1, head_dim)
        k, v = self.gather(k_pages, v_pages, workspace)
        return F.scaled_dot_product_attention(
            query.reshape(self.size, num_kv_heads, -1, head_dim),
            k,
            v,
            attn_mask=self.mask,
            scale=scale,
        )

    def run(
        self,
        query: torch.Tensor,
        k_pages: torch.Tensor,
        v_pages: torch.Tensor,
        scale: Optional[float],
        workspace: Optional[AttentionWorkspace],
        scales: tuple,
    ) -> torch.Tensor:
        """The group's attention over its query rows in order: ``[size * count,
        num_heads, head_dim]``, or any shape of as many elements when the group is the
        whole call (``query`` is then the caller's query, else its rows flattened)."""
        num_kv_heads, head_dim = k_pages.shape[2:]
        num_heads = query.shape[-2]
        size, count = self.size, self.count
        if scales == (None, None) and self.lens is not None:
            q = (
                query
                if self.whole
                else query[self.row0 : self.row0 + size]
                if self.rows is None
                else query.index_select(0, self.rows)
            )
            o = self.native(q, k_pages, v_pages, scale)
            if o is not None:
                return o
        k, v = self.gather(k_pages, v_pages, workspace)
        if k.dtype != query.dtype:
            k, v = k.to(query.dtype), v.to(query.dtype)
        if scales[0] is not None:
            _apply_scale(k, scales[0])
        if scales[1] is not None:
            _apply_scale(v, scales[1])

        heads_per_kv = num_heads // num_kv_heads
        if self.grouped and count == 1:
            # Decode: the query heads of each K/V head are the rows of one SDPA "head"
            # [size, kv_heads, heads_per_kv, dim], a view of the query (of any form).
            q = (
                query
                if self.whole
                else query[self.row0 : self.row0 + size]
                if self.rows is None
                else query.index_select(0, self.rows)
            )
            o = F.scaled_dot_product_attention(
                q.reshape(size, num_kv_heads, heads_per_kv, head_dim),
                k,
                v,
                attn_mask=self.mask,
                scale=scale,
            )
            return o if self.whole else o.reshape(size, num_heads, head_dim)
        flat_q = query.reshape(-1, num_heads, head_dim) if self.whole else query
        rows = self.rows
        q = (
            flat_q
            if self.whole
            else flat_q[self.row0 : self.row0 + size * count]
            if rows is None
            else flat_q.index_select(0, rows)
        )  # [size * count, heads, dim]
        if self.grouped:
            # Fold the query heads of each K/V head into the rows: [size, kv_heads,
            # count * heads_per_kv, dim] against K/V as they are.
            qg = (
                q.reshape(size, count, num_kv_heads, heads_per_kv, head_dim)
                .permute(0, 2, 1, 3, 4)
                .reshape(size, num_kv_heads, count * heads_per_kv, head_dim)
            )
            o = F.scaled_dot_product_attention(qg, k, v, attn_mask=self.mask, scale=scale)
            o = o.reshape(size, num_kv_heads, count, heads_per_kv, head_dim).permute(0, 2, 1, 3, 4)
        else:
            qh = q.reshape(size, count, num_heads, head_dim).transpose(1, 2)
            extra = {"enable_gqa": True} if num_heads != num_kv_heads else {}
            o = F.scaled_dot_product_attention(
                qh, k, v, attn_mask=self.mask, is_causal=self.is_causal, scale=scale, **extra
            )
            o = o.transpose(1, 2)  # [size, count, heads, dim]
        return o.reshape(size * count, num_heads, head_dim)
