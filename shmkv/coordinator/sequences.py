"""The sequence table: the coordinator's metadata above the block level, as one facade.

Composes the parts that own the state of sequences, each an object made once in
:meth:`SequenceTable.__init__` and handed the parts below it (a part calls only those;
each is the only writer of its own data, and says so in its module doc):

* ``shmkv.coordinator.rows``: sequences as rows of the shared tables, cache ids and slots,
  plain sequences without objects, every store into the shared tables, the row version
  kept batches check, the length bound;
* ``shmkv.coordinator.refs``: connections and their references, release, clone, info;
* ``shmkv.coordinator.handoffs``: hand-off tokens (export, open, expiry);
* ``shmkv.coordinator.prefix``: allocations (planned, checked, then applied), prefix keys,
  promotions from the tiers, commits and publication, hit counts;
* ``shmkv.coordinator.growth``: extends, copy-on-write, prepared writes, forks, truncates
  (the general path);
* ``shmkv.coordinator.decode``: the array fast paths of a batch step and kept batches;
* here: every wire operation, each handed to the part that does it, the ones that
  span parts orchestrated here (connections, plain allocations, the choice between a
  fast path and the general one: :meth:`SequenceTable.extend_batch`,
  :meth:`SequenceTable.extend_kept`), stats and the invariants over all the parts.

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
from typing import Any, Callable, Dict, List, Optional, Sequence as Seq, Union

import numpy as np

from shmkv.coordinator.allocator import BlockPool
from shmkv.coordinator.decode import MAX_KEPT, Decode
from shmkv.coordinator.growth import Growth
from shmkv.coordinator.handoffs import Handoffs, _Handoff
from shmkv.coordinator.prefix import AllocationPlan, PendingPromotion, Prefix
from shmkv.coordinator.refs import Refs
from shmkv.coordinator.rows import (
    MAX_REQUEST_ID,
    MAX_SALT_BYTES,
    TOKEN_SIZE,
    TOKEN_VERSION,
    Rows,
    Sequence,
    _check_count,
    format_cache_id,
)
from shmkv.memory.tables import SEQ_FIELDS, TableLayout, TableWriter

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


class SequenceTable:
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
        if tables is None:
            layout = TableLayout(pool.num_blocks, max_sequences, max_seq_blocks or pool.num_blocks)
            _owner, _epoch, seq, table = layout.views(bytearray(layout.nbytes))
            tables = TableWriter(layout, seq, table)
        self.tables = tables
        layout = tables.layout
        if arrays is None:
            arrays = (
                np.frombuffer(tables.seq, dtype=np.int64).reshape(-1, SEQ_FIELDS),
                np.frombuffer(tables.table, dtype=np.int32).reshape(-1, layout.max_seq_blocks),
                pool._owner_np,
            )
        self.max_seq_len = (
            max_seq_len if max_seq_len is not None else layout.max_seq_blocks * block_size
        )
        # The parts, each handed the ones below it.
        self._rows = Rows(pool, block_size, tp_size, tables, arrays, self.max_seq_len)
        self._refs = Refs(self._rows)
        self._handoffs = Handoffs(self._rows, self._refs, max_handoffs, max_handoff_ttl, clock)
        self._prefix = Prefix(self._rows, self._refs)
        self._growth = Growth(self._rows, self._refs, self._prefix, copy_block)
        self._decode = Decode(self._rows, self._refs)
        self.slot_bits = self._rows.slot_bits

    @property
    def sequences(self) -> Dict[int, Sequence]:
        """The live sequences that have a Python object, by cache id (the plain ones
        without are rows only: see the module doc)."""
        return self._rows.sequences

    @property
    def num_sequences(self) -> int:
        """Live sequences."""
        return self._rows.num_sequences

    def live(self) -> Dict[int, int]:
        """Every live sequence's cache id and its reference count (makes no object)."""
        return self._rows.live()

    @property
    def conn_refs(self) -> Dict[int, Dict[int, int]]:
        """Per connection, its references to sequences with objects."""
        return self._refs.conn_refs

    @property
    def handoffs(self) -> Dict[int, _Handoff]:
        """The outstanding hand-off tokens, by id."""
        return self._handoffs.handoffs

    @property
    def tiers(self) -> Any:
        """The lower tiers (``shmkv.tiers.TierSet``, set by the coordinator), or None."""
        return self._prefix.tiers

    @tiers.setter
    def tiers(self, tiers: Any) -> None:
        self._prefix.tiers = tiers

    @property
    def promotions(self) -> List[PendingPromotion]:
        """The promotions the last allocate started (see :meth:`take_promotions`)."""
        return self._prefix.promotions

    @property
    def newly_published(self) -> Optional[list]:
        """Blocks commits published, for a shared store to write behind (it sets this to
        a list, and takes it); None without one."""
        return self._prefix.newly_published

    @newly_published.setter
    def newly_published(self, published: Optional[list]) -> None:
        self._prefix.newly_published = published

    @property
    def client_counts(self) -> Dict[int, List[int]]:
        """Per connection, the ``[hit tokens, miss tokens]`` of its prompts (the
        coordinator sets each connection's list)."""
        return self._prefix.client_counts

    @property
    def counters(self) -> Dict[str, int]:
        """The table's counters, gathered from the parts that keep them (a new dict)."""
        prefix, handoffs = self._prefix.counters, self._handoffs.counters
        return {
            "prefix_hit_tokens": prefix["prefix_hit_tokens"],
            "prefix_miss_tokens": prefix["prefix_miss_tokens"],
            "prefix_hit_blocks": prefix["prefix_hit_blocks"],
            "prefix_miss_blocks": prefix["prefix_miss_blocks"],
            "cow_copies": self._growth.counters["cow_copies"],
            "published_blocks": prefix["published_blocks"],
            "deferred_allocations": prefix["deferred_allocations"],
            **handoffs,
        }

    # Connections and references (shmkv.coordinator.refs).

    def add_connection(self, conn_id: int) -> None:
        """A new connection, holding nothing."""
        self._refs.add_connection(conn_id)
        self._decode.add_connection(conn_id)

    def drop_connection(self, conn_id: int) -> int:
        """Drop every reference the connection holds, the bound hand-offs it exported
        and nobody opened, its kept batches and its hit counts; returns how many
        references were dropped (the hand-offs' included)."""
        self._prefix.drop_connection(conn_id)
        self._decode.drop_connection(conn_id)
        return self._handoffs.drop_connection(conn_id) + self._refs.drop_connection(conn_id)

    def info(self, conn_id: int, cache_id: int) -> dict:
        """A held sequence's info (see :meth:`~shmkv.coordinator.refs.Refs.info`)."""
        return self._refs.info(conn_id, cache_id)

    def clone(self, conn_id: int, cache_id: int) -> dict:
        """A new reference to the same sequence (no copy)."""
        return self._refs.clone(conn_id, cache_id)

    def release(self, conn_id: int, cache_id: int) -> None:
        """Drop one reference this connection holds."""
        self._refs.release_many(conn_id, [cache_id])

    def release_many(self, conn_id: int, cache_ids: Seq[int]) -> None:
        """Drop one reference per listed id (an id may repeat); all or none."""
        self._refs.release_many(conn_id, cache_ids)

    # Hand-offs (shmkv.coordinator.handoffs).

    def export(self, conn_id: int, cache_id: int, ttl: float, bound: bool = False) -> bytes:
        """A one-shot hand-off token (see :meth:`~shmkv.coordinator.handoffs.Handoffs.export`)."""
        return self._handoffs.export(conn_id, cache_id, ttl, bound)

    def open(self, conn_id: int, token: bytes) -> dict:
        """Turn a hand-off token into a reference held by this connection."""
        return self._handoffs.open(conn_id, token)

    def expire(self, now: Optional[float] = None) -> int:
        """Drop hand-offs past their deadline; returns how many expired."""
        return self._handoffs.expire(now)

    def next_deadline(self) -> Optional[float]:
        """The earliest hand-off deadline, for the server loop's select timeout."""
        return self._handoffs.next_deadline()

    # Allocations, promotions and commits (shmkv.coordinator.prefix).

    def allocate_many(self, conn_id: int, requests: Seq[dict]) -> List[dict]:
        """Allocate one sequence per request, all or none (see
        :meth:`~shmkv.coordinator.prefix.Prefix.allocate_many`)."""
        return self._prefix.allocate_many(conn_id, requests)

    def computing(self, conn_id: int, req: dict) -> dict:
        """How much of a prompt is cached, and how much after that others compute now
        (see :meth:`~shmkv.coordinator.prefix.Prefix.computing`)."""
        return self._prefix.computing(conn_id, req)

    def allocate(
        self,
        conn_id: int,
        num_tokens: int = 0,
        prompt: Union[List[int], bytes, None] = None,
        cache_salt: Optional[bytes] = None,
        request_id: Optional[str] = None,
        keys: Optional[bytes] = None,
        root: Optional[bytes] = None,
        defer: bool = False,
    ) -> dict:
        """Allocate one sequence (see :meth:`allocate_many`)."""
        return self._prefix.allocate_many(
            conn_id,
            [
                {
                    "num_tokens": num_tokens,
                    "prompt": prompt,
                    "cache_salt": cache_salt,
                    "request_id": request_id,
                    "keys": keys,
                    "root": root,
                    "defer": defer,
                }
            ],
        )[0]

    def allocate_counts(self, conn_id: int, counts: Seq[int]) -> tuple:
        """Allocate one plain sequence (no prompt) per count, all or none: the fast form
        of :meth:`allocate_many` for a scheduler admitting many requests at once, with a
        fixed number of array operations (the sequences get no objects, see the module
        doc). Returns ``(cache_ids, slots)`` as int64 arrays."""
        cache_ids, slot_ids = self._rows.allocate_light(conn_id, counts)
        self._refs.hold_light(conn_id, slot_ids)
        return cache_ids, slot_ids

    def take_promotions(self) -> List[PendingPromotion]:
        """The promotions the last allocate started (the coordinator copies them in)."""
        return self._prefix.take_promotions()

    def answer_early(self, records: Seq[PendingPromotion], here: Seq[int]) -> None:
        """The allocation of ``records`` is answered before their blocks are in (see
        :meth:`~shmkv.coordinator.prefix.Prefix.answer_early`)."""
        self._prefix.answer_early(records, here)

    def check_settled(self, seq: Sequence, what: str) -> None:
        """Raise ``NotSettled`` while a tier still copies blocks of ``seq`` in."""
        self._prefix.check_settled(seq, what)

    def finish_promotion(self, record: PendingPromotion, num_ok: int) -> int:
        """The bytes of the first ``num_ok`` promoted blocks are in (see
        :meth:`~shmkv.coordinator.prefix.Prefix.finish_promotion`); returns how many
        blocks were published."""
        return self._prefix.finish_promotion(record, num_ok)

    def settled(self, conn_id: int, cache_id: int) -> int:
        """The hit of held sequence ``cache_id`` once its early promotions have ended."""
        return self._prefix.settled(conn_id, cache_id)

    def commit(
        self,
        conn_id: int,
        cache_id: int,
        num_tokens: int,
        tp_rank: Optional[int] = None,
        start: Optional[int] = None,
    ) -> int:
        """Declare the first ``num_tokens`` slots fully written (see
        :meth:`~shmkv.coordinator.prefix.Prefix.commit`); returns how many leading blocks
        are published now."""
        return self._prefix.commit(conn_id, cache_id, num_tokens, tp_rank, start)

    def commit_batch(
        self,
        conn_id: int,
        cache_ids: Seq[int],
        num_tokens: Seq[int],
        tp_rank: Optional[int] = None,
        rank_connection: bool = False,
        starts: Optional[Seq[int]] = None,
    ) -> int:
        """:meth:`commit` for every sequence of a batch, all or none checked first (see
        :meth:`~shmkv.coordinator.prefix.Prefix.commit_batch`); returns the number of
        blocks published."""
        return self._prefix.commit_batch(
            conn_id, cache_ids, num_tokens, tp_rank, rank_connection, starts
        )

    # Growth (shmkv.coordinator.growth) and the decode fast paths (.decode).

    def extend_many(self, conn_id: int, items: Seq) -> List[dict]:
        """Reserve token slots in several sequences, all or none (see
        :meth:`~shmkv.coordinator.growth.Growth.extend_many`)."""
        self._decode.note_call(conn_id)
        return self._growth.extend_many(conn_id, items)

    def extend(
        self, conn_id: int, cache_id: int, num_tokens: int, tokens: Optional[List[int]] = None
    ) -> dict:
        """Reserve ``num_tokens`` more slots at the end of a sequence (see :meth:`extend_many`)."""
        item = [cache_id, num_tokens] if tokens is None else [cache_id, num_tokens, tokens]
        return self.extend_many(conn_id, [item])[0]

    def prepare_batch(
        self, conn_id: int, cache_ids: Seq[int], starts: Seq[int], counts: Seq[int]
    ) -> array:
        """Make slots already reserved writable in place in each sequence of a batch (see
        :meth:`~shmkv.coordinator.growth.Growth.prepare_batch`)."""
        self._decode.note_call(conn_id)
        return self._growth.prepare_batch(conn_id, cache_ids, starts, counts)

    def prepare_write(self, conn_id: int, cache_id: int, start: int, num_tokens: int) -> dict:
        """Make the blocks of slots ``[start, start + num_tokens)`` writable in place (see
        :meth:`~shmkv.coordinator.growth.Growth.prepare_write`)."""
        return self._growth.prepare_write(conn_id, cache_id, start, num_tokens)

    def fork(self, conn_id: int, cache_id: int) -> dict:
        """A new sequence sharing every block of ``cache_id`` (see
        :meth:`~shmkv.coordinator.growth.Growth.fork`)."""
        return self._growth.fork(conn_id, cache_id)

    def truncate_batch(self, conn_id: int, cache_ids: Seq[int], num_tokens: Seq[int]) -> int:
        """Shorten each sequence of a batch, all or none (see
        :meth:`~shmkv.coordinator.growth.Growth.truncate_batch`); returns the number of
        blocks released."""
        self._decode.note_call(conn_id)
        return self._growth.truncate_batch(conn_id, cache_ids, num_tokens)

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
        (:meth:`~shmkv.coordinator.decode.Decode.extend_uniform`) is tried, and when the
        batch does not qualify (nothing changed) the general path
        (:meth:`~shmkv.coordinator.growth.Growth.extend_general`) steps it and names any
        error.

        Returns the length of every sequence after the step (int64 array).
        """
        self._decode.note_call(conn_id)
        if isinstance(counts, int):
            self._rows.check_counts("count", [_check_count("count", counts)])
        else:
            self._rows.check_counts("counts", counts)
        if slots is not None and tokens is None and type(counts) is int and counts > 0:
            lens = self._decode.extend_uniform(conn_id, cache_ids, slots, counts)
            if lens is not None:
                return lens
        return self._growth.extend_general(conn_id, cache_ids, counts, tokens)

    def keep_batch(self, conn_id: int, cache_ids: Seq[int]) -> int:
        """Keep a batch of sequences held by this connection for :meth:`extend_kept`:
        its checks are made now and hold until one of them is released, forked, cloned,
        exported, opened, copied on write or given an object, or the connection changes
        their rows another way. Returns the batch's id, or 0 when it does not qualify
        (see :meth:`~shmkv.coordinator.decode.Decode._keepable`; then step it with
        :meth:`extend_batch`).
        A connection keeps its ``MAX_KEPT`` newest batches."""
        return self._decode.keep_batch(conn_id, cache_ids)

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
        decode = self._decode
        kept = decode.kept_batch(conn_id, batch_id)
        if kept is None:
            return None
        count = _check_count("count", count, 1)
        self._rows.check_length(count, "count")
        out = decode.step(conn_id, kept, count, seen)
        if out is None:  # rechecked, and any error named, by the general path
            lens = self.extend_batch(conn_id, kept.ids.tolist(), count, None, kept.where.tolist())
            return decode.after_general(conn_id, kept, lens)
        return out

    def stats(self) -> dict:
        """The pool's and the table's figures and counters (the ``stats`` answer)."""
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
        """Assert ref counts equal the references that exist (tests and stress): each
        part's own checks, and the pool's counts against the rows'."""
        self.pool.check_invariants()
        expected = self._rows.check_invariants()
        self._decode.check_invariants()
        assert expected == list(self.pool.ref_cnt), "ref counts differ from the block tables"
        self._refs.check_invariants(self._handoffs.token_refs())
