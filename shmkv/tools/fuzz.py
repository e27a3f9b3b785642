"""Fuzz a live coordinator with structured requests and raw bytes; check it after every batch.

The coordinator runs in its own process. A reference client holds written sequences
(forked, copied on write, cloned, and a committed prompt). The fuzzer then sends
``--inputs`` inputs:

* structured requests on one greeted connection, reconnecting whenever the
  coordinator drops it: every op of the protocol with arguments that are valid, of
  the wrong type, out of range, names of other connections' sequences, or of its
  own (the ids and hand-off tokens its successful requests returned, so allocate,
  extend, commit, fork, export and open really run), plus unknown ops, broken
  envelopes and a hello out of place;
* raw bytes on fresh connections: random bytes, random bodies, truncated frames,
  oversized length prefixes, odd msgpack, bit-flipped requests, trailing bytes,
  deep nesting, valid requests split across writes.

Every answer must be a well-formed frame with a known code other than the generic one
(an internal error); a request that names a reference sequence must fail. After each
batch the fuzzing connection is closed and its hand-offs (ttl at most 0.2 s) expire;
then the coordinator process must be alive, the reference client must be served, its
sequences must hold the same blocks and bytes, and the metadata must match the baseline:
blocks referenced, sequences, hand-offs and connections exactly, and free + cached =
num_blocks - referenced (the fuzzer's own committed prompts may legitimately leave
cached blocks behind).

Prints a summary; exit status 1 on any failure. Run it as
``python -m shmkv.tools.fuzz --inputs N`` (``--help`` for the options).
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import socket
import struct
import sys
import time
from typing import Any, Dict, Optional

import msgpack
import torch

import shmkv
from shmkv import protocol

MAX_FRAME = 64 * 1024
MAX_TTL = 0.2
MUTATING = {
    "info",
    "clone",
    "fork",
    "release",
    "release_many",
    "export",
    "commit",
    "prepare_write",
    "extend",
    "extend_many",
    "extend_batch",
    "prepare_batch",
    "truncate_batch",
    "commit_batch",
}


class Failure(Exception):
    """A check failed; the message says which input and what was seen."""


# -- the reference client ----------------------------------------------------------------


class Reference:
    """A client with sequences whose blocks and bytes must never change."""

    def __init__(self, address: str, block_size: int):
        self.client = shmkv.connect(address, timeout=10)
        c = self.client
        g = torch.Generator().manual_seed(1)
        hs = [c.allocate(n) for n in (5, 17, 1, 32)]
        for h in hs:
            h.write_all(
                torch.randn(h.num_layers, 2, h.num_tokens, h.num_heads, h.head_dim, generator=g),
                start=0,
            )
        hs.append(hs[1].fork())
        hs[1].write(
            0,
            torch.ones(2, hs[1].num_heads, hs[1].head_dim),
            torch.ones(2, hs[1].num_heads, hs[1].head_dim),
            start=0,
        )
        hs.append(hs[0].clone_handle())
        self.prompt = list(range(100, 100 + 3 * block_size + 2))
        p = c.allocate(prompt=self.prompt)
        p.write_all(
            torch.randn(p.num_layers, 2, p.num_tokens, p.num_heads, p.head_dim, generator=g),
            start=0,
        )
        p.commit()
        hs.append(p)
        self.handles = hs
        self.cache_ids = sorted({h._cache_id for h in hs})
        self.data = [h.gather_all() for h in hs]
        self.tables = [h.block_table for h in hs]
        self.baseline = c.stats()

    def check(self) -> None:
        c = self.client
        c.ping()
        stats = c.stats()
        base = self.baseline
        for key in ("num_blocks", "referenced_blocks", "sequences", "handoffs", "connections"):
            if stats[key] != base[key]:
                raise Failure(f"stats[{key!r}] is {stats[key]}, was {base[key]}")
        if (
            stats["free_blocks"] + stats["cached_blocks"]
            != stats["num_blocks"] - stats["referenced_blocks"]
        ):
            raise Failure(f"block states do not add up: {stats}")
        for h, data, table in zip(self.handles, self.data, self.tables):
            h.refresh()
            if h.block_table != table:
                raise Failure(f"{h.cache_id}: block table {h.block_table} was {table}")
            if not torch.equal(h.gather_all(), data):
                raise Failure(f"{h.cache_id}: bytes changed")


# -- connections -------------------------------------------------------------------------


def frame(obj) -> bytes:
    body = msgpack.packb(obj, use_bin_type=True)
    return struct.pack(">I", len(body)) + body


def raw_connect(address: str, hello: bool = True) -> socket.socket:
    """A raw socket, greeted with a valid hello (the passed descriptors are closed)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    sock.connect(address)
    if hello:
        sock.sendall(protocol.encode_request(0, "hello", {"version": protocol.PROTOCOL_VERSION}))
        decoder = protocol.FrameDecoder()
        while True:
            data, fds, _flags, _addr = socket.recv_fds(sock, 1 << 16, 4)
            for fd in fds:
                os.close(fd)
            if not data:
                raise Failure("coordinator closed a connection during hello")
            frames = list(decoder.feed(data))
            if frames:
                if protocol.parse_response(frames[0]).code != 0:
                    raise Failure(f"hello refused: {frames[0]!r}")
                return sock
    return sock


