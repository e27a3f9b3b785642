"""Position -> slot arithmetic, for handles and batches alike.

Owns every formula that turns (block table, token position) into a place in the
pool. Two coordinate systems:

* a **slot** (vLLM's ``slot_mapping`` convention): ``block_id * block_size + offset``,
  the same for every layer, K and V;
* a **row** of the pool in storage order (``shmkv.memory.layout``: layer-major ``[num_layers,
  2, num_blocks, block_size, heads, head_dim]``) seen as ``rows = storage.view(-1,
  heads, head_dim)``: one token of one layer's K or V. Token ``offset`` of block
  ``b``, layer ``l``, K (0) or V (1) is row ``(2 * l + which) * num_blocks *
  block_size + b * block_size + offset``: layer 0's K row of a position is its slot.
* a **chunk** of the pool seen as ``chunks = storage.view(-1, block_size, heads,
  head_dim)``: one block of one layer's K or V, index ``(2 * l + which) * num_blocks
  + b``.

Does not read block tables (``shmkv.memory.tables``) or move bytes (``shmkv.client.handle``,
``shmkv.client.batch``): inputs are lists or tensors of block ids, outputs index tensors.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import numpy as np
import torch


def layer_row(layer: int, which: int, num_blocks: int, block_size: int) -> int:
    """What to add to a layer-0-K row (a slot) for layer ``layer``'s K (0) or V (1)."""
    return (2 * layer + which) * num_blocks * block_size


def position_rows(
    blocks: Sequence[int], block_size: int, device: Optional[torch.device] = None
) -> torch.Tensor:
    """Row of layer 0's K (the slot) of every position a block table covers:
    ``[len(blocks) * block_size]`` int64. Add :func:`layer_row` for another layer."""
    table = torch.tensor(blocks, dtype=torch.int64)
    base = table[:, None] * block_size + torch.arange(block_size)
    return base.reshape(-1).to(device) if device is not None else base.reshape(-1)


def layer_offsets(
    num_layers: int, num_blocks: int, block_size: int, device: Optional[torch.device] = None
) -> torch.Tensor:
    """``[2 * num_layers]``: what to add to a layer-0-K row for layer ``l``, K or V
    (index ``2 * l + which``)."""
    return torch.arange(2 * num_layers, device=device) * (num_blocks * block_size)


def all_layer_rows(
    base_rows: torch.Tensor, num_layers: int, num_blocks: int, block_size: int
) -> torch.Tensor:
    """``[2 * num_layers, n]``: rows of every layer's K and V for layer-0-K rows
    ``base_rows`` (slots); row ``2 * l + which`` of the result is contiguous."""
    return (
        layer_offsets(num_layers, num_blocks, block_size, base_rows.device)[:, None]
        + base_rows[None, :]
    )


def spans(
    blocks: Sequence[int],
    block_size: int,
    num_layers: int,
    num_blocks: int,
    start: int,
    n: int,
    device: Optional[torch.device] = None,
) -> tuple:
    """How positions ``[start, start + n)`` of a table lie in blocks:
    ``(head, (middle, middle_rows), tail)``.

    ``head`` and ``tail`` are ``(row, length)`` of a partly covered first and last
    block (``row``: layer 0's K row; length 0 when there is none). ``middle`` is
    ``[2 * num_layers, num_full]``: the fully covered blocks' chunk indices, row
    ``2 * layer + which``; ``middle_rows`` the same as a tuple of rows. Both None when
    no block is fully covered.
    """
    first, offset = divmod(start, block_size)
    head_len = min(n, block_size - offset) if offset else 0
    head = (blocks[first] * block_size + offset, head_len)
    index = first + (1 if head_len else 0)
    full = (n - head_len) // block_size
    middle = middle_rows = None
    if full:
        table = torch.tensor(blocks[index : index + full], dtype=torch.int64)
        middle = table[None, :] + torch.arange(2 * num_layers)[:, None] * num_blocks
        if device is not None:
            middle = middle.to(device)
        middle_rows = middle.unbind(0)
    tail_len = n - head_len - full * block_size
    tail = (blocks[index + full] * block_size if tail_len else 0, tail_len)
    return head, (middle, middle_rows), tail


def batch_slots(
    tables: np.ndarray,
    starts: np.ndarray,
    counts: np.ndarray,
    query_start_loc: Optional[np.ndarray],
    num_tokens: int,
    block_size: int,
    uniform_count: int = -1,
) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(slot_mapping, seq_index, positions)`` of a step's new tokens, vectorized
    (numpy: these arrays are small, and numpy's per-op cost is a fraction of torch's).

    Args:
        tables: ``[B, max_blocks]`` block ids of each sequence.
        starts: ``[B]`` int64 position of each sequence's first new token.
        counts: ``[B]`` int64 new tokens per sequence.
        query_start_loc: ``[B + 1]`` int64 cumulative counts; None with a
            ``uniform_count``.
        num_tokens: ``T``, the sum of counts.
        uniform_count: the count when every sequence has the same one (decode: 1), for
            a shorter computation; -1 otherwise.

    Returns:
        Three int64 arrays ``[T]``: the slot of each new token, which sequence it
        belongs to, and its position in that sequence.
    """
    batch = starts.shape[0]
    if uniform_count == 1:  # decode: one token per sequence, at its start
        seq_index = np.arange(batch, dtype=np.int64)
        index, offset = np.divmod(starts, block_size)
        slot_mapping = np.multiply(tables[seq_index, index], block_size, dtype=np.int64)
        slot_mapping += offset
        return slot_mapping, seq_index, starts
    tokens = np.arange(num_tokens, dtype=np.int64)
    if uniform_count > 0:
        seq_index, offsets = tokens // uniform_count, tokens % uniform_count
    else:
        assert query_start_loc is not None  # (None only with a uniform count)
        seq_index = np.searchsorted(query_start_loc[1:], tokens, side="right")
        offsets = tokens - query_start_loc[seq_index]
    positions = starts[seq_index] + offsets
    block_ids = tables[seq_index, positions // block_size].astype(np.int64)
    return block_ids * block_size + positions % block_size, seq_index, positions
