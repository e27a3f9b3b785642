"""A tier shared across nodes: committed blocks in Redis or Valkey (:class:`RedisTier`).

Owns the store's key names and value format, the worker threads that talk to the
store, its health (timeouts, backoff, reconnection), and :class:`RemoteTierSet`,
which the coordinator drives in place of a plain ``shmkv.tiers.TierSet`` when a
``RedisTier`` is configured: it keeps the local tiers (host, disk) as they are and adds the
store under them. Does not decide which pool block is free or cached
(``shmkv.coordinator.allocator``), nor what a sequence holds
(``shmkv.coordinator.sequences``), nor answer requests (``shmkv.coordinator.server``). Keeps
no index of what the store holds: the store is asked.

* Writes are write-behind. A commit that publishes a block appends it to
  ``SequenceTable.newly_published``; the loop moves it to a bounded queue (full: the
  block is dropped and counted) that a writer thread drains in batches: one pipeline
  of ``EXISTS`` and one of ``SET key value EX ttl`` for the blocks the store lacks
  (``EXPIRE`` refreshes the ones it has). A block is written under its key only while
  it still holds that key (``shmkv.coordinator.allocator``'s rule, stated there): the commit that
  published it recorded the binding's identity (key and generation); the loop checks
  it as it queues the write (the block may have been released, evicted and taken by
  another sequence in the same turn), and the writer copies the block into its own
  buffer, checks it again after that last read, and only then ``SET`` s the buffer. A
  write whose block changed is discarded and counted (the pool's
  ``copies_discarded``).
* Lookups: an allocation whose prompt continues past the pool's and the local tiers'
  hits claims the rest of its full blocks from the store, optimistically (those
  blocks are fresh pool blocks it needs anyway). A reader thread asks the store with
  pipelined ``GET`` s, a hash-slot group at a time, and copies the values that pass
  the checks into the pool blocks; the first missing or bad value ends the hit, the
  request's ``num_cached`` shrinks to what arrived, and the coordinator answers it.
  The loop never waits on the store.
* Failures never reach a caller. Every call has a socket timeout; an error (refused,
  timed out, a wrong answer) is counted and backs the store off (0.1 s, doubling up
  to ``max_backoff``): meanwhile lookups skip the store and allocations answer from
  local tiers at once. After the backoff the next call tries again (the client
  reconnects), and sharing resumes by itself.

Keys and values: ``shmkv.tiers.redis_format`` (one key per block, a checksummed
header before the block's bytes, hash tags for Redis Cluster).

Expiry and memory. Each key gets ``ttl`` seconds (``EX``; refreshed when a node
publishes the block again). Give the store a ``maxmemory`` and ``maxmemory-policy
allkeys-lru`` (a store of only shmkv blocks) or ``volatile-lru`` (shared with other
data: only keys with a TTL are evicted); with ``noeviction`` a full store refuses
writes, which are counted as errors. Persistence is not needed: the store is a cache
(``--save '' --appendonly no``).
"""

from __future__ import annotations

import logging
import math
import threading
import time
import zlib
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, List, Optional

import numpy as np

from shmkv.coordinator.sequences import PendingPromotion
from shmkv.errors import ShmkvError
from shmkv.memory.block_io import flat_to_pool, pool_to_flat
from shmkv.memory.pool import block_bytes
from shmkv.tiers.redis_format import (  # (re-exported: the tier's public names)
    HEADER_SIZE as HEADER_SIZE,
    Codec as Codec,
    RedisTier as RedisTier,
    redis_module,
    split_specs as split_specs,
)

log = logging.getLogger("shmkv.tiers.redis_store")

PUT_BATCH = 32  # blocks per write pipeline, at most
GET_BATCH = 64  # blocks per read pipeline, at most
BATCH_BYTES = 8 << 20  # value bytes per pipeline, at most (one block at least): the
#                           client parses smaller replies faster, and the next span is read
#                           while the one before is checked and copied
MIN_BACKOFF_S = 0.1


