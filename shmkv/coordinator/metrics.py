"""Prometheus metrics of a coordinator, served over HTTP from one thread of its own.

Owns the ``/metrics`` endpoint (the Prometheus text format, version 0.0.4), the names
of every series (all ``shmkv_*``, listed in ``docs/operations.md``) and the bounds of
that endpoint. Counters are not kept here: at each scrape :func:`render` reads the
coordinator's plain ints, its per-op latency buckets and the sequence table's
counters (single reads of ints and lists, safe under the GIL), so the coordinator's
loop does no metrics work beyond adding to a few lists (see ``Connections._handle``)
and never waits on a scrape. Does not change any state of the coordinator.

The endpoint is a surface other local processes (or machines) reach, so it is
bounded: one thread serves every connection from a selector (no thread per
connection), at most ``max_connections`` are open (a new one closes the oldest), each
gets ``timeout`` seconds for its whole exchange, a request head is at most 8 KiB, and
every error is logged to the ``shmkv.coordinator.metrics`` logger, never printed. A scrape holds
the GIL only to format what changed since the last one (:func:`render` writes the
text itself and keeps each op's histogram text; about 0.1 ms), and renders are at
least ``MIN_RENDER_INTERVAL_S`` apart (requests arriving sooner wait, without the GIL,
and share the next render, which still comes after them), so no scraper can take more
than a sliver of the coordinator's GIL (``shmkv bench --only metrics``). Binding
anything but a loopback address is logged as a warning.

Started by ``Coordinator(..., metrics_port=N)`` (``shmkv serve --metrics-port N``) and
stopped with it. :class:`CoordinatorCollector` gives the same series to a
``prometheus_client`` registry of the application's own.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import selectors
import socket
import threading
import time
from typing import Iterator, List, Optional, Sequence, Tuple

from prometheus_client.utils import floatToGoString

from shmkv.errors import InvalidArgument, ShmkvError

log = logging.getLogger("shmkv.coordinator.metrics")
# Upper bounds (seconds) of the request latency histogram's buckets; one more bucket
# holds everything slower. Each op type of a coordinator keeps ``[count per bucket...,
# sum]`` as a plain list: observing a request is a clock read, a bisect and two adds
# (see ``Connections._handle``). Here, not in the coordinator, so that the coordinator
# imports this module and never the other way round.
LATENCY_BUCKETS = (
    25e-6,
    50e-6,
    100e-6,
    250e-6,
    500e-6,
    1e-3,
    2.5e-3,
    5e-3,
    10e-3,
    25e-3,
    50e-3,
    100e-3,
    250e-3,
    1.0,
)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
DEFAULT_MAX_CONNECTIONS = 16
DEFAULT_TIMEOUT = 5.0  # seconds for one connection's whole exchange
_MAX_HEAD = 8192  # bytes of a request line and headers
_WARN_EVERY_S = 10.0
# The least time between two renders of /metrics. Requests that arrive sooner wait (in
# the selector, without the GIL) and share the next render, so no scraper, however
# fast, can take more than a sliver of the coordinator's GIL; each answer is still
# rendered after its request arrived, never older.
MIN_RENDER_INTERVAL_S = 0.05


# -- the series ------------------------------------------------------------------------------

Labels = Tuple[Tuple[str, str], ...]
Sample = Tuple[str, Labels, float]  # (sample name, labels, value)
Family = Tuple[str, str, str, Optional[List[Sample]]]  # (name, type, help, samples)

_LATENCY_DOC = "Time the coordinator's loop spent on a request (decode, handle, encode), by op"


def _latency_samples(op: str, values: Sequence[float]) -> List[Sample]:
    """One op's histogram samples from its ``[count per bucket..., sum]`` list."""
    out: List[Sample] = []
    total = 0.0
    for bound, num in zip(LATENCY_BUCKETS, values):
        total += num
        out.append(
            (
                "shmkv_request_duration_seconds_bucket",
                (("op", op), ("le", floatToGoString(bound))),
                total,
            )
        )
    total += values[len(LATENCY_BUCKETS)]
    out.append(("shmkv_request_duration_seconds_bucket", (("op", op), ("le", "+Inf")), total))
    out.append(("shmkv_request_duration_seconds_count", (("op", op),), total))
    out.append(("shmkv_request_duration_seconds_sum", (("op", op),), values[-1]))
    return out


