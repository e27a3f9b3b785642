"""Suite ``attention``: shmkv.kernels.attention.paged_attention against the first (reference)
implementation.

One attention-layer call per case, on one CPU thread, with K/V pages laid out as in
the pool (``[num_blocks, num_layers, 2, block_size, kv_heads, head_dim]``, one layer's
view). The baseline takes the padded batch form it always took; the new code takes
the same batch, then an engine step's packed tokens (``query_start_loc``, no padding),
then the packed tokens with an ``AttentionWorkspace`` reused across calls. Each case
first checks that all give the same result. Writes
``benchmarks/results/attention.{json,md}``.

    shmkv bench --only attention [-- --seconds 0.4]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch

from shmkv.bench.core import result_base, write_results
from shmkv.kernels.attention import AttentionWorkspace, paged_attention
from shmkv.memory.pool import pool_view

NUM_LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 8, 8, 2, 32, 16
WAYS = ("baseline", "batch", "packed", "+ws")


def baseline_paged_attention(
    query, k_pages, v_pages, block_table, seq_lens, *, scale=None, causal=True, query_start=None
):
    """The reference implementation this replaces: every sequence's blocks gathered into
    a padded dense batch, all K/V upcast to float32, einsum + softmax."""
    decode = query.dim() == 3
    q = query.unsqueeze(1) if decode else query
    batch, q_len, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_pages.shape
    lens = torch.as_tensor(seq_lens).to(torch.int64)
    starts = lens - q_len if query_start is None else torch.as_tensor(query_start).long()
    group = num_heads // num_kv_heads
    scale = head_dim**-0.5 if scale is None else float(scale)
    max_blocks = max(-(-int(lens.max()) // block_size), 1)
    table = block_table[:, :max_blocks].long()
    used = torch.arange(max_blocks)[None, :] * block_size < lens[:, None]
    table = torch.where(used, table, torch.zeros_like(table))
    if bool(((table < 0) | (table >= num_blocks)).any()):
        raise ValueError(f"block_table names a page outside [0, {num_blocks})")
    num_keys = max_blocks * block_size
    k = k_pages[table].reshape(batch, num_keys, num_kv_heads, head_dim).float()
    v = v_pages[table].reshape(batch, num_keys, num_kv_heads, head_dim).float()
    qg = q.float().reshape(batch, q_len, num_kv_heads, group, head_dim)
    scores = torch.einsum("bqhgd,bkhd->bhgqk", qg, k) * scale
    key_pos = torch.arange(num_keys)
    allowed = (key_pos[None, :] < lens[:, None])[:, None, :].expand(batch, q_len, num_keys)
    if causal:
        query_pos = starts[:, None] + torch.arange(q_len)[None, :]
        allowed = allowed & (key_pos[None, None, :] <= query_pos[:, :, None])
    allowed = allowed[:, None, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    probs = torch.where(allowed.any(dim=-1, keepdim=True), probs, torch.zeros_like(probs))
    out = torch.einsum("bhgqk,bkhd->bqhgd", probs, v).reshape(batch, q_len, num_heads, head_dim)
    out = out.to(query.dtype)
    return out.squeeze(1) if decode else out


def make_step(seq_lens, counts, dtype, seed=0):
    """Pages, a shuffled block table padded with junk, packed queries and the padded
    ``[batch, max(counts), heads, dim]`` batch holding the same queries at its end."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // BLOCK) for n in seq_lens]
    num_blocks = sum(need) + 64
    pool = pool_view(
        torch.randn(NUM_LAYERS, 2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    )  # as shmkv stores it
    k_pages, v_pages = pool[:, 3, 0], pool[:, 3, 1]
    table = torch.full((len(seq_lens), max(need) + 4), 10**6, dtype=torch.int32)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    for b, count in enumerate(need):
        table[b, :count] = torch.tensor(perm[:count], dtype=torch.int32)
        perm = perm[count:]
    packed = torch.randn(sum(counts), HEADS, HEAD_DIM, generator=gen).to(dtype)
    locs = torch.tensor([0] + counts, dtype=torch.int32).cumsum(0).to(torch.int32)
    q_len = max(counts)
    padded = torch.zeros(len(seq_lens), q_len, HEADS, HEAD_DIM, dtype=dtype)
    for b, c in enumerate(counts):
        padded[b, q_len - c :] = packed[locs[b] : locs[b + 1]]
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return k_pages, v_pages, table, lens, packed, locs, padded


def per_call_ms(fn, seconds: float) -> float:
    """Median of per-call times over rounds of about ``seconds / 5`` each."""
    fn()
    start = time.perf_counter()
    fn()
    once = max(time.perf_counter() - start, 1e-6)
    calls = max(1, int(seconds / 5 / once))
    rounds = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - start) / calls * 1e3)
    return statistics.median(rounds)


