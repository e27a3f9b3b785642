"""What the vLLM connector's prefix keys stand for: the identity of an engine's K/V bytes.

A prefix key stands for bytes an engine would compute, so it changes with everything
that changes those bytes and with nothing else (docs/vllm.md, "Keys"). This module owns
that rule for :mod:`shmkv.integrations.vllm`: the 32-byte *namespace* of an engine
(:func:`model_identity`, :func:`model_namespace`) and the per-request ``cache_salt`` of
shmkv's prefix keys (:func:`request_salt`). It does not own the keys themselves
(:mod:`shmkv.hashing` chains them from token ids under the salt) nor any I/O but reading
a few bytes of a checkpoint's or adapter's files. It imports no vLLM: configs and
requests are read by attribute.

The namespace is a digest of:

* **the checkpoint's content**, not its path (:func:`checkpoint_identity`): for a local
  directory (or a hub id whose snapshot is in the local Hugging Face cache), a digest of
  its configs and custom code (``*.json``, ``*.py``) and weight files, each by name, size
  and a bounded sample of its bytes (:func:`file_digest`); else the hub commit; else,
  with a warning, the name and revision. ``"shmkv.model_id"`` replaces this part, and
  only this part, with the operator's string;
* **the effective model config**: vLLM's ``hf_config`` after ``hf_overrides`` (RoPE
  scaling, sliding window, quantization config...), less the fields that name a path or
  a library version; with vLLM's own ``dtype``, ``quantization``,
  ``override_attention_dtype``, ``disable_sliding_window``, multimodal processor
  arguments, and dummy weights when ``load_format="dummy"``;
* **the KV cache's dtype** (and ``calculate_kv_scales`` where vLLM has it);
* ``"shmkv.salt"``.

Left out on purpose, because they do not change the bytes of a position's K/V:
``max_model_len``, the block size, the parallel layout (shmkv maps TP ranks onto its
head shards), the attention backend (the connector translates layouts), the tokenizer
(keys are token ids), and the load format other than dummy weights. Attention sinks are
weights and config fields, so the two parts above cover them.

A request's salt adds, to the namespace: its LoRA adapter's content
(:func:`lora_digest`, cached per adapter), its multimodal inputs (each one's identifier,
modality and placeholder range) and its prompt embeddings (their bytes, shape, dtype and
which positions they fill), and its ``cache_salt``. shmkv chains a sequence's block keys
from one salt, and the same chain is what tiers, the shared store and moves between
nodes recompute from the token ids; there is no per-block extra key. So multimodal
inputs and embeddings salt the whole request: two requests share K/V only when all of
those are equal, a conservative rule (a text prefix before an image is not shared with
a request that has another image) that never hands one request another's bytes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import threading
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from shmkv.errors import InvalidArgument

log = logging.getLogger("shmkv.vllm")

IDENTITY_VERSION = "shmkv.integrations.vllm model v2"
# The checkpoint's files that enter its content digest: configs, weight indices,
# processor configs, custom modeling code, and weights.
CONFIG_SUFFIXES = (".json", ".py")
WEIGHT_SUFFIXES = (
    ".safetensors",
    ".bin",
    ".pt",
    ".pth",
    ".ckpt",
    ".gguf",
    ".msgpack",
    ".h5",
    ".npz",
    ".tensors",
)
SAMPLE_BYTES = 1 << 20  # read from each end of a large file
NUM_MIDDLE_SAMPLES = 16  # and this many pieces of MIDDLE_SAMPLE_BYTES spread between them
MIDDLE_SAMPLE_BYTES = 64 << 10
SAFETENSORS_HEADER_MAX = 100 << 20  # the format's own limit on its JSON header
# hf_config fields that name where a config came from, not what it says
_PATH_FIELDS = frozenset({"transformers_version"})
_COMMIT = re.compile(r"[0-9a-f]{40}")


# -- files ----------------------------------------------------------------------------------


def file_digest(path: str) -> str:
    """A digest of one file's content that costs a bounded read however large it is: the
    size and, for a file of up to ``2 * SAMPLE_BYTES``, every byte; for a larger one the
    first and last ``SAMPLE_BYTES``, ``NUM_MIDDLE_SAMPLES`` pieces spread between them,
    and a safetensors file's whole header (tensor names, dtypes, shapes, offsets). A
    change that touches none of those bytes and keeps the size goes unnoticed: pin
    ``"shmkv.model_id"`` for checkpoints edited in place that way.

    Raises:
        OSError: the file cannot be read.
    """
    digest = hashlib.blake2b(b"shmkv file\0", digest_size=32)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        digest.update(size.to_bytes(8, "little"))
        if size <= 2 * SAMPLE_BYTES:
            digest.update(f.read())
            return digest.hexdigest()
        head = f.read(SAMPLE_BYTES)
        digest.update(head)
        if path.endswith(".safetensors") and len(head) >= 8:
            length = int.from_bytes(head[:8], "little")
            if SAMPLE_BYTES - 8 < length <= SAFETENSORS_HEADER_MAX:
                f.seek(SAMPLE_BYTES)
                digest.update(f.read(length + 8 - SAMPLE_BYTES))
        span = size - 2 * SAMPLE_BYTES - MIDDLE_SAMPLE_BYTES
        for i in range(NUM_MIDDLE_SAMPLES):
            f.seek(SAMPLE_BYTES + span * (i + 1) // (NUM_MIDDLE_SAMPLES + 1))
            digest.update(f.read(MIDDLE_SAMPLE_BYTES))
        f.seek(size - SAMPLE_BYTES)
        digest.update(f.read(SAMPLE_BYTES))
    return digest.hexdigest()


def _counts(name: str) -> bool:
    return not name.startswith(".") and name.endswith(CONFIG_SUFFIXES + WEIGHT_SUFFIXES)


def directory_digest(path: str) -> str:
    """The content digest of a checkpoint or adapter directory: the :func:`file_digest`
    of each of its top-level files that holds configs, code or weights (by suffix: see
    ``CONFIG_SUFFIXES``, ``WEIGHT_SUFFIXES``), by name. Symbolic links are followed (a
    Hugging Face snapshot is links into its blobs); other files (READMEs, licences,
    hidden files) do not count, so two copies of one checkpoint agree.

    Raises:
        OSError: the directory or one of its files cannot be read.
    """
    files = {}
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        if _counts(name) and os.path.isfile(full):
            files[name] = file_digest(full)
    if not files:
        raise OSError(f"{path} holds no config or weight files")
    return _digest("dir", files)


def _digest(tag: str, value: Any) -> str:
    data = json.dumps(value, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.blake2b(f"shmkv {tag}\0".encode() + data, digest_size=32).hexdigest()


def local_snapshot(name: str, revision: Optional[str] = None) -> Optional[str]:
    """The local directory of checkpoint or adapter ``name``: itself when it is one, else
    its snapshot in the local Hugging Face cache (never downloaded here); None when
    neither is there."""
    if os.path.isdir(name):
        return name
    if os.path.isabs(name) or name.startswith("."):
        return None
    try:
        from huggingface_hub import snapshot_download

        found = snapshot_download(name, revision=revision, local_files_only=True)
    except Exception:  # noqa: BLE001 - not a hub id, or not in the cache: not local
        return None
    return found if os.path.isdir(found) else None


def checkpoint_identity(model: str, revision: Optional[str] = None) -> Dict[str, str]:
    """What identifies the bytes of checkpoint ``model`` (a path or a hub id) at
    ``revision``, whatever path it was loaded from: ``{"content": digest}`` for local
    files (a directory: :func:`directory_digest`; one file, such as a GGUF:
    :func:`file_digest`); ``{"commit": sha}`` for a hub checkpoint whose files are not
    here but whose revision is a commit; else ``{"name": ..., "revision": ...}``, logged
    as a warning (its content may change under the same name: set
    ``"shmkv.model_id"``)."""
    why = "its files are not here"
    try:
        if os.path.isfile(model):
            return {"content": file_digest(model)}
        local = local_snapshot(model, revision)
        if local is not None:
            return {"content": directory_digest(local)}
    except OSError as exc:
        why = str(exc)
    if revision and _COMMIT.fullmatch(revision):
        return {"commit": revision}
    log.warning(
        "shmkv: the content of checkpoint %r (revision %s) cannot be read (%s); its K/V "
        "is keyed by name and revision, which do not change when its weights do: set "
        '"shmkv.model_id" to pin an identity',
        model,
        revision,
        why,
    )
    return {"name": str(model), "revision": str(revision)}


# -- the model's namespace ------------------------------------------------------------------


def _plain_config(value: Any) -> Any:
    """A JSON value of a config dict, without the fields that name a path or a library
    version (keys starting with ``_`` such as ``_name_or_path``, and
    ``transformers_version``), nested configs included. Values JSON cannot hold become
    their ``to_dict()`` or their ``str`` (dtypes and the like; an object whose ``str``
    differs from process to process only keeps engines from sharing)."""
    if isinstance(value, dict):
        return {
            str(k): _plain_config(v)
            for k, v in value.items()
            if not str(k).startswith("_") and k not in _PATH_FIELDS
        }
    if isinstance(value, (list, tuple)):
        return [_plain_config(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    to_dict = getattr(value, "to_dict", None)
    if callable(to_dict):
        return _plain_config(to_dict())
    return str(value)


def effective_config(model_config) -> Dict[str, Any]:
    """The parts of vLLM's ``ModelConfig`` that change K/V bytes (see the module
    docstring), as plain JSON values: ``hf_config`` after overrides, less path and
    version fields, and vLLM's own dtype, quantization and attention settings."""
    mm = getattr(model_config, "multimodal_config", None)
    return {
        "hf_config": _plain_config(model_config.hf_config.to_dict()),
        "dtype": str(model_config.dtype),
        "quantization": _plain_config(getattr(model_config, "quantization", None)),
        "override_attention_dtype": _plain_config(
            getattr(model_config, "override_attention_dtype", None)
        ),
        "disable_sliding_window": bool(getattr(model_config, "disable_sliding_window", False)),
        "mm_processor_kwargs": _plain_config(getattr(mm, "mm_processor_kwargs", None)),
    }


