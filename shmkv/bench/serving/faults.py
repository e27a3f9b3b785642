"""The serving suite's faults under load: the coordinator SIGKILLed and restarted, disk-tier
files damaged, the pool filled to eviction, while the client runs; the TTFT dip.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from typing import Any, Dict, List, Optional, Sequence

from shmkv.bench.core import (
    Helper,
    median,
)
from shmkv.bench.serving.config import REPLICAS
from shmkv.bench.serving.datasets import dataset_args
from shmkv.bench.serving.deploy import (
    Deployment,
    Proc,
    coordinator_command,
    http_get,
    metrics_url,
    run_one,
    wait_for,
)
from shmkv.bench.serving.records import metric, parse_metrics


def run_faults(
    client: Helper,
    deps: Dict[str, "Deployment"],
    coord_proc: "Proc",
    procs: List["Proc"],
    model: str,
    name: str,
    env: Dict[str, str],
    work: str,
    raw_dir: str,
    shape: Dict[str, Any],
    seed: int,
    vocab: int,
) -> Dict[str, Any]:
    """Faults while ``vllm bench serve`` sends a Zipf workload at a rate every deployment
    sustains: (a) runs it first, the no-connector reference; then the coordinator is
    replaced by one with a host and a disk tier under a pool the workload overflows
    (eviction all along), and (c) runs the same prompts while this process SIGKILLs that
    coordinator and starts another at once on the same disk tier (30 % into the run),
    then damages disk-tier block files (60 % in). The record: failed requests and
    errors, greedy outputs equal to (a)'s, the restart's timings (SIGKILL to serving, to
    the first hit), TTFT around the kill (:func:`ttft_dip`), the last coordinator's tier
    counts."""
    tier_dir = os.path.join(work, "tier")
    cmd = coordinator_command(model, name, shape["pool_blocks"], tier_dir)
    logs = os.path.dirname(coord_proc.log)
    argv = dataset_args("zipf", shape, seed, work, vocab)
    argv += ["--request-rate", str(shape["rate"])]
    ref = run_one(client, deps["a"], None, "faults-a", argv, raw_dir, texts=True)
    coord_proc.stop(signal.SIGTERM)
    first = Proc("coordinator-faults-1", cmd, os.path.join(logs, "coordinator-faults-1.log"), env)
    procs.append(first)
    url = wait_for("the faults coordinator", lambda: metrics_url(first), 120, [first])
    wait_for(
        "the (c) replicas connected to it",
        lambda: (
            # the schedulers (each replica's workers connect at its next step)
            metric(parse_metrics(http_get(url) or ""), "shmkv_connections_open") >= REPLICAS
        ),
        120,
        [first],
    )
    events: Dict[str, Any] = {}
    duration = shape["requests"] / shape["rate"]
    injector = threading.Thread(
        target=_inject,
        args=(events, first, cmd, env, logs, procs, tier_dir, duration),
        name="faults",
        daemon=True,
    )
    injector.start()
    rec = run_one(client, deps["c"], None, "faults-c", argv, raw_dir, texts=True)
    events["run_done"] = True
    injector.join(60)
    tiers = _tier_stats(os.path.join(env["SHMKV_RUNTIME_DIR"], f"{name}.sock"))
    a, c = ref.pop("detail"), rec.pop("detail")
    equal = sum(x == y for x, y in zip(a["generated_texts"], c["generated_texts"]))
    kill, up = events.get("kill"), events.get("up")
    out: Dict[str, Any] = {
        "shape": shape,
        "reference": ref,
        "run": rec,
        "requests": len(c["generated_texts"]),
        "failed": int(rec.get("failed") or 0),
        "errors": sum(1 for e in c["errors"] if e),
        "outputs_equal": equal,
        "reference_failed": int(ref.get("failed") or 0),
        "damaged_files": events.get("damaged", []),
        "tiers": tiers,
        "injector_error": events.get("error"),
    }
    if kill is not None and up is not None:
        out["restart_s"] = up - kill
        out["first_hit_s"] = events["hit"] - kill if "hit" in events else None
        out["ttft"] = ttft_dip(c["start_times"], c["ttfts"], kill, up)
    return out


def _inject(
    events: Dict[str, Any],
    first: "Proc",
    cmd: List[str],
    env: Dict[str, str],
    logs: str,
    procs: List["Proc"],
    tier_dir: str,
    duration: float,
) -> None:
    """The faults of :func:`run_faults`, on a thread of their own; what happened and
    when (``time.monotonic()``, the clock of the client's request start times) goes to
    ``events``."""
    try:
        t0 = time.monotonic()
        time.sleep(0.3 * duration)
        events["kill"] = time.monotonic()
        os.kill(first.pid, signal.SIGKILL)
        first.proc.wait(30)
        second = Proc(
            "coordinator-faults-2", cmd, os.path.join(logs, "coordinator-faults-2.log"), env
        )
        procs.append(second)
        events["second"] = second
        url = wait_for("the restarted coordinator", lambda: metrics_url(second), 120, [second],
                       every=0.05)  # fmt: skip
        events["up"] = time.monotonic()
        damage_at = t0 + 0.6 * duration
        while not events.get("run_done") and time.monotonic() < t0 + 3 * duration:
            if "hit" not in events:
                m = parse_metrics(http_get(url, 2) or "")
                hits = sum(
                    v for k, v in m.items() if k.startswith("shmkv_client_prefix_hit_tokens")
                )
                if hits > 0:
                    events["hit"] = time.monotonic()
            if "damaged" not in events and time.monotonic() >= damage_at:
                events["damaged"] = damage_block_files(os.path.join(tier_dir, "blocks"), 8)
            time.sleep(0.1)
    except Exception as exc:  # noqa: BLE001 - reported in the record
        events["error"] = f"{type(exc).__name__}: {exc}"


def damage_block_files(directory: str, most: int, seed: int = 0) -> List[str]:
    """Overwrite 4 KiB in the middle of up to ``most`` block files under ``directory``
    with random bytes (their sizes unchanged); the damaged files, relative."""
    files = sorted(os.path.join(root, f) for root, _, names in os.walk(directory) for f in names)
    rng = random.Random(seed)
    damaged = []
    for path in rng.sample(files, min(most, len(files))):
        try:
            size = os.path.getsize(path)
            with open(path, "r+b") as f:
                f.seek(max(0, size // 2 - 2048))
                f.write(rng.randbytes(min(4096, size)))
            damaged.append(os.path.relpath(path, directory))
        except OSError:
            pass  # (a file the tier removed meanwhile)
    return damaged


def _tier_stats(address: str) -> Optional[List[dict]]:
    """The tiers' counts of the coordinator at ``address`` (None when none answers)."""
    import shmkv

    try:
        with shmkv.connect(address, timeout=10) as probe:
            return probe.stats().get("tiers")
    except (shmkv.ShmkvError, OSError):
        return None


def ttft_dip(
    start_times: Sequence[float],
    ttfts: Sequence[float],
    kill: float,
    up: float,
    settle: float = 5.0,
) -> Dict[str, Any]:
    """TTFT (ms) of the requests started before the coordinator was killed, between the
    kill and ``settle`` seconds after its successor served, and after that: count, p50
    and max of each (the clocks are ``time.monotonic()``'s)."""
    spans = {"before": [], "during": [], "after": []}  # type: Dict[str, List[float]]
    for start, ttft in zip(start_times, ttfts):
        if not ttft:
            continue  # (a failed request: counted apart)
        key = "before" if start < kill else "during" if start < up + settle else "after"
        spans[key].append(ttft * 1000)
    out: Dict[str, Any] = {}
    for key, values in spans.items():
        values.sort()
        out[key] = {
            "requests": len(values),
            "p50_ms": median(values) if values else None,
            "max_ms": values[-1] if values else None,
        }
    return out
