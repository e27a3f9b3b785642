"""The decode fast paths: a batch step with array operations, and kept batches.

Owns the step of many sequences by ``count`` tokens each with a fixed number of array
operations (plain sequences without objects, and ones with objects that only their
connection holds), the growth of those that open a block, and kept batches: a decode
batch checked once and then stepped with no per-step checks while nothing else changes
its sequences (the row version of ``shmkv.coordinator.rows``) and its connection makes
no other call that may change its rows (:meth:`Decode.note_call`, which the facade
calls first in each such operation). Each fast path returns None, having changed
nothing, when the batch does not qualify: the facade (``shmkv.coordinator.sequences``)
then takes the general path (``shmkv.coordinator.growth``), which names any error.

Does not store into the shared tables itself: the rows part does, through its
:meth:`~shmkv.coordinator.rows.Rows.add_blocks`,
:meth:`~shmkv.coordinator.rows.Rows.store_lengths`,
:meth:`~shmkv.coordinator.rows.Rows.step_lengths`,
:meth:`~shmkv.coordinator.rows.Rows.follow_step`,
:meth:`~shmkv.coordinator.rows.Rows.follow_kept` and
:meth:`~shmkv.coordinator.rows.Rows.count_kept`; the checks of a batch are the references
part's (:meth:`~shmkv.coordinator.refs.Refs.checked_rows`). It reads the rows' arrays
and the references of the connection directly (those reads are the fast path).
"""

from __future__ import annotations

from array import array
from typing import Dict, List, Optional, Sequence as Seq, Tuple, Union

import numpy as np

from shmkv.coordinator.refs import Refs
from shmkv.coordinator.rows import Rows, Sequence, format_cache_id
from shmkv.errors import PoolExhausted
from shmkv.memory.tables import NUM_TOKENS, SEQ_FIELDS


class _Kept:
    """A connection's kept batch (``SequenceTable.keep_batch``): its sequences, their
    slots, and what its checks hold against (``version``, ``conn_steps``)."""

    __slots__ = (
        "ids",
        "where",
        "lengths_at",
        "version",
        "conn_steps",
        "steps",
        "phases",
        "added",
        "longest",
        "objects",
        "heavy",
    )

    def __init__(
        self,
        ids: np.ndarray,
        where: np.ndarray,
        version: int,
        conn_steps: int,
        objects: Optional[List[Optional[Sequence]]] = None,
    ):
        self.ids, self.where, self.steps = ids, where, 0
        self.lengths_at = where * SEQ_FIELDS + NUM_TOKENS  # in the flat sequence rows
        self.reset(version, conn_steps, objects)

    def reset(
        self, version: int, conn_steps: int, objects: Optional[List[Optional[Sequence]]] = None
    ) -> None:
        self.version, self.conn_steps = version, conn_steps
        self.objects = objects  # per sequence: its Sequence, or None for a plain one
        self.heavy: Optional[List[Sequence]] = (
            None if objects is None else [s for s in objects if s is not None]
        )
        # for one token a step: {offset in a block: sequences}
        self.phases: Optional[Dict[int, np.ndarray]] = None
        self.added = 0  # tokens each sequence got since ``phases`` was made
        self.longest = 0  # the longest sequence's length when ``phases`` was made


_NONE = np.zeros(0, dtype=np.int64)


MAX_KEPT = 64  # kept batches per connection (Decode.keep_batch)


