"""The wire protocol between clients and the coordinator, without any I/O.

Owns framing (4-byte big-endian length prefix + one msgpack body), strict decoding,
the table of message types with the arguments each takes, and the table of error
codes. Bytes go in, validated messages come out, bytes to send come back; sockets,
threads and selectors live in ``shmkv.coordinator.server`` and ``shmkv.client.client``.

Envelopes::

    request:  [request_id, op, {arg: value, ...}]
    response: [request_id, 0, result]           success
              [request_id, code, message]       failure, code from ERROR_CODES

Only descriptors travel: ints, strings, bytes, lists and maps. Never tensor bytes,
never pickle. Decoding uses ``raw=False`` and ``strict_map_key=True`` and refuses
frames over the configured maximum before buffering them.
"""

from __future__ import annotations

import dataclasses
import struct
import sys
from array import array
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Optional, Union

import msgpack

from shmkv import errors

if TYPE_CHECKING:  # (annotations only: the protocol imports no numpy)
    import numpy as np

PROTOCOL_VERSION = 2  # 2: an allocation's prompt comes with its block keys
# Additions to version 2 a client may use only with a coordinator whose hello lists them
# (an older one closes the connection on an unknown argument or op): "settle", an
# ``allocate_many`` answered ``early``, the ``settle`` op and ``commit``'s ``start``;
# "copy", the ``tier_memory`` op, an ``allocate_many`` asked to ``copy`` its promotions
# and the ``promoted`` op (the client copies its tier blocks in, ``shmkv.tiers``);
# "count_hits", the ``count_hits`` op (an engine's report of what it loaded);
# "commit_starts", ``commit_batch``'s ``starts`` (where each sequence's writes began);
# "row_owners", the ``rows`` op's ``row_owners`` (the owners of the rows' blocks);
# "computing", the ``computing`` op (how much of a prompt others are computing now) and
# an allocation's ``defer`` (not made while others compute its prompt's next blocks);
# "bound_handoffs", ``export``'s ``bound`` (a token that goes with its maker's connection).
FEATURES = (
    "settle",
    "copy",
    "count_hits",
    "commit_starts",
    "row_owners",
    "computing",
    "bound_handoffs",
)
DEFAULT_MAX_FRAME = 16 * 1024 * 1024
_HEADER = struct.Struct(">I")
HEADER_SIZE = _HEADER.size

# -- error codes: one table, both directions ---------------------------------------------

ERROR_CODES = {
    1: errors.ShmkvError,
    2: errors.PoolExhausted,
    3: errors.UnknownCache,
    4: errors.ProtocolError,
    5: errors.InvalidArgument,
    6: errors.OutOfRange,
    7: errors.WrongType,
    8: errors.HandoffError,
    9: errors.LimitExceeded,
    10: errors.AccessDenied,
    11: errors.LayoutMismatch,
    12: errors.StaleStep,
    13: errors.NotSettled,
}
_CODE_OF = {cls: code for code, cls in ERROR_CODES.items()}


def error_code(exc: BaseException) -> int:
    """The wire code for an exception (the nearest listed base class)."""
    for cls in type(exc).__mro__:
        if cls in _CODE_OF:
            return _CODE_OF[cls]
    return 1


def exception_for(code: int, message: str) -> errors.ShmkvError:
    """The exception a client raises for an error response."""
    cls = ERROR_CODES.get(code, errors.ShmkvError)
    if cls is errors.ProtocolError:
        return errors.ProtocolError(message, remote=False)
    return cls(message)


# -- message types -----------------------------------------------------------------------
# op -> {arg: (kind, required)}. Kinds: "int", "num", "bytes", "str", "ints" (list of
# ints), "i64s" (bytes of little-endian int64s), "tokens" (token ids: "i64s", what
# clients send, or "ints"), "list", "map", "bool". None is accepted for optional
# arguments.

