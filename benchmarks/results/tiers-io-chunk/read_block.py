"""Block file reads alone: python read_block.py TREE.

32 block files of an 8B-class model's block (2 MiB, 32 layers: 64 rows of 32 KiB), warm
in the page cache, each read and verified straight into its place in a layer-major pool
(``BlockFiles.read_block`` of TREE), by one thread and by two (the tier I/O process runs
two promotion workers), at the I/O process's GIL switch interval. Best of 5 passes."""
import os
import shutil
import sys
import tempfile
import threading
import time

TREE = os.path.abspath(sys.argv[1])
sys.path.insert(0, TREE)
import numpy as np  # noqa: E402
from shmkv import tier_io  # noqa: E402

sys.setswitchinterval(tier_io.IO_SWITCH_INTERVAL_S)
rows, chunk, num_blocks, num_files = 64, 32768, 64, 32
root = tempfile.mkdtemp(prefix="shmkv-read-block-")
try:
    files = tier_io.BlockFiles(root, "s", b"n" * 16, (32, 16, 8, 128, 1, b"float16"),
                               rows * chunk, False)
    keys = [os.urandom(16) for _ in range(num_files)]
    payload = np.random.default_rng(0).integers(0, 256, rows * chunk, dtype=np.uint8)
    for key in keys:
        files.write_block(key, payload)
    pool = np.zeros((rows, num_blocks, chunk), dtype=np.uint8).transpose(1, 0, 2)

    def work(part, first):
        for j, key in enumerate(part):
            files.read_block(key, pool[(first + j) % num_blocks])

    for threads in (1, 2):
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            workers = [threading.Thread(target=work, args=(keys[i::threads], 16 * i))
                       for i in range(threads)]
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            best = min(best, time.perf_counter() - t0)
        assert np.array_equal(pool[0].reshape(-1), payload)
        print(f"{os.path.basename(TREE)} threads={threads}: "
              f"{num_files * rows * chunk / best / 1e9:.2f} GB/s", flush=True)
finally:
    shutil.rmtree(root, ignore_errors=True)