def families(coord, latency: bool = True) -> List[Family]:
    """Every series of one coordinator now: ``[(name, type, help, samples)]`` with
    ``samples`` as ``[(sample name, ((label, value), ...), number)]``. Counter families
    are named without ``_total``; their samples carry it. Without ``latency``, the
    histogram's samples are None (for :func:`render`)."""
    table = coord.table
    if table is None:
        return []
    cfg = coord.config
    counters = dict(table.counters)  # one C-level copy: consistent within itself
    out: List[Family] = []

    def gauge(name, doc, value):
        out.append((name, "gauge", doc, [(name, (), value)]))

    def counter(name, doc, value):
        out.append((name, "counter", doc, [(name + "_total", (), value)]))

    samples: List[Sample] = [
        ("shmkv_blocks", (("tier", tier), ("state", state)), num)
        for tier, states in coord.block_counts().items()
        for state, num in states.items()
    ]
    out.append(
        (
            "shmkv_blocks",
            "gauge",
            "Blocks by tier and state: free (no data), cached (unreferenced, kept for "
            "prefix hits, evictable), referenced (held by a sequence)",
            samples,
        )
    )
    gauge("shmkv_pool_blocks", "Blocks in the pool", cfg.num_blocks)
    gauge("shmkv_pool_bytes", "Bytes of K/V memory in the pool", cfg.nbytes)
    gauge("shmkv_block_bytes", "Bytes of one block (all layers, K and V)", cfg.block_nbytes)
    memory = coord.pool_memory_stats()
    gauge(
        "shmkv_pool_populated_bytes",
        "Bytes of the pool faulted in by its background populate so far",
        memory["populate"]["bytes"],
    )
    gauge("shmkv_pool_hugepages", "1 when the pool is made of huge pages", int(memory["hugepages"]))
    gauge("shmkv_sequences", "Live sequences", table.num_sequences)
    gauge(
        "shmkv_prefix_index_blocks",
        "Blocks published in the prefix index",
        len(table.pool.prefix_index),
    )
    for name, key, doc in (
        (
            "shmkv_prefix_hit_tokens",
            "prefix_hit_tokens",
            "Prompt tokens found in the prefix cache at allocation",
        ),
        (
            "shmkv_prefix_miss_tokens",
            "prefix_miss_tokens",
            "Prompt tokens not found in the prefix cache at allocation",
        ),
        (
            "shmkv_prefix_hit_blocks",
            "prefix_hit_blocks",
            "Full prompt blocks found in the prefix cache",
        ),
        (
            "shmkv_prefix_miss_blocks",
            "prefix_miss_blocks",
            "Full prompt blocks not found in the prefix cache",
        ),
        ("shmkv_cow_copies", "cow_copies", "Blocks copied on write"),
        (
            "shmkv_published_blocks",
            "published_blocks",
            "Blocks published for prefix reuse (committed by every rank)",
        ),
        (
            "shmkv_deferred_allocations",
            "deferred_allocations",
            "Allocations with defer not made: another client was computing their prompt",
        ),
    ):
        counter(name, doc, counters.get(key, 0))
    by_client = sorted((name, tuple(counts)) for name, counts in list(coord.client_counts.items()))
    for name, index, doc in (
        (
            "shmkv_client_prefix_hit_tokens",
            0,
            "Prompt tokens found in the prefix cache at allocation, by client name (as "
            "the client said at connect; unnamed, or other past 64 names)",
        ),
        (
            "shmkv_client_prefix_miss_tokens",
            1,
            "Prompt tokens not found in the prefix cache at allocation, by client name",
        ),
    ):
        out.append(
            (
                name,
                "counter",
                doc,
                [
                    (name + "_total", (("client", client),), counts[index])
                    for client, counts in by_client
                ],
            )
        )
    counter("shmkv_evictions", "Cached blocks evicted to make room", table.pool.num_evictions)
    counter(
        "shmkv_copies_discarded",
        "Copies of blocks into or out of the pool (tiers, the "
        "store) dropped because the block no longer held their key once copied",
        table.pool.num_copies_discarded,
    )
    if coord.tiers is not None:
        tier_io = coord.tiers.io_stats()
        counter(
            "shmkv_tier_lost_evictions",
            "Blocks the pool evicted that no tier held or "
            "could take (their copy down a tier was not done, and no room to rescue it)",
            tier_io.get("lost_evictions", 0),
        )
        counter(
            "shmkv_tier_rescued_evictions",
            "Blocks the pool evicted before their copy "
            "down a tier was done, copied by the coordinator's loop at eviction",
            tier_io.get("rescued_evictions", 0),
        )
    out.append(
        (
            "shmkv_handoffs",
            "counter",
            "Hand-off tokens by event",
            [
                ("shmkv_handoffs_total", (("event", event),), counters.get(f"{event}_handoffs", 0))
                for event in ("exported", "opened", "expired")
            ],
        )
    )
    gauge(
        "shmkv_handoffs_outstanding",
        "Hand-off tokens exported and not yet opened or expired",
        len(table.handoffs),
    )
    gauge("shmkv_connections_open", "Client connections open now", len(coord._conns))
    out.append(
        (
            "shmkv_connections",
            "counter",
            "Client connections by event: accepted, refused (another user, or "
            "max_connections reached), closed (cleanly or not)",
            [
                ("shmkv_connections_total", (("event", "accepted"),), coord.num_accepted),
                ("shmkv_connections_total", (("event", "refused"),), coord.num_refused),
                ("shmkv_connections_total", (("event", "closed"),), coord.num_dropped),
            ],
        )
    )
    out.append(
        (
            "shmkv_ops",
            "counter",
            "Requests served, by op",
            [
                ("shmkv_ops_total", (("op", op),), num)
                for op, num in sorted(dict(coord.ops_by_type).items())
            ],
        )
    )
    counter("shmkv_request_errors", "Requests answered with an error (any code)", coord.num_errors)

    if latency:
        out.append(
            (
                "shmkv_request_duration_seconds",
                "histogram",
                _LATENCY_DOC,
                [
                    sample
                    for op, values in sorted(dict(coord.latency).items())
                    for sample in _latency_samples(op, list(values))
                ],
            )
        )
    else:  # render() formats it per op, reusing the text of ops that did not move
        out.append(("shmkv_request_duration_seconds", "histogram", _LATENCY_DOC, None))
    uptime = time.monotonic() - coord._started_at if coord._started_at else 0.0
    gauge("shmkv_uptime_seconds", "Seconds since the coordinator opened", uptime)
    return out


