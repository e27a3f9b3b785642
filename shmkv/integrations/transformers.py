"""A Hugging Face transformers ``Cache`` whose K/V lives in a shmkv pool.

Owns :class:`ShmkvCache` (one shmkv sequence per batch row, written through a
handle as the model runs and gathered back for its attention), :func:`pool_config`
(a pool shaped for a model config), :func:`cache_argument` (the keyword a model's
``forward`` and ``generate`` take the cache by) and :func:`prefill` (run the part of
a prompt a cache does not hold yet, for prefill in one process and decoding in
another). It does not start coordinators and does not change how a model attends:
attention still runs on dense K/V, gathered from the pool at every layer.

Usage::

    cfg = pool_config(model.config, num_blocks=1024, dtype=torch.float32)
    with shmkv.Coordinator(cfg, name="lm") as coord, shmkv.connect(coord.address) as client:
        cache = ShmkvCache(client)
        out = model.generate(input_ids, max_new_tokens=32, **{cache_argument(model): cache})
        cache.close()

For decoder-only models whose layers all use full attention (Llama, Qwen2,
Mistral without sliding window, ...), on transformers 5.x.
"""

from __future__ import annotations

import inspect
from typing import List, Optional, Sequence

import torch

try:
    from transformers.cache_utils import Cache, CacheLayerMixin
except ImportError as exc:  # transformers before per-layer caches
    raise ImportError("shmkv.integrations.transformers needs a transformers release whose "
                      "Cache is a list of CacheLayerMixin layers (5.x): "
                      "pip install -U transformers") from exc

from ..client import Client
from ..errors import InvalidArgument, WrongType
from ..handle import KvCacheHandle
from ..layout import PoolConfig

__all__ = ["ShmkvCache", "cache_argument", "pool_config", "prefill"]


def pool_config(model_config, num_blocks: int, block_size: int = 16, dtype=None,
                device="cpu") -> PoolConfig:
    """A :class:`PoolConfig` with the layer count, K/V heads and head size of a model.

    Args:
        model_config: a transformers ``PretrainedConfig`` (its text decoder is used).
        num_blocks, block_size, device: as for :class:`PoolConfig`.
        dtype: pool dtype; default the config's ``dtype``, else float32. Keep it equal
            to the model's dtype: K/V is converted to the pool dtype when written.
    """
    text = model_config.get_text_config(decoder=True)
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    if dtype is None:
        dtype = getattr(text, "dtype", None) or torch.float32
    return PoolConfig(num_layers=text.num_hidden_layers, num_kv_heads=kv_heads,
                      head_dim=head_dim, num_blocks=num_blocks, block_size=block_size,
                      dtype=dtype, device=device)


