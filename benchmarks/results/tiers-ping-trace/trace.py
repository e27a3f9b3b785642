"""Where a ping's time goes while another client promotes (a one-off diagnostic, not a
benchmark: it wraps the coordinator's methods in this process, which adds a few
microseconds to each piece of work it times).

    python trace.py host|disk|none [allocations/s, for none]

Serves a coordinator in this process (the ping set-up of ``shmkv bench --only tiers``:
128 blocks of 32 layers, 32-block prompts), runs ``shmkv.bench.tiers.ping_run`` from a
spawned driver, and stamps each piece of loop work (a request, by op; ``TierSet.tick``
and ``promote``; ``_flush``) on the monotonic clock the pinger stamps its pings with.
Prints each piece's duration percentiles, then, for the pings between p98 and p99.5 of
each phase (idle, promoting), their mean time before the loop took them (and which loop
work overlapped that wait), in the loop, and after their answer.
"""

import bisect
import multiprocessing as mp
import os
import shutil
import sys
import threading
from time import monotonic_ns

import shmkv
from shmkv.bench.tiers import common as bench
from shmkv.bench.tiers.ping import ping_run
from shmkv.coordinator import allocator, connections, prefix, refs, server as coordinator

POOL_BLOCKS, PROMPT_BLOCKS, CYCLES = 128, 32, 20
DISK = f"/tmp/shmkv-trace-{os.getpid()}"
DURATIONS: dict = {}
TIMELINE: list = []  # (start, end, label) of the pieces stamped on the timeline
ON_TIMELINE = {"tiers.tick", "tiers.promote", "_flush"}


def _stamp(cls, attr, label=None, by_op=False):
    inner = getattr(cls, attr)
    label = label or attr

    def stamped(self, *args, **kwargs):
        t0 = monotonic_ns()
        try:
            return inner(self, *args, **kwargs)
        finally:
            dt = monotonic_ns() - t0
            key = label
            if by_op:  # _handle(conn, obj): obj is [request_id, op, args]
                obj = args[1]
                op = obj[1] if isinstance(obj, list) and len(obj) == 3 else "?"
                key = f"handle:{op}"
            DURATIONS.setdefault(key, []).append(dt)
            if by_op or key in ON_TIMELINE:
                TIMELINE.append((t0, t0 + dt, key))

    setattr(cls, attr, stamped)