def _label(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value) -> str:
    """A sample value as Prometheus' Go client writes it (``1.0``, ``1e+09``, ``+Inf``),
    the spelling ``prometheus_client`` gives too."""
    if type(value) is int and -(10**15) < value < 10**6:  # most samples: no call needed
        return f"{value}.0"
    return floatToGoString(value)


def _lines(lines: list, samples) -> None:
    for sample, labels, value in samples:
        if labels:
            inner = ",".join(f'{k}="{_label(v)}"' for k, v in labels)
            lines.append(f"{sample}{{{inner}}} {_number(value)}")
        else:
            lines.append(f"{sample} {_number(value)}")


def render(coord, cache: Optional[dict] = None) -> bytes:
    """The ``/metrics`` body of one coordinator now (Prometheus text format 0.0.4).

    ``cache`` (a dict kept by the caller between scrapes) keeps each op's histogram
    text with the counts it was made from, so a scrape formats only the ops that
    served requests since the last one: most of the body, and of the GIL it holds.
    """
    cache = {} if cache is None else cache
    lines = []
    for name, kind, doc, samples in families(coord, latency=False):
        shown = name + "_total" if kind == "counter" else name
        lines.append(f"# HELP {shown} {doc}")
        lines.append(f"# TYPE {shown} {kind}")
        if samples is not None:
            _lines(lines, samples)
            continue
        for op, values in sorted(dict(coord.latency).items()):
            values = tuple(values)  # a copy: the loop keeps adding to the original
            kept = cache.get(op)
            if kept is None or kept[0] != values:
                chunk: List[str] = []
                _lines(chunk, _latency_samples(op, values))
                kept = cache[op] = (values, "\n".join(chunk))
            lines.append(kept[1])
    lines.append("")
    return "\n".join(lines).encode()


class CoordinatorCollector:
    """A ``prometheus_client`` collector of one coordinator's series (the same as
    ``/metrics``), for an application that exports through a registry of its own.

    Args:
        coordinator: a :class:`~shmkv.coordinator.server.Coordinator` (opened).
    """

    def __init__(self, coordinator):
        self._coord = coordinator

    def describe(self) -> list:
        return []  # registering must not call collect() before the coordinator serves

    def collect(self) -> Iterator:
        from prometheus_client.core import Metric

        for name, kind, doc, samples in families(self._coord):
            metric = Metric(name, doc, kind)
            for sample, labels, value in samples or ():  # (all given, with latency)
                metric.add_sample(sample, dict(labels), value)
            yield metric


