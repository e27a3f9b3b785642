"""Where a host promotion pass's time goes, client side: the summed round trip of each
request and the time in the copies, per pass (profile.txt). Run: python profile.py"""

import collections
import sys
import time

import shmkv
from shmkv.bench import tiers as bt
from shmkv.client import client as client_mod
from shmkv.memory import block_io as tier_io

spent: collections.Counter = collections.Counter()
calls: collections.Counter = collections.Counter()


def timed(name_of, fn):
    def wrapper(*args, **kw):
        t = time.perf_counter()
        try:
            return fn(*args, **kw)
        finally:
            name = name_of(args)
            spent[name] += time.perf_counter() - t
            calls[name] += 1

    return wrapper


client_mod.Client.request = timed(lambda a: "req:" + a[1], client_mod.Client.request)
tier_io.ClientCopies.run = timed(lambda a: "copies", tier_io.ClientCopies.run)


def main() -> None:
    cfg = shmkv.PoolConfig(num_blocks=128, **bt.BIG)
    blocks, num_blocks = 32, 384
    prompts = bt.prompts_for(num_blocks // blocks, blocks, cfg.block_size, seed=2)
    tier = shmkv.HostTier((num_blocks + 8) * cfg.block_nbytes)
    with (
        shmkv.Coordinator.spawn(cfg, name=bt.name(), tiers=[tier]) as coord,
        shmkv.connect(coord.address, timeout=120) as client,
    ):
        bt.fill(client, prompts)
        for rep in range(6):
            bt.evict_all(client)
            bt.wait_idle(client)
            spent.clear()
            calls.clear()
            n, secs = bt.promote_pass(client, prompts, cfg.block_size)
            parts = "  ".join(f"{k}={v * 1e3:.2f}ms/{calls[k]}" for k, v in sorted(spent.items()))
            print(f"rep {rep}: {secs * 1e3:.1f} ms  {n / secs / 1e9:.2f} GB/s  {parts}")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
