"""The bytes the tiers move: block files, copies, and the tier I/O process.

Owns how one block moves between the pool, the host tier and a block file
(:class:`Mover`), the block file format (:class:`BlockFiles`), the threads that run
copies (:class:`Copier`), and the tier I/O process (:func:`main`). Owns no index:
which key a tier holds, LRU order, pins and counters belong to the coordinator's
loop (``shmkv.tiers``), which decides every copy; this module only carries them out
and reports how each went. Imports neither torch nor the rest of shmkv, so that the
I/O process starts in a fraction of a second (it runs this file as a script).

One module of about 1,400 lines, on purpose: the I/O process runs this file by path,
with no package on its import path, so what it runs (the copies, the block file format,
the frames, the copier threads) has to be in this file; split, it would import its
other parts by path, or import the package and torch with them.

Where copies run (chosen by ``shmkv.tiers.TierSet``):

* A CPU pool: in the **tier I/O process**, a child of the coordinator whose workers
  run at the lowest CPU priority (SCHED_IDLE; see ``IO_PROCESS_POLICY``). Measured on
  2 cores, worker threads inside the coordinator held ping p99 at 5-15x idle while
  promoting: the loop waited for the GIL and the cores behind the copies. Another
  process shares no GIL, and the scheduler runs the loop and the clients first. So
  that CPUs kept busy by other work cannot starve the copies (a request may wait for
  a promotion; a demotion not done when its block is evicted is lost), a queue the
  lowest-priority workers took nothing from for ``URGENT_AFTER_S`` is served by
  workers at normal priority until they do again (:class:`Copier`). It maps the pool,
  the host tier, the staging slots and the cancel generations by descriptor (the
  segments have no name), sends one ready frame once it has, writes and reads block
  files, and talks to the loop over a socket pair: jobs in, one completion per job
  out, plus a byte on the loop's wake socket. Nothing else
  travels: no index, no tensor bytes.
* A CUDA pool: in threads of the coordinator (:class:`Copier` there), because the
  pool is device memory of the coordinator's CUDA context; another process would
  need a context and IPC handles of its own. The threads run niced, and the process's
  GIL switch interval is shortened while they run (``shmkv.tiers``).

The I/O process dies with the coordinator: it reads jobs with a timeout and exits at
end of file or when its parent changed (the coordinator died), checks its parent
before every copy, and before it renames a block file into place, so after a
SIGKILLed coordinator it renames no further block (a partial ``.tmp-`` file it leaves
is removed by the next scan of the directory, as a killed writer's). It ignores
SIGINT (a Ctrl-C to the terminal's process group stops the coordinator, which stops
it). It owns no segment, socket file or lock: those are the coordinator's.

Wire format (little endian), each frame a u32 length then the body:

* loop to process, a job: ``b"J"``, job id u32, queue u8 (0 promotion, 1 demotion,
  2 disk), number of copies u32; each copy op u8 (index in ``OPS``), pool block i32,
  host slot i32, cancel generation u32, key 16 bytes.
* process to loop, once first: ``b"R"``, ready (it has mapped the pool and serves).
* process to loop, a completion: ``b"D"``, job id u32, number of copies u32, one
  status u8 per copy (``OK``, ``CANCELLED``, ``DAMAGED``, ``ENOSPC``, ``FAILED``), then
  for each copy not OK or CANCELLED a u16 length and its error text (UTF-8).

Cancellation without a lock: a copy out of the pool reads the block first and its
cancel state after. The loop cancels before it can answer anyone who would write the
block again: in process it sets the copy's ``cancelled``; for the I/O process it bumps
the block's generation in shared memory (``gens``), which the job carried as it was
when the copy was scheduled.

Memory ordering. That check is lock-free, and is sound only where the CPU keeps a
thread's loads in order (x86 and x86-64, ``STRONG_ORDER``): elsewhere (aarch64, say)
the read of the generation may be satisfied before the copy's reads of the block, so
a copy could pass its check holding bytes a client wrote after the eviction; Python
offers no fence to prevent it. So off x86 the check only saves work, and correctness
rests on a hand-off that orders memory on every CPU: the worker's completion travels
to the loop over a socket (or, in threads, a lock), and the loop keeps a copy out of
the pool only if the block still held its key when the completion was taken
(``shmkv.coordinator.allocator``: ``BlockPool.still_holds``), so every read of the copy happened
while nobody could write the block. A copy into host memory (``p2h``, ``p2s``) that
fails that check is dropped with its slot. A block file cannot be dropped that way
once renamed into place, so off x86 (``STRONG_ORDER`` False) the loop never schedules
``p2d``: a block goes to disk through a staging slot of host memory (``p2s``, checked
by the loop, then ``s2d``), the safe path. On x86 ``p2d`` is kept (one copy less):
there a copy that passed its check read bytes the key still named.
"""

from __future__ import annotations

if __name__ == "__main__":  # run as the I/O process: this file's folder is no package root
    import sys

    del sys.path[0]

import ctypes
import errno
import json
import mmap
import os
import platform
import signal
import socket
import stat
import struct
import sys
import threading
import time
import zlib
from collections import deque
from itertools import chain
from typing import Any, Callable, Deque, Dict, Iterable, List, Optional, Tuple

import numpy as np
from xxhash import xxh3_64, xxh3_64_intdigest

MAGIC = b"SHMKVBLK"
# 2: the payload checksum is xxh3-64 (crc32 capped promotion speed). 3: a directory's
# namespace is the block layout's (``PoolConfig.block_fingerprint``), so a pool of another
# size uses the same directory.
FORMAT_VERSION = 3
_HEAD = struct.Struct("<8sHHI16s16s5I12sQQ")  # everything up to the header's own crc
_CRC = struct.Struct("<I")
HEADER_SIZE = _HEAD.size + _CRC.size  # 100

OPS = ("none", "p2h", "h2p", "h2d", "p2d", "d2p", "del", "p2s", "s2d")
_OP_CODE = {op: i for i, op in enumerate(OPS)}
OP_NONE, OP_H2P, OP_D2P = _OP_CODE["none"], _OP_CODE["h2p"], _OP_CODE["d2p"]
PROMOTE, DEMOTE, DISK = 0, 1, 2  # the queues of a Copier, best first
OK, CANCELLED, DAMAGED, ENOSPC, FAILED = range(5)

