"""Warm pools: the coordinator's background populate, a worker's prefault, huge pages.

What is resident is read from the kernel (``/proc/PID/smaps``: the resident bytes and
page size of the mapping that holds a pool), not from shmkv's own counters.
"""

import logging
import multiprocessing
import os
import threading
import time
import uuid

import pytest
import torch

import shmkv
from shmkv.coordinator import metrics
from shmkv.errors import InvalidArgument, LayoutMismatch
from shmkv.memory import pool as pool_memory, shm

MIB = 1 << 20


BS, HEADS = 128, 2  # a block: 8 layers x K/V x 128 tokens x 2 heads x 128 of bfloat16 = 1 MiB


def config(mib):
    """A pool of ``mib`` MiB: as many blocks."""
    return shmkv.PoolConfig(
        num_layers=8,
        num_kv_heads=HEADS,
        head_dim=128,
        num_blocks=mib,
        block_size=BS,
        dtype=torch.bfloat16,
    )


def mapping(pid, address):
    """``{"rss": bytes, "page": bytes}`` of the mapping of process ``pid`` holding
    ``address``, from its smaps."""
    found = None
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                found = {} if lo <= address < hi else None
            elif found is not None and line.startswith(("Rss:", "KernelPageSize:")):
                key = "rss" if line.startswith("Rss:") else "page"
                found[key] = int(line.split()[1]) * 1024
                if len(found) == 2:
                    return found
    raise AssertionError(f"no mapping of {pid} holds {address:#x}")


def sample(coord, name):
    """The value of an unlabelled series in the coordinator's /metrics text."""
    for line in metrics.render(coord).decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} is not exported")


def wait_populated(client, timeout=60):
    deadline = time.monotonic() + timeout
    while True:
        stats = client.stats()["pool_memory"]["populate"]
        if stats["state"] != "running":
            return stats
        assert time.monotonic() < deadline, stats
        time.sleep(0.01)


def no_populate_thread():
    return not any(t.name == "shmkv-populate" for t in threading.enumerate())


def test_populate_faults_in_the_whole_pool_in_the_background():
    cfg = config(256)
    with shmkv.Coordinator(cfg, name=f"pop-{uuid.uuid4().hex[:8]}") as coord:
        with shmkv.connect(coord.address) as client:
            stats = wait_populated(client)
            assert stats["state"] == "done" and stats["error"] == ""
            assert stats["bytes"] == stats["total_bytes"] == cfg.nbytes
            assert stats["seconds"] > 0
            got = mapping(os.getpid(), coord.memory.raw.data_ptr())
            assert got["rss"] >= cfg.nbytes  # every page of the coordinator's mapping
            assert sample(coord, "shmkv_pool_populated_bytes") == cfg.nbytes
            assert sample(coord, "shmkv_pool_hugepages") == 0
    assert no_populate_thread()


def test_no_populate_leaves_the_pool_untouched():
    cfg = config(64)
    with shmkv.Coordinator(cfg, name=f"pop-{uuid.uuid4().hex[:8]}", populate=False) as coord:
        with shmkv.connect(coord.address) as client:
            time.sleep(0.2)
            stats = client.stats()["pool_memory"]["populate"]
            assert stats["state"] == "off" and stats["bytes"] == 0
            assert mapping(os.getpid(), coord.memory.raw.data_ptr())["rss"] < cfg.nbytes // 8
            assert sample(coord, "shmkv_pool_populated_bytes") == 0
    assert no_populate_thread()


def test_writes_made_while_populate_runs_are_kept():
    """Populate changes no byte: K/V written into pages it has not reached yet, and into
    pages it is faulting in, read back exactly."""
    cfg = config(1024)
    with shmkv.Coordinator(cfg, name=f"pop-{uuid.uuid4().hex[:8]}") as coord:
        with shmkv.connect(coord.address) as client:
            gen = torch.Generator().manual_seed(1)
            written, during = [], 0
            for _ in range(48):  # spread over the pool: the last blocks are reached last
                h = client.allocate(BS * 20)
                kv = torch.randn(2, BS * 20, HEADS, 128, generator=gen).bfloat16()
                running = client.stats()["pool_memory"]["populate"]["state"] == "running"
                for layer in range(cfg.num_layers):
                    h.write(layer, kv[0], kv[1])
                during += running
                written.append((h, kv))
            assert during, "populate ended before the first write: the pool is too small"
            assert wait_populated(client)["state"] == "done"
            for h, kv in written:
                got = h.gather_all()
                for layer in range(cfg.num_layers):
                    assert torch.equal(got[layer], kv)


def test_stop_ends_a_populate_under_way():
    cfg = config(2048)
    coord = shmkv.Coordinator(cfg, name=f"pop-{uuid.uuid4().hex[:8]}").start()
    try:
        assert coord.pool_memory_stats()["populate"]["state"] == "running"
        populator = coord._populator
    finally:
        t0 = time.monotonic()
        coord.stop()
    assert time.monotonic() - t0 < 5
    assert populator.state == "stopped" and populator.done_bytes < cfg.nbytes
    assert no_populate_thread()


def _worker_rss(address, prefault, out):
    client = shmkv.connect(address, prefault=prefault)
    got = mapping(os.getpid(), client.pool.data_ptr())
    out.put((got["rss"], got["page"], client.prefault_s))
    client.close()


