"""Connections and their references to sequences.

Owns which connection holds how many references to which sequence (``Refs.conn_refs``,
and ``Sequence.num_refs``, which also counts the references hand-off tokens hold), the
slots each connection holds (for checks over a whole batch at once), dropping
everything a closed connection held, ``info``, ``clone`` and ``release``. A sequence
lives while a reference to it exists; the last one going has
:meth:`~shmkv.coordinator.rows.Rows.drop` free its slot and drop its blocks (tail first
into the pool's LRU).

Does not own the rows, slots or plain sequences (``shmkv.coordinator.rows``: this part
uses its :meth:`~shmkv.coordinator.rows.Rows.light_slot`,
:meth:`~shmkv.coordinator.rows.Rows.take_object`,
:meth:`~shmkv.coordinator.rows.Rows.release_light`,
:meth:`~shmkv.coordinator.rows.Rows.drop` and :meth:`~shmkv.coordinator.rows.Rows.touch`),
nor the tokens themselves (``shmkv.coordinator.handoffs``, which moves a token's
reference through :meth:`Refs.hold_for_token` and :meth:`Refs.take_token_ref`).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence as Seq

import numpy as np

from shmkv.coordinator.rows import Rows, Sequence, _same, format_cache_id
from shmkv.errors import InvalidArgument, UnknownCache, WrongType
from shmkv.memory.tables import CACHE_ID, run_index


class Refs:
    """References of connections to sequences (see the module doc).

    Args:
        rows: the rows part, whose sequences these references hold.
    """

    def __init__(self, rows: Rows):
        self._rows = rows
        # Per connection: its references to sequences with objects (a plain sequence
        # without one is held once, by the connection ``Rows.light_conn`` names), and
        # every slot it holds, as an array and a memoryview over it (one-slot stores).
        self.conn_refs: Dict[int, Dict[int, int]] = {}
        self.held_np: Dict[int, np.ndarray] = {}
        self._held_mv: Dict[int, memoryview] = {}
        self._scratch = np.zeros(rows.tables.layout.max_sequences, dtype=np.int64)

    def add_connection(self, conn_id: int) -> None:
        """A new connection, holding nothing yet."""
        self.conn_refs[conn_id] = {}
        held = self.held_np[conn_id] = np.zeros(self._rows.tables.layout.max_sequences, dtype=bool)
        self._held_mv[conn_id] = held.data

    def drop_connection(self, conn_id: int) -> int:
        """Drop every reference the connection holds; returns how many were dropped."""
        rows = self._rows
        refs = self.conn_refs.pop(conn_id, {})
        held = self.held_np.pop(conn_id, None)
        self._held_mv.pop(conn_id, None)
        dropped = 0
        if held is not None:
            light = np.flatnonzero(held & rows.light_np)
            held[rows.release_light(light)] = False
            dropped = int(light.shape[0])
        for cache_id, count in refs.items():
            dropped += count
            self.unref(rows.sequences[cache_id], count)
        return dropped

    def held(self, conn_id: int, cache_id: object) -> Sequence:
        """The sequence, if this connection holds a reference to it (a plain one gets
        its object now)."""
        if isinstance(cache_id, bool) or not isinstance(cache_id, int):
            raise WrongType(f"cache_id must be an int, got {type(cache_id).__name__}")
        refs = self.conn_refs.get(conn_id)
        if refs is not None:
            if cache_id in refs:
                return self._rows.sequences[cache_id]
            slot = self._rows.light_slot(cache_id)
            if slot >= 0 and self._held_mv[conn_id][slot]:
                return self._materialize(slot)
        raise UnknownCache(
            f"cache {format_cache_id(cache_id) if cache_id >= 0 else cache_id}"
            " is not held by this connection (closed, never opened, or"
            " another connection's)"
        )

    def _materialize(self, slot: int) -> Sequence:
        """The :class:`~shmkv.coordinator.rows.Sequence` of the plain sequence in
        ``slot``; its holder's reference moves to ``conn_refs``."""
        seq, conn_id = self._rows.take_object(slot)
        seq.num_refs = 1
        self.conn_refs[conn_id][seq.cache_id] = 1
        return seq

    def live_seq(self, cache_id: int) -> Optional[Sequence]:
        """The live sequence ``cache_id`` (made from its row if it has no object yet), or
        None."""
        seq = self._rows.sequences.get(cache_id)
        if seq is None:
            slot = self._rows.light_slot(cache_id)
            if slot >= 0:
                seq = self._materialize(slot)
        return seq

    def ref(self, conn_id: int, seq: Sequence) -> None:
        """One more reference of this connection to ``seq``."""
        refs = self.conn_refs[conn_id]
        count = refs.get(seq.cache_id, 0)
        refs[seq.cache_id] = count + 1
        if not count:
            self._held_mv[conn_id][seq.slot] = True
        seq.num_refs += 1

    def unref(self, seq: Sequence, count: int = 1) -> None:
        """``count`` references to ``seq`` fewer; the last one drops it."""
        self._rows.touch(seq.slot)
        seq.num_refs -= count
        if seq.num_refs == 0:
            self._rows.drop(seq)

    def hold_light(self, conn_id: int, slots: np.ndarray) -> None:
        """This connection holds the new plain sequences in ``slots``
        (:meth:`~shmkv.coordinator.rows.Rows.allocate_light`)."""
        self.held_np[conn_id][slots] = True

    def hold_for_token(self, seq: Sequence) -> None:
        """A hand-off token holds a reference to ``seq`` now; its opener may extend it."""
        seq.num_refs += 1
        self._rows.touch(seq.slot)

    def take_token_ref(self, conn_id: int, seq: Sequence) -> None:
        """A hand-off token's reference to ``seq`` moves to this connection."""
        seq.num_refs -= 1
        self.ref(conn_id, seq)
        self._rows.touch(seq.slot)

    def light_slots(
        self, conn_id: int, cache_ids: Seq[int], any_holder: bool = False
    ) -> Optional[np.ndarray]:
        """The slots of ``cache_ids`` when they are distinct plain sequences without
        objects, each held by this connection (or by any, with ``any_holder``), checked
        with array operations; None otherwise (the caller's general path then checks
        them one by one and names any error)."""
        ids = np.asarray(cache_ids, dtype=np.int64)
        return self.checked_rows(conn_id, ids, ids & self._rows.slot_mask, any_holder, light=True)

    def checked_rows(
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
        held = self.held_np.get(conn_id)
        if not num or held is None or where.shape[0] != num or int(ids.min()) <= 0:
            return None
        rows = run_index(where)
        if isinstance(rows, slice):  # one ascending run: distinct rows, bounds at its ends
            if rows.start < 0 or rows.stop > held.shape[0]:
                return None
        elif int(where.min()) < 0 or int(where.max()) >= held.shape[0]:
            return None
        if light and not self._rows.light_np[rows].all():
            return None
        if not ((any_holder or held[rows].all()) and _same(self._rows.seq_np[rows, CACHE_ID], ids)):
            return None
        if not isinstance(rows, slice):
            order = np.arange(num)
            self._scratch[where] = order  # a slot named twice keeps only its last position
            if not _same(self._scratch[where], order):
                return None
        return where

    def batch_sequences(
        self, conn_id: int, cache_ids: Seq[int], any_live: bool = False
    ) -> List[Sequence]:
        """The sequences named by a batch, each held by this connection (or merely live,
        with ``any_live``)."""
        if len(set(cache_ids)) != len(cache_ids):
            raise InvalidArgument("the batch names a sequence twice")
        seqs = []
        for cache_id in cache_ids:
            try:
                seq = self.live_seq(cache_id) if any_live else self.held(conn_id, cache_id)
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
        """A held sequence's :meth:`~shmkv.coordinator.rows.Sequence.info`, with
        ``root``: the root key its prefix keys chain from (its salt's; None without a
        prompt), which a move carries."""
        seq = self.held(conn_id, cache_id)
        out = seq.info()
        out["root"] = seq.root
        return out

    def clone(self, conn_id: int, cache_id: int) -> dict:
        """A new reference to the same sequence (no copy)."""
        seq = self.held(conn_id, cache_id)
        self.ref(conn_id, seq)
        self._rows.touch(seq.slot)  # two references now: no kept batch steps it
        return seq.info()

    def release_many(self, conn_id: int, cache_ids: Seq[int]) -> None:
        """Drop one reference per listed id (an id may repeat); all or none."""
        rows = self._rows
        refs = self.conn_refs.get(conn_id, {})
        light = len(cache_ids) > 8
        if not light:  # (a loop: cold, a generator expression cost the loop more)
            for cache_id in cache_ids:
                if type(cache_id) is int and rows.light_slot(cache_id) >= 0:
                    light = True
                    break
        slot_ids = self.light_slots(conn_id, cache_ids) if light else None
        if slot_ids is not None:  # plain sequences without objects: array operations
            self.held_np[conn_id][rows.release_light(slot_ids)] = False
            return
        wanted: Dict[int, int] = {}
        for cache_id in cache_ids:
            self.held(conn_id, cache_id)
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
            seq = rows.sequences[cache_id]
            if not refs[cache_id]:
                del refs[cache_id]
                held[seq.slot] = False
            self.unref(seq, count)

    def check_invariants(self, token_refs: Dict[int, int]) -> None:
        """Assert every sequence's reference count is the references that exist: its
        connections' and ``token_refs`` (the hand-off tokens', by cache id), and that each
        connection's held slots are what it holds (tests and stress)."""
        rows = self._rows
        seq_np, light_np, mask = rows.seq_np, rows.light_np, rows.slot_mask
        for slot in np.flatnonzero(light_np).tolist():
            holders = [conn for conn, held in self.held_np.items() if held[slot]]
            assert holders == [int(rows.light_conn[slot])]
            assert int(seq_np[slot, CACHE_ID]) not in self.conn_refs[holders[0]]
        refs = dict(token_refs)
        for conn in self.conn_refs.values():
            for cache_id, count in conn.items():
                refs[cache_id] = refs.get(cache_id, 0) + count
        light = seq_np[np.flatnonzero(light_np), CACHE_ID].tolist()
        refs.update(dict.fromkeys(light, 1))  # each held once, by its connection
        assert refs == rows.live()
        for conn_id, held in self.held_np.items():
            assert {int(seq_np[slot, CACHE_ID]) for slot in np.flatnonzero(held).tolist()} == set(
                self.conn_refs[conn_id]
            ) | {cache_id for cache_id in light if rows.light_conn[cache_id & mask] == conn_id}
