"""The coordinator's connections: every client socket the loop serves, and its state.

Owns what happens to a client's connection inside the coordinator's loop: accepting it
(the peer's uid, ``max_connections``, running out of descriptors), reading its frames
(oversized ones refused in step), the handshake's state (greeted, its rank), the
requests it sends while one of its requests waits for a tier promotion (held, bounded
by :data:`MAX_HELD_REQUESTS` and :data:`MAX_HELD_BYTES`, answered in order; with them
the ``settle`` and ``fork`` requests that wait for an early promotion), dispatching
each request to its handler (``Ops._op_NAME``, ``shmkv.coordinator.ops``) and timing
it, writing the answers back (the handshake's with the pool's descriptors), the
connection counters (accepted, refused, dropped, requests by op, errors, latency),
the promotions this turn's requests need (``to_promote``), and
dropping a connection with every reference it held.

Not the loop (which socket is ready, when to sleep, driving the tiers), nor the
listener's address and lifetime, nor the pool: those are
:class:`~shmkv.coordinator.server.Coordinator`'s, which calls :class:`Connections`
through its public methods. Not what a request does: that is the handlers'
(:class:`~shmkv.coordinator.ops.Ops`).
"""

from __future__ import annotations

import errno
import logging
import math
import os
import select
import selectors
import socket
import struct
import time
from bisect import bisect_left
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

from shmkv import protocol
from shmkv.coordinator.metrics import (
    LATENCY_BUCKETS,  # the request latency histogram's bucket bounds
)
from shmkv.coordinator.ops import SETTLE_LATER, Ops
from shmkv.coordinator.sequences import SequenceTable
from shmkv.errors import (
    AccessDenied,
    LimitExceeded,
    PoolExhausted,
    ProtocolError,
    ShmkvError,
)

if TYPE_CHECKING:
    from shmkv.tiers import TierSet

log = logging.getLogger("shmkv.coordinator.server")
_clock = time.perf_counter

_UCRED = struct.Struct("3i")
_RECV_SIZE = 1 << 18
_MAX_OUTBUF = 64 << 20
# Requests a connection may have waiting behind a promotion: at most this many, and
# this many bytes of frames (past the byte bound they are refused, in order).
MAX_HELD_REQUESTS = 1024
MAX_HELD_BYTES = 64 << 20


class _LevelSelector(selectors.DefaultSelector):
    """Where epoll is missing: the platform's selector, in its own order."""

    def rearm(self, fileobj, events: int) -> None:
        """Nothing to do: every registration stays armed."""


if hasattr(select, "EPOLLONESHOT"):

    class ArrivalSelector(selectors.EpollSelector):
        """The loop's selector: epoll, with every client connection (registered with
        data) one-shot, so ready connections are listed in the order their requests
        arrived. Level-triggered, epoll lists a socket it has just reported again ahead
        of every socket that became ready since: a client sending back to back was
        read again before a ping that had waited the whole turn. One-shot, a reported
        connection is left out until :meth:`rearm`, which the loop calls as it reads
        it: whatever arrives after that queues behind what arrived before. The
        listener and the wake socket (no data) stay level-triggered."""

        def _arm(self, key: selectors.SelectorKey, events: int) -> None:
            mask = select.EPOLLONESHOT
            if events & selectors.EVENT_READ:
                mask |= select.EPOLLIN
            if events & selectors.EVENT_WRITE:
                mask |= select.EPOLLOUT
            self._selector.modify(key.fd, mask)  # type: ignore[attr-defined]

        def register(self, fileobj, events, data=None):
            """Register as the platform's selector does; a connection (data given)
            one-shot."""
            key = super().register(fileobj, events, data)
            if data is not None:
                self._arm(key, events)
            return key

        def modify(self, fileobj, events, data=None):
            """Modify as the platform's selector does; a connection is watched again."""
            key = super().modify(fileobj, events, data)
            if key.data is not None:  # (re-armed: a reported socket may be modified)
                self._arm(key, events)
            return key

        def rearm(self, fileobj, events: int) -> None:
            """Watch a reported connection again (each report disarms it)."""
            self._arm(self.get_key(fileobj), events)

    def make_selector() -> selectors.BaseSelector:
        """The loop's selector (:class:`ArrivalSelector`)."""
        return ArrivalSelector()

