"""One key in one tier's index (:class:`Entry`), the record the host and disk indexes map
keys to. Owns only its fields' meaning; the demotion part
(``shmkv.tiers.demotion``) is the code that changes them. Imports nothing of shmkv.
"""

from __future__ import annotations


class Entry:
    """One key in one tier. ``ready``: complete and servable. ``pins``: copies reading it."""

    __slots__ = ("slot", "ready", "pins", "from_scan", "doomed", "src_gen", "staged")

    def __init__(self, slot: int = -1, ready: bool = False, from_scan: bool = False):
        self.slot = slot
        # a demotion's: the pool block's key generation it was copied under (identity)
        self.src_gen = -1
        self.ready = ready
        self.pins = 0
        self.from_scan = from_scan  # indexed from the directory at start (not written by us)
        self.staged = False  # (disk) its bytes are in a staging slot, being written
        self.doomed = False  # found damaged while pinned: removed at the last unpin
