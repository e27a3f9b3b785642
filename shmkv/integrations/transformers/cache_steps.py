"""The step each forward makes over a :class:`ShmkvCache`'s rows (:class:`_CacheSteps`).

Owns reserving the new tokens' slots at a forward's first layer (one batch step, one
round trip or none: the decode fast path, slots reserved ahead), choosing the forward's
path (paged or dense), checking that each written token sits at its own position (what
``commit`` may publish), writing each layer's K/V into the pool, and giving back the
slots reserved ahead. How layers attend is ``cache_attention.py``; the ``Cache``
interface, construction and lifetime are ``cache.py``. Imports of shmkv: ``errors`` and,
of this package, ``attention`` (the mask hand-over) and ``cache_state``.
"""

from __future__ import annotations

import torch

from shmkv.errors import InvalidArgument
from shmkv.integrations.transformers.attention import _MASK_SIZES
from shmkv.integrations.transformers.cache_state import (
    _NEVER,
    _QUANTIZED,
    _CacheState,
    _Forward,
    _quantize,
)


class _CacheSteps(_CacheState):
    """The step each forward makes over a :class:`ShmkvCache`'s rows: reserving the new
    tokens' slots (one batch step), checking each written token sits at its own position
    (what ``commit`` may publish), and writing K/V. Part of ShmkvCache (its state)."""

    def _append(
        self, fwd: _Forward, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> bool:
        """A decode step over the mirror, in the fewest calls: write the new token of
        every row into the pool and append it to the layer's mirror, which holds every
        position before it and has room for it. False (nothing done) when any of that
        does not hold: :meth:`update` then takes the general way. (``fwd.append`` says
        the forward's dtype, device and grad mode allow it.)"""
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
        self._pending = key_states
        self._mirror_kv = (layer_idx, k_buf.narrow(2, 0, start + 1), v_buf.narrow(2, 0, start + 1))
        return True

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidArgument("this ShmkvCache is closed")

    def _begin(self, start: int, key_states: torch.Tensor) -> _Forward:
        """The first update of a forward: which path, which slots (one round trip)."""
        claim, self._claim = self._claim, None
        positions, self._positions = self._positions, None
        _MASK_SIZES.__dict__.pop("cache", None)
        batch, heads, n, head_dim = key_states.shape
        if self._handles is None:
            assert self._client is not None  # (a cache made from a client)
            self._handles = self._client.allocate_many([0] * batch)
            self._owned.update(self._handles)
            self._set_rows([0] * batch, [0] * batch, [0] * batch)
        rows = len(self._handles)
        if rows != batch and self._expandable and batch % rows == 0:
            # generate(num_return_sequences=k or num_beams=k) repeats every row k times
            # before its first forward (repeat_interleave): the sequences are forked so.
            self.batch_repeat_interleave(batch // rows)
        self._expandable = False
        if len(self._handles) != batch:
            raise InvalidArgument(
                f"the cache holds {len(self._handles)} sequences, the model ran a batch of {batch}"
            )
        first = self._handles[0]
        if (heads, head_dim) != (first.num_heads, first.head_dim):
            raise InvalidArgument(
                f"the model's K/V is {heads} heads x {head_dim}, the pool holds "
                f"{first.num_heads} x {first.head_dim}; size the pool with "
                "pool_config(model.config)"
            )
        if self._commit_upto is not None and start >= self._commit_upto:
            self.commit()  # before slots without token ids end the sequences' prefix keys
        if self._batch is None:
            client = self._client if self._client is not None else first._client
            self._batch = client.batch(self._handles)
            self._pool = client.pool
            if self._mirror is None:  # off unless asked for: it holds a second copy
                self._mirror = False
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
            if padding is not None and not self._any_pad and bool(padding.all()):
                padding = None
            elif padding is None and self._any_pad:
                raise InvalidArgument(
                    "this ShmkvCache holds rows with left padding, and the "
                    "forward has no attention mask: pass the attention mask "
                    "that marks the padding (left_pad() makes one)"
                )
        if (
            padding is None
            and self._aligned == start
            and (self._reserved >= kv_length or self._uniform_lens == start)
        ):
            # Decode fast path: every row holds exactly `start` tokens, no padding; the
            # new ones go into slots already reserved (after a crop, say: no round trip)
            # or into slots reserved now at the end of every row.
            last = self._fwd
            # the last forward, when this one is the step after it (one token on); else None
            prev = (
                last
                if last is not None and n == 1 and last.n == 1 and last.start + 1 == start
                else None
            )
            step = None
            if self._reserved >= kv_length:
                if prev is not None:  # the step after the last one, from its tables: no table read
                    step = prev.step.next_decode()
                if step is None:
                    step = self._batch.prefill(start=start, num_tokens=n)
            else:
                # A decode step reserves the rest of the rows' last blocks too (no block
                # more), which the next steps take with no round trip; the rows' stored
                # counts, not their slots, say what they hold (as after a crop).
                assert self._batch is not None  # (made by _begin)
                ahead = -kv_length % self._batch.client.config.block_size if n == 1 else 0
                step = self._extend(n, ahead)
                assert self._lens is not None  # (set with the rows)
                self._lens += n + ahead
                self._reserved = self._uniform_lens = kv_length + ahead
                self._ahead = bool(ahead)
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
            if positions is not None and start < self._check_below:
                self._check_positions(positions, start, n, None, None)
            self._aligned = kv_length
            self._stored_t = None  # every row: kv_length (made into a tensor when needed)
            fwd = _Forward(start, n, step, paged, None)
            if plan is not None:
                assert prev is not None  # (whose plan moved on)
                fwd.plan, fwd.query_shape, fwd.out_shape = plan, prev.query_shape, prev.out_shape
            return fwd
        pad = self._pad
        assert pad is not None  # (set with the rows)
        if padding is not None:
            # Skip new leading padding in rows that hold nothing yet; the mask must then
            # be exactly "padding, then tokens" for the paged path.
            lead = (~padding).cumprod(1).sum(1)
            fresh = (self._stored == 0) & (pad >= start)
            pad = torch.where(fresh, torch.maximum(pad, lead.clamp(max=kv_length)), pad)
            expected = torch.arange(kv_length)[None, :] >= pad[:, None]
            if bool((padding & ~expected).any()):
                raise InvalidArgument(
                    "the attention mask marks as tokens positions this ShmkvCache holds as left "
                    "padding (not stored); keep the mask of the padded prompts"
                )
            paged = torch.equal(padding, expected)
        stored, lens = self._stored, self._lens
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
            step = self._batch.prefill(start=hstart, num_tokens=n if uniform else counts)
        elif torch.equal(hstart, lens):
            step = self._extend(n if uniform else counts)
        else:
            self._extend(need)
            step = self._batch.prefill(start=hstart, num_tokens=counts)
        self._pad = pad
        if start < self._check_below:
            self._check_positions(positions, start, n, pad, skip)
        self._stored = torch.maximum(stored, ends)
        self._lens = torch.maximum(lens, ends)
        self._refresh_rows()
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
        self._unpublished = torch.minimum(self._unpublished, first)

    def _extend(self, counts, reserve: int = 0):
        """``batch.extend(counts, reserve=reserve)``: one round trip (copy-on-write of
        forked rows' shared last blocks included)."""
        assert self._batch is not None  # (made by _begin)
        return self._batch.extend(counts, reserve=reserve)

    def _write(self, fwd: _Forward, layer_idx: int, key_states, value_states) -> None:
        """One batch write of the layer's new K/V (the rows ``fwd.select`` names)."""
        pool = self._pool
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
            k_scale, v_scale = self._scales(layer_idx)
            k = _quantize(k.to(pool.device), pool.dtype, k_scale)
            v = _quantize(v.to(pool.device), pool.dtype, v_scale)
        elif k.dtype != pool.dtype or k.device != pool.device:
            k = k.to(device=pool.device, dtype=pool.dtype)
            v = v.to(device=pool.device, dtype=pool.dtype)
        fwd.step.write(layer_idx, k.contiguous(), v.contiguous())

    def _give_back(self) -> None:
        """Slots decode steps reserved ahead and did not write go back (one round trip),
        so that every handle holds what its row stored. Kept, as after a crop, when a
        sequence has another reference (a truncate is refused then)."""
        if not self._ahead:
            return
        self._ahead = False
        assert self._batch is not None and self._lens is not None  # (set by the step)
        if self._aligned < 0 or self._uniform_lens <= self._aligned:
            return
        try:
            self._batch.truncate(self._aligned)
        except InvalidArgument:
            return
        self._lens = torch.full_like(self._lens, self._aligned)
        self._reserved = self._uniform_lens = self._aligned
