"""Native code: built from C source on first use, loaded with ctypes.

Owns compiling the C sources in ``csrc/`` with the machine's C compiler into cached
shared libraries, and loading them. Two libraries, built and trusted alike:

* the decode kernel (``csrc/paged_decode.c``; :func:`decoder`, and
  :func:`paged_decode`, which calls it on torch tensors). :mod:`shmkv.attention` uses it
  for decode steps on CPU (one query token per sequence, float32, bfloat16 or float16):
  it reads each sequence's pages where they lie, once, instead of gathering them into a
  copy and running SDPA over the copy;
* the tiers' row copy (``csrc/copy_rows.c``; :func:`copier`): block copies between the
  pool and the host tier with stores that go past the caches
  (:class:`shmkv.tier_io.RowCopy`), in a client that copies its own promotions and in
  the tier I/O process, which loads the library the coordinator checked through the
  descriptor it inherits (``RowCopy.fd``).

Built once per machine and source: a library is named by a hash of its source, the
compiler, its flags and the CPU, in :func:`cache_dir` (``$SHMKV_CACHE_DIR``, default
``$XDG_CACHE_HOME/shmkv``, else ``~/.cache/shmkv``), written under a temporary name and
renamed into place, so processes that build at once do not see each other's partial
files. Nothing is compiled at import: a library is built by its first use (about
half a second for the decode kernel: the first decode call; for the row copy: a
coordinator starting with tiers over a CPU pool, or a client's first promotion it
copies), and later uses, in any process, load it.

Only a library this user built is ever loaded: loading runs its code (constructors run
at ``dlopen``, before any symbol is looked up), and its name is a hash anyone on the
machine can work out. So the cache directory is used only when it is a real directory
(not a symbolic link) owned by this user and writable by no one else (created 0700,
whatever the umask); a library in it is opened without following links and checked on
the open descriptor (a regular file, owned by this user, writable by no one else), then
loaded through that descriptor (``/proc/self/fd/N``), so nothing can be swapped in
between the check and the load. A library that fails the check is rebuilt in its
place; a directory that fails it is not used, and the kernel is built in a fresh
private directory instead (removed once loaded). Each refusal is logged, with why.

Optional by design: without a C compiler (``$CC``, else ``cc``, ``gcc``, ``clang``), when
the build fails, or with ``SHMKV_NATIVE=0`` in the environment, :func:`decoder`
returns None and attention takes its torch path, and :func:`copier` returns None and
the tiers copy with numpy. Why it failed is logged once (logger ``shmkv.native``) and
kept in :func:`status` / :func:`copy_status`.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import logging
import os
import platform
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, List, NamedTuple, Optional, TypedDict

import torch

log = logging.getLogger("shmkv.native")

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "paged_decode.c")
COPY_SOURCE = os.path.join(os.path.dirname(SOURCE), "copy_rows.c")
# Tried in order: the first set the compiler takes. -ffast-math lets the compiler use
# vector exp and reorder sums (results differ from SDPA's in the last bits, as SDPA's
# differ between its own kernels); the kernel keeps every value finite.
FLAG_SETS = (["-O3", "-march=native", "-ffast-math"], ["-O3", "-ffast-math"])
# The row copy: the CPU's widest streaming stores, else the baseline's (SSE2 on x86-64).
COPY_FLAG_SETS = (["-O2", "-march=native"], ["-O2"])
# Part of the library's name: a build whose output is made differently gets a new name.
BUILD_KIND = "c-then-link-v2"
BUILD_TIMEOUT_S = 60.0
# A built library no process loaded for this long goes when another is built.
PRUNE_AFTER_S = 30 * 86400.0
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
    tried: bool
    status: str  # what status() / copy_status() return


def _new_state() -> _State:
    return {"fn": None, "tried": False, "status": "not built yet"}


_state: _State = _new_state()
_copy_state: _State = _new_state()
_pool: Optional[ThreadPoolExecutor] = None


class UntrustedLibrary(PermissionError):
    """A library or cache directory refused because another user could have written it
    (wrong owner, group or others may write, a symbolic link, not a regular file)."""


# Where this process's open descriptors can be named for dlopen (Linux). Without it
# libraries are only loaded from a fresh private directory made for the build.
_FD_DIR = "/proc/self/fd"
# Descriptors of the loaded libraries, kept open: the loader knows a library by the name
# it was opened with (/proc/self/fd/N), and would hand back the first one for a later
# library opened under a reused N.
_loaded_fds: List[int] = []


def _untrusted(info: os.stat_result, directory: bool) -> Optional[str]:
    """Why a file or directory of this ``lstat``/``fstat`` result could hold another
    user's code, or None when only this user can have written it."""
    if stat.S_ISLNK(info.st_mode):
        return "is a symbolic link"
    if directory and not stat.S_ISDIR(info.st_mode):
        return "is not a directory"
    if not directory and not stat.S_ISREG(info.st_mode):
        return "is not a regular file"
    if info.st_uid != os.geteuid():
        return f"is owned by uid {info.st_uid}, not by this user (uid {os.geteuid()})"
    if info.st_mode & 0o022:
        return (
            f"can be written by its group or others (mode "
            f"{stat.S_IMODE(info.st_mode):o}; chmod go-w it, or remove it)"
        )
    return None


