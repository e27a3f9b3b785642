"""``shmkv demo``: prefill in DataLoader workers, decode in the main process, all verified.

Starts an embedded coordinator with a CPU pool. A ``torch.utils.data.DataLoader``
with several ``spawn`` worker processes is the prefill stage: each worker allocates
a sequence for its prompt (prompts share a system prefix, so later ones reuse
cached blocks), writes K/V for every layer into the pool, commits it, and returns
the handle, which pickles through the hand-off path. The main process then decodes:
one batch step per decode step for all sequences (one round trip, then one write per
layer for the whole batch), and finally
every value of every sequence is read back and compared with what was written.

K/V values are small integers computed from (prompt, layer, position, head, dim),
exact in every supported dtype, so any process can verify any slot.
"""

from __future__ import annotations

import os
import time
import warnings

import torch

from shmkv.tools.progress import ProgressBar

SYSTEM_PREFIX = 48  # tokens every prompt shares


def expected_kv(
    layers: int, positions: torch.Tensor, heads: int, head_dim: int, tokens, dtype
) -> torch.Tensor:
    """K/V ``[layers, 2, n, heads, head_dim]`` for token ids ``tokens`` at ``positions``.

    A function of the token ids and positions only, so a shared prefix has identical
    K/V in every sequence (as a real model's would).
    """
    tok = torch.as_tensor(tokens, dtype=torch.int64)[None, None, :, None, None]
    pos = positions.to(torch.int64)[None, None, :, None, None]
    layer = torch.arange(layers)[:, None, None, None, None]
    kv = torch.arange(2)[None, :, None, None, None]
    head = torch.arange(heads)[None, None, None, :, None]
    dim = torch.arange(head_dim)[None, None, None, None, :]
    value = (tok * 7 + pos * 3 + layer * 11 + kv * 29 + head * 5 + dim) % 251 - 125
    return value.to(dtype)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors of one dtype and shape hold the same bytes (float8 has no
    ``torch.equal`` on CPU; a quantized pool stores bytes exactly)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.element_size() == 1:
        return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    return torch.equal(a, b)


def prompt_tokens(index: int, length: int) -> list:
    """A system prefix shared by every prompt, then tokens of this prompt."""
    return [1000 + (i % 97) for i in range(SYSTEM_PREFIX)] + [
        (index * 131 + i * 17) % 32000 for i in range(length - SYSTEM_PREFIX)
    ]


class PrefillDataset(torch.utils.data.Dataset):
    """Prompt i -> a handle whose K/V for the whole prompt is written and committed."""

    def __init__(self, address: str, lengths: list):
        self.address = address
        self.lengths = lengths

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int):
        from shmkv.client.client import process_client

        client = process_client(self.address, None, None)
        cfg = client.config
        tokens = prompt_tokens(index, self.lengths[index])
        handle = client.allocate(prompt=tokens)
        start = handle.num_cached_tokens
        n = len(tokens) - start
        if n:
            kv = expected_kv(
                cfg.num_layers,
                torch.arange(start, len(tokens)),
                cfg.num_kv_heads,
                cfg.head_dim,
                tokens[start:],
                client.pool.dtype,
            )
            t0 = time.perf_counter()
            handle.write_all(kv.contiguous(), start=start)
            elapsed = time.perf_counter() - t0
        else:
            elapsed = 0.0
        handle.commit()
        return {
            "index": index,
            "tokens": tokens,
            "handle": handle,
            "cached": start,
            "write_bytes": n * cfg.block_nbytes // cfg.block_size,
            "write_s": elapsed,
            "pid": os.getpid(),
        }


