"""Suite ``remote``: benchmarks beyond one node: pulls from Redis, moves over Gloo, a
two-node chat trace.

1. Pull bandwidth: node A publishes a prompt's blocks to a real ``redis-server``;
   node B (a cold pool) allocates the same prompt, which pulls every block from the
   store into its pool (lookup, checks, copies). Against: a raw pipelined ``GET`` of
   the same keys on the same connection (B's reader client). Timed end to end as the
   allocate call, median of the repeats.
2. Prefill -> decode move: ``shmkv.integrations.distributed.send_sequence`` / ``recv_sequence``
   between two processes, each with its own coordinator, over Gloo on loopback.
   Against: a raw ``send``/``recv`` of the same bytes plus the same one-word ack.
3. Two-node chat trace: multi-turn conversations whose turns a load balancer without
   session affinity sends to node A or B at random; each turn's prompt is the
   conversation so far. Prefill tokens each node computes, with and without the shared
   store (each node's own prefix cache in both runs). Between turns the write-behind
   queue drains (a user's think time).

Run: ``shmkv bench --only remote [--quick]``; writes
``benchmarks/results/remote.json`` and ``remote.md``. Needs ``redis-server`` on PATH
(``./scripts/setup.sh test`` installs it).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Any, Dict, List, Optional

import torch

import shmkv
from shmkv import hashing
from shmkv.bench.core import BenchError, result_base, trace_path, write_results
from shmkv.tiers.redis_store import RemoteTierSet


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self):
        import redis

        binary = shutil.which("redis-server") or shutil.which("valkey-server")
        if binary is None:
            sys.exit("bench_remote: no redis-server on PATH; run ./scripts/setup.sh test")
        self.dir = tempfile.mkdtemp(prefix="shmkv-bench-redis-")
        self.port = free_port()
        self.proc = subprocess.Popen(
            [
                binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self.dir,
                "--maxmemory-policy",
                "allkeys-lru",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(port=self.port, socket_timeout=1)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.RedisError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    sys.exit("bench_remote: redis-server did not start")
                time.sleep(0.02)
        self.version = client.info("server")["redis_version"]
        client.close()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


def _name(tag: str) -> str:
    return f"bench-remote-{tag}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def _digest(t: torch.Tensor) -> str:
    import hashlib

    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _redis_store(coord: shmkv.Coordinator) -> RemoteTierSet:
    """The store over the coordinator's :class:`shmkv.RedisTier` (its tiers here)."""
    store = coord.tiers
    if not isinstance(store, RemoteTierSet):
        raise BenchError(
            f"the coordinator's tiers are {type(store).__name__}, not a store over a RedisTier"
        )
    return store


