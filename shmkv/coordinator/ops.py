"""The requests a coordinator answers: one handler per wire operation.

Owns turning each validated request (``shmkv.protocol.OPS``) into a call of the
sequence table (``shmkv.coordinator.sequences``) or a read of the pool's state,
checking what a connection may ask (its tensor-parallel rank, a layer's scales, the
rows it reads), and two pieces of state: the prompt counts by client name (read by
``/metrics``) and the sequences that early-answered promotions still copy into
(``Ops.promoting``, which holds back ``settle`` and ``fork`` on them).

Does no I/O and holds no connection: :class:`~shmkv.coordinator.connections.Connections`
reads, decodes and dispatches requests to ``Ops._op_NAME(conn, **args)``, sends the
answers, and holds the requests that wait. A handler reads the asking connection's
record (``conn``); the one field it changes is ``conn.copying``, from which
``promoted`` takes the promotion it finishes. A handler's error is the caller's (a
:class:`~shmkv.errors.ShmkvError`, sent back with its code), and changes nothing.
The counters of the whole coordinator (``stats``) are
:class:`~shmkv.coordinator.server.Coordinator`'s, which this part is handed.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any, Callable, Dict, List, Optional

import numpy as np

from shmkv import protocol
from shmkv.coordinator.sequences import SequenceTable
from shmkv.errors import InvalidArgument, OutOfRange, ProtocolError, WrongType
from shmkv.memory.layout import PoolConfig
from shmkv.memory.pool import PoolMemory
from shmkv.memory.tables import write_scales
from shmkv.protocol import check_client_name
from shmkv.tiers import TierSet

log = logging.getLogger("shmkv.coordinator.server")

# What ``_op_settle`` and ``_op_fork`` return for a sequence a tier still copies blocks
# into: the connection holds them, and :meth:`Ops.answer_settled` answers them once the
# blocks are in.
SETTLE_LATER = object()

# Client names counted apart in ``/metrics`` (a bound on the label's values).
MAX_CLIENT_NAMES = 64
MAX_COUNTED_TOKENS = 1 << 40  # the most tokens one count_hits report may add


class Ops:
    """The request handlers of a serving coordinator: ``_op_NAME(conn, **args)``
    answers the wire op ``NAME`` (see the module doc).

    Args:
        config: the pool's configuration.
        memory: the pool's memory (its descriptors go with the handshake).
        table: the sequence table every handler calls.
        tiers: the tiers under the pool (a ``TierSet`` or the shared store's), or None.
        instance: the coordinator instance's name (see ``Coordinator.instance``).
        max_handoff_ttl: the longest hand-off ttl, told to clients in the handshake.
        max_frame: the largest request frame, told to clients in the handshake.
        stats: the coordinator's counters (``Coordinator.stats``), the answer to ``stats``.
    """

    def __init__(
        self,
        config: PoolConfig,
        memory: PoolMemory,
        table: SequenceTable,
        tiers: Any,
        *,
        instance: str,
        max_handoff_ttl: float,
        max_frame: int,
        stats: Callable[[], dict],
    ):
        self.config = config
        self.memory = memory
        self.table = table
        self.tiers = tiers
        self.instance = instance
        self.max_handoff_ttl = max_handoff_ttl
        self.max_frame = max_frame
        self._stats = stats
        # client name -> [prompt tokens hit, missed], shared by its connections (see
        # _name_client); kept when they close, for /metrics
        self.client_counts: Dict[str, List[int]] = {}
        # cache id -> early-answered promotions still copying into it (see promote_early)
        self.promoting: Dict[int, int] = {}

    def _name_client(self, conn, name: Optional[str]) -> None:
        """Count the prompts of ``conn`` under its client name (``/metrics``, at most
        MAX_CLIENT_NAMES names: later ones count as ``other``; none: ``unnamed``)."""
        label = name or "unnamed"
        counts = self.client_counts.get(label)
        if counts is None:
            if len(self.client_counts) >= MAX_CLIENT_NAMES:
                label = "other"
            counts = self.client_counts.setdefault(label, [0, 0])
        self.table.client_counts[conn.conn_id] = counts

    def _op_hello(self, conn, version, tp_rank=None, tp_size=None, pid=None, name=None):
        if version != protocol.PROTOCOL_VERSION:
            raise ProtocolError(
                f"protocol version {version} is not supported; the "
                f"coordinator speaks {protocol.PROTOCOL_VERSION}"
            )
        if conn.greeted:
            raise ProtocolError("hello sent twice")
        if (tp_rank is not None or tp_size is not None) and (
            tp_size != self.config.tp_size
            or tp_rank is None
            or not 0 <= tp_rank < self.config.tp_size
        ):
            raise InvalidArgument(
                f"tp_rank={tp_rank}, tp_size={tp_size} do not fit a pool "
                f"with tp_size={self.config.tp_size}"
            )
        if name is not None:
            check_client_name(name)
        # (the connection records itself greeted, and its rank, once this is answered)
        self._name_client(conn, name)
        return {
            "version": protocol.PROTOCOL_VERSION,
            "pool": self.config.to_wire(),
            "memory": self.memory.descriptor,
            "coordinator_pid": os.getpid(),
            "conn_id": conn.conn_id,
            "instance": self.instance,
            "max_handoff_ttl": self.max_handoff_ttl,
            "max_frame": self.max_frame,
            # what this coordinator serves beyond its protocol version's first release
            # (a client sends those arguments and ops only where they are listed)
            "features": self._features(),
        }

    def _features(self) -> List[str]:
        """What the hello lists: ``protocol.FEATURES``, "copy" only where a client can
        copy its own promotions (:meth:`copy_tiers`)."""
        copy = self.copy_tiers() is not None
        return [f for f in protocol.FEATURES if copy or f != "copy"]

    def copy_tiers(self) -> Optional[TierSet]:
        """The tiers whose promotions a client may copy itself: local ones (a
        ``TierSet``, not the shared store's) under a CPU pool; else None."""
        tiers = self.tiers
        return tiers if isinstance(tiers, TierSet) and not self.config.is_cuda else None

    def _op_ping(self, conn):
        return {}

    def _op_count_hits(self, conn, hit_tokens, miss_tokens):
        # Engines that answer part of a prompt from their own prefix cache report what
        # they took from this one (shmkv.integrations.vllm): only their name's counters.
        for name, value in (("hit_tokens", hit_tokens), ("miss_tokens", miss_tokens)):
            if not 0 <= value <= MAX_COUNTED_TOKENS:
                raise OutOfRange(
                    f"count_hits: {name}={value} must lie in [0, {MAX_COUNTED_TOKENS}]"
                )
        counts = self.table.client_counts.get(conn.conn_id)
        if counts is not None:
            counts[0] += hit_tokens
            counts[1] += miss_tokens
        return {}

    def _op_allocate(
        self,
        conn,
        num_tokens,
        prompt=None,
        cache_salt=None,
        request_id=None,
        keys=None,
        root=None,
        defer=False,
    ):
        return self.table.allocate(
            conn.conn_id, num_tokens, prompt, cache_salt, request_id, keys, root, defer
        )

    def _op_allocate_many(self, conn, requests=None, counts=None, early=False, copy=False):
        # ``early``: answered at once though tier blocks are still coming (the
        # connections' ``_handle``); ``settle`` waits for them. ``copy``: the client
        # copies them itself (``_promote_in_client``), where ``copy_tiers`` allows.
        if (requests is None) == (counts is None):
            raise InvalidArgument("allocate_many takes one of requests and counts")
        if counts is not None:  # plain sequences of given lengths: packed both ways
            cache_ids, slots = self.table.allocate_counts(
                conn.conn_id, protocol.unpack_i64s(counts)
            )
            return protocol.pack_i64s(cache_ids) + protocol.pack_i64s(slots)
        checked = []
        for req in requests:
            try:
                checked.append(protocol.validate_args("allocate", req))
            except ProtocolError as exc:  # a bad sub-request is a bad argument, not a bad stream
                raise WrongType(f"allocate_many: {exc}") from None
        return self.table.allocate_many(conn.conn_id, checked)

    def _op_computing(self, conn, prompt, cache_salt=None, keys=None):
        # Read only: how much of the prompt is cached, and how much after that other
        # connections' sequences are computing (an engine may wait for it).
        return self.table.computing(
            conn.conn_id, {"prompt": prompt, "cache_salt": cache_salt, "keys": keys}
        )

    def _op_extend(self, conn, cache_id, num_tokens, tokens=None):
        return self.table.extend(conn.conn_id, cache_id, num_tokens, tokens)

    def _op_extend_many(self, conn, items):
        return self.table.extend_many(conn.conn_id, items)

    def _check_rank(self, conn, tp_rank) -> None:
        """A connection that said its tensor-parallel rank commits only that rank's shard."""
        if conn.tp_rank is not None and tp_rank != conn.tp_rank:
            raise InvalidArgument(
                f"a connection of tp_rank={conn.tp_rank} commits only its "
                f"own shard, not tp_rank={tp_rank}"
            )

    def _op_commit(self, conn, cache_id, num_tokens, tp_rank=None, start=None):
        self._check_rank(conn, tp_rank)
        return self.table.commit(conn.conn_id, cache_id, num_tokens, tp_rank, start)

    def _op_prepare_write(self, conn, cache_id, start, num_tokens):
        return self.table.prepare_write(conn.conn_id, cache_id, start, num_tokens)

    def _op_info(self, conn, cache_id):
        return self.table.info(conn.conn_id, cache_id)

    def _op_clone(self, conn, cache_id):
        return self.table.clone(conn.conn_id, cache_id)

    def _op_fork(self, conn, cache_id):
        # A fork of a sequence a tier still copies blocks into waits for them, as a
        # settle does (``SETTLE_LATER``; ``answer_settled`` forks it then).
        if cache_id in self.promoting:
            self.table.info(conn.conn_id, cache_id)  # (only a holder may wait)
            return SETTLE_LATER
        return self.table.fork(conn.conn_id, cache_id)

    def _op_release(self, conn, cache_id):
        self.table.release(conn.conn_id, cache_id)

    def _op_release_many(self, conn, cache_ids=None, ids=None):
        if (cache_ids is None) == (ids is None):
            raise InvalidArgument("release_many takes one of cache_ids and ids")
        self.table.release_many(
            conn.conn_id, cache_ids if ids is None else protocol.unpack_i64s(ids)
        )

    def _op_export(self, conn, cache_id, ttl, bound=False):
        return self.table.export(conn.conn_id, cache_id, ttl, bound)

    def _op_open(self, conn, token):
        return self.table.open(conn.conn_id, token)

    def _op_tier_memory(self, conn):
        # What a client needs to copy its own promotions; the host tier's read-only
        # descriptor goes with the answer (``descriptors``).
        tiers = self.copy_tiers()
        return {"tiers": None if tiers is None else tiers.client_memory()[0]}

    def _op_promoted(self, conn, id, statuses, errors=None):
        # A client's report on the copies of a promotion it was asked to run (an
        # allocation's answer with ``copy``): the promotion ends as a worker's would, and
        # the answer is then the allocation's.
        copying, tiers = conn.copying, self.copy_tiers()
        promo = None if copying is None else copying.get(id)
        if promo is None or tiers is None:
            raise InvalidArgument(f"promoted: no promotion {id} waits for this client's copies")
        tiers.finish_in_client(promo, statuses, errors or [])  # (raises, changing nothing)
        del copying[id]
        return promo.context

    def _op_settle(self, conn, cache_id):
        # A held sequence's hit once its promoted blocks are in: now, or, while a tier
        # still copies them, when it is done (``SETTLE_LATER``: the connection holds the
        # answer, see ``answer_settled``).
        if cache_id in self.promoting:
            self.table.info(conn.conn_id, cache_id)  # (only a holder may wait)
            return SETTLE_LATER
        return {"num_cached": self.table.settled(conn.conn_id, cache_id)}

    def _op_extend_batch(
        self, conn, ids, count=None, counts=None, tokens=None, slots=None, keep=False
    ):
        if (count is None) == (counts is None):
            raise InvalidArgument("extend_batch takes one of count and counts")
        counts = count if counts is None else protocol.unpack_i64s(counts)
        cache_ids = protocol.unpack_i64s(ids)
        lens = protocol.pack_i64s(
            self.table.extend_batch(
                conn.conn_id,
                cache_ids,
                counts,
                tokens,
                None if slots is None else protocol.unpack_i64s(slots),
            )
        )
        if not keep:
            return lens
        # the answer names the kept batch (0: not kept) for extend_kept
        return {"lens": lens, "batch": self.table.keep_batch(conn.conn_id, cache_ids)}

    def _op_extend_kept(self, conn, batch, count, seen):
        done = self.table.extend_kept(conn.conn_id, batch, count, seen)
        if done is not None:
            for name in ("lens", "grown", "blocks"):
                if name in done:
                    done[name] = protocol.pack_i64s(done[name]) if len(done[name]) else b""
        return done

    def _op_prepare_batch(self, conn, ids, starts, counts):
        lens = self.table.prepare_batch(
            conn.conn_id,
            protocol.unpack_i64s(ids),
            protocol.unpack_i64s(starts),
            protocol.unpack_i64s(counts),
        )
        return protocol.pack_i64s(lens)

    def _op_truncate_batch(self, conn, ids, num_tokens):
        return self.table.truncate_batch(
            conn.conn_id, protocol.unpack_i64s(ids), protocol.unpack_i64s(num_tokens)
        )

    def _op_commit_batch(self, conn, ids, num_tokens, tp_rank=None, starts=None):
        self._check_rank(conn, tp_rank)
        # A rank of a tensor-parallel pool may commit its shard of a step it rebuilt from
        # a descriptor (it holds no reference); everyone else only what it holds.
        rank_connection = conn.tp_rank is not None and self.config.tp_size > 1
        return self.table.commit_batch(
            conn.conn_id,
            protocol.unpack_i64s(ids),
            protocol.unpack_i64s(num_tokens),
            tp_rank,
            rank_connection=rank_connection,
            starts=None if starts is None else protocol.unpack_i64s(starts),
        )

    def _op_rows(self, conn, slots, width, blocks=None, row_owners=False):
        """Rows of the shared tables read on the writer's thread (``shmkv.memory.tables``, memory
        ordering): ``seq`` (int64 ``[n, 4]``), ``table`` (int32 ``[n, width]``), the
        ``owner`` of each of ``blocks``, and with ``row_owners`` the ``row_owner`` of each
        entry of ``table`` (int64 ``[n, width]``: a peek's blocks still being promoted)."""
        memory, layout = self.memory, self.memory.layout
        seq_np, table_np, owner = memory.seq_np, memory.table_np, memory.owner_t
        assert seq_np is not None and table_np is not None and owner is not None, (
            "a served pool is mapped"
        )
        where = np.frombuffer(slots, dtype="<i8")
        if not 0 <= width <= layout.max_seq_blocks:
            raise OutOfRange(f"width {width} outside [0, {layout.max_seq_blocks}]")
        if where.shape[0] and (int(where.min()) < 0 or int(where.max()) >= layout.max_sequences):
            raise OutOfRange(f"slots outside [0, {layout.max_sequences})")
        table = table_np[where, :width]
        out = {
            "seq": seq_np[where].astype("<i8").tobytes(),
            "table": table.astype("<i4").tobytes(),
        }
        if row_owners:
            out["row_owner"] = owner.numpy()[table].astype("<i8").tobytes()
        if blocks is not None:
            ids = np.frombuffer(blocks, dtype="<i8")
            if ids.shape[0] and (int(ids.min()) < 0 or int(ids.max()) >= layout.num_blocks):
                raise OutOfRange(f"blocks outside [0, {layout.num_blocks})")
            out["owner"] = owner.numpy()[ids].astype("<i8").tobytes()
        return out

    def _op_stats(self, conn):
        return self._stats()

    def _op_set_kv_scales(self, conn, layer, k_scale, v_scale):
        if not 0 <= layer < self.config.num_layers:
            raise OutOfRange(f"layer {layer} outside [0, {self.config.num_layers})")
        for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
            if not (math.isfinite(value) and value > 0):
                raise InvalidArgument(f"{name} must be a finite number > 0, got {value!r}")
        lock, scales = self.memory.scale_lock, self.memory.scales
        assert lock is not None and scales is not None, "a served pool is mapped"
        write_scales(lock, scales, layer, float(k_scale), float(v_scale))

    # -- what the connections ask of the handlers ------------------------------------------

    def descriptors(self, op: str) -> List[int]:
        """The descriptors the answer to ``op`` carries (SCM_RIGHTS): for ``hello`` the
        pool's (a CUDA pool's metadata segment only), for ``tier_memory`` the host
        tier's (none where clients copy no promotions)."""
        if op == "hello":
            return self.memory.fds[:1] if self.config.is_cuda else self.memory.fds
        tiers = self.copy_tiers()
        return [] if tiers is None else tiers.client_memory()[1]

    def promote_early(self, records: list) -> Optional[List[int]]:
        """Promotions answered before their blocks are in: each record's info says how
        many blocks still come (``promoting``), from which block of the sequence on
        (``promoting_from``), and how many of them are only asked of the shared store,
        which may not have them (``fetching``); its sequence counts in
        ``promoting`` until :meth:`end_promotion`, and ``settle`` or ``fork`` on it
        waits. Returns the records' cache ids, or None (nothing changed: the request
        then waits as one not asked early) if the answer could not be made."""
        tiers = self.tiers
        assert tiers is not None, "promotions are planned only against tiers"
        try:
            marks = [tiers.held_here(record.keys) for record in records]
        except Exception:  # a bug here must not take the coordinator down
            log.exception("early answer failed; the allocation waits for its promotions")
            return None
        self.table.answer_early(records, marks)
        cache_ids = []
        promoting = self.promoting
        for record in records:
            cache_id = record.seq.cache_id
            promoting[cache_id] = promoting.get(cache_id, 0) + 1
            cache_ids.append(cache_id)
        return cache_ids

    def end_promotion(self, cache_id: int) -> bool:
        """An early promotion into ``cache_id`` is done; True when it was the last one
        copying into it (the requests waiting for it are answered then)."""
        left = self.promoting[cache_id] - 1
        if left:
            self.promoting[cache_id] = left
            return False
        del self.promoting[cache_id]
        return True

    def answer_settled(self, conn, cache_id: int, op: str) -> Any:
        """The answer to a ``settle`` or ``fork`` that waited (``SETTLE_LATER``) for
        the blocks of ``cache_id``, now that they are in: its hit (shorter than the
        early answer said when a block did not arrive), or its fork.

        Raises:
            ShmkvError: as the op would have (the caller answers it with the error).
        """
        if op == "fork":
            return self.table.fork(conn.conn_id, cache_id)
        return {"num_cached": self.table.settled(conn.conn_id, cache_id)}
