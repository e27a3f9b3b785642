"""Prefix caching, fork with copy-on-write and LRU eviction, across real processes."""

import time

import pytest
import torch
import workers
from conftest import SPAWN, join_or_kill

import shmkv


def test_prefix_written_in_a_is_reused_by_b_with_identical_kv(coord, client):
    prompt = list(range(100, 123))  # 5 full blocks of 4 + 3 tokens
    q = SPAWN.Queue()
    a = SPAWN.Process(target=workers.prefix_writer, args=(coord.address, prompt, q))
    a.start()
    published, cached_a = q.get(timeout=30)
    assert join_or_kill(a) == 0
    assert (published, cached_a) == (5, 0)
    b = SPAWN.Process(target=workers.prefix_reader, args=(coord.address, prompt + [7, 8], q))
    b.start()
    cached_b, same = q.get(timeout=30)
    assert join_or_kill(b) == 0
    assert cached_b == 20 and same
    st = client.stats()
    assert st["prefix_hit_blocks"] == 5 and st["prefix_hit_tokens"] == 20


def test_writer_killed_mid_write_publishes_nothing(coord, client):
    prompt = list(range(500, 516))
    q = SPAWN.Queue()
    p = SPAWN.Process(target=workers.die_by_sigkill_mid_write, args=(coord.address, prompt, q))
    p.start()
    assert q.get(timeout=30) == "written"
    join_or_kill(p, 10)
    deadline = time.monotonic() + 5
    while client.stats()["referenced_blocks"] and time.monotonic() < deadline:
        time.sleep(0.02)
    st = client.stats()
    assert st["referenced_blocks"] == 0 and st["cached_blocks"] == 0
    assert st["prefix_index_blocks"] == 0
    h = client.allocate(prompt=prompt)
    assert h.num_cached_tokens == 0


def test_forks_diverge_without_seeing_each_other(client):
    parent = client.allocate(6)  # blocks: one full, one half full
    base = torch.randn(6, 4, 8)
    for layer in range(3):
        parent.write(layer, base, -base, start=0)
    child = parent.fork()
    grandchild = child.fork()
    assert child.cache_id != parent.cache_id
    a, b, c = torch.randn(3, 1, 4, 8)
    for h, x in ((parent, a), (child, b), (grandchild, c)):
        start = h.extend(1)
        for layer in range(3):
            h.write(layer, x, x, start=start)
    child.write(0, a * 9, a * 9, start=1)  # overwrite inside the shared full block
    for h, x in ((parent, a), (child, b), (grandchild, c)):
        assert torch.equal(h.key_cache(1), torch.cat([base, x]))
    assert torch.equal(parent.key_cache(0), torch.cat([base, a]))  # prefix intact
    assert torch.equal(child.key_cache(0)[1], (a * 9)[0])
    assert torch.equal(grandchild.key_cache(0)[:6], base)
    assert client.stats()["cow_copies"] >= 3
    for order in ((child, parent, grandchild),):
        for h in order:
            h.close()
    assert client.stats()["referenced_blocks"] == 0


def test_fork_across_processes_is_private(coord, client):
    h = client.allocate(5)
    h.write(0, torch.ones(5, 4, 8), torch.ones(5, 4, 8), start=0)
    f = h.fork()
    token = f.export(ttl=30)
    f.close()
    results, go = SPAWN.Queue(), SPAWN.Event()
    reader = SPAWN.Process(target=workers.read_back, args=(coord.address, token, 5, 0, results, go))
    reader.start()
    results.get(timeout=30)
    h.write(0, torch.full((1, 4, 8), 5.0), torch.full((1, 4, 8), 5.0), start=4)
    go.set()
    _tag, row = results.get(timeout=30)
    assert row == torch.ones(4, 8).tolist()  # the fork never sees the parent's write
    assert join_or_kill(reader) == 0


def test_eviction_picks_lru_unreferenced_and_never_referenced(unique_name):
    cfg = shmkv.PoolConfig(
        num_layers=1, num_kv_heads=1, head_dim=4, num_blocks=8, block_size=2, dtype=torch.float32
    )
    with shmkv.Coordinator(cfg, name=unique_name) as coord, shmkv.connect(coord.address) as c:
        old = c.allocate(prompt=[1, 2, 3, 4])  # 2 blocks
        old.commit()
        new = c.allocate(prompt=[9, 8, 7, 6])
        new.commit()
        held = c.allocate(prompt=[5, 5, 5, 5])
        held.commit()  # referenced: must never be evicted
        old.close()
        new.close()
        c.allocate(prompt=[9, 8, 7, 6]).close()  # touch "new": now more recent than "old"
        assert c.stats()["cached_blocks"] == 4
        big = c.allocate(8)  # 4 blocks: 2 free + 2 evicted
        assert c.stats()["evictions"] == 2
        assert c.stats()["prefix_index_blocks"] == 4  # old's keys are forgotten at once
        probe = c.allocate(prompt=[9, 8, 7, 6])  # new survived (a full hit, no allocation)
        assert probe.num_cached_tokens == 4
        probe.close()
        assert c.allocate(prompt=[5, 5, 5, 5]).num_cached_tokens == 4  # held survived
        with pytest.raises(shmkv.PoolExhausted):
            c.allocate(16)  # cannot take referenced blocks
        assert c.stats()["evictions"] == 2
        big.close()


