"""Hugging Face transformers on a shmkv pool: a ``Cache`` and an attention function.

Owns :class:`ShmkvCache` (one shmkv sequence per batch row; each forward is one
batch step: one round trip, then one batch write per layer), the ``"shmkv"``
attention implementation (registered with transformers' ``AttentionInterface`` and
``AttentionMaskInterface`` when this module is imported: layers attend over the
paged pool with the step's block tables), :func:`pool_config` (a pool shaped for a
model config), :func:`cache_argument` (the keyword ``forward`` and ``generate`` take
the cache by), :func:`prefill` (run the part of a prompt a cache does not hold yet),
:func:`left_pad` (a batch of prompts as padded ids and an attention mask) and
:func:`model_cache_salt` (the salt that namespaces a model's prefix keys).

Two rules keep the shared prefix cache true to its keys (a key hashes token ids from
the start of a sequence, from a root the salt namespaces): a prompt cache's keys are
salted with the model's identity (other models never reuse its K/V), and a row is
published only as far as its K/V was computed at the row's own positions 0, 1, ...
(read from each forward's ``position_ids``; see :meth:`ShmkvCache.commit`).

Which path a layer takes, decided once per forward:

* **paged** — the model runs ``attn_implementation="shmkv"`` and its mask is the plain
  causal mask with left padding at most: the cache writes the new K/V and hands the
  layer only the new tokens, and the layer calls :func:`shmkv.kernels.attention.paged_attention`
  over the pool with the step's block tables and lengths. With ``mirror=True`` a decode
  step (one new token per row) attends instead with one SDPA over the cache's
  *mirror*: every row's K/V copied in per-layer buffers of this process, kept current
  by appending each step's new tokens (a second copy of the K/V, for speed on CPU at
  long contexts). Left padding is not stored at all: each row's
  sequence holds its real tokens only, and padding queries attend to nothing (zeros,
  as SDPA gives).
* **dense** — any other attention implementation (``sdpa``, ``eager``, ...), a custom
  4-d mask, padding that is not on the left, or a forward that builds no mask: the
  cache writes the same way and returns every row's whole K/V as views of per-layer
  buffers kept across steps. A step copies in its new tokens only; positions the
  buffers lack (rows handed over or reused from the prefix cache) are gathered from
  the pool once. Left padding reads as zeros (masked anyway). Memory: as
  ``DynamicCache``'s, on top of the pool. (The mirror is these same buffers.)

It does not start coordinators, and it holds full-attention layers only.

Usage::

    import shmkv.integrations.transformers as st       # registers "shmkv"
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="shmkv")
    cfg = st.pool_config(model.config, num_blocks=1024, dtype=torch.float32)
    with shmkv.Coordinator(cfg, name="lm") as coord, shmkv.connect(coord.address) as client:
        with st.ShmkvCache(client) as cache:
            out = model.generate(input_ids, max_new_tokens=32, **{st.cache_argument(model): cache})

For decoder-only models whose layers all use full attention (Llama, Qwen2, Mistral
without sliding window, Gemma, Granite, OLMo, Phi-3, ...), on transformers 5.x.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import sys
import threading
from typing import TYPE_CHECKING, List, Literal, Optional, Sequence, Set, Tuple, Union

import torch
import torch.nn.functional as F

try:
    from transformers.cache_utils import Cache, CacheLayerMixin
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import (
        AttentionMaskInterface,
        causal_mask_function,
        prepare_padding_mask,
        sdpa_mask,
    )
    from transformers.modeling_utils import AttentionInterface
except ImportError as exc:  # transformers before per-layer caches and attention interfaces
    raise ImportError(
        "shmkv.integrations.transformers needs a transformers release whose "
        "Cache is a list of CacheLayerMixin layers and which has an "
        "AttentionInterface (5.x): pip install -U transformers"
    ) from exc

from shmkv.client.client import Client
from shmkv.client.handle import KvCacheHandle
from shmkv.errors import InvalidArgument, WrongType
from shmkv.integrations.hf_config import kv_layout
from shmkv.kernels.attention import AttentionWorkspace, PagedAttentionPlan, paged_attention
from shmkv.memory.layout import PoolConfig

if TYPE_CHECKING:
    from shmkv.client.batch import Batch

__all__ = [
    "ATTN_IMPLEMENTATION",
    "ShmkvCache",
    "cache_argument",
    "left_pad",
    "model_cache_salt",
    "pool_config",
    "prefill",
    "register",
    "shmkv_attention_forward",
    "use_shmkv_attention",
]

ATTN_IMPLEMENTATION = "shmkv"

# ShmkvCache.get_mask_sizes notes itself here; the "shmkv" mask function, which
# transformers' create_causal_mask calls right after, takes it. That is how a forward
# tells its cache, before any layer runs, that its layers attend over the pool.
_MASK_SIZES = threading.local()


# Decode over the mirror reads K/V into the CPU caches before SDPA from this many
# elements of K per layer (256 KiB of float32) up; see ShmkvCache._attend_mirror.
_WARM_MIN_NUMEL = 1 << 16

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


def pool_config(
    model_config, num_blocks: int, block_size: int = 16, dtype=None, device="cpu"
) -> PoolConfig:
    """A :class:`PoolConfig` with the layer count, K/V heads and head size of a model.

    Args:
        model_config: a transformers ``PretrainedConfig`` (its text decoder is used).
        num_blocks, block_size, device: as for :class:`PoolConfig`.
        dtype: pool dtype; default the config's ``dtype``, else float32. Keep it equal
            to the model's dtype: K/V is converted to the pool dtype when written. Or a
            quantized pool (``torch.float8_e4m3fn``, ``float8_e5m2``, ``int8``): K/V is
            stored divided by each layer's scales (``client.set_kv_scales``, 1.0 until
            set) and read back multiplied by them, on every attention path (paged,
            mirror, dense) and with left padding; see docs/transformers.md for the
            tolerance.
    """
    layout = kv_layout(model_config)
    if dtype is None:
        dtype = layout.dtype or torch.float32
    return PoolConfig(
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        num_blocks=num_blocks,
        block_size=block_size,
        dtype=dtype,
        device=device,
    )


def cache_argument(model) -> str:
    """``"cache"`` or ``"past_key_values"``: the keyword ``model``'s forward takes its
    cache by (transformers renamed it in 5.x)."""
    params = inspect.signature(type(model).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def left_pad(prompts: Sequence[Sequence[int]], pad_token_id: int = 0) -> tuple:
    """``(input_ids, attention_mask)``, both int64 ``[batch, longest]``: the prompts
    (lists of token ids) padded on the left, as a tokenizer with
    ``padding_side="left"`` pads them (what decoder-only ``generate`` expects)."""
    rows = [list(p.tolist() if hasattr(p, "tolist") else p) for p in prompts]
    if not rows or not all(rows):
        raise InvalidArgument("left_pad needs at least one prompt, none of them empty")
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.int64)
    mask = torch.zeros((len(rows), width), dtype=torch.int64)
    for b, row in enumerate(rows):
        ids[b, width - len(row) :] = torch.tensor(row, dtype=torch.int64)
        mask[b, width - len(row) :] = 1
    return ids, mask


def _check_full_attention(model_config) -> None:
    text = _config_of(model_config)[0].get_text_config(decoder=True)
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs

        layer_types, _ = get_layer_types_and_kwargs(text)
    except (ImportError, AttributeError, TypeError):
        layer_types = getattr(text, "layer_types", None) or []
    other = sorted({t for t in layer_types if t != "full_attention"})
    if other:
        raise InvalidArgument(
            f"ShmkvCache holds full-attention layers only; this model also "
            f"has {', '.join(other)} layers: use transformers' DynamicCache"
        )


# What names a model's K/V in the prefix keys: its checkpoint (name or path, revision), its
# dtype and the fields of its config that shape the K/V it computes. Runtime switches
# (attention implementation, use_cache, output flags) are not part of it: the same weights
# give the same K/V whichever way their layers attend.
_IDENTITY_FIELDS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "rms_norm_eps",
    "layer_norm_eps",
    "attention_bias",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "partial_rotary_factor",
    "max_position_embeddings",
    "tie_word_embeddings",
)


def _config_of(model_or_config):
    """``(config, dtype)``: a model's config and the dtype of its weights, or a config
    and the dtype it declares (unset: torch's default dtype, what a model made from it
    gets)."""
    config = getattr(model_or_config, "config", None)
    if config is not None and hasattr(config, "get_text_config"):  # a model
        return config, getattr(model_or_config, "dtype", None)
    if not hasattr(model_or_config, "get_text_config"):
        raise WrongType(
            f"model_config must be a transformers config or model, got "
            f"{type(model_or_config).__name__}"
        )
    text = model_or_config.get_text_config(decoder=True)
    dtype = getattr(text, "dtype", None) or getattr(model_or_config, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, dtype)
    return model_or_config, dtype or torch.get_default_dtype()


def _model_identity(model_config) -> dict:
    """The facts of ``model_config`` (a config or a model) that name the model whose K/V
    a cache holds."""
    model_config, dtype = _config_of(model_config)
    text = model_config.get_text_config(decoder=True)
    identity = {
        "name_or_path": str(getattr(model_config, "name_or_path", "") or ""),
        # transformers 5 resolves the revision at load time and no longer keeps it on the
        # config; older releases kept the commit hash as _commit_hash.
        "revision": getattr(model_config, "_commit_hash", None)
        or getattr(model_config, "revision", None),
        "dtype": str(dtype),
        "architectures": getattr(model_config, "architectures", None),
    }
    for name in _IDENTITY_FIELDS:
        if hasattr(text, name):
            identity[name] = getattr(text, name)
    return identity


def model_cache_salt(model_config, cache_salt: Optional[bytes] = None) -> bytes:
    """The ``cache_salt`` that :meth:`ShmkvCache.from_prompts` allocates with: the model's
    identity with the caller's own salt on top, 32 bytes.

    Prefix keys hash token ids from a root that the salt namespaces, so two models (or two
    revisions, or one model in two dtypes) on one coordinator never reuse each other's
    K/V, while the same model does. ``model_config`` is ``model.config`` or the model
    itself (then the dtype of its weights counts, also after ``model.to(dtype)``, which
    leaves ``config.dtype`` as it was). The identity is read from the config: the name
    or path it was loaded from, the revision when the config keeps one, the dtype, and
    the config fields that shape its K/V (layers, heads, sizes, rotary settings). Two
    models built locally from equal configs (no name, same fields) are indistinguishable
    from their configs: give them a ``name_or_path`` or a ``cache_salt`` of their own.
    Pass the result as ``cache_salt`` to ``client.allocate(prompt=...)`` (or to
    :func:`shmkv.integrations.distributed.send_sequence`) to share prefixes with these caches.

    Raises:
        WrongType: ``cache_salt`` that is not bytes, or no config or model.
    """
    if cache_salt is not None and not isinstance(cache_salt, (bytes, bytearray)):
        raise WrongType(f"cache_salt must be bytes, got {type(cache_salt).__name__}")
    identity = json.dumps(_model_identity(model_config), sort_keys=True, default=str)
    digest = hashlib.blake2b(b"shmkv.integrations.transformers model\0", digest_size=32)
    digest.update(identity.encode())
    if cache_salt:
        digest.update(b"\0salt\0" + bytes(cache_salt))
    return digest.digest()


# -- the "shmkv" attention implementation ------------------------------------------------------


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

    def __init__(self, cache: "ShmkvCache", padding, kwargs: dict):
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


# -- the cache ---------------------------------------------------------------------------------


class _ShmkvLayer(CacheLayerMixin):
    """One model layer of a :class:`ShmkvCache`: how many tokens it holds (counting left
    padding, as transformers counts them).

    The K/V bytes live in the pool, so ``keys`` and ``values`` stay None.
    """

    is_compileable = False
    is_croppable = True
    is_sliding = False

    def __init__(self, cache: "ShmkvCache", layer_idx: int, num_tokens: int):
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
    :class:`_CacheAttention`) share, declared for the type checker: ``ShmkvCache.__init__``
    sets every field and says what each holds."""

    layers: List[_ShmkvLayer]
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

        @property
        def _stored(self) -> torch.Tensor: ...

        @_stored.setter
        def _stored(self, value: torch.Tensor) -> None: ...

        def _set_rows(self, pads, stored, lens, unpublished=None) -> None: ...

        def _refresh_rows(self) -> None: ...

        def _scales(self, layer_idx: int) -> tuple: ...

        def commit(self) -> int: ...

        def batch_repeat_interleave(self, repeats: int) -> None: ...


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


