"""Prometheus metrics of a coordinator, served over HTTP from a thread of its own.

Owns the ``/metrics`` endpoint (the Prometheus text format, made by
``prometheus_client``) and the names of every series (all ``shmkv_*``, listed in
``docs/operations.md``). Counters are not kept here: at each scrape the collector
reads the coordinator's plain ints, its per-op latency buckets and the sequence
table's counters from this thread (single reads of ints and lists, safe under the
GIL), so the coordinator's loop does no metrics work beyond adding to a few lists
(see ``Coordinator._handle``) and never waits on a scrape. Does not change any state
of the coordinator.

Started by ``Coordinator(..., metrics_port=N)`` (``shmkv serve --metrics-port N``) and
stopped with it.
"""

from __future__ import annotations

import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator, Tuple

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily)

from .errors import ShmkvError


class CoordinatorCollector:
    """A ``prometheus_client`` collector that reads one coordinator at scrape time.

    Args:
        coordinator: a :class:`~shmkv.coordinator.Coordinator` (opened).
    """

    def __init__(self, coordinator):
        self._coord = coordinator

    def describe(self) -> list:
        return []  # registering must not call collect() before the coordinator serves

    def collect(self) -> Iterator:
        from .coordinator import LATENCY_BUCKETS
        coord = self._coord
        table = coord.table
        if table is None:
            return
        cfg = coord.config
        counters = dict(table.counters)  # one C-level copy: consistent within itself

        blocks = GaugeMetricFamily(
            "shmkv_blocks", "Blocks by tier and state: free (no data), cached (unreferenced, "
            "kept for prefix hits, evictable), referenced (held by a sequence)",
            labels=["tier", "state"])
        for tier, states in coord.block_counts().items():
            for state, num in states.items():
                blocks.add_metric([tier, state], num)
        yield blocks
        yield GaugeMetricFamily("shmkv_pool_blocks", "Blocks in the pool", value=cfg.num_blocks)
        yield GaugeMetricFamily("shmkv_pool_bytes", "Bytes of K/V memory in the pool",
                                value=cfg.nbytes)
        yield GaugeMetricFamily("shmkv_block_bytes", "Bytes of one block (all layers, K and V)",
                                value=cfg.block_nbytes)
        yield GaugeMetricFamily("shmkv_sequences", "Live sequences", value=table.num_sequences)
        yield GaugeMetricFamily("shmkv_prefix_index_blocks",
                                "Blocks published in the prefix index",
                                value=len(table.pool.prefix_index))

        for name, key, doc in (
                ("shmkv_prefix_hit_tokens", "prefix_hit_tokens",
                 "Prompt tokens found in the prefix cache at allocation"),
                ("shmkv_prefix_miss_tokens", "prefix_miss_tokens",
                 "Prompt tokens not found in the prefix cache at allocation"),
                ("shmkv_prefix_hit_blocks", "prefix_hit_blocks",
                 "Full prompt blocks found in the prefix cache"),
                ("shmkv_prefix_miss_blocks", "prefix_miss_blocks",
                 "Full prompt blocks not found in the prefix cache"),
                ("shmkv_cow_copies", "cow_copies", "Blocks copied on write"),
                ("shmkv_published_blocks", "published_blocks",
                 "Blocks published for prefix reuse (committed by every rank)")):
            yield CounterMetricFamily(name, doc, value=counters.get(key, 0))
        yield CounterMetricFamily("shmkv_evictions", "Cached blocks evicted to make room",
                                  value=table.pool.num_evictions)

        handoffs = CounterMetricFamily("shmkv_handoffs", "Hand-off tokens by event",
                                       labels=["event"])
        for event in ("exported", "opened", "expired"):
            handoffs.add_metric([event], counters.get(f"{event}_handoffs", 0))
        yield handoffs
        yield GaugeMetricFamily("shmkv_handoffs_outstanding",
                                "Hand-off tokens exported and not yet opened or expired",
                                value=len(table.handoffs))

        yield GaugeMetricFamily("shmkv_connections_open", "Client connections open now",
                                value=len(coord._conns))
        connections = CounterMetricFamily(
            "shmkv_connections", "Client connections by event: accepted, refused (another "
            "user, or max_connections reached), closed (cleanly or not)", labels=["event"])
        connections.add_metric(["accepted"], coord.num_accepted)
        connections.add_metric(["refused"], coord.num_refused)
        connections.add_metric(["closed"], coord.num_dropped)
        yield connections

        ops = CounterMetricFamily("shmkv_ops", "Requests served, by op", labels=["op"])
        for op, num in sorted(dict(coord.ops_by_type).items()):
            ops.add_metric([op], num)
        yield ops
        yield CounterMetricFamily("shmkv_request_errors",
                                  "Requests answered with an error (any code)",
                                  value=coord.num_errors)

        latency = HistogramMetricFamily(
            "shmkv_request_duration_seconds",
            "Time the coordinator's loop spent on a request (decode, handle, encode), by op",
            labels=["op"])
        for op, values in sorted(dict(coord.latency).items()):
            values = list(values)  # a copy: the loop keeps adding to the original
            buckets, total = [], 0
            for bound, num in zip(LATENCY_BUCKETS, values):
                total += num
                buckets.append((repr(bound), total))
            total += values[len(LATENCY_BUCKETS)]
            buckets.append(("+Inf", total))
            latency.add_metric([op], buckets, sum_value=values[-1])
        yield latency
        uptime = time.monotonic() - coord._started_at if coord._started_at else 0.0
        yield GaugeMetricFamily("shmkv_uptime_seconds", "Seconds since the coordinator opened",
                                value=uptime)


