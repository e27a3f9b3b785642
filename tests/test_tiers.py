"""Tiers under the pool (host memory, local disk): demotion, promotion, persistence across
restarts, damaged files, crashes in the middle of a demotion, capacities, bad input, and
the tier I/O process (it dies with its coordinator; threads take over if it dies).

Real processes and real files: coordinators in a thread of the test or in their own
process, writers and readers in spawned processes, block files in a temporary directory.
Copies run in the tier I/O process (CPU pools' default) unless a test says otherwise;
faults are injected there with ``tier_faults`` (``IO_PROCESS_PRELOAD``).
"""

import contextlib
import errno
import logging
import os
import signal
import threading
import time

import psutil
import pytest
import tier_faults
import torch
from conftest import SPAWN, join_or_kill, shm_entries

import shmkv
from shmkv import tiers as tiers_mod
from shmkv.coordinator.server import remove_stale_socket
from shmkv.memory import block_io
from shmkv.tiers import specs as tier_specs

BS = 4


def make_config(num_blocks=16, **kw) -> shmkv.PoolConfig:
    args = dict(
        num_layers=2,
        num_kv_heads=2,
        head_dim=8,
        num_blocks=num_blocks,
        block_size=BS,
        dtype=torch.float32,
    )
    args.update(kw)
    return shmkv.PoolConfig(**args)


def token_kv(prompt, layer, heads, dim):
    """K and V of a prompt: a function of token, position, layer, head and channel."""
    t = torch.tensor(prompt, dtype=torch.float32)[:, None, None]
    p = torch.arange(len(prompt), dtype=torch.float32)[:, None, None]
    k = (
        t * 0.5
        + p * 0.01
        + layer
        + torch.arange(heads)[None, :, None] * 0.25
        + torch.arange(dim)[None, None, :] * 0.125
    )
    return k.contiguous(), (-k - 7).contiguous()


def write_prompt(client, prompt) -> int:
    """What a model does: allocate, write the uncached rest, commit, close. Returns the
    tokens that were cached."""
    h = client.allocate(prompt=prompt)
    cached = h.num_cached_tokens
    if cached < len(prompt):
        for layer in range(h.num_layers):
            k, v = token_kv(prompt, layer, h.num_heads, h.head_dim)
            h.write(layer, k[cached:].contiguous(), v[cached:].contiguous(), start=cached)
    h.commit()
    h.close()
    return cached


def read_prompt(client, prompt) -> tuple:
    """(cached tokens, whether every cached K and V equals what was written)."""
    h = client.allocate(prompt=prompt)
    cached = h.num_cached_tokens
    exact = True
    for layer in range(h.num_layers):
        k, v = token_kv(prompt, layer, h.num_heads, h.head_dim)
        exact &= torch.equal(h.key_cache(layer)[:cached], k[:cached])
        exact &= torch.equal(h.value_cache(layer)[:cached], v[:cached])
    h.close()
    return cached, bool(exact)


def prompts_of(n, blocks, seed=0):
    return [[1000 * seed + 100 * i + j for j in range(blocks * BS)] for i in range(n)]


def wait_idle(client, timeout=30.0) -> dict:
    """Stats once no tier copy is pending and the disk scan is done."""
    deadline = time.monotonic() + timeout
    while True:
        st = client.stats()
        io = st["tier_io"]
        if not io["pending"] and not io["scanning"] and not io["promotions_in_flight"]:
            return st
        if time.monotonic() > deadline:
            pytest.fail(f"tiers still busy after {timeout} s: {io}")
        time.sleep(0.01)


def evict_all(client) -> None:
    """Take every free or cached block once (evicting all cached ones), then give it back."""
    st = client.stats()
    h = client.allocate((st["free_blocks"] + st["cached_blocks"]) * BS)
    h.close()


@contextlib.contextmanager
def tier_coordinator(cfg, name: str, tier=None, clients: int = 1):
    """A coordinator over ``tier`` (default: a host tier of 8 blocks), and ``clients``
    clients of it: ``(coord, client, ...)``."""
    tier = shmkv.HostTier(8 * cfg.block_nbytes) if tier is None else tier
    with contextlib.ExitStack() as stack:
        coord = stack.enter_context(shmkv.Coordinator(cfg, name=name, tiers=[tier]))
        conns = [
            stack.enter_context(shmkv.connect(coord.address, timeout=20)) for _ in range(clients)
        ]
        yield (coord, *conns)


def in_tier_only(client, *prompts) -> None:
    """Write and commit each prompt, let the tiers take them, and push them out of the
    pool: their blocks are in a lower tier only."""
    for prompt in prompts:
        write_prompt(client, prompt)
    wait_idle(client)
    evict_all(client)
    wait_idle(client)


def damage_block(path, prompt, index: int) -> None:
    """Flip a payload byte of block ``index`` of ``prompt`` (unsalted) in the disk tier
    at ``path``."""
    from shmkv import hashing

    key = hashing.block_keys(prompt, BS, hashing.root_key())[index]
    file = path / "blocks" / (key.hex() + ".kv")
    data = bytearray(file.read_bytes())
    data[-5] ^= 0xFF
    file.write_bytes(bytes(data))


class RawConnection:
    """A connection that speaks the wire protocol by hand (requests pipelined in one
    write, a connection closed with requests unanswered): hello on open, answers
    collected by request id."""

    def __init__(self, address: str):
        import socket

        from shmkv import protocol

        self._protocol = protocol
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(20)
        self.sock.connect(address)
        self._decoder = protocol.FrameDecoder(1 << 24)
        self._next = 0  # the next request's id
        self.answers: dict = {}
        self.send(("hello", {"version": protocol.PROTOCOL_VERSION}))

    def send(self, *requests) -> None:
        """``(op, args)`` pairs, numbered on from the last, in one write."""
        frames = [
            self._protocol.encode_request(self._next + i, op, args)
            for i, (op, args) in enumerate(requests)
        ]
        self._next += len(frames)
        self.sock.sendall(b"".join(frames))

    def wait(self, count: int) -> dict:
        """The answers once ``count`` have come (the hello's is number 0)."""
        deadline = time.monotonic() + 20
        while len(self.answers) < count:
            assert time.monotonic() < deadline, f"answers so far: {sorted(self.answers)}"
            data = self.sock.recv(1 << 16)  # (the hello's descriptors are dropped)
            assert data, "the coordinator closed the connection"
            for obj in self._decoder.feed(data):
                response = self._protocol.parse_response(obj)
                self.answers[response.request_id] = response.unwrap()
        return self.answers

    def close(self) -> None:
        self.sock.close()


def tier(st, name) -> dict:
    return next(t for t in st["tiers"] if t["tier"] == name)


def block_files(path) -> list:
    return sorted(os.listdir(os.path.join(path, "blocks")))


@pytest.fixture(params=["process", "threads", "client"])
def io(request, monkeypatch):
    """Where tier copies run: the tier I/O process (CPU pools' default) or threads, every
    copy; or "client", the I/O process but for promotions, which the allocating
    client copies (``Client.copy_promotions``, the default)."""
    monkeypatch.setattr(tiers_mod, "IO_PROCESS", request.param != "threads")
    monkeypatch.setattr(shmkv.Client, "copy_promotions", request.param == "client")
    return request.param


def inject(monkeypatch, io, fault: str) -> None:
    """Fault ``fault`` of ``tier_faults`` wherever the copies run (with "client", in the
    I/O process and in this process, where the test's clients copy)."""
    if io != "threads":
        monkeypatch.setattr(tiers_mod, "IO_PROCESS_PRELOAD", tier_faults.spec(fault))
    if io != "process":
        getattr(tier_faults, fault)(block_io, monkeypatch.setattr)


def io_process_of(pid: int) -> psutil.Process:
    """The tier I/O process of the coordinator process ``pid``."""
    deadline = time.monotonic() + 20
    while True:
        for child in psutil.Process(pid).children():
            if block_io.__file__ in child.cmdline():
                return child
        assert time.monotonic() < deadline, "no tier I/O process"
        time.sleep(0.01)


# -- children (spawned) ---------------------------------------------------------------------


def _writer(address, prompts, queue):
    with shmkv.connect(address, timeout=30) as client:
        queue.put([write_prompt(client, p) for p in prompts])


def _reader(address, prompts, queue):
    with shmkv.connect(address, timeout=30) as client:
        queue.put([read_prompt(client, p) for p in prompts])


def _slow_disk_coordinator(config_wire, address, path, queue):
    """A coordinator whose disk writes stall half-way (in its tier I/O process): a
    temporary file holds a partial block for a while before the real write, so a SIGKILL
    lands mid-demotion."""
    tiers_mod.IO_PROCESS_PRELOAD = tier_faults.spec("slow_disk_write")
    coord = shmkv.Coordinator(
        shmkv.PoolConfig.from_wire(config_wire),
        address=address,
        tiers=[shmkv.DiskTier(path, 1 << 24)],
    )
    coord.open()
    queue.put("ready")
    coord.serve_forever()


def run_child(target, *args, timeout=60.0):
    q = SPAWN.Queue()
    proc = SPAWN.Process(target=target, args=args + (q,))
    proc.start()
    try:
        return q.get(timeout=timeout)
    finally:
        assert join_or_kill(proc, timeout) == 0


# -- demotion and promotion ------------------------------------------------------------------


@pytest.mark.parametrize("kinds", ["host", "disk", "host+disk"])
def test_bytes_equal_after_demote_and_promote_read_from_another_process(
    tmp_path, unique_name, kinds, io
):
    cfg = make_config(num_blocks=16)
    specs = []
    if "host" in kinds:
        specs.append(shmkv.HostTier(32 * cfg.block_nbytes))
    if "disk" in kinds:
        specs.append(shmkv.DiskTier(tmp_path / "tier", 1 << 20))
    prompts = prompts_of(3, 3)
    with (
        shmkv.Coordinator(cfg, name=unique_name, tiers=specs) as coord,
        shmkv.connect(coord.address, timeout=20) as client,
    ):
        assert run_child(_writer, coord.address, prompts) == [0, 0, 0]
        wait_idle(client)
        evict_all(client)
        st = wait_idle(client)
        assert st["prefix_index_blocks"] == 0  # nothing left in the pool
        assert st["tier_io"]["lost_evictions"] == 0
        got = run_child(_reader, coord.address, prompts)
        assert got == [(12, True)] * 3
        st = wait_idle(client)
        assert sum(t["promotions"] for t in st["tiers"]) == 9
        assert st["prefix_hit_blocks"] == 9
        coord.table.check_invariants()


@pytest.mark.parametrize("row_copy", ["native", "numpy"])
def test_wide_rows_move_exactly_with_the_native_row_copy_or_numpys(
    tmp_path, unique_name, row_copy, monkeypatch
):
    """Blocks of 4 rows of 32,784 bytes (streamed past the caches, every other row 16
    bytes off a 32-byte line) go to the host tier and on to disk and come back, copied
    by the I/O process and by the allocating client: with the native row copy, which
    both load (the I/O process by the path the coordinator loaded it from), and with
    numpy's copy where it is not available."""
    from shmkv.kernels import native

    if row_copy == "numpy":
        monkeypatch.setattr(native, "copier", lambda: None)
    elif native.copier() is None:
        pytest.skip(f"no native row copy here: {native.copy_status()}")
    monkeypatch.setattr(shmkv.Client, "copy_promotions", True)
    cfg = make_config(num_blocks=16, num_kv_heads=1, head_dim=2049)
    row = cfg.block_size * 2049 * 4
    assert row % 32 == 16 and cfg.block_nbytes == 4 * row >= block_io.RowCopy.min_bytes
    specs = [shmkv.HostTier(8 * cfg.block_nbytes), shmkv.DiskTier(tmp_path / "tier", 1 << 23)]
    prompts = prompts_of(5, 3)  # 15 blocks: the host tier's 8 and the rest on disk
    with (
        shmkv.Coordinator(cfg, name=unique_name, tiers=specs) as coord,
        shmkv.connect(coord.address, timeout=20) as client,
    ):
        with open(f"/proc/{io_process_of(os.getpid()).pid}/maps") as f:
            maps = f.read()
        lib = native.library_path(native.COPY.name)
        assert (lib is not None and os.path.realpath(lib) in maps) == (row_copy == "native")
        assert [write_prompt(client, p) for p in prompts] == [0] * 5
        wait_idle(client)
        evict_all(client)
        st = wait_idle(client)
        assert st["prefix_index_blocks"] == 0 and st["tier_io"]["lost_evictions"] == 0
        assert [read_prompt(client, p) for p in prompts] == [(12, True)] * 5
        mover = client._copies.mover
        assert isinstance(mover.copy, block_io.RowCopy) == (row_copy == "native")
        st = wait_idle(client)
        assert sum(t["promotions"] for t in st["tiers"]) == 15
        coord.table.check_invariants()


