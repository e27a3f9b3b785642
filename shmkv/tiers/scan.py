"""The disk tier's index rebuilt from its directory at start (:class:`DiskScan`), while
the coordinator already serves.

Owns its thread (names first, so that hits start at once; then every header, checked;
then the LRU order by modification time), the queue it posts to, and the disk store's
``scanning`` flag. The loop merges what was posted a bounded amount a turn
(:meth:`DiskScan.merge`), into the index through the demotion part
(``shmkv.tiers.demotion``), which alone changes it. Imports ``shmkv.memory.block_io`` and
``shmkv.tiers.knobs`` / ``disk_store`` / ``demotion``.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections import deque
from typing import Any, Callable, Deque, Optional, Tuple

from shmkv.memory.block_io import Damaged
from shmkv.tiers import knobs
from shmkv.tiers.demotion import Demotion
from shmkv.tiers.disk_store import DiskStore

log = logging.getLogger(__name__)

_FILE_RE = re.compile(r"^([0-9a-f]{32})\.kv$")
_TMP_RE = re.compile(r"^[0-9a-f]{32}\.kv\.tmp-([0-9a-f]+)$")


class DiskScan:
    """Rebuild ``disk``'s index from its directory in a thread (:meth:`start`); the loop
    takes what it found with :meth:`merge` while :attr:`has_news`.

    Args:
        disk: the disk tier's store (in use: not disabled).
        demotion: the part that changes the index.
        wake: called from the thread to wake the loop (it has news).
    """

    def __init__(self, disk: DiskStore, demotion: Demotion, wake: Callable[[], None]):
        self._disk = disk
        self._demotion = demotion
        self._wake = wake
        self._q: Deque[Tuple[str, Any]] = deque()  # (kind, payload) for the loop
        self._stopping = False
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        """Start the thread; the disk tier reads ``scanning`` until it is done."""
        self._disk.scanning = True
        thread = threading.Thread(target=self._scan, name="shmkv-tier-scan", daemon=True)
        thread.start()
        self._thread = thread

    @property
    def has_news(self) -> bool:
        """The thread posted something the loop has not merged yet."""
        return bool(self._q)

    def stop(self) -> None:
        """Ask the thread to stop at its next file (:meth:`join` waits for it)."""
        self._stopping = True

    def join(self, timeout: float) -> None:
        """Stop the thread and wait up to ``timeout`` seconds for it. Idempotent."""
        self._stopping = True
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def merge(self) -> None:
        """Merge what the thread posted, at most about ``SCAN_CHUNK`` keys (loop thread):
        found files are indexed, damaged ones removed, the order set; once the scan is
        done, a disk over its capacity (a smaller one than last run) is trimmed."""
        disk, demotion = self._disk, self._demotion
        budget = knobs.SCAN_CHUNK
        while self._q and budget > 0:
            kind, payload = self._q.popleft()
            if kind == "keys":
                demotion.add_found(payload)
                budget -= len(payload)
            elif kind == "bad":
                key, reason = payload
                entry = disk.index.get(key)
                if entry is not None and entry.from_scan:
                    disk.counters["errors"] += 1
                    log.warning(
                        "disk tier %s: block file %s not served and removed: %s",
                        disk.path,
                        key.hex(),
                        reason,
                    )
                    demotion.remove_damaged(key, entry)
            elif kind == "order":  # newest first (see Demotion.order_found)
                demotion.order_found(payload)
            elif kind == "incomplete":
                disk.counters["removed_incomplete"] += payload
            elif kind == "error":
                disk.counters["errors"] += 1
                log.warning("disk tier %s: scanning failed: %s", disk.path, payload)
            elif kind == "done":
                disk.scanning = False
            budget -= 1
        # A smaller capacity than last run: trimmed once the scan has put the blocks in
        # LRU order (their files' modification times).
        if not disk.scanning:
            demotion.trim_disk()
        if self._q:
            self._wake()  # more next turn: the loop stays responsive meanwhile

    def _scan(self) -> None:
        """Rebuild the disk index from the directory: names first (so hits start at
        once), then every header, then the LRU order by modification time."""
        disk, chunk = self._disk, knobs.SCAN_CHUNK
        post = self._q.append
        try:
            keys, incomplete = [], 0
            with os.scandir(disk.blocks_dir) as entries:
                for item in entries:
                    if self._stopping:
                        return
                    match = _FILE_RE.match(item.name)
                    if match:
                        if not item.is_file(follow_symlinks=False):
                            continue  # a link, FIFO, device or folder: never a block
                        keys.append(bytes.fromhex(match.group(1)))
                        if len(keys) % chunk == 0:
                            post(("keys", keys[-chunk:]))
                            self._wake()
                        continue
                    tmp = _TMP_RE.match(item.name)
                    if tmp and tmp.group(1) != disk.files.session:  # left by a killed writer
                        try:
                            os.unlink(item.path)
                            incomplete += 1
                        except OSError:
                            pass
            if len(keys) % chunk:
                post(("keys", keys[-(len(keys) % chunk) :]))
            if incomplete:
                post(("incomplete", incomplete))
            self._wake()
            ages = []
            for key in keys:
                if self._stopping:
                    return
                try:
                    mtime, _crc = disk.files.read_header(key)
                    ages.append((mtime, key))
                except FileNotFoundError:
                    continue
                except (Damaged, OSError) as exc:  # (swapped for a link or FIFO since)
                    post(("bad", (key, str(exc))))
                    self._wake()
            ages.sort(reverse=True)
            post(("order", [key for _mtime, key in ages]))
        except OSError as exc:
            post(("error", str(exc)))
        finally:
            post(("done", None))
            self._wake()
