"""The batch data plane: shared block tables, steps, descriptors, tensor parallelism."""

import signal
import sys
import threading
import time

import numpy as np
import pytest
import torch
import workers
from conftest import SPAWN, join_or_kill, shm_entries

import shmkv
import shmkv.memory.tables
from shmkv.coordinator.server import remove_stale_socket
from shmkv.memory.tables import LOCK, READ_PATIENCE_S, SEQ_FIELDS

L, H, D, BS = 2, 4, 8, 4


@pytest.fixture
def cfg():
    return shmkv.PoolConfig(
        num_layers=L,
        num_kv_heads=H,
        head_dim=D,
        num_blocks=96,
        block_size=BS,
        dtype=torch.float32,
        max_sequences=64,
        max_seq_len=64,
    )


@pytest.fixture
def coord(cfg, unique_name):
    with shmkv.Coordinator(cfg, name=unique_name) as c:
        yield c


@pytest.fixture
def client(coord):
    with shmkv.connect(coord.address, timeout=20) as c:
        yield c


def reference_step(handles, starts, counts):
    """What a step must say, from each handle's own table, in plain Python."""
    slot_mapping, seq_lens, tables = [], [], []
    for h, start, count in zip(handles, starts, counts):
        table = h.block_table
        for pos in range(start, start + count):
            slot_mapping.append(table.physical_blocks[pos // BS] * BS + pos % BS)
        seq_lens.append(start + count)
        tables.append(list(table.physical_blocks[: -(-(start + count) // BS)]))
    width = max(1, max(len(t) for t in tables))
    padded = [t + [0] * (width - len(t)) for t in tables]
    return slot_mapping, seq_lens, padded


def write_step(step, heads=H):
    ids = step.cache_ids[step.seq_index]
    for layer in range(L):
        step.write(
            layer,
            workers.step_value(ids, step.positions, layer, 0, heads, D),
            workers.step_value(ids, step.positions, layer, 1, heads, D),
        )


def expected_kv(h, layer, which, n=None):
    n = h.num_tokens if n is None else n
    ids = torch.full((n,), h._cache_id, dtype=torch.int64)
    return workers.step_value(ids, torch.arange(n), layer, which, h.num_heads, D)


def test_step_tensors_equal_each_handles_own_table(client):
    hs = client.allocate_many([0, 3, 4, 9, 1])
    batch = client.batch(hs)
    for counts in (1, [2, 0, 5, 1, 4], 4):
        before = [h.num_tokens for h in hs]
        step = batch.extend(counts)
        per = [counts] * len(hs) if isinstance(counts, int) else counts
        slot_mapping, seq_lens, tables = reference_step(hs, before, per)
        assert step.slot_mapping.dtype == torch.int64
        assert step.slot_mapping.tolist() == slot_mapping
        assert step.seq_lens.dtype == torch.int32 and step.seq_lens.tolist() == seq_lens
        assert step.block_tables.dtype == torch.int32 and step.block_tables.tolist() == tables
        assert step.query_start_loc.dtype == torch.int32
        assert step.query_start_loc.tolist() == [0] + list(torch.tensor(per).cumsum(0).tolist())
        assert step.num_tokens == sum(per)
        assert [h.num_tokens for h in hs] == seq_lens
        write_step(step)
    for h, first in zip(hs, [0, 3, 4, 9, 1]):  # every token the steps added reads back
        for layer in range(L):
            assert torch.equal(h.key_cache(layer)[first:], expected_kv(h, layer, 0)[first:])
            assert torch.equal(h.value_cache(layer)[first:], expected_kv(h, layer, 1)[first:])


def test_batch_writes_read_back_exactly_in_another_process(coord):
    q = SPAWN.Queue()
    lengths = [5, 8, 1]
    proc = SPAWN.Process(target=workers.batch_write_and_handoff, args=(coord.address, lengths, q))
    proc.start()
    with shmkv.connect(coord.address, timeout=20):
        got = [q.get(timeout=60) for _ in lengths]
        assert join_or_kill(proc) == 0
        for (h, cache_id), n, extra in zip(got, lengths, [2, 3, 1]):
            assert h._cache_id == cache_id and h.num_tokens == n + extra
            for layer in range(L):
                assert torch.equal(h.key_cache(layer), expected_kv(h, layer, 0))
                assert torch.equal(h.value_cache(layer), expected_kv(h, layer, 1))


def test_prefill_step_covers_the_uncached_prompt_and_commits(client):
    prompt = list(range(10))
    first = client.allocate(prompt=prompt)
    step = client.batch([first]).prefill()
    assert step.positions.tolist() == list(range(10)) and step.seq_lens.tolist() == [10]
    write_step(step)
    assert step.commit() == 2  # two full blocks published
    again = client.allocate_many([{"prompt": prompt}, {"prompt": prompt[:9] + [99]}])
    step = client.batch(again).prefill()
    assert [h.num_cached_tokens for h in again] == [8, 8]
    assert step.positions.tolist() == [8, 9, 8, 9]
    assert step.query_start_loc.tolist() == [0, 2, 4]


def test_fork_in_a_batch_never_changes_its_sibling(client):
    parent = client.allocate(6)
    step = client.batch([parent]).prefill(start=0)
    write_step(step)
    child = parent.fork()
    before = parent.gather_all().clone()
    step = client.batch([parent, child]).extend(1)  # both copy the shared last block
    assert len(set(step.block_tables[:, 1].tolist())) == 2
    k = torch.full((2, H, D), 5.0)
    k[1] = 9.0
    for layer in range(L):
        step.write(layer, k, k)
    assert torch.equal(parent.gather_all()[:, :, :6], before)
    assert torch.equal(child.gather_all()[:, :, :6], before)
    assert torch.equal(parent.key_cache(0)[6], k[0]) and torch.equal(child.key_cache(0)[6], k[1])


def test_a_step_refuses_to_write_a_block_shared_after_it_was_made(client):
    h = client.allocate(5)
    step = client.batch([h]).extend(2)
    fork = h.fork()  # shares the block the step writes
    snapshot = client.pool.clone()
    with pytest.raises(shmkv.StaleStep, match="make a new step"):
        step.write(0, torch.ones(2, H, D), torch.ones(2, H, D))
    assert torch.equal(client.pool, snapshot)  # nothing written
    client.batch([h]).extend(0).write(0, torch.zeros(0, H, D), torch.zeros(0, H, D))
    fork.close()


def test_bad_input_gets_specific_errors_and_writes_nothing(coord, client):
    hs = client.allocate_many([3, 3])
    step = client.batch(hs).extend(1)
    snapshot = client.pool.clone()
    stats = client.stats()
    bad = [
        (shmkv.InvalidArgument, dict(k=torch.ones(3, H, D), v=torch.ones(3, H, D))),  # count
        (
            shmkv.InvalidArgument,
            dict(
                k=torch.ones(2, H, D, dtype=torch.float64),
                v=torch.ones(2, H, D, dtype=torch.float64),
            ),
        ),  # dtype
        (
            shmkv.InvalidArgument,
            dict(k=torch.ones(2, H, D, device="meta"), v=torch.ones(2, H, D, device="meta")),
        ),  # device
        (shmkv.InvalidArgument, dict(k=torch.ones(2, H + 1, D), v=torch.ones(2, H + 1, D))),
        (
            shmkv.InvalidArgument,
            dict(k=torch.ones(D, H, 2).transpose(0, 2), v=torch.ones(D, H, 2).transpose(0, 2)),
        ),  # strides
        (shmkv.WrongType, dict(k=[[1.0]], v=[[1.0]])),
    ]
    for error, kv in bad:
        with pytest.raises(error):
            step.write(0, **kv)
    with pytest.raises(shmkv.OutOfRange):
        step.write(L, torch.ones(2, H, D), torch.ones(2, H, D))
    with pytest.raises(shmkv.InvalidArgument):
        step.write_all(torch.ones(L, 2, 3, H, D))
    assert torch.equal(client.pool, snapshot)
    with shmkv.connect(coord.address) as other:
        foreign = other.allocate(2)
        with pytest.raises(shmkv.InvalidArgument, match="not a handle of this client"):
            client.batch([hs[0], foreign])
        with pytest.raises(shmkv.InvalidArgument, match="another coordinator"):
            other.step_from(step.descriptor()[:12] + b"\0" * 8 + step.descriptor()[20:])
        with pytest.raises(shmkv.InvalidArgument, match="malformed"):
            other.step_from(b"SKVS" + b"\0" * 30)
    with pytest.raises(shmkv.InvalidArgument, match="name one sequence"):
        client.batch([hs[0], hs[0]])
    with pytest.raises(shmkv.InvalidArgument):
        client.batch(hs).extend([1])  # one count for two sequences
    with pytest.raises(shmkv.InvalidArgument):
        client.batch(hs).extend(-1)
    batch = client.batch(hs)
    desc = step.descriptor()
    hs[1].close()
    with pytest.raises(shmkv.HandleClosed):
        batch.extend(1)
    with pytest.raises(shmkv.HandleClosed):
        step.write(0, torch.ones(2, H, D), torch.ones(2, H, D))
    with pytest.raises(shmkv.HandleClosed):
        client.batch(hs)
    with shmkv.connect(coord.address) as other:
        with pytest.raises(shmkv.StaleStep, match="closed"):
            other.step_from(desc)
    assert torch.equal(client.pool, snapshot)
    after = client.stats()
    assert after["free_blocks"] == stats["free_blocks"] + 1  # only hs[1]'s block came back


def test_table_bounds_are_refused_with_nothing_changed(coord, client, cfg):
    assert cfg.max_seq_blocks == 16 and cfg.table_nbytes == 4 * 64 * 16
    h = client.allocate(60)
    free = client.stats()["free_blocks"]
    with pytest.raises(shmkv.LimitExceeded, match="max_seq_len"):
        client.batch([h]).extend(5)
    with pytest.raises(shmkv.LimitExceeded, match="max_seq_len"):
        h.extend(5)
    with pytest.raises(shmkv.LimitExceeded, match="max_seq_len"):
        client.allocate(65)
    assert h.num_tokens == 60 and client.stats()["free_blocks"] == free
    with pytest.raises(shmkv.LimitExceeded, match="max_sequences"):
        client.allocate_many([0] * 64)
    assert client.stats()["sequences"] == 1
    with pytest.raises(shmkv.InvalidArgument, match="max_sequences"):
        shmkv.PoolConfig(
            num_layers=1, num_kv_heads=1, head_dim=1, num_blocks=8, max_sequences=2**21
        )


def test_two_tp_ranks_share_one_step(unique_name):
    cfg = shmkv.PoolConfig(
        num_layers=L,
        num_kv_heads=H,
        head_dim=D,
        num_blocks=64,
        block_size=BS,
        dtype=torch.float32,
        tp_size=2,
    )
    with shmkv.Coordinator(cfg, name=unique_name) as coord:
        descs, results = SPAWN.Queue(), SPAWN.Queue()
        rank1 = SPAWN.Process(
            target=workers.tp_step_rank, args=(coord.address, 1, 2, descs, results)
        )
        rank1.start()
        try:
            with (
                shmkv.connect(coord.address, tp_rank=0, tp_size=2, timeout=20) as r0,
                shmkv.connect(coord.address, timeout=20) as reader,
            ):
                prompt = list(range(8))
                hs = [r0.allocate(prompt=prompt), r0.allocate(3)]
                batch = r0.batch(hs)
                steps = [batch.prefill(start=0), batch.extend([3, 1])]
                for step in steps:
                    descs.put(step.descriptor())  # rank 1 rebuilds it: no round trip
                    ids = step.cache_ids[step.seq_index]
                    for layer in range(L):
                        k = workers.step_value(ids, step.positions, layer, 0, H, D)[:, :2]
                        v = workers.step_value(ids, step.positions, layer, 1, H, D)[:, :2]
                        step.write(layer, k.contiguous(), v.contiguous())
                    kind, slot_mapping, tables, seq_lens, _published = results.get(timeout=60)
                    assert slot_mapping == step.slot_mapping.tolist()
                    assert tables == step.block_tables.tolist()
                    assert seq_lens == step.seq_lens.tolist()
                # rank 1 committed its shard of every step; rank 0 has not: nothing public yet
                assert reader.allocate(prompt=prompt).num_cached_tokens == 0
                assert steps[-1].commit() >= 1  # now every rank has: published
                assert reader.allocate(prompt=prompt).num_cached_tokens == 8
                for h in hs:  # a full-head reader sees both shards
                    whole = reader.open(h.export(10))
                    for layer in range(L):
                        assert torch.equal(whole.key_cache(layer), expected_kv(whole, layer, 0))
                        assert torch.equal(whole.value_cache(layer), expected_kv(whole, layer, 1))
        finally:
            descs.put(None)
            assert join_or_kill(rank1) == 0


def test_reader_never_sees_a_table_the_coordinator_never_had(coord, client):
    h = client.allocate(3)
    q = SPAWN.Queue()
    reader = SPAWN.Process(target=workers.hammer_tables, args=(coord.address, h.export(30), 2.5, q))
    reader.start()
    states = set()

    def record():
        info = client.request("info", cache_id=h._cache_id)
        n = info["num_tokens"]
        states.add((n, tuple(info["blocks"][: -(-n // BS)])))

    record()
    assert q.get(timeout=60) == "reading"
    deadline = time.monotonic() + 2.0
    k = torch.ones(1, H, D)
    while time.monotonic() < deadline:
        if h.num_tokens < 60:
            h.extend(1)  # append (a new block every BS tokens)
            record()
        fork = h.fork()  # shares every block
        record()
        h.write(0, k, k)  # copy-on-write replaces the last entry
        record()
        fork.close()
        record()
    reads, seen = q.get(timeout=60)
    assert join_or_kill(reader) == 0
    assert reads > 100
    unknown = [s for s in map(lambda s: (s[0], tuple(s[1])), seen) if s not in states]
    assert not unknown, f"tables the coordinator never had: {unknown[:3]}"
    assert len(seen) > 5


def _held_odd(coord, slot, seconds: float, read):
    """Run ``read`` in a thread while the coordinator's row ``slot`` (or, for None, its
    K/V scales) stays mid-change (its seqlock odd) for ``seconds``, as when the
    coordinator is descheduled there; returns what ``read`` returned or raised."""
    if slot is None:
        words, lock = coord.memory.scale_lock, 0
    else:
        words, lock = coord.table.tables.seq, slot * SEQ_FIELDS + LOCK
    got = []
    words[lock] += 1
    try:
        reader = threading.Thread(target=lambda: got.append(_outcome(read)), daemon=True)
        reader.start()
        time.sleep(seconds)
    finally:
        words[lock] += 1
    reader.join(READ_PATIENCE_S + 5)
    assert not reader.is_alive() and len(got) == 1
    return got[0]


def _outcome(read):
    try:
        return read()
    except Exception as e:  # (returned for the test to check)
        return e


def test_a_read_waits_out_a_coordinator_descheduled_mid_change(coord, client):
    """A row held odd for 0.3 s (thousands of tries) is read once it is even again,
    by a handle and by a batch step, not refused after a count of tries; so are the
    K/V scales."""
    h = client.allocate(6)
    slot = h._state.slot
    expected = list(h.block_table.physical_blocks)
    h._state.generation = -1  # (forces a full read of the row)
    table = _held_odd(coord, slot, 0.3, lambda: h.block_table)
    assert not isinstance(table, Exception), table
    assert list(table.physical_blocks) == expected and table.sequence_length == 6
    step = _held_odd(coord, slot, 0.3, lambda: client.batch([h]).prefill(start=0))
    assert not isinstance(step, Exception), step
    assert step.block_tables.tolist()[0][: len(expected)] == expected
    client.set_kv_scales(1, 0.5, 2.0)
    assert _held_odd(coord, None, 0.3, lambda: client.kv_scales(1)) == (0.5, 2.0)


def test_a_read_of_a_row_stuck_mid_change_fails_after_its_patience(coord, client, monkeypatch):
    monkeypatch.setattr(shmkv.memory.tables, "READ_PATIENCE_S", 0.2)
    h = client.allocate(6)
    slot = h._state.slot
    h._state.generation = -1
    err = _held_odd(coord, slot, 0.6, lambda: h.block_table)
    assert isinstance(err, shmkv.LimitExceeded), err
    assert f"block table of slot {slot} kept changing for 0.2 s" in str(err)
    err = _held_odd(coord, slot, 0.6, lambda: client.batch([h]).prefill(start=0))
    assert isinstance(err, shmkv.StaleStep), err
    assert "block tables kept changing for 0.2 s" in str(err)
    err = _held_odd(coord, None, 0.6, lambda: client.kv_scales(0))
    assert isinstance(err, shmkv.LimitExceeded) and "K/V scales of layer 0" in str(err), err
    assert h.block_table.sequence_length == 6  # even again: read at once


def test_a_row_a_killed_coordinator_left_mid_change_reads_as_gone(
    cfg, unique_name, tmp_path, monkeypatch
):
    """Reads of a row (and of the K/V scales) that a SIGKILLed coordinator left
    mid-change fail with CoordinatorGone as soon as they give their CPU away, not
    after the patience a live coordinator gets (set long here)."""
    monkeypatch.setattr(shmkv.memory.tables, "READ_PATIENCE_S", 600.0)
    address = str(tmp_path / "c.sock")
    ours, theirs = SPAWN.Pipe()
    proc = SPAWN.Process(
        target=workers.coordinator_killed_mid_change, args=(cfg.to_wire(), address, theirs)
    )
    proc.start()
    try:
        assert ours.poll(60) and ours.recv() == "ready"
        client = shmkv.connect(address, timeout=20)
        h = client.allocate(12)
        ours.send(h._state.slot)
        proc.join(30)
        assert proc.exitcode == -signal.SIGKILL
        h._state.generation = -1  # (a full read of the row)
        with pytest.raises(shmkv.CoordinatorGone):
            _ = h.block_table
        with pytest.raises(shmkv.CoordinatorGone):
            client.kv_scales(0)
        with pytest.raises(shmkv.CoordinatorGone):
            client.batch([h]).prefill(start=0)
        client.close()
    finally:
        join_or_kill(proc, 10)
        remove_stale_socket(address)
    assert not shm_entries()


def _racing(real: np.ndarray, reader: str, on_read):
    """``real`` as an array that calls ``on_read(n)`` after the n-th indexing by the
    function ``reader`` (a write of the coordinator beginning or ending right then)."""
    calls = [0]

    class Racing(np.ndarray):
        def __getitem__(self, index):
            got = np.ndarray.__getitem__(real, index)
            if sys._getframe(1).f_code.co_name == reader:
                calls[0] += 1
                on_read(calls[0])
            return got

    return real.view(Racing), calls


def test_a_step_never_takes_tables_read_while_a_change_began(coord, client, monkeypatch):
    """A change that begins during a step's read of the tables (the row's lock even at
    the first read, odd at the second) is not taken: the step reads again once the
    change is done and holds a table the coordinator had."""
    client.allocate(24)
    h = client.allocate(24)  # 6 blocks
    slot, want = h._state.slot, list(h.block_table.physical_blocks)
    seq, memory = coord.table.tables.seq, client._memory
    real, lock = memory.table_np, slot * SEQ_FIELDS + LOCK

    def writer(n):
        if n == 1:  # begins: lock odd, entries being zeroed (a truncate, say)
            seq[lock] += 1
            real[slot, 2:6] = 0
        elif n == 2:  # ends: here put back as they were
            real[slot, 2:6] = want[2:6]
            seq[lock] += 1

    racing, calls = _racing(real, "_read_tables", writer)
    monkeypatch.setattr(memory, "table_np", racing)
    step = client.batch([h]).prefill(start=0)
    assert calls[0] == 3  # torn, mid-change, then whole
    assert step.block_tables.tolist()[0][:6] == want


def test_advance_never_takes_rows_read_while_a_change_began(coord, client, monkeypatch):
    monkeypatch.setattr(shmkv.client.batch, "_PLAIN_MAX_SEQS", 0)  # the rows checked by numpy
    hs = client.allocate_many([13, 6])
    step = client.batch(hs).prefill(start=[8, 1], num_tokens=1)
    seq, memory = coord.table.tables.seq, client._memory
    lock = hs[0]._state.slot * SEQ_FIELDS + LOCK

    def writer(n):
        if n == 1:  # a change begins right after the rows were read
            seq[lock] += 1

    racing, calls = _racing(memory.seq_np, "advance", writer)
    monkeypatch.setattr(memory, "seq_np", racing)
    assert step.advance() is None and calls[0] == 2
    seq[lock] += 1  # the change ends (nothing of these rows changed)
    assert step.advance() is not None
    client.close_many(hs)


def test_sigkill_of_a_rank_mid_step_leaks_nothing(coord, client):
    base = client.stats()
    q = SPAWN.Queue()
    proc = SPAWN.Process(target=workers.batch_rank_killed_mid_step, args=(coord.address, 6, q))
    proc.start()
    assert q.get(timeout=60) == "mid-step"
    proc.join(30)
    assert proc.exitcode == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while client.stats()["sequences"] != base["sequences"] and time.monotonic() < deadline:
        time.sleep(0.05)
    after = client.stats()
    assert after["sequences"] == base["sequences"]
    assert after["free_blocks"] == base["free_blocks"]
    assert after["referenced_blocks"] == base["referenced_blocks"]
    coord.table.check_invariants()
    # the dead rank's table slots are free again: a batch of 64 - live sequences fits
    client.close_many(client.allocate_many([0] * (64 - base["sequences"])))


def same_step(got, want):
    for name in (
        "slot_mapping",
        "seq_lens",
        "block_tables",
        "positions",
        "seq_index",
        "query_start_loc",
        "cache_ids",
    ):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and a.tolist() == b.tolist(), name
    assert got.num_tokens == want.num_tokens


@pytest.mark.parametrize("plain_max", [32, 0])  # checked in a loop, or by numpy
def test_advance_is_the_next_decode_step_while_the_tables_hold(client, plain_max, monkeypatch):
    monkeypatch.setattr(shmkv.client.batch, "_PLAIN_MAX_SEQS", plain_max)
    hs = client.allocate_many([13, 6])  # slots reserved past the steps below
    batch = client.batch(hs)
    step = batch.prefill(start=[8, 1], num_tokens=1)
    write_step(step)
    for starts in ([9, 2], [10, 3]):
        step = step.advance()  # no table read, no round trip
        same_step(step, batch.prefill(start=starts, num_tokens=1))
        write_step(step)
    assert step.advance() is None  # position 4 of the second opens a block
    for h, first in zip(hs, [8, 1]):  # the advanced steps wrote their own slots
        for layer in range(L):
            want = expected_kv(h, layer, 0)
            assert torch.equal(h.key_cache(layer)[first : first + 3], want[first : first + 3])
    # not reserved: the second sequence holds 6 slots
    assert batch.prefill(start=[9, 5], num_tokens=1).advance() is None
    # not a one-token step, or not of a batch
    assert batch.prefill(start=[8, 1], num_tokens=2).advance() is None
    other = client.step_from(batch.prefill(start=[8, 1], num_tokens=1).descriptor())
    assert other.advance() is None
    # a block shared since (the epoch moved), a table changed since (a block appended)
    step = batch.prefill(start=[8, 1], num_tokens=1)
    fork = hs[0].fork()
    assert step.advance() is None
    fork.close()
    step = batch.prefill(start=[8, 1], num_tokens=1)
    hs[1].extend(3)  # 9 tokens: a third block
    assert step.advance() is None
    step = batch.prefill(start=[8, 1], num_tokens=1)
    advanced = step.advance()
    hs[1].close()  # its row is released: no step after it
    assert step.advance() is None
    with pytest.raises(shmkv.HandleClosed):  # and a step made before refuses to write
        write_step(advanced)
    client.close_many(hs)


def test_few_token_writes_of_a_float8_pool_move_bytes(unique_name):
    cfg = shmkv.PoolConfig(
        num_layers=L,
        num_kv_heads=H,
        head_dim=D,
        num_blocks=16,
        block_size=BS,
        dtype=torch.float8_e4m3fn,
    )
    with (
        shmkv.Coordinator(cfg, name=unique_name) as coord,
        shmkv.connect(coord.address, timeout=20) as client,
    ):
        hs = client.allocate_many([3, 5])
        step = client.batch(hs).extend(1)
        raw = torch.randint(0, 256, (2, 2, H, D), dtype=torch.uint8)
        k, v = raw.view(torch.float8_e4m3fn)
        step.write(1, k, v)
        for b, (h, pos) in enumerate(zip(hs, [3, 5])):
            assert torch.equal(h.key_cache(1)[pos].view(torch.uint8), raw[0, b])
            assert torch.equal(h.value_cache(1)[pos].view(torch.uint8), raw[1, b])
        client.close_many(hs)
