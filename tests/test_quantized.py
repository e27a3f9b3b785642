"""Quantized pools (float8_e4m3fn, float8_e5m2, int8): bytes stored exactly across
processes, per-layer K/V scales beside the pool, paged attention that dequantizes.

Tolerance of paged attention over a quantized pool (stated in docs/operations.md):
against float32 attention over the dequantized values (``stored * scale``) it agrees
to float32 rounding (1e-5); against float32 attention over the original, unquantized
K/V (unit normal, per-layer scale ``amax / qmax``), its largest error is below
``TOLERANCE[dtype] * max|V|``: 2**-4 for e4m3, 2**-3 for e5m2, 2**-6 for int8 (the
element precision of the format; the errors measured here are a third of that or
less).
"""

import math

import pytest
import torch
from conftest import SPAWN, join_or_kill

import shmkv
from shmkv.kernels.attention import AttentionWorkspace, paged_attention

DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2, torch.int8]
QMAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0, torch.int8: 127.0}
TOLERANCE = {torch.float8_e4m3fn: 2**-4, torch.float8_e5m2: 2**-3, torch.int8: 2**-6}


def byte_pattern(seed: int, shape, dtype) -> torch.Tensor:
    """Every byte value (NaN and inf patterns of float8 included), then random bytes."""
    numel = math.prod(shape)
    g = torch.Generator().manual_seed(seed)
    raw = torch.cat(
        [
            torch.arange(256, dtype=torch.int64),
            torch.randint(0, 256, (max(numel - 256, 0),), generator=g),
        ]
    )[:numel]
    return raw.to(torch.uint8).view(dtype).view(shape)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


def _config(dtype, head_dim=8, heads=4, block_size=4):
    return shmkv.PoolConfig(
        num_layers=2,
        num_kv_heads=heads,
        head_dim=head_dim,
        num_blocks=64,
        block_size=block_size,
        dtype=dtype,
    )


# -- children (spawned: module-level functions) ---------------------------------------------


def child_writes_then_reads(address, dtype_name, n, seed, to_parent, from_parent):
    """Write three sequences (per-layer writes, write_all, a batch step), hand them to the
    parent, then read back the one the parent wrote and report whether its bytes match."""
    with shmkv.connect(address, timeout=20) as client:
        cfg = client.config
        dtype = getattr(torch, dtype_name)
        shape = (cfg.num_layers, 2, n, cfg.num_kv_heads, cfg.head_dim)
        kv = byte_pattern(seed, shape, dtype)
        per_layer, whole = client.allocate(n), client.allocate(n)
        for layer in range(cfg.num_layers):
            per_layer.write(layer, kv[layer, 0].contiguous(), kv[layer, 1].contiguous(), start=0)
        whole.write_all(kv, start=0)
        stepped = client.allocate_many([1, 2, 3])
        step = client.batch(stepped).extend(2)
        step_kv = byte_pattern(
            seed + 1, (cfg.num_layers, 2, step.num_tokens, cfg.num_kv_heads, cfg.head_dim), dtype
        )
        step.write_all(step_kv)
        to_parent.put([h.export(ttl=30) for h in [per_layer, whole, *stepped]])
        kind, token, other_seed, other_n = from_parent.get(timeout=30)
        h = client.open(token)
        want = byte_pattern(
            other_seed, (cfg.num_layers, 2, other_n, cfg.num_kv_heads, cfg.head_dim), dtype
        )
        to_parent.put(
            (
                "read",
                same_bytes(h.gather_all(), want)
                and all(
                    same_bytes(h.key_cache(layer), want[layer, 0])
                    for layer in range(cfg.num_layers)
                ),
                client.kv_scales(1),
            )
        )


def child_reads_scales(address, layer, queue):
    with shmkv.connect(address, timeout=20) as client:
        queue.put(client.kv_scales(layer))


