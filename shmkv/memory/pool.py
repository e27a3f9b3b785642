"""Pool memory: create it in the coordinator, attach to it in workers.

Owns the choice between the CPU backend (``shmkv.memory.shm``) and the CUDA backend
(``shmkv.memory.cuda``), the typed 6-d view of the raw allocation (its two orders are
``shmkv.memory.views``, which both backends import), and the metadata
segment that every pool has, always in host shared memory: the ``owner`` array, the
ownership ``epoch`` and the shared block tables (layout and rules in ``shmkv.memory.tables``).
Does not decide which block holds what (``shmkv.coordinator.allocator``) and does no socket I/O.

A pool is a list of device pools: one on CPU (every tensor-parallel rank sees its
head slice of it), one per rank on CUDA (each with ``num_kv_heads // tp_size`` heads).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import TYPE_CHECKING, List, Optional

from shmkv.errors import LayoutMismatch
from shmkv.memory import shm
from shmkv.memory.layout import PoolConfig, torch_dtype
from shmkv.memory.tables import SEQ_FIELDS, TableLayout
from shmkv.memory.views import pool_view, storage_view  # used here, and still importable from here

if TYPE_CHECKING:  # (torch is imported where memory is mapped)
    import mmap

    import numpy as np
    import torch

log = logging.getLogger("shmkv.memory.pool")
POPULATE_CHUNK = 16 << 20  # bytes a populate call faults in between checks for stop


class PoolMemory:
    """The memory of one pool as seen by one process.

    ``device_pools[i]`` is a tensor ``[num_blocks, num_layers, 2, block_size, heads_i,
    head_dim]``: a permuted view of memory stored layer-major
    (:func:`~shmkv.memory.views.storage_view` gives it in storage order; ``shmkv.memory.layout``).
    ``owner``, ``epoch``, ``seq``, ``table``, ``scale_lock`` and ``scales`` are
    memoryviews of the metadata segment
    (see ``shmkv.memory.tables``): written by the coordinator only.
    ``owner_t``, ``seq_t`` (``[max_sequences, 4]``) and ``table_t``
    (``[max_sequences, max_seq_blocks]``) are tensors over the same memory, for
    vectorized reads. ``fds`` are the
    descriptors a worker needs (coordinator side); ``descriptor`` is the msgpack-able
    description sent in the handshake.

    ``raw`` is a CPU pool's whole mapping as uint8 (None on CUDA); ``hugepages`` says
    whether it is made of huge pages, and ``hugepages_fallback`` why not, when they
    were asked for and none could be had.

    ``close()`` releases this process's descriptors and metadata mapping; the pool
    tensors stay valid for as long as Python references them (their storage owns
    the mapping), so closing can never leave a dangling view.
    """

    def __init__(self, config: PoolConfig):
        self.config = config
        self.device_pools: List[torch.Tensor] = []
        self.layout = TableLayout.of(config)
        # None until the metadata segment is mapped (create_pool / attach_pool map it
        # before returning), and again after close().
        self.owner: Optional[memoryview] = None
        self.epoch: Optional[memoryview] = None
        self.seq: Optional[memoryview] = None
        self.table: Optional[memoryview] = None
        self.scale_lock: Optional[memoryview] = None
        self.scales: Optional[memoryview[float]] = None
        self.owner_t: Optional[torch.Tensor] = None
        self.seq_t: Optional[torch.Tensor] = None
        self.table_t: Optional[torch.Tensor] = None
        self.seq_np: Optional[np.ndarray] = None
        self.table_np: Optional[np.ndarray] = None
        self._meta_map: Optional[mmap.mmap] = None
        self.fds: List[int] = []
        self.descriptor: dict = {}
        self.raw: Optional[torch.Tensor] = None
        self.hugepages = False
        self.hugepages_fallback = ""

    def prefault(self) -> float:
        """Fault in this process's mapping of a CPU pool (its page tables only: the
        pages themselves are the coordinator's to clear, see :class:`Populator`), so
        that no write of a step meets a page fault. Returns the seconds it took (0.0 on
        CUDA)."""
        if self.raw is None:
            return 0.0
        t0 = time.perf_counter()
        shm.populate(self.raw, 0, self.raw.numel(), write=False)
        return time.perf_counter() - t0

    def rank_view(self, tp_rank: Optional[int], tp_size: Optional[int]):
        """The 6-d pool view of one tensor-parallel rank (all heads when rank is None)."""
        cfg = self.config
        if tp_rank is None:
            if cfg.is_cuda and cfg.tp_size > 1:
                raise LayoutMismatch(
                    "a CUDA pool with tp_size > 1 has one pool per rank: "
                    "connect with tp_rank= and tp_size="
                )
            return self.device_pools[0]
        if tp_size != cfg.tp_size:
            raise LayoutMismatch(
                f"tp_size={tp_size} but the pool was built with tp_size={cfg.tp_size}"
            )
        if cfg.is_cuda:
            return self.device_pools[tp_rank]
        heads = cfg.heads_per_rank
        return self.device_pools[0][..., tp_rank * heads : (tp_rank + 1) * heads, :]

    def copy_block(self, src: int, dst: int) -> None:
        """Copy one block (all layers, K and V, every rank): ``2 * num_layers`` chunks."""
        for pool in self.device_pools:
            pool[dst].copy_(pool[src])

    def _map_meta(self, fd: int, nbytes: int, writable: bool) -> None:
        layout = self.layout
        if nbytes != layout.nbytes:
            raise LayoutMismatch(f"metadata segment of {nbytes} bytes, expected {layout.nbytes}")
        self._meta_map = shm.map_bytes(fd, nbytes, writable)
        self.owner, self.epoch, self.seq, self.table = layout.views(self._meta_map)
        self.scale_lock, self.scales = layout.scale_views(self._meta_map)
        import torch

        raw = shm.map_tensor(fd, nbytes)  # the storage keeps its own mapping alive
        self.owner_t = raw[layout.owner_offset : layout.epoch_offset].view(torch.int64)
        self.seq_t = (
            raw[layout.seq_offset : layout.table_offset]
            .view(torch.int64)
            .view(layout.max_sequences, SEQ_FIELDS)
        )
        self.table_t = (
            raw[layout.table_offset : layout.nbytes]
            .view(torch.int32)
            .view(layout.max_sequences, layout.max_seq_blocks)
        )
        # numpy views of the same memory (its storage still owns the mapping): a batch
        # step's small index arithmetic costs about a microsecond an op in numpy
        self.seq_np, self.table_np = self.seq_t.numpy(), self.table_t.numpy()

    def close_fds(self) -> None:
        """Close this process's descriptors (mappings stay). Idempotent."""
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds = []

    def close(self) -> None:
        """Release descriptors and the metadata mapping. Idempotent."""
        self.close_fds()
        for name in ("owner", "epoch", "seq", "table", "scale_lock", "scales"):  # before the unmap
            view = getattr(self, name)
            if view is not None:
                view.release()
                setattr(self, name, None)
        if self._meta_map is not None:
            self._meta_map.close()
            self._meta_map = None


