"""How :func:`~shmkv.kernels.attention.paged_attention` runs a batch: its sequences in
groups, each group's pages gathered into one ``scaled_dot_product_attention`` call (or
handed to the native decode kernel).

Owns the grouping rules (by query count, and by how many keys each member needs, within
a padding budget), the gather of a group's pages into a copy (into an
:class:`AttentionWorkspace` when the caller keeps one), the zeroing of gathered key
slots no member may read, the dequantizing multiply of quantized pages, and the call
itself. Does not check the caller's arguments, resolve block tables or read lengths:
``shmkv.kernels.attention`` does, and builds the work list (:class:`SeqWork`) this module
groups. Imports ``shmkv.kernels.native`` only.
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F

from shmkv.kernels import native

# scaled_dot_product_attention(enable_gqa=True) arrived in torch 2.5. Without it the
# query heads of a K/V head are folded into the query rows instead (a view, no copy).
HAS_ENABLE_GQA = torch.__version__ >= "2.5"
# With few query rows per sequence, folding the query heads of each K/V head into the
# rows beats enable_gqa, which repeats K/V on CPU. Measured on CPU against 2k keys:
# 1.6x faster at 4 rows (one query token), even at 16 rows, slower beyond.
GROUPED_MAX_ROWS = 16
# Sequences with the same query count share one SDPA call, padded to the longest key
# count. A member joins a group unless that pads more than this many (key x query)
# scores; one more call costs about as much as ~500 padded decode keys on CPU.
MAX_PAD_SCORES = 512


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


class SeqWork(NamedTuple):
    """One sequence's share of the work: row ``batch_index`` of the batch, whose query
    rows ``row0 .. row0 + num_queries - 1`` sit at positions ``start .. start +
    num_queries - 1`` and read keys ``0 .. num_keys - 1``. (Not ``index`` and ``count``:
    those are tuple's methods.)"""

    batch_index: int
    row0: int
    num_queries: int
    start: int
    num_keys: int


def apply_scale(x: torch.Tensor, scale) -> None:
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
BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def zero_slots(gathered: torch.Tensor, slots: torch.Tensor) -> None:
    """Zero key slots ``slots`` (rows of ``[blocks * block_size, ...]``) of a contiguous
    gathered ``[blocks, block_size, kv_heads, head_dim]`` copy, in place."""
    rows = gathered.view(BITS[gathered.element_size()])
    rows.view(-1, rows.shape[2] * rows.shape[3]).index_fill_(0, slots, 0)


def unwritten(num_rows: int, work: List[SeqWork]) -> List[tuple]:
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


def trim_work(seqs: List[SeqWork], causal: bool) -> List[SeqWork]:
    """Drop the rows that attend to nothing and cut each sequence's keys to those read."""
    work = []
    for s in seqs:
        row0, count, start, num_keys = s.row0, s.num_queries, s.start, s.num_keys
        if causal:
            if start < 0:  # rows at negative positions see no key: left as zeros
                row0, count, start = row0 - start, count + start, 0
            num_keys = min(num_keys, start + count)
        if count > 0 and num_keys > 0:
            work.append(SeqWork(s.batch_index, row0, count, start, num_keys))
    return work


def group_work(work: List[SeqWork]) -> List[List[SeqWork]]:
    """Sequences that share one SDPA call: same query count, similar key counts.

    Members keep batch order inside a group, so a batch whose sequences all fit in one
    group reads and writes its rows as views, without index copies.
    """
    ordered = sorted(work, key=lambda s: (s.num_queries, -s.num_keys))
    groups: List[List[SeqWork]] = []
    for s in ordered:
        head = groups[-1][0] if groups else None
        if (
            head is None
            or head.num_queries != s.num_queries
            or (head.num_keys - s.num_keys) * s.num_queries > MAX_PAD_SCORES
        ):
            groups.append([s])
        else:
            groups[-1].append(s)
    return [sorted(g, key=lambda s: s.batch_index) for g in groups]


class Group:
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
        group: List[SeqWork],
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
            count * heads_per_kv <= GROUPED_MAX_ROWS or not HAS_ENABLE_GQA
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
                zero_slots(held[1], self.outside)
                zero_slots(held[2], self.outside)
            kv = self._kv
            if kv is None:
                kv = self._kv = (held[3][:, :, : self.num_keys], held[4][:, :, : self.num_keys])
            return kv
        k, v = k_pages.index_select(0, index), v_pages.index_select(0, index)
        if self.outside is not None:
            zero_slots(k, self.outside)
            zero_slots(v, self.outside)
        return (self._keys(k)[:, :, : self.num_keys], self._keys(v)[:, :, : self.num_keys])

    def _keys(self, gathered: torch.Tensor) -> torch.Tensor:
        """``[size * blocks, block_size, kv_heads, dim]`` -> ``[size, kv_heads, blocks *
        block_size, dim]``."""
        _, block_size, num_kv_heads, head_dim = gathered.shape
        return gathered.view(self.size, self.blocks * block_size, num_kv_heads, head_dim).transpose(
            1, 2
        )

    def with_keys(self, num_keys: int) -> "Group":
        """This group of one query per sequence with ``num_keys`` keys each, in the same
        blocks: the decode step after this one (no mask, so every member had
        ``self.num_keys``)."""
        group = Group.__new__(Group)
        for name in Group.__slots__:
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
            apply_scale(k, scales[0])
        if scales[1] is not None:
            apply_scale(v, scales[1])

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
