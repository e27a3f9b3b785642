"""Suite ``transformers``: decode tokens/s of transformers' generate with ShmkvCache
against DynamicCache.

A small Mistral-shaped model with random weights (8 layers, hidden 256, 8 query heads
over 2 K/V heads, head_dim 32, no sliding window), float32, one torch thread, greedy.
For each (batch, prompt length) the prompt is prefilled once into each cache; every
timed run crops the cache back to the prompt less its last token and generates
``--steps`` tokens, timed from the first generated token to the last (the forward of
each decode step plus generate's own per-step work, the same for every cache). A
ShmkvCache cropped back keeps the slots it reserved, so these runs decode over
reserved slots (no round trip to the coordinator per step); with ``--fresh`` every
run starts from a cache prefilled anew (not timed), whose decode steps each reserve
their slot in a round trip.

Three ways are timed, interleaved round by round (in alternating order), median of
the rounds; a ratio to DynamicCache is the median of the rounds' own ratios:

* ``dynamic``: DynamicCache, ``attn_implementation="sdpa"`` (transformers' default);
* ``shmkv``: ShmkvCache, ``attn_implementation="shmkv"`` (the paged path, the default:
  every forward attends over the pool's pages);
* ``shmkv-torch``: the same with the native decode kernel turned off (decode steps
  gather K/V from the pool and run SDPA over the copy, as without a C compiler);
* ``shmkv-mirror``: the same as ``shmkv`` with ``mirror=True`` (decode steps attend over a copy of
  the K/V the cache keeps in this process, a second copy of it);
* ``shmkv-dense``: ShmkvCache with ``sdpa`` (the dense path: K/V gathered per layer).

Every run's tokens are checked equal to DynamicCache's. Writes
``benchmarks/results/NAME.json`` and ``.md`` and ``benchmarks/plots/NAME-context.png``
(NAME defaults to ``transformers``).

    shmkv bench --only transformers [--quick] [-- --steps 128 --repeats 5 --model mid]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from typing import Any, Dict, List

import torch

import shmkv
from shmkv.bench.core import plot_path, pyplot, result_base, write_results
from shmkv.integrations.transformers import ShmkvCache, cache_argument, pool_config
from shmkv.kernels import native

# MistralConfig's keywords
MODEL: Dict[str, Any] = dict(
    vocab_size=32000,
    hidden_size=256,
    intermediate_size=1024,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=8192,
    sliding_window=None,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
# --model mid: heads of a 1-3B model (16 query heads over 4 K/V heads of 128), 4 layers.
MID = dict(
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=4,
    num_attention_heads=16,
    num_key_value_heads=4,
)
DESCRIBE = {
    "small": "Mistral-shaped, 8 layers, hidden 256, 8:2 GQA heads of 32, vocab 32000",
    "mid": "Mistral-shaped, 4 layers, hidden 2048, 16:4 GQA heads of 128, vocab 32000",
}
BLOCK_SIZE = 16
TARGETS = [(4, 1024), (1, 4096)]
SWEEP = {1: [256, 512, 1024, 2048, 4096], 4: [256, 512, 1024, 2048]}
QUICK_SWEEP = {1: [512, 2048], 4: [1024]}
WAYS = ["dynamic", "shmkv", "shmkv-torch", "shmkv-mirror", "shmkv-dense"]
IMPL = {
    "dynamic": "sdpa",
    "shmkv": "shmkv",
    "shmkv-torch": "shmkv",
    "shmkv-mirror": "shmkv",
    "shmkv-dense": "sdpa",
}


def build_model():
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    return MistralForCausalLM(MistralConfig(**MODEL)).eval()


class _Clock:
    """A logits processor that notes when each generated token's logits arrive: wall
    clock, and this process's CPU time (all its threads, the coordinator's included)."""

    def __init__(self):
        self.times = []
        self.cpu = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        self.cpu.append(time.process_time())
        return scores


@torch.no_grad()
def run_case(
    model, client, batch: int, prompt_len: int, steps: int, repeats: int, fresh: bool = False
) -> dict:
    from transformers import DynamicCache, LogitsProcessorList

    key = cache_argument(model)
    ids = torch.randint(
        0,
        MODEL["vocab_size"],
        (batch, prompt_len),
        generator=torch.Generator().manual_seed(prompt_len * 10 + batch),
    )
    mask = torch.ones_like(ids)

    def prefilled(way):
        model.set_attn_implementation(IMPL[way])
        cache = (
            DynamicCache(config=model.config)
            if way == "dynamic"
            else ShmkvCache(client, mirror=way == "shmkv-mirror")
        )
        model(ids[:, :-1], attention_mask=mask[:, :-1], use_cache=True, **{key: cache})
        return cache

    caches = {way: prefilled(way) for way in WAYS}
    rates: Dict[str, List[float]] = {way: [] for way in WAYS}
    cpu_rates: Dict[str, List[float]] = {way: [] for way in WAYS}
    tokens: Dict[str, List[List[int]]] = {}
    for round_ in range(repeats + 1):  # the first round warms up
        # Alternate the order, so no way always runs after the same other one.
        for way in WAYS if round_ % 2 else WAYS[::-1]:
            if fresh and way != "dynamic":
                caches[way].close()
            cache = caches[way] = prefilled(way) if fresh else caches[way]
            model.set_attn_implementation(IMPL[way])
            cache.crop(-(cache.get_seq_length() - (prompt_len - 1)))
            clock = _Clock()
            decoder = native.decoder
            if way == "shmkv-torch":
                native.decoder = lambda: None
            try:
                out = model.generate(
                    ids,
                    attention_mask=mask,
                    max_new_tokens=steps,
                    do_sample=False,
                    logits_processor=LogitsProcessorList([clock]),
                    **{key: cache},
                )
            finally:
                native.decoder = decoder
            num = batch * (len(clock.times) - 1)
            rates[way].append(num / (clock.times[-1] - clock.times[0]))
            cpu_rates[way].append(num / (clock.cpu[-1] - clock.cpu[0]))
            tokens[way] = out[:, prompt_len:].tolist()
        for way in WAYS:
            if tokens[way] != tokens["dynamic"]:
                raise AssertionError(
                    f"{way} generated other tokens than DynamicCache at batch "
                    f"{batch}, prompt {prompt_len}"
                )
    for way in WAYS:
        if way != "dynamic":
            caches[way].close()
    result: Dict[str, Any] = {
        "batch": batch,
        "prompt": prompt_len,
        "steps": steps,
        "fresh": fresh,
        "tokens_equal": True,
    }
    for way in WAYS:
        result[f"{way}_tok_s"] = statistics.median(rates[way][1:])
        result[f"{way}_runs"] = rates[way][1:]
        result[f"{way}_cpu_tok_s"] = statistics.median(cpu_rates[way][1:])
    # Ratios: the median of each round's own ratio (runs next to each other in time see
    # about the same load from the rest of the host).
    for name, way in (
        ("ratio", "shmkv"),
        ("ratio_torch", "shmkv-torch"),
        ("ratio_mirror", "shmkv-mirror"),
        ("ratio_dense", "shmkv-dense"),
    ):
        for prefix, runs in (("", rates), ("cpu_", cpu_rates)):
            result[prefix + name] = statistics.median(
                a / b for a, b in zip(runs[way][1:], runs["dynamic"][1:])
            )
    return result


def markdown(results: dict) -> str:
    """The table: the targets first, then the rest of the sweep."""
    lines = [
        "| batch | prompt | DynamicCache tok/s | ShmkvCache, `shmkv` attention (paged) "
        "tok/s | ratio | per CPU s | the same, native kernel off tok/s | ratio | with "
        "`mirror=True` tok/s | ratio | ShmkvCache, `sdpa` (dense) tok/s | ratio | per CPU s "
        "| tokens equal |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    seen = set()
    for r in results["targets"] + results["sweep"]:
        if (r["batch"], r["prompt"]) in seen:
            continue
        seen.add((r["batch"], r["prompt"]))
        lines.append(
            f"| {r['batch']} | {r['prompt']} | {r['dynamic_tok_s']:.0f} | "
            f"{r['shmkv_tok_s']:.0f} | **{r['ratio']:.2f}x** | {r['cpu_ratio']:.2f}x | "
            f"{r['shmkv-torch_tok_s']:.0f} | {r['ratio_torch']:.2f}x | "
            f"{r['shmkv-mirror_tok_s']:.0f} | {r['ratio_mirror']:.2f}x | "
            f"{r['shmkv-dense_tok_s']:.0f} | {r['ratio_dense']:.2f}x | "
            f"{r['cpu_ratio_dense']:.2f}x | {'yes' if r['tokens_equal'] else 'NO'} |"
        )
    start = (
        "from a cache prefilled anew"
        if results.get("fresh")
        else "from the cache cropped back to the prompt"
    )
    head = (
        f"Decode tokens/s of `generate`, greedy, {results['model']}, float32, one torch "
        f"thread, {results['block_size']}-token blocks, {results['steps']} new tokens per "
        f"run, median of {results['repeats']} interleaved runs, each {start} "
        f"({results['host']}, transformers {results['transformers']}). Ratios are to "
        "DynamicCache in the same rounds (the median of each round's ratio); \"per CPU "
        's" is the ratio of tokens per CPU second of the process (the coordinator thread '
        "included), less sensitive to other load on the host. The first two rows are the "
        "targets (batch 4 with a 1k prompt, batch 1 with 4k). The paged path's decode "
        f"attention: {_native_words(results.get('native'))}.\n\n"
    )
    return head + "\n".join(lines) + "\n"


def _native_words(status) -> str:
    if status == "loaded":
        return "the native kernel (`shmkv.kernels.native`), reading the pool's pages in place"
    return f"the torch path (gather + SDPA; the native kernel: {status or 'not recorded'})"


def plot(results: dict, path: str) -> bool:
    try:
        plt = pyplot()
    except ImportError:
        return False
    batches = sorted({r["batch"] for r in results["sweep"]})
    fig, axes = plt.subplots(1, len(batches), figsize=(5.5 * len(batches), 4), squeeze=False)
    for ax, batch in zip(axes[0], batches):
        rows = sorted(
            (r for r in results["sweep"] if r["batch"] == batch), key=lambda r: r["prompt"]
        )
        x = [r["prompt"] for r in rows]
        for way, label, style in [
            ("dynamic", "DynamicCache (sdpa)", "o-"),
            ("shmkv", "ShmkvCache (shmkv attention, over the pool)", "s-"),
            ("shmkv-torch", "ShmkvCache (shmkv attention, native kernel off)", "x-."),
            ("shmkv-mirror", "ShmkvCache (shmkv attention, mirror=True)", "d:"),
            ("shmkv-dense", "ShmkvCache (dense, sdpa)", "^--"),
        ]:
            ax.plot(x, [r[f"{way}_tok_s"] for r in rows], style, label=label)
        ax.set_xscale("log", base=2)
        ax.set_xticks(x)
        ax.set_xticklabels([str(v) for v in x])
        ax.set_xlabel("context length (prompt tokens)")
        ax.set_ylabel("decode tokens/s")
        ax.set_title(f"batch {batch}")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("transformers generate, Mistral-shaped 8x256 model, float32, 1 thread")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer lengths and runs")
    parser.add_argument(
        "--steps",
        type=int,
        default=128,
        help="new tokens per run (runs of 32 last a few tenths of a second, "
        "where this host's noise moves one round's ratio by 10 %%)",
    )
    parser.add_argument("--repeats", type=int, default=None, help="timed runs (default 5, quick 3)")
    parser.add_argument("--name", default="transformers")
    parser.add_argument(
        "--out", default=None, help="directory holding results/ and plots/ (default: benchmarks)"
    )
    parser.add_argument("--no-sweep", action="store_true", help="the two targets only")
    parser.add_argument(
        "--model",
        choices=sorted(DESCRIBE),
        default="small",
        help="small: the targets' shape; mid: larger heads (see MID)",
    )
    parser.add_argument("--block-size", type=int, default=BLOCK_SIZE, help="pool block size")
    parser.add_argument(
        "--fresh",
        action="store_true",
        help="every run from a cache prefilled anew (decode steps then reserve "
        "their slots in a round trip each) instead of one cropped back",
    )
    args = parser.parse_args(argv)
    from shmkv.bench import core

    args.out = args.out or core.OUT_DIR
    repeats = args.repeats or (3 if args.quick else 5)
    torch.set_num_threads(1)
    if args.model == "mid":
        MODEL.update(MID)
    model = build_model()
    sweep = {} if args.no_sweep else (QUICK_SWEEP if args.quick else SWEEP)
    longest = max([p for _, p in TARGETS] + [p for ps in sweep.values() for p in ps])
    widest = max([b for b, _ in TARGETS] + list(sweep))
    blocks = widest * (-(-(longest + args.steps) // args.block_size) + 1) * 3 + 64
    cfg = pool_config(
        model.config, num_blocks=blocks, block_size=args.block_size, dtype=torch.float32
    )
    results = {
        "model": DESCRIBE[args.model],
        "steps": args.steps,
        "repeats": repeats,
        "threads": 1,
        "fresh": args.fresh,
        "block_size": args.block_size,
        "host": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "targets": [],
        "sweep": [],
    }
    import transformers

    results["transformers"] = transformers.__version__
    # The coordinator serves from a thread of this process (as in `shmkv demo`): on
    # this 2-core host a coordinator process's wake-up per step costs more than the GIL.
    with (
        shmkv.Coordinator(cfg, name=f"bench-tf-{os.getpid()}") as coord,
        shmkv.connect(coord.address) as client,
    ):
        for batch, prompt_len in TARGETS:
            r = run_case(model, client, batch, prompt_len, args.steps, repeats, args.fresh)
            results["targets"].append(r)
            print(
                f"target batch {batch} prompt {prompt_len}: dynamic {r['dynamic_tok_s']:.0f} "
                f"shmkv {r['shmkv_tok_s']:.0f} ({r['ratio']:.2f}x) dense "
                f"{r['shmkv-dense_tok_s']:.0f} ({r['ratio_dense']:.2f}x); per CPU second "
                f"{r['cpu_ratio']:.2f}x, dense {r['cpu_ratio_dense']:.2f}x",
                flush=True,
            )
        done = {(r["batch"], r["prompt"]): r for r in results["targets"]}
        for batch, lengths in sweep.items():
            for prompt_len in lengths:
                r = done.get((batch, prompt_len)) or run_case(
                    model, client, batch, prompt_len, args.steps, repeats, args.fresh
                )
                results["sweep"].append(r)
                print(
                    f"sweep batch {batch} prompt {prompt_len}: dynamic "
                    f"{r['dynamic_tok_s']:.0f} shmkv {r['shmkv_tok_s']:.0f} "
                    f"({r['ratio']:.2f}x) dense {r['shmkv-dense_tok_s']:.0f}",
                    flush=True,
                )
    results["native"] = native.status()
    table = markdown(results)
    write_results(result_base(args.name, args.out), results, table)
    print(table)
    if results["sweep"] and not plot(results, plot_path(f"{args.name}-context", args.out)):
        print("matplotlib missing: no plot")
    return 0


def cli_args(quick: bool, out_dir: str, name=None) -> list:
    """The arguments ``shmkv bench --only transformers`` runs :func:`main` with (a quick
    run writes ``transformers-quick``, not the committed ``transformers``)."""
    name = name or ("transformers-quick" if quick else None)
    return (["--quick"] if quick else []) + (["--name", name] if name else [])


if __name__ == "__main__":
    sys.exit(main())
