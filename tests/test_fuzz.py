"""Fuzzing a live coordinator over raw sockets: structured requests (hypothesis) and raw
bytes. Whatever a peer sends, the coordinator answers with an error or drops only that
connection, stays up, keeps serving another client unchanged, and its metadata is
unchanged once the fuzzing connection is gone."""

import random
import socket
import struct
import time

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import shmkv
from shmkv import protocol
from shmkv.tools.fuzz import frame, names_any, raw_connect  # (one copy of the raw-socket helpers)

MAX_FRAME = 64 * 1024
STATE_KEYS = (
    "num_blocks",
    "free_blocks",
    "cached_blocks",
    "referenced_blocks",
    "sequences",
    "connections",
    "handoffs",
    "prefix_index_blocks",
    "evictions",
    "cow_copies",
    "published_blocks",
    "expired_handoffs",
)


class Fuzzed:
    """A coordinator, a reference client with written sequences, and checks on both."""

    def __init__(self, coord):
        self.coord = coord
        self.client = shmkv.connect(coord.address, timeout=10)
        self.handles = [self.client.allocate(n) for n in (5, 12, 1)]
        for h in self.handles:
            h.write_all(torch.randn(3, 2, h.num_tokens, 4, 8), start=0)
        self.handles.append(self.handles[1].fork())
        self.handles[1].write(0, torch.ones(2, 4, 8), torch.ones(2, 4, 8), start=0)  # a copy
        self.handles.append(self.handles[0].clone_handle())
        self.cache_ids = [h._cache_id for h in self.handles]
        self.data = [h.gather_all() for h in self.handles]
        self.tables = [h.block_table for h in self.handles]
        self.baseline = self.state()

    def state(self) -> dict:
        stats = self.client.stats()
        return {k: stats[k] for k in STATE_KEYS}

    def check(self) -> None:
        """The coordinator is up, the reference client's data and tables are unchanged,
        and so is the metadata (the fuzzing connection has been dropped by now)."""
        self.client.ping()
        assert self.state() == self.baseline
        for h, data, table in zip(self.handles, self.data, self.tables):
            h.refresh()
            assert h.block_table == table
            assert torch.equal(h.gather_all(), data)

    def close(self) -> None:
        self.client.close()


@pytest.fixture
def fuzzed(small_config, unique_name):
    with shmkv.Coordinator(small_config, name=unique_name, max_frame=MAX_FRAME) as coord:
        f = Fuzzed(coord)
        yield f
        f.close()


def exchange(sock: socket.socket, payload: bytes) -> list:
    """Send bytes, close our sending side, and read every frame until the coordinator
    closes; returns the decoded responses (each checked to be well formed)."""
    try:
        sock.sendall(payload)
    except (BrokenPipeError, ConnectionResetError):
        pass  # dropped while we were still sending: allowed
    try:
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    decoder = protocol.FrameDecoder(1 << 20)
    frames = []
    deadline = time.monotonic() + 10
    while True:
        assert time.monotonic() < deadline, "coordinator neither answered nor closed"
        try:
            data = sock.recv(1 << 16)
        except ConnectionResetError:
            break
        if not data:
            break
        frames.extend(decoder.feed(data))
    assert decoder.buffered == 0, "coordinator sent a truncated frame"
    sock.close()
    responses = [protocol.parse_response(f) for f in frames]
    for r in responses:
        assert r.code == 0 or r.code in protocol.ERROR_CODES, r
        assert r.code != 1, f"internal coordinator error (a bug, not the peer's fault): {r}"
        assert isinstance(r.message, str)
    return responses


# -- structured fuzzing ------------------------------------------------------------------


def ints():
    return st.one_of(
        st.integers(-(2**63), 2**64 - 1),
        st.integers(-3, 300),
        st.sampled_from([0, -1, 2**31, 2**32, 2**63 - 1, 2**64 - 1]),
    )


