"""The sequence table: the coordinator's metadata above the block level, as one facade.

Owns the state of sequences and composes the parts that change it, each in the file
named after it (lower parts first; a part calls only the parts below it):

* ``shmkv.coordinator.rows``: sequences as rows of the shared tables, cache ids and slots, plain
  sequences without objects, the row version kept batches check, the length bound;
* ``shmkv.coordinator.refs``: connections and their references, release, clone, info;
* ``shmkv.coordinator.handoffs``: hand-off tokens (export, open, expiry);
* ``shmkv.coordinator.prefix``: allocations (planned, checked, then applied), prefix keys,
  promotions from the tiers, commits and publication;
* ``shmkv.coordinator.growth``: extends, copy-on-write, prepared writes, forks (the general path);
* ``shmkv.coordinator.decode``: the array fast paths of a batch step and kept batches;
* here: the state itself (made once, in :meth:`SequenceTable.__init__`), the choice
  between a fast path and the general one (:meth:`SequenceTable.extend_batch`,
  :meth:`SequenceTable.extend_kept`), stats and the invariants.

Every public method is one wire operation and either succeeds completely or raises
and changes nothing (all-or-nothing). Every change to a block table or a length is
mirrored into the shared tables (``shmkv.memory.tables``), which every attached process
reads without a round trip.

A plain sequence made by :meth:`SequenceTable.allocate_counts` (no prompt, one
reference, held by the connection that made it) has no Python object: its state is
its row of the shared tables, so a scheduler admitting or retiring hundreds of them
costs a fixed number of array operations. The first call that needs more of it
(a fork, a clone, an export, a per-sequence call) makes its
:class:`~shmkv.coordinator.rows.Sequence` from that row. A decode batch can be *kept*
(:meth:`SequenceTable.keep_batch`): checked once, then stepped by
:meth:`SequenceTable.extend_kept` with no per-step checks until something else changes
those sequences.

Does not do I/O and does not touch K/V bytes: copy-on-write calls the
``copy_block(src, dst)`` callback the coordinator provides. Pure: no torch, no
sockets, so the whole state machine is testable in one process.
"""

from __future__ import annotations

import time
from array import array
from typing import Callable, Dict, List, Optional, Sequence as Seq, Union

import numpy as np

from shmkv.coordinator.allocator import BlockPool
from shmkv.coordinator.decode import Decode, _Kept
from shmkv.coordinator.handoffs import _Handoff
from shmkv.coordinator.prefix import AllocationPlan, PendingPromotion
from shmkv.coordinator.rows import (
    MAX_REQUEST_ID,
    MAX_SALT_BYTES,
    TOKEN_SIZE,
    TOKEN_VERSION,
    Sequence,
    _check_count,
    format_cache_id,
)
from shmkv.memory.tables import CACHE_ID, NUM_TOKENS, SEQ_FIELDS, TableLayout, TableWriter

__all__ = [
    "SequenceTable",
    "Sequence",
    "PendingPromotion",
    "AllocationPlan",
    "format_cache_id",
    "MAX_KEPT",
    "MAX_REQUEST_ID",
    "MAX_SALT_BYTES",
    "TOKEN_SIZE",
    "TOKEN_VERSION",
]

MAX_KEPT = 64  # kept batches per connection (SequenceTable.keep_batch)


