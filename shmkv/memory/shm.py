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
first touch. The pages it reserves are still cleared and mapped on first touch, about
3 us a 4 KiB page: :func:`populate` does that ahead (``MADV_POPULATE_WRITE``), and
:func:`create_huge_segment` makes a segment of huge pages instead (``memfd_create`` with
``MFD_HUGETLB``: it has no name at all, so nothing to sweep), where the administrator
reserved them (``vm.nr_hugepages``). Mappings are made by torch (``UntypedStorage.from_file`` on
``/proc/self/fd/N``), so the mapping lives exactly as long as a tensor view of it:
nothing here can unmap memory that a tensor still points to.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import re
import secrets
import stat
from typing import TYPE_CHECKING, List, Optional, Tuple

import posix_ipc

from shmkv.errors import InvalidArgument, ShmkvError

if TYPE_CHECKING:  # (imported where a tensor is made: not needed to sweep or size)
    import torch

log = logging.getLogger("shmkv.memory.shm")
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


def huge_pages() -> Tuple[int, int]:
    """``(free huge pages, bytes of one)`` of the default size, from ``/proc/meminfo``
    (``(0, 0)`` where the kernel has none)."""
    free = size = 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("HugePages_Free:"):
                    free = int(line.split()[1])
                elif line.startswith("Hugepagesize:"):
                    size = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return 0, 0
    return free, size


def create_huge_segment(nbytes: int, what: str = "pool") -> Tuple[Optional[int], str]:
    """A segment of huge pages (``memfd_create(MFD_HUGETLB)``), reserved whole now:
    ``(fd, "")``, or ``(None, why not)`` where none can be had (no reserved huge pages,
    too few free, no support). Its size is ``nbytes`` rounded up to a huge page: map it
    whole (:func:`segment_bytes`), since a huge-page mapping is unmapped in huge pages."""
    flag = getattr(os, "MFD_HUGETLB", None)
    if flag is None or not hasattr(os, "memfd_create"):
        return None, "this platform has no MFD_HUGETLB"
    free, page = huge_pages()
    if not page:
        return None, "this kernel has no huge pages"
    need = -(-max(nbytes, 1) // page)
    if need > free:
        return None, (
            f"the {what} needs {need} huge pages of {page >> 20} MiB and {free} are free "
            "(reserve them with sysctl vm.nr_hugepages)"
        )
    try:
        fd = os.memfd_create(f"shmkv-{what}", os.MFD_CLOEXEC | flag)
    except OSError as exc:
        return None, f"memfd_create(MFD_HUGETLB) failed: {exc.strerror}"
    try:
        os.ftruncate(fd, need * page)
        os.posix_fallocate(fd, 0, need * page)  # taken now, or ENOSPC: never SIGBUS later
    except OSError as exc:
        os.close(fd)
        return None, f"{need} huge pages could not be reserved ({exc.strerror})"
    return fd, ""


def segment_bytes(fd: int) -> int:
    """The size of a segment (a huge-page one is larger than what was asked)."""
    return os.fstat(fd).st_size


_MADV_POPULATE_READ, _MADV_POPULATE_WRITE = 22, 23  # Linux 5.14
_madvise = None


def populate(tensor: torch.Tensor, start: int, nbytes: int, write: bool) -> None:
    """Fault in bytes ``[start, start + nbytes)`` of a mapped uint8 tensor's memory:
    ``write``: as a first write would (the segment's pages are cleared and mapped here:
    the coordinator's populate), else as a read (this process's page tables only, for
    pages another process cleared: a worker's prefault, much cheaper). Neither changes
    a byte, so other processes may write meanwhile. ``start`` is a multiple of the page
    size. On a kernel without ``MADV_POPULATE_*``, reads one byte a page instead (which
    clears a page as a write would)."""
    global _madvise
    if _madvise is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise.restype = ctypes.c_int
        _madvise = libc.madvise
    advice = _MADV_POPULATE_WRITE if write else _MADV_POPULATE_READ
    if _madvise(tensor.data_ptr() + start, nbytes, advice) == 0:  # (the GIL is let go)
        return
    err = ctypes.get_errno()
    if err != errno.EINVAL:  # EINVAL: an older kernel, or a mapping it cannot populate
        raise OSError(err, os.strerror(err))
    tensor[start : start + nbytes : mmap.PAGESIZE].sum()


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
