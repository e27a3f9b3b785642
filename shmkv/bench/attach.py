"""Suites ``attach`` and ``memory``: attach time and resident memory, per pool size.

``attach``: ``shmkv.connect`` timed in a fresh ``spawn`` worker, alternating with
connects to a 64 MiB pool that stays up (the baseline). ``memory``: RSS, USS and
anonymous memory of the coordinator and a worker from ``/proc/PID/smaps_rollup``, the
worker right after attaching and after touching every page. Both share one sweep of
pools (``_pool_sweep``), made once per run.
"""

from __future__ import annotations

import time
from typing import Dict, List

from shmkv.bench.core import (
    GIB,
    MIB,
    Figure,
    Helper,
    Options,
    _check,
    _Cleanup,
    _median,
    _model_config,
    _next_command,
    _size,
    _unique,
    memory_of,
)

# -- 2 and 6. attach time and resident memory, per pool size ---------------------------------


def _child_attach(conn, address: str, baseline: str, repeats: int, touch: bool) -> None:
    """Worker side: time connect (imports already done), measure memory, then time
    connects to ``address`` alternating with connects to the ``baseline`` pool."""
    import gc

    import torch

    from shmkv.client.client import connect

    ready = _next_command(conn)  # start timing only when the parent says so
    if ready is None:
        return
    t0 = time.perf_counter()
    client = connect(address)
    cold = time.perf_counter() - t0
    result = {"cold_s": cold, "attached": memory_of()}
    if touch:  # map every page of the pool by reading one byte of each
        from shmkv.memory.pool import storage_view

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
    from shmkv.coordinator.server import Coordinator
    from shmkv.memory.shm import shm_free_bytes

    sizes = [64 * MIB, 256 * MIB, GIB] + ([] if opts.quick else [4 * GIB, 8 * GIB])
    block_size = 16
    block_bytes = _model_config(1, block_size).block_nbytes
    rows = []
    # The smallest pool stays up: every size is timed alternating with it.
    baseline = cleanup.add(
        Coordinator.spawn(
            _model_config(sizes[0] // block_bytes, block_size), name=_unique("attach"), timeout=120
        )
    )
    for size in sizes:
        if size + 512 * MIB > shm_free_bytes():
            cache.setdefault("notes", []).append(
                f"pool of {size / GIB:g} GiB skipped: /dev/shm has "
                f"{shm_free_bytes() / GIB:.1f} GiB free"
            )
            continue
        # Spawn the worker first: its interpreter starts while the pool is allocated.
        worker = cleanup.add(Helper(_child_attach_wait, name="shmkv-bench-attach"))
        t0 = time.perf_counter()
        coord = cleanup.add(
            Coordinator.spawn(
                _model_config(size // block_bytes, block_size), name=_unique("attach"), timeout=120
            )
        )
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

    from shmkv.client import client  # noqa: F401

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
    points = [
        {
            "pool_bytes": r["pool_bytes"],
            "warm_s": _median(r["warm_s"]),
            "baseline_s": _median(r["baseline_s"]),
            "cold_s": r["cold_s"],
            "create_s": r["create_s"],
        }
        for r in rows
    ]
    series["attach"] = points
    small, large = points[0], points[-1]
    figures = []
    for p in points:
        ratio = p["warm_s"] / p["baseline_s"]
        target = "<= 1.5" if p is large and p is not small else None
        figures.append(
            Figure(
                "attach",
                f"attach, {_size(p['pool_bytes'])} pool",
                p["warm_s"] * 1e3,
                "ms",
                p["baseline_s"] * 1e3,
                f"{_size(small['pool_bytes'])} pool, same worker",
                ratio,
                target,
                _check(ratio, target) if target else None,
                params={
                    "first_attach_ms": p["cold_s"] * 1e3,
                    "first_attach_ratio": p["cold_s"] / small["cold_s"],
                    "coordinator_start_s": p["create_s"],
                },
            )
        )
    return figures


def bench_memory(opts: Options, cleanup: _Cleanup, series: dict, cache: dict) -> List[Figure]:
    """Resident memory of the coordinator and of an attached worker against pool size."""
    rows = _pool_sweep(opts, cleanup, cache)
    if not rows:
        return []
    points = [
        {
            "pool_bytes": r["pool_bytes"],
            "coordinator": r["coordinator"],
            "worker_attached": r["attached"],
            "worker_touched": r.get("touched"),
        }
        for r in rows
    ]
    series["memory"] = points
    small, large = points[0], points[-1]
    figures = []
    for who in ("coordinator", "worker_attached", "worker_touched"):
        if large[who] is None:
            continue
        label = who.replace("_", " ")
        for kind in ("rss", "uss", "anon"):
            figures.append(
                Figure(
                    "memory",
                    f"{label} {kind.upper()} ({_size(large['pool_bytes'])} pool)",
                    large[who][kind] / MIB,
                    "MiB",
                    small[who][kind] / MIB,
                    f"{_size(small['pool_bytes'])} pool",
                    params={"values_mib": {p["pool_bytes"]: p[who][kind] / MIB for p in points}},
                )
            )
    # The check: no process grows private anonymous memory with the pool (no copy).
    for who in ("coordinator", "worker_attached", "worker_touched"):
        if large[who] is None:
            continue
        growth = large[who]["anon"] - small[who]["anon"]
        pool_growth = large["pool_bytes"] - small["pool_bytes"]
        ratio = growth / pool_growth
        figures.append(
            Figure(
                "memory",
                f"{who.replace('_', ' ')} anon growth / pool growth",
                growth / MIB,
                "MiB",
                pool_growth / MIB,
                "pool growth",
                ratio,
                "<= 0.01",
                _check(ratio, "<= 0.01"),
            )
        )
    return figures