class _Handler(BaseHTTPRequestHandler):
    registry: CollectorRegistry = None  # set on a subclass per server

    def do_GET(self) -> None:  # noqa: N802 (the http.server name)
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            body, status, kind = generate_latest(self.registry), 200, CONTENT_TYPE_LATEST
        elif path == "/":
            body, status, kind = b"shmkv coordinator: metrics at /metrics\n", 200, "text/plain"
        else:
            body, status, kind = b"not found; metrics are at /metrics\n", 404, "text/plain"
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format, *args) -> None:  # noqa: A002 (the http.server name)
        pass  # a scrape every few seconds is not news; the library prints nothing itself


class _Server(ThreadingHTTPServer):
    daemon_threads = True


class _Server6(_Server):
    address_family = socket.AF_INET6


class MetricsServer:
    """``/metrics`` of one coordinator, served from a daemon thread.

    Args:
        coordinator: the coordinator to report.
        port: TCP port (0: any free port; see :attr:`address`).
        host: address to bind; loopback by default (metrics are not secret, but a
            scrape costs CPU, so exposing them is the operator's choice).

    Raises:
        ShmkvError: the port cannot be bound (in use, or not allowed).
    """

    def __init__(self, coordinator, port: int, host: str = "127.0.0.1"):
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(CoordinatorCollector(coordinator))
        handler = type("Handler", (_Handler,), {"registry": self.registry})
        server_class = _Server6 if ":" in host else _Server
        try:
            self._server = server_class((host, port), handler)
        except OSError as exc:
            raise ShmkvError(f"metrics server cannot listen on {host}:{port} ({exc.strerror}); "
                             "choose another metrics port, or 0 for any free one") from None
        self.address: Tuple[str, int] = tuple(self._server.server_address[:2])
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        kwargs={"poll_interval": 0.1},
                                        name="shmkv-metrics", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        """The ``/metrics`` URL."""
        host, port = self.address
        return f"http://{f'[{host}]' if ':' in host else host}:{port}/metrics"

    def close(self) -> None:
        """Stop serving and release the port. Idempotent."""
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        self._thread.join(5)

    def forget_after_fork(self) -> None:
        """In a forked child: close this process's copy of the listening socket (the
        serving thread exists only in the parent)."""
        server, self._server = self._server, None
        if server is not None:
            server.socket.close()