class SequenceTable(Decode):
    """The coordinator's sequence-level state machine.

    Args:
        pool: the block pool.
        block_size: tokens per block.
        tp_size: tensor-parallel ranks that must all commit a block before it is published.
        copy_block: ``copy_block(src, dst)`` copies one block's K/V bytes (all ranks).
        max_handoffs: outstanding hand-off tokens allowed at once.
        max_handoff_ttl: the longest ``ttl`` an export may ask for, in seconds.
        clock: monotonic clock (seconds), injectable for tests.
        tables: the writer of the shared block tables (``shmkv.memory.tables``); private
            tables of ``max_sequences`` x ``max_seq_blocks`` when omitted.
        arrays: ``(seq, table, owner)`` numpy views of the shared tables and the owner
            array (the same memory ``tables`` and ``pool`` write), for the checks of a
            decode step over a whole batch at once; made over ``tables`` when omitted.
        max_seq_len: tokens one sequence may hold; default the tables' row, in tokens.
    """

    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        tp_size: int = 1,
        copy_block: Callable[[int, int], None] = lambda src, dst: None,
        max_handoffs: int = 65536,
        max_handoff_ttl: float = 3600.0,
        clock: Callable[[], float] = time.monotonic,
        tables: Optional[TableWriter] = None,
        max_sequences: int = 1024,
        max_seq_blocks: Optional[int] = None,
        arrays: Optional[tuple] = None,
        max_seq_len: Optional[int] = None,
    ):
        self.pool = pool
        self.block_size = block_size
        self.tp_size = tp_size
        self.copy_block = copy_block
        self.max_handoffs = max_handoffs
        self.max_handoff_ttl = max_handoff_ttl
        self.clock = clock
        if tables is None:
            layout = TableLayout(pool.num_blocks, max_sequences, max_seq_blocks or pool.num_blocks)
            _owner, _epoch, seq, table = layout.views(bytearray(layout.nbytes))
            tables = TableWriter(layout, seq, table)
        self.tables = tables
        layout = tables.layout
        # Tokens one sequence may hold (PoolConfig.max_seq_len), exactly, not rounded up
        # to whole blocks. Every count and length is checked against it (in Python ints)
        # before any array arithmetic, which therefore never leaves int64.
        self.max_seq_len = (
            max_seq_len if max_seq_len is not None else layout.max_seq_blocks * block_size
        )
        if arrays is None:
            arrays = (
                np.frombuffer(tables.seq, dtype=np.int64).reshape(-1, SEQ_FIELDS),
                np.frombuffer(tables.table, dtype=np.int32).reshape(-1, layout.max_seq_blocks),
                pool._owner_np,
            )
        self._seq_np, self._table_np, self._owner_np = arrays
        self._seq_flat = self._seq_np.reshape(-1)  # (a view: the rows are contiguous)
        self._num_blocks_np = np.frombuffer(tables.num_blocks, dtype=np.int64)
        # Slots whose sequence still extends its prefix keys (``Sequence.keys_open``),
        # and, per connection, the slots it holds: what a batch step checks at once.
        self._keys_open_np = np.zeros(layout.max_sequences, dtype=bool)
        self._held_np: Dict[int, np.ndarray] = {}
        # Memoryviews over the same arrays, for the one-slot reads and writes of every
        # allocation and release: after the loop's sleeps a numpy scalar index costs it
        # about twice a memoryview's (its code comes back from memory too).
        self._keys_open_mv = self._keys_open_np.data
        self._held_mv: Dict[int, memoryview] = {}
        self._scratch = np.zeros(layout.max_sequences, dtype=np.int64)
        # A cache id carries its slot in its low bits: ``(serial << slot_bits) | slot``,
        # the serial never reused, so any id finds its row with no lookup table.
        self.slot_bits = max(1, (layout.max_sequences - 1).bit_length())
        self._slot_mask = (1 << self.slot_bits) - 1
        # Sequences with a Python object, and the slots of the plain ones without (see
        # the module doc), with the one connection holding each. ``conn_refs`` counts
        # a connection's references to sequences with objects only.
        self.sequences: Dict[int, Sequence] = {}
        self._light_np = np.zeros(layout.max_sequences, dtype=bool)
        self._light_mv = self._light_np.data
        self._light_conn = np.zeros(layout.max_sequences, dtype=np.int64)
        self._num_light = 0
        # Moves whenever a sequence in a kept batch changes outside its steps (see
        # :meth:`_touch`); ``_kept_count`` says which slots some kept batch holds.
        # ``_conn_steps`` moves with every call of a connection that may change its
        # rows. A kept batch (:meth:`keep_batch`) stays checked while both stand still.
        self._kept_version = 0
        self._kept_count = np.zeros(layout.max_sequences, dtype=np.int32)
        self._kept_count_mv = self._kept_count.data
        self._conn_steps: Dict[int, int] = {}
        self._kept: Dict[int, Dict[int, _Kept]] = {}
        self._next_kept = 1
        self.conn_refs: Dict[int, Dict[int, int]] = {}
        # Lower tiers (``shmkv.tiers.TierSet``, set by the coordinator): a prefix that
        # misses the pool continues there. ``promotions``: what the last allocate must
        # copy in before it is answered (the coordinator takes them).
        self.tiers = None
        self.promotions: List[PendingPromotion] = []
        # Blocks a commit published, as ``(block_id, the sequence's keys, index)``, for
        # a shared store to write behind (``shmkv.tiers.redis_store``); None without one. The keys
        # list only grows, so ``keys[:index + 1]`` stays this block's chain.
        self.newly_published: Optional[list] = None
        self.handoffs: Dict[int, _Handoff] = {}
        self._handoff_heap: list = []
        self._next_serial = 1
        self._next_handoff_id = 1
        # Per connection: the ``[hit tokens, miss tokens]`` of its prompts, a list the
        # coordinator shares among the connections of one client name (``/metrics``);
        # every connection has one, so they sum to the two counters below.
        self.client_counts: Dict[int, List[int]] = {}
        self.counters = {
            "prefix_hit_tokens": 0,
            "prefix_miss_tokens": 0,
            "prefix_hit_blocks": 0,
            "prefix_miss_blocks": 0,
            "cow_copies": 0,
            "published_blocks": 0,
            "exported_handoffs": 0,
            "opened_handoffs": 0,
            "expired_handoffs": 0,
        }

    def extend_batch(
        self,
        conn_id: int,
        cache_ids: Seq[int],
        counts: Union[int, Seq[int]],
        tokens: Optional[List[List[int]]] = None,
        slots: Optional[Seq[int]] = None,
    ) -> Union[np.ndarray, array[int]]:
        """Reserve ``counts`` (an int for all, or one per sequence) more slots in each
        sequence of a batch, all or none; copy-on-write of shared partly filled last
        blocks included. ``tokens``: one list of token ids per sequence, or None.
        ``slots``: the sequences' rows in the shared tables, as the client knows them
        (checked), for the vectorized decode path.

        The counts are checked first, then the decode fast path
        (:meth:`~shmkv.coordinator.decode.Decode._extend_uniform`) is tried, and when the batch does
        not qualify (nothing changed) the general path
        (:meth:`~shmkv.coordinator.growth.Growth._extend_general`) steps it and names any error.

        Returns the length of every sequence after the step (int64 array).
        """
        if conn_id in self._conn_steps:
            self._conn_steps[conn_id] += 1
        if isinstance(counts, int):
            self._check_counts("count", [_check_count("count", counts)])
        else:
            self._check_counts("counts", counts)
        if slots is not None and tokens is None and type(counts) is int and counts > 0:
            lens = self._extend_uniform(conn_id, cache_ids, slots, counts)
            if lens is not None:
                return lens
        return self._extend_general(conn_id, cache_ids, counts, tokens)

    def keep_batch(self, conn_id: int, cache_ids: Seq[int]) -> int:
        """Keep a batch of sequences held by this connection for :meth:`extend_kept`:
        its checks are made now and hold until one of them is released, forked, cloned,
        exported, opened, copied on write or given an object, or the connection changes
        their rows another way. Returns the batch's id, or 0 when it does not qualify
        (see :meth:`~shmkv.coordinator.decode.Decode._keepable`; then step it with
        :meth:`extend_batch`).
        A connection keeps its ``MAX_KEPT`` newest batches."""
        kept = self._kept.get(conn_id)
        if kept is None:
            return 0
        keep = self._keepable(conn_id, cache_ids)
        if keep is None:
            return 0
        if len(kept) >= MAX_KEPT:
            self._kept_count[kept.pop(next(iter(kept))).where] -= 1
        batch_id = self._next_kept
        self._next_kept += 1
        kept[batch_id] = _Kept(
            np.asarray(cache_ids, dtype=np.int64),
            keep[0],
            self._kept_version,
            self._conn_steps[conn_id],
            keep[1],
        )
        self._kept_count[keep[0]] += 1
        return batch_id

    def extend_kept(self, conn_id: int, batch_id: int, count: int, seen: int) -> Optional[dict]:
        """:meth:`extend_batch` of ``count`` more tokens in every sequence of a kept
        batch, with no per-step checks while it stays checked (see :meth:`keep_batch`).

        ``seen``: the step number the caller's copy of the batch's rows and lengths is
        at. Returns ``{"steps", "same", "grown", "blocks"}`` and, unless ``same``,
        ``"lens"``: this step's number; whether the caller's copy, with ``count`` more
        tokens in every sequence and ``blocks[i]`` added to row ``grown[i]``, is the
        batch now (else it reads the rows again, and ``lens`` are the lengths after the
        step). None when the batch is not kept (never, dropped for a newer one, or
        another connection's): step it with :meth:`extend_batch`.
        """
        kept = self._kept.get(conn_id, {}).get(batch_id)
        if kept is None:
            return None
        count = _check_count("count", count, 1)
        self._check_length(count, "count")
        current = (
            kept.version == self._kept_version and kept.conn_steps == self._conn_steps[conn_id]
        )
        self._conn_steps[conn_id] += 1
        done = self._step_kept(kept, count) if current else None
        kept.steps += 1
        if done is None:  # rechecked, and any error named, by the general path
            kept.version = -1
            lens = self.extend_batch(conn_id, kept.ids.tolist(), count, None, kept.where.tolist())
            keep = self._keepable(conn_id, kept.ids)
            if keep is not None:
                kept.reset(self._kept_version, self._conn_steps[conn_id], keep[1])
            return {"steps": kept.steps, "same": False, "lens": lens}
        kept.conn_steps = self._conn_steps[conn_id]
        grown, blocks = done
        out = {
            "steps": kept.steps,
            "same": seen == kept.steps - 1,
            "grown": grown,
            "blocks": blocks,
        }
        if not out["same"]:
            out["lens"] = self._seq_flat[kept.lengths_at]
        return out

    def stats(self) -> dict:
        pool = self.pool
        out = {
            "num_blocks": pool.num_blocks,
            "free_blocks": pool.num_free,
            "cached_blocks": pool.num_cached,
            "referenced_blocks": pool.num_referenced,
            "evictions": pool.num_evictions,
            "sequences": self.num_sequences,
            "copies_discarded": pool.num_copies_discarded,
            "connections": len(self.conn_refs),
            "handoffs": len(self.handoffs),
            "prefix_index_blocks": len(pool.prefix_index),
        }
        out.update(self.counters)
        return out

    def check_invariants(self) -> None:
        """Assert ref counts equal the references that exist (tests and stress)."""
        self.pool.check_invariants()
        expected = [0] * self.pool.num_blocks
        for seq in self.sequences.values():
            assert seq.num_refs > 0
            assert len(seq.block_ids) == self._blocks_for(seq.num_tokens)
            for block_id in seq.block_ids:
                expected[block_id] += 1
        assert int(self._light_np.sum()) == self._num_light
        kept_count = np.zeros_like(self._kept_count)
        for batches in self._kept.values():
            for kept in batches.values():
                kept_count[kept.where] += 1
        assert np.array_equal(kept_count, self._kept_count)
        for slot in np.flatnonzero(self._light_np).tolist():  # plain ones without objects
            cache_id = int(self._seq_np[slot, CACHE_ID])
            assert cache_id & self._slot_mask == slot and cache_id not in self.sequences
            holders = [conn for conn, held in self._held_np.items() if held[slot]]
            assert holders == [int(self._light_conn[slot])]
            assert cache_id not in self.conn_refs[holders[0]]
            used = int(self._num_blocks_np[slot])
            assert used == self._blocks_for(int(self._seq_np[slot, NUM_TOKENS]))
            for block_id in self._table_np[slot, :used].tolist():
                expected[block_id] += 1
                assert self.pool.owner[block_id] == cache_id
                assert self.pool.block_key[block_id] is None
        assert expected == list(self.pool.ref_cnt), "ref counts differ from the block tables"
        refs: Dict[int, int] = {}
        for conn in self.conn_refs.values():
            for cache_id, count in conn.items():
                refs[cache_id] = refs.get(cache_id, 0) + count
        for handoff in self.handoffs.values():
            refs[handoff.cache_id] = refs.get(handoff.cache_id, 0) + 1
        light = self._seq_np[np.flatnonzero(self._light_np), CACHE_ID].tolist()
        refs.update(dict.fromkeys(light, 1))  # each held once, by its connection
        assert refs == self.live()
        for conn_id, held in self._held_np.items():
            assert {
                int(self._seq_np[slot, CACHE_ID]) for slot in np.flatnonzero(held).tolist()
            } == set(self.conn_refs[conn_id]) | {
                cache_id
                for cache_id in light
                if self._light_conn[cache_id & self._slot_mask] == conn_id
            }
