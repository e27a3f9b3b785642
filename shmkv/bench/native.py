"""Suite ``native``: decode attention of one layer: the native kernel against
paged_attention's torch path.

One query token per sequence, float32 (or ``--dtype bfloat16`` / ``float16``), one torch
thread, K/V pages laid out as in the pool (indexed ``[num_blocks, num_layers, 2,
block_size, kv_heads, head_dim]``, stored layer-major; one layer's view), each
sequence's blocks in a run as a fresh pool hands them out. Per case, in interleaved
rounds (median of the rounds):

* ``native``: ``paged_attention`` with its plan, the kernel reading the pages in place;
* ``native, block-major``: the same over a copy of the pool stored block-major (layout
  version 1: a layer's page of one block a whole block from the next), what the
  storage order is worth;
* ``torch path``: the same call with the kernel off (two ``index_select`` of the pages
  into a reused workspace, then SDPA with the query heads folded);
* ``contiguous SDPA``: SDPA over K/V already contiguous ``[batch, kv_heads, keys,
  head_dim]`` in process memory (the floor of an in-process cache: no copy at all).

"hot": the same call back to back. "cold": before each call a read of 64 MiB evicts the
CPU caches, as a model's weights do between two attention layers. Every case first
checks the three results equal. Writes ``benchmarks/results/native.{json,md}``
(``native-DTYPE`` for the other dtypes).

    shmkv bench --only native [-- --rounds 7 --dtype bfloat16]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Mapping, Tuple

import torch
import torch.nn.functional as F

from shmkv.bench.core import result_base, write_results
from shmkv.kernels import native
from shmkv.kernels.attention import AttentionWorkspace, PagedAttentionPlan, paged_attention
from shmkv.memory.pool import pool_view

BLOCK = 16
# (label, query heads, K/V heads, head_dim, layers in the pool)
SHAPES = [
    ("8:2 x 32 (the transformers benchmark's)", 8, 2, 32, 8),
    ("16:4 x 128 (1-3B models)", 16, 4, 128, 4),
    ("32:8 x 128 (Llama-3-8B)", 32, 8, 128, 4),
    ("32:32 x 128 (Llama-2-7B)", 32, 32, 128, 2),
]
CASES = [(1, 4096), (4, 1024), (16, 1024)]


def make(heads, kv_heads, dim, layers, batch, keys, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    per_row = -(-keys // BLOCK)
    num_blocks = batch * per_row + 1
    pool = torch.randn(layers, 2, num_blocks, BLOCK, kv_heads, dim, generator=gen).to(dtype)
    pool = pool_view(pool)  # as shmkv stores it: layer-major
    layer = layers // 2
    k_pages, v_pages = pool[:, layer, 0], pool[:, layer, 1]
    table = torch.arange(batch * per_row, dtype=torch.int32).view(batch, per_row)
    q = torch.randn(batch, heads, dim, generator=gen).to(dtype)
    lens = [keys] * batch
    k = k_pages[table.long()].reshape(batch, -1, kv_heads, dim)[:, :keys].transpose(1, 2)
    v = v_pages[table.long()].reshape(batch, -1, kv_heads, dim)[:, :keys].transpose(1, 2)
    blocked = pool.contiguous()  # the same values stored block-major
    return (
        q,
        k_pages,
        v_pages,
        table,
        lens,
        k.contiguous(),
        v.contiguous(),
        (blocked[:, layer, 0], blocked[:, layer, 1]),
    )


def time_case(
    fns: Mapping[str, Callable[[], object]], cold: bool, rounds: int, flush: torch.Tensor
) -> Dict[str, float]:
    per: Dict[str, List[float]] = {name: [] for name in fns}
    calls = 3 if cold else 20
    for r in range(rounds + 1):
        order = list(fns) if r % 2 else list(fns)[::-1]
        for name in order:
            fn = fns[name]
            total = 0.0
            for _ in range(calls):
                if cold:
                    flush.sum()
                t0 = time.perf_counter()
                fn()
                total += time.perf_counter() - t0
            if r:
                per[name].append(total / calls * 1e6)
    return {name: statistics.median(v) for name, v in per.items()}


def case_fns(
    heads: int, kv_heads: int, dim: int, layers: int, batch: int, keys: int, dtype: torch.dtype
) -> Tuple[Dict[str, Callable[[], torch.Tensor]], float]:
    """The four calls of one case (by name, as :func:`time_case` takes them), checked to
    give the same result, and the MiB of K/V they read."""
    q, k_pages, v_pages, table, lens, k, v, (kb_pages, vb_pages) = make(
        heads, kv_heads, dim, layers, batch, keys, dtype=dtype
    )
    plan = PagedAttentionPlan(q, k_pages, table, lens)
    workspace = AttentionWorkspace()
    decoder = native.decoder
    group = heads // kv_heads

    def run_native() -> torch.Tensor:
        return paged_attention(q, k_pages, v_pages, plan=plan, workspace=workspace)

    def run_blocked() -> torch.Tensor:
        return paged_attention(q, kb_pages, vb_pages, plan=plan, workspace=workspace)

    def run_torch() -> torch.Tensor:
        native.decoder = lambda: None
        try:
            return paged_attention(q, k_pages, v_pages, plan=plan, workspace=workspace)
        finally:
            native.decoder = decoder

    def run_dense() -> torch.Tensor:
        return F.scaled_dot_product_attention(q.view(batch, kv_heads, group, dim), k, v).reshape(
            batch, heads, dim
        )

    a, b, c = run_native(), run_torch(), run_dense()
    torch.testing.assert_close(run_blocked(), a, rtol=0, atol=0)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    torch.testing.assert_close(a, c, rtol=tol, atol=tol)
    fns = {
        "native": run_native,
        "torch path": run_torch,
        "contiguous SDPA": run_dense,
        "native, block-major": run_blocked,
    }
    return fns, 2 * k.numel() * k.element_size() / 2**20


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument(
        "--shapes", type=int, default=len(SHAPES), help="the first this many head shapes only"
    )
    parser.add_argument(
        "--out",
        default=None,
        help="default benchmarks/results/native (native-DTYPE for the others)",
    )
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    if args.out is None:
        args.out = result_base("native" if args.dtype == "float32" else f"native-{args.dtype}")
    torch.set_num_threads(1)
    if native.decoder() is None:
        print(f"the native kernel is not available: {native.status()}")
        return 1
    flush = torch.ones(16 << 20)
    rows: List[Dict[str, Any]] = []
    for label, heads, kv_heads, dim, layers in SHAPES[: args.shapes]:
        for batch, keys in CASES:
            fns, kv_mb = case_fns(heads, kv_heads, dim, layers, batch, keys, dtype)
            row: Dict[str, Any] = {"shape": label, "batch": batch, "keys": keys, "kv_mb": kv_mb}
            for mode in ("hot", "cold"):
                res = time_case(fns, mode == "cold", args.rounds, flush)
                row[mode] = res
                row[mode + "_speedup"] = res["torch path"] / res["native"]
                row[mode + "_storage"] = res["native, block-major"] / res["native"]
            rows.append(row)
            print(
                f"{label} batch {batch} keys {keys}: hot native {row['hot']['native']:.0f} us "
                f"torch {row['hot']['torch path']:.0f} ({row['hot_speedup']:.2f}x); cold "
                f"native {row['cold']['native']:.0f} torch {row['cold']['torch path']:.0f} "
                f"({row['cold_speedup']:.2f}x)",
                flush=True,
            )
    result = {
        "host": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "dtype": args.dtype,
        "rounds": args.rounds,
        "block_size": BLOCK,
        "rows": rows,
    }
    lines = [
        f"Decode attention of one layer, {args.dtype}, one torch thread, {BLOCK}-token "
        f"blocks, us per call, median of {args.rounds} interleaved rounds ({result['host']}). "
        '"speedup": the torch path\'s time over the native kernel\'s. "cold": a 64 MiB '
        "read before each call evicts the CPU caches, as a model's weights do between "
        'layers. "block-major": the kernel over the same pages stored as the pool was '
        "before layout version 2 (a layer's page of one block a whole block from the "
        'next); "storage": its time over the kernel\'s on the pool as stored now '
        "(layer-major). Reproduce: `shmkv bench --only native"
        + ("" if args.dtype == "float32" else f" -- --dtype {args.dtype}")
        + "`.",
        "",
        "| heads (query:K/V x dim) | batch | keys | K/V MiB | hot: native | torch path | "
        "contiguous SDPA | speedup | block-major | storage | cold: native | torch path | "
        "contiguous SDPA | speedup | block-major | storage |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        h, c = r["hot"], r["cold"]
        lines.append(
            f"| {r['shape']} | {r['batch']} | {r['keys']} | {r['kv_mb']:.1f} | "
            f"{h['native']:.0f} | {h['torch path']:.0f} | {h['contiguous SDPA']:.0f} | "
            f"**{r['hot_speedup']:.2f}x** | {h['native, block-major']:.0f} | "
            f"{r['hot_storage']:.2f}x | {c['native']:.0f} | {c['torch path']:.0f} | "
            f"{c['contiguous SDPA']:.0f} | **{r['cold_speedup']:.2f}x** | "
            f"{c['native, block-major']:.0f} | {r['cold_storage']:.2f}x |"
        )
    write_results(args.out, result, "\n".join(lines))
    print("\n".join(lines))
    return 0


def cli_args(quick: bool, out_dir: str, name=None) -> list:
    """The arguments ``shmkv bench --only native`` runs :func:`main` with (a quick run
    writes ``native-quick``, not the committed ``native``)."""
    name = name or ("native-quick" if quick else None)
    args = ["--rounds", "3", "--shapes", "1"] if quick else []
    return args + (["--out", result_base(name, out_dir)] if name else [])


if __name__ == "__main__":
    sys.exit(main())
