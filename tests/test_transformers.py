"""ShmkvCache with small random transformers models: equal to DynamicCache, across processes.

Models are built from a config and a seed (no downloads); a spawned child builds the
same weights from the same seed, which the tests check through a weight checksum.
"""

from __future__ import annotations

import argparse

import pytest
import torch

pytest.importorskip("transformers")

from transformers import (DynamicCache, LlamaConfig, LlamaForCausalLM,  # noqa: E402
                          Qwen2Config, Qwen2ForCausalLM)

import shmkv  # noqa: E402
from conftest import SPAWN, join_or_kill  # noqa: E402
from shmkv.integrations.transformers import (ShmkvCache, cache_argument,  # noqa: E402
                                             pool_config, prefill)

VOCAB = 256
NEW_TOKENS = 10
BLOCK_SIZE = 4
TIGHT = dict(rtol=1e-5, atol=1e-6)      # same computation, another home for the K/V
REUSED = dict(rtol=1e-4, atol=1e-5)     # prefix K/V computed in another (longer) prefill

MODELS = {
    # GQA 2: 4 query heads over 2 K/V heads.
    "llama": (LlamaForCausalLM, LlamaConfig, dict(num_attention_heads=4, num_key_value_heads=2)),
    # GQA 4: 8 query heads over 2 K/V heads, head_dim 8.
    "qwen2": (Qwen2ForCausalLM, Qwen2Config, dict(num_attention_heads=8, num_key_value_heads=2)),
}


def build(kind: str, seed: int = 0, **overrides):
    model_cls, config_cls, heads = MODELS[kind]
    fields = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  max_position_embeddings=512, bos_token_id=None, eos_token_id=None,
                  pad_token_id=None, **heads)
    config = config_cls(**{**fields, **overrides})
    torch.manual_seed(seed)
    return model_cls(config).eval()


def checksum(model) -> float:
    return float(sum(p.detach().double().sum() for p in model.parameters()))


def prompt(seed: int, n: int) -> list:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPT_A = prompt(1, 23)
PROMPT_B = PROMPT_A[:16] + prompt(2, 9)     # shares 4 full blocks of A
PROMPT_C = PROMPT_A[:16]                    # wholly cached once A is committed


@torch.no_grad()
def greedy(model, ids, cache=None, max_new_tokens=NEW_TOKENS, attention_mask=None, **kwargs):
    ids = torch.as_tensor(ids)
    ids = ids[None] if ids.dim() == 1 else ids
    if cache is not None:
        kwargs[cache_argument(model)] = cache
    return model.generate(ids, attention_mask=attention_mask if attention_mask is not None
                          else torch.ones_like(ids), max_new_tokens=max_new_tokens,
                          do_sample=False, return_dict_in_generate=True, output_logits=True,
                          **kwargs)


def assert_same_generation(got, want, prompt_len: int, tol=TIGHT) -> None:
    assert got.sequences[:, prompt_len:].tolist() == want.sequences[:, prompt_len:].tolist()
    assert len(got.logits) == len(want.logits)
    for step, (a, b) in enumerate(zip(got.logits, want.logits)):
        torch.testing.assert_close(a, b, **tol, msg=lambda m: f"step {step}: {m}")


def assert_kv_equal(handle, dynamic_cache, num_tokens: int, tol=TIGHT) -> None:
    for layer in range(handle.num_layers):
        want_k = dynamic_cache.layers[layer].keys[0, :, :num_tokens].transpose(0, 1)
        want_v = dynamic_cache.layers[layer].values[0, :, :num_tokens].transpose(0, 1)
        torch.testing.assert_close(handle.key_cache(layer)[:num_tokens], want_k, **tol)
        torch.testing.assert_close(handle.value_cache(layer)[:num_tokens], want_v, **tol)


@pytest.fixture
def model_coord(unique_name):
    """Coordinators shaped for a model config, closed at the end of the test."""
    started = []

    def start(model, num_blocks=256, **kwargs):
        cfg = pool_config(model.config, num_blocks=num_blocks, block_size=BLOCK_SIZE, **kwargs)
        coord = shmkv.Coordinator(cfg, name=f"{unique_name}-{len(started)}")
        coord.start()
        started.append(coord)
        return coord

    yield start
    for coord in started:
        coord.stop()


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_generate_equals_dynamic_cache(kind, model_coord):
    model = build(kind)
    with shmkv.connect(model_coord(model).address, timeout=20) as client:
        want = greedy(model, PROMPT_A)
        with ShmkvCache(client, model_config=model.config) as cache:
            got = greedy(model, PROMPT_A, cache)
            assert got.cache is cache
            handle = cache.handle
            assert handle.num_tokens == len(PROMPT_A) + NEW_TOKENS - 1
            assert_same_generation(got, want, len(PROMPT_A))
            assert isinstance(want.cache, DynamicCache)
            assert_kv_equal(handle, want.cache, handle.num_tokens)
        assert not handle.is_valid()
        assert client.stats()["referenced_blocks"] == 0