def _kv(h, start: int, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(h.num_layers, 2, n, h.num_heads, h.head_dim, generator=g).to(h.dtype)


# -- 1. pull bandwidth ------------------------------------------------------------------------


def bench_pull(server: RedisServer, cfg: shmkv.PoolConfig, num_blocks: int, repeat: int):
    prompt = list(range(7, 7 + num_blocks * cfg.block_size))

    def tiers() -> list:
        return [shmkv.RedisTier(server.url, timeout=5.0, ttl=None)]

    with (
        shmkv.Coordinator(cfg, name=_name("a"), tiers=tiers()) as a,
        shmkv.Coordinator(cfg, name=_name("b"), tiers=tiers()) as b,
        shmkv.connect(a.address, timeout=60) as ca,
        shmkv.connect(b.address, timeout=60) as cb,
    ):
        h = ca.allocate(prompt=prompt)
        h.write_all(_kv(h, 0, len(prompt), 1), start=0)
        h.commit()
        assert _redis_store(a).flush(60), "write-behind did not drain"
        store = _redis_store(b)
        chain = hashing.block_keys(prompt, cfg.block_size, hashing.root_key(None))
        names = store.codec.names(chain, 0, num_blocks)
        conn = store._client("get")  # the reader's client: the same connection

        def raw():
            pipe = conn.pipeline(transaction=False)
            for name in names:
                pipe.get(name)
            values = pipe.execute()
            assert all(v is not None for v in values)

        from shmkv.tiers.redis_store import BATCH_BYTES, GET_BATCH

        span = max(1, min(GET_BATCH, BATCH_BYTES // store.codec.value_nbytes))

        def raw_spans():  # the same pipelines the tier sends, one after another
            for lo in range(0, len(names), span):
                pipe = conn.pipeline(transaction=False)
                for name in names[lo : lo + span]:
                    pipe.get(name)
                assert all(v is not None for v in pipe.execute())

        def evict():  # a cold pool on B: fill it with a plain sequence, then free it
            with cb.allocate(cfg.num_blocks * cfg.block_size):
                pass

        def pull():
            hb = cb.allocate(prompt=prompt)
            assert hb.num_cached_tokens == len(prompt), hb.num_cached_tokens
            hb.close()

        raw_t, spans_t, pull_t = [], [], []
        evict()
        pull()  # warm-up: connections, buffers
        for _ in range(repeat):
            evict()
            t0 = time.perf_counter()
            raw()
            raw_t.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            raw_spans()
            spans_t.append(time.perf_counter() - t0)
            evict()
            t0 = time.perf_counter()
            pull()
            pull_t.append(time.perf_counter() - t0)
        expected = h.gather_all()
        hb = cb.allocate(prompt=prompt)
        exact = torch.equal(hb.gather_all(), expected)
        hb.close()
        stats = store.store_stats()
    nbytes = num_blocks * store.codec.value_nbytes
    raw_s, pull_s = statistics.median(raw_t), statistics.median(pull_t)
    spans_s = statistics.median(spans_t)
    return {
        "blocks": num_blocks,
        "block_bytes": cfg.block_nbytes,
        "value_bytes": nbytes,
        "raw_spans_s": spans_s,
        "raw_spans_gbps": nbytes / spans_s / 1e9,
        "span_blocks": span,
        "ratio_spans": spans_s / pull_s,
        "raw_get_s": raw_s,
        "pull_s": pull_s,
        "raw_get_gbps": nbytes / raw_s / 1e9,
        "pull_gbps": nbytes / pull_s / 1e9,
        "ratio": raw_s / pull_s,
        "exact": exact,
        "repeat": repeat,
        "corrupt": stats["corrupt"],
        "errors": stats["errors"],
    }


# -- 2. prefill -> decode over Gloo ---------------------------------------------------------------


def _move_node(rank, port, cfg_wire, num_tokens, repeat, results):
    from shmkv.integrations import distributed as sd

    torch.distributed.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        cfg = shmkv.PoolConfig.from_wire(cfg_wire)
        nbytes = -(-num_tokens // cfg.block_size) * cfg.block_nbytes
        with (
            shmkv.Coordinator(cfg, name=_name(f"m{rank}")) as coord,
            shmkv.connect(coord.address, timeout=60) as client,
        ):
            raw = torch.zeros(nbytes, dtype=torch.uint8)
            ack = torch.zeros(1, dtype=torch.int64)
            raw_t, move_t = [], []
            if rank == 0:
                h = client.allocate(num_tokens)
                h.write_all(_kv(h, 0, num_tokens, 2), start=0)
                h.commit()
                raw.copy_(torch.randint(0, 255, (nbytes,), dtype=torch.uint8))
            for i in range(repeat + 1):
                torch.distributed.barrier()
                t0 = time.perf_counter()
                if rank == 0:
                    torch.distributed.send(raw, 1)
                    torch.distributed.recv(ack, 1)
                else:
                    torch.distributed.recv(raw, 0)
                    torch.distributed.send(ack, 0)
                t_raw = time.perf_counter() - t0
                torch.distributed.barrier()
                t0 = time.perf_counter()
                if rank == 0:
                    stats = sd.send_sequence(h, 1, timeout=60)
                    t_move = time.perf_counter() - t0
                else:
                    hb = sd.recv_sequence(client, 0, timeout=60)
                    t_move = time.perf_counter() - t0
                    if i == repeat:
                        results.put(("b_digest", _digest(hb.gather_all())))
                    hb.close()
                if i:  # the first round warms up
                    raw_t.append(t_raw)
                    move_t.append(t_move)
            if rank == 0:
                results.put(
                    (
                        "a",
                        {
                            "raw_s": statistics.median(raw_t),
                            "move_s": statistics.median(move_t),
                            "sent_bytes": stats.sent_bytes,
                            "bytes": nbytes,
                            "digest": _digest(h.gather_all()),
                        },
                    )
                )
            else:
                results.put(("b", None))
    except BaseException as exc:
        results.put(("error", f"node {rank}: {type(exc).__name__}: {exc}"))
        raise
    finally:
        torch.distributed.destroy_process_group()


def bench_move(cfg: shmkv.PoolConfig, num_tokens: int, repeat: int):
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_move_node, args=(r, port, cfg.to_wire(), num_tokens, repeat, results))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    got: Dict[str, Any] = {}
    try:
        while len(got) < 3:  # a, b and b_digest
            tag, value = results.get(timeout=600)
            if tag == "error":
                raise RuntimeError(value)
            got[tag] = value
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    a = got["a"]
    exact = a["digest"] == got["b_digest"]
    return {
        "tokens": num_tokens,
        "bytes": a["bytes"],
        "raw_s": a["raw_s"],
        "move_s": a["move_s"],
        "raw_gbps": a["bytes"] / a["raw_s"] / 1e9,
        "move_gbps": a["bytes"] / a["move_s"] / 1e9,
        "ratio": a["raw_s"] / a["move_s"],
        "exact": exact,
        "repeat": repeat,
    }


# -- 3. two-node chat trace ---------------------------------------------------------------------


def chat_trace(num_sessions: int, num_turns: int, seed: int = 0) -> list:
    """Requests ``(session, turn, prompt, reply)`` in arrival order: every session shares
    a system prompt; each turn adds a user message, and the reply is decoded after it."""
    rng = random.Random(seed)
    system = [rng.randrange(1, 32000) for _ in range(256)]
    history = {s: list(system) for s in range(num_sessions)}
    requests = []
    for turn in range(num_turns):
        order = list(range(num_sessions))
        rng.shuffle(order)
        for s in order:
            user = [rng.randrange(1, 32000) for _ in range(rng.randint(24, 96))]
            reply = [rng.randrange(1, 32000) for _ in range(rng.randint(32, 160))]
            prompt = history[s] + user
            requests.append((s, turn, prompt, reply))
            history[s] = prompt + reply
    return requests


def _serve(client, prompt, reply, seed):
    """One request on a node: prefill what is not cached, decode the reply, commit."""
    h = client.allocate(prompt=prompt)
    cached = h.num_cached_tokens
    n = len(prompt) - cached
    h.write_all(_kv(h, cached, n, seed), start=cached)
    h.commit()
    start = h.extend(len(reply), tokens=reply)  # the reply's K/V, as decode writes it
    h.write_all(_kv(h, start, len(reply), seed + 1), start=start)
    h.commit()
    h.close()
    return len(prompt), n


def committed_trace(path: Optional[str] = None) -> list:
    """The tiers benchmark's committed chat trace (a shared system prompt, growing
    conversations) as ``(session, turn, prompt, reply)`` requests in arrival order."""
    with open(path or trace_path()) as f:
        lines = [json.loads(line) for line in f]
    header, requests = lines[0], lines[1:]
    history: Dict[int, List[int]] = {}
    turns: Dict[int, int] = {}
    out = []
    for r in requests:
        s = r["session"]
        prompt = history.get(s, list(header["system"])) + r["user"]
        out.append((s, turns.get(s, 0), prompt, r["reply"]))
        history[s] = prompt + r["reply"]
        turns[s] = turns.get(s, 0) + 1
    return out


def bench_chat(server, cfg, num_sessions, num_turns, with_store: bool):
    # The tiers issue's committed trace when it is there (a full run); a generated one
    # of the given size otherwise (--quick).
    trace = committed_trace() if num_sessions is None else chat_trace(num_sessions, num_turns)
    route = random.Random(1)
    tiers = (lambda: [shmkv.RedisTier(server.url, timeout=5.0)]) if with_store else (lambda: None)
    if with_store:  # a fresh store for each run
        import redis

        redis.Redis(port=server.port).flushall()
    totals = {"A": [0, 0, 0], "B": [0, 0, 0]}  # requests, prompt tokens, prefilled
    with (
        shmkv.Coordinator(cfg, name=_name("ca"), tiers=tiers()) as a,
        shmkv.Coordinator(cfg, name=_name("cb"), tiers=tiers()) as b,
        shmkv.connect(a.address, timeout=60) as ca,
        shmkv.connect(b.address, timeout=60) as cb,
    ):
        nodes = {"A": (a, ca), "B": (b, cb)}
        for i, (_session, _turn, prompt, reply) in enumerate(trace):
            node = route.choice("AB")
            coord, client = nodes[node]
            for c, _ in nodes.values():  # think time: the write-behind has drained
                if c.tiers is not None:
                    _redis_store(c).flush(30)
            tokens, prefilled = _serve(client, prompt, reply, seed=i)
            t = totals[node]
            t[0] += 1
            t[1] += tokens
            t[2] += prefilled
        store = {
            n: (_redis_store(c).store_stats() if c.tiers is not None else None)
            for n, (c, _) in nodes.items()
        }
    return {
        "requests": len(trace),
        "nodes": {
            n: {"requests": t[0], "prompt_tokens": t[1], "prefill_tokens": t[2]}
            for n, t in totals.items()
        },
        "store": {
            n: (
                {k: s[k] for k in ("writes", "hits", "misses", "dropped", "errors", "corrupt")}
                if s
                else None
            )
            for n, s in store.items()
        },
    }


# -- main ----------------------------------------------------------------------------------------


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes, fewer repeats")
    parser.add_argument(
        "--out",
        default=None,
        help="results path without extension "
        "(default: benchmarks/results/remote, or remote-quick with --quick)",
    )
    parser.add_argument(
        "--only",
        choices=["pull", "move", "chat"],
        default=None,
        help="run one part and print it (no results written)",
    )
    args = parser.parse_args(argv)
    args.out = args.out or result_base("remote-quick" if args.quick else "remote")
    repeat = 3 if args.quick else 15
    # A block of 1 MiB: 16 layers x (K, V) x 16 tokens x 8 kv heads x 128 x fp16.
    big = shmkv.PoolConfig(
        num_layers=16,
        num_kv_heads=8,
        head_dim=128,
        num_blocks=80,
        block_size=16,
        dtype=torch.float16,
    )
    pull_blocks = 16 if args.quick else 64
    move_blocks = [16] if args.quick else [64, 256]
    chat_cfg = shmkv.PoolConfig(
        num_layers=4,
        num_kv_heads=4,
        head_dim=64,
        num_blocks=2048,
        block_size=16,
        dtype=torch.float16,
    )
    sessions, turns = (8, 3) if args.quick else (None, None)  # None: the committed trace

    out: Dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "torch": torch.__version__}}
    server = RedisServer()
    out["machine"]["redis_server"] = server.version
    try:
        import redis

        out["machine"]["redis_py"] = redis.__version__
        try:
            import hiredis  # noqa: F401

            out["machine"]["parser"] = "hiredis"
        except ImportError:
            out["machine"]["parser"] = "python"
        if args.only in (None, "pull"):
            print("pull from redis ...", flush=True)
            out["pull"] = bench_pull(server, big, pull_blocks, repeat)
        if args.only in (None, "move"):
            print("move over gloo ...", flush=True)
            cfg = dataclasses.replace(big, num_blocks=max(move_blocks) + 16, max_seq_len=None)
            out["move"] = [bench_move(cfg, n * big.block_size, repeat * 2) for n in move_blocks]
        if args.only in (None, "chat"):
            print("two-node chat trace ...", flush=True)
            if sessions is None:
                trace = committed_trace()
                shape = {
                    "sessions": len({r[0] for r in trace}),
                    "turns": max(r[1] for r in trace) + 1,
                    "trace": "benchmarks/traces/chat.jsonl",
                }
            else:
                shape = {"sessions": sessions, "turns": turns, "trace": "generated"}
            out["chat"] = {
                **shape,
                "local_only": bench_chat(server, chat_cfg, sessions, turns, False),
                "shared_store": bench_chat(server, chat_cfg, sessions, turns, True),
            }
    finally:
        server.stop()
    if args.only is not None:
        print(json.dumps(out, indent=1, sort_keys=True))
        return 0
    md = render(out)
    write_results(args.out, out, md, sort_keys=True)
    print(md)
    return 0


def render(out: dict) -> str:
    p, m, c = out["pull"], out["move"], out["chat"]
    lines = [
        f"# Beyond one node ({out['machine']['cpus']} CPUs, torch "
        f"{out['machine']['torch']}, redis-server {out['machine']['redis_server']}, "
        f"redis-py {out['machine']['redis_py']} with the {out['machine']['parser']} "
        "parser)",
        "",
        "| what | bytes | raw | shmkv | shmkv / raw |",
        "| --- | --- | --- | --- | --- |",
        f"| pull {p['blocks']} blocks from Redis into a cold pool vs pipelined GET "
        f"| {p['value_bytes'] / 2**20:.0f} MiB | {p['raw_get_gbps']:.2f} GB/s | "
        f"{p['pull_gbps']:.2f} GB/s | {p['ratio']:.2f}x |",
        f"| the same pull vs the same {p['span_blocks']}-block pipelines one after "
        f"another | {p['value_bytes'] / 2**20:.0f} MiB | {p['raw_spans_gbps']:.2f} GB/s | "
        f"{p['pull_gbps']:.2f} GB/s | {p['ratio_spans']:.2f}x |",
        *[
            f"| prefill -> decode move over Gloo vs send/recv + ack | "
            f"{x['bytes'] / 2**20:.0f} MiB | {x['raw_gbps']:.2f} GB/s | "
            f"{x['move_gbps']:.2f} GB/s | {x['ratio']:.2f}x |"
            for x in m
        ],
        "",
        f"Exact bytes: pull {p['exact']}, moves {all(x['exact'] for x in m)}. "
        f"Medians of {p['repeat']} repeats (pull), {m[0]['repeat']} (moves).",
        "",
        f"## Two-node chat trace ({c.get('trace', 'generated')}: {c['sessions']} sessions, "
        f"up to {c['turns']} turns, turns routed to A or B at random)",
        "",
        "| node | requests | prompt tokens | prefilled, local cache only | prefilled, "
        "shared store | saved |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for node in ("A", "B"):
        lo, st = c["local_only"]["nodes"][node], c["shared_store"]["nodes"][node]
        saved = lo["prefill_tokens"] - st["prefill_tokens"]
        lines.append(
            f"| {node} | {st['requests']} | {st['prompt_tokens']} | "
            f"{lo['prefill_tokens']} | {st['prefill_tokens']} | {saved} "
            f"({saved / max(lo['prefill_tokens'], 1):.0%}) |"
        )
    s = c["shared_store"]["store"]
    lines += [
        "",
        "Store counters (shared run): "
        + "; ".join(f"{n}: " + ", ".join(f"{k} {v}" for k, v in s[n].items()) for n in ("A", "B")),
        "",
        "Reproduce: `shmkv bench --only remote` (method in `shmkv/bench/remote.py`).",
        "",
    ]
    return "\n".join(lines)


def cli_args(quick: bool, out_dir: str, name=None) -> list:
    """The arguments ``shmkv bench --only remote`` runs :func:`main` with."""
    args = ["--quick"] if quick else []
    return args + (["--out", result_base(name, out_dir)] if name else [])


if __name__ == "__main__":
    sys.exit(main())
