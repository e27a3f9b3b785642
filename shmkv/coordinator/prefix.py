"""Allocation and the prefix index: where an allocation and a commit are decided.

Owns an allocation's plan (:class:`AllocationPlan`: the prompt's keys, its hits in the
pool, what a lower tier promotes, the blocks it needs), checked in full before
anything changes, then applied; promotions from the tiers (:class:`PendingPromotion`)
and their completion; a sequence's prefix keys as it grows (``Sequence.keys``,
``keys_open``, ``tail_tokens``: written here only, a fork's and a truncate's through
:meth:`Prefix.inherit` and :meth:`Prefix.truncate_keys`); commits, which publish full
blocks once every tensor-parallel rank has written them (``num_committed``,
``rank_tokens``); the early-answer state below (``num_cached``, ``promoting``,
``fetching``, ``gap``); the hit and miss counts, per client too; the tiers and the
blocks published for a shared store (``newly_published``).

Does not own rows, slots or lengths (``shmkv.coordinator.rows``: this part uses its
:meth:`~shmkv.coordinator.rows.Rows.new_sequence`,
:meth:`~shmkv.coordinator.rows.Rows.publish`,
:meth:`~shmkv.coordinator.rows.Rows.set_keys_open` and its checks), nor references
(``shmkv.coordinator.refs``: :meth:`~shmkv.coordinator.refs.Refs.ref`,
:meth:`~shmkv.coordinator.refs.Refs.held` and its batch checks). Plain allocations by
count are the rows' (:meth:`~shmkv.coordinator.rows.Rows.allocate_light`). The rule that
bytes are stored under a key only while the block holds it is the allocator's
(``shmkv.coordinator.allocator``); a promotion checks it before it publishes.

Early answers. An allocation may be answered before its promoted blocks are in
(``allocate(..., wait=False)``, the coordinator's ``_promote_early``). The rule for such a
sequence is kept here, and every path asks it here:

* Until its promotion has settled (``Sequence.promoting``: blocks still coming) only its
  holders use it. The blocks coming in are marked ``PROMOTING`` in the shared ``owner``
  array (``BlockPool.hold_promoting``), so a peek, which holds no
  reference and cannot wait, refuses them (``NotSettled``); a clone, a fixed-length view
  and a handle opened from a hand-off say in their info what is still coming
  (:meth:`~shmkv.coordinator.rows.Sequence.info`), and ``settle`` waits for it; a fork waits for it
  too (the coordinator holds the request until the promotion ends), and
  :meth:`Prefix.check_settled` refuses one that did not. A commit meanwhile is recorded and
  publishes nothing; what it made ready is published once the last of its blocks is in.
* After a promotion answered early came up short, nothing from the first block that did
  not arrive on is published until every rank has written it again
  (``Sequence.gap``: per rank, how far it has written contiguously from there, moved by
  commits whose ``start`` lies within what it had written; a batch step's commit gives
  each sequence's start too). A fork keeps the guard; a truncate shortens it.
"""

from __future__ import annotations

import operator
from typing import Any, Dict, List, NamedTuple, Optional, Sequence as Seq, Tuple

import numpy as np

from shmkv import hashing
from shmkv.coordinator.refs import Refs
from shmkv.coordinator.rows import (
    MAX_REQUEST_ID,
    MAX_SALT_BYTES,
    Rows,
    Sequence,
    _check_count,
    format_cache_id,
)
from shmkv.errors import InvalidArgument, NotSettled, OutOfRange, PoolExhausted, WrongType
from shmkv.memory.tables import NUM_TOKENS


class AllocationPlan(NamedTuple):
    """What one allocation request needs, decided before anything changes."""

    num_tokens: int  #: the sequence's length
    keys: Optional[List[bytes]]  #: prefix keys of the prompt's full blocks (None: no prompt)
    tail: List[int]  #: the prompt's token ids after its last full block
    root: Optional[bytes]  #: the root key of its chain (salt, model)
    hits: List[int]  #: pool blocks of its longest published prefix
    need: int  #: new blocks it takes (promoted ones included)
    request_id: Optional[str]  #: its request id, if the client named one
    promote: int  #: blocks a lower tier copies in after the pool hits
    later: List[int]  #: pool blocks that hit again after the promoted ones
    #: blocks after the pool hits that others compute now, for a request that defers to
    #: them (``defer``): then nothing is allocated
    computing: int = 0


