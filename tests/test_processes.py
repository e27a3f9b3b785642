"""Real processes (spawn) sharing one pool: zero copy, hand-off, DataLoader, crashes."""

import os
import pickle
import signal
import subprocess
import sys
import time

import pytest
import torch
import workers
from conftest import SPAWN, join_or_kill

import shmkv


def test_two_processes_see_the_same_bytes_without_copying(coord, client):
    q = SPAWN.Queue()
    child = SPAWN.Process(target=workers.write_and_handoff, args=(coord.address, 9, 5, q))
    child.start()
    h = q.get(timeout=30)  # unpickled: a handle opened through the hand-off
    q.get(timeout=30)
    assert join_or_kill(child) == 0
    assert isinstance(h, shmkv.KvCacheHandle) and h.num_tokens == 9
    for layer in range(h.num_layers):
        assert torch.equal(h.key_cache(layer), workers.pattern(5 + layer, 9, 4, 8))
        assert torch.equal(h.value_cache(layer), workers.pattern(105 + layer, 9, 4, 8))

    # the other direction, and in place: a reader sees a later write with no round trip
    token = h.export(ttl=30)
    results, go = SPAWN.Queue(), SPAWN.Event()
    reader = SPAWN.Process(target=workers.read_back, args=(coord.address, token, 9, 5, results, go))
    reader.start()
    assert results.get(timeout=30)[1] is True
    marker = torch.full((1, 4, 8), 42.0)
    h.write(0, marker, marker, start=0)
    go.set()
    tag, row = results.get(timeout=30)
    assert tag == "second" and row == marker[0].tolist()
    assert join_or_kill(reader) == 0


def test_writes_cross_block_boundaries_at_any_start(client):
    h = client.allocate(0)
    h.extend(37)  # block_size 4: ten blocks, the last partly filled
    ref = torch.zeros(3, 2, 37, 4, 8)
    for start in range(0, 37):
        for n in (1, 3, 4, 5, 9):
            if start + n > 37:
                continue
            layer = (start + n) % 3
            k = torch.randn(n, 4, 8)
            v = torch.randn(n, 4, 8)
            h.write(layer, k, v, start=start)
            ref[layer, 0, start : start + n] = k
            ref[layer, 1, start : start + n] = v
    for layer in range(3):
        assert torch.equal(h.key_cache(layer), ref[layer, 0])
        assert torch.equal(h.value_cache(layer), ref[layer, 1])
    assert torch.equal(h.gather_all(), ref)
    kv = torch.randn(3, 2, 13, 4, 8)
    h.write_all(kv, start=22)
    ref[:, :, 22:35] = kv
    assert torch.equal(h.gather_all(), ref)


def test_paged_views_are_the_pool(client):
    h = client.allocate(10)
    k = torch.randn(10, 4, 8)
    h.write(1, k, -k, start=0)
    k_pages, v_pages, table = h.paged_kv(1)
    assert table.dtype == torch.int32 and k_pages.shape[1:] == (4, 4, 8)
    assert k_pages.stride(-1) == 1
    flat = torch.cat([k_pages[b] for b in table.tolist()])[:10]
    assert torch.equal(flat, k)
    assert torch.equal(torch.cat([v_pages[b] for b in table.tolist()])[:10], -k)
    assert k_pages.untyped_storage().data_ptr() == client.pool.untyped_storage().data_ptr()


def test_handle_api_names_and_views(client):
    h = client.allocate(6, request_id="req-1")
    assert h.request_cache_id() == "req-1" and h.cache_id.startswith("kv-")
    assert (h.num_layers, h.num_heads, h.head_dim, h.device) == (3, 4, 8, torch.device("cpu"))
    assert h.block_table.num_blocks() == 2 and h.block_table.free_tokens() == 2
    st = h.stats()
    assert st.blocks_allocated == 2 and st.tokens_stored == 6 and st.utilization == 0.75
    assert st.memory_bytes == 2 * 3 * 2 * 4 * 4 * 8 * 4
    k = torch.randn(6, 4, 8)
    h.write(0, k, k, start=0)
    short = h.with_sequence_length(3)
    assert short.num_tokens == 3 and torch.equal(short.key_cache(0), k[:3])
    assert h.num_tokens == 6
    c = h.clone_handle()
    assert c.cache_id == h.cache_id
    h.close()
    h.close()  # idempotent
    assert not h.is_valid() and c.is_valid()
    with pytest.raises(shmkv.HandleClosed):
        h.key_cache(0)
    assert torch.equal(c.key_cache(0), k)  # the clone's reference keeps it alive
    with c, short:
        pass
    assert client.stats()["referenced_blocks"] == 0


def test_pool_exhausted_leaves_state_unchanged(client):
    a = client.allocate(100)
    before = client.stats()
    with pytest.raises(shmkv.PoolExhausted, match="free handles or raise num_blocks"):
        client.allocate_many([100, 100])
    with pytest.raises(shmkv.PoolExhausted):
        a.extend(1000)
    after = client.stats()
    for key in ("free_blocks", "referenced_blocks", "sequences", "cached_blocks"):
        assert after[key] == before[key]
    assert a.num_tokens == 100


