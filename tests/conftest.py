"""Shared fixtures: small pools, unique coordinators, and leak checks.

Every test runs under ``_no_leaks``: a child process of the test that is still alive
a few seconds after it ends is killed and fails the test, and so does a new
``/dev/shm`` entry named by this process or one of its descendants, or a socket file
left in the session's own runtime directory. The session ends with the same check
for the whole run. Coordinators of anyone else on the machine are not looked at.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import re
import shutil
import tempfile
import time
import uuid

# Sockets of named coordinators go to a directory of this test session only, set
# before shmkv is imported. Spawned children import this module too: they inherit
# the variables and keep the session's directory. The process that made it removes
# it as it exits (also when collection fails, so no session fixture runs).
_inherited = os.environ.get("SHMKV_TEST_SESSION_DIR")
if _inherited and os.environ.get("SHMKV_RUNTIME_DIR") == _inherited:
    RUNTIME_DIR = _inherited
    # A process the tests started: whatever it made is released by the test (the leak
    # checks see to that), so its exit skips the interpreter's last collection of torch's
    # import-time objects (half a second of each child's exit here). Exit handlers run
    # last-registered first: this one runs after those of the test's own code.
    import gc

    atexit.register(gc.freeze)
else:
    RUNTIME_DIR = tempfile.mkdtemp(prefix="shmkv-test-")  # mode 0700
    os.environ["SHMKV_RUNTIME_DIR"] = os.environ["SHMKV_TEST_SESSION_DIR"] = RUNTIME_DIR
    # vLLM's IPC sockets too (its engines and servers take the variable from here): it
    # leaves them behind when its processes are stopped without its exit handlers
    os.environ["VLLM_RPC_BASE_PATH"] = os.path.join(RUNTIME_DIR, "vllm")
    os.mkdir(os.environ["VLLM_RPC_BASE_PATH"])

    def _remove_runtime_dir(creator: int = os.getpid()) -> None:
        if os.getpid() == creator:  # not in a forked child that exits normally
            shutil.rmtree(RUNTIME_DIR, ignore_errors=True)

    atexit.register(_remove_runtime_dir)

import psutil  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import shmkv  # noqa: E402

SPAWN = multiprocessing.get_context("spawn")
# Processes started ahead of the module that uses them (a test module's ``start_ahead``):
# neither they nor their descendants are a test's leftovers; ``AHEAD_CLOSERS`` stop what
# no module took (the session ended before it).
AHEAD_PIDS: set = set()
AHEAD_CLOSERS: list = []
# tests: about two minutes of this suite before the module's first, or the module's own
# AHEAD_TESTS; the variable, where set, for every module (0: none starts ahead)
AHEAD_LEAD = int(os.environ.get("SHMKV_TEST_AHEAD_LEAD", "270"))
_AHEAD_LEAD_SET = "SHMKV_TEST_AHEAD_LEAD" in os.environ
_SHM_NAME = re.compile(r"^shmkv-(\d+)-[0-9a-f]+$")  # shmkv.memory.shm names segments by owner pid
_OUR_PIDS = {os.getpid()}  # this process and every descendant seen so far


def _is_ours(pid: int) -> bool:
    """True for this process and its descendants (live now, or seen alive before)."""
    if pid in _OUR_PIDS:
        return True
    try:
        if os.getpid() in (p.pid for p in psutil.Process(pid).parents()):
            _OUR_PIDS.add(pid)
            return True
    except psutil.Error:
        pass
    return False


def shm_entries() -> set:
    """shmkv's ``/dev/shm`` entries named by this process or one of its descendants.

    Segments are unlinked right after creation, so an entry exists only when its
    creator died in between; another coordinator's entries on the machine are not ours.
    """
    _children()  # note the descendants alive now
    out = set()
    for name in os.listdir("/dev/shm"):
        match = _SHM_NAME.match(name)
        if match and _is_ours(int(match.group(1))):
            out.add(name)
    return out


def is_resource_tracker(proc: psutil.Process) -> bool:
    """multiprocessing's resource tracker: a long-lived child of whoever used it."""
    try:
        return "resource_tracker" in " ".join(proc.cmdline())
    except psutil.Error:
        return False


