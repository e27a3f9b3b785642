"""A/B of the host ping set-up, two variants alternating (a one-off diagnostic).

    python ab.py host|none VARIABLE ROUNDS

Each round runs both variants, VARIABLE=0 and VARIABLE=1 in the environment, in
alternating order: a spawned coordinator (128 blocks of 32 layers; a host tier holding
the 8 prompts of 32 blocks, or none), and ``shmkv.bench.tiers.ping_run`` against it (20
cycles of 0.5 s idle and 0.5 s promoting). The variable reaches the coordinator through
its environment (a build switched by it), or this script acts on it:

* ``PIN=1``: the coordinator's threads pinned to CPU 0, the tier I/O process's to CPU 1;
* ``NICE=1``: the coordinator's loop thread (its main thread) at nice -5 (needs
  CAP_SYS_NICE);
* ``SPIN0=1``: the coordinator started with ``spin_us=0`` (it sleeps at once after a turn
  instead of polling for the next request).

Prints each run's idle and promoting ping p99 and their ratio, then each variant's ratios.
"""

import os
import sys

import shmkv
from shmkv.bench import tiers as bench


def _pin(pid, cpus):
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(tid), cpus)


def one(kind, env):
    os.environ.update(env)
    cfg = shmkv.PoolConfig(num_blocks=128, **bench.BIG)
    prompts = bench.prompts_for(8, 32, cfg.block_size, seed=3)
    tiers = [shmkv.HostTier((8 * 32 + 8) * cfg.block_nbytes)] if kind == "host" else []
    options = {"spin_us": 0} if os.environ.get("SPIN0") == "1" else {}
    with (
        shmkv.Coordinator.spawn(cfg, name=f"ab{os.getpid()}", tiers=tiers, **options) as coord,
        shmkv.connect(coord.address, timeout=120) as client,
    ):
        if os.environ.get("PIN") == "1":
            children = []
            for tid in os.listdir(f"/proc/{coord.pid}/task"):
                with open(f"/proc/{coord.pid}/task/{tid}/children") as f:
                    children += [int(pid) for pid in f.read().split()]
            _pin(coord.pid, {0})
            for child in children:
                _pin(child, {1})
        if os.environ.get("NICE") == "1":
            os.setpriority(os.PRIO_PROCESS, coord.pid, -5)
        if kind == "none":
            prompts = prompts[:3]
            bench.fill(client, prompts)
        else:
            bench.fill(client, prompts)
            bench.evict_all(client)
            bench.wait_idle(client)
        run = bench.ping_run(coord.address, prompts, cfg.block_size, 20)
    idle, busy = run["idle"]["p99_us"], run["promoting"]["p99_us"]
    return idle, busy, run["promoting"]["allocations_per_s"]


def main(argv):
    kind, variable, rounds = argv[1], argv[2], int(argv[3])
    ratios = {"0": [], "1": []}
    for r in range(rounds):
        for value in ("0", "1") if r % 2 == 0 else ("1", "0"):
            idle, busy, rate = one(kind, {variable: value})
            ratios[value].append(busy / idle)
            print(
                f"{variable}={value}: idle p99 {idle:.0f} promoting p99 {busy:.0f} "
                f"ratio {busy / idle:.2f} {rate:.0f} alloc/s",
                flush=True,
            )
    for value in ("0", "1"):
        print(value, "ratios", " ".join(f"{x:.2f}" for x in sorted(ratios[value])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