@dataclass(frozen=True)
class ModelIdentity:
    """An engine's namespace (``namespace``: 32 bytes) and what went into it
    (``inputs``: plain JSON values), from :func:`model_identity`."""

    namespace: bytes
    inputs: Dict[str, Any]

    def describe(self) -> str:
        """One line for the log: the namespace's hex prefix and a summary of its inputs
        (digests shortened; the salt only as set or not)."""
        inputs = self.inputs
        checkpoint = ", ".join(
            f"{k} {v[:16] if k == 'content' else v}" for k, v in inputs["checkpoint"].items()
        )
        config = inputs["config"]
        hf = config["hf_config"]
        rope = hf.get("rope_parameters", hf.get("rope_scaling"))
        return (
            f"{self.namespace.hex()[:16]} (checkpoint: {checkpoint}; config "
            f"{_digest('config', config)[:16]}: {hf.get('model_type')}, dtype "
            f"{config['dtype']}, quantization {config['quantization']}, rope {rope}; "
            f"kv cache dtype {inputs['kv_cache_dtype']}; "
            f"shmkv.salt {'set' if inputs['salt'] else 'none'})"
        )


def model_identity(vllm_config, salt: str = "", model_id: Optional[str] = None) -> ModelIdentity:
    """The namespace of this engine's prefix keys and what went into it (see the module
    docstring): the checkpoint's content identity, or ``model_id`` (the connector's
    ``"shmkv.model_id"``) in its place; the effective model config; the KV cache dtype;
    and ``salt`` (``"shmkv.salt"``). Engines share K/V exactly when these agree.

    Raises:
        InvalidArgument: ``model_id`` or ``salt`` is not a string (or ``model_id`` is
            empty).
    """
    mc, cc = vllm_config.model_config, vllm_config.cache_config
    if not isinstance(salt, str):
        raise InvalidArgument(f'"shmkv.salt" must be a string, got {salt!r}')
    if model_id is not None:
        if not isinstance(model_id, str) or not model_id:
            raise InvalidArgument(f'"shmkv.model_id" must be a non-empty string, got {model_id!r}')
        checkpoint = {"model_id": model_id}
    else:
        checkpoint = checkpoint_identity(str(mc.model), mc.revision)
    config = effective_config(mc)
    load = getattr(vllm_config, "load_config", None)
    if str(getattr(load, "load_format", "")) == "dummy":  # random weights, not the files'
        config["dummy_weights_seed"] = getattr(mc, "seed", None)
    inputs = {
        "checkpoint": checkpoint,
        "config": config,
        "kv_cache_dtype": str(cc.cache_dtype),
        "calculate_kv_scales": bool(getattr(cc, "calculate_kv_scales", False)),
        "salt": salt,
    }
    digest = hashlib.blake2b(IDENTITY_VERSION.encode() + b"\0", digest_size=32)
    digest.update(json.dumps(inputs, sort_keys=True, separators=(",", ":")).encode())
    return ModelIdentity(digest.digest(), inputs)


