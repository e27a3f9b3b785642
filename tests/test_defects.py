"""Defects found by trying the library as a new user would, each pinned by a test."""

import copy
import pickle

import numpy as np
import pytest
import torch
import workers
from conftest import SPAWN, join_or_kill

import shmkv


@pytest.fixture
def tp_coord(unique_name):
    cfg = shmkv.PoolConfig(
        num_layers=2,
        num_kv_heads=4,
        head_dim=8,
        num_blocks=32,
        block_size=4,
        dtype=torch.float32,
        tp_size=2,
    )
    with shmkv.Coordinator(cfg, name=unique_name) as coord:
        yield coord


def test_a_handle_pickled_to_another_rank_writes_that_ranks_shard(tp_coord):
    """It used to reconnect with the sender's rank, overwrite rank 0's heads and commit
    as rank 0, so the prompt was never published."""
    prompt = list(range(9))
    handles, results = SPAWN.Queue(), SPAWN.Queue()
    sender = SPAWN.Process(target=workers.tp_rank0_sends, args=(tp_coord.address, prompt, handles))
    receiver = SPAWN.Process(
        target=workers.tp_rank1_receives, args=(tp_coord.address, handles, results)
    )
    receiver.start()
    sender.start()
    kind, same_client, heads, published = results.get(timeout=60)
    assert join_or_kill(sender) == 0 and join_or_kill(receiver) == 0
    assert kind == "ok" and same_client and heads == 2
    assert published == 2  # both ranks committed now
    with shmkv.connect(tp_coord.address) as reader:
        h = reader.allocate(prompt=prompt)
        assert h.num_cached_tokens == 8
        for layer in range(2):
            want = workers.full_heads(8, 4, 8, layer)
            assert torch.equal(h.key_cache(layer)[:8], want)  # both shards, exactly
            assert torch.equal(h.value_cache(layer)[:8], -want)


def test_unpickling_with_two_clients_of_one_coordinator_asks_to_choose(tp_coord):
    prompt = list(range(5))
    handles, results = SPAWN.Queue(), SPAWN.Queue()
    sender = SPAWN.Process(target=workers.tp_rank0_sends, args=(tp_coord.address, prompt, handles))
    receiver = SPAWN.Process(
        target=workers.tp_rank1_receives, args=(tp_coord.address, handles, results, True)
    )
    receiver.start()
    sender.start()
    kind, message = results.get(timeout=60)
    assert join_or_kill(sender) == 0 and join_or_kill(receiver) == 0
    assert kind == "ambiguous" and "as_unpickle_target" in message


def test_unpickling_in_process_follows_the_documented_rule(tp_coord):
    with shmkv.connect(tp_coord.address, tp_rank=0, tp_size=2) as r0:
        h = r0.allocate(3)
        data = pickle.dumps(h)
        # the only client of this coordinator here is r0: the handle is r0's
        assert pickle.loads(data)._client is r0
        with shmkv.connect(tp_coord.address, tp_rank=1, tp_size=2) as r1:
            with pytest.raises(shmkv.InvalidArgument, match="as_unpickle_target"):
                pickle.loads(pickle.dumps(h))
            with r1.as_unpickle_target():
                got = pickle.loads(pickle.dumps(h))
            assert got._client is r1 and got.num_heads == 2


def test_pickling_stays_under_the_coordinators_handoff_limit(unique_name, small_config):
    with shmkv.Coordinator(small_config, name=unique_name, max_handoff_ttl=60) as coord:
        with shmkv.connect(coord.address) as client:
            assert client.pickle_ttl == 60
            h = client.allocate(3)
            h.write(0, torch.ones(3, 4, 8), torch.ones(3, 4, 8), start=0)
            twin = copy.deepcopy(h)
            assert twin.cache_id == h.cache_id and torch.equal(twin.key_cache(0), h.key_cache(0))
            q = SPAWN.Queue()
            q.put(h)
            got = q.get(timeout=30)
            assert got.cache_id == h.cache_id


def test_a_closed_handle_answers_nothing_about_its_freed_blocks(client):
    h = client.allocate(5)
    view = h.with_sequence_length(2)
    h.close()
    view.close()
    for name in ("block_table", "num_tokens", "num_cached_tokens"):
        with pytest.raises(shmkv.HandleClosed):
            getattr(h, name)
    for call in (
        h.stats,
        h.gather_all,
        h.commit,
        h.export,
        h.fork,
        h.clone_handle,
        lambda: h.paged_kv(0),
        lambda: h.key_cache(0),
        lambda: h.with_sequence_length(1),
        lambda: view.block_table,
    ):
        with pytest.raises(shmkv.HandleClosed):
            call()
    assert not h.is_valid()
    assert h.cache_id.startswith("kv-")  # identity stays answerable
    other = client.allocate(5)  # reuses exactly those blocks
    with pytest.raises(shmkv.HandleClosed):
        _ = h.block_table
    other.close()


def test_write_without_start_on_a_view_writes_the_views_last_slots(client):
    h = client.allocate(8)
    view = h.with_sequence_length(4)
    k = torch.full((1, 4, 8), 3.0)
    view.write(0, k, -k)  # slot 3, not 7
    assert torch.equal(h.key_cache(0)[3], k[0])
    assert torch.equal(h.key_cache(0)[7], torch.zeros(4, 8))
    with pytest.raises(shmkv.InvalidArgument, match="fixed length"):
        view.extend(1)


def test_prompt_blocks_survive_an_extend_without_ids(unique_name):
    cfg = shmkv.PoolConfig(
        num_layers=1, num_kv_heads=1, head_dim=2, num_blocks=16, block_size=8, dtype=torch.float32
    )
    prompt = list(range(100, 131))  # 31 tokens: three full blocks of 8
    with shmkv.Coordinator(cfg, name=unique_name) as coord, shmkv.connect(coord.address) as c:
        h = c.allocate(prompt=prompt)
        h.write(0, torch.ones(31, 1, 2), torch.ones(31, 1, 2), start=0)
        h.extend(5)  # decode slots, no token ids
        assert h.commit() == 3
        assert c.allocate(prompt=prompt).num_cached_tokens == 24
        # a batch extend without ids keeps them publishable too
        g = c.allocate(prompt=list(range(200, 217)))
        c.batch([g]).extend(3)
        assert g.commit() == 2


def test_integral_scalars_are_token_ids(client):
    h = client.allocate(prompt=[np.int64(1), np.int32(2), torch.tensor(3), 4])
    assert h.num_tokens == 4
    h.extend(2, tokens=np.array([5, 6]))
    with pytest.raises(shmkv.WrongType):
        client.allocate(prompt=[1.5])
    with pytest.raises(shmkv.WrongType):
        client.allocate(prompt=[True])
