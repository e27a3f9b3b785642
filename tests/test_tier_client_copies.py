"""Promotion by the client: an allocation that waits for tier blocks copies them in itself
(``Client.copy_promotions``, ``shmkv.tiers``), then reports them (``promoted``).

Real coordinators (in a thread of the test), real clients (in the test and in spawned
processes), real files. What is shown: the copies run in the client and not in the tier
I/O process; a client killed in the middle of its copies leaves nothing pinned or held
and publishes nothing; reports that do not fit the promotion are refused and change
nothing; the host tier reaches clients read-only; a client waits for its copies before
it closes. And what a hostile review found: no copy lands after its client has closed
(one that ran past the wait, one that waited for another's), a failed report after a
commit past the hit, malformed error items, ``tier_memory`` behind unread answers, a
client that sees another folder at the disk tier's path.
"""

import contextlib
import os
import signal
import socket
import threading
import time

import pytest
import tier_faults
from conftest import SPAWN, join_or_kill
from test_tiers import (
    BS,
    RawConnection,
    block_files,
    in_tier_only,
    make_config,
    prompts_of,
    read_prompt,
    tier,
    tier_coordinator,
    token_kv,
    wait_idle,
    write_prompt,
)

import shmkv
from shmkv import hashing, protocol, tiers as tiers_mod
from shmkv.memory import block_io


@pytest.fixture(autouse=True)
def clients_copy(monkeypatch):
    """Clients copy their promotions here though the coordinator runs in this process
    (where they would not by default: ``Client.copy_promotions``)."""
    monkeypatch.setattr(shmkv.Client, "copy_promotions", True)


