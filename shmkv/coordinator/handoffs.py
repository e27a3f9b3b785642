"""Hand-offs: a reference that waits, with a deadline, for another process to open it.

Owns the hand-off tokens (version, id, a 128-bit secret), their deadlines, opening one
(the reference moves to the opener's connection), expiry (an unopened token's
reference is dropped at its deadline, or, for a token exported ``bound``, when the
connection that exported it closes: its maker's process and its openers die together,
as an engine's scheduler and its workers do) and the counts of each. Handles pickle
through this path.

Does not own references: a token's reference is counted by ``shmkv.coordinator.refs``,
through its :meth:`~shmkv.coordinator.refs.Refs.held`,
:meth:`~shmkv.coordinator.refs.Refs.hold_for_token`,
:meth:`~shmkv.coordinator.refs.Refs.take_token_ref` and
:meth:`~shmkv.coordinator.refs.Refs.unref`.
"""

from __future__ import annotations

import heapq
import hmac
import os
from typing import Callable, Dict, List, Optional, Set, Tuple

from shmkv.coordinator.refs import Refs
from shmkv.coordinator.rows import TOKEN_SIZE, TOKEN_VERSION, Rows
from shmkv.errors import HandoffError, InvalidArgument, LimitExceeded, WrongType


class _Handoff:
    """One outstanding token: its secret, the sequence it names and its deadline."""

    __slots__ = ("secret", "cache_id", "deadline", "maker")

    def __init__(self, secret: bytes, cache_id: int, deadline: float, maker: Optional[int]):
        self.secret, self.cache_id, self.deadline = secret, cache_id, deadline
        self.maker = maker  # the exporting connection, for a bound token; else None


class Handoffs:
    """Hand-off tokens and their expiry (see the module doc).

    Args:
        rows: the rows part (the sequences a token names).
        refs: the references part (a token's reference is counted there).
        max_handoffs: outstanding hand-off tokens allowed at once.
        max_handoff_ttl: the longest ``ttl`` an export may ask for, in seconds.
        clock: monotonic clock (seconds).
    """

    def __init__(
        self,
        rows: Rows,
        refs: Refs,
        max_handoffs: int,
        max_handoff_ttl: float,
        clock: Callable[[], float],
    ):
        self._rows = rows
        self._refs = refs
        self.max_handoffs = max_handoffs
        self.max_handoff_ttl = max_handoff_ttl
        self.clock = clock
        self.handoffs: Dict[int, _Handoff] = {}
        self._heap: List[Tuple[float, int]] = []
        self._next_id = 1
        # bound tokens not opened yet, by the connection that exported them
        self._bound: Dict[int, Set[int]] = {}
        self.counters = {"exported_handoffs": 0, "opened_handoffs": 0, "expired_handoffs": 0}

    def export(self, conn_id: int, cache_id: int, ttl: float, bound: bool = False) -> bytes:
        """A one-shot token that gives its opener a reference, until ``ttl`` seconds pass.

        The token holds its own reference, so the sequence outlives its producer, unless
        ``bound``: then it also goes, unopened, when connection ``conn_id`` closes.
        It carries a 128-bit random secret: knowing the cache id is not enough.
        """
        seq = self._refs.held(conn_id, cache_id)
        if (
            isinstance(ttl, bool)
            or not isinstance(ttl, (int, float))
            or not (0 < ttl <= self.max_handoff_ttl)
        ):
            raise InvalidArgument(
                f"ttl must be in (0, {self.max_handoff_ttl}] seconds, got {ttl!r}"
            )
        self.expire()
        if len(self.handoffs) >= self.max_handoffs:
            raise LimitExceeded(
                f"{len(self.handoffs)} hand-offs outstanding, the limit is "
                f"{self.max_handoffs}; open or let some expire first"
            )
        handoff_id = self._next_id
        self._next_id += 1
        secret = os.urandom(16)
        deadline = self.clock() + float(ttl)
        self.handoffs[handoff_id] = _Handoff(
            secret, seq.cache_id, deadline, conn_id if bound else None
        )
        if bound:
            self._bound.setdefault(conn_id, set()).add(handoff_id)
        heapq.heappush(self._heap, (deadline, handoff_id))
        self._refs.hold_for_token(seq)
        self.counters["exported_handoffs"] += 1
        return bytes([TOKEN_VERSION]) + handoff_id.to_bytes(8, "big") + secret

    def open(self, conn_id: int, token: bytes) -> dict:
        """Turn a hand-off token into a reference held by this connection."""
        if not isinstance(token, bytes):
            raise WrongType("hand-off token must be bytes")
        if len(token) != TOKEN_SIZE or token[0] != TOKEN_VERSION:
            raise HandoffError("malformed hand-off token")
        self.expire()
        handoff_id = int.from_bytes(token[1:9], "big")
        handoff = self.handoffs.get(handoff_id)
        if handoff is None or not hmac.compare_digest(handoff.secret, token[9:]):
            raise HandoffError("unknown hand-off token: forged, already opened, or expired")
        del self.handoffs[handoff_id]
        self._unbind(handoff_id, handoff)
        seq = self._rows.sequences[handoff.cache_id]
        self._refs.take_token_ref(conn_id, seq)
        self.counters["opened_handoffs"] += 1
        return seq.info()

    def expire(self, now: Optional[float] = None) -> int:
        """Drop hand-offs past their deadline; returns how many expired."""
        now = self.clock() if now is None else now
        heap, expired = self._heap, 0
        while heap and heap[0][0] <= now:
            _deadline, handoff_id = heapq.heappop(heap)
            handoff = self.handoffs.pop(handoff_id, None)
            if handoff is not None:
                expired += 1
                self._unbind(handoff_id, handoff)
                self._refs.unref(self._rows.sequences[handoff.cache_id])
        self.counters["expired_handoffs"] += expired
        return expired

    def drop_connection(self, conn_id: int) -> int:
        """Connection ``conn_id`` closed: the bound tokens it exported and nobody opened
        go now (counted as expired); returns how many."""
        ids = self._bound.pop(conn_id, ())
        for handoff_id in ids:
            handoff = self.handoffs.pop(handoff_id)
            self._refs.unref(self._rows.sequences[handoff.cache_id])
        self.counters["expired_handoffs"] += len(ids)
        return len(ids)

    def _unbind(self, handoff_id: int, handoff: _Handoff) -> None:
        """``handoff`` (opened or expired) no longer goes with its maker's connection."""
        if handoff.maker is not None:
            ids = self._bound[handoff.maker]
            ids.discard(handoff_id)
            if not ids:
                del self._bound[handoff.maker]

    def token_refs(self) -> Dict[int, int]:
        """How many references outstanding tokens hold, by cache id (the invariants)."""
        refs: Dict[int, int] = {}
        for handoff in self.handoffs.values():
            refs[handoff.cache_id] = refs.get(handoff.cache_id, 0) + 1
        return refs

    def next_deadline(self) -> Optional[float]:
        """The earliest hand-off deadline, for the server loop's select timeout."""
        while self._heap and self._heap[0][1] not in self.handoffs:
            heapq.heappop(self._heap)
        return self._heap[0][0] if self._heap else None
