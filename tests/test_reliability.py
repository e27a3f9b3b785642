"""Reliability with real processes: SIGKILLed workers and coordinators, restarts on a
stale socket, ``shmkv serve`` shutdown on signals, and a short stress run with kills."""

import json
import os
import select
import signal
import subprocess
import sys
import time

import pytest
import torch
import workers
from conftest import SPAWN, join_or_kill

import shmkv


def values(seed: int, n: int, heads: int = 4, dim: int = 8) -> torch.Tensor:
    """Deterministic K/V rows for a test: any process can recompute them."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, heads, dim, generator=g)


def write_seq(h, seed: int) -> None:
    for layer in range(h.num_layers):
        h.write(
            layer,
            values(seed + layer, h.num_tokens),
            values(seed + 50 + layer, h.num_tokens),
            start=0,
        )


def seq_ok(h, seed: int) -> bool:
    return all(
        torch.equal(h.key_cache(layer), values(seed + layer, h.num_tokens))
        and torch.equal(h.value_cache(layer), values(seed + 50 + layer, h.num_tokens))
        for layer in range(h.num_layers)
    )


def wait_until(predicate, timeout: float, step: float = 0.01) -> float:
    """Poll ``predicate`` until true; returns the seconds it took, fails on expiry."""
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout:
            pytest.fail(f"condition not met within {timeout} s")
        time.sleep(step)
    return time.monotonic() - t0


# -- child processes ---------------------------------------------------------------------


def producer_until_killed(address, queue):
    """Hold sequences, export two of them, then write in a loop until SIGKILLed."""
    client = shmkv.connect(address, timeout=20)
    busy = client.allocate(40)
    held = client.allocate(24)
    write_seq(busy, 300)
    write_seq(held, 400)
    held.clone_handle()
    long_lived = client.allocate(12)
    write_seq(long_lived, 500)
    short_lived = client.allocate(8)
    write_seq(short_lived, 600)
    long_token = long_lived.export(ttl=60)
    asked_at = time.monotonic()
    short_token = short_lived.export(ttl=4)
    answered_at = time.monotonic()
    long_lived.close()
    queue.put((long_token, short_token, asked_at, answered_at))
    ones = torch.ones(40, 4, 8)
    i = 0
    while True:  # busy writing in place when the SIGKILL lands
        busy.write(i % busy.num_layers, ones * i, ones * -i, start=0)
        if i == 50:
            queue.put("writing")
        i += 1


def wait_for_gone(address, queue):
    """Hold a handle and call the API in a loop; report when CoordinatorGone is seen."""
    client = shmkv.connect(address, timeout=20)
    h = client.allocate(8)
    queue.put("ready")
    try:
        while True:
            h.key_cache(0)
            h.extend(0)
    except shmkv.CoordinatorGone:
        queue.put(("gone", time.monotonic(), h.is_valid(), client.is_alive()))
    queue.close()
    queue.join_thread()


# -- tests -------------------------------------------------------------------------------


def test_killed_worker_reclaimed_promptly_while_its_handoffs_live(coord, client):
    survivor = client.allocate(30)
    write_seq(survivor, 100)
    survivor_blocks = client.stats()["referenced_blocks"]
    survivor_bytes = survivor.gather_all()

    q = SPAWN.Queue()
    child = SPAWN.Process(target=producer_until_killed, args=(coord.address, q), daemon=True)
    child.start()
    long_token, short_token, asked_at, answered_at = q.get(timeout=60)
    assert q.get(timeout=30) == "writing"
    before = client.stats()
    # survivor 8 + busy 10 + held 6 + long 3 + short 2 blocks (block_size 4)
    assert before["referenced_blocks"] == survivor_blocks + 10 + 6 + 3 + 2
    assert before["handoffs"] == 2 and before["connections"] == 2

    os.kill(child.pid, signal.SIGKILL)
    assert join_or_kill(child, 10) == -signal.SIGKILL
    took = wait_until(
        lambda: client.stats()["referenced_blocks"] == survivor_blocks + 3 + 2, timeout=1.0
    )
    after = client.stats()
    assert time.monotonic() < answered_at + 4, "too slow to see the hand-offs alive"
    assert (after["sequences"], after["handoffs"], after["connections"]) == (3, 2, 1), after
    assert after["free_blocks"] + after["cached_blocks"] + after["referenced_blocks"] == 64
    assert took < 1.0

    opened = client.open(long_token)  # outlived its producer
    assert opened.num_tokens == 12 and seq_ok(opened, 500)

    wait_until(lambda: client.stats()["handoffs"] == 0, timeout=6.0, step=0.05)
    assert time.monotonic() >= asked_at + 4, "expired before its deadline"
    with pytest.raises(shmkv.HandoffError):
        client.open(short_token)
    stats = client.stats()
    assert stats["referenced_blocks"] == survivor_blocks + 3 and stats["sequences"] == 2
    assert stats["expired_handoffs"] == 1

    assert torch.equal(survivor.gather_all(), survivor_bytes) and seq_ok(survivor, 100)
    opened.close()
    survivor.close()
    stats = client.stats()
    assert stats["referenced_blocks"] == 0 and stats["free_blocks"] + stats["cached_blocks"] == 64


def test_killed_coordinator_every_call_raises_gone_within_a_second(small_config, unique_name):
    coord = shmkv.Coordinator.spawn(small_config, name=unique_name)
    try:
        client = shmkv.connect(coord.address, timeout=10)
        h = client.allocate(8)
        write_seq(h, 7)
        fork = h.fork()
        token = h.export(ttl=30)
        q = SPAWN.Queue()
        child = SPAWN.Process(target=wait_for_gone, args=(coord.address, q), daemon=True)
        child.start()
        assert q.get(timeout=60) == "ready"
        assert h.is_valid() and fork.is_valid()

        killed_at = time.monotonic()
        coord.kill()
        wait_until(lambda: not h.is_valid(), timeout=1.0)
        assert not fork.is_valid() and not client.is_alive()

        k = torch.zeros(1, 4, 8)
        calls = {
            "allocate": lambda: client.allocate(1),
            "allocate prompt": lambda: client.allocate(prompt=[1, 2, 3]),
            "allocate_many": lambda: client.allocate_many([1, 2]),
            "extend": lambda: h.extend(1),
            "extend_many": lambda: client.extend_many([(h, 1), (fork, 1)]),
            "write": lambda: h.write(0, k, k, start=0),
            "write_all": lambda: h.write_all(torch.zeros(3, 2, 1, 4, 8), start=0),
            "key_cache": lambda: h.key_cache(0),
            "value_cache": lambda: fork.value_cache(1),
            "kv_cache": lambda: h.kv_cache(2),
            "gather_all": lambda: fork.gather_all(),
            "paged_kv": lambda: h.paged_kv(0),
            "fork": lambda: h.fork(),
            "clone_handle": lambda: h.clone_handle(),
            "with_sequence_length": lambda: h.with_sequence_length(2),
            "export": lambda: h.export(ttl=5),
            "open": lambda: client.open(token),
            "commit": lambda: h.commit(),
            "refresh": lambda: h.refresh(),
            "stats": lambda: client.stats(),
            "ping": lambda: client.ping(),
            "close_many": lambda: client.close_many([fork]),
        }
        for name, call in calls.items():
            t0 = time.monotonic()
            with pytest.raises(shmkv.CoordinatorGone):
                call()
            assert time.monotonic() - t0 < 1.0, name
        h.close()  # a no-op once the coordinator is gone
        h.close()
        client.close()

        tag, seen_at, valid, alive = q.get(timeout=10)
        assert tag == "gone" and not valid and not alive
        assert seen_at - killed_at < 1.0
        assert join_or_kill(child, 10) == 0
        with pytest.raises(shmkv.CoordinatorGone):
            shmkv.connect(coord.address, timeout=5)
    finally:
        coord.stop()
        if os.path.exists(coord.address):  # left by the SIGKILL; a restart would clear it
            os.unlink(coord.address)
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"shmkv-{coord.pid}-")]


def test_new_coordinator_after_a_dead_one_and_refusal_while_live(small_config, unique_name):
    dead = shmkv.Coordinator.spawn(small_config, name=unique_name)
    with shmkv.connect(dead.address, timeout=10) as c:
        c.allocate(20)
    dead.kill()
    assert os.path.exists(dead.address), "a SIGKILLed coordinator cannot remove its socket"

    with shmkv.Coordinator(small_config, name=unique_name) as live:
        assert live.address == dead.address
        inode = os.stat(live.address).st_ino
        with shmkv.connect(live.address, timeout=10) as c:
            stats = c.stats()
            assert (stats["free_blocks"], stats["sequences"]) == (64, 0)
            h = c.allocate(6)
            write_seq(h, 1)
            with pytest.raises(shmkv.ShmkvError, match="served by a live coordinator"):
                shmkv.Coordinator(small_config, name=unique_name).start()
            with pytest.raises(shmkv.ShmkvError, match="served by a live coordinator"):
                shmkv.Coordinator.spawn(small_config, name=unique_name)
            assert os.stat(live.address).st_ino == inode  # nobody replaced the socket
            c.ping()
            assert seq_ok(h, 1)
            with shmkv.connect(live.address, timeout=10) as other:
                other.ping()
    assert not os.path.exists(dead.address)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_serve_stops_cleanly_on_signal(sig, unique_name):
    address = shmkv.default_address(unique_name)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "shmkv",
            "serve",
            "--name",
            unique_name,
            "--num-blocks",
            "32",
            "--num-layers",
            "2",
            "--num-kv-heads",
            "4",
            "--head-dim",
            "8",
            "--block-size",
            "4",
            "--dtype",
            "float32",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        assert ready, "serve printed nothing within 60 s"
        first = proc.stdout.readline()
        assert first.startswith("shmkv coordinator serving") and address in first, first
        with shmkv.connect(address, timeout=10) as client:
            h = client.allocate(5)
            h.write(0, torch.ones(5, 4, 8), torch.ones(5, 4, 8), start=0)
            assert client.stats()["referenced_blocks"] == 2
            proc.send_signal(sig)
            out, err = proc.communicate(timeout=20)
            assert proc.returncode == 0, err
            assert "shmkv coordinator stopped" in out
            wait_until(lambda: not h.is_valid(), timeout=1.0)
            with pytest.raises(shmkv.CoordinatorGone):
                h.key_cache(0)
        assert not os.path.exists(address)
        assert "Traceback" not in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)


def test_short_stress_run_with_kills_passes(tmp_path, unique_name):
    report_path = tmp_path / "stress.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "shmkv",
            "stress",
            "--workers",
            "3",
            "--duration",
            "4",
            "--kill-rate",
            "1",
            "--handoff-ttl",
            "2",
            "--num-blocks",
            "64",
            "--name",
            unique_name,
            "--quiet",
            "--json",
            str(report_path),
        ],
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(report_path.read_text())
    assert report["passed"] and report["failures"] == []
    assert report["worker_kills"] >= 2 and report["worker_restarts"] >= 2
    assert report["corrupted_reads"] == 0 and report["blocks_leaked"] == 0
    assert report["shm_entries_left"] == [] and not report["socket_left"]
    assert report["final_stats"]["referenced_blocks"] == 0
    assert report["values_verified"] > 0
    for op in ("allocate", "extend", "read", "fork", "close"):
        assert report["ops"].get(op, 0) > 0, op
    assert "PASSED" in proc.stdout
    assert not os.path.exists(shmkv.default_address(unique_name))


def test_bound_handoffs_go_with_their_killed_maker_and_opened_ones_stay(coord, client):
    """Hand-offs exported ``bound`` pin nothing once their maker's process is killed
    (long before their 60 s deadline): an unopened one goes with its connection; one
    opened before the kill is the opener's reference and stays; a plain one lives on
    until opened or expired."""
    q, go = SPAWN.Queue(), SPAWN.Event()
    child = SPAWN.Process(target=workers.export_bound_then_die, args=(coord.address, q, go))
    child.start()
    try:
        opened_token, unopened_token, plain_token = q.get(timeout=60)
        opened = client.open(opened_token)
        assert client.stats()["handoffs"] == 2
    finally:
        go.set()
    join_or_kill(child, 10)
    wait_until(lambda: client.stats()["handoffs"] == 1, timeout=5.0)
    with pytest.raises(shmkv.HandoffError):
        client.open(unopened_token)
    plain = client.open(plain_token)  # outlived its maker, as plain hand-offs do
    assert opened.num_tokens == plain.num_tokens == 8
    stats = client.stats()
    assert (stats["sequences"], stats["handoffs"], stats["expired_handoffs"]) == (2, 0, 1)
    opened.close()
    plain.close()
    assert client.stats()["referenced_blocks"] == 0
    with shmkv.connect(coord.address, timeout=10) as other:  # a clean close drops them too
        h = other.allocate(4)
        token = h.export(ttl=60, bound=True)
    with pytest.raises(shmkv.HandoffError):
        client.open(token)
    assert client.stats()["referenced_blocks"] == 0
