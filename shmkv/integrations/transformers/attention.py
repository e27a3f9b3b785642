"""The ``"shmkv"`` attention implementation of transformers: its mask function and its
attention function, registered with ``AttentionMaskInterface`` and ``AttentionInterface``
when this module is imported.

Owns :func:`shmkv_attention_forward`, :func:`register`, :func:`use_shmkv_attention` and
the hand-over by which a forward tells its cache, before any layer runs, that its layers
attend over the pool: :meth:`ShmkvCache.get_mask_sizes` notes the cache in
``_MASK_SIZES``, transformers calls the mask function (:func:`_shmkv_mask`) right after,
and that returns a :class:`_ShmkvMask` which every layer's attention function receives.
How a layer then attends over the pool is the cache's (``cache_attention.py``); with
another cache or none, the function is transformers' SDPA attention.

It knows the cache only through the few members :class:`_AttendingCache` names, and
imports no module of the cache (which imports this one). Imports of shmkv: ``errors``
and ``config`` of this package (the full-attention check).
"""

from __future__ import annotations

import sys
import threading
from typing import Optional, Protocol

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import (
    AttentionMaskInterface,
    causal_mask_function,
    prepare_padding_mask,
    sdpa_mask,
)
from transformers.modeling_utils import AttentionInterface

from shmkv.errors import InvalidArgument
from shmkv.integrations.transformers.config import _check_full_attention

__all__ = ["ATTN_IMPLEMENTATION", "register", "shmkv_attention_forward", "use_shmkv_attention"]

ATTN_IMPLEMENTATION = "shmkv"

# ShmkvCache.get_mask_sizes notes itself here; the "shmkv" mask function, which
# transformers' create_causal_mask calls right after, takes it. That is how a forward
# tells its cache, before any layer runs, that its layers attend over the pool.
_MASK_SIZES = threading.local()


class _AttendingCache(Protocol):
    """What the mask and attention functions use of the cache a forward runs over (a
    :class:`ShmkvCache`): its length, its claim on the forward, the key it handed the
    layer on the paged path, and its paged attention."""

    _config_checked: bool
    _any_pad: bool
    _claim: Optional[_ShmkvMask]
    _pending: Optional[torch.Tensor]

    def get_seq_length(self, layer_idx: int = 0) -> int: ...

    def _attend(self, module, query: torch.Tensor, scaling, dropout, is_causal, kwargs): ...


class _ShmkvMask:
    """What the "shmkv" mask function gives every layer of one forward over a
    :class:`ShmkvCache`: the cache, the 2-d padding mask (bool ``[batch, kv_length]``,
    None for no padding) and, built only if a layer needs it, the 4-d mask SDPA would
    get."""

    __slots__ = (
        "cache",
        "padding",
        "batch_size",
        "q_length",
        "kv_length",
        "_kwargs",
        "_dense",
        "_built",
    )

    def __init__(self, cache: _AttendingCache, padding, kwargs: dict):
        self.cache = cache
        self.padding = padding
        self.batch_size = kwargs["batch_size"]
        self.q_length = kwargs["q_length"]
        self.kv_length = kwargs["kv_length"]
        self._kwargs = kwargs
        self._dense: Optional[torch.Tensor] = None
        self._built = False

    def dense(self):
        """The mask transformers' ``sdpa_mask`` makes for the same forward."""
        if not self._built:
            self._dense = sdpa_mask(**self._kwargs)
            self._built = True
        return self._dense


def _mask_position_ids():
    """The ``position_ids`` of the forward whose mask transformers builds now, read from
    the frame of ``masking_utils._preprocess_mask_arguments`` (the caller of
    ``Cache.get_mask_sizes``), or None where that frame is not found or holds none.

    transformers hands a cache neither the positions nor the rotary embeddings of the
    K/V it stores; the positions decide whether a row's K/V is what its prefix keys
    promise (see :meth:`ShmkvCache.commit`). None reads as transformers' default: the
    padded positions (``cache_position``), which is safe: a padded row is then not
    published."""
    frame = sys._getframe(2)  # 0: here, 1: ShmkvCache.get_mask_sizes, 2: its caller
    try:
        if frame.f_code.co_name == "_preprocess_mask_arguments" and frame.f_globals.get(
            "__name__", ""
        ).startswith("transformers."):
            positions = frame.f_locals.get("position_ids")
            return positions if isinstance(positions, torch.Tensor) else None
        return None
    finally:
        del frame


