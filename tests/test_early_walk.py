"""A seeded random walk over allocations answered early and the views of them.

A coordinator serves from a thread of this process with a host tier under its pool; its
tier copies go to a stand-in for the copier that runs a job only when the walk says
(promotions and demotions in any order, a job's completion sometimes handed back later
than its copies ran), so a promotion answered early (``allocate(..., wait=False)``) stays
in flight across any number of steps. Allocations that wait copy their promotions in the
client. A copy from the host tier fails now and then, after leaving bytes nobody wrote in
its pool block, so promotions come up short. Interleaved with them: settle, fork, clone,
fixed-length views, export and open (by a second client), peek (by the second client),
reads, commits with and without ``start`` (from the promise before settling, in chunks
after), batch steps and their commits, closes and evictions.

The K/V of a token is a function of the token ids alone (the prefix key of its block),
so what is checked does not depend on who wrote what:

* after every step, on the coordinator's own thread: every block a fresh prefix lookup
  would hit (each published pool block, each ready host-tier slot) holds its key's bytes;
* a clone, a view or an opened handle of a sequence says blocks are coming exactly while
  they are; a peek refuses (``NotSettled``) exactly then; ``settle`` answers the hit as
  the coordinator has it; a fork answers a settled child;
* what a view reads where its writer wrote (or where the settled hit says) is exact;
* a sequence written again from 0 and committed with ``start=0`` (through a handle or a
  batch step) has every full block published.

The walk is seeded; the loop's own timing may still vary which blocks the host tier
holds between runs. Set ``SHMKV_EARLY_WALK_SEEDS`` for more walks.
"""

from __future__ import annotations

import errno
import os
import random
import threading
import time

import numpy as np
import pytest
import torch

import shmkv
from shmkv import hashing, tiers as tiers_mod
from shmkv.memory import block_io

L, H, D, BS = 2, 2, 4, 4
NUM_BLOCKS = 24
HOST_SLOTS = 12
MAX_SEQS = 6
STEPS = 400
SEEDS = int(os.environ.get("SHMKV_EARLY_WALK_SEEDS", "24"))
WAIT_S = 20.0
POISON = 0xAB

_GRID = (
    torch.arange(L)[:, None, None, None, None] * 64
    + torch.arange(2)[None, :, None, None, None] * 32
    + torch.arange(BS)[None, None, :, None, None] * 8
    + torch.arange(H)[None, None, None, :, None] * 4
    + torch.arange(D)[None, None, None, None, :]
).to(torch.float32)


def block_values(key: bytes) -> torch.Tensor:
    """K/V ``[L, 2, BS, H, D]`` of the full block whose prefix key is ``key`` (exact in
    float32)."""
    return _GRID + float(int.from_bytes(key[:3], "little") % 4096 * 256)


def token_values(tokens: list) -> torch.Tensor:
    """K/V ``[L, 2, len(tokens), H, D]``: a full block's by its key, the tail's by the key
    the tail would have as a block padded with zeros."""
    root = hashing.root_key()
    keys = hashing.block_keys(tokens, BS, root)
    parts = [block_values(k) for k in keys]
    tail = len(tokens) - len(keys) * BS
    if tail:
        parent = keys[-1] if keys else root
        pad = tokens[len(keys) * BS :] + [0] * (BS - tail)
        parts.append(block_values(hashing.block_keys(pad, BS, parent)[0])[:, :, :tail])
    return torch.cat(parts, dim=2)