# The I/O process's priority. "idle": SCHED_IDLE, it runs on CPU time nobody else wants;
# a waking loop or client preempts it at once, and the scheduler counts its CPU as idle
# when it places them. The price: on CPUs saturated by other work its copies crawl (a
# share of about 0.3%) and so do the requests that wait for promotions; "nice" (nice
# IO_PROCESS_NICE) keeps about 1.5% and lets a woken task wait up to a time slice.
IO_PROCESS_POLICY = "idle"
IO_PROCESS_NICE = 19
# A queue of copies that the lowest-priority workers took nothing from for this long
# (other work keeps the CPUs busy) is served by workers at normal priority until they
# take from it again: as if the requesting client copied the blocks itself.
URGENT_AFTER_S = 0.002
WORKER_NICE = 10  # how much nicer than the loop in-process worker threads run
IO_SWITCH_INTERVAL_S = 0.0002  # GIL switch interval of the I/O process (why: shmkv.tiers)
PARENT_CHECK_S = 1.0  # the I/O process looks for its parent at least this often
# Whether this CPU keeps a thread's loads in order (x86 and x86-64: total store order).
# Only then may a copy out of the pool trust its own cancel check (the module doc);
# elsewhere (aarch64, POWER, RISC-V) ``shmkv.tiers`` never lets one write a block file
# straight from the pool.
STRONG_ORDER = platform.machine().lower() in (
    "x86_64",
    "amd64",
    "i386",
    "i486",
    "i586",
    "i686",
    "x86",
)

_FRAME = struct.Struct("<I")
_JOB = struct.Struct("<cIBI")
_JOB_COPY = struct.Struct("<BiiI16s")
_DONE = struct.Struct("<cII")
_MSG = struct.Struct("<H")


class Damaged(Exception):
    """A block file that must not be served (the reason is the message)."""


# Every file of a tier directory is opened with these flags: a planted symbolic link is
# not followed (the open fails with ELOOP), a FIFO or a device does not block the open
# (it is then refused: only regular files are read or written), and no terminal becomes
# the process's. O_NONBLOCK is left set on the regular files: Linux ignores it for their
# reads and writes.
OPEN_FLAGS = os.O_NOFOLLOW | os.O_NOCTTY | os.O_CLOEXEC | os.O_NONBLOCK


class NotRegular(OSError):
    """A name in a tier directory that is not a regular file (a FIFO, a directory...)."""


def open_regular(path: str, flags: int, mode: int = 0o600) -> tuple:
    """``(fd, stat)`` of a regular file of a tier directory, opened with ``flags`` and
    ``OPEN_FLAGS``. Raises OSError: ELOOP for a symbolic link, :class:`NotRegular` for
    anything else that is not a regular file (closed again), or the open's own error."""
    fd = os.open(path, flags | OPEN_FLAGS, mode)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegular(errno.EINVAL, "not a regular file", path)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def _open_block(path: str) -> tuple:
    """``(fd, stat)`` of a block file to read; Damaged if the name is not a regular
    file (FileNotFoundError passes)."""
    try:
        return open_regular(path, os.O_RDONLY)
    except NotRegular:
        raise Damaged("not a regular file") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise Damaged("a symbolic link") from None
        raise


class Cancelled(Exception):
    """The pool block changed hands while it was copied: the copy is void."""


class Copy:
    """One block moved. ``op``: p2h, h2p, d2p, h2d, p2d (pool, host, disk), p2s and s2d
    (pool to a staging slot, staging slot to disk), del (delete a file) or none. ``gen``:
    the block's cancel generation when it was scheduled."""

    __slots__ = (
        "op",
        "key",
        "block",
        "slot",
        "gen",
        "entry",
        "src",
        "cancelled",
        "ok",
        "error",
        "damaged",
        "enospc",
    )

    def __init__(
        self,
        op: str,
        key: bytes,
        block: int = -1,
        slot: int = -1,
        entry: Any = None,
        src: Any = None,
        gen: int = 0,
    ):
        self.op, self.key, self.block, self.slot, self.gen = op, key, block, slot, gen
        self.entry = entry  # the tier entry this copy fills (demotions; loop side)
        self.src = src  # the tier entry this copy reads and pins (loop side)
        self.cancelled = False
        self.ok = False
        self.error: Optional[str] = None
        self.damaged = False
        self.enospc = False


class Job:
    """Copies started in order (the disk queue's also run in order: it has one worker).
    ``promotion``: the loop's, or None.

    A promotion the loop sends to the I/O process has no copies on its side (``copies``
    None): the loop encodes it from the promotion's columns, and its outcomes come back
    as ``statuses`` (one status byte a copy, ``OK`` ...) and ``errors`` (copy index ->
    the error text of a copy that failed), which :func:`apply_done` records on it."""

    __slots__ = (
        "copies",
        "promotion",
        "job_id",
        "queue",
        "queued_at",
        "num_taken",
        "num_left",
        "num_copies",
        "statuses",
        "errors",
    )

    def __init__(
        self,
        copies: Optional[List[Copy]],
        promotion: Any = None,
        job_id: int = 0,
        queue: int = PROMOTE,
        num_copies: Optional[int] = None,
    ):
        self.copies = copies
        self.promotion = promotion
        self.job_id = job_id
        self.queue = queue
        self.queued_at = 0.0
        self.num_taken = self.num_left = 0  # copies taken by workers, not finished (Copier)
        if num_copies is None:
            assert copies is not None, "a job sent as columns says how many copies it has"
            num_copies = len(copies)
        self.num_copies = num_copies
        self.statuses: Optional[bytes] = None
        self.errors: Optional[Dict[int, str]] = None


# -- the block file format -----------------------------------------------------------------