def test_stats_count_hits_misses_evictions_copies(client, coord):
    h = client.allocate(prompt=list(range(8)))
    h.commit()
    client.allocate(prompt=list(range(10)))
    st = client.stats()
    assert st["prefix_hit_blocks"] == 2 and st["prefix_miss_blocks"] == 2
    assert st["prefix_hit_tokens"] == 8 and st["prefix_miss_tokens"] == 10
    for key in ("cached_blocks", "evictions", "cow_copies"):
        assert key in st


def test_other_clients_of_a_sequence_see_its_copy_on_write(coord, client):
    """A copy-on-write made through one client moves the sequence to a new block; a
    handle of the same sequence in another client must follow, never read the fork's."""
    with shmkv.connect(coord.address) as other:
        p = client.allocate(2)
        p.write(0, torch.ones(2, 4, 8), torch.ones(2, 4, 8), start=0)
        pb = other.open(p.export(10))
        assert torch.equal(pb.key_cache(0), torch.ones(2, 4, 8))
        c = p.fork()
        p.write(0, torch.full((2, 4, 8), 2.0), torch.full((2, 4, 8), 2.0), start=0)
        c.write(0, torch.full((2, 4, 8), 9.0), torch.full((2, 4, 8), 9.0), start=0)
        assert torch.equal(pb.key_cache(0), torch.full((2, 4, 8), 2.0))
        assert torch.equal(pb.gather_all()[0, 0], torch.full((2, 4, 8), 2.0))
        k_pages, _v, table = pb.paged_kv(0)
        assert table.tolist() == p.block_table.to_tensor().tolist()
        assert torch.equal(c.key_cache(0), torch.full((2, 4, 8), 9.0))


def test_packed_and_listed_prompts_key_the_same_blocks(client):
    """Clients send prompts packed (int64 LE); a prompt sent as a list of ints (an
    older client, another language) finds the same published blocks, and a packed
    prompt that is not whole int64s is refused with nothing taken."""
    from shmkv import hashing

    prompt = list(range(900, 913))  # 3 full blocks of 4 + 1 token
    h = client.allocate(prompt=prompt)
    k = torch.randn(len(prompt), 4, 8)
    for layer in range(3):
        h.write(layer, k, -k, start=0)
    h.commit(len(prompt))
    h.close()
    before = client.stats()
    listed = client.request("allocate_many", requests=[{"num_tokens": 0, "prompt": prompt}])
    packed = client.request(
        "allocate_many", requests=[{"num_tokens": 0, "prompt": hashing.pack_tokens(prompt)}]
    )
    assert listed[0]["num_cached"] == packed[0]["num_cached"] == 12
    with pytest.raises(shmkv.errors.WrongType, match="int64"):
        client.request("allocate_many", requests=[{"num_tokens": 0, "prompt": b"\x01" * 12}])
    with pytest.raises(shmkv.errors.WrongType):
        client.request("allocate_many", requests=[{"num_tokens": 0, "prompt": [1, True]}])
    client.request("release_many", cache_ids=[listed[0]["cache_id"], packed[0]["cache_id"]])
    after = client.stats()
    assert after["referenced_blocks"] == before["referenced_blocks"]
    assert after["prefix_hit_blocks"] == before["prefix_hit_blocks"] + 6


