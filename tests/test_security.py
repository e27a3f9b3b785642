"""Security: socket and directory permissions, private segments, peer uid checks,
hand-off tokens, configured limits, and bad API input that must change nothing."""

import array
import logging
import math
import os
import pickle
import shutil
import socket
import stat
import subprocess
import tempfile
import time

import pytest
import torch
from conftest import SPAWN, join_or_kill

import shmkv
from shmkv.coordinator.server import runtime_dir

STATE_KEYS = (
    "num_blocks",
    "free_blocks",
    "cached_blocks",
    "referenced_blocks",
    "sequences",
    "handoffs",
    "prefix_index_blocks",
    "evictions",
    "cow_copies",
    "published_blocks",
)
NOBODY = 65534

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to switch uid")


def state(client) -> dict:
    stats = client.stats()
    return {k: stats[k] for k in STATE_KEYS}


class Unchanged:
    """Asserts that the coordinator's metadata and every byte of the pool are unchanged
    across the ``with`` block."""

    def __init__(self, client):
        self.client = client

    def __enter__(self):
        self.state = state(self.client)
        self.pool = self.client.pool.clone()
        return self

    def __exit__(self, exc_type, *_):
        if exc_type is None:
            assert state(self.client) == self.state
            assert torch.equal(self.client.pool, self.pool), "the pool changed"