class BlockFiles:
    """The block files of one disk tier directory: names, header, write and read.

    Args:
        blocks_dir: the ``blocks`` folder of the directory.
        session: hex id of this coordinator's run (names its temporary files).
        namespace: 16 bytes every header carries (layout fingerprint and salt).
        shape: (num_layers, block_size, num_kv_heads, head_dim, tp_size, dtype bytes).
        payload_nbytes: bytes of one block (every rank's).
        fsync: fsync each file (and the folder) around the rename.

    ``before_rename``, when set, is called after a file is written and before it is
    renamed into place (the I/O process exits there if the coordinator is gone).
    """

    before_rename: Optional[Callable[[], None]] = None

    def __init__(
        self,
        blocks_dir: str,
        session: str,
        namespace: bytes,
        shape: tuple,
        payload_nbytes: int,
        fsync: bool,
    ):
        self.blocks_dir = blocks_dir
        self.session = session
        self.namespace = namespace
        self._shape = tuple(shape)
        self.payload_nbytes = payload_nbytes
        self.fsync = fsync

    def files_wire(self) -> dict:
        """What the I/O process needs to make the same :class:`BlockFiles` (JSON)."""
        layers, block_size, heads, head_dim, tp, dtype = self._shape
        return {
            "blocks_dir": self.blocks_dir,
            "session": self.session,
            "namespace": self.namespace.hex(),
            "payload_nbytes": self.payload_nbytes,
            "shape": [layers, block_size, heads, head_dim, tp, dtype.decode()],
            "fsync": self.fsync,
        }

    @classmethod
    def from_wire(cls, wire: dict) -> "BlockFiles":
        shape = list(wire["shape"])
        shape[5] = shape[5].encode()
        return cls(
            wire["blocks_dir"],
            wire["session"],
            bytes.fromhex(wire["namespace"]),
            tuple(shape),
            wire["payload_nbytes"],
            wire["fsync"],
        )

    def file_path(self, key: bytes) -> str:
        return os.path.join(self.blocks_dir, key.hex() + ".kv")

    def _header(self, key: bytes, crc: int) -> bytes:
        layers, block_size, heads, head_dim, tp, dtype = self._shape
        head = _HEAD.pack(
            MAGIC,
            FORMAT_VERSION,
            HEADER_SIZE,
            0,
            self.namespace,
            key,
            layers,
            block_size,
            heads,
            head_dim,
            tp,
            dtype,
            self.payload_nbytes,
            crc,
        )
        return head + _CRC.pack(zlib.crc32(head))

    def read_header(self, key: bytes) -> tuple:
        """``(modification time in ns, payload checksum)`` of a block file whose header is
        valid (the disk scan); Damaged otherwise (FileNotFoundError passes)."""
        fd, st = _open_block(self.file_path(key))
        try:
            return st.st_mtime_ns, self.check_header(os.pread(fd, HEADER_SIZE, 0), key, st.st_size)
        finally:
            os.close(fd)

    def check_header(self, header: bytes | bytearray, key: bytes, size: int) -> int:
        """The payload checksum of a valid header; raises Damaged with the reason otherwise."""
        if size < HEADER_SIZE or len(header) < HEADER_SIZE:
            raise Damaged("truncated header")
        head = header[: _HEAD.size]
        if _CRC.unpack_from(header, _HEAD.size)[0] != zlib.crc32(head):
            raise Damaged("header checksum")
        (
            magic,
            version,
            header_size,
            _flags,
            namespace,
            file_key,
            layers,
            block_size,
            heads,
            head_dim,
            tp,
            dtype,
            payload,
            crc,
        ) = _HEAD.unpack(head)
        if magic != MAGIC or version != FORMAT_VERSION or header_size != HEADER_SIZE:
            raise Damaged("not a block file of this format")
        if namespace != self.namespace:
            raise Damaged("another namespace")
        dtype = dtype.rstrip(b"\0")
        if (
            file_key != key
            or (layers, block_size, heads, head_dim, tp, dtype) != self._shape
            or payload != self.payload_nbytes
        ):
            raise Damaged("another key or shape")
        if size != HEADER_SIZE + payload:
            raise Damaged("truncated" if size < HEADER_SIZE + payload else "trailing bytes")
        return crc

    def write_block(self, key: bytes, payload) -> None:
        """Write one block file: a temporary name, then renamed into place."""
        crc = xxh3_64_intdigest(payload)
        final = self.file_path(key)
        tmp = f"{final}.tmp-{self.session}"
        fd, _st = open_regular(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            try:
                _write_all(fd, [self._header(key, crc), memoryview(payload).cast("B")])
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            if self.before_rename is not None:
                self.before_rename()
            os.replace(tmp, final)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        if self.fsync:
            dfd = os.open(
                self.blocks_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
            )
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)

    def read_block(self, key: bytes, out) -> None:
        """Read and verify one block into ``out``: a writable buffer of the payload size,
        or a 2-d numpy array whose rows (each contiguous) take the payload in order (a
        block in the pool: one row per layer's K or V). Each piece read is hashed as it
        lands, while it is still in the CPU's cache."""
        fd, st = _open_block(self.file_path(key))
        try:
            size = st.st_size
            header = bytearray(HEADER_SIZE)
            _read_all(fd, [header])
            crc = self.check_header(header, key, size)  # the size is checked there too
            if isinstance(out, np.ndarray) and out.ndim == 2 and not out.flags.c_contiguous:
                views = [memoryview(row) for row in out]
            else:
                views = [out]
            hasher = xxh3_64()
            for offset, group, nbytes in _io_groups(_byte_views(views), HEADER_SIZE):
                if _pread_group(fd, group, offset, nbytes) != nbytes:
                    raise Damaged("truncated")
                for view in group:
                    hasher.update(view)
            if hasher.intdigest() != crc:
                raise Damaged("payload checksum")
        finally:
            os.close(fd)


def _iov_max() -> int:
    try:
        return max(16, os.sysconf("SC_IOV_MAX"))
    except (AttributeError, ValueError, OSError):
        return 1024


# Buffers one preadv / pwritev takes at most (a block read straight into the pool is one
# buffer per layer's K and V: a model of 512 layers or more needs more than Linux's 1024).
IOV_MAX = _iov_max()
# The most bytes one read or write system call moves. A kernel built without full
# preemption (most distributions' default, and this project's test machines) preempts a
# thread inside a system call only where the kernel's code offers to, whatever the
# thread's priority, and one copy of a large page-cache folio offers nowhere: a 2 MiB
# read of a block file held a CPU for 150-200 us, and a loop or client woken meanwhile
# waited for it (``benchmarks/notes.md``, block file I/O). Between two calls the thread is
# back in user space, where a woken task takes the CPU at once. 256 KiB is about 25 us
# of kernel copying; each piece read is hashed while it is in the cache, which more than
# pays for the extra calls.
IO_CHUNK = 256 << 10


def _byte_views(buffers: list) -> list:
    return [memoryview(b).cast("B") for b in buffers]


def _io_groups(views: list, offset: int):
    """(file offset, [views], bytes) per system call: consecutive ``views`` (flat byte
    views) cut and grouped so that each call moves at most ``IO_CHUNK`` bytes in at most
    ``IOV_MAX`` buffers. (A block's rows are whole in a group but for the rare row that
    straddles a limit: no view is made for the common case.)"""
    limit, most = IO_CHUNK, IOV_MAX
    group, size = [], 0
    for view in views:
        n = len(view)
        while n:
            if size + n <= limit:
                group.append(view)
                size += n
                n = 0
            else:
                take = limit - size
                group.append(view[:take])
                size += take
                view = view[take:]
                n -= take
            if size == limit or len(group) == most:
                yield offset, group, size
                offset += size
                group, size = [], 0
    if group:
        yield offset, group, size


def _write_all(fd: int, buffers: list) -> None:
    """Write ``buffers`` from the start of the file, ``IO_CHUNK`` bytes a call at most."""
    for offset, group, size in _io_groups(_byte_views(buffers), 0):
        done = os.pwritev(fd, group, offset)
        while done < size:  # a short write: rare on a regular file, never assumed away
            if done == 0:
                raise OSError(errno.EIO, "write made no progress")
            group, offset, size = _rest(group, done), offset + done, size - done
            done = os.pwritev(fd, group, offset)