def _shmkv_mask(**kwargs):
    """The mask function of "shmkv": the SDPA mask, unless the forward runs over a
    :class:`ShmkvCache` with a plain causal mask; then a :class:`_ShmkvMask` that lets
    the layers attend over the pool."""
    cache = _MASK_SIZES.__dict__.pop("cache", None)
    if (
        cache is None
        or kwargs.get("mask_function") is not causal_mask_function
        or kwargs.get("kv_offset", 0) != 0
        or kwargs.get("local_size") is not None
        or kwargs.get("q_offset", 0) != cache.get_seq_length()
        or kwargs["kv_length"] != cache.get_seq_length() + kwargs["q_length"]
    ):
        return sdpa_mask(**kwargs)
    config = kwargs.get("config")
    if config is not None and not cache._config_checked:
        _check_full_attention(config)
        cache._config_checked = True
    padding = kwargs.get("attention_mask")
    if (
        padding is not None
        and not cache._any_pad
        and padding.dim() == 2
        and padding.shape[1] == kwargs["kv_length"]
        and bool(padding.all())
    ):
        padding = None  # no padding at all (decode steps of unpadded rows): nothing to check
    if padding is not None:
        padding = prepare_padding_mask(padding, kwargs["kv_length"], 0)
        assert padding is not None  # (transformers gives None for no mask only)
        padding = padding[:, : kwargs["kv_length"]].to(device="cpu", dtype=torch.bool)
    claim = _ShmkvMask(cache, padding, kwargs)
    cache._claim = claim
    return claim


def shmkv_attention_forward(
    module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask,
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    is_causal: Optional[bool] = None,
    **kwargs,
):
    """transformers attention function of ``attn_implementation="shmkv"``.

    ``query`` is ``[batch, heads, q_len, head_dim]``; returns ``([batch, q_len, heads,
    head_dim], None)``. When the layer's :class:`ShmkvCache` runs this forward on the
    paged path, ``key``/``value`` are only the new tokens (already in the pool) and the
    layer attends with :func:`~shmkv.kernels.attention.paged_attention` over the pool. Otherwise
    (no cache, another cache, a dense forward) it is transformers' SDPA attention on the
    ``key``/``value`` it is given.
    """
    if isinstance(attention_mask, _ShmkvMask):
        cache = attention_mask.cache
        if cache._pending is not None:
            if cache._pending is not key:
                cache._pending = None
                raise InvalidArgument(
                    "the layer changed the K/V its ShmkvCache handed it on the "
                    "paged path; run this model with attn_implementation='sdpa'"
                )
            cache._pending = None
            return cache._attend(module, query, scaling, dropout, is_causal, kwargs), None
        attention_mask = attention_mask.dense()
    return sdpa_attention_forward(
        module,
        query,
        key,
        value,
        attention_mask,
        dropout=dropout,
        scaling=scaling,
        is_causal=is_causal,
        **kwargs,
    )


def register() -> str:
    """Register the ``"shmkv"`` attention and mask functions with transformers (done when
    this module is imported; idempotent). Returns the name to pass as
    ``attn_implementation``."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, shmkv_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _shmkv_mask)
    return ATTN_IMPLEMENTATION


def use_shmkv_attention(model):
    """Switch ``model`` to ``attn_implementation="shmkv"`` in place (one line, for a model
    already loaded); returns the model. With another cache or none, the layers attend
    exactly as with ``"sdpa"``."""
    model.set_attn_implementation(register())
    return model


register()
