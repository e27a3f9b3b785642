"""CUDA memory backend: one plain device allocation per rank, shared by CUDA IPC.

Owns allocating device pools that can be exported, turning a pool into a
msgpack-able descriptor (the CUDA IPC handle bytes and offsets), and opening that
descriptor in another process. Does not decide what goes in the pool.

Rules users must follow (also in the README):

* Worker processes use the ``spawn`` start method (CUDA cannot be used after fork).
* The coordinator outlives its workers' use of the pool: device memory dies with
  its exporter. Clients detect a gone coordinator (socket hang-up) before every
  data-plane call and raise ``CoordinatorGone`` rather than touching freed memory.
* A client in the coordinator's own process uses the original tensors (CUDA
  refuses to open an IPC handle in the exporting process); ``shmkv.client.client`` does
  this through the coordinator's in-process registry.

Export needs memory from the plain caching allocator: segments made with
``expandable_segments`` or by ``cudaMallocAsync`` cannot be exported. Expandable
segments are switched off around the pool allocation; ``cudaMallocAsync`` cannot be
switched at run time, so it is refused with a message saying what to change.
"""

from __future__ import annotations

import os
from typing import List

from shmkv.errors import InvalidArgument, ShmkvError
from shmkv.memory.layout import PoolConfig, torch_dtype
from shmkv.memory.views import pool_view


def _check_allocator() -> None:
    conf = (
        os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
        + ","
        + os.environ.get("PYTORCH_ALLOC_CONF", "")
    )
    if "cudaMallocAsync" in conf:
        raise InvalidArgument(
            "PYTORCH_CUDA_ALLOC_CONF selects backend:cudaMallocAsync, whose memory cannot "
            "be exported through CUDA IPC; start the coordinator without it (the "
            "workers may keep it)"
        )


def allocate_pools(config: PoolConfig) -> List:
    """One zeroed, exportable device tensor per rank."""
    import torch

    if not torch.cuda.is_available():
        raise InvalidArgument(f"device={config.device!r} but CUDA is not available here")
    _check_allocator()
    devices = config.rank_devices()
    for device in devices:
        if int(device.split(":")[1]) >= torch.cuda.device_count():
            raise InvalidArgument(
                f"{device} does not exist: {torch.cuda.device_count()} CUDA device(s) visible"
            )
    heads = config.heads_per_rank
    per_rank = config.nbytes // config.tp_size
    for device in devices:
        free, _total = torch.cuda.mem_get_info(torch.device(device))
        if per_rank > free:
            raise InvalidArgument(
                f"pool of {per_rank / 2**20:.1f} MiB per rank does not fit "
                f"on {device}: {free / 2**20:.1f} MiB free"
            )
    # Stored layer-major (shmkv.memory.layout); each rank's pool is the permuted view, whose
    # strides the export carries.
    shape = (config.num_layers, 2, config.num_blocks, config.block_size, heads, config.head_dim)
    settings = getattr(torch.cuda.memory, "_set_allocator_settings", None)
    if settings is not None:
        settings("expandable_segments:False")
    try:
        pools = [
            pool_view(torch.zeros(shape, dtype=torch_dtype(config.dtype), device=device))
            for device in devices
        ]
    finally:
        if settings is not None and "expandable_segments:True" in os.environ.get(
            "PYTORCH_CUDA_ALLOC_CONF", ""
        ):
            settings("expandable_segments:True")
    return pools


def export_tensor(tensor) -> dict:
    """A msgpack-able descriptor of a device pool (IPC handle bytes, sizes, offsets)."""
    storage = tensor.untyped_storage()
    try:
        (
            device,
            handle,
            storage_bytes,
            offset_bytes,
            ref_handle,
            ref_offset,
            event_handle,
            event_sync,
        ) = storage._share_cuda_()
    except RuntimeError as exc:
        raise ShmkvError(
            f"cannot export the pool through CUDA IPC: {exc}; check "
            "PYTORCH_CUDA_ALLOC_CONF (no expandable segments, no "
            "cudaMallocAsync)"
        ) from exc
    return {
        "device": device,
        "handle": handle,
        "storage_bytes": storage_bytes,
        "offset_bytes": offset_bytes,
        "ref_handle": ref_handle,
        "ref_offset": ref_offset,
        "event_handle": event_handle,
        "event_sync": event_sync,
        "shape": list(tensor.shape),
        "stride": list(tensor.stride()),
        "storage_offset": tensor.storage_offset(),
        "dtype": str(tensor.dtype)[6:],
    }


def open_tensor(desc: dict):
    """Open an exported device pool in this (non-exporting) process, zero copy."""
    import torch

    storage = torch.UntypedStorage._new_shared_cuda(
        desc["device"],
        desc["handle"],
        desc["storage_bytes"],
        desc["offset_bytes"],
        desc["ref_handle"],
        desc["ref_offset"],
        desc["event_handle"],
        desc["event_sync"],
    )
    dtype = torch_dtype(desc["dtype"])
    out = torch.empty(0, dtype=dtype, device=f"cuda:{desc['device']}")
    return out.set_(storage, desc["storage_offset"], desc["shape"], desc["stride"])
