"""ShmkvCache with small random transformers models: equal to DynamicCache, across processes.

Models are built from a config and a seed (no downloads); a spawned child builds the
same weights from the same seed, which the tests check through a weight checksum.
Most tests run three times: with ``attn_implementation="shmkv"`` (the paged path:
every forward attends over the pool), ``"shmkv"`` with ``mirror=True``
("shmkv-mirror": decode steps attend over the cache's mirror of the pool, other
forwards over the pool) and with ``"sdpa"`` (the dense path). The reference is always
``DynamicCache`` with ``"sdpa"``.
"""

from __future__ import annotations

import argparse

import pytest
import torch

pytest.importorskip("transformers")

from conftest import SPAWN, join_or_kill  # noqa: E402
from transformers import (  # noqa: E402
    DynamicCache,
    GemmaConfig,
    GemmaForCausalLM,
    GraniteConfig,
    GraniteForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Olmo2Config,
    Olmo2ForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

import shmkv  # noqa: E402
from shmkv.integrations.transformers import (  # noqa: E402
    ShmkvCache,
    cache_argument,
    left_pad,
    model_cache_salt,
    pool_config,
    prefill,
    use_shmkv_attention,
)

VOCAB = 256
NEW_TOKENS = 10
BLOCK_SIZE = 4
TIGHT = dict(rtol=1e-5, atol=1e-6)  # same computation, another home for the K/V
REUSED = dict(rtol=1e-4, atol=1e-5)  # prefix K/V computed in another (longer) prefill

GQA2 = dict(num_attention_heads=4, num_key_value_heads=2)
MODELS = {
    # GQA 2: 4 query heads over 2 K/V heads.
    "llama": (LlamaForCausalLM, LlamaConfig, GQA2),
    # GQA 4: 8 query heads over 2 K/V heads, head_dim 8.
    "qwen2": (Qwen2ForCausalLM, Qwen2Config, dict(num_attention_heads=8, num_key_value_heads=2)),
    "mistral": (MistralForCausalLM, MistralConfig, dict(GQA2, sliding_window=None)),
    # head_dim 16 apart from hidden / heads; embeddings scaled by sqrt(hidden).
    "gemma": (GemmaForCausalLM, GemmaConfig, dict(GQA2, head_dim=16)),
    # attention scaled by attention_multiplier instead of 1/sqrt(head_dim).
    "granite": (GraniteForCausalLM, GraniteConfig, dict(GQA2, attention_multiplier=0.1)),
    # q/k normalization over all heads.
    "olmo2": (Olmo2ForCausalLM, Olmo2Config, GQA2),
    # fused qkv projection, partial rotary.
    "phi3": (Phi3ForCausalLM, Phi3Config, dict(GQA2, partial_rotary_factor=0.5)),
}
FULL_ATTENTION = ["llama", "qwen2", "mistral", "gemma", "granite", "olmo2", "phi3"]
ATTN = ["shmkv", "shmkv-mirror", "sdpa"]
IMPL = {"shmkv": "shmkv", "shmkv-mirror": "shmkv", "sdpa": "sdpa"}  # attn_implementation
CACHE = {"shmkv": {}, "shmkv-mirror": {"mirror": True}, "sdpa": {}}  # ShmkvCache arguments
PATH = {"shmkv": "paged", "shmkv-mirror": "paged", "sdpa": "dense"}


def build(kind: str, seed: int = 0, attn: str = "sdpa", **overrides):
    model_cls, config_cls, heads = MODELS[kind]
    fields = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        max_position_embeddings=512,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        **heads,
    )
    config = config_cls(**{**fields, **overrides})
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    model.set_attn_implementation(IMPL[attn])
    return model


def checksum(model) -> float:
    return float(sum(p.detach().double().sum() for p in model.parameters()))


def prompt(seed: int, n: int) -> list:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPT_A = prompt(1, 23)
PROMPT_B = PROMPT_A[:16] + prompt(2, 9)  # shares 4 full blocks of A
PROMPT_C = PROMPT_A[:16]  # wholly cached once A is committed


@torch.no_grad()
def greedy(model, ids, cache=None, max_new_tokens=NEW_TOKENS, attention_mask=None, **kwargs):
    """``generate``, greedy unless ``do_sample=True`` is passed, with logits returned."""
    ids = torch.as_tensor(ids)
    ids = ids[None] if ids.dim() == 1 else ids
    if cache is not None:
        kwargs[cache_argument(model)] = cache
    kwargs.setdefault("do_sample", False)
    return model.generate(
        ids,
        attention_mask=attention_mask if attention_mask is not None else torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        return_dict_in_generate=True,
        output_logits=True,
        **kwargs,
    )