def run_case(name, seq_lens, counts, dtype, seconds):
    k_pages, v_pages, table, lens, packed, locs, padded = make_step(seq_lens, counts, dtype)
    tol = 2e-5 if dtype == torch.float32 else 3e-2  # rtol and atol
    decode = max(counts) == 1
    batch_q = padded[:, 0] if decode else padded
    workspace = AttentionWorkspace()

    def old() -> torch.Tensor:
        return baseline_paged_attention(batch_q, k_pages, v_pages, table, lens)

    def new_batch() -> torch.Tensor:
        return paged_attention(batch_q, k_pages, v_pages, table, lens)

    def new_packed() -> torch.Tensor:
        return paged_attention(packed, k_pages, v_pages, table, lens, query_start_loc=locs)

    def new_ws() -> torch.Tensor:
        return paged_attention(
            packed, k_pages, v_pages, table, lens, query_start_loc=locs, workspace=workspace
        )

    want = old()
    torch.testing.assert_close(new_batch(), want, rtol=tol, atol=tol)
    rows = torch.cat(
        [
            want.view(-1, HEADS, HEAD_DIM)[
                b * max(counts) + max(counts) - c : (b + 1) * max(counts)
            ]
            for b, c in enumerate(counts)
        ]
    )
    torch.testing.assert_close(new_packed(), rows, rtol=tol, atol=tol)
    torch.testing.assert_close(new_ws(), rows, rtol=tol, atol=tol)
    times = [per_call_ms(fn, seconds) for fn in (old, new_batch, new_packed, new_ws)]
    print(
        f"{name:<40}"
        + "".join(f"{t:9.3f}" for t in times)
        + "".join(f"{times[0] / t:7.1f}x" for t in times[1:])
    )
    return {
        "case": name,
        "ms": dict(zip(WAYS, times)),
        "speedup": {w: times[0] / t for w, t in zip(WAYS[1:], times[1:])},
    }


def markdown(record: dict) -> str:
    """The record as the suite's Markdown table."""
    from shmkv.bench.core import markdown_table

    head = (
        f"`paged_attention` against the reference implementation it replaced, one "
        f"attention-layer call, milliseconds per call, median of 5 rounds of "
        f"{record['seconds']:g} s / 5 ({record['host']}; {HEADS} query heads, {KV_HEADS} K/V "
        f"heads, head_dim {HEAD_DIM}, block {BLOCK}, pool of {NUM_LAYERS} layers). batch: "
        "the padded batch form; packed: `query_start_loc`, no padding; +ws: packed with "
        "a reused `AttentionWorkspace`. Speedup: the baseline's time over the new one's. "
        "Reproduce: `shmkv bench --only attention`."
    )
    rows = [["case", *WAYS, *(f"speedup {w}" for w in WAYS[1:])]]
    for r in record["cases"]:
        rows.append(
            [
                r["case"],
                *(f"{r['ms'][w]:.3f}" for w in WAYS),
                *(f"{r['speedup'][w]:.1f}x" for w in WAYS[1:]),
            ]
        )
    return head + "\n\n" + markdown_table(rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--seconds", type=float, default=0.4, help="time spent per measurement (default 0.4)"
    )
    parser.add_argument(
        "--out",
        default=None,
        help="results path without extension (default: benchmarks/results/attention)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(
        f"torch {torch.__version__}, 1 thread; {HEADS} query heads, {KV_HEADS} K/V heads, "
        f"head_dim {HEAD_DIM}, block {BLOCK}, pool of {NUM_LAYERS} layers; one layer call"
    )
    print(f"{'':<40}{'milliseconds per call':^36}{'speedup':^24}")
    print(
        f"{'case':<40}"
        + "".join(f"{h:>9}" for h in ("baseline", "batch", "packed", "+ws"))
        + "".join(f"{h:>8}" for h in ("batch", "packed", "+ws"))
    )
    f32, bf16 = torch.float32, torch.bfloat16
    cases = [
        ("decode B=4 ctx 1024 fp32", [1024] * 4, [1] * 4, f32),
        ("decode B=1 ctx 4096 fp32", [4096], [1], f32),
        (
            "decode B=8 ctx 128..2048 fp32",
            [128, 2048, 512, 1024, 256, 1536, 768, 2000],
            [1] * 8,
            f32,
        ),
        ("decode B=4 ctx 1024 bf16", [1024] * 4, [1] * 4, bf16),
        ("prefill 512 + 3 decodes @1024 fp32", [512, 1024, 1024, 1024], [512, 1, 1, 1], f32),
        ("chunk 256 @2048 + 3 decodes @1024 fp32", [2048, 1024, 1024, 1024], [256, 1, 1, 1], f32),
    ]
    record = {
        "host": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        "1 thread",
        "seconds": args.seconds,
        "cases": [
            run_case(name, seq_lens, counts, dtype, args.seconds)
            for name, seq_lens, counts, dtype in cases
        ],
    }
    write_results(args.out or result_base("attention"), record, markdown(record))
    print(
        "batch: the padded batch form; packed: query_start_loc, no padding; +ws: packed "
        "with a reused AttentionWorkspace. Speedup: baseline time / new time."
    )
    return 0


def cli_args(quick: bool, out_dir: str, name=None) -> list:
    """The arguments ``shmkv bench --only attention`` runs :func:`main` with (a quick run
    writes ``attention-quick``, not the committed ``attention``)."""
    name = name or ("attention-quick" if quick else None)
    args = ["--seconds", "0.1"] if quick else []
    return args + (["--out", result_base(name, out_dir)] if name else [])


if __name__ == "__main__":
    sys.exit(main())
