"""Suite ``metrics``: the coordinator's ping latency while its ``/metrics`` endpoint is
scraped (the method is in ``scripts/bench_metrics.py``'s docstring).

A thin wrapper: the suite's code is still ``scripts/bench_metrics.py`` (see
:mod:`shmkv.bench._scripts`); results go to ``benchmarks/results/metrics-scrape.{json,md}``
(the name the script's docstring gives; ``metrics`` once the script moves here).
"""

from __future__ import annotations

from ._scripts import run_script
from .core import result_base

SCRIPT = "bench_metrics"


def main(argv=None) -> int:
    """Run ``scripts/bench_metrics.py`` with ``argv`` (its own options: ``--runs``,
    ``--cycles``, ``--phase-s``, ``--rate``, ``--out``)."""
    return run_script(SCRIPT, list(argv or []))


def cli_args(quick: bool, out_dir: str, name=None) -> list:
    """The arguments ``shmkv bench --only metrics`` runs :func:`main` with (a quick run:
    two runs of six cycles, written as ``metrics-scrape-quick``)."""
    name = name or ("metrics-scrape-quick" if quick else "metrics-scrape")
    return (["--runs", "2", "--cycles", "6"] if quick else []) + ["--out", result_base(name, out_dir)]
