"""Time from a coordinator's start to its first disk hit after a restart, cold and warm."""

from __future__ import annotations

import os
import random
import time
from typing import Any, Dict

import shmkv
from shmkv.bench.tiers.common import BIG, SMALL, fill, name, prompts_for


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
            while client.stats()["tier_io"]["scanning"]:
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
