"""Shared fixtures: small pools, unique coordinators, and leak checks.

Every test runs under ``_no_leaks``: a child process of the test that is still alive
a few seconds after it ends is killed and fails the test, and so does a new
``/dev/shm`` entry named by shmkv. The session ends with the same check for the
whole run.
"""

from __future__ import annotations

import multiprocessing
import os
import time
import uuid

import psutil
import pytest
import torch

import shmkv

SPAWN = multiprocessing.get_context("spawn")


def shm_entries() -> set:
    return {n for n in os.listdir("/dev/shm") if n.startswith("shmkv-")}


def _children() -> list:
    """Child processes, less multiprocessing's own long-lived resource tracker."""
    try:
        procs = psutil.Process().children(recursive=True)
    except psutil.Error:
        return []
    out = []
    for proc in procs:
        try:
            if "resource_tracker" not in " ".join(proc.cmdline()):
                out.append(proc)
        except psutil.Error:
            pass
    return out


def _reap(grace: float) -> list:
    """Wait up to ``grace`` s for children to exit; kill and return the ones that did not."""
    deadline = time.monotonic() + grace
    alive = _children()
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    leaked = []
    for proc in alive:
        try:
            leaked.append(f"{proc.pid} {' '.join(proc.cmdline())[:120]}")
            proc.kill()
        except psutil.Error:
            pass
    multiprocessing.active_children()  # reaps finished multiprocessing children
    return leaked


def socket_files() -> set:
    from shmkv.coordinator import runtime_dir
    return set(os.listdir(runtime_dir()))


@pytest.fixture(autouse=True)
def _no_leaks():
    before, sockets_before = shm_entries(), socket_files()
    yield
    leaked = _reap(grace=5.0)
    new_shm = shm_entries() - before
    new_sockets = socket_files() - sockets_before
    assert not leaked, f"child processes outlived the test: {leaked}"
    assert not new_shm, f"/dev/shm entries outlived the test: {sorted(new_shm)}"
    assert not new_sockets, f"socket files outlived the test: {sorted(new_sockets)}"


@pytest.fixture(scope="session", autouse=True)
def _no_leaks_session():
    before = shm_entries()
    yield
    leaked = _reap(grace=5.0)
    assert not leaked, f"child processes outlived the test session: {leaked}"
    assert not shm_entries() - before, "/dev/shm entries outlived the test session"


@pytest.fixture
def unique_name() -> str:
    """A coordinator name no other test (or parallel run) uses."""
    return f"t-{os.getpid()}-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def small_config() -> shmkv.PoolConfig:
    return shmkv.PoolConfig(num_layers=3, num_kv_heads=4, head_dim=8, num_blocks=64,
                            block_size=4, dtype=torch.float32)


@pytest.fixture
def coord(small_config, unique_name):
    """A coordinator serving from a thread of the test process."""
    with shmkv.Coordinator(small_config, name=unique_name) as c:
        yield c


@pytest.fixture
def client(coord):
    with shmkv.connect(coord.address, timeout=10) as c:
        yield c


def join_or_kill(proc, timeout: float = 30.0) -> int:
    """Join a process; on expiry kill it and fail with what happened."""
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join(5)
        pytest.fail(f"process {proc.name} did not finish within {timeout} s")
    return proc.exitcode