def test_working_set_4x_the_pool_is_served_from_the_tiers(tmp_path, unique_name):
    cfg = make_config(num_blocks=16)
    prompts = prompts_of(16, 4)  # 64 blocks: four times the pool
    specs = [shmkv.HostTier(24 * cfg.block_nbytes), shmkv.DiskTier(tmp_path, 1 << 20)]
    with (
        shmkv.Coordinator(cfg, name=unique_name, tiers=specs) as coord,
        shmkv.connect(coord.address, timeout=20) as client,
    ):
        for p in prompts:
            write_prompt(client, p)
            wait_idle(client)
        for _round in range(2):  # a cycle over all: LRU's worst case, served from disk
            for p in prompts:
                assert read_prompt(client, p) == (16, True)
        for p in reversed(prompts[-8:]):  # the recent ones: from the pool, then host memory
            assert read_prompt(client, p) == (16, True)
        st = wait_idle(client)
        assert st["evictions"] > 64
        assert st["tier_io"]["lost_evictions"] == 0
        host, disk = tier(st, "host"), tier(st, "disk")
        assert host["promotions"] > 0 and disk["promotions"] > 0
        assert host["blocks"] <= 24 and disk["blocks"] == 64
        coord.table.check_invariants()


def test_promotion_is_all_or_nothing_when_the_pool_cannot_supply(unique_name):
    cfg = make_config(num_blocks=8)
    prompt = prompts_of(1, 6)[0]
    with (
        shmkv.Coordinator(
            cfg, name=unique_name, tiers=[shmkv.HostTier(16 * cfg.block_nbytes)]
        ) as coord,
        shmkv.connect(coord.address, timeout=20) as client,
    ):
        write_prompt(client, prompt)
        wait_idle(client)
        evict_all(client)
        before = wait_idle(client)
        hold = client.allocate(4 * BS)  # 4 of 8 blocks referenced
        with pytest.raises(shmkv.PoolExhausted):
            client.allocate(prompt=prompt)  # needs 6
        after = wait_idle(client)
        assert tier(after, "host") == tier(before, "host")
        assert after["free_blocks"] == 4 and after["prefix_hit_blocks"] == 0
        assert all(e.pins == 0 for e in coord.tiers.host.index.values())
        hold.close()
        assert read_prompt(client, prompt) == (24, True)
        coord.table.check_invariants()


def _published_then_copied_on_write(client, prompt):
    """A sequence that wrote and committed ``prompt``, then wrote its first token again:
    its first block is a private copy now, the published original is cached (and goes
    down a tier), its later blocks stay published in the pool, held by it."""
    h = client.allocate(prompt=prompt)
    for layer in range(h.num_layers):
        k, v = token_kv(prompt, layer, h.num_heads, h.head_dim)
        h.write(layer, k, v, start=0)
    h.commit()
    k, v = token_kv(prompt, 0, h.num_heads, h.head_dim)
    h.write(0, k[:1].contiguous(), v[:1].contiguous(), start=0)  # copy on write
    return h


def test_blocks_the_pool_holds_past_a_tier_hit_are_hits_too(unique_name):
    cfg = make_config(num_blocks=8)
    prompt = prompts_of(1, 3)[0]
    with (
        shmkv.Coordinator(
            cfg, name=unique_name, tiers=[shmkv.HostTier(16 * cfg.block_nbytes)]
        ) as coord,
        shmkv.connect(coord.address, timeout=20) as client,
    ):
        h = _published_then_copied_on_write(client, prompt)
        wait_idle(client)
        evict_all(client)  # the published first block: host tier only
        before = wait_idle(client)
        assert before["cached_blocks"] == 0 and tier(before, "host")["blocks"] == 1
        assert read_prompt(client, prompt) == (3 * BS, True)  # promoted + 2 pool hits
        after = wait_idle(client)
        assert after["prefix_hit_blocks"] - before["prefix_hit_blocks"] == 3
        assert tier(after, "host")["promotions"] - tier(before, "host")["promotions"] == 1
        h.close()
        coord.table.check_invariants()


def test_a_failed_promotion_ends_the_hit_before_the_pool_blocks_past_it(tmp_path, unique_name):
    cfg = make_config(num_blocks=8)
    prompt = prompts_of(1, 3)[0]
    with (
        shmkv.Coordinator(
            cfg, name=unique_name, tiers=[shmkv.DiskTier(tmp_path, 1 << 20)]
        ) as coord,
        shmkv.connect(coord.address, timeout=20) as client,
    ):
        h = _published_then_copied_on_write(client, prompt)
        wait_idle(client)
        evict_all(client)
        before = wait_idle(client)
        from shmkv import hashing

        first = (
            tmp_path
            / "blocks"
            / (hashing.block_keys(prompt, BS, hashing.root_key())[0].hex() + ".kv")
        )
        data = bytearray(first.read_bytes())
        data[-5] ^= 0xFF  # payload damaged
        first.write_bytes(bytes(data))
        assert read_prompt(client, prompt) == (0, True)  # nothing past the lost block
        after = wait_idle(client)
        assert after["prefix_hit_blocks"] == before["prefix_hit_blocks"]
        assert tier(after, "disk")["removed_damaged"] == 1
        h.close()
        coord.table.check_invariants()


def test_tensor_parallel_ranks_read_their_shards_of_a_promoted_block(unique_name):
    cfg = make_config(num_blocks=8, num_kv_heads=4, tp_size=2)
    prompt = prompts_of(1, 2)[0]
    with (
        shmkv.Coordinator(
            cfg, name=unique_name, tiers=[shmkv.HostTier(8 * cfg.block_nbytes)]
        ) as coord,
        shmkv.connect(coord.address, timeout=20) as full,
        shmkv.connect(coord.address, tp_rank=0, tp_size=2, timeout=20) as r0,
        shmkv.connect(coord.address, tp_rank=1, tp_size=2, timeout=20) as r1,
    ):
        write_prompt(full, prompt)
        wait_idle(full)
        evict_all(full)
        wait_idle(full)
        h0 = r0.allocate(prompt=prompt)
        assert h0.num_cached_tokens == 8
        h1 = r1.open(h0.export())
        for layer in range(2):
            k, v = token_kv(prompt, layer, 4, 8)
            assert torch.equal(h0.key_cache(layer), k[:, :2])
            assert torch.equal(h1.key_cache(layer), k[:, 2:])
            assert torch.equal(h1.value_cache(layer), v[:, 2:])
        h0.close()
        h1.close()


def test_the_loop_serves_others_while_a_promotion_copies(unique_name, monkeypatch, io):
    cfg = make_config(num_blocks=8)
    prompt = prompts_of(1, 2)[0]
    inject(monkeypatch, io, "slow_h2p")
    with tier_coordinator(cfg, unique_name, clients=2) as (coord, a, b):
        write_prompt(a, prompt)
        wait_idle(a)
        evict_all(a)
        wait_idle(a)
        result = {}

        def promote():
            t0 = time.monotonic()
            result["got"] = read_prompt(a, prompt)
            result["s"] = time.monotonic() - t0

        thread = threading.Thread(target=promote)
        thread.start()
        time.sleep(0.1)
        assert coord.tiers.num_promotions_in_flight == 1
        t0 = time.monotonic()
        for _ in range(20):
            b.request("ping")
        assert time.monotonic() - t0 < 0.4  # not queued behind the copies
        thread.join(10)
        assert result["got"] == (8, True) and result["s"] >= 0.9


def test_pipelined_requests_that_each_need_a_promotion_are_all_answered(
    unique_name, monkeypatch, io
):
    """A client sends two allocations in one write, each a hit in the host tier. The
    second is held until the first's copies are in, and needs copies of its own: they
    start in the very next turn, not when something else wakes the loop (here it would
    sleep a minute)."""
    from shmkv.coordinator import server as coordinator_mod
    from shmkv.protocol import pack_i64s

    monkeypatch.setattr(coordinator_mod, "_MAX_WAIT_S", 60.0)
    cfg = make_config(num_blocks=8)
    p, q = prompts_of(2, 2)
    with (
        shmkv.Coordinator(
            cfg, name=unique_name, tiers=[shmkv.HostTier(8 * cfg.block_nbytes)]
        ) as coord,
        shmkv.connect(coord.address, timeout=20) as client,
    ):
        in_tier_only(client, p, q)
        raw = RawConnection(coord.address)
        try:
            raw.send(
                *(
                    ("allocate_many", {"requests": [{"num_tokens": 0, "prompt": pack_i64s(x)}]})
                    for x in (p, q)
                )
            )
            answers = raw.wait(3)
        finally:
            raw.close()
        assert answers[1][0]["num_cached"] == len(p)
        assert answers[2][0]["num_cached"] == len(q)
        assert tier(client.stats(), "host")["promotions"] >= 4


def test_an_early_answer_leaves_the_connection_free_and_settle_waits_for_the_bytes(
    unique_name, monkeypatch, io
):
    """``allocate(..., wait=False)``: the answer says which cached tokens are still
    coming while the host tier copies them (half a second a block here); the same
    connection is served meanwhile; ``settle`` answers once they are in, and the bytes
    are the ones written."""
    cfg = make_config(num_blocks=8)
    prompt = prompts_of(1, 2)[0]
    inject(monkeypatch, io, "slow_h2p")
    with tier_coordinator(cfg, unique_name, clients=2) as (coord, client, other):
        in_tier_only(client, prompt)
        h = client.allocate(prompt=prompt, wait=False)
        assert h.num_cached_tokens == len(prompt)
        assert h.num_promoting_tokens == len(prompt)
        assert h.num_fetching_tokens == 0  # all on this host
        client.ping()  # not held behind the copies
        assert client.stats()["tier_io"]["promotions_in_flight"] == 1
        assert coord._promoting == {h._cache_id: 1}
        with pytest.raises(shmkv.UnknownCache):  # only a holder settles
            other.request("settle", cache_id=h._cache_id)
        # a handle opened from a hand-off waits as well (it cannot know what is coming)
        opened = other.open(h.export(ttl=30))
        assert opened.settle() == len(prompt)
        assert client.stats()["tier_io"]["promotions_in_flight"] == 0
        opened.close()
        assert h.settle() == len(prompt)
        assert h.num_promoting_tokens == 0
        for layer in range(h.num_layers):
            k, v = token_kv(prompt, layer, h.num_heads, h.head_dim)
            assert torch.equal(h.key_cache(layer)[: len(prompt)], k)
            assert torch.equal(h.value_cache(layer)[: len(prompt)], v)
        assert h.settle() == len(prompt)  # nothing coming: at once
        h.close()
        # A settle whose connection closes before the copies end: nothing answered to a
        # closed socket, the sequence's references dropped, the pool whole.
        evict_all(other)
        wait_idle(other)
        from shmkv.protocol import pack_i64s

        raw = RawConnection(coord.address)
        try:
            request = {"num_tokens": 0, "prompt": pack_i64s(prompt)}
            raw.send(("allocate_many", {"requests": [request], "early": True}))
            [info] = raw.wait(2)[1]
            assert info["promoting"] == 2
            raw.send(("settle", {"cache_id": info["cache_id"]}))
            deadline = time.monotonic() + 20
            while not coord._settle_waiters:
                assert time.monotonic() < deadline, "the settle never arrived"
                time.sleep(0.01)
        finally:
            raw.close()
        wait_idle(client)
        assert coord._promoting == {} and coord._settle_waiters == {}
        coord.table.check_invariants()
        assert read_prompt(client, prompt) == (len(prompt), True)


def test_settle_reports_the_shorter_hit_when_a_promoted_block_is_damaged(tmp_path, unique_name):
    cfg = make_config(num_blocks=8)
    prompt = prompts_of(1, 3)[0]
    disk = shmkv.DiskTier(tmp_path, 1 << 20)
    with tier_coordinator(cfg, unique_name, disk, clients=1) as (coord, client):
        in_tier_only(client, prompt)
        damage_block(tmp_path, prompt, 1)
        h = client.allocate(prompt=prompt, wait=False)
        assert (h.num_cached_tokens, h.num_promoting_tokens) == (len(prompt), len(prompt))
        assert h.settle() == BS == h.num_cached_tokens  # the first block only
        k, v = token_kv(prompt, 0, h.num_heads, h.head_dim)
        assert torch.equal(h.key_cache(0)[:BS], k[:BS])
        h.close()
        coord.table.check_invariants()
        assert coord._promoting == {}