def model_namespace(vllm_config, salt: str = "", model_id: Optional[str] = None) -> bytes:
    """The 32-byte namespace every prefix key of this engine lives under:
    :func:`model_identity`'s ``namespace``. Engines of another checkpoint, config, dtype,
    KV cache dtype or salt never share bytes; the same checkpoint at two paths does."""
    return model_identity(vllm_config, salt, model_id).namespace


# -- a request's salt -----------------------------------------------------------------------

_LORA_CACHE_MAX = 1024
_lora_digests: Dict[Tuple[int, str], str] = {}
_lora_lock = threading.Lock()


def lora_digest(lora_request) -> Optional[str]:
    """The content digest of ``lora_request``'s adapter (:func:`directory_digest` of its
    ``lora_path``, a directory or a hub id in the local cache), computed once per
    adapter (id and path, as vLLM loads it) and kept; None when its files cannot be read
    here (the request is then not cached: nothing says what its K/V was computed with).
    Files replaced under a running engine are not noticed, as vLLM does not reload an
    adapter it holds: give a new adapter a new id or path."""
    key = (int(getattr(lora_request, "lora_int_id", 0)), str(lora_request.lora_path))
    with _lora_lock:
        found = _lora_digests.get(key)
    if found is not None:
        return found
    local = local_snapshot(key[1]) if key[1] else None
    if local is None:
        return None
    try:
        found = directory_digest(local)
    except OSError as exc:
        log.warning("shmkv: LoRA adapter at %s cannot be read (%s); not cached", key[1], exc)
        return None
    with _lora_lock:
        if len(_lora_digests) >= _LORA_CACHE_MAX:
            _lora_digests.pop(next(iter(_lora_digests)))
        _lora_digests[key] = found
    return found


