"""Tiers under the pool: host shared memory and a local disk directory.

Owns the lower tiers of the cache (:class:`HostTier`, :class:`DiskTier`), their
indexes, and which copies run when (:class:`TierSet`). The copies themselves, the
on-disk block format and the tier I/O process are ``shmkv.tier_io``. Does not decide
which pool block is free, cached or referenced (``shmkv.allocator``), which sequence
a block belongs to (``shmkv.sequences``), nor answer requests (``shmkv.coordinator``:
its loop calls :meth:`TierSet.tick` and answers the promotions that come back
finished).

Every index (which key a tier holds, where, LRU order, pins, byte counts) is read
and written by the coordinator's loop thread only. Copies run off the loop -- under a
CPU pool in the tier I/O process, a low-priority child of the coordinator; under a
CUDA pool in worker threads (``shmkv.tier_io`` says why) -- and report back; the loop
never waits for them.

* Demotion is write-behind. A published block that becomes cached in the pool is
  copied to the host tier (without one, or with every host slot busy, to disk) while
  it stays valid in the pool: published blocks are immutable, so the copy races
  nothing. A host copy is then written to disk behind it, so the disk holds a superset
  of the host tier, which is what survives a restart. Every block that becomes cached
  reaches a tier unless the tier is full or failing: what one turn caches past the
  free host slots or the disk writes in flight (``MAX_DISK_WRITES_IN_FLIGHT``) waits in
  a backlog, a prefix's first blocks first (a sequence's blocks are cached last-first,
  and are placed in reverse), and is placed as copies finish. The pool evicts blocks
  already safe in a tier first (``BlockPool.copying``: the blocks copying or waiting).
  When it must evict one whose copy is not done, the copy is cancelled and the loop
  copies the block at once, a memcpy (it is still the key's until the allocation is
  answered), into a host slot, or a staging slot written to disk from there
  (``rescued_evictions``); only when neither has room is it counted in
  ``lost_evictions``. Each tier is LRU: the host tier's oldest blocks make room (with a
  disk tier taking writes, only those already on disk; otherwise counted ``dropped``),
  the disk's oldest are deleted (``dropped``).
* Memory ordering: a copy's own cancel check is lock-free and sound only on x86; the
  loop keeps a copy out of the pool only if its block still held the key when the
  completion came back, and off x86 writes no block file straight from the pool
  (``DIRECT_DISK_DEMOTION``; ``shmkv.tier_io`` says why).
* Promotion: an allocation whose prompt continues, past the pool's longest hit, in a
  tier gets fresh pool blocks for those keys, all or nothing with the rest of the
  request (``shmkv.sequences``). Workers copy the bytes in; the loop then publishes
  the blocks under their keys and the coordinator answers the request. A block that
  cannot be read back (a damaged file) ends the hit at the blocks before it.
* Promotion by the client (a CPU pool): a client that asks (``allocate_many``'s
  ``copy``) gets its promotion's copies in the answer and runs them itself
  (``shmkv.tier_io.ClientCopies``: the host tier mapped read-only, the block files read
  and checked as the I/O process does), then reports one status a block (``promoted``);
  the loop finishes the promotion as it would a worker's. The copies then cost the
  client that needs them, not the other clients: measured on 2 cores, ping p99 while
  another client promoted at full speed went from 2.1-2.4x idle to 1.6-2.0x, the
  no-tier control's level (``docs/benchmarks.md``). The sources stay pinned and the
  blocks held until the report, or until the client's connection drops (every copy
  then counts as failed).
* The bytes: under a CPU pool, whoever copies (a client, the I/O process, the
  coordinator's threads) moves a block between the pool and host memory with the
  native row copy, whose stores go past the caches (``shmkv.native.copier``,
  ``shmkv.tier_io.RowCopy``), else with ``np.copyto``; the I/O process loads the
  library the coordinator loaded, by its path in the package (``TierSet._row_copy``).
* Cancellation without a lock: a worker copies a pool block first and reads the
  copy's cancel state after (the copy's ``cancelled`` flag in threads; the block's
  generation in shared memory for the I/O process, see ``shmkv.tier_io``). The loop
  sets it when it evicts the block, before it can answer anyone who would then write
  that block, so a copy that saw no cancel was taken from unchanged bytes.

Trust: a disk tier directory is trusted as far as its owner is (see :class:`DiskTier`):
it must be owned by the coordinator's user and not writable by group or others, and
every file in it is opened without following links and used only if regular.

Disk layout (one namespace per directory)::

    DIR/lock        flock()ed by the coordinator that uses DIR (its pid inside)
    DIR/namespace   JSON: format version, block layout fingerprint, salt digest, block
                    bytes (not the pool's size: a resized pool uses the same blocks)
    DIR/blocks/<32 hex digits of the prefix key>.kv          one complete block
    DIR/blocks/<32 hex>.kv.tmp-<session>                     a block being written

A block file is a 100-byte little-endian header -- magic ``SHMKVBLK``, format
version u16, header size u16, flags u32, namespace digest (16 bytes), prefix key
(16 bytes), num_layers, block_size, num_kv_heads, head_dim, tp_size (u32 each),
dtype name (12 bytes, NUL padded), payload bytes u64, payload xxh3-64 u64, and the
crc32 of the 96 bytes before it -- followed by the payload: the block's bytes of
every rank's pool, rank after rank, each ``[num_layers, 2, block_size, heads,
head_dim]`` as in the pool. A file is written under a temporary name and renamed
into place, so a name ending in ``.kv`` is complete unless the machine itself
crashed before the data reached the disk; then its checksum fails when it is read,
and it is removed and counted. ``DiskTier(fsync=True)`` fsyncs every file before
the rename (slower; only a machine crash needs it, never a killed process).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import math
import mmap
import os
import re
import secrets
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
import weakref
from collections import OrderedDict, deque
from typing import TYPE_CHECKING, Any, Callable, Deque, Dict, List, Optional, Set, Tuple

import numpy as np

from . import shm, tier_io
from .errors import InvalidArgument, ShmkvError, WrongType
from .memory import block_bytes
from .protocol import pack_i64s
from .tier_io import (
    DAMAGED,
    DEMOTE,
    DISK,
    FORMAT_VERSION,
    HEADER_SIZE,
    OK,
    OP_D2P,
    OP_H2P,
    OP_NONE,
    PROMOTE,
    WORKER_NICE,
    BlockFiles,
    Copier,
    Copy as _Copy,
    Damaged as _Damaged,
    Job as _Job,
    Mover,
    NotRegular,
    open_regular,
    pool_to_flat,
)

if TYPE_CHECKING:
    import torch

log = logging.getLogger("shmkv.tiers")

NAMESPACE_FORMAT = "shmkv-disk-tier"
_FILE_RE = re.compile(r"^([0-9a-f]{32})\.kv$")
_TMP_RE = re.compile(r"^[0-9a-f]{32}\.kv\.tmp-([0-9a-f]+)$")
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?)\s*([kmgtp]?)(i?b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}

MAX_DISK_WRITES_IN_FLIGHT = 256  # blocks queued to the disk writer at once
DEMOTION_CHUNK = 64
# Blocks placed down the tiers between two looks at the loop's sockets (TierSet.tick).
PLACE_CHUNK = 8
# Host entries one search for a slot looks at, oldest first, for one already on disk
# (with a disk tier): the search stays short when the disk is slow to take spills.
HOST_SCAN = 512
# Staging slots of host memory under a disk tier: a block the pool evicts before its copy
# down a tier is done is copied here by the loop at once (and written to disk from
# here); off x86 every block goes to disk through one (``tier_io``: memory ordering).
STAGING_BLOCKS = 64
STAGING_RESCUE = 16  # of them kept for rescues (the others carry the writes off x86)
# Blocks are written to disk straight from the pool (``p2d``) only where the CPU keeps
# loads in order; elsewhere through a staging slot the loop has checked (``tier_io``).
DIRECT_DISK_DEMOTION = tier_io.STRONG_ORDER
SCAN_CHUNK = 2048  # keys merged into the disk index per loop turn
DISK_FULL_BACKOFF_S = 1.0  # after ENOSPC, demotion to disk pauses this long
# Where a CPU pool's copies run: True, the tier I/O process (``shmkv.tier_io``); False,
# worker threads of the coordinator, as a CUDA pool's always do.
IO_PROCESS = True
# For tests: "path.py:function", run by the tier I/O process before it serves, with
# the ``tier_io`` module as argument (to inject faults there). None in production.
IO_PROCESS_PRELOAD: Optional[str] = None
IO_PROCESS_EXIT_S = 15.0  # close() waits this long for the I/O process, then kills
# The coordinator opens once its I/O process has mapped the pool and serves (or after this
# long, with copies in threads): copies queued to a process still starting would wait,
# and the blocks the pool evicts meanwhile would be lost.
IO_PROCESS_START_S = 60.0
# While the I/O process has jobs, the loop polls it at least this often, woken or not: a
# process that died wakes nobody, and the requests waiting for its promotions would wait
# for ever.
IO_PROCESS_CHECK_S = 0.25
_POLL_RECV = 1 << 16  # bytes a recv of the I/O process's completions asks for
# While worker threads of a TierSet run in the coordinator (CUDA pools), the process's
# GIL switch interval is at most this (restored when the last TierSet closes). Workers
# release the GIL in every read, write, copy and checksum and take it back at once; at
# the default 5 ms a loop thread that wants it can wait that long for its turn
# (measured: ping p99 15x idle while promoting from disk on 2 cores, 3x at 0.2 ms).
GIL_SWITCH_INTERVAL_S = 0.0002


def parse_size(text) -> int:
    """Bytes from ``"8G"``, ``"512MiB"``, ``"1.5g"`` or a plain number (powers of 1024).

    Raises:
        InvalidArgument: not a size.
    """
    if isinstance(text, bool):
        raise WrongType("a size must be an int or a string such as '8G'")
    if isinstance(text, int):
        return text
    match = _SIZE_RE.match(str(text))
    if not match:
        raise InvalidArgument(
            f"{text!r} is not a size: use bytes or a number with K, M, G "
            "or T (powers of 1024), such as 8G"
        )
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def _capacity(value, what: str) -> int:
    value = parse_size(value) if isinstance(value, str) else value
    if isinstance(value, bool) or not isinstance(value, int):
        raise WrongType(f"{what} capacity_bytes must be an int, got {type(value).__name__}")
    if value <= 0:
        raise InvalidArgument(f"{what} capacity_bytes must be positive, got {value}")
    return value


def _free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def check_trusted_dir(path: str, top: str) -> None:
    """Refuse a directory of a disk tier (``top``, or one inside it) that this process's
    user does not own, that group or others may write, that is not a directory, or
    (inside ``top``) that is a symbolic link: whoever can write there decides which bytes
    are served as the cache's blocks.

    Raises:
        ShmkvError: naming the path and what to do.
    """
    try:
        st = os.stat(path) if path == top else os.lstat(path)
    except OSError as exc:
        raise ShmkvError(
            f"disk tier directory {top}: {path} cannot be examined "
            f"({exc.strerror}); choose another directory"
        ) from None
    if not stat.S_ISDIR(st.st_mode):
        kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a directory"
        raise ShmkvError(
            f"disk tier directory {top} is damaged: {path} is {kind}; remove "
            "it (or empty the directory) or choose another directory"
        )
    uid = os.geteuid()
    if st.st_uid != uid:
        raise ShmkvError(
            f"disk tier directory {path} is owned by uid {st.st_uid}, not by "
            f"this process's uid {uid}: another user could plant blocks there; "
            "use a directory of your own (or chown it)"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ShmkvError(
            f"disk tier directory {path} is writable by group or others (mode "
            f"{stat.S_IMODE(st.st_mode):04o}): they could plant blocks there; "
            f"run chmod go-w {path} or use a directory of your own"
        )


def _check_writable(path: str, need: int) -> None:
    """Make ``path`` a directory we can write files into, with ``need`` bytes free,
    that only this user may write (:func:`check_trusted_dir`)."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise InvalidArgument(f"disk tier path {path} exists and is not a directory")
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except OSError as exc:
        raise ShmkvError(
            f"disk tier directory {path} cannot be created ({exc.strerror}); "
            "choose a writable directory"
        ) from None
    check_trusted_dir(path, path)
    probe = os.path.join(path, f".probe-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        fd, _st = open_regular(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        what = (
            "is on a read-only filesystem"
            if exc.errno == errno.EROFS
            else f"is not writable ({exc.strerror})"
        )
        raise ShmkvError(
            f"disk tier directory {path} {what}; choose a writable directory"
        ) from None
    try:
        os.close(fd)
    finally:
        try:
            os.unlink(probe)
        except OSError:
            pass
    free = _free_bytes(path)
    if free < need:
        raise ShmkvError(
            f"disk tier directory {path} is on a full filesystem: {free} bytes "
            f"free, a block file needs {need}; free space or choose another "
            "directory"
        )