def test_a_commit_after_an_early_promotion_came_up_short_publishes_nothing_past_it(
    tmp_path, unique_name
):
    """Answered early, a client may write from the promised hit on and commit without
    settling. The promotion then ends short (a damaged file): the blocks that did not
    arrive hold nobody's bytes, so none of them, nor any block after them, is published
    (another client hits only the first block, with the written bytes), whoever commits
    what, until a commit says it wrote from the first lost block (or before): the client
    that settled and wrote from the hit as it is."""
    cfg = make_config(num_blocks=8)
    prompt = prompts_of(1, 3)[0] + [7, 8]  # 3 full blocks and 2 tokens
    disk = shmkv.DiskTier(tmp_path, 1 << 20)
    with tier_coordinator(cfg, unique_name, disk, clients=2) as (coord, client, other):
        in_tier_only(client, prompt[: 3 * BS])
        damage_block(tmp_path, prompt, 1)
        h = client.allocate(prompt=prompt, wait=False)
        assert h.num_cached_tokens == 3 * BS
        deadline = time.monotonic() + 20
        while coord._promoting:  # the promotion ended (short) before anything below
            assert time.monotonic() < deadline, "the promotion never ended"
            time.sleep(0.01)
        for layer in range(h.num_layers):
            k, v = token_kv(prompt, layer, h.num_heads, h.head_dim)
            h.write(layer, k[3 * BS :].contiguous(), v[3 * BS :].contiguous(), start=3 * BS)
        h.commit(start=3 * BS)  # not settled: it believes the promised hit
        wait_idle(client)
        assert read_prompt(other, prompt) == (BS, True)
        # another holder, opened from a hand-off, that wrote from the same promise
        with other.open(h.export(ttl=30)) as opened:
            opened.commit(start=3 * BS)
        assert h.settle() == BS
        h.commit()  # (says nothing of where it wrote from)
        assert read_prompt(other, prompt) == (BS, True)
        # Settled: it writes from the hit as it is, and says so; its blocks are published.
        for layer in range(h.num_layers):
            k, v = token_kv(prompt, layer, h.num_heads, h.head_dim)
            h.write(layer, k[BS:].contiguous(), v[BS:].contiguous(), start=BS)
        h.commit(start=BS)
        assert read_prompt(other, prompt) == (3 * BS, True)
        h.close()
        coord.table.check_invariants()


def test_under_tensor_parallelism_every_rank_must_commit_from_the_lost_block(tmp_path, unique_name):
    """A short early promotion in a pool of 2 head shards: the blocks past the lost one
    are published only once both ranks committed with ``start`` at or before it."""
    cfg = make_config(num_blocks=8, num_kv_heads=4, tp_size=2)
    prompt = prompts_of(1, 3)[0]
    with (
        shmkv.Coordinator(
            cfg, name=unique_name, tiers=[shmkv.DiskTier(tmp_path, 1 << 20)]
        ) as coord,
        shmkv.connect(coord.address, timeout=20) as full,
        shmkv.connect(coord.address, tp_rank=0, tp_size=2, timeout=20) as r0,
        shmkv.connect(coord.address, tp_rank=1, tp_size=2, timeout=20) as r1,
    ):
        in_tier_only(full, prompt)
        damage_block(tmp_path, prompt, 1)
        h0 = r0.allocate(prompt=prompt, wait=False)
        assert h0.num_cached_tokens == 3 * BS
        h1 = r1.open(h0.export(ttl=30))
        assert h0.settle() == BS
        for layer in range(2):  # each rank writes its shard from the hit as it is
            k, v = token_kv(prompt, layer, 4, 8)
            h0.write(layer, k[BS:, :2].contiguous(), v[BS:, :2].contiguous(), start=BS)
            h1.write(layer, k[BS:, 2:].contiguous(), v[BS:, 2:].contiguous(), start=BS)
        h0.commit(start=BS)
        assert read_prompt(full, prompt) == (BS, True)  # rank 1 has not said so yet
        h1.commit()  # (nor here: no start)
        assert read_prompt(full, prompt) == (BS, True)
        h1.commit(start=BS)
        assert read_prompt(full, prompt) == (3 * BS, True)
        h0.close()
        h1.close()
        coord.table.check_invariants()


def test_an_older_coordinator_is_asked_to_wait(unique_name, monkeypatch):
    """A coordinator whose hello does not list "settle" (one from before it) closes the
    connection on an unknown argument: the client does not send ``early`` to it, the
    answer waits for the promotion, and ``settle`` asks nothing."""
    from shmkv import protocol

    monkeypatch.setattr(protocol, "FEATURES", ())
    cfg = make_config(num_blocks=8)
    prompt = prompts_of(1, 2)[0]
    with tier_coordinator(cfg, unique_name) as (coord, client):
        assert "settle" not in client.features
        in_tier_only(client, prompt)
        h = client.allocate(prompt=prompt, wait=False)
        assert (h.num_cached_tokens, h.num_promoting_tokens) == (len(prompt), 0)
        assert client.stats()["tier_io"]["promotions_in_flight"] == 0  # it waited
        assert h.settle() == len(prompt)
        assert "settle" not in coord.ops_by_type and client.is_alive()
        h.close()


# -- the disk tier -----------------------------------------------------------------------


def _spawn(cfg, name, path, cap=1 << 20, **kw):
    return shmkv.Coordinator.spawn(cfg, name=name, tiers=[shmkv.DiskTier(path, cap, **kw)])


def test_restart_on_the_same_directory_hits_with_exact_bytes(tmp_path, unique_name):
    cfg = make_config(num_blocks=16)
    prompts = prompts_of(4, 3)
    with _spawn(cfg, unique_name, tmp_path) as coord:
        with shmkv.connect(coord.address, timeout=20) as client:
            assert run_child(_writer, coord.address, prompts) == [0] * 4
            assert tier(wait_idle(client), "disk")["blocks"] == 12
    assert len(block_files(tmp_path)) == 12
    with _spawn(cfg, unique_name, tmp_path) as coord:
        assert run_child(_reader, coord.address, prompts) == [(12, True)] * 4
        with shmkv.connect(coord.address, timeout=20) as client:
            st = wait_idle(client)
            disk = tier(st, "disk")
            assert disk["promotions"] == 12 and disk["errors"] == 0
            assert disk["bytes"] == 12 * (tiers_mod.HEADER_SIZE + cfg.block_nbytes)


def test_a_pool_of_another_size_hits_the_blocks_it_left_on_disk(tmp_path, unique_name):
    """The directory's namespace is the block layout, not the pool: a coordinator
    restarted with more blocks, or fewer, serves the same files with exact bytes."""
    prompts = prompts_of(3, 3)
    with (
        _spawn(make_config(num_blocks=16), unique_name, tmp_path) as coord,
        shmkv.connect(coord.address, timeout=20) as client,
    ):
        assert [write_prompt(client, p) for p in prompts] == [0] * 3
        assert tier(wait_idle(client), "disk")["blocks"] == 9
    for num_blocks in (40, 12):
        with (
            _spawn(make_config(num_blocks=num_blocks), unique_name, tmp_path) as coord,
            shmkv.connect(coord.address, timeout=20) as client,
        ):
            wait_idle(client)
            assert [read_prompt(client, p) for p in prompts] == [(3 * BS, True)] * 3
            disk = tier(wait_idle(client), "disk")
            assert disk["state"] == "ready" and disk["errors"] == 0
            assert disk["promotions"] >= 9 and disk["removed_damaged"] == 0


def test_damaged_files_are_never_served_and_are_counted_and_removed(tmp_path, unique_name, caplog):
    cfg = make_config(num_blocks=16)
    prompts = prompts_of(5, 2)
    with (
        shmkv.Coordinator(
            cfg, name=unique_name, tiers=[shmkv.DiskTier(tmp_path, 1 << 20)]
        ) as coord,
        shmkv.connect(coord.address, timeout=20) as client,
    ):
        for p in prompts:
            write_prompt(client, p)
        wait_idle(client)
        keys = coord.table.pool.prefix_index.copy()
    # Blocks of another namespace (another salt), to plant under one of our names.
    other = tmp_path / "other"
    with (
        shmkv.Coordinator(
            cfg, name=unique_name, tiers=[shmkv.DiskTier(other, 1 << 20, salt=b"x")]
        ) as coord,
        shmkv.connect(coord.address, timeout=20) as client,
    ):
        write_prompt(client, prompts[4])
        wait_idle(client)
    from shmkv import hashing

    first = [hashing.block_keys(p, BS, hashing.root_key())[0].hex() + ".kv" for p in prompts]
    assert set(first) <= set(block_files(tmp_path)) and len(keys) == 10
    path = lambda name: tmp_path / "blocks" / name  # noqa: E731
    size = os.path.getsize(path(first[0]))
    os.truncate(path(first[0]), size - 100)  # truncated
    data = bytearray(path(first[1]).read_bytes())
    data[-5] ^= 0xFF  # payload damaged
    path(first[1]).write_bytes(bytes(data))
    data = bytearray(path(first[2]).read_bytes())
    data[20] ^= 0x01  # header damaged
    path(first[2]).write_bytes(bytes(data))
    os.replace(other / "blocks" / first[4], path(first[3]))  # another namespace, misnamed
    caplog.set_level(logging.WARNING, logger="shmkv.tiers")
    with (
        shmkv.Coordinator(
            cfg, name=unique_name, tiers=[shmkv.DiskTier(tmp_path, 1 << 20)]
        ) as coord,
        shmkv.connect(coord.address, timeout=20) as client,
    ):
        wait_idle(client)
        got = [read_prompt(client, p) for p in prompts]
        assert got == [(0, True)] * 4 + [(8, True)]
        st = wait_idle(client)
        disk = tier(st, "disk")
        assert disk["removed_damaged"] == 4 and disk["errors"] == 4
        assert disk["blocks"] == 6 and disk["promotions"] == 3  # one after the damaged one
    assert not set(first[:4]) & set(block_files(tmp_path))
    assert "not served and removed" in caplog.text


def test_kill_in_the_middle_of_demotion_then_restart_serves_only_complete_blocks(
    tmp_path, unique_name
):
    cfg = make_config(num_blocks=64)
    prompts = prompts_of(6, 4)
    address = shmkv.default_address(unique_name)
    q = SPAWN.Queue()
    proc = SPAWN.Process(
        target=_slow_disk_coordinator, args=(cfg.to_wire(), address, str(tmp_path), q)
    )
    proc.start()
    try:
        assert q.get(timeout=60) == "ready"
        with shmkv.connect(address, timeout=20) as client:
            for p in prompts:
                write_prompt(client, p)
            deadline = time.monotonic() + 20
            io_process = io_process_of(proc.pid)
            while not [n for n in block_files(tmp_path) if ".tmp-" in n]:
                assert time.monotonic() < deadline, "no demotion was under way"
                time.sleep(0.005)
            proc.kill()
            join_or_kill(proc, 10)
            try:  # the I/O process follows its coordinator, renaming nothing more
                io_process.wait(10)
            except psutil.TimeoutExpired:
                io_process.kill()
                pytest.fail("the tier I/O process outlived its SIGKILLed coordinator")
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        remove_stale_socket(address)
    assert not shm_entries()
    names = block_files(tmp_path)
    complete = [n for n in names if n.endswith(".kv")]
    assert [n for n in names if ".tmp-" in n] and len(complete) < 24
    with _spawn(cfg, unique_name, tmp_path, cap=1 << 24) as coord:
        got = run_child(_reader, coord.address, prompts)
        assert all(exact for _cached, exact in got)
        assert sum(cached for cached, _ in got) // BS <= len(complete)
        with shmkv.connect(coord.address, timeout=20) as client:
            disk = tier(wait_idle(client), "disk")
            assert disk["removed_incomplete"] >= 1 and disk["errors"] == 0
    assert not [n for n in block_files(tmp_path) if ".tmp-" in n]


def test_io_process_runs_niced_and_dies_with_a_killed_coordinator(tmp_path, unique_name):
    cfg = make_config(num_blocks=16)
    prompts = prompts_of(4, 3)
    specs = [shmkv.HostTier(8 * cfg.block_nbytes), shmkv.DiskTier(tmp_path, 1 << 20)]
    coord = shmkv.Coordinator.spawn(cfg, name=unique_name, tiers=specs)
    try:
        io_process = io_process_of(coord.pid)
        with shmkv.connect(coord.address, timeout=20) as client:
            assert run_child(_writer, coord.address, prompts) == [0] * 4
            wait_idle(client)
            # Its copy workers (not the urgent ones, nor the thread reading jobs) run at
            # the lowest priority.
            tids = [t.id for t in io_process.threads()]
            lowest = [
                tid
                for tid in tids
                if os.getpriority(os.PRIO_PROCESS, tid) == block_io.IO_PROCESS_NICE
            ]
            assert len(lowest) == 3  # the 2 workers and the disk writer
            if block_io.IO_PROCESS_POLICY == "idle" and hasattr(os, "SCHED_IDLE"):
                assert all(os.sched_getscheduler(tid) == os.SCHED_IDLE for tid in lowest)
            # The rest (the thread reading jobs, the urgent workers) run SCHED_BATCH: their
            # wake-ups never preempt the loop or a client.
            if hasattr(os, "SCHED_BATCH"):
                rest = [tid for tid in tids if tid not in lowest]
                assert len(rest) >= 3  # the reader and 2 urgent workers
                assert all(os.sched_getscheduler(tid) == os.SCHED_BATCH for tid in rest)
            assert io_process.is_running()
            evict_all(client)  # copies under way as the coordinator dies
        os.kill(coord.pid, signal.SIGKILL)
        coord.process.join(10)
        try:
            io_process.wait(10)
        except psutil.TimeoutExpired:
            io_process.kill()
            pytest.fail("the tier I/O process outlived its SIGKILLed coordinator")
    finally:
        if coord.process.is_alive():
            coord.process.kill()
            coord.process.join(5)
        remove_stale_socket(coord.address)
    assert not shm_entries()
    # What reached the directory is complete: a restart serves it with exact bytes.
    with _spawn(cfg, unique_name, tmp_path) as coord:
        got = run_child(_reader, coord.address, prompts)
        assert all(exact for _cached, exact in got)