def _until(condition, what: str, timeout: float = 20.0) -> None:
    """Poll ``condition`` until it holds; fail with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def _tier_spec(kind, tmp_path, cfg):
    if kind == "host":
        return shmkv.HostTier(8 * cfg.block_nbytes)
    return shmkv.DiskTier(str(tmp_path / "disk"), 1 << 24)


@pytest.mark.parametrize("kind", ["host", "disk"])
def test_the_client_copies_what_the_io_process_cannot(tmp_path, unique_name, monkeypatch, kind):
    # Every promotion copy fails in the tier I/O process. A client that copies its own
    # promotions (the default) still gets its whole prompt, exact; one that leaves them to
    # the coordinator gets no tier block (the control: the fault bites).
    monkeypatch.setattr(tiers_mod, "IO_PROCESS_PRELOAD", tier_faults.spec("failing_promotions"))
    cfg = make_config(num_blocks=8)
    prompt = prompts_of(1, 3)[0]
    with tier_coordinator(cfg, unique_name, _tier_spec(kind, tmp_path, cfg)) as (coord, client):
        in_tier_only(client, prompt)
        client.copy_promotions = False
        client._copies = None  # (decided again at the next allocation)
        assert read_prompt(client, prompt) == (0, True)
        wait_idle(client)
        in_tier_only(client, prompt)  # (the failed promotion dropped nothing; evicted again)
        client.copy_promotions = True
        client._copies = None
        assert read_prompt(client, prompt) == (len(prompt), True)
        st = wait_idle(client)
        assert tier(st, kind)["promotions"] == 3
        assert st["tier_io"]["promotions_in_flight"] == 0


def _promote_slowly_then_wait(address, prompt, started):
    """A client whose copies from the host tier take 0.5 s each: it allocates the prompt
    (killed by the test in the middle of its copies)."""
    tier_faults.slow_h2p(block_io)
    with shmkv.connect(address, timeout=20) as client:
        assert client.copy_promotions is None  # (the default: a coordinator of another process)
        started.set()
        client.allocate(prompt=prompt)
        time.sleep(60)


def test_a_client_killed_mid_copy_leaves_nothing_pinned_or_held(unique_name):
    cfg = make_config(num_blocks=8)
    prompt = prompts_of(1, 3)[0]
    with tier_coordinator(cfg, unique_name) as (coord, client):
        in_tier_only(client, prompt)
        free = client.stats()["free_blocks"] + client.stats()["cached_blocks"]
        started = SPAWN.Event()
        child = SPAWN.Process(
            target=_promote_slowly_then_wait, args=(coord.address, prompt, started)
        )
        child.start()
        try:
            assert started.wait(30)
            _until(lambda: coord.tiers.num_promotions_in_flight == 1, "no promotion")
            entries = list(coord.tiers.host.index.values())
            assert [e.pins for e in entries] == [1, 1, 1]  # read by the child's copies
            os.kill(child.pid, signal.SIGKILL)
        finally:
            join_or_kill(child)
        st = wait_idle(client)
        assert st["tier_io"]["promotions_in_flight"] == 0
        assert [e.pins for e in coord.tiers.host.index.values()] == [0, 0, 0]
        assert st["free_blocks"] + st["cached_blocks"] == free  # its blocks came back
        # Nothing it half-copied was published: the prompt is still a tier hit, exact.
        keys = hashing.block_keys(prompt, BS, hashing.root_key())
        assert coord.table.pool.lookup(keys) == []
        assert read_prompt(client, prompt) == (len(prompt), True)


def _copy_request(prompt):
    return (
        "allocate_many",
        {
            "requests": [{"num_tokens": len(prompt), "prompt": prompt}],
            "copy": True,
        },
    )


@contextlib.contextmanager
def _raw_promotion(coord, prompt):
    """A connection speaking the wire protocol by hand that allocated ``prompt`` asking
    to copy its promotion: ``(raw, copy)``, the copies its answer named."""
    raw = RawConnection(coord.address)
    try:
        raw.send(_copy_request(prompt))
        yield raw, raw.wait(2)[1]["copy"]
    finally:
        raw.close()


def _last_answer(raw):
    """The response (not unwrapped) to the last request ``raw`` sent."""
    want = raw._next - 1
    deadline = time.monotonic() + 20
    while True:
        assert time.monotonic() < deadline
        data = raw.sock.recv(1 << 16)
        assert data, "the coordinator closed the connection"
        for obj in raw._decoder.feed(data):
            response = protocol.parse_response(obj)
            if response.request_id == want:
                return response


def test_reports_that_do_not_fit_the_promotion_are_refused_and_change_nothing(unique_name):
    cfg = make_config(num_blocks=8)
    prompt = prompts_of(1, 2)[0]
    with tier_coordinator(cfg, unique_name) as (coord, client):
        in_tier_only(client, prompt)
        with _raw_promotion(coord, prompt) as (raw, copy):
            assert copy["ops"] == bytes([block_io.OP_H2P]) * 2
            assert coord.tiers.num_promotions_in_flight == 1
            ok = bytes([block_io.OK])
            for args in (
                {"id": copy["id"] + 1, "statuses": ok * 2},  # not a promotion of its own
                {"id": copy["id"], "statuses": ok},  # one status short
                {"id": copy["id"], "statuses": ok * 3},  # one too many
            ):
                raw.send(("promoted", args))
                with pytest.raises(shmkv.InvalidArgument):
                    _last_answer(raw).unwrap()
            # Nothing changed: still in flight, its sources still pinned.
            assert coord.tiers.num_promotions_in_flight == 1
            assert [e.pins for e in coord.tiers.host.index.values()] == [1, 1]
            # A host copy reported damaged is a failure (nothing to remove): the hit ends.
            damaged = bytes([block_io.OK, block_io.DAMAGED])
            raw.send(("promoted", {"id": copy["id"], "statuses": damaged}))
            infos = _last_answer(raw).unwrap()
            assert infos[0]["num_cached"] == BS  # the first block only
            assert coord.tiers.num_promotions_in_flight == 0
            assert [e.pins for e in coord.tiers.host.index.values()] == [0, 0]
            assert tier(client.stats(), "host")["blocks"] == 2  # both still in the tier
            raw.send(("promoted", {"id": copy["id"], "statuses": ok * 2}))  # again
            with pytest.raises(shmkv.InvalidArgument):
                _last_answer(raw).unwrap()


def test_a_connection_that_drops_before_its_report_unpins_its_sources(unique_name):
    cfg = make_config(num_blocks=8)
    prompt = prompts_of(1, 2)[0]
    with tier_coordinator(cfg, unique_name) as (coord, client):
        in_tier_only(client, prompt)
        free = client.stats()["free_blocks"] + client.stats()["cached_blocks"]
        raw = RawConnection(coord.address)
        raw.send(_copy_request(prompt))
        raw.wait(2)
        assert coord.tiers.num_promotions_in_flight == 1
        raw.close()
        st = wait_idle(client)
        assert [e.pins for e in coord.tiers.host.index.values()] == [0, 0]
        assert st["free_blocks"] + st["cached_blocks"] == free
        assert read_prompt(client, prompt) == (len(prompt), True)


def test_the_host_tier_reaches_clients_read_only(unique_name):
    cfg = make_config(num_blocks=8)
    with tier_coordinator(cfg, unique_name) as (coord, client):
        copies = client._tier_copies()
        assert copies is not None
        host = copies.mover.host_np
        assert host.shape == (8, cfg.block_nbytes)
        assert not host.flags.writeable
        with pytest.raises(ValueError):
            host.setflags(write=True)  # (its mapping is PROT_READ)
        fds = []
        client.request_fds("tier_memory", fds)
        try:
            assert len(fds) == 1
            with pytest.raises(OSError):
                os.write(fds[0], b"x")  # a descriptor opened O_RDONLY
        finally:
            for fd in fds:
                os.close(fd)


def test_close_waits_for_the_clients_own_copies(unique_name, monkeypatch):
    tier_faults.slow_h2p(block_io, monkeypatch.setattr)  # (this process: the client's copies)
    cfg = make_config(num_blocks=8)
    prompt = prompts_of(1, 2)[0]
    with tier_coordinator(cfg, unique_name, clients=2) as (coord, writer, client):
        in_tier_only(writer, prompt)
        got = {}

        def allocate():
            got["handle"] = client.allocate(prompt=prompt)
            got["done"] = time.monotonic()

        thread = threading.Thread(target=allocate)
        thread.start()
        _until(lambda: client._copy_lock.locked(), "the copies never began")
        client.close()
        closed = time.monotonic()
        thread.join(20)
        assert got["done"] <= closed  # the copies and their report came first
        st = wait_idle(writer)
        assert (tier(st, "host")["promotions"], tier(st, "host")["errors"]) == (2, 0)
        assert st["tier_io"]["promotions_in_flight"] == 0
        assert [e.pins for e in coord.tiers.host.index.values()] == [0, 0]


def test_by_default_a_client_copies_only_where_the_coordinator_is_another_process(
    unique_name, monkeypatch
):
    # In the coordinator's own process the copies would hold the GIL its loop needs: the
    # tier I/O process copies them; a client of a coordinator of its own copies them.
    monkeypatch.setattr(shmkv.Client, "copy_promotions", None)
    cfg = make_config(num_blocks=8)
    prompt = prompts_of(1, 2)[0]
    with tier_coordinator(cfg, unique_name) as (coord, client):
        in_tier_only(client, prompt)
        assert read_prompt(client, prompt) == (len(prompt), True)
        assert client._tier_copies() is None
    tiers = [shmkv.HostTier(8 * cfg.block_nbytes)]
    with (
        shmkv.Coordinator.spawn(cfg, name=unique_name + "s", tiers=tiers) as coord,
        shmkv.connect(coord.address, timeout=20) as client,
    ):
        in_tier_only(client, prompt)
        assert read_prompt(client, prompt) == (len(prompt), True)
        assert client._tier_copies() is not None
        assert tier(wait_idle(client), "host")["promotions"] == 2


# -- found by a hostile review -----------------------------------------------------------------


def test_close_that_stops_waiting_ends_the_copies_before_the_connection(unique_name, monkeypatch):
    # A client (timeout 1 s) whose copies take 3 s is closed from another thread while it
    # copies. The coordinator frees its promoted blocks once the connection is gone, and
    # another client writes another prompt into them: no copy of the closed client may
    # land there after (it did: the prompt read back was wrong).
    tier_faults.slow_h2p(block_io, monkeypatch.setattr)  # (this process: the client's copies)
    cfg = make_config(num_blocks=6)
    prompt, other = prompts_of(2, 6)
    with tier_coordinator(cfg, unique_name) as (coord, writer):
        in_tier_only(writer, prompt)
        free = writer.stats()["free_blocks"] + writer.stats()["cached_blocks"]
        closing = shmkv.connect(coord.address, timeout=1)
        got = {}

        def allocate():
            try:
                got["handle"] = closing.allocate(prompt=prompt)
            except shmkv.ShmkvError as exc:
                got["error"] = exc

        thread = threading.Thread(target=allocate)
        thread.start()
        try:
            _until(lambda: closing._copy_lock.locked(), "the copies never began")
            closing.close()
            write_prompt(writer, other)  # (into the blocks the closed client had)
        finally:
            thread.join(20)
        assert not thread.is_alive()
        assert read_prompt(writer, other) == (len(other), True)
        st = wait_idle(writer)
        assert st["tier_io"]["promotions_in_flight"] == 0
        assert not [e.pins for e in coord.tiers.host.index.values() if e.pins]
        assert st["free_blocks"] + st["cached_blocks"] == free


def test_a_copy_that_waits_for_a_closing_client_never_begins(unique_name, monkeypatch):
    # Two threads of one client allocate while close() waits for the first one's copies:
    # the second one's copies, which wait for the first's, must not begin once close()
    # has gone on (they did, into blocks the coordinator had freed and given to another
    # prompt, whose K/V read back wrong).
    tier_faults.slow_h2p(block_io, monkeypatch.setattr)  # (this process: the client's copies)
    cfg = make_config(num_blocks=6)
    first, second = prompts_of(2, 3)
    other = prompts_of(1, 6, seed=3)[0]
    with tier_coordinator(cfg, unique_name) as (coord, writer):
        in_tier_only(writer, first, second)
        client = shmkv.connect(coord.address, timeout=20)
        got = {}

        def allocate(prompt):
            try:
                got[prompt[0]] = client.allocate(prompt=prompt)
            except shmkv.ShmkvError as exc:
                got[prompt[0]] = exc

        def until_in_flight(num):
            _until(lambda: coord.tiers.num_promotions_in_flight == num, "no promotion")

        threads = [threading.Thread(target=allocate, args=(first,))]
        threads[0].start()
        until_in_flight(1)
        _until(lambda: client._copy_lock.locked(), "the copies never began")
        threads.append(threading.Thread(target=client.close))
        threads[1].start()  # (waits for the first one's copies)
        time.sleep(0.05)
        threads.append(threading.Thread(target=allocate, args=(second,)))
        threads[2].start()  # (its copies wait for the first one's too)
        try:
            until_in_flight(2)
            threads[1].join(20)
            write_prompt(writer, other)  # (into the blocks the closed client had)
        finally:
            for thread in threads:
                thread.join(20)
        assert not any(thread.is_alive() for thread in threads)
        assert read_prompt(writer, other) == (len(other), True)
        st = wait_idle(writer)
        assert st["tier_io"]["promotions_in_flight"] == 0
        assert not [e.pins for e in coord.tiers.host.index.values() if e.pins]


def _prompt_past_the_tier(prompt):
    """``prompt`` and one more block no tier holds."""
    return prompt + [7] * BS


def test_a_failed_report_after_a_commit_past_the_hit_never_makes_it_negative(unique_name):
    # A sequence committed past its promoted blocks before its client reports them all
    # failed: the hit ends at its first promoted block (0), not below it; the hit and
    # miss counters move the promoted blocks only (the answer said num_cached -4, and
    # one block more than was a hit moved to the misses).
    cfg = make_config(num_blocks=16)
    prompt = prompts_of(1, 2)[0]
    longer = _prompt_past_the_tier(prompt)
    with tier_coordinator(cfg, unique_name) as (coord, client):
        in_tier_only(client, prompt)
        before = client.stats()
        with _raw_promotion(coord, longer) as (raw, copy):
            conn = next(c for c in coord._conns.values() if c.copying)
            cache_id = conn.copying[copy["id"]].context[0]["cache_id"]
            raw.send(("commit", {"cache_id": cache_id, "num_tokens": len(longer)}))
            _last_answer(raw).unwrap()
            failed = bytes([block_io.FAILED]) * 2
            raw.send(("promoted", {"id": copy["id"], "statuses": failed}))
            infos = _last_answer(raw).unwrap()
            assert infos[0]["num_cached"] == 0
        after = wait_idle(client)
        moved = {k: after[k] - before[k] for k in after if k.startswith("prefix_")}
        assert moved["prefix_hit_blocks"] == 0 and moved["prefix_miss_blocks"] == 3
        assert moved["prefix_hit_tokens"] == 0 and moved["prefix_miss_tokens"] == len(longer)


def test_an_early_answer_committed_past_before_its_promotion_fails_settles_at_zero(
    unique_name, monkeypatch
):
    # The same through the public API, where the I/O process copies: an allocation
    # answered early (wait=False) is written past its hit and committed, then every
    # promoted block fails. settle() said -4.
    monkeypatch.setattr(tiers_mod, "IO_PROCESS_PRELOAD", tier_faults.spec("late_failing_h2p"))
    cfg = make_config(num_blocks=16)
    prompt = prompts_of(1, 2)[0]
    longer = _prompt_past_the_tier(prompt)
    with tier_coordinator(cfg, unique_name) as (coord, client):
        in_tier_only(client, prompt)
        h = client.allocate(prompt=longer, wait=False)
        assert (h.num_cached_tokens, h.num_promoting_tokens) == (len(prompt), len(prompt))
        for layer in range(h.num_layers):
            k, v = token_kv(longer, layer, h.num_heads, h.head_dim)
            h.write(layer, k[len(prompt) :], v[len(prompt) :], start=len(prompt))
        h.commit(start=len(prompt))
        assert coord.tiers.num_promotions_in_flight == 1  # (committed before it failed)
        assert h.settle() == 0
        h.close()
        st = wait_idle(client)
        assert st["prefix_hit_blocks"] >= 0 and st["prefix_hit_tokens"] >= 0


def test_malformed_error_items_are_refused_and_change_nothing(unique_name):
    cfg = make_config(num_blocks=8)
    prompt = prompts_of(1, 2)[0]
    with tier_coordinator(cfg, unique_name) as (coord, client):
        in_tier_only(client, prompt)
        with _raw_promotion(coord, prompt) as (raw, copy):
            ok = bytes([block_io.OK]) * 2
            for errors in (
                [["0", "text"]],  # an index that is not an int
                [[0]],  # no text
                [[0, 5]],  # a text that is not one
                [[2, "text"]],  # a copy it does not have
                [[-1, "text"]],
                [[0, "a"], [0, "b"]],  # two for one copy
                [[0, "a"], [1, "b"], [0, "c"]],  # more than there are copies
                [[True, "text"]],
                ["0: text"],
            ):
                raw.send(("promoted", {"id": copy["id"], "statuses": ok, "errors": errors}))
                with pytest.raises(shmkv.InvalidArgument, match="promoted: errors"):
                    _last_answer(raw).unwrap()
            assert coord.tiers.num_promotions_in_flight == 1  # nothing changed
            assert [e.pins for e in coord.tiers.host.index.values()] == [1, 1]
            raw.send(("promoted", {"id": copy["id"], "statuses": ok, "errors": [[1, "x"]]}))
            assert _last_answer(raw).unwrap()[0]["num_cached"] == len(prompt)
        wait_idle(client)
        assert [e.pins for e in coord.tiers.host.index.values()] == [0, 0]


def test_tier_memory_after_answers_the_client_has_not_read_yet(unique_name):
    # A client that sends many requests and tier_memory at once, and reads them a second
    # later (its answers fill the socket meanwhile), gets the host tier's descriptor
    # with them; it was dropped ("descriptors could not be sent").
    cfg = make_config(num_blocks=8)
    with tier_coordinator(cfg, unique_name) as (coord, client):
        raw = RawConnection(coord.address)
        fds: list = []
        try:
            raw.wait(1)
            pings = 60000  # (their answers: more than a socket holds)
            raw.send(*[("ping", {})] * pings, ("tier_memory", {}))
            time.sleep(1)
            answers: dict = {}
            deadline = time.monotonic() + 20
            while pings + 1 not in answers:
                assert time.monotonic() < deadline
                data, got, _flags, _addr = socket.recv_fds(raw.sock, 1 << 16, 4)
                fds += got
                assert data, "the coordinator closed the connection"
                for obj in raw._decoder.feed(data):
                    response = protocol.parse_response(obj)
                    answers[response.request_id] = response
            assert answers[pings + 1].unwrap()["tiers"]["host"] == [8, cfg.block_nbytes]
            assert len(fds) == 1
            raw.send(("ping", {}))
            _last_answer(raw).unwrap()  # still connected
        finally:
            for fd in fds:
                os.close(fd)
            raw.close()


def _read_in_another_mount_namespace(address, blocks_dir, prompt, out):
    """A client whose view of the disk tier's folder is another (empty) folder: a mount
    namespace of its own with a tmpfs over it. Puts (cached tokens, exact) on ``out``,
    or the reason it cannot run."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    ms_rec, ms_private, clone_newns = 0x4000, 0x40000, 0x00020000
    if (
        libc.unshare(clone_newns) != 0
        or libc.mount(b"none", b"/", None, ms_rec | ms_private, None) != 0
        or libc.mount(b"tmpfs", blocks_dir.encode(), b"tmpfs", 0, None) != 0
    ):
        out.put(os.strerror(ctypes.get_errno()))
        return
    assert os.listdir(blocks_dir) == []
    with shmkv.connect(address, timeout=20) as client:
        client.copy_promotions = True
        out.put(read_prompt(client, prompt))