# -- health: timeouts, errors, backoff ----------------------------------------------------------


class _Health:
    """Whether the store may be asked now. Written by the worker threads, read by the
    loop; plain attribute writes (atomic under the GIL), no lock."""

    def __init__(self, max_backoff: float):
        self.max_backoff = max_backoff
        self.backoff = 0.0
        self.down_until = 0.0
        self.last_error: Optional[str] = None
        self.num_recoveries = 0

    def usable(self, now: float) -> bool:
        return now >= self.down_until

    def ok(self) -> None:
        if self.backoff:
            self.backoff = 0.0
            self.num_recoveries += 1
            log.warning("redis tier: the store answers again; sharing resumes")

    def failed(self, what: str, exc: BaseException) -> None:
        self.last_error = f"{what}: {type(exc).__name__}: {exc}"
        first = not self.backoff
        self.backoff = min(self.max_backoff, max(MIN_BACKOFF_S, self.backoff * 2))
        self.down_until = time.monotonic() + self.backoff
        log.log(
            logging.WARNING if first else logging.DEBUG,
            "redis tier: %s; the store is skipped for %.1f s (local tiers go on)",
            self.last_error,
            self.backoff,
        )


# -- the work items ------------------------------------------------------------------------------


class _Put:
    """One block to write: pool block ``block`` holding ``chain[index]`` under key
    generation ``gen`` when it was published. ``discarded``: the writer found the block
    changed (the loop counts it when the put comes back)."""

    __slots__ = ("block", "chain", "index", "gen", "discarded", "codec")

    def __init__(self, block: int, chain: list, index: int, gen: int, codec: Codec):
        self.block, self.chain, self.index, self.gen = block, chain, index, gen
        self.discarded = False
        self.codec = codec  # the namespace it is written under

    def holds(self, pool) -> bool:
        """The block still holds the key it was published under (see ``_Put``)."""
        return pool.still_holds(self.block, self.chain[self.index], self.gen)


class _Fetch:
    """The store's part of one record: blocks ``first..`` of ``record.seq``."""

    __slots__ = ("record", "chain", "first", "num_ok", "codec")

    def __init__(self, record, chain: list, first: int, codec: Codec):
        self.record, self.chain, self.first = record, chain, first
        self.num_ok = 0
        self.codec = codec  # the namespace it was asked under


class RemotePromotion:
    """Blocks being promoted for one request, from the local tiers and the store.
    ``context`` is the coordinator's (whom to answer)."""

    __slots__ = ("local", "fetches", "pairs", "local_done", "remote_done", "context")

    def __init__(self):
        self.local = None  # the local TierSet's Promotion, if any
        self.fetches: List[_Fetch] = []
        self.pairs: list = []  # (info, num_cached before, local record, store record)
        self.local_done = True
        self.remote_done = True
        self.context = None


# -- the tier set with a store under it -------------------------------------------------------