def test_threads_take_over_when_the_io_process_dies(tmp_path, unique_name, caplog):
    cfg = make_config(num_blocks=16)
    prompts = prompts_of(3, 3)
    specs = [shmkv.HostTier(32 * cfg.block_nbytes), shmkv.DiskTier(tmp_path, 1 << 20)]
    caplog.set_level(logging.WARNING, logger="shmkv.tiers")
    with (
        shmkv.Coordinator(cfg, name=unique_name, tiers=specs) as coord,
        shmkv.connect(coord.address, timeout=20) as client,
    ):
        assert run_child(_writer, coord.address, prompts[:2]) == [0, 0]
        wait_idle(client)
        io_process_of(os.getpid()).kill()
        assert run_child(_writer, coord.address, prompts[2:]) == [0]
        wait_idle(client)
        assert "tier I/O process exited" in caplog.text
        assert coord.tiers._proc is None
        evict_all(client)
        wait_idle(client)
        assert run_child(_reader, coord.address, prompts) == [(12, True)] * 3
        st = wait_idle(client)
        assert st["tier_io"]["lost_evictions"] == 0
        coord.table.check_invariants()


def test_a_promotion_in_flight_when_the_io_process_dies_is_finished_by_threads(
    unique_name, monkeypatch, caplog
):
    """The I/O process is killed while it copies a promotion in (each copy slowed there):
    worker threads run the promotion's copies again, and the request is answered with
    every block a hit and its exact bytes; no entry stays pinned."""
    cfg = make_config(num_blocks=8)
    prompt = prompts_of(1, 3)[0]
    monkeypatch.setattr(tiers_mod, "IO_PROCESS_PRELOAD", tier_faults.spec("slow_h2p"))
    monkeypatch.setattr(shmkv.Client, "copy_promotions", False)  # (the I/O process copies)
    caplog.set_level(logging.WARNING, logger="shmkv.tiers")
    with (
        shmkv.Coordinator(
            cfg, name=unique_name, tiers=[shmkv.HostTier(8 * cfg.block_nbytes)]
        ) as coord,
        shmkv.connect(coord.address, timeout=30) as client,
    ):
        write_prompt(client, prompt)
        wait_idle(client, timeout=60)
        evict_all(client)
        wait_idle(client, timeout=60)
        result = {}
        thread = threading.Thread(target=lambda: result.update(got=read_prompt(client, prompt)))
        thread.start()
        deadline = time.monotonic() + 10
        while coord.tiers.num_promotions_in_flight == 0:
            assert time.monotonic() < deadline, "the promotion never started"
            time.sleep(0.01)
        io_process_of(os.getpid()).kill()
        thread.join(30)
        assert not thread.is_alive()
        assert result["got"] == (len(prompt), True)
        assert "tier I/O process exited" in caplog.text
        host = coord.tiers.host
        assert host.counters["promotions"] == 3 and host.counters["errors"] == 0
        assert all(entry.pins == 0 for entry in host.index.values())
        coord.table.check_invariants()


def test_capacities_are_respected(tmp_path, unique_name):
    cfg = make_config(num_blocks=8)
    file_nbytes = tiers_mod.HEADER_SIZE + cfg.block_nbytes
    specs = [shmkv.HostTier(5 * cfg.block_nbytes + 10), shmkv.DiskTier(tmp_path, 12 * file_nbytes)]
    with (
        shmkv.Coordinator(cfg, name=unique_name, tiers=specs) as coord,
        shmkv.connect(coord.address, timeout=20) as client,
    ):
        for p in prompts_of(10, 3):
            write_prompt(client, p)
            st = wait_idle(client)
            host, disk = tier(st, "host"), tier(st, "disk")
            assert host["blocks"] <= 5 and host["slots"] == 5
            assert disk["bytes"] <= 12 * file_nbytes
            on_disk = sum(os.path.getsize(tmp_path / "blocks" / n) for n in block_files(tmp_path))
            assert on_disk <= 12 * file_nbytes
        assert disk["dropped"] == 30 - 12 and disk["blocks"] == 12
        assert host["blocks"] == 5
    # A smaller capacity on restart trims the directory.
    with (
        shmkv.Coordinator(
            cfg, name=unique_name, tiers=[shmkv.DiskTier(tmp_path, 4 * file_nbytes)]
        ) as coord,
        shmkv.connect(coord.address, timeout=20) as client,
    ):
        disk = tier(wait_idle(client), "disk")
        assert disk["blocks"] == 4 and disk["dropped"] == 8
    assert len(block_files(tmp_path)) == 4


def test_disk_full_stops_demotion_counts_it_and_loses_nothing(
    tmp_path, unique_name, monkeypatch, io
):
    inject(monkeypatch, io, "disk_full")
    cfg = make_config(num_blocks=16)
    prompt = prompts_of(1, 3)[0]
    with (
        shmkv.Coordinator(
            cfg, name=unique_name, tiers=[shmkv.DiskTier(tmp_path, 1 << 20)]
        ) as coord,
        shmkv.connect(coord.address, timeout=20) as client,
    ):
        write_prompt(client, prompt)
        disk = tier(wait_idle(client), "disk")
        assert disk["full"] >= 1 and disk["blocks"] == 0 and disk["bytes"] == 0
        assert read_prompt(client, prompt) == (12, True)  # still in the pool
    assert block_files(tmp_path) == []


def test_other_fingerprint_or_salt_does_not_use_the_directory_and_says_why(
    tmp_path, unique_name, caplog
):
    cfg = make_config(num_blocks=16)
    prompt = prompts_of(1, 2)[0]
    with (
        shmkv.Coordinator(
            cfg, name=unique_name, tiers=[shmkv.DiskTier(tmp_path, 1 << 20)]
        ) as coord,
        shmkv.connect(coord.address, timeout=20) as client,
    ):
        write_prompt(client, prompt)
        wait_idle(client)
    before = block_files(tmp_path)
    caplog.set_level(logging.WARNING, logger="shmkv.tiers")
    for other, spec, why in (
        (
            make_config(num_blocks=16, head_dim=4),
            shmkv.DiskTier(tmp_path, 1 << 20),
            "layout fingerprint",
        ),
        (cfg, shmkv.DiskTier(tmp_path, 1 << 20, salt=b"another model"), "another salt"),
    ):
        caplog.clear()
        with (
            shmkv.Coordinator(other, name=unique_name, tiers=[spec]) as coord,
            shmkv.connect(coord.address, timeout=20) as client,
        ):
            if other is cfg:
                assert read_prompt(client, prompt) == (0, True)
            disk = tier(wait_idle(client), "disk")
            assert disk["state"].startswith("disabled") and why in disk["state"]
        assert why in caplog.text and "not used" in caplog.text
    assert block_files(tmp_path) == before


def test_bad_construction_gives_clear_errors(tmp_path, unique_name, monkeypatch):
    for cap in (0, -1):
        with pytest.raises(shmkv.InvalidArgument, match="positive"):
            shmkv.HostTier(cap)
        with pytest.raises(shmkv.InvalidArgument, match="positive"):
            shmkv.DiskTier(tmp_path, cap)
    with pytest.raises(shmkv.WrongType):
        shmkv.HostTier(1.5)
    assert shmkv.HostTier("2M").capacity_bytes == 2 << 20
    with pytest.raises(shmkv.ShmkvError, match="cannot be created"):
        shmkv.DiskTier("/proc/shmkv-no/such", 1 << 20)
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(shmkv.InvalidArgument, match="not a directory"):
        shmkv.DiskTier(tmp_path / "file", 1 << 20)
    with pytest.raises(shmkv.InvalidArgument, match="tiers must be"):
        shmkv.Coordinator(
            make_config(),
            name=unique_name,
            tiers=[shmkv.DiskTier(tmp_path, 1 << 20), shmkv.HostTier(1 << 20)],
        )
    with pytest.raises(shmkv.InvalidArgument, match="holds no block"):
        shmkv.Coordinator(make_config(), name=unique_name, tiers=[shmkv.HostTier(100)]).open()

    real_open = os.open

    def read_only(path, *args, **kw):
        if ".probe-" in str(path):
            raise OSError(errno.EROFS, "Read-only file system", path)
        return real_open(path, *args, **kw)

    with monkeypatch.context() as m:
        m.setattr(os, "open", read_only)
        with pytest.raises(shmkv.ShmkvError, match="read-only filesystem"):
            shmkv.DiskTier(tmp_path / "ro", 1 << 20)
    with monkeypatch.context() as m:
        m.setattr(tier_specs, "_free_bytes", lambda path: 0)
        with pytest.raises(shmkv.ShmkvError, match="full filesystem"):
            shmkv.DiskTier(tmp_path / "full", 1 << 20)
    # Two coordinators on one directory: the second is refused, whatever its process.
    spec = shmkv.DiskTier(tmp_path / "shared", 1 << 20)
    with shmkv.Coordinator(make_config(), name=unique_name, tiers=[spec]):
        with pytest.raises(shmkv.ShmkvError, match="in use by another coordinator"):
            shmkv.Coordinator(make_config(), name=unique_name + "b", tiers=[spec]).open()
        with pytest.raises(shmkv.ShmkvError, match="in use by another coordinator"):
            shmkv.Coordinator.spawn(make_config(), name=unique_name + "c", tiers=[spec])
    with shmkv.Coordinator(make_config(), name=unique_name, tiers=[spec]):
        pass  # free again once the first stopped


def test_stats_and_cli_show_every_tier(tmp_path, unique_name, capsys):
    from shmkv.tools import cli

    cfg = make_config(num_blocks=16)
    specs = [shmkv.HostTier(8 * cfg.block_nbytes), shmkv.DiskTier(tmp_path, 1 << 20)]
    with (
        shmkv.Coordinator(cfg, name=unique_name, tiers=specs) as coord,
        shmkv.connect(coord.address, timeout=20) as client,
    ):
        write_prompt(client, prompts_of(1, 2)[0])
        st = wait_idle(client)
        for t in st["tiers"]:
            for field in (
                "blocks",
                "bytes",
                "hits",
                "demotions",
                "promotions",
                "dropped",
                "errors",
            ):
                assert field in t
        assert cli.main(["stats", "--address", coord.address]) == 0
        out = capsys.readouterr().out
        assert "tier host" in out and "tier disk" in out and "demotions" in out


def test_cli_serve_parses_tier_flags(tmp_path):
    from shmkv.tools import cli

    assert tiers_mod.parse_size("8G") == 8 << 30 and tiers_mod.parse_size("64g") == 64 << 30
    assert tiers_mod.parse_size("1.5M") == 3 << 19 and tiers_mod.parse_size("4096") == 4096
    with pytest.raises(shmkv.InvalidArgument):
        tiers_mod.parse_size("lots")
    specs = cli.tier_specs(
        cli_args(host_tier_size=8 << 20, disk_tier=str(tmp_path), disk_tier_size=64 << 20)
    )
    assert [s.kind for s in specs] == ["host", "disk"]
    assert specs[1].capacity_bytes == 64 << 20


def cli_args(**kw):
    import argparse

    return argparse.Namespace(**kw)


@contextlib.contextmanager
def _driven_loop(unique_name, num_blocks: int, host_blocks: int):
    """A coordinator with a host tier, driven turn by turn through its own loop
    (``coord._turn(selector)``), with one connection (id 7) made of a socket pair:
    yields ``(coord, selector, theirs)``, ``theirs`` the client's end."""
    import selectors
    import socket

    from shmkv.coordinator.connections import _Conn, make_selector

    cfg = make_config(num_blocks=num_blocks)
    coord = shmkv.Coordinator(
        cfg, name=unique_name, tiers=[shmkv.HostTier(host_blocks * cfg.block_nbytes)]
    )
    coord.open()
    selector = make_selector()
    mine, theirs = socket.socketpair()
    try:
        mine.setblocking(False)
        conn = _Conn(mine, 7, os.getpid(), coord.max_frame)
        conn.greeted = True
        coord._conns[7] = conn
        coord.table.add_connection(7)
        selector.register(mine, selectors.EVENT_READ, conn)
        selector.register(coord._wake_r, selectors.EVENT_READ, None)
        yield coord, selector, theirs
    finally:
        selector.close()
        theirs.close()
        coord.close()