def _rest(group: list, done: int) -> list:
    """The views of ``group`` past its first ``done`` bytes."""
    group = list(group)
    while group and done >= len(group[0]):
        done -= len(group.pop(0))
    if group and done:
        group[0] = group[0][done:]
    return group


def _pread_group(fd: int, group: list, offset: int, size: int) -> int:
    """Fill the views of one :func:`_io_groups` group of ``size`` bytes from ``offset``;
    returns the bytes read (short only at end of file)."""
    got = os.preadv(fd, group, offset)
    total = got
    while got and total < size:  # a short read before the end: rare, never assumed away
        got = os.preadv(fd, _rest(group, total), offset + total)
        total += got
    return total


def _read_all(fd: int, buffers: list) -> int:
    """Fill ``buffers`` from the start of the file, ``IO_CHUNK`` bytes a call at most;
    returns the bytes read (short at end of file)."""
    total = 0
    for offset, group, size in _io_groups(_byte_views(buffers), 0):
        got = _pread_group(fd, group, offset, size)
        total += got
        if got < size:
            break
    return total


# -- the copies ------------------------------------------------------------------------------


class RowCopy:
    """``np.copyto(dst, src)`` for the tiers' block copies, with the native row copy
    (``csrc/copy_rows.c``): stores that go past the caches, where the CPU has them.

    Loaded by ``shmkv.kernels.native.copier`` from the library built with the package; the tier
    I/O process loads the same file by its path. A copy of fewer than ``min_bytes`` goes
    to ``np.copyto``: it costs less to call, and bytes that few may as well stay in the
    caches. The trade: a block whose destination already sits in the caches (the same
    buffers copied over and over) copies at about half numpy's speed streamed; tier
    copies sweep far more memory than the caches hold.

    Args:
        path: the built library (``shmkv.kernels.native.library_path("_copy_rows")``).
        isa: how to copy rows of 512 bytes and more, one of :attr:`ISAS` up to the widest
            this CPU runs (for the tests that compare them); by default that widest one.

    Raises:
        OSError: the library cannot be loaded.
        AttributeError: it lacks the copy.
        ValueError: an ``isa`` this CPU cannot run, or not one of :attr:`ISAS`.

    ``path`` and ``isa`` (the way it copies wide rows) stay readable.
    """

    min_bytes = 128 << 10
    # narrowest first: "portable" is memcpy; "sse2" and "avx" stream 16 and 32 bytes a store
    ISAS = ("portable", "sse2", "avx")

    def __init__(self, path: str, isa: Optional[str] = None):
        lib = ctypes.CDLL(path)
        chosen = lib.shmkv_copy_rows_isa
        chosen.argtypes, chosen.restype = [], ctypes.c_char_p
        widest = chosen().decode()
        if isa is not None and (
            isa not in self.ISAS
            or widest not in self.ISAS
            or self.ISAS.index(isa) > self.ISAS.index(widest)
        ):
            raise ValueError(f"this CPU copies rows up to {widest!r}, not {isa!r}")
        fn = getattr(lib, "shmkv_copy_rows" if isa is None else "shmkv_copy_rows_" + isa)
        i64 = ctypes.c_int64
        fn.argtypes = [ctypes.c_void_p, i64, ctypes.c_void_p, i64, i64, i64]
        fn.restype = ctypes.c_int
        self._fn, self.path, self.isa = fn, path, widest if isa is None else isa

    def __call__(self, dst: np.ndarray, src: np.ndarray) -> None:
        """Copy ``src`` into ``dst``: 2-D uint8 of one shape whose rows are each one run
        of bytes; ``dst`` writable and not overlapping ``src``.

        Raises:
            ValueError: arrays of another kind, or ones that may overlap (nothing is
                copied).
        """
        if (
            dst.ndim != 2
            or dst.shape != src.shape
            or dst.dtype != np.uint8
            or src.dtype != np.uint8
            or dst.strides[1] != 1
            or src.strides[1] != 1
            or not dst.flags.writeable
        ):
            raise ValueError(
                f"a row copy takes two 2-D uint8 arrays of one shape with rows of "
                f"adjacent bytes, got {dst.dtype}{list(dst.shape)} strides {dst.strides} "
                f"from {src.dtype}{list(src.shape)} strides {src.strides}"
            )
        if np.may_share_memory(dst, src):  # (bounds only: cheap)
            raise ValueError("a row copy's source and destination overlap")
        rows, width = dst.shape
        if rows * width < self.min_bytes:
            np.copyto(dst, src)
        else:
            self._fn(dst.ctypes.data, dst.strides[0], src.ctypes.data, src.strides[0], rows, width)