def cache_of(output):
    """The cache a ``generate`` output returns (``cache`` in some transformers 5.x
    releases, ``past_key_values`` in others)."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


def assert_same_generation(got, want, prompt_len: int, tol=TIGHT) -> None:
    assert got.sequences[:, prompt_len:].tolist() == want.sequences[:, prompt_len:].tolist()
    assert len(got.logits) == len(want.logits)
    for step, (a, b) in enumerate(zip(got.logits, want.logits)):
        torch.testing.assert_close(a, b, **tol, msg=lambda m, step=step: f"step {step}: {m}")


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


@pytest.mark.parametrize("attn", ATTN)
@pytest.mark.parametrize("kind", FULL_ATTENTION)
def test_generate_equals_dynamic_cache(kind, attn, model_coord):
    model = build(kind)
    want = greedy(model, PROMPT_A)
    model.set_attn_implementation(IMPL[attn])
    with shmkv.connect(model_coord(model).address, timeout=20) as client:
        with ShmkvCache(client, model_config=model.config, **CACHE[attn]) as cache:
            got = greedy(model, PROMPT_A, cache)
            assert cache_of(got) is cache
            assert cache.attention_path == PATH[attn]
            handle = cache.handle
            assert handle.num_tokens == len(PROMPT_A) + NEW_TOKENS - 1
            assert_same_generation(got, want, len(PROMPT_A))
            assert isinstance(cache_of(want), DynamicCache)
            assert_kv_equal(handle, cache_of(want), handle.num_tokens)
        assert not handle.is_valid()
        assert client.stats()["referenced_blocks"] == 0


def test_shmkv_attention_without_shmkv_cache_is_sdpa():
    """The "shmkv" implementation with DynamicCache, or no cache, attends as SDPA does."""
    model = build("qwen2")
    want = greedy(model, PROMPT_A)
    ids = torch.tensor([PROMPT_A])
    full = model(ids, use_cache=False).logits
    use_shmkv_attention(model)
    assert model.config._attn_implementation == "shmkv"
    got = greedy(model, PROMPT_A)
    assert got.sequences.tolist() == want.sequences.tolist()
    for a, b in zip(got.logits, want.logits):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(model(ids, use_cache=False).logits, full, rtol=0, atol=0)
    config = MODELS["llama"][1](
        **dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, **GQA2)
    )
    loaded = LlamaForCausalLM._from_config(config, attn_implementation="shmkv")
    assert loaded.config._attn_implementation == "shmkv"


def padded_batch():
    """Two prompts, the second shorter and padded on the left with 0."""
    short = prompt(5, 9)
    ids, mask = left_pad([PROMPT_A, short])
    return ids, mask, [len(PROMPT_A), len(short)]


@pytest.mark.parametrize("attn", ATTN)
def test_batched_generate_with_padding(attn, model_coord):
    model = build("llama")
    ids, mask, lengths = padded_batch()
    want = greedy(model, ids, attention_mask=mask, pad_token_id=0)
    model.set_attn_implementation(IMPL[attn])
    with shmkv.connect(model_coord(model).address, timeout=20) as client:
        with ShmkvCache(client, **CACHE[attn]) as cache:
            got = greedy(model, ids, cache, attention_mask=mask, pad_token_id=0)
            assert len(cache.handles) == 2
            assert cache.attention_path == PATH[attn]
            total = ids.shape[1] + NEW_TOKENS - 1
            if PATH[attn] == "paged":  # the padding is not stored
                assert cache.left_padding == [0, ids.shape[1] - lengths[1]]
                assert [h.num_tokens for h in cache.handles] == [
                    n + NEW_TOKENS - 1 for n in lengths
                ]
            else:
                assert [h.num_tokens for h in cache.handles] == [total, total]
            assert cache.get_seq_length() == total
        assert_same_generation(got, want, ids.shape[1])
        assert client.stats()["referenced_blocks"] == 0


@pytest.mark.parametrize("attn", ATTN)
def test_num_return_sequences(attn, model_coord):
    """Sampling three sequences per prompt of a padded batch (six rows)."""
    model = build("qwen2")
    ids, mask, _ = padded_batch()
    kwargs = dict(
        attention_mask=mask,
        pad_token_id=0,
        do_sample=True,
        num_return_sequences=3,
        top_k=0,
        max_new_tokens=6,
    )
    torch.manual_seed(11)
    want = greedy(model, ids, **kwargs)
    model.set_attn_implementation(IMPL[attn])
    with shmkv.connect(model_coord(model).address, timeout=20) as client:
        with ShmkvCache(client, **CACHE[attn]) as cache:
            torch.manual_seed(11)
            got = greedy(model, ids, cache, **kwargs)
            assert len(cache.handles) == 6 and cache.attention_path == PATH[attn]
        assert_same_generation(got, want, ids.shape[1])
        assert client.stats()["referenced_blocks"] == 0


@pytest.mark.parametrize("attn", ATTN)
def test_beam_search_forks_sequences(attn, model_coord):
    model = build("qwen2")
    with shmkv.connect(model_coord(model).address, timeout=20) as client:
        kwargs = dict(num_beams=3, num_return_sequences=2, max_new_tokens=6)
        want = greedy(model, PROMPT_B, **kwargs)
        model.set_attn_implementation(IMPL[attn])
        with ShmkvCache(client, **CACHE[attn]) as cache:
            got = greedy(model, PROMPT_B, cache, **kwargs)
            assert len(cache.handles) == 3
        assert got.sequences.tolist() == want.sequences.tolist()
        stats = client.stats()
        assert stats["ops_by_type"].get("fork", 0) > 0 and stats["cow_copies"] > 0
        assert stats["referenced_blocks"] == 0


@pytest.mark.parametrize("attn", ATTN)
def test_prompt_lookup_decoding_crops(attn, model_coord):
    """Prompt-lookup decoding drafts tokens from n-grams of the prompt, verifies them in one
    forward and crops the rejected ones from the cache."""
    model = build("llama")
    ids = (PROMPT_A[:8] * 4)[:30]  # repeats: n-gram matches to draft from
    kwargs = dict(prompt_lookup_num_tokens=4, max_new_tokens=16)
    want = greedy(model, ids, **kwargs)
    model.set_attn_implementation(IMPL[attn])
    with shmkv.connect(model_coord(model).address, timeout=20) as client:
        with ShmkvCache(client, **CACHE[attn]) as cache:
            crops = []
            crop = cache.crop
            cache.crop = lambda n: (crops.append(n), crop(n))
            got = greedy(model, ids, cache, **kwargs)
            assert any(n < 0 for n in crops), "no draft was rejected: the test lost its point"
            assert cache.attention_path == PATH[attn]
            assert cache.get_seq_length() == got.sequences.shape[1] - 1
        assert got.sequences.tolist() == want.sequences.tolist()
        assert client.stats()["referenced_blocks"] == 0


@pytest.mark.parametrize("attn", ATTN)
def test_decode_over_reserved_slots_advances_steps(attn, model_coord, monkeypatch):
    """Generating again after a crop back to the prompt runs over slots already reserved:
    a step reads the tables only when a block begins (Step.advance in between), and the
    attention plan of a step over the pool is the last one's with one more key (with the
    mirror, decode steps make no plan at all)."""
    model = build("qwen2")
    ids = torch.tensor([PROMPT_A, PROMPT_A[::-1]])
    want = greedy(model, ids)
    model.set_attn_implementation(IMPL[attn])
    made = {"advance": 0, "prefill": 0, "extend": 0, "plan": 0}

    def counting(cls, name, key):
        real = getattr(cls, name)

        def call(*args, **kwargs):
            made[key] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(cls, name, call)

    counting(shmkv.client.batch.Step, "advance", "advance")
    counting(shmkv.client.batch.Batch, "prefill", "prefill")
    counting(shmkv.client.batch.Batch, "extend", "extend")
    counting(shmkv.kernels.attention.PagedAttentionPlan, "__init__", "plan")
    with shmkv.connect(model_coord(model).address, timeout=20) as client:
        with ShmkvCache(client, **CACHE[attn]) as cache:
            greedy(model, ids, cache)
            for _ in range(2):
                cache.crop(-(cache.get_seq_length() - (ids.shape[1] - 1)))
                made.update(advance=0, prefill=0, extend=0, plan=0)
                got = greedy(model, ids, cache)
                assert_same_generation(got, want, ids.shape[1])
                # positions 22..31 with 4-token blocks: 24 and 28 begin blocks
                assert made["extend"] == 0 and made["prefill"] == 3
                # the pool's attention plans: none when decode reads the mirror
                assert made["plan"] == (3 if attn == "shmkv" else 0)
                assert all(h.num_tokens == ids.shape[1] + NEW_TOKENS - 1 for h in cache.handles)
                reference = cache_of(want)
                for b, handle in enumerate(cache.handles):
                    for layer in range(handle.num_layers):
                        torch.testing.assert_close(
                            handle.key_cache(layer),
                            reference.layers[layer].keys[b, :, : handle.num_tokens].transpose(0, 1),
                            **TIGHT,
                        )


@pytest.mark.parametrize("attn", ATTN)
def test_decode_past_the_first_buffer_capacity(attn, model_coord):
    """Decoding across the mirror's (or the dense buffers') first capacity (256 tokens)
    grows them, keeping what they hold: a left-padded batch still equals DynamicCache and
    the pool holds every token."""
    model = build("llama")
    ids, mask = left_pad([prompt(21, 250), prompt(22, 241)])
    want = greedy(model, ids, attention_mask=mask, pad_token_id=0, max_new_tokens=12)
    model.set_attn_implementation(IMPL[attn])
    with shmkv.connect(model_coord(model).address, timeout=20) as client:
        with ShmkvCache(client, **CACHE[attn]) as cache:
            got = greedy(model, ids, cache, attention_mask=mask, pad_token_id=0, max_new_tokens=12)
            assert cache.get_seq_length() == ids.shape[1] + 11 > 256
            for b, handle in enumerate(cache.handles):
                pad = cache.left_padding[b]  # not stored on the paged path; 0 on the dense
                keys = cache_of(want).layers[1].keys[b, :, pad : pad + handle.num_tokens]
                torch.testing.assert_close(handle.key_cache(1), keys.transpose(0, 1), **TIGHT)
        assert_same_generation(got, want, ids.shape[1])
        assert client.stats()["referenced_blocks"] == 0


def test_mirror_argument_is_checked(model_coord):
    model = build("llama")
    with shmkv.connect(model_coord(model).address, timeout=20) as client:
        with pytest.raises(shmkv.WrongType, match="mirror"):
            ShmkvCache(client, mirror="yes")


@pytest.mark.parametrize("attn", ATTN)
def test_two_generate_calls_in_a_row(attn, model_coord):
    """A second generate continues from the first one's output with the same cache."""
    model = build("mistral")
    ids, mask, _ = padded_batch()
    with shmkv.connect(model_coord(model).address, timeout=20) as client:
        outputs = {}
        for name in ("dynamic", "shmkv"):
            model.set_attn_implementation("sdpa" if name == "dynamic" else IMPL[attn])
            cache = (
                DynamicCache(config=model.config)
                if name == "dynamic"
                else ShmkvCache(client, **CACHE[attn])
            )
            first = greedy(model, ids, cache, attention_mask=mask, pad_token_id=0)
            seq = first.sequences
            longer = torch.cat([mask, torch.ones_like(seq[:, ids.shape[1] :])], 1)
            second = greedy(
                model, seq, cache, pad_token_id=0, max_new_tokens=7, attention_mask=longer
            )
            outputs[name] = (first, second)
            if name == "shmkv":
                assert cache.attention_path == PATH[attn]
                cache.close()
        (want1, want2), (got1, got2) = outputs["dynamic"], outputs["shmkv"]
        assert_same_generation(got1, want1, ids.shape[1])
        assert_same_generation(got2, want2, want1.sequences.shape[1])
        assert client.stats()["referenced_blocks"] == 0


