"""Tiers under the pool: host shared memory and a local disk directory.

Owns the lower tiers of the cache (:class:`HostTier`, :class:`DiskTier`), their
indexes, and which copies run when (:class:`TierSet`). The copies themselves, the
on-disk block format and the tier I/O process are ``shmkv.memory.block_io``. Does not decide
which pool block is free, cached or referenced (``shmkv.coordinator.allocator``), which sequence
a block belongs to (``shmkv.coordinator.sequences``), nor answer requests
(``shmkv.coordinator.server``:
its loop calls :meth:`TierSet.tick` and answers the promotions that come back
finished). The Redis store under these tiers is ``shmkv.tiers.redis_store``.

One file a part, each opening with what it owns::

    specs.py       HostTier, DiskTier, parse_size, check_specs, check_trusted_dir:
                   a coordinator's tiers= list, checked before anything opens
    knobs.py       the tuning numbers (in flight, chunks, where copies run)
    entry.py       Entry: one key in one tier's index
    host_store.py  HostStore: the host tier (or staging slots) bound to the pool
    disk_store.py  DiskStore: the disk tier's directory, lock, namespace and index
    io_process.py  IoProcess: the tier I/O process, from the loop's side
    demotion.py    Demotion: what each tier holds, blocks down the tiers, rescues
    promotions.py  Promotions, Promotion: lookups, and blocks back into the pool
    scan.py        DiskScan: the disk index rebuilt from its directory at start
    tier_set.py    TierSet: what the coordinator drives; opens the tiers, runs the
                   copies (threads or the I/O process), holds the three parts above
    redis_format.py  RedisTier, split_specs, Codec: the shared store's configuration,
                   key names and value format (pure)
    redis_store.py RemoteTierSet: a TierSet with the store under it (its worker
                   threads, health, write-behind and lookups)

The parts are objects that TierSet makes and holds, not a chain of subclasses: each is
the only writer of its own state, and is handed the stores and the parts below it when
made. The indexes have one writer, the demotion part; the promotion part and the scan
change them (pins, a damaged file, the files found at start) by calling it. (A store's
``counters`` are statistics: each part counts its own events there.)

Imports: each other (never this ``__init__``, which only re-exports), and of shmkv only
``errors``, ``protocol``, ``memory`` (the pool, ``shm``, and ``block_io``: the bytes the
tiers move, which the client's copies use too and the I/O process runs as a script) and
``kernels.native``. The Redis store takes one record, ``PendingPromotion``, from the
coordinator's sequence table; no other part imports the coordinator, the sequence table
or the client: the table and its pool are handed in, and the coordinator calls in.

Knobs: ``shmkv.tiers.IO_PROCESS`` and the other names of ``knobs.NAMES`` are set here,
on the package, which sets them in ``shmkv.tiers.knobs`` too: the parts read them there
each time they use one, so setting ``shmkv.tiers.STAGING_BLOCKS`` (as tests do) changes
what the next coordinator uses.

Every index (which key a tier holds, where, LRU order, pins, byte counts) is read
and written by the coordinator's loop thread only. Copies run off the loop -- under a
CPU pool in the tier I/O process, a low-priority child of the coordinator; under a
CUDA pool in worker threads (``shmkv.memory.block_io`` says why) -- and report back; the loop
never waits for them.

* Demotion is write-behind. A published block that becomes cached in the pool is
  copied to the host tier (without one, or with every host slot busy, to disk) while
  it stays valid in the pool: published blocks are immutable, so the copy races
  nothing. A host copy is then written to disk behind it, so the disk holds a superset
  of the host tier, which is what survives a restart. Every block that becomes cached
  reaches a tier unless the tier is full or failing: what one turn caches past the
  free host slots or the disk writes in flight (``MAX_DISK_WRITES_IN_FLIGHT``) waits in
  a backlog, a prefix's first blocks first (a sequence's blocks are cached last-first,
  and are placed in reverse), and is placed as copies finish. The pool evicts blocks
  already safe in a tier first (``BlockPool.copying``: the blocks copying or waiting).
  When it must evict one whose copy is not done, the copy is cancelled and the loop
  copies the block at once, a memcpy (it is still the key's until the allocation is
  answered), into a host slot, or a staging slot written to disk from there
  (``rescued_evictions``); only when neither has room is it counted in
  ``lost_evictions``. Each tier is LRU: the host tier's oldest blocks make room (with a
  disk tier taking writes, only those already on disk; otherwise counted ``dropped``),
  the disk's oldest are deleted (``dropped``).
* Memory ordering: a copy's own cancel check is lock-free and sound only on x86; the
  loop keeps a copy out of the pool only if its block still held the key when the
  completion came back, and off x86 writes no block file straight from the pool
  (``DIRECT_DISK_DEMOTION``; ``shmkv.memory.block_io`` says why).
* Promotion: an allocation whose prompt continues, past the pool's longest hit, in a
  tier gets fresh pool blocks for those keys, all or nothing with the rest of the
  request (``shmkv.coordinator.sequences``). Workers copy the bytes in; the loop then publishes
  the blocks under their keys and the coordinator answers the request. A block that
  cannot be read back (a damaged file) ends the hit at the blocks before it.
* Promotion by the client (a CPU pool): a client that asks (``allocate_many``'s
  ``copy``) gets its promotion's copies in the answer and runs them itself
  (``shmkv.memory.block_io.ClientCopies``: the host tier mapped read-only, the block files read
  and checked as the I/O process does), then reports one status a block (``promoted``);
  the loop finishes the promotion as it would a worker's. The copies then cost the
  client that needs them, not the other clients: measured on 2 cores, ping p99 while
  another client promoted at full speed went from 2.1-2.4x idle to 1.6-2.0x, the
  no-tier control's level (``docs/benchmarks.md``). The sources stay pinned and the
  blocks held until the report, or until the client's connection drops (every copy
  then counts as failed).
* The bytes: under a CPU pool, whoever copies (a client, the I/O process, the
  coordinator's threads) moves a block between the pool and host memory with the
  native row copy, whose stores go past the caches (``shmkv.kernels.native.copier``,
  ``shmkv.memory.block_io.RowCopy``), else with ``np.copyto``; the I/O process loads the
  library the coordinator loaded, by its path in the package (``TierSet._row_copy``).
* Cancellation without a lock: a worker copies a pool block first and reads the
  copy's cancel state after (the copy's ``cancelled`` flag in threads; the block's
  generation in shared memory for the I/O process, see ``shmkv.memory.block_io``). The loop
  sets it when it evicts the block, before it can answer anyone who would then write
  that block, so a copy that saw no cancel was taken from unchanged bytes.

Trust: a disk tier directory is trusted as far as its owner is (see :class:`DiskTier`):
it must be owned by the coordinator's user and not writable by group or others, and
every file in it is opened without following links and used only if regular.

Disk layout (one namespace per directory)::

    DIR/lock        flock()ed by the coordinator that uses DIR (its pid inside)
    DIR/namespace   JSON: format version, block layout fingerprint, salt digest, block
                    bytes (not the pool's size: a resized pool uses the same blocks)
    DIR/blocks/<32 hex digits of the prefix key>.kv          one complete block
    DIR/blocks/<32 hex>.kv.tmp-<session>                     a block being written

A block file is a 100-byte little-endian header -- magic ``SHMKVBLK``, format
version u16, header size u16, flags u32, namespace digest (16 bytes), prefix key
(16 bytes), num_layers, block_size, num_kv_heads, head_dim, tp_size (u32 each),
dtype name (12 bytes, NUL padded), payload bytes u64, payload xxh3-64 u64, and the
crc32 of the 96 bytes before it -- followed by the payload: the block's bytes of
every rank's pool, rank after rank, each ``[num_layers, 2, block_size, heads,
head_dim]`` as in the pool. A file is written under a temporary name and renamed
into place, so a name ending in ``.kv`` is complete unless the machine itself
crashed before the data reached the disk; then its checksum fails when it is read,
and it is removed and counted. ``DiskTier(fsync=True)`` fsyncs every file before
the rename (slower; only a machine crash needs it, never a killed process).
"""

