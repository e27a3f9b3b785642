"""The control plane at batch scale: plain sequences kept as rows of the shared tables
(no object until a call needs one), cache ids that carry their slot, the decode step a
connection repeats, and the client's re-read of only the table rows that changed."""

import os
import time

import numpy as np
import pytest
import torch
from test_batch import BS, D, H, L, cfg, client, coord, expected_kv, write_step  # noqa: F401

import shmkv
from shmkv import errors, protocol
from shmkv.coordinator.allocator import BlockPool
from shmkv.coordinator.sequences import SequenceTable
from shmkv.memory.tables import CACHE_ID, NUM_TOKENS


def make_table(num_blocks=64, max_sequences=16):
    table = SequenceTable(BlockPool(num_blocks), BS, max_sequences=max_sequences, max_seq_blocks=16)
    table.add_connection(1)
    table.add_connection(2)
    return table


def test_plain_sequences_get_an_object_only_when_a_call_needs_one():
    table = make_table()
    ids, slots = table.allocate_counts(1, [0, 3, 4, 9])
    assert not table.sequences and table.num_sequences == 4
    assert table.stats()["sequences"] == 4
    assert ((ids & ((1 << table.slot_bits) - 1)) == slots).all()  # the id carries its slot
    assert table._rows.seq_np[slots, CACHE_ID].tolist() == ids.tolist()
    assert table._rows.seq_np[slots, NUM_TOKENS].tolist() == [0, 3, 4, 9]
    table.check_invariants()
    child = table.fork(1, int(ids[3]))["cache_id"]  # the parent gets its object
    assert set(table.sequences) == {int(ids[3]), child}
    assert table.sequences[int(ids[3])].block_ids == table.sequences[child].block_ids
    assert table.info(1, int(ids[1]))["num_tokens"] == 3  # and so does this one
    assert table.num_sequences == 5
    table.check_invariants()
    table.release_many(1, [int(i) for i in ids] + [child])  # plain and objects together
    assert table.num_sequences == 0 and table.pool.num_free == 64
    assert table.tables.num_free == 16
    table.check_invariants()


def test_releasing_plain_sequences_of_different_lengths_frees_each_block_once():
    table = make_table()
    for counts in ([0, 1], [0, 5, 4, 0], [9, 0, 1]):
        ids, _ = table.allocate_counts(1, counts)
        table.release_many(1, ids.tolist())
        assert table.pool.num_free == 64 and table.num_sequences == 0
        table.check_invariants()
    ids, _ = table.allocate_counts(1, [0, 4, 0])
    assert table.drop_connection(1) == 3 and table.pool.num_free == 64
    table.check_invariants()


def test_release_of_plain_sequences_checks_every_id_first():
    table = make_table()
    ids, slots = table.allocate_counts(1, [5, 5])
    other, _ = table.allocate_counts(2, [1])
    forged = int(ids[0]) + (1 << table.slot_bits)  # the right slot, another serial
    before = (table.pool.num_free, table.num_sequences, table._rows.seq_np.copy())
    for bad in (
        [int(ids[0]), forged],
        [int(ids[0]), int(other[0])],
        [int(ids[0]), int(ids[0])],
        [int(ids[0]), -1],
    ):
        with pytest.raises(errors.UnknownCache):
            table.release_many(1, bad)
        assert (table.pool.num_free, table.num_sequences) == before[:2]
        assert (table._rows.seq_np == before[2]).all()
    with pytest.raises(errors.UnknownCache):  # a commit names only what it holds
        table.commit_batch(1, [int(ids[0]), int(other[0])], [0, 0])
    with pytest.raises(errors.OutOfRange):
        table.commit_batch(1, [int(i) for i in ids], [5, 6])
    assert table.commit_batch(1, [int(i) for i in ids], [5, 5]) == 0
    table.check_invariants()


def test_a_kept_batch_is_checked_again_once_its_sequences_change():
    table = make_table()
    ids, slots = table.allocate_counts(1, [3, 4, 7])
    batch = table.keep_batch(1, ids.tolist())
    assert batch and table.keep_batch(2, ids.tolist()) == 0  # another connection's
    done = table.extend_kept(1, batch, 1, seen=0)
    assert done["same"] and done["steps"] == 1 and "lens" not in done
    assert table._rows.seq_np[slots, NUM_TOKENS].tolist() == [4, 5, 8]
    assert done["grown"].tolist() == [1]  # 4 tokens filled its block
    assert done["blocks"].tolist() == [table._rows.table_np[slots[1], 1]]
    done = table.extend_kept(1, batch, 1, seen=0)  # our rows are a step behind
    assert done["lens"].tolist() == [5, 6, 9] and not done["same"]
    assert table.extend_kept(2, batch, 1, seen=2) is None  # not that connection's
    table.extend_batch(1, [int(ids[0])], 1, None, [int(slots[0])])  # changed another way
    done = table.extend_kept(1, batch, 1, seen=2)
    assert done["lens"].tolist() == [7, 7, 10] and not done["same"]
    done = table.extend_kept(1, batch, 1, seen=3)
    assert done["same"]  # checked again, kept again
    for _ in range(12):  # 16 steps on, each sequence opened exactly one more block
        done = table.extend_kept(1, batch, 1, seen=done["steps"])
        assert done["same"]
    assert table._rows.seq_np[slots, NUM_TOKENS].tolist() == [20, 20, 23]
    assert table._rows.num_blocks_np[slots].tolist() == [5, 5, 6]
    table.check_invariants()
    table.release_many(1, [int(ids[1])])
    with pytest.raises(errors.UnknownCache):
        table.extend_kept(1, batch, 1, seen=4)
    assert table._rows.seq_np[slots[[0, 2]], NUM_TOKENS].tolist() == [20, 23]  # nothing changed
    new_ids, new_slots = table.allocate_counts(1, [0])
    assert new_slots.tolist() == [slots[1]]  # the freed slot, a new id
    with pytest.raises(errors.UnknownCache):
        table.extend_kept(1, batch, 1, seen=4)
    assert table._rows.seq_np[new_slots, NUM_TOKENS].tolist() == [0]
    with pytest.raises(errors.InvalidArgument):
        table.extend_kept(1, batch, 0, seen=4)
    table.check_invariants()


