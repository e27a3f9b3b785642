"""The worker process of ``shmkv stress`` (:func:`worker_main`): a random mix of every
handle operation on its own sequences, forks, hand-offs and prefix hits, every read
checked against the values it wrote (the value scheme is ``shmkv.tools.stress_checks``'s),
and a report per round to the parent (``shmkv.tools.stress``), which routes its hand-off
tokens, kills and restarts it. Uses only shmkv's public API.
"""

from __future__ import annotations

import gc
import os
import random
import signal
import sys
import time
import traceback
from typing import Dict, List, Optional

from shmkv.tools.stress_checks import (
    _NUM_PREFIXES,
    TOKEN_TAG_BASE,
    expected_kv,
    prefix_tokens,
    token_tags,
)

_STATS_EVERY_S = 0.25


class _Tracked:
    """A handle this worker owns and the tag of each of its positions."""

    __slots__ = ("handle", "tags")

    def __init__(self, handle, tags: List[int]):
        self.handle = handle
        self.tags = tags


class _Worker:
    """One stress worker: a random mix of operations, every read verified."""

    WEIGHTS = {
        "allocate": 10,
        "prefix_allocate": 8,
        "extend": 8,
        "extend_many": 2,
        "step": 8,
        "write": 12,
        "read": 20,
        "fork": 6,
        "clone": 5,
        "export": 5,
        "self_handoff": 2,
        "close": 9,
    }

    def __init__(self, slot: int, client, conn, rng: random.Random, opts: dict):
        self.slot = slot
        self.client = client
        self.conn = conn
        self.rng = rng
        self.opts = opts
        cfg = client.config
        self.num_layers, self.head_dim = cfg.num_layers, cfg.head_dim
        self.num_heads = client.pool.shape[4]
        self.block_size = cfg.block_size
        self.dtype = client.pool.dtype
        self.seqs: List[_Tracked] = []
        self.inbox: list = []
        self.quota: Optional[int] = opts.get("quota")
        self.num_done = 0
        self.stopping = False
        self._ops: Dict[str, int] = {}
        self._errors: Dict[str, int] = {}
        self._latency: Dict[str, List[float]] = {}
        self._corrupted = 0
        self._verified = 0
        self._samples: List[str] = []
        self._last_flush = time.monotonic()
        self.last_op = "connect"
        names = list(self.WEIGHTS)
        self._op_names = names
        self._op_weights = [self.WEIGHTS[n] for n in names]

    # -- bookkeeping ---------------------------------------------------------------------

    def timed(self, name: str, fn, *args, **kwargs):
        """Run one API call, recording its latency and outcome; re-raises errors."""
        from shmkv.errors import CoordinatorGone

        self.last_op = name
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        except CoordinatorGone:
            raise
        except Exception as exc:
            key = type(exc).__name__
            self._errors[key] = self._errors.get(key, 0) + 1
            raise
        finally:
            self._latency.setdefault(name, []).append(time.perf_counter() - t0)
            self._ops[name] = self._ops.get(name, 0) + 1
            self.num_done += 1

    def flush(self, force: bool = False) -> None:
        """Send the counters gathered since the last flush to the parent."""
        now = time.monotonic()
        if not force and now - self._last_flush < _STATS_EVERY_S:
            return
        self._last_flush = now
        self.conn.send(
            (
                "stats",
                self.slot,
                self._ops,
                self._errors,
                self._latency,
                self._corrupted,
                self._verified,
                self._samples,
            )
        )
        self._ops, self._errors, self._latency = {}, {}, {}
        self._corrupted = self._verified = 0
        self._samples = []

    def poll_parent(self) -> None:
        while self.conn.poll():
            message = self.conn.recv()
            if message[0] == "stop":
                self.stopping = True
            elif message[0] == "token":
                self.inbox.append((message[1], message[2]))

    # -- data ----------------------------------------------------------------------------

    def kv(self, tags: List[int], start: int):
        return expected_kv(tags, start, self.num_layers, self.num_heads, self.head_dim, self.dtype)

    def verify(self, tracked: _Tracked, handle=None) -> bool:
        """Read through ``handle`` (default: the tracked one) and compare with the tags."""
        import torch

        h = handle if handle is not None else tracked.handle
        n = h.num_tokens
        want = self.kv(tracked.tags[:n], 0)
        if self.rng.random() < 0.5:
            got = self.timed("read", h.gather_all)
        else:
            layer = self.rng.randrange(self.num_layers)
            which = self.rng.randrange(2)
            fn = h.key_cache if which == 0 else h.value_cache
            got = self.timed("read", fn, layer)
            want = want[layer, which]
        self._verified += want.numel()
        if got.shape == want.shape and torch.equal(got, want):
            return True
        self._corrupted += 1
        if len(self._samples) < 5:
            if got.shape != want.shape:
                where = f"shape {tuple(got.shape)} != {tuple(want.shape)}"
            else:
                bad = (got != want).nonzero()
                where = f"{bad.shape[0]} values differ, first at {bad[0].tolist()}"
            self._samples.append(
                f"worker {self.slot} pid {os.getpid()}: {h.cache_id} ({n} tokens): {where}"
            )
        return False

    def write_range(self, tracked: _Tracked, start: int, tags: List[int]) -> None:
        """Write positions ``[start, start + len(tags))`` with the values of ``tags``."""
        h = tracked.handle
        kv = self.kv(tags, start)
        if self.rng.random() < 0.5:
            self.timed("write_all", h.write_all, kv, start=start)
        else:
            for layer in range(self.num_layers):
                self.timed("write", h.write, layer, kv[layer, 0], kv[layer, 1], start=start)
        tracked.tags[start : start + len(tags)] = tags

    def new_tag(self) -> int:
        return self.rng.randrange(1, TOKEN_TAG_BASE)

    def pick(self) -> Optional[_Tracked]:
        return self.rng.choice(self.seqs) if self.seqs else None

    def drop(self, tracked: _Tracked) -> None:
        """Close a tracked handle and forget it."""
        self.seqs.remove(tracked)
        self.timed("close", tracked.handle.close)

    def relieve_pressure(self) -> None:
        """After PoolExhausted: close one of our sequences, if we have any."""
        if self.seqs:
            self.drop(self.rng.choice(self.seqs))

    # -- operations ----------------------------------------------------------------------

    def op_allocate(self) -> None:
        from shmkv.errors import PoolExhausted

        n = self.rng.randrange(0, 3 * self.block_size + 1)
        try:
            h = self.timed("allocate", self.client.allocate, n)
        except PoolExhausted:
            return self.relieve_pressure()
        tracked = _Tracked(h, [0] * n)
        self.seqs.append(tracked)
        if n:
            self.write_range(tracked, 0, [self.new_tag()] * n)

    def op_prefix_allocate(self) -> None:
        from shmkv.errors import PoolExhausted

        index = self.rng.randrange(self.opts.get("num_prefixes", _NUM_PREFIXES))
        prefix = prefix_tokens(index, (2 + index % 3) * self.block_size)
        tokens = prefix + [
            self.rng.randrange(50000) for _ in range(self.rng.randrange(0, 2 * self.block_size))
        ]
        try:
            h = self.timed("prefix_allocate", self.client.allocate, prompt=tokens)
        except PoolExhausted:
            return self.relieve_pressure()
        tags = token_tags(tokens)
        cached = h.num_cached_tokens
        tracked = _Tracked(h, list(tags))
        self.seqs.append(tracked)
        if cached:
            self.verify(tracked, _Prefix(h, cached))
        if cached < len(tokens):
            self.write_range(tracked, cached, tags[cached:])
        self.timed("commit", h.commit)

    def op_extend(self) -> None:
        from shmkv.errors import PoolExhausted

        tracked = self.pick()
        if tracked is None or len(tracked.tags) >= self.opts["max_tokens"]:
            return self.op_allocate()
        n = self.rng.randrange(1, 2 * self.block_size + 1)
        try:
            start = self.timed("extend", tracked.handle.extend, n)
        except PoolExhausted:
            return self.relieve_pressure()
        tracked.tags += [0] * n
        self.write_range(tracked, start, [self.new_tag()] * n)

    def op_extend_many(self) -> None:
        from shmkv.errors import PoolExhausted

        room = [t for t in self.seqs if len(t.tags) < self.opts["max_tokens"]]
        if len(room) < 2:
            return self.op_extend()
        chosen = self.rng.sample(room, min(len(room), self.rng.randrange(2, 5)))
        items = [(t.handle, self.rng.randrange(1, self.block_size + 1)) for t in chosen]
        try:
            starts = self.timed("extend_many", self.client.extend_many, items)
        except PoolExhausted:
            return self.relieve_pressure()
        for tracked, (_h, n), start in zip(chosen, items, starts):
            tracked.tags += [0] * n
            self.write_range(tracked, start, [self.new_tag()] * n)

    def op_step(self) -> None:
        """An engine step: one batch of our sequences, one round trip, every new token
        of the batch written with one copy (the batch data plane)."""
        import torch

        from shmkv.errors import PoolExhausted, StaleStep

        room = [t for t in self.seqs if len(t.tags) < self.opts["max_tokens"]]
        if not room:
            return self.op_allocate()
        chosen = self.rng.sample(room, min(len(room), self.rng.randrange(1, 9)))
        counts = [self.rng.randrange(0, 3) for _ in chosen]
        batch = self.timed("batch", self.client.batch, [t.handle for t in chosen])
        try:
            step = self.timed("step", batch.extend, counts)
        except PoolExhausted:
            return self.relieve_pressure()
        starts = (step.seq_lens - torch.tensor(counts, dtype=torch.int32)).tolist()
        new_tags = [[self.new_tag()] * n for n in counts]
        for tracked, n in zip(chosen, counts):
            tracked.tags += [0] * n
        parts = [self.kv(tags, start) for tags, start in zip(new_tags, starts) if tags]
        if not parts:
            return
        try:
            self.timed("step_write", step.write_all, torch.cat(parts, dim=2).contiguous())
        except StaleStep:  # another process forked one of them meanwhile: write per handle
            for tracked, tags, start in zip(chosen, new_tags, starts):
                if tags:
                    self.write_range(tracked, start, tags)
            return
        for tracked, tags, start in zip(chosen, new_tags, starts):
            tracked.tags[start : start + len(tags)] = tags

    def op_write(self) -> None:
        from shmkv.errors import PoolExhausted

        tracked = self.pick()
        if tracked is None or not tracked.tags:
            return self.op_allocate()
        n = len(tracked.tags)
        start = self.rng.randrange(n)
        end = self.rng.randrange(start + 1, min(n, start + 2 * self.block_size) + 1)
        try:
            self.write_range(tracked, start, [self.new_tag()] * (end - start))
        except PoolExhausted:  # copy-on-write found no block: nothing was written
            return self.relieve_pressure()

    def op_read(self) -> None:
        tracked = self.pick()
        if tracked is not None:
            self.verify(tracked)

    def op_fork(self) -> None:
        tracked = self.pick()
        if tracked is None:
            return self.op_allocate()
        child = self.timed("fork", tracked.handle.fork)
        self.seqs.append(_Tracked(child, list(tracked.tags)))

    def op_clone(self) -> None:
        tracked = self.pick()
        if tracked is None:
            return self.op_allocate()
        clone = self.timed("clone", tracked.handle.clone_handle)
        try:
            self.verify(tracked, clone)
        finally:
            self.timed("close", clone.close)

    def op_export(self) -> None:
        tracked = self.pick()
        if tracked is None:
            return self.op_allocate()
        token = self.timed("export", tracked.handle.export, self.opts["handoff_ttl"])
        self.drop(tracked)
        self.conn.send(("token", self.slot, token, tracked.tags))

    def op_self_handoff(self) -> None:
        tracked = self.pick()
        if tracked is None:
            return self.op_allocate()
        token = self.timed("export", tracked.handle.export, self.opts["handoff_ttl"])
        self.drop(tracked)
        self.open_token(token, tracked.tags)

    def op_close(self) -> None:
        tracked = self.pick()
        if tracked is not None:
            self.drop(tracked)

    def open_token(self, token: bytes, tags: List[int]) -> None:
        from shmkv.errors import HandoffError

        try:
            h = self.timed("open", self.client.open, token)
        except HandoffError:  # expired while in flight, or its opener died after opening
            return
        tracked = _Tracked(h, list(tags))
        self.seqs.append(tracked)
        self.verify(tracked)

    # -- loop ----------------------------------------------------------------------------

    def step(self) -> None:
        if self.inbox:
            token, tags = self.inbox.pop(0)
            return self.open_token(token, tags)
        if len(self.seqs) >= self.opts["max_seqs"]:
            return self.op_close()
        name = self.rng.choices(self._op_names, self._op_weights)[0]
        getattr(self, "op_" + name)()

    def run(self) -> None:
        while True:
            self.poll_parent()
            if self.stopping or (self.quota is not None and self.num_done >= self.quota):
                break
            self.step()
            self.flush()
        while self.seqs:
            self.drop(self.seqs[-1])
        for token, tags in self.inbox:  # never opened: give them back to the parent
            self.conn.send(("token", self.slot, token, tags))
        self.inbox = []
        self.flush(force=True)


