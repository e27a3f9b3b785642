"""The transformers ``Cache`` over a shmkv pool: :class:`ShmkvCache`.

Owns making a cache (from a client, from handles, from prompts with prefix reuse), the
``Cache`` interface transformers calls (``get_mask_sizes``, ``update``, ``crop``,
``reorder_cache``, ...), what the cache holds (handles, lengths, the last forward's
path), ``commit`` (publishing rows for prefix reuse), closing and pickling, and the
hand-over with the "shmkv" mask and attention functions (the claim, the positions, the
key handed to a layer). :class:`ShmkvCache` holds
three parts and delegates to them: its rows (``_CacheState``, ``cache_state.py``), each
forward's step (``_CacheSteps``, ``cache_steps.py``) and how its layers attend
(``_CacheAttention``, ``cache_attention.py``). Imports of shmkv: ``client``, ``errors``
and, of this package, ``config``, ``attention`` (the mask hand-over) and the cache's
parts.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch
from transformers.cache_utils import Cache

from shmkv.client.client import Client
from shmkv.client.handle import KvCacheHandle
from shmkv.errors import InvalidArgument, WrongType
from shmkv.integrations.transformers.attention import (
    _MASK_SIZES,
    _mask_position_ids,
    _ShmkvMask,
)
from shmkv.integrations.transformers.cache_attention import _CacheAttention
from shmkv.integrations.transformers.cache_state import _NEVER, _CacheState, _Forward, _ShmkvLayer
from shmkv.integrations.transformers.cache_steps import _CacheSteps
from shmkv.integrations.transformers.config import (
    _check_full_attention,
    _config_of,
    model_cache_salt,
)

__all__ = ["ShmkvCache"]


class ShmkvCache(Cache):
    """A transformers ``Cache`` backed by shmkv sequences, one per batch row.

    Pass it to ``model.generate`` or to ``model(...)`` with ``use_cache=True`` (by the
    keyword :func:`cache_argument` names). A forward is one shmkv batch step: its first
    layer reserves the new tokens' slots in every row in one round trip, and each layer
    writes the whole batch's new K/V at once. With ``attn_implementation="shmkv"`` the
    layers attend over the pool, decode steps over its mirror (the paged path, see
    :mod:`shmkv.integrations.transformers`); with any other implementation they get every row's K/V,
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

    Made of three parts, each the only writer of its data: the rows (``_rows``, a
    ``_CacheState``: handles and per-row state, changed through its ``set_rows``,
    ``select``, ``crop``, ``adopt``, ``take_owned``, ``close_owned``), the step
    (``_steps``, a ``_CacheSteps``: ``begin``, ``write``, ``give_back``, ``forget``) and
    the attention paths (``_attn``, a ``_CacheAttention``: ``append``, ``dense``,
    ``mirror``, ``attend``, ``crop``, ``select``, ``close``; ``_attend`` is its
    ``attend``). The cache itself owns its layers, the mirror setting, the hand-over
    fields the "shmkv" functions read and write (``_claim``, ``_positions``,
    ``_pending``) and its lifetime.
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
        # The parts: the rows (handles and per-row state), each forward's step, and how
        # layers attend (made once the number of layers is known).
        # Row positions from which K/V is checked to be at its own position: every one
        # below that of a cache that may publish (from_prompts: its prompts; handles: not
        # known), none of a cache made from a client (its sequences carry no token ids).
        self._rows = rows = _CacheState(
            source if isinstance(source, Client) else None,
            0 if isinstance(source, Client) else _NEVER,
        )
        self._steps = _CacheSteps(rows)
        self._attn: _CacheAttention
        self._commit_upto: Optional[int] = None
        self._closed = False
        self._config_checked = False
        # model_cache_salt(model_config) if given, and whether model_config was a model (the
        # dtype of its weights counts) or a config (the dtype it declares)
        self._model_salt: Optional[bytes] = None
        self._salt_of_model = False
        self._expandable = False  # from_prompts, before its first forward: may fork rows
        # The position_ids of the forward whose mask is being built (None: transformers'
        # default, the padded positions); taken by that forward's first update.
        self._positions: Optional[torch.Tensor] = None
        self._claim: Optional[_ShmkvMask] = None  # set by the mask function, per forward
        self._pending: Optional[torch.Tensor] = None  # key handed to a layer, paged path
        self._last_path: Optional[str] = None
        if padding_side not in (None, "left"):
            raise InvalidArgument(f"padding_side must be 'left' or None, got {padding_side!r}")
        if isinstance(source, Client):
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
            rows.adopt(handles, owned=False)
            rows.set_rows(
                pads, stored if stored is not None else [num_tokens] * len(handles), lengths
            )
            num_layers = handles[0].num_layers
        if model_config is not None:
            _check_full_attention(model_config)
            self._config_checked = True
            self._model_salt = model_cache_salt(model_config)
            self._salt_of_model = model_config is not _config_of(model_config)[0]
        self._initial_tokens = num_tokens
        self._attn = _CacheAttention(rows, self._steps, num_layers)
        # The paged path of the "shmkv" attention function, called by it per layer.
        self._attend = self._attn.attend
        super().__init__(layers=[_ShmkvLayer(self, i, num_tokens) for i in range(num_layers)])

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
        cache._rows.set_rows(pads, stored, lens)
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
        cache._rows.adopt(handles, owned=True, client=client, check_below=width)
        cache._commit_upto = width
        cache._expandable = True
        return cache

    # -- what the cache holds --------------------------------------------------------------

    @property
    def handles(self) -> List[KvCacheHandle]:
        """The sequences, one per batch row (empty before the first forward of a cache
        made from a client)."""
        self._steps.give_back()
        return list(self._rows.handles or [])

    @property
    def handle(self) -> KvCacheHandle:
        """The one sequence of a batch-1 cache."""
        self._steps.give_back()
        handles = self._rows.handles
        if not handles or len(handles) != 1:
            raise InvalidArgument(
                f"the cache holds {len(handles or [])} sequences, not one; use .handles"
            )
        return handles[0]

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
        pad = self._rows.pad
        return [] if pad is None else pad.tolist()

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
        rows = self._rows
        if rows.handles:
            assert rows.pad is not None  # (set with the rows)
            written = (
                (n - rows.pad).clamp(min=0).minimum(rows.stored).minimum(rows.unpublished).tolist()
            )
            published = [h.commit(min(w, h.num_tokens)) for h, w in zip(rows.handles, written)]
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
        fwd = self._steps.fwd
        if self._pending is not None:
            self._pending = None
            raise InvalidArgument(
                "a layer attended over a ShmkvCache on the paged path without the 'shmkv' "
                "attention function (the model's attention implementation changed during the "
                "forward?); run the model with attn_implementation='shmkv' throughout"
            )
        if fwd is None or fwd.start != start or fwd.n != n or layer_idx in fwd.layers_done:
            fwd = self._begin(start, key_states)
            self._last_path = "paged" if fwd.paged else "dense"
        fwd.layers_done.add(layer_idx)
        if fwd.append and self._attn.append(fwd, layer_idx, key_states, value_states):
            self._pending = key_states
            layer.num_tokens = start + 1
            return key_states, value_states
        self._steps.write(fwd, layer_idx, key_states, value_states)
        layer.num_tokens = start + n
        if fwd.paged:
            self._pending = key_states
            if fwd.mirror:
                # Decode: the attention function reads the mirror, brought up to date here.
                self._attn.mirror(fwd, layer_idx, key_states, value_states)
            return key_states, value_states
        return self._attn.dense(fwd, layer_idx, key_states, value_states)

    def _begin(self, start: int, key_states: torch.Tensor) -> _Forward:
        """The first update of a forward: the rows checked against it (allocated,
        expanded), then its step (which path, which slots: one round trip)."""
        claim, self._claim = self._claim, None
        positions, self._positions = self._positions, None
        _MASK_SIZES.__dict__.pop("cache", None)
        batch, heads, n, head_dim = key_states.shape
        rows = self._rows
        if rows.handles is None:
            rows.allocate(batch)
        assert rows.handles is not None  # (allocated above)
        count = len(rows.handles)
        if count != batch and self._expandable and batch % count == 0:
            # generate(num_return_sequences=k or num_beams=k) repeats every row k times
            # before its first forward (repeat_interleave): the sequences are forked so.
            self.batch_repeat_interleave(batch // count)
        self._expandable = False
        handles = rows.handles
        if len(handles) != batch:
            raise InvalidArgument(
                f"the cache holds {len(handles)} sequences, the model ran a batch of {batch}"
            )
        first = handles[0]
        if (heads, head_dim) != (first.num_heads, first.head_dim):
            raise InvalidArgument(
                f"the model's K/V is {heads} heads x {head_dim}, the pool holds "
                f"{first.num_heads} x {first.head_dim}; size the pool with "
                "pool_config(model.config)"
            )
        if self._commit_upto is not None and start >= self._commit_upto:
            self.commit()  # before slots without token ids end the sequences' prefix keys
        if self._mirror is None:  # off unless asked for: it holds a second copy
            self._mirror = False
        return self._steps.begin(start, key_states, claim, positions, self._mirror)

    @property
    def _any_pad(self) -> bool:
        """Whether a row holds left padding (read by the "shmkv" mask function)."""
        return self._rows.any_pad

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidArgument("this ShmkvCache is closed")

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
        self._pending = None
        n = self.num_tokens
        self._attn.crop(n)
        if self._rows.crop(n):
            self._steps.forget()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Row ``i`` becomes old row ``beam_idx[i]``; a row taken twice is forked
        (copy-on-write), rows not taken are dropped (closed if the cache owns them)."""
        self._select([int(i) for i in beam_idx.tolist()])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep rows ``indices`` (see :meth:`reorder_cache`)."""
        self._select([int(i) for i in torch.as_tensor(indices).tolist()])

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every row ``repeats`` times in place (forks share blocks, copy-on-write)."""
        handles = self._rows.handles
        if handles is None:
            return
        self._select([b for b in range(len(handles)) for _ in range(repeats)])

    def _select(self, rows: List[int]) -> None:
        self._check_open()
        if self._rows.handles is None:
            return
        dropped = self._rows.select(rows)
        self._steps.forget(batch=True)
        self._attn.select(rows)
        self._rows.close_owned(dropped)

    # -- lifetime --------------------------------------------------------------------------

    def close(self) -> None:
        """Close the sequences this cache allocated or forked (handles passed in stay
        open). Idempotent; the cache cannot be used afterwards."""
        if self._closed:
            return
        owned = self._rows.take_owned()
        try:
            if (
                self._commit_upto is not None
                and self.num_tokens
                and all(h.is_valid() for h in self._rows.handles or [])
            ):
                self.commit()
        finally:
            self._closed = True
            self._pending = self._claim = None
            self._steps.forget(batch=True)
            self._attn.close()
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
        rows = self._rows
        if rows.handles is None:
            raise InvalidArgument("an empty ShmkvCache holds no sequence to hand over")
        assert rows.pad is not None  # (set with the rows)
        return (
            _rebuild,
            (
                list(rows.handles),
                self.num_tokens,
                rows.pad.tolist(),
                rows.stored.tolist(),
                self._mirror,
                rows.unpublished.tolist(),
            ),
        )

    def __repr__(self) -> str:
        handles = self._rows.handles
        rows = len(handles) if handles is not None else 0
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
        cache._rows.set_unpublished(unpublished)
    cache._rows.adopt(handles, owned=True)
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
