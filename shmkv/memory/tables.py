"""Block tables and lengths in shared memory: the coordinator writes, every process reads.

Owns the layout of the metadata segment every pool has, and the rules for writing
and reading it without a lock:

* ``owner``: int64 ``[num_blocks]``. ``owner[b] == cache_id`` means sequence
  ``cache_id`` may write block ``b`` in place (see ``shmkv.coordinator.allocator``).
* ``epoch``: int64, bumped whenever a block stops being writable in place by the
  sequence that could write it (a fork or prefix hit shares it, a commit publishes
  it). A writer that checked ``owner`` at epoch ``e`` need not check again while the
  epoch is still ``e``.
* ``scales``: the per-layer K/V dequantization scales of a quantized pool: one int64
  seqlock word, then float64 ``[num_layers, 2]`` (K, V), 1.0 until a caller sets them;
  padded to 64 bytes. Written with the seqlock rule below, read by :func:`read_scales`.
* ``seq``: int64 ``[max_sequences, 4]``, one row per sequence slot:
  ``[lock, cache_id, num_tokens, generation]``.
* ``table``: int32 ``[max_sequences, max_seq_blocks]``: the block table of the
  sequence in each slot; entries past its last block are 0.

Writer rules (the coordinator, a single thread, is the only writer). Stores are
made in this order, and x86-64 keeps stores in program order (and loads in program
order, which the reader rule relies on):

* appending blocks (extend): table entries, then ``generation``, then ``num_tokens``;
* replacing an entry (copy-on-write), taking or freeing a slot, truncating a sequence:
  ``lock`` becomes odd, the change is made, ``generation`` moves, ``lock`` becomes
  even again (a seqlock).

Reader rule: read ``lock``, then ``num_tokens``, then ``generation``, then the
entries; read ``lock`` again. The read is good when both lock reads are equal and
even and the slot still holds the expected ``cache_id``. A reader that sees a
``num_tokens`` also sees the entries that cover it. ``generation`` changes whenever
an entry changes, so a reader may keep a copy of the entries while it is unchanged.

A read that meets a write in progress tries again: at once a few times, then giving
its CPU away (the writer may be the process it is waiting for, descheduled mid-change
on a busy machine), for up to ``READ_PATIENCE_S`` seconds in all (:func:`writer_busy`).
A live coordinator holds a row odd for microseconds of its own running time; a read
that waits that long met a coordinator stopped or dead mid-change. A reader that can
tell whether the coordinator lives (a client: its socket hung up) checks, once it
gives its CPU away, and fails at once with ``CoordinatorGone``.

Memory ordering: these rules hold only where the CPU keeps stores in order and loads
in order (x86-64, which is total store order). On a weakly ordered CPU (aarch64: Grace
Hopper, Graviton; POWER; RISC-V) a reader could see a length before the entries that
cover it, and Python has no fence to put between them. There, :func:`lock_free_reads`
is False and readers do not read the segment lock-free at all: a handle, a batch step
and a step rebuilt from a descriptor get their rows (and the owners a write checks)
from the coordinator in a round trip (the ``rows`` op), which reads them on the
writer's own thread. The socket hand-off between the two processes orders their
memory, as every lock in the kernel does. ``SHMKV_TABLE_READS=round-trip`` forces the
fallback anywhere (for tests); ``shared`` is refused off x86.

Bound: ``max_sequences`` live sequences and ``max_seq_blocks`` blocks per sequence,
both from :class:`~shmkv.memory.layout.PoolConfig`; the segment costs
``8 * num_blocks + 64 + scales + 32 * max_sequences + 4 * max_sequences * max_seq_blocks``
bytes, where ``scales`` is ``8 + 16 * num_layers`` rounded up to 64. Going past either
bound is refused with ``LimitExceeded``.

Pure: memoryviews, numpy and ints, no torch, no I/O. Readers that want tensors build them
over the same segment (``shmkv.memory.pool``).
"""

from __future__ import annotations

import os
import platform
import time
from array import array
from typing import TYPE_CHECKING, Callable, List, Optional, Sequence, Tuple, Union

import numpy as np

from shmkv.errors import LimitExceeded