leaves = st.one_of(
    st.none(),
    st.booleans(),
    ints(),
    st.floats(allow_nan=True),
    st.text(max_size=12),
    st.binary(max_size=30),
)
values = st.recursive(
    leaves,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def cache_id_values(ref_ids):
    """Ids of the reference client's sequences (not ours), and ids nobody holds."""
    return st.one_of(
        st.sampled_from(ref_ids), st.sampled_from([0, -1, -(2**63), 2**40, 2**64 - 1]), values
    )


def request_args(op: str, ref_ids):
    spec = protocol.OPS.get(op, {})
    by_kind = {
        "int": ints(),
        "num": st.one_of(ints(), st.floats()),
        "bytes": st.binary(max_size=40),
        "str": st.text(max_size=20),
        "ints": st.lists(ints(), max_size=20),
        # token ids: a list, or packed (lengths that are not whole int64s too)
        "tokens": st.one_of(st.lists(ints(), max_size=20), st.binary(max_size=40)),
        "list": st.lists(values, max_size=4),
        "map": values,
        "bool": st.booleans(),
        "i64s": st.lists(st.integers(-(2**63), 2**63 - 1), max_size=6).map(protocol.pack_i64s),
    }

    def arg(name, kind):
        if name == "cache_id":
            return cache_id_values(ref_ids)
        if name == "cache_ids":
            return st.lists(cache_id_values(ref_ids), max_size=4)
        if name == "ids":  # a batch naming the reference client's sequences (and others)
            return st.lists(
                st.one_of(st.sampled_from(ref_ids), st.integers(-2, 2**40)), max_size=4
            ).map(protocol.pack_i64s)
        if name == "items":
            return st.lists(
                st.lists(st.one_of(cache_id_values(ref_ids), ints(), values), max_size=4),
                max_size=3,
            )
        if name == "requests":
            return st.lists(
                st.dictionaries(
                    st.sampled_from(["num_tokens", "prompt", "cache_salt", "request_id", "x"]),
                    st.one_of(ints(), st.lists(ints(), max_size=8), values),
                    max_size=3,
                ),
                max_size=3,
            )
        if name == "num_tokens":
            return st.one_of(st.integers(-2, 40), values)
        return st.one_of(by_kind[kind], values)

    fixed = st.fixed_dictionaries(
        {}, optional={name: arg(name, kind) for name, (kind, _req) in spec.items()}
    )
    odd_keys = st.dictionaries(
        st.one_of(
            st.sampled_from(sorted(spec) or ["x"]), st.text(max_size=8), st.binary(max_size=4)
        ),
        values,
        min_size=1,
        max_size=4,
    )
    return st.one_of(fixed, fixed, odd_keys, values)


@st.composite
def envelopes(draw, ref_ids):
    op = draw(st.one_of(st.sampled_from(sorted(protocol.OPS)), st.text(max_size=10)))
    request_id = draw(st.one_of(ints(), values))
    args = draw(request_args(op, ref_ids))
    shape = draw(st.integers(0, 9))
    if shape == 0:
        return draw(values)  # not an envelope at all
    if shape == 1:
        return [request_id, op]  # too short
    if shape == 2:
        return [request_id, op, args, draw(values)]  # too long
    return [request_id, op, args]


def refused_for_others(request, ref_ids) -> bool:
    """Whether a request names one of the reference client's sequences."""
    return names_any(request, ref_ids)


@settings(
    max_examples=200,
    deadline=None,
    database=None,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ],
)
@given(data=st.data())
def test_structured_requests_get_errors_and_change_nothing(fuzzed, data):
    ref_ids = fuzzed.cache_ids
    greet = data.draw(st.integers(0, 9)) > 0
    requests = data.draw(st.lists(envelopes(ref_ids), min_size=1, max_size=5))
    sock = raw_connect(fuzzed.coord.address, hello=greet)
    responses = exchange(sock, b"".join(frame(r) for r in requests))
    assert len(responses) <= len(requests)
    first = requests[0]
    if not greet and not (isinstance(first, list) and len(first) == 3 and first[1] == "hello"):
        assert responses and all(r.code for r in responses)  # nothing runs before a hello
    for request, response in zip(requests, responses):
        if refused_for_others(request, ref_ids) and response.code == 0:
            pytest.fail(f"{request!r} acted on another connection's sequence")
    dropped = len(responses) < len(requests) or any(r.code == 4 for r in responses)
    if dropped and responses:
        assert responses[-1].code == 4, "a dropped connection's last answer says why"
    fuzzed.check()


# -- raw bytes ---------------------------------------------------------------------------


