"""Block bookkeeping: free blocks, ref counts, the prefix index and LRU eviction.

Owns which physical block is free, cached or referenced, how many references each
has, which published prefix key names it, and which sequence may write it in place.
Does not know about sequences, connections or memory; ``shmkv.coordinator.sequences`` builds on
it. Pure: lists, arrays, ints and dicts (numpy views for bulk stores), no torch, no I/O.

Every block is in exactly one state:

* free: ``ref_cnt == 0``, no key, on the free stack;
* cached: ``ref_cnt == 0``, published key, in the LRU (oldest first);
* referenced: ``ref_cnt > 0`` (published or not).

Allocation takes free blocks first and evicts cached blocks, least recently used
first, only when no free block is left. Running short is a normal outcome:
``allocate`` returns None and changes nothing; only misuse raises.

``owner`` is shared with workers (a read-only shared-memory array in their
processes): ``owner[b] == cache_id`` means sequence ``cache_id`` may write block
``b`` in place; 0 means a write must first ask the coordinator (the block is shared,
published, free, or not yet claimed), and :data:`PROMOTING` (-1) that a lower tier is
still copying its bytes in (:meth:`BlockPool.hold_promoting`): nobody writes it in
place, and a reader that holds no reference refuses it (``shmkv.client.handle.SequencePeek``).
Only the coordinator writes it. ``epoch[0]`` moves whenever a block stops being
writable by the sequence that owned it (shared by a fork or a prefix hit, or
published), so a writer that checked ``owner`` need not check again until the epoch
moves.

Keys and bytes: the one invariant every copy keeps. **A block's bytes are only ever
stored under a key while that block still holds that key.** It is enforced here, next
to the only code that binds a key (:meth:`BlockPool.publish`) and unbinds it (the
eviction in :meth:`BlockPool.allocate`): each block has a key generation,
``key_gen[b]``, that moves at both, so ``(block_key[b], key_gen[b])`` names one
binding of one key to one block (:meth:`BlockPool.identity`). A published block is
immutable while it holds its key, so a copy of its bytes is good exactly when the
binding it started under still stands once its last read is done. Every copy that
leaves the pool (a host or disk demotion, a Redis write, a ``send_sequence`` move)
records the identity when it is queued and calls :meth:`BlockPool.still_holds` after
its last read of the bytes (on the loop when its completion is taken, or, in a worker
thread of the coordinator, before it publishes the copy anywhere); a copy whose block
changed is discarded and counted once, in ``num_copies_discarded``
(:meth:`BlockPool.discard_copies`). A copy into the pool (a promotion, a pull) lands in
fresh, unkeyed blocks the promotion holds, and checks the same before they are
published under their keys. The generation moves before the eviction hook runs and
before the allocation is answered, so nobody can have written the block's new bytes
while the old binding was still seen standing.

Two hooks serve the tiers under the pool (``shmkv.tiers``), both None without tiers:
``newly_cached`` collects blocks that became cached (a dict used as an ordered set, to
be copied down behind the caller's back), and ``on_evict(block_ids, keys)`` is called
once per allocation that evicts, with the evicted blocks and the keys they had, before
anyone can be told to write them. A third, ``copying`` (a container of block ids,
or None), names the cached blocks whose copy down a tier is not done yet: eviction
takes the other cached blocks first (least recently used first), and counts those in
``newly_cached`` (not even placed yet) as not safe either, so a block is lost to every
tier only when nothing safe is left to evict.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from typing import Callable, Collection, Dict, Iterable, List, Optional, Sequence, Union

import numpy as np

NO_OWNER = 0
# ``owner`` of a block a lower tier is copying into (a promotion's, until it ends).
PROMOTING = -1
# Blocks a bulk call takes or frees with array stores rather than a loop. Below this a
# loop costs less where it matters: the coordinator's loop runs cold after its sleeps, and
# cold, numpy's stores of 32 blocks took 68 us against the loop's 30 (warm: 2 against 4).
_BULK = 128

# An int64 sequence written in place: this process's ``array("q")``, or a memoryview
# cast to ``"q"`` over the coordinator's shared memory.
Int64Buffer = Union["array[int]", memoryview]


class BlockPool:
    """Ref-counted block allocator with a prefix index and LRU eviction.

    Args:
        num_blocks: blocks in the pool.
        owner: a writable int64 sequence of ``num_blocks`` (shared memory in the
            coordinator); a private array when omitted.
        epoch: a writable int64 sequence whose item 0 is the ownership epoch; a
            private one when omitted.
        owner_np: ``owner`` as a numpy array over the same memory, for bulk stores;
            made over ``owner`` when omitted (which then cannot be released while
            the pool lives).
    """

    def __init__(
        self,
        num_blocks: int,
        owner: Optional[Int64Buffer] = None,
        epoch: Optional[Int64Buffer] = None,
        owner_np: Optional[np.ndarray] = None,
    ):
        self.num_blocks = num_blocks
        # int64 per block, with a numpy view for bulk stores (never resized)
        self.ref_cnt = array("q", bytes(8 * num_blocks))
        self._ref_np = np.frombuffer(self.ref_cnt, dtype=np.int64)
        self.block_key: List[Optional[bytes]] = [None] * num_blocks
        # Free blocks as a stack: allocating k blocks is one slice, no per-block object.
        # Reversed so that a fresh pool hands out block 0 first.
        self._free: List[int] = list(range(num_blocks - 1, -1, -1))
        # ref_cnt == 0 blocks with a key, oldest first. OrderedDict gives O(1)
        # pop-oldest, move and remove-by-id (a plain dict degrades when popped from
        # the front repeatedly).
        self._cached: "OrderedDict[int, None]" = OrderedDict()
        self.prefix_index: dict = {}
        self.owner = owner if owner is not None else array("q", bytes(8 * num_blocks))
        self._owner_np = (
            owner_np if owner_np is not None else np.frombuffer(self.owner, dtype=np.int64)
        )
        self.epoch = epoch if epoch is not None else array("q", [0])
        # Key generation per block: moves when a key is bound (publish) and unbound
        # (eviction); see the module doc. Only the loop writes it.
        self.key_gen = array("q", bytes(8 * num_blocks))
        self.num_evictions = 0
        self.num_copies_discarded = 0
        self.newly_cached: Optional[Dict[int, None]] = None
        self.on_evict: Optional[Callable[..., None]] = None  # (block_ids, keys); see the module doc
        # (tiers) blocks whose copy down a tier is not done
        self.copying: Optional[Collection[int]] = None

    # -- counts ------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks with no key and no reference."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Unreferenced blocks that keep a published key (evictable)."""
        return len(self._cached)

    @property
    def num_available(self) -> int:
        """Blocks an allocation can take now (free + evictable)."""
        return len(self._free) + len(self._cached)

    @property
    def num_referenced(self) -> int:
        return self.num_blocks - self.num_available

    # -- allocation --------------------------------------------------------------------

    def allocate(
        self, num: int, owner_id: Union[int, Sequence[int], np.ndarray]
    ) -> Optional[List[int]]:
        """Take ``num`` blocks with ``ref_cnt = 1`` writable by ``owner_id``: one id for
        all, or one per block (in the order returned).

        Returns None, changing nothing, when fewer than ``num`` blocks are available.
        """
        if num > len(self._free) + len(self._cached):
            return None
        if num == 0:
            return []
        take = min(num, len(self._free))
        ids = self._free[len(self._free) - take :]
        del self._free[len(self._free) - take :]
        ids.reverse()  # ascending ids from a fresh pool
        if num > take:  # evictions: the loop's hot path under tiers, so names are local
            victims = self._victims(num - take)
            block_key, index, key_gen = self.block_key, self.prefix_index, self.key_gen
            keys = []
            for block_id in victims:
                key = block_key[block_id]
                del index[key]
                block_key[block_id] = None  # the one place a key is unbound
                key_gen[block_id] += 1
                keys.append(key)
            ids += victims
            self.num_evictions += num - take
            if self.on_evict is not None:  # one call for them all (see the module doc)
                self.on_evict(victims, keys)
        if len(ids) >= _BULK:
            where = np.array(ids, dtype=np.int64)
            self._ref_np[where] = 1
            self._owner_np[where] = owner_id
            return ids
        ref_cnt, owner = self.ref_cnt, self.owner
        # (isinstance, not np.ndim: cold, np.ndim of an int took 38 us in the loop)
        owners = [owner_id] * len(ids) if isinstance(owner_id, (int, np.integer)) else owner_id
        for block_id, block_owner in zip(ids, owners):
            ref_cnt[block_id] = 1
            owner[block_id] = block_owner
        return ids

    def _victims(self, num: int) -> List[int]:
        """The ``num`` cached blocks an allocation evicts, taken out of the LRU: the least
        recently used first, except that the blocks in neither ``copying`` nor
        ``newly_cached`` go first, then the others, each oldest first (scanning at most
        ``num`` blocks plus those: the copies in flight and waiting)."""
        cached, copying, pending = self._cached, self.copying or (), self.newly_cached or ()
        if not copying and not pending:
            popitem = cached.popitem
            return [popitem(last=False)[0] for _ in range(num)]
        safe: List[int] = []
        waiting: List[int] = []
        for block_id in cached:
            if block_id not in copying and block_id not in pending:
                safe.append(block_id)
                if len(safe) == num:
                    break
            elif len(waiting) < num:
                waiting.append(block_id)
        victims = (safe + waiting)[:num]
        for block_id in victims:
            del cached[block_id]
        return victims

    def allocate_each(self, owner_ids: Sequence[int]) -> Optional[List[int]]:
        """One block for each owner (a decode step's new blocks), in that order; None,
        changing nothing, when there are not enough."""
        return self.allocate(len(owner_ids), owner_ids)

    def incref(self, block_ids: Iterable[int]) -> None:
        """Add a reference to each block (prefix hit, fork). Cached blocks leave the LRU."""
        ref_cnt, owner, cached = self.ref_cnt, self.owner, self._cached
        for block_id in block_ids:
            if ref_cnt[block_id] == 0:
                assert block_id in cached, f"incref of free block {block_id}"
                del cached[block_id]
            ref_cnt[block_id] += 1
            if owner[block_id] > NO_OWNER:  # shared now: writes must copy first
                owner[block_id] = NO_OWNER
                self.epoch[0] += 1

    def decref(self, block_ids: Iterable[int]) -> None:
        """Drop a reference from each block; a block at 0 becomes free or cached.

        Callers pass a sequence's blocks last-first, so that its tail is evicted
        before its head (a prefix is worthless once its first block is gone).
        """
        ref_cnt, owner = self.ref_cnt, self.owner
        for block_id in block_ids:
            count = ref_cnt[block_id] - 1
            assert count >= 0, f"decref of unreferenced block {block_id}"
            ref_cnt[block_id] = count
            if count == 0:
                owner[block_id] = NO_OWNER
                if self.block_key[block_id] is None:
                    self._free.append(block_id)
                else:
                    self._cached[block_id] = None
                    if self.newly_cached is not None:
                        self.newly_cached[block_id] = None

    def free_private(self, block_ids: np.ndarray) -> None:
        """Drop the only reference of blocks that carry no key (a dead sequence's
        private blocks, an int64 array): they go straight back to the free stack.
        (check_invariants checks they were private.)"""
        self._ref_np[block_ids] = 0
        self._owner_np[block_ids] = NO_OWNER
        self._free.extend(block_ids.tolist())

    def claim(self, block_id: int, owner_id: int) -> bool:
        """Make ``owner_id`` the in-place writer of a block only it references.

        Returns False when the block is shared, published or still being promoted (the
        caller must copy).
        """
        if (
            self.ref_cnt[block_id] == 1
            and self.block_key[block_id] is None
            and self.owner[block_id] != PROMOTING
        ):
            self.owner[block_id] = owner_id
            return True
        return False

    def hold_promoting(self, block_ids: Sequence[int]) -> None:
        """A promotion's own hold on the fresh blocks a lower tier copies into: one more
        reference each, and ``owner`` :data:`PROMOTING` until :meth:`end_promoting`."""
        self.incref(block_ids)
        owner = self.owner
        for block_id in block_ids:
            owner[block_id] = PROMOTING

    def end_promoting(self, block_ids: Sequence[int]) -> None:
        """The copies into ``block_ids`` are over (each arrived or not): they are no longer
        marked as coming in. Their hold is dropped by the caller (:meth:`decref`), once it
        has published the ones that arrived."""
        owner = self.owner
        for block_id in block_ids:
            if owner[block_id] == PROMOTING:
                owner[block_id] = NO_OWNER

    # -- prefix index ------------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes]) -> List[int]:
        """Blocks of the longest published prefix of ``keys`` (references unchanged)."""
        hits = []
        index = self.prefix_index
        for key in keys:
            block_id = index.get(key)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def touch(self, block_ids: Iterable[int]) -> None:
        """Mark cached (unreferenced) blocks as recently used."""
        cached = self._cached
        for block_id in block_ids:
            if block_id in cached:
                cached.move_to_end(block_id)

    def publish(self, block_id: int, key: bytes) -> bool:
        """Give a referenced, fully written block its prefix key; it becomes immutable.

        Returns False when the key already names another block (a concurrent writer
        of the same prefix won) or this block already has a key.
        """
        if key in self.prefix_index or self.block_key[block_id] is not None:
            return False
        assert self.ref_cnt[block_id] > 0, f"publish of unreferenced block {block_id}"
        self.block_key[block_id] = key  # the one place a key is bound
        self.key_gen[block_id] += 1
        self.prefix_index[key] = block_id
        if self.owner[block_id] != NO_OWNER:  # published blocks are immutable
            self.owner[block_id] = NO_OWNER
            self.epoch[0] += 1
        return True

    def publish_many(self, block_ids: Iterable[int], keys: Iterable[bytes]) -> int:
        """:meth:`publish` each block under its key (a promotion's blocks; no Python loop
        around the calls); returns how many were published."""
        return sum(map(self.publish, block_ids, keys))

    # -- keys and bytes (see the module doc) ----------------------------------------------

    def identity(self, block_id: int) -> tuple:
        """``(key, generation)`` of a block now: what a copy of its bytes records when it
        is queued (key None: the block holds no key)."""
        return self.block_key[block_id], self.key_gen[block_id]

    def still_holds(self, block_id: int, key: Optional[bytes], gen: int) -> bool:
        """True when the block still holds ``key`` under the binding of generation
        ``gen`` (from :meth:`identity`): a copy of its bytes read before now is good.
        Called after the copy's last read; reads two values and changes nothing, so a
        worker thread of the coordinator may call it too."""
        return self.key_gen[block_id] == gen and self.block_key[block_id] == key

    def discard_copies(self, num: int = 1) -> None:
        """Count copies dropped because their block changed (loop thread only)."""
        if num > 0:
            self.num_copies_discarded += num

    # -- checking ----------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Assert that every block is in exactly one state (for tests and stress)."""
        free = set(self._free)
        assert len(free) == len(self._free), "a block is twice on the free stack"
        cached = set(self._cached)
        assert not free & cached, "a block is both free and cached"
        for block_id in range(self.num_blocks):
            count = self.ref_cnt[block_id]
            assert count >= 0, f"block {block_id} has a negative ref count"
            key = self.block_key[block_id]
            if count == 0:
                assert (block_id in free) != (block_id in cached), f"block {block_id} lost"
                assert (key is None) == (block_id in free), f"block {block_id} key/state"
                assert self.owner[block_id] == NO_OWNER
            else:
                assert block_id not in free and block_id not in cached
            if key is not None:
                assert self.prefix_index.get(key) == block_id
        assert len(self.prefix_index) == sum(k is not None for k in self.block_key)
