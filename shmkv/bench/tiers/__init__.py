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

The suite is a package, one file a part::

    common.py     pools, clients, fills, plain reads
    bandwidth.py  promotion bandwidth (disk, host)
    ping.py       ping p99 under promotions, and its controls
    chat.py       the chat trace replayed
    restart.py    the first disk hit after a restart
    report.py     the markdown

This ``__init__`` has the command line (:func:`main`).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import sys
import tempfile
import time

import shmkv
from shmkv import tiers as tiers_mod
from shmkv.bench.core import result_base, trace_path, write_results
from shmkv.bench.tiers.bandwidth import bench_disk_bandwidth, bench_host_bandwidth
from shmkv.bench.tiers.chat import bench_chat, make_trace
from shmkv.bench.tiers.ping import bench_pings
from shmkv.bench.tiers.report import markdown
from shmkv.bench.tiers.restart import bench_cold, bench_restart
from shmkv.memory import block_io


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
