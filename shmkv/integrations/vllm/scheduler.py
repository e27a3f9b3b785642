"""The scheduler side of the vLLM connector: lookups, and each step's connector metadata.

This module owns :class:`ShmkvConnectorScheduler`, what vLLM's scheduler asks of the
connector (how much of a prompt shmkv holds, which blocks to load and save in a step,
when a request is done), and its per-request state: the lookup's handle, which pins the
hit blocks until the workers have loaded them, and the workers' hand-offs made with it.
It tells the workers what to do only through :class:`ShmkvConnectorMetadata`, and hears
from them only through vLLM's channels (:meth:`ShmkvConnectorScheduler.update_connector_output`).
It does not copy K/V nor touch the pool's pages (the worker side does), and it talks to
the coordinator only on its courier's thread. It imports the connector's settings,
identity, metadata and courier modules, never the worker side.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import shmkv
from shmkv.errors import ShmkvError
from shmkv.integrations.vllm.courier import (
    SETTLE_TIMEOUT_S,
    Dialer,
    _Courier,
    _drop_tokens,
    _Job,
    _Late,
    _NotYet,
    _release,
    _release_found,
    _Settler,
    log_refused,
)
from shmkv.integrations.vllm.identity import key_tokens, request_salt
from shmkv.integrations.vllm.metadata import (
    ShmkvConnectorMetadata,
    ShmkvReqMeta,
    ShmkvWorkerMetadata,
)
from shmkv.integrations.vllm.settings import ConnectorSettings

try:  # where each loaded token came from (vLLM 0.32)
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError:  # pragma: no cover
    CacheHitSource = None  # type: ignore[misc, assignment]

log = logging.getLogger("shmkv.vllm")

# The longest vLLM's scheduler thread waits for lookups' answers in one step: one not
# there by then is asked for again at the next step (vLLM schedules others meanwhile).
LOOKUP_WAIT_S = 0.002
# How often a request that waits for a prefix another engine is computing asks again
# whether it is there (``"shmkv.wait_computing_s"``).
COMPUTING_POLL_S = 0.02
# The longest vLLM's thread sleeps in a step that scheduled nothing while requests wait
# for prefixes others compute (an idle engine would otherwise spin through empty steps,
# taking a CPU from the engines that compute them).
IDLE_WAIT_S = 0.01


@dataclass
class _SchedReq:
    handle: Any  # the scheduler's reference (pins the hit blocks until they are loaded)
    prompt_tokens: int  # tokens the handle covers (the prompt's full vLLM blocks)
    hit: int  # loadable tokens in shmkv, whole vLLM blocks
    cached: int  # the handle's num_cached_tokens (pool blocks)
    block_ids: List[int] = field(default_factory=list)
    load: Tuple[int, int] = (0, 0)
    saved: int = 0  # tokens [0, saved) are in the pool or sent to be saved
    exported: bool = False
    # The workers read a load through the handle's descriptor: the handle stays until the
    # request finishes (request_finished), however early the lookup is done with.
    peeked: bool = False
    # A tier still copies part of the hit into the pool (the allocate answered early):
    # vLLM is told the load is asynchronous, and the workers get it once it settled.
    pending: bool = False
    told_async: bool = False  # the last answer to vLLM said the load is asynchronous
    ticket: int = 0  # the pending wait's (``_Settler``)
    resident: int = 0  # leading hit tokens in the pool at the lookup, whole vLLM blocks
    sure: int = 0  # leading hit tokens in the pool or this host's tiers, whole vLLM blocks
    cap: int = 0  # the most tokens shmkv could give (the prompt less its last token)
    local: int = 0  # tokens vLLM's own prefix cache had when it last asked
    missed: int = 0  # tokens asked for and not found, for the workers to report
    # The workers' hand-offs, made with the lookup (a request that saves needs them in its
    # first step; made then, they would cost vLLM's thread a round trip), and when.
    tokens: Optional[List[bytes]] = None
    tokens_at: float = 0.0
    defer: bool = False  # looked up with defer: others wait for the blocks it computes


@dataclass
class _Deferred:
    """A request waiting for the prefix others compute (``"shmkv.wait_computing_s"``)."""

    cached: int  # the pool's part of its prompt when last asked
    until: float  # when it stops waiting (monotonic): no progress for that long
    next_ask: float  # when it asks again


def _release_lookup(found: Any) -> None:
    """Release what a lookup nobody took made (a ``Computing`` answer made nothing)."""
    if not isinstance(found, shmkv.Computing):
        _release_found(found)


class _Asked(NamedTuple):
    """A lookup asked of the courier and not answered yet."""

    job: "_Job"
    full: int  # the prompt's tokens in whole vLLM blocks (what the lookup asks for)
    prompt_len: int
    defer: bool  # asked with defer: the coordinator notes the blocks it will compute


class ShmkvConnectorScheduler:
    """The connector's scheduler side (the facade :class:`ShmkvConnector` holds one in
    vLLM's scheduler process): each hook is the facade's hook of the same name.

    ``settings`` are the connector's (:func:`read_settings`), ``namespace`` the engine's
    (:func:`model_identity`). Connects at once, on the calling thread, so that a pool
    that does not fit is refused at start-up (:class:`ConnectorLayoutError`); a
    coordinator that is not up yet is connected to later by the courier's thread.
    """

    def __init__(self, settings: ConnectorSettings, namespace: bytes):
        self._address = settings.address
        self._retry_s = settings.retry_s
        self._lookup_timeout_s = settings.lookup_timeout_s
        self._handoff_ttl_s = settings.handoff_ttl_s
        self._wait_computing_s = settings.wait_computing_s
        self._step_tokens = settings.step_tokens
        self._wait_min_tokens = settings.wait_min_tokens
        self._client_name = settings.client_name
        self._block_size = settings.block_size
        self._tp_size = settings.tp_size
        self._namespace = namespace
        self._reqs: Dict[str, _SchedReq] = {}
        # lookups asked of the courier, not answered yet: (job, when it is a miss)
        self._asking: Dict[str, _Asked] = {}
        self._lookup_waited = False  # a lookup waited for its answer in this step
        # lookups done with whose descriptors the workers read: released when the
        # request finishes (see _finish)
        self._pins: Dict[str, List[Any]] = {}
        self._closed: List[str] = []
        self._recv_dropped: List[str] = []
        # requests vLLM admitted as asynchronous loads, not handed to the workers yet
        self._waiting: Dict[str, _SchedReq] = {}
        self._settler: Optional[_Settler] = None  # made by the first early answer
        # requests waiting for prefixes other engines are computing now
        self._deferred: Dict[str, _Deferred] = {}
        # Prompt tokens this engine told the coordinator it computes (a lookup made with
        # defer, asked or answered), for requests vLLM has not scheduled yet, and since
        # when: the other engines wait for them (see _holds_off)
        self._claims: Dict[str, Tuple[int, float]] = {}
        self._idle_step = False  # the last step scheduled nothing
        # Only a worker copies through the pool; the scheduler never touches its pages.
        self._dialer = Dialer(settings, tp_rank=None, prefault=False)
        client = self._dialer.connect_at_start()  # refuses a misfit pool now, when it is up
        self._courier = _Courier(
            self._dialer.dial, self._retry_s, client, "shmkv-scheduler", poll=True
        )
        self._pool_is_cuda = client is not None and client.config.is_cuda
        # What each worker rank last reported (ShmkvWorkerMetadata): the instance id of
        # the coordinator it is connected to, or "!" and the one it failed to reach.
        self._worker_reports: Dict[int, str] = {}
        self._gate_logged = False
        self.num_late_lookups = 0  # lookups not answered in time (counted as misses)
        # requests that waited for a prefix another engine was computing
        self.num_computing_waits = 0

    @property
    def connected(self) -> bool:
        """Whether the last attempt to connect to the coordinator succeeded."""
        return self._dialer.connected

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        """Tokens past ``num_computed_tokens`` that shmkv holds for ``request``, in whole vLLM
        blocks, and whether they load asynchronously: True while a tier of this host (host
        memory, disk) still copies some of the blocks vLLM needs into the pool, False when
        those are there (or nothing is needed). None (vLLM asks again later, scheduling
        others meanwhile) while some of them are asked of the shared store, which may not
        have them, or while another engine is computing the prompt's next blocks (see
        ``"shmkv.wait_computing_s"``). 0 when the coordinator is gone."""
        state = self._reqs.get(request.request_id)
        if state is None:
            deferred = self._deferred.get(request.request_id)
            if deferred is not None and time.monotonic() < deferred.next_ask:
                self._idle_wait(deferred.next_ask)
                return None, False
            if self._holds_off(request, num_computed_tokens):
                return None, False
            try:
                state = self._lookup(request, local=num_computed_tokens)
            except _NotYet:  # asked, no answer yet: vLLM schedules others and asks again
                self._claim(request.request_id, None, num_computed_tokens)
                return None, False
            self._claim(request.request_id, state, num_computed_tokens)
            if state is None:
                return 0, False
        if state.pending and request.request_id not in self._waiting:
            self._take_settled(state)  # (settled by now? then the hit is final)
        state.local = num_computed_tokens
        num = max(0, state.hit - num_computed_tokens)
        # What vLLM is told: synchronous unless a tier still copies blocks it needs;
        # not known yet (None: vLLM asks again) while some of those are only maybe in
        # the store.
        state.told_async = False
        if num == 0 or not state.pending or state.hit <= state.resident:
            return num, False
        if state.hit > state.sure:
            return None, False
        state.told_async = True
        return num, True

    def _waits(self, prompt_len: int, local: int) -> bool:
        """Whether a prompt of ``prompt_len`` tokens, ``local`` of them in vLLM's own
        cache, is looked up with ``defer``: it waits for blocks another engine is
        computing, and claims those it computes for others to wait for. Only where it
        would compute more than ``"shmkv.wait_min_tokens"`` itself (by default a step's
        budget, ``max_num_batched_tokens``): a prompt vLLM computes in one step costs
        that step, no more than a wait (the other engine's step, then one of this
        engine's), and waits for such prompts chain: a chat's next turn waits for the
        turn before, which waits for the one before it."""
        if self._wait_computing_s <= 0:
            return False
        return prompt_len - local > self._wait_min_tokens

    def _holds_off(self, request, local: int) -> bool:
        """Whether ``request``'s first lookup waits for a later step: while the prompt
        tokens this engine has claimed (:meth:`_claim`) and vLLM has not scheduled yet
        fill a step's token budget (``max_num_batched_tokens``). A lookup made with
        ``defer`` tells the other engines this one computes the prompt's next blocks, and
        they wait for it; vLLM asks for every waiting request in a step, so without this
        a saturated engine would claim its whole queue, computed one budget a step while
        the others wait, idle. Only for a request that would claim (:meth:`_waits`), and
        not one that waits for others already (its claim is small). A claim older than
        ``"shmkv.wait_computing_s"`` no longer counts (the others stop waiting for a
        writer that long without progress): no request is held for longer than that."""
        req_id = request.request_id
        if (
            self._step_tokens <= 0
            or req_id in self._claims
            or req_id in self._asking
            or req_id in self._deferred
        ):
            return False
        since = time.monotonic() - self._wait_computing_s
        if sum(tokens for tokens, at in self._claims.values() if at > since) < self._step_tokens:
            return False
        num = request.num_prompt_tokens
        return num - local >= self._block_size and self._waits(num, local)

    def _claim(self, req_id: str, state: Optional[_SchedReq], local: int) -> None:
        """Note what ``req_id``'s lookup claims: while asked with ``defer``, the prompt
        past vLLM's own cache (``local``); answered, what the request computes and saves
        past the hit; nothing once others compute it, or it missed."""
        tokens = 0
        asked = self._asking.get(req_id)
        if asked is not None and asked.defer:
            tokens = max(0, asked.full - local)
        elif state is not None and state.defer and state.tokens:  # (tokens: it saves)
            tokens = max(0, state.prompt_tokens - max(state.hit, local))
        if tokens:
            _, at = self._claims.get(req_id, (0, time.monotonic()))
            self._claims[req_id] = (tokens, at)
        else:
            self._claims.pop(req_id, None)

    def _idle_wait(self, until: float) -> None:
        """In a step after one that scheduled nothing, sleep once until ``until`` (at
        most ``IDLE_WAIT_S``): an engine whose requests all wait for others' prefixes
        would otherwise spin through empty steps on a CPU those engines need."""
        if self._idle_step and not self._lookup_waited:
            self._lookup_waited = True
            time.sleep(max(0.0, min(until - time.monotonic(), IDLE_WAIT_S)))

    def _gate_open(self, instance: str) -> bool:
        """Whether hits from coordinator ``instance`` may be promised: not while a worker
        rank's last report says it failed to reach it (it connects again on its next
        step, and says so). A worker that is not connected to the coordinator a step's
        metadata names connects before it loads (:meth:`start_load_kv`), so after a
        coordinator restart the scheduler's first lookups are loaded, not failed."""
        blocked = "!" + instance
        if not any(self._worker_reports.get(r) == blocked for r in range(self._tp_size)):
            self._gate_logged = False
            return True
        if not self._gate_logged:
            self._gate_logged = True
            log.warning(
                "shmkv: a worker could not connect to coordinator instance %s; no hits "
                "are promised until it does",
                instance,
            )
        return False

    def update_connector_output(self, connector_output) -> None:
        """Take the workers' reports of which coordinator they are connected to."""
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, ShmkvWorkerMetadata):
            self._worker_reports.update(meta.instances)

    def _lookup(
        self, request, wait: Optional[float] = None, local: int = 0, scheduled: bool = False
    ) -> Optional[_SchedReq]:
        """The state of ``request``'s lookup; None when it missed or cannot be made.

        The lookup runs on the courier's thread: vLLM's thread waits at most
        ``LOOKUP_WAIT_S`` for lookups in one step, so that a busy coordinator or a busy host
        never holds up a step (decodes) for a round trip. An answer not there yet raises
        ``_NotYet`` (vLLM asks again next step); one not there ``"shmkv.lookup_timeout_s"``
        after the courier began it, or queued behind one that is (a coordinator that
        stopped answering), is a miss, and what it made is released when it comes (one
        that had not begun is never made). Lookups queued behind others answered in time
        wait their turn. A request whose prompt's next blocks another engine is computing
        now waits for them (``_NotYet``) while that engine publishes more of them at
        least every ``"shmkv.wait_computing_s"``, unless vLLM's own cache (``local``
        tokens) has them; it asks again every ``COMPUTING_POLL_S``.

        Raises:
            _NotYet: asked, not answered yet; or others compute what it would load.
        """
        req_id = request.request_id
        asked = self._asking.get(req_id)
        if asked is None:
            asked = self._ask(request, local)
            if asked is None:
                return None
            self._asking[req_id] = asked
        job = asked.job
        if wait is None:
            # One wait a step at most, however many requests wait for their lookups
            # (their answers come in order); waiting also lets the courier's thread take
            # the GIL from a scheduler that would otherwise spin through empty steps.
            wait = 0.0 if self._lookup_waited else LOOKUP_WAIT_S
            if not job.done.is_set():
                self._lookup_waited = True
        try:
            found = self._courier.take(job, wait)
        except _NotYet:
            # Late: under way for longer than the timeout, or queued behind a request
            # that is (a coordinator that stopped answering); one queued behind others
            # that are answered in time waits its turn.
            started, timeout = job.started, self._lookup_timeout_s
            if started is None:
                late = self._courier.stuck(timeout)
            else:
                late = time.monotonic() - started > timeout
            if not late or self._courier.abandon(job):
                raise
            del self._asking[req_id]
            log.debug("shmkv: lookup of %s counted as a miss (no answer in time)", req_id)
            self.num_late_lookups += 1
            return None
        except shmkv.CoordinatorGone as exc:  # (said once, as the connection went)
            del self._asking[req_id]
            log.debug("shmkv: request %s not looked up (%s)", req_id, exc)
            return None
        except (ShmkvError, OSError) as exc:  # no room, a prompt past max_seq_len
            del self._asking[req_id]
            log.info("shmkv: request %s not looked up (%s)", req_id, exc)
            return None
        del self._asking[req_id]
        if isinstance(found, shmkv.Computing):
            if not scheduled:  # (``scheduled``: vLLM runs it now; it computes, no wait)
                self._defer(req_id, found, local)
            raise _NotYet()
        self._deferred.pop(req_id, None)
        handle, settle, tokens, made_at = found
        prompt_tokens, prompt_len = asked.full, asked.prompt_len
        if handle is None:  # (a worker cannot reach this coordinator: _gate_open)
            return None
        bs = self._block_size
        cached = handle.num_cached_tokens
        cap = min(prompt_tokens, (prompt_len - 1) // bs * bs)
        state = _SchedReq(
            handle=handle,
            prompt_tokens=prompt_tokens,
            hit=min(cached // bs * bs, cap),
            cached=cached,
            saved=cached,
            cap=cap,
            tokens=tokens,
            tokens_at=made_at,
            defer=asked.defer,
        )
        if settle is not None:  # a tier copies part of the hit in: wait off this thread
            state.pending = True
            state.resident = handle.num_resident_tokens // bs * bs
            state.sure = (cached - handle.num_fetching_tokens) // bs * bs
            if self._settler is None:
                self._settler = _Settler(str(self._address), self._client_name)
            state.ticket = self._settler.submit(settle)
        self._reqs[request.request_id] = state
        return state

    def _defer(self, req_id: str, found: shmkv.Computing, local: int) -> None:
        """Request ``req_id`` waits for the blocks others compute (see :meth:`_lookup`)."""
        now = time.monotonic()
        deferred = self._deferred.get(req_id)
        cached, computing = found
        if cached + computing <= local:  # vLLM's own cache has them: ask again now
            self._deferred[req_id] = _Deferred(cached, now, now)
            return
        if deferred is None:
            deferred = _Deferred(cached, now + self._wait_computing_s, now)
            self._deferred[req_id] = deferred
            self.num_computing_waits += 1
            log.debug("shmkv: %s waits for %d tokens others compute", req_id, computing)
        elif cached > deferred.cached:  # they published more: wait on
            deferred.cached, deferred.until = cached, now + self._wait_computing_s
        deferred.next_ask = now + COMPUTING_POLL_S

    def _ask(self, request, local: int) -> Optional[_Asked]:
        """Queue ``request``'s lookup on the courier's thread: its sequence (the longest
        cached prefix pinned), a hand-off to wait on when a tier still copies part of it,
        and, when the request will save, the workers' hand-offs. None when there is
        nothing to look up, or no coordinator answering."""
        prompt = key_tokens(request)  # (zeros for a prompt of embeddings alone)
        full = len(prompt) // self._block_size * self._block_size
        if full == 0:
            return None
        # The salt covers the request's adapter, multimodal inputs and prompt embeddings;
        # None for an adapter whose files are not here: such a request is not cached.
        salt = request_salt(self._namespace, request)
        if salt is None:
            return None
        ttl, ranks = self._handoff_ttl_s, self._tp_size
        # Whether to ask first if others compute its next blocks (then it waits for them)
        deferred = self._deferred.get(request.request_id)
        wait = self._waits(len(prompt), local) and (
            deferred is None or time.monotonic() < deferred.until
        )

        def lookup(client):
            if not self._gate_open(client.instance):
                return None, None, None, 0.0
            defer = wait and "computing" in client.features
            handle = client.allocate(prompt=prompt[:full], cache_salt=salt, wait=False, defer=defer)
            if isinstance(handle, shmkv.Computing):  # others compute its next blocks: it waits
                return handle
            settle, tokens = None, []
            bound = "bound_handoffs" in client.features  # (they die with this engine)
            try:
                if handle.num_promoting_tokens:  # for the thread that waits for the copies
                    settle = handle.export(ttl=2 * SETTLE_TIMEOUT_S, bound=bound)
                if handle.num_cached_tokens < full:  # it saves: each rank's hand-off
                    for _ in range(ranks):
                        tokens.append(handle.export(ttl=ttl, bound=bound))
            except BaseException:
                _release_found((handle, settle, tokens, 0.0))  # (the tokens made so far too)
                raise
            return handle, settle, tokens or None, time.monotonic()

        try:
            job = self._courier.submit(lookup, self._lookup_timeout_s, _release_lookup)
        except _Late as exc:
            log.debug("shmkv: lookup of %s counted as a miss (%s)", request.request_id, exc)
            self.num_late_lookups += 1
            return None
        return _Asked(job, full, len(prompt), wait)

    def _take_settled(self, state: _SchedReq) -> bool:
        """Whether the tier copies of ``state``'s lookup are done; if so its hit is the
        settled one (shorter when a block did not arrive; what was in the pool when the
        wait failed)."""
        assert self._settler is not None  # (made by the lookup that set pending)
        done, cached = self._settler.take(state.ticket)
        if not done:
            return False
        state.pending = False
        if cached is None:
            state.hit = min(state.hit, state.resident)
        else:
            state.hit = min(state.hit, cached // self._block_size * self._block_size)
            state.cached = cached
            state.saved = min(state.saved, cached)
        return True

    def get_external_cache_hit_sources(self, request, num_external_tokens: int):
        """Where the ``num_external_tokens`` loaded for ``request`` come from: the pool
        (host memory for a CPU pool, ``host``; another process's device memory for a CUDA
        pool, ``p2p``) for the blocks that were in it at the lookup, a tier below it or
        the shared store for the rest (``external_unspecified``: the coordinator does not
        say which). None for a request this side did not look up (vLLM's default then)."""
        state = self._reqs.get(request.request_id)
        if num_external_tokens <= 0:
            return {}
        if state is None or CacheHitSource is None:
            return None  # (vLLM's default: the facade's)
        start = state.hit - num_external_tokens
        resident = state.resident if state.ticket else state.hit  # (ticket: tiers copied)
        in_pool = max(0, min(resident, state.hit) - start)
        pool = CacheHitSource.P2P if self._pool_is_cuda else CacheHitSource.HOST
        sources = {
            pool: in_pool,
            CacheHitSource.EXTERNAL_UNSPECIFIED: num_external_tokens - in_pool,
        }
        return {source: num for source, num in sources.items() if num > 0}

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        """Note the vLLM blocks of ``request`` and the tokens to load into them."""
        state = self._reqs.get(request.request_id)
        asked = self._asking.get(request.request_id)
        if state is None and asked is not None:
            # Scheduled while its lookup was "not known yet": vLLM does so with a request
            # that does not read the prefix cache (prompt logprobs), which still saves.
            # Its answer, if here, is taken now; else the lookup is dropped (released when
            # it comes) and the request computes and saves nothing.
            try:
                state = self._lookup(request, wait=0.0, scheduled=True)
            except _NotYet:
                self._asking.pop(request.request_id, None)
                self._drop_asked(asked)
        self._deferred.pop(request.request_id, None)  # (scheduled: it computes now)
        self._claims.pop(request.request_id, None)
        if state is None:
            return
        state.block_ids = list(blocks.get_block_ids()[0]) if blocks is not None else []
        # The coordinator counts, under this engine's name, what the engine took from it
        # (the workers report loads) and, here, what it asked for and computed instead,
        # not what the lookup found: vLLM's own cache may have had most of the prompt.
        state.missed = max(0, state.cap - state.local - num_external_tokens)
        if num_external_tokens > 0:
            state.load = (state.hit - num_external_tokens, state.hit)
            # vLLM was told the load is asynchronous: the request waits for the workers
            # to report it received (build_connector_meta hands it over once settled)
            if state.pending and state.told_async:
                self._waiting[request.request_id] = state
        else:
            state.load = (0, 0)

    def build_connector_meta(self, scheduler_output) -> ShmkvConnectorMetadata:
        """This step's loads and saves, with the hand-off tokens of new requests."""
        meta = ShmkvConnectorMetadata(
            closed=self._closed,
            recv_dropped=self._recv_dropped,
            coordinator=self._courier.instance or "",
        )
        self._closed, self._recv_dropped = [], []
        self._lookup_waited = False  # (a new step: a lookup may wait again, see _lookup)
        self._idle_step = not scheduler_output.total_num_scheduled_tokens
        self._courier.post(log_refused)
        for req_id, waiting in list(self._waiting.items()):
            if self._take_settled(waiting):
                del self._waiting[req_id]
                meta.requests.append(self._received(req_id, waiting))
        computed: Dict[str, int] = {}
        for new in scheduler_output.scheduled_new_reqs:
            state = self._reqs.get(new.req_id)
            if state is not None:
                state.block_ids = list(new.block_ids[0])
                computed[new.req_id] = new.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._reqs.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.block_ids = list(new_ids[0]) if new_ids is not None else []
            elif new_ids is not None:
                state.block_ids.extend(new_ids[0])
            computed[req_id] = cached.num_computed_tokens[i]
        for req_id, before in computed.items():
            state = self._reqs[req_id]
            after = before + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            end = min(after, state.prompt_tokens) // self._block_size * self._block_size
            if state.pending:  # saves start where the settled hit ends: none before it
                self._take_settled(state)
            save = (state.saved, end) if end > state.saved and not state.pending else (0, 0)
            load = state.load
            if save == (0, 0) and load == (0, 0):
                if not state.exported and state.saved >= state.prompt_tokens:
                    # Nothing to load (vLLM's own cache had it) nor to save (shmkv has it
                    # all): no hand-off, no worker round trip; the lookup's pin goes.
                    self._finish(req_id, tell_workers=True)
                continue
            item = ShmkvReqMeta(
                req_id=req_id,
                block_ids=list(state.block_ids),
                load=load,
                save=save,
                missed=state.missed,
            )
            state.missed = 0
            if not state.exported:
                self._hand_over(state, item)
            state.load = (0, 0)
            if save != (0, 0):
                state.saved = save[1]
            if state.saved >= state.prompt_tokens:
                item.done = True
                self._finish(req_id, tell_workers=False)
            meta.requests.append(item)
        return meta

    def _received(self, req_id: str, state: _SchedReq) -> ShmkvReqMeta:
        """The hand-over of an asynchronous load whose tier copies are done: the workers
        copy what arrived and report the request received (see :class:`ShmkvReqMeta`)."""
        start, end = state.load
        item = ShmkvReqMeta(
            req_id=req_id,
            block_ids=list(state.block_ids),
            load=(start, end),
            recv=True,
            valid=max(start, min(end, state.hit)),
        )
        item.tokens = self._made_tokens(state) or self._export(state)
        state.exported = True
        state.load = (0, 0)
        return item

    def _hand_over(self, state: _SchedReq, item: ShmkvReqMeta) -> None:
        """Give the workers the request's sequence, the first time they need it: for a
        load alone, the lookup handle's descriptor (no hand-off to make, open or close;
        the handle pins the blocks until the request finishes); for a step that saves,
        one hand-off token per rank, each rank's own reference to write through."""
        if item.save == (0, 0):
            item.source = self._source(state)
            if item.source is None:
                item.tokens = []  # (the workers report the load failed)
            state.peeked = True
        else:
            item.tokens = self._made_tokens(state) or self._export(state)
            state.exported = True

    def _made_tokens(self, state: _SchedReq) -> Optional[List[bytes]]:
        """The hand-offs made with the lookup, while they have at least half their time
        to live (a request that waited longer gets new ones)."""
        tokens, state.tokens = state.tokens, None
        if tokens and time.monotonic() - state.tokens_at < self._handoff_ttl_s / 2:
            return tokens
        if tokens:
            self._courier.post(lambda client: _drop_tokens(client, tokens))
        return None

    def _source(self, state: _SchedReq) -> Optional[bytes]:
        """The descriptor the workers read a load through (its handle stays open); None
        when the handle was lost (the coordinator went away)."""
        try:
            return state.handle.descriptor()
        except (ShmkvError, OSError) as exc:
            log.warning("shmkv: the lookup's handle is gone (%s); the workers recompute", exc)
            return None

    def _export(self, state: _SchedReq) -> List[bytes]:
        """One hand-off token per rank (asked on the courier's thread, waited for at most
        ``"shmkv.lookup_timeout_s"``); an empty list when there are none: the workers
        then save nothing and report a load as failed (vLLM recomputes it). A late
        answer's tokens are left to expire (``"shmkv.handoff_ttl_s"``)."""
        handle, ttl, num = state.handle, self._handoff_ttl_s, self._tp_size

        def export(client) -> List[bytes]:
            bound = "bound_handoffs" in client.features  # (they die with this engine)
            return [handle.export(ttl=ttl, bound=bound) for _ in range(num)]

        try:
            return self._courier.call(export, self._lookup_timeout_s)
        except (ShmkvError, OSError) as exc:
            log.warning("shmkv: hand-off failed (%s); the workers recompute", exc)
            return []

    def _drop(self, handle) -> None:
        """Release ``handle`` on the courier's thread, not waited for."""
        self._courier.post(lambda client: _release(handle))

    def _finish(self, req_id: str, tell_workers: bool, final: bool = False) -> None:
        """The scheduler is done with ``req_id``'s lookup (a later lookup of the request,
        after a preemption, starts anew). Its reference goes, unless the workers read a
        load through its descriptor: that one pins the blocks they may still be copying
        until the request is ``final`` (finished, or the connector shut down)."""
        state = self._reqs.pop(req_id, None)
        self._deferred.pop(req_id, None)
        self._claims.pop(req_id, None)
        asked = self._asking.pop(req_id, None)
        if asked is not None:
            self._drop_asked(asked)
        if final:
            for handle in self._pins.pop(req_id, ()):
                self._drop(handle)
        if state is None:
            return
        tokens, state.tokens = state.tokens, None
        if tokens:  # hand-offs made with the lookup, never handed to the workers
            self._courier.post(lambda client: _drop_tokens(client, tokens))
        if state.pending:  # its wait's answer, when it comes, goes to no one
            assert self._settler is not None  # (made by the lookup that set pending)
            self._settler.forget(state.ticket)
        if state.peeked and not final:
            self._pins.setdefault(req_id, []).append(state.handle)
        else:
            self._drop(state.handle)
        if tell_workers and (state.exported or state.peeked):
            self._closed.append(req_id)

    def _drop_asked(self, asked: _Asked) -> None:
        """Nobody takes the answer of lookup ``asked``: what it made is released, now if
        it was answered, else by the courier when it is (or never made, when it had not
        begun)."""
        if self._courier.abandon(asked.job):
            try:
                found = self._courier.take(asked.job, 0)
            except Exception:  # noqa: BLE001 - a failed lookup made nothing
                return
            self._courier.post(lambda client: _release_lookup(found))

    def request_finished(self, request, block_ids):
        """Drops the request's references. Saves finish within the step that computed the
        blocks (:meth:`wait_for_save` is synchronous), so vLLM may free the blocks now (an
        asynchronous load not handed over yet is reported received, with nothing copied,
        in the next step: vLLM frees its blocks then)."""
        if self._waiting.pop(request.request_id, None) is not None:
            # an asynchronous load not handed over: vLLM holds its blocks until the
            # workers report it received
            self._recv_dropped.append(request.request_id)
        self._finish(request.request_id, tell_workers=True, final=True)
        return False, None

    def shutdown(self) -> None:
        """Release every lookup's handle and hand-offs, and close the connection."""
        for req_id in {*self._reqs, *self._pins, *self._asking}:
            self._finish(req_id, tell_workers=False, final=True)
        if self._settler is not None:
            self._settler.close()
        # (closing the client drops every reference it still held, released or not)
        self._courier.close()