class Mover:
    """Runs copies between the pool, the host tier and the block files.

    Args:
        block_nbytes: bytes of one block, every rank's.
        pool_np: numpy uint8 ``[num_blocks, 2 * num_layers, chunk bytes]`` per rank (a CPU
            pool; ``shmkv.memory.pool.block_bytes``), or None.
        pool_u8: the same as torch tensors (a CUDA pool), or None.
        host_np: numpy ``[slots, block_nbytes]`` of the host tier, or None.
        host_t: the same as a torch tensor (needed with ``pool_u8``), or None.
        files: the disk tier's :class:`BlockFiles`, or None.
        gens: numpy uint32 ``[num_blocks]`` cancel generations, or None.
        pinned: stage through page-locked memory (a CUDA pool).
        staging_np: numpy ``[slots, block_nbytes]`` of the staging slots (blocks on their
            way to disk), or None.
        staging_t: the same as a torch tensor (needed with ``pool_u8``), or None.
        copy: copies a block between ``pool_np`` and flat memory (``np.copyto``, or
            a :class:`RowCopy`).

    ``check``, when set, is called before each copy (the I/O process exits there if
    the coordinator is gone).
    """

    check: Optional[Callable[[], None]] = None

    def __init__(
        self,
        block_nbytes: int,
        pool_np=None,
        pool_u8=None,
        host_np=None,
        host_t=None,
        files: Optional[BlockFiles] = None,
        gens=None,
        pinned: bool = False,
        staging_np=None,
        staging_t=None,
        copy: Callable[[np.ndarray, np.ndarray], Any] = np.copyto,
    ):
        self.block_nbytes = block_nbytes
        self.copy = copy
        self.pool_np, self.pool_u8 = pool_np, pool_u8
        self.host_np, self.host_t = host_np, host_t
        self.staging_np, self.staging_t = staging_np, staging_t
        self.files = files
        self.gens = gens
        self.pinned = pinned
        self._local = threading.local()

    def run(self, copies: Iterable[Copy], stopping: Callable[[], bool]) -> None:
        """Run ``copies`` in order, recording each one's outcome on it."""
        for copy in copies:
            if stopping():
                copy.error = "coordinator stopping"
                continue
            if self.check is not None:
                self.check()
            try:
                getattr(self, "_op_" + copy.op)(copy)
                copy.ok = True
            except Cancelled:
                pass
            except Damaged as exc:
                copy.damaged, copy.error = True, str(exc)
            except FileNotFoundError as exc:
                copy.damaged = copy.op == "d2p"
                copy.error = f"{exc.strerror}: {exc.filename}"
            except OSError as exc:
                copy.enospc = exc.errno in (errno.ENOSPC, errno.EDQUOT)
                copy.error = f"{exc.strerror or exc}"
            except Exception as exc:  # a bug must not kill the worker
                copy.error = f"{type(exc).__name__}: {exc}"

    def _cancelled(self, copy: Copy) -> bool:
        gens = self.gens
        return copy.cancelled or (gens is not None and int(gens[copy.block]) != copy.gen)

    def _staging(self) -> Tuple[Any, Any]:
        """This thread's buffer of one block (pinned under a CUDA pool): (tensor, numpy)."""
        buf = getattr(self._local, "buf", None)
        if buf is None:
            if self.pinned:
                import torch

                tensor = torch.empty(self.block_nbytes, dtype=torch.uint8, pin_memory=True)
                buf = (tensor, tensor.numpy())
            else:
                buf = (None, np.empty(self.block_nbytes, dtype=np.uint8))
            self._local.buf = buf
        return buf

    # Copies of a CPU pool go through numpy (a plain memcpy: several times faster than a
    # torch copy_ of one block, whose dispatch and threading cost dominate).

    def _pool_to(self, block: int, dst, dst_np) -> None:
        pool_to_flat(self.pool_np, self.pool_u8, block, dst, dst_np, self.copy)

    def _to_pool(self, src, src_np, block: int) -> None:
        flat_to_pool(src, src_np, self.pool_np, self.pool_u8, block, self.copy)

    def _files(self) -> BlockFiles:
        """The block files (the loop schedules a copy to or from disk only with a disk
        tier)."""
        files = self.files
        assert files is not None, "a copy to or from disk without a disk tier"
        return files

    def _host(self, slot: int) -> Tuple[Any, Any]:
        return (None if self.host_t is None else self.host_t[slot]), self.host_np[slot]

    def _op_p2h(self, copy: Copy) -> None:
        if self._cancelled(copy):  # evicted while queued: skip the work
            raise Cancelled
        self._pool_to(copy.block, *self._host(copy.slot))
        if self._cancelled(copy):  # read after the copy: see the module doc
            raise Cancelled

    def _op_p2s(self, copy: Copy) -> None:
        if self._cancelled(copy):
            raise Cancelled
        self._pool_to(
            copy.block,
            None if self.staging_t is None else self.staging_t[copy.slot],
            self.staging_np[copy.slot],
        )
        if self._cancelled(copy):
            raise Cancelled

    def _op_s2d(self, copy: Copy) -> None:
        self._files().write_block(copy.key, self.staging_np[copy.slot])

    def _op_h2p(self, copy: Copy) -> None:
        self._to_pool(*self._host(copy.slot), copy.block)

    def _op_h2d(self, copy: Copy) -> None:
        self._files().write_block(copy.key, self.host_np[copy.slot])

    def _op_p2d(self, copy: Copy) -> None:
        if self._cancelled(copy):
            raise Cancelled
        buf, buf_np = self._staging()
        self._pool_to(copy.block, buf, buf_np)
        if self._cancelled(copy):
            raise Cancelled
        self._files().write_block(copy.key, buf_np)

    def _op_d2p(self, copy: Copy) -> None:
        if self.pool_np is not None and len(self.pool_np) == 1:
            self._files().read_block(copy.key, self.pool_np[0][copy.block])  # straight in
        else:
            buf, buf_np = self._staging()
            self._files().read_block(copy.key, buf_np)
            self._to_pool(buf, buf_np, copy.block)

    def _op_del(self, copy: Copy) -> None:
        try:
            os.unlink(self._files().file_path(copy.key))
        except FileNotFoundError:
            pass

    def _op_none(self, copy: Copy) -> None:
        raise Cancelled


# -- a client's own promotions ----------------------------------------------------------------


class ClientCopies:
    """A client's side of copying its own promotions in (``shmkv.tiers``: promotion by
    the client): the copies its allocation's answer names, run in this process.

    Args:
        pool_np: numpy uint8 ``[num_blocks, 2 * num_layers, chunk bytes]`` per rank, the
            client's own mapping of the pool (``shmkv.memory.pool.block_bytes``).
        descriptor: the ``tier_memory`` answer (``TierSet.client_memory``): block bytes,
            the host tier's ``[slots, slot bytes]`` or None, the block files (the
            :meth:`BlockFiles.files_wire` form) or None, and their folder's device and
            inode.
        fds: the host tier's read-only descriptor, if it has one; closed here (the
            mapping stays).
        copy: copies a block between the pool and flat memory (``np.copyto``, or a
            :class:`RowCopy`).

    Raises:
        ValueError: the descriptor does not fit the pool or the descriptors passed, or
            the block files' folder is another one here.
        OSError: the block files' folder cannot be seen here.
    """

    def __init__(
        self,
        pool_np: list,
        descriptor: dict,
        fds: List[int],
        copy: Callable[[np.ndarray, np.ndarray], Any] = np.copyto,
    ):
        try:
            host = None
            shape = descriptor.get("host")
            if shape is not None:
                if len(fds) != 1:
                    raise ValueError(f"the host tier came with {len(fds)} descriptors, not 1")
                slots, nbytes = int(shape[0]), int(shape[1])
                m = mmap.mmap(fds[0], slots * nbytes, mmap.MAP_SHARED, mmap.PROT_READ)
                host = np.frombuffer(m, dtype=np.uint8).reshape(slots, nbytes)
            elif fds:
                raise ValueError(f"{len(fds)} descriptors came without a host tier")
            files = descriptor.get("files")
            if files is not None:  # the coordinator's folder, not another at its path
                st = os.stat(files["blocks_dir"])
                if [st.st_dev, st.st_ino] != descriptor.get("files_id"):
                    raise ValueError(
                        f"the disk tier's folder {files['blocks_dir']} is another one in "
                        "this process (a mount namespace of its own?)"
                    )
            self.mover = Mover(
                int(descriptor["block_nbytes"]),
                pool_np=pool_np,
                host_np=host,
                files=None if files is None else BlockFiles.from_wire(files),
                copy=copy,
            )
        finally:
            for fd in fds:
                os.close(fd)
        self.num_blocks = len(pool_np[0])
        self.num_slots = 0 if host is None else len(host)

    def run(
        self, wire: dict, stopping: Callable[[], bool] = lambda: False
    ) -> Tuple[bytes, Dict[int, str]]:
        """Run the copies of one promotion (``TierSet.client_copies``), in order:
        (one status a copy, the error text of each that failed). A copy whose block or
        slot is out of range fails; the others still run. Once ``stopping()`` (the
        client closes), the copies not begun fail."""
        ops, keys = wire["ops"], wire["keys"]
        blocks, slots = wire["blocks"], wire["slots"]
        n = len(ops)
        if len(keys) != 16 * n or len(blocks) != 8 * n or len(slots) != 8 * n:
            raise ValueError("a promotion's copies do not have one of each field a copy")
        blocks = np.frombuffer(blocks, dtype="<i8").tolist()
        slots = np.frombuffer(slots, dtype="<i8").tolist()
        copies = []
        for i, op in enumerate(ops):
            copy = Copy(OPS[op] if op < len(OPS) else "none", keys[16 * i : 16 * i + 16])
            copy.block, copy.slot = blocks[i], slots[i]
            if copy.op not in ("h2p", "d2p"):
                copy.cancelled = True  # (a block no tier had: nothing to copy)
            elif not 0 <= copy.block < self.num_blocks or (
                copy.op == "h2p" and not 0 <= copy.slot < self.num_slots
            ):
                copy.op, copy.error = "none", f"block {copy.block} or slot {copy.slot} out of range"
            copies.append(copy)
        self.mover.run(copies, stopping)
        statuses = bytes(status_of(c) for c in copies)
        errors = {i: c.error for i, c in enumerate(copies) if c.error is not None}
        return statuses, errors