if TYPE_CHECKING:
    from typing_extensions import Buffer

    from shmkv.memory.layout import PoolConfig

SEQ_FIELDS = 4
# A seqlock read retries at once this many times, then yields its CPU between tries.
READ_SPINS = 64
# ...and gives up after this long (a live writer holds a row odd for microseconds).
READ_PATIENCE_S = 5.0
_ZEROS = array("i", bytes(4 * 4096))


def _zeros(num: int) -> array:
    return _ZEROS[:num] if num <= len(_ZEROS) else array("i", bytes(4 * num))


def run_index(ids: np.ndarray) -> Union[slice, np.ndarray]:
    """``ids`` (int64, distinct) as an index: a slice when they are one ascending run
    (slots and blocks taken from a stack usually are), else themselves. Stores through a
    slice cost a fraction of those through an index array."""
    num = ids.shape[0]
    if num > 8:
        first = int(ids[0])
        if int(ids[-1]) - first == num - 1 and bool((np.diff(ids) == 1).all()):
            return slice(first, first + num)
    return ids


LOCK, CACHE_ID, NUM_TOKENS, GENERATION = range(SEQ_FIELDS)
# CPUs that keep stores in order and loads in order (total store order).
_ORDERED_MACHINES = frozenset({"x86_64", "amd64", "i386", "i686", "x86"})


def lock_free_reads(machine: str = "") -> bool:
    """Whether this process may read the shared tables without a lock (see the module
    doc): on x86 unless ``SHMKV_TABLE_READS=round-trip``; never elsewhere."""
    ordered = (machine or platform.machine()).lower() in _ORDERED_MACHINES
    return ordered and os.environ.get("SHMKV_TABLE_READS", "shared") != "round-trip"


EPOCH_WORDS = 8  # the epoch and spare words, so the sequence rows stay 64-byte aligned


