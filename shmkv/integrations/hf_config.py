"""The K/V shape of a Hugging Face model config, without importing transformers.

Owns :func:`kv_layout`, the one reading of a config's layers, K/V heads, head size and
dtype that :func:`shmkv.integrations.transformers.pool_config` and ``shmkv serve
--for-model`` share. It takes a loaded ``PretrainedConfig`` (it does not load one), so
the coordinator can have the config read in another process (transformers' config
classes import triton, see :func:`shmkv.tools.cli.for_model`), and :func:`plain_layout`,
the same reading of a ``config.json`` of a plain decoder-only family straight from the
file (no transformers, no process: what makes ``--for-model`` start in well under a
second, as a coordinator restarted under load must).
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, NamedTuple, Optional


class KvLayout(NamedTuple):
    """What a model's K/V cache is made of."""

    num_layers: int  #: decoder layers (each caches K and V)
    num_kv_heads: int  #: K/V heads (all tensor-parallel ranks together)
    head_dim: int  #: elements per head
    dtype: Any  #: the config's dtype (a ``torch.dtype`` or its name), or None


def kv_layout(model_config) -> KvLayout:
    """The layers, K/V heads, head size and dtype of ``model_config``'s text decoder (a
    transformers ``PretrainedConfig``): K/V heads default to the attention heads, the
    head size to ``hidden_size / num_attention_heads``."""
    text = model_config.get_text_config(decoder=True)
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return KvLayout(text.num_hidden_layers, kv_heads, head_dim, getattr(text, "dtype", None))


# Families whose config.json names its decoder's layers, heads and head size at the top
# level, with the meanings kv_layout gives them (no text_config, no attribute map).
PLAIN_DECODERS = frozenset(
    ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma",
     "gemma2", "phi3", "granite", "olmo2", "starcoder2")
)  # fmt: skip


def plain_layout(path: str) -> Optional[Dict[str, Any]]:
    """:func:`kv_layout` of the ``config.json`` in directory ``path``, read as JSON, with
    the dtype's name (``"float32"`` when unset): for the :data:`PLAIN_DECODERS` only, and
    only when every field is there as kv_layout reads it; None otherwise (transformers
    must read that config)."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(cfg, dict) or cfg.get("model_type") not in PLAIN_DECODERS:
        return None
    if any(key in cfg for key in ("text_config", "attribute_map")):
        return None
    heads, layers, hidden = (
        cfg.get(k) for k in ("num_attention_heads", "num_hidden_layers", "hidden_size")
    )
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or (hidden // heads if _ints(hidden, heads) and heads else None)
    dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    if not _ints(heads, layers, kv_heads, head_dim) or not isinstance(dtype, str):
        return None
    return {"num_layers": layers, "num_kv_heads": kv_heads, "head_dim": head_dim, "dtype": dtype}


def _ints(*values: Any) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values)
