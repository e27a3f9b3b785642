"""The native decode kernel (shmkv.kernels.native) against a dense float64 reference and against
the torch path, each of its instruction-set instances this CPU runs, the row copy, and
what happens where the package was built without them."""

from __future__ import annotations

import importlib.machinery
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from shmkv.kernels import native
from shmkv.kernels.attention import PagedAttentionPlan, paged_attention
from shmkv.memory.block_io import RowCopy

TOLERANCE = dict(rtol=2e-5, atol=2e-5)
ROOT = Path(__file__).resolve().parents[1]
# The compiler setuptools builds the package's libraries with: where there is one, the
# install (scripts/setup.sh) must have built them.
HAS_CC = (
    shutil.which((os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc").split()[0])
    is not None
)
BUILT = native.library_path(native.DECODE.name) is not None


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


needs_build = pytest.mark.skipif(
    not BUILT, reason="the package was built without the native libraries (no C compiler)"
)


def test_the_libraries_are_built_with_the_package_and_load_here():
    if not HAS_CC:
        pytest.skip("no C compiler: the package was built without its native libraries")
    assert native.decoder() is not None, native.status()
    assert native.status() == "loaded"
    assert native.isa() in native.ISAS
    copy = native.copier()
    assert copy is not None, native.copy_status()
    assert copy.isa in RowCopy.ISAS
    for name in (native.DECODE.name, native.COPY.name):
        path = native.library_path(name)
        assert path is not None and os.path.dirname(path) == os.path.dirname(native.__file__)


def test_the_decode_kernel_chooses_the_widest_instance_the_cpu_reports():
    # paged_decode.c's cpuid test against the kernel's own view of /proc/cpuinfo.
    if native.decoder() is None:
        pytest.skip(f"no native kernel: {native.status()}")
    flags = set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    if os.uname().machine != "x86_64":
        want = "portable"
    elif {"avx512f", "avx2", "fma", "f16c"} <= flags:
        want = "avx512"
    elif {"avx2", "fma", "f16c"} <= flags:
        want = "avx2"
    else:
        want = "portable"
    assert native.isa() == want
    assert native.report()["decode"] == f"loaded ({want})"


# bfloat16 and float16: K/V and queries rounded to them, the result rounded to them
# (one part in 256, one in 2048).
TOLERANCES = {
    torch.float32: TOLERANCE,
    torch.bfloat16: dict(rtol=1e-2, atol=1e-2),
    torch.float16: dict(rtol=1e-3, atol=1e-3),
}


@needs_build
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


@needs_build
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


@needs_build
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


@needs_build
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


@needs_build
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


@needs_build
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


@needs_build
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


@needs_build
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


@needs_build
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


def _runnable(isa: str) -> dict:
    """The decode kernels of instance ``isa``; skips the test where this CPU cannot run
    it (an AVX-512 instance without AVX-512, any x86 one off x86)."""
    try:
        return native.isa_kernels(isa)
    except ValueError as exc:
        pytest.skip(str(exc))


@pytest.fixture(params=["as chosen", *native.ISAS])
def f16_kernels(request):
    """The kernels this CPU is given (its own float16 conversion where it has one), and
    each instance it can run: plain vector code (as on CPUs without a conversion), F16C's
    8-lane conversion (AVX2) and AVX-512's 16-lane one."""
    if request.param == "as chosen":
        return native.decoder()
    return _runnable(request.param)


@needs_build
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


@needs_build
@pytest.mark.parametrize("isa", native.ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_every_instance_this_cpu_runs_matches_the_reference(isa, dtype):
    kernels = _runnable(isa)
    lens = [1, 37, 64, 100]
    for dim in (8, 32, 80, 128):  # plain loops and vector instances
        q, k_pages, v_pages, table = batch(lens, 4, 2, dim, 16, seed=dim)
        q, k_pages, v_pages = q.to(dtype), k_pages.to(dtype), v_pages.to(dtype)
        got = native.paged_decode(kernels, q, k_pages, v_pages, table, torch.tensor(lens), 0.2)
        want = reference(q, k_pages, v_pages, table, lens, scale=0.2)
        torch.testing.assert_close(got.double(), want, **TOLERANCES[dtype])


def test_an_instance_the_cpu_cannot_run_is_refused(monkeypatch):
    if native.decoder() is None:
        pytest.skip(f"no native kernel: {native.status()}")
    monkeypatch.setitem(native._state, "isa", "portable")  # as on a CPU without AVX2
    with pytest.raises(ValueError, match="this CPU runs the portable ones"):
        native.isa_kernels("avx2")
    with pytest.raises(ValueError, match="this CPU runs the portable ones"):
        native.isa_kernels("sse9")
    assert set(native.isa_kernels("portable")) == set(native.DTYPES)


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


def _child(env: dict, code: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **env},
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=180,
    )


CHILD = """
import torch, logging
logging.basicConfig(level=logging.WARNING)
from shmkv.kernels import native
from shmkv.kernels.attention import paged_attention
print("FROM", native.__file__)
torch.manual_seed(0)
k = torch.randn(8, 4, 2, 32); v = torch.randn(8, 4, 2, 32); q = torch.randn(2, 4, 32)
table = torch.tensor([[0, 3, 5], [7, 1, 2]], dtype=torch.int32)
for _ in range(2):  # (a second call: nothing more is logged)
    out = paged_attention(q, k, v, table, [9, 12])
ref = torch.cat([torch.nn.functional.scaled_dot_product_attention(
    q[b][:, None], k[table[b]].reshape(-1, 2, 32)[:n].repeat_interleave(2, 1).transpose(0, 1),
    v[table[b]].reshape(-1, 2, 32)[:n].repeat_interleave(2, 1).transpose(0, 1))[None, :, 0]
    for b, n in enumerate([9, 12])])
torch.testing.assert_close(out, ref, rtol=2e-5, atol=2e-5)
print("STATUS", native.status())
print("COPY", "loaded" if native.copier() is not None else native.copy_status())
print("REPORT", native.report())
"""


SUBNORMALS = """
import torch
from shmkv.kernels import native
assert native.decoder() is not None, native.status()
tiny = 2.2250738585072014e-308 / 4          # a float64 subnormal, computed after the load
assert tiny > 0 and tiny * 3 > 0
t = torch.tensor([1e-40], dtype=torch.float32)   # a float32 subnormal
assert float((t * 1.0).item()) > 0 and float((t + t).item()) > 0
print("SUBNORMALS OK")
"""


@needs_build
def test_loading_the_kernel_leaves_the_process_floating_point_alone():
    # A library linked with -ffast-math sets flush-to-zero for the whole process at load:
    # subnormals would then read as zero everywhere (setup.py compiles with it, links
    # without it).
    done = _child({}, SUBNORMALS)
    assert done.returncode == 0 and "SUBNORMALS OK" in done.stdout, done.stderr


def test_disabled_by_the_environment():
    done = _child({"SHMKV_NATIVE": "0"}, CHILD)
    assert done.returncode == 0, done.stderr
    assert "STATUS disabled by SHMKV_NATIVE" in done.stdout
    assert "COPY disabled by SHMKV_NATIVE" in done.stdout
    assert "not available" not in done.stderr  # asked for: nothing to warn about


def test_a_package_built_without_a_compiler_installs_and_runs_on_the_fallbacks(tmp_path):
    """The package built where the C compiler fails (``CC=/bin/false``): the build
    succeeds without the libraries (optional extensions), and a process that imports it
    decodes on the torch path (the right result), copies with numpy, says why in
    status(), copy_status() and report() (what ``shmkv stats`` shows), and logs each
    once."""
    src = tmp_path / "src"
    shutil.copytree(
        ROOT / "shmkv", src / "shmkv", ignore=shutil.ignore_patterns("*.so", "__pycache__")
    )
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    built = subprocess.run(
        [sys.executable, "setup.py", "build_ext", "--inplace"],
        cwd=src,
        env={**os.environ, "CC": "/bin/false"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert built.returncode == 0, built.stderr
    assert 'building extension "shmkv.kernels._paged_decode" failed' in built.stderr
    assert 'building extension "shmkv.kernels._copy_rows" failed' in built.stderr
    assert not list((src / "shmkv").rglob("*.so"))
    done = _child({"PYTHONPATH": str(src)}, CHILD, cwd=src)
    assert done.returncode == 0, done.stderr
    kernels = src / "shmkv" / "kernels"
    assert f"FROM {kernels / 'native.py'}" in done.stdout  # the copy, not the checkout
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    assert f"STATUS not built: no _paged_decode{suffix} in {kernels} (" in done.stdout
    assert "without a C compiler" in done.stdout
    assert "COPY not built: no _copy_rows" in done.stdout
    assert "REPORT {'decode': 'not built: no _paged_decode" in done.stdout
    assert "'row_copy': 'not built: no _copy_rows" in done.stdout
    kernel = "the native decode kernel is not available, attention takes its torch path"
    assert done.stderr.count(kernel) == 1
    assert done.stderr.count("native row copy is not available, the tiers copy with numpy") == 1


def test_stats_say_whether_the_native_code_is_loaded(coord, client):
    assert client.stats()["native"] == native.report()
    want = {
        "decode": f"loaded ({native.isa()})" if native.decoder() else native.status(),
        "row_copy": f"loaded ({native.copier().isa})" if native.copier() else native.copy_status(),
    }
    assert native.report() == want
    if BUILT:
        assert want["decode"] in {f"loaded ({isa})" for isa in native.ISAS}


@needs_build
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


# -- the tiers' row copy -------------------------------------------------------------------


def _rows_at(buf, start, rows, width, gap):
    """``rows`` rows of ``width`` bytes of ``buf`` from ``start``, ``gap`` bytes apart."""
    return buf[start : start + rows * (width + gap)].reshape(rows, -1)[:, :width]


@needs_build
@pytest.mark.parametrize("width", [1, 15, 127, 511, 512, 513, 1000, 4096 + 7, 32768])
@pytest.mark.parametrize("path", ["native", "numpy", *RowCopy.ISAS])
def test_the_row_copy_writes_numpys_bytes_and_nothing_around_them(width, path, monkeypatch):
    """Rows streamed past the caches (512 bytes and wider) or copied plainly by the native
    code (the way this CPU is given, and each way it can run: memcpy, SSE2, AVX), or
    handed to numpy (a small copy), into rows that start on any byte and lie apart: every
    byte of each row, none between them."""
    copy = native.copier()
    assert copy is not None, native.copy_status()
    if path in RowCopy.ISAS:
        try:
            copy = RowCopy(copy.path, isa=path)
        except ValueError as exc:
            pytest.skip(str(exc))
    monkeypatch.setattr(copy, "min_bytes", 1 << 30 if path == "numpy" else 0)
    rng = np.random.default_rng(width)
    rows, gap = 5, 77
    for start in (0, 1, 8, 16, 31):
        buf = rng.integers(0, 256, size=start + rows * (width + gap), dtype=np.uint8)
        expected = buf.copy()
        src = rng.integers(0, 256, size=3 + rows * width, dtype=np.uint8)[3:].reshape(rows, -1)
        np.copyto(_rows_at(expected, start, rows, width, gap), src)
        copy(_rows_at(buf, start, rows, width, gap), src)
        assert np.array_equal(buf, expected), start


@needs_build
def test_the_row_copy_refuses_arrays_it_cannot_copy_and_writes_nothing():
    copy = native.copier()
    assert copy is not None, native.copy_status()
    with pytest.raises(ValueError, match="this CPU copies rows up to"):
        RowCopy(copy.path, isa="neon")  # not one of RowCopy.ISAS
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