OPS = {
    "hello": {
        "version": ("int", True),
        "tp_rank": ("int", False),
        "tp_size": ("int", False),
        "pid": ("int", False),
        "name": ("str", False),
    },
    "ping": {},
    "allocate": {
        "num_tokens": ("int", True),
        "prompt": ("tokens", False),
        "cache_salt": ("bytes", False),
        "request_id": ("str", False),
        "keys": ("bytes", False),
        "root": ("bytes", False),
        "defer": ("bool", False),
    },
    "allocate_many": {
        "requests": ("list", False),
        "counts": ("i64s", False),
        "early": ("bool", False),
        "copy": ("bool", False),
    },
    "computing": {
        "prompt": ("tokens", True),
        "cache_salt": ("bytes", False),
        "keys": ("bytes", False),
    },
    "extend": {"cache_id": ("int", True), "num_tokens": ("int", True), "tokens": ("ints", False)},
    "extend_many": {"items": ("list", True)},
    "commit": {
        "cache_id": ("int", True),
        "num_tokens": ("int", True),
        "tp_rank": ("int", False),
        "start": ("int", False),
    },
    "prepare_write": {
        "cache_id": ("int", True),
        "start": ("int", True),
        "num_tokens": ("int", True),
    },
    "info": {"cache_id": ("int", True)},
    "clone": {"cache_id": ("int", True)},
    "fork": {"cache_id": ("int", True)},
    "release": {"cache_id": ("int", True)},
    "release_many": {"cache_ids": ("ints", False), "ids": ("i64s", False)},
    "export": {"cache_id": ("int", True), "ttl": ("num", True), "bound": ("bool", False)},
    "open": {"token": ("bytes", True)},
    "settle": {"cache_id": ("int", True)},
    "tier_memory": {},
    "promoted": {"id": ("int", True), "statuses": ("bytes", True), "errors": ("list", False)},
    "stats": {},
    # What an engine reports it took from the cache (its own prefix cache answered the
    # rest): added to its client name's hit and miss counters, nothing else.
    "count_hits": {"hit_tokens": ("int", True), "miss_tokens": ("int", True)},
    "set_kv_scales": {"layer": ("int", True), "k_scale": ("num", True), "v_scale": ("num", True)},
    # Batches: sequences as packed int64 arrays ("i64s": little-endian bytes), so a
    # step of any size is one small frame and decodes without a Python loop.
    "extend_batch": {
        "ids": ("i64s", True),
        "count": ("int", False),
        "counts": ("i64s", False),
        "tokens": ("list", False),
        "slots": ("i64s", False),
        "keep": ("bool", False),
    },
    "extend_kept": {"batch": ("int", True), "count": ("int", True), "seen": ("int", True)},
    "prepare_batch": {"ids": ("i64s", True), "starts": ("i64s", True), "counts": ("i64s", True)},
    "truncate_batch": {"ids": ("i64s", True), "num_tokens": ("i64s", True)},
    "commit_batch": {
        "ids": ("i64s", True),
        "num_tokens": ("i64s", True),
        "tp_rank": ("int", False),
        "starts": ("i64s", False),
    },
    # Rows of the shared tables (and owners of blocks), for readers that may not read
    # them lock-free (``shmkv.memory.tables.lock_free_reads``).
    "rows": {
        "slots": ("i64s", True),
        "width": ("int", True),
        "blocks": ("i64s", False),
        "row_owners": ("bool", False),
    },
}


_REQUIRED = {
    op: tuple(name for name, (_kind, required) in spec.items() if required)
    for op, spec in OPS.items()
}


def _check_kind(op: str, name: str, kind: str, value: Any) -> None:
    ok = True
    if kind == "int":
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind == "num":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif kind == "bytes":
        ok = isinstance(value, bytes)
    elif kind == "str":
        ok = isinstance(value, str)
    elif kind == "bool":
        ok = isinstance(value, bool)
    elif kind == "list":
        ok = isinstance(value, list)
    elif kind == "map":
        ok = isinstance(value, dict)
    elif kind == "i64s":
        ok = isinstance(value, bytes) and len(value) % 8 == 0
    elif kind == "tokens":  # packed: nothing to check per token, nothing to decode
        ok = (
            len(value) % 8 == 0
            if isinstance(value, bytes)
            else (isinstance(value, list) and all(type(v) is int for v in value))
        )
    elif kind == "ints":
        ok = isinstance(value, list) and all(
            type(v) is int for v in value
        )  # bool is not a token id
    if not ok:
        what = {
            "tokens": "token ids: a list of ints, or whole little-endian int64s packed in bytes",
            "i64s": "whole little-endian int64s packed in bytes",
        }.get(kind, kind)
        raise errors.WrongType(
            f"{op}: argument {name!r} must be {what}, got "
            f"{type(value).__name__}" + (f" of {len(value)}" if isinstance(value, bytes) else "")
        )