def test_a_client_that_sees_another_folder_leaves_the_block_files_alone(tmp_path, unique_name):
    # A client in another mount namespace (a container, say) finds no block file at the
    # disk tier's path: that is no damage, and the genuine files stay (each one it was
    # asked to copy was removed). Its promotions are left to the coordinator.
    cfg = make_config(num_blocks=8)
    prompt = prompts_of(1, 3)[0]
    spec = shmkv.DiskTier(str(tmp_path / "disk"), 1 << 24)
    with tier_coordinator(cfg, unique_name, spec) as (coord, client):
        in_tier_only(client, prompt)
        files = block_files(tmp_path / "disk")
        assert len(files) == 3
        out = SPAWN.Queue()
        child = SPAWN.Process(
            target=_read_in_another_mount_namespace,
            args=(coord.address, str(tmp_path / "disk" / "blocks"), prompt, out),
        )
        child.start()
        try:
            got = out.get(timeout=60)
        finally:
            join_or_kill(child)
        if isinstance(got, str):
            pytest.skip(f"no mount namespace of its own here: {got}")
        assert got == (len(prompt), True)
        disk = tier(wait_idle(client), "disk")
        assert (disk["removed_damaged"], disk["errors"], disk["blocks"]) == (0, 0, 3)
        assert block_files(tmp_path / "disk") == files


