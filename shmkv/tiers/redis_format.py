"""What a :class:`RedisTier` is configured with, and the store's key names and value
format (pure: no client, no thread, no store contacted).

Owns :class:`RedisTier` (the tier a coordinator's ``tiers=`` list names, checked when
made), :func:`split_specs` (the local tiers and the store, from that list) and
:class:`Codec` (one namespace's key names, and the header that makes a value checkable).
Does not talk to the store: ``shmkv.tiers.redis_store`` does, and re-exports these
names.

Keys and values. One key per block::

    shmkv:<namespace, 32 hex>:{<tag, 32 hex>}:<prefix key, 32 hex>

The namespace is ``blake2b-128`` of the format version, the block layout fingerprint
(:meth:`PoolConfig.block_fingerprint`: shapes, dtype, tensor-parallel split, and a
quantized pool's K/V scales; not the pool size), the tier's ``salt`` and
``hash_group``; a request's ``cache_salt`` is in the prefix key already
(``shmkv.hashing``). Nodes with another layout, salt or scales never read each other's
bytes. A quantized pool's namespace follows its scales: when ``set_kv_scales`` changes
them, writes and lookups from then on use the namespace of the new ones (a write or
lookup already queued keeps the one it was queued under).

The value is a 96-byte little-endian header -- magic ``SHMKVRED``, format version
u16, header size u16, flags u32, namespace (16 bytes), prefix key (16 bytes),
num_layers, block_size, num_kv_heads, head_dim, tp_size (u32 each), dtype name (12
bytes, NUL padded), payload bytes u64, payload crc32 u32, crc32 of the 92 bytes
before -- followed by the payload: the block's bytes of every rank's pool, rank after
rank (the disk tier's format with another magic). A value whose size, header or
checksum is wrong is a miss, is deleted and counted (``corrupt``).

Redis Cluster. Only the part in braces is hashed (a hash tag): the tag of block ``i``
of a prompt is the prefix key of block ``i - i % hash_group``, so each run of
``hash_group`` consecutive blocks of a prefix lives in one hash slot, on one shard,
and one lookup pipeline asks one shard per group; long prompts and different prompts
spread over the shards. All nodes sharing a store must use the same ``hash_group``
(it is part of the namespace).

"""

from __future__ import annotations

import hashlib
import struct
import zlib
from typing import List, Optional

from shmkv.errors import InvalidArgument, ShmkvError, WrongType

MAGIC = b"SHMKVRED"
FORMAT_VERSION = 1
_HEAD = struct.Struct("<8sHHI16s16s5I12sQI")  # everything up to the header's own crc
_CRC = struct.Struct("<I")
HEADER_SIZE = _HEAD.size + _CRC.size  # 96
KEY_PREFIX = "shmkv"


def _check_number(name: str, value, lo: float, allow_none: bool = False):
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise WrongType(f"RedisTier {name} must be a number, got {type(value).__name__}")
    if not value > lo:
        raise InvalidArgument(f"RedisTier {name} must be > {lo}, got {value}")
    return value


def redis_module():
    try:
        import redis
    except ImportError:
        raise ShmkvError(
            "RedisTier needs the redis client: pip install 'shmkv[redis]' (or pip install redis)"
        ) from None
    return redis