def wait_until(predicate, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"not true within {timeout} s"
        time.sleep(0.01)


# -- permissions -------------------------------------------------------------------------


def test_socket_dir_is_0700_and_socket_0600(coord):
    directory = os.path.dirname(coord.address)
    st_dir = os.stat(directory)
    assert stat.S_ISDIR(st_dir.st_mode) and stat.S_IMODE(st_dir.st_mode) == 0o700
    assert st_dir.st_uid == os.getuid()
    st_sock = os.stat(coord.address)
    assert stat.S_ISSOCK(st_sock.st_mode) and stat.S_IMODE(st_sock.st_mode) == 0o600
    assert st_sock.st_uid == os.getuid()


def test_runtime_dir_is_tightened_and_must_be_ours(tmp_path, monkeypatch):
    monkeypatch.delenv("SHMKV_RUNTIME_DIR", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    loose = tmp_path / "shmkv"
    loose.mkdir(mode=0o755)
    os.chmod(loose, 0o755)
    assert runtime_dir() == str(loose)
    assert stat.S_IMODE(os.stat(loose).st_mode) == 0o700
    if os.geteuid() == 0:
        os.chown(loose, NOBODY, NOBODY)
        with pytest.raises(shmkv.AccessDenied, match="belongs to uid"):
            runtime_dir()


def test_segments_have_no_names_and_are_private(coord, client):
    assert not [n for n in os.listdir("/dev/shm") if n.startswith("shmkv-")]
    fd_dir = "/proc/self/fd"
    segments = []
    for fd in os.listdir(fd_dir):
        try:
            target = os.readlink(os.path.join(fd_dir, fd))
        except OSError:
            continue
        if target.startswith("/dev/shm/shmkv-"):
            segments.append((target, os.stat(os.path.join(fd_dir, fd))))
    assert segments, "the coordinator's segment descriptors were not found"
    for target, st in segments:
        assert target.endswith("(deleted)"), target
        assert stat.S_IMODE(st.st_mode) == 0o600
    with open("/proc/self/maps") as maps:
        mapped = [line for line in maps if "/dev/shm/shmkv-" in line]
    assert mapped and all(line.rstrip().endswith("(deleted)") for line in mapped)


def connect_as_nobody(addresses, queue):
    """Drop to uid/gid 65534, try to connect to each address, report what happened."""
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)
    for address in addresses:
        try:
            shmkv.connect(address, timeout=5).close()
            queue.put(("connected", "", os.getuid()))
        except Exception as exc:
            queue.put((type(exc).__name__, str(exc), os.getuid()))
    queue.close()
    queue.join_thread()


@root_only
def test_other_users_are_refused(small_config, unique_name, coord):
    """The directory keeps other users out; behind it, SO_PEERCRED refuses them too."""
    directory = tempfile.mkdtemp(prefix="shmkv-peer-")
    try:
        os.chmod(directory, 0o755)
        address = os.path.join(directory, "c.sock")
        with shmkv.Coordinator(small_config, address=address) as open_coord:
            os.chmod(address, 0o666)  # loosen the file layer to reach the peer check
            with shmkv.connect(address, timeout=10) as mine:
                h = mine.allocate(4)
                q = SPAWN.Queue()
                child = SPAWN.Process(target=connect_as_nobody, args=([coord.address, address], q))
                child.start()
                default_result = q.get(timeout=60)
                peer_result = q.get(timeout=30)
                assert join_or_kill(child) == 0
                assert default_result[0] == "PermissionError" and default_result[2] == NOBODY
                assert peer_result[0] == "AccessDenied", peer_result
                assert f"uid {NOBODY} may not use" in peer_result[1]
                stats = mine.stats()
                assert stats["refused_connections"] == 1 and stats["connections"] == 1
                h.write(0, torch.ones(4, 4, 8), torch.ones(4, 4, 8), start=0)
                assert torch.equal(h.key_cache(0), torch.ones(4, 4, 8))
        assert open_coord.num_refused == 1
    finally:
        shutil.rmtree(directory, ignore_errors=True)


# -- hand-off tokens ---------------------------------------------------------------------


def test_forged_and_malformed_tokens_fail(client):
    h = client.allocate(6)
    h.write(0, torch.ones(6, 4, 8), torch.ones(6, 4, 8), start=0)
    token = h.export(ttl=30)
    with Unchanged(client):
        wrong_secret = token[:-1] + bytes([token[-1] ^ 1])
        forged = [
            wrong_secret,
            token[:9] + os.urandom(16),
            b"\x01" + os.urandom(24),
            token[:1] + (2).to_bytes(8, "big") + token[9:],
            b"\x02" + token[1:],
            token[:-1],
            token + b"\x00",
            b"",
        ]
        for bad in forged:
            with pytest.raises(shmkv.HandoffError):
                client.open(bad)
        with pytest.raises(shmkv.WrongType):
            client.open(token.hex())
        assert client.stats()["handoffs"] == 1
    opened = client.open(token)  # the failed attempts did not consume it
    assert torch.equal(opened.key_cache(0), torch.ones(6, 4, 8))


def test_a_token_opens_once_only(coord, client):
    h = client.allocate(3)
    token = h.export(ttl=30)
    with shmkv.connect(coord.address, timeout=10) as other:
        first = other.open(token)
        with Unchanged(client):
            with pytest.raises(shmkv.HandoffError, match="already opened"):
                other.open(token)
            with pytest.raises(shmkv.HandoffError):
                client.open(token)
        assert first.num_tokens == 3 and client.stats()["handoffs"] == 0


def test_expired_token_fails_and_its_reference_is_gone(client):
    before = state(client)
    h = client.allocate(8)
    token = h.export(ttl=0.3)
    h.close()
    assert client.stats()["referenced_blocks"] == 2
    time.sleep(0.5)
    with pytest.raises(shmkv.HandoffError, match="expired"):
        client.open(token)
    after = state(client)
    assert after["handoffs"] == 0 and after["referenced_blocks"] == 0
    assert after["sequences"] == before["sequences"]
    assert client.stats()["expired_handoffs"] == 1  # it expired, not something else


def test_a_token_of_another_coordinator_fails(small_config, unique_name, client):
    token = client.allocate(2).export(ttl=30)
    with (
        shmkv.Coordinator(small_config, name=unique_name + "-b") as other_coord,
        shmkv.connect(other_coord.address, timeout=10) as other,
    ):
        theirs = other.allocate(2).export(ttl=30)  # the same hand-off id over there
        assert theirs[:9] == token[:9]
        with Unchanged(other):
            with pytest.raises(shmkv.HandoffError):
                other.open(token)
        other.open(theirs).close()


def test_bad_ttl_is_refused(client):
    h = client.allocate(2)
    with Unchanged(client):
        for ttl in (0, -1.0, math.nan, math.inf, 3601.0):
            with pytest.raises(shmkv.InvalidArgument):
                h.export(ttl=ttl)
        with pytest.raises(shmkv.WrongType):
            h.export(ttl="10")


# -- limits ------------------------------------------------------------------------------


def test_max_connections(small_config, unique_name):
    with shmkv.Coordinator(small_config, name=unique_name, max_connections=2) as coord:
        a = shmkv.connect(coord.address, timeout=10)
        b = shmkv.connect(coord.address, timeout=10)
        h = a.allocate(4)
        with Unchanged(a):
            for _ in range(40):  # refused before or after the hello is sent: same error
                with pytest.raises(shmkv.LimitExceeded, match="the limit is 2"):
                    shmkv.connect(coord.address, timeout=10)
        a.ping()
        b.ping()
        assert a.stats()["refused_connections"] == 40
        b.close()
        wait_until(lambda: a.stats()["connections"] == 1, 2.0)
        with shmkv.connect(coord.address, timeout=10) as c:
            c.ping()
        h.close()
        a.close()


def test_max_frame(small_config, unique_name):
    with (
        shmkv.Coordinator(small_config, name=unique_name, max_frame=4096) as coord,
        shmkv.connect(coord.address, timeout=10) as keeper,
    ):
        h = keeper.allocate(4)
        h.write(0, torch.ones(4, 4, 8), torch.ones(4, 4, 8), start=0)
        with Unchanged(keeper):
            for n in (2000, 300_000):  # below, and far above, the socket buffer
                sender = shmkv.connect(coord.address, timeout=10)
                held = sender.allocate(2)
                # refused before it is sent: the client knows the coordinator's limit
                with pytest.raises(shmkv.LimitExceeded, match="maximum frame of 4096"):
                    sender.allocate(prompt=list(range(n)))
                sender.ping()  # the connection stays, and so do its sequences
                assert held.is_valid() and held.num_tokens == 2
                held.close()
                sender.close()
            keeper.ping()
            wait_until(lambda: keeper.stats()["connections"] == 1, 2.0)
        assert torch.equal(h.key_cache(0), torch.ones(4, 4, 8))
        with shmkv.connect(coord.address, timeout=10) as again:
            again.allocate(prompt=list(range(100))).close()


def test_max_handoffs(small_config, unique_name):
    with (
        shmkv.Coordinator(small_config, name=unique_name, max_handoffs=3) as coord,
        shmkv.connect(coord.address, timeout=10) as client,
    ):
        handles = [client.allocate(1) for _ in range(5)]
        tokens = [h.export(ttl=30) for h in handles[:3]]
        with Unchanged(client):
            with pytest.raises(shmkv.LimitExceeded, match="3 hand-offs outstanding, the limit"):
                handles[3].export(ttl=30)
        with shmkv.connect(coord.address, timeout=10) as other:
            other.ping()
            with pytest.raises(shmkv.LimitExceeded):
                other.allocate(1).export(ttl=30)
            other.open(tokens[0]).close()
        tokens.append(handles[3].export(ttl=30))
        assert client.stats()["handoffs"] == 3
        for token in tokens[1:]:
            client.open(token).close()
        assert client.stats()["handoffs"] == 0


# -- bad API input -----------------------------------------------------------------------


def test_bad_tensors_raise_and_write_nothing(client):
    h = client.allocate(6)
    h.write_all(torch.randn(3, 2, 6, 4, 8), start=0)
    good = torch.randn(2, 4, 8)
    cases = [
        (shmkv.InvalidArgument, "dtype", good.double(), good),
        (shmkv.InvalidArgument, "dtype", good, good.half()),
        (shmkv.InvalidArgument, "on meta", torch.empty(2, 4, 8, device="meta"), good),
        (shmkv.InvalidArgument, "shape", torch.randn(2, 3, 8), good),
        (shmkv.InvalidArgument, "shape", good, torch.randn(2, 4, 9)),
        (shmkv.InvalidArgument, "shape", torch.randn(2, 32), good),
        (shmkv.InvalidArgument, "shape", torch.randn(1, 2, 4, 8), good),
        (shmkv.InvalidArgument, "not contiguous", torch.randn(8, 4, 2).permute(2, 1, 0), good),
        (shmkv.InvalidArgument, "not contiguous", good, torch.randn(4, 8, 2).permute(2, 0, 1)),
        (shmkv.InvalidArgument, "k has 2 tokens", good, torch.randn(3, 4, 8)),
        (shmkv.WrongType, "torch.Tensor", good.tolist(), good),
        (shmkv.WrongType, "torch.Tensor", good, None),
    ]
    with Unchanged(client):
        for exc, match, k, v in cases:
            with pytest.raises(exc, match=match):
                h.write(0, k, v, start=0)
        for bad_kv in (
            torch.randn(3, 2, 2, 4, 8).double(),
            torch.randn(2, 2, 2, 4, 8),
            torch.randn(3, 2, 2, 4, 8).transpose(3, 4).contiguous(),
            torch.randn(3, 2, 4, 2, 8).transpose(2, 3),
            torch.randn(3, 2, 4, 8),
        ):
            with pytest.raises(shmkv.InvalidArgument):
                h.write_all(bad_kv, start=0)


def test_bad_layers_and_positions_raise_and_write_nothing(client):
    h = client.allocate(6)
    kv = torch.randn(2, 4, 8)
    with Unchanged(client):
        for layer in (-1, 3, 100):
            for call in (
                lambda n=layer: h.write(n, kv, kv, start=0),
                lambda n=layer: h.key_cache(n),
                lambda n=layer: h.value_cache(n),
                lambda n=layer: h.paged_kv(n),
            ):
                with pytest.raises(shmkv.OutOfRange):
                    call()
        for layer in (True, 1.0, "0", None):
            with pytest.raises(shmkv.WrongType):
                h.write(layer, kv, kv, start=0)
        for start in (5, 6, 100, -1, -2):
            with pytest.raises(shmkv.OutOfRange, match="extend first|goes past"):
                h.write(0, kv, kv, start=start)
        with pytest.raises(shmkv.OutOfRange):
            h.write(0, torch.randn(7, 4, 8), torch.randn(7, 4, 8))
        with pytest.raises(shmkv.OutOfRange):
            h.write_all(torch.randn(3, 2, 2, 4, 8), start=5)
        for start in ("0", 1.0, True):
            with pytest.raises(shmkv.WrongType):
                h.write(0, kv, kv, start=start)
        with pytest.raises(shmkv.OutOfRange):
            h.with_sequence_length(7)
        with pytest.raises(shmkv.WrongType):
            h.with_sequence_length(2.0)
    assert h.num_tokens == 6


def test_bad_sizes_raise_and_allocate_nothing(client):
    h = client.allocate(6)
    empty = client.allocate(0)
    with Unchanged(client):
        with pytest.raises(shmkv.InvalidArgument):
            client.allocate(-1)
        with pytest.raises(shmkv.WrongType):
            client.allocate("3")
        with pytest.raises(shmkv.WrongType):
            client.allocate(prompt=[1, 2.5])
        with pytest.raises(shmkv.InvalidArgument, match="disagrees"):
            client.allocate(3, prompt=[1, 2])
        with pytest.raises(shmkv.InvalidArgument):
            h.extend(-1)
        with pytest.raises(shmkv.WrongType):
            h.extend(1.5)
        with pytest.raises(shmkv.InvalidArgument, match="tokens must be a list of 2"):
            h.extend(2, tokens=[1])
        with pytest.raises(shmkv.PoolExhausted):
            client.allocate_many([4, 4, 64 * 4])
        with pytest.raises(shmkv.PoolExhausted):
            h.extend(64 * 4)
        with pytest.raises(shmkv.PoolExhausted):
            client.extend_many([(h, 4), (empty, 64 * 4)])
        with pytest.raises(shmkv.OutOfRange):
            h.commit(7)
    assert h.num_tokens == 6


def test_closed_handles_and_clients_raise(coord, client):
    h = client.allocate(4)
    keep = client.allocate(4)
    h.close()
    kv = torch.randn(1, 4, 8)
    with Unchanged(client):
        calls = [
            lambda: h.write(0, kv, kv, start=0),
            lambda: h.write_all(torch.randn(3, 2, 1, 4, 8), start=0),
            lambda: h.key_cache(0),
            lambda: h.value_cache(0),
            lambda: h.gather_all(),
            lambda: h.paged_kv(0),
            lambda: h.extend(1),
            lambda: h.fork(),
            lambda: h.clone_handle(),
            lambda: h.export(),
            lambda: h.commit(),
            lambda: h.refresh(),
            lambda: h.with_sequence_length(1),
            lambda: client.extend_many([(keep, 1), (h, 1)]),
        ]
        for call in calls:
            with pytest.raises(shmkv.HandleClosed):
                call()
        h.close()
        client.close_many([h])
    assert keep.num_tokens == 4 and not h.is_valid()
    other = shmkv.connect(coord.address, timeout=10)
    g = other.allocate(4)
    other.close()
    with pytest.raises(shmkv.HandleClosed):
        g.key_cache(0)
    with pytest.raises(shmkv.HandleClosed):
        other.allocate(1)
    wait_until(lambda: client.stats()["referenced_blocks"] == 1, 2.0)


def test_foreign_handles_are_refused(coord, client, small_config, unique_name):
    mine = client.allocate(4)
    mine.write(0, torch.ones(4, 4, 8), torch.ones(4, 4, 8), start=0)
    with shmkv.connect(coord.address, timeout=10) as other:
        theirs = other.allocate(4)
        shared = other.open(mine.export(ttl=30))  # the same sequence, another client
        with Unchanged(client):
            with pytest.raises(shmkv.InvalidArgument, match="not a handle of this client"):
                other.extend_many([(mine, 4)])
            with pytest.raises(shmkv.InvalidArgument, match="not a handle of this client"):
                other.close_many([theirs, mine])
            with pytest.raises(shmkv.InvalidArgument):
                client.close_many([shared])
            with pytest.raises(shmkv.InvalidArgument):
                other.extend_many([("kv-1", 1)])
        assert mine.is_valid() and theirs.is_valid() and shared.is_valid()
        assert mine.num_tokens == 4 and shared.num_tokens == 4
        shared.close()
        theirs.close()
    mine.close()
    wait_until(lambda: client.stats()["referenced_blocks"] == 0, 2.0)

    # a handle of another coordinator whose cache id exists here too
    with (
        shmkv.Coordinator(small_config, name=unique_name + "-b") as coord_b,
        shmkv.connect(coord_b.address, timeout=10) as client_b,
    ):
        here = client.allocate(4)
        # A cache id is (serial << slot bits) | slot: hold B's lower slots, and close
        # sequences in the target slot until B's serial reaches here's.
        slot = here._slot
        there = []
        for _ in range(1000):
            h = client_b.allocate(4)
            if h._cache_id == here._cache_id or h._slot < slot:
                there.append(h)
                if h._cache_id == here._cache_id:
                    break
            else:
                h.close()
        assert there[-1]._cache_id == here._cache_id
        with Unchanged(client), Unchanged(client_b):
            with pytest.raises(shmkv.InvalidArgument):
                client_b.extend_many([(here, 4)])
            with pytest.raises(shmkv.InvalidArgument):
                client_b.close_many([here])
        assert here.num_tokens == 4 and here.block_table.num_blocks() == 1
        here.close()
        client_b.close_many(there)


# -- the runtime directory in a shared temp dir --------------------------------------------


@pytest.fixture
def shared_tmp(tmp_path, monkeypatch):
    """``tempfile.gettempdir()`` is a fresh directory, and neither $SHMKV_RUNTIME_DIR nor
    $XDG_RUNTIME_DIR is set: runtime_dir() takes its temp-dir path."""
    monkeypatch.delenv("SHMKV_RUNTIME_DIR", raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def test_runtime_dir_never_follows_a_planted_symlink(shared_tmp, caplog):
    caplog.set_level(logging.WARNING, logger="shmkv")
    target = shared_tmp / "home"
    target.mkdir()
    os.chmod(target, 0o755)
    planted = shared_tmp / f"shmkv-{os.getuid()}"
    planted.symlink_to(target)
    got = runtime_dir()
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o755  # not chmod'ed through the link
    assert os.path.islink(planted) and os.readlink(planted) == str(target)
    assert got == f"{planted}-1"
    st = os.lstat(got)
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700
    assert st.st_uid == os.getuid()
    assert any(
        "is a symbolic link" in r.getMessage() and got in r.getMessage() for r in caplog.records
    ), caplog.text
    assert runtime_dir() == got  # stable: the same walk
    planted.unlink()
    (shared_tmp / f"shmkv-{os.getuid()}").write_text("")  # a plain file: also taken
    assert runtime_dir() == got


def meet_by_name(tmp_dir: str, name: str, queue) -> None:
    """In a fresh process with the same temp dir: find the named coordinator and ping it."""
    os.environ.pop("SHMKV_RUNTIME_DIR", None)
    os.environ.pop("XDG_RUNTIME_DIR", None)
    tempfile.tempdir = tmp_dir
    try:
        address = shmkv.default_address(name)
        with shmkv.connect(address, timeout=10) as client:
            client.ping()
        queue.put(("ok", address))
    except Exception as exc:
        queue.put((type(exc).__name__, str(exc)))
    queue.close()
    queue.join_thread()


@root_only
def test_runtime_dir_of_another_owner_falls_back_and_named_coordinators_meet(
    shared_tmp, small_config, unique_name, caplog
):
    caplog.set_level(logging.WARNING, logger="shmkv")
    taken = shared_tmp / f"shmkv-{os.getuid()}"
    taken.mkdir(mode=0o700)
    os.chown(taken, NOBODY, NOBODY)  # another user was first
    os.chmod(taken, 0o700)
    with shmkv.Coordinator(small_config, name=unique_name) as coord:
        assert os.path.dirname(coord.address) == f"{taken}-1"
        assert os.lstat(taken).st_uid == NOBODY  # left as it was
        assert stat.S_IMODE(os.lstat(taken).st_mode) == 0o700
        q = SPAWN.Queue()
        child = SPAWN.Process(target=meet_by_name, args=(str(shared_tmp), unique_name, q))
        child.start()
        result = q.get(timeout=60)
        assert join_or_kill(child) == 0
        assert result == ("ok", coord.address), result
    assert any(f"belongs to uid {NOBODY}" in r.getMessage() for r in caplog.records), caplog.text


def test_runtime_dir_when_every_name_is_taken_is_private_and_said(shared_tmp, caplog):
    caplog.set_level(logging.WARNING, logger="shmkv")
    first = shared_tmp / f"shmkv-{os.getuid()}"
    for path in [first] + [f"{first}-{k}" for k in range(1, 9)]:
        os.symlink("/nonexistent", path)
    got = runtime_dir()
    assert os.path.dirname(got) == str(shared_tmp)
    assert os.path.basename(got).startswith(f"shmkv-{os.getuid()}.")
    st = os.lstat(got)
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700
    assert runtime_dir() == got  # stable in this process
    assert any(
        got in r.getMessage() and "SHMKV_RUNTIME_DIR" in r.getMessage() for r in caplog.records
    ), caplog.text


# -- /dev/shm entries of other users -------------------------------------------------------


@root_only
def test_a_planted_shm_entry_of_another_user_neither_blocks_a_start_nor_is_removed(
    small_config, unique_name
):
    dead = subprocess.Popen(["true"])
    dead.wait(timeout=30)  # a pid that no longer runs
    name = f"shmkv-{dead.pid}-{os.urandom(8).hex()}"
    path = os.path.join("/dev/shm", name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    try:
        os.close(fd)
        os.chown(path, NOBODY, NOBODY)
        before = os.lstat(path)
        with shmkv.Coordinator(small_config, name=unique_name) as coord:
            with shmkv.connect(coord.address, timeout=10) as client:
                client.ping()
        after = os.lstat(path)  # untouched
        assert (after.st_ino, after.st_uid, stat.S_IMODE(after.st_mode)) == (
            before.st_ino,
            NOBODY,
            0o600,
        )
    finally:
        if os.path.lexists(path):
            os.unlink(path)


# -- the coordinator's uid, checked by the client ----------------------------------------


def listen_as_nobody(directory: str, queue) -> None:
    """Bind a socket in ``directory`` as root, become uid 65534, then listen (the peer
    credentials are the listener's at listen()) and report every byte each of two
    connections sent before closing."""
    address = os.path.join(directory, "planted.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(address)
    os.chmod(address, 0o666)
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)
    sock.listen(4)
    sock.settimeout(60)
    queue.put(("listening", address, os.getuid()))
    for _ in range(2):
        conn, _ = sock.accept()
        conn.settimeout(5)
        got = b""
        try:
            while True:
                data = conn.recv(65536)
                if not data:
                    break
                got += data
                if len(got) > 16:  # a hello arrived: enough to tell
                    break
        except socket.timeout:
            pass
        conn.close()
        queue.put(("received", got))
    sock.close()
    queue.close()
    queue.join_thread()


@root_only
def test_connect_refuses_a_coordinator_of_another_uid_and_sends_nothing(tmp_path):
    q = SPAWN.Queue()
    child = SPAWN.Process(target=listen_as_nobody, args=(str(tmp_path), q))
    child.start()
    try:
        what, address, uid = q.get(timeout=60)
        assert what == "listening" and uid == NOBODY
        with pytest.raises(shmkv.AccessDenied, match=f"runs as uid {NOBODY}") as info:
            shmkv.connect(address, timeout=10)
        assert "trust_uid" in str(info.value)
        assert q.get(timeout=30) == ("received", b"")  # not even the hello
        # opting in: the client speaks to it (which here only hangs up)
        with pytest.raises(shmkv.CoordinatorGone):
            shmkv.connect(address, timeout=10, trust_uid=NOBODY)
        what, got = q.get(timeout=30)
        assert what == "received" and len(got) > 16
        assert join_or_kill(child) == 0
    finally:
        if child.is_alive():
            child.kill()
            child.join(5)
    with pytest.raises(shmkv.InvalidArgument):
        shmkv.connect(address, trust_uid="nobody")


# -- the address lock: another uid can neither take nor block it ------------------------


def squat_as_nobody(address: str, queue, inbox) -> None:
    """As uid 65534: bind every abstract-namespace name a lock of ``address`` could have
    had (uid 0's, by the old scheme's digest) and try to plant its lock file; report,
    then hold what was bound until told to stop."""
    import hashlib

    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)
    digest = hashlib.blake2b(os.path.realpath(address).encode(), digest_size=12).hexdigest()
    squat = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    squat.bind(f"\0shmkv-lock-0-{digest}".encode())
    try:
        open(address + ".lock", "x").close()
        planted = "planted"
    except OSError as exc:
        planted = type(exc).__name__
    queue.put(("squatting", planted, os.getuid()))
    inbox.get(timeout=120)  # "stop"
    squat.close()


@root_only
def test_another_uid_cannot_block_a_named_coordinator(small_config, unique_name):
    address = shmkv.coordinator.server.default_address(unique_name)
    to_child, from_child = SPAWN.Queue(), SPAWN.Queue()
    child = SPAWN.Process(target=squat_as_nobody, args=(address, from_child, to_child))
    child.start()
    try:
        what, planted, uid = from_child.get(timeout=60)
        assert what == "squatting" and uid == NOBODY
        assert planted == "PermissionError"  # the runtime directory keeps it out
        with shmkv.Coordinator(small_config, name=unique_name) as coord:
            with shmkv.connect(coord.address, timeout=10) as client:
                assert client.allocate(4).num_tokens == 4
            assert os.path.exists(shmkv.coordinator.server.lock_path(address))
        assert not os.path.lexists(address)
        assert not os.path.lexists(shmkv.coordinator.server.lock_path(address))
    finally:
        to_child.put("stop")
        assert join_or_kill(child) == 0


def plant_lock_as_nobody(path: str, queue) -> None:
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)
    with open(path, "x") as f:
        f.write("mine")
    queue.put(os.stat(path).st_uid)


@root_only
def test_a_lock_file_planted_by_another_uid_is_refused_and_left_alone(small_config):
    directory = tempfile.mkdtemp(prefix="shmkv-shared-")
    try:
        os.chmod(directory, 0o1777)  # a shared, sticky directory, like /tmp
        address = os.path.join(directory, "c.sock")
        q = SPAWN.Queue()
        child = SPAWN.Process(target=plant_lock_as_nobody, args=(address + ".lock", q))
        child.start()
        assert q.get(timeout=60) == NOBODY
        assert join_or_kill(child) == 0
        with pytest.raises(shmkv.AccessDenied, match="lock file .*c.sock.lock"):
            shmkv.Coordinator(small_config, address=address).open()
        assert sorted(os.listdir(directory)) == ["c.sock.lock"]  # no socket, file kept
        with open(address + ".lock") as f:
            assert f.read() == "mine"
    finally:
        shutil.rmtree(directory)


def test_a_symbolic_link_at_the_lock_path_is_refused(small_config, tmp_path):
    target = tmp_path / "elsewhere"
    target.write_text("keep")
    address = str(tmp_path / "c.sock")
    os.symlink(target, address + ".lock")
    with pytest.raises(shmkv.AccessDenied, match="symbolic link"):
        shmkv.Coordinator(small_config, address=address).open()
    assert target.read_text() == "keep"
    assert sorted(os.listdir(tmp_path)) == ["c.sock.lock", "elsewhere"]
    with pytest.raises(shmkv.AccessDenied, match="symbolic link"):
        shmkv.coordinator.server.remove_stale_socket(address)


@pytest.mark.parametrize("kind", ["directory", "fifo", "socket"])
def test_a_lock_path_that_is_not_a_file_is_refused_and_left_alone(small_config, tmp_path, kind):
    address = str(tmp_path / "c.sock")
    lock = address + ".lock"
    planted = None
    if kind == "directory":
        os.mkdir(lock)
    elif kind == "fifo":
        os.mkfifo(lock)
    else:
        planted = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        planted.bind(lock)
    try:
        with pytest.raises(shmkv.AccessDenied, match="lock file"):
            shmkv.Coordinator(small_config, address=address).open()
        with pytest.raises(shmkv.AccessDenied, match="lock file"):
            shmkv.coordinator.server.remove_stale_socket(address)
        assert sorted(os.listdir(tmp_path)) == ["c.sock.lock"]  # no socket, the entry kept
    finally:
        if planted is not None:
            planted.close()


def test_a_killed_coordinators_lock_is_free_and_its_files_are_replaced(small_config, tmp_path):
    address = str(tmp_path / "c.sock")
    spawned = shmkv.SpawnedCoordinator.start(small_config, address=address)
    try:
        with shmkv.connect(address, timeout=30) as client:
            client.allocate(4)
        with pytest.raises(shmkv.ShmkvError, match="served by a live coordinator"):
            shmkv.Coordinator(small_config, address=address).open()
    finally:
        spawned.kill()
    assert sorted(os.listdir(tmp_path)) == ["c.sock", "c.sock.lock"]  # as a crash leaves
    with shmkv.Coordinator(small_config, address=address) as coord:
        with shmkv.connect(coord.address, timeout=10) as client:
            assert client.allocate(4).num_tokens == 4
    assert os.listdir(tmp_path) == []
    spawned = shmkv.SpawnedCoordinator.start(small_config, address=address)
    spawned.kill()
    assert shmkv.coordinator.server.remove_stale_socket(address)
    assert os.listdir(tmp_path) == []


# -- addresses are compared resolved ------------------------------------------------------


def test_a_relative_spelling_of_the_address_finds_the_ranks_client(tmp_path, monkeypatch):
    cfg = shmkv.PoolConfig(
        num_layers=1,
        num_kv_heads=2,
        head_dim=4,
        num_blocks=8,
        block_size=4,
        dtype=torch.float32,
        tp_size=2,
    )
    address = str(tmp_path / "c.sock")
    with shmkv.Coordinator(cfg, address=address):
        monkeypatch.chdir(tmp_path)
        with (
            shmkv.connect(address, timeout=10) as sender,
            shmkv.connect("c.sock", tp_rank=1, tp_size=2, timeout=10) as rank,
        ):
            assert rank.address == sender.address == os.path.realpath(address)
            h = sender.allocate(4)
            with rank.as_unpickle_target():  # made current: this spelling
                got = pickle.loads(pickle.dumps(h))
            assert got._client is rank
            got.close()
            data = pickle.dumps(h)
            sender.close()  # now the only client
            got = pickle.loads(data)
            assert got._client is rank and got._client.tp_rank == 1
            got.close()


def test_open_takes_any_bytes_like_token(client):
    h = client.allocate(4)
    h.write(0, torch.ones(4, 4, 8), torch.ones(4, 4, 8), start=0)
    for convert in (
        bytes,
        bytearray,
        memoryview,
        lambda t: memoryview(bytearray(t)),
        lambda t: array.array("B", t),
    ):
        opened = client.open(convert(h.export(ttl=30)))
        assert torch.equal(opened.key_cache(0), torch.ones(4, 4, 8))
        opened.close()
    for bad in ("token", 12, None):
        with Unchanged(client), pytest.raises(shmkv.WrongType):
            client.open(bad)
    h.close()