class _Prefix:
    """A read-only view of the first ``n`` tokens of a handle, for checking prefix hits."""

    def __init__(self, handle, n: int):
        self._handle, self.num_tokens = handle, n
        self.cache_id = handle.cache_id

    def gather_all(self):
        return self._handle.gather_all()[:, :, : self.num_tokens]

    def key_cache(self, layer: int):
        return self._handle.key_cache(layer)[: self.num_tokens]

    def value_cache(self, layer: int):
        return self._handle.value_cache(layer)[: self.num_tokens]


def worker_main(slot: int, address: str, conn, seed: int, opts: dict) -> None:
    """Entry point of a worker process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C
    try:
        _work(slot, address, conn, seed, opts)
    finally:
        # The process only ran this worker and has released what it held: its exit skips
        # the interpreter's last collection of the import-time objects (torch's: half a
        # second of a 2-vCPU machine per worker, which the run's end waits for).
        gc.freeze()


def _work(slot: int, address: str, conn, seed: int, opts: dict) -> None:
    from shmkv.client.client import connect
    from shmkv.errors import CoordinatorGone

    worker = None
    try:
        try:
            client = connect(address, timeout=opts["timeout"])
        except CoordinatorGone:
            conn.send(("gone", slot, time.time(), "connect", 0))
            return
        conn.send(("ready", slot, os.getpid()))
        worker = _Worker(slot, client, conn, random.Random(seed), opts)
        try:
            worker.run()
        except CoordinatorGone:
            seen = time.time()
            valid = sum(t.handle.is_valid() for t in worker.seqs)
            worker.flush(force=True)
            conn.send(("gone", slot, seen, worker.last_op, valid))
            return
        client.close()
        conn.send(("done", slot))
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return  # the parent is gone
    except BaseException:
        try:
            if worker is not None:
                worker.flush(force=True)
            conn.send(("crash", slot, traceback.format_exc()))
        except OSError:
            pass
        sys.exit(1)
