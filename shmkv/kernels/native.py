"""Native code: C built with the package, loaded with ctypes.

Owns finding and loading the shared libraries built from ``csrc/`` when shmkv was
installed, and the calls into the decode kernel. Two libraries:

* the decode kernel (``csrc/paged_decode.c``; :func:`decoder`, and :func:`paged_decode`,
  which calls it on torch tensors). :mod:`shmkv.kernels.attention` uses it for decode steps on
  CPU (one query token per sequence, float32, bfloat16 or float16): it reads each
  sequence's pages where they lie, once, instead of gathering them into a copy and
  running SDPA over the copy;
* the tiers' row copy (``csrc/copy_rows.c``; :func:`copier`): block copies between the
  pool and the host tier with stores that go past the caches
  (:class:`shmkv.memory.block_io.RowCopy`), in a client that copies its own promotions, in the
  coordinator's threads and in the tier I/O process, which loads the same file by its
  path (:func:`library_path`).

Built when the package is built, never at run time: ``setup.py`` declares each C file
a setuptools ``Extension`` (``optional=True``), so ``pip install`` compiles them with
the C compiler Python was built with (``$CC`` overrides it), and ``pip install -e .``
(which ``make test`` runs through ``scripts/setup.sh``) builds them in place, next to
this file. setuptools rather than scikit-build-core or meson-python: the package
already builds with setuptools, the sources are two small C files with no dependencies,
and users need no CMake or meson (only a C compiler, and not even that: see below).
The libraries are plain C (no Python C API), named as extension modules are
(``_paged_decode`` and ``_copy_rows`` with the interpreter's extension suffix) and
loaded from this file's directory: installed with the package, they are trusted as its
Python files are.

Compiled for the compiler's baseline, never for the building machine's CPU
(``-march=native``): the C picks its AVX2 or AVX-512 code at run time from what the CPU
reports (:func:`isa`), so one build runs on any x86-64, and on aarch64 (which builds
the portable code alone).

Optional by design: where the package was built without a C compiler (or the build
failed), or with ``SHMKV_NATIVE=0`` in the environment, :func:`decoder` returns None and
attention takes its torch path, and :func:`copier` returns None and the tiers copy with
numpy. Why is logged once (logger ``shmkv.kernels.native``), kept in :func:`status` /
:func:`copy_status`, and shown by ``shmkv stats`` (:func:`report`).
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, NamedTuple, Optional, Tuple, TypedDict

import torch

log = logging.getLogger("shmkv.kernels.native")

# Where the build puts the libraries: beside this file (site-packages/shmkv, or the
# checkout's shmkv/ for an editable install).
LIBRARY_DIR = os.path.dirname(os.path.abspath(__file__))
# The decode kernel's instances, narrowest first: the CPU runs those up to the one
# :func:`isa` names.
ISAS = ("portable", "avx2", "avx512")
BAD_PAGE, NO_MEMORY = 1, 2
# Below this many (keys x heads x head_dim) a call runs on one thread: handing rows to
# other threads costs more than it saves.
_SPLIT_MIN_WORK = 1 << 21

# Page ids go to the kernel as int32.
_MAX_PAGES = (1 << 31) - 1

_lock = threading.Lock()


class _State(TypedDict):
    """What :func:`decoder` or :func:`copier` found (written once, under ``_lock``)."""

    fn: Any  # what the library's ``bind`` made of it; None: not (yet) available
    isa: Optional[str]  # the instruction set it runs
    tried: bool
    status: str  # what status() / copy_status() return


def _new_state() -> _State:
    return {"fn": None, "isa": None, "tried": False, "status": "not loaded yet"}


_state: _State = _new_state()
_copy_state: _State = _new_state()
_pool: Optional[ThreadPoolExecutor] = None


def library_path(name: str) -> Optional[str]:
    """The built library ``name`` (``"_paged_decode"``, ``"_copy_rows"``) in
    :data:`LIBRARY_DIR`, or None when the package was built without it."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = os.path.join(LIBRARY_DIR, name + suffix)
        if os.path.isfile(path):
            return path
    return None


