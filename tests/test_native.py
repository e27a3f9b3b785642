"""The native decode kernel (shmkv.native) against a dense float64 reference and against
the torch path, and what happens without it."""

from __future__ import annotations

import logging
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from shmkv import native
from shmkv.attention import PagedAttentionPlan, paged_attention

TOLERANCE = dict(rtol=2e-5, atol=2e-5)
HAS_CC = native._compiler() is not None


def pool_pages(num_blocks, num_layers, block_size, kv_heads, head_dim, layer, seed=0):
    """K and V pages of one layer of a pool stored block-major: views whose page stride is
    a whole block (every layer's K and V), the kernel's hardest case. (shmkv's own pool
    is stored layer-major: its layer views are contiguous, as in test_generate_*.)"""
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn(num_blocks, num_layers, 2, block_size, kv_heads, head_dim, generator=gen)
    return pool[:, layer, 0], pool[:, layer, 1]


def reference(q, k_pages, v_pages, table, lens, scale=None):
    """Dense attention of each row's one query over its keys, in float64."""
    rows, heads, dim = q.shape
    kv_heads = k_pages.shape[2]
    out = torch.zeros(rows, heads, dim, dtype=torch.float64)
    for b, n in enumerate(lens):
        if n == 0:
            continue
        blocks = -(-n // k_pages.shape[1])
        k = k_pages[table[b, :blocks].long()].reshape(-1, kv_heads, dim)[:n].double()
        v = v_pages[table[b, :blocks].long()].reshape(-1, kv_heads, dim)[:n].double()
        k = k.repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)  # [heads, n, dim]
        v = v.repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
        out[b] = F.scaled_dot_product_attention(q[b].double()[:, None], k, v, scale=scale)[:, 0]
    return out