class HostTier:
    """A tier of host shared memory under the pool, LRU.

    Under a CPU pool it is a second, larger level of the same memory (and the easy
    tier to test); under a GPU pool it is the offload tier, registered with CUDA for
    DMA. Its content does not survive the coordinator.

    Args:
        capacity_bytes: bytes to reserve (an int, or a size such as ``"8G"``);
            ``capacity_bytes // block_nbytes`` blocks fit.

    Raises:
        InvalidArgument / WrongType: a zero, negative or non-integer capacity. A
            capacity below one block, or more than ``/dev/shm`` can hold, raises when
            the coordinator opens.
    """

    kind = "host"

    def __init__(self, capacity_bytes):
        self.capacity_bytes = _capacity(capacity_bytes, "HostTier")

    def __repr__(self) -> str:
        return f"HostTier(capacity_bytes={self.capacity_bytes})"


class DiskTier:
    """A tier of block files in a local directory, LRU, persistent across restarts.

    A coordinator restarted on the same directory, with the same block layout (model
    shapes, dtype, tensor-parallel size; any number of blocks) and salt, serves prefix
    hits from it. The index is rebuilt from the directory in the background at start, so
    the coordinator serves at once. One coordinator at a time uses a directory (a lock
    file).

    Args:
        path: the directory (created if missing).
        capacity_bytes: the most bytes of block files kept (an int or ``"64G"``).
        salt: bytes that, with the layout fingerprint, name what the blocks are (the
            model, say): a coordinator with another salt does not use the directory.
        fsync: fsync each file before it is renamed into place (see the module doc).

    Trust: the directory's content is trusted as far as its owner is. Whoever can write
    into it can plant block files that are served as prefix hits (a block's name and
    namespace follow from public facts: the model's shapes, the salt, the tokens), and
    a checksum proves only that a file is whole. So the directory must be owned by the
    coordinator's user and not writable by group or others (checked here and again when
    the coordinator opens), and every file in it is opened without following symbolic
    links and used only if it is a regular file (a planted link, FIFO or device is
    refused or ignored, never followed, read or truncated). Use a ``salt`` that others
    cannot guess to keep even its owner's other models' files apart.

    Memory: besides its files, a disk tier keeps ``STAGING_BLOCKS`` blocks of host shared
    memory (staging slots: blocks the pool evicted before their write was done, and off
    x86 every block on its way to disk; see the module doc).

    Raises:
        InvalidArgument / WrongType: a zero or negative capacity, a path that is a file.
        ShmkvError: the directory cannot be created or written (a read-only
            filesystem), its filesystem is full, it is owned by another user or is
            writable by group or others, or it is damaged (``blocks`` not a directory,
            ``lock`` not a regular file). A directory in use by another coordinator
            raises when this one opens.
    """

    kind = "disk"

    def __init__(self, path, capacity_bytes, salt: bytes = b"", fsync: bool = False):
        if not isinstance(path, (str, os.PathLike)) or not str(path):
            raise WrongType("DiskTier path must be a non-empty str or path")
        if not isinstance(salt, bytes):
            raise WrongType("DiskTier salt must be bytes")
        self.path = os.path.abspath(os.fspath(path))
        self.capacity_bytes = _capacity(capacity_bytes, "DiskTier")
        self.salt = salt
        self.fsync = bool(fsync)
        _check_writable(self.path, 1)

    def __repr__(self) -> str:
        return f"DiskTier({self.path!r}, capacity_bytes={self.capacity_bytes})"


def check_specs(tiers) -> list:
    """Validate a coordinator's ``tiers=`` list: ``[HostTier]``, ``[DiskTier]`` or
    ``[HostTier, DiskTier]``, top to bottom."""
    if tiers is None:
        return []
    if not isinstance(tiers, (list, tuple)):
        raise WrongType("tiers must be a list such as [HostTier(...), DiskTier(...)]")
    kinds = [
        getattr(t, "kind", None) if isinstance(t, (HostTier, DiskTier)) else None for t in tiers
    ]
    if kinds not in ([], ["host"], ["disk"], ["host", "disk"]):
        raise InvalidArgument(
            "tiers must be [HostTier(...)], [DiskTier(...)] or "
            "[HostTier(...), DiskTier(...)], top tier first"
        )
    return list(tiers)


# -- the index entries and the promotions --------------------------------------------


class _Entry:
    """One key in one tier. ``ready``: complete and servable. ``pins``: copies reading it."""

    __slots__ = ("slot", "ready", "pins", "from_scan", "doomed", "src_gen", "staged")

    def __init__(self, slot: int = -1, ready: bool = False, from_scan: bool = False):
        self.slot = slot
        # a demotion's: the pool block's key generation it was copied under (identity)
        self.src_gen = -1
        self.ready = ready
        self.pins = 0
        self.from_scan = from_scan  # indexed from the directory at start (not written by us)
        self.staged = False  # (disk) its bytes are in a staging slot, being written
        self.doomed = False  # found damaged while pinned: removed at the last unpin


class Promotion:
    """Blocks being promoted for one request. ``context`` is the coordinator's (whom to
    answer); ``records`` are the ``shmkv.sequences`` records it finishes.

    Its copies are columns, one item a block, record after record (``row_lens`` blocks
    each): op codes (``tier_io.OPS``), pool blocks, host slots, keys, and the tier entry
    each reads and pins (None for a block no tier could serve). A promotion is the loop's
    hot path, so it makes no object per block: the job frame is packed from the columns
    and its outcomes come back as one status byte a block."""

    __slots__ = (
        "records",
        "row_lens",
        "ops",
        "blocks",
        "slots",
        "keys",
        "srcs",
        "num_host",
        "context",
    )

    def __init__(self, records: list):
        self.records = records
        self.row_lens: List[int] = []
        self.ops: List[int] = []
        self.blocks: List[int] = []
        self.slots: List[int] = []
        self.keys: List[bytes] = []
        self.srcs: list = []
        self.num_host = 0  # copies from the host tier (the others: disk, or none)
        self.context: Any = None

    def copies(self) -> list:
        """The promotion as ``tier_io.Copy`` objects (for worker threads)."""
        out = []
        for op, block, slot, key in zip(self.ops, self.blocks, self.slots, self.keys):
            copy = _Copy(tier_io.OPS[op], key, block=block, slot=slot)
            copy.cancelled = op == OP_NONE
            out.append(copy)
        return out