def _disabled() -> bool:
    return os.environ.get("SHMKV_NATIVE", "1").strip().lower() in ("0", "false", "no", "off")


def _load(lib: "_Library") -> tuple:
    """``(what lib.bind made of the loaded library, the instruction set it runs, None)``,
    or ``(None, None, why not)``."""
    if _disabled():
        return None, None, "disabled by SHMKV_NATIVE"
    path = library_path(lib.name)
    if path is None:
        return (
            None,
            None,
            f"not built: no {lib.name}{importlib.machinery.EXTENSION_SUFFIXES[0]} in "
            f"{LIBRARY_DIR} (shmkv was installed without a C compiler, or the build "
            "failed); install a C compiler (cc) and reinstall shmkv (in a checkout: "
            "pip install -e .)",
        )
    try:
        fn, isa = lib.bind(path)
    except (OSError, AttributeError) as exc:
        return None, None, f"cannot load {path}: {exc}"
    return fn, isa, None


def _decode_library(path: str) -> Tuple[ctypes.CDLL, str]:
    lib = ctypes.CDLL(path)
    chosen = lib.shmkv_paged_decode_isa
    chosen.argtypes, chosen.restype = [], ctypes.c_char_p
    return lib, chosen().decode()


def _bind_decode(path: str, isa: Optional[str] = None) -> Tuple[dict, str]:
    lib, chosen = _decode_library(path)
    suffix = "" if isa is None else "_" + isa
    kernels = {
        torch.float32: getattr(lib, "shmkv_paged_decode_f32" + suffix),
        torch.bfloat16: getattr(lib, "shmkv_paged_decode_bf16" + suffix),
        torch.float16: getattr(lib, "shmkv_paged_decode_f16" + suffix),
    }
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    for fn in kernels.values():
        fn.argtypes = [p, p, p, i64, i64, p, i64, p, i64, i64, i64, i64, i64, ctypes.c_float, p]
        fn.restype = ctypes.c_int
    return kernels, chosen if isa is None else isa


def _bind_copy(path: str) -> Tuple[Any, str]:
    from shmkv.memory.block_io import RowCopy

    copy = RowCopy(path)
    return copy, copy.isa


class _Library(NamedTuple):
    """One library built from one source: ``name`` is its file's (without the extension
    suffix), ``title`` names it in messages; ``bind`` loads the file at a path and makes
    what callers get of it, with the instruction set it runs (and raises OSError or
    AttributeError where it cannot); ``without`` says what takes its place when it is not
    available."""

    name: str
    title: str
    bind: Callable[[str], Tuple[Any, str]]
    without: str


DECODE = _Library(
    "_paged_decode", "native decode kernel", _bind_decode, "attention takes its torch path"
)
COPY = _Library("_copy_rows", "native row copy", _bind_copy, "the tiers copy with numpy")


def _get(lib: _Library, state: _State) -> Any:
    """What ``lib`` gives (loaded on the first call), or None."""
    if state["tried"]:
        return state["fn"]
    with _lock:
        if not state["tried"]:
            fn, isa, why = _load(lib)
            state["fn"], state["isa"] = fn, isa
            state["status"] = "loaded" if fn is not None else why
            if fn is None and why != "disabled by SHMKV_NATIVE":
                log.warning("shmkv: the %s is not available, %s: %s", lib.title, lib.without, why)
            state["tried"] = True
    return state["fn"]


def decoder() -> Optional[dict]:
    """The loaded kernels, ``{dtype: fn}`` for each of :data:`DTYPES`, or None when
    they are not available (see :func:`status`). Loads them on the first call; later
    calls return what that one found."""
    return _get(DECODE, _state)


def status() -> str:
    """``"loaded"``, ``"not loaded yet"``, or why the decode kernel is not available."""
    return _state["status"]


def isa() -> Optional[str]:
    """The instance of the decode kernel :func:`decoder`'s kernels run, the widest this
    CPU supports: ``"avx512"``, ``"avx2"`` (with FMA and F16C) or ``"portable"``; None
    when they are not loaded (yet)."""
    return _state["isa"]


