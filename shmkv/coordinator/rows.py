"""Sequences as rows: the state the parts of the sequence table share.

Owns :class:`Sequence` (one sequence with a Python object), cache ids (``(serial <<
slot_bits) | slot``, the serial never reused), table slots, the plain sequences that
have no object (a row of the shared tables only, see ``shmkv.coordinator.sequences``), every
store of a new or dead sequence into the shared tables, the row version kept batches
check (:meth:`Rows._touch`), and the one bound on a sequence's length
(:meth:`Rows._check_length`). :class:`Rows` declares the state every part of
:class:`~shmkv.coordinator.sequences.SequenceTable` reads; the parts build on it, each in the
file named after it:

``rows`` <- ``refs`` (connections, references, release) <- ``handoffs`` (export, open,
expiry) <- ``prefix`` (allocation, prefix keys, promotions, commits) <- ``growth``
(extends, copy-on-write, prepare, fork) <- ``decode`` (the array fast paths and kept
batches) <- ``sequences`` (the facade: state, dispatch, stats, invariants).

Pure: no torch, no sockets, no I/O.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence as Seq, Union

import numpy as np

from shmkv.coordinator.allocator import BlockPool
from shmkv.errors import InvalidArgument, LimitExceeded, PoolExhausted, WrongType
from shmkv.memory.tables import CACHE_ID, NUM_TOKENS, TableWriter, run_index

TOKEN_VERSION = 1


TOKEN_SIZE = 1 + 8 + 16


MAX_SALT_BYTES = 1024


MAX_REQUEST_ID = 256


def format_cache_id(cache_id: int) -> str:
    """The user-facing form of a cache id."""
    return f"kv-{cache_id:x}"


class Sequence:
    """One cached sequence. Plain slots: this is on every hot path."""

    __slots__ = (
        "cache_id",
        "block_ids",
        "num_tokens",
        "num_refs",
        "keys",
        "keys_open",
        "tail_tokens",
        "root",
        "num_committed",
        "rank_tokens",
        "num_cached",
        "request_id",
        "slot",
        "gap",
        "promoting",
        "promoting_from",
        "fetching",
    )

    def __init__(
        self, cache_id: int, root: Optional[bytes], tp_size: int, request_id: Optional[str]
    ):
        self.cache_id = cache_id
        self.block_ids: List[int] = []
        self.num_tokens = 0
        self.num_refs = 0
        # Prefix keys of the leading full blocks whose token ids are known (None for a
        # sequence without a prompt). ``keys_open`` stays True while every token id so
        # far is known; an extend without ids closes it: the keys already computed stay
        # publishable, no later block gets one.
        self.keys: Optional[List[bytes]] = [] if root is not None else None
        self.keys_open = root is not None
        self.tail_tokens: List[int] = []  # token ids after the last keyed block
        self.root = root
        self.num_committed = 0  # leading blocks already published/committed
        self.rank_tokens = [0] * tp_size  # tokens each tensor-parallel rank committed
        self.num_cached = 0  # tokens reused from the prefix cache at allocate
        self.request_id = request_id  # None: the default, format_cache_id(cache_id)
        self.slot = -1  # row in the shared tables
        # The early-answer state (``shmkv.coordinator.prefix``, where its rule is kept):
        # blocks a lower tier still copies in, the first of them, and how many of them only
        # the shared store may have; and after an early-answered promotion came up short,
        # per rank, how far it has written again from the first lost block on (None: no
        # loss).
        self.promoting = 0
        self.promoting_from = 0
        self.fetching = 0
        self.gap: Optional[List[int]] = None

    def info(self) -> dict:
        """What a handle on the sequence is made from; while a tier still copies blocks
        in, also how many (``promoting``), from which block on (``promoting_from``) and
        how many of them only the shared store may have (``fetching``)."""
        out = {
            "cache_id": self.cache_id,
            "slot": self.slot,
            "blocks": list(self.block_ids),
            "num_tokens": self.num_tokens,
            "num_cached": self.num_cached,
            "request_id": self.request_id,
        }
        if self.promoting:
            out["promoting"] = self.promoting
            out["promoting_from"] = self.promoting_from
            out["fetching"] = min(self.fetching, self.promoting)
        return out


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal arrays of one shape."""
    return bool((a == b).all())