class _CacheAttention(_CacheState):
    """How a layer of a :class:`ShmkvCache` attends: over the paged pool through the step's
    block tables, over a mirrored copy, or densely (see the module doc for which path
    a forward takes). Part of ShmkvCache (its state)."""

    def _scales(self, layer_idx: int) -> tuple:
        """The layer's ``(k_scale, v_scale)`` of a quantized pool (shared memory)."""
        assert self._batch is not None  # (made by the forward's first update)
        return self._batch.client.kv_scales(layer_idx)

    def _attn_pages(self, layer_idx: int) -> tuple:
        """``(k_pages, v_pages)`` of layer ``layer_idx`` for paged_attention: the layer's
        own views of the pool, ``[num_blocks, block_size, kv_heads, head_dim]`` (each one
        contiguous run of pages: the pool is stored layer-major)."""
        if self._pages is None:
            pool = self._pool
            assert pool is not None  # (set with the batch)
            self._pages = [(pool[:, i, 0], pool[:, i, 1]) for i in range(pool.shape[1])]
        return self._pages[layer_idx]

    def _page_table(self, step) -> torch.Tensor:
        """The step's block tables (the ids of the pages :meth:`_attn_pages` gives)."""
        return step.block_tables

    def _attend(self, module, query: torch.Tensor, scaling, dropout, is_causal, kwargs):
        """The paged path of the "shmkv" attention function: ``query`` ``[batch, heads,
        n, head_dim]`` against the pool through the step's block tables."""
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
        fwd = self._fwd
        assert fwd is not None  # (this forward's, made by its first update)
        mirror, self._mirror_kv = self._mirror_kv, None
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
            scales["k_scale"], scales["v_scale"] = self._scales(module.layer_idx)
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
            if self._any_pad:
                assert self._pad is not None  # (set with the rows)
                positions = torch.arange(k.shape[2], device=k.device)
                mask = (positions[None, :] >= self._pad.to(k.device)[:, None])[:, None, None]
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

    def _dense(
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
            assert self._handles is not None  # (the forward's rows)
            first = self._handles[0]
            quantized = first.dtype in _QUANTIZED
            scales = self._scales(layer_idx) if quantized else (None, None)
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
        if self._dense_bufs is None or len(self._dense_bufs) != len(self.layers):
            self._dense_bufs = [None] * len(self.layers)
            self._dense_len = [0] * len(self.layers)
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
        assert self._handles is not None and self._pad is not None  # (the forward's rows)
        pool = self._handles[0]._client.pool
        bs = pool.shape[3]
        batch = bufs[0].shape[0]
        heads, head_dim = pool.shape[4], pool.shape[5]
        if fwd.dense_index is None or fwd.dense_index[0] != lo:
            pos = torch.arange(lo, hi)[None, :] - self._pad[:, None]  # position in the row
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
                got = got.float() * self._scales(layer_idx)[which]
            if fwd.dense_pad is not None:  # whatever the padding's slots hold (NaN, inf)
                got.masked_fill_(fwd.dense_pad[:, :, None, None], 0)
            buf[:, :, lo:hi].copy_(got.transpose(1, 2))


class ShmkvCache(_CacheSteps, _CacheAttention, Cache):
    """A transformers ``Cache`` backed by shmkv sequences, one per batch row.

    Pass it to ``model.generate`` or to ``model(...)`` with ``use_cache=True`` (by the
    keyword :func:`cache_argument` names). A forward is one shmkv batch step: its first
    layer reserves the new tokens' slots in every row in one round trip, and each layer
    writes the whole batch's new K/V at once. With ``attn_implementation="shmkv"`` the
    layers attend over the pool, decode steps over its mirror (the paged path, see the
    module docstring); with any other implementation they get every row's K/V,
    gathered into reused buffers.
    Greedy generation equals generation with ``DynamicCache``; logits agree to float
    round-off. K/V read back from the pool carries no gradient: it is a cache for
    inference.

    Left padding, when the paged path sees it in the attention mask (or
    :meth:`from_prompts` / ``padding_side="left"`` declare it), is not stored: a row's
    sequence holds its real tokens only, so prompts of one batch reuse cached prefixes
    whatever their padding.

    Args:
        source: a :class:`~shmkv.Client` (sequences are allocated at the first
            forward, one per batch row, and are this cache's own), a
            :class:`~shmkv.KvCacheHandle`, or a list of handles of one client, one per
            batch row (existing sequences, for example prefilled in another process;
            they stay the caller's to close).
        num_tokens: how many leading tokens of the given handles already hold K/V for
            every layer; default all the tokens they hold (``handle.num_tokens``).
        padding_side: ``"left"`` for handles holding different token counts: the rows
            are aligned at their ends and padded on the left to the longest, as
            :func:`left_pad` pads their prompts (pass that attention mask to the model).
        model_config: ``model.config`` or the model; when given, checked to have only
            full-attention layers, and :func:`prefill` refuses another model.
        mirror: on the paged path, keep a copy of every row's K/V in per-layer buffers
            of this process (about as much memory as ``DynamicCache`` holds, on top of
            the pool), kept current by appending each step's new tokens, and let decode
            steps (one new token per row) attend over it (faster on CPU from ~2k keys
            a layer up; see docs/transformers.md).
            ``False`` (the default; None means the same): decode steps attend over
            the pool's pages at every layer of every step (no memory beyond the pool).
            Either way the pool holds every token, and other forwards (prefill,
            several new tokens) attend over the pool.

    ``close()`` (or ``with``) closes the sequences the cache allocated or forked.
    Beam search and ``num_return_sequences > 1`` work by forking sequences
    (copy-on-write). The pool must have at least as many layers as the model, and the
    model's K/V heads and head size (see :func:`pool_config`).

    Raises:
        WrongType / InvalidArgument: for a bad source or a mismatched model.
    """

    # Its own layers only (update, which would add others, is overridden); transformers
    # types the list as holding any kind of layer.
    layers: List[_ShmkvLayer]  # type: ignore[assignment]

    def __init__(
        self,
        source,
        *,
        num_tokens: Optional[int] = None,
        padding_side: Optional[str] = None,
        model_config=None,
        mirror: Optional[bool] = None,
    ):
        if mirror is not None and not isinstance(mirror, bool):
            raise WrongType(f"mirror must be True, False or None, got {type(mirror).__name__}")
        self._mirror = mirror  # None: decided at the first forward (off if quantized)
        self._mirror_kv = None  # (layer, K, V) of the mirror for the layer's attention
        # (The types of the fields the parts share: _CacheState.)
        self._client = None
        self._handles = None
        self._owned = set()
        self._commit_upto = None
        self._closed = False
        self._config_checked = False
        # model_cache_salt(model_config) if given, and whether model_config was a model (the
        # dtype of its weights counts) or a config (the dtype it declares)
        self._model_salt: Optional[bytes] = None
        self._salt_of_model = False
        self._expandable = False  # from_prompts, before its first forward: may fork rows
        # The position_ids of the forward whose mask is being built (None: transformers'
        # default, the padded positions); taken by that forward's first update.
        self._positions = None
        # Row positions from which K/V is checked to be at its own position: every one
        # below that of a cache that may publish (from_prompts: its prompts; handles: not
        # known), none of a cache made from a client (its sequences carry no token ids).
        self._check_below = 0 if isinstance(source, Client) else _NEVER
        self._claim = None  # set by the mask function, per forward
        self._pending = None  # key handed to a layer on the paged path
        self._fwd = None
        self._batch = None
        self._pages = None
        self._pool = None  # the client's pool view (set with _batch)
        self._dense_bufs = None  # per layer (K, V) buffers, dense path
        self._dense_len = []  # per layer: padded positions they hold
        # Gathered K/V goes into scratch memory kept across layers and steps.
        self._workspace = AttentionWorkspace()
        # Per row (int64 [B]): left padding not stored, tokens stored (valid K/V in every
        # layer), slots the sequence holds. For the decode fast path: ``_aligned`` is the
        # common stored length when no row has padding, else -1; ``_reserved`` the fewest
        # slots a row holds; ``_uniform_lens`` their common count, else -1.
        self._pad = self._stored_t = self._lens = None
        self._any_pad = False
        self._aligned = self._reserved = self._uniform_lens = -1
        # Decode steps reserved slots ahead that no row stores yet (given back when the
        # handles are asked for; any other change of the rows keeps them, as a crop does).
        self._ahead = False
        self._last_path: Optional[str] = None
        if padding_side not in (None, "left"):
            raise InvalidArgument(f"padding_side must be 'left' or None, got {padding_side!r}")
        if isinstance(source, Client):
            self._client = source
            num_layers = source.config.num_layers
            if num_tokens:
                raise InvalidArgument("num_tokens needs handles; a new cache starts empty")
            num_tokens = 0
        else:
            handles = [source] if isinstance(source, KvCacheHandle) else list(source)
            if not handles or not all(isinstance(h, KvCacheHandle) for h in handles):
                raise WrongType(
                    "source must be a shmkv Client, a KvCacheHandle or a non-empty list of handles"
                )
            lengths = [h.num_tokens for h in handles]
            shortest, longest = min(lengths), max(lengths)
            pads = [0] * len(handles)
            stored = None
            if num_tokens is None:
                if shortest != longest and padding_side != "left":
                    raise InvalidArgument(
                        f"handles hold different token counts {sorted(lengths)};"
                        " pass padding_side='left' (rows padded on the left "
                        "to the longest) or num_tokens= (what every row holds)"
                    )
                num_tokens = longest
                pads = [longest - n for n in lengths]
                stored = lengths
            if isinstance(num_tokens, bool) or not isinstance(num_tokens, int):
                raise WrongType(f"num_tokens must be an int, got {type(num_tokens).__name__}")
            if not 0 <= num_tokens <= shortest and stored is None:
                raise InvalidArgument(
                    f"num_tokens={num_tokens} outside [0, {shortest}] (the tokens the handles hold)"
                )
            self._handles = handles
            self._set_rows(
                pads, stored if stored is not None else [num_tokens] * len(handles), lengths
            )
            num_layers = handles[0].num_layers
        if model_config is not None:
            _check_full_attention(model_config)
            self._config_checked = True
            self._model_salt = model_cache_salt(model_config)
            self._salt_of_model = model_config is not _config_of(model_config)[0]
        self._initial_tokens = num_tokens
        super().__init__(layers=[_ShmkvLayer(self, i, num_tokens) for i in range(num_layers)])

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

    @classmethod
    def _with_rows(
        cls,
        handles,
        num_tokens: int,
        pads,
        stored,
        lens,
        model_config=None,
        mirror: Optional[bool] = None,
    ) -> "ShmkvCache":
        """A cache over ``handles`` at padded length ``num_tokens`` with the given row
        state (see ``_set_rows``)."""
        cache = cls(handles, num_tokens=0, model_config=model_config, mirror=mirror)
        for layer in cache.layers:
            layer.num_tokens = num_tokens
        cache._initial_tokens = num_tokens
        cache._set_rows(pads, stored, lens)
        return cache

    @classmethod
    def from_prompt(
        cls,
        client: Client,
        prompt: Sequence[int],
        *,
        cache_salt: Optional[bytes] = None,
        request_id: Optional[str] = None,
        model_config=None,
        mirror: Optional[bool] = None,
    ) -> "ShmkvCache":
        """A cache for one prompt that reuses the longest cached prefix of it.

        Allocates a sequence for ``prompt`` (token ids) with prefix reuse; the cache
        starts with the reused tokens (all but the last prompt token at most, so the
        model still has a token to run), and ``generate(prompt, ...)`` or
        :func:`prefill` computes only the rest. The written prompt is committed (its
        full blocks become reusable by later requests) when decoding goes past it, at
        :meth:`close`, or by :meth:`commit`. ``num_cached_tokens`` says how many
        tokens were reused. ``model_config`` (required), ``cache_salt``, ``mirror``: as
        for :meth:`from_prompts`.
        """
        prompt = prompt.tolist() if hasattr(prompt, "tolist") else list(prompt)
        if prompt and isinstance(prompt[0], list):
            raise InvalidArgument(
                "from_prompt takes one prompt (a flat list of token ids); "
                "use from_prompts for a batch"
            )
        return cls.from_prompts(
            client,
            [prompt],
            cache_salt=cache_salt,
            request_ids=None if request_id is None else [request_id],
            model_config=model_config,
            mirror=mirror,
        )

    @classmethod
    def from_prompts(
        cls,
        client: Client,
        prompts,
        *,
        attention_mask=None,
        cache_salt: Optional[bytes] = None,
        request_ids: Optional[Sequence[str]] = None,
        model_config=None,
        mirror: Optional[bool] = None,
    ) -> "ShmkvCache":
        """A cache for a batch of prompts, each reusing the longest cached prefix of its
        own tokens, in one round trip.

        Args:
            prompts: lists of token ids (one per row; run the model on
                ``left_pad(prompts)``), or ``input_ids`` ``[batch, length]`` padded on the
                left with its ``attention_mask`` (as a tokenizer with
                ``padding_side="left"`` returns them).
            attention_mask: with ``input_ids``: 1 for tokens, 0 for the left padding.
            model_config: the model that will run, ``model.config`` or the model itself
                (see :func:`model_cache_salt`), required: the prefix keys are namespaced
                by the model's identity, so the cache reuses only K/V this same model
                computed, and :func:`prefill` with another model is refused.
            cache_salt: bytes of the caller's own (a tenant, an adapter), on top of the
                model's identity.
            mirror: as for :class:`ShmkvCache`.

        The cache starts at the longest padded length that every row holds (a row's
        padding plus its reused tokens, all but its last prompt token at most);
        ``generate(input_ids, attention_mask=...)`` computes the rest, and rows that
        hold more skip the writes they already have. The prompts are committed as in
        :meth:`from_prompt`; a row is committed only as far as its K/V was computed at
        its own positions 0, 1, ... (the positions ``generate`` and :func:`prefill`
        give a left-padded batch: a forward that numbers a padded row from its padding
        leaves that row unpublished).

        ``generate`` with ``num_return_sequences > 1`` or ``num_beams > 1`` runs the
        batch expanded: at the first forward, each row's sequence is forked
        (copy-on-write) as many times as ``generate`` repeats the row.

        Raises:
            InvalidArgument: no ``model_config``, an empty prompt, or padding that is
                not on the left.
            WrongType: ``cache_salt`` that is not bytes.
            PoolExhausted: not enough blocks (nothing allocated).
        """
        if model_config is None:
            raise InvalidArgument(
                "from_prompts needs model_config=model (or model.config): its prefix keys are "
                "namespaced by the model (name or path, revision, dtype, shape), so that K/V "
                "another model left on this coordinator is never reused; cache_salt= adds a "
                "namespace of your own on top"
            )
        salt = model_cache_salt(model_config, cache_salt)
        rows = _prompt_rows(prompts, attention_mask)
        width = max(map(len, rows))
        requests = [
            dict(
                prompt=row,
                cache_salt=salt,
                request_id=None if request_ids is None else request_ids[b],
            )
            for b, row in enumerate(rows)
        ]
        handles = client.allocate_many(requests)
        try:
            pads = [width - len(row) for row in rows]
            reused = [min(h.num_cached_tokens, len(row) - 1) for h, row in zip(handles, rows)]
            start = min(p + r for p, r in zip(pads, reused))
            cache = cls._with_rows(
                handles,
                start,
                pads,
                reused,
                [len(row) for row in rows],
                model_config=model_config,
                mirror=mirror,
            )
        except BaseException:
            client.close_many(handles)
            raise
        cache._client = client
        cache._owned.update(handles)
        cache._commit_upto = width
        cache._expandable = True
        cache._check_below = width
        return cache

    # -- what the cache holds --------------------------------------------------------------

    @property
    def handles(self) -> List[KvCacheHandle]:
        """The sequences, one per batch row (empty before the first forward of a cache
        made from a client)."""
        self._give_back()
        return list(self._handles or [])

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

    @property
    def handle(self) -> KvCacheHandle:
        """The one sequence of a batch-1 cache."""
        self._give_back()
        if not self._handles or len(self._handles) != 1:
            raise InvalidArgument(
                f"the cache holds {len(self._handles or [])} sequences, not one; use .handles"
            )
        return self._handles[0]

    @property
    def num_cached_tokens(self) -> int:
        """Tokens the cache held when it was made (the reused prefix for
        ``from_prompt``; for a batch, the padded length every row held)."""
        return self._initial_tokens

    @property
    def num_tokens(self) -> int:
        """Tokens every layer holds (left padding included, as transformers counts)."""
        return min(layer.num_tokens for layer in self.layers)

    @property
    def attention_path(self) -> Optional[str]:
        """How the layers of the last forward attended: ``"paged"`` (over the pool, through
        the "shmkv" attention function), ``"dense"`` (whole K/V handed to the model's
        attention), or None before any forward."""
        return self._last_path

    @property
    def left_padding(self) -> List[int]:
        """Left padding of each row that the cache does not store."""
        return [] if self._pad is None else self._pad.tolist()

    def commit(self) -> int:
        """Publish the full blocks every layer has written, for prefix reuse (only
        sequences allocated with a prompt carry the token ids needed). Returns the
        number of leading blocks published in the first sequence.

        A prefix key promises the K/V of its tokens at positions 0, 1, ... of the
        sequence; a row is published only up to its first token that a forward computed
        at another position (a left-padded row run without ``position_ids`` from the
        attention mask numbers its tokens from the padding)."""
        self._check_open()
        n = self.num_tokens
        published = []
        if self._handles:
            assert self._pad is not None  # (set with the rows)
            written = (
                (n - self._pad)
                .clamp(min=0)
                .minimum(self._stored)
                .minimum(self._unpublished)
                .tolist()
            )
            published = [h.commit(min(w, h.num_tokens)) for h, w in zip(self._handles, written)]
        if self._commit_upto is not None and n >= self._commit_upto:
            self._commit_upto = None
        return published[0] if published else 0

    # -- the Cache interface ---------------------------------------------------------------

    def get_mask_sizes(self, query_length, layer_idx: int = 0) -> tuple:
        """``(kv_length, kv_offset)`` of the next forward's mask (see ``Cache``); also tells
        the "shmkv" mask function, which transformers calls next, that this cache runs
        the forward."""
        _MASK_SIZES.cache = self
        self._positions = _mask_position_ids()
        return super().get_mask_sizes(query_length, layer_idx)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ):
        """Write one layer's new K/V (``[batch, kv_heads, n, head_dim]``) into the pool.

        Returns the new tokens' own ``key_states``/``value_states`` on the paged path
        (the "shmkv" attention function then reads the pool), else the layer's whole
        K/V, ``[batch, kv_heads, tokens, head_dim]``.
        """
        if layer_idx >= len(self.layers):
            raise InvalidArgument(
                f"the model has a layer {layer_idx}, the pool only {len(self.layers)} layers; "
                "size the pool with shmkv.integrations.transformers.pool_config(model.config)"
            )
        self._check_open()
        layer = self.layers[layer_idx]
        if not layer.is_initialized:
            layer.lazy_initialization(key_states, value_states)
        start, n = layer.num_tokens, key_states.shape[2]
        fwd = self._fwd
        if self._pending is not None:
            self._pending = None
            raise InvalidArgument(
                "a layer attended over a ShmkvCache on the paged path without the 'shmkv' "
                "attention function (the model's attention implementation changed during the "
                "forward?); run the model with attn_implementation='shmkv' throughout"
            )
        if fwd is None or fwd.start != start or fwd.n != n or layer_idx in fwd.layers_done:
            fwd = self._fwd = self._begin(start, key_states)
            self._last_path = "paged" if fwd.paged else "dense"
            fwd.mirror = fwd.paged and n == 1 and bool(self._mirror) and fwd.select is None
            pool = self._pool
            assert pool is not None  # (set with the batch, by _begin)
            fwd.append = (
                fwd.mirror
                and key_states.dtype == pool.dtype
                and key_states.device == pool.device
                and not torch.is_grad_enabled()
            )
        fwd.layers_done.add(layer_idx)
        if fwd.append and self._append(fwd, layer_idx, key_states, value_states):
            layer.num_tokens = start + 1
            return key_states, value_states
        self._write(fwd, layer_idx, key_states, value_states)
        layer.num_tokens = start + n
        if fwd.paged:
            self._pending = key_states
            if fwd.mirror:
                # Decode: the attention function reads the mirror, brought up to date here.
                self._mirror_kv = (
                    layer_idx,
                    *self._dense(fwd, layer_idx, key_states, value_states),
                )
            return key_states, value_states
        return self._dense(fwd, layer_idx, key_states, value_states)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens layer ``layer_idx`` holds (left padding included)."""
        if layer_idx >= len(self.layers):
            return 0
        return self.layers[layer_idx].num_tokens

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` tokens (a negative count, as for
        ``DynamicCache.crop``); their slots are written over later."""
        if tokens_to_remove > 0:
            raise InvalidArgument(
                f"crop takes a negative count of tokens to remove, got {tokens_to_remove}"
            )
        if tokens_to_remove == 0:
            return
        for layer in self.layers:
            layer.num_tokens = max(0, layer.num_tokens + tokens_to_remove)
        self._fit_rows()

    def reset(self) -> None:
        """Hold no tokens (the sequences keep their slots, written over later)."""
        for layer in self.layers:
            layer.num_tokens = 0
        self._fit_rows()

    def _fit_rows(self) -> None:
        self._pending = self._mirror_kv = None
        n = self.num_tokens
        self._dense_len = [min(v, n) for v in self._dense_len]
        if self._pad is None:
            return
        self._pad = self._pad.clamp(max=n)
        self._stored = self._stored.minimum((n - self._pad).clamp(min=0))
        # rows cropped to before their first misplaced token hold none any more
        self._unpublished = torch.where(
            self._stored <= self._unpublished, _NEVER, self._unpublished
        )
        self._refresh_rows()
        self._fwd = None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Row ``i`` becomes old row ``beam_idx[i]``; a row taken twice is forked
        (copy-on-write), rows not taken are dropped (closed if the cache owns them)."""
        self._select([int(i) for i in beam_idx.tolist()])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep rows ``indices`` (see :meth:`reorder_cache`)."""
        self._select([int(i) for i in torch.as_tensor(indices).tolist()])

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every row ``repeats`` times in place (forks share blocks, copy-on-write)."""
        if self._handles is None:
            return
        self._select([b for b in range(len(self._handles)) for _ in range(repeats)])

    def _select(self, rows: List[int]) -> None:
        self._check_open()
        if self._handles is None:
            return
        old = self._handles
        taken: set = set()
        new = []
        for b in rows:
            if b in taken:
                child = old[b].fork()
                self._owned.add(child)
                new.append(child)
            else:
                taken.add(b)
                new.append(old[b])
        self._handles = new
        self._batch = self._fwd = None
        index = torch.tensor(rows, dtype=torch.int64)
        if self._dense_bufs is not None:  # as DynamicCache reorders its tensors
            self._dense_bufs = [
                None if bufs is None else tuple(b.index_select(0, index.to(b.device)) for b in bufs)
                for bufs in self._dense_bufs
            ]
        assert self._pad is not None and self._lens is not None  # (set with the rows)
        self._set_rows(
            self._pad[index], self._stored[index], self._lens[index], self._unpublished[index]
        )
        self._close_owned([h for b, h in enumerate(old) if b not in taken])

    def _close_owned(self, handles) -> None:
        for h in handles:
            if h in self._owned:
                self._owned.discard(h)
                h.close()

    # -- lifetime --------------------------------------------------------------------------

    def close(self) -> None:
        """Close the sequences this cache allocated or forked (handles passed in stay
        open). Idempotent; the cache cannot be used afterwards."""
        if self._closed:
            return
        owned, self._owned = list(self._owned), set()
        try:
            if (
                self._commit_upto is not None
                and self.num_tokens
                and all(h.is_valid() for h in self._handles or [])
            ):
                self.commit()
        finally:
            self._closed = True
            self._batch = self._fwd = self._pending = self._claim = self._mirror_kv = None
            self._dense_bufs = None
            self._workspace = None
            for h in owned:
                h.close()

    def __enter__(self) -> "ShmkvCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __reduce__(self):
        """Pickles as its handles (each through a hand-off), its length and each row's
        left padding; the copy owns the handles it opens."""
        self._check_open()
        if self._handles is None:
            raise InvalidArgument("an empty ShmkvCache holds no sequence to hand over")
        assert self._pad is not None  # (set with the rows)
        return (
            _rebuild,
            (
                list(self._handles),
                self.num_tokens,
                self._pad.tolist(),
                self._stored.tolist(),
                self._mirror,
                self._unpublished.tolist(),
            ),
        )

    def __repr__(self) -> str:
        rows = len(self._handles) if self._handles is not None else 0
        return f"<ShmkvCache {rows} sequences x {self.num_tokens} tokens>"


def _rebuild(handles, num_tokens, pads=None, stored=None, mirror=None, unpublished=None):
    cache = ShmkvCache._with_rows(
        handles,
        num_tokens,
        pads if pads is not None else [0] * len(handles),
        stored if stored is not None else [num_tokens] * len(handles),
        [h.num_tokens for h in handles],
        mirror=mirror,
    )
    if unpublished is not None:
        cache._unpublished = torch.as_tensor(unpublished, dtype=torch.int64)
    cache._owned.update(handles)
    return cache


def _prompt_rows(prompts, attention_mask) -> List[List[int]]:
    """Each row's token ids, left padding removed."""
    if isinstance(prompts, torch.Tensor):
        ids = prompts[None] if prompts.dim() == 1 else prompts
        if attention_mask is None:
            return [row for row in ids.tolist()]
        mask = torch.as_tensor(attention_mask).to(torch.bool)
        if mask.shape != ids.shape:
            raise InvalidArgument(
                f"attention_mask has shape {tuple(mask.shape)}, input_ids {tuple(ids.shape)}"
            )
        lead = (~mask).cumprod(1).sum(1)
        if not bool((mask.sum(1) == ids.shape[1] - lead).all()):
            raise InvalidArgument(
                "from_prompts takes prompts padded on the left only (padding_side='left')"
            )
        rows = [row[p:] for row, p in zip(ids.tolist(), lead.tolist())]
    else:
        if attention_mask is not None:
            raise InvalidArgument("attention_mask goes with input_ids, not with lists of ids")
        rows = [list(p.tolist() if hasattr(p, "tolist") else p) for p in prompts]
    if not rows or not all(rows):
        raise InvalidArgument("prompt is empty" if rows else "no prompts")
    return rows