# -- the worker threads ------------------------------------------------------------------------


class Copier:
    """Worker threads that run jobs with a :class:`Mover`: ``num_workers`` for promotions
    (first) and demotions to the host tier, one more for the disk queue (whose copies
    run one at a time, in order).

    Workers take copies, not jobs, one at a time: a worker the scheduler starves holds
    up one block. With ``urgent_after``, ``num_workers`` more threads at their creator's
    priority take copies from a queue on which no lowest-priority worker took one for
    that many seconds (other work keeps the CPUs busy): a request may be waiting for a
    promotion, and a demotion not done when its block is evicted is lost.

    Args:
        mover: the :class:`Mover`.
        on_done: called from a worker with each finished :class:`Job`.
        num_workers: threads for the promotion and demotion queues.
        disk: whether to start the disk queue's thread.
        nice: how much nicer than their creator the threads run (Linux: per thread).
        policy: if set, the threads run at :func:`lower_priority` ``(policy)`` instead.
        urgent_after: seconds without progress before the urgent threads step in.
    """

    def __init__(
        self,
        mover: Mover,
        on_done: Callable[[Job], None],
        num_workers: int = 2,
        disk: bool = False,
        nice: int = 0,
        policy: Optional[str] = None,
        urgent_after: Optional[float] = None,
    ):
        self.mover = mover
        self._on_done = on_done
        self._nice = nice
        self._policy = policy
        self._urgent_after = urgent_after
        self._cv = threading.Condition()
        self._queues: Tuple[Deque[Job], Deque[Job], Deque[Job]] = (deque(), deque(), deque())
        self._progress = [0.0, 0.0, 0.0]  # per queue: when a worker last took a copy
        self._disk_busy = False
        self._stopping = False
        self._threads: List[threading.Thread] = []
        self.num_urgent = 0  # copies the urgent threads took
        try:
            for i in range(num_workers):
                self._start(self._worker, ((PROMOTE, DEMOTE),), f"shmkv-tier-io-{i}")
            if disk:
                self._start(self._worker, ((DISK,),), "shmkv-tier-disk")
            if urgent_after is not None:
                for i in range(num_workers):
                    self._start(self._urgent_worker, (), f"shmkv-tier-urgent-{i}")
        except BaseException:
            self.close()
            raise

    def _start(self, target, args: tuple, name: str) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def submit(self, queue: int, job: Job) -> None:
        """Queue a job (``PROMOTE``, ``DEMOTE`` or ``DISK``)."""
        if not job.copies:
            self._on_done(job)
            return
        with self._cv:
            job.queued_at = time.monotonic()
            job.num_taken, job.num_left = 0, len(job.copies)
            self._queues[queue].append(job)
            self._cv.notify_all()

    def stopping(self) -> bool:
        return self._stopping

    def _ready(self, queue: int) -> bool:
        return bool(self._queues[queue]) and not (queue == DISK and self._disk_busy)

    def _take(self, queue: int) -> Tuple[Job, Copy, int]:
        """The next copy of the queue's first job (under the lock)."""
        jobs = self._queues[queue]
        job = jobs[0]
        copies = job.copies
        assert copies is not None  # (submit() queues only jobs with copies)
        copy = copies[job.num_taken]
        job.num_taken += 1
        if job.num_taken == len(copies):
            jobs.popleft()
        if queue == DISK:
            self._disk_busy = True
        return job, copy, queue

    def _run_one(self, job: Job, copy: Copy, queue: int) -> None:
        self.mover.run((copy,), self.stopping)
        with self._cv:
            if queue == DISK:
                self._disk_busy = False
                self._cv.notify_all()
            job.num_left -= 1
            done = job.num_left == 0
        if done:
            self._on_done(job)

    def _worker(self, queues: tuple) -> None:
        if self._policy is not None:
            lower_priority(self._policy)
        elif self._nice:  # copies and checksums yield the CPU to the loop and the clients
            try:
                tid = threading.get_native_id()
                os.setpriority(
                    os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + self._nice)
                )
            except (AttributeError, OSError):
                pass
        while True:
            with self._cv:
                while not self._stopping:
                    queue = next((q for q in queues if self._ready(q)), None)
                    if queue is not None:
                        break
                    self._cv.wait(1.0)  # re-checks even if a notify were lost
                if self._stopping:
                    return
                assert queue is not None  # (the wait ends on a queue or on stopping)
                self._progress[queue] = time.monotonic()
                taken = self._take(queue)
            self._run_one(*taken)

    def _starved(self, now: float) -> Tuple[Optional[int], float]:
        """(a queue with work that no worker took from for ``urgent_after`` seconds, or
        None; seconds until one might be)."""
        after, wait = self._urgent_after, 1.0
        assert after is not None  # (only the urgent threads ask)
        for queue in (PROMOTE, DEMOTE, DISK):
            if self._ready(queue):
                since = max(self._progress[queue], self._queues[queue][0].queued_at)
                left = since + after - now
                if left <= 0:
                    return queue, 0.0
                wait = min(wait, left)
        return None, wait

    def _urgent_worker(self) -> None:
        while True:
            with self._cv:
                while not self._stopping:
                    queue, wait = self._starved(time.monotonic())
                    if queue is not None:
                        break
                    self._cv.wait(wait)
                if self._stopping:
                    return
                assert queue is not None  # (the wait ends on a queue or on stopping)
                self.num_urgent += 1
                taken = self._take(queue)
            self._run_one(*taken)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the threads (a copy under way finishes; queued jobs are abandoned).
        Idempotent."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout)
        self._threads = []


