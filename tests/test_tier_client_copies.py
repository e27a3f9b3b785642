"""Promotion by the client: an allocation that waits for tier blocks copies them in itself
(``Client.copy_promotions``, ``shmkv.tiers``), then reports them (``promoted``).

Real coordinators (in a thread of the test), real clients (in the test and in spawned
processes), real files. What is shown: the copies run in the client and not in the tier
I/O process; a client killed in the middle of its copies leaves nothing pinned or held
and publishes nothing; reports that do not fit the promotion are refused and change
nothing; the host tier reaches clients read-only; a client waits for its copies before
it closes.
"""

import os
import signal
import threading
import time

import pytest
import tier_faults
from conftest import SPAWN, join_or_kill
from test_tiers import (
    BS,
    RawConnection,
    in_tier_only,
    make_config,
    prompts_of,
    read_prompt,
    tier,
    tier_coordinator,
    wait_idle,
)

import shmkv
from shmkv import hashing, tier_io, tiers as tiers_mod


@pytest.fixture(autouse=True)
def clients_copy(monkeypatch):
    """Clients copy their promotions here though the coordinator runs in this process
    (where they would not by default: ``Client.copy_promotions``)."""
    monkeypatch.setattr(shmkv.Client, "copy_promotions", True)


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
    tier_faults.slow_h2p(tier_io)
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
            deadline = time.monotonic() + 20
            while coord.tiers.num_promotions_in_flight != 1:
                assert time.monotonic() < deadline, "the child's promotion never started"
                time.sleep(0.01)
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


def _last_answer(raw):
    """The response (not unwrapped) to the last request ``raw`` sent."""
    from shmkv import protocol

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
        raw = RawConnection(coord.address)
        try:
            raw.send(_copy_request(prompt))
            copy = raw.wait(2)[1]["copy"]
            assert copy["ops"] == bytes([tier_io.OP_H2P]) * 2
            assert coord.tiers.num_promotions_in_flight == 1
            ok = bytes([tier_io.OK])
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
            damaged = bytes([tier_io.OK, tier_io.DAMAGED])
            raw.send(("promoted", {"id": copy["id"], "statuses": damaged}))
            infos = _last_answer(raw).unwrap()
            assert infos[0]["num_cached"] == BS  # the first block only
            assert coord.tiers.num_promotions_in_flight == 0
            assert [e.pins for e in coord.tiers.host.index.values()] == [0, 0]
            assert tier(client.stats(), "host")["blocks"] == 2  # both still in the tier
            raw.send(("promoted", {"id": copy["id"], "statuses": ok * 2}))  # again
            with pytest.raises(shmkv.InvalidArgument):
                _last_answer(raw).unwrap()
        finally:
            raw.close()


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
    tier_faults.slow_h2p(tier_io, monkeypatch.setattr)  # (this process: the client's copies)
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
        deadline = time.monotonic() + 20
        while coord.tiers.num_promotions_in_flight != 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
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
