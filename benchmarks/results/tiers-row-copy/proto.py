"""Prototype behind shmkv/csrc/copy_rows.c: 384 blocks of 2 MiB (64 rows of 32 KiB, the
layout of a block of the 8B-class pool) copied from flat shared memory into strided pool
rows, 7 passes of each way, alternating: numpy's copyto, a memcpy per row, and
non-temporal 32-byte stores. Run: cc -O2 -mavx2 -shared -fPIC -o /tmp/proto.so proto.c
&& python proto.py /tmp/proto.so"""

import ctypes
import mmap
import os
import statistics
import sys
import time

import numpy as np

lib = ctypes.CDLL(sys.argv[1])
for f in (lib.copy_rows_nt, lib.copy_rows):
    f.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_long, ctypes.c_long]
chunk, nb, host_n = 2 * 1024 * 1024 // 64, 128, 384


def shm(n):
    fd = os.memfd_create("x")
    os.ftruncate(fd, n)
    m = mmap.mmap(fd, n)
    os.close(fd)
    a = np.frombuffer(m, dtype=np.uint8)
    a.fill(1)
    return a


pool = shm(64 * nb * chunk).reshape(64, nb, chunk)  # layer-major, as the pool is
host = shm(host_n * 64 * chunk).reshape(host_n, 64 * chunk)


def np_pass():
    for i in range(host_n):
        np.copyto(pool[:, i % nb], host[i].reshape(64, chunk))


def c_pass(fn):
    for i in range(host_n):
        fn(pool[:, i % nb].ctypes.data, nb * chunk, host[i].ctypes.data, 64, chunk)


res = {}
for _rep in range(7):
    for name, f in (
        ("numpy copyto", np_pass),
        ("memcpy per row", lambda: c_pass(lib.copy_rows)),
        ("non-temporal", lambda: c_pass(lib.copy_rows_nt)),
    ):
        t = time.perf_counter()
        f()
        res.setdefault(name, []).append(host_n * 2 / 1024 / (time.perf_counter() - t))
for k, v in res.items():
    print(
        f"{k}: median {statistics.median(v[1:]):.2f} GiB/s (first pass not counted)",
        [round(x, 1) for x in v],
    )
