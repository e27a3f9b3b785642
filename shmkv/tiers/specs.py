"""What a coordinator's ``tiers=`` list may hold, checked before anything opens.

Owns the tier specs (:class:`HostTier`, :class:`DiskTier`), sizes (:func:`parse_size`),
the checks of a ``tiers=`` list (:func:`check_specs`) and of a disk tier's directory
(:func:`check_trusted_dir`, ``check_writable``: whom it trusts, whether it can be
written). Opens no tier (``shmkv.tiers.host_store``, ``shmkv.tiers.disk_store``).
Imports only ``shmkv.errors`` and ``shmkv.memory.block_io`` (how a file is opened safely).
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import stat

from shmkv.errors import InvalidArgument, ShmkvError, WrongType
from shmkv.memory.block_io import open_regular

_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?)\s*([kmgtp]?)(i?b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}


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


def check_writable(path: str, need: int) -> None:
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
        fsync: fsync each file before it is renamed into place (see ``shmkv.tiers``).

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
    x86 every block on its way to disk; see ``shmkv.tiers``).

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
        check_writable(self.path, 1)

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