def _typed(raw, config: PoolConfig):
    """The pool view of a CPU pool's raw bytes (every head), stored layer-major."""
    return pool_view(raw.view(torch_dtype(config.dtype)).view(config.storage_shape))


def block_bytes(pool):
    """The bytes of a whole device pool by block: uint8 ``[num_blocks, 2 * num_layers,
    chunk bytes]`` (no copy). Block ``b``'s bytes are ``[b]``: its layers' K and V in
    order, each row contiguous, rows ``num_blocks`` chunks apart."""
    import torch

    num_blocks, num_layers = pool.shape[0], pool.shape[1]
    return storage_view(pool).view(2 * num_layers, num_blocks, -1).view(torch.uint8).transpose(0, 1)


def create_pool(config: PoolConfig, hugepages: bool = False) -> PoolMemory:
    """Allocate a pool and its metadata (coordinator side). Nothing leaks on failure.

    ``hugepages``: make a CPU pool of huge pages where enough are free, else (said in a
    warning and in ``hugepages_fallback``) of ordinary shared memory."""
    memory = PoolMemory(config)
    meta_bytes = memory.layout.nbytes
    try:
        meta_fd = shm.create_segment(meta_bytes, "metadata")
        memory.fds.append(meta_fd)
        memory._map_meta(meta_fd, meta_bytes, writable=True)
        scales = memory.scales
        assert scales is not None  # (mapped just now)
        for i in range(len(scales)):  # K/V scales are 1.0 until a caller sets them
            scales[i] = 1.0
        memory.descriptor = {"meta_bytes": meta_bytes, "fingerprint": config.fingerprint()}
        if config.is_cuda:
            from shmkv.memory import cuda

            memory.device_pools = cuda.allocate_pools(config)
            memory.descriptor["cuda"] = [cuda.export_tensor(t) for t in memory.device_pools]
        else:
            pool_fd = None
            if hugepages:
                pool_fd, why = shm.create_huge_segment(config.nbytes)
                if pool_fd is None:
                    memory.hugepages_fallback = why
                    log.warning("hugepages: not used, %s; the pool is in %s", why, shm.SHM_DIR)
            if pool_fd is None:
                pool_fd = shm.create_segment(config.nbytes, "pool")
            else:
                memory.hugepages = True
            memory.fds.append(pool_fd)
            map_bytes = shm.segment_bytes(pool_fd)  # (a huge-page segment is rounded up)
            memory.raw = shm.map_tensor(pool_fd, map_bytes)
            memory.device_pools = [_typed(memory.raw[: config.nbytes], config)]
            memory.descriptor["pool_bytes"] = config.nbytes
            memory.descriptor["map_bytes"] = map_bytes
            memory.descriptor["hugepages"] = memory.hugepages
    except BaseException:
        memory.close()
        raise
    return memory