class RemoteTierSet:
    """The local tiers (a ``shmkv.tiers.TierSet`` or none) with a store under them.

    Driven like a ``TierSet`` by the coordinator's loop: :meth:`lookup`,
    :meth:`promote`, :meth:`tick`, :meth:`stats`, :meth:`io_stats`, :meth:`close`.

    Args:
        spec: the :class:`RedisTier`.
        local: the ``TierSet`` of the local tiers, or None; its pool hooks are chained.
        config: the pool's :class:`~shmkv.memory.layout.PoolConfig`.
        memory: the pool's :class:`~shmkv.memory.pool.PoolMemory`.
        table: the :class:`~shmkv.coordinator.sequences.SequenceTable`.
        wake: called from a worker thread to wake the loop.
    """

    def __init__(self, spec: RedisTier, local, config, memory, table, wake):
        self.spec = spec
        self.local = local
        self.config = config
        self.table = table
        self.pool = table.pool
        # A quantized pool's namespace follows its K/V scales (see the module doc):
        # re-derived on the loop when their seqlock moved since (one read a call).
        self._scale_lock, self._scales = memory.scale_lock, memory.scales
        self._scales_at = None
        self.codec = Codec(config, spec.salt, spec.hash_group)
        self._codec()
        self.health = _Health(spec.max_backoff)
        self._wake_fn = wake
        self._wake_pending = False
        self._cv = threading.Condition()
        self._puts: deque = deque()  # waiting for the writer (bounded)
        self._fetch_q: deque = deque()  # RemotePromotions waiting for the reader
        self._done: deque = deque()  # RemotePromotions back from the reader
        self._put_done: deque = deque()  # _Puts back from the writer
        self._threads: List[threading.Thread] = []
        self._clients: dict = {}
        self._client_lock = threading.Lock()
        self._stopping = False
        self._landing: Optional[ThreadPoolExecutor] = None
        self._by_local: dict = {}
        self._ready: list = []  # promotions finished outside tick()
        self._count_lock = threading.Lock()  # counters that worker threads add to
        self._puts_in = 0  # blocks queued for the writer (loop)
        self._puts_out = 0  # blocks the writer is done with (writer)
        self.num_promotions_in_flight = 0
        self.counters = {
            "lookups": 0,
            "hits": 0,
            "misses": 0,
            "writes": 0,
            "present": 0,
            "dropped": 0,
            "discarded": 0,
            "corrupt": 0,
            "errors": 0,
            "skipped_lookups": 0,
            "bytes_read": 0,
            "bytes_written": 0,
        }
        # [num_blocks, 2 * num_layers, chunk bytes] per rank (shmkv.memory.pool.block_bytes)
        self._pool_u8: Optional[List[Any]] = [block_bytes(p) for p in memory.device_pools]
        self._pool_np: Optional[List[np.ndarray]] = (
            None if config.is_cuda else [t.numpy() for t in self._pool_u8]
        )
        table.newly_published = []
        try:
            self._landing = ThreadPoolExecutor(1, thread_name_prefix="shmkv-redis-land")
            self._start(self._reader, "shmkv-redis-get")
            self._start(self._writer, "shmkv-redis-put")
        except BaseException:
            self.close()
            raise

    def _start(self, target, name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    # -- what the coordinator reads of a TierSet ---------------------------------------------

    @property
    def host(self):
        return self.local.host if self.local is not None else None

    @property
    def disk(self):
        return self.local.disk if self.local is not None else None

    @property
    def num_pending(self) -> int:
        return (
            len(self._puts)
            + self.num_promotions_in_flight
            + (self.local.num_pending if self.local is not None else 0)
        )

    def _codec(self) -> Codec:
        """The namespace writes and lookups use now (loop thread)."""
        if self._scales is not None and self.config.is_quantized:
            version = self._scale_lock[0]  # (the loop writes the scales: never odd here)
            if version != self._scales_at:
                self._scales_at = version
                self.codec = Codec(
                    self.config, self.spec.salt, self.spec.hash_group, scales=list(self._scales)
                )
        return self.codec

    # -- loop side: lookups and promotions -------------------------------------------------------

    def lookup(self, keys) -> int:
        """Leading ``keys`` the local tiers hold, and then every other one when the store
        may be asked (optimistic: the reader finds out; a miss shrinks the hit)."""
        num = self.local.lookup(keys) if self.local is not None else 0
        if num < len(keys):
            if self.health.usable(time.monotonic()):
                return len(keys)
            self.counters["skipped_lookups"] += 1
        return num

    def held_here(self, keys) -> int:
        """Leading ``keys`` the local tiers hold (the store's are only maybe there)."""
        return self.local.lookup(keys) if self.local is not None else 0

    def keep_planned(self, keys) -> None:
        """The local tiers keep ``keys`` until their next tick (``TierSet.keep_planned``)."""
        if self.local is not None:
            self.local.keep_planned(keys)

    def promote(self, records: list) -> RemotePromotion:
        """Start copying the blocks of ``records`` in: the local tiers' part through the
        local ``TierSet``, the rest from the store; :meth:`tick` returns the promotion."""
        promo = RemotePromotion()
        local_records = []
        for record in records:
            num_local = self.local.lookup(record.keys) if self.local is not None else 0
            local_rec = store_rec = None
            gens = record.gens
            if num_local:
                local_rec = PendingPromotion(
                    record.seq,
                    record.info,
                    record.first,
                    record.keys[:num_local],
                    record.blocks[:num_local],
                    None if gens is None else gens[:num_local],
                    record.client,  # (a part that comes up short moves its client's hits)
                )
                local_records.append(local_rec)
            if num_local < len(record.keys):
                store_rec = PendingPromotion(
                    record.seq,
                    record.info,
                    record.first + num_local,
                    record.keys[num_local:],
                    record.blocks[num_local:],
                    None if gens is None else gens[num_local:],
                    record.client,
                )
                promo.fetches.append(
                    _Fetch(store_rec, record.seq.keys, store_rec.first, self._codec())
                )
            promo.pairs.append((record.info, record.info["num_cached"], local_rec, store_rec))
        if local_records:
            promo.local = self.local.promote(local_records)
            promo.local_done = False
            self._by_local[id(promo.local)] = promo
        self.num_promotions_in_flight += 1
        if promo.fetches:
            self.counters["lookups"] += 1
            promo.remote_done = False
            with self._cv:
                self._fetch_q.append(promo)
                self._cv.notify_all()
        else:
            self._maybe_finish(promo, self._ready)  # (only the local part: finishes later)
        return promo

    def _maybe_finish(self, promo: RemotePromotion, finished: list) -> None:
        if not (promo.local_done and promo.remote_done):
            return
        fetched = {id(f.record): f.num_ok for f in promo.fetches}
        for info, num_cached, local_rec, store_rec in promo.pairs:
            if store_rec is None:
                continue
            lost_locally = local_rec is not None and info["num_cached"] < num_cached
            num_ok = self.table.finish_promotion(
                store_rec, 0 if lost_locally else fetched[id(store_rec)]
            )
            self.counters["hits"] += num_ok
            self.counters["misses"] += len(store_rec.blocks) - num_ok
        self.num_promotions_in_flight -= 1
        finished.append(promo)

    # -- loop side: the turn -----------------------------------------------------------------------

    def max_wait(self) -> float:
        """As ``TierSet.max_wait``, for the local tiers (the store's threads wake the loop)."""
        return self.local.max_wait() if self.local is not None else math.inf

    def tick(self, woken: bool = True, waiting: Optional[Callable[[], bool]] = None) -> list:
        """Queue newly published blocks for writing, take finished work; returns the
        promotions done (whose requests the coordinator answers now). ``woken`` and
        ``waiting``: as ``TierSet.tick``."""
        self._wake_pending = False
        finished, self._ready = self._ready, []
        if self.local is not None:
            for local_promo in self.local.tick(woken, waiting):
                promo = self._by_local.pop(id(local_promo), None)
                if promo is not None:
                    promo.local_done = True
                    self._maybe_finish(promo, finished)
        done = self._done
        while done:
            promo = done.popleft()
            promo.remote_done = True
            self._maybe_finish(promo, finished)
        put_done, discarded = self._put_done, 0
        while put_done:
            discarded += put_done.popleft().discarded
        if discarded:
            self._discard(discarded)
        published = self.table.newly_published
        if published:  # queued before the list is emptied, so flush() never sees neither
            self._queue_puts(published)
            self.table.newly_published = []
        return finished

    def _discard(self, num: int) -> None:
        """Count writes dropped because their block changed (loop thread)."""
        self.counters["discarded"] += num
        self.pool.discard_copies(num)

    def _queue_puts(self, published: list) -> None:
        """Queue the writes of blocks published this turn (``(block, chain, index,
        generation)``), those whose block still holds its key: within this turn it may
        have been released, evicted and taken by another sequence already."""
        pool, codec = self.pool, self._codec()
        new = [
            _Put(block, chain, index, gen, codec)
            for block, chain, index, gen in published
            if pool.still_holds(block, chain[index], gen)
        ]
        if len(new) < len(published):
            self._discard(len(published) - len(new))
        room = self.spec.max_queue - len(self._puts)
        if room < len(new):
            self.counters["dropped"] += len(new) - max(room, 0)
            new = new[: max(room, 0)]
        if not new:
            return
        self._puts_in += len(new)
        with self._cv:
            self._puts.extend(new)
            self._cv.notify_all()

    # -- worker side: the store -----------------------------------------------------------------

    def _client(self, role: str):
        """This role's connection (made on first use; redis-py reconnects by itself)."""
        client = self._clients.get(role)
        if client is None:
            redis = redis_module()
            from redis.backoff import NoBackoff
            from redis.retry import Retry

            options = dict(
                socket_timeout=self.spec.timeout,
                socket_connect_timeout=self.spec.timeout,
                retry=Retry(NoBackoff(), 0),
            )  # our own backoff, not redis-py's
            if self.spec.cluster:
                from redis.cluster import RedisCluster

                client = RedisCluster.from_url(self.spec.url, **options)
            else:
                client = redis.Redis.from_url(self.spec.url, **options)
            with self._client_lock:
                if self._stopping:
                    client.close()
                    raise ShmkvError("stopping")
                self._clients[role] = client
        return client

    def _count(self, **adds) -> None:
        """Add to counters from a worker thread (several threads add to some)."""
        with self._count_lock:
            for name, n in adds.items():
                self.counters[name] += n

    def _wake(self) -> None:
        if not self._wake_pending:
            self._wake_pending = True
            self._wake_fn()

    def _wait_usable(self) -> bool:
        """Sleep out the backoff (or until stopping); False when stopping."""
        while not self._stopping:
            left = self.health.down_until - time.monotonic()
            if left <= 0:
                return True
            with self._cv:
                self._cv.wait(min(left, 0.5))
        return False

    def _reader(self) -> None:
        while True:
            with self._cv:
                while not (self._stopping or self._fetch_q):
                    self._cv.wait(1.0)  # re-checks even if a notify were lost
                if self._stopping:
                    return
                promo = self._fetch_q.popleft()
            if self.health.usable(time.monotonic()):  # else: down since the lookup
                for fetch in promo.fetches:
                    try:
                        if self._stopping or not self._fetch(fetch):
                            break
                    except Exception:  # a bug must not kill the reader: a miss
                        log.exception("redis tier: lookup failed")
                        break
            self._done.append(promo)
            self._wake()

    def _fetch(self, fetch: _Fetch) -> bool:
        """Pull the leading blocks of one record that the store holds into the pool.
        Returns False after a store error (the remaining records are not asked)."""
        record, codec = fetch.record, fetch.codec
        first, stop = fetch.first, fetch.first + len(record.blocks)
        group = codec.hash_group
        # Up to GET_BATCH blocks (BATCH_BYTES) at a time, within one hash-slot group when
        # a span is no longer than a group (one shard per pipeline on a Cluster); the next
        # span is asked for while the one before is checked and copied into the pool.
        span = max(1, min(GET_BATCH, BATCH_BYTES // codec.value_nbytes))
        spans, lo = [], first
        while lo < stop:
            hi = min(stop, lo + span)
            if span <= group:
                hi = min(hi, (lo // group + 1) * group)
            spans.append((lo, hi))
            lo = hi
        landing = None
        try:
            client = self._client("get")
            landings = self._landing
            assert landings is not None  # (made before the reader starts; close() stops it)
            for lo, hi in spans:
                names = codec.names(fetch.chain, lo, hi)
                pipe = client.pipeline(transaction=False)
                for name in names:
                    pipe.get(name)
                values = pipe.execute(raise_on_error=False)  # a bad key: a bad value
                if landing is not None and not landing.result():
                    return True  # the previous span ended the hit
                present = 0
                while present < len(values) and values[present] is not None:
                    present += 1
                landing = landings.submit(self._land, fetch, lo, names, values[:present])
                if present < len(values):
                    break
            if landing is not None:
                landing.result()
            self.health.ok()
            return True
        except Exception as exc:
            if landing is not None:
                landing.result()  # what already arrived stays usable
            if self._stopping:
                return False
            self._count(errors=1)
            self.health.failed("lookup", exc)
            return False

    def _land(self, fetch: _Fetch, lo: int, names: list, values: list) -> bool:
        """Check values and copy them into their pool blocks, in order; True when all
        were good (so the next span continues the hit)."""
        try:
            return self._check_and_copy(fetch, lo, names, values)
        except Exception:  # a bug must not kill the lookup: the hit ends here
            log.exception("redis tier: copying a block into the pool failed")
            return False

    def _check_and_copy(self, fetch: _Fetch, lo: int, names: list, values: list) -> bool:
        record, codec = fetch.record, fetch.codec
        offset = lo - fetch.first
        good = True
        for j, value in enumerate(values):
            reason = codec.check(value, record.keys[offset + j])
            if reason is not None:
                self._count(corrupt=1)
                log.warning("redis tier: value of %s not served and deleted: %s", names[j], reason)
                try:
                    self._client("get").delete(names[j])
                except Exception as exc:
                    self._count(errors=1)
                    self.health.failed("delete", exc)
                good = False
                break
            self._to_pool(value, record.blocks[offset + j])
            fetch.num_ok = offset + j + 1
        self._count(bytes_read=(fetch.num_ok - offset) * codec.value_nbytes)
        return good

    def _to_pool(self, value: bytes, block: int) -> None:
        payload = np.frombuffer(value, dtype=np.uint8, offset=HEADER_SIZE)
        staging = None
        if self._pool_np is None:
            import torch

            staging = torch.from_numpy(payload.copy())  # writable; one copy to the device
        flat_to_pool(staging, payload, self._pool_np, self._pool_u8, block)

    def _writer(self) -> None:
        buffers = None
        while True:
            with self._cv:
                while not (self._stopping or self._puts):
                    self._cv.wait(1.0)  # re-checks even if a notify were lost
                if self._stopping:
                    return
            if not self._wait_usable():
                return
            if buffers is None:
                size = max(1, min(PUT_BATCH, BATCH_BYTES // self.codec.value_nbytes))
                buffers = np.empty((size, self.codec.value_nbytes), dtype=np.uint8)
            with self._cv:
                batch = [self._puts.popleft() for _ in range(min(len(buffers), len(self._puts)))]
            try:
                self._put_batch(batch, buffers)
            except Exception:  # a bug must not kill the writer: the batch is dropped
                log.exception("redis tier: writing blocks failed")
            self._put_done.extend(batch)
            self._puts_out += len(batch)

    def _put_batch(self, batch: list, buffers: np.ndarray) -> None:
        codec, ttl, pool = self.codec, self.spec.ttl, self.pool
        live = []
        for put in batch:  # changed while queued: not even asked about
            if put.holds(pool):
                live.append(put)
            else:
                put.discarded = True
        if not live:
            return
        names = [put.codec.names(put.chain, put.index, put.index + 1)[0] for put in live]
        try:
            client = self._client("put")
            pipe = client.pipeline(transaction=False)
            for name in names:
                pipe.exists(name)
            present = pipe.execute()
            pipe = client.pipeline(transaction=False)
            num_set = num_present = 0
            for j, (put, name, there) in enumerate(zip(live, names, present)):
                if there:
                    num_present += 1
                    if ttl is not None:
                        pipe.pexpire(name, int(ttl * 1000))
                    continue
                buf = buffers[j]
                self._from_pool(put.block, buf[HEADER_SIZE:])
                if not put.holds(pool):  # after the copy's last read: see the module doc
                    put.discarded = True
                    continue
                key = put.chain[put.index]
                buf[:HEADER_SIZE] = np.frombuffer(
                    put.codec.header(key, zlib.crc32(buf[HEADER_SIZE:])), dtype=np.uint8
                )
                if ttl is not None:
                    pipe.set(name, memoryview(buf), px=int(ttl * 1000))
                else:
                    pipe.set(name, memoryview(buf))
                num_set += 1
            pipe.execute()
            self._count(
                writes=num_set, present=num_present, bytes_written=num_set * codec.value_nbytes
            )
            self.health.ok()
        except Exception as exc:
            self._count(errors=1)
            self.health.failed("write", exc)

    def _from_pool(self, block: int, out: np.ndarray) -> None:
        staging = None
        if self._pool_np is None:
            import torch

            staging = torch.from_numpy(out)
        pool_to_flat(self._pool_np, self._pool_u8, block, staging, out)

    # -- stats and teardown -------------------------------------------------------------------

    def store_stats(self) -> dict:
        """The store's counters, in the shape of a tier's stats (``blocks``/``bytes``:
        what this node wrote; ``hits``/``promotions``: blocks pulled into the pool)."""
        c = self.counters
        now = time.monotonic()
        state = (
            "up"
            if self.health.usable(now)
            else f"backing off {self.health.down_until - now:.1f} s: {self.health.last_error}"
        )
        where = self.spec.url.split("@")[-1]
        out = {
            "tier": "redis",
            "url": where,
            "blocks": c["writes"],
            "bytes": c["bytes_written"],
            "capacity_bytes": None,
            "demotions": c["writes"],
            "promotions": c["hits"],
            "queued": len(self._puts),
            "recoveries": self.health.num_recoveries,
            "state": state,
        }
        out.update(c)
        return out

    def stats(self) -> list:
        """One dict per tier, top first; the store's last."""
        local = self.local.stats() if self.local is not None else []
        return local + [self.store_stats()]

    def io_stats(self) -> dict:
        """What is moving: the local tiers' figures, plus the store's queue and pulls."""
        out = (
            self.local.io_stats()
            if self.local is not None
            else {"pending": 0, "promotions_in_flight": 0, "lost_evictions": 0, "scanning": False}
        )
        out = dict(out)
        out["pending"] = self.num_pending
        out["promotions_in_flight"] = (
            out.get("promotions_in_flight", 0) + self.num_promotions_in_flight
        )
        out["redis_queued"] = len(self._puts)
        return out

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until the write queue is empty (for tests and benchmarks, not the loop's
        thread); True when it emptied within ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.table.newly_published and self._puts_out == self._puts_in:
                return True
            time.sleep(0.005)
        return False

    def close(self, timeout: Optional[float] = None) -> None:
        """Stop the workers (a store call under way ends within its timeout), close the
        connections and the local tiers. Idempotent; safe on a half-built set."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        wait = timeout if timeout is not None else self.spec.timeout * 4 + 1.0
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(wait)
        self._threads = []
        if self._landing is not None:
            self._landing.shutdown(wait=True)
            self._landing = None
        with self._client_lock:
            clients, self._clients = self._clients, {}
        for client in clients.values():
            try:
                client.close()
            except Exception:
                pass
        self.table.newly_published = None
        self._scales = self._scale_lock = None
        if self.local is not None:
            self.local.close()
            self.local = None
        self._pool_u8 = self._pool_np = None