def test_right_padding_takes_the_dense_path(model_coord):
    """A mask that is not "left padding, then tokens" (here: right padding, by forward
    calls) falls back to dense K/V with transformers' own mask, even under "shmkv"."""
    model = build("qwen2")
    key = cache_argument(model)
    ids = torch.tensor([PROMPT_A[:12], PROMPT_B[:12]])
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    extra = torch.tensor([[PROMPT_A[12]], [PROMPT_B[12]]])
    longer = torch.cat([mask, torch.ones_like(extra)], 1)
    with shmkv.connect(model_coord(model).address, timeout=20) as client, torch.no_grad():
        dynamic = DynamicCache(config=model.config)
        want = [
            model(ids, attention_mask=mask, use_cache=True, **{key: dynamic}).logits,
            model(extra, attention_mask=longer, use_cache=True, **{key: dynamic}).logits,
        ]
        use_shmkv_attention(model)
        with ShmkvCache(client) as cache:
            got = [model(ids, attention_mask=mask, use_cache=True, **{key: cache}).logits]
            assert cache.attention_path == "dense"
            got.append(model(extra, attention_mask=longer, use_cache=True, **{key: cache}).logits)
            assert cache.attention_path == "dense"  # the stored padding stays masked
        torch.testing.assert_close(got[0][0], want[0][0], **TIGHT)
        torch.testing.assert_close(got[0][1, :9], want[0][1, :9], **TIGHT)
        torch.testing.assert_close(got[1], want[1], **TIGHT)
        assert client.stats()["referenced_blocks"] == 0


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
            with torch.enable_grad():  # the pool must stay out of any autograd graph
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
        lambda module, args, out: ran.append(args[0].shape[1])
    )
    try:
        with shmkv.connect(model_coord(model).address, timeout=20) as client:
            for ids, cached in [(PROMPT_A, 0), (PROMPT_B, 16), (PROMPT_C, 15)]:
                want = greedy(model, ids)
                ran.clear()
                with ShmkvCache.from_prompt(client, ids, model_config=model.config) as cache:
                    assert cache.num_cached_tokens == cached
                    got = greedy(model, ids, cache)
                    assert ran[0] == len(ids) - cached  # only the uncached part ran
                    assert_kv_equal(cache.handle, cache_of(want), cache.handle.num_tokens, REUSED)
                assert_same_generation(got, want, len(ids), REUSED)
            stats = client.stats()
            assert stats["prefix_hit_tokens"] == 16 + 16
            assert stats["cow_copies"] >= 1  # C's last token lands in a shared block
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


