"""Steps that outlive their sequences, counts at the int64 edges, frames past the limit,
and requests queued behind a promotion: each refused with a specific error, nothing
changed, the connection kept."""

import os
import struct
import time

import msgpack
import numpy as np
import pytest
import torch

import shmkv
from shmkv import protocol

L, H, D, BS = 2, 4, 8, 4


@pytest.fixture
def cfg():
    return shmkv.PoolConfig(
        num_layers=L,
        num_kv_heads=H,
        head_dim=D,
        num_blocks=64,
        block_size=BS,
        dtype=torch.float32,
        max_sequences=16,
        max_seq_len=10,
    )


@pytest.fixture
def coord(cfg, unique_name):
    with shmkv.Coordinator(cfg, name=unique_name) as c:
        yield c


@pytest.fixture
def client(coord):
    with shmkv.connect(coord.address, timeout=20) as c:
        yield c


def kv(n, value, heads=H):
    return torch.full((n, heads, D), float(value))


def snapshot(coord, client):
    """The coordinator's counts, with its invariants checked."""
    coord.table.check_invariants()
    stats = client.stats()
    return {
        k: stats[k] for k in ("free_blocks", "cached_blocks", "referenced_blocks", "sequences")
    }, coord.table.tables.num_free


# -- a step rebuilt elsewhere, after its sequence closed (26.3) -----------------------------


def test_a_descriptor_step_never_writes_into_a_block_its_closed_sequence_gave_up(unique_name):
    cfg = shmkv.PoolConfig(
        num_layers=L,
        num_kv_heads=H,
        head_dim=D,
        num_blocks=16,
        block_size=BS,
        dtype=torch.float32,
        tp_size=2,
    )
    with (
        shmkv.Coordinator(cfg, name=unique_name) as coord,
        shmkv.connect(coord.address, tp_rank=0, tp_size=2, timeout=20) as r0,
        shmkv.connect(coord.address, tp_rank=1, tp_size=2, timeout=20) as r1,
        shmkv.connect(coord.address, timeout=20) as reader,
    ):
        h = r0.allocate(0)
        step = r0.batch([h]).extend(4)
        stale = r1.step_from(step.descriptor())  # rank 1's copy of the step
        stale.write(0, kv(4, 1.0, 2), kv(4, 1.0, 2))  # fine while the sequence lives
        block = h.block_table.physical_blocks[0]
        h.close()
        h2 = r0.allocate(4)  # takes the block back
        assert h2.block_table.physical_blocks[0] == block
        h2.write(0, kv(4, 7.0, 2), kv(4, 7.0, 2), start=0)
        with pytest.raises(shmkv.StaleStep, match="closed"):
            stale.write(0, kv(4, -1.0, 2), kv(4, -1.0, 2))
        with pytest.raises(shmkv.StaleStep):
            stale.write_all(torch.full((L, 2, 4, 2, D), -1.0))
        whole = reader.open(h2.export(10))
        assert torch.equal(whole.key_cache(0)[:, :2], kv(4, 7.0, 2))
        whole.close()


def test_a_descriptor_whose_uniform_count_disagrees_is_refused(client):
    h = client.allocate(3)
    step = client.batch([h]).extend([2])
    desc = bytearray(step.descriptor())
    header = struct.Struct("<4sBxxxi8sI")
    magic, version, _uniform, instance, num = header.unpack_from(desc)
    for uniform in (5, -7):
        header.pack_into(desc, 0, magic, version, uniform, instance, num)
        with pytest.raises(shmkv.InvalidArgument, match="malformed step descriptor"):
            client.step_from(bytes(desc))
    body = np.frombuffer(bytes(desc[header.size :]), dtype="<i8").copy().reshape(4, num)
    body[3, 0] = 2**62  # a count past any sequence
    header.pack_into(desc, 0, magic, version, -1, instance, num)
    with pytest.raises(shmkv.InvalidArgument, match="out of range"):
        client.step_from(bytes(desc[: header.size]) + body.tobytes())


# -- counts at the int64 edges, max_seq_len exactly (26.5, 26.6, 26.15) ---------------------


