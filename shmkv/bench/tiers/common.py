"""The tiers suite's pools and clients: the pool shapes, waiting for the tiers to go idle,
evicting, filling, prompts, the page cache dropped, a plain read and a promotion pass.
"""

from __future__ import annotations

import os
import random
import time
import uuid
from typing import Any, Dict

import torch

# PoolConfig's keywords. An 8B-class model's block (32 layers, 8 KV heads of 128, fp16,
# 16 tokens): 2 MiB.
BIG: Dict[str, Any] = dict(
    num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="float16"
)
SMALL: Dict[str, Any] = dict(
    num_layers=2, num_kv_heads=2, head_dim=16, block_size=16, dtype="float16"
)


def name() -> str:
    return f"bench-tiers-{uuid.uuid4().hex[:8]}"


def wait_idle(client, timeout=600.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        st = client.stats()
        io = st.get("tier_io") or {"pending": 0, "scanning": False, "promotions_in_flight": 0}
        if not (io["pending"] or io["scanning"] or io["promotions_in_flight"]):
            return st
        if time.monotonic() > deadline:
            raise RuntimeError(f"tiers busy after {timeout} s: {io}")
        time.sleep(0.005)


def evict_all(client) -> None:
    st = client.stats()
    bs = st["config"]["block_size"]
    client.allocate((st["free_blocks"] + st["cached_blocks"]) * bs).close()


def fill(client, prompts, value=None) -> None:
    """Write and commit every prompt (K/V: a constant per prompt), waiting for each one's
    blocks to reach the tiers, so that none is lost to a fast eviction."""
    for i, prompt in enumerate(prompts):
        h = client.allocate(prompt=prompt)
        n = len(prompt)
        kv = torch.full((n, h.num_heads, h.head_dim), float(i % 100), dtype=h.dtype)
        for layer in range(h.num_layers):
            h.write(layer, kv, kv, start=0)
        h.commit()
        h.close()
        wait_idle(client)


def prompts_for(num, blocks, block_size, seed):
    rng = random.Random(seed)
    return [[rng.randrange(1, 50000) for _ in range(blocks * block_size)] for _ in range(num)]


def drop_page_cache(directory: str) -> None:
    """Evict the directory's files from the page cache (no root needed)."""
    for entry in os.scandir(directory):
        if entry.is_file():
            fd = os.open(entry.path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def plain_read(directory: str, file_nbytes: int, num_dest: int) -> tuple:
    """Read every file of a directory, in order, each into the next of ``num_dest``
    destination blocks (as promotion reads into pool blocks): (bytes, seconds)."""
    import numpy as np

    names = sorted(os.listdir(directory))
    dest = np.zeros((num_dest, file_nbytes), dtype=np.uint8)  # touched: no page faults
    total = 0
    t0 = time.perf_counter()
    for i, n in enumerate(names):
        fd = os.open(os.path.join(directory, n), os.O_RDONLY)
        try:
            view, got = memoryview(dest[i % num_dest]), 0
            while got < file_nbytes:
                step = os.readv(fd, [view[got:]])
                if not step:
                    break
                got += step
            total += got
        finally:
            os.close(fd)
    return total, time.perf_counter() - t0


def promote_pass(client, prompts, block_size) -> tuple:
    """Allocate every prompt (all its blocks promoted), then close it: (bytes, seconds)."""
    nbytes = client.config.block_nbytes
    total = 0
    t0 = time.perf_counter()
    for prompt in prompts:
        h = client.allocate(prompt=prompt)
        assert h.num_cached_tokens == len(prompt), (h.num_cached_tokens, len(prompt))
        total += len(prompt) // block_size * nbytes
        h.close()
    return total, time.perf_counter() - t0


# -- bandwidth -----------------------------------------------------------------------------