def test_an_allocation_copied_in_by_the_client_beside_one_deferred_to_another(
    unique_name, monkeypatch
):
    """One ``allocate_many`` of two prompts with ``defer``: the first, in the host tier
    only, is copied in by the client; the second, which another client is computing, is
    answered ``Computing`` (nothing allocated). Both come back in order; a copy that
    fails gives back the allocated one and skips the deferred answer."""
    cfg = make_config(num_blocks=8)
    tiered, computed = prompts_of(2, 2, seed=7)
    with tier_coordinator(cfg, unique_name, clients=2) as (coord, client, other):
        in_tier_only(client, tiered)
        writer = other.allocate(prompt=computed, defer=True)
        got = client.allocate_many(
            [dict(prompt=tiered, defer=True), dict(prompt=computed, defer=True)]
        )
        assert isinstance(got[0], shmkv.KvCacheHandle)
        assert got[0].num_cached_tokens == len(tiered) and got[0].num_promoting_tokens == 0
        assert got[1] == shmkv.Computing(0, len(computed))
        assert read_prompt(client, tiered) == (len(tiered), True)
        got[0].close()
        in_tier_only(client, tiered)
        before = client.stats()["sequences"]

        def interrupted(self, wire, stopping):
            raise KeyboardInterrupt  # (a signal in the middle of the copies)

        with monkeypatch.context() as patch, pytest.raises(KeyboardInterrupt):
            patch.setattr(block_io.ClientCopies, "run", interrupted)
            client.allocate_many(
                [dict(prompt=tiered, defer=True), dict(prompt=computed, defer=True)]
            )
        assert client.stats()["sequences"] == before
        writer.close()