class StepCopier:
    """Takes the jobs the tiers' copier threads would, and runs one only when asked."""

    def __init__(self, mover, finish):
        self.mover, self.finish = mover, finish
        self.lock = threading.Lock()  # (the loop submits, the walk runs)
        self.jobs: list = []  # (queue, job) submitted, not run
        self.ran: list = []  # jobs run whose completion is not handed back yet

    def submit(self, queue, job):
        if not job.copies:
            self.finish(job)
            return
        with self.lock:
            self.jobs.append((queue, job))

    def _run(self, job, split: bool) -> None:
        self.mover.run(job.copies, lambda: False)
        if split:
            with self.lock:
                self.ran.append(job)
        else:
            self.finish(job)

    def step(self, rng) -> bool:
        with self.lock:
            if self.ran and (not self.jobs or rng.random() < 0.5):
                done = self.ran.pop(rng.randrange(len(self.ran)))
                job = None
            elif self.jobs:
                _, job = self.jobs.pop(rng.randrange(len(self.jobs)))
            else:
                return False
        if job is None:
            self.finish(done)
        else:
            self._run(job, rng.random() < 0.3)
        return True

    def run_promotions(self) -> None:
        """Every promotion queued or run, to its end (in the order they came)."""
        with self.lock:
            jobs = [job for queue, job in self.jobs if queue == block_io.PROMOTE]
            self.jobs = [(q, j) for q, j in self.jobs if q != block_io.PROMOTE]
            ran, self.ran = self.ran, []
        for job in ran:
            self.finish(job)
        for job in jobs:
            self._run(job, False)

    def run_demotions(self) -> None:
        """Every demotion queued, in the order they came (the host tier takes them)."""
        with self.lock:
            jobs = [job for queue, job in self.jobs if queue != block_io.PROMOTE]
            self.jobs = [(q, j) for q, j in self.jobs if q == block_io.PROMOTE]
        for job in jobs:
            self._run(job, False)

    def close(self, timeout=0.0):
        pass


class Seq:
    """The walk's model of one sequence: its tokens, the hit it was promised and the one
    it settled at (None until known), the positions known to hold their K/V, and the
    handles on it ``(handle, kind)``: main, clone, view, opened, fork."""

    def __init__(self, tokens, promise, hit, cache_id):
        self.tokens = tokens
        self.values = token_values(tokens)
        self.keys = hashing.block_keys(tokens, BS, hashing.root_key())
        self.promise = promise
        self.hit = hit
        self.good = np.zeros(len(tokens), dtype=bool)
        self.cache_id = cache_id
        self.handles: list = []

    def first_bad(self) -> int:
        bad = np.flatnonzero(~self.good)
        return int(bad[0]) if bad.size else len(self.tokens)