from __future__ import annotations

import sys
import types
from typing import Any

from shmkv.memory.block_io import HEADER_SIZE
from shmkv.tiers import knobs

# The knobs, as this package's attributes: setting one here sets it in knobs too (see
# _Package), where the parts read it.
from shmkv.tiers.knobs import (
    DEMOTION_CHUNK as DEMOTION_CHUNK,
    DIRECT_DISK_DEMOTION as DIRECT_DISK_DEMOTION,
    DISK_FULL_BACKOFF_S as DISK_FULL_BACKOFF_S,
    GIL_SWITCH_INTERVAL_S as GIL_SWITCH_INTERVAL_S,
    HOST_SCAN as HOST_SCAN,
    IO_PROCESS as IO_PROCESS,
    IO_PROCESS_CHECK_S as IO_PROCESS_CHECK_S,
    IO_PROCESS_EXIT_S as IO_PROCESS_EXIT_S,
    IO_PROCESS_PRELOAD as IO_PROCESS_PRELOAD,
    IO_PROCESS_START_S as IO_PROCESS_START_S,
    MAX_DISK_WRITES_IN_FLIGHT as MAX_DISK_WRITES_IN_FLIGHT,
    PLACE_CHUNK as PLACE_CHUNK,
    SCAN_CHUNK as SCAN_CHUNK,
    STAGING_BLOCKS as STAGING_BLOCKS,
    STAGING_RESCUE as STAGING_RESCUE,
)
from shmkv.tiers.promotions import Promotion
from shmkv.tiers.specs import DiskTier, HostTier, check_specs, check_trusted_dir, parse_size
from shmkv.tiers.tier_set import TierSet

__all__ = [
    "HostTier",
    "DiskTier",
    "parse_size",
    "check_specs",
    "check_trusted_dir",
    "TierSet",
    "Promotion",
    "HEADER_SIZE",
]


class _Package(types.ModuleType):
    """This package's module object: a knob (``knobs.NAMES``) set as its attribute is
    set in ``shmkv.tiers.knobs`` too, the one place the parts read it (a module gets a
    ``__setattr__`` through its ``__class__``, as Python's data model documents)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in knobs.NAMES:
            setattr(knobs, name, value)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
