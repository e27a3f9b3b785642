"""An allocation of 32 blocks that evicts 32 cached ones (with an eviction hook, as
under tiers), publishing the 32 under new keys and releasing them, back to back: the
pool's share of a promotion's loop work. Best of 5 rounds of 2000.

    python evict_publish.py
"""

import time

from shmkv.allocator import BlockPool


def main():
    pool = BlockPool(128)
    evicted = [0]
    pool.on_evict = lambda blocks, keys: evicted.__setitem__(0, evicted[0] + len(blocks))
    pool.copying = set()
    serial, best = 0, []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(2000):
            ids = pool.allocate(32, 1)
            keys = [(serial + j).to_bytes(16, "little") for j in range(32)]
            serial += 32
            pool.publish_many(ids, keys)
            pool.decref(reversed(ids))
        best.append((time.perf_counter() - t0) / 2000 * 1e6)
    assert evicted[0] >= 5 * 2000 * 32 - 128
    print(f"allocate 32 (evicting 32) + publish 32 + release 32: {min(best):.1f} us")


if __name__ == "__main__":
    main()
