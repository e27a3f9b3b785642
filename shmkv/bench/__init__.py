"""``shmkv bench``: every benchmark suite, each figure measured beside its baseline.

Owns the registry of suites (:data:`SUITES`, name to module and one line of what it
measures) and the command that runs them. One module per suite, a shared core
(:mod:`shmkv.bench.core`: timing, paired ratios, spread, JSON and Markdown records,
plots):

* the sections, run together by ``shmkv bench`` (``--quick`` for fewer sizes and
  repeats) into ``benchmarks/results/full.*`` (``quick.*``): ``data``, ``attach``,
  ``control``, ``handoff``, ``scaling``, ``memory``, ``batch``
  (:mod:`shmkv.bench.sections` drives them);
* the suites run on their own with ``--only NAME``, each writing
  ``benchmarks/results/NAME.*`` (``NAME-quick.*`` with ``--quick``): ``prefix``,
  ``attention``, ``native``, ``transformers``, ``tiers``, ``remote``, ``metrics``,
  ``vllm``, ``warm``, ``load``, ``serving``. A suite's own options follow ``--``:
  ``shmkv bench --only tiers -- --only ping --spin-us 150``.

``--only`` may name several; the sections among them run first, as one record.
``--dry-run`` prints what would run, ``--list`` the suites. Every suite measures
through the public API and changes nothing in the modules it measures; helper
processes use the ``spawn`` context, every wait has a timeout, and a run leaves no
process and no ``/dev/shm`` entry behind.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time

from shmkv.bench.core import BenchError, Figure, Options  # noqa: F401  (the suites' shared names)
from shmkv.bench.sections import SECTIONS

# name -> (module under shmkv.bench, what it measures)
SUITES = {
    "data": ("data", "data plane: write_all/write/gather_all/key_cache against copy_"),
    "attach": ("attach", "attach time per pool size against a 64 MiB pool"),
    "control": ("control", "round trips against a msgpack echo; allocate+free rates"),
    "handoff": ("handoff", "hand-off between processes against torch.multiprocessing"),
    "scaling": ("scaling", "1-8 workers on one coordinator"),
    "memory": ("attach", "coordinator and worker memory per pool size"),
    "batch": ("batch", "batched decode/prefill steps against the plain-torch floor"),
    "prefix": ("prefix", "prefix-cache lookup, hashing and fork costs"),
    "attention": ("attention", "paged_attention against the reference implementation"),
    "native": ("native", "the native decode kernel against the torch path and SDPA"),
    "transformers": ("transformers", "generate tokens/s, ShmkvCache against DynamicCache"),
    "tiers": ("tiers", "promotion from disk and host tiers, ping under load, chat trace"),
    "remote": ("remote", "pulls from Redis, moves over Gloo, a two-node chat trace"),
    "metrics": ("metrics", "ping p99 while /metrics is scraped against idle"),
    "vllm": ("vllm", "vLLM with ShmkvConnector: TTFT and no-hit throughput"),
    "warm": ("warm", "decode steps on a new pool: cold, populated, prefaulted, warm"),
    "load": ("load", "1-8 clients at rising offered rates: p50/p99/p999 per op, loop CPU"),
    "serving": ("serving", "vllm serve x3 behind vllm-router, with and without shmkv"),
}
assert set(SECTIONS) <= set(SUITES)


def suite_module(name: str):
    """The module of suite ``name`` (imported on first use: each suite imports what it
    measures, transformers or vLLM say, only when it runs)."""
    return importlib.import_module(f"{__name__}.{SUITES[name][0]}")


def plan(args) -> list:
    """What ``args`` runs, in order: ``("sections", names)`` for the sections among
    them (one record), then ``(suite, argv)`` for each other suite."""
    names = list(dict.fromkeys(args.only or SECTIONS))
    sections = tuple(s for s in SECTIONS if s in names)
    others = [n for n in names if n not in SECTIONS]
    if args.suite_args and (sections or len(others) != 1):
        raise ValueError(
            f"options after -- go to one suite run on its own (--only names {', '.join(names)})"
        )
    steps: list = [("sections", sections)] if sections else []
    for n in others:
        name = args.name if (args.name is None or len(others) == 1) else f"{args.name}-{n}"
        steps.append(
            (n, suite_module(n).cli_args(args.quick, args.out, name) + list(args.suite_args))
        )
    return steps


def cmd_bench(args) -> int:
    """Entry point of ``shmkv bench``."""
    if args.list:
        for name, (_module, what) in SUITES.items():
            kind = "section" if name in SECTIONS else "suite"
            print(f"{name:<13} {kind:<8} {what}")
        return 0
    try:
        steps = plan(args)
    except ValueError as exc:
        args.bench_parser.error(str(exc))
    from shmkv.bench import core

    core.OUT_DIR = args.out
    if args.dry_run:
        for name, what in steps:
            if name == "sections":
                print(f"shmkv bench: sections {' '.join(what)}")
            else:
                print(
                    " ".join(
                        [f"shmkv bench: {name}: python -m shmkv.bench.{SUITES[name][0]}", *what]
                    )
                )
        return 0
    failed = []
    for name, what in steps:
        if name == "sections":
            from shmkv.bench.sections import cmd_sections

            only = list(what) if args.only else None
            rc = cmd_sections(argparse.Namespace(**{**vars(args), "only": only}))
        else:
            print(f"shmkv bench: {name} ...", flush=True)
            t0 = time.perf_counter()
            rc = suite_module(name).main(what)
            print(
                f"shmkv bench: {name} done in {time.perf_counter() - t0:.0f} s "
                f"(exit status {rc or 0})",
                flush=True,
            )
        if rc:
            failed.append(name)
    if failed:
        print(f"shmkv bench: failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def add_parser(sub) -> None:
    """Register ``shmkv bench`` on an argparse subparsers object."""
    from shmkv.tools.args import name_arg, non_negative_int, path_arg, positive_int

    p = sub.add_parser(
        "bench",
        help="run the benchmark suites",
        description="Measure shmkv against plain baselines; writes "
        "benchmarks/results/NAME.json and .md and "
        "benchmarks/plots/NAME-*.png. Without --only: the "
        f"sections ({', '.join(SECTIONS)}) as one run.",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="fewer sizes and repeats (the sections: under 2 minutes)",
    )
    p.add_argument(
        "--name",
        type=name_arg,
        default=None,
        help="name of the result files (default: quick or full for the "
        "sections, the suite's name otherwise)",
    )
    p.add_argument(
        "--only",
        nargs="+",
        choices=list(SUITES),
        metavar="SUITE",
        help=f"run only these: {', '.join(SUITES)}",
    )
    p.add_argument(
        "--repeats",
        type=positive_int,
        default=None,
        help="sections: timed runs per figure after the warm-up (default 5 quick, 7 full)",
    )
    p.add_argument(
        "--threads",
        type=non_negative_int,
        default=1,
        help="sections: torch threads in the measuring processes (default 1: "
        "on a shared machine a descheduled OpenMP thread stalls every "
        "parallel copy; 0 keeps torch's default)",
    )
    p.add_argument(
        "--out",
        type=path_arg,
        default="benchmarks",
        help="directory holding results/ and plots/ (default: benchmarks)",
    )
    p.add_argument("--list", action="store_true", help="list the suites and exit")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print what would run (each suite with its arguments) and exit",
    )
    p.add_argument(
        "suite_args",
        nargs="*",
        metavar="-- SUITE-OPTION",
        help="after --: options of the one suite named by --only",
    )
    p.set_defaults(func=cmd_bench, bench_parser=p)
