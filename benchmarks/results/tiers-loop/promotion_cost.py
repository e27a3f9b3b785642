"""The loop's own work for one promotion from the host tier: python promotion_cost.py TREE.

In one process, no socket: a coordinator of TREE (opened, not serving) with a host tier
whose copies run in its tier I/O process, as in the ping run of ``scripts/bench_tiers.py``
(32-block prompts of an 8B-class model, a pool of 128 blocks and twice as many blocks in
the tier, so that every allocation promotes 32 blocks and evicts 32). Times the loop's
calls for each promotion: the allocation, ``TierSet.promote`` alone and with the turn
that sends its job, the turns that take its completion back, and the release with the
turn after it; the copies themselves are not timed. ``GAP_MS`` (default 7): a pause
before the allocation and before the release, like the loop's sleeps between requests.
Medians of ``N`` (default 200) promotions, in microseconds."""

import os
import select
import statistics
import sys
import tempfile
import time
import uuid

TREE = os.path.abspath(sys.argv[1])
sys.path.insert(0, TREE)
sys.path.insert(0, os.path.join(TREE, "scripts"))
import bench_tiers as bt  # noqa: E402
import shmkv  # noqa: E402
from shmkv import hashing  # noqa: E402


def main():
    os.environ.setdefault("SHMKV_RUNTIME_DIR", tempfile.mkdtemp(prefix="shmkv-pc-"))
    cfg = shmkv.PoolConfig(num_blocks=128, **bt.BIG)
    blocks = 32
    prompts = [hashing.pack_tokens(p) for p in bt.prompts_for(8, blocks, 16, seed=3)]
    root = hashing.root_key(None)
    sent = [(p, b"".join(hashing.packed_block_keys(p, 16, root))) for p in prompts]
    coord = shmkv.Coordinator(cfg, name=f"pc-{uuid.uuid4().hex[:8]}",
                              tiers=[shmkv.HostTier((8 * blocks + 8) * cfg.block_nbytes)])
    coord.open()
    table, tiers, wake = coord.table, coord.tiers, coord._wake_r
    clock = time.perf_counter

    def drain(timeout=5.0):
        r, _, _ = select.select([wake], [], [], timeout)
        if r:
            try:
                wake.recv(64)
            except BlockingIOError:
                pass
        return bool(r)

    def settle():
        while tiers.num_pending or tiers.num_promotions_in_flight:
            drain(0.01)
            tiers.tick(True)

    try:
        table.add_connection(1)
        for packed, keys in sent:
            info = table.allocate(1, prompt=packed, keys=keys)
            table.commit(1, info["cache_id"], len(packed) // 8)
            table.release(1, info["cache_id"])
            tiers.tick(True)
            settle()
        info = table.allocate(1, num_tokens=128 * 16)   # every cached block evicted
        table.release(1, info["cache_id"])
        tiers.tick(True)
        settle()
        gap = float(os.environ.get("GAP_MS", "7")) / 1e3
        parts = {"promote() alone": [], "allocate": [], "promote (job built and sent)": [], "completion": [],
                 "release + tier turn": [], "total": []}
        n = int(os.environ.get("N", "200"))
        for i in range(n + 10):
            packed, keys = sent[i % len(sent)]
            time.sleep(gap)
            t0 = clock()
            info = table.allocate(1, prompt=packed, keys=keys)
            t1 = clock()
            records = table.take_promotions()
            assert records, "not a tier hit"
            tiers.promote(records)
            t1b = clock()
            tiers.tick(False)
            t2 = clock()
            done, completion = False, 0.0
            while not done:
                assert drain(), "no completion"
                t3 = clock()
                done = bool(tiers.tick(True))
                completion += clock() - t3
            time.sleep(gap)
            t4 = clock()
            table.release(1, info["cache_id"])
            tiers.tick(False)
            t5 = clock()
            assert info["num_cached"] == len(packed) // 8
            if i >= 10:
                for k, v in (("promote() alone", t1b - t1), ("allocate", t1 - t0), ("promote (job built and sent)", t2 - t1),
                             ("completion", completion), ("release + tier turn", t5 - t4),
                             ("total", (t2 - t0) + completion + (t5 - t4))):
                    parts[k].append(v * 1e6)
            settle()
        print(os.path.basename(TREE), f"gap {gap*1e3:g} ms:", ", ".join(
            f"{k} {statistics.median(v):.0f}" for k, v in parts.items()), flush=True)
    finally:
        coord.close()


if __name__ == "__main__":
    main()