else:  # pragma: no cover - epoll is Linux's

    def make_selector() -> selectors.BaseSelector:
        """The loop's selector: without epoll, the platform's."""
        return _LevelSelector()


def _shutdown_and_close(sock: socket.socket) -> None:
    """End the socket for every process holding a copy of it (forked children
    included), then close this process's descriptor."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # the peer is gone already, or a listener that never connected
        pass
    sock.close()


class _Conn:
    __slots__ = (
        "sock",
        "conn_id",
        "decoder",
        "outbuf",
        "pid",
        "greeted",
        "closing",
        "events",
        "tp_rank",
        "reason",
        "held",
        "held_bytes",
        "copying",
        "fds",
    )

    def __init__(self, sock: socket.socket, conn_id: int, pid: int, max_frame: int):
        self.sock = sock
        self.conn_id = conn_id
        self.decoder = protocol.FrameDecoder(max_frame)
        self.outbuf = bytearray()
        self.pid = pid
        self.greeted = False
        self.closing = False
        self.events = selectors.EVENT_READ  # what the selector watches for this socket
        self.tp_rank = None  # the rank this connection said it is, if any
        self.reason = ""  # why it is closing (for the drop's log line)
        # While a request waits for a tier promotion: the requests this connection sent
        # after it, with their frame sizes, answered in order after it.
        self.held: Optional[List[Tuple[object, int]]] = None
        self.held_bytes = 0  # the frame bytes of ``held``
        # Promotions this connection's client copies itself (``copy``), by id, until it
        # reports them (``promoted``); failed if it drops first.
        self.copying: Optional[Dict[int, Any]] = None
        # Descriptors an answer in ``outbuf`` carries that its first send could not
        # take (the client had not read its earlier answers): they go with the next.
        self.fds: Optional[List[int]] = None


class _Refused:
    """A request refused while it waited behind a promotion (over MAX_HELD_BYTES): its
    body is dropped at once, and its error is answered in order, after the promotion."""

    __slots__ = ("request_id", "error")

    def __init__(self, request_id: int, error: Exception):
        self.request_id, self.error = request_id, error


class Connections:
    """The client connections of a serving coordinator (see the module doc). The
    coordinator's loop calls :meth:`accept` when its listener is ready,
    :meth:`on_readable` and :meth:`flush` as its selector reports a connection,
    :meth:`take_to_promote` to start the promotions requests need, and
    :meth:`promotion_done` as the tiers finish them.

    Args:
        ops: the request handlers (``shmkv.coordinator.ops``).
        table: the sequence table (connections are added to it and dropped from it;
            the promotions a request planned are taken from it).
        listener: the coordinator's listening socket, accepted from (its address and
            lifetime are the coordinator's).
        max_connections: clients connected at once; more are refused.
        max_frame: the largest request frame in bytes.
    """

    def __init__(
        self,
        ops: Ops,
        table: SequenceTable,
        listener: socket.socket,
        max_connections: int,
        max_frame: int,
    ):
        self._ops = ops
        self._table = table
        self._listener = listener
        self.max_connections = max_connections
        self.max_frame = max_frame
        self.conns: Dict[int, _Conn] = {}  # conn id -> the connection, while it is open
        self._next_conn_id = 1
        self._next_promotion_id = 0  # (promotions copied by their clients)
        # While out of descriptors: when to listen again (0.0: listening, see accept)
        self.accept_paused_until = 0.0
        self._fd_warned_at = -math.inf
        self.num_ops = 0
        self.ops_by_type: Dict[str, int] = {}
        self.num_refused = 0
        self.num_dropped = 0
        self.num_accepted = 0
        self.num_errors = 0
        self.latency: Dict[str, list] = {}  # op -> [count per LATENCY_BUCKETS bucket..., sum]
        # promotions this turn's requests need (see take_to_promote): (records, whom to
        # answer when done: (connection, request id, answer), or the cache ids of an
        # early answer)
        self.to_promote: list = []
        # cache id -> the requests waiting for its early promotions: [(conn, request id, op)]
        self.settle_waiters: Dict[int, List[Tuple[_Conn, int, str]]] = {}

    def accept(self, selector) -> None:
        """Accept every connection waiting on the listener (or refuse it, with an error
        frame: another uid's, or past ``max_connections``); out of descriptors, stop
        listening for a moment (see :meth:`maybe_resume_accept`)."""
        listener = self._listener
        while True:
            try:
                sock, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE):
                    # Out of descriptors: stop listening for a moment instead of spinning
                    # on a listener that stays readable; connected clients are served.
                    selector.unregister(listener)
                    now = time.monotonic()
                    self.accept_paused_until = now + 0.1
                    if now - self._fd_warned_at > 10.0:  # once per 10 s, not per retry
                        self._fd_warned_at = now
                        log.warning(
                            "out of file descriptors (%s): new connections wait; "
                            "raise the limit (ulimit -n) or close clients",
                            os.strerror(exc.errno),
                        )
                    return
                raise
            pid, uid, _gid = _UCRED.unpack(
                sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
            )
            refusal: Optional[ShmkvError] = None
            if uid != os.getuid():
                refusal = AccessDenied(f"uid {uid} may not use a coordinator of uid {os.getuid()}")
                log.warning(
                    "refused pid %d: uid %d is not this coordinator's uid %d", pid, uid, os.getuid()
                )
            elif len(self.conns) >= self.max_connections:
                refusal = LimitExceeded(
                    f"{len(self.conns)} connections open, the limit is {self.max_connections}"
                )
                log.warning(
                    "refused pid %d: limit hit: %d connections open (max_connections=%d)",
                    pid,
                    len(self.conns),
                    self.max_connections,
                )
            if refusal is not None:
                self.num_refused += 1
                try:
                    sock.setblocking(False)
                    sock.send(protocol.encode_error(-1, refusal))
                except OSError:
                    pass
                sock.close()
                continue
            sock.setblocking(False)
            conn = _Conn(sock, self._next_conn_id, pid, self.max_frame)
            self._next_conn_id += 1
            self.conns[conn.conn_id] = conn
            self.num_accepted += 1
            self._table.add_connection(conn.conn_id)
            selector.register(sock, selectors.EVENT_READ, conn)
            log.info("connection %d from pid %d (%d open)", conn.conn_id, pid, len(self.conns))

    def maybe_resume_accept(self, selector) -> bool:
        """While accepting is paused (out of descriptors): listen again once the pause
        is over. True while it still lasts."""
        if time.monotonic() < self.accept_paused_until:
            return True
        self.accept_paused_until = 0.0
        selector.register(self._listener, selectors.EVENT_READ, None)
        return False

    def drop(
        self,
        conn: _Conn,
        selector=None,
        count: bool = True,
        reason: str = "closed by the client",
        level: int = logging.INFO,
    ) -> None:
        """Close ``conn`` (unregistered from ``selector`` when given) and release every
        reference it held; the promotions its client was copying fail. Counted as
        dropped unless ``count`` is False; logged at ``level`` with its ``reason`` (or
        the one it was closing for). Does nothing for a connection already dropped."""
        if self.conns.pop(conn.conn_id, None) is None:
            return
        if selector is not None:
            try:
                selector.unregister(conn.sock)
            except (KeyError, ValueError):
                pass
        # shutdown, not only close: a forked child's copy must not keep the client waiting
        _shutdown_and_close(conn.sock)
        tiers = self._ops.copy_tiers()
        for promo in (conn.copying or {}).values():  # its client never said: none is in
            assert tiers is not None  # (a promotion is left to a client only with them)
            tiers.finish_in_client(promo, None, [])
        conn.copying = None
        released = self._table.drop_connection(conn.conn_id)
        if count:
            self.num_dropped += 1
        log.log(
            level,
            "connection %d (pid %d) dropped: %s; %d references released",
            conn.conn_id,
            conn.pid,
            conn.reason or reason,
            released,
        )

    def drop_all(self) -> None:
        """Drop every connection, uncounted: the coordinator is stopping."""
        for conn in list(self.conns.values()):
            self.drop(conn, count=False, reason="the coordinator is stopping", level=logging.DEBUG)

    def forget_after_fork(self) -> None:
        """In a forked child: close this process's copies of the connections' sockets
        and forget them, their references untouched (they are the parent's)."""
        for conn in self.conns.values():
            conn.sock.close()
        self.conns = {}

    def on_readable(self, conn: _Conn, selector) -> None:
        """Read what ``conn`` sent (once: its selector report is re-armed here), serve
        or hold each request in it, and send what is answered."""
        try:
            data = conn.sock.recv(_RECV_SIZE)
        except (BlockingIOError, InterruptedError):
            selector.rearm(conn.sock, conn.events)
            return
        except OSError as exc:
            self.drop(conn, selector, reason=f"receive failed: {exc.strerror}")
            return
        # Watched again from here (ArrivalSelector): what it sends from now on queues
        # behind what the others sent before; bytes still unread queue at once.
        selector.rearm(conn.sock, conn.events)
        if not data:
            self.drop(conn, selector)
            return
        try:
            decoder = conn.decoder
            for obj in decoder.feed(data):
                if conn.held is not None:  # answered in order, after the promotion
                    if len(conn.held) >= MAX_HELD_REQUESTS:
                        raise ProtocolError(
                            f"over {MAX_HELD_REQUESTS} requests sent while one waits"
                        )
                    size = decoder.last_size
                    if (
                        conn.held_bytes + size > MAX_HELD_BYTES
                        and type(obj) is not protocol.OversizedFrame
                    ):
                        obj = _Refused(
                            protocol.request_id_of(obj),
                            LimitExceeded(
                                f"{conn.held_bytes + size} bytes of requests sent while one "
                                f"waits for a tier, the limit is {MAX_HELD_BYTES}; this one was "
                                "refused: wait for answers before sending more"
                            ),
                        )
                        size = 0
                    conn.held_bytes += size
                    conn.held.append((obj, size))
                    continue
                self._handle(conn, obj)
                if conn.closing:
                    break
        except ProtocolError as exc:  # the stream cannot be trusted any more
            conn.outbuf += protocol.encode_error(-1, exc)
            conn.closing = True
            conn.reason = f"protocol error: {exc}"
        self.flush(conn, selector)

    def flush(self, conn: _Conn, selector) -> None:
        """Send what ``conn`` has to send (what the socket takes now; the rest when it
        is writable); drop it when it was closing, or when its client reads too little."""
        if conn.conn_id not in self.conns:  # dropped while reading this round
            return
        try:
            while conn.outbuf:
                if conn.fds is not None:  # (with the first byte unsent: before the answer)
                    sent = socket.send_fds(conn.sock, [conn.outbuf], conn.fds)
                    conn.fds = None
                else:
                    sent = conn.sock.send(conn.outbuf)
                del conn.outbuf[:sent]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError as exc:
            self.drop(conn, selector, reason=f"send failed: {exc.strerror}")
            return
        if conn.closing:
            self.drop(conn, selector, level=logging.WARNING)  # an error frame was tried above
            return
        if len(conn.outbuf) > _MAX_OUTBUF:
            self.drop(
                conn,
                selector,
                level=logging.WARNING,
                reason=f"limit hit: over {_MAX_OUTBUF >> 20} MiB of answers unread",
            )
            return
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.outbuf else 0)
        if events != conn.events:  # a syscall per request otherwise
            selector.modify(conn.sock, events, conn)
            conn.events = events

    # -- requests ------------------------------------------------------------------------

    def _handle(self, conn: _Conn, obj) -> None:
        """Serve one decoded request of ``conn``: an error answer for one refused in
        step, else its handler's (``Ops._op_NAME``) answer, now, with descriptors, or
        later (held behind the promotions it started, or until an early one is in);
        counted and timed."""
        started = _clock()
        kind = type(obj)
        if kind is protocol.OversizedFrame or kind is _Refused:
            # refused, the stream still in step: an error answer, the connection stays
            self.num_errors += 1
            error = obj.error() if kind is protocol.OversizedFrame else obj.error
            log.warning(
                "connection %d (pid %d): request refused: %s", conn.conn_id, conn.pid, error
            )
            conn.outbuf += protocol.encode_error(obj.request_id, error)
            return
        request_id = protocol.request_id_of(obj)
        try:
            request = protocol.parse_request(obj)
            if not conn.greeted and request.op != "hello":
                raise ProtocolError("the first request must be hello")
            handler = getattr(self._ops, "_op_" + request.op)
            result = handler(conn, **request.args)
        except ProtocolError as exc:
            self.num_errors += 1
            conn.outbuf += protocol.encode_error(request_id, exc)
            conn.closing = True
            conn.reason = f"protocol error: {exc}"
            return
        except ShmkvError as exc:
            self.num_errors += 1
            if isinstance(exc, LimitExceeded):
                log.warning("limit hit (connection %d, pid %d): %s", conn.conn_id, conn.pid, exc)
            elif isinstance(exc, PoolExhausted):  # a normal outcome: the caller decides
                log.debug("connection %d: %s", conn.conn_id, exc)
            conn.outbuf += protocol.encode_error(request_id, exc)
            return
        except Exception as exc:  # a bug here must not take the coordinator down
            self.num_errors += 1
            log.exception("internal error while serving %r", obj)
            conn.outbuf += protocol.encode_error(
                request_id, ShmkvError(f"internal coordinator error: {type(exc).__name__}: {exc}")
            )
            return
        op = request.op
        self.num_ops += 1
        self.ops_by_type[op] = self.ops_by_type.get(op, 0) + 1
        if op == "hello":
            conn.greeted = True
            conn.tp_rank = request.args.get("tp_rank")  # (checked by the handler)
            self._send_with_fds(conn, request_id, result, self._ops.descriptors(op))
        elif op == "tier_memory":
            self._send_with_fds(conn, request_id, result, self._ops.descriptors(op))
        elif self._table.promotions:  # a tier copies blocks in
            # Started at the end of this turn, after the requests that came in meanwhile
            # (see take_to_promote). Answered when they are in, or now when asked
            # ``early``; or copied by the client, asked to ``copy``, which reports them
            # (``promoted``).
            records = self._table.take_promotions()
            tiers = self._ops.copy_tiers() if request.args.get("copy") else None
            if tiers is not None:
                copy = self._promote_in_client(tiers, conn, records, result)
                conn.outbuf += protocol.encode_ok(request_id, copy)
            elif request.args.get("early") and self._promote_early(records):
                conn.outbuf += protocol.encode_ok(request_id, result)
            else:
                self.to_promote.append((records, (conn, request_id, result)))
                conn.held = []
        elif result is SETTLE_LATER:  # answered by _settled, as the requests after it
            waiter = (conn, request_id, op)
            self.settle_waiters.setdefault(request.args["cache_id"], []).append(waiter)
            conn.held = []
        else:
            conn.outbuf += protocol.encode_ok(request_id, result)
        # The latency histogram: plain list adds, read by the metrics thread at scrape time.
        latency = self.latency.get(op)
        if latency is None:
            latency = self.latency[op] = [0] * (len(LATENCY_BUCKETS) + 1) + [0.0]
        elapsed = _clock() - started
        latency[bisect_left(LATENCY_BUCKETS, elapsed)] += 1
        latency[-1] += elapsed

    def _promote_in_client(self, tiers: "TierSet", conn: _Conn, records: list, result) -> dict:
        """Promotions the asking client copies itself: their sources are pinned now, the
        answer names the copies (``TierSet.client_copies``), and ``promoted`` finishes
        them with ``result``, the allocation's answer."""
        promo = tiers.promote(records, in_client=True)
        promo.context = result
        self._next_promotion_id += 1
        if conn.copying is None:
            conn.copying = {}
        conn.copying[self._next_promotion_id] = promo
        return {"copy": tiers.client_copies(promo, self._next_promotion_id)}

    def _promote_early(self, records: list) -> bool:
        """Promotions answered before their blocks are in (``Ops.promote_early``), to
        start at the end of the turn; ``settle`` or ``fork`` on their sequences waits
        until they are in (:meth:`_settled`). False (the request then waits as one not
        asked early) if the answer could not be made."""
        cache_ids = self._ops.promote_early(records)
        if cache_ids is None:
            return False
        self.to_promote.append((records, cache_ids))
        return True

    def take_to_promote(self) -> list:
        """The promotions this turn's requests need, taken: ``(records, context)``, the
        context to set on each promotion the loop starts (``TierSet.promote``), handed
        back to :meth:`promotion_done` when it is done."""
        to_promote, self.to_promote = self.to_promote, []
        return to_promote

    def promotion_done(self, context, selector) -> None:
        """A promotion the loop started (its ``context``, from :meth:`take_to_promote`)
        is done: answer the request that waited for it (gone meanwhile: nothing; its
        references were dropped already), then what its connection sent meanwhile; for
        one answered early, the requests that waited for its sequences."""
        if isinstance(context, list):  # answered early
            self._settled(context, selector)
            return
        asked, request_id, result = context
        conn = self.conns.get(asked.conn_id)
        if conn is None or conn is not asked:
            return
        conn.outbuf += protocol.encode_ok(request_id, result)
        self.answer_held(conn)
        self.flush(conn, selector)

    def _settled(self, cache_ids: List[int], selector) -> None:
        """An early promotion is done: answer the requests that waited for the sequences
        it was the last one copying into (``settle``: their hit now, shorter than the
        early answer said when a block did not arrive; ``fork``: the fork of the settled
        sequence), then what their connections sent meanwhile."""
        ops = self._ops
        for cache_id in cache_ids:
            if not ops.end_promotion(cache_id):
                continue
            for conn, request_id, op in self.settle_waiters.pop(cache_id, ()):
                if self.conns.get(conn.conn_id) is not conn:
                    continue  # gone meanwhile
                try:  # (still held: the connection's release waits behind the request)
                    answer = ops.answer_settled(conn, cache_id, op)
                    conn.outbuf += protocol.encode_ok(request_id, answer)
                except ShmkvError as exc:
                    conn.outbuf += protocol.encode_error(request_id, exc)
                self.answer_held(conn)
                self.flush(conn, selector)

    def answer_held(self, conn: _Conn) -> None:
        """Serve, in order, the requests ``conn`` sent while one waited for a tier. One
        that waits again holds the rest once more, their bytes counted again against
        MAX_HELD_BYTES (with what arrives meanwhile)."""
        held, conn.held = conn.held, None
        conn.held_bytes = 0
        for i, (obj, _) in enumerate(held or ()):
            if conn.held is not None or conn.closing:  # waits again (or closes)
                if not conn.closing:
                    conn.held += held[i:]
                    conn.held_bytes += sum(size for _, size in held[i:])
                break
            self._handle(conn, obj)

    def _send_with_fds(self, conn: _Conn, request_id: int, result: dict, fds: List[int]) -> None:
        """An answer that carries descriptors (SCM_RIGHTS): the handshake's (the pool's),
        ``tier_memory``'s (the host tier's). They travel with the first byte still
        unsent, so they arrive while the client reads up to this answer."""
        data = bytes(conn.outbuf) + protocol.encode_ok(request_id, result)
        conn.outbuf.clear()
        try:
            if conn.fds is not None:  # others wait to go (a client that reads later)
                conn.fds = conn.fds + fds
                sent = 0
            else:
                sent = socket.send_fds(conn.sock, [data], fds) if fds else 0
        except BlockingIOError:  # its earlier answers fill the socket: sent with the next
            sent = 0
            conn.fds = fds
        except OSError as exc:
            conn.closing = True
            conn.reason = f"descriptors could not be sent: {exc.strerror}"
            return
        conn.outbuf += data[sent:]
