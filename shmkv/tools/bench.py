"""``shmkv bench``: the benchmark suite, each figure measured beside its baseline.

Owns the seven measured sections (data plane, attach, control plane, hand-off,
scaling, memory, batched steps), the baselines each is compared with, the targets,
the printed table, the JSON record under ``benchmarks/results/`` and the plots under
``benchmarks/plots/`` (drawn when matplotlib is installed). It measures through the
public API (``Coordinator``, ``connect``, handles, batches, ``BlockPool``); only the
split of the batch section's control plane calls ``SequenceTable`` and ``protocol``
in process and resends a batch's own packed request. It changes nothing in the
modules it measures.

Method: each figure is the median of repeated runs after a warm-up round, and its
baseline runs interleaved with it in the same rounds, so a busy machine slows both
alike; the ratio of the two is the result. Helper processes use the ``spawn``
context, every wait has a timeout, and the run leaves no process and no
``/dev/shm`` entry behind.
"""

from __future__ import annotations

import dataclasses
import json
import math
import multiprocessing
import os
import platform
import random
import socket
import statistics
import struct
import sys
import time
import traceback
from typing import Callable, Dict, List, Optional

SECTIONS = ("data", "attach", "control", "handoff", "scaling", "memory", "batch")
SPAWN = multiprocessing.get_context("spawn")
MIB = 1 << 20
GIB = 1 << 30

# The model shape every data-plane figure uses: a 7-8B class model with grouped KV heads.
MODEL = dict(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16")



CHILD_IDLE_TIMEOUT = 600.0


def _next_command(conn, timeout: float = CHILD_IDLE_TIMEOUT):
    """The parent's next message to a measuring child, or None (stop) when the parent
    has said nothing for ``timeout`` seconds or is gone."""
    try:
        if not conn.poll(timeout):
            return None
        return conn.recv()
    except (EOFError, OSError):
        return None

class BenchError(RuntimeError):
    """A benchmark step failed or a helper process did not answer in time."""


@dataclasses.dataclass
class Figure:
    """One measured figure and its comparison with a baseline.

    ``ratio`` is value/baseline. ``target`` applies to the ratio (``>= 0.8`` for a
    rate, ``<= 1.5`` for a time), or to the value itself when ``target_of`` is
    ``"value"``; ``met`` is None without a target.
    """

    section: str
    name: str
    value: float
    unit: str
    baseline: Optional[float] = None
    baseline_name: str = ""
    ratio: Optional[float] = None
    target: Optional[str] = None
    met: Optional[bool] = None
    target_of: str = "ratio"
    params: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Options:
    """What one run measures and how hard."""

    quick: bool
    repeats: int
    sections: tuple
    out_dir: str
    name: str
    threads: int = 1


def _check(value: float, target: str) -> bool:
    op, bound = target.split()
    return value >= float(bound) if op == ">=" else value <= float(bound)


def _median(values) -> float:
    return statistics.median(values)


def _percentile(values, q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))
    return ordered[index]


def interleaved(fns: Dict[str, Callable[[], object]], repeats: int,
                warmup: int = 1) -> Dict[str, List[float]]:
    """Time each function ``repeats`` times after ``warmup`` rounds. Every round runs
    all of them in a new random order (fixed seed), so that they share the machine's
    state and none always follows the same neighbour (whose data may still be in
    cache). Returns the seconds of each run, per name."""
    names = list(fns)
    order = random.Random(len(names) * 7919 + repeats)
    times: Dict[str, List[float]] = {name: [] for name in names}
    for round_ in range(warmup + repeats):
        order.shuffle(names)
        for name in names:
            t0 = time.perf_counter()
            fns[name]()
            elapsed = time.perf_counter() - t0
            if round_ >= warmup:
                times[name].append(elapsed)
    return times


def memory_of(pid="self") -> dict:
    """Resident memory of a process in bytes: ``rss``, ``uss`` (pages mapped by this
    process only), ``pss`` and ``anon`` (anonymous pages: where a copy would live),
    from ``/proc/PID/smaps_rollup``."""
    fields = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                fields[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return {"rss": fields.get("Rss", 0), "pss": fields.get("Pss", 0),
            "uss": fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0),
            "anon": fields.get("Anonymous", 0)}


def _shm_entries() -> set:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


# -- helper processes ------------------------------------------------------------------------

def _child_main(target: str, conn, args: tuple) -> None:
    """Entry point of every helper process: run ``target`` of this module with its pipe."""
    try:
        globals()[target](conn, *args)
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        pass  # the parent is gone or stopping us
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass
    finally:
        conn.close()


class Helper:
    """A spawned helper process driven through a pipe; every wait has a timeout.

    The child exits when the pipe closes, so it cannot outlive the benchmark.
    """

    def __init__(self, target: str, *args, name: str = "shmkv-bench"):
        self.name = name
        self.conn, child = SPAWN.Pipe()
        self.process = SPAWN.Process(target=_child_main, args=(target, child, args),
                                     name=name, daemon=True)
        self.process.start()
        child.close()

    def send(self, message) -> None:
        self.conn.send(message)

    def recv(self, timeout: float):
        """The next message; raises :class:`BenchError` on a timeout or a child error."""
        if not self.conn.poll(timeout):
            raise BenchError(f"{self.name} sent nothing within {timeout:.0f} s")
        try:
            message = self.conn.recv()
        except EOFError:
            raise BenchError(f"{self.name} exited (code {self.process.exitcode})") from None
        if isinstance(message, tuple) and message and message[0] == "error":
            raise BenchError(f"{self.name} failed:\n{message[1]}")
        return message

    def stop(self, timeout: float = 10.0) -> None:
        """Close the pipe, wait for the process, kill it if it lingers. Idempotent."""
        if self.conn is not None:
            try:
                self.conn.send(None)
            except OSError:
                pass
            self.conn.close()
            self.conn = None
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)


class _Cleanup:
    """Everything a run started, stopped in reverse order however the run ends."""

    def __init__(self):
        self.items: list = []

    def add(self, item):
        self.items.append(item)
        return item

    def remove(self, item) -> None:
        item.stop()
        if item in self.items:
            self.items.remove(item)

    def close(self) -> None:
        while self.items:
            item = self.items.pop()
            try:
                item.stop()
            except Exception as exc:  # keep stopping the rest
                print(f"shmkv bench: cleanup of {item!r} failed: {exc}", file=sys.stderr)


_names = iter(range(1 << 30))


def _unique(tag: str) -> str:
    return f"bench-{tag}-{os.getpid()}-{next(_names)}"


def _model_config(num_blocks: int, block_size: int = 16, **overrides):
    from ..layout import PoolConfig
    shape = dict(MODEL, **overrides)
    return PoolConfig(num_blocks=num_blocks, block_size=block_size, device="cpu", **shape)