# -- the server ------------------------------------------------------------------------------


class _Http:
    __slots__ = ("sock", "peer", "deadline", "head", "out", "sent", "head_only")

    def __init__(self, sock, peer, deadline):
        self.sock, self.peer, self.deadline = sock, peer, deadline
        self.head = bytearray()
        self.out: Optional[bytes] = None  # b"": waiting for the next render
        self.sent = 0
        self.head_only = False


def _response(status: str, kind: str, body: bytes, head_only: bool = False) -> bytes:
    head = (
        f"HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    ).encode("ascii")
    return head if head_only else head + body


def _bind_address(host: str, port: int) -> Tuple[int, tuple, bool]:
    """``(family, sockaddr, loopback)`` to bind ``host`` ("" is every IPv4 interface)."""
    if host is None or not isinstance(host, str):
        raise InvalidArgument(f"metrics_host must be a string, got {host!r}")
    name = host or "0.0.0.0"
    try:
        infos = socket.getaddrinfo(
            name, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE | socket.AI_NUMERICSERV
        )
    except (socket.gaierror, UnicodeError) as exc:
        raise ShmkvError(
            f"metrics server cannot listen on {host!r}:{port}: the host does not resolve ({exc})"
        ) from None
    family, _type, _proto, _name, sockaddr = infos[0]
    try:
        loopback = ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0]).is_loopback
    except ValueError:
        loopback = False
    return family, sockaddr, loopback


