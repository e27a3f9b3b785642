"""``shmkv demo --model tiny``: a real (small, random) model, prefill in worker processes,
decoding in the main process, verified against transformers' own DynamicCache.

Starts an embedded coordinator with a CPU pool shaped for the model. A
``torch.utils.data.DataLoader`` with ``spawn`` worker processes is the prefill
stage: each worker builds the same model from its config and seed, runs its prompt
through it into a :class:`~shmkv.integrations.transformers.ShmkvCache` (prompts
share a system prefix, so most reuse blocks another prompt committed), and returns a
hand-off token of the sequence with the first generated token.
The main process decodes every prompt from its handle with ``model.generate``,
the model running ``attn_implementation="shmkv"`` (its layers attend over the pool
through the step's block tables), and checks the tokens against single-process
generation with ``DynamicCache`` (``"sdpa"``); it prints tokens per second for both.
In float16 and bfloat16 the native decode kernel sums attention in float32 and rounds
once where SDPA rounds otherwise, so greedy decoding may part at a near-tie: such a
prompt passes only where DynamicCache's own logits of the two tokens are within
``TIE_STEPS`` steps of the dtype (checked at the first differing token).
"""

from __future__ import annotations

import multiprocessing
import os
import time
import warnings
from typing import Any, Dict

import torch

SEED = 0
SYSTEM_PREFIX = 32  # tokens every prompt shares: two blocks of 16
BLOCK_SIZE = 16
MODEL: Dict[str, Any] = dict(  # LlamaConfig's keyword arguments
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)

_worker_model = None


def build_model(dtype: str, attn: str = "sdpa"):
    """The demo's Llama-style model (grouped-query attention: 8 query heads over 2 K/V
    heads), with weights drawn from a fixed seed, so every process builds the same.
    ``attn``: its attention implementation ("shmkv" registers with the integration)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from shmkv.integrations.transformers import register

    register()
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(LlamaConfig(**MODEL)).to(getattr(torch, dtype)).eval()
    model.set_attn_implementation(attn)
    return model


def checksum(model) -> float:
    """A sum over every weight: equal in two processes only for the same weights."""
    return float(sum(p.detach().double().sum() for p in model.parameters()))


def prompt_tokens(index: int, vocab: int = MODEL["vocab_size"]) -> list:
    """The shared system prefix, then a tail of this prompt's own tokens."""
    gen = torch.Generator().manual_seed(1000 + index)
    prefix = torch.randint(0, vocab, (SYSTEM_PREFIX,), generator=torch.Generator().manual_seed(7))
    tail = torch.randint(0, vocab, (8 + (index * 13) % 40,), generator=gen)
    return prefix.tolist() + tail.tolist()


class PrefillDataset(torch.utils.data.Dataset):
    """Prompt i -> a hand-off token of its sequence (K/V of the whole prompt written and
    committed), the first generated token, and what the worker saw."""

    def __init__(self, address: str, num_prompts: int, dtype: str):
        self.address = address
        self.num_prompts = num_prompts
        self.dtype = dtype

    def __len__(self) -> int:
        return self.num_prompts

    def __getitem__(self, index: int) -> dict:
        from shmkv.client.client import process_client
        from shmkv.integrations.transformers import ShmkvCache, prefill

        global _worker_model
        if _worker_model is None:
            _worker_model = build_model(self.dtype, attn="shmkv")
        model = _worker_model
        client = process_client(self.address, None, None)
        tokens = prompt_tokens(index)
        t0 = time.perf_counter()
        cache = ShmkvCache.from_prompt(client, tokens, model_config=model.config)
        logits = prefill(model, cache, torch.tensor(tokens))
        cache.commit()
        # Exported here, in the worker's main thread: a pickled handle would be exported
        # by the result queue's thread while this thread runs the next prompt on the same
        # client, and a client must not be used from two threads at once. This worker's
        # own reference goes when the worker exits.
        token = cache.handle.export(ttl=300.0)
        return {
            "index": index,
            "tokens": tokens,
            "token": token,
            "first": int(logits.argmax(-1)),
            "cached": cache.num_cached_tokens,
            "prefill_s": time.perf_counter() - t0,
            "checksum": checksum(model),
            "pid": os.getpid(),
        }


