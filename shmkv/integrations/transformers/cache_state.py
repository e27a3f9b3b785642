"""The rows of a :class:`ShmkvCache`, its layers and one forward's step record.

Owns :class:`_ShmkvLayer` (one model layer of the cache: the tokens it holds),
:class:`_Forward` (what the first layer's update of a forward reserved, for every
layer), :class:`_CacheState` (the cache's rows: the client and handles, the handles it
owns, and per row the left padding, tokens stored, slots held, where publishing stops,
and what the decode fast path reads off them) and the quantization of K/V into a
quantized pool. The steps, the attention paths and the cache itself
(``cache_steps.py``, ``cache_attention.py``, ``cache.py``) hold a :class:`_CacheState`
and change it only through its methods; it imports none of them. Imports of shmkv:
``client`` (types) and ``kernels.attention`` (types).
"""

from __future__ import annotations

from typing import List, Literal, Optional, Set, Tuple, Union

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from shmkv.client.client import Client
from shmkv.client.handle import KvCacheHandle
from shmkv.kernels.attention import PagedAttentionPlan

# "No position": above any row position.
_NEVER = 1 << 62

_QUANTIZED = (
    torch.int8,
    getattr(torch, "float8_e4m3fn", None),
    getattr(torch, "float8_e5m2", None),
)