def _make_dirs(path: str) -> None:
    """Create ``path`` and missing parents, each 0700 whatever the umask (mkdir's mode is
    cut by the umask; a umask of 000 would otherwise leave nothing cut from 0777)."""
    parent = os.path.dirname(path)
    if parent and parent != path and not os.path.lexists(parent):
        _make_dirs(parent)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        return
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        os.fchmod(fd, 0o700)
    finally:
        os.close(fd)


def _private_dir(path: str) -> tuple:
    """``(None, False)`` when ``path`` is (made, if missing) a directory only this user
    can write: not a link, owned by this user, not writable by group or others, writable
    by this user. Else ``(why not, whether someone else could write it)``."""
    try:
        _make_dirs(path)
        why = _untrusted(os.lstat(path), directory=True)
    except OSError as exc:
        return f"cannot be created or read ({exc})", False
    if why is not None:
        return why, True
    if not os.access(path, os.W_OK | os.X_OK):
        return "cannot be written by this user", False
    return None, False


def cache_dir() -> Optional[str]:
    """Where built libraries are kept, or None when no directory may be used (the kernel
    is then built in a fresh private directory, removed once loaded).

    ``$SHMKV_CACHE_DIR`` when set, else the user's cache directory
    (``$XDG_CACHE_HOME/shmkv``, else ``~/.cache/shmkv``), else (a home that cannot be
    written, as in some containers) ``shmkv-UID`` in the temporary directory. A
    directory is used only when it is not a symbolic link, is owned by this user and
    can be written by no one else; a missing one is created 0700. Why one was refused
    is logged (logger ``shmkv.native``): a warning when someone else could write it."""
    explicit = os.environ.get("SHMKV_CACHE_DIR")
    if explicit:
        candidates = [explicit]
    else:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        candidates = [
            os.path.join(base, "shmkv"),
            os.path.join(tempfile.gettempdir(), f"shmkv-{os.getuid()}"),
        ]
    for path in candidates:
        why, unsafe = _private_dir(path)
        if why is None:
            return path
        log.log(
            logging.WARNING if unsafe else logging.INFO,
            "shmkv: not using %s for the native libraries: it %s",
            path,
            why,
        )
    return None


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


