"""The requests a coordinator answers: one handler per wire operation.

Owns turning each validated request (``shmkv.protocol.OPS``) into a call of the
sequence table (``shmkv.coordinator.sequences``) or a read of the pool's state, and checking what a
connection may ask (its tensor-parallel rank, a layer's scales, the rows it reads).
Does no I/O: :class:`~shmkv.coordinator.server.Coordinator`'s loop reads, decodes and
dispatches requests (``Coordinator._handle``) and sends the answers these handlers
return. A handler's error is the caller's (a :class:`~shmkv.errors.ShmkvError`, sent
back with its code), and changes nothing.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any, Dict, List, Optional

import numpy as np

from shmkv import protocol
from shmkv.coordinator.sequences import SequenceTable
from shmkv.errors import InvalidArgument, OutOfRange, ProtocolError, WrongType
from shmkv.kernels import native
from shmkv.memory.layout import PoolConfig
from shmkv.memory.pool import PoolMemory, Populator
from shmkv.memory.tables import write_scales
from shmkv.protocol import check_client_name
from shmkv.tiers import TierSet

# What ``_op_settle`` and ``_op_fork`` return for a sequence a tier still copies blocks
# into: the coordinator answers them once the blocks are in (``_settled``).
SETTLE_LATER = object()

# Client names counted apart in ``/metrics`` (a bound on the label's values).
MAX_CLIENT_NAMES = 64
MAX_COUNTED_TOKENS = 1 << 40  # the most tokens one count_hits report may add


class Ops:
    """The handlers of :class:`~shmkv.coordinator.server.Coordinator`: ``_op_NAME(conn, **args)``
    answers the wire op ``NAME`` (see the module doc)."""

    # The coordinator's state the handlers read (made by ``Coordinator.__init__`` and
    # ``Coordinator.open``).
    config: PoolConfig
    memory: PoolMemory
    table: SequenceTable
    tiers: Any
    instance: str
    max_handoff_ttl: float
    max_frame: int
    address: str
    metrics_address: Optional[tuple]
    num_ops: int
    ops_by_type: Dict[str, int]
    num_refused: int
    num_dropped: int
    num_accepted: int
    num_errors: int
    _started_at: float
    client_counts: Dict[str, List[int]]
    _populator: Optional[Populator]
    _loop_slice_ns: Optional[int]
    _promoting: Dict[int, int]

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
        conn.greeted = True
        conn.tp_rank = tp_rank
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
        copy its own promotions (:meth:`_copy_tiers`)."""
        copy = self._copy_tiers() is not None
        return [f for f in protocol.FEATURES if copy or f != "copy"]

    def _copy_tiers(self) -> Optional[TierSet]:
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
        self, conn, num_tokens, prompt=None, cache_salt=None, request_id=None, keys=None, root=None
    ):
        return self.table.allocate(
            conn.conn_id, num_tokens, prompt, cache_salt, request_id, keys, root
        )

    def _op_allocate_many(self, conn, requests=None, counts=None, early=False, copy=False):
        # ``early``: answered at once though tier blocks are still coming (the
        # coordinator's ``_handle``); ``settle`` waits for them. ``copy``: the client
        # copies them itself (``_promote_in_client``), where ``_copy_tiers`` allows.
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
        # settle does (``SETTLE_LATER``; ``Coordinator._settled`` forks it then).
        if cache_id in self._promoting:
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

    def _op_export(self, conn, cache_id, ttl):
        return self.table.export(conn.conn_id, cache_id, ttl)

    def _op_open(self, conn, token):
        return self.table.open(conn.conn_id, token)

    def _op_tier_memory(self, conn):
        # What a client needs to copy its own promotions; the host tier's read-only
        # descriptor goes with the answer (``Coordinator._handle``).
        tiers = self._copy_tiers()
        return {"tiers": None if tiers is None else tiers.client_memory()[0]}

    def _op_promoted(self, conn, id, statuses, errors=None):
        # A client's report on the copies of a promotion it was asked to run (an
        # allocation's answer with ``copy``): the promotion ends as a worker's would, and
        # the answer is then the allocation's.
        copying, tiers = conn.copying, self._copy_tiers()
        promo = None if copying is None else copying.get(id)
        if promo is None or tiers is None:
            raise InvalidArgument(f"promoted: no promotion {id} waits for this client's copies")
        tiers.finish_in_client(promo, statuses, errors or [])  # (raises, changing nothing)
        del copying[id]
        return promo.context

    def _op_settle(self, conn, cache_id):
        # A held sequence's hit once its promoted blocks are in: now, or, while a tier
        # still copies them, when it is done (``SETTLE_LATER``: the coordinator holds the
        # answer, see ``Coordinator._settled``).
        if cache_id in self._promoting:
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
        return self.stats()

    def _op_set_kv_scales(self, conn, layer, k_scale, v_scale):
        if not 0 <= layer < self.config.num_layers:
            raise OutOfRange(f"layer {layer} outside [0, {self.config.num_layers})")
        for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
            if not (math.isfinite(value) and value > 0):
                raise InvalidArgument(f"{name} must be a finite number > 0, got {value!r}")
        lock, scales = self.memory.scale_lock, self.memory.scales
        assert lock is not None and scales is not None, "a served pool is mapped"
        write_scales(lock, scales, layer, float(k_scale), float(v_scale))

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
        uptime = max(time.monotonic() - self._started_at, 1e-9)
        out.update(
            {
                "address": self.address,
                "pid": os.getpid(),
                "uptime_s": uptime,
                "ops": self.num_ops,
                "ops_per_s": self.num_ops / uptime,
                "ops_by_type": dict(self.ops_by_type),
                "refused_connections": self.num_refused,
                "dropped_connections": self.num_dropped,
                "accepted_connections": self.num_accepted,
                "request_errors": self.num_errors,
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
