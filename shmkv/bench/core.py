"""The shared core of every benchmark suite: timing, ratios, spread, records, tables, plots.

Owns what more than one suite needs and nothing a single suite measures:

* timing: :func:`interleaved` (runs in shuffled rounds after a warm-up), :func:`median`,
  :func:`percentile`, :func:`p99`, and the figures they make: :class:`Figure` (a value
  next to its baseline, a ratio and a target), :func:`paired_ratio` (median of the
  rounds' own ratios) and :func:`spread` (median, min, max);
* helper processes (:class:`Helper`, ``spawn`` context, every wait with a timeout) and
  the clean-up that stops them however a run ends (:class:`_Cleanup`);
* where results go: :func:`result_base` (``OUT/results/SUITE``, ``OUT`` being
  ``benchmarks`` unless ``shmkv bench --out`` says otherwise), :func:`write_results`
  (``SUITE.json`` and ``SUITE.md``), :func:`format_table` / :func:`markdown_table` and
  :func:`pyplot` (matplotlib without a display, or ImportError).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import multiprocessing
import os
import random
import statistics
import sys
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any, Callable, Dict, List, Optional, Sequence

SPAWN = multiprocessing.get_context("spawn")
MIB = 1 << 20
GIB = 1 << 30

# The model shape every data-plane figure uses: a 7-8B class model with grouped KV heads.
MODEL = dict(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16")

CHILD_IDLE_TIMEOUT = 600.0


def _next_command(conn, timeout: float = CHILD_IDLE_TIMEOUT):
    """The parent's next message to a measuring child, or None (stop) when the parent
    has said nothing for ``timeout`` seconds or is gone."""
    try:
        if not conn.poll(timeout):
            return None
        return conn.recv()
    except (EOFError, OSError):
        return None


class BenchError(RuntimeError):
    """A benchmark step failed or a helper process did not answer in time."""


@dataclasses.dataclass
class Figure:
    """One measured figure and its comparison with a baseline.

    ``ratio`` is value/baseline. ``target`` applies to the ratio (``>= 0.8`` for a
    rate, ``<= 1.5`` for a time), or to the value itself when ``target_of`` is
    ``"value"``; ``met`` is None without a target.
    """

    section: str
    name: str
    value: float
    unit: str
    baseline: Optional[float] = None
    baseline_name: str = ""
    ratio: Optional[float] = None
    target: Optional[str] = None
    met: Optional[bool] = None
    target_of: str = "ratio"
    params: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Options:
    """What one run measures and how hard."""

    quick: bool
    repeats: int
    sections: tuple
    out_dir: str
    name: str
    threads: int = 1


def _check(value: float, target: str) -> bool:
    op, bound = target.split()
    return value >= float(bound) if op == ">=" else value <= float(bound)


def _median(values) -> float:
    return statistics.median(values)


def _percentile(values, q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))
    return ordered[index]


def interleaved(
    fns: Dict[str, Callable[[], object]], repeats: int, warmup: int = 1
) -> Dict[str, List[float]]:
    """Time each function ``repeats`` times after ``warmup`` rounds. Every round runs
    all of them in a new random order (fixed seed), so that they share the machine's
    state and none always follows the same neighbour (whose data may still be in
    cache). Returns the seconds of each run, per name."""
    names = list(fns)
    order = random.Random(len(names) * 7919 + repeats)
    times: Dict[str, List[float]] = {name: [] for name in names}
    for round_ in range(warmup + repeats):
        order.shuffle(names)
        for name in names:
            t0 = time.perf_counter()
            fns[name]()
            elapsed = time.perf_counter() - t0
            if round_ >= warmup:
                times[name].append(elapsed)
    return times


def memory_of(pid="self") -> dict:
    """Resident memory of a process in bytes: ``rss``, ``uss`` (pages mapped by this
    process only), ``pss`` and ``anon`` (anonymous pages: where a copy would live),
    from ``/proc/PID/smaps_rollup``."""
    fields = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                fields[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return {
        "rss": fields.get("Rss", 0),
        "pss": fields.get("Pss", 0),
        "uss": fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0),
        "anon": fields.get("Anonymous", 0),
    }


def _shm_entries() -> set:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


# -- helper processes ------------------------------------------------------------------------


def _child_main(target: Callable, conn, args: tuple) -> None:
    """Entry point of every helper process: run ``target`` (a module-level function of a
    suite, which ``spawn`` pickles by its qualified name) with its pipe."""
    try:
        target(conn, *args)
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        pass  # the parent is gone or stopping us
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass
    finally:
        conn.close()


class Helper:
    """A spawned helper process driven through a pipe; every wait has a timeout.

    The child exits when the pipe closes, so it cannot outlive the benchmark.
    """

    def __init__(self, target: Callable, *args, name: str = "shmkv-bench"):
        self.name = name
        self.conn: Optional[Connection]
        self.conn, child = SPAWN.Pipe()
        self.process = SPAWN.Process(
            target=_child_main, args=(target, child, args), name=name, daemon=True
        )
        self.process.start()
        child.close()

    def _pipe(self) -> Connection:
        if self.conn is None:
            raise BenchError(f"{self.name} was stopped")
        return self.conn

    def send(self, message) -> None:
        self._pipe().send(message)

    def recv(self, timeout: float):
        """The next message; raises :class:`BenchError` on a timeout or a child error."""
        conn = self._pipe()
        if not conn.poll(timeout):
            raise BenchError(f"{self.name} sent nothing within {timeout:.0f} s")
        try:
            message = conn.recv()
        except EOFError:
            raise BenchError(f"{self.name} exited (code {self.process.exitcode})") from None
        if isinstance(message, tuple) and message and message[0] == "error":
            raise BenchError(f"{self.name} failed:\n{message[1]}")
        return message

    def stop(self, timeout: float = 10.0) -> None:
        """Close the pipe, wait for the process, kill it if it lingers. Idempotent."""
        if self.conn is not None:
            try:
                self.conn.send(None)
            except OSError:
                pass
            self.conn.close()
            self.conn = None
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)


class _Cleanup:
    """Everything a run started, stopped in reverse order however the run ends."""

    def __init__(self):
        self.items: list = []

    def add(self, item):
        self.items.append(item)
        return item

    def remove(self, item) -> None:
        item.stop()
        if item in self.items:
            self.items.remove(item)

    def close(self) -> None:
        while self.items:
            item = self.items.pop()
            try:
                item.stop()
            except Exception as exc:  # keep stopping the rest
                print(f"shmkv bench: cleanup of {item!r} failed: {exc}", file=sys.stderr)


_names = iter(range(1 << 30))


def _unique(tag: str) -> str:
    return f"bench-{tag}-{os.getpid()}-{next(_names)}"


def _model_config(num_blocks: int, block_size: int = 16, **overrides):
    from shmkv.memory.layout import PoolConfig

    shape = dict(MODEL, **overrides)
    return PoolConfig(num_blocks=num_blocks, block_size=block_size, device="cpu", **shape)


def _pattern(numel: int, dtype):
    """A ``numel`` tensor of varied bit patterns (no NaN or Inf), made in one copy."""
    import torch

    period = 1 << 20
    base = torch.randint(-3000, 3000, (period,), dtype=torch.int32).to(dtype)
    reps = -(-numel // period)
    return base.repeat(reps)[:numel]


def _same_bits(a, b) -> bool:
    import torch

    size = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return a.shape == b.shape and torch.equal(a.contiguous().view(size), b.contiguous().view(size))


def _size(nbytes: int) -> str:
    return f"{nbytes / GIB:g} GiB" if nbytes >= GIB else f"{nbytes / MIB:g} MiB"


# -- 3. control plane ------------------------------------------------------------------------


# -- tables --------------------------------------------------------------------------------


def _fmt(value: Optional[float]) -> str:
    if value is None:
        return "-"
    if value == 0:
        return "0"
    magnitude = abs(value)
    if magnitude >= 1e5:
        return f"{value:,.0f}"
    if magnitude >= 100:
        return f"{value:.0f}"
    if magnitude >= 1:
        return f"{value:.2f}"
    return f"{value:.3g}"


def table_rows(figures: List[Figure]) -> List[List[str]]:
    """The printed table: figure, value, baseline, ratio, target, met?"""
    rows = [["section", "figure", "value", "baseline", "ratio", "target", "met?"]]
    for f in figures:
        baseline = "-" if f.baseline is None else f"{_fmt(f.baseline)} {f.unit} ({f.baseline_name})"
        met = "-" if f.met is None else ("yes" if f.met else "NO")
        target = f.target or "-"
        if f.target and f.target_of == "value":
            target = f"{f.target.split()[0]} {_fmt(float(f.target.split()[1]))} {f.unit}"
        rows.append(
            [
                f.section,
                f.name,
                f"{_fmt(f.value)} {f.unit}",
                baseline,
                "-" if f.ratio is None else _fmt(f.ratio),
                target,
                met,
            ]
        )
    return rows


def format_table(figures: List[Figure]) -> str:
    """The table as aligned text."""
    rows = table_rows(figures)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# -- ratios and spread ----------------------------------------------------------------------


def process_cpu_s(pid: int) -> float:
    """CPU seconds of process ``pid`` (Linux ``/proc``): the nanosecond run times of its
    live threads (``task/*/schedstat``), else user + system time in clock ticks (10 ms:
    too coarse for a run of a second or two)."""
    total, read = 0, False
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        tasks = []
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
            read = True
        except (OSError, ValueError, IndexError):
            continue  # a thread gone meanwhile
    if read:
        return total / 1e9
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_model() -> str:
    """The CPU's model name as Linux reports it (``/proc/cpuinfo``), with the widest
    vector extension it lists ("avx512f", "avx2"), or "unknown": compute-bound
    figures differ several-fold between the machines a benchmark lands on."""
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        return "unknown"
    name = next(
        (
            line.split(":", 1)[1].strip()
            for line in info.splitlines()
            if line.startswith("model name")
        ),
        "unknown",
    )
    flags = next(
        (line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")),
        [],
    )
    vector = next((f for f in ("amx_tile", "avx512f", "avx2") if f in flags), None)
    return f"{name} ({vector})" if vector else name


def median(values) -> float:
    """The median of ``values``."""
    return statistics.median(values)


def percentile(values, q: float) -> float:
    """The nearest-rank ``q``-th percentile of ``values``."""
    return _percentile(values, q)


def p99(values) -> float:
    """The 99th percentile as the tiers and metrics suites take it: the value at index
    ``int(0.99 * n)`` of the sorted values (the last one below 100 values)."""
    values = sorted(values)
    return values[min(len(values) - 1, int(0.99 * len(values)))]


def paired_ratio(values: Sequence[float], baselines: Sequence[float]) -> float:
    """The median of the per-round ratios ``values[i] / baselines[i]``: a figure and its
    baseline measured in the same rounds, so a slow round slows both alike."""
    if len(values) != len(baselines) or not values:
        raise ValueError(
            f"paired_ratio needs two equally long, non-empty sequences "
            f"(got {len(values)} and {len(baselines)})"
        )
    return statistics.median(v / b for v, b in zip(values, baselines))


def spread(values: Sequence[float]) -> dict:
    """``{"median", "min", "max", "n"}`` of ``values`` (how far runs of one figure part)."""
    if not values:
        raise ValueError("spread of no values")
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


# -- where results go -----------------------------------------------------------------------

# The directory holding results/ and plots/, relative to the working directory; set from
# ``shmkv bench --out`` before a suite runs.
OUT_DIR = "benchmarks"
# Inputs committed with the benchmarks (the chat trace), found next to the package in a
# checkout, else under OUT_DIR.
_CHECKOUT = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks"
)


def result_base(suite: str, out_dir: Optional[str] = None) -> str:
    """``OUT/results/SUITE``: the path, without its extension, of a suite's results."""
    return os.path.join(out_dir or OUT_DIR, "results", suite)


def plot_path(name: str, out_dir: Optional[str] = None) -> str:
    """``OUT/plots/NAME.png``."""
    return os.path.join(out_dir or OUT_DIR, "plots", f"{name}.png")


def trace_path(name: str = "chat.jsonl") -> str:
    """A committed trace under ``benchmarks/traces/``."""
    here = os.path.join(_CHECKOUT, "traces", name)
    return here if os.path.exists(here) else os.path.join(OUT_DIR, "traces", name)


def write_results(
    base: str, record: dict, markdown: Optional[str], *, indent: int = 1, sort_keys: bool = False
) -> List[str]:
    """Write ``BASE.json`` (``record``) and, unless ``markdown`` is None, ``BASE.md``
    (ending in one newline); creates the directory. Returns the paths written."""
    os.makedirs(os.path.dirname(base) or ".", exist_ok=True)
    paths = [base + ".json"]
    with open(paths[0], "w") as f:
        json.dump(record, f, indent=indent, sort_keys=sort_keys, default=str)
    if markdown is not None:
        paths.append(base + ".md")
        with open(paths[1], "w") as f:
            f.write(markdown.rstrip("\n") + "\n")
    return paths


def markdown_table(rows: Sequence[Sequence[object]]) -> str:
    """Rows (the first one the header) as a Markdown table; ``|`` in a cell is escaped."""
    cells = [[str(c).replace("|", "\\|") for c in r] for r in rows]
    out = ["| " + " | ".join(cells[0]) + " |", "|" + "---|" * len(cells[0])]
    out += ["| " + " | ".join(r) + " |" for r in cells[1:]]
    return "\n".join(out)


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend (no display); ImportError without
    matplotlib (``pip install 'shmkv[plot]'``). Imported by name: matplotlib is an
    optional extra, absent where the package's types are checked."""
    matplotlib = importlib.import_module("matplotlib")
    matplotlib.use("Agg")
    return importlib.import_module("matplotlib.pyplot")
