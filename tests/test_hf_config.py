"""``plain_layout`` (``shmkv serve --for-model`` without transformers) against
transformers' own reading of the same config.json files (``AutoConfig`` and
``kv_layout``): for every plain family config it reads, the same layers, K/V heads, head
size and dtype; for any other config, None (the child process reads those)."""

from __future__ import annotations

import json

import pytest

from shmkv.integrations.hf_config import kv_layout, plain_layout

transformers = pytest.importorskip("transformers")

PLAIN = {
    "llama, grouped K/V heads": dict(
        model_type="llama", num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
        hidden_size=256, torch_dtype="bfloat16",
    ),
    "llama, K/V heads unset (as many as the heads)": dict(
        model_type="llama", num_hidden_layers=2, num_attention_heads=4, hidden_size=128,
    ),
    "qwen3, its own head size": dict(
        model_type="qwen3", num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=8,
        hidden_size=1024, head_dim=128, dtype="float16",
    ),
    "mistral, head size null": dict(
        model_type="mistral", num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
        hidden_size=512, head_dim=None, torch_dtype="float32",
    ),
}  # fmt: skip

NOT_PLAIN = {
    "gpt2 (its own field names)": dict(model_type="gpt2", n_layer=2, n_head=4, n_embd=128),
    "llava (a text_config)": dict(
        model_type="llava", text_config=dict(model_type="llama", num_hidden_layers=2)
    ),
    "llama without its layers": dict(model_type="llama", num_attention_heads=4, hidden_size=64),
    "llama with a layer count that is no int": dict(
        model_type="llama", num_hidden_layers="2", num_attention_heads=4, hidden_size=64
    ),
}


def write(tmp_path, name: str, cfg) -> str:
    path = tmp_path / name.split()[0].strip(",")
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(cfg if isinstance(cfg, str) else json.dumps(cfg))
    return str(path)


@pytest.mark.parametrize("case", sorted(PLAIN))
def test_a_plain_config_reads_as_transformers_reads_it(tmp_path, case):
    path = write(tmp_path, case, PLAIN[case])
    want = kv_layout(transformers.AutoConfig.from_pretrained(path))
    dtype = str(want.dtype or "float32").replace("torch.", "")
    assert plain_layout(path) == {
        "num_layers": want.num_layers,
        "num_kv_heads": want.num_kv_heads,
        "head_dim": want.head_dim,
        "dtype": dtype,
    }


@pytest.mark.parametrize("case", sorted(NOT_PLAIN))
def test_any_other_config_is_left_to_transformers(tmp_path, case):
    assert plain_layout(write(tmp_path, case, NOT_PLAIN[case])) is None


def test_no_config_or_a_damaged_one_is_left_to_transformers(tmp_path):
    assert plain_layout(str(tmp_path)) is None  # (no config.json)
    assert plain_layout(write(tmp_path, "damaged", '{"model_type": "llama", ')) is None
    assert plain_layout(write(tmp_path, "list", "[1, 2]")) is None


def test_serve_for_model_reads_other_configs_through_transformers(tmp_path):
    """A config plain_layout leaves alone is read by transformers in a child process."""
    from shmkv.tools.cli import _config, build_parser, for_model

    path = write(tmp_path, "gpt2", NOT_PLAIN["gpt2 (its own field names)"])
    args = build_parser().parse_args(["serve", "--for-model", path])
    for_model(args)
    cfg = _config(args)
    assert (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.dtype) == (2, 4, 32, "bfloat16")