def test_a_promotion_pins_its_entries_before_its_turn_places_demotions(unique_name, monkeypatch):
    """A client's release and its next allocate arrive in one loop turn (two frames of
    one read, as after ``close_many(..., wait=False)``); the release's blocks are demoted
    into a full host tier that turn, whose oldest entries are the very ones the allocate
    hits. The hit holds: the promotion pins its entries before the turn places demotions.
    Driven turn by turn through the coordinator's own loop, with copies in its threads."""
    import socket

    from shmkv import protocol

    monkeypatch.setattr(tiers_mod, "IO_PROCESS", False)
    with _driven_loop(unique_name, num_blocks=8, host_blocks=4) as (coord, selector, theirs):
        table, tiers = coord.table, coord.tiers
        p, q, r = prompts_of(3, 2)
        for prompt in (p, q):  # p demoted first: the oldest entries of the full host tier
            info = table.allocate(7, prompt=prompt)
            table.commit(7, info["cache_id"], len(prompt))
            table.release(7, info["cache_id"])
            _settle(tiers)
        ids, _ = table.allocate_counts(7, [8 * BS])  # evicts p and q from the pool
        table.release_many(7, ids.tolist())
        held = table.allocate(7, prompt=r)
        table.commit(7, held["cache_id"], len(r))  # published, still held
        _settle(tiers)
        assert len(tiers.host.index) == 4
        theirs.sendall(
            protocol.encode_request(
                1, "release_many", {"ids": protocol.pack_i64s([held["cache_id"]])}
            )
            + protocol.encode_request(
                2,
                "allocate_many",
                {"requests": [{"num_tokens": 0, "prompt": protocol.pack_i64s(p)}]},
            )
        )
        decoder, answers = protocol.FrameDecoder(), {}
        deadline = time.monotonic() + 20
        theirs.settimeout(0.01)
        while len(answers) < 2:
            coord._turn(selector)
            try:
                data = theirs.recv(1 << 16)
            except socket.timeout:
                data = b""
            for obj in decoder.feed(data):
                response = protocol.parse_response(obj)
                answers[response.request_id] = response.unwrap()
            assert time.monotonic() < deadline, f"answers so far: {answers}"
        assert answers[2][0]["num_cached"] == len(p)  # both blocks came from the tier
        assert tiers.host.counters["hits"] >= 2
        table.check_invariants()


def test_job_frames_of_columns_and_of_copies_are_the_same_and_come_back():
    """A promotion's job packed from columns is byte for byte the job of the same
    ``Copy`` objects, and decodes to them in the I/O process; its completion comes back
    on the loop's job as one status a copy plus the error text of each failed one, and on
    a job of copies as their outcomes. A completion of no job in flight is refused."""
    ops = [block_io.OP_H2P, block_io.OP_D2P, block_io.OP_NONE]
    blocks, slots, keys = [5, 7, 9], [2, -1, -1], [b"a" * 16, b"b" * 16, b"c" * 16]
    frame = block_io.encode_columns(42, block_io.PROMOTE, ops, blocks, slots, [0, 0, 0], keys)
    copies = [
        block_io.Copy(block_io.OPS[op], key, block=block, slot=slot)
        for op, block, slot, key in zip(ops, blocks, slots, keys)
    ]
    assert block_io.encode_job(block_io.PROMOTE, block_io.Job(copies, job_id=42)) == frame
    (body,) = block_io.split_frames(bytearray(frame))
    queue, job = block_io.decode_job(body)
    assert queue == block_io.PROMOTE and job.job_id == 42
    assert [(c.op, c.block, c.slot, c.key) for c in job.copies] == [
        ("h2p", 5, 2, b"a" * 16),
        ("d2p", 7, -1, b"b" * 16),
        ("none", 9, -1, b"c" * 16),
    ]
    job.copies[0].ok = True  # the I/O process ran them: in, damaged,
    job.copies[1].damaged, job.copies[1].error = True, "payload checksum"  # cancelled
    (done,) = block_io.split_frames(bytearray(block_io.encode_done(job)))
    columns = block_io.Job(None, "promotion", job_id=42, num_copies=3)
    assert block_io.apply_done(done, {42: columns}) is columns
    assert columns.statuses == bytes([block_io.OK, block_io.DAMAGED, block_io.CANCELLED])
    assert columns.errors == {1: "payload checksum"}
    mine = [block_io.Copy(c.op, c.key, block=c.block, slot=c.slot) for c in job.copies]
    block_io.apply_done(done, {42: block_io.Job(mine, job_id=42)})
    assert [(c.ok, c.damaged, c.error) for c in mine] == [
        (True, False, None),
        (False, True, "payload checksum"),
        (False, False, None),
    ]
    with pytest.raises(ValueError):
        block_io.apply_done(done, {})  # no such job in flight
    with pytest.raises(ValueError):
        block_io.apply_done(done, {42: block_io.Job(None, job_id=42, num_copies=2)})
    # A long job is framed the same way, without keeping a Struct of its size.
    n = block_io._JOB_FRAMES_MAX + 1
    long_frame = block_io.encode_columns(
        43,
        block_io.DEMOTE,
        [block_io.OP_H2P] * n,
        list(range(n)),
        [-1] * n,
        [0] * n,
        [b"k" * 16] * n,
    )
    (long_body,) = block_io.split_frames(bytearray(long_frame))
    assert [c.block for c in block_io.decode_job(long_body)[1].copies] == list(range(n))
    assert n not in block_io._JOB_FRAMES


@pytest.mark.parametrize("iov_max", [block_io.IOV_MAX, 3])
def test_a_block_file_reads_straight_into_the_pools_strided_rows(tmp_path, monkeypatch, iov_max):
    """A block read from disk into its place in a layer-major pool: one row per layer's K
    or V, the rows a pool's worth of chunks apart, more rows than one preadv may take
    when ``IOV_MAX`` is small. Bytes and checksum as written, the other blocks' rows
    untouched; a damaged file is refused."""
    import numpy as np

    monkeypatch.setattr(block_io, "IOV_MAX", iov_max)
    rows, chunk, num_blocks = 8, 48, 5
    files = block_io.BlockFiles(
        str(tmp_path), "s1", b"n" * 16, (4, 4, 2, 3, 1, b"f4"), rows * chunk, fsync=False
    )
    payload = np.random.default_rng(0).integers(0, 256, rows * chunk, dtype=np.uint8)
    files.write_block(b"k" * 16, payload)
    pool = np.zeros((rows, num_blocks, chunk), dtype=np.uint8).transpose(1, 0, 2)
    files.read_block(b"k" * 16, pool[3])
    assert np.array_equal(pool[3].reshape(-1), payload)
    assert not pool[[0, 1, 2, 4]].any()
    with open(files.file_path(b"k" * 16), "r+b") as f:  # one payload byte flipped
        f.seek(block_io.HEADER_SIZE + 5 * chunk + 7)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(block_io.Damaged, match="checksum"):
        files.read_block(b"k" * 16, pool[1])


