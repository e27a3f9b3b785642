"""Sequences as rows of the shared tables: the part every other part builds on.

Owns :class:`Sequence` records' place in the table (``Rows.sequences``, the cache
id and slot of each), cache ids (``(serial << slot_bits) | slot``, the serial never
reused), table slots, the plain sequences that have no object (a row of the shared
tables only, see ``shmkv.coordinator.sequences``) and the connection holding each, the
table writer and every store into the shared tables (so a sequence's ``block_ids`` and
``num_tokens`` are written here only, through :meth:`Rows.publish`,
:meth:`Rows.append_blocks`, :meth:`Rows.set_length`, :meth:`Rows.replace_block`,
:meth:`Rows.truncate` and the array stores of a batch step), the prefix-key flags a
batch step checks (:meth:`Rows.set_keys_open`), the row version kept batches check
(:meth:`Rows.touch`, :meth:`Rows.count_kept`), and the one bound on a sequence's length
(:meth:`Rows.check_length`).

Does not own who holds a sequence (``shmkv.coordinator.refs``; :meth:`Rows.take_object`
gives the holder of a plain sequence back for it to record), prefix keys and commits
(``shmkv.coordinator.prefix``), nor which batches are kept (``shmkv.coordinator.decode``).
Uses no other part: the parts above it are handed this one when they are made.

Pure: no torch, no sockets, no I/O.
"""

from __future__ import annotations

from array import array
from typing import Callable, Dict, List, Optional, Sequence as Seq, Tuple, Union

import numpy as np

from shmkv.coordinator.allocator import BlockPool
from shmkv.errors import InvalidArgument, LimitExceeded, PoolExhausted, WrongType
from shmkv.memory.tables import (
    CACHE_ID,
    GENERATION,
    NUM_TOKENS,
    SEQ_FIELDS,
    TableWriter,
    run_index,
)

TOKEN_VERSION = 1


TOKEN_SIZE = 1 + 8 + 16


MAX_SALT_BYTES = 1024


MAX_REQUEST_ID = 256


def format_cache_id(cache_id: int) -> str:
    """The user-facing form of a cache id."""
    return f"kv-{cache_id:x}"


