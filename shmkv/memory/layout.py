"""Pool configuration and memory layout.

Owns :class:`PoolConfig` (what a user asks for), its validation, the pool's shape and
storage order, byte sizes, and the layout fingerprint that a client checks at attach.
Does not allocate memory (see ``shmkv.memory.shm`` and ``shmkv.memory.cuda``) and does not import
torch at module import time: dtypes are carried by name, and torch is imported
only when a caller asks for a ``torch.dtype``.

Layout (one allocation per device). Indexed by block first, stored layer-major::

    pool (what every process indexes):
          [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
    storage order (``storage_shape``; the pool is a permuted view of it):
          [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    K of layer l: pool[:, l, 0]   V of layer l: pool[:, l, 1]   (each contiguous)

A layer's K (or V) is one contiguous run of pages, so a decode step that reads a
layer's pages of consecutive blocks reads consecutive memory. One block is ``2 *
num_layers`` chunks of ``block_size * heads * head_dim`` elements, ``num_blocks``
chunks apart; a block's bytes, as the tiers, remote stores and transfers carry them,
are always in the order ``[num_layers, 2, block_size, heads, head_dim]`` (see
:meth:`PoolConfig.block_fingerprint`).
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import TYPE_CHECKING, Any, Iterable, Optional, Sequence

from shmkv.errors import InvalidArgument, WrongType

if TYPE_CHECKING:  # (annotations only: torch_dtype alone imports torch, when called)
    import torch

LAYOUT_VERSION = 2  # 1: stored block-major; 2: stored layer-major
BLOCK_FORMAT_VERSION = 1  # the order of one block's bytes when copied out of the pool
DEFAULT_MAX_SEQ_LEN = 32768
MAX_SEQUENCES = 1 << 20
MAX_TABLE_BYTES = 1 << 30

# name -> bytes per element. The names are torch's attribute names. The 1-byte types
# are quantized pools: their bytes are stored exactly, and the scale that turns them
# back into values is the caller's (``Client.set_kv_scales`` keeps one per layer).
DTYPE_SIZES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float64": 8,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
}
QUANTIZED_DTYPES = frozenset({"float8_e4m3fn", "float8_e5m2", "int8"})
_DTYPE_ALIASES = {
    "half": "float16",
    "float": "float32",
    "double": "float64",
    "fp16": "float16",
    "bf16": "bfloat16",
    "fp32": "float32",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "float8": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}


def dtype_name(dtype: Any) -> str:
    """Return the canonical name of a dtype given as a string or a ``torch.dtype``."""
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
        name = _DTYPE_ALIASES.get(name, name)
    else:
        name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_SIZES:
        raise InvalidArgument(
            f"unsupported dtype {dtype!r}: use one of {', '.join(sorted(DTYPE_SIZES))}"
        )
    return name


def torch_dtype(name: str) -> torch.dtype:
    """Return the ``torch.dtype`` for a canonical dtype name."""
    import torch

    return getattr(torch, name)


def _check_positive(field: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise WrongType(f"PoolConfig.{field} must be an int, got {type(value).__name__}")
    if value <= 0:
        raise InvalidArgument(f"PoolConfig.{field} must be positive, got {value}")


def normalize_device(device: Any) -> str:
    """Return ``"cpu"`` or ``"cuda:N"`` for a device given as a string or ``torch.device``."""
    text = str(device)
    if text == "cpu":
        return "cpu"
    if text == "cuda":
        return "cuda:0"
    if text.startswith("cuda:") and text[5:].isdigit():
        return text
    raise InvalidArgument(f"unsupported device {device!r}: use 'cpu' or 'cuda:N'")


@dataclasses.dataclass(frozen=True)
class PoolConfig:
    """Shape and placement of a KV block pool.

    Args:
        num_layers: transformer layers cached per block.
        num_kv_heads: key/value heads (all ranks together when ``tp_size > 1``).
        head_dim: elements per head.
        num_blocks: blocks in the pool.
        block_size: tokens per block.
        dtype: ``torch.float32``, ``torch.float16``, ``torch.bfloat16``, or a quantized
            type: ``torch.float8_e4m3fn``, ``torch.float8_e5m2``, ``torch.int8`` (or
            their names; ``"fp8"`` is e4m3). A quantized pool stores bytes exactly; the
            per-layer K/V scales live beside it (``Client.set_kv_scales``).
        device: ``"cpu"`` (POSIX shared memory) or ``"cuda:N"`` (CUDA IPC).
        tp_size: tensor-parallel ranks; each rank owns ``num_kv_heads // tp_size`` heads.
        devices: with ``tp_size > 1`` on CUDA, one device per rank.
        max_sequences: live sequences at once (the rows of the shared block tables).
        max_seq_len: tokens one sequence may hold (the columns of the shared block
            tables, in blocks: ``ceil(max_seq_len / block_size)``). Default: the whole
            pool, at most 32768 tokens. The tables cost ``4 * max_sequences *
            max_seq_blocks`` bytes of shared memory (``table_nbytes``).

    Raises:
        InvalidArgument / WrongType: for a nonsense value, before anything is allocated.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_blocks: int
    block_size: int = 16
    dtype: Any = "float16"
    device: Any = "cpu"
    tp_size: int = 1
    devices: Optional[Sequence[str]] = None
    max_sequences: int = 4096
    max_seq_len: Optional[int] = None

    def __post_init__(self) -> None:
        for field in (
            "num_layers",
            "num_kv_heads",
            "head_dim",
            "num_blocks",
            "block_size",
            "tp_size",
            "max_sequences",
        ):
            _check_positive(field, getattr(self, field))
        if self.max_seq_len is None:
            object.__setattr__(
                self, "max_seq_len", min(self.num_blocks * self.block_size, DEFAULT_MAX_SEQ_LEN)
            )
        _check_positive("max_seq_len", self.max_seq_len)
        if self.max_sequences > MAX_SEQUENCES:
            raise InvalidArgument(
                f"PoolConfig.max_sequences={self.max_sequences} is above "
                f"the supported {MAX_SEQUENCES}"
            )
        if self.table_nbytes > MAX_TABLE_BYTES:
            raise InvalidArgument(
                f"shared block tables of max_sequences={self.max_sequences} x "
                f"{self.max_seq_blocks} blocks (max_seq_len={self.max_seq_len}) would take "
                f"{self.table_nbytes / 2**20:.0f} MiB; lower max_sequences or max_seq_len"
            )
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        object.__setattr__(self, "device", normalize_device(self.device))
        if self.num_kv_heads % self.tp_size:
            raise InvalidArgument(
                f"num_kv_heads={self.num_kv_heads} is not divisible by tp_size={self.tp_size}"
            )
        if self.devices is not None:
            devices = tuple(normalize_device(d) for d in self.devices)
            if len(devices) != self.tp_size:
                raise InvalidArgument(
                    f"devices has {len(devices)} entries, tp_size={self.tp_size} needs one per rank"
                )
            if any(d == "cpu" for d in devices) != (self.device == "cpu"):
                raise InvalidArgument("devices and device must be all 'cpu' or all CUDA")
            object.__setattr__(self, "devices", devices)
        if self.num_blocks >= 2**31:
            raise InvalidArgument(f"num_blocks={self.num_blocks} does not fit int32 block tables")

    # -- derived sizes -------------------------------------------------------------------

    @property
    def heads_per_rank(self) -> int:
        return self.num_kv_heads // self.tp_size

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def shape(self) -> tuple:
        """Shape of the whole pool (all heads)."""
        return (
            self.num_blocks,
            self.num_layers,
            2,
            self.block_size,
            self.num_kv_heads,
            self.head_dim,
        )

    @property
    def storage_shape(self) -> tuple:
        """Shape of the pool's memory in storage order (layer-major): ``shape`` with the
        block axis moved after the layer and K/V axes."""
        return (
            self.num_layers,
            2,
            self.num_blocks,
            self.block_size,
            self.num_kv_heads,
            self.head_dim,
        )

    @property
    def chunk_nbytes(self) -> int:
        """Bytes of one layer's K (or V) of one block, all heads: one of the ``2 *
        num_layers`` contiguous pieces of a block."""
        return self.block_size * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block: all layers, K and V, all heads."""
        return (
            self.num_layers
            * 2
            * self.block_size
            * self.num_kv_heads
            * self.head_dim
            * self.itemsize
        )

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.block_nbytes

    @property
    def max_seq_blocks(self) -> int:
        """Entries of one sequence's shared block table."""
        max_seq_len = self.max_seq_len
        assert max_seq_len is not None  # set by __post_init__
        return -(-max_seq_len // self.block_size)

    @property
    def table_nbytes(self) -> int:
        """Shared memory the block tables take (besides the pool)."""
        return 4 * self.max_sequences * self.max_seq_blocks

    @property
    def is_cuda(self) -> bool:
        return self.device != "cpu"

    @property
    def is_quantized(self) -> bool:
        """A 1-byte pool (float8 or int8) whose values need the layer's K/V scales."""
        return self.dtype in QUANTIZED_DTYPES

    def rank_devices(self) -> tuple:
        """The device of each tensor-parallel rank's pool."""
        if self.devices is not None:
            return tuple(self.devices)
        return (self.device,) * (self.tp_size if self.is_cuda else 1)

    # -- wire form -------------------------------------------------------------------------

    def to_wire(self) -> dict:
        """A msgpack-able dict of this config (names and ints only)."""
        return {
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "dtype": self.dtype,
            "device": self.device,
            "tp_size": self.tp_size,
            "devices": list(self.devices) if self.devices is not None else None,
            "max_sequences": self.max_sequences,
            "max_seq_len": self.max_seq_len,
        }

    @classmethod
    def from_wire(cls, data: dict) -> "PoolConfig":
        """Rebuild a config sent by :meth:`to_wire`; validates like the constructor."""
        if not isinstance(data, dict):
            raise WrongType("pool descriptor must be a map")
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def fingerprint(self) -> str:
        """A hex digest of everything that decides where a byte lives in the pool."""
        text = repr(
            (
                LAYOUT_VERSION,
                self.shape,
                self.dtype,
                self.tp_size,
                "layer-major[num_layers,2,num_blocks,block_size,heads,head_dim]",
            )
        )
        return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()

    def block_fingerprint(self, scales: Optional[Iterable[float]] = None) -> str:
        """A hex digest of everything that decides what one block's bytes mean: the
        :meth:`fingerprint` less the pool's size and device, so pools of any size on any
        node can exchange blocks (``shmkv.tiers.redis_store``, ``shmkv.integrations.distributed``).

        ``scales``: a quantized pool's K/V scales, every layer's (``Client.set_kv_scales``
        order: k, v of layer 0, ...): its bytes mean values only with them, so the tiers
        that keep blocks past the pool (disk, Redis) name their blocks by them too, and
        blocks stored under some scales are never read under others. Ignored for pools
        that are not quantized (their fingerprint never depends on scales)."""
        parts: tuple = (
            BLOCK_FORMAT_VERSION,
            self.shape[1:],
            self.dtype,
            self.tp_size,
            "block[num_layers,2,block_size,heads,head_dim]",
        )
        if scales is not None and self.is_quantized:
            parts += (tuple(float(x) for x in scales),)
        return hashlib.blake2b(repr(parts).encode(), digest_size=16).hexdigest()
