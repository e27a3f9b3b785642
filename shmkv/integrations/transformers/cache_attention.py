"""How a layer of a :class:`ShmkvCache` attends (:class:`_CacheAttention`): over the paged
pool through the step's block tables, over the cache's mirror of the pool, or densely
over every row's whole K/V in buffers kept across steps.

Owns the paged path's attention plan and calls into
:func:`shmkv.kernels.attention.paged_attention`, the mirror's SDPA, and the dense
buffers (grown, refilled from the pool where they lack positions; the mirror is these
buffers, appended to by a decode step). Which path a forward takes is decided by its
first update (``cache_steps.py``); the ``"shmkv"`` attention function that calls in
here is ``attention.py``. Imports of shmkv: ``errors``, ``kernels.attention`` and, of
this package, ``cache_state`` and ``cache_steps``.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

from shmkv.errors import InvalidArgument
from shmkv.integrations.transformers.cache_state import _QUANTIZED, _CacheState, _Forward, _quantize
from shmkv.integrations.transformers.cache_steps import _CacheSteps
from shmkv.kernels.attention import AttentionWorkspace, PagedAttentionPlan, paged_attention

# Decode over the mirror reads K/V into the CPU caches before SDPA from this many
# elements of K per layer (256 KiB of float32) up; see _CacheAttention._attend_mirror.
_WARM_MIN_NUMEL = 1 << 16


class _CacheAttention:
    """How a layer of a :class:`ShmkvCache` attends: over the paged pool through the step's
    block tables, over a mirrored copy, or densely (see the package docstring for which
    path a forward takes).

    Owns the layers' views of the pool's pages, the scratch memory gathered K/V goes
    into (kept across layers and steps), the dense buffers (per layer (K, V)
    ``[batch, kv_heads, capacity, head_dim]`` and the padded positions they hold; the
    mirror is these buffers) and the mirror's K/V handed from a layer's update to its
    attention.
    Reads the rows (``handles``, ``pad``, ``any_pad``) of its :class:`_CacheState` and
    the ``pool`` of its :class:`_CacheSteps`, whose ``scales`` it calls."""

    def __init__(self, rows: _CacheState, steps: _CacheSteps, num_layers: int) -> None:
        self.rows = rows
        self.steps = steps
        self.num_layers = num_layers
        self._pages: Optional[List[Tuple[torch.Tensor, torch.Tensor]]] = None
        self._workspace: Optional[AttentionWorkspace] = AttentionWorkspace()
        self._dense_bufs: Optional[List[Optional[Tuple[torch.Tensor, ...]]]] = None
        self._dense_len: List[int] = []
        # (layer, K, V) of the mirror for the layer's attention, set by its update
        self.mirror_kv: Optional[Tuple[int, torch.Tensor, torch.Tensor]] = None

    def crop(self, n: int) -> None:
        """The buffers hold no position from ``n`` on."""
        self.mirror_kv = None
        self._dense_len = [min(v, n) for v in self._dense_len]

    def select(self, rows: List[int]) -> None:
        """Row ``i`` of the buffers becomes old row ``rows[i]`` (as ``DynamicCache``
        reorders its tensors)."""
        if self._dense_bufs is None:
            return
        index = torch.tensor(rows, dtype=torch.int64)
        self._dense_bufs = [
            None if bufs is None else tuple(b.index_select(0, index.to(b.device)) for b in bufs)
            for bufs in self._dense_bufs
        ]

    def close(self) -> None:
        """Let go of the buffers and scratch memory."""
        self.mirror_kv = None
        self._dense_bufs = None
        self._workspace = None

    def append(
        self, fwd: _Forward, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> bool:
        """A decode step over the mirror, in the fewest calls: write the new token of
        every row into the pool and append it to the layer's mirror, which holds every
        position before it and has room for it (its attention then reads the mirror).
        False (nothing done) when any of that does not hold: the cache then takes the
        general way. (``fwd.append`` says the forward's dtype, device and grad mode allow
        it.)"""
        bufs = self._dense_bufs[layer_idx] if self._dense_bufs is not None else None
        start = fwd.start
        if (
            bufs is None
            or self._dense_len[layer_idx] != start
            or bufs[0].shape[2] <= start
            or bufs[0].shape[0] != key_states.shape[0]
            or bufs[0].dtype != key_states.dtype
            or value_states.dtype != key_states.dtype
            or bufs[0].device != key_states.device
            or not key_states.is_contiguous()
            or not value_states.is_contiguous()
        ):
            return False
        batch, heads, _, head_dim = key_states.shape
        fwd.step.write(
            layer_idx,
            key_states.view(batch, heads, head_dim),
            value_states.view(batch, heads, head_dim),
        )
        k_buf, v_buf = bufs
        k_buf.narrow(2, start, 1).copy_(key_states)
        v_buf.narrow(2, start, 1).copy_(value_states)
        self._dense_len[layer_idx] = start + 1
        self.mirror_kv = (layer_idx, k_buf.narrow(2, 0, start + 1), v_buf.narrow(2, 0, start + 1))
        return True

    def mirror(
        self, fwd: _Forward, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> None:
        """A decode step over the mirror the general way: the layer's mirror brought up to
        date with its new K/V (see :meth:`dense`), for its attention."""
        self.mirror_kv = (layer_idx, *self.dense(fwd, layer_idx, key_states, value_states))

    def _attn_pages(self, layer_idx: int) -> tuple:
        """``(k_pages, v_pages)`` of layer ``layer_idx`` for paged_attention: the layer's
        own views of the pool, ``[num_blocks, block_size, kv_heads, head_dim]`` (each one
        contiguous run of pages: the pool is stored layer-major)."""
        if self._pages is None:
            pool = self.steps.pool
            assert pool is not None  # (set with the batch)
            self._pages = [(pool[:, i, 0], pool[:, i, 1]) for i in range(pool.shape[1])]
        return self._pages[layer_idx]

    def _page_table(self, step) -> torch.Tensor:
        """The step's block tables (the ids of the pages :meth:`_attn_pages` gives)."""
        return step.block_tables

    def attend(self, module, query: torch.Tensor, scaling, dropout, is_causal, kwargs):
        """The paged path of the "shmkv" attention function (``ShmkvCache._attend``):
        ``query`` ``[batch, heads, n, head_dim]`` against the pool through the step's
        block tables, or against the mirror when the layer's update brought it up to
        date."""
        if (
            dropout
            or kwargs.get("softcap") is not None
            or kwargs.get("position_bias") is not None
            or kwargs.get("s_aux") is not None
            or is_causal is False
            or kwargs.get("sliding_window") is not None
            or not getattr(module, "is_causal", True)
        ):
            raise InvalidArgument(
                "the 'shmkv' attention over a ShmkvCache does causal attention "
                "without dropout, softcap, sinks, biases or windows; this layer "
                "needs one: use attn_implementation='sdpa'"
            )
        fwd = self.steps.fwd
        assert fwd is not None  # (this forward's, made by its first update)
        mirror, self.mirror_kv = self.mirror_kv, None
        if mirror is not None and mirror[0] == module.layer_idx:
            return self._attend_mirror(fwd, query, mirror[1], mirror[2], scaling)
        k_pages, v_pages = self._attn_pages(module.layer_idx)
        plan = fwd.plan
        if plan is None:
            # Once per step: every layer shares the block tables and lengths.
            plan = fwd.plan = PagedAttentionPlan(
                query.transpose(1, 2), k_pages, self._page_table(fwd.step), fwd.step.seq_lens
            )
            batch, heads, n, head_dim = fwd.query_shape = query.shape
            fwd.out_shape = (batch, n, heads, head_dim)
        scales = {}
        if k_pages.dtype in _QUANTIZED:  # dequantized on the way into attention
            scales["k_scale"], scales["v_scale"] = self.steps.scales(module.layer_idx)
        if query.shape != fwd.query_shape:  # a layer unlike the first: planned on its own
            return paged_attention(
                query.transpose(1, 2),
                k_pages,
                v_pages,
                self._page_table(fwd.step),
                fwd.step.seq_lens,
                scale=scaling,
                workspace=self._workspace,
                **scales,
            )
        group = plan.decode_group
        if group is not None and query.dtype == k_pages.dtype:
            # Decode: the plan was checked against this model's queries and pages; the
            # result, [batch, kv_heads, heads_per_kv, dim], holds [batch, 1, heads, dim].
            out = group.decode(query, k_pages, v_pages, scaling, self._workspace)
            assert fwd.out_shape is not None  # (set with the plan)
            return out.reshape(fwd.out_shape)
        return paged_attention(
            query.transpose(1, 2),
            k_pages,
            v_pages,
            scale=scaling,
            workspace=self._workspace,
            plan=plan,
            **scales,
        )

    def _attend_mirror(
        self, fwd: _Forward, query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling
    ) -> torch.Tensor:
        """A decode step's attention over the mirror: ``query`` ``[batch, heads, 1,
        head_dim]`` against ``k``, ``v`` ``[batch, kv_heads, tokens, head_dim]`` (padded
        positions, left padding masked); returns ``[batch, 1, heads, head_dim]``.

        The query heads of each K/V head are the query rows of one SDPA head (a view):
        on CPU 2x faster than SDPA's ``enable_gqa``, which repeats K/V."""
        batch, heads, _, head_dim = query.shape
        made = fwd.mirror_mask
        if made is False:  # once per step: every layer has the same padding and size
            mask = None
            rows = self.rows
            if rows.any_pad:
                assert rows.pad is not None  # (set with the rows)
                positions = torch.arange(k.shape[2], device=k.device)
                mask = (positions[None, :] >= rows.pad.to(k.device)[:, None])[:, None, None]
            made = fwd.mirror_mask = (mask, k.device.type == "cpu" and k.numel() >= _WARM_MIN_NUMEL)
        mask, warm = made
        if warm:
            # Warm the CPU caches first: the mirror was last read a step ago and the
            # model's weights streamed through since. SDPA over cold memory takes about 3x
            # as long as a plain read of it; read + SDPA over warm memory measured 25-30%
            # less than SDPA alone per layer at 2-4k keys (no gain below 1k).
            k.sum()
            v.sum()
        out = F.scaled_dot_product_attention(
            query.reshape(batch, k.shape[1], heads // k.shape[1], head_dim),
            k,
            v,
            attn_mask=mask,
            scale=scaling,
        )
        return out.view(batch, 1, heads, head_dim)

    def dense(
        self, fwd: _Forward, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> tuple:
        """The dense path: the layer's whole K/V, ``[batch, kv_heads, tokens, head_dim]``
        views of buffers kept across steps (left padding reads as zeros).

        A regular step copies only its new tokens in; after anything else (the first
        forward over handed-over or prefix-reused rows, skipped writes, a paged
        forward) the missing positions are gathered from the pool once.
        """
        batch, heads, n, head_dim = key_states.shape
        start = fwd.start
        kv_length = start + n
        bufs = self._dense_buffers(
            layer_idx, batch, heads, kv_length, head_dim, key_states.dtype, key_states.device
        )
        valid = min(self._dense_len[layer_idx], start)
        if valid == start and fwd.select is None:
            handles = self.rows.handles
            assert handles is not None  # (the forward's rows)
            first = handles[0]
            quantized = first.dtype in _QUANTIZED
            scales = self.steps.scales(layer_idx) if quantized else (None, None)
            for buf, new, scale in zip(bufs, (key_states, value_states), scales):
                new = new.detach()
                if quantized:  # hold what the pool holds: the stored value times its scale
                    new = (_quantize(new, first.dtype, scale).float() * scale).to(new.dtype)
                elif new.dtype != first.dtype:
                    new = new.to(first.dtype).to(new.dtype)
                buf[:, :, start:kv_length].copy_(new)
        else:
            self._fill(fwd, layer_idx, bufs, valid, kv_length)
        self._dense_len[layer_idx] = kv_length
        k, v = bufs[0][:, :, :kv_length], bufs[1][:, :, :kv_length]
        if torch.is_grad_enabled():  # autograd may keep them; later steps write the buffers
            k, v = k.clone(), v.clone()
        return k, v

    def _dense_buffers(
        self, layer_idx: int, batch: int, heads: int, kv_length: int, head_dim: int, dtype, device
    ) -> tuple:
        """This layer's K and V buffers ``[batch, kv_heads, capacity, head_dim]``, grown
        (doubling, keeping what they hold) to at least ``kv_length`` tokens."""
        if self._dense_bufs is None or len(self._dense_bufs) != self.num_layers:
            self._dense_bufs = [None] * self.num_layers
            self._dense_len = [0] * self.num_layers
        bufs = self._dense_bufs[layer_idx]
        if bufs is not None and (
            bufs[0].shape[0] != batch or bufs[0].dtype != dtype or bufs[0].device != device
        ):
            bufs, self._dense_len[layer_idx] = None, 0
        if bufs is None or bufs[0].shape[2] < kv_length:
            # Grown by a quarter at least, in whole 256-token steps: a decode step seldom
            # reallocates, and the buffers hold at most ~25% more than DynamicCache's.
            old = bufs[0].shape[2] if bufs is not None else 0
            capacity = -(-max(kv_length + 1, old + old // 4) // 256) * 256
            grown = tuple(
                torch.empty((batch, heads, capacity, head_dim), dtype=dtype, device=device)
                for _ in range(2)
            )
            keep = self._dense_len[layer_idx]
            if bufs is not None and keep:
                for new, held in zip(grown, bufs):
                    new[:, :, :keep].copy_(held[:, :, :keep])
            bufs = self._dense_bufs[layer_idx] = grown
        return bufs

    def _fill(self, fwd: _Forward, layer_idx: int, bufs: tuple, lo: int, hi: int) -> None:
        """Gather padded positions ``[lo, hi)`` of every row from the pool into ``bufs``."""
        handles, row_pad = self.rows.handles, self.rows.pad
        assert handles is not None and row_pad is not None  # (the forward's rows)
        pool = handles[0]._client.pool
        bs = pool.shape[3]
        batch = bufs[0].shape[0]
        heads, head_dim = pool.shape[4], pool.shape[5]
        if fwd.dense_index is None or fwd.dense_index[0] != lo:
            pos = torch.arange(lo, hi)[None, :] - row_pad[:, None]  # position in the row
            pad = pos < 0
            pos = pos.clamp(min=0)
            blocks = fwd.step.block_tables.to(torch.int64).gather(1, pos // bs)
            rows = (blocks * bs + pos % bs).reshape(-1).to(pool.device)  # slots
            fwd.dense_index = (lo, rows)
            fwd.dense_pad = pad.to(pool.device) if bool(pad.any()) else None
        rows = fwd.dense_index[1]
        for which, buf in enumerate(bufs):
            pages = pool[:, layer_idx, which]  # [num_blocks, bs, heads, dim]: slots' rows
            if not pages.is_contiguous():  # a head shard of the pool
                got = pages[rows // bs, rows % bs]
            elif pages.dtype in _QUANTIZED:  # as bytes: no float8 kernels
                got = (
                    pages.view(torch.uint8)
                    .view(-1, heads, head_dim)
                    .index_select(0, rows)
                    .view(pages.dtype)
                )
            else:
                got = pages.view(-1, heads, head_dim).index_select(0, rows)
            got = got.view(batch, hi - lo, heads, head_dim)
            if got.dtype in _QUANTIZED:  # dequantized first: float8 has no masked_fill
                got = got.float() * self.steps.scales(layer_idx)[which]
            if fwd.dense_pad is not None:  # whatever the padding's slots hold (NaN, inf)
                got.masked_fill_(fwd.dense_pad[:, :, None, None], 0)
            buf[:, :, lo:hi].copy_(got.transpose(1, 2))