class Sequence:
    """One cached sequence. Plain slots: this is on every hot path.

    Each field has one writer: ``cache_id``, ``slot``, ``block_ids`` and ``num_tokens``
    :class:`Rows`; ``num_refs`` ``shmkv.coordinator.refs``; the prefix keys, commits and
    the early-answer state ``shmkv.coordinator.prefix``.
    """

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
    """The rows of sequences: slots, plain sequences without objects, table stores
    (see the module doc).

    Args:
        pool: the block pool (blocks of released rows go back to it).
        block_size: tokens per block.
        tp_size: tensor-parallel ranks (a new :class:`Sequence` counts per rank).
        tables: the writer of the shared block tables; this part alone stores through it.
        arrays: ``(seq, table, owner)`` numpy views of the shared tables and the owner
            array (see :class:`~shmkv.coordinator.sequences.SequenceTable`).
        max_seq_len: tokens one sequence may hold.
    """

    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        tp_size: int,
        tables: TableWriter,
        arrays: Tuple[np.ndarray, np.ndarray, np.ndarray],
        max_seq_len: int,
    ):
        self.pool = pool
        self.block_size = block_size
        self.tp_size = tp_size
        self.tables = tables
        layout = tables.layout
        # Tokens one sequence may hold (PoolConfig.max_seq_len), exactly, not rounded up
        # to whole blocks. Every count and length is checked against it (in Python ints)
        # before any array arithmetic, which therefore never leaves int64.
        self.max_seq_len = max_seq_len
        # Views of the shared tables, read by the parts' checks over a whole batch;
        # written here only.
        self.seq_np, self.table_np, self.owner_np = arrays
        self.seq_flat = self.seq_np.reshape(-1)  # (a view: the rows are contiguous)
        self.num_blocks_np = np.frombuffer(tables.num_blocks, dtype=np.int64)
        # Slots whose sequence still extends its prefix keys (``Sequence.keys_open``):
        # what a batch step checks at once. Its memoryview is for the one-slot reads and
        # writes of every allocation and release: after the loop's sleeps a numpy scalar
        # index costs it about twice a memoryview's (its code comes back from memory too).
        self.keys_open_np = np.zeros(layout.max_sequences, dtype=bool)
        self._keys_open_mv = self.keys_open_np.data
        # A cache id carries its slot in its low bits: ``(serial << slot_bits) | slot``,
        # the serial never reused, so any id finds its row with no lookup table.
        self.slot_bits = max(1, (layout.max_sequences - 1).bit_length())
        self.slot_mask = (1 << self.slot_bits) - 1
        self._next_serial = 1
        # Sequences with a Python object, and the slots of the plain ones without (see
        # the module doc), with the one connection holding each.
        self.sequences: Dict[int, Sequence] = {}
        self.light_np = np.zeros(layout.max_sequences, dtype=bool)
        self._light_mv = self.light_np.data
        self.light_conn = np.zeros(layout.max_sequences, dtype=np.int64)
        self.num_light = 0
        # Moves whenever a sequence in a kept batch changes outside its steps (see
        # :meth:`touch`); ``kept_count`` says which slots some kept batch holds (moved by
        # ``shmkv.coordinator.decode`` through :meth:`count_kept`).
        self.kept_version = 0
        self.kept_count = np.zeros(layout.max_sequences, dtype=np.int32)
        self._kept_count_mv = self.kept_count.data

    def light_slot(self, cache_id: int) -> int:
        """The slot of ``cache_id`` if it is a live plain sequence without an object,
        else -1."""
        slot = cache_id & self.slot_mask
        if (
            cache_id > 0
            and slot < len(self._light_mv)
            and self._light_mv[slot]
            and self.seq_np[slot, CACHE_ID] == cache_id
        ):
            return slot
        return -1

    def take_object(self, slot: int) -> Tuple[Sequence, int]:
        """The :class:`Sequence` of the plain sequence in ``slot``, made from its row and
        kept in ``sequences`` from now on, and the connection holding it (whose
        reference the caller records)."""
        cache_id = int(self.seq_np[slot, CACHE_ID])
        self.light_np[slot] = False
        self.num_light -= 1
        self.touch(slot)
        seq = Sequence(cache_id, None, self.tp_size, None)
        seq.slot = slot
        seq.num_tokens = int(self.seq_np[slot, NUM_TOKENS])
        seq.block_ids = self.table_np[slot, : self.num_blocks_np[slot]].tolist()
        self.sequences[cache_id] = seq
        return seq, int(self.light_conn[slot])

    def allocate_light(self, conn_id: int, counts: Seq[int]) -> Tuple[np.ndarray, np.ndarray]:
        """One plain sequence (no prompt, no object) of each count, held by ``conn_id``,
        all or none, with a fixed number of array operations. Returns ``(cache_ids,
        slots)`` as int64 arrays; the caller records that ``conn_id`` holds the slots."""
        tokens = np.asarray(counts, dtype=np.int64).reshape(-1)
        num = tokens.shape[0]
        self.check_counts("num_tokens", tokens)  # (before any arithmetic on them)
        hi = int(tokens.max()) if num else 0
        lo = int(tokens.min()) if num else 0
        bs, pool, tables = self.block_size, self.pool, self.tables
        blocks = (tokens + bs - 1) // bs
        longest = (hi + bs - 1) // bs
        tables.check_slots(num)
        uniform = lo == hi  # (a scheduler admitting requests of one size)
        need = num * longest if uniform else int(blocks.sum())
        if need > pool.num_available:
            raise PoolExhausted(
                f"pool exhausted: need {need} blocks, {pool.num_available} free or evictable "
                f"(num_blocks={pool.num_blocks}); free handles or raise num_blocks"
            )
        slot_ids = np.array(tables.take(num), dtype=np.int64)
        serial = self._next_serial
        self._next_serial += num
        cache_ids = (np.arange(serial, serial + num, dtype=np.int64) << self.slot_bits) | slot_ids
        owners = cache_ids if uniform and longest == 1 else np.repeat(cache_ids, blocks)
        taken = np.array(pool.allocate(need, owners), dtype=np.int64)
        tables.assign_many(slot_ids, cache_ids, taken, blocks, tokens)
        self.light_np[slot_ids] = True
        self.light_conn[slot_ids] = conn_id
        self.num_light += num
        return cache_ids, slot_ids

    def release_light(self, slots: np.ndarray) -> Union[slice, np.ndarray]:
        """Free plain sequences without objects whose one reference is gone: their slots
        and blocks, with array operations. ``slots`` are distinct. Returns the index of
        those rows (a slice when they are one run), for the caller's per-slot arrays."""
        if not slots.shape[0]:
            return slots
        rows = run_index(slots)  # a slice when they are one run: views, cheaper stores
        self.light_np[rows] = False
        self.num_light -= int(slots.shape[0])
        if self.kept_count[rows].any():
            self.kept_version += 1
        used = self.num_blocks_np[rows]
        widest = int(used.max())
        blocks = self.table_np[rows, :widest]
        if not bool((used == widest).all()):  # (entries past a row's own are 0: not its)
            blocks = blocks[np.arange(widest) < used[:, None]]
        freed = blocks.ravel().astype(np.int64)  # a copy: the release zeroes the rows
        self.tables.release_many(slots, rows, widest)
        self.pool.free_private(freed)
        return rows

    @property
    def num_sequences(self) -> int:
        """Live sequences."""
        return len(self.sequences) + self.num_light

    def live(self) -> Dict[int, int]:
        """Every live sequence's cache id and its reference count (makes no object)."""
        out = {cache_id: seq.num_refs for cache_id, seq in self.sequences.items()}
        light = self.seq_np[np.flatnonzero(self.light_np), CACHE_ID]
        out.update(dict.fromkeys(light.tolist(), 1))
        return out

    def touch(self, slot: int) -> None:
        """The sequence in ``slot`` changes outside kept steps (released, given an object,
        forked, cloned, exported, opened, copied on write): the kept batches check again
        if one holds it."""
        if self._kept_count_mv[slot]:
            self.kept_version += 1

    def count_kept(self, where: np.ndarray, delta: int) -> None:
        """Kept batches holding the rows ``where`` moved by ``delta`` (one was kept or
        dropped)."""
        self.kept_count[where] += delta

    def check_slots(self, num: int) -> None:
        """Raise ``LimitExceeded`` unless ``num`` more sequences fit in the tables."""
        self.tables.check_slots(num)

    def new_sequence(self, root: Optional[bytes], request_id: Optional[str]) -> Sequence:
        """A sequence with a fresh cache id and slot; the caller checked
        :meth:`check_slots`, and gives it its blocks with :meth:`publish`."""
        slot = self.tables.take(1)[0]
        cache_id = (self._next_serial << self.slot_bits) | slot
        self._next_serial += 1
        seq = Sequence(cache_id, root, self.tp_size, request_id)
        seq.slot = slot
        self.sequences[cache_id] = seq
        return seq

    def publish(self, seq: Sequence, block_ids: List[int], num_tokens: int) -> None:
        """Give a new sequence its blocks and length, and its row in the shared tables."""
        seq.block_ids = block_ids
        seq.num_tokens = num_tokens
        self.tables.assign(seq.slot, seq.cache_id, block_ids, num_tokens)
        self._keys_open_mv[seq.slot] = bool(seq.keys_open)

    def drop(self, seq: Sequence) -> None:
        """The last reference to ``seq`` is gone: free its slot and drop its blocks
        (tail first into the pool's LRU)."""
        del self.sequences[seq.cache_id]
        self.tables.release(seq.slot, len(seq.block_ids))
        self.pool.decref(reversed(seq.block_ids))

    def set_keys_open(self, seq: Sequence) -> None:
        """Mirror ``seq.keys_open`` (``shmkv.coordinator.prefix`` changed it) for the
        checks of a batch step."""
        self._keys_open_mv[seq.slot] = bool(seq.keys_open)

    def append_blocks(self, seq: Sequence, new: List[int], num_tokens: int) -> None:
        """``new`` blocks at the end of ``seq``, which holds ``num_tokens`` tokens now."""
        self.tables.append(seq.slot, len(seq.block_ids), new, num_tokens)
        seq.block_ids += new
        seq.num_tokens = num_tokens

    def set_length(self, seq: Sequence, num_tokens: int) -> None:
        """A new length of ``seq`` whose blocks are all in its table already."""
        seq.num_tokens = num_tokens
        self.tables.set_length(seq.slot, num_tokens)

    def add_tokens(self, seqs: List[Sequence], counts: Seq[int], lengths: array[int]) -> List[int]:
        """``counts[i]`` more tokens in ``seqs[i]``, whose blocks hold them already;
        ``lengths`` gets every sequence's length after (the general step's result).
        Returns the indices of the sequences that grew and still take prefix keys (the
        caller extends their keys)."""
        table_seq, stride = self.tables.seq, SEQ_FIELDS
        keyed = []
        for i, (seq, num) in enumerate(zip(seqs, counts)):
            if num:
                new_len = seq.num_tokens + num
                seq.num_tokens = new_len
                table_seq[seq.slot * stride + NUM_TOKENS] = new_len
                if seq.keys_open:
                    keyed.append(i)
                lengths[i] = new_len
            else:
                lengths[i] = seq.num_tokens
        return keyed

    def replace_block(self, seq: Sequence, index: int, block_id: int) -> None:
        """Block ``index`` of ``seq`` is ``block_id`` now (its copy on write)."""
        seq.block_ids[index] = block_id
        self.tables.replace(seq.slot, index, block_id)

    def truncate(self, seq: Sequence, num_tokens: int) -> List[int]:
        """Shorten ``seq`` to ``num_tokens``; returns the blocks past its new last one,
        which the caller drops."""
        keep = -(-num_tokens // self.block_size)
        dropped = seq.block_ids[keep:]
        del seq.block_ids[keep:]
        seq.num_tokens = num_tokens
        self.touch(seq.slot)
        self.tables.truncate(seq.slot, keep, num_tokens)
        return dropped

    def add_blocks(self, where: np.ndarray, have: np.ndarray, blocks: List[int]) -> None:
        """One new entry, ``blocks[i]``, at index ``have[i]`` of each row ``where[i]`` (a
        batch step; the caller stores the lengths after)."""
        # the shared-table order: entries, then generation, then (after) the length
        self.table_np[where, have] = blocks
        self.seq_np[where, GENERATION] += 1
        self.num_blocks_np[where] += 1

    def store_lengths(self, where: np.ndarray, lengths: np.ndarray) -> None:
        """The lengths of the rows ``where`` after a batch step (their entries are in)."""
        self.seq_np[where, NUM_TOKENS] = lengths

    def step_lengths(self, lengths_at: np.ndarray) -> None:
        """One more token in each row whose length lies at ``lengths_at`` in the flat
        sequence rows (a kept step, its entries in)."""
        self.seq_flat[lengths_at] += 1

    def follow_step(
        self,
        ids: np.ndarray,
        heavy: np.ndarray,
        lengths: np.ndarray,
        grow_at: np.ndarray,
        blocks: List[int],
    ) -> None:
        """A batch step stored in the rows, made to the objects of the sequences that
        have one (``heavy[i]``): sequence ``ids[i]`` holds ``lengths[i]`` tokens, and
        sequence ``ids[grow_at[j]]`` got block ``blocks[j]``."""
        sequences = self.sequences
        for cache_id, block_id, keep in zip(ids[grow_at].tolist(), blocks, heavy[grow_at].tolist()):
            if keep:
                sequences[cache_id].block_ids.append(block_id)
        for cache_id, n in zip(ids[heavy].tolist(), lengths[heavy].tolist()):
            sequences[cache_id].num_tokens = n

    @staticmethod
    def follow_kept(
        heavy: List[Sequence],
        objects: List[Optional[Sequence]],
        count: int,
        grown: np.ndarray,
        blocks: np.ndarray,
    ) -> None:
        """A kept step stored in the rows, made to the objects of its sequences that have
        one (``heavy``; ``objects[i]`` is sequence ``i``'s or None): ``count`` tokens more
        in each, and ``blocks[j]`` added to sequence ``grown[j]``."""
        for seq in heavy:
            seq.num_tokens += count
        for i, block in zip(grown.tolist(), blocks.tolist()):
            seq = objects[i]
            if seq is not None:
                seq.block_ids.append(block)

    def check_invariants(self) -> List[int]:
        """Assert each row agrees with its sequence (tests and stress); returns, per
        block, how many rows hold it (what its reference count must be)."""
        pool, seq_np, mask = self.pool, self.seq_np, self.slot_mask
        expected = [0] * pool.num_blocks
        for seq in self.sequences.values():
            assert seq.num_refs > 0
            assert len(seq.block_ids) == self.blocks_for(seq.num_tokens)
            for block_id in seq.block_ids:
                expected[block_id] += 1
        assert int(self.light_np.sum()) == self.num_light
        for slot in np.flatnonzero(self.light_np).tolist():  # plain ones without objects
            cache_id = int(seq_np[slot, CACHE_ID])
            assert cache_id & mask == slot and cache_id not in self.sequences
            used = int(self.num_blocks_np[slot])
            assert used == self.blocks_for(int(seq_np[slot, NUM_TOKENS]))
            for block_id in self.table_np[slot, :used].tolist():
                expected[block_id] += 1
                assert pool.owner[block_id] == cache_id
                assert pool.block_key[block_id] is None
        return expected

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def check_length(self, num_tokens: int, what: Union[str, Callable[[], str]]) -> None:
        """The one bound on a sequence's length, checked before anything changes:
        ``PoolExhausted`` past what the whole pool holds, else ``LimitExceeded`` past
        ``max_seq_len``. ``num_tokens`` is a Python int (no wrap-around); ``what`` names
        the sequence (a str, or a callable making one: most calls pass)."""
        if num_tokens <= self.max_seq_len:
            return
        name = what() if callable(what) else what
        blocks = self.blocks_for(num_tokens)
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

    def check_counts(self, name: str, counts: Union[Seq[int], np.ndarray], lo: int = 0) -> None:
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
        self.check_length(most, name)