@torch.no_grad()
def reference(model, prompts: list, steps: int) -> tuple:
    """Greedy generation with DynamicCache, one prompt at a time: (tokens, decode
    seconds of each prompt). Prefill (the first token) is not timed, as in the shmkv
    flow."""
    from transformers import DynamicCache

    from shmkv.integrations.transformers import cache_argument

    key = cache_argument(model)
    outputs, decode_s = [], []
    for tokens in prompts:
        cache = DynamicCache(config=model.config)
        ids = torch.tensor([tokens])
        first = int(model(ids, use_cache=True, **{key: cache}).logits[0, -1].argmax())
        t0 = time.perf_counter()
        out = _continue(model, tokens + [first], {key: cache}, steps - 1)
        decode_s.append(time.perf_counter() - t0)
        outputs.append([first] + out)
    return outputs, decode_s


def _continue(model, tokens: list, cache_kwargs: dict, steps: int) -> list:
    ids = torch.tensor([tokens])
    if steps <= 0:
        return []
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=steps,
        do_sample=False,
        **cache_kwargs,
    )
    return out[0, len(tokens) :].tolist()


# Two tokens whose logits lie within this many float16 / bfloat16 steps of the largest
# logit are a near-tie: the native kernel sums attention in float32 and rounds once,
# SDPA in those dtypes rounds otherwise, and greedy decoding may then pick either.
TIE_STEPS = 8


@torch.no_grad()
def near_tie(model, tokens: list, ours: int, theirs: int) -> tuple:
    """(how far DynamicCache's logit of ``theirs`` lies above that of ``ours`` after
    ``tokens``, the most a near-tie may be) in the model's dtype."""
    logits = model(torch.tensor([tokens])).logits[0, -1].float()
    limit = TIE_STEPS * torch.finfo(model.dtype).eps * float(logits.abs().max())
    return float(logits[theirs] - logits[ours]), limit


