"""The batch suite's control-plane point: ``allocate_many`` + ``close_many`` and a kept
``batch.extend(1)``, end to end and split into where the time goes (the ``SequenceTable``
in process, msgpack, the wire). Part of suite ``batch`` (``shmkv.bench.batch``).
"""

from __future__ import annotations

import functools
import os
from typing import Callable

from shmkv.bench.control import _rates
from shmkv.bench.core import (
    BenchError,
    Options,
    _Cleanup,
    _median,
    _unique,
    interleaved,
)

# -- 7. batched steps ------------------------------------------------------------------------

BATCH_CONTROL_SEQS = 256  # sequences of the control-plane point


def _codec_fn(op: str, args: dict, result) -> Callable[[], None]:
    """Both sides' msgpack work for one request: encode, decode and validate the request,
    encode and decode the answer (no socket)."""
    from shmkv import protocol

    def run():
        request = protocol.encode_request(7, op, args)
        protocol.parse_request(next(protocol.FrameDecoder(1 << 30).feed(request)))
        answer = protocol.encode_ok(7, result)
        protocol.parse_response(next(protocol.FrameDecoder(1 << 30).feed(answer))).unwrap()

    return run


def control_point(opts: Options, cleanup: _Cleanup) -> dict:
    """``allocate_many`` + ``close_many`` of 256 one-block sequences, and ``batch.extend(1)``
    over 256 sequences against ``ping``, with the coordinator in its own process.

    To show where the time goes, the coordinator's part runs in this process on a
    ``SequenceTable``, called the way the coordinator's handlers call it (packed
    lengths to ``allocate_counts``, ``extend_batch`` with the batch's table rows), and
    both sides' msgpack work is timed on the same messages. ``request`` is the raw
    ``extend_batch`` request ``batch.extend`` sends, without building the ``Step``.
    """
    from shmkv import protocol
    from shmkv.client.client import connect
    from shmkv.coordinator.allocator import BlockPool
    from shmkv.coordinator.sequences import SequenceTable
    from shmkv.coordinator.server import Coordinator
    from shmkv.memory.layout import PoolConfig

    num = BATCH_CONTROL_SEQS
    # The coordinator's work does not depend on block bytes: a tiny block keeps the pool small.
    cfg = PoolConfig(
        num_layers=1,
        num_kv_heads=1,
        head_dim=8,
        num_blocks=65536,
        block_size=16,
        dtype="float16",
        max_sequences=2048,
        max_seq_len=16384,
    )
    bs = cfg.block_size
    coord = cleanup.add(Coordinator.spawn(cfg, name=_unique("batch-control"), timeout=120))
    client = connect(coord.address)
    table = SequenceTable(
        BlockPool(cfg.num_blocks),
        bs,
        max_sequences=cfg.max_sequences,
        max_seq_blocks=cfg.max_seq_blocks,
    )
    table.add_connection(1)
    point: dict = {"batch_size": num}
    try:
        budget = 0.05 if opts.quick else 0.15
        packed = protocol.pack_i64s([1] * num)
        ids, slot_ids = table.allocate_counts(1, protocol.unpack_i64s(packed))
        table.release_many(1, protocol.unpack_i64s(protocol.pack_i64s(ids)))

        def cycle(c):  # allocate_many + close_many on client c
            return lambda: c.close_many(c.allocate_many([1] * num))

        def pings(c):  # two pings (the two round trips of a cycle)
            return lambda: (c.ping(), c.ping())

        remote = cycle(client)

        def remote_posted():  # the release is not waited for (served before the next)
            client.close_many(client.allocate_many([1] * num), wait=False)

        def in_process():  # called the way the coordinator's handlers call it
            ids, _slots = table.allocate_counts(1, protocol.unpack_i64s(packed))
            table.release_many(1, protocol.unpack_i64s(protocol.pack_i64s(ids)))

        alloc_codec = _codec_fn(
            "allocate_many",
            {"counts": packed},
            protocol.pack_i64s(ids) + protocol.pack_i64s(slot_ids),
        )
        release_codec = _codec_fn("release_many", {"ids": protocol.pack_i64s(ids)}, None)

        def codec():
            alloc_codec()
            release_codec()

        two_pings = pings(client)

        # The same against a coordinator that never polls for the next request
        # (spin_us=0), side by side: what the loop's polling is worth here.
        still = cleanup.add(
            Coordinator.spawn(cfg, name=_unique("batch-control-still"), timeout=120, spin_us=0)
        )
        still_client = connect(still.address)

        # Calls of a few hundred microseconds on a shared machine: twice the usual runs.
        try:
            rates = _rates(
                {
                    "remote": remote,
                    "posted": remote_posted,
                    "table": in_process,
                    "codec": codec,
                    "ping": two_pings,
                    "still": cycle(still_client),
                    "still_ping": pings(still_client),
                },
                num,
                budget,
                2 * opts.repeats,
            )
        finally:
            still_client.close()
            cleanup.remove(still)
        client.flush()
        point["alloc_still_blocks_per_s"] = rates["still"]
        point["ping_still_s"] = num / rates["still_ping"] / 2
        point["ping_s"] = num / rates["ping"] / 2
        point["alloc_blocks_per_s"] = rates["remote"]
        point["alloc_posted_blocks_per_s"] = rates["posted"]
        for name in ("remote", "table", "codec", "ping"):  # seconds per allocate+close pair
            point[f"alloc_{name}_s"] = num / rates[name]

        # -- batch.extend(1) over 256 sequences
        handles = client.allocate_many([0] * num)
        batch = client.batch(handles)
        # What batch.extend(1) sends once the coordinator keeps the batch, on a second
        # connection (a connection's other steps over its sequences would make every
        # step of the kept batch a checked one).
        raw_client = connect(coord.address)
        raw_batch = raw_client.batch(raw_client.allocate_many([0] * num))
        kept = raw_client.request(
            "extend_batch", ids=raw_batch._ids_wire, count=1, slots=raw_batch._slots_wire, keep=True
        )["batch"]
        raw = {"seen": 0}
        # The same over sequences allocated with prompts, as an engine's are (objects
        # with prefix keys in the coordinator), on a connection of their own.
        prompt_client = connect(coord.address)
        prompt_batch = prompt_client.batch(
            prompt_client.allocate_many(
                [{"prompt": list(range(i * 64, i * 64 + 40))} for i in range(num)]
            )
        )
        prompt_batch.extend(1)

        def request():
            raw["seen"] = raw_client.request("extend_kept", batch=kept, count=1, seen=raw["seen"])[
                "steps"
            ]

        # The coordinator's part, called the way its handler calls it.
        table_ids, _ = table.allocate_counts(1, protocol.unpack_i64s(protocol.pack_i64s([0] * num)))
        table_kept = table.keep_batch(1, protocol.unpack_i64s(protocol.pack_i64s(table_ids)))
        at = {"seen": 0}

        def in_table():
            step = table.extend_kept(1, table_kept, 1, at["seen"])
            assert step is not None  # (the handler's check too) kept: only this one steps it
            at["seen"] = step["steps"]

        answer = table.extend_kept(1, table_kept, 1, 0)
        assert answer is not None
        ext_codec = _codec_fn(
            "extend_kept",
            {"batch": table_kept, "count": 1, "seen": 1},
            {
                "steps": 2,
                "same": True,
                "grown": protocol.pack_i64s(answer["grown"]),
                "blocks": protocol.pack_i64s(answer["blocks"]),
            },
        )
        at["seen"] = answer["steps"]
        calls, repeats = 50, 3 * opts.repeats  # every call adds a token to each sequence
        total_calls = (repeats + 1) * calls
        assert cfg.max_seq_len is not None  # PoolConfig sets it when not given
        if 2 * total_calls + 2 > cfg.max_seq_len:
            raise BenchError("batch control: too many steps for max_seq_len; lower --repeats")

        def looped(fn):
            def run():
                for _ in range(calls):
                    fn()

            return run

        try:
            times = interleaved(
                {
                    "extend": looped(functools.partial(batch.extend, 1)),
                    "prompt": looped(lambda: prompt_batch.extend(1)),
                    "request": looped(request),
                    "ping": looped(client.ping),
                    "table": looped(in_table),
                    "codec": looped(ext_codec),
                },
                repeats,
            )
        finally:
            raw_client.close()
            prompt_client.close()
        for name, samples in times.items():
            point[f"extend_{name}_s"] = _median(samples) / calls
        # The same against ping with client and coordinator pinned: on one CPU (every
        # round trip is a context switch there) and on two (the placement an engine has,
        # its scheduler on one core, the coordinator on another).
        cpus = sorted(os.sched_getaffinity(0))
        placements = [("same CPU", cpus[0], cpus[0])]
        if len(cpus) > 1:
            placements.append(("2 CPUs", cpus[0], cpus[1]))
        point["placements"] = {}
        try:
            for place, client_cpu, server_cpu in placements:
                client.close_many(handles)  # fresh sequences: the pool stays big enough
                handles = client.allocate_many([0] * num)
                batch = client.batch(handles)
                os.sched_setaffinity(0, {client_cpu})
                os.sched_setaffinity(coord.pid, {server_cpu})
                pinned = interleaved(
                    {
                        "extend": looped(functools.partial(batch.extend, 1)),
                        "ping": looped(client.ping),
                        "alloc": looped(remote),
                        "alloc_posted": looped(remote_posted),
                    },
                    repeats,
                )
                client.flush()
                point["placements"][place] = {
                    name: _median(v) / calls for name, v in pinned.items()
                }
        finally:
            os.sched_setaffinity(0, cpus)
            os.sched_setaffinity(coord.pid, cpus)
        client.close_many(handles)
        return point
    finally:
        client.close()
        cleanup.remove(coord)
