"""What the serving suite reads back from the replicas and the coordinator: ``/metrics``
parsed, per-replica deltas over a run, the connector's hook times per engine step, and
the trimmed ``vllm bench serve`` records kept.
"""

from __future__ import annotations

import json
from typing import Any, Dict


def parse_metrics(text: str) -> Dict[str, float]:
    """Prometheus text as ``{'name{labels}': value}`` (labels as written)."""
    out: Dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            try:
                out[key] = float(value)
            except ValueError:
                pass
    return out


def metric(metrics: Dict[str, float], name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    total = 0.0
    for key, value in metrics.items():
        base, _, rest = key.partition("{")
        if base == name and all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += value
    return total


SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


# vLLM's histograms read as (name, labels) -> key of the replica's record: its engine
# steps and their tokens (a step of more than DECODE_STEP_TOKENS carries a prefill
# chunk: no run here decodes that many requests at once), and the inter-token latency
# its API server saw (immune to the client's reads bunching streamed tokens)
DECODE_STEP_TOKENS = 32
HISTOGRAMS = {
    "steps": ("vllm:iteration_tokens_total_count", {}),
    "step_tokens": ("vllm:iteration_tokens_total_sum", {}),
    "decode_steps": ("vllm:iteration_tokens_total_bucket", {"le": f"{DECODE_STEP_TOKENS:.1f}"}),
    "itl_s": ("vllm:inter_token_latency_seconds_sum", {}),
    "itl_n": ("vllm:inter_token_latency_seconds_count", {}),
}


def replica_delta(before: Dict[str, float], after: Dict[str, float]) -> Dict[str, float]:
    """What one replica did between two scrapes: requests finished, prompt tokens by
    source, engine steps (all, and those of at most :data:`DECODE_STEP_TOKENS` tokens)
    and the server-side inter-token latency (seconds, tokens)."""
    out = {
        "requests": metric(after, "vllm:request_success_total")
        - metric(before, "vllm:request_success_total")
    }
    for src in SOURCES:
        name = "vllm:prompt_tokens_by_source_total"
        out[src] = metric(after, name, source=src) - metric(before, name, source=src)
    for key, (name, labels) in HISTOGRAMS.items():
        out[key] = metric(after, name, **labels) - metric(before, name, **labels)
    return out


def step_summary(rec: Dict[str, Any]) -> Dict[str, float]:
    """A run's engine steps over all its replicas: how many, the share that carried a
    prefill chunk, and the mean inter-token latency the servers saw (ms)."""
    reps = rec["replicas"]
    steps = sum(r.get("steps", 0.0) for r in reps)
    decode = sum(r.get("decode_steps", 0.0) for r in reps)
    itl_n = sum(r.get("itl_n", 0.0) for r in reps)
    return {
        "steps": steps,
        "prefill_step_share": 1 - decode / steps if steps else 0.0,
        "server_itl_ms": sum(r.get("itl_s", 0.0) for r in reps) / itl_n * 1e3 if itl_n else 0.0,
    }


COUNT = "count:"  # a scheduler counter among the hooks: "count:NAME": [0.0, count]


def hook_delta(before: Dict[str, list], after: Dict[str, list]) -> Dict[str, list]:
    """``{hook: [seconds, calls]}`` spent between two reads of a replica's hook files."""
    out = {}
    for hook, (secs, calls) in after.items():
        s0, c0 = before.get(hook, (0.0, 0))
        if calls - c0 or hook.startswith(COUNT):  # (a counter is kept at 0 too)
            out[hook] = [secs - s0, calls - c0]
    return out


SCHEDULER_HOOKS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "request_finished",
)


def per_step(hooks: Dict[str, list]) -> Dict[str, float]:
    """Connector seconds per engine step, from one replica's hook deltas: the scheduler's
    hooks per ``build_connector_meta`` (one a step) and the worker's per
    ``bind_connector_metadata`` (one a step), the copies (inside the worker's hooks)
    apart."""
    steps = hooks.get("build_connector_meta", [0, 0])[1]
    wsteps = hooks.get("bind_connector_metadata", [0, 0])[1]
    sched = sum(v[0] for k, v in hooks.items() if k in SCHEDULER_HOOKS)
    worker = sum(v[0] for k, v in hooks.items() if k not in SCHEDULER_HOOKS and k != "_copy_layer")
    copies = hooks.get("_copy_layer", [0.0, 0])[0]
    return {
        "steps": steps,
        "scheduler_s": sched,
        "worker_s": worker,
        "copies_s": copies,
        "scheduler_us_per_step": sched / steps * 1e6 if steps else 0.0,
        "worker_us_per_step": worker / wsteps * 1e6 if wsteps else 0.0,
    }


KEEP = (
    "duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
    "request_throughput", "output_throughput", "total_token_throughput",
    "max_concurrent_requests",
    "median_ttft_ms", "p50_ttft_ms", "p99_ttft_ms", "mean_ttft_ms",
    "median_tpot_ms", "p50_tpot_ms", "p99_tpot_ms", "mean_tpot_ms",
    "median_itl_ms", "p50_itl_ms", "p99_itl_ms", "mean_itl_ms",
    "median_e2el_ms", "p99_e2el_ms",
)  # fmt: skip


def summarize(raw: Dict[str, Any]) -> Dict[str, Any]:
    """The figures of one ``vllm bench serve`` result kept in the suite's record."""
    return {k: float(raw[k]) if raw.get(k) is not None else None for k in KEEP if k in raw}


def trim_raw(path: str) -> None:
    """Drop the generated texts from a saved ``vllm bench serve`` result (random words of
    a random model; every timing stays)."""
    with open(path) as f:
        raw = json.load(f)
    raw.pop("generated_texts", None)
    with open(path, "w") as f:
        json.dump(raw, f, indent=1, default=float)


# -- processes --------------------------------------------------------------------------------
