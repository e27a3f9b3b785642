"""Suite ``control``: one-request round trips against a raw msgpack echo server, and
batched allocate-and-free in blocks/s next to the in-process ``BlockPool`` alone.

Round trips are measured with client and server pinned to one CPU, then two.
"""

from __future__ import annotations

import functools
import os
import socket
import struct
import time
from typing import TYPE_CHECKING, Callable, Dict, List

from shmkv.bench.core import (
    BenchError,
    Figure,
    Helper,
    Options,
    _check,
    _Cleanup,
    _median,
    _percentile,
    _unique,
    interleaved,
)

if TYPE_CHECKING:
    from shmkv.coordinator.allocator import BlockPool


def _child_echo(conn, path: str) -> None:
    """A raw msgpack echo server with the coordinator's framing, one connection."""
    from shmkv import protocol

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(path)
        listener.listen(1)
        listener.settimeout(60)
        conn.send("ready")
        sock, _ = listener.accept()
        # A blocking socket with a kernel receive timeout: no poll before each call.
        sock.settimeout(None)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 600, 0))
        decoder = protocol.FrameDecoder()
        with sock:
            while True:
                data = sock.recv(1 << 18)
                if not data:
                    break
                for obj in decoder.feed(data):
                    sock.sendall(protocol.encode_ok(obj[0], {}))
    finally:
        listener.close()
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


class _EchoClient:
    """The baseline client: encode, send, receive and decode one frame, nothing else."""

    def __init__(self, path: str):
        from shmkv import protocol

        self.protocol = protocol
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(30)
        self.sock.connect(path)
        self.decoder = protocol.FrameDecoder()
        self.next_id = 1

    def ping(self):
        request_id = self.next_id
        self.next_id += 1
        self.sock.sendall(self.protocol.encode_request(request_id, "ping", {}))
        while True:
            data = self.sock.recv(1 << 18)
            if not data:
                raise BenchError("the echo server closed the connection")
            for obj in self.decoder.feed(data):
                return self.protocol.parse_response(obj).unwrap()

    def close(self):
        self.sock.close()


def bench_control(opts: Options, cleanup: _Cleanup, series: dict) -> List[Figure]:
    """Round-trip latency against a raw echo server, batched allocate/free throughput,
    and the in-process allocator alone."""
    from shmkv.client.client import connect
    from shmkv.coordinator.allocator import BlockPool
    from shmkv.coordinator.server import Coordinator, runtime_dir
    from shmkv.memory.layout import PoolConfig

    # The coordinator's work does not depend on block bytes: a tiny block keeps the pool small.
    cfg = PoolConfig(
        num_layers=1, num_kv_heads=1, head_dim=8, num_blocks=16384, block_size=16, dtype="float16"
    )
    path = os.path.join(runtime_dir(), _unique("echo") + ".sock")
    echo = cleanup.add(Helper(_child_echo, path, name="shmkv-bench-echo"))
    coord = cleanup.add(Coordinator.spawn(cfg, name=_unique("control"), timeout=120))
    echo.recv(120)
    figures = []
    client = connect(coord.address)
    echo_client = _EchoClient(path)
    try:
        # -- latency. Client and servers are pinned: on a small VM a wake-up across CPUs
        # costs several times the work measured, and the scheduler places each pair
        # differently, so unpinned ratios mostly measure placement. Blocks of each kind
        # alternate so that all see the same machine state.
        cpus = sorted(os.sched_getaffinity(0))
        placements = [("same CPU", cpus[0], cpus[0])]
        if len(cpus) > 1:
            placements.append(("2 CPUs", cpus[0], cpus[1]))
        block, total = 50, (400 if opts.quick else 2000)
        latency = {}
        try:
            for place, client_cpu, server_cpu in placements:
                os.sched_setaffinity(0, {client_cpu})
                for pid in (echo.process.pid, coord.pid):
                    os.sched_setaffinity(pid, {server_cpu})
                samples = _latency_rounds(client, echo_client, block, total)
                latency[place] = samples
                echo_p = {q: _percentile(samples["echo"], q) for q in (50, 99)}
                for kind in ("ping", "extend(1)"):
                    for q in (50, 99):
                        value = _percentile(samples[kind], q)
                        ratio = value / echo_p[q]
                        figures.append(
                            Figure(
                                "control",
                                f"{kind} round trip p{q}, {place}",
                                value * 1e6,
                                "us",
                                echo_p[q] * 1e6,
                                f"echo p{q}",
                                ratio,
                                "<= 1.5",
                                _check(ratio, "<= 1.5"),
                                params={
                                    "samples": len(samples[kind]),
                                    "client_cpu": client_cpu,
                                    "server_cpu": server_cpu,
                                },
                            )
                        )
        finally:
            os.sched_setaffinity(0, cpus)
            for pid in (echo.process.pid, coord.pid):
                os.sched_setaffinity(pid, cpus)
        series["latency"] = {
            place: {k: [t * 1e6 for t in v] for k, v in samples.items()}
            for place, samples in latency.items()
        }

        # -- batched allocate + free through the coordinator
        batches = (1, 4, 16, 64, 256, 1024)
        budget = 0.05 if opts.quick else 0.15
        bs = cfg.block_size
        throughput = []
        for batch in batches:
            rates = _rates(_allocate_and_free(client, batch, bs), batch, budget, opts.repeats)
            throughput.append({"batch": batch, **rates})
        pool = BlockPool(65536)
        for row in throughput:
            row["BlockPool"] = _rates(
                _pool_allocate_and_free(pool, row["batch"]), row["batch"], budget, opts.repeats
            )["BlockPool"]
        series["throughput"] = throughput
        for row in throughput:
            for kind in ("allocate_many+close_many", "allocate+close", "BlockPool"):
                target = ">= 500000" if row["batch"] >= 256 and kind != "BlockPool" else None
                alone = kind == "BlockPool"
                figures.append(
                    Figure(
                        "control",
                        f"{kind} batch={row['batch']}",
                        row[kind],
                        "blocks/s",
                        None if alone else row["BlockPool"],
                        "" if alone else "BlockPool alone",
                        None if alone else row[kind] / row["BlockPool"],
                        target,
                        _check(row[kind], target) if target else None,
                        "value",
                    )
                )
    finally:
        echo_client.close()
        client.close()
        cleanup.remove(echo)
        cleanup.remove(coord)
    return figures


