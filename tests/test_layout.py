"""PoolConfig validation, sizes and the fingerprint (no processes)."""

import pytest
import torch

import shmkv
from shmkv.memory.layout import PoolConfig


def test_shape_and_sizes():
    cfg = PoolConfig(
        num_layers=2, num_kv_heads=4, head_dim=8, num_blocks=10, block_size=16, dtype=torch.bfloat16
    )
    assert cfg.shape == (10, 2, 2, 16, 4, 8)
    assert cfg.dtype == "bfloat16"
    assert cfg.block_nbytes == 2 * 2 * 16 * 4 * 8 * 2
    assert cfg.nbytes == 10 * cfg.block_nbytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, "float16", "bf16"])
def test_supported_dtypes(dtype):
    assert PoolConfig(1, 1, 1, 1, dtype=dtype).dtype in ("float32", "float16", "bfloat16")


@pytest.mark.parametrize(
    "field", ["num_layers", "num_kv_heads", "head_dim", "num_blocks", "block_size", "tp_size"]
)
@pytest.mark.parametrize("value", [0, -3])
def test_nonpositive_sizes_rejected(field, value):
    args = dict(num_layers=1, num_kv_heads=2, head_dim=4, num_blocks=8)
    args[field] = value
    with pytest.raises(shmkv.InvalidArgument, match=field):
        PoolConfig(**args)


def test_wrong_types_rejected():
    with pytest.raises(shmkv.WrongType, match="num_blocks"):
        PoolConfig(1, 1, 1, num_blocks=2.5)
    with pytest.raises(TypeError):  # also a TypeError, as Python users expect
        PoolConfig(1, 1, True, 4)


def test_bad_dtype_device_tp():
    with pytest.raises(shmkv.InvalidArgument, match="unsupported dtype"):
        PoolConfig(1, 1, 1, 1, dtype=torch.int32)  # int8 is a quantized pool: supported
    with pytest.raises(ValueError, match="unsupported device"):
        PoolConfig(1, 1, 1, 1, device="tpu")
    with pytest.raises(shmkv.InvalidArgument, match="divisible"):
        PoolConfig(1, 6, 1, 1, tp_size=4)


def test_fingerprint_depends_on_layout():
    a = PoolConfig(2, 4, 8, 16)
    assert a.fingerprint() == PoolConfig(2, 4, 8, 16).fingerprint()
    assert a.fingerprint() != PoolConfig(2, 4, 8, 16, block_size=8).fingerprint()
    assert a.fingerprint() != PoolConfig(2, 4, 8, 16, dtype="float32").fingerprint()
    assert PoolConfig.from_wire(a.to_wire()) == a


def test_pool_larger_than_dev_shm_fails_before_allocating(unique_name):
    import os

    from shmkv.memory.shm import shm_free_bytes

    before = set(os.listdir("/dev/shm"))
    free = shm_free_bytes()
    blocks = free // (2 * 2 * 16 * 8 * 128 * 2) + 1024
    cfg = PoolConfig(num_layers=2, num_kv_heads=8, head_dim=128, num_blocks=blocks)
    assert cfg.nbytes > free
    with pytest.raises(shmkv.InvalidArgument, match="does not fit"):
        shmkv.Coordinator(cfg, name=unique_name).start()
    assert set(os.listdir("/dev/shm")) == before


def test_pool_is_stored_layer_major(client, small_config):
    """A token written through a handle lands where the layer-major storage order puts
    it in the shared segment, and each layer's K and V pages are one contiguous run."""
    cfg = small_config
    num, heads, dim, bs = 10, cfg.num_kv_heads, cfg.head_dim, cfg.block_size
    with client.allocate(num_tokens=num) as h:
        base = torch.arange(num * heads * dim, dtype=torch.float32).view(num, heads, dim)
        for layer in range(cfg.num_layers):
            h.write(layer, base + 1000 * layer, -(base + 1000 * layer) - 1)
        blocks = list(h.block_table.physical_blocks)
        pool = client.pool
        flat = torch.empty(0, dtype=torch.float32).set_(pool.untyped_storage())
        row_elems = heads * dim
        for layer in range(cfg.num_layers):
            for which in (0, 1):
                for pos in range(num):
                    row = ((2 * layer + which) * cfg.num_blocks + blocks[pos // bs]) * bs + pos % bs
                    want = base[pos] + 1000 * layer
                    want = want if which == 0 else -want - 1
                    got = flat[row * row_elems : (row + 1) * row_elems].view(heads, dim)
                    assert torch.equal(got, want), (layer, which, pos)
            pages = pool[:, layer, 0]
            assert pages.is_contiguous() and pool[:, layer, 1].is_contiguous()
            assert (
                pages.data_ptr() - pool.data_ptr()
                == 2 * layer * cfg.num_blocks * bs * row_elems * 4
            )


def test_block_bytes_are_a_block_in_block_order(client, small_config):
    """What tiers, remote stores and transfers copy out of the pool for a block is its
    [num_layers, 2, block_size, heads, head_dim] values in that order."""
    from shmkv.memory.pool import block_bytes

    pool = client.pool
    pool.copy_(torch.randn(pool.shape))
    rows = block_bytes(pool)
    assert tuple(rows.shape) == (
        small_config.num_blocks,
        2 * small_config.num_layers,
        small_config.chunk_nbytes,
    )
    for b in (0, 5, small_config.num_blocks - 1):
        assert torch.equal(rows[b].reshape(-1), pool[b].contiguous().view(torch.uint8).view(-1))