def test_a_prompt_comes_with_its_block_keys_from_the_client(client, monkeypatch):
    """The client hashes a prompt's full blocks and sends the keys; the coordinator's
    loop uses them as they are (hashing only a request that has none), checks their
    size, and a request it refuses takes nothing."""
    from shmkv import hashing

    hashed_in_loop = []
    real = hashing.packed_block_keys
    monkeypatch.setattr(
        hashing, "packed_block_keys", lambda *a: hashed_in_loop.append(a) or real(*a)
    )
    salt = b"model-a"
    prompt = list(range(300, 313))  # 3 full blocks of 4 + 1 token
    h = client.allocate(prompt=prompt, cache_salt=salt)
    k = torch.randn(len(prompt), 4, 8)
    for layer in range(3):
        h.write(layer, k, -k, start=0)
    h.commit(len(prompt))
    h.close()
    assert not hashed_in_loop  # the client's keys were used
    packed = hashing.pack_tokens(prompt)
    # A request without keys is hashed in the loop, to the same keys.
    info = client.request(
        "allocate_many", requests=[{"num_tokens": 0, "prompt": packed, "cache_salt": salt}]
    )[0]
    assert info["num_cached"] == 12 and len(hashed_in_loop) == 1
    # The keys are what the loop looks up: another prompt's keys find its blocks.
    other = hashing.pack_tokens(list(range(1, 14)))
    keys = b"".join(real(packed, 4, hashing.root_key(salt)))
    info2 = client.request(
        "allocate_many",
        requests=[{"num_tokens": 0, "prompt": other, "cache_salt": salt, "keys": keys}],
    )[0]
    assert info2["num_cached"] == 12 and info2["blocks"][:3] == info["blocks"][:3]
    client.request("release_many", cache_ids=[info["cache_id"], info2["cache_id"]])
    before = client.stats()
    for req, error, match in (
        ({"prompt": packed, "keys": keys[:-1]}, shmkv.errors.InvalidArgument, "48 bytes"),
        (
            {"prompt": packed, "keys": keys + keys[:16]},
            shmkv.errors.InvalidArgument,
            "3 full blocks",
        ),
        (
            {"num_tokens": 4, "keys": keys[:16]},
            shmkv.errors.InvalidArgument,
            "come with the prompt",
        ),
        ({"prompt": packed, "keys": "text"}, shmkv.errors.WrongType, "keys"),
    ):
        with pytest.raises(error, match=match):
            client.request("allocate_many", requests=[{"num_tokens": 0, **req}])
    after = client.stats()
    for name in ("referenced_blocks", "sequences", "prefix_hit_blocks", "prefix_miss_blocks"):
        assert after[name] == before[name], name


def _wait_computing(client, prompt, want, timeout=10.0):
    deadline = time.monotonic() + timeout
    while client.computing(prompt) != want and time.monotonic() < deadline:
        time.sleep(0.02)
    return client.computing(prompt)


def test_computing_counts_the_blocks_another_client_writes_until_it_commits(coord, client):
    prompt = list(range(300, 323))  # 5 full blocks of 4 + 3 tokens
    counted = client.stats()["prefix_miss_tokens"], client.stats()["prefix_hit_tokens"]
    assert client.computing(prompt) == (0, 0)
    with shmkv.connect(coord.address, timeout=10) as other:
        plain = other.allocate(prompt=prompt)  # a plain allocation is never waited for
        assert client.computing(prompt) == (0, 0)
        plain.close()
        writer = other.allocate(prompt=prompt, defer=True)
        assert writer.num_cached_tokens == 0
        assert client.computing(prompt) == (0, 20)
        assert client.computing(prompt + [1, 2, 3, 4, 5]) == (0, 20)  # its next block: no one's
        assert client.computing(prompt[:9] + [0] + prompt[10:]) == (0, 8)  # up to where it differs
        assert client.computing(prompt, cache_salt=b"tenant") == (0, 0)
        assert other.computing(prompt) == (0, 0)  # its own sequence: not waited for
        kv = workers.token_kv(prompt, 0, writer.num_heads, writer.head_dim)
        for layer in range(writer.num_layers):
            writer.write(layer, kv[0], kv[1], start=0)
        writer.commit(8)  # two blocks published: the rest is still being computed
        assert client.computing(prompt) == (8, 12)
        writer.commit(len(prompt))
        assert client.computing(prompt) == (20, 0)
        writer.close()
        assert client.computing(prompt) == (20, 0)  # cached, not computed
        # a writer that releases before it commits stops counting at once
        again = other.allocate(prompt=list(range(900, 912)), defer=True)
        assert client.computing(list(range(900, 912))) == (0, 12)
        again.close()
        assert client.computing(list(range(900, 912))) == (0, 0)
    # asking allocated nothing and counted nothing: the misses are the writers' (23 + 23 + 12)
    st = client.stats()
    assert (st["prefix_miss_tokens"], st["prefix_hit_tokens"]) == (counted[0] + 58, counted[1])
    assert st["referenced_blocks"] == 0