def _quantize(t: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """``t / scale`` stored as ``dtype`` (float8: saturated to its finite range; int8:
    rounded and clamped)."""
    t = t.float() / scale
    if dtype == torch.int8:
        return t.round_().clamp_(-128, 127).to(torch.int8)
    limit = torch.finfo(dtype).max
    return t.clamp_(-limit, limit).to(dtype)


class _ShmkvLayer(CacheLayerMixin):
    """One model layer of a :class:`ShmkvCache`: how many tokens it holds (counting left
    padding, as transformers counts them).

    The K/V bytes live in the pool, so ``keys`` and ``values`` stay None.
    """

    is_compileable = False
    is_croppable = True
    is_sliding = False

    def __init__(self, cache: Cache, layer_idx: int, num_tokens: int):
        """``cache``: the :class:`ShmkvCache` the layer belongs to (its updates and
        resets are the cache's)."""
        super().__init__()
        self._cache = cache
        self.layer_idx = layer_idx
        self.num_tokens = num_tokens

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append ``key_states``/``value_states`` (``[batch, heads, n, head_dim]``); see
        :meth:`ShmkvCache.update`."""
        return self._cache.update(key_states, value_states, self.layer_idx)

    def get_mask_sizes(self, query_length) -> tuple:
        if isinstance(query_length, torch.Tensor):  # older transformers pass cache_position
            query_length = query_length.shape[0]
        return self.num_tokens + query_length, 0

    def get_seq_length(self) -> int:
        return self.num_tokens

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self._cache.reset()

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("crop a ShmkvCache as a whole: cache.crop()")

    def offload(self) -> None:
        """The pool stays where it is: nothing to offload."""

    def prefetch(self) -> None:
        """The pool stays where it is: nothing to prefetch."""

    def reorder_cache(self, beam_idx) -> None:
        raise NotImplementedError("reorder a ShmkvCache as a whole: cache.reorder_cache()")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("use ShmkvCache.batch_repeat_interleave()")

    def batch_select_indices(self, indices) -> None:
        raise NotImplementedError("use ShmkvCache.batch_select_indices()")


class _Forward:
    """One forward's step: what the first layer's update reserved, for every layer."""

    __slots__ = (
        "start",
        "n",
        "step",
        "paged",
        "select",
        "layers_done",
        "dense_index",
        "dense_pad",
        "plan",
        "query_shape",
        "out_shape",
        "mirror",
        "append",
        "mirror_mask",
    )

    def __init__(self, start: int, n: int, step, paged: bool, select):
        self.start = start  # padded position of the first new token
        self.n = n  # new tokens per row (padding included)
        self.step = step  # the shmkv Step: slots, block tables, lengths
        self.paged = paged  # layers attend over the pool
        self.select = select  # rows of [batch * n] that are written; None: all
        self.layers_done: Set[int] = set()
        # dense fill: (first position, layer-0 K row of each)
        self.dense_index: Optional[Tuple[int, torch.Tensor]] = None
        # dense fill: bool [batch, positions], True at padding
        self.dense_pad: Optional[torch.Tensor] = None
        # paged path: the PagedAttentionPlan all layers share, built for queries of this
        # shape [batch, heads, n, dim] and giving results [batch, n, heads, dim]
        self.plan: Optional[PagedAttentionPlan] = None
        self.query_shape: Optional[torch.Size] = None
        self.out_shape: Optional[Tuple[int, int, int, int]] = None
        self.mirror = False  # a decode step over the mirror (paged path),
        self.append = False  # by _CacheAttention.append (dtype, device, grad mode allow it)
        # (padding mask or None, warm) for it; False: not yet
        self.mirror_mask: Union[Literal[False], Tuple[Optional[torch.Tensor], bool]] = False


class _CacheState:
    """The rows of a :class:`ShmkvCache`, and the only code that writes them: the client
    (a cache made from one), the handles (one per batch row) and those the cache owns,
    and per row (int64 ``[B]``) the left padding not stored (``pad``), the tokens stored,
    valid K/V in every layer (``stored``), the slots the sequence holds (``lens``) and
    the first position whose K/V may have been computed at another position
    (``unpublished``; commit stops there). For the decode fast path it derives from them
    ``any_pad``, ``aligned`` (the common stored length when no row has padding, else
    -1), ``reserved`` (the fewest slots a row holds) and ``uniform_lens`` (their common
    count, else -1); ``ahead`` says decode steps reserved slots no row stores yet (given
    back when the handles are asked for; any other change of the rows keeps them, as a
    crop does), ``check_below`` the padded length below which a forward's positions are
    checked. The steps (``cache_steps.py``) change the rows through :meth:`decode`,
    :meth:`written`, :meth:`unpublish` and :meth:`gave_back`; the cache through
    :meth:`allocate`, :meth:`set_rows`, :meth:`select`, :meth:`crop`, :meth:`adopt`,
    :meth:`set_unpublished`, :meth:`take_owned` and :meth:`close_owned`. The attention
    paths only read them."""

    def __init__(self, client: Optional[Client], check_below: int) -> None:
        self.client = client
        self.handles: Optional[List[KvCacheHandle]] = None
        self.owned: Set[KvCacheHandle] = set()
        self.check_below = check_below
        self.pad: Optional[torch.Tensor] = None
        self._stored: Optional[torch.Tensor] = None
        self.lens: Optional[torch.Tensor] = None
        self.unpublished = torch.empty(0, dtype=torch.int64)
        self.any_pad = False
        self.aligned = self.reserved = self.uniform_lens = -1
        self.ahead = False

    @property
    def stored(self) -> torch.Tensor:
        """Tokens stored per row (int64 ``[B]``)."""
        stored = self._stored
        if stored is None:  # left so by a decode step: every row holds `aligned` tokens
            assert self.pad is not None  # (set with the rows)
            stored = self._stored = torch.full_like(self.pad, self.aligned)
        return stored

    def set_rows(self, pads, stored, lens, unpublished=None) -> None:
        """Every row's state at once (``unpublished`` None: nothing misplaced)."""
        self.pad = torch.as_tensor(pads, dtype=torch.int64)
        self._stored = torch.as_tensor(stored, dtype=torch.int64)
        self.lens = torch.as_tensor(lens, dtype=torch.int64)
        self.unpublished = (
            torch.full_like(self.pad, _NEVER)
            if unpublished is None
            else torch.as_tensor(unpublished, dtype=torch.int64)
        )
        self._refresh()

    def set_unpublished(self, unpublished) -> None:
        """Where publishing stops, per row (a pickled cache's)."""
        self.unpublished = torch.as_tensor(unpublished, dtype=torch.int64)

    def adopt(
        self,
        handles,
        owned: bool,
        client: Optional[Client] = None,
        check_below: Optional[int] = None,
    ) -> None:
        """Hold ``handles`` (one per row); ``owned``: the cache closes them; ``client``:
        the client they were allocated from; ``check_below``: the padded length below
        which a forward's positions are checked from now on."""
        self.handles = handles
        if owned:
            self.owned.update(handles)
        if client is not None:
            self.client = client
        if check_below is not None:
            self.check_below = check_below

    def allocate(self, batch: int) -> None:
        """A cache made from a client: ``batch`` empty sequences of its own."""
        assert self.client is not None  # (a cache made from a client)
        self.handles = self.client.allocate_many([0] * batch)
        self.owned.update(self.handles)
        self.set_rows([0] * batch, [0] * batch, [0] * batch)

    def decode(self, kv_length: int, added: int = 0, ahead: int = 0) -> None:
        """A decode step stored ``kv_length`` tokens in every row; ``added``: slots it
        reserved in every row (0: none), ``ahead`` of them past ``kv_length``."""
        if added:
            assert self.lens is not None  # (set with the rows)
            self.lens += added
            self.reserved = self.uniform_lens = kv_length + ahead
            self.ahead = bool(ahead)
        self.aligned = kv_length
        self._stored = None  # every row: kv_length (made into a tensor when needed)

    def written(self, pad: torch.Tensor, ends: torch.Tensor) -> None:
        """A forward wrote each row up to ``ends`` (its left padding now ``pad``)."""
        assert self.lens is not None  # (set with the rows)
        self.pad = pad
        self._stored = torch.maximum(self.stored, ends)
        self.lens = torch.maximum(self.lens, ends)
        self._refresh()

    def unpublish(self, first: torch.Tensor) -> None:
        """Rows' K/V from ``first`` on was computed at other positions."""
        self.unpublished = torch.minimum(self.unpublished, first)

    def gave_back(self, truncated: bool) -> None:
        """The slots reserved ahead are settled; ``truncated``: they went back, and every
        row holds ``aligned`` slots."""
        self.ahead = False
        if truncated:
            assert self.lens is not None  # (set with the rows)
            self.lens = torch.full_like(self.lens, self.aligned)
            self.reserved = self.uniform_lens = self.aligned

    def crop(self, n: int) -> bool:
        """Rows fit a padded length ``n``; False when there are no rows yet."""
        if self.pad is None:
            return False
        self.pad = self.pad.clamp(max=n)
        self._stored = self.stored.minimum((n - self.pad).clamp(min=0))
        # rows cropped to before their first misplaced token hold none any more
        self.unpublished = torch.where(self.stored <= self.unpublished, _NEVER, self.unpublished)
        self._refresh()
        return True

    def select(self, rows: List[int]) -> List[KvCacheHandle]:
        """Row ``i`` becomes old row ``rows[i]`` (a row taken twice is forked); returns the
        handles no row takes."""
        old = self.handles
        assert old is not None and self.pad is not None and self.lens is not None
        taken: set = set()
        new = []
        for b in rows:
            if b in taken:
                child = old[b].fork()
                self.owned.add(child)
                new.append(child)
            else:
                taken.add(b)
                new.append(old[b])
        self.handles = new
        index = torch.tensor(rows, dtype=torch.int64)
        self.set_rows(
            self.pad[index], self.stored[index], self.lens[index], self.unpublished[index]
        )
        return [h for b, h in enumerate(old) if b not in taken]

    def take_owned(self) -> List[KvCacheHandle]:
        """Every owned handle, now the caller's to close."""
        owned, self.owned = list(self.owned), set()
        return owned

    def close_owned(self, handles) -> None:
        """Close those of ``handles`` the cache owns."""
        for h in handles:
            if h in self.owned:
                self.owned.discard(h)
                h.close()

    def _refresh(self) -> None:
        self.ahead = False
        pad, lens = self.pad, self.lens
        assert pad is not None and lens is not None  # (set with the rows)
        self.any_pad = bool(pad.any())
        stored = self.stored
        first = int(stored[0]) if len(stored) else 0
        uniform = not self.any_pad and bool((stored == first).all())
        self.aligned = first if uniform else -1
        low, high = (int(x) for x in torch.aminmax(lens)) if len(lens) else (0, 0)
        self.reserved = low
        self.uniform_lens = low if low == high else -1
