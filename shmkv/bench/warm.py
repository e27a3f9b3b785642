"""Suite ``warm``: decode steps on a new pool, cold, populated and warm.

The first write to each 4 KiB page of a new shared-memory pool clears it, and the first
touch through a process's own mapping maps it: a decode step reaches a new page per
sequence, layer and K/V every other token (a token's K of 8 heads x 128 of bfloat16 is
2 KiB), so the first steps of new sequences on a new pool pay a page fault each.

Each run starts two coordinators (``Coordinator.spawn``, the pool in their own process)
and times the first ``--steps`` decode steps of ``--seqs`` new sequences (a kept batch:
``batch.extend(1)``, then a ``step.write`` of every layer's K and V), through a client
in this process, in four states of the pool:

* ``cold``: a coordinator started with ``populate=False``, a client without prefault;
* ``populated``: a coordinator whose background populate has finished, a client
  without prefault (its own mapping still faults each page once, cheaply);
* ``prefaulted``: the same pool, a new client with ``prefault=True``;
* ``warm``: the same client once it has written every page of the pool
  (``pool.zero_()``), new sequences again: the steady state, the baseline.

Each figure is the mean step over the timed steps, the median over ``--groups`` groups
of new sequences (kept until all are timed, so each group writes blocks no earlier one
did), as a ratio to ``warm`` in the same
run; runs are repeated (each on new pools) and reported with their spread. The
populate's and prefault's own time are reported per GiB. With ``--hugepages`` the
populated pool is made of huge pages where enough are free (see ``shmkv serve
--hugepages``), and the record says which it got. Writes
``benchmarks/results/warm.{json,md}``.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from typing import Any, Dict, List

from shmkv.bench.core import (
    BenchError,
    _model_config,
    _same_bits,
    _unique,
    markdown_table,
    paired_ratio,
    result_base,
    spread,
    write_results,
)

STATES = ("cold", "populated", "prefaulted", "warm")
TARGET = 1.2  # prefaulted / warm, after populate: the bound


def _steps(client, num_seqs: int, num_steps: int, layers, groups: int) -> float:
    """The mean seconds of the first ``num_steps`` decode steps of ``num_seqs`` new
    sequences: the median over ``groups`` groups of new sequences, each kept until all
    are done, so that each group's blocks are blocks no earlier group wrote. Checks one
    written value of each group, then closes them all."""
    held, means = [], []
    for _ in range(groups):
        handles = client.allocate_many([0] * num_seqs)
        held += handles
        batch = client.batch(handles)
        t0 = time.perf_counter()
        for _ in range(num_steps):
            step = batch.extend(1)
            for layer, (k, v) in enumerate(layers):
                step.write(layer, k, v)
        means.append((time.perf_counter() - t0) / num_steps)
        last = handles[-1].gather_all()[:, :, -1]
        k, v = layers[0]
        if not (_same_bits(last[0, 0], k[-1]) and _same_bits(last[0, 1], v[-1])):
            raise BenchError("a decode step wrote wrong values")
    client.close_many(held)
    return statistics.median(means)


def _wait_populated(client, timeout: float = 600.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        memory = client.stats()["pool_memory"]
        if memory["populate"]["state"] != "running":
            if memory["populate"]["state"] != "done":
                raise BenchError(f"populate did not finish: {memory['populate']}")
            return memory
        if time.monotonic() > deadline:
            raise BenchError(f"populate still running after {timeout} s")
        time.sleep(0.05)


def one_run(num_blocks: int, num_seqs: int, num_steps: int, groups: int, hugepages: bool) -> dict:
    """One run of the four states, each pool new."""
    import torch

    from shmkv.client.client import connect
    from shmkv.coordinator.server import Coordinator

    cfg = _model_config(num_blocks)
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(cfg.num_layers, 2, num_seqs, cfg.num_kv_heads, cfg.head_dim, generator=gen)
    kv = kv.to(torch.bfloat16)
    layers = [(kv[layer, 0], kv[layer, 1]) for layer in range(cfg.num_layers)]
    out: Dict[str, Any] = {}
    gib = cfg.nbytes / 2**30

    t0 = time.perf_counter()
    coord = Coordinator.spawn(cfg, name=_unique("warm-cold"), timeout=300, populate=False)
    out["start_s_cold"] = time.perf_counter() - t0  # (the pool reserved: posix_fallocate)
    try:
        client = connect(coord.address, timeout=120)
        out["cold"] = _steps(client, num_seqs, num_steps, layers, groups)
        client.close()
    finally:
        coord.stop()
    del client
    gc.collect()  # (the pool's mapping goes with its last tensor)

    t0 = time.perf_counter()
    coord = Coordinator.spawn(
        cfg, name=_unique("warm"), timeout=300, populate=True, hugepages=hugepages
    )
    out["start_s"] = time.perf_counter() - t0  # (huge pages are cleared as they are reserved)
    try:
        client = connect(coord.address, timeout=120)
        memory = _wait_populated(client)
        out["populate_s_per_gib"] = memory["populate"]["seconds"] / gib
        out["hugepages"] = memory["hugepages"]
        out["hugepages_fallback"] = memory["hugepages_fallback"]
        out["populated"] = _steps(client, num_seqs, num_steps, layers, groups)
        client.close()
        del client
        gc.collect()
        client = connect(coord.address, timeout=120, prefault=True)
        out["prefault_s_per_gib"] = client.prefault_s / gib
        out["prefaulted"] = _steps(client, num_seqs, num_steps, layers, groups)
        client.pool.zero_()  # every page written once through this mapping
        out["warm"] = _steps(client, num_seqs, num_steps, layers, groups)
        client.close()
        del client
    finally:
        coord.stop()
    gc.collect()
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="runs, each on new pools")
    parser.add_argument("--pool-gib", type=float, default=2.0, help="pool size (GiB)")
    parser.add_argument("--seqs", type=int, default=64, help="sequences in a step")
    parser.add_argument("--steps", type=int, default=32, help="timed steps per group")
    parser.add_argument("--groups", type=int, default=4, help="groups of new sequences per state")
    parser.add_argument("--hugepages", action="store_true", help="populated pools of huge pages")
    parser.add_argument("--out", default=None, help="default benchmarks/results/warm")
    args = parser.parse_args(argv)
    block_nbytes = _model_config(1).block_nbytes
    num_blocks = max(1, int(args.pool_gib * 2**30) // block_nbytes)
    per_seq = -(-args.steps // _model_config(1).block_size)
    if args.groups * args.seqs * per_seq > num_blocks:
        parser.error(f"{args.groups} groups of {args.seqs} sequences do not fit the pool")
    runs: List[dict] = []
    for i in range(args.runs):
        run = one_run(num_blocks, args.seqs, args.steps, args.groups, args.hugepages)
        runs.append(run)
        print(
            f"warm: run {i + 1}: "
            + ", ".join(f"{s} {run[s] * 1e3:.2f} ms" for s in STATES)
            + f"; populate {run['populate_s_per_gib']:.2f} s/GiB, "
            f"prefault {run['prefault_s_per_gib']:.3f} s/GiB",
            flush=True,
        )
    cfg = _model_config(num_blocks)
    warm = [r["warm"] for r in runs]
    ratios = {s: paired_ratio([r[s] for r in runs], warm) for s in STATES}
    per_run = {s: [r[s] / r["warm"] for r in runs] for s in STATES}
    met = all(x <= TARGET for x in per_run["prefaulted"])
    record: Dict[str, Any] = {
        "suite": "warm",
        "params": {
            "runs": args.runs,
            "pool_bytes": cfg.nbytes,
            "num_blocks": num_blocks,
            "seqs": args.seqs,
            "steps": args.steps,
            "groups": args.groups,
            "model": {k: getattr(cfg, k) for k in ("num_layers", "num_kv_heads", "head_dim")},
            "dtype": str(cfg.dtype),
            "block_size": cfg.block_size,
            "hugepages_asked": args.hugepages,
        },
        "runs": runs,
        "step_s": {s: spread([r[s] for r in runs]) for s in STATES},
        "ratio_to_warm": ratios,
        "ratio_to_warm_spread": {s: spread(per_run[s]) for s in STATES},
        "populate_s_per_gib": spread([r["populate_s_per_gib"] for r in runs]),
        "prefault_s_per_gib": spread([r["prefault_s_per_gib"] for r in runs]),
        "start_s": spread([r["start_s"] for r in runs]),
        "start_s_cold": spread([r["start_s_cold"] for r in runs]),
        "target": f"prefaulted / warm <= {TARGET} in every run",
        "met": met,
    }
    rows = [["state", "step (ms, median)", "/ warm (median)", "/ warm (min-max)"]]
    for s in STATES:
        sp = record["ratio_to_warm_spread"][s]
        rows.append(
            [
                s,
                f"{record['step_s'][s]['median'] * 1e3:.2f}",
                f"{ratios[s]:.2f}x",
                f"{sp['min']:.2f}-{sp['max']:.2f}x",
            ]
        )
    backing = "huge pages" if all(r["hugepages"] for r in runs) else "4 KiB pages (/dev/shm)"
    fallback = next((r["hugepages_fallback"] for r in runs if r["hugepages_fallback"]), "")
    md = (
        f"# warm: decode steps on a new pool\n\n"
        f"{args.runs} runs, each on new pools of {cfg.nbytes / 2**30:.2f} GiB (populated: "
        f"{backing}{'; huge pages asked for, not used: ' + fallback if fallback else ''}; "
        "cold: 4 KiB pages, never populated); "
        f"the first {args.steps} decode steps of {args.seqs} new sequences, mean step, median "
        f"over {args.groups} groups of new sequences on blocks no earlier group wrote; "
        f"{cfg.num_layers} layers, {cfg.num_kv_heads} x {cfg.head_dim}, {cfg.dtype}. "
        "`warm` (every page written once through the worker's mapping) is the baseline "
        "of its run. See `shmkv/bench/warm.py`.\n\n"
        + markdown_table(rows)
        + "\n\nPopulate (coordinator, background): "
        f"{record['populate_s_per_gib']['median']:.2f} s/GiB "
        f"({record['populate_s_per_gib']['min']:.2f}-{record['populate_s_per_gib']['max']:.2f}); "
        f"prefault (worker, at attach): {record['prefault_s_per_gib']['median']:.3f} s/GiB. "
        f"Coordinator start (spawn to ready, pool reserved): "
        f"{record['start_s']['median']:.2f} s populated, "
        f"{record['start_s_cold']['median']:.2f} s cold.\n\n"
        f"Target: {record['target']}: **{'met' if met else 'missed'}**.\n"
    )
    print(md)
    write_results(args.out or result_base("warm"), record, md, indent=2)
    return 0


def cli_args(quick: bool, out_dir: str, name=None) -> list:
    """The arguments ``shmkv bench --only warm`` runs :func:`main` with (a quick run:
    2 runs on 1 GiB pools, written as ``warm-quick``)."""
    name = name or ("warm-quick" if quick else "warm")
    extra = ["--runs", "2", "--pool-gib", "1"] if quick else []
    return ["--out", result_base(name, out_dir)] + extra


if __name__ == "__main__":
    sys.exit(main())
