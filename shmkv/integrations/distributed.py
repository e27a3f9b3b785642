"""Point-to-point moves of a sequence between nodes over ``torch.distributed``.

Owns moving one sequence's K/V from a coordinator on one node to a coordinator on
another (prefill on node A, decode on node B): the metadata exchange, the prefix
negotiation and the streaming of whole blocks. Does not set up process groups (the
caller does, see below), does not know about Redis (``shmkv.tiers.redis_store``), and changes
no coordinator state except through its public client calls: the receiving side
allocates with :meth:`Client.allocate`, fills the new blocks and commits.

The move, one message after another on the pair (``A`` = sender, ``B`` = receiver)::

    A -> B  header: int64[16] (magic, version, status, tokens, token ids, root key
                    bytes, block layout fingerprint, chunk blocks, block shape for
                    messages)
    A -> B  token ids int64[n] and the sequence's root key uint8[16], when the header
            has them
    B       allocates the sequence (with the prompt under the same root: prefix reuse
            on B, and B's keys are A's)
    B -> A  reply: int64[4] (status, tokens B already has, blocks to send, 0)
    A -> B  the blocks from the first one B lacks, as uint8 chunks of whole blocks
            (each block's bytes in block order, gathered from and scattered into the
            pool's layer-major storage; double-buffered, so reading the pool, the wire
            and writing the pool overlap)
    A -> B  trailer: int64[1]: OK when the sequence still had the blocks it was sent
            from once the last was read (else B discards what it got)
    B       writes the blocks in place
    B -> A  ack: int64[1]
    B       commits every token (publishing its full blocks)

Keys. The root key that A's sequence's prefix keys chain from (its ``cache_salt``'s,
which A's coordinator keeps) travels with the token ids, so B publishes the blocks
under A's keys: a salted sequence stays salted without the caller passing its salt.

Bytes. The blocks are read while A's handle holds them; a copy whose sequence no
longer had them when the last byte was read (its handle closed meanwhile, a block
replaced) is discarded by B, not published (``shmkv.coordinator.allocator``'s rule: bytes are
stored under a key only while the block still holds it).

A prefix that B already holds (the same token ids under the same salt, published on
B) is not sent: ``num_cached_tokens`` of the handle B gets says how much B had. Layouts
must match block for block (:meth:`PoolConfig.block_fingerprint`: the pools may differ
in size and device); otherwise both sides raise :class:`~shmkv.errors.LayoutMismatch`.

Process groups. Any group holding both ranks works; ``src``/``dst`` are global ranks
(as ``torch.distributed.send`` takes them). Each node runs its own coordinator and
joins one group, e.g. for two nodes::

    # on node A (rank 0) and node B (rank 1), same address and port
    torch.distributed.init_process_group(
        "gloo",                       # CPU pools; "nccl" for CUDA pools
        init_method="tcp://10.0.0.1:29500",   # rendezvous: an address of rank 0's host
        rank=RANK, world_size=2, timeout=datetime.timedelta(seconds=60))

With Gloo the bytes travel from CPU tensors (a CUDA pool is staged through host
memory); with NCCL from tensors on the current CUDA device (a CPU pool is staged
through it). One move at a time per pair of ranks and group; moves in parallel take
one group per pair. Every wait has a timeout (``timeout`` seconds); after a timeout
the group's state is unknown: destroy it and make a new one.
"""

from __future__ import annotations

import dataclasses
import datetime
import threading
from collections import deque
from typing import Deque, List, Optional, Sequence

import torch
import torch.distributed as dist

from shmkv.errors import InvalidArgument, LayoutMismatch, ProtocolError, ShmkvError, WrongType
from shmkv.hashing import KEY_SIZE, pack_tokens, packed_block_keys, root_key, token_list
from shmkv.memory.pool import block_bytes