def test_computing_stops_counting_a_writer_killed_before_it_commits(coord, client):
    prompt = list(range(600, 616))  # 4 full blocks
    q, go = SPAWN.Queue(), SPAWN.Event()
    p = SPAWN.Process(target=workers.allocate_then_die, args=(coord.address, prompt, q, go))
    p.start()
    try:
        assert q.get(timeout=30) == 0
        assert client.computing(prompt) == (0, 16)
    finally:
        go.set()
        join_or_kill(p)
    assert _wait_computing(client, prompt, (0, 0)) == (0, 0)
    h = client.allocate(prompt=prompt, defer=True)  # the one that asks now computes it
    assert h.num_cached_tokens == 0
    with shmkv.connect(coord.address, timeout=10) as other:
        assert other.computing(prompt) == (0, 16)
        h.close()
        assert other.computing(prompt) == (0, 0)


def test_the_in_flight_index_stays_bounded_by_the_pool(coord, client):
    prefix = coord.table._prefix  # (the coordinator's own part: no client sees its size)
    bound = 2 * coord.config.num_blocks + 1024
    for i in range(2 * bound // 4):
        client.allocate(prompt=list(range(10_000 + 16 * i, 10_016 + 16 * i)), defer=True).close()
    assert len(prefix.in_flight) <= bound + 4
    with shmkv.connect(coord.address, timeout=10) as other:
        live = other.allocate(prompt=list(range(16)), defer=True)
        assert client.computing(list(range(16))) == (0, 16)
        live.close()


def test_computing_refuses_bad_prompts_and_changes_nothing(coord, client):
    with pytest.raises(shmkv.InvalidArgument):
        client.computing([2**63])
    with pytest.raises(shmkv.WrongType):
        client.request("computing", prompt=b"123")  # not whole int64 token ids
    with pytest.raises(shmkv.InvalidArgument):
        client.request("computing", prompt=b"\0" * 32, keys=b"short")
    assert client.computing([]) == (0, 0)
    # longer than a sequence may be (here: than the pool): refused before it is hashed
    with pytest.raises((shmkv.LimitExceeded, shmkv.PoolExhausted), match="computing"):
        client.request("computing", prompt=b"\0" * 8 * (coord.config.max_seq_len + 1))
    with pytest.raises(shmkv.WrongType):
        client.request("allocate", num_tokens=0, prompt=b"\0" * 32, defer=1)
    assert client.stats()["referenced_blocks"] == 0


def test_allocate_defers_to_another_clients_computation_and_counts_nothing(coord, client):
    prompt = list(range(700, 723))  # 5 full blocks + 3
    with shmkv.connect(coord.address, timeout=10) as other:
        writer = other.allocate(prompt=prompt, defer=True)  # nobody computes it: allocated
        assert isinstance(writer, shmkv.KvCacheHandle) and writer.num_cached_tokens == 0
        before = client.stats()
        deferred = client.allocate(prompt=prompt, defer=True)
        assert deferred == shmkv.Computing(cached_tokens=0, computing_tokens=20)
        mixed = client.allocate_many(
            [dict(prompt=prompt, defer=True), dict(prompt=list(range(800, 808)), defer=True)]
        )
        assert mixed[0] == (0, 20) and isinstance(mixed[1], shmkv.KvCacheHandle)
        mixed[1].close()
        after = client.stats()
        assert after["sequences"] == before["sequences"]
        assert after["prefix_miss_tokens"] == before["prefix_miss_tokens"] + 8  # the second
        assert after["deferred_allocations"] == before["deferred_allocations"] + 2
        assert client.allocate(prompt=prompt, defer=1) == (0, 20)  # (any truthy value)
        assert isinstance(other.allocate(prompt=prompt, defer=True), shmkv.KvCacheHandle)
        plain = client.allocate(prompt=prompt)  # without defer: computed again, as before
        assert plain.num_cached_tokens == 0
        plain.close()
        kv = workers.token_kv(prompt, 0, writer.num_heads, writer.head_dim)
        for layer in range(writer.num_layers):
            writer.write(layer, kv[0], kv[1], start=0)
        writer.commit(12)
        assert client.allocate(prompt=prompt, defer=True) == (12, 8)
        writer.commit(len(prompt))
        hit = client.allocate(prompt=prompt, defer=True)
        assert hit.num_cached_tokens == 20
        hit.close()


def test_of_processes_racing_to_allocate_one_prompt_with_defer_exactly_one_computes(coord):
    prompts = [list(range(1000 + 40 * i, 1000 + 40 * i + 17)) for i in range(10)]  # 50 blocks of 64
    q, start, done = SPAWN.Queue(), SPAWN.Event(), SPAWN.Event()
    procs = [
        SPAWN.Process(target=workers.defer_racer, args=(coord.address, prompts, start, q, done))
        for _ in range(3)
    ]
    for p in procs:
        p.start()
    try:
        start.set()
        got = [q.get(timeout=30) for _ in procs]
    finally:
        done.set()
        for p in procs:
            join_or_kill(p)
    assert [sum(column) for column in zip(*got)] == [1] * len(prompts), got
