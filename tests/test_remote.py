"""The Redis/Valkey tier (``shmkv.tiers.redis_store``) against a real ``redis-server``.

Each test that needs a store starts its own server process on a free loopback port
(no persistence) and kills it at teardown. Two coordinators in this process stand for
two nodes sharing the store.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

import pytest
import torch

import shmkv
from shmkv import hashing
from shmkv.tiers.redis_store import HEADER_SIZE, Codec, RedisTier, split_specs

redis = pytest.importorskip(
    "redis", reason="the redis client is not installed: pip install -e '.[test]'"
)
SERVER = shutil.which("redis-server") or shutil.which("valkey-server")
needs_server = pytest.mark.skipif(
    SERVER is None, reason="no redis-server on PATH: ./scripts/setup.sh test installs it"
)

BS = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A redis-server child process on a loopback port, no persistence."""

    def __init__(self, port: int, directory: str):
        self.port, self.directory = port, directory
        self.proc = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> "RedisServer":
        self.proc = subprocess.Popen(
            [
                SERVER,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self.directory,
                "--daemonize",
                "no",
                "--loglevel",
                "warning",
                "--maxmemory-policy",
                "allkeys-lru",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout
        client = redis.Redis(port=self.port, socket_timeout=0.5, socket_connect_timeout=0.5)
        try:
            while True:
                try:
                    if client.ping():
                        return self
                except redis.RedisError:
                    pass
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.kill()
                    raise RuntimeError(
                        f"redis-server on port {self.port} did not answer PING within {timeout} s"
                    )
                time.sleep(0.02)
        finally:
            client.close()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait(10)

    def client(self):
        return redis.Redis(port=self.port, socket_timeout=5)


@pytest.fixture
def redis_server():
    if SERVER is None:
        pytest.skip("no redis-server on PATH: ./scripts/setup.sh test installs it")
    directory = tempfile.mkdtemp(prefix="shmkv-redis-")
    server = None
    try:
        for attempt in range(3):  # a free port can be taken between the probe and the bind
            server = RedisServer(_free_port(), directory)
            try:
                server.start()
                break
            except RuntimeError:
                if attempt == 2:
                    raise
        yield server
    finally:
        if server is not None:
            server.kill()
        shutil.rmtree(directory, ignore_errors=True)


def _config(head_dim: int = 8, num_blocks: int = 64, device: str = "cpu") -> shmkv.PoolConfig:
    return shmkv.PoolConfig(
        num_layers=3,
        num_kv_heads=4,
        head_dim=head_dim,
        num_blocks=num_blocks,
        block_size=BS,
        dtype=torch.float32,
        device=device,
    )


def _tier(server, **kw) -> RedisTier:
    kw.setdefault("timeout", 0.5)
    kw.setdefault("max_backoff", 0.3)
    return RedisTier(server.url, **kw)


def _prefill(client, prompt, seed=0, cache_salt=None):
    """Allocate, write K/V of every token past the cached prefix, commit."""
    h = client.allocate(prompt=prompt, cache_salt=cache_salt)
    start = h.num_cached_tokens
    g = torch.Generator().manual_seed(seed)
    n = len(prompt) - start
    kv = torch.randn(h.num_layers, 2, n, h.num_heads, h.head_dim, generator=g)
    h.write_all(kv.to(h.device), start=start)
    h.commit()
    return h


def _flush(coord) -> None:
    assert coord.tiers.flush(10.0), "the write-behind queue did not drain"


def _store(coord) -> dict:
    return coord.tiers.store_stats()


def _wait_for(cond, timeout=10.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} not reached within {timeout} s")
        time.sleep(0.02)


# -- without a server ------------------------------------------------------------------------


def test_keys_carry_layout_salt_and_prefix_key_and_group_by_hash_tag():
    cfg = _config()
    chain = hashing.block_keys(list(range(40)), BS, hashing.root_key(None))
    codec = Codec(cfg, b"", hash_group=4)
    names = codec.names(chain, 0, len(chain))
    tags = [n[n.index("{") + 1 : n.index("}")] for n in names]
    assert tags == [chain[i - i % 4].hex() for i in range(10)]  # runs of 4 share a slot
    assert all(n.endswith(":" + k.hex()) for n, k in zip(names, chain))
    assert codec.names(chain, 5, 7) == names[5:7]
    others = [
        Codec(_config(head_dim=16), b""),
        Codec(cfg, b"model-b"),
        Codec(cfg, b"", hash_group=8),
    ]
    assert len({c.namespace for c in others} | {codec.namespace}) == 4
    # the pool's size is not part of the namespace: pools of any size share
    assert Codec(_config(num_blocks=999), b"", hash_group=4).namespace == codec.namespace


def test_values_are_checked_before_serving():
    cfg = _config()
    codec = Codec(cfg)
    key = os.urandom(16)
    payload = os.urandom(cfg.block_nbytes)
    value = codec.header(key, __import__("zlib").crc32(payload)) + payload
    assert len(value) == HEADER_SIZE + cfg.block_nbytes
    assert codec.check(value, key) is None
    flipped = bytearray(value)
    flipped[-1] ^= 1
    assert codec.check(bytes(flipped), key) == "payload checksum"
    assert codec.check(value[:-1], key).startswith("size")
    assert codec.check(value[:10], key) == "truncated header"
    assert codec.check(value, os.urandom(16)) == "another namespace or key"
    assert codec.check(Codec(cfg, b"x").header(key, 0) + payload, key) is not None
    bad_header = bytearray(value)
    bad_header[20] ^= 1
    assert codec.check(bytes(bad_header), key) == "header checksum"


def test_tier_arguments_are_checked():
    with pytest.raises(TypeError):
        RedisTier(6379)
    with pytest.raises(ValueError):
        RedisTier("http://127.0.0.1:6379")
    with pytest.raises(ValueError):
        RedisTier("redis://127.0.0.1:6379", timeout=0)
    with pytest.raises(ValueError):
        RedisTier("redis://127.0.0.1:6379", max_queue=0)
    spec = RedisTier("redis://:secret@127.0.0.1:6379")
    assert "secret" not in repr(spec)
    host = shmkv.HostTier(1 << 20)
    assert split_specs([host, spec]) == ([host], spec)
    with pytest.raises(ValueError):
        split_specs([spec, host])
    with pytest.raises(ValueError):
        split_specs([spec, spec])


def test_cli_serve_takes_a_redis_tier():
    from shmkv.tools.cli import build_parser, tier_specs

    args = build_parser().parse_args(["serve", "--redis-tier", "redis://127.0.0.1:7000"])
    specs = tier_specs(args)
    assert isinstance(specs[-1], RedisTier) and specs[-1].url == "redis://127.0.0.1:7000"


def test_a_store_that_never_answered_costs_nothing(small_config, unique_name):
    """A store down from the start: allocations and local hits go on, errors counted."""
    spec = RedisTier(f"redis://127.0.0.1:{_free_port()}", timeout=0.2, max_backoff=60)
    with (
        shmkv.Coordinator(small_config, name=unique_name, tiers=[spec]) as coord,
        shmkv.connect(coord.address, timeout=10) as client,
    ):
        prompt = list(range(24))
        first = _prefill(client, prompt)
        assert first.num_cached_tokens == 0
        _wait_for(lambda: _store(coord)["errors"] >= 1, what="an error counted")
        started = time.monotonic()
        again = client.allocate(prompt=prompt)  # a local hit, the store backed off
        assert again.num_cached_tokens == 24
        other = client.allocate(prompt=list(range(100, 124)))
        assert other.num_cached_tokens == 0
        assert time.monotonic() - started < 1.0
        stats = _store(coord)
        assert stats["state"].startswith("backing off") and stats["skipped_lookups"] >= 1
        assert client.stats()["tiers"][-1]["tier"] == "redis"


# -- with a server ------------------------------------------------------------------------------


@needs_server
def test_node_b_reuses_node_a_prefixes_with_exact_bytes(redis_server, unique_name):
    prompt = list(range(1000, 1042))  # 10 full blocks and 2 tokens
    with (
        shmkv.Coordinator(_config(), name=unique_name + "a", tiers=[_tier(redis_server)]) as a,
        shmkv.Coordinator(
            _config(num_blocks=48), name=unique_name + "b", tiers=[_tier(redis_server)]
        ) as b,
        shmkv.connect(a.address, timeout=10) as ca,
        shmkv.connect(b.address, timeout=10) as cb,
    ):
        ha = _prefill(ca, prompt, seed=1)
        _flush(a)
        assert _store(a)["writes"] == 10 and _store(a)["errors"] == 0
        hb = cb.allocate(prompt=prompt)
        assert hb.num_cached_tokens == 40
        assert torch.equal(
            hb.with_sequence_length(40).gather_all(), ha.with_sequence_length(40).gather_all()
        )
        stats = _store(b)
        assert stats["hits"] == 10 and stats["misses"] == 0 and stats["corrupt"] == 0
        assert stats["bytes_read"] == 10 * (HEADER_SIZE + _config().block_nbytes)
        # the pulled blocks are published on B: a second request hits B's pool
        assert cb.allocate(prompt=prompt).num_cached_tokens == 40
        assert _store(b)["hits"] == 10
        # a prompt that diverges after 6 blocks reuses 6 of them
        fork = cb.allocate(prompt=prompt[:24] + [7] * 20)
        assert fork.num_cached_tokens == 24
        # B's own new blocks go to the store too (the pulled ones are not written again)
        hb2 = _prefill(cb, prompt + list(range(6)), seed=2)
        assert hb2.num_cached_tokens == 40
        _flush(b)
        assert _store(b)["writes"] == 2  # blocks 10 and 11


@needs_server
def test_different_layouts_or_salts_never_share(redis_server, unique_name):
    prompt = list(range(32))
    with (
        shmkv.Coordinator(_config(), name=unique_name + "a", tiers=[_tier(redis_server)]) as a,
        shmkv.connect(a.address, timeout=10) as ca,
    ):
        _prefill(ca, prompt)
        _prefill(ca, prompt, cache_salt=b"tenant-1")
        _flush(a)
        assert _store(a)["writes"] == 16
        cases = [
            ("layout", _config(head_dim=16), {}, None),
            ("tier salt", _config(), {"salt": b"model-2"}, None),
            ("request salt", _config(), {}, b"tenant-2"),
        ]
        for label, cfg, kw, salt in cases:
            with (
                shmkv.Coordinator(
                    cfg, name=f"{unique_name}-{label[:3]}", tiers=[_tier(redis_server, **kw)]
                ) as b,
                shmkv.connect(b.address, timeout=10) as cb,
            ):
                h = cb.allocate(prompt=prompt, cache_salt=salt)
                assert h.num_cached_tokens == 0, label
                stats = _store(b)
                assert stats["hits"] == 0 and stats["corrupt"] == 0, label
        # the same salt does share
        with (
            shmkv.Coordinator(_config(), name=unique_name + "s", tiers=[_tier(redis_server)]) as b,
            shmkv.connect(b.address, timeout=10) as cb,
        ):
            assert cb.allocate(prompt=prompt, cache_salt=b"tenant-1").num_cached_tokens == 32
    keys = redis_server.client().keys("shmkv:*")
    assert len(keys) == 16 and len({k.split(b":")[1] for k in keys}) == 1


@needs_server
def test_corrupted_or_truncated_values_are_never_served(redis_server, unique_name):
    prompt = list(range(200, 240))  # 10 blocks
    cfg = _config()
    codec = Codec(cfg, b"", hash_group=16)
    names = codec.names(hashing.block_keys(prompt, BS, hashing.root_key(None)), 0, 10)
    with (
        shmkv.Coordinator(cfg, name=unique_name + "a", tiers=[_tier(redis_server)]) as a,
        shmkv.connect(a.address, timeout=10) as ca,
    ):
        ha = _prefill(ca, prompt, seed=3)
        _flush(a)
        expected = ha.gather_all()
    store = redis_server.client()
    good = {i: store.get(names[i]) for i in range(10)}
    flipped = bytearray(good[7])
    flipped[-5] ^= 0x40
    store.set(names[7], bytes(flipped))  # payload checksum
    store.set(names[5], good[5][:-100])  # truncated
    store.set(names[3], good[2])  # another block's value under this key
    tampered = [(3, "another block's value"), (5, "a truncated value"), (7, "a flipped bit")]
    for round_, (index, what) in enumerate(tampered):
        with (
            shmkv.Coordinator(
                cfg, name=f"{unique_name}b{round_}", tiers=[_tier(redis_server)]
            ) as b,
            shmkv.connect(b.address, timeout=10) as cb,
        ):
            h = cb.allocate(prompt=prompt)
            assert h.num_cached_tokens == index * BS, what  # the hit ends before it
            got = h.with_sequence_length(index * BS).gather_all()
            assert torch.equal(got, expected[:, :, : index * BS]), what
            stats = _store(b)
            assert stats["corrupt"] == 1 and stats["hits"] == index, what
        assert store.get(names[index]) is None, what  # deleted
        store.set(names[index], good[index])  # repaired: the next round goes on
    store.set(names[0], b"not a block at all")
    with (
        shmkv.Coordinator(cfg, name=unique_name + "c", tiers=[_tier(redis_server)]) as c,
        shmkv.connect(c.address, timeout=10) as cc,
    ):
        assert cc.allocate(prompt=prompt).num_cached_tokens == 0
        assert _store(c)["corrupt"] == 1


@needs_server
def test_a_full_write_queue_drops_and_counts(redis_server, unique_name):
    with (
        shmkv.Coordinator(
            _config(), name=unique_name, tiers=[_tier(redis_server, max_queue=3)]
        ) as a,
        shmkv.connect(a.address, timeout=10) as ca,
    ):
        _prefill(ca, list(range(40)))  # one commit publishes 10 blocks
        _flush(a)
        stats = _store(a)
        assert stats["dropped"] == 7 and stats["writes"] == 3


@needs_server
def test_the_server_killed_mid_run_breaks_nothing_and_sharing_resumes(redis_server, unique_name):
    spec_kw = dict(timeout=0.3, max_backoff=0.3)
    with (
        shmkv.Coordinator(
            _config(), name=unique_name + "a", tiers=[_tier(redis_server, **spec_kw)]
        ) as a,
        shmkv.Coordinator(
            _config(), name=unique_name + "b", tiers=[_tier(redis_server, **spec_kw)]
        ) as b,
        shmkv.connect(a.address, timeout=10) as ca,
        shmkv.connect(b.address, timeout=10) as cb,
    ):
        first = list(range(16))
        _prefill(ca, first)
        _flush(a)
        assert cb.allocate(prompt=first).num_cached_tokens == 16

        redis_server.kill()  # SIGKILL, mid-run
        second = list(range(50, 66))
        _prefill(ca, second)  # no exception: the write fails behind
        _flush(a)
        assert _store(a)["errors"] >= 1
        h = cb.allocate(prompt=second)  # the lookup fails: a plain miss
        assert h.num_cached_tokens == 0
        _wait_for(lambda: _store(b)["errors"] >= 1, what="B's lookup error counted")
        assert cb.allocate(prompt=first).num_cached_tokens == 16  # local hits go on
        assert _store(b)["state"].startswith("backing off") or _store(b)["errors"] >= 1

        redis_server.start()  # back, empty, on the same port
        third = list(range(80, 96))

        def shared() -> bool:  # retried: the backoff may still run
            with cb.allocate(prompt=third + [1]) as probe:
                return probe.num_cached_tokens == 16

        _prefill(ca, third)
        deadline = time.monotonic() + 10
        while not shared():
            assert time.monotonic() < deadline, "sharing did not resume"
            ha = _prefill(ca, third + [9] * 4)  # publishes again once A is up
            ha.close()
            _flush(a)
            time.sleep(0.1)
        assert _store(a)["recoveries"] >= 1 or _store(a)["writes"] >= 1
        assert _store(b)["hits"] >= 4 + 4


@needs_server
def test_a_frozen_server_only_costs_its_timeout(redis_server, unique_name):
    with (
        shmkv.Coordinator(
            _config(), name=unique_name, tiers=[_tier(redis_server, timeout=0.2, max_backoff=5)]
        ) as a,
        shmkv.connect(a.address, timeout=10) as ca,
    ):
        _prefill(ca, list(range(8)))
        _flush(a)
        os.kill(redis_server.proc.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            h = ca.allocate(prompt=list(range(100, 116)))
            took = time.monotonic() - started
            assert h.num_cached_tokens == 0 and took < 2.0
            _wait_for(lambda: _store(a)["errors"] >= 1, what="the timeout counted")
            started = time.monotonic()
            assert ca.allocate(prompt=list(range(8))).num_cached_tokens == 8
            assert ca.allocate(prompt=list(range(300, 316))).num_cached_tokens == 0
            assert time.monotonic() - started < 0.5  # backed off: the store is skipped
        finally:
            os.kill(redis_server.proc.pid, signal.SIGCONT)


# -- Redis Cluster ------------------------------------------------------------------------------


@pytest.fixture
def redis_cluster():
    """Three redis-server processes in cluster mode, the 16384 slots split among them."""
    if SERVER is None:
        pytest.skip("no redis-server on PATH: ./scripts/setup.sh test installs it")
    directory = tempfile.mkdtemp(prefix="shmkv-redis-cluster-")
    procs, clients = [], []
    try:
        ports = []
        while len(ports) < 3:  # the cluster bus listens on port + 10000 too
            port = _free_port()
            if port + 10000 > 65535 or port in ports or not _is_free(port + 10000):
                continue
            ports.append(port)
        for port in ports:
            procs.append(
                subprocess.Popen(
                    [
                        SERVER,
                        "--port",
                        str(port),
                        "--bind",
                        "127.0.0.1",
                        "--save",
                        "",
                        "--appendonly",
                        "no",
                        "--dir",
                        directory,
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        f"nodes-{port}.conf",
                        "--loglevel",
                        "warning",
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        for port in ports:
            client = redis.Redis(port=port, socket_timeout=2, socket_connect_timeout=2)
            clients.append(client)
            _wait_for(lambda c=client: _pings(c), what=f"redis-server on {port}")
        bounds = [(0, 5460), (5461, 10922), (10923, 16383)]
        for client, (lo, hi) in zip(clients, bounds):
            client.execute_command("CLUSTER", "ADDSLOTSRANGE", lo, hi)
        for port in ports[1:]:
            clients[0].execute_command("CLUSTER", "MEET", "127.0.0.1", port)
        _wait_for(
            lambda: all(c.cluster("info")["cluster_state"] == "ok" for c in clients),
            timeout=20,
            what="cluster_state:ok",
        )
        yield ports, clients
    finally:
        for client in clients:
            client.close()
        for proc in procs:
            proc.kill()
            proc.wait(10)
        shutil.rmtree(directory, ignore_errors=True)


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _pings(client) -> bool:
    try:
        return client.ping()
    except redis.RedisError:
        return False


@needs_server
def test_a_redis_cluster_shares_with_one_slot_per_group(redis_cluster, unique_name):
    ports, clients = redis_cluster
    prompt = list(range(3000, 3000 + 40 * BS))  # 40 blocks: groups of 16, 16 and 8
    spec = dict(cluster=True, hash_group=16, timeout=2.0)
    url_a = f"redis://127.0.0.1:{ports[0]}/0"
    url_b = f"redis://127.0.0.1:{ports[2]}/0"  # any node: redis-py finds the slots
    with (
        shmkv.Coordinator(_config(), name=unique_name + "a", tiers=[RedisTier(url_a, **spec)]) as a,
        shmkv.Coordinator(_config(), name=unique_name + "b", tiers=[RedisTier(url_b, **spec)]) as b,
        shmkv.connect(a.address, timeout=10) as ca,
        shmkv.connect(b.address, timeout=10) as cb,
    ):
        ha = _prefill(ca, prompt, seed=5)
        _flush(a)
        assert _store(a)["writes"] == 40 and _store(a)["errors"] == 0
        hb = cb.allocate(prompt=prompt)
        assert hb.num_cached_tokens == 40 * BS
        assert torch.equal(hb.gather_all(), ha.gather_all())
        assert _store(b)["hits"] == 40 and _store(b)["errors"] == 0
    codec = Codec(_config(), b"", hash_group=16)
    names = codec.names(hashing.block_keys(prompt, BS, hashing.root_key(None)), 0, 40)
    slots = [clients[0].execute_command("CLUSTER", "KEYSLOT", n) for n in names]
    assert len(set(slots[:16])) == len(set(slots[16:32])) == len(set(slots[32:])) == 1
    assert sum(c.dbsize() for c in clients) == 40


@needs_server
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_pools_share_through_the_store(redis_server, unique_name):
    prompt = list(range(4000, 4042))
    cfg = _config(device="cuda:0")
    with (
        shmkv.Coordinator(cfg, name=unique_name + "a", tiers=[_tier(redis_server)]) as a,
        shmkv.Coordinator(cfg, name=unique_name + "b", tiers=[_tier(redis_server)]) as b,
        shmkv.connect(a.address, timeout=30) as ca,
        shmkv.connect(b.address, timeout=30) as cb,
    ):
        ha = _prefill(ca, prompt, seed=7)
        _flush(a)
        hb = cb.allocate(prompt=prompt)
        assert hb.num_cached_tokens == 40
        assert torch.equal(
            hb.with_sequence_length(40).gather_all().cpu(),
            ha.with_sequence_length(40).gather_all().cpu(),
        )


@needs_server
@pytest.mark.parametrize("wait", [True, False])
def test_one_prompt_promoted_from_the_host_tier_and_the_store(redis_server, unique_name, wait):
    """The first blocks come from B's host tier, the rest from the store: one answer (or,
    answered early, the store's part said to be only maybe there, then settled)."""
    prompt = list(range(5000, 5042))  # 10 full blocks and 2 tokens
    g = torch.Generator().manual_seed(11)
    kv = torch.randn(3, 2, len(prompt), 4, 8, generator=g)
    host = shmkv.HostTier(64 * _config().block_nbytes)
    with (
        shmkv.Coordinator(_config(), name=unique_name + "a", tiers=[_tier(redis_server)]) as a,
        shmkv.Coordinator(
            _config(num_blocks=16), name=unique_name + "b", tiers=[host, _tier(redis_server)]
        ) as b,
        shmkv.connect(a.address, timeout=10) as ca,
        shmkv.connect(b.address, timeout=10) as cb,
    ):
        ha = ca.allocate(prompt=prompt)
        ha.write_all(kv, start=0)
        ha.commit()
        _flush(a)
        with cb.allocate(prompt=prompt[:16]) as first:  # B computed 4 blocks itself
            assert first.num_cached_tokens == 16  # (from the store, in fact)
        _wait_for(lambda: cb.stats()["tiers"][0]["blocks"] >= 4, what="demotion to host")
        with cb.allocate(16 * BS):  # the whole pool: evicts them
            pass
        assert cb.stats()["tiers"][0]["blocks"] >= 4
        hits_before = _store(b)["hits"]
        hb = cb.allocate(prompt=prompt, wait=wait)
        if not wait:
            assert (hb.num_promoting_tokens, hb.num_fetching_tokens) == (40, 24)
            assert hb.settle() == 40
        assert hb.num_cached_tokens == 40
        assert torch.equal(hb.with_sequence_length(40).gather_all(), kv[:, :, :40])
        assert _store(b)["hits"] - hits_before == 6  # blocks 4..9 from the store
        assert cb.stats()["tiers"][0]["promotions"] >= 4  # blocks 0..3 from host memory


# -- keys and bytes: a block is written under a key only while it holds it -------------------


class _Corked:
    """A client's socket that holds back its first ``count - 1`` writes and sends them
    with the ``count``-th in one write, so the coordinator reads them in one ``recv`` and
    serves them in one loop turn (a client pipelining requests)."""

    def __init__(self, sock, count: int):
        self._sock, self._count, self._held = sock, count, []

    def sendall(self, data) -> None:
        self._held.append(bytes(data))
        if len(self._held) == self._count:
            self._sock.sendall(b"".join(self._held))
            self._held = []

    def __getattr__(self, name):
        return getattr(self._sock, name)


@needs_server
def test_a_block_reused_in_the_turn_it_was_published_is_never_stored_under_its_old_key(
    redis_server, unique_name
):
    """Published (commit), released (close_many(wait=False)) and taken by an allocation
    that evicts it, all in one loop turn: the write queued at the end of that turn must
    not copy the new owner's bytes (9.0) under the old prefix key (1.0). The store is
    paused meanwhile, so a write that was queued copies after the new owner wrote."""
    num_blocks = 8
    prompt = list(range(700, 700 + BS))  # one full block
    tier = _tier(redis_server, timeout=5.0)
    store = redis_server.client()
    with (
        shmkv.Coordinator(
            _config(num_blocks=num_blocks), name=unique_name + "a", tiers=[tier]
        ) as a,
        shmkv.connect(a.address, timeout=10) as ca,
    ):
        h = ca.allocate(prompt=prompt)
        h.write_all(torch.full((3, 2, BS, 4, 8), 1.0), start=0)
        # the store answers nobody for a second (the tier's timeout is longer)
        store.execute_command("CLIENT", "PAUSE", "1000", "ALL")
        real = ca._link._sock
        ca._link._sock = _Corked(real, 3)
        try:
            ca._link.post("commit", cache_id=h._cache_id, num_tokens=BS)
            ca.close_many([h], wait=False)
            taker = ca.allocate(num_tokens=num_blocks * BS)  # the whole pool
        finally:
            ca._link._sock = real
        assert a.table.pool.num_evictions == 1  # the published block was taken
        taker.write_all(torch.full((3, 2, num_blocks * BS, 4, 8), 9.0), start=0)
        ca.flush()
        _flush(a)
        assert a.stats()["copies_discarded"] == 1
        assert _store(a)["discarded"] == 1 and _store(a)["writes"] == 0
        taker.close()
    with (
        shmkv.Coordinator(_config(), name=unique_name + "b", tiers=[_tier(redis_server)]) as b,
        shmkv.connect(b.address, timeout=10) as cb,
    ):
        hb = cb.allocate(prompt=prompt)
        if hb.num_cached_tokens:  # a hit must hold the prefix's bytes
            assert hb.num_cached_tokens == BS
            assert torch.equal(hb.gather_all(), torch.full((3, 2, BS, 4, 8), 1.0))
        assert _store(b)["corrupt"] == 0


@needs_server
def test_a_damaged_disk_block_under_the_store_ends_the_hit_where_disk_alone_does(
    redis_server, unique_name, tmp_path
):
    """4 blocks of a 6-block prompt on disk, block 1's file damaged after a restart
    indexed it; the store holds nothing. The local part ends after block 0, the store's
    part comes back with nothing: the hit is 1 block (as with the disk tier alone), not
    a count that went negative and served the damaged block."""
    prompt = list(range(900, 900 + 6 * BS))
    kv = torch.randn(3, 2, len(prompt), 4, 8, generator=torch.Generator().manual_seed(5))
    disk = tmp_path / "disk"
    with (
        shmkv.Coordinator(
            _config(num_blocks=16), name=unique_name + "w", tiers=[shmkv.DiskTier(disk, 1 << 20)]
        ) as w,
        shmkv.connect(w.address, timeout=10) as cw,
    ):
        with cw.allocate(prompt=prompt[: 4 * BS]) as h:
            h.write_all(kv[:, :, : 4 * BS].contiguous(), start=0)
            h.commit()
        _wait_for(lambda: cw.stats()["tiers"][0]["blocks"] == 4, what="4 blocks on disk")
    name = hashing.block_keys(prompt, BS, hashing.root_key(None))[1].hex() + ".kv"
    for tiers in (
        [shmkv.DiskTier(disk, 1 << 20)],
        [shmkv.DiskTier(disk, 1 << 20), _tier(redis_server)],
    ):
        with (
            shmkv.Coordinator(
                _config(num_blocks=16), name=unique_name + str(len(tiers)), tiers=tiers
            ) as c,
            shmkv.connect(c.address, timeout=10) as cc,
        ):
            _wait_for(lambda: not c.tiers.io_stats()["scanning"], what="the disk scan")
            f = disk / "blocks" / name  # damaged after it was indexed
            data = bytearray(f.read_bytes())
            data[-5] ^= 0xFF
            f.write_bytes(bytes(data))
            before = cc.stats()
            h = cc.allocate(prompt=prompt)
            assert h.num_cached_tokens == BS, tiers
            assert torch.equal(h.with_sequence_length(BS).gather_all(), kv[:, :, :BS])
            after = cc.stats()
            assert after["prefix_hit_blocks"] - before["prefix_hit_blocks"] == 1
            assert after["prefix_miss_blocks"] - before["prefix_miss_blocks"] == 5
            h.close()
            c.table.check_invariants()
        # the damaged file was removed: put it back for the next round
        f.write_bytes(bytes(data[:-5]) + bytes([data[-5] ^ 0xFF]) + bytes(data[-4:]))


def test_a_demotion_whose_block_was_evicted_before_its_completion_was_taken_is_discarded(
    tmp_path, unique_name, monkeypatch
):
    """A disk demotion still writing (a slow file write) when the pool evicts and reuses
    its block for other bytes (9.0): as its completion is taken the block no longer
    holds the key, so that copy is discarded and counted once in copies_discarded; what
    the disk serves for the key afterwards (if anything: the tiers may have saved the
    block another way) is the key's bytes (1.0)."""
    import tier_faults

    from shmkv import tiers as tiers_mod

    monkeypatch.setattr(tiers_mod, "IO_PROCESS_PRELOAD", tier_faults.spec("slow_disk_write"))
    num_blocks = 4
    prompt = list(range(300, 300 + BS))
    disk = tmp_path / "disk"
    with (
        shmkv.Coordinator(
            _config(num_blocks=num_blocks), name=unique_name, tiers=[shmkv.DiskTier(disk, 1 << 20)]
        ) as c,
        shmkv.connect(c.address, timeout=10) as cc,
    ):
        with cc.allocate(prompt=prompt) as h:
            h.write_all(torch.full((3, 2, BS, 4, 8), 1.0), start=0)
            h.commit()
        taker = cc.allocate(num_tokens=num_blocks * BS)  # evicts the cached block
        assert c.table.pool.num_evictions == 1
        taker.write_all(torch.full((3, 2, num_blocks * BS, 4, 8), 9.0), start=0)
        _wait_for(lambda: not cc.stats()["tier_io"]["pending"], what="the tier's copies")
        assert cc.stats()["copies_discarded"] == 1
        taker.close()
        with cc.allocate(prompt=prompt) as h:
            if h.num_cached_tokens:
                assert h.num_cached_tokens == BS
                assert torch.equal(h.gather_all(), torch.full((3, 2, BS, 4, 8), 1.0))
        c.table.check_invariants()


@needs_server
def test_a_quantized_pools_blocks_are_stored_and_served_under_its_kv_scales(
    redis_server, unique_name
):
    """int8 pools: blocks A wrote under scales 0.5 are not served to B while B's scales
    are others (1.0, then 2.0), and are once B sets the same ones; a pool that is not
    quantized ignores scales (its namespace never depends on them)."""
    cfg = shmkv.PoolConfig(
        num_layers=3, num_kv_heads=4, head_dim=8, num_blocks=32, block_size=BS, dtype=torch.int8
    )
    assert cfg.block_fingerprint([0.5] * 6) != cfg.block_fingerprint([1.0] * 6)
    assert _config().block_fingerprint([0.5] * 6) == _config().block_fingerprint()
    prompt = list(range(4000, 4000 + 3 * BS))
    g = torch.Generator().manual_seed(2)
    kv = torch.randint(-128, 128, (3, 2, len(prompt), 4, 8), generator=g).to(torch.int8)

    def set_scales(client, scale):
        for layer in range(3):
            client.set_kv_scales(layer, scale, scale)

    with (
        shmkv.Coordinator(cfg, name=unique_name + "a", tiers=[_tier(redis_server)]) as a,
        shmkv.Coordinator(cfg, name=unique_name + "b", tiers=[_tier(redis_server)]) as b,
        shmkv.connect(a.address, timeout=10) as ca,
        shmkv.connect(b.address, timeout=10) as cb,
    ):
        set_scales(ca, 0.5)
        with ca.allocate(prompt=prompt) as h:
            h.write_all(kv, start=0)
            h.commit()
        _flush(a)
        assert _store(a)["writes"] == 3
        with cb.allocate(prompt=prompt) as h:  # B's scales are 1.0
            assert h.num_cached_tokens == 0
        set_scales(cb, 2.0)
        with cb.allocate(prompt=prompt) as h:
            assert h.num_cached_tokens == 0
        set_scales(cb, 0.5)
        with cb.allocate(prompt=prompt) as h:
            assert h.num_cached_tokens == 3 * BS
            assert torch.equal(h.gather_all().view(torch.uint8), kv.view(torch.uint8))
        assert _store(b)["corrupt"] == 0


def test_a_quantized_pools_disk_tier_serves_and_stores_only_under_its_scales(tmp_path, unique_name):
    """An int8 pool's disk tier is namespaced by the scales in force when it opened: while
    set_kv_scales has them otherwise, its blocks are not served (they mean other values)
    and no block is stored; with the same scales again it serves them."""
    cfg = shmkv.PoolConfig(
        num_layers=3, num_kv_heads=4, head_dim=8, num_blocks=8, block_size=BS, dtype=torch.int8
    )
    kv = torch.randint(
        -128, 128, (3, 2, 2 * BS, 4, 8), generator=torch.Generator().manual_seed(4)
    ).to(torch.int8)
    first, second = list(range(10, 10 + 2 * BS)), list(range(50, 50 + 2 * BS))

    def set_scales(client, scale):
        for layer in range(3):
            client.set_kv_scales(layer, scale, scale)

    def evict_all(client):
        st = client.stats()
        client.allocate((st["free_blocks"] + st["cached_blocks"]) * BS).close()

    def disk_blocks(client):
        return client.stats()["tiers"][0]["blocks"]

    with (
        shmkv.Coordinator(
            cfg, name=unique_name, tiers=[shmkv.DiskTier(tmp_path / "d", 1 << 20)]
        ) as c,
        shmkv.connect(c.address, timeout=10) as cc,
    ):
        with cc.allocate(prompt=first) as h:  # under the scales it opened with
            h.write_all(kv, start=0)
            h.commit()
        _wait_for(lambda: disk_blocks(cc) == 2, what="2 blocks on disk")
        evict_all(cc)
        set_scales(cc, 0.5)
        with cc.allocate(prompt=first) as h:  # not served under other scales
            assert h.num_cached_tokens == 0
        with cc.allocate(prompt=second) as h:  # nor stored
            h.write_all(kv, start=0)
            h.commit()
        evict_all(cc)
        _wait_for(lambda: not cc.stats()["tier_io"]["pending"], what="the tier's copies")
        assert disk_blocks(cc) == 2
        set_scales(cc, 1.0)
        with cc.allocate(prompt=first) as h:
            assert h.num_cached_tokens == 2 * BS
            assert torch.equal(h.gather_all().view(torch.uint8), kv.view(torch.uint8))
        with cc.allocate(prompt=second) as h:
            assert h.num_cached_tokens == 0


@needs_server
def test_an_early_answer_settles_at_what_the_store_had(redis_server, unique_name):
    """``allocate(..., wait=False)`` on node B: the store's blocks count as coming (the
    loop cannot know what the store holds without asking it); ``settle`` gives the hit
    the fetch found, with A's bytes, and 0 for a prompt the store never had."""
    prompt = list(range(1000, 1042))  # 10 full blocks and 2 tokens
    with (
        shmkv.Coordinator(_config(), name=unique_name + "a", tiers=[_tier(redis_server)]) as a,
        shmkv.Coordinator(_config(), name=unique_name + "b", tiers=[_tier(redis_server)]) as b,
        shmkv.connect(a.address, timeout=10) as ca,
        shmkv.connect(b.address, timeout=10) as cb,
    ):
        ha = _prefill(ca, prompt, seed=1)
        _flush(a)
        hb = cb.allocate(prompt=prompt, wait=False)
        assert (hb.num_cached_tokens, hb.num_promoting_tokens, hb.num_fetching_tokens) == (
            40,
            40,
            40,
        )
        assert hb.settle() == 40 == hb.num_cached_tokens
        assert torch.equal(
            hb.with_sequence_length(40).gather_all(), ha.with_sequence_length(40).gather_all()
        )
        never = cb.allocate(prompt=[7] * 42, wait=False)
        assert never.num_promoting_tokens == never.num_fetching_tokens == 40
        assert never.settle() == 0
        assert b._promoting == {} and b._settle_waiters == {}
        b.table.check_invariants()


@needs_server
def test_per_client_counts_follow_what_the_store_returned(redis_server, unique_name):
    """Blocks asked of the store count as a client's hits until the store answers: those
    it did not have move to that client's misses, as they do in the pool's own counts,
    so the clients' counts keep summing to the pool's."""
    prompt = list(range(3000, 3024))  # 6 full blocks
    with (
        shmkv.Coordinator(_config(), name=unique_name + "a", tiers=[_tier(redis_server)]) as a,
        shmkv.Coordinator(_config(), name=unique_name + "b", tiers=[_tier(redis_server)]) as b,
        shmkv.connect(a.address, timeout=10) as ca,
        shmkv.connect(b.address, name="engine-b", timeout=10) as cb,
    ):
        _prefill(ca, prompt[:8], seed=3).close()  # the store holds the first 2 blocks
        _flush(a)
        h = cb.allocate(prompt=prompt)
        assert h.num_cached_tokens == 8
        h.close()
        counts = b.client_counts["engine-b"]
        st = cb.stats()
        assert counts == [8, 16]
        assert counts == [st["prefix_hit_tokens"], st["prefix_miss_tokens"]]