def _driver(address, kind, rate, queue):
    cfg = shmkv.PoolConfig(num_blocks=POOL_BLOCKS, **bench.BIG)
    num = max(2 * POOL_BLOCKS // PROMPT_BLOCKS, 4)
    prompts = bench.prompts_for(num, PROMPT_BLOCKS, cfg.block_size, seed=3)
    with shmkv.connect(address, timeout=120) as client:
        if kind == "none":
            prompts = prompts[: POOL_BLOCKS // PROMPT_BLOCKS - 1]
            bench.fill(client, prompts)
        else:
            bench.fill(client, prompts)
            bench.evict_all(client)
            bench.wait_idle(client)
        queue.put(("filled", None))
        run = ping_run(address, prompts, cfg.block_size, CYCLES, rate=rate, samples=True)
    queue.put(("run", run))


def _percentile_table():
    for key, values in sorted(DURATIONS.items()):
        values.sort()
        n = len(values)

        def at(q, values=values, n=n):
            return values[min(n - 1, int(q * n))] / 1e3

        print(
            f"{key:28s} n={n:7d} p50={at(0.5):7.1f} p90={at(0.9):7.1f} p99={at(0.99):7.1f} "
            f"max={values[-1] / 1e3:8.1f} us"
        )


def _tail_pings(run):
    TIMELINE.sort()
    starts = [item[0] for item in TIMELINE]
    pings = [item for item in TIMELINE if item[2] == "handle:ping"]
    ping_starts = [item[0] for item in pings]
    for promoting in (False, True):
        mine = [
            (t0, latency)
            for t0, latency in run["samples"]
            if any(a <= t0 < b and busy == promoting for a, b, busy in run["phases"])
        ]
        mine.sort(key=lambda sample: -sample[1])
        top = len(mine) // 100
        band = mine[top // 2 : 2 * top]  # p98-p99.5
        parts: dict = {}
        for t0, latency in band:
            sent, back = int(t0 * 1e9), int((t0 + latency) * 1e9)
            i = bisect.bisect_left(ping_starts, sent)
            served = pings[i] if i < len(pings) and pings[i][0] < back else None
            taken = served[0] if served else back
            j = bisect.bisect_left(starts, sent - 5_000_000)
            while j < len(TIMELINE) and TIMELINE[j][0] < taken:
                a, b, key = TIMELINE[j]
                j += 1
                if b > sent and key != "handle:ping":
                    parts[key] = parts.get(key, 0.0) + (min(b, taken) - max(a, sent)) / 1e3
            if served:
                parts["before"] = parts.get("before", 0.0) + (served[0] - sent) / 1e3
                parts["in the loop"] = parts.get("in the loop", 0.0) + (served[1] - served[0]) / 1e3
                parts["after"] = parts.get("after", 0.0) + (back - served[1]) / 1e3
        mean = sum(latency for _, latency in band) / len(band) * 1e6
        phase = "promoting" if promoting else "idle"
        print(f"{phase}: pings p98-p99.5, n={len(band)}, mean {mean:.0f} us")
        for key, total in sorted(parts.items(), key=lambda item: -item[1]):
            print(f"  {key:28s} mean {total / len(band):7.1f} us")


def main(argv):
    kind = argv[1] if len(argv) > 1 else "host"
    rate = float(argv[2]) if len(argv) > 2 else None
    cfg = shmkv.PoolConfig(num_blocks=POOL_BLOCKS, **bench.BIG)
    prompt_bytes = max(2 * POOL_BLOCKS // PROMPT_BLOCKS, 4) * PROMPT_BLOCKS * cfg.block_nbytes
    tiers = {
        "host": [shmkv.HostTier(prompt_bytes + 8 * cfg.block_nbytes)],
        "disk": [shmkv.DiskTier(DISK, 1 << 40)],
        "none": [],
    }[kind]
    coord = coordinator.Coordinator(cfg, name=f"trace-{os.getpid()}", tiers=tiers)
    coord.open()
    _stamp(connections.Connections, "_handle", by_op=True)
    _stamp(connections.Connections, "_flush")
    for cls, attr in (
        (prefix.Prefix, "allocate_many"),
        (prefix.Prefix, "_plan_allocate"),
        (allocator.BlockPool, "allocate"),
        (refs.Refs, "release_many"),
    ):
        _stamp(cls, attr, f"{cls.__name__}.{attr}")
    if coord.tiers is not None:
        for attr in ("promote", "tick"):
            _stamp(type(coord.tiers), attr, f"tiers.{attr}")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    driver = ctx.Process(target=_driver, args=(coord.address, kind, rate, queue))
    driver.start()
    result: dict = {}

    def collect():
        try:
            result.update([queue.get(timeout=600)])
            DURATIONS.clear()  # (the fill is not the run)
            TIMELINE.clear()
            result.update([queue.get(timeout=600)])
        finally:
            coord.stop()

    threading.Thread(target=collect, daemon=True).start()
    try:
        coord.serve_forever()
    finally:
        driver.join(30)
        if driver.is_alive():
            driver.kill()
        shutil.rmtree(DISK, ignore_errors=True)
    run = result["run"]
    idle, busy = run["idle"]["p99_us"], run["promoting"]["p99_us"]
    print(
        f"{kind}: idle p99 {idle:.0f} us, promoting p99 {busy:.0f} us, ratio {busy / idle:.2f}, "
        f"{run['promoting']['allocations_per_s']:.0f} allocations/s"
    )
    _percentile_table()
    _tail_pings(run)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
