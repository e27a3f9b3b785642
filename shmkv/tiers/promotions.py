"""How blocks come back up from a tier (:class:`Promotions`), and a promotion's copies as
columns (:class:`Promotion`).

Owns the promotions in flight: which leading keys of a prompt a tier can serve
(:meth:`Promotions.lookup`), a request's promotion into fresh pool blocks
(:meth:`Promotions.promote`: its columns, the hits counted), the copies a client runs
itself (:meth:`Promotions.client_memory`, :meth:`Promotions.client_copies`,
:meth:`Promotions.finish_in_client`), and the completion (:meth:`Promotions.take`:
counted, each record finished against the sequence table up to its first failed copy).
Reads the tiers' indexes and changes them only through the demotion part
(``shmkv.tiers.demotion``: pins, a damaged file's removal); where the job runs (threads
or the I/O process) is ``TierSet``'s, which it is handed as ``start``. Imports
``shmkv.protocol``, ``shmkv.errors``, ``shmkv.memory.block_io`` and ``shmkv.tiers.demotion`` /
``host_store`` / ``disk_store``.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Dict, List, Optional, Tuple

from shmkv.errors import InvalidArgument
from shmkv.memory import block_io
from shmkv.memory.block_io import (
    DAMAGED,
    OK,
    OP_D2P,
    OP_H2P,
    OP_NONE,
    OPS,
    BlockFiles,
    Copy,
    Job,
)
from shmkv.protocol import pack_i64s
from shmkv.tiers.demotion import Demotion
from shmkv.tiers.disk_store import DiskStore
from shmkv.tiers.host_store import HostStore

log = logging.getLogger(__name__)


class Promotion:
    """Blocks being promoted for one request. ``context`` is the coordinator's (whom to
    answer); ``records`` are the ``shmkv.coordinator.sequences`` records it finishes.

    Its copies are columns, one item a block, record after record (``row_lens`` blocks
    each): op codes (``block_io.OPS``), pool blocks, host slots, keys, and the tier entry
    each reads and pins (None for a block no tier could serve). A promotion is the loop's
    hot path, so it makes no object per block: the job frame is packed from the columns
    and its outcomes come back as one status byte a block."""

    __slots__ = (
        "records",
        "row_lens",
        "ops",
        "blocks",
        "slots",
        "keys",
        "srcs",
        "num_host",
        "context",
    )

    def __init__(self, records: list):
        self.records = records
        self.row_lens: List[int] = []
        self.ops: List[int] = []
        self.blocks: List[int] = []
        self.slots: List[int] = []
        self.keys: List[bytes] = []
        self.srcs: list = []
        self.num_host = 0  # copies from the host tier (the others: disk, or none)
        self.context: Any = None

    def copies(self) -> list:
        """The promotion as ``block_io.Copy`` objects (for worker threads)."""
        out = []
        for op, block, slot, key in zip(self.ops, self.blocks, self.slots, self.keys):
            copy = Copy(OPS[op], key, block=block, slot=slot)
            copy.cancelled = op == OP_NONE
            out.append(copy)
        return out


class Promotions:
    """The promotion part of a :class:`~shmkv.tiers.tier_set.TierSet` (see the module
    doc).

    Args:
        config: the pool's :class:`~shmkv.memory.layout.PoolConfig`.
        table: the :class:`~shmkv.coordinator.sequences.SequenceTable` (records are finished there).
        host, disk: the tiers' stores (None for a tier not configured).
        files: the disk tier's block files if it is in use (not disabled), else None.
        demotion: the part that pins and unpins entries and removes damaged files.
        start: hands a promotion's copies to the workers (``TierSet``).
    """

    def __init__(
        self,
        config,
        table,
        host: Optional[HostStore],
        disk: Optional[DiskStore],
        files: Optional[BlockFiles],
        demotion: Demotion,
        start: Callable[[Promotion], None],
    ):
        self.config = config
        self.table = table
        self.host = host
        self.disk = disk
        self._files = files
        self._demotion = demotion
        self._start = start
        self.num_in_flight = 0  # promotions started and not completed

    def lookup(self, keys) -> int:
        """How many leading ``keys`` a tier can serve now (a pure index lookup)."""
        host = self.host.index if self.host is not None else {}
        disk = self.disk.index if self.disk is not None and self.disk.same_scales() else {}
        num = 0
        for key in keys:
            entry = host.get(key)
            if entry is None or not entry.ready:
                entry = disk.get(key)
                if entry is None or not entry.ready:
                    break
            num += 1
        return num

    def held_here(self, keys) -> int:
        """Leading ``keys`` whose bytes are on this host (all a lookup found: every tier
        here is local), so a promotion of them fails only on a damaged file."""
        return self.lookup(keys)

    def promote(self, records: list, in_client: bool = False) -> Promotion:
        """Start copying the blocks of ``records`` (``PendingPromotion`` records, of
        ``shmkv.coordinator.prefix``) into their fresh pool blocks; ``TierSet.tick`` returns
        the promotion when done. With ``in_client``, the asking client copies them
        (:meth:`client_copies`) and :meth:`finish_in_client` takes its report instead."""
        promo = Promotion(records)
        host = self.host.index if self.host is not None else None
        disk = self.disk.index if self.disk is not None else None
        ops, slots, srcs = promo.ops, promo.slots, promo.srcs
        num_disk = 0
        for record in records:
            promo.row_lens.append(len(record.keys))
            promo.blocks += record.blocks
            promo.keys += record.keys
            for key in record.keys:
                if host is not None and (entry := host.get(key)) is not None and entry.ready:
                    ops.append(OP_H2P)
                    slots.append(entry.slot)
                else:
                    slots.append(-1)
                    # (no entry: gone since lookup(), which keep_planned() prevents)
                    if disk is None or (entry := disk.get(key)) is None or not entry.ready:
                        ops.append(OP_NONE)
                        srcs.append(None)
                        continue
                    ops.append(OP_D2P)
                    num_disk += 1
                srcs.append(entry)
        self._demotion.pin_sources(ops, promo.keys, srcs)
        promo.num_host = len(ops) - num_disk - ops.count(OP_NONE)
        if promo.num_host:
            assert self.host is not None  # (its entries were read)
            self.host.counters["hits"] += promo.num_host
        if num_disk:
            assert self.disk is not None  # (its entries were read)
            self.disk.counters["hits"] += num_disk
        # One job: workers take its copies one at a time, so reads and checksums of one
        # request still run in parallel, and the loop takes back one completion.
        self.num_in_flight += 1
        if not in_client:
            self._start(promo)
        return promo

    def client_memory(self) -> Tuple[Optional[dict], List[int]]:
        """What a client needs to copy its own promotions (the ``tier_memory`` answer):
        the host tier's slots and slot bytes and the disk tier's block files, with the
        host tier's descriptor, read-only. ``(None, [])`` where a client cannot: a CUDA
        pool, or no read-only descriptor."""
        if self.config.is_cuda:
            return None, []
        host, files = self.host, self._files
        out: Dict[str, Any] = {"block_nbytes": self.config.block_nbytes, "host": None}
        out["files"] = None if files is None else files.files_wire()
        if files is not None:
            # Which folder it is: a client that sees another one at its path (a mount
            # namespace of its own) would find no file there, and report every block it
            # was asked to copy missing, which removes the genuine files.
            try:
                st = os.stat(files.blocks_dir)
            except OSError:
                return None, []
            out["files_id"] = [st.st_dev, st.st_ino]
        fds = []
        if host is not None:
            fd = host.read_only_fd()
            if fd is None:
                return None, []
            out["host"] = [host.num_slots, host.slot_nbytes]
            fds.append(fd)
        return out, fds

    def client_copies(self, promo: Promotion, promo_id: int) -> dict:
        """The copies of ``promo`` (started ``in_client``) as its client runs them
        (:class:`ClientCopies`): op codes, pool blocks, host slots, keys."""
        return {
            "id": promo_id,
            "ops": bytes(promo.ops),
            "blocks": pack_i64s(promo.blocks),
            "slots": pack_i64s(promo.slots),
            "keys": b"".join(promo.keys),
        }

    def finish_in_client(self, promo: Promotion, statuses: Optional[bytes], errors: list) -> None:
        """The client of ``promo`` (started ``in_client``) reported its copies: one
        ``block_io`` status a copy (None: none reported, its connection dropped, so none
        counts as done), and ``[index, text]`` of the copies that failed. A status a
        copy cannot have is taken as a failure: OK for a block no tier had, damaged for
        a copy from host memory.

        Raises:
            InvalidArgument: ``statuses`` is not one byte a copy, or ``errors`` not
                ``[index, text]`` pairs of distinct copies (nothing changed).
        """
        ops = promo.ops
        if statuses is None:
            statuses = bytes([block_io.FAILED]) * len(ops)
        if not isinstance(statuses, bytes) or len(statuses) != len(ops):
            got = len(statuses) if isinstance(statuses, bytes) else type(statuses).__name__
            raise InvalidArgument(f"promoted: {len(ops)} statuses expected, got {got}")
        texts: Dict[int, str] = {}
        for item in errors if len(errors) <= len(ops) else [f"{len(errors)} items"]:
            if not (
                isinstance(item, (list, tuple))
                and len(item) == 2
                and type(item[0]) is int
                and 0 <= item[0] < len(ops)
                and item[0] not in texts
                and isinstance(item[1], str)
            ):
                raise InvalidArgument(
                    f"promoted: errors are [copy index, text] pairs, one a copy of the "
                    f"{len(ops)} at most; got {item!r:.100}"
                )
            texts[item[0]] = item[1][:500]
        if OP_NONE in ops or statuses.count(OK) != len(ops):
            fixed = bytearray(statuses)
            for i, (op, status) in enumerate(zip(ops, statuses)):
                if op == OP_NONE:
                    fixed[i] = block_io.CANCELLED
                elif status != OK and not (status == DAMAGED and op == OP_D2P):
                    fixed[i] = block_io.FAILED
            statuses = bytes(fixed)
        self._complete(promo, statuses, texts)

    def take(self, job: Job) -> Promotion:
        """A promotion's job is back: its outcomes (one status a copy, from the I/O
        process's completion or from its copies in threads) are applied by
        :meth:`_complete`. Returns the promotion, finished."""
        promo = job.promotion
        statuses, errors = job.statuses, job.errors
        if statuses is None:  # it ran in threads: the outcomes are on its copies
            copies = job.copies
            assert copies is not None
            statuses = bytes(block_io.status_of(c) for c in copies)
            errors = {i: c.error for i, c in enumerate(copies) if c.error is not None}
        assert errors is not None  # (the I/O process's completion sets both)
        self._complete(promo, statuses, errors)
        return promo

    def _complete(self, promo: Promotion, statuses: bytes, errors: dict) -> None:
        """A promotion's copies are done (``statuses``: one ``block_io`` status a copy):
        count them, unpin their sources, and publish each record's blocks up to its
        first copy that failed."""
        self.num_in_flight -= 1
        host, disk = self.host, self.disk
        srcs = promo.srcs
        if statuses.count(OK) == len(statuses):  # the common case: every block is in
            num_disk = len(statuses) - promo.num_host
            if promo.num_host:
                assert host is not None  # (its entries were read)
                host.counters["promotions"] += promo.num_host
            if num_disk:
                assert disk is not None  # (its entries were read)
                disk.counters["promotions"] += num_disk
            self._demotion.unpin_sources(srcs, promo.keys)
        else:
            for i, (entry, key, status) in enumerate(zip(srcs, promo.keys, statuses)):
                if entry is None:  # nothing was read
                    continue
                store = host if promo.ops[i] == OP_H2P else disk
                assert store is not None  # (the entry is the store's)
                if status == OK:
                    store.counters["promotions"] += 1
                else:
                    store.counters["errors"] += 1
                    if status == DAMAGED:
                        assert disk is not None  # (only a block file is found damaged)
                        self._demotion.remove_damaged(key, entry)
                        log.warning(
                            "disk tier %s: block %s not served and removed: %s",
                            disk.path,
                            key.hex(),
                            errors.get(i, "damaged"),
                        )
                self._demotion.unpin(entry, key)
        at, ok = 0, bytes([OK])
        for record, length in zip(promo.records, promo.row_lens):
            row = statuses[at : at + length]
            self.table.finish_promotion(record, length - len(row.lstrip(ok)))
            at += length