def batch(lens, heads, kv_heads, dim, block_size, seed=0, layers=3):
    gen = torch.Generator().manual_seed(seed + 100)
    per_row = max(-(-n // block_size) for n in lens) + 1
    num_blocks = len(lens) * per_row + 5
    k_pages, v_pages = pool_pages(num_blocks, layers, block_size, kv_heads, dim, layer=1, seed=seed)
    table = torch.randperm(num_blocks, generator=gen)[: len(lens) * per_row]
    table = table.view(len(lens), per_row).to(torch.int32)
    q = torch.randn(len(lens), heads, dim, generator=gen)
    return q, k_pages, v_pages, table


def counted(monkeypatch, owner, name: str) -> list:
    """``owner.name`` made to note each call's arguments in the returned list."""
    calls = []
    real = getattr(owner, name)

    def counting(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, counting)
    return calls


def sdpa_calls(monkeypatch):
    return counted(monkeypatch, F, "scaled_dot_product_attention")


needs_cc = pytest.mark.skipif(not HAS_CC, reason="no C compiler: the kernel cannot be built")


@needs_cc
def test_the_kernel_builds_and_loads_here():
    assert native.decoder() is not None, native.status()
    assert native.status() == "loaded"


# bfloat16 and float16: K/V and queries rounded to them, the result rounded to them
# (one part in 256, one in 2048).
TOLERANCES = {
    torch.float32: TOLERANCE,
    torch.bfloat16: dict(rtol=1e-2, atol=1e-2),
    torch.float16: dict(rtol=1e-3, atol=1e-3),
}


@needs_cc
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dim", [8, 16, 32, 64, 80, 128, 256])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_decode_matches_reference_without_sdpa(dim, group, dtype, monkeypatch):
    kv_heads = 2
    lens = [1, 37, 16, 64, 5, 100]  # one key, partial and whole last blocks
    q, k_pages, v_pages, table = batch(lens, kv_heads * group, kv_heads, dim, 16, seed=dim)
    q, k_pages, v_pages = q.to(dtype), k_pages.to(dtype), v_pages.to(dtype)
    calls = sdpa_calls(monkeypatch)
    got = paged_attention(q, k_pages, v_pages, table, lens)
    assert not calls  # the kernel, not SDPA
    assert got.dtype == dtype
    torch.testing.assert_close(
        got.double(), reference(q, k_pages, v_pages, table, lens), **TOLERANCES[dtype]
    )


@needs_cc
@pytest.mark.parametrize("block_size", [1, 4, 32])
def test_block_sizes_scale_and_the_torch_path_agree(block_size, monkeypatch):
    lens = [3, 70, 33]
    q, k_pages, v_pages, table = batch(lens, 8, 2, 32, block_size, seed=block_size)
    got = paged_attention(q, k_pages, v_pages, table, lens, scale=0.3)
    torch.testing.assert_close(
        got.double(), reference(q, k_pages, v_pages, table, lens, scale=0.3), **TOLERANCE
    )
    monkeypatch.setattr(native, "decoder", lambda: None)
    calls = sdpa_calls(monkeypatch)
    torch_path = paged_attention(q, k_pages, v_pages, table, lens, scale=0.3)
    assert calls
    torch.testing.assert_close(got, torch_path, **TOLERANCE)


@needs_cc
def test_packed_decodes_beside_a_prefill(monkeypatch):
    # A prefill of 5 query tokens takes SDPA; the decode rows of the same call the kernel.
    lens = [40, 9, 77]
    counts = [1, 5, 1]
    heads, kv_heads, dim, bs = 4, 2, 32, 8
    _, k_pages, v_pages, table = batch(lens, heads, kv_heads, dim, bs, seed=3)
    q = torch.randn(sum(counts), heads, dim, generator=torch.Generator().manual_seed(9))
    locs = [0, 1, 6, 7]
    ran = counted(monkeypatch, native, "run_checked")
    got = paged_attention(q, k_pages, v_pages, table, lens, query_start_loc=locs)
    assert [args[1].shape[0] for args in ran] == [2]  # the two decode rows, in one call
    monkeypatch.setattr(native, "decoder", lambda: None)
    torch.testing.assert_close(
        got, paged_attention(q, k_pages, v_pages, table, lens, query_start_loc=locs), **TOLERANCE
    )


@needs_cc
def test_rows_split_over_threads_give_the_same_result(monkeypatch):
    lens = [2000, 1500, 1999, 700]
    q, k_pages, v_pages, table = batch(lens, 8, 2, 64, 16, seed=5)
    plan = PagedAttentionPlan(q, k_pages, table, lens)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = paged_attention(q, k_pages, v_pages, plan=plan)
        torch.set_num_threads(3)
        kernel, spans = native.decoder()[torch.float32], []
        # the kernel's calls, each a span of rows (its 9th argument: how many)
        monkeypatch.setattr(
            native,
            "decoder",
            lambda: {torch.float32: lambda *args: spans.append(args[8]) or kernel(*args)},
        )
        split = paged_attention(q, k_pages, v_pages, plan=plan)
    finally:
        torch.set_num_threads(threads)
    # three threads, about as many keys each: rows 0-1 (3500 keys), 2 (1999), 3 (700)
    assert sorted(spans) == [1, 1, 2]
    assert torch.equal(one, split)
    torch.testing.assert_close(
        one.double(), reference(q, k_pages, v_pages, table, lens), **TOLERANCE
    )


@needs_cc
def test_a_bad_page_id_is_an_error_not_a_crash():
    lens = [20, 20]
    q, k_pages, v_pages, table = batch(lens, 4, 2, 32, 16)
    bad = table.clone()
    bad[1, 1] = k_pages.shape[0]
    kernels = native.decoder()
    with pytest.raises(IndexError, match="not a page id"):
        native.paged_decode(kernels, q, k_pages, v_pages, bad, torch.tensor(lens), 0.1)
    bad[1, 1] = -1
    with pytest.raises(IndexError, match="not a page id"):
        native.paged_decode(kernels, q, k_pages, v_pages, bad, torch.tensor(lens), 0.1)
    # paged_attention checks the ids before any kernel runs
    with pytest.raises(ValueError, match="page"):
        paged_attention(q, k_pages, v_pages, bad, lens)


@needs_cc
def test_the_next_decode_steps_plan_reads_one_key_more():
    lens = [30, 30, 30]  # room for two more keys in the blocks
    q, k_pages, v_pages, table = batch(lens, 8, 2, 32, 16, seed=6)
    plan = PagedAttentionPlan(q, k_pages, table, lens)
    for step in range(1, 3):
        plan = plan._next_decode()
        assert plan is not None
        longer = [n + step for n in lens]
        torch.testing.assert_close(
            paged_attention(q, k_pages, v_pages, plan=plan).double(),
            reference(q, k_pages, v_pages, table, longer),
            **TOLERANCE,
        )


@needs_cc
def test_the_kernels_own_entry_refuses_what_it_cannot_take():
    lens = torch.tensor([20, 20])
    q, k_pages, v_pages, table = batch([20, 20], 4, 2, 32, 16)
    kernels = native.decoder()
    call = native.paged_decode
    with pytest.raises(ValueError, match="multiple"):  # 3 query heads over 2
        call(kernels, torch.randn(2, 3, 32), k_pages, v_pages, table, lens, 0.1)
    with pytest.raises(ValueError, match="not rows x heads"):
        call(kernels, torch.randn(2, 4, 31), k_pages, v_pages, table, lens, 0.1)
    with pytest.raises(TypeError, match="int64"):
        call(kernels, q, k_pages, v_pages, table, lens.int(), 0.1)
    with pytest.raises(TypeError, match="int32"):
        call(kernels, q, k_pages, v_pages, table.long(), lens, 0.1)
    with pytest.raises(ValueError, match="need more pages"):
        call(kernels, q, k_pages, v_pages, table[:, :1], lens, 0.1)
    with pytest.raises(ValueError, match="out must be"):
        call(kernels, q, k_pages, v_pages, table, lens, 0.1, out=torch.empty(2, 4, 16))
    with pytest.raises(TypeError, match="float32, bfloat16 or float16 CPU"):
        call(kernels, q.double(), k_pages, v_pages, table, lens, 0.1)
    with pytest.raises(ValueError, match="rows"):
        call(kernels, q[:0], k_pages, v_pages, table[:0], lens[:0], 0.1)
    want = reference(q, k_pages, v_pages, table, [20, 20], scale=0.1)
    torch.testing.assert_close(
        call(kernels, q, k_pages, v_pages, table, lens, 0.1).double(), want, **TOLERANCE
    )


@needs_cc
def test_scores_far_below_zero_still_give_their_softmax():
    # Every score below -1e30 (a sentinel maximum there would give zeros): still a softmax.
    lens = [40]
    q, k_pages, v_pages, table = batch(lens, 4, 2, 32, 16, seed=7)
    k_pages.abs_()
    q = -q.abs() - 1.0
    got = paged_attention(q, k_pages, v_pages, table, lens, scale=1e30)
    want = reference(q, k_pages, v_pages, table, lens, scale=1e30)
    assert got.abs().sum() > 0
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


@needs_cc
def test_bfloat16_is_closer_to_the_exact_result_than_the_torch_path(monkeypatch):
    # Scores and sums in float32, one rounding at the end: never worse than SDPA in
    # bfloat16 over the gathered copy.
    lens = [300, 1000, 77]
    q, k_pages, v_pages, table = batch(lens, 8, 2, 64, 16, seed=11)
    q, k_pages, v_pages = q.bfloat16(), k_pages.bfloat16(), v_pages.bfloat16()
    exact = reference(q, k_pages, v_pages, table, lens)
    got = paged_attention(q, k_pages, v_pages, table, lens)
    monkeypatch.setattr(native, "decoder", lambda: None)
    torch_path = paged_attention(q, k_pages, v_pages, table, lens)
    assert (got.double() - exact).abs().max() <= (torch_path.double() - exact).abs().max()


def _kernel_of_values(kernels, v_rows: torch.Tensor, keys: int) -> torch.Tensor:
    """The kernel over float16 V rows [n, 16] whose every query scores its keys alike
    (a zero query): row b's output is the mean of V rows b*keys ... b*keys+keys-1, each
    read as float32, summed in float32 and rounded back once."""
    rows = v_rows.shape[0] // keys
    pages = v_rows.reshape(-1, 1, 1, 16)
    table = torch.arange(rows * keys, dtype=torch.int32).reshape(rows, keys)
    q = torch.zeros(rows, 1, 16, dtype=torch.float16)
    lens = torch.full((rows,), keys, dtype=torch.int64)
    return native.paged_decode(
        kernels, q, torch.zeros_like(pages), pages, table, lens, 1.0
    ).reshape(-1, 16)


F16_BUILDS = {
    "plain-code conversion": ["-DSHMKV_SOFT_F16"],
    "F16C without AVX-512": ["-mno-avx512f", "-mavx2", "-mf16c"],
}


@pytest.fixture(params=["as built", *F16_BUILDS])
def f16_kernels(request, tmp_path):
    """The kernels as shmkv builds them here (the CPU's own float16 conversion where it
    has one), a build that converts in plain vector code, as on CPUs without it, and one
    that uses F16C's 8-lane conversion, as on AVX2 machines."""
    if request.param == "as built":
        return native.decoder()
    if request.param == "F16C without AVX-512" and "f16c" not in native._cpu_flags().split():
        pytest.skip("this CPU has no F16C")
    cc = native._compiler()
    obj, lib = str(tmp_path / "f16.o"), str(tmp_path / "f16.so")
    for command in (
        [
            cc,
            *native.FLAG_SETS[0],
            *F16_BUILDS[request.param],
            "-fPIC",
            "-c",
            "-o",
            obj,
            native.SOURCE,
        ],
        [cc, "-shared", "-o", lib, obj, "-lm"],
    ):
        failed = native._run(command)
        assert not failed, failed
    return native.load(lib)


@needs_cc
def test_float16_values_are_read_and_rounded_as_torch_does(f16_kernels):
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    values = bits.view(torch.float16)
    finite = values[torch.isfinite(values)]  # subnormals and both zeros included
    finite = finite[: finite.numel() // 16 * 16].reshape(-1, 16)
    # One key each: every finite float16 comes back with the same bits (-0 as +0: the
    # sum starts at +0, as float32's does).
    want = (finite.float() + 0.0).half()
    got = _kernel_of_values(f16_kernels, finite, 1)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    # Two keys: the float32 mean of two float16 values, often halfway between two of
    # them, rounded as torch rounds it (to nearest, ties to even).
    pairs = finite[torch.randperm(finite.shape[0], generator=torch.Generator().manual_seed(3))]
    pairs = pairs[: pairs.shape[0] // 2 * 2]
    want = ((pairs[0::2].float() + pairs[1::2].float()) * 0.5).half()
    got = _kernel_of_values(f16_kernels, pairs, 2)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_other_dtypes_and_quantized_pages_take_the_torch_path(monkeypatch):
    lens = [12, 30]
    q, k_pages, v_pages, table = batch(lens, 4, 2, 32, 16, seed=4)
    calls = sdpa_calls(monkeypatch)
    got = paged_attention(q.double(), k_pages.double(), v_pages.double(), table, lens)
    assert calls and got.dtype == torch.float64
    assert not native.usable(q.double(), k_pages.double(), v_pages.double())
    assert not native.usable(q, k_pages.bfloat16(), v_pages.bfloat16())  # mixed dtypes
    calls.clear()
    paged_attention(q, k_pages, v_pages, table, lens, k_scale=2.0, v_scale=0.5)
    assert calls
    # pages whose chunks are not contiguous (a transposed view) are not the kernel's
    assert not native.usable(q, k_pages.transpose(2, 3), v_pages.transpose(2, 3))


def _child(env: dict, code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=180,
    )


CHILD = """
import torch, logging
logging.basicConfig(level=logging.WARNING)
from shmkv import native
from shmkv.attention import paged_attention
torch.manual_seed(0)
k = torch.randn(8, 4, 2, 32); v = torch.randn(8, 4, 2, 32); q = torch.randn(2, 4, 32)
table = torch.tensor([[0, 3, 5], [7, 1, 2]], dtype=torch.int32)
out = paged_attention(q, k, v, table, [9, 12])
ref = torch.cat([torch.nn.functional.scaled_dot_product_attention(
    q[b][:, None], k[table[b]].reshape(-1, 2, 32)[:n].repeat_interleave(2, 1).transpose(0, 1),
    v[table[b]].reshape(-1, 2, 32)[:n].repeat_interleave(2, 1).transpose(0, 1))[None, :, 0]
    for b, n in enumerate([9, 12])])
torch.testing.assert_close(out, ref, rtol=2e-5, atol=2e-5)
print("STATUS", native.status())
print("COPY", "loaded" if native.copier() is not None else native.copy_status())
"""


SUBNORMALS = """
import torch
from shmkv import native
assert native.decoder() is not None, native.status()
tiny = 2.2250738585072014e-308 / 4          # a float64 subnormal, computed after the load
assert tiny > 0 and tiny * 3 > 0
t = torch.tensor([1e-40], dtype=torch.float32)   # a float32 subnormal
assert float((t * 1.0).item()) > 0 and float((t + t).item()) > 0
print("SUBNORMALS OK")
"""


@needs_cc
def test_loading_the_kernel_leaves_the_process_floating_point_alone(tmp_path):
    # A library linked with -ffast-math sets flush-to-zero for the whole process at load:
    # subnormals would then read as zero everywhere. Built fresh, then loaded from cache.
    for _ in range(2):
        done = _child({"SHMKV_CACHE_DIR": str(tmp_path)}, SUBNORMALS)
        assert done.returncode == 0 and "SUBNORMALS OK" in done.stdout, done.stderr


def test_disabled_by_the_environment(tmp_path):
    done = _child({"SHMKV_NATIVE": "0", "SHMKV_CACHE_DIR": str(tmp_path)}, CHILD)
    assert done.returncode == 0, done.stderr
    assert "STATUS disabled by SHMKV_NATIVE" in done.stdout
    assert "COPY disabled by SHMKV_NATIVE" in done.stdout
    assert not os.listdir(tmp_path)  # nothing built


def test_a_failing_compiler_leaves_the_torch_path_and_says_why(tmp_path):
    done = _child({"CC": "false", "SHMKV_CACHE_DIR": str(tmp_path)}, CHILD)
    assert done.returncode == 0, done.stderr
    assert "STATUS building with" in done.stdout and "failed" in done.stdout
    assert "COPY building with" in done.stdout
    assert "native decode kernel is not available" in done.stderr
    assert "native row copy is not available, the tiers copy with numpy" in done.stderr
    assert not os.listdir(tmp_path)  # no partial library left behind


@needs_cc
def test_a_fresh_cache_directory_is_built_into_then_reused(tmp_path):
    cache = tmp_path / "cache"
    done = _child({"SHMKV_CACHE_DIR": str(cache)}, CHILD)
    assert done.returncode == 0, done.stderr
    assert "STATUS loaded" in done.stdout and "COPY loaded" in done.stdout
    built = sorted(os.listdir(cache))
    assert len(built) == 2 and all(name.endswith(".so") for name in built)
    assert built[0].startswith("copy_rows-") and built[1].startswith("paged_decode-")
    stamps = [os.stat(cache / name).st_mtime_ns for name in built]
    again = _child({"SHMKV_CACHE_DIR": str(cache)}, CHILD)
    assert again.returncode == 0 and "STATUS loaded" in again.stdout, again.stderr
    assert "COPY loaded" in again.stdout
    assert sorted(os.listdir(cache)) == built
    assert [os.stat(cache / name).st_mtime_ns for name in built] == stamps


def test_a_home_that_cannot_be_written_builds_in_a_private_temporary_directory(
    tmp_path, monkeypatch
):
    home = tmp_path / "home"
    home.mkdir()
    (home / ".cache").write_text("a file where the cache directory would go")
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.delenv("SHMKV_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setattr(native.tempfile, "tempdir", str(temp))
    private = temp / f"shmkv-{os.getuid()}"
    assert native.cache_dir() == str(private)
    assert private.is_dir() and not private.stat().st_mode & 0o077
    private.chmod(0o777)  # one others could write is never used
    assert native.cache_dir() != str(private)


@needs_cc
def test_generate_decodes_through_the_kernel_equal_to_dynamic_cache(monkeypatch):
    pytest.importorskip("transformers")
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    import shmkv
    from shmkv.integrations.transformers import ShmkvCache, cache_argument, pool_config

    config = LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )  # head_dim 32: the vector kernel
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 256, (3, 40), generator=torch.Generator().manual_seed(1))
    key = cache_argument(model)
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        want = model.generate(
            ids, max_new_tokens=12, do_sample=False, **{key: DynamicCache(config=config)}
        )
        calls = counted(monkeypatch, native, "run_checked")
        model.set_attn_implementation("shmkv")
        cfg = pool_config(config, num_blocks=64, block_size=16, dtype=torch.float32)
        with (
            shmkv.Coordinator(cfg, name=f"native-{os.getpid()}") as coord,
            shmkv.connect(coord.address) as client,
            ShmkvCache(client) as cache,
        ):
            got = model.generate(ids, max_new_tokens=12, do_sample=False, **{key: cache})
    assert torch.equal(got, want)
    assert len(calls) >= 11 * config.num_hidden_layers  # every decode step, every layer


# -- only a library this user built is loaded ---------------------------------------------

PLANTED_C = r"""
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen(MARKER, "w");
    if (f) { fputs("the planted library ran", f); fclose(f); }
}
"""


@pytest.fixture
def planted(tmp_path):
    """(a library whose constructor writes a marker file, the marker's path): what
    another user could leave where shmkv looks for its kernel. Loading it once in a
    child shows the marker does appear when it is loaded; then the marker is removed."""
    marker = tmp_path / "marker"
    src, lib = tmp_path / "planted.c", tmp_path / "planted.so"
    src.write_text(PLANTED_C)
    failed = native._run(
        [native._compiler(), "-shared", "-fPIC", f'-DMARKER="{marker}"', "-o", str(lib), str(src)]
    )
    assert not failed, failed
    subprocess.run(
        [sys.executable, "-c", f"import ctypes; ctypes.CDLL({str(lib)!r})"], check=True, timeout=60
    )
    assert marker.read_text() == "the planted library ran"
    marker.unlink()
    return lib, marker


def plant(lib, directory, mode=0o755, link=False, library=None):
    """Put ``lib`` under every name the kernel's library (or ``library``'s) could have in
    ``directory``."""
    names = native._library_names(native._compiler(), library)
    for name in names:
        path = os.path.join(directory, name)
        if link:
            os.symlink(lib, path)
        else:
            shutil.copyfile(lib, path)
            os.chmod(path, mode)
    return [os.path.join(directory, name) for name in names]


def built_kernels_work(kernels):
    assert kernels is not None
    lens = [20, 7]
    q, k_pages, v_pages, table = batch(lens, 4, 2, 32, 16)
    got = native.paged_decode(kernels, q, k_pages, v_pages, table, torch.tensor(lens), 0.1)
    torch.testing.assert_close(
        got.double(), reference(q, k_pages, v_pages, table, lens, scale=0.1), **TOLERANCE
    )


def refusals(caplog) -> str:
    return " ".join(
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("shmkv") and r.levelno >= logging.WARNING
    )


@needs_cc
def test_a_library_that_fails_the_check_is_refused_before_any_of_it_runs(planted, tmp_path):
    lib, marker = planted
    cases = tmp_path / "cases"
    cases.mkdir(mode=0o700)
    writable = cases / "writable.so"
    shutil.copyfile(lib, writable)
    writable.chmod(0o666)
    group = cases / "group.so"
    shutil.copyfile(lib, group)
    group.chmod(0o775)
    link = cases / "link.so"
    link.symlink_to(lib)
    fifo = cases / "fifo.so"
    os.mkfifo(fifo)
    refused = {
        writable: "written by its group or others",
        group: "group or others",
        link: "symbolic link",
        fifo: "not a regular file",
    }
    if os.geteuid() == 0:
        foreign = cases / "foreign.so"
        shutil.copyfile(lib, foreign)
        os.chown(foreign, 65534, 65534)
        refused[foreign] = "owned by uid 65534"
    for path, why in refused.items():
        with pytest.raises(native.UntrustedLibrary, match=why):
            native.load(str(path))
        assert not marker.exists(), path
    with pytest.raises(PermissionError):  # UntrustedLibrary is one
        native.load(str(writable))


@needs_cc
@pytest.mark.parametrize("case", ["mode 0666", "symlink", "other uid"])
def test_a_planted_library_in_the_cache_is_rebuilt_not_loaded(
    case, planted, tmp_path, monkeypatch, caplog
):
    if case == "other uid" and os.geteuid() != 0:
        pytest.skip("giving a file to another uid needs root")
    lib, marker = planted
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    paths = plant(lib, cache, mode=0o666 if case == "mode 0666" else 0o755, link=case == "symlink")
    if case == "other uid":
        for path in paths:
            os.chown(path, 65534, 65534)
    monkeypatch.setenv("SHMKV_CACHE_DIR", str(cache))
    with caplog.at_level(logging.WARNING, logger="shmkv"):
        kernels, why = native._build()
    assert not marker.exists()
    assert why is None
    built_kernels_work(kernels)
    assert "refusing to load" in refusals(caplog)
    # the planted file was replaced by this user's own build, which later loads take
    info = os.lstat(paths[0])
    assert stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid()
    assert not info.st_mode & 0o022
    assert Path(paths[0]).read_bytes() != lib.read_bytes()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="shmkv"):
        kernels, why = native._build()
    assert why is None and not refusals(caplog)
    built_kernels_work(kernels)


@needs_cc
@pytest.mark.parametrize("case", ["mode 0777", "symlink", "other uid"])
def test_a_cache_directory_others_could_write_is_not_used(
    case, planted, tmp_path, monkeypatch, caplog
):
    if case == "other uid" and os.geteuid() != 0:
        pytest.skip("giving a directory to another uid needs root")
    lib, marker = planted
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    paths = plant(lib, real)  # files that pass the check themselves
    cache = real
    if case == "mode 0777":
        real.chmod(0o777)
    elif case == "symlink":
        cache = tmp_path / "link"
        cache.symlink_to(real)
    else:
        os.chown(real, 65534, 65534)
    temp = tmp_path / "tmp"
    temp.mkdir(mode=0o700)
    monkeypatch.setattr(native.tempfile, "tempdir", str(temp))
    monkeypatch.setenv("SHMKV_CACHE_DIR", str(cache))
    with caplog.at_level(logging.WARNING, logger="shmkv"):
        assert native.cache_dir() is None
        kernels, why = native._build()
    assert not marker.exists()
    assert why is None
    built_kernels_work(kernels)  # built in a private directory instead
    assert f"not using {cache}" in refusals(caplog)
    assert all(Path(p).read_bytes() == lib.read_bytes() for p in paths)  # left alone
    assert not os.listdir(temp)  # the private build directory is gone


@needs_cc
def test_a_default_cache_directory_others_could_write_falls_back_to_a_private_one(
    planted, tmp_path, monkeypatch, caplog
):
    lib, marker = planted
    xdg = tmp_path / "xdg"
    (xdg / "shmkv").mkdir(parents=True)
    (xdg / "shmkv").chmod(0o777)
    plant(lib, xdg / "shmkv")
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.delenv("SHMKV_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(xdg))
    monkeypatch.setattr(native.tempfile, "tempdir", str(temp))
    with caplog.at_level(logging.WARNING, logger="shmkv"):
        kernels, why = native._build()
    assert not marker.exists()
    assert why is None
    built_kernels_work(kernels)
    assert "can be written by its group or others" in refusals(caplog)
    private = temp / f"shmkv-{os.getuid()}"
    assert [n for n in os.listdir(private) if n.endswith(".so")]


@needs_cc
def test_a_planted_library_is_not_loaded_by_a_process_that_decodes(planted, tmp_path):
    # End to end: a 0777 cache directory holding the planted library; the process still
    # gets the kernel (built privately), says why, and the planted code never runs.
    lib, marker = planted
    cache = tmp_path / "cache"
    cache.mkdir()
    cache.chmod(0o777)
    plant(lib, cache)
    done = _child({"SHMKV_CACHE_DIR": str(cache)}, CHILD)
    assert not marker.exists()
    assert done.returncode == 0, done.stderr
    assert "STATUS loaded" in done.stdout
    assert "not using" in done.stderr and "group or others" in done.stderr


UMASK_CHILD = """
import os, stat, sys
os.umask(0)
from shmkv import native
where = native.cache_dir()
assert where == os.path.join(sys.argv[1], "a", "b", "shmkv"), where
for path in (sys.argv[1] + "/a", sys.argv[1] + "/a/b", where):
    assert stat.S_IMODE(os.lstat(path).st_mode) == 0o700, (path, oct(os.lstat(path).st_mode))
assert native.decoder() is not None, native.status()
built = [n for n in os.listdir(where) if n.endswith(".so")]
assert len(built) == 1
assert not os.stat(os.path.join(where, built[0])).st_mode & 0o022
print("UMASK OK")
"""


@needs_cc
def test_with_umask_000_the_cache_directory_is_created_0700(tmp_path):
    env = {"XDG_CACHE_HOME": str(tmp_path / "a" / "b")}
    done = subprocess.run(
        [sys.executable, "-c", UMASK_CHILD, str(tmp_path)],
        env={k: v for k, v in {**os.environ, **env}.items() if k != "SHMKV_CACHE_DIR"},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0 and "UMASK OK" in done.stdout, done.stderr


# -- the tiers' row copy -------------------------------------------------------------------


def _rows_at(buf, start, rows, width, gap):
    """``rows`` rows of ``width`` bytes of ``buf`` from ``start``, ``gap`` bytes apart."""
    return buf[start : start + rows * (width + gap)].reshape(rows, -1)[:, :width]


@needs_cc
@pytest.mark.parametrize("width", [1, 15, 127, 511, 512, 513, 1000, 4096 + 7, 32768])
@pytest.mark.parametrize("path", ["native", "numpy"])
def test_the_row_copy_writes_numpys_bytes_and_nothing_around_them(width, path, monkeypatch):
    """Rows streamed past the caches (512 bytes and wider) or copied plainly by the native
    code, or handed to numpy (a small copy), into rows that start on any byte and lie
    apart: every byte of each row, none between them."""
    copy = native.copier()
    assert copy is not None, native.copy_status()
    monkeypatch.setattr(copy, "min_bytes", 0 if path == "native" else 1 << 30)
    rng = np.random.default_rng(width)
    rows, gap = 5, 77
    for start in (0, 1, 8, 16, 31):
        buf = rng.integers(0, 256, size=start + rows * (width + gap), dtype=np.uint8)
        expected = buf.copy()
        src = rng.integers(0, 256, size=3 + rows * width, dtype=np.uint8)[3:].reshape(rows, -1)
        np.copyto(_rows_at(expected, start, rows, width, gap), src)
        copy(_rows_at(buf, start, rows, width, gap), src)
        assert np.array_equal(buf, expected), start


@needs_cc
def test_the_row_copy_refuses_arrays_it_cannot_copy_and_writes_nothing():
    copy = native.copier()
    assert copy is not None, native.copy_status()
    dst = np.zeros((4, 1024), dtype=np.uint8)
    src = np.ones((4, 1024), dtype=np.uint8)
    read_only = np.zeros((4, 1024), dtype=np.uint8)
    read_only.flags.writeable = False
    for bad_dst, bad_src in (
        (dst, src[:3]),  # another shape
        (dst[:, :512], src[:, ::2]),  # a row of bytes not adjacent
        (dst[:, ::2], src[:, :512]),
        (dst.view(np.int32), src.view(np.int32)),  # not bytes
        (dst.reshape(-1), src.reshape(-1)),  # not rows
        (read_only, src),
    ):
        with pytest.raises(ValueError, match="a row copy takes two 2-D uint8 arrays"):
            copy(bad_dst, bad_src)
    assert not dst.any() and not read_only.any()
    buf = np.arange(1 << 20, dtype=np.uint8).reshape(2, -1)
    before = buf.copy()
    quarter = 1 << 18
    src = buf.reshape(-1)[quarter : 3 * quarter].reshape(2, quarter)  # overlaps both rows
    with pytest.raises(ValueError, match="overlap"):
        copy(buf[:, :quarter], src)
    assert np.array_equal(buf, before)


@needs_cc
def test_a_planted_row_copy_library_is_rebuilt_not_loaded(planted, tmp_path, monkeypatch, caplog):
    lib, marker = planted
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    paths = plant(lib, cache, mode=0o666, library=native.COPY)
    monkeypatch.setenv("SHMKV_CACHE_DIR", str(cache))
    with caplog.at_level(logging.WARNING, logger="shmkv"):
        copy, why = native._build(native.COPY)
    assert not marker.exists()
    assert why is None and "refusing to load" in refusals(caplog)
    assert os.path.basename(os.readlink(f"/proc/self/fd/{copy.fd}")) == os.path.basename(paths[0])
    assert not os.stat(paths[0]).st_mode & 0o022  # this user's own build took its place
    dst, src = np.zeros((2, 4096), dtype=np.uint8), np.arange(8192, dtype=np.uint8).reshape(2, -1)
    copy(dst, src)
    assert np.array_equal(dst, src)
