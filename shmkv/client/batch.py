"""Batches and steps: the data plane of an engine step.

Owns :class:`Batch` (open handles of one client that step together) and :class:`Step`
(one scheduler step over a batch: the slots it reserved or prepared, the batch
tensors paged kernels take, and writes of every new token at once).

A step costs one round trip to the coordinator (which reserves slots and does any
copy-on-write the step's writes need), then a fixed number of torch calls: the
tensors are built by vectorized ops over the shared block tables (``shmkv.memory.tables``),
never by a Python loop per sequence, and a write is one ``index_copy_`` per layer
for K and one for V. Another process (a tensor-parallel rank) rebuilds the same step
from its :meth:`Step.descriptor` bytes with no round trip at all. A decode loop that
steps the same batch of plain sequences goes further once the coordinator keeps the
batch: a step sends no ids, and its tensors are made from the last step's, with the
rows of the sequences that opened a block patched in.

Does not talk to the socket itself (it asks its client) and owns no position
arithmetic (``shmkv.client.slots``).

Over 1,000 lines, and :class:`Step` just over 600, on purpose: a step's fast paths (the
kept batch, the uniform step, the descriptor another rank rebuilds it from) share its
preallocated tensors and must stay one object's plain attribute reads on the hot path.
"""

from __future__ import annotations

import struct
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from shmkv import protocol
from shmkv.client import slots
from shmkv.client.handle import _views, check_kv_tensor
from shmkv.errors import (
    HandleClosed,
    InvalidArgument,
    LimitExceeded,
    OutOfRange,
    StaleStep,
    WrongType,
)
from shmkv.hashing import token_list
from shmkv.memory.tables import (
    CACHE_ID,
    GENERATION,
    LOCK,
    NUM_TOKENS,
    SEQ_FIELDS,
    reads_held,
    writer_busy,
)

_DESC_MAGIC = b"SKVS"
_DESC_VERSION = 1
_DESC_HEADER = struct.Struct("<4sBxxxi8sI")  # magic, version, uniform count, instance, B
# Writes of fewer new tokens copy rows in the pool's dtype, not in a wider copy unit.
_UNIT_MIN_TOKENS = 64
# Step.advance checks batches of up to this many sequences in a plain loop.
_PLAIN_MAX_SEQS = 32
# The arrays of a step made by Step.advance: its root step's, moved by its shift.
_KEEP_RETRY = 16  # steps after which a batch the coordinator did not keep asks again
_SHIFTED = ("_starts", "_ends", "_positions", "_slot_np")


