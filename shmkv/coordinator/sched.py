"""The CPU time slice a thread asks the scheduler for (Linux, EEVDF: kernel 6.12 and later).

Owns reading and setting a thread's requested slice (``sched_attr.sched_runtime`` of a
``SCHED_OTHER`` thread, through ``sched_setattr``/``sched_getattr``). The coordinator's
loop asks for a short one (``Coordinator(loop_slice_us=...)``): the scheduler then picks
it ahead of threads with the default slice (an earlier virtual deadline), so a client it
has just answered, woken onto the loop's CPU, no longer takes that CPU from it until the
client blocks again. It is a latency hint, not a priority: the thread's share of the CPU
(its nice weight) is unchanged, and no privilege is needed. The kernel clamps a request to
[``MIN_SLICE_NS``, ``MAX_SLICE_NS``].

Where the kernel has no such request (before 6.12, another system, a seccomp filter that
refuses the call), :func:`set_thread_slice` changes nothing and returns None.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform
import struct
from typing import Optional

log = logging.getLogger("shmkv.coordinator.sched")

MIN_SLICE_NS = 100_000  # the kernel's bounds on a requested slice
MAX_SLICE_NS = 100_000_000
# struct sched_attr, SCHED_ATTR_SIZE_VER1: size, policy, flags, nice, priority, runtime,
# deadline, period, util_min, util_max.
_ATTR = struct.Struct("IIqiIQQQII")
_SCHED_OTHER = 0
_RESET_ON_FORK = 0x01  # sched_flags: what the thread starts gets the kernel's defaults
# sched_setattr / sched_getattr syscall numbers by machine (no libc wrapper before glibc 2.41)
_SYSCALLS = {
    "x86_64": (314, 315),
    "aarch64": (274, 275),
    "riscv64": (274, 275),
    "ppc64le": (355, 356),
}
_libc = None


def _syscall(number: int, tid: int, attr, *flags: int) -> int:
    """``syscall(number, tid, attr, *flags)``: 0, or the errno. Every integer goes as a
    C long: syscall(2) is variadic and reads each argument as one."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    args = [ctypes.c_long(number), ctypes.c_long(tid), attr]
    if _libc.syscall(*args, *(ctypes.c_long(flag) for flag in flags)) == 0:
        return 0
    return ctypes.get_errno() or -1


def _numbers() -> Optional[tuple]:
    if not hasattr(os, "sched_setscheduler"):  # not Linux
        return None
    return _SYSCALLS.get(platform.machine())


def _attr(tid: int) -> Optional[tuple]:
    numbers = _numbers()
    if numbers is None:
        return None
    buf = ctypes.create_string_buffer(_ATTR.size)
    if _syscall(numbers[1], tid, buf, _ATTR.size, 0):
        return None
    return _ATTR.unpack(buf.raw)


def thread_slice(tid: int = 0) -> Optional[int]:
    """The slice (ns) in effect for thread ``tid`` (0: the calling thread): the one it
    asked for, else the kernel's default. None where it cannot be read or the thread
    is not a ``SCHED_OTHER`` one."""
    attr = _attr(tid)
    return attr[5] if attr is not None and attr[1] == _SCHED_OTHER else None


def slice_inherited(tid: int = 0) -> Optional[bool]:
    """Whether the threads and processes thread ``tid`` starts get its slice too (they do
    unless it has the reset-on-fork flag); None where it cannot be read."""
    attr = _attr(tid)
    return None if attr is None else not attr[2] & _RESET_ON_FORK


def set_thread_slice(slice_ns: int, inherit: Optional[bool] = None) -> Optional[int]:
    """Ask for a slice of ``slice_ns`` for the calling thread (0: the kernel's default),
    keeping its nice value. ``inherit``: whether the threads and processes it starts later
    get that slice too (False sets its reset-on-fork flag: they start with the kernel's
    default slice, and a negative nice value is not passed on either; True clears the
    flag; None keeps it as it was). Returns the slice now in effect (the kernel clamps
    it), or None when the kernel keeps no such request (nothing was changed then; logged
    at DEBUG with why)."""
    numbers, attr = _numbers(), _attr(0)
    if numbers is None or attr is None or attr[1] != _SCHED_OTHER:
        log.debug(
            "no per-thread slice here (%s %s, or not a SCHED_OTHER thread)",
            platform.system(),
            platform.release(),
        )
        return None
    flags = attr[2] & _RESET_ON_FORK if inherit is None else (0 if inherit else _RESET_ON_FORK)
    request = ctypes.create_string_buffer(
        _ATTR.pack(_ATTR.size, _SCHED_OTHER, flags, attr[3], 0, slice_ns, 0, 0, 0, 0),
        _ATTR.size,
    )
    err = _syscall(numbers[0], 0, request, 0)
    if err:
        log.debug("sched_setattr refused a slice of %d ns: %s", slice_ns, os.strerror(err))
        return None
    now = thread_slice()
    if slice_ns and not now:  # accepted, but this kernel keeps no slice (before 6.12)
        log.debug("this kernel keeps no per-thread slice (%s)", platform.release())
        return None
    return now