class RedisTier:
    """A tier in Redis or Valkey, shared by the coordinators of many nodes.

    Committed blocks are written behind the commit; a prefix that misses the pool
    and the local tiers is looked up in the store, and its hits are pulled into the
    pool (see the module doc for keys, values, expiry and Redis Cluster). The store
    being down, slow or wrong never fails a request: errors are counted in
    ``stats()["tiers"]`` and the node goes on with its local tiers.

    Args:
        url: ``redis://[:password@]host:port/db``, ``rediss://...`` or
            ``unix:///path.sock`` (Valkey speaks the same protocol).
        salt: bytes that, with the block layout, name what the blocks are (the model,
            say): coordinators with another salt share nothing.
        ttl: seconds each key lives (None: no expiry; then rely on maxmemory-policy).
        timeout: seconds any one socket operation (connect, send, receive) may take.
        max_queue: blocks waiting to be written at most; more are dropped and counted.
        cluster: the URL names a Redis Cluster node (``redis.cluster.RedisCluster``).
        hash_group: consecutive blocks of a prefix that share a hash slot.
        max_backoff: the longest pause, in seconds, after repeated store errors.

    Raises:
        ShmkvError: the ``redis`` client is not installed.
        InvalidArgument / WrongType: a bad argument. The store is not contacted here:
            one that is down at start is retried in the background.
    """

    kind = "redis"

    def __init__(
        self,
        url: str,
        *,
        salt: bytes = b"",
        ttl: Optional[float] = 3600.0,
        timeout: float = 0.5,
        max_queue: int = 1024,
        cluster: bool = False,
        hash_group: int = 16,
        max_backoff: float = 5.0,
    ):
        if not isinstance(url, str) or "://" not in url:
            raise WrongType("RedisTier url must be a str such as 'redis://127.0.0.1:6379'")
        if url.split("://", 1)[0] not in ("redis", "rediss", "unix", "valkey", "valkeys"):
            raise InvalidArgument(f"RedisTier url {url!r}: use redis://, rediss:// or unix://")
        if not isinstance(salt, bytes):
            raise WrongType("RedisTier salt must be bytes")
        for name, value in (("max_queue", max_queue), ("hash_group", hash_group)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgument(f"RedisTier {name} must be a positive int, got {value!r}")
        redis_module()
        self.url = url.replace("valkey", "redis", 1) if url.startswith("valkey") else url
        self.salt = salt
        self.ttl = _check_number("ttl", ttl, 0, allow_none=True)
        self.timeout = float(_check_number("timeout", timeout, 0))
        self.max_queue = max_queue
        self.cluster = bool(cluster)
        self.hash_group = hash_group
        self.max_backoff = float(_check_number("max_backoff", max_backoff, 0))

    def __repr__(self) -> str:
        where = self.url.split("@")[-1]  # never print a password
        return (
            f"RedisTier({where!r}, ttl={self.ttl}, timeout={self.timeout}"
            f"{', cluster=True' if self.cluster else ''})"
        )


def split_specs(tiers) -> tuple:
    """``(local tiers, RedisTier or None)`` from a coordinator's ``tiers=`` list; the
    store, if any, must be the last (lowest) tier."""
    if tiers is None or not isinstance(tiers, (list, tuple)):
        return tiers, None
    remote = [t for t in tiers if isinstance(t, RedisTier)]
    if not remote:
        return tiers, None
    if len(remote) > 1 or tiers[-1] is not remote[0]:
        raise InvalidArgument(
            "tiers takes one RedisTier, as the last (lowest) tier: "
            "[HostTier(...), DiskTier(...), RedisTier(url)]"
        )
    return list(tiers[:-1]), remote[0]


# -- the format (pure) ---------------------------------------------------------------------


class Codec:
    """Key names and values of one namespace (a block layout, a salt, a hash group, and
    a quantized pool's K/V scales: ``scales``, as ``PoolConfig.block_fingerprint``)."""

    def __init__(self, config, salt: bytes = b"", hash_group: int = 16, scales=None):
        self.hash_group = hash_group
        self.payload_nbytes = config.block_nbytes
        self.value_nbytes = HEADER_SIZE + self.payload_nbytes
        fingerprint = config.block_fingerprint(scales)
        self.namespace = hashlib.blake2b(
            b"shmkv-remote/%d/%s/%d/" % (FORMAT_VERSION, fingerprint.encode(), hash_group) + salt,
            digest_size=16,
        ).digest()
        self._prefix = f"{KEY_PREFIX}:{self.namespace.hex()}:{{"
        self._shape = (
            config.num_layers,
            config.block_size,
            config.num_kv_heads,
            config.head_dim,
            config.tp_size,
            config.dtype.encode(),
        )

    def names(self, chain: list, start: int, stop: int) -> List[str]:
        """Key names of blocks ``start..stop-1`` of a prefix whose keys are ``chain``."""
        group, prefix = self.hash_group, self._prefix
        return [
            f"{prefix}{chain[i - i % group].hex()}}}:{chain[i].hex()}" for i in range(start, stop)
        ]

    def header(self, key: bytes, crc: int) -> bytes:
        layers, block_size, heads, head_dim, tp, dtype = self._shape
        head = _HEAD.pack(
            MAGIC,
            FORMAT_VERSION,
            HEADER_SIZE,
            0,
            self.namespace,
            key,
            layers,
            block_size,
            heads,
            head_dim,
            tp,
            dtype,
            self.payload_nbytes,
            crc,
        )
        return head + _CRC.pack(zlib.crc32(head))

    def check(self, value, key: bytes) -> Optional[str]:
        """None for a valid value of ``key``; else why it is not served."""
        if not isinstance(value, (bytes, bytearray, memoryview)):
            return "not a string value"
        if len(value) != self.value_nbytes:
            return (
                f"size {len(value)}, expected {self.value_nbytes}"
                if len(value) >= HEADER_SIZE
                else "truncated header"
            )
        head = bytes(value[: _HEAD.size])
        if _CRC.unpack_from(value, _HEAD.size)[0] != zlib.crc32(head):
            return "header checksum"
        (
            magic,
            version,
            header_size,
            _flags,
            namespace,
            value_key,
            layers,
            block_size,
            heads,
            head_dim,
            tp,
            dtype,
            payload,
            crc,
        ) = _HEAD.unpack(head)
        if magic != MAGIC or version != FORMAT_VERSION or header_size != HEADER_SIZE:
            return "not a block value of this format"
        if namespace != self.namespace or value_key != key:
            return "another namespace or key"
        if (
            layers,
            block_size,
            heads,
            head_dim,
            tp,
            dtype.rstrip(b"\0"),
        ) != self._shape or payload != self.payload_nbytes:
            return "another shape"
        if zlib.crc32(memoryview(value)[HEADER_SIZE:]) != crc:
            return "payload checksum"
        return None