def test_batched_generate_with_padding(model_coord):
    model = build("llama")
    short = prompt(5, 9)
    ids = torch.tensor([PROMPT_A, [0] * (len(PROMPT_A) - len(short)) + short])
    mask = torch.ones_like(ids)
    mask[1, :len(PROMPT_A) - len(short)] = 0
    with shmkv.connect(model_coord(model).address, timeout=20) as client:
        want = greedy(model, ids, attention_mask=mask, pad_token_id=0)
        with ShmkvCache(client) as cache:
            got = greedy(model, ids, cache, attention_mask=mask, pad_token_id=0)
            assert len(cache.handles) == 2
        assert_same_generation(got, want, ids.shape[1])
        assert client.stats()["referenced_blocks"] == 0


def test_beam_search_forks_sequences(model_coord):
    model = build("qwen2")
    with shmkv.connect(model_coord(model).address, timeout=20) as client:
        kwargs = dict(num_beams=3, num_return_sequences=2, max_new_tokens=6)
        want = greedy(model, PROMPT_B, **kwargs)
        with ShmkvCache(client) as cache:
            got = greedy(model, PROMPT_B, cache, **kwargs)
            assert len(cache.handles) == 3
        assert got.sequences.tolist() == want.sequences.tolist()
        stats = client.stats()
        assert stats["ops_by_type"].get("fork", 0) > 0 and stats["cow_copies"] > 0
        assert stats["referenced_blocks"] == 0


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_forward_calls_with_use_cache(kind, model_coord):
    """Chunked prefill then single tokens, by plain forward calls, against DynamicCache and
    against one forward over the whole sequence without a cache."""
    model = build(kind)
    ids = torch.tensor([PROMPT_A + prompt(3, 6)])
    chunks = [(0, 7), (7, 12), (12, 23)] + [(i, i + 1) for i in range(23, ids.shape[1])]
    key = cache_argument(model)
    with shmkv.connect(model_coord(model).address, timeout=20) as client:
        with ShmkvCache(client) as cache, torch.no_grad():
            full = model(ids, use_cache=False).logits
            dynamic = DynamicCache(config=model.config)
            for lo, hi in chunks:
                got = model(ids[:, lo:hi], use_cache=True, **{key: cache})
                want = model(ids[:, lo:hi], use_cache=True, **{key: dynamic})
                assert cache.get_seq_length() == hi
                torch.testing.assert_close(got.logits, want.logits, **TIGHT)
                torch.testing.assert_close(got.logits, full[:, lo:hi], **REUSED)
            assert_kv_equal(cache.handle, dynamic, ids.shape[1])
            cache.crop(-3)
            dynamic.crop(-3)
            with torch.enable_grad():   # the pool must stay out of any autograd graph
                got = model(ids[:, -3:], use_cache=True, **{key: cache})
            want = model(ids[:, -3:], use_cache=True, **{key: dynamic})
            torch.testing.assert_close(got.logits.detach(), want.logits, **TIGHT)
            assert got.logits.requires_grad
            assert not client.pool.requires_grad and client.pool.grad_fn is None
            assert cache.handle.num_tokens == ids.shape[1]


def test_prefix_reuse_skips_shared_prefill(model_coord):
    model = build("qwen2")
    ran = []
    hook = model.model.embed_tokens.register_forward_hook(
        lambda module, args, out: ran.append(args[0].shape[1]))
    try:
        with shmkv.connect(model_coord(model).address, timeout=20) as client:
            for ids, cached in [(PROMPT_A, 0), (PROMPT_B, 16), (PROMPT_C, 15)]:
                want = greedy(model, ids)
                ran.clear()
                with ShmkvCache.from_prompt(client, ids) as cache:
                    assert cache.num_cached_tokens == cached
                    got = greedy(model, ids, cache)
                    assert ran[0] == len(ids) - cached     # only the uncached part ran
                    assert_kv_equal(cache.handle, want.cache, cache.handle.num_tokens, REUSED)
                assert_same_generation(got, want, len(ids), REUSED)
            stats = client.stats()
            assert stats["prefix_hit_tokens"] == 16 + 16
            assert stats["cow_copies"] >= 1                # C's last token lands in a shared block
            assert stats["referenced_blocks"] == 0
    finally:
        hook.remove()


