"""Suite ``scaling``: 1-8 worker processes on one coordinator, ops/s of ``extend(1)``
and GB/s of ``write_all`` + ``gather_all(out=)``, each against one worker.
"""

from __future__ import annotations

import time
from typing import Any, Dict, List

from shmkv.bench.core import (
    Figure,
    Helper,
    Options,
    _Cleanup,
    _median,
    _model_config,
    _next_command,
    _pattern,
    _unique,
)

# -- 5. scaling ----------------------------------------------------------------------------------

SCALING_TOKENS = 1024  # 128 MiB of K/V per worker: more than the caches hold


def _child_scaling(conn, address: str) -> None:
    """One worker of the scaling run: control-plane ops or data-plane bytes until a deadline."""
    import torch

    from shmkv.client.client import connect

    torch.set_num_threads(1)  # one thread per worker: the workers share the machine
    client = connect(address)
    cfg = client.config
    data = client.allocate(SCALING_TOKENS)
    kv = _pattern(
        cfg.num_layers * 2 * SCALING_TOKENS * cfg.num_kv_heads * cfg.head_dim, client.pool.dtype
    ).view(cfg.num_layers, 2, SCALING_TOKENS, cfg.num_kv_heads, cfg.head_dim)
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
    from shmkv.coordinator.server import Coordinator

    counts = (1, 2, 4) if opts.quick else (1, 2, 4, 8)
    duration = 0.3 if opts.quick else 1.0
    repeats = 2 if opts.quick else 3
    cfg = _model_config(max(counts) * (SCALING_TOKENS // 16 + 40) + 64, 16)
    coord = cleanup.add(Coordinator.spawn(cfg, name=_unique("scaling"), timeout=120))
    workers = [
        cleanup.add(Helper(_child_scaling, coord.address, name=f"shmkv-bench-w{i}"))
        for i in range(max(counts))
    ]
    points: List[Dict[str, Any]] = []
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
            points.append(
                {
                    "workers": n,
                    "ops_per_s": _median(results[("ops", n)]),
                    "bytes_per_s": _median(results[("bw", n)]),
                }
            )
    finally:
        for w in workers:
            cleanup.remove(w)
        cleanup.remove(coord)
    series["scaling"] = points
    one = points[0]
    figures = []
    for p in points:
        figures.append(
            Figure(
                "scaling",
                f"ops/s, {_workers(p['workers'])}",
                p["ops_per_s"],
                "ops/s",
                one["ops_per_s"],
                "1 worker",
                p["ops_per_s"] / one["ops_per_s"],
                params={"op": "extend(1), allocate/close every 256"},
            )
        )
    for p in points:
        figures.append(
            Figure(
                "scaling",
                f"bandwidth, {_workers(p['workers'])}",
                p["bytes_per_s"] / 1e9,
                "GB/s",
                one["bytes_per_s"] / 1e9,
                "1 worker",
                p["bytes_per_s"] / one["bytes_per_s"],
                params={"op": f"write_all + gather_all(out=) of {SCALING_TOKENS} tokens"},
            )
        )
    return figures


def _workers(n: int) -> str:
    return f"{n} worker" + ("s" if n > 1 else "")
