"""Paged attention over the pool's block layout, in plain torch.

Owns :func:`paged_attention`: attention of a batch of query tokens against K/V held
in pages ``[num_blocks, block_size, num_kv_heads, head_dim]`` (what
``KvCacheHandle.paged_kv(layer)`` returns) through a block table, for decode (one
query token per sequence) and prefill (several, causal), with grouped-query
attention. It is a reference implementation that runs anywhere torch does: it
gathers each sequence's blocks into a dense tensor first. On a GPU, FlashAttention's
``flash_attn_with_kvcache(..., block_table=)`` and FlashInfer's paged kernels read
the same pages in place (see ``docs/transformers.md``). This module does not write
K/V and does not talk to a coordinator.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Union

import torch

IntsLike = Union[torch.Tensor, Sequence[int]]


def _as_lengths(name: str, value: IntsLike, batch: int, device) -> torch.Tensor:
    t = torch.as_tensor(value, device=device)
    if t.dim() != 1 or t.shape[0] != batch:
        raise ValueError(f"{name} must have one entry per sequence ({batch}), "
                         f"got shape {tuple(t.shape)}")
    if t.dtype.is_floating_point or t.dtype == torch.bool:
        raise TypeError(f"{name} must hold integers, got {t.dtype}")
    return t.to(torch.int64)


def paged_attention(query: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                    block_table: torch.Tensor, seq_lens: IntsLike, *,
                    scale: Optional[float] = None, causal: bool = True,
                    query_start: Optional[IntsLike] = None) -> torch.Tensor:
    """Attention of ``query`` against paged K/V, per sequence of a batch.

    Sequence ``b`` owns the K/V tokens ``0 .. seq_lens[b] - 1``; token ``t`` lives in
    page ``block_table[b, t // block_size]``, slot ``t % block_size``. The query
    tokens' own K/V must already be written there.

    Args:
        query: ``[batch, q_len, num_heads, head_dim]`` (prefill, or several tokens
            per sequence), or ``[batch, num_heads, head_dim]`` (decode: one token per
            sequence). ``num_heads`` is a multiple of ``num_kv_heads`` (grouped-query
            attention: query head ``h`` reads K/V head ``h // (num_heads // num_kv_heads)``).
        k_pages, v_pages: ``[num_blocks, block_size, num_kv_heads, head_dim]``, e.g.
            from ``handle.paged_kv(layer)``. Any strides (pool views are fine).
        block_table: ``[batch, max_blocks]`` integer page ids (int32 as handles give
            them). Entries past a sequence's last block are ignored, whatever they hold.
        seq_lens: ``[batch]`` K/V tokens of each sequence (a tensor or a list of ints).
        scale: multiplier of ``q @ k``; default ``1 / sqrt(head_dim)``.
        causal: query ``i`` of sequence ``b`` sits at position ``query_start[b] + i``
            and attends to keys at positions up to its own. Without it every query
            attends to all ``seq_lens[b]`` keys.
        query_start: ``[batch]`` position of each sequence's first query token;
            default ``seq_lens - q_len`` (the queries are the last tokens, as in
            FlashAttention's bottom-right aligned causal mask). Only used when causal.

    Returns:
        A tensor shaped like ``query``, in its dtype. Scores and softmax are computed
        in float32. A query row with no key to attend to (its position is negative,
        as for a padding row placed before a short sequence's first token) gets
        zeros, not NaN.

    Raises:
        ValueError / TypeError: inconsistent shapes, head counts, dtypes or lengths.
    """
    decode = query.dim() == 3
    q = query.unsqueeze(1) if decode else query
    if q.dim() != 4:
        raise ValueError("query must be [batch, q_len, num_heads, head_dim] or "
                         f"[batch, num_heads, head_dim], got shape {tuple(query.shape)}")
    if k_pages.dim() != 4 or k_pages.shape != v_pages.shape:
        raise ValueError("k_pages and v_pages must both be [num_blocks, block_size, "
                         f"num_kv_heads, head_dim], got {tuple(k_pages.shape)} and "
                         f"{tuple(v_pages.shape)}")
    batch, q_len, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, kv_dim = k_pages.shape
    if kv_dim != head_dim:
        raise ValueError(f"query head_dim {head_dim} differs from the pages' {kv_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of "
                         f"num_kv_heads={num_kv_heads}")
    if block_table.dim() != 2 or block_table.shape[0] != batch:
        raise ValueError(f"block_table must be [batch={batch}, max_blocks], "
                         f"got shape {tuple(block_table.shape)}")
    if block_table.dtype.is_floating_point or block_table.dtype == torch.bool:
        raise TypeError(f"block_table must hold integers, got {block_table.dtype}")
    device = q.device
    lens = _as_lengths("seq_lens", seq_lens, batch, device)
    if batch == 0 or q_len == 0:
        return query.new_zeros(query.shape)
    max_len = int(lens.max())
    if int(lens.min()) < 0 or -(-max_len // block_size) > block_table.shape[1]:
        raise ValueError(f"seq_lens {lens.tolist()} need more blocks than block_table has "
                         f"({block_table.shape[1]} of {block_size} tokens)")
    if causal:
        starts = (lens - q_len if query_start is None
                  else _as_lengths("query_start", query_start, batch, device))
    group = num_heads // num_kv_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)

    max_blocks = max(-(-max_len // block_size), 1)
    table = block_table[:, :max_blocks].to(device=device, dtype=torch.int64)
    used = torch.arange(max_blocks, device=device)[None, :] * block_size < lens[:, None]
    table = torch.where(used, table, torch.zeros_like(table))
    if bool(((table < 0) | (table >= num_blocks)).any()):
        raise ValueError(f"block_table names a page outside [0, {num_blocks})")
    num_keys = max_blocks * block_size
    k = k_pages[table].reshape(batch, num_keys, num_kv_heads, head_dim).float()
    v = v_pages[table].reshape(batch, num_keys, num_kv_heads, head_dim).float()

    qg = q.float().reshape(batch, q_len, num_kv_heads, group, head_dim)
    scores = torch.einsum("bqhgd,bkhd->bhgqk", qg, k) * scale
    key_pos = torch.arange(num_keys, device=device)
    allowed = (key_pos[None, :] < lens[:, None])[:, None, :].expand(batch, q_len, num_keys)
    if causal:
        query_pos = starts[:, None] + torch.arange(q_len, device=device)[None, :]
        allowed = allowed & (key_pos[None, None, :] <= query_pos[:, :, None])
    allowed = allowed[:, None, None]                        # [batch, 1, 1, q_len, keys]
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    probs = torch.where(allowed.any(dim=-1, keepdim=True), probs, torch.zeros_like(probs))
    out = torch.einsum("bhgqk,bkhd->bqhgd", probs, v).reshape(batch, q_len, num_heads, head_dim)
    out = out.to(query.dtype)
    return out.squeeze(1) if decode else out
