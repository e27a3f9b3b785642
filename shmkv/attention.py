"""Paged attention over the pool's block layout, in plain torch.

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
multiplied by the caller's ``k_scale`` / ``v_scale``. On a GPU,
FlashAttention's ``flash_attn_with_kvcache(..., block_table=)`` and FlashInfer's paged
kernels read the same pages in place, without the gather (see ``docs/transformers.md``).

This module does not write K/V, does not resolve block tables (callers pass them)
and does not talk to a coordinator. Reading lengths and query offsets needs their
values on the host: tensors on a GPU are copied back (one sync per call).
"""

from __future__ import annotations

import math
from typing import List, NamedTuple, Optional, Sequence, Union

import torch
import torch.nn.functional as F

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
            buf = self._buffer = torch.empty(max(numel, 2 * buf.numel()), dtype=dtype,
                                             device=device)
        return buf[:numel]


class _Seq(NamedTuple):
    """One sequence's share of the work: query rows ``row0 .. row0 + count - 1`` sit at
    positions ``start .. start + count - 1`` and read keys ``0 .. num_keys - 1``."""
    index: int
    row0: int
    count: int
    start: int
    num_keys: int


def _as_lengths(name: str, value: IntsLike, batch: int) -> List[int]:
    t = torch.as_tensor(value)
    if t.dim() != 1 or t.shape[0] != batch:
        raise ValueError(f"{name} must have one entry per sequence ({batch}), "
                         f"got shape {tuple(t.shape)}")
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"{name} must hold integers, got {t.dtype}")
    return t.tolist()