def _run(command: list) -> Optional[str]:
    """Run a compiler step; None when it succeeded, else why not. On a timeout the
    whole process group goes (the driver's cc1 and ld with it)."""
    try:
        proc = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
    except OSError as exc:
        return str(exc)
    try:
        _out, err = proc.communicate(timeout=BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        proc.communicate()
        return f"{command[0]} took over {BUILD_TIMEOUT_S:g} s"
    return None if proc.returncode == 0 else (err.strip()[-400:] or f"exit {proc.returncode}")


def _prune(directory: str, keep: str, prefix: str = "paged_decode") -> None:
    """Remove the libraries named ``prefix-*`` of earlier sources or builds not used for
    PRUNE_AFTER_S (a cache shared by machines keeps each machine's current one)."""
    now = time.time()
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        path = os.path.join(directory, name)
        if name.startswith(prefix + "-") and name.endswith(".so") and path != keep:
            try:
                if now - os.stat(path).st_atime > PRUNE_AFTER_S:
                    os.unlink(path)
            except OSError:
                pass


def _library_names(cc: str, lib: Optional["_Library"] = None) -> List[str]:
    """A library's file name (the decode kernel's by default) for each of its flag sets,
    built with ``cc``: a hash of the source, the compiler and its version, the flags,
    the build kind and the CPU. Raises OSError / SubprocessError when the source cannot
    be read or ``cc`` run."""
    lib = lib or DECODE
    with open(lib.source, "rb") as f:
        source = f.read()
    version = subprocess.run(
        [cc, "--version"], capture_output=True, timeout=30, start_new_session=True
    ).stdout
    return [
        lib.name
        + "-"
        + hashlib.sha256(
            b"\0".join(
                [
                    source,
                    cc.encode(),
                    version,
                    " ".join(flags).encode(),
                    BUILD_KIND.encode(),
                    platform.machine().encode(),
                    _cpu_flags().encode(),
                ]
            )
        ).hexdigest()[:20]
        + ".so"
        for flags in lib.flag_sets
    ]


def _compile(
    cc: str, flags: list, directory: str, path: str, source: str = SOURCE
) -> Optional[str]:
    """Build the library of ``source`` into ``path`` in ``directory`` (under a temporary
    name, then renamed over whatever is there); None when it was built, else why not."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=".tmp-shmkv-", suffix=".so", dir=directory)
        os.close(fd)
    except OSError as exc:
        return f"cannot write to the cache directory {directory}: {exc}"
    obj = tmp[:-3] + ".o"
    try:
        # Compiled with the flags, linked without them: a link with -ffast-math adds
        # start-up code that sets flush-to-zero for the whole process (subnormals
        # would read as zero in every computation, torch's included).
        for command in (
            [cc, *flags, "-fPIC", "-c", "-o", obj, source],
            [cc, "-shared", "-o", tmp, obj, "-lm"],
        ):
            failed = _run(command)
            if failed:
                return failed
        os.chmod(tmp, 0o755)  # the linker's mode follows the umask
        os.replace(tmp, path)
        return None
    except (OSError, subprocess.SubprocessError) as exc:
        return str(exc)
    finally:
        for leftover in (tmp, obj):
            if os.path.exists(leftover):
                os.unlink(leftover)


def _build(lib: Optional["_Library"] = None) -> tuple:
    """(what ``lib.bind`` made of the loaded library, None) or (None, why not), for
    ``lib`` (the decode kernel by default)."""
    lib = lib or DECODE
    if os.environ.get("SHMKV_NATIVE", "1").strip().lower() in ("0", "false", "no", "off"):
        return None, "disabled by SHMKV_NATIVE"
    cc = _compiler()
    if cc is None:
        return None, "no C compiler found (set CC, or install cc/gcc/clang)"
    try:
        names = _library_names(cc, lib)
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"cannot read the source {lib.source} or run {cc}: {exc}"
    directory = cache_dir() if os.path.isdir(_FD_DIR) else None
    private = None
    if directory is None:
        try:
            private = directory = tempfile.mkdtemp(prefix="shmkv-build-")  # 0700, ours
        except OSError as exc:
            return None, f"cannot make a private directory to build in: {exc}"
    errors = []
    try:
        for flags, name in zip(lib.flag_sets, names):
            path = os.path.join(directory, name)
            if os.path.lexists(path):
                try:
                    return _load(path, lib)
                except UntrustedLibrary as exc:
                    log.warning("shmkv: %s; building a new one in its place", exc)
                except (OSError, AttributeError) as exc:
                    errors.append(f"loading {path}: {exc}")
                    continue
            failed = _compile(cc, flags, directory, path, lib.source)
            if failed:
                errors.append(f"{' '.join(flags)}: {failed}")
                continue
            if private is None:
                _prune(directory, keep=path, prefix=lib.name)
            try:
                return _load(path, lib)
            except (OSError, AttributeError) as exc:
                errors.append(f"loading {path}: {exc}")
    finally:
        if private is not None:
            shutil.rmtree(private, ignore_errors=True)  # what is loaded stays mapped
    return None, f"building with {cc} failed: " + "; ".join(errors)


def load(path: str) -> dict:
    """The kernels of the built decode library at ``path``, ``{dtype: fn}`` for each of
    :data:`DTYPES`, loaded as :func:`open_library` does.

    Raises:
        UntrustedLibrary: the file fails the check (nothing of it has run).
        OSError / AttributeError: it cannot be opened or loaded, or lacks the kernels.
    """
    return _bind_decode(*open_library(path))


def open_library(path: str) -> tuple:
    """The built library at ``path``, loaded: ``(ctypes.CDLL, the descriptor it was
    loaded through)``.

    The file is opened without following a symbolic link and checked on the open
    descriptor before anything is loaded: a regular file, owned by this user, writable
    by no one else. It is then loaded through that descriptor (``/proc/self/fd/N``),
    which stays open: what was checked is what runs. (Where there is no
    ``/proc/self/fd`` it is loaded by path after the check; :func:`decoder` then loads
    only from a fresh private directory.)

    Raises:
        UntrustedLibrary: the file fails the check (nothing of it has run).
        OSError: it cannot be opened or loaded.
    """
    try:
        fd = os.open(
            path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
        )
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UntrustedLibrary(f"refusing to load {path}: it is a symbolic link") from None
        raise
    try:
        why = _untrusted(os.fstat(fd), directory=False)
        if why is not None:
            raise UntrustedLibrary(f"refusing to load {path}: it {why}")
        lib = ctypes.CDLL(f"{_FD_DIR}/{fd}" if os.path.isdir(_FD_DIR) else path)
    except BaseException:
        os.close(fd)
        raise
    _loaded_fds.append(fd)
    return lib, fd


def _load(path: str, lib: "_Library") -> tuple:
    return lib.bind(*open_library(path)), None


def _bind_decode(lib: ctypes.CDLL, _fd: int) -> dict:
    kernels = {
        torch.float32: lib.shmkv_paged_decode_f32,
        torch.bfloat16: lib.shmkv_paged_decode_bf16,
        torch.float16: lib.shmkv_paged_decode_f16,
    }
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    for fn in kernels.values():
        fn.argtypes = [p, p, p, i64, i64, p, i64, p, i64, i64, i64, i64, i64, ctypes.c_float, p]
        fn.restype = ctypes.c_int
    return kernels


def _bind_copy(lib: ctypes.CDLL, fd: int) -> Any:
    from .tier_io import RowCopy

    return RowCopy(lib, fd)


class _Library(NamedTuple):
    """One library built from one source: ``name`` starts its file names, ``title`` names
    it in messages; ``bind`` makes
    what callers get from the loaded library and the descriptor it was loaded through
    (and raises AttributeError where a symbol is missing); ``without`` says what takes
    its place when it is not available."""

    name: str
    title: str
    source: str
    flag_sets: tuple
    bind: Callable[[ctypes.CDLL, int], Any]
    without: str


DECODE = _Library(
    "paged_decode",
    "native decode kernel",
    SOURCE,
    FLAG_SETS,
    _bind_decode,
    "attention takes its torch path",
)
COPY = _Library(
    "copy_rows",
    "native row copy",
    COPY_SOURCE,
    COPY_FLAG_SETS,
    _bind_copy,
    "the tiers copy with numpy",
)


def _get(lib: _Library, state: _State) -> Any:
    """What ``lib`` gives (built or loaded on the first call), or None."""
    if state["tried"]:
        return state["fn"]
    with _lock:
        if not state["tried"]:
            fn, why = _build(lib)
            state["fn"] = fn
            state["status"] = "loaded" if fn is not None else why
            if fn is None and why != "disabled by SHMKV_NATIVE":
                log.warning("shmkv: the %s is not available, %s: %s", lib.title, lib.without, why)
            state["tried"] = True
    return state["fn"]


def decoder() -> Optional[dict]:
    """The loaded kernels, ``{dtype: fn}`` for each of :data:`DTYPES`, or None when
    they are not available (see :func:`status`). Builds or loads them on the first
    call; later calls return what that one found."""
    return _get(DECODE, _state)


def status() -> str:
    """``"loaded"``, ``"not built yet"``, or why the decode kernel is not available."""
    return _state["status"]


def copier() -> Optional[Any]:
    """The tiers' row copy (:class:`shmkv.tier_io.RowCopy`), or None when it is not
    available (see :func:`copy_status`): the tiers then copy with numpy. Builds or loads
    it on the first call; later calls return what that one found."""
    return _get(COPY, _copy_state)


def copy_status() -> str:
    """``"loaded"``, ``"not built yet"``, or why the row copy is not available."""
    return _copy_state["status"]


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