def _rate(num_tokens: int, seconds: list) -> float:
    median = sorted(seconds)[len(seconds) // 2]
    return num_tokens / median if num_tokens and median > 0 else 0.0


def run(
    num_prompts: int = 8,
    workers: int = 2,
    decode_steps: int = 16,
    dtype: str = "float32",
    say=print,
) -> dict:
    """Run the demo; returns its summary. Raises AssertionError when anything differs
    from single-process generation or is left behind."""
    from shmkv import Coordinator, connect
    from shmkv.integrations.transformers import ShmkvCache, cache_argument, pool_config

    if num_prompts < 1 or decode_steps < 1 or workers < 1:
        raise ValueError("--prompts, --decode-steps and --workers must be at least 1")
    model = build_model(dtype)
    others = set(multiprocessing.active_children())  # the caller's: not the demo's to check
    prompts = [prompt_tokens(i) for i in range(num_prompts)]
    blocks = sum(-(-(len(p) + decode_steps) // BLOCK_SIZE) for p in prompts) + 16
    cfg = pool_config(model.config, num_blocks=blocks, block_size=BLOCK_SIZE, dtype=dtype)
    text = model.config
    say(
        f"model: Llama-style, {text.num_hidden_layers} layers, {text.num_attention_heads} query "
        f"heads over {text.num_key_value_heads} K/V heads, vocab {text.vocab_size}, {dtype}, "
        f"random weights (seed {SEED})"
    )

    want, ref_decode_s = reference(model, prompts, decode_steps)
    num_decoded = num_prompts * (decode_steps - 1)

    started = time.perf_counter()
    with (
        Coordinator(cfg, name=f"demo-model-{os.getpid()}") as coord,
        connect(coord.address) as client,
    ):
        say(
            f"coordinator at {coord.address}: {cfg.num_blocks} blocks x {cfg.block_size} tokens, "
            f"{cfg.nbytes / 2**20:.1f} MiB shared"
        )
        with warnings.catch_warnings():  # more workers than cores is fine here
            warnings.filterwarnings("ignore", message=".*worker processes in total.*")
            loader = torch.utils.data.DataLoader(
                PrefillDataset(coord.address, num_prompts, dtype),
                batch_size=None,
                num_workers=workers,
                multiprocessing_context="spawn",
                timeout=120,
            )
            items = sorted(loader, key=lambda item: item["index"])
        del loader
        prefill_s = time.perf_counter() - started
        ours = checksum(model)
        assert all(item["checksum"] == ours for item in items), (
            "a worker built other weights than the main process"
        )
        cached = sum(item["cached"] for item in items)
        say(
            f"prefill: {num_prompts} prompts, {sum(map(len, prompts))} tokens, in "
            f"{len({item['pid'] for item in items})} spawned DataLoader worker processes, "
            f"{cached} tokens reused from the prefix cache, {prefill_s:.2f} s"
        )

        key = cache_argument(model)
        model.set_attn_implementation("shmkv")
        got, decode_s = [], []
        for item in items:
            handle = client.open(item["token"])
            with torch.no_grad(), ShmkvCache(handle) as cache:
                t0 = time.perf_counter()
                out = _continue(
                    model, item["tokens"] + [item["first"]], {key: cache}, decode_steps - 1
                )
                decode_s.append(time.perf_counter() - t0)
                assert decode_steps < 2 or cache.attention_path == "paged", (
                    f"decoding took the {cache.attention_path} path, not the paged one"
                )
            handle.close()
            got.append([item["first"]] + out)
        stats = client.stats()
        assert stats["referenced_blocks"] == 0, f"blocks still referenced: {stats}"
    workers_left = [p for p in multiprocessing.active_children() if p not in others]
    for proc in workers_left:
        proc.join(10)
    assert not [p for p in workers_left if p.is_alive()], "worker processes outlived the demo"
    leftovers = [n for n in os.listdir("/dev/shm") if n.startswith(f"shmkv-{os.getpid()}-")]
    assert not leftovers, f"left in /dev/shm: {leftovers}"
    assert not os.path.exists(coord.address), "socket file left behind"

    model.set_attn_implementation("sdpa")
    ties = []
    for i, (a, b) in enumerate(zip(got, want)):
        if a == b:
            continue
        step = next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)
        margin, limit = near_tie(model, prompts[i] + b[:step], a[step], b[step])
        assert margin <= limit, (
            f"prompt {i} generated other tokens than with DynamicCache: {a} != {b}; at "
            f"token {step} DynamicCache's logit of its token is {margin:.3g} above ours "
            f"(a near-tie in {dtype} is within {limit:.3g})"
        )
        ties.append(i)
    summary = {
        "prompts": num_prompts,
        "tokens_generated": num_prompts * decode_steps,
        "near_ties": len(ties),
        "prefix_cached_tokens": cached,
        "prefill_s": prefill_s,
        "shmkv_decode_tok_s": _rate(decode_steps - 1, decode_s),
        "dynamic_decode_tok_s": _rate(decode_steps - 1, ref_decode_s),
    }
    say(
        f"decode: {num_decoded} tokens ({decode_steps - 1} per prompt after the worker's first), "
        f"one sequence at a time; tokens/s of the median prompt"
    )
    say(
        f"  shmkv pool, decoded here from handed-over prefill ('shmkv' attention over the "
        f"pool): {summary['shmkv_decode_tok_s']:.1f} tokens/s"
    )
    say(
        f"  DynamicCache, one process ('sdpa'):                                             "
        f"{summary['dynamic_decode_tok_s']:.1f} tokens/s"
    )
    if ties:
        say(
            f"verified: {num_prompts - len(ties)} of {num_prompts} prompts' tokens equal "
            f"generation with DynamicCache in one process; prompts {ties} part from it at a "
            f"near-tie (its two top logits within {TIE_STEPS} {dtype} steps), checked"
        )
    else:
        say(
            f"verified: all {num_prompts * decode_steps} generated tokens equal generation "
            "with DynamicCache in one process"
        )
    say("nothing left in /dev/shm, no worker process left, socket removed: OK")
    return summary


def main(args) -> int:
    """Entry point of ``shmkv demo --model tiny``; returns the exit code (0 only when
    every token was verified and nothing was left behind)."""
    if args.model != "tiny":
        print(f"shmkv demo: unknown model {args.model!r}; the one available is 'tiny'", flush=True)
        return 2
    try:
        import transformers  # noqa: F401
    except ImportError:
        print(
            "shmkv demo --model: needs transformers (pip install 'shmkv[transformers]')", flush=True
        )
        return 2
    from shmkv.memory.layout import dtype_name

    def say(*a):
        print(*a, flush=True)

    try:
        dtype = dtype_name(args.dtype or "float32")
        run(
            num_prompts=args.prompts,
            workers=args.workers,
            decode_steps=args.decode_steps,
            dtype=dtype,
            say=say,
        )
    except ValueError as exc:
        print(f"shmkv demo: {exc}", flush=True)
        return 2
    except AssertionError as exc:
        print(f"shmkv demo: FAILED: {exc}", flush=True)
        return 1
    return 0