def paged_attention(query: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                    block_table: torch.Tensor, seq_lens: IntsLike, *,
                    scale: Optional[float] = None, causal: bool = True,
                    query_start: Optional[IntsLike] = None,
                    query_start_loc: Optional[IntsLike] = None,
                    out: Optional[torch.Tensor] = None,
                    workspace: Optional[AttentionWorkspace] = None,
                    k_scale: ScaleLike = None, v_scale: ScaleLike = None) -> torch.Tensor:
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
            slots past a sequence's length inside its gathered blocks are masked; they
            must hold finite values, as pool memory does.
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
            are converted to the query's dtype as they are gathered, then scaled;
            ``client.kv_scales(layer)`` gives what was kept beside the pool. Default 1.

    Returns:
        A tensor shaped like ``query``, in its dtype. Scores and softmax are computed
        by ``scaled_dot_product_attention`` in that dtype (pages of another dtype are
        converted as gathered). A query row with nothing to attend to (its position is
        negative, as for a padding row placed before a short sequence's first token,
        or its sequence is empty) gets zeros, not NaN.

    Raises:
        ValueError / TypeError: inconsistent shapes, head counts, dtypes, lengths or
            offsets, or a page id outside the pages.
    """
    packed = query_start_loc is not None
    if packed:
        if query.dim() != 3:
            raise ValueError("with query_start_loc, query must be packed tokens "
                             f"[num_tokens, num_heads, head_dim], got shape {tuple(query.shape)}")
        if query_start is not None:
            raise ValueError("query_start belongs to the batch form; with query_start_loc "
                             "the queries are the last tokens of each sequence")
        q = query
    else:
        q = query.unsqueeze(1) if query.dim() == 3 else query
        if q.dim() != 4:
            raise ValueError("query must be [batch, q_len, num_heads, head_dim] or "
                             f"[batch, num_heads, head_dim], got shape {tuple(query.shape)}")
    if not query.dtype.is_floating_point:
        raise TypeError(f"query must be floating point, got {query.dtype}")
    if k_pages.dim() != 4 or k_pages.shape != v_pages.shape:
        raise ValueError("k_pages and v_pages must both be [num_blocks, block_size, "
                         f"num_kv_heads, head_dim], got {tuple(k_pages.shape)} and "
                         f"{tuple(v_pages.shape)}")
    if not (_readable(k_pages.dtype) and _readable(v_pages.dtype)):
        raise TypeError(f"k_pages and v_pages must be floating point or int8 (quantized), got "
                        f"{k_pages.dtype} and {v_pages.dtype}")
    num_heads, head_dim = q.shape[-2:]
    num_blocks, block_size, num_kv_heads, kv_dim = k_pages.shape
    if kv_dim != head_dim:
        raise ValueError(f"query head_dim {head_dim} differs from the pages' {kv_dim}")
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of "
                         f"num_kv_heads={num_kv_heads}")
    if block_table.dim() != 2 or (not packed and block_table.shape[0] != q.shape[0]):
        rows = "batch" if packed else f"batch={q.shape[0]}"
        raise ValueError(f"block_table must be [{rows}, max_blocks], "
                         f"got shape {tuple(block_table.shape)}")
    batch = block_table.shape[0]
    if block_table.dtype.is_floating_point or block_table.dtype == torch.bool:
        raise TypeError(f"block_table must hold integers, got {block_table.dtype}")
    if workspace is not None and not isinstance(workspace, AttentionWorkspace):
        raise TypeError(f"workspace must be an AttentionWorkspace, got "
                        f"{type(workspace).__name__}")
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out must be a tensor, got {type(out).__name__}")
        if out.shape != query.shape or out.dtype != query.dtype or out.device != query.device:
            raise ValueError(f"out must be shaped like query {tuple(query.shape)} "
                             f"({query.dtype} on {query.device}), got {tuple(out.shape)} "
                             f"({out.dtype} on {out.device})")
    scales = (_as_scale("k_scale", k_scale, num_kv_heads, query),
              _as_scale("v_scale", v_scale, num_kv_heads, query))
    lens = _as_lengths("seq_lens", seq_lens, batch)
    if lens and min(lens) < 0:
        raise ValueError(f"seq_lens must not be negative, got {lens}")
    if lens and -(-max(lens) // block_size) > block_table.shape[1]:
        raise ValueError(f"seq_lens {lens} need more blocks than block_table has "
                         f"({block_table.shape[1]} of {block_size} tokens)")

    if packed:
        locs = _as_lengths("query_start_loc", query_start_loc, batch + 1)
        num_rows = q.shape[0]
        if locs[0] < 0 or locs[-1] > num_rows or any(a > b for a, b in zip(locs, locs[1:])):
            raise ValueError(f"query_start_loc must be non-decreasing offsets into the "
                             f"{num_rows} query rows, got {locs}")
        seqs = [_Seq(b, locs[b], locs[b + 1] - locs[b], lens[b] - (locs[b + 1] - locs[b]),
                     lens[b]) for b in range(batch)]
    else:
        q_len = q.shape[1]
        num_rows = batch * q_len
        starts = ([n - q_len for n in lens] if query_start is None or not causal
                  else _as_lengths("query_start", query_start, batch))
        seqs = [_Seq(b, b * q_len, q_len, starts[b], lens[b]) for b in range(batch)]
    work = _trim(seqs, causal)

    flat_q = q if packed else q.reshape(num_rows, num_heads, head_dim)
    into_out = out is not None and out.is_contiguous()
    result = (out.view(num_rows, num_heads, head_dim) if into_out
              else query.new_empty((num_rows, num_heads, head_dim)))
    _zero_unwritten(result, work)
    if work:
        needed = max(-(-s.num_keys // block_size) for s in work)
        table = block_table[:, :needed].to(k_pages.device)
        if table.dtype not in (torch.int32, torch.int64):
            table = table.long()
        scale = None if scale is None else float(scale)
        for group in _groups(work):
            _attend(flat_q, k_pages, v_pages, table, group, causal, scale, result, workspace,
                    scales)
    if out is None:
        return result.view(query.shape)
    if not into_out:
        out.copy_(result.view(query.shape))
    return out


def _readable(dtype: torch.dtype) -> bool:
    """Page dtypes paged_attention reads: floating point (float8 included) and int8."""
    return dtype.is_floating_point or dtype == torch.int8


def _as_scale(name: str, value: ScaleLike, num_kv_heads: int, query: torch.Tensor):
    """None (no scaling), a float, or a ``[1, num_kv_heads, 1, 1]`` tensor in the query's
    dtype and device (broadcast over ``[batch, kv_heads, keys, head_dim]``)."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.numel() == 1:
            value = float(value)
        elif value.dim() == 1 and value.shape[0] == num_kv_heads:
            return value.to(device=query.device, dtype=query.dtype).view(1, -1, 1, 1)
        else:
            raise ValueError(f"{name} must be a number, one value, or [num_kv_heads="
                             f"{num_kv_heads}] values, got shape {tuple(value.shape)}")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number or a tensor, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return None if value == 1 else float(value)