@pytest.mark.parametrize("layers", ["sliding", "hybrid"])
def test_sliding_window_models_are_refused(layers, model_coord):
    """Sliding-window layers (all of them, or some: a hybrid model) are refused, at
    construction with model_config=, and by the "shmkv" attention at the first forward."""
    window = dict(
        use_sliding_window=True, sliding_window=8, max_window_layers=0 if layers == "sliding" else 1
    )
    model = build("qwen2", attn="shmkv", **window)
    kinds = set(model.config.layer_types)
    assert ("full_attention" in kinds) == (layers == "hybrid")
    with shmkv.connect(model_coord(model).address, timeout=20) as client:
        with pytest.raises(
            shmkv.InvalidArgument,
            match="full-attention layers only.*sliding_attention.*DynamicCache",
        ):
            ShmkvCache(client, model_config=model.config)
        with (
            ShmkvCache(client) as cache,
            pytest.raises(shmkv.InvalidArgument, match="sliding_attention"),
        ):
            greedy(model, PROMPT_A, cache)
        assert client.stats()["referenced_blocks"] == 0


@pytest.mark.parametrize("attn", ATTN)
def test_prefix_reuse_for_a_batch_of_prompts(attn, model_coord):
    """``from_prompts``: each row of a left-padded batch reuses its own cached prefix; rows
    that hold more than the common start skip the writes they already have."""
    model = build("qwen2")
    ran = []
    hook = model.model.embed_tokens.register_forward_hook(
        lambda module, args, out: ran.append(args[0].shape[1])
    )
    batches = [
        [PROMPT_A, prompt(7, 11)],
        [PROMPT_B, PROMPT_C, prompt(8, 6)],
    ]  # B: 16 tokens of A cached, C: all 16
    try:
        with shmkv.connect(model_coord(model).address, timeout=20) as client:
            for prompts, tol in zip(batches, [TIGHT, REUSED]):
                ids, mask = left_pad(prompts)
                model.set_attn_implementation("sdpa")
                want = greedy(model, ids, attention_mask=mask, pad_token_id=0)
                model.set_attn_implementation(IMPL[attn])
                ran.clear()
                with ShmkvCache.from_prompts(
                    client, ids, attention_mask=mask, model_config=model.config, **CACHE[attn]
                ) as cache:
                    start = cache.num_cached_tokens
                    got = greedy(model, ids, cache, attention_mask=mask, pad_token_id=0)
                    assert ran[0] == ids.shape[1] - start  # only the uncached part ran
                    assert cache.attention_path == PATH[attn]
                    assert cache.left_padding == [ids.shape[1] - len(p) for p in prompts]
                    assert [h.num_tokens for h in cache.handles] == [
                        len(p) + NEW_TOKENS - 1 for p in prompts
                    ]
                assert_same_generation(got, want, ids.shape[1], tol)
            # A: 20 tokens (5 blocks) cached, B reuses 16 of them, C all 16 (it runs one).
            assert start == 16
            stats = client.stats()
            assert stats["prefix_hit_tokens"] == 16 + 16
            assert stats["referenced_blocks"] == 0
    finally:
        hook.remove()