def test_counts_at_the_int64_edges_are_refused_and_change_nothing(coord, client):
    h = client.allocate(2)
    batch = client.batch([h])
    before = snapshot(coord, client)
    for count in (2**63 - 1, 2**64, 2**100):
        with pytest.raises(shmkv.LimitExceeded, match="max_seq_len"):
            batch.extend(count)
        with pytest.raises(shmkv.LimitExceeded, match="max_seq_len"):
            batch.extend([count])
    too_long = (shmkv.LimitExceeded, shmkv.PoolExhausted)  # past max_seq_len, past the pool
    for count in (2**63 - 1, 2**62, 9):  # straight to the coordinator
        with pytest.raises(too_long, match="max_seq_len|whole pool"):
            client.request(
                "extend_batch",
                ids=protocol.pack_i64s([h._cache_id]),
                count=count,
                slots=protocol.pack_i64s([h._slot]),
            )
        with pytest.raises(too_long, match="max_seq_len|whole pool"):
            client.request(
                "extend_batch",
                ids=protocol.pack_i64s([h._cache_id]),
                counts=protocol.pack_i64s([count]),
            )
        with pytest.raises(too_long, match="max_seq_len|whole pool"):
            client.request("extend_many", items=[[h._cache_id, count]])
        with pytest.raises((shmkv.LimitExceeded, shmkv.PoolExhausted)):
            h.extend(count)
    with pytest.raises(shmkv.InvalidArgument, match="start must be >= 0"):
        batch.prefill(start=-1)
    with pytest.raises(shmkv.InvalidArgument, match="k_scale"):
        client.set_kv_scales(0, 10**400, 1)
    assert snapshot(coord, client) == before
    batch.extend(1).write(0, kv(1, 1.0), kv(1, 1.0))  # the batch still steps
    assert h.num_tokens == 3


def test_allocate_many_at_the_int64_edge_keeps_every_table_slot(coord, client):
    before = snapshot(coord, client)
    for _ in range(6):  # max_sequences=16: would run out
        with pytest.raises(shmkv.PoolExhausted, match="whole pool"):
            client.request("allocate_many", counts=protocol.pack_i64s([2**63 - 1, 1]))
        with pytest.raises(shmkv.LimitExceeded, match="max_seq_len"):
            client.request("allocate_many", counts=protocol.pack_i64s([11, 1]))
        with pytest.raises(shmkv.LimitExceeded, match="max_seq_len"):
            client.allocate_many([2**63 - 1, 1])
        with pytest.raises(shmkv.LimitExceeded, match="max_seq_len"):
            client.allocate_many([2**64, 1])
    assert snapshot(coord, client) == before
    handles = client.allocate_many([1] * 16)  # every slot is still there
    client.close_many(handles)


def test_max_seq_len_is_enforced_in_tokens_not_whole_blocks(coord, client):
    # max_seq_len=10, block_size=4: the last block has room for 12, but only 10 are allowed
    h = client.allocate(10)
    before = snapshot(coord, client)
    for grow in (
        lambda: h.extend(1),
        lambda: client.batch([h]).extend(1),
        lambda: client.batch([h]).extend([2]),
    ):
        with pytest.raises(shmkv.LimitExceeded, match="max_seq_len"):
            grow()
    for n in (11, 12):
        with pytest.raises(shmkv.LimitExceeded, match="max_seq_len"):
            client.allocate(n)
        with pytest.raises(shmkv.LimitExceeded, match="max_seq_len"):
            client.allocate_many([n])
        with pytest.raises(shmkv.LimitExceeded, match="max_seq_len"):
            client.allocate(prompt=list(range(n)))
    assert snapshot(coord, client) == before and h.num_tokens == 10
    # a kept decode batch stops at the bound too
    plain = client.allocate_many([8, 8])
    batch = client.batch(plain)
    batch.extend(1)
    batch.extend(1)
    with pytest.raises(shmkv.LimitExceeded, match="max_seq_len"):
        batch.extend(1)
    assert [p.num_tokens for p in plain] == [10, 10]
    coord.table.check_invariants()


# -- frames past the limit (26.7) -------------------------------------------------------------