def raw_inputs(rng: random.Random, count: int):
    """(name, bytes) pairs: random bytes, broken frames, odd msgpack, split requests."""
    ping = protocol.encode_request(7, "ping")
    odd_objects = [
        [1, "ping", {b"x": 1, "y": 2}],  # bytes and str keys in one map
        [1, "allocate", {"num_tokens": 1, b"prompt": [1]}],
        [1, "allocate_many", {"requests": [{b"num_tokens": 1, "z": 0}]}],
        [1, "ping", {}, 0],
        [True, "ping", {}],
        [1.5, "ping", {}],
        [None, "ping", {}],
        [2**64 - 1, "ping", {}],
        [-(2**63), "ping", {}],
        [1, b"ping", {}],
        [1, "ping", []],
        [1, "extend_many", {"items": [[1, 2, [1, 2]], {"a": 1}]}],
        [1, "release_many", {"cache_ids": [1, 1, 1, True]}],
        [1, "open", {"token": b"\x01" + b"\x00" * 24}],
        [1, "hello", {"version": 1}],
        [1, "export", {"cache_id": 1, "ttl": float("nan")}],
        [1, "allocate", {"num_tokens": 2**64 - 1}],
        [1, "allocate", {"prompt": [2**64 - 1] * 5}],
        msgpack.ExtType(5, b"xyz"),
        [1, "ping", {"": msgpack.ExtType(5, b"")}],
    ]
    timestamp_arg = b"\x93\x01\xa4ping\x81\xa0\xd6\xff\x00\x00\x00\x00"  # {"": ts}
    for i in range(count):
        kind = i % 10
        if kind == 0:
            yield "random bytes", rng.randbytes(rng.randrange(0, 200))
        elif kind == 1:
            body = rng.randbytes(rng.randrange(0, 100))
            yield "random body", struct.pack(">I", len(body)) + body
        elif kind == 2:
            full = protocol.encode_request(rng.randrange(1 << 20), "stats")
            yield "truncated frame", full[: rng.randrange(1, len(full))]
        elif kind == 3:
            yield (
                "oversized length",
                struct.pack(
                    ">I",
                    rng.choice(
                        [MAX_FRAME + 1, 2**31, 2**32 - 1, rng.randrange(MAX_FRAME + 1, 2**32)]
                    ),
                )
                + rng.randbytes(rng.randrange(0, 64)),
            )
        elif kind == 4:
            if rng.random() < 0.1:
                yield "odd msgpack timestamp", struct.pack(">I", len(timestamp_arg)) + timestamp_arg
                continue
            obj = rng.choice(odd_objects)
            yield f"odd msgpack {obj!r:.40}", frame(obj)
        elif kind == 5:
            body = bytearray(
                msgpack.packb([rng.randrange(100), "allocate", {"num_tokens": rng.randrange(9)}])
            )
            for _ in range(rng.randrange(1, 4)):
                body[rng.randrange(len(body))] = rng.randrange(256)
            yield "bit-flipped request", struct.pack(">I", len(body)) + bytes(body)
        elif kind == 6:
            yield "zero-length frame", struct.pack(">I", 0) + ping
        elif kind == 7:
            body = msgpack.packb([1, "ping", {}]) + rng.randbytes(rng.randrange(1, 8))
            yield "trailing bytes", struct.pack(">I", len(body)) + body
        elif kind == 8:
            depth = rng.randrange(1, 3000)
            body = b"\x91" * depth + b"\xc0"
            yield "deep nesting", struct.pack(">I", len(body)) + body
        else:
            yield "valid pings", ping * rng.randrange(1, 20)


def test_raw_bytes_get_errors_or_drops_and_change_nothing(fuzzed):
    rng = random.Random(20240601)
    kinds = {}
    for name, payload in raw_inputs(rng, 300):
        sock = raw_connect(fuzzed.coord.address, hello=rng.random() < 0.9)
        responses = exchange(sock, payload)
        if name == "valid pings" and responses and responses[0].code == 0:
            assert all(r.code == 0 and r.request_id == 7 for r in responses)
            assert len(responses) == len(payload) // len(protocol.encode_request(7, "ping"))
        if name == "oversized length":
            assert responses and responses[-1].code == 4
            assert (
                "exceeds the maximum" in responses[-1].message
                or "first request" in responses[-1].message
            )
        kinds[name.split(" ")[0]] = kinds.get(name.split(" ")[0], 0) + 1
        fuzzed.check()
    assert sum(kinds.values()) == 300


