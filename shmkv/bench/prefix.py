"""Suite ``prefix``: prefix-cache benchmarks: lookup + allocation of a 4k-token prompt
(coordinator-side time per block), hashing throughput, and fork cost against sequence
length.

Coordinator-side figures drive ``SequenceTable`` directly (what the coordinator runs
per request, without the socket); each is a median over repeats after a warm-up.
Fork is also timed end to end through a live coordinator. Writes
``benchmarks/results/prefix.json``.
"""

import json
import statistics
import sys
import time
import uuid
from typing import Callable

import torch

import shmkv
from shmkv import hashing
from shmkv.bench.core import result_base, write_results
from shmkv.coordinator.allocator import BlockPool
from shmkv.coordinator.sequences import SequenceTable

BS = 16


def median_time(fn, repeat=15, warmup=3):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _fork_and_release(table: SequenceTable, cache_id: int) -> Callable[[], None]:
    """Fork sequence ``cache_id`` of connection 1 in ``table`` and release the fork."""

    def run() -> None:
        table.release(1, table.fork(1, cache_id)["cache_id"])

    return run


def _fork_and_close(handle: shmkv.KvCacheHandle) -> Callable[[], None]:
    """Fork ``handle`` through its coordinator and close the fork."""

    def run() -> None:
        handle.fork().close()

    return run


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="default benchmarks/results/prefix")
    args = parser.parse_args(argv)
    out = {}
    prompt = [(i * 7919) % 32000 for i in range(4096)]
    blocks = len(prompt) // BS

    root = hashing.root_key()
    t_hash = median_time(lambda: hashing.block_keys(prompt, BS, root))
    out["hash_tokens_per_s"] = len(prompt) / t_hash

    table = SequenceTable(BlockPool(8192), BS)
    table.add_connection(1)
    first = table.allocate(1, prompt=prompt)
    table.commit(1, first["cache_id"], len(prompt))

    def hit():
        info = table.allocate(1, prompt=prompt)
        assert info["num_cached"] == len(prompt)
        table.release(1, info["cache_id"])

    miss_prompt = [t + 1 for t in prompt]
    t_miss = median_time(
        lambda: table.release(1, table.allocate(1, prompt=miss_prompt)["cache_id"])
    )
    t_hit = median_time(hit)
    out["alloc_4k_miss_us_per_block"] = 1e6 * t_miss / blocks
    out["alloc_4k_hit_us_per_block"] = 1e6 * t_hit / blocks
    out["alloc_4k_hit_hash_share"] = t_hash / t_hit

    # What clients send: the prompt packed, and (protocol 2) its block keys, hashed in
    # the client. The loop's time for a hit with and without them.
    packed = hashing.pack_tokens(prompt)
    keys = b"".join(hashing.packed_block_keys(packed, BS, root))

    def packed_hit(**extra):
        info = table.allocate(1, prompt=packed, **extra)
        assert info["num_cached"] == len(prompt)
        table.release(1, info["cache_id"])

    t_packed = median_time(packed_hit)
    t_keys = median_time(lambda: packed_hit(keys=keys))
    out["alloc_4k_hit_packed_us_per_block"] = 1e6 * t_packed / blocks
    out["alloc_4k_hit_client_keys_us_per_block"] = 1e6 * t_keys / blocks
    out["client_keys_speedup"] = t_packed / t_keys

    fork_in_process, fork_e2e = {}, {}
    cfg = shmkv.PoolConfig(
        num_layers=4,
        num_kv_heads=2,
        head_dim=16,
        num_blocks=8192,
        block_size=BS,
        dtype=torch.float16,
        max_seq_len=65536,
    )
    with (
        shmkv.Coordinator(cfg, name=f"bp-{uuid.uuid4().hex[:8]}") as coord,
        shmkv.connect(coord.address) as client,
    ):
        for tokens in (256, 1024, 4096, 16384, 65536):
            info = table.allocate(1, tokens)
            t = median_time(_fork_and_release(table, info["cache_id"]))
            fork_in_process[tokens] = 1e6 * t
            table.release(1, info["cache_id"])
            h = client.allocate(tokens)
            t = median_time(_fork_and_close(h))
            fork_e2e[tokens] = 1e6 * t
            h.close()
    out["fork_us_in_coordinator"] = fork_in_process
    out["fork_and_close_us_round_trips"] = fork_e2e
    per_block = {t: fork_in_process[t] / (t // BS) for t in fork_in_process}
    out["fork_us_per_block_table_entry"] = per_block
    print(json.dumps(out, indent=2))
    write_results(args.out or result_base("prefix"), out, None, indent=2)
    return 0


def cli_args(quick: bool, out_dir: str, name=None) -> list:
    """The arguments ``shmkv bench --only prefix`` runs :func:`main` with (about 20 s
    either way: a quick run only writes ``prefix-quick``)."""
    name = name or ("prefix-quick" if quick else None)
    return ["--out", result_base(name, out_dir)] if name else []


if __name__ == "__main__":
    sys.exit(main())