@torch.no_grad()
def prefill(
    model, cache: ShmkvCache, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Run the tokens of ``input_ids`` that ``cache`` does not hold yet through
    ``model``, writing their K/V into the pool; returns the logits of the last token,
    ``[batch, vocab]`` (their argmax is the first greedy token).

    ``input_ids`` is ``[batch, tokens]`` (or ``[tokens]``), the whole (left padded)
    prompt, of which the cache holds the first ``cache.get_seq_length()`` tokens;
    ``attention_mask`` its mask, for a padded batch. Each row's tokens are numbered from
    its first real token, as ``generate`` numbers them (``position_ids`` from the mask),
    so the K/V stored is what an unpadded run of the same prompt stores.

    Raises:
        InvalidArgument: nothing left to run, a mask of another shape, or a cache made
            for another model (``from_prompts(model_config=...)``).
    """
    ids = input_ids[None] if input_ids.dim() == 1 else input_ids
    done = cache.get_seq_length()
    if not 0 <= done < ids.shape[1]:
        raise InvalidArgument(
            f"the cache holds {done} tokens; the prompt has {ids.shape[1]}, "
            "so there is nothing left to run"
        )
    if cache._model_salt is not None and cache._model_salt != model_cache_salt(
        model if cache._salt_of_model else model.config
    ):
        raise InvalidArgument(
            "this ShmkvCache was made for another model: its model_config names other weights, "
            "revision, shape or dtype than this model's, and its prefix keys and K/V are that "
            "model's; make the cache with this model's model_config (model or model.config)"
        )
    kwargs = {}
    if attention_mask is not None:
        mask = attention_mask[None] if attention_mask.dim() == 1 else attention_mask
        if mask.shape != ids.shape:
            raise InvalidArgument(
                f"attention_mask has shape {tuple(mask.shape)}, input_ids {tuple(ids.shape)}"
            )
        kwargs["attention_mask"] = mask
        if "position_ids" in inspect.signature(type(model).forward).parameters:
            # as generate() numbers a left-padded row: its first token is position 0
            positions = (mask.long().cumsum(-1) - 1).clamp_(min=0)
            kwargs["position_ids"] = positions[:, done:]
    out = model(input_ids=ids[:, done:], use_cache=True, **{cache_argument(model): cache}, **kwargs)
    return out.logits[:, -1]
