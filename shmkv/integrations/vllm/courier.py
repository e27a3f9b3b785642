"""The connector's connections to the coordinator, each used from a thread of its own.

This module owns how either side of the connector connects (:class:`Dialer`: the client
and the checks of its pool), the connection that serves a side's requests off vLLM's
threads (:class:`_Courier` and its job records), the scheduler's waits for tier copies
(:class:`_Settler`), and the releases that need no answer. It does not decide what to
ask (the scheduler and worker sides do), and it holds no request's state. It imports
only the connector's settings.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import shmkv
from shmkv.errors import ShmkvError
from shmkv.integrations.vllm.settings import (
    ConnectorConfigError,
    ConnectorLayoutError,
    ConnectorSettings,
)

log = logging.getLogger("shmkv.vllm")

# The client timeout (handshakes, and requests on the workers' own threads).
CLIENT_TIMEOUT_S = 10.0
SETTLE_TIMEOUT_S = 60.0  # the longest an asynchronous load waits for a tier's copies


class Dialer:
    """How one side of the connector connects: a new client of the coordinator at
    ``settings.address``, its pool checked against the engine (and, through ``check``,
    against whatever else the side knows by then: the worker's registered tensors).
    ``connected`` is the last attempt's outcome (logged on change). Used at start-up on
    vLLM's thread, then only by the side's :class:`_Courier` thread."""

    def __init__(
        self,
        settings: ConnectorSettings,
        tp_rank: Optional[int],
        prefault: bool,
        check: Optional[Callable[[Any], None]] = None,
    ):
        self._settings = settings
        self._tp_rank = tp_rank
        self._prefault = prefault
        self._check = check
        self.connected = False  # the last connection attempt's outcome (logged on change)
        self._tried = False  # (the first failed attempt is logged as a warning)
        self._refused = ""  # why the last pool was refused (logged once per reason)

    def dial(self):
        """A new client of the coordinator, its pool checked (:meth:`check_pool`, and
        ``check``); logs and raises why when there is none."""
        s = self._settings
        try:
            if s.tp_size > 1 and self._tp_rank is not None:
                client = shmkv.connect(
                    s.address,
                    tp_rank=self._tp_rank,
                    tp_size=s.tp_size,
                    name=s.client_name,
                    prefault=self._prefault,
                    timeout=CLIENT_TIMEOUT_S,
                )
            else:
                client = shmkv.connect(
                    s.address,
                    name=s.client_name,
                    prefault=self._prefault,
                    timeout=CLIENT_TIMEOUT_S,
                )
        except (ShmkvError, OSError) as exc:
            log.log(
                logging.WARNING if self.connected or not self._tried else logging.DEBUG,
                "shmkv: coordinator at %s unavailable (%s); no hits, retry in %.0f s",
                s.address,
                exc,
                s.retry_s,
            )
            self._tried = True
            self._set_connected(False)
            raise
        try:
            self.check_pool(client.config)
            if self._check is not None:
                self._check(client.config)
        except ConnectorConfigError as exc:
            client.close()
            if str(exc) != self._refused:  # (once per reason, not at every retry)
                self._refused = str(exc)
                log.error("shmkv: %s; not using it, retry in %.0f s", exc, s.retry_s)
            self._set_connected(False)
            raise
        if self._prefault:
            log.info("shmkv: pool mapped into this worker in %.2f s", client.prefault_s)
        log.info(
            "shmkv: connected to the coordinator at %s (instance %s)",
            s.address,
            client.instance,
        )
        self._set_connected(True)
        return client

    def connect_at_start(self):
        """Connect at start-up, on the calling thread: a pool that does not fit raises
        :class:`ConnectorConfigError` now, before the model loads; a coordinator that is
        not up is only logged (None: the courier connects later)."""
        try:
            return self.dial()
        except ConnectorConfigError:
            raise
        except (ShmkvError, OSError):
            return None

    def _set_connected(self, up: bool) -> None:
        """Note (and log, once per change) whether this side is connected."""
        if up != self.connected:
            self.connected = up
            if not up:
                log.warning(
                    "shmkv: disconnected from the coordinator at %s", self._settings.address
                )

    def check_pool(self, cfg) -> None:
        """Refuse a pool this engine cannot use: its block size must divide vLLM's, it
        must be built for vLLM's tensor-parallel size, and its layers, KV heads, head size
        and dtype must be the model's (as far as the model config tells, on both sides at
        start-up: before the model loads; the workers check vLLM's tensors again when
        they register them).

        Raises:
            ConnectorLayoutError: a pool of another layout (the message says what to run).
        """
        s = self._settings
        if s.block_size % cfg.block_size:
            divisors = [d for d in (16, 32, 64, 128) if s.block_size % d == 0]
            raise ConnectorLayoutError(
                f"shmkv pool block size {cfg.block_size} does not divide vLLM's block size "
                f"{s.block_size}: start the coordinator with --block-size one of "
                f"{divisors} (or vLLM with --block-size a multiple of {cfg.block_size} that "
                f"its kernels take)"
            )
        if s.tp_size > 1 and cfg.tp_size != s.tp_size:
            # (an engine without tensor parallelism reads and writes whole blocks: any
            # pool's; a rank of a TP engine needs the pool's head shard of that rank)
            raise ConnectorLayoutError(
                f"the shmkv pool at {s.address} is built for tensor_parallel_size "
                f"{cfg.tp_size}, this engine runs {s.tp_size}: start the coordinator "
                f"with --tp-size {s.tp_size}"
            )
        if s.expected is not None:
            self.check_shape(cfg, s.expected)

    def check_shape(self, cfg, want: Dict[str, Any]) -> None:
        """Refuse a pool whose layers, KV heads, head size or dtype are not ``want``'s.

        Raises:
            ConnectorLayoutError: they differ (the message says what to run).
        """
        have = dict(
            num_layers=cfg.num_layers,
            kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            dtype=str(cfg.dtype).replace("torch.", ""),
        )
        if want != have:
            raise ConnectorLayoutError(
                f"the shmkv pool at {self._settings.address} holds {have}, this engine's "
                f"K/V is {want}: start the coordinator with shmkv serve --num-layers "
                f"{want['num_layers']} --num-kv-heads {want['kv_heads']} --head-dim "
                f"{want['head_dim']} --dtype {want['dtype']} --tp-size {self._settings.tp_size}"
            )


def log_refused(client) -> None:
    """Log what the coordinator refused of the requests ``client`` sent without waiting
    (commits and releases: a refused commit is a save not cached)."""
    if client is not None:
        for op, exc in client.posted_errors():
            log.warning("shmkv: %s refused (%s); that save is not cached", op, exc)


def _release(handle) -> None:
    """Drop a reference without waiting for the answer (the coordinator serves it before
    the client's next request; nothing here needs the blocks afterwards)."""
    try:
        handle.client.close_many([handle], wait=False)
    except (ShmkvError, OSError):
        pass  # a coordinator gone: its references went with it


class _Settler:
    """Waits, on a daemon thread and a connection of its own, for the tier copies of the
    scheduler's lookups that were answered early (``allocate(..., wait=False)``), so the
    scheduler keeps scheduling meanwhile. ``submit`` takes a hand-off token of the
    lookup's sequence and returns a ticket; the thread opens the token, waits in
    ``settle`` and drops its reference; ``take(ticket)`` gives the hit then: the
    sequence's ``num_cached_tokens``, or None when the wait failed (the coordinator gone,
    or the copies not done ``SETTLE_TIMEOUT_S`` after the lookup: the load then takes
    only what was in the pool). One wait at a time: one queued behind a stuck one gives
    up as soon as it is its turn past its own time, so every lookup's wait ends within
    ``2 * SETTLE_TIMEOUT_S``."""

    def __init__(self, address: str, name: str):
        self._address = address
        self._name = name
        self._jobs: "queue.SimpleQueue[Optional[Tuple[int, bytes, float]]]" = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._next = 0
        self._wanted: set = set()
        self._done: Dict[int, Optional[int]] = {}
        self._stopped = False
        self._client: Optional[shmkv.Client] = None
        self._thread = threading.Thread(target=self._serve, name="shmkv-settle", daemon=True)
        self._thread.start()

    def submit(self, token: bytes) -> int:
        """Wait for the sequence of hand-off ``token``; the ticket to :meth:`take`."""
        with self._lock:
            self._next += 1
            ticket = self._next
            self._wanted.add(ticket)
        self._jobs.put((ticket, token, time.monotonic() + SETTLE_TIMEOUT_S))
        return ticket

    def take(self, ticket: int) -> Tuple[bool, Optional[int]]:
        """``(True, hit or None)`` once the wait of ``ticket`` ended (given once), else
        ``(False, None)``."""
        with self._lock:
            if ticket in self._done:
                self._wanted.discard(ticket)
                return True, self._done.pop(ticket)
        return False, None

    def forget(self, ticket: int) -> None:
        """Nobody takes ``ticket`` now: its answer, when it comes, is dropped."""
        with self._lock:
            self._wanted.discard(ticket)
            self._done.pop(ticket, None)

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None or self._stopped:
                break
            ticket, token, deadline = job
            with self._lock:
                wanted = ticket in self._wanted
            hit = self._settle(token, deadline, wanted)
            with self._lock:
                if ticket in self._wanted:
                    self._done[ticket] = hit
        if self._client is not None:
            self._client.close()

    def _settle(self, token: bytes, deadline: float, wanted: bool = True) -> Optional[int]:
        """The settled hit of hand-off ``token``'s sequence, or None. Not ``wanted`` (or
        past ``deadline``) it only opens and drops the hand-off, which would otherwise
        hold the sequence until it expires."""
        late = time.monotonic() >= deadline
        if late and wanted:
            log.warning(
                "shmkv: tier copies not done in %.0f s; loaded as far as in the pool",
                SETTLE_TIMEOUT_S,
            )
        try:
            client = self._client
            if client is None or not client.is_alive():
                if client is not None:
                    client.close()
                client = self._client = shmkv.connect(
                    self._address, timeout=SETTLE_TIMEOUT_S, name=self._name
                )
            handle = client.open(token)
            try:
                return handle.settle() if wanted and not late else None
            finally:
                _release(handle)
        except Exception as exc:  # noqa: BLE001 - a failed wait is a shorter load
            log.warning("shmkv: waiting for tier copies failed (%s)", exc)
            return None

    def close(self) -> None:
        """Stop after the wait under way (its thread is a daemon: a stuck wait cannot
        hold up exit); queued waits are dropped."""
        self._stopped = True
        self._jobs.put(None)
        self._thread.join(1.0)


class _Late(ShmkvError):
    """The coordinator did not answer within the caller's time (counted as a miss)."""


class _NotYet(Exception):
    """A request queued for the courier has no answer yet (:meth:`_Courier.take`)."""


class _Job:
    __slots__ = ("fn", "abandon", "done", "lock", "late", "started", "result", "error")

    def __init__(self, fn: Callable[[Any], Any], abandon: Optional[Callable[[Any], None]]):
        self.fn, self.abandon = fn, abandon
        self.done = threading.Event()
        self.lock = threading.Lock()
        self.late = False  # given up by its caller: its result goes to ``abandon``
        self.started: Optional[float] = None  # when the thread began it (monotonic)
        self.result: Any = None
        self.error: Optional[BaseException] = None


class _Courier:
    """One connection to the coordinator, used only from a daemon thread of its own, so
    that none of vLLM's threads ever waits on the socket or on a handshake.

    :meth:`call` hands the thread a request (a function of the client) and waits at most
    ``timeout`` for its answer (the scheduler's ``"shmkv.lookup_timeout_s"``, 1 s by
    default): a later answer is a miss, and what it made (a lookup's handle) goes to
    ``abandon`` on the thread (which releases it). While a request is outstanding past
    that time (a coordinator that stopped answering), further calls give up at once
    (:meth:`stuck`), so requests with nothing to look up never queue behind it.
    :meth:`post` queues a request nobody waits for (releases, counts, a connect).

    The thread (re)connects before a request when it has no live client: at once after a
    client was found gone (a restarted coordinator serves the next lookup), and
    ``retry_s`` after a failed attempt; with ``poll``, also on its own while it has none
    (every ``retry_s``, at least ``MIN_POLL_S``), so that a coordinator started after the
    engine serves its first request, and it checks a live client as often while idle, so
    that one restarted while no request came is connected before the next one. ``client``
    is the live client or None (read from any thread; only the courier's thread sets it);
    ``instance``, its coordinator's.
    """

    MIN_POLL_S = 0.1

    def __init__(
        self,
        dial: Callable[[], Any],
        retry_s: float,
        client=None,
        name: str = "shmkv-courier",
        poll: bool = False,
    ):
        self._dial = dial
        self._retry_s = retry_s
        self._poll = poll
        self.client = client
        self._down_until = 0.0
        self._jobs: "queue.Queue[Optional[_Job]]" = queue.Queue()
        self._busy_since: Optional[float] = None
        self._kicked = False
        self._closing = False
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    @property
    def instance(self) -> Optional[str]:
        """The instance id of the coordinator the live client is connected to, or None."""
        client = self.client
        return client.instance if client is not None and client.is_alive() else None

    def stuck(self, timeout: float) -> bool:
        """Whether a request has been under way for longer than ``timeout``."""
        since = self._busy_since
        return since is not None and time.monotonic() - since > timeout

    def call(
        self,
        fn: Callable[[Any], Any],
        timeout: float,
        abandon: Optional[Callable[[Any], None]] = None,
    ) -> Any:
        """``fn(client)`` on the thread; its result within ``timeout`` seconds.

        Raises:
            _Late: no answer in time (or an earlier request is still under way past it).
            shmkv.CoordinatorGone: no coordinator to ask (connecting failed).
            Exception: what ``fn`` raised.
        """
        job = self.submit(fn, timeout, abandon)
        try:
            return self.take(job, timeout)
        except _NotYet:
            if self.abandon(job):
                return self.take(job, 0)  # (answered as it was given up)
            raise _Late(f"no answer within {timeout * 1000:.0f} ms") from None

    def submit(
        self,
        fn: Callable[[Any], Any],
        timeout: float,
        abandon: Optional[Callable[[Any], None]] = None,
    ) -> _Job:
        """Queue ``fn(client)`` for the thread; :meth:`take` its answer, or
        :meth:`abandon` it (then ``abandon(result)`` runs on the thread once it is made).

        Raises:
            _Late: an earlier request is still under way ``timeout`` after it began (a
                coordinator that stopped answering): nothing is queued.
        """
        if self.stuck(timeout):
            raise _Late("the coordinator has not answered an earlier request")
        job = _Job(fn, abandon)
        self._jobs.put(job)
        return job

    @staticmethod
    def take(job: _Job, wait: float) -> Any:
        """The answer of ``job`` (waiting at most ``wait`` seconds for it).

        Raises:
            _NotYet: not answered yet.
            Exception: what the request raised.
        """
        if not job.done.wait(wait):
            raise _NotYet()
        if job.error is not None:
            raise job.error
        return job.result

    @staticmethod
    def abandon(job: _Job) -> bool:
        """Nobody takes ``job``'s answer: what it makes goes to its ``abandon`` on the
        thread. False when that is so; True when it was answered already (the caller
        takes it, and disposes of it)."""
        with job.lock:
            if job.done.is_set():
                return True
            job.late = True
            return False

    def post(self, fn: Callable[[Any], Any]) -> None:
        """``fn(client)`` on the thread, in order with the other requests, not waited
        for (a failure is logged at debug level: releases of a gone coordinator's
        references, say, which went with it)."""
        self._jobs.put(_Job(fn, None))

    def kick(self) -> None:
        """Connect now if there is no live client (once per kick until it is tried)."""
        if not self._kicked and self.instance is None:
            self._kicked = True
            self._jobs.put(_Job(lambda client: None, None))

    def connect_now(self, timeout: float) -> Optional[str]:
        """Connect unless connected (waiting at most ``timeout``); the coordinator's
        instance id, or None when there is none (the attempt may go on after the wait)."""
        if self.instance is None:
            try:
                self.call(lambda client: None, timeout)
            except (ShmkvError, OSError):
                return None
        return self.instance

    def close(self, timeout: float = 1.0) -> None:
        """Stop after the queued requests (at most ``timeout`` seconds; the thread is a
        daemon, so a stuck request cannot hold up exit) and close the client; a thread
        still stuck then makes no new connection, and closes the client when it ends."""
        self._closing = True
        self._jobs.put(None)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            client, self.client = self.client, None
            if client is not None:
                _quietly_close(client)

    def _serve(self) -> None:
        while True:
            try:
                job = self._jobs.get(timeout=self._idle_wait())
            except queue.Empty:  # (polling: time to try connecting again)
                self._busy_since = time.monotonic()  # (a handshake that hangs is stuck too)
                try:
                    self._live()
                except Exception:  # noqa: BLE001 - logged by the dial; tried again later
                    pass
                finally:
                    self._busy_since = None
                continue
            if job is None:
                client, self.client = self.client, None
                if client is not None:
                    _quietly_close(client)
                return
            with job.lock:
                if job.late:  # given up before it began (a lookup past its time): skipped
                    continue
                job.started = self._busy_since = time.monotonic()
            result: Any = None
            error: Optional[BaseException] = None
            try:
                self._kicked = False
                result = job.fn(self._live())
            except Exception as exc:  # noqa: BLE001 - handed to the caller
                error = exc
            finally:
                self._busy_since = None
            with job.lock:
                if not job.late:
                    job.result, job.error = result, error
                    job.done.set()
                    continue
            if error is None and job.abandon is not None:
                try:
                    job.abandon(result)
                except Exception as exc:  # noqa: BLE001 - a late answer's leftovers
                    log.debug("shmkv: dropping a late answer failed (%s)", exc)
            elif error is not None:
                log.debug("shmkv: a request nobody waits for failed (%s)", error)

    def _idle_wait(self) -> Optional[float]:
        """How long the idle thread waits for a request before it checks its connection
        on its own, connecting when there is none (None: not before a request, when not
        polling). Connected, it looks every ``retry_s`` (a coordinator that went away
        while the engine was idle is replaced before the next request, which then hits).
        """
        if not self._poll:
            return None
        if self.instance is not None:
            return max(self._retry_s, self.MIN_POLL_S)
        return max(self._down_until - time.monotonic(), self.MIN_POLL_S)

    def _live(self):
        client = self.client
        if client is not None and client.is_alive():
            return client
        if client is not None:
            self.client = None
            _quietly_close(client)
            self._down_until = 0.0  # gone: the next coordinator is asked for at once
            log.warning(
                "shmkv: the coordinator at %s went away; connecting again", _address_of(client)
            )
        if self._closing:
            raise shmkv.CoordinatorGone("the connector is shutting down")
        if time.monotonic() < self._down_until:
            raise shmkv.CoordinatorGone("no coordinator connected (retrying later)")
        try:
            client = self._dial()
        except Exception:
            self._down_until = time.monotonic() + self._retry_s
            raise
        self.client = client
        return client


def _drop_tokens(client, tokens: List[bytes]) -> None:
    """Open and drop hand-offs nobody will open (each would pin its blocks until it
    expires); on the courier's thread."""
    for token in tokens:
        try:
            _release(client.open(token))
        except (ShmkvError, OSError):
            pass  # expired, or its coordinator gone: it pins nothing


def _release_found(found: Tuple[Any, Any, Any, float]) -> None:
    """Release what a lookup nobody took made: its handle and hand-offs (none when the
    lookup was not made)."""
    handle, settle, tokens, _made_at = found
    if handle is not None:
        _drop_tokens(handle.client, ([settle] if settle else []) + (tokens or []))
        _release(handle)


def _quietly_close(client) -> None:
    try:
        client.close()
    except Exception:  # noqa: BLE001 - a dead coordinator's client closes as it can
        pass


def _address_of(client) -> str:
    return str(getattr(client, "address", "?"))