# -- tests ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_quantized_pool_round_trips_bytes_exactly_across_processes(dtype, unique_name):
    n, seed = 13, 7  # 13 tokens over blocks of 4: head, whole blocks and a tail
    with (
        shmkv.Coordinator(_config(dtype), name=unique_name) as coord,
        shmkv.connect(coord.address, timeout=20) as client,
    ):
        assert client.pool.dtype == dtype and client.pool.element_size() == 1
        client.set_kv_scales(1, 0.03125, 2.5)
        to_parent, from_parent = SPAWN.Queue(), SPAWN.Queue()
        child = SPAWN.Process(
            target=child_writes_then_reads,
            args=(
                coord.address,
                str(dtype).removeprefix("torch."),
                n,
                seed,
                to_parent,
                from_parent,
            ),
        )
        child.start()
        try:
            tokens = to_parent.get(timeout=60)
            cfg = client.config
            want = byte_pattern(seed, (cfg.num_layers, 2, n, cfg.num_kv_heads, cfg.head_dim), dtype)
            per_layer, whole = client.open(tokens[0]), client.open(tokens[1])
            for h in (per_layer, whole):
                assert h.num_tokens == n
                assert same_bytes(h.gather_all(), want)
                for layer in range(cfg.num_layers):
                    assert same_bytes(h.key_cache(layer), want[layer, 0])
                    assert same_bytes(h.value_cache(layer), want[layer, 1])
            step_want = byte_pattern(
                seed + 1, (cfg.num_layers, 2, 6, cfg.num_kv_heads, cfg.head_dim), dtype
            )
            row = 0
            for token, length in zip(tokens[2:], (1, 2, 3)):
                h = client.open(token)
                got = h.gather_all()[:, :, length:]  # the two tokens the step added
                assert same_bytes(got, step_want[:, :, row : row + 2])
                row += 2

            # the other direction: written here (one block and across blocks), read there
            mine = client.allocate(n)
            other = byte_pattern(
                seed + 2, (cfg.num_layers, 2, n, cfg.num_kv_heads, cfg.head_dim), dtype
            )
            for layer in range(cfg.num_layers):
                mine.write(
                    layer,
                    other[layer, 0, :3].contiguous(),
                    other[layer, 1, :3].contiguous(),
                    start=0,
                )
                mine.write(
                    layer,
                    other[layer, 0, 3:].contiguous(),
                    other[layer, 1, 3:].contiguous(),
                    start=3,
                )
            from_parent.put(("token", mine.export(ttl=30), seed + 2, n))
            kind, ok, scales = to_parent.get(timeout=60)
            assert kind == "read" and ok, "the child read other bytes than were written"
            assert scales == (0.03125, 2.5)
        finally:
            assert join_or_kill(child, 60) == 0


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_rows_no_wide_copy_unit_fits_still_copy_exactly(dtype, unique_name):
    # 1 head x 3 elements: 3-byte rows, so copies fall back to 1-byte units
    with (
        shmkv.Coordinator(_config(dtype, head_dim=3, heads=1), name=unique_name) as coord,
        shmkv.connect(coord.address, timeout=20) as client,
    ):
        h = client.allocate(11)
        kv = byte_pattern(3, (2, 2, 11, 1, 3), dtype)
        h.write_all(kv, start=0)
        assert same_bytes(h.gather_all(), kv)
        h.write(1, kv[0, 0, 2:9].contiguous(), kv[0, 1, 2:9].contiguous(), start=2)
        assert same_bytes(h.key_cache(1)[2:9], kv[0, 0, 2:9])
        step = client.batch([h]).extend(5)
        new = byte_pattern(4, (5, 1, 3), dtype)
        step.write(0, new, new)
        assert same_bytes(h.key_cache(0)[11:], new)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_sources_at_odd_addresses_copy_exactly(dtype, unique_name):
    # 8-byte rows take 8-byte copy units, unless a source starts at an odd address
    with (
        shmkv.Coordinator(_config(dtype, head_dim=8, heads=1), name=unique_name) as coord,
        shmkv.connect(coord.address, timeout=20) as client,
    ):
        h = client.allocate(9)  # a head-less span: whole blocks + tail
        flat = byte_pattern(5, (2 * 2 * 9 * 8 + 1,), dtype)
        kv = flat[1:].view(2, 2, 9, 1, 8)  # contiguous, one byte off
        assert kv.data_ptr() % 2 == 1
        h.write_all(kv, start=0)
        assert same_bytes(h.gather_all(), kv)
        h.write(1, kv[0, 1], kv[0, 0], start=0)
        assert same_bytes(h.key_cache(1), kv[0, 1]) and same_bytes(h.value_cache(1), kv[0, 0])


def test_kv_scales_are_kept_beside_the_pool_for_every_process(unique_name):
    with (
        shmkv.Coordinator(_config(torch.float8_e4m3fn), name=unique_name) as coord,
        shmkv.connect(coord.address, timeout=20) as client,
    ):
        assert client.kv_scales(0) == (1.0, 1.0)  # until someone sets them
        client.set_kv_scales(0, 0.5, torch.tensor(0.25))
        assert client.kv_scales(0) == (0.5, 0.25)
        assert client.kv_scales(1) == (1.0, 1.0)
        for bad in (0.0, -1.0, float("nan"), float("inf")):
            with pytest.raises(shmkv.InvalidArgument):
                client.set_kv_scales(1, bad, 1.0)
        with pytest.raises(shmkv.OutOfRange):
            client.set_kv_scales(2, 1.0, 1.0)
        with pytest.raises(shmkv.OutOfRange):
            client.kv_scales(-1)
        with pytest.raises(shmkv.WrongType):
            client.set_kv_scales(0, "big", 1.0)
        queue = SPAWN.Queue()
        child = SPAWN.Process(target=child_reads_scales, args=(coord.address, 0, queue))
        child.start()
        try:
            assert queue.get(timeout=60) == (0.5, 0.25)
        finally:
            assert join_or_kill(child, 60) == 0


