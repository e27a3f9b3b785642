"""Module-level functions run in spawned child processes by the tests."""

import os
import signal
import time

import torch

import shmkv


def pattern(seed: int, n: int, heads: int, dim: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, heads, dim, generator=g).to(dtype)


def write_and_handoff(address, n, seed, queue):
    """Allocate a sequence, write every layer, send the handle (pickled) to the parent."""
    with shmkv.connect(address, timeout=20) as client:
        h = client.allocate(n)
        for layer in range(h.num_layers):
            h.write(layer, pattern(seed + layer, n, h.num_heads, h.head_dim),
                    pattern(seed + 100 + layer, n, h.num_heads, h.head_dim), start=0)
        queue.put(h)          # pickles through export/open, in the queue's feeder thread
        queue.put(os.getpid())
        queue.close()
        queue.join_thread()   # so the export has happened before the client closes


def read_back(address, token, n, seed, results, wait_for=None):
    """Open a token, check K/V, optionally wait for the parent's write, report."""
    with shmkv.connect(address, timeout=20) as client:
        h = client.open(token)
        ok = all(torch.equal(h.key_cache(l), pattern(seed + l, n, h.num_heads, h.head_dim))
                 for l in range(h.num_layers))
        results.put(("first", ok, h.key_cache(0).data_ptr() != 0))
        if wait_for is not None:
            wait_for.wait(20)
            # no round trip: the parent's in-place write is visible through the mapping
            results.put(("second", h.key_cache(0)[0].tolist()))
        h.close()


def hold_and_sleep(address, n, queue, export_ttl=None):
    """Allocate (and optionally export) a sequence, then sleep until killed."""
    client = shmkv.connect(address, timeout=20)
    h = client.allocate(n)
    h.write(0, torch.ones(n, h.num_heads, h.head_dim), torch.ones(n, h.num_heads, h.head_dim),
            start=0)
    token = h.export(export_ttl) if export_ttl else None
    queue.put((h.cache_id, token))
    time.sleep(120)


def die_by_sigkill_mid_write(address, prompt, queue):
    """Write part of a prompt's K/V, never commit, then SIGKILL ourselves."""
    client = shmkv.connect(address, timeout=20)
    h = client.allocate(prompt=prompt)
    n = len(prompt)
    h.write(0, torch.full((n, h.num_heads, h.head_dim), 7.0),
            torch.full((n, h.num_heads, h.head_dim), 7.0), start=0)
    queue.put("written")
    queue.close()
    queue.join_thread()
    os.kill(os.getpid(), signal.SIGKILL)


def prefix_writer(address, prompt, queue):
    """Process A: write a prompt's K/V (values from the token ids) and commit it."""
    with shmkv.connect(address, timeout=20) as client:
        h = client.allocate(prompt=prompt)
        for layer in range(h.num_layers):
            kv = token_kv(prompt, layer, h.num_heads, h.head_dim)
            h.write(layer, kv[0], kv[1], start=0)
        published = h.commit()
        queue.put((published, h.num_cached_tokens))


def prefix_reader(address, prompt, queue):
    """Process B: allocate the same prompt, report reuse and whether K/V is identical."""
    with shmkv.connect(address, timeout=20) as client:
        h = client.allocate(prompt=prompt)
        cached = h.num_cached_tokens
        same = all(torch.equal(h.key_cache(l)[:cached],
                               token_kv(prompt, l, h.num_heads, h.head_dim)[0][:cached])
                   for l in range(h.num_layers))
        queue.put((cached, same))
        h.close()


def token_kv(tokens, layer, heads, dim):
    t = torch.tensor(tokens, dtype=torch.float32)[:, None, None]
    base = t * 0.5 + layer + torch.arange(heads)[None, :, None] * 0.25 \
        + torch.arange(dim)[None, None, :] * 0.125
    return base, -base


def tp_rank_writer(address, rank, tp_size, token, n, queue):
    """Rank r writes its head shard of a shared sequence and commits it."""
    with shmkv.connect(address, tp_rank=rank, tp_size=tp_size, timeout=20) as client:
        h = client.open(token)
        heads = h.num_heads
        for layer in range(h.num_layers):
            k = full_heads(n, heads * tp_size, h.head_dim, layer)[:, rank * heads:(rank + 1) * heads]
            h.write(layer, k.contiguous(), (-k).contiguous(), start=0)
        queue.put((rank, heads, h.commit()))
        h.close()


def full_heads(n, heads, dim, layer):
    return (torch.arange(n * heads * dim, dtype=torch.float32).view(n, heads, dim)
            + 1000 * layer)