MAGIC = 0x73686D6B76703270  # b"shmkvp2p" as an int64
VERSION = 2  # 2: the root key in place of the salt; the trailer
HEADER_WORDS = 16
DEFAULT_CHUNK_BYTES = 8 << 20  # bytes per message of K/V (several are in flight)
MAX_SALT_BYTES = 256

# header / reply status codes
OK = 0
ERR_LAYOUT = 1  # the block layouts differ
ERR_ALLOCATE = 2  # the receiver could not allocate (pool exhausted, bad prompt)
ERR_SENDER = 3  # the sender cannot send (a closed handle, bad arguments)
ERR_HEADER = 4  # not a header of this protocol or version

_STATUS_TEXT = {
    ERR_LAYOUT: "the block layouts differ",
    ERR_ALLOCATE: "the receiver could not allocate the sequence",
    ERR_SENDER: "the sender could not send",
    ERR_HEADER: "a message of another protocol or version",
}


class MoveFailed(ShmkvError):
    """A move between nodes failed: the peer refused it, or a wait timed out (then the
    process group's state is unknown: destroy it and make a new one)."""


@dataclasses.dataclass(frozen=True)
class MoveStats:
    """What one move did. ``num_reused_tokens``: tokens the receiver already held."""

    num_tokens: int
    num_sent_tokens: int
    num_reused_tokens: int
    num_sent_blocks: int
    sent_bytes: int


# -- helpers ------------------------------------------------------------------------------


def _fingerprint_words(config) -> List[int]:
    raw = bytes.fromhex(config.block_fingerprint())
    return [
        int.from_bytes(raw[:8], "little", signed=True),
        int.from_bytes(raw[8:], "little", signed=True),
    ]


def _comm_device(group, pool_device: torch.device) -> torch.device:
    """Where the bytes travel from: CPU for Gloo, the current CUDA device for NCCL."""
    if dist.get_backend(group) == "nccl":
        return (
            pool_device
            if pool_device.type == "cuda"
            else torch.device("cuda", torch.cuda.current_device())
        )
    return torch.device("cpu")


class _Link:
    """Sends and receives to one peer with a timeout on every wait."""

    def __init__(self, peer: int, group, timeout: float, device: torch.device):
        self.peer, self.group, self.device = peer, group, device
        self.timeout = datetime.timedelta(seconds=timeout)
        self.seconds = timeout

    def wait(self, work, what: str) -> None:
        try:
            done = work.wait(self.timeout)
        except RuntimeError as exc:  # Gloo reports a timeout or a lost peer this way
            raise MoveFailed(
                f"{what} with rank {self.peer} failed or timed out after {self.seconds} s: {exc}"
            ) from None
        if done is False:
            raise MoveFailed(f"{what} with rank {self.peer} timed out after {self.seconds} s")

    def isend(self, tensor: torch.Tensor):
        return dist.isend(tensor, self.peer, group=self.group)

    def irecv(self, tensor: torch.Tensor):
        return dist.irecv(tensor, self.peer, group=self.group)

    def send_i64(self, values: Sequence[int], what: str) -> None:
        self.wait(
            self.isend(torch.tensor(list(values), dtype=torch.int64, device=self.device)), what
        )

    def recv_i64(self, n: int, what: str) -> List[int]:
        t = torch.empty(n, dtype=torch.int64, device=self.device)
        self.wait(self.irecv(t), what)
        return t.tolist()


def _block_rows(client) -> torch.Tensor:
    """The pool's bytes by block, uint8 ``[num_blocks, 2 * num_layers, chunk bytes]``
    (``shmkv.memory.pool.block_bytes``: a block is a chunk of each layer's K and V)."""
    pool = client.pool
    if client.tp_rank is not None:
        raise InvalidArgument(
            "moving a sequence needs a client that sees every head: "
            "connect without tp_rank= (a CPU pool, or a CUDA pool with "
            "tp_size=1)"
        )
    return block_bytes(pool)


