"""Hugging Face transformers on a shmkv pool: a ``Cache`` and an attention function.

Owns :class:`ShmkvCache` (one shmkv sequence per batch row; each forward is one
batch step: one round trip, then one batch write per layer), the ``"shmkv"``
attention implementation (registered with transformers' ``AttentionInterface`` and
``AttentionMaskInterface`` when this package is imported: layers attend over the
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

One file a concern, each opening with what it owns::

    config.py           pool_config, model_cache_salt, the full-attention check: what a
                        model's config tells shmkv
    attention.py        the "shmkv" mask and attention functions (shmkv_attention_forward,
                        register, use_shmkv_attention) and the hand-over by which a
                        forward tells its cache that its layers attend over the pool
    cache_state.py      the cache's layers, one forward's step record, and its rows
                        (_CacheState: handles, per-row bookkeeping)
    cache_steps.py      a forward's step (_CacheSteps): slots reserved (one round
                        trip), the path chosen, positions checked, K/V written
    cache_attention.py  how a layer attends (_CacheAttention): paged, over the mirror,
                        or dense
    cache.py            ShmkvCache: making one, the Cache interface, commit, close,
                        pickling; it holds the three parts above and delegates
    prompts.py          prefill, left_pad, cache_argument: running prompts through a
                        model over a cache

No file is named after a function the package exports (``prefill``, ``pool_config``):
a submodule of that name would hide it from ``import ... as``. The cache is four files
because it is one object of three parts: :class:`ShmkvCache` holds its rows, its steps
and its attention paths, plain objects each the only writer of its data (the steps and
the attention paths read the rows and change them through the rows' named methods; the
attention paths read the step's pool and forward); the cut keeps a file to one concern
without changing what a forward does.

Imports point down the list above: ``config`` imports none of these files;
``attention`` only ``config`` (it reaches the cache through the members its
``_AttendingCache`` names); the cache's files import ``attention`` (the hand-over),
``config`` and each other, ``cache_state`` first, then ``cache_steps``,
``cache_attention``, and ``cache`` last; ``prompts``
imports ``cache`` and ``config``. None imports this ``__init__``, which only checks the
transformers release and re-exports. Of shmkv they import ``errors``, ``client``,
``memory.layout``, ``kernels.attention`` and ``integrations.hf_config``.
"""

try:  # before any part imports transformers: say which release is needed
    from transformers.cache_utils import Cache, CacheLayerMixin  # noqa: F401
    from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: F401
    from transformers.masking_utils import (  # noqa: F401
        AttentionMaskInterface,
        causal_mask_function,
        prepare_padding_mask,
        sdpa_mask,
    )
    from transformers.modeling_utils import AttentionInterface  # noqa: F401
except ImportError as exc:  # transformers before per-layer caches and attention interfaces
    raise ImportError(
        "shmkv.integrations.transformers needs a transformers release whose "
        "Cache is a list of CacheLayerMixin layers and which has an "
        "AttentionInterface (5.x): pip install -U transformers"
    ) from exc

from shmkv.integrations.transformers.attention import (
    ATTN_IMPLEMENTATION,
    register,
    shmkv_attention_forward,
    use_shmkv_attention,
)
from shmkv.integrations.transformers.cache import ShmkvCache
from shmkv.integrations.transformers.config import model_cache_salt, pool_config
from shmkv.integrations.transformers.prompts import cache_argument, left_pad, prefill

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