class PendingPromotion:
    """Blocks of a new sequence whose bytes a lower tier is copying in (``shmkv.tiers``).

    ``blocks[i]`` gets the bytes of ``keys[i]``; they are blocks ``first ..`` of ``seq``,
    held by one extra reference each until :meth:`shmkv.coordinator.prefix.Prefix.finish_promotion`.
    ``info`` is the answer to the request, completed then.
    """

    __slots__ = ("seq", "info", "first", "keys", "blocks", "gens", "client")

    def __init__(
        self,
        seq: Sequence,
        info: dict,
        first: int,
        keys: list,
        blocks: list,
        gens: Optional[list] = None,
        client: Optional[List[int]] = None,
    ):
        self.seq, self.info, self.first, self.keys, self.blocks = seq, info, first, keys, blocks
        # each block's key generation when the copy in began (``BlockPool.identity``)
        self.gens = gens
        self.client = client  # the asking client's counts (SequenceTable.client_counts)


class Prefix:
    """Allocations, prefix keys, promotions and commits (see the module doc).

    Args:
        rows: the rows part (new sequences, their rows, the length bound).
        refs: the references part (who holds what is allocated).
    """

    def __init__(self, rows: Rows, refs: Refs):
        self._rows = rows
        self._refs = refs
        self.pool = rows.pool
        self.block_size = rows.block_size
        self.tp_size = rows.tp_size
        # Lower tiers (``shmkv.tiers.TierSet``, set by the coordinator): a prefix that
        # misses the pool continues there. ``promotions``: what the last allocate must
        # copy in before it is answered (the coordinator takes them).
        self.tiers: Any = None
        self.promotions: List[PendingPromotion] = []
        # Blocks a commit published, as ``(block_id, the sequence's keys, index,
        # key generation)``, for a shared store to write behind
        # (``shmkv.tiers.redis_store``, which sets and takes it); None without one. The
        # keys list only grows, so ``keys[:index + 1]`` stays this block's chain.
        self.newly_published: Optional[list] = None
        # Per connection: the ``[hit tokens, miss tokens]`` of its prompts, a list the
        # coordinator shares among the connections of one client name (``/metrics``);
        # every connection has one, so they sum to the two counters below.
        self.client_counts: Dict[int, List[int]] = {}
        # The in-flight index: a prompt block's key -> the cache id of the live sequence
        # computing it (allocated without a hit there), the block's index in it and the
        # connection that allocated it. Entries are checked when read (``_computes``),
        # never kept up to date: a commit, a release or a truncate makes one stale, and
        # stale ones are swept as the index grows past twice the pool (live entries are
        # uncommitted blocks of live sequences: at most the pool's), a few ints each.
        self.in_flight: Dict[bytes, Tuple[int, int, int]] = {}
        self.counters = {
            "prefix_hit_tokens": 0,
            "prefix_miss_tokens": 0,
            "prefix_hit_blocks": 0,
            "prefix_miss_blocks": 0,
            "published_blocks": 0,
            "deferred_allocations": 0,
        }

    def drop_connection(self, conn_id: int) -> None:
        """Forget a closed connection's hit counts (its client name's list stays with
        the coordinator)."""
        self.client_counts.pop(conn_id, None)

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
            got = len(sent) if isinstance(sent, bytes) else type(sent).__name__
            raise InvalidArgument(
                f"keys must be the {full} full blocks' {size}-byte prefix "
                f"keys of the prompt, {full * size} bytes; got {got}"
            )
        return hashing.split_keys(sent)

    def _request_keys(
        self, req: dict
    ) -> Tuple[int, Optional[List[bytes]], List[int], Optional[bytes], Optional[str]]:
        """An allocation request checked: its length, its prompt's full blocks' keys (None
        without a prompt), the token ids after them, its root key and its request id."""
        num_tokens = _check_count("num_tokens", req.get("num_tokens", 0))
        prompt = req.get("prompt")
        salt = req.get("cache_salt")
        request_id = req.get("request_id")
        if salt is not None and (not isinstance(salt, bytes) or len(salt) > MAX_SALT_BYTES):
            raise InvalidArgument(f"cache_salt must be bytes of at most {MAX_SALT_BYTES}")
        if request_id is not None and (
            not isinstance(request_id, str) or len(request_id) > MAX_REQUEST_ID
        ):
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
                    raise InvalidArgument(
                        "prompt token ids must be ints in the int64 range"
                    ) from None
            else:
                raise WrongType("prompt must be a list of token ids")
            length = len(packed) // 8
            if num_tokens not in (0, length):
                raise InvalidArgument(
                    f"num_tokens={num_tokens} disagrees with a prompt of "
                    f"{length} tokens; pass one or make them equal"
                )
            num_tokens = length
            root = req.get(
                "root"
            )  # a moved sequence's (shmkv.integrations.distributed): its salt's root
            if root is None:
                root = hashing.root_key(salt)
            elif salt is not None or not isinstance(root, bytes) or len(root) != hashing.KEY_SIZE:
                raise InvalidArgument(
                    f"root must be a {hashing.KEY_SIZE}-byte root key, given without cache_salt"
                )
            keys = self._prompt_keys(req.get("keys"), packed, root)
            tail = hashing.unpack_tokens(packed, len(keys) * self.block_size)
        elif salt is not None:
            raise InvalidArgument("cache_salt needs a prompt")
        elif req.get("keys") is not None or req.get("root") is not None:
            raise InvalidArgument("keys and root come with the prompt they were hashed from")
        return num_tokens, keys, tail, root, request_id

    def _plan_allocate(self, conn_id: int, req: dict) -> AllocationPlan:
        num_tokens, keys, tail, root, request_id = self._request_keys(req)
        self._rows.check_length(num_tokens, "allocate")
        hits = self.pool.lookup(keys) if keys else []
        if keys and req.get("defer"):
            computing = self._computing_from(conn_id, keys, len(hits))
            if computing:  # others compute what follows: nothing is allocated
                self.counters["deferred_allocations"] += 1
                return AllocationPlan(
                    num_tokens, keys, tail, root, hits, 0, request_id, 0, [], computing
                )
        need = self._rows.blocks_for(num_tokens) - len(hits)
        if need > self.pool.num_blocks:
            raise PoolExhausted(
                f"pool exhausted: need {need} blocks for {num_tokens} tokens, "
                f"the whole pool has {self.pool.num_blocks}; raise num_blocks"
            )
        # Tier hits take fresh pool blocks, which ``need`` already counts. The pool may hold
        # blocks past them (their holder copied an earlier one on write, and the published
        # original went down a tier): those are hits too.
        promote = self.tiers.lookup(keys[len(hits) :]) if keys and self.tiers is not None else 0
        if promote and keys:
            assert self.tiers is not None  # (a tier found them)
            self.tiers.keep_planned(keys[len(hits) : len(hits) + promote])
        later = self.pool.lookup(keys[len(hits) + promote :]) if promote and keys else []
        need -= len(later)
        return AllocationPlan(num_tokens, keys, tail, root, hits, need, request_id, promote, later)

    def allocate_many(self, conn_id: int, requests: Seq[dict]) -> List[dict]:
        """Allocate one sequence per request, all or none.

        A request is ``{"num_tokens": n, "prompt": [ids] | None, "cache_salt": bytes,
        "request_id": str, "keys": bytes}``. With a prompt, the longest published prefix
        of full blocks is reused and ``num_cached`` says how many tokens are already
        present. ``keys``: the prompt's full blocks' prefix keys, as its client hashed them
        (see :meth:`_prompt_keys`); hashed here when absent. ``root`` (instead of
        ``cache_salt``): the root key the keys chain from, as
        :meth:`~shmkv.coordinator.refs.Refs.info` gives it (a sequence moved from another
        node keeps its salt's keys). ``defer``: when sequences of other connections are
        computing the prompt's blocks right after its longest published prefix (see
        :meth:`computing`), that request is not allocated and its answer is
        ``{"cached": tokens, "computing": tokens}`` (nothing counted): decided in the
        same turn as the allocation, so of two engines that ask at once, one computes
        and the other defers. A sequence allocated with ``defer`` is itself one that
        others wait for: its uncommitted prompt blocks go into the in-flight index (a
        plain allocation costs the index nothing, and is never waited for: its client
        has not said it commits what it computes).
        """
        planned = [self._plan_allocate(conn_id, req) for req in requests]
        plans = [plan for plan in planned if not plan.computing]
        self._rows.check_slots(len(plans))
        need = sum(plan.need for plan in plans)
        cached_hits = {
            b for plan in plans for b in plan.hits + plan.later if self.pool.ref_cnt[b] == 0
        }
        available = self.pool.num_available - len(cached_hits)
        if need > available:
            raise PoolExhausted(
                f"pool exhausted: need {need} blocks, {available} free or evictable "
                f"(num_blocks={self.pool.num_blocks}); free handles or raise num_blocks"
            )
        for plan in plans:  # take every hit before any allocation can evict it
            self.pool.incref(plan.hits)
            self.pool.incref(plan.later)
        results = []
        client = self.client_counts.get(conn_id)
        bs = self.block_size
        for plan, req in zip(planned, requests):
            if plan.computing:
                results.append({"cached": len(plan.hits) * bs, "computing": plan.computing * bs})
                continue
            num_tokens, keys, tail, root, hits, need_blocks, request_id, promote, later, _ = plan
            seq = self._rows.new_sequence(root, request_id)
            new = self.pool.allocate(need_blocks, seq.cache_id)
            assert new is not None
            # promoted blocks count once their bytes are in
            num_hit = len(hits) + promote + len(later)
            seq.num_cached = num_hit * self.block_size
            seq.num_committed = num_hit
            seq.rank_tokens = [seq.num_cached] * self.tp_size
            self._rows.publish(seq, hits + new[:promote] + later + new[promote:], num_tokens)
            if keys is not None:
                seq.keys = keys
                seq.tail_tokens = list(tail)
                if num_hit < len(keys) and req.get("defer"):
                    self._note_computing(conn_id, seq, num_hit)
                self._count_hits(
                    client,
                    num_hit,
                    len(keys) - num_hit,
                    seq.num_cached,
                    num_tokens - seq.num_cached,
                )
            self._refs.ref(conn_id, seq)
            info = seq.info()
            results.append(info)
            if promote and keys is not None:  # (only prompts with keys promote)
                self.pool.hold_promoting(new[:promote])  # the promotion's own hold
                seq.promoting, seq.promoting_from = promote, len(hits)
                self.promotions.append(
                    PendingPromotion(
                        seq,
                        info,
                        len(hits),
                        keys[len(hits) : len(hits) + promote],
                        new[:promote],
                        [self.pool.key_gen[b] for b in new[:promote]],
                        client,
                    )
                )
        return results

    def _note_computing(self, conn_id: int, seq: Sequence, first: int) -> None:
        """``seq`` (allocated by connection ``conn_id``) computes its prompt's blocks from
        ``first`` on: each key it will publish names it in the in-flight index, unless a
        live sequence already does (that one started first)."""
        index = self.in_flight
        if len(index) > 2 * self.pool.num_blocks + 1024:  # stale entries: sweep them
            for key in [k for k, entry in index.items() if not self._computes(k, entry)]:
                del index[key]
        keys = seq.keys
        assert keys is not None  # (a prompt's)
        for i in range(first, len(keys)):
            key = keys[i]
            entry = index.get(key)
            if entry is None or not self._computes(key, entry):
                index[key] = (seq.cache_id, i, conn_id)

    def _computes(self, key: bytes, entry: Tuple[int, int, int]) -> bool:
        """Whether the in-flight entry of ``key`` still holds: its sequence is alive (a
        cache id is never used again), has not committed that block yet, and still has
        ``key`` there (a truncate and a new extend may have changed it)."""
        cache_id, i, _ = entry
        seq = self._rows.sequences.get(cache_id)
        if seq is None or seq.num_committed > i:
            return False
        keys = seq.keys
        return keys is not None and i < len(keys) and keys[i] == key

    def computing(self, conn_id: int, req: dict) -> dict:
        """How much of a prompt is in the pool, and how much after that other connections'
        live sequences allocated with ``defer`` are computing now: ``{"cached": tokens,
        "computing": tokens}``.

        ``req`` is an allocation request (:meth:`allocate_many`'s, ``num_tokens``
        aside); nothing is allocated, counted or changed. ``computing`` counts the blocks
        right after the pool's longest prefix that sequences allocated (with ``defer``)
        by another connection hold uncommitted under the prompt's keys: they will be published once
        their writers commit them (an engine that has other work may wait for that rather
        than compute them again). A writer that releases its sequence, or dies, stops
        counting at once.
        """
        num_tokens, keys, _, _, _ = self._request_keys(req)
        self._rows.check_length(num_tokens, "computing")
        if not keys:
            return {"cached": 0, "computing": 0}
        hits = len(self.pool.lookup(keys))
        bs = self.block_size
        return {"cached": hits * bs, "computing": self._computing_from(conn_id, keys, hits) * bs}

    def _computing_from(self, conn_id: int, keys: List[bytes], first: int) -> int:
        """How many of ``keys`` from ``first`` on, in a row, sequences of connections
        other than ``conn_id`` compute now (see :meth:`computing`)."""
        index = self.in_flight
        num = 0
        for key in keys[first:]:
            entry = index.get(key)
            if entry is None or entry[2] == conn_id or not self._computes(key, entry):
                break
            num += 1
        return num

    def _count_hits(
        self,
        client: Optional[List[int]],
        hit_blocks: int,
        miss_blocks: int,
        hit_tokens: int,
        miss_tokens: int,
    ) -> None:
        """Count a prompt's hits and misses (or move some from hits to misses, when a
        promotion ends early): in the table's counters and in the asking client's, the
        one place either is changed, so the clients' counts sum to the table's."""
        counters = self.counters
        counters["prefix_hit_blocks"] += hit_blocks
        counters["prefix_miss_blocks"] += miss_blocks
        counters["prefix_hit_tokens"] += hit_tokens
        counters["prefix_miss_tokens"] += miss_tokens
        if client is not None:
            client[0] += hit_tokens
            client[1] += miss_tokens

    def take_promotions(self) -> List[PendingPromotion]:
        """The promotions the last allocate started (the coordinator copies them in)."""
        promotions, self.promotions = self.promotions, []
        return promotions

    def answer_early(self, records: Seq[PendingPromotion], here: Seq[int]) -> None:
        """The allocation of ``records`` is answered before their blocks are in: each
        record's answer says how many blocks still come (``promoting``), from which block
        of the sequence on (``promoting_from``), and how many of them are only asked of
        the shared store, which may not have them (``fetching``: all but ``here[i]``, the
        leading ones the local tiers hold). A loss then guards the sequence (see the
        module doc)."""
        for record, num_here in zip(records, here):
            info, num = record.info, len(record.blocks)
            info["promoting"] = info.get("promoting", 0) + num
            info["promoting_from"] = min(info.get("promoting_from", record.first), record.first)
            info["fetching"] = info.get("fetching", 0) + num - num_here
            record.seq.fetching += num - num_here

    def check_settled(self, seq: Sequence, what: str) -> None:
        """Raise ``NotSettled`` while a tier still copies blocks of ``seq`` in (see the
        module doc): ``what`` cannot be done to it before."""
        if seq.promoting:
            raise NotSettled(
                f"{what} of {format_cache_id(seq.cache_id)}: a tier still copies "
                f"{seq.promoting} of its blocks in (answered early); settle() first"
            )

    def finish_promotion(self, record: PendingPromotion, num_ok: int) -> int:
        """The bytes of the first ``num_ok`` promoted blocks are in: publish them under
        their keys. A block after them did not arrive (a damaged file), so the hit ends
        there, pool hits past the promoted blocks included: the answer's ``num_cached``
        shrinks and the caller writes the rest (copying those shared blocks on write);
        a sequence answered early is guarded from then on (see the module doc). Drops the
        promotion's hold (the sequence may be gone by now: its connection closed); once
        the last of the sequence's promoted blocks is in, publishes what its commits made
        ready meanwhile. Returns how many blocks were published (fewer than ``num_ok``
        when a block changed under its copy: ``BlockPool.still_holds``)."""
        pool, seq = self.pool, record.seq
        pool.end_promoting(record.blocks)
        if record.gens is not None:  # a block that changed under the copy ends the hit
            for i in range(num_ok):
                if not pool.still_holds(record.blocks[i], None, record.gens[i]):
                    pool.discard_copies(num_ok - i)
                    num_ok = i
                    break
        # (a key published meanwhile is skipped; fine)
        pool.publish_many(record.blocks[:num_ok], record.keys)
        seq.promoting -= len(record.blocks)
        # The hit ends at this record's first missing block, unless an earlier part of
        # the same request ended it before (a local part ends, its store part comes
        # back with nothing): never later than it already ends, so never negative.
        # (The hit's blocks, not the committed ones: a holder answered early may have
        # committed blocks of its own past the hit already.)
        end = record.first + num_ok
        hit = -(-seq.num_cached // self.block_size)  # (a truncate may end it mid-block)
        lost = hit - min(hit, end) if num_ok < len(record.blocks) else 0
        if lost:
            tokens = seq.num_cached - end * self.block_size
            seq.num_committed = min(seq.num_committed, end)
            seq.num_cached = end * self.block_size
            record.info["num_cached"] = seq.num_cached
            self._count_hits(record.client, -lost, lost, -tokens, tokens)
            if "promoting" in record.info:
                # Answered early (``wait=False``): its holders were told of a longer hit
                # and may have written from there on, never into the blocks that did not
                # arrive. Nothing from the first of them on is published until every rank
                # has written it again (``_commit``); what they committed stays recorded.
                lost_at = seq.num_committed * self.block_size
                gap = seq.gap
                seq.gap = (
                    [lost_at] * self.tp_size if gap is None else [min(g, lost_at) for g in gap]
                )
            else:  # answered now: nobody has written from the longer hit
                seq.rank_tokens = [seq.num_cached] * self.tp_size
        pool.decref(reversed(record.blocks))
        if not seq.promoting:
            seq.fetching = 0
            if self._rows.sequences.get(seq.cache_id) is seq:  # (still alive)
                self._publish_ready(seq)
        return num_ok

    def settled(self, conn_id: int, cache_id: int) -> int:
        """The hit of held sequence ``cache_id`` once its early promotions have ended
        (the ``settle`` answer)."""
        return self._refs.held(conn_id, cache_id).num_cached

    def inherit(self, parent: Sequence, child: Sequence) -> None:
        """A fork ``child`` of ``parent`` (not published yet) takes its prefix keys, its
        commits and its loss guard (see the module doc)."""
        child.keys = list(parent.keys) if parent.keys is not None else None
        child.keys_open = parent.keys_open
        child.tail_tokens = list(parent.tail_tokens)
        child.num_committed = parent.num_committed
        child.rank_tokens = list(parent.rank_tokens)
        child.gap = None if parent.gap is None else list(parent.gap)

    def truncate_keys(self, seq: Sequence, num: int) -> None:
        """``seq`` was shortened to ``num`` tokens: its prefix keys past the new end go
        (when the end falls inside a keyed block, it gets no keys from there on), and its
        commits, hit and loss guard are cut there."""
        bs = self.block_size
        full = num // bs
        if seq.keys is not None:
            if len(seq.keys) > full:
                del seq.keys[full:]
                seq.tail_tokens = []
                if num % bs:
                    seq.keys_open = False
            else:
                del seq.tail_tokens[num - len(seq.keys) * bs :]
            self._rows.set_keys_open(seq)
        seq.num_committed = min(seq.num_committed, full)
        seq.rank_tokens = [min(done, num) for done in seq.rank_tokens]
        seq.num_cached = min(seq.num_cached, num)
        if seq.gap is not None:  # (cut below the lost blocks, the guard ends)
            seq.gap = [min(done, num) for done in seq.gap]
            self._maybe_end_gap(seq)

    def extend_keys(self, seq: Sequence, num: int, tokens: Optional[List[int]]) -> None:
        """The prefix keys of ``seq`` after ``num`` more tokens, ``tokens`` their ids (None:
        unknown, so no later block gets a key)."""
        if not seq.keys_open or not num:
            return
        if tokens is None:
            # Token ids of this stretch are unknown: blocks from here on get no key,
            # the keys already computed stay publishable.
            seq.keys_open, seq.tail_tokens = False, []
            self._rows.set_keys_open(seq)
            return
        tail = seq.tail_tokens + tokens
        # keys_open: the sequence has a root, and its keys are a list
        assert seq.keys is not None and seq.root is not None
        parent = seq.keys[-1] if seq.keys else seq.root
        new_keys = hashing.block_keys(tail, self.block_size, parent)
        seq.keys += new_keys
        seq.tail_tokens = tail[len(new_keys) * self.block_size :]

    def commit(
        self,
        conn_id: int,
        cache_id: int,
        num_tokens: int,
        tp_rank: Optional[int] = None,
        start: Optional[int] = None,
    ) -> int:
        """Declare the first ``num_tokens`` slots fully written (by ``tp_rank``, or all ranks).

        Full blocks with known token ids become prefix-cache hits once every rank has
        committed them. ``start``: where this commit's writes began (the hit it wrote
        after), which a sequence whose early-answered promotion came up short needs
        (see the module doc). Returns how many leading blocks are published now.
        """
        seq = self._refs.held(conn_id, cache_id)
        _check_count("num_tokens", num_tokens)
        if start is not None:
            _check_count("start", start)
        if num_tokens > seq.num_tokens:
            raise OutOfRange(f"commit of {num_tokens} tokens, only {seq.num_tokens} reserved")
        return self._commit(seq, num_tokens, tp_rank, start)

    def _commit(
        self, seq: Sequence, num_tokens: int, tp_rank: Optional[int], start: Optional[int] = None
    ) -> int:
        ranks: Seq[int]
        if tp_rank is None:
            ranks = range(self.tp_size)
        else:
            if (
                isinstance(tp_rank, bool)
                or not isinstance(tp_rank, int)
                or not (0 <= tp_rank < self.tp_size)
            ):
                raise InvalidArgument(f"tp_rank must be in [0, {self.tp_size}), got {tp_rank}")
            ranks = (tp_rank,)
        for rank in ranks:
            seq.rank_tokens[rank] = max(seq.rank_tokens[rank], num_tokens)
        if seq.promoting:  # recorded; published once its blocks are in (finish_promotion)
            return seq.num_committed
        gap = seq.gap
        if gap is not None:
            if start is not None:
                for rank in ranks:  # written again from within what it had: contiguous
                    if start <= gap[rank]:
                        gap[rank] = max(gap[rank], num_tokens)
            self._maybe_end_gap(seq)
        return self._publish_ready(seq)

    def _maybe_end_gap(self, seq: Sequence) -> None:
        """The loss guard ends once every rank has written again all it committed."""
        gap = seq.gap
        if gap is not None and all(map(operator.ge, gap, seq.rank_tokens)):
            seq.gap = None

    def _publish_ready(self, seq: Sequence) -> int:
        """Publish the full keyed blocks every rank has committed, up to the loss guard
        (see the module doc); returns how many leading blocks are published now."""
        if not seq.keys:
            return seq.num_committed
        ready = min(min(seq.rank_tokens) // self.block_size, len(seq.keys))
        if seq.gap is not None:  # nobody has written the lost blocks (of every rank) yet
            ready = min(ready, min(seq.gap) // self.block_size)
        for index in range(seq.num_committed, ready):
            if self.pool.publish(seq.block_ids[index], seq.keys[index]):
                self.counters["published_blocks"] += 1
                if self.newly_published is not None:
                    block_id = seq.block_ids[index]  # with the binding's identity
                    self.newly_published.append(
                        (block_id, seq.keys, index, self.pool.key_gen[block_id])
                    )
        seq.num_committed = max(seq.num_committed, ready)
        return seq.num_committed

    def commit_batch(
        self,
        conn_id: int,
        cache_ids: Seq[int],
        num_tokens: Seq[int],
        tp_rank: Optional[int] = None,
        rank_connection: bool = False,
        starts: Optional[Seq[int]] = None,
    ) -> int:
        """:meth:`commit` for every sequence of a batch, all or none checked first.

        ``rank_connection``: the connection is a tensor-parallel rank that may commit
        its shard of sequences it does not hold (a step it rebuilt from a descriptor).
        ``starts``: where each sequence's writes began (:meth:`commit`'s ``start``).
        Returns the number of blocks published by this call.
        """
        if starts is not None:
            if len(starts) != len(cache_ids):
                raise InvalidArgument(
                    f"starts needs one entry per sequence ({len(cache_ids)}), got {len(starts)}"
                )
            if len(starts) and min(starts) < 0:
                raise InvalidArgument(f"starts must be >= 0, got {min(starts)}")
        slot_ids = self._refs.light_slots(conn_id, cache_ids, any_holder=rank_connection)
        if slot_ids is not None:
            # plain sequences without objects: no prefix keys, so nothing to publish;
            # the checks only
            if tp_rank is not None and not 0 <= tp_rank < self.tp_size:
                raise InvalidArgument(f"tp_rank must be in [0, {self.tp_size}), got {tp_rank}")
            if len(num_tokens) != len(cache_ids):
                raise InvalidArgument(f"num_tokens needs one entry per sequence ({len(cache_ids)})")
            wanted = np.asarray(num_tokens, dtype=np.int64)
            have = self._rows.seq_np[slot_ids, NUM_TOKENS]
            bad = (wanted < 0) | (wanted > have)
            if bad.any():
                i = int(np.argmax(bad))
                raise OutOfRange(
                    f"commit of {int(wanted[i])} tokens, "
                    f"{format_cache_id(int(cache_ids[i]))} has {int(have[i])} "
                    "reserved"
                )
            return 0
        seqs = self._refs.batch_sequences(conn_id, cache_ids, any_live=rank_connection)
        if tp_rank is not None and not 0 <= tp_rank < self.tp_size:
            raise InvalidArgument(f"tp_rank must be in [0, {self.tp_size}), got {tp_rank}")
        if len(num_tokens) != len(seqs):
            raise InvalidArgument(f"num_tokens needs one entry per sequence ({len(seqs)})")
        for seq, num in zip(seqs, num_tokens):
            if num < 0 or num > seq.num_tokens:
                raise OutOfRange(
                    f"commit of {num} tokens, {format_cache_id(seq.cache_id)} "
                    f"has {seq.num_tokens} reserved"
                )
        before = self.counters["published_blocks"]
        if starts is None:
            for seq, num in zip(seqs, num_tokens):
                self._commit(seq, num, tp_rank)
        else:
            for seq, num, start in zip(seqs, num_tokens, starts):
                self._commit(seq, num, tp_rank, start)
        return self.counters["published_blocks"] - before
