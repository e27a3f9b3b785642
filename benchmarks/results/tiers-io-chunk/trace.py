"""Where the slow pings of the ping run wait: python trace.py TREE KIND (KIND: host, disk).

Runs the ping run of ``scripts/bench_tiers.py`` (``CYCLES`` idle/promoting pairs, default
10; TREE's ``bench_tiers.ping_run`` must take ``samples=True``: the "old" row of the
README ran the same phases from this script as of ca6d6fc) against a coordinator of TREE in a process of this script's, whose loop is wrapped
with a clock: each request served (``Coordinator._handle``) and each tier call
(``TierSet.tick``, ``TierSet.promote``), on the clock the pinger uses (CLOCK_MONOTONIC).
For the slowest 2% of pings of each phase it splits the latency into the wait before
the coordinator took the ping up, the handling, and the time from the answer to the
pinger having it (medians), and gives the loop's other work that overlapped the wait
(a mean per slow ping, in microseconds)."""
import bisect
import json
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

TREE = os.path.abspath(sys.argv[1])
sys.path.insert(0, TREE)
sys.path.insert(0, os.path.join(TREE, "scripts"))
import bench_tiers as bt  # noqa: E402
import shmkv  # noqa: E402

SPAWN = multiprocessing.get_context("spawn")


def _child(tree, cfg_wire, address, tiers, pipe, out):
    sys.path.insert(0, tree)
    import gc
    from shmkv import coordinator as co, tiers as tm
    clock, events = time.monotonic, []
    handle = co.Coordinator._handle

    def _handle(self, conn, obj):
        t0 = clock()
        handle(self, conn, obj)
        op = obj[1] if isinstance(obj, list) and len(obj) > 1 else "?"
        events.append(("h", t0, clock(), conn.conn_id, str(op)))
    co.Coordinator._handle = _handle
    for name in ("tick", "promote"):
        real = getattr(tm.TierSet, name)

        def wrapped(self, *a, _real=real, _name=name, **k):
            t0 = clock()
            result = _real(self, *a, **k)
            events.append((_name, t0, clock(), 0, _name))
            return result
        setattr(tm.TierSet, name, wrapped)
    coord = co.Coordinator(shmkv.PoolConfig.from_wire(cfg_wire), address=address, tiers=tiers,
                           spin_us=co.DEFAULT_SPIN_US)
    coord.open()
    pipe.send("ready")
    co.freeze_startup_objects()
    gc.disable()   # the events list would make collections slower and slower
    threading.Thread(target=lambda: (pipe.recv(), coord.stop()), daemon=True).start()
    coord.serve_forever()
    with open(out, "w") as f:
        json.dump(events, f)


def analyze(events, pings, phases) -> dict:
    by_conn = {}
    for e in events:
        if e[0] == "h" and e[4] == "ping":
            by_conn[e[3]] = by_conn.get(e[3], 0) + 1
    pinger = max(by_conn, key=by_conn.get)
    mine = sorted((e for e in events if e[0] == "h" and e[3] == pinger), key=lambda e: e[1])
    starts = [e[1] for e in mine]
    others = sorted((e for e in events if not (e[0] == "h" and e[3] == pinger)),
                    key=lambda e: e[1])
    other_starts = [e[1] for e in others]
    out = {}
    for busy, label in ((False, "idle"), (True, "promoting")):
        rows = []
        for t0, latency in pings:
            if not any(s <= t0 < e and b == busy for s, e, b in phases):
                continue
            i = bisect.bisect_left(starts, t0)
            if i == len(mine):
                continue
            h = mine[i]
            rows.append((latency, t0, h[1] - t0, h[2] - h[1], t0 + latency - h[2]))
        rows.sort()
        slow = rows[int(0.98 * len(rows)):]
        overlap = {}
        for latency, t0, before, _h, _a in slow:
            j = bisect.bisect_left(other_starts, t0 - 0.05)
            while j < len(others) and others[j][1] < t0 + before:
                e = others[j]
                o = min(e[2], t0 + before) - max(e[1], t0)
                if o > 0:
                    overlap[e[4]] = overlap.get(e[4], 0.0) + o
                j += 1
        us = lambda v: round(v * 1e6)  # noqa: E731
        out[label] = {
            "pings": len(rows), "p50_us": us(rows[len(rows) // 2][0]),
            "p99_us": us(rows[int(0.99 * len(rows))][0]),
            "slowest_2pct": {"wait_before_us": us(statistics.median(r[2] for r in slow)),
                             "handling_us": us(statistics.median(r[3] for r in slow)),
                             "answer_to_pinger_us": us(statistics.median(r[4] for r in slow)),
                             "loop_work_overlapping_wait_us": {
                                 k: us(v / len(slow)) for k, v in
                                 sorted(overlap.items(), key=lambda kv: -kv[1])}}}
    out["p99_ratio"] = out["promoting"]["p99_us"] / out["idle"]["p99_us"]
    return out


def main(kind: str) -> None:
    os.environ.setdefault("SHMKV_RUNTIME_DIR", tempfile.mkdtemp(prefix="shmkv-trace-"))
    root = tempfile.mkdtemp(prefix="shmkv-trace-tiers-")
    cfg = shmkv.PoolConfig(num_blocks=128, **bt.BIG)
    prompts = bt.prompts_for(8, 32, cfg.block_size, seed=3)
    spec = shmkv.DiskTier(os.path.join(root, "ping"), 1 << 40) if kind == "disk" else \
        shmkv.HostTier((len(prompts) * 32 + 8) * cfg.block_nbytes)
    address = os.path.join(os.environ["SHMKV_RUNTIME_DIR"], f"trace-{os.getpid()}.sock")
    events_path = os.path.join(root, "events.json")
    ours, theirs = SPAWN.Pipe()
    child = SPAWN.Process(target=_child, args=(TREE, cfg.to_wire(), address, [spec], theirs,
                                                events_path))
    child.start()
    try:
        assert ours.poll(120)
        ours.recv()
        with shmkv.connect(address, timeout=120) as client:
            bt.fill(client, prompts)
            bt.evict_all(client)
            bt.wait_idle(client)
            run = bt.ping_run(address, prompts, cfg.block_size,
                              int(os.environ.get("CYCLES", "10")), samples=True)
        ours.send("stop")
        child.join(60)
        with open(events_path) as f:
            events = json.load(f)
        print(json.dumps({"tree": os.path.basename(TREE), "tier": kind,
                          **analyze(events, run["samples"], run["phases"])}), flush=True)
    finally:
        if child.is_alive():
            child.kill()
            child.join(10)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[2])
