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
This module checks the arguments and builds the plan; the groups, their gathers and
the calls are ``shmkv.kernels.gather``'s.

This module does not write K/V, does not resolve block tables (callers pass them)
and does not talk to a coordinator. Reading lengths and query offsets needs their
values on the host: tensors on a GPU are copied back (one sync per plan, so per call
without one).
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence, Union

import torch

from shmkv.kernels.gather import (
    AttentionWorkspace,
    Group,
    SeqWork,
    group_work,
    trim_work,
    unwritten,
)

IntsLike = Union[torch.Tensor, Sequence[int]]
ScaleLike = Union[None, float, torch.Tensor]


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
                SeqWork(
                    b, locs[b], locs[b + 1] - locs[b], lens[b] - (locs[b + 1] - locs[b]), lens[b]
                )
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
            seqs = [SeqWork(b, b * q_len, q_len, starts[b], lens[b]) for b in range(batch)]
        work = trim_work(seqs, causal)

        self.query_shape = tuple(query.shape)
        self.num_rows = num_rows
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.block_size = block_size
        self.device = k_pages.device
        self.query_device = query.device
        self.zero_rows = unwritten(num_rows, work)
        self.groups: List[Group] = []
        self.low, self.high = 0, -1
        if work:
            needed = max(-(-s.num_keys // block_size) for s in work)
            table = block_table[:, :needed]
            if table.device != self.device:
                table = table.to(self.device)
            if table.dtype not in (torch.int32, torch.int64):
                table = table.long()
            self.groups = [
                Group(
                    table, g, causal, num_heads, num_kv_heads, block_size, self.device, query.device
                )
                for g in group_work(work)
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
        self.decode_group: Optional[Group] = None
        if (
            first is not None
            and first.rows is None
            and first.row0 == 0
            and first.size * first.count == num_rows
        ):
            self.whole = first.whole = True
            # One query per sequence, all in one group of folded heads: what a model's
            # decode step is. Group.decode runs it with the fewest torch calls.
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

    Never a tensor of the query's dtype: :func:`apply_scale` multiplies by a Python
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


def _page_outside(num_blocks: int) -> ValueError:
    return ValueError(
        f"block_table names a page outside [0, {num_blocks}) within a sequence's blocks"
    )
