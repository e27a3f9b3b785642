"""The sans-IO protocol: framing, strict decoding, validation, error codes (no sockets)."""

import msgpack
import pytest

from shmkv import errors, protocol


def test_frames_split_anywhere_decode_the_same():
    frames = b"".join(protocol.encode_request(i, "ping") for i in range(5))
    for cut in range(1, len(frames)):
        decoder = protocol.FrameDecoder()
        got = list(decoder.feed(frames[:cut])) + list(decoder.feed(frames[cut:]))
        assert [protocol.parse_request(o).request_id for o in got] == list(range(5))


def test_oversized_length_prefix_refused_before_buffering():
    decoder = protocol.FrameDecoder(max_frame=1024)
    got = list(decoder.feed((10**9).to_bytes(4, "big") + b"x"))
    assert len(got) == 1 and isinstance(got[0], protocol.OversizedFrame)
    assert got[0].length == 10**9 and got[0].request_id == -1
    assert "exceeds the maximum of 1024" in str(got[0].error())
    assert isinstance(got[0].error(), errors.ProtocolError)
    assert decoder.buffered < 1024
    assert list(decoder.feed(b"y" * 4096)) == [] and decoder.buffered == 0  # skipped


def test_undecodable_and_trailing_bytes_rejected():
    body = msgpack.packb([1, "ping", {}]) + b"\xc1"
    with pytest.raises(errors.ProtocolError, match="undecodable"):
        list(protocol.FrameDecoder().feed(len(body).to_bytes(4, "big") + body))
    with pytest.raises(errors.ProtocolError):
        list(protocol.FrameDecoder().feed(b"\x00\x00\x00\x01\xc1"))


def test_non_string_map_keys_rejected():
    body = msgpack.packb([1, "allocate", {1: 2}])
    with pytest.raises(errors.ProtocolError):
        list(protocol.FrameDecoder().feed(len(body).to_bytes(4, "big") + body))


@pytest.mark.parametrize(
    "obj, match",
    [
        ([1, "nope", {}], "unknown op"),
        ([1, "allocate", {"num_tokens": 1, "evil": 1}], "unknown argument"),
        ([1, "extend", {"cache_id": 1}], "missing argument"),
        ("hello", "request must be"),
        ([True, "ping", {}], "request_id"),
        ([1, 2, {}], "op must be"),
        ([1, "ping", []], "must be a map"),
    ],
)
def test_malformed_requests(obj, match):
    with pytest.raises(errors.ProtocolError, match=match):
        protocol.parse_request(obj)


def test_wrong_argument_types_are_type_errors():
    with pytest.raises(errors.WrongType, match="num_tokens"):
        protocol.parse_request([1, "allocate", {"num_tokens": "7"}])
    with pytest.raises(TypeError):
        protocol.parse_request([1, "allocate", {"num_tokens": 1, "prompt": [1, True]}])


def test_error_codes_round_trip_to_the_same_class():
    for code, cls in protocol.ERROR_CODES.items():
        response = protocol.parse_response(
            msgpack.unpackb(protocol.encode_error(7, cls("boom"))[4:], raw=False)
        )
        assert response.code == code
        with pytest.raises(cls, match="boom"):
            response.unwrap()


def test_two_peers_over_a_fake_link():
    """A client-side encoder and a server-side decoder joined by a byte string."""
    link = protocol.encode_request(3, "extend", {"cache_id": 9, "num_tokens": 2})
    (obj,) = protocol.FrameDecoder().feed(link)
    request = protocol.parse_request(obj)
    assert request == protocol.Request(
        3, "extend", {"cache_id": 9, "num_tokens": 2, "tokens": None}
    )
    reply = protocol.encode_ok(request.request_id, {"start": 0})
    (robj,) = protocol.FrameDecoder().feed(reply)
    assert protocol.parse_response(robj).unwrap() == {"start": 0}


def test_protocol_and_allocator_import_without_torch():
    import subprocess
    import sys

    # the package __init__ imports torch, so load the pure modules as a bare package
    code = (
        "import sys, importlib.util, types; sys.modules['torch'] = None\n"
        "pkg = types.ModuleType('shmkv'); pkg.__path__ = ['shmkv']\n"
        "sys.modules['shmkv'] = pkg\n"
        "import shmkv.protocol, shmkv.hashing\n"
        "import shmkv.coordinator.allocator, shmkv.coordinator.sequences\n"
        "import shmkv.memory.layout\n"
    )
    subprocess.run(
        [sys.executable, "-c", code],
        check=True,
        timeout=60,
        cwd=__import__("os").path.dirname(__import__("os").path.dirname(__file__)),
    )
