"""KV cache handles: a reference to one sequence whose block table resolves into the pool.

Owns :class:`KvCacheHandle` (the Python form of the seed's ``KvCacheHandle``
trait), :class:`BlockTable` and :class:`CacheHandleStats`, the data plane (writing
K/V into the slots the block table names and gathering it back, in place, with no
round trip) and the pickling of handles through the hand-off path.

Metadata changes (extend, clone, fork, export, close) are one round trip each to
the coordinator, which is the only writer of block metadata. A handle's length and
block table are read from the shared tables (``shmkv.memory.tables``) with no round trip,
so they are current whichever process changed them. Before writing, a handle checks
the shared ``owner`` array: a block this sequence may not write in place (shared
with a fork or a prefix hit, or published) first gets a private copy through the
coordinator (copy-on-write). Position arithmetic is in ``shmkv.client.slots``; a batch of
handles stepping together is ``shmkv.client.batch``.

Does not import ``shmkv.client.client``: a handle reaches its client through the object it
was made with, and unpickling goes through the client module's own function.

Over 1,100 lines, and :class:`KvCacheHandle` over 700, on purpose: the handle is the
object a worker holds, its 37 public methods are the per-sequence API (each with the
docstring a user reads: about a quarter of the class), and they all act on one
sequence's state; split into parts it would be the chain of base classes this tree
does without, or a facade repeating every method.
"""

from __future__ import annotations

import dataclasses
import struct
import time
import weakref
from operator import itemgetter
from typing import Any, List, Literal, Optional, Sequence, Tuple, overload

import torch

from shmkv import protocol
from shmkv.client import slots
from shmkv.coordinator.allocator import PROMOTING
from shmkv.coordinator.sequences import format_cache_id
from shmkv.errors import (
    HandleClosed,
    InvalidArgument,
    NotSettled,
    OutOfRange,
    ShmkvError,
    StaleStep,
    UnknownCache,
    WrongType,
)
from shmkv.memory.pool import storage_view
from shmkv.memory.tables import CACHE_ID, GENERATION, NUM_TOKENS, read_row

# Widest plain element types K/V rows are reinterpreted as for indexed copies: torch's
# CPU index_copy_ moves one element per step, so 16-byte elements make it 8x fewer
# steps than bf16 (close to memcpy speed). The bits are moved, never computed on.
_COPY_UNITS = ((16, torch.complex128), (8, torch.int64), (4, torch.int32), (2, torch.int16))
# Pool dtypes torch has no CPU ``index_copy_`` kernel for: when no wider unit fits, their
# rows are copied as the same-sized integer type (bits moved, never computed on).
_BYTE_UNITS = {torch.float8_e4m3fn: torch.uint8, torch.float8_e5m2: torch.uint8}
# A handle's descriptor (``KvCacheHandle.descriptor``, read back by ``Client.peek``):
# magic, version, the coordinator instance, cache id, slot.
_PEEK_MAGIC = b"SKVP"
_PEEK_VERSION = 1
_PEEK = struct.Struct("<4sBxxx8sqq")


def _fits(t: torch.Tensor, size: int) -> bool:
    """Whether ``t`` (last dim contiguous) can be viewed with ``size``-byte elements."""
    itemsize = t.element_size()
    return (
        size > itemsize
        and (t.shape[-1] * itemsize) % size == 0
        and t.data_ptr() % size == 0
        and (t.storage_offset() * itemsize) % size == 0
    )


