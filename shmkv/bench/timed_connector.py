"""``TimedShmkvConnector``: :class:`~shmkv.integrations.vllm.ShmkvConnector` with its vLLM
hooks timed, for the replicas of ``shmkv bench --only serving``.

Loaded by a ``vllm serve`` replica as ``"kv_connector": "TimedShmkvConnector",
"kv_connector_module_path": "shmkv.bench.timed_connector"``. Every process that builds
the connector (vLLM's scheduler in the engine core, each worker) adds up, per hook, the
seconds spent in it and its calls, and a daemon thread of that process writes the totals
every half second to ``$SHMKV_BENCH_HOOK_DIR/PID.json`` (``{"pid": ..., "hooks":
{name: [seconds, calls]}, "counters": {name: count}}``; replaced atomically), where the
benchmark reads them before and after each run. The counters are the scheduler side's
(:data:`COUNTERS`): lookups counted as misses for want of an answer in time, and
requests that waited for a prefix another engine computed. A hook costs two
``perf_counter`` calls more; nothing else changes.
Without ``$SHMKV_BENCH_HOOK_DIR`` the totals are kept and never written.
"""

from __future__ import annotations

import json
import os
import threading
import time
import weakref
from typing import Dict, List

from shmkv.integrations.vllm import ShmkvConnector, ShmkvConnectorWorker

HOOK_DIR_ENV = "SHMKV_BENCH_HOOK_DIR"
DUMP_EVERY_S = 0.5
# vLLM's connector hooks (scheduler side, then worker side), and the copies between the
# pool and vLLM's blocks, which run inside start_load_kv and wait_for_save (the worker
# side's _copy_layer)
HOOKS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "request_finished",
    "bind_connector_metadata",
    "start_load_kv",
    "wait_for_layer_load",
    "save_kv_layer",
    "wait_for_save",
    "clear_connector_metadata",
    "get_finished",
    "get_block_ids_with_load_errors",
    "get_kv_connector_stats",
    "_copy_layer",
)

# The scheduler side's counters, by the name they are written under
COUNTERS = {"late_lookups": "num_late_lookups", "computing_waits": "num_computing_waits"}

_TOTALS: Dict[str, List[float]] = {}  # hook -> [seconds, calls], this process
_SCHEDULERS: "weakref.WeakSet[TimedShmkvConnector]" = weakref.WeakSet()  # this process's
_LOCK = threading.Lock()
_STARTED: List[int] = []  # the pid whose writer thread runs (a fork starts its own)


def _dump(directory: str) -> None:
    with _LOCK:
        record = {"pid": os.getpid(), "hooks": {k: list(v) for k, v in _TOTALS.items()}}
    counters = dict.fromkeys(COUNTERS, 0)
    for connector in list(_SCHEDULERS):
        for name, attr in COUNTERS.items():
            counters[name] += getattr(connector, attr)
    record["counters"] = counters
    path = os.path.join(directory, f"{os.getpid()}.json")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(record, f)
    os.replace(tmp, path)


def _writer(directory: str) -> None:
    while True:
        time.sleep(DUMP_EVERY_S)
        try:
            _dump(directory)
        except OSError:
            return  # the benchmark removed its directory: it is over


def _start_writer() -> None:
    directory = os.environ.get(HOOK_DIR_ENV)
    if not directory or (_STARTED and _STARTED[0] == os.getpid()):
        return
    _STARTED[:] = [os.getpid()]
    threading.Thread(
        target=_writer, args=(directory,), name="shmkv-bench-hooks", daemon=True
    ).start()


def _timed(name: str, method):
    def run(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            spent = time.perf_counter() - t0
            with _LOCK:
                total = _TOTALS.setdefault(name, [0.0, 0])
                total[0] += spent
                total[1] += 1

    run.__name__ = name
    run.__doc__ = method.__doc__
    return run


class TimedShmkvConnectorWorker(ShmkvConnectorWorker):
    """The connector's worker side, its copies timed (``_copy_layer`` in :data:`HOOKS`)."""


class TimedShmkvConnector(ShmkvConnector):
    """The connector, each hook in :data:`HOOKS` timed (see the module's doc)."""

    worker_class = TimedShmkvConnectorWorker

    def __init__(self, vllm_config, role, kv_cache_config=None):
        _start_writer()
        super().__init__(vllm_config, role, kv_cache_config)
        if self.connector_scheduler is not None:
            _SCHEDULERS.add(self)


for _name in HOOKS:
    if hasattr(ShmkvConnector, _name):
        setattr(TimedShmkvConnector, _name, _timed(_name, getattr(ShmkvConnector, _name)))
    elif hasattr(ShmkvConnectorWorker, _name):
        setattr(
            TimedShmkvConnectorWorker, _name, _timed(_name, getattr(ShmkvConnectorWorker, _name))
        )
