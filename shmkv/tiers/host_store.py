"""The host tier bound to one pool (:class:`HostStore`): its shared-memory slots, their
free list, its index and its counters.

Owns the segment (made, mapped, registered with CUDA under a GPU pool, closed), the
read-only descriptor clients map, and :meth:`HostStore.stats`. Which key sits in which
slot is decided by the demotion part (``shmkv.tiers.demotion``), the only code that
changes the index and the free list; the promotion part reads them. The same class makes
a disk tier's staging slots. Imports ``shmkv.memory.shm``, ``shmkv.errors`` and
``shmkv.tiers.specs`` / ``entry``.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from typing import TYPE_CHECKING, List, Optional

import numpy as np

from shmkv.errors import InvalidArgument
from shmkv.memory import shm
from shmkv.tiers.entry import Entry
from shmkv.tiers.specs import HostTier

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


class HostStore:
    """A host tier (or staging slots) bound to one pool: ``num_slots`` slots of
    ``slot_nbytes`` each, in one shared-memory segment (see the module doc)."""

    name = "host"

    def __init__(self, spec: HostTier, config, what: str = "host tier"):
        self.slot_nbytes = config.block_nbytes
        self.num_slots = spec.capacity_bytes // self.slot_nbytes
        self.capacity_bytes = spec.capacity_bytes
        self.data: Optional[torch.Tensor] = None  # uint8 [num_slots, slot_nbytes]
        self.np: Optional[np.ndarray] = None  # the same, as numpy
        self.fd: Optional[int] = None  # for the tier I/O process (closed once it has it)
        self._registered: Optional[int] = None  # the address cudaHostRegister took
        if self.num_slots < 1:
            raise InvalidArgument(
                f"HostTier capacity_bytes={spec.capacity_bytes} holds no "
                f"block of {self.slot_nbytes} bytes; raise it"
            )
        nbytes = self.num_slots * self.slot_nbytes
        self.fd = shm.create_segment(nbytes, what)
        self.ro_fd: Optional[int] = None  # read-only, for clients (read_only_fd)
        self.data = shm.map_tensor(self.fd, nbytes).view(self.num_slots, self.slot_nbytes)
        self.np = self.data.numpy()  # the mapping lives as long as these views
        if config.is_cuda:  # page-locked, so copies to and from the GPU are DMA
            import torch

            ptr = self.data.data_ptr()
            code = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
            if int(code) == 0:
                self._registered = ptr
            else:
                log.warning("%s: cudaHostRegister failed (%s); copies will be staged", what, code)
        self.free: List[int] = list(range(self.num_slots - 1, -1, -1))
        self.index: "OrderedDict[bytes, Entry]" = OrderedDict()
        self.num_ready = 0
        self.counters = {"hits": 0, "demotions": 0, "promotions": 0, "dropped": 0, "errors": 0}

    def stats(self) -> dict:
        blocks = self.num_ready
        out = {
            "tier": "host",
            "blocks": blocks,
            "bytes": blocks * self.slot_nbytes,
            "capacity_bytes": self.capacity_bytes,
            "slots": self.num_slots,
        }
        out.update(self.counters)
        return out

    def read_only_fd(self) -> Optional[int]:
        """A descriptor of the slots that only reads (opened again through ``/proc``),
        kept for clients that copy their own promotions; None where it cannot be made."""
        if self.ro_fd is None and self.fd is not None:
            try:
                self.ro_fd = os.open(f"/proc/self/fd/{self.fd}", os.O_RDONLY | os.O_CLOEXEC)
            except OSError as exc:
                log.warning("host tier: no read-only descriptor for clients (%s)", exc)
        return self.ro_fd

    def close_fd(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def close(self) -> None:
        self.close_fd()
        if self.ro_fd is not None:
            os.close(self.ro_fd)
            self.ro_fd = None
        if self._registered is not None:
            import torch

            torch.cuda.cudart().cudaHostUnregister(self._registered)
            self._registered = None
        self.data = self.np = None  # the mapping goes with the last tensor