def _pattern(numel: int, dtype):
    """A ``numel`` tensor of varied bit patterns (no NaN or Inf), made in one copy."""
    import torch
    period = 1 << 20
    base = torch.randint(-3000, 3000, (period,), dtype=torch.int32).to(dtype)
    reps = -(-numel // period)
    return base.repeat(reps)[:numel]


def _same_bits(a, b) -> bool:
    import torch
    size = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return a.shape == b.shape and torch.equal(a.contiguous().view(size), b.contiguous().view(size))


# -- 1. data plane ---------------------------------------------------------------------------

# (op key, label, baseline key, target); "clone_*" are references for fresh outputs.
DATA_OPS = (
    ("write_all", "write_all", "copy_all", ">= 0.7"),
    ("write", "write per layer", "copy_all", ">= 0.7"),
    ("gather_all_out", "gather_all(out=)", "copy_all", ">= 0.8"),
    ("key_cache_out", "key_cache(out=)", "copy_layer", ">= 0.8"),
    ("gather_all", "gather_all()", "copy_all", ">= 0.8"),
    ("key_cache", "key_cache()", "copy_layer", ">= 0.8"),
)
_REFERENCE = {"copy_all": "clone_all", "copy_layer": "clone_layer"}


def bench_data(opts: Options, cleanup: _Cleanup, series: dict) -> List[Figure]:
    """Write and gather bandwidth against a contiguous copy of the same bytes."""
    import torch
    from ..client import connect
    from ..coordinator import Coordinator

    lengths = (128, 1024, 4096) if opts.quick else (128, 256, 512, 1024, 2048, 4096, 8192)
    block_sizes = (8, 16, 32, 64)
    probe = _model_config(1)
    L, H, D = probe.num_layers, probe.num_kv_heads, probe.head_dim
    dtype = getattr(torch, probe.dtype)
    max_n = max(lengths)
    buffers = {"source": _pattern(L * 2 * max_n * H * D, dtype),
               "all": torch.zeros(L * 2 * max_n * H * D, dtype=dtype),
               "layer": torch.zeros(max_n * H * D, dtype=dtype)}
    points = []
    for bs in block_sizes:
        # Room for the measured sequence and a filler taking every other block.
        cfg = _model_config(2 * (max_n // bs) + 2, block_size=bs)
        coord = cleanup.add(Coordinator(cfg, name=_unique("data")).start())
        client = connect(coord.address)
        try:
            for n in lengths:
                points.append(_data_point(client, buffers, n, opts.repeats))
        finally:
            client.close()
            cleanup.remove(coord)
    buffers.clear()
    series["data"] = points

    figures = []
    for op, label, base, target in DATA_OPS:
        for bs in block_sizes:
            rows = [p for p in points if p["block_size"] == bs]
            for p in rows:
                p[op + "_ratio"] = p[op] / p[base]
            worst = min(rows, key=lambda p: p[op + "_ratio"])
            ratio = worst[op + "_ratio"]
            params = {"block_size": bs, "n": worst["n"],
                      "ratios": {p["n"]: round(p[op + "_ratio"], 3) for p in rows}}
            if op in ("gather_all", "key_cache"):  # fresh outputs: what a clone gets
                params["reference_ratios"] = {
                    p["n"]: round(p[_REFERENCE[base]] / p[base], 3) for p in rows}
            figures.append(Figure(
                "data", f"{label} bs={bs} (worst: n={worst['n']})", worst[op] / 1e9, "GB/s",
                worst[base] / 1e9, base.replace("_", " "), ratio, target, _check(ratio, target),
                params=params))
    return figures


def _data_point(client, buffers: dict, n: int, repeats: int) -> dict:
    cfg = client.config
    L, H, D, bs = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.block_size
    handle = client.allocate(0)
    filler = client.allocate(0)
    try:
        for _ in range(n // bs):  # interleave the two tables: no two neighbours are adjacent
            client.extend_many([(handle, bs), (filler, bs)])
        kv = buffers["source"][:L * 2 * n * H * D].view(L, 2, n, H, D)
        out_all = buffers["all"][:kv.numel()].view_as(kv)
        layer_src = kv[3, 0]
        out_layer = buffers["layer"][:layer_src.numel()].view_as(layer_src)

        def write_layers():
            for layer in range(L):
                handle.write(layer, kv[layer, 0], kv[layer, 1], 0)

        handle.write_all(kv, 0)
        if not (_same_bits(handle.gather_all(), kv) and _same_bits(handle.key_cache(3), layer_src)):
            raise BenchError(f"data plane read back wrong values (n={n}, block_size={bs})")
        times = interleaved({
            "copy_all": lambda: out_all.copy_(kv),
            "clone_all": kv.clone,
            "write_all": lambda: handle.write_all(kv, 0),
            "write": write_layers,
            "gather_all_out": lambda: handle.gather_all(out=out_all),
            "gather_all": handle.gather_all,
            "copy_layer": lambda: out_layer.copy_(layer_src),
            "clone_layer": layer_src.clone,
            "key_cache_out": lambda: handle.key_cache(3, out=out_layer),
            "key_cache": lambda: handle.key_cache(3),
        }, repeats if n >= 1024 else 3 * repeats)  # small points are cheap: more runs
        all_bytes = kv.numel() * kv.element_size()
        layer_bytes = layer_src.numel() * layer_src.element_size()
        point = {"n": n, "block_size": bs, "bytes_all": all_bytes, "bytes_layer": layer_bytes}
        for name, samples in times.items():
            nbytes = layer_bytes if "layer" in name or "key_cache" in name else all_bytes
            point[name] = nbytes / _median(samples)
            point[name + "_s"] = _median(samples)
        return point
    finally:
        client.close_many([handle, filler])


# -- 2 and 6. attach time and resident memory, per pool size ---------------------------------

def _child_attach(conn, address: str, baseline: str, repeats: int, touch: bool) -> None:
    """Worker side: time connect (imports already done), measure memory, then time
    connects to ``address`` alternating with connects to the ``baseline`` pool."""
    import gc
    import torch
    from ..client import connect
    ready = _next_command(conn)  # start timing only when the parent says so
    if ready is None:
        return
    t0 = time.perf_counter()
    client = connect(address)
    cold = time.perf_counter() - t0
    result = {"cold_s": cold, "attached": memory_of()}
    if touch:  # map every page of the pool by reading one byte of each
        from ..memory import storage_view
        pages = storage_view(client.pool).reshape(-1).view(torch.uint8)[::4096]
        pages.sum()
        del pages
        result["touched"] = memory_of()
    client.close()
    del client
    gc.collect()  # unmap the touched pool now, not inside a timed connect
    times: Dict[str, List[float]] = {"pool": [], "baseline": []}
    for round_ in range(repeats + 1):
        for kind, where in (("baseline", baseline), ("pool", address)):
            t0 = time.perf_counter()
            client = connect(where)
            elapsed = time.perf_counter() - t0
            client.close()
            del client
            if round_:
                times[kind].append(elapsed)
    result["warm_s"] = times["pool"]
    result["baseline_s"] = times["baseline"]
    conn.send(("ok", result))
    _next_command(conn)  # hold the process until the parent is done with it


def _pool_sweep(opts: Options, cleanup: _Cleanup, cache: dict) -> list:
    """For each pool size: spawn a coordinator, attach a fresh worker, read memory."""
    if "pools" in cache:
        return cache["pools"]
    from ..coordinator import Coordinator
    from ..shm import shm_free_bytes
    sizes = [64 * MIB, 256 * MIB, GIB] + ([] if opts.quick else [4 * GIB, 8 * GIB])
    block_size = 16
    block_bytes = _model_config(1, block_size).block_nbytes
    rows = []
    # The smallest pool stays up: every size is timed alternating with it.
    baseline = cleanup.add(Coordinator.spawn(_model_config(sizes[0] // block_bytes, block_size),
                                             name=_unique("attach"), timeout=120))
    for size in sizes:
        if size + 512 * MIB > shm_free_bytes():
            cache.setdefault("notes", []).append(
                f"pool of {size / GIB:g} GiB skipped: /dev/shm has "
                f"{shm_free_bytes() / GIB:.1f} GiB free")
            continue
        # Spawn the worker first: its interpreter starts while the pool is allocated.
        worker = cleanup.add(Helper("_child_attach_wait", name="shmkv-bench-attach"))
        t0 = time.perf_counter()
        coord = cleanup.add(Coordinator.spawn(_model_config(size // block_bytes, block_size),
                                              name=_unique("attach"), timeout=120))
        create_s = time.perf_counter() - t0
        try:
            worker.send((coord.address, baseline.address, 5 * opts.repeats, True))
            worker.recv(120)  # imports done
            coordinator_before = memory_of(coord.pid)
            worker.send("go")
            _, result = worker.recv(300)
            result["coordinator"] = memory_of(coord.pid)
            result["coordinator_before"] = coordinator_before
            result["pool_bytes"] = size
            result["create_s"] = create_s
            rows.append(result)
        finally:
            cleanup.remove(worker)
            cleanup.remove(coord)
    cleanup.remove(baseline)
    cache["pools"] = rows
    return rows


def _child_attach_wait(conn) -> None:
    """A fresh worker: import everything, then attach when told (see ``_child_attach``)."""
    import torch  # noqa: F401  (imports are outside the timed region)
    from .. import client  # noqa: F401
    args = _next_command(conn)
    if args is None:
        return
    conn.send("ready")
    _child_attach(conn, *args)


def bench_attach(opts: Options, cleanup: _Cleanup, series: dict, cache: dict) -> List[Figure]:
    """Worker attach time against pool size."""
    rows = _pool_sweep(opts, cleanup, cache)
    if not rows:
        return []
    points = [{"pool_bytes": r["pool_bytes"], "warm_s": _median(r["warm_s"]),
               "baseline_s": _median(r["baseline_s"]), "cold_s": r["cold_s"],
               "create_s": r["create_s"]} for r in rows]
    series["attach"] = points
    small, large = points[0], points[-1]
    figures = []
    for p in points:
        ratio = p["warm_s"] / p["baseline_s"]
        target = "<= 1.5" if p is large and p is not small else None
        figures.append(Figure("attach", f"attach, {_size(p['pool_bytes'])} pool",
                              p["warm_s"] * 1e3, "ms", p["baseline_s"] * 1e3,
                              f"{_size(small['pool_bytes'])} pool, same worker", ratio,
                              target, _check(ratio, target) if target else None,
                              params={"first_attach_ms": p["cold_s"] * 1e3,
                                      "first_attach_ratio": p["cold_s"] / small["cold_s"],
                                      "coordinator_start_s": p["create_s"]}))
    return figures


def bench_memory(opts: Options, cleanup: _Cleanup, series: dict, cache: dict) -> List[Figure]:
    """Resident memory of the coordinator and of an attached worker against pool size."""
    rows = _pool_sweep(opts, cleanup, cache)
    if not rows:
        return []
    points = [{"pool_bytes": r["pool_bytes"], "coordinator": r["coordinator"],
               "worker_attached": r["attached"], "worker_touched": r.get("touched")}
              for r in rows]
    series["memory"] = points
    small, large = points[0], points[-1]
    figures = []
    for who in ("coordinator", "worker_attached", "worker_touched"):
        if large[who] is None:
            continue
        label = who.replace("_", " ")
        for kind in ("rss", "uss", "anon"):
            figures.append(Figure("memory", f"{label} {kind.upper()} ({_size(large['pool_bytes'])} "
                                            "pool)", large[who][kind] / MIB, "MiB",
                                  small[who][kind] / MIB, f"{_size(small['pool_bytes'])} pool",
                                  params={"values_mib": {p["pool_bytes"]: p[who][kind] / MIB
                                                         for p in points}}))
    # The check: no process grows private anonymous memory with the pool (no copy).
    for who in ("coordinator", "worker_attached", "worker_touched"):
        if large[who] is None:
            continue
        growth = (large[who]["anon"] - small[who]["anon"])
        pool_growth = large["pool_bytes"] - small["pool_bytes"]
        ratio = growth / pool_growth
        figures.append(Figure("memory", f"{who.replace('_', ' ')} anon growth / pool growth",
                              growth / MIB, "MiB", pool_growth / MIB, "pool growth", ratio,
                              "<= 0.01", _check(ratio, "<= 0.01")))
    return figures


def _size(nbytes: int) -> str:
    return f"{nbytes / GIB:g} GiB" if nbytes >= GIB else f"{nbytes / MIB:g} MiB"


# -- 3. control plane ------------------------------------------------------------------------

def _child_echo(conn, path: str) -> None:
    """A raw msgpack echo server with the coordinator's framing, one connection."""
    from .. import protocol
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
        from .. import protocol
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
    from ..allocator import BlockPool
    from ..client import connect
    from ..coordinator import Coordinator, runtime_dir
    from ..layout import PoolConfig

    # The coordinator's work does not depend on block bytes: a tiny block keeps the pool small.
    cfg = PoolConfig(num_layers=1, num_kv_heads=1, head_dim=8, num_blocks=16384, block_size=16,
                     dtype="float16")
    path = os.path.join(runtime_dir(), _unique("echo") + ".sock")
    echo = cleanup.add(Helper("_child_echo", path, name="shmkv-bench-echo"))
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
                        figures.append(Figure(
                            "control", f"{kind} round trip p{q}, {place}", value * 1e6, "us",
                            echo_p[q] * 1e6, f"echo p{q}", ratio, "<= 1.5",
                            _check(ratio, "<= 1.5"),
                            params={"samples": len(samples[kind]), "client_cpu": client_cpu,
                                    "server_cpu": server_cpu}))
        finally:
            os.sched_setaffinity(0, cpus)
            for pid in (echo.process.pid, coord.pid):
                os.sched_setaffinity(pid, cpus)
        series["latency"] = {place: {k: [t * 1e6 for t in v] for k, v in samples.items()}
                             for place, samples in latency.items()}

        # -- batched allocate + free through the coordinator
        batches = (1, 4, 16, 64, 256, 1024)
        budget = 0.05 if opts.quick else 0.15
        bs = cfg.block_size
        throughput = []
        for batch in batches:
            def many():
                client.close_many(client.allocate_many([bs] * batch))

            def one():
                client.allocate(batch * bs).close()
            rates = _rates({"allocate_many+close_many": many, "allocate+close": one},
                           batch, budget, opts.repeats)
            throughput.append({"batch": batch, **rates})
        pool = BlockPool(65536)
        for row in throughput:
            batch = row["batch"]

            def alloc_free():
                pool.decref(pool.allocate(batch, 1))
            row["BlockPool"] = _rates({"BlockPool": alloc_free}, batch, budget,
                                      opts.repeats)["BlockPool"]
        series["throughput"] = throughput
        for row in throughput:
            for kind in ("allocate_many+close_many", "allocate+close", "BlockPool"):
                target = ">= 500000" if row["batch"] >= 256 and kind != "BlockPool" else None
                alone = kind == "BlockPool"
                figures.append(Figure(
                    "control", f"{kind} batch={row['batch']}", row[kind], "blocks/s",
                    None if alone else row["BlockPool"], "" if alone else "BlockPool alone",
                    None if alone else row[kind] / row["BlockPool"], target,
                    _check(row[kind], target) if target else None, "value"))
    finally:
        echo_client.close()
        client.close()
        cleanup.remove(echo)
        cleanup.remove(coord)
    return figures


def _latency_rounds(client, echo_client, block: int, total: int) -> dict:
    """Round-trip times of echo, ping and extend(1), ``total`` each (after two warm-up
    rounds), in alternating blocks of ``block``."""
    samples = {"echo": [], "ping": [], "extend(1)": []}
    handle = client.allocate(0)
    try:
        for round_ in range(total // block + 2):
            for kind, fn in (("echo", echo_client.ping), ("ping", client.ping),
                             ("extend(1)", lambda: handle.extend(1))):
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


# -- 4. hand-off -------------------------------------------------------------------------------

HANDOFF_METHODS = ("shmkv", "torch.multiprocessing", "shared_memory")


def _clock() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)  # one clock for every process


def _checksum(t) -> int:
    import torch
    return int(t.reshape(-1)[::257].view(torch.int16).to(torch.int64).sum())


def _child_producer(conn, address: str, tokens: int, threads: int, torch_queue,
                    meta_queue) -> None:
    """Prefill side: fresh K/V each round (untimed), then hand it off by one method."""
    import torch
    from multiprocessing import shared_memory
    from ..client import connect
    torch.set_num_threads(threads)
    client = connect(address)
    cfg = client.config
    shape = (cfg.num_layers, 2, tokens, cfg.num_kv_heads, cfg.head_dim)
    template = _pattern(math.prod(shape), client.pool.dtype).view(shape)
    segments = []
    try:
        conn.send("ready")
        while True:
            command = _next_command(conn)
            if command is None:
                return
            method, rep = command
            for seg in segments:  # the consumer of the last round is done with it
                seg.close()
                seg.unlink()
            segments.clear()
            kv = template.clone()  # the freshly computed K/V of this prefill
            kv.view(-1)[::4099] += rep
            expected = _checksum(kv)
            t0 = _clock()
            if method == "shmkv":
                handle = client.allocate(tokens)
                handle.write_all(kv, 0)
                token = handle.export(60)
                handle.close()
                meta_queue.put(token)
            elif method == "torch.multiprocessing":
                torch_queue.put(kv)
            else:
                nbytes = kv.numel() * kv.element_size()
                seg = shared_memory.SharedMemory(create=True, size=nbytes,
                                                 name=f"shmkvbench-{os.getpid()}-{rep}")
                segments.append(seg)
                view = torch.frombuffer(seg.buf, dtype=kv.dtype, count=kv.numel())
                view.copy_(kv.view(-1))
                del view  # frombuffer does not hold the buffer: drop it before close
                meta_queue.put((seg.name, tuple(kv.shape), str(kv.dtype)))
            conn.send((t0, expected))
            del kv
    finally:
        for seg in segments:
            seg.close()
            seg.unlink()
        client.close()


def _child_consumer(conn, address: str, tokens: int, threads: int, torch_queue,
                    meta_queue) -> None:
    """Decode side: receive one hand-off by the named method and read all of it into a
    K/V buffer of its own."""
    import torch
    from multiprocessing import shared_memory
    from ..client import connect
    torch.set_num_threads(threads)
    client = connect(address)
    cfg = client.config
    # The decoder's own K/V buffer, allocated and touched once: every method reads into it.
    out = torch.zeros((cfg.num_layers, 2, tokens, cfg.num_kv_heads, cfg.head_dim),
                      dtype=client.pool.dtype)
    conn.send("ready")
    while True:
        method = _next_command(conn)
        if method is None:
            break
        if method == "shmkv":
            token = meta_queue.get(timeout=120)
            handle = client.open(token)
            handle.gather_all(out=out)
            handle.close()
        elif method == "torch.multiprocessing":
            received = torch_queue.get(timeout=120)
            out.copy_(received)
            del received
        else:
            name, shape, dtype = meta_queue.get(timeout=120)
            seg = shared_memory.SharedMemory(name=name)  # its owner, the producer, unlinks it
            view = torch.frombuffer(seg.buf, dtype=out.dtype, count=out.numel())
            out.view(-1).copy_(view)
            del view  # frombuffer does not hold the buffer: drop it before close
            seg.close()
        t1 = _clock()
        conn.send((t1, _checksum(out)))
    client.close()


def bench_handoff(opts: Options, cleanup: _Cleanup, series: dict) -> List[Figure]:
    """End-to-end hand-off of one sequence's K/V from a producer to a consumer process."""
    import torch.multiprocessing as tmp
    from ..coordinator import Coordinator
    tokens = 2048
    cfg = _model_config(2 * (tokens // 16) + 8, 16)
    coord = cleanup.add(Coordinator.spawn(cfg, name=_unique("handoff"), timeout=120))
    torch_queue = tmp.get_context("spawn").Queue()
    meta_queue = SPAWN.Queue()
    producer = cleanup.add(Helper("_child_producer", coord.address, tokens, opts.threads,
                                  torch_queue, meta_queue, name="shmkv-bench-producer"))
    consumer = cleanup.add(Helper("_child_consumer", coord.address, tokens, opts.threads,
                                  torch_queue, meta_queue, name="shmkv-bench-consumer"))
    try:
        producer.recv(120)
        consumer.recv(120)
        repeats = max(3, opts.repeats)
        times: Dict[str, List[float]] = {m: [] for m in HANDOFF_METHODS}
        rep = 0
        for round_ in range(repeats + 1):
            order = HANDOFF_METHODS[round_ % 3:] + HANDOFF_METHODS[:round_ % 3]
            for method in order:
                rep += 1
                consumer.send(method)
                producer.send((method, rep))
                t0, expected = producer.recv(120)
                t1, got = consumer.recv(120)
                if got != expected:
                    raise BenchError(f"hand-off by {method} delivered different K/V")
                if round_ > 0:
                    times[method].append((t1 - t0) / 1e9)
    finally:
        cleanup.remove(consumer)
        cleanup.remove(producer)
        cleanup.remove(coord)
        for q in (torch_queue, meta_queue):
            q.close()
            q.join_thread()
    nbytes = tokens * cfg.block_nbytes // cfg.block_size
    medians = {m: _median(t) for m, t in times.items()}
    series["handoff"] = {"bytes": nbytes, "times_s": times, "median_s": medians}
    figures = []
    params = {"tokens": tokens, "bytes": nbytes, "layers": cfg.num_layers,
              "kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "dtype": cfg.dtype}
    for method in HANDOFF_METHODS:
        speedup = medians[method] / medians["shmkv"]
        figures.append(Figure("handoff", f"hand-off {method}", medians[method] * 1e3, "ms",
                              medians["shmkv"] * 1e3 if method != "shmkv" else None,
                              "shmkv" if method != "shmkv" else "",
                              speedup if method != "shmkv" else None,
                              ">= 5" if method == "torch.multiprocessing" else None,
                              _check(speedup, ">= 5") if method == "torch.multiprocessing"
                              else None, params))
    return figures


# -- 5. scaling ----------------------------------------------------------------------------------

SCALING_TOKENS = 1024  # 128 MiB of K/V per worker: more than the caches hold


def _child_scaling(conn, address: str) -> None:
    """One worker of the scaling run: control-plane ops or data-plane bytes until a deadline."""
    import torch
    from ..client import connect
    torch.set_num_threads(1)  # one thread per worker: the workers share the machine
    client = connect(address)
    cfg = client.config
    data = client.allocate(SCALING_TOKENS)
    kv = _pattern(cfg.num_layers * 2 * SCALING_TOKENS * cfg.num_kv_heads * cfg.head_dim,
                  client.pool.dtype).view(cfg.num_layers, 2, SCALING_TOKENS, cfg.num_kv_heads,
                                          cfg.head_dim)
    out = torch.zeros_like(kv)
    step_bytes = 2 * kv.numel() * kv.element_size()
    conn.send("ready")
    while True:
        command = _next_command(conn)
        if command is None:
            break
        kind, start, end = command
        time.sleep(max(0.0, start - time.monotonic()))
        count = 0
        if kind == "ops":
            handle = client.allocate(0)
            while time.monotonic() < end:
                handle.extend(1)
                count += 1
                if count % 256 == 0:
                    handle.close()
                    handle = client.allocate(0)
                    count += 2
            handle.close()
        else:
            while time.monotonic() < end:
                data.write_all(kv, 0)
                data.gather_all(out=out)
                count += step_bytes
        conn.send((count, time.monotonic() - start))
    client.close()


def bench_scaling(opts: Options, cleanup: _Cleanup, series: dict) -> List[Figure]:
    """Aggregate ops/s and bandwidth with several workers on one coordinator."""
    from ..coordinator import Coordinator
    counts = (1, 2, 4) if opts.quick else (1, 2, 4, 8)
    duration = 0.3 if opts.quick else 1.0
    repeats = 2 if opts.quick else 3
    cfg = _model_config(max(counts) * (SCALING_TOKENS // 16 + 40) + 64, 16)
    coord = cleanup.add(Coordinator.spawn(cfg, name=_unique("scaling"), timeout=120))
    workers = [cleanup.add(Helper("_child_scaling", coord.address, name=f"shmkv-bench-w{i}"))
               for i in range(max(counts))]
    points = []
    try:
        for w in workers:
            w.recv(180)
        results: Dict[tuple, List[float]] = {}
        for round_ in range(repeats + 1):  # round 0 warms up
            for kind in ("ops", "bw"):
                for n in counts:
                    start = time.monotonic() + 0.05
                    for w in workers[:n]:
                        w.send((kind, start, start + duration))
                    total = sum(w.recv(duration + 60)[0] for w in workers[:n])
                    if round_:
                        results.setdefault((kind, n), []).append(total / duration)
        for n in counts:
            points.append({"workers": n, "ops_per_s": _median(results[("ops", n)]),
                           "bytes_per_s": _median(results[("bw", n)])})
    finally:
        for w in workers:
            cleanup.remove(w)
        cleanup.remove(coord)
    series["scaling"] = points
    one = points[0]
    figures = []
    for p in points:
        figures.append(Figure("scaling", f"ops/s, {_workers(p['workers'])}", p["ops_per_s"],
                              "ops/s", one["ops_per_s"], "1 worker",
                              p["ops_per_s"] / one["ops_per_s"],
                              params={"op": "extend(1), allocate/close every 256"}))
    for p in points:
        figures.append(Figure("scaling", f"bandwidth, {_workers(p['workers'])}",
                              p["bytes_per_s"] / 1e9, "GB/s", one["bytes_per_s"] / 1e9,
                              "1 worker", p["bytes_per_s"] / one["bytes_per_s"],
                              params={"op": f"write_all + gather_all(out=) of {SCALING_TOKENS} "
                                            "tokens"}))
    return figures


def _workers(n: int) -> str:
    return f"{n} worker" + ("s" if n > 1 else "")


# -- 7. batched steps ------------------------------------------------------------------------

BATCH_SIZES = (1, 8, 64, 256)
BATCH_CONTEXT = 512          # tokens of context every decoding sequence has
BATCH_TP_SEQS = 64           # sequences of the tensor-parallel step
BATCH_PREFILL = (8, 512)     # prompts, tokens each
BATCH_CONTROL_SEQS = 256
_PROMPT = list(range(1, BATCH_CONTEXT + 1))  # the shared context's token ids


def _steps_per_run(num_seqs: int) -> int:
    """Decode steps per timed run: small batches take several, so that no run is a few
    hundred microseconds that one scheduler tick would swamp."""
    return max(1, 16 // num_seqs)


def _floor_rows(slot_mapping, num_layers: int, num_blocks: int, block_size: int):
    """``[2 * num_layers, T]``: the row, in the pool's storage as ``[rows, heads,
    head_dim]`` (layer-major: ``_rows``), of every layer's K and V of each slot (vLLM's
    reshape_and_cache arithmetic over per-layer caches, for the floor)."""
    import torch
    return (torch.arange(2 * num_layers)[:, None] * (num_blocks * block_size)
            + slot_mapping[None, :])


def _rows(pool, heads: int, head_dim: int):
    """A pool view (all heads, or a rank's shard) as ``[rows, heads, head_dim]`` in
    storage order, the rows :func:`_floor_rows` counts."""
    from ..memory import storage_view
    return storage_view(pool).view(-1, heads, head_dim)


def _sum_bits(t) -> int:
    """The sum of a tensor's elements read as integers: a checksum across processes."""
    import torch
    size = {2: torch.int16, 4: torch.int32}[t.element_size()]
    return int(t.contiguous().view(size).to(torch.int64).sum())


def _shared_context(client, context_kv) -> None:
    """Write and commit one prompt of ``BATCH_CONTEXT`` tokens, so that every sequence
    allocated later with the same prompt shares its blocks (prefix cache)."""
    first = client.allocate(prompt=_PROMPT)
    first.write_all(context_kv, 0)
    first.commit()


def _allocate_on_context(client, num_seqs: int) -> list:
    handles = client.allocate_many([{"prompt": _PROMPT}] * num_seqs)
    missed = [h for h in handles if h.num_cached_tokens != BATCH_CONTEXT]
    if missed:
        raise BenchError(f"prefix sharing failed: {len(missed)} of {num_seqs} sequences got "
                         f"{missed[0].num_cached_tokens} of {BATCH_CONTEXT} context tokens cached")
    return handles


def _decode_point(opts: Options, cleanup: _Cleanup, num_seqs: int, context_kv, kv_all) -> dict:
    """One batch size: a batched decode step, the per-handle path and the plain-torch
    floor, interleaved, on one pool whose sequences share a committed context."""
    import torch
    from ..client import connect
    from ..coordinator import Coordinator
    per_run = _steps_per_run(num_seqs)
    num_steps = per_run * (opts.repeats + 1) + 1  # + the checked step
    per_seq = -(-num_steps // 16) + 1
    cfg = _model_config(BATCH_CONTEXT // 16 + 2 * num_seqs * per_seq + 8)
    L, bs = cfg.num_layers, cfg.block_size
    coord = cleanup.add(Coordinator.spawn(cfg, name=_unique("batch"), timeout=120))
    client = connect(coord.address)
    try:
        # Steady state: every page of the pool written once through this client's mapping.
        # The first write to a 4 KiB page of a fresh pool allocates it, and the first touch
        # of a page through a process's own mapping faults it in; a decode step reaches a
        # new page per sequence, layer and K/V every other token, which would be timed for
        # shmkv and not for the floor (which writes the same slots again).
        client.pool.zero_()
        _shared_context(client, context_kv)
        batched = _allocate_on_context(client, num_seqs)
        single = _allocate_on_context(client, num_seqs)
        batch = client.batch(batched)
        kv = kv_all[:, :, :num_seqs]
        layers = [(kv[layer, 0], kv[layer, 1]) for layer in range(L)]
        # The per-handle path gets its one-token slices made in advance (generous to it).
        slices = [[(k[i:i + 1], v[i:i + 1]) for i in range(num_seqs)] for k, v in layers]
        items = [(h, 1) for h in single]

        step = batch.extend(1)  # checked step: the slots the floor writes again
        for layer, (k, v) in enumerate(layers):
            step.write(layer, k, v)
        client.extend_many(items)
        for layer in range(L):
            for h, (k, v) in zip(single, slices[layer]):
                h.write(layer, k, v)
        for handles in (batched, single):
            for i in {0, num_seqs // 2, num_seqs - 1}:
                got = handles[i].gather_all()[:, :, -1]
                if not _same_bits(got, kv[:, :, i]):
                    raise BenchError(f"decode step wrote wrong values (B={num_seqs}, seq {i})")
        rows = _rows(client.pool, cfg.num_kv_heads, cfg.head_dim)
        floor_index = _floor_rows(step.slot_mapping, L, cfg.num_blocks, bs)
        wide_rows = rows.view(torch.complex128)  # 16-byte elements: what shmkv's writes use
        wide = [(k.view(torch.complex128), v.view(torch.complex128)) for k, v in layers]
        extend_s: List[float] = []

        def batch_step():
            for _ in range(per_run):
                t0 = time.perf_counter()
                step = batch.extend(1)
                step.block_tables, step.slot_mapping  # what an attention kernel takes
                extend_s.append(time.perf_counter() - t0)
                for layer, (k, v) in enumerate(layers):
                    step.write(layer, k, v)

        def per_handle():
            for _ in range(per_run):
                client.extend_many(items)
                for layer in range(L):
                    for h, (k, v) in zip(single, slices[layer]):
                        h.write(layer, k, v)

        def floor(rows=rows, sources=layers):
            for _ in range(per_run):
                for layer, (k, v) in enumerate(sources):
                    rows.index_copy_(0, floor_index[2 * layer], k)
                    rows.index_copy_(0, floor_index[2 * layer + 1], v)

        times = interleaved({"batch": batch_step, "per_handle": per_handle, "floor": floor,
                             "floor_16b": lambda: floor(wide_rows, wide)}, opts.repeats)
        point = {"batch_size": num_seqs, "steps_per_run": per_run, "num_blocks": cfg.num_blocks,
                 "context_blocks": BATCH_CONTEXT // bs,
                 "bytes_per_step": 2 * L * num_seqs * cfg.num_kv_heads * cfg.head_dim
                 * cfg.itemsize}
        for name, samples in times.items():
            point[name + "_s"] = _median(samples) / per_run
        point["extend_s"] = _median(extend_s[per_run:])  # the warm-up round left out
        point["write_s"] = point["batch_s"] - point["extend_s"]
        return point
    finally:
        client.close()
        cleanup.remove(coord)


def _child_tp_rank(conn, address: str, num_seqs: int, threads: int) -> None:
    """Tensor-parallel rank 1: rebuild each step rank 0 made from its descriptor and
    write this rank's head shard; reports how long each part took."""
    import torch
    from ..client import connect
    torch.set_num_threads(threads)
    client = connect(address, tp_rank=1, tp_size=2)
    cfg, pool = client.config, client.pool
    L, H, D = cfg.num_layers, pool.shape[4], pool.shape[5]
    context = _pattern(L * 2 * BATCH_CONTEXT * H * D, pool.dtype).view(L, 2, BATCH_CONTEXT, H, D)
    kv = _pattern(L * 2 * num_seqs * H * D, pool.dtype).view(L, 2, num_seqs, H, D)
    layers = [(kv[layer, 0], kv[layer, 1]) for layer in range(L)]
    pool.zero_()  # this rank's heads: its own mapping of every page (see _decode_point)
    conn.send(("ready", _sum_bits(context), _sum_bits(kv)))
    try:
        while True:
            command = _next_command(conn)
            if command is None:
                return
            kind, descriptor = command
            t0 = time.perf_counter()
            step = client.step_from(descriptor)
            step.block_tables, step.slot_mapping
            t1 = time.perf_counter()
            if kind == "prefill":
                step.write_all(context)
                step.commit()
            else:
                for layer, (k, v) in enumerate(layers):
                    step.write(layer, k, v)
            conn.send((t1 - t0, time.perf_counter() - t0))
    finally:
        client.close()


def _tp_point(opts: Options, cleanup: _Cleanup) -> dict:
    """A 2-rank tensor-parallel decode step: rank 0 (this process) makes the round trip
    and sends the descriptor; rank 1 (a spawned process) rebuilds the step; each writes
    its 4 of the 8 heads. Against the floor of one rank's shard."""
    import torch
    from ..client import connect
    from ..coordinator import Coordinator
    num_seqs, repeats = BATCH_TP_SEQS, 3 * opts.repeats  # steps of a few ms: more runs
    cfg = _model_config(BATCH_CONTEXT // 16 + num_seqs * (-(-(repeats + 2) // 16) + 1) + 8,
                        tp_size=2)
    L, bs, D = cfg.num_layers, cfg.block_size, cfg.head_dim
    coord = cleanup.add(Coordinator.spawn(cfg, name=_unique("batch-tp"), timeout=120))
    rank1 = cleanup.add(Helper("_child_tp_rank", coord.address, num_seqs, opts.threads,
                               name="shmkv-bench-tp1"))
    client = connect(coord.address, tp_rank=0, tp_size=2)
    viewer = connect(coord.address)  # all heads: checks what both ranks wrote
    try:
        client.pool.zero_()  # steady state in this process's mapping (see _decode_point)
        _, context_sum, kv_sum = rank1.recv(180)
        H = client.pool.shape[4]
        context = _pattern(L * 2 * BATCH_CONTEXT * H * D, client.pool.dtype).view(
            L, 2, BATCH_CONTEXT, H, D)
        kv = _pattern(L * 2 * num_seqs * H * D, client.pool.dtype).view(L, 2, num_seqs, H, D)
        layers = [(kv[layer, 0], kv[layer, 1]) for layer in range(L)]
        # The shared context: prefilled by both ranks, published once both committed.
        first = client.allocate(prompt=_PROMPT)
        step = client.batch([first]).prefill()
        rank1.send(("prefill", step.descriptor()))
        step.write_all(context)
        step.commit()
        rank1.recv(60)
        handles = _allocate_on_context(client, num_seqs)
        batch = client.batch(handles)

        def tp_step() -> dict:
            t0 = time.perf_counter()
            step = batch.extend(1)
            step.block_tables, step.slot_mapping
            t1 = time.perf_counter()
            rank1.send(("step", step.descriptor()))
            for layer, (k, v) in enumerate(layers):
                step.write(layer, k, v)
            t2 = time.perf_counter()
            from_s, rank1_s = rank1.recv(60)
            return {"step": step, "extend_s": t1 - t0, "rank0_s": t2 - t0,
                    "step_from_s": from_s, "rank1_s": rank1_s,
                    "end_to_end_s": time.perf_counter() - t0}

        checked = tp_step()
        slot_mapping = checked["step"].slot_mapping
        index = _floor_rows(slot_mapping, L, cfg.num_blocks, bs)
        full_rows = _rows(viewer.pool, cfg.num_kv_heads, D)
        written = torch.stack([full_rows[index[j]] for j in range(2 * L)]).view(
            L, 2, num_seqs, cfg.num_kv_heads, D)
        if not (_same_bits(written[..., :H, :], kv) and _sum_bits(written[..., H:, :]) == kv_sum):
            raise BenchError("tensor-parallel step: a rank's shard holds wrong values")
        blocks = torch.tensor(first.block_table.physical_blocks, dtype=torch.int64)
        positions = torch.arange(BATCH_CONTEXT)
        context_index = _floor_rows(blocks[positions // bs] * bs + positions % bs, L,
                                    cfg.num_blocks, bs)
        shared = torch.stack([full_rows[context_index[j]] for j in range(2 * L)]).view(
            L, 2, BATCH_CONTEXT, cfg.num_kv_heads, D)
        if not (_same_bits(shared[..., :H, :], context)
                and _sum_bits(shared[..., H:, :]) == context_sum):
            raise BenchError("tensor-parallel prefill: a rank's shard of the context is wrong")
        del written, shared
        rows = _rows(client.pool, H, D)  # rank 0's shard: strided rows of 4 heads

        def floor():
            for layer, (k, v) in enumerate(layers):
                rows.index_copy_(0, index[2 * layer], k)
                rows.index_copy_(0, index[2 * layer + 1], v)

        samples: Dict[str, List[float]] = {}
        floor_s: List[float] = []
        for round_ in range(repeats + 1):
            for which in ((0, 1) if round_ % 2 else (1, 0)):
                if which:
                    t0 = time.perf_counter()
                    floor()
                    if round_:
                        floor_s.append(time.perf_counter() - t0)
                else:
                    result = tp_step()
                    if round_:
                        for key, value in result.items():
                            if key != "step":
                                samples.setdefault(key, []).append(value)
        point = {key: _median(values) for key, values in samples.items()}
        point.update(batch_size=num_seqs, floor_s=_median(floor_s), heads_per_rank=H)
        return point
    finally:
        viewer.close()
        client.close()
        cleanup.remove(rank1)
        cleanup.remove(coord)


def _prefill_point(opts: Options, cleanup: _Cleanup) -> dict:
    """8 prompts of 512 tokens written through ``batch.prefill()`` (``write_all`` and 32
    per-layer writes) against ``copy_`` of the same bytes between two tensors."""
    import torch
    from ..client import connect
    from ..coordinator import Coordinator
    num_prompts, tokens = BATCH_PREFILL
    cfg = _model_config(num_prompts * tokens // 16 + 8)
    L, H, D = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
    coord = cleanup.add(Coordinator.spawn(cfg, name=_unique("batch-prefill"), timeout=120))
    client = connect(coord.address)
    try:
        client.pool.zero_()  # steady state (see _decode_point)
        total = num_prompts * tokens
        kv = _pattern(L * 2 * total * H * D, client.pool.dtype).view(L, 2, total, H, D)
        dst = torch.zeros_like(kv)
        # Distinct prompts: nothing is cached, every token is written.
        handles = client.allocate_many(
            [{"prompt": list(range(1 + i * tokens, 1 + (i + 1) * tokens))}
             for i in range(num_prompts)])
        batch = client.batch(handles)
        step = batch.prefill()
        if step.num_tokens != total:
            raise BenchError(f"prefill step covers {step.num_tokens} tokens, expected {total}")
        step.write_all(kv)
        for i in (0, num_prompts - 1):
            if not _same_bits(handles[i].gather_all(), kv[:, :, i * tokens:(i + 1) * tokens]):
                raise BenchError(f"prefill wrote wrong values (prompt {i})")
        layers = [(kv[layer, 0], kv[layer, 1]) for layer in range(L)]

        def per_layer():
            step = batch.prefill()
            for layer, (k, v) in enumerate(layers):
                step.write(layer, k, v)

        times = interleaved({"copy": lambda: dst.copy_(kv),
                             "write_all": lambda: batch.prefill().write_all(kv),
                             "write": per_layer,
                             "prefill_only": batch.prefill},
                            3 * opts.repeats)  # copies share memory bandwidth: more runs
        nbytes = kv.numel() * kv.element_size()
        point = {"prompts": num_prompts, "tokens": tokens, "bytes": nbytes}
        for name, samples in times.items():
            point[name + "_s"] = _median(samples)
        return point
    finally:
        client.close()
        cleanup.remove(coord)


def _codec_fn(op: str, args: dict, result) -> Callable[[], None]:
    """Both sides' msgpack work for one request: encode, decode and validate the request,
    encode and decode the answer (no socket)."""
    from .. import protocol

    def run():
        request = protocol.encode_request(7, op, args)
        protocol.parse_request(next(protocol.FrameDecoder(1 << 30).feed(request)))
        answer = protocol.encode_ok(7, result)
        protocol.parse_response(next(protocol.FrameDecoder(1 << 30).feed(answer))).unwrap()
    return run


def _control_point(opts: Options, cleanup: _Cleanup) -> dict:
    """``allocate_many`` + ``close_many`` of 256 one-block sequences, and ``batch.extend(1)``
    over 256 sequences against ``ping``, with the coordinator in its own process.

    To show where the time goes, the coordinator's part runs in this process on a
    ``SequenceTable``, called the way the coordinator's handlers call it (packed
    lengths to ``allocate_counts``, ``extend_batch`` with the batch's table rows), and
    both sides' msgpack work is timed on the same messages. ``request`` is the raw
    ``extend_batch`` request ``batch.extend`` sends, without building the ``Step``.
    """
    from .. import protocol
    from ..allocator import BlockPool
    from ..client import connect
    from ..coordinator import Coordinator
    from ..layout import PoolConfig
    from ..sequences import SequenceTable
    num = BATCH_CONTROL_SEQS
    # The coordinator's work does not depend on block bytes: a tiny block keeps the pool small.
    cfg = PoolConfig(num_layers=1, num_kv_heads=1, head_dim=8, num_blocks=65536, block_size=16,
                     dtype="float16", max_sequences=2048, max_seq_len=16384)
    bs = cfg.block_size
    coord = cleanup.add(Coordinator.spawn(cfg, name=_unique("batch-control"), timeout=120))
    client = connect(coord.address)
    table = SequenceTable(BlockPool(cfg.num_blocks), bs, max_sequences=cfg.max_sequences,
                          max_seq_blocks=cfg.max_seq_blocks)
    table.add_connection(1)
    point: dict = {"batch_size": num}
    try:
        budget = 0.05 if opts.quick else 0.15
        packed = protocol.pack_i64s([1] * num)
        ids, slot_ids = table.allocate_counts(1, protocol.unpack_i64s(packed))
        table.release_many(1, protocol.unpack_i64s(protocol.pack_i64s(ids)))

        def cycle(c):   # allocate_many + close_many on client c
            return lambda: c.close_many(c.allocate_many([1] * num))

        def pings(c):   # two pings (the two round trips of a cycle)
            return lambda: (c.ping(), c.ping())

        remote = cycle(client)

        def remote_posted():   # the release is not waited for (served before the next)
            client.close_many(client.allocate_many([1] * num), wait=False)

        def in_process():  # called the way the coordinator's handlers call it
            ids, _slots = table.allocate_counts(1, protocol.unpack_i64s(packed))
            table.release_many(1, protocol.unpack_i64s(protocol.pack_i64s(ids)))

        alloc_codec = _codec_fn("allocate_many", {"counts": packed},
                                protocol.pack_i64s(ids) + protocol.pack_i64s(slot_ids))
        release_codec = _codec_fn("release_many", {"ids": protocol.pack_i64s(ids)}, None)

        def codec():
            alloc_codec()
            release_codec()

        two_pings = pings(client)

        # The same against a coordinator that never polls for the next request
        # (spin_us=0), side by side: what the loop's polling is worth here.
        still = cleanup.add(Coordinator.spawn(cfg, name=_unique("batch-control-still"),
                                              timeout=120, spin_us=0))
        still_client = connect(still.address)

        # Calls of a few hundred microseconds on a shared machine: twice the usual runs.
        try:
            rates = _rates({"remote": remote, "posted": remote_posted, "table": in_process,
                            "codec": codec, "ping": two_pings, "still": cycle(still_client),
                            "still_ping": pings(still_client)}, num, budget, 2 * opts.repeats)
        finally:
            still_client.close()
            cleanup.remove(still)
        client.flush()
        point["alloc_still_blocks_per_s"] = rates["still"]
        point["ping_still_s"] = num / rates["still_ping"] / 2
        point["ping_s"] = num / rates["ping"] / 2
        point["alloc_blocks_per_s"] = rates["remote"]
        point["alloc_posted_blocks_per_s"] = rates["posted"]
        for name in ("remote", "table", "codec", "ping"):  # seconds per allocate+close pair
            point[f"alloc_{name}_s"] = num / rates[name]

        # -- batch.extend(1) over 256 sequences
        handles = client.allocate_many([0] * num)
        batch = client.batch(handles)
        # What batch.extend(1) sends once the coordinator keeps the batch, on a second
        # connection (a connection's other steps over its sequences would make every
        # step of the kept batch a checked one).
        raw_client = connect(coord.address)
        raw_batch = raw_client.batch(raw_client.allocate_many([0] * num))
        kept = raw_client.request("extend_batch", ids=raw_batch._ids_wire, count=1,
                                  slots=raw_batch._slots_wire, keep=True)["batch"]
        raw = {"seen": 0}
        # The same over sequences allocated with prompts, as an engine's are (objects
        # with prefix keys in the coordinator), on a connection of their own.
        prompt_client = connect(coord.address)
        prompt_batch = prompt_client.batch(prompt_client.allocate_many(
            [{"prompt": list(range(i * 64, i * 64 + 40))} for i in range(num)]))
        prompt_batch.extend(1)

        def request():
            raw["seen"] = raw_client.request("extend_kept", batch=kept, count=1,
                                             seen=raw["seen"])["steps"]

        # The coordinator's part, called the way its handler calls it.
        table_ids, _ = table.allocate_counts(1, protocol.unpack_i64s(
            protocol.pack_i64s([0] * num)))
        table_kept = table.keep_batch(1, protocol.unpack_i64s(protocol.pack_i64s(table_ids)))
        at = {"seen": 0}

        def in_table():
            at["seen"] = table.extend_kept(1, table_kept, 1, at["seen"])["steps"]

        answer = table.extend_kept(1, table_kept, 1, 0)
        ext_codec = _codec_fn("extend_kept", {"batch": table_kept, "count": 1, "seen": 1},
                              {"steps": 2, "same": True,
                               "grown": protocol.pack_i64s(answer["grown"]),
                               "blocks": protocol.pack_i64s(answer["blocks"])})
        at["seen"] = answer["steps"]
        calls, repeats = 50, 3 * opts.repeats  # every call adds a token to each sequence
        total_calls = (repeats + 1) * calls
        if 2 * total_calls + 2 > cfg.max_seq_len:
            raise BenchError("batch control: too many steps for max_seq_len; lower --repeats")

        def looped(fn):
            def run():
                for _ in range(calls):
                    fn()
            return run

        try:
            times = interleaved({
                "extend": looped(lambda: batch.extend(1)),
                "prompt": looped(lambda: prompt_batch.extend(1)),
                "request": looped(request),
                "ping": looped(client.ping),
                "table": looped(in_table),
                "codec": looped(ext_codec)}, repeats)
        finally:
            raw_client.close()
            prompt_client.close()
        for name, samples in times.items():
            point[f"extend_{name}_s"] = _median(samples) / calls
        # The same against ping with client and coordinator pinned: on one CPU (every
        # round trip is a context switch there) and on two (the placement an engine has,
        # its scheduler on one core, the coordinator on another).
        cpus = sorted(os.sched_getaffinity(0))
        placements = [("same CPU", cpus[0], cpus[0])]
        if len(cpus) > 1:
            placements.append(("2 CPUs", cpus[0], cpus[1]))
        point["placements"] = {}
        try:
            for place, client_cpu, server_cpu in placements:
                client.close_many(handles)  # fresh sequences: the pool stays big enough
                handles = client.allocate_many([0] * num)
                batch = client.batch(handles)
                os.sched_setaffinity(0, {client_cpu})
                os.sched_setaffinity(coord.pid, {server_cpu})
                pinned = interleaved({"extend": looped(lambda: batch.extend(1)),
                                      "ping": looped(client.ping),
                                      "alloc": looped(remote),
                                      "alloc_posted": looped(remote_posted)}, repeats)
                client.flush()
                point["placements"][place] = {name: _median(v) / calls
                                              for name, v in pinned.items()}
        finally:
            os.sched_setaffinity(0, cpus)
            os.sched_setaffinity(coord.pid, cpus)
        client.close_many(handles)
        return point
    finally:
        client.close()
        cleanup.remove(coord)


def bench_batch(opts: Options, cleanup: _Cleanup, series: dict, cache: dict) -> List[Figure]:
    """Batched engine steps (``client.batch``): decode against the plain-torch floor and
    the per-handle path, a 2-rank tensor-parallel step, prefill, and a step's control plane."""
    import torch
    probe = _model_config(1)
    L, H, D = probe.num_layers, probe.num_kv_heads, probe.head_dim
    dtype = getattr(torch, probe.dtype)
    context_kv = _pattern(L * 2 * BATCH_CONTEXT * H * D, dtype).view(L, 2, BATCH_CONTEXT, H, D)
    kv_all = _pattern(L * 2 * max(BATCH_SIZES) * H * D, dtype).view(L, 2, max(BATCH_SIZES), H, D)
    decode = [_decode_point(opts, cleanup, b, context_kv, kv_all) for b in BATCH_SIZES]
    del context_kv, kv_all
    tp = _tp_point(opts, cleanup)
    prefill = _prefill_point(opts, cleanup)
    control = _control_point(opts, cleanup)
    series["batch"] = {"decode": decode, "tp": tp, "prefill": prefill, "control": control}
    cache.setdefault("notes", []).append(
        f"batch: the decode sequences share one committed {BATCH_CONTEXT}-token context "
        f"({BATCH_CONTEXT // 16} blocks, prefix cache) instead of {BATCH_CONTEXT} tokens each "
        "(256 x 512 tokens would take 17 GB); every pool is written once before timing "
        "(steady state, no first-touch page faults)")

    figures = []
    for p in decode:
        b = p["batch_size"]
        target = "<= 1.5" if b >= 64 else None
        ratio = p["batch_s"] / p["floor_s"]
        params = {"extend_ms": p["extend_s"] * 1e3, "write_ms": p["write_s"] * 1e3,
                  "floor_16byte_ms": p["floor_16b_s"] * 1e3,
                  "ratio_to_16byte_floor": p["batch_s"] / p["floor_16b_s"],
                  "steps_per_run": p["steps_per_run"], "bytes_per_step": p["bytes_per_step"]}
        figures.append(Figure("batch", f"decode step B={b} (extend(1) + 32 layers)",
                              p["batch_s"] * 1e3, "ms", p["floor_s"] * 1e3, "plain index_copy_",
                              ratio, target, _check(ratio, target) if target else None,
                              params=params))
    for p in decode:
        figures.append(Figure("batch", f"per-handle step B={p['batch_size']} (extend_many + "
                                       "h.write)", p["per_handle_s"] * 1e3, "ms",
                              p["batch_s"] * 1e3, "batch step", p["per_handle_s"] / p["batch_s"]))
    figures.append(Figure("batch", f"TP rank 0 step B={tp['batch_size']} (extend + descriptor "
                                   "+ 4-head writes)", tp["rank0_s"] * 1e3, "ms",
                          tp["floor_s"] * 1e3, "plain index_copy_ of the shard",
                          tp["rank0_s"] / tp["floor_s"]))
    figures.append(Figure("batch", f"TP rank 1 step B={tp['batch_size']} (step_from + 4-head "
                                   "writes)", tp["rank1_s"] * 1e3, "ms",
                          tp["floor_s"] * 1e3, "plain index_copy_ of the shard",
                          tp["rank1_s"] / tp["floor_s"]))
    figures.append(Figure("batch", f"TP step_from B={tp['batch_size']}",
                          tp["step_from_s"] * 1e6, "us", tp["extend_s"] * 1e6,
                          "batch.extend(1) round trip", tp["step_from_s"] / tp["extend_s"],
                          params={"end_to_end_ms": tp["end_to_end_s"] * 1e3}))
    for name, label in (("write_all", "write_all"), ("write", "32 per-layer writes")):
        rate, base = prefill["bytes"] / prefill[name + "_s"], prefill["bytes"] / prefill["copy_s"]
        figures.append(Figure("batch", f"prefill 8x512 prefill() + {label}", rate / 1e9, "GB/s",
                              base / 1e9, "copy_ of the same bytes", rate / base, ">= 0.8",
                              _check(rate / base, ">= 0.8"),
                              params={"prefill_round_trip_ms": prefill["prefill_only_s"] * 1e3}))
    c = control
    table_rate = BATCH_CONTROL_SEQS / c["alloc_table_s"]
    figures.append(Figure("batch", "allocate_many([1]*256) + close_many", c["alloc_blocks_per_s"],
                          "blocks/s", table_rate, "SequenceTable in process",
                          c["alloc_blocks_per_s"] / table_rate, ">= 500000",
                          _check(c["alloc_blocks_per_s"], ">= 500000"), "value",
                          params=_split(c, "alloc")))
    if "alloc_posted_blocks_per_s" in c:
        rate = c["alloc_posted_blocks_per_s"]
        figures.append(Figure("batch", "allocate_many([1]*256) + close_many(wait=False)", rate,
                              "blocks/s", table_rate, "SequenceTable in process",
                              rate / table_rate, ">= 500000", _check(rate, ">= 500000"),
                              "value"))
    if "alloc_still_blocks_per_s" in c:
        rate = c["alloc_still_blocks_per_s"]
        figures.append(Figure("batch", "allocate_many([1]*256) + close_many, coordinator not "
                              "polling (spin_us=0)", rate, "blocks/s", c["alloc_blocks_per_s"],
                              "the same, polling (spin_us default)",
                              rate / c["alloc_blocks_per_s"]))
        figures.append(Figure("batch", "ping, coordinator not polling (spin_us=0)",
                              c["ping_still_s"] * 1e6, "us", c["ping_s"] * 1e6,
                              "ping, polling (spin_us default)",
                              c["ping_still_s"] / c["ping_s"]))
    ratio = c["extend_extend_s"] / c["extend_ping_s"]
    figures.append(Figure("batch", "batch.extend(1), 256 sequences", c["extend_extend_s"] * 1e6,
                          "us", c["extend_ping_s"] * 1e6, "ping", ratio, "<= 3",
                          _check(ratio, "<= 3"), params=_split(c, "extend")))
    if "extend_prompt_s" in c:
        ratio = c["extend_prompt_s"] / c["extend_ping_s"]
        figures.append(Figure("batch", "batch.extend(1), 256 prompt-allocated sequences",
                              c["extend_prompt_s"] * 1e6, "us", c["extend_ping_s"] * 1e6,
                              "ping", ratio, "<= 3", _check(ratio, "<= 3")))
    for place, pinned in c.get("placements", {}).items():
        if "alloc" in pinned:
            rate = BATCH_CONTROL_SEQS / pinned["alloc"]
            figures.append(Figure("batch", f"allocate_many([1]*256) + close_many, {place}",
                                  rate, "blocks/s", BATCH_CONTROL_SEQS / pinned["ping"] / 2,
                                  f"blocks/s if it cost two pings, {place}",
                                  pinned["ping"] * 2 / pinned["alloc"], ">= 500000",
                                  _check(rate, ">= 500000"), "value"))
        if "alloc_posted" in pinned:
            rate = BATCH_CONTROL_SEQS / pinned["alloc_posted"]
            figures.append(Figure("batch", "allocate_many([1]*256) + close_many(wait=False), "
                                  + place, rate, "blocks/s",
                                  BATCH_CONTROL_SEQS / pinned["ping"] / 2,
                                  f"blocks/s if it cost two pings, {place}",
                                  pinned["ping"] * 2 / pinned["alloc_posted"], ">= 500000",
                                  _check(rate, ">= 500000"), "value"))
        ratio = pinned["extend"] / pinned["ping"]
        figures.append(Figure("batch", f"batch.extend(1), 256 sequences, {place}",
                              pinned["extend"] * 1e6, "us", pinned["ping"] * 1e6,
                              f"ping, {place}", ratio, "<= 3", _check(ratio, "<= 3")))
    for part, label in (("table", "coordinator: SequenceTable.extend_kept, in process"),
                        ("codec", "msgpack, both sides, in process"),
                        ("request", "client.request of a kept batch only (no Step built)")):
        figures.append(Figure("batch", f"  extend(1) x256 part: {label}",
                              c[f"extend_{part}_s"] * 1e6, "us", c["extend_extend_s"] * 1e6,
                              "batch.extend(1)", c[f"extend_{part}_s"] / c["extend_extend_s"]))
    return figures


def _split(c: dict, prefix: str) -> dict:
    """Where a control-plane call's time goes, in microseconds."""
    total = c[f"{prefix}_remote_s" if prefix == "alloc" else f"{prefix}_extend_s"]
    ping = c[f"{prefix}_ping_s"]
    out = {"total_us": total * 1e6, "table_us": c[f"{prefix}_table_s"] * 1e6,
           "codec_us": c[f"{prefix}_codec_s"] * 1e6, "ping_us": ping * 1e6}
    if prefix == "extend":
        out["step_build_us"] = (total - c["extend_request_s"]) * 1e6
        rest = c["extend_request_s"] - c["extend_table_s"] - c["extend_codec_s"] - ping
    else:
        rest = total - c["alloc_table_s"] - c["alloc_codec_s"] - ping
    out["other_us"] = rest * 1e6
    return out


# -- report ---------------------------------------------------------------------------------

def _fmt(value: Optional[float]) -> str:
    if value is None:
        return "-"
    if value == 0:
        return "0"
    magnitude = abs(value)
    if magnitude >= 1e5:
        return f"{value:,.0f}"
    if magnitude >= 100:
        return f"{value:.0f}"
    if magnitude >= 1:
        return f"{value:.2f}"
    return f"{value:.3g}"


def table_rows(figures: List[Figure]) -> List[List[str]]:
    """The printed table: figure, value, baseline, ratio, target, met?"""
    rows = [["section", "figure", "value", "baseline", "ratio", "target", "met?"]]
    for f in figures:
        baseline = "-" if f.baseline is None else f"{_fmt(f.baseline)} {f.unit} ({f.baseline_name})"
        met = "-" if f.met is None else ("yes" if f.met else "NO")
        target = f.target or "-"
        if f.target and f.target_of == "value":
            target = f"{f.target.split()[0]} {_fmt(float(f.target.split()[1]))} {f.unit}"
        rows.append([f.section, f.name, f"{_fmt(f.value)} {f.unit}", baseline,
                     "-" if f.ratio is None else _fmt(f.ratio), target, met])
    return rows


def format_table(figures: List[Figure]) -> str:
    """The table as aligned text."""
    rows = table_rows(figures)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_markdown(figures: List[Figure], series: dict) -> str:
    """The table as Markdown, followed by the data-plane ratio grid."""
    rows = table_rows(figures)
    out = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    out += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows[1:]]
    points = series.get("data")
    if points:
        lengths = sorted({p["n"] for p in points})
        out += ["", "Data plane, ratio to the contiguous copy, per block size and sequence "
                    "length:", "",
                "| op | block size | " + " | ".join(f"n={n}" for n in lengths) + " |",
                "|---|---|" + "---|" * len(lengths)]
        for op, label, base, _target in DATA_OPS:
            for bs in sorted({p["block_size"] for p in points}):
                by_n = {p["n"]: p[op + "_ratio"] for p in points if p["block_size"] == bs}
                out.append(f"| {label} | {bs} | " + " | ".join(
                    f"{by_n[n]:.2f}" if n in by_n else "-" for n in lengths) + " |")
        for base, ref in _REFERENCE.items():
            for bs in sorted({p["block_size"] for p in points}):
                by_n = {p["n"]: p[ref] / p[base] for p in points if p["block_size"] == bs}
                out.append(f"| reference: {ref.replace('_', ' ')} (fresh tensor) | {bs} | "
                           + " | ".join(f"{by_n[n]:.2f}" if n in by_n else "-"
                                        for n in lengths) + " |")
    batch = series.get("batch")
    if batch:
        out += ["", "Batched decode step, milliseconds per step (32 layers, 8 KV heads x 128, "
                    "bfloat16, block size 16, 512-token shared context):", "",
                "| B | floor (bf16 rows) | floor (16-byte rows) | batch step | of which "
                "extend(1) | per-handle | batch / floor | per-handle / batch |",
                "|---|---|---|---|---|---|---|---|"]
        for p in batch["decode"]:
            out.append(f"| {p['batch_size']} | {p['floor_s'] * 1e3:.3f} | "
                       f"{p['floor_16b_s'] * 1e3:.3f} | {p['batch_s'] * 1e3:.3f} | "
                       f"{p['extend_s'] * 1e3:.3f} | {p['per_handle_s'] * 1e3:.3f} | "
                       f"{p['batch_s'] / p['floor_s']:.2f} | "
                       f"{p['per_handle_s'] / p['batch_s']:.1f} |")
        c = batch["control"]
        out += ["", "Where a control-plane call goes (microseconds; table and msgpack timed in "
                    "process, wire = ping round trips, other = the rest):", "",
                "| call | total | coordinator table | msgpack, both sides | wire (ping) | "
                "other | Step built by the client |", "|---|---|---|---|---|---|---|"]
        for prefix, label in (("alloc", "allocate_many([1]*256) + close_many"),
                              ("extend", "batch.extend(1), 256 sequences")):
            split = _split(c, prefix)
            out.append(f"| {label} | {split['total_us']:.0f} | {split['table_us']:.0f} | "
                       f"{split['codec_us']:.0f} | {split['ping_us']:.0f} | "
                       f"{split['other_us']:.0f} | "
                       + (f"{split['step_build_us']:.0f} |" if "step_build_us" in split
                          else "- |"))
    return "\n".join(out)


def draw_plots(series: dict, plot_dir: str, name: str) -> List[str]:
    """One PNG per measured section; returns the paths written."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(plot_dir, exist_ok=True)
    written = []

    def save(fig, section):
        path = os.path.join(plot_dir, f"{name}-{section}.png")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    if "data" in series:
        points = series["data"]
        fig, axes = plt.subplots(3, 2, figsize=(11, 11), sharex=True)
        for ax, (op, label, base, target) in zip(axes.flat, DATA_OPS):
            bound = float(target.split()[1])
            for i, bs in enumerate(sorted({p["block_size"] for p in points})):
                rows = sorted((p for p in points if p["block_size"] == bs), key=lambda p: p["n"])
                ax.plot([p["n"] for p in rows], [p[op + "_ratio"] for p in rows], marker="o",
                        color=f"C{i}", label=f"block size {bs}")
                if op in ("gather_all", "key_cache"):
                    ax.plot([p["n"] for p in rows], [p[_REFERENCE[base]] / p[base] for p in rows],
                            color=f"C{i}", linestyle=":", alpha=0.6,
                            label=f"clone (fresh tensor), bs {bs}" if i == 0 else None)
            ax.axhline(bound, color="red", linestyle="--", label=f"target {bound}")
            ax.set_xscale("log", base=2)
            ax.set_title(f"{label} / {base.replace('_', ' ')}")
            ax.set_xlabel("sequence length (tokens)")
            ax.set_ylabel("bandwidth ratio")
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
        axes.flat[0].legend(fontsize=8)
        axes.flat[4].legend(fontsize=7)
        save(fig, "data")
    if "attach" in series:
        points = series["attach"]
        fig, ax = plt.subplots(figsize=(6, 4))
        x = [p["pool_bytes"] / MIB for p in points]
        ax.plot(x, [p["warm_s"] * 1e3 for p in points], marker="o", label="attach (median)")
        ax.plot(x, [p["baseline_s"] * 1e3 for p in points], marker=".", alpha=0.6,
                label=f"{_size(points[0]['pool_bytes'])} pool, timed alternately")
        ax.plot(x, [p["cold_s"] * 1e3 for p in points], marker="x", linestyle=":",
                label="first attach in the process")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("pool size (MiB)")
        ax.set_ylabel("shmkv.connect (ms)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend()
        save(fig, "attach")
    if "latency" in series or "throughput" in series:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        if "latency" in series:
            labels, p50, p99 = [], [], []
            for place, lat in series["latency"].items():
                for kind, values in lat.items():
                    labels.append(f"{kind}\n{place}")
                    p50.append(_percentile(values, 50))
                    p99.append(_percentile(values, 99))
            x = range(len(labels))
            axes[0].bar([i - 0.2 for i in x], p50, width=0.4, label="p50")
            axes[0].bar([i + 0.2 for i in x], p99, width=0.4, label="p99")
            axes[0].set_xticks(list(x), labels, fontsize=7)
            axes[0].set_ylabel("round trip (us)")
            axes[0].set_title("one request (echo = raw msgpack server)")
            axes[0].legend()
        if "throughput" in series:
            rows = series["throughput"]
            for kind in ("allocate_many+close_many", "allocate+close", "BlockPool"):
                axes[1].plot([r["batch"] for r in rows], [r[kind] for r in rows], marker="o",
                             label=kind)
            axes[1].axhline(500000, color="red", linestyle="--", label="target (batch >= 256)")
            axes[1].set_xscale("log", base=2)
            axes[1].set_yscale("log")
            axes[1].set_xlabel("blocks per call")
            axes[1].set_ylabel("blocks allocated + freed per s")
            axes[1].legend(fontsize=8)
            axes[1].grid(alpha=0.3)
        save(fig, "control")
    if "handoff" in series:
        med = series["handoff"]["median_s"]
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.bar(list(med), [v * 1e3 for v in med.values()], color=["C0", "C1", "C2"])
        ax.set_ylabel("end to end (ms)")
        ax.set_title(f"hand-off of {series['handoff']['bytes'] / MIB:.0f} MiB of K/V")
        save(fig, "handoff")
    if "scaling" in series:
        points = series["scaling"]
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        n = [p["workers"] for p in points]
        axes[0].plot(n, [p["ops_per_s"] for p in points], marker="o")
        axes[0].set_ylabel("aggregate ops/s")
        axes[1].plot(n, [p["bytes_per_s"] / 1e9 for p in points], marker="o")
        axes[1].set_ylabel("aggregate GB/s (write_all + gather_all(out=))")
        for ax in axes:
            ax.set_xlabel("worker processes")
            ax.set_xscale("log", base=2)
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
        save(fig, "scaling")
    if "memory" in series:
        points = series["memory"]
        fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
        x = [p["pool_bytes"] / MIB for p in points]
        for ax, who in zip(axes, ("coordinator", "worker")):
            keys = ["coordinator"] if who == "coordinator" else ["worker_attached",
                                                                  "worker_touched"]
            for key in keys:
                if points[0][key] is None:
                    continue
                for kind, style in (("rss", "-"), ("uss", "--"), ("anon", ":")):
                    ax.plot(x, [p[key][kind] / MIB for p in points], marker="o",
                            linestyle=style, label=f"{key.replace('_', ' ')} {kind.upper()}")
            ax.plot(x, x, color="grey", alpha=0.4, label="pool size")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log", base=2)
            ax.set_xlabel("pool size (MiB)")
            ax.set_ylabel("MiB")
            ax.set_title(who)
            ax.legend(fontsize=7)
            ax.grid(alpha=0.3)
        save(fig, "memory")
    if "batch" in series:
        points = series["batch"]["decode"]
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        b = [p["batch_size"] for p in points]
        ax = axes[0]
        for key, label, style in (("batch_s", "batch: extend(1) + step.write x32", "-"),
                                  ("per_handle_s", "per handle: extend_many + h.write", "-"),
                                  ("floor_s", "floor: index_copy_ x64 (bf16 rows)", "--"),
                                  ("floor_16b_s", "floor, 16-byte rows", ":")):
            ax.plot(b, [p[key] * 1e3 for p in points], marker="o", linestyle=style, label=label)
        ax.set_xscale("log", base=2)
        ax.set_xticks(b, [str(x) for x in b])
        ax.set_yscale("log")
        ax.set_xlabel("sequences in the step (B)")
        ax.set_ylabel("decode step (ms)")
        ax.set_title("decode step, 32 layers, 512-token context")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        ax = axes[1]
        control = series["batch"]["control"]
        parts = ("table_us", "codec_us", "ping_us", "other_us", "step_build_us")
        labels = ("coordinator table", "msgpack", "wire (ping)", "other", "Step (client)")
        for row, prefix in enumerate(("alloc", "extend")):
            split, left = _split(control, prefix), 0.0
            for i, (part, part_label) in enumerate(zip(parts, labels)):
                width = max(0.0, split.get(part, 0.0))
                ax.barh(row, width, left=left, color=f"C{i}",
                        label=part_label if row == 0 else None)
                left += width
            # The parts are timed apart (and on a shared machine): mark the measured whole.
            ax.plot([split["total_us"]], [row], marker="|", markersize=40, color="black",
                    linestyle="none", label="measured call" if row == 0 else None)
        ax.set_yticks([0, 1], ["allocate_many\n+ close_many", "batch.extend(1)"])
        ax.set_xlabel("microseconds, 256 sequences")
        ax.set_title("where a control-plane call goes")
        ax.legend(fontsize=8, markerscale=0.3)
        save(fig, "batch")
    return written


# -- driver ---------------------------------------------------------------------------------

def run(opts: Options) -> dict:
    """Run the selected sections; returns the record that is written as JSON."""
    import torch
    if opts.threads > 0:
        torch.set_num_threads(opts.threads)
    opts.threads = torch.get_num_threads()
    started = time.time()
    t0 = time.perf_counter()
    shm_before = _shm_entries()
    cleanup = _Cleanup()
    figures: List[Figure] = []
    series: dict = {}
    cache: dict = {}
    timings = {}
    from .progress import ProgressBar  # a live bar on a terminal, nothing otherwise
    bar = ProgressBar("bench", total=sum(s in opts.sections for s in SECTIONS), unit="sections")
    try:
        for section in SECTIONS:
            if section not in opts.sections:
                continue
            s0 = time.perf_counter()
            bar.update(description=f"bench: {section}")
            print(f"shmkv bench: {section} ...", flush=True)
            if section == "data":
                figures += bench_data(opts, cleanup, series)
            elif section == "attach":
                figures += bench_attach(opts, cleanup, series, cache)
            elif section == "control":
                figures += bench_control(opts, cleanup, series)
            elif section == "handoff":
                figures += bench_handoff(opts, cleanup, series)
            elif section == "scaling":
                figures += bench_scaling(opts, cleanup, series)
            elif section == "memory":
                figures += bench_memory(opts, cleanup, series, cache)
            elif section == "batch":
                figures += bench_batch(opts, cleanup, series, cache)
            timings[section] = time.perf_counter() - s0
            print(f"shmkv bench: {section} done in {timings[section]:.1f} s", flush=True)
            bar.advance()
    finally:
        bar.close()
        cleanup.close()
    notes = list(cache.get("notes", []))
    leftover = multiprocessing.active_children()
    if leftover:
        notes.append(f"helper processes still alive at the end: {leftover}")
    new_shm = sorted(_shm_entries() - shm_before)
    if new_shm:
        notes.append(f"new /dev/shm entries at the end: {new_shm}")
    return {
        "name": opts.name, "quick": opts.quick, "sections": list(opts.sections),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)),
        "duration_s": time.perf_counter() - t0, "section_s": timings,
        "repeats": opts.repeats,
        "host": {"cpus": os.cpu_count(), "platform": platform.platform(),
                 "python": platform.python_version(), "torch": torch.__version__,
                 "torch_threads": torch.get_num_threads(),
                 "load_avg": os.getloadavg()},
        "model": MODEL, "figures": [dataclasses.asdict(f) for f in figures],
        "series": series, "notes": notes,
    }


def cmd_bench(args) -> int:
    """Entry point of ``shmkv bench``."""
    sections = tuple(args.only) if args.only else SECTIONS
    mode = "quick" if args.quick else "full"
    name = args.name or (mode if not args.only else f"{mode}-{'-'.join(args.only)}")
    repeats = args.repeats or (5 if args.quick else 7)
    opts = Options(quick=args.quick, repeats=repeats, sections=sections, out_dir=args.out,
                   name=name, threads=args.threads)
    record = run(opts)
    figures = [Figure(**f) for f in record["figures"]]
    print()
    print(format_table(figures))
    try:
        plots = draw_plots(record["series"], os.path.join(opts.out_dir, "plots"), name)
    except ImportError:
        plots = []
        record["notes"].append("matplotlib is not installed: plots skipped "
                               "(pip install 'shmkv[plot]')")
    results_dir = os.path.join(opts.out_dir, "results")
    os.makedirs(results_dir, exist_ok=True)
    json_path = os.path.join(results_dir, f"{name}.json")
    with open(json_path, "w") as f:
        json.dump(record, f, indent=1, default=str)
    md_path = os.path.join(results_dir, f"{name}.md")
    with open(md_path, "w") as f:
        f.write(format_markdown(figures, record["series"]) + "\n")
    for note in record["notes"]:
        print(f"note: {note}")
    missed = [f for f in figures if f.met is False]
    print(f"\n{sum(f.met is True for f in figures)} targets met, {len(missed)} missed; "
          f"{record['duration_s']:.0f} s; results in {json_path} and {md_path}"
          + (f"; plots in {os.path.dirname(plots[0])}" if plots else ""))
    return 0


def add_parser(sub) -> None:
    """Register ``shmkv bench`` on an argparse subparsers object."""
    from .args import name_arg, non_negative_int, path_arg, positive_int
    p = sub.add_parser("bench", help="run the benchmark suite",
                       description="Measure shmkv against plain baselines; writes "
                                   "benchmarks/results/NAME.json and .md and "
                                   "benchmarks/plots/NAME-*.png.")
    p.add_argument("--quick", action="store_true",
                   help="fewer sizes and repeats (under 2 minutes)")
    p.add_argument("--name", type=name_arg, default=None,
                   help="name of the result files (default: quick or full)")
    p.add_argument("--only", nargs="+", choices=SECTIONS, metavar="SECTION",
                   help=f"run only these sections: {', '.join(SECTIONS)}")
    p.add_argument("--repeats", type=positive_int, default=None,
                   help="timed runs per figure after the warm-up (default 5 quick, 7 full)")
    p.add_argument("--threads", type=non_negative_int, default=1,
                   help="torch threads in the measuring processes (default 1: on a shared "
                        "machine a descheduled OpenMP thread stalls every parallel copy; "
                        "0 keeps torch's default)")
    p.add_argument("--out", type=path_arg, default="benchmarks",
                   help="directory holding results/ and plots/ (default: benchmarks)")
    p.set_defaults(func=cmd_bench)