def test_an_oversized_request_is_split_or_refused_and_the_connection_stays(
    small_config, unique_name
):
    cfg = shmkv.PoolConfig(
        num_layers=1,
        num_kv_heads=1,
        head_dim=8,
        num_blocks=2048,
        block_size=16,
        dtype=torch.float32,
        max_seq_len=4096,
    )
    cfg = shmkv.PoolConfig(
        num_layers=1,
        num_kv_heads=1,
        head_dim=8,
        num_blocks=8192,
        block_size=16,
        dtype=torch.float32,
        max_seq_len=4096,
    )
    with (
        shmkv.Coordinator(cfg, name=unique_name, max_frame=64 << 10) as coord,
        shmkv.connect(coord.address, timeout=20) as client,
    ):
        assert client.max_frame == 64 << 10
        running = client.allocate(prompt=list(range(32)))
        # 24 prompts of 4,000 tokens: over 700 KiB packed, so the client splits them
        prompts = [[i * 10_000 + t for t in range(4000)] for i in range(24)]
        handles = client.allocate_many([{"prompt": p} for p in prompts])
        assert [h.num_tokens for h in handles] == [4000] * 24
        client.close_many(handles)
        # too many for the pool across the parts: all or none still
        free = client.stats()["free_blocks"]
        with pytest.raises(shmkv.PoolExhausted):
            client.allocate_many(
                [{"prompt": [i * 10_000 + t for t in range(4000)]} for i in range(40)]
            )
        assert client.stats()["free_blocks"] == free
        # one request that cannot be split: refused before it is sent
        with pytest.raises(shmkv.LimitExceeded, match="maximum frame"):
            client.request("allocate", num_tokens=0, prompt=b"\0" * (80 << 10))
        # and the coordinator answers one it gets from a peer that does not check
        body = msgpack.packb([77, "allocate", {"prompt": b"\0" * (80 << 10)}])
        with client._link._lock:
            client._link._sock.sendall(struct.pack(">I", len(body)) + body)
            answer = None
            while answer is None:
                for obj in client._link._decoder.feed(client._link._sock.recv(1 << 16)):
                    answer = protocol.parse_response(obj)
        assert answer.request_id == 77 and answer.code == 4
        assert "exceeds the maximum" in answer.message
        client.ping()  # still connected, sequences alive
        assert running.is_valid() and running.num_tokens == 32
        assert client.stats()["sequences"] == 1


def test_decoder_skips_an_oversized_body_without_buffering_it():
    decoder = protocol.FrameDecoder(max_frame=1024)
    big = msgpack.packb([9, "allocate", {"prompt": b"x" * 5000}])
    frames = struct.pack(">I", len(big)) + big + protocol.encode_request(10, "ping")
    got = []
    for i in range(0, len(frames), 700):  # in pieces, as a socket gives them
        got += list(decoder.feed(frames[i : i + 700]))
        assert decoder.buffered < 1024
    assert isinstance(got[0], protocol.OversizedFrame)
    assert (got[0].request_id, got[0].length) == (9, len(big))
    assert protocol.parse_request(got[1]).request_id == 10


def test_an_oversized_frame_whose_header_arrives_alone_keeps_its_request_id():
    decoder = protocol.FrameDecoder(max_frame=1024)
    big = msgpack.packb([2**62, "allocate", {"prompt": b"x" * 5000}])
    frames = struct.pack(">I", len(big)) + big + protocol.encode_request(10, "ping")
    got = list(decoder.feed(frames[:4]))  # the length prefix alone
    got += list(decoder.feed(frames[4:7]))  # then 3 bytes: the id is not whole
    assert got == []
    for i in range(7, len(frames), 5):
        got += list(decoder.feed(frames[i : i + 5]))
        assert decoder.buffered < 1024
    assert isinstance(got[0], protocol.OversizedFrame)
    assert (got[0].request_id, got[0].length) == (2**62, len(big))
    assert protocol.parse_request(got[1]).request_id == 10


# -- requests queued behind a promotion (26.11) -----------------------------------------------