@pytest.mark.parametrize("short", [False, True])
def test_block_file_io_moves_at_most_io_chunk_bytes_a_call(tmp_path, monkeypatch, short):
    """No read or write of a block file moves more than ``IO_CHUNK`` bytes in one system
    call (the kernel does not preempt a thread inside one), rows straight into a strided
    pool included; with ``short``, every call moves fewer bytes than asked (as a signal
    or a full pipe may make it), and the bytes still arrive whole and in order."""
    import numpy as np

    monkeypatch.setattr(block_io, "IO_CHUNK", 100)
    rows, chunk, num_blocks = 8, 48, 3
    files = block_io.BlockFiles(
        str(tmp_path), "s1", b"n" * 16, (4, 4, 2, 3, 1, b"f4"), rows * chunk, fsync=False
    )
    calls = []

    def wrap(real):
        def call(fd, buffers, offset):
            asked = sum(len(b) for b in buffers)
            calls.append(asked)
            if short and asked > 1:  # move only part of the last buffer asked for
                cut = list(buffers[:-1]) + [buffers[-1][: max(1, len(buffers[-1]) // 2)]]
                return real(fd, cut, offset)
            return real(fd, buffers, offset)

        return call

    monkeypatch.setattr(block_io.os, "pwritev", wrap(os.pwritev))
    monkeypatch.setattr(block_io.os, "preadv", wrap(os.preadv))
    payload = np.random.default_rng(1).integers(0, 256, rows * chunk, dtype=np.uint8)
    files.write_block(b"k" * 16, payload)
    written = list(calls)
    assert os.path.getsize(files.file_path(b"k" * 16)) == block_io.HEADER_SIZE + rows * chunk
    calls.clear()
    pool = np.zeros((rows, num_blocks, chunk), dtype=np.uint8).transpose(1, 0, 2)
    files.read_block(b"k" * 16, pool[1])
    assert np.array_equal(pool[1].reshape(-1), payload)
    assert not pool[[0, 2]].any()
    flat = np.zeros(rows * chunk, dtype=np.uint8)
    files.read_block(b"k" * 16, flat)
    assert np.array_equal(flat, payload)
    total = block_io.HEADER_SIZE + rows * chunk
    for sizes in (written, calls):
        assert sizes and max(sizes) <= 100
        assert len(sizes) >= -(-total // 100)


# -- demotion under load: bursts, backlog, eviction preference ------------------------------


def keys_of(prompt) -> list:
    from shmkv import hashing

    return hashing.block_keys(prompt, BS, hashing.root_key())


def written_prompt(client, prompt):
    """A handle on ``prompt``, written and committed, still open."""
    h = client.allocate(prompt=prompt)
    for layer in range(h.num_layers):
        k, v = token_kv(prompt, layer, h.num_heads, h.head_dim)
        h.write(layer, k, v, start=0)
    h.commit()
    return h


def _released_prompt(table, prompt) -> None:
    """``prompt`` allocated, committed and released through the table: its blocks are
    cached, and the next tick places them down the tiers."""
    info = table.allocate(7, prompt=prompt)
    table.commit(7, info["cache_id"], len(prompt))
    table.release(7, info["cache_id"])


def _settle(tiers, deadline_s=20.0) -> None:
    deadline = time.monotonic() + deadline_s
    tiers.tick()
    while tiers.num_pending or tiers.num_promotions_in_flight:
        assert time.monotonic() < deadline, "tier copies never finished"
        time.sleep(0.005)
        tiers.tick()


def test_blocks_cached_and_not_placed_yet_are_pending(unique_name, monkeypatch):
    """Blocks a release cached, before the turn that places them, count as pending (the
    stats' ``"pending"``): the loop may serve a request before that turn, and a caller
    that waits for the tiers to be idle (the pool model test, ``shmkv stress``) must not
    see them idle while which blocks the next allocation evicts still depends on when
    the turn comes (those not placed yet are evicted last)."""
    with _threaded_tiers(monkeypatch, unique_name, 48, host_blocks=48) as (table, tiers):
        (prompt,) = prompts_of(1, 6, seed=33)
        _released_prompt(table, prompt)
        assert len(tiers.pool.newly_cached) == 6  # (no turn yet)
        assert tiers.num_pending == 6 and tiers.io_stats()["pending"] == 6
        _settle(tiers)
        assert not tiers.pool.newly_cached and tiers.num_pending == 0
        assert tiers.lookup(keys_of(prompt)) == 6


def test_placing_stops_every_chunk_a_client_waits_and_goes_on_next_turn(unique_name, monkeypatch):
    """A released 20-block prompt is placed ``PLACE_CHUNK`` blocks at a time: while a
    client waits, the tick stops after the first chunk, the rest waits in the backlog
    (where the pool evicts it last), and the loop must not sleep; the next tick, with
    nobody waiting, places the rest, and the host tier ends up with every block."""
    monkeypatch.setattr(tiers_mod, "IO_PROCESS", False)
    chunk = tiers_mod.PLACE_CHUNK
    cfg = make_config(num_blocks=24)
    # Opened, not serving: a loop thread woken by the first copies would tick meanwhile.
    coord = shmkv.Coordinator(cfg, name=unique_name, tiers=[shmkv.HostTier(24 * cfg.block_nbytes)])
    coord.open()
    try:
        table, tiers = coord.table, coord.tiers
        table.add_connection(7)
        prompt = prompts_of(1, 20, seed=21)[0]
        _released_prompt(table, prompt)
        asked = []

        def waiting() -> bool:
            asked.append(len(tiers._demotion._backlog))
            return True

        tiers.tick(waiting=waiting)
        assert asked == [0]  # one look, after a chunk, before anything waited
        assert len(tiers._demotion._backlog) == 20 - (chunk - 1)
        # evicted last
        assert all(tiers._demotion._reading[b] is None for b in tiers._demotion._backlog)
        assert tiers.max_wait() == 0.0
        placed_first = [b for b in tiers._demotion._reading if b not in tiers._demotion._backlog]
        # a prefix's first blocks are placed first (released last-first, placed reversed)
        seq_blocks = [table.pool.prefix_index[k] for k in keys_of(prompt)]
        assert sorted(placed_first) == sorted(seq_blocks[: chunk - 1])
        tiers.tick(waiting=lambda: False)
        assert not tiers._demotion._backlog
        assert tiers.max_wait() != 0.0
        _settle(tiers)
        assert tiers.lookup(keys_of(prompt)) == 20
        assert tiers.num_lost_evictions == 0
        # Nobody asking (waiting None): everything in one tick, as before.
        other = prompts_of(1, 3, seed=22)[0]
        _released_prompt(table, other)
        tiers.tick()
        assert not tiers._demotion._backlog and tiers.max_wait() != 0.0
        _settle(tiers)
        assert tiers.lookup(keys_of(other)) == 3
        table.check_invariants()
    finally:
        coord.close()


@contextlib.contextmanager
def _threaded_tiers(monkeypatch, name, num_blocks, host_blocks=0, disk_dir=None):
    """A coordinator opened, not served (a loop thread would tick meanwhile), its tier
    copies in threads of this process: ``(table, tiers)``, connection 7 added."""
    monkeypatch.setattr(tiers_mod, "IO_PROCESS", False)
    cfg = make_config(num_blocks=num_blocks)
    specs = [shmkv.HostTier(host_blocks * cfg.block_nbytes)] if host_blocks else []
    if disk_dir is not None:
        specs.append(shmkv.DiskTier(str(disk_dir), 1 << 30))
    coord = shmkv.Coordinator(cfg, name=name, tiers=specs)
    coord.open()
    try:
        coord.table.add_connection(7)
        yield coord.table, coord.tiers
    finally:
        coord.close()


class _Gate:
    """Holds one kind of copy (``Mover._op_<op>``) until :meth:`open` (or the end of its
    ``with``): before the copy runs, or with ``after`` once it ran (its completion not
    handed back yet); ``only(copy)`` picks which copies wait. Enter it after the
    coordinator, so that it opens before the coordinator waits for its copies."""

    def __init__(self, monkeypatch, op, after=False, only=None):
        self._open = threading.Event()
        self._entered = threading.Semaphore(0)
        run = getattr(block_io.Mover, "_op_" + op)

        def held(mover, copy):
            if only is not None and not only(copy):
                return run(mover, copy)
            if after:
                run(mover, copy)
            self._entered.release()
            assert self._open.wait(20), "the test never opened the gate"
            if not after:
                run(mover, copy)

        monkeypatch.setattr(block_io.Mover, "_op_" + op, held)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.open()

    def open(self):
        self._open.set()

    def wait_entered(self):
        assert self._entered.acquire(timeout=10), "no copy reached the gate"


def _settled_balance(tiers, table) -> None:
    """Every slot, byte and file accounted for once nothing is in flight."""
    host, disk, staging = tiers.host, tiers.disk, tiers._staging
    assert (
        tiers.num_pending == 0
        and tiers._demotion._disk_in_flight == 0
        and not tiers._demotion._reading
    )
    if host is not None:
        assert all(e.ready for e in host.index.values())
        assert len(host.free) + len(host.index) == host.num_slots
    if disk is not None:
        assert disk.bytes == len(disk.index) * disk.file_nbytes
        files = {bytes.fromhex(n[:32]) for n in os.listdir(disk.blocks_dir) if n.endswith(".kv")}
        assert files == set(disk.index)
    if staging is not None:
        assert len(staging.free) == staging.num_slots
    table.check_invariants()


@pytest.mark.parametrize("kind", ["host", "disk"])
def test_released_blocks_a_tier_holds_already_are_touched_not_placed(
    kind, unique_name, monkeypatch, tmp_path
):
    """A prompt whose blocks the first tier holds (promoted, or placed before) released
    again: the tick copies nothing, puts nothing in the backlog and looks at no socket
    for them, even with a client waiting; each entry becomes the tier's most recently
    used, a prefix's first block first."""
    host_blocks, disk_dir = (48, None) if kind == "host" else (0, tmp_path / "disk")
    with _threaded_tiers(monkeypatch, unique_name, 48, host_blocks, disk_dir) as (table, tiers):
        prompt, other = prompts_of(2, 20, seed=24)
        _released_prompt(table, prompt)
        _settle(tiers)
        _released_prompt(table, other)
        _settle(tiers)
        store = tiers.host if kind == "host" else tiers.disk
        assert list(store.index)[-20:] == keys_of(other)
        _released_prompt(table, prompt)  # pool hits: the same blocks, cached again
        asked = []

        def waiting() -> bool:
            asked.append(len(tiers._demotion._backlog))
            return True

        tiers.tick(waiting=waiting)
        assert asked == [] and not tiers._demotion._backlog and not tiers._demotion._reading
        assert tiers.num_pending == 0 and tiers.max_wait() != 0.0
        assert list(store.index)[-20:] == keys_of(prompt)
        assert tiers.lookup(keys_of(prompt)) == 20
        table.check_invariants()


def test_a_key_lost_mid_demotion_is_placed_again_when_published_again(unique_name, monkeypatch):
    """Blocks evicted while their copies to the host tier are still running, with no
    slot to rescue them into, are lost; the entries those copies were filling go with
    them. The same keys published again in other blocks and released are placed as
    any new block (the backlog while the cancelled copies hold the slots, then copied),
    not taken for held by the tier; the host tier ends up with them."""
    with (
        _threaded_tiers(monkeypatch, unique_name, 4, host_blocks=2) as (table, tiers),
        _Gate(monkeypatch, "p2h") as gate,
    ):
        prompt = prompts_of(1, 2, seed=31)[0]
        _released_prompt(table, prompt)
        tiers.tick()  # both blocks copying, both host slots taken
        assert len(tiers._demotion._reading) == 2 and not tiers.host.free
        other = table.allocate(7, num_tokens=4 * BS)  # evicts both: no slot to rescue into
        assert tiers.num_lost_evictions == 2
        assert not any(key in tiers.host.index for key in keys_of(prompt))
        table.release(7, other["cache_id"])
        _released_prompt(table, prompt)  # the same keys, published in other blocks
        tiers.tick()
        assert len(tiers._demotion._backlog) == 2  # to be placed once the slots come back
        gate.open()
        _settle(tiers)
        assert tiers.lookup(keys_of(prompt)) == 2
        assert tiers.num_lost_evictions == 2
        _settled_balance(tiers, table)


@pytest.mark.parametrize("op", ["p2d", "p2s"])
def test_a_key_lost_mid_demotion_to_disk_is_placed_again(op, unique_name, monkeypatch, tmp_path):
    """The disk's side of the test above: demotions straight from the pool (``p2d``)
    or through staging slots (``p2s``), held in flight; the blocks evicted with no
    staging slot left to rescue them into are lost, their disk entries and the room
    reserved for them dropped; published again, they are written, and the disk tier
    ends up with every key, its byte count that of its files."""
    monkeypatch.setattr(tiers_mod, "DIRECT_DISK_DEMOTION", op == "p2d")
    monkeypatch.setattr(tiers_mod, "STAGING_BLOCKS", 1 if op == "p2d" else 2)
    monkeypatch.setattr(tiers_mod, "STAGING_RESCUE", 0)
    with (
        _threaded_tiers(monkeypatch, unique_name, 4, disk_dir=tmp_path / "disk") as (table, tiers),
        _Gate(monkeypatch, op) as gate,
    ):
        disk = tiers.disk
        prompt = prompts_of(1, 2, seed=32)[0]
        _released_prompt(table, prompt)
        tiers.tick()
        assert len(tiers._demotion._reading) == 2
        other = table.allocate(7, num_tokens=4 * BS)
        lost = 1 if op == "p2d" else 2  # (p2d: one rescued through the staging slot)
        assert tiers.num_lost_evictions == lost
        assert sum(key not in disk.index for key in keys_of(prompt)) == lost
        assert disk.bytes == (2 - lost) * disk.file_nbytes
        table.release(7, other["cache_id"])
        _released_prompt(table, prompt)
        tiers.tick()
        gate.open()
        _settle(tiers)
        assert tiers.lookup(keys_of(prompt)) == 2
        assert len(disk.index) == 2
        _settled_balance(tiers, table)


@pytest.mark.parametrize("op", ["p2d", "p2s"])
def test_a_block_rescued_to_the_host_over_a_cancelled_disk_copy_still_spills(
    op, unique_name, monkeypatch, tmp_path
):
    """A block on its way to disk (the host tier full) is evicted once a host slot is
    free: rescued into the host tier. Its cancelled disk copy's completion drops the
    disk entry, and queues the key to spill: the disk keeps every key the host tier
    has, so the host tier, needing the slot later, can drop it (it is on disk)."""
    monkeypatch.setattr(tiers_mod, "DIRECT_DISK_DEMOTION", op == "p2d")
    disk_dir = tmp_path / "disk"
    with (
        _threaded_tiers(monkeypatch, unique_name, 2, 1, disk_dir) as (table, tiers),
        _Gate(monkeypatch, "p2h", only=lambda copy: copy.slot == 0) as to_host,
        _Gate(monkeypatch, op) as to_disk,
    ):
        a, b = prompts_of(2, 1, seed=41)
        _released_prompt(table, a)
        tiers.tick()  # a: into the only host slot (held)
        _released_prompt(table, b)
        tiers.tick()  # b: to disk (held)
        kb = keys_of(b)[0]
        assert kb in tiers.disk.index and not tiers.host.free
        first = table.allocate(7, num_tokens=BS)  # evicts a: rescued to a staging slot
        to_host.open()  # a's cancelled copy gives the host slot back
        deadline = time.monotonic() + 10
        while not tiers.host.free:
            assert time.monotonic() < deadline, "the host slot never came back"
            time.sleep(0.005)
            tiers.tick()
        second = table.allocate(7, num_tokens=BS)  # evicts b: rescued into that slot
        assert tiers.num_rescued_evictions == 2 and tiers.num_lost_evictions == 0
        assert tiers.host.index[kb].ready
        to_disk.open()
        _settle(tiers)
        assert kb in tiers.disk.index and tiers.disk.index[kb].ready
        table.release(7, first["cache_id"])
        table.release(7, second["cache_id"])
        _released_prompt(table, prompts_of(1, 1, seed=43)[0])  # takes the host slot
        _settle(tiers)
        assert tiers.lookup(keys_of(b)) == 1
        _settled_balance(tiers, table)


def test_a_block_file_written_before_its_copy_was_cancelled_is_removed(
    unique_name, monkeypatch, tmp_path
):
    """A copy to disk that renamed its file in, then saw its block evicted (and lost)
    before its completion came back: the file goes too, so the files on disk are
    exactly the disk tier's entries, and its byte count theirs."""
    monkeypatch.setattr(tiers_mod, "DIRECT_DISK_DEMOTION", True)
    monkeypatch.setattr(tiers_mod, "STAGING_BLOCKS", 1)
    monkeypatch.setattr(tiers_mod, "STAGING_RESCUE", 0)
    with (
        _threaded_tiers(monkeypatch, unique_name, 2, disk_dir=tmp_path / "disk") as (table, tiers),
        _Gate(monkeypatch, "p2d", after=True) as gate,
    ):
        prompt = prompts_of(1, 2, seed=51)[0]
        _released_prompt(table, prompt)
        tiers.tick()  # both to disk, one after the other
        gate.wait_entered()  # the first block's file is in place, its completion held
        other = table.allocate(7, num_tokens=2 * BS)  # one rescued (the staging slot), one lost
        assert tiers.num_lost_evictions == 1 and tiers.num_rescued_evictions == 1
        assert keys_of(prompt)[0] not in tiers.disk.index
        gate.open()
        _settle(tiers)
        table.release(7, other["cache_id"])
        _settle(tiers)
        _settled_balance(tiers, table)


def test_blocks_released_and_evicted_in_one_turn_are_rescued(unique_name, monkeypatch):
    """Blocks cached and evicted before the tiers' next turn looks at them (a release
    and another client's allocation served in the same turn): not placed yet, so not
    safe; rescued into the host tier's free slots, not lost."""
    with _threaded_tiers(monkeypatch, unique_name, 2, host_blocks=8) as (table, tiers):
        prompt = prompts_of(1, 2, seed=61)[0]
        _released_prompt(table, prompt)  # cached; no tick yet
        other = table.allocate(7, num_tokens=2 * BS)  # the same turn: evicts both
        assert tiers.num_lost_evictions == 0 and tiers.num_rescued_evictions == 2
        assert tiers.lookup(keys_of(prompt)) == 2
        tiers.tick()
        table.release(7, other["cache_id"])
        _settle(tiers)
        assert tiers.lookup(keys_of(prompt)) == 2
        _settled_balance(tiers, table)


def test_an_allocation_keeps_the_tier_entries_its_plan_promotes(unique_name, monkeypatch):
    """An allocation whose plan promotes a key from the host tier, and whose fresh block
    evicts a block not copied yet: the rescue of that block may not drop the planned
    key's entry to make room (the promotion would find nothing and the hit shrink). The
    planned hit is served; the evicted block, with no room left, is counted lost."""
    monkeypatch.setattr(tiers_mod, "PLACE_CHUNK", 1)
    with _threaded_tiers(monkeypatch, unique_name, 1, host_blocks=1) as (table, tiers):
        a, b = prompts_of(2, 1, seed=71)
        _released_prompt(table, a)
        _settle(tiers)  # a's key in the only host slot
        _released_prompt(table, b)  # evicts a (safe in the host tier), b cached
        tiers.tick(waiting=lambda: True)  # a client waits: b stays in the backlog
        assert tiers._demotion._backlog and tiers.lookup(keys_of(a)) == 1
        info = table.allocate(7, prompt=a)  # its fresh block evicts b: a rescue, no room
        records = table.take_promotions()
        assert records and tiers.num_rescued_evictions == 0 and tiers.num_lost_evictions == 1
        promotion = tiers.promote(records)
        assert list(promotion.ops) == [block_io.OP_H2P]
        _settle(tiers)
        assert table._refs.held(7, info["cache_id"]).num_cached == len(a)
        tiers.tick()  # the plan is forgotten: the entry may make room again
        assert not tiers._demotion._planned
        table.check_invariants()


def test_the_pool_evicts_blocks_safe_in_a_tier_before_those_just_cached():
    """``BlockPool`` alone: with ``newly_cached`` collecting, the blocks cached since it was
    last taken go after every other cached block, oldest first among them."""
    from shmkv.coordinator.allocator import BlockPool

    pool = BlockPool(4)
    ids = pool.allocate(4, 1)
    for i, block in enumerate(ids):
        assert pool.publish(block, bytes([i]) * 16)
    pool.decref(ids[:2])  # cached before collecting: safe
    pool.newly_cached = {}
    pool.decref(ids[2:])  # cached since: in newly_cached
    assert list(pool.newly_cached) == ids[2:]
    got = pool.allocate(3, 2)
    assert got[:3] == [ids[0], ids[1], ids[2]]  # the safe ones first, then the oldest new
    pool.check_invariants()


def test_a_request_that_comes_while_the_loop_places_is_served_before_the_rest(
    unique_name, monkeypatch
):
    """Through the coordinator's own turns: a ping arrives while the turn places a
    released prompt's blocks; that turn stops placing after a chunk, the next one
    (taken without sleeping) answers the ping and then places the rest."""
    from shmkv import protocol

    monkeypatch.setattr(tiers_mod, "IO_PROCESS", False)
    with _driven_loop(unique_name, num_blocks=24, host_blocks=24) as (coord, selector, theirs):
        table, tiers = coord.table, coord.tiers
        prompt = prompts_of(1, 20, seed=23)[0]
        _released_prompt(table, prompt)
        place = tiers._demotion._place
        sent = []

        def place_and_ping(block, key, queued=False):
            if not sent:  # the ping arrives while the first block is placed
                theirs.sendall(protocol.encode_request(1, "ping", {}))
                sent.append(block)
            return place(block, key, queued)

        monkeypatch.setattr(tiers._demotion, "_place", place_and_ping)
        coord._wake_w.send(b"t")  # (the turn takes the tiers' turn without waiting)
        coord._turn(selector)
        assert sent and tiers._demotion._backlog  # stopped placing for the ping
        theirs.settimeout(0.0)
        with pytest.raises(BlockingIOError):
            theirs.recv(1 << 16)  # not answered yet
        assert tiers.max_wait() == 0.0
        began = time.monotonic()
        coord._turn(selector)  # did not sleep: the ping, then the rest
        theirs.settimeout(5.0)
        (obj,) = list(protocol.FrameDecoder().feed(theirs.recv(1 << 16)))
        assert protocol.parse_response(obj).request_id == 1
        # The first chunks' copies (worker threads) may finish meanwhile: their wake-up
        # stops the placing again, for a turn that does not sleep either.
        for _ in range(8):
            if not tiers._demotion._backlog:
                break
            coord._turn(selector)
        assert time.monotonic() - began < 0.2
        assert not tiers._demotion._backlog
        _settle(tiers)
        assert tiers.lookup(keys_of(prompt)) == 20
        table.check_invariants()


def test_a_burst_past_the_disk_writes_in_flight_reaches_disk_head_first(tmp_path, unique_name):
    """A 300-block prompt cached in one turn is more than the disk writes in flight
    (``MAX_DISK_WRITES_IN_FLIGHT``): the rest waits in the backlog and is written as
    writes finish, the prompt's first blocks first, so a restarted coordinator hits
    the whole prompt."""
    assert tiers_mod.MAX_DISK_WRITES_IN_FLIGHT < 300
    cfg = make_config(num_blocks=320)
    prompt = prompts_of(1, 300)[0]
    with (
        _spawn(cfg, unique_name, tmp_path) as coord,
        shmkv.connect(coord.address, timeout=20) as client,
    ):
        assert write_prompt(client, prompt) == 0
        disk = tier(wait_idle(client, timeout=60), "disk")
        assert disk["blocks"] == 300 and disk["demotions"] == 300
    assert len(block_files(tmp_path)) == 300
    with (
        _spawn(cfg, unique_name, tmp_path) as coord,
        shmkv.connect(coord.address, timeout=20) as client,
    ):
        wait_idle(client)
        assert read_prompt(client, prompt) == (1200, True)


def test_a_burst_past_the_host_slots_and_the_disk_writes_keeps_the_prefix_head(
    tmp_path, unique_name, io
):
    """HostTier(64 slots) + DiskTier, 340 blocks cached in one turn: more than the host
    slots and the disk writes in flight together. Block 0 (and every block) reaches a
    tier, and the disk ends up with all of them."""
    cfg = make_config(num_blocks=360)
    prompt = prompts_of(1, 340)[0]
    specs = [shmkv.HostTier(64 * cfg.block_nbytes), shmkv.DiskTier(tmp_path, 1 << 22)]
    with (
        shmkv.Coordinator(cfg, name=unique_name, tiers=specs) as coord,
        shmkv.connect(coord.address, timeout=20) as client,
    ):
        write_prompt(client, prompt)
        st = wait_idle(client, timeout=60)
        keys = keys_of(prompt)
        assert coord.tiers.lookup(keys[:1]) == 1  # block 0 is on a tier
        assert coord.tiers.lookup(keys) == 340
        assert tier(st, "disk")["blocks"] == 340
        assert tier(st, "host")["blocks"] == 64
        assert tier(st, "host")["dropped"] == 0
        coord.table.check_invariants()


def test_close_many_of_512_blocks_writes_all_512(tmp_path, unique_name, io):
    """64 requests of 8 blocks released by one ``close_many``: all 512 blocks are
    written to disk (256 in flight at once, the rest as writes finish)."""
    cfg = make_config(num_blocks=520)
    prompts = prompts_of(64, 8, seed=3)
    with (
        shmkv.Coordinator(
            cfg, name=unique_name, tiers=[shmkv.DiskTier(tmp_path, 1 << 22)]
        ) as coord,
        shmkv.connect(coord.address, timeout=20) as client,
    ):
        handles = [written_prompt(client, p) for p in prompts]
        client.close_many(handles)
        st = wait_idle(client, timeout=60)
        disk = tier(st, "disk")
        assert disk["demotions"] == 512 and disk["blocks"] == 512
        assert len(block_files(tmp_path)) == 512
        assert all(coord.tiers.lookup(keys_of(p)) == 8 for p in prompts)


@pytest.mark.parametrize("kinds", ["host", "disk", "disk, staged"])
def test_a_pool_filled_back_to_back_keeps_its_first_prompt_on_a_tier(
    tmp_path, unique_name, kinds, io, monkeypatch
):
    """A 16-block pool filled back to back, from the moment the coordinator opens, by 8
    prompts of 3 blocks (the pool evicts 8 blocks): prompt 0 ends up on a tier. Its
    copies must not wait for the tier I/O process to start, and eviction takes blocks
    already safe in a tier first. Any block evicted before its copy finished is counted."""
    cfg = make_config(num_blocks=16)
    spec = (
        shmkv.HostTier(64 * cfg.block_nbytes)
        if kinds == "host"
        else shmkv.DiskTier(tmp_path, 1 << 20)
    )
    if kinds == "disk, staged":  # as off x86 (block_io: memory ordering)
        monkeypatch.setattr(tiers_mod, "DIRECT_DISK_DEMOTION", False)
    prompts = prompts_of(8, 3, seed=5)
    with (
        shmkv.Coordinator(cfg, name=unique_name, tiers=[spec]) as coord,
        shmkv.connect(coord.address, timeout=20) as client,
    ):
        for p in prompts:
            write_prompt(client, p)
        st = wait_idle(client)
        assert st["evictions"] == 8
        on_tier = [coord.tiers.lookup(keys_of(p)) for p in prompts]
        in_pool = [len(coord.table.pool.lookup(keys_of(p))) for p in prompts]
        assert on_tier[0] == 3, (on_tier, in_pool, st["tier_io"])
        # Nothing silent: every block is in the pool, on the tier, or counted lost.
        lost = sum(3 - max(t, c) for t, c in zip(on_tier, in_pool))
        assert lost == st["tier_io"]["lost_evictions"]
        from shmkv.coordinator import metrics  # and the counters are exported

        series = {name: samples for name, _kind, _doc, samples in metrics.families(coord)}
        for name in ("lost", "rescued"):
            (sample,) = series[f"shmkv_tier_{name}_evictions"]
            assert sample[0] == f"shmkv_tier_{name}_evictions_total"
            assert sample[2] == st["tier_io"][f"{name}_evictions"]
        assert read_prompt(client, prompts[0]) == (12, True)


# -- a disk tier directory that is not to be trusted, or damaged ----------------------------


def test_a_directory_writable_by_others_or_owned_by_another_user_is_refused(tmp_path, unique_name):
    """Whoever can write into a disk tier directory decides what is served from it: a
    directory of mode 0777, or owned by another uid, is refused with the path and what
    to do, both as the tier is made and when a coordinator opens it."""
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)
    with pytest.raises(shmkv.ShmkvError, match="writable by group or others") as err:
        shmkv.DiskTier(open_dir, 1 << 20)
    assert str(open_dir) in str(err.value) and "chmod go-w" in str(err.value)
    later = tmp_path / "later"
    spec = shmkv.DiskTier(later, 1 << 20)  # fine when made, opened up before use
    os.chmod(later, 0o775)
    with pytest.raises(shmkv.ShmkvError, match="writable by group or others"):
        shmkv.Coordinator(make_config(), name=unique_name, tiers=[spec]).open()
    assert not os.path.exists(later / "lock")
    if os.geteuid() != 0:
        pytest.skip("chown to another uid needs root")
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 65534, 65534)
    with pytest.raises(shmkv.ShmkvError, match="owned by uid 65534") as err:
        shmkv.DiskTier(theirs, 1 << 20)
    assert str(theirs) in str(err.value)


def test_a_planted_lock_symlink_is_refused_and_its_target_unchanged(tmp_path, unique_name):
    path = tmp_path / "tier"
    spec = shmkv.DiskTier(path, 1 << 20)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious\n" * 10)
    os.symlink(victim, path / "lock")
    with pytest.raises(shmkv.ShmkvError, match="symbolic link") as err:
        shmkv.Coordinator(make_config(), name=unique_name, tiers=[spec]).open()
    assert str(path / "lock") in str(err.value)
    assert victim.read_bytes() == b"precious\n" * 10


def _first_block_file(path, prompt):
    return path / "blocks" / (keys_of(prompt)[0].hex() + ".kv")


def test_a_block_file_that_is_a_symlink_is_never_served(tmp_path, unique_name):
    """A name of a block file that is a symbolic link, here to a copy of the genuine
    file, is ignored by the scan (no hit, the target untouched); one that becomes a link
    after the scan is refused by the promotion, and the hit ends before it."""
    cfg = make_config(num_blocks=16)
    p, q = prompts_of(2, 2)
    path = tmp_path / "tier"
    with (
        shmkv.Coordinator(cfg, name=unique_name, tiers=[shmkv.DiskTier(path, 1 << 20)]) as coord,
        shmkv.connect(coord.address, timeout=20) as client,
    ):
        write_prompt(client, p)
        write_prompt(client, q)
        wait_idle(client)
    genuine = {}
    for prompt, name in ((p, "p"), (q, "q")):
        genuine[name] = _first_block_file(path, prompt).read_bytes()
        (tmp_path / name).write_bytes(genuine[name])
    _first_block_file(path, p).unlink()
    os.symlink(tmp_path / "p", _first_block_file(path, p))
    with (
        shmkv.Coordinator(cfg, name=unique_name, tiers=[shmkv.DiskTier(path, 1 << 20)]) as coord,
        shmkv.connect(coord.address, timeout=20) as client,
    ):
        st = wait_idle(client)
        assert tier(st, "disk")["blocks"] == 3  # the link is not indexed
        _first_block_file(path, q).unlink()  # a link in place after the scan
        os.symlink(tmp_path / "q", _first_block_file(path, q))
        assert read_prompt(client, p) == (0, True)
        assert read_prompt(client, q) == (0, True)
        disk = tier(wait_idle(client), "disk")
        assert disk["removed_damaged"] == 1 and disk["errors"] == 1
    for name in ("p", "q"):  # the links' targets: never written, truncated nor removed
        assert (tmp_path / name).read_bytes() == genuine[name]


def test_a_fifo_named_like_a_block_file_hangs_nothing(tmp_path, unique_name, io):
    """A FIFO under a block file's name, there at the scan (ignored) or put in place of
    an indexed file after it (refused by the promotion): the scan finishes, the
    allocations are answered, and the coordinator stops (each within a timeout)."""
    cfg = make_config(num_blocks=16)
    p, q = prompts_of(2, 2, seed=7)
    path = tmp_path / "tier"
    with (
        shmkv.Coordinator(cfg, name=unique_name, tiers=[shmkv.DiskTier(path, 1 << 20)]) as coord,
        shmkv.connect(coord.address, timeout=20) as client,
    ):
        write_prompt(client, p)
        write_prompt(client, q)
        wait_idle(client)
    fifos = [_first_block_file(path, p), _first_block_file(path, q)]
    fifos[0].unlink()
    os.mkfifo(fifos[0])
    coord = shmkv.Coordinator(cfg, name=unique_name, tiers=[shmkv.DiskTier(path, 1 << 20)])
    coord.start()
    closer = None
    try:
        with shmkv.connect(coord.address, timeout=20) as client:
            assert tier(wait_idle(client, timeout=20), "disk")["blocks"] == 3
            fifos[1].unlink()
            os.mkfifo(fifos[1])
            assert read_prompt(client, p) == (0, True)
            assert read_prompt(client, q) == (0, True)  # answered: the FIFO is refused
            assert tier(wait_idle(client), "disk")["removed_damaged"] == 1
        closer = threading.Thread(target=coord.stop)
        closer.start()
        closer.join(10)
        assert not closer.is_alive(), "the coordinator did not stop"
    finally:
        for fifo in fifos:  # a reader still blocked in open() (the old defect) lets go
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
        if closer is None:
            coord.stop()
        else:
            closer.join(30)


@pytest.mark.parametrize("damage", ["blocks is a file", "lock is a directory"])
def test_a_damaged_directory_is_a_clear_error_naming_the_path(tmp_path, unique_name, damage):
    path = tmp_path / "tier"
    path.mkdir(mode=0o700)
    bad = path / damage.split()[0]
    if damage == "blocks is a file":
        bad.write_bytes(b"")
    else:
        bad.mkdir()
    with pytest.raises(shmkv.ShmkvError) as err:
        shmkv.Coordinator(
            make_config(), name=unique_name, tiers=[shmkv.DiskTier(path, 1 << 20)]
        ).open()
    assert str(bad) in str(err.value) and "remove it" in str(err.value)
    assert not isinstance(err.value, OSError)


@pytest.mark.parametrize("damage", ["blocks", "lock"])
def test_shmkv_serve_on_a_damaged_directory_exits_with_one_clear_line(tmp_path, damage):
    import subprocess
    import sys

    path = tmp_path / "tier"
    path.mkdir(mode=0o700)
    if damage == "blocks":
        (path / "blocks").write_bytes(b"")
    else:
        (path / "lock").mkdir()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "shmkv",
            "serve",
            "--address",
            str(tmp_path / "s.sock"),
            "--num-blocks",
            "16",
            "--num-layers",
            "1",
            "--head-dim",
            "8",
            "--disk-tier",
            str(path),
            "--disk-tier-size",
            "1M",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "ShmkvError" in line]
    assert len(errors) == 1 and str(path / damage) in errors[0]
    assert not os.path.exists(tmp_path / "s.sock")


# -- off x86: no block file written straight from the pool -----------------------------------


@pytest.mark.parametrize("direct", [True, False])
def test_disk_demotion_through_checked_staging_slots_serves_exact_bytes(
    tmp_path, unique_name, monkeypatch, io, direct
):
    """``DIRECT_DISK_DEMOTION`` False is the path of CPUs that may reorder loads (aarch64):
    every block reaches disk through a staging slot the loop checked (``p2s`` then ``s2d``),
    none straight from the pool. A burst of 72 blocks (past the staging slots), then a
    restart: every block on disk, exact bytes."""
    monkeypatch.setattr(tiers_mod, "DIRECT_DISK_DEMOTION", direct)
    ops = []
    if io == "threads":  # which copies ran (the I/O process's are its own)
        real = block_io.Mover.run
        monkeypatch.setattr(
            block_io.Mover,
            "run",
            lambda self, copies, stopping: (
                ops.extend(c.op for c in copies),
                real(self, copies, stopping),
            )[1],
        )
    assert tiers_mod.STAGING_BLOCKS < 72
    cfg = make_config(num_blocks=80)
    prompts = prompts_of(12, 6, seed=9)
    with (
        shmkv.Coordinator(
            cfg, name=unique_name, tiers=[shmkv.DiskTier(tmp_path, 1 << 22)]
        ) as coord,
        shmkv.connect(coord.address, timeout=20) as client,
    ):
        client.close_many([written_prompt(client, p) for p in prompts])
        st = wait_idle(client, timeout=60)
        assert tier(st, "disk")["blocks"] == 72 and tier(st, "disk")["demotions"] == 72
        assert len(coord.tiers._staging.free) == tiers_mod.STAGING_BLOCKS  # all back
    if io == "threads":
        if direct:
            assert ops.count("p2d") == 72 and "p2s" not in ops
        else:
            assert "p2d" not in ops and ops.count("p2s") == ops.count("s2d") == 72
    with (
        shmkv.Coordinator(
            cfg, name=unique_name, tiers=[shmkv.DiskTier(tmp_path, 1 << 22)]
        ) as coord,
        shmkv.connect(coord.address, timeout=20) as client,
    ):
        wait_idle(client)
        assert [read_prompt(client, p) for p in prompts] == [(24, True)] * 12


def test_a_tier_io_process_that_never_gets_ready_leaves_the_copies_to_threads(
    tmp_path, unique_name, monkeypatch, caplog
):
    """The coordinator opens once its tier I/O process has said it serves; one that exits
    before it does is reported, and worker threads run the copies from the start."""
    fault = tmp_path / "fault.py"
    fault.write_text("import os\n\n\ndef exit_now(mod):\n    os._exit(3)\n")
    monkeypatch.setattr(tiers_mod, "IO_PROCESS_PRELOAD", f"{fault}:exit_now")
    caplog.set_level(logging.WARNING, logger="shmkv.tiers")
    cfg = make_config(num_blocks=16)
    prompt = prompts_of(1, 3)[0]
    with (
        shmkv.Coordinator(
            cfg, name=unique_name, tiers=[shmkv.HostTier(8 * cfg.block_nbytes)]
        ) as coord,
        shmkv.connect(coord.address, timeout=20) as client,
    ):
        assert coord.tiers._proc is None and coord.tiers._copier is not None
        assert "tier I/O process did not start (exit code 3)" in caplog.text
        write_prompt(client, prompt)
        wait_idle(client)
        evict_all(client)
        assert read_prompt(client, prompt) == (12, True)
        assert wait_idle(client)["tier_io"]["lost_evictions"] == 0


def test_the_pool_evicts_blocks_safe_in_a_tier_before_those_still_copying():
    """``BlockPool.copying`` (the tiers' blocks copying or waiting): an eviction takes the
    other cached blocks first, least recently used first, then those, oldest first."""
    from shmkv.coordinator.allocator import BlockPool

    pool = BlockPool(8)
    ids = pool.allocate(8, 1)
    for block in ids:
        assert pool.publish(block, bytes([block]) * 16)
    pool.decref(ids)  # cached, block 0 the oldest
    evicted = []
    pool.on_evict = lambda blocks, keys: evicted.extend(blocks)
    pool.copying = {0, 1, 2, 6}
    assert pool.allocate(3, 2) == [3, 4, 5]
    assert pool.allocate(3, 2) == [7, 0, 1]
    assert evicted == [3, 4, 5, 7, 0, 1]
    pool.copying = None
    assert pool.allocate(2, 2) == [2, 6]
    pool.check_invariants()


def test_an_eviction_spares_a_block_whose_disk_write_is_under_way(
    tmp_path, unique_name, monkeypatch, io
):
    """Prompt B's blocks are being written (slowly) when an allocation must evict three
    blocks; prompt A's, already on disk, are more recently used but go first: B's stay
    in the pool, nothing is lost or needs rescuing, and both are served exactly."""
    inject(monkeypatch, io, "slow_disk_write")
    cfg = make_config(num_blocks=8)
    a, b = prompts_of(2, 3, seed=11)
    with (
        shmkv.Coordinator(
            cfg, name=unique_name, tiers=[shmkv.DiskTier(tmp_path, 1 << 20)]
        ) as coord,
        shmkv.connect(coord.address, timeout=20) as client,
    ):
        write_prompt(client, a)
        wait_idle(client)  # A is safe on disk
        write_prompt(client, b)  # B: its writes under way
        assert read_prompt(client, a) == (12, True)  # A: the pool's newest now
        client.allocate(5 * BS).close()  # 2 free + 3 evicted
        st = wait_idle(client)
        assert st["evictions"] == 3
        assert len(coord.table.pool.lookup(keys_of(b))) == 3
        assert coord.table.pool.lookup(keys_of(a)) == []
        io_st = st["tier_io"]
        assert io_st["lost_evictions"] == 0 and io_st["rescued_evictions"] == 0
        assert read_prompt(client, a) == (12, True) and read_prompt(client, b) == (12, True)


_GATED_DEMOTIONS = '''import os
import time


def gated(mod, set_attr=setattr):
    """Demotions out of the pool wait for the gate file to exist (at most 30 s)."""
    gate = os.environ["SHMKV_TEST_DEMOTION_GATE"]
    for op in ("_op_p2h", "_op_p2d", "_op_p2s"):
        def late(self, copy, orig=getattr(mod.Mover, op)):
            deadline = time.monotonic() + 30
            while not os.path.exists(gate):
                assert time.monotonic() < deadline, "the test never opened the gate"
                time.sleep(0.005)
            orig(self, copy)
        set_attr(mod.Mover, op, late)
'''


@pytest.mark.parametrize("kinds", ["host", "disk", "disk, staged"])
def test_a_block_evicted_while_its_copy_waits_is_rescued_by_the_loop(
    tmp_path, unique_name, monkeypatch, io, kinds
):
    """Every cached block is still copying (demotions held until the allocation is
    answered) when an allocation evicts them: the loop copies each at eviction, into a
    host slot or through a staging slot to disk, and the late copies, cancelled, change
    nothing. Counted as rescued, none lost; the bytes served afterwards are exact."""
    fault, gate = tmp_path / "gated_demotions.py", tmp_path / "gate"
    fault.write_text(_GATED_DEMOTIONS)
    monkeypatch.setenv("SHMKV_TEST_DEMOTION_GATE", str(gate))  # (the I/O process's too)
    # wherever the copies run (as inject() does): with "client", demotions run in the I/O
    # process, and only promotions in this process
    if io != "threads":
        monkeypatch.setattr(tiers_mod, "IO_PROCESS_PRELOAD", f"{fault}:gated")
    if io != "process":
        import runpy

        runpy.run_path(str(fault))["gated"](block_io, monkeypatch.setattr)
    if kinds == "disk, staged":
        monkeypatch.setattr(tiers_mod, "DIRECT_DISK_DEMOTION", False)
    cfg = make_config(num_blocks=4)
    spec = (
        shmkv.HostTier(8 * cfg.block_nbytes)
        if kinds == "host"
        else shmkv.DiskTier(tmp_path / "tier", 1 << 20)
    )
    prompt = prompts_of(1, 3, seed=13)[0]
    with (
        shmkv.Coordinator(cfg, name=unique_name, tiers=[spec]) as coord,
        shmkv.connect(coord.address, timeout=20) as client,
    ):
        write_prompt(client, prompt)  # its copies wait at the gate
        client.allocate(4 * BS).close()  # 1 free + 3 evicted
        gate.touch()
        st = wait_idle(client)
        assert st["evictions"] == 3
        assert st["tier_io"]["rescued_evictions"] == 3, st["tier_io"]
        assert st["tier_io"]["lost_evictions"] == 0
        assert coord.tiers.lookup(keys_of(prompt)) == 3
        assert read_prompt(client, prompt) == (12, True)  # promoted back, exact
        if coord.tiers._staging is not None:
            assert len(coord.tiers._staging.free) == tiers_mod.STAGING_BLOCKS
        coord.table.check_invariants()
