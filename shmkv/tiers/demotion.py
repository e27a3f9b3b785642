"""How every block that becomes cached in the pool reaches a tier (:class:`Demotion`).

Owns what the tiers hold: the only code that adds, readies and removes the entries of
the host and disk indexes, hands out host slots, staging slots and room on disk (LRU),
deletes block files, and pins and unpins entries (for the promotion part too). And its
own state: the pool blocks whose copy down a tier is under way or waiting (the backlog),
the host keys still to spill to disk, the keys an allocation plans to promote (not
dropped for room), the disk writes in flight, and the evictions rescued or lost.

Each loop turn :class:`~shmkv.tiers.tier_set.TierSet` starts the turn
(:meth:`Demotion.new_turn`), hands back the finished copies (:meth:`Demotion.complete`),
has the cached blocks placed (:meth:`Demotion.place_cached`) and sends the copies that
were queued (:meth:`Demotion.take_jobs`); the pool calls :meth:`Demotion.on_evict`. The
promotion part (``shmkv.tiers.promotions``) pins what it reads and reports damaged files
through :meth:`Demotion.pin_sources`, :meth:`Demotion.unpin` and
:meth:`Demotion.remove_damaged`; the disk scan (``shmkv.tiers.scan``) indexes what it
finds through :meth:`Demotion.add_found`, :meth:`Demotion.order_found` and
:meth:`Demotion.trim_disk`. Runs no copy and knows not where copies run (threads or the
I/O process: ``TierSet``). Imports ``shmkv.memory.block_io`` and ``shmkv.tiers.knobs`` /
``entry`` / ``host_store`` / ``disk_store``.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Callable, Dict, List, Optional, Set

from shmkv.memory.block_io import DEMOTE, DISK, OP_H2P, Copy, Job, pool_to_flat
from shmkv.tiers import knobs
from shmkv.tiers.disk_store import DiskStore
from shmkv.tiers.entry import Entry
from shmkv.tiers.host_store import HostStore

log = logging.getLogger(__name__)


class Demotion:
    """The demotion part of a :class:`~shmkv.tiers.tier_set.TierSet` (see the module doc):
    placement (a host slot, a disk write, or the backlog while neither has room, a
    prefix's first blocks first), the spills from host to disk, the rescue of a block
    evicted before its copy was done, and the completion of those copies (published in
    a tier only if the block still held the key, ``_still_holds``).

    Its class is over 600 lines because placing, making room, rescuing and completing
    are one set of rules over the same indexes (a slot taken in one is given back in
    another); cut apart, each piece would need the others' state.

    Args:
        pool: the :class:`~shmkv.coordinator.allocator.BlockPool` (its hooks: :meth:`hook`).
        host, disk: the tiers' stores (None for a tier not configured).
        staging: the disk tier's staging slots (None without a disk tier in use).
        pool_u8, pool_np: byte views of every rank's pool by block (``pool_np`` None
            under a CUDA pool), for the copies of a rescue.
        gens: the cancel generations the I/O process reads (None with copies in
            threads): made by ``TierSet``, moved only here.
    """

    def __init__(
        self,
        pool,
        host: Optional[HostStore],
        disk: Optional[DiskStore],
        staging: Optional[HostStore],
        pool_u8,
        pool_np,
        gens,
    ):
        self.pool = pool
        self.host = host
        self.disk = disk
        self._staging = staging
        self._pool_u8, self._pool_np, self._gens = pool_u8, pool_np, gens
        # Pool block -> the demotion copy reading it, or None while it waits in the backlog
        # (the pool evicts these blocks last: ``BlockPool.copying``).
        self._reading: Dict[int, Optional[Copy]] = {}
        # Cached pool blocks no tier took yet (its slots or writes in flight were all
        # busy), a prefix's first blocks first: placed as room frees up (place_cached).
        self._backlog: "OrderedDict[int, bytes]" = OrderedDict()
        self._spill: "OrderedDict[bytes, None]" = OrderedDict()  # host keys to write to disk
        # keys an allocation of this turn plans to promote (keep_planned): not dropped to
        # make room before its promotion pins them; forgotten at the next turn
        self._planned: Set[bytes] = set()
        self._new_demotes: List[Copy] = []
        self._new_disk: List[Copy] = []
        # This turn's placing (new_turn): blocks placed, whether it stopped for a client.
        self._num_placed = 0
        self._deferred = False
        self._waiting: Optional[Callable[[], bool]] = None
        self._disk_in_flight = 0  # disk writes handed to the writer, not back yet
        self.num_lost_evictions = 0
        self.num_rescued_evictions = 0

    # -- what TierSet calls ------------------------------------------------------------

    def hook(self) -> None:
        """Have the pool collect the blocks that become cached, call :meth:`on_evict`,
        and evict the blocks being copied down last (``shmkv.coordinator.allocator``'s hooks)."""
        pool = self.pool
        pool.newly_cached = {}
        pool.on_evict = self.on_evict
        pool.copying = self._reading

    def close(self) -> None:
        """Take the pool's hooks back (where they are still this part's) and drop the
        pool's views. Idempotent."""
        pool = self.pool
        if getattr(pool, "on_evict", None) == self.on_evict:
            pool.on_evict = None
            pool.newly_cached = None
        if getattr(pool, "copying", None) is self._reading:
            pool.copying = None
        self._pool_u8 = self._pool_np = self._gens = None

    def new_turn(self, waiting: Optional[Callable[[], bool]]) -> None:
        """A loop turn begins (``TierSet.tick``): this turn's promotions have pinned
        what they read, so the planned keys are forgotten; ``waiting`` tells whether a
        client waits (see :meth:`_yield_to_clients`)."""
        self._planned.clear()
        self._deferred, self._num_placed, self._waiting = False, 0, waiting

    def keep_planned(self, keys) -> None:
        """``keys`` are an allocation's plan: not dropped to make room until the next
        turn, by which its promotion has pinned them (``TierSet.keep_planned``)."""
        self._planned.update(keys)

    @property
    def deferred(self) -> bool:
        """This turn's placing stopped for a client: the next turn should come at once."""
        return self._deferred

    @property
    def num_waiting(self) -> int:
        """Blocks waiting for a tier: those the pool cached since the last turn (not placed
        yet: a request served before the turn sees them), copies not sent yet, spills,
        and the backlog."""
        return (
            len(self.pool.newly_cached or ())
            + len(self._spill)
            + len(self._new_demotes)
            + len(self._new_disk)
            + len(self._backlog)
        )

    def place_cached(self) -> None:
        """Place what waits for a tier: the backlog first, then the blocks the pool
        cached since the last turn, then queue the host tier's spills to disk."""
        if self._backlog:
            self._drain_backlog()
        pool = self.pool
        newly = pool.newly_cached
        if newly:
            pool.newly_cached = {}
            block_key, reading, backlog = pool.block_key, self._reading, self._backlog
            # A sequence's blocks are released (and cached) last-first: reversed, a
            # prefix's first blocks are placed first, and wait least when room runs out.
            touch_held = self._touch_held
            for block in reversed(newly):
                key = block_key[block]
                if key is None or block in reading or touch_held(key):
                    continue  # (held: no copy, and no look at the sockets for it)
                if backlog or self._yield_to_clients() or not self._place(block, key):
                    backlog[block] = key
                    reading[block] = None
        if self._spill:
            self._schedule_spills()

    def take_jobs(self) -> list:
        """The copies queued since the last call, as ``(queue, Job)`` pairs for the
        workers: demotions in chunks of ``DEMOTION_CHUNK``, then one job of disk writes
        and deletions."""
        if not (self._new_demotes or self._new_disk):
            return []
        new, chunk = self._new_demotes, knobs.DEMOTION_CHUNK
        jobs = [(DEMOTE, Job(new[i : i + chunk])) for i in range(0, len(new), chunk)]
        if self._new_disk:
            jobs.append((DISK, Job(self._new_disk)))
        self._new_demotes, self._new_disk = [], []
        return jobs

    # -- what the promotion part and the disk scan call ----------------------------------

    def pin_sources(self, ops: List[int], keys: List[bytes], srcs: list) -> None:
        """A promotion reads ``srcs`` (the entries of ``keys``, None where no tier had
        the key; ``ops``: whether from the host tier): each is pinned until its copy is
        done (:meth:`unpin`) and becomes its tier's most recently used."""
        host = None if self.host is None else self.host.index
        disk = None if self.disk is None else self.disk.index
        for op, key, entry in zip(ops, keys, srcs):
            if entry is not None:
                entry.pins += 1
                index = host if op == OP_H2P else disk
                assert index is not None  # (the entry is the tier's)
                index.move_to_end(key)

    def unpin_sources(self, srcs: list, keys: List[bytes]) -> None:
        """:meth:`unpin` each of ``srcs`` (none None: every copy read one)."""
        for entry, key in zip(srcs, keys):
            entry.pins -= 1
            if entry.doomed and not entry.pins:
                self._unpin_doomed(entry, key)

    def remove_damaged(self, key: bytes, entry: Entry) -> None:
        """The block file of disk entry ``entry`` is damaged (a promotion or the scan
        read it): it is served no more, and removed at once or, while copies read it, at
        its last :meth:`unpin`. Counted in ``removed_damaged``."""
        disk = self.disk
        assert disk is not None  # (only a block file is found damaged)
        disk.counters["removed_damaged"] += 1
        if entry.pins:
            self._unready(disk, entry)
            entry.doomed = True
        else:
            self._disk_remove(key)

    def add_found(self, keys) -> None:
        """Index block files the disk scan found: ready, and older than every block this
        run wrote (a key indexed already keeps its entry)."""
        disk = self.disk
        assert disk is not None  # (only the disk tier is scanned)
        index = disk.index
        for key in keys:
            if key not in index:
                index[key] = Entry(ready=True, from_scan=True)
                index.move_to_end(key, last=False)  # older than this run's blocks
                disk.num_ready += 1
                disk.bytes += disk.file_nbytes

    def order_found(self, keys) -> None:
        """Put the found entries in LRU order: ``keys`` newest first, each moved to the
        front in turn (entries this run wrote stay newer)."""
        disk = self.disk
        assert disk is not None  # (only the disk tier is scanned)
        index = disk.index
        for key in keys:
            entry = index.get(key)
            if entry is not None and entry.from_scan:
                index.move_to_end(key, last=False)

    def trim_disk(self) -> None:
        """Delete the disk's LRU blocks until it fits its capacity (a smaller one than
        the last run's; called once the scan has put the blocks in LRU order)."""
        disk = self.disk
        assert disk is not None  # (only the disk tier is scanned)
        while disk.bytes > disk.capacity_bytes:
            victim = next(
                (key for key, entry in disk.index.items() if entry.ready and not entry.pins), None
            )
            if victim is None:
                break
            self._disk_remove(victim)
            disk.counters["dropped"] += 1

    # -- placing, making room, rescuing ------------------------------------------------

    def on_evict(self, blocks: List[int], keys: List[bytes]) -> None:
        """The pool evicts cached blocks (called once inside ``BlockPool.allocate``, before
        anyone can be told to write them: their bytes are still their keys'). A block
        whose copy down a tier was not done, or not even placed (cached since the last
        turn), is rescued: copied now, on the loop (see :meth:`_rescue`); one no tier
        holds or can take is counted lost."""
        reading, host_index = self._reading, None if self.host is None else self.host.index
        pending = self.pool.newly_cached or ()  # cached this turn, not placed yet
        for block, key in zip(blocks, keys):
            unsafe, copy = block in pending, None
            if reading and block in reading:
                copy = reading.pop(block)
                unsafe = True
                if copy is not None:  # its demotion is still copying: cancel it
                    copy.cancelled = True
                    if self._gens is not None:  # and tell the I/O process (before anyone
                        self._gens[block] += 1  # writes)
                else:  # never copied: it leaves the backlog
                    self._backlog.pop(block, None)
            if host_index is not None:  # the common case, first: the host tier has it
                entry = host_index.get(key)
                if entry is not None and entry.ready:
                    continue
            if self._held(key):
                continue
            if unsafe and self._rescue(block, key):
                self.num_rescued_evictions += 1
            else:  # no tier has it, nor can take it now: lost
                self.num_lost_evictions += 1
                if copy is not None:
                    self._forget_unfinished(copy)

    def _spill_if_host_only(self, key: bytes) -> None:
        """Queue ``key`` to spill to disk if the host tier has it ready and the disk (in
        use) has no entry for it: the disk holds every key the host tier does
        (:meth:`_host_slot` drops only entries on disk). Called where a key becomes
        ready in the host tier, and where a cancelled demotion to disk drops its entry
        (its block may have been rescued into the host tier meanwhile)."""
        host, disk = self.host, self.disk
        entry = None if host is None else host.index.get(key)
        if (
            entry is not None
            and entry.ready
            and disk is not None
            and disk.disabled is None
            and key not in disk.index
        ):
            self._spill[key] = None

    def _forget_unfinished(self, copy: Copy) -> None:
        """Drop the tier entry a cancelled demotion was filling, now that its block is
        lost: the key is in no tier, and the next block published under it must be
        placed again (an entry left until the copy completes reads as "the tier has it"
        to :meth:`_touch_held`, and that block would never go down). The completion
        then finds the entry gone and only gives back what the copy reserved (its host
        slot; its staging slot and its place among the disk writes in flight)."""
        if copy.op == "p2h":
            host = self.host
            assert host is not None  # (a copy into the host tier)
            if host.index.get(copy.key) is copy.entry:
                del host.index[copy.key]
        elif copy.op in ("p2s", "p2d"):
            disk = self.disk
            assert disk is not None  # (a copy towards the disk tier)
            if disk.index.get(copy.key) is copy.entry:
                del disk.index[copy.key]
                disk.bytes -= disk.file_nbytes

    def _rescue(self, block: int, key: bytes) -> bool:
        """Copy an evicted block whose copy down a tier is not done, on the loop, now
        (its bytes are the key's until the allocation evicting it is answered): into a
        host tier slot (ready at once), else a staging slot written to disk from there.
        False when neither has room. One memcpy of a block, only when the tiers are behind
        the pool's churn and nothing already safe was left to evict
        (``BlockPool.copying``)."""
        host, disk, staging = self.host, self.disk, self._staging
        if host is not None:
            slot = self._host_slot()
            if slot is not None:
                assert host.data is not None and host.np is not None  # (open)
                pool_to_flat(self._pool_np, self._pool_u8, block, host.data[slot], host.np[slot])
                # (an unfinished copy's entry is replaced: its completion frees its slot)
                host.index[key] = Entry(slot, ready=True)
                host.num_ready += 1
                host.counters["demotions"] += 1
                self._spill_if_host_only(key)
                return True
        if staging is None or not staging.free:
            return False
        assert disk is not None  # (staging slots exist only under a disk tier)
        if not disk.usable(time.monotonic()):
            return False
        # (a key in the index already: an unfinished copy's, whose room it takes over)
        if key not in disk.index and not self._disk_reserve():
            return False
        slot = staging.free.pop()
        assert staging.data is not None and staging.np is not None  # (open)
        pool_to_flat(self._pool_np, self._pool_u8, block, staging.data[slot], staging.np[slot])
        entry = Entry()
        entry.staged = True
        disk.index[key] = entry
        self._new_disk.append(Copy("s2d", key, slot=slot, entry=entry))
        self._disk_in_flight += 1
        return True

    def _held(self, key: bytes) -> bool:
        """A tier has the key's bytes (ready, or in a staging slot on their way to disk)."""
        for store in (self.host, self.disk):
            if store is not None:
                entry = store.index.get(key)
                if entry is not None and (entry.ready or entry.staged):
                    return True
        return False

    def _yield_to_clients(self) -> bool:
        """True when this turn's placing should stop here, every ``PLACE_CHUNK`` blocks,
        because a client waits (:meth:`new_turn`'s ``waiting``): what is left waits in
        the backlog for the next turn, which the loop takes without sleeping
        (:attr:`deferred`, ``TierSet.max_wait``)."""
        self._num_placed += 1
        if self._waiting is None or self._num_placed % knobs.PLACE_CHUNK or not self._waiting():
            return False
        self._deferred = True
        return True

    def _drain_backlog(self) -> None:
        """Place the backlog's blocks, oldest first, until one must wait again (or a
        client waits: :meth:`_yield_to_clients`)."""
        backlog, reading, block_key = self._backlog, self._reading, self.pool.block_key
        while backlog and not self._deferred:
            block, key = next(iter(backlog.items()))
            if block_key[block] == key and not self._place(block, key, queued=True):
                return  # no room yet: it stays first
            self._yield_to_clients()
            del backlog[block]
            if reading.get(block, False) is None:  # (a copy placed now replaced the mark)
                del reading[block]

    def _touch_held(self, key: bytes, queued: bool = False) -> bool:
        """Whether the first tier a cached block goes to holds its key already (an entry,
        ready or being copied): then nothing is copied, the entry is marked recently used
        (unless ``queued``: see :meth:`_place`), and a host entry the disk lacks is spilled
        (an earlier write failed). A block promoted and released again ends here: a
        dictionary look-up, no placing."""
        host, disk = self.host, self.disk
        if host is not None:
            entry = host.index.get(key)
            if entry is None:
                return False
            if not queued:
                host.index.move_to_end(key)
                if disk is not None and disk.disabled is None and key in disk.index:
                    disk.index.move_to_end(key)
            self._spill_if_host_only(key)  # (ready, not on disk: an earlier write failed)
            return True
        if disk is None or disk.disabled is not None or key not in disk.index:
            return False
        if not queued:
            disk.index.move_to_end(key)
        return True

    def _place(self, block: int, key: bytes, queued: bool = False) -> bool:
        """A published block became cached: copy it to the first tier that lacks it.

        Returns False when it must wait for room (every host slot busy and no disk
        write to spare): the caller keeps it in the backlog. True otherwise: a copy was
        scheduled, a tier has it already, or no tier can take it (the disk is full,
        failing or not used, and there is no host tier); the loop does not retry those.
        ``queued``: ``move_to_end`` of an entry it finds is skipped (the block waited;
        it was used when it became cached, not now)."""
        if self._touch_held(key, queued):
            return True
        host, disk = self.host, self.disk
        if host is not None:
            slot = self._host_slot()
            if slot is not None:
                entry = Entry(slot)
                entry.src_gen = self.pool.key_gen[block]  # checked as the copy completes
                host.index[key] = entry
                copy = Copy(
                    "p2h",
                    key,
                    block=block,
                    slot=slot,
                    entry=entry,
                    gen=0 if self._gens is None else int(self._gens[block]),
                )
                self._reading[block] = copy
                self._new_demotes.append(copy)
                return True
        if disk is None or disk.disabled is not None:
            return host is None  # the host tier's slots are all busy: wait for one
        if key in disk.index:  # (the host tier lacks it and is full: the disk has it)
            if not queued:
                disk.index.move_to_end(key)
            return True
        if not disk.usable(time.monotonic()) or disk.file_nbytes > disk.capacity_bytes:
            return True  # full: demotion to disk pauses (counted in "full")
        if self._disk_in_flight >= knobs.MAX_DISK_WRITES_IN_FLIGHT:
            return False  # every write in flight: wait
        staging = self._staging
        assert staging is not None  # (made with a disk tier that is used)
        staged = not knobs.DIRECT_DISK_DEMOTION
        if staged and len(staging.free) <= knobs.STAGING_RESCUE:
            return False  # every staging slot busy (but those kept for rescues): wait
        if not self._disk_reserve():
            return False  # every disk entry busy: wait
        entry = Entry()
        entry.src_gen = self.pool.key_gen[block]  # checked as the copy completes
        disk.index[key] = entry
        gen = 0 if self._gens is None else int(self._gens[block])
        if staged:  # through a staging slot, checked by the loop (block_io: memory ordering)
            copy = Copy("p2s", key, block=block, slot=staging.free.pop(), entry=entry, gen=gen)
            self._new_demotes.append(copy)
        else:
            copy = Copy("p2d", key, block=block, entry=entry, gen=gen)
            self._new_disk.append(copy)
        self._reading[block] = copy
        self._disk_in_flight += 1
        return True

    def _host_slot(self) -> Optional[int]:
        """A free host slot, making room by the LRU when needed; None when all are busy.

        With a disk tier that takes writes, only an entry already on disk makes room (the
        oldest of the first ``HOST_SCAN`` entries; an entry whose disk write is still to
        come is busy): the host tier drops nothing the disk does not hold."""
        host, disk = self.host, self.disk
        assert host is not None  # (only the host tier has slots)
        if host.free:
            return host.free.pop()
        on_disk = None
        if disk is not None and disk.usable(time.monotonic()):
            on_disk = disk.index
        spill = self._spill
        # oldest first; busy entries are skipped
        planned = self._planned
        for scanned, (key, entry) in enumerate(host.index.items(), start=1):
            if entry.ready and not entry.pins and key not in planned:
                if on_disk is None:
                    break
                target = on_disk.get(key)
                if target is None:
                    if key not in spill:  # its disk write failed: nothing to wait for
                        break
                elif target.ready:
                    break
            if scanned >= knobs.HOST_SCAN:
                return None
        else:
            return None
        del host.index[key]
        host.num_ready -= 1
        self._spill.pop(key, None)
        disk = self.disk
        kept = disk is not None and key in disk.index and disk.index[key].ready
        if not kept:
            host.counters["dropped"] += 1
        return entry.slot

    def _disk_reserve(self) -> bool:
        """Make room for one file by deleting the disk's LRU blocks; False if it cannot."""
        disk = self.disk
        assert disk is not None  # (called only with a disk tier)
        planned = self._planned
        while disk.bytes + disk.file_nbytes > disk.capacity_bytes:
            victim = next(
                (
                    key
                    for key, entry in disk.index.items()
                    if entry.ready and not entry.pins and key not in planned
                ),
                None,
            )
            if victim is None:
                return False
            self._disk_remove(victim)
            disk.counters["dropped"] += 1
        disk.bytes += disk.file_nbytes
        return True

    def _disk_remove(self, key: bytes) -> None:
        """Forget a disk block and delete its file (after any write queued before)."""
        disk = self.disk
        assert disk is not None  # (called only with a disk tier)
        self._unready(disk, disk.index.pop(key))
        disk.bytes -= disk.file_nbytes
        self._new_disk.append(Copy("del", key))

    @staticmethod
    def _unready(store, entry: Entry) -> None:
        if entry.ready:
            entry.ready = False
            store.num_ready -= 1

    def _schedule_spills(self) -> None:
        disk, host = self.disk, self.host
        # (keys are spilled only from a host tier to a disk tier)
        assert disk is not None and host is not None
        if not disk.usable(time.monotonic()):
            return
        while self._spill and self._disk_in_flight < knobs.MAX_DISK_WRITES_IN_FLIGHT:
            key, _ = self._spill.popitem(last=False)
            entry = host.index.get(key)
            if entry is None or not entry.ready or key in disk.index:
                continue
            if not self._disk_reserve():
                self._spill[key] = None
                self._spill.move_to_end(key, last=False)
                return
            entry.pins += 1
            target = Entry()
            disk.index[key] = target
            self._new_disk.append(Copy("h2d", key, slot=entry.slot, entry=target, src=entry))
            self._disk_in_flight += 1

    def unpin(self, entry: Entry, key: bytes) -> None:
        """A copy that read ``entry`` (of ``key``) is done: the last one out removes a
        damaged entry (:meth:`remove_damaged`)."""
        entry.pins -= 1
        if entry.doomed and not entry.pins:
            self._unpin_doomed(entry, key)

    def _still_holds(self, copy) -> bool:
        """A demotion's block still holds the key it was copied under (the allocator's
        rule: ``BlockPool.still_holds``); a copy whose block changed is counted there and
        discarded by the caller. Checked as its completion is taken, after its last
        read, before it is published in a tier's index."""
        if self.pool.still_holds(copy.block, copy.key, copy.entry.src_gen):
            return True
        self.pool.discard_copies(1)
        return False

    def _unpin_doomed(self, entry: Entry, key: bytes) -> None:
        """The last copy reading a damaged entry is done: remove it (only disk entries
        are doomed)."""
        if self.disk is not None and self.disk.index.get(key) is entry:
            self._disk_remove(key)

    def complete(self, copies: list) -> None:
        """A job of demotion copies (or deletions) is back: publish each copy that
        succeeded while its block still held the key (``_still_holds``) in its tier's
        index, and release what the others reserved (their slot, room on disk, a pin).
        A full disk pauses demotion to disk (``DISK_FULL_BACKOFF_S``)."""
        host, disk = self.host, self.disk
        entry: Entry  # the tier entry a demotion's copy fills
        for copy in copies:
            op = copy.op
            block = copy.block
            if op == "p2h":
                assert host is not None  # (a copy into the host tier)
                if self._reading.get(block) is copy:
                    del self._reading[block]
                entry = copy.entry
                held = self._still_holds(copy)
                if copy.ok and held and not copy.cancelled and host.index.get(copy.key) is entry:
                    entry.ready = True
                    host.num_ready += 1
                    host.counters["demotions"] += 1
                    self._spill_if_host_only(copy.key)
                else:
                    if copy.error is not None:
                        host.counters["errors"] += 1
                    if host.index.get(copy.key) is entry:
                        del host.index[copy.key]
                    host.free.append(entry.slot)
            elif op == "p2s":  # a block on its way to disk: in its staging slot now
                assert disk is not None and self._staging is not None  # (its copies)
                if self._reading.get(block) is copy:
                    del self._reading[block]
                entry = copy.entry
                held = self._still_holds(copy)
                if copy.ok and held and not copy.cancelled and disk.index.get(copy.key) is entry:
                    entry.staged = True  # out of the pool: safe from eviction
                    self._new_disk.append(Copy("s2d", copy.key, slot=copy.slot, entry=entry))
                    continue  # (still a write in flight)
                self._disk_in_flight -= 1
                self._staging.free.append(copy.slot)
                if copy.error is not None:
                    disk.counters["errors"] += 1
                if disk.index.get(copy.key) is entry:
                    del disk.index[copy.key]
                    disk.bytes -= disk.file_nbytes
                if copy.cancelled:
                    self._spill_if_host_only(copy.key)
            elif op in ("h2d", "p2d", "s2d"):
                assert disk is not None  # (a copy into the disk tier)
                self._disk_in_flight -= 1
                if op == "h2d":
                    self.unpin(copy.src, copy.key)
                elif op == "s2d":
                    assert self._staging is not None  # (its slot)
                    self._staging.free.append(copy.slot)
                elif self._reading.get(block) is copy:
                    del self._reading[block]
                entry = copy.entry
                mine = disk.index.get(copy.key) is entry
                if op == "p2d" and not self._still_holds(copy):
                    # renamed in (its last cancel check passed before the eviction): remove
                    if copy.ok and (mine or copy.key not in disk.index):
                        self._new_disk.append(Copy("del", copy.key))
                    copy.ok = False
                if copy.ok and not copy.cancelled:
                    if mine:
                        entry.ready = True
                        disk.num_ready += 1
                        disk.counters["demotions"] += 1
                    elif copy.key not in disk.index:  # forgotten while written: delete it
                        self._new_disk.append(Copy("del", copy.key))
                    continue
                if copy.enospc:
                    disk.counters["full"] += 1
                    now = time.monotonic()
                    if now >= disk.full_until:  # once per pause, not once per block
                        log.warning(
                            "disk tier %s: filesystem full; demotion to disk pauses "
                            "for %.0f s (nothing in the pool is lost)",
                            disk.path,
                            knobs.DISK_FULL_BACKOFF_S,
                        )
                    disk.full_until = now + knobs.DISK_FULL_BACKOFF_S
                    # (an h2d copy is a spill from the host tier)
                    if op == "h2d" and host is not None and host.index.get(copy.key) is copy.src:
                        self._spill[copy.key] = None  # still in host memory: try again later
                elif copy.error is not None:
                    disk.counters["errors"] += 1
                    log.warning("disk tier %s: writing a block failed: %s", disk.path, copy.error)
                if mine:
                    del disk.index[copy.key]
                    disk.bytes -= disk.file_nbytes
                if op == "p2d" and copy.cancelled:
                    self._spill_if_host_only(copy.key)
            elif op == "del" and copy.error is not None:
                assert disk is not None  # (a file of the disk tier)
                disk.counters["errors"] += 1