def _children() -> list:
    """Child processes, less multiprocessing's own long-lived resource tracker."""
    try:
        procs = psutil.Process().children(recursive=True)
    except psutil.Error:
        return []
    _OUR_PIDS.update(proc.pid for proc in procs)
    out = []
    for proc in procs:
        try:
            if is_resource_tracker(proc):
                continue
            if AHEAD_PIDS and (
                proc.pid in AHEAD_PIDS or any(q.pid in AHEAD_PIDS for q in proc.parents())
            ):
                continue
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


def mapped_shm(procs) -> set:
    """The ``/dev/shm`` files the processes map (shared memory, POSIX semaphores)."""
    from shmkv.bench.serving.deploy import mapped_shm as mapped_by_pids

    return mapped_by_pids(proc.pid for proc in procs)


def process_tree(pid: int) -> list:
    """The process ``pid`` and its live descendants (none when it is gone)."""
    try:
        root = psutil.Process(pid)
        return [root] + root.children(recursive=True)
    except psutil.Error:
        return []


def ahead_mapped_shm() -> set:
    """The ``/dev/shm`` files that processes started ahead, and their descendants, map
    (semaphores, vLLM's segments): not another module's leftovers."""
    return mapped_shm([proc for pid in list(AHEAD_PIDS) for proc in process_tree(pid)])


def socket_files() -> set:
    """Files in this session's runtime directory (``$SHMKV_RUNTIME_DIR``)."""
    return set(os.listdir(RUNTIME_DIR))


def pytest_collection_modifyitems(session, config, items) -> None:
    """A module with a ``start_ahead(config)`` function gets it called :data:`AHEAD_LEAD`
    tests (the module's ``AHEAD_TESTS``, unless ``SHMKV_TEST_AHEAD_LEAD`` is set) before
    its first one (vLLM's engines and servers: they start at a low priority, on the CPU
    time the tests before them leave idle)."""
    seen = set()
    for index, item in enumerate(items):
        module = getattr(item, "module", None)
        if module is None or module in seen or not hasattr(module, "start_ahead"):
            continue
        seen.add(module)
        lead = AHEAD_LEAD if _AHEAD_LEAD_SET else getattr(module, "AHEAD_TESTS", AHEAD_LEAD)
        if lead and index >= lead:  # (nearer the start, it starts its own)
            _AHEAD_AT.setdefault(items[index - lead].nodeid, []).append(module)


_AHEAD_AT: dict = {}  # test id -> the modules to start ahead as it starts


def pytest_runtest_setup(item) -> None:
    for module in _AHEAD_AT.pop(item.nodeid, ()):
        module.start_ahead(item.config)


@pytest.fixture(autouse=True)
def _cli_logging_restored():
    """``shmkv.tools.cli.main()`` run in this process (test_cli, test_lifecycle,
    test_tiers, test_bench) sends the ``shmkv`` loggers to stderr, as a command should;
    the tests after it must not inherit that handler (later tests' coordinator threads
    would print their INFO lines from under pytest's capture)."""
    from shmkv.tools import cli

    logger = logging.getLogger("shmkv")
    handlers, level = list(logger.handlers), logger.level
    yield
    logger.handlers[:] = handlers
    logger.setLevel(level)
    cli._log_handler = None


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
    for close in AHEAD_CLOSERS:
        close()
    leaked = _reap(grace=5.0)
    left = shm_entries() - before
    assert not leaked, f"child processes outlived the test session: {leaked}"
    assert not left, f"/dev/shm entries outlived the test session: {sorted(left)}"


@pytest.fixture
def unique_name() -> str:
    """A coordinator name no other test (or parallel run) uses."""
    return f"t-{os.getpid()}-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def small_config() -> shmkv.PoolConfig:
    return shmkv.PoolConfig(
        num_layers=3, num_kv_heads=4, head_dim=8, num_blocks=64, block_size=4, dtype=torch.float32
    )


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
