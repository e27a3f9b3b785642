"""Faults injected into ``shmkv.memory.block_io`` for the tier tests.

The tier I/O process runs them before it serves (``shmkv.tiers.IO_PROCESS_PRELOAD`` =
``"<this file>:<function>"``, called with its ``block_io`` module); a test whose copies
run in threads calls them on ``shmkv.memory.block_io`` with ``monkeypatch.setattr``. Each one
replaces one method of the module's classes.
"""

import errno
import os
import threading
import time

PATH = os.path.abspath(__file__)


def spec(name: str) -> str:
    """The ``IO_PROCESS_PRELOAD`` value that runs fault ``name``."""
    return f"{PATH}:{name}"


def slow_h2p(mod, set_attr=setattr) -> None:
    """Copies from the host tier to the pool take half a second longer each, one at a
    time (however many workers there are)."""
    orig = mod.Mover._op_h2p
    one_at_a_time = threading.Lock()

    def slow(self, copy):
        with one_at_a_time:
            time.sleep(0.5)
        orig(self, copy)

    set_attr(mod.Mover, "_op_h2p", slow)


def slow_disk_write(mod, set_attr=setattr) -> None:
    """Block files stall half-way: a temporary file holds half a block for a while before
    the real write, so that a SIGKILL lands mid-demotion."""
    orig = mod.BlockFiles.write_block

    def slow(self, key, payload):
        tmp = f"{self.file_path(key)}.tmp-{self.session}"
        with open(tmp, "wb") as f:
            f.write(bytes(payload)[: len(payload) // 2])
        time.sleep(0.3)
        orig(self, key, payload)

    set_attr(mod.BlockFiles, "write_block", slow)


def disk_full(mod, set_attr=setattr) -> None:
    """Every block file write fails: no space left on the device."""

    def full(self, key, payload):
        raise OSError(errno.ENOSPC, "No space left on device")

    set_attr(mod.BlockFiles, "write_block", full)


def failing_promotions(mod, set_attr=setattr) -> None:
    """Every copy into the pool from the host tier or a block file fails (an I/O error),
    wherever it runs."""

    def fail(self, copy):
        raise OSError(errno.EIO, "Input/output error (injected)")

    set_attr(mod.Mover, "_op_h2p", fail)
    set_attr(mod.Mover, "_op_d2p", fail)


def late_failing_h2p(mod, set_attr=setattr) -> None:
    """Copies from the host tier to the pool fail (an I/O error) half a second after
    they begin, one at a time."""
    one_at_a_time = threading.Lock()

    def fail(self, copy):
        with one_at_a_time:
            time.sleep(0.5)
        raise OSError(errno.EIO, "Input/output error (injected)")

    set_attr(mod.Mover, "_op_h2p", fail)


def gated_host_tier(monkeypatch) -> threading.Event:
    """Copies from the host tier to the pool run in threads of this process and each
    waits for the returned event to be set (at most 30 s)."""
    from shmkv import tiers as tiers_mod
    from shmkv.memory import block_io

    gate = threading.Event()
    monkeypatch.setattr(tiers_mod, "IO_PROCESS", False)
    h2p = block_io.Mover._op_h2p

    def gated(self, copy):
        assert gate.wait(30), "the test never opened the gate"
        h2p(self, copy)

    monkeypatch.setattr(block_io.Mover, "_op_h2p", gated)
    return gate
