"""``shmkv stress``: many worker processes hammer one coordinator, with kills, and verify.

Owns the stress program: a coordinator in its own process, N worker processes
(``spawn`` context) that run a random mix of every handle operation, a parent that
routes hand-off tokens between workers, SIGKILLs and restarts workers (and, when
asked, the coordinator), shows progress on stderr, judges the run and writes the
report. The value scheme below and the checks the parent makes itself (hand-offs it
opens, the leak count at the end, every prefix read back from the tiers, the store and
a restarted coordinator) are in :mod:`.stress_checks`: the run holds a
:class:`~shmkv.tools.stress_checks.Checks` (``checks``), which keeps the tally of
values verified and reads corrupted, and calls it to make the tiers
(:meth:`~shmkv.tools.stress_checks.Checks.tier_specs`), count the workers' reports
(:meth:`~shmkv.tools.stress_checks.Checks.add_reads`), open tokens nobody took
(:meth:`~shmkv.tools.stress_checks.Checks.open_here`) and run the checks at the end,
handing it the parent's client each time. It uses only the public API; it does not
reach into the coordinator's state.

Every K/V value a worker writes is a function of a per-position *tag* and the
(layer, K/V, position, head, dim) coordinates. A worker keeps the tag of every
position of each of its sequences (forks copy their parent's tags, hand-offs carry
them along), so every read, of its own sequences, its forks, opened hand-offs and
prefix-cache hits, is checked against what was written. Tags of prompt positions
come from the token id alone, so a prefix written by any process can be verified
by any other.

With ``--tiers`` the coordinator has a host-memory tier (a quarter of the pool) and a
disk tier (a temporary directory, or ``--tier-dir``) under its pool, and with ``--redis
URL`` the Redis/Valkey store under those; the workers then share more prompt prefixes
than the pool holds, so prefix hits are promoted from the tiers and pulled from the
store while other workers demote, and every hit is checked like any read. At the end
(and after ``--kill-coordinator``, on the restarted coordinator, which uses the same
tiers) the parent reads every shared prefix back: from the disk after a restart, and
from the store through a second coordinator of its own, as another node would.

The run passes when no read was corrupted, no block is leaked once the dead are
reclaimed, the survivors have closed and the outstanding hand-offs have expired,
no ``/dev/shm`` entry is left behind, no worker crashed, hung or hit an unexpected
error, and, with ``--kill-coordinator``, every surviving worker saw
``CoordinatorGone`` promptly with all its handles invalid.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import random
import signal
import sys
import time
from multiprocessing.connection import wait as mp_wait
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

from shmkv.tools.progress import ProgressBar, enabled as progress_enabled
from shmkv.tools.stress_checks import (
    _MODULUS,
    EXPECTED_ERRORS,
    Checks,
)
from shmkv.tools.stress_report import format_report
from shmkv.tools.stress_worker import worker_main

if TYPE_CHECKING:  # (the library is imported by the run, not by the command line)
    from multiprocessing.connection import Connection
    from multiprocessing.process import BaseProcess

    from shmkv.client.client import Client
    from shmkv.coordinator.server import SpawnedCoordinator


# -- parent ------------------------------------------------------------------------------


def shm_entries() -> List[str]:
    """``/dev/shm`` entries named by shmkv."""
    try:
        return sorted(n for n in os.listdir("/dev/shm") if n.startswith("shmkv-"))
    except OSError:
        return []


def _percentile(sorted_values: List[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    index = min(len(sorted_values) - 1, max(0, math.ceil(q * len(sorted_values)) - 1))
    return sorted_values[index]


class _Slot:
    __slots__ = (
        "index",
        "process",
        "conn",
        "pid",
        "ready",
        "finished",
        "generation",
        "ops_reported",
        "gone",
    )

    def __init__(self, index: int):
        self.index = index
        # The worker's process and our end of its pipe: both set while it runs (from
        # _start_worker to _close_slot), else None.
        self.process: Optional[BaseProcess] = None
        self.conn: Optional[Connection] = None
        self.pid: Optional[int] = None
        self.ready = False
        self.finished = False
        self.generation = 0
        self.ops_reported = 0
        self.gone: Optional[dict] = None

    def running(self) -> Tuple[Connection, BaseProcess]:
        """``(conn, process)`` of a slot whose worker runs."""
        assert self.conn is not None and self.process is not None
        return self.conn, self.process


class StressRun:
    """The parent of a stress run: starts, routes, kills, restarts, reports; its
    :class:`~shmkv.tools.stress_checks.Checks` (``checks``) checks and tallies.

    Args:
        args: the parsed command line (see :func:`add_parser`).
    """

    def __init__(self, args):
        self.args = args
        self.checks = Checks(args)
        self.rng = random.Random(args.seed)
        self.ctx = multiprocessing.get_context("spawn")
        self.slots = [_Slot(i) for i in range(args.workers)]
        self.ops: Dict[str, int] = {}
        self.errors: Dict[str, int] = {}
        self.latency: Dict[str, List[float]] = {}
        self.crashes: List[str] = []
        self.pending_tokens: list = []  # hand-off tokens no worker has taken yet
        self.handoffs = {"sent": 0, "routed": 0}  # (the ones the parent opens: checks')
        self.kills = 0
        self.restarts = 0
        self.hung = 0
        self.unexpected_exits: List[str] = []
        self.gone_reports: List[dict] = []
        self.coordinator_killed_at: Optional[float] = None
        self.failures: List[str] = []
        self.coord: Optional[SpawnedCoordinator] = None
        self.client: Optional[Client] = None
        self._progress_at = 0.0
        self._progress_line_at = 0.0
        self._bar = None  # a ProgressBar while the run's loop goes (on a terminal only)
        self.started = 0.0
        self.ended = 0.0
        self._stopping = False

    # -- worker processes ----------------------------------------------------------------

    def _quota(self, slot: _Slot) -> Optional[int]:
        if self.args.ops is None:
            return None
        base, extra = divmod(self.args.ops, self.args.workers)
        return base + (1 if slot.index < extra else 0) - slot.ops_reported

    def _start_worker(self, slot: _Slot) -> None:
        parent_end, child_end = self.ctx.Pipe(duplex=True)
        opts = {
            "timeout": self.args.client_timeout,
            "handoff_ttl": self.args.handoff_ttl,
            "max_seqs": self.args.max_seqs,
            "max_tokens": self.args.max_tokens,
            "quota": self._quota(slot),
            "num_prefixes": self.checks.num_prefixes(),
        }
        seed = self.args.seed * 1_000_003 + slot.index * 1009 + slot.generation
        assert self.coord is not None  # (started by _run)
        proc = self.ctx.Process(
            target=worker_main,
            name=f"shmkv-stress-{slot.index}",
            args=(slot.index, self.coord.address, child_end, seed, opts),
            daemon=True,
        )
        proc.start()
        child_end.close()
        slot.process, slot.conn, slot.pid = proc, parent_end, None
        slot.ready = False
        slot.generation += 1

    def _close_slot(self, slot: _Slot) -> None:
        self._drain(slot)
        if slot.conn is not None:
            slot.conn.close()
        slot.conn = None
        slot.process = None
        slot.ready = False

    def _drain(self, slot: _Slot) -> None:
        """Take every complete message a (possibly dead) worker left in its pipe."""
        if slot.conn is None:
            return
        try:
            while slot.conn.poll(0):
                self._on_message(slot, slot.conn.recv())
        except (EOFError, OSError):
            pass

    def _kill_worker(self, slot: _Slot) -> None:
        _conn, process = slot.running()
        assert process.pid is not None  # (started)
        os.kill(process.pid, signal.SIGKILL)
        process.join(10)
        self.kills += 1
        self._close_slot(slot)

    # -- messages ------------------------------------------------------------------------

    def _on_message(self, slot: _Slot, message) -> None:
        kind = message[0]
        if kind == "stats":
            _, _, ops, errors, latency, corrupted, verified, samples = message
            for name, count in ops.items():
                self.ops[name] = self.ops.get(name, 0) + count
                slot.ops_reported += count
            for name, count in errors.items():
                self.errors[name] = self.errors.get(name, 0) + count
            for name, values in latency.items():
                self.latency.setdefault(name, []).extend(values)
            self.checks.add_reads(verified, corrupted, samples)
        elif kind == "ready":
            slot.ready, slot.pid = True, message[2]
        elif kind == "token":
            self.handoffs["sent"] += 1
            self._route(message[1], message[2], message[3])
        elif kind == "done":
            slot.finished = True
        elif kind == "gone":
            slot.gone = {
                "slot": slot.index,
                "seen_at": message[2],
                "op": message[3],
                "valid_handles_after": message[4],
            }
            self.gone_reports.append(slot.gone)
        elif kind == "crash":
            self.crashes.append(f"worker {slot.index}: {message[2]}")

    def _retry_pending(self) -> None:
        pending, self.pending_tokens = self.pending_tokens, []
        for token, tags in pending:
            self._route(-1, token, tags)

    def _route(self, sender: int, token: bytes, tags: List[int]) -> None:
        """Send a token to a random other ready worker, or keep it for later."""
        if self.coordinator_killed_at is not None:
            return
        if self._stopping:
            assert self.client is not None  # (connected by _run)
            return self.checks.open_here(self.client, token, tags)
        targets = [
            s
            for s in self.slots
            if s.ready
            and not s.finished
            and s.conn is not None
            and (s.index != sender or len(self.slots) == 1)
        ]
        while targets:
            target = self.rng.choice(targets)
            try:
                target.running()[0].send(("token", token, tags))
                self.handoffs["routed"] += 1
                return
            except OSError:
                targets.remove(target)
        self.pending_tokens.append((token, tags))

    # -- the run -------------------------------------------------------------------------

    def _config(self):
        from shmkv.memory.layout import PoolConfig

        a = self.args
        return PoolConfig(
            num_layers=a.num_layers,
            num_kv_heads=a.num_kv_heads,
            head_dim=a.head_dim,
            num_blocks=a.num_blocks,
            block_size=a.block_size,
            dtype=a.dtype,
        )

    def _say(self, text: str) -> None:
        if not self.args.quiet:
            print(text, file=sys.stderr, flush=True)

    def run(self) -> dict:
        """Run the stress test; returns the report."""
        a = self.args
        shm_before = set(shm_entries())
        config = self._config()
        name = a.name or f"stress-{os.getpid()}"
        try:
            return self._run(config, name, shm_before)
        finally:
            self.checks.remove_tier_dir()

    def _run(self, config, name: str, shm_before: set) -> dict:
        from shmkv.client.client import connect
        from shmkv.coordinator.server import Coordinator

        a = self.args
        coord = self.coord = Coordinator.spawn(
            config,
            name=name,
            tiers=self.checks.tier_specs(config) or None,
            max_handoff_ttl=max(60.0, a.handoff_ttl),
        )
        address = coord.address
        self.client = connect(address, timeout=a.client_timeout)
        self._say(
            f"shmkv stress: coordinator pid {coord.pid} at {address}, "
            f"{config.num_blocks} blocks; starting {a.workers} workers"
        )
        try:
            for slot in self.slots:
                self._start_worker(slot)
            self._wait_ready(timeout=a.start_timeout)
            self.started = time.monotonic()
            self._loop()
            if self.coordinator_killed_at is None:
                self._stop_workers()
        finally:
            self._close_bar()
            for slot in self.slots:
                if slot.process is not None and slot.process.is_alive():
                    slot.process.kill()
                    slot.process.join(5)
                if slot.process is not None:
                    self._close_slot(slot)
        elapsed = self.ended - self.started
        if self.coordinator_killed_at is None:
            pending, self.pending_tokens = self.pending_tokens, []
            leak = self.checks.final_check(self.client, pending)
            if a.tiers or a.redis:
                self.checks.evict_pool(self.client)
                self.checks.check_prefixes(self.client, "tiers, the pool evicted")
                leak["tiers"] = self.checks.wait_tiers_idle(self.client).get("tiers")
                if a.redis:
                    self.checks.check_store(config, name)
            self.client.close()
            self.coord.stop()
            restart = None
        else:
            leak = {
                "blocks_leaked": None,
                "note": "the coordinator was killed: its pool died with it",
            }
            restart = self.checks.check_restart(self.client, config, name)
        socket_left = os.path.exists(address)
        shm_left = sorted(set(shm_entries()) - shm_before)
        return self._report(config, elapsed, leak, shm_left, socket_left, restart)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        # a worker may do all its operations and exit before a slower one is up: its slot
        # is closed (not ready) but finished, and will not come back
        while not all(s.ready or s.finished or s.gone for s in self.slots):
            if time.monotonic() > deadline:
                raise RuntimeError(f"workers not ready within {timeout} s")
            self._pump(0.1)

    def _pump(self, timeout: float) -> None:
        """Wait for messages or exits for up to ``timeout`` s and handle them."""
        live = [(s, *s.running()) for s in self.slots if s.conn is not None]
        waitables = [conn for _, conn, _ in live] + [process.sentinel for _, _, process in live]
        ready = set(mp_wait(waitables, timeout)) if waitables else set()
        if not waitables:
            time.sleep(timeout)
        for slot, conn, process in live:
            if conn in ready:
                try:
                    while conn.poll(0):
                        self._on_message(slot, conn.recv())
                except (EOFError, OSError):
                    pass
            if process.sentinel in ready and not process.is_alive():
                process.join(1)
                self._drain(slot)
                code = process.exitcode
                if code != 0 and not slot.finished:
                    self.unexpected_exits.append(
                        f"worker {slot.index} (pid {process.pid}) exit code {code}"
                    )
                if not slot.finished and slot.gone is None and code == 0:
                    self.unexpected_exits.append(f"worker {slot.index} exited without reporting")
                self._close_slot(slot)
                if (
                    not slot.finished
                    and slot.gone is None
                    and self.coordinator_killed_at is None
                    and not self._stopping
                ):
                    self._start_worker(slot)
                    self.restarts += 1

    def _total_ops(self) -> int:
        return sum(self.ops.values())

    def _loop(self) -> None:
        a = self.args
        duration = a.duration
        deadline = self.started + duration if duration is not None else None
        kill_interval = 1.0 / a.kill_rate if a.kill_rate > 0 else None
        next_kill = self.started + kill_interval if kill_interval else None
        kill_coord_at = None
        if a.kill_coordinator:
            kill_coord_at = self.started + (duration or 10.0) * a.kill_coordinator_at
        while True:
            now = time.monotonic()
            if self.coordinator_killed_at is None:
                if deadline is not None and now >= deadline:
                    break
                if a.ops is not None and all(s.finished for s in self.slots):
                    break
            self._pump(0.05)
            now = time.monotonic()
            if (
                kill_coord_at is not None
                and self.coordinator_killed_at is None
                and (
                    now >= kill_coord_at or (a.ops is not None and self._total_ops() >= a.ops // 2)
                )
            ):
                self._kill_coordinator()
                break
            if next_kill is not None and now >= next_kill:
                next_kill += kill_interval
                victims = [
                    s
                    for s in self.slots
                    if s.ready and not s.finished and s.process is not None and s.process.is_alive()
                ]
                if victims:
                    victim = self.rng.choice(victims)
                    self._kill_worker(victim)
                    self._start_worker(victim)
                    self.restarts += 1
            self._retry_pending()
            self._progress(deadline)
        self.ended = time.monotonic()
        if self.coordinator_killed_at is not None:
            self._await_gone()
        self._progress(deadline, final=True)

    def _kill_coordinator(self) -> None:
        assert self.coord is not None  # (started by _run)
        self._say(f"\nSIGKILL coordinator pid {self.coord.pid}")
        self.coordinator_killed_at = time.time()
        self.coord.kill()

    def _await_gone(self) -> None:
        """Every worker alive at the kill must report CoordinatorGone and exit."""
        deadline = time.monotonic() + max(10.0, self.args.gone_deadline * 5)
        while time.monotonic() < deadline:
            if all(s.conn is None for s in self.slots):
                break
            self._pump(0.05)
        self._stopping = True

    def _stop_workers(self) -> None:
        self._stopping = True
        for slot in self.slots:
            if slot.conn is not None:
                try:
                    slot.conn.send(("stop",))
                except OSError:
                    pass
        deadline = time.monotonic() + self.args.stop_timeout
        while any(s.conn is not None for s in self.slots):
            if time.monotonic() > deadline:
                for slot in self.slots:
                    if slot.conn is not None:
                        self.hung += 1
                        self._kill_worker(slot)
                        self.kills -= 1
                break
            self._pump(0.05)

    # -- output --------------------------------------------------------------------------

    def _progress(self, deadline: Optional[float], final: bool = False) -> None:
        """A progress bar on stderr when it is a terminal (nothing otherwise, or with
        --quiet): time or operations done, rates, errors, kills, corruption."""
        if self.args.quiet or not progress_enabled():
            return
        if self._bar is None:
            if deadline is not None:
                self._bar = ProgressBar("stress", total=deadline - self.started, unit="s")
            else:
                self._bar = ProgressBar("stress", total=self.args.ops, unit="ops")
        now = time.monotonic()
        if not final and now - self._progress_at < 0.25:
            return
        self._progress_at = now
        elapsed = now - self.started
        total = self._total_ops()
        done = min(elapsed, deadline - self.started) if deadline is not None else total
        errors = sum(self.errors.values())
        ops = f"{total} ops, " if deadline is not None else ""
        self._bar.update(
            completed=done,
            info=(
                f"{ops}{total / max(elapsed, 1e-9):.0f} ops/s  errors {errors}  "
                f"kills {self.kills}  corrupted {self.checks.corrupted}"
            ),
        )
        if final:
            self._close_bar()

    def _close_bar(self) -> None:
        bar, self._bar = self._bar, None
        if bar is not None:
            bar.close()

    def _report(
        self,
        config,
        elapsed: float,
        leak: dict,
        shm_left: List[str],
        socket_left: bool,
        restart: Optional[dict],
    ) -> dict:
        a = self.args
        latency = {}
        for name, values in sorted(self.latency.items()):
            values.sort()
            latency[name] = {
                "n": len(values),
                "p50_ms": 1e3 * _percentile(values, 0.50),
                "p99_ms": 1e3 * _percentile(values, 0.99),
                "max_ms": 1e3 * values[-1],
            }
        unexpected = {k: v for k, v in self.errors.items() if k not in EXPECTED_ERRORS}
        report = {
            "args": {k: v for k, v in vars(a).items() if k not in ("func",)},
            "pool": config.to_wire(),
            "elapsed_s": elapsed,
            "ops_total": self._total_ops(),
            "ops_per_s": self._total_ops() / max(elapsed, 1e-9),
            "ops": dict(sorted(self.ops.items())),
            "errors": dict(sorted(self.errors.items())),
            "unexpected_errors": unexpected,
            "latency_ms": latency,
            "values_verified": self.checks.verified,
            "corrupted_reads": self.checks.corrupted,
            "corruption_samples": self.checks.samples,
            "handoffs": {**self.handoffs, **self.checks.handoffs},
            "worker_kills": self.kills,
            "worker_restarts": self.restarts,
            "worker_crashes": self.crashes,
            "unexpected_exits": self.unexpected_exits,
            "hung_workers": self.hung,
            "shm_entries_left": shm_left,
            "socket_left": socket_left,
            "prefix_checks": self.checks.prefix_checks,
        }
        report.update(leak)
        failures = []
        if self.checks.corrupted:
            failures.append(f"{self.checks.corrupted} corrupted reads")
        if leak.get("blocks_leaked"):
            failures.append(f"{leak['blocks_leaked']} blocks leaked")
        if shm_left:
            failures.append(f"/dev/shm entries left: {shm_left}")
        if unexpected:
            failures.append(f"unexpected errors: {unexpected}")
        if self.crashes or self.unexpected_exits:
            failures.append(
                f"{len(self.crashes)} worker crashes, {len(self.unexpected_exits)} unexpected exits"
            )
        if self.hung:
            failures.append(f"{self.hung} workers did not stop")
        if self.coordinator_killed_at is None:
            if socket_left:
                failures.append("socket file left after a clean stop")
            if self.gone_reports:
                failures.append(f"{len(self.gone_reports)} workers saw CoordinatorGone")
            if leak.get("sequences_left") or leak.get("handoffs_left"):
                failures.append(
                    f"{leak.get('sequences_left')} sequences and "
                    f"{leak.get('handoffs_left')} hand-offs left"
                )
        else:
            lat = [g["seen_at"] - self.coordinator_killed_at for g in self.gone_reports]
            missing = [s.index for s in self.slots if s.gone is None]
            report["coordinator_kill"] = {
                "workers_saw_gone": len(self.gone_reports),
                "workers_missing": missing,
                "detect_s_max": max(lat) if lat else None,
                "detect_s_p50": sorted(lat)[len(lat) // 2] if lat else None,
                "valid_handles_after_gone": sum(
                    g["valid_handles_after"] for g in self.gone_reports
                ),
                "ops_seen_in": sorted({g["op"] for g in self.gone_reports}),
            }
            report["coordinator_kill"].update(restart or {})
            if missing:
                failures.append(f"workers {missing} did not report CoordinatorGone")
            late = [x for x in lat if x > a.gone_deadline]
            if late:
                failures.append(
                    f"{len(late)} workers saw CoordinatorGone after more than "
                    f"{a.gone_deadline} s (max {max(late):.2f} s)"
                )
            if report["coordinator_kill"]["valid_handles_after_gone"]:
                failures.append("handles still valid after CoordinatorGone")
            if restart and restart.get("restart") != "ok":
                failures.append(f"restart after the kill: {restart.get('restart')}")
            if restart and not restart.get("parent_client_saw_gone"):
                failures.append("the parent's client did not see CoordinatorGone")
            if restart and not restart.get("socket_removed_after_stop", True):
                failures.append("socket left after the restarted coordinator stopped")
        report["failures"] = failures
        report["passed"] = not failures
        return report


def add_parser(sub) -> None:
    """Register the ``stress`` subcommand on an argparse subparsers object."""
    from shmkv.tools.args import (
        fraction,
        name_arg,
        non_negative_float,
        non_negative_int,
        path_arg,
        positive_float,
        positive_int,
    )

    p = sub.add_parser("stress", help="many processes, random ops, kills; everything verified")
    p.add_argument(
        "--workers", type=positive_int, default=8, help="worker processes doing random operations"
    )
    p.add_argument(
        "--duration",
        type=positive_float,
        default=None,
        help="seconds to run (default 30, or until --ops are done)",
    )
    p.add_argument(
        "--ops",
        type=positive_int,
        default=None,
        help="operations to run in all workers together (instead of --duration)",
    )
    p.add_argument(
        "--kill-rate",
        type=non_negative_float,
        default=0.0,
        help="SIGKILL this many random workers per second, and restart them (kills per second)",
    )
    p.add_argument(
        "--kill-coordinator",
        action="store_true",
        help="SIGKILL the coordinator partway; every worker must see CoordinatorGone",
    )
    p.add_argument(
        "--kill-coordinator-at",
        type=fraction,
        default=0.5,
        help="when to kill it, as a fraction of --duration (0-1)",
    )
    p.add_argument(
        "--gone-deadline",
        type=positive_float,
        default=2.0,
        help="seconds within which workers must see CoordinatorGone",
    )
    p.add_argument(
        "--tiers",
        action="store_true",
        help="a host-memory tier (a quarter of the pool) and a disk tier (four "
        "times the pool) under the pool, with more shared prefixes than it "
        "holds: hits are promoted while others demote",
    )
    p.add_argument(
        "--tier-dir",
        type=path_arg,
        default=None,
        metavar="DIR",
        help="the disk tier's directory with --tiers (default: a temporary one, "
        "removed at the end)",
    )
    p.add_argument(
        "--redis",
        default=None,
        metavar="URL",
        help="the Redis/Valkey store under the pool (redis://host:6379/0); at "
        "the end a second coordinator reads every prefix from it",
    )
    p.add_argument(
        "--json", type=path_arg, default=None, metavar="PATH", help="write the report here"
    )
    p.add_argument(
        "--name", type=name_arg, default=None, help="coordinator name (default stress-PID)"
    )
    p.add_argument(
        "--seed",
        type=non_negative_int,
        default=0,
        help="random seed of the operation mix (the same seed, the same plan)",
    )
    p.add_argument("--num-blocks", type=positive_int, default=256, help="blocks in the pool")
    p.add_argument("--block-size", type=positive_int, default=16, help="tokens per block")
    p.add_argument("--num-layers", type=positive_int, default=4, help="layers per block")
    p.add_argument("--num-kv-heads", type=positive_int, default=4, help="key/value heads")
    p.add_argument("--head-dim", type=positive_int, default=16, help="elements per head")
    p.add_argument("--dtype", default="float32", choices=sorted(_MODULUS), help="pool element type")
    p.add_argument(
        "--max-seqs", type=positive_int, default=12, help="live sequences per worker at most"
    )
    p.add_argument(
        "--max-tokens", type=positive_int, default=256, help="tokens per sequence at most"
    )
    p.add_argument(
        "--handoff-ttl",
        type=positive_float,
        default=5.0,
        help="seconds a hand-off token lives before it expires",
    )
    p.add_argument(
        "--client-timeout",
        type=positive_float,
        default=30.0,
        help="seconds a client waits for any answer of the coordinator",
    )
    p.add_argument(
        "--start-timeout",
        type=positive_float,
        default=120.0,
        help="seconds the workers have to start and connect",
    )
    p.add_argument(
        "--stop-timeout",
        type=positive_float,
        default=30.0,
        help="seconds the workers have to finish and report at the end",
    )
    p.add_argument(
        "--quiet",
        action="store_true",
        help="no progress bar or status lines on stderr (the bar is shown only "
        "on a terminal anyway)",
    )
    p.set_defaults(func=_cmd)


def _cmd(args) -> int:
    if args.duration is None and args.ops is None:
        args.duration = 30.0
    if args.workers < 1:
        print("shmkv stress: --workers must be at least 1", file=sys.stderr)
        return 2
    if args.tier_dir and not args.tiers:
        print("shmkv stress: --tier-dir needs --tiers", file=sys.stderr)
        return 2
    if args.redis:
        from shmkv.errors import ShmkvError
        from shmkv.tiers.redis_store import RedisTier

        try:
            RedisTier(args.redis)
        except (ShmkvError, ValueError, TypeError) as exc:
            print(f"shmkv stress: --redis {args.redis}: {exc}", file=sys.stderr)
            return 2
    report = StressRun(args).run()
    text = format_report(report)
    print(text, flush=True)
    if args.json:
        directory = os.path.dirname(os.path.abspath(args.json))
        os.makedirs(directory, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2, sort_keys=True, default=str)
    return 0 if report["passed"] else 1