class TableLayout:
    """Offsets and sizes of the metadata segment of one pool."""

    __slots__ = (
        "num_blocks",
        "max_sequences",
        "max_seq_blocks",
        "num_layers",
        "owner_offset",
        "epoch_offset",
        "scales_offset",
        "seq_offset",
        "table_offset",
        "nbytes",
    )

    def __init__(
        self, num_blocks: int, max_sequences: int, max_seq_blocks: int, num_layers: int = 0
    ):
        self.num_blocks = num_blocks
        self.max_sequences = max_sequences
        self.max_seq_blocks = max_seq_blocks
        self.num_layers = num_layers
        self.owner_offset = 0
        self.epoch_offset = 8 * num_blocks
        self.scales_offset = self.epoch_offset + 8 * EPOCH_WORDS
        scales_bytes = -(-(8 + 16 * num_layers) // 64) * 64  # the sequence rows stay aligned
        self.seq_offset = self.scales_offset + scales_bytes
        self.table_offset = self.seq_offset + 8 * SEQ_FIELDS * max_sequences
        self.nbytes = self.table_offset + 4 * max_sequences * max_seq_blocks

    @classmethod
    def of(cls, config: PoolConfig) -> "TableLayout":
        return cls(
            config.num_blocks, config.max_sequences, config.max_seq_blocks, config.num_layers
        )

    def scale_views(self, buffer: Buffer) -> Tuple[memoryview, memoryview[float]]:
        """``(lock, scales)`` memoryviews over a buffer of ``nbytes``: the int64 seqlock
        word and float64 ``[num_layers * 2]`` (K then V of each layer)."""
        whole = memoryview(buffer)
        lock = whole[self.scales_offset : self.scales_offset + 8].cast("q")
        start = self.scales_offset + 8
        scales = whole[start : start + 16 * self.num_layers].cast("d")
        whole.release()
        return lock, scales

    def views(self, buffer: Buffer) -> Tuple[memoryview, memoryview, memoryview, memoryview]:
        """``(owner, epoch, seq, table)`` memoryviews over a buffer of ``nbytes``:
        int64, int64, int64 (flat, ``SEQ_FIELDS`` per slot), int32 (flat)."""
        whole = memoryview(buffer)
        owner = whole[self.owner_offset : self.epoch_offset].cast("q")
        epoch = whole[self.epoch_offset : self.seq_offset].cast("q")
        seq = whole[self.seq_offset : self.table_offset].cast("q")
        table = whole[self.table_offset : self.nbytes].cast("i")
        whole.release()
        return owner, epoch, seq, table


class TableWriter:
    """The coordinator's side: slots, and every store into the shared tables.

    Args:
        layout: the segment layout.
        seq, table: the writable ``seq`` and ``table`` views of :meth:`TableLayout.views`.
        arrays: ``(seq, table)`` as numpy arrays ``[max_sequences, SEQ_FIELDS]`` and
            ``[max_sequences, max_seq_blocks]`` over the same memory, for the stores
            of many sequences at once; made over ``seq`` and ``table`` when omitted
            (then those views cannot be released while the writer lives).
    """

    def __init__(
        self,
        layout: TableLayout,
        seq: memoryview,
        table: memoryview,
        arrays: Optional[Tuple[np.ndarray, np.ndarray]] = None,
    ):
        self.layout = layout
        self.seq = seq
        self.table = table
        self.max_seq_blocks = layout.max_seq_blocks
        # Free slots as a stack, lowest slot on top, so a fresh pool fills slot 0 first.
        self._free: List[int] = list(range(layout.max_sequences - 1, -1, -1))
        # Entries in use per slot (the coordinator's own bookkeeping, not shared), for
        # checks over a whole batch at once. Never resized: arrays may view it.
        self.num_blocks = array("q", bytes(8 * layout.max_sequences))
        if arrays is None:
            arrays = (
                np.frombuffer(seq, dtype=np.int64).reshape(-1, SEQ_FIELDS),
                np.frombuffer(table, dtype=np.int32).reshape(-1, layout.max_seq_blocks),
            )
        self.seq_np: np.ndarray
        self.table_np: np.ndarray
        self.seq_np, self.table_np = arrays
        self.num_blocks_np = np.frombuffer(self.num_blocks, dtype=np.int64)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def check_slots(self, num: int) -> None:
        """Raise ``LimitExceeded`` unless ``num`` more sequences fit."""
        if num > len(self._free):
            raise LimitExceeded(
                f"{self.layout.max_sequences - len(self._free)} sequences live and {num} more "
                f"asked for: the shared block tables hold {self.layout.max_sequences} "
                f"(PoolConfig.max_sequences); close handles or raise max_sequences"
            )

    def check_blocks(self, num_blocks: int, what: str) -> None:
        """Raise ``LimitExceeded`` when one sequence would need more table entries than
        a row holds."""
        if num_blocks > self.max_seq_blocks:
            raise LimitExceeded(
                f"{what} would need {num_blocks} blocks, a shared block table holds "
                f"{self.max_seq_blocks} per sequence (PoolConfig.max_seq_len="
                f"{self.max_seq_blocks} blocks); raise max_seq_len"
            )

    def take(self, num: int) -> List[int]:
        """``num`` free slots for new sequences (the caller checked :meth:`check_slots`
        and fills each with :meth:`assign` or :meth:`assign_many`)."""
        free = self._free
        slots = free[len(free) - num :]
        del free[len(free) - num :]
        slots.reverse()
        return slots

    def assign(self, slot: int, cache_id: int, block_ids: Sequence[int], num_tokens: int) -> None:
        """Publish a new sequence's table in a slot from :meth:`take`. The caller
        checked :meth:`check_blocks`."""
        self.num_blocks[slot] = len(block_ids)
        seq, base = self.seq, slot * SEQ_FIELDS
        seq[base + LOCK] += 1
        if block_ids:
            row = slot * self.max_seq_blocks
            self.table[row : row + len(block_ids)] = array("i", block_ids)
        seq[base + CACHE_ID] = cache_id
        seq[base + NUM_TOKENS] = num_tokens
        seq[base + GENERATION] += 1
        seq[base + LOCK] += 1

    def assign_many(
        self,
        slots: np.ndarray,
        cache_ids: np.ndarray,
        blocks: np.ndarray,
        counts: np.ndarray,
        num_tokens: np.ndarray,
    ) -> None:
        """:meth:`assign` for several new sequences at once, with a fixed number of array
        operations: sequence ``i`` gets slot ``slots[i]``, ``counts[i]`` of ``blocks``
        (one sequence's after another's) and ``num_tokens[i]``."""
        num = cache_ids.shape[0]
        seq = self.seq_np
        rows = run_index(slots)
        seq[rows, LOCK] += 1
        if blocks.shape[0] == num and bool((counts == 1).all()):
            self.table_np[rows, 0] = blocks
        elif blocks.shape[0]:
            first = np.cumsum(counts) - counts
            self.table_np[
                np.repeat(slots, counts), np.arange(blocks.shape[0]) - np.repeat(first, counts)
            ] = blocks
        seq[rows, CACHE_ID] = cache_ids
        seq[rows, NUM_TOKENS] = num_tokens
        seq[rows, GENERATION] += 1
        seq[rows, LOCK] += 1
        self.num_blocks_np[rows] = counts

    def release_many(self, slots: np.ndarray, rows: Union[slice, np.ndarray], widest: int) -> None:
        """:meth:`release` for several dead sequences at once (distinct slots): ``rows``
        is ``run_index(slots)``, ``widest`` the most table entries one of them uses."""
        seq = self.seq_np
        seq[rows, LOCK] += 1
        seq[rows, CACHE_ID] = 0
        seq[rows, NUM_TOKENS] = 0
        if widest:  # entries past a row's used ones are 0 already
            self.table_np[rows, :widest] = 0
        seq[rows, GENERATION] += 1
        seq[rows, LOCK] += 1
        self.num_blocks_np[rows] = 0
        self._free.extend(slots[::-1].tolist())

    def release(self, slot: int, num_blocks: int) -> None:
        """Free a dead sequence's slot (and zero the ``num_blocks`` entries it used, so
        that table rows read past a sequence's end hold 0, never a stale block id)."""
        self.num_blocks[slot] = 0
        seq, base = self.seq, slot * SEQ_FIELDS
        seq[base + LOCK] += 1
        seq[base + CACHE_ID] = 0
        seq[base + NUM_TOKENS] = 0
        if num_blocks:
            row = slot * self.max_seq_blocks
            self.table[row : row + num_blocks] = _zeros(num_blocks)
        seq[base + GENERATION] += 1
        seq[base + LOCK] += 1
        self._free.append(slot)

    def append(self, slot: int, index: int, block_ids: Sequence[int], num_tokens: int) -> None:
        """Entries ``index..`` become ``block_ids`` (new blocks only), then the length."""
        base = slot * SEQ_FIELDS
        if block_ids:
            self.num_blocks[slot] = index + len(block_ids)
            row = slot * self.max_seq_blocks + index
            self.table[row : row + len(block_ids)] = array("i", block_ids)
            self.seq[base + GENERATION] += 1
        self.seq[base + NUM_TOKENS] = num_tokens

    def truncate(self, slot: int, keep: int, num_tokens: int) -> None:
        """The sequence ends at ``num_tokens``, in its first ``keep`` entries (a
        truncate): under the seqlock, entries from ``keep`` on become 0."""
        seq, base = self.seq, slot * SEQ_FIELDS
        seq[base + LOCK] += 1
        used = self.num_blocks[slot]
        if used > keep:
            row = slot * self.max_seq_blocks
            self.table[row + keep : row + used] = _zeros(used - keep)
            self.num_blocks[slot] = keep
        seq[base + NUM_TOKENS] = num_tokens
        seq[base + GENERATION] += 1
        seq[base + LOCK] += 1

    def set_length(self, slot: int, num_tokens: int) -> None:
        """A new length whose blocks are all in the table already."""
        self.seq[slot * SEQ_FIELDS + NUM_TOKENS] = num_tokens

    def replace(self, slot: int, index: int, block_id: int) -> None:
        """Entry ``index`` now names another block (copy-on-write)."""
        seq, base = self.seq, slot * SEQ_FIELDS
        seq[base + LOCK] += 1
        self.table[slot * self.max_seq_blocks + index] = block_id
        seq[base + GENERATION] += 1
        seq[base + LOCK] += 1


def write_scales(
    lock: memoryview, scales: memoryview[float], layer: int, k_scale: float, v_scale: float
) -> None:
    """Store one layer's K/V scales (the coordinator only; a seqlock, as for rows)."""
    lock[0] += 1
    scales[2 * layer] = k_scale
    scales[2 * layer + 1] = v_scale
    lock[0] += 1


def writer_busy(
    tries: int,
    since: float,
    what: str,
    error: Callable[[str], Exception] = LimitExceeded,
    alive: Optional[Callable[[], None]] = None,
) -> Tuple[int, float]:
    """The wait before a seqlock read's next try, after ``tries`` failed ones (the
    module's retry rule). Returns the new ``(tries, since)`` for the next call: start
    with ``(0, 0.0)``; ``since`` is when the waits began. ``alive`` (a client's
    ``check``) is called before each wait past the first tries.

    Raises:
        ``error``: the reads of ``what`` kept meeting a change for ``READ_PATIENCE_S``.
        What ``alive`` raises: the coordinator is gone.
    """
    tries += 1
    if tries <= READ_SPINS:
        return tries, since
    if alive is not None:
        alive()
    now = time.monotonic()
    if not since:
        since = now
    elif now - since > READ_PATIENCE_S:
        raise error(
            f"{what} kept changing for {READ_PATIENCE_S:g} s ({tries} reads): "
            "the coordinator stopped or died mid-change"
        )
    if tries <= 2 * READ_SPINS:
        os.sched_yield()
    else:
        time.sleep(min(0.001, 1e-5 * (tries - 2 * READ_SPINS)))
    return tries, since


def reads_held(before: np.ndarray, after: np.ndarray) -> bool:
    """Whether rows read at once between two reads of their locks (``before``, then
    ``after``) are consistent, the reader rule for many rows: every lock even at the
    first read and the same at the second. (Masking ``after`` instead would accept a
    write that began during the read: ``before`` even, ``after`` odd.)"""
    return bool(((before & ~1) == after).all())


def read_scales(
    lock: memoryview,
    scales: memoryview[float],
    layer: int,
    alive: Optional[Callable[[], None]] = None,
) -> Tuple[float, float]:
    """One layer's ``(k_scale, v_scale)``, never half of an update (``alive`` as for
    :func:`writer_busy`).

    Raises:
        LimitExceeded: the scales kept changing (:func:`writer_busy`).
    """
    tries, since = 0, 0.0
    while True:
        before = lock[0]
        if not before & 1:
            k_scale, v_scale = scales[2 * layer], scales[2 * layer + 1]
            if lock[0] == before:
                return k_scale, v_scale
        tries, since = writer_busy(
            tries, since, f"K/V scales of layer {layer}", LimitExceeded, alive
        )


def read_row(
    seq: memoryview,
    table: memoryview,
    max_seq_blocks: int,
    block_size: int,
    slot: int,
    cache_id: int,
    known_generation: int = -1,
    known_blocks: int = 0,
    alive: Optional[Callable[[], None]] = None,
) -> Optional[Tuple[int, int, Optional[List[int]]]]:
    """One sequence's ``(num_tokens, generation, blocks)``, consistent (see the module
    rules). ``blocks`` is None when the caller's copy (``known_blocks`` entries read at
    ``known_generation``) is current and covers ``num_tokens``. Returns None when the
    slot no longer holds ``cache_id``. ``alive`` as for :func:`writer_busy`.

    Raises:
        LimitExceeded: the row kept changing (:func:`writer_busy`).
    """
    base = slot * SEQ_FIELDS
    tries, since = 0, 0.0
    while True:
        lock = seq[base + LOCK]
        if not lock & 1:
            num_tokens = seq[base + NUM_TOKENS]
            generation = seq[base + GENERATION]
            blocks = None
            needed = -(-num_tokens // block_size)
            if generation != known_generation or needed > known_blocks:
                row = slot * max_seq_blocks
                blocks = table[row : row + needed].tolist()
            owner_ok = seq[base + CACHE_ID] == cache_id
            if seq[base + LOCK] == lock:
                return (num_tokens, generation, blocks) if owner_ok else None
        tries, since = writer_busy(
            tries, since, f"block table of slot {slot}", LimitExceeded, alive
        )
