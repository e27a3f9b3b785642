"""Hand-offs: a reference that waits, with a deadline, for another process to open it.

Owns the hand-off tokens (version, id, a 128-bit secret), the reference each holds,
opening one (the reference moves to the opener's connection) and expiry (an unopened
token's reference is dropped at its deadline). Handles pickle through this path.
"""

from __future__ import annotations

import heapq
import hmac
import os
from typing import Optional

from shmkv.coordinator.refs import Refs
from shmkv.coordinator.rows import TOKEN_SIZE, TOKEN_VERSION
from shmkv.errors import HandoffError, InvalidArgument, LimitExceeded, WrongType


class _Handoff:
    __slots__ = ("secret", "cache_id", "deadline")

    def __init__(self, secret: bytes, cache_id: int, deadline: float):
        self.secret, self.cache_id, self.deadline = secret, cache_id, deadline


class Handoffs(Refs):
    """Hand-off tokens and their expiry (see the module doc)."""

    def export(self, conn_id: int, cache_id: int, ttl: float) -> bytes:
        """A one-shot token that gives its opener a reference, until ``ttl`` seconds pass.

        The token holds its own reference, so the sequence outlives its producer.
        It carries a 128-bit random secret: knowing the cache id is not enough.
        """
        seq = self._held(conn_id, cache_id)
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
        handoff_id = self._next_handoff_id
        self._next_handoff_id += 1
        secret = os.urandom(16)
        deadline = self.clock() + float(ttl)
        self.handoffs[handoff_id] = _Handoff(secret, seq.cache_id, deadline)
        heapq.heappush(self._handoff_heap, (deadline, handoff_id))
        seq.num_refs += 1
        self._touch(seq.slot)  # its opener may extend it too
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
        seq = self.sequences[handoff.cache_id]
        seq.num_refs -= 1  # the token's reference moves to the connection
        self._ref(conn_id, seq)
        self._touch(seq.slot)
        self.counters["opened_handoffs"] += 1
        return self._info(seq)

    def expire(self, now: Optional[float] = None) -> int:
        """Drop hand-offs past their deadline; returns how many expired."""
        now = self.clock() if now is None else now
        heap, expired = self._handoff_heap, 0
        while heap and heap[0][0] <= now:
            _deadline, handoff_id = heapq.heappop(heap)
            handoff = self.handoffs.pop(handoff_id, None)
            if handoff is not None:
                expired += 1
                self._unref(self.sequences[handoff.cache_id])
        self.counters["expired_handoffs"] += expired
        return expired

    def next_deadline(self) -> Optional[float]:
        """The earliest hand-off deadline, for the server loop's select timeout."""
        while self._handoff_heap and self._handoff_heap[0][1] not in self.handoffs:
            heapq.heappop(self._handoff_heap)
        return self._handoff_heap[0][0] if self._handoff_heap else None
