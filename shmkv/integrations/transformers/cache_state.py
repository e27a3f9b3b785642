"""What the parts of a :class:`ShmkvCache` share: its layers, one forward's step, and
the cache's fields with the bookkeeping of its rows.

Owns :class:`_ShmkvLayer` (one model layer of the cache: the tokens it holds),
:class:`_Forward` (what the first layer's update of a forward reserved, for every
layer), :class:`_CacheState` (the fields ``ShmkvCache.__init__`` sets, declared for the
type checker, and the per-row state: left padding, tokens stored, slots held, where
publishing stops, and what the decode fast path reads off them) and the quantization of
K/V into a quantized pool. The steps, the attention paths and the cache itself
(``cache_steps.py``, ``cache_attention.py``, ``cache.py``) build on it; it imports none
of them. Imports of shmkv: ``client`` (types), ``kernels.attention`` (types) and
``attention`` of this package (the mask a forward claims).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, List, Literal, Optional, Sequence, Set, Tuple, Union

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from shmkv.client.client import Client
from shmkv.client.handle import KvCacheHandle
from shmkv.integrations.transformers.attention import _ShmkvMask
from shmkv.kernels.attention import AttentionWorkspace, PagedAttentionPlan

if TYPE_CHECKING:
    from shmkv.client.batch import Batch

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
        self.append = False  # by _append (dtype, device, grad mode allow it)
        # (padding mask or None, warm) for it; False: not yet
        self.mirror_mask: Union[Literal[False], Tuple[Optional[torch.Tensor], bool]] = False


class _CacheState:
    """The state of a :class:`ShmkvCache` that its parts (:class:`_CacheSteps`,
    :class:`_CacheAttention`) share. The fields are declared here for the type checker:
    ``ShmkvCache.__init__`` sets every one and says what each holds. The per-row fields
    (``_pad``, ``_stored``, ``_lens``, ``_unpublished``) are set together by
    :meth:`_set_rows`, and :meth:`_refresh_rows` derives from them what the decode fast
    path reads (``_any_pad``, ``_aligned``, ``_reserved``, ``_uniform_lens``)."""

    layers: Sequence[CacheLayerMixin]
    _mirror: Optional[bool]
    _mirror_kv: Optional[Tuple[int, torch.Tensor, torch.Tensor]]
    _client: Optional[Client]
    _handles: Optional[List[KvCacheHandle]]
    _owned: Set[KvCacheHandle]
    _commit_upto: Optional[int]
    _closed: bool
    _expandable: bool
    _positions: Optional[torch.Tensor]
    _check_below: int
    _claim: Optional[_ShmkvMask]
    _pending: Optional[torch.Tensor]
    _fwd: Optional[_Forward]
    _batch: Optional[Batch]
    _pages: Optional[List[Tuple[torch.Tensor, torch.Tensor]]]
    _pool: Optional[torch.Tensor]
    _dense_bufs: Optional[List[Optional[Tuple[torch.Tensor, ...]]]]
    _dense_len: List[int]
    _workspace: Optional[AttentionWorkspace]
    _pad: Optional[torch.Tensor]
    _stored_t: Optional[torch.Tensor]
    _lens: Optional[torch.Tensor]
    _unpublished: torch.Tensor
    _any_pad: bool
    _aligned: int
    _reserved: int
    _uniform_lens: int
    _ahead: bool

    if TYPE_CHECKING:  # defined by ShmkvCache and _CacheAttention

        def _scales(self, layer_idx: int) -> tuple: ...

        def commit(self) -> int: ...

        def batch_repeat_interleave(self, repeats: int) -> None: ...

    @property
    def _stored(self) -> torch.Tensor:
        stored = self._stored_t
        if stored is None:  # left so by a decode step: every row holds _aligned tokens
            assert self._pad is not None  # (set with the rows)
            stored = self._stored_t = torch.full_like(self._pad, self._aligned)
        return stored

    @_stored.setter
    def _stored(self, value: torch.Tensor) -> None:
        self._stored_t = value

    def _set_rows(self, pads, stored, lens, unpublished=None) -> None:
        self._pad = torch.as_tensor(pads, dtype=torch.int64)
        self._stored = torch.as_tensor(stored, dtype=torch.int64)
        self._lens = torch.as_tensor(lens, dtype=torch.int64)
        # Per row: the first position whose K/V may have been computed at another position
        # (a forward that numbered the row from its padding); commit stops there.
        self._unpublished = (
            torch.full_like(self._pad, _NEVER)
            if unpublished is None
            else torch.as_tensor(unpublished, dtype=torch.int64)
        )
        self._refresh_rows()

    def _refresh_rows(self) -> None:
        self._ahead = False
        pad, lens = self._pad, self._lens
        assert pad is not None and lens is not None  # (set with the rows)
        self._any_pad = bool(pad.any())
        first = int(self._stored[0]) if len(self._stored) else 0
        uniform = not self._any_pad and bool((self._stored == first).all())
        self._aligned = first if uniform else -1
        low, high = (int(x) for x in torch.aminmax(lens)) if len(lens) else (0, 0)
        self._reserved = low
        self._uniform_lens = low if low == high else -1
