"""paged_attention against dense scaled_dot_product_attention over the gathered K/V."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shmkv.attention import paged_attention

HEAD_DIM = 16
NUM_KV_HEADS = 2


def random_pages(num_blocks: int, block_size: int, dtype=torch.float32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    return (torch.randn(shape, generator=gen).to(dtype),
            torch.randn(shape, generator=gen).to(dtype), gen)


def random_table(seq_lens, block_size: int, num_blocks: int, gen, pad: int = -1):
    """Distinct random pages per sequence; entries past each sequence's blocks are ``pad``."""
    need = [-(-n // block_size) for n in seq_lens]
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    table = torch.full((len(seq_lens), max(need) + 1), pad, dtype=torch.int32)
    for b, count in enumerate(need):
        table[b, :count] = torch.tensor(perm[:count], dtype=torch.int32)
        perm = perm[count:]
    return table


def gather(pages, table_row, n: int, block_size: int) -> torch.Tensor:
    pos = torch.arange(n)
    return pages[table_row.long()[pos // block_size], pos % block_size]      # [n, heads, dim]


def dense_reference(q, k_pages, v_pages, table, seq_lens, block_size, causal=True,
                    query_start=None):
    """Per sequence: gather K/V, repeat heads for GQA, run SDPA with an explicit mask."""
    batch, q_len, num_heads, _ = q.shape
    out = torch.zeros_like(q)
    for b in range(batch):
        n = seq_lens[b]
        k = gather(k_pages, table[b], n, block_size)
        v = gather(v_pages, table[b], n, block_size)
        group = num_heads // k.shape[1]
        k = k.repeat_interleave(group, dim=1).transpose(0, 1)[None]
        v = v.repeat_interleave(group, dim=1).transpose(0, 1)[None]
        start = (n - q_len) if query_start is None else query_start[b]
        mask = None
        if causal:
            mask = torch.arange(n)[None, :] <= (start + torch.arange(q_len))[:, None]
        out[b] = F.scaled_dot_product_attention(q[b].transpose(0, 1)[None], k, v,
                                                attn_mask=mask)[0].transpose(0, 1)
    return out


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("block_size", [4, 16])
def test_prefill_matches_dense(group, block_size):
    k_pages, v_pages, gen = random_pages(64, block_size, seed=group * 100 + block_size)
    seq_lens = [1, block_size - 1, block_size, block_size + 1, 3 * block_size + 2, 37]
    q_len = 5
    seq_lens = [max(n, q_len) for n in seq_lens]
    table = random_table(seq_lens, block_size, 64, gen)
    q = torch.randn(len(seq_lens), q_len, NUM_KV_HEADS * group, HEAD_DIM, generator=gen)
    got = paged_attention(q, k_pages, v_pages, table, seq_lens)
    want = dense_reference(q, k_pages, v_pages, table, seq_lens, block_size)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("group", [1, 2, 4])
def test_decode_matches_dense(group):
    block_size = 4
    k_pages, v_pages, gen = random_pages(48, block_size, seed=7 + group)
    seq_lens = [1, 3, 4, 5, 8, 9, 17, 30]
    table = random_table(seq_lens, block_size, 48, gen, pad=10**6)
    q = torch.randn(len(seq_lens), NUM_KV_HEADS * group, HEAD_DIM, generator=gen)
    got = paged_attention(q, k_pages, v_pages, table, torch.tensor(seq_lens, dtype=torch.int32))
    assert got.shape == q.shape
    want = dense_reference(q[:, None], k_pages, v_pages, table, seq_lens, block_size)[:, 0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_whole_sequence_prefill_equals_is_causal_sdpa():
    block_size = 4
    k_pages, v_pages, gen = random_pages(16, block_size, seed=3)
    n = 11
    table = random_table([n], block_size, 16, gen)
    q = torch.randn(1, n, NUM_KV_HEADS * 2, HEAD_DIM, generator=gen)
    got = paged_attention(q, k_pages, v_pages, table, [n])
    k = gather(k_pages, table[0], n, block_size).transpose(0, 1)[None]
    v = gather(v_pages, table[0], n, block_size).transpose(0, 1)[None]
    want = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, is_causal=True,
                                          enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_query_start_and_non_causal():
    block_size = 4
    k_pages, v_pages, gen = random_pages(32, block_size, seed=11)
    seq_lens = [9, 14]
    table = random_table(seq_lens, block_size, 32, gen)
    q = torch.randn(2, 3, NUM_KV_HEADS * 2, HEAD_DIM, generator=gen)
    starts = [2, 6]
    got = paged_attention(q, k_pages, v_pages, table, seq_lens, query_start=starts)
    want = dense_reference(q, k_pages, v_pages, table, seq_lens, block_size, query_start=starts)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    got = paged_attention(q, k_pages, v_pages, table, seq_lens, causal=False, scale=0.3)
    want = dense_reference(q * (0.3 * HEAD_DIM ** 0.5), k_pages, v_pages, table, seq_lens,
                           block_size, causal=False)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, paged_attention(q, k_pages, v_pages, table, seq_lens))


def test_rows_without_keys_are_zero_and_half_precision():
    block_size = 4
    k_pages, v_pages, gen = random_pages(16, block_size, dtype=torch.bfloat16, seed=5)
    seq_lens = [6, 2]
    table = random_table(seq_lens, block_size, 16, gen)
    q = torch.randn(2, 4, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)
    starts = [2, -2]
    got = paged_attention(q, k_pages, v_pages, table, seq_lens, query_start=starts)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got[1, :2], torch.zeros_like(got[1, :2]))  # positions -2, -1
    assert not torch.isnan(got).any()
    want = dense_reference(q.float(), k_pages.float(), v_pages.float(), table, seq_lens,
                           block_size, query_start=starts)
    torch.testing.assert_close(got[0].float(), want[0], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got[1, 2:].float(), want[1, 2:], rtol=2e-2, atol=2e-2)


def test_bad_arguments():
    k_pages, v_pages, gen = random_pages(8, 4)
    table = torch.zeros(1, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="multiple"):
        paged_attention(torch.randn(1, 3, HEAD_DIM), k_pages, v_pages, table, [4])
    with pytest.raises(ValueError, match="more blocks"):
        paged_attention(torch.randn(1, 2, HEAD_DIM), k_pages, v_pages, table, [9])
    with pytest.raises(ValueError, match="outside"):
        paged_attention(torch.randn(1, 2, HEAD_DIM), k_pages, v_pages,
                        torch.tensor([[8, 0]], dtype=torch.int32), [3])
    with pytest.raises(TypeError):
        paged_attention(torch.randn(1, 2, HEAD_DIM), k_pages, v_pages, table.float(), [3])


def test_on_shmkv_handles(client):
    """Pages and block tables straight from handles equal SDPA over the gathered K/V."""
    cfg = client.config
    gen = torch.Generator().manual_seed(1)
    lengths = [3, cfg.block_size, 2 * cfg.block_size + 1, 10]
    handles = [client.allocate(num_tokens=n) for n in lengths]
    layer = 1
    for h, n in zip(handles, lengths):
        h.write(layer, torch.randn(n, cfg.num_kv_heads, cfg.head_dim, generator=gen),
                torch.randn(n, cfg.num_kv_heads, cfg.head_dim, generator=gen), start=0)
    k_pages, v_pages, _ = handles[0].paged_kv(layer)
    tables = [h.paged_kv(layer)[2] for h in handles]
    table = torch.zeros(len(handles), max(t.numel() for t in tables), dtype=torch.int32)
    for b, t in enumerate(tables):
        table[b, :t.numel()] = t
    group = 2
    q_len = 3
    q = torch.randn(len(handles), q_len, cfg.num_kv_heads * group, cfg.head_dim, generator=gen)
    got = paged_attention(q, k_pages, v_pages, table, [h.num_tokens for h in handles])
    for b, h in enumerate(handles):
        k, v = h.kv_cache(layer)
        n = h.num_tokens
        mask = torch.arange(n)[None, :] <= (n - q_len + torch.arange(q_len))[:, None]
        want = F.scaled_dot_product_attention(
            q[b].transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            attn_mask=mask, enable_gqa=True)[0].transpose(0, 1)
        # A query position before the first key (n < q_len) has nothing to attend to.
        valid = (n - q_len + torch.arange(q_len)) >= 0
        torch.testing.assert_close(got[b][valid], want[valid], rtol=1e-5, atol=1e-5)
        assert torch.equal(got[b][~valid], torch.zeros_like(got[b][~valid]))
    client.close_many(handles)
