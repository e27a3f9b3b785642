"""The coordinator: owns the pool and serves its metadata over a Unix socket.

Owns the socket's address (the runtime directory, the address lock, permissions,
stale-file cleanup), the pool's lifetime, the tiers' lifetime, and the single-threaded
select loop that serves it; it is the only writer of block metadata. The loop (which
socket is ready, when to poll or sleep, starting promotions and driving the tiers,
expiring hand-offs) is :class:`Coordinator`'s; it holds two parts, made when the pool
is, each the only writer of its own state: the connections
(:class:`~shmkv.coordinator.connections.Connections`: sockets, frames, held requests,
dispatch, answers, their counters) and the request handlers
(:class:`~shmkv.coordinator.ops.Ops`). :meth:`Coordinator.stats` gathers the counters
of all three. Framing and validation are in ``shmkv.protocol``; block and sequence
rules in ``shmkv.coordinator.allocator`` and ``shmkv.coordinator.sequences``; memory in
``shmkv.memory.pool``.

Three ways to run it: :meth:`Coordinator.start` (a thread of this process),
:meth:`Coordinator.spawn` (its own process, tied to this one's lifetime: a
:class:`SpawnedCoordinator`, at the end of this module), and ``shmkv serve`` (the
foreground of a terminal).

The module is over 800 lines because the address helpers (``runtime_dir``,
``default_address``, ``lock_path``, ``remove_stale_socket``), ``LOCAL_POOLS`` and
:class:`SpawnedCoordinator` are imported from here by the rest of the tree; they could
move to a module of their own.
"""

from __future__ import annotations

import errno
import fcntl
import gc
import logging
import multiprocessing
import os
import selectors
import signal
import socket
import stat
import tempfile
import threading
import time
import weakref
from typing import TYPE_CHECKING, Dict, List, Optional, Union

from shmkv import protocol
from shmkv.coordinator import sched
from shmkv.coordinator.allocator import BlockPool
from shmkv.coordinator.connections import Connections, _Conn, _shutdown_and_close, make_selector
from shmkv.coordinator.ops import Ops
from shmkv.coordinator.sequences import SequenceTable
from shmkv.errors import (
    AccessDenied,
    CoordinatorTimeout,
    InvalidArgument,
    ShmkvError,
    WrongType,
)
from shmkv.kernels import native
from shmkv.memory import shm
from shmkv.memory.layout import PoolConfig
from shmkv.memory.pool import PoolMemory, Populator, create_pool
from shmkv.memory.tables import TableWriter
from shmkv.tiers import TierSet, check_specs
from shmkv.tiers.redis_store import RemoteTierSet, split_specs

if TYPE_CHECKING:
    from shmkv.coordinator.metrics import MetricsServer

log = logging.getLogger("shmkv.coordinator.server")
_clock = time.perf_counter
# The longest the loop sleeps in the selector with nothing due (it wakes for requests,
# tier completions and hand-off deadlines).
_MAX_WAIT_S = 1.0
# How long the coordinator's loop polls for the next request after serving one before
# it sleeps in the selector (``Coordinator._spin``): the default of a coordinator in its
# own process, and the most it accepts. A request caught while polling skips the loop's
# wake-up, which costs tens of microseconds on a virtual machine.
DEFAULT_SPIN_US = 300.0
MAX_SPIN_US = 10000.0
# The CPU slice the loop's thread asks for (``shmkv.coordinator.sched``): short, so that the
# scheduler picks the loop ahead of the clients it wakes; the kernel's bounds otherwise.
DEFAULT_LOOP_SLICE_US = 100.0
MIN_LOOP_SLICE_US, MAX_LOOP_SLICE_US = sched.MIN_SLICE_NS / 1e3, sched.MAX_SLICE_NS / 1e3
_SPIN_WEIGHT = 0.05  # of the latest turn in the running rate of spins that catch a request
# Pools of coordinators running in this process, by address: a client here uses the
# original tensors (required for CUDA, whose IPC handles cannot be opened by their
# exporter).
LOCAL_POOLS: Dict[str, PoolMemory] = {}


# How many suffixed names (``shmkv-UID-1`` ...) runtime_dir tries in the temp dir when
# ``shmkv-UID`` is taken by someone else, before a private directory of this process.
_RUNTIME_FALLBACKS = 8
_private_runtime: Dict[str, str] = {}  # temp dir -> this process's mkdtemp fallback
_runtime_warned: set = set()


def _private_dir(path: str, strict: bool) -> Optional[str]:
    """Make ``path`` a private directory of this uid; returns None when it is one, else
    why it cannot be (the name is taken).

    Created with mode 0700 when missing. An existing entry is examined with ``lstat``
    (never following a link): a symbolic link, a non-directory or a directory of
    another uid is refused; so is one that others may write unless ``strict`` (a
    directory this user named or owns the parent of, which is then tightened). The
    mode is tightened through a descriptor opened ``O_NOFOLLOW``, so a link swapped in
    meanwhile is never chmod'ed.
    """
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        return f"cannot be created ({exc.strerror})"
    try:
        st = os.lstat(path)
    except OSError as exc:
        return f"cannot be examined ({exc.strerror})"
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_uid != os.getuid():
        return f"belongs to uid {st.st_uid}, not to this user (uid {os.getuid()})"
    if st.st_mode & 0o077:
        if st.st_mode & 0o022 and not strict:
            return f"is writable by others (mode {stat.S_IMODE(st.st_mode):o})"
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError as exc:
            return f"cannot be opened ({exc.strerror})"
        try:
            now = os.fstat(fd)
            if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                return "was replaced while being examined"
            os.fchmod(fd, 0o700)
        finally:
            os.close(fd)
    return None


