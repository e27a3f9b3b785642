"""Suite ``handoff``: a producer process hands 2048 tokens of fresh K/V to a consumer
process, end to end on one clock: shmkv (``export`` / ``open``) against a
``torch.multiprocessing`` queue and a ``multiprocessing.shared_memory`` segment.
"""

from __future__ import annotations

import math
import os
import time
from typing import Dict, List

from shmkv.bench.core import (
    SPAWN,
    BenchError,
    Figure,
    Helper,
    Options,
    _check,
    _Cleanup,
    _median,
    _model_config,
    _next_command,
    _pattern,
    _unique,
)

# -- 4. hand-off -------------------------------------------------------------------------------

HANDOFF_METHODS = ("shmkv", "torch.multiprocessing", "shared_memory")


def _clock() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)  # one clock for every process


def _checksum(t) -> int:
    import torch

    return int(t.reshape(-1)[::257].view(torch.int16).to(torch.int64).sum())


def _child_producer(conn, address: str, tokens: int, threads: int, torch_queue, meta_queue) -> None:
    """Prefill side: fresh K/V each round (untimed), then hand it off by one method."""
    from multiprocessing import shared_memory

    import torch

    from shmkv.client.client import connect

    torch.set_num_threads(threads)
    client = connect(address)
    cfg = client.config
    shape = (cfg.num_layers, 2, tokens, cfg.num_kv_heads, cfg.head_dim)
    template = _pattern(math.prod(shape), client.pool.dtype).view(shape)
    segments: List[shared_memory.SharedMemory] = []
    try:
        conn.send("ready")
        while True:
            command = _next_command(conn)
            if command is None:
                return
            method, rep = command
            for seg in segments:  # the consumer of the last round is done with it
                seg.close()
                seg.unlink()
            segments.clear()
            kv = template.clone()  # the freshly computed K/V of this prefill
            kv.view(-1)[::4099] += rep
            expected = _checksum(kv)
            t0 = _clock()
            if method == "shmkv":
                handle = client.allocate(tokens)
                handle.write_all(kv, 0)
                token = handle.export(60)
                handle.close()
                meta_queue.put(token)
            elif method == "torch.multiprocessing":
                torch_queue.put(kv)
            else:
                nbytes = kv.numel() * kv.element_size()
                seg = shared_memory.SharedMemory(
                    create=True, size=nbytes, name=f"shmkvbench-{os.getpid()}-{rep}"
                )
                segments.append(seg)
                view = torch.frombuffer(seg.buf, dtype=kv.dtype, count=kv.numel())
                view.copy_(kv.view(-1))
                del view  # frombuffer does not hold the buffer: drop it before close
                meta_queue.put((seg.name, tuple(kv.shape), str(kv.dtype)))
            conn.send((t0, expected))
            del kv
    finally:
        for seg in segments:
            seg.close()
            seg.unlink()
        client.close()


def _child_consumer(conn, address: str, tokens: int, threads: int, torch_queue, meta_queue) -> None:
    """Decode side: receive one hand-off by the named method and read all of it into a
    K/V buffer of its own."""
    from multiprocessing import shared_memory

    import torch

    from shmkv.client.client import connect

    torch.set_num_threads(threads)
    client = connect(address)
    cfg = client.config
    # The decoder's own K/V buffer, allocated and touched once: every method reads into it.
    out = torch.zeros(
        (cfg.num_layers, 2, tokens, cfg.num_kv_heads, cfg.head_dim), dtype=client.pool.dtype
    )
    conn.send("ready")
    while True:
        method = _next_command(conn)
        if method is None:
            break
        if method == "shmkv":
            token = meta_queue.get(timeout=120)
            handle = client.open(token)
            handle.gather_all(out=out)
            handle.close()
        elif method == "torch.multiprocessing":
            received = torch_queue.get(timeout=120)
            out.copy_(received)
            del received
        else:
            name, shape, dtype = meta_queue.get(timeout=120)
            seg = shared_memory.SharedMemory(name=name)  # its owner, the producer, unlinks it
            view = torch.frombuffer(seg.buf, dtype=out.dtype, count=out.numel())
            out.view(-1).copy_(view)
            del view  # frombuffer does not hold the buffer: drop it before close
            seg.close()
        t1 = _clock()
        conn.send((t1, _checksum(out)))
    client.close()


def bench_handoff(opts: Options, cleanup: _Cleanup, series: dict) -> List[Figure]:
    """End-to-end hand-off of one sequence's K/V from a producer to a consumer process."""
    import torch.multiprocessing as tmp

    from shmkv.coordinator.server import Coordinator

    tokens = 2048
    cfg = _model_config(2 * (tokens // 16) + 8, 16)
    coord = cleanup.add(Coordinator.spawn(cfg, name=_unique("handoff"), timeout=120))
    torch_queue = tmp.get_context("spawn").Queue()
    meta_queue = SPAWN.Queue()
    producer = cleanup.add(
        Helper(
            _child_producer,
            coord.address,
            tokens,
            opts.threads,
            torch_queue,
            meta_queue,
            name="shmkv-bench-producer",
        )
    )
    consumer = cleanup.add(
        Helper(
            _child_consumer,
            coord.address,
            tokens,
            opts.threads,
            torch_queue,
            meta_queue,
            name="shmkv-bench-consumer",
        )
    )
    try:
        producer.recv(120)
        consumer.recv(120)
        repeats = max(3, opts.repeats)
        times: Dict[str, List[float]] = {m: [] for m in HANDOFF_METHODS}
        rep = 0
        for round_ in range(repeats + 1):
            order = HANDOFF_METHODS[round_ % 3 :] + HANDOFF_METHODS[: round_ % 3]
            for method in order:
                rep += 1
                consumer.send(method)
                producer.send((method, rep))
                t0, expected = producer.recv(120)
                t1, got = consumer.recv(120)
                if got != expected:
                    raise BenchError(f"hand-off by {method} delivered different K/V")
                if round_ > 0:
                    times[method].append((t1 - t0) / 1e9)
    finally:
        cleanup.remove(consumer)
        cleanup.remove(producer)
        cleanup.remove(coord)
        for q in (torch_queue, meta_queue):
            q.close()
            q.join_thread()
    nbytes = tokens * cfg.block_nbytes // cfg.block_size
    medians = {m: _median(t) for m, t in times.items()}
    series["handoff"] = {"bytes": nbytes, "times_s": times, "median_s": medians}
    figures = []
    params = {
        "tokens": tokens,
        "bytes": nbytes,
        "layers": cfg.num_layers,
        "kv_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "dtype": cfg.dtype,
    }
    for method in HANDOFF_METHODS:
        speedup = medians[method] / medians["shmkv"]
        figures.append(
            Figure(
                "handoff",
                f"hand-off {method}",
                medians[method] * 1e3,
                "ms",
                medians["shmkv"] * 1e3 if method != "shmkv" else None,
                "shmkv" if method != "shmkv" else "",
                speedup if method != "shmkv" else None,
                ">= 5" if method == "torch.multiprocessing" else None,
                _check(speedup, ">= 5") if method == "torch.multiprocessing" else None,
                params=params,
            )
        )
    return figures