def test_from_prompts_takes_left_padding_only(model_coord):
    model = build("llama")
    with shmkv.connect(model_coord(model).address, timeout=20) as client:
        ids, mask = left_pad([PROMPT_A, PROMPT_C])
        with pytest.raises(shmkv.InvalidArgument, match="left"):
            ShmkvCache.from_prompts(
                client, ids, attention_mask=mask.flip(1), model_config=model.config
            )
        with pytest.raises(shmkv.InvalidArgument, match="empty"):
            ShmkvCache.from_prompts(client, [PROMPT_A, []], model_config=model.config)
        assert client.stats()["referenced_blocks"] == 0


# -- positions, model identity and expansion of prompt caches -----------------------------------


def padded_prompts(seed: int) -> tuple:
    """A long prompt and a short one (left padded by 23 in the batch), by seed."""
    return prompt(100 + seed, 40), prompt(200 + seed, 17)


@pytest.mark.parametrize("attn", ATTN)
def test_padded_prefill_then_decode_equals_dynamic_cache(attn, model_coord):
    """prefill() numbers each row of a left-padded batch from its first token, as
    generate does: its logits and the decode that follows equal DynamicCache's on the
    padded batch (float32, tight)."""
    model = build("llama")
    long, short = padded_prompts(0)
    ids, mask = left_pad([long, short])
    want = greedy(model, ids, attention_mask=mask, pad_token_id=0)
    model.set_attn_implementation(IMPL[attn])
    with shmkv.connect(model_coord(model).address, timeout=20) as client:
        with ShmkvCache.from_prompts(
            client, ids, attention_mask=mask, model_config=model, **CACHE[attn]
        ) as cache:
            logits = prefill(model, cache, ids, mask)
            torch.testing.assert_close(logits, want.logits[0], **TIGHT)
            firsts = logits.argmax(-1).tolist()
            assert firsts == want.sequences[:, ids.shape[1]].tolist()
            ids2, mask2 = left_pad([long + firsts[:1], short + firsts[1:]])
            got = greedy(
                model,
                ids2,
                cache,
                attention_mask=mask2,
                pad_token_id=0,
                max_new_tokens=NEW_TOKENS - 1,
            )
            assert cache.attention_path == PATH[attn]
        assert (
            got.sequences[:, ids2.shape[1] :].tolist()
            == want.sequences[:, ids.shape[1] + 1 :].tolist()
        )
        for step, (a, b) in enumerate(zip(got.logits, want.logits[1:])):
            torch.testing.assert_close(a, b, **TIGHT, msg=lambda m, step=step: f"step {step}: {m}")
        assert client.stats()["referenced_blocks"] == 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_padded_prefill_does_not_poison_the_prefix_cache(seed, model_coord):
    """A left-padded batch prefilled and committed publishes each row's K/V at the row's
    own positions: a later unpadded request for the short prompt reuses its blocks and
    generates what DynamicCache generates."""
    model = build("llama", seed=seed, attn="shmkv")
    long, short = padded_prompts(seed)
    ids, mask = left_pad([long, short])
    with shmkv.connect(model_coord(model).address, timeout=20) as client:
        with ShmkvCache.from_prompts(client, ids, attention_mask=mask, model_config=model) as cache:
            prefill(model, cache, ids, mask)
            assert cache.left_padding == [0, len(long) - len(short)]
        model.set_attn_implementation("sdpa")
        want = greedy(model, short)
        with ShmkvCache.from_prompt(client, short, model_config=model) as cache:
            assert cache.num_cached_tokens == 16  # four blocks of the padded row
            got = greedy(model, short, cache)
        assert_same_generation(got, want, len(short), REUSED)
        assert client.stats()["referenced_blocks"] == 0


@pytest.mark.parametrize("attn", ATTN)
def test_forward_numbered_from_the_padding_leaves_the_row_unpublished(attn, model_coord):
    """A forward over a padded prompt cache without position_ids (transformers numbers
    the padded row from its padding) stores K/V that the row's prefix keys do not
    promise: commit publishes the unpadded row only, and a later request for the padded
    row's prompt reuses nothing and generates what DynamicCache generates."""
    model = build("llama", attn=IMPL[attn])
    long, short = padded_prompts(3)
    ids, mask = left_pad([long, short])
    key = cache_argument(model)
    with shmkv.connect(model_coord(model).address, timeout=20) as client:
        with (
            ShmkvCache.from_prompts(
                client, ids, attention_mask=mask, model_config=model, **CACHE[attn]
            ) as cache,
            torch.no_grad(),
        ):
            model(ids, attention_mask=mask, use_cache=True, **{key: cache})
            cache.commit()
        model.set_attn_implementation("sdpa")
        for tokens, cached in [(short, 0), (long, 39)]:
            want = greedy(model, tokens)
            with ShmkvCache.from_prompt(client, tokens, model_config=model) as cache:
                assert cache.num_cached_tokens == cached
                got = greedy(model, tokens, cache)
            assert_same_generation(got, want, len(tokens), REUSED)
        assert client.stats()["referenced_blocks"] == 0


def test_prefill_checks_its_mask(model_coord):
    model = build("llama")
    ids, mask = left_pad([PROMPT_A, PROMPT_C])
    with shmkv.connect(model_coord(model).address, timeout=20) as client:
        with ShmkvCache.from_prompts(client, ids, attention_mask=mask, model_config=model) as cache:
            with pytest.raises(shmkv.InvalidArgument, match="shape"):
                prefill(model, cache, ids, mask[:, 1:])
            assert cache.get_seq_length() == 0
        assert client.stats()["referenced_blocks"] == 0


