"""Suite ``tiers``: benchmarks of the tiers under the pool (host memory, local disk).

    shmkv bench --only tiers [--quick] [-- --only ping --spin-us 150 --loop-slice-us 0]
    shmkv bench --only tiers -- --make-trace benchmarks/traces/chat.jsonl

Measures, each against its baseline:

* promotion bandwidth from disk against a plain sequential read of the same files from
  the same directory into as many destination blocks as the pool has, both from a cold
  page cache (``posix_fadvise(DONTNEED)`` before each pass: the bytes come from the
  device) and warm (both from the page cache);
* promotion bandwidth from the host tier against a plain copy of the same blocks
  (one ``numpy.copyto`` per block, host shared memory to the block's place in pool
  shared memory: its ``2 * num_layers`` chunks);
* ping p99 while another process promotes blocks as fast as it can, against ping p99
  when it does not, in alternating half-second phases of one run (disk tier, then host
  tier), with three controls: the same allocations as pool hits with no tier, as many
  pings from another client, and the copies alone with no request;
* the loop's work for one request (the coordinator's own calls, in this process)
  back to back and after pauses like its sleeps between requests;
* the committed multi-turn chat trace (``benchmarks/traces/chat.jsonl``: a shared
  system prompt, growing conversations, a working set 4x the pool): prefix-hit rate
  and prefill tokens saved, with tiers against the pool alone, every cached block
  checked against the K/V its writer wrote;
* time from coordinator start to the first disk hit after a restart, with 10k blocks
  on disk (and until the background scan has checked every header).

The coordinator runs in its own process (``Coordinator.spawn``), its tier copies in its
tier I/O process (``shmkv.memory.block_io``: the pools here are CPU pools); clients here and in
spawned processes. Results go to ``OUT.json`` and ``OUT.md``.
"""

from __future__ import annotations

import argparse
import atexit
import itertools
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from typing import Any, Dict, List

import numpy as np
import torch

import shmkv
from shmkv import tiers as tiers_mod
from shmkv.bench.core import SPAWN, p99, result_base, trace_path, write_results
from shmkv.memory import block_io
from shmkv.memory.pool import block_bytes

# PoolConfig's keywords. An 8B-class model's block (32 layers, 8 KV heads of 128, fp16,
# 16 tokens): 2 MiB.
BIG: Dict[str, Any] = dict(
    num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="float16"
)
SMALL: Dict[str, Any] = dict(
    num_layers=2, num_kv_heads=2, head_dim=16, block_size=16, dtype="float16"
)


def name() -> str:
    return f"bench-tiers-{uuid.uuid4().hex[:8]}"