def unpack_i64s(data: bytes) -> "array":
    """The ints of an ``i64s`` argument (little-endian int64s)."""
    out = array("q")
    out.frombytes(data)
    if sys.byteorder != "little":
        out.byteswap()
    return out


def pack_i64s(values: Union[Iterable[int], np.ndarray]) -> bytes:
    """The ``i64s`` form of a sequence of ints (or of a numpy integer array)."""
    if hasattr(values, "astype"):  # (no copy when they are little-endian int64s)
        return values.astype("<i8", copy=False).tobytes()
    out = values if isinstance(values, array) and values.typecode == "q" else array("q", values)
    if sys.byteorder != "little":
        out = array("q", out)
        out.byteswap()
    return out.tobytes()


# A client names itself at hello (``shmkv.connect(name=...)``): counted apart in /metrics.
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.:/-")


def check_client_name(name: object) -> str:
    """``name`` if it is a client name (1-64 of ``A-Z a-z 0-9 _ . : / -``).

    Raises:
        InvalidArgument: it is not.
    """
    if not isinstance(name, str) or not 1 <= len(name) <= 64 or not _NAME_CHARS.issuperset(name):
        raise errors.InvalidArgument(
            f"client name {name!r} must be 1-64 characters of letters, digits and _ . : / -"
        )
    return name


def validate_args(op: str, args: Any) -> dict:
    """Check ``args`` against the table for ``op``; returns them with defaults filled."""
    spec = OPS.get(op)
    if spec is None:
        raise errors.ProtocolError(f"unknown op {op!r}")
    if not isinstance(args, dict):
        raise errors.ProtocolError(f"{op}: arguments must be a map")
    out = dict.fromkeys(spec)  # every argument, None where not given
    for name, value in args.items():
        entry = spec.get(name)
        if entry is None:
            unknown = sorted(map(str, set(args) - set(spec)))
            raise errors.ProtocolError(f"{op}: unknown argument(s) {unknown}")
        if value is not None:
            _check_kind(op, name, entry[0], value)
            out[name] = value
    for name in _REQUIRED[op]:
        if out[name] is None:
            raise errors.ProtocolError(f"{op}: missing argument {name!r}")
    return out


@dataclasses.dataclass(frozen=True)
class Request:
    """A validated request."""

    request_id: int
    op: str
    args: dict


@dataclasses.dataclass(frozen=True)
class Response:
    """A response: ``code == 0`` carries ``result``, otherwise ``message``."""

    request_id: int
    code: int
    result: Any = None
    message: str = ""

    def unwrap(self) -> Any:
        """Return the result, or raise the exception the error code names."""
        if self.code:
            raise exception_for(self.code, self.message)
        return self.result


# -- framing -----------------------------------------------------------------------------


def encode(obj: Any) -> bytes:
    """One frame: length prefix + msgpack body.

    Raises:
        InvalidArgument: an int outside the 64-bit range msgpack carries.
        WrongType: a value of a type the wire does not carry (tensors, objects).
    """
    try:
        body = msgpack.packb(obj, use_bin_type=True)
    except (OverflowError, ValueError) as exc:
        raise errors.InvalidArgument(f"a value does not fit the wire format: {exc}") from None
    except TypeError as exc:
        raise errors.WrongType(f"a value cannot be sent to the coordinator: {exc}") from None
    return _HEADER.pack(len(body)) + body


def encode_request(request_id: int, op: str, args: Optional[dict] = None) -> bytes:
    return encode([request_id, op, args or {}])


def encode_ok(request_id: int, result: Any) -> bytes:
    return encode([request_id, 0, result])


def encode_error(request_id: int, exc: BaseException) -> bytes:
    return encode([request_id, error_code(exc), str(exc)])


@dataclasses.dataclass(frozen=True)
class OversizedFrame:
    """What :class:`FrameDecoder` yields for a frame longer than its maximum: the frame's
    length and the request id read from its first bytes (-1 when they did not say). The
    body is skipped as it arrives, never buffered, so the stream stays in step: the
    receiver answers ``error()`` and goes on with the next frame."""

    request_id: int
    length: int
    max_frame: int

    def error(self) -> errors.ProtocolError:
        return errors.ProtocolError(
            f"frame of {self.length} bytes exceeds the maximum of {self.max_frame}; it was "
            "skipped (the connection stays): split the request"
        )


