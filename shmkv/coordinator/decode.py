"""The decode fast paths: a batch step with array operations, and kept batches.

Owns the step of many sequences by ``count`` tokens each with a fixed number of array
operations (plain sequences without objects, and ones with objects that only their
connection holds), the growth of those that open a block, and kept batches: a decode batch
checked once and then stepped with no per-step checks while nothing else changes its
sequences (the row version of ``shmkv.coordinator.rows``). Each fast path returns None,
having changed nothing, when the batch does not qualify: the facade
(``shmkv.coordinator.sequences``) then takes the general path
(``shmkv.coordinator.growth``), which names any error.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence as Seq, Tuple, Union

import numpy as np

from shmkv.coordinator.growth import Growth
from shmkv.coordinator.rows import Sequence, format_cache_id
from shmkv.errors import PoolExhausted
from shmkv.memory.tables import GENERATION, NUM_TOKENS, SEQ_FIELDS


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


class Decode(Growth):
    """The array fast paths of a batch step and kept batches (see the module doc)."""

    def _extend_uniform(
        self, conn_id: int, cache_ids: Seq[int], slots: Seq[int], count: int
    ) -> Optional[np.ndarray]:
        """The decode step (``count`` more tokens in every sequence, no token ids) with
        array operations over the whole batch: a constant number of them, whatever the
        batch size, plus Python work only for the sequences that need a new block, a
        copy of a shared last block, or to stop their prefix keys. None (nothing
        changed) when the batch does not check out: the general path then names the
        error."""
        ids = np.asarray(cache_ids, dtype=np.int64)
        where = self._checked_rows(conn_id, ids, np.asarray(slots, dtype=np.int64))
        if where is None:
            return None
        seq_np = self._seq_np
        if self._light_np[where].all():
            done = self._extend_light(where, ids, count)
            if done is not None:
                return done[0]
        bs = self.block_size
        lens = seq_np[where, NUM_TOKENS]
        have = self._num_blocks_np[where]
        new = lens + count
        if int(new.max()) > self.max_seq_len:
            return None  # the general path names the sequence
        full = (lens % bs) == 0
        last = self._table_np[where, np.maximum(have - 1, 0)]
        writable = full | (self._owner_np[last] == ids)  # the last block, if partial
        fits = new <= have * bs
        # One new block, and nothing else to do: the other common decode case.
        grow = ~fits & writable & (new <= (have + 1) * bs)
        if self._keys_open_np[where].any() or not ((fits & writable) | grow).all():
            # copies of shared blocks, several blocks, or prefix keys to stop: the general
            # per-sequence path (rare in a decode loop), for the whole batch
            return None
        sequences = self.sequences
        heavy = ~self._light_np[where]  # sequences with objects, which keep a copy
        grow_at = np.flatnonzero(grow)
        if grow_at.size:
            blocks = self._grow(where, ids, grow_at, have[grow_at], new[grow_at])
            for cache_id, block_id, keep in zip(
                ids[grow_at].tolist(), blocks, heavy[grow_at].tolist()
            ):
                if keep:
                    sequences[cache_id].block_ids.append(block_id)
        if heavy.any():
            for cache_id, n in zip(ids[heavy].tolist(), new[heavy].tolist()):
                sequences[cache_id].num_tokens = n
        seq_np[where, NUM_TOKENS] = new
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
        pool, tables = self.pool, self.tables
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
        grow_where = where[grow_at]
        # the shared-table order: entries, then generation, then (after) the length
        self._table_np[grow_where, have] = blocks
        self._seq_np[grow_where, GENERATION] += 1
        self._num_blocks_np[grow_where] += 1
        return blocks

    def _extend_light(
        self, where: np.ndarray, ids: np.ndarray, count: int
    ) -> Optional[Tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """:meth:`_extend_uniform` for a checked batch of plain sequences without
        objects: their blocks are theirs alone and they cover exactly their tokens, so
        the step is a length store, plus a block for each that crosses into a new one.
        Returns ``(lengths, grown, blocks)``: ``blocks[i]`` is the new block of sequence
        ``grown[i]`` (int64 arrays); None (nothing changed) when one would need two."""
        bs, seq_np = self.block_size, self._seq_np
        lens = seq_np[where, NUM_TOKENS]
        new = lens + count
        if int(new.max()) > self.max_seq_len:
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
        seq_np[where, NUM_TOKENS] = new
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
        ids = np.asarray(cache_ids, dtype=np.int64)
        where = self._checked_rows(conn_id, ids, ids & self._slot_mask)
        if where is None:
            return None
        heavy = np.flatnonzero(~self._light_np[where])
        if not heavy.shape[0]:
            return where, None
        rows, bs = where[heavy], self.block_size
        lens = self._seq_np[rows, NUM_TOKENS]
        if self._keys_open_np[rows].any() or not np.array_equal(
            self._num_blocks_np[rows], (lens + bs - 1) // bs
        ):
            return None
        objects: List[Optional[Sequence]] = [None] * ids.shape[0]
        refs, owner = self.conn_refs[conn_id], self._owner_np
        for i, cache_id in zip(heavy.tolist(), ids[heavy].tolist()):
            seq = self.sequences[cache_id]
            if (
                seq.num_refs != 1
                or refs.get(cache_id) != 1
                or (seq.num_tokens % bs and owner[seq.block_ids[-1]] != cache_id)
            ):
                return None
            objects[i] = seq
        return where, objects

    def _step_kept(self, kept: "_Kept", count: int) -> Optional[Tuple[np.ndarray, np.ndarray]]:
        """:meth:`_extend_light` of a kept batch: for one token a step, which sequences
        open a block comes from their phase in a block (no work per step), and the step
        is one store that adds to every length; then the objects of the sequences that
        have one move along. Returns ``(grown, blocks)``, or None (nothing changed) when
        one would need two blocks."""
        if count != 1:
            kept.phases = None
            done = self._extend_light(kept.where, kept.ids, count)
            if done is None:
                return None
            self._move_objects(kept, count, done[1], done[2])
            return done[1:]
        bs, seq_flat, at = self.block_size, self._seq_flat, kept.lengths_at
        if kept.phases is None:  # sequences by their length's offset in a block
            lengths = seq_flat[at]
            phase = lengths % bs
            kept.phases = {p: np.flatnonzero(phase == p) for p in np.unique(phase).tolist()}
            kept.added = 0
            kept.longest = int(lengths.max())
        if kept.longest + kept.added + 1 > self.max_seq_len:
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
        seq_flat[at] += 1  # the lengths, after any new entries (the tables' order)
        self._move_objects(kept, 1, grown, blocks)
        return grown, blocks

    @staticmethod
    def _move_objects(kept: "_Kept", count: int, grown: np.ndarray, blocks: np.ndarray) -> None:
        """A kept step's changes, made to the objects of its sequences that have one."""
        objects, heavy = kept.objects, kept.heavy
        if objects is None or heavy is None:  # (both None, or neither)
            return
        for seq in heavy:
            seq.num_tokens += count
        for i, block in zip(grown.tolist(), blocks.tolist()):
            seq = objects[i]
            if seq is not None:
                seq.block_ids.append(block)
