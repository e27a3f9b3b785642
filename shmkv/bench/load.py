"""Suite ``load``: the coordinator under load from several clients at rising offered rates.

    shmkv bench --only load [--quick] [-- --clients 1 2 4 8 --rates 250 1000 4000]

K client processes (``--clients``; spawned) share a coordinator (``Coordinator.spawn``)
whose CPU pool holds half the prompts' blocks, with a host tier under it holding all of
them, so that prompt allocations are in part pool hits and in part promotions from the
tier. Each client sends, open loop at its share of the offered rate (``--rates``: ops a
second over all clients), rounds of 16 operations, the mix of a decode server:

* ``allocate``: ``allocate_many`` of 4 prompts (4 blocks each; hits or promotions),
  which become the client's decode batch;
* ``extend``: ``batch.extend(1)`` of that kept batch (13 of the 16);
* ``commit``: the last step's ``commit``;
* ``close``: ``close_many`` of the batch.

Each op's latency is counted from the time the schedule said to send it (so a client
that falls behind counts its wait: no coordinated omission), and reported as p50, p99
and p999 per op and offered rate, with the rate the clients achieved and the
coordinator's CPU time per op (its process's user + system time over the phase, over the
ops served). The ping-during-promotion figure of the tiers suite (``ping_run``: ping p99
while another client promotes at full speed, against idle) runs on the same
coordinator after the load phases. Writes ``benchmarks/results/load.{json,md}`` and a
plot of p99 against offered load.
"""

from __future__ import annotations

import argparse
import os
import queue as queue_mod
import random
import sys
import time
from typing import Any, Dict, List

import shmkv
from shmkv.bench.core import (
    SPAWN,
    BenchError,
    markdown_table,
    plot_path,
    process_cpu_s,
    pyplot,
    result_base,
    spread,
    write_results,
)
from shmkv.bench.tiers.common import evict_all, fill, prompts_for, wait_idle
from shmkv.bench.tiers.ping import ping_run

OPS = ("allocate", "extend", "commit", "close")
ROUND = ["allocate"] + ["extend"] * 12 + ["commit", "extend", "close"]  # 16 ops
BATCH = 4  # sequences a client's decode batch holds
PROMPT_BLOCKS = 4
READY_TIMEOUT_S = 120.0  # clients import torch and connect before the first phase
MODEL: Dict[str, Any] = dict(
    num_layers=8, num_kv_heads=8, head_dim=128, block_size=16, dtype="float16"
)


