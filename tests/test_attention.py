"""paged_attention against dense scaled_dot_product_attention over the gathered K/V."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shmkv.kernels import native
from shmkv.kernels.attention import AttentionWorkspace, PagedAttentionPlan, paged_attention

HEAD_DIM = 16
NUM_KV_HEADS = 2


def random_pages(num_blocks: int, block_size: int, dtype=torch.float32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    return (
        torch.randn(shape, generator=gen).to(dtype),
        torch.randn(shape, generator=gen).to(dtype),
        gen,
    )


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
    return pages[table_row.long()[pos // block_size], pos % block_size]  # [n, heads, dim]


def dense_reference(
    q, k_pages, v_pages, table, seq_lens, block_size, causal=True, query_start=None
):
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
        out[b] = F.scaled_dot_product_attention(q[b].transpose(0, 1)[None], k, v, attn_mask=mask)[
            0
        ].transpose(0, 1)
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
    want = F.scaled_dot_product_attention(
        q.transpose(1, 2), k, v, is_causal=True, enable_gqa=True
    ).transpose(1, 2)
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
    want = dense_reference(
        q * (0.3 * HEAD_DIM**0.5), k_pages, v_pages, table, seq_lens, block_size, causal=False
    )
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
    want = dense_reference(
        q.float(), k_pages.float(), v_pages.float(), table, seq_lens, block_size, query_start=starts
    )
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
        paged_attention(
            torch.randn(1, 2, HEAD_DIM),
            k_pages,
            v_pages,
            torch.tensor([[8, 0]], dtype=torch.int32),
            [3],
        )
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
        h.write(
            layer,
            torch.randn(n, cfg.num_kv_heads, cfg.head_dim, generator=gen),
            torch.randn(n, cfg.num_kv_heads, cfg.head_dim, generator=gen),
            start=0,
        )
    k_pages, v_pages, _ = handles[0].paged_kv(layer)
    tables = [h.paged_kv(layer)[2] for h in handles]
    table = torch.zeros(len(handles), max(t.numel() for t in tables), dtype=torch.int32)
    for b, t in enumerate(tables):
        table[b, : t.numel()] = t
    group = 2
    q_len = 3
    q = torch.randn(len(handles), q_len, cfg.num_kv_heads * group, cfg.head_dim, generator=gen)
    got = paged_attention(q, k_pages, v_pages, table, [h.num_tokens for h in handles])
    for b, h in enumerate(handles):
        k, v = h.kv_cache(layer)
        n = h.num_tokens
        mask = torch.arange(n)[None, :] <= (n - q_len + torch.arange(q_len))[:, None]
        want = F.scaled_dot_product_attention(
            q[b].transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            attn_mask=mask,
            enable_gqa=True,
        )[0].transpose(0, 1)
        # A query position before the first key (n < q_len) has nothing to attend to.
        valid = (n - q_len + torch.arange(q_len)) >= 0
        torch.testing.assert_close(got[b][valid], want[valid], rtol=1e-5, atol=1e-5)
        assert torch.equal(got[b][~valid], torch.zeros_like(got[b][~valid]))
    client.close_many(handles)


# --- packed (varlen) form, output buffers, the old implementation as a baseline ---


def pool_pages(num_blocks: int, block_size: int, num_kv_heads: int, dtype, seed: int):
    """K/V pages as strided views of a pool stored ``[blocks, layers, 2, block, heads,
    dim]`` (block-major: pages a block apart, the strided case; shmkv's own pool is
    stored layer-major, whose layer views are contiguous)."""
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn(num_blocks, 3, 2, block_size, num_kv_heads, HEAD_DIM, generator=gen).to(
        dtype
    )
    return pool[:, 1, 0], pool[:, 1, 1], gen


def garbage_table(seq_lens, block_size: int, num_blocks: int, gen, extra: int = 2):
    """Distinct random pages per sequence; every entry past a sequence's blocks is junk."""
    need = [-(-n // block_size) for n in seq_lens]
    table = torch.randint(
        -(2**31),
        2**31 - 1,
        (len(seq_lens), max(need + [0]) + extra),
        generator=gen,
        dtype=torch.int64,
    ).to(torch.int32)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    for b, count in enumerate(need):
        table[b, :count] = torch.tensor(perm[:count], dtype=torch.int32)
        perm = perm[count:]
    return table


def varlen_reference(q, k_pages, v_pages, table, seq_lens, locs, causal=True, scale=None):
    """Plain softmax attention in float64, one sequence at a time (queries are the last
    tokens of their sequence); rows of no sequence and rows with no key stay zero."""
    num_rows, num_heads, head_dim = q.shape
    block_size = k_pages.shape[1]
    scale = head_dim**-0.5 if scale is None else scale
    out = torch.zeros(num_rows, num_heads, head_dim, dtype=torch.float64)
    for b, n in enumerate(seq_lens):
        r0, r1 = locs[b], locs[b + 1]
        if r1 == r0 or n == 0:
            continue
        k = gather(k_pages, table[b], n, block_size).double()
        v = gather(v_pages, table[b], n, block_size).double()
        group = num_heads // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[r0:r1].double(), k) * scale
        if causal:
            pos = n - (r1 - r0) + torch.arange(r1 - r0)
            scores = scores.masked_fill(torch.arange(n)[None, :] > pos[:, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
        out[r0:r1] = torch.einsum("hqk,khd->qhd", probs, v)
    return out


TOLERANCE = {
    torch.float32: dict(rtol=2e-5, atol=2e-5),
    torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
    torch.float16: dict(rtol=2e-3, atol=2e-3),
}


def packed_batch(counts, seq_lens, group, block_size, dtype, seed, pad_rows=0):
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 5
    k_pages, v_pages, gen = pool_pages(num_blocks, block_size, NUM_KV_HEADS, dtype, seed)
    table = garbage_table(seq_lens, block_size, num_blocks, gen)
    locs = [0]
    for c in counts:
        locs.append(locs[-1] + c)
    q = torch.randn(locs[-1] + pad_rows, NUM_KV_HEADS * group, HEAD_DIM, generator=gen).to(dtype)
    return q, k_pages, v_pages, table, locs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("block_size", [4, 16])
def test_packed_mixed_prefill_and_decode_match_reference(dtype, group, block_size):
    # A whole prompt, decodes of very different lengths, a chunk of a longer prompt
    # (prefill with earlier context), a sequence idle this step, speculative tokens.
    counts = [37, 1, 9, 1, 0, 1, 3, 1, 20]
    seq_lens = [37, 2 * block_size, 9 + 3 * block_size + 1, 1, 12, 150, 3 * block_size, 7, 61]
    q, k_pages, v_pages, table, locs = packed_batch(
        counts, seq_lens, group, block_size, dtype, seed=group * 10 + block_size, pad_rows=3
    )
    got = paged_attention(
        q,
        k_pages,
        v_pages,
        table,
        torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.tensor(locs, dtype=torch.int32),
    )
    assert got.shape == q.shape and got.dtype == dtype
    want = varlen_reference(q, k_pages, v_pages, table, seq_lens, locs)
    torch.testing.assert_close(got.double(), want, **TOLERANCE[dtype])
    assert torch.equal(got[locs[-1] :], torch.zeros_like(got[locs[-1] :]))  # padding rows


@pytest.mark.parametrize("group", [1, 2, 4])
def test_packed_non_causal_and_scale(group):
    counts, seq_lens = [4, 1, 6], [10, 33, 6]
    q, k_pages, v_pages, table, locs = packed_batch(counts, seq_lens, group, 8, torch.float32, 3)
    got = paged_attention(
        q, k_pages, v_pages, table, seq_lens, query_start_loc=locs, causal=False, scale=0.2
    )
    want = varlen_reference(q, k_pages, v_pages, table, seq_lens, locs, causal=False, scale=0.2)
    torch.testing.assert_close(got.double(), want, **TOLERANCE[torch.float32])


def test_packed_rows_without_keys_are_zero(monkeypatch):
    # More queries than tokens: the first rows sit before the sequence's first token.
    # An empty padding sequence (no queries, no tokens) is skipped.
    counts, seq_lens = [5, 0, 2], [3, 0, 9]
    q, k_pages, v_pages, table, locs = packed_batch(counts, seq_lens, 2, 4, torch.float32, 4)
    calls = count_sdpa_calls(monkeypatch)
    got = paged_attention(q, k_pages, v_pages, table, seq_lens, query_start_loc=locs)
    assert all(ok for _, ok in calls)  # SDPA is never asked for a row with no key
    assert not torch.isnan(got).any()
    assert torch.equal(got[:2], torch.zeros_like(got[:2]))
    want = varlen_reference(q, k_pages, v_pages, table, seq_lens, locs)
    torch.testing.assert_close(got.double(), want, **TOLERANCE[torch.float32])


def count_sdpa_calls(monkeypatch):
    """SDPA calls of the torch path (the native decode kernel is turned off: these tests
    are about how that path groups its calls; tests/test_native.py covers the kernel)."""
    monkeypatch.setattr(native, "decoder", lambda: None)
    calls = []
    real = F.scaled_dot_product_attention

    def counting(q, k, v, attn_mask=None, **kwargs):
        # (query shape, whether every query row of the mask may attend to some key)
        calls.append((tuple(q.shape), attn_mask is None or bool(attn_mask.any(-1).all())))
        return real(q, k, v, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", counting)
    return calls


@pytest.mark.parametrize("group", [1, 2, 4])
def test_decode_batch_is_one_call_and_matches(group, monkeypatch):
    block_size = 16
    seq_lens = [200, 190, 201, 180, 199]
    counts = [1] * len(seq_lens)
    q, k_pages, v_pages, table, locs = packed_batch(
        counts, seq_lens, group, block_size, torch.float32, seed=group
    )
    calls = count_sdpa_calls(monkeypatch)
    got = paged_attention(q, k_pages, v_pages, table, seq_lens, query_start_loc=locs)
    assert len(calls) == 1
    want = varlen_reference(q, k_pages, v_pages, table, seq_lens, locs)
    torch.testing.assert_close(got.double(), want, **TOLERANCE[torch.float32])
    # The decode form of the batch call takes the same path and gives the same result.
    assert torch.equal(paged_attention(q, k_pages, v_pages, table, seq_lens), got)


def test_far_apart_lengths_and_prefills_get_their_own_calls(monkeypatch):
    block_size = 8
    counts, seq_lens = [1, 1, 30, 1], [6, 700, 30, 5]
    q, k_pages, v_pages, table, locs = packed_batch(
        counts, seq_lens, 4, block_size, torch.float32, seed=9
    )
    calls = count_sdpa_calls(monkeypatch)
    got = paged_attention(q, k_pages, v_pages, table, seq_lens, query_start_loc=locs)
    # Decodes of 6 and 5 keys share a call; the 700-key decode and the prefill do not
    # pad them (nor each other).
    assert len(calls) == 3
    want = varlen_reference(q, k_pages, v_pages, table, seq_lens, locs)
    torch.testing.assert_close(got.double(), want, **TOLERANCE[torch.float32])


def test_without_enable_gqa_folds_heads(monkeypatch):
    """The torch < 2.5 path (query heads folded into rows) gives the same result."""
    import shmkv.kernels.gather as gather_mod

    counts, seq_lens = [12, 1, 3], [12, 40, 20]
    q, k_pages, v_pages, table, locs = packed_batch(counts, seq_lens, 4, 4, torch.float32, 5)
    monkeypatch.setattr(gather_mod, "HAS_ENABLE_GQA", False)
    got = paged_attention(q, k_pages, v_pages, table, seq_lens, query_start_loc=locs)
    want = varlen_reference(q, k_pages, v_pages, table, seq_lens, locs)
    torch.testing.assert_close(got.double(), want, **TOLERANCE[torch.float32])


def test_out_is_written_and_returned():
    counts, seq_lens = [5, 0, 1, 2], [5, 4, 30, 1]
    q, k_pages, v_pages, table, locs = packed_batch(
        counts, seq_lens, 2, 4, torch.float32, 6, pad_rows=2
    )
    want = paged_attention(q, k_pages, v_pages, table, seq_lens, query_start_loc=locs)
    out = torch.full_like(q, float("nan"))
    assert (
        paged_attention(q, k_pages, v_pages, table, seq_lens, query_start_loc=locs, out=out) is out
    )
    assert torch.equal(out, want)  # padding and keyless rows overwritten with zeros
    strided = torch.full((q.shape[1], q.shape[0], q.shape[2]), float("nan")).transpose(0, 1)
    assert (
        paged_attention(q, k_pages, v_pages, table, seq_lens, query_start_loc=locs, out=strided)
        is strided
    )
    assert torch.equal(strided, want)
    batch_q = q[:4].view(2, 2, *q.shape[1:])
    batch_out = torch.empty_like(batch_q)
    got = paged_attention(batch_q, k_pages, v_pages, table[:2], seq_lens[:2], out=batch_out)
    assert got is batch_out
    assert torch.equal(got, paged_attention(batch_q, k_pages, v_pages, table[:2], seq_lens[:2]))


def test_workspace_is_reused_and_changes_nothing(monkeypatch):
    monkeypatch.setattr(native, "decoder", lambda: None)  # the torch path gathers into it
    workspace = AttentionWorkspace()
    assert workspace.nbytes == 0
    steps = [
        ([1, 1, 1], [5, 9, 30], torch.float32),
        ([7, 1, 1], [40, 10, 31], torch.float32),
        ([1, 1, 1], [6, 10, 32], torch.float32),
        ([4, 1], [60, 3], torch.bfloat16),
        ([1, 1, 1], [7, 11, 33], torch.float32),
    ]
    held = []
    for seed, (counts, seq_lens, dtype) in enumerate(steps):
        q, k_pages, v_pages, table, locs = packed_batch(counts, seq_lens, 2, 4, dtype, seed)
        got = paged_attention(
            q, k_pages, v_pages, table, seq_lens, query_start_loc=locs, workspace=workspace
        )
        assert torch.equal(
            got, paged_attention(q, k_pages, v_pages, table, seq_lens, query_start_loc=locs)
        )
        held.append(workspace.nbytes)
    assert held[0] > 0 and held[2] == held[1]  # a smaller call reuses what is there
    workspace.clear()
    assert workspace.nbytes == 0
    with pytest.raises(TypeError, match="AttentionWorkspace"):
        paged_attention(
            q, k_pages, v_pages, table, seq_lens, query_start_loc=locs, workspace=torch.empty(10)
        )


def test_pages_of_another_dtype_are_converted():
    counts, seq_lens = [3, 1], [7, 12]
    q, k_pages, v_pages, table, locs = packed_batch(counts, seq_lens, 2, 4, torch.bfloat16, 8)
    got = paged_attention(q.float(), k_pages, v_pages, table, seq_lens, query_start_loc=locs)
    assert got.dtype == torch.float32
    want = varlen_reference(q.float(), k_pages, v_pages, table, seq_lens, locs)
    torch.testing.assert_close(got.double(), want, **TOLERANCE[torch.float32])


def test_packed_bad_arguments():
    counts, seq_lens = [2, 1], [4, 3]
    q, k_pages, v_pages, table, locs = packed_batch(counts, seq_lens, 2, 4, torch.float32, 1)
    with pytest.raises(ValueError, match="one entry per sequence"):
        paged_attention(q, k_pages, v_pages, table, seq_lens, query_start_loc=[0, 3])
    with pytest.raises(ValueError, match="non-decreasing"):
        paged_attention(q, k_pages, v_pages, table, seq_lens, query_start_loc=[0, 2, 1])
    with pytest.raises(ValueError, match="non-decreasing"):
        paged_attention(q, k_pages, v_pages, table, seq_lens, query_start_loc=[0, 2, 4])
    with pytest.raises(TypeError, match="integers"):
        paged_attention(
            q, k_pages, v_pages, table, seq_lens, query_start_loc=torch.tensor([0.0, 2.0, 3.0])
        )
    with pytest.raises(ValueError, match="packed tokens"):
        paged_attention(q[None], k_pages, v_pages, table, seq_lens, query_start_loc=locs)
    with pytest.raises(ValueError, match="query_start"):
        paged_attention(
            q, k_pages, v_pages, table, seq_lens, query_start_loc=locs, query_start=[0, 0]
        )
    with pytest.raises(ValueError, match="negative"):
        paged_attention(q, k_pages, v_pages, table, [4, -1], query_start_loc=locs)
    with pytest.raises(ValueError, match="out must be shaped like query"):
        paged_attention(
            q,
            k_pages,
            v_pages,
            table,
            seq_lens,
            query_start_loc=locs,
            out=torch.empty(3, *q.shape[1:], dtype=torch.bfloat16),
        )
    with pytest.raises(TypeError, match="floating point"):
        paged_attention(q.long(), k_pages, v_pages, table, seq_lens, query_start_loc=locs)
    bad = table.clone()
    bad[1, 0] = k_pages.shape[0]
    with pytest.raises(ValueError, match="outside"):
        paged_attention(q, k_pages, v_pages, bad, seq_lens, query_start_loc=locs)


# The implementation this module replaced, kept once as the benchmark's baseline.
from shmkv.bench.attention import baseline_paged_attention as old_paged_attention  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("block_size", [4, 16])
def test_batch_form_equals_old_implementation(dtype, group, block_size, monkeypatch):
    seq_lens = [3, block_size, 2 * block_size + 1, 40, 6]
    k_pages, v_pages, gen = pool_pages(64, block_size, NUM_KV_HEADS, dtype, seed=group)
    table = garbage_table(seq_lens, block_size, 64, gen)
    heads = NUM_KV_HEADS * group
    tol = TOLERANCE[dtype]
    cases = [dict(), dict(query_start=[0, 1, 4, 30, -3]), dict(causal=False, scale=0.5)]
    calls = count_sdpa_calls(monkeypatch)
    for q_len in (1, 4):
        q = torch.randn(len(seq_lens), q_len, heads, HEAD_DIM, generator=gen).to(dtype)
        for kwargs in cases:
            got = paged_attention(q, k_pages, v_pages, table, seq_lens, **kwargs)
            want = old_paged_attention(q, k_pages, v_pages, table, seq_lens, **kwargs)
            torch.testing.assert_close(got, want, **tol)
    assert all(ok for _, ok in calls)
    # As many queries as keys but starting past position 0: not SDPA's top-left mask.
    q = torch.randn(1, 5, heads, HEAD_DIM, generator=gen).to(dtype)
    for start in (0, 2):
        torch.testing.assert_close(
            paged_attention(q, k_pages, v_pages, table[4:], [5], query_start=[start]),
            old_paged_attention(q, k_pages, v_pages, table[4:], [5], query_start=[start]),
            **tol,
        )
    q = torch.randn(len(seq_lens), heads, HEAD_DIM, generator=gen).to(dtype)  # decode
    torch.testing.assert_close(
        paged_attention(q, k_pages, v_pages, table, seq_lens),
        old_paged_attention(q, k_pages, v_pages, table, seq_lens),
        **tol,
    )


@pytest.mark.parametrize("packed", [True, False])
def test_one_plan_serves_every_layer_of_a_step(packed):
    """A plan built once gives what planning each call gives, for other queries and pages
    of the same shapes (another layer's), with and without a workspace."""
    counts, seq_lens = ([5, 1, 1, 3], [5, 30, 12, 9]) if packed else ([2] * 4, [2, 30, 12, 9])
    q, k_pages, v_pages, table, locs = packed_batch(counts, seq_lens, 2, 4, torch.float32, 11)
    if not packed:
        q = q.view(4, 2, *q.shape[1:])
    form = dict(query_start_loc=locs) if packed else {}
    plan = PagedAttentionPlan(q, k_pages, table, seq_lens, **form)
    workspace = AttentionWorkspace()
    for layer in range(3):
        k, v = k_pages * (layer + 1), v_pages - layer
        query = torch.randn_like(q)
        want = paged_attention(query, k, v, table, seq_lens, **form)
        assert torch.equal(paged_attention(query, k, v, plan=plan), want)
        assert torch.equal(paged_attention(query, k, v, plan=plan, workspace=workspace), want)
        out = torch.empty_like(q)
        assert paged_attention(query, k, v, plan=plan, out=out) is out
        assert torch.equal(out, want)


def test_decode_plan_and_the_plan_of_the_next_step():
    block_size = 4
    seq_lens = [6, 6, 6]
    q, k_pages, v_pages, table, locs = packed_batch(
        [1] * 3, seq_lens, 4, block_size, torch.float32, 12
    )
    plan = PagedAttentionPlan(q, k_pages, table, seq_lens)
    assert plan.decode_group is not None
    got = plan.decode_group.decode(q, k_pages, v_pages, None, AttentionWorkspace())
    torch.testing.assert_close(
        got.reshape(q.shape).double(),
        varlen_reference(q, k_pages, v_pages, table, seq_lens, locs),
        **TOLERANCE[torch.float32],
    )
    for n in (7, 8):  # one more key each step, in the blocks held
        plan = plan._next_decode()
        assert torch.equal(
            paged_attention(q, k_pages, v_pages, plan=plan),
            paged_attention(q, k_pages, v_pages, table, [n] * 3),
        )
    assert plan._next_decode() is None  # a ninth key needs a third block
    mixed = PagedAttentionPlan(q, k_pages, table, [6, 5, 6])
    assert mixed._next_decode() is None  # lengths differ: masked, planned each step


def test_plan_arguments_are_checked():
    counts, seq_lens = [2, 1], [4, 3]
    q, k_pages, v_pages, table, locs = packed_batch(counts, seq_lens, 2, 4, torch.float32, 13)
    plan = PagedAttentionPlan(q, k_pages, table, seq_lens, query_start_loc=locs)
    with pytest.raises(TypeError, match="not both"):
        paged_attention(q, k_pages, v_pages, table, seq_lens, plan=plan)
    with pytest.raises(TypeError, match="not both"):
        paged_attention(q, k_pages, v_pages, query_start_loc=locs, plan=plan)
    with pytest.raises(TypeError, match="needs block_table"):
        paged_attention(q, k_pages, v_pages)
    with pytest.raises(TypeError, match="PagedAttentionPlan"):
        paged_attention(q, k_pages, v_pages, plan=object())
    with pytest.raises(ValueError, match="does not match the plan"):
        paged_attention(q[:2], k_pages, v_pages, plan=plan)
    with pytest.raises(ValueError, match="block_size=4"):
        paged_attention(
            q,
            k_pages.reshape(-1, 2, *k_pages.shape[2:]),
            v_pages.reshape(-1, 2, *v_pages.shape[2:]),
            plan=plan,
        )
    with pytest.raises(ValueError, match="outside"):  # fewer pages than the plan's ids
        paged_attention(q, k_pages[:1], v_pages[:1], plan=plan)
    with pytest.raises(ValueError, match="multiple"):
        PagedAttentionPlan(q[:, :3], k_pages, table, seq_lens, query_start_loc=locs)


# -- values outside a sequence's keys ---------------------------------------------------------
# Whatever lies outside a sequence's keys (the rest of its last block, pages standing in
# for a shorter member's missing blocks, every other sequence's pages, unused pages)
# contributes exactly nothing: not NaN, not inf, not finite garbage near the dtype's
# largest value, on every path and page dtype.

QUANTIZED = (torch.float8_e5m2, torch.float8_e4m3fn, torch.int8)
DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
    ),
]


def poison_values(dtype) -> list:
    """What a slot of a page of ``dtype`` can hold that a mask alone does not stop."""
    if dtype == torch.int8:
        return [127.0, -128.0]  # no NaN or inf in int8: its extremes
    info = torch.finfo(dtype)
    values = [float("nan"), info.max, -info.max]  # 1.7e38 in float32, 448 in e4m3 ...
    if dtype != torch.float8_e4m3fn:  # e4m3fn has no inf
        values += [float("inf"), float("-inf")]
    if dtype in (torch.float32, torch.bfloat16):
        values.append(1e38)
    return values


def poisoned_pool(seq_lens, block_size, dtype, poison: float, seed: int, device="cpu"):
    """Pages where every slot outside ``seq_lens``' keys holds ``poison``; page 0 belongs
    to no sequence of the batch (as another sequence's page would), and table entries
    past each sequence's blocks name poisoned pages. Also the same pages with those
    slots holding random finite values instead, to compare with."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(need) + 6
    shape = (num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    k, v = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    if dtype == torch.int8:
        k, v = (k * 40).round().clamp(-127, 127), (v * 40).round().clamp(-127, 127)
    inside = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    table = torch.zeros(len(seq_lens), max(need) + 2, dtype=torch.int32)
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()  # never page 0
    for b, (n, count) in enumerate(zip(seq_lens, need)):
        pages, free = free[:count], free[count:]
        table[b, :count] = torch.tensor(pages, dtype=torch.int32)
        # past its blocks: a poisoned unused page, then page 0, alternately
        table[b, count:] = torch.tensor([free[0], 0], dtype=torch.int32)[
            torch.arange(table.shape[1] - count) % 2
        ]
        for i, page in enumerate(pages):
            inside[page, : min(block_size, n - i * block_size)] = True
    clean_k, clean_v = k.to(dtype), v.to(dtype)
    outside = ~inside[:, :, None, None].expand(shape)
    # through integer views of the bits: torch fills no float8 tensor
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[dtype.itemsize]
    bad = torch.tensor([poison]).to(dtype).view(bits)
    k_bad, v_bad = (
        torch.where(outside, bad, x.view(bits)).view(dtype).to(device) for x in (clean_k, clean_v)
    )
    return (k_bad, v_bad), (clean_k.to(device), clean_v.to(device)), table.to(device), gen


def outside_reference(q, k_pages, v_pages, table, seq_lens, locs, causal, k_scale, v_scale):
    """float64 attention of packed query rows over each sequence's own keys only."""
    scales = [
        torch.as_tensor(s, dtype=torch.float64).reshape(-1)[None, :, None] if s is not None else 1.0
        for s in (k_scale, v_scale)
    ]
    k64 = k_pages.cpu().double() * (scales[0] if k_scale is not None else 1.0)
    v64 = v_pages.cpu().double() * (scales[1] if v_scale is not None else 1.0)
    return varlen_reference(q.cpu().double(), k64, v64, table.cpu(), seq_lens, locs, causal=causal)


CASES = {
    # decodes of different lengths: one group, padded to the longest
    "decode": ([1] * 5, [37, 5, 16, 50, 1], True),
    # prefill chunks (queries the last tokens, earlier context before them)
    "prefill": ([4] * 3, [37, 20, 45], True),
    "prefill-non-causal": ([3] * 3, [9, 30, 17], False),
    # an engine step: a prompt, chunks, decodes, speculative tokens
    "varlen": ([1, 5, 1, 3, 9, 1], [40, 9, 77, 30, 21, 3], True),
}


def _outside_params():
    """(dtype, case, path, device) of every combination a path takes: the native
    kernel takes the decodes (one query each) of CPU float32 / bfloat16 / float16."""
    for dtype in [torch.float32, torch.bfloat16, torch.float16, *QUANTIZED]:
        for case, (counts, _, _) in CASES.items():
            for path in ("torch", "native"):
                for device in DEVICES:
                    name = device if isinstance(device, str) else device.values[0]
                    marks = () if isinstance(device, str) else device.marks
                    if path == "native" and not (
                        name == "cpu" and dtype not in QUANTIZED and 1 in counts
                    ):
                        continue
                    yield pytest.param(
                        dtype,
                        case,
                        path,
                        name,
                        marks=marks,
                        id=f"{str(dtype).removeprefix('torch.')}-{case}-{path}-{name}",
                    )


@pytest.mark.parametrize("dtype, case, path, device", list(_outside_params()))
def test_values_outside_a_sequence_contribute_nothing(dtype, case, path, device, monkeypatch):
    counts, seq_lens, causal = CASES[case]
    quantized = dtype in QUANTIZED
    if path == "native" and native.decoder() is None:
        pytest.skip(f"no native kernel: {native.status()}")
    if path == "torch":
        monkeypatch.setattr(native, "decoder", lambda: None)
    ran = []
    real_run = native.run_checked
    monkeypatch.setattr(native, "run_checked", lambda *a: ran.append(a) or real_run(*a))
    qdtype = torch.float16 if quantized else dtype
    locs = [0]
    for c in counts:
        locs.append(locs[-1] + c)
    k_scale = v_scale = None
    if quantized:
        k_scale = torch.tensor([0.03, 0.05]) if dtype == torch.int8 else torch.tensor([0.5, 2.0])
        v_scale = 0.02 if dtype == torch.int8 else 0.25
    tol = TOLERANCE[qdtype]
    for i, poison in enumerate(poison_values(dtype)):
        (k_bad, v_bad), (k_clean, v_clean), table, gen = poisoned_pool(
            seq_lens, 8, dtype, poison, seed=i, device=device
        )
        q = torch.randn(locs[-1], NUM_KV_HEADS * 2, HEAD_DIM, generator=gen).to(qdtype)
        q = q.to(device)
        want = outside_reference(
            q, k_clean, v_clean, table, seq_lens, locs, causal, k_scale, v_scale
        )
        forms = [dict(query_start_loc=locs)]
        if len(set(counts)) == 1:  # the batch form too
            forms.append(dict(batch=counts[0]))
        for form in forms:
            kwargs = dict(causal=causal, k_scale=k_scale, v_scale=v_scale)
            query = q
            if "batch" in form:
                query = q.view(len(counts), form["batch"], *q.shape[1:])
                if form["batch"] == 1:
                    query = query[:, 0]
            else:
                kwargs.update(form)
            for workspace in (None, AttentionWorkspace()):
                got = paged_attention(
                    query, k_bad, v_bad, table, seq_lens, workspace=workspace, **kwargs
                )
                clean = paged_attention(
                    query, k_clean, v_clean, table, seq_lens, workspace=workspace, **kwargs
                )
                assert torch.isfinite(got).all(), (poison, form)
                assert torch.equal(got, clean), (poison, form)  # exactly nothing
                torch.testing.assert_close(got.reshape(q.shape).cpu().double(), want, **tol)
    assert bool(ran) == (path == "native")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "qdtype",
    [torch.float16, torch.bfloat16, torch.float32],
    ids=lambda d: str(d).removeprefix("torch."),
)
def test_scales_apply_in_float32_as_a_tensor_or_a_number(qdtype, device, monkeypatch):
    # Scales below float16's smallest normal (6.1e-5): rounded to the query's dtype
    # first, they would keep a few bits (1e-6 as a float16 is 1.013e-6).
    monkeypatch.setattr(native, "decoder", lambda: None)
    seq_lens = [30, 7, 64]  # decode, a chunk of 4, decode
    locs = [0, 1, 5, 6]
    gen = torch.Generator().manual_seed(5)
    shape = (24, 8, NUM_KV_HEADS, HEAD_DIM)
    k_pages, v_pages = (
        (torch.randn(shape, generator=gen) * 1.5e4)
        .clamp(-57344, 57344)
        .to(torch.float8_e5m2)
        .to(device)
        for _ in range(2)
    )
    table = torch.randperm(24, generator=gen).view(3, 8).int().to(device)
    q = torch.randn(locs[-1], NUM_KV_HEADS * 2, HEAD_DIM, generator=gen).to(qdtype).to(device)
    k_num, v_num = 2.1e-5, 1.03e-6
    by_number = paged_attention(
        q, k_pages, v_pages, table, seq_lens, query_start_loc=locs, k_scale=k_num, v_scale=v_num
    )
    for kind in (torch.float32, torch.float64, qdtype):
        per_head = paged_attention(
            q,
            k_pages,
            v_pages,
            table,
            seq_lens,
            query_start_loc=locs,
            k_scale=torch.full((NUM_KV_HEADS,), k_num, dtype=torch.float64).to(kind),
            v_scale=torch.full((NUM_KV_HEADS,), v_num, dtype=torch.float64).to(kind),
        )
        if kind != qdtype or qdtype == torch.float32:
            assert torch.equal(per_head, by_number), kind
    one = paged_attention(
        q,
        k_pages,
        v_pages,
        table,
        seq_lens,
        query_start_loc=locs,
        k_scale=torch.tensor(k_num, dtype=torch.float64),
        v_scale=torch.tensor([v_num], dtype=torch.float64),
    )
    assert torch.equal(one, by_number)

    # different scales per head, against float64 attention over stored * scale
    k_heads, v_heads = torch.tensor([2.1e-5, 7.7e-6]), torch.tensor([1.03e-6, 3.1e-7])
    got = paged_attention(
        q,
        k_pages,
        v_pages,
        table,
        seq_lens,
        query_start_loc=locs,
        k_scale=k_heads.to(device),
        v_scale=v_heads.to(device),
    )
    k64 = k_pages.cpu().double() * k_heads.double()[None, None, :, None]
    v64 = v_pages.cpu().double() * v_heads.double()[None, None, :, None]
    want = varlen_reference(q.cpu().double(), k64, v64, table.cpu(), seq_lens, locs)
    size = want.abs().max().item()
    err = (got.cpu().double() - want).abs().max().item()
    # one rounding of the query, the scaled K/V and the result to the query's dtype
    assert err <= {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-5}[qdtype] * size