def _runs(blocks: Sequence[int]) -> List[tuple]:
    """``(index, first block, length)`` of each run of consecutive block ids."""
    runs, i, n = [], 0, len(blocks)
    while i < n:
        j = i + 1
        while j < n and blocks[j] == blocks[j - 1] + 1:
            j += 1
        runs.append((i, blocks[i], j - i))
        i = j
    return runs


# Fragmented tables move with one indexed copy; a few runs with plain slice copies
# (a memcpy each, faster than the per-row indexed kernels on CPU).
_MAX_RUNS = 16


def _gather(rows: torch.Tensor, blocks: Sequence[int], out: torch.Tensor) -> None:
    """The bytes of ``blocks`` (``rows`` as :func:`_block_rows` gives) into ``out``, one
    block after another."""
    shape = rows.shape[1:]
    runs = _runs(blocks)
    if len(runs) <= _MAX_RUNS:
        for i, first, length in runs:
            out.view(len(blocks), *shape)[i : i + length].copy_(rows[first : first + length])
    else:
        index = torch.tensor(list(blocks), dtype=torch.int64, device=rows.device)
        if out.device == rows.device:
            torch.index_select(rows, 0, index, out=out.view(len(blocks), *shape))
        else:
            out.view(len(blocks), *shape).copy_(rows.index_select(0, index))


def _scatter(src: torch.Tensor, rows: torch.Tensor, blocks: Sequence[int]) -> None:
    """The inverse of :func:`_gather`: ``src`` holds the bytes of ``blocks`` in order."""
    shape = rows.shape[1:]
    src = src.view(len(blocks), *shape)
    runs = _runs(blocks)
    if len(runs) <= _MAX_RUNS:
        for i, first, length in runs:
            rows[first : first + length].copy_(src[i : i + length])
    else:
        index = torch.tensor(list(blocks), dtype=torch.int64, device=rows.device)
        rows.index_copy_(0, index, src.to(rows.device))