@pytest.mark.parametrize("attn", ATTN)
@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2", "int8"])
@pytest.mark.parametrize("source", ["client", "from_prompts"])
def test_quantized_pool_with_left_padding(source, dtype, attn, model_coord):
    """A left-padded batch over a quantized pool, by generate over a cache made from a
    client (dense: padding stored) or from the prompts (padding not stored), on every
    path: within the stated tolerance of DynamicCache (float8 has no masked_fill)."""
    model = build("llama")
    ids, mask, _ = padded_batch()
    want = greedy(model, ids, attention_mask=mask, pad_token_id=0)
    model.set_attn_implementation(IMPL[attn])
    with shmkv.connect(
        model_coord(model, dtype=getattr(torch, dtype)).address, timeout=20
    ) as client:
        limit = 127.0 if dtype == "int8" else float(torch.finfo(getattr(torch, dtype)).max)
        for layer, cached in enumerate(cache_of(want).layers):
            client.set_kv_scales(
                layer,
                float(cached.keys.abs().max()) / limit,
                float(cached.values.abs().max()) / limit,
            )
        cache = (
            ShmkvCache(client, **CACHE[attn])
            if source == "client"
            else ShmkvCache.from_prompts(
                client, ids, attention_mask=mask, model_config=model, **CACHE[attn]
            )
        )
        with cache:
            got = greedy(model, ids, cache, attention_mask=mask, pad_token_id=0)
            assert cache.attention_path == PATH[attn]
            assert cache.handles[0].dtype == getattr(torch, dtype)
        # DynamicCache's logits along the tokens this run chose (a quantized cache may
        # flip a greedy near-tie, after which the two runs see other tokens)
        model.set_attn_implementation("sdpa")
        seq = got.sequences
        full_mask = torch.cat([mask, torch.ones_like(seq[:, ids.shape[1] :])], 1)
        with torch.no_grad():
            ref = model(
                seq, attention_mask=full_mask, position_ids=(full_mask.cumsum(-1) - 1).clamp(min=0)
            ).logits
        torch.testing.assert_close(ref[:, ids.shape[1] - 1], want.logits[0], **REUSED)
        for step, a in enumerate(got.logits):
            b = ref[:, ids.shape[1] - 1 + step]
            error = float((a - b).abs().max()) / float(b.abs().max())
            assert error <= QUANTIZED_TOL[dtype], f"step {step}: {error:.4f}"
        assert client.stats()["referenced_blocks"] == 0


def other_model(differs: str):
    """A model of llama's pool layout (2 layers, 2 K/V heads of 16) that is not
    ``build("llama")``: other weights under another name, another config field, another
    architecture, or the same weights in another dtype."""
    if differs == "weights":
        model = build("llama", seed=1)
        model.config.name_or_path = "test/llama-b"
        return model, "test/llama-a"
    if differs == "config":
        return build("llama", intermediate_size=96), None
    if differs == "model_type":
        return build("mistral", sliding_window=None), None
    return build("llama").to(torch.bfloat16), None


@pytest.mark.parametrize("differs", ["weights", "config", "model_type", "dtype"])
def test_two_models_of_one_layout_do_not_share_prefixes(differs, model_coord):
    """Prefix keys are namespaced by the model's identity: a second model on the same
    coordinator reuses none of the first one's K/V, each generates what DynamicCache
    does, and each hits its own prefixes."""
    first = build("llama")
    second, first_name = other_model(differs)
    if first_name is not None:
        first.config.name_or_path = first_name
    with shmkv.connect(model_coord(first).address, timeout=20) as client:
        for model, cached in [(first, 0), (second, 0), (first, 20), (second, 20)]:
            want = greedy(model, PROMPT_A)
            with ShmkvCache.from_prompt(client, PROMPT_A, model_config=model) as cache:
                assert cache.num_cached_tokens == cached
                got = greedy(model, PROMPT_A, cache)
            tol = REUSED if model.dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
            assert_same_generation(got, want, len(PROMPT_A), tol)
        assert client.stats()["prefix_hit_tokens"] == 40
        assert client.stats()["referenced_blocks"] == 0


def test_model_identity_and_salt(model_coord):
    """model_cache_salt: the model's identity, the caller's salt on top; from_prompts
    needs a model, and prefill refuses a cache made for another one."""
    model = build("llama")
    want = greedy(model, PROMPT_A)
    salt = model_cache_salt(model.config)
    assert salt == model_cache_salt(model) == model_cache_salt(build("llama", seed=5).config)
    assert len(salt) == 32
    assert model_cache_salt(model, b"tenant-1") not in (salt, model_cache_salt(model, b"t2"))
    model.set_attn_implementation("shmkv")  # how it attends is not who it is
    assert model_cache_salt(model) == salt
    with pytest.raises(shmkv.WrongType, match="cache_salt"):
        model_cache_salt(model, "tenant-1")
    with pytest.raises(shmkv.WrongType, match="model_config"):
        model_cache_salt({"model_type": "llama"})
    with shmkv.connect(model_coord(model).address, timeout=20) as client:
        with pytest.raises(shmkv.InvalidArgument, match="model_config=model"):
            ShmkvCache.from_prompt(client, PROMPT_A)
        # the salt is what from_prompts allocates with: a plain client request shares it
        with ShmkvCache.from_prompt(
            client, PROMPT_A, model_config=model, cache_salt=b"tenant-1"
        ) as cache:
            greedy(model, PROMPT_A, cache)
        with client.allocate(
            prompt=PROMPT_A, cache_salt=model_cache_salt(model, b"tenant-1")
        ) as handle:
            assert handle.num_cached_tokens == 20
            assert_kv_equal(handle, cache_of(want), 20, REUSED)
        with ShmkvCache.from_prompt(client, PROMPT_A, model_config=model) as cache:
            assert cache.num_cached_tokens == 0  # another tenant's
            other = build("llama", intermediate_size=96)
            with pytest.raises(shmkv.InvalidArgument, match="another model"):
                prefill(other, cache, torch.tensor(PROMPT_A))
            assert cache.get_seq_length() == 0
        assert client.stats()["referenced_blocks"] == 0


