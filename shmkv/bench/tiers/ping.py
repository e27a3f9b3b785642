"""Ping p99 while another process promotes, against ping p99 when it does not, with its
controls (pool hits with no tier, pings from another client, copies with no request).
"""

from __future__ import annotations

import itertools
import os
import shutil
import time
from typing import Any, Dict, List

import shmkv
from shmkv.bench.core import SPAWN, BenchError, p99
from shmkv.bench.tiers.common import BIG, evict_all, fill, name, prompts_for, wait_idle
from shmkv.memory import block_io


def _pinger(address, stop, queue):
    """Ping until ``stop``: (start time, latency) of each ping, a little apart. Says
    ``pinging`` once it has connected and warmed up."""
    with shmkv.connect(address, timeout=60) as client:
        for _ in range(50):
            client.request("ping")
        queue.put(("pinging", None))
        samples = []
        while not stop.is_set():
            t0 = time.monotonic()
            client.request("ping")
            samples.append((t0, time.monotonic() - t0))
            time.sleep(0.0005)
    queue.put(("pings", samples))


def _paced(go, stop, rate, step) -> float:
    """Call ``step()`` while ``go`` is set (at most ``rate`` times a second, if given),
    phase after phase until ``stop``; returns the seconds the phases lasted."""
    busy = 0.0
    while not stop.is_set():
        if not go.wait(0.05):
            continue
        t0 = time.monotonic()
        while go.is_set():
            t1 = time.monotonic()
            step()
            if rate:
                time.sleep(max(0.0, 1.0 / rate - (time.monotonic() - t1)))
        busy += time.monotonic() - t0
    return busy


def _promoter(address, prompts, block_size, go, stop, queue, rate=None):
    """Promote the prompts round and round while ``go`` is set (at most ``rate``
    allocations a second, if given)."""
    counts = {"moved": 0, "num": 0}
    turn = itertools.cycle(prompts)
    with shmkv.connect(address, timeout=60) as client:

        def step():
            h = client.allocate(prompt=next(turn))
            counts["moved"] += h.num_cached_tokens // block_size
            counts["num"] += 1
            h.close()

        queue.put(("ready", None))
        busy = _paced(go, stop, rate, step)
    queue.put(("moved", (counts["moved"], busy, counts["num"])))


def _ping_load(address, go, stop, queue, rate):
    """The third control's neighbour: ``rate`` pings a second while ``go`` is set; requests
    that cost the loop nothing beyond being served."""
    num = [0]
    with shmkv.connect(address, timeout=60) as client:

        def step():
            client.request("ping")
            num[0] += 1

        queue.put(("ready", None))
        busy = _paced(go, stop, rate, step)
    queue.put(("moved", (0, busy, num[0])))