def wait_idle(client, timeout=600.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        st = client.stats()
        io = st.get("block_io") or {"pending": 0, "scanning": False, "promotions_in_flight": 0}
        if not (io["pending"] or io["scanning"] or io["promotions_in_flight"]):
            return st
        if time.monotonic() > deadline:
            raise RuntimeError(f"tiers busy after {timeout} s: {io}")
        time.sleep(0.005)


def evict_all(client) -> None:
    st = client.stats()
    bs = st["config"]["block_size"]
    client.allocate((st["free_blocks"] + st["cached_blocks"]) * bs).close()


def fill(client, prompts, value=None) -> None:
    """Write and commit every prompt (K/V: a constant per prompt), waiting for each one's
    blocks to reach the tiers, so that none is lost to a fast eviction."""
    for i, prompt in enumerate(prompts):
        h = client.allocate(prompt=prompt)
        n = len(prompt)
        kv = torch.full((n, h.num_heads, h.head_dim), float(i % 100), dtype=h.dtype)
        for layer in range(h.num_layers):
            h.write(layer, kv, kv, start=0)
        h.commit()
        h.close()
        wait_idle(client)


def prompts_for(num, blocks, block_size, seed):
    rng = random.Random(seed)
    return [[rng.randrange(1, 50000) for _ in range(blocks * block_size)] for _ in range(num)]


def drop_page_cache(directory: str) -> None:
    """Evict the directory's files from the page cache (no root needed)."""
    for entry in os.scandir(directory):
        if entry.is_file():
            fd = os.open(entry.path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def plain_read(directory: str, file_nbytes: int, num_dest: int) -> tuple:
    """Read every file of a directory, in order, each into the next of ``num_dest``
    destination blocks (as promotion reads into pool blocks): (bytes, seconds)."""
    import numpy as np

    names = sorted(os.listdir(directory))
    dest = np.zeros((num_dest, file_nbytes), dtype=np.uint8)  # touched: no page faults
    total = 0
    t0 = time.perf_counter()
    for i, n in enumerate(names):
        fd = os.open(os.path.join(directory, n), os.O_RDONLY)
        try:
            view, got = memoryview(dest[i % num_dest]), 0
            while got < file_nbytes:
                step = os.readv(fd, [view[got:]])
                if not step:
                    break
                got += step
            total += got
        finally:
            os.close(fd)
    return total, time.perf_counter() - t0


def promote_pass(client, prompts, block_size) -> tuple:
    """Allocate every prompt (all its blocks promoted), then close it: (bytes, seconds)."""
    nbytes = client.config.block_nbytes
    total = 0
    t0 = time.perf_counter()
    for prompt in prompts:
        h = client.allocate(prompt=prompt)
        assert h.num_cached_tokens == len(prompt), (h.num_cached_tokens, len(prompt))
        total += len(prompt) // block_size * nbytes
        h.close()
    return total, time.perf_counter() - t0


# -- bandwidth -----------------------------------------------------------------------------


def bench_disk_bandwidth(args, root) -> dict:
    cfg = shmkv.PoolConfig(num_blocks=args.pool_blocks, **BIG)
    path = os.path.join(root, "disk-bw")
    blocks = args.prompt_blocks
    prompts = prompts_for(args.disk_blocks // blocks, blocks, cfg.block_size, seed=1)
    out = {
        "block_bytes": cfg.block_nbytes,
        "blocks": len(prompts) * blocks,
        "blocks_per_request": blocks,
    }
    with (
        shmkv.Coordinator.spawn(cfg, name=name(), tiers=[shmkv.DiskTier(path, 1 << 40)]) as coord,
        shmkv.connect(coord.address, timeout=120) as client,
    ):
        fill(client, prompts)
        blocks_dir = os.path.join(path, "blocks")
        for cache in ("cold", "warm"):
            rates_p, rates_r = [], []
            for _rep in range(args.reps):
                evict_all(client)
                wait_idle(client)
                if cache == "cold":
                    drop_page_cache(blocks_dir)
                nbytes, secs = promote_pass(client, prompts, cfg.block_size)
                rates_p.append(nbytes / secs)
                if cache == "cold":
                    drop_page_cache(blocks_dir)
                nbytes, secs = plain_read(
                    blocks_dir, tiers_mod.HEADER_SIZE + cfg.block_nbytes, cfg.num_blocks
                )
                rates_r.append(nbytes / secs)
            p, r = max(rates_p), max(rates_r)
            out[cache] = {"promotion_GBps": p / 1e9, "plain_read_GBps": r / 1e9, "ratio": p / r}
        out["stats"] = wait_idle(client)["tiers"]
    return out


def bench_host_bandwidth(args, root) -> dict:
    """Promotion from the host tier against a plain copy of as many blocks from host shared
    memory into the same places of the pool (numpy's copyto, what a caller would write),
    in alternating passes (the first of each maps its pages and is not counted): the
    median of the passes' paired ratios, with their spread. Where the native row copy
    the promotions use is available, a third pass copies with it alone: promotion
    against that is what the bookkeeping around the copies costs."""
    cfg = shmkv.PoolConfig(num_blocks=args.pool_blocks, **BIG)
    blocks = args.prompt_blocks
    num_blocks = args.host_blocks
    prompts = prompts_for(num_blocks // blocks, blocks, cfg.block_size, seed=2)
    from shmkv.memory import shm

    fd = shm.create_segment(num_blocks * cfg.block_nbytes, "bench")
    try:
        host = shm.map_tensor(fd, num_blocks * cfg.block_nbytes).view(num_blocks, -1)
    finally:
        os.close(fd)
    host_np = host.numpy()
    host_np.fill(1)
    with (
        shmkv.Coordinator.spawn(
            cfg, name=name(), tiers=[shmkv.HostTier((num_blocks + 8) * cfg.block_nbytes)]
        ) as coord,
        shmkv.connect(coord.address, timeout=120) as client,
    ):
        fill(client, prompts)
        # A block's place in the pool: 2 * num_layers chunks (shmkv.memory.pool.block_bytes).
        pool = block_bytes(client.pool).numpy()
        from shmkv.kernels import native

        row_copy = native.copier()
        rates: list = []
        plain: list = []
        streamed: list = []

        def copy_pass(copy, pool, host_np, out: list) -> None:
            evict_all(client)  # a plain copy overwrites pool blocks: none may be cached
            wait_idle(client)
            t0 = time.perf_counter()
            for i in range(num_blocks):
                copy(pool[i % cfg.num_blocks], host_np[i].reshape(pool.shape[1:]))
            out.append(num_blocks * cfg.block_nbytes / (time.perf_counter() - t0))

        for _rep in range(max(args.reps, 5) + 1):
            evict_all(client)
            wait_idle(client)
            nbytes, secs = promote_pass(client, prompts, cfg.block_size)
            rates.append(nbytes / secs)
            copy_pass(np.copyto, pool, host_np, plain)
            if row_copy is not None:
                copy_pass(row_copy, pool, host_np, streamed)
        stats = wait_idle(client)["tiers"]
        del pool
    del host, host_np
    ratios = sorted(p / c for p, c in zip(rates[1:], plain[1:]))
    out = {
        "block_bytes": cfg.block_nbytes,
        "blocks": num_blocks,
        "blocks_per_request": blocks,
        "promotion_GBps": statistics.median(rates[1:]) / 1e9,
        "plain_copy_GBps": statistics.median(plain[1:]) / 1e9,
        "ratio": statistics.median(ratios),
        "ratios": ratios,
        "row_copy": native.copy_status(),
        "stats": stats,
    }
    if streamed:
        same = sorted(p / c for p, c in zip(rates[1:], streamed[1:]))
        out.update(
            row_copy_GBps=statistics.median(streamed[1:]) / 1e9,
            ratio_same_copy=statistics.median(same),
            ratios_same_copy=same,
        )
    return out


# -- ping under promotion -------------------------------------------------------------------


def _pinger(address, seconds, queue):
    """Ping for ``seconds``: (start time, latency) of each ping, a little apart."""
    with shmkv.connect(address, timeout=60) as client:
        for _ in range(50):
            client.request("ping")
        samples = []
        end = time.monotonic() + seconds
        while time.monotonic() < end:
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
    pinger = SPAWN.Process(target=_pinger, args=(address, 2 * cycles * phase_s + 3.0, q))
    pinger.start()
    time.sleep(2.0)  # the pinger imports and connects
    phases = []
    for _ in range(cycles):
        for busy in (False, True):
            (go.set if busy else go.clear)()
            t0 = time.monotonic()
            time.sleep(phase_s)
            phases.append((t0 + 0.05, time.monotonic(), busy))
    go.clear()
    results = dict(q.get(timeout=120) for _ in range(1))
    stop.set()
    results.update(dict([q.get(timeout=120)]))
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


def make_trace(
    path: str, seed: int = 7, sessions: int = 40, concurrent: int = 24, block_size: int = 16
) -> None:
    """A multi-turn chat trace: one system prompt shared by every session, ``concurrent``
    sessions at a time that interleave at random (a user comes back after others have
    spoken), each turn a user message then an assistant reply (token ids)."""
    rng = random.Random(seed)
    system = [rng.randrange(1, 32000) for _ in range(320)]
    turns = {s: rng.randint(3, 8) for s in range(sessions)}
    active = list(range(min(concurrent, sessions)))
    waiting = list(range(len(active), sessions))
    lines = [
        {
            "kind": "header",
            "block_size": block_size,
            "system": system,
            "seed": seed,
            "sessions": sessions,
            "concurrent": concurrent,
        }
    ]
    while active:
        s = rng.choice(active)
        lines.append(
            {
                "session": s,
                "user": [rng.randrange(1, 32000) for _ in range(rng.randint(16, 160))],
                "reply": [rng.randrange(1, 32000) for _ in range(rng.randint(24, 200))],
            }
        )
        turns[s] -= 1
        if not turns[s]:
            active.remove(s)
            if waiting:
                active.append(waiting.pop(0))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        for line in lines:
            f.write(json.dumps(line, separators=(",", ":")) + "\n")


def load_trace(path: str) -> tuple:
    with open(path) as f:
        lines = [json.loads(line) for line in f]
    return lines[0], lines[1:]


def trace_working_set(header, requests) -> int:
    """Distinct full blocks the trace publishes (prompts and replies)."""
    from shmkv import hashing

    convs: dict = {}
    for r in requests:
        convs.setdefault(r["session"], list(header["system"])).extend(r["user"] + r["reply"])
    keys = set()
    for conv in convs.values():
        keys.update(hashing.block_keys(conv, header["block_size"], hashing.root_key()))
    return len(keys)


def kv_of(tokens, positions, heads, dim, dtype):
    t = torch.tensor(tokens, dtype=torch.float32)[:, None, None]
    p = torch.tensor(positions, dtype=torch.float32)[:, None, None]
    return (
        (
            (t % 1000) * 0.25
            + p * 0.001
            + torch.arange(heads)[None, :, None]
            + torch.arange(dim)[None, None, :] * 0.01
        )
        .expand(-1, heads, dim)
        .to(dtype)
    )


def replay(address, header, requests, verify=True, decode_us=500.0) -> dict:
    """Replay the trace: allocate each prompt, write what was not cached, commit, decode
    the reply (``decode_us`` of pretend compute per reply token: far faster than any
    model, but not zero, so that write-behind copies have a moment), commit, close."""
    bs = header["block_size"]
    convs: dict = {}
    prompt_tokens = cached_tokens = checked = bad = 0
    with shmkv.connect(address, timeout=120) as client:
        heads, dim, dtype = client.pool.shape[4], client.config.head_dim, client.pool.dtype
        layers = client.config.num_layers
        t0 = time.perf_counter()
        for r in requests:
            conv = convs.setdefault(r["session"], list(header["system"]))
            prompt = conv + r["user"]
            h = client.allocate(prompt=prompt)
            cached = h.num_cached_tokens
            prompt_tokens += len(prompt)
            cached_tokens += cached
            if verify and cached:
                for pos in {0, cached - bs}:  # the first and the last cached block
                    want = kv_of(prompt[pos : pos + bs], range(pos, pos + bs), heads, dim, dtype)
                    got = h.key_cache(layers - 1)[pos : pos + bs]
                    checked += 1
                    bad += not torch.equal(got, want)
            kv = kv_of(prompt[cached:], range(cached, len(prompt)), heads, dim, dtype)
            for layer in range(layers):
                h.write(layer, kv, kv, start=cached)
            h.commit()
            start = h.extend(len(r["reply"]), tokens=r["reply"])
            kv = kv_of(r["reply"], range(start, start + len(r["reply"])), heads, dim, dtype)
            for layer in range(layers):
                h.write(layer, kv, kv, start=start)
            h.commit()
            h.close()
            conv += r["user"] + r["reply"]
            time.sleep(len(r["reply"]) * decode_us * 1e-6)
        secs = time.perf_counter() - t0
        st = client.stats()
    return {
        "requests": len(requests),
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached_tokens,
        "hit_rate": cached_tokens / prompt_tokens,
        "prefill_tokens": prompt_tokens - cached_tokens,
        "seconds": secs,
        "blocks_checked": checked,
        "blocks_wrong": bad,
        "evictions": st["evictions"],
        "tiers": st.get("tiers"),
        "block_io": st.get("block_io"),
    }


def bench_chat(args, root) -> dict:
    header, requests = load_trace(args.trace)
    bs = header["block_size"]
    working_set = trace_working_set(header, requests)
    pool_blocks = working_set // 4
    cfg = shmkv.PoolConfig(num_blocks=pool_blocks, max_seq_len=8192, **SMALL)
    out = {
        "trace": os.path.relpath(args.trace),
        "requests": len(requests),
        "working_set_blocks": working_set,
        "pool_blocks": pool_blocks,
        "block_size": bs,
    }
    runs = {
        "pool alone": None,
        "pool + host tier (1x pool) + disk tier": [
            shmkv.HostTier(pool_blocks * cfg.block_nbytes),
            shmkv.DiskTier(os.path.join(root, "chat"), 1 << 34),
        ],
    }
    for label, specs in runs.items():
        with shmkv.Coordinator.spawn(cfg, name=name(), tiers=specs) as coord:
            out[label] = replay(coord.address, header, requests, decode_us=args.decode_us)
    base, tiered = out["pool alone"], out["pool + host tier (1x pool) + disk tier"]
    out["prefill_tokens_saved_by_tiers"] = base["prefill_tokens"] - tiered["prefill_tokens"]
    return out


# -- the loop's work, warm and cold -----------------------------------------------------------


def bench_cold(args, root) -> dict:
    """What the loop's work for one request costs back to back, and after a pause like
    the loop's sleeps between requests (its code and data then come back from memory):
    the coordinator's own table calls, in this process, with no socket."""
    from shmkv import hashing, protocol

    cfg = shmkv.PoolConfig(num_blocks=args.pool_blocks, **BIG)
    blocks = args.prompt_blocks
    prompts = [
        hashing.pack_tokens(p)
        for p in prompts_for(max(1, args.pool_blocks // blocks - 1), blocks, cfg.block_size, 5)
    ]
    coord = shmkv.Coordinator(cfg, name=name())
    coord.open()
    try:
        table = coord.table
        table.add_connection(1)
        for packed in prompts:  # published: every allocation below is a pool hit
            info = table.allocate(1, prompt=packed)
            table.commit(1, info["cache_id"], len(packed) // 8)
            table.release(1, info["cache_id"])
        root = hashing.root_key(None)  # each prompt with its keys, as a client sends it
        sent = [
            (packed, b"".join(hashing.packed_block_keys(packed, cfg.block_size, root)))
            for packed in prompts
        ]
        turn = [0]

        def hit():
            packed, keys = sent[turn[0] % len(sent)]
            info = table.allocate(1, prompt=packed, keys=keys)
            turn[0] += 1
            table.release(1, info["cache_id"])

        def plain():
            info = table.allocate(1, num_tokens=blocks * cfg.block_size)
            table.release(1, info["cache_id"])

        answer = {
            "cache_id": 1,
            "slot": 0,
            "blocks": list(range(blocks)),
            "num_tokens": blocks * cfg.block_size,
            "num_cached": 0,
            "request_id": None,
        }
        work = {
            f"allocate a {blocks}-block prompt (a pool hit, keys from its client) + release": hit,
            f"allocate {blocks} blocks, no prompt + release": plain,
            "encode a ping's answer": lambda: protocol.encode_ok(1, {}),
            f"encode an allocation's answer ({blocks} blocks)": lambda: protocol.encode_ok(
                1, [answer]
            ),
        }
        gaps_ms = (0.0, 0.5, 2.0, 7.0)
        out: Dict[str, Any] = {"gaps_ms": list(gaps_ms), "work": {}}
        for label, fn in work.items():
            row: Dict[str, float] = {}
            for gap in gaps_ms:
                times = []
                for _ in range(200):
                    if gap:
                        time.sleep(gap / 1e3)
                    t0 = time.perf_counter()
                    fn()
                    times.append(time.perf_counter() - t0)
                times.sort()
                row[str(gap)] = times[len(times) // 2] * 1e6
            out["work"][label] = row
        return out
    finally:
        coord.close()


# -- restart ----------------------------------------------------------------------------------


def bench_restart(args, root) -> dict:
    cfg = shmkv.PoolConfig(num_blocks=256, max_seq_len=4096, **SMALL)
    path = os.path.join(root, "restart")
    per = 100
    prompts = prompts_for(args.restart_blocks // per, per, cfg.block_size, seed=4)
    with (
        shmkv.Coordinator.spawn(cfg, name=name(), tiers=[shmkv.DiskTier(path, 1 << 40)]) as coord,
        shmkv.connect(coord.address, timeout=120) as client,
    ):
        fill(client, prompts)
        on_disk = len(os.listdir(os.path.join(path, "blocks")))
    probe = random.Random(5).choice(prompts)
    t_spawn = time.perf_counter()
    with shmkv.Coordinator.spawn(cfg, name=name(), tiers=[shmkv.DiskTier(path, 1 << 40)]) as coord:
        t_ready = time.perf_counter()
        with shmkv.connect(coord.address, timeout=120) as client:
            tries = 0
            while True:
                tries += 1
                h = client.allocate(prompt=probe)
                cached = h.num_cached_tokens
                h.close()
                if cached:
                    t_hit = time.perf_counter()
                    break
            while client.stats()["block_io"]["scanning"]:
                time.sleep(0.001)
            t_scan = time.perf_counter()
            disk = next(t for t in client.stats()["tiers"] if t["tier"] == "disk")
    return {
        "blocks_on_disk": on_disk,
        "first_hit_cached_tokens": cached,
        "process_start_to_ready_s": t_ready - t_spawn,
        "ready_to_first_disk_hit_s": t_hit - t_ready,
        "ready_to_scan_done_s": t_scan - t_ready,
        "allocations_until_hit": tries,
        "disk": disk,
    }


# -- report -----------------------------------------------------------------------------------


def _commands(commands: dict) -> str:
    """ "`CMD` (part, part); ..." for the commands that last ran each part."""
    parts: Dict[str, List[str]] = {}
    for part, command in commands.items():
        parts.setdefault(command, []).append(part)
    return "; ".join(f"`{command}` ({', '.join(names)})" for command, names in parts.items())


def _slice_line(ping: dict) -> str:
    """What CPU slice the coordinators' loop thread ran with (``loop_slice_us``)."""
    own = "The coordinators' loop thread ran with its own CPU slice"
    if "loop_slice_us" not in ping.get("disk", {}):
        return f"{own} (a build before `loop_slice_us`)."
    got = ping["disk"]["loop_slice_us"]
    if got is None:
        return f"{own} (`loop_slice_us` 0, or a kernel that keeps none)."
    return f"The coordinators' loop thread asked for a CPU slice of {got:g} us (`loop_slice_us`)."


def markdown(res: dict) -> str:
    lines = [
        "# Tiers under the pool",
        "",
        f"Machine: {os.cpu_count()} cores, shared with other work (1-minute load average "
        f"after each part: "
        + ", ".join(f"{k} {v:.1f}" for k, v in res.get("load_average", {}).items())
        + ").",
        "Reproduce: `shmkv bench --only tiers` (every part), or with `-- --only "
        "PART ...` (the parts given; the others stay as they were). This file: "
        + _commands(res.get("commands", {}))
        + ".",
        f"Tier copies run in: {res.get('tier_copies', 'threads of the coordinator')}.",
        "",
    ]
    d = res.get("disk_bandwidth")
    if d:
        lines += [
            "## Promotion from disk vs a plain sequential read of the same files",
            "",
            f"{d['blocks']} blocks of {d['block_bytes'] // 1024} KiB, "
            f"{d['blocks_per_request']} per request.",
            "",
            "| page cache | promotion GB/s | plain read GB/s | ratio |",
            "|---|---|---|---|",
        ]
        for cache in ("cold", "warm"):
            r = d[cache]
            lines.append(
                f"| {cache} | {r['promotion_GBps']:.2f} | {r['plain_read_GBps']:.2f} "
                f"| {r['ratio']:.2f} |"
            )
        lines.append("")
    h = res.get("host_bandwidth")
    if h:
        lines += [
            "## Promotion from the host tier vs a plain copy",
            "",
            f"{h['blocks']} blocks of {h['block_bytes'] // 1024} KiB, "
            f"{h['blocks_per_request']} per request, passes of each alternating: promotion "
            f"{h['promotion_GBps']:.2f} GB/s, plain copy {h['plain_copy_GBps']:.2f} GB/s "
            f"(numpy's copyto; medians), ratio **{h['ratio']:.2f}** (the median of "
            + (
                f"{len(h['ratios'])} pairs, {min(h['ratios']):.2f}-{max(h['ratios']):.2f})."
                if h.get("ratios")
                else "the passes)."
            ),
            "",
        ]
        if h.get("ratios_same_copy"):
            same = h["ratios_same_copy"]
            lines += [
                "Promotions copy with the native row copy (stores past the caches). The same "
                f"copy alone, in a third pass of each round: {h['row_copy_GBps']:.2f} GB/s; "
                f"promotion against it {h['ratio_same_copy']:.2f} ({min(same):.2f}-"
                f"{max(same):.2f}): what the round trips and bookkeeping cost.",
                "",
            ]
        elif h.get("row_copy"):
            lines += [f"No native row copy here ({h['row_copy']}): promotions copy with numpy.", ""]
    p = res.get("ping")
    if p:
        lines += [
            "## Ping while another process promotes",
            "",
            'The last three rows are controls. "no tier": the same number of '
            'allocations a second as the host run, each a pool hit ("promoted '
            "blocks/s\": blocks hit), so the loop's own work for those requests. "
            '"pings alone": a process sending as many requests a second as the '
            "host run did (an allocation and a release per promoting request), each "
            'a ping ("promoted blocks/s": 0). "copies alone": a process copying '
            "as many blocks a second as the host run promoted, at the tier I/O "
            "process's priority, sending no request.",
            "",
            _slice_line(p),
            "",
            "| tier | idle p50 us | idle p99 us | promoting p50 us | promoting p99 us | "
            "p99 ratio | promoted blocks/s |",
            "|---|---|---|---|---|---|---|",
        ]
        for kind, r in p.items():
            if kind == "runs":
                continue
            lines.append(
                f"| {kind} | {r['idle']['p50_us']:.0f} | {r['idle']['p99_us']:.0f} | "
                f"{r['promoting']['p50_us']:.0f} | {r['promoting']['p99_us']:.0f} | "
                f"{r['p99_ratio']:.2f} | "
                f"{r['promoting']['promoted_blocks_per_s']:.0f} |"
            )
        lines.append("")
    runs = (p or {}).get("runs")
    if runs:
        lines += [
            f"Every run's p99 ratio ({len(runs)} runs, one after another; the table above "
            "is the last):",
            "",
            "| tier | "
            + " | ".join(f"run {i + 1}" for i in range(len(runs)))
            + " | min | median | max | runs <= 2x |",
            "|---|" + "---|" * (len(runs) + 4),
        ]
        for kind in runs[0]:
            got = [run[kind] for run in runs]
            lines.append(
                f"| {kind} | "
                + " | ".join(f"{v:.2f}" for v in got)
                + f" | {min(got):.2f} | {sorted(got)[len(got) // 2]:.2f} | {max(got):.2f} | "
                f"{sum(v <= 2 for v in got)} of {len(got)} |"
            )
        lines.append("")
    w = res.get("loop_cold")
    if w:
        gaps = [str(g) for g in w["gaps_ms"]]
        lines += [
            "## The loop's work for one request, back to back and after a pause",
            "",
            "The coordinator's own calls in one process, no socket: median of 200, "
            "each after a sleep of the given length (the loop sleeps between "
            "requests; its code and data then come back from memory). What a ping "
            "waits for when it arrives behind such a request.",
            "",
            "| work | "
            + " | ".join(f"{float(g):g} ms pause, us" for g in gaps)
            + f" | {float(gaps[-1]):g} ms / back to back |",
            "|---|" + "---|" * (len(gaps) + 1),
        ]
        for label, row in w["work"].items():
            lines.append(
                f"| {label} | "
                + " | ".join(f"{row[g]:.1f}" for g in gaps)
                + f" | {row[gaps[-1]] / row[gaps[0]]:.1f}x |"
            )
        lines.append("")
    c = res.get("chat")
    if c:
        lines += [
            "## Multi-turn chat trace",
            "",
            f"`{c['trace']}`: {c['requests']} requests, working set "
            f"{c['working_set_blocks']} blocks, pool {c['pool_blocks']} blocks "
            f"(block size {c['block_size']}).",
            "",
            "| run | prefix-hit rate | prompt tokens | prefill tokens | cached blocks "
            "checked (wrong) |",
            "|---|---|---|---|---|",
        ]
        for label in ("pool alone", "pool + host tier (1x pool) + disk tier"):
            r = c[label]
            lines.append(
                f"| {label} | {r['hit_rate']:.1%} | {r['prompt_tokens']} | "
                f"{r['prefill_tokens']} | {r['blocks_checked']} ({r['blocks_wrong']}) |"
            )
        io = c["pool + host tier (1x pool) + disk tier"].get("block_io") or {}
        lines += [
            "",
            f"Pool evictions whose block no tier had yet (write-behind behind): "
            f"{io.get('lost_evictions')}.",
        ]
        lines += [
            "",
            f"Prefill tokens saved by the tiers: **{c['prefill_tokens_saved_by_tiers']}**.",
            "",
        ]
    r = res.get("restart")
    if r:
        lines += [
            "## Restart with blocks on disk",
            "",
            f"{r['blocks_on_disk']} blocks on disk. Coordinator process start to ready "
            f"{r['process_start_to_ready_s']:.2f} s; ready to the first disk hit "
            f"**{r['ready_to_first_disk_hit_s'] * 1e3:.0f} ms** "
            f"({r['allocations_until_hit']} allocations); ready to every header "
            f"checked {r['ready_to_scan_done_s'] * 1e3:.0f} ms.",
            "",
        ]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes")
    parser.add_argument(
        "--out",
        default=None,
        help="results path without extension (default: benchmarks/results/tiers)",
    )
    parser.add_argument(
        "--trace", default=None, help="the chat trace (default: benchmarks/traces/chat.jsonl)"
    )
    parser.add_argument("--make-trace", metavar="PATH", help="write the chat trace and exit")
    parser.add_argument(
        "--ping-runs",
        type=int,
        default=1,
        help="how many times the ping part runs, each ratio reported (default 1)",
    )
    parser.add_argument(
        "--only",
        nargs="*",
        default=None,
        choices=["disk", "host", "ping", "cold", "chat", "restart"],
    )
    parser.add_argument("--dir", default=None, help="where the disk tiers go (default: /tmp)")
    parser.add_argument(
        "--spin-us",
        type=float,
        default=None,
        help="the coordinator's spin_us in the ping runs (default: spawn's)",
    )
    parser.add_argument(
        "--loop-slice-us",
        type=float,
        default=None,
        help="the coordinator's loop_slice_us in the ping runs (default: the coordinator's; "
        "0: the loop thread's own slice)",
    )
    parser.add_argument(
        "--decode-us",
        type=float,
        default=500.0,
        help="pretend decode time per reply token in the chat replay",
    )
    args = parser.parse_args(argv)
    args.out = args.out or result_base("tiers")
    args.trace = args.trace or trace_path()
    if args.make_trace:
        make_trace(args.make_trace)
        return 0
    args.pool_blocks = 32 if args.quick else 128
    args.prompt_blocks = 16 if args.quick else 32
    args.disk_blocks = 128 if args.quick else 768
    args.host_blocks = 128 if args.quick else 384
    args.reps = 2 if args.quick else 3
    args.ping_cycles = 6 if args.quick else 20
    args.restart_blocks = 2000 if args.quick else 10000
    if "SHMKV_RUNTIME_DIR" not in os.environ:  # a runtime directory of the run's own, removed
        runtime = tempfile.mkdtemp(prefix="shmkv-bench-")
        os.environ["SHMKV_RUNTIME_DIR"] = runtime
        atexit.register(shutil.rmtree, runtime, True)
    root = tempfile.mkdtemp(prefix="shmkv-bench-tiers-", dir=args.dir)
    res = {}
    if args.only and os.path.exists(args.out + ".json"):  # update the parts run again
        with open(args.out + ".json") as f:
            res = json.load(f)
    command = "shmkv bench --only tiers -- " + " ".join(argv or sys.argv[1:])
    res.pop("command", None)  # (one command for the whole file, before parts had theirs)
    res["tier_copies"] = (
        (
            f"tier I/O process, workers at {block_io.IO_PROCESS_POLICY} "
            f"priority (normal-priority ones after "
            f"{block_io.URGENT_AFTER_S * 1e3:g} ms without progress)"
        )
        if tiers_mod.IO_PROCESS
        else "threads of the coordinator"
    ) + (
        "; promotions: copied by the allocating client, whose coordinator runs in a "
        "process of its own (Client.copy_promotions)"
        if shmkv.Client.copy_promotions is not False
        else ""
    )
    from shmkv.kernels import native

    res["tier_copies"] += (
        "; blocks copied between the pool and host memory by the native row copy "
        "(stores past the caches)"
        if native.copier() is not None
        else f"; blocks copied with numpy (no native row copy: {native.copy_status()})"
    )
    only = set(args.only or ["disk", "host", "ping", "cold", "chat", "restart"])
    try:
        steps = (
            ("disk", "disk_bandwidth", bench_disk_bandwidth),
            ("host", "host_bandwidth", bench_host_bandwidth),
            ("ping", "ping", bench_pings),
            ("cold", "loop_cold", bench_cold),
            ("chat", "chat", bench_chat),
            ("restart", "restart", bench_restart),
        )
        for key, label, fn in steps:
            if key in only:
                t0 = time.perf_counter()
                res[label] = fn(args, root)
                res.setdefault("load_average", {})[label] = os.getloadavg()[0]
                res.setdefault("commands", {})[label] = command.strip()
                print(f"{label}: done in {time.perf_counter() - t0:.0f} s", flush=True)
                print(
                    json.dumps({k: v for k, v in res[label].items() if k != "stats"}, default=str)[
                        :1500
                    ],
                    flush=True,
                )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    write_results(args.out, res, markdown(res), sort_keys=True)
    print(markdown(res))
    return 0


def cli_args(quick: bool, out_dir: str, name=None) -> list:
    """The arguments ``shmkv bench --only tiers`` runs :func:`main` with (a quick run
    writes ``tiers-quick``, not the committed ``tiers``)."""
    name = name or ("tiers-quick" if quick else None)
    return (["--quick"] if quick else []) + (["--out", result_base(name, out_dir)] if name else [])


if __name__ == "__main__":
    sys.exit(main())