@pytest.mark.parametrize("attn", ATTN)
def test_from_prompts_with_num_return_sequences(attn, model_coord):
    """generate repeats every row of a prompt cache (three samples per prompt of a padded
    batch): the cache forks each row's sequence as often, and reuses the prefix."""
    model = build("qwen2")
    ids, mask, _ = padded_batch()
    kwargs = dict(
        attention_mask=mask,
        pad_token_id=0,
        do_sample=True,
        num_return_sequences=3,
        top_k=0,
        max_new_tokens=6,
    )
    torch.manual_seed(11)
    want = greedy(model, ids, **kwargs)
    model.set_attn_implementation(IMPL[attn])
    with shmkv.connect(model_coord(model).address, timeout=20) as client:
        with ShmkvCache.from_prompt(client, PROMPT_A, model_config=model) as cache:
            greedy(model, PROMPT_A, cache)  # PROMPT_A's 20 tokens cached
        with ShmkvCache.from_prompts(
            client, ids, attention_mask=mask, model_config=model, **CACHE[attn]
        ) as cache:
            assert cache.num_cached_tokens == 14 and len(cache.handles) == 2
            torch.manual_seed(11)
            got = greedy(model, ids, cache, **kwargs)
            assert len(cache.handles) == 6 and cache.attention_path == PATH[attn]
        assert_same_generation(got, want, ids.shape[1], REUSED)
        stats = client.stats()
        assert stats["ops_by_type"].get("fork", 0) >= 4
        assert stats["referenced_blocks"] == 0


@pytest.mark.parametrize("attn", ATTN)
def test_from_prompts_with_beam_search(attn, model_coord):
    """Beam search over a prompt cache: rows forked for the beams, reordered as beams
    win, the prompt's prefix reused."""
    model = build("qwen2")
    kwargs = dict(num_beams=3, num_return_sequences=2, max_new_tokens=6)
    want = greedy(model, PROMPT_B, **kwargs)
    model.set_attn_implementation(IMPL[attn])
    with shmkv.connect(model_coord(model).address, timeout=20) as client:
        with ShmkvCache.from_prompt(client, PROMPT_A, model_config=model) as cache:
            greedy(model, PROMPT_A, cache)
        with ShmkvCache.from_prompt(client, PROMPT_B, model_config=model, **CACHE[attn]) as cache:
            assert cache.num_cached_tokens == 16
            got = greedy(model, PROMPT_B, cache, **kwargs)
            assert len(cache.handles) == 3
        assert got.sequences.tolist() == want.sequences.tolist()
        stats = client.stats()
        assert stats["ops_by_type"].get("fork", 0) > 0 and stats["cow_copies"] > 0
        assert stats["referenced_blocks"] == 0
        # a batch that is no multiple of the cache's rows is refused, not expanded
        ids, mask = left_pad([PROMPT_A, PROMPT_C])
        with ShmkvCache.from_prompts(client, ids, attention_mask=mask, model_config=model) as cache:
            with pytest.raises(shmkv.InvalidArgument, match="holds 2 sequences.*batch of 3"):
                greedy(
                    model,
                    torch.cat([ids, ids[:1]]),
                    cache,
                    attention_mask=torch.cat([mask, mask[:1]]),
                    pad_token_id=0,
                )
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
                queue.put(
                    {
                        "kv": cache.handle if i == 0 else cache,
                        "first": int(logits.argmax(-1)),
                        "logits": logits[0].tolist(),
                        "cached": cache.num_cached_tokens,
                        "checksum": checksum(model),
                    }
                )
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
    child = SPAWN.Process(
        target=prefill_worker,
        args=(coord.address, "llama", prompts, queue, acks),
        name="prefill-worker",
    )
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
                torch.testing.assert_close(torch.tensor([item["logits"]]), want.logits[0], **REUSED)
                kv = item["kv"]
                cache = kv if isinstance(kv, ShmkvCache) else ShmkvCache(kv)
                handle = cache.handle
                assert handle.num_tokens == len(ids) and cache.get_seq_length() == len(ids)
                assert_kv_equal(handle, cache_of(want), len(ids), REUSED)
                got = greedy(model, ids + [item["first"]], cache, max_new_tokens=NEW_TOKENS - 1)
                assert (
                    got.sequences[0, len(ids) :].tolist() == want.sequences[0, len(ids) :].tolist()
                )
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

    args = argparse.Namespace(model="tiny", prompts=3, workers=1, decode_steps=4, dtype="float32")
    code = demo_model.main(args)
    out = capsys.readouterr().out
    assert code == 0, out
    assert "verified: all 12 generated tokens equal" in out
    assert "tokens/s" in out
    assert demo_model.main(argparse.Namespace(**{**vars(args), "model": "huge"})) == 2


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_demo_model_in_16_bits_passes_and_tells_a_near_tie_from_a_wrong_token(dtype, capsys):
    """In 16 bits the kernel rounds otherwise than SDPA: the demo passes, every prompt
    equal to DynamicCache's or parting at a near-tie; a token that is not one fails."""
    from shmkv.tools import demo_model

    args = argparse.Namespace(model="tiny", prompts=4, workers=1, decode_steps=6, dtype=dtype)
    assert demo_model.main(args) == 0, capsys.readouterr().out
    assert "verified: " in capsys.readouterr().out
    model = demo_model.build_model(dtype)
    tokens = demo_model.prompt_tokens(0)
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0, -1].float()
    best, worst = int(logits.argmax()), int(logits.argmin())
    margin, limit = demo_model.near_tie(model, tokens, best, best)
    assert margin == 0 and limit > 0
    margin, limit = demo_model.near_tie(model, tokens, worst, best)
    assert margin == pytest.approx(float(logits[best] - logits[worst])) and margin > limit