def test_bytes_and_str_keys_in_one_map_get_an_error(fuzzed):
    sock = raw_connect(fuzzed.coord.address)
    responses = exchange(sock, frame([3, "ping", {b"x": 1, "y": 2}]))
    assert [(r.request_id, r.code) for r in responses] == [(3, 4)]
    assert "unknown argument" in responses[0].message
    fuzzed.check()


def test_other_connections_cache_ids_are_unknown_and_untouched(fuzzed):
    sock = raw_connect(fuzzed.coord.address)
    requests = []
    for cid in fuzzed.cache_ids + [0, -5, 2**40]:
        requests += [
            ["info", {"cache_id": cid}],
            ["clone", {"cache_id": cid}],
            ["fork", {"cache_id": cid}],
            ["release", {"cache_id": cid}],
            ["release_many", {"cache_ids": [cid, cid]}],
            ["export", {"cache_id": cid, "ttl": 10.0}],
            ["commit", {"cache_id": cid, "num_tokens": 1}],
            ["prepare_write", {"cache_id": cid, "start": 0, "num_tokens": 1}],
            ["extend", {"cache_id": cid, "num_tokens": 3}],
            ["extend_many", {"items": [[cid, 1]]}],
        ]
    payload = b"".join(
        protocol.encode_request(i, op, args) for i, (op, args) in enumerate(requests, 1)
    )
    payload += protocol.encode_request(10**6, "ping")
    responses = exchange(sock, payload)
    assert len(responses) == len(requests) + 1  # not dropped: errors only
    assert all(r.code == 3 for r in responses[:-1]), [r for r in responses if r.code != 3]
    assert responses[-1].code == 0 and responses[-1].request_id == 10**6
    fuzzed.check()


def test_oversized_frame_drops_only_that_connection(fuzzed):
    bystander = raw_connect(fuzzed.coord.address)
    sock = raw_connect(fuzzed.coord.address)
    body = msgpack.packb([1, "allocate", {"prompt": list(range(MAX_FRAME))}])
    assert len(body) > MAX_FRAME
    responses = exchange(sock, struct.pack(">I", len(body)) + body)
    assert [r.code for r in responses] == [4]
    assert f"exceeds the maximum of {MAX_FRAME}" in responses[0].message
    bystander.sendall(protocol.encode_request(5, "ping"))
    assert [r.code for r in exchange(bystander, b"")] == [0]
    fuzzed.check()


def test_partial_frame_does_not_block_others(fuzzed):
    slow = raw_connect(fuzzed.coord.address)
    slow.sendall(struct.pack(">I", 1000) + b"\x93\x01")  # a frame that never completes
    t0 = time.monotonic()
    for _ in range(20):
        fuzzed.client.ping()
    assert time.monotonic() - t0 < 2.0
    other = raw_connect(fuzzed.coord.address)
    assert [r.code for r in exchange(other, protocol.encode_request(1, "stats"))] == [0]
    assert exchange(slow, b"") == []  # closed mid-frame: no answer, no harm
    fuzzed.check()


def test_wrong_types_keep_the_connection(fuzzed):
    sock = raw_connect(fuzzed.coord.address)
    requests = [
        ("allocate", {"num_tokens": "3"}),
        ("allocate", {"num_tokens": -1}),
        ("allocate", {"num_tokens": 1, "prompt": [1.5]}),
        ("allocate", {"num_tokens": 2**64 - 1}),
        ("allocate", {"num_tokens": 0, "prompt": [2**64 - 1]}),
        ("allocate_many", {"requests": [1]}),
        ("export", {"cache_id": fuzzed.cache_ids[0], "ttl": True}),
        ("open", {"token": "not bytes"}),
        ("open", {"token": b"\x01" * 25}),
        ("extend_many", {"items": [5]}),
        ("release_many", {"cache_ids": [True]}),
        ("ping", {}),
    ]
    payload = b"".join(
        protocol.encode_request(i, op, args) for i, (op, args) in enumerate(requests, 1)
    )
    codes = [r.code for r in exchange(sock, payload)]
    # a bad sub-request of allocate_many ([1]: not a map) is a wrong argument, not a broken
    # stream: it gets WrongType and the connection goes on serving the rest
    assert codes == [7, 5, 7, 2, 5, 7, 7, 7, 8, 7, 7, 0]
    fuzzed.check()
