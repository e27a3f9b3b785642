"""Promotion bandwidth from disk and from the host tier, each against a plain copy of the
same bytes.
"""

from __future__ import annotations

import os
import statistics
import time

import numpy as np

import shmkv
from shmkv import tiers as tiers_mod
from shmkv.bench.tiers.common import (
    BIG,
    drop_page_cache,
    evict_all,
    fill,
    name,
    plain_read,
    promote_pass,
    prompts_for,
    wait_idle,
)
from shmkv.memory.pool import block_bytes


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