class HeldConnection:
    """A coordinator served by hand (no thread) with one greeted connection ``conn``
    whose requests are being held, as while one of its promotions is copied in;
    ``send`` writes frames from the client's end, ``read_until`` lets the loop read them
    until ``n`` are held. ``MAX_HELD_BYTES`` is 8192 meanwhile."""

    def __init__(self, cfg, name: str, monkeypatch):
        import selectors
        import socket

        from shmkv.coordinator import connections

        monkeypatch.setattr(connections, "MAX_HELD_BYTES", 8192)
        self.coord = shmkv.Coordinator(cfg, name=name)
        self.coord.open()
        self.selector = connections.make_selector()
        mine, self.theirs = socket.socketpair()
        mine.setblocking(False)
        self.conn = connections._Conn(mine, 7, os.getpid(), self.coord.max_frame)
        self.conn.greeted = True
        self.coord._conns[7] = self.conn
        self.coord.table.add_connection(7)
        self.selector.register(mine, selectors.EVENT_READ, self.conn)
        self.conn.held = []
        self.deadline = time.monotonic() + 10

    def send(self, *frames: bytes) -> None:
        self.theirs.sendall(b"".join(frames))

    def read_until(self, n: int) -> None:
        while len(self.conn.held) < n:
            assert time.monotonic() < self.deadline, f"read {len(self.conn.held)} of {n} frames"
            self.coord._connections.on_readable(self.conn, self.selector)

    def kinds(self) -> list:
        return [type(obj).__name__ for obj, _ in self.conn.held]

    def close(self) -> None:
        self.selector.close()
        self.theirs.close()
        self.coord.close()


def _allocate_frame(request_id: int) -> bytes:
    prompt = protocol.pack_i64s(list(range(400)))  # 3.2 KB a request
    return protocol.encode_request(request_id, "allocate", {"num_tokens": 0, "prompt": prompt})


@pytest.fixture
def held(unique_name, monkeypatch):
    cfg = shmkv.PoolConfig(
        num_layers=L,
        num_kv_heads=H,
        head_dim=D,
        num_blocks=256,
        block_size=BS,
        dtype=torch.float32,
        max_sequences=16,
    )
    h = HeldConnection(cfg, unique_name, monkeypatch)
    try:
        yield h
    finally:
        h.close()


def test_requests_held_behind_a_promotion_are_bounded_in_bytes(held):
    coord, conn = held.coord, held.conn
    held.send(*[_allocate_frame(100 + i) for i in range(4)], protocol.encode_request(200, "ping"))
    held.read_until(5)
    assert 0 < conn.held_bytes <= 8192
    assert held.kinds() == ["list", "list", "_Refused", "_Refused", "list"]
    assert "the limit is 8192" in str(conn.held[2][0].error)
    assert conn.held_bytes == sum(size for _, size in conn.held)
    coord._connections.answer_held(conn)  # the wait ends: answered in order
    coord._connections.flush(conn, held.selector)
    decoder, answers = protocol.FrameDecoder(), []
    held.theirs.settimeout(5)
    while len(answers) < 5:
        answers += [protocol.parse_response(o) for o in decoder.feed(held.theirs.recv(1 << 16))]
    assert [(a.request_id, a.code) for a in answers] == [
        (100, 0),
        (101, 0),
        (102, 9),
        (103, 9),
        (200, 0),
    ]
    assert 7 in coord._conns  # the connection stays
    assert coord.table.num_sequences == 2
    coord.table.check_invariants()


def test_requests_held_again_behind_a_second_promotion_count_again(held, monkeypatch):
    """A held request that itself waits for a tier holds the rest once more: their bytes
    stay counted, so what arrives meanwhile is bounded by the same MAX_HELD_BYTES."""
    coord, conn = held.coord, held.conn
    held.send(_allocate_frame(100), _allocate_frame(101))
    held.read_until(2)
    handle = coord._connections._handle

    def waits_again(c, obj):  # request 100 waits for a tier too
        handle(c, obj)
        if protocol.request_id_of(obj) == 100:
            c.held = []

    monkeypatch.setattr(coord._connections, "_handle", waits_again)
    coord._connections.answer_held(conn)
    assert [protocol.request_id_of(obj) for obj, _ in conn.held] == [101]
    assert conn.held_bytes == conn.held[0][1] > 3000  # still counted
    held.send(_allocate_frame(102), _allocate_frame(103))
    held.read_until(3)
    assert held.kinds() == ["list", "list", "_Refused"]  # 3 x 3.2 KB > 8 KiB
    assert conn.held_bytes <= 8192


