"""The chat trace replayed: prefix-hit rate and prefill tokens saved with tiers against the
pool alone, every cached block checked against the K/V its writer wrote.
"""

from __future__ import annotations

import json
import os
import random
import time

import torch

import shmkv
from shmkv.bench.tiers.common import SMALL, name


def make_trace(
    path: str, seed: int = 7, sessions: int = 40, concurrent: int = 24, block_size: int = 16
) -> None:
    """A multi-turn chat trace: one system prompt shared by every session, ``concurrent``
    sessions at a time that interleave at random (a user comes back after others have
    spoken), each turn a user message then an assistant reply (token ids)."""
    rng = random.Random(seed)
    system = [rng.randrange(1, 32000) for _ in range(320)]
    turns = {s: rng.randint(3, 8) for s in range(sessions)}
    active = list(range(min(concurrent, sessions)))
    waiting = list(range(len(active), sessions))
    lines = [
        {
            "kind": "header",
            "block_size": block_size,
            "system": system,
            "seed": seed,
            "sessions": sessions,
            "concurrent": concurrent,
        }
    ]
    while active:
        s = rng.choice(active)
        lines.append(
            {
                "session": s,
                "user": [rng.randrange(1, 32000) for _ in range(rng.randint(16, 160))],
                "reply": [rng.randrange(1, 32000) for _ in range(rng.randint(24, 200))],
            }
        )
        turns[s] -= 1
        if not turns[s]:
            active.remove(s)
            if waiting:
                active.append(waiting.pop(0))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        for line in lines:
            f.write(json.dumps(line, separators=(",", ":")) + "\n")


def load_trace(path: str) -> tuple:
    with open(path) as f:
        lines = [json.loads(line) for line in f]
    return lines[0], lines[1:]


def trace_working_set(header, requests) -> int:
    """Distinct full blocks the trace publishes (prompts and replies)."""
    from shmkv import hashing

    convs: dict = {}
    for r in requests:
        convs.setdefault(r["session"], list(header["system"])).extend(r["user"] + r["reply"])
    keys = set()
    for conv in convs.values():
        keys.update(hashing.block_keys(conv, header["block_size"], hashing.root_key()))
    return len(keys)


def kv_of(tokens, positions, heads, dim, dtype):
    t = torch.tensor(tokens, dtype=torch.float32)[:, None, None]
    p = torch.tensor(positions, dtype=torch.float32)[:, None, None]
    return (
        (
            (t % 1000) * 0.25
            + p * 0.001
            + torch.arange(heads)[None, :, None]
            + torch.arange(dim)[None, None, :] * 0.01
        )
        .expand(-1, heads, dim)
        .to(dtype)
    )


def replay(address, header, requests, verify=True, decode_us=500.0) -> dict:
    """Replay the trace: allocate each prompt, write what was not cached, commit, decode
    the reply (``decode_us`` of pretend compute per reply token: far faster than any
    model, but not zero, so that write-behind copies have a moment), commit, close."""
    bs = header["block_size"]
    convs: dict = {}
    prompt_tokens = cached_tokens = checked = bad = 0
    with shmkv.connect(address, timeout=120) as client:
        heads, dim, dtype = client.pool.shape[4], client.config.head_dim, client.pool.dtype
        layers = client.config.num_layers
        t0 = time.perf_counter()
        for r in requests:
            conv = convs.setdefault(r["session"], list(header["system"]))
            prompt = conv + r["user"]
            h = client.allocate(prompt=prompt)
            cached = h.num_cached_tokens
            prompt_tokens += len(prompt)
            cached_tokens += cached
            if verify and cached:
                for pos in {0, cached - bs}:  # the first and the last cached block
                    want = kv_of(prompt[pos : pos + bs], range(pos, pos + bs), heads, dim, dtype)
                    got = h.key_cache(layers - 1)[pos : pos + bs]
                    checked += 1
                    bad += not torch.equal(got, want)
            kv = kv_of(prompt[cached:], range(cached, len(prompt)), heads, dim, dtype)
            for layer in range(layers):
                h.write(layer, kv, kv, start=cached)
            h.commit()
            start = h.extend(len(r["reply"]), tokens=r["reply"])
            kv = kv_of(r["reply"], range(start, start + len(r["reply"])), heads, dim, dtype)
            for layer in range(layers):
                h.write(layer, kv, kv, start=start)
            h.commit()
            h.close()
            conv += r["user"] + r["reply"]
            time.sleep(len(r["reply"]) * decode_us * 1e-6)
        secs = time.perf_counter() - t0
        st = client.stats()
    return {
        "requests": len(requests),
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached_tokens,
        "hit_rate": cached_tokens / prompt_tokens,
        "prefill_tokens": prompt_tokens - cached_tokens,
        "seconds": secs,
        "blocks_checked": checked,
        "blocks_wrong": bad,
        "evictions": st["evictions"],
        "tiers": st.get("tiers"),
        "tier_io": st.get("tier_io"),
    }


def bench_chat(args, root) -> dict:
    header, requests = load_trace(args.trace)
    bs = header["block_size"]
    working_set = trace_working_set(header, requests)
    pool_blocks = working_set // 4
    cfg = shmkv.PoolConfig(num_blocks=pool_blocks, max_seq_len=8192, **SMALL)
    out = {
        "trace": os.path.relpath(args.trace),
        "requests": len(requests),
        "working_set_blocks": working_set,
        "pool_blocks": pool_blocks,
        "block_size": bs,
    }
    runs = {
        "pool alone": None,
        "pool + host tier (1x pool) + disk tier": [
            shmkv.HostTier(pool_blocks * cfg.block_nbytes),
            shmkv.DiskTier(os.path.join(root, "chat"), 1 << 34),
        ],
    }
    for label, specs in runs.items():
        with shmkv.Coordinator.spawn(cfg, name=name(), tiers=specs) as coord:
            out[label] = replay(coord.address, header, requests, decode_us=args.decode_us)
    base, tiered = out["pool alone"], out["pool + host tier (1x pool) + disk tier"]
    out["prefill_tokens_saved_by_tiers"] = base["prefill_tokens"] - tiered["prefill_tokens"]
    return out


# -- the loop's work, warm and cold -----------------------------------------------------------