def _check_count(name: str, value: object, lo: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise WrongType(f"{name} must be an int, got {type(value).__name__}")
    if value < lo:
        raise InvalidArgument(f"{name} must be >= {lo}, got {value}")
    return value


class Rows:
    """The rows of sequences: slots, plain sequences without objects, table stores."""

    # The state every part reads and writes, made once by ``SequenceTable.__init__``
    # (see there for what each is) and declared here, at the bottom of the parts.
    pool: BlockPool
    block_size: int
    tp_size: int
    copy_block: Callable[[int, int], None]
    max_handoffs: int
    max_handoff_ttl: float
    clock: Callable[[], float]
    tables: TableWriter
    max_seq_len: int
    _seq_np: np.ndarray
    _table_np: np.ndarray
    _owner_np: np.ndarray
    _seq_flat: np.ndarray
    _num_blocks_np: np.ndarray
    _keys_open_np: np.ndarray
    _keys_open_mv: memoryview
    _held_np: Dict[int, np.ndarray]
    _held_mv: Dict[int, memoryview]
    _scratch: np.ndarray
    slot_bits: int
    _slot_mask: int
    sequences: Dict[int, Sequence]
    _light_np: np.ndarray
    _light_mv: memoryview
    _light_conn: np.ndarray
    _num_light: int
    _kept_version: int
    _kept_count: np.ndarray
    _kept_count_mv: memoryview
    _conn_steps: Dict[int, int]
    _kept: Dict[int, Dict[int, Any]]
    _next_kept: int
    conn_refs: Dict[int, Dict[int, int]]
    tiers: Any
    promotions: List[Any]
    newly_published: Optional[list]
    handoffs: Dict[int, Any]
    _handoff_heap: list
    _next_serial: int
    _next_handoff_id: int
    counters: Dict[str, int]
    client_counts: Dict[int, List[int]]

    def _light_slot(self, cache_id: int) -> int:
        """The slot of ``cache_id`` if it is a live plain sequence without an object,
        else -1."""
        slot = cache_id & self._slot_mask
        if (
            cache_id > 0
            and slot < len(self._light_mv)
            and self._light_mv[slot]
            and self._seq_np[slot, CACHE_ID] == cache_id
        ):
            return slot
        return -1

    def _materialize(self, slot: int) -> Sequence:
        """The :class:`Sequence` of the plain sequence in ``slot``, made from its row;
        its holder's reference moves to ``conn_refs``."""
        cache_id = int(self._seq_np[slot, CACHE_ID])
        self._light_np[slot] = False
        self._num_light -= 1
        self._touch(slot)
        seq = Sequence(cache_id, None, self.tp_size, None)
        seq.slot = slot
        seq.num_tokens = int(self._seq_np[slot, NUM_TOKENS])
        seq.block_ids = self._table_np[slot, : self._num_blocks_np[slot]].tolist()
        seq.num_refs = 1
        self.sequences[cache_id] = seq
        self.conn_refs[int(self._light_conn[slot])][cache_id] = 1
        return seq

    def _live_seq(self, cache_id: int) -> Optional[Sequence]:
        """The live sequence ``cache_id`` (made from its row if it has no object yet), or
        None."""
        seq = self.sequences.get(cache_id)
        if seq is None:
            slot = self._light_slot(cache_id)
            if slot >= 0:
                seq = self._materialize(slot)
        return seq

    def _release_light(self, slots: np.ndarray, held: np.ndarray) -> None:
        """Free plain sequences without objects, whose one reference (in ``held``, their
        connection's held slots) is gone: their slots and blocks, with array
        operations. ``slots`` are distinct."""
        if not slots.shape[0]:
            return
        rows = run_index(slots)  # a slice when they are one run: views, cheaper stores
        self._light_np[rows] = False
        held[rows] = False
        self._num_light -= int(slots.shape[0])
        if self._kept_count[rows].any():
            self._kept_version += 1
        used = self._num_blocks_np[rows]
        widest = int(used.max())
        blocks = self._table_np[rows, :widest]
        if not bool((used == widest).all()):  # (entries past a row's own are 0: not its)
            blocks = blocks[np.arange(widest) < used[:, None]]
        freed = blocks.ravel().astype(np.int64)  # a copy: the release zeroes the rows
        self.tables.release_many(slots, rows, widest)
        self.pool.free_private(freed)

    @property
    def num_sequences(self) -> int:
        """Live sequences."""
        return len(self.sequences) + self._num_light

    def live(self) -> Dict[int, int]:
        """Every live sequence's cache id and its reference count (makes no object)."""
        out = {cache_id: seq.num_refs for cache_id, seq in self.sequences.items()}
        light = self._seq_np[np.flatnonzero(self._light_np), CACHE_ID]
        out.update(dict.fromkeys(light.tolist(), 1))
        return out

    def _touch(self, slot: int) -> None:
        """The sequence in ``slot`` changes outside kept steps (released, given an object,
        forked, cloned, exported, opened, copied on write): the kept batches check again
        if one holds it."""
        if self._kept_count_mv[slot]:
            self._kept_version += 1

    def _new_sequence(self, root: Optional[bytes], request_id: Optional[str]) -> Sequence:
        """A sequence with a fresh cache id and slot; the caller checked
        ``tables.check_slots``, fills it and calls :meth:`_publish`."""
        slot = self.tables.take(1)[0]
        cache_id = (self._next_serial << self.slot_bits) | slot
        self._next_serial += 1
        seq = Sequence(cache_id, root, self.tp_size, request_id)
        seq.slot = slot
        self.sequences[cache_id] = seq
        return seq

    def _publish(self, seq: Sequence) -> None:
        """Give a filled new sequence its row in the shared tables."""
        self.tables.assign(seq.slot, seq.cache_id, seq.block_ids, seq.num_tokens)
        self._keys_open_mv[seq.slot] = bool(seq.keys_open)

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _check_length(self, num_tokens: int, what: Union[str, Callable[[], str]]) -> None:
        """The one bound on a sequence's length, checked before anything changes:
        ``PoolExhausted`` past what the whole pool holds, else ``LimitExceeded`` past
        ``max_seq_len``. ``num_tokens`` is a Python int (no wrap-around); ``what`` names
        the sequence (a str, or a callable making one: most calls pass)."""
        if num_tokens <= self.max_seq_len:
            return
        name = what() if callable(what) else what
        blocks = self._blocks_for(num_tokens)
        if blocks > self.pool.num_blocks:
            raise PoolExhausted(
                f"pool exhausted: {name} would need {blocks} blocks for "
                f"{num_tokens} tokens, the whole pool has "
                f"{self.pool.num_blocks}; raise num_blocks"
            )
        raise LimitExceeded(
            f"{name}: {num_tokens} tokens, but a sequence holds at most "
            f"{self.max_seq_len} (PoolConfig.max_seq_len); raise max_seq_len"
        )

    def _check_counts(self, name: str, counts: Union[Seq[int], np.ndarray], lo: int = 0) -> None:
        """Every one of ``counts`` (ints or an int64 array) lies in ``[lo, max_seq_len]``:
        ``InvalidArgument`` below, the length check above."""
        if isinstance(counts, np.ndarray):
            if not counts.shape[0]:
                return
            least, most = int(counts.min()), int(counts.max())
        else:
            if not len(counts):
                return
            least, most = min(counts), max(counts)
        if least < lo:
            raise InvalidArgument(f"{name} must be >= {lo}, got {least}")
        self._check_length(most, name)