def check_response(obj, what: str) -> protocol.Response:
    try:
        response = protocol.parse_response(obj)
    except shmkv.ProtocolError as exc:
        raise Failure(f"{what}: malformed response {obj!r:.200}: {exc}") from None
    if response.code and response.code not in protocol.ERROR_CODES:
        raise Failure(f"{what}: unknown error code {response.code}")
    if response.code == 1:  # the generic code: an internal error, not the peer's fault
        raise Failure(f"{what}: internal coordinator error: {response.message}")
    return response


def exchange(sock: socket.socket, payload: bytes, what: str) -> list:
    """Send, close our side, read every frame until the coordinator closes."""
    try:
        sock.sendall(payload)
    except (BrokenPipeError, ConnectionResetError):
        pass
    try:
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    decoder = protocol.FrameDecoder(1 << 20)
    frames: list = []
    try:
        while True:
            data = sock.recv(1 << 16)
            if not data:
                break
            frames.extend(decoder.feed(data))
    except ConnectionResetError:
        pass
    except socket.timeout:
        raise Failure(f"{what}: no answer and no close within 5 s") from None
    finally:
        sock.close()
    if decoder.buffered:
        raise Failure(f"{what}: truncated response frame")
    return [check_response(f, what) for f in frames]


class Session:
    """The structured fuzzer's connection and what its own requests have created."""

    def __init__(self, address: str):
        self.address = address
        self.sock: Optional[socket.socket] = None
        self.decoder = protocol.FrameDecoder(1 << 20)
        self.own_ids: list = []
        self.tokens: list = []
        self.reconnects = 0

    def ensure(self) -> None:
        if self.sock is None:
            self.sock = raw_connect(self.address)
            self.decoder = protocol.FrameDecoder(1 << 20)
            self.own_ids, self.tokens = [], []
            self.reconnects += 1

    def close(self) -> None:
        if self.sock is not None:
            exchange(self.sock, b"", "closing the fuzzing connection")
            self.sock = None

    def roundtrip(self, payload: bytes, what: str):
        """Send one request; returns its response, or None when the connection dropped
        without one (then the next call reconnects)."""
        self.ensure()
        sock = self.sock
        assert sock is not None  # (ensure connected it)
        try:
            sock.sendall(payload)
        except (BrokenPipeError, ConnectionResetError):
            pass
        try:
            while True:
                data = sock.recv(1 << 16)
                if not data:
                    break
                frames = list(self.decoder.feed(data))
                if frames:
                    if len(frames) > 1:
                        raise Failure(f"{what}: {len(frames)} answers to one request")
                    return check_response(frames[0], what)
        except ConnectionResetError:
            pass
        except socket.timeout:
            raise Failure(f"{what}: no answer within 5 s") from None
        sock.close()
        self.sock = None
        return None

    def dropped(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


# -- generators --------------------------------------------------------------------------


class Gen:
    """Random inputs, valid or nearly so, from a seeded generator."""

    def __init__(self, rng: random.Random, ref: Reference, session: Session):
        self.rng = rng
        self.ref = ref
        self.session = session
        self.vocab = ref.prompt + list(range(5000, 5040))
        self.ops = sorted(op for op in protocol.OPS if op != "hello")

    def value(self, depth: int = 0):
        r = self.rng.random()
        rng = self.rng
        if depth < 3 and r < 0.15:
            return [self.value(depth + 1) for _ in range(rng.randrange(4))]
        if depth < 3 and r < 0.25:
            return {self.text(): self.value(depth + 1) for _ in range(rng.randrange(3))}
        return rng.choice(
            [
                None,
                True,
                False,
                rng.randrange(-5, 300),
                rng.getrandbits(64),
                -rng.getrandbits(63),
                rng.random() * 1e6,
                float("nan"),
                float("inf"),
                self.text(),
                rng.randbytes(rng.randrange(30)),
            ]
        )

    def text(self) -> str:
        return "".join(self.rng.choice("abcxyz_é\u2603") for _ in range(self.rng.randrange(8)))

    def int_(self):
        rng = self.rng
        return rng.choice(
            [
                rng.randrange(0, 40),
                rng.randrange(0, 40),
                rng.randrange(-3, 3),
                2**31,
                2**63 - 1,
                2**64 - 1,
                -(2**63),
                rng.getrandbits(40),
            ]
        )

    def cache_id(self):
        r = self.rng.random()
        own = self.session.own_ids
        if r < 0.45 and own:
            return self.rng.choice(own)
        if r < 0.65:
            return self.rng.choice(self.ref.cache_ids)
        if r < 0.85:
            return self.rng.choice([0, -1, 2**40, 2**64 - 1, self.rng.randrange(1000, 2000)])
        return self.value()

    def tokens(self, n=None):
        n = self.rng.randrange(0, 20) if n is None else n
        if self.rng.random() < 0.5:
            start = self.rng.randrange(len(self.ref.prompt))
            return (self.ref.prompt[:start] + [self.rng.choice(self.vocab) for _ in range(n)])[
                : max(n, 1)
            ]
        return [self.rng.choice(self.vocab) for _ in range(n)]

    def token(self):
        r = self.rng.random()
        tokens = self.session.tokens
        if r < 0.4 and tokens:
            return self.rng.choice(tokens)
        if r < 0.6 and tokens:
            t = bytearray(self.rng.choice(tokens))
            t[self.rng.randrange(len(t))] ^= 1 << self.rng.randrange(8)
            return bytes(t)
        return self.rng.choice(
            [
                b"\x01" + self.rng.randbytes(24),
                self.rng.randbytes(25),
                b"",
                self.rng.randbytes(self.rng.randrange(60)),
            ]
        )

    def arg(self, op: str, name: str, kind: str):
        rng = self.rng
        if rng.random() < 0.15:
            return self.value()
        if name == "cache_id":
            return self.cache_id()
        if name == "cache_ids":
            return [self.cache_id() for _ in range(rng.randrange(4))]
        if kind == "i64s":  # batch arrays: ids of sequences, or counts, starts, lengths
            count = rng.randrange(5)
            if name == "ids":
                values = [self.cache_id() for _ in range(count)]
            else:
                values = [rng.choice([0, 1, 2, 7, -1, 2**40]) for _ in range(count)]
            values = [v if type(v) is int and -(2**63) <= v < 2**63 else 0 for v in values]
            data = protocol.pack_i64s(values)
            return data if rng.random() > 0.1 else data[: rng.randrange(len(data) + 1)]
        if name in ("num_tokens", "start"):
            return self.int_()
        if name == "prompt":
            return self.tokens()
        if name == "tokens":
            return self.tokens()
        if name == "token":
            return self.token()
        if name == "ttl":
            return rng.choice(
                [
                    rng.uniform(0.01, MAX_TTL),
                    rng.uniform(0.01, MAX_TTL),
                    0,
                    -1.0,
                    MAX_TTL * 10,
                    float("nan"),
                ]
            )
        if name == "version":
            return rng.choice([protocol.PROTOCOL_VERSION, 0, 2, -1])
        if name in ("tp_rank", "tp_size", "pid"):
            return rng.choice([0, 1, -1, 2, None])
        if name == "cache_salt":
            return rng.randbytes(rng.randrange(0, 20))
        if name == "request_id":
            return self.text()
        if name == "items":
            items = []
            for _ in range(rng.randrange(4)):
                n = self.int_() if rng.random() < 0.2 else rng.randrange(0, 9)
                item = [self.cache_id(), n]
                if rng.random() < 0.4:
                    item.append(self.tokens(n if isinstance(n, int) and 0 <= n < 50 else None))
                items.append(item if rng.random() > 0.1 else self.value())
            return items
        if name == "requests":
            reqs = []
            for _ in range(rng.randrange(4)):
                req: Dict[str, Any] = {"num_tokens": rng.randrange(0, 30)}
                if rng.random() < 0.5:
                    req["prompt"] = self.tokens()
                    req["num_tokens"] = rng.choice([0, len(req["prompt"]), 3])
                if rng.random() < 0.1:
                    req[rng.choice(["cache_salt", "request_id", "bogus", "num_tokens"])] = (
                        self.value()
                    )
                reqs.append(req if rng.random() > 0.05 else self.value())
            return reqs
        return self.value()

    def request(self):
        """A structured request (a decoded envelope) and the op it names."""
        rng = self.rng
        r = rng.random()
        if r < 0.95:
            op = rng.choice(self.ops)
        elif r < 0.96:
            op = "hello"
        else:
            op = rng.choice(["", "nope", "_op_stats", "__init__", "stats ", "PING", self.text()])
        spec = protocol.OPS.get(op, {})
        args = {}
        for name, (kind, required) in spec.items():
            if rng.random() < (0.97 if required else 0.5):
                args[name] = self.arg(op, name, kind)
        if rng.random() < 0.04:
            args[rng.choice([self.text(), "x"])] = self.value()
        if rng.random() < 0.02:
            args = self.value()
        request_id = rng.randrange(1, 1 << 30)
        envelope = [request_id, op, args]
        r = rng.random()
        if r < 0.01:
            envelope = self.value()
        elif r < 0.02:
            envelope = envelope[:2]
        elif r < 0.03:
            envelope.append(self.value())
        elif r < 0.04:
            envelope[0] = rng.choice([True, 1.5, None, "1", -1])
        return envelope, op

    def raw(self):
        """(kind, bytes, greet) for one raw-bytes input on a fresh connection."""
        rng = self.rng
        kind = rng.randrange(10)
        ping = protocol.encode_request(7, "ping")
        if kind == 0:
            return "random bytes", rng.randbytes(rng.randrange(0, 300)), rng.random() < 0.8
        if kind == 1:
            body = rng.randbytes(rng.randrange(0, 200))
            return "random body", struct.pack(">I", len(body)) + body, True
        if kind == 2:
            full = protocol.encode_request(rng.randrange(1 << 20), "stats")
            return "truncated frame", full[: rng.randrange(1, len(full))], True
        if kind == 3:
            size = rng.choice(
                [MAX_FRAME + 1, 2**31, 2**32 - 1, rng.randrange(MAX_FRAME + 1, 2**32)]
            )
            return "oversized length", struct.pack(">I", size) + rng.randbytes(64), True
        if kind == 4:
            envelope, _ = self.request()
            keys = {b"x": 1, "y": 2} if rng.random() < 0.3 else {}
            if (
                keys
                and isinstance(envelope, list)
                and len(envelope) == 3
                and isinstance(envelope[2], dict)
            ):
                envelope[2].update(keys)
            return "odd msgpack", frame(envelope), rng.random() < 0.9
        if kind == 5:
            envelope, _ = self.request()
            flipped = bytearray(msgpack.packb(envelope, use_bin_type=True))
            for _ in range(rng.randrange(1, 4)):
                flipped[rng.randrange(len(flipped))] = rng.randrange(256)
            return "bit-flipped request", struct.pack(">I", len(flipped)) + bytes(flipped), True
        if kind == 6:
            return "zero-length frame", struct.pack(">I", 0) + ping, True
        if kind == 7:
            body = msgpack.packb([1, "ping", {}]) + rng.randbytes(rng.randrange(1, 8))
            return "trailing bytes", struct.pack(">I", len(body)) + body, True
        if kind == 8:
            body = rng.choice([b"\x91", b"\x81\xa1a"]) * rng.randrange(1, 5000) + b"\xc0"
            return "deep nesting", struct.pack(">I", len(body)) + body, True
        return "split pings", ping * rng.randrange(1, 10), rng.random() < 0.9


def names_any(envelope, ref_ids) -> bool:
    """Whether a request envelope names one of ``ref_ids`` (any op)."""
    if not (isinstance(envelope, list) and len(envelope) == 3 and isinstance(envelope[2], dict)):
        return False
    args = envelope[2]
    named = [args.get("cache_id")]
    if isinstance(args.get("cache_ids"), list):
        named += args["cache_ids"]
    if isinstance(args.get("items"), list):
        named += [i[0] for i in args["items"] if isinstance(i, list) and i]
    ids = args.get("ids")
    if isinstance(ids, bytes) and len(ids) % 8 == 0:
        named += list(protocol.unpack_i64s(ids))
    return any(type(x) is int and x in ref_ids for x in named)


def names_reference(envelope, ref_ids) -> bool:
    """Whether a mutating request names one of ``ref_ids``."""
    return names_any(envelope, ref_ids) and envelope[1] in MUTATING


# -- the run -----------------------------------------------------------------------------


def run(args) -> int:
    rng = random.Random(args.seed)
    cfg = shmkv.PoolConfig(
        num_layers=2,
        num_kv_heads=2,
        head_dim=8,
        num_blocks=args.num_blocks,
        block_size=4,
        dtype=torch.float32,
    )
    name = f"fuzz-{os.getpid()}"
    coord = shmkv.Coordinator.spawn(
        cfg, name=name, max_frame=MAX_FRAME, max_handoff_ttl=MAX_TTL, max_handoffs=64
    )
    ref = Reference(coord.address, cfg.block_size)
    session = Session(coord.address)
    gen = Gen(rng, ref, session)
    ref_ids = set(ref.cache_ids)
    kinds: collections.Counter = collections.Counter()
    codes: collections.Counter = collections.Counter()
    code_names = {0: "ok", **{c: cls.__name__ for c, cls in protocol.ERROR_CODES.items()}}
    drops = 0
    silent_drops = 0
    batches = 0
    failure = None
    recent: collections.deque = collections.deque(maxlen=5)
    done = 0
    t0 = time.monotonic()
    try:
        while done < args.inputs:
            for _ in range(min(args.batch, args.inputs - done)):
                done += 1
                if rng.random() < args.raw_fraction:
                    kind, payload, greet = gen.raw()
                    recent.append((kind, payload[:200], greet))
                    kinds["raw: " + kind] += 1
                    sock = raw_connect(coord.address, hello=greet)
                    responses = exchange(sock, payload, f"raw input #{done} ({kind})")
                    for r in responses:
                        codes[code_names.get(r.code, r.code)] += 1
                    if kind == "oversized length" and (not responses or responses[-1].code != 4):
                        raise Failure(f"raw input #{done}: oversized length not refused")
                    continue
                envelope, op = gen.request()
                recent.append(("structured", envelope, True))
                kinds["structured: " + (op if op in protocol.OPS else "unknown op")] += 1
                try:
                    payload = frame(envelope)
                except (OverflowError, TypeError, ValueError):
                    kinds["structured: unencodable"] += 1
                    continue
                response = session.roundtrip(payload, f"input #{done} {envelope!r:.200}")
                if response is None:
                    drops += 1
                    silent_drops += 1
                    continue
                codes[code_names.get(response.code, response.code)] += 1
                if response.code == 4:
                    drops += 1
                    session.dropped()
                    continue
                if names_reference(envelope, ref_ids) and response.code == 0:
                    raise Failure(f"input #{done} acted on a reference sequence: {envelope!r}")
                if (
                    response.code == 0
                    and isinstance(response.result, dict)
                    and "cache_id" in response.result
                ):
                    session.own_ids.append(response.result["cache_id"])
                if response.code == 0 and isinstance(response.result, list):
                    for item in response.result:
                        if isinstance(item, dict) and "cache_id" in item:
                            session.own_ids.append(item["cache_id"])
                if response.code == 0 and op == "export":
                    session.tokens.append(response.result)
                if (
                    isinstance(envelope, list)
                    and len(envelope) == 3
                    and type(envelope[0]) is int
                    and response.request_id != envelope[0]
                ):
                    raise Failure(
                        f"input #{done}: answer for request {response.request_id}, "
                        f"sent {envelope[0]}"
                    )
            session.close()
            deadline = time.monotonic() + 5
            while True:
                if not coord.is_alive():
                    raise Failure("the coordinator process died")
                stats = ref.client.stats()
                if (
                    stats["handoffs"] == ref.baseline["handoffs"]
                    and stats["connections"] == ref.baseline["connections"]
                ):
                    break
                if time.monotonic() > deadline:
                    break
                time.sleep(0.02)
            ref.check()
            batches += 1
            if not args.quiet and sys.stderr.isatty():
                rate = done / (time.monotonic() - t0)
                print(
                    f"\r{done}/{args.inputs} inputs, {batches} batches checked, "
                    f"{rate:.0f} inputs/s",
                    end="",
                    file=sys.stderr,
                    flush=True,
                )
    except Failure as exc:
        failure = str(exc)
    except shmkv.ShmkvError as exc:
        failure = f"reference client: {type(exc).__name__}: {exc}"
    except OSError as exc:
        failure = f"{type(exc).__name__}: {exc}"
    if failure is not None:
        coord.process.join(1.0)
        if not coord.is_alive():
            failure += f" (the coordinator process died, exit code {coord.process.exitcode})"
    elapsed = time.monotonic() - t0
    if not args.quiet and sys.stderr.isatty():
        print(file=sys.stderr)
    alive = coord.is_alive()
    try:
        final = ref.client.stats() if failure is None else {}
    except shmkv.ShmkvError:
        final = {}
    ref.client.close()
    coord.stop()
    socket_left = os.path.exists(coord.address)
    shm_left = [n for n in os.listdir("/dev/shm") if n.startswith("shmkv-")]

    print(
        f"shmkv fuzz: {done} inputs in {elapsed:.1f} s ({done / max(elapsed, 1e-9):.0f}/s), "
        f"seed {args.seed}, {batches} batches of up to {args.batch} checked"
    )
    structured = sum(v for k, v in kinds.items() if k.startswith("structured"))
    print(f"  structured requests: {structured}; raw-bytes inputs: {done - structured}")
    for kind, count in sorted(kinds.items()):
        print(f"    {kind:<36} {count:>7}")
    print("  answers by code: " + ", ".join(f"{k} {v}" for k, v in codes.most_common()))
    print(
        f"  structured connections dropped by the coordinator: {drops} ({silent_drops} "
        f"without an error frame); reconnects: {session.reconnects}"
    )
    if final:
        print(
            f"  coordinator: {final['ops']} ops served, {final['dropped_connections']} "
            f"connections dropped, evictions {final['evictions']}, prefix hit tokens "
            f"{final['prefix_hit_tokens']}, expired hand-offs {final['expired_handoffs']}, "
            f"copy-on-write {final['cow_copies']}"
        )
        print(
            f"  reference client after all batches: {len(ref.handles)} sequences, "
            f"blocks and bytes unchanged; referenced {final['referenced_blocks']}, "
            f"sequences {final['sequences']}, hand-offs {final['handoffs']}, "
            f"connections {final['connections']} (as at the start)"
        )
    print(
        f"  coordinator alive at the end: {alive}; socket left after stop: {socket_left}; "
        f"/dev/shm entries: {len(shm_left)}"
    )
    if failure:
        print(f"FAILED after input #{done}: {failure}")
        print("  last inputs:")
        for item in recent:
            print(f"    {item!r:.300}")
        return 1
    if not alive or socket_left or shm_left:
        print("FAILED: coordinator state after the run")
        return 1
    print(
        "PASSED: every input got a well-formed error or answer, or a drop of only its "
        "connection; the coordinator stayed up and the reference client saw no change"
    )
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--inputs", type=int, default=100_000)
    p.add_argument("--batch", type=int, default=1000, help="inputs between checks")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--raw-fraction", type=float, default=0.3)
    p.add_argument("--num-blocks", type=int, default=256)
    p.add_argument("--quiet", action="store_true")
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
