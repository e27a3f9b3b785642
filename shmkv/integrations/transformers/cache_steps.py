"""The step each forward makes over a :class:`ShmkvCache`'s rows (:class:`_CacheSteps`).

Owns reserving the new tokens' slots at a forward's first layer (one batch step, one
round trip or none: the decode fast path, slots reserved ahead), choosing the forward's
path (paged or dense), checking that each written token sits at its own position (what
``commit`` may publish), writing each layer's K/V into the pool, and giving back the
slots reserved ahead. How layers attend is ``cache_attention.py``; the ``Cache``
interface, construction and lifetime are ``cache.py``. Imports of shmkv: ``errors`` and,
of this package, ``cache_state``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from shmkv.errors import InvalidArgument
from shmkv.integrations.transformers.cache_state import (
    _NEVER,
    _QUANTIZED,
    _CacheState,
    _Forward,
    _quantize,
)

if TYPE_CHECKING:
    from shmkv.client.batch import Batch


class _CacheSteps:
    """The step each forward makes over a :class:`ShmkvCache`'s rows: reserving the new
    tokens' slots (one batch step), checking each written token sits at its own position
    (what ``commit`` may publish), and writing K/V.

    Owns the rows' shmkv ``Batch`` (``batch``), the pool it writes (``pool``) and the
    current forward's :class:`_Forward` (``fwd``). Reads the rows of its
    :class:`_CacheState` and changes them through its ``decode``, ``written``,
    ``unpublish`` and ``gave_back``."""

    def __init__(self, rows: _CacheState) -> None:
        self.rows = rows
        self.fwd: Optional[_Forward] = None
        self.batch: Optional[Batch] = None
        self.pool: Optional[torch.Tensor] = None

    def forget(self, batch: bool = False) -> None:
        """Forget the last forward (``batch``: and the batch, for rows that changed)."""
        self.fwd = None
        if batch:
            self.batch = None

    def scales(self, layer_idx: int) -> tuple:
        """The layer's ``(k_scale, v_scale)`` of a quantized pool (shared memory)."""
        assert self.batch is not None  # (made by the forward's first update)
        return self.batch.client.kv_scales(layer_idx)

    def begin(
        self, start: int, key_states: torch.Tensor, claim, positions, mirror: bool
    ) -> _Forward:
        """The first update of a forward over rows checked to match it: which path,
        which slots (one round trip). ``claim``: the "shmkv" mask's, or None;
        ``positions``: the forward's ``position_ids``; ``mirror``: decode steps on the
        paged path attend over the mirror."""
        fwd = self.fwd = self._begin(start, key_states, claim, positions)
        fwd.mirror = fwd.paged and fwd.n == 1 and mirror and fwd.select is None
        pool = self.pool
        assert pool is not None  # (set with the batch)
        fwd.append = (
            fwd.mirror
            and key_states.dtype == pool.dtype
            and key_states.device == pool.device
            and not torch.is_grad_enabled()
        )
        return fwd

    def _begin(self, start: int, key_states: torch.Tensor, claim, positions) -> _Forward:
        rows = self.rows
        handles = rows.handles
        assert handles is not None  # (checked by the cache)
        batch, heads, n, head_dim = key_states.shape
        if self.batch is None:
            client = rows.client if rows.client is not None else handles[0]._client
            self.batch = client.batch(handles)
            self.pool = client.pool
        kv_length = start + n
        padding = None
        paged = claim is not None and (claim.batch_size, claim.q_length, claim.kv_length) == (
            batch,
            n,
            kv_length,
        )
        if paged:
            assert claim is not None  # (what paged says)
            padding = claim.padding
            if padding is not None and not rows.any_pad and bool(padding.all()):
                padding = None
            elif padding is None and rows.any_pad:
                raise InvalidArgument(
                    "this ShmkvCache holds rows with left padding, and the "
                    "forward has no attention mask: pass the attention mask "
                    "that marks the padding (left_pad() makes one)"
                )
        if (
            padding is None
            and rows.aligned == start
            and (rows.reserved >= kv_length or rows.uniform_lens == start)
        ):
            # Decode fast path: every row holds exactly `start` tokens, no padding; the
            # new ones go into slots already reserved (after a crop, say: no round trip)
            # or into slots reserved now at the end of every row.
            last = self.fwd
            # the last forward, when this one is the step after it (one token on); else None
            prev = (
                last
                if last is not None and n == 1 and last.n == 1 and last.start + 1 == start
                else None
            )
            step = None
            added = ahead = 0
            if rows.reserved >= kv_length:
                if prev is not None:  # the step after the last one, from its tables: no table read
                    step = prev.step.next_decode()
                if step is None:
                    assert self.batch is not None  # (made above)
                    step = self.batch.prefill(start=start, num_tokens=n)
            else:
                # A decode step reserves the rest of the rows' last blocks too (no block
                # more), which the next steps take with no round trip; the rows' stored
                # counts, not their slots, say what they hold (as after a crop).
                assert self.batch is not None  # (made above)
                ahead = -kv_length % self.batch.client.config.block_size if n == 1 else 0
                step = self._extend(n, ahead)
                added = n + ahead
            plan = None
            if (
                prev is not None
                and prev.plan is not None
                and (
                    step.block_tables is prev.step.block_tables
                    or torch.equal(step.block_tables, prev.step.block_tables)
                )
            ):
                # The same blocks, one more key each: the last step's attention plan moved on.
                plan = prev.plan._next_decode()
            if positions is not None and start < rows.check_below:
                self._check_positions(positions, start, n, None, None)
            rows.decode(kv_length, added, ahead)
            fwd = _Forward(start, n, step, paged, None)
            if plan is not None:
                assert prev is not None  # (whose plan moved on)
                fwd.plan, fwd.query_shape, fwd.out_shape = plan, prev.query_shape, prev.out_shape
            return fwd
        pad = rows.pad
        assert pad is not None  # (set with the rows)
        if padding is not None:
            # Skip new leading padding in rows that hold nothing yet; the mask must then
            # be exactly "padding, then tokens" for the paged path.
            lead = (~padding).cumprod(1).sum(1)
            fresh = (rows.stored == 0) & (pad >= start)
            pad = torch.where(fresh, torch.maximum(pad, lead.clamp(max=kv_length)), pad)
            expected = torch.arange(kv_length)[None, :] >= pad[:, None]
            if bool((padding & ~expected).any()):
                raise InvalidArgument(
                    "the attention mask marks as tokens positions this ShmkvCache holds as left "
                    "padding (not stored); keep the mask of the padded prompts"
                )
            paged = torch.equal(padding, expected)
        stored, lens = rows.stored, rows.lens
        assert lens is not None  # (set with the rows)
        skip = (pad + stored - start).clamp(0, n)  # new tokens a row does not write
        if bool((pad + stored < start).any()):
            raise InvalidArgument(
                "a row of this ShmkvCache holds fewer tokens than the cache "
                "length; was a forward interrupted? crop() the cache back"
            )
        counts = n - skip
        hstart = (start + skip - pad).clamp(min=0)  # first written position in each row
        ends = hstart + counts
        need = (ends - lens).clamp(min=0)
        uniform = not bool(skip.any())
        if not bool(need.any()):
            assert self.batch is not None  # (made above)
            step = self.batch.prefill(start=hstart, num_tokens=n if uniform else counts)
        elif torch.equal(hstart, lens):
            step = self._extend(n if uniform else counts)
        else:
            self._extend(need)
            assert self.batch is not None  # (made above)
            step = self.batch.prefill(start=hstart, num_tokens=counts)
        if start < rows.check_below:
            self._check_positions(positions, start, n, pad, skip)
        rows.written(pad, ends)
        select = None
        if not uniform:
            select = (torch.arange(n)[None, :] >= skip[:, None]).reshape(-1).nonzero().squeeze(1)
        return _Forward(start, n, step, paged, select)

    def _check_positions(self, positions, start: int, n: int, pad, skip) -> None:
        """Note in ``_unpublished`` the rows whose new K/V a forward computes at positions
        other than their own: new token ``j`` sits at row position ``start + j - pad``
        (``pad``, ``skip``: per row, None for none) and is computed at
        ``positions[:, j]`` (the forward's ``position_ids``; None: transformers'
        default, ``start + j``). Tokens a row skips (``skip``) are not written."""
        if (
            pad is None
            and n == 1
            and positions is not None
            and positions.dim() == 2
            and positions.shape[-1] == 1
            and bool((positions == start).all())
        ):
            return  # a decode step of unpadded rows at their positions: the common case
        steps = torch.arange(n)
        own = start + steps[None, :]  # [1 or batch, n]
        if pad is not None:
            own = own - pad[:, None]
        if positions is None or positions.dim() != 2 or positions.shape[-1] != n:
            # transformers' default (or a form not checked here, e.g. multimodal rotary
            # positions [3, batch, n]): the padded positions
            used = start + steps[None, :]
        else:
            used = positions.to(device="cpu", dtype=torch.int64)
        wrong = used != own
        if skip is not None:
            wrong &= steps[None, :] >= skip[:, None]
        if not bool(wrong.any()):
            return
        first = torch.where(wrong, own.expand_as(wrong), _NEVER).amin(1)
        self.rows.unpublish(first)

    def _extend(self, counts, reserve: int = 0):
        """``batch.extend(counts, reserve=reserve)``: one round trip (copy-on-write of
        forked rows' shared last blocks included)."""
        assert self.batch is not None  # (made by begin)
        return self.batch.extend(counts, reserve=reserve)

    def write(self, fwd: _Forward, layer_idx: int, key_states, value_states) -> None:
        """One batch write of the layer's new K/V (the rows ``fwd.select`` names)."""
        pool = self.pool
        assert pool is not None  # (set with the batch, by _begin)
        batch, heads, n, head_dim = key_states.shape
        if (
            n == 1
            and fwd.select is None
            and key_states.dtype == value_states.dtype == pool.dtype
            and key_states.is_contiguous()
            and value_states.is_contiguous()
            and not (key_states.requires_grad or value_states.requires_grad)
            and key_states.device == pool.device
        ):
            # Decode: [batch, heads, 1, dim] is already the [batch, heads, dim] rows.
            fwd.step.write(
                layer_idx,
                key_states.view(batch, heads, head_dim),
                value_states.view(batch, heads, head_dim),
            )
            return
        k = key_states.detach().transpose(1, 2).reshape(batch * n, heads, head_dim)
        v = value_states.detach().transpose(1, 2).reshape(batch * n, heads, head_dim)
        if fwd.select is not None:
            k, v = k.index_select(0, fwd.select), v.index_select(0, fwd.select)
        if pool.dtype in _QUANTIZED:
            k_scale, v_scale = self.scales(layer_idx)
            k = _quantize(k.to(pool.device), pool.dtype, k_scale)
            v = _quantize(v.to(pool.device), pool.dtype, v_scale)
        elif k.dtype != pool.dtype or k.device != pool.device:
            k = k.to(device=pool.device, dtype=pool.dtype)
            v = v.to(device=pool.device, dtype=pool.dtype)
        fwd.step.write(layer_idx, k.contiguous(), v.contiguous())

    def give_back(self) -> None:
        """Slots decode steps reserved ahead and did not write go back (one round trip),
        so that every handle holds what its row stored. Kept, as after a crop, when a
        sequence has another reference (a truncate is refused then)."""
        rows = self.rows
        if not rows.ahead:
            return
        assert self.batch is not None  # (made by the step that reserved ahead)
        truncated = False
        if rows.aligned >= 0 and rows.uniform_lens > rows.aligned:
            try:
                self.batch.truncate(rows.aligned)
                truncated = True
            except InvalidArgument:
                pass
        rows.gave_back(truncated)