def worker_rss(address, prefault):
    """Resident bytes and page size of a new worker process's mapping of the pool, and
    its ``prefault_s``."""
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_worker_rss, args=(address, prefault, out))
    proc.start()
    try:
        return out.get(timeout=60)
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join(5)


def test_prefault_maps_the_pool_into_the_worker():
    cfg = config(128)
    coord = shmkv.Coordinator.spawn(cfg, name=f"pop-{uuid.uuid4().hex[:8]}")
    try:
        with shmkv.connect(coord.address) as client:
            wait_populated(client)
        cold_rss, _, cold_s = worker_rss(coord.address, prefault=False)
        warm_rss, _, warm_s = worker_rss(coord.address, prefault=True)
    finally:
        coord.stop()
    assert cold_rss < cfg.nbytes // 8 and cold_s == 0.0
    assert warm_rss >= cfg.nbytes and warm_s > 0


def test_bad_flags_are_refused():
    cfg = config(4)
    with pytest.raises(InvalidArgument, match="populate must be True or False"):
        shmkv.Coordinator(cfg, name="x", populate="no")
    with pytest.raises(InvalidArgument, match="hugepages must be True or False"):
        shmkv.Coordinator(cfg, name="x", hugepages=1)
    with shmkv.Coordinator(cfg, name=f"pop-{uuid.uuid4().hex[:8]}") as coord:
        with pytest.raises(InvalidArgument, match="prefault must be True or False"):
            shmkv.connect(coord.address, prefault="yes")
        # a description whose mapping is smaller than the pool: refused, nothing mapped
        desc = dict(coord.memory.descriptor, map_bytes=cfg.nbytes - 4096)
        fds = [os.dup(fd) for fd in coord.memory.fds]
        with pytest.raises(LayoutMismatch, match="pool mapping of"):
            pool_memory.attach_pool(cfg, desc, fds)
        for fd in fds:  # attach_pool closed them
            with pytest.raises(OSError):
                os.fstat(fd)


def free_huge_pages():
    return shm.huge_pages()[0]


def test_hugepages_fall_back_plainly_when_none_are_free(caplog):
    if free_huge_pages() >= 8:
        pytest.skip("this machine has free huge pages: the fallback cannot be seen")
    cfg = config(8)
    with caplog.at_level(logging.WARNING, logger="shmkv.memory.pool"):
        coord = shmkv.Coordinator(cfg, name=f"pop-{uuid.uuid4().hex[:8]}", hugepages=True)
        coord.start()
    try:
        with shmkv.connect(coord.address) as client:
            stats = client.stats()["pool_memory"]
            assert stats["hugepages"] is False
            assert "huge pages" in stats["hugepages_fallback"]
            assert "vm.nr_hugepages" in stats["hugepages_fallback"]
            h = client.allocate(BS)
            kv = torch.ones(BS, HEADS, 128, dtype=torch.bfloat16)
            h.write(0, kv, kv)
            assert torch.equal(h.gather_all()[0][0], kv)
    finally:
        coord.stop()
    assert "hugepages: not used" in caplog.text and "/dev/shm" in caplog.text


@pytest.fixture
def reserved_huge_pages():
    """8 MiB of huge pages reserved for the test (as root), given back after it."""
    path = "/proc/sys/vm/nr_hugepages"
    if os.geteuid() != 0 or not os.access(path, os.W_OK):
        pytest.skip("reserving huge pages needs root")
    with open(path) as f:
        before = int(f.read())
    try:
        with open(path, "w") as f:
            f.write(str(before + 4))
        if free_huge_pages() < 4:
            pytest.skip("the kernel could not reserve 4 huge pages")
        yield
    finally:
        with open(path, "w") as f:
            f.write(str(before))


def huge_values():
    return (torch.arange(BS * 3 * HEADS * 128) % 251).float().view(BS * 3, HEADS, 128).bfloat16()


def _huge_writer(address, out):
    client = shmkv.connect(address)
    h = client.allocate(BS * 3)
    kv = huge_values()
    for layer in range(8):
        h.write(layer, kv, -kv)
    page = mapping(os.getpid(), client.pool.data_ptr())["page"]
    out.put((h.export(), page))
    client.close()


def test_hugepages_back_the_pool_where_reserved(reserved_huge_pages):
    cfg = config(7)  # 7 MiB: rounded up to 4 pages of 2 MiB
    free = free_huge_pages()
    coord = shmkv.Coordinator.spawn(cfg, name=f"pop-{uuid.uuid4().hex[:8]}", hugepages=True)
    try:
        assert free_huge_pages() == free - 4  # taken whole at start
        with shmkv.connect(coord.address) as client:
            stats = client.stats()["pool_memory"]
            assert stats["hugepages"] is True and stats["hugepages_fallback"] == ""
            assert stats["populate"]["total_bytes"] == 4 * 2 * MIB  # the whole mapping
            assert mapping(os.getpid(), client.pool.data_ptr())["page"] == 2 * MIB
            ctx = multiprocessing.get_context("spawn")
            out = ctx.Queue()
            proc = ctx.Process(target=_huge_writer, args=(coord.address, out))
            proc.start()
            token, page = out.get(timeout=60)
            proc.join(30)
            assert page == 2 * MIB  # the other process's mapping is of huge pages too
            h = client.open(token)
            kv = huge_values()
            got = h.gather_all()
            for layer in range(8):
                assert torch.equal(got[layer][0], kv) and torch.equal(got[layer][1], -kv)
            h.close()
    finally:
        coord.stop()
