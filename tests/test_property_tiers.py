"""Property test of the tiers and the shared store: every byte served is the byte written.

A hypothesis state machine drives two nodes that share a real ``redis-server``:

* node A, a coordinator in a thread of this process, with tiers under its pool (one of:
  host memory and a disk directory, host memory alone, a disk directory alone) and the
  store; its pool is split between two tensor-parallel ranks. Rank 0 allocates, makes
  batch steps and commits; rank 1 rebuilds every step from its descriptor
  (``client.step_from``), writes its head shard and commits it. Rules demote (evict every
  cached block), promote (allocate a prompt seen before), restart (a new coordinator on
  the same directory), damage a block file, close with ``close_many(wait=False)`` and
  allocate again at once, and write through a rank 1 step whose sequences were closed
  meanwhile (which must raise ``StaleStep`` or ``HandleClosed``, and write nothing);
* node B, a coordinator in its own process on the same store, also split in two ranks,
  which reads what A published and publishes prompts of its own in a burst: rank 1's
  commit (the one that publishes), the release of the sequence (``close_many(wait=
  False)``) and an allocation that evicts its blocks and takes them, all served in one
  loop turn (B is stopped with SIGSTOP while the three are sent, and the store until the
  new owner has written its K/V). B's process is started once for the whole run; each
  example starts from an empty store and nothing cached in B's pool.

K/V of a prompt's full block is a function of its prefix key alone (:func:`block_values`),
so what any node serves for a prefix, and every value the store holds, can be checked
without knowing who wrote it: every prefix hit of either node is read back in full and
compared, and the store is audited value by value. Other slots hold values of a tag the
model keeps (negative, so they never equal a prompt's). After every step node A's tables
are consistent and every live sequence reads back exactly what was written, rank by rank.
After a quiet period every block cached in A's pool is on one of its local tiers, unless
a tier counted a block it dropped or failed to write since the last such check.

``SHMKV_PROPERTY_EXAMPLES`` (default 15) sets the number of examples: about half a minute
on two CPUs (a failure's shrinking takes longer); set it to a few hundred for a long run.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import threading
import time
import uuid

import psutil
import pytest
import torch
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

import shmkv
from shmkv import hashing
from shmkv.tiers.redis_store import HEADER_SIZE

redis = pytest.importorskip(
    "redis", reason="the redis client is not installed: pip install -e '.[test]'"
)
# (after the skip above: test_remote needs the redis client too)
from test_remote import SERVER, RedisServer, _free_port  # noqa: E402

L, H, D, BS, TP = 2, 2, 2, 2, 2  # one head per rank
NUM_BLOCKS_A, NUM_BLOCKS_B = 20, 16
HOST_SLOTS = 4  # fewer than one close can cache: bursts overflow it
VOCAB = [3, 5, 7]  # a tiny vocabulary, so prompts share prefixes often
EXAMPLES = int(os.environ.get("SHMKV_PROPERTY_EXAMPLES", "15"))
WAIT_S = 20.0
PROMPT = st.lists(st.sampled_from(VOCAB), min_size=BS, max_size=12)
SEEN = st.none() | st.integers(0, 1 << 16)
PICKS = st.lists(st.integers(0, 15), min_size=1, max_size=4)
# A tier's counters of blocks it dropped (its LRU), skipped, lost or could not write.
LOSS_COUNTERS = (
    "dropped",
    "skipped",
    "lost",
    "discarded",
    "errors",
    "full",
    "removed_damaged",
    "removed_incomplete",
)

# [L, 2, BS, H, D]: what sets apart the values of one block's positions.
_GRID = (
    torch.arange(BS)[None, None, :, None, None] * 32
    + torch.arange(L)[:, None, None, None, None] * 8
    + torch.arange(2)[None, :, None, None, None] * 4
    + torch.arange(H)[None, None, None, :, None] * 2
    + torch.arange(D)[None, None, None, None, :]
).to(torch.float32)


def block_values(key: bytes) -> torch.Tensor:
    """K/V ``[L, 2, BS, H, D]`` of the full block whose prefix key is ``key`` (exact in
    float32: integers below 2**21)."""
    return _GRID + float(int.from_bytes(key[:3], "little") % 4096 * 256)


def prompt_values(prompt: list) -> torch.Tensor:
    """K/V ``[L, 2, len(prompt), H, D]`` of a prompt: its full blocks' by their keys, the
    tail's by the key the tail would have as a block (a hash of parent key and tokens)."""
    keys = hashing.block_keys(prompt, BS, hashing.root_key())
    parts = [block_values(k) for k in keys]
    tail = len(prompt) - len(keys) * BS
    if tail:
        parent = keys[-1] if keys else hashing.root_key()
        parts.append(
            block_values(
                hashing.block_keys(prompt[len(keys) * BS :] + [0] * (BS - tail), BS, parent)[0]
            )[:, :, :tail]
        )
    return torch.cat(parts, dim=2) if parts else torch.zeros(L, 2, 0, H, D)