def copying_table(copies: list) -> SequenceTable:
    """A table (connections 1 and 2) whose copies on write are noted in ``copies``."""
    table = SequenceTable(
        BlockPool(64),
        BS,
        copy_block=lambda s, d: copies.append((s, d)),
        max_sequences=16,
        max_seq_blocks=16,
    )
    table.add_connection(1)
    table.add_connection(2)
    return table


def test_a_kept_batch_copies_a_block_a_fork_shared_since():
    copies = []
    table = copying_table(copies)
    ids, slots = table.allocate_counts(1, [5, 5])
    batch = table.keep_batch(1, ids.tolist())
    assert table.extend_kept(1, batch, 1, seen=0)["same"]
    child = table.fork(1, int(ids[0]))["cache_id"]  # shares the last block (6 of 8)
    done = table.extend_kept(1, batch, 1, seen=1)
    assert not done["same"] and list(done["lens"]) == [7, 7]
    assert len(copies) == 1 and copies[0][0] == table.sequences[child].block_ids[1]
    assert table._rows.table_np[slots[0], 1] == copies[0][1]
    table.check_invariants()


def test_a_connection_keeps_its_newest_batches():
    from shmkv.coordinator.sequences import MAX_KEPT

    table = make_table(num_blocks=256, max_sequences=MAX_KEPT + 4)
    ids, _ = table.allocate_counts(1, [1] * (MAX_KEPT + 1))
    kept = [table.keep_batch(1, [int(i)]) for i in ids]
    assert table.extend_kept(1, kept[0], 1, seen=0) is None  # dropped for a newer one
    assert table.extend_kept(1, kept[-1], 1, seen=0)["same"]
    table.drop_connection(1)
    assert table.extend_kept(1, kept[-1], 1, seen=1) is None
    table.check_invariants()


def test_a_repeated_decode_step_copies_a_block_a_fork_shared_since(client):
    hs = client.allocate_many([5, 5])
    batch = client.batch(hs)
    write_step(batch.prefill(start=0))
    for _ in range(2):  # the coordinator now knows this batch
        write_step(batch.extend(1))
    child = hs[0].fork()  # shares the partly filled last block (7 of 8)
    child_before = child.gather_all().clone()
    step = batch.extend(1)  # must copy that block for the parent
    assert step.block_tables[0, 1] != child.block_table.physical_blocks[1]
    assert step.block_tables[1, 1] == hs[1].block_table.physical_blocks[1]
    k = torch.full((2, H, D), 7.0)
    for layer in range(L):
        step.write(layer, k, k)
    assert torch.equal(child.gather_all(), child_before)
    assert torch.equal(hs[0].key_cache(0)[7], k[0])
    for layer in range(L):
        assert torch.equal(hs[0].key_cache(layer)[:7], expected_kv(hs[0], layer, 0, 7))
        assert torch.equal(child.key_cache(layer), expected_kv(hs[0], layer, 0, 7))