class Decode:
    """The array fast paths of a batch step and kept batches (see the module doc).

    Args:
        rows: the rows part (the arrays read, every store made).
        refs: the references part (the checks of a batch).
    """

    def __init__(self, rows: Rows, refs: Refs):
        self._rows = rows
        self._refs = refs
        self.pool = rows.pool
        self.block_size = rows.block_size
        # ``conn_steps`` moves with every call of a connection that may change its rows
        # (:meth:`note_call`). A kept batch (:meth:`keep_batch`) stays checked while it
        # and the rows' version stand still.
        self.conn_steps: Dict[int, int] = {}
        self.kept: Dict[int, Dict[int, _Kept]] = {}
        self._next_kept = 1

    def add_connection(self, conn_id: int) -> None:
        """A new connection, keeping no batch yet."""
        self.conn_steps[conn_id] = 0
        self.kept[conn_id] = {}

    def drop_connection(self, conn_id: int) -> None:
        """Forget a closed connection's kept batches."""
        self.conn_steps.pop(conn_id, None)
        for gone in self.kept.pop(conn_id, {}).values():
            self._rows.count_kept(gone.where, -1)

    def note_call(self, conn_id: int) -> None:
        """A call of this connection that may change its rows: its kept batches check
        again before their next step."""
        if conn_id in self.conn_steps:
            self.conn_steps[conn_id] += 1

    def check_invariants(self) -> None:
        """Assert the rows' kept counts are the kept batches' (tests and stress)."""
        kept_count = np.zeros_like(self._rows.kept_count)
        for batches in self.kept.values():
            for kept in batches.values():
                kept_count[kept.where] += 1
        assert np.array_equal(kept_count, self._rows.kept_count)

    def extend_uniform(
        self, conn_id: int, cache_ids: Seq[int], slots: Seq[int], count: int
    ) -> Optional[np.ndarray]:
        """The decode step (``count`` more tokens in every sequence, no token ids) with
        array operations over the whole batch: a constant number of them, whatever the
        batch size, plus Python work only for the sequences that need a new block, a
        copy of a shared last block, or to stop their prefix keys. None (nothing
        changed) when the batch does not check out: the general path then names the
        error."""
        rows = self._rows
        ids = np.asarray(cache_ids, dtype=np.int64)
        where = self._refs.checked_rows(conn_id, ids, np.asarray(slots, dtype=np.int64))
        if where is None:
            return None
        if rows.light_np[where].all():
            done = self._extend_light(where, ids, count)
            if done is not None:
                return done[0]
        bs = self.block_size
        lens = rows.seq_np[where, NUM_TOKENS]
        have = rows.num_blocks_np[where]
        new = lens + count
        if int(new.max()) > rows.max_seq_len:
            return None  # the general path names the sequence
        full = (lens % bs) == 0
        last = rows.table_np[where, np.maximum(have - 1, 0)]
        writable = full | (rows.owner_np[last] == ids)  # the last block, if partial
        fits = new <= have * bs
        # One new block, and nothing else to do: the other common decode case.
        grow = ~fits & writable & (new <= (have + 1) * bs)
        if rows.keys_open_np[where].any() or not ((fits & writable) | grow).all():
            # copies of shared blocks, several blocks, or prefix keys to stop: the general
            # per-sequence path (rare in a decode loop), for the whole batch
            return None
        heavy = ~rows.light_np[where]  # sequences with objects, which keep a copy
        grow_at = np.flatnonzero(grow)
        blocks: list = []
        if grow_at.size:
            blocks = self._grow(where, ids, grow_at, have[grow_at], new[grow_at])
        if heavy.any():
            rows.follow_step(ids, heavy, new, grow_at, blocks)
        rows.store_lengths(where, new)
        return new

    def _grow(
        self,
        where: np.ndarray,
        ids: np.ndarray,
        grow_at: np.ndarray,
        have: np.ndarray,
        new: np.ndarray,
    ) -> list:
        """One new block for each sequence ``grow_at`` indexes (``have`` blocks now,
        ``new`` tokens after the step, both for those sequences only), all or none;
        returns the blocks. The caller stores the lengths after."""
        pool, tables = self.pool, self._rows.tables
        longer = have + 1
        over = (longer > tables.max_seq_blocks) & (longer <= pool.num_blocks)
        if over.any():  # (a sequence longer than the pool is PoolExhausted below)
            i = int(np.argmax(over))
            tables.check_blocks(
                int(longer[i]), f"{format_cache_id(int(ids[grow_at[i]]))} at {int(new[i])} tokens"
            )
        if grow_at.size > pool.num_available:
            raise PoolExhausted(
                f"pool exhausted: the step needs {grow_at.size} blocks, "
                f"{pool.num_available} free or evictable (num_blocks={pool.num_blocks}); "
                "free handles or raise num_blocks"
            )
        blocks = pool.allocate_each(ids[grow_at].tolist())
        assert blocks is not None  # (counted above)
        self._rows.add_blocks(where[grow_at], have, blocks)
        return blocks

    def _extend_light(
        self, where: np.ndarray, ids: np.ndarray, count: int
    ) -> Optional[Tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """:meth:`extend_uniform` for a checked batch of plain sequences without
        objects: their blocks are theirs alone and they cover exactly their tokens, so
        the step is a length store, plus a block for each that crosses into a new one.
        Returns ``(lengths, grown, blocks)``: ``blocks[i]`` is the new block of sequence
        ``grown[i]`` (int64 arrays); None (nothing changed) when one would need two."""
        bs, rows = self.block_size, self._rows
        lens = rows.seq_np[where, NUM_TOKENS]
        new = lens + count
        if int(new.max()) > rows.max_seq_len:
            return None
        if count == 1:
            grow_at = np.flatnonzero(lens % bs == 0)
        else:
            have = (lens + bs - 1) // bs
            more = (new + bs - 1) // bs - have
            if int(more.max()) > 1:
                return None
            grow_at = np.flatnonzero(more)
        blocks = grow_at  # (empty)
        if grow_at.size:
            blocks = np.array(
                self._grow(where, ids, grow_at, (lens[grow_at] + bs - 1) // bs, new[grow_at]),
                dtype=np.int64,
            )
        rows.store_lengths(where, new)
        return new, grow_at, blocks

    def _keepable(
        self, conn_id: int, cache_ids: Union[Seq[int], np.ndarray]
    ) -> Optional[Tuple[np.ndarray, Optional[List[Optional[Sequence]]]]]:
        """``(slots, objects)`` when a batch can be kept, else None: distinct live
        sequences held by this connection, each plain, or with an object (``objects[i]``,
        None for a plain one) that this connection alone holds, that takes no more prefix
        keys, whose blocks just cover its tokens and whose partial last block it writes
        in place. Then a kept step needs no copy and knows which sequences open a block
        from their lengths alone."""
        rows = self._rows
        ids = np.asarray(cache_ids, dtype=np.int64)
        where = self._refs.checked_rows(conn_id, ids, ids & rows.slot_mask)
        if where is None:
            return None
        heavy = np.flatnonzero(~rows.light_np[where])
        if not heavy.shape[0]:
            return where, None
        at, bs = where[heavy], self.block_size
        lens = rows.seq_np[at, NUM_TOKENS]
        if rows.keys_open_np[at].any() or not np.array_equal(
            rows.num_blocks_np[at], (lens + bs - 1) // bs
        ):
            return None
        objects: List[Optional[Sequence]] = [None] * ids.shape[0]
        refs, owner, sequences = self._refs.conn_refs[conn_id], rows.owner_np, rows.sequences
        for i, cache_id in zip(heavy.tolist(), ids[heavy].tolist()):
            seq = sequences[cache_id]
            if (
                seq.num_refs != 1
                or refs.get(cache_id) != 1
                or (seq.num_tokens % bs and owner[seq.block_ids[-1]] != cache_id)
            ):
                return None
            objects[i] = seq
        return where, objects

    def keep_batch(self, conn_id: int, cache_ids: Seq[int]) -> int:
        """Keep a batch of sequences held by this connection for the facade's
        ``extend_kept``: its checks are made now and hold until one of them is released,
        forked, cloned, exported, opened, copied on write or given an object, or the
        connection changes their rows another way. Returns the batch's id, or 0 when it
        does not qualify (see :meth:`_keepable`; then step it with ``extend_batch``).
        A connection keeps its ``MAX_KEPT`` newest batches."""
        kept = self.kept.get(conn_id)
        if kept is None:
            return 0
        keep = self._keepable(conn_id, cache_ids)
        if keep is None:
            return 0
        if len(kept) >= MAX_KEPT:
            self._rows.count_kept(kept.pop(next(iter(kept))).where, -1)
        batch_id = self._next_kept
        self._next_kept += 1
        kept[batch_id] = _Kept(
            np.asarray(cache_ids, dtype=np.int64),
            keep[0],
            self._rows.kept_version,
            self.conn_steps[conn_id],
            keep[1],
        )
        self._rows.count_kept(keep[0], 1)
        return batch_id

    def kept_batch(self, conn_id: int, batch_id: int) -> Optional[_Kept]:
        """The kept batch ``batch_id`` of this connection, or None (never kept, dropped
        for a newer one, or another connection's)."""
        return self.kept.get(conn_id, {}).get(batch_id)

    def step(self, conn_id: int, kept: _Kept, count: int, seen: int) -> Optional[dict]:
        """A step of ``count`` tokens (checked by the facade) in every sequence of a kept
        batch, with no per-step checks while it stays checked; the facade's
        ``extend_kept`` answer. None (nothing changed; the step counted) when it is not
        checked any more or a sequence would need two blocks: the facade steps it by the
        general path, then calls :meth:`after_general`."""
        current = (
            kept.version == self._rows.kept_version and kept.conn_steps == self.conn_steps[conn_id]
        )
        self.conn_steps[conn_id] += 1
        done = self._step_kept(kept, count) if current else None
        kept.steps += 1
        if done is None:  # rechecked, and any error named, by the general path
            kept.version = -1
            return None
        kept.conn_steps = self.conn_steps[conn_id]
        grown, blocks = done
        out = {
            "steps": kept.steps,
            "same": seen == kept.steps - 1,
            "grown": grown,
            "blocks": blocks,
        }
        if not out["same"]:
            out["lens"] = self._rows.seq_flat[kept.lengths_at]
        return out

    def after_general(self, conn_id: int, kept: _Kept, lens: Union[np.ndarray, array[int]]) -> dict:
        """A kept batch the general path stepped (``lens``: its lengths after): checked
        again, and kept from here on if it still qualifies. Returns the answer."""
        keep = self._keepable(conn_id, kept.ids)
        if keep is not None:
            kept.reset(self._rows.kept_version, self.conn_steps[conn_id], keep[1])
        return {"steps": kept.steps, "same": False, "lens": lens}

    def _step_kept(self, kept: _Kept, count: int) -> Optional[Tuple[np.ndarray, np.ndarray]]:
        """:meth:`_extend_light` of a kept batch: for one token a step, which sequences
        open a block comes from their phase in a block (no work per step), and the step
        is one store that adds to every length; then the objects of the sequences that
        have one move along. Returns ``(grown, blocks)``, or None (nothing changed) when
        one would need two blocks."""
        rows = self._rows
        if count != 1:
            kept.phases = None
            done = self._extend_light(kept.where, kept.ids, count)
            if done is None:
                return None
            if kept.heavy is not None and kept.objects is not None:  # (both None, or neither)
                rows.follow_kept(kept.heavy, kept.objects, count, done[1], done[2])
            return done[1:]
        bs, seq_flat, at = self.block_size, rows.seq_flat, kept.lengths_at
        if kept.phases is None:  # sequences by their length's offset in a block
            lengths = seq_flat[at]
            phase = lengths % bs
            kept.phases = {p: np.flatnonzero(phase == p) for p in np.unique(phase).tolist()}
            kept.added = 0
            kept.longest = int(lengths.max())
        if kept.longest + kept.added + 1 > rows.max_seq_len:
            return None  # (the general path names the sequence)
        grown = kept.phases.get(-kept.added % bs, _NONE)
        kept.added += 1
        blocks = _NONE
        if grown.shape[0]:
            old = seq_flat[at[grown]]
            try:
                blocks = np.array(
                    self._grow(kept.where, kept.ids, grown, (old + bs - 1) // bs, old + 1),
                    dtype=np.int64,
                )
            except BaseException:
                kept.phases = None  # (nothing changed; the next step starts again)
                raise
        rows.step_lengths(at)  # the lengths, after any new entries (the tables' order)
        if kept.heavy is not None and kept.objects is not None:  # (both None, or neither)
            rows.follow_kept(kept.heavy, kept.objects, 1, grown, blocks)
        return grown, blocks