def tag_values(tag: int, n: int) -> torch.Tensor:
    """K/V ``[L, 2, n, H, D]`` of slots written with ``tag`` (negative: never a prompt's)."""
    pos = torch.arange(n, dtype=torch.float32)[None, None, :, None, None] * 64
    return -(float((tag + 1) * 4096) + pos + _GRID[:, :, :1])


def read_blocks(full_client, blocks: list, n: int) -> torch.Tensor:
    """``[L, 2, n, H, D]``: the first ``n`` slots of ``blocks``, every head, read through
    a client that sees the whole pool."""
    if not blocks:
        return torch.zeros(L, 2, 0, H, D)
    got = full_client.pool[torch.tensor(blocks, dtype=torch.int64)]  # [nb, L, 2, BS, H, D]
    return got.permute(1, 2, 0, 3, 4, 5).reshape(L, 2, len(blocks) * BS, H, D)[:, :, :n]


def check_hit(full_client, handle, prompt: list, node: str) -> int:
    """The prefix a prompt allocation was served, read back in full: it must be the K/V
    of those blocks' keys. Returns the cached tokens."""
    cached = handle.num_cached_tokens
    assert cached % BS == 0 and 0 <= cached <= len(prompt), (node, cached, len(prompt))
    if cached:
        blocks = list(handle.block_table.physical_blocks)[: cached // BS]
        got = read_blocks(full_client, blocks, cached)
        want = prompt_values(prompt[:cached])
        assert torch.equal(got, want), (
            f"node {node} served wrong K/V for a {cached}-token prefix hit of {prompt}: "
            f"{int((got != want).sum())} values differ"
        )
    return cached


def shard(kv: torch.Tensor, rank: int) -> torch.Tensor:
    """Rank ``rank``'s heads of ``[L, 2, n, H, D]``."""
    per = H // TP
    return kv[:, :, :, rank * per : (rank + 1) * per].contiguous()


def store_done(client) -> int:
    """Published blocks the store writer of ``client``'s node is done with (however)."""
    store = client.stats()["tiers"][-1]
    return sum(
        store.get(k, 0)
        for k in ("writes", "present", "cancelled", "discarded", "dropped", "errors")
    )


def wait_stopped(pid: int) -> None:
    """Until process ``pid`` is stopped (SIGSTOP delivered)."""
    proc = psutil.Process(pid)
    wait_for(lambda: proc.status() == psutil.STATUS_STOPPED, f"pid {pid} stopped")


def wait_for(cond, what: str, timeout: float = WAIT_S):
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what} not reached within {timeout} s"
        time.sleep(0.005)


class Seq:
    """The model of one sequence of node A: expected K/V and what each rank wrote."""

    def __init__(self, n: int):
        self.values = torch.zeros(L, 2, n, H, D)
        self.written = torch.zeros(TP, n, dtype=torch.bool)

    def grow(self, n: int) -> None:
        self.values = torch.cat([self.values, torch.zeros(L, 2, n, H, D)], dim=2)
        self.written = torch.cat([self.written, torch.zeros(TP, n, dtype=torch.bool)], dim=1)


