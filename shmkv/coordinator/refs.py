"""Connections and their references to sequences.

Owns which connection holds how many references to which sequence, the slots each
connection holds (for checks over a whole batch at once), dropping everything a
closed connection held, ``info``, ``clone`` and ``release``. A sequence lives while
a reference to it exists; the last one going frees its slot and drops its blocks
(tail first into the pool's LRU).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence as Seq

import numpy as np

from shmkv.coordinator.rows import Rows, Sequence, _same, format_cache_id
from shmkv.errors import InvalidArgument, UnknownCache, WrongType
from shmkv.memory.tables import CACHE_ID, run_index


class Refs(Rows):
    """References of connections to sequences (see the module doc)."""

    def add_connection(self, conn_id: int) -> None:
        self.conn_refs[conn_id] = {}
        self._conn_steps[conn_id] = 0
        self._kept[conn_id] = {}
        held = self._held_np[conn_id] = np.zeros(self.tables.layout.max_sequences, dtype=bool)
        self._held_mv[conn_id] = held.data

    def drop_connection(self, conn_id: int) -> int:
        """Drop every reference the connection holds; returns how many were dropped."""
        refs = self.conn_refs.pop(conn_id, {})
        self.client_counts.pop(conn_id, None)
        held = self._held_np.pop(conn_id, None)
        self._held_mv.pop(conn_id, None)
        self._conn_steps.pop(conn_id, None)
        for gone in self._kept.pop(conn_id, {}).values():
            self._kept_count[gone.where] -= 1
        dropped = 0
        if held is not None:
            light = np.flatnonzero(held & self._light_np)
            self._release_light(light, held)
            dropped = int(light.shape[0])
        for cache_id, count in refs.items():
            dropped += count
            self._unref(self.sequences[cache_id], count)
        return dropped

    def _held(self, conn_id: int, cache_id: object) -> Sequence:
        """The sequence, if this connection holds a reference to it."""
        if isinstance(cache_id, bool) or not isinstance(cache_id, int):
            raise WrongType(f"cache_id must be an int, got {type(cache_id).__name__}")
        refs = self.conn_refs.get(conn_id)
        if refs is not None:
            if cache_id in refs:
                return self.sequences[cache_id]
            slot = self._light_slot(cache_id)
            if slot >= 0 and self._held_mv[conn_id][slot]:
                return self._materialize(slot)
        raise UnknownCache(
            f"cache {format_cache_id(cache_id) if cache_id >= 0 else cache_id}"
            " is not held by this connection (closed, never opened, or"
            " another connection's)"
        )

    def _ref(self, conn_id: int, seq: Sequence) -> None:
        refs = self.conn_refs[conn_id]
        count = refs.get(seq.cache_id, 0)
        refs[seq.cache_id] = count + 1
        if not count:
            self._held_mv[conn_id][seq.slot] = True
        seq.num_refs += 1

    def _unref(self, seq: Sequence, count: int = 1) -> None:
        self._touch(seq.slot)
        seq.num_refs -= count
        if seq.num_refs == 0:
            del self.sequences[seq.cache_id]
            self.tables.release(seq.slot, len(seq.block_ids))
            self.pool.decref(reversed(seq.block_ids))  # tail first into the LRU

    def _light_slots(
        self, conn_id: int, cache_ids: Seq[int], any_holder: bool = False
    ) -> Optional[np.ndarray]:
        """The slots of ``cache_ids`` when they are distinct plain sequences without
        objects, each held by this connection (or by any, with ``any_holder``), checked
        with array operations; None otherwise (the caller's general path then checks
        them one by one and names any error)."""
        ids = np.asarray(cache_ids, dtype=np.int64)
        return self._checked_rows(conn_id, ids, ids & self._slot_mask, any_holder, light=True)

    def _checked_rows(
        self,
        conn_id: int,
        ids: np.ndarray,
        where: np.ndarray,
        any_holder: bool = False,
        light: bool = False,
    ) -> Optional[np.ndarray]:
        """``where`` when it names distinct rows of the shared tables holding the live
        sequences ``ids``, each held by this connection (or by any, with
        ``any_holder``), and with ``light`` each a plain sequence without an object;
        checked with a fixed number of array operations. None otherwise."""
        num = ids.shape[0]
        held = self._held_np.get(conn_id)
        if not num or held is None or where.shape[0] != num or int(ids.min()) <= 0:
            return None
        rows = run_index(where)
        if isinstance(rows, slice):  # one ascending run: distinct rows, bounds at its ends
            if rows.start < 0 or rows.stop > held.shape[0]:
                return None
        elif int(where.min()) < 0 or int(where.max()) >= held.shape[0]:
            return None
        if light and not self._light_np[rows].all():
            return None
        if not ((any_holder or held[rows].all()) and _same(self._seq_np[rows, CACHE_ID], ids)):
            return None
        if not isinstance(rows, slice):
            order = np.arange(num)
            self._scratch[where] = order  # a slot named twice keeps only its last position
            if not _same(self._scratch[where], order):
                return None
        return where

    def _batch_sequences(
        self, conn_id: int, cache_ids: Seq[int], any_live: bool = False
    ) -> List[Sequence]:
        """The sequences named by a batch, each held by this connection (or merely live,
        with ``any_live``)."""
        if len(set(cache_ids)) != len(cache_ids):
            raise InvalidArgument("the batch names a sequence twice")
        seqs = []
        for cache_id in cache_ids:
            try:
                seq = self._live_seq(cache_id) if any_live else self._held(conn_id, cache_id)
            except UnknownCache:
                seq = None
            if seq is None:
                raise UnknownCache(
                    f"cache {format_cache_id(cache_id)} of the batch is closed "
                    "(or not held by this connection)"
                )
            seqs.append(seq)
        return seqs

    def info(self, conn_id: int, cache_id: int) -> dict:
        """A held sequence's :meth:`_info`, with ``root``: the root key its prefix keys
        chain from (its salt's; None without a prompt), which a move carries."""
        seq = self._held(conn_id, cache_id)
        out = self._info(seq)
        out["root"] = seq.root
        return out

    def _info(self, seq: Sequence) -> dict:
        """A sequence's slot in the shared tables, table and length."""
        return seq.info()

    def clone(self, conn_id: int, cache_id: int) -> dict:
        """A new reference to the same sequence (no copy)."""
        seq = self._held(conn_id, cache_id)
        self._ref(conn_id, seq)
        self._touch(seq.slot)  # two references now: no kept batch steps it
        return self._info(seq)

    def release(self, conn_id: int, cache_id: int) -> None:
        """Drop one reference this connection holds."""
        self.release_many(conn_id, [cache_id])

    def release_many(self, conn_id: int, cache_ids: Seq[int]) -> None:
        """Drop one reference per listed id (an id may repeat); all or none."""
        refs = self.conn_refs.get(conn_id, {})
        light = len(cache_ids) > 8
        if not light:  # (a loop: cold, a generator expression cost the loop more)
            for cache_id in cache_ids:
                if type(cache_id) is int and self._light_slot(cache_id) >= 0:
                    light = True
                    break
        slot_ids = self._light_slots(conn_id, cache_ids) if light else None
        if slot_ids is not None:  # plain sequences without objects: array operations
            self._release_light(slot_ids, self._held_np[conn_id])
            return
        wanted: Dict[int, int] = {}
        for cache_id in cache_ids:
            self._held(conn_id, cache_id)
            wanted[cache_id] = wanted.get(cache_id, 0) + 1
        for cache_id, count in wanted.items():
            if refs[cache_id] < count:
                raise UnknownCache(
                    f"release of {count} references to "
                    f"{format_cache_id(cache_id)}, this connection holds "
                    f"{refs[cache_id]}"
                )
        held = self._held_mv[conn_id]
        for cache_id, count in wanted.items():
            refs[cache_id] -= count
            seq = self.sequences[cache_id]
            if not refs[cache_id]:
                del refs[cache_id]
                held[seq.slot] = False
            self._unref(seq, count)
