"""The worker side: one connection to a coordinator and the pool mapped into this process.

Owns the client's user-facing API (allocating, extending, closing and opening handles,
batches and steps, stats, KV scales), mapping the pool without copying from the
handshake's descriptors, and the per-process registry that lets pickled handles find a
client when they are unpickled. The socket itself (the handshake, the peer's uid,
request ids, timeouts, requests sent without waiting, detecting a gone coordinator) is
the ``shmkv.client.link.Link`` a :class:`Client` holds (``_link``): the client makes
it, greets through it (``greet``), sends through ``exchange`` and ``post``, asks it
``check`` and ``is_alive``, and closes it (``close``); :meth:`Client.request`,
:meth:`Client.flush` and the rest of the connection's API pass through to it. Handles
themselves are in ``shmkv.client.handle``, batches and steps in ``shmkv.client.batch``.

Unpickling rule: a pickled handle is opened by a client of *the receiving process*
for the same coordinator, so it gets the receiver's tensor-parallel rank, never the
sender's. The client is, in order: the one made current in this thread with
``with client.as_unpickle_target():``; else the only open client of that coordinator
in this process; else a new full-view client (``connect(address)``) when there is
none. With several and none made current, unpickling raises ``InvalidArgument``.
Addresses are compared resolved (absolute, links followed: ``Client.address``), so
any spelling of a coordinator's socket path finds the rank's client.

A :class:`Client` is thread-safe: one request is on the wire at a time (a lock),
and data-plane reads and writes on handles need no lock at all.

The module runs past 800 lines and :class:`Client` past 600 because the class is the
public API: each request a user can make is a documented method here, while the work
behind them is the link's, the handles' and the batches'.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from array import array
from typing import ClassVar, Iterable, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from shmkv import protocol
from shmkv.client.batch import Batch, Step
from shmkv.client.handle import KvCacheHandle, SequencePeek, SequenceView
from shmkv.client.link import Link
from shmkv.errors import (
    HandleClosed,
    InvalidArgument,
    LimitExceeded,
    OutOfRange,
    ShmkvError,
    WrongType,
)
from shmkv.hashing import pack_tokens, packed_block_keys, root_key, token_list
from shmkv.memory import block_io
from shmkv.memory.block_io import ClientCopies
from shmkv.memory.layout import PoolConfig
from shmkv.memory.pool import PoolMemory, attach_pool, block_bytes
from shmkv.memory.tables import lock_free_reads

log = logging.getLogger("shmkv.client.client")
DEFAULT_TIMEOUT = 30.0
DEFAULT_PICKLE_TTL = 300.0


class Computing(NamedTuple):
    """A prompt others are computing: its tokens in the pool, and how many after them
    other clients' live sequences compute now (:meth:`Client.computing`; what
    ``allocate(..., defer=True)`` answers instead of a handle)."""

    cached_tokens: int
    computing_tokens: int


class Client:
    """A connection to a coordinator, with its pool mapped zero copy.

    Use :func:`connect` to make one. Attributes: ``address``, ``config``
    (:class:`PoolConfig`), ``tp_rank`` / ``tp_size`` (None when this client sees all
    heads), ``pool`` (this client's 6-d view of the pool: its head shard under
    tensor parallelism), ``timeout`` (seconds per request), ``features`` (what the
    coordinator offers: its hello's ``protocol.FEATURES``). Its connection (requests,
    :meth:`flush`, :meth:`posted_errors`, :meth:`check`, :meth:`is_alive`,
    ``max_frame``) is the ``shmkv.client.link.Link`` it holds.

    ``copy_promotions``: where the coordinator offers it (a CPU pool with tiers), an
    allocation waiting for blocks from a tier copies them in itself, in this process,
    instead of having the coordinator's tier I/O process copy them: the copies then take
    this client's CPU time, not the other clients' (``shmkv.tiers``). None (the default):
    unless the coordinator runs in this process, whose loop would then wait for the GIL
    behind the copies. True or False, set on a client or on the class: always, or never.
    """

    copy_promotions: Optional[bool] = None
    features: frozenset  # (set by the handshake)

    def __init__(
        self,
        address: str,
        tp_rank: Optional[int] = None,
        tp_size: Optional[int] = None,
        timeout: float = DEFAULT_TIMEOUT,
        pickle_ttl: float = DEFAULT_PICKLE_TTL,
        trust_uid: Optional[int] = None,
        name: Optional[str] = None,
        prefault: bool = False,
    ):
        if not isinstance(prefault, bool):
            raise InvalidArgument(f"prefault must be True or False, got {prefault!r}")
        if name is not None:
            protocol.check_client_name(name)
        if trust_uid is not None and (
            isinstance(trust_uid, bool) or not isinstance(trust_uid, int) or trust_uid < 0
        ):
            raise InvalidArgument(
                f"trust_uid must be a uid (an int >= 0) or None, got {trust_uid!r}"
            )
        if (tp_rank is None) != (tp_size is None):
            raise InvalidArgument("pass both tp_rank= and tp_size=, or neither")
        if tp_size is not None and (
            not isinstance(tp_size, int)
            or tp_size < 1
            or not isinstance(tp_rank, int)
            or not 0 <= tp_rank < tp_size
        ):
            raise InvalidArgument(f"tp_rank={tp_rank!r} must lie in [0, tp_size={tp_size!r})")
        self.address = _normal(address)
        self._link = Link(str(address), self.address, timeout, trust_uid)
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.trust_uid = trust_uid
        self.name = name
        self.pickle_ttl = pickle_ttl
        self._memory: Optional[PoolMemory] = None
        self._owns_memory = False
        self._closed = False
        # Runs this client's own promotions (_tier_copies): None until the first
        # allocation with a prompt asks, False where the coordinator cannot offer it.
        self._copies: "Optional[ClientCopies | bool]" = None
        self._copy_lock = threading.Lock()  # held while copies run (close waits for it)
        self._copy_thread: Optional[int] = None  # the thread running them (holds the lock)
        self._stop_copies = False  # set by close: copies not begun fail
        self._close_after_copies = False  # close() came from that thread (a signal handler)
        self._handles: "set" = set()
        self._states: dict = {}
        self.num_closed = 0  # handles closed so far (a batch re-checks its handles when it moves)
        self.prefault_s = 0.0  # how long prefault= took
        try:
            self._handshake(str(address))
            if prefault:
                assert self._memory is not None  # (mapped by the handshake)
                self.prefault_s = self._memory.prefault()
        except BaseException:
            self._teardown()
            raise
        _remember(self)

    # -- the pool, from the handshake --------------------------------------------------------

    def _handshake(self, given_address: str) -> None:
        fds: List[int] = []  # the pool's descriptors, from the hello's answer
        try:
            hello = self._link.greet(fds, self.tp_rank, self.tp_size, self.name)
            self.features = frozenset(hello.get("features") or ())
            config = PoolConfig.from_wire(hello["pool"])
            self.config = config
            self.coordinator_pid = hello["coordinator_pid"]
            self.instance = hello["instance"]
            # Stay under the coordinator's limit, so pickling never fails on the ttl.
            self.pickle_ttl = min(self.pickle_ttl, float(hello["max_handoff_ttl"]))
            from shmkv.coordinator.server import LOCAL_POOLS

            local = LOCAL_POOLS.get(given_address) or next(
                (m for a, m in list(LOCAL_POOLS.items()) if _normal(a) == self.address), None
            )
            if local is not None and config.is_cuda:
                for fd in fds:
                    os.close(fd)
                fds = []
                self._memory = local
                self._owns_memory = False
            else:
                owned, fds = fds, []  # attach_pool closes them, on failure too
                self._memory = attach_pool(config, hello["memory"], owned)
                self._owns_memory = True
        finally:
            for fd in fds:
                os.close(fd)
        self.pool = self._memory.rank_view(self.tp_rank, self.tp_size)
        self.owner = self._memory.owner
        # Whether handles and steps read the shared tables lock-free, or ask (``rows``):
        # see ``shmkv.memory.tables`` on memory ordering.
        self.lock_free = lock_free_reads()

    # -- the connection (the link's) ---------------------------------------------------------

    def request(self, op: str, **args):
        """Send one request and wait for its result (raises the mapped error)."""
        return self._link.exchange(op, args)

    def request_fds(self, op: str, fds: List[int], **args):
        """:meth:`request` for an answer that carries descriptors: they are appended to
        ``fds`` (the caller closes them), the ones that came before an error too."""
        return self._link.exchange(op, args, fds)

    def is_alive(self) -> bool:
        """False once the coordinator has hung up or this client was closed (no round trip)."""
        return self._link.is_alive()

    def check(self) -> None:
        """Raise ``HandleClosed`` or ``CoordinatorGone`` unless the client is usable."""
        self._link.check()

    def posted_errors(self) -> List[Tuple[str, ShmkvError]]:
        """The ``(op, error)`` of each request sent without waiting that the coordinator
        refused, as answers came in so far (never waits; the list is emptied). At most
        the first 64 are kept between two calls."""
        return self._link.posted_errors()

    def flush(self) -> None:
        """Wait until the coordinator has served every request this client sent without
        waiting (``close_many(..., wait=False)``); raise the first one it refused.

        Raises:
            ShmkvError: what the coordinator answered a request sent without waiting.
        """
        self._link.flush()

    @property
    def max_frame(self) -> int:
        """The largest request the coordinator reads, in bytes (from its hello): a larger
        one is split (``allocate_many``) or refused before it is sent."""
        return self._link.max_frame

    @property
    def timeout(self) -> float:
        """Seconds to wait for any answer before ``CoordinatorTimeout``."""
        return self._link.timeout

    @timeout.setter
    def timeout(self, value: float) -> None:
        self._link.timeout = value

    # -- shared-table reads and ownership ----------------------------------------------------

    def _rows(self, slots, width: int, blocks=None, row_owners: bool = False) -> tuple:
        """Rows of the shared tables, read by the coordinator (for a client that may not
        read them lock-free): ``(seq int64 [n, 4], table int32 [n, width], owner int64
        of each of blocks, or None)``; with ``row_owners``, a fourth item: the owner of
        each entry of ``table`` (int64 ``[n, width]``), or None from a coordinator that
        does not send them (it marks no block as being promoted)."""
        args = {"slots": protocol.pack_i64s(np.asarray(slots, dtype=np.int64)), "width": int(width)}
        if blocks is not None:
            args["blocks"] = protocol.pack_i64s(np.asarray(blocks, dtype=np.int64))
        asked = row_owners and "row_owners" in self.features
        if asked:
            args["row_owners"] = True
        got = self.request("rows", **args)
        seq = np.frombuffer(got["seq"], dtype="<i8").astype(np.int64).reshape(-1, 4)
        table = (
            np.frombuffer(got["table"], dtype="<i4")
            .astype(np.int32)
            .reshape(seq.shape[0], int(width))
        )
        owner = (
            np.frombuffer(got["owner"], dtype="<i8").astype(np.int64) if "owner" in got else None
        )
        if not row_owners:
            return seq, table, owner
        row_owner = (
            np.frombuffer(got["row_owner"], dtype="<i8").astype(np.int64).reshape(table.shape)
            if asked
            else None
        )
        return seq, table, owner, row_owner

    def _check_own(self, handle) -> None:
        if getattr(handle, "_client", None) is not self:
            raise InvalidArgument(
                f"{handle!r} is not a handle of this client ({self.address});"
                " use the client that made it"
            )

    # -- handles -----------------------------------------------------------------------------

    def _sequence_view(self, cache_id: int, slot: int) -> SequenceView:
        """The view of a sequence's shared row that this client's handles on it share."""
        view = self._states.get(cache_id)
        if view is None:
            view = self._states[cache_id] = SequenceView(cache_id, slot)
        view.num_handles += 1
        return view

    def _release_state(self, handle) -> None:
        """A handle closed: its share of its sequence's view goes (if it took one)."""
        if handle._shared is not None:
            self._drop_view(handle)
        self.num_closed += 1

    def _drop_view(self, handle) -> None:
        view = handle._shared
        view.num_handles -= 1
        if view.num_handles <= 0:
            del self._states[handle._cache_id]

    def _handle(self, info: dict, view_len: Optional[int] = None) -> KvCacheHandle:
        return KvCacheHandle._from_info(self, info, view_len)

    def allocate(
        self,
        num_tokens: int = 0,
        prompt: Optional[Sequence[int]] = None,
        cache_salt: Optional[bytes] = None,
        request_id: Optional[str] = None,
        wait: bool = True,
        defer: bool = False,
    ):
        """A new sequence with ``num_tokens`` reserved slots (one round trip).

        With ``prompt`` (token ids), ``num_tokens`` defaults to ``len(prompt)``, the
        longest cached prefix of full blocks is reused, and ``handle.num_cached_tokens``
        says how many tokens are already present: write K/V from there on. Call
        ``handle.commit()`` once written so other requests can reuse it.
        ``cache_salt`` namespaces the prefix keys (model, adapter, tenant).

        A prefix that a tier (host, disk, the shared store) holds is copied into the pool
        first, and the answer waits for it. With ``wait=False`` it comes at once:
        ``handle.num_promoting_tokens`` of the cached tokens are still on their way, and
        ``handle.settle()`` waits for them (a scheduler that has other work meanwhile).

        With ``defer=True``, a prompt whose blocks right after its cached prefix other
        clients are computing now (:meth:`computing`) is not allocated: the answer is a
        :class:`Computing` instead of a handle (nothing allocated, nothing counted), and
        an allocation asked again once they committed hits them. The coordinator decides
        it in the same turn as the allocation: of two clients that ask at once, one
        computes and the other is told to wait. A sequence allocated with ``defer`` is
        one others wait for in turn (commit what you compute, promptly); a plain
        allocation is never waited for.

        Raises:
            PoolExhausted: not enough free or evictable blocks (nothing changed).
            ShmkvError: ``defer`` with a coordinator that predates it.
        """
        return self.allocate_many(
            [
                dict(
                    num_tokens=num_tokens,
                    prompt=prompt,
                    cache_salt=cache_salt,
                    request_id=request_id,
                    defer=True if defer else None,
                )
            ],
            wait=wait,
        )[0]

    def allocate_many(self, requests: Iterable, wait: bool = True) -> list:
        """Allocate several sequences in one round trip, all or none.

        Each request is an int (``num_tokens``) or a dict of :meth:`allocate`'s arguments
        (``wait`` as there, for all of them); one with ``defer`` is answered by a
        :class:`Computing` where others compute its prompt.
        """
        requests = list(requests)
        if requests and set(map(type, requests)) == {int}:  # plain lengths: packed both ways
            if min(requests) < 0:
                raise InvalidArgument(f"num_tokens must be >= 0, got {min(requests)}")
            if max(requests) > self.config.max_seq_len:
                raise LimitExceeded(
                    f"num_tokens of {max(requests)}: a sequence holds at most "
                    f"{self.config.max_seq_len} tokens "
                    "(PoolConfig.max_seq_len); raise max_seq_len"
                )
            data = self.request("allocate_many", counts=protocol.pack_i64s(requests))
            half = len(data) // 2
            return KvCacheHandle._many(
                self, protocol.unpack_i64s(data[:half]), protocol.unpack_i64s(data[half:])
            )
        wire = []
        for req in requests:
            if isinstance(req, int) and not isinstance(req, bool):
                req = {"num_tokens": req}
            if not isinstance(req, dict):
                raise WrongType("each request must be an int or a dict of allocate arguments")
            req = dict(req)
            prompt = req.get("prompt")
            if prompt is not None:
                self._pack_prompt(req)
                if not req.get("num_tokens"):
                    req["num_tokens"] = len(req["prompt"]) // 8
            req.setdefault("num_tokens", 0)
            if not req.get("defer"):
                req.pop("defer", None)
            elif "computing" not in self.features:
                raise ShmkvError(
                    "this coordinator cannot defer an allocation to others computing its "
                    "prompt (an older version: 'computing' is not in client.features)"
                )
            else:
                req["defer"] = True  # (a truthy value of any type: the wire takes a bool)
            wire.append({k: v for k, v in req.items() if v is not None})
        parts = _split_requests(wire, self.max_frame)
        handles: list = []
        copy = wait and any("prompt" in req for req in wire) and self._tier_copies() is not None
        try:
            for part in parts:
                if copy:  # the blocks a tier holds are copied here, then reported
                    answer = self.request("allocate_many", requests=part, copy=True)
                    if isinstance(answer, dict):
                        answer = self._copy_in(answer["copy"])
                elif wait or "settle" not in self.features:  # (an older coordinator waits)
                    answer = self.request("allocate_many", requests=part)
                else:
                    answer = self.request("allocate_many", requests=part, early=True)
                handles += [
                    self._handle(info)
                    if "computing" not in info
                    else Computing(info["cached"], info["computing"])
                    for info in answer
                ]
        except BaseException:
            # All or none across the parts too: the ones allocated are given back.
            made = [h for h in handles if not isinstance(h, Computing)]
            if made:
                self.close_many(made)
            raise
        return handles

    def _pack_prompt(self, req: dict) -> dict:
        """``req``'s prompt packed (int64 LE bytes: the coordinator neither decodes nor
        checks each token) and its full blocks' prefix keys added, hashed here rather
        than in the coordinator's loop, which every client waits on (a salt that is not
        bytes is left to the coordinator to refuse); returns ``req``.

        Raises:
            InvalidArgument: a token id outside the int64 range.
        """
        try:
            req["prompt"] = pack_tokens(token_list(req["prompt"]))
        except OverflowError:
            raise InvalidArgument("prompt token ids must be ints in the int64 range") from None
        salt = req.get("cache_salt")
        if salt is None or isinstance(salt, bytes):
            root = root_key(salt)
            req["keys"] = b"".join(packed_block_keys(req["prompt"], self.config.block_size, root))
        return req

    def _tier_copies(self) -> Optional[ClientCopies]:
        """What runs this client's own promotions (``copy_promotions``), made at the first
        allocation with a prompt where the coordinator offers it: the tier memory mapped
        read-only (``tier_memory``). None where it does not, or where it could not be
        made (the coordinator copies them then)."""
        if self._copies is None:
            self._copies = False
            wanted = self.copy_promotions
            if wanted is None:  # (a coordinator in this process: its loop shares our GIL)
                wanted = self.coordinator_pid != os.getpid()
            if "copy" in self.features and wanted:
                fds: List[int] = []
                try:
                    answer = self.request_fds("tier_memory", fds)
                    if answer.get("tiers") is not None:
                        assert self._memory is not None  # (mapped by the handshake)
                        pool_np = [block_bytes(p).numpy() for p in self._memory.device_pools]
                        from shmkv.kernels import native

                        copy = native.copier() or np.copyto
                        owned, fds = fds, []  # (ClientCopies closes them, on failure too)
                        self._copies = ClientCopies(pool_np, answer["tiers"], owned, copy)
                except (ValueError, OSError, KeyError, TypeError) as exc:
                    log.warning("promotions stay with the coordinator: %s", exc)
                finally:
                    for fd in fds:
                        os.close(fd)
        copies = self._copies
        return copies if isinstance(copies, ClientCopies) else None

    def _copy_in(self, wire: dict) -> list:
        """Run the copies of a promotion the coordinator left to this client, report
        them (``promoted``) and return the allocation's answer. Interrupted, the copies
        are reported failed and the sequences closed before the error goes on."""
        copies = self._copies
        assert isinstance(copies, ClientCopies)  # (asked to copy only with one)
        try:
            with self._copy_lock:
                self._copy_thread = threading.get_ident()
                try:
                    return self._run_copies(copies, wire)
                finally:
                    self._copy_thread = None
        finally:
            if self._close_after_copies:  # no copy runs now: close as close() was asked
                self.close()

    def _run_copies(self, copies: ClientCopies, wire: dict) -> list:
        """(Holding the copy lock.) :meth:`_copy_in`'s copies and their report. Closed
        meanwhile from this thread (:meth:`close` from a signal handler), nothing is
        reported (the connection's close fails every copy and drops the sequences)."""
        try:
            statuses, errors = copies.run(wire, lambda: self._stop_copies)
        except BaseException:
            if not self._close_after_copies:
                failed = bytes([block_io.FAILED]) * len(wire["ops"])
                infos = self.request("promoted", id=wire["id"], statuses=failed)
                self.close_many([self._handle(i) for i in infos if "computing" not in i])
            raise
        if not self._close_after_copies:
            reported = [[i, text] for i, text in errors.items()]
            infos = self.request("promoted", id=wire["id"], statuses=statuses, errors=reported)
        if self._close_after_copies:  # (asked during the copies, or during the report)
            raise HandleClosed(
                "the client was closed while it copied its promotion in (from a signal "
                "handler on this thread); the allocation was given back"
            )
        return infos

    def extend_many(self, items: Iterable[Tuple]) -> List[int]:
        """Reserve slots in several sequences in one round trip, all or none.

        ``items`` are ``(handle, num_tokens)`` or ``(handle, num_tokens, token_ids)``.
        Returns the start position of each reservation.

        Raises:
            InvalidArgument: a handle was made by another client (nothing is sent).
        """
        wire = []
        for item in items:
            handle, num = item[0], item[1]
            self._check_own(handle)
            if handle._closed:  # liveness is checked once, by request()
                raise HandleClosed(f"handle on {handle.cache_id} is closed")
            if handle._view_len is not None:
                raise InvalidArgument(
                    "a handle viewing a fixed length (with_sequence_length) "
                    "cannot extend; extend a handle on the whole sequence"
                )
            entry = [handle._cache_id, num]
            if len(item) > 2 and item[2] is not None:
                entry.append(token_list(item[2]))
            wire.append(entry)
        # The new lengths and blocks are in the shared tables: only the starts are used.
        return [result["start"] for result in self.request("extend_many", items=wire)]

    def close_many(self, handles: Iterable, wait: bool = True) -> None:
        """Close several handles in one round trip (already closed ones are skipped).

        With ``wait=False`` the release is sent and not waited for (a scheduler freeing
        finished requests has nothing to wait for): the coordinator serves it before this
        client's next request, so this client never sees the blocks still held; other
        processes may, for that long. :meth:`flush` waits for it.

        Raises:
            InvalidArgument: a handle was made by another client (nothing is closed).
        """
        handles = list(handles)
        for h in handles:
            if getattr(h, "_client", None) is not self:
                self._check_own(h)
        live = list({id(h): h for h in handles if not h._closed}.values())  # once each
        if not live:
            return
        ids = protocol.pack_i64s(array("q", [h._cache_id for h in live]))
        try:
            if wait:
                self.request("release_many", ids=ids)
            else:
                self._link.post("release_many", ids=ids)
        finally:
            self._handles.difference_update(live)
            for h in live:
                h._closed = True
                if h._shared is not None:
                    self._drop_view(h)
            self.num_closed += len(live)

    def open(self, token: bytes):
        """Open a hand-off token from :meth:`KvCacheHandle.export`; returns a handle.

        Raises:
            HandoffError: the token is malformed, forged, already used or expired.
        """
        if isinstance(token, str):
            raise WrongType("token must be bytes (any bytes-like object), got str")
        try:
            token = memoryview(token).tobytes()  # bytes, bytearray, memoryview, array...
        except TypeError:
            raise WrongType(
                f"token must be bytes (any bytes-like object), got {type(token).__name__}"
            ) from None
        return self._handle(self.request("open", token=token))

    def peek(self, descriptor: bytes) -> SequencePeek:
        """The block table of the sequence a handle's :meth:`~KvCacheHandle.descriptor`
        names, read from the shared tables (no round trip on x86), holding no reference:
        copy its blocks out, then :meth:`SequencePeek.check` that the sequence outlived
        the copy.

        Raises:
            WrongType: ``descriptor`` is not bytes.
            InvalidArgument: it is malformed or from another coordinator.
            UnknownCache: the sequence is closed.
            NotSettled: the sequence was allocated with ``wait=False`` and a tier is still
                copying its blocks in (a holder's ``settle()`` waits for them).
        """
        self.check()
        return SequencePeek.from_descriptor(self, descriptor)

    # -- batches -----------------------------------------------------------------------------

    def batch(self, handles: Iterable[KvCacheHandle]) -> Batch:
        """A :class:`~shmkv.client.batch.Batch` over open handles of this client: one round trip
        per step for all of them, and the step's tensors built without a loop per
        sequence.

        Raises:
            InvalidArgument: a handle of another client, a fixed-length view, or two
                handles on one sequence.
            HandleClosed: a closed handle.
        """
        self.check()
        return Batch(self, list(handles))

    def step_from(self, descriptor: bytes) -> Step:
        """Rebuild a step another process made (``step.descriptor()``) with no round
        trip: the same ``slot_mapping``, ``block_tables``, ``seq_lens`` and
        ``query_start_loc``, writing this client's head shard. For tensor-parallel
        ranks: rank 0 (or the scheduler) makes the round trip, every rank steps.

        Raises:
            InvalidArgument: the descriptor is malformed or from another coordinator.
            StaleStep: a sequence of the step was closed since it was made.
        """
        self.check()
        return Step.from_descriptor(self, descriptor)

    @contextlib.contextmanager
    def as_unpickle_target(self):
        """Within this ``with`` block, handles of this client's coordinator unpickled
        in this thread are opened by this client (for a process with several clients
        of one coordinator, e.g. a rank connection and a full-view reader)."""
        stack = _unpickle_targets.__dict__.setdefault("stack", [])
        stack.append(self)
        try:
            yield self
        finally:
            stack.pop()

    def stats(self) -> dict:
        """The coordinator's counters (pool, prefix cache, connections, operations)."""
        return self.request("stats")

    def set_kv_scales(self, layer: int, k_scale: float, v_scale: float) -> None:
        """Keep one layer's K and V dequantization scales beside the pool (one round
        trip): a value stored in a quantized pool (float8 / int8) stands for
        ``stored * scale``. Every attached process reads them with :meth:`kv_scales`.

        Raises:
            OutOfRange: a bad layer.
            InvalidArgument: a scale that is not a finite number > 0.
        """

        def number(name, value):
            if isinstance(value, bool):
                raise WrongType(f"{name} must be a number, got bool")
            try:
                return float(value)  # a Python number, or a one-element tensor
            except OverflowError:
                raise InvalidArgument(
                    f"{name} must be a finite number > 0, got an int too large for a float"
                ) from None
            except (TypeError, ValueError, RuntimeError):
                raise WrongType(f"{name} must be a number, got {type(value).__name__}") from None

        self.request(
            "set_kv_scales",
            layer=layer,
            k_scale=number("k_scale", k_scale),
            v_scale=number("v_scale", v_scale),
        )

    def kv_scales(self, layer: int) -> Tuple[float, float]:
        """One layer's ``(k_scale, v_scale)``, read from shared memory with no round trip;
        ``(1.0, 1.0)`` until someone sets them. Pass them to
        ``shmkv.kernels.attention.paged_attention(..., k_scale=, v_scale=)``.

        Raises:
            OutOfRange / WrongType: a bad layer.
        """
        from shmkv.memory.tables import read_scales

        if isinstance(layer, bool) or not isinstance(layer, int):
            raise WrongType(f"layer must be an int, got {type(layer).__name__}")
        if not 0 <= layer < self.config.num_layers:
            raise OutOfRange(f"layer {layer} outside [0, {self.config.num_layers})")
        self.check()
        assert self._memory is not None  # (mapped by the handshake)
        lock, scales = self._memory.scale_lock, self._memory.scales
        assert lock is not None and scales is not None  # (mapped until the client closes)
        return read_scales(lock, scales, layer, self.check)

    def ping(self) -> None:
        """One empty round trip."""
        self.request("ping")

    def computing(self, prompt: Sequence[int], cache_salt: Optional[bytes] = None) -> Computing:
        """How much of ``prompt`` the pool holds, and how much right after that other
        clients are computing now (one round trip; nothing is allocated or counted), in
        whole blocks.

        ``computing_tokens`` counts the prompt's next full blocks that live sequences of
        other connections, allocated with ``defer=True``, got without a hit and have not
        committed yet: once their writers commit them, an :meth:`allocate` of the same
        prompt hits them. A writer
        that releases its sequence, or dies, stops counting at once. An engine with
        other work may wait for them instead of computing them again (the vLLM connector
        does, see ``shmkv.wait_computing_s``).

        Raises:
            ShmkvError: the coordinator does not answer this (it predates it: ``"computing"``
                not in ``client.features``).
        """
        if "computing" not in self.features:
            raise ShmkvError(
                "this coordinator does not tell what others are computing (an older "
                "version: 'computing' is not in client.features)"
            )
        req = self._pack_prompt({"prompt": prompt, "cache_salt": cache_salt})
        answer = self.request("computing", **{k: v for k, v in req.items() if v is not None})
        return Computing(answer["cached"], answer["computing"])

    def count_hits(self, hit_tokens: int, miss_tokens: int) -> None:
        """Add to this client's name's prefix hit and miss counters (``/metrics``:
        ``shmkv_client_prefix_*_tokens_total``) what an engine took from the cache and
        what it computed instead, where its own prefix cache answered the rest of the
        prompt, so that the counters say what the engine loaded rather than what its
        lookups found. Sent without waiting (:meth:`flush` raises a refusal); a no-op on
        a coordinator that does not count reports.

        Raises:
            InvalidArgument: a count that is not an int >= 0.
        """
        for name, value in (("hit_tokens", hit_tokens), ("miss_tokens", miss_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidArgument(f"{name} must be an int >= 0, got {value!r}")
        if "count_hits" in self.features and (hit_tokens or miss_tokens):
            self._link.post("count_hits", hit_tokens=hit_tokens, miss_tokens=miss_tokens)

    # -- teardown ------------------------------------------------------------------------

    def close(self) -> None:
        """Disconnect. The coordinator drops every reference this client held; handles
        turn invalid. Idempotent. Pool views already handed out stay readable (their
        storage keeps the mapping) but no longer belong to any sequence.

        Copies of this client's own promotions end first (an allocation copying them
        then raises ``HandleClosed``). Called on the thread that runs them (a signal
        handler that interrupted them), it cannot wait for them: it returns at once, no
        further copy begins, and the client closes as soon as the copy under way ends.
        """
        if self._closed:
            return
        if self._copy_thread == threading.get_ident():
            # Re-entered on the thread that holds the copy lock: waiting for it would wait
            # for ourselves, and closing now would free the blocks the interrupted copy
            # still writes. _copy_in closes once the copy under way has ended.
            self._stop_copies = self._close_after_copies = True
            return
        # Copies into this client's promoted blocks end first: once it is gone, the
        # coordinator frees those blocks for others, and a copy that lands after would
        # overwrite another sequence's K/V. Waited for up to the timeout; from then on
        # no copy begins (those still running, or waiting for the lock, skip theirs) and
        # the one under way ends.
        wait = max(self.timeout, 1.0)
        done = self._copy_lock.acquire(timeout=wait)
        self._stop_copies = True
        if not done:
            done = self._copy_lock.acquire(timeout=wait)  # (one block's copy)
        if done:
            self._copy_lock.release()
        else:
            log.warning("closed while a copy into a promoted block has run for %.0f s", wait)
        self._closed = True
        self._link.close()
        for handle in list(self._handles):
            handle._closed = True
        self._handles.clear()
        self._teardown()
        _forget(self)

    def _teardown(self) -> None:
        self._link.close()
        if self._memory is not None and self._owns_memory:
            self._memory.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("gone" if self._link.gone else "open")
        return f"<shmkv.Client {self.address} {state}>"

    # :func:`open_pickled`, set below the class: what a pickled handle is rebuilt by.
    open_pickled: ClassVar[staticmethod[[str, bytes, Optional[int]], KvCacheHandle]]


# -- per-process registry, for unpickling handles --------------------------------------------

_registry: List[Client] = []  # open clients made in this process, oldest first
_registry_lock = threading.Lock()
_unpickle_targets = threading.local()


# What one request of an allocate_many costs on the wire beyond its prompt and keys.
_REQUEST_OVERHEAD = 128


def _split_requests(wire: list, max_frame: int) -> List[list]:
    """Allocation requests in parts whose frames stay under ``max_frame`` (one part in
    the common case). A request too large for any frame stays alone in its part, and
    the send refuses it."""
    budget = max_frame // 2  # (room for the envelope and msgpack's lengths)
    sizes = [
        len(req.get("prompt") or b"") + len(req.get("keys") or b"") + _REQUEST_OVERHEAD
        for req in wire
    ]
    if sum(sizes) <= budget:
        return [wire]
    parts: List[list] = []
    part: list = []
    used = 0
    for req, size in zip(wire, sizes):
        if part and used + size > budget:
            parts.append(part)
            part, used = [], 0
        part.append(req)
        used += size
    parts.append(part)
    return parts


def _remember(client: Client) -> None:
    with _registry_lock:
        _registry.append(client)


def _forget(client: Client) -> None:
    with _registry_lock:
        if client in _registry:
            _registry.remove(client)


def _normal(address) -> str:
    """One spelling per socket: the absolute path with every link resolved, so that a
    relative (or linked) spelling of a coordinator's address finds the same clients."""
    return os.path.realpath(os.fspath(address))


def _clients_of(address: str) -> List[Client]:
    """Live clients of this process for ``address`` (any spelling of it; a forked
    child inherits none)."""
    address = _normal(address)
    pid = os.getpid()
    with _registry_lock:
        found = [c for c in _registry if c.address == address and c._link.pid == pid]
    return [c for c in found if c.is_alive()]


def connect(
    address,
    tp_rank: Optional[int] = None,
    tp_size: Optional[int] = None,
    timeout: float = DEFAULT_TIMEOUT,
    pickle_ttl: float = DEFAULT_PICKLE_TTL,
    trust_uid: Optional[int] = None,
    name: Optional[str] = None,
    prefault: bool = False,
) -> Client:
    """Connect to the coordinator at ``address`` and map its pool (zero copy).

    Args:
        address: the coordinator's socket path (``coord.address``).
        tp_rank, tp_size: see only this tensor-parallel rank's head shard.
        timeout: seconds to wait for any answer before ``CoordinatorTimeout``.
        pickle_ttl: how long a pickled handle waits to be unpickled, in seconds (kept
            under the coordinator's ``max_handoff_ttl``).
        trust_uid: also accept a coordinator running as this uid. By default only a
            coordinator of this process's uid (or root) is used: the client checks the
            listener's uid (``SO_PEERCRED``) before it sends anything, since whoever
            serves the socket receives every K/V written through it.
        name: what this client is called in the coordinator's ``/metrics`` (its prompt
            tokens hit and missed are counted by name: ``engine-a``, ``vllm-0``; 1-64
            of ``A-Z a-z 0-9 _ . : / -``). Connections of one name count together;
            unnamed ones count as ``unnamed``.
        prefault: map every page of a CPU pool into this process now, so that no
            write meets a first-touch page fault later (about 0.1 s a GiB once the
            coordinator has populated the pool, ``stats()["pool_memory"]``; it took
            ``client.prefault_s``). For a worker that writes all over the pool at once
            (a batch of decode steps); a short-lived client does not need it.

    ``client.address`` is ``address`` made absolute with links resolved, so every
    spelling of one socket path names the same coordinator (pickled handles carry it).

    Raises:
        CoordinatorGone: nothing serves ``address``.
        AccessDenied: the coordinator runs as another uid and ``trust_uid`` is not it
            (nothing was sent to it).
    """
    return Client(address, tp_rank, tp_size, timeout, pickle_ttl, trust_uid, name, prefault)


def process_client(
    address: str, tp_rank: Optional[int] = None, tp_size: Optional[int] = None
) -> Client:
    """A live client of this process for ``address`` with this rank (None: full view),
    connecting one if there is none."""
    for client in _clients_of(address):
        if client.tp_rank == tp_rank and client.tp_size == tp_size:
            return client
    return Client(address, tp_rank, tp_size)


def open_pickled(address: str, token: bytes, view_len: Optional[int]) -> KvCacheHandle:
    """Open a pickled handle in this process (see the module's unpickling rule)."""
    address = _normal(address)
    stack = getattr(_unpickle_targets, "stack", None)
    client = None
    if stack:
        for candidate in reversed(stack):
            if candidate.address == address:
                client = candidate
                break
    if client is None:
        clients = _clients_of(address)
        if len(clients) > 1:
            ranks = ", ".join(
                "full view" if c.tp_rank is None else f"tp_rank={c.tp_rank}" for c in clients
            )
            raise InvalidArgument(
                f"this process has {len(clients)} clients of {address} ({ranks}); unpickling "
                "cannot choose: wrap it in `with client.as_unpickle_target():`"
            )
        client = clients[0] if clients else Client(address)
    handle = client.open(token)
    handle._view_len = view_len
    return handle


# Handles reach this through their client (``shmkv.client.handle`` does not import this module).
Client.open_pickled = staticmethod(open_pickled)
