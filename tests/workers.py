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
            h.write(
                layer,
                pattern(seed + layer, n, h.num_heads, h.head_dim),
                pattern(seed + 100 + layer, n, h.num_heads, h.head_dim),
                start=0,
            )
        queue.put(h)  # pickles through export/open, in the queue's feeder thread
        queue.put(os.getpid())
        queue.close()
        queue.join_thread()  # so the export has happened before the client closes


def read_back(address, token, n, seed, results, wait_for=None):
    """Open a token, check K/V, optionally wait for the parent's write, report."""
    with shmkv.connect(address, timeout=20) as client:
        h = client.open(token)
        ok = all(
            torch.equal(h.key_cache(layer), pattern(seed + layer, n, h.num_heads, h.head_dim))
            for layer in range(h.num_layers)
        )
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
    h.write(
        0, torch.ones(n, h.num_heads, h.head_dim), torch.ones(n, h.num_heads, h.head_dim), start=0
    )
    token = h.export(export_ttl) if export_ttl else None
    queue.put((h.cache_id, token))
    time.sleep(120)


def die_by_sigkill_mid_write(address, prompt, queue):
    """Write part of a prompt's K/V, never commit, then SIGKILL ourselves."""
    client = shmkv.connect(address, timeout=20)
    h = client.allocate(prompt=prompt)
    n = len(prompt)
    h.write(
        0,
        torch.full((n, h.num_heads, h.head_dim), 7.0),
        torch.full((n, h.num_heads, h.head_dim), 7.0),
        start=0,
    )
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
        same = all(
            torch.equal(
                h.key_cache(layer)[:cached],
                token_kv(prompt, layer, h.num_heads, h.head_dim)[0][:cached],
            )
            for layer in range(h.num_layers)
        )
        queue.put((cached, same))
        h.close()


def token_kv(tokens, layer, heads, dim):
    t = torch.tensor(tokens, dtype=torch.float32)[:, None, None]
    base = (
        t * 0.5
        + layer
        + torch.arange(heads)[None, :, None] * 0.25
        + torch.arange(dim)[None, None, :] * 0.125
    )
    return base, -base


def tp_rank_writer(address, rank, tp_size, token, n, queue):
    """Rank r writes its head shard of a shared sequence and commits it."""
    with shmkv.connect(address, tp_rank=rank, tp_size=tp_size, timeout=20) as client:
        h = client.open(token)
        heads = h.num_heads
        for layer in range(h.num_layers):
            k = full_heads(n, heads * tp_size, h.head_dim, layer)
            k = k[:, rank * heads : (rank + 1) * heads]
            h.write(layer, k.contiguous(), (-k).contiguous(), start=0)
        queue.put((rank, heads, h.commit()))
        h.close()


def full_heads(n, heads, dim, layer):
    return torch.arange(n * heads * dim, dtype=torch.float32).view(n, heads, dim) + 1000 * layer


# -- batches and steps -------------------------------------------------------------------


def step_value(cache_ids, positions, layer, which, heads, dim):
    """K (which=0) or V (1) of new tokens: a function of (sequence, position, layer, head)."""
    base = (
        cache_ids.to(torch.float32) * 1000
        + positions.to(torch.float32) * 3
        + layer * 100
        + which * 50
    )[:, None, None]
    return (
        (base + torch.arange(heads)[None, :, None] * 0.5 + torch.arange(dim)[None, None, :] * 0.25)
        .expand(-1, heads, dim)
        .contiguous()
    )


def tp_step_rank(address, rank, tp_size, desc_queue, result_queue):
    """A tensor-parallel rank without a round trip of its own: rebuild each step from the
    descriptor rank 0 sends, write this rank's head shard, commit its shard."""
    with shmkv.connect(address, tp_rank=rank, tp_size=tp_size, timeout=20) as client:
        while True:
            desc = desc_queue.get(timeout=60)
            if desc is None:
                break
            step = client.step_from(desc)
            heads = client.pool.shape[4]
            for layer in range(client.config.num_layers):
                full_k = step_value(
                    step.cache_ids[step.seq_index],
                    step.positions,
                    layer,
                    0,
                    heads * tp_size,
                    client.config.head_dim,
                )
                full_v = step_value(
                    step.cache_ids[step.seq_index],
                    step.positions,
                    layer,
                    1,
                    heads * tp_size,
                    client.config.head_dim,
                )
                sl = slice(rank * heads, (rank + 1) * heads)
                step.write(layer, full_k[:, sl].contiguous(), full_v[:, sl].contiguous())
            result_queue.put(
                (
                    "stepped",
                    step.slot_mapping.tolist(),
                    step.block_tables.tolist(),
                    step.seq_lens.tolist(),
                    step.commit(),
                )
            )


def hammer_tables(address, token, seconds, result_queue):
    """Read a sequence's block table as fast as possible while others change it; report
    every distinct (length, blocks) seen."""
    with shmkv.connect(address, timeout=20) as client:
        h = client.open(token)
        result_queue.put("reading")
        seen = set()
        deadline = time.monotonic() + seconds
        reads = 0
        while time.monotonic() < deadline:
            table = h.block_table
            seen.add((table.sequence_length, table.physical_blocks))
            reads += 1
        result_queue.put((reads, sorted(seen)))
        h.close()


def batch_rank_killed_mid_step(address, n_seqs, queue):
    """Allocate, step, write half the layers, then SIGKILL ourselves."""
    client = shmkv.connect(address, timeout=20)
    hs = client.allocate_many([5] * n_seqs)
    step = client.batch(hs).extend(3)
    k = torch.ones(step.num_tokens, client.pool.shape[4], client.config.head_dim)
    step.write(0, k, k)
    queue.put("mid-step")
    queue.close()
    queue.join_thread()
    os.kill(os.getpid(), signal.SIGKILL)


