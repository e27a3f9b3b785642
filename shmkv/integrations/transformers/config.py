"""What a model's config tells shmkv: the pool shaped for it, whether its layers are all
full attention, and the identity its prefix keys are namespaced by.

Owns :func:`pool_config` (a pool with the model's layers, K/V heads and head size),
:func:`model_cache_salt` (the salt that namespaces a model's prefix keys, from the
model's identity: checkpoint, revision, dtype and the config fields that shape its K/V)
and the check that a model has full-attention layers only. It reads configs and models;
it runs no model and knows no cache. Imports of shmkv: ``errors``, ``memory.layout`` and
``integrations.hf_config`` (the K/V shape of a config, shared with ``shmkv serve``).
"""

from __future__ import annotations

import hashlib
import json
from typing import Optional

import torch

from shmkv.errors import InvalidArgument, WrongType
from shmkv.integrations.hf_config import kv_layout
from shmkv.memory.layout import PoolConfig

__all__ = ["model_cache_salt", "pool_config"]


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