def attach_pool(config: PoolConfig, descriptor: dict, fds: List[int]) -> PoolMemory:
    """Map a pool described by the coordinator's handshake (worker side), zero copy.

    Takes ownership of ``fds`` (they are closed once mapped).
    """
    memory = PoolMemory(config)
    memory.fds = list(fds)
    try:
        if descriptor.get("fingerprint") != config.fingerprint():
            raise LayoutMismatch(
                "pool layout fingerprint differs from the coordinator's "
                "description; client and coordinator versions disagree"
            )
        expected_fds = 1 if config.is_cuda else 2
        if len(fds) != expected_fds:
            raise LayoutMismatch(
                f"handshake passed {len(fds)} descriptors, expected {expected_fds}"
            )
        memory._map_meta(fds[0], descriptor["meta_bytes"], writable=False)
        if config.is_cuda:
            from shmkv.memory import cuda

            memory.device_pools = [cuda.open_tensor(d) for d in descriptor["cuda"]]
        else:
            map_bytes = descriptor.get("map_bytes", config.nbytes)
            if not isinstance(map_bytes, int) or not config.nbytes <= map_bytes:
                raise LayoutMismatch(
                    f"pool mapping of {map_bytes!r} bytes, expected >= {config.nbytes}"
                )
            memory.raw = shm.map_tensor(fds[1], map_bytes)
            memory.device_pools = [_typed(memory.raw[: config.nbytes], config)]
            memory.hugepages = bool(descriptor.get("hugepages"))
    except BaseException:
        memory.close()
        raise
    memory.close_fds()
    return memory


class Populator:
    """Faults in a new CPU pool's pages from a background thread of the coordinator,
    :data:`POPULATE_CHUNK` at a time, so that the first writes of a decode step do not
    each clear and map a page (``shm.populate``). It changes no byte, so the pool is
    served meanwhile. ``stats()`` gives its progress; ``stop()`` ends it between chunks.

    Populated pages are cleared and in the pool's segment, and mapped in the
    coordinator: a worker's own mapping still faults each page once, cheaply, or
    ahead with ``connect(prefault=True)`` (:meth:`PoolMemory.prefault`).
    """

    def __init__(self, raw: torch.Tensor):
        self._raw = raw
        self.total_bytes = raw.numel()
        self.done_bytes = 0
        self.state = "running"  # then "done", "stopped" or "failed"
        self.error = ""
        self.seconds = 0.0  # how long it took (so far, while it runs)
        self._t0 = time.perf_counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="shmkv-populate", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while self.done_bytes < self.total_bytes:
                if self._stop.is_set():
                    self.state = "stopped"
                    return
                n = min(POPULATE_CHUNK, self.total_bytes - self.done_bytes)
                shm.populate(self._raw, self.done_bytes, n, write=True)
                self.done_bytes += n
            self.seconds = time.perf_counter() - self._t0
            self.state = "done"
            log.debug("populated %.1f MiB in %.2f s", self.total_bytes / 2**20, self.seconds)
        except OSError as exc:  # (the pool is served either way: its pages fault later)
            self.state, self.error = "failed", str(exc)
            log.warning("populating the pool failed after %d bytes: %s", self.done_bytes, exc)
        finally:
            self.seconds = time.perf_counter() - self._t0
            self._raw = None  # type: ignore[assignment]  # (its mapping is the pool's to free)

    def stop(self, timeout: float = 10.0) -> None:
        """End it at the next chunk and wait (at most ``timeout`` s). Idempotent."""
        self._stop.set()
        self._thread.join(timeout)

    def stats(self) -> dict:
        running = self.state == "running"
        return {
            "state": self.state,
            "bytes": self.done_bytes,
            "total_bytes": self.total_bytes,
            "seconds": time.perf_counter() - self._t0 if running else self.seconds,
            "error": self.error,
        }