# -- the wire between the loop and the I/O process ---------------------------------------------


# Number of copies -> the Struct of a job frame with that many.
_JOB_FRAMES: Dict[int, struct.Struct] = {}
# Frames of at most this many copies keep their Struct (about 160 bytes a copy; 1.3 MB for
# every size up to it); a larger job, rare and long, makes its own.
_JOB_FRAMES_MAX = 128


def encode_columns(
    job_id: int, queue: int, ops: list, blocks: list, slots: list, gens: list, keys: list
) -> bytes:
    """A job frame (loop side) from its copies' columns: op codes (indexes in ``OPS``),
    pool blocks, host slots, cancel generations, keys. One pack of the whole frame: a
    promotion's job is built without an object or a call per block."""
    n = len(ops)
    frame = _JOB_FRAMES.get(n)
    if frame is None:
        frame = struct.Struct("<I" + _JOB.format.lstrip("<") + _JOB_COPY.format.lstrip("<") * n)
        if n <= _JOB_FRAMES_MAX:
            _JOB_FRAMES[n] = frame
    return frame.pack(
        frame.size - _FRAME.size,
        b"J",
        job_id,
        queue,
        n,
        *chain.from_iterable(zip(ops, blocks, slots, gens, keys)),
    )


def encode_job(queue: int, job: Job) -> bytes:
    """A job frame (loop side) of a job of copies."""
    copies = job.copies
    assert copies is not None, "a promotion's job is encoded from its columns"
    return encode_columns(
        job.job_id,
        queue,
        [_OP_CODE[c.op] for c in copies],
        [c.block for c in copies],
        [c.slot for c in copies],
        [c.gen for c in copies],
        [c.key for c in copies],
    )


def decode_job(body: bytes) -> tuple:
    """(queue, Job) of a job frame's body (I/O process side)."""
    kind, job_id, queue, n = _JOB.unpack_from(body, 0)
    if kind != b"J" or queue > DISK or len(body) != _JOB.size + n * _JOB_COPY.size:
        raise ValueError("not a job frame")
    copies = []
    for op, block, slot, gen, key in _JOB_COPY.iter_unpack(body[_JOB.size :]):
        copies.append(Copy(OPS[op], key, block=block, slot=slot, gen=gen))
    return queue, Job(copies, job_id=job_id, queue=queue)


def status_of(copy: Copy) -> int:
    """A copy's outcome as its status code (``OK``, ``CANCELLED``, ``DAMAGED``, ...)."""
    if copy.ok:
        return OK
    if copy.damaged:
        return DAMAGED
    if copy.enospc:
        return ENOSPC
    return FAILED if copy.error is not None else CANCELLED


def encode_done(job: Job) -> bytes:
    """A completion frame (I/O process side)."""
    copies = job.copies
    assert copies is not None  # (the I/O process decodes every job into copies)
    statuses = bytes(status_of(c) for c in copies)
    parts = [_DONE.pack(b"D", job.job_id, len(statuses)), statuses]
    for c, status in zip(copies, statuses):
        if status not in (OK, CANCELLED):
            text = (c.error or "")[:1000].encode("utf-8", "replace")
            parts += [_MSG.pack(len(text)), text]
    body = b"".join(parts)
    return _FRAME.pack(len(body)) + body


def apply_done(body: bytes, jobs: dict) -> Job:
    """Record a completion frame's outcomes on its job (loop side): on its copies, or as
    ``statuses`` and ``errors`` for a job sent as columns; returns the job, taken out of
    ``jobs`` (job id -> Job). Raises ValueError on a bad frame."""
    kind, job_id, n = _DONE.unpack_from(body, 0)
    job = jobs.pop(job_id, None)
    if kind != b"D" or job is None or n != job.num_copies or len(body) < _DONE.size + n:
        raise ValueError("not a completion of a job in flight")
    at = _DONE.size + n
    statuses = body[_DONE.size : at]
    errors = {}
    if statuses.count(OK) != n:  # (the common case has nothing more to read)
        for i, status in enumerate(statuses):
            if status not in (OK, CANCELLED):
                (length,) = _MSG.unpack_from(body, at)
                errors[i] = body[at + 2 : at + 2 + length].decode("utf-8", "replace")
                at += 2 + length
    if job.copies is None:
        job.statuses, job.errors = statuses, errors
        return job
    for i, (copy, status) in enumerate(zip(job.copies, statuses)):
        if status == OK:
            copy.ok = True
        elif status != CANCELLED:
            copy.error = errors[i]
            copy.damaged = status == DAMAGED
            copy.enospc = status == ENOSPC
    return job


def encode_ready() -> bytes:
    """The frame the I/O process sends once, before any completion: it has mapped the
    pool and takes jobs."""
    return _FRAME.pack(1) + b"R"


def split_frames(buf: bytearray) -> list:
    """Take the complete frames' bodies off the front of ``buf``."""
    out, at = [], 0
    while len(buf) - at >= 4:
        (length,) = _FRAME.unpack_from(buf, at)
        if len(buf) - at - 4 < length:
            break
        out.append(bytes(buf[at + 4 : at + 4 + length]))
        at += 4 + length
    del buf[:at]
    return out


# -- the I/O process -----------------------------------------------------------------------------