def checked_decode_step(batch, hs):
    """``batch.extend(1)``, its tensors checked against each handle's own table."""
    before = [h.num_tokens for h in hs]
    step = batch.extend(1)
    width = step.block_tables.shape[1]
    for row, h, n in zip(step.block_tables.tolist(), hs, before):
        table = list(h.block_table.physical_blocks)
        assert row == (table + [0] * width)[:width]
        assert len(table) == -(-(n + 1) // BS)
    assert step.slot_mapping.tolist() == [
        h.block_table.physical_blocks[n // BS] * BS + n % BS for h, n in zip(hs, before)
    ]
    assert step.seq_lens.tolist() == [n + 1 for n in before]
    return step


def test_step_tables_stay_exact_over_many_steps_with_forks(client):
    hs = client.allocate_many([0, 1, 5, 2])
    batch = client.batch(hs)
    first = batch.extend(1)
    write_step(first)
    first_tables = first.block_tables.clone()
    forks = []
    for i in range(40):
        if i % 7 == 3:  # a fork shares blocks; the next step copies the last one
            forks.append(hs[i % 4].fork())
        write_step(checked_decode_step(batch, hs))
    assert torch.equal(first.block_tables, first_tables)  # a step keeps its own tables
    for h in hs:
        n = h.num_tokens
        first_new = n - 41
        for layer in range(L):
            assert torch.equal(
                h.key_cache(layer)[first_new:], expected_kv(h, layer, 0, n)[first_new:]
            )
    client.close_many(forks)


def test_close_many_of_handles_that_never_read_their_row(coord, client):
    hs = client.allocate_many([1] * 40)
    assert hs[3].num_tokens == 1  # this one reads its row (and keeps a view)
    assert len(client._states) == 1
    client.close_many(hs)
    assert all(h._closed for h in hs) and not client._states and not client._handles
    with pytest.raises(shmkv.HandleClosed):
        _ = hs[0].block_table
    stats = coord.stats()
    assert stats["sequences"] == 0 and stats["free_blocks"] == stats["num_blocks"]
    with pytest.raises(errors.InvalidArgument, match="one of cache_ids and ids"):
        client.request("release_many", cache_ids=[1], ids=b"\0" * 8)


def test_close_many_without_waiting_is_served_before_the_next_request(coord, client):
    base = coord.stats()
    hs = client.allocate_many([1] * 64)
    client.close_many(hs, wait=False)
    assert all(h._closed for h in hs) and not client._handles
    # This client's next request is served after the release: it never sees them held.
    stats = client.stats()
    assert stats["sequences"] == base["sequences"]
    assert stats["free_blocks"] == base["free_blocks"]
    client.flush()  # nothing refused: no error
    # A release the coordinator refuses is raised by flush(), named, and only once.
    h = client.allocate_many([1])[0]
    client.request("release_many", ids=protocol.pack_i64s([h._cache_id]))  # behind its back
    client.close_many([h], wait=False)
    with pytest.raises(errors.UnknownCache, match="sent without waiting"):
        client.flush()
    client.flush()  # raised once, then cleared
    assert client.stats()["sequences"] == base["sequences"]  # and the client goes on


def test_a_commit_without_waiting_publishes_before_the_next_request(coord, client):
    prompt = list(range(4 * coord.config.block_size))
    h = client.allocate(prompt=prompt)
    assert h.commit(wait=False) is None
    again = client.allocate(prompt=prompt)  # served after the commit
    assert again.num_cached_tokens == len(prompt)
    assert client.posted_errors() == []
    # a commit the coordinator refuses (past the sequence's end) is kept, once
    again.commit(len(prompt) + 100, wait=False)
    client.ping()  # its answer came in on the way
    refused = client.posted_errors()
    assert [(op, type(exc)) for op, exc in refused] == [("commit", errors.OutOfRange)]
    assert client.posted_errors() == []
    client.flush()  # already taken: nothing raised
    client.close_many([h, again])


def test_a_dropped_connection_frees_plain_and_object_sequences():
    table = make_table()
    ids, _ = table.allocate_counts(1, [4, 8, 1])
    table.clone(1, int(ids[0]))  # an object with two references
    token = table.export(1, int(ids[1]), ttl=30)  # one held by a hand-off
    assert table.drop_connection(1) == 4
    assert table.num_sequences == 1
    table.check_invariants()
    opened = table.open(2, token)
    assert opened["num_tokens"] == 8
    table.release(2, opened["cache_id"])
    assert table.pool.num_free == 64 and table.num_sequences == 0
    table.check_invariants()


def test_a_batch_steps_on_when_its_kept_batch_was_dropped(client, monkeypatch):
    monkeypatch.setattr(shmkv.coordinator.decode, "MAX_KEPT", 4)  # (the coordinator's thread)
    hs = client.allocate_many([3, 1, 2])
    first = client.batch(hs)
    write_step(first.extend(1))
    old = first._kept
    assert old
    for _ in range(4):  # newer batches over the same sequences
        write_step(client.batch(hs).extend(1))
    before = [h.num_tokens for h in hs]
    step = first.extend(1)  # its kept batch is gone: sent by ids again
    assert first._kept not in (0, old) and step.seq_lens.tolist() == [n + 1 for n in before]
    for row, h in zip(step.block_tables.tolist(), hs):
        assert row[: len(h.block_table.physical_blocks)] == list(h.block_table.physical_blocks)
    write_step(step)
    for h in hs:
        for layer in range(L):
            n = h.num_tokens
            assert torch.equal(h.value_cache(layer)[n - 6 :], expected_kv(h, layer, 1, n)[n - 6 :])


def test_run_index_is_a_slice_only_for_one_ascending_run():
    from shmkv.memory.tables import run_index

    run = np.arange(40, 72, dtype=np.int64)
    assert run_index(run) == slice(40, 72)
    for ids in (
        run[::-1].copy(),
        np.r_[run[:16], run[17:], 72],
        np.r_[run[1:], 40],
        np.arange(0, 64, 2, dtype=np.int64),
        run[:8],
    ):
        assert run_index(ids) is ids  # reversed, a gap, wrapped, strided, short
    # The stores through either index are the same.
    a, b = np.zeros(100), np.zeros(100)
    a[run_index(run)] = np.arange(32)
    b[run] = np.arange(32)
    assert np.array_equal(a, b)


def prompt_sequences(table, lengths, conn=1, start=1000):
    """Sequences allocated with prompts (objects with prefix keys), as an engine's are."""
    infos = table.allocate_many(
        conn,
        [
            {"num_tokens": 0, "prompt": list(range(start + 100 * i, start + 100 * i + n))}
            for i, n in enumerate(lengths)
        ],
    )
    return [info["cache_id"] for info in infos], [info["slot"] for info in infos]


def test_a_batch_of_prompt_sequences_is_kept_once_its_keys_close():
    table = make_table()
    ids, slots = prompt_sequences(table, [3, 4, 6])
    assert table.keep_batch(1, ids) == 0  # prompt keys still open: not yet
    table.extend_batch(1, ids, 1, None, slots)  # an extend without ids closes them
    batch = table.keep_batch(1, ids)
    assert batch
    seen = 0
    for _ in range(13):  # across block boundaries: 4, 5 -> 8, 9 and 7 -> 8
        done = table.extend_kept(1, batch, 1, seen=seen)
        assert done["same"]
        seen = done["steps"]
        table.check_invariants()  # the objects moved with the shared rows
    assert [table.sequences[i].num_tokens for i in ids] == [17, 18, 20]
    assert [len(table.sequences[i].block_ids) for i in ids] == [5, 5, 5]
    for i, slot in zip(ids, slots):
        seq = table.sequences[i]
        assert table._rows.table_np[slot, :5].tolist() == seq.block_ids
        assert table._rows.seq_np[slot, NUM_TOKENS] == seq.num_tokens
    # A commit publishes full blocks only: the batch stays kept.
    table.commit(1, ids[0], 16)
    assert table.extend_kept(1, batch, 1, seen=seen)["same"]
    table.check_invariants()


def test_a_kept_batch_of_prompt_sequences_checks_again_after_a_share():
    copies = []
    table = copying_table(copies)
    ids, slots = prompt_sequences(table, [5, 6])
    table.extend_batch(1, ids, 1, None, slots)  # 6 and 7 tokens
    batch = table.keep_batch(1, ids)
    assert table.extend_kept(1, batch, 1, seen=0)["same"]  # 7 and 8
    child = table.fork(1, ids[0])["cache_id"]  # shares the last block (7 of 8)
    done = table.extend_kept(1, batch, 1, seen=1)
    assert not done["same"] and list(done["lens"]) == [8, 9]
    assert len(copies) == 1 and copies[0][0] == table.sequences[child].block_ids[1]
    assert table.sequences[ids[0]].block_ids[1] == copies[0][1] != copies[0][0]
    table.check_invariants()
    # A second reference (a hand-off opened by another connection, or a clone): the
    # batch steps through the checked path while it lasts, and stays exact.
    done = table.extend_kept(1, batch, 1, seen=done["steps"])
    assert done["same"]  # kept again after the copy
    token = table.export(1, ids[0], ttl=30)
    table.open(2, token)
    for _ in range(2):
        done = table.extend_kept(1, batch, 1, seen=done["steps"])
        assert not done["same"]
    assert list(done["lens"]) == [11, 12]
    table.release(2, ids[0])
    done = table.extend_kept(1, batch, 1, seen=done["steps"])
    done = table.extend_kept(1, batch, 1, seen=done["steps"])
    assert done["same"]  # one holder again: kept
    table.clone(1, ids[1])
    for _ in range(2):
        done = table.extend_kept(1, batch, 1, seen=done["steps"])
        assert not done["same"]
    assert list(done["lens"]) == [15, 16]
    assert [table.sequences[i].num_tokens for i in ids] == [15, 16]
    table.check_invariants()
    table.release(1, ids[1])  # the clone's reference
    done = table.extend_kept(1, batch, 1, seen=done["steps"])
    done = table.extend_kept(1, batch, 1, seen=done["steps"])
    assert done["same"]
    assert [table.sequences[i].num_tokens for i in ids] == [17, 18]
    table.check_invariants()


def test_decode_steps_of_prompt_sequences_stay_exact_with_forks(client):
    prompts = [list(range(50 + 20 * i, 50 + 20 * i + n)) for i, n in enumerate([5, 8, 3])]
    hs = [client.allocate(prompt=p) for p in prompts]
    batch = client.batch(hs)
    write_step(batch.prefill(start=0))
    forks = []
    marker = torch.full((1, H, D), -3.0)
    for i in range(30):
        if i % 9 == 4:  # a fork that writes its own next token into the shared block
            parent = hs[i % 3]
            f = parent.fork()
            start = f.extend(1)
            for layer in range(L):
                f.write(layer, marker, marker, start=start)
            forks.append((parent, f))
        write_step(checked_decode_step(batch, hs))
    assert batch._kept > 0  # the coordinator kept this batch
    for h in hs:
        for layer in range(L):
            assert torch.equal(h.key_cache(layer), expected_kv(h, layer, 0, h.num_tokens))
    for parent, f in forks:  # its parent's values, then its own token; and the parents
        n = f.num_tokens  # (checked above) still hold theirs in that position
        for layer in range(L):
            assert torch.equal(f.key_cache(layer)[: n - 1], expected_kv(parent, layer, 0, n - 1))
            assert torch.equal(f.key_cache(layer)[n - 1 :], marker)
    client.close_many([f for _p, f in forks] + hs)


def test_a_batch_the_coordinator_did_not_keep_asks_again(client):
    from shmkv.client.batch import _KEEP_RETRY

    hs = [client.allocate(prompt=list(range(300 + 10 * i, 305 + 10 * i))) for i in range(2)]
    extra = hs[0].clone_handle()  # a second holder: not keepable for now
    batch = client.batch(hs)
    batch.extend(1)
    assert batch._kept == -_KEEP_RETRY
    extra.close()
    for _ in range(_KEEP_RETRY):  # steps through the checked path, then asks
        step = batch.extend(1)
        assert batch._kept <= 0
    step = batch.extend(1)
    assert batch._kept > 0
    step = batch.extend(1)  # a kept step: built from the last one
    assert step.seq_lens.tolist() == [h.num_tokens for h in hs] == [24, 24]
    for row, h in zip(step.block_tables.tolist(), hs):
        assert row[: len(h.block_table.physical_blocks)] == list(h.block_table.physical_blocks)
    client.close_many(hs)


def test_a_release_sent_without_waiting_times_out_like_a_request(unique_name):
    """A coordinator that stops reading (SIGSTOP) while a release too big for the socket
    buffers is being sent: close_many(wait=False) raises CoordinatorTimeout and the
    client stops using the stream (part of a frame may be out), as request() does."""
    import os
    import signal

    cfg = shmkv.PoolConfig(
        num_layers=1,
        num_kv_heads=1,
        head_dim=8,
        num_blocks=1 << 17,
        block_size=BS,
        dtype=torch.float16,
        max_sequences=1 << 17,
        max_seq_len=64,
    )
    with shmkv.Coordinator.spawn(cfg, name=unique_name) as coord:
        client = shmkv.connect(coord.address, timeout=0.5)
        hs = client.allocate_many([1] * 100_000)  # an 800 kB release
        os.kill(coord.pid, signal.SIGSTOP)
        try:
            with pytest.raises(errors.CoordinatorTimeout, match="release_many"):
                client.close_many(hs, wait=False)
            assert not client.is_alive()
            with pytest.raises(errors.CoordinatorGone):
                client.ping()
        finally:
            os.kill(coord.pid, signal.SIGCONT)
            client.close()
        with shmkv.connect(coord.address) as other:  # the coordinator goes on
            deadline = time.monotonic() + 10
            while other.stats()["sequences"] and time.monotonic() < deadline:
                time.sleep(0.05)
            assert other.stats()["sequences"] == 0


def _random_kept_run(seed: int, steps: int = 300) -> None:
    """Random calls of two connections on one table (prompt and plain allocations,
    batch steps that ask to be kept, kept steps of 1-3 tokens, per-sequence extends,
    forks, clones, releases, hand-offs opened or expired, prepare_write, commits of a
    rank connection too). After every call: the invariants, every object equal to its
    shared row, every slot a step reserved writable by its own sequence alone, and a
    kept step that says "same" describing the rows exactly."""
    import random

    from shmkv.memory.tables import GENERATION

    rng = random.Random(seed)
    now = [0.0]
    pool = BlockPool(96)
    table = SequenceTable(pool, BS, clock=lambda: now[0], max_sequences=32, max_seq_blocks=40)
    table.add_connection(1)
    table.add_connection(2)
    held = {1: [], 2: []}  # cache ids each connection holds (a clone twice)
    batches = []  # [ids, kept batch id, (steps, rows) last seen]
    tokens = [rng.randrange(5) for _ in range(400)]
    mask = table._rows.slot_mask

    def length(cache_id):
        return int(table._rows.seq_np[cache_id & mask, NUM_TOKENS])

    def rows(ids):
        slots = [c & mask for c in ids]
        return (
            table._rows.table_np[slots].copy(),
            table._rows.seq_np[slots, NUM_TOKENS].copy(),
            table._rows.seq_np[slots, GENERATION].copy(),
        )

    def check_writable(ids, old, count):
        for cache_id, start in zip(ids, old):
            for pos in range(start, start + count):
                block = int(table._rows.table_np[cache_id & mask, pos // BS])
                assert table._rows.owner_np[block] == cache_id, (seed, cache_id, pos)

    ops = [
        "alloc_prompt",
        "alloc_plain",
        "batch",
        "batch",
        "extend",
        "fork",
        "clone",
        "release",
        "close_many",
        "export_open",
        "expire",
        "prepare_write",
        "commit",
        "commit_rank",
        "alloc_other",
        "drop_other",
    ] + ["kept"] * 8
    for _ in range(steps):
        op = rng.choice(ops)
        mine = sorted(set(held[1]))
        try:
            if op == "alloc_prompt":
                infos = table.allocate_many(
                    1,
                    [
                        {"num_tokens": 0, "prompt": tokens[start : start + rng.randint(0, 14)]}
                        for start in (
                            rng.choice([0, 40, rng.randrange(300)])
                            for _ in range(rng.randint(1, 3))
                        )
                    ],
                )
                held[1] += [info["cache_id"] for info in infos]
            elif op == "alloc_other":
                start = rng.choice([0, 40, 80])
                info = table.allocate(2, 0, tokens[start : start + rng.randint(4, 14)])
                held[2].append(info["cache_id"])
            elif op == "alloc_plain":
                ids, _ = table.allocate_counts(
                    1, [rng.randint(0, 9) for _ in range(rng.randint(1, 3))]
                )
                held[1] += ids.tolist()
            elif op == "batch" and mine:
                ids = rng.sample(mine, rng.randint(1, len(mine)))
                count, old = rng.randint(1, 3), [length(c) for c in ids]
                table.extend_batch(1, ids, count, None, [c & mask for c in ids])
                check_writable(ids, old, count)
                kept = table.keep_batch(1, ids)
                if kept:
                    batches.append([ids, kept, None])
            elif op == "kept" and batches:
                entry = rng.choice(batches)
                ids, kept, state = entry
                if any(c not in held[1] for c in ids):
                    continue
                count, old = rng.choice([1, 1, 1, 2, 3]), [length(c) for c in ids]
                done = table.extend_kept(1, kept, count, state[0] if state else -1)
                if done is None:
                    batches.remove(entry)
                    continue
                assert [length(c) for c in ids] == [n + count for n in old]
                check_writable(ids, old, count)
                if done["same"]:
                    tab, lens, gens = (a.copy() for a in state[1])
                    lens += count
                    for i, block in zip(done["grown"].tolist(), done["blocks"].tolist()):
                        tab[i, (lens[i] - count + BS - 1) // BS] = block
                        gens[i] += 1
                    now_rows = rows(ids)
                    assert (
                        (now_rows[0] == tab).all()
                        and (now_rows[1] == lens).all()
                        and (now_rows[2] == gens).all()
                    ), seed
                entry[2] = (done["steps"], rows(ids))
            elif op == "extend" and mine:
                n = rng.randint(0, 5)
                table.extend(
                    1,
                    rng.choice(mine),
                    n,
                    [rng.randrange(5) for _ in range(n)] if rng.random() < 0.5 else None,
                )
            elif op == "fork" and mine:
                held[1].append(table.fork(1, rng.choice(mine))["cache_id"])
            elif op == "clone" and mine:
                cache_id = rng.choice(mine)
                table.clone(1, cache_id)
                held[1].append(cache_id)
            elif op == "release":
                conn = rng.choice([1, 2])
                if held[conn]:
                    cache_id = rng.choice(held[conn])
                    table.release(conn, cache_id)
                    held[conn].remove(cache_id)
            elif op == "close_many" and held[1]:
                some = rng.sample(held[1], rng.randint(1, min(4, len(held[1]))))
                table.release_many(1, some)
                for cache_id in some:
                    held[1].remove(cache_id)
            elif op == "export_open" and mine:
                cache_id = rng.choice(mine)
                token = table.export(1, cache_id, ttl=rng.choice([1.0, 5.0]))
                if rng.random() < 0.5:
                    table.open(2, token)
                    held[2].append(cache_id)
            elif op == "expire":
                now[0] += 2.0
                table.expire()
            elif op == "prepare_write" and mine:
                cache_id = rng.choice(mine)
                n = length(cache_id)
                if n:
                    start = rng.randrange(n)
                    table.prepare_write(1, cache_id, start, rng.randint(0, n - start))
            elif op == "commit" and mine:
                cache_id = rng.choice(mine)
                table.commit(1, cache_id, rng.randint(0, length(cache_id)))
            elif op == "commit_rank" and mine:
                some = rng.sample(mine, rng.randint(1, len(mine)))
                table.commit_batch(
                    2, some, [rng.randint(0, length(c)) for c in some], None, rank_connection=True
                )
            elif op == "drop_other":
                table.drop_connection(2)
                table.add_connection(2)
                held[2] = []
        except (errors.PoolExhausted, errors.LimitExceeded):
            pass
        table.check_invariants()
        for seq in table.sequences.values():
            slot = seq.slot
            assert table._rows.table_np[slot, : len(seq.block_ids)].tolist() == seq.block_ids
            assert int(table._rows.num_blocks_np[slot]) == len(seq.block_ids)
            assert int(table._rows.seq_np[slot, NUM_TOKENS]) == seq.num_tokens


@pytest.mark.parametrize("first_seed", [0, 20, 40])
def test_kept_batches_under_random_calls(first_seed):
    for seed in range(first_seed, first_seed + 20):
        _random_kept_run(seed)


def test_a_kept_batch_stays_kept_while_other_sequences_change():
    table = make_table(num_blocks=128)
    ids, slots = prompt_sequences(table, [3, 6])
    table.extend_batch(1, ids, 1, None, slots)
    batch = table.keep_batch(1, ids)
    other, _ = prompt_sequences(table, [5, 7], conn=2, start=5000)
    plain, _ = table.allocate_counts(2, [4, 2])
    done = table.extend_kept(1, batch, 1, seen=0)
    for change in (
        lambda: table.fork(2, other[0]),
        lambda: table.clone(2, other[1]),
        lambda: table.export(2, other[0], ttl=5),
        lambda: table.release(2, other[1]),
        lambda: table.release_many(2, plain.tolist()),
        lambda: table.fork(2, int(table.allocate_counts(2, [3])[0][0])),
    ):
        change()  # another connection's sequences: not this batch's
        done = table.extend_kept(1, batch, 1, seen=done["steps"])
        assert done["same"]
    table.check_invariants()
    table.clone(1, ids[1])  # one of its own: checked again
    assert not table.extend_kept(1, batch, 1, seen=done["steps"])["same"]
    table.drop_connection(1)
    table.check_invariants()  # its kept batches counted out


# -- the loop's polling for the next request (Coordinator.spin_us) --------------------------


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="the loop never polls on one CPU")
def test_the_loop_polls_only_while_requests_come_back_to_back(small_config, unique_name):
    """The running rate of turns whose next request came within spin_us: high while a
    client sends back to back (the loop polls), low once requests come far apart (it
    sleeps), and high again when they come close; answers stay right throughout."""
    with (
        shmkv.Coordinator(small_config, name=unique_name, spin_us=10000) as coord,
        shmkv.connect(coord.address, timeout=10) as client,
    ):
        spin, caught = coord._spin, []

        def counted(selector, wait):
            began = time.perf_counter()
            ready = spin(selector, wait)
            caught.append((bool(ready), time.perf_counter() - began))
            return ready

        coord._spin = counted
        for _ in range(100):
            client.ping()
        assert coord._spin_hits > 0.9
        assert sum(hit for hit, _ in caught) > 50  # the pings were caught polling
        handles = []
        for _ in range(40):
            time.sleep(0.025)
            handles.append(client.allocate(num_tokens=3))
        assert coord._spin_hits < 0.5
        del caught[:]
        for _ in range(5):
            time.sleep(0.025)
            handles.append(client.allocate(num_tokens=3))
        assert caught and max(took for _, took in caught) < 0.005  # it no longer polls
        client.close_many(handles)
        for _ in range(100):
            client.ping()
        assert coord._spin_hits > 0.5
        assert client.stats()["sequences"] == 0


def test_spin_us_zero_never_polls(small_config, unique_name):
    with (
        shmkv.Coordinator(small_config, name=unique_name, spin_us=0) as coord,
        shmkv.connect(coord.address, timeout=10) as client,
    ):
        calls = []
        coord._spin = lambda selector, wait: calls.append(1) or []
        for _ in range(50):
            client.ping()
        assert calls == []


# -- the loop thread's CPU slice (Coordinator.loop_slice_us, shmkv.coordinator.sched) ------


def _slices_kept() -> bool:
    """Whether this kernel keeps a thread's requested slice (EEVDF, 6.12 and later)."""
    from shmkv.coordinator import sched

    before = sched.thread_slice()
    try:
        return before is not None and sched.set_thread_slice(200_000) == 200_000
    finally:
        if before is not None:
            sched.set_thread_slice(before)


@pytest.mark.skipif(not _slices_kept(), reason="this kernel keeps no per-thread slice")
def test_the_loop_thread_asks_for_a_short_slice_and_gives_it_back(small_config, unique_name):
    """The serving thread runs with the slice asked for, read from the kernel by its
    thread id; the thread's own slice is back once the loop ends."""
    import threading

    from shmkv.coordinator import sched

    for asked in (100.0, 2500.0):
        coord = shmkv.Coordinator(small_config, name=unique_name, loop_slice_us=asked)
        coord.open()
        seen = {}

        def serve(coord, seen):
            seen["tid"], seen["before"] = threading.get_native_id(), sched.thread_slice()
            seen["inherit_before"] = sched.slice_inherited()
            coord.serve_forever()
            seen["after"] = sched.thread_slice()
            seen["inherit_after"] = sched.slice_inherited()

        loop = threading.Thread(target=serve, args=(coord, seen))
        loop.start()
        try:
            with shmkv.connect(coord.address, timeout=10) as client:
                assert client.stats()["loop_slice_us"] == asked
                assert sched.thread_slice(seen["tid"]) == asked * 1000
                assert sched.slice_inherited(seen["tid"]) is False  # not passed on
        finally:
            coord.stop()
            loop.join(10)
        assert not loop.is_alive()
        assert seen["after"] == seen["before"] != asked * 1000
        assert seen["inherit_after"] is seen["inherit_before"] is True


@pytest.mark.skipif(not _slices_kept(), reason="this kernel keeps no per-thread slice")
def test_threads_a_thread_starts_get_its_slice_only_when_asked():
    """The loop's short slice must not pass to the threads it starts (tier copiers): with
    ``inherit=False`` they start with the kernel's default; with True they share it."""
    import threading

    from shmkv.coordinator import sched

    def started_by(inherit):
        seen = {}

        def parent():
            seen["own"] = sched.set_thread_slice(150_000, inherit=inherit)
            child = threading.Thread(target=lambda: seen.update(child=sched.thread_slice()))
            child.start()
            child.join(10)
            seen["after"] = sched.thread_slice()

        thread = threading.Thread(target=parent)  # (a fresh thread: the default slice)
        default = sched.thread_slice()
        thread.start()
        thread.join(10)
        return seen, default

    seen, default = started_by(inherit=False)
    assert seen["own"] == seen["after"] == 150_000 and seen["child"] == default != 150_000
    seen, _ = started_by(inherit=True)
    assert seen["own"] == seen["child"] == 150_000


def test_loop_slice_zero_leaves_the_thread_alone(small_config, unique_name):
    from shmkv.coordinator import sched

    before = sched.thread_slice()
    with (
        shmkv.Coordinator(small_config, name=unique_name, loop_slice_us=0) as coord,
        shmkv.connect(coord.address, timeout=10) as client,
    ):
        assert client.stats()["loop_slice_us"] is None
        assert sched.thread_slice() == before


@pytest.mark.parametrize("bad", [-1, 50, 99.9, 100001, float("nan"), float("inf"), True, "100"])
def test_a_loop_slice_outside_the_kernels_bounds_is_refused(small_config, unique_name, bad):
    with pytest.raises(errors.InvalidArgument, match="loop_slice_us must be 0 or"):
        shmkv.Coordinator(small_config, name=unique_name, loop_slice_us=bad)


# -- the order the loop reads connections in ---------------------------------------------------


class _RawLoop:
    """A coordinator driven turn by turn through its own loop, with connections made of
    socket pairs (``theirs[i]`` is the client's end of connection ``i``)."""

    def __init__(self, name: str, num: int):
        import selectors
        import socket

        from shmkv.coordinator.connections import _Conn, make_selector

        self.coord = shmkv.Coordinator(
            shmkv.PoolConfig(num_layers=L, num_kv_heads=H, head_dim=D, num_blocks=8, block_size=BS),
            name=name,
        )
        self.coord.open()
        self.selector = make_selector()
        self.theirs = []
        self.served: list = []
        for i in range(num):
            mine, theirs = socket.socketpair()
            mine.setblocking(False)
            theirs.settimeout(10.0)
            conn = _Conn(mine, i, os.getpid(), self.coord.max_frame)
            conn.greeted = True
            self.coord._conns[i] = conn
            self.coord.table.add_connection(i)
            self.selector.register(mine, selectors.EVENT_READ, conn)
            self.theirs.append(theirs)
        handle = self.coord._connections._handle

        def recorded(conn, obj):
            self.served.append(conn.conn_id)
            handle(conn, obj)

        self.coord._connections._handle = recorded

    def answers(self, i: int, num: int) -> list:
        decoder, ids = protocol.FrameDecoder(), []
        while len(ids) < num:
            for obj in decoder.feed(self.theirs[i].recv(1 << 16)):
                ids.append(protocol.parse_response(obj).request_id)
        return ids

    def close(self) -> None:
        self.selector.close()
        for sock in self.theirs:
            sock.close()
        self.coord.close()


def test_ready_connections_are_served_in_the_order_their_requests_came(unique_name):
    """Connection 0 was served last turn; then connection 1 sends, then 0 again. Both
    are ready at the next turn, and 1, whose request came first, is served first (a
    level-triggered epoll lists the socket it reported last first: a client sending
    back to back went ahead of one that had waited the whole turn)."""
    loop = _RawLoop(unique_name, 2)
    try:
        loop.theirs[0].sendall(protocol.encode_request(1, "ping", {}))
        loop.coord._turn(loop.selector)
        assert loop.answers(0, 1) == [1]
        loop.theirs[1].sendall(protocol.encode_request(2, "ping", {}))
        loop.theirs[0].sendall(protocol.encode_request(3, "ping", {}))
        loop.served.clear()
        loop.coord._turn(loop.selector)
        assert loop.served == [1, 0]
        assert loop.answers(1, 1) == [2] and loop.answers(0, 1) == [3]
    finally:
        loop.close()


def test_a_connection_with_more_than_one_reads_worth_of_requests_is_served_to_the_last(
    unique_name,
):
    """Past one receive's worth of frames: each report reads once and watches the
    connection again, so the rest is reported on the next turns, every request
    answered in order; a second connection is served meanwhile."""
    from shmkv.coordinator import connections

    loop = _RawLoop(unique_name, 2)
    try:
        frames = b"".join(protocol.encode_request(i, "ping", {}) for i in range(40000))
        assert len(frames) > 2 * connections._RECV_SIZE
        loop.theirs[0].setblocking(False)
        sent = 0
        got: list = []
        decoder = protocol.FrameDecoder()
        deadline = time.monotonic() + 60
        while len(got) < 40000:
            assert time.monotonic() < deadline, f"{len(got)} of 40000 answered"
            if sent < len(frames):
                try:
                    sent += loop.theirs[0].send(frames[sent:])
                except BlockingIOError:
                    pass
            if not got:  # the other connection, once, while the first one's frames pour
                loop.theirs[1].sendall(protocol.encode_request(7, "ping", {}))
            loop.coord._turn(loop.selector)
            try:
                data = loop.theirs[0].recv(1 << 20)
            except BlockingIOError:
                data = b""
            got += [protocol.parse_response(obj).request_id for obj in decoder.feed(data)]
        assert got == list(range(40000))
        assert 7 in loop.answers(1, 1)
    finally:
        loop.close()


def test_connections_caught_waiting_are_served_first_next_turn_or_skipped_once_dropped(
    unique_name,
):
    """``_clients_waiting`` (asked while the tiers place blocks) takes the ready
    connections' one-shot reports and keeps them: the next turn serves them without
    sleeping, and one dropped meanwhile is skipped, its descriptor never read."""
    loop = _RawLoop(unique_name, 3)
    coord, selector = loop.coord, loop.selector
    try:
        assert not coord._clients_waiting(selector)
        loop.theirs[0].sendall(protocol.encode_request(1, "ping", {}))
        loop.theirs[1].sendall(protocol.encode_request(2, "ping", {}))
        assert coord._clients_waiting(selector)
        assert sorted(key.data.conn_id for key, _ in coord._caught) == [0, 1]
        assert selector.select(0) == []  # taken: only the kept reports serve them now
        coord._connections.drop(coord._conns[1], selector)
        began = time.monotonic()
        coord._turn(selector)
        assert time.monotonic() - began < 0.5  # it did not sleep
        assert loop.served == [0] and not coord._caught
        assert loop.answers(0, 1) == [1]
        loop.theirs[2].sendall(protocol.encode_request(3, "ping", {}))
        coord._turn(selector)  # the others are served as before
        assert loop.answers(2, 1) == [3]
    finally:
        loop.close()