def _copier(block_nbytes, go, stop, queue, rate):
    """The second control's neighbour: copy blocks of ``block_nbytes`` between two
    buffers of this process, at most ``rate`` blocks a second, at the tier I/O process's
    priority (SCHED_IDLE where there is one), while ``go`` is set; no request at all."""
    import numpy as np

    if getattr(os, "SCHED_IDLE", None) is not None and block_io.IO_PROCESS_POLICY == "idle":
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    num = max(1, (64 << 20) // block_nbytes)
    src = np.ones((num, block_nbytes), dtype=np.uint8)
    dst = np.empty_like(src)
    moved = [0]

    def step():
        dst[moved[0] % num] = src[moved[0] % num]
        moved[0] += 1

    queue.put(("ready", None))
    busy = _paced(go, stop, rate, step)
    queue.put(("moved", (moved[0], busy, 0)))


def ping_run(
    address,
    prompts,
    block_size,
    cycles,
    phase_s=0.5,
    rate=None,
    copy_nbytes=None,
    pings=False,
    samples=False,
) -> dict:
    """Ping throughout while a promoter runs in alternate phases (idle, promoting, idle,
    ...), so both conditions meet the same background load; pings within 50 ms of a
    phase change are not counted. With ``copy_nbytes``, the neighbour is a process that
    only copies blocks of that size (``rate`` a second) and sends no request; with
    ``pings``, one that only pings (``rate`` a second). With ``samples``, the result also
    has every ping (``"samples"``: start, latency) and the phases (start, end, busy)."""
    q = SPAWN.Queue()
    go, stop = SPAWN.Event(), SPAWN.Event()
    if copy_nbytes:
        promoter = SPAWN.Process(target=_copier, args=(copy_nbytes, go, stop, q, rate))
    elif pings:
        promoter = SPAWN.Process(target=_ping_load, args=(address, go, stop, q, rate))
    else:
        promoter = SPAWN.Process(
            target=_promoter, args=(address, prompts, block_size, go, stop, q, rate)
        )
    promoter.start()
    assert q.get(timeout=120)[0] == "ready"
    pinger = SPAWN.Process(target=_pinger, args=(address, stop, q))
    pinger.start()
    assert q.get(timeout=120)[0] == "pinging"  # it imported, connected and warmed up
    phases = []
    for _ in range(cycles):
        for busy in (False, True):
            (go.set if busy else go.clear)()
            t0 = time.monotonic()
            time.sleep(phase_s)
            phases.append((t0 + 0.05, time.monotonic(), busy))
    go.clear()
    stop.set()
    results = dict(q.get(timeout=120) for _ in range(2))  # "moved" and "pings"
    for p in (promoter, pinger):
        p.join(30)
    lat: Dict[bool, List[float]] = {False: [], True: []}
    for t0, latency in results["pings"]:
        for start, end, busy in phases:
            if start <= t0 < end:
                lat[busy].append(latency)
                break
    moved, busy_s, num = results["moved"]
    out: Dict[str, Any] = {}
    for busy, label in ((False, "idle"), (True, "promoting")):
        values = sorted(lat[busy])
        if not values:
            raise BenchError(
                f"no ping landed in a {label} phase ({cycles} of {phase_s} s): the pinger "
                "was not scheduled (a host this loaded cannot measure ping latency)"
            )
        out[label] = {
            "p50_us": values[len(values) // 2] * 1e6,
            "p99_us": p99(values) * 1e6,
            "pings": len(values),
        }
    out["promoting"]["promoted_blocks_per_s"] = moved / max(busy_s, 1e-9)
    out["promoting"]["allocations_per_s"] = num / max(busy_s, 1e-9)
    if samples:
        out["samples"], out["phases"] = results["pings"], phases
    return out


def spin(args) -> dict:
    """The coordinator's ``spin_us`` and ``loop_slice_us`` where ``--spin-us`` and
    ``--loop-slice-us`` are given (else spawn's defaults)."""
    options = {} if args.spin_us is None else {"spin_us": args.spin_us}
    if args.loop_slice_us is not None:
        options["loop_slice_us"] = args.loop_slice_us
    return options


def bench_pings(args, root) -> dict:
    """:func:`bench_ping` ``args.ping_runs`` times: the last run's figures, with every
    run's ratios under ``"runs"`` (the spread the ping target is stated with)."""
    runs = [bench_ping(args, root) for _ in range(max(1, args.ping_runs))]
    last = dict(runs[-1])
    if len(runs) > 1:
        last["runs"] = [{kind: r["p99_ratio"] for kind, r in run.items()} for run in runs]
    return last


def bench_ping(args, root) -> dict:
    cfg = shmkv.PoolConfig(num_blocks=args.pool_blocks, **BIG)
    blocks = args.prompt_blocks
    out = {}
    for kind in ("disk", "host"):
        prompts = prompts_for(
            max(2 * args.pool_blocks // blocks, 4), blocks, cfg.block_size, seed=3
        )
        n = len(prompts) * blocks
        spec = (
            shmkv.DiskTier(os.path.join(root, "ping"), 1 << 40)
            if kind == "disk"
            else shmkv.HostTier((n + 8) * cfg.block_nbytes)
        )
        with (
            shmkv.Coordinator.spawn(cfg, name=name(), tiers=[spec], **spin(args)) as coord,
            shmkv.connect(coord.address, timeout=120) as client,
        ):
            fill(client, prompts)
            evict_all(client)
            wait_idle(client)
            run = ping_run(coord.address, prompts, cfg.block_size, args.ping_cycles)
            run["p99_ratio"] = run["promoting"]["p99_us"] / run["idle"]["p99_us"]
            run["loop_slice_us"] = client.stats()["loop_slice_us"]
            out[kind] = run
        shutil.rmtree(os.path.join(root, "ping"), ignore_errors=True)
    # The control: no tier, the same prompts are pool hits, allocated and released at the
    # host run's rate. What the loop's own work for those requests costs the pings.
    prompts = prompts[: max(1, args.pool_blocks // blocks - 1)]
    with (
        shmkv.Coordinator.spawn(cfg, name=name(), **spin(args)) as coord,
        shmkv.connect(coord.address, timeout=120) as client,
    ):
        fill(client, prompts)
        run = ping_run(
            coord.address,
            prompts,
            cfg.block_size,
            args.ping_cycles,
            rate=out["host"]["promoting"]["allocations_per_s"],
        )
        run["p99_ratio"] = run["promoting"]["p99_us"] / run["idle"]["p99_us"]
        out["no tier (pool hits)"] = run
    # The second control: as many requests a second as the host run sent (an allocation
    # and a release per promoting request), each a ping. What serving that many requests
    # costs the pings, whatever they ask.
    with shmkv.Coordinator.spawn(cfg, name=name(), **spin(args)) as coord:
        run = ping_run(
            coord.address,
            None,
            cfg.block_size,
            args.ping_cycles,
            rate=2 * out["host"]["promoting"]["allocations_per_s"],
            pings=True,
        )
        run["p99_ratio"] = run["promoting"]["p99_us"] / run["idle"]["p99_us"]
        out["pings alone (the host run's request rate)"] = run
    # The third control: the host run's copies without its requests. What the copies
    # alone, in a process at the tier I/O process's priority, cost the pings.
    with shmkv.Coordinator.spawn(cfg, name=name(), **spin(args)) as coord:
        run = ping_run(
            coord.address,
            None,
            cfg.block_size,
            args.ping_cycles,
            rate=out["host"]["promoting"]["promoted_blocks_per_s"],
            copy_nbytes=cfg.block_nbytes,
        )
        run["p99_ratio"] = run["promoting"]["p99_us"] / run["idle"]["p99_us"]
        out["copies alone (no requests)"] = run
    return out


# -- the chat trace ------------------------------------------------------------------------
