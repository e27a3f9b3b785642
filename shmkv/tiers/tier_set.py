"""The tiers of one coordinator as one object (:class:`TierSet`): what the coordinator's
loop, its request handlers and the remote store (``shmkv.tiers.redis_store``) call.

Owns the tiers' lifetime (the stores opened and closed), the pool's byte views, where
the copies run -- worker threads (``shmkv.memory.block_io.Copier``) or the tier I/O process
(``shmkv.tiers.io_process``): started, handed jobs, polled, and replaced by threads
should the process die -- and the loop's turn (:meth:`TierSet.tick`). It composes three
parts, made here, each the only writer of its own state and handed what it uses:

* ``Demotion`` (``shmkv.tiers.demotion``): what each tier holds, and every block down
  the tiers and its completion. Handed the pool, the stores, the pool's byte views and
  the cancel generations; its copies come back here as jobs (``take_jobs``).
* ``Promotions`` (``shmkv.tiers.promotions``): lookups, promotions and their completions.
  Handed the stores, the demotion part (pins, damaged files) and
  ``TierSet._start_promotion`` (where its job runs).
* ``DiskScan`` (``shmkv.tiers.scan``): the disk index rebuilt at start. Handed the disk
  store, the demotion part and the loop's wake.
 Every finished job comes back through :meth:`TierSet.tick`, which hands a promotion's to
the promotion part and the others to the demotion part. Imports ``shmkv.memory.shm``,
``shmkv.memory.pool``, ``shmkv.memory.block_io``, ``shmkv.kernels.native`` (when a CPU
pool's copies start) and the modules of ``shmkv.tiers`` but its ``__init__``.
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import socket
import sys
import threading
import time
from collections import deque
from typing import Any, Callable, Deque, List, Optional, Tuple

import numpy as np

from shmkv.memory import block_io, shm
from shmkv.memory.block_io import PROMOTE, WORKER_NICE, BlockFiles, Copier, Job, Mover
from shmkv.memory.pool import block_bytes
from shmkv.tiers import knobs
from shmkv.tiers.demotion import Demotion
from shmkv.tiers.disk_store import DiskStore
from shmkv.tiers.host_store import HostStore
from shmkv.tiers.io_process import IoProcess
from shmkv.tiers.promotions import Promotion, Promotions
from shmkv.tiers.scan import DiskScan
from shmkv.tiers.specs import HostTier

log = logging.getLogger(__name__)

_switch_lock = threading.Lock()
_switch_users = 0
_switch_saved = 0.0


def _shorten_switch_interval() -> None:
    global _switch_users, _switch_saved
    with _switch_lock:
        if _switch_users == 0:
            _switch_saved = sys.getswitchinterval()
            if _switch_saved > knobs.GIL_SWITCH_INTERVAL_S:
                sys.setswitchinterval(knobs.GIL_SWITCH_INTERVAL_S)
        _switch_users += 1


def _restore_switch_interval() -> None:
    global _switch_users
    with _switch_lock:
        _switch_users -= 1
        if _switch_users == 0:
            sys.setswitchinterval(_switch_saved)


class TierSet:
    """The tiers of one coordinator, their indexes, and where their copies run.

    Made by the coordinator at open. Everything here runs on the coordinator's loop
    thread: :meth:`lookup` (from a prefix lookup), :meth:`promote`, :meth:`tick`
    (every loop turn), :meth:`stats`, :meth:`close`. The copies run in the tier I/O
    process (a CPU pool, with ``IO_PROCESS`` and a ``wake_sock``) or in worker threads
    (a CUDA pool); see ``shmkv.memory.block_io``. Should the I/O process die, the copies it
    had fail (promotions end their hit there, demotions are not kept) and worker
    threads take over, with a warning.

    Its parts (see the module doc): the demotion part (blocks down a tier and their
    completions), the promotion part (lookups, promotions and their completions) and the
    disk scan. TierSet itself opens the tiers, starts the copies' workers (threads or
    the I/O process), hands them jobs and takes the finished ones back each turn, and
    closes.

    Args:
        specs: checked ``tiers=`` list (see :func:`~shmkv.tiers.specs.check_specs`).
        config: the pool's :class:`~shmkv.memory.layout.PoolConfig`.
        memory: the pool's :class:`~shmkv.memory.pool.PoolMemory`.
        table: the :class:`~shmkv.coordinator.sequences.SequenceTable` (its pool gets the hooks).
        wake: called from a worker thread to wake the loop.
        num_workers: threads for promotions and host copies (in either place).
        wake_sock: the loop's wake socket (write end); the I/O process sends a byte on
            it when a job is done. Without it copies run in threads.

    While worker threads run, the process's GIL switch interval is at most
    ``GIL_SWITCH_INTERVAL_S`` (see there why) and the threads run niced
    (``WORKER_NICE``); the I/O process runs at ``shmkv.memory.block_io.IO_PROCESS_POLICY``.

    Raises:
        ShmkvError and subclasses: a tier cannot be opened (nothing is left open).
    """

    # The parts, made last in __init__ (after every step that can fail but the scan's
    # thread): close() finds the demotion part only on a set that got that far.
    _demotion: Demotion
    _promotions: Promotions

    def __init__(
        self,
        specs: list,
        config,
        memory,
        table,
        wake: Callable[[], None],
        num_workers: int = 2,
        wake_sock: Optional[socket.socket] = None,
    ):
        self.config = config
        self.table = table
        self.pool = table.pool
        self.num_workers = num_workers
        self._wake_fn = wake
        self.host: Optional[HostStore] = None
        self.disk: Optional[DiskStore] = None
        self._staging: Optional[HostStore] = None  # staging slots (under a disk tier)
        self._copier: Optional[Copier] = None  # worker threads, or
        self._proc: Optional[IoProcess] = None  # the tier I/O process
        self._gens: Optional[np.ndarray] = None  # cancel generations, for the process
        # (made with it, moved by the demotion part)
        self._done: Deque[Job] = deque()  # jobs the workers finished
        self._scan: Optional[DiskScan] = None
        self._wake_pending = False
        self._proc_checked = 0.0  # when the I/O process was last polled
        self._jobs_out = 0  # jobs handed to workers, not yet back in tick()
        self._switch = False
        self._pool_u8 = self._pool_np = None
        try:
            for spec in specs:
                if spec.kind == "host":
                    self.host = HostStore(spec, config)
                    if not config.is_cuda:  # (made while the read-write one is open)
                        self.host.read_only_fd()
                else:
                    self.disk = DiskStore(spec, config, memory)
            files = self._files()
            if files is not None:
                self._staging = HostStore(
                    HostTier(knobs.STAGING_BLOCKS * config.block_nbytes),
                    config,
                    what="tier staging slots",
                )
            # Byte views of every rank's pool by block: [num_blocks, 2 * num_layers, chunk
            # bytes of that rank] (a block is a chunk of each layer's K and V).
            self._pool_u8 = [block_bytes(p) for p in memory.device_pools]
            self._pool_np = None if config.is_cuda else [t.numpy() for t in self._pool_u8]
            if knobs.IO_PROCESS and not config.is_cuda and wake_sock is not None:
                self._start_process(memory, wake_sock)
            else:
                self._start_threads()
            self._demotion = Demotion(
                self.pool,
                self.host,
                self.disk,
                self._staging,
                self._pool_u8,
                self._pool_np,
                self._gens,
            )
            self._demotion.hook()
            self._promotions = Promotions(
                config, table, self.host, self.disk, files, self._demotion, self._start_promotion
            )
            if self.disk is not None and files is not None:  # (a disk tier in use)
                self._scan = DiskScan(self.disk, self._demotion, self._wake)
                self._scan.start()
        except BaseException:
            self.close()
            raise

    # -- what the coordinator calls: lookups and promotions (the promotion part) --------

    def lookup(self, keys) -> int:
        """How many leading ``keys`` a tier can serve now (a pure index lookup)."""
        return self._promotions.lookup(keys)

    def held_here(self, keys) -> int:
        """Leading ``keys`` whose bytes are on this host (all a lookup found: every tier
        here is local), so a promotion of them fails only on a damaged file."""
        return self._promotions.held_here(keys)

    def keep_planned(self, keys) -> None:
        """``keys`` (found by :meth:`lookup`) are an allocation's plan: until the next
        :meth:`tick`, by which the loop has started that promotion and pinned them, they
        are not dropped to make room (for a block the same allocation, or another one
        served before the promotion starts, evicts and rescues)."""
        self._demotion.keep_planned(keys)

    def promote(self, records: list, in_client: bool = False) -> Promotion:
        """Start copying the blocks of ``records`` (``PendingPromotion`` records, of
        ``shmkv.coordinator.prefix``) into their fresh pool blocks; :meth:`tick` returns the
        promotion when done. With ``in_client``, the asking client copies them
        (:meth:`client_copies`) and :meth:`finish_in_client` takes its report instead."""
        return self._promotions.promote(records, in_client)

    def client_memory(self) -> Tuple[Optional[dict], List[int]]:
        """What a client needs to copy its own promotions (the ``tier_memory`` answer):
        the host tier's slots and slot bytes and the disk tier's block files, with the
        host tier's descriptor, read-only. ``(None, [])`` where a client cannot: a CUDA
        pool, or no read-only descriptor."""
        return self._promotions.client_memory()

    def client_copies(self, promo: Promotion, promo_id: int) -> dict:
        """The copies of ``promo`` (started ``in_client``) as its client runs them
        (``shmkv.memory.block_io.ClientCopies``): op codes, pool blocks, host slots, keys."""
        return self._promotions.client_copies(promo, promo_id)

    def finish_in_client(self, promo: Promotion, statuses: Optional[bytes], errors: list) -> None:
        """The client of ``promo`` (started ``in_client``) reported its copies: one
        ``block_io`` status a copy (None: its connection dropped, so none counts as
        done), and ``[index, text]`` of the copies that failed.

        Raises:
            InvalidArgument: ``statuses`` is not one byte a copy, or ``errors`` not
                ``[index, text]`` pairs of distinct copies (nothing changed).
        """
        self._promotions.finish_in_client(promo, statuses, errors)

    @property
    def num_promotions_in_flight(self) -> int:
        """Promotions started and not completed."""
        return self._promotions.num_in_flight

    @property
    def num_lost_evictions(self) -> int:
        """Blocks the pool evicted that no tier held nor could take."""
        return self._demotion.num_lost_evictions

    @property
    def num_rescued_evictions(self) -> int:
        """Blocks the pool evicted before their copy down a tier was done, copied then."""
        return self._demotion.num_rescued_evictions

    # -- where copies run ------------------------------------------------------------------

    def _files(self) -> Optional[BlockFiles]:
        """The disk tier's block files if it is in use (not disabled)."""
        disk = self.disk
        return disk.files if disk is not None and disk.disabled is None else None

    def _row_copy(self) -> Callable[[np.ndarray, np.ndarray], Any]:
        """What copies a CPU pool's blocks to and from flat memory: the native row copy
        (``shmkv.kernels.native.copier``), else ``np.copyto``."""
        if self._pool_np is None:
            return np.copyto
        from shmkv.kernels import native

        return native.copier() or np.copyto

    def _start_threads(self) -> None:
        host, staging = self.host, self._staging
        mover = Mover(
            self.config.block_nbytes,
            pool_np=self._pool_np,
            pool_u8=self._pool_u8,
            host_np=None if host is None else host.np,
            host_t=None if host is None else host.data,
            files=self._files(),
            gens=self._gens,
            pinned=self.config.is_cuda,
            staging_np=None if staging is None else staging.np,
            staging_t=None if staging is None else staging.data,
            copy=self._row_copy(),
        )
        _shorten_switch_interval()
        self._switch = True
        self._copier = Copier(
            mover, self._finish, self.num_workers, disk=self._files() is not None, nice=WORKER_NICE
        )

    def _start_process(self, memory, wake_sock: socket.socket) -> None:
        cfg = self.config
        fd = shm.create_segment(4 * cfg.num_blocks, "tier cancel generations")
        try:
            gens_map = mmap.mmap(
                fd, 4 * cfg.num_blocks, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE
            )
            self._gens = np.frombuffer(gens_map, dtype=np.uint32)
            host, files = self.host, self._files()
            fds = [memory.fds[1], fd, wake_sock.fileno()]
            spec = {
                "parent": os.getpid(),
                "block_nbytes": cfg.block_nbytes,
                "pool": [memory.fds[1], cfg.num_blocks, cfg.block_nbytes, 2 * cfg.num_layers],
                "gens": [fd, cfg.num_blocks],
                "wake": wake_sock.fileno(),
                "host": None,
                "files": None if files is None else files.files_wire(),
                "workers": self.num_workers,
                "policy": block_io.IO_PROCESS_POLICY,
                "preload": knobs.IO_PROCESS_PRELOAD,
                "copy_lib": None,
            }
            copy = self._row_copy()
            if isinstance(copy, block_io.RowCopy):  # the I/O process loads the same file
                spec["copy_lib"] = copy.path
            for name, store in (("host", host), ("staging", self._staging)):
                if store is not None:
                    spec[name] = [store.fd, store.num_slots, store.slot_nbytes]
                    fds.append(store.fd)
            self._proc = IoProcess(spec, fds)
        finally:
            os.close(fd)
            for store in (self.host, self._staging):
                if store is not None:
                    store.close_fd()
        why = self._proc.wait_ready(knobs.IO_PROCESS_START_S)
        if why is not None:
            log.warning(
                "tier I/O process did not start (%s); tier copies run in threads of "
                "the coordinator",
                why,
            )
            self._proc.close(5.0)
            self._proc = None
            self._start_threads()

    # -- loop side: handing jobs out and taking them back ------------------------------------

    def _send(self, queue: int, job: Job) -> None:
        """Hand a job to the workers (threads or the I/O process); tick() takes it back."""
        self._jobs_out += 1
        if self._proc is not None:
            self._proc.submit(queue, job)  # sent at the end of this turn's tick()
        else:
            assert self._copier is not None  # (the threads run when no process does)
            self._copier.submit(queue, job)

    def _start_promotion(self, promo: Promotion) -> None:
        """Hand a promotion's copies to the workers as one job: its columns to the I/O
        process, copy objects to threads. Workers take its copies one at a time, so the
        reads and checksums of one request still run in parallel, and the loop takes
        back one completion."""
        if self._proc is not None:
            self._send(PROMOTE, Job(None, promo, num_copies=len(promo.ops)))
        else:
            self._send(PROMOTE, Job(promo.copies(), promo))

    # -- loop side: the turn ----------------------------------------------------------------

    def tick(
        self, woken: bool = True, waiting: Optional[Callable[[], bool]] = None
    ) -> List[Promotion]:
        """Take finished copies, schedule new ones; returns the finished promotions.

        ``woken``: the loop's wake socket was readable this turn. The I/O process sends
        a byte there after every completion, so on other turns it has none to take and
        is not polled (a turn that only served requests does no tier I/O), but for one
        turn every ``IO_PROCESS_CHECK_S`` while it has jobs: a process that died sends
        no byte, and its jobs must not wait for one (see :meth:`max_wait`).

        ``waiting``: tells whether a client waits to be served (the loop's sockets
        polled without sleeping). The blocks that became cached are placed down the
        tiers ``PLACE_CHUNK`` at a time, and once a client waits the rest go to the
        backlog for the next turn: a released sequence's blocks are a hundred
        microseconds of Python, which a ping should not wait behind. They stay where
        the pool evicts them last (``BlockPool.copying``), and an eviction of one
        rescues it, as for any block in the backlog."""
        self._wake_pending = False
        demotion = self._demotion
        demotion.new_turn(waiting)
        finished: List[Promotion] = []
        if (
            self._proc is not None
            and self._jobs_out
            and (woken or time.monotonic() - self._proc_checked >= knobs.IO_PROCESS_CHECK_S)
        ):
            self._proc_checked = time.monotonic()
            self._poll_process()
        done = self._done
        while done:
            self._complete(done.popleft(), finished)
        if self._scan is not None and self._scan.has_news:
            self._scan.merge()
        demotion.place_cached()
        for queue, job in demotion.take_jobs():
            self._send(queue, job)
        if self._proc is not None:  # one send a turn for every job of the turn
            self._proc.flush()
            if not self._proc.alive:
                self._take_over()
        return finished

    def max_wait(self) -> float:
        """The longest the loop may sleep before its next :meth:`tick`: while the I/O
        process has jobs, ``IO_PROCESS_CHECK_S`` (it is then polled even without a wake
        byte, so that a process that died is found and its jobs run in threads)."""
        if self._demotion.deferred:  # placing stopped for a client: go on after serving it
            return 0.0
        if self._proc is not None and self._jobs_out:
            return knobs.IO_PROCESS_CHECK_S
        return math.inf

    @property
    def num_pending(self) -> int:
        """Copies scheduled or running, plus blocks waiting for a disk write."""
        return self._jobs_out + self._demotion.num_waiting

    def _poll_process(self) -> None:
        """Take the I/O process's completions; if it died, hand its jobs to threads."""
        proc = self._proc
        assert proc is not None  # (called while it runs)
        self._done.extend(proc.poll())
        if not proc.alive:
            self._take_over()

    def _take_over(self) -> None:
        """The I/O process is gone: worker threads run the jobs it had not completed, and
        every copy from now on. Running a copy twice is safe: the loop has taken no
        outcome of these jobs yet, the pool blocks they fill are still reserved, the
        ones they read are checked for cancellation, and files are renamed into place."""
        proc = self._proc
        assert proc is not None  # (called while it runs)
        log.warning(
            "tier I/O process exited (%s); its %d unfinished jobs and all tier "
            "copies from now on run in threads of the coordinator",
            proc.exit_reason(),
            len(proc.jobs),
        )
        jobs = list(proc.jobs.values())
        proc.close(0.0)  # killed if it was still there: no copy runs in two places
        self._proc = None
        self._start_threads()
        copier = self._copier
        assert copier is not None  # (started just now)
        for job in jobs:
            if job.copies is None:  # a promotion's columns: as copies, for the threads
                job.copies = job.promotion.copies()
            copier.submit(job.queue, job)

    def _complete(self, job: Job, finished: list) -> None:
        self._jobs_out -= 1
        if job.promotion is not None:
            finished.append(self._promotions.take(job))
        else:
            assert job.copies is not None  # (only a promotion's job travels as columns)
            self._demotion.complete(job.copies)

    # -- worker side -------------------------------------------------------------------

    def _wake(self) -> None:
        if not self._wake_pending:
            self._wake_pending = True
            self._wake_fn()

    def _finish(self, job: Job) -> None:
        self._done.append(job)
        self._wake()

    # -- stats and teardown ------------------------------------------------------------------

    def stats(self) -> list:
        """One dict per tier: blocks, bytes, hits, demotions, promotions, dropped, errors."""
        return [store.stats() for store in (self.host, self.disk) if store is not None]

    def io_stats(self) -> dict:
        """What is moving: pending copies, promotions in flight, evictions that lost a block."""
        return {
            "pending": self.num_pending,
            "promotions_in_flight": self.num_promotions_in_flight,
            "lost_evictions": self.num_lost_evictions,
            "rescued_evictions": self.num_rescued_evictions,
            "scanning": bool(self.disk is not None and self.disk.scanning),
        }

    def close(self, timeout: float = 10.0) -> None:
        """Stop the workers or the I/O process (a copy under way finishes; queued ones are
        abandoned) and release the tiers. Idempotent; safe on a half-built set."""
        scan = self._scan
        if scan is not None:
            scan.stop()  # (it stops at its next file while the workers stop)
        if self._proc is not None:
            self._proc.close(knobs.IO_PROCESS_EXIT_S)
            self._proc = None
        if self._copier is not None:
            self._copier.close(timeout)
            self._copier = None
        if scan is not None:
            scan.join(timeout)
            self._scan = None
        if self._switch:
            self._switch = False
            _restore_switch_interval()
        demotion = getattr(self, "_demotion", None)  # (None: not made, no hook set)
        if demotion is not None:
            demotion.close()
        for name in ("host", "disk", "_staging"):
            store = getattr(self, name)
            if store is not None:
                store.close()
        self._pool_u8 = self._pool_np = self._gens = None