def _allocate_and_free(client, batch: int, block_size: int) -> Dict[str, Callable[[], None]]:
    """Allocate + free of ``batch`` blocks through the coordinator: one sequence of
    ``batch`` blocks, and ``batch`` one-block sequences in one round trip each way."""

    def many() -> None:
        client.close_many(client.allocate_many([block_size] * batch))

    def one() -> None:
        client.allocate(batch * block_size).close()

    return {"allocate_many+close_many": many, "allocate+close": one}


def _pool_allocate_and_free(pool: BlockPool, batch: int) -> Dict[str, Callable[[], None]]:
    """The same ``batch`` blocks from a :class:`BlockPool` alone (no socket)."""

    def alloc_free() -> None:
        blocks = pool.allocate(batch, 1)
        assert blocks is not None, "the pool ran out of blocks"
        pool.decref(blocks)

    return {"BlockPool": alloc_free}


def _latency_rounds(client, echo_client, block: int, total: int) -> dict:
    """Round-trip times of echo, ping and extend(1), ``total`` each (after two warm-up
    rounds), in alternating blocks of ``block``."""
    samples: Dict[str, List[float]] = {"echo": [], "ping": [], "extend(1)": []}
    handle = client.allocate(0)
    try:
        for round_ in range(total // block + 2):
            for kind, fn in (
                ("echo", echo_client.ping),
                ("ping", client.ping),
                ("extend(1)", functools.partial(handle.extend, 1)),
            ):
                for _ in range(block):
                    t0 = time.perf_counter()
                    fn()
                    elapsed = time.perf_counter() - t0
                    if round_ >= 2:
                        samples[kind].append(elapsed)
            handle.close()  # keep tables short between rounds (untimed)
            handle = client.allocate(0)
    finally:
        handle.close()
    return samples


def _rates(fns: dict, batch: int, budget: float, repeats: int) -> dict:
    """Blocks per second of each function (one call handles ``batch`` blocks): each
    sample runs the call for about ``budget`` seconds; the median over samples."""
    calls = {}
    for name, fn in fns.items():  # calibrate: calls per sample
        t0 = time.perf_counter()
        fn()
        one = max(time.perf_counter() - t0, 1e-7)
        calls[name] = max(1, int(budget / one))

    def looped(fn, k):
        def run():
            for _ in range(k):
                fn()

        return run

    times = interleaved({name: looped(fn, calls[name]) for name, fn in fns.items()}, repeats)
    return {name: batch * calls[name] / _median(t) for name, t in times.items()}