# -- memory ordering off x86 (26.17): the round-trip fallback -----------------------------------


def test_tables_are_read_lock_free_only_where_loads_and_stores_keep_their_order(monkeypatch):
    from shmkv.memory.tables import lock_free_reads

    monkeypatch.delenv("SHMKV_TABLE_READS", raising=False)
    assert lock_free_reads("x86_64") and lock_free_reads("AMD64")
    for machine in ("aarch64", "arm64", "ppc64le", "riscv64", "s390x"):
        assert not lock_free_reads(machine)
    monkeypatch.setenv("SHMKV_TABLE_READS", "shared")
    assert not lock_free_reads("aarch64")  # never off x86
    monkeypatch.setenv("SHMKV_TABLE_READS", "round-trip")
    assert not lock_free_reads("x86_64")


def test_the_round_trip_fallback_reads_what_the_shared_tables_hold(coord, monkeypatch):
    monkeypatch.setenv("SHMKV_TABLE_READS", "round-trip")
    with shmkv.connect(coord.address, timeout=20) as slow:
        monkeypatch.delenv("SHMKV_TABLE_READS")
        with shmkv.connect(coord.address, timeout=20) as fast:
            assert not slow.lock_free and fast.lock_free
            hs = [slow.allocate(prompt=[1, 2, 3, 4, 5]), slow.allocate(3)]
            batch = slow.batch(hs)
            steps = [batch.prefill(start=0), batch.extend([1, 2]), batch.extend(1), batch.extend(1)]
            assert steps[-1].advance() is None  # no lock-free shortcut
            for step in steps:
                ids = step.cache_ids[step.seq_index].to(torch.float32)
                for layer in range(L):
                    value = (ids + step.positions)[:, None, None].expand(-1, H, D) + layer
                    step.write(layer, value.contiguous(), value.contiguous())
            twin = fast.step_from(steps[-1].descriptor())
            assert twin.slot_mapping.tolist() == steps[-1].slot_mapping.tolist()
            assert twin.block_tables.tolist() == steps[-1].block_tables.tolist()
            again = slow.step_from(steps[-1].descriptor())
            assert again.block_tables.tolist() == steps[-1].block_tables.tolist()
            for h in hs:
                other = fast.open(h.export(10))
                assert other.block_table == h.block_table and other.num_tokens == h.num_tokens
                for layer in range(L):
                    assert torch.equal(other.key_cache(layer), h.key_cache(layer))
                other.close()
            # a fork by the other client is seen: the stale step refuses, nothing written
            fork = fast.open(hs[0].export(10)).fork()
            with pytest.raises(shmkv.StaleStep):
                steps[-1].write(0, torch.zeros(2, H, D), torch.zeros(2, H, D))
            fork.close()
            hs[1].close()
            with pytest.raises(shmkv.StaleStep, match="closed"):
                again.write(0, torch.zeros(2, H, D), torch.zeros(2, H, D))
            assert slow.stats()["ops_by_type"]["rows"] > 0


def test_a_rank_connection_commits_only_its_own_shard_per_handle_too(unique_name):
    cfg = shmkv.PoolConfig(
        num_layers=L,
        num_kv_heads=H,
        head_dim=D,
        num_blocks=16,
        block_size=BS,
        dtype=torch.float32,
        tp_size=2,
    )
    with (
        shmkv.Coordinator(cfg, name=unique_name) as coord,
        shmkv.connect(coord.address, tp_rank=0, tp_size=2, timeout=20) as r0,
        shmkv.connect(coord.address, timeout=20) as reader,
    ):
        h = r0.allocate(prompt=list(range(8)))
        for rank in (1, None):  # another rank's shard, or every rank's at once
            with pytest.raises(shmkv.InvalidArgument, match="commits only its own shard"):
                r0.request("commit", cache_id=h._cache_id, num_tokens=8, tp_rank=rank)
        assert h.commit() == 0  # its own: rank 1 has not committed
        assert reader.allocate(prompt=list(range(8))).num_cached_tokens == 0
