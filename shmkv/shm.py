"""CPU memory backend: POSIX shared-memory segments passed by file descriptor.

Owns creating, sizing, mapping and sweeping the segments that hold a CPU pool and
the small metadata array workers read. Does not decide what goes in them.

Lifetime: a segment is created ``O_CREAT | O_EXCL`` with mode 0600 under a name
that carries the owner's pid, and unlinked *immediately*, before it is sized. From
then on it exists only as open file descriptors and mappings: the coordinator
passes the descriptor to each worker over the Unix socket (``SCM_RIGHTS``), and the
kernel frees the memory when the last process holding it exits, however it exits.
No ``/dev/shm`` entry can outlive even a SIGKILLed coordinator, except for the few
microseconds between create and unlink; :func:`sweep_stale` removes entries of
dead owners of this uid at the next start to close that window too (never another
user's entry, and never failing a start).

Sizing uses ``posix_fallocate`` after a free-space check, so a pool larger than
``/dev/shm`` can hold fails with a clear error at creation instead of SIGBUS on
first touch. Mappings are made by torch (``UntypedStorage.from_file`` on
``/proc/self/fd/N``), so the mapping lives exactly as long as a tensor view of it:
nothing here can unmap memory that a tensor still points to.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import re
import secrets
import stat
from typing import TYPE_CHECKING, List

import posix_ipc

from .errors import InvalidArgument, ShmkvError

if TYPE_CHECKING:  # (imported where a tensor is made: not needed to sweep or size)
    import torch

log = logging.getLogger("shmkv.shm")
SHM_DIR = "/dev/shm"
_NAME_RE = re.compile(r"^shmkv-(\d+)-[0-9a-f]+$")


def shm_free_bytes(path: str = SHM_DIR) -> int:
    """Bytes an unprivileged user can still allocate on the shared-memory filesystem."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale() -> List[str]:
    """Unlink segments named by a shmkv process of this uid that no longer exists;
    returns the names.

    An entry of another uid is never touched (``/dev/shm`` is writable by every user,
    so anyone can plant a name that looks like ours), and no entry's error stops the
    sweep: it only ever closes the window described in the module docstring, so a
    coordinator starts whatever lies in ``/dev/shm``.
    """
    removed: List[str] = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    uid, pid = os.getuid(), os.getpid()
    for name in names:
        match = _NAME_RE.match(name)
        if not match or int(match.group(1)) == pid or _pid_alive(int(match.group(1))):
            continue
        try:
            st = os.lstat(os.path.join(SHM_DIR, name))
            if st.st_uid != uid or not stat.S_ISREG(st.st_mode):
                continue  # someone else's (or not a segment): not ours to remove
            posix_ipc.unlink_shared_memory("/" + name)
            removed.append(name)
        except (OSError, posix_ipc.Error) as exc:
            log.debug("left %s/%s in place: %s", SHM_DIR, name, exc)
    return removed


def create_segment(nbytes: int, what: str = "pool") -> int:
    """Create an anonymous (already unlinked) shared-memory segment; returns its fd.

    Raises:
        InvalidArgument: the segment cannot fit in the free space of ``/dev/shm``.
    """
    free = shm_free_bytes()
    if nbytes > free:
        raise InvalidArgument(
            f"{what} of {nbytes / 2**20:.1f} MiB does not fit in {SHM_DIR}: "
            f"{free / 2**20:.1f} MiB free; lower num_blocks or enlarge {SHM_DIR}"
        )
    name = f"/shmkv-{os.getpid()}-{secrets.token_hex(8)}"
    segment = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600)
    fd = segment.fd
    try:
        posix_ipc.unlink_shared_memory(name)
        os.posix_fallocate(fd, 0, max(nbytes, 1))
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
            raise InvalidArgument(
                f"{what} of {nbytes / 2**20:.1f} MiB could not be reserved in {SHM_DIR} "
                f"({exc.strerror}); lower num_blocks or free shared memory"
            ) from None
        raise ShmkvError(f"could not size the {what} segment: {exc}") from exc
    except BaseException:
        os.close(fd)
        raise
    return fd


def map_tensor(fd: int, nbytes: int) -> torch.Tensor:
    """A writable uint8 tensor over the segment; the mapping lives as long as the tensor."""
    import torch

    if os.fstat(fd).st_size < nbytes:
        raise ShmkvError(f"shared segment is {os.fstat(fd).st_size} bytes, expected {nbytes}")
    storage = torch.UntypedStorage.from_file(f"/proc/self/fd/{fd}", shared=True, nbytes=nbytes)
    # (torch types from_file as any storage kind; UntypedStorage's returns an UntypedStorage)
    assert isinstance(storage, torch.UntypedStorage)
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def map_bytes(fd: int, nbytes: int, writable: bool) -> mmap.mmap:
    """Map a metadata segment (read-only unless ``writable``).

    The caller releases every memoryview of it before closing the mmap.
    """
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    return mmap.mmap(fd, nbytes, mmap.MAP_SHARED, prot)