def run(
    num_prompts: int = 24,
    workers: int = 3,
    decode_steps: int = 32,
    num_layers: int = 4,
    num_kv_heads: int = 8,
    head_dim: int = 64,
    block_size: int = 16,
    num_blocks: int = 2048,
    dtype: str = "float16",
    quiet: bool = False,
) -> dict:
    """Run the demo; returns its summary. Raises AssertionError on any wrong value."""
    from shmkv.client.client import connect
    from shmkv.coordinator.server import Coordinator
    from shmkv.memory.layout import PoolConfig

    say = (lambda *a: None) if quiet else (lambda *a: print(*a, flush=True))
    cfg = PoolConfig(
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        num_blocks=num_blocks,
        block_size=block_size,
        dtype=dtype,
    )
    lengths = [SYSTEM_PREFIX + 16 + (i * 37) % 200 for i in range(num_prompts)]
    name = f"demo-{os.getpid()}"
    started = time.perf_counter()
    with Coordinator(cfg, name=name) as coord, connect(coord.address) as client:
        say(
            f"coordinator at {coord.address}: {cfg.num_blocks} blocks x {cfg.block_size} "
            f"tokens, {cfg.num_layers} layers, {cfg.num_kv_heads}x{cfg.head_dim} {cfg.dtype}, "
            f"{cfg.nbytes / 2**20:.1f} MiB shared"
        )
        with warnings.catch_warnings():  # more workers than cores is fine: they wait on I/O
            warnings.filterwarnings("ignore", message=".*worker processes in total.*")
            loader = torch.utils.data.DataLoader(
                PrefillDataset(coord.address, lengths),
                batch_size=None,
                num_workers=workers,
                multiprocessing_context="spawn",
                timeout=120,
            )
            items = []
            with ProgressBar("prefill", total=len(lengths), unit="prompts", quiet=quiet) as bar:
                for item in loader:
                    items.append(item)
                    bar.advance()
        prefill_bytes, prefill_write_s, worker_pids = 0, 0.0, set()
        for item in items:
            prefill_bytes += item["write_bytes"]
            prefill_write_s += item["write_s"]
            worker_pids.add(item["pid"])
        prefill_s = time.perf_counter() - started
        cached = sum(item["cached"] for item in items)
        say(
            f"prefill: {len(items)} prompts in {len(worker_pids)} DataLoader worker processes, "
            f"{sum(map(len, (i['tokens'] for i in items)))} tokens, {cached} reused from the "
            f"prefix cache, {prefill_s:.2f} s"
        )

        handles = [item["handle"] for item in items]
        # Every sequence of the batch at once; each extend reserves a block's worth of slots
        # ahead too, which the next steps take with no round trip (next_decode).
        batch = client.batch(handles)
        rng = torch.Generator().manual_seed(0)
        decode_tokens = [item["tokens"] for item in items]
        decode_bytes, decode_write_s, num_writes = 0, 0.0, 0
        t0 = time.perf_counter()
        step, round_trips = None, 0
        for _step in range(decode_steps):
            new = torch.randint(0, 32000, (len(handles),), generator=rng).tolist()
            step = step.next_decode() if step is not None else None
            if step is None:
                step = batch.extend(1, reserve=cfg.block_size - 1)
                round_trips += 1
            # what a model step would produce for every sequence: [layers, 2, B, heads, dim]
            step_kv = expected_kv(
                num_layers, step.positions, num_kv_heads, head_dim, new, client.pool.dtype
            )
            t_write = time.perf_counter()
            for layer in range(num_layers):  # one copy for K and one for V per layer
                step.write(layer, step_kv[layer, 0], step_kv[layer, 1])
            decode_write_s += time.perf_counter() - t_write
            num_writes += num_layers
            decode_bytes += len(handles) * cfg.block_nbytes // cfg.block_size
            for toks, tok in zip(decode_tokens, new):
                toks.append(tok)
        if step is not None:  # the slots reserved ahead and not written go back
            batch.truncate(step.seq_lens)
            round_trips += 1
        decode_s = time.perf_counter() - t0

        read_bytes, read_s, checked = 0, 0.0, 0
        for h, toks in zip(handles, decode_tokens):
            t_read = time.perf_counter()
            got = h.gather_all()
            read_s += time.perf_counter() - t_read
            want = expected_kv(
                num_layers, torch.arange(len(toks)), num_kv_heads, head_dim, toks, client.pool.dtype
            )
            assert h.num_tokens == len(toks), (h.num_tokens, len(toks))
            assert same_bytes(got, want), f"{h.cache_id}: K/V differs from what was written"
            for layer in range(num_layers):  # the per-layer API agrees with the bulk read
                assert same_bytes(h.key_cache(layer), want[layer, 0])
                assert same_bytes(h.value_cache(layer), want[layer, 1])
            read_bytes += got.numel() * got.element_size()
            checked += got.numel()
        stats = client.stats()
        probe = handles[0].clone_handle()
        t_ops = time.perf_counter()
        for _ in range(500):  # control plane: real metadata ops, one round trip each
            client.extend_many([(probe, 0)])
        ops_per_s = 500 / (time.perf_counter() - t_ops)
        probe.close()
        client.close_many(handles)
        after = client.stats()
        assert after["referenced_blocks"] == 0, f"blocks still referenced: {after}"
    elapsed = time.perf_counter() - started
    leftovers = [n for n in os.listdir("/dev/shm") if n.startswith(f"shmkv-{os.getpid()}-")]
    assert not leftovers, f"left in /dev/shm: {leftovers}"
    assert not os.path.exists(coord.address), "socket file left behind"
    summary = {
        "sequences": len(handles),
        "tokens": sum(map(len, decode_tokens)),
        "prefix_cached_tokens": cached,
        "decode_steps": decode_steps,
        "decode_round_trips": round_trips,
        "bytes_written": prefill_bytes + decode_bytes,
        "bytes_read": read_bytes,
        "values_verified": checked,
        "prefill_write_GBps": (prefill_bytes / prefill_write_s / 1e9 if prefill_write_s else 0.0),
        "decode_write_us": 1e6 * decode_write_s / max(num_writes, 1),
        "read_GBps": read_bytes / read_s / 1e9 if read_s else 0.0,
        "coordinator_ops": stats["ops"],
        "coordinator_ops_per_s": ops_per_s,
        "decode_step_ms": 1e3 * decode_s / max(decode_steps, 1),
        "elapsed_s": elapsed,
    }
    say(
        f"decode: {decode_steps} steps x {len(handles)} sequences in {round_trips} round "
        f"trips (slots reserved a block ahead), one write per layer for the whole "
        f"batch, {summary['decode_step_ms']:.2f} ms/step"
    )
    say(
        f"verified {checked:,} K/V values in {len(handles)} sequences, "
        f"{summary['tokens']:,} tokens: all equal to what was written"
    )
    say(
        f"written: prefill {prefill_bytes / 2**20:.1f} MiB at "
        f"{summary['prefill_write_GBps']:.2f} GB/s (write_all in the workers), decode "
        f"{decode_bytes / 2**20:.2f} MiB in {num_writes} batch layer writes, "
        f"{summary['decode_write_us']:.1f} us each; read {read_bytes / 2**20:.1f} MiB at "
        f"{summary['read_GBps']:.2f} GB/s"
    )
    say(
        f"coordinator: served {stats['ops']} ops; {ops_per_s:.0f} round trips/s in a burst "
        f"of real metadata ops"
    )
    say("nothing left in /dev/shm, socket removed: OK")
    return summary