def batch_write_and_handoff(address, lengths, queue):
    """Allocate, prefill and decode through batches, hand the handles to the parent."""
    with shmkv.connect(address, timeout=20) as client:
        hs = client.allocate_many(lengths)
        batch = client.batch(hs)
        steps = [batch.prefill(start=0), batch.extend(1), batch.extend([1, 2, 0][: len(hs)])]
        heads, dim = client.pool.shape[4], client.config.head_dim
        for step in steps:
            ids = step.cache_ids[step.seq_index]
            kv = torch.stack(
                [
                    torch.stack(
                        [
                            step_value(ids, step.positions, layer, which, heads, dim)
                            for which in (0, 1)
                        ]
                    )
                    for layer in range(client.config.num_layers)
                ]
            )
            step.write_all(kv.contiguous())
        for h in hs:
            queue.put((h, int(h._cache_id)))
        queue.close()
        queue.join_thread()


# -- handles crossing processes between tensor-parallel ranks ------------------------------


def tp_rank0_sends(address, prompt, queue):
    """Rank 0: allocate a prompt, write its shard, commit, send the handle."""
    with shmkv.connect(address, tp_rank=0, tp_size=2, timeout=20) as client:
        h = client.allocate(prompt=prompt)
        heads = h.num_heads
        for layer in range(h.num_layers):
            k = full_heads(len(prompt), heads * 2, h.head_dim, layer)[:, :heads]
            h.write(layer, k.contiguous(), (-k).contiguous(), start=0)
        h.commit()
        queue.put(h)
        queue.close()
        queue.join_thread()


def tp_rank1_receives(address, queue, result_queue, extra_full_client=False):
    """Rank 1: connected as rank 1, receive rank 0's handle, write rank 1's shard, commit."""
    with shmkv.connect(address, tp_rank=1, tp_size=2, timeout=20) as client:
        other = shmkv.connect(address, timeout=20) if extra_full_client else None
        try:
            if other is not None:
                try:
                    queue.get(timeout=60)
                    result_queue.put(("no error",))
                    return
                except shmkv.InvalidArgument as exc:  # two clients: unpickling cannot choose
                    result_queue.put(("ambiguous", str(exc)))
                    return
            h = queue.get(timeout=60)
            heads = h.num_heads
            n = h.num_tokens
            for layer in range(h.num_layers):
                k = full_heads(n, heads * 2, h.head_dim, layer)[:, heads:]
                h.write(layer, k.contiguous(), (-k).contiguous(), start=0)
            result_queue.put(("ok", h._client is client, heads, h.commit()))
            h.close()
        finally:
            if other is not None:
                other.close()


def peek_and_read(address, descriptor, n, seed, results):
    """Read a sequence another process holds through its descriptor (no reference of
    this process's own), check its K/V against the writer's pattern, report."""
    with shmkv.connect(address, timeout=20) as client:
        peek = client.peek(descriptor)
        table = peek.block_table
        pool, bs = client.pool, table.block_size
        ok = True
        for layer in range(client.config.num_layers):
            for which, base in ((0, seed + layer), (1, seed + 100 + layer)):
                got = pool[list(table.physical_blocks), layer, which].reshape(
                    -1, client.config.num_kv_heads, client.config.head_dim
                )[:n]
                want = pattern(base, n, client.config.num_kv_heads, client.config.head_dim)
                ok = ok and torch.equal(got, want)
        peek.check()
        results.put((ok, table.sequence_length, len(table.physical_blocks) * bs >= n))


def coordinator_killed_mid_change(config_wire, address, conn):
    """A coordinator that, sent a slot, leaves that row's seqlock and the K/V scales'
    odd (a change under way) and is SIGKILLed right there."""
    from shmkv.memory.tables import LOCK, SEQ_FIELDS

    with shmkv.Coordinator(shmkv.PoolConfig.from_wire(config_wire), address=address) as coord:
        conn.send("ready")
        slot = conn.recv()
        coord.table.tables.seq[slot * SEQ_FIELDS + LOCK] += 1
        coord.memory.scale_lock[0] += 1
        os.kill(os.getpid(), signal.SIGKILL)


def allocate_then_die(address, prompt, queue, go):
    """Allocate a prompt with ``defer`` (it computes it: nothing cached), say so, and
    once told to, SIGKILL ourselves before committing anything."""
    client = shmkv.connect(address, timeout=20)
    h = client.allocate(prompt=prompt, defer=True)
    queue.put(h.num_cached_tokens)
    queue.close()
    queue.join_thread()
    go.wait(30)
    os.kill(os.getpid(), signal.SIGKILL)


def defer_racer(address, prompts, start, queue, done):
    """Allocate each prompt with ``defer=True`` once ``start`` is set; report which were
    allocated (the others were deferred to another process), hold them until ``done``."""
    with shmkv.connect(address, timeout=20) as client:
        start.wait(30)
        got = [client.allocate(prompt=p, defer=True) for p in prompts]
        queue.put([not isinstance(g, shmkv.Computing) for g in got])
        done.wait(30)


def export_bound_then_die(address, queue, go):
    """Export two bound hand-offs and one plain one of three sequences, hand the tokens
    to the parent, and once told to, SIGKILL ourselves (nobody opened the bound ones)."""
    client = shmkv.connect(address, timeout=20)
    bound = [client.allocate(8), client.allocate(8)]
    plain = client.allocate(8)
    tokens = [h.export(ttl=60, bound=True) for h in bound] + [plain.export(ttl=60)]
    queue.put(tokens)
    queue.close()
    queue.join_thread()
    go.wait(30)
    os.kill(os.getpid(), signal.SIGKILL)
