"""The K/V shape of a Hugging Face model config, without importing transformers.

Owns :func:`kv_layout`, the one reading of a config's layers, K/V heads, head size and
dtype that :func:`shmkv.integrations.transformers.pool_config` and ``shmkv serve
--for-model`` share. It takes a loaded ``PretrainedConfig`` (it does not load one), so
the coordinator can have the config read in another process (transformers' config
classes import triton, see :func:`shmkv.tools.cli.for_model`).
"""

from __future__ import annotations

from typing import Any, NamedTuple


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
