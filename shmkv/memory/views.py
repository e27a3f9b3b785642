"""The two orders of a pool's memory, as views of one another (no copy, no torch import).

Owns the mapping between the pool view every process indexes,
``[num_blocks, num_layers, 2, block_size, heads, head_dim]``, and the order the bytes
are stored in, layer-major ``[num_layers, 2, num_blocks, block_size, heads, head_dim]``
(``shmkv.memory.layout`` says why). Both memory backends (``shmkv.memory.pool`` for shared memory,
``shmkv.memory.cuda`` for device memory) and the readers of a pool's storage order use it;
it imports nothing of shmkv, so each of them can import it without importing the other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (for the annotations only: this module imports no torch)
    import torch


def pool_view(storage: torch.Tensor) -> torch.Tensor:
    """The pool view ``[num_blocks, num_layers, 2, block_size, heads, head_dim]`` of
    memory in storage order ``[num_layers, 2, num_blocks, ...]`` (no copy); the inverse
    of :func:`storage_view`."""
    return storage.permute(2, 0, 1, 3, 4, 5)


def storage_view(pool: torch.Tensor) -> torch.Tensor:
    """A pool view ``[num_blocks, num_layers, 2, block_size, heads, head_dim]`` in storage
    order, ``[num_layers, 2, num_blocks, block_size, heads, head_dim]`` (no copy;
    contiguous for a whole device pool, a head slice of it for a CPU rank's view)."""
    return pool.permute(1, 2, 0, 3, 4, 5)
