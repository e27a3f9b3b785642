"""BlockPool and SequenceTable in one process: allocation, ref counts, prefix index,
eviction, copy-on-write, hand-offs."""

import pytest

from shmkv import errors, hashing
from shmkv.coordinator.allocator import BlockPool
from shmkv.coordinator.sequences import SequenceTable

BS = 4


def make_table(num_blocks=16, **kw):
    copies = []
    table = SequenceTable(
        BlockPool(num_blocks), BS, copy_block=lambda s, d: copies.append((s, d)), **kw
    )
    table.add_connection(1)
    table.add_connection(2)
    return table, copies


def test_allocate_free_is_all_or_nothing():
    pool = BlockPool(8)
    a = pool.allocate(5, owner_id=1)
    assert a == [0, 1, 2, 3, 4]
    assert pool.allocate(4, owner_id=2) is None
    assert pool.num_free == 3 and list(pool.ref_cnt[5:]) == [0, 0, 0]
    pool.decref(a)
    assert pool.num_free == 8
    pool.check_invariants()


def test_pool_exhausted_changes_nothing():
    table, _ = make_table(num_blocks=8)
    table.allocate(1, 12)
    before = (table.stats(), list(table.pool.ref_cnt), dict(table.sequences))
    with pytest.raises(errors.PoolExhausted, match="need 6 blocks, 5 free"):
        table.allocate_many(1, [{"num_tokens": 8}, {"num_tokens": 16}])
    assert (table.stats(), list(table.pool.ref_cnt), dict(table.sequences)) == before
    table.check_invariants()


def test_references_per_connection_and_drop():
    table, _ = make_table()
    info = table.allocate(1, 9)
    cid = info["cache_id"]
    table.clone(1, cid)
    with pytest.raises(errors.UnknownCache, match="not held by this connection"):
        table.release(2, cid)  # another connection's cache id
    token = table.export(1, cid, ttl=30)
    assert table.drop_connection(1) == 2
    assert cid in table.sequences  # the hand-off keeps it alive
    opened = table.open(2, token)
    assert opened["blocks"] == info["blocks"]
    with pytest.raises(errors.HandoffError):
        table.open(2, token)  # one-shot
    table.release(2, cid)
    assert table.pool.num_free == 16
    table.check_invariants()


def test_handoff_expires_and_forged_tokens_fail():
    now = [0.0]
    table, _ = make_table(clock=lambda: now[0])
    cid = table.allocate(1, 4)["cache_id"]
    token = table.export(1, cid, ttl=5)
    table.release(1, cid)
    forged = token[:-1] + bytes([token[-1] ^ 1])
    with pytest.raises(errors.HandoffError):
        table.open(2, forged)
    now[0] = 5.1
    assert table.expire() == 1
    assert table.pool.num_free == 16 and not table.sequences
    with pytest.raises(errors.HandoffError):
        table.open(2, token)
    with pytest.raises(errors.HandoffError, match="malformed"):
        table.open(2, b"short")


def test_extend_reserves_and_reports_table_tail():
    table, _ = make_table()
    cid = table.allocate(1, 3)["cache_id"]
    r = table.extend(1, cid, 6)
    assert r["start"] == 3 and r["num_tokens"] == 9
    assert r["table_from"] == 0 and len(r["blocks"]) == 3
    with pytest.raises(errors.InvalidArgument):
        table.extend(1, cid, -1)
    with pytest.raises(errors.PoolExhausted):
        table.extend(1, cid, 10**6)
    assert table.sequences[cid].num_tokens == 9
    table.check_invariants()


def test_fork_copy_on_write_of_partial_last_block():
    table, copies = make_table()
    parent = table.allocate(1, 6)["cache_id"]  # blocks [0, 1], block 1 half full
    child = table.fork(1, parent)["cache_id"]
    assert list(table.pool.ref_cnt[:2]) == [2, 2]
    r = table.extend(1, child, 1)
    assert copies == [(1, r["blocks"][0])]  # the shared last block was copied
    assert table.sequences[child].block_ids[0] == 0  # full blocks stay shared
    assert table.pool.ref_cnt[1] == 1
    # the parent's partial block is now only its own: extending it needs no copy
    table.extend(1, parent, 1)
    assert len(copies) == 1
    table.check_invariants()


def test_prepare_write_copies_shared_blocks_only():
    table, copies = make_table()
    a = table.allocate(1, 8)["cache_id"]
    b = table.fork(1, a)["cache_id"]
    info = table.prepare_write(1, b, 5, 2)  # touches block 1 only
    assert len(copies) == 1 and copies[0][0] == 1
    assert info["blocks"][0] == 0 and info["blocks"][1] != 1
    assert table.pool.owner[info["blocks"][1]] == b
    with pytest.raises(errors.OutOfRange):
        table.prepare_write(1, b, 7, 2)
    table.check_invariants()