# -- the stores: a tier bound to one pool ------------------------------------------------


class _HostStore:
    name = "host"

    def __init__(self, spec: HostTier, config, what: str = "host tier"):
        self.slot_nbytes = config.block_nbytes
        self.num_slots = spec.capacity_bytes // self.slot_nbytes
        self.capacity_bytes = spec.capacity_bytes
        self.data: Optional[torch.Tensor] = None  # uint8 [num_slots, slot_nbytes]
        self.np: Optional[np.ndarray] = None  # the same, as numpy
        self.fd: Optional[int] = None  # for the tier I/O process (closed once it has it)
        self._registered: Optional[int] = None  # the address cudaHostRegister took
        if self.num_slots < 1:
            raise InvalidArgument(
                f"HostTier capacity_bytes={spec.capacity_bytes} holds no "
                f"block of {self.slot_nbytes} bytes; raise it"
            )
        nbytes = self.num_slots * self.slot_nbytes
        self.fd = shm.create_segment(nbytes, what)
        self.ro_fd: Optional[int] = None  # read-only, for clients (read_only_fd)
        self.data = shm.map_tensor(self.fd, nbytes).view(self.num_slots, self.slot_nbytes)
        self.np = self.data.numpy()  # the mapping lives as long as these views
        if config.is_cuda:  # page-locked, so copies to and from the GPU are DMA
            import torch

            ptr = self.data.data_ptr()
            code = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
            if int(code) == 0:
                self._registered = ptr
            else:
                log.warning("%s: cudaHostRegister failed (%s); copies will be staged", what, code)
        self.free: List[int] = list(range(self.num_slots - 1, -1, -1))
        self.index: "OrderedDict[bytes, _Entry]" = OrderedDict()
        self.num_ready = 0
        self.counters = {"hits": 0, "demotions": 0, "promotions": 0, "dropped": 0, "errors": 0}

    def stats(self) -> dict:
        blocks = self.num_ready
        out = {
            "tier": "host",
            "blocks": blocks,
            "bytes": blocks * self.slot_nbytes,
            "capacity_bytes": self.capacity_bytes,
            "slots": self.num_slots,
        }
        out.update(self.counters)
        return out

    def read_only_fd(self) -> Optional[int]:
        """A descriptor of the slots that only reads (opened again through ``/proc``),
        kept for clients that copy their own promotions; None where it cannot be made."""
        if self.ro_fd is None and self.fd is not None:
            try:
                self.ro_fd = os.open(f"/proc/self/fd/{self.fd}", os.O_RDONLY | os.O_CLOEXEC)
            except OSError as exc:
                log.warning("host tier: no read-only descriptor for clients (%s)", exc)
        return self.ro_fd

    def close_fd(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def close(self) -> None:
        self.close_fd()
        if self.ro_fd is not None:
            os.close(self.ro_fd)
            self.ro_fd = None
        if self._registered is not None:
            import torch

            torch.cuda.cudart().cudaHostUnregister(self._registered)
            self._registered = None
        self.data = self.np = None  # the mapping goes with the last tensor


_LIVE_DISKS: "weakref.WeakSet[_DiskStore]" = weakref.WeakSet()
_switch_lock = threading.Lock()
_switch_users = 0
_switch_saved = 0.0


def _shorten_switch_interval() -> None:
    global _switch_users, _switch_saved
    with _switch_lock:
        if _switch_users == 0:
            _switch_saved = sys.getswitchinterval()
            if _switch_saved > GIL_SWITCH_INTERVAL_S:
                sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        _switch_users += 1


def _restore_switch_interval() -> None:
    global _switch_users
    with _switch_lock:
        _switch_users -= 1
        if _switch_users == 0:
            sys.setswitchinterval(_switch_saved)


def _after_fork_in_child() -> None:
    """A forked child must not keep a disk tier's lock alive after its parent stops, nor
    the tier I/O process's socket (it would hide the parent's death from the process)."""
    for store in list(_LIVE_DISKS):
        store.forget_lock()
    _LIVE_DISKS.clear()
    for io in list(_LIVE_IO):
        io.forget_after_fork()
    _LIVE_IO.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


class _DiskStore(BlockFiles):
    """The disk tier's index and directory; its block files are a :class:`BlockFiles`."""

    name = "disk"

    def __init__(self, spec: DiskTier, config, memory=None):
        self.path = spec.path
        self.capacity_bytes = spec.capacity_bytes
        # A quantized pool's blocks mean values only with its K/V scales: the namespace
        # holds the scales in force at open, and while the pool's differ from them the
        # tier neither serves nor stores (same_scales).
        self._scale_lock: Optional[memoryview] = None  # the pool's seqlock word and
        self._scales: Optional[memoryview] = None  # K/V scales (shmkv.memory)
        scales = None
        if config.is_quantized and memory is not None and memory.scales is not None:
            self._scale_lock, self._scales = memory.scale_lock, memory.scales
            scales = tuple(memory.scales)
        self._opened_scales, self._scales_same = scales, True
        self._scales_at: Optional[int] = None  # the seqlock's value same_scales last saw
        # What a block's bytes mean, not how many the pool has: a pool restarted with
        # another num_blocks hits the blocks it left.
        self.fingerprint = config.block_fingerprint(scales)
        self.salt_digest = hashlib.blake2b(spec.salt, digest_size=16).hexdigest()
        super().__init__(
            os.path.join(self.path, "blocks"),
            secrets.token_hex(6),
            hashlib.blake2b(
                f"{self.fingerprint}/{self.salt_digest}".encode(), digest_size=16
            ).digest(),
            (
                config.num_layers,
                config.block_size,
                config.num_kv_heads,
                config.head_dim,
                config.tp_size,
                config.dtype.encode(),
            ),
            config.block_nbytes,
            spec.fsync,
        )
        self.file_nbytes = HEADER_SIZE + self.payload_nbytes
        self.disabled: Optional[str] = None
        self.scanning = False
        self.full_until = 0.0
        self.index: "OrderedDict[bytes, _Entry]" = OrderedDict()
        self.num_ready = 0
        self.bytes = 0  # files written, being written, or found at start
        self.counters = {
            "hits": 0,
            "demotions": 0,
            "promotions": 0,
            "dropped": 0,
            "errors": 0,
            "full": 0,
            "removed_damaged": 0,
            "removed_incomplete": 0,
        }
        self._lock_fd: Optional[int] = None
        _check_writable(self.path, self.file_nbytes)
        self._lock()
        try:
            self._check_namespace(config)
            if self.disabled is None:
                try:
                    os.mkdir(self.blocks_dir, 0o700)
                except FileExistsError:
                    pass
                except OSError as exc:
                    raise ShmkvError(
                        f"disk tier directory {self.path}: {self.blocks_dir} "
                        f"cannot be created ({exc.strerror}); choose a "
                        "writable directory"
                    ) from None
                check_trusted_dir(self.blocks_dir, self.path)
        except BaseException:
            self.close()
            raise

    def _lock(self) -> None:
        lock_path = os.path.join(self.path, "lock")
        try:
            fd, _st = open_regular(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            kind = (
                "a symbolic link"
                if exc.errno == errno.ELOOP
                else "not a regular file"
                if isinstance(exc, NotRegular) or exc.errno == errno.EISDIR
                else f"unusable ({exc.strerror})"
            )
            raise ShmkvError(
                f"disk tier directory {self.path} is damaged: its lock file "
                f"{lock_path} is {kind}; remove it (the coordinator makes a "
                "new one) or choose another directory"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            finally:
                os.close(fd)
            raise ShmkvError(
                f"disk tier directory {self.path} is in use by another "
                f"coordinator (pid {holder}); stop it or choose another "
                "directory"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd
        _LIVE_DISKS.add(self)

    def _check_namespace(self, config) -> None:
        ns_path = os.path.join(self.path, "namespace")
        wanted = {
            "format": NAMESPACE_FORMAT,
            "version": FORMAT_VERSION,
            "fingerprint": self.fingerprint,
            "salt_digest": self.salt_digest,
            "block_nbytes": self.payload_nbytes,
            "layout": {
                k: v
                for k, v in config.to_wire().items()
                if k in ("num_layers", "num_kv_heads", "head_dim", "block_size", "dtype", "tp_size")
            },
        }
        try:
            fd, _st = open_regular(ns_path, os.O_RDONLY)
            with open(fd, "rb") as f:
                found = json.loads(f.read(1 << 16))
        except FileNotFoundError:
            tmp = f"{ns_path}.tmp-{self.session}"
            try:
                fd, _st = open_regular(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                with open(fd, "w") as f:
                    json.dump(wanted, f, indent=1, sort_keys=True)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, ns_path)
            except OSError as exc:
                raise ShmkvError(
                    f"disk tier directory {self.path}: its namespace file "
                    f"{ns_path} cannot be written ({exc.strerror or exc}); "
                    "remove what is in its way or choose another "
                    "directory"
                ) from None
            return
        except (OSError, ValueError) as exc:
            self._disable(f"its namespace file cannot be read ({exc})")
            return
        if not isinstance(found, dict) or found.get("format") != NAMESPACE_FORMAT:
            self._disable("its namespace file is not a shmkv disk tier's")
        elif found.get("version") != FORMAT_VERSION:
            self._disable(
                f"it holds format version {found.get('version')}, this shmkv "
                f"writes {FORMAT_VERSION}"
            )
        elif found.get("fingerprint") != self.fingerprint:
            self._disable(
                f"it holds blocks of layout fingerprint {found.get('fingerprint')}, "
                f"this pool's block layout is {self.fingerprint}"
            )
        elif found.get("salt_digest") != self.salt_digest:
            self._disable("it holds blocks made with another salt")

    def _disable(self, reason: str) -> None:
        self.disabled = reason
        log.warning(
            "disk tier %s is not used: %s; point the disk tier at another directory "
            "(or empty this one) to use it",
            self.path,
            reason,
        )
        self.forget_lock(close=True)

    def forget_lock(self, close: bool = True) -> None:
        if self._lock_fd is not None:
            try:
                os.close(self._lock_fd)  # in a forked child: the parent's lock stays held
            except OSError:
                pass
            self._lock_fd = None
        _LIVE_DISKS.discard(self)

    def close(self) -> None:
        self.forget_lock()
        self._scale_lock = self._scales = None

    def usable(self, now: float) -> bool:
        return self.disabled is None and now >= self.full_until and self.same_scales()

    def same_scales(self) -> bool:
        """False while a quantized pool's K/V scales differ from those this tier's
        namespace holds (set_kv_scales moved them since it opened): its blocks mean
        other values then, so it serves and stores none (loop thread)."""
        lock = self._scale_lock
        if lock is None:
            return True
        version = lock[0]
        if version != self._scales_at:
            self._scales_at = version
            assert self._scales is not None  # (set with the lock)
            same = tuple(self._scales) == self._opened_scales
            if same != self._scales_same:
                log.warning(
                    "disk tier %s: the pool's K/V scales %s those its blocks were "
                    "stored under; it %s",
                    self.path,
                    "are again" if same else "now differ from",
                    "serves and stores again"
                    if same
                    else "neither serves nor stores until they are the same",
                )
            self._scales_same = same
        return self._scales_same

    def stats(self) -> dict:
        blocks = self.num_ready
        state = (
            ("disabled: " + self.disabled)
            if self.disabled
            else ("scanning" if self.scanning else "ready")
        )
        out = {
            "tier": "disk",
            "blocks": blocks,
            "bytes": self.bytes,
            "capacity_bytes": self.capacity_bytes,
            "path": self.path,
            "state": state,
        }
        out.update(self.counters)
        return out


# -- the tier I/O process, from the loop's side ------------------------------------------


class _IoProcess:
    """Start the tier I/O process (``shmkv.tier_io``), send it jobs, take its completions,
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
            # A fresh interpreter running tier_io.py by path (no torch, no shmkv import):
            # not multiprocessing, whose daemonic coordinator process may have no
            # children and whose spawn would re-run an unguarded __main__.
            self.proc = subprocess.Popen(
                [sys.executable, tier_io.__file__, json.dumps(spec)],
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
        want = tier_io.encode_ready()
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

    def submit(self, queue: int, job: _Job) -> None:
        """Queue a job: one of copies, or a promotion's (``job.copies`` None), encoded
        from the promotion's columns."""
        job.queue = queue
        job.job_id = self._next_id
        self._next_id = self._next_id % 0xFFFFFFFF + 1
        self.jobs[job.job_id] = job
        if job.copies is not None:
            self._out += tier_io.encode_job(queue, job)
            return
        promo = job.promotion
        self._out += tier_io.encode_columns(
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
        for body in tier_io.split_frames(self._in):
            try:
                finished.append(tier_io.apply_done(body, self.jobs))
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


_LIVE_IO: "weakref.WeakSet[_IoProcess]" = weakref.WeakSet()


# -- the tier set -----------------------------------------------------------------------


class _Demotion:
    """How every block that becomes cached in the pool reaches a tier: its placement
    (a host slot, a disk write, or the backlog while neither has room, a prefix's first
    blocks first), the spills from host to disk, and the rescue of a block evicted
    before its copy was done, and the completion of those copies (``_complete_demotions``:
    published in a tier only if the block still held the key, ``_still_holds``). Part of
    :class:`TierSet` (its state is TierSet's, made in ``TierSet.__init__``; TierSet's
    ``_complete`` hands each finished job here or to :class:`_Promotions`)."""

    # TierSet's state the demotion side reads and writes (see TierSet.__init__).
    pool: Any
    host: Optional[_HostStore]
    disk: Optional[_DiskStore]
    _staging: Optional[_HostStore]
    _gens: Any
    _reading: Dict[int, Optional[_Copy]]
    _backlog: "OrderedDict[int, bytes]"
    _spill: "OrderedDict[bytes, None]"
    _planned: Set[bytes]
    _new_demotes: List[_Copy]
    _new_disk: List[_Copy]
    _disk_in_flight: int
    num_lost_evictions: int
    num_rescued_evictions: int
    _num_placed: int
    _deferred: bool
    _waiting: Optional[Callable[[], bool]]
    _pool_u8: Any
    _pool_np: Any

    def _on_evict(self, blocks: List[int], keys: List[bytes]) -> None:
        """The pool evicts cached blocks (called once inside ``BlockPool.allocate``, before
        anyone can be told to write them: their bytes are still their keys'). A block
        whose copy down a tier was not done, or not even placed (cached since the last
        tick), is rescued: copied now, on the loop (see :meth:`_rescue`); one no tier
        holds or can take is counted lost."""
        reading, host_index = self._reading, None if self.host is None else self.host.index
        pending = self.pool.newly_cached or ()  # cached this turn, not placed yet
        for block, key in zip(blocks, keys):
            unsafe, copy = block in pending, None
            if reading and block in reading:
                copy = reading.pop(block)
                unsafe = True
                if copy is not None:  # its demotion is still copying: cancel it
                    copy.cancelled = True
                    if self._gens is not None:  # and tell the I/O process (before anyone
                        self._gens[block] += 1  # writes)
                else:  # never copied: it leaves the backlog
                    self._backlog.pop(block, None)
            if host_index is not None:  # the common case, first: the host tier has it
                entry = host_index.get(key)
                if entry is not None and entry.ready:
                    continue
            if self._held(key):
                continue
            if unsafe and self._rescue(block, key):
                self.num_rescued_evictions += 1
            else:  # no tier has it, nor can take it now: lost
                self.num_lost_evictions += 1
                if copy is not None:
                    self._forget_unfinished(copy)

    def _spill_if_host_only(self, key: bytes) -> None:
        """Queue ``key`` to spill to disk if the host tier has it ready and the disk (in
        use) has no entry for it: the disk holds every key the host tier does
        (:meth:`_host_slot` drops only entries on disk). Called where a key becomes
        ready in the host tier, and where a cancelled demotion to disk drops its entry
        (its block may have been rescued into the host tier meanwhile)."""
        host, disk = self.host, self.disk
        entry = None if host is None else host.index.get(key)
        if (
            entry is not None
            and entry.ready
            and disk is not None
            and disk.disabled is None
            and key not in disk.index
        ):
            self._spill[key] = None

    def _forget_unfinished(self, copy: _Copy) -> None:
        """Drop the tier entry a cancelled demotion was filling, now that its block is
        lost: the key is in no tier, and the next block published under it must be
        placed again (an entry left until the copy completes reads as "the tier has it"
        to :meth:`_touch_held`, and that block would never go down). The completion
        then finds the entry gone and only gives back what the copy reserved (its host
        slot; its staging slot and its place among the disk writes in flight)."""
        if copy.op == "p2h":
            host = self.host
            assert host is not None  # (a copy into the host tier)
            if host.index.get(copy.key) is copy.entry:
                del host.index[copy.key]
        elif copy.op in ("p2s", "p2d"):
            disk = self.disk
            assert disk is not None  # (a copy towards the disk tier)
            if disk.index.get(copy.key) is copy.entry:
                del disk.index[copy.key]
                disk.bytes -= disk.file_nbytes

    def _rescue(self, block: int, key: bytes) -> bool:
        """Copy an evicted block whose copy down a tier is not done, on the loop, now
        (its bytes are the key's until the allocation evicting it is answered): into a
        host tier slot (ready at once), else a staging slot written to disk from there.
        False when neither has room. One memcpy of a block, only when the tiers are behind
        the pool's churn and nothing already safe was left to evict
        (``BlockPool.copying``)."""
        host, disk, staging = self.host, self.disk, self._staging
        if host is not None:
            slot = self._host_slot()
            if slot is not None:
                assert host.data is not None and host.np is not None  # (open)
                pool_to_flat(self._pool_np, self._pool_u8, block, host.data[slot], host.np[slot])
                # (an unfinished copy's entry is replaced: its completion frees its slot)
                host.index[key] = _Entry(slot, ready=True)
                host.num_ready += 1
                host.counters["demotions"] += 1
                self._spill_if_host_only(key)
                return True
        if staging is None or not staging.free:
            return False
        assert disk is not None  # (staging slots exist only under a disk tier)
        if not disk.usable(time.monotonic()):
            return False
        # (a key in the index already: an unfinished copy's, whose room it takes over)
        if key not in disk.index and not self._disk_reserve():
            return False
        slot = staging.free.pop()
        assert staging.data is not None and staging.np is not None  # (open)
        pool_to_flat(self._pool_np, self._pool_u8, block, staging.data[slot], staging.np[slot])
        entry = _Entry()
        entry.staged = True
        disk.index[key] = entry
        self._new_disk.append(_Copy("s2d", key, slot=slot, entry=entry))
        self._disk_in_flight += 1
        return True

    def _held(self, key: bytes) -> bool:
        """A tier has the key's bytes (ready, or in a staging slot on their way to disk)."""
        for store in (self.host, self.disk):
            if store is not None:
                entry = store.index.get(key)
                if entry is not None and (entry.ready or entry.staged):
                    return True
        return False

    def _yield_to_clients(self) -> bool:
        """True when this turn's placing should stop here, every ``PLACE_CHUNK`` blocks,
        because a client waits (``tick``'s ``waiting``): what is left waits in the
        backlog for the next turn, which the loop takes without sleeping (``max_wait``)."""
        self._num_placed += 1
        if self._waiting is None or self._num_placed % PLACE_CHUNK or not self._waiting():
            return False
        self._deferred = True
        return True

    def _drain_backlog(self) -> None:
        """Place the backlog's blocks, oldest first, until one must wait again (or a
        client waits: :meth:`_yield_to_clients`)."""
        backlog, reading, block_key = self._backlog, self._reading, self.pool.block_key
        while backlog and not self._deferred:
            block, key = next(iter(backlog.items()))
            if block_key[block] == key and not self._place(block, key, queued=True):
                return  # no room yet: it stays first
            self._yield_to_clients()
            del backlog[block]
            if reading.get(block, False) is None:  # (a copy placed now replaced the mark)
                del reading[block]

    def _touch_held(self, key: bytes, queued: bool = False) -> bool:
        """Whether the first tier a cached block goes to holds its key already (an entry,
        ready or being copied): then nothing is copied, the entry is marked recently used
        (unless ``queued``: see :meth:`_place`), and a host entry the disk lacks is spilled
        (an earlier write failed). A block promoted and released again ends here: a
        dictionary look-up, no placing."""
        host, disk = self.host, self.disk
        if host is not None:
            entry = host.index.get(key)
            if entry is None:
                return False
            if not queued:
                host.index.move_to_end(key)
                if disk is not None and disk.disabled is None and key in disk.index:
                    disk.index.move_to_end(key)
            self._spill_if_host_only(key)  # (ready, not on disk: an earlier write failed)
            return True
        if disk is None or disk.disabled is not None or key not in disk.index:
            return False
        if not queued:
            disk.index.move_to_end(key)
        return True

    def _place(self, block: int, key: bytes, queued: bool = False) -> bool:
        """A published block became cached: copy it to the first tier that lacks it.

        Returns False when it must wait for room (every host slot busy and no disk
        write to spare): the caller keeps it in the backlog. True otherwise: a copy was
        scheduled, a tier has it already, or no tier can take it (the disk is full,
        failing or not used, and there is no host tier); the loop does not retry those.
        ``queued``: ``move_to_end`` of an entry it finds is skipped (the block waited;
        it was used when it became cached, not now)."""
        if self._touch_held(key, queued):
            return True
        host, disk = self.host, self.disk
        if host is not None:
            slot = self._host_slot()
            if slot is not None:
                entry = _Entry(slot)
                entry.src_gen = self.pool.key_gen[block]  # checked as the copy completes
                host.index[key] = entry
                copy = _Copy(
                    "p2h",
                    key,
                    block=block,
                    slot=slot,
                    entry=entry,
                    gen=0 if self._gens is None else int(self._gens[block]),
                )
                self._reading[block] = copy
                self._new_demotes.append(copy)
                return True
        if disk is None or disk.disabled is not None:
            return host is None  # the host tier's slots are all busy: wait for one
        if key in disk.index:  # (the host tier lacks it and is full: the disk has it)
            if not queued:
                disk.index.move_to_end(key)
            return True
        if not disk.usable(time.monotonic()) or disk.file_nbytes > disk.capacity_bytes:
            return True  # full: demotion to disk pauses (counted in "full")
        if self._disk_in_flight >= MAX_DISK_WRITES_IN_FLIGHT:
            return False  # every write in flight: wait
        staging = self._staging
        assert staging is not None  # (made with a disk tier that is used)
        staged = not DIRECT_DISK_DEMOTION
        if staged and len(staging.free) <= STAGING_RESCUE:
            return False  # every staging slot busy (but those kept for rescues): wait
        if not self._disk_reserve():
            return False  # every disk entry busy: wait
        entry = _Entry()
        entry.src_gen = self.pool.key_gen[block]  # checked as the copy completes
        disk.index[key] = entry
        gen = 0 if self._gens is None else int(self._gens[block])
        if staged:  # through a staging slot, checked by the loop (tier_io: memory ordering)
            copy = _Copy("p2s", key, block=block, slot=staging.free.pop(), entry=entry, gen=gen)
            self._new_demotes.append(copy)
        else:
            copy = _Copy("p2d", key, block=block, entry=entry, gen=gen)
            self._new_disk.append(copy)
        self._reading[block] = copy
        self._disk_in_flight += 1
        return True

    def _host_slot(self) -> Optional[int]:
        """A free host slot, making room by the LRU when needed; None when all are busy.

        With a disk tier that takes writes, only an entry already on disk makes room (the
        oldest of the first ``HOST_SCAN`` entries; an entry whose disk write is still to
        come is busy): the host tier drops nothing the disk does not hold."""
        host, disk = self.host, self.disk
        assert host is not None  # (only the host tier has slots)
        if host.free:
            return host.free.pop()
        on_disk = None
        if disk is not None and disk.usable(time.monotonic()):
            on_disk = disk.index
        spill = self._spill
        # oldest first; busy entries are skipped
        planned = self._planned
        for scanned, (key, entry) in enumerate(host.index.items(), start=1):
            if entry.ready and not entry.pins and key not in planned:
                if on_disk is None:
                    break
                target = on_disk.get(key)
                if target is None:
                    if key not in spill:  # its disk write failed: nothing to wait for
                        break
                elif target.ready:
                    break
            if scanned >= HOST_SCAN:
                return None
        else:
            return None
        del host.index[key]
        host.num_ready -= 1
        self._spill.pop(key, None)
        disk = self.disk
        kept = disk is not None and key in disk.index and disk.index[key].ready
        if not kept:
            host.counters["dropped"] += 1
        return entry.slot

    def _disk_reserve(self) -> bool:
        """Make room for one file by deleting the disk's LRU blocks; False if it cannot."""
        disk = self.disk
        assert disk is not None  # (called only with a disk tier)
        planned = self._planned
        while disk.bytes + disk.file_nbytes > disk.capacity_bytes:
            victim = next(
                (
                    key
                    for key, entry in disk.index.items()
                    if entry.ready and not entry.pins and key not in planned
                ),
                None,
            )
            if victim is None:
                return False
            self._disk_remove(victim)
            disk.counters["dropped"] += 1
        disk.bytes += disk.file_nbytes
        return True

    def _disk_remove(self, key: bytes) -> None:
        """Forget a disk block and delete its file (after any write queued before)."""
        disk = self.disk
        assert disk is not None  # (called only with a disk tier)
        self._unready(disk, disk.index.pop(key))
        disk.bytes -= disk.file_nbytes
        self._new_disk.append(_Copy("del", key))

    @staticmethod
    def _unready(store, entry: _Entry) -> None:
        if entry.ready:
            entry.ready = False
            store.num_ready -= 1

    def _schedule_spills(self) -> None:
        disk, host = self.disk, self.host
        # (keys are spilled only from a host tier to a disk tier)
        assert disk is not None and host is not None
        if not disk.usable(time.monotonic()):
            return
        while self._spill and self._disk_in_flight < MAX_DISK_WRITES_IN_FLIGHT:
            key, _ = self._spill.popitem(last=False)
            entry = host.index.get(key)
            if entry is None or not entry.ready or key in disk.index:
                continue
            if not self._disk_reserve():
                self._spill[key] = None
                self._spill.move_to_end(key, last=False)
                return
            entry.pins += 1
            target = _Entry()
            disk.index[key] = target
            self._new_disk.append(_Copy("h2d", key, slot=entry.slot, entry=target, src=entry))
            self._disk_in_flight += 1

    def _unpin(self, entry: _Entry, key: bytes) -> None:
        entry.pins -= 1
        if entry.doomed and not entry.pins:
            self._unpin_doomed(entry, key)

    def _still_holds(self, copy) -> bool:
        """A demotion's block still holds the key it was copied under (the allocator's
        rule: ``BlockPool.still_holds``); a copy whose block changed is counted there and
        discarded by the caller. Checked as its completion is taken, after its last
        read, before it is published in a tier's index."""
        if self.pool.still_holds(copy.block, copy.key, copy.entry.src_gen):
            return True
        self.pool.discard_copies(1)
        return False

    def _unpin_doomed(self, entry: _Entry, key: bytes) -> None:
        """The last copy reading a damaged entry is done: remove it (only disk entries
        are doomed)."""
        if self.disk is not None and self.disk.index.get(key) is entry:
            self._disk_remove(key)

    def _complete_demotions(self, copies: list) -> None:
        """A job of demotion copies (or deletions) is back: publish each copy that
        succeeded while its block still held the key (``_still_holds``) in its tier's
        index, and release what the others reserved (their slot, room on disk, a pin).
        A full disk pauses demotion to disk (``DISK_FULL_BACKOFF_S``)."""
        host, disk = self.host, self.disk
        entry: _Entry  # the tier entry a demotion's copy fills
        for copy in copies:
            op = copy.op
            block = copy.block
            if op == "p2h":
                assert host is not None  # (a copy into the host tier)
                if self._reading.get(block) is copy:
                    del self._reading[block]
                entry = copy.entry
                held = self._still_holds(copy)
                if copy.ok and held and not copy.cancelled and host.index.get(copy.key) is entry:
                    entry.ready = True
                    host.num_ready += 1
                    host.counters["demotions"] += 1
                    self._spill_if_host_only(copy.key)
                else:
                    if copy.error is not None:
                        host.counters["errors"] += 1
                    if host.index.get(copy.key) is entry:
                        del host.index[copy.key]
                    host.free.append(entry.slot)
            elif op == "p2s":  # a block on its way to disk: in its staging slot now
                assert disk is not None and self._staging is not None  # (its copies)
                if self._reading.get(block) is copy:
                    del self._reading[block]
                entry = copy.entry
                held = self._still_holds(copy)
                if copy.ok and held and not copy.cancelled and disk.index.get(copy.key) is entry:
                    entry.staged = True  # out of the pool: safe from eviction
                    self._new_disk.append(_Copy("s2d", copy.key, slot=copy.slot, entry=entry))
                    continue  # (still a write in flight)
                self._disk_in_flight -= 1
                self._staging.free.append(copy.slot)
                if copy.error is not None:
                    disk.counters["errors"] += 1
                if disk.index.get(copy.key) is entry:
                    del disk.index[copy.key]
                    disk.bytes -= disk.file_nbytes
                if copy.cancelled:
                    self._spill_if_host_only(copy.key)
            elif op in ("h2d", "p2d", "s2d"):
                assert disk is not None  # (a copy into the disk tier)
                self._disk_in_flight -= 1
                if op == "h2d":
                    self._unpin(copy.src, copy.key)
                elif op == "s2d":
                    assert self._staging is not None  # (its slot)
                    self._staging.free.append(copy.slot)
                elif self._reading.get(block) is copy:
                    del self._reading[block]
                entry = copy.entry
                mine = disk.index.get(copy.key) is entry
                if op == "p2d" and not self._still_holds(copy):
                    # renamed in (its last cancel check passed before the eviction): remove
                    if copy.ok and (mine or copy.key not in disk.index):
                        self._new_disk.append(_Copy("del", copy.key))
                    copy.ok = False
                if copy.ok and not copy.cancelled:
                    if mine:
                        entry.ready = True
                        disk.num_ready += 1
                        disk.counters["demotions"] += 1
                    elif copy.key not in disk.index:  # forgotten while written: delete it
                        self._new_disk.append(_Copy("del", copy.key))
                    continue
                if copy.enospc:
                    disk.counters["full"] += 1
                    now = time.monotonic()
                    if now >= disk.full_until:  # once per pause, not once per block
                        log.warning(
                            "disk tier %s: filesystem full; demotion to disk pauses "
                            "for %.0f s (nothing in the pool is lost)",
                            disk.path,
                            DISK_FULL_BACKOFF_S,
                        )
                    disk.full_until = now + DISK_FULL_BACKOFF_S
                    # (an h2d copy is a spill from the host tier)
                    if op == "h2d" and host is not None and host.index.get(copy.key) is copy.src:
                        self._spill[copy.key] = None  # still in host memory: try again later
                elif copy.error is not None:
                    disk.counters["errors"] += 1
                    log.warning("disk tier %s: writing a block failed: %s", disk.path, copy.error)
                if mine:
                    del disk.index[copy.key]
                    disk.bytes -= disk.file_nbytes
                if op == "p2d" and copy.cancelled:
                    self._spill_if_host_only(copy.key)
            elif op == "del" and copy.error is not None:
                assert disk is not None  # (a file of the disk tier)
                disk.counters["errors"] += 1


class _Promotions(_Demotion):
    """How blocks come back up from a tier: which leading keys of a prompt a tier can
    serve (:meth:`lookup`), the promotion of a request's blocks into fresh pool blocks
    (:meth:`promote`: its columns, the entries it reads and pins, the hits counted, one
    job handed to the workers), and its completion (:meth:`_take_promotion`,
    :meth:`_complete_promotion`: counted, sources unpinned, a damaged block file
    removed, each record finished against the sequence table up to its first failed
    copy). Part of :class:`TierSet`, building on :class:`_Demotion` (entries are
    unpinned and removed there); its state is TierSet's, made in ``TierSet.__init__``,
    and where the job runs (threads or the I/O process) is TierSet's (``_send``)."""

    # TierSet's state the promotion side reads and writes (see TierSet.__init__).
    table: Any
    config: Any
    num_promotions_in_flight: int
    _proc: Optional[_IoProcess]
    _send: Callable[[int, _Job], None]
    _files: Callable[[], Optional[_DiskStore]]

    def lookup(self, keys) -> int:
        """How many leading ``keys`` a tier can serve now (a pure index lookup)."""
        host = self.host.index if self.host is not None else {}
        disk = self.disk.index if self.disk is not None and self.disk.same_scales() else {}
        num = 0
        for key in keys:
            entry = host.get(key)
            if entry is None or not entry.ready:
                entry = disk.get(key)
                if entry is None or not entry.ready:
                    break
            num += 1
        return num

    def held_here(self, keys) -> int:
        """Leading ``keys`` whose bytes are on this host (all a lookup found: every tier
        here is local), so a promotion of them fails only on a damaged file."""
        return self.lookup(keys)

    def keep_planned(self, keys) -> None:
        """``keys`` (found by :meth:`lookup`) are an allocation's plan: until the next
        :meth:`tick`, by which the loop has started that promotion and pinned them, they
        are not dropped to make room (for a block the same allocation, or another one
        served before the promotion starts, evicts and rescues)."""
        self._planned.update(keys)

    def promote(self, records: list, in_client: bool = False) -> Promotion:
        """Start copying the blocks of ``records`` (``shmkv.sequences.PendingPromotion``)
        into their fresh pool blocks; :meth:`tick` returns the promotion when done. With
        ``in_client``, the asking client copies them (:meth:`client_copies`) and
        :meth:`finish_in_client` takes its report instead."""
        promo = Promotion(records)
        host = self.host.index if self.host is not None else None
        disk = self.disk.index if self.disk is not None else None
        ops, slots, srcs = promo.ops, promo.slots, promo.srcs
        num_disk = 0
        for record in records:
            promo.row_lens.append(len(record.keys))
            promo.blocks += record.blocks
            promo.keys += record.keys
            for key in record.keys:
                if host is not None and (entry := host.get(key)) is not None and entry.ready:
                    ops.append(OP_H2P)
                    slots.append(entry.slot)
                    host.move_to_end(key)
                else:
                    slots.append(-1)
                    # (no entry: gone since lookup(), which keep_planned() prevents)
                    if disk is None or (entry := disk.get(key)) is None or not entry.ready:
                        ops.append(OP_NONE)
                        srcs.append(None)
                        continue
                    ops.append(OP_D2P)
                    disk.move_to_end(key)
                    num_disk += 1
                entry.pins += 1
                srcs.append(entry)
        promo.num_host = len(ops) - num_disk - ops.count(OP_NONE)
        if promo.num_host:
            assert self.host is not None  # (its entries were read)
            self.host.counters["hits"] += promo.num_host
        if num_disk:
            assert self.disk is not None  # (its entries were read)
            self.disk.counters["hits"] += num_disk
        # One job: workers take its copies one at a time, so reads and checksums of one
        # request still run in parallel, and the loop takes back one completion.
        self.num_promotions_in_flight += 1
        if in_client:
            return promo
        if self._proc is not None:
            self._send(PROMOTE, _Job(None, promo, num_copies=len(ops)))
        else:
            self._send(PROMOTE, _Job(promo.copies(), promo))
        return promo

    def client_memory(self) -> Tuple[Optional[dict], List[int]]:
        """What a client needs to copy its own promotions (the ``tier_memory`` answer):
        the host tier's slots and slot bytes and the disk tier's block files, with the
        host tier's descriptor, read-only. ``(None, [])`` where a client cannot: a CUDA
        pool, or no read-only descriptor."""
        if self.config.is_cuda:
            return None, []
        host, files = self.host, self._files()
        out: Dict[str, Any] = {"block_nbytes": self.config.block_nbytes, "host": None}
        out["files"] = None if files is None else files.files_wire()
        if files is not None:
            # Which folder it is: a client that sees another one at its path (a mount
            # namespace of its own) would find no file there, and report every block it
            # was asked to copy missing, which removes the genuine files.
            try:
                st = os.stat(files.blocks_dir)
            except OSError:
                return None, []
            out["files_id"] = [st.st_dev, st.st_ino]
        fds = []
        if host is not None:
            fd = host.read_only_fd()
            if fd is None:
                return None, []
            out["host"] = [host.num_slots, host.slot_nbytes]
            fds.append(fd)
        return out, fds

    def client_copies(self, promo: Promotion, promo_id: int) -> dict:
        """The copies of ``promo`` (started ``in_client``) as its client runs them
        (:class:`ClientCopies`): op codes, pool blocks, host slots, keys."""
        return {
            "id": promo_id,
            "ops": bytes(promo.ops),
            "blocks": pack_i64s(promo.blocks),
            "slots": pack_i64s(promo.slots),
            "keys": b"".join(promo.keys),
        }

    def finish_in_client(self, promo: Promotion, statuses: Optional[bytes], errors: list) -> None:
        """The client of ``promo`` (started ``in_client``) reported its copies: one
        ``tier_io`` status a copy (None: none reported, its connection dropped, so none
        counts as done), and ``[index, text]`` of the copies that failed. A status a
        copy cannot have is taken as a failure: OK for a block no tier had, damaged for
        a copy from host memory.

        Raises:
            InvalidArgument: ``statuses`` is not one byte a copy, or ``errors`` not
                ``[index, text]`` pairs of distinct copies (nothing changed).
        """
        ops = promo.ops
        if statuses is None:
            statuses = bytes([tier_io.FAILED]) * len(ops)
        if not isinstance(statuses, bytes) or len(statuses) != len(ops):
            got = len(statuses) if isinstance(statuses, bytes) else type(statuses).__name__
            raise InvalidArgument(f"promoted: {len(ops)} statuses expected, got {got}")
        texts: Dict[int, str] = {}
        for item in errors if len(errors) <= len(ops) else [f"{len(errors)} items"]:
            if not (
                isinstance(item, (list, tuple))
                and len(item) == 2
                and type(item[0]) is int
                and 0 <= item[0] < len(ops)
                and item[0] not in texts
                and isinstance(item[1], str)
            ):
                raise InvalidArgument(
                    f"promoted: errors are [copy index, text] pairs, one a copy of the "
                    f"{len(ops)} at most; got {item!r:.100}"
                )
            texts[item[0]] = item[1][:500]
        if OP_NONE in ops or statuses.count(OK) != len(ops):
            fixed = bytearray(statuses)
            for i, (op, status) in enumerate(zip(ops, statuses)):
                if op == OP_NONE:
                    fixed[i] = tier_io.CANCELLED
                elif status != OK and not (status == DAMAGED and op == OP_D2P):
                    fixed[i] = tier_io.FAILED
            statuses = bytes(fixed)
        self._complete_promotion(promo, statuses, texts)

    def _take_promotion(self, job: _Job) -> Promotion:
        """A promotion's job is back: its outcomes (one status a copy, from the I/O
        process's completion or from its copies in threads) are applied by
        :meth:`_complete_promotion`. Returns the promotion, finished."""
        promo = job.promotion
        statuses, errors = job.statuses, job.errors
        if statuses is None:  # it ran in threads: the outcomes are on its copies
            copies = job.copies
            assert copies is not None
            statuses = bytes(tier_io.status_of(c) for c in copies)
            errors = {i: c.error for i, c in enumerate(copies) if c.error is not None}
        assert errors is not None  # (the I/O process's completion sets both)
        self._complete_promotion(promo, statuses, errors)
        return promo

    def _complete_promotion(self, promo: Promotion, statuses: bytes, errors: dict) -> None:
        """A promotion's copies are done (``statuses``: one ``tier_io`` status a copy):
        count them, unpin their sources, and publish each record's blocks up to its
        first copy that failed."""
        self.num_promotions_in_flight -= 1
        host, disk = self.host, self.disk
        srcs = promo.srcs
        if statuses.count(OK) == len(statuses):  # the common case: every block is in
            num_disk = len(statuses) - promo.num_host
            if promo.num_host:
                assert host is not None  # (its entries were read)
                host.counters["promotions"] += promo.num_host
            if num_disk:
                assert disk is not None  # (its entries were read)
                disk.counters["promotions"] += num_disk
            for entry, key in zip(srcs, promo.keys):
                entry.pins -= 1
                if entry.doomed and not entry.pins:
                    self._unpin_doomed(entry, key)
        else:
            for i, (entry, key, status) in enumerate(zip(srcs, promo.keys, statuses)):
                if entry is None:  # nothing was read
                    continue
                store = host if promo.ops[i] == OP_H2P else disk
                assert store is not None  # (the entry is the store's)
                if status == OK:
                    store.counters["promotions"] += 1
                else:
                    store.counters["errors"] += 1
                    if status == DAMAGED:
                        assert disk is not None  # (only a block file is found damaged)
                        self._unready(store, entry)
                        entry.doomed = True
                        disk.counters["removed_damaged"] += 1
                        log.warning(
                            "disk tier %s: block %s not served and removed: %s",
                            disk.path,
                            key.hex(),
                            errors.get(i, "damaged"),
                        )
                self._unpin(entry, key)
        at, ok = 0, bytes([OK])
        for record, length in zip(promo.records, promo.row_lens):
            row = statuses[at : at + length]
            self.table.finish_promotion(record, length - len(row.lstrip(ok)))
            at += length


class TierSet(_Promotions):
    """The tiers of one coordinator, their indexes, and where their copies run.

    Made by the coordinator at open. Everything here runs on the coordinator's loop
    thread: :meth:`lookup` (from a prefix lookup), :meth:`promote`, :meth:`tick`
    (every loop turn), :meth:`stats`, :meth:`close`. The copies run in the tier I/O
    process (a CPU pool, with ``IO_PROCESS`` and a ``wake_sock``) or in worker threads
    (a CUDA pool); see ``shmkv.tier_io``. Should the I/O process die, the copies it
    had fail (promotions end their hit there, demotions are not kept) and worker
    threads take over, with a warning.

    Its parts: :class:`_Demotion` (blocks down a tier and their completions) and
    :class:`_Promotions` (lookups, promotions and their completions). TierSet itself
    opens the tiers, starts the copies' workers (threads or the I/O process), hands them
    jobs and takes the finished ones back each turn, merges the disk scan, and closes.

    Args:
        specs: checked ``tiers=`` list (see :func:`check_specs`).
        config: the pool's :class:`~shmkv.layout.PoolConfig`.
        memory: the pool's :class:`~shmkv.memory.PoolMemory`.
        table: the :class:`~shmkv.sequences.SequenceTable` (its pool gets the hooks).
        wake: called from a worker thread to wake the loop.
        num_workers: threads for promotions and host copies (in either place).
        wake_sock: the loop's wake socket (write end); the I/O process sends a byte on
            it when a job is done. Without it copies run in threads.

    While worker threads run, the process's GIL switch interval is at most
    ``GIL_SWITCH_INTERVAL_S`` (see there why) and the threads run niced
    (``WORKER_NICE``); the I/O process runs at ``shmkv.tier_io.IO_PROCESS_POLICY``.

    Raises:
        ShmkvError and subclasses: a tier cannot be opened (nothing is left open).
    """

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
        self.host: Optional[_HostStore] = None
        self.disk: Optional[_DiskStore] = None
        self._staging: Optional[_HostStore] = None  # staging slots (under a disk tier)
        self._copier: Optional[Copier] = None  # worker threads, or
        self._proc: Optional[_IoProcess] = None  # the tier I/O process
        self._gens = None  # cancel generations, for the process
        self._done: Deque[_Job] = deque()  # jobs the workers finished
        self._scan_q: Deque[Tuple[str, Any]] = deque()  # (kind, payload) from the disk scan
        self._threads: List[threading.Thread] = []  # the disk scan
        self._stopping = False
        self._wake_pending = False
        self._proc_checked = 0.0  # when the I/O process was last polled
        # Pool block -> the demotion copy reading it, or None while it waits in the backlog
        # (the pool evicts these blocks last: ``BlockPool.copying``).
        self._reading: Dict[int, Optional[_Copy]] = {}
        # Cached pool blocks no tier took yet (its slots or writes in flight were all
        # busy), a prefix's first blocks first: placed as room frees up (tick).
        self._backlog: "OrderedDict[int, bytes]" = OrderedDict()
        self._spill: "OrderedDict[bytes, None]" = OrderedDict()  # host keys to write to disk
        # keys an allocation of this turn plans to promote (keep_planned): not dropped to
        # make room before its promotion pins them; forgotten at the next tick
        self._planned: Set[bytes] = set()
        self._new_demotes: List[_Copy] = []
        self._new_disk: List[_Copy] = []
        self._jobs_out = 0  # jobs handed to workers, not yet back in tick()
        # This turn's placing (tick): blocks placed, whether it stopped for a client.
        self._num_placed = 0
        self._deferred = False
        self._waiting: Optional[Callable[[], bool]] = None
        self._disk_in_flight = 0  # disk writes handed to the writer, not back yet
        self.num_lost_evictions = 0
        self.num_rescued_evictions = 0
        self.num_promotions_in_flight = 0
        self._switch = False
        self._pool_u8 = self._pool_np = None
        try:
            for spec in specs:
                if spec.kind == "host":
                    self.host = _HostStore(spec, config)
                    if not config.is_cuda:  # (made while the read-write one is open)
                        self.host.read_only_fd()
                else:
                    self.disk = _DiskStore(spec, config, memory)
            if self.disk is not None and self.disk.disabled is None:
                self._staging = _HostStore(
                    HostTier(STAGING_BLOCKS * config.block_nbytes),
                    config,
                    what="tier staging slots",
                )
            # Byte views of every rank's pool by block: [num_blocks, 2 * num_layers, chunk
            # bytes of that rank] (a block is a chunk of each layer's K and V).
            self._pool_u8 = [block_bytes(p) for p in memory.device_pools]
            self._pool_np = None if config.is_cuda else [t.numpy() for t in self._pool_u8]
            self.pool.newly_cached = {}
            self.pool.on_evict = self._on_evict
            self.pool.copying = self._reading
            if IO_PROCESS and not config.is_cuda and wake_sock is not None:
                self._start_process(memory, wake_sock)
            else:
                self._start_threads()
            if self.disk is not None and self.disk.disabled is None:
                self.disk.scanning = True
                thread = threading.Thread(target=self._scan, name="shmkv-tier-scan", daemon=True)
                thread.start()
                self._threads.append(thread)
        except BaseException:
            self.close()
            raise

    def _files(self) -> Optional[_DiskStore]:
        disk = self.disk
        return disk if disk is not None and disk.disabled is None else None

    def _row_copy(self) -> Callable[[np.ndarray, np.ndarray], Any]:
        """What copies a CPU pool's blocks to and from flat memory: the native row copy
        (``shmkv.native.copier``), else ``np.copyto``."""
        if self._pool_np is None:
            return np.copyto
        from . import native

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
                "policy": tier_io.IO_PROCESS_POLICY,
                "preload": IO_PROCESS_PRELOAD,
                "copy_lib": None,
            }
            copy = self._row_copy()
            if isinstance(copy, tier_io.RowCopy):  # the I/O process loads the same file
                spec["copy_lib"] = copy.path
            for name, store in (("host", host), ("staging", self._staging)):
                if store is not None:
                    spec[name] = [store.fd, store.num_slots, store.slot_nbytes]
                    fds.append(store.fd)
            self._proc = _IoProcess(spec, fds)
        finally:
            os.close(fd)
            for store in (self.host, self._staging):
                if store is not None:
                    store.close_fd()
        why = self._proc.wait_ready(IO_PROCESS_START_S)
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

    def _send(self, queue: int, job: _Job) -> None:
        """Hand a job to the workers (threads or the I/O process); tick() takes it back."""
        self._jobs_out += 1
        if self._proc is not None:
            self._proc.submit(queue, job)  # sent at the end of this turn's tick()
        else:
            assert self._copier is not None  # (the threads run when no process does)
            self._copier.submit(queue, job)

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
        self._planned.clear()  # (this turn's promotions have pinned what they read)
        self._deferred, self._num_placed, self._waiting = False, 0, waiting
        finished: List[Promotion] = []
        if (
            self._proc is not None
            and self._jobs_out
            and (woken or time.monotonic() - self._proc_checked >= IO_PROCESS_CHECK_S)
        ):
            self._proc_checked = time.monotonic()
            self._poll_process()
        done = self._done
        while done:
            self._complete(done.popleft(), finished)
        if self._scan_q:
            self._merge_scan()
        if self._backlog:
            self._drain_backlog()
        newly = self.pool.newly_cached
        if newly:
            self.pool.newly_cached = {}
            block_key, reading, backlog = self.pool.block_key, self._reading, self._backlog
            # A sequence's blocks are released (and cached) last-first: reversed, a
            # prefix's first blocks are placed first, and wait least when room runs out.
            touch_held = self._touch_held
            for block in reversed(newly):
                key = block_key[block]
                if key is None or block in reading or touch_held(key):
                    continue  # (held: no copy, and no look at the sockets for it)
                if backlog or self._yield_to_clients() or not self._place(block, key):
                    backlog[block] = key
                    reading[block] = None
        if self._spill:
            self._schedule_spills()
        self._submit()
        if self._proc is not None:  # one send a turn for every job of the turn
            self._proc.flush()
            if not self._proc.alive:
                self._take_over()
        return finished

    def max_wait(self) -> float:
        """The longest the loop may sleep before its next :meth:`tick`: while the I/O
        process has jobs, ``IO_PROCESS_CHECK_S`` (it is then polled even without a wake
        byte, so that a process that died is found and its jobs run in threads)."""
        if self._deferred:  # placing stopped for a client: go on after serving it
            return 0.0
        return IO_PROCESS_CHECK_S if self._proc is not None and self._jobs_out else math.inf

    @property
    def num_pending(self) -> int:
        """Copies scheduled or running, plus blocks waiting for a disk write."""
        return (
            self._jobs_out
            + len(self._spill)
            + len(self._new_demotes)
            + len(self._new_disk)
            + len(self._backlog)
        )

    def _submit(self) -> None:
        if not (self._new_demotes or self._new_disk):
            return
        new = self._new_demotes
        for i in range(0, len(new), DEMOTION_CHUNK):
            self._send(DEMOTE, _Job(new[i : i + DEMOTION_CHUNK]))
        if self._new_disk:
            self._send(DISK, _Job(self._new_disk))
        self._new_demotes, self._new_disk = [], []

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

    def _complete(self, job: _Job, finished: list) -> None:
        self._jobs_out -= 1
        if job.promotion is not None:
            finished.append(self._take_promotion(job))
        else:
            assert job.copies is not None  # (only a promotion's job travels as columns)
            self._complete_demotions(job.copies)

    def _merge_scan(self) -> None:
        disk = self.disk
        assert disk is not None  # (only the disk tier is scanned)
        budget = SCAN_CHUNK
        while self._scan_q and budget > 0:
            kind, payload = self._scan_q.popleft()
            if kind == "keys":
                index = disk.index
                for key in payload:
                    if key not in index:
                        index[key] = _Entry(ready=True, from_scan=True)
                        index.move_to_end(key, last=False)  # older than this run's blocks
                        disk.num_ready += 1
                        disk.bytes += disk.file_nbytes
                budget -= len(payload)
            elif kind == "bad":
                key, reason = payload
                entry = disk.index.get(key)
                if entry is not None and entry.from_scan:
                    disk.counters["removed_damaged"] += 1
                    disk.counters["errors"] += 1
                    log.warning(
                        "disk tier %s: block file %s not served and removed: %s",
                        disk.path,
                        key.hex(),
                        reason,
                    )
                    if entry.pins:
                        self._unready(disk, entry)
                        entry.doomed = True
                    else:
                        self._disk_remove(key)
            elif kind == "order":  # oldest last, so each moves to the front in turn
                index = disk.index
                for key in payload:
                    entry = index.get(key)
                    if entry is not None and entry.from_scan:
                        index.move_to_end(key, last=False)
            elif kind == "incomplete":
                disk.counters["removed_incomplete"] += payload
            elif kind == "error":
                disk.counters["errors"] += 1
                log.warning("disk tier %s: scanning failed: %s", disk.path, payload)
            elif kind == "done":
                disk.scanning = False
            budget -= 1
        # A smaller capacity than last run: trimmed once the scan has put the blocks in
        # LRU order (their files' modification times).
        while not disk.scanning and disk.bytes > disk.capacity_bytes:
            victim = next(
                (key for key, entry in disk.index.items() if entry.ready and not entry.pins), None
            )
            if victim is None:
                break
            self._disk_remove(victim)
            disk.counters["dropped"] += 1
        if self._scan_q:
            self._wake()  # more next turn: the loop stays responsive meanwhile

    # -- worker side -------------------------------------------------------------------

    def _wake(self) -> None:
        if not self._wake_pending:
            self._wake_pending = True
            self._wake_fn()

    def _finish(self, job: _Job) -> None:
        self._done.append(job)
        self._wake()

    def _scan(self) -> None:
        """Rebuild the disk index from the directory: names first (so hits start at
        once), then every header, then the LRU order by modification time."""
        disk = self.disk
        assert disk is not None  # (only the disk tier is scanned)
        post = self._scan_q.append
        try:
            keys, incomplete = [], 0
            with os.scandir(disk.blocks_dir) as entries:
                for item in entries:
                    if self._stopping:
                        return
                    match = _FILE_RE.match(item.name)
                    if match:
                        if not item.is_file(follow_symlinks=False):
                            continue  # a link, FIFO, device or folder: never a block
                        keys.append(bytes.fromhex(match.group(1)))
                        if len(keys) % SCAN_CHUNK == 0:
                            post(("keys", keys[-SCAN_CHUNK:]))
                            self._wake()
                        continue
                    tmp = _TMP_RE.match(item.name)
                    if tmp and tmp.group(1) != disk.session:  # left by a killed writer
                        try:
                            os.unlink(item.path)
                            incomplete += 1
                        except OSError:
                            pass
            if len(keys) % SCAN_CHUNK:
                post(("keys", keys[-(len(keys) % SCAN_CHUNK) :]))
            if incomplete:
                post(("incomplete", incomplete))
            self._wake()
            ages = []
            for key in keys:
                if self._stopping:
                    return
                try:
                    mtime, _crc = disk.read_header(key)
                    ages.append((mtime, key))
                except FileNotFoundError:
                    continue
                except (_Damaged, OSError) as exc:  # (swapped for a link or FIFO since)
                    post(("bad", (key, str(exc))))
                    self._wake()
            ages.sort(reverse=True)
            post(("order", [key for _mtime, key in ages]))
        except OSError as exc:
            post(("error", str(exc)))
        finally:
            post(("done", None))
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
        self._stopping = True
        if self._proc is not None:
            self._proc.close(IO_PROCESS_EXIT_S)
            self._proc = None
        if self._copier is not None:
            self._copier.close(timeout)
            self._copier = None
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout)
        self._threads = []
        if self._switch:
            self._switch = False
            _restore_switch_interval()
        if getattr(self.pool, "on_evict", None) == self._on_evict:
            self.pool.on_evict = None
            self.pool.newly_cached = None
        if getattr(self.pool, "copying", None) is self._reading:
            self.pool.copying = None
        for name in ("host", "disk", "_staging"):
            store = getattr(self, name)
            if store is not None:
                store.close()
        self._pool_u8 = self._pool_np = self._gens = None