def _tensor_bytes(tensor):
    """The bytes of ``tensor`` as a buffer (no copy of a contiguous CPU tensor)."""
    import torch

    t = tensor.detach().to("cpu").contiguous()
    return t.view(torch.uint8).numpy() if t.numel() else b""


def _mm_inputs(request) -> List[list]:
    """Each multimodal input of ``request``: modality, identifier (vLLM's hash of its
    content) and placeholder offset and length."""
    out = []
    for feature in getattr(request, "mm_features", None) or ():
        pos = feature.mm_position
        out.append([str(feature.modality), str(feature.identifier), pos.offset, pos.length])
    return out


def request_salt(namespace: bytes, request) -> Optional[bytes]:
    """The ``cache_salt`` of one request's prefix keys: the model ``namespace``, the
    request's LoRA adapter's content, its multimodal inputs (identifier, modality,
    position), its prompt embeddings (bytes, dtype, shape and, for a prompt that mixes
    them with token ids, which positions they fill) and its ``cache_salt``. None when
    the request's adapter cannot be identified (:func:`lora_digest`): do not look it up
    or save it."""
    digest = hashlib.blake2b(namespace, digest_size=32)
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        content = lora_digest(lora)
        if content is None:
            return None
        digest.update(b"\0lora\0" + content.encode())
    mm = _mm_inputs(request)
    if mm:
        digest.update(b"\0mm\0" + json.dumps(mm).encode())
    embeds = getattr(request, "prompt_embeds", None)
    if embeds is not None:
        mask = getattr(request, "prompt_is_token_ids", None)
        head = [str(embeds.dtype), list(embeds.shape), mask is not None]
        digest.update(b"\0embeds\0" + json.dumps(head).encode() + b"\0")
        if mask is not None:  # one byte a position: 1 for a token id, 0 for an embedding
            digest.update(bytes(bytearray(map(bool, mask))))
        digest.update(_tensor_bytes(embeds))
    salt = getattr(request, "cache_salt", None)
    if salt:
        digest.update(b"\0salt\0" + str(salt).encode())
    return digest.digest()


def key_tokens(request) -> List[int]:
    """The token ids ``request``'s prefix keys hash: its prompt's, or, for a prompt made
    of embeddings alone, one 0 per position (as vLLM's own token list has them; the
    embeddings are in :func:`request_salt`)."""
    ids = getattr(request, "prompt_token_ids", None)
    if ids is not None:
        return list(ids)
    if getattr(request, "prompt_embeds", None) is not None:
        return [0] * len(request.prompt_embeds)
    return []