def _chunks(num_blocks: int, chunk_blocks: int) -> List[tuple]:
    return [(lo, min(lo + chunk_blocks, num_blocks)) for lo in range(0, num_blocks, chunk_blocks)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


_LOCAL = threading.local()


def _staging(device: torch.device, nbytes: int, count: int = 2) -> list:
    """This thread's ``count`` staging buffers of ``nbytes`` on ``device``, kept between
    moves: fresh memory costs a page fault per page on first touch, more than the copy."""
    cache = getattr(_LOCAL, "buffers", None)
    if cache is None:
        cache = _LOCAL.buffers = {}
    bufs = cache.get(device)
    if bufs is None or bufs[0].numel() < nbytes or len(bufs) < count:
        bufs = cache[device] = [
            torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(count)
        ]
    return bufs


# -- the sender -------------------------------------------------------------------------


def send_sequence(
    handle,
    dst: int,
    *,
    tokens=None,
    cache_salt: Optional[bytes] = None,
    group=None,
    timeout: float = 60.0,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> MoveStats:
    """Send the sequence of ``handle`` to rank ``dst``, which calls :func:`recv_sequence`.

    Returns once the receiver has written every token into its pool; the caller may
    then close ``handle``. Blocks the receiver already holds (the same token ids and
    salt, published there) are not sent.

    Args:
        handle: a :class:`~shmkv.KvCacheHandle` of a client that sees every head.
        dst: the receiver's global rank.
        tokens: the sequence's token ids (one per token of ``handle``): the receiver
            reuses its cached prefix and publishes the blocks under their prefix keys,
            chained from the root key of the sequence's salt (its coordinator keeps
            it). Without them every block is sent and none is published on the receiver.
        cache_salt: the salt ``handle``'s sequence was allocated with, if any: checked
            against the one its coordinator knows (it need not be passed).
        group: the process group (default: the default group).
        timeout: seconds any one wait may take.
        chunk_bytes: bytes per message of K/V (rounded to whole blocks).

    Raises:
        MoveFailed: the receiver refused (could not allocate) or a wait timed out.
        LayoutMismatch: the receiver's block layout differs.
        InvalidArgument / WrongType: bad arguments (the receiver is told, and raises).
    """
    client = handle._client
    config = client.config
    device = _comm_device(group, client.pool.device)
    link = _Link(dst, group, timeout, device)
    fp = _fingerprint_words(config)
    chunk_blocks = max(1, int(chunk_bytes) // config.block_nbytes)
    header = [
        MAGIC,
        VERSION,
        OK,
        0,
        0,
        0,
        fp[0],
        fp[1],
        chunk_blocks,
        config.block_size,
        config.num_layers,
        config.num_kv_heads,
        config.head_dim,
        config.itemsize,
        config.tp_size,
        0,
    ]
    try:  # every argument error is told to the receiver too, so it does not wait
        rows = _block_rows(client)
        num_tokens = handle.num_tokens
        ids = None
        if tokens is not None:
            ids = token_list(tokens)
            if len(ids) != num_tokens:
                raise InvalidArgument(
                    f"tokens has {len(ids)} ids, the handle holds "
                    f"{num_tokens} tokens; pass one id per token"
                )
        if cache_salt is not None and (
            not isinstance(cache_salt, bytes) or len(cache_salt) > MAX_SALT_BYTES
        ):
            raise WrongType(f"cache_salt must be bytes of at most {MAX_SALT_BYTES}")
        root = None
        if ids is not None:  # the root its keys chain from, as its coordinator has it
            handle._check_open()
            root = client.request("info", cache_id=handle._cache_id).get("root")
            if cache_salt is not None and root is not None and root != root_key(cache_salt):
                raise InvalidArgument(
                    "cache_salt is not the salt the sequence was allocated "
                    "with (its coordinator keeps that one: leave it out)"
                )
            if root is None:  # allocated without a prompt: no salt, the default root
                root = root_key(cache_salt)
        blocks = list(handle.block_table.physical_blocks)
    except BaseException:
        header[2] = ERR_SENDER
        link.send_i64(header, "sending the header")
        raise
    header[3] = num_tokens
    header[4] = len(ids) if ids is not None else 0
    header[5] = len(root) if root is not None else 0
    # The header, ids and root go out together, and the reply is awaited at once.
    out = [torch.tensor(header, dtype=torch.int64, device=device)]
    if ids:
        out.append(torch.tensor(ids, dtype=torch.int64, device=device))
    if root is not None:
        out.append(torch.frombuffer(bytearray(root), dtype=torch.uint8).to(device))
    works = [link.isend(t) for t in out]
    reply = torch.empty(4, dtype=torch.int64, device=device)
    reply_work = link.irecv(reply)
    for work in works:
        link.wait(work, "sending the header")
    link.wait(reply_work, "receiving the reply")
    status, have, num_send, _ = reply.tolist()
    if status == ERR_LAYOUT:
        raise LayoutMismatch(
            f"rank {dst} holds another block layout (this pool's block "
            f"fingerprint is {config.block_fingerprint()})"
        )
    if status != OK:
        raise MoveFailed(
            f"rank {dst} refused the sequence: {_STATUS_TEXT.get(status, f'status {status}')}"
        )
    bs = config.block_size
    first = have // bs
    if have % bs or have > num_tokens or num_send != len(blocks) - first:
        raise ProtocolError(
            f"rank {dst} answered {have} tokens held and {num_send} blocks "
            f"to send for a sequence of {num_tokens} tokens"
        )
    send = blocks[first:]
    nbytes = rows.shape[1] * rows.shape[2]
    if send:
        # Each chunk of blocks is gathered into one of two staging buffers (a block's
        # bytes lie in 2 * num_layers pieces of the pool), the next while the last is sent.
        bufs = None
        staged: list = [None, None]  # the send still reading each staging buffer
        slot = 0
        for lo, hi in _chunks(len(send), chunk_blocks):
            if bufs is None:
                bufs = _staging(device, min(chunk_blocks, len(send)) * nbytes)
            if staged[slot] is not None:  # the send before last used this buffer
                link.wait(staged[slot], "sending K/V")
            buf = bufs[slot][: (hi - lo) * nbytes]
            _gather(rows, send[lo:hi], buf)
            _sync(rows.device)
            staged[slot] = link.isend(buf)
            slot = 1 - slot
        for work in [w for w in staged if w is not None]:
            link.wait(work, "sending K/V")
    # After the last read: did the sequence still have the blocks it was read from?
    try:
        same = list(handle.block_table.physical_blocks[: len(blocks)]) == blocks
    except ShmkvError:  # closed meanwhile
        same = False
    link.send_i64([OK if same else ERR_SENDER], "sending the trailer")
    if not same:
        raise MoveFailed(
            "the sequence lost or replaced its blocks while they were sent "
            "(its handle closed, or a block copied on write): the receiver "
            "discarded them"
        )
    ack = link.recv_i64(1, "receiving the acknowledgement")[0]
    if ack != OK:
        raise MoveFailed(
            f"rank {dst} failed to store the sequence: {_STATUS_TEXT.get(ack, f'status {ack}')}"
        )
    return MoveStats(
        num_tokens=num_tokens,
        num_sent_tokens=num_tokens - have,
        num_reused_tokens=have,
        num_sent_blocks=len(send),
        sent_bytes=len(send) * nbytes,
    )


# -- the receiver ------------------------------------------------------------------------


def recv_sequence(
    client, src: int, *, group=None, request_id: Optional[str] = None, timeout: float = 60.0
):
    """Receive a sequence that rank ``src`` sends with :func:`send_sequence`.

    Allocates the sequence in ``client``'s pool (with the sender's token ids as the
    prompt, so a prefix already cached here is reused and not sent), writes the
    blocks that arrive in place, and commits every token, so full blocks are
    published here under their prefix keys. Returns the new handle, ready to decode
    on: ``num_tokens`` is the sender's, ``num_cached_tokens`` the tokens this pool
    already held.

    Args:
        client: a :class:`~shmkv.Client` that sees every head.
        src: the sender's global rank.
        group: the process group (default: the default group).
        request_id: the new sequence's request id.
        timeout: seconds any one wait may take.

    Raises:
        LayoutMismatch: the sender's block layout differs (the sender is told).
        PoolExhausted: no room for the sequence here (the sender is told).
        MoveFailed: the sender could not send, or a wait timed out.
        ProtocolError: the peer does not speak this protocol.
    """
    config = client.config
    rows = _block_rows(client)
    device = _comm_device(group, client.pool.device)
    link = _Link(src, group, timeout, device)
    header = link.recv_i64(HEADER_WORDS, "receiving the header")
    if header[0] != MAGIC or header[1] != VERSION:
        link.send_i64([ERR_HEADER, 0, 0, 0], "sending the reply")
        raise ProtocolError(f"rank {src} sent no shmkv move header of version {VERSION}")
    status, num_tokens, num_ids, salt_len = header[2:6]
    if status != OK:
        raise MoveFailed(f"rank {src} could not send the sequence (its own error says why)")
    if salt_len not in (0, KEY_SIZE) or (salt_len and not num_ids):
        link.send_i64([ERR_HEADER, 0, 0, 0], "sending the reply")
        raise ProtocolError(f"rank {src} sent a root key of {salt_len} bytes")
    ids_t = torch.empty(num_ids, dtype=torch.int64, device=device)
    salt_t = torch.empty(salt_len, dtype=torch.uint8, device=device)
    works = [link.irecv(t) for t in (ids_t, salt_t) if t.numel()]
    for work in works:
        link.wait(work, "receiving the token ids")
    ids = ids_t.tolist() if num_ids else None
    root = bytes(salt_t.cpu().numpy()) if salt_len else None
    if header[6:8] != _fingerprint_words(config):
        link.send_i64([ERR_LAYOUT, 0, 0, 0], "sending the reply")
        raise LayoutMismatch(
            f"rank {src} sends blocks of another layout (block_size {header[9]}, "
            f"{header[10]} layers, {header[11]} kv heads x {header[12]}, {header[13]}-byte "
            f"elements, tp_size {header[14]}); this pool has block_size "
            f"{config.block_size}, {config.num_layers} layers, {config.num_kv_heads} kv "
            f"heads x {config.head_dim}, {config.itemsize}-byte {config.dtype}, tp_size "
            f"{config.tp_size}"
        )
    chunk_blocks = header[8]
    try:
        if root is None:
            handle = client.allocate(num_tokens=num_tokens, prompt=ids, request_id=request_id)
        else:  # the sender's keys: its prompt under its root (its salt's)
            assert ids is not None  # (a root key comes with token ids: checked above)
            packed = pack_tokens(ids)
            req = {
                "num_tokens": num_tokens,
                "prompt": packed,
                "root": root,
                "keys": b"".join(packed_block_keys(packed, config.block_size, root)),
            }
            if request_id is not None:
                req["request_id"] = request_id
            handle = client._handle(client.request("allocate_many", requests=[req])[0])
    except ShmkvError:  # pool exhausted, a bad prompt, the coordinator gone
        link.send_i64([ERR_ALLOCATE, 0, 0, 0], "sending the reply")
        raise
    try:
        bs = config.block_size
        have = handle.num_cached_tokens
        blocks = list(handle.block_table.physical_blocks)
        first = have // bs
        recv = blocks[first:]
        if recv:  # fresh blocks of this sequence: normally writable in place already
            handle._ensure_writable(handle._check_open(), first * bs, num_tokens - first * bs)
            blocks = list(handle.block_table.physical_blocks)
            recv = blocks[first:]
        reply = torch.tensor([OK, have, len(recv), 0], dtype=torch.int64, device=device)
        reply_work = link.isend(reply)  # awaited once the first chunk's receive is posted
        nbytes = rows.shape[1] * rows.shape[2]
        if recv:
            # Each chunk lands in one of two staging buffers and is scattered into the
            # pool while the next chunks arrive. Receives are posted in message order.
            chunks = _chunks(len(recv), max(1, chunk_blocks))
            bufs = _staging(device, (chunks[0][1] - chunks[0][0]) * nbytes)
            free = [1, 0]  # staging buffers not receiving or scattering
            posted: Deque[tuple] = deque()  # (work, staging buffer index, lo, hi)
            next_chunk = 0

            def post_more() -> None:
                nonlocal next_chunk
                while next_chunk < len(chunks):
                    lo, hi = chunks[next_chunk]
                    if free:
                        slot = free.pop()
                        posted.append((link.irecv(bufs[slot][: (hi - lo) * nbytes]), slot, lo, hi))
                    else:
                        return
                    next_chunk += 1

            post_more()
            link.wait(reply_work, "sending the reply")
            reply_work = None
            while posted:
                work, slot, lo, hi = posted.popleft()
                link.wait(work, "receiving K/V")
                _scatter(bufs[slot][: (hi - lo) * nbytes], rows, recv[lo:hi])
                free.append(slot)
                post_more()
            _sync(rows.device)
        if reply_work is not None:
            link.wait(reply_work, "sending the reply")
        if link.recv_i64(1, "receiving the trailer")[0] != OK:
            raise MoveFailed(
                f"rank {src} no longer had the blocks it sent when it had read "
                "them; they are discarded"
            )
        link.send_i64([OK], "sending the acknowledgement")  # the bytes are in place
        handle.commit(num_tokens)
    except BaseException:
        handle.close()
        raise
    return handle
