"""Sequences, references, hand-offs, prefix reuse and copy-on-write.

Owns the coordinator's metadata above the block level: which sequences (cache ids)
exist, their block tables and lengths, which connection holds how many references
to each, the hand-off tokens waiting to be opened, prefix keys and their commit,
and copy-on-write. Every public method is one wire operation and either succeeds
completely or raises and changes nothing (all-or-nothing).

Every change to a block table or a length is mirrored into the shared tables
(``shmkv.tables``), which every attached process reads without a round trip.

A plain sequence made by :meth:`SequenceTable.allocate_counts` (no prompt, one
reference, held by the connection that made it) has no Python object: its state is
its row of the shared tables, so a scheduler admitting or retiring hundreds of them
costs a fixed number of array operations. The first call that needs more of it
(a fork, a clone, an export, a per-sequence call) makes its :class:`Sequence` from
that row. A decode batch can be *kept* (:meth:`SequenceTable.keep_batch`): checked
once, then stepped by :meth:`SequenceTable.extend_kept` with no per-step checks until
something else changes those sequences. Its sequences may be plain ones or ones with
objects (a prompt's, with prefix keys) that only this connection holds; a kept step
stores the lengths with one array operation and moves each object's length along.

Does not do I/O and does not touch K/V bytes: copy-on-write calls the
``copy_block(src, dst)`` callback the coordinator provides. Pure: no torch, no
sockets, so the whole state machine is testable in one process.
"""

from __future__ import annotations

import heapq
import hmac
import os
import time
from array import array
from typing import Callable, Dict, List, Optional, Sequence as Seq

import numpy as np

from . import hashing
from .allocator import BlockPool
from .errors import (HandoffError, InvalidArgument, LimitExceeded, OutOfRange, PoolExhausted,
                     UnknownCache, WrongType)
from .tables import (CACHE_ID, GENERATION, NUM_TOKENS, SEQ_FIELDS, TableLayout, TableWriter,
                     run_index)

TOKEN_VERSION = 1
TOKEN_SIZE = 1 + 8 + 16
MAX_SALT_BYTES = 1024
MAX_REQUEST_ID = 256
MAX_KEPT = 64        # kept batches per connection (SequenceTable.keep_batch)


def format_cache_id(cache_id: int) -> str:
    """The user-facing form of a cache id."""
    return f"kv-{cache_id:x}"


class Sequence:
    """One cached sequence. Plain slots: this is on every hot path."""

    __slots__ = ("cache_id", "block_ids", "num_tokens", "num_refs", "keys", "keys_open",
                 "tail_tokens", "root", "num_committed", "rank_tokens", "num_cached",
                 "request_id", "slot")

    def __init__(self, cache_id: int, root: Optional[bytes], tp_size: int,
                 request_id: Optional[str]):
        self.cache_id = cache_id
        self.block_ids: List[int] = []
        self.num_tokens = 0
        self.num_refs = 0
        # Prefix keys of the leading full blocks whose token ids are known (None for a
        # sequence without a prompt). ``keys_open`` stays True while every token id so
        # far is known; an extend without ids closes it: the keys already computed stay
        # publishable, no later block gets one.
        self.keys: Optional[List[bytes]] = [] if root is not None else None
        self.keys_open = root is not None
        self.tail_tokens: List[int] = []   # token ids after the last keyed block
        self.root = root
        self.num_committed = 0             # leading blocks already published/committed
        self.rank_tokens = [0] * tp_size   # tokens each tensor-parallel rank committed
        self.num_cached = 0                # tokens reused from the prefix cache at allocate
        self.request_id = request_id       # None: the default, format_cache_id(cache_id)
        self.slot = -1                     # row in the shared tables

    def info(self) -> dict:
        return {"cache_id": self.cache_id, "slot": self.slot, "blocks": list(self.block_ids),
                "num_tokens": self.num_tokens, "num_cached": self.num_cached,
                "request_id": self.request_id}


class PendingPromotion:
    """Blocks of a new sequence whose bytes a lower tier is copying in (``shmkv.tiers``).

    ``blocks[i]`` gets the bytes of ``keys[i]``; they are blocks ``first ..`` of ``seq``,
    held by one extra reference each until :meth:`SequenceTable.finish_promotion`.
    ``info`` is the answer to the request, completed then.
    """

    __slots__ = ("seq", "info", "first", "keys", "blocks", "gens")

    def __init__(self, seq: Sequence, info: dict, first: int, keys: list, blocks: list,
                 gens: Optional[list] = None):
        self.seq, self.info, self.first, self.keys, self.blocks = seq, info, first, keys, blocks
        # each block's key generation when the copy in began (``BlockPool.identity``)
        self.gens = gens


class _Kept:
    """A connection's kept batch (``SequenceTable.keep_batch``): its sequences, their
    slots, and what its checks hold against (``version``, ``conn_steps``)."""

    __slots__ = ("ids", "where", "lengths_at", "version", "conn_steps", "steps", "phases",
                 "added", "longest", "objects", "heavy")

    def __init__(self, ids, where, version: int, conn_steps: int, objects=None):
        self.ids, self.where, self.steps = ids, where, 0
        self.lengths_at = where * SEQ_FIELDS + NUM_TOKENS   # in the flat sequence rows
        self.reset(version, conn_steps, objects)

    def reset(self, version: int, conn_steps: int, objects=None) -> None:
        self.version, self.conn_steps = version, conn_steps
        self.objects = objects   # per sequence: its Sequence, or None for a plain one
        self.heavy = None if objects is None else [s for s in objects if s is not None]
        self.phases = None   # for one token a step: {offset in a block: sequences}
        self.added = 0       # tokens each sequence got since ``phases`` was made
        self.longest = 0     # the longest sequence's length when ``phases`` was made


_NONE = np.zeros(0, dtype=np.int64)


