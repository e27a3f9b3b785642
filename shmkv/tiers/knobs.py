"""The tiers' tuning knobs: how much is in flight, how often the loop looks up, where
copies run.

Owns these numbers and nothing else. The parts of ``shmkv.tiers`` read them here, as
``knobs.NAME``, each time they use one (never a copy taken at import), so that a value
set before a coordinator opens takes effect. Set them on the package,
``shmkv.tiers.IO_PROCESS = False`` (tests do, through ``monkeypatch``): it re-exports
them and writes a knob set there here too (set here only, the package's copy would
not follow). Imports only ``shmkv.memory.block_io``.
"""

from __future__ import annotations

from typing import Optional

from shmkv.memory import block_io

MAX_DISK_WRITES_IN_FLIGHT = 256  # blocks queued to the disk writer at once
DEMOTION_CHUNK = 64
# Blocks placed down the tiers between two looks at the loop's sockets (TierSet.tick).
PLACE_CHUNK = 8
# Host entries one search for a slot looks at, oldest first, for one already on disk
# (with a disk tier): the search stays short when the disk is slow to take spills.
HOST_SCAN = 512
# Staging slots of host memory under a disk tier: a block the pool evicts before its copy
# down a tier is done is copied here by the loop at once (and written to disk from
# here); off x86 every block goes to disk through one (``block_io``: memory ordering).
STAGING_BLOCKS = 64
STAGING_RESCUE = 16  # of them kept for rescues (the others carry the writes off x86)
# Blocks are written to disk straight from the pool (``p2d``) only where the CPU keeps
# loads in order; elsewhere through a staging slot the loop has checked (``block_io``).
DIRECT_DISK_DEMOTION = block_io.STRONG_ORDER
SCAN_CHUNK = 2048  # keys merged into the disk index per loop turn
DISK_FULL_BACKOFF_S = 1.0  # after ENOSPC, demotion to disk pauses this long
# Where a CPU pool's copies run: True, the tier I/O process (``shmkv.memory.block_io``); False,
# worker threads of the coordinator, as a CUDA pool's always do.
IO_PROCESS = True
# For tests: "path.py:function", run by the tier I/O process before it serves, with
# the ``block_io`` module as argument (to inject faults there). None in production.
IO_PROCESS_PRELOAD: Optional[str] = None
IO_PROCESS_EXIT_S = 15.0  # close() waits this long for the I/O process, then kills
# The coordinator opens once its I/O process has mapped the pool and serves (or after this
# long, with copies in threads): copies queued to a process still starting would wait,
# and the blocks the pool evicts meanwhile would be lost.
IO_PROCESS_START_S = 60.0
# While the I/O process has jobs, the loop polls it at least this often, woken or not: a
# process that died wakes nobody, and the requests waiting for its promotions would wait
# for ever.
IO_PROCESS_CHECK_S = 0.25
# While worker threads of a TierSet run in the coordinator (CUDA pools), the process's
# GIL switch interval is at most this (restored when the last TierSet closes). Workers
# release the GIL in every read, write, copy and checksum and take it back at once; at
# the default 5 ms a loop thread that wants it can wait that long for its turn
# (measured: ping p99 15x idle while promoting from disk on 2 cores, 3x at 0.2 ms).
GIL_SWITCH_INTERVAL_S = 0.0002

# The knobs above, by name: ``shmkv.tiers`` writes these through to here.
NAMES = frozenset(
    {
        "MAX_DISK_WRITES_IN_FLIGHT",
        "DEMOTION_CHUNK",
        "PLACE_CHUNK",
        "HOST_SCAN",
        "STAGING_BLOCKS",
        "STAGING_RESCUE",
        "DIRECT_DISK_DEMOTION",
        "SCAN_CHUNK",
        "DISK_FULL_BACKOFF_S",
        "IO_PROCESS",
        "IO_PROCESS_PRELOAD",
        "IO_PROCESS_EXIT_S",
        "IO_PROCESS_START_S",
        "IO_PROCESS_CHECK_S",
        "GIL_SWITCH_INTERVAL_S",
    }
)