def test_batched_step_is_one_round_trip(client, coord):
    handles = client.allocate_many([3] * 8)
    ops = coord.stats()["ops"]
    starts = client.extend_many([(h, 2) for h in handles])
    assert starts == [3] * 8 and all(h.num_tokens == 5 for h in handles)
    client.close_many(handles)
    assert coord.stats()["ops"] == ops + 2
    assert coord.stats()["referenced_blocks"] == 0


def test_sigkilled_worker_blocks_come_back(coord, client):
    q = SPAWN.Queue()
    free0 = client.stats()["free_blocks"]
    kept = client.allocate(8)
    kept.write(0, torch.full((8, 4, 8), 3.0), torch.full((8, 4, 8), 3.0), start=0)
    killed = SPAWN.Process(target=workers.hold_and_sleep, args=(coord.address, 20, q))
    exporter = SPAWN.Process(target=workers.hold_and_sleep, args=(coord.address, 12, q, 30))
    killed.start()
    exporter.start()
    got = [q.get(timeout=30), q.get(timeout=30)]
    token = next(t for _cid, t in got if t)
    assert client.stats()["free_blocks"] == free0 - 2 - 5 - 3
    os.kill(killed.pid, signal.SIGKILL)
    os.kill(exporter.pid, signal.SIGKILL)
    join_or_kill(killed, 10)
    join_or_kill(exporter, 10)
    deadline = time.monotonic() + 5
    while client.stats()["free_blocks"] != free0 - 2 - 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert client.stats()["free_blocks"] == free0 - 2 - 3  # the hand-off keeps 3 blocks
    opened = client.open(token)  # and it still opens after its producer died
    assert torch.equal(opened.key_cache(0), torch.ones(12, 4, 8))
    opened.close()
    assert client.stats()["free_blocks"] == free0 - 2
    assert torch.equal(kept.key_cache(0), torch.full((8, 4, 8), 3.0))  # survivor unchanged


def _loader_item(args):
    address, index = args
    client = shmkv.client.client.process_client(address, None, None)
    h = client.allocate(5 + index)
    k = torch.full((5 + index, 4, 8), float(index))
    h.write(2, k, k, start=0)
    return h


class _Prefill(torch.utils.data.Dataset):
    def __init__(self, address):
        self.address = address

    def __len__(self):
        return 6

    def __getitem__(self, index):
        return {"index": index, "handle": _loader_item((self.address, index))}


def test_handles_cross_a_dataloader(coord, client):
    loader = torch.utils.data.DataLoader(
        _Prefill(coord.address),
        batch_size=None,
        num_workers=2,
        multiprocessing_context="spawn",
        timeout=60,
    )
    items = list(loader)
    assert sorted(i["index"] for i in items) == list(range(6))
    for item in items:
        h, index = item["handle"], item["index"]
        assert h.num_tokens == 5 + index
        assert torch.equal(h.key_cache(2), torch.full((5 + index, 4, 8), float(index)))
        h.close()
    deadline = time.monotonic() + 5  # worker connections close as the workers exit
    while client.stats()["referenced_blocks"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert client.stats()["referenced_blocks"] == 0


def test_pickle_of_a_closed_handle_fails(client):
    h = client.allocate(1)
    h.close()
    with pytest.raises(shmkv.HandleClosed):
        pickle.dumps(h)


def test_spawned_coordinator_and_cli_entry(small_config, unique_name):
    with shmkv.Coordinator.spawn(small_config, name=unique_name) as coord:
        assert coord.pid != os.getpid()
        with shmkv.connect(coord.address) as client:
            h = client.allocate(4)
            h.write(0, torch.ones(4, 4, 8), torch.ones(4, 4, 8), start=0)
            assert torch.equal(h.key_cache(0), torch.ones(4, 4, 8))
        out = subprocess.run(
            [sys.executable, "-m", "shmkv", "stats", "--address", coord.address, "--json"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        assert '"num_blocks": 64' in out.stdout
    assert not os.path.exists(coord.address)


def test_second_coordinator_on_a_live_name_is_refused(coord, small_config):
    with pytest.raises(shmkv.ShmkvError, match="live coordinator"):
        shmkv.Coordinator(small_config, address=coord.address).start()
    with shmkv.connect(coord.address) as c:  # the first one is untouched
        c.ping()


def test_connect_to_nothing_is_coordinator_gone(unique_name):
    with pytest.raises(shmkv.CoordinatorGone, match="no coordinator"):
        shmkv.connect(shmkv.default_address(unique_name))


def test_close_many_drops_each_handle_once(client):
    h = client.allocate(4)
    keep = h.clone_handle()
    k = torch.randn(4, 4, 8)
    h.write(0, k, k, start=0)
    client.close_many([h, h])  # the same handle twice: one reference dropped
    assert client.stats()["referenced_blocks"] == 1
    assert torch.equal(keep.key_cache(0), k)
    keep.close()
    assert client.stats()["referenced_blocks"] == 0


def test_a_regular_file_at_the_address_is_never_removed(small_config, tmp_path):
    path = tmp_path / "not-a-socket"
    path.write_text("precious")
    with pytest.raises(shmkv.InvalidArgument, match="not a socket"):
        shmkv.Coordinator(small_config, address=str(path)).start()
    assert path.read_text() == "precious"
