"""The tier I/O process from the loop's side (:class:`IoProcess`): start it, send it
jobs, take its completions, stop it.
 Owns the child process and its socket (a forked child of the coordinator drops its copy of
the socket). What the process runs, and the frames both sides speak, are
``shmkv.memory.block_io`` (run as a script: ``python shmkv/memory/block_io.py SPEC``); which
jobs go to it, and what happens when it dies, are ``shmkv.tiers.tier_set``'s. Imports only
``shmkv.memory.block_io``.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
import subprocess
import sys
import time
import weakref
from typing import Optional

from shmkv.memory import block_io
from shmkv.memory.block_io import Job

log = logging.getLogger(__name__)

_POLL_RECV = 1 << 16  # bytes a recv of the I/O process's completions asks for


class IoProcess:
    """Start the tier I/O process (``shmkv.memory.block_io``), send it jobs, take its completions,
    stop it. Loop thread only; nothing here blocks but :meth:`close`.

    Args:
        spec: the process's description (JSON; ``sock`` is added here).
        fds: descriptors it inherits (the ones ``spec`` names).
    """

    def __init__(self, spec: dict, fds: list):
        self.jobs: dict = {}  # job id -> Job sent and not completed
        self.alive = False
        self.proc: Optional[subprocess.Popen] = None
        self.sock: Optional[socket.socket] = None
        self._next_id = 1
        self._out = bytearray()  # job frames the socket did not take yet
        self._in = bytearray()
        mine, theirs = socket.socketpair()
        try:
            spec = dict(spec, sock=theirs.fileno())
            # A fresh interpreter running block_io.py by path (no torch, no shmkv import):
            # not multiprocessing, whose daemonic coordinator process may have no
            # children and whose spawn would re-run an unguarded __main__.
            self.proc = subprocess.Popen(
                [sys.executable, block_io.__file__, json.dumps(spec)],
                pass_fds=fds + [theirs.fileno()],
                stdin=subprocess.DEVNULL,
                close_fds=True,
                # numpy's BLAS would start a thread per CPU at import; copies need none
                env=dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1"),
            )
        except BaseException:
            mine.close()
            raise
        finally:
            theirs.close()
        mine.setblocking(False)
        self.sock = mine
        self.alive = True
        _LIVE_IO.add(self)

    def wait_ready(self, timeout: float) -> Optional[str]:
        """Wait up to ``timeout`` seconds for the process's ready frame (it has mapped
        the pool and serves). None once it came; else why not (the process is left to
        :meth:`close`)."""
        sock, proc = self.sock, self.proc
        assert sock is not None and proc is not None  # (started in __init__, not closed)
        want = block_io.encode_ready()
        got = bytearray()
        deadline = time.monotonic() + timeout
        try:
            while len(got) < len(want):
                left = deadline - time.monotonic()
                if left <= 0:
                    return f"not ready within {timeout:.0f} s"
                sock.settimeout(left)
                try:
                    data = sock.recv(len(want) - len(got))
                except socket.timeout:
                    continue
                if not data:  # it exited (or closed its end): say how, once it has
                    try:
                        proc.wait(min(5.0, max(0.0, deadline - time.monotonic())))
                    except subprocess.TimeoutExpired:
                        pass
                    return self.exit_reason()
                got += data
        except OSError as exc:
            return str(exc)
        finally:
            if self.sock is not None:
                self.sock.setblocking(False)
        return None if bytes(got) == want else "it sent no ready frame"

    def submit(self, queue: int, job: Job) -> None:
        """Queue a job: one of copies, or a promotion's (``job.copies`` None), encoded
        from the promotion's columns."""
        job.queue = queue
        job.job_id = self._next_id
        self._next_id = self._next_id % 0xFFFFFFFF + 1
        self.jobs[job.job_id] = job
        if job.copies is not None:
            self._out += block_io.encode_job(queue, job)
            return
        promo = job.promotion
        self._out += block_io.encode_columns(
            job.job_id,
            queue,
            promo.ops,
            promo.blocks,
            promo.slots,
            [0] * job.num_copies,
            promo.keys,
        )

    def flush(self) -> None:
        """Send the jobs submitted since (as much as the socket takes; the rest later)."""
        if self._out and self.alive:
            assert self.sock is not None  # (alive: not closed)
            try:
                sent = self.sock.send(self._out)
            except BlockingIOError:  # the process is behind: the next turn sends the rest
                return
            except OSError:
                self.alive = False
                return
            del self._out[:sent]

    def poll(self) -> list:
        """Jobs completed since the last call (outcomes recorded on their copies). Sets
        ``alive`` False when the process has gone."""
        self.flush()
        while self.alive:
            assert self.sock is not None  # (alive: not closed)
            try:
                data = self.sock.recv(_POLL_RECV)
            except BlockingIOError:
                break
            except OSError:
                data = b""
            if not data:
                self.alive = False
                break
            self._in += data
            if len(data) < _POLL_RECV:  # all there was: no second recv (and its exception)
                break
        finished = []
        for body in block_io.split_frames(self._in):
            try:
                finished.append(block_io.apply_done(body, self.jobs))
            except (ValueError, struct.error) as exc:
                log.error("tier I/O process sent a bad completion (%s); stopping it", exc)
                self.alive = False
                break
        return finished

    def exit_reason(self) -> str:
        code = None if self.proc is None else self.proc.poll()
        return "its socket closed" if code is None else f"exit code {code}"

    def close(self, timeout: float) -> None:
        """Close the socket (the process finishes the copy under way and exits) and wait
        for it up to ``timeout`` seconds, then kill it. Idempotent."""
        self.alive = False
        if self.sock is not None:
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self.sock.close()
            self.sock = None
        if self.proc is not None:
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning(
                    "tier I/O process %d did not exit within %.0f s; killing it",
                    self.proc.pid,
                    timeout,
                )
                self.proc.kill()
                self.proc.wait(5.0)
            self.proc = None
        _LIVE_IO.discard(self)

    def forget_after_fork(self) -> None:
        """In a forked child: close this copy of the socket; the process is the parent's."""
        if self.sock is not None:
            self.sock.close()  # no shutdown: that would end the parent's connection too
            self.sock = None
        self.proc = None
        self.alive = False


_LIVE_IO: "weakref.WeakSet[IoProcess]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    """A forked child must not keep the tier I/O process's socket: it would hide the
    parent's death from the process."""
    for io in list(_LIVE_IO):
        io.forget_after_fork()
    _LIVE_IO.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
