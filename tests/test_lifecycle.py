"""Coordinator lifecycle: stop and the address lock when this process forks, the test
session's private runtime directory, and command-line argument checks."""

import os
import secrets
import signal
import time

import conftest
import pytest
from conftest import SPAWN, join_or_kill

import shmkv
from shmkv.coordinator.server import default_address, runtime_dir
from shmkv.tools import cli


def fork_sleeper(seconds: float = 30.0) -> int:
    """Fork a child of this process that only sleeps (as a fork-start Pool or DataLoader
    worker would idle); returns its pid. The caller kills and reaps it."""
    pid = os.fork()
    if pid == 0:
        try:
            time.sleep(seconds)
        finally:
            os._exit(0)
    return pid


def kill_and_reap(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    os.waitpid(pid, 0)  # SIGKILL cannot be ignored: returns at once


# -- child processes ---------------------------------------------------------------------


def hold_then_watch_stop(address, served, stopped, results):
    """Hold a sequence; extend it once after the parent forked; after the parent's
    stop, report how long ``is_valid()`` took to turn False and what the next request
    raised, and how long it took."""
    client = shmkv.connect(address, timeout=8)
    h = client.allocate(4)
    results.put("ready")
    if not served.wait(30):
        results.put("no fork signal")
        return
    results.put(("served", h.extend(1)))
    if not stopped.wait(30):
        results.put("no stop signal")
        return
    t0 = time.monotonic()
    while h.is_valid() and time.monotonic() - t0 < 4.0:
        time.sleep(0.005)
    invalid_after = None if h.is_valid() else time.monotonic() - t0
    t1 = time.monotonic()
    try:
        h.extend(1)
        outcome = "no error"
    except shmkv.ShmkvError as exc:
        outcome = type(exc).__name__
    results.put((invalid_after, outcome, time.monotonic() - t1))


# -- defects 1 and 2: a fork of the coordinator's process ------------------------------------


def test_stop_reaches_workers_while_a_forked_child_lives(small_config, unique_name):
    coord = shmkv.Coordinator(small_config, name=unique_name).start()
    served, stopped, results = SPAWN.Event(), SPAWN.Event(), SPAWN.Queue()
    worker = SPAWN.Process(
        target=hold_then_watch_stop, args=(coord.address, served, stopped, results)
    )
    worker.start()
    child = None
    try:
        assert results.get(timeout=60) == "ready"
        child = fork_sleeper()
        served.set()  # the child's closing its copies must not cut the parent's connections
        assert results.get(timeout=20) == ("served", 4)
        coord.stop()
        stopped.set()
        invalid_after, outcome, request_s = results.get(timeout=30)
        assert invalid_after is not None and invalid_after < 1.0, invalid_after
        assert outcome == "CoordinatorGone" and request_s < 1.0, (outcome, request_s)
        assert join_or_kill(worker, 20) == 0
    finally:
        if child is not None:
            kill_and_reap(child)
        coord.stop()  # idempotent
        if worker.is_alive():
            worker.kill()
            worker.join(5)


def test_stopped_name_is_free_while_a_forked_child_lives(small_config, unique_name):
    coord = shmkv.Coordinator(small_config, name=unique_name).start()
    child = fork_sleeper()
    try:
        with shmkv.connect(coord.address, timeout=10) as client:
            assert client.allocate(3).num_tokens == 3  # still served after the fork
        coord.stop()
        coord.stop()
        with shmkv.Coordinator(small_config, name=unique_name) as again:
            with shmkv.connect(again.address, timeout=10) as client:
                assert client.stats()["pid"] == os.getpid()
        with pytest.raises(shmkv.CoordinatorGone):
            shmkv.connect(coord.address, timeout=10)
    finally:
        kill_and_reap(child)
        coord.stop()


# -- defect 3: the test session looks only at what it made -----------------------------------


@pytest.fixture(scope="module")
def outlives_tests():
    """Things a test starts on purpose to outlive it (another user of shmkv on this
    machine, say); released when the module ends, after every test's leak check."""
    coordinators, files = [], []
    yield coordinators, files
    for coord in coordinators:
        coord.stop()
    for path in files:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def test_runtime_dir_honours_SHMKV_RUNTIME_DIR(tmp_path, monkeypatch):
    assert runtime_dir() == conftest.RUNTIME_DIR == os.environ["SHMKV_RUNTIME_DIR"]
    chosen = tmp_path / "sockets"
    monkeypatch.setenv("SHMKV_RUNTIME_DIR", str(chosen))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))  # the variable wins over XDG
    assert runtime_dir() == str(chosen)
    assert os.stat(chosen).st_mode & 0o777 == 0o700
    assert default_address("x") == str(chosen / "x.sock")
    os.chmod(chosen, 0o755)
    assert runtime_dir() == str(chosen) and os.stat(chosen).st_mode & 0o777 == 0o700
    if os.geteuid() == 0:
        os.chown(chosen, 65534, 65534)  # nobody
        with pytest.raises(shmkv.AccessDenied, match="belongs to uid"):
            runtime_dir()