def _warn_runtime(taken: str, why: str, used: str, extra: str = "") -> None:
    if (taken, used) not in _runtime_warned:  # once per process, not per address
        _runtime_warned.add((taken, used))
        log.warning(
            "runtime directory %s %s; named coordinators of this user use %s%s",
            taken,
            why,
            used,
            extra,
        )


def runtime_dir() -> str:
    """The per-user directory for sockets of named coordinators.

    In order:

    * ``$SHMKV_RUNTIME_DIR`` when set (to keep a test run or a sandbox apart from every
      other coordinator on the machine; a link there is resolved, as the user chose it);
    * ``$XDG_RUNTIME_DIR/shmkv`` when ``$XDG_RUNTIME_DIR`` is a directory of this user
      that others cannot write (systemd's ``/run/user/UID``);
    * ``shmkv-UID`` in the temp dir. The temp dir is shared with every user, so the
      name may be taken first by someone else (a link, a file, a directory of another
      uid or one others can write). Then ``shmkv-UID-1`` ... ``shmkv-UID-8`` are tried
      in turn: every process of this user walks the same names, so a named coordinator
      and its clients still meet. When all are taken, a private ``mkdtemp`` directory of
      this process is used, which other processes cannot find (set
      ``$SHMKV_RUNTIME_DIR``, or pass an address). A fallback is logged as a warning
      on the ``shmkv`` logger, naming the directory used.

    The directory is created with mode 0700, and a directory of this user that others
    can read is tightened to it (never through a link).

    Raises:
        AccessDenied: ``$SHMKV_RUNTIME_DIR`` or ``$XDG_RUNTIME_DIR/shmkv`` is not a
            private directory of this user (a link, a file, another user's).
    """
    override = os.environ.get("SHMKV_RUNTIME_DIR")
    base = os.environ.get("XDG_RUNTIME_DIR")
    if override:
        path = os.path.realpath(override)
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    elif base and _trusted_base(base):
        path = os.path.join(base, "shmkv")
    else:
        path = None
    if path is not None:
        why = _private_dir(path, strict=True)
        if why is not None:
            raise AccessDenied(
                f"runtime directory {path} {why}; remove it, or set "
                "SHMKV_RUNTIME_DIR to a directory of yours"
            )
        return path
    tmp = tempfile.gettempdir()
    first = os.path.join(tmp, f"shmkv-{os.getuid()}")
    why_first = ""
    for k in range(_RUNTIME_FALLBACKS + 1):
        path = first if k == 0 else f"{first}-{k}"
        why = _private_dir(path, strict=False)
        if why is None:
            if k:
                _warn_runtime(first, why_first, path)
            return path
        if k == 0:
            why_first = why or ""
    private = _private_runtime.get(tmp)
    if private is None or _private_dir(private, strict=False) is not None:
        private = _private_runtime[tmp] = tempfile.mkdtemp(prefix=f"shmkv-{os.getuid()}.", dir=tmp)
    _warn_runtime(
        first,
        f"{why_first}, and so are {first}-1..{_RUNTIME_FALLBACKS}",
        private,
        " (this process only: set SHMKV_RUNTIME_DIR for other processes to find its coordinators)",
    )
    return private


def _trusted_base(base: str) -> bool:
    """``$XDG_RUNTIME_DIR`` is used only when it is a directory of this user that
    others cannot write."""
    try:
        st = os.stat(base)
    except OSError:
        return False
    return (
        stat.S_ISDIR(st.st_mode)
        and st.st_uid == os.getuid()
        and not st.st_mode & 0o022
        and os.access(base, os.W_OK)
    )


def default_address(name: str) -> str:
    """The socket path a coordinator called ``name`` listens on."""
    if not name or "/" in name or name.startswith(".") or len(name) > 64:
        raise InvalidArgument(
            f"coordinator name {name!r} must be 1-64 characters without '/' and not start with '.'"
        )
    return os.path.join(runtime_dir(), f"{name}.sock")


def lock_path(address: str) -> str:
    """The lock file beside ``address`` that a coordinator serving it holds."""
    return address + ".lock"


def _take_lock(address: str) -> Optional[int]:
    """Take the lock that marks ``address`` as served; returns its descriptor, or None
    when a live coordinator holds it.

    The lock is an ``flock`` on ``ADDRESS.lock``, a file of this user in the socket's
    directory: only those who can write that directory can take or block it, so in the
    0700 runtime directory of named coordinators no other local user can (an
    abstract-namespace name, which any uid may bind first, could be squatted). The
    kernel drops the lock when its holder dies, so a killed coordinator never leaves it
    held: its file stays until the next coordinator on the address, or
    :func:`remove_stale_socket`, removes it.

    The file is opened ``O_NOFOLLOW`` and must be a regular file of this uid. Who lets
    the lock go unlinks the file first, so a lock taken on a file that is no longer (or
    not yet again) at its path is let go and taken anew.

    Raises:
        AccessDenied: the lock file is a link, not a regular file, or another uid's.
    """
    path = lock_path(address)
    for _ in range(16):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise AccessDenied(f"lock file {path} is a symbolic link; remove it") from None
            if exc.errno in (errno.EACCES, errno.EPERM, errno.EISDIR, errno.ENXIO):
                raise AccessDenied(
                    f"lock file {path} cannot be opened ({exc.strerror}); "
                    "remove it, or choose another address"
                ) from None
            raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                raise AccessDenied(
                    f"lock file {path} is not a regular file of this user "
                    f"(uid {st.st_uid}); remove it, or choose another address"
                )
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return None
            try:
                now = os.lstat(path)
                same = (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino)
            except FileNotFoundError:
                same = False
            if same:
                return fd
            os.close(fd)  # its holder let it go (and unlinked it) as we took it: again
        except BaseException:
            try:
                os.close(fd)
            except OSError:
                pass
            raise
    raise ShmkvError(f"lock file {path} kept changing while being taken")


