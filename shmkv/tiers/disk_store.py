"""The disk tier bound to one pool (:class:`DiskStore`): its directory, lock, namespace,
index and counters; its block files are a :class:`~shmkv.memory.block_io.BlockFiles` it
holds (``files``).

Owns the directory's lifetime for this coordinator: the lock file (one coordinator a
directory; a forked child drops its copy of the lock), the namespace file (which blocks
the directory may hold, and whether this pool may use them), whether the tier is usable
now (disabled, full, or a quantized pool's scales moved), and :meth:`DiskStore.stats`.
Which keys it holds is decided by the demotion part (``shmkv.tiers.demotion``), the only
code that changes its index and byte count; the scan (``shmkv.tiers.scan``) rebuilds the
index at start through that part, and sets ``scanning``. The block file format is
``shmkv.memory.block_io``'s: the store makes its ``files`` with this pool's namespace and
block shape and reads its ``payload_nbytes`` and ``session``; the copies (``Mover``, the
tier I/O process), the scan and clients read and write blocks through that object, never
through the store. The directory layout is in ``shmkv.tiers``' docstring. Imports
``shmkv.errors``, ``shmkv.memory.block_io`` and ``shmkv.tiers.specs`` / ``entry``.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import secrets
import weakref
from collections import OrderedDict
from typing import Optional

from shmkv.errors import ShmkvError
from shmkv.memory.block_io import FORMAT_VERSION, HEADER_SIZE, BlockFiles, NotRegular, open_regular
from shmkv.tiers.entry import Entry
from shmkv.tiers.specs import DiskTier, check_trusted_dir, check_writable

log = logging.getLogger(__name__)

NAMESPACE_FORMAT = "shmkv-disk-tier"

_LIVE_DISKS: "weakref.WeakSet[DiskStore]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    """A forked child must not keep a disk tier's lock alive after its parent stops."""
    for store in list(_LIVE_DISKS):
        store.forget_lock()
    _LIVE_DISKS.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


class DiskStore:
    """The disk tier's index and directory. Its block files are the :class:`BlockFiles`
    it holds (``files``), made here with the blocks folder (``blocks_dir``), this pool's
    namespace and its block shape: that object alone reads and writes block files (the
    copies and the scan call it; the tier I/O process and clients make their own from
    its :meth:`~BlockFiles.files_wire`)."""

    name = "disk"

    def __init__(self, spec: DiskTier, config, memory=None):
        self.path = spec.path
        self.capacity_bytes = spec.capacity_bytes
        # A quantized pool's blocks mean values only with its K/V scales: the namespace
        # holds the scales in force at open, and while the pool's differ from them the
        # tier neither serves nor stores (same_scales).
        self._scale_lock: Optional[memoryview] = None  # the pool's seqlock word and
        self._scales: Optional[memoryview] = None  # K/V scales (shmkv.memory.pool)
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
        self.blocks_dir = os.path.join(self.path, "blocks")
        self.files = BlockFiles(
            self.blocks_dir,
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
        self.file_nbytes = HEADER_SIZE + self.files.payload_nbytes
        self.disabled: Optional[str] = None
        self.scanning = False
        self.full_until = 0.0
        self.index: "OrderedDict[bytes, Entry]" = OrderedDict()
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
        check_writable(self.path, self.file_nbytes)
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
            "block_nbytes": self.files.payload_nbytes,
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
            tmp = f"{ns_path}.tmp-{self.files.session}"
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