# -- a batch prefilled in DataLoader workers, decoded here ------------------------------------


class PrefillPrompts(torch.utils.data.Dataset):
    """Prompt i -> a hand-off token of its sequence, prefilled in a DataLoader worker,
    with the first greedy token and its logits."""

    def __init__(self, address: str, kind: str, prompts: list):
        self.address, self.kind, self.prompts = address, kind, prompts

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, index: int) -> dict:
        from shmkv.client.client import process_client

        model = build(self.kind, attn="shmkv")
        client = process_client(self.address, None, None)
        ids = self.prompts[index]
        with ShmkvCache(client, model_config=model.config) as cache:
            logits = prefill(model, cache, torch.tensor(ids))
            # Exported in this thread, then this worker's own reference is dropped: the
            # hand-off keeps the sequence until the main process opens it.
            token = cache.handle.export(ttl=120.0)
        return {
            "index": index,
            "token": token,
            "first": int(logits.argmax(-1)),
            "logits": logits[0].tolist(),
            "checksum": checksum(model),
        }


def test_batch_prefilled_in_dataloader_workers(model_coord):
    """Prompts of three lengths prefilled one each in spawned DataLoader workers, decoded
    here as one left-padded batch over the pool: equal to DynamicCache on the padded
    batch."""
    model = build("llama")
    prompts = [PROMPT_A, prompt(9, 14), prompt(10, 5)]
    ids, mask = left_pad(prompts)
    want = greedy(model, ids, attention_mask=mask, pad_token_id=0)
    use_shmkv_attention(model)
    coord = model_coord(model)
    loader = torch.utils.data.DataLoader(
        PrefillPrompts(coord.address, "llama", prompts),
        batch_size=None,
        num_workers=2,
        multiprocessing_context="spawn",
        timeout=120,
    )
    items = sorted(loader, key=lambda item: item["index"])
    del loader
    assert all(item["checksum"] == checksum(model) for item in items), "other weights"
    firsts = [item["first"] for item in items]
    assert firsts == want.sequences[:, ids.shape[1]].tolist()
    torch.testing.assert_close(
        torch.tensor([item["logits"] for item in items]), want.logits[0], **REUSED
    )
    with shmkv.connect(coord.address, timeout=20) as client:
        handles = [client.open(item["token"]) for item in items]
        with ShmkvCache(handles, padding_side="left") as cache:
            assert cache.get_seq_length() == ids.shape[1]
            assert cache.left_padding == [ids.shape[1] - len(p) for p in prompts]
            ids2, mask2 = left_pad([p + [f] for p, f in zip(prompts, firsts)])
            got = greedy(
                model,
                ids2,
                cache,
                attention_mask=mask2,
                pad_token_id=0,
                max_new_tokens=NEW_TOKENS - 1,
            )
            assert cache.attention_path == "paged"
        assert (
            got.sequences[:, ids2.shape[1] :].tolist()
            == want.sequences[:, ids.shape[1] + 1 :].tolist()
        )
        for a, b in zip(got.logits, want.logits[1:]):
            torch.testing.assert_close(a, b, **REUSED)
        client.close_many(handles)
        assert client.stats()["referenced_blocks"] == 0


# -- quantized pools -----------------------------------------------------------------------------

# A float8/int8 pool stores K/V divided by a per-layer scale; attention reads it back times
# the scale. The stated tolerance (docs/transformers.md): every step's logits stay within
# QUANTIZED_TOL[dtype] of DynamicCache's, relative to the largest logit magnitude.
QUANTIZED_TOL = {"float8_e4m3fn": 0.05, "float8_e5m2": 0.1, "int8": 0.02}


@pytest.mark.parametrize("attn", ATTN)
@pytest.mark.parametrize("dtype", sorted(QUANTIZED_TOL))
def test_quantized_pool_stays_within_the_stated_tolerance(dtype, attn, model_coord):
    model = build("llama")
    want = greedy(model, PROMPT_A)
    reference = cache_of(want)
    model.set_attn_implementation(IMPL[attn])
    with shmkv.connect(model_coord(model, dtype=dtype).address, timeout=20) as client:
        limit = 127.0 if dtype == "int8" else float(torch.finfo(getattr(torch, dtype)).max)
        for layer, cached in enumerate(reference.layers):  # calibrated from a real prefill
            client.set_kv_scales(
                layer,
                float(cached.keys.abs().max()) / limit,
                float(cached.values.abs().max()) / limit,
            )
        with ShmkvCache(client, model_config=model.config, **CACHE[attn]) as cache:
            got = greedy(model, PROMPT_A, cache)
            assert cache.attention_path == PATH[attn]
            assert cache.handle.dtype == getattr(torch, dtype)
            for step, (a, b) in enumerate(zip(got.logits, want.logits)):
                error = float((a - b).abs().max()) / float(b.abs().max())
                assert error <= QUANTIZED_TOL[dtype], f"step {step}: {error:.4f}"
            # the pool holds K/V to the dtype's precision, scaled back
            k_scale, v_scale = client.kv_scales(0)
            stored = cache.handle.key_cache(0)[: len(PROMPT_A)].float() * k_scale
            want_k = reference.layers[0].keys[0, :, : len(PROMPT_A)].transpose(0, 1)
            assert float((stored - want_k).abs().max()) <= 0.13 * float(want_k.abs().max())
