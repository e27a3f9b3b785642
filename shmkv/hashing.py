"""Deterministic prefix hashing of token blocks.

Owns the key of a full block: ``blake2b-128(parent_key || token ids as int64 LE)``,
with the root key derived from an optional extra key (a namespace: model, adapter,
salt). The same tokens give the same keys in every process, on every run and after
a coordinator restart: there is no per-process seed. 128-bit keys make an accidental
collision practically impossible. Also owns turning what a caller passes as token
ids into ints (:func:`token_list`). Pure: no I/O, no torch.
"""

from __future__ import annotations

import hashlib
import operator
import struct
import sys
from array import array
from functools import lru_cache
from typing import Iterable, List, Optional, Sequence, SupportsIndex, cast

from shmkv.errors import WrongType

KEY_SIZE = 16
_BIG_ENDIAN = sys.byteorder == "big"
_ROOT_TAG = b"shmkv-prefix-v1"


def root_key(extra_key: Optional[bytes] = None) -> bytes:
    """The parent key of a sequence's first block, for namespace ``extra_key``."""
    if not extra_key:  # the common case, without a call (cold, the cached call took 12 us)
        return _NO_SALT_ROOT
    return _root_key(bytes(extra_key))


@lru_cache(maxsize=1024)  # one per salt in use: the loop asks for it every prompt
def _root_key(extra: bytes) -> bytes:
    return hashlib.blake2b(
        _ROOT_TAG + len(extra).to_bytes(4, "little") + extra, digest_size=KEY_SIZE
    ).digest()


_NO_SALT_ROOT = _root_key(b"")


def pack_tokens(tokens: Sequence[int]) -> bytes:
    """Token ids as little-endian int64 bytes (the bytes that get hashed). Raises
    TypeError for one that is not an integer, OverflowError for one past int64.
    (``struct.pack``: half the time of ``array("q", ...)``, 50 us for 8k tokens here.)"""
    try:
        return struct.pack(f"<{len(tokens)}q", *tokens)
    except struct.error:
        packed = array("q", tokens)  # raises the precise error for the one that failed
        if _BIG_ENDIAN:
            packed.byteswap()
        return packed.tobytes()


def unpack_tokens(packed: bytes, start: int = 0) -> List[int]:
    """The token ids of :func:`pack_tokens` bytes, from token ``start`` on. Plain Python
    rather than numpy: the loop calls it for every prompt, and after its sleeps a numpy
    call costs it twice as much as this (its code comes back from memory too)."""
    tokens = array("q", packed[8 * start :])
    if _BIG_ENDIAN:
        tokens.byteswap()
    return tokens.tolist()


def block_keys(tokens: Sequence[int], block_size: int, parent: bytes) -> List[bytes]:
    """Keys of the full blocks of ``tokens``, chained from ``parent``.

    ``tokens`` must start on a block boundary; a trailing partial block gets no key.
    """
    return packed_block_keys(pack_tokens(tokens), block_size, parent)


def packed_block_keys(data: bytes, block_size: int, parent: bytes) -> List[bytes]:
    """:func:`block_keys` of tokens already packed (:func:`pack_tokens`'s bytes)."""
    step = block_size * 8
    keys = []
    blake2b = hashlib.blake2b  # hot loop: one C call per block
    for offset in range(0, (len(data) // step) * step, step):
        parent = blake2b(parent + data[offset : offset + step], digest_size=KEY_SIZE).digest()
        keys.append(parent)
    return keys


def split_keys(joined: bytes) -> List[bytes]:
    """The keys of ``joined`` (keys of ``KEY_SIZE`` bytes one after another, as clients
    send a prompt's): up to ``_SPLIT_MAX`` keys in one C call, where slicing them one by
    one cost the loop about 20 us for 32 keys after its sleeps. (Longer prompts are
    sliced: one cached ``Struct`` per key count stays small that way.)"""
    num = len(joined) // KEY_SIZE
    if num <= _SPLIT_MAX:
        return list(_keys_struct(num).unpack(joined))
    return [joined[i : i + KEY_SIZE] for i in range(0, num * KEY_SIZE, KEY_SIZE)]


_SPLIT_MAX = 128  # (their Structs: 32 bytes a key, about 260 KB for all)


@lru_cache(maxsize=None)  # at most _SPLIT_MAX + 1 of them
def _keys_struct(num: int) -> struct.Struct:
    return struct.Struct(f"{KEY_SIZE}s" * num)


def token_list(tokens: Iterable[SupportsIndex]) -> List[int]:
    """Token ids as a list of ints: from a list, a tensor, an array, or any integral
    scalars (``operator.index``: numpy integers are fine, floats and bools are not)."""
    if hasattr(tokens, "tolist"):
        tokens = tokens.tolist()
    tokens = list(tokens)
    if set(map(type, tokens)) <= {int}:  # (a C loop: a 4k-token prompt in 50 us, not 80)
        return cast(List[int], tokens)  # (each one an int, checked just above)
    out = []
    for t in tokens:
        if isinstance(t, bool):
            raise WrongType("token ids must be integers, got a bool")
        try:
            out.append(operator.index(t))
        except TypeError:
            raise WrongType(f"token ids must be integers, got {type(t).__name__}") from None
    return out
