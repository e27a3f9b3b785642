"""The loop's allocation and release of a 32-block prompt whose blocks are all pool hits,
back to back (warm), through the table the loop calls, in this process: what the same
calls cost without the pauses between them (see trace.py for what they cost in the loop).

    python warm_calls.py
"""

import os
import time

import shmkv
from shmkv import hashing
from shmkv.bench import tiers as bench
from shmkv.coordinator import server as coordinator

CONN = 7
ROUNDS = 2000


def main():
    cfg = shmkv.PoolConfig(num_blocks=128, **bench.BIG)
    coord = coordinator.Coordinator(cfg, name=f"warm-calls-{os.getpid()}")
    coord.open()
    try:
        table = coord.table
        table.add_connection(CONN)
        packed = [hashing.pack_tokens(p) for p in bench.prompts_for(3, 32, cfg.block_size, 3)]
        root = hashing.root_key(None)
        keys = [b"".join(hashing.packed_block_keys(p, cfg.block_size, root)) for p in packed]
        for prompt in packed:  # published, then cached: every later allocation hits
            info = table.allocate(CONN, prompt=prompt)
            table.commit(CONN, info["cache_id"], len(prompt) // 8)
            table.release(CONN, info["cache_id"])
        allocate = release = 0
        for i in range(ROUNDS):
            t0 = time.perf_counter_ns()
            info = table.allocate(CONN, prompt=packed[i % 3], keys=keys[i % 3])
            t1 = time.perf_counter_ns()
            table.release(CONN, info["cache_id"])
            allocate += t1 - t0
            release += time.perf_counter_ns() - t1
        assert info["num_cached"] == 32 * cfg.block_size
        print(
            f"32 hits, back to back: allocate {allocate / ROUNDS / 1e3:.1f} us, "
            f"release {release / ROUNDS / 1e3:.1f} us"
        )
    finally:
        coord.close()


if __name__ == "__main__":
    main()