def add_parser(sub) -> None:
    from shmkv.tools.args import dtype_arg, non_negative_int, positive_int

    p = sub.add_parser("demo", help="prefill in DataLoader workers, decode here, verify all")
    p.add_argument(
        "--prompts",
        type=positive_int,
        default=24,
        help="prompts (sequences) to prefill, sharing a 48-token system prefix",
    )
    p.add_argument(
        "--workers",
        type=positive_int,
        default=3,
        help="DataLoader worker processes for the prefill (at least 1)",
    )
    p.add_argument(
        "--decode-steps",
        type=non_negative_int,
        default=32,
        help="decode steps (one token per sequence each) after the prefill",
    )
    p.add_argument(
        "--dtype",
        type=dtype_arg,
        default=None,
        help="pool element type (default float16, and float32 with --model; "
        "float8 and int8 pools are checked byte for byte)",
    )
    p.add_argument(
        "--model",
        default=None,
        choices=("tiny",),
        help="'tiny': cross-process generation with a small random model",
    )
    p.set_defaults(func=_cmd)


def _cmd(args) -> int:
    if args.model:
        from shmkv.tools import demo_model

        return demo_model.main(args)
    try:
        run(
            num_prompts=args.prompts,
            workers=args.workers,
            decode_steps=args.decode_steps,
            dtype=args.dtype or "float16",
        )
    except AssertionError as exc:
        print(f"shmkv demo: FAILED: {exc}", flush=True)
        return 1
    return 0
