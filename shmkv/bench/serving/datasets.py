"""The serving suite's prompts: the word-level tokenizer saved beside the model, the chat
trace's turns, the Zipf-skewed prefixes, and the ``vllm bench serve`` arguments of each
dataset.
"""

from __future__ import annotations

import json
import os
import random
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from shmkv.bench.core import (
    trace_path,
)

SPECIAL = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2 of the tokenizer


def word(token: int) -> str:
    """The tokenizer's word for token id ``token`` (``w17``; the special tokens apart: a
    special token's text is matched anywhere in a word, so ``w1`` would split ``w17``)."""
    return SPECIAL[token] if token < len(SPECIAL) else f"w{token}"


def words(tokens: Iterable[int]) -> str:
    """Token ids as text that the tokenizer maps back to exactly these ids."""
    return " ".join(word(t) for t in tokens)


def save_tokenizer(path: str, vocab: int) -> None:
    """A word-level tokenizer of ``vocab`` words (:func:`word`; split at spaces),
    saved as ``tokenizer.json`` with a ``PreTrainedTokenizerFast`` config beside the model
    at ``path``: decoding then encoding any ids gives them back, so that vLLM's random and
    prefix datasets keep their exact lengths and shared prefixes stay shared."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab_map = {word(i): i for i in range(vocab)}
    tok = Tokenizer(models.WordLevel(vocab=vocab_map, unk_token=word(0)))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token=word(0), bos_token=word(1), eos_token=word(2)
    ).save_pretrained(path)


FIRST_WORD = len(SPECIAL)  # the generated prompts use no special token


def chat_dataset(
    header: dict, turns: Sequence[dict], sessions: int, vocab: int, seed: int, out: int
) -> List[dict]:
    """The chat trace's turns of sessions ``0 .. sessions-1``, in trace order, as
    ``custom`` dataset lines: each prompt is the system prompt, then the session's earlier
    turns (user message and the recorded reply), then the turn's user message. The
    trace's token ids are mapped to words of the model's vocabulary through a random map
    drawn from ``seed`` (one map for the whole run, so prefixes shared in the trace stay
    shared; another seed, other prompts)."""
    rng = random.Random(seed)
    table: Dict[int, int] = {}

    def remap(ids: Sequence[int]) -> List[int]:
        return [table.setdefault(t, rng.randrange(FIRST_WORD, vocab)) for t in ids]

    system = remap(header["system"])
    history: Dict[int, List[int]] = {}
    lines = []
    for turn in turns:
        s = turn["session"]
        if s >= sessions:
            continue
        context = history.setdefault(s, list(system))
        prompt = context + remap(turn["user"])
        lines.append({"prompt": words(prompt), "output_tokens": out, "session": s})
        history[s] = prompt + remap(turn["reply"])
    return lines


def zipf_dataset(
    requests: int,
    num_prefixes: int,
    prefix_len: int,
    suffix_len: int,
    s: float,
    vocab: int,
    seed: int,
    out: int,
) -> List[dict]:
    """``requests`` prompts, each a prefix then ``suffix_len`` fresh tokens; the prefix of
    each request drawn at random with weight ``1 / rank**s`` (Zipf), so that the first
    prefix is most requests at ``s`` = 2 over 8 prefixes (65 % of them)."""
    rng = random.Random(seed)
    prefixes = [
        [rng.randrange(FIRST_WORD, vocab) for _ in range(prefix_len)] for _ in range(num_prefixes)
    ]
    weights = [1 / (rank + 1) ** s for rank in range(num_prefixes)]
    lines = []
    for _ in range(requests):
        k = rng.choices(range(num_prefixes), weights)[0]
        suffix = [rng.randrange(FIRST_WORD, vocab) for _ in range(suffix_len)]
        lines.append({"prompt": words(prefixes[k] + suffix), "output_tokens": out, "prefix": k})
    return lines


def write_jsonl(path: str, lines: Sequence[dict]) -> str:
    with open(path, "w") as f:
        for line in lines:
            f.write(json.dumps(line, separators=(",", ":")) + "\n")
    return path


def load_trace(path: Optional[str] = None) -> Tuple[dict, List[dict]]:
    with open(path or trace_path()) as f:
        lines = [json.loads(line) for line in f]
    return lines[0], lines[1:]


def dataset_args(
    dataset: str, shape: Dict[str, Any], seed: int, work: str, vocab: int, trace=None
) -> List[str]:
    """The ``vllm bench serve`` arguments of one run of ``dataset`` (a dataset file of
    its own written under ``work`` for ``chat`` and ``zipf``)."""
    common = ["--seed", str(seed), "--ignore-eos"]
    if dataset == "prefix":
        return common + [
            "--dataset-name", "prefix_repetition",
            "--num-prompts", str(shape["requests"]),
            "--prefix-repetition-prefix-len", str(shape["prefix_len"]),
            "--prefix-repetition-suffix-len", str(shape["suffix_len"]),
            "--prefix-repetition-num-prefixes", str(shape["num_prefixes"]),
            "--prefix-repetition-output-len", str(shape["out"]),
        ]  # fmt: skip
    if dataset in ("random", "probe"):
        return common + [
            "--dataset-name", "random",
            "--num-prompts", str(shape["requests"]),
            "--random-input-len", str(shape["input_len"]),
            "--random-output-len", str(shape["out"]),
            "--random-range-ratio", "0",
        ]  # fmt: skip
    if dataset == "chat":
        header, turns = trace if trace is not None else load_trace()
        lines = chat_dataset(header, turns, shape["sessions"], vocab, seed, shape["out"])
    elif dataset == "zipf":
        lines = zipf_dataset(
            shape["requests"], shape["num_prefixes"], shape["prefix_len"],
            shape["suffix_len"], shape["s"], vocab, seed, shape["out"],
        )  # fmt: skip
    else:
        raise ValueError(f"unknown dataset {dataset!r}")
    path = write_jsonl(os.path.join(work, f"{dataset}-{seed}.jsonl"), lines)
    return common + [
        "--dataset-name", "custom",
        "--dataset-path", path,
        "--num-prompts", str(len(lines)),
        "--custom-output-len", str(shape["out"]),
        "--skip-chat-template",
        "--disable-shuffle",
        "--no-oversample",
    ]  # fmt: skip


# -- metrics (pure) --------------------------------------------------------------------------