def _peek_request_id(head: bytes, whole: bool) -> int | None:
    """The request id at the start of a request envelope's bytes, -1 when they are not
    an envelope's, or None when more bytes are needed to tell (never when ``whole``:
    ``head`` is all there is)."""
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=64)
    try:
        unpacker.feed(head[:_PEEK])
        if unpacker.read_array_header() != 3:
            return -1
        request_id = unpacker.unpack()
    except msgpack.OutOfData:
        return -1 if whole else None
    except Exception:  # not an envelope: msgpack raises several classes
        return -1
    return request_id if type(request_id) is int else -1


# The bytes of an oversized body read to find its request id (an envelope's first
# element: a msgpack array header and an int take at most 10 bytes).
_PEEK = 32


class FrameDecoder:
    """Turns a byte stream into decoded msgpack objects, one per frame.

    A frame past ``max_frame`` is never buffered: ``feed`` yields an
    :class:`OversizedFrame` for it as soon as its length prefix arrives and skips its
    body as it comes, so the receiver can answer an error and keep the connection.
    ``feed`` raises :class:`ProtocolError` for a body that is not exactly one valid
    msgpack object; the connection should then be dropped, as the stream can no
    longer be trusted. ``last_size`` is the size of the frame last yielded.
    """

    def __init__(self, max_frame: int = DEFAULT_MAX_FRAME):
        self.max_frame = max_frame
        self._buf = bytearray()
        self._skip = 0  # bytes of an oversized frame's body still to come
        self.last_size = 0

    @property
    def buffered(self) -> int:
        return len(self._buf)

    def feed(self, data: bytes | bytearray | memoryview) -> Iterator[Any]:
        if self._skip:
            skipped = min(self._skip, len(data))
            self._skip -= skipped
            if skipped == len(data):
                return
            data = memoryview(data)[skipped:]
        self._buf += data
        while True:
            if len(self._buf) < HEADER_SIZE:
                return
            (length,) = _HEADER.unpack_from(self._buf)
            if length > self.max_frame:
                head = bytes(self._buf[HEADER_SIZE : HEADER_SIZE + _PEEK])
                request_id = _peek_request_id(head, whole=len(head) >= min(length, _PEEK))
                if request_id is None:
                    return  # the request id is in the body's first bytes: wait for them
                got = min(len(self._buf) - HEADER_SIZE, length)
                del self._buf[: HEADER_SIZE + got]
                self._skip = length - got
                self.last_size = HEADER_SIZE + got
                yield OversizedFrame(request_id, length, self.max_frame)
                continue  # (the buffer is empty while a body is being skipped)
            end = HEADER_SIZE + length
            if len(self._buf) < end:
                return
            body = bytes(self._buf[HEADER_SIZE:end])
            del self._buf[:end]
            self.last_size = end
            yield decode_body(body)


def decode_body(body: bytes) -> Any:
    """Strictly decode one msgpack object that must fill ``body`` exactly."""
    try:
        return msgpack.unpackb(body, raw=False, strict_map_key=True, use_list=True, timestamp=0)
    except Exception as exc:  # msgpack raises several unrelated classes
        raise errors.ProtocolError(f"undecodable frame: {type(exc).__name__}: {exc}") from None


def parse_request(obj: Any) -> Request:
    """Validate a decoded request envelope and its arguments."""
    if not (isinstance(obj, list) and len(obj) == 3):
        raise errors.ProtocolError("request must be [request_id, op, args]")
    request_id, op, args = obj
    if not isinstance(request_id, int) or isinstance(request_id, bool):
        raise errors.ProtocolError("request_id must be an int")
    if not isinstance(op, str):
        raise errors.ProtocolError("op must be a string")
    return Request(request_id, op, validate_args(op, args))


def request_id_of(obj: Any) -> int:
    """The request id of a possibly malformed envelope, or -1 if there is none."""
    if isinstance(obj, list) and obj and isinstance(obj[0], int) and not isinstance(obj[0], bool):
        return obj[0]
    return -1


def parse_response(obj: Any) -> Response:
    """Validate a decoded response envelope."""
    if not (
        isinstance(obj, list)
        and len(obj) == 3
        and isinstance(obj[0], int)
        and isinstance(obj[1], int)
    ):
        raise errors.ProtocolError("response must be [request_id, code, result_or_message]")
    request_id, code, payload = obj
    if code == 0:
        return Response(request_id, 0, payload)
    return Response(request_id, code, None, str(payload))