class _PoolViews:
    """The views of one client's pool that the data plane indexes, made once per client.

    ``rows`` is the pool in storage order as ``[slots, heads, head_dim]``: one token slot
    of one layer's K or V per row (``shmkv.client.slots``). ``chunks`` is the same memory as
    ``[chunks, block_size, heads, head_dim]``: one block of one layer's K or V per chunk
    (contiguous when the client sees all heads), so a full block of a layer moves as one
    memcpy. ``unit_*`` are the same views in the
    widest copy unit that fits; ``plain`` is ``(rows, chunks, dtype)`` for copies no unit
    fits: the pool's own dtype (None), or bytes where torch cannot index-copy it.
    """

    __slots__ = (
        "pool",
        "rows",
        "chunks",
        "unit",
        "unit_dtype",
        "unit_rows",
        "unit_chunks",
        "plain",
        "_layers",
    )

    def __init__(self, pool: torch.Tensor):
        self.pool = pool
        self._layers: dict = {}  # a rows dtype -> layer_views of it
        heads, head_dim = pool.shape[4], pool.shape[5]
        storage = storage_view(pool)
        self.rows = storage.view(-1, heads, head_dim)
        self.chunks = storage.view(-1, pool.shape[3], heads, head_dim)
        self.unit, self.unit_dtype = 0, None
        self.unit_rows, self.unit_chunks = self.rows, self.chunks
        for size, dtype in _COPY_UNITS:
            if _fits(self.rows, size):
                self.unit, self.unit_dtype = size, dtype
                self.unit_rows, self.unit_chunks = self.rows.view(dtype), self.chunks.view(dtype)
                break
        byte = _BYTE_UNITS.get(pool.dtype)
        self.plain = (
            (self.rows, self.chunks, None)
            if byte is None
            else (self.rows.view(byte), self.chunks.view(byte), byte)
        )

    def layer_views(self, rows: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        """``rows`` (one of these row views) as ``2 * num_layers`` views, the one at
        ``2 * layer + which`` holding that layer's K or V rows, indexed by slot (a
        slot's layer-0 K row): made once per dtype, so that a write indexes them with
        the step's slot mapping as it is."""
        views = self._layers.get(rows.dtype)
        if views is None:
            views = self._layers[rows.dtype] = rows.view(
                2 * self.pool.shape[1], -1, *rows.shape[1:]
            ).unbind(0)
        return views

    def select(self, *tensors) -> tuple:
        """``(rows, chunks, *tensors)``, all in the copy unit when every tensor's offset
        fits it, else all in ``plain``'s dtype. The tensors end in the pool's last two
        dims, the last one contiguous."""
        unit = self.unit
        if unit:
            for t in tensors:
                if t.data_ptr() % unit or (t.storage_offset() * t.element_size()) % unit:
                    break
            else:
                dtype = self.unit_dtype
                return (self.unit_rows, self.unit_chunks, *[t.view(dtype) for t in tensors])
        rows, chunks, dtype = self.plain
        if dtype is None:
            return (rows, chunks, *tensors)
        return (rows, chunks, *[t.view(dtype) for t in tensors])


_VIEWS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _views(client) -> _PoolViews:
    views = _VIEWS.get(client)
    if views is None or views.pool is not client.pool:
        views = _VIEWS[client] = _PoolViews(client.pool)
    return views


def check_kv_tensor(
    pool: torch.Tensor, name: str, t, shape: Optional[tuple], shape_tail: tuple = (), what: str = ""
) -> int:
    """Check K/V handed to a write against the pool: a contiguous tensor of the pool's
    dtype and device, of exactly ``shape`` (or ``[n, *shape_tail]``). Returns its
    token count. Handles and steps share it, so both refuse bad input alike.

    Raises:
        WrongType: not a tensor.
        InvalidArgument: wrong dtype, device, shape, or not contiguous.
    """
    if not isinstance(t, torch.Tensor):
        raise WrongType(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != pool.dtype:
        raise InvalidArgument(
            f"{name} has dtype {t.dtype}, the pool holds {pool.dtype}; "
            f"convert with .to({pool.dtype})"
        )
    if t.device != pool.device:
        raise InvalidArgument(f"{name} is on {t.device}, the pool is on {pool.device}")
    if shape is not None:
        if tuple(t.shape) != shape:
            raise InvalidArgument(
                f"{name} has shape {tuple(t.shape)}, expected {list(shape)}{what}"
            )
    elif t.dim() != len(shape_tail) + 1 or tuple(t.shape[1:]) != shape_tail:
        raise InvalidArgument(
            f"{name} has shape {tuple(t.shape)}, expected [n, {', '.join(map(str, shape_tail))}]"
        )
    if not t.is_contiguous():
        raise InvalidArgument(f"{name} is not contiguous; pass {name}.contiguous()")
    return t.shape[0]


@dataclasses.dataclass(frozen=True)
class BlockTable:
    """The physical blocks of a sequence, in token order.

    ``physical_blocks[i]`` holds tokens ``[i * block_size, (i + 1) * block_size)``.
    """

    physical_blocks: Tuple[int, ...]
    block_size: int
    sequence_length: int

    def num_blocks(self) -> int:
        return len(self.physical_blocks)

    def free_tokens(self) -> int:
        """Slots left in the last block before another block is needed."""
        return len(self.physical_blocks) * self.block_size - self.sequence_length

    def to_tensor(self, device="cpu") -> torch.Tensor:
        """The table as an int32 tensor (what paged attention kernels take)."""
        return torch.tensor(self.physical_blocks, dtype=torch.int32, device=device)


class SequenceView:
    """A client's copy of one sequence's row of the shared tables, shared by all its
    handles on that sequence, with the index tensors built for its block table."""

    __slots__ = (
        "cache_id",
        "slot",
        "num_tokens",
        "generation",
        "blocks",
        "index_cache",
        "num_handles",
    )

    def __init__(self, cache_id: int, slot: int):
        self.cache_id = cache_id
        self.slot = slot
        self.num_tokens = 0
        self.generation = -1  # the table generation ``blocks`` were read at
        self.blocks: list = []
        self.index_cache: dict = {}  # position-to-row index tensors for ``blocks``
        self.num_handles = 0

    def refresh(self, memory, block_size: int, alive=None) -> "SequenceView":
        """Read the shared row again (no round trip; ``alive``: the client's ``check``,
        for a row left mid-change, ``shmkv.memory.tables``); returns self."""
        got = read_row(
            memory.seq,
            memory.table,
            memory.layout.max_seq_blocks,
            block_size,
            self.slot,
            self.cache_id,
            self.generation,
            len(self.blocks),
            alive,
        )
        return self._apply(got)

    def read(self, client) -> "SequenceView":
        """:meth:`refresh` where ``client`` may read the tables lock-free, else
        :meth:`refresh_asking`; returns self."""
        if not client.lock_free:
            return self.refresh_asking(client)
        return self.refresh(client._memory, client.config.block_size, client.check)

    def refresh_asking(self, client, owners: Optional[list] = None) -> "SequenceView":
        """:meth:`refresh` for a client that may not read the tables lock-free: the row
        comes from the coordinator (``shmkv.memory.tables``, memory ordering). ``owners``: a list
        that gets the owner of each of the row's blocks, read with it (left empty by a
        coordinator that does not send them)."""
        width = client._memory.layout.max_seq_blocks
        row_owner = None
        if owners is None:
            seq, table, _owner = client._rows([self.slot], width)
        else:
            seq, table, _owner, row_owner = client._rows([self.slot], width, row_owners=True)
        row = seq[0]
        got = None
        if int(row[CACHE_ID]) == self.cache_id:
            num_tokens = int(row[NUM_TOKENS])
            needed = -(-num_tokens // client.config.block_size)
            got = (num_tokens, int(row[GENERATION]), table[0, :needed].tolist())
            if owners is not None and row_owner is not None:
                owners += row_owner[0, :needed].tolist()
        return self._apply(got)

    def _apply(self, got) -> "SequenceView":
        if got is None:
            raise UnknownCache(f"{format_cache_id(self.cache_id)} no longer exists")
        self.num_tokens, generation, blocks = got
        if blocks is not None:
            if blocks != self.blocks[: len(blocks)] or len(blocks) < len(self.blocks):
                self.index_cache.clear()
            elif len(blocks) > len(self.blocks):  # appended: the whole-table index grows
                self.index_cache.pop("base", None)
            self.blocks = blocks
        self.generation = generation
        return self


class SequencePeek:
    """One sequence's block table as another process's handle holds it, read from the
    shared tables with no round trip and no reference of its own (:meth:`Client.peek`);
    ``block_table`` is the :class:`BlockTable` read then.

    The reader copies what it needs of the blocks, then calls :meth:`check`: the bytes it
    copied are the sequence's only if the sequence was still alive, holding the same
    blocks, after the copy (a cache id is never reused, so alive afterwards means alive
    throughout, and a live sequence's blocks are never handed to another). Meant for a
    prefix no holder writes any more (committed blocks); a holder's truncate and
    re-extend in place is not told apart.

    A sequence allocated with ``wait=False`` whose blocks a tier is still copying in is
    refused (``NotSettled``): its bytes are not there yet, and a peek cannot wait. Once a
    holder's ``settle()`` has returned, its first ``settle()`` tokens are readable; blocks
    past them hold what its holder writes.
    """

    __slots__ = ("_client", "_view", "block_table")

    def __init__(self, client, cache_id: int, slot: int):
        self._client = client
        self._view = SequenceView(cache_id, slot)
        view = self._read()
        bs = client.config.block_size
        self.block_table = BlockTable(
            tuple(view.blocks[: -(-view.num_tokens // bs)]), bs, view.num_tokens
        )

    def _read(self) -> SequenceView:
        """The sequence's row, read again; raises ``NotSettled`` when one of its blocks is
        still being promoted (``shmkv.coordinator.allocator.PROMOTING`` in the shared owner array,
        read after the row, or with it where the row comes from the coordinator)."""
        client = self._client
        if client.lock_free:
            view = self._view.read(client)
            owner = client.owner
            coming = sum(owner[b] == PROMOTING for b in view.blocks)
        else:
            owners: list = []
            view = self._view.refresh_asking(client, owners)
            coming = owners.count(PROMOTING)
        if coming:
            raise NotSettled(
                f"{self.cache_id} was answered before its tier blocks were in "
                f"(allocate(..., wait=False)): {coming} of its blocks are still being "
                "copied in. A holder's settle() waits for them; peek after that"
            )
        return view

    @classmethod
    def from_descriptor(cls, client, data) -> "SequencePeek":
        """:meth:`Client.peek`'s reading of ``data`` (see there for the errors)."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise WrongType(f"a sequence descriptor is bytes, got {type(data).__name__}")
        data = bytes(data)
        if len(data) != _PEEK.size:
            raise InvalidArgument(
                f"malformed sequence descriptor ({len(data)} bytes, not {_PEEK.size})"
            )
        magic, version, instance, cache_id, slot = _PEEK.unpack(data)
        if magic != _PEEK_MAGIC or version != _PEEK_VERSION:
            raise InvalidArgument("malformed sequence descriptor")
        if instance.hex() != client.instance:
            raise InvalidArgument(
                "this sequence descriptor was made against another coordinator "
                f"than the one at {client.address}"
            )
        if not 0 <= slot < client._memory.layout.max_sequences or cache_id <= 0:
            raise InvalidArgument("malformed sequence descriptor (values out of range)")
        return cls(client, cache_id, slot)

    @property
    def cache_id(self) -> str:
        """The sequence's id (as :attr:`KvCacheHandle.cache_id` gives it)."""
        return format_cache_id(self._view.cache_id)

    @property
    def client(self) -> Any:
        """The client that peeked (its pool holds the blocks)."""
        return self._client

    def check(self) -> None:
        """Raise unless the sequence is still alive with the blocks ``block_table``
        names (no round trip on x86).

        Raises:
            UnknownCache: the sequence was closed (its blocks may have been reused).
            StaleStep: its blocks changed since the peek.
            NotSettled: a tier is still copying some of its blocks in.
            CoordinatorGone: this client's coordinator is gone (a device pool's memory
                went with it).
        """
        self._client.check()
        self._view.generation = -1  # (read the whole row again)
        view = self._read()
        blocks = self.block_table.physical_blocks
        if tuple(view.blocks[: len(blocks)]) != blocks:
            raise StaleStep(f"the blocks of {self.cache_id} changed since they were peeked")

    def __repr__(self) -> str:
        return f"<shmkv.SequencePeek {self.cache_id} {self.block_table.sequence_length} tokens>"


@dataclasses.dataclass(frozen=True)
class CacheHandleStats:
    """What one handle's view of a sequence holds."""

    memory_bytes: int
    blocks_allocated: int
    tokens_stored: int
    utilization: float
    last_access: float


class KvCacheHandle:
    """A reference to one cached sequence in a shared pool.

    Made by :meth:`Client.allocate`, :meth:`Client.open`, :meth:`clone_handle`,
    :meth:`fork`, :meth:`with_sequence_length`, or by unpickling. The sequence lives
    while any reference to it exists, in any process; :meth:`close` drops this one
    (also on ``with`` exit, and when the client's connection closes).
    """

    # Plain slots: a scheduler makes and drops hundreds of handles a step.
    __slots__ = (
        "_client",
        "_cache_id",
        "_slot",
        "_num_cached",
        "_promoting",
        "_fetching",
        "_resident",
        "_request_id",
        "_view_len",
        "_closed",
        "_last_access",
        "_shared",
        "__weakref__",
    )

    def __init__(
        self,
        client,
        cache_id: int,
        slot: int,
        num_cached: int = 0,
        request_id: Optional[str] = None,
        view_len: Optional[int] = None,
    ):
        self._client = client
        self._cache_id = cache_id
        self._slot = slot
        self._num_cached = num_cached
        self._promoting = self._fetching = 0
        self._resident = num_cached
        self._request_id = request_id
        self._view_len = view_len
        self._closed = False
        self._last_access = time.time()
        self._shared: Optional[SequenceView] = None
        client._handles.add(self)

    @classmethod
    def _many(
        cls, client, cache_ids: Sequence[int], slot_ids: Sequence[int]
    ) -> List["KvCacheHandle"]:
        """Handles on new plain sequences (``allocate_many`` of lengths): the fields of
        :meth:`__init__`, set without a call per handle."""
        now, new = time.time(), object.__new__
        handles: List[KvCacheHandle] = []
        append = handles.append
        for cache_id, slot in zip(cache_ids, slot_ids):
            h = new(cls)
            h._client, h._cache_id, h._slot, h._num_cached = client, cache_id, slot, 0
            h._promoting = h._fetching = h._resident = 0
            h._request_id = h._view_len = h._shared = None
            h._closed, h._last_access = False, now
            append(h)
        client._handles.update(handles)
        return handles

    @property
    def _state(self) -> SequenceView:
        """The view of the sequence's shared row that this client's handles on it share,
        made on first use (a scheduler admitting many sequences may never need it)."""
        state = self._shared
        if state is None:
            state = self._shared = self._client._sequence_view(self._cache_id, self._slot)
        return state

    @classmethod
    def _from_info(cls, client, info: dict, view_len: Optional[int] = None) -> "KvCacheHandle":
        handle = cls(
            client,
            info["cache_id"],
            info["slot"],
            info["num_cached"],
            info.get("request_id"),
            view_len,
        )
        promoting = info.get("promoting")
        if promoting:  # an early answer (``allocate(..., wait=False)``)
            bs = client.config.block_size
            handle._promoting = promoting * bs
            handle._fetching = info.get("fetching", 0) * bs
            handle._resident = info.get("promoting_from", 0) * bs
        return handle

    def _view(self) -> SequenceView:
        """The sequence's current row (read from the shared tables)."""
        return self._state.read(self._client)

    @property
    def _blocks(self) -> list:
        return self._view().blocks

    @property
    def _seq_len(self) -> int:
        return self._view().num_tokens

    @property
    def _index_cache(self) -> dict:
        return self._state.index_cache

    def _live(self) -> None:
        if self._closed:
            raise HandleClosed(f"handle on {self.cache_id} is closed")

    # -- identity and shape ----------------------------------------------------------------

    @property
    def cache_id(self) -> str:
        """Unique id of the sequence (shared by clones, not by forks)."""
        return format_cache_id(self._cache_id)

    def request_cache_id(self) -> str:
        """The request id given at allocate (defaults to the cache id)."""
        return self._request_id if self._request_id is not None else self.cache_id

    @property
    def num_tokens(self) -> int:
        """Token slots this handle sees (reserved by extend/allocate, or its fixed view).

        Raises:
            HandleClosed: the handle is closed (its blocks may belong to another
                sequence by now).
        """
        self._live()
        return self._seq_len if self._view_len is None else self._view_len

    @property
    def num_cached_tokens(self) -> int:
        """Tokens reused from the prefix cache when the sequence was allocated."""
        self._live()
        return self._num_cached

    @property
    def num_promoting_tokens(self) -> int:
        """Of :attr:`num_cached_tokens`, those a tier was still copying into the pool when
        the allocation was answered (``allocate(..., wait=False)``), or when this handle
        was made on such a sequence (a clone, a fixed-length view, a handle opened from a
        hand-off); 0 once :meth:`settle` returned. Do not read them before."""
        self._live()
        return self._promoting

    @property
    def num_resident_tokens(self) -> int:
        """The leading cached tokens whose blocks are in the pool now, readable at once:
        :attr:`num_cached_tokens` but for an allocation answered early, whose promoted
        blocks (and any pool hits after them) count from :meth:`settle` on."""
        self._live()
        return self._resident

    @property
    def num_fetching_tokens(self) -> int:
        """Of :attr:`num_promoting_tokens`, the last ones, which are asked of the shared
        store (``RedisTier``): the coordinator cannot know whether it has them until it
        answers, so :meth:`settle` may well return fewer. The others are on this host
        (host or disk tier) and fail only on a damaged file."""
        self._live()
        return self._fetching

    def settle(self) -> int:
        """Wait until the tier blocks of an allocation answered early (``wait=False``)
        are in the pool; returns :attr:`num_cached_tokens`, which is shorter than the
        early answer said when a block did not arrive (a damaged file, a lost store
        entry). Any handle on the sequence may wait (one opened from a hand-off of it,
        too); answered at once when nothing is coming. One round trip, bounded by the
        client's timeout; the connection's other requests wait behind it."""
        self._check_open()
        if "settle" not in self._client.features:  # an older coordinator: nothing comes
            return self._num_cached
        got = self._client.request("settle", cache_id=self._cache_id)
        self._num_cached = self._resident = got["num_cached"]
        self._promoting = self._fetching = 0
        return self._num_cached

    @property
    def num_layers(self) -> int:
        return self._client.config.num_layers

    @property
    def num_heads(self) -> int:
        """KV heads this handle sees (its rank's shard under tensor parallelism)."""
        return self._client.pool.shape[4]

    @property
    def head_dim(self) -> int:
        return self._client.config.head_dim

    @property
    def dtype(self) -> torch.dtype:
        return self._client.pool.dtype

    @property
    def device(self) -> torch.device:
        return self._client.pool.device

    @property
    def block_table(self) -> BlockTable:
        """The sequence's current blocks (read from the shared tables, no round trip).

        Raises:
            HandleClosed: the handle is closed.
        """
        self._live()
        view = self._view()
        n = view.num_tokens if self._view_len is None else self._view_len
        bs = self._client.config.block_size
        return BlockTable(tuple(view.blocks[: -(-n // bs)]), bs, n)

    def stats(self) -> CacheHandleStats:
        """What this handle's view holds. Raises ``HandleClosed`` once closed."""
        self._live()
        pool = self._client.pool
        blocks = -(-self.num_tokens // self._client.config.block_size)
        per_block = pool[0].numel() * pool.element_size()
        capacity = blocks * self._client.config.block_size
        return CacheHandleStats(
            memory_bytes=blocks * per_block,
            blocks_allocated=blocks,
            tokens_stored=self.num_tokens,
            utilization=self.num_tokens / capacity if capacity else 0.0,
            last_access=self._last_access,
        )

    @property
    def client(self) -> Any:
        """The :class:`~shmkv.client.client.Client` this handle was made by (its requests go
        through it; typed loosely here, as ``shmkv.client.client`` imports this module)."""
        return self._client

    def is_valid(self) -> bool:
        """True while this reference is open and its coordinator is alive (no round trip)."""
        return not self._closed and self._client.is_alive()

    def _check_open(self) -> SequenceView:
        """Raise unless usable; returns the sequence's current row."""
        if self._closed:
            raise HandleClosed(f"handle on {self.cache_id} is closed")
        self._client.check()
        return self._view()

    # -- metadata (one round trip each) ----------------------------------------------------

    def refresh(self) -> None:
        """Read the sequence's current length and block table again. Reads are always
        current (the tables are shared), so this only checks the handle is usable."""
        self._check_open()

    def extend(self, num_tokens: int, tokens=None) -> int:
        """Reserve ``num_tokens`` more slots at the end; returns the first new position.

        ``tokens`` (their token ids) keep the sequence's prefix keys going, so blocks
        filled during decode can be reused too. A shared, partly filled last block
        gets a private copy first (copy-on-write).

        Raises:
            PoolExhausted: not enough blocks (nothing changed).
        """
        if self._view_len is not None:
            raise InvalidArgument(
                "this handle views a fixed length (with_sequence_length); "
                "extend a handle on the whole sequence"
            )
        return self._client.extend_many([(self, num_tokens, tokens)])[0]

    def truncate(self, num_tokens: int) -> int:
        """Shorten the sequence to its first ``num_tokens`` tokens: the slots past them
        are given back (reserved and never written, or draft tokens rejected) and the
        blocks past the new end are released. Returns the number of blocks released.

        Raises:
            OutOfRange: the sequence holds fewer than ``num_tokens`` (nothing changed).
            InvalidArgument: the sequence has another reference (a clone, a view, an
                export), which could read past the new end (nothing changed).
        """
        self._check_open()
        if self._view_len is not None:
            raise InvalidArgument(
                "this handle views a fixed length (with_sequence_length); "
                "truncate a handle on the whole sequence"
            )
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int):
            raise WrongType(f"num_tokens must be an int, got {type(num_tokens).__name__}")
        seq_len = self._seq_len
        if not 0 <= num_tokens <= seq_len:
            raise OutOfRange(
                f"truncate of {self.cache_id} to {num_tokens} tokens: it holds {seq_len} "
                "(a truncate only shortens)"
            )
        return self._client.request(
            "truncate_batch",
            ids=protocol.pack_i64s([self._cache_id]),
            num_tokens=protocol.pack_i64s([num_tokens]),
        )

    @overload
    def commit(
        self,
        num_tokens: Optional[int] = None,
        wait: Literal[True] = True,
        start: Optional[int] = None,
    ) -> int: ...

    @overload
    def commit(
        self,
        num_tokens: Optional[int] = None,
        *,
        wait: Literal[False],
        start: Optional[int] = None,
    ) -> None: ...

    @overload
    def commit(
        self, num_tokens: Optional[int], wait: Literal[False], start: Optional[int] = None
    ) -> None: ...

    def commit(
        self, num_tokens: Optional[int] = None, wait: bool = True, start: Optional[int] = None
    ) -> Optional[int]:
        """Declare the first ``num_tokens`` (default: all) slots fully written by this
        client (its rank, under tensor parallelism). Full blocks with known token ids
        become prefix-cache hits for other requests once every rank has committed.
        Returns the number of leading blocks published.

        With ``wait=False`` the commit is sent and not waited for (a worker that has
        nothing to do with the answer): returns None; the coordinator serves it before
        this client's next request, and a refusal is kept for
        :meth:`~shmkv.client.client.Client.flush` and
        :meth:`~shmkv.client.client.Client.posted_errors`.

        ``start``: where this client's writes began. After an allocation answered early
        (``wait=False``) whose promotion came up short, nothing from the first block that
        did not arrive on is published until this client's commits say it wrote all it
        committed again from there: write from what :meth:`settle` returns, and pass it
        here; a write in chunks passes each chunk's start (a chunk counts when it starts
        within what the chunks before it wrote). Commits sent before the promotion has
        settled publish nothing until it has.
        """
        self._check_open()
        n = self.num_tokens if num_tokens is None else num_tokens
        args: dict = dict(cache_id=self._cache_id, num_tokens=n, tp_rank=self._client.tp_rank)
        if start is not None and "settle" in self._client.features:
            args["start"] = start
        if not wait:
            self._client._link.post("commit", **args)
            return None
        return self._client.request("commit", **args)

    def clone_handle(self) -> "KvCacheHandle":
        """A new reference to the same sequence (no copy). On a sequence allocated with
        ``wait=False`` whose tier blocks are still coming, the clone says so
        (:attr:`num_promoting_tokens`) and its :meth:`settle` waits for them."""
        self._check_open()
        return KvCacheHandle._from_info(
            self._client, self._client.request("clone", cache_id=self._cache_id), self._view_len
        )

    def fork(self) -> "KvCacheHandle":
        """A new sequence (new cache id) sharing every block; writes copy first.

        On a sequence allocated with ``wait=False`` whose tier blocks are still coming,
        the fork waits for them, as :meth:`settle` does (the connection's other requests
        wait behind it), and forks the settled sequence. A fork keeps what its parent
        may publish: after a promotion that came up short, nothing from the first block
        that did not arrive on until it is written again (``commit(start=)``)."""
        self._check_open()
        return KvCacheHandle._from_info(
            self._client, self._client.request("fork", cache_id=self._cache_id)
        )

    def with_sequence_length(self, num_tokens: int) -> "KvCacheHandle":
        """A new reference to the same sequence that views its first ``num_tokens`` (told
        of tier blocks still coming, as :meth:`clone_handle` is)."""
        seq_len = self._check_open().num_tokens
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int):
            raise WrongType(f"num_tokens must be an int, got {type(num_tokens).__name__}")
        if not 0 <= num_tokens <= seq_len:
            raise OutOfRange(f"with_sequence_length({num_tokens}) outside [0, {seq_len}]")
        return KvCacheHandle._from_info(
            self._client, self._client.request("clone", cache_id=self._cache_id), num_tokens
        )

    def export(self, ttl: float = 60.0, bound: bool = False) -> bytes:
        """A one-shot hand-off token; ``client.open(token)`` in any process of this user
        gives a new reference. The sequence stays alive until opened or ``ttl`` expires,
        even if this process exits, unless ``bound``: then an unopened token also goes
        when this client's connection closes (its process exited or was killed), for a
        token whose openers die with its maker (an engine's scheduler and its workers).
        A handle opened while tier blocks of an allocation answered early are still
        coming says so (:attr:`num_promoting_tokens`); its :meth:`settle` waits for them.

        Raises:
            ShmkvError: ``bound`` with a coordinator that predates it
                (``"bound_handoffs"`` not in ``client.features``).
        """
        self._check_open()
        if not bound:
            return self._client.request("export", cache_id=self._cache_id, ttl=ttl)
        if "bound_handoffs" not in self._client.features:
            raise ShmkvError(
                "this coordinator cannot bind a hand-off to its maker's connection (an "
                "older version: 'bound_handoffs' is not in client.features)"
            )
        return self._client.request("export", cache_id=self._cache_id, ttl=ttl, bound=True)

    def descriptor(self) -> bytes:
        """A few bytes from which another process attached to the same coordinator reads
        this sequence's block table with no round trip and no reference of its own
        (:meth:`Client.peek`), to copy blocks out while this reference (or another) keeps
        the sequence alive. Unlike :meth:`export`, it makes no request and holds nothing:
        a reader whose copy outlived the sequence finds out in
        :meth:`SequencePeek.check`. Gives no access a client lacks already (every client
        maps the whole pool). A peek refuses (``NotSettled``) while tier blocks of an
        allocation answered early are still coming: :meth:`settle` first.

        Raises:
            HandleClosed: the handle is closed.
        """
        self._live()
        return _PEEK.pack(
            _PEEK_MAGIC,
            _PEEK_VERSION,
            bytes.fromhex(self._client.instance),
            self._cache_id,
            self._slot,
        )

    def close(self) -> None:
        """Drop this reference. Idempotent; a no-op once the coordinator is gone."""
        if self._closed:
            return
        self._closed = True
        self._client._handles.discard(self)
        self._client._release_state(self)
        if self._client.is_alive():
            self._client.request("release", cache_id=self._cache_id)

    def __enter__(self) -> "KvCacheHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __reduce__(self):
        """Pickles through a hand-off token. The unpickled handle belongs to the
        receiving process's client of the same coordinator, with that client's
        tensor-parallel rank, never the sender's (see ``shmkv.client.client.open_pickled``)."""
        token = self.export(self._client.pickle_ttl)
        return (self._client.open_pickled, (self._client.address, token, self._view_len))

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self.num_tokens} tokens"
        return f"<KvCacheHandle {self.cache_id} {state}>"

    # -- data plane (no round trip) --------------------------------------------------------

    def _check_layer(self, layer) -> int:
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise WrongType(f"layer must be an int, got {type(layer).__name__}")
        if not 0 <= layer < self.num_layers:
            raise OutOfRange(f"layer {layer} outside [0, {self.num_layers})")
        return layer

    def _check_tensor(self, name: str, t, shape_tail: tuple) -> int:
        return check_kv_tensor(self._client.pool, name, t, None, shape_tail)

    def _check_range(self, view: SequenceView, start, n: int) -> int:
        limit = view.num_tokens if self._view_len is None else self._view_len
        if start is None:  # the last n slots this handle sees
            start = limit - n
        if isinstance(start, bool) or not isinstance(start, int):
            raise WrongType(f"start must be an int, got {type(start).__name__}")
        if start < 0 or start + n > limit:
            raise OutOfRange(
                f"write of {n} tokens at {start} goes past the {limit} slots "
                f"reserved in {self.cache_id}; extend first"
            )
        return start

    def _ensure_writable(self, view: SequenceView, start: int, n: int) -> SequenceView:
        """Make the blocks of ``[start, start + n)`` writable in place; returns the row
        to write through (copy-on-write may have replaced blocks)."""
        bs = self._client.config.block_size
        owner, cid = self._client.owner, self._cache_id
        blocks = view.blocks[start // bs : (start + n - 1) // bs + 1]
        if len(blocks) == 1:
            writable = owner[blocks[0]] == cid
        else:  # one C-level pass over the shared owner array, not a Python loop per block
            writable = itemgetter(*blocks)(owner).count(cid) == len(blocks)
        if not writable:
            self._client.request("prepare_write", cache_id=cid, start=start, num_tokens=n)
            view = self._view()
        return view

    def _base(self) -> torch.Tensor:
        """Row of layer 0's K slot, in the pool's ``rows`` view, of every position the
        table covers: ``[num_blocks * block_size]``. Cached per table, so a growing
        sequence rebuilds it once per new block, not once per step."""
        base = self._index_cache.get("base")
        if base is None:
            cfg = self._client.config
            base = slots.position_rows(self._state.blocks, cfg.block_size, self.device)
            self._cache_index("base", base)
        return base

    def _layer_rows(self, start: int, n: int, layer: int, which: int) -> torch.Tensor:
        """Rows of positions ``[start, start + n)`` of one layer's K (0) or V (1)."""
        cfg = self._client.config
        return self._base()[start : start + n] + slots.layer_row(
            layer, which, cfg.num_blocks, cfg.block_size
        )

    def _rows(self, start: int, n: int) -> torch.Tensor:
        """Rows of positions ``[start, start + n)`` in the pool's ``rows`` view:
        ``[2 * num_layers, n]``, row ``2 * layer + (0 for K, 1 for V)``."""
        cfg = self._client.config
        return slots.all_layer_rows(
            self._base()[start : start + n], cfg.num_layers, cfg.num_blocks, cfg.block_size
        )

    def _spans(self, start: int, n: int) -> tuple:
        """``slots.spans`` of ``[start, start + n)`` for this table, cached per table."""
        key = ("spans", start, n)
        found = self._index_cache.get(key)
        if found is None:
            cfg = self._client.config
            found = slots.spans(
                self._state.blocks,
                cfg.block_size,
                cfg.num_layers,
                cfg.num_blocks,
                start,
                n,
                self.device,
            )
            self._cache_index(key, found)
        return found

    def _cache_index(self, key, value) -> None:
        cache = self._index_cache
        if len(cache) > 8:  # per-range entries come and go; the table's base stays
            base = cache.get("base")
            cache.clear()
            if base is not None:
                cache["base"] = base
        cache[key] = value

    def _check_out(self, out, shape: tuple) -> None:
        if not isinstance(out, torch.Tensor):
            raise WrongType(f"out must be a torch.Tensor, got {type(out).__name__}")
        pool = self._client.pool
        if out.dtype != pool.dtype or out.device != pool.device:
            raise InvalidArgument(
                f"out is {out.dtype} on {out.device}, the pool holds {pool.dtype} on {pool.device}"
            )
        if tuple(out.shape) != shape:
            raise InvalidArgument(f"out has shape {tuple(out.shape)}, expected {list(shape)}")
        if not out.is_contiguous():
            raise InvalidArgument("out is not contiguous")

    def write(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, start: Optional[int] = None
    ) -> None:
        """Write K and V (each ``[n, num_heads, head_dim]``) of one layer at positions
        ``[start, start + n)``; ``start`` defaults to the last ``n`` reserved slots.

        In place, no round trip (one round trip first only when a block is shared).

        Raises:
            OutOfRange: bad layer, or positions past the reserved slots.
            InvalidArgument / WrongType: wrong dtype, device, shape, or a non-contiguous
                tensor. Nothing is written in any of these cases.
        """
        view = self._check_open()
        layer = self._check_layer(layer)
        tail = (self.num_heads, self.head_dim)
        n = self._check_tensor("k", k, tail)
        if self._check_tensor("v", v, tail) != n:
            raise InvalidArgument(f"k has {n} tokens, v has {v.shape[0]}")
        start = self._check_range(view, start, n)
        if n == 0:
            return
        view = self._ensure_writable(view, start, n)
        self._last_access = time.time()
        cfg = self._client.config
        bs = cfg.block_size
        if start // bs == (start + n - 1) // bs:  # one block: two slice copies
            slot = view.blocks[start // bs] * bs + start % bs
            rows = _views(self._client).rows
            rows.narrow(0, slot + slots.layer_row(layer, 0, cfg.num_blocks, bs), n).copy_(k)
            rows.narrow(0, slot + slots.layer_row(layer, 1, cfg.num_blocks, bs), n).copy_(v)
            return
        (head_row, head_len), (middle, middle_rows), (tail_row, tail_len) = self._spans(start, n)
        rows, chunks, k, v = _views(self._client).select(k, v)
        for which, src in ((0, k), (1, v)):
            offset = slots.layer_row(layer, which, cfg.num_blocks, bs)
            if head_len:
                rows.narrow(0, head_row + offset, head_len).copy_(src[:head_len])
            if middle is not None:
                full = middle.shape[1]
                whole = src[head_len : head_len + full * bs] if head_len or tail_len else src
                chunks.index_copy_(
                    0, middle_rows[2 * layer + which], whole.view(full, bs, *src.shape[1:])
                )
            if tail_len:
                rows.narrow(0, tail_row + offset, tail_len).copy_(src[n - tail_len :])

    def write_all(self, kv: torch.Tensor, start: Optional[int] = None) -> None:
        """Write every layer at once: ``kv`` is ``[num_layers, 2, n, num_heads, head_dim]``
        (one copy kernel for the whole step). Same checks as :meth:`write`."""
        view = self._check_open()
        if not isinstance(kv, torch.Tensor) or kv.dim() != 5:
            raise InvalidArgument("kv must be a tensor [num_layers, 2, n, num_heads, head_dim]")
        if tuple(kv.shape[:2]) != (self.num_layers, 2):
            raise InvalidArgument(
                f"kv has shape {tuple(kv.shape)}, expected "
                f"[{self.num_layers}, 2, n, {self.num_heads}, {self.head_dim}]"
            )
        n = kv.shape[2]
        if not kv.is_contiguous():
            raise InvalidArgument("kv is not contiguous; pass kv.contiguous()")
        flat_kv = kv.view(-1, *kv.shape[3:])
        self._check_tensor("kv", flat_kv, (self.num_heads, self.head_dim))
        start = self._check_range(view, start, n)
        if n == 0:
            return
        self._ensure_writable(view, start, n)
        self._last_access = time.time()
        rows, chunks, src = _views(self._client).select(flat_kv)
        (_, head_len), (middle, _), (_, tail_len) = self._spans(start, n)
        if not head_len and not tail_len:  # whole blocks: one memcpy per block and layer
            bs = self._client.config.block_size
            chunks.index_copy_(0, middle.view(-1), src.view(-1, bs, *src.shape[1:]))
        else:
            rows.index_copy_(0, self._rows(start, n).view(-1), src)

    def _gather(self, layer: int, which: int, out: Optional[torch.Tensor]) -> torch.Tensor:
        view = self._check_open()
        layer = self._check_layer(layer)
        n = view.num_tokens if self._view_len is None else self._view_len
        shape = (n, self.num_heads, self.head_dim)
        if out is not None:
            self._check_out(out, shape)
        self._last_access = time.time()
        bs = self._client.config.block_size
        if n <= bs:
            if not n:
                return out if out is not None else self._client.pool.new_empty(shape)
            block = self._client.pool[self._state.blocks[0], layer, which, :n]
            return out.copy_(block) if out is not None else block.clone()
        views = _views(self._client)  # index_select copies whole rows: no copy unit needed
        if out is None:  # into fresh pages, token rows copy faster than whole blocks
            return views.rows.index_select(0, self._layer_rows(0, n, layer, which))
        _, (middle, middle_rows), (tail_row, tail_len) = self._spans(0, n)
        full = middle.shape[1]
        dst = out[: full * bs] if tail_len else out
        torch.index_select(
            views.chunks, 0, middle_rows[2 * layer + which], out=dst.view(full, bs, *out.shape[1:])
        )
        if tail_len:
            out[n - tail_len :].copy_(
                views.rows.narrow(
                    0,
                    tail_row + slots.layer_row(layer, which, self._client.config.num_blocks, bs),
                    tail_len,
                )
            )
        return out

    def key_cache(self, layer: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """K of one layer, gathered: ``[num_tokens, num_heads, head_dim]`` (a copy).

        ``out``: a contiguous tensor of that shape, dtype and device to gather into
        (a buffer reused across steps saves allocating and first-touching new memory).
        """
        return self._gather(layer, 0, out)

    def value_cache(self, layer: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """V of one layer, gathered: ``[num_tokens, num_heads, head_dim]`` (a copy);
        ``out`` as in :meth:`key_cache`."""
        return self._gather(layer, 1, out)

    def kv_cache(self, layer: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(key_cache(layer), value_cache(layer))``."""
        return self._gather(layer, 0, None), self._gather(layer, 1, None)

    def gather_all(self, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Every layer's K and V: ``[num_layers, 2, num_tokens, num_heads, head_dim]``,
        gathered with one copy kernel.

        ``out``: a contiguous tensor of that shape, dtype and device to gather into
        (a buffer reused across steps saves allocating and first-touching new memory).
        """
        view = self._check_open()
        n = view.num_tokens if self._view_len is None else self._view_len
        shape = (self.num_layers, 2, n, self.num_heads, self.head_dim)
        if out is not None:
            self._check_out(out, shape)
        self._last_access = time.time()
        if n == 0:
            return out if out is not None else self._client.pool.new_empty(shape)
        views = _views(self._client)  # index_select copies whole rows: no copy unit needed
        if out is None:  # into fresh pages, token rows copy faster than whole blocks
            return views.rows.index_select(0, self._rows(0, n).view(-1)).view(shape)
        _, (middle, _), (_, tail_len) = self._spans(0, n)
        if not tail_len:  # whole blocks: one memcpy per block and layer
            bs = self._client.config.block_size
            torch.index_select(views.chunks, 0, middle.view(-1), out=out.view(-1, bs, *shape[3:]))
        else:
            torch.index_select(
                views.rows, 0, self._rows(0, n).view(-1), out=out.view(-1, *shape[3:])
            )
        return out

    def paged_kv(self, layer: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Zero-copy ``(k_pages, v_pages, block_table)`` for paged attention kernels.

        ``k_pages`` and ``v_pages`` are ``[num_blocks, block_size, num_heads, head_dim]``
        views of the whole pool (contiguous when the client sees every head: the pool is
        stored layer-major); ``block_table`` is int32
        on the pool's device. Writes through the views bypass copy-on-write.
        """
        self._check_open()
        layer = self._check_layer(layer)
        pool = self._client.pool
        return pool[:, layer, 0], pool[:, layer, 1], self.block_table.to_tensor(pool.device)
