"""Numpy against plain Python for the loop's small steps (bulk stores, a prompt's tail
tokens, one slot set, telling a scalar owner from a list, a prompt's sent keys split),
warm and cold:
python cold_calls.py. Cold: before each call, 64 MiB are copied and the process sleeps
2 ms (as the loop's caches are after a tier copy and a sleep). Medians of 200 calls."""
import statistics
import struct
import time
from array import array

import numpy as np

N = 128
ref = array("q", bytes(8 * N)); ref_np = np.frombuffer(ref, dtype=np.int64)
own = array("q", bytes(8 * N)); own_np = np.frombuffer(own, dtype=np.int64)
junk = np.ones(64 << 20, dtype=np.uint8); junk2 = np.empty_like(junk)
ids = list(range(40, 72))
packed = struct.pack("<%dq" % 520, *range(520))
def numpy_way():
    where = np.array(ids, dtype=np.int64); ref_np[where] = 1; own_np[where] = 7
def loop_way():
    r, o = ref, own
    for b in ids:
        r[b] = 1; o[b] = 7
held = np.zeros((4, 1024), dtype=bool)
held_mv = memoryview(held[1])


def np_scalar_set():
    held[1][37] = True


def mv_scalar_set():
    held_mv[37] = True


def tail_np():
    return np.frombuffer(packed, dtype="<i8")[512:].tolist()
def tail_mv():
    return memoryview(packed)[512 * 8:].cast("q").tolist()
def ndim_scalar():
    return np.ndim(7) == 0


def isinstance_scalar():
    return isinstance(7, (int, np.integer))


keys = bytes(range(256)) * 2   # 32 keys of 16 bytes, as a client sends a prompt's
keys_struct = struct.Struct("16s" * 32)


def keys_sliced():
    return [keys[i:i + 16] for i in range(0, len(keys), 16)]


def keys_unpacked():
    return list(keys_struct.unpack(keys))


for fn in (numpy_way, loop_way, tail_np, tail_mv, np_scalar_set, mv_scalar_set, ndim_scalar,
           isinstance_scalar, keys_sliced, keys_unpacked):
    for cold in (False, True):
        ts = []
        for _ in range(200):
            if cold:
                np.copyto(junk2, junk); time.sleep(0.002)
            t0 = time.perf_counter(); fn(); ts.append(time.perf_counter() - t0)
        print(f"{fn.__name__:10s} cold={cold}: {statistics.median(ts)*1e6:.1f} us")