def isa_kernels(name: str) -> dict:
    """The decode kernels of one instance (one of :data:`ISAS`, up to :func:`isa`),
    ``{dtype: fn}`` as :func:`decoder`'s, whichever this CPU would choose: for the
    tests and benchmarks that compare them.

    Raises:
        LookupError: the kernel is not available (see :func:`status`).
        ValueError: an instance this CPU cannot run, or not one of :data:`ISAS`.
    """
    if decoder() is None:
        raise LookupError(f"the native decode kernel is not available: {status()}")
    chosen = _state["isa"]
    runs = ISAS[: ISAS.index(chosen) + 1] if chosen in ISAS else ()
    if name not in runs:
        raise ValueError(
            f"no decode kernel instance {name!r}: this CPU runs the {', '.join(runs)} ones"
        )
    path = library_path(DECODE.name)
    assert path is not None  # (decoder() loaded it)
    return _bind_decode(path, name)[0]


def copier() -> Optional[Any]:
    """The tiers' row copy (:class:`shmkv.memory.block_io.RowCopy`), or None when it is not
    available (see :func:`copy_status`): the tiers then copy with numpy. Loads it on
    the first call; later calls return what that one found."""
    return _get(COPY, _copy_state)


def copy_status() -> str:
    """``"loaded"``, ``"not loaded yet"``, or why the row copy is not available."""
    return _copy_state["status"]


def report() -> Dict[str, str]:
    """The native code of this installation, as ``shmkv stats`` shows it (loading each
    library not tried yet): ``{"decode": ..., "row_copy": ...}``, each ``"loaded
    (ISA)"`` or why it is not available (then the torch path or numpy's copy runs)."""
    decoder(), copier()
    return {
        name: f"loaded ({state['isa']})" if state["fn"] is not None else state["status"]
        for name, state in (("decode", _state), ("row_copy", _copy_state))
    }


DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def usable(query: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor) -> bool:
    """Whether :func:`paged_decode` takes these tensors: float32, bfloat16 or float16
    (all three alike) on the CPU, pages whose every page is one contiguous
    ``[block_size, kv_heads, head_dim]`` chunk, K and V pages alike."""
    return (
        query.dtype == k_pages.dtype == v_pages.dtype
        and query.dtype in DTYPES
        and k_pages.shape[0] <= _MAX_PAGES
        and query.device.type == k_pages.device.type == v_pages.device.type == "cpu"
        and k_pages.stride() == v_pages.stride()
        and k_pages.stride()[1:] == (k_pages.shape[2] * k_pages.shape[3], k_pages.shape[3], 1)
    )


