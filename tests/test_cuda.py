"""CUDA IPC pool: run on a machine with an NVIDIA GPU (skipped cleanly without one)."""

import time

import pytest
import torch
from conftest import SPAWN, join_or_kill

import shmkv

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _cuda_worker(address, rank, token, n, queue):
    with shmkv.connect(address, timeout=60) as client:
        h = client.open(token)
        k = torch.full(
            (n, h.num_heads, h.head_dim), float(rank + 1), device=h.device, dtype=h.dtype
        )
        h.write(rank, k, k, start=0)
        torch.cuda.synchronize()
        queue.put((rank, str(h.device), h.key_cache(rank).float().sum().item()))
        h.close()


@pytest.fixture
def cuda_coord(unique_name):
    cfg = shmkv.PoolConfig(
        num_layers=2,
        num_kv_heads=4,
        head_dim=64,
        num_blocks=128,
        block_size=16,
        dtype=torch.float16,
        device="cuda:0",
    )
    with shmkv.Coordinator(cfg, name=unique_name) as coord:
        yield coord


def test_two_worker_processes_share_one_device_pool(cuda_coord):
    with shmkv.connect(cuda_coord.address) as client:  # same process: original tensor
        h = client.allocate(40)
        assert h.device.type == "cuda"
        q = SPAWN.Queue()
        procs = [
            SPAWN.Process(target=_cuda_worker, args=(cuda_coord.address, r, h.export(60), 40, q))
            for r in range(2)
        ]
        for p in procs:
            p.start()
        got = sorted(q.get(timeout=120) for _ in procs)
        for p in procs:
            assert join_or_kill(p, 60) == 0
        assert [g[0] for g in got] == [0, 1]
        for rank in range(2):
            want = torch.full((40, 4, 64), float(rank + 1), device="cuda:0", dtype=torch.float16)
            assert torch.equal(h.key_cache(rank), want)
        k_pages, _v, table = h.paged_kv(0)
        assert k_pages.is_cuda and table.is_cuda and table.dtype == torch.int32


def test_handles_turn_invalid_when_the_coordinator_dies(unique_name):
    cfg = shmkv.PoolConfig(
        num_layers=1,
        num_kv_heads=1,
        head_dim=64,
        num_blocks=8,
        block_size=16,
        dtype=torch.float16,
        device="cuda:0",
    )
    coord = shmkv.Coordinator.spawn(cfg, name=unique_name)
    client = shmkv.connect(coord.address)
    try:
        h = client.allocate(4)
        coord.kill()
        deadline = time.monotonic() + 2
        while h.is_valid() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not h.is_valid()
        with pytest.raises(shmkv.CoordinatorGone):
            h.key_cache(0)
    finally:
        client.close()
        coord.stop()  # reaps it and removes the socket file the kill left