def _map(fd: int, nbytes: int, rows: int):
    """numpy uint8 ``[rows, nbytes // rows]`` over a shared segment, pages mapped up front."""
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    m = mmap.mmap(fd, nbytes, flags, mmap.PROT_READ | mmap.PROT_WRITE)
    return np.frombuffer(m, dtype=np.uint8).reshape(rows, nbytes // rows)


def pool_to_flat(pool_np, pool_u8, block: int, dst, dst_np, copy=np.copyto) -> None:
    """Copy block ``block`` of every rank's pool (``pool_np``: numpy ``[num_blocks, 2 *
    num_layers, chunk bytes]`` per rank, a CPU pool, copied with ``copy``; else
    ``pool_u8``, the same as torch tensors) into the flat buffer ``dst_np`` (numpy) /
    ``dst`` (torch, for ``pool_u8``): rank after rank, each rank's chunks in order."""
    offset = 0
    if pool_np is not None:
        for rank in pool_np:
            rows = rank[block]  # [2 * num_layers, chunk bytes]: the block's chunks
            n = rows.size
            copy(_flat_rows(dst_np, offset, rows.shape), rows)
            offset += n
        return
    for rank in pool_u8:
        rows = rank[block]
        n = rows.numel()
        dst[offset : offset + n].view(rows.shape).copy_(rows)
        offset += n


def _flat_rows(flat: np.ndarray, offset: int, shape: tuple) -> np.ndarray:
    """``flat[offset:]`` as ``shape``; ValueError where ``flat`` is too short (a slice
    past the end is shorter, and a row copy trusts its shapes)."""
    n = shape[0] * shape[1]
    if offset + n > flat.shape[0]:
        raise ValueError(f"{flat.shape[0]} bytes hold no block of {n} at offset {offset}")
    return flat[offset : offset + n].reshape(shape)


def flat_to_pool(src, src_np, pool_np, pool_u8, block: int, copy=np.copyto) -> None:
    """The inverse of :func:`pool_to_flat`: the flat ``src_np`` / ``src`` into block
    ``block`` of every rank's pool."""
    offset = 0
    if pool_np is not None:
        for rank in pool_np:
            rows = rank[block]
            n = rows.size
            copy(rows, _flat_rows(src_np, offset, rows.shape))
            offset += n
        return
    import torch

    for rank in pool_u8:
        rows = rank[block]
        n = rows.numel()
        rows.copy_(src[offset : offset + n].view(rows.shape))
        offset += n
        # Into strided rows, copy_ lands in a device buffer first and returns before
        # the last step on the device is done: the block counts as in only after it.
        torch.cuda.synchronize(rows.device)


def _map_pool(fd: int, num_blocks: int, block_nbytes: int, chunks: int):
    """The pool segment (stored layer-major: ``chunks`` rows of every block's chunk) as
    numpy uint8 ``[num_blocks, chunks, chunk bytes]``, like ``shmkv.memory.pool.block_bytes``."""
    rows = _map(fd, num_blocks * block_nbytes, chunks)
    return rows.reshape(chunks, num_blocks, block_nbytes // chunks).transpose(1, 0, 2)


class _Process:
    """The I/O process's side: jobs in from the socket, completions out."""

    def __init__(self, spec: dict):
        self.parent = spec["parent"]
        self.sock = socket.socket(fileno=spec["sock"])
        self.wake = socket.socket(fileno=spec["wake"])
        self._send_lock = threading.Lock()
        files = None
        if spec.get("files") is not None:
            files = BlockFiles.from_wire(spec["files"])
            files.before_rename = self.exit_if_orphaned
        fd, num_blocks, nbytes, chunks = spec["pool"]
        pool = _map_pool(fd, num_blocks, nbytes, chunks)
        host = staging = None
        if spec.get("host") is not None:
            fd, slots, nbytes = spec["host"]
            host = _map(fd, slots * nbytes, slots)
        if spec.get("staging") is not None:
            fd, slots, nbytes = spec["staging"]
            staging = _map(fd, slots * nbytes, slots)
        fd, num_blocks = spec["gens"]
        gens = _map(fd, 4 * num_blocks, 1).view(np.uint32).reshape(num_blocks)
        for fd in [spec["pool"][0], spec["gens"][0]] + [
            spec[name][0] for name in ("host", "staging") if spec.get(name) is not None
        ]:
            os.close(fd)  # the mappings stay
        copy: Callable[[np.ndarray, np.ndarray], Any] = np.copyto
        if spec.get("copy_lib") is not None:  # the native row copy the coordinator loaded
            try:
                copy = RowCopy(spec["copy_lib"])
            except (OSError, AttributeError) as exc:
                print(f"shmkv tier I/O: copying with numpy: {exc}", file=sys.stderr)
        self.mover = Mover(
            spec["block_nbytes"],
            pool_np=[pool],
            host_np=host,
            files=files,
            gens=gens,
            staging_np=staging,
            copy=copy,
        )
        self.mover.check = self.exit_if_orphaned
        # This thread (reading jobs) keeps the priority the process started with, and so
        # do the urgent workers; the others run at the lowest.
        self.copier = Copier(
            self.mover,
            self.send_done,
            spec["workers"],
            disk=files is not None,
            policy=spec["policy"],
            urgent_after=URGENT_AFTER_S,
        )

    def exit_if_orphaned(self) -> None:
        if os.getppid() != self.parent:  # the coordinator died: do nothing more
            os._exit(0)

    def send_done(self, job: Job) -> None:
        data = memoryview(encode_done(job))
        with self._send_lock:
            while data:
                try:
                    data = data[self.sock.send(data) :]
                except socket.timeout:
                    self.exit_if_orphaned()
                except OSError:  # the coordinator closed its end: it is stopping
                    return
        try:
            self.wake.send(b"t", socket.MSG_DONTWAIT)
        except OSError:  # full (the loop is awake anyway) or closed (it is stopping)
            pass

    def serve(self) -> None:
        self.sock.settimeout(PARENT_CHECK_S)
        buf = bytearray()
        while True:
            try:
                data = self.sock.recv(1 << 16)
            except socket.timeout:
                self.exit_if_orphaned()
                continue
            except OSError:
                data = b""
            if not data:  # the coordinator closed its end, or died
                self.exit_if_orphaned()
                self.copier.close(timeout=10.0)
                return
            buf += data
            for body in split_frames(buf):
                queue, job = decode_job(body)
                self.copier.submit(queue, job)


def lower_priority(policy: str) -> None:
    """Give the calling thread the I/O process's lowest priority (Linux: per thread):
    nice ``IO_PROCESS_NICE``, and SCHED_IDLE if ``policy`` is "idle" (where supported)."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, IO_PROCESS_NICE)
    except (AttributeError, OSError):
        pass
    if policy == "idle":
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except (AttributeError, OSError):
            pass


def batch_priority() -> None:
    """SCHED_BATCH for the calling thread and the threads it starts later (Linux): the
    process's own wake-ups (a job arrives, an urgent worker looks at its queues) then
    never preempt the loop or a client, which still preempt it as before; it keeps its
    fair share of the CPUs."""
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except (AttributeError, OSError):
        pass


def main(argv: List[str]) -> int:
    """The tier I/O process (``python block_io.py SPEC``, started by ``shmkv.tiers``)."""
    spec = json.loads(argv[1])
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if os.getppid() != spec["parent"]:
        return 0
    sys.setswitchinterval(IO_SWITCH_INTERVAL_S)
    batch_priority()
    if spec.get("preload"):  # fault injection in tests: "path.py:function"
        import runpy

        path, func = spec["preload"].rsplit(":", 1)
        runpy.run_path(path)[func](sys.modules[__name__])
    process = _Process(spec)
    try:
        process.sock.sendall(encode_ready())
    except OSError:  # the coordinator gave up on it already
        return 0
    process.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