def paged_decode(
    kernels: dict,
    query: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    table: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """One query token per sequence against its pages, with the ``kernels`` of
    :func:`decoder`: ``query`` holds ``[rows, heads, head_dim]`` elements in that order
    (any shape); ``table`` is ``[rows, >= pages of the longest row]`` int32, ``lens``
    ``[rows]`` int64 (keys of each row; 0 gives zeros). Returns ``[rows, heads,
    head_dim]`` in the query's dtype (into ``out`` when given, contiguous, of that shape
    and dtype). Scores, softmax and sums are float32 whatever the dtype.

    Raises:
        ValueError / TypeError: tensors the kernel does not take (see :func:`usable`),
            shapes that disagree, a table too short for a length.
        IndexError: a table entry names a page outside ``k_pages`` (``out`` may then
            hold part of the result).
    """
    if not usable(query, k_pages, v_pages) or k_pages.shape != v_pages.shape:
        raise TypeError(
            "the native kernel takes float32, bfloat16 or float16 CPU tensors "
            "(one dtype), pages of one contiguous [block_size, kv_heads, "
            "head_dim] chunk each, K and V alike"
        )
    num_pages, block_size, kv_heads, head_dim = k_pages.shape
    if (
        lens.dtype != torch.int64
        or lens.dim() != 1
        or table.dtype != torch.int32
        or table.dim() != 2
        or table.shape[0] != lens.shape[0]
    ):
        raise TypeError("lens must be [rows] int64 and table [rows, pages] int32")
    rows = lens.shape[0]
    if rows == 0 or query.numel() % (rows * head_dim):
        raise ValueError(
            f"query has {query.numel()} elements, not rows x heads x {head_dim} for {rows} rows"
        )
    heads = query.numel() // (rows * head_dim)
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads is not a multiple of {kv_heads} K/V heads")
    table, lens = table.contiguous(), lens.contiguous()
    if bool((lens < 0).any()) or -(-int(lens.max()) // block_size) > table.shape[1]:
        raise ValueError(
            f"lens {lens.tolist()} need more pages than the table's "
            f"{table.shape[1]} (or are negative)"
        )
    q = query.reshape(rows, heads, head_dim).contiguous()
    if out is None:
        out = torch.empty((rows, heads, head_dim), dtype=q.dtype)
    elif (
        out.shape != (rows, heads, head_dim)
        or out.dtype != q.dtype
        or not out.is_contiguous()
        or out.device.type != "cpu"
    ):
        raise ValueError(f"out must be contiguous {q.dtype} [{rows}, {heads}, {head_dim}]")
    return run_checked(kernels, q, k_pages, v_pages, table, lens, lens.tolist(), scale, out)


def run_checked(
    kernels: dict,
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    table: torch.Tensor,
    lens: torch.Tensor,
    keys: list,
    scale: float,
    out: torch.Tensor,
) -> torch.Tensor:
    """:func:`paged_decode` of arguments already checked (a plan's): ``q`` and ``out``
    contiguous ``[rows, heads, head_dim]`` of the pages' dtype, ``table`` contiguous
    int32 wide enough, ``lens`` contiguous int64 and ``keys`` the same lengths as a
    list."""
    fn = kernels[q.dtype]
    num_pages, block_size, kv_heads, head_dim = k_pages.shape
    rows, heads = q.shape[0], q.shape[1]
    k_base, v_base = k_pages.data_ptr(), v_pages.data_ptr()
    stride, row_stride = k_pages.stride(0), table.stride(0)
    row_bytes = heads * head_dim * q.element_size()

    def run(lo: int, hi: int) -> int:
        return fn(
            q.data_ptr() + lo * row_bytes,
            k_base,
            v_base,
            stride,
            num_pages,
            table.data_ptr() + lo * row_stride * 4,
            row_stride,
            lens.data_ptr() + lo * 8,
            hi - lo,
            heads,
            kv_heads,
            head_dim,
            block_size,
            scale,
            out.data_ptr() + lo * row_bytes,
        )

    threads = min(torch.get_num_threads(), rows)
    total = sum(keys) if threads > 1 else 0
    if total * heads * head_dim >= _SPLIT_MIN_WORK:
        # The kernel runs without the GIL (ctypes releases it): rows split over threads,
        # about as many keys each.
        bounds, seen = [0], 0
        for row, n in enumerate(keys):
            seen += n
            if len(bounds) < threads and seen * threads >= total * len(bounds):
                bounds.append(row + 1)
        if bounds[-1] != rows:
            bounds.append(rows)
        spans = list(zip(bounds, bounds[1:]))
        futures = [_executor().submit(run, lo, hi) for lo, hi in spans[:-1]]
        codes = [run(*spans[-1])] + [f.result() for f in futures]
    else:
        codes = [run(0, rows)]
    if any(codes):
        if NO_MEMORY in codes:
            raise MemoryError("the native decode kernel could not allocate its scratch memory")
        raise IndexError(f"a block table entry is not a page id in [0, {num_pages})")
    return out


def _after_fork() -> None:
    # A forked child has none of its parent's threads: no pool, and no thread that
    # could release a lock held at the fork.
    global _pool, _lock
    _pool = None
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


def _executor() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        with _lock:
            if _pool is None:
                _pool = ThreadPoolExecutor(
                    max(1, (os.cpu_count() or 2) - 1), thread_name_prefix="shmkv-decode"
                )
    return _pool