def _drop_lock(address: str, fd: int) -> None:
    """Let go of a lock :func:`_take_lock` gave: unlink its file (while still holding
    it, see there), then close it."""
    path = lock_path(address)
    try:
        st, now = os.fstat(fd), os.lstat(path)
        if (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
            os.unlink(path)
    except FileNotFoundError:
        pass
    finally:
        os.close(fd)


def remove_stale_socket(address: str) -> bool:
    """Remove the socket file at ``address`` (and its lock file) if no live coordinator
    serves it.

    For whoever supervises a coordinator that died without cleaning up (SIGKILL).
    Returns True when a stale socket file was removed.

    Raises:
        AccessDenied: the lock file beside it is not this user's (see :func:`_take_lock`).
    """
    try:
        fd = _take_lock(address)
    except FileNotFoundError:
        return False  # the directory is gone: nothing to remove
    if fd is None:
        return False  # a live coordinator holds it
    try:
        if not stat.S_ISSOCK(os.lstat(address).st_mode):
            return False
        os.unlink(address)
        return True
    except FileNotFoundError:
        return False
    finally:
        _drop_lock(address, fd)


# Coordinators of this process that hold descriptors (address lock, listener,
# connections), for the fork hook below. Weak: a coordinator is never kept alive by it.
_LIVE: "weakref.WeakSet[Coordinator]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    """In a child made by ``os.fork`` (a fork-start Pool or DataLoader, say): drop the
    copies of every coordinator's descriptors.

    A child does not serve. Its copies would keep the address lock held after the
    parent stops, and keep each connection open, so that clients would not see the
    parent's stop. Only this process's descriptors are closed (never ``shutdown``,
    which would cut the parent's connections); the socket file, the pool and its
    metadata belong to the parent and are left alone.
    """
    for coord in list(_LIVE):
        coord._forget_after_fork()
    _LIVE.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


class Coordinator:
    """Owns a KV block pool and serves it to worker processes.

    Args:
        config: the pool to allocate.
        name: derive the socket address from a name (``default_address``).
        address: an explicit socket path (instead of ``name``).
        max_connections: clients connected at once; more are refused.
        max_frame: largest request frame in bytes.
        max_handoffs: hand-off tokens outstanding at once.
        max_handoff_ttl: the longest hand-off ttl in seconds.
        metrics_port: serve Prometheus metrics at ``http://metrics_host:PORT/metrics``
            from a thread of this process (0: any free port; ``metrics_address`` says
            which). None (the default): no metrics server. See ``shmkv.coordinator.metrics``.
        metrics_host: the address the metrics server binds (default loopback only; any
            other, ``""`` and ``"0.0.0.0"`` included, is logged as a warning).
        tiers: tiers under the pool, top first: ``[HostTier(...)]``, ``[DiskTier(...)]``
            or ``[HostTier(...), DiskTier(...)]`` (``shmkv.tiers``), and a
            ``RedisTier(url)`` last, shared with other nodes (``shmkv.tiers.redis_store``).
        spin_us: after serving a request, poll this many microseconds for the next one
            before sleeping, while requests come back to back (see :meth:`_spin`). 0 (the
            default here, where the loop is a thread of the application's process); a
            coordinator in its own process (:meth:`spawn`, ``shmkv serve``) defaults to
            ``DEFAULT_SPIN_US``.
        loop_slice_us: the CPU slice the loop's thread asks the scheduler for while it
            serves (Linux 6.12 and later; ``shmkv.coordinator.sched``), in [100, 100000]; 0: the
            thread's own. Short (the default, 100), the loop is picked ahead of the
            clients it answers, instead of waiting behind one it has just woken. Threads
            the loop starts meanwhile (tier copiers) get the kernel's default. The
            thread's slice is restored when the loop ends; ``stats()["loop_slice_us"]``
            says what is in effect (None: the kernel keeps no such request).

    Use as a context manager, or call :meth:`start` and :meth:`stop`.

    Raises:
        ShmkvError: the address is served by a live coordinator, or the pool cannot
            be allocated (with what to change).

    The class is over 600 lines because its option checks, its lifecycle (open, stop,
    close, fork), the loop and the read-only views of its parts' counters share one
    object's fields; what the loop serves is in its parts,
    :class:`~shmkv.coordinator.connections.Connections` and
    :class:`~shmkv.coordinator.ops.Ops`.
    """

    def __init__(
        self,
        config: PoolConfig,
        name: Optional[str] = None,
        address: Optional[str] = None,
        max_connections: int = 1024,
        max_frame: int = protocol.DEFAULT_MAX_FRAME,
        max_handoffs: int = 65536,
        max_handoff_ttl: float = 3600.0,
        metrics_port: Optional[int] = None,
        metrics_host: str = "127.0.0.1",
        tiers=None,
        spin_us: float = 0.0,
        loop_slice_us: float = DEFAULT_LOOP_SLICE_US,
        populate: bool = True,
        hugepages: bool = False,
    ):
        if not isinstance(config, PoolConfig):
            raise WrongType(f"config must be a PoolConfig, got {type(config).__name__}")
        if (name is None) == (address is None):
            raise InvalidArgument("pass exactly one of name= and address=")
        for label, value in (
            ("max_connections", max_connections),
            ("max_frame", max_frame),
            ("max_handoffs", max_handoffs),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise InvalidArgument(f"{label} must be a positive int, got {value!r}")
        if metrics_port is not None and (
            isinstance(metrics_port, bool)
            or not isinstance(metrics_port, int)
            or not 0 <= metrics_port <= 65535
        ):
            raise InvalidArgument(
                f"metrics_port must be an int in [0, 65535] or None, got {metrics_port!r}"
            )
        if (
            isinstance(spin_us, bool)
            or not isinstance(spin_us, (int, float))
            or not 0 <= spin_us <= MAX_SPIN_US
        ):
            raise InvalidArgument(
                f"spin_us must be a number of microseconds in [0, {MAX_SPIN_US:g}], got {spin_us!r}"
            )
        if (
            isinstance(loop_slice_us, bool)
            or not isinstance(loop_slice_us, (int, float))
            or not (loop_slice_us == 0 or MIN_LOOP_SLICE_US <= loop_slice_us <= MAX_LOOP_SLICE_US)
        ):
            raise InvalidArgument(
                f"loop_slice_us must be 0 or a number of microseconds in "
                f"[{MIN_LOOP_SLICE_US:g}, {MAX_LOOP_SLICE_US:g}], got {loop_slice_us!r}"
            )
        for label, flag in (("populate", populate), ("hugepages", hugepages)):
            if not isinstance(flag, bool):
                raise InvalidArgument(f"{label} must be True or False, got {flag!r}")
        self.config = config
        self.populate = populate
        self.hugepages = hugepages
        self._populator: Optional[Populator] = None
        self.spin_us = float(spin_us)
        self.loop_slice_us = float(loop_slice_us)
        self._loop_slice_ns: Optional[int] = None  # in effect while the loop serves
        # Never on a machine with one CPU, where polling only keeps the client from running.
        # The machine's count, not this process's affinity: a coordinator pinned to a core
        # of its own (the placement that gains most) still polls.
        self._spin_s = self.spin_us * 1e-6 if (os.cpu_count() or 1) > 1 else 0.0
        self._num_ops_seen = 0  # requests served when the last turn began (see _turn)
        self._turn_began = 0.0
        self._spin_hits = 0.0  # how often a spin caught (or would have caught) the next;
        # from none: a coordinator polls once it has seen requests come back to back
        if address is None and name is None:
            raise InvalidArgument("a coordinator needs a name= or an address=")
        self.address = str(address) if address is not None else default_address(name or "")
        if len(os.fsencode(self.address)) > 107:
            raise InvalidArgument(
                f"socket path {self.address!r} is longer than the 107 bytes "
                "a Unix socket address can hold; use a shorter path or name="
            )
        self.max_connections = max_connections
        self.max_frame = max_frame
        self.max_handoffs = max_handoffs
        self.max_handoff_ttl = float(max_handoff_ttl)
        self.metrics_port = metrics_port
        self.metrics_host = metrics_host
        self.metrics_address: Optional[tuple] = None  # (host, port) once the metrics server listens
        self._metrics: Optional[MetricsServer] = None
        local_tiers, self._remote_spec = split_specs(tiers)
        self._tier_specs = check_specs(local_tiers)
        self.tiers: Optional[Union[TierSet, RemoteTierSet]] = None  # a store over tiers
        # Fields that teardown may meet half-built default to "nothing to release". The
        # pool, its table and the loop's parts (made with them) are None until open();
        # the loop runs only after it, so they are typed as set.
        self.memory: PoolMemory = None  # type: ignore[assignment]  # see above
        self.table: SequenceTable = None  # type: ignore[assignment]  # see above
        self._ops: Ops = None  # type: ignore[assignment]  # see above
        self._connections: Connections = None  # type: ignore[assignment]  # see above
        self._listener: Optional[socket.socket] = None
        self._lock_fd: Optional[int] = None  # the address lock (see _take_lock)
        self._wake_r: Optional[socket.socket] = None
        self._wake_w: Optional[socket.socket] = None
        self._thread: Optional[threading.Thread] = None
        self._stopping = False
        self._serving = False
        self._close_lock = threading.RLock()  # re-entrant: stop() may run in a signal handler
        self._started_at = 0.0
        self._woken = False  # the wake socket was readable this turn (see _turn)
        # Connections found ready while the tiers placed blocks (_clients_waiting): their
        # reports are taken (one-shot), so the next turn serves them first, not sleeping.
        self._caught: list = []
        # Names this coordinator instance (not its address, which a restart reuses), so
        # a step descriptor made against another coordinator is refused.
        self.instance = os.urandom(8).hex()

    # -- lifecycle -----------------------------------------------------------------------

    def open(self) -> None:
        """Allocate the pool and bind the socket, without serving yet."""
        try:
            self._claim_address()
            shm.sweep_stale()
            self.memory = memory = create_pool(self.config, hugepages=self.hugepages)
            owner, seq, table = memory.owner_t, memory.seq, memory.table
            seq_np, table_np = memory.seq_np, memory.table_np
            assert (
                owner is not None
                and seq is not None
                and table is not None
                and seq_np is not None
                and table_np is not None
            ), "create_pool maps the metadata segment"
            self.table = SequenceTable(
                BlockPool(
                    self.config.num_blocks,
                    owner=memory.owner,
                    epoch=memory.epoch,
                    owner_np=owner.numpy(),
                ),
                self.config.block_size,
                self.config.tp_size,
                copy_block=memory.copy_block,
                max_handoffs=self.max_handoffs,
                max_handoff_ttl=self.max_handoff_ttl,
                tables=TableWriter(memory.layout, seq, table, (seq_np, table_np)),
                arrays=(seq_np, table_np, owner.numpy()),
                max_seq_len=self.config.max_seq_len,
            )
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._listener = listener
            old_umask = os.umask(0o177)
            try:
                listener.bind(self.address)
            finally:
                os.umask(old_umask)
            os.chmod(self.address, 0o600)
            listener.listen(128)
            listener.setblocking(False)
            self._wake_r, self._wake_w = socket.socketpair()
            self._wake_r.setblocking(False)
            self._started_at = time.monotonic()
            LOCAL_POOLS[self.address] = self.memory
            if self._tier_specs:  # after the wake socket: workers wake the loop with it
                self.tiers = TierSet(
                    self._tier_specs,
                    self.config,
                    memory,
                    self.table,
                    self._wake_for_tiers,
                    wake_sock=self._wake_w,
                )
                self.table.tiers = self.tiers
            if self._remote_spec is not None:  # the store under the local tiers
                self.tiers = RemoteTierSet(
                    self._remote_spec,
                    self.tiers,
                    self.config,
                    memory,
                    self.table,
                    self._wake_for_tiers,
                )
                self.table.tiers = self.tiers
            self._ops = Ops(
                self.config,
                memory,
                self.table,
                self.tiers,
                instance=self.instance,
                max_handoff_ttl=self.max_handoff_ttl,
                max_frame=self.max_frame,
                stats=self.stats,
            )
            self._connections = Connections(
                self._ops, self.table, listener, self.max_connections, self.max_frame
            )
            if self.metrics_port is not None:
                from shmkv.coordinator.metrics import MetricsServer

                metrics = self._metrics = MetricsServer(self, self.metrics_port, self.metrics_host)
                self.metrics_address = metrics.address
            if self.populate and memory.raw is not None:  # last: nothing after it can fail
                self._populator = Populator(memory.raw)
            log.info(
                "coordinator %s: %d blocks x %d tokens, %s, %.1f MiB%s%s",
                self.address,
                self.config.num_blocks,
                self.config.block_size,
                self.config.dtype,
                self.config.nbytes / 2**20,
                " of huge pages" if memory.hugepages else "",
                "" if self._metrics is None else f"; metrics at {self._metrics.url}",
            )
        except BaseException:
            self.close()
            raise

    def _claim_address(self) -> None:
        directory = os.path.dirname(self.address) or "."
        if not os.path.isdir(directory):
            raise InvalidArgument(f"socket directory {directory} does not exist")
        lock = _take_lock(self.address)
        if lock is None:
            raise ShmkvError(
                f"{self.address} is served by a live coordinator; stop it or choose another name"
            )
        self._lock_fd = lock
        _LIVE.add(self)  # from the first descriptor on, a fork must drop them in the child
        if os.path.lexists(self.address):  # left by a dead coordinator: we hold the lock
            if not stat.S_ISSOCK(os.lstat(self.address).st_mode):
                raise InvalidArgument(
                    f"{self.address} exists and is not a socket; choose another address"
                )
            os.unlink(self.address)

    def start(self) -> "Coordinator":
        """Serve from a daemon thread of this process; returns self."""
        if self._thread is not None:
            raise ShmkvError("coordinator already started")
        if self._listener is None:
            self.open()
        self._thread = threading.Thread(
            target=self.serve_forever, name="shmkv-coordinator", daemon=True
        )
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop serving, drop every connection, free the pool, remove the socket.

        Idempotent. Clients see ``CoordinatorGone`` on their next call (and
        ``is_valid()`` turn False) at once, even while children forked from this
        process live: connections are shut down, not only closed here.
        """
        self._stopping = True
        if self._wake_w is not None:
            try:
                self._wake_w.send(b"x")
            except OSError:
                pass
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise ShmkvError(f"coordinator thread did not stop within {timeout} s")
        with self._close_lock:  # serve_forever decides under it whether it serves
            if not self._serving:  # a running loop closes everything itself as it exits
                self._close()

    def close(self) -> None:
        """Release everything this object holds. Safe on a half-built coordinator, and
        when a signal handler's stop() races the loop's own exit."""
        with self._close_lock:
            self._close()

    def _close(self) -> None:
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
        if self._connections is not None:
            self._connections.drop_all()
        if self._listener is not None:
            _shutdown_and_close(self._listener)  # refuses connects from any process
            self._listener = None
            try:
                os.unlink(self.address)
            except FileNotFoundError:
                pass
        for name in ("_wake_r", "_wake_w"):
            sock = getattr(self, name)
            if sock is not None:
                sock.close()
                setattr(self, name, None)
        if self._lock_fd is not None:  # last of the address: the socket file is gone
            _drop_lock(self.address, self._lock_fd)
            self._lock_fd = None
        if self.tiers is not None:  # its workers copy pool memory: stop them first
            self.tiers.close()
            self.tiers = None
        if self._populator is not None:
            self._populator.stop()
        if self.memory is not None:
            if LOCAL_POOLS.get(self.address) is self.memory:
                del LOCAL_POOLS[self.address]
            self.memory.close()
            self.memory = None  # type: ignore[assignment]  # closed: see __init__
        _LIVE.discard(self)

    def _forget_after_fork(self) -> None:
        """In a forked child: close this process's copies of the sockets, never serve.

        The child is single-threaded, so no lock is taken (the parent's serving thread
        may have held ``_close_lock`` at the fork). Connections are forgotten without
        ``SequenceTable.drop_connection``: the table is the parent's, and its block
        tables live in shared memory. ``stop()`` in the child then releases only the
        child's copy of the pool mapping.
        """
        self._close_lock = threading.RLock()  # re-entrant: stop() may run in a signal handler
        self._stopping = True
        self._serving = False
        if self._connections is not None:
            self._connections.forget_after_fork()
        self.tiers = None  # its threads are the parent's; shmkv.tiers drops the disk lock
        self._populator = None  # (so is this one's)
        if self._metrics is not None:
            self._metrics.forget_after_fork()
            self._metrics = None
        for name in ("_listener", "_wake_r", "_wake_w"):
            sock = getattr(self, name)
            if sock is not None:
                sock.close()
                setattr(self, name, None)
        if self._lock_fd is not None:  # closed, not dropped: the parent still holds it
            os.close(self._lock_fd)
            self._lock_fd = None
        if self.memory is not None and LOCAL_POOLS.get(self.address) is self.memory:
            del LOCAL_POOLS[self.address]  # a client made in the child maps the pool itself

    def __enter__(self) -> "Coordinator":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @classmethod
    def spawn(
        cls,
        config: PoolConfig,
        name: Optional[str] = None,
        address: Optional[str] = None,
        timeout: float = 60.0,
        **options,
    ):
        """Serve from a new process (spawn context); returns a :class:`SpawnedCoordinator`.

        The process stops when :meth:`SpawnedCoordinator.stop` is called or when this
        process dies.
        """
        return SpawnedCoordinator.start(
            config, name=name, address=address, timeout=timeout, **options
        )

    # -- counters ------------------------------------------------------------------------
    # Kept by the loop's parts (made by open()): the connections count connections and
    # requests, the handlers the prompts by client name.

    @property
    def num_ops(self) -> int:
        """Requests answered without an error."""
        return self._connections.num_ops

    @property
    def ops_by_type(self) -> Dict[str, int]:
        """Requests answered without an error, by op (read only)."""
        return self._connections.ops_by_type

    @property
    def num_errors(self) -> int:
        """Requests answered with an error (any code)."""
        return self._connections.num_errors

    @property
    def num_accepted(self) -> int:
        """Connections accepted."""
        return self._connections.num_accepted

    @property
    def num_refused(self) -> int:
        """Connections refused (another uid's, or past ``max_connections``)."""
        return self._connections.num_refused

    @property
    def num_dropped(self) -> int:
        """Connections closed while the coordinator served."""
        return self._connections.num_dropped

    @property
    def latency(self) -> Dict[str, list]:
        """The request latency histogram by op: a count per bucket of
        ``shmkv.coordinator.metrics.LATENCY_BUCKETS`` (and one past the last), then the
        sum of seconds (read only; read by the metrics exporter at scrape time)."""
        return self._connections.latency

    @property
    def client_counts(self) -> Dict[str, List[int]]:
        """Prompt tokens hit and missed, ``[hit, missed]`` by client name (read only;
        see ``Client(name=...)``), kept when its connections close."""
        return self._ops.client_counts

    # The loop's parts' state, read by the metrics exporter and the tests (read only).

    @property
    def _conns(self) -> Dict[int, _Conn]:
        return self._connections.conns

    @property
    def _to_promote(self) -> list:
        return self._connections.to_promote

    @property
    def _settle_waiters(self) -> Dict[int, list]:
        return self._connections.settle_waiters

    @property
    def _promoting(self) -> Dict[int, int]:
        return self._ops.promoting

    def block_counts(self) -> Dict[str, Dict[str, int]]:
        """Blocks by tier and state, ``{tier: {state: n}}``: ``pool`` (free, cached,
        referenced), ``host`` (free, cached) and ``disk`` (cached), each lower tier only
        when configured. Read by the metrics exporter (``shmkv.coordinator.metrics``), which labels
        every series with the tier and the state."""
        pool = self.table.pool
        counts = {
            "pool": {
                "free": pool.num_free,
                "cached": pool.num_cached,
                "referenced": pool.num_referenced,
            }
        }
        tiers = self.tiers
        if tiers is not None and tiers.host is not None:
            counts["host"] = {"free": len(tiers.host.free), "cached": tiers.host.num_ready}
        if tiers is not None and tiers.disk is not None:
            counts["disk"] = {"cached": tiers.disk.num_ready}
        return counts

    def stats(self) -> dict:
        """Counters of the pool, the prefix cache, connections and operations, and
        whether the native code is loaded (``native``: see ``shmkv.kernels.native.report``)."""
        out = self.table.stats()
        connections = self._connections
        uptime = max(time.monotonic() - self._started_at, 1e-9)
        out.update(
            {
                "address": self.address,
                "pid": os.getpid(),
                "uptime_s": uptime,
                "ops": connections.num_ops,
                "ops_per_s": connections.num_ops / uptime,
                "ops_by_type": dict(connections.ops_by_type),
                "refused_connections": connections.num_refused,
                "dropped_connections": connections.num_dropped,
                "accepted_connections": connections.num_accepted,
                "request_errors": connections.num_errors,
                "metrics_port": (None if self.metrics_address is None else self.metrics_address[1]),
                "pool_bytes": self.config.nbytes,
                "block_bytes": self.config.block_nbytes,
                "config": self.config.to_wire(),
                # the loop thread's CPU slice while it serves (None: not asked for, or
                # this kernel keeps no such request; see shmkv.coordinator.sched)
                "loop_slice_us": (
                    None if self._loop_slice_ns is None else self._loop_slice_ns / 1e3
                ),
            }
        )
        out["pool_memory"] = self.pool_memory_stats()
        # the native code of this installation: the kernel or its fallback, and why
        out["native"] = native.report()
        if self.tiers is not None:
            out["tiers"] = self.tiers.stats()
            out["tier_io"] = self.tiers.io_stats()
        return out

    def pool_memory_stats(self) -> dict:
        """How the pool's memory is backed, and how far its background populate is."""
        memory = self.memory
        if self._populator is not None:
            populate = self._populator.stats()
        else:  # not asked for, or a CUDA pool (its memory is the device's)
            total = 0 if self.config.is_cuda else self.config.nbytes
            populate = dict(state="off", bytes=0, total_bytes=total, seconds=0.0, error="")
        return {
            "hugepages": memory.hugepages,
            "hugepages_fallback": memory.hugepages_fallback,
            "populate": populate,
        }

    # -- the loop ------------------------------------------------------------------------

    def serve_forever(self) -> None:
        """Serve until :meth:`stop` (from another thread or a signal handler). Returns at
        once when it was stopped before it began."""
        if self._listener is None and not self._stopping:
            self.open()
        # Under the lock stop() takes to decide whether it closes: either stop() came
        # first (nothing is served) or the loop serves and closes everything as it exits.
        listener, wake = self._listener, self._wake_r
        with self._close_lock:
            serving = self._serving = (
                not self._stopping and listener is not None and wake is not None
            )
        if not serving or listener is None or wake is None:
            self.close()
            return
        selector = make_selector()
        own_slice = sched.thread_slice() if self.loop_slice_us else None
        own_inherit = sched.slice_inherited() if own_slice is not None else None
        if own_slice is not None:  # (threads the loop starts, tier copiers, keep the default)
            self._loop_slice_ns = sched.set_thread_slice(
                int(self.loop_slice_us * 1e3), inherit=False
            )
        try:
            selector.register(listener, selectors.EVENT_READ, None)
            selector.register(wake, selectors.EVENT_READ, None)
            while not self._stopping:
                self._turn(selector)
        finally:
            selector.close()
            self.close()
            self._serving = False
            if self._loop_slice_ns is not None and own_slice is not None:
                sched.set_thread_slice(own_slice, inherit=own_inherit)
            self._loop_slice_ns = None
            log.info("coordinator %s stopped", self.address)

    def _turn(self, selector) -> None:
        """One turn of the loop: serve what is ready (or wait for it), start the tier
        promotions those requests need, let the tiers move blocks, expire hand-offs."""
        self._turn_began = _clock()
        deadline = self.table.next_deadline()
        wait = (
            _MAX_WAIT_S
            if deadline is None
            else max(0.0, min(_MAX_WAIT_S, deadline - time.monotonic()))
        )
        connections = self._connections
        caught, self._caught = self._caught, []
        if connections.to_promote or caught:  # held requests answered last turn need copies
            wait = 0.0  # start them; connections caught waiting last turn: serve them
        elif self.tiers is not None:
            wait = min(wait, self.tiers.max_wait())
        if connections.accept_paused_until and connections.maybe_resume_accept(selector):
            wait = min(wait, 0.1)
        # Whether the last turn served a request, and (below) whether this one does: the
        # connections count what they serve.
        num_ops = connections.num_ops
        served, self._num_ops_seen = num_ops != self._num_ops_seen, num_ops
        polls = served and self._spin_s and not caught
        ready = self._spin(selector, wait) if polls else None
        hit = bool(ready)
        if not ready:
            ready = selector.select(wait)
            hit = bool(polls) and _clock() - self._turn_began <= self._spin_s  # would it?
        self._serve_ready(selector, caught + ready if caught else ready)
        if polls:  # a hit: a request, soon enough (not a tier wake-up or a connect)
            now_served = connections.num_ops != num_ops
            self._spin_hits += _SPIN_WEIGHT * ((hit and now_served) - self._spin_hits)
        if connections.to_promote or self._woken:
            # The requests that came in meanwhile go first (a ping should not wait for
            # copy jobs to be built and sent, or for finished copies to be taken back).
            self._serve_ready(selector, selector.select(0))
        if connections.to_promote:
            # The copies start before this turn's tier work places demotions that could
            # evict the entries they read.
            tiers = self.tiers
            assert tiers is not None, "promotions are planned only against tiers"
            for records, context in connections.take_to_promote():
                tiers.promote(records).context = context
        if self.tiers is not None:
            self._tier_turn(self.tiers, selector)
        if deadline is not None and self.table.expire():
            log.info(
                "hand-offs expired unopened (%d so far)", self.table.counters["expired_handoffs"]
            )

    def _spin(self, selector, wait: float) -> list:
        """After a turn that served a request: poll for the next one for ``spin_us``
        before sleeping in the selector. A client's next request often comes within
        that; caught here, it skips the wake-up (tens of microseconds on a virtual
        machine). Only while at least half of the recent turns' next requests came that
        soon (``_spin_hits``, kept by ``_turn`` whether it polled or not): polling that
        catches nothing takes a CPU from the clients and the tier copies."""
        if self._spin_hits < 0.5:
            return []
        end = _clock() + min(self._spin_s, wait)  # (a deadline due sooner goes first)
        while True:
            ready = selector.select(0)
            if ready or _clock() >= end:
                return ready
            os.sched_yield()  # a client waiting for this CPU runs first

    def _clients_waiting(self, selector) -> bool:
        """Whether a request waits (for the tiers' placing, ``TierSet.tick``): the
        connections found ready are kept for the next turn, which serves them first
        (their reports are taken: they are one-shot); the listener and the wake socket
        stay ready for it."""
        ready = selector.select(0)
        self._caught += [item for item in ready if item[0].data is not None]
        return bool(ready or self._caught)

    def _serve_ready(self, selector, ready) -> None:
        connections = self._connections
        for key, events in ready:
            sock = key.fileobj
            if sock is self._listener:
                connections.accept(selector)
            elif sock is self._wake_r:
                self._woken = True
                try:
                    self._wake_r.recv(64)
                except BlockingIOError:
                    pass
            else:
                conn: _Conn = key.data
                if connections.conns.get(conn.conn_id) is not conn:
                    continue  # dropped since it was reported (its descriptor may be reused)
                if events & selectors.EVENT_READ:
                    connections.on_readable(conn, selector)  # (watched again once it has read)
                else:
                    selector.rearm(conn.sock, conn.events)
                if events & selectors.EVENT_WRITE and not conn.closing:
                    connections.flush(conn, selector)

    # -- tiers ---------------------------------------------------------------------------

    def _wake_for_tiers(self) -> None:
        """Wake the loop (from a tier's worker thread): copies are done."""
        wake = self._wake_w
        if wake is not None:
            try:
                wake.send(b"t")
            except OSError:
                pass

    def _tier_turn(self, tiers: Union[TierSet, RemoteTierSet], selector) -> None:
        """Let the tiers move blocks; answer the requests whose promotions are done,
        then the requests their connections sent meanwhile."""
        woken, self._woken = self._woken, False
        connections = self._connections
        for promotion in tiers.tick(woken, lambda: self._clients_waiting(selector)):
            connections.promotion_done(promotion.context, selector)


def freeze_startup_objects() -> None:
    """For a process that only serves a coordinator: move everything alive now (torch,
    the pool's views) out of the garbage collector's reach, so that collections
    triggered by per-sequence objects scan only those. Never called for a coordinator
    embedded in someone else's process."""
    gc.collect()
    gc.freeze()


# -- a coordinator in its own process ----------------------------------------------------------
# Starting the process (``spawn`` context), waiting for it to be ready with a timeout,
# stopping it, and making sure it never outlives the process that started it: the child
# watches a pipe to its parent and stops when the pipe closes, however the parent dies.


def _child_main(config_wire: dict, name, address, options: dict, pipe) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent's Ctrl-C is the parent's
    try:
        coord = Coordinator(
            PoolConfig.from_wire(config_wire), name=name, address=address, **options
        )
        coord.open()
    except BaseException as exc:  # report any start failure to the parent, then exit
        pipe.send(("error", type(exc).__name__, str(exc)))
        pipe.close()
        return
    pipe.send(("ready", coord.address, os.getpid()))
    freeze_startup_objects()

    def watch_parent() -> None:
        try:
            pipe.recv()  # "stop", or EOFError when the parent is gone
        except (EOFError, OSError):
            pass
        coord.stop()

    signal.signal(signal.SIGTERM, lambda *_: coord.stop())
    threading.Thread(target=watch_parent, daemon=True).start()
    coord.serve_forever()


class SpawnedCoordinator:
    """Handle on a coordinator process started by :meth:`Coordinator.spawn`.

    Attributes: ``address`` (socket path), ``pid``, ``process``.
    """

    def __init__(self, process, pipe, address: str, pid: int):
        self.process = process
        self._pipe = pipe
        self.address = address
        self.pid = pid

    @classmethod
    def start(
        cls,
        config: PoolConfig,
        name: Optional[str] = None,
        address: Optional[str] = None,
        timeout: float = 60.0,
        **options,
    ) -> "SpawnedCoordinator":
        options.setdefault("spin_us", DEFAULT_SPIN_US)  # its own process: see _spin
        ctx = multiprocessing.get_context("spawn")
        parent_end, child_end = ctx.Pipe()
        process = ctx.Process(
            target=_child_main,
            name="shmkv-coordinator",
            daemon=True,
            args=(config.to_wire(), name, address, options, child_end),
        )
        process.start()
        child_end.close()
        if not parent_end.poll(timeout):
            process.kill()
            process.join(5)
            parent_end.close()
            raise CoordinatorTimeout(f"coordinator process did not start within {timeout} s")
        try:
            message = parent_end.recv()
        except EOFError:
            message = (
                "error",
                "ShmkvError",
                f"coordinator process died at start (exit code {process.exitcode})",
            )
        if message[0] != "ready":
            process.join(5)
            if process.is_alive():
                process.kill()
                process.join(5)
            parent_end.close()
            from shmkv import errors

            cls_ = getattr(errors, message[1], ShmkvError)
            if not (isinstance(cls_, type) and issubclass(cls_, ShmkvError)):
                cls_ = ShmkvError
            raise cls_(message[2])
        return cls(process, parent_end, message[1], message[2])

    def is_alive(self) -> bool:
        return self.process.is_alive()

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the process to stop; kill it if it has not within ``timeout``. Idempotent.

        Also removes the socket file a coordinator killed earlier left behind.
        """
        if self._pipe is not None:
            try:
                self._pipe.send("stop")
            except OSError:
                pass
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        if self._pipe is not None:
            self._pipe.close()
            self._pipe = None
        if not self.process.is_alive():
            remove_stale_socket(self.address)

    def kill(self) -> None:
        """SIGKILL the coordinator (for crash tests) and reap it. Like a real crash, this
        leaves its socket file; :meth:`stop` or the next coordinator on the address
        removes it."""
        self.process.kill()
        self.process.join(5)
        if self._pipe is not None:
            self._pipe.close()
            self._pipe = None

    def __enter__(self) -> "SpawnedCoordinator":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