def cache_argument(model) -> str:
    """``"cache"`` or ``"past_key_values"``: the keyword ``model``'s forward takes its
    cache by (transformers renamed it in 5.x)."""
    params = inspect.signature(type(model).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _check_full_attention(model_config) -> None:
    text = model_config.get_text_config(decoder=True)
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs
        layer_types, _ = get_layer_types_and_kwargs(text)
    except (ImportError, AttributeError, TypeError):
        layer_types = getattr(text, "layer_types", None) or []
    other = sorted({t for t in layer_types if t != "full_attention"})
    if other:
        raise InvalidArgument(f"ShmkvCache holds full-attention layers only; this model also "
                              f"has {', '.join(other)} layers: use transformers' DynamicCache")


class _ShmkvLayer(CacheLayerMixin):
    """One model layer of a :class:`ShmkvCache`: how many tokens it holds.

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
        """Append ``key_states``/``value_states`` (``[batch, heads, n, head_dim]``) to the
        pool; returns this layer's whole K and V, ``[batch, heads, tokens, head_dim]``."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return self._cache._append(self, key_states, value_states)

    def get_mask_sizes(self, query_length) -> tuple:
        if isinstance(query_length, torch.Tensor):  # older transformers pass cache_position
            query_length = query_length.shape[0]
        return self.num_tokens + query_length, 0

    def get_seq_length(self) -> int:
        return self.num_tokens

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.num_tokens = 0

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` tokens (a negative count, as for
        ``DynamicLayer.crop``); their slots are written over later."""
        if tokens_to_remove > 0:
            raise InvalidArgument(f"crop takes a negative count of tokens to remove, "
                                  f"got {tokens_to_remove}")
        self.num_tokens = max(0, self.num_tokens + tokens_to_remove)

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


class ShmkvCache(Cache):
    """A transformers ``Cache`` backed by shmkv sequences, one per batch row.

    Pass it to ``model.generate`` or to ``model(...)`` with ``use_cache=True`` (by the
    keyword :func:`cache_argument` names). Each forward appends the new tokens' K/V
    to the sequences (one round trip to reserve slots, then in-place writes) and
    gives every layer its K/V gathered from the pool. Greedy generation equals
    generation with ``DynamicCache``; logits agree to float round-off (bit for bit
    on CPU when the pool dtype is the model's). K/V read back from the pool carries
    no gradient: it is a cache for inference.

    Args:
        source: a :class:`~shmkv.Client` (sequences are allocated at the first
            forward, one per batch row, and are this cache's own), a
            :class:`~shmkv.KvCacheHandle`, or a list of handles, one per batch row
            (existing sequences, for example prefilled in another process; they stay
            the caller's to close).
        num_tokens: how many leading tokens of the given handles already hold K/V for
            every layer; default all the tokens they hold (``handle.num_tokens``).
        model_config: when given, checked to have only full-attention layers.

    ``close()`` (or ``with``) closes the sequences the cache allocated or forked.
    Beam search and ``num_return_sequences > 1`` work by forking sequences
    (copy-on-write). The pool must have at least as many layers as the model, and the
    model's K/V heads and head size (see :func:`pool_config`).

    Raises:
        WrongType / InvalidArgument: for a bad source or a mismatched model.
    """

    def __init__(self, source, *, num_tokens: Optional[int] = None, model_config=None):
        self._client: Optional[Client] = None
        self._handles: Optional[List[KvCacheHandle]] = None
        self._owned: set = set()
        self._commit_upto: Optional[int] = None
        self._closed = False
        if isinstance(source, Client):
            self._client = source
            num_layers = source.config.num_layers
            if num_tokens:
                raise InvalidArgument("num_tokens needs handles; a new cache starts empty")
            num_tokens = 0
        else:
            handles = [source] if isinstance(source, KvCacheHandle) else list(source)
            if not handles or not all(isinstance(h, KvCacheHandle) for h in handles):
                raise WrongType("source must be a shmkv Client, a KvCacheHandle or a "
                                "non-empty list of handles")
            lengths = {h.num_tokens for h in handles}
            shortest = min(lengths)
            if num_tokens is None:
                if len(lengths) != 1:
                    raise InvalidArgument(f"handles hold different token counts {sorted(lengths)};"
                                          f" pass num_tokens= (what every row holds)")
                num_tokens = shortest
            if isinstance(num_tokens, bool) or not isinstance(num_tokens, int):
                raise WrongType(f"num_tokens must be an int, got {type(num_tokens).__name__}")
            if not 0 <= num_tokens <= shortest:
                raise InvalidArgument(f"num_tokens={num_tokens} outside [0, {shortest}] "
                                      "(the tokens the handles hold)")
            self._handles = handles
            num_layers = handles[0].num_layers
        if model_config is not None:
            _check_full_attention(model_config)
        self._initial_tokens = num_tokens
        super().__init__(layers=[_ShmkvLayer(self, i, num_tokens) for i in range(num_layers)])

    @classmethod
    def from_prompt(cls, client: Client, prompt: Sequence[int], *,
                    cache_salt: Optional[bytes] = None, request_id: Optional[str] = None,
                    model_config=None) -> "ShmkvCache":
        """A cache for one prompt that reuses the longest cached prefix of it.

        Allocates a sequence for ``prompt`` (token ids) with prefix reuse; the cache
        starts with the reused tokens (all but the last prompt token at most, so the
        model still has a token to run), and ``generate(prompt, ...)`` or
        :func:`prefill` computes only the rest. The written prompt is committed (its
        full blocks become reusable by later requests) when decoding goes past it, at
        :meth:`close`, or by :meth:`commit`. ``num_cached_tokens`` says how many
        tokens were reused.
        """
        prompt = prompt.tolist() if hasattr(prompt, "tolist") else list(prompt)
        if prompt and isinstance(prompt[0], list):
            raise InvalidArgument("from_prompt takes one prompt (a flat list of token ids)")
        if not prompt:
            raise InvalidArgument("prompt is empty")
        handle = client.allocate(prompt=prompt, cache_salt=cache_salt, request_id=request_id)
        try:
            cache = cls(handle, num_tokens=min(handle.num_cached_tokens, len(prompt) - 1),
                        model_config=model_config)
        except BaseException:
            handle.close()
            raise
        cache._client = client
        cache._owned.add(handle)
        cache._commit_upto = len(prompt)
        return cache

    # -- what the cache holds --------------------------------------------------------------

    @property
    def handles(self) -> List[KvCacheHandle]:
        """The sequences, one per batch row (empty before the first forward of a cache
        made from a client)."""
        return list(self._handles or [])

    @property
    def handle(self) -> KvCacheHandle:
        """The one sequence of a batch-1 cache."""
        if not self._handles or len(self._handles) != 1:
            raise InvalidArgument(f"the cache holds {len(self._handles or [])} sequences, "
                                  "not one; use .handles")
        return self._handles[0]

    @property
    def num_cached_tokens(self) -> int:
        """Tokens the cache held when it was made (the reused prefix for ``from_prompt``)."""
        return self._initial_tokens

    @property
    def num_tokens(self) -> int:
        """Tokens every layer holds."""
        return min(layer.num_tokens for layer in self.layers)

    def commit(self) -> int:
        """Publish the full blocks every layer has written, for prefix reuse (only
        sequences allocated with a prompt carry the token ids needed). Returns the
        number of leading blocks published in the first sequence."""
        self._check_open()
        n = self.num_tokens
        published = [h.commit(min(n, h.num_tokens)) for h in self._handles or []]
        if self._commit_upto is not None and n >= self._commit_upto:
            self._commit_upto = None
        return published[0] if published else 0

    # -- the Cache interface ---------------------------------------------------------------

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args, **kwargs):
        """Append one layer's new K/V and return all of it (see ``Cache.update``)."""
        if layer_idx >= len(self.layers):
            raise InvalidArgument(
                f"the model has a layer {layer_idx}, the pool only {len(self.layers)} layers; "
                "size the pool with shmkv.integrations.transformers.pool_config(model.config)")
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidArgument("this ShmkvCache is closed")

    def _append(self, layer: _ShmkvLayer, key_states: torch.Tensor,
                value_states: torch.Tensor):
        self._check_open()
        batch, heads, n, head_dim = key_states.shape
        if self._handles is None:
            self._handles = self._client.allocate_many([0] * batch)
            self._owned.update(self._handles)
        handles = self._handles
        if len(handles) != batch:
            raise InvalidArgument(f"the cache holds {len(handles)} sequences, the model ran a "
                                  f"batch of {batch}")
        first = handles[0]
        if (heads, head_dim) != (first.num_heads, first.head_dim):
            raise InvalidArgument(f"the model's K/V is {heads} heads x {head_dim}, the pool holds "
                                  f"{first.num_heads} x {first.head_dim}; size the pool with "
                                  "pool_config(model.config)")
        start = layer.num_tokens
        end = start + n
        short = [(h, end - h.num_tokens) for h in handles if h.num_tokens < end]
        if short:
            self._reserve(start, short)
        pool_dtype, pool_device = first.dtype, first.device
        k_rows = key_states.detach().transpose(1, 2).to(device=pool_device, dtype=pool_dtype)
        v_rows = value_states.detach().transpose(1, 2).to(device=pool_device, dtype=pool_dtype)
        k_rows, v_rows = k_rows.contiguous(), v_rows.contiguous()
        idx = layer.layer_idx
        for b, h in enumerate(handles):
            h.write(idx, k_rows[b], v_rows[b], start=start)
        layer.num_tokens = end
        keys, values = [], []
        for h in handles:
            k_pages, v_pages, table = h.paged_kv(idx)
            table = table.long()
            # [blocks, block_size, heads, dim] -> the [heads, tokens, dim] models expect
            keys.append(k_pages[table].flatten(0, 1)[:end].transpose(0, 1))
            values.append(v_pages[table].flatten(0, 1)[:end].transpose(0, 1))
        if batch == 1:
            keys, values = keys[0][None], values[0][None]
        else:
            keys, values = torch.stack(keys), torch.stack(values)
        return (keys.to(device=key_states.device, dtype=key_states.dtype),
                values.to(device=value_states.device, dtype=value_states.dtype))

    def _reserve(self, start: int, short: list) -> None:
        if self._commit_upto is not None and start >= self._commit_upto:
            self.commit()  # before slots without token ids end the sequence's prefix keys
        if self._client is not None and all(h in self._owned for h, _ in short):
            self._client.extend_many(short)  # one round trip for the whole batch
        else:
            for h, need in short:
                h.extend(need)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens layer ``layer_idx`` holds."""
        if layer_idx >= len(self.layers):
            return 0
        return self.layers[layer_idx].num_tokens

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
            if self._commit_upto is not None and self.num_tokens and all(
                    h.is_valid() for h in self._handles or []):
                self.commit()
        finally:
            self._closed = True
            for h in owned:
                h.close()

    def __enter__(self) -> "ShmkvCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __reduce__(self):
        """Pickles as its handles (each through a hand-off) and its length; the copy
        owns the handles it opens."""
        self._check_open()
        if self._handles is None:
            raise InvalidArgument("an empty ShmkvCache holds no sequence to hand over")
        return (_rebuild, (list(self._handles), self.num_tokens))

    def __repr__(self) -> str:
        rows = len(self._handles) if self._handles is not None else 0
        return f"<ShmkvCache {rows} sequences x {self.num_tokens} tokens>"


def _rebuild(handles, num_tokens):
    cache = ShmkvCache(handles, num_tokens=num_tokens)
    cache._owned.update(handles)
    return cache


@torch.no_grad()
def prefill(model, cache: ShmkvCache, input_ids: torch.Tensor) -> torch.Tensor:
    """Run the tokens of ``input_ids`` that ``cache`` does not hold yet through
    ``model``, writing their K/V into the pool; returns the logits of the last token,
    ``[batch, vocab]`` (their argmax is the first greedy token).

    ``input_ids`` is ``[batch, tokens]`` (or ``[tokens]``), the whole prompt, of which
    the cache holds the first ``cache.get_seq_length()`` tokens.
    """
    ids = input_ids[None] if input_ids.dim() == 1 else input_ids
    done = cache.get_seq_length()
    if not 0 <= done < ids.shape[1]:
        raise InvalidArgument(f"the cache holds {done} tokens; the prompt has {ids.shape[1]}, "
                              "so there is nothing left to run")
    out = model(input_ids=ids[:, done:], use_cache=True, **{cache_argument(model): cache})
    return out.logits[:, -1]