_NONE = np.zeros(0, dtype=np.int64)
_NONE.flags.writeable = False


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal arrays of one shape (np.array_equal's checks cost twice the comparison)."""
    return bool((a == b).all())


def _int64s(data: bytes) -> np.ndarray:
    """Little-endian int64s of a wire answer (``protocol.pack_i64s``)."""
    return np.frombuffer(data, dtype="<i8").astype(np.int64)


class Batch:
    """Open handles of one client that step together (``client.batch(handles)``).

    Attributes: ``handles`` (tuple), ``cache_ids`` (int64 ``[B]``). Building a batch
    checks every handle once; each step is then one round trip and no loop per
    sequence. A handle closed later makes the batch's next step raise ``HandleClosed``.
    """

    def __init__(self, client, handles: list):
        ids, slot_list, cached = [], [], []
        for h in handles:
            if getattr(h, "_client", None) is not client:
                raise InvalidArgument(
                    f"{h!r} is not a handle of this client "
                    f"({client.address}); a batch takes one client's handles"
                )
            if h._closed:
                raise HandleClosed(f"handle on {h.cache_id} is closed")
            if h._view_len is not None:
                raise InvalidArgument(
                    f"{h!r} views a fixed length (with_sequence_length); a "
                    "batch steps handles on whole sequences"
                )
            ids.append(h._cache_id)
            slot_list.append(h._slot)
            cached.append(h._num_cached)
        if len(set(ids)) != len(ids):
            raise InvalidArgument("two handles of the batch name one sequence; pass one each")
        self.client = client
        self.handles = tuple(handles)
        self._ids = np.array(ids, dtype=np.int64)
        self._slots = np.array(slot_list, dtype=np.int64)
        self._num_cached = np.array(cached, dtype=np.int64)
        self.cache_ids = torch.from_numpy(self._ids)
        self._ids_wire = protocol.pack_i64s(ids)
        self._slots_wire = protocol.pack_i64s(slot_list)
        self._checked_at = client.num_closed
        # (rows, generations) of the last step's table read
        self._known_tables: Optional[Tuple[np.ndarray, np.ndarray]] = None
        # The coordinator's id of this batch once it keeps it (extend_kept: a decode
        # step sends no ids and is not checked again; -n: it did not qualify, ask again
        # in n steps), and what our last kept step left: (its number, ends,
        # slot_mapping, longest end).
        self._kept = 0
        self._kept_state: Optional[tuple] = None
        self._full: dict = {}  # a count -> [B] of it
        self._arange = np.arange(len(self.handles), dtype=np.int64)  # (read-only)
        self._arange.flags.writeable = False

    def __len__(self) -> int:
        return len(self.handles)

    def _check(self) -> None:
        """Every handle still open (a loop only when some handle of the client closed)."""
        client = self.client
        if client.num_closed != self._checked_at:
            for h in self.handles:
                if h._closed:
                    raise HandleClosed(f"handle on {h.cache_id} in this batch is closed")
            self._checked_at = client.num_closed

    def _counts(self, counts, name: str = "counts") -> tuple:
        """``(uniform count or -1, int64 [B] counts)``, each checked to lie in ``[0,
        max_seq_len]`` (a sequence never holds more), so that no arithmetic on them
        leaves int64 and nothing out of range is sent."""
        num = len(self.handles)
        most = self.client.config.max_seq_len
        if isinstance(counts, bool):
            raise WrongType(f"{name} must be an int or one int per sequence, got a bool")
        if isinstance(counts, int):
            if counts < 0:
                raise InvalidArgument(f"{name} must be >= 0, got {counts}")
            if counts > most:
                raise LimitExceeded(
                    f"{name} of {counts}: a sequence holds at most {most} "
                    "tokens (PoolConfig.max_seq_len); raise max_seq_len"
                )
            full = self._full.get(counts)
            if full is None:  # read-only, shared by this batch's steps of that count
                full = np.full(num, counts, dtype=np.int64)
                full.flags.writeable = False
                self._full = {counts: full}
            return counts, full
        if isinstance(counts, torch.Tensor):
            counts = counts.cpu().numpy()
        try:
            t = np.asarray(counts)
        except OverflowError:  # (ints past 64 bits, with numpy refusing them)
            t = np.asarray(counts, dtype=object)
        if t.dtype.kind == "O" and t.ndim == 1 and all(type(v) is int for v in t.tolist()):
            t = np.array([min(max(v, -1), most + 1) for v in t.tolist()], dtype=np.int64)
        if t.dtype.kind not in "iu" or t.ndim != 1 or t.shape[0] != num:
            raise InvalidArgument(f"{name} must be an int or {num} ints (one per sequence)")
        if num and int(t.min()) < 0:
            raise InvalidArgument(f"{name} must be >= 0, got {int(t.min())}")
        if num and int(t.max()) > most:
            raise LimitExceeded(
                f"{name} of {int(t.max())}: a sequence holds at most {most} "
                "tokens (PoolConfig.max_seq_len); raise max_seq_len"
            )
        return -1, t.astype(np.int64)

    def extend(
        self, counts=1, tokens: Optional[Sequence] = None, reserve: Union[int, str] = 0
    ) -> "Step":
        """Reserve ``counts`` more slots in every sequence (an int for all, or one per
        sequence) in ONE round trip, with copy-on-write of shared last blocks; returns
        the :class:`Step` over the new slots.

        ``tokens``: one list of token ids per sequence (its new tokens), so their blocks
        get prefix keys and can be reused once committed.

        ``reserve``: that many more slots in every sequence after the step's (with an
        int ``counts`` and no ``tokens``), which the next decode steps take with no
        round trip (:meth:`Step.advance`); ``"block"``: as many as the last blocks
        still hold after the step (the fewest over the batch), so that the reservation
        takes no block. A decode loop gives back what it did not write with
        :meth:`truncate`; until then the reserved slots count in the sequences'
        lengths::

            step = batch.extend(1, reserve=63)
            for _ in range(num_new_tokens):
                ...  # the model's forward, writing through step.write(layer, k, v)
                step = step.next_decode() or batch.extend(1, reserve=63)
            batch.truncate(step.seq_lens - 1)  # the last step was not written

        Raises:
            PoolExhausted / LimitExceeded: not enough blocks, or a table bound
                (nothing changed).
            HandleClosed: a handle of the batch was closed.
        """
        self._check()
        uniform, counts_t = self._counts(counts)
        client = self.client
        if reserve == "block":
            reserve = self._room(uniform)
        if reserve:
            if isinstance(reserve, bool) or not isinstance(reserve, int):
                raise WrongType(f"reserve must be an int, got {type(reserve).__name__}")
            if reserve < 0:
                raise InvalidArgument(f"reserve must be >= 0, got {reserve}")
            if uniform <= 0 or tokens is not None:
                raise InvalidArgument(
                    "reserve takes one int count for every sequence, and no tokens"
                )
            total, total_t = self._counts(uniform + reserve, "counts + reserve")
            return self._extend_uniform(total, total_t, uniform)
        if uniform > 0 and tokens is None:
            return self._extend_uniform(uniform, counts_t)
        args: Dict[str, Any] = {"ids": self._ids_wire}
        if uniform >= 0:
            args["count"] = uniform
            args["slots"] = self._slots_wire
        else:
            args["counts"] = counts_t.astype("<i8").tobytes()
        if tokens is not None:
            tokens = [token_list(t) for t in tokens]
            if len(tokens) != len(self.handles):
                raise InvalidArgument(f"tokens needs one list per sequence ({len(self)})")
            args["tokens"] = tokens
        epoch = client._memory.epoch[0]
        lens = _int64s(client.request("extend_batch", **args))
        return Step(client, self._ids, self._slots, lens - counts_t, counts_t, uniform, epoch, self)

    def _room(self, count: int) -> int:
        """Slots the fewest over the batch that its sequences' last blocks hold after
        ``count`` more each (``extend(reserve="block")``)."""
        if count <= 0 or not len(self.handles):
            return 0
        lens = self._lengths()
        return int((-(lens + count) % self.client.config.block_size).min())

    def _lengths(self) -> np.ndarray:
        """Every sequence's length (slots reserved), from the shared tables (from the
        coordinator where they are not read lock-free)."""
        client = self.client
        if client.lock_free:
            return client._memory.seq_np[self._slots, NUM_TOKENS]
        return client._rows(self._slots, 0)[0][:, NUM_TOKENS]

    def truncate(self, num_tokens) -> int:
        """Shorten every sequence to ``num_tokens`` (an int for all, or one per sequence,
        a tensor such as a step's ``seq_lens`` included) in one round trip: the slots
        past it are given back (reserved ahead and never written, or draft tokens
        rejected), and blocks past the new ends are released. Returns the number of
        blocks released.

        Steps made before it must not be written past the new ends (a write to a
        released block raises ``StaleStep``); make new ones.

        Raises:
            OutOfRange: a sequence holds fewer tokens than asked (nothing changed).
            InvalidArgument: a sequence has another reference (a clone, a view, an
                export), which could read past its new end (nothing changed).
        """
        self._check()
        _uniform, lens = self._counts(num_tokens, "num_tokens")
        self._kept_state = None
        return self.client.request(
            "truncate_batch", ids=self._ids_wire, num_tokens=lens.astype("<i8").tobytes()
        )

    def _extend_uniform(self, count: int, counts_t: np.ndarray, step_count: int = 0) -> "Step":
        """The decode step: through the coordinator's kept batch once it keeps one, else
        by ids. While nothing else changed the batch, the answer says only which
        sequences opened a block, and the step is made from the last one's arrays.

        ``step_count`` (``extend(reserve=)``): the step covers only the first that many
        of the ``count`` slots reserved; made from the lengths the answer carries."""
        client = self.client
        epoch = client._memory.epoch[0]
        state, self._kept_state = self._kept_state, None  # (set again by a kept step)
        if step_count:
            state = None  # (the answer then carries the lengths)
        answer = None
        if self._kept > 0:
            answer = client.request(
                "extend_kept",
                batch=self._kept,
                count=count,
                seen=state[0] if state is not None else -1,
            )
            if answer is None:  # no longer kept (the coordinator keeps the newest)
                self._kept = 0
        if answer is None and self._kept < 0:  # did not qualify lately
            self._kept += 1
            answer = {
                "lens": client.request(
                    "extend_batch", ids=self._ids_wire, count=count, slots=self._slots_wire
                ),
                "same": False,
            }
        elif answer is None:
            answer = client.request(
                "extend_batch", ids=self._ids_wire, count=count, slots=self._slots_wire, keep=True
            )
            # (one that does not qualify, a sequence with a second holder say, asks
            # again some steps later)
            self._kept = answer["batch"] or -_KEEP_RETRY
            answer["steps"], answer["same"] = 0, False
        if step_count:
            lens = np.frombuffer(answer["lens"], dtype="<i8")
            starts = lens - count
            step = Step(
                client,
                self._ids,
                self._slots,
                starts,
                self._counts(step_count)[1],
                step_count,
                epoch,
                self,
                ends=starts + step_count,
            )
            return step  # (no kept state: the next kept step asks for the lengths)
        if answer["same"]:
            assert state is not None  # (the answer to a step that named its last one)
            grown = answer["grown"]
            step = Step._next_decode(
                self,
                state,
                count,
                counts_t,
                epoch,
                *(
                    (
                        np.frombuffer(grown, dtype="<i8"),
                        np.frombuffer(answer["blocks"], dtype="<i8"),
                    )
                    if grown
                    else (_NONE, _NONE)
                ),
            )
        else:
            lens = np.frombuffer(answer["lens"], dtype="<i8")  # (read-only: only read)
            step = Step(
                client,
                self._ids,
                self._slots,
                lens - counts_t,
                counts_t,
                count,
                epoch,
                self,
                ends=lens,
            )
        if self._kept > 0:
            self._kept_state = (answer["steps"], step._ends, step._slot_np, step._max_len)
        return step

    def prefill(self, start=None, num_tokens=None) -> "Step":
        """A step over slots already reserved (a prompt allocated with its length, or
        decode slots reserved ahead): positions ``[start, start + num_tokens)`` of every
        sequence. No round trip when every block it writes is already this sequence's
        to write; otherwise ONE round trip makes them writable (copy-on-write where a
        block is shared).

        Args:
            start: an int or one per sequence; default each handle's
                ``num_cached_tokens`` (the part of the prompt the prefix cache lacks).
            num_tokens: an int or one per sequence; default up to each sequence's end.

        The step's ``seq_lens`` are ``start + num_tokens`` (the context a chunk attends
        to), so a chunked prefill is several prefill steps.

        Raises:
            OutOfRange: positions past a sequence's reserved slots (nothing changed).
        """
        self._check()
        client = self.client
        num = len(self.handles)
        if start is None:
            starts = self._num_cached.copy()
        else:
            starts = self._counts(start, "start")[1].copy()  # (its own: positions may view it)
        current = self._lengths()
        if num_tokens is None:
            counts_t = current - starts
            if num and int(counts_t.min()) < 0:
                raise OutOfRange("start lies past the end of a sequence")
            uniform = -1
        else:
            uniform, counts_t = self._counts(num_tokens, "num_tokens")
            if num and bool((starts + counts_t > current).any()):
                i = int(np.argmax(starts + counts_t > current))
                raise OutOfRange(
                    f"slots [{int(starts[i])}, {int(starts[i] + counts_t[i])}) of "
                    f"{self.handles[i].cache_id} are not all reserved "
                    f"({int(current[i])} are); extend first"
                )
        if num and uniform < 0 and bool((counts_t == counts_t[0]).all()):
            uniform = int(counts_t[0])
        epoch = client._memory.epoch[0]
        step = Step(client, self._ids, self._slots, starts, counts_t, uniform, epoch, self)
        if step._owned():
            return step
        client.request(
            "prepare_batch",
            ids=self._ids_wire,
            starts=starts.astype("<i8").tobytes(),
            counts=counts_t.astype("<i8").tobytes(),
        )
        return Step(client, self._ids, self._slots, starts, counts_t, uniform, epoch, self)


class Step:
    """One engine step over a batch: the new tokens' slots and the batch tensors (CPU
    tensors).

    Attributes:
        slot_mapping: int64 ``[T]``: ``block_id * block_size + offset`` of each new
            token, sequence by sequence (vLLM's convention).
        block_tables: int32 ``[B, max_blocks]``, padded with 0.
        seq_lens: int32 ``[B]``: each sequence's context after the step.
        query_start_loc: int32 ``[B + 1]``: cumulative new-token counts.
        positions: int64 ``[T]``: each new token's position in its sequence.
        seq_index: int64 ``[T]``: which sequence of the batch each new token is of.
        cache_ids: int64 ``[B]``.
        num_tokens: ``T``.

    Made by :meth:`Batch.extend`, :meth:`Batch.prefill`, ``client.step_from`` or, for
    the decode step after one, :meth:`advance`.
    """

    def __init__(
        self,
        client,
        cache_ids: np.ndarray,
        slot_ids: np.ndarray,
        starts: np.ndarray,
        counts: np.ndarray,
        uniform: int,
        epoch: int,
        batch: Optional[Batch] = None,
        ends: Optional[np.ndarray] = None,
    ):
        # The index arithmetic runs in numpy (about a microsecond an op, against a few
        # for torch's dispatcher on tensors this small); the results are exposed as
        # tensors sharing that memory, those a write does not need made on first use.
        self.client = client
        self.batch = batch
        self._ids = cache_ids
        self._slots = slot_ids
        self._uniform = uniform
        self._epoch = epoch
        self._counts = counts
        self._starts = starts
        bs = client.config.block_size
        num = cache_ids.shape[0]
        if ends is None:
            ends = starts + counts
        if uniform > 0:  # decode: no cumulative sum
            qsl = None
            self.num_tokens = uniform * num
        else:
            qsl = np.zeros(num + 1, dtype=np.int64)
            np.cumsum(counts, out=qsl[1:])
            self.num_tokens = int(qsl[-1])
        self._qsl = qsl
        self._max_len = max_len = int(ends.max()) if num else 0
        tables = self._read_tables(max(1, -(-max_len // bs)), ends)
        self._finish(
            tables,
            ends,
            *slots.batch_slots(tables, starts, counts, qsl, self.num_tokens, bs, uniform),
        )

    def _finish(
        self,
        tables: np.ndarray,
        ends: np.ndarray,
        slot_mapping: np.ndarray,
        seq_index: np.ndarray,
        positions: np.ndarray,
    ) -> None:
        self._ends = ends
        self._seq_index = seq_index
        self._positions = positions
        self._slot_np = slot_mapping
        self._tables_np = tables
        self._lazy: dict = {}
        self._rows: Optional[torch.Tensor] = None
        # (per-layer views of the pool or None, slot index): see _write_targets
        self._targets: Optional[Tuple[Optional[Tuple[torch.Tensor, ...]], torch.Tensor]] = None
        self._live = False  # the client was checked by a write of this step (CPU pools)
        self._sig: Optional[tuple] = None  # (layers, [T, heads, head_dim], dtype, device)
        self._plain = None  # for advance: (slots, cache ids, generations, starts) as lists

    @classmethod
    def _next_decode(
        cls,
        batch: Batch,
        state: tuple,
        count: int,
        counts: np.ndarray,
        epoch: int,
        grown: np.ndarray,
        blocks: np.ndarray,
    ) -> "Step":
        """The step of a kept batch whose answer says nothing changed it since our last
        kept step (``state``) but this step's ``count`` tokens a sequence, and block
        ``blocks[i]`` for sequence ``grown[i]``: made from the last step's arrays, with
        no read of the shared tables."""
        _steps, last_ends, last_slots, last_max = state
        client = batch.client
        step = cls.__new__(cls)
        step.client, step.batch = client, batch
        step._ids, step._slots = batch._ids, batch._slots
        step._uniform, step._epoch, step._counts, step._qsl = count, epoch, counts, None
        num = batch._ids.shape[0]
        step.num_tokens = count * num
        ends = last_ends + count
        step._starts = starts = ends - count
        step._max_len = max_len = last_max + count
        bs = client.config.block_size
        width = max(1, -(-max_len // bs))
        tables = step._patched_tables(width, grown, blocks)
        if tables is None:
            tables = step._read_tables(width, ends)
        if count == 1 and last_slots.shape[0] == num:  # one token on from the last step's
            slot_mapping = last_slots + 1
            if grown.shape[0]:
                slot_mapping[grown] = blocks * bs  # the first slot of its new block
            step._finish(tables, ends, slot_mapping, batch._arange, starts)
        else:
            step._finish(
                tables,
                ends,
                *slots.batch_slots(tables, starts, counts, None, step.num_tokens, bs, count),
            )
        return step

    def __getattr__(self, name: str):
        # A step made by advance() holds its root step and how far it moved; its
        # arrays are the root's moved that far, made on first use.
        if name in _SHIFTED:
            root = self.__dict__.get("_root")
            if root is not None:
                value = getattr(root, name) + self._shift
                setattr(self, name, value)
                return value
        raise AttributeError(f"'Step' object has no attribute {name!r}")

    def next_decode(self) -> Optional["Step"]:
        """The decode step after this one over slots already reserved (``extend(1,
        reserve=...)``): :meth:`advance` while this step's tables hold; else, when every
        sequence has its next slot reserved (a next token opens a reserved block, say),
        a step from a fresh read of the tables (:meth:`Batch.prefill`: no round trip
        while the blocks are the sequences' own to write). None when a sequence lacks
        its next slot, or this is not a one-token-per-sequence step of a batch: make the
        step with :meth:`Batch.extend` then."""
        step = self.advance()
        if step is not None or self._uniform != 1 or self.batch is None:
            return step
        ends = self._ends
        if not bool((self.batch._lengths() > ends).all()):
            return None
        return self.batch.prefill(start=ends, num_tokens=1)

    def advance(self) -> Optional["Step"]:
        """The decode step after this one: one more token in every sequence, in the slot
        after this step's, already reserved (decode over slots reserved ahead, or after
        a crop). Made from this step's tables, with no round trip and no table read,
        when they still hold; None otherwise (this is not a one-token-per-sequence step
        of a batch, a next token opens a block, a sequence lacks the slot or its row
        changed since, or a block was shared or published since): make the step with
        :meth:`Batch.prefill` or :meth:`Batch.extend` then.

        It writes the blocks this step writes, which this step found writable at its
        epoch: with the epoch unchanged, they still are. Its writes check the batch's
        handles and the epoch again, as every step's do.
        """
        if self._uniform != 1 or self.batch is None or not self.client.lock_free:
            return None
        client = self.client
        memory = client._memory
        if memory.epoch[0] != self._epoch:
            return None
        root = self.__dict__.get("_root", self)
        shift = self.__dict__.get("_shift", 0) + 1
        bs = client.config.block_size
        # The seqlock read of _read_tables without the entries: an unchanged generation
        # says the entries the step holds are current.
        if self._ids.shape[0] <= _PLAIN_MAX_SEQS:
            # A loop over a few sequences costs less than numpy's calls, which run cold
            # between a model's layers (several times their warm cost).
            plain = root._plain
            if plain is None:
                plain = root._plain = (
                    root._slots.tolist(),
                    root._ids.tolist(),
                    root._generations.tolist(),
                    root._starts.tolist(),
                )
            seq = memory.seq
            for slot, cache_id, generation, start in zip(*plain):
                pos = start + shift  # the new token's position
                base = slot * SEQ_FIELDS
                lock = seq[base + LOCK]
                if (
                    pos % bs == 0
                    or lock & 1
                    or seq[base + CACHE_ID] != cache_id
                    or seq[base + GENERATION] != generation
                    or seq[base + NUM_TOKENS] <= pos
                    or seq[base + LOCK] != lock
                ):
                    return None
        else:
            starts = root._starts + shift
            seq_np, slot_ids = memory.seq_np, self._slots
            rows = seq_np[slot_ids]
            if (
                bool((starts % bs == 0).any())
                or not reads_held(rows[:, LOCK], seq_np[slot_ids, LOCK])
                or not _same(rows[:, CACHE_ID], self._ids)
                or not _same(rows[:, GENERATION], root._generations)
                or not bool((rows[:, NUM_TOKENS] > starts).all())
            ):
                return None
        step = Step.__new__(Step)
        fields = step.__dict__
        fields.update(self.__dict__)
        for name in _SHIFTED:
            fields.pop(name, None)
        tables = self._lazy.get("block_tables")  # the same tables: the same tensor
        fields.update(
            _root=root,
            _shift=shift,
            _lazy={} if tables is None else {"block_tables": tables},
            _rows=None,
            _targets=None,
            _live=False,
        )
        return step

    @property
    def block_tables(self) -> torch.Tensor:
        return self._tensor("block_tables", lambda: self._tables_np)

    @property
    def slot_mapping(self) -> torch.Tensor:
        return self._tensor("slot_mapping", lambda: self._slot_np)

    @property
    def seq_lens(self) -> torch.Tensor:
        return self._tensor("seq_lens", lambda: self._ends.astype(np.int32))

    @property
    def cache_ids(self) -> torch.Tensor:
        return self._tensor("cache_ids", lambda: self._ids)

    @property
    def query_start_loc(self) -> torch.Tensor:
        def qsl():
            if self._qsl is not None:
                return self._qsl.astype(np.int32)
            num, count = self._ids.shape[0], self._uniform
            return (
                np.arange(0, (num + 1) * count, count, dtype=np.int32)
                if count
                else np.zeros(num + 1, dtype=np.int32)
            )

        return self._tensor("query_start_loc", qsl)

    @property
    def positions(self) -> torch.Tensor:
        return self._tensor("positions", lambda: self._positions)

    @property
    def seq_index(self) -> torch.Tensor:
        return self._tensor(
            "seq_index",
            lambda: (
                self._seq_index.copy() if not self._seq_index.flags.writeable else self._seq_index
            ),
        )

    def _tensor(self, name: str, make) -> torch.Tensor:
        t = self._lazy.get(name)
        if t is None:
            t = self._lazy[name] = torch.from_numpy(make())
        return t

    # -- reading the shared tables -----------------------------------------------------------

    def _read_tables(self, max_blocks: int, ends: np.ndarray) -> np.ndarray:
        """The batch's rows of the shared tables, consistent (seqlock): a fixed number
        of array operations whatever the batch size. Entries past a sequence's last
        block are 0 (the coordinator zeroes rows), or its later blocks when the step
        ends before the sequence does (a prefill chunk)."""
        memory = self.client._memory
        if max_blocks > memory.layout.max_seq_blocks:
            raise StaleStep("the step's sequences are longer than any table holds")
        if not self.client.lock_free:
            return self._asked_tables(max_blocks, ends)
        seq_np, table_np, slot_ids = memory.seq_np, memory.table_np, self._slots
        # The batch's last read, as a private copy: a row whose generation is unchanged
        # holds the same entries, so a decode step re-reads only the rows that grew.
        known = self.batch._known_tables if self.batch is not None else None
        if known is not None and known[0].shape[1] != max_blocks:
            known = None
        tries, since = 0, 0.0
        while True:
            before = seq_np[slot_ids]
            if known is None:
                private = table_np[slot_ids, :max_blocks]
            else:
                private = known[0]
                changed = np.flatnonzero(before[:, GENERATION] != known[1])
                if changed.shape[0]:
                    private[changed] = table_np[slot_ids[changed], :max_blocks]
            if reads_held(before[:, LOCK], seq_np[slot_ids, LOCK]):
                break
            known = None  # (a torn re-read may have patched rows: read them all again)
            tries, since = writer_busy(
                tries, since, "the step's block tables", StaleStep, self.client.check
            )
        if not _same(before[:, CACHE_ID], self._ids):
            raise StaleStep("a sequence of this step was closed; make a new step")
        self._generations = before[:, GENERATION]
        tables = private.copy()  # the step's own: its tensors outlive later reads
        if self.batch is not None:
            self.batch._known_tables = (private, self._generations)
            self.batch._kept_state = None  # (only a kept step's rows may be grown on)
        if self.batch is None and bool((before[:, NUM_TOKENS] < ends).any()):
            raise StaleStep("a sequence of this step is shorter than the step says")
        return tables

    def _asked_tables(self, max_blocks: int, ends: np.ndarray) -> np.ndarray:
        """:meth:`_read_tables` for a client that may not read them lock-free: the rows
        come from the coordinator (``shmkv.memory.tables``, memory ordering)."""
        rows, tables, _owner = self.client._rows(self._slots, max_blocks)
        if not _same(rows[:, CACHE_ID], self._ids):
            raise StaleStep("a sequence of this step was closed; make a new step")
        self._generations = rows[:, GENERATION]
        if self.batch is not None:
            self.batch._known_tables = (tables.copy(), self._generations)
            self.batch._kept_state = None
        if self.batch is None and bool((rows[:, NUM_TOKENS] < ends).any()):
            raise StaleStep("a sequence of this step is shorter than the step says")
        return tables

    def _patched_tables(
        self, width: int, grown: np.ndarray, blocks: np.ndarray
    ) -> Optional[np.ndarray]:
        """The batch's rows from its last step's, for a step of a kept batch whose
        answer says they are current once sequence ``grown[i]`` has block ``blocks[i]``
        after its others; no read of the shared tables. None when the batch holds no
        rows of a width it can grow to."""
        batch = self.batch
        assert batch is not None  # (a step of a kept batch)
        known = batch._known_tables
        if known is None or known[0].shape[1] > width:
            return None
        private, generations = known
        if private.shape[1] < width:  # entries past a plain sequence's blocks are 0
            wider = np.zeros((private.shape[0], width), dtype=private.dtype)
            wider[:, : private.shape[1]] = private  # (np.pad: 30x the time)
            private = wider
        if grown.shape[0]:
            bs = self.client.config.block_size
            private[grown, (self._starts[grown] + bs - 1) // bs] = blocks
            generations = generations.copy()
            generations[grown] += 1
        self._generations = generations
        batch._known_tables = (private, generations)
        return private.copy()  # the step's own: its tensors outlive later steps

    def _not_owned(self) -> int:
        """Index of the first new token whose block its sequence may no longer write in
        place (shared or published since), or -1 when every one is writable."""
        if not self.num_tokens:
            return -1
        blocks = self.slot_mapping.numpy() // self.client.config.block_size
        if self.client.lock_free:
            owners = self.client._memory.owner_t.numpy()[blocks]
        else:
            owners = self.client._rows(self._slots[:0], 0, blocks)[2]
        bad = np.flatnonzero(owners != self._ids[self._seq_index])
        return int(bad[0]) if bad.size else -1

    def _owned(self) -> bool:
        """Whether this sequence may write every block the step writes, in place."""
        return self._not_owned() < 0

    def _verify_owners(self) -> None:
        """Every block the step writes is still writable in place by its sequence."""
        epoch = self.client._memory.epoch[0]
        bad = self._not_owned()
        if bad >= 0:
            block = int(self.slot_mapping[bad]) // self.client.config.block_size
            cache_id = int(self._ids[self._seq_index[bad]])
            raise StaleStep(
                f"block {block} of kv-{cache_id:x} was shared (fork, prefix hit) or published "
                "(commit) after this step was made; make a new step (nothing was written)"
            )
        self._epoch = epoch

    def _ready(self) -> None:
        client = self.client
        if client._closed or not self._live:
            # A CPU pool's memory stays mapped while this process holds it, whatever
            # happens to the coordinator: one liveness check (a poll) per step is enough.
            # A device pool dies with the coordinator: checked before every write.
            client.check()
            self._live = not client.config.is_cuda
        if self.batch is not None:
            self.batch._check()
        else:
            self._check_alive()
        if client._memory.epoch[0] != self._epoch:
            self._verify_owners()

    def _check_alive(self) -> None:
        """A step rebuilt from a descriptor (another rank's) holds no reference to its
        sequences: before every write, each slot must still hold its sequence (a closed
        sequence's slot is emptied, and a cache id is never reused), so a step that
        outlived one of them never writes into the blocks another sequence got since."""
        client = self.client
        cache_ids = (
            client._memory.seq_np[self._slots, CACHE_ID]
            if client.lock_free
            else client._rows(self._slots, 0)[0][:, CACHE_ID]
        )
        if not _same(cache_ids, self._ids):
            raise StaleStep(
                "a sequence of this step was closed since the step was made "
                "(by the rank that owns it); make a new step (nothing was written)"
            )

    # -- writes ------------------------------------------------------------------------------

    def _layer_rows(self) -> torch.Tensor:
        rows = self._rows
        if rows is None:
            root = self.__dict__.get("_root")
            if root is not None:  # slots moved by k in their blocks: rows moved by k
                rows = self._rows = root._layer_rows() + self._shift
                return rows
            cfg = self.client.config  # (layer 0's K row of a slot is the slot)
            rows = self._rows = slots.all_layer_rows(
                self.slot_mapping, cfg.num_layers, cfg.num_blocks, cfg.block_size
            ).to(self.client.pool.device)
        return rows

    def _write_targets(self) -> tuple:
        """``(per-layer views of the pool or None, slot index)`` for :meth:`write`, made
        at the step's first write: a write then indexes a list of views with the step's
        slot mapping, made into no new tensor (``_PoolViews.layer_views``). None: the
        views are chosen per write (``_PoolViews.select``), the copy unit depending on
        the tensors'. A step made by :meth:`advance` writes its root's slots moved by
        its shift: one add a step."""
        targets = self._targets
        if targets is None:
            root = self.__dict__.get("_root")
            if root is not None:
                views, index = root._write_targets()
                targets = self._targets = (views, index + self._shift)
                return targets
            pool_views = _views(self.client)
            plain_rows, _chunks, plain_dtype = pool_views.plain
            # Few rows are copied in the pool's dtype (viewing them in a wider copy unit
            # costs more than the copy); float8 always as bytes (torch has no CPU copy).
            views = (
                pool_views.layer_views(plain_rows)
                if self.num_tokens < _UNIT_MIN_TOKENS and plain_dtype is None
                else None
            )
            targets = self._targets = (views, self.slot_mapping.to(self.client.pool.device))
        return targets

    def _check_tensor(self, name: str, t, shape: tuple) -> None:
        check_kv_tensor(self.client.pool, name, t, shape, what=f" ({self.num_tokens} new tokens)")

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write K and V of one layer for every new token of the step: ``k``, ``v`` are
        ``[T, num_heads, head_dim]`` (this client's heads), in ``slot_mapping`` order.
        One ``index_copy_`` each, no round trip.

        Raises:
            OutOfRange / WrongType: a bad layer.
            InvalidArgument / WrongType: wrong token count, dtype, device, shape or a
                non-contiguous tensor.
            StaleStep: a sequence was closed or a block shared since the step was made.
            Nothing is written in any of these cases.
        """
        self._ready()
        sig = self._sig
        if sig is None:  # what every write of the step is checked against
            pool = self.client.pool
            sig = self._sig = (
                pool.shape[1],
                (self.num_tokens, pool.shape[4], pool.shape[5]),
                pool.dtype,
                pool.device,
            )
        num_layers, shape, dtype, device = sig
        # What a model loop passes (plain tensors as the pool holds them) is accepted by
        # these few comparisons; anything else goes through the checks that name the fault.
        if not (
            type(layer) is int
            and 0 <= layer < num_layers
            and type(k) is torch.Tensor
            and type(v) is torch.Tensor
            and k.dtype == dtype
            and v.dtype == dtype
            and k.shape == shape
            and v.shape == shape
            and k.is_contiguous()
            and v.is_contiguous()
            and k.device == device
            and v.device == device
        ):
            pool = self.client.pool
            if isinstance(layer, bool) or not isinstance(layer, int):
                raise WrongType(f"layer must be an int, got {type(layer).__name__}")
            if not 0 <= layer < pool.shape[1]:
                raise OutOfRange(f"layer {layer} outside [0, {pool.shape[1]})")
            shape = (self.num_tokens, pool.shape[4], pool.shape[5])
            self._check_tensor("k", k, shape)
            self._check_tensor("v", v, shape)
        if not self.num_tokens:
            return
        views, index = self._write_targets()
        if views is None:
            pool_views = _views(self.client)
            rows, _chunks, k, v = pool_views.select(k, v)
            views = pool_views.layer_views(rows)
        views[2 * layer].index_copy_(0, index, k)
        views[2 * layer + 1].index_copy_(0, index, v)

    def write_all(self, kv: torch.Tensor) -> None:
        """Write every layer at once: ``kv`` is ``[num_layers, 2, T, num_heads,
        head_dim]`` (one copy kernel). Same checks as :meth:`write`."""
        self._ready()
        cfg, pool = self.client.config, self.client.pool
        self._check_tensor(
            "kv", kv, (cfg.num_layers, 2, self.num_tokens, pool.shape[4], pool.shape[5])
        )
        if not self.num_tokens:
            return
        rows, _chunks, src = _views(self.client).select(kv.view(-1, *kv.shape[3:]))
        rows.index_copy_(0, self._layer_rows().view(-1), src)

    def commit(self) -> int:
        """Declare every sequence's first ``seq_lens`` tokens written by this client
        (its rank under tensor parallelism), in one round trip. Full blocks with known
        token ids are published once every rank has committed them. Returns the number
        of blocks published by this call.

        The commit says where each sequence's writes began (the step's first position,
        ``handle.commit(start=)``): a step that writes from the settled hit of an
        allocation answered early whose promotion came up short publishes what it wrote
        (``shmkv.coordinator.prefix``, early answers)."""
        client = self.client
        client.check()
        args = dict(
            ids=self._ids.astype("<i8").tobytes(),
            num_tokens=(self._starts + self._counts).astype("<i8").tobytes(),
            tp_rank=client.tp_rank,
        )
        if "commit_starts" in client.features:  # (an older coordinator refuses the argument)
            args["starts"] = self._starts.astype("<i8").tobytes()
        return client.request("commit_batch", **args)

    # -- descriptors -------------------------------------------------------------------------

    def descriptor(self) -> bytes:
        """A few bytes from which another process attached to the same coordinator
        rebuilds this step (``client.step_from``), with no round trip."""
        header = _DESC_HEADER.pack(
            _DESC_MAGIC,
            _DESC_VERSION,
            self._uniform,
            bytes.fromhex(self.client.instance),
            len(self._ids),
        )
        return (
            header
            + np.stack([self._ids, self._slots, self._starts, self._counts]).astype("<i8").tobytes()
        )

    @classmethod
    def from_descriptor(cls, client, data) -> "Step":
        if not isinstance(data, (bytes, bytearray)):
            raise WrongType(f"a step descriptor is bytes, got {type(data).__name__}")
        data = bytes(data)
        if len(data) < _DESC_HEADER.size:
            raise InvalidArgument("malformed step descriptor (too short)")
        magic, version, uniform, instance, num = _DESC_HEADER.unpack_from(data)
        if (
            magic != _DESC_MAGIC
            or version != _DESC_VERSION
            or len(data) != _DESC_HEADER.size + 32 * num
        ):
            raise InvalidArgument("malformed step descriptor")
        if instance.hex() != client.instance:
            raise InvalidArgument(
                "this step descriptor was made against another coordinator "
                f"than the one at {client.address}"
            )
        body = _int64s(data[_DESC_HEADER.size :]).reshape(4, num)
        cache_ids, slot_ids, starts, counts = (np.ascontiguousarray(row) for row in body)
        memory = client._memory
        most = client.config.max_seq_len
        if num and (
            int(slot_ids.min()) < 0
            or int(slot_ids.max()) >= memory.layout.max_sequences
            or int(starts.min()) < 0
            or int(counts.min()) < 0
            or int(starts.max()) > most
            or int(counts.max()) > most
        ):
            raise InvalidArgument("malformed step descriptor (values out of range)")
        if uniform < -1 or (uniform >= 0 and num and not bool((counts == uniform).all())):
            raise InvalidArgument(
                "malformed step descriptor (its uniform count disagrees with its counts)"
            )
        step = cls(client, cache_ids, slot_ids, starts, counts, uniform, memory.epoch[0])
        step._verify_owners()
        return step

    def __repr__(self) -> str:
        return f"<shmkv.Step {len(self._ids)} sequences, {self.num_tokens} new tokens>"


__all__: List[str] = ["Batch", "Step"]