def _page_outside(num_blocks: int) -> ValueError:
    return ValueError(f"block_table names a page outside [0, {num_blocks}) "
                      "within a sequence's blocks")


def _zero_unwritten(result: torch.Tensor, work: List[_Seq]) -> None:
    """Zero the rows no group will write: padding rows, rows with nothing to attend to."""
    done = 0
    for s in sorted(work, key=lambda s: s.row0):
        if s.row0 > done:
            result[done:s.row0].zero_()
        done = s.row0 + s.count
    if done < result.shape[0]:
        result[done:].zero_()


def _trim(seqs: List[_Seq], causal: bool) -> List[_Seq]:
    """Drop the rows that attend to nothing and cut each sequence's keys to those read."""
    work = []
    for s in seqs:
        row0, count, start, num_keys = s.row0, s.count, s.start, s.num_keys
        if causal:
            if start < 0:  # rows at negative positions see no key: left as zeros
                row0, count, start = row0 - start, count + start, 0
            num_keys = min(num_keys, start + count)
        if count > 0 and num_keys > 0:
            work.append(_Seq(s.index, row0, count, start, num_keys))
    return work


def _groups(work: List[_Seq]) -> List[List[_Seq]]:
    """Sequences that share one SDPA call: same query count, similar key counts.

    Members keep batch order inside a group, so a batch whose sequences all fit in one
    group reads and writes its rows as views, without index copies.
    """
    ordered = sorted(work, key=lambda s: (s.count, -s.num_keys))
    groups: List[List[_Seq]] = []
    for s in ordered:
        head = groups[-1][0] if groups else None
        if (head is None or head.count != s.count
                or (head.num_keys - s.num_keys) * s.count > _MAX_PAD_SCORES):
            groups.append([s])
        else:
            groups[-1].append(s)
    return [sorted(g, key=lambda s: s.index) for g in groups]


