"""The native decode kernel: built from C source on first use, loaded with ctypes.

Owns compiling ``csrc/paged_decode.c`` with the machine's C compiler into a cached
shared library, loading it, and :func:`paged_decode`, which calls it on torch
tensors. :mod:`shmkv.attention` uses it for decode steps on CPU (one query token per
sequence, float32): it reads each sequence's pages where they lie, once, instead of
gathering them into a copy and running SDPA over the copy.

Built once per machine and source: the library is named by a hash of the source, the
compiler, its flags and the CPU, in ``$SHMKV_CACHE_DIR`` (default
``$XDG_CACHE_HOME/shmkv``, else ``~/.cache/shmkv``), written under a temporary name and
renamed into place, so processes that build at once do not see each other's partial
files. Nothing is compiled at import: the first decode call builds (about half a
second) and later ones, in any process, load.

Optional by design: without a C compiler (``$CC``, else ``cc``, ``gcc``, ``clang``), when
the build fails, or with ``SHMKV_NATIVE=0`` in the environment, :func:`decoder`
returns None and attention takes its torch path. Why it failed is logged once
(logger ``shmkv.native``) and kept in :func:`status`.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import torch

log = logging.getLogger("shmkv.native")

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "paged_decode.c")
# Tried in order: the first set the compiler takes. -ffast-math lets the compiler use
# vector exp and reorder sums (results differ from SDPA's in the last bits, as SDPA's
# differ between its own kernels); the kernel keeps every value finite.
FLAG_SETS = (["-O3", "-march=native", "-ffast-math"], ["-O3", "-ffast-math"])
BUILD_TIMEOUT_S = 120.0
BAD_PAGE, NO_MEMORY = 1, 2
# Below this many (keys x heads x head_dim) a call runs on one thread: handing rows to
# other threads costs more than it saves.
_SPLIT_MIN_WORK = 1 << 21

_lock = threading.Lock()
_state = {"fn": None, "tried": False, "status": "not built yet"}
_pool: Optional[ThreadPoolExecutor] = None


def cache_dir() -> str:
    """Where built libraries are kept."""
    explicit = os.environ.get("SHMKV_CACHE_DIR")
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "shmkv")


def _compiler() -> Optional[str]:
    for name in ([os.environ["CC"]] if os.environ.get("CC") else []) + ["cc", "gcc", "clang"]:
        path = shutil.which(name)
        if path:
            return path
    return None


def _cpu_flags() -> str:
    """What -march=native depends on: the CPU's feature flags (Linux), else the machine."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def _build() -> tuple:
    """(the loaded function, None) or (None, why not)."""
    if os.environ.get("SHMKV_NATIVE", "1").strip().lower() in ("0", "false", "no", "off"):
        return None, "disabled by SHMKV_NATIVE"
    cc = _compiler()
    if cc is None:
        return None, "no C compiler found (set CC, or install cc/gcc/clang)"
    try:
        with open(SOURCE, "rb") as f:
            source = f.read()
        version = subprocess.run([cc, "--version"], capture_output=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"cannot read the kernel source or run {cc}: {exc}"
    directory = cache_dir()
    errors = []
    for flags in FLAG_SETS:
        digest = hashlib.sha256(b"\0".join([source, cc.encode(), version, " ".join(flags).encode(),
                                            platform.machine().encode(),
                                            _cpu_flags().encode()])).hexdigest()[:20]
        path = os.path.join(directory, f"paged_decode-{digest}.so")
        if not os.path.exists(path):
            try:
                os.makedirs(directory, exist_ok=True)
                fd, tmp = tempfile.mkstemp(prefix=".tmp-paged_decode-", suffix=".so",
                                           dir=directory)
                os.close(fd)
            except OSError as exc:
                return None, f"cannot write to the cache directory {directory}: {exc}"
            try:
                done = subprocess.run([cc, *flags, "-fPIC", "-shared", "-o", tmp, SOURCE, "-lm"],
                                      capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
                if done.returncode != 0:
                    errors.append(f"{' '.join(flags)}: {done.stderr.strip()[-400:]}")
                    continue
                os.replace(tmp, path)
            except (OSError, subprocess.SubprocessError) as exc:
                errors.append(f"{' '.join(flags)}: {exc}")
                continue
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        try:
            fn = ctypes.CDLL(path).shmkv_paged_decode_f32
        except (OSError, AttributeError) as exc:
            errors.append(f"loading {path}: {exc}")
            continue
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        fn.argtypes = [p, p, p, i64, i64, p, i64, p, i64, i64, i64, i64, i64, ctypes.c_float, p]
        fn.restype = ctypes.c_int
        return fn, None
    return None, f"building with {cc} failed: " + "; ".join(errors)


def decoder():
    """The loaded kernel, or None when it is not available (see :func:`status`). Builds
    or loads it on the first call; later calls return what that one found."""
    if _state["tried"]:
        return _state["fn"]
    with _lock:
        if not _state["tried"]:
            fn, why = _build()
            _state["fn"] = fn
            _state["status"] = "loaded" if fn is not None else why
            if fn is None and why != "disabled by SHMKV_NATIVE":
                log.warning("shmkv: the native decode kernel is not available, attention takes "
                            "its torch path: %s", why)
            _state["tried"] = True
    return _state["fn"]


def status() -> str:
    """``"loaded"``, ``"not built yet"``, or why the kernel is not available."""
    return _state["status"]


def usable(query: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor) -> bool:
    """Whether :func:`paged_decode` takes these tensors: float32 on the CPU, pages whose
    every page is one contiguous ``[block_size, kv_heads, head_dim]`` chunk, K and V
    pages alike."""
    return (query.dtype == k_pages.dtype == v_pages.dtype == torch.float32
            and query.device.type == k_pages.device.type == v_pages.device.type == "cpu"
            and k_pages.stride() == v_pages.stride()
            and k_pages.stride()[1:] == (k_pages.shape[2] * k_pages.shape[3], k_pages.shape[3], 1))


def paged_decode(fn, query: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                 table: torch.Tensor, lens: torch.Tensor, scale: float,
                 out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One query token per sequence against its pages: ``query`` holds ``[rows, heads,
    head_dim]`` float32 elements in that order; ``table`` is ``[rows, >= pages]`` int32
    contiguous, ``lens`` ``[rows]`` int64 (keys of each row; 0 gives zeros). Returns
    ``[rows, heads, head_dim]`` (into ``out`` when given, contiguous). The caller
    checked :func:`usable`.

    Raises:
        IndexError: a table entry names a page outside ``k_pages`` (``out`` may then
            hold part of the result).
    """
    num_pages, block_size, kv_heads, head_dim = k_pages.shape
    rows = lens.shape[0]
    q = query.contiguous()
    heads = q.numel() // (rows * head_dim)
    if out is None:
        out = torch.empty((rows, heads, head_dim), dtype=torch.float32)
    k_base, v_base = k_pages.data_ptr(), v_pages.data_ptr()
    stride, row_stride = k_pages.stride(0), table.stride(0)
    row_bytes = heads * head_dim * 4

    def run(lo: int, hi: int) -> int:
        return fn(q.data_ptr() + lo * row_bytes, k_base, v_base, stride, num_pages,
                  table.data_ptr() + lo * row_stride * 4, row_stride,
                  lens.data_ptr() + lo * 8, hi - lo, heads, kv_heads, head_dim, block_size,
                  scale, out.data_ptr() + lo * row_bytes)

    threads = min(torch.get_num_threads(), rows)
    if threads > 1 and int(lens.sum()) * heads * head_dim >= _SPLIT_MIN_WORK:
        # The kernel runs without the GIL (ctypes releases it): rows split over threads.
        bounds = [rows * i // threads for i in range(threads + 1)]
        futures = [_executor().submit(run, lo, hi) for lo, hi in zip(bounds, bounds[1:-1])]
        codes = [run(bounds[-2], bounds[-1])] + [f.result() for f in futures]
    else:
        codes = [run(0, rows)]
    if any(codes):
        if NO_MEMORY in codes:
            raise MemoryError("the native decode kernel could not allocate its scratch memory")
        raise IndexError(f"a block table entry is not a page id in [0, {num_pages})")
    return out


def _forget_pool() -> None:
    global _pool
    _pool = None   # a forked child has none of its parent's threads


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def _executor() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        with _lock:
            if _pool is None:
                _pool = ThreadPoolExecutor(max(1, (os.cpu_count() or 2) - 1),
                                           thread_name_prefix="shmkv-decode")
    return _pool