def _reference(q, k, v, block_table, seq_lens, scale):
    """Float32 attention per sequence with explicit loops (GQA by repeating K/V heads)."""
    out = torch.zeros_like(q, dtype=torch.float32)
    heads, kv_heads = q.shape[1], k.shape[2]
    bs = k.shape[1]
    for b, n in enumerate(seq_lens):
        blocks = block_table[b, : -(-n // bs)].long()
        keys = k[blocks].reshape(-1, kv_heads, k.shape[3])[:n].float()
        values = v[blocks].reshape(-1, kv_heads, k.shape[3])[:n].float()
        keys = keys.repeat_interleave(heads // kv_heads, dim=1)  # [n, heads, dim]
        values = values.repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[b].float(), keys) * scale
        out[b] = torch.einsum("hn,nhd->hd", scores.softmax(-1), values)
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_paged_attention_over_a_quantized_pool_is_within_tolerance(dtype, unique_name):
    heads, kv_heads, dim, bs = 8, 2, 64, 16
    cfg = shmkv.PoolConfig(
        num_layers=2, num_kv_heads=kv_heads, head_dim=dim, num_blocks=64, block_size=bs, dtype=dtype
    )
    g = torch.Generator().manual_seed(0)
    lens = [50, 128, 7]
    with (
        shmkv.Coordinator(cfg, name=unique_name) as coord,
        shmkv.connect(coord.address, timeout=20) as client,
    ):
        layer = 1
        originals, handles = [], []
        for n in lens:
            originals.append(
                (
                    torch.randn(n, kv_heads, dim, generator=g),
                    torch.randn(n, kv_heads, dim, generator=g),
                )
            )
        k_amax = max(k.abs().max().item() for k, _ in originals)
        v_amax = max(v.abs().max().item() for _, v in originals)
        client.set_kv_scales(layer, k_amax / QMAX[dtype], v_amax / QMAX[dtype])
        k_scale, v_scale = client.kv_scales(layer)

        def quantize(x, s):
            x = x / s
            return x.round().clamp(-127, 127).to(dtype) if dtype == torch.int8 else x.to(dtype)

        for k, v in originals:
            h = client.allocate(len(k))
            h.write(layer, quantize(k, k_scale), quantize(v, v_scale), start=0)
            handles.append(h)
        k_pages, v_pages, _ = handles[0].paged_kv(layer)
        width = max(h.block_table.num_blocks() for h in handles)
        table = torch.zeros(len(handles), width, dtype=torch.int32)
        for i, h in enumerate(handles):
            table[i, : h.block_table.num_blocks()] = h.block_table.to_tensor()
        q = torch.randn(len(lens), heads, dim, generator=g)
        out = paged_attention(
            q,
            k_pages,
            v_pages,
            table,
            lens,
            k_scale=k_scale,
            v_scale=v_scale,
            workspace=AttentionWorkspace(),
        )
        assert out.dtype == torch.float32 and torch.isfinite(out).all()

        # exact dequantization: float32 attention over stored * scale
        deq = _reference(
            q, k_pages.float() * k_scale, v_pages.float() * v_scale, table, lens, dim**-0.5
        )
        assert (out - deq).abs().max().item() <= 1e-5

        # within the format's precision of attention over the unquantized K/V
        k_full = torch.zeros(k_pages.shape)
        v_full = torch.zeros(v_pages.shape)
        for (k, v), h in zip(originals, handles):
            for i, block in enumerate(h.block_table.physical_blocks):
                k_full[block, : len(k[i * bs : (i + 1) * bs])] = k[i * bs : (i + 1) * bs]
                v_full[block, : len(v[i * bs : (i + 1) * bs])] = v[i * bs : (i + 1) * bs]
        exact = _reference(q, k_full, v_full, table, lens, dim**-0.5)
        assert (out - exact).abs().max().item() <= TOLERANCE[dtype] * v_amax

        # per-head scales and a bf16 query take the same path
        per_head = paged_attention(
            q.bfloat16(),
            k_pages,
            v_pages,
            table,
            lens,
            k_scale=torch.full((kv_heads,), k_scale),
            v_scale=torch.tensor(v_scale),
        )
        assert per_head.dtype == torch.bfloat16
        assert (per_head.float() - deq).abs().max().item() <= 0.05
        with pytest.raises(ValueError):
            paged_attention(q, k_pages, v_pages, table, lens, k_scale=torch.ones(3))
        with pytest.raises(TypeError):
            paged_attention(q, k_pages, v_pages, table, lens, k_scale="1")