def _attend(flat_q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
            table: torch.Tensor, group: List[_Seq], causal: bool,
            scale: Optional[float], result: torch.Tensor,
            workspace: Optional[AttentionWorkspace], scales: tuple = (None, None)) -> None:
    """One SDPA call for ``group``; writes its query rows of ``result``."""
    device = k_pages.device
    num_blocks, block_size, num_kv_heads, head_dim = k_pages.shape
    num_heads = flat_q.shape[1]
    heads_per_kv = num_heads // num_kv_heads
    size, count = len(group), group[0].count
    num_keys = max(s.num_keys for s in group)
    blocks = -(-num_keys // block_size)

    first = group[0].index
    indexes = [s.index for s in group]
    if indexes == list(range(first, first + size)):
        idx = table[first:first + size, :blocks]
    else:
        idx = table.index_select(0, torch.tensor(indexes, device=table.device))[:, :blocks]
    short = [-(-s.num_keys // block_size) for s in group]
    if min(short) < blocks:  # table entries past a member's last block may be garbage
        unused = (torch.arange(blocks, device=table.device)[None, :]
                  >= torch.tensor(short, device=table.device)[:, None])
        idx = idx.masked_fill(unused, 0)
    idx = idx.reshape(-1)
    if idx.device.type != "cpu":  # there a bad index is a device-side assert: check first
        low, high = torch.stack(torch.aminmax(idx)).tolist()
        if low < 0 or high >= num_blocks:
            raise _page_outside(num_blocks)

    shape = (size * blocks, block_size, num_kv_heads, head_dim)
    space = None
    if workspace is not None and k_pages.dtype == v_pages.dtype:
        numel = shape[0] * block_size * num_kv_heads * head_dim
        space = workspace._take(2 * numel, k_pages.dtype, device).view(2, *shape)

    def gather(pages: torch.Tensor, which: int) -> torch.Tensor:
        kv = (pages.index_select(0, idx) if space is None
              else torch.index_select(pages, 0, idx, out=space[which]))
        kv = kv.view(size, blocks * block_size, num_kv_heads, head_dim)[:, :num_keys]
        kv = kv.transpose(1, 2)                               # [size, kv_heads, keys, dim]
        kv = kv if kv.dtype == flat_q.dtype else kv.to(flat_q.dtype)
        dequant = scales[which]
        return kv if dequant is None else kv * dequant

    try:
        k, v = gather(k_pages, 0), gather(v_pages, 1)
    except IndexError:  # on CPU index_select checks the ids itself
        raise _page_outside(num_blocks) from None

    row0 = group[0].row0
    rows = None
    if any(b.row0 != a.row0 + count for a, b in zip(group, group[1:])):
        rows = torch.tensor([s.row0 + i for s in group for i in range(count)],
                            device=flat_q.device)
    q = (flat_q[row0:row0 + size * count] if rows is None
         else flat_q.index_select(0, rows))                    # [size * count, heads, dim]

    pad = any(s.num_keys < num_keys for s in group)
    restrict = causal and any(s.start < s.num_keys - 1 for s in group)
    mask = None
    if pad or restrict:
        key_pos = torch.arange(num_keys, device=device)
        lengths = torch.tensor([s.num_keys for s in group], device=device)
        mask = key_pos < lengths[:, None, None]                       # [size, 1, keys]
        if restrict:
            query_pos = (torch.tensor([s.start for s in group], device=device)[:, None]
                         + torch.arange(count, device=device))
            mask = mask & (key_pos <= query_pos[:, :, None])          # [size, count, keys]
        mask = mask[:, None]                                   # [size, 1, count or 1, keys]

    grouped = heads_per_kv > 1 and (count * heads_per_kv <= _GROUPED_MAX_ROWS
                                    or not _HAS_ENABLE_GQA)
    if grouped:
        # Fold the query heads of each K/V head into the rows: [size, kv_heads,
        # count * heads_per_kv, dim] against K/V as they are (a view for one query).
        qg = (q.reshape(size, count, num_kv_heads, heads_per_kv, head_dim)
              .permute(0, 2, 1, 3, 4).reshape(size, num_kv_heads, count * heads_per_kv, head_dim))
        if mask is not None and mask.shape[2] > 1:
            mask = (mask[:, :, :, None].expand(size, 1, count, heads_per_kv, num_keys)
                    .reshape(size, 1, count * heads_per_kv, num_keys))
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)
        o = o.view(size, num_kv_heads, count, heads_per_kv, head_dim).permute(0, 2, 1, 3, 4)
    else:
        qh = q.reshape(size, count, num_heads, head_dim).transpose(1, 2)
        is_causal = (restrict and not pad and count == num_keys
                     and all(s.start == 0 for s in group))
        if is_causal:  # whole-sequence prefills: SDPA's own top-left mask is the same
            mask = None
        extra = {"enable_gqa": True} if heads_per_kv > 1 else {}
        o = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, is_causal=is_causal,
                                           scale=scale, **extra)
        o = o.transpose(1, 2)                                  # [size, count, heads, dim]
    o = o.reshape(size * count, num_heads, head_dim)
    if rows is None:
        result[row0:row0 + size * count].copy_(o)
    else:
        result.index_copy_(0, rows, o)
