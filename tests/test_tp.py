"""Tensor parallelism on one CPU pool: each rank sees and writes its head slice."""

import pytest
import torch
import workers
from conftest import SPAWN, join_or_kill

import shmkv

TP = 2


@pytest.fixture
def tp_coord(unique_name):
    cfg = shmkv.PoolConfig(
        num_layers=2,
        num_kv_heads=4,
        head_dim=8,
        num_blocks=32,
        block_size=4,
        dtype=torch.float32,
        tp_size=TP,
    )
    with shmkv.Coordinator(cfg, name=unique_name) as coord:
        yield coord


def test_rank_processes_write_shards_reader_sees_whole_heads(tp_coord):
    n = 11
    with shmkv.connect(tp_coord.address) as reader:
        h = reader.allocate(prompt=list(range(n)))
        assert h.num_heads == 4
        q = SPAWN.Queue()
        procs = [
            SPAWN.Process(
                target=workers.tp_rank_writer, args=(tp_coord.address, rank, TP, h.export(30), n, q)
            )
            for rank in range(TP)
        ]
        for p in procs:
            p.start()
        got = sorted(q.get(timeout=60) for _ in procs)
        for p in procs:
            assert join_or_kill(p) == 0
        assert [g[:2] for g in got] == [(0, 2), (1, 2)]
        # the prompt's full blocks are published only once both ranks committed
        assert max(g[2] for g in got) == 2 and min(g[2] for g in got) == 0
        for layer in range(2):
            want = workers.full_heads(n, 4, 8, layer)
            assert torch.equal(h.key_cache(layer), want)
            assert torch.equal(h.value_cache(layer), -want)
        assert reader.allocate(prompt=list(range(n))).num_cached_tokens == 8


def test_rank_view_is_a_head_slice_of_the_same_memory(tp_coord):
    with (
        shmkv.connect(tp_coord.address, tp_rank=1, tp_size=TP) as r1,
        shmkv.connect(tp_coord.address) as full,
    ):
        assert r1.pool.shape == (32, 2, 2, 4, 2, 8)
        h = r1.allocate(3)
        k = torch.randn(3, 2, 8)
        h.write(1, k, k, start=0)
        whole = full.open(h.export(10))
        assert torch.equal(whole.key_cache(1)[:, 2:], k)
        assert r1.pool.stride() == full.pool.stride()  # a slice of the pool, not a copy
        assert r1.pool.storage_offset() == 2 * 8
        with pytest.raises(shmkv.InvalidArgument, match="expected"):
            h.write(0, torch.randn(3, 4, 8), torch.randn(3, 4, 8), start=0)


def test_wrong_tp_arguments_are_refused(tp_coord):
    with pytest.raises(shmkv.InvalidArgument, match="tp_rank"):
        shmkv.connect(tp_coord.address, tp_rank=2, tp_size=TP)
    with pytest.raises(shmkv.ShmkvError):
        shmkv.connect(tp_coord.address, tp_rank=0, tp_size=4)