class _Handoff:
    __slots__ = ("secret", "cache_id", "deadline")

    def __init__(self, secret: bytes, cache_id: int, deadline: float):
        self.secret, self.cache_id, self.deadline = secret, cache_id, deadline


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal arrays of one shape."""
    return bool((a == b).all())


def _check_count(name: str, value, lo: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise WrongType(f"{name} must be an int, got {type(value).__name__}")
    if value < lo:
        raise InvalidArgument(f"{name} must be >= {lo}, got {value}")
    return value


class SequenceTable:
    """The coordinator's sequence-level state machine.

    Args:
        pool: the block pool.
        block_size: tokens per block.
        tp_size: tensor-parallel ranks that must all commit a block before it is published.
        copy_block: ``copy_block(src, dst)`` copies one block's K/V bytes (all ranks).
        max_handoffs: outstanding hand-off tokens allowed at once.
        max_handoff_ttl: the longest ``ttl`` an export may ask for, in seconds.
        clock: monotonic clock (seconds), injectable for tests.
        tables: the writer of the shared block tables (``shmkv.tables``); private
            tables of ``max_sequences`` x ``max_seq_blocks`` when omitted.
        arrays: ``(seq, table, owner)`` numpy views of the shared tables and the owner
            array (the same memory ``tables`` and ``pool`` write), for the checks of a
            decode step over a whole batch at once; made over ``tables`` when omitted.
        max_seq_len: tokens one sequence may hold; default the tables' row, in tokens.
    """

    def __init__(self, pool: BlockPool, block_size: int, tp_size: int = 1,
                 copy_block: Callable[[int, int], None] = lambda src, dst: None,
                 max_handoffs: int = 65536, max_handoff_ttl: float = 3600.0,
                 clock: Callable[[], float] = time.monotonic,
                 tables: Optional[TableWriter] = None, max_sequences: int = 1024,
                 max_seq_blocks: Optional[int] = None, arrays: Optional[tuple] = None,
                 max_seq_len: Optional[int] = None):
        self.pool = pool
        self.block_size = block_size
        self.tp_size = tp_size
        self.copy_block = copy_block
        self.max_handoffs = max_handoffs
        self.max_handoff_ttl = max_handoff_ttl
        self.clock = clock
        if tables is None:
            layout = TableLayout(pool.num_blocks, max_sequences, max_seq_blocks or pool.num_blocks)
            _owner, _epoch, seq, table = layout.views(bytearray(layout.nbytes))
            tables = TableWriter(layout, seq, table)
        self.tables = tables
        layout = tables.layout
        # Tokens one sequence may hold (PoolConfig.max_seq_len), exactly, not rounded up
        # to whole blocks. Every count and length is checked against it (in Python ints)
        # before any array arithmetic, which therefore never leaves int64.
        self.max_seq_len = max_seq_len if max_seq_len is not None else \
            layout.max_seq_blocks * block_size
        if arrays is None:
            arrays = (np.frombuffer(tables.seq, dtype=np.int64).reshape(-1, SEQ_FIELDS),
                      np.frombuffer(tables.table, dtype=np.int32).reshape(
                          -1, layout.max_seq_blocks),
                      pool._owner_np)
        self._seq_np, self._table_np, self._owner_np = arrays
        self._seq_flat = self._seq_np.reshape(-1)   # (a view: the rows are contiguous)
        self._num_blocks_np = np.frombuffer(tables.num_blocks, dtype=np.int64)
        # Slots whose sequence still extends its prefix keys (``Sequence.keys_open``),
        # and, per connection, the slots it holds: what a batch step checks at once.
        self._keys_open_np = np.zeros(layout.max_sequences, dtype=bool)
        self._held_np: Dict[int, np.ndarray] = {}
        # Memoryviews over the same arrays, for the one-slot reads and writes of every
        # allocation and release: after the loop's sleeps a numpy scalar index costs it
        # about twice a memoryview's (its code comes back from memory too).
        self._keys_open_mv = memoryview(self._keys_open_np)
        self._held_mv: Dict[int, memoryview] = {}
        self._scratch = np.zeros(layout.max_sequences, dtype=np.int64)
        # A cache id carries its slot in its low bits: ``(serial << slot_bits) | slot``,
        # the serial never reused, so any id finds its row with no lookup table.
        self.slot_bits = max(1, (layout.max_sequences - 1).bit_length())
        self._slot_mask = (1 << self.slot_bits) - 1
        # Sequences with a Python object, and the slots of the plain ones without (see
        # the module doc), with the one connection holding each. ``conn_refs`` counts
        # a connection's references to sequences with objects only.
        self.sequences: Dict[int, Sequence] = {}
        self._light_np = np.zeros(layout.max_sequences, dtype=bool)
        self._light_mv = memoryview(self._light_np)
        self._light_conn = np.zeros(layout.max_sequences, dtype=np.int64)
        self._num_light = 0
        # Moves whenever a sequence in a kept batch changes outside its steps (see
        # :meth:`_touch`); ``_kept_count`` says which slots some kept batch holds.
        # ``_conn_steps`` moves with every call of a connection that may change its
        # rows. A kept batch (:meth:`keep_batch`) stays checked while both stand still.
        self._kept_version = 0
        self._kept_count = np.zeros(layout.max_sequences, dtype=np.int32)
        self._kept_count_mv = memoryview(self._kept_count)
        self._conn_steps: Dict[int, int] = {}
        self._kept: Dict[int, Dict[int, list]] = {}
        self._next_kept = 1
        self.conn_refs: Dict[int, Dict[int, int]] = {}
        # Lower tiers (``shmkv.tiers.TierSet``, set by the coordinator): a prefix that
        # misses the pool continues there. ``promotions``: what the last allocate must
        # copy in before it is answered (the coordinator takes them).
        self.tiers = None
        self.promotions: List[PendingPromotion] = []
        # Blocks a commit published, as ``(block_id, the sequence's keys, index)``, for
        # a shared store to write behind (``shmkv.remote``); None without one. The keys
        # list only grows, so ``keys[:index + 1]`` stays this block's chain.
        self.newly_published: Optional[list] = None
        self.handoffs: Dict[int, _Handoff] = {}
        self._handoff_heap: list = []
        self._next_serial = 1
        self._next_handoff_id = 1
        self.counters = {"prefix_hit_tokens": 0, "prefix_miss_tokens": 0,
                         "prefix_hit_blocks": 0, "prefix_miss_blocks": 0,
                         "cow_copies": 0, "published_blocks": 0, "exported_handoffs": 0,
                         "opened_handoffs": 0, "expired_handoffs": 0}

    # -- connections and references ------------------------------------------------------

    def add_connection(self, conn_id: int) -> None:
        self.conn_refs[conn_id] = {}
        self._conn_steps[conn_id] = 0
        self._kept[conn_id] = {}
        held = self._held_np[conn_id] = np.zeros(self.tables.layout.max_sequences, dtype=bool)
        self._held_mv[conn_id] = memoryview(held)

    def drop_connection(self, conn_id: int) -> int:
        """Drop every reference the connection holds; returns how many were dropped."""
        refs = self.conn_refs.pop(conn_id, {})
        held = self._held_np.pop(conn_id, None)
        self._held_mv.pop(conn_id, None)
        self._conn_steps.pop(conn_id, None)
        for gone in self._kept.pop(conn_id, {}).values():
            self._kept_count[gone.where] -= 1
        dropped = 0
        if held is not None:
            light = np.flatnonzero(held & self._light_np)
            self._release_light(light, held)
            dropped = int(light.shape[0])
        for cache_id, count in refs.items():
            dropped += count
            self._unref(self.sequences[cache_id], count)
        return dropped

    def _light_slot(self, cache_id: int) -> int:
        """The slot of ``cache_id`` if it is a live plain sequence without an object,
        else -1."""
        slot = cache_id & self._slot_mask
        if cache_id > 0 and slot < len(self._light_mv) and self._light_mv[slot] and \
                self._seq_np[slot, CACHE_ID] == cache_id:
            return slot
        return -1

    def _materialize(self, slot: int) -> Sequence:
        """The :class:`Sequence` of the plain sequence in ``slot``, made from its row;
        its holder's reference moves to ``conn_refs``."""
        cache_id = int(self._seq_np[slot, CACHE_ID])
        self._light_np[slot] = False
        self._num_light -= 1
        self._touch(slot)
        seq = Sequence(cache_id, None, self.tp_size, None)
        seq.slot = slot
        seq.num_tokens = int(self._seq_np[slot, NUM_TOKENS])
        seq.block_ids = self._table_np[slot, :self._num_blocks_np[slot]].tolist()
        seq.num_refs = 1
        self.sequences[cache_id] = seq
        self.conn_refs[int(self._light_conn[slot])][cache_id] = 1
        return seq

    def _live_seq(self, cache_id: int) -> Optional[Sequence]:
        """The live sequence ``cache_id`` (made from its row if it has no object yet), or
        None."""
        seq = self.sequences.get(cache_id)
        if seq is None:
            slot = self._light_slot(cache_id)
            if slot >= 0:
                seq = self._materialize(slot)
        return seq

    def _release_light(self, slots: np.ndarray, held: np.ndarray) -> None:
        """Free plain sequences without objects, whose one reference (in ``held``, their
        connection's held slots) is gone: their slots and blocks, with array
        operations. ``slots`` are distinct."""
        if not slots.shape[0]:
            return
        rows = run_index(slots)   # a slice when they are one run: views, cheaper stores
        self._light_np[rows] = False
        held[rows] = False
        self._num_light -= int(slots.shape[0])
        if self._kept_count[rows].any():
            self._kept_version += 1
        used = self._num_blocks_np[rows]
        widest = int(used.max())
        blocks = self._table_np[rows, :widest]
        if not bool((used == widest).all()):   # (entries past a row's own are 0: not its)
            blocks = blocks[np.arange(widest) < used[:, None]]
        freed = blocks.ravel().astype(np.int64)   # a copy: the release zeroes the rows
        self.tables.release_many(slots, rows, widest)
        self.pool.free_private(freed)

    @property
    def num_sequences(self) -> int:
        """Live sequences."""
        return len(self.sequences) + self._num_light

    def live(self) -> Dict[int, int]:
        """Every live sequence's cache id and its reference count (makes no object)."""
        out = {cache_id: seq.num_refs for cache_id, seq in self.sequences.items()}
        light = self._seq_np[np.flatnonzero(self._light_np), CACHE_ID]
        out.update(dict.fromkeys(light.tolist(), 1))
        return out

    def _held(self, conn_id: int, cache_id) -> Sequence:
        """The sequence, if this connection holds a reference to it."""
        if isinstance(cache_id, bool) or not isinstance(cache_id, int):
            raise WrongType(f"cache_id must be an int, got {type(cache_id).__name__}")
        refs = self.conn_refs.get(conn_id)
        if refs is not None:
            if cache_id in refs:
                return self.sequences[cache_id]
            slot = self._light_slot(cache_id)
            if slot >= 0 and self._held_mv[conn_id][slot]:
                return self._materialize(slot)
        raise UnknownCache(f"cache {format_cache_id(cache_id) if cache_id >= 0 else cache_id}"
                           " is not held by this connection (closed, never opened, or"
                           " another connection's)")

    def _ref(self, conn_id: int, seq: Sequence) -> None:
        refs = self.conn_refs[conn_id]
        count = refs.get(seq.cache_id, 0)
        refs[seq.cache_id] = count + 1
        if not count:
            self._held_mv[conn_id][seq.slot] = True
        seq.num_refs += 1

    def _touch(self, slot: int) -> None:
        """The sequence in ``slot`` changes outside kept steps (released, given an object,
        forked, cloned, exported, opened, copied on write): the kept batches check again
        if one holds it."""
        if self._kept_count_mv[slot]:
            self._kept_version += 1

    def _unref(self, seq: Sequence, count: int = 1) -> None:
        self._touch(seq.slot)
        seq.num_refs -= count
        if seq.num_refs == 0:
            del self.sequences[seq.cache_id]
            self.tables.release(seq.slot, len(seq.block_ids))
            self.pool.decref(reversed(seq.block_ids))  # tail first into the LRU

    def _new_sequence(self, root: Optional[bytes], request_id: Optional[str]) -> Sequence:
        """A sequence with a fresh cache id and slot; the caller checked
        ``tables.check_slots``, fills it and calls :meth:`_publish`."""
        slot = self.tables.take(1)[0]
        cache_id = (self._next_serial << self.slot_bits) | slot
        self._next_serial += 1
        seq = Sequence(cache_id, root, self.tp_size, request_id)
        seq.slot = slot
        self.sequences[cache_id] = seq
        return seq

    def _publish(self, seq: Sequence) -> None:
        """Give a filled new sequence its row in the shared tables."""
        self.tables.assign(seq.slot, seq.cache_id, seq.block_ids, seq.num_tokens)
        self._keys_open_mv[seq.slot] = bool(seq.keys_open)

    # -- allocate ------------------------------------------------------------------------

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _check_length(self, num_tokens: int, what) -> None:
        """The one bound on a sequence's length, checked before anything changes:
        ``PoolExhausted`` past what the whole pool holds, else ``LimitExceeded`` past
        ``max_seq_len``. ``num_tokens`` is a Python int (no wrap-around); ``what`` names
        the sequence (a str, or a callable making one: most calls pass)."""
        if num_tokens <= self.max_seq_len:
            return
        name = what() if callable(what) else what
        blocks = self._blocks_for(num_tokens)
        if blocks > self.pool.num_blocks:
            raise PoolExhausted(f"pool exhausted: {name} would need {blocks} blocks for "
                                f"{num_tokens} tokens, the whole pool has "
                                f"{self.pool.num_blocks}; raise num_blocks")
        raise LimitExceeded(f"{name}: {num_tokens} tokens, but a sequence holds at most "
                            f"{self.max_seq_len} (PoolConfig.max_seq_len); raise max_seq_len")

    def _check_counts(self, name: str, counts, lo: int = 0) -> None:
        """Every one of ``counts`` (ints or an int64 array) lies in ``[lo, max_seq_len]``:
        ``InvalidArgument`` below, the length check above."""
        if isinstance(counts, np.ndarray):
            if not counts.shape[0]:
                return
            least, most = int(counts.min()), int(counts.max())
        else:
            if not len(counts):
                return
            least, most = min(counts), max(counts)
        if least < lo:
            raise InvalidArgument(f"{name} must be >= {lo}, got {least}")
        self._check_length(most, name)

    def _prompt_keys(self, sent: Optional[bytes], packed: bytes, root: bytes) -> List[bytes]:
        """The prefix keys of a prompt's full blocks: the ones its client hashed and sent
        (``hashing.packed_block_keys`` of the packed prompt from ``root``), else hashed
        here. Sent keys are taken as they are: a client that maps the pool can write any
        block's bytes anyway, so hashing its prompt again here would protect nothing,
        while it would cost the loop most of an allocation's time."""
        if sent is None:
            return hashing.packed_block_keys(packed, self.block_size, root)
        size = hashing.KEY_SIZE
        full = len(packed) // (8 * self.block_size)
        if not isinstance(sent, bytes) or len(sent) != full * size:
            raise InvalidArgument(f"keys must be the {full} full blocks' {size}-byte prefix "
                                  f"keys of the prompt, {full * size} bytes; got "
                                  f"{len(sent) if isinstance(sent, bytes) else type(sent).__name__}")
        return hashing.split_keys(sent)

    def _plan_allocate(self, req: dict) -> tuple:
        num_tokens = _check_count("num_tokens", req.get("num_tokens", 0))
        prompt = req.get("prompt")
        salt = req.get("cache_salt")
        request_id = req.get("request_id")
        if salt is not None and (not isinstance(salt, bytes) or len(salt) > MAX_SALT_BYTES):
            raise InvalidArgument(f"cache_salt must be bytes of at most {MAX_SALT_BYTES}")
        if request_id is not None and (not isinstance(request_id, str)
                                       or len(request_id) > MAX_REQUEST_ID):
            raise InvalidArgument(f"request_id must be a str of at most {MAX_REQUEST_ID} chars")
        keys, tail, root = None, [], None
        if prompt is not None:
            # Clients send the prompt packed (int64 LE bytes): no per-token decode or check.
            if isinstance(prompt, bytes):
                if len(prompt) % 8:
                    raise WrongType("a packed prompt must be whole int64 token ids")
                packed = prompt
            elif isinstance(prompt, list):
                try:
                    packed = hashing.pack_tokens(prompt)
                except (OverflowError, TypeError):
                    raise InvalidArgument("prompt token ids must be ints in the int64 "
                                          "range") from None
            else:
                raise WrongType("prompt must be a list of token ids")
            length = len(packed) // 8
            if num_tokens not in (0, length):
                raise InvalidArgument(f"num_tokens={num_tokens} disagrees with a prompt of "
                                      f"{length} tokens; pass one or make them equal")
            num_tokens = length
            root = req.get("root")   # a moved sequence's (shmkv.distributed): its salt's root
            if root is None:
                root = hashing.root_key(salt)
            elif salt is not None or not isinstance(root, bytes) or \
                    len(root) != hashing.KEY_SIZE:
                raise InvalidArgument(f"root must be a {hashing.KEY_SIZE}-byte root key, "
                                      "given without cache_salt")
            keys = self._prompt_keys(req.get("keys"), packed, root)
            tail = hashing.unpack_tokens(packed, len(keys) * self.block_size)
        elif salt is not None:
            raise InvalidArgument("cache_salt needs a prompt")
        elif req.get("keys") is not None or req.get("root") is not None:
            raise InvalidArgument("keys and root come with the prompt they were hashed from")
        self._check_length(num_tokens, "allocate")
        hits = self.pool.lookup(keys) if keys else []
        need = self._blocks_for(num_tokens) - len(hits)
        if need > self.pool.num_blocks:
            raise PoolExhausted(f"pool exhausted: need {need} blocks for {num_tokens} tokens, "
                                f"the whole pool has {self.pool.num_blocks}; raise num_blocks")
        # Tier hits take fresh pool blocks, which ``need`` already counts. The pool may hold
        # blocks past them (their holder copied an earlier one on write, and the published
        # original went down a tier): those are hits too.
        promote = self.tiers.lookup(keys[len(hits):]) if keys and self.tiers is not None else 0
        later = self.pool.lookup(keys[len(hits) + promote:]) if promote else []
        need -= len(later)
        return num_tokens, keys, tail, root, hits, need, request_id, promote, later

    def allocate_many(self, conn_id: int, requests: Seq[dict]) -> List[dict]:
        """Allocate one sequence per request, all or none.

        A request is ``{"num_tokens": n, "prompt": [ids] | None, "cache_salt": bytes,
        "request_id": str, "keys": bytes}``. With a prompt, the longest published prefix
        of full blocks is reused and ``num_cached`` says how many tokens are already
        present. ``keys``: the prompt's full blocks' prefix keys, as its client hashed
        them (see :meth:`_prompt_keys`); hashed here when absent. ``root`` (instead of
        ``cache_salt``): the root key the keys chain from, as :meth:`info` gives it (a
        sequence moved from another node keeps its salt's keys).
        """
        plans = [self._plan_allocate(req) for req in requests]
        self.tables.check_slots(len(plans))
        need = sum(plan[5] for plan in plans)
        cached_hits = {b for plan in plans for b in plan[4] + plan[8]
                       if self.pool.ref_cnt[b] == 0}
        available = self.pool.num_available - len(cached_hits)
        if need > available:
            raise PoolExhausted(
                f"pool exhausted: need {need} blocks, {available} free or evictable "
                f"(num_blocks={self.pool.num_blocks}); free handles or raise num_blocks")
        for plan in plans:  # take every hit before any allocation can evict it
            self.pool.incref(plan[4])
            self.pool.incref(plan[8])
        results = []
        for num_tokens, keys, tail, root, hits, need_blocks, request_id, promote, later in plans:
            seq = self._new_sequence(root, request_id)
            new = self.pool.allocate(need_blocks, seq.cache_id)
            assert new is not None
            seq.block_ids = hits + new[:promote] + later + new[promote:]
            seq.num_tokens = num_tokens
            # promoted blocks count once their bytes are in
            num_hit = len(hits) + promote + len(later)
            seq.num_cached = num_hit * self.block_size
            seq.num_committed = num_hit
            seq.rank_tokens = [seq.num_cached] * self.tp_size
            self._publish(seq)
            if keys is not None:
                seq.keys = keys
                seq.tail_tokens = list(tail)
                counters = self.counters
                counters["prefix_hit_blocks"] += num_hit
                counters["prefix_miss_blocks"] += len(keys) - num_hit
                counters["prefix_hit_tokens"] += seq.num_cached
                counters["prefix_miss_tokens"] += num_tokens - seq.num_cached
            self._ref(conn_id, seq)
            info = self._info(seq)
            results.append(info)
            if promote:
                self.pool.incref(new[:promote])  # the promotion's own hold
                self.promotions.append(PendingPromotion(
                    seq, info, len(hits), keys[len(hits):len(hits) + promote], new[:promote],
                    [self.pool.key_gen[b] for b in new[:promote]]))
        return results

    def take_promotions(self) -> List[PendingPromotion]:
        """The promotions the last allocate started (the coordinator copies them in)."""
        promotions, self.promotions = self.promotions, []
        return promotions

    def finish_promotion(self, record: PendingPromotion, num_ok: int) -> int:
        """The bytes of the first ``num_ok`` promoted blocks are in: publish them under
        their keys. A block after them did not arrive (a damaged file), so the hit ends
        there, pool hits past the promoted blocks included: the answer's ``num_cached``
        shrinks and the caller writes the rest (copying those shared blocks on write).
        Drops the promotion's hold (the sequence may be gone by now: its connection
        closed). Returns how many blocks were published (fewer than ``num_ok`` when a
        block changed under its copy: ``BlockPool.still_holds``)."""
        pool, seq = self.pool, record.seq
        if record.gens is not None:   # a block that changed under the copy ends the hit
            for i in range(num_ok):
                if not pool.still_holds(record.blocks[i], None, record.gens[i]):
                    pool.discard_copies(num_ok - i)
                    num_ok = i
                    break
        for block_id, key in zip(record.blocks[:num_ok], record.keys):
            pool.publish(block_id, key)  # False: the key was published meanwhile; fine
        # The hit ends at this record's first missing block, unless an earlier part of
        # the same request ended it before (a local part ends, its store part comes
        # back with nothing): never later than it already ends, so never negative.
        if num_ok < len(record.blocks):
            lost = seq.num_committed - min(seq.num_committed, record.first + num_ok)
        else:
            lost = 0
        if lost:
            seq.num_committed -= lost
            seq.num_cached -= lost * self.block_size
            seq.rank_tokens = [seq.num_cached] * self.tp_size
            record.info["num_cached"] = seq.num_cached
            counters = self.counters
            counters["prefix_hit_blocks"] -= lost
            counters["prefix_miss_blocks"] += lost
            counters["prefix_hit_tokens"] -= lost * self.block_size
            counters["prefix_miss_tokens"] += lost * self.block_size
        pool.decref(reversed(record.blocks))
        return num_ok

    def allocate_counts(self, conn_id: int, counts: Seq[int]) -> tuple:
        """Allocate one plain sequence (no prompt) per count, all or none: the fast form
        of :meth:`allocate_many` for a scheduler admitting many requests at once, with a
        fixed number of array operations (the sequences get no objects, see the module
        doc). Returns ``(cache_ids, slots)`` as int64 arrays."""
        tokens = np.asarray(counts, dtype=np.int64).reshape(-1)
        num = tokens.shape[0]
        self._check_counts("num_tokens", tokens)   # (before any arithmetic on them)
        hi = int(tokens.max()) if num else 0
        lo = int(tokens.min()) if num else 0
        bs, pool, tables = self.block_size, self.pool, self.tables
        blocks = (tokens + bs - 1) // bs
        longest = (hi + bs - 1) // bs
        tables.check_slots(num)
        uniform = lo == hi      # (a scheduler admitting requests of one size)
        need = num * longest if uniform else int(blocks.sum())
        if need > pool.num_available:
            raise PoolExhausted(
                f"pool exhausted: need {need} blocks, {pool.num_available} free or evictable "
                f"(num_blocks={pool.num_blocks}); free handles or raise num_blocks")
        slot_ids = np.array(tables.take(num), dtype=np.int64)
        serial = self._next_serial
        self._next_serial += num
        cache_ids = (np.arange(serial, serial + num, dtype=np.int64) << self.slot_bits) | slot_ids
        owners = cache_ids if uniform and longest == 1 else np.repeat(cache_ids, blocks)
        taken = np.array(pool.allocate(need, owners), dtype=np.int64)
        tables.assign_many(slot_ids, cache_ids, taken, blocks, tokens)
        self._light_np[slot_ids] = True
        self._light_conn[slot_ids] = conn_id
        self._num_light += num
        self._held_np[conn_id][slot_ids] = True
        return cache_ids, slot_ids

    def allocate(self, conn_id: int, num_tokens: int = 0, prompt=None, cache_salt=None,
                 request_id=None, keys=None, root=None) -> dict:
        """Allocate one sequence (see :meth:`allocate_many`)."""
        return self.allocate_many(conn_id, [{"num_tokens": num_tokens, "prompt": prompt,
                                             "cache_salt": cache_salt,
                                             "request_id": request_id, "keys": keys,
                                             "root": root}])[0]

    # -- extend --------------------------------------------------------------------------

    def _writable(self, seq: Sequence, index: int) -> bool:
        """Whether block ``index`` of ``seq`` can be written in place (claims it if so)."""
        block_id = seq.block_ids[index]
        return self.pool.owner[block_id] == seq.cache_id or self.pool.claim(block_id, seq.cache_id)

    def _needs_copy(self, seq: Sequence, index: int) -> bool:
        """Whether writing block ``index`` of ``seq`` needs a private copy first: it is
        neither this sequence's to write nor claimable (shared or published)."""
        pool, block_id = self.pool, seq.block_ids[index]
        return pool.owner[block_id] != seq.cache_id and not (
            pool.ref_cnt[block_id] == 1 and pool.block_key[block_id] is None)

    def _cow(self, seq: Sequence, index: int) -> None:
        self._touch(seq.slot)
        old = seq.block_ids[index]
        new = self.pool.allocate(1, seq.cache_id)
        assert new is not None
        self.copy_block(old, new[0])
        seq.block_ids[index] = new[0]
        self.tables.replace(seq.slot, index, new[0])
        self.pool.decref((old,))
        self.counters["cow_copies"] += 1

    def _plan_extend(self, conn_id: int, item) -> tuple:
        if not (isinstance(item, (list, tuple)) and len(item) in (2, 3)):
            raise WrongType("extend item must be [cache_id, num_tokens] or "
                            "[cache_id, num_tokens, tokens]")
        seq = self._held(conn_id, item[0])
        num = _check_count("num_tokens", item[1])
        tokens = item[2] if len(item) == 3 else None
        if tokens is not None:
            if not isinstance(tokens, list) or len(tokens) != num:
                raise InvalidArgument(f"tokens must be a list of {num} token ids")
            try:
                hashing.pack_tokens(tokens)
            except (OverflowError, TypeError):
                raise InvalidArgument("token ids must be ints in the int64 range") from None
        partial = seq.num_tokens % self.block_size
        self._check_length(seq.num_tokens + num, lambda: format_cache_id(seq.cache_id))
        total = self._blocks_for(seq.num_tokens + num)
        need = total - len(seq.block_ids)
        copy_last = bool(num and partial and self._needs_copy(seq, len(seq.block_ids) - 1))
        return seq, num, tokens, need, copy_last

    def extend_many(self, conn_id: int, items: Seq) -> List[dict]:
        """Reserve token slots in several sequences, all or none.

        ``items`` are ``[cache_id, num_tokens]`` or ``[cache_id, num_tokens, tokens]``.
        Returns, per item, ``{"start", "num_tokens", "table_from", "blocks"}``:
        ``blocks`` replaces the block table from index ``table_from`` on. A shared
        partly filled last block gets a private copy first (copy-on-write).
        """
        if conn_id in self._conn_steps:
            self._conn_steps[conn_id] += 1
        plans = [self._plan_extend(conn_id, item) for item in items]
        if len({id(plan[0]) for plan in plans}) != len(plans):
            raise InvalidArgument("extend_many names a sequence twice")
        need = sum(plan[3] + plan[4] for plan in plans)
        if need > self.pool.num_available:
            raise PoolExhausted(
                f"pool exhausted: need {need} blocks, {self.pool.num_available} free or "
                f"evictable (num_blocks={self.pool.num_blocks}); free handles or raise num_blocks")
        results = []
        for seq, num, tokens, need_blocks, copy_last in plans:
            table_from = len(seq.block_ids)
            if num and seq.num_tokens % self.block_size:
                table_from -= 1
                if copy_last:
                    self._cow(seq, table_from)
                else:
                    self._writable(seq, table_from)
            start = seq.num_tokens
            seq.num_tokens += num
            if need_blocks:
                new = self.pool.allocate(need_blocks, seq.cache_id)
                self.tables.append(seq.slot, len(seq.block_ids), new, seq.num_tokens)
                seq.block_ids += new
            else:
                self.tables.set_length(seq.slot, seq.num_tokens)
            self._extend_keys(seq, num, tokens)
            results.append({"start": start, "num_tokens": seq.num_tokens,
                            "table_from": table_from, "blocks": seq.block_ids[table_from:]})
        return results

    def extend(self, conn_id: int, cache_id: int, num_tokens: int, tokens=None) -> dict:
        """Reserve ``num_tokens`` more slots at the end of a sequence (see :meth:`extend_many`)."""
        item = [cache_id, num_tokens] if tokens is None else [cache_id, num_tokens, tokens]
        return self.extend_many(conn_id, [item])[0]

    # -- batches (one round trip per engine step) ---------------------------------------

    def _light_slots(self, conn_id: int, cache_ids: Seq[int],
                     any_holder: bool = False) -> Optional[np.ndarray]:
        """The slots of ``cache_ids`` when they are distinct plain sequences without
        objects, each held by this connection (or by any, with ``any_holder``), checked
        with array operations; None otherwise (the caller's general path then checks
        them one by one and names any error)."""
        ids = np.asarray(cache_ids, dtype=np.int64)
        return self._checked_rows(conn_id, ids, ids & self._slot_mask, any_holder, light=True)

    def _checked_rows(self, conn_id: int, ids: np.ndarray, where: np.ndarray,
                      any_holder: bool = False, light: bool = False) -> Optional[np.ndarray]:
        """``where`` when it names distinct rows of the shared tables holding the live
        sequences ``ids``, each held by this connection (or by any, with
        ``any_holder``), and with ``light`` each a plain sequence without an object;
        checked with a fixed number of array operations. None otherwise."""
        num = ids.shape[0]
        held = self._held_np.get(conn_id)
        if not num or held is None or where.shape[0] != num or int(ids.min()) <= 0:
            return None
        rows = run_index(where)
        run = type(rows) is slice   # one ascending run: distinct rows, bounds at its ends
        if run:
            if rows.start < 0 or rows.stop > held.shape[0]:
                return None
        elif int(where.min()) < 0 or int(where.max()) >= held.shape[0]:
            return None
        if light and not self._light_np[rows].all():
            return None
        if not ((any_holder or held[rows].all()) and _same(self._seq_np[rows, CACHE_ID], ids)):
            return None
        if not run:
            order = np.arange(num)
            self._scratch[where] = order  # a slot named twice keeps only its last position
            if not _same(self._scratch[where], order):
                return None
        return where

    def _batch_sequences(self, conn_id: int, cache_ids: Seq[int], any_live: bool = False):
        """The sequences named by a batch, each held by this connection (or merely live,
        with ``any_live``)."""
        if len(set(cache_ids)) != len(cache_ids):
            raise InvalidArgument("the batch names a sequence twice")
        seqs = []
        for cache_id in cache_ids:
            try:
                seq = self._live_seq(cache_id) if any_live else self._held(conn_id, cache_id)
            except UnknownCache:
                seq = None
            if seq is None:
                raise UnknownCache(f"cache {format_cache_id(cache_id)} of the batch is closed "
                                   "(or not held by this connection)")
            seqs.append(seq)
        return seqs

    def extend_batch(self, conn_id: int, cache_ids: Seq[int], counts, tokens=None,
                     slots: Optional[Seq[int]] = None):
        """Reserve ``counts`` (an int for all, or one per sequence) more slots in each
        sequence of a batch, all or none; copy-on-write of shared partly filled last
        blocks included. ``tokens``: one list of token ids per sequence, or None.
        ``slots``: the sequences' rows in the shared tables, as the client knows them
        (checked), for the vectorized decode path.

        Returns the length of every sequence after the step (int64 array).
        """
        if conn_id in self._conn_steps:
            self._conn_steps[conn_id] += 1
        if isinstance(counts, int):
            self._check_counts("count", [_check_count("count", counts)])
        else:
            self._check_counts("counts", counts)
        if slots is not None and tokens is None and type(counts) is int and counts > 0:
            lens = self._extend_uniform(conn_id, cache_ids, slots, counts)
            if lens is not None:
                return lens
        seqs = self._batch_sequences(conn_id, cache_ids)
        num_seqs = len(seqs)
        if isinstance(counts, int):
            counts = [counts] * num_seqs
        elif len(counts) != num_seqs:
            raise InvalidArgument(f"{len(counts)} counts for a batch of {num_seqs} sequences")
        if tokens is not None:
            if not isinstance(tokens, list) or len(tokens) != num_seqs:
                raise InvalidArgument(f"tokens must be one list of token ids per sequence "
                                      f"({num_seqs})")
            for ids, num in zip(tokens, counts):
                if not isinstance(ids, list) or len(ids) != num:
                    raise InvalidArgument(f"tokens must hold exactly the step's count of token "
                                          f"ids for each sequence (expected {num})")
                try:
                    hashing.pack_tokens(ids)
                except (OverflowError, TypeError):
                    raise InvalidArgument("token ids must be ints in the int64 range") from None
        bs, owner, pool = self.block_size, self.pool.owner, self.pool
        max_len = self.max_seq_len
        # Pass 1, check and count. Most decode steps add a token to a block the sequence
        # already owns; only the others (a new block, a shared last block) are listed.
        need, special = 0, []
        for i, (seq, num) in enumerate(zip(seqs, counts)):
            if not num:
                continue
            old = seq.num_tokens
            if old + num > max_len:
                self._check_length(old + num, format_cache_id(seq.cache_id))
            have = len(seq.block_ids)
            if old + num <= have * bs and (not old % bs or owner[seq.block_ids[-1]] == seq.cache_id):
                continue  # the plain case: no block, no copy
            special.append(i)
            total = (old + num + bs - 1) // bs
            if total > have:
                need += total - have
            if old % bs and owner[seq.block_ids[-1]] != seq.cache_id and \
                    self._needs_copy(seq, have - 1):
                need += 1
        if need > pool.num_available:
            raise PoolExhausted(
                f"pool exhausted: the step needs {need} blocks, {pool.num_available} free or "
                f"evictable (num_blocks={pool.num_blocks}); free handles or raise num_blocks")
        # Pass 2, apply: the plain case is a length store; the listed ones take blocks.
        tables = self.tables
        table_seq, stride = tables.seq, SEQ_FIELDS
        for i in special:
            seq, num = seqs[i], counts[i]
            old, have = seq.num_tokens, len(seq.block_ids)
            if old % bs and owner[seq.block_ids[-1]] != seq.cache_id:
                if self._needs_copy(seq, have - 1):
                    self._cow(seq, have - 1)
                else:
                    pool.claim(seq.block_ids[-1], seq.cache_id)
            total = (old + num + bs - 1) // bs
            if total > have:
                new = pool.allocate(total - have, seq.cache_id)
                tables.append(seq.slot, have, new, old)   # blocks first, the length below
                seq.block_ids += new
        lens = array("q", bytes(8 * len(seqs)))
        for i, (seq, num) in enumerate(zip(seqs, counts)):
            if num:
                new_len = seq.num_tokens + num
                seq.num_tokens = new_len
                table_seq[seq.slot * stride + NUM_TOKENS] = new_len
                if seq.keys_open:
                    self._extend_keys(seq, num, tokens[i] if tokens is not None else None)
                lens[i] = new_len
            else:
                lens[i] = seq.num_tokens
        return lens

    def _extend_uniform(self, conn_id: int, cache_ids: Seq[int], slots: Seq[int], count: int):
        """The decode step (``count`` more tokens in every sequence, no token ids) with
        array operations over the whole batch: a constant number of them, whatever the
        batch size, plus Python work only for the sequences that need a new block, a
        copy of a shared last block, or to stop their prefix keys. None (nothing
        changed) when the batch does not check out: the general path then names the
        error."""
        ids = np.asarray(cache_ids, dtype=np.int64)
        where = self._checked_rows(conn_id, ids, np.asarray(slots, dtype=np.int64))
        if where is None:
            return None
        seq_np = self._seq_np
        if self._light_np[where].all():
            done = self._extend_light(where, ids, count)
            if done is not None:
                return done[0]
        bs = self.block_size
        lens = seq_np[where, NUM_TOKENS]
        have = self._num_blocks_np[where]
        new = lens + count
        if int(new.max()) > self.max_seq_len:
            return None   # the general path names the sequence
        full = (lens % bs) == 0
        last = self._table_np[where, np.maximum(have - 1, 0)]
        writable = full | (self._owner_np[last] == ids)   # the last block, if partial
        fits = new <= have * bs
        # One new block, and nothing else to do: the other common decode case.
        grow = ~fits & writable & (new <= (have + 1) * bs)
        if self._keys_open_np[where].any() or not ((fits & writable) | grow).all():
            # copies of shared blocks, several blocks, or prefix keys to stop: the general
            # per-sequence path (rare in a decode loop), for the whole batch
            return None
        sequences = self.sequences
        heavy = ~self._light_np[where]   # sequences with objects, which keep a copy
        grow_at = np.flatnonzero(grow)
        if grow_at.size:
            blocks = self._grow(where, ids, grow_at, have[grow_at], new[grow_at])
            for cache_id, block_id, keep in zip(ids[grow_at].tolist(), blocks,
                                                heavy[grow_at].tolist()):
                if keep:
                    sequences[cache_id].block_ids.append(block_id)
        if heavy.any():
            for cache_id, n in zip(ids[heavy].tolist(), new[heavy].tolist()):
                sequences[cache_id].num_tokens = n
        seq_np[where, NUM_TOKENS] = new
        return new

    def _grow(self, where: np.ndarray, ids: np.ndarray, grow_at: np.ndarray, have: np.ndarray,
              new: np.ndarray) -> list:
        """One new block for each sequence ``grow_at`` indexes (``have`` blocks now,
        ``new`` tokens after the step, both for those sequences only), all or none;
        returns the blocks. The caller stores the lengths after."""
        pool, tables = self.pool, self.tables
        longer = have + 1
        over = (longer > tables.max_seq_blocks) & (longer <= pool.num_blocks)
        if over.any():  # (a sequence longer than the pool is PoolExhausted below)
            i = int(np.argmax(over))
            tables.check_blocks(int(longer[i]), f"{format_cache_id(int(ids[grow_at[i]]))} at "
                                                 f"{int(new[i])} tokens")
        if grow_at.size > pool.num_available:
            raise PoolExhausted(
                f"pool exhausted: the step needs {grow_at.size} blocks, "
                f"{pool.num_available} free or evictable (num_blocks={pool.num_blocks}); "
                "free handles or raise num_blocks")
        blocks = pool.allocate_each(ids[grow_at].tolist())
        grow_where = where[grow_at]
        # the shared-table order: entries, then generation, then (after) the length
        self._table_np[grow_where, have] = blocks
        self._seq_np[grow_where, GENERATION] += 1
        self._num_blocks_np[grow_where] += 1
        return blocks

    def _extend_light(self, where: np.ndarray, ids: np.ndarray, count: int):
        """:meth:`_extend_uniform` for a checked batch of plain sequences without
        objects: their blocks are theirs alone and they cover exactly their tokens, so
        the step is a length store, plus a block for each that crosses into a new one.
        Returns ``(lengths, grown, blocks)``: ``blocks[i]`` is the new block of sequence
        ``grown[i]`` (int64 arrays); None (nothing changed) when one would need two."""
        bs, seq_np = self.block_size, self._seq_np
        lens = seq_np[where, NUM_TOKENS]
        new = lens + count
        if int(new.max()) > self.max_seq_len:
            return None
        if count == 1:
            grow_at = np.flatnonzero(lens % bs == 0)
        else:
            have = (lens + bs - 1) // bs
            more = (new + bs - 1) // bs - have
            if int(more.max()) > 1:
                return None
            grow_at = np.flatnonzero(more)
        blocks = grow_at  # (empty)
        if grow_at.size:
            blocks = np.array(self._grow(where, ids, grow_at, (lens[grow_at] + bs - 1) // bs,
                                         new[grow_at]), dtype=np.int64)
        seq_np[where, NUM_TOKENS] = new
        return new, grow_at, blocks

    # -- kept batches (a decode loop's batch, checked once) -------------------------------

    def keep_batch(self, conn_id: int, cache_ids: Seq[int]) -> int:
        """Keep a batch of sequences held by this connection for :meth:`extend_kept`:
        its checks are made now and hold until one of them is released, forked, cloned,
        exported, opened, copied on write or given an object, or the connection changes
        their rows another way. Returns the batch's id, or 0 when it does not qualify
        (see :meth:`_keepable`; then step it with :meth:`extend_batch`). A connection
        keeps its ``MAX_KEPT`` newest batches."""
        kept = self._kept.get(conn_id)
        keep = self._keepable(conn_id, cache_ids) if kept is not None else None
        if keep is None:
            return 0
        if len(kept) >= MAX_KEPT:
            self._kept_count[kept.pop(next(iter(kept))).where] -= 1
        batch_id = self._next_kept
        self._next_kept += 1
        kept[batch_id] = _Kept(np.asarray(cache_ids, dtype=np.int64), keep[0],
                               self._kept_version, self._conn_steps[conn_id], keep[1])
        self._kept_count[keep[0]] += 1
        return batch_id

    def _keepable(self, conn_id: int, cache_ids: Seq[int]) -> Optional[tuple]:
        """``(slots, objects)`` when a batch can be kept, else None: distinct live
        sequences held by this connection, each plain, or with an object (``objects[i]``,
        None for a plain one) that this connection alone holds, that takes no more prefix
        keys, whose blocks just cover its tokens and whose partial last block it writes
        in place. Then a kept step needs no copy and knows which sequences open a block
        from their lengths alone."""
        ids = np.asarray(cache_ids, dtype=np.int64)
        where = self._checked_rows(conn_id, ids, ids & self._slot_mask)
        if where is None:
            return None
        heavy = np.flatnonzero(~self._light_np[where])
        if not heavy.shape[0]:
            return where, None
        rows, bs = where[heavy], self.block_size
        lens = self._seq_np[rows, NUM_TOKENS]
        if self._keys_open_np[rows].any() or \
                not np.array_equal(self._num_blocks_np[rows], (lens + bs - 1) // bs):
            return None
        objects: list = [None] * ids.shape[0]
        refs, owner = self.conn_refs[conn_id], self._owner_np
        for i, cache_id in zip(heavy.tolist(), ids[heavy].tolist()):
            seq = self.sequences[cache_id]
            if seq.num_refs != 1 or refs.get(cache_id) != 1 or (
                    seq.num_tokens % bs and owner[seq.block_ids[-1]] != cache_id):
                return None
            objects[i] = seq
        return where, objects

    def extend_kept(self, conn_id: int, batch_id: int, count: int, seen: int) -> Optional[dict]:
        """:meth:`extend_batch` of ``count`` more tokens in every sequence of a kept
        batch, with no per-step checks while it stays checked (see :meth:`keep_batch`).

        ``seen``: the step number the caller's copy of the batch's rows and lengths is
        at. Returns ``{"steps", "same", "grown", "blocks"}`` and, unless ``same``,
        ``"lens"``: this step's number; whether the caller's copy, with ``count`` more
        tokens in every sequence and ``blocks[i]`` added to row ``grown[i]``, is the
        batch now (else it reads the rows again, and ``lens`` are the lengths after the
        step). None when the batch is not kept (never, dropped for a newer one, or
        another connection's): step it with :meth:`extend_batch`.
        """
        kept = self._kept.get(conn_id, {}).get(batch_id)
        if kept is None:
            return None
        count = _check_count("count", count, 1)
        self._check_length(count, "count")
        current = kept.version == self._kept_version and \
            kept.conn_steps == self._conn_steps[conn_id]
        self._conn_steps[conn_id] += 1
        done = self._step_kept(kept, count) if current else None
        kept.steps += 1
        if done is None:  # rechecked, and any error named, by the general path
            kept.version = -1
            lens = self.extend_batch(conn_id, kept.ids.tolist(), count, None,
                                     kept.where.tolist())
            keep = self._keepable(conn_id, kept.ids)
            if keep is not None:
                kept.reset(self._kept_version, self._conn_steps[conn_id], keep[1])
            return {"steps": kept.steps, "same": False, "lens": lens}
        kept.conn_steps = self._conn_steps[conn_id]
        grown, blocks = done
        out = {"steps": kept.steps, "same": seen == kept.steps - 1, "grown": grown,
               "blocks": blocks}
        if not out["same"]:
            out["lens"] = self._seq_flat[kept.lengths_at]
        return out

    def _step_kept(self, kept: "_Kept", count: int) -> Optional[tuple]:
        """:meth:`_extend_light` of a kept batch: for one token a step, which sequences
        open a block comes from their phase in a block (no work per step), and the step
        is one store that adds to every length; then the objects of the sequences that
        have one move along. Returns ``(grown, blocks)``, or None (nothing changed) when
        one would need two blocks."""
        if count != 1:
            kept.phases = None
            done = self._extend_light(kept.where, kept.ids, count)
            if done is None:
                return None
            self._move_objects(kept, count, done[1], done[2])
            return done[1:]
        bs, seq_flat, at = self.block_size, self._seq_flat, kept.lengths_at
        if kept.phases is None:   # sequences by their length's offset in a block
            lengths = seq_flat[at]
            phase = lengths % bs
            kept.phases = {p: np.flatnonzero(phase == p) for p in np.unique(phase).tolist()}
            kept.added = 0
            kept.longest = int(lengths.max())
        if kept.longest + kept.added + 1 > self.max_seq_len:
            return None   # (the general path names the sequence)
        grown = kept.phases.get(-kept.added % bs, _NONE)
        kept.added += 1
        blocks = _NONE
        if grown.shape[0]:
            old = seq_flat[at[grown]]
            try:
                blocks = np.array(self._grow(kept.where, kept.ids, grown, (old + bs - 1) // bs,
                                             old + 1), dtype=np.int64)
            except BaseException:
                kept.phases = None   # (nothing changed; the next step starts again)
                raise
        seq_flat[at] += 1   # the lengths, after any new entries (the tables' order)
        self._move_objects(kept, 1, grown, blocks)
        return grown, blocks

    @staticmethod
    def _move_objects(kept: "_Kept", count: int, grown: np.ndarray, blocks: np.ndarray) -> None:
        """A kept step's changes, made to the objects of its sequences that have one."""
        if kept.objects is None:
            return
        for seq in kept.heavy:
            seq.num_tokens += count
        objects = kept.objects
        for i, block in zip(grown.tolist(), blocks.tolist()):
            seq = objects[i]
            if seq is not None:
                seq.block_ids.append(block)

    def prepare_batch(self, conn_id: int, cache_ids: Seq[int], starts: Seq[int],
                      counts: Seq[int]) -> array:
        """Make slots ``[starts[i], starts[i] + counts[i])`` of each sequence writable in
        place (a step over slots already reserved, such as a prompt's prefill), all or
        none. Returns every sequence's current length (int64 array)."""
        if conn_id in self._conn_steps:
            self._conn_steps[conn_id] += 1
        seqs = self._batch_sequences(conn_id, cache_ids)
        if not len(starts) == len(counts) == len(seqs):
            raise InvalidArgument(f"starts and counts need one entry per sequence "
                                  f"({len(seqs)}), got {len(starts)} and {len(counts)}")
        bs, plans, num_copies = self.block_size, [], 0
        for seq, start, num in zip(seqs, starts, counts):
            if start < 0 or num < 0 or start + num > seq.num_tokens:
                raise OutOfRange(f"slots [{start}, {start + num}) of "
                                 f"{format_cache_id(seq.cache_id)} are not all reserved "
                                 f"({seq.num_tokens} are); extend first")
            if num:
                first, last = start // bs, (start + num - 1) // bs
                copies = [i for i in range(first, last + 1) if self._needs_copy(seq, i)]
                num_copies += len(copies)
                plans.append((seq, first, last, copies))
        if num_copies > self.pool.num_available:
            raise PoolExhausted(f"pool exhausted: copy-on-write needs {num_copies} blocks, "
                                f"{self.pool.num_available} free or evictable")
        for seq, first, last, copies in plans:
            for i in range(first, last + 1):
                if i in copies:
                    self._cow(seq, i)
                else:
                    self._writable(seq, i)
        return array("q", [seq.num_tokens for seq in seqs])

    def commit_batch(self, conn_id: int, cache_ids: Seq[int], num_tokens: Seq[int],
                     tp_rank: Optional[int] = None, rank_connection: bool = False) -> int:
        """:meth:`commit` for every sequence of a batch, all or none checked first.

        ``rank_connection``: the connection is a tensor-parallel rank that may commit
        its shard of sequences it does not hold (a step it rebuilt from a descriptor).
        Returns the number of blocks published by this call.
        """
        slot_ids = self._light_slots(conn_id, cache_ids, any_holder=rank_connection)
        if slot_ids is not None:
            # plain sequences without objects: no prefix keys, so nothing to publish;
            # the checks only
            if tp_rank is not None and not 0 <= tp_rank < self.tp_size:
                raise InvalidArgument(f"tp_rank must be in [0, {self.tp_size}), got {tp_rank}")
            if len(num_tokens) != len(cache_ids):
                raise InvalidArgument(f"num_tokens needs one entry per sequence "
                                      f"({len(cache_ids)})")
            wanted = np.asarray(num_tokens, dtype=np.int64)
            have = self._seq_np[slot_ids, NUM_TOKENS]
            bad = (wanted < 0) | (wanted > have)
            if bad.any():
                i = int(np.argmax(bad))
                raise OutOfRange(f"commit of {int(wanted[i])} tokens, "
                                 f"{format_cache_id(int(cache_ids[i]))} has {int(have[i])} "
                                 "reserved")
            return 0
        seqs = self._batch_sequences(conn_id, cache_ids, any_live=rank_connection)
        if tp_rank is not None and not 0 <= tp_rank < self.tp_size:
            raise InvalidArgument(f"tp_rank must be in [0, {self.tp_size}), got {tp_rank}")
        if len(num_tokens) != len(seqs):
            raise InvalidArgument(f"num_tokens needs one entry per sequence ({len(seqs)})")
        for seq, num in zip(seqs, num_tokens):
            if num < 0 or num > seq.num_tokens:
                raise OutOfRange(f"commit of {num} tokens, {format_cache_id(seq.cache_id)} "
                                 f"has {seq.num_tokens} reserved")
        before = self.counters["published_blocks"]
        for seq, num in zip(seqs, num_tokens):
            self._commit(seq, num, tp_rank)
        return self.counters["published_blocks"] - before

    def _extend_keys(self, seq: Sequence, num: int, tokens) -> None:
        if not seq.keys_open or not num:
            return
        if tokens is None:
            # Token ids of this stretch are unknown: blocks from here on get no key,
            # the keys already computed stay publishable.
            seq.keys_open, seq.tail_tokens = False, []
            self._keys_open_np[seq.slot] = False
            return
        tail = seq.tail_tokens + tokens
        parent = seq.keys[-1] if seq.keys else seq.root
        new_keys = hashing.block_keys(tail, self.block_size, parent)
        seq.keys += new_keys
        seq.tail_tokens = tail[len(new_keys) * self.block_size:]

    # -- writes and commits ----------------------------------------------------------------

    def prepare_write(self, conn_id: int, cache_id: int, start: int, num_tokens: int) -> dict:
        """Make the blocks of slots ``[start, start + num_tokens)`` writable in place.

        Blocks only this sequence references are claimed; shared or published blocks
        get a private copy (copy-on-write). Returns the sequence's info (full table).
        """
        seq = self._held(conn_id, cache_id)
        _check_count("start", start)
        _check_count("num_tokens", num_tokens)
        if start + num_tokens > seq.num_tokens:
            raise OutOfRange(f"slots [{start}, {start + num_tokens}) lie past the "
                             f"{seq.num_tokens} reserved in {format_cache_id(cache_id)}; "
                             f"extend first")
        if num_tokens:
            first, last = start // self.block_size, (start + num_tokens - 1) // self.block_size
            copies = {i for i in range(first, last + 1) if self._needs_copy(seq, i)}
            if len(copies) > self.pool.num_available:
                raise PoolExhausted(f"pool exhausted: copy-on-write needs {len(copies)} "
                                    f"blocks, {self.pool.num_available} free or evictable")
            for i in range(first, last + 1):
                if i in copies:
                    self._cow(seq, i)
                else:
                    self._writable(seq, i)
        return self._info(seq)

    def commit(self, conn_id: int, cache_id: int, num_tokens: int,
               tp_rank: Optional[int] = None) -> int:
        """Declare the first ``num_tokens`` slots fully written (by ``tp_rank``, or all ranks).

        Full blocks with known token ids become prefix-cache hits once every rank has
        committed them. Returns how many leading blocks are published now.
        """
        seq = self._held(conn_id, cache_id)
        _check_count("num_tokens", num_tokens)
        if num_tokens > seq.num_tokens:
            raise OutOfRange(f"commit of {num_tokens} tokens, only {seq.num_tokens} reserved")
        return self._commit(seq, num_tokens, tp_rank)

    def _commit(self, seq: Sequence, num_tokens: int, tp_rank: Optional[int]) -> int:
        if tp_rank is None:
            ranks = range(self.tp_size)
        else:
            if isinstance(tp_rank, bool) or not isinstance(tp_rank, int) or not (
                    0 <= tp_rank < self.tp_size):
                raise InvalidArgument(f"tp_rank must be in [0, {self.tp_size}), got {tp_rank}")
            ranks = (tp_rank,)
        for rank in ranks:
            seq.rank_tokens[rank] = max(seq.rank_tokens[rank], num_tokens)
        if not seq.keys:
            return seq.num_committed
        ready = min(min(seq.rank_tokens) // self.block_size, len(seq.keys))
        for index in range(seq.num_committed, ready):
            if self.pool.publish(seq.block_ids[index], seq.keys[index]):
                self.counters["published_blocks"] += 1
                if self.newly_published is not None:
                    block_id = seq.block_ids[index]   # with the binding's identity
                    self.newly_published.append((block_id, seq.keys, index,
                                                 self.pool.key_gen[block_id]))
        seq.num_committed = max(seq.num_committed, ready)
        return seq.num_committed

    # -- references ----------------------------------------------------------------------

    def info(self, conn_id: int, cache_id: int) -> dict:
        """A held sequence's :meth:`_info`, with ``root``: the root key its prefix keys
        chain from (its salt's; None without a prompt), which a move carries."""
        seq = self._held(conn_id, cache_id)
        out = self._info(seq)
        out["root"] = seq.root
        return out

    def _info(self, seq: Sequence) -> dict:
        """A sequence's slot in the shared tables, table and length."""
        return seq.info()

    def clone(self, conn_id: int, cache_id: int) -> dict:
        """A new reference to the same sequence (no copy)."""
        seq = self._held(conn_id, cache_id)
        self._ref(conn_id, seq)
        self._touch(seq.slot)   # two references now: no kept batch steps it
        return self._info(seq)

    def fork(self, conn_id: int, cache_id: int) -> dict:
        """A new sequence sharing every block of ``cache_id`` (copy-on-write on writes)."""
        parent = self._held(conn_id, cache_id)
        self.tables.check_slots(1)
        child = self._new_sequence(parent.root, None)
        self.pool.incref(parent.block_ids)
        self._touch(parent.slot)   # its last block is shared now
        child.block_ids = list(parent.block_ids)
        child.num_tokens = parent.num_tokens
        child.keys = list(parent.keys) if parent.keys is not None else None
        child.keys_open = parent.keys_open
        child.tail_tokens = list(parent.tail_tokens)
        child.num_committed = parent.num_committed
        child.rank_tokens = list(parent.rank_tokens)
        self._publish(child)
        self._ref(conn_id, child)
        return self._info(child)

    def release(self, conn_id: int, cache_id: int) -> None:
        """Drop one reference this connection holds."""
        self.release_many(conn_id, [cache_id])

    def release_many(self, conn_id: int, cache_ids: Seq[int]) -> None:
        """Drop one reference per listed id (an id may repeat); all or none."""
        refs = self.conn_refs.get(conn_id, {})
        light = len(cache_ids) > 8
        if not light:   # (a loop: cold, a generator expression cost the loop more)
            for cache_id in cache_ids:
                if type(cache_id) is int and self._light_slot(cache_id) >= 0:
                    light = True
                    break
        slot_ids = self._light_slots(conn_id, cache_ids) if light else None
        if slot_ids is not None:  # plain sequences without objects: array operations
            self._release_light(slot_ids, self._held_np[conn_id])
            return
        wanted: Dict[int, int] = {}
        for cache_id in cache_ids:
            self._held(conn_id, cache_id)
            wanted[cache_id] = wanted.get(cache_id, 0) + 1
        for cache_id, count in wanted.items():
            if refs[cache_id] < count:
                raise UnknownCache(f"release of {count} references to "
                                   f"{format_cache_id(cache_id)}, this connection holds "
                                   f"{refs[cache_id]}")
        held = self._held_mv[conn_id]
        for cache_id, count in wanted.items():
            refs[cache_id] -= count
            seq = self.sequences[cache_id]
            if not refs[cache_id]:
                del refs[cache_id]
                held[seq.slot] = False
            self._unref(seq, count)

    # -- hand-off ------------------------------------------------------------------------

    def export(self, conn_id: int, cache_id: int, ttl: float) -> bytes:
        """A one-shot token that gives its opener a reference, until ``ttl`` seconds pass.

        The token holds its own reference, so the sequence outlives its producer.
        It carries a 128-bit random secret: knowing the cache id is not enough.
        """
        seq = self._held(conn_id, cache_id)
        if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not (
                0 < ttl <= self.max_handoff_ttl):
            raise InvalidArgument(f"ttl must be in (0, {self.max_handoff_ttl}] seconds, "
                                  f"got {ttl!r}")
        self.expire()
        if len(self.handoffs) >= self.max_handoffs:
            raise LimitExceeded(f"{len(self.handoffs)} hand-offs outstanding, the limit is "
                                f"{self.max_handoffs}; open or let some expire first")
        handoff_id = self._next_handoff_id
        self._next_handoff_id += 1
        secret = os.urandom(16)
        deadline = self.clock() + float(ttl)
        self.handoffs[handoff_id] = _Handoff(secret, seq.cache_id, deadline)
        heapq.heappush(self._handoff_heap, (deadline, handoff_id))
        seq.num_refs += 1
        self._touch(seq.slot)   # its opener may extend it too
        self.counters["exported_handoffs"] += 1
        return bytes([TOKEN_VERSION]) + handoff_id.to_bytes(8, "big") + secret

    def open(self, conn_id: int, token: bytes) -> dict:
        """Turn a hand-off token into a reference held by this connection."""
        if not isinstance(token, bytes):
            raise WrongType("hand-off token must be bytes")
        if len(token) != TOKEN_SIZE or token[0] != TOKEN_VERSION:
            raise HandoffError("malformed hand-off token")
        self.expire()
        handoff_id = int.from_bytes(token[1:9], "big")
        handoff = self.handoffs.get(handoff_id)
        if handoff is None or not hmac.compare_digest(handoff.secret, token[9:]):
            raise HandoffError("unknown hand-off token: forged, already opened, or expired")
        del self.handoffs[handoff_id]
        seq = self.sequences[handoff.cache_id]
        seq.num_refs -= 1  # the token's reference moves to the connection
        self._ref(conn_id, seq)
        self._touch(seq.slot)
        self.counters["opened_handoffs"] += 1
        return self._info(seq)

    def expire(self, now: Optional[float] = None) -> int:
        """Drop hand-offs past their deadline; returns how many expired."""
        now = self.clock() if now is None else now
        heap, expired = self._handoff_heap, 0
        while heap and heap[0][0] <= now:
            _deadline, handoff_id = heapq.heappop(heap)
            handoff = self.handoffs.pop(handoff_id, None)
            if handoff is not None:
                expired += 1
                self._unref(self.sequences[handoff.cache_id])
        self.counters["expired_handoffs"] += expired
        return expired

    def next_deadline(self) -> Optional[float]:
        """The earliest hand-off deadline, for the server loop's select timeout."""
        while self._handoff_heap and self._handoff_heap[0][1] not in self.handoffs:
            heapq.heappop(self._handoff_heap)
        return self._handoff_heap[0][0] if self._handoff_heap else None

    # -- stats and checks ----------------------------------------------------------------

    def stats(self) -> dict:
        pool = self.pool
        out = {"num_blocks": pool.num_blocks, "free_blocks": pool.num_free,
               "cached_blocks": pool.num_cached, "referenced_blocks": pool.num_referenced,
               "evictions": pool.num_evictions, "sequences": self.num_sequences,
               "copies_discarded": pool.num_copies_discarded,
               "connections": len(self.conn_refs), "handoffs": len(self.handoffs),
               "prefix_index_blocks": len(pool.prefix_index)}
        out.update(self.counters)
        return out

    def check_invariants(self) -> None:
        """Assert ref counts equal the references that exist (tests and stress)."""
        self.pool.check_invariants()
        expected = [0] * self.pool.num_blocks
        for seq in self.sequences.values():
            assert seq.num_refs > 0
            assert len(seq.block_ids) == self._blocks_for(seq.num_tokens)
            for block_id in seq.block_ids:
                expected[block_id] += 1
        assert int(self._light_np.sum()) == self._num_light
        kept_count = np.zeros_like(self._kept_count)
        for batches in self._kept.values():
            for kept in batches.values():
                kept_count[kept.where] += 1
        assert np.array_equal(kept_count, self._kept_count)
        for slot in np.flatnonzero(self._light_np).tolist():  # plain ones without objects
            cache_id = int(self._seq_np[slot, CACHE_ID])
            assert cache_id & self._slot_mask == slot and cache_id not in self.sequences
            holders = [conn for conn, held in self._held_np.items() if held[slot]]
            assert holders == [int(self._light_conn[slot])]
            assert cache_id not in self.conn_refs[holders[0]]
            used = int(self._num_blocks_np[slot])
            assert used == self._blocks_for(int(self._seq_np[slot, NUM_TOKENS]))
            for block_id in self._table_np[slot, :used].tolist():
                expected[block_id] += 1
                assert self.pool.owner[block_id] == cache_id
                assert self.pool.block_key[block_id] is None
        assert expected == list(self.pool.ref_cnt), "ref counts differ from the block tables"
        refs = {}
        for conn in self.conn_refs.values():
            for cache_id, count in conn.items():
                refs[cache_id] = refs.get(cache_id, 0) + count
        for handoff in self.handoffs.values():
            refs[handoff.cache_id] = refs.get(handoff.cache_id, 0) + 1
        light = self._seq_np[np.flatnonzero(self._light_np), CACHE_ID].tolist()
        refs.update(dict.fromkeys(light, 1))   # each held once, by its connection
        assert refs == self.live()
        for conn_id, held in self._held_np.items():
            assert {int(self._seq_np[slot, CACHE_ID]) for slot in np.flatnonzero(held).tolist()
                    } == set(self.conn_refs[conn_id]) | {
                        cache_id for cache_id in light
                        if self._light_conn[cache_id & self._slot_mask] == conn_id}