class Shared:
    """What every example uses: the store, node B (in its own process) and its clients."""

    def __init__(self, server: RedisServer):
        self.server = server
        self.store = server.client()
        self.url = server.url
        self.cfg_b = shmkv.PoolConfig(
            num_layers=L,
            num_kv_heads=H,
            head_dim=D,
            num_blocks=NUM_BLOCKS_B,
            block_size=BS,
            dtype=torch.float32,
            tp_size=TP,
        )
        self.b = shmkv.Coordinator.spawn(
            self.cfg_b, name=f"prop-b-{uuid.uuid4().hex[:10]}", tiers=[self.tier()]
        )
        self.b0 = shmkv.connect(self.b.address, tp_rank=0, tp_size=TP, timeout=WAIT_S)
        self.b1 = shmkv.connect(self.b.address, tp_rank=1, tp_size=TP, timeout=WAIT_S)
        self.bf = shmkv.connect(self.b.address, timeout=WAIT_S)

    def tier(self) -> shmkv.RedisTier:
        return shmkv.RedisTier(self.url, timeout=5.0, max_backoff=0.2)

    def reset(self) -> None:
        """An empty store, and nothing cached in node B's pool (each example starts from
        the same state; B's process is kept, it takes seconds to start)."""
        self.store.flushall()
        self.bf.allocate(NUM_BLOCKS_B * BS).close()

    def close(self) -> None:
        for client in (self.b0, self.b1, self.bf):
            client.close()
        self.b.stop()
        self.store.close()