def test_prefix_publish_hit_and_lru_eviction():
    table, _ = make_table(num_blocks=6)
    prompt = list(range(12))  # 3 full blocks
    a = table.allocate(1, prompt=prompt)
    assert a["num_cached"] == 0
    assert table.commit(1, a["cache_id"], 12) == 3
    b = table.allocate(2, prompt=prompt + [99])
    assert b["num_cached"] == 12 and b["blocks"][:3] == a["blocks"]
    table.release(1, a["cache_id"])
    table.release(2, b["cache_id"])
    assert table.pool.num_cached == 3
    # LRU: the tail of the prefix was freed first, so it is evicted first
    c = table.allocate(1, 16)  # 3 free + 1 evicted
    assert table.pool.num_evictions == 1
    assert a["blocks"][2] in c["blocks"]
    assert table.pool.lookup(hashing.block_keys(prompt, BS, hashing.root_key())) == a["blocks"][:2]
    table.check_invariants()


def test_referenced_blocks_are_never_evicted():
    table, _ = make_table(num_blocks=4)
    a = table.allocate(1, prompt=list(range(8)))
    table.commit(1, a["cache_id"], 8)
    with pytest.raises(errors.PoolExhausted):
        table.allocate(2, 12)
    assert table.pool.num_evictions == 0
    table.check_invariants()


def test_salt_separates_namespaces_and_uncommitted_blocks_are_not_hits():
    table, _ = make_table()
    prompt = list(range(8))
    a = table.allocate(1, prompt=prompt)
    assert table.allocate(2, prompt=prompt)["num_cached"] == 0  # not committed yet
    table.commit(1, a["cache_id"], 8)
    assert table.allocate(2, prompt=prompt, cache_salt=b"other")["num_cached"] == 0
    assert table.allocate(2, prompt=prompt)["num_cached"] == 8


def test_tp_block_published_only_when_every_rank_committed():
    table, _ = make_table(tp_size=2)
    a = table.allocate(1, prompt=list(range(8)))["cache_id"]
    assert table.commit(1, a, 8, tp_rank=0) == 0
    assert table.allocate(2, prompt=list(range(8)))["num_cached"] == 0
    assert table.commit(1, a, 8, tp_rank=1) == 2
    assert table.allocate(2, prompt=list(range(8)))["num_cached"] == 8


def test_extend_with_tokens_keeps_prefix_keys_going():
    table, _ = make_table()
    a = table.allocate(1, prompt=[1, 2, 3])["cache_id"]
    table.extend(1, a, 5, tokens=[4, 5, 6, 7, 8])
    table.commit(1, a, 8)
    assert table.allocate(2, prompt=[1, 2, 3, 4, 5, 6, 7, 8, 9])["num_cached"] == 8


def test_hashing_is_deterministic_and_chained():
    root = hashing.root_key(b"m")
    keys = hashing.block_keys(list(range(8)), 4, root)
    assert keys == hashing.block_keys(list(range(8)), 4, hashing.root_key(b"m"))
    assert len(keys) == 2 and all(len(k) == 16 for k in keys)
    assert hashing.block_keys([0, 1, 2, 3], 4, root) == keys[:1]
    other = hashing.block_keys([9, 1, 2, 3, 4, 5, 6, 7], 4, root)
    assert other[1] != keys[1]  # the parent is part of the key
    # a fixed vector: keys must not change between processes, runs, versions or machines
    assert (
        hashing.block_keys([1, 2, 3, 4], 4, hashing.root_key())[0].hex()
        == "c07abdb4dd08e109ffbff08c8961885f"
    )
    # keys sent joined (as clients send a prompt's) come apart in order
    assert hashing.split_keys(b"".join(keys + other)) == keys + other
    assert hashing.split_keys(b"") == []
    many = [bytes([i % 256]) * 16 for i in range(hashing._SPLIT_MAX + 3)]
    assert hashing.split_keys(b"".join(many)) == many


def test_a_blocks_identity_moves_where_its_key_is_bound_and_unbound():
    """(key, generation): publish binds, eviction unbinds; a copy recorded under one
    binding is refused after either, even when the same key comes back (ABA)."""
    pool = BlockPool(2)
    key = b"k" * 16
    [block] = pool.allocate(1, owner_id=1)
    unkeyed = pool.identity(block)
    assert unkeyed[0] is None and pool.still_holds(block, None, unkeyed[1])
    assert pool.publish(block, key)
    bound = pool.identity(block)
    assert bound[0] == key and bound[1] != unkeyed[1]
    assert not pool.still_holds(block, None, unkeyed[1])  # a copy in must not publish
    pool.decref([block])  # cached: keeps its binding
    pool.incref([block])
    pool.decref([block])
    assert pool.still_holds(block, key, bound[1])
    other = pool.allocate(2, owner_id=2)  # evicts it
    assert block in other and not pool.still_holds(block, key, bound[1])
    pool.publish(block, key)  # the same key again
    assert not pool.still_holds(block, key, bound[1])  # another binding
    assert pool.still_holds(block, *pool.identity(block))
    pool.discard_copies(2)
    pool.discard_copies(0)
    assert pool.num_copies_discarded == 2
    pool.check_invariants()