class MetricsServer:
    """``/metrics`` of one coordinator, served from one daemon thread.

    Args:
        coordinator: the coordinator to report.
        port: TCP port (0: any free port; see :attr:`address`).
        host: address to bind; loopback by default (metrics are not secret, but a
            scrape costs CPU, so exposing them is the operator's choice). Any other
            address (``""`` and ``"0.0.0.0"``: every interface) is logged as a warning.
        max_connections: connections open at once; a new one beyond closes the oldest
            (so idle connections cannot lock scrapers out).
        timeout: seconds a connection has to send its request and take the answer.

    Raises:
        ShmkvError: the port cannot be bound (in use, or not allowed) or the host does
            not resolve.
        InvalidArgument: a bad host, limit or timeout.
    """

    def __init__(
        self,
        coordinator,
        port: int,
        host: str = "127.0.0.1",
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        timeout: float = DEFAULT_TIMEOUT,
    ):
        if (
            isinstance(max_connections, bool)
            or not isinstance(max_connections, int)
            or max_connections < 1
        ):
            raise InvalidArgument(f"max_connections must be an int >= 1, got {max_connections!r}")
        if not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
            raise InvalidArgument(f"timeout must be a number of seconds > 0, got {timeout!r}")
        self._coord = coordinator
        self.max_connections = max_connections
        self.timeout = float(timeout)
        self.num_served = 0  # responses sent
        self.num_closed = 0  # connections closed before an answer (timeout, error, limit)
        self._stopping = False
        self._listener: Optional[socket.socket] = None
        self._wake_r: Optional[socket.socket] = None
        self._wake_w: Optional[socket.socket] = None
        self._conns: dict = {}  # socket -> _Http, oldest first
        self._cache: dict = {}  # op -> (its latency counts, their text): see render()
        self._waiting: list = []  # connections whose /metrics waits for the next render
        self._rendered_at = -MIN_RENDER_INTERVAL_S
        self._warned_at = -_WARN_EVERY_S
        family, sockaddr, loopback = _bind_address(host, port)
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(sockaddr)
            listener.listen(64)
            listener.setblocking(False)
        except OSError as exc:
            listener.close()
            raise ShmkvError(
                f"metrics server cannot listen on {host}:{port} "
                f"({exc.strerror or exc}); choose another metrics port, or 0 "
                "for any free one"
            ) from None
        self._listener = listener
        self.address: Tuple[str, int] = tuple(listener.getsockname()[:2])
        if not loopback:
            log.warning(
                "metrics endpoint binds %s (%s): reachable from other machines; pass "
                "metrics_host='127.0.0.1' to keep it local",
                self.url,
                "every interface" if sockaddr[0] in ("0.0.0.0", "::") else "not a loopback address",
            )
        self._wake_r, self._wake_w = wake, _ = socket.socketpair()
        wake.setblocking(False)
        self._thread = threading.Thread(
            target=self._serve, args=(listener, wake), name="shmkv-metrics", daemon=True
        )
        self._thread.start()

    @property
    def url(self) -> str:
        """The ``/metrics`` URL."""
        host, port = self.address
        return f"http://{f'[{host}]' if ':' in host else host}:{port}/metrics"

    # -- serving (the server's thread) ---------------------------------------------------

    def _serve(self, listener: socket.socket, wake: socket.socket) -> None:
        selector = selectors.DefaultSelector()
        try:
            selector.register(listener, selectors.EVENT_READ, None)
            selector.register(wake, selectors.EVENT_READ, "wake")
            paused_until = 0.0
            while not self._stopping:
                now = time.monotonic()
                if paused_until and now >= paused_until:
                    selector.register(listener, selectors.EVENT_READ, None)
                    paused_until = 0.0
                wait = 1.0
                if self._waiting:
                    wait = self._maybe_render(selector, now)
                if self._conns:
                    wait = max(0.0, min(wait, next(iter(self._conns.values())).deadline - now))
                if paused_until:
                    wait = min(wait, max(0.0, paused_until - now))
                for key, events in selector.select(wait):
                    if key.data == "wake":
                        continue
                    if key.data is None:
                        if self._accept(listener, selector):
                            selector.unregister(listener)
                            paused_until = time.monotonic() + 0.1
                        continue
                    if key.data.sock in self._conns:  # (not closed earlier this turn)
                        try:
                            self._on_event(key.data, events, selector)
                        except Exception:  # a bug: this connection goes, the server stays
                            log.exception("metrics connection from %s failed", key.data.peer)
                            self._close(key.data, selector)
                if self._waiting:
                    self._maybe_render(selector, time.monotonic())
                self._expire(selector, time.monotonic())
        except Exception:  # a bug here must not pass silently, nor print
            log.exception("metrics server stopped by an error")
        finally:
            for conn in list(self._conns.values()):
                self._close(conn, selector)
            selector.close()

    def _accept(self, listener: socket.socket, selector) -> bool:
        """Accept what is waiting; True when out of descriptors (pause accepting)."""
        while True:
            try:
                sock, peer = listener.accept()
            except (BlockingIOError, InterruptedError):
                return False
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    self._warn("out of descriptors (%s): new connections wait", exc.strerror)
                    return True
                log.debug("metrics accept failed: %s", exc)  # ECONNABORTED and the like
                continue
            if len(self._conns) >= self.max_connections:
                oldest = next(iter(self._conns.values()))
                self._warn(
                    "%d connections open (the limit): closed the oldest, from %s",
                    len(self._conns),
                    oldest.peer,
                )
                self._close(oldest, selector)
                self.num_closed += 1
            sock.setblocking(False)
            conn = _Http(sock, peer, time.monotonic() + self.timeout)
            self._conns[sock] = conn
            selector.register(sock, selectors.EVENT_READ, conn)

    def _on_event(self, conn: _Http, events: int, selector) -> None:
        try:
            if conn.out is None:
                data = conn.sock.recv(4096)
                if not data:  # gone before asking
                    self._close(conn, selector)
                    return
                conn.head += data
                end = conn.head.find(b"\r\n\r\n")
                if end < 0:
                    end = conn.head.find(b"\n\n")
                if end < 0:
                    if len(conn.head) > _MAX_HEAD:
                        self._answer(
                            conn,
                            _response(
                                "431 Request Header Fields Too Large",
                                "text/plain",
                                b"request too large\n",
                            ),
                            selector,
                        )
                    return
                response = self._respond(conn, bytes(conn.head[:end]))
                if response is None:  # /metrics: answered by the next render
                    conn.out = b""
                    selector.unregister(conn.sock)
                    self._waiting.append(conn)
                else:
                    self._answer(conn, response, selector)
            else:
                self._send(conn, selector)
        except OSError as exc:  # reset, broken pipe: the peer's business, not ours
            log.debug("metrics connection from %s: %s", conn.peer, exc)
            self._close(conn, selector)
            self.num_closed += 1

    def _maybe_render(self, selector, now: float) -> float:
        """Answer every request waiting for /metrics with one render, if the last one is
        old enough; returns how long the selector may wait."""
        due = self._rendered_at + MIN_RENDER_INTERVAL_S
        if now < due:
            return due - now
        waiting, self._waiting = self._waiting, []
        waiting = [conn for conn in waiting if conn.sock in self._conns]
        if not waiting:
            return 1.0
        try:
            response = ("200 OK", CONTENT_TYPE, render(self._coord, self._cache))
        except Exception:  # a bug: say so to the scrapers and the log, keep serving
            log.exception("metrics could not be rendered")
            response = ("500 Internal Server Error", "text/plain", b"metrics failed\n")
        self._rendered_at = time.monotonic()
        for conn in waiting:
            try:
                self._answer(conn, _response(*response, conn.head_only), selector)
            except OSError as exc:
                log.debug("metrics connection from %s: %s", conn.peer, exc)
                self._close(conn, selector)
                self.num_closed += 1
        return 1.0

    def _respond(self, conn: _Http, head: bytes) -> Optional[bytes]:
        """The answer to a request head, or None for /metrics (see _maybe_render)."""
        parts = head.split(b"\r\n" if b"\r\n" in head else b"\n", 1)[0].split()
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
            return _response("400 Bad Request", "text/plain", b"bad request\n")
        method, target = parts[0], parts[1].split(b"?", 1)[0]
        if method not in (b"GET", b"HEAD"):
            return _response("405 Method Not Allowed", "text/plain", b"GET /metrics\n")
        head_only = method == b"HEAD"
        if target == b"/metrics":
            conn.head_only = head_only
            return None
        if target == b"/":
            return _response(
                "200 OK", "text/plain", b"shmkv coordinator: metrics at /metrics\n", head_only
            )
        return _response(
            "404 Not Found", "text/plain", b"not found; metrics are at /metrics\n", head_only
        )

    def _answer(self, conn: _Http, response: bytes, selector) -> None:
        conn.out = response
        try:
            selector.modify(conn.sock, selectors.EVENT_WRITE, conn)
        except KeyError:  # waited for a render, unregistered meanwhile
            selector.register(conn.sock, selectors.EVENT_WRITE, conn)
        self._send(conn, selector)

    def _send(self, conn: _Http, selector) -> None:
        out = conn.out
        assert out is not None, "only an answered connection waits to write"
        try:
            conn.sent += conn.sock.send(memoryview(out)[conn.sent :])
        except (BlockingIOError, InterruptedError):
            return
        if conn.sent >= len(out):
            self.num_served += 1
            try:
                conn.sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
            self._close(conn, selector)

    def _expire(self, selector, now: float) -> None:
        while self._conns:
            conn = next(iter(self._conns.values()))
            if conn.deadline > now:
                return
            log.debug(
                "metrics connection from %s: no request within %.1f s, closed",
                conn.peer,
                self.timeout,
            )
            self._close(conn, selector)
            self.num_closed += 1

    def _close(self, conn: _Http, selector) -> None:
        if self._conns.pop(conn.sock, None) is None:
            return
        try:
            selector.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()

    def _warn(self, message: str, *args) -> None:
        now = time.monotonic()
        # ``message`` is the caller's %-format for ``args``: prefixed, it stays lazy.
        if now - self._warned_at >= _WARN_EVERY_S:  # once per interval, not per connection
            self._warned_at = now
            log.warning("metrics endpoint %s: " + message, self.url, *args)  # noqa: G003
        else:
            log.debug("metrics endpoint %s: " + message, self.url, *args)  # noqa: G003

    # -- lifecycle ---------------------------------------------------------------------

    def close(self) -> None:
        """Stop serving, close every connection and release the port. Idempotent."""
        if self._listener is None:
            return
        self._stopping = True
        try:
            if self._wake_w is not None:
                self._wake_w.send(b"x")
        except OSError:
            pass
        self._thread.join(5)
        if self._thread.is_alive():
            log.warning("metrics thread did not stop within 5 s")
        for name in ("_listener", "_wake_r", "_wake_w"):
            sock = getattr(self, name)
            if sock is not None:
                sock.close()
                setattr(self, name, None)

    def forget_after_fork(self) -> None:
        """In a forked child: close this process's copies of the sockets (the serving
        thread exists only in the parent)."""
        self._stopping = True
        for sock in list(self._conns):
            sock.close()
        self._conns = {}
        for name in ("_listener", "_wake_r", "_wake_w"):
            sock = getattr(self, name)
            if sock is not None:
                sock.close()
                setattr(self, name, None)