class TierStoreMachine(RuleBasedStateMachine):
    """Two nodes, two ranks each, tiers and a shared store; see the module docstring."""

    def __init__(self, shared: Shared):
        super().__init__()
        self.shared = shared
        shared.reset()
        self.cfg = shmkv.PoolConfig(
            num_layers=L,
            num_kv_heads=H,
            head_dim=D,
            num_blocks=NUM_BLOCKS_A,
            block_size=BS,
            dtype=torch.float32,
            tp_size=TP,
        )
        self.tier_dir = tempfile.mkdtemp(prefix="shmkv-prop-tiers-")
        self.kinds = None
        self.coord = None
        self.clients = ()
        self.handles = []  # live rank-0 handles of node A
        self.seqs = {}  # cache id -> Seq
        self.rank1_steps = []  # (rank 1's step, the cache ids it covers)
        self.prompts_seen = []
        self.next_tag = 0
        self.missing_before = set()  # keys cached in A's pool and on no tier, last check
        self.losses_before = 0

    # -- node A --------------------------------------------------------------------------

    def _start_a(self) -> None:
        tiers = []
        if "host" in self.kinds:
            tiers.append(shmkv.HostTier(HOST_SLOTS * self.cfg.block_nbytes))
        if "disk" in self.kinds:
            tiers.append(shmkv.DiskTier(self.tier_dir, 1 << 20))
        tiers.append(self.shared.tier())
        self.coord = shmkv.Coordinator(
            self.cfg, name=f"prop-a-{uuid.uuid4().hex[:10]}", tiers=tiers
        ).start()
        address = self.coord.address
        self.a0 = shmkv.connect(address, tp_rank=0, tp_size=TP, timeout=WAIT_S)
        self.a1 = shmkv.connect(address, tp_rank=1, tp_size=TP, timeout=WAIT_S)
        self.af = shmkv.connect(address, timeout=WAIT_S)
        self.clients = (self.a0, self.a1, self.af)
        self.missing_before, self.losses_before = set(), 0

    def _stop_a(self) -> None:
        for client in self.clients:
            client.close()
        self.clients = ()
        if self.coord is not None:
            self.coord.stop()
            self.coord = None
        self.handles, self.seqs, self.rank1_steps = [], {}, []

    def teardown(self) -> None:
        try:
            self._stop_a()
        finally:
            shutil.rmtree(self.tier_dir, ignore_errors=True)

    def _local_tiers(self):
        tiers = self.coord.tiers
        return getattr(tiers, "local", tiers)

    def _idle_a(self) -> None:
        """Every write-behind copy of A done (local tiers and store), the disk scanned."""

        def idle():
            io = self.af.stats()["tier_io"]
            return not (io["pending"] or io["scanning"] or io["promotions_in_flight"])

        wait_for(idle, "node A's tiers idle")
        assert self.coord.tiers.flush(WAIT_S), "node A's store writes did not drain"

    def _pick(self, picks: list) -> list:
        """Live handles of A chosen by ``picks`` (indexes taken modulo their number, so the
        draws never depend on what the run made)."""
        if not self.handles:
            return []
        return list(
            {id(h): h for h in (self.handles[i % len(self.handles)] for i in picks)}.values()
        )

    def _prompt(self, seen, new: list) -> list:
        """A prompt seen before when ``seen`` is an index (modulo their number), else new."""
        if seen is not None and self.prompts_seen:
            return list(self.prompts_seen[seen % len(self.prompts_seen)])
        return new

    def _tag(self) -> int:
        self.next_tag += 1
        return self.next_tag

    def _track(self, h, seq: Seq):
        self.handles.append(h)
        self.seqs[h.cache_id] = seq
        return h

    def _forget(self, h) -> None:
        self.handles.remove(h)
        del self.seqs[h.cache_id]

    def _write_step(self, step0, kv: torch.Tensor):
        """Rank 0 writes its shard of ``kv`` ``[L, 2, T, H, D]`` through its step; rank 1
        rebuilds the step from its descriptor and writes its own (kept for later)."""
        step0.write_all(shard(kv, 0))
        step1 = self.a1.step_from(step0.descriptor())
        step1.write_all(shard(kv, 1))
        ids = {shmkv.coordinator.sequences.format_cache_id(c) for c in step0.cache_ids.tolist()}
        self.rank1_steps = (self.rank1_steps + [(step1, ids)])[-4:]
        return step1

    @initialize(kinds=st.sampled_from(["host+disk", "host", "disk"]))
    def start(self, kinds):
        self.kinds = kinds
        self._start_a()

    @rule(
        prompt=st.lists(st.sampled_from(VOCAB), min_size=1, max_size=12),
        commit=st.sampled_from(["both", "both", "rank 0", "none"]),
        then=st.sampled_from(["keep", "close", "close without waiting"]),
        quiet=st.booleans(),
    )
    def prefill(self, prompt, commit, then, quiet):
        """What a TP engine does: rank 0 allocates the prompt (its prefix hit read back),
        rank 0 and rank 1 each write their heads of the rest, each commits its shard.
        Then the sequence is kept, or closed (waiting or not) and rank 1's step of it must
        refuse to write; ``quiet``: then the tiers are checked once idle."""
        try:
            h = self.a0.allocate(prompt=prompt)
        except shmkv.PoolExhausted:
            return
        cached = check_hit(self.af, h, prompt, "A")
        seq = Seq(len(prompt))
        self._track(h, seq)
        values = prompt_values(prompt)
        seq.values[:] = values
        seq.written[:, :cached] = True
        step0 = self.a0.batch([h]).prefill()
        assert step0.positions.tolist() == list(range(cached, len(prompt)))
        step1 = self._write_step(step0, values[:, :, cached:])
        seq.written[:, cached:] = True
        if len(prompt) >= BS:
            self.prompts_seen.append(list(prompt))
        if commit != "none":
            step0.commit()
        if commit == "both":
            step1.commit()
        if then != "keep":
            self._close([h], wait=then == "close")
            self.a0.flush()  # (served before this in any case)
            self._stale_steps_refuse()
        if quiet:
            self.quiet_then_every_cached_block_is_on_a_tier()

    @rule(picks=PICKS, count=st.integers(1, 3))
    def decode(self, picks, count):
        """A decode step over some of A's sequences: rank 0's batch extend, both ranks'
        writes (rank 1 through ``step_from``)."""
        hs = self._pick(picks)
        if not hs:
            return
        try:
            step0 = self.a0.batch(hs).extend(count)
        except (shmkv.PoolExhausted, shmkv.LimitExceeded):
            return
        tags = [self._tag() for _ in hs]
        kv = torch.cat([tag_values(t, count) for t in tags], dim=2)
        self._write_step(step0, kv)
        for h, t in zip(hs, tags):
            seq = self.seqs[h.cache_id]
            seq.grow(count)
            seq.values[:, :, -count:] = tag_values(t, count)
            seq.written[:, -count:] = True

    @rule(picks=PICKS, wait=st.booleans(), again=st.integers(0, 12))
    def close_and_reallocate(self, picks, wait, again):
        """``close_many`` (waiting or not) of some sequences, then at once (``again`` > 0)
        an allocation that may take their blocks; both ranks write it."""
        hs = self._pick(picks)
        if not hs:
            return
        self._close(hs, wait)
        if again:
            try:
                h = self.a0.allocate(again)
            except shmkv.PoolExhausted:
                self.a0.flush()
                return
            seq = Seq(again)
            self._track(h, seq)
            tag = self._tag()
            self._write_step(self.a0.batch([h]).prefill(), tag_values(tag, again))
            seq.values[:] = tag_values(tag, again)
            seq.written[:] = True
        self.a0.flush()
        self._stale_steps_refuse()

    def _close(self, hs: list, wait: bool) -> None:
        """Rank 0 closes ``hs`` in one ``close_many``. Once the release is served (rank 0
        waited for it, or sent a request since) rank 1's steps of them must refuse."""
        self.a0.close_many(hs, wait=wait)
        for h in hs:
            self._forget(h)

    def _stale_steps_refuse(self) -> None:
        """Rank 1 writes through every step it rebuilt earlier one of whose sequences rank
        0 has closed since (their blocks may belong to another sequence now): each is
        refused, with nothing written (the invariants read every live sequence back)."""
        live = set(self.seqs)
        for step1, ids in self.rank1_steps:
            if ids <= live or not step1.num_tokens:
                continue
            kv = torch.full((L, 2, step1.num_tokens, H // TP, D), -7.0)
            with pytest.raises((shmkv.StaleStep, shmkv.HandleClosed)):
                step1.write_all(kv)

    @rule()
    def demote(self):
        """Evict every cached block of A's pool (each lives on in a tier, or the store)."""
        self._idle_a()
        stats = self.af.stats()
        n = stats["free_blocks"] + stats["cached_blocks"]
        if n:
            self.af.allocate(n * BS).close()
        self._idle_a()

    @rule(seen=SEEN, new=PROMPT, demote_first=st.booleans())
    def promote(self, seen, new, demote_first):
        """A prompt seen before (or a new one), allocated on A: the hit comes from the
        pool, the local tiers and the store, and is read back in full."""
        prompt = self._prompt(seen, new)
        if demote_first:
            self.demote()
        try:
            h = self.af.allocate(prompt=prompt)
        except shmkv.PoolExhausted:
            return
        try:
            check_hit(self.af, h, prompt, "A")
        finally:
            h.close()

    @rule()
    def restart(self):
        """Stop A (its handles go), start a new coordinator on the same directory."""
        self._idle_a()
        self._stop_a()
        self._start_a()

    @rule(pick=st.integers(0, 1 << 16), where=st.floats(0, 1))
    def damage_a_file(self, pick, where):
        """Flip a byte of one block file on A's disk (header or payload): never served."""
        if "disk" not in self.kinds:
            return
        self._idle_a()
        folder = os.path.join(self.tier_dir, "blocks")
        names = sorted(n for n in os.listdir(folder) if n.endswith(".kv"))
        if not names:
            return
        path = os.path.join(folder, names[pick % len(names)])
        with open(path, "r+b") as f:
            offset = int(where * max(0, os.fstat(f.fileno()).st_size - 1))
            f.seek(offset)
            byte = f.read(1)
            f.seek(offset)
            f.write(bytes([byte[0] ^ 0x10]) if byte else b"\0")

    # -- node B and the store -----------------------------------------------------------

    @rule(seen=SEEN, new=PROMPT)
    def read_on_b(self, seen, new):
        """A prompt allocated on node B: what it hits (its pool or the store) is read back."""
        prompt = self._prompt(seen, new)
        self.coord.tiers.flush(WAIT_S)
        b = self.shared
        try:
            h = b.bf.allocate(prompt=prompt)
        except shmkv.PoolExhausted:
            return
        try:
            check_hit(b.bf, h, prompt, "B")
        finally:
            h.close()

    @rule(prompt=PROMPT)
    def burst_on_b(self, prompt):
        """On B: rank 0 allocates and writes a prompt and commits; rank 1 writes its shard.
        Then, in one loop turn of B: rank 1's commit (which publishes), the release
        (``close_many(wait=False)``) and an allocation of the whole pool, which evicts the
        just-published blocks and takes them, its K/V written at once. The store must end
        up holding the prompt's bytes under its keys, or nothing."""
        b = self.shared
        try:
            h = b.b0.allocate(prompt=prompt)
        except shmkv.PoolExhausted:
            return
        cached = check_hit(b.bf, h, prompt, "B")
        keys = hashing.block_keys(prompt, BS, hashing.root_key())
        if cached == len(keys) * BS:  # nothing new to publish
            b.b0.close_many([h])
            return
        step0 = b.b0.batch([h]).prefill()
        values = prompt_values(prompt)[:, :, cached:]
        step0.write_all(shard(values, 0))
        step1 = b.b1.step_from(step0.descriptor())
        step1.write_all(shard(values, 1))
        step0.commit()  # rank 0: nothing published yet
        done_before = store_done(b.b0)
        stats = b.b0.stats()
        fill_tokens = (
            stats["num_blocks"] - stats["referenced_blocks"] + len(h.block_table.physical_blocks)
        ) * BS
        results = {}

        tag = self._tag()

        def rank1_commits():
            try:
                results["published"] = step1.commit()
            except BaseException as exc:  # noqa: BLE001 (raised below, in the test's thread)
                results["error"] = exc

        def rank0_releases_and_reallocates():
            try:
                b.b0.close_many([h], wait=False)
                fill = results["fill"] = b.b0.allocate(fill_tokens)
                fill.write_all(shard(tag_values(tag, fill_tokens), 0))  # at once
            except BaseException as exc:  # noqa: BLE001 (raised below)
                results["error"] = exc

        # Rank 1's connection served last: a level-triggered epoll lists the connection it
        # reported last first, so once B runs again rank 1's commit is read before rank 0's
        # release (which would otherwise close the sequence it commits). The store stays
        # stopped until the new owner has written its K/V: a copy the store writer makes
        # of those blocks then holds the new owner's bytes, whenever the writer runs (it
        # waits on the store, within the tier's timeout).
        b.b1.ping()
        store_pid = b.server.proc.pid
        threads = []
        try:
            for pid in (b.b.pid, store_pid):
                os.kill(pid, signal.SIGSTOP)
                wait_stopped(pid)
            for target in (rank1_commits, rank0_releases_and_reallocates):
                thread = threading.Thread(target=target, daemon=True)
                thread.start()
                threads.append(thread)
                time.sleep(0.05)  # (only orders the two sends: rank 1's commit first)
        finally:
            os.kill(b.b.pid, signal.SIGCONT)  # node B serves the three in one turn
            for thread in threads:
                thread.join(WAIT_S)
            os.kill(store_pid, signal.SIGCONT)  # and the store answers B's writer now
            for handle in (h, results.get("fill")):
                if handle is not None:
                    handle.close()  # (idempotent: h was closed by close_many already)
        assert not any(t.is_alive() for t in threads), "node B did not answer"
        if "error" in results:
            raise results["error"]
        if not results.get("published"):
            return  # refused or nothing published: nothing to check
        wait_for(
            lambda: store_done(b.b0) >= done_before + results["published"], "node B's store writes"
        )
        self.audit_store()

    @rule()
    def audit_store(self):
        """Every value in the store holds, under a prefix key, that key's K/V."""
        if self.coord is not None:
            assert self.coord.tiers.flush(WAIT_S), "node A's store writes did not drain"
        b = self.shared
        names = b.store.keys("shmkv:*")
        values = b.store.mget(names) if names else []
        for name, value in zip(names, values):
            if value is None:
                continue  # expired or deleted meanwhile
            key = bytes.fromhex(name.decode().rsplit(":", 1)[1])
            payload = torch.frombuffer(bytearray(value[HEADER_SIZE:]), dtype=torch.float32)
            want = block_values(key).reshape(-1)
            assert payload.shape == want.shape and torch.equal(payload, want), (
                f"the store holds other K/V than its prefix key's under {name.decode()}: "
                f"{int((payload != want).sum()) if payload.shape == want.shape else 'size'}"
                " values differ"
            )

    # -- checks --------------------------------------------------------------------------

    @rule()
    def quiet_then_every_cached_block_is_on_a_tier(self):
        """After a quiet period, every block cached in A's pool is on a local tier (it was
        copied down when it became cached), unless a tier counted a block it dropped or
        failed to write since the last check."""
        self._idle_a()
        local = self._local_tiers()
        pool = self.coord.table.pool
        cached = [pool.block_key[b] for b in list(pool._cached)]
        missing = {k for k in cached if k is not None and local.lookup([k]) == 0}
        losses = 0  # whatever a tier counts as a block it let go or could not keep
        for t in local.stats():
            losses += sum(t.get(name, 0) for name in LOSS_COUNTERS)
        new = missing - self.missing_before
        assert len(new) <= losses - self.losses_before, (
            f"{len(new)} blocks cached in node A's pool since the last check reached no "
            f"tier ({self.kinds}), and the tiers counted {losses - self.losses_before} "
            f"dropped or failed blocks"
        )
        self.missing_before, self.losses_before = missing, losses

    @invariant()
    def tables_consistent(self):
        if self.coord is None:
            return
        self.a0.flush()  # a release sent without waiting is served first
        table = self.coord.table
        table.check_invariants()
        live = {shmkv.coordinator.sequences.format_cache_id(c) for c in table.live()}
        assert live == set(self.seqs)

    @invariant()
    def contents_match(self):
        for h in self.handles:
            seq = self.seqs[h.cache_id]
            n = seq.written.shape[1]
            assert h.num_tokens == n
            got = read_blocks(self.af, list(h.block_table.physical_blocks), n)
            for rank in range(TP):
                mask = seq.written[rank]
                assert torch.equal(
                    shard(got, rank)[:, :, mask], shard(seq.values, rank)[:, :, mask]
                ), (h, rank)


@pytest.fixture
def redis_server():
    if SERVER is None:
        pytest.skip("no redis-server on PATH: ./scripts/setup.sh test installs it")
    directory = tempfile.mkdtemp(prefix="shmkv-redis-")
    server = None
    try:
        for attempt in range(3):  # a free port can be taken between the probe and the bind
            server = RedisServer(_free_port(), directory)
            try:
                server.start()
                break
            except RuntimeError:
                if attempt == 2:
                    raise
        yield server
    finally:
        if server is not None:
            server.kill()
        shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.timeout(900)
def test_tiers_and_the_store_serve_only_what_was_written(redis_server):
    shared = Shared(redis_server)
    try:
        run_state_machine_as_test(
            lambda: TierStoreMachine(shared),
            settings=settings(
                max_examples=EXAMPLES,
                stateful_step_count=25,
                deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
            ),
        )
    finally:
        shared.close()