class Walk:
    def __init__(self, seed, coord, client, other):
        self.rng = random.Random(seed)
        self.coord, self.client, self.other = coord, client, other
        self.tiers = coord.tiers
        self.table = coord.table
        self.seqs: list = []
        self.trace: list = []  # what the walk did (the last steps are shown on a failure)
        self.seen: list = []  # prompts allocated before (a lower tier may hold them)
        self.fail_rate = self.rng.choice([0.2, 0.4, 0.6])  # of a run of tier copies
        # how often the walk reached the states it is about (-s shows them)
        self.num = dict.fromkeys(
            (
                "early",  # answered early, blocks still coming
                "short",  # settled at less than it was promised
                "rewrites",  # commits from within what a short promotion lost
                "promoting_views",  # clones, views, opened handles while blocks came
                "refused_peeks",
                "waited_forks",
                "guarded_forks",  # forks of a sequence that must write lost blocks again
            ),
            0,
        )
        vocab = [3, 5, 7]
        base = [[self.rng.choice(vocab) for _ in range(6 * BS)] for _ in range(8)]
        self.prompts = [
            b[: n * BS] + [self.rng.choice(vocab) for _ in range(tail)]
            for b in base
            for n in (2, 3, 4, 5)
            for tail in (0, 2)
        ]

    # -- the loop's side -------------------------------------------------------------------

    def drain(self) -> None:
        """Until the promotions the loop was asked to start are started and the copies
        handed back are taken (a ping is then served after that turn), then the checks
        run on the loop's thread."""
        deadline = time.monotonic() + WAIT_S
        while self.coord._to_promote or self.tiers._done:
            assert time.monotonic() < deadline, "the loop never took the copies"
            time.sleep(0.0005)
        bad = self.client.request("ping")["bad"]
        assert not bad, "\n".join(bad + self.trace[-40:])

    def check_on_loop(self) -> list:
        """What a fresh prefix lookup would hit holds its key's bytes (the loop's thread:
        nothing moves meanwhile)."""
        bad = []
        pool = self.table.pool
        pool_np = self.tiers._pool_np[0]
        for block in range(pool.num_blocks):
            key = pool.block_key[block]
            if key is not None:
                want = block_values(key).numpy().reshape(-1).view(np.uint8)
                if not (pool_np[block].reshape(-1) == want).all():
                    bad.append(f"pool block {block} is published without its key's bytes")
        # A sequence's committed blocks are what it published, or would have, had another
        # block not published the same key first (not while its blocks still come in).
        for seq in self.table.sequences.values():
            if seq.promoting or not seq.keys:
                continue
            for index in range(min(seq.num_committed, len(seq.keys))):
                block = seq.block_ids[index]
                want = block_values(seq.keys[index]).numpy().reshape(-1).view(np.uint8)
                if not (pool_np[block].reshape(-1) == want).all():
                    bad.append(f"block {index} of kv-{seq.cache_id:x} is committed wrong")
        host = self.tiers.host
        for key, entry in host.index.items():
            if entry.ready:
                want = block_values(key).numpy().reshape(-1).view(np.uint8)
                if not (host.np[entry.slot] == want).all():
                    bad.append(f"host slot {entry.slot} is ready without its key's bytes")
        return bad

    def in_tier(self, tokens: list) -> bool:
        """Whether an allocation of ``tokens`` would promote a block (quiet loop)."""
        keys = hashing.block_keys(tokens, BS, hashing.root_key())
        hits = len(self.table.pool.lookup(keys))
        return hits < len(keys) and keys[hits] in self.tiers.host.index

    def promoting(self, seq: Seq) -> bool:
        live = self.table.sequences.get(seq.cache_id)
        return live is not None and live.promoting > 0

    def waiting(self, fn):
        """``fn()`` (a request that waits for a promotion) in a thread, while every
        promotion runs to its end here."""
        out: dict = {}

        def run():
            try:
                out["value"] = fn()
            except BaseException as exc:  # (raised below, in the walk's thread)
                out["error"] = exc

        thread = threading.Thread(target=run)
        thread.start()
        time.sleep(0.001)  # (mostly it waits in the loop before the copies end)
        self.copier.run_promotions()
        thread.join(WAIT_S)
        assert not thread.is_alive(), "a request that waited for a promotion never returned"
        if "error" in out:
            raise out["error"]
        return out["value"]

    # -- helpers ---------------------------------------------------------------------------

    @staticmethod
    def early(seq: Seq) -> bool:
        """Answered early and not settled yet, or settled short and not written again."""
        return seq.hit is None or (seq.hit < seq.promise and not seq.good.all())

    def pick(self, kinds=("main", "clone", "opened", "fork"), client=None):
        """A random (seq, handle) of a live sequence, its handle of one of ``kinds``; more
        often one of a sequence answered early: not settled yet, or settled short and not
        written again yet, where there is one."""
        choices = [
            (seq, h)
            for seq in self.seqs
            for h, kind in seq.handles
            if kind in kinds and (client is None or h.client is client)
        ]
        early = [(seq, h) for seq, h in choices if self.early(seq)]
        if early and self.rng.random() < 0.7:
            choices = early
        return self.rng.choice(choices) if choices else (None, None)

    def write(self, seq: Seq, h, start: int, end: int) -> None:
        for layer in range(L):
            k = seq.values[layer, 0, start:end].contiguous()
            v = seq.values[layer, 1, start:end].contiguous()
            h.write(layer, k, v, start=start)
        seq.good[start:end] = True

    def add(self, seq: Seq, h, kind: str) -> None:
        seq.handles.append((h, kind))
        if seq not in self.seqs:
            self.seqs.append(seq)

    def check_view(self, seq: Seq, h) -> None:
        """A new view on ``seq`` says blocks are coming exactly while they are."""
        coming = self.promoting(seq)
        assert (h.num_promoting_tokens > 0) == coming, (h.num_promoting_tokens, coming)
        assert h.num_cached_tokens == self.table.sequences[seq.cache_id].num_cached
        self.num["promoting_views"] += coming

    def all_published(self, seq: Seq) -> None:
        """Every full block of ``seq`` is published (or its key was, by another block)."""
        done = self.table.sequences[seq.cache_id].num_committed
        assert done == len(seq.keys), (
            f"{done} of {len(seq.keys)} blocks published after a commit from 0"
        )

    # -- the steps -------------------------------------------------------------------------

    def allocate(self) -> None:
        while len(self.seqs) >= MAX_SEQS:
            self.close(whole=True)
        # mostly a prompt whose next block after its pool hits the host tier holds
        tokens = self.rng.choice(self.prompts)
        if self.rng.random() < 0.8:
            promoting = [p for p in self.seen if self.in_tier(p)]
            if promoting:
                tokens = self.rng.choice(promoting)
        early = self.rng.random() < 0.75
        try:
            h = self.client.allocate(prompt=tokens, wait=not early)
        except shmkv.PoolExhausted:
            return
        if tokens not in self.seen:
            self.seen.append(tokens)
        seq = Seq(tokens, h.num_cached_tokens, None, h._cache_id)
        self.trace.append(
            f"  alloc {h.cache_id} n={len(tokens)} early={early} "
            f"cached={h.num_cached_tokens} promoting={h.num_promoting_tokens}"
        )
        if early and h.num_promoting_tokens:
            self.num["early"] += 1
            seq.good[: h.num_resident_tokens] = True
        else:
            seq.hit = h.num_cached_tokens
            seq.good[: seq.hit] = True
        self.add(seq, h, "main")
        if seq.hit is not None and self.rng.random() < 0.7:  # an engine's prefill
            try:
                self.write(seq, h, seq.hit, len(tokens))
            except shmkv.PoolExhausted:
                return
            h.commit(start=seq.hit)

    def settle(self) -> None:
        ended = [
            (seq, h)
            for seq in self.seqs
            if seq.hit is None and not self.promoting(seq)
            for h, _kind in seq.handles
        ]
        if ended and self.rng.random() < 0.7:  # (a promotion that ended: settle it)
            seq, h = self.rng.choice(ended)
        else:
            seq, h = self.pick(("main", "clone", "view", "opened", "fork"))
        if seq is None:
            return
        got = self.waiting(h.settle) if self.promoting(seq) else h.settle()
        live = self.table.sequences[seq.cache_id]
        assert got == live.num_cached and not live.promoting
        if seq.hit is None:
            seq.hit = got
            self.num["short"] += got < seq.promise
        seq.good[:got] = True

    def write_commit(self) -> None:
        seq, h = self.pick()
        if seq is None:
            return
        n = len(seq.tokens)
        start = None
        if seq.hit is None:  # not settled: it writes from the promise, as told
            end = seq.promise
            if seq.promise < n and self.rng.random() < 0.8:
                try:
                    self.write(seq, h, seq.promise, n)
                except shmkv.PoolExhausted:
                    return
                end = n
            if self.rng.random() < 0.8:
                start = seq.promise
            self.trace.append(f"  early-commit {h.cache_id} {end} start={start}")
            h.commit(end, start=start)
            return
        r = self.rng.random()
        start = seq.first_bad() if r < 0.6 else seq.hit if r < 0.85 else 0
        start = min(start, n)
        # (in chunks of up to two blocks, mostly: each one's commit publishes what the
        # chunks so far cover)
        end = min(n, start + self.rng.randint(1, 2 * BS)) if self.rng.random() < 0.7 else n
        try:
            self.write(seq, h, start, end)
        except shmkv.PoolExhausted:  # (copies on write: nothing was written)
            return
        with_start = self.rng.random() < 0.8
        self.num["rewrites"] += seq.hit < seq.promise and with_start and start < seq.promise
        self.trace.append(f"  write {h.cache_id} [{start},{end}) with start={with_start}")
        h.commit(end, start=start if with_start else None)
        if with_start and start == 0 and end == n:
            self.drain()
            self.all_published(seq)

    def batch_commit(self) -> None:
        chosen, seen = [], set()
        for seq in self.rng.sample(self.seqs, len(self.seqs)):
            if seq.hit is None or id(seq) in seen or seq.first_bad() >= len(seq.tokens):
                continue
            hs = [h for h, kind in seq.handles if kind != "view" and h.client is self.client]
            if hs:
                chosen.append((seq, self.rng.choice(hs)))
                seen.add(id(seq))
            if len(chosen) == 3:
                break
        if not chosen:
            return
        from_zero = self.rng.random() < 0.3
        starts = [0 if from_zero else seq.first_bad() for seq, _ in chosen]
        counts = [len(seq.tokens) - s for (seq, _), s in zip(chosen, starts)]
        try:
            step = self.client.batch([h for _, h in chosen]).prefill(
                start=starts, num_tokens=counts
            )
        except shmkv.PoolExhausted:  # (copies on write: nothing was written)
            return
        for layer in range(L):
            parts = [
                seq.values[layer, :, s : s + c] for (seq, _), s, c in zip(chosen, starts, counts)
            ]
            kv = torch.cat(parts, dim=1)
            step.write(layer, kv[0].contiguous(), kv[1].contiguous())
        self.trace.append(f"  batch {[h.cache_id for _, h in chosen]} {starts} {counts}")
        step.commit()
        for (seq, _), s in zip(chosen, starts):
            seq.good[s:] = True
        if from_zero:
            self.drain()
            for seq, _ in chosen:
                self.all_published(seq)

    def fork(self) -> None:
        seq, h = self.pick()
        if seq is None or len(self.seqs) >= MAX_SEQS:
            return
        waited = self.promoting(seq)
        try:
            child_h = self.waiting(h.fork) if waited else h.fork()
        except shmkv.PoolExhausted:
            return
        self.num["waited_forks"] += waited
        self.num["guarded_forks"] += self.table.sequences[seq.cache_id].gap is not None
        assert child_h.num_promoting_tokens == 0 and not self.promoting(seq)
        live = self.table.sequences[seq.cache_id]  # (settled now: its hit as it is)
        child = Seq(seq.tokens, seq.promise, live.num_cached, child_h._cache_id)
        child.good[:] = seq.good
        child.good[: live.num_cached] = True
        self.add(child, child_h, "fork")

    def clone(self) -> None:
        seq, h = self.pick()
        if seq is None:
            return
        if self.rng.random() < 0.5:
            new, kind = h.clone_handle(), "clone"
        else:
            new, kind = h.with_sequence_length(self.rng.randint(0, len(seq.tokens))), "view"
        self.check_view(seq, new)
        self.add(seq, new, kind)

    def export_open(self) -> None:
        seq, h = self.pick(("main", "clone", "fork"), client=self.client)
        if seq is None:
            return
        opened = self.other.open(h.export(ttl=60))
        self.check_view(seq, opened)
        self.add(seq, opened, "opened")

    def peek(self) -> None:
        seq, h = self.pick(("main", "clone", "view", "opened", "fork"))
        if seq is None:
            return
        if self.promoting(seq):
            with pytest.raises(shmkv.NotSettled):
                self.other.peek(h.descriptor())
            self.num["refused_peeks"] += 1
            return
        peek = self.other.peek(h.descriptor())
        blocks = peek.block_table.physical_blocks
        pool = self.other.pool
        for p in np.flatnonzero(seq.good).tolist():
            got = pool[blocks[p // BS], :, :, p % BS]
            assert torch.equal(got, seq.values[:, :, p]), f"peeked position {p}"
        peek.check()

    def read(self) -> None:
        seq, h = self.pick(("main", "clone", "view", "opened", "fork"))
        if seq is None or h.num_promoting_tokens:
            return
        n = h.num_tokens
        good = np.flatnonzero(seq.good[:n])
        for layer in range(L):
            k, v = h.kv_cache(layer)
            assert torch.equal(k[good], seq.values[layer, 0, good]), f"read layer {layer}"
            assert torch.equal(v[good], seq.values[layer, 1, good]), f"read layer {layer}"

    def close(self, whole: bool = False) -> None:
        """Close a handle (or, ``whole``, every handle of its sequence)."""
        done = [(seq, h) for seq in self.seqs if not self.early(seq) for h, _ in seq.handles]
        if done and self.rng.random() < 0.7:  # (those answered early live on, mostly)
            seq, h = self.rng.choice(done)
        else:
            seq, h = self.pick(("main", "clone", "view", "opened", "fork"))
        if seq is None:
            return
        gone = [x for x, _ in seq.handles] if whole or self.rng.random() < 0.3 else [h]
        for x in gone:
            x.close()
        seq.handles = [(x, k) for x, k in seq.handles if x not in gone]
        if not seq.handles:
            self.seqs.remove(seq)

    def copy(self) -> None:
        for _ in range(self.rng.randint(1, 3)):
            self.copier.step(self.rng)

    def evict(self) -> None:
        """Push what the pool caches out (what the host tier took stays there)."""
        self.copier.run_demotions()
        self.drain()
        st = self.other.stats()
        try:
            self.other.allocate((st["free_blocks"] + st["cached_blocks"]) * BS).close()
        except shmkv.PoolExhausted:
            pass

    def run(self, steps: int) -> None:
        moves = [
            (self.allocate, 18),
            (self.copy, 10),
            (self.settle, 6),
            (self.write_commit, 14),
            (self.batch_commit, 5),
            (self.fork, 6),
            (self.clone, 8),
            (self.export_open, 6),
            (self.peek, 8),
            (self.read, 4),
            (self.close, 9),
            (self.evict, 12),
        ]
        funcs, weights = zip(*moves)
        for _ in range(steps):
            move = self.rng.choices(funcs, weights)[0]
            self.trace.append(move.__name__)
            move()
            self.drain()
        self.finish()

    def finish(self) -> None:
        """Every promotion ends and every sequence settles; then each is written again
        from 0 and committed with ``start=0`` (through a batch step, or a handle), after
        which every full block of it is published; every handle closes."""
        self.copier.run_promotions()
        self.drain()
        for seq in self.seqs:
            h = seq.handles[0][0]
            got = self.waiting(h.settle) if self.promoting(seq) else h.settle()
            seq.good[:got] = True
            self.drain()
        for i, seq in enumerate(self.seqs):
            mine = [h for h, kind in seq.handles if kind != "view" and h.client is self.client]
            n = len(seq.tokens)
            try:
                if mine and i % 2:
                    step = self.client.batch(mine[:1]).prefill(start=0, num_tokens=n)
                    for layer in range(L):
                        kv = seq.values[layer]
                        step.write(layer, kv[0].contiguous(), kv[1].contiguous())
                    step.commit()
                else:
                    h = next(h for h, kind in seq.handles if kind != "view")
                    self.write(seq, h, 0, n)
                    h.commit(start=0)
            except (shmkv.PoolExhausted, StopIteration):  # (copies on write; only views)
                continue
            self.drain()
            self.all_published(seq)
        while self.copier.step(self.rng):
            self.drain()
        for seq in self.seqs:
            for h, _kind in seq.handles:
                h.close()
        self.seqs.clear()
        self.drain()
        self.table.check_invariants()


def _failing_copies(monkeypatch, walk_ref: list) -> None:
    """Copies from the host tier into the pool fail now and then (at the walk's rate, per
    run of copies): from a copy picked at random on, every one of the run fails after
    leaving :data:`POISON` in its block, as copies do whose source went bad half-way."""
    run, op_h2p = block_io.Mover.run, block_io.Mover._op_h2p
    doomed: set = set()

    def run_copies(mover, copies, stopping):
        walk = walk_ref[0]
        copies = list(copies)
        h2p = [c for c in copies if c.op == "h2p"]
        if walk is not None and h2p and walk.rng.random() < walk.fail_rate:
            doomed.update(id(c) for c in h2p[walk.rng.randrange(len(h2p)) :])
        try:
            run(mover, copies, stopping)
        finally:
            doomed.difference_update(id(c) for c in copies)

    def copy_in(mover, copy):
        if id(copy) in doomed:
            for pool in mover.pool_np:
                pool[copy.block][...] = POISON
            raise OSError(errno.EIO, "Input/output error (injected)")
        op_h2p(mover, copy)

    monkeypatch.setattr(block_io.Mover, "run", run_copies)
    monkeypatch.setattr(block_io.Mover, "_op_h2p", copy_in)


@pytest.mark.parametrize("seed", range(SEEDS))
def test_early_answers_walk(seed, monkeypatch, unique_name):
    monkeypatch.setattr(tiers_mod, "IO_PROCESS", False)
    monkeypatch.setattr(shmkv.Client, "copy_promotions", True)  # (wait=True copies here)
    walk_ref: list = [None]
    _failing_copies(monkeypatch, walk_ref)
    cfg = shmkv.PoolConfig(
        num_layers=L,
        num_kv_heads=H,
        head_dim=D,
        num_blocks=NUM_BLOCKS,
        block_size=BS,
        dtype=torch.float32,
    )
    tier = shmkv.HostTier(HOST_SLOTS * cfg.block_nbytes)
    with shmkv.Coordinator(cfg, name=unique_name, tiers=[tier]) as coord:
        tiers = coord.tiers
        threads = tiers._copier
        copier = StepCopier(threads.mover, tiers._finish)
        tiers._copier = copier
        threads.close(5)
        with (
            shmkv.connect(coord.address, timeout=WAIT_S) as client,
            shmkv.connect(coord.address, timeout=WAIT_S) as other,
        ):
            walk = Walk(seed, coord, client, other)
            walk.copier = copier
            walk_ref[0] = walk
            monkeypatch.setattr(coord._ops, "_op_ping", lambda conn: {"bad": walk.check_on_loop()})
            try:
                walk.run(STEPS)
            finally:
                walk_ref[0] = None
                copier.run_promotions()
                while copier.step(random.Random(0)):
                    pass
    print(seed, walk.num)
    assert walk.num["early"] >= 5 and walk.num["promoting_views"] >= 1, walk.num