def test_leak_checks_ignore_other_coordinators_on_the_machine(
    small_config, monkeypatch, outlives_tests
):
    coordinators, files = outlives_tests
    with monkeypatch.context() as m:  # where a shmkv user outside this test run puts sockets
        m.delenv("SHMKV_RUNTIME_DIR")
        elsewhere = runtime_dir()
    assert elsewhere != conftest.RUNTIME_DIR
    other = shmkv.Coordinator(
        small_config,
        address=os.path.join(elsewhere, f"other-{os.getpid()}-{secrets.token_hex(4)}.sock"),
    )
    coordinators.append(other)
    other.start()  # still serving when this test's leak check runs
    assert os.path.basename(other.address) not in conftest.socket_files()

    # A segment left by a live process that is not ours (our parent stands in for
    # another user's coordinator), and one named by this process.
    theirs = f"/dev/shm/shmkv-{os.getppid()}-{secrets.token_hex(8)}"
    mine = f"/dev/shm/shmkv-{os.getpid()}-{secrets.token_hex(8)}"
    files.append(theirs)
    for path in (theirs, mine):
        with open(path, "x"):
            pass
    try:
        found = conftest.shm_entries()
        assert os.path.basename(mine) in found
        assert os.path.basename(theirs) not in found
    finally:
        os.unlink(mine)


# -- defect 4: command-line arguments ------------------------------------------------------


@pytest.mark.parametrize(
    "argv, message",
    [
        (["demo", "--prompts", "0"], "--prompts: must be at least 1, got 0"),
        (["demo", "--workers", "0"], "--workers: must be at least 1, got 0"),
        (["demo", "--decode-steps", "-1"], "--decode-steps: must be 0 or more, got -1"),
        (["demo", "--prompts", "two"], "--prompts: 'two' is not an integer"),
        (["demo", "--dtype", "int4"], "--dtype: unsupported dtype 'int4'"),
        (["demo", "--model", "huge"], "--model: invalid choice"),
        (["serve", "--num-blocks", "0"], "--num-blocks: must be at least 1"),
        (["serve", "--block-size", "-4"], "--block-size: must be at least 1"),
        (["serve", "--max-connections", "0"], "--max-connections: must be at least 1"),
        (["serve", "--tp-size", "0"], "--tp-size: must be at least 1"),
        (["serve", "--spin-us", "-1"], "--spin-us: must lie in [0, 10000]"),
        (["serve", "--spin-us", "20000"], "--spin-us: must lie in [0, 10000]"),
        (["serve", "--device", "tpu"], "--device: unsupported device 'tpu'"),
        (["serve", "--name", "a/b"], "--name: 'a/b' must be 1-64 characters"),
        (["serve", "--address", "/tmp/" + "x" * 120], "longer than the 107 bytes"),
        (["serve", "--num-kv-heads", "6", "--tp-size", "4"], "not divisible by tp_size=4"),
        (["stats", "--timeout", "0"], "--timeout: must be greater than 0"),
        (["stats", "--timeout", "nan"], "--timeout: 'nan' is not a finite number"),
        (["stress", "--workers", "0"], "--workers: must be at least 1"),
        (["stress", "--duration", "-1"], "--duration: must be greater than 0"),
        (["stress", "--ops", "0"], "--ops: must be at least 1"),
        (["stress", "--kill-rate", "-0.5"], "--kill-rate: must be 0 or more"),
        (["stress", "--kill-coordinator-at", "1.5"], "--kill-coordinator-at: must lie in [0, 1]"),
        (["stress", "--gone-deadline", "0"], "--gone-deadline: must be greater than 0"),
        (["stress", "--max-seqs", "0"], "--max-seqs: must be at least 1"),
        (["stress", "--handoff-ttl", "inf"], "--handoff-ttl: 'inf' is not a finite number"),
        (["stress", "--json", ""], "--json: path must not be empty"),
        (["bench", "--repeats", "0"], "--repeats: must be at least 1"),
        (["bench", "--threads", "-1"], "--threads: must be 0 or more"),
        (["bench", "--name", ".hidden"], "--name: '.hidden' must be 1-64 characters"),
    ],
)
def test_cli_rejects_bad_arguments_with_usage_and_status_2(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"shmkv {argv[0]}: error:" in err and message in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("spin_us", [-1, 10001, True, "150", float("nan")])
def test_a_bad_spin_us_is_refused_before_anything_exists(small_config, unique_name, spin_us):
    with pytest.raises(shmkv.InvalidArgument, match="spin_us must be a number of microseconds"):
        shmkv.Coordinator(small_config, name=unique_name, spin_us=spin_us)
    assert not os.path.exists(default_address(unique_name))


def test_serve_forever_after_stop_returns_and_leaves_nothing(small_config, unique_name):
    """A stop that lands before the loop begins (a spawned coordinator whose parent died
    at once) ends it: the loop neither opens the pool again nor serves a closed socket."""
    import threading

    coord = shmkv.Coordinator(small_config, name=unique_name)
    coord.open()
    coord.stop()
    assert not os.path.exists(coord.address)
    opened = []
    coord.open = lambda: opened.append(1)  # the pool must not be made again
    thread = threading.Thread(target=coord.serve_forever, daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive()
    assert opened == [] and not coord._serving
    assert coord.memory is None and coord._listener is None
    assert not os.path.exists(coord.address)


def test_a_stop_from_a_signal_handler_while_the_loop_decides_does_not_deadlock(
    small_config, unique_name
):
    """stop() runs in a signal handler on the loop's own thread (shmkv serve): a signal
    landing while serve_forever holds the close lock must not wait for that lock."""
    import threading

    coord = shmkv.Coordinator(small_config, name=unique_name)
    coord.open()

    class SignalInside:  # the close lock, with a "signal" (stop()) arriving inside it
        def __init__(self, lock):
            self.lock, self.fired = lock, False

        def __enter__(self):
            self.lock.acquire()
            if not self.fired:  # the loop's own entry, the first
                self.fired = True
                coord.stop()

        def __exit__(self, *exc):
            self.lock.release()

    coord._close_lock = SignalInside(coord._close_lock)
    thread = threading.Thread(target=coord.serve_forever, daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), "serve_forever deadlocked on its own close lock"
    assert coord.memory is None and not os.path.exists(coord.address)
