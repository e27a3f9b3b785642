"""Running a model over a :class:`ShmkvCache`: a batch of prompts as model inputs
(:func:`left_pad`), the keyword a model's forward takes its cache by
(:func:`cache_argument`), and :func:`prefill` (the part of a prompt a cache does not
hold yet, run through the model).

Everything here calls the model or shapes its inputs; the cache itself is ``cache.py``.
Imports of shmkv: ``errors`` and, of this package, ``config`` and ``cache``.
"""

from __future__ import annotations

import inspect
from typing import Optional, Sequence

import torch

from shmkv.errors import InvalidArgument
from shmkv.integrations.transformers.cache import ShmkvCache
from shmkv.integrations.transformers.config import model_cache_salt

__all__ = ["cache_argument", "left_pad", "prefill"]


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