def _pct(values: List[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def _client(address, prompts, rates, phase_s, start, seed, ready, queue) -> None:
    """:func:`_phases`, its failure put on the queue (the parent raises it at once)."""
    try:
        _phases(address, prompts, rates, phase_s, start, seed, ready, queue)
    except BaseException as e:
        queue.put((seed, f"{type(e).__name__}: {e}"))
        raise


def _phases(address, prompts, rates, phase_s, start, seed, ready, queue) -> None:
    """Once connected, say so on ``ready`` and wait for the parent to set the start time
    (``start``, a shared double: every client ready). Then run every phase (one offered
    rate each, from the start time, ``phase_s`` apart plus a pause): the round's ops open
    loop at ``rate`` a second; put each phase's latencies per op and the ops done."""
    rng = random.Random(seed)
    out = []
    with shmkv.connect(address, timeout=60) as client:
        ready.put(seed)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not start.value:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no start time within {READY_TIMEOUT_S} s")
            time.sleep(0.005)
        start_at = start.value
        handles: list = []
        batch = step = None
        for i, rate in enumerate(rates):
            begin = start_at + i * (phase_s + 1.0)
            end = begin + phase_s
            lat: Dict[str, List[float]] = {op: [] for op in OPS}
            done = 0
            due = begin
            n = 0
            while True:
                now = time.monotonic()
                if due >= end:
                    break
                if due > now:
                    time.sleep(due - now)
                op = ROUND[n % len(ROUND)]
                if op == "allocate" and handles:
                    op = "extend"  # (a round left unfinished by the last phase)
                if op != "allocate" and not handles:
                    op = "allocate"
                if op == "allocate":
                    picks = [rng.choice(prompts) for _ in range(BATCH)]
                    handles = client.allocate_many([{"prompt": p} for p in picks])
                    batch = client.batch(handles)
                elif op == "extend":
                    assert batch is not None
                    step = batch.extend(1)
                elif op == "commit":
                    assert step is not None
                    step.commit()
                else:
                    client.close_many(handles)
                    handles, batch, step = [], None, None
                lat[op].append(time.monotonic() - due)
                done += 1
                n += 1
                due += 1.0 / rate
            if handles:
                client.close_many(handles)
                handles, batch, step = [], None, None
            out.append({"lat": lat, "done": done})
    queue.put((seed, out))


def _start_when_ready(ready, failures, clients: int, start) -> float:
    """Wait until every client is connected, then set and return the start time every
    client reads from ``start``. A failure (on ``failures``, where the phases find it) or
    :data:`READY_TIMEOUT_S` ends the wait early: those connected then run without the
    others, and the results say what failed."""
    waiting = set(range(clients))
    deadline = time.monotonic() + READY_TIMEOUT_S
    while waiting and failures.empty() and time.monotonic() < deadline:
        try:
            waiting.discard(ready.get(timeout=0.05))
        except queue_mod.Empty:
            pass
    start.value = start_at = time.monotonic() + 0.2
    return start_at


def one_k(
    cfg,
    prompts,
    clients: int,
    rates: List[float],
    phase_s: float,
    ping_cycles: int,
    min_clients: int,
    options: dict,
) -> List[dict]:
    """Every offered rate with ``clients`` clients, on a coordinator of its own
    (``Coordinator.spawn`` with ``options``)."""
    spec = shmkv.HostTier((len(prompts) * PROMPT_BLOCKS + 8) * cfg.block_nbytes)
    name = f"bench-load-{os.getpid()}"
    with (
        shmkv.Coordinator.spawn(cfg, name=name, tiers=[spec], **options) as coord,
        shmkv.connect(coord.address, timeout=120) as client,
    ):
        fill(client, prompts)
        evict_all(client)
        wait_idle(client)
        q, ready, start = SPAWN.Queue(), SPAWN.Queue(), SPAWN.Value("d", 0.0)
        procs = [
            SPAWN.Process(
                target=_client,
                args=(
                    coord.address,
                    prompts,
                    [r / clients for r in rates],
                    phase_s,
                    start,
                    s,
                    ready,
                    q,
                ),
            )
            for s in range(clients)
        ]
        for p in procs:
            p.start()
        start_at = _start_when_ready(ready, q, clients, start)
        points = []
        for i, rate in enumerate(rates):
            if not q.empty():  # a client failed (its phases' results come at the end)
                break
            begin = start_at + i * (phase_s + 1.0)
            time.sleep(max(0.0, begin - time.monotonic()))
            cpu0, st0 = process_cpu_s(coord.pid), client.stats()
            time.sleep(max(0.0, begin + phase_s - time.monotonic()))
            cpu1, st1 = process_cpu_s(coord.pid), client.stats()
            host0 = next(t for t in st0["tiers"] if t["tier"] == "host")
            host1 = next(t for t in st1["tiers"] if t["tier"] == "host")
            points.append(
                {
                    "clients": clients,
                    "offered_ops_s": rate,
                    "loop_cpu_s": cpu1 - cpu0,
                    "promoted_blocks": host1["promotions"] - host0["promotions"],
                }
            )
        try:
            results = dict(q.get(timeout=60) for _ in procs)
        finally:
            for p in procs:
                p.join(30)
                if p.is_alive():
                    p.kill()
                    p.join(5)
        failed = [r for r in results.values() if isinstance(r, str)]
        if failed:
            raise BenchError(f"a load client failed: {failed[0]}")
        for i, point in enumerate(points):
            lat: Dict[str, List[float]] = {op: [] for op in OPS}
            done = 0
            for phases in results.values():
                for op in OPS:
                    lat[op] += phases[i]["lat"][op]
                done += phases[i]["done"]
            point["achieved_ops_s"] = done / phase_s
            point["loop_cpu_us_per_op"] = 1e6 * point["loop_cpu_s"] / max(done, 1)
            point["promoted_blocks_per_s"] = point["promoted_blocks"] / phase_s
            point["ops"] = {
                op: {
                    "n": len(lat[op]),
                    "p50_us": 1e6 * _pct(lat[op], 0.5),
                    "p99_us": 1e6 * _pct(lat[op], 0.99),
                    "p999_us": 1e6 * _pct(lat[op], 0.999),
                }
                for op in OPS
            }
        ping = None
        if clients == min_clients and ping_cycles:  # the tiers suite's figure, here
            evict_all(client)
            wait_idle(client)
            ping = ping_run(coord.address, prompts, cfg.block_size, ping_cycles)
            ping["p99_ratio"] = ping["promoting"]["p99_us"] / ping["idle"]["p99_us"]
    return [dict(p, ping=ping) if ping and j == 0 else p for j, p in enumerate(points)]


def _plot(points: List[dict], path: str) -> bool:
    try:
        plt = pyplot()
    except ImportError:
        return False
    fig, axes = plt.subplots(1, len(OPS), figsize=(4 * len(OPS), 3.5), sharey=True)
    for ax, op in zip(axes, OPS):
        for k in sorted({p["clients"] for p in points}):
            mine = [p for p in points if p["clients"] == k]
            ax.plot(
                [p["offered_ops_s"] for p in mine],
                [p["ops"][op]["p99_us"] for p in mine],
                marker="o",
                label=f"{k} clients",
            )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(f"{op} p99")
        ax.set_xlabel("offered ops/s")
    axes[0].set_ylabel("us")
    axes[0].legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--rates", type=float, nargs="+", default=[250, 1000, 4000])
    parser.add_argument("--phase-s", type=float, default=3.0, help="seconds per offered rate")
    parser.add_argument("--pool-blocks", type=int, default=256)
    parser.add_argument("--ping-cycles", type=int, default=5, help="0: no ping figure")
    parser.add_argument(
        "--spin-us", type=float, default=None, help="the coordinator's spin_us (default: spawn's)"
    )
    parser.add_argument(
        "--loop-slice-us",
        type=float,
        default=None,
        help="the coordinator's loop_slice_us (default: the coordinator's; 0: the loop "
        "thread's own slice)",
    )
    parser.add_argument("--out", default=None, help="default benchmarks/results/load")
    parser.add_argument("--plot", default=None, help="default benchmarks/plots/load.png")
    args = parser.parse_args(argv)
    cfg = shmkv.PoolConfig(num_blocks=args.pool_blocks, **MODEL)
    # twice the pool: about half the prompt allocations come up from the host tier
    prompts = prompts_for(2 * args.pool_blocks // PROMPT_BLOCKS, PROMPT_BLOCKS, 16, seed=5)
    points: List[dict] = []
    for k in args.clients:
        options = {
            name: value
            for name, value in (("spin_us", args.spin_us), ("loop_slice_us", args.loop_slice_us))
            if value is not None
        }
        got = one_k(
            cfg, prompts, k, args.rates, args.phase_s, args.ping_cycles, min(args.clients), options
        )
        points += got
        for p in got:
            print(
                f"load: {k} clients, offered {p['offered_ops_s']:.0f} ops/s: achieved "
                f"{p['achieved_ops_s']:.0f}, loop {p['loop_cpu_us_per_op']:.1f} us CPU/op, "
                + ", ".join(
                    f"{op} p99 {p['ops'][op]['p99_us']:.0f} us" for op in OPS if p["ops"][op]["n"]
                ),
                flush=True,
            )
    ping = next((p["ping"] for p in points if p.get("ping")), None)
    rows = [
        ["clients", "offered ops/s", "achieved ops/s", "promoted blocks/s", "loop CPU us/op"]
        + [f"{op} p50 / p99 / p999 us" for op in OPS]
    ]
    for p in points:
        rows.append(
            [
                p["clients"],
                f"{p['offered_ops_s']:.0f}",
                f"{p['achieved_ops_s']:.0f}",
                f"{p['promoted_blocks_per_s']:.0f}",
                f"{p['loop_cpu_us_per_op']:.1f}",
            ]
            + [
                "{:.0f} / {:.0f} / {:.0f}".format(
                    p["ops"][op]["p50_us"], p["ops"][op]["p99_us"], p["ops"][op]["p999_us"]
                )
                for op in OPS
            ]
        )
    plotted = _plot(points, args.plot or plot_path("load"))
    record = {
        "suite": "load",
        "params": {
            "clients": args.clients,
            "rates": args.rates,
            "phase_s": args.phase_s,
            "pool_blocks": args.pool_blocks,
            "prompts": len(prompts),
            "prompt_blocks": PROMPT_BLOCKS,
            "round": ROUND,
            "batch": BATCH,
            "model": MODEL,
            "cpus": os.cpu_count(),
        },
        "points": [{k: v for k, v in p.items() if k != "ping"} for p in points],
        "ping": None
        if ping is None
        else {k: v for k, v in ping.items() if k in ("idle", "promoting", "p99_ratio")},
        "loop_cpu_us_per_op": spread([p["loop_cpu_us_per_op"] for p in points]),
    }
    md = (
        "# load: the coordinator under load from several clients\n\n"
        f"K client processes, open loop, each at its share of the offered rate; rounds of "
        f"16 ops: allocate_many of {BATCH} prompts of {PROMPT_BLOCKS} blocks (the pool holds "
        f"half the {len(prompts)} prompts, a host tier all: hits and promotions), 13 "
        "kept-batch extend(1), a commit, a close_many. Latency from the scheduled send "
        f"time; {args.phase_s:.0f} s a rate; {os.cpu_count()} CPUs shared by the clients, "
        "the coordinator and its tier I/O process. Loop CPU: the coordinator process's "
        "user + system time over the ops served. See `shmkv/bench/load.py`.\n\n"
        + markdown_table(rows)
        + "\n"
    )
    if ping is not None:
        md += (
            "\nPing while another client promotes from the host tier at full speed "
            f"(this coordinator, {args.ping_cycles} cycles of 0.5 s idle, 0.5 s "
            f"promoting): idle p99 {ping['idle']['p99_us']:.0f} us, "
            f"promoting p99 {ping['promoting']['p99_us']:.0f} us: "
            f"**{ping['p99_ratio']:.2f}x** (target <= 2).\n"
        )
    if plotted:
        md += "\n![p99 against offered load](../plots/load.png)\n"
    print(md)
    write_results(args.out or result_base("load"), record, md, indent=2)
    return 0


def cli_args(quick: bool, out_dir: str, name=None) -> list:
    """The arguments ``shmkv bench --only load`` runs :func:`main` with (quick: 1 and 4
    clients, two rates, 2 s each, written as ``load-quick``)."""
    name = name or ("load-quick" if quick else "load")
    extra = ["--clients", "1", "4", "--rates", "250", "2000", "--phase-s", "2"] if quick else []
    return ["--out", result_base(name, out_dir), "--plot", plot_path(name, out_dir)] + extra


if __name__ == "__main__":
    sys.exit(main())