def test_mismatched_model_is_refused(model_coord):
    model = build("llama")
    one_layer = build("llama", num_hidden_layers=1)
    with shmkv.connect(model_coord(one_layer).address, timeout=20) as client:
        with ShmkvCache(client) as cache, pytest.raises(shmkv.InvalidArgument, match="layer"):
            greedy(model, PROMPT_A, cache)
    with shmkv.connect(model_coord(build("qwen2")).address, timeout=20) as client:
        with ShmkvCache(client) as cache, pytest.raises(shmkv.InvalidArgument, match="heads"):
            greedy(model, PROMPT_A, cache)
        sliding = build("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=0)
        with pytest.raises(shmkv.InvalidArgument, match="sliding"):
            ShmkvCache(client, model_config=sliding.config)
        assert client.stats()["referenced_blocks"] == 0


# -- prefill in a spawned process, decode here ------------------------------------------------

def prefill_worker(address: str, kind: str, prompts: list, queue, acks) -> None:
    """Prefill each prompt (reusing cached prefixes), commit it, and send the parent what
    decoding needs: the first prompt's handle, the later prompts' whole ShmkvCache.

    One prompt at a time: the next starts once the parent has acknowledged the last.
    The queue's thread pickles (exports) what was put through this process's client,
    and a client must not be used from two threads at once."""
    model = build(kind)
    caches = []
    with shmkv.connect(address, timeout=30) as client:
        try:
            for i, ids in enumerate(prompts):
                cache = ShmkvCache.from_prompt(client, ids, model_config=model.config)
                caches.append(cache)
                logits = prefill(model, cache, torch.tensor(ids))
                cache.commit()
                queue.put({"kv": cache.handle if i == 0 else cache,
                           "first": int(logits.argmax(-1)), "logits": logits[0].tolist(),
                           "cached": cache.num_cached_tokens, "checksum": checksum(model)})
                acks.get(timeout=60)
            queue.close()
            queue.join_thread()
        finally:
            for cache in caches:
                cache.close()


def test_prefill_in_child_decode_in_parent(model_coord):
    model = build("llama")
    coord = model_coord(model)
    prompts = [PROMPT_A, PROMPT_B]
    wants = [greedy(model, ids) for ids in prompts]
    queue, acks = SPAWN.Queue(), SPAWN.Queue()
    child = SPAWN.Process(target=prefill_worker,
                          args=(coord.address, "llama", prompts, queue, acks),
                          name="prefill-worker")
    child.start()
    try:
        with shmkv.connect(coord.address, timeout=20) as client:
            items = []
            for _ in prompts:
                items.append(queue.get(timeout=90))
                acks.put(True)
            assert join_or_kill(child, 30) == 0
            for ids, want, item, cached in zip(prompts, wants, items, [0, 16]):
                assert item["checksum"] == checksum(model), "child built other weights"
                assert item["cached"] == cached
                assert item["first"] == int(want.sequences[0, len(ids)])
                torch.testing.assert_close(torch.tensor([item["logits"]]), want.logits[0],
                                           **REUSED)
                kv = item["kv"]
                cache = kv if isinstance(kv, ShmkvCache) else ShmkvCache(kv)
                handle = cache.handle
                assert handle.num_tokens == len(ids) and cache.get_seq_length() == len(ids)
                assert_kv_equal(handle, want.cache, len(ids), REUSED)
                got = greedy(model, ids + [item["first"]], cache, max_new_tokens=NEW_TOKENS - 1)
                assert got.sequences[0, len(ids):].tolist() == \
                    want.sequences[0, len(ids):].tolist()
                for a, b in zip(got.logits, want.logits[1:]):
                    torch.testing.assert_close(a, b, **REUSED)
                cache.close()
                handle.close()
            assert client.stats()["referenced_blocks"] == 0
    finally:
        if child.is_alive():
            child.kill()
        child.join(10)


def test_demo_model_main(capsys):
    """``shmkv demo --model tiny``: prefill in a spawned DataLoader worker, decode here,
    every token verified; exit code 0 and nothing left behind (the leak check)."""
    from shmkv.tools import demo_model
    args = argparse.Namespace(model="tiny", prompts=3, workers=1, decode_steps=4,
                              dtype="float32")
    code = demo_model.main(args)
    out = capsys.readouterr().out
    assert code == 0, out
    assert "verified: all 12 generated tokens equal" in out
    assert "tokens/s" in out
    assert demo_model.main(argparse.Namespace(**{**vars(args), "model": "huge"})) == 2
