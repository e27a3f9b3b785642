"""A/B of the host-tier ping run between two trees: python ab.py TREE KIND... (KIND: host, disk, notier)."""
import sys, os, json, shutil, tempfile
tree = sys.argv[1]
sys.path.insert(0, tree); sys.path.insert(0, os.path.join(tree, "scripts"))
import shmkv, bench_tiers as bt
if __name__ == "__main__":
    os.environ.setdefault("SHMKV_RUNTIME_DIR", tempfile.mkdtemp(prefix="ab-"))
    cycles = int(os.environ.get("CYCLES", "10"))
    cfg = shmkv.PoolConfig(num_blocks=128, **bt.BIG)
    blocks = int(os.environ.get("PB", "32"))
    out = {}
    root = tempfile.mkdtemp(prefix="ab-tiers-")
    for kind in sys.argv[2:]:
        prompts = bt.prompts_for(max(2 * 128 // blocks, 4), blocks, cfg.block_size, seed=3)
        n = len(prompts) * blocks
        if kind == "notier":
            prompts = prompts[:max(1, 128 // blocks - 1)]
            with shmkv.Coordinator.spawn(cfg, name=bt.name()) as coord, shmkv.connect(coord.address, timeout=120) as client:
                bt.fill(client, prompts)
                run = bt.ping_run(coord.address, prompts, cfg.block_size, cycles, rate=float(os.environ.get("RATE", "145")))
        else:
            spec = shmkv.DiskTier(os.path.join(root, "ping"), 1 << 40) if kind == "disk" else shmkv.HostTier((n + 8) * cfg.block_nbytes)
            with shmkv.Coordinator.spawn(cfg, name=bt.name(), tiers=[spec]) as coord, shmkv.connect(coord.address, timeout=120) as client:
                bt.fill(client, prompts); bt.evict_all(client); bt.wait_idle(client)
                run = bt.ping_run(coord.address, prompts, cfg.block_size, cycles)
            shutil.rmtree(os.path.join(root, "ping"), ignore_errors=True)
        i, p = run["idle"], run["promoting"]
        print(f"{os.path.basename(tree):5s} {kind:6s} idle p99 {i['p99_us']:4.0f} busy p99 {p['p99_us']:4.0f} ratio {p['p99_us']/i['p99_us']:.2f}  p50 {i['p50_us']:.0f}/{p['p50_us']:.0f}  alloc/s {p['allocations_per_s']:.0f}", flush=True)
    shutil.rmtree(root, ignore_errors=True)
